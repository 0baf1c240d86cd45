//! The workflows of the swarm load: random graphs drawn from the seed, submitted beside the
//! plain tasks, and what the checker must know of each (its graph, as the harness built it).
//!
//! Shapes: chains, stacked diamonds (a hub, two to four steps in parallel, a hub, ...), wide
//! fan-outs (one root, every other step its child), fan-ins (every other step a parent of the
//! last) and random DAGs (edges from lower to higher steps only, so no cycle); joins all, any
//! or quorum(n); some edges `allow_failed`; some workflows pause on error. Each step's task
//! takes a queue that runs (cap not 0), now and then a priority, a delay, a good-until or a
//! retry policy, as the plain tasks do; steps hold no key (a store refuses them).

use std::collections::BTreeSet;

use serde_json::json;

use crate::rng::Rng;
use crate::store::{DbTime, NewTask, NewWorkflow, RunAt};
use crate::workflow::{EdgePolicy, Join, StepId};

use super::options::{self, LoadOptions};

/// The shapes a workflow is drawn from.
const SHAPES: [&str; 5] = ["chain", "diamonds", "fan-out", "fan-in", "dag"];

/// The edges `(parent, child)` of a random graph of `steps` steps, parent before child (so no
/// cycle), of shape `shape` (an index of the shapes this module draws: 0 a chain, 1 stacked
/// diamonds of 2 to `widest` steps in parallel between hubs, 2 a fan-out, 3 a fan-in, else a
/// random DAG of a random density). The simulation's load and the store conformance suite's
/// workflow scripts draw their graphs with it.
pub fn random_edges(rng: &mut Rng, steps: u32, shape: usize, widest: u32) -> BTreeSet<(u32, u32)> {
    let mut edges: BTreeSet<(u32, u32)> = BTreeSet::new();
    match shape {
        0 => edges.extend((1..steps).map(|i| (i - 1, i))),
        1 => {
            let (mut hub, mut next) = (0, 1);
            while next < steps {
                let width = (rng.range(2, u64::from(widest.max(2)) + 1) as u32).min(steps - next);
                let middle: Vec<u32> = (next..next + width).collect();
                next += width;
                edges.extend(middle.iter().map(|&m| (hub, m)));
                if next < steps {
                    edges.extend(middle.iter().map(|&m| (m, next)));
                    hub = next;
                    next += 1;
                }
            }
        }
        2 => edges.extend((1..steps).map(|i| (0, i))),
        3 => edges.extend((0..steps.saturating_sub(1)).map(|i| (i, steps - 1))),
        _ => {
            let density = [0.15, 0.3, 0.5][rng.range(0, 3) as usize];
            for child in 1..steps {
                for parent in 0..child {
                    if rng.chance(density) {
                        edges.insert((parent, child));
                    }
                }
            }
        }
    }
    edges
}

/// One drawn workflow: what to submit, and the latest run-at of its steps.
#[derive(Debug, Clone)]
pub(crate) struct Drawn {
    /// The workflow to submit.
    pub(crate) workflow: NewWorkflow,
    /// Its shape's name, for the trace.
    pub(crate) shape: &'static str,
    /// The latest run-at of its steps (a promoted step is claimable from then at the earliest).
    pub(crate) latest_run_at: DbTime,
}

