//! The workflow machine: unit tests of each rule, and property tests against a reference model
//! that recomputes every step's decision from scratch after every event.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

use EdgePolicy::{AllowFailed, RequireSuccess};

fn s(id: u32) -> StepId {
    StepId(id)
}

fn ids(list: &[u32]) -> Vec<StepId> {
    list.iter().copied().map(StepId).collect()
}

/// A graph from joins and `(parent, child, policy)` edges.
fn graph(on_error: OnError, joins: &[Join], edges: &[(u32, u32, EdgePolicy)]) -> WorkflowSpec {
    let mut spec = WorkflowSpec::new(on_error);
    for &join in joins {
        spec.add_step(join);
    }
    for &(parent, child, policy) in edges {
        spec.add_edge(s(parent), s(child), policy);
    }
    spec
}

fn submit(spec: &WorkflowSpec) -> (WorkflowState, Changes) {
    WorkflowState::submit(spec).expect("a valid graph")
}

fn done(wf: &mut WorkflowState, step: u32, outcome: StepOutcome) -> Changes {
    wf.step_finished(s(step), outcome).expect("a finish the state allows")
}

const ALL4: [Join; 4] = [Join::All; 4];

#[test]
fn a_diamond_runs_step_by_step_and_completes() {
    let spec = graph(
        OnError::Continue,
        &ALL4,
        &[(0, 1, RequireSuccess), (0, 2, RequireSuccess), (1, 3, RequireSuccess), (2, 3, RequireSuccess)],
    );
    let (mut wf, changes) = submit(&spec);
    assert_eq!(changes.ready, ids(&[0]));
    assert_eq!(changes.status, WorkflowStatus::Running);
    wf.step_started(s(0)).unwrap();
    assert_eq!(wf.state(s(0)), Some(StepState::Running));
    assert_eq!(done(&mut wf, 0, StepOutcome::Completed).ready, ids(&[1, 2]));
    assert_eq!(done(&mut wf, 2, StepOutcome::Completed).ready, ids(&[]));
    let reason = wf.waiting_reasons(s(3)).unwrap();
    assert_eq!(reason, WaitReason { unfinished: ids(&[1]), needed: 1, held: None });
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).ready, ids(&[3]));
    assert_eq!(wf.waiting_reasons(s(3)), None);
    let last = done(&mut wf, 3, StepOutcome::Completed);
    assert_eq!(last.status, WorkflowStatus::Completed);
    assert_eq!(wf.step_counts(), StepCounts { completed: 4, ..StepCounts::default() });
}

#[test]
fn a_failure_skips_its_dependents_while_independent_branches_run_on_then_the_workflow_fails() {
    // 0 -> 1 -> 2, and 3 alone.
    let spec = graph(OnError::Continue, &ALL4, &[(0, 1, RequireSuccess), (1, 2, RequireSuccess)]);
    let (mut wf, changes) = submit(&spec);
    assert_eq!(changes.ready, ids(&[0, 3]));
    let failed = done(&mut wf, 0, StepOutcome::Failed);
    assert_eq!(failed.skipped, ids(&[1, 2]));
    assert_eq!(failed.status, WorkflowStatus::Running);
    assert_eq!(done(&mut wf, 3, StepOutcome::Completed).status, WorkflowStatus::Failed);
    let counts = wf.step_counts();
    assert_eq!((counts.failed, counts.skipped, counts.completed), (1, 2, 1));
}

#[test]
fn cancelled_and_expired_parents_skip_like_failed_ones() {
    for outcome in [StepOutcome::Cancelled, StepOutcome::Expired] {
        let spec = graph(OnError::Continue, &[Join::All; 2], &[(0, 1, RequireSuccess)]);
        let (mut wf, _) = submit(&spec);
        assert_eq!(done(&mut wf, 0, outcome).skipped, ids(&[1]), "{outcome}");
        assert_eq!(wf.status(), WorkflowStatus::Failed);
    }
}

#[test]
fn an_allow_failed_edge_runs_a_recovery_step_that_completes_the_workflow() {
    let spec = graph(OnError::Continue, &[Join::All; 2], &[(0, 1, AllowFailed)]);
    let (mut wf, _) = submit(&spec);
    assert_eq!(done(&mut wf, 0, StepOutcome::Failed).ready, ids(&[1]));
    // The failed step is not a sink: its recovery handled it.
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).status, WorkflowStatus::Completed);
}

#[test]
fn a_skipped_parent_satisfies_an_allow_failed_edge() {
    // 0 -> 1 (required) -> 2 (allow_failed): the clean-up step 2 runs after 0 failed.
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, RequireSuccess), (1, 2, AllowFailed)]);
    let (mut wf, _) = submit(&spec);
    let changes = done(&mut wf, 0, StepOutcome::Failed);
    assert_eq!((changes.skipped, changes.ready), (ids(&[1]), ids(&[2])));
}

#[test]
fn any_runs_on_the_first_satisfied_parent_and_skips_when_none_is() {
    let joins = [Join::All, Join::All, Join::Any];
    let spec = graph(OnError::Continue, &joins, &[(0, 2, RequireSuccess), (1, 2, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    assert_eq!(done(&mut wf, 0, StepOutcome::Failed).ready, ids(&[]));
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).ready, ids(&[2]));
    assert_eq!(done(&mut wf, 2, StepOutcome::Completed).status, WorkflowStatus::Completed);

    let (mut wf, _) = submit(&spec);
    assert_eq!(done(&mut wf, 0, StepOutcome::Failed).skipped, ids(&[]));
    assert_eq!(done(&mut wf, 1, StepOutcome::Expired).skipped, ids(&[2]));
}

#[test]
fn quorum_runs_at_n_satisfied_parents_and_skips_once_n_is_out_of_reach() {
    let joins = [Join::All, Join::All, Join::All, Join::Quorum(2)];
    let edges = [(0, 3, RequireSuccess), (1, 3, RequireSuccess), (2, 3, RequireSuccess)];
    let spec = graph(OnError::Continue, &joins, &edges);
    let (mut wf, _) = submit(&spec);
    done(&mut wf, 0, StepOutcome::Failed);
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).ready, ids(&[]));
    assert_eq!(wf.waiting_reasons(s(3)), Some(WaitReason { unfinished: ids(&[2]), needed: 1, held: None }));
    assert_eq!(done(&mut wf, 2, StepOutcome::Completed).ready, ids(&[3]));

    let (mut wf, _) = submit(&spec);
    done(&mut wf, 0, StepOutcome::Failed);
    assert_eq!(done(&mut wf, 2, StepOutcome::Cancelled).skipped, ids(&[3]));
    assert_eq!(wf.state(s(1)), Some(StepState::Ready));
    assert_eq!(wf.status(), WorkflowStatus::Running);
}

