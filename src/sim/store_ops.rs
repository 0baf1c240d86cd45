//! Operation sequences against one [`MemoryStore`]: the vocabulary shared by the claim/cap
//! model (`tests/model_claim_cap.rs`) and the `store_ops` fuzz target (`fuzz/`).
//!
//! A [`StoreOp`] is one thing a worker or the clock does to the store: enqueue a task, claim
//! for a worker, finish or release a task some worker holds, heartbeat a worker's runs, let
//! time pass, run the reaper. Its fields are small integers that the [`Harness`] reduces
//! modulo the sizes of the [`Setup`] (3 workers, 3 queues, the tasks held right now), so every
//! value is a valid operation and a fuzzer or a proptest strategy can generate them freely.
//!
//! The [`Harness`] applies operations at a virtual database clock and, after every one,
//! asserts the invariants:
//!
//! - every request's reply agrees with the rows as they were before it (the simulation's
//!   per-request checks: a claim takes the best claimable rows within the worker's budget,
//!   writes apply exactly when the lease is held, the reaper takes exactly the stale runs);
//! - every enqueued task is in the store exactly once; attempts and leases never decrease; a
//!   terminal task never changes;
//! - the caps hold in hard-cap mode (the only mode here): per queue and across the cluster
//!   (the store's rows), and per worker (the rows each worker holds, against its concurrency);
//! - no task is handed out while a worker holds it; every Running row is held by the worker
//!   and under the lease the store names, and every task a worker holds is Running under it.
//!
//! A violation panics with the operation and what broke: that is the point of the harness.
//! Bad input never does.
//!
//! With the feature `arbitrary`, [`StoreOp`], [`Setup`] and [`Input`] implement
//! `arbitrary::Arbitrary`; the fuzz target is `fuzz_target!(|input: Input| { input.run(); })`.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::json;

use crate::budget::ClaimPolicy;
use crate::config::{AppConfig, CustomQueue, QueueMode, WorkerConfig};
use crate::memory::MemoryStore;
use crate::store::{Completion, DbReply, DbRequest, DbTime, FinishOutcome, NewTask, ReapReport, RunAt};
use crate::task::{ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};

use super::DB_EPOCH_MS;
use super::invariants::Checker;

/// The workers that claim: worker `w` is [`worker_id`]`(w)`, for `w` below this.
pub const WORKERS: usize = 3;

/// The application's queues, in priority order: (name, priority, cap).
pub const QUEUES: [(&str, u8, Option<u32>); 3] = [("high", 1, Some(3)), ("mid", 2, None), ("low", 3, Some(2))];

/// The most operations [`Input::run`] applies.
pub const MAX_OPS: usize = 200;

/// How many ms of database time one unit of [`StoreOp::Tick`] is.
pub const TICK_UNIT_MS: u64 = 10;

/// The lease a claim asks for, in ms.
pub const LEASE_MS: u64 = 60_000;

/// A heartbeat renews claims no older than this, in ms (the harness holds no claims: every
/// claim starts its tasks at once).
pub const MAX_RENEW_AGE_MS: u64 = 180_000;

/// The reaper requeues a claim without a heartbeat for longer than this, in ms.
pub const CLAIMED_STALE_MS: u64 = 120_000;

/// The reaper takes a run without a heartbeat for longer than this, in ms; with the default
/// retry policy (no retries) it fails the task with `WORKER_CRASHED`.
pub const RUNNING_STALE_MS: u64 = 300_000;

/// The delay of the retry that [`StoreOp::Finish`] asks for with an outcome of 2 (mod 3), in ms.
pub const RETRY_DELAY_MS: u64 = 1_000;

/// The entropy every reaper pass passes (it only spreads retry delays, and nothing retries).
const REAP_ENTROPY: u64 = 7;

