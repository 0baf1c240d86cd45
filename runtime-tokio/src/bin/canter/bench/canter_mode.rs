//! The workloads through Canter: the client's enqueue, `canter worker` as a child process for
//! the drains, and a worker on a runtime of its own in this process for latency.

use std::ops::Range;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use canter_tokio::canter::config::AppConfig;
use canter_tokio::canter::driver::Handlers;
use canter_tokio::canter::driver::isolation::{IsolatedTasks, Isolation, IsolationOptions, ProcessPool};
use canter_tokio::canter::driver::wakeups::WakeupProvider;
use canter_tokio::canter::driver::{Counters, Registry, WorkerService};
use canter_tokio::canter::postgres::{PgSchema, PgStore, enqueue_many_in, register_listener, submit_workflow_in};
use canter_tokio::canter::store::DbTime;
use canter_tokio::canter::store::{DbRequest, NewTask, NewWorkflow, WorkerInfo};
use canter_tokio::canter::task::{Attempt, Lease, TaskError, TaskId, WorkerId};
use canter_tokio::canter::worker::{TaskOutcome, TaskRun};
use canter_tokio::canter::workflow::{EdgePolicy, Join};
use serde::Deserialize;
use serde_json::Value;
use sqlx::postgres::PgListener;
use tokio::time::Instant;

use super::{
    BenchError, Broker, Options, Paced, Sample, Scratch, Workload, checkpoint, connect, core_times, core_wait_ratio,
    failed, session_pids, steady, task_args, urgent_claims, wal_position, wal_since,
};
use crate::errln;
use canter_tokio::TokioRuntime;

pub(super) async fn run(options: &Options, scratch: &Scratch, workload: Workload) -> Result<Vec<Sample>, BenchError> {
    let schema = scratch.schema()?;
    let pool = connect(&scratch.url, 4)?;
    let store = PgStore::new(pool.clone(), schema.clone(), options.config.app.clone());
    store.migrate().await.map_err(|e| failed("migrate", e))?;
    let result = match workload {
        Workload::EnqueueOne | Workload::EnqueueBulk | Workload::EnqueueOneRabbitmq | Workload::EnqueueOneNats => {
            unreachable!("the enqueue workloads run through CanterEnqueuer")
        }
        Workload::Drain => drain(options, scratch, &store, 0, None, None).await.map(|s| vec![s]),
        Workload::Pooled => {
            let pooler = options.pooler_url.as_deref();
            let sample = drain(options, scratch, &store, 0, None, pooler).await;
            sample.map(|mut sample| {
                sample.workload = Workload::Pooled.name();
                vec![sample]
            })
        }
        Workload::FanOut | Workload::FanIn | Workload::Chain | Workload::Diamonds => {
            drain(options, scratch, &store, 0, Some(workload), None).await.map(|s| vec![s])
        }
        Workload::Watched => {
            let watchers = Watchers::open(scratch, &store, 3).await?;
            let sample = drain(options, scratch, &store, 0, None, None).await;
            let seen = watchers.close().await;
            sample.map(|mut sample| {
                sample.workload = Workload::Watched.name();
                sample.dashboards = Some(seen);
                vec![sample]
            })
        }
        Workload::History => {
            fill_history(&store, options.history_tasks).await?;
            drain(options, scratch, &store, options.history_tasks, None, None).await.map(|s| vec![s])
        }
        Workload::Latency | Workload::LatencyRabbitmq | Workload::LatencyNats => {
            let wakeups = workload.broker().map(|broker| options.wakeups(broker, &schema)).transpose()?;
            latency(options, scratch, &store, wakeups).await.map(|mut sample| {
                sample.workload = workload.name();
                vec![sample]
            })
        }
        Workload::LatencyUnderLoad => latency_under_load(options, scratch, &store).await.map(|s| vec![s]),
        Workload::IsolatedOverhead => isolated_overhead(options).await,
        Workload::DrainBlocking | Workload::DrainIsolated => {
            let isolated = workload == Workload::DrainIsolated;
            in_process_drain(options, scratch, &store, isolated).await.map(|mut sample| {
                sample.workload = workload.name();
                vec![sample]
            })
        }
        Workload::HeldXmin | Workload::NoVacuum | Workload::BackendKills => {
            let plan = steady::Plan::of(workload, options).expect("a steady workload");
            steady(options, scratch, &store, plan).await.map(|s| vec![s])
        }
    };
    pool.close().await;
    result
}

fn noop(options: &Options, i: usize) -> NewTask {
    NewTask::new("noop", task_args(options, i))
}

/// The enqueue workloads' client: a store on a fresh schema, announcing its enqueues by
/// NOTIFY or on a broker.
pub(super) struct CanterEnqueuer {
    store: PgStore,
    options: Options,
    wakeups: Option<Arc<dyn WakeupProvider>>,
}

