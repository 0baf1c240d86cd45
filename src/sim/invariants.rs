//! The invariants a run checks after every step, and the checks of every request the store
//! applies.
//!
//! Three layers:
//!
//! - **Per request** ([`Checker::before`] and [`Checker::after`]): the store's answer agrees
//!   with the rows as they were before it applied the request. A claim takes only claimable
//!   rows, best first, within the worker's budget; a start, finish, heartbeat or release is
//!   applied exactly when the row is held under the named lease in the expected state
//!   (fencing: a write from a stale lease is never applied); the reaper takes exactly the
//!   stale rows; nothing starts at or after good-until and no retry is scheduled at or after
//!   it.
//! - **The store** ([`Checker::check_store`], after every store mutation): the caps hold
//!   (hard-cap mode: Running plus live Claimed per queue and across the cluster; soft-cap
//!   mode: Running per queue); attempts and leases never decrease; no terminal task is live
//!   again; and, walking the finished table too every few mutations and at the end, every
//!   enqueued task is in the store exactly once and a terminal task never changes.
//! - **The workers** ([`check_worker`], after every step): a worker runs at most its
//!   concurrency; the handlers the harness runs for it are exactly the ones it believes run;
//!   a handler whose lease is the row's current lease on a Running row belongs to the row's
//!   holder, so no task runs under two live leases (steps of workflows included: they are
//!   ordinary rows).
//! - **The workflows** ([`Checker::check_store`] too, from the graph the harness submitted
//!   and the steps' rows, not from the store's own bookkeeping): a step leaves Waiting for
//!   Pending (or further) only when its join is satisfied by its parents' rows (at least
//!   `required` of them finished satisfying their edge: Completed, or any terminal state
//!   through an `allow_failed` edge), and is Skipped only when its join can no longer be; no
//!   step of a running workflow waits with its join decided (a promotion or a skip missed),
//!   and no step of a workflow paused since the last check is promoted or skipped; a skipped
//!   step never ran (no claim, no attempt since it last waited); no step of a cancelled
//!   workflow is promoted after the cancel (until a retry reopens it), and none of its steps
//!   is live after it (a cancel takes running steps too); a retry resets exactly the steps
//!   that did not complete (and, downstream, the finished ones below them), and no other; the
//!   workflow's machine agrees with the rows, step by step and in its counts (Waiting is
//!   Waiting; Pending, Claimed and Running are Ready or Running; each terminal state is
//!   itself), and its status with the rows (Cancelled exactly when the operator cancelled it;
//!   else, once every step is terminal, Completed exactly when every sink completed, Failed
//!   otherwise; Running or Paused before).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde_json::Value;

