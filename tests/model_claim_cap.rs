//! A proptest-state-machine model of claiming under caps: the memory store (which follows
//! `budget::plan`) against a reference written the simple way — pick the best eligible task
//! one at a time while every cap still allows one more.
//!
//! The transitions are [`StoreOp`]s, the vocabulary the `store_ops` fuzz target uses too, and
//! the system under test is the shared [`Harness`], which applies them to the store and checks
//! its invariants after each; this test adds the comparison of every outcome with the
//! reference.

use std::collections::BTreeMap;

use canter::sim::store_ops::{
    Applied, Harness, QUEUES, RETRY_DELAY_MS, RUNNING_STALE_MS, Setup, StoreOp, TICK_UNIT_MS, WORKERS, worker_id,
};
use canter::task::{TaskId, TaskState};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

#[derive(Debug, Clone)]
struct RefTask {
    queue: usize,
    priority: i16,
    /// Due at this many ms after the start.
    run_at: u64,
    state: TaskState,
    worker: Option<usize>,
    /// The last heartbeat (or the claim) of its current run, in ms after the start.
    beat: u64,
}

/// What an operation should have done, in the terms both sides can state.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Enqueued(i64),
    /// Ids in claim order.
    Claimed(Vec<i64>),
    Finished(i64, TaskState),
    Released(i64),
    /// A heartbeat that lost nothing, or the passing of time.
    Nothing,
    /// Runs the reaper failed (no retry policy).
    Reaped(Vec<i64>),
    /// A finish or release with nothing running.
    Skipped,
}

#[derive(Debug, Clone)]
struct Reference {
    setup: Setup,
    /// Ms since the start.
    now: u64,
    tasks: BTreeMap<i64, RefTask>,
    /// What the last transition should have done.
    expected: Outcome,
}

impl Reference {
    fn running(&self) -> impl Iterator<Item = (&i64, &RefTask)> {
        self.tasks.iter().filter(|(_, t)| t.state == TaskState::Running)
    }

    /// The `pick % n`-th of the `n` running tasks, in id order.
    fn pick(&self, pick: u8) -> Option<i64> {
        let running: Vec<i64> = self.running().map(|(id, _)| *id).collect();
        (!running.is_empty()).then(|| running[usize::from(pick) % running.len()])
    }

    /// The reference claim: greedily the best eligible task while all caps allow one more.
    fn claim(&mut self, worker: usize) -> Vec<i64> {
        let mut taken = Vec::new();
        let mut per_queue_taken = [0u32; QUEUES.len()];
        let batch = self.setup.claim_batch();
        loop {
            let worker_running = self.running().filter(|(_, t)| t.worker == Some(worker)).count() as u32;
            let cluster = self.running().count() as u32;
            if worker_running >= self.setup.worker_concurrency(worker) {
                break;
            }
            if self.setup.cluster_wide_cap().is_some_and(|cap| cluster >= cap) {
                break;
            }
            let fits = |t: &RefTask| {
                let (_, _, cap) = QUEUES[t.queue];
                let in_queue = self.running().filter(|(_, r)| r.queue == t.queue).count() as u32;
                let batch_ok = batch == 0 || per_queue_taken[t.queue] < batch;
                let due = t.run_at <= self.now;
                t.state == TaskState::Pending && due && cap.is_none_or(|cap| in_queue < cap) && batch_ok
            };
            // Queues are claimed in priority order; a queue is passed over once it was left.
            let best = self
                .tasks
                .iter()
                .filter(|(_, t)| fits(t))
                .filter(|(_, t)| taken.last().is_none_or(|last: &i64| self.tasks[last].queue <= t.queue))
                .min_by_key(|(id, t)| (QUEUES[t.queue].1, t.priority, t.run_at, **id))
                .map(|(id, _)| *id);
            let Some(id) = best else { break };
            let now = self.now;
            let task = self.tasks.get_mut(&id).unwrap();
            task.state = TaskState::Running;
            task.worker = Some(worker);
            task.beat = now;
            per_queue_taken[task.queue] += 1;
            taken.push(id);
        }
        taken
    }
}

impl ReferenceStateMachine for Reference {
    type State = Reference;
    type Transition = StoreOp;

    fn init_state() -> BoxedStrategy<Self::State> {
        (any::<[u8; WORKERS]>(), any::<u8>(), any::<Option<u8>>())
            .prop_map(|(concurrency, max_claim_batch, cluster_cap)| Reference {
                setup: Setup { concurrency, max_claim_batch, cluster_cap },
                now: 0,
                tasks: BTreeMap::new(),
                expected: Outcome::Nothing,
            })
            .boxed()
    }

    fn transitions(state: &Self::State) -> BoxedStrategy<Self::Transition> {
        let delay = prop_oneof![3 => Just(0u16), 1 => 0u16..2_000];
        let enqueue = (0u8..3, 0i8..3, delay).prop_map(|(queue, priority, delay_ms)| StoreOp::Enqueue {
            queue,
            priority,
            delay_ms,
        });
        let claim = any::<u8>().prop_map(|worker| StoreOp::Claim { worker });
        // Mostly short steps (a retry's delay is 100 units), sometimes past the reaper's threshold.
        let tick = prop_oneof![4 => 0u16..200, 1 => any::<u16>()].prop_map(|ms| StoreOp::Tick { ms });
        let reap = Just(StoreOp::Reap);
        if state.running().next().is_none() {
            return prop_oneof![3 => enqueue, 2 => claim, 1 => tick, 1 => reap].boxed();
        }
        let finish = (any::<u8>(), any::<u8>()).prop_map(|(pick, outcome)| StoreOp::Finish { pick, outcome });
        let release = any::<u8>().prop_map(|pick| StoreOp::Release { pick });
        let heartbeat = any::<u8>().prop_map(|worker| StoreOp::Heartbeat { worker });
        prop_oneof![3 => enqueue, 3 => claim, 3 => finish, 1 => release, 1 => heartbeat, 1 => tick, 1 => reap].boxed()
    }

