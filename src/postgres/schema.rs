//! The schema a store lives in: its name, its notification channels, its advisory lock keys,
//! the migrations that create it and the check of its version.
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
//! # Versions
//!
//! A schema's version is the number of the newest migration applied to it; a binary's is the
//! newest migration it embeds ([`code_schema_version`]). [`schema_status`] compares the two
//! with reads alone (no lock, no DDL, so a role with only DML rights can start): every embedded
//! migration applied with its checksum is [`SchemaStatus::Current`]. A schema ahead of the
//! binary (migrations it does not know) is usable when every such migration declares, in the
//! `schema_versions` table each migration from 2 on writes to, a `min_code_version` the binary
//! reaches ([`SchemaStatus::Ahead`]); otherwise it is refused naming both versions
//! ([`MigrateSchemaError::Incompatible`]). Applied migrations are never edited (a test pins
//! every checksum): new SQL goes into a new file, online-safe (`SET lock_timeout` at its top,
//! indexes built `CONCURRENTLY`).
//!
//! # Notification channels
//!
//! Channels are `{tag}:q:{queue}` for a queue and `{tag}:done` for finished tasks, where `tag`
//! is the schema name when it has at most 8 bytes and `#` plus 7 hex digits of a hash of it
//! otherwise. Neither schema nor queue names can contain `:` or `#`, so a channel names one
//! schema and one queue (`a_q_b` with queue `c` and `a` with queue `b_q_c` no longer meet), and
//! a hashed tag never equals a literal one; two long names whose hashes agree share channels,
//! which costs spurious wake-ups only (claims and result reads decide, never the channel). A
//! queue channel has at most 11 bytes before a queue name of at most 52, within PostgreSQL's
//! 63. The default schema `canter` keeps the names it had before (`canter_q_<queue>`,
//! `canter_done`), so processes of an older release and a newer one still wake each other
//! during a rolling upgrade; those names contain no `:`, so no other schema's channel equals
//! them. A finished-tasks payload is a comma-separated list of task ids; a queue payload is
//! empty.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

use crate::postgres::sql::Statements;

/// The schema used when none is configured.
pub const DEFAULT_SCHEMA: &str = "canter";

/// Every table a schema of this release holds, as [`migrate`] leaves it: live tasks, finished
/// tasks, their runs, keys, the worker registry, paused queues, schedule records, the claim
/// and reaper lock rows, registered listeners, workers marked waiting, workflows with their steps, edges and gates, the
/// schema's versions and sqlx's migration record. [`HOT_TABLES`](crate::postgres::HOT_TABLES) are those workers vacuum themselves.
pub const TABLES: &[&str] = &[
    "tasks",
    "finished_tasks",
    "attempts",
    "task_keys",
    "workers",
    "queue_states",
    "schedules",
    "claim_locks",
    "reaper_lock",
    "listeners",
    "waiting_workers",
    "workflows",
    "workflow_steps",
    "workflow_edges",
    "task_gates",
    "schema_versions",
    "_sqlx_migrations",
];

/// The embedded migrations of `migrations/`, to be run with [`migrate`] (which places them in a
/// schema).
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The advisory lock key that serializes [`migrate`] across every process and schema of a
/// database (`fnv1a64("canter:migrate")`).
pub const MIGRATE_LOCK_KEY: i64 = fnv1a64(b"canter:migrate");

/// How long [`migrate`] waits for [`MIGRATE_LOCK_KEY`] before it gives up with
/// [`MigrateSchemaError::LockBusy`]: any role can take an advisory lock, so the wait is bounded.
pub const MIGRATE_LOCK_WAIT: Duration = Duration::from_secs(60);

/// The SQLSTATE of "insufficient privilege".
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// The SQLSTATE of "lock not available" (a `lock_timeout` ran out).
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The schema version of this binary: the newest migration it embeds.
pub fn code_schema_version() -> i64 {
    embedded().map(|m| m.version).max().unwrap_or(0)
}

/// The embedded migrations that apply (down migrations are not run).
fn embedded() -> impl Iterator<Item = &'static sqlx::migrate::Migration> {
    MIGRATOR.migrations.iter().filter(|m| !m.migration_type.is_down_migration())
}

/// A schema name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid schema name {0:?}: expected 1 to 63 bytes of a-z, 0-9 and _, not starting with a digit or pg_, and not \
     information_schema (PostgreSQL's own schemas)"
)]
pub struct InvalidSchemaName(pub String);

