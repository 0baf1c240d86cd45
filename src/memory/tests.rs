use std::sync::Arc;

use serde_json::json;

use super::*;
use crate::budget::*;
use crate::config::*;
use crate::config::{CustomQueue, QueueMode, RecoveryConfig, WorkerConfig};
use crate::store::RunAt;
use crate::store::*;
use crate::task::*;

const T0: DbTime = DbTime(1_000_000);
const LEASE_MS: u64 = 60_000;

fn at(ms: i64) -> DbTime {
    DbTime(T0.0 + ms)
}

fn w(name: &str) -> WorkerId {
    WorkerId(name.to_owned())
}

fn custom(queues: Vec<CustomQueue>) -> AppConfig {
    AppConfig { queue_mode: QueueMode::Custom, custom_queues: queues, ..AppConfig::default() }
}

/// The claim policy of a worker serving every queue of the store's app.
fn policy(store: &MemoryStore, concurrency: u32) -> Arc<ClaimPolicy> {
    let worker = WorkerConfig { concurrency, ..WorkerConfig::default() };
    Arc::new(ClaimPolicy::from_config(store.app(), &worker))
}

fn add(store: &mut MemoryStore, task: NewTask) -> TaskId {
    store.enqueue(task, T0).expect("enqueue")
}

/// A claim by a worker of this concurrency serving every queue.
fn claim_n(
    store: &mut MemoryStore,
    worker: &str,
    token: u64,
    concurrency: u32,
    start_now: u32,
    now: DbTime,
) -> Vec<ClaimedTask> {
    let policy = policy(store, concurrency);
    claim_with(store, worker, token, &policy, start_now, now)
}

/// A claim by a worker holding nothing, under a lease of [`LEASE_MS`].
fn claim_request(worker: &str, token: u64, policy: &Arc<ClaimPolicy>, start_now: u32) -> DbRequest {
    DbRequest::Claim {
        worker: w(worker),
        token,
        policy: Arc::clone(policy),
        my_running: 0,
        my_claimed: 0,
        start_now,
        lease_ms: LEASE_MS,
    }
}

fn claim_with(
    store: &mut MemoryStore,
    worker: &str,
    token: u64,
    policy: &Arc<ClaimPolicy>,
    start_now: u32,
    now: DbTime,
) -> Vec<ClaimedTask> {
    let request = claim_request(worker, token, policy, start_now);
    match store.apply(&request, now) {
        DbReply::Claimed { tasks, .. } => tasks,
        other => panic!("unexpected reply {other:?}"),
    }
}

fn claim(store: &mut MemoryStore, worker: &str, concurrency: u32, now: DbTime) -> Vec<ClaimedTask> {
    let policy = policy(store, concurrency);
    claim_with(store, worker, 1, &policy, 0, now)
}

fn ids(tasks: &[ClaimedTask]) -> Vec<i64> {
    tasks.iter().map(|t| t.id.0).collect()
}

fn lease(task: &ClaimedTask) -> TaskLease {
    TaskLease { task: task.id, lease: task.lease }
}

fn start(
    store: &mut MemoryStore,
    worker: &str,
    tasks: Vec<TaskLease>,
    policy: &Arc<ClaimPolicy>,
    now: DbTime,
) -> DbReply {
    let request = DbRequest::Start { worker: w(worker), tasks, policy: Arc::clone(policy) };
    store.apply(&request, now)
}

fn started(reply: &DbReply) -> Vec<(i64, u32)> {
    match reply {
        DbReply::Started { started, .. } => started.iter().map(|(id, a)| (id.0, a.0)).collect(),
        other => panic!("unexpected reply {other:?}"),
    }
}

fn finish(store: &mut MemoryStore, worker: &str, task: TaskLease, outcome: FinishOutcome, now: DbTime) -> DbReply {
    let request = DbRequest::Finish { worker: w(worker), completions: vec![Completion { task, outcome, args: None }] };
    store.apply(&request, now)
}

fn reap(store: &mut MemoryStore, claimed: Option<u64>, running: Option<u64>, now: DbTime) -> ReapReport {
    let request =
        DbRequest::Reap { worker: w("reaper"), claimed_stale_ms: claimed, running_stale_ms: running, entropy: 7 };
    match store.apply(&request, now) {
        DbReply::Reaped(report) => report,
        other => panic!("unexpected reply {other:?}"),
    }
}

fn state(store: &MemoryStore, id: TaskId) -> TaskState {
    store.get(id).expect("task exists").state
}

fn err(code: ErrorCode) -> TaskError {
    TaskError::new(code, "boom")
}

/// Claims and starts one task of a default-queue store: (id, its lease).
fn running_task(store: &mut MemoryStore, task: NewTask, worker: &str, now: DbTime) -> TaskLease {
    let id = add(store, task);
    let policy = policy(store, 1);
    let claimed = claim_with(store, worker, 1, &policy, 1, now);
    assert_eq!(ids(&claimed), vec![id.0]);
    lease(&claimed[0])
}

#[test]
fn claim_order_is_queue_priority_then_task_priority_run_at_and_id() {
    let app = custom(vec![CustomQueue::new("low").with_priority(2), CustomQueue::new("high").with_priority(1)]);
    let mut store = MemoryStore::new(app);
    let t1 = add(&mut store, NewTask::new("t", json!(1)).queue("low").priority(3));
    let t2 = add(&mut store, NewTask::new("t", json!(2)).queue("high").priority(5));
    let t3 = add(&mut store, NewTask::new("t", json!(3)).queue("high").priority(1).run_at(RunAt::DelayMs(500)));
    let t4 = add(&mut store, NewTask::new("t", json!(4)).queue("high").priority(1).run_at(RunAt::DelayMs(100)));
    let t5 = add(&mut store, NewTask::new("t", json!(5)).queue("high").priority(1).run_at(RunAt::DelayMs(100)));
    let t6 = add(&mut store, NewTask::new("t", json!(6)).queue("low").priority(-1));
    let claimed = claim(&mut store, "a", 10, at(1_000));
    assert_eq!(ids(&claimed), vec![t4.0, t5.0, t3.0, t2.0, t6.0, t1.0]);
    assert!(claimed.iter().all(|t| !t.started && t.attempt == Attempt(1) && t.lease == Lease(1)));
    let row = store.task(t4).unwrap();
    assert_eq!(row.state, TaskState::Claimed);
    assert_eq!(row.claimed_by, Some(w("a")));
    assert_eq!(row.claimed_at, Some(at(1_000)));
    assert_eq!(row.claim_expires_at, Some(at(1_000).plus_ms(LEASE_MS)));
    assert_eq!(store.get(t4).unwrap().worker, Some(w("a")));
}

#[test]
fn a_budget_smaller_than_the_eligible_rows_takes_the_first_and_says_more() {
    let mut store = MemoryStore::new(AppConfig::default());
    for i in 0..5 {
        add(&mut store, NewTask::new("t", json!(i)));
    }
    let request = claim_request("a", 1, &policy(&store, 2), 0);
    let DbReply::Claimed { tasks, more, .. } = store.apply(&request, T0) else { panic!() };
    assert_eq!((ids(&tasks), more), (vec![1, 2], true));
    let request = claim_request("b", 1, &policy(&store, 10), 0);
    let DbReply::Claimed { tasks, more, .. } = store.apply(&request, T0) else { panic!() };
    assert_eq!((ids(&tasks), more), (vec![3, 4, 5], false));
}

#[test]
fn run_at_in_the_future_is_not_claimed_until_reached() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("t", json!(null)).run_at(RunAt::DelayMs(1_000)));
    assert_eq!(store.next_run_at(), Some(at(1_000)));
    assert_eq!(store.next_run_at_after(at(1_000)), None);
    assert!(claim(&mut store, "a", 4, at(999)).is_empty());
    assert_eq!(ids(&claim(&mut store, "a", 4, at(1_000))), vec![id.0]);
    assert_eq!(store.next_run_at(), None);
}

#[test]
fn good_until_passed_is_not_claimed_and_expires() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("t", json!(null)).good_until(at(100)));
    let claimed_one = add(&mut store, NewTask::new("t", json!(2)).good_until(at(100)));
    let policy = policy(&store, 1);
    // The second is claimed before its good-until, and expires when started after it.
    let claimed = claim_with(&mut store, "a", 1, &policy, 0, at(50));
    assert_eq!(ids(&claimed), vec![id.0]);
    let reply = start(&mut store, "a", vec![lease(&claimed[0])], &policy, at(100));
    assert_eq!(reply, DbReply::Started { started: vec![], expired: vec![id], deferred: vec![], lost: vec![] });
    assert!(claim(&mut store, "b", 4, at(100)).is_empty());
    store.take_notifications();
    let report = reap(&mut store, None, None, at(100));
    assert_eq!(report.expired, vec![claimed_one]);
    for task in [id, claimed_one] {
        let record = store.get(task).unwrap();
        assert_eq!(record.state, TaskState::Expired);
        assert_eq!(record.error.unwrap().code, ErrorCode::TaskExpired);
        assert_eq!(record.finished_at, Some(at(100)));
        assert!(store.attempts(task).is_empty());
    }
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskFinished { task: claimed_one, state: TaskState::Expired }]
    );
}

