//! [`PgStore`]: the worker machine's database requests, executed on PostgreSQL.
//!
//! Each [`DbRequest`] is one round trip (the reaper, which runs rarely, is one short
//! transaction): claims call the `claim_tasks` function of the schema, which locks rows of
//! `claim_locks` only when a cap needs a consistent count and otherwise is `FOR UPDATE SKIP
//! LOCKED` alone; starts
//! call `start_tasks`; finishes, heartbeats, releases and abandoned claims are single statements
//! over `unnest`ed arrays (see [`sql`](crate::postgres::sql)). Semantics are the memory store's,
//! reply for reply; the conformance suite (`tests/pg_conformance.rs`) compares them.
//!
//! # Failures
//!
//! [`PgStore::execute`] maps sqlx errors onto the protocol's [`DbFailure`]:
//! - no connection (the pool timed out or is closed, connecting failed) → `Unavailable`: the
//!   request was never sent;
//! - an I/O or protocol error once the request was sent, or a reply that cannot be decoded →
//!   `Unknown`: it may have been applied;
//! - a database error: serialization failures, deadlocks, shutdowns, connection exceptions and
//!   exhausted resources (SQLSTATE classes 08, 40, 53, 57P) → `Unavailable` (the transaction was
//!   rolled back, retrying is right); any other SQLSTATE → `Rejected` (a bug or a schema
//!   mismatch; nothing was applied).
//!
//! Before any of that, a request whose session the server ended under it (a `FATAL` error: a
//! terminated backend, a restart) is sent again at once on another connection (module
//! `replay`): it was not applied, and a lost session is not an outage.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres, Row};

use crate::config::AppConfig;
use crate::postgres::replay::{Replay, replayed};
use crate::postgres::schema::{MigrateSchemaError, PgSchema, migrate};
use crate::store::DbTime;
use crate::task::{TaskError, TaskLease, TaskState};

/// The longest duration sent to the database, in ms (about 3 170 years): longer ones are
/// clamped, so `now() + duration` stays within PostgreSQL's timestamp range.
pub const MAX_DURATION_MS: u64 = 100_000_000_000_000;

/// The latest [`DbTime`] sent to the database (about the year 255 000); later ones are
/// clamped. The earliest is about 4 300 BC.
pub const MAX_DB_TIME_MS: i64 = 8_000_000_000_000_000;
const MIN_DB_TIME_MS: i64 = -200_000_000_000_000;

/// The settings every session of Canter's carries, as `(name, value)`, so that no wait is
/// unbounded and the server gives up on a statement before its client does (the driver gives
/// up after 30 s, [`DriverOptions::request_timeout`](crate::driver::DriverOptions)):
///
/// - `statement_timeout` 25 s: a statement that runs (or waits to run) longer is cancelled and
///   rolled back, so it cannot commit after its worker stopped waiting for it;
/// - `lock_timeout` 5 s: a row or lock another transaction holds cannot stall a statement (and
///   every retry of it) for longer;
/// - `idle_in_transaction_session_timeout` 60 s: a transaction whose client stalled in the
///   middle of it releases its locks.
///
/// [`with_session_settings`] puts them on a pool's connect options (the adapters' `connect`
/// does); a pool built otherwise should carry them too.
pub const SESSION_SETTINGS: [(&str, &str); 3] =
    [("statement_timeout", "25s"), ("lock_timeout", "5s"), ("idle_in_transaction_session_timeout", "60s")];

/// The statement that begins the transaction of each statement sent through a pooler in
/// transaction mode (see [`PgSchema::transaction_pooled`]): the pooler drops startup
/// parameters, so [`SESSION_SETTINGS`] are set for the transaction (`SET LOCAL`), in the same
/// round trip.
pub(crate) fn pooled_begin() -> sqlx::SqlStr {
    use sqlx::SqlSafeStr;
    let mut text = String::from("BEGIN");
    for (name, value) in SESSION_SETTINGS {
        text.push_str(&format!("; SET LOCAL {name} = '{value}'"));
    }
    sqlx::AssertSqlSafe(text).into_sql_str()
}

/// `options` with [`SESSION_SETTINGS`] as startup parameters (no round trip per connection),
/// and sqlx's warning about statements slower than a second lowered to a debug line: Canter's
/// own big batches (a workflow of 50,000 steps, a finish of thousands) take that long by design,
/// and the warning quotes the whole statement (`CANTER_LOG=sqlx=debug` shows them all).
pub fn with_session_settings(options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
    use sqlx::ConnectOptions;
    options.options(SESSION_SETTINGS).log_slow_statements(log::LevelFilter::Debug, std::time::Duration::from_secs(1))
}

