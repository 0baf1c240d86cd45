//! Results and inspection: a task's status, result or error; its attempts; waiting for it to
//! finish; listing and counting; the worker registry. Operator actions: cancel, requeue,
//! reschedule, complete or fail by hand, force-unlock a dead worker's tasks, remove a key,
//! purge old finished tasks, pause and resume queues.
//!
//! # Waiting for a result
//!
//! Finishing statements notify the schema's done channel
//! ([`PgSchema::done_channel`](crate::postgres::PgSchema::done_channel)) with the ids they
//! finished, while a waiter is registered for it (see [`register_listener`]: without waiters,
//! finishes send nothing). A waiter listens, registers, then reads the task, and re-reads it
//! after every notification naming it (a notification can arrive before its commit is visible
//! to another connection, so the notification itself is never trusted), until it is terminal
//! or the caller's timeout future resolves. Waiting is runtime-agnostic: the timeout is any
//! future (a runtime's sleep).
//!
//! [`PgStore::wait_result`] opens a listening connection per call. A process with many waiters
//! runs one [`DoneRouter`] instead: one listener routes each notification to the waiters of the
//! ids it names, and [`PgStore::wait_result_with`] waits through it.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use futures::channel::oneshot;
use futures::future::{Either, select};
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::{PgListener, PgRow};

use crate::config::is_valid_queue_name;
use crate::db::{AttemptRecord, DbTime, RunAt, TaskRecord, WorkerInfo};
use crate::memory::{
    AdminError, Cancelled, KeyRemoval, PausedQueue, Reschedule, TASK_CANCELLED_MESSAGE, TaskFilter, WorkerRecord,
};
use crate::postgres::listeners::{register_listener, unregister_listener};
use crate::postgres::replay::{Replay, replay_error_with_unknown_outcome, replayed};
use crate::postgres::store::{PgStore, count, db_time, duration, error_json, json, leniently, parse_state};
use crate::task::{Attempt, ErrorCode, TaskError, TaskId, TaskState, WorkerId};

/// A row of the attempts history: task, attempt, worker, outcome, error, finished at.
type AttemptRow = (i64, i32, Option<String>, String, Option<Value>, i64);

/// Why an operator action failed.
#[derive(Debug, thiserror::Error)]
pub enum PgAdminError {
    /// The task is missing or in a state the action does not apply to; nothing changed.
    #[error(transparent)]
    Refused(#[from] AdminError),
    /// The database failed; nothing changed, unless the action is one sent again after a lost
    /// reply (a pause, a resume, a force-unlock), whose first try may have.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The connection broke after the action was sent, with no reply: it may or may not have
    /// been applied (read the task to know).
    #[error("action may or may not have been applied: the connection broke before its reply ({0})")]
    OutcomeUnknown(sqlx::Error),
}

replay_error_with_unknown_outcome!(PgAdminError);

/// Why waiting for a result ended without one.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The timeout resolved first; the task may still finish later.
    #[error("timed out waiting for task {0}")]
    Timeout(TaskId),
    /// No task has this id.
    #[error("task {0} not found")]
    NotFound(TaskId),
    /// The database or the listening connection failed.
    #[error("database error while waiting: {0}")]
    Database(#[from] sqlx::Error),
}

impl WaitError {
    /// The error code callers see: `WAIT_TIMEOUT`, `TASK_NOT_FOUND` or `BROKER_ERROR`.
    pub fn code(&self) -> ErrorCode {
        match self {
            WaitError::Timeout(_) => ErrorCode::WaitTimeout,
            WaitError::NotFound(_) => ErrorCode::TaskNotFound,
            WaitError::Database(_) => ErrorCode::BrokerError,
        }
    }
}

impl PgStore {
    /// The task with this id, live or finished.
    pub async fn get(&self, id: TaskId) -> Result<Option<TaskRecord>, sqlx::Error> {
        let row = replayed!(self, Replay::Safe, |conn| sqlx::query(self.schema().sql().get.clone())
            .bind(id.0)
            .fetch_optional(conn))?;
        row.map(|row| record(&row)).transpose()
    }

