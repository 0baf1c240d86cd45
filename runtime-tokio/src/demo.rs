//! `canter demo`: a mixed load through several workers, with progress while it drains and a
//! summary at the end. On the embedded in-memory store unless a database URL is given.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use canter::config::{AppConfig, CustomQueue, QueueMode, RecoveryConfig, RetryPolicy, WorkerConfig};
use canter::driver::{self, DriverOptions, MemoryBackend, Runtime, WorkerService};
use canter::memory::MemoryStore;
use canter::postgres::PgSchema;
use canter::rng::Rng;
use canter::store::{DbTime, NewTask, RunAt};
use canter::task::{ErrorCode, TaskId, TaskState, WorkerId};
use canter::worker::{Event, Input, Worker};
use futures::channel::mpsc;
use serde_json::json;

use crate::cli::Args;
use crate::{Client, TokioRuntime, builtins, outln};

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// Bad options.
    #[error("{0}")]
    Usage(String),
    /// Something failed while running.
    #[error("{0}")]
    Failed(String),
    /// The output's reader went away (`canter demo | head`); the demo stopped and cleaned up.
    #[error("the output was closed")]
    OutputClosed,
}

impl DemoError {
    fn output(error: std::io::Error) -> Self {
        match error.kind() {
            std::io::ErrorKind::BrokenPipe => DemoError::OutputClosed,
            _ => DemoError::Failed(format!("cannot write the output: {error}")),
        }
    }
}

struct Options {
    tasks: usize,
    workers: usize,
    concurrency: u32,
    url: Option<String>,
}

fn options(raw: &[String]) -> Result<Options, DemoError> {
    let args = Args::parse(raw, &["tasks", "workers", "concurrency", "database-url"], &[], false)
        .map_err(|e| DemoError::Usage(e.0))?;
    let number = |name: &str, default: usize, max: usize| -> Result<usize, DemoError> {
        let value = args.parsed::<usize>(name).map_err(|e| DemoError::Usage(e.0))?.unwrap_or(default);
        if value == 0 || value > max {
            return Err(DemoError::Usage(format!("--{name} must be 1 to {max}")));
        }
        Ok(value)
    };
    Ok(Options {
        tasks: number("tasks", 2_000, 1_000_000)?,
        workers: number("workers", 3, 64)?,
        concurrency: number("concurrency", 16, 1_000)? as u32,
        url: args
            .value("database-url")
            .map(str::to_owned)
            .or_else(|| std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty())),
    })
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

fn load(count: usize) -> Vec<NewTask> {
    let mut rng = Rng::new(2026);
    let flaky = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    (0..count)
        .map(|i| {
            let task = match rng.range(0, 100) {
                0..=54 => NewTask::new("sleep", json!({"ms": rng.range(1, 20)})),
                55..=74 => NewTask::new("echo", json!({"i": i})).queue("fast"),
                75..=89 => NewTask::new("cpu", json!({"iterations": rng.range(10_000, 200_000)})).queue("bulk"),
                90..=95 => NewTask::new("fail", json!({"code": "FLAKY"})).retry(flaky.clone()),
                96..=97 => NewTask::new("panic", json!({})),
                _ => NewTask::new("sleep", json!({"ms": 5})).run_at(RunAt::DelayMs(rng.range(100, 1_500))),
            };
            task.priority(rng.range(0, 3) as i16)
        })
        .collect()
}

/// When each task was enqueued, started and finished, from the workers' hooks.
#[derive(Default)]
struct Timeline {
    enqueued: BTreeMap<TaskId, Instant>,
    started: BTreeMap<TaskId, Instant>,
    finished: BTreeMap<TaskId, Instant>,
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
        Event::Finished { task, .. } | Event::Expired { task } => {
            t.finished.insert(*task, now);
        }
        _ => {}
    }
}

/// Where the demo's tasks live.
enum Backend {
    Memory(MemoryBackend),
    Postgres { client: Client, schema: PgSchema },
}

impl Backend {
    async fn counts(&self) -> Result<BTreeMap<TaskState, u64>, DemoError> {
        let by_queue = match self {
            Backend::Memory(backend) => backend.with_store(|store, _| store.counts()),
            Backend::Postgres { client, .. } => client.counts().await.map_err(|e| DemoError::Failed(e.to_string()))?,
        };
        let mut counts = BTreeMap::new();
        for ((_, state), n) in by_queue {
            *counts.entry(state).or_default() += n;
        }
        Ok(counts)
    }
}

