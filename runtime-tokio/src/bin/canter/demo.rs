//! `canter demo`: a mixed load through several workers, with progress while it drains and a
//! summary at the end. On the embedded in-memory store unless a database URL is given.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use canter_tokio::canter::config::{AppConfig, CustomQueue, QueueMode, RecoveryConfig, RetryPolicy, WorkerConfig};
use canter_tokio::canter::driver::{self, DriverOptions, MemoryBackend, Runtime, WorkerService};
use canter_tokio::canter::memory::MemoryStore;
use canter_tokio::canter::postgres::PgSchema;
use canter_tokio::canter::rng::Rng;
use canter_tokio::canter::store::{DbTime, NewTask, RunAt};
use canter_tokio::canter::task::{ErrorCode, TaskId, TaskState, WorkerId};
use canter_tokio::canter::worker::{Event, Input, Worker};
use canter_tokio::{Client, TokioRuntime};
use futures::channel::mpsc;
use serde_json::json;

use crate::args::DemoArgs;
use crate::connect::Database;
use crate::output::Table;
use crate::{Failure, builtins, outln};

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DemoError {
    /// The database could not be had, or the arguments do not work.
    #[error("{0:?}")]
    Connect(Failure),
    /// Something failed while running.
    #[error("{0}")]
    Failed(String),
    /// The output's reader went away (`canter demo | head`); the demo stopped and cleaned up.
    #[error("the output was closed")]
    OutputClosed,
    /// Ctrl-C or SIGTERM came; the demo stopped and cleaned up.
    #[error("interrupted; the demo stopped and cleaned up")]
    Interrupted,
}

impl DemoError {
    fn output(error: std::io::Error) -> Self {
        match error.kind() {
            std::io::ErrorKind::BrokenPipe => DemoError::OutputClosed,
            _ => DemoError::Failed(format!("cannot write the output: {error}")),
        }
    }
}

fn app() -> AppConfig {
    AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![
            CustomQueue::new("fast").with_priority(1),
            CustomQueue::new("default").with_priority(2),
            CustomQueue::new("bulk").with_priority(3).with_max_concurrency(8),
        ],
        recovery: RecoveryConfig {
            claimer_heartbeat_interval_ms: 1_000,
            runner_heartbeat_interval_ms: 1_000,
            check_interval_ms: 2_000,
            claimed_stale_threshold_ms: 5_000,
            running_stale_threshold_ms: 5_000,
            ..RecoveryConfig::default()
        },
        ..AppConfig::default()
    }
}

/// The kinds of task in the mix, with what each is for: the summary shows outcomes by kind.
const KINDS: [(&str, &str); 7] = [
    ("sleep", "sleeps 1-20 ms"),
    ("echo", "returns its arguments (queue fast)"),
    ("cpu", "hashes for a while (queue bulk, at most 8 at once)"),
    ("delayed", "sleeps 5 ms, enqueued to run 0.1-1.5 s later"),
    ("fail", "fails on purpose with FLAKY, retried once"),
    ("panic", "panics on purpose (no retry)"),
    ("timeout", "sleeps 2 s, past its 1 s timeout, on purpose"),
];

/// The mix: each task with the index of its kind in [`KINDS`].
fn load(count: usize) -> Vec<(usize, NewTask)> {
    let mut rng = Rng::new(2026);
    let flaky = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    (0..count)
        .map(|i| {
            let (kind, task) = match rng.range(0, 100) {
                0..=54 => (0, NewTask::new("sleep", json!({"ms": rng.range(1, 20)}))),
                55..=74 => (1, NewTask::new("echo", json!({"i": i})).queue("fast")),
                75..=88 => (2, NewTask::new("cpu", json!({"iterations": rng.range(10_000, 200_000)})).queue("bulk")),
                89..=91 => (3, NewTask::new("sleep", json!({"ms": 5})).run_at(RunAt::DelayMs(rng.range(100, 1_500)))),
                92..=96 => (4, NewTask::new("fail", json!({"code": "FLAKY"})).retry(flaky.clone())),
                97..=98 => (5, NewTask::new("panic", json!({}))),
                _ => (6, NewTask::new("sleep", json!({"ms": 2_000}))),
            };
            (kind, task.priority(rng.range(0, 3) as i16))
        })
        .collect()
}