/// A store of tasks in PostgreSQL: executes the worker machine's requests, and offers enqueue
/// ([`enqueue`](PgStore::enqueue)), inspection and result waiting
/// ([`get`](PgStore::get), [`wait_result`](PgStore::wait_result)).
///
/// Cheap to clone: a pool handle, the schema and the app configuration behind `Arc`s. Clones
/// share the connections the store keeps between statements (up to one less than the pool's
/// size, detached from it, and one more for a worker's urgent claims alone): sqlx tests a
/// connection with a round trip every time it goes back to its pool. The pool may open others
/// in place of detached ones, so a store holds about as many connections as it has concurrent
/// callers, and at most twice its pool's size.
#[derive(Debug, Clone)]
pub struct PgStore {
    pub(super) pool: PgPool,
    /// Connections that keep session state (LISTEN, the liveness token), when not `pool`'s.
    pub(super) session_pool: Option<PgPool>,
    pub(super) schema: PgSchema,
    pub(super) app: Arc<AppConfig>,
    pub(super) kept: Arc<KeptConnections>,
    /// The connection kept for urgent claims alone (see [`Lane::Urgent`]): at most one.
    pub(super) urgent: Arc<KeptConnections>,
    pub(crate) vacuum: Arc<super::vacuum::VacuumMemory>,
}

/// Connections kept between statements. sqlx tests every connection that goes back to its pool
/// with a round trip (a ping, in a task it spawns), so a worker sending a statement or two per
/// batch of tasks, or a client enqueueing one task at a time, would pay a second round trip and
/// a wake-up of another thread per statement. A kept connection is detached from the pool (so
/// closing the pool never waits for the store) and is kept only after a statement succeeded;
/// one unused for [`KeptConnections::MAX_IDLE`] is closed rather than trusted.
///
/// Up to one less than the pool's size are kept, so that about as many concurrent callers as
/// the pool serves skip the ping: with 8 producers enqueueing one task at a time on a pool of
/// 9, keeping 3 (as before) gave 4,166 tasks/s and keeping 8 11,455/s, raw SQL 12,894/s
/// (`canter bench --workload enqueue --producers 8`). Detached connections no longer count in
/// the pool, which may open others in their place: a store holds about as many connections as
/// it has concurrent callers, and at most twice its pool's size (with the urgent claims' one).
#[derive(Debug)]
pub(crate) struct KeptConnections {
    idle: Mutex<Vec<(PgConnection, Instant)>>,
    cap: usize,
}

impl KeptConnections {
    /// How long a kept connection may sit unused before it is closed.
    const MAX_IDLE: Duration = Duration::from_secs(30);

    /// The shared connections of `pool` and the urgent claims' one. A pool of one stays one
    /// session (a caller may set session state on it): it keeps neither.
    fn for_pool(pool: &PgPool) -> (KeptConnections, KeptConnections) {
        let shared = (pool.options().get_max_connections() as usize).saturating_sub(1);
        (KeptConnections::with_cap(shared), KeptConnections::with_cap(shared.min(1)))
    }