use crate::budget::ClaimPolicy;
use crate::config::AppConfig;
use crate::memory::{MemoryStore, READABLE_JSON_DEPTH, StoredTask, json_depth};
use crate::store::{DbReply, DbRequest, DbTime, FinishOutcome, NewWorkflow, WorkflowId};
use crate::task::{ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
use crate::worker::Worker;
use crate::workflow::{EdgePolicy, Join, StepId, StepState, WorkflowStatus};

/// How often [`Checker::check_store`] walks the finished table too.
const FULL_CHECK_EVERY: u64 = 16;

/// What the checker knows of one row before a request.
#[derive(Debug, Clone)]
struct Facts {
    state: TaskState,
    lease: Lease,
    claimed_by: Option<WorkerId>,
    claim_token: Option<u64>,
    claim_expires_at: Option<DbTime>,
    heartbeat_at: Option<DbTime>,
    claimed_at: Option<DbTime>,
    started_at: Option<DbTime>,
    attempts: u32,
    retries: u32,
    max_retries: u32,
    /// Whether its policy retries `WORKER_CRASHED`.
    retries_crashes: bool,
    run_at: DbTime,
    good_until: Option<DbTime>,
    priority: i16,
    queue: String,
}

impl Facts {
    fn of(row: &StoredTask) -> Facts {
        Facts {
            state: row.state,
            lease: row.lease,
            claimed_by: row.claimed_by.clone(),
            claim_token: row.claim_token,
            claim_expires_at: row.claim_expires_at,
            heartbeat_at: row.heartbeat_at,
            claimed_at: row.claimed_at,
            started_at: row.started_at,
            attempts: row.attempts,
            retries: row.retries,
            max_retries: row.retry.max_retries,
            retries_crashes: row.retry.retries_for(&ErrorCode::WorkerCrashed),
            run_at: row.run_at,
            good_until: row.good_until,
            priority: row.priority,
            queue: row.queue.clone(),
        }
    }

    fn held_by(&self, worker: &WorkerId, lease: Lease) -> bool {
        self.lease == lease && self.claimed_by.as_ref() == Some(worker)
    }

    fn live_claim(&self, now: DbTime) -> bool {
        self.state == TaskState::Claimed && self.claim_expires_at.is_some_and(|at| at > now)
    }

    fn expired_at(&self, now: DbTime) -> bool {
        self.good_until.is_some_and(|at| at <= now)
    }
}

/// The checker's own definition of claimable (DESIGN.md §3), independent of the store's.
fn claimable(row: &StoredTask, now: DbTime) -> bool {
    let free = match row.state {
        TaskState::Pending => true,
        TaskState::Claimed => row.claim_expires_at.is_some_and(|at| at <= now),
        _ => false,
    };
    free && row.run_at <= now && row.good_until.is_none_or(|at| at > now)
}

/// Rows as they were before one request, as much as its checks need.
#[derive(Debug, Default)]
pub(crate) struct Before {
    rows: BTreeMap<TaskId, Facts>,
    /// Reap: the rows the reaper must requeue, retry or fail, and expire.
    stale_claimed: BTreeSet<TaskId>,
    stale_running: BTreeSet<TaskId>,
    expiring: BTreeSet<TaskId>,
    /// Reap: waiting steps past their good-until. The reaper's first statement may promote
    /// them (it fails their parents' crashed runs), and its expiry, a statement of its own,
    /// then expires them.
    waiting_expiring: BTreeSet<TaskId>,
    /// Abandon (or a heartbeat's sweep of abandoned claims): the rows it must hand back.
    abandoned: BTreeSet<TaskId>,
    /// Rows other transactions held locked.
    locked: BTreeSet<TaskId>,
    /// Reap of dead workers: each worker's claims and runs (rows not locked).
    held_claims: BTreeMap<WorkerId, BTreeSet<TaskId>>,
    held_runs: BTreeMap<WorkerId, BTreeSet<TaskId>>,
}

/// A terminal row's frozen content.
#[derive(Debug, Clone, PartialEq)]
struct Frozen {
    state: TaskState,
    attempts: u32,
    retries: u32,
    lease: Lease,
    finished_at: Option<DbTime>,
    result: Option<Value>,
    error: Option<TaskError>,
}

impl Frozen {
    /// Whether `row` still has this content (compared in place, without cloning it).
    fn matches(&self, row: &StoredTask) -> bool {
        self.state == row.state
            && self.attempts == row.attempts
            && self.retries == row.retries
            && self.lease == row.lease
            && self.finished_at == row.finished_at
            && self.result == row.result
            && self.error == row.error
    }

    fn of(row: &StoredTask) -> Frozen {
        Frozen {
            state: row.state,
            attempts: row.attempts,
            retries: row.retries,
            lease: row.lease,
            finished_at: row.finished_at,
            result: row.result.clone(),
            error: row.error.clone(),
        }
    }
}

/// What the checker has seen of one task.
#[derive(Debug)]
struct Seen {
    attempts: u32,
    lease: Lease,
    frozen: Option<Frozen>,
}

impl Default for Seen {
    fn default() -> Self {
        Seen { attempts: 0, lease: Lease(0), frozen: None }
    }
}

/// The checker: what it has seen of every task so far.
#[derive(Debug)]
pub(crate) struct Checker {
    hard: bool,
    queue_caps: BTreeMap<String, u32>,
    /// Serial queues: their live claims count against their cap in either mode.
    serial: BTreeSet<String>,
    cluster_cap: Option<u32>,
    paused: BTreeSet<String>,
    /// `recovery.crash_retries`: re-runs of crashed runs beyond their policy.
    crash_retries: u32,
    /// Per task, indexed by `id - 1` (the store numbers tasks 1, 2, 3… in order): the most
    /// attempts and the highest lease seen, and the content once terminal. Its length is the
    /// number of tasks enqueued.
    seen: Vec<Seen>,
    mutations: u64,
    unfinished: usize,
    /// Finish requests whose completions were applied, in all.
    pub(crate) finishes_applied: u64,
    /// Stale writes (a lease or state that no longer matched) the store refused.
    pub(crate) fenced: u64,
    /// The run each task's latest applied finish ended: by whom, under which lease.
    finished_by: BTreeMap<TaskId, (WorkerId, Lease)>,
    /// The workflows submitted, as the harness built them.
    flows: BTreeMap<WorkflowId, Flow>,
    /// Each step's row as the last check saw it.
    steps: BTreeMap<TaskId, StepSeen>,
    /// The workflows a mutation touched since the last check (a step's row it moved, an
    /// operator's action): the next check looks at them (the others did not change).
    dirty: BTreeSet<WorkflowId>,
}

/// What the checker knows of one submitted workflow: its graph as the harness built it, and
/// what the operator did to it.
#[derive(Debug, Clone)]
struct Flow {
    /// Each step's task, by step.
    tasks: Vec<TaskId>,
    /// Each step's join.
    joins: Vec<Join>,
    /// Each step's parents (by step) with their edges' policies.
    parents: Vec<Vec<(usize, EdgePolicy)>>,
    /// Whether each step is a sink (has no children).
    sinks: Vec<bool>,
    /// The most steps on one path through it.
    depth: u32,
    /// The operator cancelled it (and the store accepted), and did not retry it since.
    cancelled: bool,
    /// Every step terminal and its status over: checked again only in full checks.
    settled: bool,
    /// Its status at the last check (none before the first, or after a failover).
    last_status: Option<WorkflowStatus>,
}

/// A step's row as the last check saw it.
#[derive(Debug, Clone, Copy)]
struct StepSeen {
    /// Its workflow.
    flow: WorkflowId,
    state: TaskState,
    /// Its attempts and lease the last time it was seen Waiting: a skipped step has run no
    /// more and been claimed no more since.
    waiting_attempts: u32,
    waiting_lease: Lease,
}

impl StepSeen {
    /// A step of workflow `flow` just submitted: Waiting, never claimed.
    fn new(flow: WorkflowId) -> StepSeen {
        StepSeen { flow, state: TaskState::Waiting, waiting_attempts: 0, waiting_lease: Lease(0) }
    }
}

/// Runs `check` and turns a `false` into an error naming what broke.
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

impl Checker {
    /// A checker for an application configured as `app`.
    pub(crate) fn new(app: &AppConfig) -> Checker {
        let queues = app.queues();
        Checker {
            hard: app.is_hard_cap_mode(),
            queue_caps: queues.iter().filter_map(|q| q.effective_cap().map(|cap| (q.name.clone(), cap))).collect(),
            serial: queues.iter().filter(|q| q.serial).map(|q| q.name.clone()).collect(),
            cluster_cap: app.cluster_wide_cap,
            paused: queues.iter().filter(|q| q.max_concurrency == Some(0)).map(|q| q.name.clone()).collect(),
            crash_retries: app.recovery.crash_retries,
            seen: Vec::new(),
            mutations: 0,
            unfinished: 0,
            finishes_applied: 0,
            fenced: 0,
            finished_by: BTreeMap::new(),
            flows: BTreeMap::new(),
            steps: BTreeMap::new(),
            dirty: BTreeSet::new(),
        }
    }

    /// A checker that takes `store` as it is now for the truth, keeping `self`'s counters: after
    /// a failover, the database's history is the store's, whatever was seen before.
    pub(crate) fn rebuild(&self, app: &AppConfig, store: &MemoryStore) -> Checker {
        let mut checker = Checker::new(app);
        checker.finishes_applied = self.finishes_applied;
        checker.fenced = self.fenced;
        let rows: BTreeMap<TaskId, &StoredTask> = store.tasks().map(|row| (row.id, row)).collect();
        let count = rows.keys().next_back().map_or(0, |id| id.0);
        checker.seen = (1..=count)
            .map(|id| match rows.get(&TaskId(id)) {
                Some(row) => Seen {
                    attempts: row.attempts,
                    lease: row.lease,
                    frozen: row.state.is_terminal().then(|| Frozen::of(row)),
                },
                None => Seen::default(),
            })
            .collect();
        // The workflows the database still has as submitted (a later submit may reuse a
        // forgotten one's id), with the operator's cancel only if it survived; their steps as
        // the rows are now.
        for (&id, flow) in &self.flows {
            let same = flow.tasks.iter().enumerate().all(|(step, &task)| {
                store.step_of(task) == Some((id, StepId(step as u32))) && store.task(task).is_some()
            });
            let Some(state) = store.workflow_state(id).filter(|_| same) else { continue };
            let mut flow = flow.clone();
            flow.settled = false;
            flow.last_status = None;
            // Only the operator cancels a workflow (and only a retry reopens it).
            flow.cancelled = state.status() == WorkflowStatus::Cancelled;
            for &task in &flow.tasks {
                let row = store.task(task).expect("checked above");
                let seen =
                    StepSeen { flow: id, state: row.state, waiting_attempts: row.attempts, waiting_lease: row.lease };
                checker.steps.insert(task, seen);
            }
            checker.flows.insert(id, flow);
            checker.dirty.insert(id);
        }
        checker
    }

    /// Records workflow `id`, submitted as `workflow`, whose steps' tasks are `tasks` (each a
    /// new task id, in order).
    pub(crate) fn submitted(
        &mut self,
        id: WorkflowId,
        workflow: &NewWorkflow,
        tasks: &[TaskId],
        depth: u32,
    ) -> Result<(), String> {
        let steps = workflow.spec.steps.len();
        ensure!(tasks.len() == steps, "workflow {id} of {steps} steps was given {} tasks", tasks.len());
        let next = self.seen.len() as i64 + 1;
        for &task in tasks {
            ensure!(task.0 >= next, "workflow {id}'s step task {task} is not a new task (next id {next})");
            self.enqueued(task)?;
            self.steps.insert(task, StepSeen::new(id));
        }
        let mut parents = vec![Vec::new(); steps];
        let mut sinks = vec![true; steps];
        for edge in &workflow.spec.edges {
            parents[edge.child.index()].push((edge.parent.index(), edge.policy));
            sinks[edge.parent.index()] = false;
        }
        let flow = Flow {
            tasks: tasks.to_vec(),
            joins: workflow.spec.steps.iter().map(|s| s.join).collect(),
            parents,
            sinks,
            depth,
            cancelled: false,
            settled: false,
            last_status: None,
        };
        ensure!(self.flows.insert(id, flow).is_none(), "workflow id {id} was handed out twice");
        self.dirty.insert(id);
        Ok(())
    }

    /// The operator cancelled workflow `id` and the store accepted: from now on (until a
    /// retry) none of its steps may be promoted, and none may be left live.
    pub(crate) fn workflow_cancelled(&mut self, id: WorkflowId) -> Result<(), String> {
        let flow = self.flows.get_mut(&id).ok_or_else(|| format!("cancelled workflow {id} was never submitted"))?;
        flow.cancelled = true;
        flow.settled = false;
        self.dirty.insert(id);
        Ok(())
    }

    /// The operator retried workflow `id` (`downstream` or not) at `now` and the store
    /// accepted; `before` is each step's row state before the retry. The steps a retry resets,
    /// by the checker's own reading: those finished without completing, and with `downstream`
    /// every finished step below them. Each of them must have left its finish (live again, or
    /// decided again by the retry's own statement: finished at `now`); they may change from now
    /// on, as Waiting steps never claimed since. No other step's row changes (the frozen rows
    /// are compared at the next full check). A cancelled workflow is open again.
    pub(crate) fn workflow_retried(
        &mut self,
        id: WorkflowId,
        downstream: bool,
        before: &[TaskState],
        store: &MemoryStore,
        now: DbTime,
    ) -> Result<(), String> {
        let flow = self.flows.get_mut(&id).ok_or_else(|| format!("retried workflow {id} was never submitted"))?;
        ensure!(before.len() == flow.tasks.len(), "retry of workflow {id}: {} states before", before.len());
        let mut reset: BTreeSet<usize> =
            (0..before.len()).filter(|&s| before[s].is_terminal() && before[s] != TaskState::Completed).collect();
        if downstream {
            let mut children = vec![Vec::new(); before.len()];
            for (child, parents) in flow.parents.iter().enumerate() {
                for &(parent, _) in parents {
                    children[parent].push(child);
                }
            }
            let mut stack: Vec<usize> = reset.iter().copied().collect();
            let mut seen: BTreeSet<usize> = reset.clone();
            while let Some(step) = stack.pop() {
                for &child in &children[step] {
                    if seen.insert(child) {
                        stack.push(child);
                        if before[child].is_terminal() {
                            reset.insert(child);
                        }
                    }
                }
            }
        }
        flow.cancelled = false;
        flow.settled = false;
        self.dirty.insert(id);
        let tasks = flow.tasks.clone();
        for step in reset {
            let task = tasks[step];
            let row = store.task(task).ok_or_else(|| format!("retried step task {task} vanished"))?;
            ensure!(
                !row.state.is_terminal() || row.finished_at == Some(now),
                "RETRY: step {step} (task {task}) of workflow {id} was {} and is still {} as it was (downstream \
                 {downstream})",
                before[step],
                row.state
            );
            self.seen(task)?.frozen = None;
            self.steps.insert(
                task,
                StepSeen {
                    flow: id,
                    state: TaskState::Waiting,
                    waiting_attempts: row.attempts,
                    waiting_lease: row.lease,
                },
            );
        }
        Ok(())
    }

    /// The workflows whose status is not over yet (not Completed, Failed or Cancelled), with
    /// their status.
    pub(crate) fn unfinished_workflows(&self, store: &MemoryStore) -> Vec<(WorkflowId, Option<WorkflowStatus>)> {
        self.flows
            .keys()
            .map(|&id| (id, store.workflow_state(id).map(|s| s.status())))
            .filter(|(_, status)| !status.is_some_and(WorkflowStatus::is_finished))
            .collect()
    }

    /// The most steps on one path of a workflow not over yet: how many steps, one after the
    /// other, the slowest of them may still have to run.
    pub(crate) fn workflow_levels(&self, store: &MemoryStore) -> u32 {
        let open: BTreeSet<WorkflowId> = self.unfinished_workflows(store).into_iter().map(|(id, _)| id).collect();
        self.flows.iter().filter(|(id, _)| open.contains(id)).map(|(_, flow)| flow.depth).max().unwrap_or(0)
    }

    /// Whether the join of step `task` is satisfied by its parents' rows (`None` when it is no
    /// step the checker knows).
    fn join_satisfied(&self, store: &MemoryStore, task: TaskId) -> Option<bool> {
        let flow = self.flows.values().find(|flow| flow.tasks.contains(&task))?;
        let step = flow.tasks.iter().position(|&t| t == task)?;
        let rows: Vec<&StoredTask> = flow.tasks.iter().map(|&t| store.task(t)).collect::<Option<_>>()?;
        let (satisfied, _, required) = join_standing(flow, step, &rows);
        Some(satisfied >= required)
    }

    /// The workflows submitted.
    pub(crate) fn workflow_count(&self) -> usize {
        self.flows.len()
    }

    /// A mutation moved (or may have moved) task `id`'s row: if it is a step, its workflow is
    /// checked at the next check.
    pub(crate) fn touch_task(&mut self, id: TaskId) {
        if let Some(seen) = self.steps.get(&id) {
            self.dirty.insert(seen.flow);
        }
    }

    /// The operator acted on workflow `id`: it is checked at the next check.
    pub(crate) fn touch_workflow(&mut self, id: WorkflowId) {
        self.dirty.insert(id);
    }

    /// Checks the workflows against their steps' rows (see the module docs): those a mutation
    /// touched since the last check; with `periodic`, every one not settled; with `deep`,
    /// every one.
    fn check_workflows(&mut self, store: &MemoryStore, periodic: bool, deep: bool) -> Result<(), String> {
        if store.statement_held() {
            // The workflows have not heard of what the statement finished yet: checked when it
            // ends.
            return Ok(());
        }
        let dirty = std::mem::take(&mut self.dirty);
        for (&id, flow) in self.flows.iter_mut() {
            if deep || (periodic && !flow.settled) || dirty.contains(&id) {
                check_flow(id, flow, &mut self.steps, store)?;
            }
        }
        Ok(())
    }

    /// Records a task id an enqueue returned: the next new one, or one seen before (an
    /// idempotency key).
    pub(crate) fn enqueued(&mut self, id: TaskId) -> Result<(), String> {
        let next = self.seen.len() as i64 + 1;
        ensure!((1..=next).contains(&id.0), "enqueue returned task {id}, expected at most {next} (ids go 1, 2, 3…)");
        if id.0 == next {
            self.seen.push(Seen::default());
        }
        Ok(())
    }

    /// Tasks enqueued (distinct ids).
    pub(crate) fn enqueued_count(&self) -> usize {
        self.seen.len()
    }

    fn seen(&mut self, id: TaskId) -> Result<&mut Seen, String> {
        let index = usize::try_from(id.0 - 1).ok().filter(|&i| i < self.seen.len());
        let index = index.ok_or_else(|| format!("task {id} is in the store but was never enqueued"))?;
        Ok(&mut self.seen[index])
    }

    /// Live tasks outside paused queues, as of the last store check.
    pub(crate) fn unfinished(&self) -> usize {
        self.unfinished
    }

    /// The queue caps over what really runs: per capped queue, the tasks Running in the store
    /// plus those whose handler runs on a live claim without the store knowing it started
    /// (soft-cap mode starts a task of an uncapped queue without asking; on a capped queue
    /// that would slip past the cap unseen by [`Checker::check_store`]). `handlers` are the
    /// handlers of every live worker.
    pub(crate) fn check_running_handlers(
        &self,
        store: &MemoryStore,
        handlers: impl Iterator<Item = (TaskId, Lease)>,
        rewound: &BTreeSet<TaskId>,
    ) -> Result<(), String> {
        if self.queue_caps.is_empty() {
            return Ok(());
        }
        let mut running: BTreeMap<&str, BTreeSet<TaskId>> = BTreeMap::new();
        for row in live_rows(store).filter(|row| row.state == TaskState::Running) {
            running.entry(row.queue.as_str()).or_default().insert(row.id);
        }
        // A run the database forgot (a failover) is not the store's to count.
        for (task, lease) in handlers.filter(|(task, _)| !rewound.contains(task)) {
            if let Some(row) = store.task(task).filter(|row| row.lease == lease && row.state == TaskState::Claimed) {
                running.entry(row.queue.as_str()).or_default().insert(task);
            }
        }
        for (queue, cap) in &self.queue_caps {
            let n = running.get(queue.as_str()).map_or(0, BTreeSet::len);
            ensure!(n <= *cap as usize, "CAP: {n} tasks of queue {queue} run (store and handlers), cap {cap}");
        }
        Ok(())
    }

    /// Whether `worker`'s own finish ended `task`'s run under `lease` (the latest finish of it
    /// that applied).
    pub(crate) fn finished_by(&self, task: TaskId, worker: &WorkerId, lease: Lease) -> bool {
        self.finished_by.get(&task).is_some_and(|(by, under)| by == worker && *under == lease)
    }

    /// Whether tasks of `queue` can never run (its cap is 0).
    pub(crate) fn is_paused(&self, queue: &str) -> bool {
        self.paused.contains(queue)
    }

    /// Captures what the checks of `request` need, before the store applies it at `now`.
    pub(crate) fn before(&self, store: &MemoryStore, request: &DbRequest, now: DbTime) -> Before {
        let mut before = Before { locked: store.locked_rows().clone(), ..Before::default() };
        let named = |before: &mut Before, ids: &mut dyn Iterator<Item = TaskId>| {
            for id in ids {
                if let Some(row) = store.task(id) {
                    before.rows.insert(id, Facts::of(row));
                }
            }
        };
        match request {
            DbRequest::Claim { policy, .. } => {
                let served: BTreeSet<&str> = policy.queues.iter().map(|q| q.name.as_str()).collect();
                for row in live_rows(store) {
                    // Forbidden flags, priority bounds (urgent claims, floors) and a run-at bound leave rows out.
                    if served.contains(row.queue.as_str()) && claimable(row, now) && row.admitted_by(policy) {
                        before.rows.insert(row.id, Facts::of(row));
                    }
                }
            }
            DbRequest::Start { tasks, .. }
            | DbRequest::RecordStarts { tasks, .. }
            | DbRequest::Release { tasks, .. } => {
                named(&mut before, &mut tasks.iter().map(|t| t.task));
            }
            DbRequest::Finish { completions, .. } => named(&mut before, &mut completions.iter().map(|c| c.task.task)),
            // The harness checks it as its finish and then its claim.
            DbRequest::FinishAndClaim { .. } => {}
            DbRequest::Heartbeat { worker, claimed, running, abandoned, .. } => {
                named(&mut before, &mut claimed.iter().chain(running).map(|t| t.task));
                before.abandoned = abandoned_rows(store, worker, abandoned);
                for t in claimed.iter().chain(running) {
                    if store.task(t.task).is_some_and(|row| row.lease == t.lease) {
                        before.abandoned.remove(&t.task);
                    }
                }
                for &id in &before.abandoned {
                    before.rows.insert(id, Facts::of(store.task(id).expect("abandoned rows are live")));
                }
            }
            DbRequest::AbandonClaim { worker, token } => {
                before.abandoned = abandoned_rows(store, worker, &[*token]);
                for &id in &before.abandoned {
                    before.rows.insert(id, Facts::of(store.task(id).expect("abandoned rows are live")));
                }
            }
            DbRequest::Reap { claimed_stale_ms, running_stale_ms, .. } => {
                for row in live_rows(store) {
                    let stale = |threshold: Option<u64>, at: Option<DbTime>| {
                        threshold.is_some_and(|ms| at.is_some_and(|at| at.plus_ms(ms) < now))
                    };
                    if before.locked.contains(&row.id) {
                        continue; // the reaper skips what it cannot lock
                    }
                    let mut pending = row.state == TaskState::Pending;
                    if row.state == TaskState::Claimed && stale(*claimed_stale_ms, row.heartbeat_at.or(row.claimed_at))
                    {
                        before.stale_claimed.insert(row.id);
                        pending = true;
                    }
                    if row.state == TaskState::Running && stale(*running_stale_ms, row.heartbeat_at.or(row.started_at))
                    {
                        before.stale_running.insert(row.id);
                    }
                    if pending && row.good_until.is_some_and(|at| at <= now) {
                        before.expiring.insert(row.id);
                    }
                    if row.state == TaskState::Waiting && row.good_until.is_some_and(|at| at <= now) {
                        before.waiting_expiring.insert(row.id);
                    }
                    if before.stale_claimed.contains(&row.id) || before.stale_running.contains(&row.id) {
                        before.rows.insert(row.id, Facts::of(row));
                    }
                }
            }
            DbRequest::ReapDead { .. } => {
                for row in live_rows(store) {
                    // Only a worker whose token no session holds can be found dead.
                    let Some(holder) = row.claimed_by.as_ref().filter(|w| !store.holds_token(w)).cloned() else {
                        continue;
                    };
                    if before.locked.contains(&row.id) {
                        continue;
                    }
                    let held = match row.state {
                        TaskState::Claimed => &mut before.held_claims,
                        TaskState::Running => &mut before.held_runs,
                        _ => continue,
                    };
                    held.entry(holder).or_default().insert(row.id);
                    before.rows.insert(row.id, Facts::of(row));
                }
            }
            DbRequest::Purge { .. }
            | DbRequest::Vacuum { .. }
            | DbRequest::RegisterWorker(_)
            | DbRequest::DeregisterWorker(_)
            | DbRequest::SetWaiting { .. } => {}
        }
        before
    }

    /// Checks the store's `reply` to `request` by `worker` at `now` against the rows before.
    pub(crate) fn after(
        &mut self,
        store: &MemoryStore,
        worker: &WorkerId,
        request: &DbRequest,
        before: &Before,
        reply: &DbReply,
        now: DbTime,
    ) -> Result<(), String> {
        let pre = |id: TaskId| before.rows.get(&id);
        let post = |id: TaskId| store.task(id).ok_or_else(|| format!("task {id} vanished from the store"));
        let mut touched: Vec<TaskId> = Vec::new();
        match (request, reply) {
            (
                DbRequest::Claim { policy, my_running, my_claimed, start_now, .. },
                DbReply::Claimed { tasks, more, .. },
            ) => {
                let budget = policy.local_budget(*my_running, *my_claimed);
                ensure!(
                    tasks.len() as u64 <= u64::from(budget),
                    "claim by {worker} took {} tasks, budget {budget}",
                    tasks.len()
                );
                let mut taken: BTreeSet<TaskId> = BTreeSet::new();
                for (index, task) in tasks.iter().enumerate() {
                    let id = task.id;
                    let Some(was) = pre(id) else {
                        return Err(format!("claim by {worker} took task {id}, which was not claimable at {}", now.0));
                    };
                    ensure!(taken.insert(id), "claim by {worker} returned task {id} twice");
                    let row = post(id)?;
                    ensure!(
                        task.lease == Lease(was.lease.0 + 1) && row.lease == task.lease,
                        "claim of task {id}: lease {} -> {} (row {}), expected +1",
                        was.lease,
                        task.lease,
                        row.lease
                    );
                    ensure!(row.claimed_by.as_ref() == Some(worker), "claimed task {id} is not held by {worker}");
                    let unreadable = json_depth(&row.args) > READABLE_JSON_DEPTH;
                    ensure!(
                        task.args_error.is_some() == unreadable && (!unreadable || task.args.is_null()),
                        "claim of task {id}: args_error {:?} for arguments {} levels deep",
                        task.args_error,
                        json_depth(&row.args)
                    );
                    ensure!(
                        task.started == (index < *start_now as usize),
                        "claim of task {id}: started {} at index {index}, start_now {start_now}",
                        task.started
                    );
                    let (state, attempts) = if task.started {
                        (TaskState::Running, was.attempts + 1)
                    } else {
                        (TaskState::Claimed, was.attempts)
                    };
                    ensure!(row.state == state, "claimed task {id} is {} (started {})", row.state, task.started);
                    ensure!(
                        row.attempts == attempts && task.attempt.0 == was.attempts + 1,
                        "claim of task {id}: attempts {} -> {} (reply {}), started {}",
                        was.attempts,
                        row.attempts,
                        task.attempt,
                        task.started
                    );
                    ensure!(
                        !was.expired_at(now),
                        "task {id} claimed at {} at or past its good_until {:?}",
                        now.0,
                        was.good_until
                    );
                    touched.push(id);
                }
                // Best first within each queue: nothing left behind sorts before what was taken.
                let key = |f: &Facts, id: TaskId| (f.priority, f.run_at, id);
                let mut best_left: BTreeMap<&str, (i16, DbTime, TaskId)> = BTreeMap::new();
                for (&id, facts) in &before.rows {
                    if !taken.contains(&id) && !before.locked.contains(&id) {
                        let k = key(facts, id);
                        let entry = best_left.entry(facts.queue.as_str()).or_insert(k);
                        *entry = (*entry).min(k);
                    }
                }
                for &id in &taken {
                    let facts = &before.rows[&id];
                    if let Some(left) = best_left.get(facts.queue.as_str()) {
                        ensure!(
                            key(facts, id) < *left,
                            "claim by {worker} took task {id} {:?} but left task {} {:?} in queue {}",
                            key(facts, id),
                            left.2,
                            left,
                            facts.queue
                        );
                    }
                }
                let eligible = before.rows.len();
                // A row another transaction locks may read as taken by another claimer (as in
                // PostgreSQL): then `more` may be false with it left behind.
                let locked_left = before.rows.keys().any(|id| before.locked.contains(id));
                ensure!(
                    *more == (eligible > tasks.len()) || (locked_left && !*more),
                    "claim by {worker}: more = {more} with {eligible} eligible and {} taken",
                    tasks.len()
                );
            }
            (DbRequest::Start { tasks, .. }, DbReply::Started { started, expired, deferred, lost }) => {
                let mut answered: BTreeSet<TaskId> = BTreeSet::new();
                let all = started
                    .iter()
                    .map(|(id, _)| *id)
                    .chain(expired.iter().copied())
                    .chain(deferred.iter().copied())
                    .chain(lost.iter().copied());
                for id in all {
                    ensure!(answered.insert(id), "start by {worker} answered task {id} twice");
                }
                let asked: BTreeSet<TaskId> = tasks.iter().map(|t| t.task).collect();
                ensure!(answered == asked, "start by {worker} answered {answered:?} for {asked:?}");
                let lease_of = |id: TaskId| tasks.iter().find(|t| t.task == id).map(|t| t.lease).unwrap_or(Lease(-1));
                let usable = |id: TaskId| {
                    pre(id).is_some_and(|f| {
                        f.held_by(worker, lease_of(id)) && (f.live_claim(now) || f.state == TaskState::Running)
                    })
                };
                for &(id, attempt) in started {
                    ensure!(
                        usable(id),
                        "start by {worker} started task {id} under a lease or state it does not hold: {:?}",
                        pre(id)
                    );
                    let was = pre(id).expect("usable rows have facts");
                    let row = post(id)?;
                    ensure!(row.state == TaskState::Running, "started task {id} is {}", row.state);
                    if was.state == TaskState::Claimed {
                        ensure!(
                            !was.expired_at(now),
                            "task {id} started at {} at or past its good_until {:?}",
                            now.0,
                            was.good_until
                        );
                        ensure!(
                            row.attempts == was.attempts + 1,
                            "start of task {id}: attempts {} -> {}",
                            was.attempts,
                            row.attempts
                        );
                    } else {
                        ensure!(row.attempts == was.attempts, "re-start of running task {id} changed attempts");
                    }
                    ensure!(
                        attempt.0 == row.attempts,
                        "start of task {id} reported attempt {attempt}, row has {}",
                        row.attempts
                    );
                    touched.push(id);
                }
                for &id in expired {
                    ensure!(usable(id), "start by {worker} expired task {id} it does not hold");
                    let was = pre(id).expect("usable rows have facts");
                    ensure!(
                        was.expired_at(now),
                        "start expired task {id} at {} before its good_until {:?}",
                        now.0,
                        was.good_until
                    );
                    ensure!(post(id)?.state == TaskState::Expired, "expired task {id} is {}", post(id)?.state);
                    touched.push(id);
                }
                for &id in deferred {
                    // In hard-cap mode a start checks no cap: only a row another transaction
                    // holds is deferred.
                    ensure!(
                        !self.hard || before.locked.contains(&id),
                        "start by {worker} deferred task {id} in hard-cap mode"
                    );
                    ensure!(usable(id), "start by {worker} deferred task {id} it does not hold");
                }
                for &id in lost {
                    ensure!(
                        !usable(id),
                        "start by {worker} reported task {id} lost although it holds it: {:?}",
                        pre(id)
                    );
                    self.fenced += 1;
                }
            }
            (DbRequest::RecordStarts { tasks, .. }, DbReply::Started { started, expired, deferred, lost }) => {
                ensure!(
                    expired.is_empty() && deferred.is_empty(),
                    "record of starts by {worker} expired {expired:?} and deferred {deferred:?}"
                );
                let answered: Vec<TaskId> = started.iter().map(|(id, _)| *id).chain(lost.iter().copied()).collect();
                let asked: Vec<TaskId> = tasks.iter().map(|t| t.task).collect();
                ensure!(sorted(&answered) == sorted(&asked), "record by {worker} answered {answered:?} for {asked:?}");
                for t in tasks {
                    let held = pre(t.task).is_some_and(|f| {
                        matches!(f.state, TaskState::Claimed | TaskState::Running) && f.held_by(worker, t.lease)
                    });
                    ensure!(
                        held == started.iter().any(|(id, _)| *id == t.task),
                        "record by {worker} of task {} under lease {}: held {held}, reply {reply:?}",
                        t.task,
                        t.lease
                    );
                    if !held {
                        self.fenced += 1;
                        continue;
                    }
                    let was = pre(t.task).expect("held rows have facts");
                    let row = post(t.task)?;
                    ensure!(row.state == TaskState::Running, "recorded task {} is {}", t.task, row.state);
                    run_counted_once(t.task, "record", was, row)?;
                    touched.push(t.task);
                }
            }
            (DbRequest::Finish { completions, .. }, DbReply::Finished { applied, lost }) => {
                let answered: Vec<TaskId> = applied.iter().map(|(id, _)| *id).chain(lost.iter().copied()).collect();
                let asked: Vec<TaskId> = completions.iter().map(|c| c.task.task).collect();
                ensure!(sorted(&answered) == sorted(&asked), "finish by {worker} answered {answered:?} for {asked:?}");
                // A batch may name a task twice (a stale re-send and a fresh run): at most the
                // completion under the row's lease applies.
                // Claimed counts too: a run started without a start request (soft-cap mode).
                let running_under = |c: &TaskLease| {
                    pre(c.task).is_some_and(|f| {
                        matches!(f.state, TaskState::Running | TaskState::Claimed) && f.held_by(worker, c.lease)
                    })
                };
                for &(id, state) in applied {
                    let Some(completion) = completions.iter().find(|c| c.task.task == id && running_under(&c.task))
                    else {
                        return Err(format!(
                            "FENCING: finish by {worker} of task {id} was applied, but no completion of the batch \
                             names the row's lease and state: row {:?}, batch {:?}",
                            pre(id),
                            completions.iter().filter(|c| c.task.task == id).map(|c| c.task.lease).collect::<Vec<_>>()
                        ));
                    };
                    ensure!(applied.iter().filter(|(t, _)| *t == id).count() == 1, "finish of task {id} applied twice");
                    let was = pre(id).expect("applied rows have facts");
                    let row = post(id)?;
                    ensure!(row.state == state, "finished task {id} is {}, reply says {state}", row.state);
                    self.finished_by.insert(id, (worker.clone(), completion.task.lease));
                    run_counted_once(id, "finish", was, row)?;
                    match (&completion.outcome, state) {
                        (FinishOutcome::Completed(_), TaskState::Completed) => {}
                        (FinishOutcome::Failed(_) | FinishOutcome::Retry { .. }, TaskState::Failed) => {}
                        (FinishOutcome::Retry { .. }, TaskState::Pending) => {
                            ensure!(
                                row.retries == was.retries + 1,
                                "retry of task {id}: retries {} -> {}",
                                was.retries,
                                row.retries
                            );
                            ensure!(row.run_at >= now, "retry of task {id} runs in the past");
                            ensure!(
                                row.good_until.is_none_or(|at| row.run_at < at),
                                "retry of task {id} scheduled at {} at or past its good_until {:?}",
                                row.run_at.0,
                                row.good_until
                            );
                        }
                        (outcome, state) => {
                            return Err(format!("finish of task {id} with {outcome:?} left it {state}"));
                        }
                    }
                    touched.push(id);
                }
                for id in lost {
                    let fresh = completions.iter().filter(|c| c.task.task == *id && running_under(&c.task)).count();
                    let applied_too = applied.iter().any(|(t, _)| t == id);
                    ensure!(fresh == 0 || applied_too, "finish by {worker} of task {id} refused although it holds it");
                    self.fenced += 1;
                }
                if !applied.is_empty() {
                    self.finishes_applied += 1;
                }
            }
            (DbRequest::Heartbeat { claimed, running, .. }, DbReply::Heartbeat { lost, busy, handed_back }) => {
                let lost: BTreeSet<TaskId> = lost.iter().copied().collect();
                let busy: BTreeSet<TaskId> = busy.iter().copied().collect();
                for (list, state) in [(claimed, TaskState::Claimed), (running, TaskState::Running)] {
                    for t in list {
                        if before.locked.contains(&t.task) {
                            let held = pre(t.task).is_some_and(|f| {
                                matches!(f.state, TaskState::Claimed | TaskState::Running) && f.held_by(worker, t.lease)
                            });
                            ensure!(
                                held == busy.contains(&t.task) && held != lost.contains(&t.task),
                                "heartbeat by {worker}: locked task {} held {held}, reply {reply:?}",
                                t.task
                            );
                            continue;
                        }
                        ensure!(
                            !busy.contains(&t.task),
                            "heartbeat by {worker} called task {} busy, which no one locks",
                            t.task
                        );
                        let held = pre(t.task).is_some_and(|f| f.state == state && f.held_by(worker, t.lease));
                        // Listed as claimed, started since under the same lease (a start that
                        // raced the beat): still the worker's, so either answer is accepted
                        // here; the harness judges the worker's reaction (SPURIOUS LOSS).
                        let started = state == TaskState::Claimed
                            && pre(t.task).is_some_and(|f| f.state == TaskState::Running && f.held_by(worker, t.lease));
                        if !started {
                            ensure!(
                                held != lost.contains(&t.task),
                                "heartbeat by {worker}: task {} held {held} but lost {}",
                                t.task,
                                !held
                            );
                        }
                    }
                }
                self.fenced += lost.len() as u64;
                let got: BTreeSet<TaskId> = handed_back.iter().copied().collect();
                ensure!(
                    got == before.abandoned,
                    "heartbeat by {worker} handed back {got:?} of abandoned claims, expected {:?}",
                    before.abandoned
                );
                for &id in handed_back {
                    self.check_handed_back(pre(id), post(id)?, id)?;
                    touched.push(id);
                }
            }
            (DbRequest::Release { tasks, .. }, DbReply::Released { released, lost }) => {
                for t in tasks {
                    let held = pre(t.task).is_some_and(|f| {
                        matches!(f.state, TaskState::Claimed | TaskState::Running) && f.held_by(worker, t.lease)
                    });
                    ensure!(
                        held == released.contains(&t.task) && held != lost.contains(&t.task),
                        "release by {worker} of task {} under lease {}: held {held}, reply {reply:?}",
                        t.task,
                        t.lease
                    );
                }
                for &id in released {
                    self.check_released(pre(id), post(id)?, id)?;
                    touched.push(id);
                }
            }
            (DbRequest::AbandonClaim { .. }, DbReply::Released { released, lost }) => {
                let got: BTreeSet<TaskId> = released.iter().copied().collect();
                ensure!(
                    got == before.abandoned && lost.is_empty(),
                    "abandon by {worker} released {got:?}, expected {:?}",
                    before.abandoned
                );
                for &id in released {
                    self.check_handed_back(pre(id), post(id)?, id)?;
                    touched.push(id);
                }
            }
            (DbRequest::Reap { .. }, DbReply::Reaped(report)) => {
                let requeued: BTreeSet<TaskId> = report.requeued.iter().copied().collect();
                ensure!(
                    requeued == before.stale_claimed,
                    "reaper requeued {requeued:?}, stale claims were {:?}",
                    before.stale_claimed
                );
                let crashed: BTreeSet<TaskId> = report.retried.iter().chain(&report.failed).copied().collect();
                ensure!(
                    crashed == before.stale_running,
                    "reaper took runs {crashed:?}, stale runs were {:?}",
                    before.stale_running
                );
                let expired: BTreeSet<TaskId> = report.expired.iter().copied().collect();
                // What was due, and the due steps the reap's own failures promoted (their joins
                // satisfied by the rows now).
                let promoted: BTreeSet<TaskId> = expired.difference(&before.expiring).copied().collect();
                ensure!(
                    expired.is_superset(&before.expiring) && promoted.is_subset(&before.waiting_expiring),
                    "reaper expired {expired:?}, expected {:?} (and of the waiting steps past their good-until {:?}, \
                     those it promoted)",
                    before.expiring,
                    before.waiting_expiring
                );
                for &id in &promoted {
                    ensure!(
                        self.join_satisfied(store, id) == Some(true),
                        "reaper expired waiting step {id}, whose join its parents' rows do not satisfy"
                    );
                }
                self.check_crashed(report, pre, post)?;
                touched
                    .extend(report.requeued.iter().chain(&report.retried).chain(&report.failed).chain(&report.expired));
            }
            (DbRequest::ReapDead { .. }, DbReply::Reaped(report)) => {
                let mut claims = BTreeSet::new();
                let mut runs = BTreeSet::new();
                for dead in &report.dead_workers {
                    ensure!(!store.holds_token(dead), "the reaper found {dead} dead, but its token is held");
                    claims.extend(before.held_claims.get(dead).into_iter().flatten().copied());
                    runs.extend(before.held_runs.get(dead).into_iter().flatten().copied());
                }
                let requeued: BTreeSet<TaskId> = report.requeued.iter().copied().collect();
                ensure!(requeued == claims, "dead workers' claims {claims:?} but the reaper requeued {requeued:?}");
                let crashed: BTreeSet<TaskId> = report.retried.iter().chain(&report.failed).copied().collect();
                ensure!(crashed == runs, "dead workers' runs {runs:?} but the reaper took {crashed:?}");
                ensure!(
                    report.expired.is_empty() && report.workers_pruned == 0,
                    "a reap of dead workers expired or pruned: {report:?}"
                );
                for &id in &report.requeued {
                    self.check_released(pre(id), post(id)?, id)?;
                }
                self.check_crashed(report, pre, post)?;
                touched.extend(report.requeued.iter().chain(&report.retried).chain(&report.failed));
            }
            (DbRequest::RegisterWorker(_) | DbRequest::DeregisterWorker(_), DbReply::Done) => {}
            (DbRequest::SetWaiting { .. }, DbReply::WaitingSet { .. }) => {}
            // The simulated apps keep finished tasks (no retention): a purge deletes nothing
            // the checker relies on.
            (DbRequest::Purge { .. }, DbReply::Purged { .. }) => {}
            (DbRequest::Vacuum { .. }, DbReply::Vacuumed { .. }) => {}
            (request, reply) => return Err(format!("the store answered {} with {reply:?}", request.kind())),
        }
        for &id in &touched {
            // A step's move (and its workflow's promotions and skips, in the same workflow).
            self.touch_task(id);
        }
        for id in touched {
            if let Some(row) = store.task(id).filter(|row| row.state.is_terminal()) {
                self.freeze(row)?;
            }
        }
        Ok(())
    }

    /// The runs a reaper ended as crashed: retried (a retry spent, `WORKER_CRASHED`, before
    /// good-until) only when their policy retries crashes or `recovery.crash_retries` allows
    /// another run; failed otherwise.
    fn check_crashed<'r>(
        &self,
        report: &crate::store::ReapReport,
        pre: impl Fn(TaskId) -> Option<&'r Facts>,
        post: impl Fn(TaskId) -> Result<&'r StoredTask, String>,
    ) -> Result<(), String> {
        for &id in &report.retried {
            let (was, row) = (pre(id).ok_or_else(|| format!("reaped run {id} had no facts"))?, post(id)?);
            let by_policy = was.retries_crashes && was.retries < was.max_retries;
            ensure!(
                by_policy || was.retries < self.crash_retries,
                "reaper retried task {id} with no retry left (retries {}, policy max {}, crash retries {})",
                was.retries,
                was.max_retries,
                self.crash_retries
            );
            ensure!(
                row.state == TaskState::Pending && row.retries == was.retries + 1,
                "reaper retry of task {id} left {} retries {}",
                row.state,
                row.retries
            );
            ensure!(
                row.good_until.is_none_or(|at| row.run_at < at),
                "reaper retry of task {id} scheduled at or past good_until"
            );
            ensure!(
                row.error.as_ref().is_some_and(|e| e.code == ErrorCode::WorkerCrashed),
                "reaper retry of task {id} without WORKER_CRASHED"
            );
        }
        for &id in &report.failed {
            ensure!(post(id)?.state == TaskState::Failed, "reaper failed task {id} but it is {}", post(id)?.state);
        }
        Ok(())
    }

    fn check_released(&self, was: Option<&Facts>, row: &StoredTask, id: TaskId) -> Result<(), String> {
        let was = was.ok_or_else(|| format!("released task {id} was not held"))?;
        ensure!(row.state == TaskState::Pending, "released task {id} is {}", row.state);
        ensure!(
            row.attempts == was.attempts && row.retries == was.retries,
            "release of task {id} changed attempts {} -> {} or retries {} -> {}",
            was.attempts,
            row.attempts,
            was.retries,
            row.retries
        );
        ensure!(row.claimed_by.is_none() && row.claim_token.is_none(), "released task {id} still names a holder");
        let _ = (was.claim_token, was.claimed_at, was.started_at, was.heartbeat_at, was.run_at);
        Ok(())
    }

    /// A row of an abandoned claim handed back: as a release, but a run the claim started
    /// gives its attempt back (nothing ran), so its attempts may go down by one.
    fn check_handed_back(&mut self, was: Option<&Facts>, row: &StoredTask, id: TaskId) -> Result<(), String> {
        let was = was.ok_or_else(|| format!("handed back task {id} was not held"))?;
        ensure!(row.state == TaskState::Pending, "handed back task {id} is {}", row.state);
        let counted = u32::from(was.state == TaskState::Running);
        ensure!(
            row.attempts + counted == was.attempts && row.retries == was.retries,
            "undoing the claim of task {id} (was {}) left attempts {} -> {} or retries {} -> {}: the attempt it counted must go back",
            was.state,
            was.attempts,
            row.attempts,
            was.retries,
            row.retries
        );
        ensure!(row.claimed_by.is_none() && row.claim_token.is_none(), "handed back task {id} still names a holder");
        self.seen(id)?.attempts = row.attempts;
        Ok(())
    }

    fn freeze(&mut self, row: &StoredTask) -> Result<(), String> {
        let seen = self.seen(row.id)?;
        match &seen.frozen {
            Some(before) => {
                ensure!(before.matches(row), "terminal task {} changed: {before:?} -> {:?}", row.id, Frozen::of(row))
            }
            None => seen.frozen = Some(Frozen::of(row)),
        }
        Ok(())
    }

    /// Checks the store at `now` (see the module docs): the live table every time, the
    /// finished table and the counts every [`FULL_CHECK_EVERY`] calls or when `full` (the rows
    /// a request touches are checked by [`after`](Self::after) at once).
    pub(crate) fn check_store(&mut self, store: &MemoryStore, now: DbTime, full: bool) -> Result<(), String> {
        self.mutations += 1;
        let deep = full;
        let full = full || self.mutations % FULL_CHECK_EVERY == 0;
        let mut queue_in_flight: BTreeMap<&str, u32> = BTreeMap::new();
        let mut cluster_in_flight = 0u32;
        let mut unfinished = 0;
        let mut live = 0usize;
        for row in live_rows(store) {
            live += 1;
            let id = row.id;
            ensure!(self.seen(id)?.frozen.is_none(), "terminal task {id} is live again: {}", row.state);
            self.monotonic(row)?;
            match row.state {
                TaskState::Pending => ensure!(row.claimed_by.is_none(), "pending task {id} names a holder"),
                TaskState::Claimed => ensure!(
                    row.claimed_by.is_some() && row.claim_expires_at.is_some(),
                    "claimed task {id} without holder or lease expiry"
                ),
                TaskState::Running => {
                    ensure!(
                        row.claimed_by.is_some() && row.attempts >= 1,
                        "running task {id} without holder or attempt"
                    )
                }
                TaskState::Waiting => {
                    ensure!(self.steps.contains_key(&id), "task {id} is Waiting but is no workflow's step");
                    ensure!(
                        row.claimed_by.is_none() && row.claim_expires_at.is_none(),
                        "waiting step {id} names a holder or a claim"
                    );
                }
                state => return Err(format!("task {id} is {state} in the live table")),
            }
            let live_claim = row.state == TaskState::Claimed && row.claim_expires_at.is_some_and(|at| at > now);
            if row.state == TaskState::Running || (live_claim && (self.hard || self.serial.contains(&row.queue))) {
                *queue_in_flight.entry(row.queue.as_str()).or_insert(0) += 1;
            }
            if row.state == TaskState::Running || (live_claim && self.hard) {
                cluster_in_flight += 1;
            }
            if !self.paused.contains(&row.queue) {
                unfinished += 1;
            }
        }
        self.unfinished = unfinished;
        let counted = if self.hard { "Running + live Claimed" } else { "Running (+ live Claimed if serial)" };
        for (queue, &n) in &queue_in_flight {
            if let Some(&cap) = self.queue_caps.get(*queue) {
                ensure!(n <= cap, "CAP: queue {queue} has {n} in flight ({counted}), cap {cap}");
            }
        }
        if let Some(cap) = self.cluster_cap {
            ensure!(cluster_in_flight <= cap, "CAP: {cluster_in_flight} in flight across the cluster, cap {cap}");
        }
        self.check_workflows(store, full, deep)?;
        if full {
            let mut finished = 0usize;
            for row in store.tasks().skip(live) {
                finished += 1;
                ensure!(row.state.is_terminal(), "task {} is {} in the finished table", row.id, row.state);
                self.monotonic(row)?;
                self.freeze(row)?;
            }
            // Every row's id was enqueued and the tables are keyed by id, so equal counts and no
            // id in both tables mean every enqueued task is there exactly once.
            ensure!(
                live + finished == self.seen.len(),
                "NO TASK LOST: {} tasks enqueued, the store has {live} live and {finished} finished",
                self.seen.len()
            );
            for row in live_rows(store) {
                ensure!(self.seen(row.id)?.frozen.is_none(), "task {} is both live and finished", row.id);
            }
        }
        Ok(())
    }

    fn monotonic(&mut self, row: &StoredTask) -> Result<(), String> {
        let seen = self.seen(row.id)?;
        ensure!(
            row.attempts >= seen.attempts,
            "attempts of task {} went down: {} -> {}",
            row.id,
            seen.attempts,
            row.attempts
        );
        ensure!(row.lease >= seen.lease, "lease of task {} went down: {} -> {}", row.id, seen.lease, row.lease);
        (seen.attempts, seen.lease) = (row.attempts, row.lease);
        Ok(())
    }

    /// A short description of every live task outside paused queues, for a liveness failure.
    pub(crate) fn describe_unfinished(&self, store: &MemoryStore, now: DbTime, limit: usize) -> String {
        let mut out = String::new();
        for row in live_rows(store).filter(|row| !self.paused.contains(&row.queue)).take(limit) {
            let _ = write!(
                out,
                "\n  task {} {} queue {} lease {} holder {:?} attempts {} retries {}/{} run_at {:+}ms good_until {:?} heartbeat {:?}",
                row.id,
                row.state,
                row.queue,
                row.lease,
                row.claimed_by.as_ref().map(|w| w.0.as_str()),
                row.attempts,
                row.retries,
                row.retry.max_retries,
                row.run_at.0 - now.0,
                row.good_until.map(|at| at.0 - now.0),
                row.heartbeat_at.map(|at| at.0 - now.0),
            );
            if let Some((workflow, step)) = store.step_of(row.id) {
                let status = store.workflow_state(workflow).map(|s| s.status());
                let parents: Vec<String> =
                    store.parents(row.id).iter().map(|p| format!("{}:{}", p.task, p.state)).collect();
                let _ = write!(out, " (step {step} of workflow {workflow} {status:?}, parents {parents:?})");
            }
        }
        for (id, status) in self.unfinished_workflows(store).into_iter().take(limit) {
            let _ = write!(out, "\n  workflow {id} is {status:?}");
        }
        out
    }
}