#[test]
fn hard_mode_queue_cap_counts_running_and_live_claims() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("q").with_max_concurrency(2)]));
    for i in 0..5 {
        add(&mut store, NewTask::new("t", json!(i)));
    }
    let a = policy(&store, 1);
    let first = claim_with(&mut store, "a", 1, &a, 1, T0);
    assert_eq!(ids(&first), vec![1]);
    assert_eq!(ids(&claim(&mut store, "b", 5, T0)), vec![2]);
    assert!(claim(&mut store, "c", 5, T0).is_empty());
    let counts = store.claim_counts(&policy(&store, 5), 0, 0, T0);
    assert_eq!(counts.queues["q"], InFlight { running: 1, claimed: 1 });
    assert_eq!(counts.cluster, InFlight { running: 1, claimed: 1 });
    assert_eq!(counts.available["q"], 3);
    // B's claim lapses: no longer in flight, and claimable again, first by id.
    let later = at(LEASE_MS as i64);
    assert_eq!(store.claim_counts(&a, 0, 0, later).queues["q"], InFlight { running: 1, claimed: 0 });
    assert_eq!(ids(&claim(&mut store, "c", 5, later)), vec![2]);
    assert_eq!(store.task(TaskId(2)).unwrap().lease, Lease(2));
}

#[test]
fn hard_mode_cluster_cap_bounds_every_worker() {
    let mut app = custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]);
    app.cluster_wide_cap = Some(3);
    let mut store = MemoryStore::new(app);
    for i in 0..4 {
        add(&mut store, NewTask::new("t", json!(i)).queue("a"));
        add(&mut store, NewTask::new("t", json!(i)).queue("b"));
    }
    let p = policy(&store, 2);
    assert_eq!(claim_with(&mut store, "w1", 1, &p, 2, T0).len(), 2);
    assert_eq!(claim(&mut store, "w2", 5, T0).len(), 1);
    assert!(claim(&mut store, "w3", 5, T0).is_empty());
}

#[test]
fn soft_mode_queue_cap_counts_running_only_and_start_defers_at_the_cap() {
    let mut app = custom(vec![CustomQueue::new("q").with_max_concurrency(1)]);
    app.prefetch_buffer = 2;
    app.claim_lease_ms = Some(LEASE_MS);
    let mut store = MemoryStore::new(app);
    for i in 0..3 {
        add(&mut store, NewTask::new("t", json!(i)));
    }
    let p = policy(&store, 1);
    let a = claim_with(&mut store, "a", 1, &p, 0, T0);
    let b = claim_with(&mut store, "b", 1, &p, 0, T0);
    // In hard mode the second claimer would have got nothing: the claim holds the slot.
    assert_eq!((ids(&a), ids(&b)), (vec![1], vec![2]));
    assert_eq!(started(&start(&mut store, "a", vec![lease(&a[0])], &p, at(1))), vec![(1, 1)]);
    let reply = start(&mut store, "b", vec![lease(&b[0])], &p, at(2));
    assert_eq!(reply, DbReply::Started { started: vec![], expired: vec![], deferred: vec![TaskId(2)], lost: vec![] });
    assert_eq!(state(&store, TaskId(2)), TaskState::Claimed);
    // Now Running fills the cap: nothing more is claimed.
    assert!(claim_with(&mut store, "c", 1, &p, 0, at(3)).is_empty());
    finish(&mut store, "a", lease(&a[0]), FinishOutcome::Completed(json!("ok")), at(4));
    assert_eq!(started(&start(&mut store, "b", vec![lease(&b[0])], &p, at(5))), vec![(2, 1)]);
}

#[test]
fn a_lapsed_claim_is_reclaimed_under_a_higher_lease_and_the_old_holder_is_fenced() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("t", json!(null)));
    let p = policy(&store, 1);
    let old = lease(&claim_with(&mut store, "a", 1, &p, 0, T0)[0]);
    let lapsed = at(LEASE_MS as i64);
    // Lapsed but not yet reclaimed: too late to start.
    assert_eq!(started(&start(&mut store, "a", vec![old], &p, lapsed)), vec![]);
    let new = claim_with(&mut store, "b", 9, &p, 0, lapsed);
    assert_eq!((ids(&new), new[0].lease, new[0].attempt), (vec![id.0], Lease(2), Attempt(1)));
    let new = lease(&new[0]);
    let lost = |reply: DbReply| match reply {
        DbReply::Started { lost, .. }
        | DbReply::Finished { lost, .. }
        | DbReply::Heartbeat { lost, .. }
        | DbReply::Released { lost, .. } => lost,
        other => panic!("unexpected reply {other:?}"),
    };
    let heartbeat = |claimed: Vec<TaskLease>, running: Vec<TaskLease>| DbRequest::Heartbeat {
        worker: w("a"),
        claimed,
        running,
        lease_ms: LEASE_MS,
        max_renew_age_ms: 180_000,
        abandoned: vec![],
    };
    assert_eq!(lost(start(&mut store, "a", vec![old], &p, lapsed)), vec![id]);
    assert_eq!(lost(store.apply(&heartbeat(vec![old], vec![]), lapsed)), vec![id]);
    let release = DbRequest::Release { worker: w("a"), tasks: vec![old] };
    assert_eq!(lost(store.apply(&release, lapsed)), vec![id]);
    // The new holder runs it; the old holder's writes about the run change nothing.
    assert_eq!(started(&start(&mut store, "b", vec![new], &p, lapsed)), vec![(id.0, 1)]);
    // Even the same worker name under the old lease is fenced.
    assert_eq!(lost(start(&mut store, "b", vec![old], &p, lapsed)), vec![id]);
    assert_eq!(lost(store.apply(&heartbeat(vec![], vec![old]), lapsed)), vec![id]);
    let done = FinishOutcome::Completed(json!(1));
    assert_eq!(lost(finish(&mut store, "a", old, done.clone(), lapsed)), vec![id]);
    assert_eq!(state(&store, id), TaskState::Running);
    let reply = finish(&mut store, "b", new, done.clone(), lapsed);
    assert_eq!(reply, DbReply::Finished { applied: vec![(id, TaskState::Completed)], lost: vec![] });
    // A re-send of an applied finish is lost, never applied twice.
    assert_eq!(lost(finish(&mut store, "b", new, done, lapsed)), vec![id]);
    assert_eq!(store.attempts(id).len(), 1);
}

#[test]
fn start_is_idempotent_for_its_holder() {
    let mut store = MemoryStore::new(AppConfig::default());
    add(&mut store, NewTask::new("t", json!(null)));
    let p = policy(&store, 1);
    let held = lease(&claim_with(&mut store, "a", 1, &p, 0, T0)[0]);
    assert_eq!(started(&start(&mut store, "a", vec![held], &p, at(1))), vec![(1, 1)]);
    assert_eq!(started(&start(&mut store, "a", vec![held], &p, at(2))), vec![(1, 1)]);
    let row = store.task(held.task).unwrap();
    assert_eq!((row.attempts, row.started_at, row.claim_expires_at), (1, Some(at(1)), None));
}

#[test]
fn start_now_starts_the_first_n_of_the_reply() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b").with_priority(2)]));
    add(&mut store, NewTask::new("t", json!(1)).queue("b"));
    add(&mut store, NewTask::new("t", json!(2)).queue("a"));
    add(&mut store, NewTask::new("t", json!(3)).queue("b"));
    let p = policy(&store, 5);
    let claimed = claim_with(&mut store, "a", 1, &p, 2, T0);
    let shape: Vec<(i64, bool, u32)> = claimed.iter().map(|t| (t.id.0, t.started, t.attempt.0)).collect();
    assert_eq!(shape, vec![(2, true, 1), (1, true, 1), (3, false, 1)]);
    let row = store.task(TaskId(2)).unwrap();
    assert_eq!(row.state, TaskState::Running);
    assert_eq!((row.attempts, row.started_at, row.heartbeat_at), (1, Some(T0), Some(T0)));
    assert_eq!(row.claim_expires_at, None);
    assert_eq!(store.task(TaskId(3)).unwrap().attempts, 0);
    assert_eq!(state(&store, TaskId(3)), TaskState::Claimed);
}

#[test]
fn retry_waits_its_delay_then_runs_again() {
    let mut store = MemoryStore::new(AppConfig::default());
    let first = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
    let id = first.task;
    let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 5_000 };
    let reply = finish(&mut store, "a", first, retry, at(10));
    assert_eq!(reply, DbReply::Finished { applied: vec![(id, TaskState::Pending)], lost: vec![] });
    let row = store.task(id).unwrap();
    assert_eq!((row.retries, row.attempts, row.run_at), (1, 1, at(5_010)));
    assert_eq!((row.claimed_by.clone(), row.claim_token, row.heartbeat_at), (None, None, None));
    assert_eq!(store.get(id).unwrap().error, Some(err(ErrorCode::TaskError)));
    assert_eq!(store.next_run_at(), Some(at(5_010)));
    assert!(claim(&mut store, "b", 1, at(5_009)).is_empty());
    let again = claim(&mut store, "b", 1, at(5_010));
    assert_eq!((again[0].attempt, again[0].retries, again[0].lease), (Attempt(2), 1, Lease(2)));
}

#[test]
fn a_retry_at_or_past_good_until_fails_instead() {
    let mut store = MemoryStore::new(AppConfig::default());
    let held = running_task(&mut store, NewTask::new("t", json!(null)).good_until(at(10_000)), "a", T0);
    let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 9_000 };
    let reply = finish(&mut store, "a", held, retry, at(1_000));
    assert_eq!(reply, DbReply::Finished { applied: vec![(held.task, TaskState::Failed)], lost: vec![] });
    let record = store.get(held.task).unwrap();
    assert_eq!((record.error, record.retries), (Some(err(ErrorCode::TaskError)), 0));
    assert_eq!(store.attempts(held.task)[0].outcome, TaskState::Failed);
    // One millisecond earlier it retries.
    let held = running_task(&mut store, NewTask::new("t", json!(2)).good_until(at(10_000)), "a", T0);
    let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 8_999 };
    let reply = finish(&mut store, "a", held, retry, at(1_000));
    assert_eq!(reply, DbReply::Finished { applied: vec![(held.task, TaskState::Pending)], lost: vec![] });
}

