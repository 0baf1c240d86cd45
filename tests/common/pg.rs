//! PostgreSQL for the store's tests.
//!
//! The server is `DATABASE_URL` if set, else `postgres://postgres@127.0.0.1:5432/test`. If that
//! is unreachable, a throwaway server is started from the installed PostgreSQL: as root (where
//! `initdb` refuses to run) a cluster `canter_tests` on port 5433 made with Debian's
//! `pg_createcluster` and left running for the next test binary; otherwise one per test binary
//! with `pgtemp` (the binaries in `/usr/lib/postgresql/<version>/bin` are searched when they
//! are not on `PATH`).
//!
//! Every test gets its own schema (`t<pid>_<n>`), migrated with the crate's migrations and
//! dropped when the [`TestDb`] is dropped, so tests run in parallel on one database. Its clock
//! functions are then replaced by ones a test can pin per session ([`PINNABLE_CLOCKS`],
//! [`pin_clock`]); the migrations' own read the database's clock alone.

#![allow(dead_code, unreachable_pub)]

#[path = "cluster.rs"]
pub mod cluster;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use canter::config::AppConfig;
use canter::postgres::{PgSchema, PgStore, migrate};
use canter::store::DbTime;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

/// The database the tests use when `DATABASE_URL` is not set.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// A migrated schema of its own for one test.
pub struct TestDb {
    /// The server's URL.
    pub url: String,
    /// The schema.
    pub schema: PgSchema,
}

static SERVER: OnceLock<String> = OnceLock::new();
static TEMP: OnceLock<pgtemp::PgTempDB> = OnceLock::new();
static NEXT: AtomicU32 = AtomicU32::new(0);

/// The URL of a reachable server, starting a throwaway one if needed.
pub async fn server_url() -> String {
    if let Some(url) = SERVER.get() {
        return url.clone();
    }
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let url = match PgConnection::connect(&url).await {
        Ok(conn) => {
            let _ = conn.close().await;
            url
        }
        Err(error) if is_root() => {
            const THROWAWAY: &str = "postgres://postgres@127.0.0.1:5433/postgres";
            eprintln!("PostgreSQL at {url} is unreachable ({error}); using a throwaway cluster at {THROWAWAY}");
            // One creator at a time, in this process: tests start concurrently.
            static CREATING: std::sync::Mutex<()> = std::sync::Mutex::new(());
            let _creating = CREATING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if std::net::TcpStream::connect("127.0.0.1:5433").is_err() {
                let mut made = cluster::Cluster::start("canter_tests", 5433);
                // Left running: later test binaries reuse it.
                made.remove_on_drop = false;
            }
            THROWAWAY.to_owned()
        }
        Err(error) => {
            eprintln!("PostgreSQL at {url} is unreachable ({error}); starting a throwaway server with pgtemp");
            let temp = TEMP.get_or_init(|| {
                let mut builder = pgtemp::PgTempDB::builder();
                if let Some(bin) = postgres_bin_dir() {
                    builder = builder.with_bin_path(bin);
                }
                std::thread::spawn(move || builder.start()).join().expect("pgtemp failed to start PostgreSQL")
            });
            temp.connection_uri()
        }
    };
    SERVER.get_or_init(|| url).clone()
}

fn is_root() -> bool {
    std::process::Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// Where `initdb` is, when it is not on `PATH`: the newest `/usr/lib/postgresql/*/bin`.
fn postgres_bin_dir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join("initdb").exists()))
        .unwrap_or(false);
    if on_path {
        return None;
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path().join("bin")))
        .filter(|dir| dir.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|dir| {
        dir.parent().and_then(|v| v.file_name()).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok())
    });
    dirs.pop()
}

/// The schema's clock functions a test may pin with `SET canter.now` ([`pin_clock`]): each
/// function's name, what it reads when the setting is unset or empty, and its volatility.
/// Production's read the clock alone; [`TestDb::new`] replaces these in the test's schema.
pub const PINNABLE_CLOCKS: &[(&str, &str, &str)] =
    &[("db_now", "now()", "STABLE"), ("db_clock", "clock_timestamp()", "VOLATILE")];

