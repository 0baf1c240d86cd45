//! Workflows for clients: a graph built from registered tasks ([`Workflow`], whose steps are
//! typed [`Step`]s), submitted by [`Client::submit`](super::Client::submit), and followed
//! through a [`WorkflowHandle`] (each step's typed result, the workflow's status, a wait for
//! its end).

use std::marker::PhantomData;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::client::{Client, ClientError, ResultError, ResultHandle};
use super::{Runtime, TaskHandle};
use crate::store::{NewTask, NewWorkflow, WorkflowId, WorkflowRecord};
use crate::task::{ErrorCode, TaskError, TaskId, TaskState};
use crate::workflow::{EdgePolicy, Join, StepId};

/// A workflow to submit: steps running registered tasks, and edges saying which step waits
/// for which. A step runs once its join over its parents is satisfied (all of them completed,
/// by default); see [`crate::workflow`] for the rules.
///
/// ```
/// # use canter::driver::{Registry, TaskContext, Workflow};
/// # use canter::task::TaskError;
/// # let mut registry = Registry::new();
/// # let fetch = registry.register("fetch", |url: String, _: TaskContext| async move { Ok::<_, TaskError>(url.len()) }).unwrap();
/// # let total = registry.register("total", |_: (), _: TaskContext| async move { Ok::<_, TaskError>(0u64) }).unwrap();
/// let mut workflow = Workflow::new("crawl");
/// let pages: Vec<_> = ["a", "b", "c"].iter().map(|url| workflow.step(&fetch, &url.to_string())).collect::<Result<_, _>>()?;
/// let sum = workflow.step(&total, &())?;
/// for page in &pages {
///     workflow.after(&sum, page); // fan-in: `total` runs once every page was fetched
/// }
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Workflow {
    new: NewWorkflow,
}

/// A step of a [`Workflow`], whose task returns `T`.
pub struct Step<T> {
    id: StepId,
    result: PhantomData<fn() -> T>,
}

impl<T> Clone for Step<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Step<T> {}

impl<T> std::fmt::Debug for Step<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Step").field(&self.id).finish()
    }
}

impl<T> Step<T> {
    /// The step's index in its workflow.
    pub fn id(&self) -> StepId {
        self.id
    }
}

impl Workflow {
    /// An empty workflow named `name` (1 to 128 bytes, for people).
    pub fn new(name: impl Into<String>) -> Self {
        Workflow { new: NewWorkflow::new(name) }
    }

    /// Adds a step running `task` with `args`.
    pub fn step<A: Serialize, T>(&mut self, task: &TaskHandle<A, T>, args: &A) -> Result<Step<T>, serde_json::Error> {
        self.step_with(task, args, |t| t)
    }

    /// Adds a step running `task` with `args`, shaped by `options` (queue, priority, run-at,
    /// good-until, retry policy, flags: see [`NewTask`]'s builder methods; a step cannot hold
    /// a key).
    pub fn step_with<A: Serialize, T>(
        &mut self,
        task: &TaskHandle<A, T>,
        args: &A,
        options: impl FnOnce(NewTask) -> NewTask,
    ) -> Result<Step<T>, serde_json::Error> {
        let new = options(NewTask::new(task.name(), task.encode(args)?));
        Ok(Step { id: self.new.step(new, Join::All), result: PhantomData })
    }

    /// `child` waits for `parent` to complete: a parent that fails, is cancelled, expires or
    /// is skipped does not satisfy the edge.
    pub fn after<T, U>(&mut self, child: &Step<T>, parent: &Step<U>) -> &mut Self {
        self.new.edge(parent.id, child.id, EdgePolicy::RequireSuccess);
        self
    }

    /// `child` waits for `parent` to finish, however it finishes: a recovery or clean-up step
    /// (its handler can read how the parent ended).
    pub fn after_finish<T, U>(&mut self, child: &Step<T>, parent: &Step<U>) -> &mut Self {
        self.new.edge(parent.id, child.id, EdgePolicy::AllowFailed);
        self
    }

    /// How `step` joins over its parents: all of them satisfied (the default), any one, or a
    /// quorum.
    pub fn join<T>(&mut self, step: &Step<T>, join: Join) -> &mut Self {
        if let Some(spec) = self.new.spec.steps.get_mut(step.id.index()) {
            spec.join = join;
        }
        self
    }

    /// Pauses the workflow when a step fails, is cancelled or expires, before anything below
    /// it is skipped: an operator retries or resumes it.
    pub fn pause_on_error(&mut self) -> &mut Self {
        self.new.spec.on_error = crate::workflow::OnError::Pause;
        self
    }

    /// The workflow as stores take it.
    pub fn into_new(self) -> NewWorkflow {
        self.new
    }
}

