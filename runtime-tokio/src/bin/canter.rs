//! `canter`: run workers, enqueue tasks and inspect the queue from the command line.
//!
//! Exit codes: 0 success, 1 failure, 2 usage.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use canter_tokio::canter::config::{Config, RetryPolicy};
use canter_tokio::canter::postgres::{CheckReport, MIGRATE_LOCK_WAIT, PgStore, SchemaStatus, enqueue_many_in};
use canter_tokio::canter::schedule::ParsedSchedule;
use canter_tokio::canter::scheduler::{Plan, ScheduleRecord};
use canter_tokio::canter::store::{
    AdminReply, AdminRequest, Cancelled, DEFAULT_PURGE_BATCH, DbTime, FAILED_BY_OPERATOR_MESSAGE, KeyMode, KeyRemoval,
    NewTask, Reschedule, RunAt, TaskFilter, TaskRecord,
};
use canter_tokio::cli::{self, Args, UsageError, parse_duration, printable};
use canter_tokio::{Client, PgSchema, Scheduler, TaskId, TaskState, TokioRuntime, Worker, WorkerId, builtins};
use canter_tokio::{errln, outln};
use serde_json::Value;
use sqlx::PgPool;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;

const HELP: &str = "\
canter: a PostgreSQL task queue

usage: canter <command> [options]

commands:
  migrate     create or upgrade the schema
  worker      run a worker serving the built-in tasks
  enqueue     enqueue tasks and print their ids
  status      counts by queue and status, and live workers
  list        list tasks
  show        show one task and its attempts
  result      print a task's result, optionally waiting for it
  cancel      cancel a pending or claimed task
  retry       put a failed task back to pending
  reschedule  change a pending task's run-at, priority or retries spent
  complete    complete a pending, claimed or running task by hand
  fail        fail a pending, claimed or running task by hand
  force-unlock  put the claimed and running tasks of dead workers back to pending
  remove-key  free an idempotency key (cancelling its task if pending)
  purge       delete finished tasks older than a retention period
  pause       stop workers from claiming a queue's pending tasks
  resume      let workers claim a paused queue's tasks again
  scheduler   enqueue the ticks of the configured schedules (--once, --dry-run, --list)
  schedules   each schedule's last and next tick
  demo        run the demo: a mixed load through several workers
  bench       measure throughput, latency and memory against a raw-SQL baseline

every command takes --database-url URL (or DATABASE_URL) and --schema NAME (default canter);
`canter <command> --help` says more.";

const COMMON: &[&str] = &["database-url", "schema"];

enum Failure {
    Usage(String),
    Failed(String),
}

impl From<UsageError> for Failure {
    fn from(error: UsageError) -> Self {
        Failure::Usage(error.0)
    }
}

type Outcome = Result<(), Failure>;