/// Registers a worker and marks it waiting on the default queue, as an idle worker is: a
/// client's enqueue notifies the queue only while one is (schema 14).
async fn mark_waiting_worker(store: &PgStore) -> Result<(), BenchError> {
    let worker = WorkerId("bench-waiting-worker".into());
    let info = WorkerInfo { worker: worker.clone(), queues: vec!["default".into()], concurrency: 1 };
    store.execute(&DbRequest::RegisterWorker(info)).await.map_err(|e| failed("register a waiting worker", e))?;
    let mark = DbRequest::SetWaiting {
        worker,
        queues: vec!["default".into()],
        waiting: true,
        urgent_below: None,
        stale_ms: u64::MAX,
    };
    store.execute(&mark).await.map_err(|e| failed("mark a worker waiting", e))?;
    Ok(())
}

/// Enqueues `task` and announces it: by NOTIFY at its commit, or on `wakeups` after it.
async fn enqueue_announced(
    store: &PgStore,
    wakeups: Option<&Arc<dyn WakeupProvider>>,
    task: NewTask,
) -> Result<(), BenchError> {
    match wakeups {
        Some(provider) => {
            let (_, announced) = store.enqueue_many_unnotified(vec![task]).await.map_err(|e| failed("enqueue", e))?;
            provider.publish(announced);
        }
        None => {
            store.enqueue(task).await.map_err(|e| failed("enqueue", e))?;
        }
    }
    Ok(())
}

impl CanterEnqueuer {
    /// Migrates the schema and connects (before any clock starts).
    pub(super) async fn new(
        options: &Options,
        scratch: &Scratch,
        broker: Option<Broker>,
    ) -> Result<CanterEnqueuer, BenchError> {
        let size = options.producers as u32 + 1;
        let schema = scratch.schema()?;
        let store = PgStore::new(connect(&scratch.url, size)?, schema.clone(), options.config.app.clone());
        store.migrate().await.map_err(|e| failed("migrate", e))?;
        store.now().await.map_err(|e| failed("connect", e))?;
        if options.waiting_worker {
            mark_waiting_worker(&store).await?;
        }
        let wakeups = broker.map(|broker| options.wakeups(broker, &schema)).transpose()?;
        if let Some(provider) = &wakeups {
            // Connected before the clock starts.
            provider.publish(vec![canter_tokio::canter::wake::Wakeup {
                queue: "default".into(),
                priority: None,
                tasks: vec![],
            }]);
            provider.flush().await;
        }
        Ok(CanterEnqueuer { store, options: options.clone(), wakeups })
    }

    /// Enqueues tasks `range` from `--producers` concurrent producers (a part of it each): one
    /// call per task, or one per part when `bulk`.
    pub(super) async fn enqueue(&mut self, range: Range<usize>, bulk: bool) -> Result<(), BenchError> {
        let (store, options, wakeups) = (&self.store, &self.options, self.wakeups.as_ref());
        let parts = super::split_range(range, options.producers).into_iter().map(|part| async move {
            if bulk {
                let tasks = part.map(|i| noop(options, i)).collect();
                store.enqueue_many(tasks).await.map_err(|e| failed("enqueue_many", e))?;
                return Ok(());
            }
            for i in part {
                enqueue_announced(store, wakeups, noop(options, i)).await?;
            }
            Ok::<_, BenchError>(())
        });
        futures::future::try_join_all(parts).await?;
        Ok(())
    }

    /// Closes the store (once its wake-ups have left).
    pub(super) async fn close(self) {
        if let Some(provider) = &self.wakeups {
            let _ = tokio::time::timeout(Duration::from_secs(5), provider.flush()).await;
        }
        self.store.pool().close().await;
    }
}

/// Stores `n` finished tasks (and their attempts) directly, as a worker would have left them,
/// then vacuums and analyzes them: the steady state of a database with that much history.
async fn fill_history(store: &PgStore, n: usize) -> Result<(), BenchError> {
    if n == 0 {
        return Ok(());
    }
    let s = store.schema().quoted();
    let retry = serde_json::to_value(&store.app().retry).map_err(|e| failed("retry policy", e))?;
    let finished = format!(
        "INSERT INTO {s}.finished_tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, \
         claimed_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at, retry, result, finished_at) \
         SELECT g, 'noop', 'default', 0, jsonb_build_object('i', g), 'COMPLETED', 1, 'bench-history', g, now(), \
         now(), now(), 1, 0, now(), now(), $2, 'null'::jsonb, now() FROM generate_series(1, $1::bigint) g"
    );
    let attempts = format!(
        "INSERT INTO {s}.attempts (task_id, attempt, worker, outcome, finished_at) \
         SELECT g, 1, 'bench-history', 'COMPLETED', now() FROM generate_series(1, $1::bigint) g"
    );
    let n = n as i64;
    let pool = store.pool();
    sqlx::query(sqlx::AssertSqlSafe(finished))
        .bind(n)
        .bind(retry)
        .execute(pool)
        .await
        .map_err(|e| failed("fill", e))?;
    sqlx::query(sqlx::AssertSqlSafe(attempts)).bind(n).execute(pool).await.map_err(|e| failed("fill", e))?;
    let sequence = format!("SELECT setval('{s}.task_id_seq', $1)");
    sqlx::query(sqlx::AssertSqlSafe(sequence)).bind(n).execute(pool).await.map_err(|e| failed("fill", e))?;
    let vacuum = format!("VACUUM ANALYZE {s}.finished_tasks, {s}.attempts");
    sqlx::raw_sql(sqlx::AssertSqlSafe(vacuum)).execute(pool).await.map_err(|e| failed("vacuum", e))?;
    Ok(())
}

