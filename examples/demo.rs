//! The demo: enqueues a mixed load, runs three workers on the embedded in-memory store in real
//! time, shows progress while the queue drains, and ends with a summary.
//!
//! It is also the smallest complete driver of the core: one thread owns the store and the
//! worker machines, handlers run on threads, and everything the machines ask for is done here.
//!
//! Run it with `cargo run --release --example demo` (`-- --tasks N --workers W --concurrency C`).

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use canter::config::{AppConfig, CustomQueue, QueueMode, RecoveryConfig, RetryPolicy, WorkerConfig};
use canter::db::{DbTime, NewTask, RunAt};
use canter::memory::{MemoryStore, Notification};
use canter::rng::Rng;
use canter::task::{ErrorCode, Lease, TaskError, TaskId, TaskState, WorkerId};
use canter::worker::{Command, Event, Input, TaskOutcome, Worker};
use serde_json::{Value, json};

/// The demo's only clock read: the core takes `now` as an argument, drivers read the clock.
#[allow(clippy::disallowed_methods)]
fn clock() -> Instant {
    Instant::now()
}

struct Options {
    tasks: usize,
    workers: usize,
    concurrency: u32,
}

fn options() -> Options {
    let mut options = Options { tasks: 2_000, workers: 3, concurrency: 16 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = pair.get(1).and_then(|v| v.parse::<usize>().ok());
        match (pair[0].as_str(), value) {
            ("--tasks", Some(v)) => options.tasks = v.max(1),
            ("--workers", Some(v)) => options.workers = v.clamp(1, 64),
            ("--concurrency", Some(v)) => options.concurrency = v.clamp(1, 1_000) as u32,
            _ => {
                eprintln!("usage: demo [--tasks N] [--workers W] [--concurrency C]");
                std::process::exit(2);
            }
        }
    }
    options
}

/// The handlers the demo registers, by name.
fn run_handler(name: &str, args: &Value) -> TaskOutcome {
    match name {
        "sleep" => {
            std::thread::sleep(Duration::from_millis(args["ms"].as_u64().unwrap_or(1)));
            TaskOutcome::Success(json!({"slept_ms": args["ms"]}))
        }
        "echo" => TaskOutcome::Success(args.clone()),
        "cpu" => {
            let mut x = 0u64;
            for i in 0..args["iterations"].as_u64().unwrap_or(1_000) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
            }
            TaskOutcome::Success(json!({"hash": x}))
        }
        "flaky" => TaskOutcome::Failure(TaskError::new(ErrorCode::User("FLAKY".into()), "failed on purpose")),
        "panic" => match std::panic::catch_unwind(|| panic!("a handler panicked on purpose")) {
            Ok(()) => TaskOutcome::Success(Value::Null),
            Err(_) => TaskOutcome::Failure(TaskError::new(ErrorCode::UnhandledError, "handler panicked")),
        },
        other => TaskOutcome::Failure(TaskError::new(
            ErrorCode::WorkerResolutionError,
            format!("no handler is registered under {other:?}"),
        )),
    }
}

fn mixed_load(count: usize, rng: &mut Rng) -> Vec<NewTask> {
    let flaky = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    (0..count)
        .map(|i| {
            let roll = rng.range(0, 100);
            let task = match roll {
                0..=54 => NewTask::new("sleep", json!({"ms": rng.range(1, 20)})),
                55..=74 => NewTask::new("echo", json!({"i": i})).queue("fast"),
                75..=89 => NewTask::new("cpu", json!({"iterations": rng.range(10_000, 200_000)})).queue("bulk"),
                90..=95 => NewTask::new("flaky", json!({"i": i})).retry(flaky.clone()),
                96..=97 => NewTask::new("panic", json!({})),
                _ => NewTask::new("sleep", json!({"ms": 5})).run_at(RunAt::DelayMs(rng.range(100, 1_500))),
            };
            task.priority(rng.range(0, 3) as i16)
        })
        .collect()
}

