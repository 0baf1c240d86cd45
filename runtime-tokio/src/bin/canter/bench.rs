//! `canter bench`: throughput, latency and memory of Canter on PostgreSQL, each workload also
//! run by a raw baseline (hand-written SQL through sqlx, no library) in the same invocation, so
//! every figure comes with a ratio measured on the same machine at the same time.
//!
//! Workloads (each run in a fresh schema of its own, dropped afterwards; the two modes of a run
//! back to back, or taking turns for the enqueue workloads, the first alternating by run):
//!
//! - `enqueue`: `--enqueue-tasks` tasks one by one from one client (`enqueue_one`; with
//!   `--producers N`, each turn's tasks split among N concurrent producers of one client, on a
//!   connection each; `--raw-no-notify` takes `pg_notify` out of the raw inserts; Canter's
//!   enqueues notify only with `--waiting-worker`, which marks a worker waiting on the queue
//!   as an idle one is, schema 14), then, in
//!   fresh schemas, the same number in calls of `--bulk-size` (`enqueue_bulk`), after a
//!   `CHECKPOINT` (so no commit waits behind the WAL of a schema's creation). The two modes take
//!   turns, 100 tasks one by one or one bulk call at a time, and each one's time is the sum of
//!   its turns: the machine's speed drifts over seconds, and both modes see the same drifts;
//! - `drain`: `--tasks` no-op tasks committed in one transaction while one idle worker process
//!   (`canter worker --concurrency C`, a child of this process) waits; timed from the commit
//!   until the last task is finished (results kept), checked by a count; the worker's peak RSS
//!   (`VmHWM`) and CPU time are read before it is stopped, and the WAL the server wrote from
//!   start to end (`wal_bytes`; per task in the table: steadier than the time, for comparing
//!   what two versions write). The transaction ends with `ANALYZE`
//!   of the live table, as autovacuum would soon do (a server may run without it), and a
//!   `CHECKPOINT` comes before it, so no run pays for the previous one's dirty pages. Its end
//!   is the done notification of the last task (the bench registers as a result waiter), or
//!   with `--no-result-waiter` the first read of the live count, every 5 ms, that finds none:
//!   then no waiter is registered and finishes send no NOTIFY (schema 8);
//! - `latency`: an idle worker (in this process, on a runtime of its own), `--latency-tasks`
//!   tasks enqueued one at a time every `--interval-ms`; enqueue commit to handler start;
//! - `latency-under-load`: `--tasks` no-op tasks committed at once to a worker in this process,
//!   and a task of priority −1 every `--interval-ms` until they are done: the drain's rate,
//!   each urgent task's enqueue commit to handler start (no raw baseline), and the time the
//!   database's sessions and this process's threads waited for a core per time on one (from
//!   `/proc/<pid>/task/*/schedstat`, where the server runs on this machine): a drain that keeps
//!   every core busy delays each wake-up on the urgent path. The worker's urgent claims (its
//!   counters' `urgent_claim`) are reported too: their mean round trip and the share over
//!   5 ms. With `--task-wait-ms` each no-op
//!   first awaits a timer, as a handler waiting on I/O would, and the drain leaves the cores
//!   room (`--concurrency` sets how much);
//! - `history`: the drain again with `--history-tasks` finished tasks already stored;
//! - `drain_pgbouncer` (`--workload pgbouncer`, after the plain drain; no raw baseline): the
//!   drain with its workers through `--pooler-url`, a PgBouncer in transaction mode in front of
//!   the same database (`--transaction-pooler`, LISTEN on the direct URL);
//! - `drain_watched` (`--workload dashboards`, after the plain drain; no raw baseline): the
//!   drain while three dashboards (`canter_tokio::dashboard`, each on a pool of its own, as
//!   three `canter dashboard` processes would be) serve an open event stream each, so each
//!   reads its overview all along; with the count of readings and their mean time;
//! - `held-xmin` and `no-vacuum` (minutes each, so not in `all`): `--rate` tasks/s offered one
//!   by one for `--duration-s` to an idle worker (in this process) or to the raw `LISTEN` loop,
//!   with pickup latency (enqueue commit to start) and the live table's size and dead rows per
//!   `--window-s`; `held-xmin` while another session holds the xmin (`REPEATABLE READ` and a
//!   transaction id) from 20 s on for `--hold-s`, `no-vacuum` with autovacuum off on every
//!   table of the schema (see `steady`);
//! - `backend-kills` (not in `all`, no raw baseline): the steady load for a minute while every
//!   session of the bench but the killer's (the worker's, the producer's, the listener's and
//!   the liveness token's) is terminated with `pg_terminate_backend` every `--kill-every-ms`
//!   from 10 s to 50 s: pickup latency per window, and enqueues that failed.
//!
//! The raw baseline uses one table `jobs (id bigserial, state, payload jsonb, result jsonb, …)`
//! with a partial index on pending ids: enqueue is `INSERT … RETURNING id` (`unnest` for bulk)
//! with `pg_notify`; drain is `C` loops, each claiming `--raw-batch` rows with `FOR UPDATE SKIP
//! LOCKED`, running a no-op per row and writing the results back in one `UPDATE`; latency is
//! `LISTEN` plus that claim.
//!
//! Output: one JSON line per result on stdout, then (unless `--json-only`) a table of medians
//! with the canter/raw ratios and the targets of issue 8. Every line carries the load average
//! and `commit_ms`, the median time of a one-row autocommit insert just before the run: what a
//! WAL flush cost at the time, which bounds every serial step of a worker.

mod canter_mode;
mod raw_mode;
mod steady;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use canter_tokio::canter::config::Config;
use canter_tokio::canter::driver::wakeups::{NatsWakeups, RabbitMqWakeups, WakeupProvider};
use canter_tokio::canter::driver::{REQUEST_SECONDS_BUCKETS, RequestStats};
use canter_tokio::canter::postgres::PgSchema;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::connect::Database;
use crate::outln;
use crate::settings::WorkerSettings;

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    /// Bad options.
    #[error("{0}")]
    Usage(String),
    /// Something failed while running.
    #[error("{0}")]
    Failed(String),
}

impl BenchError {
    /// `Ok` with the message of a usage error (printed with the help), `Err` with the message
    /// of a failure.
    pub(crate) fn split(self) -> Result<String, String> {
        match self {
            BenchError::Usage(message) => Ok(message),
            BenchError::Failed(message) => Err(message),
        }
    }
}

fn failed(what: &str, error: impl std::fmt::Display) -> BenchError {
    BenchError::Failed(format!("{what}: {error}"))
}

/// `canter bench`: its options, each with its range.
#[derive(Debug, Clone, clap::Args)]
#[command(long_about = "Measure Canter against a raw-SQL baseline on the same database, each workload in a \
    fresh schema dropped afterwards, and print one JSON line per result and a table of medians.\n\n\
    The drain's worker is `canter worker` as a child process (this program, or --worker-bin), with \
    Config::throughput() (--prefetch-buffer 2048 --claim-lease-ms 60000 --completion-batch-max 5000) \
    and --worker-args laid over it. --tls runs each mode over plain TCP (sslmode=disable) and over TLS \
    (sslmode=require), with no raw baseline unless --baseline says so, and reports TLS/plain ratios; \
    task arguments then carry 200 bytes of padding. held-xmin, no-vacuum and backend-kills (not in \
    all: minutes each) offer --rate tasks/s to an idle worker and report pickup latency per window: \
    held-xmin while another session holds the xmin from 20 s for --hold-s (160 s in all), no-vacuum \
    with autovacuum off on the schema's tables (600 s), backend-kills while every session of the \
    bench is terminated every --kill-every-ms from 10 s to 50 s (60 s).")]