/// Runs the demo with the command line's arguments.
pub async fn run(raw: &[String]) -> Result<(), DemoError> {
    let options = options(raw)?;
    let runtime = Arc::new(TokioRuntime);
    let app = app();
    let registry = Arc::new(builtins::registry());
    let timeline = Arc::new(Mutex::new(Timeline::default()));
    let config = WorkerConfig {
        concurrency: options.concurrency,
        poll_interval_ms: 1_000,
        handler_timeout_ms: Some(5_000),
        ..WorkerConfig::default()
    };
    let (stop_tx, stop_rx) = futures::channel::oneshot::channel::<()>();
    let stop = futures::FutureExt::shared(async move {
        let _ = stop_rx.await;
    });

    let tasks = load(options.tasks);
    let mut workers = Vec::new();
    let backend = match &options.url {
        None => {
            outln!(
                "canter demo: {} tasks, {} workers x concurrency {}, on the embedded in-memory store \
                 (give --database-url or DATABASE_URL to use PostgreSQL)",
                options.tasks,
                options.workers,
                options.concurrency
            );
            let clock = runtime.clone();
            let backend =
                MemoryBackend::new(MemoryStore::new(app.clone()), DbTime(1_700_000_000_000), move || clock.now());
            for i in 0..options.workers {
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
                workers.push(tokio::spawn(async move { Ok(run.await) }));
            }
            let now = runtime.now();
            let ids = backend
                .with_store(|store, db_now| store.enqueue_many(tasks, db_now))
                .map_err(|e| DemoError::Failed(e.to_string()))?;
            timeline.lock().unwrap_or_else(std::sync::PoisonError::into_inner).enqueued =
                ids.into_iter().map(|id| (id, now)).collect();
            Backend::Memory(backend)
        }
        Some(url) => {
            let schema = PgSchema::new(&format!("canter_demo_{}", std::process::id()))
                .map_err(|e| DemoError::Failed(e.to_string()))?;
            outln!(
                "canter demo: {} tasks, {} workers x concurrency {}, on PostgreSQL (schema {}, dropped at the end)",
                options.tasks,
                options.workers,
                options.concurrency,
                schema.name()
            );
            let pool = crate::connect(url, 8 + 4 * options.workers as u32)
                .map_err(|e| DemoError::Usage(format!("invalid database url: {e}")))?;
            let client = Client::new(runtime.clone(), pool.clone(), schema.clone(), app.clone());
            client
                .store()
                .migrate()
                .await
                .map_err(|e| DemoError::Failed(format!("cannot reach or migrate the database: {e}")))?;
            for i in 0..options.workers {
                let id = WorkerId(format!("demo-{}-{}", std::process::id(), i + 1));
                let mut service = WorkerService::new(app.clone(), config.clone(), registry.clone(), id)
                    .map_err(|e| DemoError::Failed(e.to_string()))?;
                service.schema = schema.clone();
                let t = timeline.clone();
                service.hooks.push(Arc::new(move |event: &Event| record(&t, event)));
                let serve = service.serve(runtime.clone(), pool.clone(), stop.clone());
                workers.push(tokio::spawn(async move { serve.await.map_err(|e| e.to_string()) }));
            }
            for chunk in tasks.chunks(1_000) {
                let now = runtime.now();
                let ids =
                    client.store().enqueue_many(chunk.to_vec()).await.map_err(|e| DemoError::Failed(e.to_string()))?;
                let mut t = timeline.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                t.enqueued.extend(ids.into_iter().map(|id| (id, now)));
            }
            Backend::Postgres { client, schema }
        }
    };

    let total = options.tasks as u64;
    let watched = watch(&backend, &workers, &runtime, total).await;
    let _ = stop_tx.send(());
    let mut stats = Vec::new();
    let mut stopped = None;
    for worker in workers {
        match worker.await {
            Ok(Ok(worker_stats)) => stats.push(worker_stats),
            Ok(Err(error)) => stopped = stopped.or(Some(error)),
            Err(error) => stopped = stopped.or(Some(error.to_string())),
        }
    }
    // The schema goes whatever happened since it was made.
    if let Backend::Postgres { client, schema } = &backend {
        let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", schema.quoted());
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(client.store().pool()).await;
    }
    let (counts, elapsed) = match (watched, stopped) {
        (Ok(watched), None) => watched,
        (Err(DemoError::Failed(what)), Some(why)) => return Err(DemoError::Failed(format!("{what}: {why}"))),
        (Err(error), _) => return Err(error),
        (Ok(_), Some(why)) => return Err(DemoError::Failed(format!("a worker failed: {why}"))),
    };
    summary(&timeline, &counts, elapsed, total, &stats);
    Ok(())
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
            crate::cli::write_line(format_args!("{line}")).map_err(DemoError::output)?;
        }
        if done >= total {
            if tty {
                crate::cli::write_line(format_args!("")).map_err(DemoError::output)?;
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
    stats: &[canter::worker::Stats],
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