    /// The attempts history of a task, oldest first (empty for an unknown id).
    pub async fn attempts(&self, id: TaskId) -> Result<Vec<AttemptRecord>, sqlx::Error> {
        let rows: Vec<AttemptRow> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_as(self.schema().sql().attempts.clone())
                .bind(id.0)
                .fetch_all(conn))?;
        rows.into_iter()
            .map(|(task, attempt, worker, outcome, error, finished_at)| {
                Ok(AttemptRecord {
                    task: TaskId(task),
                    attempt: Attempt(count(attempt)),
                    worker: worker.map(WorkerId),
                    outcome: parse_state(&outcome)?,
                    error: error.map(json).transpose()?,
                    finished_at: DbTime(finished_at),
                })
            })
            .collect()
    }

    /// The tasks `filter` selects, live and finished together, by id.
    pub async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, sqlx::Error> {
        let limit = filter.limit.map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX));
        let rows = replayed!(self, Replay::Safe, |conn| sqlx::query(self.schema().sql().list.clone())
            .bind(filter.queue.as_deref())
            .bind(filter.state.map(TaskState::as_str))
            .bind(limit)
            .fetch_all(conn))?;
        rows.iter().map(record).collect()
    }

    /// How many tasks each queue has in each state (pairs with none are left out).
    pub async fn counts(&self) -> Result<BTreeMap<(String, TaskState), u64>, sqlx::Error> {
        let rows: Vec<(String, String, i64)> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_as(self.schema().sql().counts.clone()).fetch_all(conn))?;
        let mut counts = BTreeMap::new();
        for (queue, state, n) in rows {
            *counts.entry((queue, parse_state(&state)?)).or_insert(0) += u64::try_from(n).unwrap_or(0);
        }
        Ok(counts)
    }

    /// The worker registry, by worker id.
    pub async fn workers(&self) -> Result<Vec<WorkerRecord>, sqlx::Error> {
        let rows: Vec<(String, Vec<String>, i32, i64, bool)> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_as(self.schema().sql().workers.clone()).fetch_all(conn))?;
        Ok(rows
            .into_iter()
            .map(|(id, queues, concurrency, last_seen, stopped)| WorkerRecord {
                info: WorkerInfo { worker: WorkerId(id), queues, concurrency: count(concurrency) },
                last_seen: DbTime(last_seen),
                stopped,
            })
            .collect())
    }

    /// Cancels a Pending or Claimed task: it becomes Cancelled with error `TASK_CANCELLED`
    /// (no attempt record), and its holder's later writes about it are reported lost.
    pub async fn cancel(&self, id: TaskId) -> Result<Cancelled, PgAdminError> {
        let sql = self.schema().sql();
        let error = error_json(&TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE))?;
        let done: Option<(i64, String, Option<String>)> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sqlx::query_as(sql.cancel.clone())
                .bind(id.0)
                .bind(&error)
                .bind(self.schema().done_channel())
                .fetch_optional(conn))?;
        if let Some((_, state, holder)) = done {
            return Ok(Cancelled::of(parse_state(&state)?, holder.map(WorkerId)));
        }
        Err(self.refusal(id, "PENDING or CLAIMED").await?.into())
    }

    /// Puts a Failed task back to Pending, claimable at once, with its retries reset to 0; its
    /// attempts, history and last error are kept.
    pub async fn requeue_failed(&self, id: TaskId) -> Result<(), PgAdminError> {
        let sql = self.schema().sql();
        let done: Option<i64> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sqlx::query_scalar(sql.requeue_failed.clone())
                .bind(id.0)
                .bind(self.schema().queue_channel_prefix())
                .fetch_optional(conn))?;
        if done.is_some() {
            return Ok(());
        }
        Err(self.refusal(id, "FAILED").await?.into())
    }

    /// Changes a Pending task's run-at, priority or retries spent (see [`Reschedule`]) in one
    /// statement; its key, attempts and history are kept, and its queue is notified. A task
    /// that is not Pending is refused with `WrongState`, a run-at at or past its good-until
    /// with `RunAtAfterGoodUntil`.
    pub async fn reschedule(&self, id: TaskId, change: Reschedule) -> Result<(), PgAdminError> {
        let (delay, at) = match change.run_at {
            None | Some(RunAt::Now) => (None, None),
            Some(RunAt::DelayMs(ms)) => (Some(duration(ms)), None),
            Some(RunAt::At(at)) => (None, Some(db_time(at))),
        };
        let sql = self.schema().sql();
        let row: Option<(String, i64, Option<i64>, bool)> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sqlx::query_as(sql.reschedule.clone())
                .bind(id.0)
                .bind(change.run_at.is_some())
                .bind(delay)
                .bind(at)
                .bind(change.priority)
                .bind(change.retries.map(|n| i32::try_from(n).unwrap_or(i32::MAX)))
                .bind(self.schema().queue_channel_prefix())
                .fetch_optional(conn))?;
        match row {
            Some((_, _, _, true)) => Ok(()),
            Some((state, run_at, good_until, false)) => match parse_state(&state)? {
                TaskState::Pending => Err(AdminError::RunAtAfterGoodUntil {
                    task: id,
                    run_at,
                    good_until: good_until.unwrap_or_default(),
                }
                .into()),
                state => Err(AdminError::WrongState { task: id, state, expected: "PENDING" }.into()),
            },
            None => Err(self.refusal(id, "PENDING").await?.into()),
        }
    }

    /// Completes a Pending, Claimed or Running task by hand with `result`, in one statement:
    /// it moves to the finished table (no retry), its holder's later writes are reported lost
    /// and waiters are notified. A run it was in is its last run, kept on the finished row.
    pub async fn complete(&self, id: TaskId, result: Value) -> Result<(), PgAdminError> {
        self.finish_by_hand(id, TaskState::Completed, None, Some(result)).await
    }

    /// Fails a Pending, Claimed or Running task by hand with `FAILED_BY_OPERATOR` and
    /// `message`, with no retry; otherwise as [`complete`](PgStore::complete).
    pub async fn fail(&self, id: TaskId, message: &str) -> Result<(), PgAdminError> {
        let error = error_json(&TaskError::new(ErrorCode::FailedByOperator, message))?;
        self.finish_by_hand(id, TaskState::Failed, Some(error), None).await
    }

    async fn finish_by_hand(
        &self,
        id: TaskId,
        state: TaskState,
        error: Option<Value>,
        result: Option<Value>,
    ) -> Result<(), PgAdminError> {
        let sql = self.schema().sql();
        let done: Option<i64> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sqlx::query_scalar(sql.finish_by_hand.clone())
                .bind(id.0)
                .bind(state.as_str())
                .bind(&error)
                .bind(&result)
                .bind(self.schema().done_channel())
                .fetch_optional(conn))?;
        if done.is_some() {
            return Ok(());
        }
        Err(self.refusal(id, "PENDING, CLAIMED or RUNNING").await?.into())
    }

    /// Hands the Claimed and Running tasks of dead `workers` back to Pending in one statement,
    /// as a release by their holder would: claimable at once, no retry spent, the holder's
    /// later writes reported lost, each queue concerned notified. Registered workers among
    /// them are marked stopped. Returns how many tasks went back.
    pub async fn force_unlock(&self, workers: &[WorkerId]) -> Result<u64, sqlx::Error> {
        let ids: Vec<&str> = workers.iter().map(|w| w.0.as_str()).collect();
        let n: i64 =
            replayed!(self, Replay::Safe, |conn| sqlx::query_scalar(self.schema().sql().force_unlock.clone())
                .bind(&ids)
                .bind(self.schema().queue_channel_prefix())
                .fetch_one(conn))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Frees idempotency key `key` in one statement: the task holding it is Cancelled if
    /// Pending (waiters are notified), runs on without it if Claimed or Running (its row is not
    /// written), and simply loses it if finished. Refused with `KeyNotFound` when no task
    /// holds it. It waits its turn with the key's enqueuers (the key's advisory lock, then
    /// rows, in their order), so the two never deadlock.
    pub async fn remove_key(&self, key: &str) -> Result<KeyRemoval, PgAdminError> {
        let error = error_json(&TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE))?;
        let sql = self.schema().sql();
        let row: Option<(i64, String)> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sqlx::query_as(sql.remove_key.clone())
                .bind(key)
                .bind(&error)
                .bind(self.schema().done_channel())
                .bind(self.schema().key_lock_prefix())
                .fetch_optional(conn))?;
        let Some((id, action)) = row else {
            return Err(AdminError::KeyNotFound(key.to_owned()).into());
        };
        let id = TaskId(id);
        Ok(match action.as_str() {
            "cancelled" => KeyRemoval::Cancelled(id),
            "detached" => KeyRemoval::Detached(id),
            _ => KeyRemoval::Freed(id),
        })
    }

    /// Deletes finished tasks that finished more than `retention_ms` ago, with their attempts
    /// history and the keys they hold, `batch` tasks per statement (each its own transaction,
    /// locking only that batch, skipping rows another session holds) until a batch comes back
    /// short. Returns how many. A `batch` of 0 is taken as 1. Tasks that hold an idempotency
    /// key stay for the store's `recovery.idempotency_retention_ms` (forever by default).
    pub async fn purge_finished(&self, retention_ms: u64, batch: u32) -> Result<u64, sqlx::Error> {
        // Deleting what is deleted already deletes nothing (the count then leaves it out).
        replayed!(self, Replay::Safe, |conn| self.purge_on(conn, retention_ms, batch))
    }

    /// Pauses `queue`: from the next claim on, no worker takes its Pending tasks (its Claimed
    /// and Running ones go on). Returns whether it was running before; pausing a paused queue
    /// keeps its first pause time. Any valid queue name may be paused, configured or not.
    pub async fn pause_queue(&self, queue: &str) -> Result<bool, PgAdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()).into());
        }
        let row: Option<String> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_scalar(self.schema().sql().pause_queue.clone())
                .bind(queue)
                .fetch_optional(conn))?;
        Ok(row.is_some())
    }

    /// Resumes a paused `queue` and notifies it, so waiting workers claim its tasks. Returns
    /// whether it was paused.
    pub async fn resume_queue(&self, queue: &str) -> Result<bool, PgAdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()).into());
        }
        let row: Option<String> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_scalar(self.schema().sql().resume_queue.clone())
                .bind(queue)
                .bind(self.schema().queue_channel_prefix())
                .fetch_optional(conn))?;
        Ok(row.is_some())
    }

    /// The paused queues, by name.
    pub async fn paused_queues(&self) -> Result<Vec<PausedQueue>, sqlx::Error> {
        let rows: Vec<(String, i64)> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_as(self.schema().sql().paused_queues.clone())
                .fetch_all(conn))?;
        Ok(rows.into_iter().map(|(queue, at)| PausedQueue { queue, paused_at: DbTime(at) }).collect())
    }

    /// Why an action found nothing to change: the task is missing or in another state.
    async fn refusal(&self, id: TaskId, expected: &'static str) -> Result<AdminError, sqlx::Error> {
        let state: Option<String> =
            replayed!(self, Replay::Safe, |conn| sqlx::query_scalar(self.schema().sql().state_of.clone())
                .bind(id.0)
                .fetch_optional(conn))?;
        Ok(match state {
            None => AdminError::NotFound(id),
            Some(state) => AdminError::WrongState { task: id, state: parse_state(&state)?, expected },
        })
    }

    /// Waits until the task is terminal and returns it, or fails with [`WaitError::Timeout`]
    /// when `timeout` resolves first. Opens its own listening connection for the wait, which
    /// registers as a waiter (a moment's exclusive lock that finishing statements wait
    /// behind); see [`wait_result_with`](PgStore::wait_result_with) to share one.
    ///
    /// A wait that ends by itself deletes its registration before the connection goes back to
    /// the pool; one cut short by `timeout` leaves it until that session ends or registers
    /// again (finishes meanwhile notify for nobody, the cost of every finish before schema 8),
    /// since nothing may wait after the caller's timeout.
    pub async fn wait_result(&self, id: TaskId, timeout: impl Future<Output = ()>) -> Result<TaskRecord, WaitError> {
        let wait = async {
            let channels = [self.schema().done_channel()];
            let mut listener = PgListener::connect_with(self.pool()).await?;
            listener.listen(&channels[0]).await?;
            register_listener(&mut listener, self.schema(), &channels).await?;
            let found = self.wait_listening(&mut listener, &channels, id).await;
            // Best effort: a session that cannot be reached takes its registration with it.
            let _ = unregister_listener(&mut listener, self.schema()).await;
            found
        };
        race(wait, timeout, id).await
    }

    /// Reads the task until it is terminal, again after every notification naming it and
    /// after every reconnect of `listener` (a new session, registered again: notifications may
    /// have been missed).
    async fn wait_listening(
        &self,
        listener: &mut PgListener,
        channels: &[String],
        id: TaskId,
    ) -> Result<TaskRecord, WaitError> {
        loop {
            // Read after listening, so a finish between the two is not missed.
            if let Some(record) = self.terminal(id).await? {
                return Ok(record);
            }
            loop {
                match listener.try_recv().await? {
                    None => {
                        register_listener(listener, self.schema(), channels).await?;
                        break;
                    }
                    Some(note) if names(note.payload(), id) => break,
                    Some(_) => {}
                }
            }
        }
    }

    /// Waits like [`wait_result`](PgStore::wait_result), through a shared [`DoneRouter`]
    /// (whose [`run`](DoneRouter::run) must be driven for waits to see notifications).
    pub async fn wait_result_with(
        &self,
        router: &DoneRouter,
        id: TaskId,
        timeout: impl Future<Output = ()>,
    ) -> Result<TaskRecord, WaitError> {
        let wait = async {
            loop {
                // Subscribe before reading, so a finish between the two is not missed.
                let signal = router.subscribe(id);
                if let Some(record) = self.terminal(id).await? {
                    return Ok(record);
                }
                signal.await;
            }
        };
        race(wait, timeout, id).await
    }

    /// The task if it is terminal; `NotFound` if it does not exist.
    async fn terminal(&self, id: TaskId) -> Result<Option<TaskRecord>, WaitError> {
        match self.get(id).await? {
            None => Err(WaitError::NotFound(id)),
            Some(record) if record.state.is_terminal() => Ok(Some(record)),
            Some(_) => Ok(None),
        }
    }
}