/// One operation on the store. Every field is reduced modulo what it selects from, so any
/// value is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum StoreOp {
    /// Enqueue a task, due after a delay.
    Enqueue {
        /// The queue: [`QUEUES`]`[queue % 3]`.
        queue: u8,
        /// The task's priority (lower runs first).
        priority: i8,
        /// The delay before it is due, in ms.
        delay_ms: u16,
    },
    /// One claim pass by a worker, which starts every task it claims (hard-cap mode).
    Claim {
        /// The worker: `worker % WORKERS`.
        worker: u8,
    },
    /// The worker holding a task writes its outcome.
    Finish {
        /// The task: the `pick % n`-th of the `n` held tasks in id order (nothing when none is).
        pick: u8,
        /// `outcome % 3`: 0 completed, 1 failed, 2 retry after [`RETRY_DELAY_MS`].
        outcome: u8,
    },
    /// The worker holding a task hands it back.
    Release {
        /// The task, as for [`StoreOp::Finish`].
        pick: u8,
    },
    /// A worker heartbeats every task it holds.
    Heartbeat {
        /// The worker: `worker % WORKERS`.
        worker: u8,
    },
    /// Database time passes: `ms` × [`TICK_UNIT_MS`] ms.
    Tick {
        /// Time units.
        ms: u16,
    },
    /// One reaper pass (claims stale after [`CLAIMED_STALE_MS`], runs after
    /// [`RUNNING_STALE_MS`]).
    Reap,
}

/// The configuration of one run, as small integers reduced like [`StoreOp`]'s fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Setup {
    /// Each worker's concurrency: see [`Setup::worker_concurrency`].
    pub concurrency: [u8; WORKERS],
    /// Every worker's batch limit per queue: see [`Setup::claim_batch`].
    pub max_claim_batch: u8,
    /// The cluster-wide cap: see [`Setup::cluster_wide_cap`].
    pub cluster_cap: Option<u8>,
}

impl Setup {
    /// The concurrency of worker `worker % WORKERS`: 1 to 6.
    pub fn worker_concurrency(&self, worker: usize) -> u32 {
        u32::from(self.concurrency[worker % WORKERS] % 6) + 1
    }

    /// The most tasks one claim takes from one queue: 0 (no limit) to 3.
    pub fn claim_batch(&self) -> u32 {
        u32::from(self.max_claim_batch % 4)
    }

    /// The cluster-wide cap on tasks in flight: none, or 1 to 8.
    pub fn cluster_wide_cap(&self) -> Option<u32> {
        self.cluster_cap.map(|cap| u32::from(cap % 8) + 1)
    }

    /// The application: [`QUEUES`] in custom mode, hard-cap mode, the cluster-wide cap; stale
    /// runs fail (no crash retries: the reference models caps, not retries).
    pub fn app(&self) -> AppConfig {
        let queues = QUEUES.iter().map(|&(name, priority, cap)| CustomQueue {
            name: name.to_owned(),
            priority,
            max_concurrency: cap,
            serial: false,
        });
        let mut app = AppConfig {
            queue_mode: QueueMode::Custom,
            custom_queues: queues.collect(),
            cluster_wide_cap: self.cluster_wide_cap(),
            ..AppConfig::default()
        };
        app.recovery.crash_retries = 0;
        app
    }

    /// The claim policy of worker `worker % WORKERS` (serving every queue).
    pub fn policy(&self, worker: usize) -> ClaimPolicy {
        let config = WorkerConfig {
            concurrency: self.worker_concurrency(worker),
            max_claim_batch: self.claim_batch(),
            ..WorkerConfig::default()
        };
        ClaimPolicy::from_config(&self.app(), &config)
    }
}

/// A whole run: a setup and the operations (at most [`MAX_OPS`] of them are applied).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Input {
    /// The configuration.
    pub setup: Setup,
    /// The operations, in order.
    pub ops: Vec<StoreOp>,
}

impl Input {
    /// Applies the first [`MAX_OPS`] operations to a fresh [`Harness`], which checks every
    /// invariant after each (and panics on a violation); returns the harness.
    pub fn run(&self) -> Harness {
        let mut harness = Harness::new(self.setup);
        for &op in self.ops.iter().take(MAX_OPS) {
            harness.apply(op);
        }
        harness
    }
}

