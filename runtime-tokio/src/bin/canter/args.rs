//! The command line, declared with clap: every command, option and value type. Values are
//! parsed and range-checked here, so a command's code receives typed arguments only.

use std::io::Read;
use std::path::PathBuf;

use canter_tokio::canter::postgres::MAX_DURATION_MS;
use canter_tokio::canter::store::{DbTime, EnqueueError, KeyMode, MAX_RETRIES_SPENT, is_valid_key};
use canter_tokio::canter::task::{is_valid_flag, is_valid_queue_name};
use canter_tokio::canter::time::{parse_duration_ms, parse_instant};
use canter_tokio::{PgSchema, TaskId, TaskState};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};
use serde_json::Value;

use crate::bench::BenchArgs;
use crate::settings::WorkerSettings;

/// canter: a PostgreSQL task queue
#[derive(Debug, Parser)]
#[command(
    name = "canter",
    version,
    about = "canter: a PostgreSQL task queue",
    propagate_version = true,
    max_term_width = 100
)]
#[command(after_help = "Exit status: 0 success, 1 failure, 2 usage error.\n\
                        Logs go to stderr; CANTER_LOG sets their level (error, warn, info, debug, trace or \
                        target=level directives).")]
pub(crate) struct Cli {
    /// The PostgreSQL connection URL (postgres://user@host:port/database)
    #[arg(long, global = true, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) database_url: Option<String>,
    /// Another PostgreSQL URL for the connections that keep session state (LISTEN, the
    /// worker's liveness token): a direct one when --database-url's cannot keep sessions
    #[arg(long, global = true, env = "CANTER_LISTEN_DATABASE_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) listen_database_url: Option<String>,
    /// --database-url goes through a pooler in transaction mode (PgBouncer's pool_mode =
    /// transaction): each statement in a transaction of its own, no named prepared statements,
    /// no startup parameters; give --listen-database-url (direct) to LISTEN and migrate
    #[arg(long, global = true, env = "CANTER_TRANSACTION_POOLER", hide_env_values = true)]
    pub(crate) transaction_pooler: bool,
    /// Where workers hear of enqueues besides LISTEN/NOTIFY: postgres (nowhere else), rabbitmq
    /// or nats (the broker at --wakeup-url, on which enqueues are announced too)
    #[arg(
        long,
        global = true,
        env = "CANTER_WAKEUPS",
        hide_env_values = true,
        value_name = "PROVIDER",
        default_value = "postgres",
        value_parser = PossibleValuesParser::new(["postgres", "rabbitmq", "nats"])
    )]
    pub(crate) wakeups: String,
    /// The broker of --wakeups rabbitmq or nats [default: amqp://guest:guest@127.0.0.1:5672/%2f
    /// or nats://127.0.0.1:4222]
    #[arg(long, global = true, env = "CANTER_WAKEUP_URL", value_name = "URL", hide_env_values = true)]
    pub(crate) wakeup_url: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create or upgrade the schema and print its version
    #[command(long_about = "Create or upgrade the schema and print its version.\n\n\
        Applies the migrations the schema lacks, creating it if needed. Needs CREATE on the schema \
        (and on the database to create it); workers then start with read and write rights only \
        (canter worker --no-migrate).")]
    Migrate {
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Run a worker serving the built-in tasks until SIGINT or SIGTERM
    #[command(
        long_about = "Run a worker serving the built-in tasks (noop, sleep, fail, panic, echo, cpu, block, and crash and hog for --processes) \
        until SIGINT or SIGTERM.\n\n\
        At startup it applies the migrations the schema lacks (a current schema is only read); \
        --no-migrate only checks the schema's version and refuses to start if it lacks any. Every \
        setting of the configuration file has a flag of its own, which overrides the file."
    )]
    Worker(Box<WorkerArgs>),
    /// Enqueue tasks and print their ids
    Enqueue(Box<EnqueueArgs>),
    /// Counts by queue and state, paused queues and live workers
    Status {
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// List tasks, newest first
    List(ListArgs),
    /// Show one task and its attempts
    Show {
        /// The task's id
        id: TaskIdArg,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Print a task's result, optionally waiting for it
    Result {
        /// The task's id
        id: TaskIdArg,
        /// Wait this long for the task to finish (e.g. 30s, 5m)
        #[arg(long, value_name = "DURATION", value_parser = duration)]
        wait: Option<Millis>,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Cancel a pending or claimed task
    Cancel(TaskArgs),
    /// Put a failed task back to pending
    Retry(TaskArgs),
    /// Change a pending task's run-at, priority or retries spent
    Reschedule(RescheduleArgs),
    /// Delete a finished task with its attempts history and the idempotency key it holds
    Delete(TaskArgs),
    /// Complete a pending, claimed or running task by hand
    #[command(long_about = "Complete a pending, claimed or running task by hand with a JSON result \
        (default null); a worker still running it has its result discarded. Waiters are woken.")]
    Complete {
        #[command(flatten)]
        task: TaskArgs,
        /// The result, as JSON (`@FILE` reads a file, `-` standard input)
        #[arg(long, value_name = "JSON", value_parser = json_value)]
        result: Option<Value>,
    },
    /// Fail a pending, claimed or running task by hand
    #[command(long_about = "Fail a pending, claimed or running task for good with code \
        FAILED_BY_OPERATOR; a worker still running it has its result discarded. Waiters are woken.")]
    Fail {
        #[command(flatten)]
        task: TaskArgs,
        /// The failure's message
        #[arg(long, value_name = "TEXT")]
        message: Option<String>,
    },
    /// Put the claimed and running tasks of dead workers back to pending
    #[command(long_about = "Put every claimed or running task of these dead workers back to pending, \
        claimable at once, without spending a retry, and mark the workers stopped. Only for workers \
        that are gone: a live worker would see its tasks run twice, so one that still beats or holds \
        its liveness token is refused unless --force.")]
    ForceUnlock {
        /// The workers' ids (as `canter status` shows them)
        #[arg(required = true, value_name = "WORKER")]
        workers: Vec<String>,
        /// Unlock even workers that look alive or were never registered
        #[arg(long)]
        force: bool,
        /// The configuration file the workers run with (its claimed-stale threshold says how
        /// long a worker without a liveness token may go unseen and still be alive)
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Free an idempotency key, cancelling its task if pending
    #[command(long_about = "Free an idempotency key: a pending task holding it is cancelled, a claimed \
        or running one runs on without it, a finished one just loses it.")]
    RemoveKey {
        /// The key
        #[arg(value_parser = key)]
        key: String,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Delete finished tasks older than a retention period
    #[command(long_about = "Delete finished tasks (with their attempts and keys) that finished more \
        than --older-than ago, --batch per statement so no lock is held long, and print how many. \
        A task holding an idempotency key stays until the key is --idempotency-retention old \
        (default: forever), so an idempotent enqueue of it still gives its id.")]
    Purge {
        /// Delete tasks finished longer ago than this (e.g. 30d, 12h)
        #[arg(long, value_name = "DURATION", value_parser = duration)]
        older_than: Millis,
        /// Keep tasks holding an idempotency key until the key is this old
        #[arg(long, value_name = "DURATION", value_parser = duration)]
        idempotency_retention: Option<Millis>,
        /// Tasks deleted per statement
        #[arg(long, value_name = "N", default_value_t = canter_tokio::canter::store::DEFAULT_PURGE_BATCH,
              value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch: u32,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Stop workers from claiming a queue's pending tasks
    Pause(QueueArgs),
    /// Let workers claim a paused queue's tasks again
    Resume(QueueArgs),
    /// Enqueue the ticks of the configured schedules until SIGINT or SIGTERM
    #[command(long_about = "Enqueue the ticks of the file's [[app.schedules]] until SIGINT or SIGTERM: \
        each tick once, however many schedulers and workers with worker.run_scheduler run. At \
        startup it applies the migrations the schema lacks (--no-migrate only checks the version).")]
    Scheduler(SchedulerArgs),
    /// Each schedule's last and next tick
    Schedules {
        /// The configuration file (TOML or JSON) whose schedules to show
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Serve the web dashboard: queues, tasks, workers, schedules and workflows, live
    #[command(long_about = "Serve the web dashboard of a schema on ADDR (127.0.0.1:8080 by default): \
        counts and throughput per queue, workers, tasks with filters and bulk actions, each task's \
        attempts, queues to pause and resume, schedules and workflows, updated live; /metrics has \
        each queue's depth and age. Every action is logged; --read-only refuses them all.")]
    Dashboard(DashboardArgs),
    /// Submit, show, list, pause, resume, cancel and retry workflows
    #[command(subcommand)]
    Workflow(WorkflowCommand),
    /// Run the demo: a mixed load through several workers
    #[command(long_about = "Run the demo: a mixed load through several workers, with progress and a \
        summary. On the embedded in-memory store, or on PostgreSQL in a schema of its own (dropped \
        at the end, and on Ctrl-C) when a database URL is given.")]
    Demo(DemoArgs),
    /// Measure throughput, latency and memory against a raw-SQL baseline
    Bench(Box<BenchArgs>),
    /// Print a shell completion script (e.g. `canter completions bash > /etc/bash_completion.d/canter`)
    Completions {
        /// The shell
        shell: clap_complete::Shell,
    },
}

/// `--schema NAME`.
#[derive(Debug, Clone, Args)]
pub(crate) struct SchemaArg {
    /// The PostgreSQL schema of Canter's tables
    #[arg(long = "schema", value_name = "NAME", default_value = "canter", value_parser = schema_name)]
    pub(crate) schema: PgSchema,
}

/// `--json`.
#[derive(Debug, Clone, Copy, Args)]
pub(crate) struct Output {
    /// Print JSON instead of text
    #[arg(long)]
    pub(crate) json: bool,
}

/// `canter workflow`.
#[derive(Debug, Subcommand)]
pub(crate) enum WorkflowCommand {
    /// Submit a workflow of built-in tasks described in JSON, and print its id
    #[command(after_help = "FILE (or - for standard input) holds {\"name\": ..., \"pause_on_error\": false, \
        \"steps\": [{\"name\": \"a\", \"task\": \"echo\", \"args\": {...}, \"queue\": ..., \"priority\": 0, \
        \"after\": [\"x\"], \"after_finish\": [\"y\"], \"join\": \"all\" | \"any\" | {\"quorum\": N}}, ...]}: \
        a step runs once its join over the steps it comes after is satisfied (\"after\" needs the \
        step to complete, \"after_finish\" only to end).")]
    Submit {
        /// The workflow's JSON: a file, or - for standard input
        #[arg(value_name = "FILE")]
        file: String,
        /// Submit steps whose tasks the canter worker does not serve (your own workers do)
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// A workflow's status and each step's state (and what a waiting one waits for)
    Show {
        /// The workflow's id
        id: WorkflowIdArg,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// The newest workflows with their status
    List {
        /// How many
        #[arg(short = 'n', long, value_name = "N", default_value_t = 20,
              value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        #[command(flatten)]
        schema: SchemaArg,
        #[command(flatten)]
        output: Output,
    },
    /// Stop promoting and skipping a workflow's steps until it is resumed
    Pause(WorkflowArgs),
    /// Apply what a paused workflow's steps decided meanwhile, and go on
    Resume(WorkflowArgs),
    /// Cancel every step of a workflow that has not finished (their workers abort the running
    /// ones at once)
    Cancel(WorkflowArgs),
    /// Run again a workflow's steps that did not complete (failed, cancelled, expired,
    /// skipped); a paused workflow runs them once resumed
    Retry {
        #[command(flatten)]
        workflow: WorkflowArgs,
        /// Also run again every finished step below them, completed ones included
        #[arg(long)]
        downstream: bool,
    },
}

/// A workflow id with its schema and output flags (pause, resume, cancel, retry).
#[derive(Debug, Clone, Args)]
pub(crate) struct WorkflowArgs {
    /// The workflow's id
    pub(crate) id: WorkflowIdArg,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// A workflow's id on the command line.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkflowIdArg(pub(crate) canter_tokio::WorkflowId);

impl std::str::FromStr for WorkflowIdArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.parse::<i64>() {
            Ok(id) if id > 0 => Ok(WorkflowIdArg(canter_tokio::WorkflowId(id))),
            _ => Err("expected a workflow id: a positive whole number".into()),
        }
    }
}

/// A task id with its schema and output flags (cancel, retry).
#[derive(Debug, Clone, Args)]
pub(crate) struct TaskArgs {
    /// The task's id
    pub(crate) id: TaskIdArg,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// A queue with its schema and output flags (pause, resume).
#[derive(Debug, Clone, Args)]
pub(crate) struct QueueArgs {
    /// The queue's name
    #[arg(value_parser = queue_name)]
    pub(crate) queue: String,
    /// Act on a queue that has no tasks and that no live worker serves
    #[arg(long)]
    pub(crate) force: bool,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// `canter worker`.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// A configuration file (TOML or JSON) with [app] and [worker] tables
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Do not migrate: only check the schema's version
    #[arg(long)]
    pub(crate) no_migrate: bool,
    /// With --run-scheduler: run schedules whose tasks this worker does not serve (your own
    /// workers do)
    #[arg(long)]
    pub(crate) force: bool,
    /// Serve /metrics (Prometheus), /healthz and /readyz over HTTP on ADDR, e.g.
    /// 127.0.0.1:9464 (port 0 lets the system choose; the address is printed)
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics_addr: Option<String>,
    /// Run the blocking tasks (cpu, block, crash, hog) in N child processes: a crash, a signal or the
    /// OOM killer costs the task (WORKER_CHILD_CRASHED), a timeout kills its child
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(crate) processes: Option<u32>,
    /// With --processes: each child's memory limit (its address space), in MiB
    #[arg(long, value_name = "MIB", requires = "processes", value_parser = clap::value_parser!(u64).range(16..=1_048_576))]
    pub(crate) child_memory_mib: Option<u64>,
    /// With --processes: replace a child after it ran N tasks
    #[arg(long, value_name = "N", requires = "processes", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) recycle_after: Option<u64>,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) settings: WorkerSettings,
}

/// `canter enqueue`.
#[derive(Debug, Args)]
#[command(after_help = "DURATION is e.g. 500ms, 10s, 1h30m or 7d. TIME is a DURATION from now or an \
    RFC 3339 time (2026-11-22T10:00:00Z). --count N enqueues N copies in one transaction: all of them \
    or none.")]
pub(crate) struct EnqueueArgs {
    /// The task's name (a built-in task unless --force)
    pub(crate) task: String,
    /// The task's arguments as JSON (`@FILE` reads a file, `-` standard input)
    #[arg(long, value_name = "JSON", value_parser = json_value)]
    pub(crate) args: Option<Value>,
    /// The queue
    #[arg(long, value_name = "QUEUE", value_parser = queue_name)]
    pub(crate) queue: Option<String>,
    /// The priority: lower runs first
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub(crate) priority: Option<i16>,
    /// Run no earlier than this long from now
    #[arg(long, value_name = "DURATION", value_parser = duration, conflicts_with = "run_at")]
    pub(crate) delay: Option<Millis>,
    /// Run no earlier than TIME
    #[arg(long, value_name = "TIME", value_parser = when)]
    pub(crate) run_at: Option<When>,
    /// Expire the task if it has not started by TIME
    #[arg(long, value_name = "TIME", value_parser = when)]
    pub(crate) good_until: Option<When>,
    /// Retries after a failure, with exponential backoff from 1 s
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=20))]
    pub(crate) max_retries: Option<u32>,
    /// A unique key: what an enqueue of a task with a live key does is --key-mode's
    #[arg(long, value_name = "KEY", conflicts_with = "count", value_parser = key)]
    pub(crate) key: Option<String>,
    /// What enqueueing a key that a task holds does
    #[arg(long, value_name = "MODE", requires = "key", value_parser = key_mode_parser())]
    pub(crate) key_mode: Option<KeyMode>,
    /// Flags (comma-separated) that workers may refuse to claim
    #[arg(long, value_name = "FLAG,...", value_delimiter = ',', value_parser = flag)]
    pub(crate) flags: Vec<String>,
    /// Enqueue this many copies, all or none
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) count: u32,
    /// Enqueue a task name the built-in worker does not serve
    #[arg(long)]
    pub(crate) force: bool,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// `canter list`.
#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    /// Only tasks in this state
    #[arg(long, value_name = "STATE", ignore_case = true, value_parser = state_parser())]
    pub(crate) status: Option<TaskState>,
    /// Only tasks of this queue
    #[arg(long, value_name = "QUEUE", value_parser = queue_name)]
    pub(crate) queue: Option<String>,
    /// Only tasks of this name
    #[arg(long, value_name = "NAME")]
    pub(crate) task: Option<String>,
    /// Only tasks with a smaller id than this (the next page after a listing's last id)
    #[arg(long, value_name = "ID")]
    pub(crate) after: Option<TaskIdArg>,
    /// Skip this many tasks first
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) offset: usize,
    /// Show at most this many tasks
    #[arg(long, short = 'n', value_name = "N", default_value_t = 50,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) limit: u32,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// `canter dashboard`.
#[derive(Debug, Args)]
pub(crate) struct DashboardArgs {
    /// Listen on ADDR (port 0 lets the system choose; the address is printed)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub(crate) addr: String,
    /// Refuse every action: pages and metrics only
    #[arg(long)]
    pub(crate) read_only: bool,
    /// Ask for USER:PASSWORD (HTTP basic auth) on every page but /healthz and /readyz
    #[arg(long, value_name = "USER:PASSWORD", env = "CANTER_DASHBOARD_AUTH", hide_env_values = true,
          value_parser = user_and_password)]
    pub(crate) auth: Option<(String, String)>,
    /// The configuration file (TOML or JSON) whose queues' caps and schedules to show
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Without --auth, answer this host name too (IP addresses and localhost always are); may
    /// be repeated
    #[arg(long, value_name = "NAME")]
    pub(crate) allowed_host: Vec<String>,
    /// Read the overview this often while anyone looks (it waits longer when a read is slow)
    #[arg(long, value_name = "DURATION", value_parser = duration, default_value = "2s")]
    pub(crate) refresh: Millis,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
}

