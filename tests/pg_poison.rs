//! Issue 18 on real PostgreSQL: poison values (U+0000 in outcomes, stored rows no decoder
//! reads), claims that commit after their client gave up, rows other transactions hold locked,
//! and locks anyone who can connect could take. Each test drives [`PgStore::execute`] with the
//! worker machine's requests; a second connection plays the other transaction.

#[path = "common/pg.rs"]
mod pg;

use std::sync::Arc;
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, CustomQueue, QueueMode, RetryPolicy, WorkerConfig};
use canter::postgres::{PgSchema, PgStore, claim_lock_keys, with_session_settings};
use canter::store::TaskFilter;
use canter::store::{ClaimedTask, Completion, DbFailure, DbReply, DbRequest, FinishOutcome, NewTask};
use canter::task::{Attempt, ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
use pg::{TestDb, dead_rows};
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::time::Instant;

/// `sql` with `{s}` naming the test's schema.
fn on(schema: &PgSchema, sql: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(sql.replace("{s}", schema.quoted()))
}

/// The test's connect options: tagged with the schema, so cleanup ends these sessions too.
fn options(db: &TestDb) -> PgConnectOptions {
    let options: PgConnectOptions = db.url.parse().expect("database url");
    options.application_name(db.schema.name()).disable_statement_logging()
}

/// A pool whose sessions carry `SESSION_SETTINGS`, as the adapters' `connect()` makes them.
async fn session_pool(db: &TestDb, size: u32) -> PgPool {
    let options = with_session_settings(options(db));
    canter::postgres::pool_options(&options)
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("connect")
}

/// A session of another application (no timeouts), to hold locks with.
async fn other_session(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&options(db)).await.expect("connect")
}

fn worker() -> WorkerId {
    WorkerId("w".into())
}

fn policy(app: &AppConfig, concurrency: u32) -> Arc<ClaimPolicy> {
    Arc::new(ClaimPolicy::from_config(app, &WorkerConfig { concurrency, ..WorkerConfig::default() }))
}

fn claim(token: u64, policy: &Arc<ClaimPolicy>, start_now: u32) -> DbRequest {
    pg::claim_by_w(token, policy, start_now)
}

async fn claimed(store: &PgStore, request: &DbRequest) -> Vec<ClaimedTask> {
    match store.execute(request).await {
        Ok(DbReply::Claimed { tasks, .. }) => tasks,
        other => panic!("a claim failed: {other:?}"),
    }
}

fn leases(tasks: &[ClaimedTask]) -> Vec<TaskLease> {
    tasks.iter().map(|t| TaskLease { task: t.id, lease: t.lease }).collect()
}

fn heartbeat(running: Vec<TaskLease>, abandoned: Vec<u64>) -> DbRequest {
    DbRequest::Heartbeat {
        worker: worker(),
        claimed: vec![],
        running,
        lease_ms: 60_000,
        max_renew_age_ms: 60_000,
        abandoned,
    }
}

fn finish(tasks: &[ClaimedTask], outcome: impl Fn(&ClaimedTask) -> FinishOutcome) -> DbRequest {
    let completions = tasks
        .iter()
        .map(|t| Completion { task: TaskLease { task: t.id, lease: t.lease }, outcome: outcome(t), args: None })
        .collect();
    DbRequest::Finish { worker: worker(), completions }
}

/// A task's live row: state, attempts, holder.
async fn live_row(pool: &PgPool, schema: &PgSchema, id: TaskId) -> (String, i32, Option<String>) {
    sqlx::query_as(on(schema, "SELECT state, attempts, claimed_by FROM {s}.tasks WHERE id = $1"))
        .bind(id.0)
        .fetch_one(pool)
        .await
        .expect("the live row")
}

fn ids(tasks: &[ClaimedTask]) -> Vec<TaskId> {
    tasks.iter().map(|t| t.id).collect()
}

