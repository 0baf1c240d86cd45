//! Enqueue: new tasks, keys and their modes, checked as every store checks them.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::store::{self, DbTime, EnqueueError, KeyMode, NewTask, Notification};
use crate::task::{Lease, TaskId, TaskState};

use super::store::{KeyHold, MemoryStore, StoredTask};

impl MemoryStore {
    /// Enqueues one task (see [`enqueue_many`](Self::enqueue_many)).
    pub fn enqueue(&mut self, task: NewTask, now: DbTime) -> Result<TaskId, EnqueueError> {
        let ids = self.enqueue_many(vec![task], now)?;
        Ok(ids.into_iter().next().expect("one id per task enqueued"))
    }

    /// Enqueues tasks as one statement: every task is checked ([`store::check_new_task`], one
    /// mode per key: [`store::BatchKeys`]) before any is written, and on an error nothing is
    /// written. Then the tasks apply in order, as if enqueued one by one. Returns one id per
    /// task, in order.
    ///
    /// A keyed task follows its [`KeyMode`]: in `Idempotent` mode a key that names a task
    /// (live or finished, or an earlier task of the batch) with the same name and arguments
    /// gives that task's id and writes nothing, with another name or other arguments it is
    /// [`EnqueueError::PayloadMismatch`]; the graphile modes update a Pending holder in place,
    /// detach the key from a Claimed or Running one, or keep a live one (`UnsafeDedupe`).
    /// New tasks get ids 1, 2, 3… in order, and each queue that received a new or updated
    /// task gets one [`Notification::TaskReady`] (whatever the tasks' `run_at`), which names the
    /// earliest run-at among them when no task has a key. A batch without keys notifies only
    /// the queues some worker is marked waiting on ([`DbRequest::SetWaiting`]), as a client's
    /// own enqueue in PostgreSQL does.
    ///
    /// [`DbRequest::SetWaiting`]: crate::store::DbRequest::SetWaiting
    pub fn enqueue_many(&mut self, tasks: Vec<NewTask>, now: DbTime) -> Result<Vec<TaskId>, EnqueueError> {
        let mut queues = Vec::with_capacity(tasks.len());
        let mut batch_keys = store::BatchKeys::default();
        // The first task with a problem is refused; within a task, in PostgreSQL's order: what
        // needs no clock nor stored rows (the client's checks, with the earliest `now`), then
        // times and stored keys (the database's), so both stores report the same problem.
        for (index, task) in tasks.iter().enumerate() {
            queues.push(store::check_new_task(&self.app, task, DbTime(i64::MIN))?.to_owned());
            batch_keys.check(index, task)?;
            store::check_new_task(&self.app, task, now)?;
            if let (Some(key), KeyMode::Idempotent) = (&task.key, task.key_mode) {
                if let Some(holder) = self.keys.get(key).and_then(|hold| self.row(hold.task)) {
                    if holder.name != task.name || holder.args != task.args {
                        return Err(EnqueueError::PayloadMismatch { key: key.clone(), existing: holder.id });
                    }
                }
            }
        }

        let mut ids = Vec::with_capacity(tasks.len());
        // Per queue that received a new or updated task, the most urgent priority and the
        // earliest run-at. PostgreSQL's statements for batches without keys announce the run-at
        // too; keyed batches go through its `enqueue()` function, which announces none.
        let keyless = tasks.iter().all(|task| task.key.is_none());
        let mut ready: BTreeMap<String, (i16, DbTime)> = BTreeMap::new();
        for (task, queue) in tasks.into_iter().zip(queues) {
            let priority = task.priority;
            let holder = task.key.as_ref().and_then(|key| self.keys.get_mut(key)).map(|hold| {
                // An idempotent enqueue relies on the key from now on, whatever mode took it.
                if task.key_mode == KeyMode::Idempotent {
                    hold.idempotent_since.get_or_insert(now);
                }
                hold.task
            });
            let live_holder = holder.and_then(|id| self.live.get(&id).map(|row| (id, row.state)));
            let id = match (task.key_mode, holder, live_holder) {
                _ if task.key.is_none() => self.insert_new(task, queue.clone(), now),
                (KeyMode::Idempotent, Some(id), _) | (KeyMode::UnsafeDedupe, _, Some((id, _))) => {
                    ids.push(id);
                    continue;
                }
                (KeyMode::Replace | KeyMode::PreserveRunAt, _, Some((id, TaskState::Pending))) => {
                    self.replace_pending(id, task, queue.clone(), now);
                    id
                }
                (_, holder, _) => {
                    // A Claimed or Running holder runs on without its key; a finished one
                    // gives it up.
                    if let Some(row) =
                        holder.and_then(|id| self.live.get_mut(&id).or_else(|| self.finished.get_mut(&id)))
                    {
                        row.key = None;
                    }
                    self.insert_new(task, queue.clone(), now)
                }
            };
            let run_at = self.live.get(&id).map_or(now, |row| row.run_at);
            let (most_urgent, earliest) = ready.entry(queue).or_insert((priority, run_at));
            *most_urgent = (*most_urgent).min(priority);
            *earliest = (*earliest).min(run_at);
            ids.push(id);
        }
        for (queue, (priority, run_at)) in ready {
            // PostgreSQL's statements for batches without keys notify only queues some worker
            // is marked waiting on; `enqueue()` always notifies.
            if keyless && !self.waited_on(&queue, priority) {
                continue;
            }
            let run_at = keyless.then_some(run_at);
            self.notifications.push(Notification::TaskReady { queue, priority: Some(priority), run_at });
        }
        Ok(ids)
    }

