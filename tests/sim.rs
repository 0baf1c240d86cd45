//! The deterministic simulation (`canter::sim`): a sweep of seeds, one-seed replay with the
//! full trace, a determinism check, and the seeds and scenarios of past failures.
//!
//! - `cargo test --test sim` sweeps seeds `0..DEFAULT_SEEDS`, checks determinism and replays
//!   `tests/sim-regressions.txt`;
//! - `CANTER_SEED=<n> cargo test --test sim -- --nocapture replay` replays seed `n` printing
//!   every trace line as it happens;
//! - `CANTER_SEEDS=<n> cargo test --test sim -- --nocapture sweep` sweeps `n` seeds from
//!   `CANTER_SEED_START` (or from a random base, printed);
//! - a failing seed prints itself, the end of its trace and the command that replays it.

use std::hash::BuildHasher;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use canter::sim::{self, SimFailure, SimReport, Trace};

/// Seeds the plain sweep runs (kept under a minute in a debug build on two cores).
const DEFAULT_SEEDS: u64 = 300;

/// Full failure reports printed by one sweep; the rest are listed by seed.
const PRINTED_FAILURES: usize = 5;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    let value = value.trim();
    let parsed = match value.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => value.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={value:?} is not a u64: {e}")))
}

#[allow(clippy::disallowed_methods)] // wall time of the sweep, for the summary line only
fn wall_clock() -> Instant {
    Instant::now()
}

struct Sweep {
    reports: Vec<SimReport>,
    failures: Vec<SimFailure>,
    wall: Duration,
}

/// Runs `count` seeds from `start` on every core.
fn sweep_seeds(start: u64, count: u64) -> Sweep {
    let begun = wall_clock();
    let next = AtomicU64::new(0);
    let results: Mutex<(Vec<SimReport>, Vec<SimFailure>)> = Mutex::new((Vec::new(), Vec::new()));
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(count.max(1) as usize);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let seed = start.wrapping_add(i);
                    let outcome = sim::run_seed(seed);
                    let mut results = results.lock().unwrap_or_else(|e| e.into_inner());
                    match outcome {
                        Ok(report) => results.0.push(report),
                        Err(failure) => {
                            eprintln!("seed {seed} FAILED: {}", failure.message);
                            results.1.push(failure);
                        }
                    }
                }
            });
        }
    });
    let (mut reports, mut failures) = results.into_inner().unwrap_or_else(|e| e.into_inner());
    reports.sort_by_key(|r| r.seed);
    failures.sort_by_key(|f| f.seed);
    Sweep { reports, failures, wall: begun.elapsed() }
}

