//! The PostgreSQL store on a real server: migrations, enqueue (single, bulk, in the caller's
//! transaction, idempotency keys, refusals), notifications, waiting for results, failures.

#[path = "common/admin.rs"]
mod admin;
#[path = "common/pg.rs"]
mod pg;

use admin::Admin;
use std::sync::Arc;
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, CustomQueue, QueueMode, WorkerConfig};
use canter::postgres::{
    DoneRouter, HOT_TABLES, PgEnqueueError, PgSchema, PgStore, TABLES, WaitError, enqueue_in, migrate,
    register_listener,
};
use canter::store::{Completion, DbFailure, DbReply, DbRequest, EnqueueError, FinishOutcome, NewTask, RunAt};
use canter::task::{ErrorCode, TaskId, TaskLease, TaskState, WorkerId};
use pg::TestDb;
use serde_json::json;
use sqlx::postgres::PgListener;

fn custom(queues: &[&str]) -> AppConfig {
    AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: queues.iter().map(|q| CustomQueue::new(*q)).collect(),
        ..AppConfig::default()
    }
}

fn claim_request(store: &PgStore, worker: &str, concurrency: u32, start_now: u32) -> DbRequest {
    claim_with(store, worker, &WorkerConfig { concurrency, ..WorkerConfig::default() }, start_now)
}

fn claim_with(store: &PgStore, worker: &str, config: &WorkerConfig, start_now: u32) -> DbRequest {
    DbRequest::Claim {
        worker: WorkerId(worker.into()),
        token: 1,
        policy: Arc::new(ClaimPolicy::from_config(store.app(), config)),
        my_running: 0,
        my_claimed: 0,
        start_now,
        lease_ms: 60_000,
    }
}

