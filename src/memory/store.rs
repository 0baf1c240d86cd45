//! The memory store's tables: live and finished tasks, the attempts history, keys, the worker
//! registry, liveness tokens, paused queues, schedule records, locked rows and notifications;
//! and the row moves every request is made of.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::budget::ClaimPolicy;
use crate::config::{AppConfig, RetryPolicy};
use crate::scheduler::ScheduleRecord;
use crate::store::{AttemptRecord, DbTime, Notification, TaskRecord, WorkerInfo, WorkerRecord, WorkflowId};
use crate::task::{Attempt, Lease, TaskError, TaskEvent, TaskId, TaskState, WorkerId, transition};
use crate::workflow::StepId;

use super::workflow::StoredWorkflow;

/// One task's full row, as the live or the finished table holds it.
///
/// Invariants the store keeps (and a simulation may check): `claim_expires_at` is set exactly
/// when the task is Claimed; `claimed_by` and `claim_token` are set while it is Claimed or
/// Running and cleared when it goes back to Pending (a finished row keeps its last holder);
/// `lease` and `attempts` never decrease; `result` is set only on Completed rows and
/// `finished_at` only on terminal ones.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredTask {
    /// The task.
    pub id: TaskId,
    /// Its handler name.
    pub name: String,
    /// Its queue.
    pub queue: String,
    /// Lower runs first within the queue.
    pub priority: i16,
    /// Its arguments.
    pub args: Value,
    /// Its state; terminal states live in the finished table.
    pub state: TaskState,
    /// The claim generation: 0 until the first claim, bumped by every claim.
    pub lease: Lease,
    /// The worker holding it (see the invariants above).
    pub claimed_by: Option<WorkerId>,
    /// The token of the claim request that took it.
    pub claim_token: Option<u64>,
    /// When it was last claimed.
    pub claimed_at: Option<DbTime>,
    /// When its claim lapses, while it is Claimed.
    pub claim_expires_at: Option<DbTime>,
    /// The holder's last heartbeat under the current claim or run.
    pub heartbeat_at: Option<DbTime>,
    /// When its latest run started.
    pub started_at: Option<DbTime>,
    /// Runs started; never decreases.
    pub attempts: u32,
    /// Retries spent.
    pub retries: u32,
    /// When it is (or was) claimable.
    pub run_at: DbTime,
    /// When it was enqueued.
    pub enqueued_at: DbTime,
    /// When it expires.
    pub good_until: Option<DbTime>,
    /// Its retry policy (the app's default resolved at enqueue).
    pub retry: RetryPolicy,
    /// Its key, while it holds one.
    pub key: Option<String>,
    /// Its flags, sorted.
    pub flags: Vec<String>,
    /// Its result, once Completed.
    pub result: Option<Value>,
    /// Its last error (see [`TaskRecord::error`]).
    pub error: Option<TaskError>,
    /// When it reached a terminal state.
    pub finished_at: Option<DbTime>,
}

impl StoredTask {
    /// The row as inspection shows it.
    pub fn record(&self) -> TaskRecord {
        let held = matches!(self.state, TaskState::Claimed | TaskState::Running);
        TaskRecord {
            id: self.id,
            name: self.name.clone(),
            queue: self.queue.clone(),
            state: self.state,
            priority: self.priority,
            args: if json_depth(&self.args) > READABLE_JSON_DEPTH { Value::Null } else { self.args.clone() },
            args_error: (json_depth(&self.args) > READABLE_JSON_DEPTH).then(|| "recursion limit exceeded".to_owned()),
            attempts: self.attempts,
            retries: self.retries,
            enqueued_at: self.enqueued_at,
            run_at: self.run_at,
            good_until: self.good_until,
            finished_at: self.finished_at,
            worker: if held { self.claimed_by.clone() } else { None },
            result: self.result.clone(),
            error: self.error.clone(),
            key: self.key.clone(),
            flags: self.flags.clone(),
        }
    }

    /// Whether a claim under `policy` takes (and sees) this row, if claimable: see
    /// [`ClaimPolicy::admits_row`].
    pub fn admitted_by(&self, policy: &ClaimPolicy) -> bool {
        policy.admits_row(&self.flags, self.priority, self.state == TaskState::Pending, self.run_at)
    }

    /// Whether a claim at `now` may take this row, its queue aside: Pending, or Claimed with
    /// a lapsed lease; `run_at` reached; good-until not reached.
    pub fn is_claimable(&self, now: DbTime) -> bool {
        let free = match self.state {
            TaskState::Pending => true,
            TaskState::Claimed => self.claim_expires_at.is_some_and(|at| at <= now),
            _ => false,
        };
        free && self.run_at <= now && self.good_until.is_none_or(|at| at > now)
    }

