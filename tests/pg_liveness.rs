//! Liveness tokens against PostgreSQL (issue 19, items 4 and 5): a worker's session lock, which
//! the server releases when the session ends, lets any worker recover a dead worker's tasks at
//! once; a live session's token is never taken; a token of another server incarnation counts
//! for nothing; a crashed run is re-run `recovery.crash_retries` times beyond its policy.

#[path = "common/pg.rs"]
mod pg;

use std::sync::Arc;
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, RetryPolicy, WorkerConfig};
use canter::postgres::PgStore;
use canter::store::{ClaimedTask, DbReply, DbRequest, NewTask, ReapReport};
use canter::task::{ErrorCode, TaskId, TaskState, WorkerId};
use pg::TestDb;
use serde_json::json;
use sqlx::{ConnectOptions, Connection, PgConnection};

fn w(name: &str) -> WorkerId {
    WorkerId(name.into())
}

/// A session of its own, as a worker's token keeper holds one.
async fn session(db: &TestDb) -> PgConnection {
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("database url");
    PgConnection::connect_with(&options.application_name(db.schema.name()).disable_statement_logging())
        .await
        .expect("connect")
}

/// Claims `n` tasks for `worker`, started at once (hard-cap mode) when `start`.
async fn claim(store: &PgStore, worker: &str, n: u32, start: bool) -> Vec<ClaimedTask> {
    let config = WorkerConfig { concurrency: n, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let request = DbRequest::Claim {
        worker: w(worker),
        token: 1,
        policy,
        my_running: 0,
        my_claimed: 0,
        start_now: if start { n } else { 0 },
        lease_ms: 60_000,
    };
    match store.execute(&request).await {
        Ok(DbReply::Claimed { tasks, .. }) => tasks,
        other => panic!("claim: {other:?}"),
    }
}

async fn reap_dead(store: &PgStore, grace_ms: u64) -> ReapReport {
    match store.execute(&DbRequest::ReapDead { worker: w("reaper"), grace_ms, entropy: 7 }).await {
        Ok(DbReply::Reaped(report)) => report,
        other => panic!("reap_dead: {other:?}"),
    }
}

fn ids(tasks: &[ClaimedTask]) -> Vec<TaskId> {
    tasks.iter().map(|t| t.id).collect()
}

async fn state(store: &PgStore, id: TaskId) -> (TaskState, u32, u32) {
    let record = store.get(id).await.expect("get").expect("the task");
    (record.state, record.attempts, record.retries)
}

async fn token_epoch(store: &PgStore, worker: &str) -> Option<bool> {
    let sql = format!("SELECT token_epoch IS NOT NULL FROM {}.workers WHERE id = $1", store.schema().quoted());
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(worker).fetch_optional(store.pool()).await.expect("read")
}

#[tokio::test]
async fn a_dead_sessions_worker_is_recovered_at_once_and_a_live_ones_never() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = db.store(app.clone(), 4).await;
    store.enqueue_many((0..4).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();

    // Two workers hold their tokens; each claims two tasks, "dead" starts its two.
    let mut alive = session(&db).await;
    let mut doomed = session(&db).await;
    assert!(store.take_token(&mut alive, &w("alive")).await.unwrap());
    assert!(store.take_token(&mut doomed, &w("dead")).await.unwrap());
    assert_eq!(token_epoch(&store, "dead").await, Some(true), "recorded in the registry");
    let kept = claim(&store, "alive", 2, true).await;
    let lost = claim(&store, "dead", 1, true).await;
    let buffered = claim(&store, "dead", 1, false).await;
    assert_eq!((kept.len(), lost.len(), buffered.len()), (2, 1, 1));
    // A second session cannot take a token that is held.
    let mut other = session(&db).await;
    assert!(!store.take_token(&mut other, &w("alive")).await.unwrap());

    // While both live, nobody is dead.
    assert_eq!(reap_dead(&store, 0).await, ReapReport::default());

    // "dead"'s session ends: with a grace, the first look only notes the free token.
    doomed.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reap_dead(&store, 60_000).await, ReapReport::default());
    // Past the grace its claim goes back and its run is re-run (the default policy does not
    // retry crashes; `crash_retries` does, at once).
    let report = reap_dead(&store, 0).await;
    assert_eq!(report.dead_workers, vec![w("dead")]);
    assert_eq!(report.requeued, ids(&buffered));
    assert_eq!(report.retried, ids(&lost));
    assert!(report.failed.is_empty());
    assert_eq!(state(&store, lost[0].id).await, (TaskState::Pending, 1, 1));
    assert_eq!(state(&store, buffered[0].id).await, (TaskState::Pending, 0, 0));
    let attempts = store.attempts(lost[0].id).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].error.as_ref().map(|e| e.code.clone()), Some(ErrorCode::WorkerCrashed));
    // The live worker's tasks are untouched, and the dead one's token is forgotten.
    for t in &kept {
        assert_eq!(state(&store, t.id).await.0, TaskState::Running);
    }
    assert_eq!(token_epoch(&store, "dead").await, Some(false));
    assert_eq!(reap_dead(&store, 0).await, ReapReport::default(), "recovered once");

    // The re-run is claimable at once.
    let again = claim(&store, "alive", 4, true).await;
    assert!(ids(&again).contains(&lost[0].id));
    drop(alive);
}