async fn race<T>(
    wait: impl Future<Output = Result<T, WaitError>>,
    timeout: impl Future<Output = ()>,
    id: TaskId,
) -> Result<T, WaitError> {
    match select(pin!(wait), pin!(timeout)).await {
        Either::Left((result, _)) => result,
        Either::Right(((), _)) => Err(WaitError::Timeout(id)),
    }
}

/// Whether a done-channel payload (comma-separated ids) names `id`.
fn names(payload: &str, id: TaskId) -> bool {
    payload.split(',').any(|part| part.trim().parse::<i64>() == Ok(id.0))
}

/// Routes done-channel notifications from one listening connection to many waiters.
///
/// Cheap to clone (one shared table of waiters). Drive [`run`](DoneRouter::run) on a task of
/// your runtime; waiters [`subscribe`](DoneRouter::subscribe) to an id and are woken when a
/// notification names it, and all of them are woken whenever the listening connection was
/// re-established (notifications may have been lost meanwhile). A [`DoneSignal`] leaves the
/// table when it is dropped, woken or not, so waits that end by a result, a timeout or a
/// dropped future leave nothing behind.
#[derive(Debug, Clone, Default)]
pub struct DoneRouter {
    waiters: Arc<Mutex<Waiters>>,
}

/// The waiters of each task, by subscription number.
#[derive(Debug, Default)]
struct Waiters {
    next: u64,
    by_task: BTreeMap<TaskId, BTreeMap<u64, oneshot::Sender<()>>>,
}

