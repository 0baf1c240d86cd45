//! The workflow machine: a submitted graph's steps and status, moved by events, each event
//! answered with what changed. See the module docs for the semantics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::join::{Decision, JoinCounts, decide, on_parent_finished, on_parent_reset};
use super::spec::{EdgePolicy, Graph, Join, OnError, ParentOutcome, StepId, StepOutcome, WorkflowError, WorkflowSpec};

/// Where a step of a workflow stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// Its join is not satisfied yet (or the workflow is paused): not claimable.
    Waiting,
    /// Claimable.
    Ready,
    /// Claimed or running.
    Running,
    /// Finished with a result.
    Completed,
    /// Finished with an error and no retry left.
    Failed,
    /// Cancelled, alone or with its workflow.
    Cancelled,
    /// Its good-until time passed before it ran.
    Expired,
    /// Its join can no longer be satisfied: it never runs.
    Skipped,
}

impl StepState {
    /// Every state, in declaration order.
    pub const ALL: [StepState; 8] = [
        StepState::Waiting,
        StepState::Ready,
        StepState::Running,
        StepState::Completed,
        StepState::Failed,
        StepState::Cancelled,
        StepState::Expired,
        StepState::Skipped,
    ];

    /// The outcome its children see, once it finished (the last five states).
    pub fn outcome(self) -> Option<ParentOutcome> {
        match self {
            StepState::Waiting | StepState::Ready | StepState::Running => None,
            StepState::Completed => Some(ParentOutcome::Completed),
            StepState::Failed => Some(ParentOutcome::Failed),
            StepState::Cancelled => Some(ParentOutcome::Cancelled),
            StepState::Expired => Some(ParentOutcome::Expired),
            StepState::Skipped => Some(ParentOutcome::Skipped),
        }
    }

    /// Whether the step finished (it has an [`outcome`](Self::outcome)).
    pub fn is_finished(self) -> bool {
        self.outcome().is_some()
    }
}

impl From<ParentOutcome> for StepState {
    fn from(outcome: ParentOutcome) -> Self {
        match outcome {
            ParentOutcome::Completed => StepState::Completed,
            ParentOutcome::Failed => StepState::Failed,
            ParentOutcome::Cancelled => StepState::Cancelled,
            ParentOutcome::Expired => StepState::Expired,
            ParentOutcome::Skipped => StepState::Skipped,
        }
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StepState::Waiting => "waiting",
            StepState::Ready => "ready",
            StepState::Running => "running",
            StepState::Completed => "completed",
            StepState::Failed => "failed",
            StepState::Cancelled => "cancelled",
            StepState::Expired => "expired",
            StepState::Skipped => "skipped",
        })
    }
}

/// How many steps of a workflow are in each state (a workflow row's counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepCounts {
    /// Steps [`Waiting`](StepState::Waiting).
    pub waiting: u32,
    /// Steps [`Ready`](StepState::Ready).
    pub ready: u32,
    /// Steps [`Running`](StepState::Running).
    pub running: u32,
    /// Steps [`Completed`](StepState::Completed).
    pub completed: u32,
    /// Steps [`Failed`](StepState::Failed).
    pub failed: u32,
    /// Steps [`Cancelled`](StepState::Cancelled).
    pub cancelled: u32,
    /// Steps [`Expired`](StepState::Expired).
    pub expired: u32,
    /// Steps [`Skipped`](StepState::Skipped).
    pub skipped: u32,
}

impl StepCounts {
    /// The steps in `state`.
    pub fn get(&self, state: StepState) -> u32 {
        match state {
            StepState::Waiting => self.waiting,
            StepState::Ready => self.ready,
            StepState::Running => self.running,
            StepState::Completed => self.completed,
            StepState::Failed => self.failed,
            StepState::Cancelled => self.cancelled,
            StepState::Expired => self.expired,
            StepState::Skipped => self.skipped,
        }
    }