#[tokio::test]
async fn a_token_of_another_server_incarnation_counts_for_nothing_until_taken_again() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    store.enqueue(NewTask::new("job", json!(1))).await.unwrap();
    let mut token = session(&db).await;
    assert!(store.take_token(&mut token, &w("w")).await.unwrap());
    let run = claim(&store, "w", 1, true).await;
    // As after a restart: the recorded incarnation is not the server's, and no session holds it.
    let sql = format!("UPDATE {}.workers SET token_epoch = '2000-01-01' WHERE id = 'w'", db.schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(store.pool()).await.unwrap();
    token.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reap_dead(&store, 0).await, ReapReport::default(), "not a death: a restart");
    assert_eq!(state(&store, run[0].id).await.0, TaskState::Running);
    // The worker, alive, takes it again in this incarnation: covered again.
    let mut again = session(&db).await;
    assert!(store.take_token(&mut again, &w("w")).await.unwrap());
    assert_eq!(reap_dead(&store, 0).await, ReapReport::default());
    again.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reap_dead(&store, 0).await.retried, ids(&run));
}

#[tokio::test]
async fn a_token_taken_again_within_the_grace_costs_nothing() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    store.enqueue(NewTask::new("job", json!(1))).await.unwrap();
    let mut first = session(&db).await;
    assert!(store.take_token(&mut first, &w("w")).await.unwrap());
    let run = claim(&store, "w", 1, true).await;
    first.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reap_dead(&store, 60_000).await, ReapReport::default(), "noted free");
    // Its keeper reconnects within the grace: the note is cleared.
    let mut second = session(&db).await;
    assert!(store.take_token(&mut second, &w("w")).await.unwrap());
    let sql = format!("SELECT token_free_since IS NULL FROM {}.workers WHERE id = 'w'", db.schema.quoted());
    let cleared: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap();
    assert!(cleared);
    assert_eq!(reap_dead(&store, 0).await, ReapReport::default());
    assert_eq!(state(&store, run[0].id).await.0, TaskState::Running);
    drop(second);
}

/// Worker `name` takes its token, claims and starts up to `n` tasks, and dies; a reaper then
/// recovers them.
async fn run_and_die(db: &TestDb, store: &PgStore, name: &str, n: u32) -> (Vec<ClaimedTask>, ReapReport) {
    let mut token = session(db).await;
    assert!(store.take_token(&mut token, &w(name)).await.unwrap());
    let runs = claim(store, name, n, true).await;
    token.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    (runs, reap_dead(store, 0).await)
}

