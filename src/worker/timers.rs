//! The worker's deadlines: one slot per named [`Timer`] and, for handler timeouts (one per
//! running task that has one), an index ordered by deadline. The next deadline is the earlier
//! of the two heads, so neither a poll of it nor a turn of due timers scans the running tasks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::Timer;
use crate::task::TaskId;

/// How many named timers there are: every [`Timer`] but [`Timer::HandlerTimeout`].
const NAMED: usize = 13;

/// The named timers, in [`Timer`]'s order (which due timers are handled in).
const NAMED_TIMERS: [Timer; NAMED] = [
    Timer::Poll,
    Timer::Wake,
    Timer::Heartbeat,
    Timer::Reaper,
    Timer::LivenessCheck,
    Timer::Purge,
    Timer::Vacuum,
    Timer::DbRetry,
    Timer::ShutdownGrace,
    Timer::RecordStarts,
    Timer::NotifiedPass,
    Timer::LockRetry,
    Timer::FloorSweep,
];

/// The slot of a named timer; `None` for a handler's.
fn slot(timer: Timer) -> Option<usize> {
    Some(match timer {
        Timer::Poll => 0,
        Timer::Wake => 1,
        Timer::Heartbeat => 2,
        Timer::Reaper => 3,
        Timer::LivenessCheck => 4,
        Timer::Purge => 5,
        Timer::Vacuum => 6,
        Timer::DbRetry => 7,
        Timer::ShutdownGrace => 8,
        Timer::RecordStarts => 9,
        Timer::NotifiedPass => 10,
        Timer::LockRetry => 11,
        Timer::FloorSweep => 12,
        Timer::HandlerTimeout(_) => return None,
    })
}

/// Every armed deadline of a worker.
#[derive(Debug, Default)]
pub(super) struct Timers {
    named: [Option<Instant>; NAMED],
    /// Handler timeouts by deadline, then task.
    handlers: BTreeSet<(Instant, TaskId)>,
    /// The deadline of each task's handler timeout.
    handler_at: BTreeMap<TaskId, Instant>,
}

impl Timers {
    /// Arms `timer` for `at`, replacing its earlier deadline.
    pub(super) fn arm(&mut self, timer: Timer, at: Instant) {
        match (slot(timer), timer) {
            (Some(i), _) => self.named[i] = Some(at),
            (None, Timer::HandlerTimeout(task)) => {
                if let Some(old) = self.handler_at.insert(task, at) {
                    self.handlers.remove(&(old, task));
                }
                self.handlers.insert((at, task));
            }
            (None, _) => unreachable!("every timer but a handler's has a slot"),
        }
    }

    /// Disarms `timer`, if it is armed.
    pub(super) fn remove(&mut self, timer: Timer) {
        match (slot(timer), timer) {
            (Some(i), _) => self.named[i] = None,
            (None, Timer::HandlerTimeout(task)) => {
                if let Some(at) = self.handler_at.remove(&task) {
                    self.handlers.remove(&(at, task));
                }
            }
            (None, _) => unreachable!("every timer but a handler's has a slot"),
        }
    }

    /// When `timer` is due, if it is armed.
    pub(super) fn get(&self, timer: Timer) -> Option<Instant> {
        match (slot(timer), timer) {
            (Some(i), _) => self.named[i],
            (None, Timer::HandlerTimeout(task)) => self.handler_at.get(&task).copied(),
            (None, _) => None,
        }
    }

    /// Whether `timer` is armed.
    pub(super) fn contains(&self, timer: Timer) -> bool {
        self.get(timer).is_some()
    }

    /// The next deadline and its timer (the least timer among those due at that instant).
    pub(super) fn next(&self) -> Option<(Instant, Timer)> {
        let named = self.named.iter().zip(NAMED_TIMERS).filter_map(|(at, timer)| at.map(|at| (at, timer))).min();
        let handler = self.handlers.first().map(|&(at, task)| (at, Timer::HandlerTimeout(task)));
        named.into_iter().chain(handler).min()
    }

    /// Disarms and returns every timer due at `now`, in [`Timer`]'s order.
    pub(super) fn take_due(&mut self, now: Instant) -> Vec<Timer> {
        let mut due: Vec<Timer> = Vec::new();
        for (i, timer) in NAMED_TIMERS.into_iter().enumerate() {
            if self.named[i].is_some_and(|at| at <= now) {
                self.named[i] = None;
                due.push(timer);
            }
        }
        while let Some(&(at, task)) = self.handlers.first() {
            if at > now {
                break;
            }
            self.handlers.pop_first();
            self.handler_at.remove(&task);
            due.push(Timer::HandlerTimeout(task));
        }
        due.sort();
        due
    }

    /// Disarms everything.
    pub(super) fn clear(&mut self) {
        *self = Timers::default();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_next_deadline_is_the_earlier_head_and_due_timers_come_in_timer_order() {
        // Any instant will do: only differences count.
        #[allow(clippy::disallowed_methods)]
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut timers = Timers::default();
        assert_eq!(timers.next(), None);
        timers.arm(Timer::Heartbeat, at(30));
        timers.arm(Timer::HandlerTimeout(TaskId(7)), at(20));
        timers.arm(Timer::HandlerTimeout(TaskId(3)), at(20));
        timers.arm(Timer::Poll, at(40));
        assert_eq!(timers.next(), Some((at(20), Timer::HandlerTimeout(TaskId(3)))));
        // Re-arming moves a handler's deadline; removing forgets it.
        timers.arm(Timer::HandlerTimeout(TaskId(3)), at(50));
        timers.remove(Timer::HandlerTimeout(TaskId(7)));
        assert_eq!(timers.next(), Some((at(30), Timer::Heartbeat)));
        assert_eq!(timers.get(Timer::HandlerTimeout(TaskId(3))), Some(at(50)));
        assert!(!timers.contains(Timer::HandlerTimeout(TaskId(7))));
        // Everything due, in the order of `Timer`: named ones first, handlers by task.
        timers.arm(Timer::LockRetry, at(10));
        timers.arm(Timer::HandlerTimeout(TaskId(1)), at(45));
        let due = timers.take_due(at(50));
        assert_eq!(
            due,
            [
                Timer::Poll,
                Timer::Heartbeat,
                Timer::HandlerTimeout(TaskId(1)),
                Timer::HandlerTimeout(TaskId(3)),
                Timer::LockRetry
            ]
        );
        assert_eq!(timers.next(), None);
    }

    #[test]
    fn every_named_timer_has_its_slot_in_timer_order() {
        for (i, timer) in NAMED_TIMERS.into_iter().enumerate() {
            assert_eq!(slot(timer), Some(i));
        }
        let mut sorted = NAMED_TIMERS;
        sorted.sort();
        // HandlerTimeout sits between ShutdownGrace and RecordStarts in `Timer`'s order.
        assert_eq!(sorted, NAMED_TIMERS);
    }
}