/// A failure whose message may carry names and errors from the data: one line, with its
/// control characters escaped.
fn failed(message: impl std::fmt::Display) -> Failure {
    Failure::Failed(printable(&message.to_string()).to_string())
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let Some(command) = raw.first().cloned() else {
        errln!("{HELP}");
        return ExitCode::from(2);
    };
    if matches!(command.as_str(), "help" | "--help" | "-h") {
        outln!("{HELP}");
        return ExitCode::SUCCESS;
    }
    let rest = &raw[1..];
    let help = command_help(&command);
    if help.is_none() {
        errln!("unknown command {command:?}\n\n{HELP}");
        return ExitCode::from(2);
    }
    if rest.iter().any(|a| a == "--help" || a == "-h") {
        outln!("{}", help.unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    // The demo prints its own progress: only warnings from the workers.
    init_logging(if command == "demo" { LevelFilter::WARN } else { LevelFilter::INFO });
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            errln!("cannot start the runtime: {error}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(&command, rest)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            errln!("canter {command}: {message}\n\n{}", help.unwrap_or_default());
            ExitCode::from(2)
        }
        Err(Failure::Failed(message)) => {
            errln!("canter {command}: {message}");
            ExitCode::from(1)
        }
    }
}

/// Logs to stderr as `CANTER_LOG` says (see [`log_filter`]); `default` when it is unset, and,
/// said so, when it cannot be read. Colours only on a terminal.
fn init_logging(default: LevelFilter) {
    let value = std::env::var("CANTER_LOG").unwrap_or_default();
    let (filter, max) = log_filter(&value, default).unwrap_or_else(|| {
        errln!("canter: CANTER_LOG={value:?} is neither a level nor target=level directives; logging at {default}");
        (Targets::new().with_default(default), default)
    });
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(max)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        // A log that cannot be written is dropped: by default the subscriber reports it with
        // `eprintln!`, which panics when stderr is gone, inside whatever task logged (a worker's
        // loop, whose process then hangs).
        .log_internal_errors(false)
        .finish()
        .with(filter);
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// Reads log directives: comma-separated levels (error, warn, info, debug, trace, off) and
/// `target=level` pairs (`canter::db=trace,info`); targets without a pair of their own log at
/// the bare level, else at `default`. Returns the filter and the most verbose level it lets
/// through, or `None` when a part is neither (a misspelt level must not silence every log).
fn log_filter(directives: &str, default: LevelFilter) -> Option<(Targets, LevelFilter)> {
    let mut targets = Targets::new();
    let (mut fallback, mut max) = (None, LevelFilter::OFF);
    for part in directives.split(',').map(str::trim).filter(|part| !part.is_empty()) {
        match part.split_once('=') {
            Some((target, level)) => {
                let (target, level) = (target.trim(), level.trim().parse::<LevelFilter>().ok()?);
                if target.is_empty() {
                    return None;
                }
                targets = targets.with_target(target.to_owned(), level);
                max = max.max(level);
            }
            None => fallback = Some(part.parse::<LevelFilter>().ok()?),
        }
    }
    let fallback = fallback.unwrap_or(default);
    Some((targets.with_default(fallback), max.max(fallback)))
}

fn command_help(command: &str) -> Option<&'static str> {
    Some(match command {
        "migrate" => {
            "usage: canter migrate [--database-url URL] [--schema NAME]\n\n\
             applies the migrations the schema lacks (creating it if needed) and prints its version.\n\
             needs CREATE on the schema (and on the database to create the schema); workers then\n\
             start with only read and write rights (canter worker --no-migrate)."
        }
        "worker" => {
            "usage: canter worker [--config FILE] [--database-url URL] [--schema NAME] [--no-migrate] [--<setting> VALUE]...\n\n\
             serves the built-in tasks (noop, sleep, fail, panic, echo, cpu) until SIGINT or SIGTERM.\n\
             at startup it applies the migrations the schema lacks (a current schema is only read);\n\
             --no-migrate only checks the schema's version and refuses to start if it lacks any.\n\
             every AppConfig and WorkerConfig setting can be given as a flag named after it, e.g.\n\
             --concurrency 16 --queues default,emails --prefetch-buffer 4 --claim-lease-ms 30000\n\
             --deployment-mode PollingOnly --check-interval-ms 5000 --custom-queues '[{\"name\":\"a\"}]'\n\
             --queue-mode custom; flags override the file."
        }
        "enqueue" => {
            "usage: canter enqueue TASK [--args JSON] [--queue Q] [--priority N] [--delay D | --run-at T]\n\
             \x20                     [--good-until T] [--max-retries N] [--key K [--key-mode M]] [--flags F,G]\n\
             \x20                     [--count N] [--force]\n\n\
             D is a duration (500ms, 10s, 2m); T is a duration from now or an RFC 3339 UTC time\n\
             (2026-11-22T10:00:00Z). M is replace (default: a waiting task with the key is updated),\n\
             preserve_run_at, unsafe_dedupe or idempotent. --count N enqueues N copies in one\n\
             transaction: all of them or none. --force enqueues a task name the built-in worker does\n\
             not serve."
        }
        "status" => "usage: canter status [--json]\n\ncounts by queue and state, paused queues, live workers.",
        "list" => "usage: canter list [--status S] [--queue Q] [--limit N] [--json]",
        "show" => "usage: canter show ID [--json]",
        "result" => "usage: canter result ID [--wait D]",
        "cancel" => "usage: canter cancel ID",
        "retry" => "usage: canter retry ID",
        "reschedule" => {
            "usage: canter reschedule ID [--now | --run-at T] [--priority N] [--retries N]\n\n\
             changes a pending task: --now makes it due at once, --run-at T at T (a duration from now,\n\
             10m, or an RFC 3339 UTC time, 2026-11-22T10:00:00Z; not at or past its good-until);\n\
             --priority sets its priority (lower runs first); --retries sets the retries it has spent\n\
             (0 gives it its whole retry budget again). its queue is notified."
        }
        "complete" => {
            "usage: canter complete ID [--result JSON]\n\n\
             completes a pending, claimed or running task with JSON (default null); a worker still\n\
             running it has its result discarded. waiters are woken."
        }
        "fail" => {
            "usage: canter fail ID [--message TEXT]\n\n\
             fails a pending, claimed or running task for good with code FAILED_BY_OPERATOR; a\n\
             worker still running it has its result discarded. waiters are woken."
        }
        "force-unlock" => {
            "usage: canter force-unlock WORKER... [--json]\n\n\
             puts every claimed or running task of these dead workers back to pending, claimable at\n\
             once, without spending a retry, and marks the workers stopped; prints how many tasks.\n\
             only for workers that are gone: a live one would see its tasks run twice."
        }
        "remove-key" => {
            "usage: canter remove-key KEY [--json]\n\n\
             frees an idempotency key: a pending task holding it is cancelled, a claimed or running\n\
             one runs on without it, a finished one just loses it."
        }
        "purge" => {
            "usage: canter purge --older-than D [--idempotency-retention E] [--batch N] [--json]\n\n\
             deletes finished tasks (with their attempts and keys) that finished more than D ago\n\
             (e.g. 30d, 12h), N per statement (default 1000) so no lock is held long; prints how many.\n\
             a task holding an idempotency key stays until the key is E old (default: forever), so an\n\
             idempotent enqueue of it still gives its id instead of running it again."
        }
        "pause" => {
            "usage: canter pause QUEUE [--json]\n\n\
             stops every worker from claiming the queue's pending tasks; claimed and running ones go on."
        }
        "resume" => "usage: canter resume QUEUE [--json]\n\nlets workers claim a paused queue's tasks again.",
        "scheduler" => {
            "usage: canter scheduler --config FILE [--database-url URL] [--schema NAME] [--no-migrate]\n\
             \x20                       [--once | --dry-run | --list [--json]]\n\n\
             enqueues the ticks of the file's [[app.schedules]] until SIGINT or SIGTERM: each tick once,\n\
             however many schedulers and workers with worker.run_scheduler run (at startup it applies\n\
             the migrations the schema lacks; --no-migrate only checks the schema's version).\n\
             --once checks once and prints what it enqueued; --dry-run prints what a check would\n\
             enqueue and writes nothing; --list prints each schedule's last and next tick."
        }
        "schedules" => {
            "usage: canter schedules [--config FILE] [--json]\n\n\
             each schedule's kind, zone, last tick, next tick, runs and last task: the file's\n\
             schedules, then recorded schedules the file does not configure."
        }
        "demo" => "usage: canter demo [--tasks N] [--workers W] [--concurrency C] [--database-url URL]",
        "bench" => canter_tokio::bench::HELP,
        _ => return None,
    })
}

async fn run(command: &str, raw: &[String]) -> Outcome {
    match command {
        "migrate" => {
            let args = Args::parse(raw, COMMON, &[], false)?;
            let client = client(&args, Default::default())?;
            let store = client.store();
            let status = with_retry("migrate", || {
                canter_tokio::canter::postgres::migrate_within(store.pool(), store.schema(), MIGRATE_LOCK_WAIT)
            })
            .await?;
            let name = store.schema().name();
            match status {
                SchemaStatus::Ahead { version, code_version } => outln!(
                    "schema {name} is at version {version}, newer than this binary's {code_version}, which it accepts"
                ),
                status => outln!("schema {name} is up to date (version {})", status.version().unwrap_or(0)),
            }
            Ok(())
        }
        "worker" => worker(raw).await,
        "enqueue" => enqueue(raw).await,
        "status" => status(raw).await,
        "list" => list(raw).await,
        "show" => show(raw).await,
        "result" => result(raw).await,
        "cancel" | "retry" | "reschedule" | "complete" | "fail" | "force-unlock" | "remove-key" | "purge" | "pause"
        | "resume" => admin(command, raw).await,
        "scheduler" => scheduler(raw, false).await,
        "schedules" => scheduler(raw, true).await,
        "demo" => canter_tokio::demo::run(raw).await.map_err(|e| match e {
            canter_tokio::demo::DemoError::Usage(m) => Failure::Usage(m),
            canter_tokio::demo::DemoError::Failed(m) => Failure::Failed(m),
            // As `outln!` does, once the demo has cleaned up.
            canter_tokio::demo::DemoError::OutputClosed => cli::exit_output_closed(),
        }),
        "bench" => canter_tokio::bench::run(raw).await.map_err(|e| e.split().map_or_else(failed, Failure::Usage)),
        _ => Err(Failure::Usage(format!("unknown command {command:?}"))),
    }
}

fn database_url(args: &Args) -> Result<String, Failure> {
    args.value("database-url")
        .map(str::to_owned)
        .or_else(|| std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()))
        .ok_or_else(|| Failure::Usage("no database: pass --database-url URL or set DATABASE_URL".into()))
}