/// Resolves when a notification names the subscribed task, or when every waiter is woken.
/// Dropping it unsubscribes.
#[derive(Debug)]
pub struct DoneSignal {
    receiver: oneshot::Receiver<()>,
    router: Weak<Mutex<Waiters>>,
    task: TaskId,
    number: u64,
}

impl Future for DoneSignal {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        // A dropped sender (the router gone) wakes the waiter too: it re-reads.
        std::pin::Pin::new(&mut self.receiver).poll(cx).map(|_| ())
    }
}

impl Drop for DoneSignal {
    fn drop(&mut self) {
        let Some(waiters) = self.router.upgrade() else { return };
        let mut waiters = waiters.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(list) = waiters.by_task.get_mut(&self.task) {
            list.remove(&self.number);
            if list.is_empty() {
                waiters.by_task.remove(&self.task);
            }
        }
    }
}

impl DoneRouter {
    /// A router with no waiters.
    pub fn new() -> Self {
        DoneRouter::default()
    }

    /// A signal for the next notification naming `id`.
    pub fn subscribe(&self, id: TaskId) -> DoneSignal {
        let (sender, receiver) = oneshot::channel();
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let number = waiters.next;
        waiters.next = waiters.next.wrapping_add(1);
        waiters.by_task.entry(id).or_default().insert(number, sender);
        DoneSignal { receiver, router: Arc::downgrade(&self.waiters), task: id, number }
    }

