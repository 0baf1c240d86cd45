//! The end-to-end suite body shared by the adapters: each adapter's `tests/e2e.rs` includes
//! this file and runs every scenario on its own runtime, so parity is checked, not assumed.
//! Scenarios take the runtime as an `Arc<R: Runtime>` and a way to spawn a future on it.

#![allow(dead_code, unreachable_pub)]

/// Calls `$run!(name)` for every scenario of this file: the one list both adapters' suites
/// run (each `tests/e2e.rs` defines `$run` for its runtime).
#[allow(unused_macros)]
macro_rules! every_scenario {
    ($run:ident) => {
        $run!(many_tasks_through_several_workers);
        $run!(caps_hold_under_load);
        $run!(failures_end_with_their_codes);
        $run!(waiting_timeouts_and_cancel);
        $run!(graceful_shutdown);
        $run!(hooks_see_lifecycle_events);
        $run!(serial_queue_runs_one_at_a_time_in_order);
        $run!(batch_tasks_retry_only_failed_items);
        $run!(forbidden_flags_leave_tasks_to_other_workers);
        $run!(schedules_fire_inside_a_worker);
        $run!(racing_scheduler_loops);
        $run!(waits_leave_nothing_behind);
        $run!(poison_outcomes_fail_alone);
        $run!(undecodable_rows_fail_alone);
        $run!(workflows_fan_out_fan_in_and_recover);
        $run!(a_cancelled_workflow_aborts_its_running_step_and_a_retry_runs_it_again);
        $run!(metrics_follow_what_the_worker_did);
    };
}

/// The suite once per broker provider, in a module of each's name, through the adapter's
/// `scenario!($name, $wakeups)` (`$wakeups`: an `Option<MakeWakeups>`).
#[allow(unused_macros)]
macro_rules! with_every_provider {
    () => {
        with_every_provider!(rabbitmq);
        with_every_provider!(nats);
    };
    ($provider:ident) => {
        mod $provider {
            use super::*;

            macro_rules! provided {
                ($name:ident) => {
                    scenario!($name, Some(brokers::$provider));
                };
            }

            every_scenario!(provided);
            every_provider_scenario!(provided);
        }
    };
}

/// The scenarios of a wake-up provider besides LISTEN/NOTIFY (run with [`use_wakeups`]).
#[allow(unused_macros)]
macro_rules! every_provider_scenario {
    ($run:ident) => {
        $run!(the_provider_carries_enqueues_without_notify);
    };
}

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use canter::config::{AppConfig, CustomQueue, QueueMode, RecoveryConfig, RetryPolicy, WorkerConfig};
use canter::driver::wakeups::WakeupProvider;
use canter::driver::{
    Client, Counters, Registry, ResultError, Runtime, TaskContext, TaskHandle, WorkerService, Workflow,
};
use canter::postgres::{PgSchema, PgStore};
use canter::schedule::ScheduleConfig;
use canter::store::AdminRequest;
use canter::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};
use canter::worker::{Event, Stats};
use futures::channel::oneshot;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// The wake-up provider each test's schema runs its scenario with, when not LISTEN/NOTIFY.
static WAKEUPS: Mutex<BTreeMap<String, Arc<dyn WakeupProvider>>> = Mutex::new(BTreeMap::new());

/// Runs the scenarios in `schema` with `provider`: their clients announce enqueues through it
/// and their workers subscribe to it.
pub fn use_wakeups(schema: &PgSchema, provider: Arc<dyn WakeupProvider>) {
    WAKEUPS.lock().unwrap().insert(schema.name().to_owned(), provider);
}

fn wakeups_of(schema: &PgSchema) -> Option<Arc<dyn WakeupProvider>> {
    WAKEUPS.lock().unwrap().get(schema.name()).cloned()
}

/// Makes the wake-up provider of a test's schema.
pub type MakeWakeups = fn(&PgSchema) -> Arc<dyn WakeupProvider>;

/// A scenario's database (a schema of its own) and pool, its clients and workers announcing
/// and hearing enqueues through the provider `wakeups` makes, if any.
pub async fn prepare(wakeups: Option<MakeWakeups>) -> (crate::pg::TestDb, PgPool) {
    let db = crate::pg::TestDb::new().await;
    let pool = db.pool(20).await;
    if let Some(provider) = wakeups {
        use_wakeups(&db.schema, provider(&db.schema));
    }
    (db, pool)
}

/// A client of the scenario, with the schema's wake-up provider if it has one.
pub fn client<R: Runtime>(runtime: &Arc<R>, pool: &PgPool, schema: &PgSchema, app: AppConfig) -> Client<R> {
    let client = Client::new(runtime.clone(), pool.clone(), schema.clone(), app);
    match wakeups_of(schema) {
        Some(provider) => client.wakeups(provider),
        None => client,
    }
}

/// Runs a future on the adapter's runtime and hands back its output.
pub trait Spawner: Send + Sync + 'static {
    /// Spawns `future`; the receiver gets its output.
    fn spawn_with_output<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> oneshot::Receiver<T>;
}

impl<R: Runtime> Spawner for R {
    fn spawn_with_output<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> oneshot::Receiver<T> {
        let (tx, rx) = oneshot::channel();
        self.spawn(Box::pin(async move {
            let _ = tx.send(future.await);
        }));
        rx
    }
}