    fn slot(&mut self, state: StepState) -> &mut u32 {
        match state {
            StepState::Waiting => &mut self.waiting,
            StepState::Ready => &mut self.ready,
            StepState::Running => &mut self.running,
            StepState::Completed => &mut self.completed,
            StepState::Failed => &mut self.failed,
            StepState::Cancelled => &mut self.cancelled,
            StepState::Expired => &mut self.expired,
            StepState::Skipped => &mut self.skipped,
        }
    }

    /// Steps not finished: waiting, ready or running.
    pub fn unfinished(&self) -> u32 {
        self.waiting + self.ready + self.running
    }

    /// All the steps.
    pub fn total(&self) -> u32 {
        StepState::ALL.iter().map(|&s| self.get(s)).sum()
    }
}

/// Where a workflow stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkflowStatus {
    /// Some step is unfinished and the workflow promotes steps as their joins are satisfied.
    Running,
    /// Some step is unfinished and no step is promoted or skipped until it is resumed.
    Paused,
    /// Every step finished and every sink step (a step without children) completed.
    Completed,
    /// Every step finished and some sink step did not complete.
    Failed,
    /// Cancelled: nothing more is promoted; running steps are being aborted.
    Cancelled,
}

impl WorkflowStatus {
    /// The status of a workflow with these flags and `unfinished` steps (see the module docs):
    /// what a store that keeps the flags and counts its steps' rows reports. `sink_failed`
    /// says whether some sink step (one without children) finished without completing; it
    /// matters once every step finished, and a store keeps it apart from the steps' rows,
    /// which purge may delete.
    pub fn of(cancelled: bool, paused: bool, unfinished: u32, sink_failed: bool) -> WorkflowStatus {
        if cancelled {
            WorkflowStatus::Cancelled
        } else if unfinished == 0 {
            if sink_failed { WorkflowStatus::Failed } else { WorkflowStatus::Completed }
        } else if paused {
            WorkflowStatus::Paused
        } else {
            WorkflowStatus::Running
        }
    }

    /// Whether the workflow is over (completed, failed or cancelled); only a retry reopens it.
    pub fn is_finished(self) -> bool {
        matches!(self, WorkflowStatus::Completed | WorkflowStatus::Failed | WorkflowStatus::Cancelled)
    }
}

impl fmt::Display for WorkflowStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkflowStatus::Running => "running",
            WorkflowStatus::Paused => "paused",
            WorkflowStatus::Completed => "completed",
            WorkflowStatus::Failed => "failed",
            WorkflowStatus::Cancelled => "cancelled",
        })
    }
}

/// What one event changed. Every list is in ascending step order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Steps that became [`Ready`](StepState::Ready): to be made claimable (one notification
    /// per queue).
    pub ready: Vec<StepId>,
    /// Steps that became [`Skipped`](StepState::Skipped).
    pub skipped: Vec<StepId>,
    /// Steps that became [`Cancelled`](StepState::Cancelled) with their workflow.
    pub cancelled: Vec<StepId>,
    /// Running steps to abort (the workflow was cancelled); each is still
    /// [`Running`](StepState::Running) until its finish is reported.
    pub abort: Vec<StepId>,
    /// Finished steps a retry made [`Waiting`](StepState::Waiting) again (some may be in
    /// `ready` too).
    pub reset: Vec<StepId>,
    /// The workflow's status after the event.
    pub status: WorkflowStatus,
}

impl Changes {
    fn new(status: WorkflowStatus) -> Self {
        Changes {
            ready: Vec::new(),
            skipped: Vec::new(),
            cancelled: Vec::new(),
            abort: Vec::new(),
            reset: Vec::new(),
            status,
        }
    }
}

/// Why a waiting step waits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitReason {
    /// Its parents not finished yet, ascending.
    pub unfinished: Vec<StepId>,
    /// How many more parents must satisfy their edge for its join to be satisfied.
    pub needed: u32,
    /// What its join decided, if the workflow is paused and it is decided already: applied
    /// when the workflow resumes.
    pub held: Option<Decision>,
}