    /// Whether `worker` holds this row under `lease` (the state is the caller's to check).
    pub(super) fn held_by(&self, worker: &WorkerId, lease: Lease) -> bool {
        self.lease == lease && self.claimed_by.as_ref() == Some(worker)
    }

    /// Moves the row by `event`, which must be allowed.
    pub(super) fn apply_event(&mut self, event: TaskEvent) {
        match transition(self.state, event) {
            Ok(to) => self.state = to,
            Err(err) => panic!("memory store invariant broken on task {}: {err}", self.id),
        }
    }

    /// Forgets the holder: the row is no longer claimed by anyone.
    pub(super) fn clear_claim(&mut self) {
        self.claimed_by = None;
        self.claim_token = None;
        self.claim_expires_at = None;
        self.heartbeat_at = None;
    }

    /// Brings a finished row back to life by `event` (a requeue, a workflow's reset): no
    /// holder, no retry spent, no result or finish time; its attempts and last error stay.
    pub(super) fn reopen(&mut self, event: TaskEvent) {
        self.apply_event(event);
        self.clear_claim();
        self.retries = 0;
        self.result = None;
        self.finished_at = None;
    }
}

/// A worker's waiting mark: its queues, and while it works through a backlog the priority
/// only tasks more urgent than which it is told of (`None`: every task).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WaitingMark {
    pub(super) queues: BTreeSet<String>,
    pub(super) below: Option<i16>,
    /// The worker's own stale threshold: others delete the mark once the registry has not
    /// seen the worker for that long.
    pub(super) stale_after_ms: u64,
}

/// Which task a key names (the `task_keys` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyHold {
    pub(super) task: TaskId,
    /// When an idempotent enqueue took the key or first relied on it ([`KeyMode::Idempotent`]);
    /// `None` for a key taken in another mode. Purge keeps the finished task of such a key for
    /// `recovery.idempotency_retention_ms`.
    pub(super) idempotent_since: Option<DbTime>,
}

/// The in-memory store. See the module docs.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    pub(super) app: AppConfig,
    pub(super) next_id: i64,
    pub(super) live: BTreeMap<TaskId, StoredTask>,
    pub(super) finished: BTreeMap<TaskId, StoredTask>,
    pub(super) keys: BTreeMap<String, KeyHold>,
    pub(super) history: BTreeMap<TaskId, Vec<AttemptRecord>>,
    pub(super) workers: BTreeMap<WorkerId, WorkerRecord>,
    /// Each marked worker's mark (the `waiting_workers` table): see
    /// [`DbRequest::SetWaiting`](crate::store::DbRequest::SetWaiting).
    pub(super) waiting: BTreeMap<WorkerId, WaitingMark>,
    /// Paused queues and since when.
    pub(super) paused: BTreeMap<String, DbTime>,
    /// Schedule records by name (the `schedules` table).
    pub(super) schedules: BTreeMap<String, ScheduleRecord>,
    pub(super) notifications: Vec<Notification>,
    /// Rows another transaction holds locked (an application's, an operator's): see
    /// [`MemoryStore::lock_row`].
    pub(super) locked: BTreeSet<TaskId>,
    /// Workers' liveness tokens: see [`MemoryStore::take_token`].
    pub(super) tokens: Tokens,
    /// Workflows by id (the `workflows` table with its edges).
    pub(super) workflows: BTreeMap<WorkflowId, StoredWorkflow>,
    /// The workflow and step of each step's task.
    pub(super) steps: BTreeMap<TaskId, (WorkflowId, StepId)>,
    pub(super) next_workflow_id: i64,
    /// Steps' rows the statement under way moved to the finished table, with their states:
    /// their workflows learn of them when it ends ([`MemoryStore::settle_workflows`]), as
    /// PostgreSQL's statement trigger does.
    pub(super) finished_steps: Vec<(TaskId, TaskState)>,
    /// While a simulation applies the parts of one request as requests of their own
    /// ([`MemoryStore::hold_statement`]): the workflows settle when it ends.
    #[cfg(feature = "sim")]
    pub(super) statement_held: bool,
}

/// The liveness tokens: in PostgreSQL, a session advisory lock each worker holds on a
/// connection of its own, which the server releases when that session ends, and the
/// registry's record of it (`workers.token_epoch`, `workers.token_free_since`).
#[derive(Debug, Clone, Default)]
pub(super) struct Tokens {
    /// The server's incarnation (`pg_postmaster_start_time()`): a restart or failover starts
    /// a new one, and every session, with its locks, ends.
    pub(super) epoch: u64,
    /// Tokens a live session holds.
    pub(super) held: BTreeSet<WorkerId>,
    /// Per worker: the incarnation it took its token in, and since when a reaper has seen the
    /// token released.
    pub(super) recorded: BTreeMap<WorkerId, (u64, Option<DbTime>)>,
}