async fn sleep<R: Runtime>(runtime: &R, duration: Duration) {
    runtime.sleep_until(runtime.now() + duration).await;
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Work {
    pub id: u64,
    pub ms: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Fail {
    pub code: String,
}

/// What the handlers saw: executions per work id and concurrency per worker.
#[derive(Default)]
pub struct Seen {
    pub runs: Mutex<BTreeMap<u64, u32>>,
    pub running: AtomicI64,
    pub max_running: AtomicI64,
    pub flaky_calls: AtomicU64,
    /// Serial-queue tasks in start order, and how many ran at once.
    pub serial_order: Mutex<Vec<u64>>,
    pub serial_running: AtomicI64,
    pub serial_max: AtomicI64,
    /// Batch items handled: item and attempt.
    pub batch_items: Mutex<Vec<(u64, u32)>>,
    /// Which worker ran each flagged task.
    pub flagged_by: Mutex<Vec<(u64, String)>>,
}

pub struct Tasks {
    pub registry: Arc<Registry>,
    pub work: TaskHandle<Work, u64>,
    pub fail: TaskHandle<Fail, ()>,
    pub panic: TaskHandle<(), ()>,
    pub blocking: TaskHandle<Work, u64>,
    pub flaky: TaskHandle<(), String>,
    pub serial: TaskHandle<u64, ()>,
    pub batch: TaskHandle<Vec<u64>, usize>,
    pub seen: Arc<Seen>,
}

/// The handlers every scenario registers. `sleep` is the runtime's timer.
pub fn tasks<R: Runtime>(runtime: Arc<R>) -> Tasks {
    let seen = Arc::new(Seen::default());
    let mut registry = Registry::new();
    let (s, rt) = (seen.clone(), runtime.clone());
    let work = registry
        .register("work", move |args: Work, _ctx: TaskContext| {
            let (seen, runtime) = (s.clone(), rt.clone());
            async move {
                let now = seen.running.fetch_add(1, Ordering::SeqCst) + 1;
                seen.max_running.fetch_max(now, Ordering::SeqCst);
                *seen.runs.lock().unwrap().entry(args.id).or_default() += 1;
                if args.ms > 0 {
                    sleep(&*runtime, Duration::from_millis(args.ms)).await;
                }
                seen.running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, TaskError>(args.id * 2)
            }
        })
        .unwrap();
    let fail = registry
        .register("fail", |args: Fail, _| async move {
            Err::<(), _>(TaskError::new(ErrorCode::parse(&args.code), "failed on purpose"))
        })
        .unwrap();
    let panic = registry
        .register("panic", |_: (), _| async move {
            if true {
                panic!("a handler panicked on purpose");
            }
            Ok::<(), TaskError>(())
        })
        .unwrap();
    let blocking = registry
        .register_blocking("blocking", |args: Work, _| -> Result<u64, TaskError> {
            std::thread::sleep(Duration::from_millis(args.ms));
            Ok(args.id + 1)
        })
        .unwrap();
    let s = seen.clone();
    let flaky = registry
        .register("flaky", move |_: (), ctx: TaskContext| {
            let seen = s.clone();
            async move {
                seen.flaky_calls.fetch_add(1, Ordering::SeqCst);
                if ctx.attempt.0 < 3 {
                    Err(TaskError::new(ErrorCode::User("FLAKY".into()), format!("attempt {}", ctx.attempt)))
                } else {
                    Ok(format!("succeeded on attempt {}", ctx.attempt))
                }
            }
        })
        .unwrap();
    let (s, rt) = (seen.clone(), runtime.clone());
    let serial = registry
        .register("serial", move |n: u64, _ctx: TaskContext| {
            let (seen, runtime) = (s.clone(), rt.clone());
            async move {
                let now = seen.serial_running.fetch_add(1, Ordering::SeqCst) + 1;
                seen.serial_max.fetch_max(now, Ordering::SeqCst);
                seen.serial_order.lock().unwrap().push(n);
                sleep(&*runtime, Duration::from_millis(3)).await;
                seen.serial_running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, TaskError>(())
            }
        })
        .unwrap();
    let s = seen.clone();
    let batch = registry
        .register_batch("batch", move |items: Vec<u64>, ctx: TaskContext| {
            let seen = s.clone();
            async move {
                let mut handled = seen.batch_items.lock().unwrap();
                items
                    .into_iter()
                    .map(|item| {
                        handled.push((item, ctx.attempt.0));
                        // Odd items fail on the first run.
                        if item % 2 == 1 && ctx.attempt.0 == 1 {
                            Err(TaskError::new(ErrorCode::User("ODD".into()), format!("item {item}")))
                        } else {
                            Ok(())
                        }
                    })
                    .collect()
            }
        })
        .unwrap();
    Tasks { registry: Arc::new(registry), work, fail, panic, blocking, flaky, serial, batch, seen }
}

/// Short intervals so recovery happens within a test.
pub fn fast_app() -> AppConfig {
    AppConfig {
        recovery: RecoveryConfig {
            claimer_heartbeat_interval_ms: 1_000,
            runner_heartbeat_interval_ms: 1_000,
            check_interval_ms: 1_000,
            claimed_stale_threshold_ms: 2_000,
            running_stale_threshold_ms: 2_000,
            ..RecoveryConfig::default()
        },
        claim_lease_ms: Some(2_000),
        max_claim_renew_age_ms: 180_000,
        ..AppConfig::default()
    }
}

pub fn fast_worker(concurrency: u32) -> WorkerConfig {
    WorkerConfig { concurrency, poll_interval_ms: 1_000, handler_timeout_ms: Some(10_000), ..WorkerConfig::default() }
}

/// A worker serving on `runtime` until the returned sender fires (or is dropped).
pub struct RunningWorker {
    pub stop: Option<oneshot::Sender<()>>,
    pub done: oneshot::Receiver<Stats>,
    pub events: Arc<Mutex<Vec<Event>>>,
    pub id: WorkerId,
    pub counters: Arc<Counters>,
}

impl RunningWorker {
    pub async fn stop(mut self) -> Stats {
        let _ = self.stop.take().map(|s| s.send(()));
        self.done.await.expect("the worker task ended")
    }
}

pub fn start_worker<R: Runtime>(
    runtime: &Arc<R>,
    pool: &PgPool,
    schema: &PgSchema,
    app: AppConfig,
    config: WorkerConfig,
    registry: Arc<Registry>,
    name: &str,
) -> RunningWorker {
    let id = WorkerId(name.to_owned());
    let mut service = WorkerService::new(app, config, registry, id.clone()).expect("valid config");
    service.schema = schema.clone();
    service.wakeups = wakeups_of(schema);
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    service.hooks.push(Arc::new(move |event: &Event| sink.lock().unwrap().push(event.clone())));
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    let counters = service.counters.clone();
    let serve = service.serve(runtime.clone(), pool.clone(), shutdown);
    let done = runtime.spawn_with_output(async move { serve.await.expect("serve") });
    RunningWorker { stop: Some(stop), done, events, id, counters }
}

async fn wait_until<R: Runtime>(runtime: &R, within: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = runtime.now() + within;
    while !check().await {
        assert!(runtime.now() < deadline, "condition not met within {within:?}");
        sleep(runtime, Duration::from_millis(20)).await;
    }
}

async fn all_terminal<R: Runtime>(client: &Client<R>, ids: &[TaskId]) -> bool {
    let counts = client.counts().await.unwrap();
    let live: u64 = counts.iter().filter(|((_, s), _)| !s.is_terminal()).map(|(_, n)| n).sum();
    live == 0 && !ids.is_empty()
}

/// Thousands of tasks through several workers: every one completes exactly once.
pub async fn many_tasks_through_several_workers<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    // No crash here: stale thresholds of seconds would only let a loaded machine (the whole
    // suite at once on 2 cores) reap live runs, and the counts below would be off.
    let mut app = fast_app();
    app.recovery.running_stale_threshold_ms = 30_000;
    app.recovery.claimed_stale_threshold_ms = 30_000;
    let client = client(&runtime, &pool, &schema, app.clone());
    let total = 3_000u64;
    let handles = client
        .enqueue_many(&tasks.work, (0..total).map(|id| Work { id, ms: if id % 10 == 0 { 2 } else { 0 } }))
        .await
        .unwrap();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            start_worker(
                &runtime,
                &pool,
                &schema,
                app.clone(),
                fast_worker(8),
                tasks.registry.clone(),
                &format!("w{i}"),
            )
        })
        .collect();
    let ids: Vec<TaskId> = handles.iter().map(|h| h.id()).collect();
    wait_until(&*runtime, Duration::from_secs(60), async || all_terminal(&client, &ids).await).await;
    // Results are there and right.
    for (i, handle) in handles.iter().enumerate().step_by(97) {
        assert_eq!(handle.wait(Duration::from_secs(5)).await.unwrap(), i as u64 * 2);
    }
    let mut completed = 0;
    for worker in workers {
        completed += worker.stop().await.completed;
    }
    assert_eq!(completed, total);
    {
        let runs = tasks.seen.runs.lock().unwrap();
        assert_eq!(runs.len() as u64, total, "every task ran");
        assert!(runs.values().all(|n| *n == 1), "no task ran twice");
    }
    let counts = client.counts().await.unwrap();
    assert_eq!(counts.get(&("default".to_owned(), TaskState::Completed)), Some(&total));
}