fn user_and_password(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((user, password)) if !user.is_empty() && !password.is_empty() => {
            Ok((user.to_owned(), password.to_owned()))
        }
        _ => Err("expected USER:PASSWORD, both non-empty".to_owned()),
    }
}

/// `canter reschedule`.
#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("change").required(true).multiple(true)
    .args(["now", "run_at", "priority", "retries"]))]
pub(crate) struct RescheduleArgs {
    /// The task's id
    pub(crate) id: TaskIdArg,
    /// Make the task due at once
    #[arg(long, conflicts_with = "run_at")]
    pub(crate) now: bool,
    /// Make the task due at TIME (a duration from now or an RFC 3339 time; before its good-until)
    #[arg(long, value_name = "TIME", value_parser = when)]
    pub(crate) run_at: Option<When>,
    /// Set its priority (lower runs first)
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub(crate) priority: Option<i16>,
    /// Set the retries it has spent (0 gives it its whole retry budget again)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(..=i64::from(MAX_RETRIES_SPENT)))]
    pub(crate) retries: Option<u32>,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    #[command(flatten)]
    pub(crate) output: Output,
}

/// `canter scheduler`.
#[derive(Debug, Args)]
pub(crate) struct SchedulerArgs {
    /// The configuration file (TOML or JSON) with the [[app.schedules]]
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Do not migrate: only check the schema's version
    #[arg(long)]
    pub(crate) no_migrate: bool,
    /// Check once, print what was enqueued and exit
    #[arg(long, conflicts_with_all = ["dry_run", "list"])]
    pub(crate) once: bool,
    /// Print what a check would enqueue, writing nothing
    #[arg(long, conflicts_with = "list")]
    pub(crate) dry_run: bool,
    /// Print each schedule's last and next tick (as `canter schedules`)
    #[arg(long)]
    pub(crate) list: bool,
    /// Run schedules whose tasks the built-in worker does not serve (your own workers do)
    #[arg(long)]
    pub(crate) force: bool,
    #[command(flatten)]
    pub(crate) schema: SchemaArg,
    /// Print JSON instead of text (with --once, --dry-run or --list)
    #[arg(long)]
    pub(crate) json: bool,
}

