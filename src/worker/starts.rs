//! Starts: buffered tasks started as permits free (asked of the store, or at once where it
//! has nothing to check, recorded later), and what the store answers.

use super::*;

impl Worker {
    /// Starts buffered tasks while permits are free: without asking where the store would
    /// check nothing (see [`Worker::starts_unasked`]), else with one start request at a time.
    pub(super) fn start_buffered(&mut self, now: Instant) {
        if self.phase != Phase::Running || self.buffer.is_empty() {
            return;
        }
        let starting = self.held.count(&[Stage::Starting]);
        // Slots the claims in flight start tasks in are taken already.
        let reserved =
            if self.slots.claim.is_out() { self.claim_out.1 } else { 0 } + self.urgent_out.map_or(0, |(_, s)| s);
        let mut free = self.config.concurrency.saturating_sub(self.executing() + starting + reserved);
        let may_ask = !self.slots.start.is_out() && !self.start_blocked;
        let mut ask = Vec::new();
        let mut kept = VecDeque::new();
        while free > 0 {
            let Some(id) = self.buffer.pop() else { break };
            // A buffered task is held; one the store handed out again under the same lease (a
            // failover) may have been written off meanwhile: it is simply gone.
            let Some(held) = self.held.get_mut(&id).filter(|held| held.stage == Stage::Buffered) else { continue };
            if Self::starts_unasked(&self.policy, held) {
                held.unrecorded = true;
                let attempt = held.attempt;
                self.on_started(id, attempt);
                if !self.timers.contains(Timer::RecordStarts) && !self.slots.record.is_due() {
                    self.arm(Timer::RecordStarts, now + self.record_starts_after());
                }
            } else if may_ask {
                ask.push(TaskLease { task: id, lease: held.lease });
                self.held.set_stage(&id, Stage::Starting);
            } else {
                kept.push_back(id);
                continue;
            }
            free -= 1;
        }
        while let Some(id) = kept.pop_back() {
            self.buffer_task(id, true);
        }
        if !ask.is_empty() {
            self.slots.start.sending(self.next_op_id());
            let request = DbRequest::Start { worker: self.id.clone(), tasks: ask.clone(), policy: self.policy.clone() };
            self.send(request, Op::Start(ask));
        }
    }

    /// Whether a claimed task may start without a start request: a start checks the claim
    /// lease (which heartbeats keep), good-until and the caps (soft-cap mode checks them at
    /// start; hard-cap mode counts a claim while its lease is live). With no good-until and no
    /// cap there is nothing to ask, so the handler starts at once and
    /// the store learns of it from the finish, or from [`DbRequest::RecordStarts`] if the
    /// handler is still running [`Worker::record_starts_after`] later.
    pub(super) fn starts_unasked(policy: &ClaimPolicy, held: &Held) -> bool {
        // Under a cap a start must ask: in soft-cap mode the cap is checked at start; in
        // hard-cap mode the claim counts against it only while its lease is live, which the
        // start request checks on the store's clock (a buffered claim may have lapsed).
        let uncapped = policy.queues.iter().find(|q| q.name == held.queue).is_some_and(|q| q.max_concurrency.is_none());
        !held.expires && uncapped && (!policy.hard_cap_mode() || policy.cluster_wide_cap.is_none())
    }

    /// How long a handler started unasked may run before its start is recorded: a quarter of
    /// the claim lease, at most a second, so the claim never lapses and short tasks never need
    /// the write.
    pub(super) fn record_starts_after(&self) -> Duration {
        Duration::from_millis((self.app.effective_claim_lease_ms() / 4).clamp(1, 1_000))
    }

    pub(super) fn send_record_starts(&mut self) {
        if self.slots.record.is_out() || self.db_down || self.phase == Phase::Stopped {
            return;
        }
        self.slots.record.settle();
        let tasks: Vec<TaskLease> = self
            .held
            .iter()
            .filter(|(_, held)| held.unrecorded && matches!(held.stage, Stage::Running { .. }))
            .map(|(id, held)| TaskLease { task: *id, lease: held.lease })
            .collect();
        if tasks.is_empty() {
            return;
        }
        self.slots.record.sending(self.next_op_id());
        self.send(DbRequest::RecordStarts { worker: self.id.clone(), tasks: tasks.clone() }, Op::RecordStarts(tasks));
    }

    /// Whether `task` waits for the start request that named `sent`, under the lease it names.
    pub(super) fn starting(&self, task: TaskId, sent: &SentLeases) -> bool {
        self.held
            .get(&task)
            .is_some_and(|held| held.stage == Stage::Starting && sent.contains(TaskLease { task, lease: held.lease }))
    }

