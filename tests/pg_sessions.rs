//! Sessions that end under Canter's statements (issue 19, item 8). A session the server ended
//! (`pg_terminate_backend`, a restart: a `FATAL` error in place of the reply) did not apply its
//! statement, so worker requests, enqueues and operator calls are sent again on another
//! connection. A connection that broke with no word from the server (here a proxy cutting it)
//! lost the reply: reads and deduplicating writes are sent again, other writes fail saying they
//! may or may not have committed — and here they did.

#[path = "common/admin.rs"]
mod admin;
#[path = "common/pg.rs"]
mod pg;

use admin::Admin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, WorkerConfig};
use canter::postgres::{PgAdminError, PgEnqueueError, PgStore};
use canter::store::Cancelled;
use canter::store::{DbReply, DbRequest, NewTask};
use canter::task::{TaskId, TaskState, WorkerId};
use pg::TestDb;
use serde_json::json;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A TCP proxy to the test server whose connections can be cut at once, without a word to the
/// client or the server (both see the stream end).
struct Proxy {
    port: u16,
    links: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: AbortHandle,
}

impl Proxy {
    async fn start(server: &PgConnectOptions) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        assert!(!server.get_host().starts_with('/'), "the proxy needs a server on TCP");
        let target = format!("{}:{}", server.get_host(), server.get_port());
        let links: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accepted = links.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                accepted.lock().unwrap_or_else(PoisonError::into_inner).push(link.abort_handle());
            }
        })
        .abort_handle();
        Proxy { port, links, accepting }
    }

    /// Breaks every connection made so far; new ones go through.
    fn cut(&self) {
        for link in self.links.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
            link.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cut();
    }
}

fn options(db: &TestDb) -> PgConnectOptions {
    let options: PgConnectOptions = db.url.parse().expect("database url");
    options.application_name(db.schema.name()).disable_statement_logging()
}

/// A store of `db` whose connections go through `proxy`.
async fn store_through(db: &TestDb, proxy: &Proxy) -> PgStore {
    let options = options(db);
    let pool = canter::postgres::pool_options(&options)
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.host("127.0.0.1").port(proxy.port))
        .await
        .expect("connect through the proxy");
    PgStore::new(pool, db.schema.clone(), AppConfig::default())
}

/// A session of its own (not the store's, so not terminated with them).
async fn session(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&options(db).application_name("canter-test-bystander")).await.expect("connect")
}

/// Ends every session of the store under test (those named after the test's schema).
async fn terminate_sessions(db: &TestDb, killer: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(db.schema.name())
    .fetch_one(killer)
    .await
    .expect("terminate the store's sessions")
}

/// Opens and keeps every connection `store` may hold, so that all of them die with a kill:
/// concurrent reads until the server shows three sessions of the store (a pool of two and the
/// one connection it keeps), at most 50 rounds (on a loaded machine the reads of a round may
/// not overlap).
async fn fill_connections(store: &PgStore, db: &TestDb, observer: &mut PgConnection) {
    for _ in 0..50 {
        let reads = (0..4).map(|_| store.counts());
        for read in futures::future::join_all(reads).await {
            read.expect("count");
        }
        let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(db.schema.name())
            .fetch_one(&mut *observer)
            .await
            .expect("read the activity");
        if sessions >= 3 {
            return;
        }
    }
}

async fn live_tasks(db: &TestDb, conn: &mut PgConnection) -> i64 {
    let sql = format!("SELECT count(*) FROM {}.tasks", db.schema.quoted());
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(conn).await.expect("count the tasks")
}

/// Takes `tasks` for good in `conn`'s open transaction: every statement on it waits.
async fn lock_tasks(db: &TestDb, conn: &mut PgConnection) {
    let sql = format!("BEGIN; LOCK TABLE {}.tasks IN ACCESS EXCLUSIVE MODE", db.schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(conn).await.expect("lock the tasks table");
}

/// Waits until `n` sessions of the store wait for a lock.
async fn waiting_for_a_lock(db: &TestDb, conn: &mut PgConnection, n: i64) {
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
        )
        .bind(db.schema.name())
        .fetch_one(&mut *conn)
        .await
        .expect("read the activity");
        if waiting >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no statement of the store waited for the lock");
}

/// A store behind a proxy that can cut its connections, and two sessions of the test's own:
/// one to hold a lock, one to watch.
struct Cuttable {
    db: TestDb,
    proxy: Proxy,
    store: PgStore,
    holder: PgConnection,
    observer: PgConnection,
}

impl Cuttable {
    async fn new() -> Cuttable {
        let db = TestDb::new().await;
        let proxy = Proxy::start(&options(&db)).await;
        let store = store_through(&db, &proxy).await;
        let (holder, observer) = (session(&db).await, session(&db).await);
        Cuttable { db, proxy, store, holder, observer }
    }

