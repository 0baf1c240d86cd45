//! Flow control of claims: how many tasks a worker holds beyond its free slots (its buffer),
//! and in which order buffered tasks start.
//!
//! A buffer hides the claim's round trip: while a claim is out, handlers that finish start
//! tasks from the buffer instead of waiting. It needs to hold what the worker processes in a
//! few round trips, no more: a larger one takes tasks other workers could run and makes a task
//! claimed later (an urgent one) wait behind it. So its size follows the worker's measured
//! completion rate times a window of a few claim round trips ([`ClaimFlow::buffer`]), up to a
//! maximum (`prefetch_buffer` in soft-cap mode; [`HARD_CAP_CLAIM_AHEAD_MAX`] in hard-cap mode,
//! where buffered claims count against every cap like any live claim). And buffered tasks
//! start most urgent first ([`Buffer`]): a task of a higher-priority queue, or of a lower
//! priority number, claimed after others overtakes them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The most tasks a claim for an announced urgent task takes (see `Buffer::would_overtake`):
/// it goes beside a claim already in flight, and takes the most urgent tasks first.
pub const URGENT_CLAIM_MAX: u32 = 8;

/// The most tasks a worker in hard-cap mode claims beyond its free slots (they count against
/// every cap, as live claims do, and start as slots free).
pub const HARD_CAP_CLAIM_AHEAD_MAX: u32 = 1_024;

/// The shortest stretch of work a buffer covers.
pub const BUFFER_WINDOW_MIN: Duration = Duration::from_millis(10);

/// How many claim round trips of work a buffer covers (when that is longer than
/// [`BUFFER_WINDOW_MIN`]).
const BUFFER_ROUND_TRIPS: u32 = 4;

/// Completions are counted over stretches of at least this long to measure the rate.
const RATE_SAMPLE: Duration = Duration::from_millis(5);

/// A rate sample older than this says the worker was idle: the rate starts over.
const RATE_STALE: Duration = Duration::from_secs(1);

/// The measurements that size the buffer: the completion rate and the claim round trip.
#[derive(Debug, Clone)]
pub(crate) struct ClaimFlow {
    /// Handlers finished, in all.
    finished: u64,
    /// The start of the current rate sample: when, and `finished` then.
    sample: (Instant, u64),
    /// Completions per second, smoothed.
    rate: f64,
    /// The claim round trip, smoothed; `None` before the first.
    round_trip: Option<Duration>,
}

impl ClaimFlow {
    pub(crate) fn new(now: Instant) -> ClaimFlow {
        ClaimFlow { finished: 0, sample: (now, 0), rate: 0.0, round_trip: None }
    }

    /// A handler finished at `now`.
    pub(crate) fn on_finished(&mut self, now: Instant) {
        self.finished += 1;
        let (since, at_start) = self.sample;
        let elapsed = now.saturating_duration_since(since);
        if elapsed >= RATE_STALE {
            // Idle for a while: what came before says nothing about now.
            self.rate = 0.0;
            self.sample = (now, self.finished - 1);
        } else if elapsed >= RATE_SAMPLE {
            let measured = (self.finished - at_start) as f64 / elapsed.as_secs_f64();
            self.rate = if self.rate == 0.0 { measured } else { (self.rate + measured) / 2.0 };
            self.sample = (now, self.finished);
        }
    }

    /// A claim sent at `sent` was answered at `now`.
    pub(crate) fn on_claim_answered(&mut self, sent: Instant, now: Instant) {
        let took = now.saturating_duration_since(sent);
        self.round_trip = Some(match self.round_trip {
            Some(smoothed) => (smoothed * 7 + took) / 8,
            None => took,
        });
    }

    /// The buffer to hold at `now`: the work of a few claim round trips at the rate measured
    /// (at least [`BUFFER_WINDOW_MIN`] of it), between `floor` and `max`.
    pub(crate) fn buffer(&self, now: Instant, floor: u32, max: u32) -> u32 {
        let idle = now.saturating_duration_since(self.sample.0) >= RATE_STALE;
        let rate = if idle { 0.0 } else { self.rate };
        let window = self.round_trip.map_or(BUFFER_WINDOW_MIN, |rtt| (rtt * BUFFER_ROUND_TRIPS).max(BUFFER_WINDOW_MIN));
        let wanted = (rate * window.as_secs_f64()).ceil();
        let wanted = if wanted >= f64::from(u32::MAX) { u32::MAX } else { wanted as u32 };
        wanted.clamp(floor.min(max), max)
    }
}

