//! The shape of a workflow: its steps, their joins, the edges between them with their policies,
//! and the checks a graph must pass before it is submitted.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The most steps one workflow may have.
///
/// Large enough for the 10,000-way fan-out and fan-in the issue targets with room to spare,
/// small enough that a submit is one bounded statement and every count fits a `u32`.
pub const MAX_STEPS: usize = 100_000;

/// The most edges one workflow may have: ten per step on average at the step limit.
pub const MAX_EDGES: usize = 1_000_000;

/// A step of a workflow: its index in [`WorkflowSpec::steps`], from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StepId(pub u32);

impl StepId {
    /// The step's index in [`WorkflowSpec::steps`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for StepId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How a step joins over its parents: how many of them must finish in a way that satisfies
/// their edge before it runs. A parent that finished otherwise counts against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Join {
    /// Every parent (the default; vacuous for a step without parents, which runs at once).
    #[default]
    All,
    /// At least one parent.
    Any,
    /// At least this many parents, from 1 to the number of parents.
    Quorum(u32),
}

impl Join {
    /// How many satisfying parents a step with `parents` parents needs: the whole join is the
    /// threshold rule of [`decide`](super::decide) over this number.
    pub fn required(self, parents: u32) -> u32 {
        match self {
            Join::All => parents,
            Join::Any => 1,
            Join::Quorum(n) => n,
        }
    }
}

impl fmt::Display for Join {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Join::All => f.write_str("all"),
            Join::Any => f.write_str("any"),
            Join::Quorum(n) => write!(f, "quorum({n})"),
        }
    }
}

/// What an edge asks of its parent for the child to count it as satisfied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgePolicy {
    /// The parent must complete (the default): any other outcome counts against the child.
    #[default]
    RequireSuccess,
    /// Any finish satisfies the edge, failed, cancelled, expired or skipped included: the child
    /// runs after its parent whatever happened to it (a recovery or clean-up step) and reads
    /// the parent's result to branch on it.
    AllowFailed,
}

impl EdgePolicy {
    /// Whether a parent that finished with `outcome` satisfies an edge of this policy.
    pub fn satisfied_by(self, outcome: ParentOutcome) -> bool {
        match self {
            EdgePolicy::RequireSuccess => outcome == ParentOutcome::Completed,
            EdgePolicy::AllowFailed => true,
        }
    }
}

impl fmt::Display for EdgePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EdgePolicy::RequireSuccess => "require_success",
            EdgePolicy::AllowFailed => "allow_failed",
        })
    }
}

/// How a parent finished, as its children see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParentOutcome {
    /// It ran and returned a result.
    Completed,
    /// It ran and failed with no retry left.
    Failed,
    /// It was cancelled (before or while it ran).
    Cancelled,
    /// Its good-until time passed before it ran.
    Expired,
    /// Its join could no longer be satisfied, so it never ran.
    Skipped,
}

impl fmt::Display for ParentOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ParentOutcome::Completed => "completed",
            ParentOutcome::Failed => "failed",
            ParentOutcome::Cancelled => "cancelled",
            ParentOutcome::Expired => "expired",
            ParentOutcome::Skipped => "skipped",
        })
    }
}

/// How a step's task finished: the outcomes a store reports (skipping is the workflow's own
/// decision, never reported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcome {
    /// It ran and returned a result.
    Completed,
    /// It ran and failed with no retry left.
    Failed,
    /// It was cancelled (before or while it ran).
    Cancelled,
    /// Its good-until time passed before it ran.
    Expired,
}

impl From<StepOutcome> for ParentOutcome {
    fn from(outcome: StepOutcome) -> Self {
        match outcome {
            StepOutcome::Completed => ParentOutcome::Completed,
            StepOutcome::Failed => ParentOutcome::Failed,
            StepOutcome::Cancelled => ParentOutcome::Cancelled,
            StepOutcome::Expired => ParentOutcome::Expired,
        }
    }
}

impl fmt::Display for StepOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        ParentOutcome::from(*self).fmt(f)
    }
}

/// What a workflow does when one of its steps fails, is cancelled or expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Skip what can no longer run and go on with the rest (the default).
    #[default]
    Continue,
    /// Pause the workflow: no step is promoted or skipped until it is resumed.
    Pause,
}

/// One step of a workflow's graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StepSpec {
    /// How the step joins over its parents.
    #[serde(default)]
    pub join: Join,
}

/// An edge of a workflow's graph: `child` waits for `parent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Edge {
    /// The step waited for.
    pub parent: StepId,
    /// The waiting step.
    pub child: StepId,
    /// What the child asks of the parent.
    #[serde(default)]
    pub policy: EdgePolicy,
}

