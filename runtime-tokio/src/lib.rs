//! Canter on tokio: the workers and clients users run.
//!
//! Everything that decides lives in the core crate [`canter`]; everything that is the same on
//! every runtime (the driver loop, the PostgreSQL store, the worker service, the client) lives
//! in its `driver` and `postgres` features. This crate adds what is tokio's: the [`Runtime`]
//! (timers, spawning, blocking work), signals, and sqlx's `runtime-tokio`.
//!
//! Its default feature `cli` builds the `canter` program (command line, demo, bench); a library
//! user may turn it off (`default-features = false, features = ["tls"]`) and build none of the
//! program's dependencies. Feature `http` (part of `cli`) adds [`http`]: a worker's `/metrics`,
//! `/healthz` and `/readyz`; feature `dashboard` (part of `cli`) adds [`dashboard`]: the web
//! dashboard `canter dashboard` serves; feature `isolation` (part of `cli`) adds `isolation`:
//! tasks in child processes; features `rabbitmq` and `nats` (part of `cli`) add their wake-up
//! providers (`canter::driver::wakeups`).
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use canter_tokio::{AppConfig, Client, Registry, TaskError, Worker, WorkerConfig};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Add { a: i64, b: i64 }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let mut registry = Registry::new();
//! let add = registry.register("add", |args: Add, _ctx| async move { Ok::<_, TaskError>(args.a + args.b) })?;
//! let registry = Arc::new(registry);
//!
//! let pool = canter_tokio::connect("postgres://postgres@127.0.0.1/test", 10)?;
//! let app = AppConfig::default();
//! let worker = Worker::new(pool.clone(), app.clone(), WorkerConfig::default(), registry)?;
//! tokio::spawn(worker.run()); // until SIGINT or SIGTERM
//!
//! let client = Client::new(Arc::new(canter_tokio::TokioRuntime), pool, Default::default(), app);
//! let sum = client.enqueue(&add, &Add { a: 2, b: 3 }).await?.wait(Duration::from_secs(10)).await?;
//! assert_eq!(sum, 5);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

#[cfg(feature = "dashboard")]
pub mod dashboard;
#[cfg(feature = "http")]
pub mod http;
#[cfg(all(feature = "isolation", unix))]
pub mod isolation;
mod runtime;

pub use canter;
pub use canter::check::ConfigError;
pub use canter::config::{AppConfig, Config, CustomQueue, DeploymentMode, QueueMode, RetryPolicy, WorkerConfig};
pub use canter::driver::{
    ClientError, CounterSnapshot, Counters, Registry, RegistryError, ResultError, SchedulerOptions, SchedulerRunError,
    SchedulerStats, ServeError, Step, TaskContext, TaskHandle, Workflow, connect, new_worker_id,
};
pub use canter::postgres::PgSchema;
pub use canter::schedule::ScheduleConfig;
pub use canter::scheduler::SchedulerError;
pub use canter::store::{NewTask, RunAt, WorkflowId, WorkflowRecord};
pub use canter::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};
pub use canter::worker::{Event, Stats};
pub use canter::workflow::{Join, WorkflowStatus};
pub use runtime::TokioRuntime;

/// The client on tokio: enqueue, wait for results, cancel, inspect.
pub type Client = canter::driver::Client<TokioRuntime>;

/// A task's future result on tokio.
pub type ResultHandle<T> = canter::driver::ResultHandle<TokioRuntime, T>;

/// A submitted workflow on tokio: its steps' results, its status, a wait for its end.
pub type WorkflowHandle = canter::driver::WorkflowHandle<TokioRuntime>;

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        // A handler that cannot be installed must not read as a signal.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// A scheduler on tokio, on its own: enqueues the ticks of the app's schedules until told to
/// stop (`run()` stops at SIGINT or SIGTERM). Workers run one too with
/// `WorkerConfig::run_scheduler`; any number may run at once, each tick is enqueued once.
pub type Scheduler = canter::driver::PgScheduler<TokioRuntime>;

/// A worker on tokio: claims and runs tasks of its queues until told to stop.
pub type Worker = canter::driver::PgWorker<TokioRuntime>;