/// `canter worker` serving this schema as a child process, stopped on drop.
struct WorkerProcess {
    child: Child,
    config: std::path::PathBuf,
}

/// `options.workers` worker processes, started together and stopped together.
struct WorkerProcesses(Vec<WorkerProcess>);

impl WorkerProcesses {
    async fn start(
        options: &Options,
        url: &str,
        store: &PgStore,
        pooler: Option<&str>,
    ) -> Result<WorkerProcesses, BenchError> {
        let schema = store.schema();
        let workers = (0..options.workers)
            .map(|i| WorkerProcess::spawn(options, url, schema, i, pooler))
            .collect::<Result<Vec<_>, _>>()
            .map(WorkerProcesses)?;
        let sql = format!("SELECT count(*) FROM {}.workers WHERE stopped_at IS NULL", schema.quoted());
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut workers = workers;
        loop {
            workers.check_alive()?;
            let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone()))
                .fetch_one(store.pool())
                .await
                .map_err(|e| failed("read workers", e))?;
            if live >= i64::from(options.workers) {
                // A little more, for their listeners.
                tokio::time::sleep(Duration::from_millis(300)).await;
                return Ok(workers);
            }
            if Instant::now() > deadline {
                return Err(BenchError::Failed(format!(
                    "{live} of {} workers registered within 30 s",
                    options.workers
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn check_alive(&mut self) -> Result<(), BenchError> {
        self.0.iter_mut().try_for_each(WorkerProcess::check_alive)
    }

    /// The largest peak resident set of one process, in MiB.
    fn peak_rss_mib(&self) -> Option<f64> {
        self.0.iter().filter_map(WorkerProcess::peak_rss_mib).reduce(f64::max)
    }

    /// CPU seconds of them all.
    fn cpu_seconds(&self) -> Option<f64> {
        self.0.iter().map(WorkerProcess::cpu_seconds).sum()
    }

    async fn stop(self) {
        futures::future::join_all(self.0.into_iter().map(WorkerProcess::stop)).await;
    }
}

impl WorkerProcess {
    fn spawn(
        options: &Options,
        url: &str,
        schema: &PgSchema,
        index: u32,
        pooler: Option<&str>,
    ) -> Result<WorkerProcess, BenchError> {
        let config =
            std::env::temp_dir().join(format!("canter-bench-{}-{}-{index}.json", std::process::id(), schema.name()));
        let text = serde_json::to_string(&options.config).map_err(|e| failed("config", e))?;
        std::fs::write(&config, text).map_err(|e| failed("write the worker config", e))?;
        let mut command = Command::new(&options.worker_bin);
        match pooler {
            Some(pooler) => {
                command.args(["--transaction-pooler", "--database-url", pooler, "--listen-database-url", url])
            }
            None => command.args(["--database-url", url]),
        };
        let child = command
            .args(["worker", "--schema", schema.name(), "--config"])
            .arg(&config)
            .env("CANTER_LOG", std::env::var("CANTER_LOG").unwrap_or_else(|_| "warn".to_owned()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| failed(&format!("cannot start {}", options.worker_bin.display()), e))?;
        Ok(WorkerProcess { child, config })
    }

    fn check_alive(&mut self) -> Result<(), BenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(BenchError::Failed(format!("the worker process exited: {status}"))),
            Err(e) => Err(failed("the worker process", e)),
        }
    }

    /// The peak resident set so far in MiB (`VmHWM`), where `/proc` has it.
    fn peak_rss_mib(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    }

    /// CPU seconds (user and system) the process has used, where `/proc` has it.
    fn cpu_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).ok()?;
        // The fields after the command name (which may hold spaces) in parentheses.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
        // USER_HZ is 100 on every Linux ABI.
        Some(ticks / 100.0)
    }

    /// SIGTERM, then up to 30 s for a graceful exit, then SIGKILL.
    async fn stop(mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        errln!("canter bench: the worker did not stop within 30 s; killing it");
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The workflows of a workflow workload over `n` steps of `noop`, and how many steps they hold
/// (the raw baseline runs the same graphs).
pub(super) fn workflows(options: &Options, workload: Workload, n: usize) -> (Vec<NewWorkflow>, usize) {
    let noop_step = |workflow: &mut NewWorkflow, i: usize| workflow.step(noop(options, i), Join::All);
    let required = EdgePolicy::RequireSuccess;
    match workload {
        Workload::FanOut | Workload::FanIn => {
            let mut workflow = NewWorkflow::new(workload.name());
            let hub = noop_step(&mut workflow, 0);
            for i in 1..n.max(2) {
                let spoke = noop_step(&mut workflow, i);
                match workload {
                    Workload::FanOut => workflow.edge(hub, spoke, required),
                    _ => workflow.edge(spoke, hub, required),
                }
            }
            let steps = workflow.tasks.len();
            (vec![workflow], steps)
        }
        Workload::Chain => {
            let mut workflow = NewWorkflow::new("chain");
            let mut last = noop_step(&mut workflow, 0);
            for i in 1..n.clamp(2, 1_000) {
                let next = noop_step(&mut workflow, i);
                workflow.edge(last, next, required);
                last = next;
            }
            let steps = workflow.tasks.len();
            (vec![workflow], steps)
        }
        _ => {
            let flows: Vec<NewWorkflow> = (0..(n / 4).max(1))
                .map(|k| {
                    let mut workflow = NewWorkflow::new("diamond");
                    let [a, b, c, d] = [0, 1, 2, 3].map(|j| noop_step(&mut workflow, 4 * k + j));
                    for (parent, child) in [(a, b), (a, c), (b, d), (c, d)] {
                        workflow.edge(parent, child, required);
                    }
                    workflow
                })
                .collect();
            let steps = flows.len() * 4;
            (flows, steps)
        }
    }
}

/// Enqueues `n` no-op tasks in `tx`, 1,000 per statement.
async fn enqueue_noops_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    options: &Options,
    store: &PgStore,
    n: usize,
) -> Result<(), BenchError> {
    let mut done = 0;
    while done < n {
        let size = 1_000.min(n - done);
        let tasks = (done..done + size).map(|i| noop(options, i)).collect();
        enqueue_many_in(&mut **tx, store.schema(), store.app(), tasks).await.map_err(|e| failed("enqueue", e))?;
        done += size;
    }
    Ok(())
}

/// Statistics as autovacuum would soon have them (this server may run without it), taken in
/// the transaction that wrote the tasks so the worker never plans against an empty table's
/// numbers; then the commit.
async fn analyze_and_commit(mut tx: sqlx::Transaction<'_, sqlx::Postgres>, store: &PgStore) -> Result<(), BenchError> {
    let analyze = format!("ANALYZE {}.tasks", store.schema().quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(analyze)).execute(&mut *tx).await.map_err(|e| failed("analyze", e))?;
    tx.commit().await.map_err(|e| failed("commit", e))
}

/// From each parent's finish to its child's start, in ms, sorted: the chain's step overhead.
async fn step_gaps(store: &PgStore) -> Result<Vec<f64>, BenchError> {
    let s = store.schema().quoted();
    let sql = format!(
        "SELECT extract(epoch FROM c.started_at - p.finished_at)::float8 * 1000 FROM {s}.workflow_edges e \
         JOIN {s}.finished_tasks p ON p.id = e.parent JOIN {s}.finished_tasks c ON c.id = e.child"
    );
    let mut gaps: Vec<f64> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_all(store.pool()).await.map_err(|e| failed("gaps", e))?;
    gaps.sort_by(f64::total_cmp);
    Ok(gaps)
}

async fn drain(
    options: &Options,
    scratch: &Scratch,
    store: &PgStore,
    history: usize,
    workflow: Option<Workload>,
    // A pooler in transaction mode the workers go through.
    pooler: Option<&str>,
) -> Result<Sample, BenchError> {
    let schema = store.schema().clone();
    let pool = store.pool();
    let mut worker = WorkerProcesses::start(options, &scratch.url, store, pooler).await?;
    checkpoint(pool).await;
    let cpu_before = worker.cpu_seconds();

    // A registered result waiter (schema 8: finishes notify only while one is), unless the
    // drain is to be timed without one.
    let mut listener = None;
    if !options.no_result_waiter {
        let waiter = listener.insert(PgListener::connect_with(pool).await.map_err(|e| failed("listen", e))?);
        waiter.listen(&schema.done_channel()).await.map_err(|e| failed("listen", e))?;
        register_listener(waiter, &schema, &[schema.done_channel()]).await.map_err(|e| failed("listen", e))?;
    }
    let mut n = options.tasks;
    let mut tx = pool.begin().await.map_err(|e| failed("begin", e))?;
    if let Some(workload) = workflow {
        let (flows, steps) = workflows(options, workload, n);
        n = steps;
        for flow in &flows {
            submit_workflow_in(&mut *tx, &schema, store.app(), flow).await.map_err(|e| failed("submit", e))?;
        }
    } else {
        enqueue_noops_in(&mut tx, options, store, n).await?;
    }
    analyze_and_commit(tx, store).await?;
    let wal_start = wal_position(pool).await;
    let start = Instant::now();

    // Generous: a slow machine makes slow numbers, not a failed run.
    let limit = Duration::from_secs(600).max(Duration::from_millis(10 * n as u64));
    let end = match listener.as_mut() {
        Some(listener) => drained_as_notified(listener, n, store, &mut worker, start, limit).await?,
        None => drained_as_counted(store, &mut worker, start, limit).await?,
    };
    let seconds = (end - start).as_secs_f64();
    let wal = wal_since(pool, wal_start).await;
    let peak = worker.peak_rss_mib();
    let cpu = worker.cpu_seconds().zip(cpu_before).map(|(after, before)| after - before);
    worker.stop().await;
    drop(listener);

    // Checked by a count: nothing live, every task completed.
    let s = schema.quoted();
    let check = format!(
        "SELECT (SELECT count(*) FROM {s}.tasks), (SELECT count(*) FROM {s}.finished_tasks WHERE state = 'COMPLETED'), \
         (SELECT count(DISTINCT (claimed_by, claim_token)) FROM {s}.finished_tasks WHERE claimed_by <> 'bench-history')"
    );
    let (live, completed, claims): (i64, i64, i64) =
        sqlx::query_as(sqlx::AssertSqlSafe(check)).fetch_one(pool).await.map_err(|e| failed("count", e))?;
    if live != 0 || completed as usize != n + history {
        return Err(BenchError::Failed(format!(
            "after the drain {live} tasks are live and {completed} completed (expected 0 and {})",
            n + history
        )));
    }
    let name = match workflow {
        Some(workflow) => workflow.name(),
        None if history > 0 => "history",
        None => "drain",
    };
    let mut sample = Sample::new(name, scratch.mode, n, seconds);
    if workflow == Some(Workload::Chain) {
        sample.latency = Some(super::latency_summary(step_gaps(store).await?));
    }
    sample.peak_rss_mib = peak;
    sample.history = (history > 0).then_some(history);
    sample.claims = Some(claims as u64);
    sample.worker_cpu_s = cpu;
    sample.workers = Some(options.workers);
    sample.wal_bytes = wal;
    Ok(sample)
}

/// When the done notifications have named `n` tasks (or, should they fall short, when the
/// live count read after 200 ms without one is 0).
async fn drained_as_notified(
    listener: &mut PgListener,
    n: usize,
    store: &PgStore,
    worker: &mut WorkerProcesses,
    start: Instant,
    limit: Duration,
) -> Result<Instant, BenchError> {
    let mut finished = 0usize;
    loop {
        match tokio::time::timeout(Duration::from_millis(200), listener.recv()).await {
            Ok(Ok(note)) => {
                finished += note.payload().split(',').filter(|id| !id.is_empty()).count();
                if finished >= n {
                    return Ok(Instant::now());
                }
            }
            Ok(Err(e)) => return Err(failed("listen", e)),
            Err(_quiet) => {
                if drained(store, worker, start, limit).await? {
                    errln!("canter bench: finished-task notifications fell short; the end time is approximate");
                    return Ok(Instant::now());
                }
            }
        }
    }
}

/// When a read of the live count, every 5 ms, finds none (`--no-result-waiter`).
async fn drained_as_counted(
    store: &PgStore,
    worker: &mut WorkerProcesses,
    start: Instant,
    limit: Duration,
) -> Result<Instant, BenchError> {
    loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if drained(store, worker, start, limit).await? {
            return Ok(Instant::now());
        }
    }
}

/// Whether no task is live; an error once the workers died or `limit` passed since `start`.
async fn drained(
    store: &PgStore,
    worker: &mut WorkerProcesses,
    start: Instant,
    limit: Duration,
) -> Result<bool, BenchError> {
    worker.check_alive()?;
    // The queue-depth read users have: the live table only.
    let depths = store.queue_depths().await.map_err(|e| failed("queue depths", e))?;
    let live: u64 = depths.iter().map(|d| d.due + d.scheduled + d.claimed + d.running).sum();
    if live > 0 && start.elapsed() > limit {
        return Err(BenchError::Failed(format!("the drain did not finish within {limit:?}: {live} left")));
    }
    Ok(live == 0)
}

#[derive(Deserialize)]
struct Stamp {
    i: usize,
}

/// A worker in this process, on a runtime of its own (as if it were another process), with
/// the bench's worker settings: started and registered (and its first claim back) before any
/// clock starts.
struct InProcessWorker {
    runtime: tokio::runtime::Runtime,
    counters: Arc<Counters>,
    stop: futures::channel::oneshot::Sender<()>,
    serve: tokio::task::JoinHandle<Result<(), sqlx::Error>>,
}

impl InProcessWorker {
    async fn start(
        options: &Options,
        scratch: &Scratch,
        store: &PgStore,
        registry: Registry,
        wakeups: Option<Arc<dyn WakeupProvider>>,
        isolation: Option<Isolation>,
    ) -> Result<InProcessWorker, BenchError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-worker")
            .enable_all()
            .build()
            .map_err(|e| failed("worker runtime", e))?;
        let (stop, stop_rx) = futures::channel::oneshot::channel::<()>();
        let app: AppConfig = options.config.app.clone();
        let config = options.config.worker.clone();
        let id = WorkerId(format!("bench-{}-{}", scratch.name, std::process::id()));
        let mut service =
            WorkerService::new(app, config.clone(), Arc::new(registry), id).map_err(|e| failed("worker", e))?;
        service.schema = store.schema().clone();
        service.migrate = false;
        service.wakeups = wakeups;
        service.isolation = isolation;
        let counters = service.counters.clone();
        let url = super::named_url(&scratch.url);
        let serve = runtime.spawn(async move {
            let pool = canter_tokio::connect(&url, config.pool_size())?;
            let stop = async move {
                let _ = stop_rx.await;
            };
            let _ = service.serve(Arc::new(TokioRuntime), pool.clone(), stop).await;
            pool.close().await;
            Ok::<_, sqlx::Error>(())
        });
        let worker = InProcessWorker { runtime, counters, stop, serve };
        let schema = store.schema();
        let sql = format!("SELECT count(*) FROM {}.workers WHERE stopped_at IS NULL", schema.quoted());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let live: i64 = match sqlx::query_scalar(sqlx::AssertSqlSafe(sql.clone())).fetch_one(store.pool()).await {
                Ok(live) => live,
                Err(e) => {
                    worker.stop().await;
                    return Err(failed("read workers", e));
                }
            };
            if live > 0 {
                break;
            }
            if Instant::now() > deadline {
                worker.stop().await;
                return Err(BenchError::Failed("the worker did not register within 30 s".into()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Room for the listener to connect, and the startup claim to come back empty.
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(worker)
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(35), self.serve).await;
        self.runtime.shutdown_background();
    }
}

/// A handler that stamps when task `i` started into `stamps`.
fn register_stamp(registry: &mut Registry, stamps: &Arc<Mutex<Vec<Option<Instant>>>>) -> Result<(), BenchError> {
    let record = stamps.clone();
    registry
        .register("stamp", move |args: Stamp, _| {
            let record = record.clone();
            async move {
                let now = Instant::now();
                if let Some(slot) = record.lock().unwrap_or_else(PoisonError::into_inner).get_mut(args.i) {
                    *slot = Some(now);
                }
                Ok::<_, TaskError>(Value::Null)
            }
        })
        .map(|_| ())
        .map_err(|e| failed("register", e))
}

/// An idle worker in this process, tasks enqueued one at a time: enqueue commit to handler
/// start.
async fn latency(
    options: &Options,
    scratch: &Scratch,
    store: &PgStore,
    wakeups: Option<Arc<dyn WakeupProvider>>,
) -> Result<Sample, BenchError> {
    let n = options.latency_tasks;
    let stamps: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; n]));
    let mut registry = Registry::new();
    register_stamp(&mut registry, &stamps)?;
    let worker = InProcessWorker::start(options, scratch, store, registry, wakeups.clone(), None).await?;
    let result = async {
        let mut paced = Paced::new(options.interval, n);
        for i in 0..n {
            paced.next().await;
            enqueue_announced(store, wakeups.as_ref(), NewTask::new("stamp", task_args(options, i))).await?;
            paced.committed();
        }
        paced.sample(scratch.mode, &stamps).await
    }
    .await;
    worker.stop().await;
    result
}