async fn claim_and_start(store: &PgStore, worker: &str, n: u32) -> Vec<TaskLease> {
    match store.execute(&claim_request(store, worker, n, n)).await.unwrap() {
        DbReply::Claimed { tasks, .. } => tasks.iter().map(|t| TaskLease { task: t.id, lease: t.lease }).collect(),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn migrate_is_idempotent_and_safe_when_many_run_at_once() {
    // Not migrated yet: the runs race to create the schema, one migrates, the others wait.
    let db = TestDb::unmigrated().await;
    let pool = db.pool(8).await;
    let runs = (0..6).map(|_| {
        let pool = pool.clone();
        let schema = db.schema.clone();
        tokio::spawn(async move { migrate(&pool, &schema).await })
    });
    for run in runs {
        run.await.unwrap().unwrap();
    }
    // A second schema in the same database is independent.
    let other = PgSchema::new(&format!("{}_b", db.schema.name())).unwrap();
    migrate(&pool, &other).await.unwrap();
    let tables: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = $1")
        .bind(other.name())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        tables, 17,
        "tasks, finished_tasks, task_keys, attempts, workers, queue_states, schedules, claim_locks, reaper_lock, \
         _sqlx_migrations, schema_versions, listeners, waiting_workers, workflows, workflow_steps, workflow_edges, \
         task_gates"
    );
    // The public list names exactly these, and the vacuumed ones are among them.
    let mut named: Vec<String> = sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = $1")
        .bind(other.name())
        .fetch_all(&pool)
        .await
        .unwrap();
    named.sort();
    let mut listed: Vec<String> = TABLES.iter().map(|t| t.to_string()).collect();
    listed.sort();
    assert_eq!(named, listed, "postgres::TABLES");
    assert!(HOT_TABLES.iter().all(|t| TABLES.contains(t)), "the hot tables are tables of the schema");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", other.quoted()))).execute(&pool).await.unwrap();
}

#[tokio::test]
async fn enqueue_one_many_and_in_a_transaction() {
    let db = TestDb::new().await;
    let store = db.store(custom(&["a", "b"]), 4).await;
    let one = store.enqueue(NewTask::new("t", json!({"n": 1})).queue("b").priority(-3)).await.unwrap();
    let many = store
        .enqueue_many(
            (0..1000).map(|i| NewTask::new("t", json!(i)).queue(if i % 2 == 0 { "a" } else { "b" })).collect(),
        )
        .await
        .unwrap();
    assert_eq!(many.len(), 1000);
    assert!(many.windows(2).all(|w| w[0].0 + 1 == w[1].0) && many[0].0 == one.0 + 1, "ids in batch order");
    let record = store.get(one).await.unwrap().unwrap();
    assert_eq!((record.queue.as_str(), record.priority, record.state), ("b", -3, TaskState::Pending));

    // Inside the caller's transaction: invisible until commit, gone on rollback.
    let mut tx = store.pool().begin().await.unwrap();
    let inside = enqueue_in(&mut *tx, store.schema(), store.app(), NewTask::new("t", json!("tx"))).await.unwrap();
    assert!(store.get(inside).await.unwrap().is_none());
    // A refusal inside the transaction does not abort it.
    let refused = enqueue_in(&mut *tx, store.schema(), store.app(), NewTask::new("t", json!(1)).queue("zzz")).await;
    assert!(matches!(refused, Err(PgEnqueueError::Invalid(EnqueueError::UnknownQueue { .. }))));
    let late = NewTask::new("t", json!(1)).run_at(RunAt::DelayMs(10_000)).good_until(canter::store::DbTime(0));
    let refused = enqueue_in(&mut *tx, store.schema(), store.app(), late).await;
    assert!(matches!(refused, Err(PgEnqueueError::Invalid(EnqueueError::RunAtAfterGoodUntil { .. }))));
    tx.commit().await.unwrap();
    assert_eq!(store.get(inside).await.unwrap().unwrap().args, json!("tx"));
    let mut tx = store.pool().begin().await.unwrap();
    let gone =
        enqueue_in(&mut *tx, store.schema(), store.app(), NewTask::new("t", json!("rolled back"))).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(store.get(gone).await.unwrap().is_none());
}

#[tokio::test]
async fn bad_input_is_refused_with_clear_errors_and_writes_nothing() {
    let db = TestDb::new().await;
    let store = db.store(custom(&["a"]), 2).await;
    let now = store.now().await.unwrap();
    let cases: Vec<(NewTask, &str)> = vec![
        (NewTask::new("t", json!(1)).queue("nope"), "unknown queue \"nope\": expected one of a"),
        (NewTask::new("t", json!(1)).queue("Bad-Name"), "invalid queue name \"Bad-Name\""),
        (NewTask::new("t", json!(1)).queue("x".repeat(53)), "invalid queue name"),
        (NewTask::new("t", json!({"s": "nul\u{0}"})), "invalid args: $.s contains U+0000"),
        (
            NewTask::new("t", json!(1)).good_until(now.plus_ms(1_000)).run_at(RunAt::DelayMs(5_000)),
            "is not before good_until",
        ),
        (NewTask::new("t", json!(1)).good_until(now).run_at(RunAt::At(now.plus_ms(1))), "is not before good_until"),
        (NewTask::new("", json!(1)), "invalid task name"),
    ];
    for (task, message) in cases {
        let batch = vec![NewTask::new("t", json!("fine")), task];
        let error = store.enqueue_many(batch).await.unwrap_err();
        assert!(error.to_string().contains(message), "{error} does not say {message:?}");
        assert_eq!(error.code(), ErrorCode::User("VALIDATION_FAILED".into()));
    }
    assert!(store.list(&Default::default()).await.unwrap().is_empty(), "nothing written");
}

#[tokio::test]
async fn idempotency_keys_survive_finishing_and_concurrent_enqueuers() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 8).await;
    let id = store.enqueue(NewTask::new("t", json!({"a": 1})).idempotency_key("k")).await.unwrap();
    assert_eq!(store.enqueue(NewTask::new("t", json!({"a": 1})).idempotency_key("k")).await.unwrap(), id);
    let mismatch = store.enqueue(NewTask::new("t", json!({"a": 2})).idempotency_key("k")).await.unwrap_err();
    assert!(
        matches!(&mismatch, PgEnqueueError::Invalid(EnqueueError::PayloadMismatch { existing, .. }) if existing == &id)
    );
    assert_eq!(mismatch.code(), ErrorCode::PayloadMismatch);
    store.cancel(id).await.unwrap();
    assert_eq!(
        store.enqueue(NewTask::new("t", json!({"a": 1})).idempotency_key("k")).await.unwrap(),
        id,
        "finished keeps its key"
    );

    // Many enqueuers of one new key at once get one task.
    let racers = (0..16).map(|_| {
        let store = store.clone();
        tokio::spawn(
            async move { store.enqueue(NewTask::new("t", json!("race")).idempotency_key("race")).await.unwrap() },
        )
    });
    let mut ids = Vec::new();
    for racer in racers {
        ids.push(racer.await.unwrap());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(store.counts().await.unwrap().values().sum::<u64>(), 2);
}

