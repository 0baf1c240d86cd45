//! The schema a store lives in: its name, its notification channels, its advisory lock keys,
//! and the migrations that create it.
//!
//! # Migrations in a configurable schema
//!
//! The files of `migrations/` use unqualified names. [`migrate`] runs them on one connection
//! whose `search_path` is set to the target schema alone, so every table, index and function
//! lands there (and sqlx's `_sqlx_migrations` bookkeeping table too: each schema has its own
//! history). The SQL functions pin the schema with `SET search_path FROM CURRENT`; statements
//! sent from Rust qualify every name with the quoted schema instead, so no connection of the
//! application needs a particular `search_path`.
//!
//! # Notification channels
//!
//! A queue's channel is `{tag}_q_{queue}` and the channel of finished tasks is `{tag}_done`,
//! where `tag` is the schema name when it has at most 8 bytes and `c` plus 7 hex digits of a
//! hash of it otherwise. The tag keeps queue channels within PostgreSQL's 63-byte limit (at
//! most 11 bytes of prefix before a queue name of at most 52) and keeps two schemas of one
//! database from waking each other. With the default schema `canter` the channels are
//! `canter_q_<queue>` and `canter_done`. A finished-tasks payload is a comma-separated list of
//! task ids; a queue payload is empty.

use std::fmt;
use std::sync::Arc;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{Connection, PgPool};

use crate::postgres::sql::Statements;

/// The schema used when none is configured.
pub const DEFAULT_SCHEMA: &str = "canter";

/// The embedded migrations of `migrations/`, to be run with [`migrate`] (which places them in a
/// schema).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The advisory lock key that serializes [`migrate`] across every process and schema of a
/// database (`fnv1a64("canter:migrate")`).
pub const MIGRATE_LOCK_KEY: i64 = fnv1a64(b"canter:migrate");

/// A schema name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid schema name {0:?}: expected 1 to 63 bytes of a-z, 0-9 and _, not starting with a digit or pg_")]
pub struct InvalidSchemaName(pub String);

/// Why [`migrate`] failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateSchemaError {
    /// The database failed around the migrations (connecting, locking, creating the schema).
    #[error("migration setup failed: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed, or the applied history does not match the embedded migrations.
    #[error("migration failed: {0}")]
    Migrate(#[from] MigrateError),
}

/// A validated schema name with everything derived from it: its quoted form, its notification
/// channels, its advisory lock keys and the SQL text of the store's statements. Cheap to clone.
#[derive(Clone)]
pub struct PgSchema {
    inner: Arc<SchemaInner>,
}

struct SchemaInner {
    name: String,
    quoted: String,
    tag: String,
    statements: Statements,
}

impl fmt::Debug for PgSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSchema").field("name", &self.inner.name).finish()
    }
}

impl PartialEq for PgSchema {
    fn eq(&self, other: &Self) -> bool {
        self.inner.name == other.inner.name
    }
}

impl Eq for PgSchema {}

impl Default for PgSchema {
    fn default() -> Self {
        PgSchema::new(DEFAULT_SCHEMA).expect("the default schema name is valid")
    }
}

