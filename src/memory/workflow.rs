//! Workflows: each holds the core's [`WorkflowState`] (the specification the SQL agrees with)
//! and its steps' task ids. Every move of a step's row to the finished table is noted
//! ([`finish_row`](MemoryStore::finish_row)); when the statement that moved it ends, its
//! workflow learns of all the steps that statement finished as one event
//! ([`MemoryStore::settle_workflows`], as PostgreSQL's statement trigger), and what it decides
//! moves the other steps' rows: promoted to Pending (one notification per queue and
//! statement), or skipped, which is itself a finish its children see.

use std::collections::BTreeMap;

use crate::store::{
    CANCELLED_WITH_WORKFLOW, DbTime, EdgeRecord, NewWorkflow, Notification, ParentRecord, StepRecord, SubmitError,
    SubmittedWorkflow, WorkflowActionError, WorkflowId, WorkflowRecord, check_new_workflow,
};
use crate::task::{ErrorCode, TaskError, TaskEvent, TaskId, TaskState};
use crate::workflow::{Changes, EdgePolicy, StepId, StepOutcome, WorkflowState, WorkflowStatus};

use super::store::MemoryStore;

/// A submitted workflow (a row of `workflows`, with its edges in the state).
#[derive(Debug, Clone)]
pub(crate) struct StoredWorkflow {
    pub(crate) name: String,
    pub(crate) state: WorkflowState,
    /// Each step's task, by step.
    pub(crate) tasks: Vec<TaskId>,
    pub(crate) submitted_at: DbTime,
}

impl MemoryStore {
    /// Submits a workflow as one statement: everything is checked
    /// ([`check_new_workflow`]) before anything is written, and on an error nothing is. Each
    /// step becomes a task: the steps without parents Pending (their queues notified), the
    /// others [`Waiting`](TaskState::Waiting) for their parents. Task ids follow the steps'
    /// order.
    pub fn submit_workflow(&mut self, workflow: NewWorkflow, now: DbTime) -> Result<SubmittedWorkflow, SubmitError> {
        let queues: Vec<String> =
            check_new_workflow(&self.app, &workflow, now)?.into_iter().map(str::to_owned).collect();
        let (state, changes) = WorkflowState::submit(&workflow.spec)?;
        let id = WorkflowId(self.next_workflow_id);
        self.next_workflow_id = self.next_workflow_id.saturating_add(1);
        let mut tasks = Vec::with_capacity(workflow.tasks.len());
        for (index, (task, queue)) in workflow.tasks.into_iter().zip(queues).enumerate() {
            let task_id = self.insert_new(task, queue, now);
            // A new step's row starts waiting; the workflow's first changes promote the roots.
            self.live_row(task_id).state = TaskState::Waiting;
            self.steps.insert(task_id, (id, StepId(u32::try_from(index).unwrap_or(u32::MAX))));
            tasks.push(task_id);
        }
        let stored = StoredWorkflow { name: workflow.name, state, tasks: tasks.clone(), submitted_at: now };
        self.workflows.insert(id, stored);
        self.apply_workflow_changes(&[(id, changes)], now);
        Ok(SubmittedWorkflow { workflow: id, tasks })
    }

    /// The workflow `id` as reading it shows: its status and its steps per state.
    pub fn workflow(&self, id: WorkflowId) -> Option<WorkflowRecord> {
        let flow = self.workflows.get(&id)?;
        let mut steps = BTreeMap::new();
        // A purged step's row is gone: it counts no more.
        for row in flow.tasks.iter().filter_map(|task| self.row(*task)) {
            *steps.entry(row.state).or_insert(0) += 1;
        }
        Some(WorkflowRecord {
            id,
            name: flow.name.clone(),
            status: flow.state.status(),
            on_error: flow.state.on_error(),
            steps,
            submitted_at: flow.submitted_at,
        })
    }