#[test]
fn reaper_requeues_stale_claims() {
    let mut store = MemoryStore::new(AppConfig::default());
    add(&mut store, NewTask::new("t", json!(1)));
    add(&mut store, NewTask::new("t", json!(2)));
    let claimed = claim(&mut store, "a", 2, T0);
    let beat = DbRequest::Heartbeat {
        worker: w("a"),
        claimed: vec![lease(&claimed[1])],
        running: vec![],
        lease_ms: LEASE_MS,
        max_renew_age_ms: 180_000,
        abandoned: vec![],
    };
    assert_eq!(store.apply(&beat, at(10_000)), DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] });
    assert_eq!(store.task(TaskId(2)).unwrap().claim_expires_at, Some(at(10_000).plus_ms(LEASE_MS)));
    store.take_notifications();
    assert_eq!(reap(&mut store, Some(30_000), None, at(30_000)).requeued, vec![]);
    let report = reap(&mut store, Some(30_000), None, at(30_001));
    assert_eq!(report, ReapReport { requeued: vec![TaskId(1)], ..ReapReport::default() });
    let row = store.task(TaskId(1)).unwrap();
    assert_eq!((row.state, row.claimed_by.clone(), row.claim_expires_at), (TaskState::Pending, None, None));
    assert_eq!((row.retries, row.attempts, row.lease), (0, 0, Lease(1)));
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: None, run_at: None }]
    );
    // `None` skips the step.
    assert_eq!(reap(&mut store, None, None, at(1_000_000)), ReapReport::default());
}

#[test]
fn reaper_retries_stale_runs_when_the_policy_lists_worker_crashed_and_fails_the_rest() {
    // The policies alone decide (no crash retries beyond them, as in the seed systems).
    let mut app = AppConfig::default();
    app.recovery.crash_retries = 0;
    let mut store = MemoryStore::new(app);
    let crash_retry = RetryPolicy::fixed(vec![10]).with_jitter(false);
    let no_crash = RetryPolicy::fixed(vec![10]).with_codes(vec![ErrorCode::TaskError]);
    let retried = running_task(&mut store, NewTask::new("t", json!(1)).retry(crash_retry.clone()), "a", T0);
    let failed = running_task(&mut store, NewTask::new("t", json!(2)).retry(no_crash), "a", T0);
    let near_expiry =
        running_task(&mut store, NewTask::new("t", json!(3)).retry(crash_retry).good_until(at(40_000)), "a", T0);
    let alive = running_task(&mut store, NewTask::new("t", json!(4)), "b", T0);
    let beat = DbRequest::Heartbeat {
        worker: w("b"),
        claimed: vec![],
        running: vec![alive],
        lease_ms: LEASE_MS,
        max_renew_age_ms: 180_000,
        abandoned: vec![],
    };
    store.apply(&beat, at(20_000));
    store.take_notifications();
    let now = at(30_001);
    let report = reap(&mut store, None, Some(30_000), now);
    assert_eq!(
        report,
        ReapReport {
            retried: vec![retried.task],
            failed: vec![failed.task, near_expiry.task],
            ..ReapReport::default()
        }
    );
    let row = store.task(retried.task).unwrap();
    assert_eq!((row.state, row.retries, row.run_at), (TaskState::Pending, 1, now.plus_ms(10_000)));
    assert_eq!(row.error.as_ref().unwrap().code, ErrorCode::WorkerCrashed);
    assert_eq!(row.claimed_by, None);
    let history = store.attempts(retried.task);
    assert_eq!((history.len(), history[0].outcome, history[0].worker.clone()), (1, TaskState::Pending, Some(w("a"))));
    let record = store.get(failed.task).unwrap();
    assert_eq!(record.state, TaskState::Failed);
    assert_eq!(record.error, Some(TaskError::new(ErrorCode::WorkerCrashed, WORKER_CRASHED_MESSAGE)));
    assert_eq!(store.attempts(failed.task)[0].outcome, TaskState::Failed);
    assert_eq!(state(&store, alive.task), TaskState::Running);
    assert_eq!(
        store.take_notifications(),
        vec![
            Notification::TaskFinished { task: failed.task, state: TaskState::Failed },
            Notification::TaskFinished { task: near_expiry.task, state: TaskState::Failed },
            // The retry becomes ready later: listeners are told so they learn when.
            Notification::TaskReady { queue: "default".into(), priority: None, run_at: None },
        ]
    );
    // The worker that was thought dead finds out when it writes.
    let late = finish(&mut store, "a", retried, FinishOutcome::Completed(json!(1)), now);
    assert_eq!(late, DbReply::Finished { applied: vec![], lost: vec![retried.task] });
}

#[test]
fn cancel_takes_pending_and_claimed_tasks_and_refuses_running_ones() {
    let mut store = MemoryStore::new(AppConfig::default());
    let pending = add(&mut store, NewTask::new("t", json!(1)).run_at(RunAt::DelayMs(1_000)));
    let p = policy(&store, 1);
    let running = running_task(&mut store, NewTask::new("t", json!(2)), "a", T0);
    let claimed_id = add(&mut store, NewTask::new("t", json!(3)));
    let claimed = lease(&claim_with(&mut store, "a", 2, &p, 0, T0)[0]);
    assert_eq!(claimed.task, claimed_id);
    store.take_notifications();
    store.cancel(pending, at(1)).unwrap();
    store.cancel(claimed_id, at(2)).unwrap();
    for id in [pending, claimed_id] {
        let record = store.get(id).unwrap();
        assert_eq!(record.state, TaskState::Cancelled);
        assert_eq!(record.error.unwrap().code, ErrorCode::TaskCancelled);
        assert!(store.attempts(id).is_empty());
    }
    let refused = store.cancel(running.task, at(3)).unwrap_err();
    assert_eq!(refused.to_string(), format!("task {} is RUNNING: expected PENDING or CLAIMED", running.task));
    assert_eq!(store.cancel(TaskId(99), at(3)), Err(AdminError::NotFound(TaskId(99))));
    assert_eq!(
        store.cancel(pending, at(3)).unwrap_err().to_string(),
        "task 1 is CANCELLED: expected PENDING or CLAIMED"
    );
    assert_eq!(started(&start(&mut store, "a", vec![claimed], &p, at(4))), vec![]);
    assert_eq!(
        store.take_notifications(),
        vec![
            Notification::TaskFinished { task: pending, state: TaskState::Cancelled },
            Notification::TaskFinished { task: claimed_id, state: TaskState::Cancelled },
        ]
    );
}

#[test]
fn requeue_failed_puts_a_failed_task_back_at_once() {
    let mut store = MemoryStore::new(AppConfig::default());
    let held = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
    let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 1_000 };
    finish(&mut store, "a", held, retry, at(1));
    let p = policy(&store, 1);
    let again = lease(&claim_with(&mut store, "a", 2, &p, 1, at(1_001))[0]);
    finish(&mut store, "a", again, FinishOutcome::Failed(err(ErrorCode::TaskError)), at(1_002));
    assert_eq!(state(&store, held.task), TaskState::Failed);
    assert_eq!(store.requeue_failed(TaskId(42), at(1_003)), Err(AdminError::NotFound(TaskId(42))));
    store.take_notifications();
    store.requeue_failed(held.task, at(2_000)).unwrap();
    let record = store.get(held.task).unwrap();
    assert_eq!((record.state, record.retries, record.attempts), (TaskState::Pending, 0, 2));
    assert_eq!((record.run_at, record.finished_at), (at(2_000), None));
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: None, run_at: None }]
    );
    assert_eq!(store.tasks().next().map(|t| t.id), Some(held.task), "back in the live table");
    let third = claim(&mut store, "b", 1, at(2_000));
    assert_eq!((third[0].attempt, third[0].retries, third[0].lease), (Attempt(3), 0, Lease(3)));
    assert_eq!(store.attempts(held.task).len(), 2);
    let refused = store.requeue_failed(held.task, at(2_001)).unwrap_err();
    assert_eq!(refused.to_string(), "task 1 is CLAIMED: expected FAILED");
}

#[test]
fn reschedule_changes_pending_tasks_only_and_announces_them() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("t", json!(1)).good_until(at(10_000)).key("k"));
    store.take_notifications();
    let later = Reschedule { run_at: Some(RunAt::DelayMs(5_000)), priority: Some(-4), retries: Some(3) };
    store.reschedule(id, later, at(1)).unwrap();
    let row = store.task(id).unwrap();
    assert_eq!((row.run_at, row.priority, row.retries, row.key.as_deref()), (at(5_001), -4, 3, Some("k")));
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: None, run_at: None }]
    );
    // A claim now waits for it: the wake-up hint names its new run-at.
    let p = policy(&store, 1);
    let request = claim_request("a", 1, &p, 0);
    assert_eq!(
        store.apply(&request, at(2)),
        DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: Some(4_999) }
    );
    let too_late = Reschedule { run_at: Some(RunAt::At(at(10_000))), ..Reschedule::default() };
    assert_eq!(
        store.reschedule(id, too_late, at(3)),
        Err(AdminError::RunAtAfterGoodUntil { task: id, run_at: at(10_000).0, good_until: at(10_000).0 })
    );
    // Said as times, not milliseconds.
    let said = store.reschedule(id, too_late, at(3)).unwrap_err().to_string();
    assert!(said.contains("run_at 1970-01-01T00:16:50Z is not before its good_until 1970-01-01T00:16:50Z"), "{said}");
    // Regression: more retries spent than the column holds were clamped without a word.
    let huge = Reschedule { retries: Some(u32::MAX), ..Reschedule::default() };
    assert_eq!(store.reschedule(id, huge, at(3)), Err(AdminError::InvalidRetries(u32::MAX)));
    assert_eq!(store.task(id).unwrap().retries, 3);
    store.reschedule(id, Reschedule { run_at: Some(RunAt::Now), ..Reschedule::default() }, at(4)).unwrap();
    assert_eq!(ids(&claim_with(&mut store, "a", 2, &p, 1, at(4))), vec![id.0]);
    let refused = store.reschedule(id, Reschedule::default(), at(5)).unwrap_err();
    assert_eq!(refused.to_string(), "task 1 is RUNNING: expected PENDING");
    assert_eq!(store.reschedule(TaskId(9), Reschedule::default(), at(5)), Err(AdminError::NotFound(TaskId(9))));
}