/// Caps per worker, per queue and cluster-wide hold under load, sampled while running.
pub async fn caps_hold_under_load<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![
            CustomQueue::new("narrow").with_priority(1).with_max_concurrency(3),
            CustomQueue::new("wide").with_priority(2),
        ],
        cluster_wide_cap: Some(7),
        ..fast_app()
    };
    let client = client(&runtime, &pool, &schema, app.clone());
    for queue in ["narrow", "wide"] {
        for id in 0..150 {
            client.enqueue_with(&tasks.work, &Work { id, ms: 15 }, |t| t.queue(queue)).await.unwrap();
        }
    }
    let workers: Vec<_> = (0..3)
        .map(|i| {
            start_worker(
                &runtime,
                &pool,
                &schema,
                app.clone(),
                fast_worker(4),
                tasks.registry.clone(),
                &format!("c{i}"),
            )
        })
        .collect();
    let mut samples = 0;
    let deadline = runtime.now() + Duration::from_secs(60);
    loop {
        let row: (i64, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE queue = 'narrow'), count(*), \
                    count(*) FILTER (WHERE state = 'RUNNING') \
             FROM {}.tasks WHERE state = 'RUNNING' OR (state = 'CLAIMED' AND claim_expires_at > clock_timestamp())",
            schema.quoted()
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        samples += 1;
        assert!(row.0 <= 3, "queue cap exceeded: {} in flight in narrow", row.0);
        assert!(row.1 <= 7, "cluster cap exceeded: {} in flight", row.1);
        let counts = client.counts().await.unwrap();
        let live: u64 = counts.iter().filter(|((_, s), _)| !s.is_terminal()).map(|(_, n)| n).sum();
        if live == 0 {
            break;
        }
        assert!(runtime.now() < deadline, "not drained in time");
        sleep(&*runtime, Duration::from_millis(3)).await;
    }
    assert!(samples > 10, "sampled while running");
    assert!(tasks.seen.max_running.load(Ordering::SeqCst) <= 7);
    for worker in workers {
        worker.stop().await;
    }
}

/// Panics, returned errors, undecodable arguments, unknown names and timeouts end with their
/// codes; retries follow the policy.
pub async fn failures_end_with_their_codes<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let config = WorkerConfig { handler_timeout_ms: Some(2_000), ..fast_worker(4) };
    let worker = start_worker(&runtime, &pool, &schema, app, config, tasks.registry.clone(), "f1");

    let panic = client.enqueue(&tasks.panic, &()).await.unwrap();
    let failed = client.enqueue(&tasks.fail, &Fail { code: "OUT_OF_STOCK".into() }).await.unwrap();
    let undecodable: TaskHandle<String, u64> = TaskHandle::named("work");
    let undecodable = client.enqueue(&undecodable, &"not a Work".to_owned()).await.unwrap();
    let unknown: TaskHandle<(), ()> = TaskHandle::named("nobody_registered_this");
    let unknown = client.enqueue(&unknown, &()).await.unwrap();
    let slow = client.enqueue(&tasks.work, &Work { id: 1, ms: 5_000 }).await.unwrap();
    let flaky_policy = RetryPolicy::fixed(vec![1, 1, 1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    let flaky = client.enqueue_with(&tasks.flaky, &(), |t| t.retry(flaky_policy)).await.unwrap();
    let blocking = client.enqueue(&tasks.blocking, &Work { id: 41, ms: 20 }).await.unwrap();

    let code = async |error: ResultError| error.code();
    let wait = Duration::from_secs(20);
    assert_eq!(code(panic.wait(wait).await.unwrap_err()).await, ErrorCode::UnhandledError);
    assert_eq!(code(failed.wait(wait).await.unwrap_err()).await, ErrorCode::User("OUT_OF_STOCK".into()));
    assert_eq!(code(undecodable.wait(wait).await.unwrap_err()).await, ErrorCode::WorkerSerializationError);
    assert_eq!(code(unknown.wait(wait).await.unwrap_err()).await, ErrorCode::WorkerResolutionError);
    assert_eq!(code(slow.wait(wait).await.unwrap_err()).await, ErrorCode::TaskTimeout);
    assert_eq!(flaky.wait(wait).await.unwrap(), "succeeded on attempt 3");
    assert_eq!(blocking.wait(wait).await.unwrap(), 42);
    let attempts = client.attempts(flaky.id()).await.unwrap();
    assert_eq!(attempts.len(), 3, "two failed runs, then the successful one");
    assert!(worker.events.lock().unwrap().iter().any(|e| matches!(e, Event::TimedOut { .. })));
    worker.stop().await;
}

/// Waiting for a result times out with WAIT_TIMEOUT while nobody runs the task; cancelling a
/// pending task ends the wait with TASK_CANCELLED.
pub async fn waiting_timeouts_and_cancel<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let client = client(&runtime, &pool, &schema, fast_app());
    let handle = client.enqueue(&tasks.work, &Work { id: 9, ms: 0 }).await.unwrap();
    let error = handle.wait(Duration::from_millis(200)).await.unwrap_err();
    assert_eq!(error.code(), ErrorCode::WaitTimeout);
    let waiter = handle.clone();
    let waiting = runtime.spawn_with_output(async move { waiter.wait(Duration::from_secs(10)).await });
    sleep(&*runtime, Duration::from_millis(100)).await;
    handle.cancel().await.unwrap();
    let error = waiting.await.unwrap().unwrap_err();
    assert_eq!(error.code(), ErrorCode::TaskCancelled);
}

