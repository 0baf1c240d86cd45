//! Connections that keep session state come from the session pool when one is given (for a
//! main pool behind PgBouncer in transaction mode): the worker's LISTEN and its liveness token
//! are sessions of that pool, none of the main pool's, and wake-ups and result waits work.

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::sync::Arc;
use std::time::Duration;

use canter_tokio::{AppConfig, Client, Registry, TaskError, TokioRuntime, Worker, WorkerConfig};
use sqlx::postgres::PgConnectOptions;

/// A pool whose sessions are named `name` (pg_stat_activity's application_name).
fn named_pool(url: &str, name: &str, size: u32) -> sqlx::PgPool {
    let options: PgConnectOptions = url.parse().expect("database url");
    canter::postgres::pool_options(&options).max_connections(size).connect_lazy_with(options.application_name(name))
}

/// A main pool and a session pool on `db`'s server, their sessions named `{schema}-main` and
/// `{schema}-session`: the names, then the pools.
fn two_pools(db: &pg::TestDb) -> ((String, String), (sqlx::PgPool, sqlx::PgPool)) {
    let names = (format!("{}-main", db.schema.name()), format!("{}-session", db.schema.name()));
    let pools = (named_pool(&db.url, &names.0, 4), named_pool(&db.url, &names.1, 3));
    (names, pools)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_lives_on_the_session_pool() {
    let db = pg::TestDb::new().await;
    let ((main_name, session_name), (main, session)) = two_pools(&db);
    let mut registry = Registry::new();
    let double = registry.register("double", |n: i64, _| async move { Ok::<_, TaskError>(n * 2) }).unwrap();
    // Event-driven only: the task below starts only if the LISTEN on the session pool works.
    let config = WorkerConfig {
        deployment_mode: canter_tokio::DeploymentMode::EventDrivenOnly,
        poll_interval_ms: 300_000,
        ..WorkerConfig::default()
    };
    let worker = Worker::new(main.clone(), AppConfig::default(), config, Arc::new(registry))
        .unwrap()
        .schema(db.schema.clone())
        .session_pool(session.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));

    let observer = db.pool(1).await;
    // The worker listens, and holds its liveness token, on sessions of the session pool.
    let sessions = |kind: &'static str| {
        let (observer, main_name, session_name) = (observer.clone(), main_name.clone(), session_name.clone());
        async move {
            let sql = match kind {
                "listen" => {
                    "SELECT application_name FROM pg_stat_activity WHERE query ILIKE 'LISTEN%' AND application_name IN ($1, $2)"
                }
                _ => {
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'advisory' AND a.application_name IN ($1, $2)"
                }
            };
            sqlx::query_scalar::<_, String>(sql).bind(main_name).bind(session_name).fetch_all(&observer).await.unwrap()
        }
    };
    let mut seen = (Vec::new(), Vec::new());
    for _ in 0..200 {
        seen = (sessions("listen").await, sessions("token").await);
        if !seen.0.is_empty() && !seen.1.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen.0, vec![session_name.clone()], "the worker's LISTEN session");
    assert_eq!(seen.1, vec![session_name.clone()], "the liveness token's session");

    let client = Client::new(Arc::new(TokioRuntime), main.clone(), db.schema.clone(), AppConfig::default())
        .session_pool(session.clone());
    let handle = client.enqueue(&double, &21).await.expect("enqueue");
    assert_eq!(handle.wait(Duration::from_secs(20)).await.expect("woken and waited for"), 42);
    // The client's wait listened on the session pool too: its session registered as a waiter
    // (its last statement), and no session of the main pool did either.
    let waiters: Vec<String> = sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity WHERE (query ILIKE 'LISTEN%' OR query ILIKE '%register_listener%') \
         AND application_name IN ($1, $2) ORDER BY 1",
    )
    .bind(&main_name)
    .bind(&session_name)
    .fetch_all(&observer)
    .await
    .unwrap();
    assert_eq!(waiters, vec![session_name.clone(), session_name.clone()], "the worker's and the client's");

    stop.send(()).expect("the worker runs");
    running.await.expect("joined").expect("served");
    drop(client);
    main.close().await;
    session.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_first_write_migrates_on_the_session_pool() {
    let db = pg::TestDb::unmigrated().await;
    let ((main_name, session_name), (main, session)) = two_pools(&db);
    // Another session holds the migrate lock: the migration waits for it, and shows where.
    let observer = db.pool(1).await;
    let mut holder = observer.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(canter::postgres::MIGRATE_LOCK_KEY)
        .execute(&mut *holder)
        .await
        .unwrap();
    let client = Client::new(Arc::new(TokioRuntime), main.clone(), db.schema.clone(), AppConfig::default())
        .session_pool(session.clone());
    let noop: canter_tokio::TaskHandle<(), ()> = canter_tokio::TaskHandle::named("noop");
    let enqueue = tokio::spawn(async move { client.enqueue(&noop, &()).await.map(|handle| handle.id()) });
    let waiting = "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                   WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name IN ($1, $2)";
    let mut waiters = Vec::new();
    for _ in 0..400 {
        waiters = sqlx::query_scalar::<_, String>(waiting)
            .bind(&main_name)
            .bind(&session_name)
            .fetch_all(&mut *holder)
            .await
            .unwrap();
        if !waiters.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(waiters, vec![session_name.clone()], "the migration waits on a session of the session pool");
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(canter::postgres::MIGRATE_LOCK_KEY)
        .execute(&mut *holder)
        .await
        .unwrap();
    enqueue.await.unwrap().expect("migrated, then enqueued");
    drop(holder);
    main.close().await;
    session.close().await;
}