    /// A start that did not happen (deferred, or no answer): back to the buffer, or, while
    /// shutting down, handed back (nothing else would release it, and a start that did land
    /// is undone by the release too).
    pub(super) fn unstart(&mut self, task: TaskId) {
        if self.phase != Phase::Running {
            self.release(task);
        } else if self.held.set_stage(&task, Stage::Buffered).is_some() {
            self.buffer_task(task, true);
        }
    }

    pub(super) fn on_started(&mut self, task: TaskId, attempt: Attempt) {
        let deadline = self.config.handler_timeout_ms.map(|ms| self.now + Duration::from_millis(ms));
        let shutting_down = self.phase != Phase::Running;
        if shutting_down {
            // Started while shutting down: no handler was spawned, so give it straight back.
            let Some(held) = self.held.set_stage(&task, Stage::Starting) else { return };
            held.attempt = attempt;
            self.release(task);
            return;
        }
        let Some(held) = self.held.set_stage(&task, Stage::Running { deadline }) else { return };
        held.attempt = attempt;
        let run = TaskRun {
            id: task,
            lease: held.lease,
            attempt,
            name: held.name.clone(),
            queue: held.queue.clone(),
            priority: held.priority,
            enqueued_at: held.enqueued_at,
            run_at: held.run_at,
            args: std::mem::take(&mut held.args),
            deadline,
        };
        if let Some(deadline) = deadline {
            self.arm(Timer::HandlerTimeout(task), deadline);
        }
        self.stats.started += 1;
        self.events.push_back(Event::Started { task, attempt });
        self.commands.push_back(Command::Spawn(run));
    }

    /// The answer of a start request.
    pub(super) fn on_start_answered(
        &mut self,
        sent: Vec<TaskLease>,
        started: Vec<(TaskId, Attempt)>,
        expired: Vec<TaskId>,
        deferred: Vec<TaskId>,
        lost: Vec<TaskId>,
    ) {
        let sent = SentLeases::new(sent);
        self.slots.start.answered();
        // Only tasks this request starts under the lease held now count: one lost and
        // claimed again while the request was in flight belongs to a newer lease.
        for (task, attempt) in started {
            if self.starting(task, &sent) {
                self.on_started(task, attempt);
            }
        }
        for task in expired {
            if self.starting(task, &sent) {
                self.held.remove(&task);
                self.stats.expired += 1;
                self.events.push_back(Event::Expired { task });
            }
        }
        if !deferred.is_empty() {
            self.start_blocked = true;
            self.poll_while_blocked();
        }
        for task in deferred.into_iter().rev() {
            if self.starting(task, &sent) {
                self.unstart(task);
            }
        }
        for task in lost {
            self.lose(TaskLease { task, lease: sent.lease_of(task) }, LostReason::LeaseLost);
        }
    }

    /// The answer of a record of starts made without asking.
    pub(super) fn on_starts_recorded(
        &mut self,
        sent: Vec<TaskLease>,
        started: Vec<(TaskId, Attempt)>,
        expired: Vec<TaskId>,
        deferred: Vec<TaskId>,
        lost: Vec<TaskId>,
    ) {
        let sent = SentLeases::new(sent);
        self.slots.record.answered();
        for (task, attempt) in started {
            if let Some(held) = self.held.get_mut(&task).filter(|h| sent.contains(TaskLease { task, lease: h.lease })) {
                held.unrecorded = false;
                held.attempt = attempt;
            }
        }
        // Nothing is expired or deferred by a record; a store that says so lost the task.
        for task in lost.into_iter().chain(expired).chain(deferred) {
            let lease = sent.lease_of(task);
            // A finish or release under way reports on its task itself.
            if self.held.get(&task).is_some_and(|h| h.lease == lease && matches!(h.stage, Stage::Running { .. })) {
                self.lose(TaskLease { task, lease }, LostReason::LeaseLost);
            }
        }
        let unrecorded = self.held.values().any(|h| h.unrecorded && matches!(h.stage, Stage::Running { .. }));
        if unrecorded && !self.timers.contains(Timer::RecordStarts) {
            let at = self.now + self.record_starts_after();
            self.arm(Timer::RecordStarts, at);
        }
    }

    /// A start request that failed: its tasks are not started (starting again is idempotent:
    /// a started row under our lease counts as started). True for a lock, which is handled
    /// like a start deferred at a cap: asked again at the next poll or finish.
    pub(super) fn start_failed(&mut self, tasks: Vec<TaskLease>, lock: bool) -> bool {
        self.slots.start.answered();
        let sent = SentLeases::new(tasks.iter().copied());
        for lease in tasks.iter().rev() {
            if self.starting(lease.task, &sent) {
                self.unstart(lease.task);
            }
        }
        if lock {
            self.start_blocked = true;
            self.poll_while_blocked();
            return true;
        }
        false
    }

    /// A record of starts that failed: owed again.
    pub(super) fn record_failed(&mut self) -> bool {
        self.slots.record.answered();
        self.slots.record.owe();
        false
    }
}