/// Seconds until task `id` is due.
async fn due_in(store: &PgStore, id: TaskId) -> f64 {
    let sql = format!(
        "SELECT extract(epoch FROM run_at - now())::float8 FROM {}.tasks WHERE id = $1",
        store.schema().quoted()
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(id.0).fetch_one(store.pool()).await.unwrap()
}

#[tokio::test]
async fn crashed_runs_are_rerun_up_to_crash_retries_then_fail_and_policies_that_retry_crashes_decide() {
    let db = TestDb::new().await;
    let mut app = AppConfig::default();
    app.recovery.crash_retries = 1;
    let store = db.store(app, 4).await;
    // No retry of its own; and a policy that retries a crash once, 30 s later.
    let plain = store.enqueue(NewTask::new("job", json!("plain"))).await.unwrap();
    let own = RetryPolicy { jitter: false, ..RetryPolicy::fixed(vec![30]) }.with_codes(vec![ErrorCode::WorkerCrashed]);
    let retrying = store.enqueue(NewTask::new("job", json!("own")).retry(own)).await.unwrap();

    let (runs, report) = run_and_die(&db, &store, "w0", 2).await;
    assert_eq!(ids(&runs), vec![plain, retrying]);
    assert_eq!(report.retried, vec![plain, retrying], "both run again");
    assert!(due_in(&store, plain).await <= 0.5, "a crash retry runs at once");
    assert!((29.0..=31.0).contains(&due_in(&store, retrying).await), "the policy's own retry waits its interval");

    // The crash retry is spent: the next crash fails it.
    let (runs, report) = run_and_die(&db, &store, "w1", 2).await;
    assert_eq!(ids(&runs), vec![plain], "the other waits out its interval");
    assert_eq!(report.failed, vec![plain]);
    assert_eq!(state(&store, plain).await, (TaskState::Failed, 2, 1));

    // The policy's retry is spent too (and the crash retries with it): it fails.
    let sql = format!("UPDATE {}.tasks SET run_at = now() WHERE id = $1", db.schema.quoted());
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(retrying.0).execute(store.pool()).await.unwrap();
    let (runs, report) = run_and_die(&db, &store, "w2", 2).await;
    assert_eq!(ids(&runs), vec![retrying]);
    assert_eq!(report.failed, vec![retrying]);
}

#[tokio::test]
async fn without_crash_retries_a_crashed_run_fails_as_in_the_seed_systems() {
    let db = TestDb::new().await;
    let mut app = AppConfig::default();
    app.recovery.crash_retries = 0;
    let store = db.store(app, 4).await;
    let id = store.enqueue(NewTask::new("job", json!(1))).await.unwrap();
    let mut token = session(&db).await;
    assert!(store.take_token(&mut token, &w("w")).await.unwrap());
    claim(&store, "w", 1, true).await;
    token.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reap_dead(&store, 0).await.failed, vec![id]);
    let record = store.get(id).await.unwrap().unwrap();
    assert_eq!(record.state, TaskState::Failed);
    assert_eq!(record.error.map(|e| e.code), Some(ErrorCode::WorkerCrashed));
}

#[tokio::test]
async fn two_reapers_at_once_recover_a_dead_worker_once() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 8).await;
    store.enqueue_many((0..20).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    let mut token = session(&db).await;
    assert!(store.take_token(&mut token, &w("w")).await.unwrap());
    let runs = claim(&store, "w", 20, true).await;
    token.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (a, b) = tokio::join!(reap_dead(&store, 0), reap_dead(&store, 0));
    let mut retried: Vec<TaskId> = a.retried.iter().chain(&b.retried).copied().collect();
    retried.sort_unstable();
    assert_eq!(retried, ids(&runs), "each run once: {a:?} {b:?}");
    assert_eq!(a.dead_workers.len() + b.dead_workers.len(), 1);
}
