//! Observing a running worker: counters anyone can read, and hooks that see lifecycle events
//! without slowing the worker down.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::channel::mpsc;

use super::Runtime;
use crate::worker::{Event, Health, Stats};

/// Live counters of one worker: the machine's own [`Stats`], published by the driver's loop
/// after every turn (when [`DriverOptions::counters`](super::DriverOptions) names them, as
/// the worker service does), and what the driver itself counts. Cheap to read at any time.
#[derive(Debug, Default)]
pub struct Counters {
    stats: Mutex<(Stats, Health)>,
    in_flight: AtomicU64,
    hook_events_dropped: AtomicU64,
    requests: Mutex<BTreeMap<&'static str, RequestStats>>,
}

/// Upper bounds (seconds) of the buckets of a request's duration.
pub const REQUEST_SECONDS_BUCKETS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Upper bounds of the buckets of how many tasks a request named (a finish's outcomes, a
/// heartbeat's leases, a start's tasks; a finish-and-claim's finishes) or, for a claim, brought
/// back: the batch sizes.
pub const REQUEST_TASKS_BUCKETS: [f64; 12] =
    [0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0];

/// What the driver measured of one kind of database request (`claim`, `finish`, `heartbeat`,
/// ...): how many went, how many failed, and histograms of their durations and batch sizes
/// (counts per bucket of [`REQUEST_SECONDS_BUCKETS`] and [`REQUEST_TASKS_BUCKETS`], each
/// counting the values up to its bound and above the previous one; a last count for the rest).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestStats {
    /// Requests answered (or given up on).
    pub count: u64,
    /// Requests that failed (an outage, a timeout, a refusal, a lock held too long).
    pub failures: u64,
    /// The sum of their durations in seconds.
    pub seconds_sum: f64,
    /// Requests per duration bucket; one more than the bounds.
    pub seconds_buckets: [u64; REQUEST_SECONDS_BUCKETS.len() + 1],
    /// The sum of the tasks they named or brought back.
    pub tasks_sum: u64,
    /// Requests per batch-size bucket; one more than the bounds.
    pub tasks_buckets: [u64; REQUEST_TASKS_BUCKETS.len() + 1],
}

impl RequestStats {
    fn record(&mut self, took: Duration, tasks: usize, ok: bool) {
        let seconds = took.as_secs_f64();
        self.count += 1;
        self.failures += u64::from(!ok);
        self.seconds_sum += seconds;
        self.seconds_buckets[bucket(&REQUEST_SECONDS_BUCKETS, seconds)] += 1;
        self.tasks_sum += tasks as u64;
        self.tasks_buckets[bucket(&REQUEST_TASKS_BUCKETS, tasks as f64)] += 1;
    }
}

/// The bucket of `value`: the first whose bound it does not pass, or the last.
fn bucket(bounds: &[f64], value: f64) -> usize {
    bounds.iter().position(|bound| value <= *bound).unwrap_or(bounds.len())
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
    /// The machine's state: shutdown, database failures in a row, listener, what it runs.
    pub health: Health,
}

impl Counters {
    /// All zero.
    pub fn new() -> Self {
        Counters::default()
    }

    /// Publishes the machine's counts, its health and how many tasks it holds (the driver's
    /// loop does, after every turn).
    pub fn publish(&self, stats: Stats, health: Health, in_flight: usize) {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner) = (stats, health);
        self.in_flight.store(in_flight as u64, Ordering::Relaxed);
    }

    /// Records a database request of `kind` that took `took`, named or brought back `tasks`,
    /// and succeeded or not (the driver does, as each is answered).
    pub fn record_request(&self, kind: &'static str, took: Duration, tasks: usize, ok: bool) {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner).entry(kind).or_default().record(took, tasks, ok);
    }

    /// The counts now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let (stats, health) = *self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        CounterSnapshot {
            stats,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            hook_events_dropped: self.hook_events_dropped.load(Ordering::Relaxed),
            health,
        }
    }

    /// What was measured of each kind of database request so far, by kind.
    pub fn requests(&self) -> BTreeMap<&'static str, RequestStats> {
        self.requests.lock().unwrap_or_else(PoisonError::into_inner).clone()
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
        let health = Health { running: 1, concurrency: 4, polling: true, ..Health::default() };
        counters.publish(Stats { claimed: 2, started: 1, completed: 1, ..Stats::default() }, health, 1);
        let s = counters.snapshot();
        assert_eq!((s.stats.claimed, s.stats.started, s.stats.completed, s.in_flight), (2, 1, 1, 1));
        assert_eq!(s.health, health);
    }

    #[test]
    fn requests_fall_in_the_buckets_of_their_duration_and_size() {
        let counters = Counters::new();
        counters.record_request("claim", Duration::from_micros(400), 0, true);
        counters.record_request("claim", Duration::from_millis(3), 120, true);
        counters.record_request("claim", Duration::from_secs(30), 0, false);
        counters.record_request("finish", Duration::from_millis(1), 1, true);
        let requests = counters.requests();
        let claim = &requests["claim"];
        assert_eq!((claim.count, claim.failures, claim.tasks_sum), (3, 1, 120));
        // 0.4 ms in the first bucket, 3 ms in the (2.5, 5] ms one, 30 s past the last bound.
        let mut seconds = [0; REQUEST_SECONDS_BUCKETS.len() + 1];
        seconds[0] = 1;
        seconds[3] = 1;
        seconds[REQUEST_SECONDS_BUCKETS.len()] = 1;
        assert_eq!(claim.seconds_buckets, seconds);
        // 0 tasks twice (the bound 0), 120 in (100, 200].
        let mut tasks = [0; REQUEST_TASKS_BUCKETS.len() + 1];
        tasks[0] = 2;
        tasks[8] = 1;
        assert_eq!(claim.tasks_buckets, tasks);
        assert!((claim.seconds_sum - 30.0034).abs() < 1e-9);
        // The millisecond sits on a bound: its own bucket.
        assert_eq!(requests["finish"].seconds_buckets[1], 1);
    }

    #[test]
    fn a_worker_is_ready_while_it_runs_hears_of_work_and_reaches_the_database() {
        let running = Health { listening: true, polling: true, concurrency: 1, ..Health::default() };
        assert!(running.ready());
        assert!(Health { listening: false, ..running }.ready(), "polling finds the work");
        assert!(!Health { listening: false, polling: false, ..running }.ready(), "deaf");
        assert!(!Health { shutting_down: true, ..running }.ready());
        assert!(!Health { db_failures_in_a_row: 1, ..running }.ready());
    }
}