/// A workflow's graph: steps with their joins, edges with their policies, and the failure
/// policy. [`check`](Self::check) says whether it can be submitted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WorkflowSpec {
    /// The steps; a step's [`StepId`] is its index here.
    pub steps: Vec<StepSpec>,
    /// The edges, in any order.
    #[serde(default)]
    pub edges: Vec<Edge>,
    /// What a failed step does to the workflow.
    #[serde(default)]
    pub on_error: OnError,
}

impl WorkflowSpec {
    /// An empty graph with this failure policy.
    pub fn new(on_error: OnError) -> Self {
        WorkflowSpec { steps: Vec::new(), edges: Vec::new(), on_error }
    }

    /// Adds a step with this join and returns its id.
    pub fn add_step(&mut self, join: Join) -> StepId {
        let id = StepId(u32::try_from(self.steps.len()).unwrap_or(u32::MAX));
        self.steps.push(StepSpec { join });
        id
    }

    /// Adds an edge: `child` waits for `parent` under `policy`.
    pub fn add_edge(&mut self, parent: StepId, child: StepId, policy: EdgePolicy) {
        self.edges.push(Edge { parent, child, policy });
    }

    /// Whether this graph can be submitted: at least one and at most [`MAX_STEPS`] steps, at
    /// most [`MAX_EDGES`] edges, every edge between two known steps, no edge from a step to
    /// itself, no edge given twice (whatever its policies), a join of `all` on every step
    /// without parents, a quorum from 1 to the step's number of parents, and no cycle. The
    /// first problem found is reported, in that order.
    pub fn check(&self) -> Result<(), WorkflowError> {
        Graph::build(self).map(|_| ())
    }
}

/// Why a graph cannot be submitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkflowError {
    /// The graph has no steps.
    #[error("a workflow needs at least one step")]
    Empty,
    /// The graph has more than [`MAX_STEPS`] steps.
    #[error("a workflow has {steps} steps, expected at most {MAX_STEPS}")]
    TooManySteps {
        /// How many it has.
        steps: usize,
    },
    /// The graph has more than [`MAX_EDGES`] edges.
    #[error("a workflow has {edges} edges, expected at most {MAX_EDGES}")]
    TooManyEdges {
        /// How many it has.
        edges: usize,
    },
    /// An edge names a step the graph does not have.
    #[error("edge {parent} -> {child} names step {step}, but the workflow has {steps} steps")]
    UnknownStep {
        /// The edge's parent.
        parent: StepId,
        /// The edge's child.
        child: StepId,
        /// The unknown one of the two.
        step: StepId,
        /// How many steps the graph has.
        steps: usize,
    },
    /// An edge goes from a step to itself.
    #[error("step {step} waits for itself")]
    SelfEdge {
        /// The step.
        step: StepId,
    },
    /// Two edges join the same parent to the same child.
    #[error("edge {parent} -> {child} is given twice")]
    DuplicateEdge {
        /// The edges' parent.
        parent: StepId,
        /// The edges' child.
        child: StepId,
    },
    /// A step without parents has a join other than `all`: it could never run.
    #[error("step {step} has no parents, so its join must be all, not {join}")]
    RootJoin {
        /// The step.
        step: StepId,
        /// Its join.
        join: Join,
    },
    /// A quorum of 0 or of more than the step's parents.
    #[error("step {step} has join quorum({quorum}), expected a quorum from 1 to {parents} (its parents)")]
    Quorum {
        /// The step.
        step: StepId,
        /// The quorum asked for.
        quorum: u32,
        /// How many parents the step has.
        parents: u32,
    },
    /// The edges form a cycle.
    #[error("steps wait for each other in a cycle: {}", cycle_text(.steps))]
    Cycle {
        /// The steps of one cycle, each a parent of the next and the last a parent of the
        /// first, starting from the smallest.
        steps: Vec<StepId>,
    },
}

fn cycle_text(steps: &[StepId]) -> String {
    let mut text: Vec<String> = steps.iter().map(ToString::to_string).collect();
    if let Some(first) = steps.first() {
        text.push(first.to_string());
    }
    text.join(" -> ")
}

/// A checked graph with its adjacency: each step's parents and children, sorted by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Graph {
    pub(crate) parents: Vec<Vec<(StepId, EdgePolicy)>>,
    pub(crate) children: Vec<Vec<(StepId, EdgePolicy)>>,
}

