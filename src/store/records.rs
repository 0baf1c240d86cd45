//! What inspection reads: tasks ([`TaskRecord`]), their runs ([`AttemptRecord`]), workers
//! ([`WorkerRecord`]), paused queues ([`PausedQueue`]), and which tasks to list
//! ([`TaskFilter`]).

use serde::{Deserialize, Serialize};

use crate::store::WorkerInfo;
use crate::task::{Attempt, DbTime, TaskError, TaskId, TaskState, WorkerId};

/// A task as inspection shows it: its row in the live table or the finished table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// The task.
    pub id: TaskId,
    /// Its handler name.
    pub name: String,
    /// Its queue.
    pub queue: String,
    /// Its state.
    pub state: TaskState,
    /// Its priority.
    pub priority: i16,
    /// Its arguments (`null` when they could not be read: see `args_error`).
    pub args: serde_json::Value,
    /// Why the stored arguments could not be read (nested deeper than a reader decodes, a
    /// number out of range), if they could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_error: Option<String>,
    /// Runs started.
    pub attempts: u32,
    /// Retries spent.
    pub retries: u32,
    /// When it was enqueued.
    pub enqueued_at: DbTime,
    /// When it is (or was) claimable.
    pub run_at: DbTime,
    /// When it expires.
    pub good_until: Option<DbTime>,
    /// When it reached a terminal state.
    pub finished_at: Option<DbTime>,
    /// The worker holding it, while Claimed or Running.
    pub worker: Option<WorkerId>,
    /// Its result, once Completed.
    pub result: Option<serde_json::Value>,
    /// Its last error: the final one once Failed, Expired or Cancelled, the latest retried
    /// one while it waits for its next run.
    pub error: Option<TaskError>,
    /// Its key, while it holds one.
    pub key: Option<String>,
    /// Its flags, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<String>,
}

/// One finished run of a task, as the attempts history keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The task.
    pub task: TaskId,
    /// Which run.
    pub attempt: Attempt,
    /// Who ran it.
    pub worker: Option<WorkerId>,
    /// What the task became: Completed, Failed, or Pending when it will be retried.
    pub outcome: TaskState,
    /// The error, if it failed.
    pub error: Option<TaskError>,
    /// When the run ended.
    pub finished_at: DbTime,
}

/// A paused queue: no claim takes its Pending tasks until it is resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedQueue {
    /// The queue.
    pub queue: String,
    /// Since when (the first pause, if it was paused again).
    pub paused_at: DbTime,
}

/// Which tasks a list returns ([`MemoryStore::list`](crate::memory::MemoryStore::list)), in
/// what order; the default lists them all, oldest (lowest id) first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Only tasks of this queue.
    pub queue: Option<String>,
    /// Only tasks in this state.
    pub state: Option<TaskState>,
    /// Only tasks of this name.
    pub name: Option<String>,
    /// Only tasks enqueued at or after this time.
    pub enqueued_from: Option<DbTime>,
    /// Only tasks enqueued before this time.
    pub enqueued_before: Option<DbTime>,
    /// Only tasks past this id in the listing's order: below it newest first, above it oldest
    /// first (the last id of a page gives the next page, however many tasks came and went).
    pub after: Option<TaskId>,
    /// Newest (highest id) first instead of oldest first.
    pub newest_first: bool,
    /// Skip this many of the matching tasks first.
    pub offset: usize,
    /// At most this many.
    pub limit: Option<usize>,
}

/// A worker as the registry knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// What it registered (empty queues and concurrency 0 if it only ever sent heartbeats).
    pub info: WorkerInfo,
    /// Its last registration or heartbeat.
    pub last_seen: DbTime,
    /// Whether it deregistered (and did not register again since).
    pub stopped: bool,
}

/// The live tasks of one queue by state: what [`queue_depths`] reads (the live table only, a
/// cheap read however much history there is).
///
/// [`queue_depths`]: crate::memory::MemoryStore::queue_depths
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueDepth {
    /// The queue.
    pub queue: String,
    /// Pending tasks claimable now.
    pub due: u64,
    /// Pending tasks whose run-at is still ahead.
    pub scheduled: u64,
    /// Tasks claimed and not started.
    pub claimed: u64,
    /// Tasks running.
    pub running: u64,
    /// The run-at of its oldest claimable Pending task: how long the queue's work has waited.
    pub oldest_due: Option<DbTime>,
}

/// How many tasks of one queue reached one terminal state in a span of time: what a dashboard
/// adds up for its throughput (see `PgStore::finished_counts`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedCount {
    /// The queue.
    pub queue: String,
    /// The terminal state.
    pub state: TaskState,
    /// How many.
    pub tasks: u64,
}

/// What one worker holds now: its Claimed and Running tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The worker.
    pub worker: WorkerId,
    /// Tasks it claimed and has not started.
    pub claimed: u64,
    /// Tasks it runs.
    pub running: u64,
}