/// An event the workflow's state does not allow; nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The step is not in the workflow.
    #[error("step {step} is not in this workflow of {steps} steps")]
    UnknownStep {
        /// The step named.
        step: StepId,
        /// How many steps the workflow has.
        steps: usize,
    },
    /// Only a ready step can start.
    #[error("step {step} is {state}, so it cannot start: only a ready step can")]
    CannotStart {
        /// The step.
        step: StepId,
        /// Its state.
        state: StepState,
    },
    /// A finished step cannot finish again, and a waiting step can only be cancelled or
    /// expire.
    #[error("step {step} is {state}, so it cannot finish {outcome}")]
    CannotFinish {
        /// The step.
        step: StepId,
        /// Its state.
        state: StepState,
        /// The outcome reported.
        outcome: StepOutcome,
    },
    /// Pause, resume and cancel need a workflow that is not over.
    #[error("the workflow is {status}, so it cannot be {action}")]
    WorkflowOver {
        /// Its status.
        status: WorkflowStatus,
        /// What was asked: "paused", "resumed" or "cancelled".
        action: &'static str,
    },
}

/// A submitted workflow: every step's state and join counts, the workflow's status, moved by
/// events. Pure and deterministic; see the module docs for the rules it applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkflowState {
    joins: Vec<Join>,
    graph: Graph,
    on_error: OnError,
    states: Vec<StepState>,
    counts: Vec<JoinCounts>,
    /// While paused: the waiting steps whose join decided (Ready or Skip), applied on resume.
    held: BTreeSet<StepId>,
    step_counts: StepCounts,
    sinks: u32,
    sinks_completed: u32,
    paused: bool,
    cancelled: bool,
}

impl WorkflowState {
    /// Checks `spec` and submits it: every step waits, then the steps without parents become
    /// ready (listed in the changes).
    pub fn submit(spec: &WorkflowSpec) -> Result<(WorkflowState, Changes), WorkflowError> {
        let graph = Graph::build(spec)?;
        let steps = spec.steps.len();
        let counts = graph.parents.iter().map(|p| JoinCounts::new(p.len() as u32)).collect();
        let sinks = graph.children.iter().filter(|c| c.is_empty()).count() as u32;
        let mut state = WorkflowState {
            joins: spec.steps.iter().map(|s| s.join).collect(),
            graph,
            on_error: spec.on_error,
            states: vec![StepState::Waiting; steps],
            counts,
            held: BTreeSet::new(),
            step_counts: StepCounts { waiting: steps as u32, ..StepCounts::default() },
            sinks,
            sinks_completed: 0,
            paused: false,
            cancelled: false,
        };
        let mut changes = Changes::new(WorkflowStatus::Running);
        let roots = (0..steps).filter(|&s| state.graph.parents[s].is_empty()).map(|s| StepId(s as u32)).collect();
        state.settle(roots, &mut changes);
        let changes = state.close(changes);
        Ok((state, changes))
    }

    /// The workflow's status.
    pub fn status(&self) -> WorkflowStatus {
        let unfinished = self.step_counts.unfinished();
        WorkflowStatus::of(self.cancelled, self.paused, unfinished, self.sinks_completed < self.sinks)
    }

    /// How many steps the workflow has.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// Whether the workflow has no steps (never: a submitted workflow has at least one).
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    /// The workflow's failure policy.
    pub fn on_error(&self) -> OnError {
        self.on_error
    }

    /// A step's state.
    pub fn state(&self, step: StepId) -> Option<StepState> {
        self.states.get(step.index()).copied()
    }

    /// Every step's state, by step.
    pub fn states(&self) -> &[StepState] {
        &self.states
    }

    /// A step's join.
    pub fn join(&self, step: StepId) -> Option<Join> {
        self.joins.get(step.index()).copied()
    }