    /// Wakes the waiters of every id a done-channel payload names.
    pub fn deliver(&self, payload: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        for part in payload.split(',') {
            if let Ok(id) = part.trim().parse::<i64>() {
                for sender in waiters.by_task.remove(&TaskId(id)).unwrap_or_default().into_values() {
                    let _ = sender.send(());
                }
            }
        }
    }

    /// Wakes every waiter (after a reconnect, when notifications may have been lost).
    pub fn wake_all(&self) {
        let by_task = std::mem::take(&mut self.waiters.lock().unwrap_or_else(PoisonError::into_inner).by_task);
        for sender in by_task.into_values().flat_map(BTreeMap::into_values) {
            let _ = sender.send(());
        }
    }

    /// How many tasks have waiters.
    pub fn waiting(&self) -> usize {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner).by_task.len()
    }

    /// Listens on `store`'s done channel and routes notifications until the listener fails
    /// for good (it reconnects by itself on a lost connection, waking every waiter). Its
    /// session registers as a waiter (see [`register_listener`]) and stays registered until
    /// that session ends, even when this future is dropped and the session goes back to the
    /// pool: finishes then notify for nobody, as they all did before schema 8.
    pub async fn run(&self, store: &PgStore) -> Result<(), sqlx::Error> {
        let channels = [store.schema().done_channel()];
        let mut listener = PgListener::connect_with(store.pool()).await?;
        listener.listen(&channels[0]).await?;
        register_listener(&mut listener, store.schema(), &channels).await?;
        // Waiters that subscribed before the listener was up re-read now.
        self.wake_all();
        loop {
            match listener.try_recv().await? {
                Some(note) => self.deliver(note.payload()),
                None => {
                    register_listener(&mut listener, store.schema(), &channels).await?;
                    self.wake_all();
                }
            }
        }
    }
}

