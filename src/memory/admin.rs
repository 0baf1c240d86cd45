//! Operator actions: [`AdminRequest`]s applied as the SQL applies them.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::Value;

use crate::budget::ClaimPolicy;
use crate::store::{
    self, AdminError, AdminReply, AdminRequest, Cancelled, DbTime, KeyRemoval, PausedQueue, Reschedule,
    TASK_CANCELLED_MESSAGE,
};
use crate::task::is_valid_queue_name;
use crate::task::{ErrorCode, TaskError, TaskEvent, TaskId, TaskState, WorkerId, transition};

use super::store::{MemoryStore, StoredTask, minus_ms};

impl MemoryStore {
    /// Applies an operator's action at `now` (see [`AdminRequest`] for what each does and
    /// replies); a refused one changes nothing.
    pub fn admin(&mut self, request: &AdminRequest, now: DbTime) -> Result<AdminReply, AdminError> {
        let reply = self.admin_request(request, now);
        // One statement each: the workflows of the steps it finished settle as it ends.
        self.settle_workflows(now);
        reply
    }

    fn admin_request(&mut self, request: &AdminRequest, now: DbTime) -> Result<AdminReply, AdminError> {
        match request {
            AdminRequest::Cancel { task } => self.cancel(*task, now).map(|found| AdminReply::Cancelled { found }),
            AdminRequest::Retry { task } => self.requeue_failed(*task, now).map(|()| AdminReply::Done),
            AdminRequest::Reschedule { task, change } => {
                self.reschedule(*task, *change, now).map(|()| AdminReply::Done)
            }
            AdminRequest::Complete { task, result } => {
                self.complete(*task, result.clone(), now).map(|()| AdminReply::Done)
            }
            AdminRequest::Fail { task, message } => self.fail(*task, message, now).map(|()| AdminReply::Done),
            AdminRequest::ForceUnlock { workers } => Ok(AdminReply::Released { tasks: self.force_unlock(workers) }),
            AdminRequest::RemoveKey { key } => {
                self.remove_key(key, now).map(|removal| AdminReply::KeyRemoved { removal })
            }
            // One atomic step: the batch size of a statement means nothing here.
            AdminRequest::Purge { retention_ms, batch: _ } => {
                Ok(AdminReply::Purged { tasks: self.purge_finished(*retention_ms, now) })
            }
            AdminRequest::Delete { task } => self.delete_finished(*task).map(|()| AdminReply::Done),
            AdminRequest::Pause { queue } => {
                self.pause_queue(queue, now).map(|was_running| AdminReply::Paused { was_running })
            }
            AdminRequest::Resume { queue } => {
                self.resume_queue(queue).map(|was_paused| AdminReply::Resumed { was_paused })
            }
        }
    }