/// Item 1: a FINISH carrying U+0000 (a result, an error message) is refused by `jsonb` as a
/// value (SQLSTATE class 22): `Invalid`, which the worker splits on, and nothing is applied.
#[tokio::test]
async fn a_finish_carrying_u0000_is_refused_as_invalid_and_applies_nothing() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    store.enqueue_many((0..3).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    let app = AppConfig::default();
    let tasks = claimed(&store, &claim(1, &policy(&app, 3), 3)).await;
    assert_eq!(tasks.len(), 3);
    let nul_result = finish(&tasks, |t| match t.id == tasks[1].id {
        true => FinishOutcome::Completed(json!({"from_c": "abc\u{0}def"})),
        false => FinishOutcome::Completed(json!("fine")),
    });
    let nul_message = finish(&tasks, |t| match t.id == tasks[2].id {
        true => FinishOutcome::Failed(TaskError::new(ErrorCode::User("BAD".into()), "nul \0 in the message")),
        false => FinishOutcome::Completed(json!("fine")),
    });
    for request in [nul_result, nul_message] {
        let refused = store.execute(&request).await;
        assert!(matches!(refused, Err(DbFailure::Invalid(_))), "{refused:?}");
        for task in &tasks {
            let (state, attempts, holder) = live_row(store.pool(), &db.schema, task.id).await;
            assert_eq!((state.as_str(), attempts, holder.as_deref()), ("RUNNING", 1, Some("w")), "nothing applied");
        }
    }
    let clean = finish(&tasks, |_| FinishOutcome::Completed(json!("fine")));
    match store.execute(&clean).await {
        Ok(DbReply::Finished { applied, lost }) => assert_eq!((applied.len(), lost.len()), (3, 0)),
        other => panic!("{other:?}"),
    }
}

/// Enqueues `name` tasks and rewrites their stored values by SQL, as a producer that writes the
/// jsonb itself may: returns the ids in order.
async fn poison_rows(store: &PgStore, schema: &PgSchema) -> Poison {
    let newer = RetryPolicy::fixed(vec![1, 2]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    let tasks = vec![
        NewTask::new("job", json!({"n": 1})),
        NewTask::new("job", json!({"n": 2})),
        NewTask::new("job", json!({"n": 3})),
        NewTask::new("job", json!({"n": 4})).retry(newer.clone()),
        NewTask::new("job", json!({"n": 5})).retry(newer.clone()),
        NewTask::new("job", json!({"n": 6})),
    ];
    let ids = store.enqueue_many(tasks).await.unwrap();
    let pool = store.pool();
    let set = |sql: &'static str, id: TaskId| {
        let sql = on(schema, sql);
        async move { sqlx::query(sql).bind(id.0).execute(pool).await.expect("rewrite a row") }
    };
    set("UPDATE {s}.tasks SET args = (repeat('[', 200) || repeat(']', 200))::jsonb WHERE id = $1", ids[1]).await;
    set("UPDATE {s}.tasks SET args = '{\"n\": 1e400}'::jsonb WHERE id = $1", ids[2]).await;
    set("UPDATE {s}.tasks SET retry = retry || '{\"from_a_newer_client\": true}'::jsonb WHERE id = $1", ids[3]).await;
    set("UPDATE {s}.tasks SET retry = jsonb_set(retry, '{max_retries}', '999') WHERE id = $1", ids[4]).await;
    Poison { healthy: [ids[0], ids[5]], deep: ids[1], huge: ids[2], newer_policy: ids[3], bad_policy: ids[4], newer }
}

struct Poison {
    healthy: [TaskId; 2],
    /// Args nested 200 deep.
    deep: TaskId,
    /// Args holding 1e400.
    huge: TaskId,
    /// A valid retry policy with a field this version does not know.
    newer_policy: TaskId,
    /// A retry policy that breaks a rule (max_retries 999).
    bad_policy: TaskId,
    /// The policy the last two were enqueued with.
    newer: RetryPolicy,
}