#[test]
fn hand_finishes_fence_the_holder_and_keep_the_cut_off_run() {
    let mut store = MemoryStore::new(AppConfig::default());
    let running = running_task(&mut store, NewTask::new("t", json!(1)), "a", T0);
    let pending = add(&mut store, NewTask::new("t", json!(2)));
    store.take_notifications();
    store.complete(running.task, json!("by hand"), at(1)).unwrap();
    store.fail(pending, "not wanted", at(2)).unwrap();
    let late = finish(&mut store, "a", running, FinishOutcome::Completed(json!("late")), at(3));
    assert_eq!(late, DbReply::Finished { applied: vec![], lost: vec![running.task] });
    let done = store.get(running.task).unwrap();
    assert_eq!((done.state, done.result, done.error), (TaskState::Completed, Some(json!("by hand")), None));
    let history = store.attempts(running.task);
    assert_eq!(history.len(), 1);
    assert_eq!((history[0].worker.clone(), history[0].outcome), (Some(w("a")), TaskState::Completed));
    let failed = store.get(pending).unwrap();
    assert_eq!(failed.error.unwrap().code, ErrorCode::FailedByOperator);
    assert!(store.attempts(pending).is_empty(), "it never ran");
    assert_eq!(
        store.take_notifications(),
        vec![
            Notification::TaskFinished { task: running.task, state: TaskState::Completed },
            Notification::TaskFinished { task: pending, state: TaskState::Failed },
        ]
    );
    let refused = store.complete(pending, json!(null), at(4)).unwrap_err();
    assert_eq!(refused.to_string(), "task 2 is FAILED: expected PENDING, CLAIMED or RUNNING");
}

#[test]
fn force_unlock_releases_every_hold_of_the_dead_and_marks_them_stopped() {
    let mut store = MemoryStore::new(AppConfig::default());
    let info = WorkerInfo { worker: w("dead"), queues: vec![], concurrency: 2 };
    store.apply(&DbRequest::RegisterWorker(info), T0);
    for i in 0..3 {
        add(&mut store, NewTask::new("t", json!(i)));
    }
    let p = policy(&store, 2);
    let dead = claim_with(&mut store, "dead", 1, &p, 1, T0);
    let other = claim(&mut store, "b", 1, T0);
    store.take_notifications();
    assert_eq!(store.force_unlock(&[w("dead")]), 2);
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: None, run_at: None }]
    );
    let states: Vec<(TaskState, u32, u32)> =
        dead.iter().map(|t| store.get(t.id).unwrap()).map(|r| (r.state, r.attempts, r.retries)).collect();
    assert_eq!(states, vec![(TaskState::Pending, 1, 0), (TaskState::Pending, 0, 0)]);
    assert_eq!(state(&store, other[0].id), TaskState::Claimed);
    assert!(store.workers()[0].stopped);
    assert_eq!(store.force_unlock(&[w("dead")]), 0);
}

#[test]
fn removing_a_key_frees_it_whatever_the_task_did() {
    let mut store = MemoryStore::new(AppConfig::default());
    let held = add(&mut store, NewTask::new("t", json!(1)).key("held"));
    claim(&mut store, "a", 1, T0);
    let pending = add(&mut store, NewTask::new("t", json!(2)).key("pending"));
    let done = add(&mut store, NewTask::new("t", json!(3)).key("done"));
    store.cancel(done, T0).unwrap();
    assert_eq!(store.remove_key("held", at(1)), Ok(KeyRemoval::Detached(held)));
    assert_eq!(store.remove_key("pending", at(1)), Ok(KeyRemoval::Cancelled(pending)));
    assert_eq!(store.remove_key("done", at(1)), Ok(KeyRemoval::Freed(done)));
    assert_eq!(store.remove_key("done", at(1)), Err(AdminError::KeyNotFound("done".into())));
    assert_eq!(state(&store, held), TaskState::Claimed);
    assert_eq!(state(&store, pending), TaskState::Cancelled);
    assert!(store.tasks().all(|t| t.key.is_none()));
    // Free for new tasks, with other arguments.
    let again = store.enqueue(NewTask::new("t", json!(9)).key("held"), at(2)).unwrap();
    assert_eq!(again, TaskId(4));
}

#[test]
fn purge_forgets_old_finished_tasks_with_their_runs_and_keys() {
    let mut store = MemoryStore::new(AppConfig::default());
    let old = running_task(&mut store, NewTask::new("t", json!(1)).key("old"), "a", T0);
    finish(&mut store, "a", old, FinishOutcome::Completed(json!(1)), at(10));
    let young = add(&mut store, NewTask::new("t", json!(2)).key_with_mode("young", KeyMode::UnsafeDedupe));
    store.cancel(young, at(1_000)).unwrap();
    assert_eq!(store.purge_finished(500, at(1_000)), 1);
    assert!(store.get(old.task).is_none() && store.attempts(old.task).is_empty());
    assert_eq!(store.remove_key("old", at(1_001)), Err(AdminError::KeyNotFound("old".into())), "gone with it");
    assert_eq!(store.remove_key("young", at(1_001)), Ok(KeyRemoval::Freed(young)));
    assert_eq!(store.purge_finished(500, at(1_000)), 0);
}

#[test]
fn idempotency_keys_keep_their_tasks_from_purge_for_their_window() {
    // By default, forever: an idempotent enqueue of a payment that ran gives its id, years on.
    let mut store = MemoryStore::new(AppConfig::default());
    let paid = add(&mut store, NewTask::new("pay", json!({"cents": 100})).idempotency_key("p1"));
    store.complete(paid, json!("ok"), at(10)).unwrap();
    let years = 100 * 365 * 86_400_000;
    assert_eq!(store.purge_finished(0, at(years)), 0);
    let again = NewTask::new("pay", json!({"cents": 100})).idempotency_key("p1");
    assert_eq!(store.enqueue(again.clone(), at(years)), Ok(paid));
    assert_eq!(store.tasks().count(), 1, "the payment did not run again");

    // With a window of a minute: kept while the key is younger, then purged with its key.
    let recovery = RecoveryConfig { idempotency_retention_ms: Some(60_000), ..RecoveryConfig::default() };
    let mut store = MemoryStore::new(AppConfig { recovery, ..AppConfig::default() });
    let paid = add(&mut store, again.clone());
    let plain = add(&mut store, NewTask::new("t", json!(1)).key("plain"));
    // A key taken in another mode counts from the first idempotent enqueue that relies on it.
    let relied = add(&mut store, NewTask::new("t", json!(2)).key("relied"));
    assert_eq!(store.enqueue(NewTask::new("t", json!(2)).idempotency_key("relied"), at(30_000)), Ok(relied));
    for id in [paid, plain, relied] {
        store.complete(id, json!(null), at(10)).unwrap();
    }
    assert_eq!(store.purge_finished(0, at(59_999)), 1, "the plain key's task goes at once");
    assert_eq!(store.purge_finished(0, at(60_000)), 1, "a minute after its enqueue, the payment");
    assert_eq!(store.purge_finished(0, at(89_999)), 0);
    assert_eq!(store.purge_finished(0, at(90_000)), 1);
    assert!(store.tasks().next().is_none());
    assert_eq!(store.enqueue(again, at(90_001)), Ok(TaskId(4)), "past its window the key is free again");
}

#[test]
fn a_paused_queue_is_left_out_of_claims_until_resumed() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
    add(&mut store, NewTask::new("t", json!(1)).queue("a"));
    add(&mut store, NewTask::new("t", json!(2)).queue("b"));
    add(&mut store, NewTask::new("t", json!(3)).queue("a").run_at(RunAt::DelayMs(100)));
    store.take_notifications();
    assert_eq!(store.pause_queue("a", T0), Ok(true));
    assert_eq!(store.pause_queue("a", at(5)), Ok(false));
    assert_eq!(store.paused_queues(), vec![PausedQueue { queue: "a".into(), paused_at: T0 }]);
    assert_eq!(store.pause_queue("A", T0), Err(AdminError::InvalidQueueName("A".into())));
    let p = policy(&store, 4);
    let request = claim_request("w", 1, &p, 0);
    // Neither its due task nor the wake-up hint of its delayed one.
    let DbReply::Claimed { tasks, more, next_run_in_ms } = store.apply(&request, T0) else { panic!() };
    assert_eq!((ids(&tasks), more, next_run_in_ms), (vec![2], false, None));
    assert!(store.take_notifications().is_empty());
    assert_eq!(store.resume_queue("a"), Ok(true));
    assert_eq!(store.resume_queue("a"), Ok(false));
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "a".into(), priority: None, run_at: None }]
    );
    assert_eq!(ids(&claim_with(&mut store, "w", 2, &p, 0, T0)), vec![1]);
}

