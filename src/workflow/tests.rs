//! The workflow machine: unit tests of each rule.

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