/// Where a schema stands against this binary's migrations (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaStatus {
    /// Every embedded migration is applied, with its checksum, and no other.
    Current {
        /// The schema's version (this binary's).
        version: i64,
    },
    /// Migrations this binary does not know are applied too, and every one of them declares
    /// code of this binary's version compatible.
    Ahead {
        /// The schema's version.
        version: i64,
        /// This binary's version.
        code_version: i64,
    },
    /// Some embedded migrations are not applied yet: [`migrate`] applies them.
    Behind {
        /// The schema's version (`None`: no migration applied, or no schema at all).
        version: Option<i64>,
        /// The embedded migrations not applied, in order.
        missing: Vec<i64>,
        /// Whether the schema exists (creating it needs CREATE on the database).
        schema_exists: bool,
    },
}

impl SchemaStatus {
    /// Whether a worker or client of this binary can use the schema as it is.
    pub fn is_usable(&self) -> bool {
        !matches!(self, SchemaStatus::Behind { .. })
    }

    /// The schema's version, if any migration is applied.
    pub fn version(&self) -> Option<i64> {
        match self {
            SchemaStatus::Current { version } | SchemaStatus::Ahead { version, .. } => Some(*version),
            SchemaStatus::Behind { version, .. } => *version,
        }
    }
}

/// A session holding [`MIGRATE_LOCK_KEY`], as `pg_stat_activity` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// The holder's backend process id (`pg_terminate_backend` takes it).
    pub pid: i32,
    /// Its role.
    pub role: String,
    /// Its `application_name`.
    pub application: String,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} (role {:?}, application {:?})", self.pid, self.role, self.application)
    }
}

/// Why [`migrate`], [`schema_status`] or [`require_current`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateSchemaError {
    /// The database failed around the migrations (connecting, reading, creating the schema).
    #[error("migration setup failed: {}", error_text(.0))]
    Database(#[from] sqlx::Error),
    /// A migration failed, or the applied history does not match the embedded migrations.
    #[error("migration failed: {}", migrate_text(.0))]
    Migrate(#[from] MigrateError),
    /// The role lacks a privilege (SQLSTATE 42501): retrying cannot help.
    #[error("permission denied {doing} schema {schema}: {message}; {needs}")]
    PermissionDenied {
        /// The schema.
        schema: String,
        /// What was being done.
        doing: &'static str,
        /// What the role needs (see the README's Privileges).
        needs: &'static str,
        /// PostgreSQL's message (it names the object).
        message: String,
    },
    /// The schema is newer than this binary and does not declare it compatible.
    #[error(
        "schema {schema} is at version {version}, which needs code of schema version {needs} or newer; \
         this binary knows schema versions up to {code_version}: upgrade it"
    )]
    Incompatible {
        /// The schema.
        schema: String,
        /// The schema's version.
        version: i64,
        /// The oldest code version the schema's newer migrations accept.
        needs: i64,
        /// This binary's version.
        code_version: i64,
    },
    /// An applied migration's checksum differs from the embedded one.
    #[error(
        "migration {version} applied to schema {schema} differs from this binary's copy (their checksums \
         differ): applied migrations must never be edited"
    )]
    Modified {
        /// The schema.
        schema: String,
        /// The migration.
        version: i64,
    },
    /// A migration is recorded as failed part-way.
    #[error("migration {version} of schema {schema} is recorded as failed part-way: repair the schema by hand")]
    Failed {
        /// The schema.
        schema: String,
        /// The migration.
        version: i64,
    },
    /// The schema has a migration this binary does not know but lacks one it has.
    #[error(
        "schema {schema} has migration {unknown}, which this binary does not know, but lacks migration \
         {missing}, which it has: its history diverged from this binary's"
    )]
    Diverged {
        /// The schema.
        schema: String,
        /// A migration applied that the binary does not embed.
        unknown: i64,
        /// An embedded migration not applied.
        missing: i64,
    },
    /// Migrations are missing and this process may not apply them (`--no-migrate`).
    #[error(
        "schema {schema} is at version {}, but this binary needs version {code_version}: run `canter migrate` \
         (as a role that may create objects in the schema) first",
        version.map_or_else(|| "none (not migrated)".to_owned(), |v| v.to_string())
    )]
    NotMigrated {
        /// The schema.
        schema: String,
        /// The schema's version.
        version: Option<i64>,
        /// This binary's version.
        code_version: i64,
    },
    /// Another session held [`MIGRATE_LOCK_KEY`] for the whole wait.
    #[error(
        "the migrate lock (advisory lock {MIGRATE_LOCK_KEY}) is still held after {} ms, by {}: another process \
         is migrating, or a session took the lock and keeps it",
        waited.as_millis(),
        holder.as_ref().map_or_else(|| "a session that is gone".to_owned(), ToString::to_string)
    )]
    LockBusy {
        /// How long this attempt waited.
        waited: Duration,
        /// Who holds it (`None`: released meanwhile).
        holder: Option<LockHolder>,
    },
}

