//! The operator vocabulary: every action an operator takes on tasks and queues, as data
//! ([`AdminRequest`]), what it did ([`AdminReply`]) and why it was refused ([`AdminError`]).
//! Each store applies it in one place (`MemoryStore::admin`, `PgStore::admin`); the client,
//! the command line and the conformance suite send these values.

use serde::{Deserialize, Serialize};

use crate::store::RunAt;
use crate::task::{QUEUE_NAME_RULE, TaskId, TaskState, WorkerId};

/// The message of the error a task gets when it is cancelled.
pub const TASK_CANCELLED_MESSAGE: &str = "task cancelled";

/// The message of a task failed by hand when the operator gives none.
pub const FAILED_BY_OPERATOR_MESSAGE: &str = "failed by an operator";

/// An operator's action on tasks or queues. Each store applies one with its `admin` method
/// (`MemoryStore::admin`, `PgStore::admin`) and answers the [`AdminReply`] the variant names,
/// or refuses it with an [`AdminError`] and changes nothing. Adding an action is a variant
/// here, an arm in each store's `admin.rs` (and its SQL), and the reply it gives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AdminRequest {
    /// Cancels a Pending or Claimed task: it becomes Cancelled with error `TASK_CANCELLED`
    /// (no attempt record), and its holder's later writes about it are reported lost. Replies
    /// [`AdminReply::Cancelled`].
    Cancel {
        /// The task.
        task: TaskId,
    },
    /// Puts a Failed task back to Pending, claimable at once, with its retries reset to 0; its
    /// attempts, history and last error are kept. Replies [`AdminReply::Done`].
    Retry {
        /// The task.
        task: TaskId,
    },
    /// Changes a Pending task's run-at, priority or retries spent; its key, attempts and
    /// history are kept, and its queue is notified. Replies [`AdminReply::Done`].
    Reschedule {
        /// The task.
        task: TaskId,
        /// What changes.
        change: Reschedule,
    },
    /// Completes a Pending, Claimed or Running task by hand with `result`: it is finished (no
    /// retry), its holder's later writes are reported lost and waiters are notified. A run it
    /// was in counts as its last run. Replies [`AdminReply::Done`].
    Complete {
        /// The task.
        task: TaskId,
        /// Its result.
        result: serde_json::Value,
    },
    /// Fails a Pending, Claimed or Running task by hand with `FAILED_BY_OPERATOR` and
    /// `message`, with no retry; otherwise as [`Complete`](AdminRequest::Complete). Replies
    /// [`AdminReply::Done`].
    Fail {
        /// The task.
        task: TaskId,
        /// The error's message.
        message: String,
    },
    /// Hands the Claimed and Running tasks of dead `workers` back to Pending, as a release by
    /// their holder would: claimable at once, no retry spent, the holder's later writes
    /// reported lost, each queue concerned notified. Registered workers among them are marked
    /// stopped. Replies [`AdminReply::Released`].
    ForceUnlock {
        /// The dead workers.
        workers: Vec<WorkerId>,
    },
    /// Frees idempotency key `key`: the task holding it is Cancelled if Pending, runs on
    /// without it if Claimed or Running, and simply loses it if finished. Replies
    /// [`AdminReply::KeyRemoved`].
    RemoveKey {
        /// The key.
        key: String,
    },
    /// Deletes finished tasks that finished more than `retention_ms` ago, with their attempts
    /// history and the keys they hold; tasks that hold an idempotency key stay for the app's
    /// `recovery.idempotency_retention_ms` (forever by default). Replies
    /// [`AdminReply::Purged`].
    Purge {
        /// How long finished tasks are kept.
        retention_ms: u64,
        /// How many tasks one statement deletes (PostgreSQL: each its own transaction; 0 is
        /// taken as 1). The memory store deletes them all at once.
        batch: u32,
    },
    /// Deletes a finished (Completed, Failed, Cancelled, Expired or Skipped) task with its
    /// attempts history and the idempotency key it holds, as a purge would. Replies
    /// [`AdminReply::Done`].
    Delete {
        /// The task.
        task: TaskId,
    },
    /// Pauses `queue`: from the next claim on, no worker takes its Pending tasks (its Claimed
    /// and Running ones go on). Any valid queue name may be paused, configured or not; a
    /// paused queue keeps its first pause time. Replies [`AdminReply::Paused`].
    Pause {
        /// The queue.
        queue: String,
    },
    /// Resumes a paused `queue` and notifies it, so waiting workers claim its tasks. Replies
    /// [`AdminReply::Resumed`].
    Resume {
        /// The queue.
        queue: String,
    },
}

/// What an [`AdminRequest`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AdminReply {
    /// [`AdminRequest::Cancel`]: what the cancel found.
    Cancelled {
        /// A task that never ran, or one a worker had claimed.
        found: Cancelled,
    },
    /// [`AdminRequest::Retry`], [`Reschedule`](AdminRequest::Reschedule),
    /// [`Complete`](AdminRequest::Complete), [`Fail`](AdminRequest::Fail),
    /// [`Delete`](AdminRequest::Delete): applied.
    Done,
    /// [`AdminRequest::ForceUnlock`]: how many tasks went back to Pending.
    Released {
        /// The tasks handed back.
        tasks: u64,
    },
    /// [`AdminRequest::RemoveKey`]: what became of the task that held the key.
    KeyRemoved {
        /// The task and what was done to it.
        removal: KeyRemoval,
    },
    /// [`AdminRequest::Purge`]: how many finished tasks were deleted.
    Purged {
        /// The tasks deleted.
        tasks: u64,
    },
    /// [`AdminRequest::Pause`]: whether the queue was running before.
    Paused {
        /// False if it was paused already.
        was_running: bool,
    },
    /// [`AdminRequest::Resume`]: whether the queue was paused.
    Resumed {
        /// False if it was not paused.
        was_paused: bool,
    },
}