/// Urgent work during a drain: `options.tasks` no-op tasks committed at once while a worker in
/// this process waits, then, until the drain is done, a task of priority -1 enqueued every
/// `options.interval`: each one's enqueue commit to its handler's start. The sample's rate is
/// the drain's.
async fn latency_under_load(options: &Options, scratch: &Scratch, store: &PgStore) -> Result<Sample, BenchError> {
    let n = options.tasks;
    // Probes for as long as the drain may take at 1,000 tasks a second (a slow machine).
    let most_probes = (n as u64 * 1_000 / options.interval.as_micros().max(1) as u64).max(1_000) as usize;
    let stamps: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; most_probes]));
    let drained = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut registry = Registry::new();
    register_stamp(&mut registry, &stamps)?;
    let count = drained.clone();
    let wait = options.task_wait;
    registry
        .register("noop", move |_: Value, _| {
            let count = count.clone();
            async move {
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok::<_, TaskError>(Value::Null)
            }
        })
        .map_err(|e| failed("register", e))?;
    let worker = InProcessWorker::start(options, scratch, store, registry, None, None).await?;
    let result = async {
        let pool = store.pool();
        let mut tx = pool.begin().await.map_err(|e| failed("begin", e))?;
        enqueue_noops_in(&mut tx, options, store, n).await?;
        analyze_and_commit(tx, store).await?;
        let own = [std::process::id()];
        let cores_before = (core_times(&session_pids(pool).await), core_times(&own));
        let start = Instant::now();
        let limit = Duration::from_secs(600).max(Duration::from_millis(10 * n as u64));
        let mut paced = Paced::new(options.interval, most_probes);
        let mut probes = 0;
        // The drain's end is looked for every millisecond, whatever the probes' interval.
        let seconds = loop {
            if drained.load(std::sync::atomic::Ordering::Relaxed) >= n {
                break start.elapsed().as_secs_f64();
            }
            if probes == most_probes || start.elapsed() > limit {
                return Err(BenchError::Failed(format!("the drain did not finish within {:?}", start.elapsed())));
            }
            tokio::select! {
                () = paced.next() => {
                    let probe = NewTask::new("stamp", task_args(options, probes)).priority(-1);
                    store.enqueue(probe).await.map_err(|e| failed("enqueue", e))?;
                    paced.committed();
                    probes += 1;
                }
                () = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        };
        let db = core_wait_ratio(&cores_before.0, &core_times(&session_pids(pool).await));
        let bench = core_wait_ratio(&cores_before.1, &core_times(&own));
        let mut sample = paced.sample(scratch.mode, &stamps).await?;
        sample.core_wait = db.zip(bench).map(|(db, bench)| [db, bench]);
        sample.urgent_claims = urgent_claims(&worker.counters.requests());
        sample.workload = "latency_under_load";
        sample.task_wait_ms = u64::try_from(options.task_wait.as_millis()).ok().filter(|&ms| ms > 0);
        sample.tasks = n;
        sample.seconds = seconds;
        Ok(sample)
    }
    .await;
    worker.stop().await;
    result
}