/// The rows held by `worker` under one of the claim `tokens` that no one else locks: what
/// undoing those claims must hand back.
fn abandoned_rows(store: &MemoryStore, worker: &WorkerId, tokens: &[u64]) -> BTreeSet<TaskId> {
    live_rows(store)
        .filter(|row| {
            matches!(row.state, TaskState::Claimed | TaskState::Running)
                && row.claimed_by.as_ref() == Some(worker)
                && row.claim_token.is_some_and(|t| tokens.contains(&t))
                && !store.locked_rows().contains(&row.id)
        })
        .map(|row| row.id)
        .collect()
}

/// The live table: `tasks()` lists it first, and its rows are the non-terminal ones.
fn live_rows(store: &MemoryStore) -> impl Iterator<Item = &StoredTask> {
    store.tasks().take_while(|row| !row.state.is_terminal())
}

fn sorted(ids: &[TaskId]) -> Vec<TaskId> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids
}

/// A write that ends or records a run counts it as an attempt exactly when the run started
/// without a start request (the row was still Claimed); a Running row already counted it.
fn run_counted_once(id: TaskId, what: &str, was: &Facts, row: &StoredTask) -> Result<(), String> {
    let counted = u32::from(was.state == TaskState::Claimed);
    ensure!(
        row.attempts == was.attempts + counted,
        "{what} of task {id} from {}: attempts {} -> {}",
        was.state,
        was.attempts,
        row.attempts
    );
    Ok(())
}