/// Replaces the [`PINNABLE_CLOCKS`] of `schema` by functions that read `canter.now` first.
pub async fn install_clock_override(pool: &PgPool, schema: &PgSchema) {
    for (name, clock, volatility) in PINNABLE_CLOCKS {
        let sql = format!(
            "CREATE OR REPLACE FUNCTION {}.{name}() RETURNS timestamptz LANGUAGE sql {volatility} PARALLEL SAFE \
             AS $$ SELECT coalesce(nullif(current_setting('canter.now', true), '')::timestamptz, {clock}) $$",
            schema.quoted()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.expect("install the test clock");
    }
}

impl TestDb {
    /// A fresh schema, migrated, with clocks a test can pin ([`pin_clock`]).
    pub async fn new() -> TestDb {
        let db = TestDb::unmigrated().await;
        let pool = db.pool(2).await;
        migrate(&pool, &db.schema).await.expect("migrate");
        install_clock_override(&pool, &db.schema).await;
        pool.close().await;
        db
    }

    /// A fresh schema, migrated as in production: its clocks cannot be pinned.
    pub async fn production() -> TestDb {
        let db = TestDb::unmigrated().await;
        let pool = db.pool(2).await;
        migrate(&pool, &db.schema).await.expect("migrate");
        pool.close().await;
        db
    }

    /// A schema name of its own (dropped with the value), not created yet.
    pub async fn unmigrated() -> TestDb {
        let url = server_url().await;
        let name = format!("t{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let schema = PgSchema::new(&name).expect("test schema name");
        let db = TestDb { url, schema };
        let pool = db.pool(2).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {} CASCADE", db.schema.quoted())))
            .execute(&pool)
            .await
            .expect("drop a leftover schema");
        pool.close().await;
        db
    }

    /// A pool of at most `size` connections to the server, as Canter opens them (TCP_NODELAY:
    /// over TLS, which the server may offer, every longer message would wait ~40 ms without).
    pub async fn pool(&self, size: u32) -> PgPool {
        let options: PgConnectOptions = self.url.parse().expect("database url");
        canter::postgres::pool_options(&options)
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(30))
            // Tagged with the schema, so cleanup can end this test's sessions (see `Drop`).
            .connect_with(options.application_name(self.schema.name()).disable_statement_logging())
            .await
            .expect("connect")
    }

    /// A store in this schema on a pool of at most `size` connections.
    pub async fn store(&self, app: AppConfig, size: u32) -> PgStore {
        PgStore::new(self.pool(size).await, self.schema.clone(), app)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Async drop does not exist, and the test's runtime may be gone or busy: drop the
        // schema from a thread with a runtime of its own.
        let url = self.url.clone();
        let name = self.schema.name().to_owned();
        let drop = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema.quoted());
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            runtime.block_on(async move {
                let mut conn = PgConnection::connect(&url).await.ok()?;
                // A test that panicked may have left a transaction open that would block the
                // drop: end the test's own sessions first.
                sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
                    .bind(name)
                    .execute(&mut conn)
                    .await
                    .ok()?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&mut conn).await.ok()?;
                conn.close().await.ok()
            })
        })
        .join();
    }
}

/// Pins the database clock of every statement `pool` runs at `now` (the pool must have one
/// connection: the setting is per session). Only schemas made by [`TestDb::new`] read it.
///
/// The session also gates every child it can (`canter.gate_min_children` 1, migration 0018),
/// so that the scripts of a few steps compared with the memory store take the gated path.
pub async fn pin_clock<'e>(executor: impl sqlx::PgExecutor<'e>, schema: &PgSchema, now: DbTime) {
    let sql = format!(
        "SELECT set_config('canter.now', {}.at_ms($1)::text, false), set_config('canter.gate_min_children', '1', false)",
        schema.quoted()
    );
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now.0).execute(executor).await.expect("pin the clock");
}

/// A claim by worker `w`, holding nothing, under `policy`: starting `start_now` of what it
/// takes, the rest leased for 60 s.
pub fn claim_by_w(
    token: u64,
    policy: &std::sync::Arc<canter::budget::ClaimPolicy>,
    start_now: u32,
) -> canter::store::DbRequest {
    canter::store::DbRequest::Claim {
        worker: canter::task::WorkerId("w".into()),
        token,
        policy: std::sync::Arc::clone(policy),
        my_running: 0,
        my_claimed: 0,
        start_now,
        lease_ms: 60_000,
    }
}

/// A call of the schema's current claim function (`claim_tasks()`) for a worker `w` on the
/// default queue: a budget and start-now of 16, no caps, `hard` or soft cap mode, a priority
/// floor of 0 and a run-at bound of the epoch (the tests' tasks have priority 0 and run later;
/// the bounds are planned like the rest);
/// selects the number of rows it returns with a task (the last row, with no id, carries `more`).
pub fn claim_call(schema: &PgSchema, hard: bool) -> String {
    format!(
        "SELECT count(id) FROM {}.claim_tasks('w', 1, ARRAY['default'], ARRAY[NULL]::integer[], 16, {hard}, NULL, 0, \
         '{{}}', 16, 60000, ARRAY[false], NULL, NULL, 0::smallint, 0::bigint)",
        schema.quoted()
    )
}

/// Dead rows of `table` as the statistics count them, once they count at least `at_least`
/// (each backend reports its counts within a second or so of its transaction's end).
#[allow(dead_code)]
pub async fn dead_rows(store: &PgStore, table: &str, at_least: i64) -> i64 {
    let sql = "SELECT coalesce(max(n_dead_tup), 0) FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2";
    for _ in 0..100 {
        let dead: i64 =
            sqlx::query_scalar(sql).bind(store.schema().name()).bind(table).fetch_one(store.pool()).await.unwrap();
        if dead >= at_least {
            return dead;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{table} never counted {at_least} dead rows");
}

/// A database of its own on the test server, empty: for programs that make their own schemas
/// (the README's), which a shared database would leave behind for the next run.
pub struct FreshDatabase {
    server: String,
    name: String,
    /// Its URL.
    pub url: String,
}

impl FreshDatabase {
    /// Creates database `name` (dropping one left by an earlier run).
    pub async fn create(name: &str) -> FreshDatabase {
        let server = server_url().await;
        admin_sql(&server, format!("DROP DATABASE IF EXISTS {name}")).await;
        admin_sql(&server, format!("CREATE DATABASE {name}")).await;
        let (path, query) = server.split_once('?').map_or((server.as_str(), None), |(p, q)| (p, Some(q)));
        let (base, _) = path.rsplit_once('/').expect("a database in the URL");
        let url = format!("{base}/{name}{}", query.map_or_else(String::new, |q| format!("?{q}")));
        FreshDatabase { server, name: name.to_owned(), url }
    }

    /// Drops it, whoever is still connected.
    pub async fn drop_now(self) {
        admin_sql(&self.server, format!("DROP DATABASE {} WITH (FORCE)", self.name)).await;
    }
}

async fn admin_sql(server: &str, sql: String) {
    let mut conn = PgConnection::connect(server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.unwrap();
}