/// A steady workload (see [`steady`]) against a worker in this process, tasks enqueued in calls
/// of `rate / 100`.
async fn steady(
    options: &Options,
    scratch: &Scratch,
    store: &PgStore,
    plan: steady::Plan,
) -> Result<Sample, BenchError> {
    let stamps = steady::prepare(&plan, scratch).await?;
    let mut registry = Registry::new();
    register_stamp(&mut registry, &stamps)?;
    let worker = InProcessWorker::start(options, scratch, store, registry, None, None).await?;
    let result = steady::run(plan, scratch, "tasks", &stamps, async |range: Range<usize>| {
        let tasks = range.map(|i| NewTask::new("stamp", task_args(options, i))).collect();
        match store.enqueue_many(tasks).await {
            Ok(_) => Ok(true),
            Err(e) if e.may_have_committed() => Ok(false),
            Err(e) => Err(failed("enqueue", e)),
        }
    })
    .await;
    worker.stop().await;
    result
}

/// Dashboards open during a drain, each with a pool of its own and an event stream a client
/// reads, so each reads its overview all along.
struct Watchers {
    dashboards: Vec<(canter_tokio::dashboard::Dashboard, canter_tokio::http::Endpoints)>,
    clients: Vec<tokio::task::JoinHandle<(u64, u64)>>,
}