    /// Writes `task` as another producer writing its row by hand would: none of
    /// [`store::check_new_task`]'s checks, so its arguments may be anything a database holds
    /// (nested deeper than a reader decodes, say). For tests and the simulation of rows no
    /// worker can read; its queue, if any, is taken as it is.
    #[cfg(feature = "sim")]
    pub fn enqueue_unchecked(&mut self, task: NewTask, now: DbTime) -> TaskId {
        let queue = task.queue.clone().unwrap_or_else(|| store::default_queue(&self.app).to_owned());
        let id = self.insert_new(task, queue.clone(), now);
        self.notify_ready([queue]);
        id
    }

    /// Writes `task` as a new Pending row (taking its key, if it has one) and returns its id.
    pub(super) fn insert_new(&mut self, task: NewTask, queue: String, now: DbTime) -> TaskId {
        let id = TaskId(self.next_id);
        self.next_id = self.next_id.saturating_add(1);
        if let Some(key) = &task.key {
            let idempotent_since = (task.key_mode == KeyMode::Idempotent).then_some(now);
            self.keys.insert(key.clone(), KeyHold { task: id, idempotent_since });
        }
        self.live.insert(
            id,
            StoredTask {
                id,
                name: task.name,
                queue,
                priority: task.priority,
                args: task.args,
                state: TaskState::Pending,
                lease: Lease(0),
                claimed_by: None,
                claim_token: None,
                claimed_at: None,
                claim_expires_at: None,
                heartbeat_at: None,
                started_at: None,
                attempts: 0,
                retries: 0,
                run_at: store::resolve_run_at(task.run_at, now),
                enqueued_at: now,
                good_until: task.good_until,
                retry: task.retry.unwrap_or_else(|| self.app.retry.clone()),
                key: task.key,
                flags: crate::task::normalized_flags(&task.flags),
                result: None,
                error: None,
                finished_at: None,
            },
        );
        id
    }

    /// Updates the Pending task `id` in place from `task` ([`KeyMode::Replace`] and
    /// [`KeyMode::PreserveRunAt`]).
    pub(super) fn replace_pending(&mut self, id: TaskId, task: NewTask, queue: String, now: DbTime) {
        let default_retry = self.app.retry.clone();
        let row = self.live.get_mut(&id).expect("the holder is live");
        debug_assert_eq!(row.state, TaskState::Pending);
        if !(task.key_mode == KeyMode::PreserveRunAt && row.attempts == 0) {
            row.run_at = store::resolve_run_at(task.run_at, now);
        }
        row.args = match (&mut row.args, task.args) {
            (Value::Array(old), Value::Array(new)) => {
                old.extend(new);
                Value::Array(std::mem::take(old))
            }
            (_, new) => new,
        };
        row.name = task.name;
        row.queue = queue;
        row.priority = task.priority;
        row.good_until = task.good_until;
        row.retry = task.retry.unwrap_or(default_retry);
        row.flags = crate::task::normalized_flags(&task.flags);
        row.retries = 0;
        row.error = None;
    }
}