/// The error PostgreSQL gives a statement that waited on a row lock past `lock_timeout`.
pub const LOCK_TIMEOUT_MESSAGE: &str = "canceling statement due to lock timeout";

/// How long PostgreSQL lets a statement of Canter's sessions wait for a lock before it gives
/// up (their `lock_timeout`): what a request that meets a locked row costs before its
/// [`DbFailure::LockTimeout`](crate::store::DbFailure::LockTimeout) comes back. The store answers at once; a driver that models
/// time (the simulation) delays the answer by this much.
pub const LOCK_TIMEOUT_MS: u64 = 5_000;

/// How deep a stored JSON value may be nested for serde_json to read it back (its recursion
/// limit): a claim reply of a row nested deeper says so in [`ClaimedTask::args_error`](crate::store::ClaimedTask::args_error), as
/// PostgreSQL's store does when it fails to decode one.
pub const READABLE_JSON_DEPTH: usize = 127;

impl MemoryStore {
    /// An empty store for this application; task ids start at 1.
    pub fn new(app: AppConfig) -> Self {
        MemoryStore {
            app,
            next_id: 1,
            live: BTreeMap::new(),
            finished: BTreeMap::new(),
            keys: BTreeMap::new(),
            history: BTreeMap::new(),
            workers: BTreeMap::new(),
            waiting: BTreeMap::new(),
            paused: BTreeMap::new(),
            schedules: BTreeMap::new(),
            notifications: Vec::new(),
            locked: BTreeSet::new(),
            tokens: Tokens::default(),
            workflows: BTreeMap::new(),
            steps: BTreeMap::new(),
            next_workflow_id: 1,
            finished_steps: Vec::new(),
            #[cfg(feature = "sim")]
            statement_held: false,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Row locks of other transactions
    // -----------------------------------------------------------------------------------------

    /// Marks row `id` as locked by another transaction until [`unlock_row`](Self::unlock_row),
    /// as an application transaction or an operator's statement can hold it in PostgreSQL.
    /// Statements that skip locked rows (claims, starts, heartbeats, the reaper) pass it by; the
    /// others wait, which [`execute`](Self::execute) answers as PostgreSQL's `lock_timeout`
    /// does.
    #[cfg(feature = "sim")]
    pub fn lock_row(&mut self, id: TaskId) {
        self.locked.insert(id);
    }

    /// Ends the lock [`lock_row`](Self::lock_row) took.
    #[cfg(feature = "sim")]
    pub fn unlock_row(&mut self, id: TaskId) {
        self.locked.remove(&id);
    }

    /// The rows locked by other transactions.
    #[cfg(feature = "sim")]
    pub fn locked_rows(&self) -> &BTreeSet<TaskId> {
        &self.locked
    }

    // -----------------------------------------------------------------------------------------
    // Liveness tokens
    // -----------------------------------------------------------------------------------------

    /// `worker`'s session takes its liveness token, as a worker's driver does before it
    /// claims (and again after its token connection came back), and records it in the
    /// registry for this server incarnation; `false` (nothing recorded) when a live session
    /// holds it already.
    pub fn take_token(&mut self, worker: &WorkerId, now: DbTime) -> bool {
        if !self.tokens.held.insert(worker.clone()) {
            return false;
        }
        self.tokens.recorded.insert(worker.clone(), (self.tokens.epoch, None));
        // The registry row is created if the worker has none yet, as a heartbeat creates it.
        self.workers.entry(worker.clone()).or_insert_with(|| WorkerRecord {
            info: WorkerInfo { worker: worker.clone(), queues: Vec::new(), concurrency: 0 },
            last_seen: now,
            stopped: false,
        });
        true
    }

    /// `worker`'s token session ended (its process died, or its connection did): the server
    /// releases the token.
    #[cfg(feature = "sim")]
    pub fn release_token(&mut self, worker: &WorkerId) {
        self.tokens.held.remove(worker);
    }

    /// Whether a live session holds `worker`'s token.
    #[cfg(feature = "sim")]
    pub fn holds_token(&self, worker: &WorkerId) -> bool {
        self.tokens.held.contains(worker)
    }

    /// The server restarted (or another took over): every session ended, and tokens recorded
    /// before count for nothing until their workers take them again.
    #[cfg(feature = "sim")]
    pub fn restart_server(&mut self) {
        self.tokens.epoch += 1;
        self.tokens.held.clear();
    }

    // -----------------------------------------------------------------------------------------
    // Row moves
    // -----------------------------------------------------------------------------------------

    pub(super) fn pending_run_ats(&self) -> impl Iterator<Item = DbTime> + '_ {
        self.live.values().filter(|row| row.state == TaskState::Pending).map(|row| row.run_at)
    }

    pub(super) fn row(&self, id: TaskId) -> Option<&StoredTask> {
        self.live.get(&id).or_else(|| self.finished.get(&id))
    }

    /// A row of the live table the caller knows is there.
    pub(super) fn live_row(&mut self, id: TaskId) -> &mut StoredTask {
        self.live.get_mut(&id).unwrap_or_else(|| panic!("memory store invariant broken: task {id} is not live"))
    }

    pub(super) fn running_per_queue(&self) -> BTreeMap<String, u32> {
        let mut running = BTreeMap::new();
        for row in self.live.values() {
            if row.state == TaskState::Running {
                *running.entry(row.queue.clone()).or_insert(0) += 1;
            }
        }
        running
    }

    /// Whether some worker's mark of `queue` takes in a task of `priority`: a client's
    /// enqueue without keys notifies the queue only then (see
    /// [`DbRequest::SetWaiting`](crate::store::DbRequest::SetWaiting)).
    pub(crate) fn waited_on(&self, queue: &str, priority: i16) -> bool {
        self.waiting.values().any(|mark| mark.queues.contains(queue) && mark.below.is_none_or(|below| priority < below))
    }

    pub(super) fn notify_ready(&mut self, queues: impl IntoIterator<Item = String>) {
        for queue in queues {
            self.notifications.push(Notification::TaskReady { queue, priority: None, run_at: None });
        }
    }

    /// Appends the attempt record of the run a live row is finishing.
    pub(super) fn record_attempt(&mut self, id: TaskId, outcome: TaskState, error: Option<TaskError>, now: DbTime) {
        let row = self.live_row(id);
        let record = AttemptRecord {
            task: id,
            attempt: Attempt(row.attempts),
            worker: row.claimed_by.clone(),
            outcome,
            error,
            finished_at: now,
        };
        self.history.entry(id).or_default().push(record);
    }

    /// Moves a live row by a terminal `event` into the finished table and announces it.
    pub(super) fn finish_row(
        &mut self,
        id: TaskId,
        event: TaskEvent,
        now: DbTime,
        error: Option<TaskError>,
        result: Option<Value>,
    ) -> TaskState {
        let mut row =
            self.live.remove(&id).unwrap_or_else(|| panic!("memory store invariant broken: task {id} is not live"));
        row.apply_event(event);
        assert!(row.state.is_terminal(), "memory store invariant broken: {event:?} left task {id} in {}", row.state);
        row.claim_expires_at = None;
        row.error = error;
        row.result = result;
        row.finished_at = Some(now);
        let state = row.state;
        self.finished.insert(id, row);
        self.notifications.push(Notification::TaskFinished { task: id, state });
        // A step's children decide when the statement ends (`settle_workflows`).
        if self.steps.contains_key(&id) {
            self.finished_steps.push((id, state));
        }
        state
    }

    /// Fails a Running row for good, with its attempt record.
    pub(super) fn fail_run(&mut self, id: TaskId, error: TaskError, now: DbTime) -> TaskState {
        self.record_attempt(id, TaskState::Failed, Some(error.clone()), now);
        self.finish_row(id, TaskEvent::Fail, now, Some(error), None)
    }

    /// Puts a Running row back to Pending from `run_at`, spending a retry, with its attempt
    /// record.
    pub(super) fn retry_run(&mut self, id: TaskId, error: TaskError, run_at: DbTime, now: DbTime) -> TaskState {
        self.record_attempt(id, TaskState::Pending, Some(error.clone()), now);
        let row = self.live_row(id);
        row.apply_event(TaskEvent::Retry);
        row.clear_claim();
        row.retries = row.retries.saturating_add(1);
        row.run_at = run_at;
        row.error = Some(error);
        row.state
    }

    /// Hands a Claimed or Running row back to Pending without spending a retry; returns its
    /// queue.
    pub(super) fn release_row(&mut self, id: TaskId) -> String {
        let row = self.live_row(id);
        row.apply_event(TaskEvent::Release);
        row.clear_claim();
        row.queue.clone()
    }
}

/// How deeply `value` nests arrays and objects (a scalar is 0).
pub fn json_depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        match value {
            Value::Array(items) => stack.extend(items.iter().map(|item| (item, depth + 1))),
            Value::Object(fields) => stack.extend(fields.values().map(|item| (item, depth + 1))),
            _ => {}
        }
    }
    deepest
}

/// `now` minus `ms` milliseconds (saturating).
pub(super) fn minus_ms(now: DbTime, ms: u64) -> DbTime {
    DbTime(now.0.saturating_sub(i64::try_from(ms).unwrap_or(i64::MAX)))
}