/// Item 2: a claim over rows no decoder reads returns every row; the poison carries
/// `args_error` (the worker fails it alone), a policy with an unknown field applies, an
/// invalid one falls back to the app's with `retry_error`.
#[tokio::test]
async fn a_claim_over_undecodable_rows_returns_every_row_and_marks_the_poison() {
    let db = TestDb::new().await;
    let app = AppConfig { retry: RetryPolicy::fixed(vec![7]), ..AppConfig::default() };
    let store = db.store(app.clone(), 2).await;
    let poison = poison_rows(&store, &db.schema).await;
    let tasks = claimed(&store, &claim(1, &policy(&app, 10), 10)).await;
    assert_eq!(tasks.len(), 6, "every row claimed: {:?}", ids(&tasks));
    let by_id = |id: TaskId| tasks.iter().find(|t| t.id == id).expect("claimed");
    for id in poison.healthy {
        let task = by_id(id);
        assert!(task.args.is_object() && task.args_error.is_none() && task.retry_error.is_none(), "{task:?}");
        assert_eq!(task.retry, app.retry, "no policy of its own: the app's");
    }
    for id in [poison.deep, poison.huge] {
        let task = by_id(id);
        assert_eq!(task.args, Value::Null, "{task:?}");
        assert!(task.args_error.as_ref().is_some_and(|e| !e.is_empty()), "{task:?}");
        assert!(task.started && task.attempt == Attempt(1), "{task:?}");
    }
    let newer = by_id(poison.newer_policy);
    assert_eq!((newer.retry.clone(), newer.retry_error.clone()), (poison.newer.clone(), None), "tolerated");
    let bad = by_id(poison.bad_policy);
    assert_eq!(bad.retry, app.retry, "the app's policy applies");
    assert!(bad.retry_error.as_ref().is_some_and(|e| e.contains("max_retries")), "{bad:?}");
    assert!(bad.args_error.is_none());
}

/// Item 2, inspection: `list` and `get` (what `canter list` and `canter show` print) of a
/// queue holding a row whose args no decoder reads still answer, for that row and the others.
#[tokio::test]
async fn inspection_answers_for_rows_whose_args_cannot_be_read() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let poison = poison_rows(&store, &db.schema).await;
    let mut problems = Vec::new();
    match store.list(&TaskFilter::default()).await {
        Ok(listed) => assert_eq!(listed.len(), 6),
        Err(e) => problems.push(format!("list: {e}")),
    }
    for id in [poison.deep, poison.huge] {
        match store.get(id).await {
            Ok(record) => assert_eq!(record.map(|r| r.state), Some(TaskState::Pending)),
            Err(e) => problems.push(format!("get {id}: {e}")),
        }
    }
    assert!(problems.is_empty(), "one unreadable row fails inspection: {problems:#?}");
}

/// Item 2, recovery: a stale run whose stored retry policy no decoder reads is reaped like
/// any other (under no retries), and the reaper's pass goes on for the other rows.
#[tokio::test]
async fn a_stale_run_whose_stored_policy_cannot_be_read_does_not_stop_the_reaper() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = db.store(app.clone(), 2).await;
    store.enqueue_many((0..2).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    let tasks = claimed(&store, &claim(1, &policy(&app, 2), 2)).await;
    let sql = "UPDATE {s}.tasks SET heartbeat_at = heartbeat_at - interval '1 hour', \
               retry = CASE WHEN id = $1 THEN (repeat('[', 200) || repeat(']', 200))::jsonb END";
    sqlx::query(on(&db.schema, sql)).bind(tasks[0].id.0).execute(store.pool()).await.unwrap();
    let reap = DbRequest::Reap { worker: worker(), claimed_stale_ms: None, running_stale_ms: Some(60_000), entropy: 1 };
    let report = match store.execute(&reap).await {
        Ok(DbReply::Reaped(report)) => report,
        other => panic!("one unreadable policy fails the whole reaper pass: {other:?}"),
    };
    let mut reaped = [report.failed, report.retried].concat();
    reaped.sort();
    assert_eq!(reaped, ids(&tasks));
}

fn capped_app() -> AppConfig {
    AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue::new("capped").with_max_concurrency(10)],
        ..AppConfig::default()
    }
}

/// Creates the `claim_locks` rows of `keys` and locks them in a transaction of `conn`.
async fn hold_claim_locks(conn: &mut PgConnection, schema: &PgSchema, keys: &[i64]) {
    let create = "INSERT INTO {s}.claim_locks (key) SELECT unnest($1::bigint[]) ON CONFLICT DO NOTHING";
    sqlx::query(on(schema, create)).bind(keys).execute(&mut *conn).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe("BEGIN")).execute(&mut *conn).await.unwrap();
    let lock = "SELECT key FROM {s}.claim_locks WHERE key = ANY ($1) ORDER BY key FOR UPDATE";
    let held: Vec<i64> = sqlx::query_scalar(on(schema, lock)).bind(keys).fetch_all(&mut *conn).await.unwrap();
    assert_eq!(held.len(), keys.len());
}