/// The id of worker `worker`: `w0`, `w1`, …
pub fn worker_id(worker: usize) -> WorkerId {
    WorkerId(format!("w{worker}"))
}

/// A task a worker holds, as the harness remembers it from the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The worker (an index below [`WORKERS`]).
    pub worker: usize,
    /// The lease the claim returned.
    pub lease: Lease,
}

/// What one operation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The task was enqueued under this id.
    Enqueued(TaskId),
    /// The worker claimed (and started) these tasks, in the store's order.
    Claimed {
        /// The worker.
        worker: usize,
        /// The tasks.
        tasks: Vec<TaskId>,
    },
    /// The holder of `task` wrote its outcome.
    Finished {
        /// The task.
        task: TaskId,
        /// Its state afterwards, or `None` if the store refused the write.
        state: Option<TaskState>,
    },
    /// The holder of `task` handed it back.
    Released {
        /// The task.
        task: TaskId,
        /// Whether the store took it back.
        released: bool,
    },
    /// The worker heartbeat its tasks.
    Heartbeat {
        /// The worker.
        worker: usize,
        /// The tasks the store said it no longer holds.
        lost: Vec<TaskId>,
    },
    /// The clock moved on to this time.
    Ticked(DbTime),
    /// The reaper's report.
    Reaped(ReapReport),
    /// A finish or release with no task held: nothing happened.
    Skipped,
}

/// Applies [`StoreOp`]s to a [`MemoryStore`] and checks the invariants after each (see the
/// module docs).
#[derive(Debug)]
pub struct Harness {
    setup: Setup,
    store: MemoryStore,
    policies: Vec<Arc<ClaimPolicy>>,
    checker: Checker,
    now: DbTime,
    held: BTreeMap<TaskId, Held>,
}

impl Harness {
    /// A harness with an empty store configured by `setup`, its clock at [`DB_EPOCH_MS`].
    pub fn new(setup: Setup) -> Harness {
        let app = setup.app();
        Harness {
            setup,
            checker: Checker::new(&app),
            store: MemoryStore::new(app),
            policies: (0..WORKERS).map(|w| Arc::new(setup.policy(w))).collect(),
            now: DbTime(DB_EPOCH_MS),
            held: BTreeMap::new(),
        }
    }

    /// The setup.
    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// The store.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    /// The database clock.
    pub fn now(&self) -> DbTime {
        self.now
    }

    /// The tasks the workers hold, by id.
    pub fn held(&self) -> &BTreeMap<TaskId, Held> {
        &self.held
    }

