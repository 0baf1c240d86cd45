//! Canter on tokio: the workers and clients users run.
//!
//! Everything that decides lives in the core crate [`canter`]; everything that is the same on
//! every runtime (the driver loop, the PostgreSQL store, the worker service, the client) lives
//! in its `driver` and `postgres` features. This crate adds what is tokio's: the [`Runtime`]
//! (timers, spawning, blocking work), signals, and sqlx's `runtime-tokio`.
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

pub mod builtins;
#[doc(hidden)]
pub mod cli;
pub mod demo;
mod runtime;

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use canter;
pub use canter::config::{
    AppConfig, Config, ConfigError, CustomQueue, DeploymentMode, QueueMode, RetryPolicy, WorkerConfig,
};
pub use canter::db::{NewTask, RunAt};
pub use canter::driver::{
    ClientError, CounterSnapshot, Counters, Registry, RegistryError, ResultError, ServeError, TaskContext, TaskHandle,
};
pub use canter::postgres::PgSchema;
pub use canter::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};
pub use canter::worker::{Event, Stats};
pub use runtime::TokioRuntime;

use canter::driver::WorkerService;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

/// The client on tokio: enqueue, wait for results, cancel, inspect.
pub type Client = canter::driver::Client<TokioRuntime>;

/// A task's future result on tokio.
pub type ResultHandle<T> = canter::driver::ResultHandle<TokioRuntime, T>;

/// A lazily connecting pool of at most `max_connections` for `url`: nothing is dialled until
/// first use, so a worker can start while the database is down and wait it out.
pub fn connect(url: &str, max_connections: u32) -> Result<PgPool, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    Ok(PgPoolOptions::new()
        .max_connections(max_connections.max(2))
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options))
}

/// A worker id unique across the cluster: host, process and a random part.
pub fn new_worker_id() -> WorkerId {
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).unwrap_or_else(|| "worker".to_owned());
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    WorkerId(format!("{host}-{}-{:08x}", std::process::id(), random as u32))
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
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

/// A worker: claims and runs tasks of its queues until told to stop.
pub struct Worker {
    service: WorkerService,
    pool: PgPool,
}

impl Worker {
    /// A worker on `pool` with these configurations and handlers (validated here).
    pub fn new(
        pool: PgPool,
        app: AppConfig,
        config: WorkerConfig,
        registry: Arc<Registry>,
    ) -> Result<Self, ConfigError> {
        let service = WorkerService::new(app, config, registry, new_worker_id())?;
        Ok(Worker { service, pool })
    }

    /// A worker configured by a TOML or JSON file with `[app]` and `[worker]` tables.
    pub fn from_config_file(
        pool: PgPool,
        path: &Path,
        registry: Arc<Registry>,
    ) -> Result<Self, canter::config::LoadError> {
        let config = Config::from_path(path)?;
        Ok(Worker::new(pool, config.app, config.worker, registry)?)
    }

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

    /// Whether to apply migrations at startup (default) or only check the database is there.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.service.migrate = migrate;
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

    /// Runs until SIGINT or SIGTERM, then shuts down gracefully.
    pub async fn run(self) -> Result<Stats, ServeError> {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `shutdown` resolves, then shuts down gracefully: buffered claims go back at
    /// once, running handlers get the grace period, the rest return to Pending.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<Stats, ServeError> {
        self.service.serve(Arc::new(TokioRuntime), self.pool, shutdown).await
    }
}