async fn rollback(conn: &mut PgConnection) {
    sqlx::raw_sql(sqlx::AssertSqlSafe("ROLLBACK")).execute(&mut *conn).await.unwrap();
}

/// Milliseconds on the server's clock, now.
async fn server_ms(pool: &PgPool, schema: &PgSchema) -> i64 {
    sqlx::query_scalar(on(schema, "SELECT {s}.ms(clock_timestamp())")).fetch_one(pool).await.unwrap()
}

/// Item 3: a capped hard-mode claim waits on a `claim_locks` row another session holds; its
/// client gives up and abandons it (finding nothing); the lock goes and the claim commits
/// late. Its tasks are dated after the wait (not from the transaction's start, which made the
/// reaper fail them at once), and the next heartbeat carrying the abandoned token hands them
/// back, with the attempt the claim counted given back.
#[tokio::test]
async fn a_claim_that_commits_after_its_client_gave_up_is_handed_back_by_the_next_heartbeat() {
    let db = TestDb::new().await;
    let app = capped_app();
    let store = db.store(app.clone(), 4).await;
    let enqueued = store.enqueue_many((0..2).map(|i| NewTask::new("job", json!(i)).queue("capped")).collect()).await;
    let mut enqueued = enqueued.unwrap();
    enqueued.sort();
    let policy = policy(&app, 4);
    let keys = claim_lock_keys(&db.schema, &policy);
    assert_eq!(keys.len(), 1, "a capped queue's claims lock its row");
    let mut other = other_session(&db).await;
    hold_claim_locks(&mut other, &db.schema, &keys).await;

    let token = 77;
    let gave_up = tokio::time::timeout(Duration::from_millis(500), store.execute(&claim(token, &policy, 4))).await;
    assert!(gave_up.is_err(), "the claim waited for the lock: {gave_up:?}");
    let abandon = DbRequest::AbandonClaim { worker: worker(), token };
    let abandoned = tokio::time::timeout(Duration::from_secs(5), store.execute(&abandon)).await;
    assert_eq!(
        abandoned.expect("the abandon waits for nothing"),
        Ok(DbReply::Released { released: vec![], lost: vec![] })
    );
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let released_at = server_ms(store.pool(), &db.schema).await;
    rollback(&mut other).await;

    // The statement the client dropped still runs on the server, and commits.
    let late = "SELECT {s}.ms(heartbeat_at), {s}.ms(started_at), {s}.ms(claimed_at), attempts \
                FROM {s}.tasks WHERE claim_token = $1 AND state = 'RUNNING' ORDER BY id";
    let deadline = Instant::now() + Duration::from_secs(10);
    let rows: Vec<(i64, i64, i64, i32)> = loop {
        let rows = sqlx::query_as(on(&db.schema, late)).bind(token as i64).fetch_all(store.pool()).await.unwrap();
        if rows.len() == 2 {
            break rows;
        }
        assert!(Instant::now() < deadline, "the late claim did not commit: {rows:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for (heartbeat_at, started_at, claimed_at, attempts) in rows {
        assert!(
            heartbeat_at >= released_at,
            "heartbeat_at {heartbeat_at} is from before the lock wait ended at {released_at}"
        );
        assert!(started_at >= released_at && claimed_at >= released_at, "{started_at} {claimed_at} < {released_at}");
        assert_eq!(attempts, 1);
    }

    let beat = store.execute(&heartbeat(vec![], vec![token])).await;
    assert_eq!(beat, Ok(DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: enqueued.clone() }));
    for id in enqueued {
        let (state, attempts, holder) = live_row(store.pool(), &db.schema, id).await;
        assert_eq!((state.as_str(), attempts, holder), ("PENDING", 0, None), "handed back, its attempt given back");
    }
    // Once handed back, the token finds nothing more.
    let again = store.execute(&heartbeat(vec![], vec![token])).await;
    assert_eq!(again, Ok(DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] }));
}