#[test]
fn idempotency_keys_dedupe_same_payloads_and_refuse_others() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("t", json!({"n": 1})).idempotency_key("k"));
    store.take_notifications();
    assert_eq!(store.enqueue(NewTask::new("t", json!({"n": 1})).idempotency_key("k"), at(5)), Ok(id));
    assert!(store.take_notifications().is_empty());
    assert_eq!(store.tasks().count(), 1);
    assert_eq!(
        store.enqueue(NewTask::new("t", json!({"n": 2})).idempotency_key("k"), at(5)),
        Err(EnqueueError::PayloadMismatch { key: "k".into(), existing: id })
    );
    assert_eq!(
        store.enqueue(NewTask::new("other", json!({"n": 1})).idempotency_key("k"), at(5)),
        Err(EnqueueError::PayloadMismatch { key: "k".into(), existing: id })
    );
    // A finished task still owns its key.
    store.cancel(id, at(6)).unwrap();
    assert_eq!(store.enqueue(NewTask::new("t", json!({"n": 1})).idempotency_key("k"), at(7)), Ok(id));
}

#[test]
fn enqueue_many_is_all_or_nothing_and_dedupes_within_the_batch() {
    let mut store = MemoryStore::new(AppConfig::default());
    let existing = add(&mut store, NewTask::new("t", json!(0)).idempotency_key("k0"));
    let bad_batch = vec![
        NewTask::new("t", json!(1)),
        NewTask::new("t", json!(0)).idempotency_key("k0"),
        NewTask::new("t", json!(2)).idempotency_key("k1"),
        NewTask::new("t", json!(3)).idempotency_key("k1"),
    ];
    assert_eq!(
        store.enqueue_many(bad_batch, T0),
        Err(EnqueueError::BatchKeyConflict { key: "k1".into(), first: 2, second: 3 })
    );
    assert_eq!(store.tasks().count(), 1);
    let batch = vec![
        NewTask::new("t", json!(1)),
        NewTask::new("t", json!(0)).idempotency_key("k0"),
        NewTask::new("t", json!(2)).idempotency_key("k1"),
        NewTask::new("t", json!(2)).idempotency_key("k1"),
    ];
    let ids = store.enqueue_many(batch, T0).unwrap();
    assert_eq!(ids, vec![TaskId(2), existing, TaskId(3), TaskId(3)]);
    assert_eq!(store.tasks().count(), 3);
    assert_eq!(add(&mut store, NewTask::new("t", json!(9))), TaskId(4));
}

#[test]
fn replace_updates_a_pending_task_in_place_and_detaches_a_running_one() {
    let mut store = MemoryStore::new(AppConfig::default());
    let first = add(&mut store, NewTask::new("t", json!({"v": 1})).key("k").priority(5));
    store.take_notifications();
    let again = NewTask::new("u", json!({"v": 2})).key("k").run_at(RunAt::DelayMs(500)).flag("slow");
    assert_eq!(store.enqueue(again, at(10)), Ok(first));
    let row = store.task(first).unwrap();
    assert_eq!((row.name.as_str(), &row.args, row.priority, row.run_at), ("u", &json!({"v": 2}), 0, at(510)));
    assert_eq!(row.flags, vec!["slow".to_owned()]);
    assert_eq!(store.take_notifications().len(), 1, "its queue hears of the update");
    assert_eq!(store.tasks().count(), 1);

    // Running: it keeps running without its key, and a new task takes the key.
    let running = claim_n(&mut store, "w1", 1, 1, 1, at(600));
    assert_eq!(running[0].id, first);
    let second = store.enqueue(NewTask::new("t", json!({"v": 3})).key("k"), at(700)).unwrap();
    assert_ne!(second, first);
    assert_eq!(store.task(first).unwrap().key, None);
    assert_eq!(store.task(second).unwrap().key.as_deref(), Some("k"));

    // Finished: the key is free, the finished row gives it up.
    finish(&mut store, "w1", lease(&running[0]), FinishOutcome::Completed(json!(1)), at(800));
    let claimed = claim_n(&mut store, "w1", 2, 1, 1, at(900));
    finish(&mut store, "w1", lease(&claimed[0]), FinishOutcome::Completed(json!(2)), at(950));
    let third = store.enqueue(NewTask::new("t", json!({"v": 4})).key("k"), at(1_000)).unwrap();
    assert!(third > second);
    assert_eq!(store.task(second).unwrap().key, None);
}

#[test]
fn replace_appends_arrays_resets_retries_and_preserve_keeps_run_at() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("batch", json!([1, 2])).key("b").run_at(RunAt::DelayMs(1_000)));
    assert_eq!(store.enqueue(NewTask::new("batch", json!([3])).key("b"), at(10)), Ok(id));
    assert_eq!(store.task(id).unwrap().args, json!([1, 2, 3]));
    assert_eq!(store.task(id).unwrap().run_at, at(10), "replace moves run-at");

    let kept = store
        .enqueue(
            NewTask::new("batch", json!([4])).key_with_mode("b", KeyMode::PreserveRunAt).run_at(RunAt::DelayMs(9_000)),
            at(20),
        )
        .unwrap();
    assert_eq!(kept, id);
    assert_eq!(store.task(id).unwrap().run_at, at(10), "preserve_run_at keeps it while it never ran");

    // A task that ran and waits for a retry: its retry budget starts over, and
    // preserve_run_at no longer applies.
    let claimed = claim_n(&mut store, "w", 1, 1, 1, at(30));
    let error = TaskError::new(ErrorCode::TaskError, "boom");
    finish(&mut store, "w", lease(&claimed[0]), FinishOutcome::Retry { error, delay_ms: 5_000 }, at(40));
    assert_eq!(store.task(id).unwrap().retries, 1);
    let mode = KeyMode::PreserveRunAt;
    store.enqueue(NewTask::new("batch", json!("x")).key_with_mode("b", mode), at(50)).unwrap();
    let row = store.task(id).unwrap();
    assert_eq!((row.retries, row.error.is_none(), row.run_at, &row.args), (0, true, at(50), &json!("x")));
    assert_eq!(row.attempts, 1, "attempts never decrease");
}

#[test]
fn unsafe_dedupe_keeps_a_live_task_and_bulk_applies_in_order() {
    let mut store = MemoryStore::new(AppConfig::default());
    let mode = KeyMode::UnsafeDedupe;
    let batch = vec![
        NewTask::new("t", json!(1)).key_with_mode("d", mode),
        NewTask::new("t", json!(2)).key_with_mode("d", mode),
        NewTask::new("t", json!(3)),
        NewTask::new("t", json!(4)).key("r"),
        NewTask::new("t", json!(5)).key("r"),
    ];
    let ids = store.enqueue_many(batch, T0).unwrap();
    assert_eq!(ids, vec![TaskId(1), TaskId(1), TaskId(2), TaskId(3), TaskId(3)]);
    assert_eq!(store.task(TaskId(1)).unwrap().args, json!(1), "dedupe keeps the first");
    assert_eq!(store.task(TaskId(3)).unwrap().args, json!(5), "replace takes the last");

    let claimed = claim_n(&mut store, "w", 1, 1, 1, at(1));
    assert_eq!(claimed[0].id, TaskId(1));
    assert_eq!(store.enqueue(NewTask::new("t", json!(9)).key_with_mode("d", mode), at(2)), Ok(TaskId(1)));

    let mixed = vec![NewTask::new("t", json!(1)).key("m"), NewTask::new("t", json!(1)).key_with_mode("m", mode)];
    assert_eq!(store.enqueue_many(mixed, at(3)), Err(EnqueueError::MixedKeyModes("m".into())));
    assert_eq!(store.tasks().count(), 3);
}

#[test]
fn forbidden_flags_are_not_claimed() {
    let mut store = MemoryStore::new(AppConfig::default());
    let slow = add(&mut store, NewTask::new("t", json!(1)).flag("slow").flag("gpu").flag("slow"));
    let plain = add(&mut store, NewTask::new("t", json!(2)));
    assert_eq!(store.task(slow).unwrap().flags, vec!["gpu".to_owned(), "slow".to_owned()]);
    let worker = WorkerConfig { forbidden_flags: vec!["slow".into()], ..WorkerConfig::default() };
    let picky = Arc::new(ClaimPolicy::from_config(store.app(), &worker));
    assert_eq!(ids(&claim_with(&mut store, "w", 1, &picky, 0, T0)), vec![plain.0]);
    assert_eq!(ids(&claim_n(&mut store, "w", 2, 4, 0, T0)), vec![slow.0]);
    assert_eq!(
        store.enqueue(NewTask::new("t", json!(3)).flag("Bad"), T0),
        Err(EnqueueError::InvalidFlag("Bad".into()))
    );
}

#[test]
fn a_serial_queue_holds_one_claim_at_a_time_in_soft_cap_mode_too() {
    let mut app = custom(vec![CustomQueue::new("s").serial(), CustomQueue::new("free")]);
    app.prefetch_buffer = 8;
    app.claim_lease_ms = Some(LEASE_MS);
    let mut store = MemoryStore::new(app);
    for n in 0..3 {
        add(&mut store, NewTask::new("t", json!(n)).queue("s"));
    }
    let policy = policy(&store, 4);
    let first = claim_with(&mut store, "a", 1, &policy, 0, T0);
    assert_eq!(ids(&first), vec![1], "one claim, though the buffer has room");
    assert!(claim_with(&mut store, "b", 2, &policy, 0, T0).is_empty(), "another worker waits for it");
    finish(&mut store, "a", lease(&first[0]), FinishOutcome::Completed(json!(0)), at(1));
    assert_eq!(ids(&claim_with(&mut store, "b", 3, &policy, 0, at(2))), vec![2], "then the next, in order");
    // A lapsed claim frees the queue.
    assert_eq!(ids(&claim_with(&mut store, "a", 4, &policy, 0, at(2 + LEASE_MS as i64))), vec![2]);
}

