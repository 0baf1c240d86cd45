//! Serving a worker against PostgreSQL on any runtime: startup with retries, LISTEN per queue
//! with reconnects and a poll fallback, traced handlers, hooks and counters, graceful
//! shutdown. The adapters add only what is their runtime's (timers, spawning, signals).

use std::future::Future;
use std::sync::Arc;

use futures::channel::{mpsc, oneshot};
use futures::future::{AbortHandle, Abortable, BoxFuture, FutureExt};
use futures::stream::StreamExt;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tracing::Instrument;

use super::observe::{Counters, Hook, HookSink};
use super::retry::Retry;
use super::scheduler::{SchedulerOptions, run_scheduler};
use super::startup::{StartupFailure, prepare_schema};
use super::wakeups::WakeupProvider;
use super::zones::load_scheduler;
use super::{DriverOptions, Handlers, Registry, Runtime};
use crate::check::ConfigError;
use crate::config::{AppConfig, DeploymentMode, ResilienceConfig, WorkerConfig};
use crate::postgres::replay::session_ended;
use crate::postgres::{MigrateSchemaError, PgSchema, PgStore};
use crate::rng::mix;
use crate::scheduler::SchedulerError;
use crate::task::{DbTime, TaskId, WorkerId};
use crate::wake::WakeSources;
use crate::worker::{Event, Input, Stats, TaskOutcome, TaskRun, Worker};

/// Everything a worker process serves with. Build it, then [`serve`](WorkerService::serve).
pub struct WorkerService {
    /// The application configuration (shared by every worker and client).
    pub app: AppConfig,
    /// This worker's configuration.
    pub config: WorkerConfig,
    /// The schema the tables live in.
    pub schema: PgSchema,
    /// The task handlers.
    pub registry: Arc<Registry>,
    /// This worker's id (unique across the cluster).
    pub id: WorkerId,
    /// Observers of lifecycle events.
    pub hooks: Vec<Hook>,
    /// Apply missing migrations at startup (a current schema is only read). Off, the worker
    /// only checks the schema's version and refuses to start when migrations are missing.
    pub migrate: bool,
    /// Settings of the driver loop.
    pub driver: DriverOptions,
    /// Counters, readable while the worker runs.
    pub counters: Arc<Counters>,
    /// Where the connections that keep session state (LISTEN, the liveness token) come from,
    /// when not the pool `serve` is given: a direct connection when that pool goes through
    /// PgBouncer in transaction mode (see [`PgStore::with_session_pool`]).
    pub session_pool: Option<PgPool>,
    /// Where the worker also hears of enqueues, besides LISTEN (see
    /// [`wakeups`](crate::driver::wakeups)): the provider the app's clients announce on.
    pub wakeups: Option<Arc<dyn WakeupProvider>>,
    /// The process pool isolated tasks run in, if any (see
    /// [`isolation`](crate::driver::isolation)).
    #[cfg(all(feature = "isolation", unix))]
    pub isolation: Option<super::isolation::Isolation>,
}

/// Why a worker could not be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration breaks a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The app's schedules could not be prepared (with `run_scheduler`).
    #[error(transparent)]
    Schedules(#[from] SchedulerError),
    /// The schema cannot be used: a privilege is missing, migrations are missing and the
    /// worker may not apply them, or the schema is newer than this binary accepts.
    #[error("the worker cannot start: {0}")]
    Schema(MigrateSchemaError),
    /// The database could not be reached (or migrated) within `db_retry_max_attempts` tries.
    #[error("the database could not be reached at startup after {failures} tries: {error}")]
    DatabaseUnavailable {
        /// Tries made.
        failures: u32,
        /// The last error.
        error: String,
    },
    /// The runtime dropped the worker's loop before it had shut down (the runtime itself was
    /// shutting down); tasks it held are left to their claim leases and the reaper.
    #[error("the runtime dropped the worker loop before it shut down")]
    Dropped,
}