/// How a step's join stands by its parents' rows: parents finished satisfying their edge,
/// parents not finished, and how many must satisfy it. The checker's own reading of the rule
/// (`crate::workflow`): an edge is satisfied by a Completed parent, or by any terminal one
/// through an `allow_failed` edge.
fn join_standing(flow: &Flow, step: usize, rows: &[&StoredTask]) -> (u32, u32, u32) {
    let (mut satisfied, mut unfinished) = (0, 0);
    for &(parent, policy) in &flow.parents[step] {
        let state = rows[parent].state;
        if !state.is_terminal() {
            unfinished += 1;
        } else if state == TaskState::Completed || policy == EdgePolicy::AllowFailed {
            satisfied += 1;
        }
    }
    let required = flow.joins[step].required(flow.parents[step].len() as u32);
    (satisfied, unfinished, required)
}

/// Whether the workflow's machine may count a step `core` whose row is in `row`: Waiting is
/// Waiting, a live row is Ready or Running, a terminal row is its own state.
fn core_agrees(core: StepState, row: TaskState) -> bool {
    match row {
        TaskState::Waiting => core == StepState::Waiting,
        TaskState::Pending | TaskState::Claimed | TaskState::Running => {
            matches!(core, StepState::Ready | StepState::Running)
        }
        TaskState::Completed => core == StepState::Completed,
        TaskState::Failed => core == StepState::Failed,
        TaskState::Cancelled => core == StepState::Cancelled,
        TaskState::Expired => core == StepState::Expired,
        TaskState::Skipped => core == StepState::Skipped,
    }
}

