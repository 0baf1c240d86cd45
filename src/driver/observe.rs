//! Observing a running worker: counters anyone can read, and hooks that see lifecycle events
//! without slowing the worker down.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use futures::channel::mpsc;

use super::Runtime;
use crate::task::TaskState;
use crate::worker::Event;

/// Live counters of one worker, updated from its events. Cheap to read at any time.
#[derive(Debug, Default)]
pub struct Counters {
    claimed: AtomicU64,
    started: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
    expired: AtomicU64,
    timed_out: AtomicU64,
    lost: AtomicU64,
    settled: AtomicU64,
    db_failures: AtomicU64,
    hook_events_dropped: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Tasks claimed.
    pub claimed: u64,
    /// Handlers started.
    pub started: u64,
    /// Tasks completed (written).
    pub completed: u64,
    /// Tasks failed for good (written).
    pub failed: u64,
    /// Runs failed and scheduled again (written).
    pub retried: u64,
    /// Tasks that expired before they could start.
    pub expired: u64,
    /// Handlers that ran past their timeout.
    pub timed_out: u64,
    /// Tasks taken away by another lease holder or the reaper.
    pub lost: u64,
    /// Claimed tasks not yet written back or lost: held by this worker now.
    pub in_flight: u64,
    /// Database failures seen.
    pub db_failures: u64,
    /// Events dropped because a hook fell behind.
    pub hook_events_dropped: u64,
}

impl Counters {
    /// All zero.
    pub fn new() -> Self {
        Counters::default()
    }

    /// Counts one event.
    pub fn record(&self, event: &Event) {
        let add = |counter: &AtomicU64| {
            counter.fetch_add(1, Ordering::Relaxed);
        };
        match event {
            Event::Claimed { .. } => add(&self.claimed),
            Event::Started { .. } => add(&self.started),
            Event::Finished { state, .. } => {
                add(match state {
                    TaskState::Completed => &self.completed,
                    TaskState::Pending => &self.retried,
                    _ => &self.failed,
                });
                add(&self.settled);
            }
            Event::Expired { .. } => {
                add(&self.expired);
                add(&self.settled);
            }
            Event::Lost { .. } => {
                add(&self.lost);
                add(&self.settled);
            }
            Event::TimedOut { .. } => add(&self.timed_out),
            Event::DbUnavailable { .. } => add(&self.db_failures),
            _ => {}
        }
    }

    /// The counts now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CounterSnapshot {
            claimed: get(&self.claimed),
            started: get(&self.started),
            completed: get(&self.completed),
            failed: get(&self.failed),
            retried: get(&self.retried),
            expired: get(&self.expired),
            timed_out: get(&self.timed_out),
            lost: get(&self.lost),
            // Released tasks (shutdown) are neither settled nor held: never below zero.
            in_flight: get(&self.claimed).saturating_sub(get(&self.settled)),
            db_failures: get(&self.db_failures),
            hook_events_dropped: get(&self.hook_events_dropped),
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

    /// Counts `event` and offers it to the hooks.
    pub fn observe(&mut self, event: &Event) {
        self.counters.record(event);
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
    use crate::task::TaskId;

    #[test]
    fn counters_follow_events() {
        let counters = Counters::new();
        for event in [
            Event::Claimed { task: TaskId(1), queue: "q".into() },
            Event::Claimed { task: TaskId(2), queue: "q".into() },
            Event::Started { task: TaskId(1), attempt: crate::task::Attempt(1) },
            Event::Finished { task: TaskId(1), state: TaskState::Completed },
        ] {
            counters.record(&event);
        }
        let s = counters.snapshot();
        assert_eq!((s.claimed, s.started, s.completed, s.in_flight), (2, 1, 1, 1));
    }
}
