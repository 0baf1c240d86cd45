//! Operator actions on PostgreSQL: each [`AdminRequest`] in one statement, refused with the
//! same [`AdminError`] as the memory store's.

use serde_json::Value;

use crate::postgres::replay::{Replay, replay_error_with_unknown_outcome, replayed};
use crate::postgres::sql::Statements;
use crate::postgres::store::{PgStore, db_time, duration, error_json, parse_state};
use crate::store::RunAt;
use crate::store::{
    AdminError, AdminReply, AdminRequest, Cancelled, FINISHED_STATES, KeyRemoval, Reschedule, TASK_CANCELLED_MESSAGE,
};
use crate::task::is_valid_queue_name;
use crate::task::{ErrorCode, TaskError, TaskId, TaskState, WorkerId};

/// Why an operator action failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgAdminError {
    /// The task is missing or in a state the action does not apply to; nothing changed.
    #[error(transparent)]
    Refused(#[from] AdminError),
    /// The database failed; nothing changed, unless the action is one sent again after a lost
    /// reply (a pause, a resume, a force-unlock), whose first try may have.
    #[error("database error: {}", super::error_text(.0))]
    Database(#[from] sqlx::Error),
    /// The connection broke after the action was sent, with no reply: it may or may not have
    /// been applied (read the task to know).
    #[error("action may or may not have been applied: the connection broke before its reply ({})", super::error_text(.0))]
    OutcomeUnknown(sqlx::Error),
}

replay_error_with_unknown_outcome!(PgAdminError);

/// Promotes task `id` if it waits behind an open gate (migration 0018), so that the statement
/// after it on `conn` acts on the row as the Pending one readers see.
async fn promote_opened(sql: &Statements, conn: &mut sqlx::PgConnection, id: TaskId) -> Result<(), sqlx::Error> {
    sql.promote_opened.query().bind(id.0).execute(conn).await.map(|_| ())
}

impl PgStore {
    /// Applies an operator's action (see [`AdminRequest`] for what each does and replies),
    /// each in one statement; a refused one changes nothing.
    pub async fn admin(&self, request: &AdminRequest) -> Result<AdminReply, PgAdminError> {
        Ok(match request {
            AdminRequest::Cancel { task } => AdminReply::Cancelled { found: self.cancel_task(*task).await? },
            AdminRequest::Retry { task } => self.retry_failed(*task).await.map(|()| AdminReply::Done)?,
            AdminRequest::Reschedule { task, change } => {
                self.reschedule_task(*task, *change).await.map(|()| AdminReply::Done)?
            }
            AdminRequest::Complete { task, result } => {
                self.finish_by_hand(*task, TaskState::Completed, None, Some(result.clone())).await?;
                AdminReply::Done
            }
            AdminRequest::Fail { task, message } => {
                let error = error_json(&TaskError::new(ErrorCode::FailedByOperator, message))?;
                self.finish_by_hand(*task, TaskState::Failed, Some(error), None).await?;
                AdminReply::Done
            }
            AdminRequest::ForceUnlock { workers } => {
                AdminReply::Released { tasks: self.unlock_workers(workers).await? }
            }
            AdminRequest::RemoveKey { key } => AdminReply::KeyRemoved { removal: self.free_key(key).await? },
            AdminRequest::Purge { retention_ms, batch } => {
                // Deleting what is deleted already deletes nothing (the count then leaves it out).
                let tasks = replayed!(@transaction false, self, Replay::Safe, |conn| self.purge_on(
                    conn,
                    *retention_ms,
                    *batch
                ))?;
                AdminReply::Purged { tasks }
            }
            AdminRequest::Delete { task } => self.delete_finished(*task).await.map(|()| AdminReply::Done)?,
            AdminRequest::Pause { queue } => AdminReply::Paused { was_running: self.pause(queue).await? },
            AdminRequest::Resume { queue } => AdminReply::Resumed { was_paused: self.resume(queue).await? },
        })
    }

    /// Cancels a Pending or Claimed task: it becomes Cancelled with error `TASK_CANCELLED`
    /// (no attempt record), and its holder's later writes about it are reported lost.
    async fn cancel_task(&self, id: TaskId) -> Result<Cancelled, PgAdminError> {
        let sql = self.schema().sql();
        let error = error_json(&TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE))?;
        let done: Option<(i64, String, Option<String>)> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| async {
                promote_opened(sql, conn, id).await?;
                sql.cancel
                    .query_as()
                    .bind(id.0)
                    .bind(&error)
                    .bind(self.schema().done_channel())
                    .fetch_optional(&mut *conn)
                    .await
            })?;
        if let Some((_, state, holder)) = done {
            return Ok(Cancelled::of(parse_state(&state)?, holder.map(WorkerId)));
        }
        Err(self.refusal(id, "PENDING or CLAIMED").await?.into())
    }

    /// Puts a Failed task back to Pending, claimable at once, with its retries reset to 0; its
    /// attempts, history and last error are kept.
    async fn retry_failed(&self, id: TaskId) -> Result<(), PgAdminError> {
        if let Some((workflow, _)) = self.step_of(id).await? {
            return Err(AdminError::WorkflowStep { task: id, workflow }.into());
        }
        let sql = self.schema().sql();
        let done: Option<i64> = replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sql
            .requeue_failed
            .query_scalar()
            .bind(id.0)
            .bind(self.schema().queue_channel_prefix())
            .fetch_optional(conn))?;
        if done.is_some() {
            return Ok(());
        }
        Err(self.refusal(id, "FAILED").await?.into())
    }

    /// Deletes a finished task with its attempts history and the key it holds, in one
    /// statement; a live one is refused with `WrongState`.
    async fn delete_finished(&self, id: TaskId) -> Result<(), PgAdminError> {
        let sql = self.schema().sql();
        let done: Option<i64> = replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sql
            .delete_finished
            .query_scalar()
            .bind(id.0)
            .fetch_optional(conn))?;
        if done.is_some() {
            return Ok(());
        }
        Err(self.refusal(id, FINISHED_STATES).await?.into())
    }

    /// Changes a Pending task's run-at, priority or retries spent (see [`Reschedule`]) in one
    /// statement; its key, attempts and history are kept, and its queue is notified. A task
    /// that is not Pending is refused with `WrongState`, a run-at at or past its good-until
    /// with `RunAtAfterGoodUntil`.
    async fn reschedule_task(&self, id: TaskId, change: Reschedule) -> Result<(), PgAdminError> {
        change.check()?;
        let (delay, at) = match change.run_at {
            None | Some(RunAt::Now) => (None, None),
            Some(RunAt::DelayMs(ms)) => (Some(duration(ms)), None),
            Some(RunAt::At(at)) => (None, Some(db_time(at))),
        };
        let sql = self.schema().sql();
        let row: Option<(String, i64, Option<i64>, bool)> =
            replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| async {
                promote_opened(sql, conn, id).await?;
                sql.reschedule
                    .query_as()
                    .bind(id.0)
                    .bind(change.run_at.is_some())
                    .bind(delay)
                    .bind(at)
                    .bind(change.priority)
                    .bind(change.retries.map(|n| i32::try_from(n).unwrap_or(i32::MAX))) // checked above
                    .bind(self.schema().queue_channel_prefix())
                    .fetch_optional(&mut *conn)
                    .await
            })?;
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

    async fn finish_by_hand(
        &self,
        id: TaskId,
        state: TaskState,
        error: Option<Value>,
        result: Option<Value>,
    ) -> Result<(), PgAdminError> {
        let sql = self.schema().sql();
        let done: Option<i64> = replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| async {
            promote_opened(sql, conn, id).await?;
            sql.finish_by_hand
                .query_scalar()
                .bind(id.0)
                .bind(state.as_str())
                .bind(&error)
                .bind(&result)
                .bind(self.schema().done_channel())
                .fetch_optional(&mut *conn)
                .await
        })?;
        if done.is_some() {
            return Ok(());
        }
        Err(self.refusal(id, "PENDING, CLAIMED or RUNNING").await?.into())
    }

    /// Hands the Claimed and Running tasks of dead `workers` back to Pending in one statement,
    /// as a release by their holder would: claimable at once, no retry spent, the holder's
    /// later writes reported lost, each queue concerned notified. Registered workers among
    /// them are marked stopped. Returns how many tasks went back.
    async fn unlock_workers(&self, workers: &[WorkerId]) -> Result<u64, sqlx::Error> {
        let ids: Vec<&str> = workers.iter().map(|w| w.0.as_str()).collect();
        let n: i64 = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .force_unlock
            .query_scalar()
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
    async fn free_key(&self, key: &str) -> Result<KeyRemoval, PgAdminError> {
        let error = error_json(&TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE))?;
        let sql = self.schema().sql();
        let row: Option<(i64, String)> = replayed!(self, Replay::IfNotApplied, PgAdminError, |conn| sql
            .remove_key
            .query_as()
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

    /// Pauses `queue`: from the next claim on, no worker takes its Pending tasks (its Claimed
    /// and Running ones go on). Returns whether it was running before; pausing a paused queue
    /// keeps its first pause time. Any valid queue name may be paused, configured or not.
    async fn pause(&self, queue: &str) -> Result<bool, PgAdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()).into());
        }
        let row: Option<String> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .pause_queue
            .query_scalar()
            .bind(queue)
            .fetch_optional(conn))?;
        Ok(row.is_some())
    }

    /// Resumes a paused `queue` and notifies it, so waiting workers claim its tasks. Returns
    /// whether it was paused.
    async fn resume(&self, queue: &str) -> Result<bool, PgAdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()).into());
        }
        let row: Option<String> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .resume_queue
            .query_scalar()
            .bind(queue)
            .bind(self.schema().queue_channel_prefix())
            .fetch_optional(conn))?;
        Ok(row.is_some())
    }

    /// Why an action found nothing to change: the task is missing or in another state.
    async fn refusal(&self, id: TaskId, expected: &'static str) -> Result<AdminError, sqlx::Error> {
        let state: Option<String> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .state_of
            .query_scalar()
            .bind(id.0)
            .fetch_optional(conn))?;
        Ok(match state {
            None => AdminError::NotFound(id),
            Some(state) => AdminError::WrongState { task: id, state: parse_state(&state)?, expected },
        })
    }
}
