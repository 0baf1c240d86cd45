//! Operator actions on a real server, where PostgreSQL adds something the conformance suite
//! (`pg_conformance.rs`, which compares each action with the memory store) cannot show: waiters
//! and workers on other connections, concurrent callers, purges over several batches, and the
//! purge's index.

#[path = "common/admin.rs"]
mod admin;
#[path = "common/pg.rs"]
mod pg;

use admin::Admin;
use std::sync::Arc;
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, CustomQueue, QueueMode, WorkerConfig};
use canter::postgres::{PgAdminError, PgStore};
use canter::store::{AdminError, Cancelled, KeyRemoval, PausedQueue};
use canter::store::{Completion, DbReply, DbRequest, DbTime, FinishOutcome, NewTask, WorkerInfo};
use canter::task::{ErrorCode, TaskId, TaskLease, TaskState, WorkerId};
use pg::{TestDb, dead_rows, pin_clock};
use serde_json::{Value, json};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgListener;

fn w(name: &str) -> WorkerId {
    WorkerId(name.into())
}

fn claim_request(store: &PgStore, worker: &str, concurrency: u32, start_now: u32) -> DbRequest {
    let config = WorkerConfig { concurrency, ..WorkerConfig::default() };
    DbRequest::Claim {
        worker: w(worker),
        token: 1,
        policy: Arc::new(ClaimPolicy::from_config(store.app(), &config)),
        my_running: 0,
        my_claimed: 0,
        start_now,
        lease_ms: 60_000,
    }
}

/// Claims up to `n` tasks for `worker`, starting the first `start_now`; (task, lease, queue).
async fn claim(store: &PgStore, worker: &str, n: u32, start_now: u32) -> Vec<(TaskLease, String)> {
    match store.execute(&claim_request(store, worker, n, start_now)).await.unwrap() {
        DbReply::Claimed { tasks, .. } => {
            tasks.into_iter().map(|t| (TaskLease { task: t.id, lease: t.lease }, t.queue)).collect()
        }
        other => panic!("unexpected {other:?}"),
    }
}

async fn finish(store: &PgStore, worker: &str, tasks: &[TaskLease], outcome: FinishOutcome) -> DbReply {
    let completions = tasks.iter().map(|&task| Completion { task, outcome: outcome.clone(), args: None }).collect();
    store.execute(&DbRequest::Finish { worker: w(worker), completions }).await.unwrap()
}

async fn next(listener: &mut PgListener) -> (String, String) {
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await.expect("a notification").unwrap();
    (note.channel().to_owned(), note.payload().to_owned())
}

async fn scalar(store: &PgStore, sql: &str) -> i64 {
    let sql = sql.replace("{s}", store.schema().quoted());
    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(store.pool()).await.unwrap()
}

/// Every (node type, relation) of an `EXPLAIN (FORMAT JSON)` plan.
fn scans(plan: &Value) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut stack = vec![plan];
    while let Some(node) = stack.pop() {
        match node {
            Value::Array(items) => stack.extend(items),
            Value::Object(fields) => {
                if let (Some(Value::String(kind)), Some(Value::String(relation))) =
                    (fields.get("Node Type"), fields.get("Relation Name"))
                {
                    found.push((kind.clone(), relation.clone()));
                }
                stack.extend(fields.values());
            }
            _ => {}
        }
    }
    found
}

fn refused(error: PgAdminError) -> AdminError {
    match error {
        PgAdminError::Refused(refusal) => refusal,
        PgAdminError::Database(error) | PgAdminError::OutcomeUnknown(error) => panic!("database error: {error}"),
        other => panic!("not a refusal: {other}"),
    }
}