#[tokio::test]
async fn notifications_come_once_per_statement_per_queue_and_per_finish() {
    let db = TestDb::new().await;
    let store = db.store(custom(&["a", "b"]), 2).await;
    let mut listener = PgListener::connect_with(&db.pool(1).await).await.unwrap();
    for channel in [store.schema().queue_channel("a"), store.schema().queue_channel("b"), store.schema().done_channel()]
    {
        listener.listen(&channel).await.unwrap();
    }
    register_listener(&mut listener, store.schema(), &[store.schema().done_channel()]).await.unwrap();
    register(&store, "w").await;
    let mark = DbRequest::SetWaiting {
        worker: WorkerId("w".into()),
        queues: vec!["a".into(), "b".into()],
        waiting: true,
        urgent_below: None,
        stale_ms: 300_000,
    };
    store.execute(&mark).await.unwrap();
    let batch = (0..10).map(|i| NewTask::new("t", json!(i)).queue(if i < 7 { "a" } else { "b" })).collect();
    store.enqueue_many(batch).await.unwrap();
    let mut channels = vec![next(&mut listener).await.0, next(&mut listener).await.0];
    channels.sort();
    assert_eq!(channels, vec![store.schema().queue_channel("a"), store.schema().queue_channel("b")]);

    let held = claim_and_start(&store, "w", 3).await;
    let completions =
        held.iter().map(|&task| Completion { task, outcome: FinishOutcome::Completed(json!(1)), args: None }).collect();
    let request = DbRequest::Finish { worker: WorkerId("w".into()), completions };
    assert!(matches!(store.execute(&request).await.unwrap(), DbReply::Finished { applied, .. } if applied.len() == 3));
    let (channel, payload) = next(&mut listener).await;
    assert_eq!(channel, store.schema().done_channel());
    let expected: Vec<String> = held.iter().map(|t| t.task.0.to_string()).collect();
    let mut got: Vec<String> = payload.split(',').map(str::to_owned).collect();
    got.sort();
    let mut expected = expected;
    expected.sort();
    assert_eq!(got, expected, "one notification names the whole batch");
    assert!(tokio::time::timeout(Duration::from_millis(200), listener.recv()).await.is_err(), "nothing more");
}

/// Finishes the next Pending task as worker `w`.
async fn finish_one(store: &PgStore) -> TaskId {
    finish(store, claim_and_start(store, "w", 1).await[0]).await
}

/// Completes `task`, held by worker `w`.
async fn finish(store: &PgStore, task: TaskLease) -> TaskId {
    let completions = vec![Completion { task, outcome: FinishOutcome::Completed(json!(1)), args: None }];
    let request = DbRequest::Finish { worker: WorkerId("w".into()), completions };
    assert!(matches!(store.execute(&request).await.unwrap(), DbReply::Finished { applied, .. } if applied.len() == 1));
    task.task
}

/// A session of `db` (a pool of its own) listening on `channel`, not registered.
async fn listening(db: &TestDb, channel: &str) -> PgListener {
    let mut listener = PgListener::connect_with(&db.pool(1).await).await.unwrap();
    listener.listen(channel).await.unwrap();
    listener
}

async fn nothing_heard(listener: &mut PgListener) -> bool {
    tokio::time::timeout(Duration::from_millis(300), listener.recv()).await.is_err()
}

#[tokio::test]
async fn finishes_notify_the_done_channel_only_while_a_waiter_is_registered() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    store.enqueue_many((0..3).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    let done = [store.schema().done_channel()];
    // A session that listens without registering hears no finish.
    let mut unregistered = listening(&db, &done[0]).await;
    finish_one(&store).await;
    assert!(nothing_heard(&mut unregistered).await, "a finish notified with no waiter registered");
    // While one is registered, every listener hears.
    let mut waiter = listening(&db, &done[0]).await;
    register_listener(&mut waiter, store.schema(), &done).await.unwrap();
    let id = finish_one(&store).await;
    assert_eq!(next(&mut unregistered).await, (done[0].clone(), id.0.to_string()));
    assert_eq!(next(&mut waiter).await, (done[0].clone(), id.0.to_string()));
    // A registration whose session ended goes with the next registration of anyone.
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut waiter).await.unwrap();
    drop(waiter);
    let killer = db.pool(1).await;
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&killer).await.unwrap();
    let mut other = PgListener::connect_with(&db.pool(1).await).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let registrations = format!("SELECT count(*) FROM {}.listeners", store.schema().quoted());
    loop {
        register_listener(&mut other, store.schema(), &[store.schema().queue_channel("x")]).await.unwrap();
        let n: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(registrations.clone())).fetch_one(&mut other).await.unwrap();
        if n == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the ended session's registration stayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    finish_one(&store).await;
    assert!(nothing_heard(&mut unregistered).await, "a finish notified for a registration whose session ended");
}

