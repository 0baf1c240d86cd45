//! The core's driver loop on tokio over the shared in-memory store (`MemoryBackend`): real
//! handlers, real timers, no PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use canter_tokio::TokioRuntime;
use canter_tokio::canter::config::{AppConfig, RecoveryConfig, RetryPolicy, WorkerConfig};
use canter_tokio::canter::driver::{self, DriverOptions, MemoryBackend, Registry, Runtime, TaskContext};
use canter_tokio::canter::memory::MemoryStore;
use canter_tokio::canter::store::{DbTime, NewTask, RunAt};
use canter_tokio::canter::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};
use canter_tokio::canter::worker::{Event, Input, Worker};
use serde_json::json;

#[derive(serde::Serialize, serde::Deserialize)]
struct Double {
    n: i64,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Sleep {
    ms: u64,
}

fn registry() -> Arc<Registry> {
    let mut registry = Registry::new();
    registry.register("double", |args: Double, _| async move { Ok::<_, TaskError>(args.n * 2) }).unwrap();
    registry
        .register("sleep", |args: Sleep, _| async move {
            tokio::time::sleep(Duration::from_millis(args.ms)).await;
            Ok::<_, TaskError>("slept")
        })
        .unwrap();
    registry
        .register("boom", |_: serde_json::Value, _| async move {
            if true {
                panic!("boom on purpose");
            }
            Ok::<(), TaskError>(())
        })
        .unwrap();
    registry
        .register_blocking("blocking_boom", |_: serde_json::Value, _| -> Result<(), TaskError> {
            panic!("blocking boom")
        })
        .unwrap();
    registry
        .register_blocking("spin", |args: Double, ctx: TaskContext| -> Result<String, TaskError> {
            Ok(format!("{} on attempt {}", args.n, ctx.attempt))
        })
        .unwrap();
    registry
        .register("context", |_: serde_json::Value, ctx: TaskContext| async move {
            Ok::<_, TaskError>(json!({
                "queue": ctx.queue,
                "priority": ctx.priority,
                "attempt": ctx.attempt.0,
                "waited_ms": ctx.run_at.0 - ctx.enqueued_at.0,
            }))
        })
        .unwrap();
    registry
        .register("flaky", |_: serde_json::Value, _| async move {
            Err::<(), _>(TaskError::new(ErrorCode::User("FLAKY".into()), "flaky"))
        })
        .unwrap();
    registry
        .register("sync_boom", |args: serde_json::Value, _| {
            // Panics while building the future, before any await.
            if args.is_object() {
                panic!("a handler that panics synchronously");
            }
            async { Ok::<(), TaskError>(()) }
        })
        .unwrap();
    Arc::new(registry)
}

fn app() -> AppConfig {
    AppConfig {
        recovery: RecoveryConfig {
            claimer_heartbeat_interval_ms: 1_000,
            runner_heartbeat_interval_ms: 1_000,
            check_interval_ms: 1_000,
            claimed_stale_threshold_ms: 2_000,
            running_stale_threshold_ms: 2_000,
            ..RecoveryConfig::default()
        },
        ..AppConfig::default()
    }
}

struct Cluster {
    backend: MemoryBackend,
    shutdowns: Vec<futures::channel::mpsc::UnboundedSender<Input>>,
    workers: Vec<tokio::task::JoinHandle<canter::worker::Stats>>,
    events: Arc<std::sync::Mutex<Vec<Event>>>,
}

fn cluster(workers: usize, config: WorkerConfig) -> Cluster {
    cluster_with(app(), workers, config, DriverOptions::default())
}

/// `workers` workers of `app` and `config` over one memory store, each driven with `options`.
fn cluster_with(app: AppConfig, workers: usize, config: WorkerConfig, options: DriverOptions) -> Cluster {
    let runtime = Arc::new(TokioRuntime);
    let clock = runtime.clone();
    let backend = MemoryBackend::new(MemoryStore::new(app.clone()), DbTime(1_700_000_000_000), move || clock.now());
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut cluster = Cluster { backend: backend.clone(), shutdowns: Vec::new(), workers: Vec::new(), events };
    for i in 0..workers {
        let worker = Worker::new(WorkerId(format!("w{i}")), app.clone(), config.clone(), runtime.now()).unwrap();
        let (shutdown_tx, shutdown_rx) = futures::channel::mpsc::unbounded();
        let inputs = futures::stream::select(backend.subscribe(), shutdown_rx);
        let events = cluster.events.clone();
        let observer: driver::Observer = Box::new(move |event| events.lock().unwrap().push(event.clone()));
        let handle = tokio::spawn(driver::run(
            worker,
            runtime.clone(),
            backend.clone(),
            registry().bind(runtime.clone()),
            inputs,
            options.clone(),
            Some(observer),
        ));
        cluster.shutdowns.push(shutdown_tx);
        cluster.workers.push(handle);
    }
    cluster
}

impl Cluster {
    async fn wait_terminal(&self, ids: &[canter::task::TaskId], within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let all =
                self.backend.with_store(|store, _| ids.iter().all(|id| store.get(*id).unwrap().state.is_terminal()));
            if all {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "tasks not terminal within {within:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn shutdown(self) -> Vec<canter::worker::Stats> {
        for tx in &self.shutdowns {
            tx.unbounded_send(Input::Shutdown).unwrap();
        }
        let mut stats = Vec::new();
        for handle in self.workers {
            stats.push(tokio::time::timeout(Duration::from_secs(10), handle).await.expect("drained").unwrap());
        }
        stats
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_drain_a_queue_through_the_driver() {
    let config = WorkerConfig { concurrency: 8, ..WorkerConfig::default() };
    let cluster = cluster(2, config);
    let ids = cluster.backend.with_store(|store, now| {
        let mut tasks: Vec<_> = (0..300).map(|n| NewTask::new("double", json!({"n": n}))).collect();
        tasks.push(NewTask::new("spin", json!({"n": 7})));
        store.enqueue_many(tasks, now).unwrap()
    });
    cluster.wait_terminal(&ids, Duration::from_secs(20)).await;
    let results: Vec<_> = cluster.backend.with_store(|store, _| ids.iter().map(|id| store.get(*id).unwrap()).collect());
    for (n, record) in results[..300].iter().enumerate() {
        assert_eq!(record.state, TaskState::Completed);
        assert_eq!(record.result, Some(json!(n as i64 * 2)));
        assert_eq!(record.attempts, 1, "no task ran twice");
    }
    assert_eq!(results[300].result, Some(json!("7 on attempt 1")), "blocking handlers get their context");
    let stats = cluster.shutdown().await;
    assert_eq!(stats.iter().map(|s| s.completed).sum::<u64>(), 301);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_see_their_task_s_queue_priority_attempt_and_times() {
    let cluster = cluster(1, WorkerConfig::default());
    let ids = cluster.backend.with_store(|store, now| {
        let task = NewTask::new("context", json!({})).priority(-3).run_at(RunAt::DelayMs(300));
        store.enqueue_many(vec![task], now).unwrap()
    });
    cluster.wait_terminal(&ids, Duration::from_secs(20)).await;
    let result = cluster.backend.with_store(|store, _| store.get(ids[0]).unwrap().result);
    assert_eq!(result, Some(json!({"queue": "default", "priority": -3, "attempt": 1, "waited_ms": 300})));
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_unknown_names_and_timeouts_end_with_their_codes() {
    let config = WorkerConfig { concurrency: 4, handler_timeout_ms: Some(2_000), ..WorkerConfig::default() };
    let cluster = cluster(1, config);
    let flaky = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    let ids = cluster.backend.with_store(|store, now| {
        let tasks = vec![
            NewTask::new("boom", json!({})),
            NewTask::new("sync_boom", json!({})),
            NewTask::new("nobody", json!({})),
            NewTask::new("double", json!({"n": "not a number"})),
            NewTask::new("blocking_boom", json!({})),
            NewTask::new("sleep", json!({"ms": 60_000})),
            NewTask::new("flaky", json!({})).retry(flaky),
        ];
        store.enqueue_many(tasks, now).unwrap()
    });
    cluster.wait_terminal(&ids, Duration::from_secs(10)).await;
    let codes: Vec<_> = cluster.backend.with_store(|store, _| {
        ids.iter().map(|id| store.get(*id).unwrap()).map(|r| (r.state, r.error.unwrap().code, r.attempts)).collect()
    });
    assert_eq!(
        codes,
        vec![
            (TaskState::Failed, ErrorCode::UnhandledError, 1),
            (TaskState::Failed, ErrorCode::UnhandledError, 1),
            (TaskState::Failed, ErrorCode::WorkerResolutionError, 1),
            (TaskState::Failed, ErrorCode::WorkerSerializationError, 1),
            (TaskState::Failed, ErrorCode::UnhandledError, 1),
            (TaskState::Failed, ErrorCode::TaskTimeout, 1),
            (TaskState::Failed, ErrorCode::User("FLAKY".into()), 2),
        ]
    );
    assert!(cluster.events.lock().unwrap().iter().any(|e| matches!(e, Event::TimedOut { .. })));
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_running_tasks_after_the_grace_period() {
    let config =
        WorkerConfig { concurrency: 2, handler_timeout_ms: None, shutdown_grace_ms: 100, ..WorkerConfig::default() };
    let cluster = cluster(1, config);
    let ids = cluster.backend.with_store(|store, now| {
        store.enqueue_many(vec![NewTask::new("sleep", json!({"ms": 60_000})); 2], now).unwrap()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    // Running in the store is not enough: the claim's reply may still be on its way to the
    // worker, and a shutdown handled before it hands the tasks straight back, with no grace
    // period to wait for (CI saw the shutdown end early once). The worker's own Started events
    // say it runs them.
    let started_by_worker = |id: &TaskId| {
        cluster.events.lock().unwrap().iter().any(|e| matches!(e, Event::Started { task, .. } if task == id))
    };
    while cluster.backend.with_store(|s, _| ids.iter().any(|id| s.get(*id).unwrap().state != TaskState::Running))
        || !ids.iter().all(started_by_worker)
    {
        assert!(tokio::time::Instant::now() < deadline, "tasks never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = tokio::time::Instant::now();
    let backend = cluster.backend.clone();
    cluster.shutdown().await;
    assert!(started.elapsed() >= Duration::from_millis(100), "waited for the grace period");
    backend.with_store(|store, _| {
        for id in &ids {
            let record = store.get(*id).unwrap();
            assert_eq!(record.state, TaskState::Pending, "handed back");
            assert_eq!(record.retries, 0, "without spending a retry");
        }
        assert!(store.workers().iter().all(|w| w.stopped), "deregistered");
    });
}

#[test]
fn a_panic_payload_becomes_an_unhandled_error() {
    let error = driver::panic_error(&"disk on fire");
    assert_eq!(error.code, ErrorCode::UnhandledError);
    assert_eq!(error.message, "handler panicked: disk on fire");
    let error = driver::panic_error(&String::from("owned"));
    assert_eq!(error.message, "handler panicked: owned");
}

/// Counts the timers the driver asks for: a loop that spins asks for one per turn.
struct Counting {
    sleeps: std::sync::atomic::AtomicU64,
}

impl Runtime for Counting {
    fn now(&self) -> std::time::Instant {
        TokioRuntime.now()
    }
    fn sleep_until(&self, deadline: std::time::Instant) -> futures::future::BoxFuture<'static, ()> {
        self.sleeps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        TokioRuntime.sleep_until(deadline)
    }
    fn spawn(&self, future: futures::future::BoxFuture<'static, ()>) {
        TokioRuntime.spawn(future)
    }
    fn spawn_blocking(&self, work: Box<dyn FnOnce() + Send + 'static>) -> futures::future::BoxFuture<'static, ()> {
        TokioRuntime.spawn_blocking(work)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_input_stream_shuts_the_worker_down_without_spinning() {
    let runtime = Arc::new(Counting { sleeps: Default::default() });
    let clock = runtime.clone();
    let backend = MemoryBackend::new(MemoryStore::new(app()), DbTime(1_700_000_000_000), move || clock.now());
    backend.with_store(|store, now| store.enqueue(NewTask::new("sleep", json!({"ms": 300})), now).unwrap());
    let config = WorkerConfig { concurrency: 1, shutdown_grace_ms: 5_000, ..WorkerConfig::default() };
    let worker = Worker::new(WorkerId("w".into()), app(), config, runtime.now()).unwrap();
    // Let the worker claim the task, then hang up the inputs.
    let (tx, rx) = futures::channel::mpsc::unbounded::<Input>();
    let handlers = registry().bind(runtime.clone());
    let run = tokio::spawn(driver::run(
        worker,
        runtime.clone(),
        backend.clone(),
        handlers,
        rx,
        DriverOptions::default(),
        None,
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(tx);
    let stats = tokio::time::timeout(Duration::from_secs(10), run).await.expect("drained").unwrap();
    assert_eq!(stats.completed, 1, "the running task finished within the grace period");
    let sleeps = runtime.sleeps.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sleeps < 100, "the driver spun: {sleeps} timers in about 300 ms");
}

/// An announced urgent task is claimed by a small claim of its own beside the buffer, starts
/// before the tasks buffered ahead of it, and the counters (the metrics' `kind` label) keep
/// that claim apart from the passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_claims_are_counted_apart_from_the_passes() {
    let app = AppConfig { prefetch_buffer: 16, claim_lease_ms: Some(60_000), ..app() };
    let config = WorkerConfig { concurrency: 1, ..WorkerConfig::default() };
    let counters = Arc::new(driver::Counters::new());
    let options = DriverOptions { counters: Some(counters.clone()), ..DriverOptions::default() };
    let cluster = cluster_with(app, 1, config, options);
    // Two slow tasks the first pass takes whole, one to run and one to buffer: it leaves no
    // floor behind, so no sweep below one goes out.
    let backlog = cluster.backend.with_store(|store, now| {
        let tasks = (0..2).map(|_| NewTask::new("sleep", json!({"ms": 300}))).collect();
        store.enqueue_many(tasks, now).unwrap()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while counters.snapshot().stats.claimed < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the backlog was not claimed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The enqueue announces its priority (the memory store's notification).
    let urgent = cluster.backend.with_store(|store, now| {
        store.enqueue_many(vec![NewTask::new("double", json!({"n": 21})).priority(-1)], now).unwrap()[0]
    });
    cluster.wait_terminal(&[urgent, backlog[0], backlog[1]], Duration::from_secs(10)).await;
    let started: Vec<TaskId> = cluster
        .events
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            Event::Started { task, .. } => Some(*task),
            _ => None,
        })
        .collect();
    assert_eq!(started, vec![backlog[0], urgent, backlog[1]], "the urgent task overtook the buffered one");
    let requests = counters.requests();
    // The urgent task is the one task the urgent claims took.
    let urgent_claims = requests.get("urgent_claim").map(|r| (r.count, r.tasks_sum));
    assert!(
        urgent_claims.is_some_and(|(count, tasks)| count >= 1 && tasks == 1),
        "the urgent task's claim counted apart: {urgent_claims:?} of {:?}",
        requests.keys().collect::<Vec<_>>()
    );
    assert_eq!(requests.get("claim").map(|r| r.tasks_sum), Some(2), "the pass is counted as a claim");
    cluster.shutdown().await;
}