#[tokio::test]
async fn hand_finishes_wake_waiters_and_fence_the_worker() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    let ids = store.enqueue_many(vec![NewTask::new("t", json!(1)), NewTask::new("t", json!(2))]).await.unwrap();
    let held: Vec<TaskLease> = claim(&store, "w", 2, 2).await.into_iter().map(|(t, _)| t).collect();
    assert_eq!(held.iter().map(|t| t.task).collect::<Vec<_>>(), ids);
    let waiter = tokio::spawn({
        let (store, id) = (store.clone(), ids[0]);
        async move { store.wait_result(id, tokio::time::sleep(Duration::from_secs(10))).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;

    store.complete(ids[0], json!({"by": "hand"})).await.unwrap();
    let record = waiter.await.unwrap().unwrap();
    assert_eq!((record.state, record.result, record.error), (TaskState::Completed, Some(json!({"by": "hand"})), None));
    store.fail(ids[1], "stuck on a lock").await.unwrap();
    let failed = store.get(ids[1]).await.unwrap().unwrap();
    assert_eq!(failed.state, TaskState::Failed);
    let error = failed.error.unwrap();
    assert_eq!((error.code.as_str(), error.message.as_str()), ("FAILED_BY_OPERATOR", "stuck on a lock"));

    // The worker still running them finds out when it writes: nothing it sends applies.
    let late = finish(&store, "w", &held, FinishOutcome::Completed(json!("late"))).await;
    assert_eq!(late, DbReply::Finished { applied: vec![], lost: ids.clone() });
    let beat = DbRequest::Heartbeat {
        worker: w("w"),
        claimed: vec![],
        running: held,
        lease_ms: 1_000,
        max_renew_age_ms: 0,
        abandoned: vec![],
    };
    assert_eq!(
        store.execute(&beat).await.unwrap(),
        DbReply::Heartbeat { lost: ids.clone(), busy: vec![], handed_back: vec![] }
    );
    // The run that was cut off is the finished row's last run.
    let runs = store.attempts(ids[0]).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].attempt.0, runs[0].worker.clone(), runs[0].outcome), (1, Some(w("w")), TaskState::Completed));

    let again = refused(store.complete(ids[1], Value::Null).await.unwrap_err());
    assert_eq!(again.to_string(), format!("task {} is FAILED: expected PENDING, CLAIMED or RUNNING", ids[1]));
    assert_eq!(refused(store.fail(TaskId(999), "x").await.unwrap_err()), AdminError::NotFound(TaskId(999)));
}

#[tokio::test]
async fn force_unlock_hands_a_dead_workers_tasks_to_the_living() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    let mut listener = PgListener::connect_with(&db.pool(1).await).await.unwrap();
    listener.listen(&store.schema().queue_channel("default")).await.unwrap();
    let info = WorkerInfo { worker: w("dead"), queues: vec!["default".into()], concurrency: 3 };
    store.execute(&DbRequest::RegisterWorker(info)).await.unwrap();
    let ids = store.enqueue_many((0..4).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    // No worker is marked waiting: the enqueue notified nobody.
    // Two run, one waits claimed; another worker runs the fourth.
    let dead: Vec<TaskLease> = claim(&store, "dead", 3, 2).await.into_iter().map(|(t, _)| t).collect();
    let alive = claim(&store, "alive", 1, 1).await;

    assert_eq!(store.force_unlock(&[w("dead"), w("never_seen")]).await.unwrap(), 3);
    assert_eq!(next(&mut listener).await.0, store.schema().queue_channel("default"));
    let registry = store.workers().await.unwrap();
    assert!(registry.iter().any(|r| r.info.worker == w("dead") && r.stopped));
    for (i, id) in ids.iter().enumerate().take(3) {
        let record = store.get(*id).await.unwrap().unwrap();
        let attempts = if i < 2 { 1 } else { 0 };
        assert_eq!(
            (record.state, record.attempts, record.retries, record.worker),
            (TaskState::Pending, attempts, 0, None)
        );
    }
    assert_eq!(store.get(alive[0].0.task).await.unwrap().unwrap().state, TaskState::Running, "others' tasks stay");

    // Claimable at once by the living; the dead worker's late writes are lost.
    let taken = claim(&store, "heir", 3, 3).await;
    assert_eq!(taken.len(), 3);
    let late = finish(&store, "dead", &dead, FinishOutcome::Completed(json!("late"))).await;
    assert_eq!(late, DbReply::Finished { applied: vec![], lost: ids[..3].to_vec() });
    assert_eq!(store.force_unlock(&[w("dead")]).await.unwrap(), 0);
    assert_eq!(store.force_unlock(&[]).await.unwrap(), 0);
}

