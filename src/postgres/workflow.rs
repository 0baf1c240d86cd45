//! Workflows on PostgreSQL (migration 0010): submit in one statement, alone or inside the
//! caller's transaction; read a workflow; pause, resume and cancel it. Promotion and skipping
//! are the schema's own: a trigger on `finished_tasks` settles the children of every step a
//! statement finished, in that statement (see the migration).

use std::collections::BTreeMap;

use sqlx::{PgExecutor, Row};

use crate::config::AppConfig;
use crate::postgres::replay::{Replay, in_own_transaction, replayed};
use crate::postgres::schema::PgSchema;
use crate::postgres::store::{PgStore, db_time, duration, error_json, json, parse_state};
use crate::store::{
    CANCELLED_WITH_WORKFLOW, DbTime, EdgeRecord, EnqueueError, NewWorkflow, ParentRecord, RunAt, StepRecord,
    SubmitError, SubmittedWorkflow, WorkflowActionError, WorkflowId, WorkflowRecord, check_new_workflow,
};
use crate::task::{ErrorCode, TaskError, TaskId, TaskState, normalized_flags};
use crate::workflow::{EdgePolicy, EventError, OnError, StepId, WorkflowStatus};

/// Why a workflow submit into PostgreSQL failed. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgSubmitError {
    /// The workflow breaks a rule every store checks (see [`SubmitError`]).
    #[error(transparent)]
    Invalid(#[from] SubmitError),
    /// The database failed; nothing was written.
    #[error("workflow submit failed: {}", super::error_text(.0))]
    Database(#[from] sqlx::Error),
}

/// Why an action on a workflow in PostgreSQL failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgWorkflowError {
    /// The workflow is unknown or its state does not allow the action; nothing changed.
    #[error(transparent)]
    Refused(#[from] WorkflowActionError),
    /// The database failed.
    #[error("database error: {}", super::error_text(.0))]
    Database(#[from] sqlx::Error),
}

impl PgStore {
    /// Submits a workflow in one statement: its steps' tasks, the steps without parents
    /// Pending (one notification per queue) and the others Waiting, the workflow and its
    /// edges. All or nothing; not sent again after a lost reply (it could have committed).
    pub async fn submit_workflow(&self, workflow: &NewWorkflow) -> Result<SubmittedWorkflow, PgSubmitError> {
        let mut conn = self.pool().acquire().await?;
        let pooled = self.schema().is_transaction_pooled();
        in_own_transaction!(pooled, &mut *conn, |conn| submit_workflow_in(conn, self.schema(), self.app(), workflow))
    }

    /// The workflow `id` as reading it shows (see [`WorkflowRecord`]).
    pub async fn workflow(&self, id: WorkflowId) -> Result<Option<WorkflowRecord>, sqlx::Error> {
        Ok(self.workflow_state(id).await?.map(|(record, _)| record))
    }

    /// The workflow and step of task `id`, if it is a workflow's step.
    pub async fn step_of(&self, id: TaskId) -> Result<Option<(WorkflowId, StepId)>, sqlx::Error> {
        let row: Option<(i64, i32)> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .step_of
            .query_as()
            .bind(id.0)
            .fetch_optional(conn))?;
        Ok(row.map(|(workflow, step)| (WorkflowId(workflow), StepId(u32::try_from(step).unwrap_or(u32::MAX)))))
    }

    /// The steps of workflow `id`, by step (as [`StepRecord`]s).
    pub async fn workflow_steps(&self, id: WorkflowId) -> Result<Vec<StepRecord>, sqlx::Error> {
        let rows = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .workflow_steps
            .query()
            .bind(id.0)
            .fetch_all(conn))?;
        let count = |row: &sqlx::postgres::PgRow, column: &str| -> Result<u32, sqlx::Error> {
            Ok(u32::try_from(row.try_get::<i32, _>(column)?).unwrap_or(0))
        };
        rows.iter()
            .map(|row| {
                let state = parse_state(row.try_get("state")?)?;
                let waiting = match state {
                    TaskState::Waiting => Some((count(row, "satisfied")?, count(row, "unsatisfied")?)),
                    _ => None,
                };
                Ok(StepRecord {
                    step: StepId(count(row, "step")?),
                    task: TaskId(row.try_get("task_id")?),
                    name: row.try_get("name")?,
                    state,
                    parents: count(row, "parents")?,
                    required: count(row, "required")?,
                    waiting,
                })
            })
            .collect()
    }

    /// A workflow's edges by step, children in step order, at most `limit` (none for an
    /// unknown id).
    pub async fn workflow_edges(&self, id: WorkflowId, limit: u32) -> Result<Vec<EdgeRecord>, sqlx::Error> {
        let rows: Vec<(i32, i32, bool)> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .workflow_edges
            .query_as()
            .bind(id.0)
            .bind(i64::from(limit))
            .fetch_all(conn))?;
        let step = |index: i32| StepId(u32::try_from(index).unwrap_or(u32::MAX));
        Ok(rows
            .into_iter()
            .map(|(parent, child, allow_failed)| EdgeRecord { parent: step(parent), child: step(child), allow_failed })
            .collect())
    }

    /// The ids of the workflows, newest first, at most `limit`.
    pub async fn workflow_ids(&self, limit: u32) -> Result<Vec<WorkflowId>, sqlx::Error> {
        let ids: Vec<i64> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .workflow_ids
            .query_scalar()
            .bind(i64::from(limit))
            .fetch_all(conn))?;
        Ok(ids.into_iter().map(WorkflowId).collect())
    }

    /// The parents of step `id`, by task id, as [`ParentRecord`]s (none for a task that is not
    /// a step or has no parents): what a step's handler reads of the steps it waited for.
    pub async fn parents(&self, id: TaskId) -> Result<Vec<ParentRecord>, sqlx::Error> {
        let rows =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().parents_of.query().bind(id.0).fetch_all(conn))?;
        rows.iter()
            .map(|row| {
                Ok(ParentRecord {
                    task: TaskId(row.try_get("parent")?),
                    step: StepId(u32::try_from(row.try_get::<i32, _>("step")?).unwrap_or(u32::MAX)),
                    allow_failed: row.try_get("allow_failed")?,
                    state: parse_state(row.try_get("state")?)?,
                    result: row.try_get("result")?,
                    error: row.try_get::<Option<serde_json::Value>, _>("error")?.map(json).transpose()?,
                })
            })
            .collect()
    }

    /// Pauses workflow `id`: no step is promoted or skipped until it is resumed (steps already
    /// Pending, Claimed or Running go on). Pausing a paused workflow does nothing.
    pub async fn pause_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, PgWorkflowError> {
        self.allowed(id, "paused", |status| matches!(status, WorkflowStatus::Running | WorkflowStatus::Paused)).await?;
        let sql = self.schema().sql();
        let _: Option<i64> =
            replayed!(self, Replay::Safe, |conn| sql.pause_workflow.query_scalar().bind(id.0).fetch_optional(conn))?;
        self.status_now(id).await
    }

    /// Resumes workflow `id`: what its waiting steps' joins decided while it was paused applies
    /// now. Resuming a running workflow does nothing.
    pub async fn resume_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, PgWorkflowError> {
        self.allowed(id, "resumed", |status| matches!(status, WorkflowStatus::Running | WorkflowStatus::Paused))
            .await?;
        let sql = self.schema().sql();
        let _: bool =
            replayed!(self, Replay::Safe, |conn| sql.resume_workflow.query_scalar().bind(id.0).fetch_one(conn))?;
        self.status_now(id).await
    }

    /// Cancels workflow `id` in one statement: its Waiting, Pending, Claimed and Running steps
    /// are Cancelled, and the claimed and running ones named on the abort channel
    /// ([`PgSchema::abort_channel`](super::PgSchema::abort_channel)): their workers beat at
    /// once, find their leases gone and abort the handlers. Cancelling a cancelled workflow
    /// does nothing.
    pub async fn cancel_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, PgWorkflowError> {
        let status = self
            .allowed(id, "cancelled", |status| {
                matches!(status, WorkflowStatus::Running | WorkflowStatus::Paused | WorkflowStatus::Cancelled)
            })
            .await?;
        if status != WorkflowStatus::Cancelled {
            let sql = self.schema().sql();
            let error = error_json(&TaskError::new(ErrorCode::TaskCancelled, CANCELLED_WITH_WORKFLOW))?;
            let _: i64 = replayed!(self, Replay::Safe, |conn| async {
                sql.promote_opened_steps.query().bind(id.0).execute(&mut *conn).await?;
                sql.cancel_workflow
                    .query_scalar()
                    .bind(id.0)
                    .bind(&error)
                    .bind(self.schema().done_channel())
                    .bind(self.schema().abort_channel())
                    .fetch_one(&mut *conn)
                    .await
            })?;
        }
        self.status_now(id).await
    }

    /// Retries workflow `id` in one statement, as the memory store's `retry_workflow` does:
    /// the steps that did not complete (and, if `downstream`, every
    /// finished step below them) wait again and their joins decide; a cancelled workflow is
    /// reopened, a paused one stays paused. Refused if rows of its steps were purged.
    pub async fn retry_workflow(&self, id: WorkflowId, downstream: bool) -> Result<WorkflowStatus, PgWorkflowError> {
        let sql = self.schema().sql();
        let (found, purged, _reset): (bool, i32, i32) = replayed!(self, Replay::Safe, |conn| sql
            .retry_workflow
            .query_as()
            .bind(id.0)
            .bind(downstream)
            .fetch_one(conn))?;
        if !found {
            return Err(WorkflowActionError::NotFound(id).into());
        }
        if purged > 0 {
            let steps = usize::try_from(purged).unwrap_or(usize::MAX);
            return Err(WorkflowActionError::Purged { workflow: id, steps }.into());
        }
        self.status_now(id).await
    }

    /// The workflow's status if `allowed` allows it, else why not.
    async fn allowed(
        &self,
        id: WorkflowId,
        action: &'static str,
        allowed: impl Fn(WorkflowStatus) -> bool,
    ) -> Result<WorkflowStatus, PgWorkflowError> {
        let status = self.status_now(id).await?;
        if allowed(status) {
            Ok(status)
        } else {
            let error = EventError::WorkflowOver { status, action };
            Err(WorkflowActionError::Refused { workflow: id, error }.into())
        }
    }

    async fn status_now(&self, id: WorkflowId) -> Result<WorkflowStatus, PgWorkflowError> {
        match self.workflow(id).await? {
            Some(record) => Ok(record.status),
            None => Err(WorkflowActionError::NotFound(id).into()),
        }
    }

    /// The workflow's record and whether it is paused.
    async fn workflow_state(&self, id: WorkflowId) -> Result<Option<(WorkflowRecord, bool)>, sqlx::Error> {
        let rows = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .workflow_record
            .query()
            .bind(id.0)
            .fetch_all(conn))?;
        let Some(first) = rows.first() else {
            return Ok(None);
        };
        let (paused, cancelled): (bool, bool) = (first.try_get("paused")?, first.try_get("cancelled")?);
        let sink_failed: bool = first.try_get("sink_failed")?;
        let mut steps: BTreeMap<TaskState, u32> = BTreeMap::new();
        let mut unfinished = 0u32;
        for row in &rows {
            let Some(state) = row.try_get::<Option<String>, _>("state")? else {
                continue;
            };
            let state = parse_state(&state)?;
            let n = u32::try_from(row.try_get::<i64, _>("n")?).unwrap_or(u32::MAX);
            *steps.entry(state).or_insert(0) += n;
            if !state.is_terminal() {
                unfinished += n;
            }
        }
        let on_error = match first.try_get::<String, _>("on_error")?.as_str() {
            "PAUSE" => OnError::Pause,
            _ => OnError::Continue,
        };
        let record = WorkflowRecord {
            id,
            name: first.try_get("name")?,
            status: WorkflowStatus::of(cancelled, paused, unfinished, sink_failed),
            on_error,
            steps,
            submitted_at: DbTime(first.try_get("submitted_at_ms")?),
        };
        Ok(Some((record, paused)))
    }
}

