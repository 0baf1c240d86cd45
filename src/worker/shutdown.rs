//! Shutdown: no more claims, buffered claims handed back, handlers given the grace period,
//! the rest aborted and released, then deregistration.

use super::*;

/// After the shutdown grace period, this many database failures in a row stop a draining
/// worker and leave what it still holds to the reaper.
const SHUTDOWN_DB_FAILURES: u32 = 3;

impl Worker {
    pub(super) fn begin_shutdown(&mut self, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        self.phase = Phase::Draining { grace_over: false };
        self.timers.remove(Timer::Poll);
        self.timers.remove(Timer::Wake);
        self.timers.remove(Timer::Reaper);
        self.timers.remove(Timer::LivenessCheck);
        let buffered: Vec<TaskId> = self.buffer.iter().collect();
        for task in buffered {
            self.release(task);
        }
        self.arm(Timer::ShutdownGrace, now + Duration::from_millis(self.config.shutdown_grace_ms));
    }

    pub(super) fn end_grace(&mut self) {
        self.phase = Phase::Draining { grace_over: true };
        // Shutdown gives up on writes that locks keep holding up past the grace period: the
        // hold-ups before it (the row may be free by now) do not count.
        self.busy_streak = 0;

        let running: Vec<TaskId> =
            self.held.iter().filter(|(_, t)| matches!(t.stage, Stage::Running { .. })).map(|(id, _)| *id).collect();
        for task in running {
            self.release(task);
        }
    }

    /// Finishes shutdown once nothing is held or in flight; after the grace period, a database
    /// that is down does not hold shutdown up.
    pub(super) fn check_drained(&mut self) {
        let Phase::Draining { grace_over } = self.phase else { return };
        // A database that keeps failing does not hold shutdown up past the grace period, but
        // one failed request (a lost reply) does not end it either: what it left to do (undo
        // an unanswered claim, hand tasks back) is retried like any write first.
        // Nor do locks that keep holding its writes up.
        if grace_over && self.db_down && self.backoff.failures() >= SHUTDOWN_DB_FAILURES {
            self.stop(self.held.len());
            return;
        }
        if grace_over && self.busy_streak >= SHUTDOWN_DB_FAILURES && !self.held.is_empty() {
            // The database answers, but locks held elsewhere keep holding writes up: what they
            // hold up is left to the reaper, and the worker deregisters as usual.
            self.given_up += self.held.len();
            self.held = HeldTasks::default();
            self.completions.clear();
            self.lone.clear();
            self.releases.clear();
        }
        let idle = self.held.is_empty()
            && self.completions.is_empty()
            && self.lone.is_empty()
            && self.releases.is_empty()
            && self.abandons.is_empty()
            // A waiting mark's answer changes nothing now: the deregistration deletes the mark
            // (and one that lands after it is a stopped worker's, deleted as stale).
            && self.ops.values().all(|op| {
                matches!(op, Op::Heartbeat(_) | Op::Reap | Op::ReapDead | Op::Vacuum | Op::SetWaiting { .. })
            });
        if idle && !self.deregister_sent && !self.db_down {
            self.deregister_sent = true;
            self.send(DbRequest::DeregisterWorker(self.id.clone()), Op::Deregister);
        }
    }

    pub(super) fn stop(&mut self, abandoned: usize) {
        self.phase = Phase::Stopped;
        self.timers.clear();
        self.events.push_back(Event::Drained { abandoned });
    }

    pub(super) fn release(&mut self, task: TaskId) {
        let held = self.held.get(&task).expect("release is called for held tasks");
        let (lease, was_running) = (held.lease, matches!(held.stage, Stage::Running { .. }));
        if was_running {
            self.abort(task, lease);
        }
        self.buffer.remove(task);
        self.held.set_stage(&task, Stage::Releasing);
        self.timers.remove(Timer::HandlerTimeout(task));
        self.releases.push(TaskLease { task, lease });
    }

    /// The answer of a release or an abandoned claim's undoing: those tasks are no longer held.
    pub(super) fn on_released(&mut self, released: Vec<TaskId>, lost: Vec<TaskId>) {
        for task in released.into_iter().chain(lost) {
            if self.held.get(&task).is_some_and(|t| t.stage == Stage::Releasing) {
                self.held.remove(&task);
            }
        }
    }
}
