//! The driver (feature `driver`): one async loop that runs a [`Worker`] machine on any runtime.
//!
//! The loop does what the machine asks and nothing else: it runs database requests on a
//! [`Store`], spawns handlers through [`Handlers`] on the [`Runtime`], sleeps until the next
//! deadline, and feeds back every reply, outcome, notification and timeout. The tokio and smol
//! adapters implement [`Runtime`] in a few lines each and share everything here.
//!
//! It is written against `futures` only. The loop itself is a single task: database requests
//! run concurrently inside it (they are futures, not spawned tasks), handlers are spawned.
//!
//! Beside it, with `postgres`, the scheduler loop ([`run_scheduler`], [`PgScheduler`]) enqueues
//! the app's schedules' ticks, inside workers or on its own; [`load_time_zone`] reads the zone
//! files the pure [`schedule`](crate::schedule) module needs.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::mpsc;
use futures::future::{AbortHandle, Abortable, BoxFuture, FutureExt};
use futures::stream::{FusedStream, FuturesUnordered, Stream, StreamExt};

#[cfg(all(feature = "isolation", unix))]
pub mod isolation;
#[cfg(feature = "metrics")]
pub mod metrics;
mod observe;
mod registry;
#[cfg(feature = "postgres")]
mod retry;
mod zones;

#[cfg(feature = "postgres")]
mod client;
#[cfg(feature = "postgres")]
mod scheduler;
#[cfg(feature = "postgres")]
mod service;
#[cfg(feature = "postgres")]
mod startup;
#[cfg(feature = "postgres")]
pub mod wakeups;
#[cfg(feature = "postgres")]
mod workflow;

#[cfg(feature = "postgres")]
pub use client::{Client, ClientError, ResultError, ResultHandle};
pub use observe::{
    CounterSnapshot, Counters, HOOK_BUFFER, Hook, HookSink, REQUEST_SECONDS_BUCKETS, REQUEST_TASKS_BUCKETS,
    RequestStats,
};
pub use registry::{BoundRegistry, Registry, RegistryError, TaskContext, TaskHandle};
#[cfg(feature = "postgres")]
pub use scheduler::{PgScheduler, SchedulerOptions, SchedulerRunError, SchedulerStats, run_scheduler};
#[cfg(feature = "postgres")]
pub use service::{PgWorker, ServeError, WorkerService, connect, connect_through_pooler, new_worker_id};
#[cfg(feature = "postgres")]
pub use startup::STARTUP_LOCK_WAIT;
#[cfg(feature = "postgres")]
pub use workflow::{ParentResult, Step, Workflow, WorkflowHandle};
pub use zones::{DEFAULT_ZONEINFO_DIR, ZoneLoadError, load_scheduler, load_time_zone, zoneinfo_dir};

use crate::store::{DbFailure, DbReply, DbRequest, OpId};
use crate::task::{ErrorCode, Lease, TaskError, TaskId};
use crate::worker::{Command, Event, Input, Stats, TaskOutcome, TaskRun, Worker};

/// What the driver needs from an async runtime: a clock, timers and spawning.
pub trait Runtime: Send + Sync + 'static {
    /// The current time. Adapters may return a virtual clock (tokio's paused time).
    fn now(&self) -> Instant;
    /// A future that resolves at `deadline`.
    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()>;
    /// Runs `future` in the background.
    fn spawn(&self, future: BoxFuture<'static, ()>);
    /// Runs blocking `work` on a thread meant for it; the future resolves when it is done.
    fn spawn_blocking(&self, work: Box<dyn FnOnce() + Send + 'static>) -> BoxFuture<'static, ()>;
    /// Resolves when the process is asked to stop (SIGINT, SIGTERM); never by default.
    fn shutdown_signal(&self) -> BoxFuture<'static, ()> {
        Box::pin(futures::future::pending())
    }
}

/// Where database requests go: the PostgreSQL store, or a memory store behind a lock.
pub trait Store: Send + Sync + 'static {
    /// Runs one request of the worker machine.
    fn execute(&self, request: DbRequest) -> BoxFuture<'static, Result<DbReply, DbFailure>>;
}

/// The registered task handlers.
pub trait Handlers: Send + Sync + 'static {
    /// Runs the handler of `run.name` on `run.args`. An unknown name resolves to a failure
    /// with `WORKER_RESOLUTION_ERROR`, undecodable arguments to `WORKER_SERIALIZATION_ERROR`.
    /// A panic while the future is polled is caught by the driver (`UNHANDLED_ERROR`): do the
    /// work inside the future, not in `run` itself. A timed-out blocking handler's thread
    /// cannot be stopped: it runs to its end while the task is written as timed out.
    fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome>;
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn execute(&self, request: DbRequest) -> BoxFuture<'static, Result<DbReply, DbFailure>> {
        (**self).execute(request)
    }
}