#[test]
fn a_failure_pauses_an_on_error_pause_workflow_and_resume_applies_what_was_held() {
    // 0 -> 1, 0 -> 2 (allow_failed), and 3 alone.
    let spec = graph(OnError::Pause, &ALL4, &[(0, 1, RequireSuccess), (0, 2, AllowFailed)]);
    let (mut wf, _) = submit(&spec);
    let failed = done(&mut wf, 0, StepOutcome::Failed);
    assert_eq!(failed.status, WorkflowStatus::Paused);
    assert!(failed.skipped.is_empty() && failed.ready.is_empty());
    assert_eq!(wf.held().collect::<Vec<_>>(), ids(&[1, 2]));
    assert_eq!(wf.waiting_reasons(s(1)).unwrap().held, Some(Decision::Skip));
    assert_eq!(wf.waiting_reasons(s(2)).unwrap().held, Some(Decision::Ready));
    // Ready steps go on while paused.
    assert_eq!(done(&mut wf, 3, StepOutcome::Completed).status, WorkflowStatus::Paused);
    let resumed = wf.resume().unwrap();
    assert_eq!((resumed.ready, resumed.skipped), (ids(&[2]), ids(&[1])));
    assert_eq!(done(&mut wf, 2, StepOutcome::Completed).status, WorkflowStatus::Failed);
}

#[test]
fn finishes_of_one_statement_pause_before_any_child_decides_whatever_their_order() {
    // 0 -> 2, 1 -> 3: a completion of 0 and a failure of 1 in one event.
    let spec = graph(OnError::Pause, &ALL4, &[(0, 2, RequireSuccess), (1, 3, RequireSuccess)]);
    for batch in [
        [(s(0), StepOutcome::Completed), (s(1), StepOutcome::Failed)],
        [(s(1), StepOutcome::Failed), (s(0), StepOutcome::Completed)],
    ] {
        let (mut wf, _) = submit(&spec);
        let changes = wf.steps_finished(&batch).unwrap();
        assert_eq!(changes.status, WorkflowStatus::Paused);
        assert!(changes.ready.is_empty() && changes.skipped.is_empty(), "{batch:?}: {changes:?}");
        assert_eq!(wf.held().collect::<Vec<_>>(), ids(&[2, 3]));
        let resumed = wf.resume().unwrap();
        assert_eq!((resumed.ready, resumed.skipped), (ids(&[2]), ids(&[3])));
    }
    // Without the pause, the batch decides as its finishes one by one would.
    let spec = WorkflowSpec { on_error: OnError::Continue, ..spec };
    let (mut wf, _) = submit(&spec);
    let changes = wf.steps_finished(&[(s(0), StepOutcome::Completed), (s(1), StepOutcome::Failed)]).unwrap();
    assert_eq!((changes.ready, changes.skipped), (ids(&[2]), ids(&[3])));
}