impl MigrateSchemaError {
    /// Whether retrying cannot help: a missing privilege, or a schema this binary cannot use
    /// as it is. Outages and a busy migrate lock are worth waiting out.
    pub fn is_fatal(&self) -> bool {
        match self {
            MigrateSchemaError::Database(_) | MigrateSchemaError::LockBusy { .. } => false,
            // Statements that failed may succeed later (a lock timeout, a lost connection); a
            // history that does not match will not.
            MigrateSchemaError::Migrate(error) => {
                !matches!(error, MigrateError::Execute(_) | MigrateError::ExecuteMigration(..))
            }
            _ => true,
        }
    }
}

/// Maps a database error met while `doing` something to the schema: a missing privilege to
/// [`MigrateSchemaError::PermissionDenied`], the rest to [`MigrateSchemaError::Database`].
fn denied<'a>(
    schema: &'a PgSchema,
    doing: &'static str,
    needs: &'static str,
) -> impl Fn(sqlx::Error) -> MigrateSchemaError + 'a {
    move |error| match sqlstate(&error).as_deref() {
        Some(INSUFFICIENT_PRIVILEGE) => MigrateSchemaError::PermissionDenied {
            schema: schema.name().to_owned(),
            doing,
            needs,
            message: error_text(&error),
        },
        _ => MigrateSchemaError::Database(error),
    }
}

pub(crate) fn sqlstate(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Database(e) => e.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// A migration error as [`error_text`] words the database's part of it.
fn migrate_text(error: &MigrateError) -> String {
    match error {
        MigrateError::Execute(e) => format!("while executing migrations: {}", error_text(e)),
        MigrateError::ExecuteMigration(e, version) => format!("while executing migration {version}: {}", error_text(e)),
        other => other.to_string(),
    }
}

/// What a database error says, for people: the server's message, its detail and hint when it
/// has them, never the line of PostgreSQL's own source that sqlx's `Display` appends
/// (`relation "x" does not exist at line 1371`). Any other error as it displays.
pub fn error_text(error: &sqlx::Error) -> String {
    let sqlx::Error::Database(e) = error else {
        return error.to_string();
    };
    let mut text = e.message().to_owned();
    if let Some(pg) = e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        for extra in [pg.detail(), pg.hint()].into_iter().flatten() {
            text.push_str(" (");
            text.push_str(extra);
            text.push(')');
        }
    }
    text
}

const READ_NEEDS: &str = "reading the schema's version needs USAGE on the schema and SELECT on its _sqlx_migrations \
                          and schema_versions tables (README: Privileges)";
const CREATE_SCHEMA_NEEDS: &str = "creating the schema needs CREATE on the database: create it as a role that may \
                                   (or run `canter migrate` as one), then start workers with --no-migrate";
const MIGRATE_NEEDS: &str = "migrating needs CREATE on the schema and ownership of its objects: run `canter \
                             migrate` as the schema's owner, then start workers with --no-migrate";

/// A validated schema name with everything derived from it: its quoted form, its notification
/// channels, its advisory lock keys and the SQL text of the store's statements. Cheap to clone.
#[derive(Clone)]
pub struct PgSchema {
    inner: Arc<SchemaInner>,
}

struct SchemaInner {
    name: String,
    quoted: String,
    queue_channel_prefix: String,
    done_channel: String,
    abort_channel: String,
    statements: Statements,
    /// Its store's connections go through a pooler in transaction mode.
    transaction_pooled: bool,
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
    /// or with `pg_`, and not `information_schema` (PostgreSQL's own schemas: a migration
    /// must never put tables there).
    pub fn new(name: &str) -> Result<Self, InvalidSchemaName> {
        let valid = (1..=63).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && !name.starts_with("pg_")
            && name != "information_schema";
        if !valid {
            return Err(InvalidSchemaName(name.to_owned()));
        }
        let quoted = format!("\"{name}\"");
        let (queue_channel_prefix, done_channel, abort_channel) = channel_names(name);
        let statements = Statements::new(&quoted, true);
        Ok(PgSchema {
            inner: Arc::new(SchemaInner {
                name: name.to_owned(),
                quoted,
                queue_channel_prefix,
                done_channel,
                abort_channel,
                statements,
                transaction_pooled: false,
            }),
        })
    }