/// Checks workflow `id` against its steps' rows (see the module docs) and notes how each row
/// stands in `seen`.
fn check_flow(
    id: WorkflowId,
    flow: &mut Flow,
    seen: &mut BTreeMap<TaskId, StepSeen>,
    store: &MemoryStore,
) -> Result<(), String> {
    let state = store.workflow_state(id).ok_or_else(|| format!("workflow {id} vanished from the store"))?;
    let steps = flow.tasks.len();
    ensure!(state.len() == steps, "workflow {id} has {} steps in the store, {steps} submitted", state.len());
    let rows = flow
        .tasks
        .iter()
        .map(|&task| store.task(task).ok_or_else(|| format!("step task {task} of workflow {id} vanished")))
        .collect::<Result<Vec<&StoredTask>, String>>()?;
    let status = state.status();
    // Paused at the last check and still paused: nothing was promoted or skipped since (no
    // request of a worker resumes a workflow; only the operator does, checked on its own).
    let held = flow.last_status == Some(WorkflowStatus::Paused) && status == WorkflowStatus::Paused;
    // The rows as the workflow should count them.
    let mut tally: BTreeMap<StepState, u32> = BTreeMap::new();
    for (step, row) in rows.iter().enumerate() {
        let task = row.id;
        let was = seen.get(&task).copied().unwrap_or(StepSeen::new(id));
        let (satisfied, unfinished, required) = join_standing(flow, step, &rows);
        let standing = || {
            format!(
                "step {step} (task {task}) of workflow {id}, join {} over {} parents: {satisfied} satisfied, {unfinished} \
             unfinished, {required} required; parents {:?}",
                flow.joins[step],
                flow.parents[step].len(),
                flow.parents[step].iter().map(|&(p, policy)| (rows[p].id, rows[p].state, policy)).collect::<Vec<_>>()
            )
        };
        // Left Waiting (or, a retry, came back from a finish) for a live row or a run's end: its
        // join must be satisfied, and its workflow not cancelled.
        let from_rest = was.state == TaskState::Waiting || was.state.is_terminal();
        let promoted = match row.state {
            TaskState::Pending | TaskState::Claimed | TaskState::Running => from_rest,
            TaskState::Completed | TaskState::Failed => was.state == TaskState::Waiting,
            _ => false,
        };
        if (promoted || row.state == TaskState::Skipped) && was.state == TaskState::Waiting {
            ensure!(!held, "PROMOTED WHILE PAUSED: {} went {} -> {}", standing(), was.state, row.state);
        }
        if promoted {
            ensure!(
                !flow.cancelled,
                "PROMOTED AFTER CANCEL: {} went {} -> {} after the operator cancelled the workflow",
                standing(),
                was.state,
                row.state
            );
            ensure!(
                satisfied >= required,
                "STARTED BEFORE ITS JOIN: {} went {} -> {} (lease {}, attempts {})",
                standing(),
                was.state,
                row.state,
                row.lease,
                row.attempts
            );
        }
        if row.state == TaskState::Skipped && was.state != TaskState::Skipped {
            ensure!(
                !flow.cancelled && satisfied + unfinished < required,
                "SKIPPED WITH A SATISFIABLE JOIN: {} (workflow cancelled: {})",
                standing(),
                flow.cancelled
            );
            // Never claimed in any of its lives: no claim, no start, no run in its history.
            let never_claimed = was.waiting_lease == Lease(0);
            ensure!(
                row.attempts == was.waiting_attempts
                    && row.lease == was.waiting_lease
                    && row.claimed_by.is_none()
                    && row.claim_token.is_none()
                    && (!never_claimed || (row.started_at.is_none() && row.claimed_at.is_none())),
                "SKIPPED STEP RAN: {} is Skipped with attempts {} lease {} holder {:?} started {:?} (when it \
                 last waited: attempts {} lease {})",
                standing(),
                row.attempts,
                row.lease,
                row.claimed_by,
                row.started_at,
                was.waiting_attempts,
                was.waiting_lease
            );
            ensure!(
                !never_claimed || store.attempts(task).is_empty(),
                "SKIPPED STEP RAN: {} is Skipped with a run in its history",
                standing(),
            );
        }
        if row.state == TaskState::Waiting {
            ensure!(!flow.cancelled, "{} still waits after the operator cancelled the workflow", standing());
            // The harness's reading of the rule decides it: nothing may be left undecided in a
            // workflow that promotes (paused ones hold their decisions).
            ensure!(
                status != WorkflowStatus::Running || (satisfied < required && satisfied + unfinished >= required),
                "UNDECIDED: {} still waits in a running workflow",
                standing(),
            );
        }
        if flow.cancelled {
            ensure!(
                row.state.is_terminal(),
                "{} is {} after the operator cancelled the workflow",
                standing(),
                row.state
            );
        }
        let core = state.states()[step];
        ensure!(
            core_agrees(core, row.state),
            "WORKFLOW COUNTS: {}: the row is {}, the workflow counts it {core}",
            standing(),
            row.state
        );
        let counted = match row.state {
            TaskState::Waiting => StepState::Waiting,
            TaskState::Pending | TaskState::Claimed | TaskState::Running => StepState::Ready,
            TaskState::Completed => StepState::Completed,
            TaskState::Failed => StepState::Failed,
            TaskState::Cancelled => StepState::Cancelled,
            TaskState::Expired => StepState::Expired,
            TaskState::Skipped => StepState::Skipped,
        };
        *tally.entry(counted).or_insert(0) += 1;
        let next = match row.state {
            TaskState::Waiting => {
                StepSeen { flow: id, state: row.state, waiting_attempts: row.attempts, waiting_lease: row.lease }
            }
            _ => StepSeen { state: row.state, ..was },
        };
        seen.insert(task, next);
    }
    let counts = state.step_counts();
    let rows_say = |s: StepState| tally.get(&s).copied().unwrap_or(0);
    let agree = StepState::ALL.iter().all(|&s| match s {
        StepState::Ready => counts.ready + counts.running == rows_say(StepState::Ready),
        StepState::Running => true,
        s => counts.get(s) == rows_say(s),
    });
    ensure!(agree, "WORKFLOW COUNTS: workflow {id} counts {counts:?}, its rows say {tally:?}");
    let all_terminal = rows.iter().all(|row| row.state.is_terminal());
    let expected = if flow.cancelled {
        Some(WorkflowStatus::Cancelled)
    } else if all_terminal {
        let sinks_completed =
            rows.iter().zip(&flow.sinks).all(|(row, &sink)| !sink || row.state == TaskState::Completed);
        Some(if sinks_completed { WorkflowStatus::Completed } else { WorkflowStatus::Failed })
    } else {
        None
    };
    match expected {
        Some(expected) => ensure!(
            status == expected,
            "WORKFLOW STATUS: workflow {id} is {status}, its rows say {expected} (cancelled by the operator: {})",
            flow.cancelled
        ),
        None => ensure!(
            matches!(status, WorkflowStatus::Running | WorkflowStatus::Paused),
            "WORKFLOW STATUS: workflow {id} is {status} with steps unfinished and no cancel"
        ),
    }
    flow.settled = all_terminal && status.is_finished();
    flow.last_status = Some(status);
    Ok(())
}