fn schema(args: &Args) -> Result<PgSchema, Failure> {
    match args.value("schema") {
        Some(name) => PgSchema::new(name).map_err(|e| Failure::Usage(e.to_string())),
        None => Ok(PgSchema::default()),
    }
}

fn pool(args: &Args, size: u32) -> Result<PgPool, Failure> {
    let url = database_url(args)?;
    canter_tokio::connect(&url, size).map_err(|e| Failure::Usage(format!("invalid database url: {e}")))
}

fn client(args: &Args, app: canter_tokio::AppConfig) -> Result<Client, Failure> {
    Ok(Client::new(Arc::new(TokioRuntime), pool(args, 4)?, schema(args)?, app))
}

/// Runs `op`, retrying with backoff while the database is unreachable, and says so.
async fn with_retry<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    what: &str,
    mut op: impl FnMut() -> F,
) -> Result<T, Failure> {
    // CANTER_CONNECT_ATTEMPTS bounds the tries (default 6, about 15 s of backoff).
    let attempts: u32 = std::env::var("CANTER_CONNECT_ATTEMPTS").ok().and_then(|a| a.parse().ok()).unwrap_or(6).max(1);
    let mut delay = Duration::from_millis(500);
    for attempt in 1..=attempts {
        match op().await {
            Ok(value) => return Ok(value),
            Err(error) => {
                let text = error.to_string();
                let unreachable = ["connect", "refused", "timed out", "pool", "closed", "io error", "dns"]
                    .iter()
                    .any(|w| text.to_lowercase().contains(w));
                if !unreachable || attempt == attempts {
                    return Err(failed(format!("{what} failed: {text}")));
                }
                errln!(
                    "database unreachable ({}); retrying in {delay:?} ({attempt}/{})",
                    printable(&text),
                    attempts - 1
                );
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(8));
            }
        }
    }
    Err(failed(format!("{what} failed")))
}

/// The config from `--config FILE` (or defaults) with every other flag laid over it.
fn worker_config(args: &Args) -> Result<Config, Failure> {
    let base = match args.value("config") {
        Some(path) => canter_tokio::canter::driver::read_config(std::path::Path::new(path))
            .map_err(|e| Failure::Usage(e.to_string()))?,
        None => Config::default(),
    };
    Ok(cli::config_with_flags(&base, &args.values, &["config", "database-url", "schema"])?)
}

async fn worker(raw: &[String]) -> Outcome {
    let args = Args::parse(raw, &["config", "database-url", "schema"], &["no-migrate"], true)?;
    let config = worker_config(&args)?;
    let size = config.worker.pool_size();
    let registry = Arc::new(builtins::registry());
    let worker = Worker::new(pool(&args, size)?, config.app, config.worker, registry)
        .map_err(|e| Failure::Usage(e.to_string()))?
        .schema(schema(&args)?)
        .migrate(!args.switch("no-migrate"));
    cli::note_line(format_args!(
        "worker {} starting; stop it with Ctrl-C or SIGTERM",
        printable(&worker.worker_id().0)
    ));
    let stats = worker.run().await.map_err(failed)?;
    cli::note_line(format_args!(
        "worker stopped: claimed {}, completed {}, failed {}, retried {}, lost {}",
        stats.claimed, stats.completed, stats.failed, stats.retried, stats.lost
    ));
    Ok(())
}

/// An absolute database time from a duration from now or an RFC 3339 UTC timestamp.
fn db_time(text: &str, now: DbTime) -> Result<DbTime, UsageError> {
    if cli::is_duration(text) {
        // A duration too long to store is refused as such.
        return Ok(now.plus_ms(millis(parse_duration(text)?)));
    }
    parse_rfc3339(text)
        .ok_or_else(|| UsageError(format!("invalid time {text:?}: expected a duration (10m) or 2026-11-22T10:00:00Z")))
}

/// A duration in whole milliseconds (saturating; `parse_duration` keeps them far below).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.fff]Z`.
fn parse_rfc3339(text: &str) -> Option<DbTime> {
    let text = text.strip_suffix('Z').or_else(|| text.strip_suffix("+00:00"))?;
    let (date, time) = text.split_once(['T', ' '])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    if fraction.is_empty() || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let millis: i64 = format!("{fraction:0<3}")[..3].parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(DbTime(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + millis))
}

