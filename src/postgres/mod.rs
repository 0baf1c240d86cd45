//! The PostgreSQL store (feature `postgres`): schema and migrations, the worker machine's
//! requests, enqueue, results and inspection.
//!
//! sqlx is compiled without a runtime feature here; the adapters (or an application's own
//! `sqlx` dependency) pick the runtime. Everything is plain `sqlx::query` with runtime checks,
//! prepared and cached per connection by sqlx.
//!
//! # Layout in the database
//!
//! All objects live in one schema (default [`DEFAULT_SCHEMA`], see [`PgSchema`]), created by
//! [`migrate`] from the embedded [`MIGRATOR`]:
//!
//! - `tasks`: live tasks only (Waiting workflow steps, Pending, Claimed, Running), with partial
//!   indexes that match the claim exactly (`(hashtext(queue), priority, run_at, id) WHERE state
//!   = 'PENDING'`, Waiting rows behind gates by `(gate, hashtext(queue), priority, id)`, and
//!   in-flight rows by `(queue, state, claim_expires_at)`), fillfactor 70 and aggressive
//!   autovacuum, and workers' own vacuum where the server does not keep up (see
//!   [`DbRequest::Vacuum`](crate::store::DbRequest::Vacuum));
//! - `finished_tasks`: terminal tasks with their result or error, moved there by the statement
//!   that finishes them, so claims cost the same however much history piles up;
//! - `attempts`: one row per finished run; `task_keys`: the task each key names (a row's own
//!   `key` column counts only while `task_keys` names that row) and whether it is an
//!   idempotency key; `workers`: the worker registry with liveness; `queue_states`: paused
//!   queues, which the claim leaves out; `schedules`: each schedule's last tick (see
//!   [`PgStore::check_schedules`]); `claim_locks` and `reaper_lock`: rows whose locks serialize
//!   capped claims and reapers; `listeners`: the sessions waiting for notifications (see
//!   [`register_listener`]); `waiting_workers`: the workers waiting for work, whose queues
//!   a client's own enqueue notifies (see
//!   [`DbRequest::SetWaiting`](crate::store::DbRequest::SetWaiting)); `workflows`,
//!   `workflow_steps` (each step's join and its parents' outcomes so far; fillfactor 70, so
//!   those counts change in place) and `workflow_edges` (`sole` where the child has that
//!   parent alone and needs it: a finish satisfying it decides the child without counting),
//!   settled by `workflow_settle()` in the statement that finishes a step (a trigger on
//!   `finished_tasks`); `task_gates`: per parent of a wide fan-out and queue, a gate its
//!   completion opens, behind which the claim takes the children straight from WAITING (their
//!   `gate` column names the parent; the view `seen_tasks` shows them Pending to readers);
//!   every table is in [`TABLES`];
//! - functions `enqueue`, `claim_tasks` (and the `claim` of earlier releases), `start_tasks`
//!   and `remove_key` (each one round trip), `register_listener` and `unregister_listener`,
//!   `mark_waiting` and `unmark_waiting`,
//!   `db_now()`, the clock statements read (`now()`; tests replace it in their own schemas), and
//!   `db_clock()`, read where a statement may have waited for locks (`clock_timestamp()`);
//! - `schema_versions`: each migration's version and the oldest code it accepts (see
//!   [`schema_status`]).
//!
//! No trigger notifies per row: statements notify once per queue (enqueue, release, requeue,
//! reschedule, force-unlock, resume) and once per batch of finished tasks (see [`PgSchema`] for
//! the channels).
//!
//! # Use
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use canter::config::AppConfig;
//! use canter::store::NewTask;
//! use canter::postgres::{PgSchema, PgStore};
//!
//! let store = PgStore::new(pool, PgSchema::default(), AppConfig::default());
//! store.migrate().await?;
//! let id = store.enqueue(NewTask::new("send_email", serde_json::json!({"to": "a@b.c"}))).await?;
//! let record = store.get(id).await?;
//! # Ok(())
//! # }
//! ```

mod admin;
mod enqueue;
mod listeners;
mod protocol;
mod records;
pub(crate) mod replay;
mod results;
mod schedules;
mod schema;
mod sql;
mod store;
mod tcp;
mod vacuum;
mod workflow;

pub use admin::PgAdminError;
pub(crate) use enqueue::only_id;
pub use enqueue::{PgEnqueueError, enqueue_in, enqueue_many_in};
pub use listeners::{register_listener, unregister_listener};
pub use protocol::claim_lock_keys;
pub use results::{DoneRouter, DoneSignal, WaitError};
pub use schedules::{AppliedWrite, CheckReport, MAX_CHECK_ROUNDS, PlanOutcome, RefusedWrite};
pub use schema::{
    DEFAULT_SCHEMA, InvalidSchemaName, LockHolder, MIGRATE_LOCK_KEY, MIGRATE_LOCK_WAIT, MIGRATOR, MigrateSchemaError,
    PgSchema, SchemaStatus, TABLES, code_schema_version, error_text, migrate, migrate_within, require_current,
    schema_status,
};
pub use store::{MAX_DB_TIME_MS, MAX_DURATION_MS, PgStore, SESSION_SETTINGS, with_session_settings};
pub use tcp::{pool_options, set_tcp_nodelay, tcp_nodelay};
pub use vacuum::HOT_TABLES;
pub use workflow::{PgSubmitError, PgWorkflowError, submit_workflow_in};