impl<H: Handlers + ?Sized> Handlers for Arc<H> {
    fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome> {
        (**self).run(run)
    }
}

/// Settings of the loop itself (the machine's live in its own configuration).
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// A database request with no answer after this long counts as `Unknown`.
    pub request_timeout: Duration,
    /// Where the loop publishes the machine's [`Stats`] and how many tasks it holds, after
    /// every turn.
    pub counters: Option<Arc<Counters>>,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions { request_timeout: Duration::from_secs(30), counters: None }
    }
}

/// Called with every event the machine emits, in order. It runs inside the loop: keep it
/// short and never block (hand work to a channel, as the adapters' hooks do).
pub type Observer = Box<dyn FnMut(&Event) + Send>;

/// How many finished handlers one turn of the loop takes in after the input it woke for.
const DONE_PER_TURN: usize = 256;

/// How many waiting outside inputs (notifications) one turn takes in besides.
const INPUTS_PER_TURN: usize = 64;

type DbFuture = Pin<Box<dyn Future<Output = (OpId, Result<DbReply, DbFailure>)> + Send>>;

/// Runs `worker` until it has shut down and drained; returns its final counters.
///
/// `inputs` carries what comes from outside: notifications (`Input::Notified`), listener
/// state (`Input::Listener`) and `Input::Shutdown`. When `inputs` ends, the worker is shut
/// down gracefully.
pub async fn run<R, S, H, I>(
    mut worker: Worker,
    runtime: Arc<R>,
    store: S,
    handlers: H,
    inputs: I,
    options: DriverOptions,
    mut observer: Option<Observer>,
) -> Stats
where
    R: Runtime,
    S: Store,
    H: Handlers,
    I: Stream<Item = Input> + Unpin,
{
    let mut inputs = inputs.fuse();
    let (done_tx, mut done_rx) = mpsc::unbounded::<(TaskId, Lease, TaskOutcome)>();
    let mut requests: FuturesUnordered<DbFuture> = FuturesUnordered::new();
    // The handler running for each task, under the lease it runs with: a late answer of an
    // older run must not take the abort handle of a newer one.
    let mut running: BTreeMap<TaskId, (Lease, AbortHandle)> = BTreeMap::new();
    let mut shutdown_sent = false;
    let mut sleep: Option<(Instant, futures::future::Fuse<BoxFuture<'static, ()>>)> = None;

    loop {
        // 1. Do everything the machine asked for.
        while let Some(command) = worker.poll_command() {
            match command {
                Command::Db { op, request } => {
                    let (kind, items) = (request_label(&request), request.items());
                    let reply = store.execute(request);
                    let sent = runtime.now();
                    let timeout = sleep_after(&*runtime, sent, options.request_timeout);
                    let limit = options.request_timeout;
                    let clock = runtime.clone();
                    let counters = options.counters.clone();
                    requests.push(Box::pin(async move {
                        let answer = futures::select! {
                            reply = reply.fuse() => reply,
                            () = timeout.fuse() => Err(DbFailure::Unknown(format!("no reply within {limit:?}"))),
                        };
                        // Where a worker's time goes, request by request (`CANTER_LOG=canter::db=trace`).
                        let claimed = match &answer {
                            Ok(DbReply::Claimed { tasks, .. } | DbReply::FinishedAndClaimed { tasks, .. }) => {
                                tasks.len()
                            }
                            _ => 0,
                        };
                        let took = clock.now().saturating_duration_since(sent);
                        if let Some(counters) = &counters {
                            // What it named (a finish's outcomes, a heartbeat's leases), or what
                            // a claim brought back.
                            counters.record_request(
                                kind,
                                took,
                                if items == 0 { claimed } else { items },
                                answer.is_ok(),
                            );
                        }
                        let ms = took.as_secs_f64() * 1e3;
                        tracing::trace!(target: "canter::db", %op, kind, items, claimed, ms, ok = answer.is_ok());
                        (op, answer)
                    }));
                }
                Command::Spawn(run) => {
                    let (handle, registration) = AbortHandle::new_pair();
                    if let Some((_, previous)) = running.insert(run.id, (run.lease, handle)) {
                        previous.abort();
                    }
                    let (task, lease) = (run.id, run.lease);
                    let handler = handlers.run(run);
                    let done = done_tx.clone();
                    runtime.spawn(Box::pin(async move {
                        let caught = Abortable::new(AssertUnwindSafe(handler).catch_unwind(), registration).await;
                        let outcome = match caught {
                            Err(_aborted) => return,
                            Ok(Ok(outcome)) => outcome,
                            Ok(Err(panic)) => TaskOutcome::Failure(panic_error(panic.as_ref())),
                        };
                        let _ = done.unbounded_send((task, lease, outcome));
                    }));
                }
                Command::Abort { task, lease } => {
                    if running.get(&task).is_some_and(|(held, _)| *held == lease) {
                        let (_, handle) = running.remove(&task).expect("checked above");
                        handle.abort();
                    }
                }
            }
        }
        while let Some(event) = worker.poll_event() {
            if let Some(observer) = observer.as_mut() {
                observer(&event);
            }
        }
        if let Some(counters) = &options.counters {
            counters.publish(worker.stats(), worker.health(), worker.held());
        }
        if worker.is_stopped() {
            return worker.stats();
        }

        // 2. Wait for the first of: a reply, a handler, an outside input, the next deadline.
        // The timer is kept while the deadline stands: a fresh one per input would register
        // and drop a runtime timer for every task.
        let deadline = worker.poll_timeout().map(|(at, _)| at);
        if sleep.as_ref().map(|(at, _)| *at) != deadline {
            sleep = deadline.map(|at| (at, runtime.sleep_until(at).fuse()));
        }
        let mut next_sleep = match sleep.as_mut() {
            Some((_, timer)) => futures::future::Either::Left(timer),
            None => futures::future::Either::Right(futures::future::pending::<()>()),
        };
        let mut next_reply = requests.select_next_some();
        let mut next_done = done_rx.select_next_some();
        // An ended input stream is ready at once forever: wait on it only while it is open.
        let mut next_input = if inputs.is_terminated() {
            futures::future::Either::Left(futures::future::pending::<Option<Input>>())
        } else {
            futures::future::Either::Right(inputs.next())
        }
        .fuse();
        let input = futures::select_biased! {
            (op, reply) = next_reply => Some(Input::Db { op, reply }),
            (task, lease, outcome) = next_done => Some(task_finished(task, lease, outcome)),
            input = next_input => match input {
                Some(input) => Some(input),
                // The outside world hung up: shut down gracefully.
                None if !shutdown_sent => Some(Input::Shutdown),
                None => None,
            },
            () = next_sleep => None,
        };
        if input.is_none() {
            sleep = None;
        }

        // 3. Feed it back: one input, or the timers that are due.
        let now = runtime.now();
        match input {
            Some(input) => {
                if let Input::TaskFinished { task, lease, .. } = &input {
                    if running.get(task).is_some_and(|(held, _)| held == lease) {
                        running.remove(task);
                    }
                }
                if matches!(input, Input::Shutdown) {
                    shutdown_sent = true;
                }
                // Handlers that finished meanwhile go in the same turn, and the machine decides
                // once for all of them: one finish and one claim for the slots they freed.
                let mut batch = vec![input];
                for _ in 0..DONE_PER_TURN {
                    let Ok((task, lease, outcome)) = done_rx.try_recv() else { break };
                    if running.get(&task).is_some_and(|(held, _)| *held == lease) {
                        running.remove(&task);
                    }
                    batch.push(task_finished(task, lease, outcome));
                }
                // Notifications that came meanwhile too: while handlers finish without pause
                // (a drain), the biased wait above would never get to them, and an announced
                // urgent task would wait for the drain.
                for _ in 0..INPUTS_PER_TURN {
                    match inputs.next().now_or_never() {
                        Some(Some(input)) => {
                            if matches!(input, Input::Shutdown) {
                                shutdown_sent = true;
                            }
                            batch.push(input);
                        }
                        _ => break,
                    }
                }
                worker.handle_inputs(batch, now);
                // A steady stream of inputs must not starve the timers (heartbeats, timeouts).
                if worker.poll_timeout().is_some_and(|(at, _)| at <= now) {
                    worker.handle_timeout(now);
                }
            }
            None => worker.handle_timeout(now),
        }
    }
}

/// Reads the configuration file at `path`: TOML (`.toml`) or JSON (`.json`) with `[app]` and
/// `[worker]` tables, validated ([`Config::from_file_text`](crate::config::Config::from_file_text)).
pub fn read_config(path: &std::path::Path) -> Result<crate::config::Config, crate::config::LoadError> {
    let config = read_config_unchecked(path)?;
    config.validate()?;
    Ok(config)
}

/// Reads and parses a configuration file as [`read_config`] does, without checking the rules
/// ([`Config::parse_file_text`](crate::config::Config::parse_file_text)): the caller lays its
/// own settings over it, then validates the whole.
pub fn read_config_unchecked(path: &std::path::Path) -> Result<crate::config::Config, crate::config::LoadError> {
    crate::config::Config::format_of(path)?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| crate::config::LoadError::Io { path: path.to_path_buf(), message: e.to_string() })?;
    crate::config::Config::parse_file_text(path, &text)
}