/// Graceful shutdown: running handlers finish within the grace period; what still runs after
/// it goes back to Pending without spending a retry.
pub async fn graceful_shutdown<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let quick = client.enqueue(&tasks.work, &Work { id: 1, ms: 200 }).await.unwrap();
    let long = client.enqueue(&tasks.work, &Work { id: 2, ms: 60_000 }).await.unwrap();
    let config = WorkerConfig { shutdown_grace_ms: 1_000, handler_timeout_ms: None, ..fast_worker(4) };
    let worker = start_worker(&runtime, &pool, &schema, app, config, tasks.registry.clone(), "g1");
    wait_until(&*runtime, Duration::from_secs(10), async || tasks.seen.running.load(Ordering::SeqCst) == 2).await;
    let began = runtime.now();
    worker.stop().await;
    let took = runtime.now() - began;
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(8), "shutdown took {took:?}");
    assert_eq!(quick.wait(Duration::from_secs(1)).await.unwrap(), 2, "finished within the grace period");
    let record = long.status().await.unwrap().unwrap();
    assert_eq!(record.state, TaskState::Pending, "handed back");
    assert_eq!(record.retries, 0, "without spending a retry");
    let workers = client.workers().await.unwrap();
    assert!(workers.iter().any(|w| w.info.worker.0 == "g1" && w.stopped), "deregistered");
}

/// Hooks see lifecycle events after the result is written.
pub async fn hooks_see_lifecycle_events<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let worker = start_worker(&runtime, &pool, &schema, app, fast_worker(2), tasks.registry.clone(), "h1");
    let handle = client.enqueue(&tasks.work, &Work { id: 5, ms: 0 }).await.unwrap();
    assert_eq!(handle.wait(Duration::from_secs(10)).await.unwrap(), 10);
    let id = handle.id();
    wait_until(&*runtime, Duration::from_secs(5), async || {
        worker.events.lock().unwrap().iter().any(|e| matches!(e, Event::Finished { task, .. } if *task == id))
    })
    .await;
    let events = worker.events.lock().unwrap().clone();
    let position = |f: &dyn Fn(&Event) -> bool| events.iter().position(f).expect("event seen");
    let claimed = position(&|e| matches!(e, Event::Claimed { task, .. } if *task == id));
    let started = position(&|e| matches!(e, Event::Started { task, .. } if *task == id));
    let finished = position(&|e| matches!(e, Event::Finished { task, state: TaskState::Completed } if *task == id));
    assert!(claimed < started && started < finished);
    worker.stop().await;
}

/// A serial queue runs one task at a time across workers that prefetch, in enqueue order
/// (graphile-worker #621: prefetching workers each held a task of one named queue and ran them
/// out of order). Busy workers buffer serial tasks they cannot start yet: another worker must
/// not take the next one meanwhile.
pub async fn serial_queue_runs_one_at_a_time_in_order<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let mut app = fast_app();
    app.queue_mode = QueueMode::Custom;
    app.custom_queues = vec![CustomQueue::new("default"), CustomQueue::new("ledger").with_priority(2).serial()];
    app.prefetch_buffer = 16;
    let client = client(&runtime, &pool, &schema, app.clone());
    let total = 30u64;
    for n in 0..total {
        client.enqueue_with(&tasks.serial, &n, |t| t.queue("ledger")).await.unwrap();
    }
    client.enqueue_many(&tasks.work, (0..12).map(|id| Work { id, ms: 10 })).await.unwrap();
    let workers: Vec<_> = (0..3)
        .map(|i| {
            start_worker(
                &runtime,
                &pool,
                &schema,
                app.clone(),
                fast_worker(1),
                tasks.registry.clone(),
                &format!("w{i}"),
            )
        })
        .collect();
    wait_until(&*runtime, Duration::from_secs(60), async || {
        tasks.seen.serial_order.lock().unwrap().len() as u64 == total
    })
    .await;
    for worker in workers {
        worker.stop().await;
    }
    assert_eq!(tasks.seen.serial_max.load(Ordering::SeqCst), 1, "one at a time");
    assert_eq!(*tasks.seen.serial_order.lock().unwrap(), (0..total).collect::<Vec<_>>(), "in order");
}

/// A batch task whose items partly fail retries only the failed ones.
pub async fn batch_tasks_retry_only_failed_items<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let mut app = fast_app();
    app.retry = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("ODD".into())]).with_jitter(false);
    let client = client(&runtime, &pool, &schema, app.clone());
    let handle = client.enqueue(&tasks.batch, &vec![1, 2, 3, 4]).await.unwrap();
    let worker = start_worker(&runtime, &pool, &schema, app, fast_worker(4), tasks.registry.clone(), "w");
    assert_eq!(handle.wait(Duration::from_secs(30)).await.unwrap(), 2, "the retry handled the two odd items");
    worker.stop().await;
    let mut handled = tasks.seen.batch_items.lock().unwrap().clone();
    handled.sort_unstable();
    assert_eq!(handled, vec![(1, 1), (1, 2), (2, 1), (3, 1), (3, 2), (4, 1)]);
    let attempts = client.attempts(handle.id()).await.unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].error.as_ref().unwrap().code, ErrorCode::User("ODD".into()));
}

/// A worker told to skip a flag leaves those tasks to the others.
pub async fn forbidden_flags_leave_tasks_to_other_workers<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let mut ids = Vec::new();
    for id in 0..20u64 {
        let flag = |t: canter::store::NewTask| if id % 2 == 0 { t.flag("gpu") } else { t };
        ids.push(client.enqueue_with(&tasks.work, &Work { id, ms: 1 }, flag).await.unwrap().id());
    }
    let picky = WorkerConfig { forbidden_flags: vec!["gpu".into()], ..fast_worker(4) };
    let picky = start_worker(&runtime, &pool, &schema, app.clone(), picky, tasks.registry.clone(), "picky");
    // Only the picky worker runs first: the unflagged half finishes, the flagged half waits.
    wait_until(&*runtime, Duration::from_secs(30), async || tasks.seen.runs.lock().unwrap().len() == 10).await;
    sleep(&*runtime, Duration::from_millis(300)).await;
    assert!(tasks.seen.runs.lock().unwrap().keys().all(|id| id % 2 == 1), "no flagged task ran on the picky worker");
    let any = start_worker(&runtime, &pool, &schema, app, fast_worker(4), tasks.registry.clone(), "any");
    wait_until(&*runtime, Duration::from_secs(30), async || all_terminal(&client, &ids).await).await;
    picky.stop().await;
    any.stop().await;
    assert_eq!(tasks.seen.runs.lock().unwrap().len(), 20);
    let record = client.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(record.flags, vec!["gpu".to_owned()]);
}

