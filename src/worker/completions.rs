//! Completions: handlers' outcomes checked, queued and written in batches (with the next
//! claim in hard-cap mode), refused batches split until the poison one is alone.

use super::*;

/// A completion waiting to be written.
#[derive(Debug, Clone)]
pub(super) struct Queued {
    pub(super) completion: Completion,
    /// A re-send after an unknown reply: a loss it meets was most likely its own first send.
    pub(super) resent: bool,
    /// Already rewritten after the database refused its values: refused again, it is not the
    /// values.
    pub(super) sanitized: bool,
    /// Its outcome's size, as [`check_storable`] counts it: what batches are cut by.
    pub(super) bytes: u64,
    /// Refusals of it alone so far (locks aside): at [`MAX_LONE_REFUSALS`] it is dropped.
    pub(super) refusals: u32,
}

impl Queued {
    pub(super) fn new(completion: Completion, bytes: u64) -> Queued {
        Queued { completion, resent: false, sanitized: false, bytes, refusals: 0 }
    }
}

/// The size of an outcome the worker wrote itself (an error of its own): small, and storable.
pub(super) fn own_outcome_bytes(outcome: &FinishOutcome) -> u64 {
    match outcome {
        FinishOutcome::Completed(value) => check_storable(value, u64::MAX).unwrap_or(0),
        FinishOutcome::Retry { error, .. } | FinishOutcome::Failed(error) => {
            check_storable_error(error, u64::MAX).unwrap_or(0)
        }
    }
}

/// The most bytes of outcomes (results, errors, new arguments; as [`check_storable`] counts
/// them) one finish request carries: a batch of large results is cut short of it, though a
/// single completion goes alone whatever its size.
pub const MAX_FINISH_BATCH_BYTES: u64 = 64 * 1024 * 1024;

/// A completion the database refuses alone this many times (other than for a lock) is
/// dropped: the worker stops renewing its task and leaves it to the reaper, rather than
/// sending it forever.
pub const MAX_LONE_REFUSALS: u32 = 8;

impl Worker {
    pub(super) fn flush_completions(&mut self) {
        if let Some(batch) = self.take_finish_batch() {
            self.send_finish(batch, false);
        }
    }

    /// The next batch of completions to finish, marked in flight; `None` while one is out or
    /// none waits. At most `completion_batch_max`, the refusal limit and (after the first)
    /// [`MAX_FINISH_BATCH_BYTES`].
    pub(super) fn take_finish_batch(&mut self) -> Option<Vec<Queued>> {
        if self.slots.finish.is_out() || self.completions.is_empty() {
            return None;
        }
        let most = self.completions.len().min(self.config.completion_batch_max as usize).min(self.finish_limit.max(1));
        let (mut n, mut bytes) = (0, 0u64);
        for queued in self.completions.iter().take(most) {
            bytes = bytes.saturating_add(queued.bytes);
            if n > 0 && bytes > MAX_FINISH_BATCH_BYTES {
                break;
            }
            n += 1;
        }
        self.slots.finish.sending(self.next_op_id());
        Some(self.completions.drain(..n).collect())
    }

    /// In hard-cap mode, when a claim is due and completions wait, one request finishes them
    /// and claims: the claim refills the slots the finish frees, in the same round trip.
    pub(super) fn finish_and_claim(&mut self, now: Instant) {
        if !self.app.is_hard_cap_mode() || self.slots.finish.is_out() || self.completions.is_empty() {
            return;
        }
        let Some(claim) = self.begin_claim(now) else { return };
        // Checked above: a batch waits and none is in flight.
        let batch = self.take_finish_batch().unwrap_or_default();
        let completions: Vec<Completion> = batch.iter().map(|q| q.completion.clone()).collect();
        let request = DbRequest::FinishAndClaim {
            worker: self.id.clone(),
            completions,
            token: claim.token,
            policy: claim.policy,
            my_running: claim.running,
            my_claimed: claim.claimed,
            start_now: claim.start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::FinishAndClaim { batch, token: claim.token, notified: claim.notified, sent });
    }

    /// Sends the next lone completion, unless one is out or the last was refused.
    pub(super) fn flush_lone(&mut self) {
        if self.slots.lone.is_out() || self.lone_waiting {
            return;
        }
        let Some(queued) = self.lone.pop_front() else { return };
        self.slots.lone.sending(self.next_op_id());
        self.send_finish(vec![queued], true);
    }

    pub(super) fn send_finish(&mut self, batch: Vec<Queued>, lone: bool) {
        let completions: Vec<Completion> = batch.iter().map(|q| q.completion.clone()).collect();
        self.send(DbRequest::Finish { worker: self.id.clone(), completions }, Op::Finish { batch, lone });
    }