impl Watchers {
    async fn open(scratch: &Scratch, store: &PgStore, n: u32) -> Result<Watchers, BenchError> {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let mut watchers = Watchers { dashboards: Vec::new(), clients: Vec::new() };
        for _ in 0..n {
            let own = PgStore::new(connect(&scratch.url, 2)?, store.schema().clone(), store.app().clone());
            let dashboard = canter_tokio::dashboard::Dashboard::new(own, Default::default());
            let endpoints = canter_tokio::http::Endpoints::bind("127.0.0.1:0", dashboard.router())
                .await
                .map_err(|e| failed("serve a dashboard", e))?;
            let mut stream = tokio::net::TcpStream::connect(endpoints.local_addr)
                .await
                .map_err(|e| failed("open a dashboard", e))?;
            let request =
                format!("GET /api/events HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", endpoints.local_addr);
            stream.write_all(request.as_bytes()).await.map_err(|e| failed("open a dashboard", e))?;
            // Counts the overviews and the time their readings took, until the stream ends.
            watchers.clients.push(tokio::spawn(async move {
                let (mut reads, mut took_ms) = (0u64, 0u64);
                let mut lines = tokio::io::BufReader::new(stream).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let Some(data) = line.strip_prefix("data: ") else { continue };
                    if let Ok(overview) = serde_json::from_str::<Value>(data) {
                        reads += 1;
                        took_ms += overview["took_ms"].as_u64().unwrap_or(0);
                    }
                }
                (reads, took_ms)
            }));
            watchers.dashboards.push((dashboard, endpoints));
        }
        Ok(watchers)
    }

    /// Closes them: how many there were, the overviews they read and the mean read in ms.
    async fn close(self) -> (u32, u64, f64) {
        for (dashboard, _) in &self.dashboards {
            dashboard.close();
        }
        let (mut reads, mut took_ms) = (0, 0);
        for client in self.clients {
            let (r, t) = client.await.unwrap_or_default();
            reads += r;
            took_ms += t;
        }
        let n = self.dashboards.len() as u32;
        for (_, endpoints) in self.dashboards {
            endpoints.stop().await;
        }
        (n, reads, if reads > 0 { took_ms as f64 / reads as f64 } else { 0.0 })
    }
}