pub(crate) struct BenchArgs {
    /// The workloads to run
    #[arg(long, value_enum, default_value = "all")]
    workload: WorkloadArg,
    /// Which implementations to measure
    #[arg(long, value_enum)]
    baseline: Option<Baseline>,
    /// Runs of each workload
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// The worker's concurrency (and the raw baseline's loops)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    concurrency: u32,
    /// Print only the JSON lines
    #[arg(long)]
    json_only: bool,
    /// Tasks of a drain
    #[arg(long, value_name = "N", default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    tasks: u64,
    /// Tasks of the enqueue workloads
    #[arg(long, value_name = "N", default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    enqueue_tasks: u64,
    /// Tasks per bulk enqueue call
    #[arg(long, value_name = "N", default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    bulk_size: u64,
    /// Tasks of the latency workload
    #[arg(long, value_name = "N", default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    latency_tasks: u64,
    /// Milliseconds between latency probes
    #[arg(long, value_name = "MS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    interval_ms: u64,
    /// Finished tasks stored before the history drain
    #[arg(long, value_name = "N", default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(0..=100_000_000))]
    history_tasks: u64,
    /// Rows per raw claim
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    raw_batch: u32,
    /// Raw claim loops (default: the concurrency)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1_000))]
    raw_loops: Option<u32>,
    /// `canter worker` settings for the worker, e.g. '--prefetch-buffer 0' for hard-cap mode
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    worker_args: Option<String>,
    /// The `canter` program the drain's workers run (default: this one)
    #[arg(long, value_name = "PATH")]
    worker_bin: Option<PathBuf>,
    /// Run each mode over plain TCP and over TLS, and report the ratios
    #[arg(long)]
    tls: bool,
    /// Bytes of padding in each task's arguments (default 200 with --tls, else 0)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    payload_bytes: Option<u64>,
    /// Worker processes of the drains (the raw baseline: this many times its loops)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    workers: u32,
    /// Tasks a second the steady workloads offer
    #[arg(long, value_name = "N", default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    rate: u32,
    /// Seconds held-xmin holds the xmin (default 90)
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..=3_600))]
    hold_s: Option<u64>,
    /// Seconds a steady workload runs
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration_s: Option<u64>,
    /// Seconds per window of a steady workload's report
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..=3_600))]
    window_s: Option<u64>,
    /// Milliseconds between backend kills
    #[arg(long, value_name = "MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    kill_every_ms: u64,
    /// Concurrent producers of the enqueue workloads
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    producers: u32,
    /// The raw baseline enqueues without pg_notify
    #[arg(long)]
    raw_no_notify: bool,
    /// Milliseconds each no-op of latency-under-load's drain awaits a timer, as a handler
    /// waiting on I/O would (0: none, the drain as fast as the cores allow)
    #[arg(long, value_name = "MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    task_wait_ms: u64,
    /// Canter's enqueue workloads run beside a worker marked waiting for work (as an idle
    /// worker is), so every enqueue notifies; without, no worker waits and none does
    #[arg(long)]
    waiting_worker: bool,
    /// Time Canter's drains by reading the live count instead of by done notifications
    #[arg(long)]
    no_result_waiter: bool,
    /// A PgBouncer in transaction mode in front of the same database, for --workload
    /// pgbouncer (its workers get --transaction-pooler and this URL, LISTEN on the direct one)
    #[arg(long, value_name = "URL")]
    pooler_url: Option<String>,
    /// The RabbitMQ of --workload wakeups
    #[arg(long, value_name = "URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    rabbitmq_url: String,
    /// The NATS server of --workload wakeups
    #[arg(long, value_name = "URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
}

/// `--workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WorkloadArg {
    All,
    Enqueue,
    Drain,
    Latency,
    LatencyUnderLoad,
    History,
    HeldXmin,
    NoVacuum,
    BackendKills,
    /// The plain drain, then the drain with its worker through --pooler-url (PgBouncer in
    /// transaction mode) (no raw baseline)
    Pgbouncer,
    /// The plain drain, then the drain again with three dashboards open, each reading its
    /// overview for an open event stream (no raw baseline)
    Dashboards,
    /// Enqueues one by one announced by NOTIFY, on RabbitMQ and on NATS (interleaved), then
    /// the latency with each (no raw baseline; --producers 8 shows NOTIFY's commit lock)
    Wakeups,
    /// Isolated tasks (`canter worker --processes`): the time of a blocking no-op and a
    /// 1 ms task in a child process beside the blocking pool's, then a drain of blocking
    /// no-ops by a worker with 2 children beside one without (no raw baseline)
    Isolation,
    /// The plain drain, then workflows drained the same way: fan-out, fan-in, a chain and
    /// many small diamonds (the raw baseline runs the same graphs: jobs that count their
    /// unfinished parents, made pending by their last parent's completion, polled)
    Workflows,
}

/// `--baseline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Baseline {
    /// Canter and the raw baseline
    Both,
    /// Canter only
    None,
    /// The raw baseline only
    Raw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Workload {
    /// Enqueues one by one; `--workload enqueue` runs it and then [`Workload::EnqueueBulk`].
    EnqueueOne,
    /// Enqueues in calls of `--bulk-size`, in a fresh schema of its own.
    EnqueueBulk,
    Drain,
    Latency,
    /// Probes of priority -1 during a drain, in this process (no raw baseline).
    LatencyUnderLoad,
    /// The drain while three dashboards are open (no raw baseline).
    Watched,
    /// The drain with its worker through a pooler in transaction mode (no raw baseline).
    Pooled,
    History,
    /// A steady load while another session holds the xmin (see [`steady`]).
    HeldXmin,
    /// A steady load with autovacuum off (see [`steady`]).
    NoVacuum,
    /// A steady load while every session of the bench is terminated again and again (see
    /// [`steady`]; no raw baseline).
    BackendKills,
    /// One workflow: a root and `--tasks` - 1 children of it.
    FanOut,
    /// One workflow: `--tasks` - 1 parents of one child.
    FanIn,
    /// One workflow: a chain of at most 1,000 steps, each the child of the one before; its
    /// latency is the time from a parent's finish to its child's start.
    Chain,
    /// `--tasks` / 4 workflows of four steps, a diamond each.
    Diamonds,
    /// [`Workload::EnqueueOne`] announced on RabbitMQ instead of by NOTIFY.
    EnqueueOneRabbitmq,
    /// [`Workload::EnqueueOne`] announced on NATS instead of by NOTIFY.
    EnqueueOneNats,
    /// [`Workload::Latency`] with the wake-ups through RabbitMQ.
    LatencyRabbitmq,
    /// [`Workload::Latency`] with the wake-ups through NATS.
    LatencyNats,
    /// Blocking tasks one at a time in a child process and on the blocking pool.
    IsolatedOverhead,
    /// `--tasks` blocking no-ops drained by a worker in this process, on its blocking pool.
    DrainBlocking,
    /// The same drained by a worker whose tasks run in 2 child processes.
    DrainIsolated,
}

/// A broker that carries a workload's wake-ups instead of NOTIFY.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Rabbitmq,
    Nats,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::EnqueueOne => "enqueue_one",
            Workload::EnqueueBulk => "enqueue_bulk",
            Workload::Drain => "drain",
            Workload::Latency => "latency",
            Workload::LatencyUnderLoad => "latency_under_load",
            Workload::Watched => "drain_watched",
            Workload::Pooled => "drain_pgbouncer",
            Workload::History => "history",
            Workload::HeldXmin => "held_xmin",
            Workload::NoVacuum => "no_vacuum",
            Workload::BackendKills => "backend_kills",
            Workload::FanOut => "fan_out",
            Workload::FanIn => "fan_in",
            Workload::Chain => "chain",
            Workload::Diamonds => "diamonds",
            Workload::EnqueueOneRabbitmq => "enqueue_one_rabbitmq",
            Workload::EnqueueOneNats => "enqueue_one_nats",
            Workload::LatencyRabbitmq => "latency_rabbitmq",
            Workload::LatencyNats => "latency_nats",
            Workload::IsolatedOverhead => "isolated_overhead",
            Workload::DrainBlocking => "drain_blocking",
            Workload::DrainIsolated => "drain_isolated",
        }
    }

    /// The broker that carries its wake-ups, if not PostgreSQL.
    fn broker(self) -> Option<Broker> {
        match self {
            Workload::EnqueueOneRabbitmq | Workload::LatencyRabbitmq => Some(Broker::Rabbitmq),
            Workload::EnqueueOneNats | Workload::LatencyNats => Some(Broker::Nats),
            _ => None,
        }
    }

    /// Whether it enqueues (timed by its producers, the modes taking turns).
    fn enqueues(self) -> bool {
        matches!(
            self,
            Workload::EnqueueOne | Workload::EnqueueBulk | Workload::EnqueueOneRabbitmq | Workload::EnqueueOneNats
        )
    }
}

