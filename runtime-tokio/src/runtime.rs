//! The core's [`Runtime`] on tokio.

use std::time::Instant;

use canter::driver::Runtime;
use futures::future::BoxFuture;

/// Timers, spawning and blocking work on the current tokio runtime.
///
/// `now()` reads tokio's clock, so tests with `start_paused = true` drive workers in virtual
/// time.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioRuntime;

impl Runtime for TokioRuntime {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep_until(deadline.into()))
    }

    fn spawn(&self, future: BoxFuture<'static, ()>) {
        tokio::spawn(future);
    }

    fn spawn_blocking(&self, work: Box<dyn FnOnce() + Send + 'static>) -> BoxFuture<'static, ()> {
        let handle = tokio::task::spawn_blocking(work);
        Box::pin(async move {
            // A panic is caught inside `work`; a cancelled blocking task has nothing to report.
            let _ = handle.await;
        })
    }

    fn shutdown_signal(&self) -> BoxFuture<'static, ()> {
        Box::pin(crate::shutdown_signal())
    }
}