async fn enqueue(raw: &[String]) -> Outcome {
    let values = [
        "database-url",
        "schema",
        "args",
        "queue",
        "priority",
        "delay",
        "run-at",
        "good-until",
        "max-retries",
        "key",
        "key-mode",
        "flags",
        "count",
    ];
    let args = Args::parse(raw, &values, &["force"], false)?;
    let [task] = args.positional.as_slice() else {
        return Err(Failure::Usage("expected exactly one TASK name".into()));
    };
    if !builtins::NAMES.contains(&task.as_str()) && !args.switch("force") {
        return Err(Failure::Usage(format!(
            "unknown task name {task:?}: the canter worker serves {}; pass --force to enqueue it anyway",
            builtins::NAMES.join(", ")
        )));
    }
    let task_args: Value = match args.value("args") {
        Some(text) => {
            serde_json::from_str(text).map_err(|e| Failure::Usage(format!("--args is not valid JSON: {e}")))?
        }
        None => Value::Object(Default::default()),
    };
    if args.value("delay").is_some() && args.value("run-at").is_some() {
        return Err(Failure::Usage("give --delay or --run-at, not both".into()));
    }
    let count: usize = args.parsed("count")?.unwrap_or(1);
    if count == 0 || count > 1_000_000 {
        return Err(Failure::Usage("--count must be 1 to 1000000".into()));
    }
    let mut app = canter_tokio::AppConfig::default();
    if let Some(queue) = args.value("queue").filter(|q| *q != "default") {
        // The command line enqueues into any queue name a worker may be configured with.
        app.queue_mode = canter_tokio::QueueMode::Custom;
        app.custom_queues = vec![canter_tokio::CustomQueue::new(queue)];
    }
    let client = client(&args, app)?;
    let now = if args.value("run-at").is_some() || args.value("good-until").is_some() {
        with_retry("read the database clock", || client.store().now()).await?
    } else {
        DbTime(0)
    };
    let mut template = NewTask::new(task.clone(), task_args);
    if let Some(queue) = args.value("queue") {
        template = template.queue(queue);
    }
    if let Some(priority) = args.parsed::<i16>("priority")? {
        template = template.priority(priority);
    }
    if let Some(delay) = args.value("delay") {
        template = template.run_at(RunAt::DelayMs(millis(parse_duration(delay)?)));
    }
    if let Some(at) = args.value("run-at") {
        template = template.run_at(RunAt::At(db_time(at, now)?));
    }
    if let Some(until) = args.value("good-until") {
        template = template.good_until(db_time(until, now)?);
    }
    if let Some(retries) = args.parsed::<u32>("max-retries")? {
        template = template.retry(RetryPolicy::exponential(1, retries));
    }
    if let Some(key) = args.value("key") {
        if count > 1 {
            return Err(Failure::Usage("--key names one task: it cannot go with --count".into()));
        }
        let mode = match args.value("key-mode") {
            Some(name) => KeyMode::parse(name).ok_or_else(|| {
                Failure::Usage(format!(
                    "invalid --key-mode {name:?}: expected replace, preserve_run_at, unsafe_dedupe or idempotent"
                ))
            })?,
            None => KeyMode::Replace,
        };
        template = template.key_with_mode(key, mode);
    } else if args.value("key-mode").is_some() {
        return Err(Failure::Usage("--key-mode needs --key".into()));
    }
    if let Some(flags) = args.value("flags") {
        for flag in flags.split(',').filter(|f| !f.is_empty()) {
            template = template.flag(flag);
        }
    }
    // Retried: the read-only probe. Not retried: the write, whose commit a lost connection
    // could hide (a retry would enqueue twice).
    with_retry("reach the database", || client.store().now()).await?;
    let ids = enqueue_all(client.store(), &template, count).await?;
    for id in ids {
        outln!("{id}");
    }
    Ok(())
}

/// Enqueues `count` copies of `template` all or nothing: one transaction of statements of
/// 1,000 tasks (the memory of a million tasks at once is not needed). A failure says what was
/// committed: nothing, or, when the commit itself got no answer, all or nothing.
async fn enqueue_all(store: &PgStore, template: &NewTask, count: usize) -> Result<Vec<TaskId>, Failure> {
    const CHUNK: usize = 1_000;
    let nothing = |e: &dyn std::fmt::Display| failed(format!("enqueue failed: {e}; nothing was enqueued"));
    let mut tx = store.pool().begin().await.map_err(|e| nothing(&e))?;
    let mut ids = Vec::with_capacity(count);
    while ids.len() < count {
        let batch = vec![template.clone(); (count - ids.len()).min(CHUNK)];
        // On an error the transaction is dropped, which rolls back what it wrote.
        ids.extend(enqueue_many_in(&mut *tx, store.schema(), store.app(), batch).await.map_err(|e| nothing(&e))?);
    }
    tx.commit().await.map_err(|e| {
        failed(format!(
            "enqueue failed at commit: {e}; either all {count} tasks were enqueued or none (see canter list)"
        ))
    })?;
    Ok(ids)
}