/// Item 3: with `SESSION_SETTINGS` a claim stuck behind a lock gives up after `lock_timeout`
/// (5 s) with `LockTimeout`, instead of waiting as long as the other transaction lasts.
#[tokio::test]
async fn with_session_settings_a_claim_stuck_behind_a_lock_gives_up_after_the_lock_timeout() {
    let db = TestDb::new().await;
    let app = capped_app();
    let store = PgStore::new(session_pool(&db, 2).await, db.schema.clone(), app.clone());
    store.enqueue(NewTask::new("job", json!(1)).queue("capped")).await.unwrap();
    let policy = policy(&app, 4);
    let mut other = other_session(&db).await;
    hold_claim_locks(&mut other, &db.schema, &claim_lock_keys(&db.schema, &policy)).await;
    let began = Instant::now();
    let stuck = tokio::time::timeout(Duration::from_secs(15), store.execute(&claim(1, &policy, 4))).await;
    let waited = began.elapsed();
    let stuck = stuck.unwrap_or_else(|_| panic!("the claim waited {waited:?} for the lock, without a bound"));
    assert!(matches!(stuck, Err(DbFailure::LockTimeout(_))), "{stuck:?}");
    assert!(waited >= Duration::from_secs(4) && waited < Duration::from_secs(10), "{waited:?}");
    rollback(&mut other).await;
    assert_eq!(claimed(&store, &claim(2, &policy, 4)).await.len(), 1, "the lock gone, the claim goes through");
}

/// Item 4: another transaction holds one of a worker's running rows. The heartbeat for its
/// three tasks returns at once, that row busy (not lost) and the others renewed; a finish of
/// the three gives up after `lock_timeout` with `LockTimeout` (the worker then splits it),
/// applying nothing.
#[tokio::test]
async fn a_row_another_transaction_holds_neither_stalls_a_heartbeat_nor_a_finish_for_long() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = db.store(app.clone(), 2).await;
    store.enqueue_many((0..3).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    let tasks = claimed(&store, &claim(1, &policy(&app, 3), 3)).await;
    assert_eq!(tasks.len(), 3);
    let backdate = "UPDATE {s}.tasks SET heartbeat_at = heartbeat_at - interval '1 minute'";
    sqlx::query(on(&db.schema, backdate)).execute(store.pool()).await.unwrap();
    let held = tasks[1].id;
    let mut other = other_session(&db).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe("BEGIN")).execute(&mut other).await.unwrap();
    let lock = "SELECT id FROM {s}.tasks WHERE id = $1 FOR UPDATE";
    sqlx::query(on(&db.schema, lock)).bind(held.0).execute(&mut other).await.unwrap();

    let beat = tokio::time::timeout(Duration::from_secs(3), store.execute(&heartbeat(leases(&tasks), vec![]))).await;
    let beat = beat.expect("the heartbeat waited for the locked row");
    assert_eq!(beat, Ok(DbReply::Heartbeat { lost: vec![], busy: vec![held], handed_back: vec![] }));
    let fresh = "SELECT id, heartbeat_at > clock_timestamp() - interval '10 seconds' FROM {s}.tasks ORDER BY id";
    let fresh: Vec<(i64, bool)> = sqlx::query_as(on(&db.schema, fresh)).fetch_all(store.pool()).await.unwrap();
    let expected: Vec<(i64, bool)> = tasks.iter().map(|t| (t.id.0, t.id != held)).collect();
    assert_eq!(fresh, expected, "the others renewed, the held row left alone");

    let bounded = PgStore::new(session_pool(&db, 2).await, db.schema.clone(), app);
    let all = finish(&tasks, |t| FinishOutcome::Completed(json!(t.id.0)));
    let began = Instant::now();
    let stuck = tokio::time::timeout(Duration::from_secs(15), bounded.execute(&all)).await;
    let waited = began.elapsed();
    let stuck = stuck.unwrap_or_else(|_| panic!("the finish waited {waited:?} for the row, without a bound"));
    assert!(matches!(stuck, Err(DbFailure::LockTimeout(_))), "{stuck:?}");
    assert!(waited >= Duration::from_secs(4) && waited < Duration::from_secs(10), "{waited:?}");
    for task in &tasks {
        assert_eq!(live_row(store.pool(), &db.schema, task.id).await.0, "RUNNING", "nothing applied");
    }
    rollback(&mut other).await;
    match bounded.execute(&all).await {
        Ok(DbReply::Finished { applied, lost }) => assert_eq!((applied.len(), lost.len()), (3, 0)),
        other => panic!("{other:?}"),
    }
}

