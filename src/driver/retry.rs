//! Tries again after a database failure: the core's pure [`DbBackoff`] with a seeded random
//! source and the app's resilience settings, and the sleep between tries. Every loop of the
//! driver that reaches the database (startup, the listener, the liveness token, the scheduler,
//! the client's result listener) backs off through one of these.

use std::time::Duration;

use super::{Runtime, sleep_after};
use crate::backoff::DbBackoff;
use crate::config::ResilienceConfig;
use crate::rng::Rng;

/// The backoff state of one loop.
pub(crate) struct Retry {
    backoff: DbBackoff,
    rng: Rng,
    resilience: ResilienceConfig,
}

impl Retry {
    /// A loop with no failure yet, backing off as `resilience` says, its jitter drawn from `seed`.
    pub(crate) fn new(resilience: &ResilienceConfig, seed: u64) -> Retry {
        Retry { backoff: DbBackoff::new(), rng: Rng::new(seed), resilience: resilience.clone() }
    }

    /// A try failed: how long to wait before the next.
    pub(crate) fn failed(&mut self) -> Duration {
        self.backoff.on_failure(&self.resilience, &mut self.rng)
    }

    /// A try failed: waits as long as [`failed`](Self::failed) says.
    pub(crate) async fn pause<R: Runtime + ?Sized>(&mut self, runtime: &R) {
        let delay = self.failed();
        sleep_after(runtime, runtime.now(), delay).await;
    }

    /// A try succeeded: the next failure waits the shortest time again.
    pub(crate) fn succeeded(&mut self) {
        self.backoff.on_success();
    }

    /// Failures in a row.
    pub(crate) fn failures(&self) -> u32 {
        self.backoff.failures()
    }

    /// Whether `resilience.db_retry_max_attempts` failures came in a row (never, when it is 0).
    pub(crate) fn exhausted(&self) -> bool {
        self.backoff.exhausted(&self.resilience)
    }
}