#[test]
fn a_batch_with_a_finish_the_state_does_not_allow_changes_nothing() {
    let spec = graph(OnError::Pause, &[Join::All; 3], &[(0, 1, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    let before = wf.clone();
    let twice = wf.steps_finished(&[(s(0), StepOutcome::Failed), (s(0), StepOutcome::Completed)]).unwrap_err();
    assert_eq!(twice.to_string(), "step 0 is failed, so it cannot finish completed");
    let waiting = wf.steps_finished(&[(s(2), StepOutcome::Failed), (s(1), StepOutcome::Completed)]).unwrap_err();
    assert_eq!(waiting.to_string(), "step 1 is waiting, so it cannot finish completed");
    assert_eq!(wf, before);
    // A waiting step may be cancelled with the others (which pauses this workflow).
    let changes = wf.steps_finished(&[(s(1), StepOutcome::Cancelled), (s(0), StepOutcome::Completed)]).unwrap();
    assert_eq!(changes.status, WorkflowStatus::Paused);
    assert_eq!(wf.states()[..2], [StepState::Completed, StepState::Cancelled]);
}

#[test]
fn a_retry_during_a_pause_loses_nothing_to_skips() {
    let spec = graph(OnError::Pause, &[Join::All; 2], &[(0, 1, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    done(&mut wf, 0, StepOutcome::Failed);
    let retried = wf.retry_failed(false).unwrap();
    assert_eq!(retried.reset, ids(&[0]));
    // Still paused: the retried step itself waits for the resume.
    assert_eq!((retried.ready.len(), retried.status), (0, WorkflowStatus::Paused));
    assert_eq!(wf.held().collect::<Vec<_>>(), ids(&[0]));
    assert_eq!(wf.waiting_reasons(s(1)).unwrap().held, None);
    assert_eq!(wf.resume().unwrap().ready, ids(&[0]));
    assert_eq!(done(&mut wf, 0, StepOutcome::Completed).ready, ids(&[1]));
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).status, WorkflowStatus::Completed);
}

#[test]
fn a_manual_pause_holds_promotions_until_resumed() {
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, RequireSuccess), (1, 2, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    assert_eq!(wf.pause().unwrap().status, WorkflowStatus::Paused);
    assert_eq!(wf.pause().unwrap().status, WorkflowStatus::Paused);
    assert!(done(&mut wf, 0, StepOutcome::Completed).ready.is_empty());
    assert_eq!(wf.state(s(1)), Some(StepState::Waiting));
    assert_eq!(
        wf.waiting_reasons(s(1)).unwrap(),
        WaitReason { unfinished: vec![], needed: 0, held: Some(Decision::Ready) }
    );
    assert_eq!(wf.waiting_reasons(s(2)).unwrap(), WaitReason { unfinished: ids(&[1]), needed: 1, held: None });
    let resumed = wf.resume().unwrap();
    assert_eq!((resumed.ready, resumed.status), (ids(&[1]), WorkflowStatus::Running));
    assert_eq!(wf.resume().unwrap().status, WorkflowStatus::Running);
}

#[test]
fn a_workflow_whose_steps_all_finished_is_not_paused() {
    let spec = graph(OnError::Continue, &[Join::All], &[]);
    let (mut wf, _) = submit(&spec);
    wf.pause().unwrap();
    assert_eq!(done(&mut wf, 0, StepOutcome::Completed).status, WorkflowStatus::Completed);
    let spec = graph(OnError::Pause, &[Join::All], &[]);
    let (mut wf, _) = submit(&spec);
    assert_eq!(done(&mut wf, 0, StepOutcome::Failed).status, WorkflowStatus::Failed);
    let err = wf.pause().unwrap_err();
    assert_eq!(err.to_string(), "the workflow is failed, so it cannot be paused");
}

#[test]
fn cancel_cancels_what_waits_aborts_what_runs_and_promotes_nothing_after() {
    // 0 -> 1, and 2 alone.
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    wf.step_started(s(0)).unwrap();
    let cancelled = wf.cancel().unwrap();
    assert_eq!((cancelled.cancelled, cancelled.abort), (ids(&[1, 2]), ids(&[0])));
    assert_eq!(cancelled.status, WorkflowStatus::Cancelled);
    assert_eq!(wf.state(s(0)), Some(StepState::Running));
    // The aborted step's late finish is recorded, and nothing moves.
    let late = done(&mut wf, 0, StepOutcome::Completed);
    assert_eq!((late.ready.len(), late.status), (0, WorkflowStatus::Cancelled));
    assert_eq!(wf.cancel().unwrap().cancelled, ids(&[]));
    assert!(wf.pause().is_err() && wf.resume().is_err());
    // A retry reopens it where it stopped.
    let retried = wf.retry_failed(false).unwrap();
    assert_eq!((retried.reset, retried.ready), (ids(&[1, 2]), ids(&[1, 2])));
    assert_eq!(retried.status, WorkflowStatus::Running);
}

#[test]
fn a_finished_workflow_cannot_be_cancelled() {
    let (mut wf, _) = submit(&graph(OnError::Continue, &[Join::All], &[]));
    done(&mut wf, 0, StepOutcome::Completed);
    assert_eq!(wf.cancel(), Err(EventError::WorkflowOver { status: WorkflowStatus::Completed, action: "cancelled" }));
}

#[test]
fn retry_failed_only_or_with_everything_downstream() {
    // 0 -> 1 (allow_failed) -> 2: 0 fails, its recovery 1 and then 2 complete.
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, AllowFailed), (1, 2, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    done(&mut wf, 0, StepOutcome::Failed);
    done(&mut wf, 1, StepOutcome::Completed);
    assert_eq!(done(&mut wf, 2, StepOutcome::Completed).status, WorkflowStatus::Completed);
    let mut again = wf.clone();

    let only = wf.retry_failed(false).unwrap();
    assert_eq!((only.reset, only.ready), (ids(&[0]), ids(&[0])));
    assert_eq!(wf.state(s(1)), Some(StepState::Completed));
    assert_eq!(wf.join_counts(s(1)), Some(JoinCounts::new(1)));
    assert_eq!(done(&mut wf, 0, StepOutcome::Completed).status, WorkflowStatus::Completed);

    let all = again.retry_failed(true).unwrap();
    assert_eq!((all.reset, all.ready), (ids(&[0, 1, 2]), ids(&[0])));
    assert_eq!(again.step_counts(), StepCounts { waiting: 2, ready: 1, ..StepCounts::default() });
    assert_eq!(done(&mut again, 0, StepOutcome::Completed).ready, ids(&[1]));
}

#[test]
fn retry_brings_skipped_steps_back() {
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, RequireSuccess), (1, 2, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    done(&mut wf, 0, StepOutcome::Completed);
    assert_eq!(done(&mut wf, 1, StepOutcome::Failed).skipped, ids(&[2]));
    let retried = wf.retry_failed(false).unwrap();
    assert_eq!((retried.reset, retried.ready), (ids(&[1, 2]), ids(&[1])));
    assert_eq!(done(&mut wf, 1, StepOutcome::Completed).ready, ids(&[2]));
}

#[test]
fn a_waiting_step_can_be_cancelled_or_expire_on_its_own() {
    let spec = graph(OnError::Continue, &[Join::All; 3], &[(0, 1, RequireSuccess), (1, 2, AllowFailed)]);
    let (mut wf, _) = submit(&spec);
    let changes = done(&mut wf, 1, StepOutcome::Expired);
    assert_eq!(changes.ready, ids(&[2]));
    assert_eq!(wf.state(s(1)), Some(StepState::Expired));
    // Its parent's later finish changes nothing for it.
    assert!(done(&mut wf, 0, StepOutcome::Completed).ready.is_empty());
}

#[test]
fn events_the_state_does_not_allow_are_refused_and_change_nothing() {
    let spec = graph(OnError::Continue, &[Join::All; 2], &[(0, 1, RequireSuccess)]);
    let (mut wf, _) = submit(&spec);
    let before = wf.clone();
    let err = wf.step_started(s(1)).unwrap_err();
    assert_eq!(err.to_string(), "step 1 is waiting, so it cannot start: only a ready step can");
    let err = wf.step_finished(s(1), StepOutcome::Completed).unwrap_err();
    assert_eq!(err.to_string(), "step 1 is waiting, so it cannot finish completed");
    assert_eq!(
        wf.step_finished(s(1), StepOutcome::Failed).unwrap_err().to_string(),
        "step 1 is waiting, so it cannot finish failed"
    );
    let err = wf.step_finished(s(7), StepOutcome::Completed).unwrap_err();
    assert_eq!(err, EventError::UnknownStep { step: s(7), steps: 2 });
    assert_eq!(err.to_string(), "step 7 is not in this workflow of 2 steps");
    assert_eq!(wf.waiting_reasons(s(7)), None);
    assert_eq!(wf, before);
    done(&mut wf, 0, StepOutcome::Completed);
    let before = wf.clone();
    assert!(matches!(wf.step_finished(s(0), StepOutcome::Failed), Err(EventError::CannotFinish { .. })));
    assert!(matches!(wf.step_started(s(0)), Err(EventError::CannotStart { .. })));
    assert_eq!(wf, before);
}

#[test]
fn submit_checks_the_graph() {
    assert_eq!(WorkflowState::submit(&WorkflowSpec::default()).unwrap_err(), WorkflowError::Empty);
    let cycle = graph(OnError::Continue, &[Join::All; 2], &[(0, 1, RequireSuccess), (1, 0, RequireSuccess)]);
    assert!(matches!(WorkflowState::submit(&cycle), Err(WorkflowError::Cycle { .. })));
}

#[test]
fn a_wide_fan_in_and_fan_out_promote_once() {
    let width = 2_000u32;
    let mut spec = WorkflowSpec::new(OnError::Continue);
    let root = spec.add_step(Join::All);
    let middle: Vec<StepId> = (0..width).map(|_| spec.add_step(Join::All)).collect();
    let sink = spec.add_step(Join::All);
    for &m in &middle {
        spec.add_edge(root, m, RequireSuccess);
        spec.add_edge(m, sink, RequireSuccess);
    }
    let (mut wf, _) = submit(&spec);
    assert_eq!(wf.step_finished(root, StepOutcome::Completed).unwrap().ready, middle);
    for (i, &m) in middle.iter().enumerate() {
        let changes = wf.step_finished(m, StepOutcome::Completed).unwrap();
        let expect = if i + 1 == middle.len() { vec![sink] } else { vec![] };
        assert_eq!(changes.ready, expect);
    }
    assert_eq!(wf.step_finished(sink, StepOutcome::Completed).unwrap().status, WorkflowStatus::Completed);
}

// ---------------------------------------------------------------------------------------------
// The reference model.

/// The same semantics written naively: no counts, no work lists; every step's decision is
/// recomputed from its parents' states by asking whether the join holds when every unfinished
/// parent fails its edge (then Ready) or when every unfinished parent satisfies it (if not,
/// Skip), steps visited in a topological order found by repeated scans.
#[derive(Debug, Clone)]
struct Model {
    joins: Vec<Join>,
    edges: Vec<Edge>,
    on_error: OnError,
    order: Vec<usize>,
    states: Vec<StepState>,
    paused: bool,
    cancelled: bool,
}

/// What the model says an event changed (`None`: refused).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    ready: Vec<StepId>,
    skipped: Vec<StepId>,
    cancelled: Vec<StepId>,
    abort: Vec<StepId>,
    reset: Vec<StepId>,
    status: WorkflowStatus,
}

fn holds(join: Join, satisfied: &[bool]) -> bool {
    let yes = satisfied.iter().filter(|&&b| b).count();
    match join {
        Join::All => yes == satisfied.len(),
        Join::Any => yes >= 1,
        Join::Quorum(n) => yes >= n as usize,
    }
}

impl Model {
    fn new(spec: &WorkflowSpec) -> Model {
        let n = spec.steps.len();
        let mut order = Vec::new();
        let mut placed = vec![false; n];
        while order.len() < n {
            for step in 0..n {
                let free = spec.edges.iter().all(|e| e.child.index() != step || placed[e.parent.index()]);
                if !placed[step] && free {
                    placed[step] = true;
                    order.push(step);
                }
            }
        }
        let mut model = Model {
            joins: spec.steps.iter().map(|s| s.join).collect(),
            edges: spec.edges.clone(),
            on_error: spec.on_error,
            order,
            states: vec![StepState::Waiting; n],
            paused: false,
            cancelled: false,
        };
        model.settle();
        model
    }

    fn n(&self) -> usize {
        self.states.len()
    }

    /// Each parent edge of `step`: `Some(satisfied)` if the parent finished, `None` if not.
    fn parent_edges(&self, step: usize) -> Vec<Option<bool>> {
        self.edges
            .iter()
            .filter(|e| e.child.index() == step)
            .map(|e| {
                let state = self.states[e.parent.index()];
                let finished = !matches!(state, StepState::Waiting | StepState::Ready | StepState::Running);
                finished.then_some(state == StepState::Completed || e.policy == AllowFailed)
            })
            .collect()
    }

    fn decision(&self, step: usize) -> Decision {
        let edges = self.parent_edges(step);
        let worst: Vec<bool> = edges.iter().map(|e| e.unwrap_or(false)).collect();
        let best: Vec<bool> = edges.iter().map(|e| e.unwrap_or(true)).collect();
        if holds(self.joins[step], &worst) {
            Decision::Ready
        } else if !holds(self.joins[step], &best) {
            Decision::Skip
        } else {
            Decision::Wait
        }
    }

    fn all_finished(&self) -> bool {
        self.states.iter().all(|s| !matches!(s, StepState::Waiting | StepState::Ready | StepState::Running))
    }

    fn settle(&mut self) {
        if !self.paused && !self.cancelled {
            for i in 0..self.order.len() {
                let step = self.order[i];
                if self.states[step] == StepState::Waiting {
                    match self.decision(step) {
                        Decision::Wait => {}
                        Decision::Ready => self.states[step] = StepState::Ready,
                        Decision::Skip => self.states[step] = StepState::Skipped,
                    }
                }
            }
        }
        if self.all_finished() {
            self.paused = false;
        }
    }

    fn status(&self) -> WorkflowStatus {
        let sink = |step: usize| self.edges.iter().all(|e| e.parent.index() != step);
        if self.cancelled {
            WorkflowStatus::Cancelled
        } else if self.all_finished() {
            let ok = (0..self.n()).filter(|&s| sink(s)).all(|s| self.states[s] == StepState::Completed);
            if ok { WorkflowStatus::Completed } else { WorkflowStatus::Failed }
        } else if self.paused {
            WorkflowStatus::Paused
        } else {
            WorkflowStatus::Running
        }
    }

    fn held(&self) -> Vec<StepId> {
        if !self.paused {
            return Vec::new();
        }
        (0..self.n())
            .filter(|&s| self.states[s] == StepState::Waiting && self.decision(s) != Decision::Wait)
            .map(|s| StepId(s as u32))
            .collect()
    }

    fn expected(
        &self,
        before: &[StepState],
        cancelled: Vec<StepId>,
        abort: Vec<StepId>,
        reset: Vec<StepId>,
    ) -> Expected {
        let became = |state: StepState| {
            (0..self.n())
                .filter(|&s| self.states[s] == state && before[s] != state)
                .map(|s| StepId(s as u32))
                .collect::<Vec<_>>()
        };
        Expected {
            ready: became(StepState::Ready),
            skipped: became(StepState::Skipped),
            cancelled,
            abort,
            reset,
            status: self.status(),
        }
    }

    fn apply(&mut self, event: Event) -> Option<Expected> {
        let before = self.states.clone();
        let live = matches!(self.status(), WorkflowStatus::Running | WorkflowStatus::Paused);
        match event {
            Event::Start(step) => {
                if self.states.get(step)? != &StepState::Ready {
                    return None;
                }
                self.states[step] = StepState::Running;
            }
            Event::Finish(step, outcome) => return self.apply(Event::Finishes([Some((step, outcome)), None, None])),
            Event::Finishes(batch) => {
                // Every finish allowed, each step once, or nothing happens.
                let batch: Vec<(usize, StepOutcome)> = batch.iter().flatten().copied().collect();
                let mut seen = BTreeSet::new();
                for &(step, outcome) in &batch {
                    let state = *self.states.get(step)?;
                    let allowed = matches!(state, StepState::Ready | StepState::Running)
                        || (state == StepState::Waiting
                            && matches!(outcome, StepOutcome::Cancelled | StepOutcome::Expired));
                    if !allowed || !seen.insert(step) {
                        return None;
                    }
                }
                // All recorded, and the pause taken, before any child decides.
                for &(step, outcome) in &batch {
                    self.states[step] = StepState::from(ParentOutcome::from(outcome));
                    if outcome != StepOutcome::Completed && self.on_error == OnError::Pause && !self.cancelled {
                        self.paused = true;
                    }
                }
            }
            Event::Pause => {
                if !live {
                    return None;
                }
                self.paused = true;
            }
            Event::Resume => {
                if !live {
                    return None;
                }
                self.paused = false;
            }
            Event::Cancel => {
                if self.cancelled {
                    return Some(self.expected(&before, vec![], vec![], vec![]));
                }
                if !live {
                    return None;
                }
                self.cancelled = true;
                self.paused = false;
                let mut cancelled = Vec::new();
                let mut abort = Vec::new();
                for step in 0..self.n() {
                    match self.states[step] {
                        StepState::Waiting | StepState::Ready => {
                            self.states[step] = StepState::Cancelled;
                            cancelled.push(StepId(step as u32));
                        }
                        StepState::Running => abort.push(StepId(step as u32)),
                        _ => {}
                    }
                }
                return Some(self.expected(&before, cancelled, abort, vec![]));
            }
            Event::Retry(downstream) => {
                let finished = |s: StepState| !matches!(s, StepState::Waiting | StepState::Ready | StepState::Running);
                let mut from: BTreeSet<usize> = (0..self.n())
                    .filter(|&s| finished(self.states[s]) && self.states[s] != StepState::Completed)
                    .collect();
                if downstream {
                    // Everything reachable, by passes over the edge list until nothing is added.
                    let mut reach = from.clone();
                    loop {
                        let more: Vec<usize> = self
                            .edges
                            .iter()
                            .filter(|e| reach.contains(&e.parent.index()) && !reach.contains(&e.child.index()))
                            .map(|e| e.child.index())
                            .collect();
                        if more.is_empty() {
                            break;
                        }
                        reach.extend(more);
                    }
                    from.extend(reach.into_iter().filter(|&s| finished(self.states[s])));
                }
                for &step in &from {
                    self.states[step] = StepState::Waiting;
                }
                self.cancelled = false;
                self.settle();
                let reset = from.into_iter().map(|s| StepId(s as u32)).collect();
                return Some(self.expected(&before, vec![], vec![], reset));
            }
        }
        self.settle();
        Some(self.expected(&before, vec![], vec![], vec![]))
    }
}

/// An event, on step indices.
#[derive(Debug, Clone, Copy)]
enum Event {
    Start(usize),
    Finish(usize, StepOutcome),
    /// Up to three finishes as one event (one statement of a store).
    Finishes([Option<(usize, StepOutcome)>; 3]),
    Pause,
    Resume,
    Cancel,
    Retry(bool),
}

fn apply_machine(wf: &mut WorkflowState, event: Event) -> Result<Changes, EventError> {
    let step = |i: usize| StepId(u32::try_from(i).unwrap_or(u32::MAX));
    match event {
        Event::Start(i) => wf.step_started(step(i)),
        Event::Finish(i, outcome) => wf.step_finished(step(i), outcome),
        Event::Finishes(batch) => {
            let batch: Vec<(StepId, StepOutcome)> = batch.iter().flatten().map(|&(i, o)| (step(i), o)).collect();
            wf.steps_finished(&batch)
        }
        Event::Pause => wf.pause(),
        Event::Resume => wf.resume(),
        Event::Cancel => wf.cancel(),
        Event::Retry(downstream) => wf.retry_failed(downstream),
    }
}

/// An operation of a generated run: most pick their step among those it fits (by `pick`
/// modulo how many there are), the last is any event on any step, fit or not.
#[derive(Debug, Clone, Copy)]
enum Op {
    Start(usize),
    Finish(usize, StepOutcome),
    WaitingGone(usize, bool),
    Pause,
    Resume,
    Cancel,
    Retry(bool),
    Raw(usize, u8, StepOutcome),
    /// Two or three finishes in one event (the third when the flag says so); a cancel or an
    /// expiry may take a waiting step.
    Finishes([(usize, StepOutcome); 3], bool),
}

fn outcome() -> impl Strategy<Value = StepOutcome> {
    prop_oneof![
        6 => Just(StepOutcome::Completed),
        2 => Just(StepOutcome::Failed),
        1 => Just(StepOutcome::Cancelled),
        1 => Just(StepOutcome::Expired),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (any::<usize>(), outcome()).prop_map(|(i, o)| Op::Finish(i, o)),
        4 => any::<usize>().prop_map(Op::Start),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, c)| Op::WaitingGone(i, c)),
        1 => Just(Op::Pause),
        2 => Just(Op::Resume),
        1 => Just(Op::Cancel),
        2 => any::<bool>().prop_map(Op::Retry),
        2 => (0usize..44, 0u8..6, outcome()).prop_map(|(i, k, o)| Op::Raw(i, k, o)),
        4 => ([(any::<usize>(), outcome()), (any::<usize>(), outcome()), (any::<usize>(), outcome())], any::<bool>())
            .prop_map(|(batch, three)| Op::Finishes(batch, three)),
    ]
}

fn pick(states: &[StepState], pick: usize, fits: impl Fn(StepState) -> bool) -> Option<usize> {
    let fit: Vec<usize> = (0..states.len()).filter(|&s| fits(states[s])).collect();
    (!fit.is_empty()).then(|| fit[pick % fit.len()])
}

fn event(states: &[StepState], op: Op) -> Option<Event> {
    let in_flight = |s: StepState| matches!(s, StepState::Ready | StepState::Running);
    Some(match op {
        Op::Start(i) => Event::Start(pick(states, i, |s| s == StepState::Ready)?),
        Op::Finish(i, outcome) => Event::Finish(pick(states, i, in_flight)?, outcome),
        Op::WaitingGone(i, cancel) => {
            let outcome = if cancel { StepOutcome::Cancelled } else { StepOutcome::Expired };
            Event::Finish(pick(states, i, |s| s == StepState::Waiting)?, outcome)
        }
        Op::Pause => Event::Pause,
        Op::Resume => Event::Resume,
        Op::Cancel => Event::Cancel,
        Op::Retry(downstream) => Event::Retry(downstream),
        Op::Finishes(batch, three) => {
            let mut finishes = [None; 3];
            for (k, &(i, outcome)) in batch.iter().take(if three { 3 } else { 2 }).enumerate() {
                let gone = matches!(outcome, StepOutcome::Cancelled | StepOutcome::Expired);
                let fits = |s: StepState| in_flight(s) || (gone && s == StepState::Waiting);
                finishes[k] = Some((pick(states, i, fits)?, outcome));
            }
            Event::Finishes(finishes)
        }
        Op::Raw(i, kind, outcome) => match kind {
            0 => Event::Start(i),
            1 | 2 => Event::Finish(i, outcome),
            3 => Event::Pause,
            4 => Event::Resume,
            _ => Event::Cancel,
        },
    })
}

/// A run: the machine and the model side by side, with what the properties remember.
struct Run {
    wf: WorkflowState,
    model: Model,
    /// Per step: whether it became ready since it was submitted or last reset.
    promoted: Vec<bool>,
}

impl Run {
    fn new(spec: &WorkflowSpec) -> Result<Run, TestCaseError> {
        let (wf, changes) = WorkflowState::submit(spec).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let model = Model::new(spec);
        let mut run = Run { wf, model, promoted: vec![false; spec.steps.len()] };
        let before = vec![StepState::Waiting; spec.steps.len()];
        let expected = run.model.expected(&before, vec![], vec![], vec![]);
        run.check(&before, Ok(changes), Some(expected))?;
        Ok(run)
    }

    fn step(&mut self, event: Event) -> Result<(), TestCaseError> {
        let before_wf = self.wf.clone();
        let before = self.wf.states().to_vec();
        let got = apply_machine(&mut self.wf, event);
        let expected = self.model.apply(event);
        if got.is_err() {
            prop_assert_eq!(&self.wf, &before_wf, "a refused {:?} changed the machine", event);
        }
        self.check(&before, got, expected).map_err(|e| TestCaseError::fail(format!("after {event:?}: {e}")))
    }

    fn check(
        &mut self,
        before: &[StepState],
        got: Result<Changes, EventError>,
        expected: Option<Expected>,
    ) -> Result<(), TestCaseError> {
        let wf = &self.wf;
        let model = &self.model;
        // The incremental machine equals the reference.
        prop_assert_eq!(wf.states(), &model.states[..]);
        prop_assert_eq!(wf.status(), model.status());
        prop_assert_eq!(wf.held().collect::<Vec<_>>(), model.held());
        match (got, expected) {
            (Err(_), None) => {}
            (Ok(changes), Some(expected)) => {
                let got = Expected {
                    ready: changes.ready.clone(),
                    skipped: changes.skipped.clone(),
                    cancelled: changes.cancelled.clone(),
                    abort: changes.abort.clone(),
                    reset: changes.reset.clone(),
                    status: changes.status,
                };
                prop_assert_eq!(&got, &expected);
                for &step in &changes.reset {
                    self.promoted[step.index()] = false;
                }
                for &step in &changes.ready {
                    // Ready only when the join holds, at most once per run, never from skipped.
                    prop_assert_eq!(model.decision(step.index()), Decision::Ready, "{} promoted early", step);
                    prop_assert!(!self.promoted[step.index()], "{} promoted twice", step);
                    self.promoted[step.index()] = true;
                }
                for (i, (&was, &is)) in before.iter().zip(wf.states()).enumerate() {
                    let reset = changes.reset.contains(&StepId(i as u32));
                    let runs = matches!(is, StepState::Ready | StepState::Running);
                    prop_assert!(reset || was != StepState::Skipped || !runs, "skipped step {} runs", i);
                }
            }
            (got, expected) => {
                return Err(TestCaseError::fail(format!("machine {got:?}, model {expected:?}")));
            }
        }
        // The counts equal a recount.
        let mut recount = StepCounts::default();
        for &state in wf.states() {
            match state {
                StepState::Waiting => recount.waiting += 1,
                StepState::Ready => recount.ready += 1,
                StepState::Running => recount.running += 1,
                StepState::Completed => recount.completed += 1,
                StepState::Failed => recount.failed += 1,
                StepState::Cancelled => recount.cancelled += 1,
                StepState::Expired => recount.expired += 1,
                StepState::Skipped => recount.skipped += 1,
            }
        }
        prop_assert_eq!(wf.step_counts(), recount);
        for step in 0..wf.len() {
            let edges = model.parent_edges(step);
            let counts = JoinCounts {
                parents: edges.len() as u32,
                satisfied: edges.iter().filter(|e| **e == Some(true)).count() as u32,
                unsatisfied: edges.iter().filter(|e| **e == Some(false)).count() as u32,
            };
            prop_assert_eq!(wf.join_counts(StepId(step as u32)), Some(counts));
        }
        // A running workflow has settled: every waiting step waits for an unfinished parent.
        if wf.status() == WorkflowStatus::Running {
            for step in 0..wf.len() {
                if wf.states()[step] == StepState::Waiting {
                    let reason = wf.waiting_reasons(StepId(step as u32)).unwrap();
                    prop_assert!(!reason.unfinished.is_empty() && reason.held.is_none());
                    prop_assert_eq!(model.decision(step), Decision::Wait);
                }
            }
        }
        Ok(())
    }

    /// Resumes and finishes every ready or running step (outcomes from `outcomes`, cycled)
    /// until the workflow is over; it must be, within one finish per step and one resume
    /// per finish.
    fn drain(&mut self, outcomes: &[StepOutcome]) -> Result<(), TestCaseError> {
        let mut next = 0;
        for _ in 0..2 * self.wf.len() + 2 {
            match self.wf.status() {
                WorkflowStatus::Paused => self.step(Event::Resume)?,
                WorkflowStatus::Running | WorkflowStatus::Cancelled => {
                    let states = self.wf.states();
                    let Some(step) =
                        (0..states.len()).find(|&s| matches!(states[s], StepState::Ready | StepState::Running))
                    else {
                        break;
                    };
                    let outcome = outcomes.get(next % outcomes.len().max(1)).copied().unwrap_or(StepOutcome::Completed);
                    next += 1;
                    self.step(Event::Finish(step, outcome))?;
                }
                WorkflowStatus::Completed | WorkflowStatus::Failed => break,
            }
        }
        prop_assert!(self.wf.status().is_finished(), "stuck {:?}: {:?}", self.wf.status(), self.wf.states());
        prop_assert_eq!(self.wf.step_counts().ready + self.wf.step_counts().running, 0);
        Ok(())
    }
}

// Graph generators: shapes over steps 0..n where edges go from a smaller to a larger index,
// then joins, policies, a failure policy and a random relabelling of the steps.

type Shape = (usize, Vec<(usize, usize)>);

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        (1usize..=15).prop_map(|n| (n, (1..n).map(|i| (i - 1, i)).collect())),
        // A chain of diamonds, each of some width.
        (1usize..=4, 1usize..=5).prop_map(|(diamonds, width)| {
            let mut edges = Vec::new();
            let mut top = 0;
            for _ in 0..diamonds {
                let bottom = top + width + 1;
                for m in top + 1..bottom {
                    edges.push((top, m));
                    edges.push((m, bottom));
                }
                top = bottom;
            }
            (top + 1, edges)
        }),
        (1usize..=35).prop_map(|k| (k + 1, (1..=k).map(|c| (0, c)).collect())),
        (1usize..=35).prop_map(|k| (k + 1, (0..k).map(|p| (p, k)).collect())),
        // Fan-out then fan-in: 0 -> 1..=k -> k+1.
        (1usize..=30).prop_map(|k| (k + 2, (1..=k).flat_map(|m| [(0, m), (m, k + 1)]).collect())),
        (2usize..=40, 1u8..45).prop_flat_map(|(n, density)| {
            prop::collection::vec(0u8..100, n * (n - 1) / 2).prop_map(move |dice| {
                let pairs = (0..n).flat_map(|c| (0..c).map(move |p| (p, c)));
                (n, pairs.zip(dice).filter(|(_, d)| *d < density).map(|(e, _)| e).collect())
            })
        }),
    ]
}