    /// Whether something waits for [`Timer::LockRetry`]: the hold-ups in a row go on counting.
    pub(super) fn held_up(&self) -> bool {
        self.lock_blocked || self.claims_held || self.lone_waiting
    }

    pub(super) fn on_task_finished(&mut self, task: TaskId, lease: Lease, outcome: TaskOutcome) {
        if self.aborted.remove(&TaskLease { task, lease }).is_some() {
            return; // an aborted run's answer: no run under its lease started since
        }
        let Some(held) = self.held.get(&task) else { return };
        if held.lease != lease || !matches!(held.stage, Stage::Running { .. }) {
            return; // aborted or superseded: its answer no longer counts
        }
        self.flow.on_finished(self.now);
        let max = self.config.max_result_bytes;
        let checked = match &outcome {
            TaskOutcome::Success(value) => check_storable(value, max).map_err(|e| format!("its result: {e}")),
            TaskOutcome::Failure(error) => check_storable_error(error, max).map_err(|e| format!("its error: {e}")),
            TaskOutcome::PartialFailure { error, remaining } => {
                check_storable_error(error, max).map_err(|e| format!("its error: {e}")).and_then(|error_bytes| {
                    check_storable(remaining, max.saturating_sub(error_bytes))
                        .map(|bytes| bytes + error_bytes)
                        .map_err(|e| format!("its remaining items: {e}"))
                })
            }
        };
        let (outcome, args, bytes) = match (checked, outcome) {
            (Err(problem), _) => {
                // Queued as it is, it would be refused with every completion of its batch.
                let message = format!("the handler's outcome could not be stored: {problem}");
                self.stats.outcomes_refused += 1;
                self.events.push_back(Event::OutcomeRefused { task, problem: message.clone() });
                let error = TaskError::new(ErrorCode::WorkerSerializationError, message);
                let outcome = self.failure_outcome(task, error);
                let bytes = own_outcome_bytes(&outcome);
                (outcome, None, bytes)
            }
            (Ok(bytes), TaskOutcome::Success(value)) => (FinishOutcome::Completed(value), None, bytes),
            (Ok(bytes), TaskOutcome::Failure(error)) => (self.failure_outcome(task, error), None, bytes),
            (Ok(bytes), TaskOutcome::PartialFailure { error, remaining }) => {
                (self.failure_outcome(task, error), Some(remaining), bytes)
            }
        };
        self.finish(task, outcome, args, bytes);
    }

    pub(super) fn failure_outcome(&mut self, task: TaskId, error: TaskError) -> FinishOutcome {
        let held = self.held.get(&task).expect("a failure is decided for a held task");
        if backoff::may_retry(&held.retry, held.retries, &error.code) {
            let delay = backoff::retry_delay(&held.retry, held.retries + 1, self.rng.next_u64());
            FinishOutcome::Retry { error, delay_ms: delay.as_millis() as u64 }
        } else {
            FinishOutcome::Failed(error)
        }
    }

    /// Queues the outcome of `task`, whose size as JSON is about `bytes`.
    pub(super) fn finish(&mut self, task: TaskId, outcome: FinishOutcome, args: Option<serde_json::Value>, bytes: u64) {
        let held = self.held.set_stage(&task, Stage::Finishing).expect("finish is called for held tasks");
        let lease = held.lease;
        self.timers.remove(Timer::HandlerTimeout(task));
        self.completions.push_back(Queued::new(Completion { task: TaskLease { task, lease }, outcome, args }, bytes));
    }

    /// The answer of a finish (alone or inside a claim).
    pub(super) fn on_finished(
        &mut self,
        batch: Vec<Queued>,
        lone: bool,
        applied: Vec<(TaskId, TaskState)>,
        lost: Vec<TaskId>,
    ) {
        if lone {
            self.slots.lone.answered();
        } else {
            self.slots.finish.answered();
            // It landed: the next batch may be as large again (back to the configured
            // size after a refused batch was split).
            self.finish_limit = self.finish_limit.saturating_mul(2).min(self.config.completion_batch_max as usize);
        }
        if !self.held_up() {
            self.busy_streak = 0;
        }
        let sent = SentLeases::new(batch.iter().map(|q| q.completion.task));
        let resent: BTreeSet<TaskLease> = batch.iter().filter(|q| q.resent).map(|q| q.completion.task).collect();
        for (task, state) in applied {
            // The run this finish ended: still finishing under the lease it named (not a
            // new holding under the same lease, after a failover handed it out again).
            let ended = self.held.get(&task).is_some_and(|held| {
                held.stage == Stage::Finishing && sent.contains(TaskLease { task, lease: held.lease })
            });
            if ended {
                self.held.remove(&task);
            }
            match state {
                TaskState::Completed => self.stats.completed += 1,
                TaskState::Pending => self.stats.retried += 1,
                _ => self.stats.failed += 1,
            }
            self.events.push_back(Event::Finished { task, state });
        }
        for task in lost {
            // A batch may name a task twice (a stale re-send, then the fresh run): only a
            // loss of the lease this worker holds now counts.
            if let Some(held) = self.held.get(&task) {
                let lease = TaskLease { task, lease: held.lease };
                if sent.contains(lease) {
                    let reason = if resent.contains(&lease) { LostReason::Unconfirmed } else { LostReason::LeaseLost };
                    self.lose(lease, reason);
                }
            }
        }
        if self.cap_blocked {
            // Our own tasks left their queues: room may have opened.
            self.cap_blocked = false;
            self.want_pass();
        }
        self.start_blocked = false;
    }

