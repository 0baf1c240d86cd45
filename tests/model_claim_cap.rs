//! A proptest-state-machine model of claiming under caps: the memory store (which follows
//! `budget::plan`) against a reference written the simple way — pick the best eligible task
//! one at a time while every cap still allows one more.

use std::collections::BTreeMap;
use std::sync::Arc;

use canter::budget::{ClaimPolicy, QueuePolicy};
use canter::config::{AppConfig, CustomQueue, QueueMode};
use canter::db::{Completion, DbReply, DbRequest, DbTime, FinishOutcome, NewTask};
use canter::memory::MemoryStore;
use canter::task::{Lease, TaskId, TaskLease, TaskState, WorkerId};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use serde_json::json;

const QUEUES: [(&str, u8, Option<u32>); 3] = [("high", 1, Some(3)), ("mid", 2, None), ("low", 3, Some(2))];
const WORKERS: usize = 3;
const NOW: DbTime = DbTime(1_700_000_000_000);

#[derive(Debug, Clone)]
struct Setup {
    concurrency: [u32; WORKERS],
    max_claim_batch: u32,
    cluster_wide_cap: Option<u32>,
}

#[derive(Debug, Clone)]
enum Transition {
    Enqueue { queue: usize, priority: i16 },
    Claim { worker: usize },
    Finish { pick: Index, success: bool },
    Release { pick: Index },
}

#[derive(Debug, Clone)]
struct RefTask {
    queue: usize,
    priority: i16,
    state: TaskState,
    worker: Option<usize>,
}

#[derive(Debug, Clone)]
struct Reference {
    setup: Setup,
    tasks: BTreeMap<i64, RefTask>,
    /// What the last claim of each transition should return (ids in claim order).
    expected_claim: Vec<i64>,
}

impl Reference {
    fn running(&self) -> impl Iterator<Item = (&i64, &RefTask)> {
        self.tasks.iter().filter(|(_, t)| t.state == TaskState::Running)
    }

    /// The reference claim: greedily the best eligible task while all caps allow one more.
    fn claim(&mut self, worker: usize) -> Vec<i64> {
        let mut taken = Vec::new();
        let mut per_queue_taken = [0u32; QUEUES.len()];
        loop {
            let worker_running = self.running().filter(|(_, t)| t.worker == Some(worker)).count() as u32;
            let cluster = self.running().count() as u32;
            if worker_running >= self.setup.concurrency[worker] {
                break;
            }
            if self.setup.cluster_wide_cap.is_some_and(|cap| cluster >= cap) {
                break;
            }
            let fits = |t: &RefTask| {
                let (_, _, cap) = QUEUES[t.queue];
                let in_queue = self.running().filter(|(_, r)| r.queue == t.queue).count() as u32;
                let batch_ok = self.setup.max_claim_batch == 0 || per_queue_taken[t.queue] < self.setup.max_claim_batch;
                t.state == TaskState::Pending && cap.is_none_or(|cap| in_queue < cap) && batch_ok
            };
            // Queues are claimed in priority order; a queue is passed over once it was left.
            let best = self
                .tasks
                .iter()
                .filter(|(_, t)| fits(t))
                .filter(|(_, t)| taken.last().is_none_or(|last: &i64| self.tasks[last].queue <= t.queue))
                .min_by_key(|(id, t)| (QUEUES[t.queue].1, t.priority, **id))
                .map(|(id, _)| *id);
            let Some(id) = best else { break };
            let task = self.tasks.get_mut(&id).unwrap();
            task.state = TaskState::Running;
            task.worker = Some(worker);
            per_queue_taken[task.queue] += 1;
            taken.push(id);
        }
        taken
    }
}

