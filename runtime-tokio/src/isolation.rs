//! Isolated execution on tokio (feature `isolation`): the child entry a program with isolated
//! tasks calls first thing in `main`, and the pool's types. See
//! [`canter::driver::isolation`] for what isolation buys and costs.
//!
//! ```no_run
//! use std::sync::Arc;
//! use canter_tokio::{Registry, TaskError};
//!
//! fn main() {
//!     let mut registry = Registry::new();
//!     registry.register_blocking("render", |page: u32, _ctx| -> Result<u32, TaskError> { Ok(page) }).unwrap();
//!     let registry = Arc::new(registry);
//!     // A child of the worker's pool serves here and exits; the worker goes on below.
//!     canter_tokio::isolation::serve_child_if_asked(&registry);
//!     // ... build the worker with `.isolate(...)` and run it.
//! }
//! ```

use std::sync::Arc;

use canter::driver::Registry;
pub use canter::driver::isolation::{
    IsolatedHandlers, IsolatedTasks, Isolation, IsolationOptions, PoolStats, ProcessPool, child_socket,
};
use canter::driver::isolation::{exit_child, serve_child};

use crate::TokioRuntime;

/// If this process was started as a child of a worker's pool, serves its tasks with
/// `registry` and exits (status 0 when the worker closed it, 1 on a failure, said on stderr);
/// otherwise returns at once. Call it first thing in `main`, with the registry the worker uses.
pub fn serve_child_if_asked(registry: &Arc<Registry>) {
    let Some(socket) = child_socket() else { return };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("canter child: cannot start a runtime: {error}");
            std::process::exit(1);
        }
    };
    let handlers = registry.clone().bind(Arc::new(TokioRuntime));
    let served = runtime.block_on(serve_child(socket, handlers));
    drop(runtime);
    exit_child(served)
}