    /// Cancels a Pending or Claimed task: it becomes Cancelled with error `TASK_CANCELLED`
    /// (no attempt record); a holder's later writes about it are reported lost. Says whether
    /// it was claimed, and by whom: that worker may already be running it.
    pub(super) fn cancel(&mut self, id: TaskId, now: DbTime) -> Result<Cancelled, AdminError> {
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        let (state, holder) = (row.state, row.claimed_by.clone());
        transition(state, TaskEvent::Cancel).map_err(|_| AdminError::WrongState {
            task: id,
            state,
            expected: "PENDING or CLAIMED",
        })?;
        let error = TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE);
        self.finish_row(id, TaskEvent::Cancel, now, Some(error), None);
        Ok(Cancelled::of(state, holder))
    }

    /// Puts a Failed task back to Pending, claimable at once (`run_at = now`), with its
    /// retries reset to 0; its attempts, history and last error are kept.
    pub(super) fn requeue_failed(&mut self, id: TaskId, now: DbTime) -> Result<(), AdminError> {
        if let Some((workflow, _)) = self.step_of(id) {
            return Err(AdminError::WorkflowStep { task: id, workflow });
        }
        let state = self.row(id).ok_or(AdminError::NotFound(id))?.state;
        transition(state, TaskEvent::Requeue).map_err(|_| AdminError::WrongState {
            task: id,
            state,
            expected: "FAILED",
        })?;
        let mut row = self.finished.remove(&id).expect("a FAILED task is in the finished table");
        row.reopen(TaskEvent::Requeue);
        row.run_at = now;
        let queue = row.queue.clone();
        self.live.insert(id, row);
        self.notify_ready([queue]);
        Ok(())
    }

    /// Changes a Pending task's run-at, priority or retries spent (see [`Reschedule`]); its
    /// key, attempts and history are kept. Its queue is notified, so waiting workers claim it
    /// if it is due, or learn its new run-at from the claim's wake-up hint.
    pub(super) fn reschedule(&mut self, id: TaskId, change: Reschedule, now: DbTime) -> Result<(), AdminError> {
        change.check()?;
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        if row.state != TaskState::Pending {
            return Err(AdminError::WrongState { task: id, state: row.state, expected: "PENDING" });
        }
        let run_at = change.run_at.map_or(row.run_at, |at| store::resolve_run_at(at, now));
        if let Some(good_until) = row.good_until.filter(|&at| run_at >= at) {
            return Err(AdminError::RunAtAfterGoodUntil { task: id, run_at: run_at.0, good_until: good_until.0 });
        }
        let row = self.live_row(id);
        row.run_at = run_at;
        row.priority = change.priority.unwrap_or(row.priority);
        row.retries = change.retries.unwrap_or(row.retries);
        let queue = row.queue.clone();
        self.notify_ready([queue]);
        Ok(())
    }

    /// Completes a Pending, Claimed or Running task by hand with `result`: it moves to the
    /// finished table (no retry), a holder's later writes about it are reported lost, and
    /// waiters are notified. A run it was in counts as its last run (as a finished run's does).
    pub(super) fn complete(&mut self, id: TaskId, result: Value, now: DbTime) -> Result<(), AdminError> {
        self.finish_by_hand(id, TaskEvent::CompleteByHand, None, Some(result), now)
    }

    /// Fails a Pending, Claimed or Running task by hand with `FAILED_BY_OPERATOR` and
    /// `message`, with no retry; otherwise as [`complete`](Self::complete).
    pub(super) fn fail(&mut self, id: TaskId, message: &str, now: DbTime) -> Result<(), AdminError> {
        let error = TaskError::new(ErrorCode::FailedByOperator, message);
        self.finish_by_hand(id, TaskEvent::FailByHand, Some(error), None, now)
    }

    pub(super) fn finish_by_hand(
        &mut self,
        id: TaskId,
        event: TaskEvent,
        error: Option<TaskError>,
        result: Option<Value>,
        now: DbTime,
    ) -> Result<(), AdminError> {
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        let state = row.state;
        let refused = |_| AdminError::WrongState { task: id, state, expected: "PENDING, CLAIMED or RUNNING" };
        let outcome = transition(state, event).map_err(refused)?;
        // The finished row holds the task's last run unless the history has it already (what
        // PostgreSQL's attempts query reads back): a run cut off here, or one handed back.
        let recorded = self.history.get(&id).and_then(|runs| runs.iter().map(|r| r.attempt.0).max()).unwrap_or(0);
        if row.attempts > recorded {
            self.record_attempt(id, outcome, error.clone(), now);
        }
        self.finish_row(id, event, now, error, result);
        Ok(())
    }

    /// Hands the Claimed and Running tasks of dead `workers` back to Pending, as a
    /// [`DbRequest::Release`] by their holder would: claimable at once, no retry spent, the
    /// holder's later writes reported lost; each queue concerned is notified once. Registered
    /// workers among them are marked stopped. Returns how many tasks went back.
    pub(super) fn force_unlock(&mut self, workers: &[WorkerId]) -> u64 {
        let ids: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| matches!(row.state, TaskState::Claimed | TaskState::Running))
            .filter(|row| row.claimed_by.as_ref().is_some_and(|w| workers.contains(w)))
            .map(|row| row.id)
            .collect();
        let queues: BTreeSet<String> = ids.iter().map(|&id| self.release_row(id)).collect();
        self.notify_ready(queues);
        for worker in workers {
            if let Some(record) = self.workers.get_mut(worker) {
                record.stopped = true;
            }
        }
        ids.len() as u64
    }

    /// Frees idempotency key `key`: the task holding it is Cancelled if Pending (as by
    /// [`cancel`](Self::cancel)), runs on without it if Claimed or Running, and simply loses
    /// it if finished. The task no longer shows the key, and a new task may take it.
    pub(super) fn remove_key(&mut self, key: &str, now: DbTime) -> Result<KeyRemoval, AdminError> {
        let id = self.keys.remove(key).ok_or_else(|| AdminError::KeyNotFound(key.to_owned()))?.task;
        if let Some(row) = self.live.get_mut(&id) {
            row.key = None;
            if row.state != TaskState::Pending {
                return Ok(KeyRemoval::Detached(id));
            }
            let error = TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE);
            self.finish_row(id, TaskEvent::Cancel, now, Some(error), None);
            return Ok(KeyRemoval::Cancelled(id));
        }
        if let Some(row) = self.finished.get_mut(&id) {
            row.key = None;
        }
        Ok(KeyRemoval::Freed(id))
    }

    /// Deletes finished tasks that finished more than `retention_ms` before `now`, with their
    /// attempts history and the keys they hold. Returns how many.
    ///
    /// A task that holds an idempotency key stays (its row is what an idempotent enqueue
    /// compares name and arguments with) for `recovery.idempotency_retention_ms` of the app
    /// after the key was taken (or its task enqueued, if later): forever when that is `None`.
    pub(super) fn purge_finished(&mut self, retention_ms: u64, now: DbTime) -> u64 {
        let cutoff = minus_ms(now, retention_ms);
        let window = self.app.recovery.idempotency_retention_ms;
        let keys = &self.keys;
        let kept = |row: &StoredTask| {
            let Some(hold) = row.key.as_ref().and_then(|key| keys.get(key)).filter(|hold| hold.task == row.id) else {
                return false;
            };
            match (hold.idempotent_since, window) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(since), Some(window)) => since.max(row.enqueued_at) > minus_ms(now, window),
            }
        };
        let old: Vec<TaskId> = self
            .finished
            .values()
            .filter(|row| row.finished_at.is_some_and(|at| at < cutoff) && !kept(row))
            .map(|row| row.id)
            .collect();
        for id in &old {
            if let Some(row) = self.finished.remove(id) {
                // A key another task has taken since is not this task's to drop.
                if let Some(key) = row.key.filter(|key| self.keys.get(key).is_some_and(|hold| hold.task == *id)) {
                    self.keys.remove(&key);
                }
            }
            self.history.remove(id);
        }
        old.len() as u64
    }

    /// Deletes a finished task with its attempts history and the key it holds.
    pub(super) fn delete_finished(&mut self, id: TaskId) -> Result<(), AdminError> {
        let Some(row) = self.finished.remove(&id) else {
            let state = self.row(id).ok_or(AdminError::NotFound(id))?.state;
            return Err(AdminError::WrongState { task: id, state, expected: store::FINISHED_STATES });
        };
        if let Some(key) = row.key.filter(|key| self.keys.get(key).is_some_and(|hold| hold.task == id)) {
            self.keys.remove(&key);
        }
        self.history.remove(&id);
        Ok(())
    }

    /// Pauses `queue`: from now on no claim takes its Pending tasks (its Claimed and Running
    /// ones go on). Returns whether it was running before (pausing a paused queue keeps its
    /// first pause time). Any valid queue name may be paused, configured or not.
    pub(super) fn pause_queue(&mut self, queue: &str, now: DbTime) -> Result<bool, AdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()));
        }
        if self.paused.contains_key(queue) {
            return Ok(false);
        }
        self.paused.insert(queue.to_owned(), now);
        Ok(true)
    }

    /// Resumes a paused `queue` and notifies it, so waiting workers claim its tasks. Returns
    /// whether it was paused.
    pub(super) fn resume_queue(&mut self, queue: &str) -> Result<bool, AdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()));
        }
        if self.paused.remove(queue).is_none() {
            return Ok(false);
        }
        self.notify_ready([queue.to_owned()]);
        Ok(true)
    }

    /// The paused queues, by name.
    pub fn paused_queues(&self) -> Vec<PausedQueue> {
        self.paused.iter().map(|(queue, &paused_at)| PausedQueue { queue: queue.clone(), paused_at }).collect()
    }

    /// `policy` without the queues that are paused: what a claim pass serves.
    pub(super) fn without_paused(&self, policy: &Arc<ClaimPolicy>) -> Arc<ClaimPolicy> {
        if self.paused.is_empty() || !policy.queues.iter().any(|q| self.paused.contains_key(&q.name)) {
            return Arc::clone(policy);
        }
        let mut served = ClaimPolicy::clone(policy);
        served.queues.retain(|q| !self.paused.contains_key(&q.name));
        Arc::new(served)
    }
}