/// Another transaction holds one of a worker's claimed rows and its registry row: a start of
/// its tasks defers that one at once (asked again later) and starts the others, and a
/// heartbeat returns at once; neither waits for the locks.
#[tokio::test]
async fn a_start_and_a_heartbeat_pass_the_rows_another_transaction_holds() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = PgStore::new(session_pool(&db, 2).await, db.schema.clone(), app.clone());
    store.enqueue_many((0..3).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    let policy = policy(&app, 3);
    let tasks = claimed(&store, &claim(1, &policy, 0)).await;
    assert_eq!(tasks.len(), 3);
    assert!(tasks.iter().all(|t| !t.started));
    assert!(store.execute(&heartbeat(vec![], vec![])).await.is_ok(), "the registry row exists");
    let held = tasks[1].id;
    let mut other = other_session(&db).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe("BEGIN")).execute(&mut other).await.unwrap();
    let lock = "SELECT id FROM {s}.tasks WHERE id = $1 FOR UPDATE";
    sqlx::query(on(&db.schema, lock)).bind(held.0).execute(&mut other).await.unwrap();
    let lock = "SELECT id FROM {s}.workers WHERE id = $1 FOR UPDATE";
    let locked = sqlx::query(on(&db.schema, lock)).bind(&worker().0).execute(&mut other).await.unwrap();
    assert_eq!(locked.rows_affected(), 1);

    // The held row named again under an older lease: that one is lost, not deferred.
    let mut asked = leases(&tasks);
    let stale = Lease(tasks[1].lease.0 - 1);
    asked.push(TaskLease { task: held, lease: stale });
    let start = DbRequest::Start { worker: worker(), tasks: asked, policy: Arc::clone(&policy) };
    let started = tokio::time::timeout(Duration::from_secs(3), store.execute(&start)).await;
    let started = started.expect("the start waited for the locked row");
    let others: Vec<(TaskId, Attempt)> = tasks.iter().filter(|t| t.id != held).map(|t| (t.id, Attempt(1))).collect();
    assert_eq!(
        started,
        Ok(DbReply::Started { started: others.clone(), expired: vec![], deferred: vec![held], lost: vec![held] })
    );
    assert_eq!(live_row(store.pool(), &db.schema, held).await.0, "CLAIMED");
    let running: Vec<TaskLease> =
        tasks.iter().filter(|t| t.id != held).map(|t| TaskLease { task: t.id, lease: t.lease }).collect();
    let beat = tokio::time::timeout(Duration::from_secs(3), store.execute(&heartbeat(running, vec![]))).await;
    let beat = beat.expect("the heartbeat waited for the registry row");
    assert_eq!(beat, Ok(DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] }));

    rollback(&mut other).await;
    let again = DbRequest::Start { worker: worker(), tasks: leases(&tasks[1..2]), policy };
    assert_eq!(
        store.execute(&again).await,
        Ok(DbReply::Started { started: vec![(held, Attempt(1))], expired: vec![], deferred: vec![], lost: vec![] })
    );
}

/// The SQLSTATE of a failed statement.
fn sqlstate(result: Result<impl std::fmt::Debug, sqlx::Error>) -> String {
    match result {
        Err(sqlx::Error::Database(e)) => e.code().map(|c| c.into_owned()).unwrap_or_default(),
        other => panic!("expected a database error, got {other:?}"),
    }
}