    /// The same schema, for a store whose pool goes through a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`), where a server session serves one transaction of
    /// a client and then another client's. Each statement is then sent in a transaction of its
    /// own that sets [`SESSION_SETTINGS`](super::SESSION_SETTINGS) locally (the pooler drops
    /// startup parameters), and unnamed: a named prepared statement would be missing from, or
    /// clash with another client's on, the next server session (PgBouncer 1.18 does not track
    /// them). What needs a session of its own (LISTEN, the worker's liveness token, the migrate
    /// lock) goes to the store's session pool: give it one on a direct connection
    /// ([`PgStore::with_session_pool`](super::PgStore::with_session_pool)); without one, workers
    /// poll. Costs two round trips more per statement (the begin and the commit).
    pub fn transaction_pooled(&self) -> PgSchema {
        let inner = &self.inner;
        PgSchema {
            inner: Arc::new(SchemaInner {
                name: inner.name.clone(),
                quoted: inner.quoted.clone(),
                queue_channel_prefix: inner.queue_channel_prefix.clone(),
                done_channel: inner.done_channel.clone(),
                abort_channel: inner.abort_channel.clone(),
                statements: Statements::new(&inner.quoted, false),
                transaction_pooled: true,
            }),
        }
    }

    /// Whether the store's connections go through a pooler in transaction mode (see
    /// [`transaction_pooled`](PgSchema::transaction_pooled)).
    pub fn is_transaction_pooled(&self) -> bool {
        self.inner.transaction_pooled
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
        format!("{}{queue}", self.inner.queue_channel_prefix)
    }

    /// What every queue channel starts with (the queue name follows).
    pub fn queue_channel_prefix(&self) -> String {
        self.inner.queue_channel_prefix.clone()
    }

    /// The notification channel of finished tasks: its payloads are comma-separated task ids.
    pub fn done_channel(&self) -> String {
        self.inner.done_channel.clone()
    }

    /// The notification channel of revoked tasks (claimed or running tasks a workflow's cancel
    /// took from their holders), which workers listen on: its payloads are comma-separated
    /// task ids.
    pub fn abort_channel(&self) -> String {
        self.inner.abort_channel.clone()
    }

    /// The key of the `claim_locks` row that serializes capped claims of `queue`.
    pub fn queue_lock_key(&self, queue: &str) -> i64 {
        fnv1a64(format!("canter:claim:{}:{queue}", self.inner.name).as_bytes())
    }

    /// The key of the `claim_locks` row that serializes claims under a cluster-wide cap.
    pub fn cluster_lock_key(&self) -> i64 {
        fnv1a64(format!("canter:claim:{}", self.inner.name).as_bytes())
    }

    /// What the text hashed into the advisory lock of a task key starts with (the SQL
    /// `enqueue()` hashes it with the key by `hashtextextended`).
    pub fn key_lock_prefix(&self) -> String {
        format!("canter:key:{}:", self.inner.name)
    }

    /// What the text hashed into a worker's liveness lock starts with: the lock's key is
    /// `hashtextextended(prefix || worker id, 0)` (see [`PgStore::take_token`](super::PgStore::take_token)).
    pub fn liveness_lock_prefix(&self) -> String {
        format!("canter:liveness:{}:", self.inner.name)
    }

    pub(crate) fn sql(&self) -> &Statements {
        &self.inner.statements
    }
}

/// The queue channel prefix and the done channel of schema `name` (see the module docs).
fn channel_names(name: &str) -> (String, String, String) {
    if name == DEFAULT_SCHEMA {
        // The names of earlier releases, kept for rolling upgrades: no `:`, unlike every other.
        return (format!("{name}_q_"), format!("{name}_done"), format!("{name}_abort"));
    }
    let tag = if name.len() <= 8 {
        name.to_owned()
    } else {
        format!("#{:07x}", fnv1a64(name.as_bytes()) as u64 & 0x0fff_ffff)
    };
    (format!("{tag}:q:"), format!("{tag}:done"), format!("{tag}:abort"))
}

/// Reads where `schema` stands against this binary's migrations (see the module docs): reads
/// only, takes no lock, needs no CREATE. Fails with [`MigrateSchemaError::Incompatible`],
/// [`Modified`](MigrateSchemaError::Modified), [`Failed`](MigrateSchemaError::Failed) or
/// [`Diverged`](MigrateSchemaError::Diverged) for a schema this binary must not use or
/// migrate.
pub async fn schema_status(pool: &PgPool, schema: &PgSchema) -> Result<SchemaStatus, MigrateSchemaError> {
    let mut conn = pool.acquire().await?;
    // In a transaction that sets the session settings: through a pooler in transaction mode
    // the reads need one (see `PgSchema::transaction_pooled`), and it costs nothing here.
    let mut transaction = conn.begin_with(super::store::pooled_begin()).await?;
    let status = read_status(&mut transaction, schema).await;
    transaction.commit().await?;
    status
}