impl Options {
    /// A provider of `broker`'s wake-ups for `schema`'s queues.
    fn wakeups(&self, broker: Broker, schema: &PgSchema) -> Result<Arc<dyn WakeupProvider>, BenchError> {
        Ok(match broker {
            Broker::Rabbitmq => {
                Arc::new(RabbitMqWakeups::new(&self.rabbitmq_url, schema.name()).map_err(|e| failed("rabbitmq", e))?)
            }
            Broker::Nats => Arc::new(NatsWakeups::new(&self.nats_url, schema.name()).map_err(|e| failed("nats", e))?),
        })
    }
}

/// Which implementation a result measures, and over which transport: plain TCP, or TLS
/// (`--tls`: each mode runs over both, `sslmode=disable` and `sslmode=require`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    Canter,
    Raw,
    CanterTls,
    RawTls,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Canter => "canter",
            Mode::Raw => "raw",
            Mode::CanterTls => "canter_tls",
            Mode::RawTls => "raw_tls",
        }
    }

    fn is_raw(self) -> bool {
        matches!(self, Mode::Raw | Mode::RawTls)
    }

    fn tls(self) -> bool {
        matches!(self, Mode::CanterTls | Mode::RawTls)
    }

    /// The same implementation over TLS.
    fn over_tls(self) -> Mode {
        if self.is_raw() { Mode::RawTls } else { Mode::CanterTls }
    }
}

/// The options of one invocation.
#[derive(Debug, Clone)]
struct Options {
    url: String,
    workloads: Vec<Workload>,
    modes: Vec<Mode>,
    runs: u32,
    concurrency: u32,
    json_only: bool,
    tasks: usize,
    enqueue_tasks: usize,
    bulk_size: usize,
    latency_tasks: usize,
    interval: Duration,
    history_tasks: usize,
    raw_batch: u32,
    raw_loops: u32,
    /// Each mode over TLS too.
    tls: bool,
    /// Worker processes of the drains (raw: this many times `raw_loops`).
    workers: u32,
    /// Bytes of padding in every task's arguments (beside its number).
    payload_bytes: usize,
    /// The steady workloads' tasks a second.
    rate: u32,
    /// How long `held-xmin` holds the xmin, in seconds (`None`: its default).
    hold_s: Option<u64>,
    /// How long a steady workload runs, in seconds (`None`: its default).
    duration_s: Option<u64>,
    /// A steady workload's windows, in seconds (`None`: its default).
    window_s: Option<u64>,
    /// How often `backend-kills` terminates the bench's sessions.
    kill_every: Duration,
    /// Concurrent producers of the enqueue workloads, each on a connection of its own.
    producers: usize,
    /// The raw baseline enqueues without `pg_notify`.
    raw_quiet: bool,
    /// What each no-op of latency-under-load's drain awaits (zero: nothing).
    task_wait: Duration,
    /// Canter's enqueues run beside a worker marked waiting, so they notify.
    waiting_worker: bool,
    /// Canter's drains registered no result waiter (timed by reading the live count).
    no_result_waiter: bool,
    /// A pooler in transaction mode in front of the database (`--workload pgbouncer`).
    pooler_url: Option<String>,
    /// `--workload wakeups`: the one-by-one enqueue is NOTIFY's against the brokers'.
    wakeups: bool,
    /// The brokers of `--workload wakeups`.
    rabbitmq_url: String,
    nats_url: String,
    /// The worker's configuration: defaults, the bench's choices, then `--worker-args`.
    config: Config,
    worker_bin: PathBuf,
}

fn options(database: &Database, args: BenchArgs) -> Result<Options, BenchError> {
    let workloads = match args.workload {
        WorkloadArg::All => vec![
            Workload::EnqueueOne,
            Workload::EnqueueBulk,
            Workload::Drain,
            Workload::Latency,
            Workload::LatencyUnderLoad,
            Workload::History,
        ],
        WorkloadArg::Enqueue => vec![Workload::EnqueueOne, Workload::EnqueueBulk],
        WorkloadArg::Drain => vec![Workload::Drain],
        WorkloadArg::Latency => vec![Workload::Latency],
        WorkloadArg::LatencyUnderLoad => vec![Workload::LatencyUnderLoad],
        WorkloadArg::History => vec![Workload::History],
        WorkloadArg::HeldXmin => vec![Workload::HeldXmin],
        WorkloadArg::NoVacuum => vec![Workload::NoVacuum],
        WorkloadArg::BackendKills => vec![Workload::BackendKills],
        WorkloadArg::Dashboards => vec![Workload::Drain, Workload::Watched],
        WorkloadArg::Pgbouncer => {
            if args.pooler_url.is_none() {
                return Err(BenchError::Usage("--workload pgbouncer needs --pooler-url".to_owned()));
            }
            vec![Workload::Drain, Workload::Pooled]
        }
        WorkloadArg::Workflows => {
            vec![Workload::Drain, Workload::FanOut, Workload::FanIn, Workload::Chain, Workload::Diamonds]
        }
        WorkloadArg::Isolation => vec![Workload::IsolatedOverhead, Workload::DrainBlocking, Workload::DrainIsolated],
        WorkloadArg::Wakeups => {
            vec![Workload::EnqueueOne, Workload::Latency, Workload::LatencyRabbitmq, Workload::LatencyNats]
        }
    };
    let wakeups = args.workload == WorkloadArg::Wakeups;
    let no_raw = wakeups || args.workload == WorkloadArg::Isolation;
    let tls = args.tls;
    let mut modes = match args.baseline.unwrap_or(if tls || no_raw { Baseline::None } else { Baseline::Both }) {
        Baseline::Both => vec![Mode::Canter, Mode::Raw],
        Baseline::None => vec![Mode::Canter],
        Baseline::Raw => vec![Mode::Raw],
    };
    if tls {
        modes = modes.into_iter().flat_map(|mode| [mode, mode.over_tls()]).collect();
    }
    let url = database.url().map_err(|e| BenchError::Usage(format!("{e:?}")))?.to_owned();
    // The user's settings after the bench's: the last value of a flag wins.
    let config = worker_config(args.concurrency, args.worker_args.as_deref().unwrap_or_default())?;
    let concurrency = config.worker.concurrency;
    let worker_bin = match args.worker_bin {
        Some(path) => path,
        None => std::env::current_exe().map_err(|e| failed("cannot find this program", e))?,
    };
    let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    Ok(Options {
        url,
        workloads,
        modes,
        runs: args.runs,
        concurrency,
        json_only: args.json_only,
        tasks: size(args.tasks),
        enqueue_tasks: size(args.enqueue_tasks),
        bulk_size: size(args.bulk_size),
        latency_tasks: size(args.latency_tasks),
        interval: Duration::from_millis(args.interval_ms),
        history_tasks: size(args.history_tasks),
        raw_batch: args.raw_batch,
        raw_loops: args.raw_loops.unwrap_or(concurrency),
        workers: args.workers,
        tls,
        payload_bytes: size(args.payload_bytes.unwrap_or(if tls { 200 } else { 0 })),
        rate: args.rate,
        hold_s: args.hold_s,
        duration_s: args.duration_s,
        window_s: args.window_s,
        kill_every: Duration::from_millis(args.kill_every_ms),
        producers: args.producers as usize,
        raw_quiet: args.raw_no_notify,
        task_wait: Duration::from_millis(args.task_wait_ms),
        waiting_worker: args.waiting_worker,
        no_result_waiter: args.no_result_waiter,
        pooler_url: args.pooler_url.clone(),
        wakeups,
        rabbitmq_url: args.rabbitmq_url.clone(),
        nats_url: args.nats_url.clone(),
        config,
        worker_bin,
    })
}

/// The worker's configuration: `Config::throughput()` (soft caps, a buffer of up to 2,048
/// claims sized to the measured rate, large completion batches; of the buffers tried on the
/// reference machine, 256 to 4,096, the one with the best drain, while latency does not
/// depend on it) with `--concurrency` and `--worker-args` (the settings flags of
/// `canter worker`) laid over it.
fn worker_config(concurrency: u32, worker_args: &str) -> Result<Config, BenchError> {
    #[derive(Debug, clap::Parser)]
    #[command(name = "--worker-args", no_binary_name = true)]
    struct WorkerArgs {
        #[command(flatten)]
        settings: WorkerSettings,
    }
    let words = worker_args.split_whitespace();
    let mut parsed = <WorkerArgs as clap::Parser>::try_parse_from(words).map_err(|e| {
        BenchError::Usage(format!("--worker-args: {}", e.to_string().trim().trim_start_matches("error: ")))
    })?;
    parsed.settings.concurrency = parsed.settings.concurrency.or(Some(concurrency));
    parsed.settings.apply(&Config::throughput()).map_err(|e| BenchError::Usage(format!("--worker-args: {e}")))
}