impl PgSchema {
    /// The schema `name`: 1 to 63 bytes of `a-z`, `0-9` and `_`, not starting with a digit
    /// or with `pg_` (PostgreSQL reserves those).
    pub fn new(name: &str) -> Result<Self, InvalidSchemaName> {
        let valid = (1..=63).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && !name.starts_with("pg_");
        if !valid {
            return Err(InvalidSchemaName(name.to_owned()));
        }
        let quoted = format!("\"{name}\"");
        let tag = if name.len() <= 8 {
            name.to_owned()
        } else {
            format!("c{:07x}", fnv1a64(name.as_bytes()) as u64 & 0x0fff_ffff)
        };
        let statements = Statements::new(&quoted);
        Ok(PgSchema { inner: Arc::new(SchemaInner { name: name.to_owned(), quoted, tag, statements }) })
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The name quoted as an SQL identifier, ready to prefix table names.
    pub fn quoted(&self) -> &str {
        &self.inner.quoted
    }

    /// The notification channel of a queue: announced once per statement that makes tasks of
    /// the queue claimable (enqueue, release, requeue).
    pub fn queue_channel(&self, queue: &str) -> String {
        format!("{}{queue}", self.queue_channel_prefix())
    }

    /// What every queue channel starts with.
    pub fn queue_channel_prefix(&self) -> String {
        format!("{}_q_", self.inner.tag)
    }

    /// The notification channel of finished tasks: its payloads are comma-separated task ids.
    pub fn done_channel(&self) -> String {
        format!("{}_done", self.inner.tag)
    }

    /// The advisory lock key that serializes capped claims of `queue`.
    pub fn queue_lock_key(&self, queue: &str) -> i64 {
        fnv1a64(format!("canter:claim:{}:{queue}", self.inner.name).as_bytes())
    }

    /// The advisory lock key that serializes claims under a cluster-wide cap.
    pub fn cluster_lock_key(&self) -> i64 {
        fnv1a64(format!("canter:claim:{}", self.inner.name).as_bytes())
    }

    /// What the text hashed into the advisory lock of a task key starts with (the SQL
    /// `enqueue()` hashes it with the key by `hashtextextended`).
    pub fn key_lock_prefix(&self) -> String {
        format!("canter:key:{}:", self.inner.name)
    }

    /// The advisory lock key only one reaper at a time holds.
    pub fn reaper_lock_key(&self) -> i64 {
        fnv1a64(format!("canter:reap:{}", self.inner.name).as_bytes())
    }

    pub(crate) fn sql(&self) -> &Statements {
        &self.inner.statements
    }
}

/// Applies the embedded migrations to `schema`, creating it if needed.
///
/// Safe when many processes start at once: it runs on one connection under the session
/// advisory lock [`MIGRATE_LOCK_KEY`], so the others wait and then find nothing to do. The
/// connection's `search_path` is set to the schema for the duration (see the module docs) and
/// the connection is closed afterwards rather than returned to the pool.
pub async fn migrate(pool: &PgPool, schema: &PgSchema) -> Result<(), MigrateSchemaError> {
    let mut conn = pool.acquire().await?.detach();
    let result = migrate_on(&mut conn, schema).await;
    // The session lock and the search_path go with the connection.
    let closed = conn.close().await;
    result?;
    closed?;
    Ok(())
}

async fn migrate_on(conn: &mut sqlx::PgConnection, schema: &PgSchema) -> Result<(), MigrateSchemaError> {
    sqlx::query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK_KEY).execute(&mut *conn).await?;
    let create = format!("CREATE SCHEMA IF NOT EXISTS {}", schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&mut *conn).await?;
    let path = format!("SET search_path TO {}", schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(path)).execute(&mut *conn).await?;
    // Our lock already serializes migrators; sqlx's own lock is per database and would only
    // add a second wait.
    let migrator = Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ignore_missing: MIGRATOR.ignore_missing,
        locking: false,
        no_tx: MIGRATOR.no_tx,
        table_name: MIGRATOR.table_name.clone(),
        create_schemas: MIGRATOR.create_schemas.clone(),
    };
    // `run_direct` rather than `run`: `run` is generic over `Acquire`, which makes this future
    // not `Send` for every lifetime (sqlx's own workaround).
    migrator.run_direct(None, &mut *conn, false).await?;
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(MIGRATE_LOCK_KEY).execute(&mut *conn).await?;
    Ok(())
}

/// FNV-1a, 64 bits, as a signed advisory lock key: stable across builds and platforms.
pub(crate) const fn fnv1a64(bytes: &[u8]) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    hash as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_checked() {
        assert!(PgSchema::new("canter").is_ok());
        assert!(PgSchema::new("t_0123456789abcdef").is_ok());
        for bad in ["", "Canter", "1abc", "pg_x", "a-b", "a\"b", &"x".repeat(64)] {
            assert_eq!(PgSchema::new(bad), Err(InvalidSchemaName(bad.to_owned())), "{bad}");
        }
    }

    #[test]
    fn channels_fit_postgres_limits() {
        let schema = PgSchema::default();
        assert_eq!(schema.queue_channel("emails"), "canter_q_emails");
        assert_eq!(schema.done_channel(), "canter_done");
        let long = PgSchema::new(&"s".repeat(63)).unwrap();
        let queue = "q".repeat(crate::config::MAX_QUEUE_NAME_LEN);
        assert!(long.queue_channel(&queue).len() <= 63);
        assert!(long.queue_channel_prefix().len() <= 11);
        assert_ne!(long.done_channel(), PgSchema::new(&"t".repeat(63)).unwrap().done_channel());
    }

    #[test]
    fn lock_keys_differ_by_schema_and_queue() {
        let a = PgSchema::new("a").unwrap();
        let b = PgSchema::new("b").unwrap();
        assert_ne!(a.queue_lock_key("q"), b.queue_lock_key("q"));
        assert_ne!(a.queue_lock_key("q"), a.queue_lock_key("r"));
        assert_ne!(a.cluster_lock_key(), a.reaper_lock_key());
    }
}