fn spec() -> impl Strategy<Value = WorkflowSpec> {
    shape().prop_flat_map(|(n, edges)| {
        let m = edges.len();
        (
            Just(edges),
            prop::collection::vec(any::<u8>(), n),
            prop::collection::vec(0u8..4, m),
            Just((0..n).collect::<Vec<usize>>()).prop_shuffle(),
            prop_oneof![3 => Just(OnError::Continue), 1 => Just(OnError::Pause)],
        )
            .prop_map(|(edges, join_dice, policy_dice, relabel, on_error)| {
                let n = relabel.len();
                let mut parents = vec![0u32; n];
                for &(_, c) in &edges {
                    parents[c] += 1;
                }
                let mut spec = WorkflowSpec { steps: vec![StepSpec::default(); n], edges: Vec::new(), on_error };
                for step in 0..n {
                    let k = parents[step];
                    let dice = join_dice[step];
                    let join = match dice % 4 {
                        _ if k == 0 => Join::All,
                        2 => Join::Any,
                        3 => Join::Quorum(1 + u32::from(dice / 4) % k),
                        _ => Join::All,
                    };
                    spec.steps[relabel[step]].join = join;
                }
                for (&(p, c), &dice) in edges.iter().zip(&policy_dice).rev() {
                    let policy = if dice == 0 { AllowFailed } else { RequireSuccess };
                    spec.add_edge(StepId(relabel[p] as u32), StepId(relabel[c] as u32), policy);
                }
                spec
            })
    })
}