/// A blocking task's run as the driver would hand it over.
fn blocking_run(i: usize, ms: u64) -> TaskRun {
    TaskRun {
        id: TaskId(i as i64 + 1),
        lease: Lease(1),
        attempt: Attempt(1),
        name: "block".to_owned(),
        queue: "default".to_owned(),
        priority: 0,
        enqueued_at: DbTime(0),
        run_at: DbTime(0),
        args: serde_json::json!({ "ms": ms }),
        deadline: None,
    }
}

/// Blocking tasks (no-op and 1 ms) one at a time, `--latency-tasks` of each: on tokio's
/// blocking pool, then in a child process (this program again, serving the built-in tasks),
/// each after one untimed run (a child's start is a cost of the first task only).
async fn isolated_overhead(options: &Options) -> Result<Vec<Sample>, BenchError> {
    let blocking = Arc::new(crate::builtins::registry()).bind(Arc::new(TokioRuntime));
    let pool = ProcessPool::new(IsolationOptions { processes: 1, ..IsolationOptions::default() })
        .map_err(|e| failed("process pool", e))?;
    let n = options.latency_tasks;
    let mut samples = Vec::new();
    let cases =
        [("blocking_0ms", 0, false), ("isolated_0ms", 0, true), ("blocking_1ms", 1, false), ("isolated_1ms", 1, true)];
    for (name, ms, isolated) in cases {
        let run = |i: usize| if isolated { pool.run(blocking_run(i, ms)) } else { blocking.run(blocking_run(i, ms)) };
        let warm = run(0).await;
        if !matches!(warm, TaskOutcome::Success(_)) {
            return Err(BenchError::Failed(format!("{name}: the task failed: {warm:?}")));
        }
        let mut times = Vec::with_capacity(n);
        let started = Instant::now();
        for i in 0..n {
            let begun = Instant::now();
            let outcome = run(i + 1).await;
            times.push(begun.elapsed().as_secs_f64() * 1e3);
            if !matches!(outcome, TaskOutcome::Success(_)) {
                return Err(BenchError::Failed(format!("{name}: task {i} failed: {outcome:?}")));
            }
        }
        let mut sample = Sample::new(name, super::Mode::Canter, n, started.elapsed().as_secs_f64());
        sample.latency = Some(super::latency_summary(times));
        samples.push(sample);
    }
    Ok(samples)
}