/// Submits a workflow with `executor`: a pool, a connection, or the caller's open transaction
/// (its steps then become visible, and its notifications are sent, when that transaction
/// commits). Everything is checked before anything is written, and on a refusal nothing is.
pub async fn submit_workflow_in<'e, E: PgExecutor<'e>>(
    executor: E,
    schema: &PgSchema,
    app: &AppConfig,
    workflow: &NewWorkflow,
) -> Result<SubmittedWorkflow, PgSubmitError> {
    // The checks that need no clock (run-at against good-until is the database's).
    let queues = check_new_workflow(app, workflow, DbTime(i64::MIN))?;
    let steps = workflow.spec.steps.len();
    let mut parents = vec![0i32; steps];
    let mut sink = vec![true; steps];
    for edge in &workflow.spec.edges {
        parents[edge.child.index()] += 1;
        sink[edge.parent.index()] = false;
    }
    let required: Vec<i32> = workflow
        .spec
        .steps
        .iter()
        .zip(&parents)
        .map(|(step, &n)| i32::try_from(step.join.required(n.unsigned_abs())).unwrap_or(i32::MAX))
        .collect();
    let tasks = &workflow.tasks;
    let mut delays: Vec<Option<i64>> = Vec::with_capacity(steps);
    let mut ats: Vec<Option<i64>> = Vec::with_capacity(steps);
    let mut retries = Vec::with_capacity(steps);
    for task in tasks {
        let (delay, at) = match task.run_at {
            RunAt::Now => (None, None),
            RunAt::DelayMs(ms) => (Some(duration(ms)), None),
            RunAt::At(at) => (None, Some(db_time(at))),
        };
        delays.push(delay);
        ats.push(at);
        let policy = task.retry.as_ref().map(serde_json::to_value).transpose();
        retries.push(policy.map_err(|e| sqlx::Error::Encode(Box::new(e)))?);
    }
    let rows = schema
        .sql()
        .submit_workflow
        .query()
        .bind(tasks.iter().map(|t| t.name.as_str()).collect::<Vec<_>>())
        .bind(tasks.iter().map(|t| &t.args).collect::<Vec<_>>())
        .bind(&queues)
        .bind(tasks.iter().map(|t| t.priority).collect::<Vec<_>>())
        .bind(delays)
        .bind(ats)
        .bind(tasks.iter().map(|t| t.good_until.map(db_time)).collect::<Vec<_>>())
        .bind(retries)
        .bind(
            tasks
                .iter()
                .map(|t| (!t.flags.is_empty()).then(|| normalized_flags(&t.flags).join(",")))
                .collect::<Vec<_>>(),
        )
        .bind(parents)
        .bind(required)
        .bind(sink)
        .bind(workflow.spec.edges.iter().map(|e| e.parent.0 as i32).collect::<Vec<_>>())
        .bind(workflow.spec.edges.iter().map(|e| e.child.0 as i32).collect::<Vec<_>>())
        .bind(workflow.spec.edges.iter().map(|e| e.policy == EdgePolicy::AllowFailed).collect::<Vec<_>>())
        .bind(workflow.name.as_str())
        .bind(match workflow.spec.on_error {
            OnError::Continue => "CONTINUE",
            OnError::Pause => "PAUSE",
        })
        .bind(schema.queue_channel_prefix())
        .bind(schema.done_channel())
        .fetch_all(executor)
        .await?;
    let mut ids = Vec::with_capacity(steps);
    let mut workflow_id = None;
    for row in rows {
        if let Some(id) = row.try_get::<Option<i64>, _>("id")? {
            ids.push(TaskId(id));
            workflow_id = row.try_get::<Option<i64>, _>("workflow_id")?.map(WorkflowId);
            continue;
        }
        let ord: i64 = row.try_get("ord")?;
        let step = StepId(u32::try_from(ord - 1).unwrap_or(0));
        let error = EnqueueError::RunAtAfterGoodUntil {
            run_at: row.try_get::<Option<i64>, _>("run_at_ms")?.unwrap_or_default(),
            good_until: row.try_get::<Option<i64>, _>("good_until_ms")?.unwrap_or_default(),
        };
        return Err(SubmitError::Step { step, error }.into());
    }
    match workflow_id {
        Some(workflow) if ids.len() == steps => Ok(SubmittedWorkflow { workflow, tasks: ids }),
        _ => Err(sqlx::Error::Protocol(format!("workflow submit returned {} ids for {steps} steps", ids.len())).into()),
    }
}