impl WorkerService {
    /// A service with these configurations and handlers, in the default schema, with a fresh
    /// worker id. The configurations are validated here.
    pub fn new(
        app: AppConfig,
        config: WorkerConfig,
        registry: Arc<Registry>,
        id: WorkerId,
    ) -> Result<Self, ConfigError> {
        crate::config::validate_pair(&app, &config)?;
        Ok(WorkerService {
            app,
            config,
            schema: PgSchema::default(),
            registry,
            id,
            hooks: Vec::new(),
            migrate: true,
            driver: DriverOptions::default(),
            counters: Arc::new(Counters::new()),
            session_pool: None,
            wakeups: None,
            #[cfg(all(feature = "isolation", unix))]
            isolation: None,
        })
    }

    /// Runs the worker on `runtime` over `pool` until `shutdown` resolves (or the worker gives
    /// up on the database), then drains it. Database outages, at startup too, are waited out
    /// with backoff; they never end the worker unless `db_retry_max_attempts` says so. A
    /// missing privilege or an unusable schema at startup ends it with [`ServeError::Schema`].
    pub async fn serve<R: Runtime>(
        self,
        runtime: Arc<R>,
        pool: PgPool,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Stats, ServeError> {
        let WorkerService {
            mut app,
            mut config,
            schema,
            registry,
            id,
            hooks,
            migrate,
            driver,
            counters,
            session_pool,
            wakeups,
            #[cfg(all(feature = "isolation", unix))]
            isolation,
        } = self;
        // Through a pooler in transaction mode with no session pool of its own, a LISTEN would
        // hear nothing and a session lock would not outlive its statement: poll, and leave
        // dead workers to the heartbeat thresholds. A wake-up provider still carries enqueues;
        // what statements make ready (retries, promotions, hand-backs) is left to the poll.
        let listens_to_postgres = !schema.is_transaction_pooled() || session_pool.is_some();
        if !listens_to_postgres && wakeups.is_some() {
            if config.deployment_mode == DeploymentMode::EventDrivenOnly {
                tracing::warn!(
                    worker = %id,
                    poll_interval_ms = config.poll_interval_ms,
                    "connections go through a transaction pooler and no session pool was given: the wake-up provider \
                     carries enqueues, polls find the rest (Hybrid)"
                );
                config.deployment_mode = DeploymentMode::Hybrid;
            }
            app.recovery.auto_recover_dead_workers = false;
        } else if !listens_to_postgres {
            if config.deployment_mode != DeploymentMode::PollingOnly || app.recovery.auto_recover_dead_workers {
                tracing::warn!(
                    worker = %id,
                    poll_interval_ms = config.poll_interval_ms,
                    "connections go through a transaction pooler and no session pool was given: polling, without a \
                     liveness token (give a direct connection for LISTEN, e.g. --listen-database-url)"
                );
            }
            config.deployment_mode = DeploymentMode::PollingOnly;
            app.recovery.auto_recover_dead_workers = false;
        }
        // Schedules are prepared first: a bad zone or task ends the worker before it claims.
        let scheduler = if config.run_scheduler && !app.schedules.is_empty() {
            Some(Arc::new(load_scheduler(&app)?))
        } else {
            if !app.schedules.is_empty() {
                tracing::info!(worker = %id, schedules = app.schedules.len(), "not running the app's schedules (worker.run_scheduler is off)");
            }
            None
        };
        let mut store = PgStore::new(pool, schema, app.clone());
        if let Some(session_pool) = session_pool {
            store = store.with_session_pool(session_pool);
        }
        let seed = mix(config.seed_for(&id));
        let (control_tx, mut control_rx) = mpsc::unbounded::<Input>();
        // Dropping the sender stops the scheduler: at the shutdown signal, or when the worker ends.
        let (scheduler_stop_tx, scheduler_stop_rx) = oneshot::channel::<()>();
        let scheduler_stop = Arc::new(std::sync::Mutex::new(Some(scheduler_stop_tx)));
        {
            let control = control_tx.clone();
            let scheduler_stop = scheduler_stop.clone();
            runtime.spawn(Box::pin(async move {
                shutdown.await;
                stop(&scheduler_stop);
                let _ = control.unbounded_send(Input::Shutdown);
            }));
        }

        // Startup: reach the database and make sure the schema is usable (migrating it unless
        // told not to) before claiming. The shutdown signal ends it at once, whatever it waits
        // on: the migrate lock, a slow statement, the backoff sleep.
        {
            let who = format!("worker {id}");
            let startup = prepare_schema(&*runtime, &store, migrate, &app.resilience, seed, &who, true).fuse();
            futures::pin_mut!(startup);
            loop {
                futures::select! {
                    ready = startup => match ready {
                        Ok(_) => break,
                        Err(StartupFailure::Schema(error)) => return Err(ServeError::Schema(error)),
                        Err(StartupFailure::GaveUp { failures, error }) => {
                            return Err(ServeError::DatabaseUnavailable { failures, error });
                        }
                    },
                    input = control_rx.next() => if matches!(input, Some(Input::Shutdown) | None) {
                        tracing::info!(worker = %id, "shut down during startup");
                        return Ok(Stats::default());
                    },
                }
            }
        }

        // The liveness token: taken (or found held elsewhere, or failed once) before the worker
        // claims, so that its claims are covered from the first; kept until the worker ends.
        let token = if app.recovery.auto_recover_dead_workers {
            let (handle, registration) = AbortHandle::new_pair();
            let (first_tx, first_rx) = oneshot::channel::<()>();
            let keep =
                keep_token(runtime.clone(), store.clone(), id.clone(), first_tx, app.clone(), mix(seed ^ 0x70c3));
            runtime.spawn(Box::pin(Abortable::new(keep, registration).map(|_| ())));
            let waited = runtime.sleep_until(runtime.now() + TOKEN_STARTUP_WAIT).fuse();
            futures::pin_mut!(waited);
            let mut first = first_rx.fuse();
            futures::select! {
                _ = first => {}
                () = waited => tracing::warn!(worker = %id, "the liveness token is not taken yet: claiming without it"),
            }
            Some(handle)
        } else {
            None
        };

        let worker = Worker::new(id.clone(), app.clone(), config.clone(), runtime.now())?;
        let policy = worker.policy().clone();
        tracing::info!(
            worker = %id,
            queues = ?policy.queues.iter().map(|q| (&q.name, q.priority, q.max_concurrency)).collect::<Vec<_>>(),
            concurrency = config.concurrency,
            prefetch_buffer = app.prefetch_buffer,
            mode = if app.is_hard_cap_mode() { "hard cap" } else { "soft cap" },
            cluster_wide_cap = ?app.cluster_wide_cap,
            max_claim_batch = config.max_claim_batch,
            max_claim_per_worker = worker.policy().max_claimed(),
            deployment = ?config.deployment_mode,
            "canter worker starting"
        );

        let (notes_tx, notes_rx) = mpsc::channel::<Input>(config.coalesce_notifies as usize);
        let queues: Vec<String> = policy.queues.iter().map(|q| q.name.clone()).collect();
        let listens = config.deployment_mode.listens();
        // The wake-up sources and their listening states, reported to the machine as one.
        let postgres_source = (listens && listens_to_postgres).then_some(0);
        let provider_source = (listens && wakeups.is_some()).then(|| postgres_source.map_or(0, |_| 1));
        let sources = usize::from(postgres_source.is_some()) + usize::from(provider_source.is_some());
        let (states_tx, states_rx) = mpsc::unbounded::<(usize, bool)>();
        let mut merged = WakeSources::new(sources);
        let states =
            states_rx.filter_map(move |(source, connected)| futures::future::ready(merged.update(source, connected)));
        let listener = postgres_source.map(|source| {
            let (handle, registration) = AbortHandle::new_pair();
            let listen = listen(
                runtime.clone(),
                store.clone(),
                queues.clone(),
                notes_tx.clone(),
                SourceReport { states: states_tx.clone(), source },
                app.resilience.clone(),
                mix(seed),
            );
            runtime.spawn(Box::pin(Abortable::new(listen, registration).map(|_| ())));
            handle
        });
        let subscription = provider_source.zip(wakeups.as_ref()).map(|(source, provider)| {
            tracing::info!(worker = %id, provider = provider.name(), "hearing of enqueues through a wake-up provider");
            let (handle, registration) = AbortHandle::new_pair();
            let heard = provider.subscribe(queues.clone());
            let forward = forward_heard(heard, notes_tx.clone(), SourceReport { states: states_tx.clone(), source });
            runtime.spawn(Box::pin(Abortable::new(forward, registration).map(|_| ())));
            handle
        });
        drop((notes_tx, states_tx));

        let scheduler_done = scheduler.map(|scheduler| {
            let (done_tx, done_rx) = oneshot::channel::<()>();
            let options = SchedulerOptions { give_up: false, ..SchedulerOptions::default() };
            let stopped = async move {
                let _ = scheduler_stop_rx.await;
            };
            let run =
                run_scheduler(runtime.clone(), store.clone(), scheduler, options, mix(seed ^ 0x5c4e_d01e), stopped);
            let worker = id.clone();
            runtime.spawn(Box::pin(async move {
                if let Err(error) = run.await {
                    tracing::error!(%worker, %error, "the scheduler stopped");
                }
                let _ = done_tx.send(());
            }));
            done_rx
        });

        let mut sink = HookSink::start(&*runtime, hooks, counters.clone());
        let driver = DriverOptions { counters: Some(counters), ..driver };
        let log_id = id.clone();
        let observer: super::Observer = Box::new(move |event| {
            log_event(&log_id, event);
            sink.observe(event);
        });
        let handlers: Arc<dyn Handlers> = Arc::new(Traced { inner: registry.clone().bind(runtime.clone()) });
        #[cfg(all(feature = "isolation", unix))]
        let handlers: Arc<dyn Handlers> = match isolation {
            Some(isolation) => {
                let names = isolation.names(&registry);
                tracing::info!(worker = %id, processes = isolation.pool.processes(), tasks = ?names, "isolated tasks run in child processes");
                Arc::new(super::isolation::IsolatedHandlers::new(handlers, isolation.pool, names))
            }
            None => handlers,
        };
        let inputs = futures::stream::select(futures::stream::select(control_rx, states), notes_rx);
        // The loop runs as a task of the runtime, beside the handlers it spawns, whatever polls
        // this future (often `block_on` on a thread of its own): otherwise every spawn and every
        // finished handler would wake a thread across the runtime's boundary.
        let (stats_tx, stats_rx) = oneshot::channel::<Stats>();
        let driven = super::run(worker, runtime.clone(), store, handlers, inputs, driver, Some(observer));
        runtime.spawn(Box::pin(async move {
            let _ = stats_tx.send(driven.await);
        }));
        let stats = stats_rx.await.map_err(|_| ServeError::Dropped);
        for source in listener.into_iter().chain(subscription) {
            source.abort();
        }
        // Its connection closes with it, and the server releases the token.
        if let Some(token) = token {
            token.abort();
        }
        stop(&scheduler_stop);
        if let Some(done) = scheduler_done {
            let _ = done.await;
        }
        let stats = stats?;
        tracing::info!(worker = %id, %stats, "canter worker stopped");
        Ok(stats)
    }
}

/// Stops the scheduler by dropping its stop sender (once; later calls do nothing).
fn stop(sender: &std::sync::Mutex<Option<oneshot::Sender<()>>>) {
    drop(sender.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take());
}

fn log_event(worker: &WorkerId, event: &Event) {
    match event {
        Event::DbUnavailable { failures, retry_in, error } => {
            tracing::warn!(%worker, failures, retry_in = %super::duration_text(*retry_in), %error, "database unavailable")
        }
        Event::DbRecovered => tracing::info!(%worker, "database reachable again"),
        Event::Lost { task, reason } => tracing::warn!(%worker, %task, %reason, "task lost"),
        // A task failing is ordinary: its policy decides what follows.
        Event::TimedOut { task } => tracing::info!(%worker, %task, "handler timed out"),
        Event::GaveUp => tracing::error!(%worker, "too many database failures in a row: shutting down"),
        Event::Reaped(report) => tracing::info!(%worker, %report, "reaper recovered tasks"),
        Event::Purged { tasks } => tracing::info!(%worker, tasks, "purged finished tasks past their retention"),
        Event::Vacuumed(tables) => {
            for t in tables {
                tracing::debug!(%worker, table = %t.table, dead_before = t.dead_before, dead_after = t.dead_after, "vacuumed");
            }
        }
        Event::Drained { abandoned } => tracing::info!(%worker, abandoned, "drained"),
        Event::OutcomeRefused { task, problem } => {
            tracing::warn!(%worker, %task, %problem, "outcome refused: the task fails with WORKER_SERIALIZATION_ERROR")
        }
        Event::OutcomeDropped { task, problem } => {
            tracing::error!(%worker, %task, %problem, "the database keeps refusing a task's finish: dropped, left to the reaper")
        }
        Event::UnreadableRow { task, problem } => tracing::warn!(%worker, %task, %problem, "unreadable task row"),
        Event::LeaseWentBack { task, held, claimed } => {
            tracing::error!(%worker, %task, %held, %claimed, "the database handed out an older lease than this worker held: it went back in time (a restore, a failover?)")
        }
        Event::ReapSkipped => tracing::debug!(%worker, "reaper pass skipped: another reaper holds the lock"),
        _ => {}
    }
}

/// Handlers run inside a span per task (id, name, queue, attempt).
struct Traced<H> {
    inner: H,
}

impl<H: Handlers> Handlers for Traced<H> {
    fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome> {
        let span = tracing::info_span!("canter.task", id = %run.id, name = %run.name, queue = %run.queue, attempt = run.attempt.0);
        self.inner.run(run).instrument(span).boxed()
    }
}

/// LISTENs on the queues' channels and the abort channel and turns notifications into wake-ups
/// and revocations, reconnecting with backoff; reports the listener's state so the worker polls
/// while it is deaf.
async fn listen<R: Runtime>(
    runtime: Arc<R>,
    store: PgStore,
    queues: Vec<String>,
    mut notes: mpsc::Sender<Input>,
    report: SourceReport,
    resilience: ResilienceConfig,
    seed: u64,
) {
    let prefix = store.schema().queue_channel_prefix();
    let abort = store.schema().abort_channel();
    let mut channels: Vec<String> = queues.iter().map(|q| store.schema().queue_channel(q)).collect();
    channels.push(abort.clone());
    let mut retry = Retry::new(&resilience, seed);
    // Sessions lost as they started to listen or soon after, in a row.
    let mut lost_in_a_row = 0;
    loop {
        // A session that listened for a while and was lost, or that the server ended (a
        // terminated backend), is not an outage: listen again at once, up to a few times in a
        // row. Failing to connect is, and backs off.
        let mut at_once = false;
        let listening = match PgListener::connect_with(store.session_pool()).await {
            Ok(mut listener) => match listener.listen_all(channels.iter().map(String::as_str)).await {
                Ok(()) => Some(listener),
                Err(error) => {
                    lost_in_a_row += 1;
                    at_once = session_ended(&error) && lost_in_a_row <= LOST_AT_ONCE_IN_A_ROW;
                    None
                }
            },
            Err(_) => None,
        };
        if let Some(mut listener) = listening {
            // A lost connection ends this loop, which connects again itself.
            listener.eager_reconnect(false);
            let since = runtime.now();
            retry.succeeded();
            report.connected(true);
            // Tasks may have arrived unannounced while deaf: one wake-up per queue.
            for queue in &queues {
                let _ = notes.try_send(Input::Notified { queue: queue.clone(), priority: None, run_at: None });
            }
            // A note dropped for a full channel: the next one names no run-at.
            let mut dropped = false;
            while let Ok(Some(note)) = listener.try_recv().await {
                if note.channel() == abort {
                    // Ids that do not parse are left out: the worker's heartbeat still finds
                    // what it lost, at its interval.
                    let tasks: Vec<TaskId> =
                        note.payload().split(',').filter_map(|id| id.parse::<i64>().ok()).map(TaskId).collect();
                    tracing::trace!(target: "canter::listen", ?tasks, "revoked");
                    let _ = notes.try_send(Input::Revoked { tasks });
                } else if let Some(queue) = note.channel().strip_prefix(&prefix) {
                    let (priority, run_at) = parse_ready(note.payload());
                    tracing::trace!(target: "canter::listen", queue, ?priority, ?run_at, "notified");
                    // The worker claims from the announced run-ats on while they are all it
                    // heard since its last pass: once one is dropped, the next says "any".
                    let run_at = run_at.filter(|_| !dropped);
                    let note = Input::Notified { queue: queue.to_owned(), priority, run_at };
                    dropped = match notes.try_send(note) {
                        Ok(()) => false,
                        // A full channel: the worker is behind, and wake-ups coalesce anyway.
                        Err(full) => full.is_full(),
                    };
                }
            }
            lost_in_a_row = if runtime.now() >= since + LISTENED_A_WHILE { 0 } else { lost_in_a_row + 1 };
            at_once = lost_in_a_row <= LOST_AT_ONCE_IN_A_ROW;
        }
        report.connected(false);
        if !at_once {
            retry.pause(&*runtime).await;
        }
    }
}

/// Where a wake-up source reports its connection: to the merge of the worker's sources
/// ([`WakeSources`]), as source number `source`.
#[derive(Clone)]
struct SourceReport {
    states: mpsc::UnboundedSender<(usize, bool)>,
    source: usize,
}

impl SourceReport {
    /// Reports the source connected or lost; `false` when the worker is gone.
    fn connected(&self, connected: bool) -> bool {
        self.states.unbounded_send((self.source, connected)).is_ok()
    }
}

/// The most urgent priority and the earliest run-at (ms on the database's clock) that a queue
/// channel's payload announces: `"<priority>"` (keyed enqueues, promotions) or `"<priority>
/// <run-at>"` (enqueues without keys). Anything else, an empty payload included (hand-backs,
/// retries, resumes), announces neither.
fn parse_ready(payload: &str) -> (Option<i16>, Option<DbTime>) {
    let (priority, run_at) = payload.split_once(' ').map_or((payload, None), |(p, r)| (p, Some(r)));
    let Ok(priority) = priority.parse::<i16>() else { return (None, None) };
    (Some(priority), run_at.and_then(|r| r.parse::<i64>().ok()).map(DbTime))
}

/// Passes what a wake-up provider's subscription hears to the worker: wake-ups as notes (a
/// full channel drops one: they coalesce), its listening state as its source's.
async fn forward_heard(
    mut heard: futures::stream::BoxStream<'static, Input>,
    mut notes: mpsc::Sender<Input>,
    report: SourceReport,
) {
    while let Some(input) = heard.next().await {
        match input {
            Input::Listener { connected } => {
                if !report.connected(connected) {
                    return;
                }
            }
            note => {
                if notes.try_send(note).is_err_and(|e| e.is_disconnected()) {
                    return;
                }
            }
        }
    }
    // A provider's stream that ended hears nothing more: the worker is deaf on its side.
    report.connected(false);
}

/// How long a listening session must have lived for its loss to be followed by a new one at
/// once however often it happens (shorter ones count as failures in a row): long enough that
/// a loop of sessions lost as soon as they listen backs off, short enough that sessions
/// terminated every few hundred milliseconds do not (`canter bench --workload backend-kills`).
const LISTENED_A_WHILE: std::time::Duration = std::time::Duration::from_millis(100);

/// How many listening sessions lost soon after they listened are followed by a new one at once,
/// in a row, before the listener backs off.
const LOST_AT_ONCE_IN_A_ROW: u32 = 3;

/// How long a starting worker waits for its liveness token before it claims without it (its
/// keeper goes on trying).
const TOKEN_STARTUP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Holds the worker's liveness token (`recovery.auto_recover_dead_workers`) on a connection of
/// its own, detached from the pool, for as long as it runs (aborted when the worker ends, which
/// closes the connection). The connection is pinged at half the liveness grace (at most every
/// second, at least every 100 ms): one that died is replaced and the token taken again, within
/// the grace, so a lost connection costs nothing while a dead process loses its token for good.
/// `first` is signalled after the first try, whatever came of it.
async fn keep_token<R: Runtime>(
    runtime: Arc<R>,
    store: PgStore,
    id: WorkerId,
    first: oneshot::Sender<()>,
    app: AppConfig,
    seed: u64,
) {
    let ping = std::time::Duration::from_millis((app.recovery.liveness_grace_ms / 2).clamp(100, 1_000));
    let mut first = Some(first);
    let mut retry = Retry::new(&app.resilience, seed);
    let mut warned = false;
    loop {
        let taken = match store.session_pool().acquire().await {
            Ok(connection) => {
                let mut connection = connection.detach();
                match store.take_token(&mut connection, &id).await {
                    Ok(true) => Some(connection),
                    Ok(false) => {
                        if !warned {
                            tracing::warn!(worker = %id, "another session holds this worker's liveness token (the same worker id twice?): recovered by heartbeats only until it is free");
                            warned = true;
                        }
                        None
                    }
                    Err(error) => {
                        tracing::debug!(worker = %id, %error, "taking the liveness token failed");
                        None
                    }
                }
            }
            Err(error) => {
                tracing::debug!(worker = %id, %error, "no connection for the liveness token");
                None
            }
        };
        if let Some(sender) = first.take() {
            let _ = sender.send(());
        }
        if let Some(mut connection) = taken {
            retry.succeeded();
            warned = false;
            tracing::debug!(worker = %id, "liveness token taken");
            loop {
                runtime.sleep_until(runtime.now() + ping).await;
                if let Err(error) = sqlx::Connection::ping(&mut connection).await {
                    tracing::warn!(worker = %id, %error, "the liveness token's connection was lost: taking the token again");
                    break;
                }
            }
            // At once: the grace runs.
            continue;
        }
        retry.pause(&*runtime).await;
    }
}

/// A lazily connecting pool of at most `max_connections` for `url`: nothing is dialled until
/// first use, so a worker can start while the database is down and wait it out. Connections
/// are not pinged before use (sqlx's default): the ping is a round trip of its own before
/// every statement, and a dead connection fails its statement anyway, which the worker and
/// the client retry. Every session carries [`SESSION_SETTINGS`](crate::postgres::SESSION_SETTINGS)
/// (statement, lock and idle-transaction timeouts), and every connection `TCP_NODELAY`
/// ([`pool_options`](crate::postgres::pool_options)).
pub fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    Ok(lazy_pool(crate::postgres::with_session_settings(url.parse()?), max_connections))
}