impl Graph {
    /// Checks `spec` (see [`WorkflowSpec::check`]) and builds its adjacency.
    pub(crate) fn build(spec: &WorkflowSpec) -> Result<Graph, WorkflowError> {
        let steps = spec.steps.len();
        if steps == 0 {
            return Err(WorkflowError::Empty);
        }
        if steps > MAX_STEPS {
            return Err(WorkflowError::TooManySteps { steps });
        }
        if spec.edges.len() > MAX_EDGES {
            return Err(WorkflowError::TooManyEdges { edges: spec.edges.len() });
        }
        let mut seen = BTreeSet::new();
        let mut parents = vec![Vec::new(); steps];
        let mut children = vec![Vec::new(); steps];
        for edge in &spec.edges {
            let Edge { parent, child, policy } = *edge;
            if let Some(step) = [parent, child].into_iter().find(|s| s.index() >= steps) {
                return Err(WorkflowError::UnknownStep { parent, child, step, steps });
            }
            if parent == child {
                return Err(WorkflowError::SelfEdge { step: parent });
            }
            if !seen.insert((parent, child)) {
                return Err(WorkflowError::DuplicateEdge { parent, child });
            }
            parents[child.index()].push((parent, policy));
            children[parent.index()].push((child, policy));
        }
        for list in parents.iter_mut().chain(children.iter_mut()) {
            list.sort_unstable();
        }
        for (index, (step, list)) in spec.steps.iter().zip(&parents).enumerate() {
            let id = StepId(index as u32);
            // At most MAX_EDGES parents: fits.
            let count = list.len() as u32;
            match step.join {
                Join::All => {}
                join @ (Join::Any | Join::Quorum(_)) if count == 0 => {
                    return Err(WorkflowError::RootJoin { step: id, join });
                }
                Join::Quorum(quorum) if quorum == 0 || quorum > count => {
                    return Err(WorkflowError::Quorum { step: id, quorum, parents: count });
                }
                Join::Any | Join::Quorum(_) => {}
            }
        }
        let graph = Graph { parents, children };
        match graph.find_cycle() {
            Some(cycle) => Err(WorkflowError::Cycle { steps: cycle }),
            None => Ok(graph),
        }
    }