#[tokio::test]
async fn a_paused_queue_is_skipped_by_every_worker_until_resumed() {
    let db = TestDb::new().await;
    let app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue::new("a"), CustomQueue::new("b").with_priority(2)],
        ..AppConfig::default()
    };
    let store = db.store(app, 8).await;
    let mut listener = PgListener::connect_with(&db.pool(1).await).await.unwrap();
    listener.listen(&store.schema().queue_channel("a")).await.unwrap();
    let tasks = (0..12).map(|i| NewTask::new("t", json!(i)).queue(if i < 6 { "a" } else { "b" })).collect();
    store.enqueue_many(tasks).await.unwrap();
    // No worker is marked waiting: the enqueue notified nobody.

    assert!(store.pause_queue("a").await.unwrap());
    assert!(!store.pause_queue("a").await.unwrap(), "already paused");
    let paused = store.paused_queues().await.unwrap();
    assert_eq!(paused.iter().map(|p| p.queue.as_str()).collect::<Vec<_>>(), vec!["a"]);
    let claimers = (0..4).map(|i| {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, &format!("w{i}"), 4, 1).await })
    });
    let mut claimed = Vec::new();
    for claimer in claimers {
        claimed.extend(claimer.await.unwrap());
    }
    assert_eq!(claimed.len(), 6, "every task of b, none of a: {claimed:?}");
    assert!(claimed.iter().all(|(_, queue)| queue == "b"));

    assert!(store.resume_queue("a").await.unwrap());
    assert_eq!(next(&mut listener).await.0, store.schema().queue_channel("a"), "resuming wakes the queue");
    assert!(!store.resume_queue("a").await.unwrap());
    assert_eq!(store.paused_queues().await.unwrap(), Vec::<PausedQueue>::new());
    let resumed = claim(&store, "w9", 10, 0).await;
    assert_eq!(resumed.len(), 6);
    assert!(resumed.iter().all(|(_, queue)| queue == "a"));
    let bad = refused(store.pause_queue("No Such").await.unwrap_err());
    assert_eq!(bad.to_string(), "invalid queue name \"No Such\": expected 1 to 52 bytes of a-z, 0-9 and _");
}

#[tokio::test]
async fn removing_a_key_under_concurrent_enqueuers_leaves_one_holder() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 8).await;
    let first = store.enqueue(NewTask::new("t", json!("x")).key("k")).await.unwrap();
    assert_eq!(store.remove_key("k").await.unwrap(), KeyRemoval::Cancelled(first));
    assert_eq!(refused(store.remove_key("k").await.unwrap_err()), AdminError::KeyNotFound("k".into()));

    let enqueuers = (0..6).map(|_| {
        let store = store.clone();
        tokio::spawn(async move {
            for _ in 0..20 {
                store.enqueue(NewTask::new("t", json!("x")).key("k")).await.unwrap();
            }
        })
    });
    let remover = tokio::spawn({
        let store = store.clone();
        async move {
            let mut removed = 0;
            for _ in 0..40 {
                match store.remove_key("k").await {
                    Ok(KeyRemoval::Cancelled(_)) => removed += 1,
                    Ok(other) => panic!("a pending task's key: {other:?}"),
                    Err(PgAdminError::Refused(AdminError::KeyNotFound(_))) => {}
                    Err(error) => panic!("{error}"),
                }
            }
            removed
        }
    });
    for enqueuer in enqueuers {
        enqueuer.await.unwrap();
    }
    let removed = remover.await.unwrap();
    // Every task the key named was cancelled by a removal, except the one that holds it now.
    let holders = scalar(&store, "SELECT count(*) FROM {s}.tasks WHERE key = 'k'").await;
    let keys = scalar(&store, "SELECT count(*) FROM {s}.task_keys WHERE key = 'k'").await;
    let cancelled = scalar(&store, "SELECT count(*) FROM {s}.finished_tasks WHERE state = 'CANCELLED'").await;
    assert_eq!(holders, keys, "the key row and the task showing the key go together");
    assert!(holders <= 1);
    assert_eq!(cancelled, removed + 1);
    let total =
        scalar(&store, "SELECT (SELECT count(*) FROM {s}.tasks) + (SELECT count(*) FROM {s}.finished_tasks)").await;
    assert_eq!(total, cancelled + holders);
}