/// As [`connect`], for a `url` that goes through a pooler in transaction mode (PgBouncer):
/// without startup parameters, which PgBouncer refuses unless told to ignore them (Canter's
/// session settings are then set per transaction: see
/// [`PgSchema::transaction_pooled`](crate::postgres::PgSchema::transaction_pooled)).
pub fn connect_through_pooler(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    Ok(lazy_pool(options.extra_float_digits(None), max_connections))
}

fn lazy_pool(options: sqlx::postgres::PgConnectOptions, max_connections: u32) -> PgPool {
    crate::postgres::pool_options(&options)
        .max_connections(max_connections.max(2))
        .acquire_timeout(std::time::Duration::from_secs(5))
        .test_before_acquire(false)
        .connect_lazy_with(options)
}

/// A worker id unique across the cluster: host, process and a random part.
pub fn new_worker_id() -> WorkerId {
    use std::hash::{BuildHasher, Hasher};
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "worker".to_owned());
    // RandomState is seeded per process by the OS: enough to tell restarts apart.
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    WorkerId(format!("{host}-{}-{:08x}", std::process::id(), random as u32))
}

/// A worker on a runtime `R`: claims and runs tasks of its queues until told to stop. The
/// adapters name it `Worker` (`canter_tokio::Worker`, `canter_smol::Worker`).
pub struct PgWorker<R> {
    service: WorkerService,
    pool: PgPool,
    runtime: Arc<R>,
}