async fn status(raw: &[String]) -> Outcome {
    let args = Args::parse(raw, COMMON, &["json"], false)?;
    let client = client(&args, Default::default())?;
    let counts = with_retry("read counts", || client.counts()).await?;
    let workers = with_retry("read workers", || client.workers()).await?;
    let paused = with_retry("read paused queues", || client.paused_queues()).await?;
    if args.switch("json") {
        let counts: Vec<Value> = counts
            .iter()
            .map(|((queue, state), n)| serde_json::json!({"queue": queue, "state": state, "count": n}))
            .collect();
        let workers: Vec<Value> = workers
            .iter()
            .map(|w| serde_json::json!({"id": w.info.worker, "queues": w.info.queues, "concurrency": w.info.concurrency, "last_seen_ms": w.last_seen.0, "stopped": w.stopped}))
            .collect();
        outln!("{}", serde_json::json!({"counts": counts, "workers": workers, "paused": paused}));
        return Ok(());
    }
    let mut by_queue: BTreeMap<&str, BTreeMap<TaskState, u64>> = BTreeMap::new();
    for ((queue, state), n) in &counts {
        by_queue.entry(queue).or_default().insert(*state, *n);
    }
    outln!(
        "{:<20} {:>9} {:>9} {:>9} {:>10} {:>9} {:>10} {:>9}",
        "QUEUE",
        "PENDING",
        "CLAIMED",
        "RUNNING",
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "EXPIRED"
    );
    for (queue, states) in &by_queue {
        let n = |s| states.get(&s).copied().unwrap_or(0);
        outln!(
            "{:<20} {:>9} {:>9} {:>9} {:>10} {:>9} {:>10} {:>9}",
            printable(queue),
            n(TaskState::Pending),
            n(TaskState::Claimed),
            n(TaskState::Running),
            n(TaskState::Completed),
            n(TaskState::Failed),
            n(TaskState::Cancelled),
            n(TaskState::Expired)
        );
    }
    if by_queue.is_empty() {
        outln!("(no tasks)");
    }
    if !paused.is_empty() {
        let names: Vec<String> = paused.iter().map(|p| printable(&p.queue).to_string()).collect();
        outln!("\npaused queues: {}", names.join(", "));
    }
    let live: Vec<_> = workers.iter().filter(|w| !w.stopped).collect();
    outln!("\n{} live workers", live.len());
    for w in live {
        outln!(
            "  {}  queues {}  concurrency {}",
            printable(&w.info.worker.0),
            printable(&w.info.queues.join(",")),
            w.info.concurrency
        );
    }
    Ok(())
}

fn print_record(record: &TaskRecord) {
    outln!(
        "{:<8} {:<10} {:<12} {:<12} attempts {} retries {}",
        record.id,
        record.state,
        printable(&record.queue),
        printable(&record.name),
        record.attempts,
        record.retries
    );
}

async fn list(raw: &[String]) -> Outcome {
    let args = Args::parse(raw, &["database-url", "schema", "status", "queue", "limit"], &["json"], false)?;
    let state =
        args.value("status").map(|s| s.parse::<TaskState>().map_err(|e| Failure::Usage(e.to_string()))).transpose()?;
    let filter = TaskFilter {
        queue: args.value("queue").map(str::to_owned),
        state,
        limit: Some(args.parsed::<usize>("limit")?.unwrap_or(50)),
    };
    let client = client(&args, Default::default())?;
    let records = with_retry("list tasks", || client.list(&filter)).await?;
    if args.switch("json") {
        outln!("{}", serde_json::to_string(&records).map_err(failed)?);
    } else {
        for record in &records {
            print_record(record);
        }
    }
    Ok(())
}

fn task_id(args: &Args) -> Result<TaskId, Failure> {
    match args.positional.as_slice() {
        [id] => id
            .parse::<i64>()
            .map(TaskId)
            .map_err(|_| Failure::Usage(format!("invalid task id {id:?}: expected a number"))),
        _ => Err(Failure::Usage("expected exactly one task ID".into())),
    }
}

async fn show(raw: &[String]) -> Outcome {
    let args = Args::parse(raw, COMMON, &["json"], false)?;
    let id = task_id(&args)?;
    let client = client(&args, Default::default())?;
    let record =
        with_retry("read the task", || client.get(id)).await?.ok_or_else(|| failed(format!("no task {id}")))?;
    let attempts = with_retry("read attempts", || client.attempts(id)).await?;
    if args.switch("json") {
        outln!("{}", serde_json::json!({"task": record, "attempts": attempts}));
        return Ok(());
    }
    outln!("{}", serde_json::to_string_pretty(&record).map_err(failed)?);
    for attempt in attempts {
        let worker = attempt.worker.map_or_else(|| "-".to_owned(), |w| printable(&w.0).to_string());
        outln!("attempt {} by {worker}: {}", attempt.attempt, attempt.outcome);
    }
    Ok(())
}

async fn result(raw: &[String]) -> Outcome {
    let args = Args::parse(raw, &["database-url", "schema", "wait"], &[], false)?;
    let id = task_id(&args)?;
    let client = client(&args, Default::default())?;
    let record = match args.value("wait") {
        Some(wait) => {
            client.wait(id, parse_duration(wait)?).await.map_err(|e| failed(format!("{} ({})", e, e.code())))?
        }
        None => with_retry("read the task", || client.get(id)).await?.ok_or_else(|| failed(format!("no task {id}")))?,
    };
    match record.state {
        TaskState::Completed => {
            outln!("{}", record.result.unwrap_or(Value::Null));
            Ok(())
        }
        state if state.is_terminal() => {
            let error = record.error.map(|e| format!("{e}")).unwrap_or_default();
            Err(failed(format!("task {id} is {state}: {error}")))
        }
        state => Err(failed(format!("task {id} is {state}: no result yet (use --wait)"))),
    }
}

/// The operator commands: each parses its arguments into one [`AdminRequest`] (and the app
/// settings the action reads), which [`admin`] sends and whose reply it prints.
type Action = (Args, AdminRequest, canter_tokio::AppConfig);