#[tokio::test]
async fn purges_go_in_batches_and_take_histories_and_keys_along() {
    let db = TestDb::new().await;
    // One connection with the clock pinned: the tasks finish two hours apart.
    let store = db.store(AppConfig::default(), 1).await;
    let t0 = DbTime(1_700_000_000_000);
    pin_clock(store.pool(), store.schema(), t0).await;
    let old = 2_500;
    let tasks = (0..old).map(|i| {
        let task = NewTask::new("t", json!(i));
        if i % 10 == 0 { task.key(format!("old{i}")) } else { task }
    });
    store.enqueue_many(tasks.collect()).await.unwrap();
    let mut held: Vec<TaskLease> = claim(&store, "w", old, old).await.into_iter().map(|(t, _)| t).collect();
    assert_eq!(held.len(), old as usize);
    // A hundred runs are retried at once, so histories have rows of their own.
    let error = canter::task::TaskError::new(ErrorCode::TaskError, "again");
    finish(&store, "w", &held[..100], FinishOutcome::Retry { error, delay_ms: 0 }).await;
    held.drain(..100);
    held.extend(claim(&store, "w", 100, 100).await.into_iter().map(|(t, _)| t));
    finish(&store, "w", &held, FinishOutcome::Completed(json!(true))).await;
    assert_eq!(scalar(&store, "SELECT count(*) FROM {s}.attempts").await, 100);

    pin_clock(store.pool(), store.schema(), t0.plus_ms(2 * 3_600_000)).await;
    let young = store.enqueue_many((0..5).map(|i| NewTask::new("t", json!(i)).key(format!("young{i}"))).collect());
    let young = young.await.unwrap();
    let held: Vec<TaskLease> = claim(&store, "w", 5, 5).await.into_iter().map(|(t, _)| t).collect();
    finish(&store, "w", &held, FinishOutcome::Completed(json!(true))).await;

    assert_eq!(store.purge_finished(3_600_000, 1_000).await.unwrap(), u64::from(old));
    assert_eq!(scalar(&store, "SELECT count(*) FROM {s}.finished_tasks").await, 5);
    assert_eq!(scalar(&store, "SELECT count(*) FROM {s}.attempts").await, 0);
    assert_eq!(scalar(&store, "SELECT count(*) FROM {s}.task_keys").await, 5);
    assert!(store.get(young[0]).await.unwrap().is_some());
    // A purged task's key is free: the same key with other arguments is a new task.
    let reused = store.enqueue(NewTask::new("t", json!("other")).key("old0")).await.unwrap();
    assert!(reused.0 > young[4].0);
    assert_eq!(store.purge_finished(3_600_000, 1_000).await.unwrap(), 0);
    pin_clock(store.pool(), store.schema(), t0.plus_ms(2 * 3_600_000 + 1)).await;
    assert_eq!(store.purge_finished(0, 0).await.unwrap(), 5, "a batch of 0 is 1");
}

#[tokio::test]
async fn the_purge_finds_old_rows_by_the_brin_index() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 1).await;
    let s = store.schema().quoted();
    // 50,000 finished tasks, one a second, the oldest first (finishing order).
    let fill = format!(
        "INSERT INTO {s}.finished_tasks (id, name, queue, priority, args, state, lease, attempts, retries, run_at, \
         enqueued_at, result, finished_at)
         SELECT g, 'report', 'default', 0, jsonb_build_object('n', g), 'COMPLETED', 1, 1, 0, now(), now(), 'true', \
                now() - (50000 - g) * interval '1 second'
         FROM generate_series(1, 50000) AS g"
    );
    sqlx::query(AssertSqlSafe(fill)).execute(store.pool()).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {s}.finished_tasks"))).execute(store.pool()).await.unwrap();
    // The purge's selection of old rows, as `PURGE_FINISHED` in src/postgres/sql.rs has it, for
    // a retention that leaves all but the oldest 1 %.
    let explain = format!(
        "EXPLAIN (FORMAT JSON) SELECT f.id FROM {s}.finished_tasks f
         WHERE f.finished_at < {s}.db_now() - $1 * interval '1 millisecond'
           AND NOT EXISTS (
               SELECT FROM {s}.task_keys k
               WHERE k.key = f.key AND k.task_id = f.id AND k.idempotent_since IS NOT NULL
                 AND ($3::bigint IS NULL
                      OR greatest(k.idempotent_since, f.enqueued_at) > {s}.db_now() - $3 * interval '1 millisecond'))
         LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    let plan: Value = sqlx::query_scalar(AssertSqlSafe(explain))
        .bind(49_500_000_i64)
        .bind(1_000_i64)
        .bind(None::<i64>)
        .fetch_one(store.pool())
        .await
        .unwrap();
    let text = plan.to_string();
    assert!(text.contains("finished_tasks_finished_at_idx"), "{plan:#}");
    assert!(!scans(&plan).contains(&("Seq Scan".to_owned(), "finished_tasks".to_owned())), "{plan:#}");
    let purged = store.purge_finished(49_500_000, 1_000).await.unwrap();
    assert!((499..=501).contains(&purged), "{purged}");
}