    /// The machine workflow `id` runs on: every step's state as the workflow counts it, its
    /// step counts and its status (what the simulation checks against the steps' rows).
    #[cfg(feature = "sim")]
    pub fn workflow_state(&self, id: WorkflowId) -> Option<&WorkflowState> {
        self.workflows.get(&id).map(|flow| &flow.state)
    }

    /// Makes the requests applied from now until [`end_statement`](Self::end_statement) one
    /// statement for the workflows: the steps they finish settle when it ends, not at the end
    /// of each. For a simulation that applies the parts of one request (a finish and a claim)
    /// one after the other, to check each as if alone: the claim must not see what the
    /// finish's workflows decide, as in the request itself.
    #[cfg(feature = "sim")]
    pub fn hold_statement(&mut self) {
        self.statement_held = true;
    }

    /// Ends the statement [`hold_statement`](Self::hold_statement) began: the workflows of
    /// the steps it finished settle now.
    #[cfg(feature = "sim")]
    pub fn end_statement(&mut self, now: DbTime) {
        self.statement_held = false;
        self.settle_workflows(now);
    }

    /// Whether a statement is held open ([`hold_statement`](Self::hold_statement)): the
    /// workflows have not heard of the steps it finished yet.
    #[cfg(feature = "sim")]
    pub fn statement_held(&self) -> bool {
        self.statement_held
    }

    /// The workflow and step of task `id`, if it is a workflow's step.
    pub fn step_of(&self, id: TaskId) -> Option<(WorkflowId, StepId)> {
        self.steps.get(&id).copied()
    }

    /// The steps of workflow `id`, by step (their rows purged by retention left out).
    pub fn workflow_steps(&self, id: WorkflowId) -> Vec<StepRecord> {
        let Some(flow) = self.workflows.get(&id) else {
            return Vec::new();
        };
        flow.tasks
            .iter()
            .enumerate()
            .filter_map(|(index, task)| {
                let row = self.row(*task)?;
                let step = StepId(u32::try_from(index).unwrap_or(u32::MAX));
                let join = flow.state.join(step)?;
                let counts = flow.state.join_counts(step)?;
                Some(StepRecord {
                    step,
                    task: *task,
                    name: row.name.clone(),
                    state: row.state,
                    parents: counts.parents,
                    required: join.required(counts.parents),
                    waiting: (row.state == TaskState::Waiting).then_some((counts.satisfied, counts.unsatisfied)),
                })
            })
            .collect()
    }

    /// A workflow's edges by step, children in step order, at most `limit` (none for an
    /// unknown id).
    pub fn workflow_edges(&self, id: WorkflowId, limit: u32) -> Vec<EdgeRecord> {
        let Some(flow) = self.workflows.get(&id) else {
            return Vec::new();
        };
        (0..flow.tasks.len())
            .map(|index| StepId(u32::try_from(index).unwrap_or(u32::MAX)))
            .flat_map(|child| {
                flow.state.parents(child).iter().map(move |&(parent, policy)| EdgeRecord {
                    parent,
                    child,
                    allow_failed: policy == EdgePolicy::AllowFailed,
                })
            })
            .take(limit as usize)
            .collect()
    }

    /// The ids of the workflows, newest first, at most `limit`.
    pub fn workflow_ids(&self, limit: usize) -> Vec<WorkflowId> {
        self.workflows.keys().rev().take(limit).copied().collect()
    }

    /// The parents of step `id`, by task id, as [`ParentRecord`]s (none for a task that is not
    /// a step or has no parents).
    pub fn parents(&self, id: TaskId) -> Vec<ParentRecord> {
        let Some((workflow, step)) = self.step_of(id) else {
            return Vec::new();
        };
        let flow = &self.workflows[&workflow];
        let mut parents: Vec<ParentRecord> = flow
            .state
            .parents(step)
            .iter()
            .filter_map(|&(parent, policy)| {
                let task = flow.tasks[parent.index()];
                let row = self.row(task)?;
                Some(ParentRecord {
                    task,
                    step: parent,
                    allow_failed: policy == EdgePolicy::AllowFailed,
                    state: row.state,
                    result: row.result.clone(),
                    error: row.error.clone().filter(|_| row.state.is_terminal()),
                })
            })
            .collect();
        parents.sort_by_key(|p| p.task);
        parents
    }

