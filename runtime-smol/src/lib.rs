//! Canter on smol: the workers and clients users run, feature for feature with canter-tokio.
//!
//! Everything that decides lives in the core crate [`canter`]; what is the same on every
//! runtime (the driver loop, the PostgreSQL store, the worker service, the client) lives in
//! its `driver` and `postgres` features. This crate adds what is smol's: async-io timers,
//! smol's executor, the `blocking` pool, signals through async-signal, and sqlx's
//! `runtime-smol`. It also runs from async-std's executor (`async_std::task::block_on`),
//! which shares async-io with smol.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use canter_smol::{AppConfig, Client, Registry, SmolRuntime, TaskError, Worker, WorkerConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> { smol::block_on(async {
//! let mut registry = Registry::new();
//! let double = registry.register("double", |n: i64, _ctx| async move { Ok::<_, TaskError>(n * 2) })?;
//! let pool = canter_smol::connect("postgres://postgres@127.0.0.1/test", 10)?;
//! let worker = Worker::new(pool.clone(), AppConfig::default(), WorkerConfig::default(), Arc::new(registry))?;
//! smol::spawn(worker.run()).detach(); // until SIGINT or SIGTERM
//! let client = Client::new(Arc::new(SmolRuntime), pool, Default::default(), AppConfig::default());
//! assert_eq!(client.enqueue(&double, &21).await?.wait(Duration::from_secs(10)).await?, 42);
//! # Ok(()) }) }
//! ```

use std::time::Instant;

use futures::StreamExt;
use futures::future::BoxFuture;

#[cfg(all(feature = "isolation", unix))]
pub mod isolation;

pub use canter;
pub use canter::check::ConfigError;
pub use canter::config::{AppConfig, Config, CustomQueue, DeploymentMode, QueueMode, RetryPolicy, WorkerConfig};
pub use canter::driver::{
    ClientError, CounterSnapshot, Counters, Registry, RegistryError, ResultError, Runtime, SchedulerOptions,
    SchedulerRunError, SchedulerStats, ServeError, Step, TaskContext, TaskHandle, Workflow, connect, new_worker_id,
};
pub use canter::postgres::PgSchema;
pub use canter::schedule::ScheduleConfig;
pub use canter::scheduler::SchedulerError;
pub use canter::store::{NewTask, RunAt, WorkflowId, WorkflowRecord};
pub use canter::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};
pub use canter::worker::{Event, Stats};
pub use canter::workflow::{Join, WorkflowStatus};

/// Timers (async-io), spawning (smol's global executor) and blocking work (the `blocking`
/// pool).
#[derive(Debug, Clone, Copy, Default)]
pub struct SmolRuntime;

impl Runtime for SmolRuntime {
    #[allow(clippy::disallowed_methods)] // the adapter is where the clock is read
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            async_io::Timer::at(deadline).await;
        })
    }

    fn spawn(&self, future: BoxFuture<'static, ()>) {
        smol::spawn(future).detach();
    }

    fn spawn_blocking(&self, work: Box<dyn FnOnce() + Send + 'static>) -> BoxFuture<'static, ()> {
        Box::pin(blocking::unblock(work))
    }

    fn shutdown_signal(&self) -> BoxFuture<'static, ()> {
        Box::pin(shutdown_signal())
    }
}

/// Resolves on SIGINT or SIGTERM (never if signals cannot be watched).
pub async fn shutdown_signal() {
    use async_signal::{Signal, Signals};
    match Signals::new([Signal::Int, Signal::Term]) {
        Ok(mut signals) => {
            signals.next().await;
        }
        Err(_) => std::future::pending::<()>().await,
    }
}

/// The client on smol: enqueue, wait for results, cancel, inspect.
pub type Client = canter::driver::Client<SmolRuntime>;

/// A task's future result on smol.
pub type ResultHandle<T> = canter::driver::ResultHandle<SmolRuntime, T>;

/// A submitted workflow on smol: its steps' results, its status, a wait for its end.
pub type WorkflowHandle = canter::driver::WorkflowHandle<SmolRuntime>;

/// A scheduler on smol, on its own: enqueues the ticks of the app's schedules until told to
/// stop (`run()` stops at SIGINT or SIGTERM). Workers run one too with
/// `WorkerConfig::run_scheduler`; any number may run at once, each tick is enqueued once.
pub type Scheduler = canter::driver::PgScheduler<SmolRuntime>;

/// A worker on smol: claims and runs tasks of its queues until told to stop.
pub type Worker = canter::driver::PgWorker<SmolRuntime>;