/// Keys written before migration 0003 (which does not know their mode) count as idempotency
/// keys: a purge keeps their finished tasks forever by default, and with a window ages them
/// from their task's enqueue. Keys written since carry their mode.
#[tokio::test]
async fn keys_from_before_their_mode_was_stored_are_kept_as_idempotency_keys() {
    let db = TestDb::new().await;
    let pool = db.pool(2).await;
    let old = canter::postgres::PgSchema::new(&format!("{}_v2", db.schema.name())).unwrap();
    {
        let mut conn = pool.acquire().await.unwrap().detach();
        let setup = format!("CREATE SCHEMA {s}; SET search_path TO {s}", s = old.quoted());
        sqlx::raw_sql(AssertSqlSafe(setup)).execute(&mut conn).await.unwrap();
        canter::postgres::MIGRATOR.run_to(2, &mut conn).await.unwrap();
    }
    let store = PgStore::new(pool.clone(), old.clone(), AppConfig::default());
    let legacy = store.enqueue(NewTask::new("pay", json!(1)).idempotency_key("legacy")).await.unwrap();
    let replaced = store.enqueue(NewTask::new("t", json!(2)).key("replace")).await.unwrap();
    // Completed by this code, so on the current schema (its statements read 0008's listeners).
    store.migrate().await.unwrap();
    for id in [legacy, replaced] {
        store.complete(id, json!(null)).await.unwrap();
    }
    assert_eq!(store.purge_finished(0, 10).await.unwrap(), 0, "both kept: their mode is unknown");
    assert_eq!(store.enqueue(NewTask::new("pay", json!(1)).idempotency_key("legacy")).await.unwrap(), legacy);
    let new = store.enqueue(NewTask::new("t", json!(3)).key("new")).await.unwrap();
    store.complete(new, json!(null)).await.unwrap();
    assert_eq!(store.purge_finished(0, 10).await.unwrap(), 1, "a key written since carries its mode");

    // With a window, their age is their task's: an hour old, past a minute's window.
    let sql = format!(
        "UPDATE {}.finished_tasks SET enqueued_at = enqueued_at - interval '1 hour' WHERE id = $1",
        old.quoted()
    );
    sqlx::query(AssertSqlSafe(sql)).bind(legacy.0).execute(&pool).await.unwrap();
    let mut app = AppConfig::default();
    app.recovery.idempotency_retention_ms = Some(60_000);
    let windowed = PgStore::new(pool.clone(), old.clone(), app);
    assert_eq!(windowed.purge_finished(0, 10).await.unwrap(), 1);
    assert!(windowed.get(legacy).await.unwrap().is_none());
    assert_eq!(windowed.get(replaced).await.unwrap().unwrap().key.as_deref(), Some("replace"));
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", old.quoted()))).execute(&pool).await.unwrap();
}

/// Issue 18, item 10: a cancel of a claimed task says who claimed it, since that worker may
/// already run it (soft-cap mode starts some claims without telling the store), and its run's
/// outcome will not be recorded; a pending task's cancel says it never ran.
#[tokio::test]
async fn a_cancel_says_when_a_worker_had_claimed_the_task() {
    let db = TestDb::new().await;
    let app = AppConfig { prefetch_buffer: 2, claim_lease_ms: Some(60_000), ..AppConfig::default() };
    let store = db.store(app, 2).await;
    store.enqueue(NewTask::new("t", json!(1))).await.unwrap();
    let claimed = claim(&store, "w", 1, 0).await;
    assert_eq!(claimed.len(), 1);
    let held = claimed[0].0;
    let pending = store.enqueue(NewTask::new("t", json!(2))).await.unwrap();
    assert_eq!(store.cancel(held.task).await.unwrap(), Cancelled::Claimed { worker: w("w") });
    assert_eq!(store.cancel(pending).await.unwrap(), Cancelled::Pending);
    // The run the worker may have started unasked is fenced: its finish changes nothing.
    let late = finish(&store, "w", &[held], FinishOutcome::Completed(json!(1))).await;
    assert_eq!(late, DbReply::Finished { applied: vec![], lost: vec![held.task] });
    assert_eq!(store.get(held.task).await.unwrap().unwrap().state, TaskState::Cancelled);
}