    /// Applies `op` and checks every invariant.
    ///
    /// # Panics
    ///
    /// When an invariant is violated (never because of `op`'s values).
    pub fn apply(&mut self, op: StoreOp) -> Applied {
        let applied = match op {
            StoreOp::Enqueue { queue, priority, delay_ms } => {
                let (name, _, _) = QUEUES[usize::from(queue) % QUEUES.len()];
                let task = NewTask::new("job", json!({}))
                    .queue(name)
                    .priority(i16::from(priority))
                    .run_at(RunAt::DelayMs(u64::from(delay_ms)));
                let id = match self.store.enqueue(task, self.now) {
                    Ok(id) => id,
                    Err(err) => panic!("{op:?}: the store refused a valid task: {err}"),
                };
                ensure(op, self.checker.enqueued(id));
                Applied::Enqueued(id)
            }
            StoreOp::Claim { worker } => {
                let worker = usize::from(worker) % WORKERS;
                let my_running = self.held.values().filter(|h| h.worker == worker).count() as u32;
                let request = DbRequest::Claim {
                    worker: worker_id(worker),
                    token: 1,
                    policy: self.policies[worker].clone(),
                    my_running,
                    my_claimed: 0,
                    // Hard-cap mode starts every claimed task at once.
                    start_now: u32::MAX,
                    lease_ms: LEASE_MS,
                };
                let DbReply::Claimed { tasks, .. } = self.request(op, worker, &request) else {
                    unreachable!("the checker accepts only a Claimed reply to a claim")
                };
                for task in &tasks {
                    let held = Held { worker, lease: task.lease };
                    if let Some(before) = self.held.insert(task.id, held) {
                        panic!("{op:?}: task {} handed out to {held:?} while {before:?} holds it", task.id);
                    }
                }
                Applied::Claimed { worker, tasks: tasks.iter().map(|t| t.id).collect() }
            }
            StoreOp::Finish { .. } | StoreOp::Release { .. } if self.held.is_empty() => Applied::Skipped,
            StoreOp::Finish { pick, outcome } => {
                let (task, held) = self.pick(pick);
                let error = TaskError::new(ErrorCode::TaskError, "no");
                let outcome = match outcome % 3 {
                    0 => FinishOutcome::Completed(serde_json::Value::Null),
                    1 => FinishOutcome::Failed(error),
                    _ => FinishOutcome::Retry { error, delay_ms: RETRY_DELAY_MS },
                };
                let completions = vec![Completion { task: TaskLease { task, lease: held.lease }, outcome, args: None }];
                let request = DbRequest::Finish { worker: worker_id(held.worker), completions };
                let DbReply::Finished { applied, .. } = self.request(op, held.worker, &request) else {
                    unreachable!("the checker accepts only a Finished reply to a finish")
                };
                self.held.remove(&task);
                Applied::Finished { task, state: applied.iter().find(|(id, _)| *id == task).map(|(_, state)| *state) }
            }
            StoreOp::Release { pick } => {
                let (task, held) = self.pick(pick);
                let tasks = vec![TaskLease { task, lease: held.lease }];
                let request = DbRequest::Release { worker: worker_id(held.worker), tasks };
                let DbReply::Released { released, .. } = self.request(op, held.worker, &request) else {
                    unreachable!("the checker accepts only a Released reply to a release")
                };
                self.held.remove(&task);
                Applied::Released { task, released: released.contains(&task) }
            }
            StoreOp::Heartbeat { worker } => {
                let worker = usize::from(worker) % WORKERS;
                let running: Vec<TaskLease> = self
                    .held
                    .iter()
                    .filter(|(_, h)| h.worker == worker)
                    .map(|(&task, h)| TaskLease { task, lease: h.lease })
                    .collect();
                let request = DbRequest::Heartbeat {
                    worker: worker_id(worker),
                    claimed: Vec::new(),
                    running,
                    lease_ms: LEASE_MS,
                    max_renew_age_ms: MAX_RENEW_AGE_MS,
                    abandoned: Vec::new(),
                };
                let DbReply::Heartbeat { lost, .. } = self.request(op, worker, &request) else {
                    unreachable!("the checker accepts only a Heartbeat reply to a heartbeat")
                };
                for task in &lost {
                    self.held.remove(task);
                }
                Applied::Heartbeat { worker, lost }
            }
            StoreOp::Tick { ms } => {
                self.now = self.now.plus_ms(u64::from(ms) * TICK_UNIT_MS);
                Applied::Ticked(self.now)
            }
            StoreOp::Reap => {
                let request = DbRequest::Reap {
                    worker: worker_id(0),
                    claimed_stale_ms: Some(CLAIMED_STALE_MS),
                    running_stale_ms: Some(RUNNING_STALE_MS),
                    entropy: REAP_ENTROPY,
                };
                let DbReply::Reaped(report) = self.request(op, 0, &request) else {
                    unreachable!("the checker accepts only a Reaped reply to a reap")
                };
                for task in report.requeued.iter().chain(&report.retried).chain(&report.failed) {
                    self.held.remove(task);
                }
                Applied::Reaped(report)
            }
        };
        // Nobody listens: drop what the store would announce.
        self.store.take_notifications();
        self.check(op);
        applied
    }

