//! Workflows: graphs of steps where a step runs once its parents finished (issue 22).
//!
//! A workflow is a directed acyclic graph ([`WorkflowSpec`]). Each step is an ordinary task
//! that waits, not claimable, until its *join* over its parents is satisfied; then it becomes
//! claimable, or, if its join can no longer be satisfied, it is *skipped* and never runs. This
//! module is the pure core of it: the graph and its checks, the per-edge decision
//! ([`on_parent_finished`], [`decide`]) that a store applies when a parent finishes, and a
//! whole-workflow machine ([`WorkflowState`]) that applies those decisions to every step.
//!
//! # The rule
//!
//! Each edge `parent -> child` has a policy. When a parent finishes, the edge is
//! **satisfied** or **unsatisfied**:
//!
//! | parent outcome | [`RequireSuccess`] (default) | [`AllowFailed`] |
//! |---|---|---|
//! | completed | satisfied | satisfied |
//! | failed, cancelled, expired | unsatisfied | satisfied |
//! | skipped | unsatisfied | satisfied |
//!
//! A waiting step keeps three numbers, [`JoinCounts`]: its parents, those finished satisfied,
//! those finished unsatisfied (the rest are unfinished). Its join needs `required` satisfied
//! parents ([`Join::required`]): all of them for [`Join::All`] (the default), one for
//! [`Join::Any`], `n` for [`Join::Quorum`]. Then [`decide`] says:
//!
//! | decision | when | all | any | quorum(n) |
//! |---|---|---|---|---|
//! | **Ready** | `satisfied >= required` | every parent satisfied | one satisfied | `n` satisfied |
//! | **Skip** | `satisfied + unfinished < required` | one unsatisfied | all finished, none satisfied | fewer than `n` still possible |
//! | **Wait** | otherwise | | | |
//!
//! Put together, what one parent's finish does to a waiting child:
//!
//! | parent outcome × edge | counts as | all | any | quorum(n) |
//! |---|---|---|---|---|
//! | completed × either | satisfied | Ready if it was the last unfinished parent, else Wait | Ready | Ready if it is the `n`-th satisfied, else Wait |
//! | failed, cancelled, expired, skipped × require_success | unsatisfied | Skip | Skip if it was the last unfinished parent and none satisfied, else Wait | Skip if `n` is now out of reach, else Wait |
//! | failed, cancelled, expired, skipped × allow_failed | satisfied | as completed | as completed | as completed |
//!
//! Both conditions are monotone: once a step is decided, later finishes of its other parents
//! never change the decision, and once all its parents finished it is decided. A skipped step
//! is a finish with outcome [`Skipped`](ParentOutcome::Skipped) for its children, so skips
//! propagate down until an [`AllowFailed`] edge or an any/quorum join stops them.
//!
//! **Why a skipped parent satisfies an `allow_failed` edge.** `allow_failed` marks a recovery
//! or clean-up step: "run me after this parent, whatever happened to it". A parent skipped
//! because something above it failed did not complete either, and the step that would
//! recover from it is needed all the more; if skips went through `allow_failed` edges, a
//! failure two levels up would silently remove the recovery step. The child reads the
//! parent's result and sees it was skipped. So the edge policy is one predicate: required
//! edges ask for completion, `allow_failed` edges for any finish.
//!
//! # The workflow
//!
//! [`WorkflowState`] holds every step's [`StepState`]: waiting, ready (claimable), running,
//! then completed, failed, cancelled, expired or skipped. Events:
//!
//! - [`submit`](WorkflowState::submit): steps without parents become ready.
//! - [`step_started`](WorkflowState::step_started): ready to running (optional: a finish may
//!   come straight from ready).
//! - [`step_finished`](WorkflowState::step_finished): a step's task finished; its children's
//!   counts change and the decided ones are promoted or skipped. A waiting step may be
//!   cancelled on its own, by an operator (its children see that outcome); the rules allow a
//!   waiting step to expire too, though both stores expire a step only once it is promoted
//!   (a good-until that passed while it waited expires it at its first claim or reap).
//!   [`steps_finished`](WorkflowState::steps_finished) is the same for several steps at once,
//!   as one event: what one statement of a store finished.
//! - [`pause`](WorkflowState::pause), [`resume`](WorkflowState::resume): while paused, no
//!   step is promoted *or skipped*; a waiting step whose join decides is *held* (its
//!   [`WaitReason::held`] says how) and the decision is applied on resume. Steps already
//!   ready or running go on. Holding skips too means a retry during the pause loses nothing.
//! - [`cancel`](WorkflowState::cancel): waiting and ready steps are cancelled, running ones
//!   listed to abort; nothing is promoted or skipped afterwards.
//! - [`retry_failed`](WorkflowState::retry_failed)`(downstream)`: the failed, cancelled,
//!   expired and skipped steps (and with `downstream` every finished step below them) wait
//!   again and their joins decide anew; steps not finished are never touched.
//!
//! With [`OnError::Pause`], a step that fails, is cancelled or expires pauses the workflow
//! before its children decide, so an operator can retry it before anything is skipped. The
//! rule is per event, and the steps one statement finishes are one event: if one of them
//! failed, was cancelled or expired, none of their children decides, not even those of a step
//! the same statement completed before it (a worker's finish of a batch, a reaper's pass: the
//! order of rows within a statement means nothing).
//!
//! The status ([`WorkflowStatus`]), in order:
//!
//! 1. **Cancelled** after a cancel (until a retry).
//! 2. Once every step finished: **Completed** if every *sink* step (one without children)
//!    completed, else **Failed**. A failure handled by an `allow_failed` recovery step, or
//!    outvoted in an any/quorum join, does not fail the workflow; a sink that failed or was
//!    skipped does. A workflow whose steps all finished is no longer paused: there is nothing
//!    left to hold, and a retry reopens it.
//! 3. **Paused** while paused.
//! 4. **Running** otherwise. When not paused, every waiting step has an unfinished parent, so
//!    some step is ready or running: finishing the ready and running steps always brings a
//!    running workflow to Completed or Failed.
//!
//! Every event returns [`Changes`]: the steps that became ready, skipped or cancelled, the
//! steps to abort, the steps reset, each list ascending, and the new status. An event the
//! state does not allow returns an [`EventError`] and changes nothing.
//!
//! # The calling contract for stores
//!
//! A store keeps, per workflow, its status and [`StepCounts`], and per waiting step its
//! [`JoinCounts`] (the parents count is fixed at submit), and per edge its policy. When a
//! statement has finished steps (when it ends: a statement that finishes steps and then claims
//! does not claim the children it promotes), it takes them as one batch: it pauses the
//! workflows that pause on error if one of their steps in the batch did not complete, then for
//! each finished parent and each of its edges it applies [`on_parent_finished`] to the child's
//! counts, then [`decide`]s every waiting child whose counts changed: Ready makes it claimable,
//! Skip marks it skipped and is itself a finish of that child, to be propagated the same way
//! until no step is skipped (a chain of skips is as long as the graph is deep), Wait leaves it.
//! The statement notifies each queue that received promoted steps once, with their most urgent
//! priority (the same for a resume, skips and their consequences included). In SQL the
//! decision is the threshold of [`decide`] on the child's row: ready when `satisfied >=
//! required`, skipped when `parents - unsatisfied < required`. [`WorkflowState`] is the
//! specification of the whole: the memory store may run it directly, and the SQL must agree
//! with it event for event.
//!
//! # Limits
//!
//! At most [`MAX_STEPS`] steps and [`MAX_EDGES`] edges; no self edges, no edge given twice,
//! no cycle; a quorum between 1 and the step's parents; steps without parents join with
//! `all`. [`WorkflowSpec::check`] reports the first violation. Every event costs time in
//! proportion to the steps and edges it touches, except cancel and retry, which scan the
//! steps once.
//!
//! [`RequireSuccess`]: EdgePolicy::RequireSuccess
//! [`AllowFailed`]: EdgePolicy::AllowFailed

mod join;
mod spec;
mod state;

#[cfg(test)]
mod tests;

pub use join::{Decision, JoinCounts, decide, on_parent_finished, on_parent_reset};
pub use spec::{
    Edge, EdgePolicy, Join, MAX_EDGES, MAX_STEPS, OnError, ParentOutcome, StepId, StepOutcome, StepSpec, WorkflowError,
    WorkflowSpec,
};
pub use state::{Changes, EventError, StepCounts, StepState, WaitReason, WorkflowState, WorkflowStatus};