/// A schedule's tasks in the store, live or finished.
async fn scheduled_tasks(pool: &PgPool, schema: &PgSchema, name: &str) -> i64 {
    let sql = format!(
        "SELECT (SELECT count(*) FROM {s}.tasks WHERE name = $1) + (SELECT count(*) FROM {s}.finished_tasks WHERE name = $1)",
        s = schema.quoted()
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(name).fetch_one(pool).await.unwrap()
}

/// A worker with `run_scheduler` enqueues its app's schedules' ticks and runs them; its
/// scheduler stops with it.
pub async fn schedules_fire_inside_a_worker<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let every_second = ScheduleConfig {
        every: Some("1s".into()),
        args: serde_json::json!({"id": 70, "ms": 0}),
        ..ScheduleConfig::new("every_second", "work")
    };
    let app = AppConfig { schedules: vec![every_second], ..fast_app() };
    let config = WorkerConfig { run_scheduler: true, ..fast_worker(2) };
    let worker = start_worker(&runtime, &pool, &schema, app, config, tasks.registry.clone(), "s1");
    wait_until(&*runtime, Duration::from_secs(10), async || {
        tasks.seen.runs.lock().unwrap().get(&70).is_some_and(|n| *n >= 2)
    })
    .await;
    let stats = worker.stop().await;
    assert!(stats.completed >= 2, "{stats:?}");
    let enqueued = scheduled_tasks(&pool, &schema, "work").await;
    sleep(&*runtime, Duration::from_millis(1_500)).await;
    assert_eq!(scheduled_tasks(&pool, &schema, "work").await, enqueued, "the scheduler stopped with the worker");
    let store = PgStore::new(pool.clone(), schema.clone(), AppConfig::default());
    let record = store.schedule_records().await.unwrap().into_iter().find(|r| r.name == "every_second").unwrap();
    assert_eq!(record.run_count, enqueued as u64, "one task per recorded tick");
}

/// Three scheduler loops racing on one schema for a few seconds of real time: every tick in
/// between is enqueued exactly once.
pub async fn racing_scheduler_loops<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let every_second = ScheduleConfig { every: Some("1s".into()), backfill: 5, ..ScheduleConfig::new("tick", "tick") };
    let app = AppConfig { schedules: vec![every_second], ..fast_app() };
    let store = PgStore::new(pool.clone(), schema.clone(), app.clone());
    let scheduler = Arc::new(canter::driver::load_scheduler(&app).unwrap());
    // The record starts at a known instant, so the ticks due since are known.
    let start = store.now().await.unwrap();
    let sql = format!(
        "INSERT INTO {s}.schedules (name, last_tick, updated_at) VALUES ('tick', {s}.at_ms($1), {s}.db_now())",
        s = schema.quoted()
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(start.0).execute(&pool).await.unwrap();
    let mut loops = Vec::new();
    for seed in 0..3u64 {
        let (stop, stopped) = oneshot::channel::<()>();
        let run = canter::driver::run_scheduler(
            runtime.clone(),
            store.clone(),
            scheduler.clone(),
            canter::driver::SchedulerOptions::default(),
            seed,
            async move {
                let _ = stopped.await;
            },
        );
        loops.push((stop, runtime.spawn_with_output(run)));
    }
    sleep(&*runtime, Duration::from_millis(3_300)).await;
    let mut enqueued_by_loops = 0;
    for (stop, done) in loops {
        let _ = stop.send(());
        enqueued_by_loops += done.await.unwrap().unwrap().tasks;
    }
    let record = store.schedule_records().await.unwrap().into_iter().find(|r| r.name == "tick").unwrap();
    let ticks = record.last_tick.0 / 1000 - start.0 / 1000;
    assert!(ticks >= 2, "ticks fell due: {ticks}");
    assert_eq!(record.last_tick.0 % 1000, 0, "the last tick recorded is a tick");
    let tasks = scheduled_tasks(&pool, &schema, "tick").await;
    assert_eq!(tasks, ticks, "each tick once");
    assert_eq!((record.run_count, enqueued_by_loops), (ticks as u64, ticks as u64));
}

/// Waits that end by a result (read at once, or after a notification), by a timeout or by
/// being dropped leave no entry behind in the client's router (100,000 waits used to grow
/// memory by 20 MB); a wait, and a scheduler loop, with durations past the clock's range run
/// instead of panicking.
pub async fn waits_leave_nothing_behind<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    use futures::future::{Either, join_all, select};
    let client = client(&runtime, &pool, &schema, fast_app());
    let tasks = (0..100).map(|i| canter::store::NewTask::new("t", serde_json::json!(i))).collect();
    let ids = client.store().enqueue_many(tasks).await.unwrap();
    // Finished before the wait: read at once.
    for id in &ids[..25] {
        client.admin(&AdminRequest::Complete { task: *id, result: serde_json::json!(1) }).await.unwrap();
        client.wait(*id, Duration::from_secs(10)).await.unwrap();
    }
    // Timed out.
    let timeouts = join_all(ids[25..50].iter().map(|id| client.wait(*id, Duration::from_millis(50)))).await;
    assert!(timeouts.iter().all(|r| matches!(r, Err(ResultError::Timeout(_)))), "{timeouts:?}");
    // Dropped while waiting.
    for id in &ids[50..75] {
        let wait = std::pin::pin!(client.wait(*id, Duration::from_secs(60)));
        let later = std::pin::pin!(sleep(&*runtime, Duration::from_millis(20)));
        assert!(matches!(select(wait, later).await, Either::Right(_)), "the task is not finished");
    }
    // Finished while waited for: woken by the notification.
    let waits: Vec<_> = ids[75..]
        .iter()
        .map(|id| {
            let client = client.clone();
            let id = *id;
            runtime.spawn_with_output(async move { client.wait(id, Duration::from_secs(20)).await })
        })
        .collect();
    sleep(&*runtime, Duration::from_millis(200)).await;
    for id in &ids[75..] {
        client.admin(&AdminRequest::Complete { task: *id, result: serde_json::json!(2) }).await.unwrap();
    }
    for wait in waits {
        assert_eq!(wait.await.unwrap().unwrap().state, TaskState::Completed);
    }
    assert_eq!(client.waited_tasks(), 0, "every ended wait left the router");

    // No deadline at all: a finished task's result, and a pending one that keeps waiting.
    assert_eq!(client.wait(ids[0], Duration::MAX).await.unwrap().state, TaskState::Completed);
    {
        let wait = std::pin::pin!(client.wait(ids[30], Duration::MAX));
        let later = std::pin::pin!(sleep(&*runtime, Duration::from_millis(100)));
        assert!(matches!(select(wait, later).await, Either::Right(_)));
    }
    let options = canter::driver::SchedulerOptions {
        max_check_delay: Duration::MAX,
        request_timeout: Duration::MAX,
        give_up: true,
    };
    let store = PgStore::new(pool.clone(), schema.clone(), AppConfig::default());
    let scheduler = Arc::new(canter::driver::load_scheduler(&AppConfig::default()).unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let run = canter::driver::run_scheduler(runtime.clone(), store, scheduler, options, 1, async move {
        let _ = stopped.await;
    });
    let done = runtime.spawn_with_output(run);
    sleep(&*runtime, Duration::from_millis(300)).await;
    let _ = stop.send(());
    let stats = done.await.expect("the scheduler loop ran to its end").unwrap();
    assert!(stats.checks >= 1, "{stats:?}");
    assert_eq!(client.waited_tasks(), 0);
}

