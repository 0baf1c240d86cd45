//! Heartbeats: renewing the leases of everything the worker holds and sending its liveness,
//! one request per interval (sooner for rows another transaction held), from the timer that
//! owes one to the reply that says what was lost.

use super::*;

impl Worker {
    /// The heartbeat timer: a beat is owed until sent (one skipped by an outage goes out once
    /// the database answers again, not an interval later), and the next one armed.
    pub(super) fn on_heartbeat_timer(&mut self, now: Instant) {
        self.slots.heartbeat.owe();
        self.renew_waiting();
        self.arm(Timer::Heartbeat, now + self.heartbeat_interval());
    }

    /// Tasks were taken from their holders: if this worker holds one, a beat is owed now (one
    /// in flight may have been sent before; the next says what became of them).
    pub(super) fn on_revoked(&mut self, tasks: &[TaskId]) {
        if tasks.iter().any(|task| self.held.get(task).is_some()) {
            self.slots.heartbeat.owe();
        }
    }

    pub(super) fn send_heartbeat(&mut self) {
        if self.slots.heartbeat.is_out() || self.db_down || self.phase == Phase::Stopped {
            return;
        }
        self.slots.heartbeat.settle();
        let mut claimed = Vec::new();
        let mut running = Vec::new();
        let sent: Vec<TaskLease> = self.held_leases().collect();
        for (id, held) in self.held.iter() {
            let lease = TaskLease { task: *id, lease: held.lease };
            match held.stage {
                // Claimed in the database: renew the claim (an unrecorded start runs on it).
                _ if held.unrecorded => claimed.push(lease),
                Stage::Buffered | Stage::Starting => claimed.push(lease),
                // Finishing and releasing tasks are still Running in the database until their
                // write lands: keep them alive so the reaper does not take them meanwhile.
                Stage::Running { .. } | Stage::Finishing | Stage::Releasing => running.push(lease),
            }
        }
        self.slots.heartbeat.sending(self.next_op_id());
        let now = self.now;
        self.abandoned.retain(|_, until| *until > now);
        let request = DbRequest::Heartbeat {
            worker: self.id.clone(),
            claimed,
            running,
            lease_ms: self.app.effective_claim_lease_ms(),
            max_renew_age_ms: self.app.max_claim_renew_age_ms,
            abandoned: self.abandoned.keys().copied().collect(),
        };
        self.send(request, Op::Heartbeat(sent));
    }

    /// The answer of a heartbeat: what it lost, and rows another transaction held.
    pub(super) fn on_heartbeat(&mut self, sent: Vec<TaskLease>, lost: Vec<TaskId>, busy: Vec<TaskId>) {
        self.slots.heartbeat.answered();
        let sent = SentLeases::new(sent);
        for task in lost {
            let lease = sent.lease_of(task);
            // A write of ours that takes the task out of the live rows is under way
            // (its finish, its release, or a start that may expire it): it says what
            // became of the task, and a loss the beat saw may be that write landing first.
            let writing = self.held.get(&task).is_some_and(|h| {
                h.lease == lease
                    && match h.stage {
                        Stage::Finishing | Stage::Releasing => true,
                        Stage::Starting => h.expires,
                        Stage::Buffered | Stage::Running { .. } => false,
                    }
            });
            if !writing {
                self.lose(TaskLease { task, lease }, LostReason::LeaseLost);
            }
        }
        if busy.is_empty() {
            if !self.held_up() {
                self.busy_streak = 0;
            }
        } else {
            // Rows another transaction locks were not renewed: beat again soon for them,
            // less soon while they stay locked.
            let at = self.now + self.busy_delay();
            self.busy_streak = self.busy_streak.saturating_add(1);
            if self.timers.get(Timer::Heartbeat).is_none_or(|armed| armed > at) {
                self.arm(Timer::Heartbeat, at);
            }
        }
    }

    /// A heartbeat that failed: owed again. True for a lock, no outage: beat again soon, less
    /// soon while the lock holds.
    pub(super) fn heartbeat_failed(&mut self, lock: bool, now: Instant) -> bool {
        self.slots.heartbeat.answered();
        if lock {
            let at = now + self.busy_delay();
            self.busy_streak = self.busy_streak.saturating_add(1);
            if self.timers.get(Timer::Heartbeat).is_none_or(|armed| armed > at) {
                self.arm(Timer::Heartbeat, at);
            }
            return true;
        }
        self.slots.heartbeat.owe();
        false
    }

    pub(super) fn heartbeat_interval(&self) -> Duration {
        let r = &self.app.recovery;
        Duration::from_millis(r.claimer_heartbeat_interval_ms.min(r.runner_heartbeat_interval_ms))
    }
}