/// When each task was enqueued, started and finished, from the workers' hooks.
#[derive(Default)]
struct Timeline {
    enqueued: BTreeMap<TaskId, Instant>,
    started: BTreeMap<TaskId, Instant>,
    finished: BTreeMap<TaskId, Instant>,
    /// The state each task ended in.
    outcome: BTreeMap<TaskId, TaskState>,
    /// Each task's kind (an index in [`KINDS`]).
    kind: BTreeMap<TaskId, usize>,
    retried: u64,
}

fn record(timeline: &Mutex<Timeline>, event: &Event) {
    let now = TokioRuntime.now();
    let mut t = timeline.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match event {
        Event::Started { task, .. } => {
            t.started.entry(*task).or_insert(now);
        }
        Event::Finished { state: TaskState::Pending, .. } => t.retried += 1,
        Event::Finished { task, state } => {
            t.finished.insert(*task, now);
            t.outcome.insert(*task, *state);
        }
        Event::Expired { task } => {
            t.finished.insert(*task, now);
            t.outcome.insert(*task, TaskState::Expired);
        }
        _ => {}
    }
}

/// Where the demo's tasks live.
enum Backend {
    Memory(MemoryBackend),
    Postgres(Client),
}

impl Backend {
    async fn counts(&self) -> Result<BTreeMap<TaskState, u64>, DemoError> {
        let by_queue = match self {
            Backend::Memory(backend) => backend.with_store(|store, _| store.counts()),
            Backend::Postgres(client) => client.counts().await.map_err(|e| DemoError::Failed(e.to_string()))?,
        };
        let mut counts = BTreeMap::new();
        for ((_, state), n) in by_queue {
            *counts.entry(state).or_default() += n;
        }
        Ok(counts)
    }
}

/// The workers of a demo and how to stop them, and the schema to drop, whatever happens.
#[derive(Default)]
struct Session {
    workers: Vec<tokio::task::JoinHandle<Result<canter_tokio::Stats, String>>>,
    stop: Option<futures::channel::oneshot::Sender<()>>,
    /// The PostgreSQL schema made for the demo, with a pool to drop it.
    schema: Option<(PgSchema, sqlx::PgPool)>,
}

impl Session {
    /// Stops the workers (waiting at most `grace` for them) and drops the schema: the demo
    /// leaves nothing behind, on success, failure or interruption.
    async fn end(&mut self, grace: Duration) -> (Vec<canter_tokio::Stats>, Option<String>) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let (mut stats, mut failure) = (Vec::new(), None);
        for worker in self.workers.drain(..) {
            match tokio::time::timeout(grace, worker).await {
                Ok(Ok(Ok(worker_stats))) => stats.push(worker_stats),
                Ok(Ok(Err(error))) => failure = failure.or(Some(error)),
                Ok(Err(error)) => failure = failure.or(Some(error.to_string())),
                Err(_) => failure = failure.or(Some("a worker did not stop in time".to_owned())),
            }
        }
        if let Some((schema, pool)) = self.schema.take() {
            let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", schema.quoted());
            if let Err(error) = sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&pool).await {
                failure = failure.or(Some(format!("cannot drop the demo's schema {}: {error}", schema.name())));
            }
        }
        (stats, failure)
    }
}

/// Runs the demo with the command line's arguments. Ctrl-C or SIGTERM stops it early; either
/// way its workers stop and its schema is dropped.
pub(crate) async fn run(database: &Database, args: DemoArgs) -> Result<(), DemoError> {
    builtins::quiet_deliberate_panics();
    let mut session = Session::default();
    let timeline = Arc::new(Mutex::new(Timeline::default()));
    let outcome = tokio::select! {
        outcome = demo(database, &args, &mut session, &timeline) => outcome,
        () = canter_tokio::shutdown_signal() => Err(DemoError::Interrupted),
    };
    let (stats, stopped) = session.end(Duration::from_secs(10)).await;
    let (counts, elapsed) = match (outcome, stopped) {
        (Ok(watched), None) => watched,
        (Err(DemoError::Failed(what)), Some(why)) => return Err(DemoError::Failed(format!("{what}: {why}"))),
        (Err(error), _) => return Err(error),
        (Ok(_), Some(why)) => return Err(DemoError::Failed(format!("a worker failed: {why}"))),
    };
    summary(&timeline, &counts, elapsed, u64::from(args.tasks), &stats);
    Ok(())
}

