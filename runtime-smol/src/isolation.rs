//! Isolated execution on smol (feature `isolation`): the child entry a program with isolated
//! tasks calls first thing in `main`, and the pool's types. See
//! [`canter::driver::isolation`] for what isolation buys and costs.

use std::sync::Arc;

use canter::driver::Registry;
pub use canter::driver::isolation::{
    IsolatedHandlers, IsolatedTasks, Isolation, IsolationOptions, PoolStats, ProcessPool, child_socket,
};
use canter::driver::isolation::{exit_child, serve_child};

use crate::SmolRuntime;

/// If this process was started as a child of a worker's pool, serves its tasks with
/// `registry` and exits (status 0 when the worker closed it, 1 on a failure, said on stderr);
/// otherwise returns at once. Call it first thing in `main`, with the registry the worker uses.
pub fn serve_child_if_asked(registry: &Arc<Registry>) {
    let Some(socket) = child_socket() else { return };
    let handlers = registry.clone().bind(Arc::new(SmolRuntime));
    exit_child(smol::block_on(serve_child(socket, handlers)))
}
