//! Workflows as stores hold them: a graph of new tasks to submit ([`NewWorkflow`]), the checks
//! every store applies to it ([`check_new_workflow`]), and what reading a workflow gives
//! ([`WorkflowRecord`]).
//!
//! A step is an ordinary task row. A step with parents is written
//! [`Waiting`](TaskState::Waiting), which no claim takes; the finish of its parents decides it
//! ([`crate::workflow`]): promoted to Pending, or [`Skipped`](TaskState::Skipped). Caps,
//! priorities, retries, expiry, results and history apply to steps as to any task.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::AppConfig;
use crate::store::{DbTime, EnqueueError, NewTask, check_new_task};
use crate::task::{TaskId, TaskState};
use crate::workflow::{EdgePolicy, EventError, Join, OnError, StepId, WorkflowError, WorkflowSpec, WorkflowStatus};

/// A workflow's id, assigned by the store at submit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkflowId(pub i64);

impl fmt::Display for WorkflowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A workflow to submit: its graph and one new task per step (`tasks[i]` is step `i`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct NewWorkflow {
    /// Its name, for people: 1 to 128 bytes.
    pub name: String,
    /// The graph: joins, edges and the failure policy.
    pub spec: WorkflowSpec,
    /// The steps' tasks, by step.
    pub tasks: Vec<NewTask>,
}

impl NewWorkflow {
    /// An empty workflow named `name` that skips what can no longer run after a failure
    /// ([`OnError::Continue`]).
    pub fn new(name: impl Into<String>) -> Self {
        NewWorkflow { name: name.into(), spec: WorkflowSpec::new(OnError::Continue), tasks: Vec::new() }
    }

    /// Pauses the workflow when a step fails, is cancelled or expires ([`OnError::Pause`]).
    pub fn pause_on_error(mut self) -> Self {
        self.spec.on_error = OnError::Pause;
        self
    }

    /// Adds a step running `task` once its join over its parents is satisfied.
    pub fn step(&mut self, task: NewTask, join: Join) -> StepId {
        self.tasks.push(task);
        self.spec.add_step(join)
    }

    /// `child` waits for `parent` under `policy`.
    pub fn edge(&mut self, parent: StepId, child: StepId, policy: EdgePolicy) {
        self.spec.add_edge(parent, child, policy);
    }
}

/// What a submit wrote: the workflow and its steps' tasks (`tasks[i]` runs step `i`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmittedWorkflow {
    /// The workflow.
    pub workflow: WorkflowId,
    /// Each step's task, by step.
    pub tasks: Vec<TaskId>,
}

/// Why a workflow was refused at submit; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The name is empty or too long.
    #[error("invalid workflow name {0:?}: expected 1 to 128 bytes")]
    InvalidName(String),
    /// The graph cannot be submitted.
    #[error("invalid workflow graph: {0}")]
    Graph(#[from] WorkflowError),
    /// There is not exactly one task per step.
    #[error("workflow of {steps} steps with {tasks} tasks: expected one task per step")]
    TasksPerStep {
        /// Steps in the graph.
        steps: usize,
        /// Tasks given.
        tasks: usize,
    },
    /// A step's task is refused as an enqueue would refuse it.
    #[error("step {step}: {error}")]
    Step {
        /// The step.
        step: StepId,
        /// Why its task was refused.
        error: EnqueueError,
    },
    /// A step's task has a key: a key's modes replace or reuse other tasks, which a step of a
    /// graph cannot be.
    #[error("step {0}: a workflow step cannot hold a key")]
    StepKey(StepId),
}

/// The error message of a step's task that its workflow's cancel cancelled.
pub const CANCELLED_WITH_WORKFLOW: &str = "cancelled with its workflow";

/// The longest workflow name.
pub const MAX_WORKFLOW_NAME_BYTES: usize = 128;

