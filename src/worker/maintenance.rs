//! Upkeep: the reaper, the look for dead workers, the purge of old finished tasks, the vacuum
//! of the hot tables, and the worker's registration.

use super::*;

/// How often a worker purges finished tasks past `recovery.finished_retention_ms`: an hour.
pub const PURGE_INTERVAL_MS: u64 = 3_600_000;

/// How often a worker checks whether the hot tables need its vacuum
/// (`recovery.vacuum_dead_rows`): a check is one read of the table statistics.
pub const VACUUM_CHECK_INTERVAL_MS: u64 = 10_000;

impl Worker {
    /// Arms the first of each upkeep timer (at startup).
    pub(super) fn arm_upkeep(&mut self, now: Instant) {
        // The first reap comes after a random part of the interval so that workers started
        // together do not reap together.
        let check = self.app.recovery.check_interval_ms;
        let first_reap = self.rng.range(check / 10, check + 1);
        self.arm(Timer::Reaper, now + Duration::from_millis(first_reap));
        if self.app.recovery.auto_recover_dead_workers {
            let every = self.app.recovery.liveness_check_interval_ms;
            let first = self.rng.range(every / 10, every + 1);
            self.arm(Timer::LivenessCheck, now + Duration::from_millis(first));
        }
        if self.app.recovery.finished_retention_ms.is_some() {
            // Spread like the reaper; each worker purges (concurrent purges skip each other's
            // rows), so retention holds while any worker runs.
            let first_purge = self.rng.range(PURGE_INTERVAL_MS / 10, PURGE_INTERVAL_MS + 1);
            self.arm(Timer::Purge, now + Duration::from_millis(first_purge));
        }
        if self.app.recovery.vacuum_dead_rows.is_some() {
            // Spread by the worker's name rather than its random stream, which the rest of
            // the machine's choices (and the simulation's recorded seeds) follow.
            let spread = self.id.0.bytes().fold(0, |h, b| crate::rng::mix(h ^ u64::from(b)));
            let first = VACUUM_CHECK_INTERVAL_MS / 10 + spread % (VACUUM_CHECK_INTERVAL_MS * 9 / 10 + 1);
            self.arm(Timer::Vacuum, now + Duration::from_millis(first));
        }
    }

    /// The queues this worker serves, in its policy's order (as the registry and marks name
    /// them).
    pub(super) fn queue_names(&self) -> Vec<String> {
        self.policy.queues.iter().map(|q| q.name.clone()).collect()
    }

    /// Registers the worker (its queues and concurrency) until the registry has it.
    pub(super) fn send_register(&mut self) {
        if self.registered || self.slots.register.is_out() || self.lock_blocked {
            return;
        }
        self.slots.register.sending(self.next_op_id());
        let info =
            WorkerInfo { worker: self.id.clone(), queues: self.queue_names(), concurrency: self.config.concurrency };
        self.send(DbRequest::RegisterWorker(info), Op::Register);
    }

    /// An upkeep timer: its request goes out (unless one is in flight), and the next one armed.
    pub(super) fn on_upkeep_timer(&mut self, timer: Timer, now: Instant) {
        let every = match timer {
            Timer::Reaper => {
                self.send_reap();
                self.app.recovery.check_interval_ms
            }
            Timer::LivenessCheck => {
                self.send_reap_dead();
                self.app.recovery.liveness_check_interval_ms
            }
            Timer::Purge => {
                self.send_purge();
                PURGE_INTERVAL_MS
            }
            Timer::Vacuum => {
                self.send_vacuum();
                VACUUM_CHECK_INTERVAL_MS
            }
            _ => return,
        };
        self.arm(timer, now + Duration::from_millis(every));
    }

    pub(super) fn send_reap(&mut self) {
        if self.slots.reap.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        let recovery = &self.app.recovery;
        let request = DbRequest::Reap {
            worker: self.id.clone(),
            claimed_stale_ms: recovery.auto_requeue_stale_claimed.then_some(recovery.claimed_stale_threshold_ms),
            running_stale_ms: recovery.auto_fail_stale_running.then_some(recovery.running_stale_threshold_ms),
            entropy: self.rng.next_u64(),
        };
        self.slots.reap.sending(self.next_op_id());
        self.send(request, Op::Reap);
    }