    fn with_cap(cap: usize) -> KeptConnections {
        KeptConnections { idle: Mutex::new(Vec::with_capacity(cap)), cap }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(PgConnection, Instant)>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last connection kept, unless it sat unused too long (the server may have closed it:
    /// such ones are closed here).
    fn take(&self) -> Option<PgConnection> {
        loop {
            let (conn, since) = self.lock().pop()?;
            if since.elapsed() < KeptConnections::MAX_IDLE {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` (detaching it from its pool) unless enough are kept.
    // Connection bookkeeping of the I/O adapter, not the core's time (which is the database's).
    #[allow(clippy::disallowed_methods)]
    fn keep(&self, conn: StoreConnection) {
        let mut idle = self.lock();
        if idle.len() >= self.cap {
            return;
        }
        let conn = match conn {
            StoreConnection::Kept(conn) | StoreConnection::Urgent(conn) => conn,
            StoreConnection::Pooled(conn) => conn.detach(),
        };
        idle.push((conn, Instant::now()));
    }
}

/// Which connections a statement may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Any kept connection, else one from the pool.
    Shared,
    /// A claim for announced urgent tasks ([`ClaimPolicy::max_priority`](crate::budget::ClaimPolicy)):
    /// the connection kept for such claims alone, so that one never waits for a connection
    /// behind a draining worker's large claims and finishes, which take every other one (with
    /// a pool of 4, a probe during a drain at a sixth of its top speed waited up to 11 ms for
    /// one). The first such claim, or one after the kept connection sat unused for
    /// [`KeptConnections::MAX_IDLE`], takes a shared one and keeps it. A store on a pool of one
    /// has no such connection: its urgent claims share the one session.
    Urgent,
}

/// A connection for one statement: kept by the store, fresh from the pool, or the one kept
/// for urgent claims.
pub(crate) enum StoreConnection {
    Kept(PgConnection),
    Pooled(PoolConnection<Postgres>),
    Urgent(PgConnection),
}

impl std::ops::Deref for StoreConnection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            StoreConnection::Kept(conn) | StoreConnection::Urgent(conn) => conn,
            StoreConnection::Pooled(conn) => conn,
        }
    }
}

impl std::ops::DerefMut for StoreConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            StoreConnection::Kept(conn) | StoreConnection::Urgent(conn) => conn,
            StoreConnection::Pooled(conn) => conn,
        }
    }
}

impl PgStore {
    /// A store on `pool` in `schema`, checking enqueues against `app`. It does not touch the
    /// database; run [`migrate`](PgStore::migrate) once at startup.
    pub fn new(pool: PgPool, schema: PgSchema, app: AppConfig) -> Self {
        let (kept, urgent) = KeptConnections::for_pool(&pool);
        PgStore {
            pool,
            schema,
            app: Arc::new(app),
            kept: Arc::new(kept),
            urgent: Arc::new(urgent),
            vacuum: Arc::default(),
            session_pool: None,
        }
    }

    /// Takes the connections that keep state in their session (LISTEN for wake-ups and result
    /// waits, the worker's liveness token, the migrate lock and the settings the migrations run
    /// under) from `pool` instead of the store's: a direct connection to PostgreSQL when the store's pool goes through a pooler in
    /// transaction mode (PgBouncer), where a session does not outlive its transaction.
    pub fn with_session_pool(mut self, pool: PgPool) -> Self {
        self.session_pool = Some(pool);
        self
    }

    /// Where connections that keep session state come from (see
    /// [`with_session_pool`](PgStore::with_session_pool)): the store's pool unless one was given.
    pub fn session_pool(&self) -> &PgPool {
        self.session_pool.as_ref().unwrap_or(&self.pool)
    }

    /// Whether migrations can run: they hold a session's advisory lock, which a pooler in
    /// transaction mode does not keep, so through one they need the session pool
    /// ([`with_session_pool`](PgStore::with_session_pool)); without it the schema is only
    /// checked.
    pub fn can_migrate(&self) -> bool {
        self.keeps_sessions()
    }

    /// Whether the store has connections that keep session state (LISTEN, a session lock):
    /// its own, or a session pool's. Through a pooler in transaction mode without a session
    /// pool it has none: workers poll, result waits read again and again.
    pub fn keeps_sessions(&self) -> bool {
        !self.schema.is_transaction_pooled() || self.session_pool.is_some()
    }

    /// The pool to LISTEN on: refused through a pooler in transaction mode without a session
    /// pool, where a LISTEN would hear nothing and its notifications would reach whichever
    /// client the server session serves next, in the middle of its statement.
    pub(crate) fn listening_pool(&self) -> Result<&PgPool, sqlx::Error> {
        match self.keeps_sessions() {
            true => Ok(self.session_pool()),
            false => Err(sqlx::Error::Configuration(
                "listening through a transaction pooler needs a session pool (PgStore::with_session_pool)".into(),
            )),
        }
    }

    /// How many connections the store may hold at once: the pool's, the kept ones and the
    /// urgent claims' one.
    pub(crate) fn max_connections(&self) -> u32 {
        let kept = (self.kept.cap + self.urgent.cap) as u32;
        self.pool.options().get_max_connections().saturating_add(kept)
    }

    /// A connection for a statement: the last one kept, else one from the pool. Hand it back
    /// with [`keep`](PgStore::keep) once its statement succeeded.
    pub(crate) async fn connection(&self, lane: Lane) -> Result<StoreConnection, sqlx::Error> {
        if self.pool.is_closed() {
            self.kept.lock().clear();
            self.urgent.lock().clear();
            return Err(sqlx::Error::PoolClosed);
        }
        if lane == Lane::Urgent && self.urgent.cap > 0 {
            if let Some(conn) = self.urgent.take() {
                return Ok(StoreConnection::Urgent(conn));
            }
            // None yet, or too long unused: a shared one becomes the urgent claims' own.
            return match Box::pin(self.connection(Lane::Shared)).await? {
                StoreConnection::Kept(conn) | StoreConnection::Urgent(conn) => Ok(StoreConnection::Urgent(conn)),
                StoreConnection::Pooled(conn) => Ok(StoreConnection::Urgent(conn.detach())),
            };
        }
        match self.kept.take() {
            Some(conn) => Ok(StoreConnection::Kept(conn)),
            None => self.pool.acquire().await.map(StoreConnection::Pooled),
        }
    }

    /// Keeps `conn` for the next statement (the urgent claims' one for the next of those), or
    /// lets it go when enough are kept or the pool is closed.
    pub(crate) fn keep(&self, conn: StoreConnection) {
        if self.pool.is_closed() {
            return;
        }
        match conn {
            StoreConnection::Urgent(_) => self.urgent.keep(conn),
            StoreConnection::Kept(_) | StoreConnection::Pooled(_) => self.kept.keep(conn),
        }
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema the store lives in.
    pub fn schema(&self) -> &PgSchema {
        &self.schema
    }

    /// The application configuration enqueues are checked against.
    pub fn app(&self) -> &AppConfig {
        &self.app
    }

    /// Creates or upgrades the store's schema (see [`migrate`]), on the session pool: the
    /// migrations hold a session's advisory lock.
    pub async fn migrate(&self) -> Result<(), MigrateSchemaError> {
        migrate(self.session_pool(), &self.schema).await
    }

    /// The database's clock.
    pub async fn now(&self) -> Result<DbTime, sqlx::Error> {
        let ms: i64 = replayed!(self, Replay::Safe, |conn| self.schema.sql().now.query_scalar().fetch_one(conn))?;
        Ok(DbTime(ms))
    }
}

/// Column `column` of `row` decoded, or why it could not be (a value its decoder refuses);
/// a column missing or of another type is an error of the whole reply.
pub(crate) fn leniently<T>(row: &sqlx::postgres::PgRow, column: &str) -> Result<Result<T, String>, sqlx::Error>
where
    T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    match row.try_get::<T, _>(column) {
        Ok(value) => Ok(Ok(value)),
        Err(sqlx::Error::ColumnDecode { source, .. }) => Ok(Err(source.to_string())),
        Err(other) => Err(other),
    }
}

/// A count from the protocol as an SQL `integer` (saturating).
pub(super) fn int(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// An SQL `integer` count as the protocol's `u32` (negative counts are 0).
pub(crate) fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}

/// A duration in ms for the database, clamped to [`MAX_DURATION_MS`].
pub(crate) fn duration(ms: u64) -> i64 {
    ms.min(MAX_DURATION_MS) as i64
}

/// A [`DbTime`] for the database, clamped to the range PostgreSQL can store.
pub(crate) fn db_time(time: DbTime) -> i64 {
    time.0.clamp(MIN_DB_TIME_MS, MAX_DB_TIME_MS)
}

pub(super) fn split(tasks: &[TaskLease]) -> (Vec<i64>, Vec<i64>) {
    tasks.iter().map(|t| (t.task.0, t.lease.0)).unzip()
}

pub(crate) fn error_json(error: &TaskError) -> Result<Value, sqlx::Error> {
    serde_json::to_value(error).map_err(|e| sqlx::Error::Encode(Box::new(e)))
}

/// Decodes a stored JSON column into its Rust type.
pub(crate) fn json<T: DeserializeOwned>(value: Value) -> Result<T, sqlx::Error> {
    serde_json::from_value(value).map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

pub(crate) fn parse_state(state: &str) -> Result<TaskState, sqlx::Error> {
    state.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))
}

#[cfg(test)]
mod tests {
    use super::SESSION_SETTINGS;

    #[test]
    fn the_memory_store_models_the_sessions_lock_timeout() {
        let lock_timeout = SESSION_SETTINGS.iter().find(|(name, _)| *name == "lock_timeout").map(|(_, v)| *v);
        assert_eq!(lock_timeout, Some(format!("{}s", crate::memory::LOCK_TIMEOUT_MS / 1_000).as_str()));
    }
}