/// Item 5: a role that may connect and read (CONNECT, USAGE, SELECT) cannot lock the rows
/// Canter's claims and reaper lock; the advisory keys the old locks used it can hold, and they
/// no longer stall a capped claim (per queue or cluster-wide) or the reaper.
#[tokio::test]
async fn a_role_that_may_only_read_can_stall_neither_claims_nor_the_reaper() {
    let db = TestDb::new().await;
    let app = capped_app();
    let store = db.store(app.clone(), 2).await;
    store.enqueue_many((0..4).map(|i| NewTask::new("job", json!(i)).queue("capped")).collect()).await.unwrap();
    let reader_role = RoleGuard { url: db.url.clone(), name: format!("{}_reader", db.schema.name()) };
    let role = reader_role.name.clone();
    let grants = format!(
        "CREATE ROLE \"{role}\" NOLOGIN; GRANT USAGE ON SCHEMA {{s}} TO \"{role}\"; \
         GRANT SELECT ON ALL TABLES IN SCHEMA {{s}} TO \"{role}\""
    );
    sqlx::raw_sql(on(&db.schema, &grants)).execute(store.pool()).await.unwrap();
    let queue_key = db.schema.queue_lock_key("capped");
    let cluster_key = db.schema.cluster_lock_key();
    sqlx::query(on(&db.schema, "INSERT INTO {s}.claim_locks (key) VALUES ($1), ($2) ON CONFLICT DO NOTHING"))
        .bind(queue_key)
        .bind(cluster_key)
        .execute(store.pool())
        .await
        .unwrap();

    let mut reader = other_session(&db).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE \"{role}\""))).execute(&mut reader).await.unwrap();
    let reaper_lock = sqlx::query(on(&db.schema, "SELECT true FROM {s}.reaper_lock FOR UPDATE SKIP LOCKED"));
    assert_eq!(sqlstate(reaper_lock.execute(&mut reader).await), "42501");
    let claim_locks = sqlx::query(on(&db.schema, "SELECT key FROM {s}.claim_locks FOR UPDATE"));
    assert_eq!(sqlstate(claim_locks.execute(&mut reader).await), "42501");
    let take = sqlx::query(on(&db.schema, "SELECT {s}.take_claim_locks(ARRAY[$1]::bigint[])")).bind(queue_key);
    assert_eq!(sqlstate(take.execute(&mut reader).await), "42501");
    // What it can do: hold the advisory keys claims used to take.
    let advisory = sqlx::query("SELECT pg_advisory_lock($1), pg_advisory_lock($2)").bind(queue_key).bind(cluster_key);
    advisory.execute(&mut reader).await.expect("anyone may take advisory locks");

    let queue_capped = policy(&app, 2);
    let cluster_app = AppConfig { cluster_wide_cap: Some(10), ..capped_app() };
    let cluster_capped = policy(&cluster_app, 2);
    assert_eq!(claim_lock_keys(&db.schema, &queue_capped), vec![queue_key]);
    assert_eq!(claim_lock_keys(&db.schema, &cluster_capped), vec![cluster_key]);
    for (token, policy) in [(1, queue_capped), (2, cluster_capped)] {
        let bounded = tokio::time::timeout(Duration::from_secs(3), claimed(&store, &claim(token, &policy, 2))).await;
        assert_eq!(bounded.expect("a capped claim waited on a reader's advisory lock").len(), 2);
    }
    let reap = DbRequest::Reap { worker: worker(), claimed_stale_ms: Some(60_000), running_stale_ms: None, entropy: 1 };
    let reaped = tokio::time::timeout(Duration::from_secs(3), store.execute(&reap)).await.expect("the reaper waited");
    assert!(matches!(reaped, Ok(DbReply::Reaped(ref report)) if !report.skipped), "{reaped:?}");

    reader.close().await.unwrap();
    drop(reader_role);
}

/// Only a table's owner (or a superuser) may vacuum it, and PostgreSQL skips the other tables
/// with a warning, which would pass for a vacuum that removed nothing: a worker whose role has
/// only the README's grants does not try (issue 19: Canter's own vacuum).
#[tokio::test]
async fn a_worker_that_does_not_own_the_tables_leaves_their_vacuum_to_the_server() {
    let db = TestDb::new().await;
    let owner = db.store(AppConfig::default(), 2).await;
    let role = RoleGuard { url: db.url.clone(), name: format!("{}_dml", db.schema.name()) };
    let name = role.name.clone();
    let setup = format!(
        "CREATE ROLE \"{name}\" LOGIN PASSWORD 'canter'; GRANT USAGE ON SCHEMA {{s}} TO \"{name}\"; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {{s}} TO \"{name}\"; \
         ALTER TABLE {{s}}.tasks SET (autovacuum_enabled = off)"
    );
    sqlx::raw_sql(on(&db.schema, &setup)).execute(owner.pool()).await.unwrap();
    owner.enqueue_many((0..200).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    sqlx::raw_sql(on(&db.schema, "DELETE FROM {s}.tasks")).execute(owner.pool()).await.unwrap();
    dead_rows(&owner, "tasks", 200).await;

    let options = options(&db).username(&name).password("canter");
    let pool = canter::postgres::pool_options(&options).max_connections(1).connect_with(options).await.unwrap();
    let worker = PgStore::new(pool, db.schema.clone(), AppConfig::default());
    let vacuum = DbRequest::Vacuum { min_dead_rows: 100 };
    let reply = worker.execute(&vacuum).await.unwrap();
    assert_eq!(reply, DbReply::Vacuumed { tables: vec![] });
    match owner.execute(&vacuum).await.unwrap() {
        DbReply::Vacuumed { tables } => assert!(tables.iter().any(|t| t.table == "tasks"), "{tables:?}"),
        other => panic!("unexpected {other:?}"),
    }
    worker.pool().close().await;
    drop(role);
}

/// A role of a test's, dropped (with its privileges) when the test ends, failed or not.
struct RoleGuard {
    url: String,
    name: String,
}

impl Drop for RoleGuard {
    fn drop(&mut self) {
        let url = self.url.clone();
        let sql = format!("DROP OWNED BY \"{r}\"; DROP ROLE \"{r}\"", r = self.name);
        // The test's runtime may be gone: a thread with a runtime of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            runtime.block_on(async move {
                let mut conn = PgConnection::connect(&url).await.ok()?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.ok()?;
                conn.close().await.ok()
            })
        })
        .join();
    }
}