/// `canter demo`.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Tasks in the mix
    #[arg(long, value_name = "N", default_value_t = 2_000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) tasks: u32,
    /// Worker processes' worth of workers
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) workers: u32,
    /// Each worker's concurrency
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub(crate) concurrency: u32,
}

/// Milliseconds, from a duration's text.
pub(crate) type Millis = u64;

/// A time given on the command line: a duration from now, or an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum When {
    /// This many ms after the database's now.
    In(Millis),
    /// This instant.
    At(DbTime),
}

impl When {
    /// The instant, given the database's now.
    pub(crate) fn at(self, now: DbTime) -> DbTime {
        match self {
            When::In(ms) => now.plus_ms(ms),
            When::At(t) => t,
        }
    }
}

/// A task id (a positive number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TaskIdArg(pub(crate) TaskId);

impl std::str::FromStr for TaskIdArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.parse::<i64>() {
            Ok(id) if id > 0 => Ok(TaskIdArg(TaskId(id))),
            _ => Err("expected a task id: a positive whole number".into()),
        }
    }
}

/// A duration (`500ms`, `10s`, `1h30m`, `7d`) in ms, at most what the database stores.
pub(crate) fn duration(text: &str) -> Result<Millis, String> {
    let too_long = || {
        format!(
            "invalid duration {:?}: expected at most {}d (about 3,170 years)",
            text.trim(),
            MAX_DURATION_MS / 86_400_000
        )
    };
    let ms = parse_duration_ms(text.trim())
        .map_err(|e| if e.to_string().contains("at most") { too_long() } else { e.to_string() })?;
    if ms > MAX_DURATION_MS {
        return Err(too_long());
    }
    Ok(ms)
}