/// Reachability by repeated passes: whether some step reaches itself.
fn has_cycle(n: usize, edges: &[(usize, usize)]) -> bool {
    let mut reach = vec![vec![false; n]; n];
    for &(p, c) in edges {
        reach[p][c] = true;
    }
    for k in 0..n {
        for i in 0..n {
            for j in 0..n {
                if reach[i][k] && reach[k][j] {
                    reach[i][j] = true;
                }
            }
        }
    }
    (0..n).any(|i| reach[i][i])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn the_machine_equals_the_reference_after_every_event(
        spec in spec(),
        ops in prop::collection::vec(op(), 0..80),
        drain in prop::collection::vec(outcome(), 1..6),
    ) {
        prop_assert_eq!(spec.check(), Ok(()));
        let mut run = Run::new(&spec)?;
        for op in ops {
            if let Some(event) = event(run.wf.states(), op) {
                run.step(event)?;
            }
        }
        run.drain(&drain)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_workflow_whose_steps_all_complete_completes(spec in spec(), starts in prop::collection::vec(any::<bool>(), 40)) {
        let mut run = Run::new(&spec)?;
        let mut turn = 0;
        while let Some(step) = pick(run.wf.states(), turn, |s| matches!(s, StepState::Ready | StepState::Running)) {
            if run.wf.states()[step] == StepState::Ready && starts[turn % starts.len()] {
                run.step(Event::Start(step))?;
            }
            run.step(Event::Finish(step, StepOutcome::Completed))?;
            turn += 1;
        }
        prop_assert_eq!(turn, spec.steps.len());
        prop_assert_eq!(run.wf.status(), WorkflowStatus::Completed);
    }

    #[test]
    fn decide_matches_the_naive_rule_and_never_changes_its_mind(
        parents in prop::collection::vec((any::<bool>(), 0u8..5), 0..12),
        join_dice in any::<u8>(),
    ) {
        let k = parents.len() as u32;
        let join = match join_dice % 3 {
            0 => Join::All,
            1 => Join::Any,
            _ => Join::Quorum(u32::from(join_dice / 3) % (k + 2)),
        };
        let outcomes = [ParentOutcome::Completed, ParentOutcome::Failed, ParentOutcome::Cancelled, ParentOutcome::Expired, ParentOutcome::Skipped];
        let mut counts = JoinCounts::new(k);
        let mut finished: Vec<Option<bool>> = vec![None; parents.len()];
        let mut decided = None;
        for (i, &(allow, o)) in parents.iter().enumerate() {
            let policy = if allow { AllowFailed } else { RequireSuccess };
            let outcome = outcomes[usize::from(o)];
            let next = on_parent_finished(counts, policy, outcome);
            prop_assert_eq!(next.satisfied + next.unsatisfied, counts.satisfied + counts.unsatisfied + 1);
            prop_assert_eq!(on_parent_reset(next, policy, outcome), counts);
            counts = next;
            finished[i] = Some(policy.satisfied_by(outcome));
            let worst: Vec<bool> = finished.iter().map(|f| f.unwrap_or(false)).collect();
            let best: Vec<bool> = finished.iter().map(|f| f.unwrap_or(true)).collect();
            let naive = if holds(join, &worst) { Decision::Ready } else if !holds(join, &best) { Decision::Skip } else { Decision::Wait };
            let decision = decide(join, &counts);
            prop_assert_eq!(decision, naive);
            if let Some(earlier) = decided {
                prop_assert_eq!(decision, earlier, "changed its mind");
            } else if decision != Decision::Wait {
                decided = Some(decision);
            }
        }
        prop_assert_ne!(decide(join, &counts), Decision::Wait, "every parent finished and still waiting");
    }

    #[test]
    fn check_finds_a_cycle_exactly_when_there_is_one(
        n in 1usize..12,
        pairs in prop::collection::vec((0usize..12, 0usize..12), 0..30),
    ) {
        let mut seen = BTreeSet::new();
        let edges: Vec<(usize, usize)> =
            pairs.into_iter().map(|(p, c)| (p % n, c % n)).filter(|&(p, c)| p != c && seen.insert((p, c))).collect();
        let mut spec = WorkflowSpec { steps: vec![StepSpec::default(); n], ..WorkflowSpec::default() };
        for &(p, c) in &edges {
            spec.add_edge(StepId(p as u32), StepId(c as u32), RequireSuccess);
        }
        match spec.check() {
            Ok(()) => prop_assert!(!has_cycle(n, &edges)),
            Err(WorkflowError::Cycle { steps }) => {
                prop_assert!(has_cycle(n, &edges));
                let distinct: BTreeSet<_> = steps.iter().collect();
                prop_assert_eq!(distinct.len(), steps.len());
                for i in 0..steps.len() {
                    let (p, c) = (steps[i].index(), steps[(i + 1) % steps.len()].index());
                    prop_assert!(edges.contains(&(p, c)), "{} -> {} is no edge", p, c);
                }
            }
            Err(other) => return Err(TestCaseError::fail(other.to_string())),
        }
    }
}