    /// A finish of `batch` that failed: what is still ours goes back to its lane, split when
    /// the database refused it (a value, a lock) so that no refused batch is sent again
    /// unchanged. `true` when the failure is not an outage (nothing to back off from).
    pub(super) fn finish_failed(
        &mut self,
        batch: Vec<Queued>,
        lone: bool,
        failure: &DbFailure,
        unknown: bool,
        now: Instant,
    ) -> bool {
        if lone {
            self.slots.lone.answered();
        } else {
            self.slots.finish.answered();
        }
        // Only an item refused alone is the refused item: one left alone because the others
        // were lost meanwhile is sent again as it is.
        let sent_alone = batch.len() <= 1;
        // Re-send only what is still ours under the same lease.
        let held = |q: &Queued| {
            self.held
                .get(&q.completion.task.task)
                .is_some_and(|h| h.lease == q.completion.task.lease && h.stage == Stage::Finishing)
        };
        let mut batch: Vec<Queued> = batch.into_iter().filter(held).collect();
        let refused = matches!(failure, DbFailure::Invalid(_) | DbFailure::Rejected(_) | DbFailure::LockTimeout(_));
        if refused && sent_alone {
            // Alone: it goes on in the lone lane, and the other completions without it.
            if let Some(queued) = batch.pop() {
                self.refused_alone(queued, failure, now);
            }
            return true;
        }
        if refused {
            // Never the same refused batch again: halve it until the item the database refuses
            // (or the row another transaction holds) is alone. Not an outage: the split is
            // progress, sent at once.
            self.finish_limit = (batch.len() / 2).max(1);
        }
        let lane = if lone { &mut self.lone } else { &mut self.completions };
        for mut queued in batch.into_iter().rev() {
            queued.resent |= unknown;
            lane.push_front(queued);
        }
        refused
    }

    /// A completion the database refused (or a lock held up) on its own: it goes on in the
    /// lone lane, beside the batches. Refused for its values, its task fails instead with
    /// values of the worker's own, at once; refused otherwise, it waits for
    /// [`Timer::LockRetry`], and after [`MAX_LONE_REFUSALS`] refusals it is dropped. A lock
    /// drops nothing: the row's holder lets go in the end, and heartbeats keep the task.
    pub(super) fn refused_alone(&mut self, mut queued: Queued, failure: &DbFailure, now: Instant) {
        let task = queued.completion.task.task;
        match failure {
            DbFailure::Invalid(_) if !queued.sanitized => {
                // No new arguments either: they may be what was refused.
                let problem =
                    format!("the database refused the task's outcome: {}", printable(&failure.to_string(), 500));
                self.stats.outcomes_refused += 1;
                self.events.push_back(Event::OutcomeRefused { task, problem: problem.clone() });
                let error = TaskError::new(ErrorCode::WorkerSerializationError, problem);
                queued.completion.outcome = self.failure_outcome(task, error);
                queued.completion.args = None;
                queued.bytes = own_outcome_bytes(&queued.completion.outcome);
                queued.sanitized = true;
                self.lone.push_front(queued);
                return;
            }
            DbFailure::LockTimeout(_) => {}
            _ => {
                queued.refusals += 1;
                if queued.refusals >= MAX_LONE_REFUSALS {
                    self.held.remove(&task);
                    self.stats.outcomes_dropped += 1;
                    let problem = format!(
                        "the database refused the task's finish {} times, the last: {}",
                        queued.refusals,
                        printable(&failure.to_string(), 500)
                    );
                    self.events.push_back(Event::OutcomeDropped { task, problem });
                    return;
                }
            }
        }
        self.lone.push_back(queued);
        self.lone_waiting = true;
        self.hold_up(now);
    }
}