/// One measured result.
#[derive(Debug, Clone)]
struct Sample {
    workload: &'static str,
    mode: Mode,
    run: u32,
    tasks: usize,
    seconds: f64,
    /// Latency percentiles in ms: p50, p90, p99, max.
    latency: Option<[f64; 4]>,
    /// The worker's peak resident set in MiB.
    peak_rss_mib: Option<f64>,
    /// Finished tasks stored before the run.
    history: Option<usize>,
    /// Claim passes (canter) or claim statements (raw) the run took.
    claims: Option<u64>,
    /// CPU seconds (user and system) the worker processes spent in the run.
    worker_cpu_s: Option<f64>,
    /// Worker processes (or raw loop groups) of a drain.
    workers: Option<u32>,
    /// The median time of a one-row autocommit insert just before the run, in ms: what a
    /// commit (a WAL flush) cost on this machine at the time.
    commit_ms: Option<f64>,
    /// A steady workload's plan and windows.
    windows: Option<(steady::Plan, Vec<steady::Window>)>,
    /// Dashboards open during the run: how many, the overviews they read, and the mean time
    /// of a read in ms.
    dashboards: Option<(u32, u64, f64)>,
    /// WAL the server wrote from the drain's start to its end, in bytes: what its writes
    /// cost, steadier from run to run than its time on a machine whose speed drifts.
    wal_bytes: Option<i64>,
    /// Time waited for a core per time on one during the run, of the database's sessions and
    /// of this process's threads (see [`core_wait_ratio`]), where the server runs here.
    core_wait: Option<[f64; 2]>,
    /// What each drained no-op awaited, in ms (`--task-wait-ms`), when it awaited anything.
    task_wait_ms: Option<u64>,
    /// The worker's urgent claims during the run, from its counters: how many, their mean
    /// round trip in ms, and the share of them that took over 5 ms.
    urgent_claims: Option<(u64, f64, f64)>,
}

impl Sample {
    fn new(workload: &'static str, mode: Mode, tasks: usize, seconds: f64) -> Self {
        Sample {
            workload,
            mode,
            run: 0,
            tasks,
            seconds,
            latency: None,
            peak_rss_mib: None,
            history: None,
            claims: None,
            worker_cpu_s: None,
            workers: None,
            commit_ms: None,
            windows: None,
            dashboards: None,
            wal_bytes: None,
            core_wait: None,
            task_wait_ms: None,
            urgent_claims: None,
        }
    }

    fn per_sec(&self) -> f64 {
        if self.seconds > 0.0 { self.tasks as f64 / self.seconds } else { 0.0 }
    }

    fn json(&self, concurrency: u32) -> Value {
        let mut line = json!({
            "workload": self.workload,
            "mode": self.mode.name(),
            "run": self.run,
            "tasks": self.tasks,
            "seconds": round(self.seconds, 4),
            "per_sec": round(self.per_sec(), 1),
            "concurrency": concurrency,
        });
        if let Some(workers) = self.workers {
            line["workers"] = json!(workers);
        }
        if let Some([p50, p90, p99, max]) = self.latency {
            line["p50_ms"] = json!(round(p50, 3));
            line["p90_ms"] = json!(round(p90, 3));
            line["p99_ms"] = json!(round(p99, 3));
            line["max_ms"] = json!(round(max, 3));
        }
        if let Some(rss) = self.peak_rss_mib {
            line["peak_rss_mib"] = json!(round(rss, 1));
        }
        if let Some(history) = self.history {
            line["history"] = json!(history);
        }
        if let Some(claims) = self.claims {
            line["claims"] = json!(claims);
        }
        if let Some(cpu) = self.worker_cpu_s {
            line["worker_cpu_s"] = json!(round(cpu, 2));
        }
        if let Some(commit) = self.commit_ms {
            line["commit_ms"] = json!(round(commit, 3));
        }
        if let Some(wal) = self.wal_bytes {
            line["wal_bytes"] = json!(wal);
        }
        if let Some([db, bench]) = self.core_wait {
            line["db_core_wait"] = json!(round(db, 3));
            line["bench_core_wait"] = json!(round(bench, 3));
        }
        if let Some(wait) = self.task_wait_ms {
            line["task_wait_ms"] = json!(wait);
        }
        if let Some((count, mean_ms, over_5ms)) = self.urgent_claims {
            line["urgent_claims"] = json!(count);
            line["urgent_claim_mean_ms"] = json!(round(mean_ms, 3));
            line["urgent_claims_over_5ms_share"] = json!(round(over_5ms, 3));
        }
        if let Some((dashboards, reads, read_ms)) = self.dashboards {
            line["dashboards"] = json!(dashboards);
            line["dashboard_reads"] = json!(reads);
            line["dashboard_read_ms"] = json!(round(read_ms, 2));
        }
        if let Some((plan, windows)) = &self.windows {
            line["windows"] = windows.iter().enumerate().map(|(i, w)| w.json(i, plan)).collect();
        }
        let [one, five, _] = load_average();
        line["load1"] = json!(one);
        line["load5"] = json!(five);
        line
    }
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// The 1, 5 and 15 minute load averages (zeros where `/proc/loadavg` is missing).
fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut parts = text.split_whitespace().map(|p| p.parse::<f64>().unwrap_or(0.0));
    [parts.next().unwrap_or(0.0), parts.next().unwrap_or(0.0), parts.next().unwrap_or(0.0)]
}

/// The `p`-th percentile (0 to 1) of sorted samples, nearest rank.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// The latency workload's enqueues, one every `interval`: when each committed, then the
/// sample once every handler has stamped its start.
struct Paced {
    ticks: tokio::time::Interval,
    began: tokio::time::Instant,
    committed: Vec<tokio::time::Instant>,
}

impl Paced {
    fn new(interval: Duration, n: usize) -> Paced {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Paced { ticks, began: tokio::time::Instant::now(), committed: Vec::with_capacity(n) }
    }

    /// Waits for the next enqueue's turn.
    async fn next(&mut self) {
        self.ticks.tick().await;
    }

    /// The enqueue just made has committed.
    fn committed(&mut self) {
        self.committed.push(tokio::time::Instant::now());
    }

    /// Waits (up to 30 s) until every enqueued task has its handler-start stamp: the sample of
    /// `mode`, each latency from enqueue commit to handler start.
    async fn sample(
        self,
        mode: Mode,
        stamps: &std::sync::Mutex<Vec<Option<tokio::time::Instant>>>,
    ) -> Result<Sample, BenchError> {
        let lock = || stamps.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self.committed.len();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let started = lock().iter().filter(|s| s.is_some()).count();
            if started >= n {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BenchError::Failed(format!("only {started} of {n} latency tasks started within 30 s")));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ms: Vec<f64> = self
            .committed
            .iter()
            .zip(lock().iter())
            .map(|(at, started)| started.map_or(f64::NAN, |s| s.saturating_duration_since(*at).as_secs_f64() * 1e3))
            .collect();
        let seconds = self.committed.last().map_or(0.0, |last| (*last - self.began).as_secs_f64());
        let mut sample = Sample::new("latency", mode, n, seconds);
        sample.latency = Some(latency_summary(ms));
        Ok(sample)
    }
}

/// p50, p90, p99 and max of latencies in ms.
fn latency_summary(mut ms: Vec<f64>) -> [f64; 4] {
    ms.sort_by(f64::total_cmp);
    [percentile(&ms, 0.5), percentile(&ms, 0.9), percentile(&ms, 0.99), ms.last().copied().unwrap_or(f64::NAN)]
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 })
}

/// A fresh schema for one run, dropped by [`Scratch::drop_now`].
struct Scratch {
    pool: PgPool,
    name: String,
    /// The mode that runs in it.
    mode: Mode,
    /// The URL its mode connects with: the transport its mode measures.
    url: String,
}