/// What the counters and traces call a request: its kind, with the claims bounded by priority
/// ([`DbRequest::is_urgent_claim`]) apart from the passes (a few rows, where a pass may bring
/// thousands), so their round trip shows.
fn request_label(request: &DbRequest) -> &'static str {
    if request.is_urgent_claim() { "urgent_claim" } else { request.kind() }
}

/// A sleep until `from + wait`. A wait past the clock's range (`Duration::MAX`, a huge
/// timeout) never resolves, where `Instant + Duration` would panic.
pub(crate) fn sleep_after<R: Runtime + ?Sized>(runtime: &R, from: Instant, wait: Duration) -> BoxFuture<'static, ()> {
    match from.checked_add(wait) {
        Some(at) => runtime.sleep_until(at),
        None => Box::pin(futures::future::pending()),
    }
}

/// A wait as logs show it: `1.5s`, `250ms`.
pub(crate) fn duration_text(wait: Duration) -> String {
    crate::time::format_duration_ms(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX))
}

/// A handler's outcome as the machine's input. A failure is logged, one line, at info: a task
/// failing is ordinary (its policy decides what comes next), and a panic's own message was
/// already printed by the process's panic hook, if it prints them.
fn task_finished(task: TaskId, lease: Lease, outcome: TaskOutcome) -> Input {
    if let TaskOutcome::Failure(error) = &outcome {
        tracing::info!(task = task.0, code = %error.code, "task {task} failed: {}", error.message);
    }
    Input::TaskFinished { task, lease, outcome }
}