    /// Pauses workflow `id`: no step is promoted or skipped until it is resumed (steps
    /// already Pending, Claimed or Running go on).
    pub fn pause_workflow(&mut self, id: WorkflowId) -> Result<WorkflowStatus, WorkflowActionError> {
        self.workflow_event(id, WorkflowState::pause)
    }

    /// Resumes workflow `id`: what its steps' joins decided meanwhile applies now.
    pub fn resume_workflow(&mut self, id: WorkflowId, now: DbTime) -> Result<WorkflowStatus, WorkflowActionError> {
        let changes = self.workflow_changes(id, WorkflowState::resume)?;
        let status = changes.status;
        self.apply_workflow_changes(&[(id, changes)], now);
        self.settle_workflows(now);
        Ok(status)
    }

    /// Cancels workflow `id` in one statement: its Waiting, Pending, Claimed and Running steps
    /// are Cancelled, and the claimed and running ones announced revoked
    /// ([`Notification::TasksRevoked`]): their worker beats at once, finds their leases gone
    /// and aborts the handlers; what a handler reports after is lost. Nothing is promoted
    /// after.
    pub fn cancel_workflow(&mut self, id: WorkflowId, now: DbTime) -> Result<WorkflowStatus, WorkflowActionError> {
        let changes = self.workflow_changes(id, WorkflowState::cancel)?;
        let status = changes.status;
        self.apply_workflow_changes(&[(id, changes)], now);
        self.settle_workflows(now);
        Ok(status)
    }

    /// Retries workflow `id` in one statement: its steps that finished without completing
    /// (failed, cancelled, expired, skipped) and, if `downstream`, every finished step below
    /// them wait again (a completed one runs again on its parents' new results), with their
    /// retries spent reset, attempts and last error kept; then their joins decide. A
    /// cancelled workflow is reopened; a paused one stays paused (resume it to run them).
    /// Refused if a step's row was purged (its outcome is gone with it).
    pub fn retry_workflow(
        &mut self,
        id: WorkflowId,
        downstream: bool,
        now: DbTime,
    ) -> Result<WorkflowStatus, WorkflowActionError> {
        let flow = self.workflows.get(&id).ok_or(WorkflowActionError::NotFound(id))?;
        let purged = flow.tasks.iter().filter(|task| self.row(**task).is_none()).count();
        if purged > 0 {
            return Err(WorkflowActionError::Purged { workflow: id, steps: purged });
        }
        let changes = self.workflow_changes(id, |state| state.retry_failed(downstream))?;
        for &step in &changes.reset {
            let task = self.workflows[&id].tasks[step.index()];
            let mut row = self.finished.remove(&task).expect("a reset step finished: its row is in the finished table");
            row.reopen(TaskEvent::Reset);
            self.live.insert(task, row);
        }
        let status = changes.status;
        self.apply_workflow_changes(&[(id, changes)], now);
        self.settle_workflows(now);
        Ok(status)
    }

    fn workflow_changes(
        &mut self,
        id: WorkflowId,
        event: impl FnOnce(&mut WorkflowState) -> Result<Changes, crate::workflow::EventError>,
    ) -> Result<Changes, WorkflowActionError> {
        let flow = self.workflows.get_mut(&id).ok_or(WorkflowActionError::NotFound(id))?;
        event(&mut flow.state).map_err(|error| WorkflowActionError::Refused { workflow: id, error })
    }

    fn workflow_event(
        &mut self,
        id: WorkflowId,
        event: impl FnOnce(&mut WorkflowState) -> Result<Changes, crate::workflow::EventError>,
    ) -> Result<WorkflowStatus, WorkflowActionError> {
        let changes = self.workflow_changes(id, event)?;
        debug_assert!(changes.ready.is_empty() && changes.skipped.is_empty() && changes.cancelled.is_empty());
        Ok(changes.status)
    }