/// A finished task's row read by SQL (inspection decodes args, which poison rows defeat):
/// state, attempts and error code.
async fn finished_row(pool: &PgPool, schema: &PgSchema, id: TaskId) -> Option<(String, i32, Option<String>)> {
    let sql = format!("SELECT state, attempts, error->>'code' FROM {}.finished_tasks WHERE id = $1", schema.quoted());
    sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id.0).fetch_optional(pool).await.unwrap()
}

/// Issue 18, item 1: handlers whose result or error message holds U+0000 (common from C
/// libraries), finishing beside healthy ones: the healthy ones complete, the poison ones fail
/// alone with WORKER_SERIALIZATION_ERROR, nothing is recorded as crashed, and the worker goes
/// on running tasks. (Before: the whole batched finish was refused and re-sent forever.)
pub async fn poison_outcomes_fail_alone<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let mut registry = Registry::new();
    let rt = runtime.clone();
    let work = registry
        .register("work", move |args: Work, _ctx: TaskContext| {
            let runtime = rt.clone();
            async move {
                sleep(&*runtime, Duration::from_millis(args.ms)).await;
                Ok::<_, TaskError>(args.id * 2)
            }
        })
        .unwrap();
    let nul_result: TaskHandle<(), String> =
        registry.register("nul_result", |_: (), _| async move { Ok::<_, TaskError>("from C: \0".to_owned()) }).unwrap();
    let nul_error: TaskHandle<(), ()> = registry
        .register("nul_error", |_: (), _| async move {
            Err::<(), _>(TaskError::new(ErrorCode::User("FROM_C".into()), "bad \0 byte"))
        })
        .unwrap();
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let healthy = client.enqueue_many(&work, (0..8).map(|id| Work { id, ms: 100 })).await.unwrap();
    let poison =
        [client.enqueue(&nul_result, &()).await.unwrap().id(), client.enqueue(&nul_error, &()).await.unwrap().id()];
    let worker = start_worker(&runtime, &pool, &schema, app, fast_worker(10), Arc::new(registry), "p1");
    let wait = Duration::from_secs(15);
    for (i, handle) in healthy.iter().enumerate() {
        assert_eq!(handle.wait(wait).await.unwrap(), i as u64 * 2, "a healthy task of the batch completed");
    }
    for id in poison {
        let record = client.wait(id, wait).await.unwrap();
        assert_eq!(record.state, TaskState::Failed);
        let error = record.error.expect("an error");
        assert_eq!(error.code, ErrorCode::WorkerSerializationError, "{error:?}");
        assert!(!error.message.contains('\0'), "{error:?}");
    }
    // The worker still runs tasks.
    let after = client.enqueue(&work, &Work { id: 21, ms: 0 }).await.unwrap();
    assert_eq!(after.wait(wait).await.unwrap(), 42);
    let events = worker.events.clone();
    let stats = worker.stop().await;
    assert_eq!((stats.completed, stats.failed, stats.lost, stats.outcomes_refused), (9, 2, 0, 2), "{stats:?}");
    let crashed = client.list(&Default::default()).await.unwrap();
    let crashed: Vec<_> =
        crashed.iter().filter(|r| r.error.as_ref().is_some_and(|e| e.code == ErrorCode::WorkerCrashed)).collect();
    assert!(crashed.is_empty(), "{crashed:?}");
    let events = events.lock().unwrap().clone();
    let mut refused: Vec<TaskId> = events
        .iter()
        .filter_map(|e| match e {
            Event::OutcomeRefused { task, .. } => Some(*task),
            _ => None,
        })
        .collect();
    // The two handlers run at once: their events come in either order.
    refused.sort_unstable();
    let mut expected = poison.to_vec();
    expected.sort_unstable();
    assert_eq!(refused, expected);
}

/// Issue 18, item 2: rows no decoder reads, written by SQL (args nested 200 deep, args
/// holding 1e400), and rows whose own retry policy has a field this version does not know or
/// breaks a rule, in one queue with five noops and one worker: the noops and the two policy
/// rows run within seconds; the poison rows fail alone with WORKER_SERIALIZATION_ERROR after
/// one attempt, without running. (Before: every claim meeting them failed to decode and was
/// undone; 0 of 5 noops ran in 10 s and the poison's attempts climbed.)
pub async fn undecodable_rows_fail_alone<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let mut registry = Registry::new();
    let ran = Arc::new(Mutex::new(Vec::new()));
    let seen = ran.clone();
    let noop = registry
        .register("noop", move |n: u64, _ctx: TaskContext| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(n);
                Ok::<_, TaskError>(n)
            }
        })
        .unwrap();
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let policy = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    let mut ids = Vec::new();
    for n in 0..4u64 {
        let handle = client.enqueue_with(&noop, &(100 + n), |t| t.retry(policy.clone())).await.unwrap();
        ids.push(handle.id());
    }
    let [deep, huge, newer, bad] = [ids[0], ids[1], ids[2], ids[3]];
    let rewrite = |sql: &str, id: TaskId| {
        let sql = format!("UPDATE {s}.tasks SET {sql} WHERE id = $1", s = schema.quoted());
        let pool = pool.clone();
        async move { sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id.0).execute(&pool).await.unwrap() }
    };
    rewrite("args = (repeat('[', 200) || repeat(']', 200))::jsonb", deep).await;
    rewrite("args = '{\"n\": 1e400}'::jsonb", huge).await;
    rewrite("retry = retry || '{\"from_a_newer_client\": true}'::jsonb", newer).await;
    rewrite("retry = jsonb_set(retry, '{max_retries}', '999')", bad).await;
    let noops = client.enqueue_many(&noop, 0..5u64).await.unwrap();
    let began = runtime.now();
    let worker = start_worker(&runtime, &pool, &schema, app, fast_worker(4), Arc::new(registry), "u1");
    for (n, handle) in noops.iter().enumerate() {
        assert_eq!(handle.wait(Duration::from_secs(10)).await.unwrap(), n as u64, "a noop beside the poison ran");
    }
    for (id, n) in [(newer, 102), (bad, 103)] {
        let record = client.wait(id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(record.state, TaskState::Completed, "{record:?}");
        assert!(ran.lock().unwrap().contains(&n));
    }
    assert!(runtime.now() - began < Duration::from_secs(10), "within seconds");
    for id in [deep, huge] {
        let deadline = runtime.now() + Duration::from_secs(10);
        let row = loop {
            if let Some(row) = finished_row(&pool, &schema, id).await {
                break row;
            }
            assert!(runtime.now() < deadline, "poison row {id} not finished");
            sleep(&*runtime, Duration::from_millis(20)).await;
        };
        assert_eq!(row, ("FAILED".to_owned(), 1, Some("WORKER_SERIALIZATION_ERROR".to_owned())), "task {id}");
    }
    let events = worker.events.clone();
    let stats = worker.stop().await;
    assert_eq!((stats.completed, stats.failed, stats.lost), (7, 2, 0), "{stats:?}");
    let mut ran = ran.lock().unwrap().clone();
    ran.sort_unstable();
    assert_eq!(ran, vec![0, 1, 2, 3, 4, 102, 103], "the poison rows never ran, the rest once");
    let unreadable: Vec<TaskId> = events
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            Event::UnreadableRow { task, .. } => Some(*task),
            _ => None,
        })
        .collect();
    assert_eq!(unreadable.iter().copied().collect::<std::collections::BTreeSet<_>>(), [deep, huge, bad].into());
}