async fn admin(command: &str, raw: &[String]) -> Outcome {
    let (args, request, app) = match command {
        "cancel" | "retry" => task_action(command, raw)?,
        "reschedule" => reschedule(raw)?,
        "complete" | "fail" => finish_by_hand(command, raw)?,
        "force-unlock" => force_unlock(raw)?,
        "remove-key" => remove_key(raw)?,
        "purge" => purge(raw)?,
        _ => pause(command, raw)?,
    };
    let client = client(&args, app)?;
    let reply = client.admin(&request).await.map_err(failed)?;
    let json = args.switch("json");
    match (&request, reply) {
        (AdminRequest::Cancel { task }, AdminReply::Cancelled { found: Cancelled::Pending }) => {
            outln!("task {task} cancelled")
        }
        (AdminRequest::Cancel { task }, AdminReply::Cancelled { found: Cancelled::Claimed { worker } }) => outln!(
            "task {task} cancelled; worker {} had claimed it and may be running it: that run goes on to its end, \
             and its outcome will not be recorded",
            printable(&worker.0)
        ),
        (AdminRequest::Retry { task }, AdminReply::Done) => outln!("task {task} is pending again"),
        (AdminRequest::Reschedule { task, .. }, AdminReply::Done) => outln!("task {task} rescheduled"),
        (AdminRequest::Complete { task, .. }, AdminReply::Done) => outln!("task {task} completed"),
        (AdminRequest::Fail { task, .. }, AdminReply::Done) => outln!("task {task} failed"),
        (AdminRequest::ForceUnlock { workers }, AdminReply::Released { tasks }) if json => {
            outln!("{}", serde_json::json!({"workers": workers, "tasks": tasks}))
        }
        (AdminRequest::ForceUnlock { .. }, AdminReply::Released { tasks }) => outln!("{tasks} tasks back to pending"),
        (AdminRequest::RemoveKey { key }, AdminReply::KeyRemoved { removal }) if json => {
            outln!("{}", serde_json::json!({"key": key, "removal": removal}))
        }
        (AdminRequest::RemoveKey { key }, AdminReply::KeyRemoved { removal }) => match removal {
            KeyRemoval::Cancelled(id) => outln!("key \"{}\" freed; its pending task {id} cancelled", printable(key)),
            KeyRemoval::Detached(id) => outln!("key \"{}\" freed; task {id} runs on without it", printable(key)),
            KeyRemoval::Freed(id) => outln!("key \"{}\" freed from finished task {id}", printable(key)),
        },
        (AdminRequest::Purge { .. }, AdminReply::Purged { tasks }) if json => {
            outln!("{}", serde_json::json!({"purged": tasks}))
        }
        (AdminRequest::Purge { .. }, AdminReply::Purged { tasks }) => outln!("{tasks} finished tasks purged"),
        (AdminRequest::Pause { queue }, AdminReply::Paused { was_running: changed })
        | (AdminRequest::Resume { queue }, AdminReply::Resumed { was_paused: changed }) => {
            let pausing = matches!(request, AdminRequest::Pause { .. });
            if json {
                outln!("{}", serde_json::json!({"queue": queue, "paused": pausing, "changed": changed}));
            } else {
                let state = if pausing { "paused" } else { "running" };
                outln!("queue {} {}{state}", printable(queue), if changed { "" } else { "was already " });
            }
        }
        (request, reply) => return Err(failed(format!("{} replied {reply:?}", request.name()))),
    }
    Ok(())
}

fn task_action(command: &str, raw: &[String]) -> Result<Action, Failure> {
    let args = Args::parse(raw, COMMON, &[], false)?;
    let task = task_id(&args)?;
    let request = if command == "cancel" { AdminRequest::Cancel { task } } else { AdminRequest::Retry { task } };
    Ok((args, request, Default::default()))
}

fn reschedule(raw: &[String]) -> Result<Action, Failure> {
    let args = Args::parse(raw, &["database-url", "schema", "run-at", "priority", "retries"], &["now"], false)?;
    let task = task_id(&args)?;
    let run_at = match (args.switch("now"), args.value("run-at")) {
        (true, Some(_)) => return Err(Failure::Usage("give --now or --run-at, not both".into())),
        (true, None) => Some(RunAt::Now),
        // A duration is from the database's now; a time is absolute.
        (false, Some(at)) => Some(match cli::is_duration(at) {
            true => RunAt::DelayMs(millis(parse_duration(at)?)),
            false => RunAt::At(parse_rfc3339(at).ok_or_else(|| {
                Failure::Usage(format!("invalid time {at:?}: expected a duration (10m) or 2026-11-22T10:00:00Z"))
            })?),
        }),
        (false, None) => None,
    };
    let change = Reschedule { run_at, priority: args.parsed("priority")?, retries: args.parsed("retries")? };
    if change == Reschedule::default() {
        return Err(Failure::Usage("nothing to change: give --now, --run-at, --priority or --retries".into()));
    }
    Ok((args, AdminRequest::Reschedule { task, change }, Default::default()))
}

fn finish_by_hand(command: &str, raw: &[String]) -> Result<Action, Failure> {
    let value = if command == "complete" { "result" } else { "message" };
    let args = Args::parse(raw, &["database-url", "schema", value], &[], false)?;
    let task = task_id(&args)?;
    let request = if command == "complete" {
        let result: Value = match args.value("result") {
            Some(text) => {
                serde_json::from_str(text).map_err(|e| Failure::Usage(format!("--result is not valid JSON: {e}")))?
            }
            None => Value::Null,
        };
        AdminRequest::Complete { task, result }
    } else {
        AdminRequest::Fail { task, message: args.value("message").unwrap_or(FAILED_BY_OPERATOR_MESSAGE).to_owned() }
    };
    Ok((args, request, Default::default()))
}

fn force_unlock(raw: &[String]) -> Result<Action, Failure> {
    let args = Args::parse(raw, COMMON, &["json"], false)?;
    if args.positional.is_empty() {
        return Err(Failure::Usage("expected one or more WORKER ids".into()));
    }
    let workers: Vec<WorkerId> = args.positional.iter().cloned().map(WorkerId).collect();
    Ok((args, AdminRequest::ForceUnlock { workers }, Default::default()))
}

fn remove_key(raw: &[String]) -> Result<Action, Failure> {
    let args = Args::parse(raw, COMMON, &["json"], false)?;
    let [key] = args.positional.as_slice() else {
        return Err(Failure::Usage("expected exactly one KEY".into()));
    };
    let key = key.clone();
    Ok((args, AdminRequest::RemoveKey { key }, Default::default()))
}