/// `--tasks` blocking no-ops enqueued at once, drained by an idle worker in this process: on
/// its blocking pool, or (`isolated`) in 2 child processes. From the commit to the last one's
/// end (read off the live table every 10 ms).
async fn in_process_drain(
    options: &Options,
    scratch: &Scratch,
    store: &PgStore,
    isolated: bool,
) -> Result<Sample, BenchError> {
    let n = options.tasks;
    let isolation = match isolated {
        true => {
            let pool = ProcessPool::new(IsolationOptions { processes: 2, ..IsolationOptions::default() })
                .map_err(|e| failed("process pool", e))?;
            Some(Isolation { pool, tasks: IsolatedTasks::All })
        }
        false => None,
    };
    let worker = InProcessWorker::start(options, scratch, store, crate::builtins::registry(), None, isolation).await?;
    let result = async {
        let tasks: Vec<NewTask> = (0..n).map(|_| NewTask::new("block", serde_json::json!({ "ms": 0 }))).collect();
        let count = format!("SELECT count(*) FROM {}.tasks", store.schema().quoted());
        let started = Instant::now();
        for chunk in tasks.chunks(10_000) {
            store.enqueue_many(chunk.to_vec()).await.map_err(|e| failed("enqueue", e))?;
        }
        loop {
            let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count.clone()))
                .fetch_one(store.pool())
                .await
                .map_err(|e| failed("count", e))?;
            if live == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(Sample::new(Workload::DrainBlocking.name(), super::Mode::Canter, n, started.elapsed().as_secs_f64()))
    }
    .await;
    worker.stop().await;
    result
}