/// A duration from now or an RFC 3339 time.
pub(crate) fn when(text: &str) -> Result<When, String> {
    let text = text.trim();
    // A timestamp starts with its year and a dash; anything else is read as a duration, so a
    // duration too long says so.
    let timestamp = text.len() > 4 && text.as_bytes()[..4].iter().all(u8::is_ascii_digit) && text.as_bytes()[4] == b'-';
    if !timestamp && text.starts_with(|c: char| c.is_ascii_digit() || c == '+') {
        return duration(text).map(When::In);
    }
    parse_instant(text, DbTime(0)).map(When::At).map_err(|e| e.to_string())
}

/// A queue name, as stores check it.
fn queue_name(text: &str) -> Result<String, String> {
    match is_valid_queue_name(text) {
        true => Ok(text.to_owned()),
        false => Err(EnqueueError::InvalidQueueName(text.to_owned()).to_string()),
    }
}

/// An idempotency key, as stores check it.
fn key(text: &str) -> Result<String, String> {
    match is_valid_key(text) {
        true => Ok(text.to_owned()),
        false => Err(EnqueueError::InvalidKey(text.to_owned()).to_string()),
    }
}

/// A task flag, as stores check it.
fn flag(text: &str) -> Result<String, String> {
    match is_valid_flag(text) {
        true => Ok(text.to_owned()),
        false => Err(EnqueueError::InvalidFlag(text.to_owned()).to_string()),
    }
}

