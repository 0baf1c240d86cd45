//! Operation sequences against the memory store, in the vocabulary of the claim/cap model
//! (`tests/model_claim_cap.rs`: enqueue, claim, finish, release) plus the passing of time,
//! heartbeats and the reaper. After every operation: no cap exceeded in hard-cap mode, no task
//! held by two workers, every enqueued task present exactly once, attempts never decreasing.
#![no_main]

use std::collections::BTreeMap;
use std::sync::Arc;

use arbitrary::Arbitrary;
use canter::budget::{ClaimPolicy, QueuePolicy};
use canter::config::{AppConfig, CustomQueue, QueueMode};
use canter::db::{Completion, DbReply, DbRequest, DbTime, FinishOutcome, NewTask, RunAt};
use canter::memory::MemoryStore;
use canter::task::{ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
use libfuzzer_sys::fuzz_target;

const QUEUES: [(&str, u8, Option<u32>); 3] = [("a", 1, Some(3)), ("b", 2, None), ("c", 3, Some(1))];

#[derive(Debug, Arbitrary)]
enum Op {
    Enqueue { queue: u8, priority: i8, delay_ms: u16 },
    Claim { worker: u8 },
    Finish { pick: u8, outcome: u8 },
    Release { pick: u8 },
    Heartbeat { worker: u8 },
    Tick { ms: u16 },
    Reap,
}

#[derive(Debug, Arbitrary)]
struct Input {
    concurrency: [u8; 3],
    max_claim_batch: u8,
    cluster_cap: Option<u8>,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let cluster_cap = input.cluster_cap.map(|c| u32::from(c % 8) + 1);
    let app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: QUEUES.iter().map(|(n, p, c)| CustomQueue { name: n.to_string(), priority: *p, max_concurrency: *c }).collect(),
        cluster_wide_cap: cluster_cap,
        ..AppConfig::default()
    };
    let mut store = MemoryStore::new(app);
    let policies: Vec<Arc<ClaimPolicy>> = input
        .concurrency
        .iter()
        .map(|c| {
            Arc::new(ClaimPolicy {
                concurrency: u32::from(c % 6) + 1,
                prefetch_buffer: 0,
                max_claim_batch: u32::from(input.max_claim_batch % 4),
                max_claim_per_worker: 0,
                cluster_wide_cap: cluster_cap,
                queues: QUEUES.iter().map(|(n, p, c)| QueuePolicy { name: n.to_string(), priority: *p, max_concurrency: *c }).collect(),
            })
        })
        .collect();
    let worker = |w: usize| WorkerId(format!("w{w}"));
    let mut now = DbTime(1_700_000_000_000);
    let mut held: BTreeMap<TaskId, (usize, Lease)> = BTreeMap::new();
    let mut enqueued = 0u64;
    let mut attempts: BTreeMap<TaskId, u32> = BTreeMap::new();
    for op in input.ops.iter().take(200) {
        match *op {
            Op::Enqueue { queue, priority, delay_ms } => {
                let (name, _, _) = QUEUES[usize::from(queue) % QUEUES.len()];
                let task = NewTask::new("job", serde_json::json!({})).queue(name).priority(i16::from(priority)).run_at(RunAt::DelayMs(u64::from(delay_ms)));
                store.enqueue(task, now).expect("a valid task is accepted");
                enqueued += 1;
            }
            Op::Claim { worker: w } => {
                let w = usize::from(w) % policies.len();
                let running = held.values().filter(|(h, _)| *h == w).count() as u32;
                let request = DbRequest::Claim {
                    worker: worker(w),
                    token: 1,
                    policy: policies[w].clone(),
                    my_running: running,
                    my_claimed: 0,
                    // Hard-cap mode starts every claimed task at once.
                    start_now: u32::MAX,
                    lease_ms: 60_000,
                };
                let DbReply::Claimed { tasks, .. } = store.apply(&request, now) else { panic!("claim reply") };
                for task in tasks {
                    assert!(held.insert(task.id, (w, task.lease)).is_none_or(|(_, old)| old < task.lease), "a task handed out twice");
                }
            }
            Op::Finish { .. } | Op::Release { .. } if held.is_empty() => {}
            Op::Finish { pick, outcome } => {
                let (&task, &(w, lease)) = held.iter().nth(usize::from(pick) % held.len()).expect("non-empty");
                let error = TaskError::new(ErrorCode::TaskError, "no");
                let outcome = match outcome % 3 {
                    0 => FinishOutcome::Completed(serde_json::Value::Null),
                    1 => FinishOutcome::Failed(error),
                    _ => FinishOutcome::Retry { error, delay_ms: 1_000 },
                };
                let completion = Completion { task: TaskLease { task, lease }, outcome };
                store.apply(&DbRequest::Finish { worker: worker(w), completions: vec![completion] }, now);
                held.remove(&task);
            }
            Op::Release { pick } => {
                let (&task, &(w, lease)) = held.iter().nth(usize::from(pick) % held.len()).expect("non-empty");
                store.apply(&DbRequest::Release { worker: worker(w), tasks: vec![TaskLease { task, lease }] }, now);
                held.remove(&task);
            }
            Op::Heartbeat { worker: w } => {
                let w = usize::from(w) % policies.len();
                let running: Vec<TaskLease> = held.iter().filter(|(_, (h, _))| *h == w).map(|(t, (_, l))| TaskLease { task: *t, lease: *l }).collect();
                let request = DbRequest::Heartbeat { worker: worker(w), claimed: vec![], running, lease_ms: 60_000, max_renew_age_ms: 180_000 };
                let DbReply::Heartbeat { lost } = store.apply(&request, now) else { panic!("heartbeat reply") };
                for task in lost {
                    held.remove(&task);
                }
            }
            Op::Tick { ms } => now = now.plus_ms(u64::from(ms) * 10),
            Op::Reap => {
                let request = DbRequest::Reap { worker: worker(0), claimed_stale_ms: Some(120_000), running_stale_ms: Some(300_000), entropy: 7 };
                let DbReply::Reaped(report) = store.apply(&request, now) else { panic!("reap reply") };
                for task in report.retried.iter().chain(&report.failed) {
                    held.remove(task);
                }
            }
        }
        // Invariants.
        let tasks: Vec<_> = store.tasks().collect();
        assert_eq!(tasks.len() as u64, enqueued, "every enqueued task exists exactly once");
        let running: Vec<_> = tasks.iter().filter(|t| t.state == TaskState::Running).collect();
        if let Some(cap) = cluster_cap {
            assert!(running.len() as u32 <= cap, "cluster cap exceeded");
        }
        for (name, _, cap) in QUEUES {
            let n = running.iter().filter(|t| t.queue == name).count() as u32;
            assert!(cap.is_none_or(|cap| n <= cap), "queue {name} over its cap");
        }
        for (w, policy) in policies.iter().enumerate() {
            let n = running.iter().filter(|t| t.claimed_by == Some(worker(w))).count() as u32;
            assert!(n <= policy.concurrency, "worker {w} over its concurrency");
        }
        for task in &tasks {
            let seen = attempts.entry(task.id).or_insert(task.attempts);
            assert!(task.attempts >= *seen, "attempts went down");
            *seen = task.attempts;
            if task.state == TaskState::Running {
                let holder = held.get(&task.id).expect("a running task is held by the worker the store names");
                assert_eq!(Some(worker(holder.0)), task.claimed_by);
                assert_eq!(holder.1, task.lease);
            }
        }
    }
});
