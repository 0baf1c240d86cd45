//! The scheduler loop on any runtime: check the app's schedules against PostgreSQL
//! ([`PgStore::check_schedules`]), sleep until the next tick falls due, repeat; database errors
//! are waited out with the resilience backoff; a shutdown signal ends it between checks (a
//! check in flight finishes first, or times out and its transaction rolls back).
//!
//! It runs inside workers ([`WorkerConfig::run_scheduler`](crate::config::WorkerConfig)) or
//! on its own ([`PgScheduler`], `canter scheduler`). Any number of schedulers may run against
//! one schema: each tick is enqueued exactly once.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt};
use sqlx::PgPool;

use super::Runtime;
use super::retry::Retry;
use super::sleep_after;
use super::startup::{StartupFailure, prepare_schema};
use super::zones::load_scheduler;
use crate::config::{AppConfig, ResilienceConfig};
use crate::postgres::{CheckReport, MigrateSchemaError, PgSchema, PgStore};
use crate::rng::mix;
use crate::scheduler::{
    DEFAULT_MAX_CHECK_DELAY_MS, MIN_CHECK_DELAY_MS, Plan, Scheduler, SchedulerError, check_delay_ms,
};

/// Settings of the scheduler loop.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// The longest sleep between two checks (default 60 s): bounds the drift between the
    /// local timer and the database's clock while waiting for a distant tick.
    pub max_check_delay: Duration,
    /// A check with no answer after this long counts as failed (default 30 s).
    pub request_timeout: Duration,
    /// Whether to stop after `resilience.db_retry_max_attempts` failures in a row (default
    /// true). A worker's scheduler never does: the worker decides when to give up.
    pub give_up: bool,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            max_check_delay: Duration::from_millis(DEFAULT_MAX_CHECK_DELAY_MS),
            request_timeout: Duration::from_secs(30),
            give_up: true,
        }
    }
}

/// What a scheduler loop did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Checks made, failed ones included.
    pub checks: u64,
    /// Tasks enqueued.
    pub tasks: u64,
    /// Races lost to other schedulers (each planned again).
    pub lost: u64,
    /// Checks that failed.
    pub failures: u64,
}

impl std::fmt::Display for SchedulerStats {
    /// The counts, for logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} checks, {} tasks enqueued, {} races lost, {} failed checks",
            self.checks, self.tasks, self.lost, self.failures
        )
    }
}

/// Why a scheduler stopped without being asked to.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerRunError {
    /// The schedules could not be prepared.
    #[error(transparent)]
    Setup(#[from] SchedulerError),
    /// The schema cannot be used: a privilege is missing, migrations are missing and the
    /// scheduler may not apply them, or the schema is newer than this binary accepts.
    #[error("the scheduler cannot start: {0}")]
    Schema(MigrateSchemaError),
    /// The database failed `db_retry_max_attempts` times in a row.
    #[error("the scheduler gave up after {failures} database failures in a row: {error}")]
    GaveUp {
        /// Failures in a row.
        failures: u32,
        /// The last error.
        error: String,
    },
}

/// Runs `scheduler`'s checks against `store` until `shutdown` resolves (or, with
/// `options.give_up`, until the database has failed too often). See the module docs.
pub async fn run_scheduler<R: Runtime>(
    runtime: Arc<R>,
    store: PgStore,
    scheduler: Arc<Scheduler>,
    options: SchedulerOptions,
    seed: u64,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<SchedulerStats, SchedulerRunError> {
    let mut shutdown = Box::pin(shutdown).fuse();
    let resilience = store.app().resilience.clone();
    let max_ms = u64::try_from(options.max_check_delay.as_millis()).unwrap_or(u64::MAX);
    let mut retry = Retry::new(&resilience, mix(seed));
    let mut stats = SchedulerStats::default();
    tracing::info!(schedules = %scheduler.names().join(", "), schema = store.schema().name(), "canter scheduler starting");
    loop {
        let started = runtime.now();
        let result = {
            let check = store.check_schedules(&scheduler).fuse();
            let timeout = sleep_after(&*runtime, started, options.request_timeout).fuse();
            futures::pin_mut!(check, timeout);
            // A check in flight finishes (or times out) before a shutdown is looked at, so its
            // transaction is never cut between commit and report.
            futures::select_biased! {
                result = check => result.map_err(|e| e.to_string()),
                () = timeout => Err(format!("no answer within {:?}", options.request_timeout)),
            }
        };
        stats.checks += 1;
        let delay = match result {
            Ok(report) => {
                if retry.failures() > 0 {
                    tracing::info!("scheduler: database reachable again");
                }
                retry.succeeded();
                log_report(&report);
                stats.tasks += report.tasks() as u64;
                stats.lost += u64::from(report.lost);
                Duration::from_millis(check_delay_ms(report.now, report.next_check, max_ms))
            }
            Err(error) => {
                stats.failures += 1;
                let delay = retry.failed();
                tracing::warn!(failures = retry.failures(), retry_in = %super::duration_text(delay), %error, "scheduler check failed");
                if options.give_up && retry.exhausted() {
                    tracing::error!(failures = retry.failures(), "scheduler: too many database failures in a row");
                    return Err(SchedulerRunError::GaveUp { failures: retry.failures(), error });
                }
                delay
            }
        };
        // From the check's start (the clock was read then), and never less than the floor.
        let floor = runtime.now() + Duration::from_millis(MIN_CHECK_DELAY_MS);
        let sleep: BoxFuture<'static, ()> = match started.checked_add(delay) {
            Some(wake) => runtime.sleep_until(wake.max(floor)),
            // Past the clock's range (a huge `max_check_delay`): only a shutdown ends it.
            None => Box::pin(futures::future::pending()),
        };
        let sleep = sleep.fuse();
        futures::pin_mut!(sleep);
        futures::select_biased! {
            () = shutdown => break,
            () = sleep => {}
        }
    }
    tracing::info!(%stats, "canter scheduler stopped");
    Ok(stats)
}