    /// Ends a statement for the workflows: reports the steps' rows it moved to the finished
    /// table ([`finished_steps`](MemoryStore::finished_steps)) to their workflows, one event per
    /// workflow ([`WorkflowState::steps_finished`]), and applies what they decide, as
    /// PostgreSQL's statement trigger does after the statement. Rows the workflows themselves
    /// finished (skipped, cancelled with their workflow) are already known to them.
    pub(super) fn settle_workflows(&mut self, now: DbTime) {
        #[cfg(feature = "sim")]
        if self.statement_held {
            return;
        }
        let finished = std::mem::take(&mut self.finished_steps);
        let mut batches: BTreeMap<WorkflowId, Vec<(StepId, StepOutcome)>> = BTreeMap::new();
        for (id, state) in finished {
            let Some((workflow, step)) = self.step_of(id) else { continue };
            let outcome = match state {
                TaskState::Completed => StepOutcome::Completed,
                TaskState::Failed => StepOutcome::Failed,
                TaskState::Cancelled => StepOutcome::Cancelled,
                TaskState::Expired => StepOutcome::Expired,
                _ => continue,
            };
            let known = self.workflows.get(&workflow).and_then(|flow| flow.state.state(step));
            if known.is_some_and(|known| !known.is_finished()) {
                batches.entry(workflow).or_default().push((step, outcome));
            }
        }
        let mut all = Vec::with_capacity(batches.len());
        for (workflow, finishes) in batches {
            let Some(flow) = self.workflows.get_mut(&workflow) else { continue };
            let changes = flow
                .state
                .steps_finished(&finishes)
                .unwrap_or_else(|e| panic!("memory store invariant broken: workflow {workflow}: {finishes:?}: {e}"));
            all.push((workflow, changes));
        }
        self.apply_workflow_changes(&all, now);
        // What they moved (skips) is known to them already.
        self.finished_steps.clear();
    }

    /// Moves the rows of the steps workflow events promoted, skipped or cancelled, and
    /// notifies each queue that received a promoted step once, with its most urgent priority:
    /// the events of one statement together, as PostgreSQL notifies once per statement.
    fn apply_workflow_changes(&mut self, all: &[(WorkflowId, Changes)], now: DbTime) {
        // Per queue that received a promoted step, the most urgent priority (as an enqueue's).
        let mut queues: BTreeMap<String, i16> = BTreeMap::new();
        // Claimed and running steps a cancel took from their holders.
        let mut revoked = Vec::new();
        for (workflow, changes) in all {
            let task = |store: &MemoryStore, step: StepId| store.workflows[workflow].tasks[step.index()];
            for &step in &changes.ready {
                let id = task(self, step);
                let row = self.live_row(id);
                row.apply_event(TaskEvent::Promote);
                row.run_at = row.run_at.max(now);
                let priority = row.priority;
                queues.entry(row.queue.clone()).and_modify(|p| *p = (*p).min(priority)).or_insert(priority);
            }
            for &step in &changes.skipped {
                self.finish_row(task(self, step), TaskEvent::Skip, now, None, None);
            }
            for &step in &changes.cancelled {
                let id = task(self, step);
                // The workflow counts a claimed or running step as ready; a holder has its
                // claim revoked.
                let Some(state) = self.live.get(&id).map(|row| row.state) else { continue };
                if matches!(state, TaskState::Claimed | TaskState::Running) {
                    revoked.push(id);
                }
                let event = if state == TaskState::Running { TaskEvent::Abort } else { TaskEvent::Cancel };
                let error = TaskError::new(ErrorCode::TaskCancelled, CANCELLED_WITH_WORKFLOW);
                self.finish_row(id, event, now, Some(error), None);
            }
        }
        for (queue, priority) in queues {
            self.notifications.push(Notification::TaskReady { queue, priority: Some(priority), run_at: None });
        }
        if !revoked.is_empty() {
            self.notifications.push(Notification::TasksRevoked { tasks: revoked });
        }
    }
}