/// [`schema_status`], refusing a schema that lacks migrations with
/// [`MigrateSchemaError::NotMigrated`]: the check of a process that does not migrate.
pub async fn require_current(pool: &PgPool, schema: &PgSchema) -> Result<SchemaStatus, MigrateSchemaError> {
    match schema_status(pool, schema).await? {
        SchemaStatus::Behind { version, .. } => Err(MigrateSchemaError::NotMigrated {
            schema: schema.name().to_owned(),
            version,
            code_version: code_schema_version(),
        }),
        usable => Ok(usable),
    }
}

async fn read_status(conn: &mut PgConnection, schema: &PgSchema) -> Result<SchemaStatus, MigrateSchemaError> {
    let read = denied(schema, "reading the version of", READ_NEEDS);
    // The catalogs need no privilege: a missing schema or table is not an error.
    let (schema_exists, has_history, has_versions): (bool, bool, bool) = sqlx::query_as(
        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1),
                EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = $1 AND c.relname = '_sqlx_migrations'),
                EXISTS (SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = $1 AND c.relname = 'schema_versions')",
    )
    .persistent(false)
    .bind(schema.name())
    .fetch_one(&mut *conn)
    .await
    .map_err(&read)?;
    let applied: Vec<(i64, Vec<u8>, bool)> = if has_history {
        let sql =
            format!("SELECT version, checksum, success FROM {}._sqlx_migrations ORDER BY version", schema.quoted());
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).persistent(false).fetch_all(&mut *conn).await.map_err(&read)?
    } else {
        Vec::new()
    };
    let name = || schema.name().to_owned();
    if let Some((version, _, _)) = applied.iter().find(|(_, _, success)| !success) {
        return Err(MigrateSchemaError::Failed { schema: name(), version: *version });
    }
    let mut missing = Vec::new();
    for migration in embedded() {
        match applied.iter().find(|(version, _, _)| *version == migration.version) {
            Some((_, checksum, _)) if checksum.as_slice() != &*migration.checksum => {
                return Err(MigrateSchemaError::Modified { schema: name(), version: migration.version });
            }
            Some(_) => {}
            None => missing.push(migration.version),
        }
    }
    let code_version = code_schema_version();
    let unknown: Vec<i64> =
        applied.iter().map(|(v, _, _)| *v).filter(|v| !embedded().any(|m| m.version == *v)).collect();
    let version = applied.last().map(|(v, _, _)| *v);
    match (unknown.first(), missing.first()) {
        (None, None) => Ok(SchemaStatus::Current { version: version.unwrap_or(code_version) }),
        (None, Some(_)) => Ok(SchemaStatus::Behind { version, missing, schema_exists }),
        (Some(&unknown), Some(&missing)) => Err(MigrateSchemaError::Diverged { schema: name(), unknown, missing }),
        (Some(_), None) => {
            // A newer migration without a row declares nothing: it needs code of its own version.
            let needs: i64 = if has_versions {
                let sql = format!(
                    "SELECT max(coalesce(v.min_code_version, u.version)) FROM unnest($1::bigint[]) AS u(version)
                     LEFT JOIN {}.schema_versions v ON v.version = u.version",
                    schema.quoted()
                );
                sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(sql))
                    .persistent(false)
                    .bind(&unknown)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(&read)?
                    .unwrap_or(i64::MAX)
            } else {
                unknown.iter().copied().max().unwrap_or(i64::MAX)
            };
            let version = version.unwrap_or(code_version);
            if needs <= code_version {
                Ok(SchemaStatus::Ahead { version, code_version })
            } else {
                Err(MigrateSchemaError::Incompatible { schema: name(), version, needs, code_version })
            }
        }
    }
}

/// Applies the embedded migrations to `schema`, creating it if needed, and returns where it
/// stands afterwards; waits at most [`MIGRATE_LOCK_WAIT`] for the migrate lock.
///
/// See [`migrate_within`].
pub async fn migrate(pool: &PgPool, schema: &PgSchema) -> Result<(), MigrateSchemaError> {
    migrate_within(pool, schema, MIGRATE_LOCK_WAIT).await.map(|_| ())
}