fn summarize(start: u64, count: u64, sweep: &Sweep) {
    let steps: u64 = sweep.reports.iter().map(|r| r.steps).sum();
    let faulty = sweep.reports.iter().filter(|r| r.faulty).count();
    let virtual_secs: u64 = sweep.reports.iter().map(|r| r.elapsed.as_secs()).sum();
    let secs = sweep.wall.as_secs_f64();
    let stale: u64 = sweep.reports.iter().map(|r| r.stale_spawns).sum();
    let fenced: u64 = sweep.reports.iter().map(|r| r.fenced).sum();
    let busiest = sweep.reports.iter().map(|r| r.max_requests_per_second).max().unwrap_or(0);
    let dead: u64 = sweep.reports.iter().map(|r| r.dead_workers).sum();
    let with_workflows = sweep.reports.iter().filter(|r| r.workflows > 0).count();
    let workflows: usize = sweep.reports.iter().map(|r| r.workflows).sum();
    let completed: usize = sweep.reports.iter().map(|r| r.workflows_completed).sum();
    let failed: usize = sweep.reports.iter().map(|r| r.workflows_failed).sum();
    let cancelled: usize = sweep.reports.iter().map(|r| r.workflows_cancelled).sum();
    let skipped: usize = sweep.reports.iter().map(|r| r.skipped).sum();
    let with_broker = sweep.reports.iter().filter(|r| r.broker_wakeups > 0).count();
    let broker_wakeups: u64 = sweep.reports.iter().map(|r| r.broker_wakeups).sum();
    let with_floors = sweep.reports.iter().filter(|r| r.floored_passes > 0).count();
    let floored: u64 = sweep.reports.iter().map(|r| r.floored_passes).sum();
    eprintln!("sim sweep: {with_floors} passed seeds sent {floored} claim passes with a priority floor");
    let with_bounds = sweep.reports.iter().filter(|r| r.bounded_passes > 0).count();
    let bounded: u64 = sweep.reports.iter().map(|r| r.bounded_passes).sum();
    let looks: u64 = sweep.reports.iter().map(|r| r.looks).sum();
    eprintln!(
        "sim sweep: {with_bounds} passed seeds sent {bounded} claim passes from an announced run-at, and {looks} \
         looks at every row beside them"
    );
    eprintln!(
        "sim sweep: {with_broker} passed seeds woke workers through a broker: {broker_wakeups} wake-ups delivered"
    );
    let with_unnotified = sweep.reports.iter().filter(|r| r.unnotified_enqueues > 0).count();
    let unnotified: u64 = sweep.reports.iter().map(|r| r.unnotified_enqueues).sum();
    let debts: u64 = sweep.reports.iter().map(|r| r.wakeup_debts).sum();
    eprintln!(
        "sim sweep: {with_unnotified} passed seeds enqueued without notifying (no worker waiting) {unnotified} times; \
         workers looked at {debts} such tasks they owed a look"
    );
    eprintln!(
        "sim sweep: {with_workflows} passed seeds had workflows: {workflows} workflows, {completed} completed, {failed} \
         failed, {cancelled} cancelled; {skipped} steps skipped"
    );
    eprintln!(
        "sim sweep: seeds {start}..{} ({count}): {} passed ({faulty} with faults), {} failed; {:.1} s wall, {:.1} seeds/s, \
         {steps} steps, {virtual_secs} virtual s; {stale} stale spawns, {fenced} fenced writes, {dead} dead workers found by \
         their tokens, busiest worker {busiest} requests/s",
        start.wrapping_add(count),
        sweep.reports.len(),
        sweep.failures.len(),
        secs,
        count as f64 / secs.max(1e-9),
    );
}

fn fail_with(failures: &[SimFailure]) -> ! {
    for failure in failures.iter().take(PRINTED_FAILURES) {
        eprintln!("\n{failure}\n");
    }
    let seeds: Vec<String> = failures.iter().map(|f| f.seed.to_string()).collect();
    panic!("{} seeds failed: {}\nreplay one with: {}", failures.len(), seeds.join(" "), failures[0].replay_command());
}

#[test]
fn sweep() {
    let (start, count) = match env_u64("CANTER_SEEDS") {
        Some(count) => {
            let start = env_u64("CANTER_SEED_START").unwrap_or_else(|| {
                // A random base without a clock: the standard library's per-process hash keys.
                std::hash::RandomState::new().hash_one(0x5EED_u64) >> 16
            });
            eprintln!("sweeping {count} seeds from CANTER_SEED_START={start}");
            (start, count)
        }
        None => (0, DEFAULT_SEEDS),
    };
    let sweep = sweep_seeds(start, count);
    summarize(start, count, &sweep);
    if !sweep.failures.is_empty() {
        fail_with(&sweep.failures);
    }
}

#[test]
fn replay() {
    let Some(seed) = env_u64("CANTER_SEED") else {
        // Without a seed: one quiet run, so the test is not empty.
        sim::run_seed(1).unwrap_or_else(|failure| panic!("{failure}"));
        return;
    };
    let options = sim::SimOptions::from_seed(seed);
    eprintln!("replaying seed {seed}\n{options:#?}");
    match sim::run_seed_with(seed, Trace::new(usize::MAX).echo(true)) {
        Ok(report) => eprintln!("seed {seed} passed: {report:#?}"),
        Err(failure) => panic!("{failure}"),
    }
}