/// Regression (simulation seed 6012823): a heartbeat renewed a lapsed claim of a serial
/// queue after another worker, counting it out, had claimed the queue's next task.
#[test]
fn a_lapsed_claim_is_not_renewed_by_a_late_heartbeat() {
    let mut app = custom(vec![CustomQueue::new("s").serial()]);
    app.prefetch_buffer = 8;
    app.claim_lease_ms = Some(LEASE_MS);
    let mut store = MemoryStore::new(app);
    add(&mut store, NewTask::new("t", json!(1)).queue("s"));
    let policy = policy(&store, 1);
    let first = claim_with(&mut store, "a", 1, &policy, 0, T0);
    let later = at(LEASE_MS as i64 + 1);
    store.enqueue(NewTask::new("t", json!(2)).queue("s").priority(-1), later).unwrap();
    let second = claim_with(&mut store, "b", 2, &policy, 1, later);
    assert_eq!(ids(&second), vec![2], "the lapsed claim is counted out; the urgent task goes first");
    let beat = DbRequest::Heartbeat {
        worker: w("a"),
        claimed: vec![lease(&first[0])],
        running: vec![],
        lease_ms: LEASE_MS,
        max_renew_age_ms: 10 * LEASE_MS,
        abandoned: vec![],
    };
    store.apply(&beat, later.plus_ms(1));
    assert_eq!(store.task(first[0].id).unwrap().claim_expires_at, Some(at(LEASE_MS as i64)), "not renewed");
    let reply = start(&mut store, "a", vec![lease(&first[0])], &policy, later.plus_ms(2));
    assert_eq!(started(&reply), vec![], "and it cannot start");
}

#[test]
fn a_partial_failure_keeps_only_the_failed_items() {
    let mut store = MemoryStore::new(AppConfig::default());
    let id = add(&mut store, NewTask::new("batch", json!([1, 2, 3])));
    let claimed = claim_n(&mut store, "w", 1, 1, 1, T0);
    let error = TaskError::new(ErrorCode::TaskError, "2 failed");
    let completion = Completion {
        task: lease(&claimed[0]),
        outcome: FinishOutcome::Retry { error, delay_ms: 1_000 },
        args: Some(json!([2])),
    };
    store.apply(&DbRequest::Finish { worker: w("w"), completions: vec![completion] }, at(1));
    assert_eq!(store.task(id).unwrap().args, json!([2]));
    assert_eq!(store.task(id).unwrap().state, TaskState::Pending);
}

#[test]
fn refused_enqueues_write_nothing() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a")]));
    let refusals = [
        NewTask::new("t", json!(1)).queue("b"),
        NewTask::new("t", json!(1)).queue("Bad-Name"),
        NewTask::new("t", json!(1)).queue("a").run_at(RunAt::DelayMs(100)).good_until(at(100)),
        NewTask::new("", json!(1)),
    ];
    assert!(matches!(store.enqueue(refusals[0].clone(), T0), Err(EnqueueError::UnknownQueue { .. })));
    assert!(matches!(store.enqueue(refusals[1].clone(), T0), Err(EnqueueError::InvalidQueueName(_))));
    assert!(matches!(store.enqueue(refusals[2].clone(), T0), Err(EnqueueError::RunAtAfterGoodUntil { .. })));
    let mut batch = vec![NewTask::new("t", json!(0))];
    batch.extend(refusals);
    assert!(store.enqueue_many(batch, T0).is_err());
    assert_eq!(store.tasks().count(), 0);
    assert!(store.take_notifications().is_empty());
    // No task means the default queue: the first queue in custom mode.
    let id = add(&mut store, NewTask::new("t", json!(1)));
    assert_eq!((id, store.get(id).unwrap().queue), (TaskId(1), "a".to_owned()));
}

#[test]
fn abandon_claim_releases_exactly_that_tokens_rows() {
    let mut store = MemoryStore::new(AppConfig::default());
    for i in 0..5 {
        add(&mut store, NewTask::new("t", json!(i)));
    }
    let p = policy(&store, 2);
    assert_eq!(ids(&claim_with(&mut store, "a", 1, &p, 1, T0)), vec![1, 2]);
    let one = policy(&store, 1);
    assert_eq!(ids(&claim_with(&mut store, "a", 2, &one, 0, T0)), vec![3]);
    assert_eq!(ids(&claim_with(&mut store, "b", 1, &one, 0, T0)), vec![4]);
    store.take_notifications();
    let reply = store.apply(&DbRequest::AbandonClaim { worker: w("a"), token: 1 }, at(1));
    assert_eq!(reply, DbReply::Released { released: vec![TaskId(1), TaskId(2)], lost: vec![] });
    let states: Vec<TaskState> = (1..=5).map(|i| state(&store, TaskId(i))).collect();
    use TaskState::{Claimed, Pending};
    assert_eq!(states, vec![Pending, Pending, Claimed, Claimed, Pending]);
    let one = store.task(TaskId(1)).unwrap();
    // The claim started it, and nothing ran: the attempt goes back, the lease stays (it
    // fences whatever the claim's holder might still write).
    assert_eq!((one.attempts, one.retries, one.lease), (0, 0, Lease(1)));
    assert_eq!(one.started_at, None);
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: None, run_at: None }]
    );
    let again = store.apply(&DbRequest::AbandonClaim { worker: w("a"), token: 1 }, at(2));
    assert_eq!(again, DbReply::Released { released: vec![], lost: vec![] });
    assert!(store.take_notifications().is_empty());
}

#[test]
fn notifications_come_one_per_statement_per_queue() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
    let batch = vec![
        NewTask::new("t", json!(1)).queue("a"),
        NewTask::new("t", json!(2)).queue("b"),
        NewTask::new("t", json!(3)).queue("a"),
        NewTask::new("t", json!(4)).queue("a"),
    ];
    // A worker waits on both queues: the enqueues notify.
    let mark = DbRequest::SetWaiting {
        worker: w("w"),
        queues: vec!["a".into(), "b".into()],
        waiting: true,
        urgent_below: None,
        stale_ms: 1,
    };
    store.apply(&mark, T0);
    store.enqueue_many(batch, T0).unwrap();
    // An enqueue announces the most urgent priority and the earliest run-at it wrote; a release
    // announces neither.
    let ready = |q: &str, priority, run_at| Notification::TaskReady { queue: q.into(), priority, run_at };
    assert_eq!(store.take_notifications(), vec![ready("a", Some(0), Some(T0)), ready("b", Some(0), Some(T0))]);
    let claimed = claim(&mut store, "w", 4, T0);
    assert!(store.take_notifications().is_empty());
    let tasks = claimed.iter().map(lease).collect();
    store.apply(&DbRequest::Release { worker: w("w"), tasks }, at(1));
    assert_eq!(store.take_notifications(), vec![ready("a", None, None), ready("b", None, None)]);
    let urgent =
        vec![NewTask::new("t", json!(5)).queue("a").priority(3), NewTask::new("t", json!(6)).queue("a").priority(-2)];
    store.enqueue_many(urgent, at(1)).unwrap();
    assert_eq!(store.take_notifications(), vec![ready("a", Some(-2), Some(at(1)))]);
    let p = policy(&store, 4);
    let claimed = claim_with(&mut store, "w", 2, &p, 4, at(2));
    let completions = claimed
        .iter()
        .map(|t| Completion { task: lease(t), outcome: FinishOutcome::Completed(json!(t.id.0)), args: None })
        .collect();
    store.apply(&DbRequest::Finish { worker: w("w"), completions }, at(3));
    let finished: Vec<Notification> =
        claimed.iter().map(|t| Notification::TaskFinished { task: t.id, state: TaskState::Completed }).collect();
    assert_eq!(store.take_notifications(), finished);
    assert_eq!(store.get(claimed[0].id).unwrap().result, Some(json!(claimed[0].id.0)));
}