/// Applies the embedded migrations to `schema`, creating it if needed, waiting at most
/// `lock_wait` for the migrate lock; returns where the schema stands afterwards.
///
/// A schema that is current, or ahead and compatible, is only read ([`schema_status`]): no
/// lock, no DDL, so a role with only DML rights passes. Otherwise it runs on one connection
/// under the session advisory lock [`MIGRATE_LOCK_KEY`] (so processes that start at once take
/// turns, and the later ones find nothing to do), waiting for it under `lock_timeout`: after
/// `lock_wait` it fails with [`MigrateSchemaError::LockBusy`] naming the holder. The
/// connection's `search_path` is set to the schema for the duration (see the module docs) and
/// the connection is closed afterwards rather than returned to the pool. Dropping the future
/// part-way is safe: the connection closes, PostgreSQL rolls back a migration in flight and
/// releases the lock.
pub async fn migrate_within(
    pool: &PgPool,
    schema: &PgSchema,
    lock_wait: Duration,
) -> Result<SchemaStatus, MigrateSchemaError> {
    match schema_status(pool, schema).await? {
        SchemaStatus::Behind { .. } => {}
        usable => return Ok(usable),
    }
    let mut conn = pool.acquire().await?.detach();
    let result = migrate_on(&mut conn, schema, lock_wait).await;
    // The session lock and the search_path go with the connection.
    let closed = conn.close().await;
    let status = result?;
    closed?;
    Ok(status)
}

async fn migrate_on(
    conn: &mut PgConnection,
    schema: &PgSchema,
    lock_wait: Duration,
) -> Result<SchemaStatus, MigrateSchemaError> {
    lock(conn, lock_wait).await?;
    // A migration may take longer than the statement timeout of Canter's sessions (an index
    // built on a large table); its files bound their own lock waits.
    sqlx::query("SELECT set_config('statement_timeout', '0', false)").persistent(false).execute(&mut *conn).await?;
    // Another process may have migrated while this one waited.
    let schema_exists = match read_status(conn, schema).await? {
        SchemaStatus::Behind { schema_exists, .. } => schema_exists,
        usable => return Ok(usable),
    };
    if !schema_exists {
        let create = format!("CREATE SCHEMA IF NOT EXISTS {}", schema.quoted());
        sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&mut *conn).await.map_err(denied(
            schema,
            "creating",
            CREATE_SCHEMA_NEEDS,
        ))?;
    }
    let path = format!("SET search_path TO {}", schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(path)).execute(&mut *conn).await?;
    // Our lock already serializes migrators; sqlx's own lock is per database and would only
    // add a second, unbounded wait.
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
    migrator.run_direct(None, &mut *conn, false).await.map_err(|error| match error {
        MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)
            if sqlstate(&e).as_deref() == Some(INSUFFICIENT_PRIVILEGE) =>
        {
            denied(schema, "migrating", MIGRATE_NEEDS)(e)
        }
        other => other.into(),
    })?;
    let status = read_status(conn, schema).await?;
    sqlx::query("SELECT pg_advisory_unlock($1)").persistent(false).bind(MIGRATE_LOCK_KEY).execute(&mut *conn).await?;
    Ok(status)
}

/// Takes [`MIGRATE_LOCK_KEY`] for the session, waiting at most `wait` (a `lock_timeout`, so
/// the server gives up by itself even if this side is gone).
async fn lock(conn: &mut PgConnection, wait: Duration) -> Result<(), MigrateSchemaError> {
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).clamp(1, i32::MAX as u64);
    sqlx::query("SELECT set_config('lock_timeout', $1, false)")
        .persistent(false)
        .bind(format!("{ms}ms"))
        .execute(&mut *conn)
        .await?;
    let locked =
        sqlx::query("SELECT pg_advisory_lock($1)").persistent(false).bind(MIGRATE_LOCK_KEY).execute(&mut *conn).await;
    match locked {
        Ok(_) => Ok(()),
        Err(error) if sqlstate(&error).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            let holder = lock_holder(conn).await?;
            Err(MigrateSchemaError::LockBusy { waited: Duration::from_millis(ms), holder })
        }
        Err(error) => Err(error.into()),
    }
}