#[test]
fn determinism() {
    for seed in [0, 7, 42, 1_000_003, u64::MAX] {
        let first = sim::run_seed(seed);
        let second = sim::run_seed(seed);
        let hash = |r: &Result<SimReport, SimFailure>| match r {
            Ok(report) => (report.trace_hash, report.trace_lines),
            Err(failure) => (failure.trace_hash, failure.step),
        };
        assert_eq!(hash(&first), hash(&second), "seed {seed} ran twice differently");
        assert_eq!(first, second, "seed {seed} ran twice differently");
    }
}

/// With a broker carrying the client's enqueues (their statements notify nobody) and every
/// worker event-driven (no poll), the workers hear of new tasks through the broker alone:
/// with no other fault, every task ends before the faults would heal, though the broker
/// duplicates, delays and reorders its wake-ups and drops subscriptions for seconds (a
/// catch-up claim when they come back). Without its wake-ups, tasks enqueued while the
/// workers idle would wait for the heal.
#[test]
fn a_broker_alone_wakes_event_driven_workers() {
    let mut woken = 0;
    let mut runs = 0;
    for seed in 0.. {
        let mut options = sim::SimOptions::from_seed(seed);
        // Serial and capped queues take their time whatever wakes the workers: left out.
        let queues = &options.app.custom_queues;
        if queues.iter().any(|q| q.serial || q.max_concurrency.is_some()) || options.app.cluster_wide_cap.is_some() {
            continue;
        }
        for worker in &mut options.workers {
            worker.deployment_mode = canter::config::DeploymentMode::EventDrivenOnly;
        }
        // Tasks due at once and quick to run, none failing: each ends soon after it is heard
        // of (paused workflows would wait for the operator, who resumes them at the heal).
        let load = &mut options.load;
        (load.delay_chance, load.retry_chance, load.good_until_chance, load.cancel_chance) = (0.0, 0.0, 0.0, 0.0);
        (load.error_chance, load.panic_chance, load.odd_error_chance) = (0.0, 0.0, 0.0);
        (load.hang_chance, load.slow_chance, load.workflows) = (0.0, 0.0, 0);
        load.duration_max_ms = load.duration_max_ms.min(100);
        let last = options.workers.len() - 1;
        options.faults = sim::FaultOptions {
            broker: Some(sim::BrokerFaults {
                loss_chance: 0.3,
                duplicate_chance: 0.3,
                delay_max_ms: 400,
                drops: vec![(5_000, 0, 3_000), (20_000, last, 10_000)],
            }),
            ..sim::FaultOptions::none()
        };
        let report = sim::Sim::new(seed, options, Trace::new(200), wall_clock())
            .run()
            .unwrap_or_else(|failure| panic!("{failure}"));
        assert!(
            report.settled_at <= report.healed_at,
            "seed {seed}: tasks waited for the heal ({:?}) to end at {:?}",
            report.healed_at,
            report.settled_at
        );
        woken += report.broker_wakeups;
        runs += 1;
        if runs == 24 {
            break;
        }
    }
    assert!(woken > 0, "no wake-up came through the broker");
}

/// Seeds that once failed, from `tests/sim-regressions.txt` (one per line, `#` comments).
#[test]
fn regressions() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sim-regressions.txt");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let seeds: Vec<u64> = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or("").trim())
        .filter(|line| !line.is_empty())
        .map(|line| line.parse().unwrap_or_else(|e| panic!("{path}: {line:?} is not a seed: {e}")))
        .collect();
    let failures: Vec<SimFailure> = seeds.iter().filter_map(|&seed| sim::run_seed(seed).err()).collect();
    if !failures.is_empty() {
        fail_with(&failures);
    }
}

// -------------------------------------------------------------------------------------------
// Scripted regressions: the smallest scenario of each bug the sweep found, with the real
// worker machine and the real memory store, the script choosing which request the store
// applies when and whether its reply comes back. See the issue-6 report for each bug's fix.
// -------------------------------------------------------------------------------------------

mod scripted {
    use std::time::{Duration, Instant};

    use std::sync::Arc;