/// Issue 18, item 10: the reaper deletes from the registry the workers unseen for
/// `recovery.worker_retention_ms` that hold no task; one that still holds a task stays (its
/// tasks name it), and so does a recent one.
#[tokio::test]
async fn the_reaper_prunes_long_dead_workers_that_hold_nothing() {
    let db = TestDb::new().await;
    let app = AppConfig::default();
    let retention = app.recovery.worker_retention_ms;
    let store = db.store(app, 2).await;
    for name in ["gone", "holding", "recent"] {
        let info = WorkerInfo { worker: w(name), queues: vec!["default".into()], concurrency: 1 };
        store.execute(&DbRequest::RegisterWorker(info)).await.unwrap();
    }
    store.enqueue(NewTask::new("t", json!(1))).await.unwrap();
    assert_eq!(claim(&store, "holding", 1, 1).await.len(), 1);
    let age = format!(
        "UPDATE {}.workers SET last_seen = last_seen - ($1 + 1000) * interval '1 millisecond' WHERE id <> 'recent'",
        db.schema.quoted()
    );
    sqlx::query(AssertSqlSafe(age)).bind(retention as i64).execute(store.pool()).await.unwrap();
    let reap = DbRequest::Reap { worker: w("reaper"), claimed_stale_ms: None, running_stale_ms: None, entropy: 0 };
    let DbReply::Reaped(report) = store.execute(&reap).await.unwrap() else { panic!("a reap report") };
    assert_eq!(report.workers_pruned, 1);
    let left: Vec<String> = store.workers().await.unwrap().into_iter().map(|r| r.info.worker.0).collect();
    assert_eq!(left, ["holding", "recent"]);
}

async fn vacuum(store: &PgStore, min_dead_rows: u64) -> Vec<canter::store::VacuumedTable> {
    match store.execute(&DbRequest::Vacuum { min_dead_rows }).await.unwrap() {
        DbReply::Vacuumed { tables } => tables,
        other => panic!("unexpected {other:?}"),
    }
}

/// Runs `n` tasks through `store`: each leaves dead row versions in the live table.
async fn churn(store: &PgStore, n: u32) {
    store.enqueue_many((0..n).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    let held: Vec<TaskLease> = claim(store, "w", n, n).await.into_iter().map(|(t, _)| t).collect();
    assert_eq!(held.len(), n as usize);
    finish(store, "w", &held, FinishOutcome::Completed(json!(true))).await;
}

/// Issue 19: on a server without autovacuum the live table grew without bound. Workers vacuum
/// the hot tables once enough dead rows pile up, and do not repeat a vacuum that an open
/// snapshot kept from removing anything.
#[tokio::test]
async fn workers_vacuum_the_hot_tables_when_dead_rows_pile_up() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    // Whatever the server's setting, only Canter's vacuum runs here.
    for table in canter::postgres::HOT_TABLES {
        let sql = format!("ALTER TABLE {}.\"{table}\" SET (autovacuum_enabled = off)", store.schema().quoted());
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(store.pool()).await.unwrap();
    }
    assert!(vacuum(&store, 100).await.is_empty(), "nothing dead yet");

    // An open snapshot older than the dead rows: the vacuum can remove none of them.
    let mut holder = db.pool(1).await.begin().await.unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT txid_current()")
        .execute(&mut *holder)
        .await
        .unwrap();
    churn(&store, 300).await;
    let before = dead_rows(&store, "tasks", 300).await;
    let held = vacuum(&store, 100).await;
    let tasks = held.iter().find(|t| t.table == "tasks").expect("tasks vacuumed");
    assert!(tasks.dead_before >= before as u64 && tasks.dead_after >= before as u64, "{held:?}");
    assert!(vacuum(&store, 100).await.iter().all(|t| t.table != "tasks"), "not repeated for nothing");
    holder.rollback().await.unwrap();

    // Once the snapshot is gone, a vacuum removes them (this store's next one after more dead
    // rows or a minute; a fresh store's at once).
    let fresh = vacuum_clean(&db).await;
    assert!(vacuum(&fresh, 100).await.is_empty(), "nothing left to vacuum");
    churn(&store, 200).await;
    dead_rows(&store, "tasks", 200).await;
    vacuum_clean(&db).await;
}

/// A fresh store whose vacuum left fewer than 100 dead rows in `tasks`. Tests running beside
/// this one may hold a snapshot for a moment (any session's holds every schema's dead rows):
/// tried again with a fresh store (which remembers nothing) until that has passed.
async fn vacuum_clean(db: &TestDb) -> PgStore {
    let mut last = Vec::new();
    for _ in 0..50 {
        let fresh = db.store(AppConfig::default(), 1).await;
        last = vacuum(&fresh, 100).await;
        if last.iter().any(|t| t.table == "tasks" && t.dead_after < 100) {
            return fresh;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("tasks never vacuumed clean: {last:?}");
}