impl ReferenceStateMachine for Reference {
    type State = Reference;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Self::State> {
        (prop::array::uniform3(1u32..5), 0u32..4, prop::option::of(1u32..8))
            .prop_map(|(concurrency, max_claim_batch, cluster_wide_cap)| Reference {
                setup: Setup { concurrency, max_claim_batch, cluster_wide_cap },
                tasks: BTreeMap::new(),
                expected_claim: Vec::new(),
            })
            .boxed()
    }

    fn transitions(state: &Self::State) -> BoxedStrategy<Self::Transition> {
        let enqueue = (0..QUEUES.len(), 0i16..3).prop_map(|(queue, priority)| Transition::Enqueue { queue, priority });
        let claim = (0..WORKERS).prop_map(|worker| Transition::Claim { worker });
        if state.running().next().is_none() {
            return prop_oneof![3 => enqueue, 2 => claim].boxed();
        }
        let finish = (any::<Index>(), any::<bool>()).prop_map(|(pick, success)| Transition::Finish { pick, success });
        let release = any::<Index>().prop_map(|pick| Transition::Release { pick });
        prop_oneof![3 => enqueue, 3 => claim, 3 => finish, 1 => release].boxed()
    }

    fn preconditions(state: &Self::State, transition: &Self::Transition) -> bool {
        match transition {
            Transition::Finish { .. } | Transition::Release { .. } => state.running().next().is_some(),
            _ => true,
        }
    }

    fn apply(mut state: Self::State, transition: &Self::Transition) -> Self::State {
        state.expected_claim.clear();
        match transition {
            Transition::Enqueue { queue, priority } => {
                let id = state.tasks.len() as i64 + 1;
                state.tasks.insert(
                    id,
                    RefTask { queue: *queue, priority: *priority, state: TaskState::Pending, worker: None },
                );
            }
            Transition::Claim { worker } => state.expected_claim = state.claim(*worker),
            Transition::Finish { pick, success } => {
                let id = *pick.get(&state.running().map(|(id, _)| *id).collect::<Vec<_>>());
                let task = state.tasks.get_mut(&id).unwrap();
                task.state = if *success { TaskState::Completed } else { TaskState::Failed };
                task.worker = None;
            }
            Transition::Release { pick } => {
                let id = *pick.get(&state.running().map(|(id, _)| *id).collect::<Vec<_>>());
                let task = state.tasks.get_mut(&id).unwrap();
                task.state = TaskState::Pending;
                task.worker = None;
            }
        }
        state
    }
}

struct System {
    store: MemoryStore,
    policies: Vec<Arc<ClaimPolicy>>,
    leases: BTreeMap<i64, (usize, Lease)>,
}

fn worker_id(worker: usize) -> WorkerId {
    WorkerId(format!("w{worker}"))
}

impl StateMachineTest for System {
    type SystemUnderTest = System;
    type Reference = Reference;

    fn init_test(reference: &Reference) -> System {
        let app = AppConfig {
            queue_mode: QueueMode::Custom,
            custom_queues: QUEUES
                .iter()
                .map(|(name, priority, cap)| CustomQueue {
                    name: name.to_string(),
                    priority: *priority,
                    max_concurrency: *cap,
                })
                .collect(),
            cluster_wide_cap: reference.setup.cluster_wide_cap,
            ..AppConfig::default()
        };
        let policies = (0..WORKERS)
            .map(|w| {
                Arc::new(ClaimPolicy {
                    concurrency: reference.setup.concurrency[w],
                    prefetch_buffer: 0,
                    max_claim_batch: reference.setup.max_claim_batch,
                    max_claim_per_worker: 0,
                    cluster_wide_cap: reference.setup.cluster_wide_cap,
                    queues: QUEUES
                        .iter()
                        .map(|(name, priority, cap)| QueuePolicy {
                            name: name.to_string(),
                            priority: *priority,
                            max_concurrency: *cap,
                        })
                        .collect(),
                })
            })
            .collect();
        System { store: MemoryStore::new(app), policies, leases: BTreeMap::new() }
    }