/// Checks everything a store checks before writing a workflow (`now` is the store's) and
/// returns each step's queue: the name, the graph ([`WorkflowSpec::check`]), one task per step,
/// no keys, and each task as [`check_new_task`] checks it.
pub fn check_new_workflow<'a>(
    app: &'a AppConfig,
    workflow: &'a NewWorkflow,
    now: DbTime,
) -> Result<Vec<&'a str>, SubmitError> {
    if workflow.name.is_empty() || workflow.name.len() > MAX_WORKFLOW_NAME_BYTES {
        return Err(SubmitError::InvalidName(workflow.name.clone()));
    }
    workflow.spec.check()?;
    if workflow.tasks.len() != workflow.spec.steps.len() {
        return Err(SubmitError::TasksPerStep { steps: workflow.spec.steps.len(), tasks: workflow.tasks.len() });
    }
    let step = |index: usize| StepId(u32::try_from(index).unwrap_or(u32::MAX));
    let mut queues = Vec::with_capacity(workflow.tasks.len());
    for (index, task) in workflow.tasks.iter().enumerate() {
        if task.key.is_some() {
            return Err(SubmitError::StepKey(step(index)));
        }
        queues.push(check_new_task(app, task, now).map_err(|error| SubmitError::Step { step: step(index), error })?);
    }
    Ok(queues)
}

/// A workflow as reading it shows: its status and how many of its steps are in each state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkflowRecord {
    /// The workflow.
    pub id: WorkflowId,
    /// Its name.
    pub name: String,
    /// Where it stands.
    pub status: WorkflowStatus,
    /// What a failed step does to it.
    pub on_error: OnError,
    /// Its steps' tasks per state (states without steps left out).
    pub steps: BTreeMap<TaskState, u32>,
    /// When it was submitted.
    pub submitted_at: DbTime,
}

/// Why an action on a whole workflow (pause, resume, cancel, retry) was refused; nothing
/// changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkflowActionError {
    /// No workflow has this id.
    #[error("no workflow {0}")]
    NotFound(WorkflowId),
    /// A retry needs every step's outcome, and rows of this workflow's steps were purged
    /// (`finished_retention_ms`).
    #[error("workflow {workflow}: {steps} of its steps were purged, so it cannot be retried")]
    Purged {
        /// The workflow.
        workflow: WorkflowId,
        /// How many steps' rows are gone.
        steps: usize,
    },
    /// The workflow's state does not allow it (it is over, say).
    #[error("workflow {workflow}: {error}")]
    Refused {
        /// The workflow.
        workflow: WorkflowId,
        /// Why.
        error: EventError,
    },
}

/// A parent of a workflow's step, as its child reads it: how it ended, with its result or
/// error once it finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParentRecord {
    /// The parent's task.
    pub task: TaskId,
    /// Its step in the workflow.
    pub step: StepId,
    /// Whether any finish of it satisfies the edge (`allow_failed`), not only its completion.
    pub allow_failed: bool,
    /// Its state: terminal once it finished (a child of an `any` or quorum join may run before
    /// every parent did).
    pub state: TaskState,
    /// Its result, if it completed.
    pub result: Option<serde_json::Value>,
    /// Its error, if it failed, was cancelled or expired.
    pub error: Option<crate::task::TaskError>,
}

/// One step of a workflow as reading it shows: its task and where its join stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    /// The step.
    pub step: StepId,
    /// Its task.
    pub task: TaskId,
    /// Its task's name.
    pub name: String,
    /// Its task's state.
    pub state: TaskState,
    /// Its parents.
    pub parents: u32,
    /// How many of them must satisfy their edge for it to run.
    pub required: u32,
    /// While it waits: its parents that finished satisfying their edge, and those that
    /// finished without satisfying it (`None` once it left Waiting, when they no longer
    /// matter).
    pub waiting: Option<(u32, u32)>,
}

/// One edge of a workflow's graph, by step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EdgeRecord {
    /// The step waited for.
    pub parent: StepId,
    /// The step that waits.
    pub child: StepId,
    /// Whether any finish of the parent satisfies the edge, not only its completion.
    pub allow_failed: bool,
}