    fn preconditions(_: &Self::State, _: &Self::Transition) -> bool {
        // Every operation is valid in every state (a finish with nothing running does nothing).
        true
    }

    fn apply(mut state: Self::State, transition: &Self::Transition) -> Self::State {
        state.expected = match *transition {
            StoreOp::Enqueue { queue, priority, delay_ms } => {
                let id = state.tasks.len() as i64 + 1;
                let task = RefTask {
                    queue: usize::from(queue) % QUEUES.len(),
                    priority: i16::from(priority),
                    run_at: state.now + u64::from(delay_ms),
                    state: TaskState::Pending,
                    worker: None,
                    beat: 0,
                };
                state.tasks.insert(id, task);
                Outcome::Enqueued(id)
            }
            StoreOp::Claim { worker } => Outcome::Claimed(state.claim(usize::from(worker) % WORKERS)),
            StoreOp::Finish { pick, outcome } => match state.pick(pick) {
                None => Outcome::Skipped,
                Some(id) => {
                    let now = state.now;
                    let task = state.tasks.get_mut(&id).unwrap();
                    task.worker = None;
                    task.state = match outcome % 3 {
                        0 => TaskState::Completed,
                        1 => TaskState::Failed,
                        _ => {
                            task.run_at = now + RETRY_DELAY_MS;
                            TaskState::Pending
                        }
                    };
                    Outcome::Finished(id, task.state)
                }
            },
            StoreOp::Release { pick } => match state.pick(pick) {
                None => Outcome::Skipped,
                Some(id) => {
                    let task = state.tasks.get_mut(&id).unwrap();
                    task.state = TaskState::Pending;
                    task.worker = None;
                    Outcome::Released(id)
                }
            },
            StoreOp::Heartbeat { worker } => {
                let (worker, now) = (usize::from(worker) % WORKERS, state.now);
                for task in state.tasks.values_mut().filter(|t| t.state == TaskState::Running) {
                    if task.worker == Some(worker) {
                        task.beat = now;
                    }
                }
                Outcome::Nothing
            }
            StoreOp::Tick { ms } => {
                state.now += u64::from(ms) * TICK_UNIT_MS;
                Outcome::Nothing
            }
            StoreOp::Reap => {
                let now = state.now;
                let mut failed = Vec::new();
                for (id, task) in state.tasks.iter_mut().filter(|(_, t)| t.state == TaskState::Running) {
                    if task.beat + RUNNING_STALE_MS < now {
                        task.state = TaskState::Failed;
                        task.worker = None;
                        failed.push(*id);
                    }
                }
                Outcome::Reaped(failed)
            }
        };
        state
    }
}

/// The harness's answer in the reference's terms.
fn outcome(applied: Applied) -> Outcome {
    let ids = |tasks: Vec<TaskId>| tasks.into_iter().map(|t| t.0).collect::<Vec<_>>();
    match applied {
        Applied::Enqueued(id) => Outcome::Enqueued(id.0),
        Applied::Claimed { tasks, .. } => Outcome::Claimed(ids(tasks)),
        Applied::Finished { task, state: Some(state) } => Outcome::Finished(task.0, state),
        Applied::Released { task, released: true } => Outcome::Released(task.0),
        Applied::Heartbeat { lost, .. } if lost.is_empty() => Outcome::Nothing,
        Applied::Ticked(_) => Outcome::Nothing,
        Applied::Reaped(report)
            if report.requeued.is_empty() && report.retried.is_empty() && report.expired.is_empty() =>
        {
            Outcome::Reaped(ids(report.failed))
        }
        Applied::Skipped => Outcome::Skipped,
        other => panic!("the store did something the reference never does: {other:?}"),
    }
}

struct System;

impl StateMachineTest for System {
    type SystemUnderTest = Harness;
    type Reference = Reference;

    fn init_test(reference: &Reference) -> Harness {
        Harness::new(reference.setup)
    }

    fn apply(mut sut: Harness, reference: &Reference, transition: StoreOp) -> Harness {
        let applied = sut.apply(transition);
        assert_eq!(outcome(applied), reference.expected, "the store and the reference differ on {transition:?}");
        sut
    }

    fn check_invariants(sut: &Harness, reference: &Reference) {
        // The harness checked the store's own invariants (caps, holders, attempts) already.
        assert_eq!(sut.store().tasks().count(), reference.tasks.len(), "every enqueued task exists once");
        for (id, task) in &reference.tasks {
            let record = sut.store().get(TaskId(*id)).expect("every enqueued task exists");
            assert_eq!(record.state, task.state, "task {id}");
            assert_eq!(record.worker, task.worker.map(worker_id), "the holder of task {id}");
            if task.state == TaskState::Pending {
                assert_eq!(record.run_at.0 - sut.now().0, task.run_at as i64 - reference.now as i64, "task {id} due");
            }
        }
        let held: Vec<i64> = sut.held().keys().map(|t| t.0).collect();
        let running: Vec<i64> = reference.running().map(|(id, _)| *id).collect();
        assert_eq!(held, running, "the tasks held");
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn claims_follow_the_reference_under_every_cap(sequential 1..60 => System);
}