impl AdminRequest {
    /// The action's name, as the command line and logs say it.
    pub fn name(&self) -> &'static str {
        match self {
            AdminRequest::Cancel { .. } => "cancel",
            AdminRequest::Retry { .. } => "retry",
            AdminRequest::Reschedule { .. } => "reschedule",
            AdminRequest::Complete { .. } => "complete",
            AdminRequest::Fail { .. } => "fail",
            AdminRequest::ForceUnlock { .. } => "force-unlock",
            AdminRequest::RemoveKey { .. } => "remove-key",
            AdminRequest::Purge { .. } => "purge",
            AdminRequest::Delete { .. } => "delete",
            AdminRequest::Pause { .. } => "pause",
            AdminRequest::Resume { .. } => "resume",
        }
    }
}

/// What a cancel found: a task that never ran, or one a worker had claimed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "was", rename_all = "snake_case")]
pub enum Cancelled {
    /// It was Pending: it never ran and never will.
    Pending,
    /// It was Claimed by `worker`, which may already run it: in soft-cap mode a buffered
    /// task of a queue without a cap starts without telling the store. Such a run goes on to
    /// its end, and its outcome is not recorded (its writes are fenced); its side effects
    /// happen all the same.
    Claimed {
        /// The worker that held the claim.
        worker: WorkerId,
    },
}

impl Cancelled {
    /// What a cancel of a row in `state`, held by `holder`, found.
    pub fn of(state: TaskState, holder: Option<WorkerId>) -> Cancelled {
        match (state, holder) {
            (TaskState::Claimed, Some(worker)) => Cancelled::Claimed { worker },
            _ => Cancelled::Pending,
        }
    }
}

/// The states [`AdminRequest::Delete`] applies to, as its refusal says them.
pub const FINISHED_STATES: &str = "finished (COMPLETED, FAILED, CANCELLED, EXPIRED or SKIPPED)";

/// Why an operator action was refused. Nothing is changed when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// No task has this id.
    #[error("task {0} not found")]
    NotFound(TaskId),
    /// The task is in a state the action does not apply to.
    #[error("task {task} is {state}: expected {expected}")]
    WrongState {
        /// The task.
        task: TaskId,
        /// The state it is in.
        state: TaskState,
        /// The states the action applies to.
        expected: &'static str,
    },
    /// No task holds this idempotency key.
    #[error("no task holds idempotency key {0:?}")]
    KeyNotFound(String),
    /// The task is a workflow's step: only its workflow is retried, so that its children's
    /// counts follow.
    #[error("task {task} is a step of workflow {workflow}: retry the workflow instead")]
    WorkflowStep {
        /// The task.
        task: TaskId,
        /// Its workflow.
        workflow: crate::store::WorkflowId,
    },
    /// A reschedule would set more retries spent than a task can have.
    #[error("invalid retries spent {0}: expected 0 to {MAX_RETRIES_SPENT}")]
    InvalidRetries(u32),
    /// A reschedule would make the task claimable only after it expires.
    #[error(
        "task {task}: run_at {} is not before its good_until {}: it could never run",
        crate::time::format_instant_ms(*.run_at),
        crate::time::format_instant_ms(*.good_until)
    )]
    RunAtAfterGoodUntil {
        /// The task.
        task: TaskId,
        /// When it would become claimable.
        run_at: i64,
        /// When it expires.
        good_until: i64,
    },
    /// The queue name has characters or a length queues cannot have.
    #[error("invalid queue name {0:?}: expected {QUEUE_NAME_RULE}")]
    InvalidQueueName(String),
}

/// What [`AdminRequest::Reschedule`] changes on a Pending task; `None` fields are kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reschedule {
    /// When it becomes claimable, resolved on the store's clock as at enqueue (a past time
    /// means at once).
    pub run_at: Option<RunAt>,
    /// Its new priority (lower runs first).
    pub priority: Option<i16>,
    /// Its retries spent, e.g. 0 for a fresh retry budget (at most [`MAX_RETRIES_SPENT`]).
    /// Attempts are never reset: they count runs started.
    pub retries: Option<u32>,
}

/// The most retries a task can have spent (the SQL column is an `integer`).
pub const MAX_RETRIES_SPENT: u32 = i32::MAX as u32;

impl Reschedule {
    /// Refuses a change no task can take, before any store looks at the task.
    pub fn check(&self) -> Result<(), AdminError> {
        match self.retries {
            Some(retries) if retries > MAX_RETRIES_SPENT => Err(AdminError::InvalidRetries(retries)),
            _ => Ok(()),
        }
    }
}

/// What [`AdminRequest::RemoveKey`] did with the task holding the key; in every case the key
/// is free for a new task and the task no longer shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", content = "task", rename_all = "snake_case")]
pub enum KeyRemoval {
    /// The task was Pending: it is Cancelled.
    Cancelled(TaskId),
    /// The task is Claimed or Running: it runs on without the key.
    Detached(TaskId),
    /// The task had finished.
    Freed(TaskId),
}

impl KeyRemoval {
    /// The task that held the key.
    pub fn task(self) -> TaskId {
        match self {
            KeyRemoval::Cancelled(id) | KeyRemoval::Detached(id) | KeyRemoval::Freed(id) => id,
        }
    }
}
