//! Workflows: graphs of steps where a step runs once its parents finished (issue 22).
//!
//! A workflow is a directed acyclic graph ([`WorkflowSpec`]). Each step is an ordinary task
//! that waits, not claimable, until its *join* over its parents is satisfied; then it becomes
//! claimable, or, if its join can no longer be satisfied, it is *skipped* and never runs. This
//! module is the pure core of it: the graph and its checks, and the per-edge decision
//! ([`on_parent_finished`], [`decide`]) that a store applies when a parent finishes.

mod join;
mod spec;

pub use join::{Decision, JoinCounts, decide, on_parent_finished, on_parent_reset};
pub use spec::{
    Edge, EdgePolicy, Join, MAX_EDGES, MAX_STEPS, OnError, ParentOutcome, StepId, StepOutcome, StepSpec, WorkflowError,
    WorkflowSpec,
};