/// Item 5: while another transaction holds the reaper's row, a reaper pass does nothing and
/// says so (`skipped`, which the worker counts); once it is free, the pass reaps.
#[tokio::test]
async fn a_reap_while_another_transaction_holds_the_reaper_lock_reports_skipped() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = db.store(app.clone(), 2).await;
    store.enqueue(NewTask::new("job", json!(1))).await.unwrap();
    let tasks = claimed(&store, &claim(1, &policy(&app, 1), 1)).await;
    let backdate = "UPDATE {s}.tasks SET heartbeat_at = heartbeat_at - interval '1 hour'";
    sqlx::query(on(&db.schema, backdate)).execute(store.pool()).await.unwrap();
    let mut other = other_session(&db).await;
    sqlx::raw_sql(on(&db.schema, "BEGIN; SELECT true FROM {s}.reaper_lock FOR UPDATE"))
        .execute(&mut other)
        .await
        .unwrap();
    let reap = DbRequest::Reap { worker: worker(), claimed_stale_ms: None, running_stale_ms: Some(60_000), entropy: 1 };
    let skipped = tokio::time::timeout(Duration::from_secs(3), store.execute(&reap)).await.expect("the reaper waited");
    match skipped {
        Ok(DbReply::Reaped(report)) => {
            assert!(report.skipped && !report.changed_anything(), "{report:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(live_row(store.pool(), &db.schema, tasks[0].id).await.0, "RUNNING");
    rollback(&mut other).await;
    match store.execute(&reap).await {
        Ok(DbReply::Reaped(report)) => {
            assert!(!report.skipped, "{report:?}");
            assert_eq!([report.failed, report.retried].concat(), ids(&tasks));
        }
        other => panic!("{other:?}"),
    }
}

/// Item 9: undoing a hard-mode claim (its reply lost) gives back the attempt the claim
/// counted: nothing ran, so attempts are 0 again and the next claim is attempt 1.
#[tokio::test]
async fn abandoning_a_hard_mode_claim_gives_its_attempts_back() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let store = db.store(app.clone(), 2).await;
    let mut enqueued = store.enqueue_many((0..2).map(|i| NewTask::new("job", json!(i))).collect()).await.unwrap();
    enqueued.sort();
    let policy = policy(&app, 2);
    let tasks = claimed(&store, &claim(5, &policy, 2)).await;
    assert!(tasks.iter().all(|t| t.started && t.attempt == Attempt(1)), "{tasks:?}");
    let undone = store.execute(&DbRequest::AbandonClaim { worker: worker(), token: 5 }).await;
    assert_eq!(undone, Ok(DbReply::Released { released: enqueued.clone(), lost: vec![] }));
    for id in &enqueued {
        let (state, attempts, holder) = live_row(store.pool(), &db.schema, *id).await;
        assert_eq!((state.as_str(), attempts, holder), ("PENDING", 0, None));
    }
    let started: Vec<Option<i64>> =
        sqlx::query_scalar(on(&db.schema, "SELECT {s}.ms(started_at) FROM {s}.tasks ORDER BY id"))
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(started, vec![None, None], "never started, as far as anyone can tell");
    let again = claimed(&store, &claim(6, &policy, 2)).await;
    assert!(again.iter().all(|t| t.attempt == Attempt(1)), "{again:?}");
}