/// The race the registration closes: a finish that read no registration must commit before the
/// registration does (so the waiter's first read sees it), and one that reads after must notify.
#[tokio::test]
async fn a_registration_waits_for_statements_in_flight_and_later_ones_see_it() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    store.enqueue_many((0..2).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    let done = [store.schema().done_channel()];
    let s = store.schema().quoted().to_owned();
    // A statement in flight that read no registration (the lock a finishing statement holds).
    let mut in_flight = db.pool(1).await.begin().await.unwrap();
    let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {s}.listeners")))
        .fetch_one(&mut *in_flight)
        .await
        .unwrap();
    assert_eq!(seen, 0);
    // Claimed beforehand, so that the finish below reaches the registration's lock at once
    // (the registration gives up after 250 ms, and tries again).
    let held = claim_and_start(&store, "w", 1).await[0];
    let mut waiter = listening(&db, &done[0]).await;
    let registering = tokio::spawn({
        let schema = store.schema().clone();
        let done = done.clone();
        async move {
            register_listener(&mut waiter, &schema, &done).await.unwrap();
            waiter
        }
    });
    let watcher = db.pool(1).await;
    let waiting = format!("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = '{s}.listeners'::regclass");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(waiting.clone())).fetch_one(&watcher).await.unwrap() < 1 {
        assert!(tokio::time::Instant::now() < deadline, "the registration did not wait for the statement in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!registering.is_finished());
    // A finish sent now waits behind the registration, then sees it.
    let finishing = tokio::spawn({
        let store = store.clone();
        async move { finish(&store, held).await }
    });
    while sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(waiting.clone())).fetch_one(&watcher).await.unwrap() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the finish did not queue behind the registration");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    in_flight.commit().await.unwrap();
    let mut waiter = registering.await.unwrap();
    let id = finishing.await.unwrap();
    assert_eq!(next(&mut waiter).await, (done[0].clone(), id.0.to_string()));
}

/// A worker's waiting mark of the default queue (or its unmark).
fn set_waiting(worker: &str, waiting: bool) -> DbRequest {
    DbRequest::SetWaiting {
        worker: WorkerId(worker.into()),
        queues: vec!["default".into()],
        waiting,
        urgent_below: None,
        stale_ms: 300_000,
    }
}

fn written(reply: DbReply) -> bool {
    match reply {
        DbReply::WaitingSet { written } => written,
        other => panic!("unexpected {other:?}"),
    }
}

async fn register(store: &PgStore, worker: &str) {
    let info =
        canter::store::WorkerInfo { worker: WorkerId(worker.into()), queues: vec!["default".into()], concurrency: 1 };
    store.execute(&DbRequest::RegisterWorker(info)).await.unwrap();
}

/// A client's enqueue in a statement of its own notifies a queue only while a worker of it is
/// marked waiting (each of its five forms); inside the caller's transaction, or with a key, it
/// always notifies. A mark there already is left as it is; another worker's mark or unmark
/// deletes the marks of workers the registry does not have or has stopped, and a worker's
/// deregistration deletes its own.
#[tokio::test]
async fn client_enqueues_notify_a_queue_only_while_a_worker_of_it_waits() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let channel = store.schema().queue_channel("default");
    let mut listener = listening(&db, &channel).await;
    let t = |n: i64| NewTask::new("t", json!(n));
    // One each of the five statements: one due now, one with a run-at, a uniform batch, a
    // plain batch, a batch with a good-until.
    let every_form = |store: PgStore| async move {
        store.enqueue(t(1)).await.unwrap();
        store.enqueue(t(2).run_at(RunAt::DelayMs(0))).await.unwrap();
        store.enqueue_many(vec![t(3), t(4)]).await.unwrap();
        store.enqueue_many(vec![t(5), t(6).priority(1)]).await.unwrap();
        store.enqueue_many(vec![t(7).good_until(canter::store::DbTime(i64::MAX / 2))]).await.unwrap();
    };
    every_form(store.clone()).await;
    assert!(nothing_heard(&mut listener).await, "an enqueue notified with no worker waiting");
    // Inside the caller's transaction, and with a key: always.
    let mut tx = store.pool().begin().await.unwrap();
    enqueue_in(&mut *tx, store.schema(), store.app(), t(8)).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(next(&mut listener).await.0, channel);
    store.enqueue(t(9).key("k")).await.unwrap();
    assert_eq!(next(&mut listener).await.0, channel);

    register(&store, "w").await;
    assert!(written(store.execute(&set_waiting("w", true)).await.unwrap()), "a new mark is written");
    assert!(!written(store.execute(&set_waiting("w", true)).await.unwrap()), "a mark there already is kept");
    every_form(store.clone()).await;
    for _ in 0..5 {
        assert_eq!(next(&mut listener).await.0, channel);
    }
    assert!(nothing_heard(&mut listener).await);
    // Busy with a backlog of priority 0: only more urgent tasks notify.
    let busy = DbRequest::SetWaiting {
        worker: WorkerId("w".into()),
        queues: vec!["default".into()],
        waiting: false,
        urgent_below: Some(0),
        stale_ms: 300_000,
    };
    assert!(!written(store.execute(&busy).await.unwrap()));
    every_form(store.clone()).await;
    assert!(nothing_heard(&mut listener).await, "a task as urgent as the backlog notified");
    store.enqueue(t(11).priority(-1)).await.unwrap();
    store.enqueue_many(vec![t(12), t(13).priority(-1)]).await.unwrap();
    for _ in 0..2 {
        let (heard, payload) = next(&mut listener).await;
        assert_eq!(heard, channel);
        assert!(payload.starts_with("-1 "), "{payload}");
    }
    assert!(nothing_heard(&mut listener).await);
    assert!(!written(store.execute(&set_waiting("w", false)).await.unwrap()));
    store.enqueue(t(10)).await.unwrap();
    assert!(nothing_heard(&mut listener).await, "an enqueue notified after the unmark");

    // A mark of a worker the registry does not have goes with another worker's mark; a
    // deregistration takes the worker's own.
    let marks = format!("SELECT count(*)::bigint FROM {}.waiting_workers", store.schema().quoted());
    let count = || sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(marks.clone())).fetch_one(store.pool());
    assert!(written(store.execute(&set_waiting("ghost", true)).await.unwrap()));
    assert!(written(store.execute(&set_waiting("w", true)).await.unwrap()));
    assert_eq!(count().await.unwrap(), 1, "the ghost's mark stayed");
    store.execute(&DbRequest::DeregisterWorker(WorkerId("w".into()))).await.unwrap();
    assert_eq!(count().await.unwrap(), 0, "a stopped worker's mark stayed");
}