/// A [`TaskRecord`] from a row of the `get`/`list` statements.
fn record(row: &PgRow) -> Result<TaskRecord, sqlx::Error> {
    let state = parse_state(row.try_get("state")?)?;
    let held = matches!(state, TaskState::Claimed | TaskState::Running);
    let claimed_by: Option<String> = row.try_get("claimed_by")?;
    // One row whose arguments cannot be read fails neither a listing nor a wait.
    let (args, args_error) = match leniently::<Value>(row, "args")? {
        Ok(args) => (args, None),
        Err(problem) => (Value::Null, Some(problem)),
    };
    Ok(TaskRecord {
        id: TaskId(row.try_get("id")?),
        name: row.try_get("name")?,
        queue: row.try_get("queue")?,
        state,
        priority: row.try_get("priority")?,
        args,
        args_error,
        attempts: count(row.try_get("attempts")?),
        retries: count(row.try_get("retries")?),
        enqueued_at: DbTime(row.try_get("enqueued_at")?),
        run_at: DbTime(row.try_get("run_at")?),
        good_until: row.try_get::<Option<i64>, _>("good_until")?.map(DbTime),
        finished_at: row.try_get::<Option<i64>, _>("finished_at")?.map(DbTime),
        worker: if held { claimed_by.map(WorkerId) } else { None },
        result: row.try_get("result")?,
        error: row.try_get::<Option<Value>, _>("error")?.map(json).transpose()?,
        key: row.try_get("key")?,
        flags: row.try_get::<Option<Vec<String>>, _>("flags")?.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_name_ids() {
        assert!(names("1,22,333", TaskId(22)));
        assert!(!names("1,22,333", TaskId(2)));
        assert!(!names("", TaskId(0)));
    }

    #[test]
    fn the_router_wakes_named_waiters_only() {
        let router = DoneRouter::new();
        let mut one = router.subscribe(TaskId(1));
        let mut two = router.subscribe(TaskId(2));
        router.deliver("1,3");
        assert_eq!(one.receiver.try_recv(), Ok(Some(())));
        assert_eq!(two.receiver.try_recv(), Ok(None));
        router.wake_all();
        assert_eq!(two.receiver.try_recv(), Ok(Some(())));
        assert_eq!(router.waiting(), 0);
    }

    #[test]
    fn dropped_signals_leave_the_router() {
        let router = DoneRouter::new();
        // Never woken (a wait that timed out or was dropped).
        for _ in 0..1_000 {
            drop(router.subscribe(TaskId(7)));
        }
        let kept = router.subscribe(TaskId(7));
        let other = router.subscribe(TaskId(8));
        assert_eq!(router.waiting(), 2);
        drop(kept);
        assert_eq!(router.waiting(), 1, "a task whose last waiter left has no entry");
        // Woken, then dropped after the router let go of it.
        router.deliver("8");
        drop(other);
        assert_eq!(router.waiting(), 0);
        // A signal outliving its router is just dropped.
        let orphan = DoneRouter::new().subscribe(TaskId(1));
        drop(orphan);
    }
}