    /// The `pick % n`-th of the `n` held tasks (the caller made sure there is one).
    fn pick(&self, pick: u8) -> (TaskId, Held) {
        let index = usize::from(pick) % self.held.len().max(1);
        let (&task, &held) = self.held.iter().nth(index).unwrap_or_else(|| unreachable!("a task is held"));
        (task, held)
    }

    /// Applies `request` by `worker` to the store, with the per-request checks.
    fn request(&mut self, op: StoreOp, worker: usize, request: &DbRequest) -> DbReply {
        let before = self.checker.before(&self.store, request, self.now);
        let reply = self.store.apply(request, self.now);
        ensure(op, self.checker.after(&self.store, &worker_id(worker), request, &before, &reply, self.now));
        reply
    }

    /// The invariants after `op` (see the module docs).
    fn check(&mut self, op: StoreOp) {
        ensure(op, self.checker.check_store(&self.store, self.now, true));
        let mut running = [0u32; WORKERS];
        for row in self.store.tasks().filter(|row| row.state == TaskState::Running) {
            let Some(held) = self.held.get(&row.id) else {
                panic!("{op:?}: task {} is Running for {:?} but no worker holds it", row.id, row.claimed_by);
            };
            assert!(
                row.claimed_by == Some(worker_id(held.worker)) && row.lease == held.lease,
                "{op:?}: task {} is Running for {:?} under lease {}, but {held:?} holds it",
                row.id,
                row.claimed_by,
                row.lease
            );
            running[held.worker] += 1;
        }
        for (&task, held) in &self.held {
            let state = self.store.task(task).map(|row| row.state);
            assert_eq!(state, Some(TaskState::Running), "{op:?}: task {task} is held by {held:?}");
        }
        for (worker, &n) in running.iter().enumerate() {
            let concurrency = self.setup.worker_concurrency(worker);
            assert!(n <= concurrency, "{op:?}: CAP: worker {worker} runs {n} tasks, concurrency {concurrency}");
        }
    }
}

/// Panics with `op` and the message of a failed check.
fn ensure(op: StoreOp, check: Result<(), String>) {
    if let Err(message) = check {
        panic!("{op:?}: {message}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_value_is_a_valid_operation() {
        let ops = vec![
            StoreOp::Finish { pick: 255, outcome: 255 },
            StoreOp::Release { pick: 9 },
            StoreOp::Enqueue { queue: 255, priority: i8::MIN, delay_ms: 0 },
            StoreOp::Enqueue { queue: 7, priority: i8::MAX, delay_ms: u16::MAX },
            StoreOp::Enqueue { queue: 1, priority: 0, delay_ms: 0 },
            StoreOp::Claim { worker: 255 },
            StoreOp::Heartbeat { worker: 200 },
            StoreOp::Finish { pick: 200, outcome: 2 },
            StoreOp::Tick { ms: u16::MAX },
            StoreOp::Claim { worker: 3 },
            StoreOp::Tick { ms: u16::MAX },
            StoreOp::Reap,
        ];
        let setup = Setup { concurrency: [255; WORKERS], max_claim_batch: 255, cluster_cap: Some(255) };
        let harness = Input { setup, ops }.run();
        assert_eq!(harness.store().tasks().count(), 3);
        assert!(harness.held().is_empty(), "the reaper took the run nobody heartbeat: {:?}", harness.held());
    }

    #[test]
    fn a_claim_respects_the_queue_caps() {
        let mut harness = Harness::new(Setup { concurrency: [5; WORKERS], ..Setup::default() });
        for _ in 0..4 {
            harness.apply(StoreOp::Enqueue { queue: 0, priority: 0, delay_ms: 0 });
        }
        let Applied::Claimed { tasks, .. } = harness.apply(StoreOp::Claim { worker: 0 }) else { panic!("a claim") };
        // Concurrency 6, but the queue `high` allows 3.
        assert_eq!(tasks, [TaskId(1), TaskId(2), TaskId(3)]);
        let applied = harness.apply(StoreOp::Finish { pick: 1, outcome: 0 });
        assert_eq!(applied, Applied::Finished { task: TaskId(2), state: Some(TaskState::Completed) });
    }
}