/// A workflow through two workers: a root fans out to ten steps, a fan-in step waits for all
/// of them, a step that fails skips what needs it, and a recovery step after it runs anyway;
/// the typed results and the workflow's end are read through its handle.
pub async fn workflows_fan_out_fan_in_and_recover<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    let mut workflow = Workflow::new("fan");
    let root = workflow.step(&tasks.work, &Work { id: 1_000, ms: 0 }).unwrap();
    let leaves: Vec<_> = (0..10).map(|id| workflow.step(&tasks.work, &Work { id, ms: 1 }).unwrap()).collect();
    let join = workflow.step(&tasks.work, &Work { id: 2_000, ms: 0 }).unwrap();
    for leaf in &leaves {
        workflow.after(leaf, &root).after(&join, leaf);
    }
    let failing = workflow.step(&tasks.fail, &Fail { code: "BROKEN".into() }).unwrap();
    workflow.after(&failing, &root);
    let needs_it = workflow.step(&tasks.work, &Work { id: 3_000, ms: 0 }).unwrap();
    workflow.after(&needs_it, &failing);
    let recovery = workflow.step(&tasks.work, &Work { id: 4_000, ms: 0 }).unwrap();
    workflow.after_finish(&recovery, &failing);
    let submitted = client.submit(workflow).await.unwrap();
    let workers: Vec<_> = (0..2)
        .map(|i| {
            start_worker(
                &runtime,
                &pool,
                &schema,
                app.clone(),
                fast_worker(4),
                tasks.registry.clone(),
                &format!("w{i}"),
            )
        })
        .collect();
    let ended = submitted.wait(Duration::from_secs(60)).await.unwrap();
    // A sink was skipped: the workflow failed, but every branch that could run ran.
    assert_eq!(ended.status, canter::workflow::WorkflowStatus::Failed);
    assert_eq!(submitted.step(&join).unwrap().wait(Duration::from_secs(1)).await.unwrap(), 4_000);
    assert_eq!(submitted.step(&recovery).unwrap().wait(Duration::from_secs(1)).await.unwrap(), 8_000);
    let skipped = submitted.step(&needs_it).unwrap().wait(Duration::from_secs(1)).await;
    assert!(matches!(skipped, Err(ResultError::Skipped)), "{skipped:?}");
    assert!(matches!(
        submitted.step(&failing).unwrap().wait(Duration::from_secs(1)).await,
        Err(ResultError::Failed(_))
    ));
    // What the recovery step's handler reads of the parent it ran after: its error, typed.
    let recovery_task = submitted.step(&recovery).unwrap().id();
    let parents = client.parent_results::<()>(recovery_task).await.unwrap();
    let failed_task = submitted.step(&failing).unwrap().id();
    assert_eq!(parents.len(), 1);
    assert_eq!((parents[0].task, parents[0].step, parents[0].state), (failed_task, failing.id(), TaskState::Failed));
    let code = parents[0].outcome.clone().and_then(Result::err).map(|e| e.code);
    assert_eq!(code, Some(ErrorCode::User("BROKEN".into())));
    let fan_in = client.parent_results::<u64>(submitted.step(&join).unwrap().id()).await.unwrap();
    let mut doubled: Vec<u64> = fan_in.into_iter().filter_map(|p| p.outcome.and_then(Result::ok)).collect();
    doubled.sort_unstable();
    assert_eq!(doubled, (0..10).map(|id| id * 2).collect::<Vec<u64>>(), "every leaf's result, typed");
    let expected = [(TaskState::Completed, 13), (TaskState::Failed, 1), (TaskState::Skipped, 1)];
    assert_eq!(ended.steps, expected.into_iter().collect());
    for worker in workers {
        worker.stop().await;
    }
    // Nothing ran twice, and the skipped step never ran.
    let runs = tasks.seen.runs.lock().unwrap();
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
    assert!(!runs.contains_key(&3_000), "the skipped step never ran");
}