/// Checks one live worker against the harness and the store: `handlers` are the tasks the
/// harness runs for it (spawned, not yet answered or aborted) with their leases.
pub(crate) fn check_worker(
    store: &MemoryStore,
    worker: &Worker,
    policy: &ClaimPolicy,
    handlers: &BTreeMap<TaskId, Lease>,
    rewound: &BTreeSet<TaskId>,
) -> Result<(), String> {
    let id = worker.id();
    let (running, claimed) = (worker.running(), worker.claimed());
    ensure!(
        running <= policy.concurrency as usize,
        "CAP: {id} runs {running} handlers, concurrency {}",
        policy.concurrency
    );
    // Its buffer varies with its rate of work, up to the prefetch buffer (soft-cap mode) or the
    // most it claims ahead (hard-cap mode).
    let most = ClaimPolicy {
        claim_ahead: if policy.hard_cap_mode() { crate::worker::HARD_CAP_CLAIM_AHEAD_MAX } else { 0 },
        ..policy.clone()
    };
    ensure!(
        running + claimed <= most.capacity() as usize,
        "CAP: {id} holds {running} running and {claimed} claimed, capacity {}",
        most.capacity()
    );
    ensure!(claimed <= most.max_claimed() as usize, "CAP: {id} holds {claimed} claims, max {}", most.max_claimed());
    // After a failover a task may run twice under one lease (the store handed the lease out
    // again): an aborted run's late answer then reads as the new run's. Those tasks aside.
    let believed: BTreeMap<TaskId, Lease> =
        worker.running_leases().filter(|t| !rewound.contains(&t.task)).map(|t| (t.task, t.lease)).collect();
    let handlers: BTreeMap<TaskId, Lease> =
        handlers.iter().filter(|(task, _)| !rewound.contains(task)).map(|(t, l)| (*t, *l)).collect();
    ensure!(
        believed == handlers,
        "{id} believes these handlers run {believed:?}, the harness runs {handlers:?} (spawn/abort contract)"
    );
    for (&task, &lease) in believed.iter().filter(|(task, _)| !rewound.contains(task)) {
        let Some(row) = store.task(task) else {
            return Err(format!("{id} runs task {task}, which the store does not have"));
        };
        ensure!(row.lease >= lease, "{id} runs task {task} under lease {lease}, newer than the row's {}", row.lease);
        // Claimed too: a handler started without a start request runs on its claim.
        if row.lease == lease && matches!(row.state, TaskState::Running | TaskState::Claimed) {
            ensure!(
                row.claimed_by.as_ref() == Some(id),
                "TWO LEASES: {id} runs task {task} under the row's current lease {lease}, the row is held by {:?}",
                row.claimed_by
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::budget::ClaimPolicy;
    use crate::config::WorkerConfig;
    use crate::store::{DbFailure, NewTask};
    use crate::workflow::EdgePolicy;

    fn epoch() -> DbTime {
        DbTime(super::super::DB_EPOCH_MS)
    }

    /// Applies `request` by `worker` at `now` with the checks around it, as the harness does.
    fn checked(
        checker: &mut Checker,
        store: &mut MemoryStore,
        worker: &WorkerId,
        request: &DbRequest,
        now: DbTime,
    ) -> Result<DbReply, String> {
        let before = checker.before(store, request, now);
        let reply = store.execute(request, now).map_err(|e: DbFailure| e.to_string())?;
        checker.after(store, worker, request, &before, &reply, now)?;
        checker.check_store(store, now, true)?;
        Ok(reply)
    }

    /// Seeds 4488 and 5041: a reap fails a crashed step, which promotes its child through an
    /// `allow_failed` edge, and its expiry (a statement of its own) then expires the child,
    /// past its good-until. The checker expected only the rows Pending before the reap to
    /// expire.
    #[test]
    fn a_reap_may_expire_the_steps_its_own_failures_promote() {
        let mut app = AppConfig::default();
        app.recovery.crash_retries = 0;
        let mut store = MemoryStore::new(app.clone());
        let mut checker = Checker::new(&app);
        let now = epoch();
        let mut workflow = NewWorkflow::new("recover");
        let root = workflow.step(NewTask::new("step", json!(0)), Join::All);
        let mut cleanup = NewTask::new("step", json!(1));
        cleanup.good_until = Some(now.plus_ms(1_000));
        let child = workflow.step(cleanup, Join::All);
        workflow.edge(root, child, EdgePolicy::AllowFailed);
        let submitted = store.submit_workflow(workflow.clone(), now).expect("a valid workflow");
        checker.submitted(submitted.workflow, &workflow, &submitted.tasks, 2).expect("recorded");
        checker.check_store(&store, now, true).expect("submitted as it should");
        let worker = WorkerId("w".into());
        let claim = DbRequest::Claim {
            worker: worker.clone(),
            token: 1,
            policy: Arc::new(ClaimPolicy::from_config(&app, &WorkerConfig::default())),
            my_running: 0,
            my_claimed: 0,
            start_now: 1,
            lease_ms: 60_000,
        };
        checked(&mut checker, &mut store, &worker, &claim, now).expect("the root is claimed and started");
        // The worker dies; long after, past the child's good-until, the reaper fails its run.
        let later = now.plus_ms(100_000);
        let reap = DbRequest::Reap {
            worker: WorkerId("reaper".into()),
            claimed_stale_ms: None,
            running_stale_ms: Some(1_000),
            entropy: 0,
        };
        let reply = checked(&mut checker, &mut store, &worker, &reap, later).expect("the reap passes the checks");
        let DbReply::Reaped(report) = reply else { panic!("a reap answered {reply:?}") };
        assert_eq!(report.failed, [submitted.tasks[0]]);
        assert_eq!(report.expired, [submitted.tasks[1]], "the store promotes the child, then expires it");
        assert_eq!(store.task(submitted.tasks[1]).map(|row| row.state), Some(TaskState::Expired));
    }
}