    /// The steps of one cycle, or `None` if the graph is acyclic. Kahn's algorithm removes
    /// every step not on or below a cycle; each step left has a parent left, so walking up from
    /// one must come back to a step already seen.
    fn find_cycle(&self) -> Option<Vec<StepId>> {
        let steps = self.parents.len();
        let mut waiting: Vec<usize> = self.parents.iter().map(Vec::len).collect();
        let mut ready: Vec<usize> = (0..steps).filter(|&s| waiting[s] == 0).collect();
        let mut removed = vec![false; steps];
        while let Some(step) = ready.pop() {
            removed[step] = true;
            for &(child, _) in &self.children[step] {
                let left = &mut waiting[child.index()];
                *left -= 1;
                if *left == 0 {
                    ready.push(child.index());
                }
            }
        }
        let start = removed.iter().position(|&r| !r)?;
        let mut position = vec![usize::MAX; steps];
        let mut path = Vec::new();
        let mut step = start;
        while position[step] == usize::MAX {
            position[step] = path.len();
            path.push(StepId(step as u32));
            // A step left by Kahn's algorithm has a parent left too.
            step = self.parents[step].iter().map(|(p, _)| p.index()).find(|&p| !removed[p])?;
        }
        // path[position[step]..] walks from child to parent: reverse it into parent order.
        let mut cycle: Vec<StepId> = path[position[step]..].iter().rev().copied().collect();
        let smallest = cycle.iter().enumerate().min_by_key(|(_, s)| **s).map_or(0, |(i, _)| i);
        cycle.rotate_left(smallest);
        Some(cycle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(joins: &[Join], edges: &[(u32, u32)]) -> WorkflowSpec {
        let mut spec = WorkflowSpec::new(OnError::Continue);
        for &join in joins {
            spec.add_step(join);
        }
        for &(parent, child) in edges {
            spec.add_edge(StepId(parent), StepId(child), EdgePolicy::RequireSuccess);
        }
        spec
    }

    fn all(n: usize) -> Vec<Join> {
        vec![Join::All; n]
    }

    #[test]
    fn a_diamond_passes() {
        assert_eq!(spec(&all(4), &[(0, 1), (0, 2), (1, 3), (2, 3)]).check(), Ok(()));
        let mut joins = all(4);
        joins[3] = Join::Quorum(2);
        assert_eq!(spec(&joins, &[(0, 1), (0, 2), (1, 3), (2, 3)]).check(), Ok(()));
        joins[3] = Join::Any;
        assert_eq!(spec(&joins, &[(0, 1), (0, 2), (1, 3), (2, 3)]).check(), Ok(()));
    }

    #[test]
    fn empty_and_oversized_graphs_are_refused() {
        assert_eq!(spec(&[], &[]).check(), Err(WorkflowError::Empty));
        let big = WorkflowSpec { steps: vec![StepSpec::default(); MAX_STEPS + 1], ..WorkflowSpec::default() };
        assert_eq!(big.check(), Err(WorkflowError::TooManySteps { steps: MAX_STEPS + 1 }));
        let limit = WorkflowSpec { steps: vec![StepSpec::default(); MAX_STEPS], ..WorkflowSpec::default() };
        assert_eq!(limit.check(), Ok(()));
        let edge = Edge { parent: StepId(0), child: StepId(1), policy: EdgePolicy::RequireSuccess };
        let dense = WorkflowSpec {
            steps: vec![StepSpec::default(); 2],
            edges: vec![edge; MAX_EDGES + 1],
            ..WorkflowSpec::default()
        };
        assert_eq!(dense.check(), Err(WorkflowError::TooManyEdges { edges: MAX_EDGES + 1 }));
    }

    #[test]
    fn edges_must_name_known_distinct_steps_once() {
        let err = spec(&all(2), &[(0, 2)]).check().unwrap_err();
        assert_eq!(err, WorkflowError::UnknownStep { parent: StepId(0), child: StepId(2), step: StepId(2), steps: 2 });
        assert_eq!(err.to_string(), "edge 0 -> 2 names step 2, but the workflow has 2 steps");
        assert_eq!(spec(&all(2), &[(1, 1)]).check(), Err(WorkflowError::SelfEdge { step: StepId(1) }));
        let mut twice = spec(&all(2), &[(0, 1)]);
        twice.add_edge(StepId(0), StepId(1), EdgePolicy::AllowFailed);
        assert_eq!(twice.check(), Err(WorkflowError::DuplicateEdge { parent: StepId(0), child: StepId(1) }));
    }

    #[test]
    fn joins_must_be_satisfiable() {
        let err = spec(&[Join::Any], &[]).check().unwrap_err();
        assert_eq!(err, WorkflowError::RootJoin { step: StepId(0), join: Join::Any });
        assert_eq!(err.to_string(), "step 0 has no parents, so its join must be all, not any");
        assert!(matches!(spec(&[Join::Quorum(1)], &[]).check(), Err(WorkflowError::RootJoin { .. })));
        let joins = [Join::All, Join::All, Join::Quorum(3)];
        let err = spec(&joins, &[(0, 2), (1, 2)]).check().unwrap_err();
        assert_eq!(err, WorkflowError::Quorum { step: StepId(2), quorum: 3, parents: 2 });
        assert_eq!(err.to_string(), "step 2 has join quorum(3), expected a quorum from 1 to 2 (its parents)");
        let joins = [Join::All, Join::Quorum(0)];
        assert!(matches!(spec(&joins, &[(0, 1)]).check(), Err(WorkflowError::Quorum { quorum: 0, .. })));
    }

    #[test]
    fn a_cycle_is_reported_with_its_steps() {
        // 0 -> 1 -> 2 -> 3 -> 1, and 3 -> 4 below the cycle.
        let err = spec(&all(5), &[(0, 1), (1, 2), (2, 3), (3, 1), (3, 4)]).check().unwrap_err();
        assert_eq!(err, WorkflowError::Cycle { steps: vec![StepId(1), StepId(2), StepId(3)] });
        assert_eq!(err.to_string(), "steps wait for each other in a cycle: 1 -> 2 -> 3 -> 1");
        let err = spec(&all(3), &[(2, 0), (0, 2)]).check().unwrap_err();
        assert_eq!(err, WorkflowError::Cycle { steps: vec![StepId(0), StepId(2)] });
    }

    #[test]
    fn the_graph_round_trips_through_json() {
        let mut s = spec(&[Join::All, Join::All, Join::Quorum(1)], &[(0, 2)]);
        s.add_edge(StepId(1), StepId(2), EdgePolicy::AllowFailed);
        s.on_error = OnError::Pause;
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["steps"][2]["join"], serde_json::json!({"quorum": 1}));
        assert_eq!(json["edges"][1]["policy"], "allow_failed");
        assert_eq!(json["on_error"], "pause");
        assert_eq!(serde_json::from_value::<WorkflowSpec>(json).unwrap(), s);
        let short: WorkflowSpec =
            serde_json::from_str(r#"{"steps": [{}, {"join": "any"}], "edges": [{"parent": 0, "child": 1}]}"#).unwrap();
        assert_eq!(short.edges[0].policy, EdgePolicy::RequireSuccess);
        assert_eq!(short.on_error, OnError::Continue);
        assert_eq!(short.check(), Ok(()));
    }
}