/// The error a panicking handler ends with.
pub fn panic_error(payload: &(dyn std::any::Any + Send)) -> TaskError {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "the handler panicked".to_owned());
    TaskError::new(ErrorCode::UnhandledError, format!("handler panicked: {message}"))
}

/// A [`MemoryStore`](crate::memory::MemoryStore) shared by drivers: the embedded store for
/// demos and for tests that run the real async loop without PostgreSQL. Its clock is the
/// runtime's, mapped onto a database time.
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<std::sync::Mutex<MemoryInner>>,
    clock: Arc<dyn Fn() -> Instant + Send + Sync>,
}

struct MemoryInner {
    store: crate::memory::MemoryStore,
    subscribers: Vec<mpsc::UnboundedSender<Input>>,
    epoch: Instant,
    base: crate::store::DbTime,
}

impl MemoryBackend {
    /// Shares `store`; `clock` gives the current time (the runtime's `now`). Database time
    /// starts at `base` and advances with the clock.
    pub fn new(
        store: crate::memory::MemoryStore,
        base: crate::store::DbTime,
        clock: impl Fn() -> Instant + Send + Sync + 'static,
    ) -> Self {
        let epoch = clock();
        let inner = MemoryInner { store, subscribers: Vec::new(), epoch, base };
        MemoryBackend { inner: Arc::new(std::sync::Mutex::new(inner)), clock: Arc::new(clock) }
    }

    /// A stream of the notifications a worker would get from LISTEN: one
    /// [`Input::Notified`] per queue made ready by an enqueue or a release.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Input> {
        let (tx, rx) = mpsc::unbounded();
        self.lock().subscribers.push(tx);
        rx
    }

    /// Runs `f` on the store at the current database time, then delivers the notifications
    /// it caused.
    pub fn with_store<T>(&self, f: impl FnOnce(&mut crate::memory::MemoryStore, crate::store::DbTime) -> T) -> T {
        let now = (self.clock)();
        let mut inner = self.lock();
        let db_now = inner.base.plus_ms((now.saturating_duration_since(inner.epoch)).as_millis() as u64);
        let result = f(&mut inner.store, db_now);
        inner.notify();
        result
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryInner> {
        // A panic while holding the lock leaves the store as consistent as the last request.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl MemoryInner {
    fn notify(&mut self) {
        for notification in self.store.take_notifications() {
            let input = match notification {
                crate::store::Notification::TaskReady { queue, priority, run_at } => {
                    Input::Notified { queue, priority, run_at }
                }
                crate::store::Notification::TasksRevoked { tasks } => Input::Revoked { tasks },
                _ => continue,
            };
            self.subscribers.retain(|tx| tx.unbounded_send(input.clone()).is_ok());
        }
    }
}

impl Store for MemoryBackend {
    fn execute(&self, request: DbRequest) -> BoxFuture<'static, Result<DbReply, DbFailure>> {
        let reply = self.with_store(|store, now| store.apply(&request, now));
        futures::future::ready(Ok(reply)).boxed()
    }
}

#[cfg(feature = "postgres")]
impl Store for crate::postgres::PgStore {
    fn execute(&self, request: DbRequest) -> BoxFuture<'static, Result<DbReply, DbFailure>> {
        let store = self.clone();
        async move { crate::postgres::PgStore::execute(&store, &request).await }.boxed()
    }
}