/// A submitted workflow: its id and its steps' tasks.
pub struct WorkflowHandle<R> {
    pub(super) client: Client<R>,
    pub(super) id: WorkflowId,
    pub(super) tasks: Vec<TaskId>,
    /// The steps without children, whose results are the workflow's.
    pub(super) sinks: Vec<TaskId>,
}

impl<R> Clone for WorkflowHandle<R> {
    fn clone(&self) -> Self {
        WorkflowHandle {
            client: self.client.clone(),
            id: self.id,
            tasks: self.tasks.clone(),
            sinks: self.sinks.clone(),
        }
    }
}

impl<R> std::fmt::Debug for WorkflowHandle<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkflowHandle").field("id", &self.id).field("tasks", &self.tasks).finish()
    }
}

impl<R: Runtime> WorkflowHandle<R> {
    /// The workflow's id.
    pub fn id(&self) -> WorkflowId {
        self.id
    }

    /// Each step's task, by step.
    pub fn tasks(&self) -> &[TaskId] {
        &self.tasks
    }

    /// The typed result of `step` (a step of the [`Workflow`] this handle was submitted from).
    pub fn step<T>(&self, step: &Step<T>) -> Option<ResultHandle<R, T>> {
        self.tasks.get(step.id.index()).map(|id| self.client.handle(*id))
    }

    /// The workflow as stored now.
    pub async fn status(&self) -> Result<Option<WorkflowRecord>, ClientError> {
        self.client.workflow(self.id).await
    }

    /// Waits at most `timeout` for the workflow to end (completed, failed or cancelled) and
    /// returns it as it ended: its sinks' results are then stored, each readable through
    /// [`step`](Self::step). A timeout is [`ResultError::Timeout`].
    pub async fn wait(&self, timeout: Duration) -> Result<WorkflowRecord, ResultError> {
        let runtime = self.client.runtime();
        let started = runtime.now();
        let left = || timeout.saturating_sub(runtime.now().saturating_duration_since(started));
        // The sinks finish last unless a branch ended early: wait for them, then for the rest.
        for sink in &self.sinks {
            self.client.wait(*sink, left()).await?;
        }
        let mut pause = Duration::from_millis(20);
        loop {
            let record = self.client.store().workflow(self.id).await?;
            let Some(record) = record else {
                return Err(ResultError::WorkflowNotFound(self.id));
            };
            if record.status.is_finished() {
                return Ok(record);
            }
            if left().is_zero() {
                return Err(ResultError::Timeout(timeout));
            }
            super::sleep_after(runtime, runtime.now(), pause.min(left())).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}

/// A parent of a workflow's step as the step's handler reads it, its result typed `T`.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentResult<T> {
    /// The parent's task.
    pub task: TaskId,
    /// Its step in the workflow.
    pub step: StepId,
    /// Its state.
    pub state: TaskState,
    /// How it ended, once it finished: its result, or why there is none (its error; a
    /// result that does not decode as `T` is `RESULT_DESERIALIZATION_ERROR`, a skipped parent
    /// `STEP_SKIPPED`). `None` while it has not finished (a child of an `any` or quorum join
    /// may run before every parent did).
    pub outcome: Option<Result<T, TaskError>>,
}

impl<R: Runtime> Client<R> {
    /// The parents of the step whose task is `step` (a handler passes its own
    /// [`TaskContext::id`](super::TaskContext::id)), by task id, each with its result typed
    /// `T` or its error: a recovery step after an `after_finish` edge branches on them.
    pub async fn parent_results<T: DeserializeOwned>(&self, step: TaskId) -> Result<Vec<ParentResult<T>>, ClientError> {
        let parents = self.store().parents(step).await?;
        Ok(parents
            .into_iter()
            .map(|parent| {
                let error = |code: ErrorCode, message: &str| {
                    parent.error.clone().unwrap_or_else(|| TaskError::new(code, message))
                };
                let outcome = match parent.state {
                    TaskState::Completed => {
                        Some(serde_json::from_value(parent.result.clone().unwrap_or_default()).map_err(|e| {
                            TaskError::new(
                                ErrorCode::ResultDeserializationError,
                                format!("result of task {} did not decode: {e}", parent.task),
                            )
                        }))
                    }
                    TaskState::Skipped => Some(Err(TaskError::new(
                        ErrorCode::StepSkipped,
                        "skipped: its parents' outcomes could not satisfy its join",
                    ))),
                    TaskState::Cancelled => Some(Err(error(ErrorCode::TaskCancelled, "cancelled"))),
                    TaskState::Expired => Some(Err(error(ErrorCode::TaskExpired, "expired before it ran"))),
                    TaskState::Failed => Some(Err(error(ErrorCode::TaskError, "failed"))),
                    _ => None,
                };
                ParentResult { task: parent.task, step: parent.step, state: parent.state, outcome }
            })
            .collect())
    }
}