/// A schema name Canter may use.
fn schema_name(text: &str) -> Result<PgSchema, String> {
    PgSchema::new(text).map_err(|e| e.to_string())
}

/// JSON given inline, as `@FILE`, or as `-` (standard input).
pub(crate) fn json_value(text: &str) -> Result<Value, String> {
    let owned;
    let json = if text == "-" {
        let mut input = String::new();
        std::io::stdin().read_to_string(&mut input).map_err(|e| format!("cannot read standard input: {e}"))?;
        owned = input;
        owned.as_str()
    } else if let Some(path) = text.strip_prefix('@') {
        owned = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        owned.as_str()
    } else {
        text
    };
    serde_json::from_str(json).map_err(|e| format!("not valid JSON: {e}"))
}

/// The task states, by their lower-case names.
fn state_parser() -> impl TypedValueParser<Value = TaskState> {
    let names: Vec<String> = TaskState::ALL.iter().map(|s| s.as_str().to_ascii_lowercase()).collect();
    PossibleValuesParser::new(names).try_map(|name| name.parse::<TaskState>())
}

/// The key modes, by name.
fn key_mode_parser() -> impl TypedValueParser<Value = KeyMode> {
    let modes = [KeyMode::Replace, KeyMode::PreserveRunAt, KeyMode::UnsafeDedupe, KeyMode::Idempotent];
    PossibleValuesParser::new(modes.map(KeyMode::as_str))
        .try_map(|name| KeyMode::parse(&name).ok_or_else(|| format!("unknown key mode {name:?}")))
}