impl Scratch {
    async fn new(
        options: &Options,
        pool: &PgPool,
        workload: Workload,
        mode: Mode,
        run: u32,
    ) -> Result<Scratch, BenchError> {
        let name = format!("canter_bench_{}_{}_{}_{run}", workload.name(), mode.name(), std::process::id());
        let url = mode_url(options, mode);
        let scratch = Scratch { pool: pool.clone(), name, mode, url };
        scratch.drop_now().await?;
        Ok(scratch)
    }

    fn quoted(&self) -> String {
        format!("\"{}\"", self.name)
    }

    fn schema(&self) -> Result<PgSchema, BenchError> {
        PgSchema::new(&self.name).map_err(|e| failed("schema", e))
    }

    async fn drop_now(&self) -> Result<(), BenchError> {
        let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.quoted());
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&self.pool).await.map_err(|e| failed("drop schema", e))?;
        Ok(())
    }
}

/// The URL `mode` connects with: with `--tls`, `sslmode=require` for a TLS mode and
/// `sslmode=disable` for the others (a later `sslmode` in a query string wins); otherwise the
/// URL as given.
fn mode_url(options: &Options, mode: Mode) -> String {
    if !options.tls {
        return options.url.clone();
    }
    let sslmode = if mode.tls() { "require" } else { "disable" };
    let separator = if options.url.contains('?') { '&' } else { '?' };
    format!("{}{separator}sslmode={sslmode}", options.url)
}

/// `url` with its sessions named `canter-bench`, as [`connect`]'s are: for pools the bench does
/// not build itself (the in-process worker's), so that `backend-kills` finds them.
fn named_url(url: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name=canter-bench")
}

/// The arguments of the benchmark's task `i`: its number, and `--payload-bytes` of padding.
fn task_args(options: &Options, i: usize) -> Value {
    if options.payload_bytes == 0 {
        return json!({ "i": i });
    }
    json!({ "i": i, "pad": "x".repeat(options.payload_bytes) })
}

/// A lazily connecting pool of at most `size` for the system under test, without notices
/// (`DROP SCHEMA IF EXISTS` and cascades would log them), its sessions named `canter-bench`.
fn connect(url: &str, size: u32) -> Result<PgPool, BenchError> {
    connect_as(url, size, "canter-bench")
}

/// [`connect`] with sessions named `name`: the bench's own pool (schemas, sizes, the sessions
/// `backend-kills` terminates) is `canter-bench-admin`, and survives the kills.
fn connect_as(url: &str, size: u32, name: &str) -> Result<PgPool, BenchError> {
    let options: sqlx::postgres::PgConnectOptions =
        url.parse().map_err(|e| BenchError::Usage(format!("invalid database url: {e}")))?;
    let options = sqlx::ConnectOptions::disable_statement_logging(
        options.options([("client_min_messages", "warning")]).application_name(name),
    );
    // TCP_NODELAY as canter's own connections have it: both modes alike.
    Ok(canter_tokio::canter::postgres::pool_options(&options)
        .max_connections(size.max(2))
        .acquire_timeout(Duration::from_secs(30))
        // As canter's own `connect`: no ping (a round trip) before every statement.
        .test_before_acquire(false)
        .connect_lazy_with(options))
}

/// Flushes dirty buffers so a run does not pay for the previous run's writes (needs a
/// superuser or `pg_checkpoint`; skipped otherwise).
async fn checkpoint(pool: &PgPool) {
    let _ = sqlx::raw_sql("CHECKPOINT").execute(pool).await;
}

/// The server's WAL insert position in bytes (none on a standby, or where it cannot be read).
async fn wal_position(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetch_one(pool).await.ok()
}

/// The WAL written since `start` (a [`wal_position`]).
async fn wal_since(pool: &PgPool, start: Option<i64>) -> Option<i64> {
    Some(wal_position(pool).await? - start?)
}

/// Nanoseconds each thread of some processes spent on a core and waiting in the run queue for
/// one, by thread id (`/proc/<pid>/task/<tid>/schedstat`; empty where `/proc` lacks it).
type CoreTimes = BTreeMap<u32, (u64, u64)>;

/// The [`CoreTimes`] of the threads of `pids`.
fn core_times(pids: &[u32]) -> CoreTimes {
    let mut times = CoreTimes::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else { continue };
            let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
            let mut fields = text.split_whitespace().map(str::parse::<u64>);
            if let (Some(Ok(ran)), Some(Ok(waited))) = (fields.next(), fields.next()) {
                times.insert(tid, (ran, waited));
            }
        }
    }
    times
}