    use canter::budget::ClaimPolicy;
    use canter::config::{AppConfig, CustomQueue, DeploymentMode, QueueMode, RetryPolicy, WorkerConfig};
    use canter::memory::MemoryStore;
    use canter::sim::DB_EPOCH_MS;
    use canter::store::Notification;
    use canter::store::{DbFailure, DbReply, DbRequest, DbTime, NewTask, OpId, RunAt};
    use canter::task::{ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
    use canter::worker::{Command, Event, Input, TaskOutcome, TaskRun, Worker};
    use serde_json::json;

    /// One worker and one store, stepped by hand.
    struct Script {
        store: MemoryStore,
        worker: Worker,
        epoch: Instant,
        now: Instant,
        /// Requests sent and not applied yet, oldest first.
        requests: Vec<(OpId, DbRequest)>,
        /// Handlers spawned and not answered or aborted.
        runs: Vec<TaskRun>,
        events: Vec<Event>,
    }

    impl Script {
        fn new(app: AppConfig, config: WorkerConfig) -> Script {
            let epoch = super::wall_clock();
            let store = MemoryStore::new(app.clone());
            let worker = Worker::new(WorkerId("w".into()), app, config, epoch).expect("a valid configuration");
            let mut script =
                Script { store, worker, epoch, now: epoch, requests: Vec::new(), runs: Vec::new(), events: Vec::new() };
            script.drain();
            script
        }

        fn db_now(&self) -> DbTime {
            DbTime(DB_EPOCH_MS + (self.now - self.epoch).as_millis() as i64)
        }

        fn drain(&mut self) {
            while let Some(command) = self.worker.poll_command() {
                match command {
                    Command::Db { op, request } => self.requests.push((op, request)),
                    Command::Spawn(run) => self.runs.push(run),
                    Command::Abort { task, lease } => self.runs.retain(|r| (r.id, r.lease) != (task, lease)),
                    other => panic!("a command this driver does not know: {other:?}"),
                }
            }
            while let Some(event) = self.worker.poll_event() {
                self.events.push(event);
            }
        }

        fn input(&mut self, input: Input) {
            self.worker.handle_input(input, self.now);
            self.drain();
        }

        fn enqueue(&mut self, task: NewTask) -> TaskId {
            let id = self.store.enqueue(task, self.db_now()).expect("a valid task");
            self.store.take_notifications();
            id
        }

        /// The oldest pending request of this kind.
        fn op(&self, kind: &str) -> OpId {
            self.requests
                .iter()
                .find(|(_, r)| r.kind() == kind)
                .unwrap_or_else(|| panic!("no pending {kind} in {:?}", self.requests))
                .0
        }

        fn has(&self, kind: &str) -> bool {
            self.requests.iter().any(|(_, r)| r.kind() == kind)
        }

        /// The store applies the request now; its reply is not delivered yet.
        fn apply(&mut self, op: OpId) -> DbReply {
            let index = self.requests.iter().position(|(o, _)| *o == op).expect("a pending request");
            let (_, request) = self.requests.remove(index);
            self.store.apply(&request, self.db_now())
        }

        /// Delivers an answer; a request answered without being applied is gone too.
        fn answer(&mut self, op: OpId, reply: Result<DbReply, DbFailure>) {
            self.requests.retain(|(o, _)| *o != op);
            self.input(Input::Db { op, reply });
        }

        /// Applies the request and delivers its reply.
        fn run_op(&mut self, op: OpId) -> DbReply {
            let reply = self.apply(op);
            self.answer(op, Ok(reply.clone()));
            reply
        }

        /// Applies and answers every pending request, oldest first, until none is left, and
        /// delivers the store's notifications when `notify`.
        fn settle(&mut self, notify: bool) {
            for _ in 0..1_000 {
                for notification in self.store.take_notifications() {
                    if let (true, Notification::TaskReady { queue, priority, run_at }) = (notify, notification) {
                        self.input(Input::Notified { queue, priority, run_at });
                    }
                }
                let Some(&(op, _)) = self.requests.first() else { return };
                self.run_op(op);
            }
            panic!("requests keep coming: {:?}", self.requests);
        }

        /// Moves the clock `ms` forward, firing every timer that falls due on the way.
        fn advance(&mut self, ms: u64) {
            let end = self.now + Duration::from_millis(ms);
            while let Some((at, _)) = self.worker.poll_timeout().filter(|(at, _)| *at <= end) {
                self.now = self.now.max(at);
                self.worker.handle_timeout(self.now);
                self.drain();
            }
            self.now = end;
        }

        /// Runs a healthy world for `ms`: every request answered at once, every handler
        /// returning `Success` at once, notifications delivered.
        fn run_for(&mut self, ms: u64) {
            let end = self.now + Duration::from_millis(ms);
            loop {
                self.settle(true);
                if let Some(run) = self.runs.first().cloned() {
                    self.finish(run.id, TaskOutcome::Success(json!("done")));
                    continue;
                }
                match self.worker.poll_timeout() {
                    Some((at, _)) if at <= end => {
                        self.now = self.now.max(at);
                        self.worker.handle_timeout(self.now);
                        self.drain();
                    }
                    _ => break,
                }
            }
            self.now = end;
        }

        /// The handler of `task` returns `outcome`.
        fn finish(&mut self, task: TaskId, outcome: TaskOutcome) {
            let index = self.runs.iter().position(|r| r.id == task).expect("a running handler");
            let run = self.runs.remove(index);
            self.input(Input::TaskFinished { task, lease: run.lease, outcome });
        }

        fn runs(&self, task: TaskId, lease: Lease) -> bool {
            self.worker.running_leases().any(|t| t == TaskLease { task, lease })
        }

        fn state(&self, task: TaskId) -> TaskState {
            self.store.task(task).expect("an enqueued task").state
        }
    }

    fn lost_reply() -> Result<DbReply, DbFailure> {
        Err(DbFailure::Unknown("reply lost".into()))
    }

    fn task_error() -> TaskOutcome {
        TaskOutcome::Failure(TaskError::new(ErrorCode::TaskError, "failed"))
    }

    fn one_retry_after_a_second() -> AppConfig {
        AppConfig { retry: RetryPolicy::fixed(vec![1]).with_jitter(false), ..AppConfig::default() }
    }

    fn worker(concurrency: u32, mode: DeploymentMode) -> WorkerConfig {
        WorkerConfig {
            concurrency,
            deployment_mode: mode,
            poll_interval_ms: 1_000,
            seed: Some(7),
            ..WorkerConfig::default()
        }
    }

    /// Bug A (sweep seed 40): a retry whose Finish landed but whose reply was lost leaves the
    /// task held (Finishing) while the store has it Pending; once its retry delay passes, the
    /// worker's own next claim takes it again and the worker panics ("task 1 claimed while
    /// this worker already holds it").
    #[test]
    fn regression_a_claiming_a_task_whose_retry_reply_was_lost() {
        let mut s = Script::new(one_retry_after_a_second(), worker(1, DeploymentMode::PollingOnly));
        let task = s.enqueue(NewTask::new("job", json!(1)));
        s.settle(false);
        assert!(s.runs(task, Lease(1)));
        s.finish(task, task_error());
        let finish = s.op("finish");
        s.apply(finish); // the retry lands: Pending, due in one second
        s.answer(finish, lost_reply());
        s.advance(1_500); // the database retry re-sends the finish; the poll claims
        let claim = s.op("claim");
        s.run_op(claim); // the store hands the task out again, under lease 2
        assert!(s.runs(task, Lease(2)), "the worker runs the task's new lease");
        let resend = s.op("finish");
        s.run_op(resend); // the stale re-send is fenced
        assert!(s.runs(task, Lease(2)), "a stale re-send does not drop the new lease");
        assert_eq!(s.state(task), TaskState::Running);
    }

    /// Bug B (sweep seed 12, no faults needed): in soft-cap mode a heartbeat sent while a start
    /// is in flight lists the task as claimed; when the start lands first, the store reports
    /// the task lost, and the worker aborts a healthy handler and leaves the task Running for
    /// the reaper (a spurious WORKER_CRASHED).
    #[test]
    fn regression_b_a_start_racing_a_heartbeat() {
        let mut s = Script::new(
            soft_cap_app(),
            WorkerConfig { poll_interval_ms: 5_000, ..worker(1, DeploymentMode::PollingOnly) },
        );
        let first = s.enqueue(NewTask::new("job", json!(1)));
        let second = s.enqueue(NewTask::new("job", json!(2)));
        s.settle(false); // the first starts in the claim, the second waits in the buffer
        assert!(s.runs(first, Lease(1)));
        s.finish(first, TaskOutcome::Success(json!(1))); // its permit frees: the second starts
        let start = s.op("start");
        s.advance(1_000); // the heartbeat goes out while the start is in flight
        let beat = s.op("heartbeat");
        s.run_op(start);
        assert!(s.runs(second, Lease(1)));
        s.run_op(beat);
        assert!(s.runs(second, Lease(1)), "the heartbeat that raced the start drops a healthy run");
        assert_eq!(s.state(second), TaskState::Running);
    }

    /// Bug C (sweep seed 38): losses are matched by task id, not by lease. A finish re-sent
    /// after a lost reply names the old lease; when its "lost" answer arrives after the task was
    /// claimed again, the worker drops the new lease's run.
    #[test]
    fn regression_c_a_stale_resend_drops_a_newer_lease() {
        let mut app = one_retry_after_a_second();
        app.recovery.claimer_heartbeat_interval_ms = 1_000;
        app.recovery.runner_heartbeat_interval_ms = 1_000;
        let mut s = Script::new(app, WorkerConfig { poll_interval_ms: 5_000, ..worker(1, DeploymentMode::Hybrid) });
        s.settle(false); // registered, out of work, marked waiting
        let task = s.enqueue(NewTask::new("job", json!(1)));
        s.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        s.settle(false);
        s.finish(task, task_error());
        let finish = s.op("finish");
        s.apply(finish); // the retry lands
        s.answer(finish, lost_reply());
        s.advance(1_000); // the re-send goes out (held in flight), then a heartbeat
        let resend = s.op("finish");
        let beat = s.op("heartbeat");
        s.run_op(beat); // the row is Pending: the worker rightly lets lease 1 go
        s.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        let claim = s.op("claim");
        s.run_op(claim); // the retry is due: lease 2 starts
        assert!(s.runs(task, Lease(2)));
        s.run_op(resend); // the stale re-send of lease 1 is reported lost
        assert!(s.runs(task, Lease(2)), "the loss of lease 1 dropped the run of lease 2");
    }

    /// Bug D (sweep seeds 14, 289): in EventDrivenOnly mode nothing wakes a worker when a
    /// delayed task (or a retry) becomes due: notifications fire at enqueue and the worker does
    /// not poll while it listens, so the task is never claimed.
    #[test]
    fn regression_d_event_driven_only_runs_delayed_tasks() {
        let mut s = Script::new(AppConfig::default(), worker(1, DeploymentMode::EventDrivenOnly));
        s.input(Input::Listener { connected: true });
        s.settle(true);
        let task = s.enqueue(NewTask::new("job", json!(1)).run_at(RunAt::DelayMs(5_000)));
        s.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        s.run_for(120_000);
        assert_eq!(s.state(task), TaskState::Completed, "a delayed task never ran in EventDrivenOnly mode");
    }

    /// Bug E (sweep seed 42): after the grace period one failed request stops a draining
    /// worker at once: a claim whose reply was lost is never undone (it reports `abandoned
    /// 0`), so the task it took stays Running under a stopped worker until the reaper fails
    /// or retries it with WORKER_CRASHED.
    #[test]
    fn regression_e_shutdown_after_grace_leaks_an_unanswered_claim() {
        let config = WorkerConfig { shutdown_grace_ms: 0, ..worker(1, DeploymentMode::PollingOnly) };
        let mut s = Script::new(AppConfig::default(), config);
        let task = s.enqueue(NewTask::new("job", json!(1)));
        let register = s.op("register_worker");
        s.run_op(register);
        s.input(Input::Shutdown);
        s.advance(0); // the grace period (0 ms) is over
        let claim = s.op("claim");
        s.apply(claim); // the claim takes and starts the task...
        s.answer(claim, lost_reply()); // ...and its reply is lost
        s.run_for(60_000);
        assert!(s.worker.is_stopped());
        assert_eq!(s.state(task), TaskState::Pending, "the unanswered claim was never undone");
    }

    /// Bug F (sweep seed 52 with A to D fixed): a shutdown right after start deregisters while
    /// the registration is still in flight; the registration lands last and the stopped worker
    /// looks alive in the registry.
    #[test]
    fn regression_f_deregistration_overtaken_by_registration() {
        let mut s = Script::new(AppConfig::default(), worker(1, DeploymentMode::PollingOnly));
        let claim = s.op("claim");
        s.run_op(claim);
        s.input(Input::Shutdown);
        if s.has("deregister_worker") {
            let deregister = s.op("deregister_worker");
            s.run_op(deregister);
        }
        let register = s.op("register_worker");
        s.run_op(register);
        s.settle(false);
        assert!(s.worker.is_stopped());
        let record = s.store.workers().into_iter().find(|r| r.info.worker.0 == "w").expect("registered");
        assert!(record.stopped, "the worker stopped but the registry says it runs");
    }

    /// Soft-cap mode with a cap on the queue, so that buffered tasks start by a start request
    /// (on an uncapped queue they start without one).
    fn soft_cap_app() -> AppConfig {
        let mut app = AppConfig {
            prefetch_buffer: 1,
            claim_lease_ms: Some(60_000),
            queue_mode: QueueMode::Custom,
            custom_queues: vec![CustomQueue::new("default").with_max_concurrency(100)],
            ..AppConfig::default()
        };
        app.recovery.claimer_heartbeat_interval_ms = 1_000;
        app.recovery.runner_heartbeat_interval_ms = 1_000;
        app
    }

    /// Bug C, start path (sweep seeds 2880 and 1224 with A and B fixed): the answer to a start
    /// is matched by task id too. A start of lease 1 that gets no answer after the task was
    /// lost and claimed again under lease 2 puts the *running* lease-2 task back into the
    /// buffer: the worker forgets its handler and starts the task a second time.
    #[test]
    fn regression_c_a_stale_start_answer_restarts_a_newer_lease() {
        let mut s =
            Script::new(soft_cap_app(), WorkerConfig { poll_interval_ms: 5_000, ..worker(1, DeploymentMode::Hybrid) });
        s.settle(false); // registered, out of work, marked waiting
        let first = s.enqueue(NewTask::new("job", json!(1)));
        let second = s.enqueue(NewTask::new("job", json!(2)));
        s.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        s.settle(false); // the first runs, the second waits in the buffer
        s.finish(first, TaskOutcome::Success(json!(1)));
        let start = s.op("start"); // the second's start, left without an answer for now
        let finish = s.op("finish");
        s.run_op(finish);
        s.advance(10);
        let reap = DbRequest::Reap {
            worker: WorkerId("other".into()),
            claimed_stale_ms: Some(1),
            running_stale_ms: None,
            entropy: 0,
        };
        s.store.apply(&reap, s.db_now()); // another worker's reaper requeues the claim
        s.advance(1_000);
        let beat = s.op("heartbeat");
        s.run_op(beat); // the worker learns and lets lease 1 go
        s.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        let claim = s.op("claim");
        s.run_op(claim); // claimed and started again under lease 2
        assert!(s.runs(second, Lease(2)));
        s.answer(start, lost_reply()); // the lease-1 start never got an answer
        assert!(s.runs(second, Lease(2)), "the stale start's failure took lease 2 away from its handler");
        assert!(!s.has("start"), "the worker starts a task whose handler already runs");
    }

    /// Bug H (found with B to D fixed): a listener that reconnects does not catch up. In
    /// EventDrivenOnly mode the notifications sent while it was down are gone, the fallback
    /// poll is disarmed at reconnection, and the work waits for the next notification.
    #[test]
    fn regression_h_a_reconnected_listener_catches_up() {
        let mut s = Script::new(
            AppConfig::default(),
            WorkerConfig { poll_interval_ms: 5_000, ..worker(1, DeploymentMode::EventDrivenOnly) },
        );
        s.input(Input::Listener { connected: true });
        s.settle(true);
        s.input(Input::Listener { connected: false });
        let task = s.enqueue(NewTask::new("job", json!(1))); // its notification is lost
        s.advance(1_000);
        s.input(Input::Listener { connected: true }); // back before the fallback poll
        s.run_for(120_000);
        assert_eq!(s.state(task), TaskState::Completed, "work enqueued while the listener was down never ran");
    }

    /// Bug I (sweep seed 2966 with A to D fixed): a start that fails (or is deferred) while the
    /// worker drains goes back to the buffer, which only the start of shutdown empties: the
    /// task is never handed back and the worker never finishes draining (on main the start
    /// and heartbeat race, bug B, hides it by orphaning the task instead).
    #[test]
    fn regression_i_a_start_without_answer_during_shutdown_is_handed_back() {
        let config = WorkerConfig {
            shutdown_grace_ms: 1_000,
            poll_interval_ms: 5_000,
            ..worker(1, DeploymentMode::PollingOnly)
        };
        let mut s = Script::new(soft_cap_app(), config);
        let first = s.enqueue(NewTask::new("job", json!(1)));
        let second = s.enqueue(NewTask::new("job", json!(2)));
        s.settle(false);
        s.finish(first, TaskOutcome::Success(json!(1)));
        let finish = s.op("finish");
        s.run_op(finish);
        s.input(Input::Shutdown);
        let start = s.op("start");
        s.apply(start); // the second starts...
        s.answer(start, lost_reply()); // ...and the answer is lost
        s.run_for(60_000);
        assert!(s.worker.is_stopped(), "the worker never finished draining");
        assert_eq!(s.state(second), TaskState::Pending, "the task was not handed back");
    }

    /// Bug J (sweep seeds 4219, 5566 with A to I fixed): in EventDrivenOnly mode a worker
    /// stopped by a queue (or cluster) cap claims again only on its own completions or a
    /// notification, and a slot freed by another worker or the reaper sends none: the queue
    /// starves.
    #[test]
    fn regression_j_a_cap_blocked_event_driven_worker_claims_when_capacity_frees() {
        let mut app = AppConfig {
            queue_mode: QueueMode::Custom,
            custom_queues: vec![CustomQueue::new("q").with_max_concurrency(1)],
            ..AppConfig::default()
        };
        // The dead worker's run fails (no crash retry): only the waiting task is left to run.
        app.recovery.crash_retries = 0;
        let mut s = Script::new(
            app.clone(),
            WorkerConfig { poll_interval_ms: 5_000, ..worker(1, DeploymentMode::EventDrivenOnly) },
        );
        let held = s.enqueue(NewTask::new("job", json!(1)));
        let waiting = s.enqueue(NewTask::new("job", json!(2)));
        let policy = Arc::new(ClaimPolicy::from_config(&app, &WorkerConfig::default()));
        let other = DbRequest::Claim {
            worker: WorkerId("dying".into()),
            token: 1,
            policy,
            my_running: 0,
            my_claimed: 0,
            start_now: 1,
            lease_ms: 60_000,
        };
        s.store.apply(&other, s.db_now()); // another worker takes the queue's only slot
        s.input(Input::Listener { connected: true });
        s.settle(true); // our claim finds the queue at its cap
        assert_eq!(s.state(waiting), TaskState::Pending);
        s.advance(10);
        let reap = DbRequest::Reap {
            worker: WorkerId("reaper".into()),
            claimed_stale_ms: None,
            running_stale_ms: Some(1),
            entropy: 0,
        };
        s.store.apply(&reap, s.db_now()); // that worker died: the reaper frees the slot
        assert_eq!(s.state(held), TaskState::Failed);
        s.run_for(120_000);
        assert_eq!(s.state(waiting), TaskState::Completed, "the queue starved after its slot was freed");
    }
}