/// A workflow's cancel aborts its running step through the worker (the cancel names it on the
/// abort channel: the worker beats at once and finds the lease gone), and a retry of the
/// cancelled workflow runs its steps again to completion.
pub async fn a_cancelled_workflow_aborts_its_running_step_and_a_retry_runs_it_again<R: Runtime>(
    runtime: Arc<R>,
    pool: PgPool,
    schema: PgSchema,
) {
    use canter::workflow::WorkflowStatus;
    let tasks = tasks(runtime.clone());
    // Heartbeats every 30 s (the default): only the notification can abort the step in time.
    let app = AppConfig::default();
    let client = client(&runtime, &pool, &schema, app.clone());
    let mut workflow = Workflow::new("slow");
    let slow = workflow.step(&tasks.work, &Work { id: 1, ms: 4_000 }).unwrap();
    let next = workflow.step(&tasks.work, &Work { id: 2, ms: 0 }).unwrap();
    workflow.after(&next, &slow);
    let submitted = client.submit(workflow).await.unwrap();
    let slow_task = submitted.step(&slow).unwrap().id();
    let worker = start_worker(&runtime, &pool, &schema, app.clone(), fast_worker(2), tasks.registry.clone(), "w0");
    wait_until(&*runtime, Duration::from_secs(30), async || tasks.seen.runs.lock().unwrap().contains_key(&1)).await;
    assert_eq!(client.cancel_workflow(submitted.id()).await.unwrap(), WorkflowStatus::Cancelled);
    // The worker beats at once, finds the lease gone and aborts the handler, long before its
    // 4 s are up.
    let lost = |worker: &RunningWorker| {
        worker.events.lock().unwrap().iter().any(|e| matches!(e, Event::Lost { task, .. } if *task == slow_task))
    };
    wait_until(&*runtime, Duration::from_secs(3), async || lost(&worker)).await;
    let record = client.workflow(submitted.id()).await.unwrap().unwrap();
    assert_eq!(record.steps, [(TaskState::Cancelled, 2)].into_iter().collect());
    // The retry reopens it: both steps run, in order, to completion.
    assert_eq!(client.retry_workflow(submitted.id(), false).await.unwrap(), WorkflowStatus::Running);
    let ended = submitted.wait(Duration::from_secs(30)).await.unwrap();
    assert_eq!(ended.status, WorkflowStatus::Completed);
    assert_eq!(submitted.step(&next).unwrap().wait(Duration::from_secs(1)).await.unwrap(), 4);
    worker.stop().await;
    let runs = tasks.seen.runs.lock().unwrap().clone();
    assert_eq!(runs, [(1, 2), (2, 1)].into_iter().collect(), "the cancelled step ran again, its child once");
    // The aborted run was dropped before its end (the others counted themselves out).
    assert_eq!(tasks.seen.running.load(Ordering::SeqCst), 1, "the aborted handler never got to its end");
}

/// The metrics text of a worker (`canter::driver::metrics`, what `/metrics` serves) carries
/// what it did, read back sample by sample: its outcomes, its requests by kind, its readiness
/// while it runs and after it stopped.
pub async fn metrics_follow_what_the_worker_did<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let tasks = tasks(runtime.clone());
    let client = client(&runtime, &pool, &schema, fast_app());
    let worker = start_worker(&runtime, &pool, &schema, fast_app(), fast_worker(4), tasks.registry.clone(), "m1");
    let mut handles = Vec::new();
    for id in 0..10 {
        handles.push(client.enqueue(&tasks.work, &Work { id, ms: 0 }).await.unwrap());
    }
    let failed = client.enqueue(&tasks.fail, &Fail { code: "NOPE".into() }).await.unwrap();
    for handle in handles {
        handle.wait(Duration::from_secs(20)).await.unwrap();
    }
    failed.wait(Duration::from_secs(20)).await.unwrap_err();
    let id = worker.id.0.clone();
    let samples = |counters: &Counters| -> BTreeMap<String, f64> {
        let text = canter::driver::metrics::render(&id, &counters.snapshot(), &counters.requests());
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .map(|line| {
                let (key, value) = line.rsplit_once(' ').expect("a sample");
                (key.to_owned(), if value == "+Inf" { f64::INFINITY } else { value.parse().expect("a number") })
            })
            .collect()
    };
    // Counted after the turn that handled the finish's reply: it may come a moment later.
    wait_until(&*runtime, Duration::from_secs(10), async || {
        let s = samples(&worker.counters);
        let counts = ["completed", "failed", "claimed"].map(|c| s[&format!("canter_worker_tasks_{c}_total")]);
        counts == [10.0, 1.0, 11.0]
    })
    .await;
    let running = samples(&worker.counters);
    assert_eq!(running["canter_worker_ready"], 1.0);
    assert_eq!(running["canter_worker_concurrency"], 4.0);
    assert!(running["canter_db_request_duration_seconds_count{kind=\"register_worker\"}"] >= 1.0, "{running:?}");
    let counters = worker.counters.clone();
    worker.stop().await;
    let stopped = samples(&counters);
    assert_eq!((stopped["canter_worker_ready"], stopped["canter_worker_shutting_down"]), (0.0, 1.0));
    assert!(stopped["canter_db_request_duration_seconds_count{kind=\"deregister_worker\"}"] >= 1.0, "{stopped:?}");
}

/// With a wake-up provider, a worker that neither polls nor hears PostgreSQL claims what a
/// client enqueued within moments, and the enqueue sent no NOTIFY: the wake-up came through
/// the provider alone.
pub async fn the_provider_carries_enqueues_without_notify<R: Runtime>(runtime: Arc<R>, pool: PgPool, schema: PgSchema) {
    let provider = wakeups_of(&schema).expect("a scenario run with a wake-up provider");
    let tasks = tasks(runtime.clone());
    let app = fast_app();
    let client = client(&runtime, &pool, &schema, app.clone());
    // A session that LISTENs on the queue's channel: the provider's enqueues notify nobody.
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen(&schema.queue_channel("default")).await.unwrap();
    // Event-driven, with the poll minutes away: only a wake-up (or the catch-up claim when the
    // subscription comes up) starts a task.
    let config = WorkerConfig {
        deployment_mode: canter::config::DeploymentMode::EventDrivenOnly,
        poll_interval_ms: 300_000,
        ..fast_worker(4)
    };
    let worker = start_worker(&runtime, &pool, &schema, app, config, tasks.registry.clone(), "evented");
    // Wait for the subscription and the catch-up claim it makes to pass.
    wait_until(&*runtime, Duration::from_secs(20), async || worker.counters.snapshot().stats.claim_passes >= 1).await;
    sleep(&*runtime, Duration::from_millis(300)).await;
    let heard_before = provider.stats().heard;
    for round in 0..5u64 {
        let started = runtime.now();
        let handle = client.enqueue(&tasks.work, &Work { id: round, ms: 0 }).await.unwrap();
        assert_eq!(handle.wait(Duration::from_secs(10)).await.unwrap(), round * 2);
        let took = runtime.now() - started;
        assert!(took < Duration::from_secs(5), "round {round} took {took:?}: the wake-up was not heard");
    }
    // Nothing reached the LISTENing session: the enqueues sent no NOTIFY.
    let quiet = runtime.sleep_until(runtime.now() + Duration::from_millis(500));
    match futures::future::select(Box::pin(listener.try_recv()), quiet).await {
        futures::future::Either::Left((heard, _)) => panic!("the enqueues sent a NOTIFY: {heard:?}"),
        futures::future::Either::Right(((), _)) => {}
    }
    let stats = provider.stats();
    assert!(stats.heard >= heard_before + 5, "the worker heard the wake-ups: {stats:?}");
    assert_eq!(stats.malformed, 0);
    worker.stop().await;
}