struct Run {
    store: MemoryStore,
    workers: Vec<Worker>,
    epoch: Instant,
    finished_tx: mpsc::Sender<(usize, TaskId, Lease, TaskOutcome)>,
    finished_rx: mpsc::Receiver<(usize, TaskId, Lease, TaskOutcome)>,
    enqueued_at: BTreeMap<TaskId, Instant>,
    started_at: BTreeMap<TaskId, Instant>,
    pickup: Vec<Duration>,
    outcomes: BTreeMap<&'static str, u64>,
}

impl Run {
    fn db_now(&self, now: Instant) -> DbTime {
        DbTime(1_700_000_000_000 + (now - self.epoch).as_millis() as i64)
    }

    /// Runs every command every worker has queued, until none has any.
    fn drain(&mut self, now: Instant) {
        loop {
            let mut idle = true;
            for w in 0..self.workers.len() {
                while let Some(command) = self.workers[w].poll_command() {
                    idle = false;
                    match command {
                        Command::Db { op, request } => {
                            let reply = self.store.apply(&request, self.db_now(now));
                            self.workers[w].handle_input(Input::Db { op, reply: Ok(reply) }, now);
                        }
                        Command::Spawn(run) => {
                            let tx = self.finished_tx.clone();
                            std::thread::spawn(move || {
                                let outcome = run_handler(&run.name, &run.args);
                                let _ = tx.send((w, run.id, run.lease, outcome));
                            });
                        }
                        // A thread cannot be stopped from outside; its late answer is ignored.
                        Command::Abort { .. } => {}
                    }
                }
                while let Some(event) = self.workers[w].poll_event() {
                    self.observe(event, now);
                }
            }
            for notification in self.store.take_notifications() {
                if let Notification::TaskReady { queue } = notification {
                    for worker in &mut self.workers {
                        worker.handle_input(Input::Notified { queue: queue.clone() }, now);
                    }
                    idle = false;
                }
            }
            if idle {
                return;
            }
        }
    }

    fn observe(&mut self, event: Event, now: Instant) {
        match event {
            Event::Started { task, .. } => {
                if let Some(at) = self.enqueued_at.get(&task) {
                    self.started_at.entry(task).or_insert(now);
                    self.pickup.push(now.saturating_duration_since(*at));
                }
            }
            Event::Finished { state, .. } => {
                *self.outcomes.entry(if state == TaskState::Pending { "retried" } else { "finished" }).or_default() += 1
            }
            Event::TimedOut { .. } => *self.outcomes.entry("timed out").or_default() += 1,
            Event::Lost { .. } => *self.outcomes.entry("lost").or_default() += 1,
            _ => {}
        }
    }

    fn step(&mut self) {
        let now = clock();
        let deadline = self.workers.iter().filter_map(|w| w.poll_timeout()).map(|(at, _)| at).min();
        let wait = deadline.map_or(Duration::from_millis(50), |at| at.saturating_duration_since(now));
        if let Ok((w, task, lease, outcome)) = self.finished_rx.recv_timeout(wait.min(Duration::from_millis(50))) {
            let now = clock();
            self.workers[w].handle_input(Input::TaskFinished { task, lease, outcome }, now);
            // Take every other answer that is already here before writing.
            while let Ok((w, task, lease, outcome)) = self.finished_rx.try_recv() {
                self.workers[w].handle_input(Input::TaskFinished { task, lease, outcome }, now);
            }
        }
        let now = clock();
        for worker in &mut self.workers {
            if worker.poll_timeout().is_some_and(|(at, _)| at <= now) {
                worker.handle_timeout(now);
            }
        }
        self.drain(now);
    }

    fn terminal(&self) -> (u64, BTreeMap<TaskState, u64>) {
        let mut by_state = BTreeMap::new();
        for ((_, state), n) in self.store.counts() {
            *by_state.entry(state).or_default() += n;
        }
        let done = by_state.iter().filter(|(s, _)| s.is_terminal()).map(|(_, n)| n).sum();
        (done, by_state)
    }
}

