//! Observing a running worker: counters anyone can read, and hooks that see lifecycle events
//! without slowing the worker down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use futures::channel::mpsc;

use super::Runtime;
use crate::worker::{Event, Stats};

/// Live counters of one worker: the machine's own [`Stats`], published by the driver's loop
/// after every turn (when [`DriverOptions::counters`](super::DriverOptions) names them, as
/// the worker service does), and what the driver itself counts. Cheap to read at any time.
#[derive(Debug, Default)]
pub struct Counters {
    stats: Mutex<Stats>,
    in_flight: AtomicU64,
    hook_events_dropped: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Everything the worker machine counts: tasks claimed, started, completed, failed,
    /// retried, expired, timed out and lost, claim passes, and more. Its `db_failures` counts
    /// every request that failed (a lock timeout and a refusal too), not outages.
    pub stats: Stats,
    /// Tasks the worker holds now: claimed, running, or finished and not yet written back or
    /// released.
    pub in_flight: u64,
    /// Events dropped because a hook fell behind.
    pub hook_events_dropped: u64,
}

impl Counters {
    /// All zero.
    pub fn new() -> Self {
        Counters::default()
    }

    /// Publishes the machine's counts and how many tasks it holds (the driver's loop does,
    /// after every turn).
    pub fn publish(&self, stats: Stats, in_flight: usize) {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner) = stats;
        self.in_flight.store(in_flight as u64, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            stats: *self.stats.lock().unwrap_or_else(PoisonError::into_inner),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            hook_events_dropped: self.hook_events_dropped.load(Ordering::Relaxed),
        }
    }
}

/// A function that sees a worker's events.
pub type Hook = Arc<dyn Fn(&Event) + Send + Sync>;

/// How many events may wait for a slow hook before new ones are dropped.
pub const HOOK_BUFFER: usize = 1024;

/// Hands events to hooks on a task of their own: the worker never waits for a hook, and
/// events a hook has no room for are dropped and counted. Events about results come after the
/// result is written (the machine emits them on the database's confirmation).
pub struct HookSink {
    sender: Option<mpsc::Sender<Event>>,
    counters: Arc<Counters>,
}

impl HookSink {
    /// Starts the hook task on `runtime` (nothing when `hooks` is empty).
    pub fn start<R: Runtime>(runtime: &R, hooks: Vec<Hook>, counters: Arc<Counters>) -> HookSink {
        if hooks.is_empty() {
            return HookSink { sender: None, counters };
        }
        let (sender, mut receiver) = mpsc::channel::<Event>(HOOK_BUFFER);
        runtime.spawn(Box::pin(async move {
            while let Some(event) = receiver.next().await {
                for hook in &hooks {
                    // A panicking hook must not take the others down with it.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&event)));
                }
            }
        }));
        HookSink { sender: Some(sender), counters }
    }

    /// Offers `event` to the hooks (counted in [`Counters`] when a hook has no room for it).
    pub fn observe(&mut self, event: &Event) {
        if let Some(sender) = &mut self.sender {
            if sender.try_send(event.clone()).is_err() {
                self.counters.hook_events_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_follow_the_machine() {
        let counters = Counters::new();
        // Two tasks claimed, one started and completed: the machine's counts, one task held.
        counters.publish(Stats { claimed: 2, started: 1, completed: 1, ..Stats::default() }, 1);
        let s = counters.snapshot();
        assert_eq!((s.stats.claimed, s.stats.started, s.stats.completed, s.in_flight), (2, 1, 1, 1));
    }
}