/// The pids of this database's client sessions, where the server runs on this machine (each
/// checked to be a `postgres` process here); empty otherwise.
async fn session_pids(pool: &PgPool) -> Vec<u32> {
    let sql = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'";
    let pids: Vec<i32> = sqlx::query_scalar(sql).fetch_all(pool).await.unwrap_or_default();
    pids.into_iter()
        .filter_map(|pid| u32::try_from(pid).ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres"))
        .collect()
}

/// How many urgent claims `requests` (a worker's counters) holds, their mean round trip in
/// ms, and the share of them over 5 ms (a bound of the counters' buckets); `None` without any.
fn urgent_claims(requests: &BTreeMap<&'static str, RequestStats>) -> Option<(u64, f64, f64)> {
    let urgent = requests.get("urgent_claim").filter(|r| r.count > 0)?;
    let within = REQUEST_SECONDS_BUCKETS.iter().position(|&bound| bound == 0.005)?;
    let fast: u64 = urgent.seconds_buckets[..=within].iter().sum();
    let count = urgent.count as f64;
    Some((urgent.count, urgent.seconds_sum * 1e3 / count, (urgent.count - fast) as f64 / count))
}

/// Milliseconds waited for a core per millisecond on one, from `before` to `after` (threads
/// born in between count from their start), or `None` with nothing measured.
fn core_wait_ratio(before: &CoreTimes, after: &CoreTimes) -> Option<f64> {
    let (mut ran, mut waited) = (0u64, 0u64);
    for (tid, (r, w)) in after {
        let (r0, w0) = before.get(tid).copied().unwrap_or((0, 0));
        ran += r.saturating_sub(r0);
        waited += w.saturating_sub(w0);
    }
    (ran > 0).then(|| waited as f64 / ran as f64)
}

/// Runs the benchmark with the command line's arguments.
pub(crate) async fn run(database: &Database, args: BenchArgs) -> Result<(), BenchError> {
    let options = options(database, args)?;
    let pool = connect_as(&options.url, 4, "canter-bench-admin")?;
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(&pool)
        .await
        .map_err(|e| failed("cannot reach the database", e))?;
    if options.tls {
        let ssl: String = sqlx::query_scalar("SHOW ssl").fetch_one(&pool).await.map_err(|e| failed("SHOW ssl", e))?;
        if ssl != "on" {
            return Err(BenchError::Usage(format!("--tls: the server does not offer TLS (ssl = {ssl})")));
        }
    }
    let started = load_average();
    if !options.json_only {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        outln!("canter bench: {version}");
        outln!(
            "{cores} cores, load average {:.2} {:.2} {:.2}; {} runs; worker concurrency {}; raw: {} loops claiming {}",
            started[0],
            started[1],
            started[2],
            options.runs,
            options.concurrency,
            options.raw_loops,
            options.raw_batch
        );
        if options.producers > 1 || options.raw_quiet {
            let quiet = if options.raw_quiet { "; raw enqueues send no pg_notify" } else { "" };
            outln!("enqueues from {} concurrent producers{quiet}", options.producers);
        }
        outln!("worker config: {}", serde_json::to_string(&options.config).map_err(|e| failed("config", e))?);
    }
    let mut samples = Vec::new();
    for &workload in &options.workloads {
        for run in 1..=options.runs {
            // Each run alternates which mode goes first, so a machine that speeds up or slows
            // down over a minute does not always favour the same one.
            let mut modes = options.modes.clone();
            if run % 2 == 0 {
                modes.reverse();
            }
            let results = match workload {
                Workload::EnqueueOne if options.wakeups => {
                    let against = [Workload::EnqueueOne, Workload::EnqueueOneRabbitmq, Workload::EnqueueOneNats];
                    let contestants: Vec<(Workload, Mode)> = against.iter().map(|&w| (w, Mode::Canter)).collect();
                    run_enqueue(&options, &pool, &contestants, run).await?
                }
                _ if workload.enqueues() => {
                    let contestants: Vec<(Workload, Mode)> = modes.iter().map(|&mode| (workload, mode)).collect();
                    run_enqueue(&options, &pool, &contestants, run).await?
                }
                _ => {
                    let mut results = Vec::new();
                    for &mode in &modes {
                        results.extend(run_one(&options, &pool, workload, mode, run).await?);
                    }
                    results
                }
            };
            for mut sample in results {
                sample.run = run;
                // Stdout is line-buffered: each result shows as soon as it is measured.
                outln!("{}", sample.json(options.concurrency));
                samples.push(sample);
            }
        }
    }
    if !options.json_only {
        let ended = load_average();
        outln!("{}", table(&samples, &options).trim_end_matches('\n'));
        outln!(
            "load average at start {:.2} {:.2} {:.2}, at end {:.2} {:.2} {:.2}",
            started[0],
            started[1],
            started[2],
            ended[0],
            ended[1],
            ended[2]
        );
    }
    pool.close().await;
    Ok(())
}

async fn run_one(
    options: &Options,
    pool: &PgPool,
    workload: Workload,
    mode: Mode,
    run: u32,
) -> Result<Vec<Sample>, BenchError> {
    let scratch = Scratch::new(options, pool, workload, mode, run).await?;
    let commit_ms = commit_latency(pool, &scratch).await?;
    let result = if mode.is_raw() {
        raw_mode::run(options, &scratch, workload).await
    } else {
        canter_mode::run(options, &scratch, workload).await
    };
    let dropped = scratch.drop_now().await;
    let mut samples = result?;
    dropped?;
    for sample in &mut samples {
        sample.commit_ms = Some(commit_ms);
    }
    Ok(samples)
}

/// `range` cut into `n` consecutive parts as even as can be (empty ones left out).
fn split_range(range: std::ops::Range<usize>, n: usize) -> Vec<std::ops::Range<usize>> {
    let (len, n) = (range.len(), n.max(1));
    (0..n).map(|k| range.start + len * k / n..range.start + len * (k + 1) / n).filter(|part| !part.is_empty()).collect()
}

/// Tasks a mode enqueues one by one before the other mode takes its turn.
const ONE_BY_ONE_BLOCK: usize = 100;

/// One mode's client in an enqueue workload.
enum Enqueuer {
    Canter(canter_mode::CanterEnqueuer),
    Raw(raw_mode::RawEnqueuer),
}

impl Enqueuer {
    /// Sets up `mode`'s client on `scratch` (before any clock starts).
    async fn new(options: &Options, scratch: &Scratch, workload: Workload) -> Result<Enqueuer, BenchError> {
        Ok(if scratch.mode.is_raw() {
            Enqueuer::Raw(raw_mode::RawEnqueuer::new(options, scratch).await?)
        } else {
            Enqueuer::Canter(canter_mode::CanterEnqueuer::new(options, scratch, workload.broker()).await?)
        })
    }

    async fn enqueue(&mut self, range: std::ops::Range<usize>, bulk: bool) -> Result<(), BenchError> {
        match self {
            Enqueuer::Canter(client) => client.enqueue(range, bulk).await,
            Enqueuer::Raw(client) => client.enqueue(range, bulk).await,
        }
    }

    async fn close(self) {
        match self {
            Enqueuer::Canter(client) => client.close().await,
            Enqueuer::Raw(client) => client.close().await,
        }
    }
}

/// An enqueue workload, every mode in a fresh schema of its own. The modes take turns, a block
/// at a time ([`ONE_BY_ONE_BLOCK`] tasks one by one, or one call of `--bulk-size`), the first
/// alternating, so that the machine's drifts in speed (seconds long here) fall on all alike;
/// a mode's time is the sum of its blocks'.
async fn run_enqueue(
    options: &Options,
    pool: &PgPool,
    contestants: &[(Workload, Mode)],
    run: u32,
) -> Result<Vec<Sample>, BenchError> {
    let bulk = contestants.iter().any(|(workload, _)| *workload == Workload::EnqueueBulk);
    let mut scratches = Vec::new();
    let result = async {
        // Per contestant: its sample (commit probe kept, time summed over its turns) and its client.
        let mut turns = Vec::new();
        for &(workload, mode) in contestants {
            scratches.push(Scratch::new(options, pool, workload, mode, run).await?);
            let scratch = scratches.last().expect("just pushed");
            let mut sample = Sample::new(workload.name(), mode, options.enqueue_tasks, 0.0);
            sample.commit_ms = Some(commit_latency(pool, scratch).await?);
            turns.push((sample, Enqueuer::new(options, scratch, workload).await?));
        }
        // Neither mode's commits wait behind the WAL of the schemas' creation.
        checkpoint(pool).await;
        let n = options.enqueue_tasks;
        let block = if bulk { options.bulk_size } else { ONE_BY_ONE_BLOCK };
        let (mut done, mut turn) = (0, 0);
        while done < n {
            let range = done..(done + block).min(n);
            for k in 0..turns.len() {
                let (sample, client) = &mut turns[(k + turn) % contestants.len()];
                let start = tokio::time::Instant::now();
                client.enqueue(range.clone(), bulk).await?;
                sample.seconds += start.elapsed().as_secs_f64();
            }
            (done, turn) = (range.end, turn + 1);
        }
        let mut samples = Vec::with_capacity(turns.len());
        for (sample, client) in turns {
            client.close().await;
            samples.push(sample);
        }
        Ok::<_, BenchError>(samples)
    }
    .await;
    // Every schema goes, whatever failed; the workload's own error comes first.
    let mut dropped = Ok(());
    for scratch in &scratches {
        let outcome = scratch.drop_now().await;
        if dropped.is_ok() {
            dropped = outcome;
        }
    }
    let samples = result?;
    dropped?;
    Ok(samples)
}

/// The median of 15 one-row autocommit inserts, in ms (each waits for its WAL flush).
async fn commit_latency(pool: &PgPool, scratch: &Scratch) -> Result<f64, BenchError> {
    let s = scratch.quoted();
    let setup = format!("CREATE SCHEMA {s}; CREATE TABLE {s}.commit_probe (x integer)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(setup)).execute(pool).await.map_err(|e| failed("commit probe", e))?;
    let mut conn = pool.acquire().await.map_err(|e| failed("commit probe", e))?;
    let insert = format!("INSERT INTO {s}.commit_probe VALUES (1)");
    let mut times = Vec::with_capacity(15);
    for _ in 0..15 {
        let start = tokio::time::Instant::now();
        sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
            .execute(&mut *conn)
            .await
            .map_err(|e| failed("commit probe", e))?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    drop(conn);
    scratch.drop_now().await?;
    Ok(median(times).unwrap_or(f64::NAN))
}

/// The readable summary: medians per workload and mode, ratios and targets.
fn table(samples: &[Sample], options: &Options) -> String {
    let medians = Medians::new(samples);
    let med = |workload: &str, mode: Mode, f: &dyn Fn(&Sample) -> Option<f64>| medians.of(workload, mode, f);
    let rate = |s: &Sample| Some(s.per_sec());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nmedians of {} runs\n{:<14} {:<14} {:>12} {:>12} {:>10}   target",
        options.runs, "workload", "metric", "canter", "raw", "canter/raw"
    );
    let cell = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"));
    let mut row =
        |workload: &str, metric: &str, canter: Option<f64>, raw: Option<f64>, digits: usize, target: String| {
            let ratio = match (canter, raw) {
                (Some(c), Some(r)) if r != 0.0 => format!("{:.2}", c / r),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "{:<14} {:<14} {:>12} {:>12} {:>10}   {}",
                workload,
                metric,
                cell(canter, digits),
                cell(raw, digits),
                ratio,
                target
            );
        };
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "ok",
        Some(false) => "MISSED",
        None => "n/a",
    };
    let both = |a: Option<bool>, b: Option<bool>| match (a, b) {
        (Some(a), Some(b)) => Some(a && b),
        (Some(a), None) | (None, Some(a)) => Some(a),
        (None, None) => None,
    };
    let ratio_at_least = |c: Option<f64>, r: Option<f64>, k: f64| Some(c? >= k * r?);

    let one = (med("enqueue_one", Mode::Canter, &rate), med("enqueue_one", Mode::Raw, &rate));
    if one.0.is_some() || one.1.is_some() {
        let ok = ratio_at_least(one.0, one.1, 0.9);
        row("enqueue_one", "tasks/s", one.0, one.1, 0, format!("≥ 0.9 × raw: {}", verdict(ok)));
    }
    let bulk = (med("enqueue_bulk", Mode::Canter, &rate), med("enqueue_bulk", Mode::Raw, &rate));
    if bulk.0.is_some() || bulk.1.is_some() {
        let ok = both(bulk.0.map(|c| c >= 100_000.0), ratio_at_least(bulk.0, bulk.1, 0.7));
        row("enqueue_bulk", "tasks/s", bulk.0, bulk.1, 0, format!("≥ 100000/s and ≥ 0.7 × raw: {}", verdict(ok)));
    }
    let drain = (med("drain", Mode::Canter, &rate), med("drain", Mode::Raw, &rate));
    if drain.0.is_some() || drain.1.is_some() {
        let ok = both(drain.0.map(|c| c >= 42_000.0), ratio_at_least(drain.0, drain.1, 0.8));
        row("drain", "tasks/s", drain.0, drain.1, 0, format!("≥ 42000/s and ≥ 0.8 × raw: {}", verdict(ok)));
        let rss = med("drain", Mode::Canter, &|s: &Sample| s.peak_rss_mib);
        row("drain", "peak RSS MiB", rss, None, 1, format!("≤ 64 MiB: {}", verdict(rss.map(|r| r <= 64.0))));
    }
    let wal = |s: &Sample| s.wal_bytes.map(|b| b as f64 / s.tasks.max(1) as f64);
    let wal_of = |workload: &str| (med(workload, Mode::Canter, &wal), med(workload, Mode::Raw, &wal));
    let (c, r) = wal_of("drain");
    if c.is_some() || r.is_some() {
        row("drain", "WAL B/task", c, r, 0, String::new());
    }
    for workload in ["fan_out", "fan_in", "diamonds"] {
        let (c, r) = (med(workload, Mode::Canter, &rate), med(workload, Mode::Raw, &rate));
        if c.is_some() || r.is_some() {
            let ok = ratio_at_least(c, drain.0, 0.8);
            row(workload, "tasks/s", c, r, 0, format!("≥ 0.8 × canter's drain: {}", verdict(ok)));
        }
        let (c, r) = wal_of(workload);
        if c.is_some() || r.is_some() {
            row(workload, "WAL B/task", c, r, 0, String::new());
        }
    }
    for (i, name) in ["step p50 ms", "step p90 ms", "step p99 ms", "step max ms"].iter().enumerate() {
        let pick = move |s: &Sample| s.latency.map(|l| l[i]);
        let (c, r) = (med("chain", Mode::Canter, &pick), med("chain", Mode::Raw, &pick));
        if c.is_some() || r.is_some() {
            let target = if i == 0 { format!("≤ 2 ms: {}", verdict(c.map(|c| c <= 2.0))) } else { String::new() };
            row("chain", name, c, r, 3, target);
        }
    }
    let names = ["p50 ms", "p90 ms", "p99 ms", "max ms"];
    for (i, name) in names.iter().enumerate() {
        let pick = move |s: &Sample| s.latency.map(|l| l[i]);
        let (c, r) = (med("latency", Mode::Canter, &pick), med("latency", Mode::Raw, &pick));
        if c.is_none() && r.is_none() {
            continue;
        }
        let target = match i {
            0 => format!("≤ 1 ms: {}", verdict(c.map(|c| c <= 1.0))),
            2 => format!("≤ 3 ms: {}", verdict(c.map(|c| c <= 3.0))),
            _ => String::new(),
        };
        row("latency", name, c, r, 3, target);
    }
    for broker in ["rabbitmq", "nats"] {
        let workload = format!("enqueue_one_{broker}");
        let announced = med(&workload, Mode::Canter, &rate);
        if announced.is_some() {
            row(&workload, "tasks/s", announced, None, 0, String::new());
            let ratio = |b: Option<f64>, n: Option<f64>| Some(b? / n?);
            row(&format!("{broker}/notify"), "enqueue ratio", ratio(announced, one.0), None, 2, String::new());
        }
        let workload = format!("latency_{broker}");
        for (i, name) in names.iter().enumerate() {
            let pick = move |s: &Sample| s.latency.map(|l| l[i]);
            let c = med(&workload, Mode::Canter, &pick);
            if c.is_some() {
                row(&workload, name, c, None, 3, String::new());
            }
        }
    }
    for name in ["blocking_0ms", "isolated_0ms", "blocking_1ms", "isolated_1ms"] {
        for (i, metric) in names.iter().enumerate() {
            let pick = move |s: &Sample| s.latency.map(|l| l[i]);
            if let Some(c) = med(name, Mode::Canter, &pick) {
                row(name, &format!("task {metric}"), Some(c), None, 3, String::new());
            }
        }
    }
    let (blocking, isolated) = (med("drain_blocking", Mode::Canter, &rate), med("drain_isolated", Mode::Canter, &rate));
    if blocking.is_some() || isolated.is_some() {
        row("drain_blocking", "tasks/s", blocking, None, 0, String::new());
        row("drain_isolated", "tasks/s", isolated, None, 0, String::new());
        let ratio = |i: Option<f64>, b: Option<f64>| Some(i? / b?);
        row("isolated/block", "drain ratio", ratio(isolated, blocking), None, 2, String::new());
    }
    let pooled = med("drain_pgbouncer", Mode::Canter, &rate);
    if pooled.is_some() {
        row("pgbouncer", "drain tasks/s", pooled, None, 0, String::new());
        let ratio = |p: Option<f64>, d: Option<f64>| Some(p? / d?);
        row("pgbouncer/drain", "ratio", ratio(pooled, drain.0), None, 2, String::new());
    }
    let watched = med("drain_watched", Mode::Canter, &rate);
    if watched.is_some() {
        let ok = ratio_at_least(watched, drain.0, 0.9);
        let target = format!("≥ 0.9 × canter's drain: {}", verdict(ok));
        row("3 dashboards", "drain tasks/s", watched, None, 0, target);
        let ratio = |w: Option<f64>, d: Option<f64>| Some(w? / d?);
        row("watched/drain", "ratio", ratio(watched, drain.0), None, 2, String::new());
        let reads = med("drain_watched", Mode::Canter, &|s: &Sample| s.dashboards.map(|d| d.1 as f64));
        row("3 dashboards", "reads", reads, None, 0, String::new());
        let read_ms = med("drain_watched", Mode::Canter, &|s: &Sample| s.dashboards.map(|d| d.2));
        row("3 dashboards", "read ms", read_ms, None, 1, String::new());
    }
    let under_load = med("latency_under_load", Mode::Canter, &rate);
    if under_load.is_some() {
        let ok = ratio_at_least(under_load, drain.0, 0.9);
        let target = format!("≥ 0.9 × canter's drain: {}", verdict(ok));
        row("under load", "drain tasks/s", under_load, None, 0, target);
        for (i, name) in names.iter().enumerate() {
            let pick = move |s: &Sample| s.latency.map(|l| l[i]);
            let c = med("latency_under_load", Mode::Canter, &pick);
            let target = if i == 2 { format!("≤ 5 ms: {}", verdict(c.map(|c| c <= 5.0))) } else { String::new() };
            row("under load", &format!("urgent {name}"), c, None, 3, target);
        }
        for (i, whose) in ["db", "bench"].iter().enumerate() {
            let wait = med("latency_under_load", Mode::Canter, &|s: &Sample| s.core_wait.map(|w| w[i]));
            if wait.is_some() {
                row("under load", &format!("{whose} core wait/run"), wait, None, 2, String::new());
            }
        }
        let mean = med("latency_under_load", Mode::Canter, &|s: &Sample| s.urgent_claims.map(|u| u.1));
        if mean.is_some() {
            row("under load", "urgent claim mean ms", mean, None, 3, String::new());
            let over = med("latency_under_load", Mode::Canter, &|s: &Sample| s.urgent_claims.map(|u| u.2 * 100.0));
            row("under load", "urgent claims > 5 ms %", over, None, 1, String::new());
        }
    }
    let history = (med("history", Mode::Canter, &rate), med("history", Mode::Raw, &rate));
    if history.0.is_some() || history.1.is_some() {
        let ok = ratio_at_least(history.0, drain.0, 0.9);
        row("history", "tasks/s", history.0, history.1, 0, format!("≥ 0.9 × canter's drain: {}", verdict(ok)));
        let ratio = |h: Option<f64>, d: Option<f64>| Some(h? / d?);
        row("history/drain", "ratio", ratio(history.0, drain.0), ratio(history.1, drain.1), 2, String::new());
        let rss = med("history", Mode::Canter, &|s: &Sample| s.peak_rss_mib);
        row("history", "peak RSS MiB", rss, None, 1, String::new());
    }
    if options.tls {
        tls_rows(&mut out, &medians);
    }
    for workload in [Workload::HeldXmin, Workload::NoVacuum, Workload::BackendKills] {
        steady_rows(&mut out, &medians, workload);
    }
    let commits: Vec<f64> = samples.iter().filter_map(|s| s.commit_ms).collect();
    if let (Some(low), Some(mid), Some(high)) =
        (commits.iter().copied().reduce(f64::min), median(commits.clone()), commits.iter().copied().reduce(f64::max))
    {
        let _ =
            writeln!(out, "one-row commit (WAL flush) before each run: median {mid:.2} ms, {low:.2} to {high:.2} ms");
    }
    let cpu =
        |workload: &str| med(workload, Mode::Canter, &|s: &Sample| s.worker_cpu_s.map(|c| c * 1e6 / s.tasks as f64));
    if let Some(us) = cpu("drain") {
        let _ = writeln!(out, "worker CPU per drained task: {us:.1} µs (median of runs)");
    }
    out
}

/// The samples by workload and mode, for medians.
struct Medians<'a> {
    by: BTreeMap<(&'a str, Mode), Vec<&'a Sample>>,
}

impl<'a> Medians<'a> {
    fn new(samples: &'a [Sample]) -> Medians<'a> {
        let mut by: BTreeMap<(&str, Mode), Vec<&Sample>> = BTreeMap::new();
        for sample in samples {
            by.entry((sample.workload, sample.mode)).or_default().push(sample);
        }
        Medians { by }
    }

    /// The median of `f` over the samples of `workload` in `mode`.
    fn of(&self, workload: &str, mode: Mode, f: &dyn Fn(&Sample) -> Option<f64>) -> Option<f64> {
        median(self.by.get(&(workload, mode))?.iter().filter_map(|s| f(s)).collect())
    }
}

/// A steady workload's part of the summary: per window, the medians over runs of each mode's
/// pickup p50 and p99 and its live table's size.
fn steady_rows(out: &mut String, medians: &Medians<'_>, workload: Workload) {
    let plan_of = |mode| medians.by.get(&(workload.name(), mode))?.iter().find_map(|s| s.windows.as_ref().map(|w| w.0));
    let Some(plan) = plan_of(Mode::Canter).or_else(|| plan_of(Mode::Raw)) else { return };
    let held = plan.hold.map_or(String::new(), |(from, until)| {
        format!(", xmin held from {} s to {} s", from.as_secs(), until.as_secs())
    });
    let vacuum = if plan.no_autovacuum { ", autovacuum off" } else { "" };
    let _ = writeln!(
        out,
        "\n{}: {} tasks/s for {} s{held}{vacuum}; pickup by window of enqueue (medians of runs)\n\
         {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        workload.name(),
        plan.rate,
        plan.duration.as_secs(),
        "from s",
        "canter p50",
        "p99",
        "live MiB",
        "raw p50",
        "p99",
        "live MiB"
    );
    let windows = (plan.duration.as_millis().div_ceil(plan.window.as_millis().max(1))) as usize;
    let cell = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"));
    for w in 0..windows {
        let pick = |mode: Mode, f: &dyn Fn(&steady::Window) -> f64| {
            medians.of(workload.name(), mode, &|s: &Sample| s.windows.as_ref().and_then(|(_, ws)| ws.get(w)).map(f))
        };
        let row: Vec<String> = [Mode::Canter, Mode::Raw]
            .into_iter()
            .flat_map(|mode| {
                [
                    cell(pick(mode, &|w| w.latency[0]), 2),
                    cell(pick(mode, &|w| w.latency[2]), 2),
                    cell(pick(mode, &|w| w.live_mib), 1),
                ]
            })
            .collect();
        let _ = writeln!(
            out,
            "{:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            w as u64 * plan.window.as_secs(),
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5]
        );
    }
}

/// The TLS part of the summary: each mode over TLS against itself over plain TCP, as speed
/// ratios (throughput TLS/plain; latency plain/TLS, so that 1 is "as fast" in both).
fn tls_rows(out: &mut String, medians: &Medians<'_>) {
    let _ = writeln!(
        out,
        "\nover TLS (sslmode=require) against plain TCP (sslmode=disable)\n{:<20} {:<8} {:>12} {:>12} {:>8}   target",
        "workload", "metric", "plain", "tls", "speed"
    );
    let rate = |s: &Sample| Some(s.per_sec());
    for base in [Mode::Canter, Mode::Raw] {
        let tls = base.over_tls();
        let mut row = |workload: &str, metric: &str, f: &dyn Fn(&Sample) -> Option<f64>, throughput: bool| {
            let (Some(plain), Some(over_tls)) = (medians.of(workload, base, f), medians.of(workload, tls, f)) else {
                return;
            };
            let speed = if throughput { over_tls / plain } else { plain / over_tls };
            let targeted =
                matches!((workload, metric), ("enqueue_bulk" | "drain", _) | ("latency", "p50 ms" | "p99 ms"));
            let verdict = if speed >= 0.9 { "ok" } else { "MISSED" };
            let target = if targeted { format!("≥ 0.9: {verdict}") } else { String::new() };
            let digits = if throughput { 0 } else { 3 };
            let label = format!("{} {workload}", base.name());
            let _ = writeln!(
                out,
                "{label:<20} {metric:<8} {plain:>12.digits$} {over_tls:>12.digits$} {speed:>8.2}   {target}"
            );
        };
        for workload in ["enqueue_one", "enqueue_bulk", "drain", "history"] {
            row(workload, "tasks/s", &rate, true);
        }
        for (i, name) in ["p50 ms", "p90 ms", "p99 ms", "max ms"].into_iter().enumerate() {
            row("latency", name, &move |s: &Sample| s.latency.map(|l| l[i]), false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.5), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&sorted, 1.0), 100.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn urgent_claims_read_the_counters_buckets() {
        let counters = canter_tokio::canter::driver::Counters::new();
        assert_eq!(urgent_claims(&counters.requests()), None);
        counters.record_request("claim", Duration::from_millis(40), 2_000, true);
        for ms in [1, 2, 5, 8] {
            counters.record_request("urgent_claim", Duration::from_millis(ms), 1, true);
        }
        let (count, mean_ms, over_5ms) = urgent_claims(&counters.requests()).expect("four urgent claims");
        assert_eq!((count, over_5ms), (4, 0.25), "one of four took over 5 ms (5 ms itself is within)");
        assert!((mean_ms - 4.0).abs() < 1e-9, "{mean_ms}");
    }

    #[test]
    fn core_wait_counts_threads_born_during_the_run() {
        let before = CoreTimes::from([(1, (1_000, 500)), (2, (2_000, 0))]);
        // Thread 1 ran 1,000 ns more and waited 1,500 more; 2 did nothing; 3 was born and ran
        // 2,000 ns, waiting 500.
        let after = CoreTimes::from([(1, (2_000, 2_000)), (2, (2_000, 0)), (3, (2_000, 500))]);
        assert_eq!(core_wait_ratio(&before, &after), Some(2_000.0 / 3_000.0));
        assert_eq!(core_wait_ratio(&before, &before), None);
        // This process has threads, and each has its times where /proc has them.
        let own = core_times(&[std::process::id()]);
        if std::path::Path::new("/proc/self/task").exists() {
            assert!(!own.is_empty());
        }
    }

    #[test]
    fn worker_args_become_settings() {
        let config =
            worker_config(16, "--prefetch-buffer 48 --claim-lease-ms 60000 --completion-batch-max 900").unwrap();
        assert_eq!(config.worker.concurrency, 16);
        assert_eq!(config.app.prefetch_buffer, 48);
        assert_eq!(config.worker.completion_batch_max, 900);
        let overridden = worker_config(16, "--concurrency 8").unwrap();
        assert_eq!(overridden.worker.concurrency, 8);
        assert!(worker_config(16, "--no-such-setting 1").is_err());
        assert!(worker_config(16, "stray").is_err());
    }
}