/// Starts the workers, enqueues the mix and watches it drain.
async fn demo(
    database: &Database,
    args: &DemoArgs,
    session: &mut Session,
    timeline: &Arc<Mutex<Timeline>>,
) -> Result<(BTreeMap<TaskState, u64>, Duration), DemoError> {
    let runtime = Arc::new(TokioRuntime);
    let app = app();
    let registry = Arc::new(builtins::registry());
    let config = WorkerConfig {
        concurrency: args.concurrency,
        poll_interval_ms: 1_000,
        handler_timeout_ms: Some(1_000),
        ..WorkerConfig::default()
    };
    let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
    session.stop = Some(stop_tx);
    let stop = futures::FutureExt::shared(async move {
        let _ = stop_rx.await;
    });
    let (kinds, tasks): (Vec<usize>, Vec<NewTask>) = load(args.tasks as usize).into_iter().unzip();
    let header =
        format!("canter demo: {} tasks, {} workers x concurrency {}", args.tasks, args.workers, args.concurrency);
    let purpose = "about 1 in 10 tasks fails, panics or times out on purpose, to show retries and failures";
    let mut enqueued = Vec::with_capacity(tasks.len());
    let backend = match database.url.as_deref().filter(|url| !url.is_empty()) {
        None => {
            outln!("{header}, on the embedded in-memory store (give --database-url or DATABASE_URL to use PostgreSQL)");
            outln!("{purpose}");
            let clock = runtime.clone();
            let backend =
                MemoryBackend::new(MemoryStore::new(app.clone()), DbTime(1_700_000_000_000), move || clock.now());
            for i in 0..args.workers {
                let id = WorkerId(format!("demo-{}", i + 1));
                let worker = Worker::new(id, app.clone(), config.clone(), runtime.now())
                    .map_err(|e| DemoError::Failed(e.to_string()))?;
                let (shutdown_tx, shutdown_rx) = mpsc::unbounded();
                let stop = stop.clone();
                tokio::spawn(async move {
                    stop.await;
                    let _ = shutdown_tx.unbounded_send(Input::Shutdown);
                });
                let inputs = futures::stream::select(backend.subscribe(), shutdown_rx);
                let t = timeline.clone();
                let observer: driver::Observer = Box::new(move |event| record(&t, event));
                let handlers = registry.clone().bind(runtime.clone());
                let run = driver::run(
                    worker,
                    runtime.clone(),
                    backend.clone(),
                    handlers,
                    inputs,
                    DriverOptions::default(),
                    Some(observer),
                );
                session.workers.push(tokio::spawn(async move { Ok(run.await) }));
            }
            let now = runtime.now();
            let ids = backend
                .with_store(|store, db_now| store.enqueue_many(tasks, db_now))
                .map_err(|e| DemoError::Failed(e.to_string()))?;
            enqueued.extend(ids.into_iter().map(|id| (id, now)));
            Backend::Memory(backend)
        }
        Some(_) => {
            let schema = PgSchema::new(&format!("canter_demo_{}", std::process::id()))
                .map_err(|e| DemoError::Failed(e.to_string()))?;
            let pool = database.pool(8 + 4 * args.workers).await.map_err(DemoError::Connect)?;
            outln!("{header}, on PostgreSQL (schema {}, dropped at the end)", schema.name());
            outln!("{purpose}");
            session.schema = Some((schema.clone(), pool.clone()));
            let client = Client::new(runtime.clone(), pool.clone(), schema.clone(), app.clone());
            client
                .store()
                .migrate()
                .await
                .map_err(|e| DemoError::Failed(format!("cannot migrate the demo's schema: {e}")))?;
            for i in 0..args.workers {
                let id = WorkerId(format!("demo-{}-{}", std::process::id(), i + 1));
                let mut service = WorkerService::new(app.clone(), config.clone(), registry.clone(), id)
                    .map_err(|e| DemoError::Failed(e.to_string()))?;
                service.schema = schema.clone();
                let t = timeline.clone();
                service.hooks.push(Arc::new(move |event: &Event| record(&t, event)));
                let serve = service.serve(runtime.clone(), pool.clone(), stop.clone());
                session.workers.push(tokio::spawn(async move { serve.await.map_err(|e| e.to_string()) }));
            }
            for chunk in tasks.chunks(1_000) {
                let now = runtime.now();
                let ids =
                    client.store().enqueue_many(chunk.to_vec()).await.map_err(|e| DemoError::Failed(e.to_string()))?;
                enqueued.extend(ids.into_iter().map(|id| (id, now)));
            }
            Backend::Postgres(client)
        }
    };
    {
        let mut t = timeline.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        t.kind.extend(enqueued.iter().map(|(id, _)| *id).zip(kinds));
        t.enqueued.extend(enqueued);
    }
    watch(&backend, &session.workers, &runtime, u64::from(args.tasks)).await
}