    fn apply(mut sut: System, reference: &Reference, transition: Transition) -> System {
        match transition {
            Transition::Enqueue { queue, priority } => {
                let task = NewTask::new("job", json!({})).queue(QUEUES[queue].0).priority(priority);
                sut.store.enqueue(task, NOW).unwrap();
            }
            Transition::Claim { worker } => {
                let my_running = sut.leases.values().filter(|(w, _)| *w == worker).count() as u32;
                let request = DbRequest::Claim {
                    worker: worker_id(worker),
                    token: 1,
                    policy: sut.policies[worker].clone(),
                    my_running,
                    my_claimed: 0,
                    start_now: u32::MAX,
                    lease_ms: 60_000,
                };
                let DbReply::Claimed { tasks, .. } = sut.store.apply(&request, NOW) else { panic!("claim reply") };
                let ids: Vec<i64> = tasks.iter().map(|t| t.id.0).collect();
                assert_eq!(ids, reference.expected_claim, "the store and the reference claimed differently");
                for task in tasks {
                    assert!(task.started);
                    sut.leases.insert(task.id.0, (worker, task.lease));
                }
            }
            Transition::Finish { success, .. } => {
                // The reference already moved the picked task: find the one that left Running.
                let id = changed(&sut, reference, if success { TaskState::Completed } else { TaskState::Failed });
                let (worker, lease) = sut.leases.remove(&id).unwrap();
                let outcome = if success {
                    FinishOutcome::Completed(json!(null))
                } else {
                    FinishOutcome::Failed(canter::task::TaskError::new(canter::task::ErrorCode::TaskError, "no"))
                };
                let completion = Completion { task: TaskLease { task: TaskId(id), lease }, outcome };
                let reply = sut
                    .store
                    .apply(&DbRequest::Finish { worker: worker_id(worker), completions: vec![completion] }, NOW);
                assert!(matches!(reply, DbReply::Finished { ref lost, .. } if lost.is_empty()), "{reply:?}");
            }
            Transition::Release { .. } => {
                let id = changed(&sut, reference, TaskState::Pending);
                let (worker, lease) = sut.leases.remove(&id).unwrap();
                let tasks = vec![TaskLease { task: TaskId(id), lease }];
                let reply = sut.store.apply(&DbRequest::Release { worker: worker_id(worker), tasks }, NOW);
                assert!(matches!(reply, DbReply::Released { ref lost, .. } if lost.is_empty()), "{reply:?}");
            }
        }
        sut
    }

    fn check_invariants(sut: &System, reference: &Reference) {
        for (id, task) in &reference.tasks {
            let record = sut.store.get(TaskId(*id)).expect("every enqueued task exists once");
            if task.state != TaskState::Running || sut.leases.contains_key(id) {
                assert_eq!(record.state, task.state, "task {id}");
            }
        }
        let running: Vec<_> = sut.store.tasks().filter(|t| t.state == TaskState::Running).collect();
        if let Some(cap) = reference.setup.cluster_wide_cap {
            assert!(running.len() as u32 <= cap, "cluster cap exceeded");
        }
        for (q, (name, _, cap)) in QUEUES.iter().enumerate() {
            let n = running.iter().filter(|t| t.queue == *name).count() as u32;
            assert!(cap.is_none_or(|cap| n <= cap), "queue {q} over its cap");
        }
        for w in 0..WORKERS {
            let n = running.iter().filter(|t| t.claimed_by == Some(worker_id(w))).count() as u32;
            assert!(n <= reference.setup.concurrency[w], "worker {w} over its concurrency");
        }
    }
}

/// The task the reference just moved into `state` while the system still holds it.
fn changed(sut: &System, reference: &Reference, state: TaskState) -> i64 {
    *sut.leases.keys().find(|id| reference.tasks[id].state == state).expect("the reference moved one held task")
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn claims_follow_the_reference_under_every_cap(sequential 1..60 => System);
}