fn purge(raw: &[String]) -> Result<Action, Failure> {
    let values = ["database-url", "schema", "older-than", "idempotency-retention", "batch"];
    let args = Args::parse(raw, &values, &["json"], false)?;
    if !args.positional.is_empty() {
        return Err(Failure::Usage("purge takes no positional arguments".into()));
    }
    let retention = parse_duration(
        args.value("older-than").ok_or_else(|| Failure::Usage("give --older-than D (e.g. 30d)".into()))?,
    )?;
    let batch: u32 = args.parsed("batch")?.unwrap_or(DEFAULT_PURGE_BATCH);
    if batch == 0 {
        return Err(Failure::Usage("--batch must be at least 1".into()));
    }
    let mut app = canter_tokio::AppConfig::default();
    if let Some(window) = args.value("idempotency-retention") {
        app.recovery.idempotency_retention_ms = Some(millis(parse_duration(window)?));
    }
    Ok((args, AdminRequest::Purge { retention_ms: millis(retention), batch }, app))
}

fn pause(command: &str, raw: &[String]) -> Result<Action, Failure> {
    let args = Args::parse(raw, COMMON, &["json"], false)?;
    let [queue] = args.positional.as_slice() else {
        return Err(Failure::Usage("expected exactly one QUEUE".into()));
    };
    let queue = queue.clone();
    let request = if command == "pause" { AdminRequest::Pause { queue } } else { AdminRequest::Resume { queue } };
    Ok((args, request, Default::default()))
}

async fn scheduler(raw: &[String], list_only: bool) -> Outcome {
    let switches: &[&str] = if list_only { &["json"] } else { &["once", "dry-run", "list", "json", "no-migrate"] };
    let args = Args::parse(raw, &["config", "database-url", "schema"], switches, false)?;
    if !args.positional.is_empty() {
        return Err(Failure::Usage("takes no positional arguments".into()));
    }
    let modes = ["once", "dry-run", "list"].iter().filter(|m| args.switch(m)).count();
    if modes > 1 {
        return Err(Failure::Usage("give one of --once, --dry-run and --list".into()));
    }
    if args.switch("json") && !(list_only || args.switch("list")) {
        return Err(Failure::Usage("--json goes with --list".into()));
    }
    let app = match args.value("config") {
        Some(path) => {
            canter_tokio::canter::driver::read_config(std::path::Path::new(path))
                .map_err(|e| Failure::Usage(e.to_string()))?
                .app
        }
        None => canter_tokio::AppConfig::default(),
    };
    let list = list_only || args.switch("list");
    if app.schedules.is_empty() && !list {
        return Err(Failure::Usage("no schedules: give --config FILE with [[app.schedules]] tables".into()));
    }
    let scheduler = Scheduler::new(pool(&args, 4)?, app)
        .map_err(|e| Failure::Usage(e.to_string()))?
        .schema(schema(&args)?)
        .migrate(!args.switch("no-migrate"));
    if list {
        return list_schedules(&scheduler, args.switch("json")).await;
    }
    if args.switch("dry-run") {
        let plan = with_retry("read the schedules", || scheduler.plan()).await?;
        print_plan(&scheduler, &plan);
        return Ok(());
    }
    if args.switch("once") {
        let store = scheduler.store();
        if args.switch("no-migrate") {
            with_retry("check the schema", || {
                canter_tokio::canter::postgres::require_current(store.pool(), store.schema())
            })
            .await?;
        } else {
            with_retry("migrate", || store.migrate()).await?;
        }
        let report = scheduler.check().await.map_err(|e| failed(format!("check failed: {e}")))?;
        print_report(&scheduler, &report);
        return if report.refused.is_empty() { Ok(()) } else { Err(failed("some schedules' tasks were refused")) };
    }
    cli::note_line(format_args!(
        "scheduler of {} schedules starting; stop it with Ctrl-C or SIGTERM",
        scheduler.scheduler().schedules().len()
    ));
    let stats = scheduler.run().await.map_err(failed)?;
    cli::note_line(format_args!(
        "scheduler stopped: {} checks, {} tasks enqueued, {} races lost",
        stats.checks, stats.tasks, stats.lost
    ));
    Ok(())
}

/// `t` in the schedule's zone (UTC when it is not configured), RFC 3339.
fn tick_time(schedule: Option<&ParsedSchedule>, t: DbTime) -> String {
    match schedule {
        Some(schedule) => schedule.time_zone().to_local(t).to_string(),
        None => canter_tokio::canter::schedule::TimeZone::Utc.to_local(t).to_string(),
    }
}

fn tick_or(schedule: Option<&ParsedSchedule>, t: Option<DbTime>, none: &str) -> String {
    t.map_or_else(|| none.to_owned(), |t| tick_time(schedule, t))
}

fn print_plan(scheduler: &Scheduler, plan: &Plan) {
    outln!("dry run at {}: nothing is written", tick_time(None, plan.now));
    for write in &plan.writes {
        let schedule = scheduler.scheduler().get(&write.name);
        for (i, tick) in write.ticks.iter().enumerate() {
            let task = write.tasks.get(i).map_or("", |t| t.name.as_str());
            let kind = if i < write.backfilled { " (backfilled)" } else { "" };
            outln!(
                "would enqueue {} for schedule {} at tick {}{kind}",
                printable(task),
                printable(&write.name),
                tick_time(schedule, *tick)
            );
        }
        if write.read.is_none() {
            outln!(
                "would record new schedule {}: first tick {}",
                printable(&write.name),
                tick_or(schedule, write.next_tick, "never")
            );
        }
        if write.skipped {
            outln!(
                "would skip missed ticks of schedule {} up to {}",
                printable(&write.name),
                tick_time(schedule, write.advance_to)
            );
        }
    }
    if plan.writes.iter().all(|w| w.ticks.is_empty()) {
        outln!("nothing due; next tick {}", tick_or(None, plan.next_check, "never"));
    }
}