/// Draws workflow number `number` at `now` over `queues` (the queues whose tasks can run).
pub(crate) fn draw(rng: &mut Rng, load: &LoadOptions, queues: &[String], now: DbTime, number: u64) -> Drawn {
    let steps = rng.range(2, u64::from(load.workflow_steps_max.max(2)) + 1) as u32;
    let shape_index = rng.range(0, SHAPES.len() as u64) as usize;
    let edges = random_edges(rng, steps, shape_index, 4);
    let mut parents = vec![0u32; steps as usize];
    for &(_, child) in &edges {
        parents[child as usize] += 1;
    }
    let mut workflow = NewWorkflow::new(format!("wf{number}"));
    if load.pause_on_error_chance > 0.0 && rng.chance(load.pause_on_error_chance) {
        workflow = workflow.pause_on_error();
    }
    let mut latest_run_at = now;
    for (step, &n) in parents.iter().enumerate() {
        let join = match (n, rng.range(0, 10)) {
            (0, _) | (_, 0..=4) => Join::All,
            (_, 5..=7) => Join::Any,
            _ => Join::Quorum(rng.range(1, u64::from(n) + 1) as u32),
        };
        let mut task = NewTask::new("step", json!({ "wf": number, "step": step }));
        task.queue = Some(queues[rng.range(0, queues.len() as u64) as usize].clone());
        let spread = i64::from(load.priority_spread);
        task.priority = (rng.range(0, (2 * spread + 1) as u64) as i64 - spread) as i16;
        let delay_ms = if rng.chance(load.delay_chance) { rng.range(1, load.delay_max_ms.min(10_000) + 1) } else { 0 };
        if delay_ms > 0 {
            task.run_at = RunAt::DelayMs(delay_ms);
        }
        if rng.chance(load.good_until_chance) {
            // Counted from the submit: a step promoted late may expire before it runs.
            task.good_until = Some(now.plus_ms(delay_ms + rng.range(1, load.good_until_max_ms + 1)));
        }
        if rng.chance(load.retry_chance) {
            task.retry = Some(options::swarm_retry(rng));
        }
        latest_run_at = latest_run_at.max(now.plus_ms(delay_ms));
        workflow.step(task, join);
    }
    for (parent, child) in edges {
        let allow = load.allow_failed_chance > 0.0 && rng.chance(load.allow_failed_chance);
        let policy = if allow { EdgePolicy::AllowFailed } else { EdgePolicy::RequireSuccess };
        workflow.edge(StepId(parent), StepId(child), policy);
    }
    Drawn { workflow, shape: SHAPES[shape_index], latest_run_at }
}

/// The most steps on one path from a root to a sink of `workflow` (1 for a lone step): how
/// many steps, one after the other, its slowest branch runs.
pub(crate) fn depth(workflow: &NewWorkflow) -> u32 {
    let steps = workflow.spec.steps.len();
    // Edges go from lower to higher steps in every drawn shape, but the depth is computed for
    // any acyclic graph: relax every edge until nothing changes (at most `steps` rounds).
    let mut depth = vec![1u32; steps];
    for _ in 0..steps {
        let mut changed = false;
        for edge in &workflow.spec.edges {
            let (parent, child) = (edge.parent.index(), edge.child.index());
            if parent < steps && child < steps && depth[child] < depth[parent] + 1 {
                depth[child] = depth[parent] + 1;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    depth.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::AppConfig;
    use crate::store::check_new_workflow;

    #[test]
    fn drawn_workflows_are_valid_and_every_shape_comes_up() {
        let mut rng = Rng::new(3);
        let app = AppConfig::default();
        let queues = vec!["default".to_owned()];
        let mut shapes = BTreeSet::new();
        for number in 0..2_000 {
            let options = super::super::SimOptions::swarm(&mut rng);
            let mut load = options.load;
            load.workflow_steps_max = load.workflow_steps_max.max(2);
            let now = DbTime(super::super::DB_EPOCH_MS);
            let drawn = draw(&mut rng, &load, &queues, now, number);
            check_new_workflow(&app, &drawn.workflow, now).unwrap_or_else(|e| panic!("{e}: {:#?}", drawn.workflow));
            let steps = drawn.workflow.spec.steps.len() as u32;
            assert!((2..=load.workflow_steps_max.max(2)).contains(&steps));
            let depth = depth(&drawn.workflow);
            assert!((1..=steps).contains(&depth));
            if drawn.shape == "chain" {
                assert_eq!(depth, steps);
            }
            shapes.insert(drawn.shape);
        }
        assert_eq!(shapes.len(), SHAPES.len());
    }
}