fn log_report(report: &CheckReport) {
    for applied in &report.applied {
        let write = &applied.write;
        if !applied.task_ids.is_empty() {
            tracing::info!(
                schedule = %write.name,
                ticks = ?write.ticks,
                backfilled = write.backfilled,
                tasks = ?applied.task_ids.iter().map(|t| t.0).collect::<Vec<_>>(),
                "schedule fired"
            );
        } else if write.read.is_none() {
            tracing::info!(schedule = %write.name, next_tick = %write.next_tick.map_or_else(|| "none".to_owned(), crate::time::format_instant), "schedule recorded: it fires from its next tick");
        }
        if write.skipped {
            tracing::warn!(schedule = %write.name, up_to = %crate::time::format_instant(write.advance_to), "missed ticks skipped (late beyond misfire_ms, beyond the backfill)");
        }
    }
    for refused in &report.refused {
        tracing::error!(schedule = %refused.name, error = %refused.error, "schedule's tasks refused; its ticks stay due");
    }
    if report.lost > 0 {
        tracing::debug!(lost = report.lost, "scheduler lost races to other schedulers");
    }
}

/// A seed that differs between processes, so that schedulers' backoffs do not move in step.
fn process_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded per process by the OS.
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

/// A scheduler on a runtime `R`, on its own (not inside a worker): enqueues the app's
/// schedules' ticks until told to stop. The adapters name it `Scheduler`
/// (`canter_tokio::Scheduler`, `canter_smol::Scheduler`).
pub struct PgScheduler<R> {
    store: PgStore,
    scheduler: Arc<Scheduler>,
    options: SchedulerOptions,
    migrate: bool,
    seed: u64,
    runtime: Arc<R>,
}

impl<R: Runtime + Default> PgScheduler<R> {
    /// A scheduler of `app`'s schedules on `pool` in the default schema; the app is validated
    /// and named time zones are read from the system's tz database here.
    pub fn new(pool: PgPool, app: AppConfig) -> Result<Self, SchedulerError> {
        let scheduler = Arc::new(load_scheduler(&app)?);
        Ok(PgScheduler {
            store: PgStore::new(pool, PgSchema::default(), app),
            scheduler,
            options: SchedulerOptions::default(),
            migrate: true,
            seed: process_seed(),
            runtime: Arc::new(R::default()),
        })
    }
}

impl<R: Runtime> PgScheduler<R> {
    /// Uses `schema` instead of the default `canter`.
    pub fn schema(mut self, schema: PgSchema) -> Self {
        self.store = PgStore::new(self.store.pool().clone(), schema, self.store.app().clone());
        self
    }

    /// Whether to apply missing migrations at startup (default; a current schema is only
    /// read), or only check the schema's version and refuse to start when migrations are
    /// missing (`canter scheduler --no-migrate`).
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Uses these loop settings.
    pub fn options(mut self, options: SchedulerOptions) -> Self {
        self.options = options;
        self
    }

    /// The schedules.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The store it writes to.
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// One check now (no migration, no retry): enqueues the due ticks.
    pub async fn check(&self) -> Result<CheckReport, sqlx::Error> {
        self.store.check_schedules(&self.scheduler).await
    }

    /// What a check now would write and enqueue, without writing (a dry run).
    pub async fn plan(&self) -> Result<Plan, sqlx::Error> {
        self.store.plan_schedules(&self.scheduler).await
    }

    /// Runs until the runtime's shutdown signal (SIGINT or SIGTERM).
    pub async fn run(self) -> Result<SchedulerStats, SchedulerRunError> {
        let signal = self.runtime.shutdown_signal();
        self.run_until(signal).await
    }

    /// Runs until `shutdown` resolves: first reaches the database and makes sure the schema is
    /// usable (migrating it, unless told not to), waiting out outages with backoff, then checks
    /// the schedules in a loop. A missing privilege or an unusable schema ends it with
    /// [`SchedulerRunError::Schema`].
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<SchedulerStats, SchedulerRunError> {
        let PgScheduler { store, scheduler, options, migrate, seed, runtime } = self;
        let mut shutdown = shutdown.boxed().fuse();
        let resilience: ResilienceConfig = store.app().resilience.clone();
        // The shutdown signal ends startup at once, whatever it waits on.
        let ready = {
            let startup =
                prepare_schema(&*runtime, &store, migrate, &resilience, seed, "scheduler", options.give_up).fuse();
            futures::pin_mut!(startup);
            futures::select_biased! {
                () = shutdown => return Ok(SchedulerStats::default()),
                ready = startup => ready,
            }
        };
        match ready {
            Ok(_) => {}
            Err(StartupFailure::Schema(error)) => return Err(SchedulerRunError::Schema(error)),
            Err(StartupFailure::GaveUp { failures, error }) => {
                return Err(SchedulerRunError::GaveUp { failures, error });
            }
        }
        run_scheduler(runtime, store, scheduler, options, seed, shutdown).await
    }
}