impl<R: Runtime + Default> PgWorker<R> {
    /// A worker on `pool` with these configurations and handlers (validated here).
    pub fn new(
        pool: PgPool,
        app: AppConfig,
        config: WorkerConfig,
        registry: Arc<Registry>,
    ) -> Result<Self, ConfigError> {
        let service = WorkerService::new(app, config, registry, new_worker_id())?;
        Ok(PgWorker { service, pool, runtime: Arc::new(R::default()) })
    }

    /// A worker configured by a TOML or JSON file with `[app]` and `[worker]` tables.
    pub fn from_config_file(
        pool: PgPool,
        path: &std::path::Path,
        registry: Arc<Registry>,
    ) -> Result<Self, crate::config::LoadError> {
        let config = super::read_config(path)?;
        Ok(PgWorker::new(pool, config.app, config.worker, registry)?)
    }
}

impl<R: Runtime> PgWorker<R> {
    /// Uses `schema` instead of the default `canter`.
    pub fn schema(mut self, schema: PgSchema) -> Self {
        self.service.schema = schema;
        self
    }

    /// Uses `id` instead of a generated one.
    pub fn id(mut self, id: WorkerId) -> Self {
        self.service.id = id;
        self
    }

    /// Whether to apply missing migrations at startup (default; a current schema is only
    /// read), or only check the schema's version and refuse to start when migrations are
    /// missing (for a role without CREATE rights; `canter worker --no-migrate`).
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.service.migrate = migrate;
        self
    }

    /// Takes the connections that keep session state (LISTEN for wake-ups, the liveness
    /// token) from `pool`: a direct connection when the worker's pool goes through PgBouncer in
    /// transaction mode, where neither outlives a transaction (see
    /// [`PgStore::with_session_pool`]). A few connections suffice: the listener and the token
    /// hold one each.
    pub fn session_pool(mut self, pool: PgPool) -> Self {
        self.service.session_pool = Some(pool);
        self
    }

    /// Hears of enqueues through `provider` too (RabbitMQ, NATS: see
    /// [`wakeups`](crate::driver::wakeups)), the provider the app's clients announce on.
    pub fn wakeups(mut self, provider: Arc<dyn WakeupProvider>) -> Self {
        self.service.wakeups = Some(provider);
        self
    }

    /// Runs the isolated tasks in `isolation`'s pool of child processes (see
    /// [`isolation`](crate::driver::isolation)); the program's `main` must serve as a child
    /// first thing when started as one.
    #[cfg(all(feature = "isolation", unix))]
    pub fn isolate(mut self, isolation: super::isolation::Isolation) -> Self {
        self.service.isolation = Some(isolation);
        self
    }

    /// Calls `hook` with every lifecycle event, on a task of its own: a slow hook never slows
    /// the worker; events it has no room for are dropped and counted.
    pub fn on_event(mut self, hook: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.service.hooks.push(Arc::new(hook));
        self
    }

    /// Counters readable while the worker runs.
    pub fn counters(&self) -> Arc<Counters> {
        self.service.counters.clone()
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &WorkerId {
        &self.service.id
    }

    /// Runs until the runtime's shutdown signal (SIGINT or SIGTERM), then shuts down
    /// gracefully.
    pub async fn run(self) -> Result<Stats, ServeError> {
        let signal = self.runtime.shutdown_signal();
        self.run_until(signal).await
    }

    /// Runs until `shutdown` resolves, then shuts down gracefully: buffered claims go back at
    /// once, running handlers get the grace period, the rest return to Pending.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<Stats, ServeError> {
        self.service.serve(self.runtime, self.pool, shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_payload_announces_a_priority_and_perhaps_a_run_at() {
        assert_eq!(parse_ready("-3"), (Some(-3), None));
        assert_eq!(parse_ready("0 1764201600123"), (Some(0), Some(DbTime(1_764_201_600_123))));
        // A run-at that does not parse is no run-at; a priority that does not, announces nothing.
        assert_eq!(parse_ready("2 soon"), (Some(2), None));
        assert_eq!(parse_ready(""), (None, None));
        assert_eq!(parse_ready("urgent 1764201600123"), (None, None));
        assert_eq!(parse_ready("40000"), (None, None));
    }
}