/// The session holding [`MIGRATE_LOCK_KEY`] in this database, if any.
async fn lock_holder(conn: &mut PgConnection) -> Result<Option<LockHolder>, sqlx::Error> {
    // A bigint key is stored as its high and low 32 bits, with objsubid 1.
    let key = MIGRATE_LOCK_KEY as u64;
    let row: Option<(i32, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT l.pid, a.usename::text, a.application_name FROM pg_locks l
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid
         LIMIT 1",
    )
    .persistent(false)
    .bind((key >> 32) as i64)
    .bind((key & 0xffff_ffff) as i64)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|(pid, role, application)| LockHolder {
        pid,
        role: role.unwrap_or_default(),
        application: application.unwrap_or_default(),
    }))
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
        // PostgreSQL's own schema (`canter migrate --schema information_schema` put eight
        // tables there): refused, and the message says why.
        let system = PgSchema::new("information_schema").unwrap_err();
        assert!(system.to_string().contains("not information_schema"), "{system}");
        assert!(PgSchema::new("information_schema_2").is_ok());
    }

    #[test]
    fn channels_fit_postgres_limits() {
        let long = PgSchema::new(&"s".repeat(63)).unwrap();
        let queue = "q".repeat(crate::task::MAX_QUEUE_NAME_LEN);
        assert!(long.queue_channel(&queue).len() <= 63);
        assert!(long.queue_channel_prefix().len() <= 11);
        assert!(PgSchema::new("abcdefgh").unwrap().queue_channel(&queue).len() <= 63);
        assert!(PgSchema::default().queue_channel(&queue).len() <= 63);
        assert_ne!(long.done_channel(), PgSchema::new(&"t".repeat(63)).unwrap().done_channel());
    }

    #[test]
    fn the_default_schema_keeps_its_channel_names() {
        // Processes of earlier releases listen and notify on these.
        let schema = PgSchema::default();
        assert_eq!(schema.queue_channel("emails"), "canter_q_emails");
        assert_eq!(schema.queue_channel_prefix(), "canter_q_");
        assert_eq!(schema.done_channel(), "canter_done");
        let other = PgSchema::new("shop").unwrap();
        assert_eq!(other.queue_channel("emails"), "shop:q:emails");
        assert_eq!(other.done_channel(), "shop:done");
        assert_eq!((schema.abort_channel(), other.abort_channel()), ("canter_abort".into(), "shop:abort".into()));
    }

    /// Every channel of `schema` for these queues.
    fn channels(schema: &PgSchema, queues: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = queues.iter().map(|q| schema.queue_channel(q)).collect();
        all.push(schema.done_channel());
        all.push(schema.abort_channel());
        all
    }

    #[test]
    fn channels_of_different_schemas_never_meet() {
        // Schema and queue names may contain `_`: with `{tag}_q_{queue}` the first two pairs
        // shared a channel, and a literal name spelt like a hashed tag shared the long one's.
        let long = "a_schema_name_longer_than_eight_bytes";
        let hashed = format!("c{:07x}", fnv1a64(long.as_bytes()) as u64 & 0x0fff_ffff);
        let pairs = [
            (("a_q_b", "c"), ("a", "b_q_c")),
            (("a_q", "b"), ("a", "q_b")),
            ((long, "jobs"), (hashed.as_str(), "jobs")),
            (("x_done", "q"), ("x", "done")),
            (("canter_q", "x"), ("canter", "q_x")),
            (("canter_done", "q"), ("canter", "done")),
        ];
        for ((schema_a, queue_a), (schema_b, queue_b)) in pairs {
            let (a, b) = (PgSchema::new(schema_a).unwrap(), PgSchema::new(schema_b).unwrap());
            let (of_a, of_b) = (channels(&a, &[queue_a, queue_b]), channels(&b, &[queue_a, queue_b]));
            for channel in &of_a {
                assert!(!of_b.contains(channel), "{schema_a} and {schema_b} share {channel}");
            }
        }
    }

    #[test]
    fn a_queue_is_read_back_from_its_channel_alone() {
        // The listener maps a notification to its queue by stripping the prefix.
        for name in ["canter", "a", "a_q_b", "abcdefgh", "abcdefghi", &"z".repeat(63)] {
            let schema = PgSchema::new(name).unwrap();
            for queue in ["default", "b_q_c", "q", "done"] {
                let channel = schema.queue_channel(queue);
                assert_eq!(channel.strip_prefix(&schema.queue_channel_prefix()), Some(queue));
                assert_ne!(channel, schema.done_channel());
                assert_ne!(channel, schema.abort_channel());
            }
        }
    }

    #[test]
    fn lock_keys_differ_by_schema_and_queue() {
        let a = PgSchema::new("a").unwrap();
        let b = PgSchema::new("b").unwrap();
        assert_ne!(a.queue_lock_key("q"), b.queue_lock_key("q"));
        assert_ne!(a.queue_lock_key("q"), a.queue_lock_key("r"));
        assert_ne!(a.cluster_lock_key(), a.queue_lock_key("q"));
    }

    /// The SHA-384 of every migration as it was released. Applied migrations must never
    /// change (a schema that ran the old text would be refused as modified): new SQL goes into
    /// a new file, whose checksum is added here.
    const RELEASED: &[(i64, &str)] = &[
        (1, "91921525a4c15206b4711b54cf0512fa0eac129ef53a0aaacb82a198e38010d8a6ebc783ab53227795159f937c35a596"),
        (2, "8eb4a1ae59fc3a84ce37a27a34653bb03d676bfc8dff19011fca65d480cb40777efdf1412056ee0ff74d71f33f2210a7"),
        (3, "44c919368851da503e9723014c9fa1d06cb56316c918dbdf676e489492700406a7d9768d0ef8c52c3fd971c4d03fdc5f"),
        (4, "555adbfb3481dc111e3c5b18750570615d323b896455188fad74bc583f11748a0b82cd63ddd20f2ba871053d19daa248"),
        (5, "5c407c93aca6f2a3d69279ff06ef20356f334bd13b66b3945c0f08ae7b68a76930668146e7e1f6f56a8ae2fe9b4c8acc"),
        (6, "8637aa029ee4bee0d6dd6db1f6906674401df2245746312961831b36eb913500b208eaadc1d1fe9fdf32b7cb65419caa"),
        (7, "2b38b84367b7f67a59cf61c25bbff6084ba0959fc932744eb5ab4d22b5c1a51b9dde9d515758356033362e8ebe2e57cd"),
        (8, "7abad88eb8479ff8c6586de6dce251d033d86856028de975c7edc587f398f21a9b2b15aa61994b753b065c11c3ba78bc"),
        (9, "caf7fd53c8dd649041e78e1b882dd4499a2a922cad369f0f042407b4da9a1d4f951bef6e5edf45fe7e583ab9834c974f"),
        (10, "7da11ff356bff61efcd90ee1a094ceb0887f67f064076f25175f0f082aa21c84afbaff0d6627dde05049a8cb879c7915"),
        (11, "abcce6ffa284c24334fc2738103a9dafbcfcbcea87e68966e63ad2dde07607baf4c923fe83725b61288a7103597961ff"),
        (12, "5cf623d9187e077fde45d583f4c3e791389320fde33e308642bd1e9203e46aa5e7422a0dcd600b91e3681eff6ed87ac4"),
        (13, "fc38d64e4edac1b93b2bdc2c10ec699890f19d9fa82a10272cc13208da86c5142dca867a26aa0cbb575aa9a11f658010"),
        (14, "efa26828399fa8486832113bfa74ed5a129a5c3b57a9fabe68eae92194774d7fc2fab9148e67ea35db5ad7bf22bb8bb2"),
        (15, "7b5f67fbf527109d4129ca333968d9f16ac6be57e33bda2f1f4a663febbc83fa65116749103b6438bb3ebf13277e2311"),
        (16, "2bd1d008484f1f1d398f1655f6cbd2c0a289abb6a3d1e0a6f59877bee8be6ea0aa78c0e97e66040ea4ebceff70d42ff2"),
        (17, "11cf388c839c644412321b807cd03875eea9b4bceb14a2133f3283812f6e94882a068dd7d80b1b66e55b6d590b937c3f"),
        (18, "9bd23b96bb6a4be033306c4cda52b463760f50faeef8978184bcfe7854307e26fc6d24ddd304f8695b7a4256ea3947c3"),
    ];

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn released_migrations_are_frozen() {
        let embedded: Vec<(i64, String)> = embedded().map(|m| (m.version, hex(&m.checksum))).collect();
        let pinned: Vec<(i64, String)> = RELEASED.iter().map(|(v, c)| (*v, (*c).to_owned())).collect();
        assert_eq!(embedded, pinned, "a migration changed, or a new one lacks its pinned checksum");
        assert_eq!(code_schema_version(), RELEASED.last().unwrap().0);
    }

    #[test]
    fn new_migrations_are_online_safe() {
        // From 0002 on: a bounded lock wait first, and no index built inside a transaction.
        for migration in embedded().filter(|m| m.version >= 2) {
            let sql: &str = migration.sql.as_str();
            let first = sql.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with("--"));
            assert!(
                first.is_some_and(|l| l.starts_with("SET lock_timeout")),
                "migration {} must start with SET lock_timeout",
                migration.version
            );
            let upper = sql.to_uppercase();
            let indexes = upper.matches("CREATE INDEX").count() + upper.matches("CREATE UNIQUE INDEX").count();
            let concurrent = upper.matches("INDEX CONCURRENTLY").count();
            // Indexes built in the migration's transaction, each argued in its header: on a
            // table the migration creates (empty), or small enough to read once while writes
            // wait (0018's, on the live table: a concurrent build would wait for every older
            // snapshot of the database, a held xmin's included).
            let plain_allowed = match migration.version {
                18 => 2,
                _ => 0,
            };
            assert_eq!(
                indexes,
                concurrent + plain_allowed,
                "migration {} builds an index without CONCURRENTLY",
                migration.version
            );
            assert!(
                concurrent == 0 || migration.no_tx,
                "migration {}: CONCURRENTLY needs -- no-transaction",
                migration.version
            );
            assert!(
                sql.contains("INSERT INTO schema_versions"),
                "migration {} must declare its row of schema_versions",
                migration.version
            );
        }
    }
}