    /// A step's parents with their edges' policies, ascending.
    pub fn parents(&self, step: StepId) -> &[(StepId, EdgePolicy)] {
        self.graph.parents.get(step.index()).map_or(&[], Vec::as_slice)
    }

    /// A step's children with their edges' policies, ascending.
    pub fn children(&self, step: StepId) -> &[(StepId, EdgePolicy)] {
        self.graph.children.get(step.index()).map_or(&[], Vec::as_slice)
    }

    /// A step's parents counted by how they stand (kept for every step, finished or not).
    pub fn join_counts(&self, step: StepId) -> Option<JoinCounts> {
        self.counts.get(step.index()).copied()
    }

    /// How many steps are in each state.
    pub fn step_counts(&self) -> StepCounts {
        self.step_counts
    }

    /// The waiting steps whose join decided while the workflow is paused, ascending.
    pub fn held(&self) -> impl Iterator<Item = StepId> + '_ {
        self.held.iter().copied()
    }

    /// Why a step waits: `None` unless it is [`Waiting`](StepState::Waiting).
    pub fn waiting_reasons(&self, step: StepId) -> Option<WaitReason> {
        if self.state(step)? != StepState::Waiting {
            return None;
        }
        let counts = self.counts[step.index()];
        let unfinished =
            self.parents(step).iter().filter(|(p, _)| !self.states[p.index()].is_finished()).map(|(p, _)| *p).collect();
        let needed = self.joins[step.index()].required(counts.parents).saturating_sub(counts.satisfied);
        let held = self.held.contains(&step).then(|| decide(self.joins[step.index()], &counts));
        Some(WaitReason { unfinished, needed, held })
    }

    /// A ready step was claimed or started. Optional for the joins (only the abort list of a
    /// cancel needs it): a store may report a finish straight from ready.
    pub fn step_started(&mut self, step: StepId) -> Result<Changes, EventError> {
        let state = self.known(step)?;
        if state != StepState::Ready {
            return Err(EventError::CannotStart { step, state });
        }
        self.set_state(step, StepState::Running);
        Ok(self.close(Changes::new(WorkflowStatus::Running)))
    }

    /// A step's task finished with `outcome`: from ready or running any outcome, from waiting
    /// only cancelled or expired (an operator cancelled it, or it expired before its parents
    /// finished). Its children's counts change; a failure, cancellation or expiry pauses a
    /// workflow whose policy is [`OnError::Pause`]; then the children whose joins decided are
    /// promoted or skipped (skips propagate), unless the workflow is paused or cancelled. In a
    /// cancelled workflow the step's state is recorded and nothing else happens. The same as
    /// [`steps_finished`](Self::steps_finished) with this one finish.
    pub fn step_finished(&mut self, step: StepId, outcome: StepOutcome) -> Result<Changes, EventError> {
        self.steps_finished(&[(step, outcome)])
    }

    /// Several steps' tasks finished at once (one statement of a store finished them all), as
    /// one event: every step as [`step_finished`](Self::step_finished) allows it (each at most
    /// once), or none is recorded. All of them are recorded and counted in their children
    /// first; if one of them failed, was cancelled or expired, a workflow whose policy is
    /// [`OnError::Pause`] pauses; only then do the children decide. So a completion finished
    /// together with a failure promotes nothing in such a workflow, whatever their order.
    pub fn steps_finished(&mut self, finishes: &[(StepId, StepOutcome)]) -> Result<Changes, EventError> {
        let mut seen = BTreeMap::new();
        for &(step, outcome) in finishes {
            let state = self.known(step)?;
            let allowed = match state {
                StepState::Ready | StepState::Running => true,
                StepState::Waiting => matches!(outcome, StepOutcome::Cancelled | StepOutcome::Expired),
                _ => false,
            };
            if let Some(&first) = seen.get(&step) {
                // Finished earlier in this batch: it is in that outcome's state now.
                let state = StepState::from(ParentOutcome::from(first));
                return Err(EventError::CannotFinish { step, state, outcome });
            }
            seen.insert(step, outcome);
            if !allowed {
                return Err(EventError::CannotFinish { step, state, outcome });
            }
        }
        let mut work = BTreeSet::new();
        for &(step, outcome) in finishes {
            self.held.remove(&step);
            let outcome = ParentOutcome::from(outcome);
            self.set_state(step, outcome.into());
            if outcome != ParentOutcome::Completed && self.on_error == OnError::Pause && !self.cancelled {
                self.paused = true;
            }
            self.count_finish(step, outcome, &mut work);
        }
        let mut changes = Changes::new(WorkflowStatus::Running);
        if !self.cancelled {
            self.settle(work, &mut changes);
        }
        Ok(self.close(changes))
    }

    /// Pauses the workflow: from now on no step is promoted or skipped; the steps whose joins
    /// decide are held and applied on resume. Ready and running steps are left alone. Pausing a
    /// paused workflow does nothing; one that is over cannot be paused.
    pub fn pause(&mut self) -> Result<Changes, EventError> {
        match self.status() {
            WorkflowStatus::Running | WorkflowStatus::Paused => self.paused = true,
            status => return Err(EventError::WorkflowOver { status, action: "paused" }),
        }
        Ok(self.close(Changes::new(WorkflowStatus::Running)))
    }

    /// Resumes a paused workflow: the held decisions are applied (promotions and skips, which
    /// propagate). Resuming a running workflow does nothing; one that is over cannot be
    /// resumed.
    pub fn resume(&mut self) -> Result<Changes, EventError> {
        let mut changes = Changes::new(WorkflowStatus::Running);
        match self.status() {
            WorkflowStatus::Running => {}
            WorkflowStatus::Paused => {
                self.paused = false;
                let held = std::mem::take(&mut self.held);
                self.settle(held, &mut changes);
            }
            status => return Err(EventError::WorkflowOver { status, action: "resumed" }),
        }
        Ok(self.close(changes))
    }

    /// Cancels the workflow: every waiting or ready step is cancelled, every running step is
    /// listed to abort (its finish is recorded when it comes), and nothing is promoted or
    /// skipped any more. Cancelling a cancelled workflow does nothing; a completed or failed one
    /// cannot be cancelled.
    pub fn cancel(&mut self) -> Result<Changes, EventError> {
        let mut changes = Changes::new(WorkflowStatus::Cancelled);
        match self.status() {
            WorkflowStatus::Running | WorkflowStatus::Paused => {}
            WorkflowStatus::Cancelled => return Ok(self.close(changes)),
            status => return Err(EventError::WorkflowOver { status, action: "cancelled" }),
        }
        self.cancelled = true;
        self.paused = false;
        self.held.clear();
        let mut ignored = BTreeSet::new();
        for index in 0..self.states.len() {
            let step = StepId(index as u32);
            match self.states[index] {
                StepState::Waiting | StepState::Ready => {
                    self.set_state(step, StepState::Cancelled);
                    self.count_finish(step, ParentOutcome::Cancelled, &mut ignored);
                    changes.cancelled.push(step);
                }
                StepState::Running => changes.abort.push(step),
                _ => {}
            }
        }
        Ok(self.close(changes))
    }

    /// Retries the steps that finished without completing (failed, cancelled, expired or
    /// skipped) and, if `downstream`, every finished step below them too (completed ones
    /// included, so they run again on their parents' new results): each becomes waiting, its
    /// children's counts forget its outcome, and the joins decide again (the workflow's pause
    /// still holds them). A cancelled workflow is reopened. Steps not finished (waiting, ready,
    /// running) are never touched, whatever is above them. Allowed in every status; with
    /// nothing to retry it changes nothing but a cancelled workflow's status.
    pub fn retry_failed(&mut self, downstream: bool) -> Result<Changes, EventError> {
        let failed = |s: StepState| s.is_finished() && s != StepState::Completed;
        let mut reset: BTreeSet<StepId> =
            (0..self.states.len()).filter(|&i| failed(self.states[i])).map(|i| StepId(i as u32)).collect();
        if downstream {
            let mut seen: BTreeSet<StepId> = reset.clone();
            let mut stack: Vec<StepId> = reset.iter().copied().collect();
            while let Some(step) = stack.pop() {
                for &(child, _) in &self.graph.children[step.index()] {
                    if seen.insert(child) {
                        stack.push(child);
                        if self.states[child.index()].is_finished() {
                            reset.insert(child);
                        }
                    }
                }
            }
        }
        let mut work = BTreeSet::new();
        for &step in &reset {
            let Some(outcome) = self.states[step.index()].outcome() else { continue };
            for &(child, policy) in &self.graph.children[step.index()] {
                let counts = &mut self.counts[child.index()];
                *counts = on_parent_reset(*counts, policy, outcome);
                work.insert(child);
            }
            self.set_state(step, StepState::Waiting);
            work.insert(step);
        }
        self.cancelled = false;
        let mut changes = Changes::new(WorkflowStatus::Running);
        changes.reset = reset.into_iter().collect();
        self.settle(work, &mut changes);
        Ok(self.close(changes))
    }

    fn known(&self, step: StepId) -> Result<StepState, EventError> {
        self.state(step).ok_or(EventError::UnknownStep { step, steps: self.states.len() })
    }

    fn set_state(&mut self, step: StepId, to: StepState) {
        let from = std::mem::replace(&mut self.states[step.index()], to);
        *self.step_counts.slot(from) -= 1;
        *self.step_counts.slot(to) += 1;
        if self.graph.children[step.index()].is_empty() {
            if from == StepState::Completed {
                self.sinks_completed -= 1;
            }
            if to == StepState::Completed {
                self.sinks_completed += 1;
            }
        }
    }

    /// Counts `step`'s finish with `outcome` in each child's counts; the waiting children go
    /// into `work` to decide again.
    fn count_finish(&mut self, step: StepId, outcome: ParentOutcome, work: &mut BTreeSet<StepId>) {
        for &(child, policy) in &self.graph.children[step.index()] {
            let counts = &mut self.counts[child.index()];
            *counts = on_parent_finished(*counts, policy, outcome);
            if self.states[child.index()] == StepState::Waiting {
                work.insert(child);
            }
        }
    }

    /// Decides every waiting step of `work` and applies the decisions (a skip is a finish:
    /// its waiting children join the work), or, while paused, only records them as held.
    fn settle(&mut self, mut work: BTreeSet<StepId>, changes: &mut Changes) {
        while let Some(step) = work.pop_first() {
            if self.states[step.index()] != StepState::Waiting {
                continue;
            }
            let decision = decide(self.joins[step.index()], &self.counts[step.index()]);
            if self.paused {
                if decision == Decision::Wait {
                    self.held.remove(&step);
                } else {
                    self.held.insert(step);
                }
                continue;
            }
            match decision {
                Decision::Wait => {}
                Decision::Ready => {
                    self.set_state(step, StepState::Ready);
                    changes.ready.push(step);
                }
                Decision::Skip => {
                    self.set_state(step, StepState::Skipped);
                    changes.skipped.push(step);
                    self.count_finish(step, ParentOutcome::Skipped, &mut work);
                }
            }
        }
    }

    /// Closes an event: a workflow with every step finished is no longer paused; the lists are
    /// sorted and the status filled in.
    fn close(&mut self, mut changes: Changes) -> Changes {
        if self.step_counts.unfinished() == 0 {
            self.paused = false;
            self.held.clear();
        }
        changes.ready.sort_unstable();
        changes.skipped.sort_unstable();
        changes.status = self.status();
        changes
    }
}