/// Shows progress until every task is done: the final counts and the time it took.
async fn watch<W>(
    backend: &Backend,
    workers: &[tokio::task::JoinHandle<W>],
    runtime: &TokioRuntime,
    total: u64,
) -> Result<(BTreeMap<TaskState, u64>, Duration), DemoError> {
    let epoch = runtime.now();
    let tty = std::io::stdout().is_terminal();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let counts = backend.counts().await?;
        let count = |s| counts.get(&s).copied().unwrap_or(0);
        let done: u64 = counts.iter().filter(|(s, _)| s.is_terminal()).map(|(_, n)| n).sum();
        let line = format!(
            "{} {:>7}/{total}  pending {:>6}  running {:>4}  completed {:>7}  failed {:>5}  {:>6.1}s",
            bar(done, total),
            done,
            count(TaskState::Pending),
            count(TaskState::Running) + count(TaskState::Claimed),
            count(TaskState::Completed),
            count(TaskState::Failed),
            (runtime.now() - epoch).as_secs_f64()
        );
        if tty {
            let mut out = std::io::stdout().lock();
            write!(out, "\r{line}").and_then(|()| out.flush()).map_err(DemoError::output)?;
        } else {
            crate::output::write_line(format_args!("{line}")).map_err(DemoError::output)?;
        }
        if done >= total {
            if tty {
                crate::output::write_line(format_args!("")).map_err(DemoError::output)?;
            }
            return Ok((counts, runtime.now() - epoch));
        }
        if workers.iter().all(|worker| worker.is_finished()) {
            return Err(DemoError::Failed(format!("every worker stopped with {done} of {total} tasks done")));
        }
    }
}

fn bar(done: u64, total: u64) -> String {
    let width = 30u64;
    let filled = (done.min(total) * width / total.max(1)) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width as usize - filled))
}

fn percentiles(mut samples: Vec<Duration>) -> String {
    if samples.is_empty() {
        return "no samples".to_owned();
    }
    samples.sort();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    let ms = |d: Duration| format!("{:.1}ms", d.as_secs_f64() * 1000.0);
    format!("p50 {}  p90 {}  p99 {}  max {}", ms(at(0.5)), ms(at(0.9)), ms(at(0.99)), ms(samples[samples.len() - 1]))
}

fn summary(
    timeline: &Mutex<Timeline>,
    counts: &BTreeMap<TaskState, u64>,
    elapsed: Duration,
    total: u64,
    stats: &[canter_tokio::Stats],
) {
    let t = timeline.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let pickup =
        t.started.iter().filter_map(|(id, at)| t.enqueued.get(id).map(|e| at.saturating_duration_since(*e))).collect();
    let through =
        t.finished.iter().filter_map(|(id, at)| t.enqueued.get(id).map(|e| at.saturating_duration_since(*e))).collect();
    outln!("\nsummary");
    outln!(
        "  throughput       {total} tasks in {:.2}s: {:.0} tasks/s",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    outln!("  enqueue → start  {}", percentiles(pickup));
    outln!("  enqueue → done   {}", percentiles(through));
    outln!("  (latencies include the backlog, the 8-at-once cap of the bulk queue, run_at delays and retries)");
    for (state, n) in counts {
        outln!("  {:<16} {n}", state.as_str().to_lowercase());
    }
    outln!("  retried runs     {}", t.retried);
    outln!("\noutcomes by kind (fail, panic and timeout tasks fail on purpose)");
    let mut table = Table::new(&["KIND", ">TASKS", ">COMPLETED", ">FAILED", ">EXPIRED", "WHAT IT DOES"]);
    for (index, (kind, what)) in KINDS.iter().enumerate() {
        let of_kind: Vec<TaskId> = t.kind.iter().filter(|(_, k)| **k == index).map(|(id, _)| *id).collect();
        let ended = |state: TaskState| of_kind.iter().filter(|id| t.outcome.get(id) == Some(&state)).count();
        table.row(vec![
            kind.to_string(),
            of_kind.len().to_string(),
            ended(TaskState::Completed).to_string(),
            ended(TaskState::Failed).to_string(),
            ended(TaskState::Expired).to_string(),
            what.to_string(),
        ]);
    }
    table.print();
    outln!("");
    for (i, s) in stats.iter().enumerate() {
        outln!(
            "  worker {}: claimed {} in {} passes, completed {}, failed {}, retried {}",
            i + 1,
            s.claimed,
            s.claim_passes,
            s.completed,
            s.failed,
            s.retried
        );
    }
}