fn bar(done: u64, total: u64) -> String {
    let width = 30;
    let filled = (done * width / total.max(1)) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width as usize - filled))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let options = options();
    // The `panic` task panics on purpose: keep its message off the progress display.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let on_purpose = info.payload().downcast_ref::<&str>().is_some_and(|m| m.ends_with("on purpose"));
        if !on_purpose {
            default_hook(info);
        }
    }));
    let app = AppConfig {
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
    };
    let worker_config = WorkerConfig {
        concurrency: options.concurrency,
        poll_interval_ms: 1_000,
        handler_timeout_ms: Some(5_000),
        ..WorkerConfig::default()
    };
    println!(
        "canter demo: {} tasks, {} workers x concurrency {}, embedded in-memory store",
        options.tasks, options.workers, options.concurrency
    );
    println!("queues: fast (priority 1), default (priority 2), bulk (priority 3, at most 8 at once)");

    let epoch = clock();
    let (finished_tx, finished_rx) = mpsc::channel();
    let mut run = Run {
        store: MemoryStore::new(app.clone()),
        workers: Vec::new(),
        epoch,
        finished_tx,
        finished_rx,
        enqueued_at: BTreeMap::new(),
        started_at: BTreeMap::new(),
        pickup: Vec::new(),
        outcomes: BTreeMap::new(),
    };
    let mut rng = Rng::new(2026);
    let load = mixed_load(options.tasks, &mut rng);
    let now = clock();
    for chunk in load.chunks(500) {
        let ids = run.store.enqueue_many(chunk.to_vec(), run.db_now(now)).expect("the demo's tasks are valid");
        for id in ids {
            run.enqueued_at.insert(id, now);
        }
    }
    for i in 0..options.workers {
        let config = WorkerConfig { seed: Some(i as u64 + 1), ..worker_config.clone() };
        let worker = Worker::new(WorkerId(format!("demo-worker-{}", i + 1)), app.clone(), config, now)
            .expect("the demo's configuration is valid");
        run.workers.push(worker);
    }
    run.drain(now);

    let total = options.tasks as u64;
    let mut last_print = clock();
    loop {
        run.step();
        let (done, by_state) = run.terminal();
        if clock() - last_print >= Duration::from_millis(250) || done == total {
            last_print = clock();
            let count = |s| by_state.get(&s).copied().unwrap_or(0);
            println!(
                "{} {:>6}/{} done  pending {:>5}  running {:>3}  completed {:>5}  failed {:>4}  {:>5.1}s",
                bar(done, total),
                done,
                total,
                count(TaskState::Pending),
                count(TaskState::Running) + count(TaskState::Claimed),
                count(TaskState::Completed),
                count(TaskState::Failed),
                (clock() - epoch).as_secs_f64()
            );
        }
        if done == total {
            break;
        }
    }
    let drained_at = clock();
    for worker in &mut run.workers {
        worker.handle_input(Input::Shutdown, drained_at);
    }
    while !run.workers.iter().all(Worker::is_stopped) {
        run.step();
    }

    let elapsed = drained_at - epoch;
    let (_, by_state) = run.terminal();
    let mut pickup = run.pickup.clone();
    pickup.sort();
    println!();
    println!("summary");
    println!(
        "  tasks          {total} in {:.2}s: {:.0} tasks/s",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    for (state, n) in &by_state {
        println!("  {:<14} {n}", state.as_str().to_lowercase());
    }
    println!("  retried runs   {}", run.outcomes.get("retried").copied().unwrap_or(0));
    println!(
        "  enqueue to start (includes the queue's backlog and run_at delays): p50 {:?}  p90 {:?}  p99 {:?}  max {:?}",
        percentile(&pickup, 0.5),
        percentile(&pickup, 0.9),
        percentile(&pickup, 0.99),
        pickup.last().copied().unwrap_or_default()
    );
    for worker in &run.workers {
        let s = worker.stats();
        println!(
            "  {}: claimed {} in {} passes, completed {}, failed {}, retried {}",
            worker.id(),
            s.claimed,
            s.claim_passes,
            s.completed,
            s.failed,
            s.retried
        );
    }
    let not_terminal: u64 = by_state.iter().filter(|(s, _)| !s.is_terminal()).map(|(_, n)| n).sum();
    if not_terminal > 0 {
        eprintln!("{not_terminal} tasks did not finish");
        std::process::exit(1);
    }
}