/// Workers running out of work together mark themselves one after another: none times out on
/// another's read of the table (two markers that each read it and then asked for the exclusive
/// lock would wait for each other until one gave up).
#[tokio::test]
async fn workers_marking_at_once_all_get_their_marks() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 10).await;
    for i in 0..8 {
        register(&store, &format!("w{i}")).await;
    }
    let marks: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.execute(&set_waiting(&format!("w{i}"), true)).await })
        })
        .collect();
    for mark in marks {
        assert!(written(mark.await.unwrap().unwrap()));
    }
}

/// The race a mark closes: an enqueue that read no mark must commit before the mark does (so
/// the worker's next claim sees it), and one that reads after must notify. The mark waits at
/// most 250 ms for the table: a try the machine was too slow for is tried again.
#[tokio::test]
async fn a_waiting_mark_waits_for_enqueues_in_flight_and_later_ones_see_it() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    let channel = store.schema().queue_channel("default");
    let mut listener = listening(&db, &channel).await;
    register(&store, "w").await;
    let s = store.schema().quoted().to_owned();
    let watcher = db.pool(1).await;
    let waiters =
        format!("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = '{s}.waiting_workers'::regclass");
    let waiting = || sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(waiters.clone())).fetch_one(&watcher);
    for try_ in 1.. {
        // A statement in flight that read no mark (the lock a client's enqueue holds to its commit).
        let mut in_flight = db.pool(1).await.begin().await.unwrap();
        let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {s}.waiting_workers")))
            .fetch_one(&mut *in_flight)
            .await
            .unwrap();
        assert_eq!(seen, 0);
        let marking = tokio::spawn({
            let store = store.clone();
            async move { store.execute(&set_waiting("w", true)).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while waiting().await.unwrap() < 1 && !marking.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "the mark did not wait for the statement in flight");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // An enqueue sent now waits behind the mark, then sees it.
        let enqueuing = tokio::spawn({
            let store = store.clone();
            async move { store.enqueue(NewTask::new("t", json!(1))).await.unwrap() }
        });
        while waiting().await.unwrap() < 2 && !marking.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "the enqueue did not queue behind the mark");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let queued = !marking.is_finished();
        in_flight.commit().await.unwrap();
        let marked = marking.await.unwrap();
        enqueuing.await.unwrap();
        match marked {
            Ok(reply) if queued => {
                assert!(written(reply));
                assert_eq!(next(&mut listener).await.0, channel, "the enqueue behind the mark did not notify");
                return;
            }
            // The mark gave up before the enqueue queued: the enqueue went through unnotified.
            Err(DbFailure::LockTimeout(_)) if try_ < 10 => assert!(nothing_heard(&mut listener).await),
            other => panic!("try {try_}: the mark {other:?}, the enqueue queued behind it: {queued}"),
        }
    }
}

async fn next(listener: &mut PgListener) -> (String, String) {
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await.expect("a notification").unwrap();
    (note.channel().to_owned(), note.payload().to_owned())
}

