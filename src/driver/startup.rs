//! Startup of a worker or a scheduler: reach the database and make sure the schema is one this
//! binary can use, migrating it unless told not to.
//!
//! A current schema is only read (no lock, no DDL: a role with DML rights alone starts).
//! Outages and a busy migrate lock are waited out with the resilience backoff, each wait
//! logged; a missing privilege or a schema this binary cannot use ends startup at once with an
//! error that says why (retrying cannot help). Callers race this future against their shutdown
//! signal: dropping it part-way is safe (see [`migrate_within`]).

use std::time::Duration;

use super::Runtime;
use super::retry::Retry;
use crate::config::ResilienceConfig;
use crate::postgres::{MigrateSchemaError, PgStore, SchemaStatus, migrate_within, require_current};

/// How long one attempt at the migrate lock waits at startup before the wait is logged and the
/// attempt retried with backoff.
pub const STARTUP_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Why startup ended without a usable schema.
#[derive(Debug)]
pub(crate) enum StartupFailure {
    /// A missing privilege or an unusable schema.
    Schema(MigrateSchemaError),
    /// `db_retry_max_attempts` failures in a row.
    GaveUp {
        /// Failures in a row.
        failures: u32,
        /// The last error.
        error: String,
    },
}

/// Brings `store`'s schema to a state this binary can use (see the module docs). `who` names
/// the process in logs; `give_up` honours `resilience.db_retry_max_attempts`.
pub(crate) async fn prepare_schema<R: Runtime>(
    runtime: &R,
    store: &PgStore,
    migrate: bool,
    resilience: &ResilienceConfig,
    seed: u64,
    who: &str,
    give_up: bool,
) -> Result<SchemaStatus, StartupFailure> {
    let mut retry = Retry::new(resilience, seed);
    let schema = store.schema().name();
    loop {
        let attempt = if migrate && store.can_migrate() {
            migrate_within(store.session_pool(), store.schema(), STARTUP_LOCK_WAIT).await
        } else {
            require_current(store.pool(), store.schema()).await
        };
        let error = match attempt {
            Ok(status) => {
                log_ready(who, schema, &status);
                return Ok(status);
            }
            Err(error) if error.is_fatal() => {
                tracing::error!(%who, schema, %error, "the schema cannot be used");
                return Err(StartupFailure::Schema(error));
            }
            Err(error) => error,
        };
        let delay = retry.failed();
        if matches!(error, MigrateSchemaError::LockBusy { .. }) {
            tracing::warn!(%who, schema, failures = retry.failures(), retry_in = %super::duration_text(delay), %error, "waiting for the migrate lock");
        } else {
            tracing::warn!(%who, schema, failures = retry.failures(), retry_in = %super::duration_text(delay), %error, "database not ready at startup");
        }
        if give_up && retry.exhausted() {
            tracing::error!(%who, schema, "giving up on the database at startup");
            return Err(StartupFailure::GaveUp { failures: retry.failures(), error: error.to_string() });
        }
        super::sleep_after(runtime, runtime.now(), delay).await;
    }
}

fn log_ready(who: &str, schema: &str, status: &SchemaStatus) {
    match status {
        SchemaStatus::Ahead { version, code_version } => tracing::info!(
            %who,
            schema,
            version,
            code_version,
            "the schema is newer than this binary and declares it compatible"
        ),
        _ => tracing::debug!(%who, schema, version = ?status.version(), "schema ready"),
    }
}