/// An enqueue without keys notifies only the queues some worker is marked waiting on (as a
/// client's own enqueue in PostgreSQL); a keyed one always. Marks of workers the registry has
/// not seen for their own stale thresholds (or has stopped, or lacks) go with any other mark
/// or unmark; a worker's deregistration takes its own.
#[test]
fn enqueues_without_keys_notify_only_queues_a_worker_waits_on() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
    let ready =
        |q: &str, run_at: Option<DbTime>| Notification::TaskReady { queue: q.into(), priority: Some(0), run_at };
    let set = |worker: &str, queues: &[&str], waiting: bool| DbRequest::SetWaiting {
        worker: w(worker),
        queues: queues.iter().map(|q| (*q).to_owned()).collect(),
        waiting,
        urgent_below: None,
        stale_ms: 1_000,
    };
    let both = || vec![NewTask::new("t", json!(1)).queue("a"), NewTask::new("t", json!(2)).queue("b")];
    store.enqueue_many(both(), T0).unwrap();
    assert!(store.take_notifications().is_empty(), "nobody waits");
    store.enqueue(NewTask::new("t", json!(3)).queue("a").key("k"), T0).unwrap();
    assert_eq!(store.take_notifications(), vec![ready("a", None)], "a keyed enqueue notifies always");

    let info = |name: &str| WorkerInfo { worker: w(name), queues: vec!["a".into()], concurrency: 1 };
    store.apply(&DbRequest::RegisterWorker(info("x")), T0);
    assert_eq!(store.apply(&set("x", &["a"], true), T0), DbReply::WaitingSet { written: true });
    assert_eq!(store.apply(&set("x", &["a"], true), at(1)), DbReply::WaitingSet { written: false });
    store.enqueue_many(both(), at(2)).unwrap();
    assert_eq!(store.take_notifications(), vec![ready("a", Some(at(2)))]);
    // Busy: narrowed to tasks more urgent than its backlog (priority 0 here).
    let busy = DbRequest::SetWaiting {
        worker: w("x"),
        queues: vec!["a".into()],
        waiting: false,
        urgent_below: Some(0),
        stale_ms: 1_000,
    };
    assert_eq!(store.apply(&busy, at(3)), DbReply::WaitingSet { written: false });
    store.enqueue_many(both(), at(4)).unwrap();
    assert!(store.take_notifications().is_empty(), "a task as urgent as the backlog notified");
    store.enqueue(NewTask::new("t", json!(9)).queue("a").priority(-1), at(4)).unwrap();
    let urgent = Notification::TaskReady { queue: "a".into(), priority: Some(-1), run_at: Some(at(4)) };
    assert_eq!(store.take_notifications(), vec![urgent], "a more urgent task did not notify");
    assert_eq!(store.apply(&set("x", &["a"], false), at(4)), DbReply::WaitingSet { written: false });
    store.enqueue_many(both(), at(4)).unwrap();
    assert!(store.take_notifications().is_empty(), "unmarked");

    // x, last seen at T0, is stale at T0 + 1 s: y's mark deletes x's; y's deregistration its own.
    store.apply(&DbRequest::RegisterWorker(info("y")), at(1_500));
    store.apply(&set("x", &["a"], true), at(5));
    store.apply(&set("y", &["b"], true), at(1_500));
    store.enqueue_many(both(), at(1_501)).unwrap();
    assert_eq!(store.take_notifications(), vec![ready("b", Some(at(1_501)))], "x's stale mark stayed");
    store.apply(&DbRequest::DeregisterWorker(w("y")), at(1_502));
    store.enqueue_many(both(), at(1_503)).unwrap();
    assert!(store.take_notifications().is_empty(), "a stopped worker's mark stayed");

    // Each mark is judged by its own worker's threshold: a worker with a short one leaves the
    // mark of a worker with a long one, silent for longer than the short one.
    store.apply(&DbRequest::RegisterWorker(info("z")), at(2_000));
    let long = DbRequest::SetWaiting {
        worker: w("z"),
        queues: vec!["a".into()],
        waiting: true,
        urgent_below: None,
        stale_ms: 100_000,
    };
    store.apply(&long, at(2_000));
    store.apply(&DbRequest::RegisterWorker(info("v")), at(5_000));
    store.apply(&set("v", &["b"], true), at(5_000));
    store.enqueue_many(both(), at(5_001)).unwrap();
    assert_eq!(
        store.take_notifications(),
        vec![ready("a", Some(at(5_001))), ready("b", Some(at(5_001)))],
        "a mark went by another worker's threshold"
    );
}

#[test]
fn the_attempts_history_has_one_record_per_finished_run() {
    let mut store = MemoryStore::new(AppConfig::default());
    let first = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
    let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskTimeout), delay_ms: 1_000 };
    finish(&mut store, "a", first, retry, at(10));
    let p = policy(&store, 1);
    let second = lease(&claim_with(&mut store, "b", 3, &p, 0, at(1_010))[0]);
    // A released run writes no record, and the release spends no retry.
    assert_eq!(started(&start(&mut store, "b", vec![second], &p, at(1_011))), vec![(1, 2)]);
    let release = DbRequest::Release { worker: w("b"), tasks: vec![second] };
    assert_eq!(store.apply(&release, at(1_012)), DbReply::Released { released: vec![first.task], lost: vec![] });
    let third = lease(&claim_with(&mut store, "c", 4, &p, 1, at(1_013))[0]);
    finish(&mut store, "c", third, FinishOutcome::Completed(json!("done")), at(1_020));
    let history = store.attempts(first.task);
    type Shape = (u32, Option<WorkerId>, TaskState, Option<ErrorCode>, DbTime);
    let shape: Vec<Shape> = history
        .into_iter()
        .map(|r| (r.attempt.0, r.worker, r.outcome, r.error.map(|e| e.code), r.finished_at))
        .collect();
    assert_eq!(
        shape,
        vec![
            (1, Some(w("a")), TaskState::Pending, Some(ErrorCode::TaskTimeout), at(10)),
            (3, Some(w("c")), TaskState::Completed, None, at(1_020)),
        ]
    );
    let record = store.get(first.task).unwrap();
    assert_eq!((record.state, record.attempts, record.retries, record.error), (TaskState::Completed, 3, 1, None));
    assert_eq!(store.attempts(TaskId(77)), vec![]);
}

#[test]
fn heartbeats_renew_young_claims_only_and_mark_the_worker_seen() {
    let mut store = MemoryStore::new(AppConfig::default());
    add(&mut store, NewTask::new("t", json!(null)));
    let held = lease(&claim(&mut store, "a", 1, T0)[0]);
    let beat = DbRequest::Heartbeat {
        worker: w("a"),
        claimed: vec![held],
        running: vec![],
        lease_ms: LEASE_MS,
        max_renew_age_ms: 50_000,
        abandoned: vec![],
    };
    assert_eq!(store.apply(&beat, at(50_000)), DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] });
    assert_eq!(store.task(held.task).unwrap().claim_expires_at, Some(at(110_000)));
    // Too old to renew: left to lapse, yet still held.
    assert_eq!(store.apply(&beat, at(50_001)), DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] });
    let row = store.task(held.task).unwrap();
    assert_eq!((row.claim_expires_at, row.heartbeat_at), (Some(at(110_000)), Some(at(50_000))));
    assert_eq!(
        store.workers(),
        vec![WorkerRecord {
            info: WorkerInfo { worker: w("a"), queues: vec![], concurrency: 0 },
            last_seen: at(50_001),
            stopped: false,
        }]
    );
    let info = WorkerInfo { worker: w("a"), queues: vec!["default".into()], concurrency: 4 };
    assert_eq!(store.apply(&DbRequest::RegisterWorker(info.clone()), at(100_002)), DbReply::Done);
    store.apply(&DbRequest::DeregisterWorker(w("a")), at(100_003));
    store.apply(&DbRequest::DeregisterWorker(w("nobody")), at(100_003));
    // A worker with no row (pruned) is recorded stopped: a beat of it that lands after its
    // deregistration (sent before it, or committing late) leaves it stopped.
    let gone = WorkerRecord {
        info: WorkerInfo { worker: w("nobody"), queues: vec![], concurrency: 0 },
        last_seen: at(100_004),
        stopped: true,
    };
    let late_beat = DbRequest::Heartbeat {
        worker: w("nobody"),
        claimed: vec![],
        running: vec![],
        lease_ms: LEASE_MS,
        max_renew_age_ms: 50_000,
        abandoned: vec![],
    };
    store.apply(&late_beat, at(100_004));
    assert_eq!(store.workers(), vec![WorkerRecord { info, last_seen: at(100_002), stopped: true }, gone]);
}

#[test]
fn inspection_lists_filters_and_counts() {
    let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
    for i in 0..3 {
        add(&mut store, NewTask::new("t", json!(i)).queue("a"));
        add(&mut store, NewTask::new("t", json!(i)).queue("b"));
    }
    store.cancel(TaskId(1), T0).unwrap();
    let filter = TaskFilter { queue: Some("a".into()), ..TaskFilter::default() };
    let listed: Vec<i64> = store.list(&filter).iter().map(|r| r.id.0).collect();
    assert_eq!(listed, vec![1, 3, 5]);
    let filter = TaskFilter { state: Some(TaskState::Pending), limit: Some(2), ..TaskFilter::default() };
    let listed: Vec<i64> = store.list(&filter).iter().map(|r| r.id.0).collect();
    assert_eq!(listed, vec![2, 3]);
    let counts = store.counts();
    assert_eq!(counts[&("a".to_owned(), TaskState::Pending)], 2);
    assert_eq!(counts[&("a".to_owned(), TaskState::Cancelled)], 1);
    assert_eq!(counts[&("b".to_owned(), TaskState::Pending)], 3);
    assert_eq!(counts.len(), 3);
    // Newest first, paged by the last id seen or by an offset, by name.
    add(&mut store, NewTask::new("other", json!(0)).queue("a"));
    let page = |filter: TaskFilter| -> Vec<i64> { store.list(&filter).iter().map(|r| r.id.0).collect() };
    let newest = TaskFilter { newest_first: true, limit: Some(3), ..TaskFilter::default() };
    assert_eq!(page(newest.clone()), vec![7, 6, 5]);
    assert_eq!(page(TaskFilter { after: Some(TaskId(5)), ..newest.clone() }), vec![4, 3, 2]);
    assert_eq!(page(TaskFilter { offset: 5, ..newest.clone() }), vec![2, 1]);
    assert_eq!(page(TaskFilter { after: Some(TaskId(5)), ..TaskFilter::default() }), vec![6, 7]);
    assert_eq!(page(TaskFilter { name: Some("other".into()), ..TaskFilter::default() }), vec![7]);
}

// ---------------------------------------------------------------------------------------------
// Workflows
// ---------------------------------------------------------------------------------------------

use crate::workflow::{EdgePolicy, Join, StepId, WorkflowStatus};

fn state_of(store: &MemoryStore, id: TaskId) -> TaskState {
    store.task(id).expect("the step's row").state
}

/// A diamond `a -> (b, c) -> d`, with `d`'s edge from `c` as given.
fn diamond(store: &mut MemoryStore, c_to_d: EdgePolicy) -> SubmittedWorkflow {
    let mut workflow = NewWorkflow::new("diamond");
    let step =
        |workflow: &mut NewWorkflow, name: &str| workflow.step(NewTask::new(name, json!({"step": name})), Join::All);
    let (a, b, c, d) =
        (step(&mut workflow, "a"), step(&mut workflow, "b"), step(&mut workflow, "c"), step(&mut workflow, "d"));
    workflow.edge(a, b, EdgePolicy::RequireSuccess);
    workflow.edge(a, c, EdgePolicy::RequireSuccess);
    workflow.edge(b, d, EdgePolicy::RequireSuccess);
    workflow.edge(c, d, c_to_d);
    store.submit_workflow(workflow, T0).expect("submit")
}