    /// Runs `call` (a statement of the store) while `holder` locks `tasks`: once the statement
    /// waits for the lock, the proxy cuts its connection; with `resent`, it waits until the
    /// statement waits again, sent again on a new connection; then the lock goes. What the
    /// call returned.
    async fn cut_while_it_waits<T: Send + 'static>(
        &mut self,
        resent: bool,
        call: impl Future<Output = T> + Send + 'static,
    ) -> T {
        lock_tasks(&self.db, &mut self.holder).await;
        let call = tokio::spawn(call);
        waiting_for_a_lock(&self.db, &mut self.observer, 1).await;
        self.proxy.cut();
        if resent {
            // The first statement's backend still waits beside the one sent again.
            waiting_for_a_lock(&self.db, &mut self.observer, 2).await;
        }
        sqlx::raw_sql("COMMIT").execute(&mut self.holder).await.expect("release the lock");
        call.await.expect("the call's task")
    }

    async fn live_tasks(&mut self) -> i64 {
        live_tasks(&self.db, &mut self.observer).await
    }
}

#[tokio::test]
async fn worker_requests_enqueues_and_operator_calls_are_sent_again_when_their_sessions_were_ended() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let mut killer = session(&db).await;
    let worker = WorkerId("w".into());
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &WorkerConfig::default()));
    let claim = DbRequest::Claim {
        worker: worker.clone(),
        token: 1,
        policy,
        my_running: 0,
        my_claimed: 0,
        start_now: 0,
        lease_ms: 60_000,
    };

    fill_connections(&store, &db, &mut killer).await;
    assert!(terminate_sessions(&db, &mut killer).await >= 3, "the kept connection and the pool's");
    let id = store.enqueue(NewTask::new("t", json!(1))).await.expect("a plain enqueue on a new session");
    assert_eq!(live_tasks(&db, &mut killer).await, 1, "written once");

    fill_connections(&store, &db, &mut killer).await;
    terminate_sessions(&db, &mut killer).await;
    match store.execute(&claim).await {
        Ok(DbReply::Claimed { tasks, .. }) => assert_eq!(tasks.iter().map(|t| t.id).collect::<Vec<_>>(), [id]),
        other => panic!("a claim after the kill: {other:?}"),
    }

    fill_connections(&store, &db, &mut killer).await;
    terminate_sessions(&db, &mut killer).await;
    let cancelled = store.cancel(id).await.expect("a cancel on a new session");
    assert_eq!(cancelled, Cancelled::Claimed { worker });

    fill_connections(&store, &db, &mut killer).await;
    terminate_sessions(&db, &mut killer).await;
    let record = store.get(id).await.expect("a read on a new session").expect("the task");
    assert_eq!(record.state, TaskState::Cancelled);
}

#[tokio::test]
async fn a_write_whose_reply_was_lost_may_have_committed_and_says_so() {
    let mut cut = Cuttable::new().await;
    let store = cut.store.clone();

    // Prepared on the kept connection first, so that the enqueue waits at its execution (a
    // statement still to be prepared waits while being parsed, and never runs).
    store.enqueue(NewTask::new("t", json!(0))).await.expect("the first enqueue");
    let enqueue = {
        let store = store.clone();
        async move { store.enqueue(NewTask::new("t", json!(1))).await }
    };
    let enqueued = cut.cut_while_it_waits(false, enqueue).await;
    let error = enqueued.expect_err("the reply was lost");
    assert!(matches!(error, PgEnqueueError::OutcomeUnknown(_)), "{error:?}");
    assert!(error.may_have_committed());
    assert!(error.to_string().contains("may or may not have committed"), "{error}");
    // And it had: the server applied it after the client was gone.
    let mut written = 0;
    for _ in 0..200 {
        written = cut.live_tasks().await;
        if written == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(written, 2);

    // An operator write alike.
    let id = store.list(&Default::default()).await.expect("list")[0].id;
    let cancel = {
        let store = store.clone();
        async move { store.cancel(id).await }
    };
    let cancelled = cut.cut_while_it_waits(false, cancel).await;
    let error = cancelled.expect_err("the reply was lost");
    assert!(matches!(error, PgAdminError::OutcomeUnknown(_)), "{error:?}");
}

#[tokio::test]
async fn reads_and_deduplicating_enqueues_whose_replies_were_lost_are_sent_again() {
    let mut cut = Cuttable::new().await;
    let store = cut.store.clone();
    let keyed = || NewTask::new("t", json!({"order": 7})).idempotency_key("order-7");

    let enqueue = {
        let store = store.clone();
        async move { store.enqueue(keyed()).await }
    };
    let enqueued = cut.cut_while_it_waits(true, enqueue).await;
    let id: TaskId = enqueued.expect("sent again");
    assert_eq!(cut.live_tasks().await, 1, "applied once, though sent twice");
    assert_eq!(store.enqueue(keyed()).await.expect("the key names it"), id);

    let read = {
        let store = store.clone();
        async move { store.get(id).await }
    };
    let record = cut.cut_while_it_waits(true, read).await;
    let record = record.expect("read again").expect("the task");
    assert_eq!(record.id, id);
}