fn print_report(scheduler: &Scheduler, report: &CheckReport) {
    for applied in &report.applied {
        let write = &applied.write;
        let schedule = scheduler.scheduler().get(&write.name);
        for (i, (tick, id)) in write.ticks.iter().zip(&applied.task_ids).enumerate() {
            let kind = if i < write.backfilled { " (backfilled)" } else { "" };
            outln!(
                "schedule {}: enqueued task {id} for tick {}{kind}",
                printable(&write.name),
                tick_time(schedule, *tick)
            );
        }
        if write.read.is_none() {
            outln!(
                "schedule {}: recorded; first tick {}",
                printable(&write.name),
                tick_or(schedule, write.next_tick, "never")
            );
        }
        if write.skipped {
            outln!(
                "schedule {}: missed ticks up to {} skipped",
                printable(&write.name),
                tick_time(schedule, write.advance_to)
            );
        }
    }
    for refused in &report.refused {
        errln!("schedule {}: tasks refused: {}", printable(&refused.name), printable(&refused.error.to_string()));
    }
    outln!("{} tasks enqueued; next tick {}", report.tasks(), tick_or(None, report.next_check, "never"));
}

/// One line of `canter schedules`.
struct ScheduleRow {
    name: String,
    kind: String,
    zone: String,
    record: Option<ScheduleRecord>,
    next: Option<DbTime>,
}

async fn list_schedules(scheduler: &Scheduler, json: bool) -> Outcome {
    let store = scheduler.store();
    let names = scheduler.scheduler().names();
    let (now, configured) = with_retry("read the schedules", || store.schedule_states(&names)).await?;
    let all = with_retry("read the schedules", || store.schedule_records()).await?;
    // Configured schedules first, then records of schedules the file does not configure.
    let mut rows = Vec::new();
    for (schedule, record) in scheduler.scheduler().schedules().iter().zip(configured) {
        let after = record.as_ref().map_or(now, |r| r.last_tick.max(now));
        rows.push(ScheduleRow {
            name: schedule.name().to_owned(),
            kind: schedule.schedule().to_string(),
            zone: schedule.time_zone().id().to_string(),
            next: schedule.next_after(after),
            record,
        });
    }
    for record in all.into_iter().filter(|r| !names.contains(&r.name.as_str())) {
        rows.push(ScheduleRow {
            name: record.name.clone(),
            kind: "(not configured)".into(),
            zone: "UTC".into(),
            next: record.next_tick,
            record: Some(record),
        });
    }
    if json {
        let rows: Vec<Value> = rows
            .iter()
            .map(|row| {
                let schedule = scheduler.scheduler().get(&row.name);
                let record = row.record.as_ref();
                serde_json::json!({
                    "name": row.name,
                    "schedule": row.kind,
                    "timezone": row.zone,
                    "configured": schedule.is_some(),
                    "last_tick": record.map(|r| tick_time(schedule, r.last_tick)),
                    "last_tick_ms": record.map(|r| r.last_tick.0),
                    "next_tick": row.next.map(|t| tick_time(schedule, t)),
                    "next_tick_ms": row.next.map(|t| t.0),
                    "run_count": record.map_or(0, |r| r.run_count),
                    "last_task_id": record.and_then(|r| r.last_task_id),
                })
            })
            .collect();
        outln!("{}", Value::from(rows));
        return Ok(());
    }
    if rows.is_empty() {
        outln!("(no schedules configured or recorded)");
        return Ok(());
    }
    outln!(
        "{:<24} {:<34} {:<16} {:<25} {:<25} {:>6} {:>9}",
        "NAME",
        "SCHEDULE",
        "ZONE",
        "LAST TICK",
        "NEXT TICK",
        "RUNS",
        "LAST TASK"
    );
    for row in &rows {
        let schedule = scheduler.scheduler().get(&row.name);
        let record = row.record.as_ref();
        outln!(
            "{:<24} {:<34} {:<16} {:<25} {:<25} {:>6} {:>9}",
            printable(&row.name),
            printable(&row.kind),
            printable(&row.zone),
            tick_or(schedule, record.map(|r| r.last_tick), "never"),
            tick_or(schedule, row.next, "never"),
            record.map_or(0, |r| r.run_count),
            record.and_then(|r| r.last_task_id).map_or_else(|| "-".to_owned(), |id| id.to_string()),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(DbTime(0)));
        assert_eq!(parse_rfc3339("2026-11-22T10:00:00.5Z"), Some(DbTime(1_795_341_600_500)));
        assert_eq!(parse_rfc3339("2026-13-22T10:00:00Z"), None);
        assert_eq!(parse_rfc3339("yesterday"), None);
        assert_eq!(parse_rfc3339("2026-01-01T00:00:00.\u{e9}\u{e9}Z"), None, "no panic on non-ASCII fractions");
    }

    #[test]
    fn log_directives_are_levels_and_target_levels() {
        let (filter, max) = log_filter("warn", LevelFilter::INFO).expect("a level");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::WARN), LevelFilter::WARN));

        let (filter, max) = log_filter(" canter::db = trace , info ", LevelFilter::WARN).expect("directives");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::INFO), LevelFilter::TRACE));
        assert!(filter.would_enable("canter::db", &tracing::Level::TRACE));
        assert!(!filter.would_enable("sqlx::query", &tracing::Level::DEBUG));

        // No bare level: other targets keep the default, errors included.
        let (filter, max) = log_filter("canter::db=trace", LevelFilter::WARN).expect("a directive");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::WARN), LevelFilter::TRACE));
        assert!(filter.would_enable("canter::driver", &tracing::Level::ERROR));

        let (filter, max) = log_filter("", LevelFilter::INFO).expect("nothing");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::INFO), LevelFilter::INFO));
    }

    #[test]
    fn unreadable_log_directives_are_refused() {
        for bad in ["wran", "verbose", "canter::db=loud", "=info", "canter::db=trace,nonsense"] {
            assert!(log_filter(bad, LevelFilter::INFO).is_none(), "{bad}");
        }
    }
}