/// Buffered claims, most urgent first: by queue priority, then task priority, then the order
/// they came in (claim order, which within one claim is the queue's order). A task put back
/// (a start that did not happen) goes before the others of its rank.
#[derive(Debug, Default)]
pub(crate) struct Buffer {
    order: BTreeSet<(u8, i16, i64, TaskKey)>,
    keys: BTreeMap<TaskKey, (u8, i16, i64)>,
    next: i64,
    front: i64,
}

type TaskKey = crate::task::TaskId;

impl Buffer {
    /// Adds `task` after those of its rank.
    pub(crate) fn push(&mut self, task: TaskKey, queue_priority: u8, priority: i16) {
        self.next += 1;
        self.insert(task, (queue_priority, priority, self.next));
    }

    /// Puts `task` back before those of its rank.
    pub(crate) fn push_front(&mut self, task: TaskKey, queue_priority: u8, priority: i16) {
        self.front -= 1;
        self.insert(task, (queue_priority, priority, self.front));
    }

    fn insert(&mut self, task: TaskKey, key: (u8, i16, i64)) {
        self.remove(task);
        self.order.insert((key.0, key.1, key.2, task));
        self.keys.insert(task, key);
    }

    /// Takes the most urgent task out.
    pub(crate) fn pop(&mut self) -> Option<TaskKey> {
        let (_, _, _, task) = self.order.pop_first()?;
        self.keys.remove(&task);
        Some(task)
    }

    /// Takes `task` out, wherever it is.
    pub(crate) fn remove(&mut self, task: TaskKey) {
        if let Some((q, p, seq)) = self.keys.remove(&task) {
            self.order.remove(&(q, p, seq, task));
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether a task of queue priority `queue_priority` and priority `priority` would start
    /// before some buffered task: it is more urgent than the least urgent one.
    pub(crate) fn would_overtake(&self, queue_priority: u8, priority: i16) -> bool {
        self.order.last().is_some_and(|&(q, p, _, _)| (queue_priority, priority) < (q, p))
    }

    /// The buffered tasks, most urgent first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = TaskKey> + '_ {
        self.order.iter().map(|&(_, _, _, task)| task)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::TaskId;

    #[test]
    fn urgent_tasks_overtake_and_put_back_ones_go_first_in_their_rank() {
        let mut buffer = Buffer::default();
        buffer.push(TaskId(1), 2, 0);
        buffer.push(TaskId(2), 2, 0);
        buffer.push(TaskId(3), 2, -1); // a more urgent task of the same queue
        buffer.push(TaskId(4), 1, 5); // a task of a higher-priority queue
        buffer.push_front(TaskId(5), 2, 0); // put back
        assert_eq!(buffer.iter().count(), 5);
        assert!(buffer.would_overtake(2, -1) && buffer.would_overtake(1, 9) && !buffer.would_overtake(2, 0));
        buffer.remove(TaskId(2));
        let order: Vec<TaskId> = std::iter::from_fn(|| buffer.pop()).collect();
        assert_eq!(order, vec![TaskId(4), TaskId(3), TaskId(5), TaskId(1)]);
        assert!(buffer.is_empty());
    }

    #[test]
    fn the_buffer_follows_the_rate_over_a_few_round_trips() {
        // Any instant will do: only differences count.
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        let mut flow = ClaimFlow::new(start);
        assert_eq!(flow.buffer(start, 1, 2_048), 1, "nothing measured: the floor");
        // 10,000 completions a second for 50 ms.
        for i in 1..=500 {
            flow.on_finished(start + Duration::from_micros(100 * i));
        }
        let now = start + Duration::from_millis(50);
        // No round trip measured: the 10 ms window, about 100 tasks.
        let buffer = flow.buffer(now, 1, 2_048);
        assert!((90..=110).contains(&buffer), "{buffer}");
        // Round trips of 5 ms: four of them, about 200 tasks.
        flow.on_claim_answered(now, now + Duration::from_millis(5));
        let buffer = flow.buffer(now, 1, 2_048);
        assert!((180..=220).contains(&buffer), "{buffer}");
        assert_eq!(flow.buffer(now, 1, 64), 64, "the maximum");
        // Idle for a while: back to the floor.
        assert_eq!(flow.buffer(now + Duration::from_secs(2), 1, 2_048), 1);
    }
}