    /// Skipped (until the next interval) while one is in flight, the database is down or the
    /// worker drains.
    pub(super) fn send_reap_dead(&mut self) {
        if self.slots.reap_dead.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        let request = DbRequest::ReapDead {
            worker: self.id.clone(),
            grace_ms: self.app.recovery.liveness_grace_ms,
            entropy: self.rng.next_u64(),
        };
        self.slots.reap_dead.sending(self.next_op_id());
        self.send(request, Op::ReapDead);
    }

    /// Skipped (until the next interval) while a purge is in flight, the database is down or
    /// the worker drains.
    pub(super) fn send_purge(&mut self) {
        let Some(older_than_ms) = self.app.recovery.finished_retention_ms else { return };
        if self.slots.purge.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        self.slots.purge.sending(self.next_op_id());
        self.send(DbRequest::Purge { older_than_ms, batch: DEFAULT_PURGE_BATCH }, Op::Purge);
    }

    /// Skipped (until the next interval) while a vacuum is in flight, the database is down or
    /// the worker drains.
    pub(super) fn send_vacuum(&mut self) {
        let Some(min_dead_rows) = self.app.recovery.vacuum_dead_rows else { return };
        if self.slots.vacuum.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        self.slots.vacuum.sending(self.next_op_id());
        self.send(DbRequest::Vacuum { min_dead_rows }, Op::Vacuum);
    }

    /// The reaper's report.
    pub(super) fn on_reaped(&mut self, report: ReapReport) {
        self.slots.reap.answered();
        if report.skipped {
            self.stats.reaps_skipped += 1;
            self.events.push_back(Event::ReapSkipped);
        } else if report.changed_anything() {
            self.events.push_back(Event::Reaped(report));
        }
    }

    /// The report of a look for dead workers by their released liveness tokens.
    pub(super) fn on_dead_reaped(&mut self, report: ReapReport) {
        self.slots.reap_dead.answered();
        if !report.dead_workers.is_empty() {
            self.stats.dead_workers_recovered += report.dead_workers.len() as u64;
            self.events.push_back(Event::Reaped(report));
        }
    }

    /// How many finished tasks a purge deleted.
    pub(super) fn on_purged(&mut self, tasks: u64) {
        self.slots.purge.answered();
        if tasks > 0 {
            self.events.push_back(Event::Purged { tasks });
        }
    }

    /// The hot tables a vacuum check vacuumed.
    pub(super) fn on_vacuumed(&mut self, tables: Vec<VacuumedTable>) {
        self.slots.vacuum.answered();
        if !tables.is_empty() {
            self.events.push_back(Event::Vacuumed(tables));
        }
    }

    /// The worker is in the registry.
    pub(super) fn on_registered(&mut self) {
        self.slots.register.answered();
        self.registered = true;
    }

    /// A reaper pass that failed: true for a lock (the next interval tries again; nothing
    /// waits for it).
    pub(super) fn reap_failed(&mut self, lock: bool) -> bool {
        self.slots.reap.answered();
        lock
    }

    /// A look for dead workers that failed: as [`reap_failed`](Self::reap_failed).
    pub(super) fn reap_dead_failed(&mut self, lock: bool) -> bool {
        self.slots.reap_dead.answered();
        lock
    }

    /// A purge that failed: as [`reap_failed`](Self::reap_failed).
    pub(super) fn purge_failed(&mut self, lock: bool) -> bool {
        self.slots.purge.answered();
        lock
    }

    /// A vacuum check that failed, whatever stopped it (a lock, its statement timeout on a
    /// bloated table): upkeep, which the next check tries again; an outage shows in the work
    /// itself. Always handled.
    pub(super) fn vacuum_failed(&mut self) -> bool {
        self.slots.vacuum.answered();
        true
    }
}