#[tokio::test]
async fn waiting_for_results_with_a_timeout_and_through_a_router() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    let id = store.enqueue(NewTask::new("t", json!(null))).await.unwrap();
    let timeout = tokio::time::sleep(Duration::from_millis(200));
    let error = store.wait_result(id, timeout).await.unwrap_err();
    assert!(matches!(error, WaitError::Timeout(t) if t == id));
    assert_eq!(error.code(), ErrorCode::WaitTimeout);
    let missing = store.wait_result(TaskId(999_999), tokio::time::sleep(Duration::from_secs(5))).await.unwrap_err();
    assert_eq!(missing.code(), ErrorCode::TaskNotFound);

    let router = DoneRouter::new();
    let routing = tokio::spawn({
        let (router, store) = (router.clone(), store.clone());
        async move { router.run(&store).await }
    });
    let waiter = tokio::spawn({
        let store = store.clone();
        async move { store.wait_result(id, tokio::time::sleep(Duration::from_secs(10))).await }
    });
    let routed = tokio::spawn({
        let (store, router) = (store.clone(), router.clone());
        async move { store.wait_result_with(&router, id, tokio::time::sleep(Duration::from_secs(10))).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = claim_and_start(&store, "w", 1).await;
    let request = DbRequest::Finish {
        worker: WorkerId("w".into()),
        completions: vec![Completion {
            task: held[0],
            outcome: FinishOutcome::Completed(json!({"ok": true})),
            args: None,
        }],
    };
    store.execute(&request).await.unwrap();
    for record in [waiter.await.unwrap().unwrap(), routed.await.unwrap().unwrap()] {
        assert_eq!((record.state, record.result), (TaskState::Completed, Some(json!({"ok": true}))));
    }
    routing.abort();
}

#[tokio::test]
async fn failures_map_onto_the_protocol() {
    let db = TestDb::new().await;
    // A schema that was never migrated: the database rejects the statements.
    let missing = PgStore::new(db.pool(1).await, PgSchema::new("no_such_schema").unwrap(), AppConfig::default());
    let request = DbRequest::DeregisterWorker(WorkerId("w".into()));
    assert!(matches!(missing.execute(&request).await, Err(DbFailure::Rejected(_))));
    // A closed pool: unavailable, nothing sent.
    let store = db.store(AppConfig::default(), 1).await;
    store.pool().close().await;
    assert!(matches!(store.execute(&request).await, Err(DbFailure::Unavailable(_))));
}

#[tokio::test]
async fn plain_enqueues_keep_task_order_times_and_flags() {
    let db = TestDb::new().await;
    let store = db.store(custom(&["a", "b"]), 4).await;
    // One task: the single-row statement, with a delay and flags.
    let delayed =
        store.enqueue(NewTask::new("t", json!("later")).run_at(RunAt::DelayMs(60_000)).flag("slow")).await.unwrap();
    let record = store.get(delayed).await.unwrap().unwrap();
    assert_eq!(record.run_at.0 - record.enqueued_at.0, 60_000);
    assert_eq!((record.args, record.flags), (json!("later"), vec!["slow".to_owned()]));
    // A batch without keys or good-until: the plain insert; each id names its own task.
    let tasks = (0..300)
        .map(|i| NewTask::new("t", json!(i)).queue(if i % 3 == 0 { "a" } else { "b" }).priority((i % 5) as i16));
    let ids = store.enqueue_many(tasks.collect()).await.unwrap();
    for (i, id) in ids.iter().enumerate() {
        let record = store.get(*id).await.unwrap().unwrap();
        assert_eq!(record.args, json!(i), "task {i}");
        assert_eq!((record.queue.as_str(), record.priority), (if i % 3 == 0 { "a" } else { "b" }, (i % 5) as i16));
        assert_eq!(record.run_at, record.enqueued_at);
    }
    // A batch of one kind due now: the insert with the arguments as its only array.
    let ids = store.enqueue_many((0..300).map(|i| NewTask::new("u", json!([i])).queue("a").priority(-3)).collect());
    let ids = ids.await.unwrap();
    assert_eq!(ids.len(), 300);
    for (i, id) in ids.iter().enumerate() {
        let record = store.get(*id).await.unwrap().unwrap();
        assert_eq!((record.name.as_str(), &record.args), ("u", &json!([i])), "task {i}");
        assert_eq!((record.queue.as_str(), record.priority, record.flags.len()), ("a", -3, 0));
        assert_eq!(record.run_at, record.enqueued_at);
    }
}

#[tokio::test]
async fn a_full_claim_says_whether_rows_were_left_behind() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    store.enqueue_many((0..5).map(|i| NewTask::new("t", json!(i)).priority(-(i as i16))).collect()).await.unwrap();
    let claim = |batch: u32| claim_request(&store, "w", batch, 0);
    // Claim order is priority first: the probe for more starts after the last row taken.
    let mut taken = Vec::new();
    for (batch, more) in [(2, true), (2, true), (2, false)] {
        match store.execute(&claim(batch)).await.unwrap() {
            DbReply::Claimed { tasks, more: reported, .. } => {
                assert_eq!(reported, more, "after {taken:?}");
                taken.extend(tasks.iter().map(|t| t.args.clone()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(taken, [4, 3, 2, 1, 0].map(|i| json!(i)));
}

/// A pass through a backlog claims from its floor on: more urgent tasks are left (to the
/// worker's urgent claims) and not counted as more.
#[tokio::test]
async fn a_claim_with_a_floor_leaves_more_urgent_tasks() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    store.enqueue_many([-1_i16, 0, 1].map(|p| NewTask::new("t", json!(p)).priority(p)).to_vec()).await.unwrap();
    let mut floored =
        ClaimPolicy::from_config(store.app(), &WorkerConfig { concurrency: 8, ..WorkerConfig::default() });
    floored.min_priority = Some(0);
    let request = |policy: ClaimPolicy| DbRequest::Claim {
        worker: WorkerId("w".into()),
        token: 1,
        policy: Arc::new(policy),
        my_running: 0,
        my_claimed: 0,
        start_now: 0,
        lease_ms: 60_000,
    };
    let taken = |reply: DbReply| match reply {
        DbReply::Claimed { tasks, more, .. } => (tasks.iter().map(|t| t.priority).collect::<Vec<_>>(), more),
        other => panic!("unexpected {other:?}"),
    };
    assert_eq!(taken(store.execute(&request(floored.clone())).await.unwrap()), (vec![0, 1], false));
    floored.min_priority = None;
    assert_eq!(taken(store.execute(&request(floored)).await.unwrap()), (vec![-1], false));
}

/// Enqueues without keys announce their most urgent priority and earliest run-at. A claim from
/// a run-at takes, and counts as more, only the Pending tasks due then or later; lapsed claims
/// it takes whatever their run-at (nothing announces them).
#[tokio::test]
async fn enqueues_announce_their_run_at_and_a_claim_can_start_from_one() {
    let db = TestDb::new().await;
    // One connection, so that the pinned clock is every statement's.
    let store = db.store(AppConfig::default(), 1).await;
    let mut listener = listening(&db, &store.schema().queue_channel("default")).await;
    // A worker waits: client enqueues notify.
    register(&store, "w").await;
    store.execute(&set_waiting("w", true)).await.unwrap();
    let t0 = canter::store::DbTime(1_800_000_000_000);
    let pin = |at: canter::store::DbTime| pg::pin_clock(store.pool(), store.schema(), at);
    let policy = ClaimPolicy::from_config(store.app(), &WorkerConfig { concurrency: 8, ..WorkerConfig::default() });
    let request = |min_run_at: Option<i64>| DbRequest::Claim {
        worker: WorkerId("w".into()),
        token: 1,
        policy: Arc::new(ClaimPolicy { min_run_at: min_run_at.map(canter::store::DbTime), ..policy.clone() }),
        my_running: 0,
        my_claimed: 0,
        start_now: 0,
        lease_ms: 500,
    };
    let taken = |reply: DbReply| match reply {
        DbReply::Claimed { tasks, more, .. } => (tasks.iter().map(|t| t.id.0).collect::<Vec<_>>(), more),
        other => panic!("unexpected {other:?}"),
    };
    pin(t0).await;
    let a = store.enqueue(NewTask::new("t", json!("a"))).await.unwrap();
    assert_eq!(listener.recv().await.unwrap().payload(), format!("0 {}", t0.0));
    assert_eq!(taken(store.execute(&request(None)).await.unwrap()), (vec![a.0], false));
    pin(t0.plus_ms(1_000)).await;
    let b = store.enqueue_many(vec![NewTask::new("t", json!("b")).priority(3)]).await.unwrap()[0];
    assert_eq!(listener.recv().await.unwrap().payload(), format!("3 {}", t0.0 + 1_000));
    pin(t0.plus_ms(2_000)).await;
    let c = store.enqueue(NewTask::new("t", json!("c"))).await.unwrap();
    assert_eq!(listener.recv().await.unwrap().payload(), format!("0 {}", t0.0 + 2_000));
    // a's claim lapsed at t0 + 500: taken again; b, due before the bound, is left and not
    // counted as more.
    assert_eq!(taken(store.execute(&request(Some(t0.0 + 1_500))).await.unwrap()), (vec![a.0, c.0], false));
    assert_eq!(taken(store.execute(&request(None)).await.unwrap()), (vec![b.0], false));
}

/// A claim commits synchronously. It once set `synchronous_commit = off` for its transaction
/// (0.2 ms of a one-task claim): after a server crash its lease increment could be lost while
/// the worker still held the task under the new lease, and the next claim would hand the same
/// lease out again; fencing needs leases that never repeat.
#[tokio::test]
async fn a_claim_waits_for_its_commit_to_be_flushed() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let mut conn = store.pool().acquire().await.unwrap();
    let show = || sqlx::query_scalar::<_, String>("SHOW synchronous_commit");
    assert_eq!(show().fetch_one(&mut *conn).await.unwrap(), "on");
    let claim = pg::claim_call(store.schema(), false);
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(claim)).execute(&mut *conn).await.unwrap();
    assert_eq!(show().fetch_one(&mut *conn).await.unwrap(), "on");
    sqlx::raw_sql("COMMIT").execute(&mut *conn).await.unwrap();
    assert_eq!(show().fetch_one(&mut *conn).await.unwrap(), "on");
}

/// The claim index keys queues by `hashtext(queue)`; two queues with the same hash share its
/// key range, and the claim must still take only its own queue's rows.
#[tokio::test]
async fn queues_whose_names_share_a_hash_stay_apart() {
    let db = TestDb::new().await;
    let (mine, other) = ("q22137", "q190411");
    let store = db.store(custom(&[mine, other]), 4).await;
    let same: bool = sqlx::query_scalar("SELECT hashtext($1) = hashtext($2)")
        .bind(mine)
        .bind(other)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(same, "the two queue names no longer share a hash");
    // In the shared key range the other queue's rows come both before this queue's (priority
    // -1) and after them (priority 1): the pass must skip the first, and its probe for rows
    // left behind (a full pass of 3) must not count the last.
    let tasks = (0..9)
        .map(|i| {
            let (queue, priority) = match i {
                0..3 => (other, -1),
                3..6 => (mine, 0),
                _ => (other, 1),
            };
            NewTask::new("t", json!(i)).queue(queue).priority(priority)
        })
        .collect();
    store.enqueue_many(tasks).await.unwrap();
    let config =
        WorkerConfig { concurrency: 3, max_claim_batch: 3, queues: vec![mine.into()], ..WorkerConfig::default() };
    let claim = claim_with(&store, "w", &config, 0);
    match store.execute(&claim).await.unwrap() {
        DbReply::Claimed { tasks, more, .. } => {
            let taken: Vec<_> = tasks.iter().map(|t| (t.queue.clone(), t.args.clone())).collect();
            assert_eq!(taken, [3, 4, 5].map(|i| (mine.to_string(), json!(i))));
            assert!(!more, "the other queue's rows are not this claim's");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn closing_the_pool_does_not_wait_for_the_connections_a_store_keeps() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    // A kept connection serves the next statement.
    store.enqueue(NewTask::new("t", json!(1))).await.unwrap();
    store.enqueue(NewTask::new("t", json!(2))).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), store.pool().close()).await.expect("the pool closed");
    let after = store.enqueue(NewTask::new("t", json!(3))).await;
    assert!(matches!(after, Err(PgEnqueueError::Database(sqlx::Error::PoolClosed))), "{after:?}");
}

#[tokio::test]
async fn an_urgent_claim_does_not_wait_for_a_connection_while_other_requests_hold_them_all() {
    let db = TestDb::new().await;
    // A pool of two: the store keeps one connection of its own between statements.
    let store = db.store(AppConfig::default(), 2).await;
    let other = db.store(AppConfig::default(), 1).await;
    let mut policy = ClaimPolicy::from_config(store.app(), &WorkerConfig::default());
    let claim = |policy: &ClaimPolicy, token| DbRequest::Claim {
        worker: WorkerId("w".into()),
        token,
        policy: Arc::new(policy.clone()),
        my_running: 0,
        my_claimed: 0,
        start_now: 0,
        lease_ms: 60_000,
    };
    let regular = claim(&policy, 1);
    policy.max_priority = Some(-1);
    // The first urgent claim takes a connection and keeps it for the next ones.
    assert!(matches!(store.execute(&claim(&policy, 2)).await, Ok(DbReply::Claimed { .. })));

    // A draining worker's requests hold every other connection: one waits for a row lock
    // (on the connection the store kept, if it kept one), the pool's are taken.
    let locked = other.enqueue(NewTask::new("t", json!(0))).await.unwrap();
    let holder_pool = db.pool(1).await;
    let mut holder = holder_pool.begin().await.unwrap();
    let lock = format!("SELECT 1 FROM {}.tasks WHERE id = $1 FOR UPDATE", store.schema().quoted());
    sqlx::query(sqlx::AssertSqlSafe(lock)).bind(locked.0).execute(&mut *holder).await.unwrap();
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.cancel(locked).await }
    });
    let observer = db.pool(1).await;
    let sessions = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = $1";
    for _ in 0..500 {
        let n: i64 = sqlx::query_scalar(sessions).bind(db.schema.name()).fetch_one(&observer).await.unwrap();
        if n > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut held = Vec::new();
    while let Ok(conn) = tokio::time::timeout(Duration::from_millis(300), store.pool().acquire()).await {
        held.push(conn.unwrap());
    }
    let id = other.enqueue(NewTask::new("t", json!(1)).priority(-1)).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_millis(300), store.execute(&regular)).await;
    assert!(waited.is_err(), "a regular claim waits for a connection: {waited:?}");
    // Well within the lock wait's 5 s, so the waiting request holds its connection all along.
    let urgent = tokio::time::timeout(Duration::from_secs(2), store.execute(&claim(&policy, 3))).await;
    match urgent {
        Ok(Ok(DbReply::Claimed { tasks, .. })) => assert_eq!(tasks.iter().map(|t| t.id).collect::<Vec<_>>(), [id]),
        other => panic!("the urgent claim waited or failed: {other:?}"),
    }
    holder.rollback().await.unwrap();
    drop(held);
    waiting.await.unwrap().expect("the cancel, once the row is free");
    observer.close().await;
}
