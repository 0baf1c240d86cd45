//! Inspection: tasks, runs, counts, workers and paused queues as the SQL reads them.

use std::collections::BTreeMap;

use crate::store::{
    AttemptRecord, DbTime, FinishedCount, Notification, QueueDepth, TaskFilter, TaskRecord, WorkerLoad, WorkerRecord,
};
use crate::task::{TaskId, TaskState, WorkerId};

use super::store::{MemoryStore, StoredTask};

impl MemoryStore {
    /// The task with this id, live or finished.
    pub fn get(&self, id: TaskId) -> Option<TaskRecord> {
        self.row(id).map(StoredTask::record)
    }

    /// The full row of the task with this id, live or finished.
    #[cfg(feature = "sim")]
    pub fn task(&self, id: TaskId) -> Option<&StoredTask> {
        self.row(id)
    }

    /// Every row: the live table, then the finished table, each by id.
    pub fn tasks(&self) -> impl Iterator<Item = &StoredTask> {
        self.live.values().chain(self.finished.values())
    }

    /// The attempts history of a task, oldest first (empty for an unknown id).
    pub fn attempts(&self, id: TaskId) -> Vec<AttemptRecord> {
        self.history.get(&id).cloned().unwrap_or_default()
    }

    /// The tasks `filter` selects, live and finished together, by id.
    pub fn list(&self, filter: &TaskFilter) -> Vec<TaskRecord> {
        let past = |id: TaskId| match filter.after {
            None => true,
            Some(after) if filter.newest_first => id < after,
            Some(after) => id > after,
        };
        let mut rows: Vec<&StoredTask> = self
            .tasks()
            .filter(|row| filter.queue.as_ref().is_none_or(|q| &row.queue == q))
            .filter(|row| filter.state.is_none_or(|s| row.state == s))
            .filter(|row| filter.name.as_ref().is_none_or(|n| &row.name == n))
            .filter(|row| filter.enqueued_from.is_none_or(|from| row.enqueued_at >= from))
            .filter(|row| filter.enqueued_before.is_none_or(|before| row.enqueued_at < before))
            .filter(|row| past(row.id))
            .collect();
        rows.sort_by_key(|row| row.id);
        if filter.newest_first {
            rows.reverse();
        }
        rows.into_iter().skip(filter.offset).take(filter.limit.unwrap_or(usize::MAX)).map(StoredTask::record).collect()
    }

    /// How many tasks each queue has in each state (pairs with none are left out).
    pub fn counts(&self) -> BTreeMap<(String, TaskState), u64> {
        let mut counts = BTreeMap::new();
        for row in self.tasks() {
            *counts.entry((row.queue.clone(), row.state)).or_insert(0) += 1;
        }
        counts
    }

    /// Each queue with live tasks, by name, with how many it holds in each live state at
    /// `now` (see [`QueueDepth`]); the finished table is not read.
    pub fn queue_depths(&self, now: DbTime) -> Vec<QueueDepth> {
        let mut depths: BTreeMap<&str, QueueDepth> = BTreeMap::new();
        for row in self.live.values() {
            let depth = depths.entry(&row.queue).or_insert_with(|| QueueDepth {
                queue: row.queue.clone(),
                due: 0,
                scheduled: 0,
                claimed: 0,
                running: 0,
                oldest_due: None,
            });
            match row.state {
                TaskState::Pending if row.run_at <= now => {
                    depth.due += 1;
                    depth.oldest_due = Some(depth.oldest_due.map_or(row.run_at, |oldest| oldest.min(row.run_at)));
                }
                TaskState::Pending => depth.scheduled += 1,
                TaskState::Claimed => depth.claimed += 1,
                TaskState::Running => depth.running += 1,
                // Workflow steps waiting for their parents are no queue's work yet.
                _ => {}
            }
        }
        depths.into_values().collect()
    }

    /// How many tasks reached each terminal state in [`from`, `to`), by queue and state.
    pub fn finished_counts(&self, from: DbTime, to: DbTime) -> Vec<FinishedCount> {
        let mut counts: BTreeMap<(&str, TaskState), u64> = BTreeMap::new();
        for row in self.finished.values().filter(|row| row.finished_at.is_some_and(|at| from <= at && at < to)) {
            *counts.entry((&row.queue, row.state)).or_insert(0) += 1;
        }
        counts
            .into_iter()
            .map(|((queue, state), tasks)| FinishedCount { queue: queue.to_owned(), state, tasks })
            .collect()
    }

    /// What each worker holds now, by worker id (workers holding nothing left out).
    pub fn worker_loads(&self) -> Vec<WorkerLoad> {
        let mut loads: BTreeMap<&WorkerId, WorkerLoad> = BTreeMap::new();
        for row in self.live.values() {
            let (Some(worker), TaskState::Claimed | TaskState::Running) = (&row.claimed_by, row.state) else {
                continue;
            };
            let load =
                loads.entry(worker).or_insert_with(|| WorkerLoad { worker: worker.clone(), claimed: 0, running: 0 });
            match row.state {
                TaskState::Claimed => load.claimed += 1,
                _ => load.running += 1,
            }
        }
        loads.into_values().collect()
    }

    /// The worker registry, by worker id.
    pub fn workers(&self) -> Vec<WorkerRecord> {
        self.workers.values().cloned().collect()
    }

    /// Takes the notifications sent since the last call, in the order they were sent.
    pub fn take_notifications(&mut self) -> Vec<Notification> {
        std::mem::take(&mut self.notifications)
    }

    /// The earliest `run_at` among Pending tasks, past or future: a simulation compares it
    /// with its clock to skip ahead to the next time a task becomes claimable.
    pub fn next_run_at(&self) -> Option<DbTime> {
        self.pending_run_ats().min()
    }

    /// The earliest `run_at` after `now` among Pending tasks.
    pub fn next_run_at_after(&self, now: DbTime) -> Option<DbTime> {
        self.pending_run_ats().filter(|&at| at > now).min()
    }
}