/// Claims, starts and finishes the one claimable task, which must be `expected`.
fn run_one(store: &mut MemoryStore, expected: TaskId, outcome: FinishOutcome, now: DbTime) {
    let claimed = claim_n(store, "w", 1, 1, 1, now);
    assert_eq!(ids(&claimed), vec![expected.0], "the one claimable step");
    assert!(matches!(finish(store, "w", lease(&claimed[0]), outcome, now), DbReply::Finished { .. }));
}

#[test]
fn a_workflow_promotes_each_step_when_its_parents_complete() {
    let mut store = MemoryStore::new(AppConfig::default());
    let submitted = diamond(&mut store, EdgePolicy::RequireSuccess);
    let [a, b, c, d] = submitted.tasks[..] else { panic!("four steps") };
    assert_eq!(submitted.tasks, vec![TaskId(1), TaskId(2), TaskId(3), TaskId(4)]);
    let states = |store: &MemoryStore| [a, b, c, d].map(|id| state_of(store, id));
    use TaskState::{Completed, Pending, Waiting};
    assert_eq!(states(&store), [Pending, Waiting, Waiting, Waiting]);
    // One notification for the root's queue; a waiting step is never claimed.
    assert_eq!(
        store.take_notifications(),
        vec![Notification::TaskReady { queue: "default".into(), priority: Some(0), run_at: None }]
    );
    run_one(&mut store, a, FinishOutcome::Completed(json!(1)), at(1));
    assert_eq!(states(&store), [Completed, Pending, Pending, Waiting]);
    let notified = store.take_notifications();
    assert_eq!(notified.iter().filter(|n| matches!(n, Notification::TaskReady { .. })).count(), 1, "{notified:?}");
    run_one_of(&mut store, &[b, c], at(2));
    assert_eq!(state_of(&store, d), Waiting, "d waits for both parents");
    run_one_of(&mut store, &[b, c], at(3));
    run_one(&mut store, d, FinishOutcome::Completed(json!(4)), at(4));
    let record = store.workflow(submitted.workflow).expect("the workflow");
    assert_eq!(record.status, WorkflowStatus::Completed);
    assert_eq!(record.steps, [(Completed, 4)].into_iter().collect());
    // A promoted step's run-at is when it became claimable, not when it was submitted.
    assert_eq!(store.task(d).unwrap().run_at, at(3));
}

/// Claims one of `choices` and completes it.
fn run_one_of(store: &mut MemoryStore, choices: &[TaskId], now: DbTime) {
    let claimed = claim_n(store, "w", 1, 1, 1, now);
    assert!(claimed.len() == 1 && choices.contains(&claimed[0].id), "{claimed:?}");
    finish(store, "w", lease(&claimed[0]), FinishOutcome::Completed(json!(null)), now);
}

#[test]
fn a_failed_step_skips_what_needs_it_and_an_allow_failed_edge_runs_on() {
    let mut store = MemoryStore::new(AppConfig::default());
    let required = diamond(&mut store, EdgePolicy::RequireSuccess);
    let [a, b, c, d] = required.tasks[..] else { panic!("four steps") };
    run_one(&mut store, a, FinishOutcome::Completed(json!(1)), at(1));
    let claimed = claim_n(&mut store, "w", 1, 2, 2, at(2));
    let c_lease = claimed.iter().find(|t| t.id == c).map(lease).expect("c claimed");
    let failure = TaskError::new(ErrorCode::TaskError, "no");
    finish(&mut store, "w", c_lease, FinishOutcome::Failed(failure.clone()), at(2));
    // d needs c's success: skipped at once, though b still runs.
    assert_eq!((state_of(&store, c), state_of(&store, d)), (TaskState::Failed, TaskState::Skipped));
    assert_eq!(state_of(&store, b), TaskState::Running);
    assert!(store.task(d).unwrap().finished_at == Some(at(2)));
    let b_lease = claimed.iter().find(|t| t.id == b).map(lease).expect("b claimed");
    finish(&mut store, "w", b_lease, FinishOutcome::Completed(json!(2)), at(3));
    let record = store.workflow(required.workflow).unwrap();
    assert_eq!(record.status, WorkflowStatus::Failed, "its sink was skipped");

    // With an allow_failed edge from c, d runs after c failed.
    let allowing = diamond(&mut store, EdgePolicy::AllowFailed);
    let [a, b, c, d] = allowing.tasks[..] else { panic!("four steps") };
    run_one(&mut store, a, FinishOutcome::Completed(json!(1)), at(4));
    store.admin(&AdminRequest::Fail { task: c, message: "by hand".into() }, at(5)).unwrap();
    run_one(&mut store, b, FinishOutcome::Completed(json!(2)), at(6));
    run_one(&mut store, d, FinishOutcome::Completed(json!(3)), at(7));
    assert_eq!(store.workflow(allowing.workflow).unwrap().status, WorkflowStatus::Completed);
}

#[test]
fn skips_cascade_down_a_chain_in_one_request() {
    let mut store = MemoryStore::new(AppConfig::default());
    let mut workflow = NewWorkflow::new("chain");
    let steps: Vec<StepId> = (0..50).map(|i| workflow.step(NewTask::new("t", json!(i)), Join::All)).collect();
    for pair in steps.windows(2) {
        workflow.edge(pair[0], pair[1], EdgePolicy::RequireSuccess);
    }
    let submitted = store.submit_workflow(workflow, T0).unwrap();
    store.admin(&AdminRequest::Cancel { task: submitted.tasks[0] }, at(1)).unwrap();
    assert!(submitted.tasks[1..].iter().all(|id| state_of(&store, *id) == TaskState::Skipped));
    let record = store.workflow(submitted.workflow).unwrap();
    assert_eq!((record.status, record.steps.get(&TaskState::Skipped)), (WorkflowStatus::Failed, Some(&49)));
}

#[test]
fn a_paused_workflow_holds_its_decisions_and_a_cancel_ends_it() {
    let mut store = MemoryStore::new(AppConfig::default());
    let submitted = diamond(&mut store, EdgePolicy::RequireSuccess);
    let [a, b, c, d] = submitted.tasks[..] else { panic!("four steps") };
    assert_eq!(store.pause_workflow(submitted.workflow), Ok(WorkflowStatus::Paused));
    // The root was Pending already: it runs; its children wait for the resume.
    run_one(&mut store, a, FinishOutcome::Completed(json!(1)), at(1));
    assert_eq!((state_of(&store, b), state_of(&store, c)), (TaskState::Waiting, TaskState::Waiting));
    store.take_notifications();
    assert_eq!(store.resume_workflow(submitted.workflow, at(2)), Ok(WorkflowStatus::Running));
    assert_eq!((state_of(&store, b), state_of(&store, c)), (TaskState::Pending, TaskState::Pending));
    assert_eq!(store.take_notifications().len(), 1, "one notification per queue");

    // Cancel: pending, waiting and running steps cancelled (the running one's worker finds
    // its lease gone); nothing after.
    let claimed = claim_n(&mut store, "w", 1, 1, 1, at(3));
    assert_eq!(state_of(&store, claimed[0].id), TaskState::Running);
    assert_eq!(store.cancel_workflow(submitted.workflow, at(4)), Ok(WorkflowStatus::Cancelled));
    let (running, other) = if claimed[0].id == b { (b, c) } else { (c, b) };
    assert_eq!((state_of(&store, running), state_of(&store, other)), (TaskState::Cancelled, TaskState::Cancelled));
    for step in [running, other] {
        let message = store.task(step).unwrap().error.as_ref().map(|e| e.message.clone());
        assert_eq!(message.as_deref(), Some(CANCELLED_WITH_WORKFLOW));
    }
    assert_eq!(state_of(&store, d), TaskState::Cancelled);
    // The worker's late finish is lost: the cancel stands.
    finish(&mut store, "w", lease(&claimed[0]), FinishOutcome::Completed(json!(2)), at(5));
    assert_eq!(state_of(&store, running), TaskState::Cancelled);
    assert_eq!(store.workflow(submitted.workflow).unwrap().status, WorkflowStatus::Cancelled);
    assert!(matches!(store.pause_workflow(submitted.workflow), Err(WorkflowActionError::Refused { .. })));
    assert_eq!(store.resume_workflow(WorkflowId(99), at(6)), Err(WorkflowActionError::NotFound(WorkflowId(99))));
}

#[test]
fn a_workflow_is_checked_whole_before_anything_is_written() {
    let mut store = MemoryStore::new(AppConfig::default());
    let mut cyclic = NewWorkflow::new("cycle");
    let (x, y) =
        (cyclic.step(NewTask::new("t", json!(1)), Join::All), cyclic.step(NewTask::new("t", json!(2)), Join::All));
    cyclic.edge(x, y, EdgePolicy::RequireSuccess);
    cyclic.edge(y, x, EdgePolicy::RequireSuccess);
    assert!(matches!(store.submit_workflow(cyclic, T0), Err(SubmitError::Graph(_))));
    let mut keyed = NewWorkflow::new("keyed");
    keyed.step(NewTask::new("t", json!(1)), Join::All);
    keyed.step(NewTask::new("t", json!(1)).key("k"), Join::All);
    assert_eq!(store.submit_workflow(keyed, T0), Err(SubmitError::StepKey(StepId(1))));
    let mut bad_queue = NewWorkflow::new("queue");
    bad_queue.step(NewTask::new("t", json!(1)).queue("nowhere"), Join::All);
    assert!(matches!(store.submit_workflow(bad_queue, T0), Err(SubmitError::Step { step: StepId(0), .. })));
    assert!(matches!(store.submit_workflow(NewWorkflow::new(""), T0), Err(SubmitError::InvalidName(_))));
    assert_eq!(store.tasks().count(), 0, "nothing written");
}
