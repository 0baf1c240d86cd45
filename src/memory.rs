//! An in-memory store: the database of the [protocol](crate::db) without PostgreSQL.
//!
//! [`MemoryStore`] applies the worker machine's [`DbRequest`]s with exactly the semantics the
//! SQL has, so the core's tests, the deterministic simulation and users' unit tests can run
//! the whole system with no database. Like the SQL schema it keeps two tables: the live table
//! (Pending, Claimed and Running tasks, the only ones a claim scans) and the finished table
//! (terminal tasks with their result or error); a terminal transition moves the row. It also
//! keeps the attempts history (one record per finished run), the task keys, the worker
//! registry, paused queues, schedule records and the notifications PostgreSQL would send.
//!
//! Every request applies atomically: [`MemoryStore::apply`] takes `&mut self`, so no two
//! requests interleave. That is what `FOR UPDATE SKIP LOCKED` achieves across workers in
//! PostgreSQL (no row is handed to two claimers, and a claimer never waits for a row another
//! holds), and the advisory locks around capped claims (the counts a claim sees are the counts
//! it acts on). A claim here never meets a locked row, so it sees every eligible row: the
//! PostgreSQL store may claim fewer under contention, never more.
//!
//! The store is pure like the rest of the core: `now` is always an argument, and the only
//! randomness is the `entropy` a [`DbRequest::Reap`] carries. Every state change goes through
//! [`transition`]; a refused one is a broken invariant of this module and panics. Bad input
//! (unknown ids, stale leases, other workers' tasks) never panics: it is reported `lost` or
//! returned as an error.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::backoff;
use crate::budget::{self, ClaimCounts, ClaimPolicy, InFlight};
use crate::config::{AppConfig, RetryPolicy, is_valid_queue_name};
use crate::db::{
    self, AttemptRecord, ClaimedTask, Completion, DbFailure, DbReply, DbRequest, DbTime, EnqueueError, FinishOutcome,
    KeyMode, NewTask, ReapReport, RunAt, TaskRecord, WorkerInfo,
};
use crate::rng::mix;
use crate::schedule::{ScheduleRecord, ScheduleWrite};
use crate::task::{
    Attempt, ErrorCode, Lease, TaskError, TaskEvent, TaskId, TaskLease, TaskState, WorkerId, transition,
};

/// The message of the error a task gets when the reaper finds its worker gone.
pub const WORKER_CRASHED_MESSAGE: &str = "worker stopped sending heartbeats";

/// The message of the error a task gets when its good-until time passes before it runs.
pub const TASK_EXPIRED_MESSAGE: &str = "good_until passed before the task ran";

/// The message of the error a task gets when it is cancelled.
pub const TASK_CANCELLED_MESSAGE: &str = "task cancelled";

/// The message of a task failed by hand when the operator gives none.
pub const FAILED_BY_OPERATOR_MESSAGE: &str = "failed by an operator";

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
    fn held_by(&self, worker: &WorkerId, lease: Lease) -> bool {
        self.lease == lease && self.claimed_by.as_ref() == Some(worker)
    }

    /// Moves the row by `event`, which must be allowed.
    fn apply_event(&mut self, event: TaskEvent) {
        match transition(self.state, event) {
            Ok(to) => self.state = to,
            Err(err) => panic!("memory store invariant broken on task {}: {err}", self.id),
        }
    }

    /// Forgets the holder: the row is no longer claimed by anyone.
    fn clear_claim(&mut self) {
        self.claimed_by = None;
        self.claim_token = None;
        self.claim_expires_at = None;
        self.heartbeat_at = None;
    }
}

/// What a cancel found: a task that never ran, or one a worker had claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// It was Pending: it never ran and never will.
    Pending,
    /// It was Claimed by `worker`, which may already run it: in soft-cap mode a buffered
    /// task of a queue without a cap starts without telling the store. Such a run goes on to
    /// its end, and its outcome is not recorded (its writes are fenced); its side effects
    /// happen all the same.
    Claimed {
        /// The worker that held the claim.
        worker: WorkerId,
    },
}

impl Cancelled {
    /// What a cancel of a row in `state`, held by `holder`, found.
    pub fn of(state: TaskState, holder: Option<WorkerId>) -> Cancelled {
        match (state, holder) {
            (TaskState::Claimed, Some(worker)) => Cancelled::Claimed { worker },
            _ => Cancelled::Pending,
        }
    }
}

/// Something PostgreSQL would announce with `NOTIFY`, for drivers to deliver.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Notification {
    /// Tasks of this queue may have become claimable (one per statement per queue).
    TaskReady {
        /// The queue.
        queue: String,
        /// For tasks enqueued (or updated by a key), the most urgent priority among them: a
        /// worker whose buffer holds less urgent tasks claims it at once. `None` for tasks that
        /// became claimable otherwise (released, retried, rescheduled, resumed).
        priority: Option<i16>,
    },
    /// A task reached a terminal state.
    TaskFinished {
        /// The task.
        task: TaskId,
        /// Its terminal state.
        state: TaskState,
    },
}

/// Why an operator action was refused. Nothing is changed when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// No task has this id.
    #[error("task {0} not found")]
    NotFound(TaskId),
    /// The task is in a state the action does not apply to.
    #[error("task {task} is {state}: expected {expected}")]
    WrongState {
        /// The task.
        task: TaskId,
        /// The state it is in.
        state: TaskState,
        /// The states the action applies to.
        expected: &'static str,
    },
    /// No task holds this idempotency key.
    #[error("no task holds idempotency key {0:?}")]
    KeyNotFound(String),
    /// A reschedule would make the task claimable only after it expires.
    #[error("task {task}: run_at {run_at} ms is not before its good_until {good_until} ms: it could never run")]
    RunAtAfterGoodUntil {
        /// The task.
        task: TaskId,
        /// When it would become claimable.
        run_at: i64,
        /// When it expires.
        good_until: i64,
    },
    /// The queue name has characters or a length queues cannot have.
    #[error("invalid queue name {0:?}: expected 1 to 52 bytes of a-z, 0-9 and _")]
    InvalidQueueName(String),
}

/// What [`MemoryStore::reschedule`] changes on a Pending task; `None` fields are kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reschedule {
    /// When it becomes claimable, resolved on the store's clock as at enqueue (a past time
    /// means at once).
    pub run_at: Option<RunAt>,
    /// Its new priority (lower runs first).
    pub priority: Option<i16>,
    /// Its retries spent, e.g. 0 for a fresh retry budget (at most `i32::MAX`). Attempts are
    /// never reset: they count runs started.
    pub retries: Option<u32>,
}

/// What [`MemoryStore::remove_key`] did with the task holding the key; in every case the key
/// is free for a new task and the task no longer shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", content = "task", rename_all = "snake_case")]
pub enum KeyRemoval {
    /// The task was Pending: it is Cancelled.
    Cancelled(TaskId),
    /// The task is Claimed or Running: it runs on without the key.
    Detached(TaskId),
    /// The task had finished.
    Freed(TaskId),
}

impl KeyRemoval {
    /// The task that held the key.
    pub fn task(self) -> TaskId {
        match self {
            KeyRemoval::Cancelled(id) | KeyRemoval::Detached(id) | KeyRemoval::Freed(id) => id,
        }
    }
}

/// A paused queue: no claim takes its Pending tasks until it is resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedQueue {
    /// The queue.
    pub queue: String,
    /// Since when (the first pause, if it was paused again).
    pub paused_at: DbTime,
}

/// Which tasks [`MemoryStore::list`] returns; every field `None` lists them all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskFilter {
    /// Only tasks of this queue.
    pub queue: Option<String>,
    /// Only tasks in this state.
    pub state: Option<TaskState>,
    /// At most this many (the lowest ids).
    pub limit: Option<usize>,
}

/// A worker as the registry knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// What it registered (empty queues and concurrency 0 if it only ever sent heartbeats).
    pub info: WorkerInfo,
    /// Its last registration or heartbeat.
    pub last_seen: DbTime,
    /// Whether it deregistered (and did not register again since).
    pub stopped: bool,
}

/// Which task a key names (the `task_keys` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyHold {
    task: TaskId,
    /// When an idempotent enqueue took the key or first relied on it ([`KeyMode::Idempotent`]);
    /// `None` for a key taken in another mode. Purge keeps the finished task of such a key for
    /// `recovery.idempotency_retention_ms`.
    idempotent_since: Option<DbTime>,
}

/// The in-memory store. See the module docs.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    app: AppConfig,
    next_id: i64,
    live: BTreeMap<TaskId, StoredTask>,
    finished: BTreeMap<TaskId, StoredTask>,
    keys: BTreeMap<String, KeyHold>,
    history: BTreeMap<TaskId, Vec<AttemptRecord>>,
    workers: BTreeMap<WorkerId, WorkerRecord>,
    /// Paused queues and since when.
    paused: BTreeMap<String, DbTime>,
    /// Schedule records by name (the `schedules` table).
    schedules: BTreeMap<String, ScheduleRecord>,
    notifications: Vec<Notification>,
    /// Rows another transaction holds locked (an application's, an operator's): see
    /// [`MemoryStore::lock_row`].
    locked: BTreeSet<TaskId>,
    /// Workers' liveness tokens: see [`MemoryStore::take_token`].
    tokens: Tokens,
}

/// The liveness tokens: in PostgreSQL, a session advisory lock each worker holds on a
/// connection of its own, which the server releases when that session ends, and the
/// registry's record of it (`workers.token_epoch`, `workers.token_free_since`).
#[derive(Debug, Clone, Default)]
struct Tokens {
    /// The server's incarnation (`pg_postmaster_start_time()`): a restart or failover starts
    /// a new one, and every session, with its locks, ends.
    epoch: u64,
    /// Tokens a live session holds.
    held: BTreeSet<WorkerId>,
    /// Per worker: the incarnation it took its token in, and since when a reaper has seen the
    /// token released.
    recorded: BTreeMap<WorkerId, (u64, Option<DbTime>)>,
}

/// The error PostgreSQL gives a statement that waited on a row lock past `lock_timeout`.
pub const LOCK_TIMEOUT_MESSAGE: &str = "canceling statement due to lock timeout";

/// How long PostgreSQL lets a statement of Canter's sessions wait for a lock before it gives
/// up (their `lock_timeout`): what a request that meets a locked row costs before its
/// [`DbFailure::LockTimeout`] comes back. The store answers at once; a driver that models
/// time (the simulation) delays the answer by this much.
pub const LOCK_TIMEOUT_MS: u64 = 5_000;

/// How deep a stored JSON value may be nested for serde_json to read it back (its recursion
/// limit): a claim reply of a row nested deeper says so in [`ClaimedTask::args_error`], as
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
            paused: BTreeMap::new(),
            schedules: BTreeMap::new(),
            notifications: Vec::new(),
            locked: BTreeSet::new(),
            tokens: Tokens::default(),
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
    pub fn lock_row(&mut self, id: TaskId) {
        self.locked.insert(id);
    }

    /// Ends the lock [`lock_row`](Self::lock_row) took.
    pub fn unlock_row(&mut self, id: TaskId) {
        self.locked.remove(&id);
    }

    /// The rows locked by other transactions.
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
    pub fn release_token(&mut self, worker: &WorkerId) {
        self.tokens.held.remove(worker);
    }

    /// Whether a live session holds `worker`'s token.
    pub fn holds_token(&self, worker: &WorkerId) -> bool {
        self.tokens.held.contains(worker)
    }

    /// The server restarted (or another took over): every session ended, and tokens recorded
    /// before count for nothing until their workers take them again.
    pub fn restart_server(&mut self) {
        self.tokens.epoch += 1;
        self.tokens.held.clear();
    }

    // -----------------------------------------------------------------------------------------
    // Schedules
    // -----------------------------------------------------------------------------------------

    /// Each recorded schedule's last tick, as [`Scheduler::plan`](crate::schedule::Scheduler::plan)
    /// reads them.
    pub fn schedule_ticks(&self) -> BTreeMap<String, DbTime> {
        self.schedules.iter().map(|(name, record)| (name.clone(), record.last_tick)).collect()
    }

    /// The record of schedule `name`, if it has one.
    pub fn schedule_record(&self, name: &str) -> Option<&ScheduleRecord> {
        self.schedules.get(name)
    }

    /// Applies one write of a scheduler's plan as PostgreSQL does, atomically: a new schedule's
    /// record is inserted only if it has none; an existing one advances only if it still holds
    /// the tick the plan read (compare-and-set), and then its tasks are enqueued with it.
    /// Returns the new tasks' ids, or `None` when another scheduler got there first (nothing
    /// is written). A refused enqueue writes nothing either.
    pub fn apply_schedule_write(
        &mut self,
        write: &ScheduleWrite,
        now: DbTime,
    ) -> Result<Option<Vec<TaskId>>, EnqueueError> {
        let current = self.schedules.get(&write.name).map(|record| record.last_tick);
        if current != write.read {
            return Ok(None);
        }
        let ids = if write.tasks.is_empty() { Vec::new() } else { self.enqueue_many(write.tasks.clone(), now)? };
        let record = self.schedules.entry(write.name.clone()).or_insert_with(|| ScheduleRecord {
            name: write.name.clone(),
            last_tick: write.advance_to,
            next_tick: None,
            last_task_id: None,
            run_count: 0,
            updated_at: now,
        });
        record.last_tick = write.advance_to;
        record.next_tick = write.next_tick;
        record.run_count += ids.len() as u64;
        record.last_task_id = ids.last().copied().or(record.last_task_id);
        record.updated_at = now;
        Ok(Some(ids))
    }

    /// The application configuration enqueues are checked against.
    pub fn app(&self) -> &AppConfig {
        &self.app
    }

    // -----------------------------------------------------------------------------------------
    // Enqueue
    // -----------------------------------------------------------------------------------------

    /// Enqueues one task (see [`enqueue_many`](Self::enqueue_many)).
    pub fn enqueue(&mut self, task: NewTask, now: DbTime) -> Result<TaskId, EnqueueError> {
        let ids = self.enqueue_many(vec![task], now)?;
        Ok(ids.into_iter().next().expect("one id per task enqueued"))
    }

    /// Enqueues tasks as one statement: every task is checked ([`db::check_new_task`], one
    /// mode per key: [`db::BatchKeyModes`]) before any is written, and on an error nothing is
    /// written. Then the tasks apply in order, as if enqueued one by one. Returns one id per
    /// task, in order.
    ///
    /// A keyed task follows its [`KeyMode`]: in `Idempotent` mode a key that names a task
    /// (live or finished, or an earlier task of the batch) with the same name and arguments
    /// gives that task's id and writes nothing, with another name or other arguments it is
    /// [`EnqueueError::PayloadMismatch`]; the graphile modes update a Pending holder in place,
    /// detach the key from a Claimed or Running one, or keep a live one (`UnsafeDedupe`).
    /// New tasks get ids 1, 2, 3… in order, and each queue that received a new or updated
    /// task gets one [`Notification::TaskReady`] (whatever the tasks' `run_at`).
    pub fn enqueue_many(&mut self, tasks: Vec<NewTask>, now: DbTime) -> Result<Vec<TaskId>, EnqueueError> {
        let mut queues = Vec::with_capacity(tasks.len());
        let mut batch_keys = db::BatchKeys::default();
        // The first task with a problem is refused; within a task, in PostgreSQL's order: what
        // needs no clock nor stored rows (the client's checks, with the earliest `now`), then
        // times and stored keys (the database's), so both stores report the same problem.
        for (index, task) in tasks.iter().enumerate() {
            queues.push(db::check_new_task(&self.app, task, DbTime(i64::MIN))?.to_owned());
            batch_keys.check(index, task)?;
            db::check_new_task(&self.app, task, now)?;
            if let (Some(key), KeyMode::Idempotent) = (&task.key, task.key_mode) {
                if let Some(holder) = self.keys.get(key).and_then(|hold| self.row(hold.task)) {
                    if holder.name != task.name || holder.args != task.args {
                        return Err(EnqueueError::PayloadMismatch { key: key.clone(), existing: holder.id });
                    }
                }
            }
        }

        let mut ids = Vec::with_capacity(tasks.len());
        // Per queue that received a new or updated task, the most urgent priority.
        let mut ready: BTreeMap<String, i16> = BTreeMap::new();
        for (task, queue) in tasks.into_iter().zip(queues) {
            let priority = task.priority;
            let holder = task.key.as_ref().and_then(|key| self.keys.get_mut(key)).map(|hold| {
                // An idempotent enqueue relies on the key from now on, whatever mode took it.
                if task.key_mode == KeyMode::Idempotent {
                    hold.idempotent_since.get_or_insert(now);
                }
                hold.task
            });
            let live_holder = holder.and_then(|id| self.live.get(&id).map(|row| (id, row.state)));
            let id = match (task.key_mode, holder, live_holder) {
                _ if task.key.is_none() => self.insert_new(task, queue.clone(), now),
                (KeyMode::Idempotent, Some(id), _) | (KeyMode::UnsafeDedupe, _, Some((id, _))) => {
                    ids.push(id);
                    continue;
                }
                (KeyMode::Replace | KeyMode::PreserveRunAt, _, Some((id, TaskState::Pending))) => {
                    self.replace_pending(id, task, queue.clone(), now);
                    id
                }
                (_, holder, _) => {
                    // A Claimed or Running holder runs on without its key; a finished one
                    // gives it up.
                    if let Some(row) =
                        holder.and_then(|id| self.live.get_mut(&id).or_else(|| self.finished.get_mut(&id)))
                    {
                        row.key = None;
                    }
                    self.insert_new(task, queue.clone(), now)
                }
            };
            let most_urgent = ready.entry(queue).or_insert(priority);
            *most_urgent = (*most_urgent).min(priority);
            ids.push(id);
        }
        for (queue, priority) in ready {
            self.notifications.push(Notification::TaskReady { queue, priority: Some(priority) });
        }
        Ok(ids)
    }

    /// Writes `task` as another producer writing its row by hand would: none of
    /// [`db::check_new_task`]'s checks, so its arguments may be anything a database holds
    /// (nested deeper than a reader decodes, say). For tests and the simulation of rows no
    /// worker can read; its queue, if any, is taken as it is.
    pub fn enqueue_unchecked(&mut self, task: NewTask, now: DbTime) -> TaskId {
        let queue = task.queue.clone().unwrap_or_else(|| db::default_queue(&self.app).to_owned());
        let id = self.insert_new(task, queue.clone(), now);
        self.notify_ready([queue]);
        id
    }

    /// Writes `task` as a new Pending row (taking its key, if it has one) and returns its id.
    fn insert_new(&mut self, task: NewTask, queue: String, now: DbTime) -> TaskId {
        let id = TaskId(self.next_id);
        self.next_id = self.next_id.saturating_add(1);
        if let Some(key) = &task.key {
            let idempotent_since = (task.key_mode == KeyMode::Idempotent).then_some(now);
            self.keys.insert(key.clone(), KeyHold { task: id, idempotent_since });
        }
        self.live.insert(
            id,
            StoredTask {
                id,
                name: task.name,
                queue,
                priority: task.priority,
                args: task.args,
                state: TaskState::Pending,
                lease: Lease(0),
                claimed_by: None,
                claim_token: None,
                claimed_at: None,
                claim_expires_at: None,
                heartbeat_at: None,
                started_at: None,
                attempts: 0,
                retries: 0,
                run_at: db::resolve_run_at(task.run_at, now),
                enqueued_at: now,
                good_until: task.good_until,
                retry: task.retry.unwrap_or_else(|| self.app.retry.clone()),
                key: task.key,
                flags: db::normalized_flags(&task.flags),
                result: None,
                error: None,
                finished_at: None,
            },
        );
        id
    }

    /// Updates the Pending task `id` in place from `task` ([`KeyMode::Replace`] and
    /// [`KeyMode::PreserveRunAt`]).
    fn replace_pending(&mut self, id: TaskId, task: NewTask, queue: String, now: DbTime) {
        let default_retry = self.app.retry.clone();
        let row = self.live.get_mut(&id).expect("the holder is live");
        debug_assert_eq!(row.state, TaskState::Pending);
        if !(task.key_mode == KeyMode::PreserveRunAt && row.attempts == 0) {
            row.run_at = db::resolve_run_at(task.run_at, now);
        }
        row.args = match (&mut row.args, task.args) {
            (Value::Array(old), Value::Array(new)) => {
                old.extend(new);
                Value::Array(std::mem::take(old))
            }
            (_, new) => new,
        };
        row.name = task.name;
        row.queue = queue;
        row.priority = task.priority;
        row.good_until = task.good_until;
        row.retry = task.retry.unwrap_or(default_retry);
        row.flags = db::normalized_flags(&task.flags);
        row.retries = 0;
        row.error = None;
    }

    // -----------------------------------------------------------------------------------------
    // The protocol
    // -----------------------------------------------------------------------------------------

    /// Runs one request as PostgreSQL would answer it: a value PostgreSQL refuses (text with
    /// U+0000, a value over its size limit) fails the whole request with
    /// [`DbFailure::Invalid`], and a request that would wait on a row another transaction
    /// locked ([`lock_row`](Self::lock_row)) fails with [`DbFailure::LockTimeout`] as
    /// `lock_timeout` makes it; nothing is applied then. Otherwise as [`apply`](Self::apply).
    pub fn execute(&mut self, request: &DbRequest, now: DbTime) -> Result<DbReply, DbFailure> {
        if let DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. } = request {
            for completion in completions {
                refused_values(completion).map_err(|e| DbFailure::Invalid(e.to_string()))?;
            }
        }
        if self.waits_on_a_lock(request) {
            return Err(DbFailure::LockTimeout(LOCK_TIMEOUT_MESSAGE.into()));
        }
        Ok(self.apply(request, now))
    }

    /// Whether `request` would wait on a row another transaction locked: those that lock the
    /// rows they name without `SKIP LOCKED`.
    fn waits_on_a_lock(&self, request: &DbRequest) -> bool {
        if self.locked.is_empty() {
            return false;
        }
        // PostgreSQL locks only the rows its conditions select: the worker's own in-flight rows.
        let held_locked = |worker: &WorkerId, id: TaskId| {
            self.locked.contains(&id)
                && self
                    .live
                    .get(&id)
                    .is_some_and(|row| row.state != TaskState::Pending && row.claimed_by.as_ref() == Some(worker))
        };
        match request {
            DbRequest::RecordStarts { worker, tasks } | DbRequest::Release { worker, tasks } => {
                tasks.iter().any(|t| held_locked(worker, t.task))
            }
            DbRequest::Finish { worker, completions } | DbRequest::FinishAndClaim { worker, completions, .. } => {
                completions.iter().any(|c| held_locked(worker, c.task.task))
            }
            DbRequest::AbandonClaim { worker, token } => self.live.values().any(|row| {
                self.locked.contains(&row.id)
                    && row.claimed_by.as_ref() == Some(worker)
                    && row.claim_token == Some(*token)
            }),
            // A start skips the rows another transaction holds and defers them.
            DbRequest::Claim { .. }
            | DbRequest::Start { .. }
            | DbRequest::Heartbeat { .. }
            | DbRequest::Reap { .. }
            | DbRequest::ReapDead { .. }
            | DbRequest::Purge { .. }
            | DbRequest::Vacuum { .. }
            | DbRequest::RegisterWorker(_)
            | DbRequest::DeregisterWorker(_) => false,
        }
    }

    /// Applies one request of the worker machine atomically at database time `now`, with the
    /// semantics [`DbRequest`] documents, and returns its reply. Values are taken as they
    /// come and row locks of other transactions only skip rows: see
    /// [`execute`](Self::execute) for PostgreSQL's refusals.
    pub fn apply(&mut self, request: &DbRequest, now: DbTime) -> DbReply {
        let before = self.notifications.len();
        let reply = self.apply_request(request, now);
        // PostgreSQL delivers identical notifications of one transaction once (a reap that
        // requeues claims and retries runs of one queue announces it once).
        let mut seen = BTreeSet::new();
        let mut index = 0;
        self.notifications.retain(|note| {
            index += 1;
            index <= before || seen.insert(note.clone())
        });
        reply
    }

    fn apply_request(&mut self, request: &DbRequest, now: DbTime) -> DbReply {
        match request {
            DbRequest::Claim { worker, token, policy, my_running, my_claimed, start_now, lease_ms } => {
                let policy = &self.without_paused(policy);
                let counts = self.claim_counts(policy, *my_running, *my_claimed, now);
                let (tasks, more) = self.claim(worker, *token, policy, &counts, *start_now, *lease_ms, now);
                // Only a worker that will wait needs to know when delayed work becomes due.
                let next_run_in_ms = if more {
                    None
                } else {
                    self.live
                        .values()
                        // Delayed tasks only, as PostgreSQL's index of them (a task due when
                        // enqueued is not one, whatever the clock did since).
                        .filter(|row| row.state == TaskState::Pending && row.run_at > now)
                        .filter(|row| row.run_at > row.enqueued_at)
                        .filter(|row| policy.queues.iter().any(|q| q.name == row.queue))
                        .map(|row| row.run_at.0.abs_diff(now.0))
                        .min()
                };
                DbReply::Claimed { tasks, more, next_run_in_ms }
            }
            DbRequest::Start { worker, tasks, policy } => self.start(worker, tasks, policy, now),
            DbRequest::RecordStarts { worker, tasks } => self.record_starts(worker, tasks, now),
            DbRequest::Finish { worker, completions } => self.finish(worker, completions, now),
            DbRequest::FinishAndClaim { .. } => {
                // One statement: the claim sees what the finish did.
                let (finish, claim) = request.finish_then_claim().expect("a FinishAndClaim");
                let finished = self.apply_request(&finish, now);
                let claimed = self.apply_request(&claim, now);
                DbReply::finished_and_claimed(finished, claimed).expect("a finish and a claim answer as such")
            }
            DbRequest::Heartbeat { worker, claimed, running, lease_ms, max_renew_age_ms, abandoned } => {
                self.heartbeat(worker, claimed, running, *lease_ms, *max_renew_age_ms, abandoned, now)
            }
            DbRequest::Release { worker, tasks } => self.release(worker, tasks),
            DbRequest::AbandonClaim { worker, token } => {
                let released = self.abandon_claims(worker, &[*token], &BTreeSet::new());
                DbReply::Released { released, lost: Vec::new() }
            }
            DbRequest::Reap { worker: _, claimed_stale_ms, running_stale_ms, entropy } => {
                DbReply::Reaped(self.reap(*claimed_stale_ms, *running_stale_ms, *entropy, now))
            }
            DbRequest::ReapDead { worker: _, grace_ms, entropy } => {
                DbReply::Reaped(self.reap_dead(*grace_ms, *entropy, now))
            }
            // Nothing here leaves dead rows behind.
            DbRequest::Vacuum { .. } => DbReply::Vacuumed { tables: Vec::new() },
            DbRequest::Purge { older_than_ms, batch: _ } => {
                DbReply::Purged { tasks: self.purge_finished(*older_than_ms, now) }
            }
            DbRequest::RegisterWorker(info) => {
                self.workers
                    .insert(info.worker.clone(), WorkerRecord { info: info.clone(), last_seen: now, stopped: false });
                DbReply::Done
            }
            DbRequest::DeregisterWorker(worker) => {
                if let Some(record) = self.workers.get_mut(worker) {
                    record.stopped = true;
                }
                DbReply::Done
            }
        }
    }

    /// Ends a Running row whose worker crashed (or went silent) with `WORKER_CRASHED`: retried
    /// as [`backoff::crash_retry_delay`] says if that is before good-until, else failed.
    fn crash_run(
        &mut self,
        id: TaskId,
        entropy: u64,
        now: DbTime,
        report: &mut ReapReport,
        ready: &mut BTreeSet<String>,
    ) {
        let crash_retries = self.app.recovery.crash_retries;
        let row = self.live_row(id);
        let delay = backoff::crash_retry_delay(&row.retry, row.retries, crash_retries, mix(entropy ^ id.0 as u64));
        let run_at = delay.map(|delay| now.plus_ms(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)));
        let error = TaskError::new(ErrorCode::WorkerCrashed, WORKER_CRASHED_MESSAGE);
        match run_at.filter(|&run_at| row.good_until.is_none_or(|at| run_at < at)) {
            Some(run_at) => {
                ready.insert(row.queue.clone());
                self.retry_run(id, error, run_at, now);
                report.retried.push(id);
            }
            None => {
                self.fail_run(id, error, now);
                report.failed.push(id);
            }
        }
    }

    /// [`DbRequest::ReapDead`]: the workers whose token was recorded in this incarnation and
    /// has been released for `grace_ms`, and their tasks (rows other transactions hold are
    /// skipped, as the reaper skips them).
    fn reap_dead(&mut self, grace_ms: u64, entropy: u64, now: DbTime) -> ReapReport {
        let mut report = ReapReport::default();
        let epoch = self.tokens.epoch;
        let mut dead = Vec::new();
        for (worker, (taken_in, free_since)) in &mut self.tokens.recorded {
            if *taken_in != epoch || self.tokens.held.contains(worker) {
                continue;
            }
            let since = *free_since.get_or_insert(now);
            if minus_ms(now, grace_ms) >= since {
                dead.push(worker.clone());
            }
        }
        let mut ready = BTreeSet::new();
        for worker in &dead {
            self.tokens.recorded.remove(worker);
            let held = |state: TaskState| -> Vec<TaskId> {
                self.live
                    .values()
                    .filter(|row| {
                        row.state == state && row.claimed_by.as_ref() == Some(worker) && !self.locked.contains(&row.id)
                    })
                    .map(|row| row.id)
                    .collect()
            };
            let (claimed, running) = (held(TaskState::Claimed), held(TaskState::Running));
            ready.extend(claimed.iter().map(|&id| self.release_row(id)));
            report.requeued.extend(claimed);
            for id in running {
                self.crash_run(id, entropy, now, &mut report, &mut ready);
            }
        }
        report.requeued.sort_unstable();
        report.retried.sort_unstable();
        report.failed.sort_unstable();
        self.notify_ready(ready);
        report.dead_workers = dead;
        report
    }

    /// The counts a claim pass by a worker with `policy` observes at `now`: the cluster's and
    /// each served queue's in flight (Running, and Claimed with a live lease), and each served
    /// queue's eligible rows. `queues` and `available` have an entry for every queue of
    /// `policy`, zeros included, and for no other queue.
    pub fn claim_counts(&self, policy: &ClaimPolicy, my_running: u32, my_claimed: u32, now: DbTime) -> ClaimCounts {
        let mut counts = ClaimCounts { my_running, my_claimed, ..ClaimCounts::default() };
        for queue in &policy.queues {
            counts.queues.insert(queue.name.clone(), InFlight::default());
            counts.available.insert(queue.name.clone(), 0);
        }
        for row in self.live.values() {
            let in_flight = match row.state {
                TaskState::Running => Some(true),
                TaskState::Claimed if row.claim_expires_at.is_none_or(|at| at > now) => Some(false),
                _ => None,
            };
            if let Some(running) = in_flight {
                add_in_flight(&mut counts.cluster, running);
                if let Some(queue) = counts.queues.get_mut(&row.queue) {
                    add_in_flight(queue, running);
                }
            }
            // A row another transaction locks cannot be taken (`SKIP LOCKED`).
            if row.is_claimable(now) && policy.admits(&row.flags, row.priority) && !self.locked.contains(&row.id) {
                if let Some(available) = counts.available.get_mut(&row.queue) {
                    *available = available.saturating_add(1);
                }
            }
        }
        counts
    }

    #[allow(clippy::too_many_arguments)]
    fn claim(
        &mut self,
        worker: &WorkerId,
        token: u64,
        policy: &ClaimPolicy,
        counts: &ClaimCounts,
        start_now: u32,
        lease_ms: u64,
        now: DbTime,
    ) -> (Vec<ClaimedTask>, bool) {
        let plan = budget::plan(policy, counts);
        let mut chosen: Vec<TaskId> = Vec::new();
        let mut taken: BTreeSet<TaskId> = BTreeSet::new();
        for (queue, take) in &plan.takes {
            let mut candidates: Vec<&StoredTask> = self
                .live
                .values()
                .filter(|row| {
                    &row.queue == queue
                        && row.is_claimable(now)
                        && policy.admits(&row.flags, row.priority)
                        && !taken.contains(&row.id)
                        && !self.locked.contains(&row.id)
                })
                .collect();
            candidates.sort_by_key(|row| (row.priority, row.run_at, row.id));
            for row in candidates.into_iter().take(*take as usize) {
                chosen.push(row.id);
                taken.insert(row.id);
            }
        }
        let more = self.left_behind(policy, counts, plan.budget, &taken, now);
        let mut claimed = Vec::with_capacity(chosen.len());
        for (index, id) in chosen.into_iter().enumerate() {
            let start = index < start_now as usize;
            let row = self.live_row(id);
            row.apply_event(if start { TaskEvent::ClaimAndStart } else { TaskEvent::Claim });
            row.lease = Lease(row.lease.0.saturating_add(1));
            row.claimed_by = Some(worker.clone());
            row.claim_token = Some(token);
            row.claimed_at = Some(now);
            let attempt = if start {
                row.attempts = row.attempts.saturating_add(1);
                row.started_at = Some(now);
                row.heartbeat_at = Some(now);
                row.claim_expires_at = None;
                row.attempts
            } else {
                row.heartbeat_at = None;
                row.claim_expires_at = Some(now.plus_ms(lease_ms));
                row.attempts.saturating_add(1)
            };
            // What PostgreSQL's store could not decode, it hands over as `null` and says why.
            let args_error =
                (json_depth(&row.args) > READABLE_JSON_DEPTH).then(|| "recursion limit exceeded".to_owned());
            claimed.push(ClaimedTask {
                id,
                lease: row.lease,
                name: row.name.clone(),
                queue: row.queue.clone(),
                args: if args_error.is_some() { Value::Null } else { row.args.clone() },
                priority: row.priority,
                started: start,
                attempt: Attempt(attempt),
                retries: row.retries,
                retry: row.retry.clone(),
                expires: row.good_until.is_some(),
                args_error,
                retry_error: None,
            });
        }
        (claimed, more)
    }

    /// Whether a claim pass that took `taken` left an eligible row of a served queue behind,
    /// as PostgreSQL's `claim()` judges it, per queue in claim order: a queue that took all it
    /// wanted (its budget, cap room and batch; wanting nothing counts) is probed for a Pending
    /// row after the last one it took in claim order and a lapsed claim it did not take (a
    /// locked row before the last one taken reads as taken by another claimer); a queue that
    /// ran short, for any eligible row it did not take (one another transaction locks).
    /// Without locked rows this is "more eligible rows than taken".
    fn left_behind(
        &self,
        policy: &ClaimPolicy,
        counts: &ClaimCounts,
        budget: u32,
        taken: &BTreeSet<TaskId>,
        now: DbTime,
    ) -> bool {
        let hard = policy.hard_cap_mode();
        let mut left = budget;
        for queue in &policy.queues {
            let in_flight = counts.queues.get(&queue.name).copied().unwrap_or_default();
            let room = queue
                .max_concurrency
                .map_or(u32::MAX, |cap| cap.saturating_sub(in_flight.counted(hard || queue.serial)));
            let batch = if policy.max_claim_batch > 0 { policy.max_claim_batch } else { u32::MAX };
            let want = left.min(room).min(batch);
            let eligible = |row: &&StoredTask| {
                row.queue == queue.name && row.is_claimable(now) && policy.admits(&row.flags, row.priority)
            };
            let got: Vec<&StoredTask> =
                self.live.values().filter(eligible).filter(|row| taken.contains(&row.id)).collect();
            left = left.saturating_sub(got.len() as u32);
            if (got.len() as u32) < want {
                if self.live.values().filter(eligible).any(|row| !taken.contains(&row.id)) {
                    return true;
                }
                continue;
            }
            let key = |row: &StoredTask| (row.priority, row.run_at, row.id);
            let last = got.iter().filter(|row| row.state == TaskState::Pending).map(|row| key(row)).max();
            let behind = self.live.values().filter(eligible).any(|row| match row.state {
                TaskState::Pending => last.is_none_or(|last| key(row) > last),
                _ => !taken.contains(&row.id),
            });
            if behind {
                return true;
            }
        }
        false
    }

    fn start(&mut self, worker: &WorkerId, tasks: &[TaskLease], policy: &ClaimPolicy, now: DbTime) -> DbReply {
        let mut started = Vec::new();
        let mut expired = Vec::new();
        let mut deferred = Vec::new();
        let mut lost = Vec::new();
        let mut running = self.running_per_queue();
        for &TaskLease { task: id, lease } in tasks {
            if self.locked.contains(&id)
                && self.live.get(&id).is_some_and(|row| {
                    row.held_by(worker, lease)
                        && (row.state == TaskState::Running
                            || (row.state == TaskState::Claimed && row.claim_expires_at.is_none_or(|at| at > now)))
                })
            {
                // Skipped, as PostgreSQL's `SKIP LOCKED` does: asked again later. (Any other
                // locked row is lost below, as it is there.)
                deferred.push(id);
                continue;
            }
            let Some(row) = self.live.get(&id).filter(|row| row.held_by(worker, lease)) else {
                lost.push(id);
                continue;
            };
            match row.state {
                // A re-send of a start that was applied: report it started again.
                TaskState::Running => {
                    started.push((id, Attempt(row.attempts)));
                    continue;
                }
                TaskState::Claimed if row.claim_expires_at.is_none_or(|at| at > now) => {}
                _ => {
                    lost.push(id);
                    continue;
                }
            }
            if row.good_until.is_some_and(|at| at <= now) {
                let error = TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE);
                self.finish_row(id, TaskEvent::Expire, now, Some(error), None);
                expired.push(id);
                continue;
            }
            let cap = if policy.hard_cap_mode() {
                None
            } else {
                policy.queues.iter().find(|q| q.name == row.queue).and_then(|q| q.max_concurrency)
            };
            let queue_running = running.entry(row.queue.clone()).or_insert(0);
            if cap.is_some_and(|cap| *queue_running >= cap) {
                deferred.push(id);
                continue;
            }
            *queue_running += 1;
            started.push((id, self.start_row(id, now)));
        }
        DbReply::Started { started, expired, deferred, lost }
    }

    /// Claimed to Running, counting the run as an attempt: the number of this run.
    fn start_row(&mut self, id: TaskId, now: DbTime) -> Attempt {
        let row = self.live_row(id);
        row.apply_event(TaskEvent::Start);
        row.attempts = row.attempts.saturating_add(1);
        row.started_at = Some(now);
        row.heartbeat_at = Some(now);
        row.claim_expires_at = None;
        Attempt(row.attempts)
    }

    fn record_starts(&mut self, worker: &WorkerId, tasks: &[TaskLease], now: DbTime) -> DbReply {
        let mut started = Vec::new();
        let mut lost = Vec::new();
        for &TaskLease { task: id, lease } in tasks {
            match self.live.get(&id).filter(|row| row.held_by(worker, lease)).map(|row| row.state) {
                Some(TaskState::Running) => started.push((id, Attempt(self.live_row(id).attempts))),
                Some(TaskState::Claimed) => started.push((id, self.start_row(id, now))),
                _ => lost.push(id),
            }
        }
        DbReply::Started { started, expired: Vec::new(), deferred: Vec::new(), lost }
    }

    fn finish(&mut self, worker: &WorkerId, completions: &[Completion], now: DbTime) -> DbReply {
        let mut applied = Vec::new();
        let mut lost = Vec::new();
        let mut retried = BTreeSet::new();
        for Completion { task: TaskLease { task: id, lease }, outcome, args } in completions {
            let id = *id;
            match self.live.get(&id).filter(|row| row.held_by(worker, *lease)).map(|row| row.state) {
                Some(TaskState::Running) => {}
                // Started by the worker without a start request: the run counts here.
                Some(TaskState::Claimed) => {
                    self.start_row(id, now);
                }
                _ => {
                    lost.push(id);
                    continue;
                }
            }
            if let (Some(args), false) = (args, matches!(outcome, FinishOutcome::Completed(_))) {
                self.live.get_mut(&id).expect("a held task is live").args = args.clone();
            }
            let state = match outcome {
                FinishOutcome::Completed(result) => {
                    self.record_attempt(id, TaskState::Completed, None, now);
                    self.finish_row(id, TaskEvent::Complete, now, None, Some(result.clone()))
                }
                FinishOutcome::Failed(error) => self.fail_run(id, error.clone(), now),
                FinishOutcome::Retry { error, delay_ms } => {
                    let run_at = now.plus_ms(*delay_ms);
                    if self.live_row(id).good_until.is_some_and(|at| run_at >= at) {
                        self.fail_run(id, error.clone(), now)
                    } else {
                        retried.insert(self.live_row(id).queue.clone());
                        self.retry_run(id, error.clone(), run_at, now)
                    }
                }
            };
            applied.push((id, state));
        }
        // A retry is work that becomes ready later: tell the listeners so their next claim
        // learns when (`next_run_in_ms`).
        self.notify_ready(retried);
        DbReply::Finished { applied, lost }
    }

    #[allow(clippy::too_many_arguments)]
    fn heartbeat(
        &mut self,
        worker: &WorkerId,
        claimed: &[TaskLease],
        running: &[TaskLease],
        lease_ms: u64,
        max_renew_age_ms: u64,
        abandoned: &[u64],
        now: DbTime,
    ) -> DbReply {
        let mut lost = Vec::new();
        let mut busy = Vec::new();
        let oldest_renewable = minus_ms(now, max_renew_age_ms);
        for &TaskLease { task: id, lease } in claimed {
            if self.locked.contains(&id) {
                busy_or_lost(self.live.get(&id), worker, lease, id, &mut busy, &mut lost);
                continue;
            }
            match self.live.get_mut(&id) {
                Some(row) if row.state == TaskState::Claimed && row.held_by(worker, lease) => {
                    // A lapsed claim is not renewed: claimers already count it out (a serial
                    // queue or a hard cap would overshoot) and may take it; its start fails.
                    let live = row.claim_expires_at.is_none_or(|at| at > now);
                    if live && row.claimed_at.is_some_and(|at| at >= oldest_renewable) {
                        row.claim_expires_at = Some(now.plus_ms(lease_ms));
                        row.heartbeat_at = Some(now);
                    }
                }
                // Started under the same lease since the beat was sent (a start that raced it):
                // still held, and alive.
                Some(row) if row.state == TaskState::Running && row.held_by(worker, lease) => {
                    row.heartbeat_at = Some(now);
                }
                _ => lost.push(id),
            }
        }
        for &TaskLease { task: id, lease } in running {
            if self.locked.contains(&id) {
                busy_or_lost(self.live.get(&id), worker, lease, id, &mut busy, &mut lost);
                continue;
            }
            match self.live.get_mut(&id) {
                Some(row) if row.state == TaskState::Running && row.held_by(worker, lease) => {
                    row.heartbeat_at = Some(now);
                }
                _ => lost.push(id),
            }
        }
        let handed_back = if abandoned.is_empty() {
            Vec::new()
        } else {
            // Rows the beat names under their current lease are the worker's: not left behind.
            let named: BTreeSet<TaskLease> = claimed.iter().chain(running).copied().collect();
            self.abandon_claims(worker, abandoned, &named)
        };
        self.workers.entry(worker.clone()).and_modify(|record| record.last_seen = now).or_insert_with(|| {
            WorkerRecord {
                info: WorkerInfo { worker: worker.clone(), queues: Vec::new(), concurrency: 0 },
                last_seen: now,
                stopped: false,
            }
        });
        DbReply::Heartbeat { lost, busy, handed_back }
    }

    fn release(&mut self, worker: &WorkerId, tasks: &[TaskLease]) -> DbReply {
        let mut released = Vec::new();
        let mut lost = Vec::new();
        let mut queues = BTreeSet::new();
        for &TaskLease { task: id, lease } in tasks {
            let held = self.live.get(&id).is_some_and(|row| {
                matches!(row.state, TaskState::Claimed | TaskState::Running) && row.held_by(worker, lease)
            });
            if held {
                queues.insert(self.release_row(id));
                released.push(id);
            } else {
                lost.push(id);
            }
        }
        self.notify_ready(queues);
        DbReply::Released { released, lost }
    }

    /// Undoes the claims `tokens` of `worker`: every row still held under one of them goes back
    /// to Pending, and a Running one gives back the attempt the claim counted (its worker never
    /// saw the claim, so nothing ran). Rows other transactions hold locked, and rows `except`
    /// names under their current lease, are left. Returns the rows handed back, by id.
    fn abandon_claims(&mut self, worker: &WorkerId, tokens: &[u64], except: &BTreeSet<TaskLease>) -> Vec<TaskId> {
        let ids: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| {
                matches!(row.state, TaskState::Claimed | TaskState::Running)
                    && row.claimed_by.as_ref() == Some(worker)
                    && row.claim_token.is_some_and(|token| tokens.contains(&token))
                    && !self.locked.contains(&row.id)
                    && !except.contains(&TaskLease { task: row.id, lease: row.lease })
            })
            .map(|row| row.id)
            .collect();
        let mut queues = BTreeSet::new();
        for &id in &ids {
            let row = self.live_row(id);
            if row.state == TaskState::Running {
                row.attempts = row.attempts.saturating_sub(1);
                if row.attempts == 0 {
                    row.started_at = None;
                }
            }
            queues.insert(self.release_row(id));
        }
        self.notify_ready(queues);
        ids
    }

    fn reap(
        &mut self,
        claimed_stale_ms: Option<u64>,
        running_stale_ms: Option<u64>,
        entropy: u64,
        now: DbTime,
    ) -> ReapReport {
        let mut report = ReapReport::default();
        // One transaction in PostgreSQL, which delivers a notification sent twice in one
        // transaction once: each queue is announced once per pass.
        let mut ready = BTreeSet::new();
        if let Some(threshold) = claimed_stale_ms {
            let cutoff = minus_ms(now, threshold);
            let stale: Vec<TaskId> = self
                .live
                .values()
                .filter(|row| {
                    row.state == TaskState::Claimed
                        && row.heartbeat_at.or(row.claimed_at).is_some_and(|at| at < cutoff)
                        && !self.locked.contains(&row.id)
                })
                .map(|row| row.id)
                .collect();
            ready.extend(stale.iter().map(|&id| self.release_row(id)));
            report.requeued = stale;
        }
        if let Some(threshold) = running_stale_ms {
            let cutoff = minus_ms(now, threshold);
            let stale: Vec<TaskId> = self
                .live
                .values()
                .filter(|row| {
                    row.state == TaskState::Running
                        && row.heartbeat_at.or(row.started_at).is_some_and(|at| at < cutoff)
                        && !self.locked.contains(&row.id)
                })
                .map(|row| row.id)
                .collect();
            for id in stale {
                self.crash_run(id, entropy, now, &mut report, &mut ready);
            }
        }
        self.notify_ready(ready);
        let expired: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| {
                row.state == TaskState::Pending
                    && row.good_until.is_some_and(|at| at <= now)
                    && !self.locked.contains(&row.id)
            })
            .map(|row| row.id)
            .collect();
        for &id in &expired {
            let error = TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE);
            self.finish_row(id, TaskEvent::Expire, now, Some(error), None);
        }
        report.expired = expired;
        let oldest = minus_ms(now, self.app.recovery.worker_retention_ms);
        let holders: BTreeSet<&WorkerId> = self.live.values().filter_map(|row| row.claimed_by.as_ref()).collect();
        let gone: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, record)| record.last_seen < oldest && !holders.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        report.workers_pruned = gone.len() as u64;
        for id in gone {
            self.workers.remove(&id);
            // Its registry row held the record of its token.
            self.tokens.recorded.remove(&id);
        }
        report
    }

    // -----------------------------------------------------------------------------------------
    // Operator actions
    // -----------------------------------------------------------------------------------------

    /// Cancels a Pending or Claimed task: it becomes Cancelled with error `TASK_CANCELLED`
    /// (no attempt record); a holder's later writes about it are reported lost. Says whether
    /// it was claimed, and by whom: that worker may already be running it.
    pub fn cancel(&mut self, id: TaskId, now: DbTime) -> Result<Cancelled, AdminError> {
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        let (state, holder) = (row.state, row.claimed_by.clone());
        transition(state, TaskEvent::Cancel).map_err(|_| AdminError::WrongState {
            task: id,
            state,
            expected: "PENDING or CLAIMED",
        })?;
        let error = TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE);
        self.finish_row(id, TaskEvent::Cancel, now, Some(error), None);
        Ok(Cancelled::of(state, holder))
    }

    /// Puts a Failed task back to Pending, claimable at once (`run_at = now`), with its
    /// retries reset to 0; its attempts, history and last error are kept.
    pub fn requeue_failed(&mut self, id: TaskId, now: DbTime) -> Result<(), AdminError> {
        let state = self.row(id).ok_or(AdminError::NotFound(id))?.state;
        transition(state, TaskEvent::Requeue).map_err(|_| AdminError::WrongState {
            task: id,
            state,
            expected: "FAILED",
        })?;
        let mut row = self.finished.remove(&id).expect("a FAILED task is in the finished table");
        row.apply_event(TaskEvent::Requeue);
        row.clear_claim();
        row.retries = 0;
        row.run_at = now;
        row.result = None;
        row.finished_at = None;
        let queue = row.queue.clone();
        self.live.insert(id, row);
        self.notify_ready([queue]);
        Ok(())
    }

    /// Changes a Pending task's run-at, priority or retries spent (see [`Reschedule`]); its
    /// key, attempts and history are kept. Its queue is notified, so waiting workers claim it
    /// if it is due, or learn its new run-at from the claim's wake-up hint.
    pub fn reschedule(&mut self, id: TaskId, change: Reschedule, now: DbTime) -> Result<(), AdminError> {
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        if row.state != TaskState::Pending {
            return Err(AdminError::WrongState { task: id, state: row.state, expected: "PENDING" });
        }
        let run_at = change.run_at.map_or(row.run_at, |at| db::resolve_run_at(at, now));
        if let Some(good_until) = row.good_until.filter(|&at| run_at >= at) {
            return Err(AdminError::RunAtAfterGoodUntil { task: id, run_at: run_at.0, good_until: good_until.0 });
        }
        let row = self.live_row(id);
        row.run_at = run_at;
        row.priority = change.priority.unwrap_or(row.priority);
        // The SQL column is an `integer`.
        row.retries = change.retries.map_or(row.retries, |n| n.min(i32::MAX as u32));
        let queue = row.queue.clone();
        self.notify_ready([queue]);
        Ok(())
    }

    /// Completes a Pending, Claimed or Running task by hand with `result`: it moves to the
    /// finished table (no retry), a holder's later writes about it are reported lost, and
    /// waiters are notified. A run it was in counts as its last run (as a finished run's does).
    pub fn complete(&mut self, id: TaskId, result: Value, now: DbTime) -> Result<(), AdminError> {
        self.finish_by_hand(id, TaskEvent::CompleteByHand, None, Some(result), now)
    }

    /// Fails a Pending, Claimed or Running task by hand with `FAILED_BY_OPERATOR` and
    /// `message`, with no retry; otherwise as [`complete`](Self::complete).
    pub fn fail(&mut self, id: TaskId, message: &str, now: DbTime) -> Result<(), AdminError> {
        let error = TaskError::new(ErrorCode::FailedByOperator, message);
        self.finish_by_hand(id, TaskEvent::FailByHand, Some(error), None, now)
    }

    fn finish_by_hand(
        &mut self,
        id: TaskId,
        event: TaskEvent,
        error: Option<TaskError>,
        result: Option<Value>,
        now: DbTime,
    ) -> Result<(), AdminError> {
        let row = self.row(id).ok_or(AdminError::NotFound(id))?;
        let state = row.state;
        let refused = |_| AdminError::WrongState { task: id, state, expected: "PENDING, CLAIMED or RUNNING" };
        let outcome = transition(state, event).map_err(refused)?;
        // The finished row holds the task's last run unless the history has it already (what
        // PostgreSQL's attempts query reads back): a run cut off here, or one handed back.
        let recorded = self.history.get(&id).and_then(|runs| runs.iter().map(|r| r.attempt.0).max()).unwrap_or(0);
        if row.attempts > recorded {
            self.record_attempt(id, outcome, error.clone(), now);
        }
        self.finish_row(id, event, now, error, result);
        Ok(())
    }

    /// Hands the Claimed and Running tasks of dead `workers` back to Pending, as a
    /// [`DbRequest::Release`] by their holder would: claimable at once, no retry spent, the
    /// holder's later writes reported lost; each queue concerned is notified once. Registered
    /// workers among them are marked stopped. Returns how many tasks went back.
    pub fn force_unlock(&mut self, workers: &[WorkerId]) -> u64 {
        let ids: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| matches!(row.state, TaskState::Claimed | TaskState::Running))
            .filter(|row| row.claimed_by.as_ref().is_some_and(|w| workers.contains(w)))
            .map(|row| row.id)
            .collect();
        let queues: BTreeSet<String> = ids.iter().map(|&id| self.release_row(id)).collect();
        self.notify_ready(queues);
        for worker in workers {
            if let Some(record) = self.workers.get_mut(worker) {
                record.stopped = true;
            }
        }
        ids.len() as u64
    }

    /// Frees idempotency key `key`: the task holding it is Cancelled if Pending (as by
    /// [`cancel`](Self::cancel)), runs on without it if Claimed or Running, and simply loses
    /// it if finished. The task no longer shows the key, and a new task may take it.
    pub fn remove_key(&mut self, key: &str, now: DbTime) -> Result<KeyRemoval, AdminError> {
        let id = self.keys.remove(key).ok_or_else(|| AdminError::KeyNotFound(key.to_owned()))?.task;
        if let Some(row) = self.live.get_mut(&id) {
            row.key = None;
            if row.state != TaskState::Pending {
                return Ok(KeyRemoval::Detached(id));
            }
            let error = TaskError::new(ErrorCode::TaskCancelled, TASK_CANCELLED_MESSAGE);
            self.finish_row(id, TaskEvent::Cancel, now, Some(error), None);
            return Ok(KeyRemoval::Cancelled(id));
        }
        if let Some(row) = self.finished.get_mut(&id) {
            row.key = None;
        }
        Ok(KeyRemoval::Freed(id))
    }

    /// Deletes finished tasks that finished more than `retention_ms` before `now`, with their
    /// attempts history and the keys they hold. Returns how many.
    ///
    /// A task that holds an idempotency key stays (its row is what an idempotent enqueue
    /// compares name and arguments with) for `recovery.idempotency_retention_ms` of the app
    /// after the key was taken (or its task enqueued, if later): forever when that is `None`.
    pub fn purge_finished(&mut self, retention_ms: u64, now: DbTime) -> u64 {
        let cutoff = minus_ms(now, retention_ms);
        let window = self.app.recovery.idempotency_retention_ms;
        let keys = &self.keys;
        let kept = |row: &StoredTask| {
            let Some(hold) = row.key.as_ref().and_then(|key| keys.get(key)).filter(|hold| hold.task == row.id) else {
                return false;
            };
            match (hold.idempotent_since, window) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(since), Some(window)) => since.max(row.enqueued_at) > minus_ms(now, window),
            }
        };
        let old: Vec<TaskId> = self
            .finished
            .values()
            .filter(|row| row.finished_at.is_some_and(|at| at < cutoff) && !kept(row))
            .map(|row| row.id)
            .collect();
        for id in &old {
            if let Some(row) = self.finished.remove(id) {
                // A key another task has taken since is not this task's to drop.
                if let Some(key) = row.key.filter(|key| self.keys.get(key).is_some_and(|hold| hold.task == *id)) {
                    self.keys.remove(&key);
                }
            }
            self.history.remove(id);
        }
        old.len() as u64
    }

    /// Pauses `queue`: from now on no claim takes its Pending tasks (its Claimed and Running
    /// ones go on). Returns whether it was running before (pausing a paused queue keeps its
    /// first pause time). Any valid queue name may be paused, configured or not.
    pub fn pause_queue(&mut self, queue: &str, now: DbTime) -> Result<bool, AdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()));
        }
        if self.paused.contains_key(queue) {
            return Ok(false);
        }
        self.paused.insert(queue.to_owned(), now);
        Ok(true)
    }

    /// Resumes a paused `queue` and notifies it, so waiting workers claim its tasks. Returns
    /// whether it was paused.
    pub fn resume_queue(&mut self, queue: &str) -> Result<bool, AdminError> {
        if !is_valid_queue_name(queue) {
            return Err(AdminError::InvalidQueueName(queue.to_owned()));
        }
        if self.paused.remove(queue).is_none() {
            return Ok(false);
        }
        self.notify_ready([queue.to_owned()]);
        Ok(true)
    }

    /// The paused queues, by name.
    pub fn paused_queues(&self) -> Vec<PausedQueue> {
        self.paused.iter().map(|(queue, &paused_at)| PausedQueue { queue: queue.clone(), paused_at }).collect()
    }

    /// `policy` without the queues that are paused: what a claim pass serves.
    fn without_paused(&self, policy: &Arc<ClaimPolicy>) -> Arc<ClaimPolicy> {
        if self.paused.is_empty() || !policy.queues.iter().any(|q| self.paused.contains_key(&q.name)) {
            return Arc::clone(policy);
        }
        let mut served = ClaimPolicy::clone(policy);
        served.queues.retain(|q| !self.paused.contains_key(&q.name));
        Arc::new(served)
    }

    // -----------------------------------------------------------------------------------------
    // Inspection
    // -----------------------------------------------------------------------------------------

    /// The task with this id, live or finished.
    pub fn get(&self, id: TaskId) -> Option<TaskRecord> {
        self.row(id).map(StoredTask::record)
    }

    /// The full row of the task with this id, live or finished.
    pub fn task(&self, id: TaskId) -> Option<&StoredTask> {
        self.row(id)
    }

    /// Every row: the live table, then the finished table, each by id.
    pub fn tasks(&self) -> impl Iterator<Item = &StoredTask> {
        self.live.values().chain(self.finished.values())
    }

    /// The attempts history of a task, oldest first (empty for an unknown id).
    pub fn attempts(&self, id: TaskId) -> Vec<AttemptRecord> {
        self.history.get(&id).cloned().unwrap_or_default()
    }

    /// The tasks `filter` selects, live and finished together, by id.
    pub fn list(&self, filter: &TaskFilter) -> Vec<TaskRecord> {
        let mut rows: Vec<&StoredTask> = self
            .tasks()
            .filter(|row| filter.queue.as_ref().is_none_or(|q| &row.queue == q))
            .filter(|row| filter.state.is_none_or(|s| row.state == s))
            .collect();
        rows.sort_by_key(|row| row.id);
        rows.into_iter().take(filter.limit.unwrap_or(usize::MAX)).map(StoredTask::record).collect()
    }

    /// How many tasks each queue has in each state (pairs with none are left out).
    pub fn counts(&self) -> BTreeMap<(String, TaskState), u64> {
        let mut counts = BTreeMap::new();
        for row in self.tasks() {
            *counts.entry((row.queue.clone(), row.state)).or_insert(0) += 1;
        }
        counts
    }

    /// The worker registry, by worker id.
    pub fn workers(&self) -> Vec<WorkerRecord> {
        self.workers.values().cloned().collect()
    }

    /// Takes the notifications sent since the last call, in the order they were sent.
    pub fn take_notifications(&mut self) -> Vec<Notification> {
        std::mem::take(&mut self.notifications)
    }

    /// The earliest `run_at` among Pending tasks, past or future: a simulation compares it
    /// with its clock to skip ahead to the next time a task becomes claimable.
    pub fn next_run_at(&self) -> Option<DbTime> {
        self.pending_run_ats().min()
    }

    /// The earliest `run_at` after `now` among Pending tasks.
    pub fn next_run_at_after(&self, now: DbTime) -> Option<DbTime> {
        self.pending_run_ats().filter(|&at| at > now).min()
    }

    // -----------------------------------------------------------------------------------------
    // Row moves
    // -----------------------------------------------------------------------------------------

    fn pending_run_ats(&self) -> impl Iterator<Item = DbTime> + '_ {
        self.live.values().filter(|row| row.state == TaskState::Pending).map(|row| row.run_at)
    }

    fn row(&self, id: TaskId) -> Option<&StoredTask> {
        self.live.get(&id).or_else(|| self.finished.get(&id))
    }

    /// A row of the live table the caller knows is there.
    fn live_row(&mut self, id: TaskId) -> &mut StoredTask {
        self.live.get_mut(&id).unwrap_or_else(|| panic!("memory store invariant broken: task {id} is not live"))
    }

    fn running_per_queue(&self) -> BTreeMap<String, u32> {
        let mut running = BTreeMap::new();
        for row in self.live.values() {
            if row.state == TaskState::Running {
                *running.entry(row.queue.clone()).or_insert(0) += 1;
            }
        }
        running
    }

    fn notify_ready(&mut self, queues: impl IntoIterator<Item = String>) {
        for queue in queues {
            self.notifications.push(Notification::TaskReady { queue, priority: None });
        }
    }

    /// Appends the attempt record of the run a live row is finishing.
    fn record_attempt(&mut self, id: TaskId, outcome: TaskState, error: Option<TaskError>, now: DbTime) {
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
    fn finish_row(
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
        state
    }

    /// Fails a Running row for good, with its attempt record.
    fn fail_run(&mut self, id: TaskId, error: TaskError, now: DbTime) -> TaskState {
        self.record_attempt(id, TaskState::Failed, Some(error.clone()), now);
        self.finish_row(id, TaskEvent::Fail, now, Some(error), None)
    }

    /// Puts a Running row back to Pending from `run_at`, spending a retry, with its attempt
    /// record.
    fn retry_run(&mut self, id: TaskId, error: TaskError, run_at: DbTime, now: DbTime) -> TaskState {
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
    fn release_row(&mut self, id: TaskId) -> String {
        let row = self.live_row(id);
        row.apply_event(TaskEvent::Release);
        row.clear_claim();
        row.queue.clone()
    }
}

fn add_in_flight(in_flight: &mut InFlight, running: bool) {
    if running {
        in_flight.running = in_flight.running.saturating_add(1);
    } else {
        in_flight.claimed = in_flight.claimed.saturating_add(1);
    }
}

/// A row named by a beat that another transaction holds locked: still held (busy) when its
/// holder and lease match, else lost.
fn busy_or_lost(
    row: Option<&StoredTask>,
    worker: &WorkerId,
    lease: Lease,
    id: TaskId,
    busy: &mut Vec<TaskId>,
    lost: &mut Vec<TaskId>,
) {
    let held = row
        .is_some_and(|row| matches!(row.state, TaskState::Claimed | TaskState::Running) && row.held_by(worker, lease));
    if held { busy.push(id) } else { lost.push(id) }
}

/// What PostgreSQL refuses in a completion's values: text with U+0000 (`jsonb` cannot hold
/// it) and values over its size limit. Depth it stores (it is reading them back that fails).
fn refused_values(completion: &Completion) -> Result<(), db::UnstorableValue> {
    let limit = crate::config::MAX_STORED_VALUE_BYTES;
    let refused = |value: &Value| match db::check_storable(value, limit) {
        Err(db::UnstorableValue::TooDeep { .. }) | Ok(_) => Ok(()),
        Err(other) => Err(other),
    };
    match &completion.outcome {
        FinishOutcome::Completed(result) => refused(result)?,
        FinishOutcome::Failed(error) | FinishOutcome::Retry { error, .. } => {
            match db::check_storable_error(error, limit) {
                Err(db::UnstorableValue::TooDeep { .. }) | Ok(_) => {}
                Err(other) => return Err(other),
            }
        }
    }
    completion.args.as_ref().map_or(Ok(()), refused)
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
fn minus_ms(now: DbTime, ms: u64) -> DbTime {
    DbTime(now.0.saturating_sub(i64::try_from(ms).unwrap_or(i64::MAX)))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::config::{CustomQueue, QueueMode, RecoveryConfig, WorkerConfig};
    use crate::db::RunAt;

    const T0: DbTime = DbTime(1_000_000);
    const LEASE_MS: u64 = 60_000;

    fn at(ms: i64) -> DbTime {
        DbTime(T0.0 + ms)
    }

    fn w(name: &str) -> WorkerId {
        WorkerId(name.to_owned())
    }

    fn custom(queues: Vec<CustomQueue>) -> AppConfig {
        AppConfig { queue_mode: QueueMode::Custom, custom_queues: queues, ..AppConfig::default() }
    }

    /// The claim policy of a worker serving every queue of the store's app.
    fn policy(store: &MemoryStore, concurrency: u32) -> Arc<ClaimPolicy> {
        let worker = WorkerConfig { concurrency, ..WorkerConfig::default() };
        Arc::new(ClaimPolicy::from_config(store.app(), &worker))
    }

    fn add(store: &mut MemoryStore, task: NewTask) -> TaskId {
        store.enqueue(task, T0).expect("enqueue")
    }

    /// A claim by a worker of this concurrency serving every queue.
    fn claim_n(
        store: &mut MemoryStore,
        worker: &str,
        token: u64,
        concurrency: u32,
        start_now: u32,
        now: DbTime,
    ) -> Vec<ClaimedTask> {
        let policy = policy(store, concurrency);
        claim_with(store, worker, token, &policy, start_now, now)
    }

    /// A claim by a worker holding nothing, under a lease of [`LEASE_MS`].
    fn claim_request(worker: &str, token: u64, policy: &Arc<ClaimPolicy>, start_now: u32) -> DbRequest {
        DbRequest::Claim {
            worker: w(worker),
            token,
            policy: Arc::clone(policy),
            my_running: 0,
            my_claimed: 0,
            start_now,
            lease_ms: LEASE_MS,
        }
    }

    fn claim_with(
        store: &mut MemoryStore,
        worker: &str,
        token: u64,
        policy: &Arc<ClaimPolicy>,
        start_now: u32,
        now: DbTime,
    ) -> Vec<ClaimedTask> {
        let request = claim_request(worker, token, policy, start_now);
        match store.apply(&request, now) {
            DbReply::Claimed { tasks, .. } => tasks,
            other => panic!("unexpected reply {other:?}"),
        }
    }

    fn claim(store: &mut MemoryStore, worker: &str, concurrency: u32, now: DbTime) -> Vec<ClaimedTask> {
        let policy = policy(store, concurrency);
        claim_with(store, worker, 1, &policy, 0, now)
    }

    fn ids(tasks: &[ClaimedTask]) -> Vec<i64> {
        tasks.iter().map(|t| t.id.0).collect()
    }

    fn lease(task: &ClaimedTask) -> TaskLease {
        TaskLease { task: task.id, lease: task.lease }
    }

    fn start(
        store: &mut MemoryStore,
        worker: &str,
        tasks: Vec<TaskLease>,
        policy: &Arc<ClaimPolicy>,
        now: DbTime,
    ) -> DbReply {
        let request = DbRequest::Start { worker: w(worker), tasks, policy: Arc::clone(policy) };
        store.apply(&request, now)
    }

    fn started(reply: &DbReply) -> Vec<(i64, u32)> {
        match reply {
            DbReply::Started { started, .. } => started.iter().map(|(id, a)| (id.0, a.0)).collect(),
            other => panic!("unexpected reply {other:?}"),
        }
    }

    fn finish(store: &mut MemoryStore, worker: &str, task: TaskLease, outcome: FinishOutcome, now: DbTime) -> DbReply {
        let request =
            DbRequest::Finish { worker: w(worker), completions: vec![Completion { task, outcome, args: None }] };
        store.apply(&request, now)
    }

    fn reap(store: &mut MemoryStore, claimed: Option<u64>, running: Option<u64>, now: DbTime) -> ReapReport {
        let request =
            DbRequest::Reap { worker: w("reaper"), claimed_stale_ms: claimed, running_stale_ms: running, entropy: 7 };
        match store.apply(&request, now) {
            DbReply::Reaped(report) => report,
            other => panic!("unexpected reply {other:?}"),
        }
    }

    fn state(store: &MemoryStore, id: TaskId) -> TaskState {
        store.get(id).expect("task exists").state
    }

    fn err(code: ErrorCode) -> TaskError {
        TaskError::new(code, "boom")
    }

    /// Claims and starts one task of a default-queue store: (id, its lease).
    fn running_task(store: &mut MemoryStore, task: NewTask, worker: &str, now: DbTime) -> TaskLease {
        let id = add(store, task);
        let policy = policy(store, 1);
        let claimed = claim_with(store, worker, 1, &policy, 1, now);
        assert_eq!(ids(&claimed), vec![id.0]);
        lease(&claimed[0])
    }

    #[test]
    fn claim_order_is_queue_priority_then_task_priority_run_at_and_id() {
        let app = custom(vec![CustomQueue::new("low").with_priority(2), CustomQueue::new("high").with_priority(1)]);
        let mut store = MemoryStore::new(app);
        let t1 = add(&mut store, NewTask::new("t", json!(1)).queue("low").priority(3));
        let t2 = add(&mut store, NewTask::new("t", json!(2)).queue("high").priority(5));
        let t3 = add(&mut store, NewTask::new("t", json!(3)).queue("high").priority(1).run_at(RunAt::DelayMs(500)));
        let t4 = add(&mut store, NewTask::new("t", json!(4)).queue("high").priority(1).run_at(RunAt::DelayMs(100)));
        let t5 = add(&mut store, NewTask::new("t", json!(5)).queue("high").priority(1).run_at(RunAt::DelayMs(100)));
        let t6 = add(&mut store, NewTask::new("t", json!(6)).queue("low").priority(-1));
        let claimed = claim(&mut store, "a", 10, at(1_000));
        assert_eq!(ids(&claimed), vec![t4.0, t5.0, t3.0, t2.0, t6.0, t1.0]);
        assert!(claimed.iter().all(|t| !t.started && t.attempt == Attempt(1) && t.lease == Lease(1)));
        let row = store.task(t4).unwrap();
        assert_eq!(row.state, TaskState::Claimed);
        assert_eq!(row.claimed_by, Some(w("a")));
        assert_eq!(row.claimed_at, Some(at(1_000)));
        assert_eq!(row.claim_expires_at, Some(at(1_000).plus_ms(LEASE_MS)));
        assert_eq!(store.get(t4).unwrap().worker, Some(w("a")));
    }

    #[test]
    fn a_budget_smaller_than_the_eligible_rows_takes_the_first_and_says_more() {
        let mut store = MemoryStore::new(AppConfig::default());
        for i in 0..5 {
            add(&mut store, NewTask::new("t", json!(i)));
        }
        let request = claim_request("a", 1, &policy(&store, 2), 0);
        let DbReply::Claimed { tasks, more, .. } = store.apply(&request, T0) else { panic!() };
        assert_eq!((ids(&tasks), more), (vec![1, 2], true));
        let request = claim_request("b", 1, &policy(&store, 10), 0);
        let DbReply::Claimed { tasks, more, .. } = store.apply(&request, T0) else { panic!() };
        assert_eq!((ids(&tasks), more), (vec![3, 4, 5], false));
    }

    #[test]
    fn run_at_in_the_future_is_not_claimed_until_reached() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("t", json!(null)).run_at(RunAt::DelayMs(1_000)));
        assert_eq!(store.next_run_at(), Some(at(1_000)));
        assert_eq!(store.next_run_at_after(at(1_000)), None);
        assert!(claim(&mut store, "a", 4, at(999)).is_empty());
        assert_eq!(ids(&claim(&mut store, "a", 4, at(1_000))), vec![id.0]);
        assert_eq!(store.next_run_at(), None);
    }

    #[test]
    fn good_until_passed_is_not_claimed_and_expires() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("t", json!(null)).good_until(at(100)));
        let claimed_one = add(&mut store, NewTask::new("t", json!(2)).good_until(at(100)));
        let policy = policy(&store, 1);
        // The second is claimed before its good-until, and expires when started after it.
        let claimed = claim_with(&mut store, "a", 1, &policy, 0, at(50));
        assert_eq!(ids(&claimed), vec![id.0]);
        let reply = start(&mut store, "a", vec![lease(&claimed[0])], &policy, at(100));
        assert_eq!(reply, DbReply::Started { started: vec![], expired: vec![id], deferred: vec![], lost: vec![] });
        assert!(claim(&mut store, "b", 4, at(100)).is_empty());
        store.take_notifications();
        let report = reap(&mut store, None, None, at(100));
        assert_eq!(report.expired, vec![claimed_one]);
        for task in [id, claimed_one] {
            let record = store.get(task).unwrap();
            assert_eq!(record.state, TaskState::Expired);
            assert_eq!(record.error.unwrap().code, ErrorCode::TaskExpired);
            assert_eq!(record.finished_at, Some(at(100)));
            assert!(store.attempts(task).is_empty());
        }
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskFinished { task: claimed_one, state: TaskState::Expired }]
        );
    }

    #[test]
    fn hard_mode_queue_cap_counts_running_and_live_claims() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("q").with_max_concurrency(2)]));
        for i in 0..5 {
            add(&mut store, NewTask::new("t", json!(i)));
        }
        let a = policy(&store, 1);
        let first = claim_with(&mut store, "a", 1, &a, 1, T0);
        assert_eq!(ids(&first), vec![1]);
        assert_eq!(ids(&claim(&mut store, "b", 5, T0)), vec![2]);
        assert!(claim(&mut store, "c", 5, T0).is_empty());
        let counts = store.claim_counts(&policy(&store, 5), 0, 0, T0);
        assert_eq!(counts.queues["q"], InFlight { running: 1, claimed: 1 });
        assert_eq!(counts.cluster, InFlight { running: 1, claimed: 1 });
        assert_eq!(counts.available["q"], 3);
        // B's claim lapses: no longer in flight, and claimable again, first by id.
        let later = at(LEASE_MS as i64);
        assert_eq!(store.claim_counts(&a, 0, 0, later).queues["q"], InFlight { running: 1, claimed: 0 });
        assert_eq!(ids(&claim(&mut store, "c", 5, later)), vec![2]);
        assert_eq!(store.task(TaskId(2)).unwrap().lease, Lease(2));
    }

    #[test]
    fn hard_mode_cluster_cap_bounds_every_worker() {
        let mut app = custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]);
        app.cluster_wide_cap = Some(3);
        let mut store = MemoryStore::new(app);
        for i in 0..4 {
            add(&mut store, NewTask::new("t", json!(i)).queue("a"));
            add(&mut store, NewTask::new("t", json!(i)).queue("b"));
        }
        let p = policy(&store, 2);
        assert_eq!(claim_with(&mut store, "w1", 1, &p, 2, T0).len(), 2);
        assert_eq!(claim(&mut store, "w2", 5, T0).len(), 1);
        assert!(claim(&mut store, "w3", 5, T0).is_empty());
    }

    #[test]
    fn soft_mode_queue_cap_counts_running_only_and_start_defers_at_the_cap() {
        let mut app = custom(vec![CustomQueue::new("q").with_max_concurrency(1)]);
        app.prefetch_buffer = 2;
        app.claim_lease_ms = Some(LEASE_MS);
        let mut store = MemoryStore::new(app);
        for i in 0..3 {
            add(&mut store, NewTask::new("t", json!(i)));
        }
        let p = policy(&store, 1);
        let a = claim_with(&mut store, "a", 1, &p, 0, T0);
        let b = claim_with(&mut store, "b", 1, &p, 0, T0);
        // In hard mode the second claimer would have got nothing: the claim holds the slot.
        assert_eq!((ids(&a), ids(&b)), (vec![1], vec![2]));
        assert_eq!(started(&start(&mut store, "a", vec![lease(&a[0])], &p, at(1))), vec![(1, 1)]);
        let reply = start(&mut store, "b", vec![lease(&b[0])], &p, at(2));
        assert_eq!(
            reply,
            DbReply::Started { started: vec![], expired: vec![], deferred: vec![TaskId(2)], lost: vec![] }
        );
        assert_eq!(state(&store, TaskId(2)), TaskState::Claimed);
        // Now Running fills the cap: nothing more is claimed.
        assert!(claim_with(&mut store, "c", 1, &p, 0, at(3)).is_empty());
        finish(&mut store, "a", lease(&a[0]), FinishOutcome::Completed(json!("ok")), at(4));
        assert_eq!(started(&start(&mut store, "b", vec![lease(&b[0])], &p, at(5))), vec![(2, 1)]);
    }

    #[test]
    fn a_lapsed_claim_is_reclaimed_under_a_higher_lease_and_the_old_holder_is_fenced() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("t", json!(null)));
        let p = policy(&store, 1);
        let old = lease(&claim_with(&mut store, "a", 1, &p, 0, T0)[0]);
        let lapsed = at(LEASE_MS as i64);
        // Lapsed but not yet reclaimed: too late to start.
        assert_eq!(started(&start(&mut store, "a", vec![old], &p, lapsed)), vec![]);
        let new = claim_with(&mut store, "b", 9, &p, 0, lapsed);
        assert_eq!((ids(&new), new[0].lease, new[0].attempt), (vec![id.0], Lease(2), Attempt(1)));
        let new = lease(&new[0]);
        let lost = |reply: DbReply| match reply {
            DbReply::Started { lost, .. }
            | DbReply::Finished { lost, .. }
            | DbReply::Heartbeat { lost, .. }
            | DbReply::Released { lost, .. } => lost,
            other => panic!("unexpected reply {other:?}"),
        };
        let heartbeat = |claimed: Vec<TaskLease>, running: Vec<TaskLease>| DbRequest::Heartbeat {
            worker: w("a"),
            claimed,
            running,
            lease_ms: LEASE_MS,
            max_renew_age_ms: 180_000,
            abandoned: vec![],
        };
        assert_eq!(lost(start(&mut store, "a", vec![old], &p, lapsed)), vec![id]);
        assert_eq!(lost(store.apply(&heartbeat(vec![old], vec![]), lapsed)), vec![id]);
        let release = DbRequest::Release { worker: w("a"), tasks: vec![old] };
        assert_eq!(lost(store.apply(&release, lapsed)), vec![id]);
        // The new holder runs it; the old holder's writes about the run change nothing.
        assert_eq!(started(&start(&mut store, "b", vec![new], &p, lapsed)), vec![(id.0, 1)]);
        // Even the same worker name under the old lease is fenced.
        assert_eq!(lost(start(&mut store, "b", vec![old], &p, lapsed)), vec![id]);
        assert_eq!(lost(store.apply(&heartbeat(vec![], vec![old]), lapsed)), vec![id]);
        let done = FinishOutcome::Completed(json!(1));
        assert_eq!(lost(finish(&mut store, "a", old, done.clone(), lapsed)), vec![id]);
        assert_eq!(state(&store, id), TaskState::Running);
        let reply = finish(&mut store, "b", new, done.clone(), lapsed);
        assert_eq!(reply, DbReply::Finished { applied: vec![(id, TaskState::Completed)], lost: vec![] });
        // A re-send of an applied finish is lost, never applied twice.
        assert_eq!(lost(finish(&mut store, "b", new, done, lapsed)), vec![id]);
        assert_eq!(store.attempts(id).len(), 1);
    }

    #[test]
    fn start_is_idempotent_for_its_holder() {
        let mut store = MemoryStore::new(AppConfig::default());
        add(&mut store, NewTask::new("t", json!(null)));
        let p = policy(&store, 1);
        let held = lease(&claim_with(&mut store, "a", 1, &p, 0, T0)[0]);
        assert_eq!(started(&start(&mut store, "a", vec![held], &p, at(1))), vec![(1, 1)]);
        assert_eq!(started(&start(&mut store, "a", vec![held], &p, at(2))), vec![(1, 1)]);
        let row = store.task(held.task).unwrap();
        assert_eq!((row.attempts, row.started_at, row.claim_expires_at), (1, Some(at(1)), None));
    }

    #[test]
    fn start_now_starts_the_first_n_of_the_reply() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b").with_priority(2)]));
        add(&mut store, NewTask::new("t", json!(1)).queue("b"));
        add(&mut store, NewTask::new("t", json!(2)).queue("a"));
        add(&mut store, NewTask::new("t", json!(3)).queue("b"));
        let p = policy(&store, 5);
        let claimed = claim_with(&mut store, "a", 1, &p, 2, T0);
        let shape: Vec<(i64, bool, u32)> = claimed.iter().map(|t| (t.id.0, t.started, t.attempt.0)).collect();
        assert_eq!(shape, vec![(2, true, 1), (1, true, 1), (3, false, 1)]);
        let row = store.task(TaskId(2)).unwrap();
        assert_eq!(row.state, TaskState::Running);
        assert_eq!((row.attempts, row.started_at, row.heartbeat_at), (1, Some(T0), Some(T0)));
        assert_eq!(row.claim_expires_at, None);
        assert_eq!(store.task(TaskId(3)).unwrap().attempts, 0);
        assert_eq!(state(&store, TaskId(3)), TaskState::Claimed);
    }

    #[test]
    fn retry_waits_its_delay_then_runs_again() {
        let mut store = MemoryStore::new(AppConfig::default());
        let first = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
        let id = first.task;
        let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 5_000 };
        let reply = finish(&mut store, "a", first, retry, at(10));
        assert_eq!(reply, DbReply::Finished { applied: vec![(id, TaskState::Pending)], lost: vec![] });
        let row = store.task(id).unwrap();
        assert_eq!((row.retries, row.attempts, row.run_at), (1, 1, at(5_010)));
        assert_eq!((row.claimed_by.clone(), row.claim_token, row.heartbeat_at), (None, None, None));
        assert_eq!(store.get(id).unwrap().error, Some(err(ErrorCode::TaskError)));
        assert_eq!(store.next_run_at(), Some(at(5_010)));
        assert!(claim(&mut store, "b", 1, at(5_009)).is_empty());
        let again = claim(&mut store, "b", 1, at(5_010));
        assert_eq!((again[0].attempt, again[0].retries, again[0].lease), (Attempt(2), 1, Lease(2)));
    }

    #[test]
    fn a_retry_at_or_past_good_until_fails_instead() {
        let mut store = MemoryStore::new(AppConfig::default());
        let held = running_task(&mut store, NewTask::new("t", json!(null)).good_until(at(10_000)), "a", T0);
        let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 9_000 };
        let reply = finish(&mut store, "a", held, retry, at(1_000));
        assert_eq!(reply, DbReply::Finished { applied: vec![(held.task, TaskState::Failed)], lost: vec![] });
        let record = store.get(held.task).unwrap();
        assert_eq!((record.error, record.retries), (Some(err(ErrorCode::TaskError)), 0));
        assert_eq!(store.attempts(held.task)[0].outcome, TaskState::Failed);
        // One millisecond earlier it retries.
        let held = running_task(&mut store, NewTask::new("t", json!(2)).good_until(at(10_000)), "a", T0);
        let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 8_999 };
        let reply = finish(&mut store, "a", held, retry, at(1_000));
        assert_eq!(reply, DbReply::Finished { applied: vec![(held.task, TaskState::Pending)], lost: vec![] });
    }

    #[test]
    fn reaper_requeues_stale_claims() {
        let mut store = MemoryStore::new(AppConfig::default());
        add(&mut store, NewTask::new("t", json!(1)));
        add(&mut store, NewTask::new("t", json!(2)));
        let claimed = claim(&mut store, "a", 2, T0);
        let beat = DbRequest::Heartbeat {
            worker: w("a"),
            claimed: vec![lease(&claimed[1])],
            running: vec![],
            lease_ms: LEASE_MS,
            max_renew_age_ms: 180_000,
            abandoned: vec![],
        };
        assert_eq!(
            store.apply(&beat, at(10_000)),
            DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] }
        );
        assert_eq!(store.task(TaskId(2)).unwrap().claim_expires_at, Some(at(10_000).plus_ms(LEASE_MS)));
        store.take_notifications();
        assert_eq!(reap(&mut store, Some(30_000), None, at(30_000)).requeued, vec![]);
        let report = reap(&mut store, Some(30_000), None, at(30_001));
        assert_eq!(report, ReapReport { requeued: vec![TaskId(1)], ..ReapReport::default() });
        let row = store.task(TaskId(1)).unwrap();
        assert_eq!((row.state, row.claimed_by.clone(), row.claim_expires_at), (TaskState::Pending, None, None));
        assert_eq!((row.retries, row.attempts, row.lease), (0, 0, Lease(1)));
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskReady { queue: "default".into(), priority: None }]
        );
        // `None` skips the step.
        assert_eq!(reap(&mut store, None, None, at(1_000_000)), ReapReport::default());
    }

    #[test]
    fn reaper_retries_stale_runs_when_the_policy_lists_worker_crashed_and_fails_the_rest() {
        // The policies alone decide (no crash retries beyond them, as in the seed systems).
        let mut app = AppConfig::default();
        app.recovery.crash_retries = 0;
        let mut store = MemoryStore::new(app);
        let crash_retry = RetryPolicy::fixed(vec![10]).with_jitter(false);
        let no_crash = RetryPolicy::fixed(vec![10]).with_codes(vec![ErrorCode::TaskError]);
        let retried = running_task(&mut store, NewTask::new("t", json!(1)).retry(crash_retry.clone()), "a", T0);
        let failed = running_task(&mut store, NewTask::new("t", json!(2)).retry(no_crash), "a", T0);
        let near_expiry =
            running_task(&mut store, NewTask::new("t", json!(3)).retry(crash_retry).good_until(at(40_000)), "a", T0);
        let alive = running_task(&mut store, NewTask::new("t", json!(4)), "b", T0);
        let beat = DbRequest::Heartbeat {
            worker: w("b"),
            claimed: vec![],
            running: vec![alive],
            lease_ms: LEASE_MS,
            max_renew_age_ms: 180_000,
            abandoned: vec![],
        };
        store.apply(&beat, at(20_000));
        store.take_notifications();
        let now = at(30_001);
        let report = reap(&mut store, None, Some(30_000), now);
        assert_eq!(
            report,
            ReapReport {
                retried: vec![retried.task],
                failed: vec![failed.task, near_expiry.task],
                ..ReapReport::default()
            }
        );
        let row = store.task(retried.task).unwrap();
        assert_eq!((row.state, row.retries, row.run_at), (TaskState::Pending, 1, now.plus_ms(10_000)));
        assert_eq!(row.error.as_ref().unwrap().code, ErrorCode::WorkerCrashed);
        assert_eq!(row.claimed_by, None);
        let history = store.attempts(retried.task);
        assert_eq!(
            (history.len(), history[0].outcome, history[0].worker.clone()),
            (1, TaskState::Pending, Some(w("a")))
        );
        let record = store.get(failed.task).unwrap();
        assert_eq!(record.state, TaskState::Failed);
        assert_eq!(record.error, Some(TaskError::new(ErrorCode::WorkerCrashed, WORKER_CRASHED_MESSAGE)));
        assert_eq!(store.attempts(failed.task)[0].outcome, TaskState::Failed);
        assert_eq!(state(&store, alive.task), TaskState::Running);
        assert_eq!(
            store.take_notifications(),
            vec![
                Notification::TaskFinished { task: failed.task, state: TaskState::Failed },
                Notification::TaskFinished { task: near_expiry.task, state: TaskState::Failed },
                // The retry becomes ready later: listeners are told so they learn when.
                Notification::TaskReady { queue: "default".into(), priority: None },
            ]
        );
        // The worker that was thought dead finds out when it writes.
        let late = finish(&mut store, "a", retried, FinishOutcome::Completed(json!(1)), now);
        assert_eq!(late, DbReply::Finished { applied: vec![], lost: vec![retried.task] });
    }

    #[test]
    fn cancel_takes_pending_and_claimed_tasks_and_refuses_running_ones() {
        let mut store = MemoryStore::new(AppConfig::default());
        let pending = add(&mut store, NewTask::new("t", json!(1)).run_at(RunAt::DelayMs(1_000)));
        let p = policy(&store, 1);
        let running = running_task(&mut store, NewTask::new("t", json!(2)), "a", T0);
        let claimed_id = add(&mut store, NewTask::new("t", json!(3)));
        let claimed = lease(&claim_with(&mut store, "a", 2, &p, 0, T0)[0]);
        assert_eq!(claimed.task, claimed_id);
        store.take_notifications();
        store.cancel(pending, at(1)).unwrap();
        store.cancel(claimed_id, at(2)).unwrap();
        for id in [pending, claimed_id] {
            let record = store.get(id).unwrap();
            assert_eq!(record.state, TaskState::Cancelled);
            assert_eq!(record.error.unwrap().code, ErrorCode::TaskCancelled);
            assert!(store.attempts(id).is_empty());
        }
        let refused = store.cancel(running.task, at(3)).unwrap_err();
        assert_eq!(refused.to_string(), format!("task {} is RUNNING: expected PENDING or CLAIMED", running.task));
        assert_eq!(store.cancel(TaskId(99), at(3)), Err(AdminError::NotFound(TaskId(99))));
        assert_eq!(
            store.cancel(pending, at(3)).unwrap_err().to_string(),
            "task 1 is CANCELLED: expected PENDING or CLAIMED"
        );
        assert_eq!(started(&start(&mut store, "a", vec![claimed], &p, at(4))), vec![]);
        assert_eq!(
            store.take_notifications(),
            vec![
                Notification::TaskFinished { task: pending, state: TaskState::Cancelled },
                Notification::TaskFinished { task: claimed_id, state: TaskState::Cancelled },
            ]
        );
    }

    #[test]
    fn requeue_failed_puts_a_failed_task_back_at_once() {
        let mut store = MemoryStore::new(AppConfig::default());
        let held = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
        let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskError), delay_ms: 1_000 };
        finish(&mut store, "a", held, retry, at(1));
        let p = policy(&store, 1);
        let again = lease(&claim_with(&mut store, "a", 2, &p, 1, at(1_001))[0]);
        finish(&mut store, "a", again, FinishOutcome::Failed(err(ErrorCode::TaskError)), at(1_002));
        assert_eq!(state(&store, held.task), TaskState::Failed);
        assert_eq!(store.requeue_failed(TaskId(42), at(1_003)), Err(AdminError::NotFound(TaskId(42))));
        store.take_notifications();
        store.requeue_failed(held.task, at(2_000)).unwrap();
        let record = store.get(held.task).unwrap();
        assert_eq!((record.state, record.retries, record.attempts), (TaskState::Pending, 0, 2));
        assert_eq!((record.run_at, record.finished_at), (at(2_000), None));
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskReady { queue: "default".into(), priority: None }]
        );
        assert_eq!(store.tasks().next().map(|t| t.id), Some(held.task), "back in the live table");
        let third = claim(&mut store, "b", 1, at(2_000));
        assert_eq!((third[0].attempt, third[0].retries, third[0].lease), (Attempt(3), 0, Lease(3)));
        assert_eq!(store.attempts(held.task).len(), 2);
        let refused = store.requeue_failed(held.task, at(2_001)).unwrap_err();
        assert_eq!(refused.to_string(), "task 1 is CLAIMED: expected FAILED");
    }

    #[test]
    fn reschedule_changes_pending_tasks_only_and_announces_them() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("t", json!(1)).good_until(at(10_000)).key("k"));
        store.take_notifications();
        let later = Reschedule { run_at: Some(RunAt::DelayMs(5_000)), priority: Some(-4), retries: Some(3) };
        store.reschedule(id, later, at(1)).unwrap();
        let row = store.task(id).unwrap();
        assert_eq!((row.run_at, row.priority, row.retries, row.key.as_deref()), (at(5_001), -4, 3, Some("k")));
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskReady { queue: "default".into(), priority: None }]
        );
        // A claim now waits for it: the wake-up hint names its new run-at.
        let p = policy(&store, 1);
        let request = claim_request("a", 1, &p, 0);
        assert_eq!(
            store.apply(&request, at(2)),
            DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: Some(4_999) }
        );
        let too_late = Reschedule { run_at: Some(RunAt::At(at(10_000))), ..Reschedule::default() };
        assert_eq!(
            store.reschedule(id, too_late, at(3)),
            Err(AdminError::RunAtAfterGoodUntil { task: id, run_at: at(10_000).0, good_until: at(10_000).0 })
        );
        store.reschedule(id, Reschedule { run_at: Some(RunAt::Now), ..Reschedule::default() }, at(4)).unwrap();
        assert_eq!(ids(&claim_with(&mut store, "a", 2, &p, 1, at(4))), vec![id.0]);
        let refused = store.reschedule(id, Reschedule::default(), at(5)).unwrap_err();
        assert_eq!(refused.to_string(), "task 1 is RUNNING: expected PENDING");
        assert_eq!(store.reschedule(TaskId(9), Reschedule::default(), at(5)), Err(AdminError::NotFound(TaskId(9))));
    }

    #[test]
    fn hand_finishes_fence_the_holder_and_keep_the_cut_off_run() {
        let mut store = MemoryStore::new(AppConfig::default());
        let running = running_task(&mut store, NewTask::new("t", json!(1)), "a", T0);
        let pending = add(&mut store, NewTask::new("t", json!(2)));
        store.take_notifications();
        store.complete(running.task, json!("by hand"), at(1)).unwrap();
        store.fail(pending, "not wanted", at(2)).unwrap();
        let late = finish(&mut store, "a", running, FinishOutcome::Completed(json!("late")), at(3));
        assert_eq!(late, DbReply::Finished { applied: vec![], lost: vec![running.task] });
        let done = store.get(running.task).unwrap();
        assert_eq!((done.state, done.result, done.error), (TaskState::Completed, Some(json!("by hand")), None));
        let history = store.attempts(running.task);
        assert_eq!(history.len(), 1);
        assert_eq!((history[0].worker.clone(), history[0].outcome), (Some(w("a")), TaskState::Completed));
        let failed = store.get(pending).unwrap();
        assert_eq!(failed.error.unwrap().code, ErrorCode::FailedByOperator);
        assert!(store.attempts(pending).is_empty(), "it never ran");
        assert_eq!(
            store.take_notifications(),
            vec![
                Notification::TaskFinished { task: running.task, state: TaskState::Completed },
                Notification::TaskFinished { task: pending, state: TaskState::Failed },
            ]
        );
        let refused = store.complete(pending, json!(null), at(4)).unwrap_err();
        assert_eq!(refused.to_string(), "task 2 is FAILED: expected PENDING, CLAIMED or RUNNING");
    }

    #[test]
    fn force_unlock_releases_every_hold_of_the_dead_and_marks_them_stopped() {
        let mut store = MemoryStore::new(AppConfig::default());
        let info = WorkerInfo { worker: w("dead"), queues: vec![], concurrency: 2 };
        store.apply(&DbRequest::RegisterWorker(info), T0);
        for i in 0..3 {
            add(&mut store, NewTask::new("t", json!(i)));
        }
        let p = policy(&store, 2);
        let dead = claim_with(&mut store, "dead", 1, &p, 1, T0);
        let other = claim(&mut store, "b", 1, T0);
        store.take_notifications();
        assert_eq!(store.force_unlock(&[w("dead")]), 2);
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskReady { queue: "default".into(), priority: None }]
        );
        let states: Vec<(TaskState, u32, u32)> =
            dead.iter().map(|t| store.get(t.id).unwrap()).map(|r| (r.state, r.attempts, r.retries)).collect();
        assert_eq!(states, vec![(TaskState::Pending, 1, 0), (TaskState::Pending, 0, 0)]);
        assert_eq!(state(&store, other[0].id), TaskState::Claimed);
        assert!(store.workers()[0].stopped);
        assert_eq!(store.force_unlock(&[w("dead")]), 0);
    }

    #[test]
    fn removing_a_key_frees_it_whatever_the_task_did() {
        let mut store = MemoryStore::new(AppConfig::default());
        let held = add(&mut store, NewTask::new("t", json!(1)).key("held"));
        claim(&mut store, "a", 1, T0);
        let pending = add(&mut store, NewTask::new("t", json!(2)).key("pending"));
        let done = add(&mut store, NewTask::new("t", json!(3)).key("done"));
        store.cancel(done, T0).unwrap();
        assert_eq!(store.remove_key("held", at(1)), Ok(KeyRemoval::Detached(held)));
        assert_eq!(store.remove_key("pending", at(1)), Ok(KeyRemoval::Cancelled(pending)));
        assert_eq!(store.remove_key("done", at(1)), Ok(KeyRemoval::Freed(done)));
        assert_eq!(store.remove_key("done", at(1)), Err(AdminError::KeyNotFound("done".into())));
        assert_eq!(state(&store, held), TaskState::Claimed);
        assert_eq!(state(&store, pending), TaskState::Cancelled);
        assert!(store.tasks().all(|t| t.key.is_none()));
        // Free for new tasks, with other arguments.
        let again = store.enqueue(NewTask::new("t", json!(9)).key("held"), at(2)).unwrap();
        assert_eq!(again, TaskId(4));
    }

    #[test]
    fn purge_forgets_old_finished_tasks_with_their_runs_and_keys() {
        let mut store = MemoryStore::new(AppConfig::default());
        let old = running_task(&mut store, NewTask::new("t", json!(1)).key("old"), "a", T0);
        finish(&mut store, "a", old, FinishOutcome::Completed(json!(1)), at(10));
        let young = add(&mut store, NewTask::new("t", json!(2)).key_with_mode("young", KeyMode::UnsafeDedupe));
        store.cancel(young, at(1_000)).unwrap();
        assert_eq!(store.purge_finished(500, at(1_000)), 1);
        assert!(store.get(old.task).is_none() && store.attempts(old.task).is_empty());
        assert_eq!(store.remove_key("old", at(1_001)), Err(AdminError::KeyNotFound("old".into())), "gone with it");
        assert_eq!(store.remove_key("young", at(1_001)), Ok(KeyRemoval::Freed(young)));
        assert_eq!(store.purge_finished(500, at(1_000)), 0);
    }

    #[test]
    fn idempotency_keys_keep_their_tasks_from_purge_for_their_window() {
        // By default, forever: an idempotent enqueue of a payment that ran gives its id, years on.
        let mut store = MemoryStore::new(AppConfig::default());
        let paid = add(&mut store, NewTask::new("pay", json!({"cents": 100})).idempotency_key("p1"));
        store.complete(paid, json!("ok"), at(10)).unwrap();
        let years = 100 * 365 * 86_400_000;
        assert_eq!(store.purge_finished(0, at(years)), 0);
        let again = NewTask::new("pay", json!({"cents": 100})).idempotency_key("p1");
        assert_eq!(store.enqueue(again.clone(), at(years)), Ok(paid));
        assert_eq!(store.tasks().count(), 1, "the payment did not run again");

        // With a window of a minute: kept while the key is younger, then purged with its key.
        let recovery = RecoveryConfig { idempotency_retention_ms: Some(60_000), ..RecoveryConfig::default() };
        let mut store = MemoryStore::new(AppConfig { recovery, ..AppConfig::default() });
        let paid = add(&mut store, again.clone());
        let plain = add(&mut store, NewTask::new("t", json!(1)).key("plain"));
        // A key taken in another mode counts from the first idempotent enqueue that relies on it.
        let relied = add(&mut store, NewTask::new("t", json!(2)).key("relied"));
        assert_eq!(store.enqueue(NewTask::new("t", json!(2)).idempotency_key("relied"), at(30_000)), Ok(relied));
        for id in [paid, plain, relied] {
            store.complete(id, json!(null), at(10)).unwrap();
        }
        assert_eq!(store.purge_finished(0, at(59_999)), 1, "the plain key's task goes at once");
        assert_eq!(store.purge_finished(0, at(60_000)), 1, "a minute after its enqueue, the payment");
        assert_eq!(store.purge_finished(0, at(89_999)), 0);
        assert_eq!(store.purge_finished(0, at(90_000)), 1);
        assert!(store.tasks().next().is_none());
        assert_eq!(store.enqueue(again, at(90_001)), Ok(TaskId(4)), "past its window the key is free again");
    }

    #[test]
    fn a_paused_queue_is_left_out_of_claims_until_resumed() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
        add(&mut store, NewTask::new("t", json!(1)).queue("a"));
        add(&mut store, NewTask::new("t", json!(2)).queue("b"));
        add(&mut store, NewTask::new("t", json!(3)).queue("a").run_at(RunAt::DelayMs(100)));
        store.take_notifications();
        assert_eq!(store.pause_queue("a", T0), Ok(true));
        assert_eq!(store.pause_queue("a", at(5)), Ok(false));
        assert_eq!(store.paused_queues(), vec![PausedQueue { queue: "a".into(), paused_at: T0 }]);
        assert_eq!(store.pause_queue("A", T0), Err(AdminError::InvalidQueueName("A".into())));
        let p = policy(&store, 4);
        let request = claim_request("w", 1, &p, 0);
        // Neither its due task nor the wake-up hint of its delayed one.
        let DbReply::Claimed { tasks, more, next_run_in_ms } = store.apply(&request, T0) else { panic!() };
        assert_eq!((ids(&tasks), more, next_run_in_ms), (vec![2], false, None));
        assert!(store.take_notifications().is_empty());
        assert_eq!(store.resume_queue("a"), Ok(true));
        assert_eq!(store.resume_queue("a"), Ok(false));
        assert_eq!(store.take_notifications(), vec![Notification::TaskReady { queue: "a".into(), priority: None }]);
        assert_eq!(ids(&claim_with(&mut store, "w", 2, &p, 0, T0)), vec![1]);
    }

    #[test]
    fn idempotency_keys_dedupe_same_payloads_and_refuse_others() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("t", json!({"n": 1})).idempotency_key("k"));
        store.take_notifications();
        assert_eq!(store.enqueue(NewTask::new("t", json!({"n": 1})).idempotency_key("k"), at(5)), Ok(id));
        assert!(store.take_notifications().is_empty());
        assert_eq!(store.tasks().count(), 1);
        assert_eq!(
            store.enqueue(NewTask::new("t", json!({"n": 2})).idempotency_key("k"), at(5)),
            Err(EnqueueError::PayloadMismatch { key: "k".into(), existing: id })
        );
        assert_eq!(
            store.enqueue(NewTask::new("other", json!({"n": 1})).idempotency_key("k"), at(5)),
            Err(EnqueueError::PayloadMismatch { key: "k".into(), existing: id })
        );
        // A finished task still owns its key.
        store.cancel(id, at(6)).unwrap();
        assert_eq!(store.enqueue(NewTask::new("t", json!({"n": 1})).idempotency_key("k"), at(7)), Ok(id));
    }

    #[test]
    fn enqueue_many_is_all_or_nothing_and_dedupes_within_the_batch() {
        let mut store = MemoryStore::new(AppConfig::default());
        let existing = add(&mut store, NewTask::new("t", json!(0)).idempotency_key("k0"));
        let bad_batch = vec![
            NewTask::new("t", json!(1)),
            NewTask::new("t", json!(0)).idempotency_key("k0"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
            NewTask::new("t", json!(3)).idempotency_key("k1"),
        ];
        assert_eq!(
            store.enqueue_many(bad_batch, T0),
            Err(EnqueueError::BatchKeyConflict { key: "k1".into(), first: 2, second: 3 })
        );
        assert_eq!(store.tasks().count(), 1);
        let batch = vec![
            NewTask::new("t", json!(1)),
            NewTask::new("t", json!(0)).idempotency_key("k0"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
        ];
        let ids = store.enqueue_many(batch, T0).unwrap();
        assert_eq!(ids, vec![TaskId(2), existing, TaskId(3), TaskId(3)]);
        assert_eq!(store.tasks().count(), 3);
        assert_eq!(add(&mut store, NewTask::new("t", json!(9))), TaskId(4));
    }

    #[test]
    fn replace_updates_a_pending_task_in_place_and_detaches_a_running_one() {
        let mut store = MemoryStore::new(AppConfig::default());
        let first = add(&mut store, NewTask::new("t", json!({"v": 1})).key("k").priority(5));
        store.take_notifications();
        let again = NewTask::new("u", json!({"v": 2})).key("k").run_at(RunAt::DelayMs(500)).flag("slow");
        assert_eq!(store.enqueue(again, at(10)), Ok(first));
        let row = store.task(first).unwrap();
        assert_eq!((row.name.as_str(), &row.args, row.priority, row.run_at), ("u", &json!({"v": 2}), 0, at(510)));
        assert_eq!(row.flags, vec!["slow".to_owned()]);
        assert_eq!(store.take_notifications().len(), 1, "its queue hears of the update");
        assert_eq!(store.tasks().count(), 1);

        // Running: it keeps running without its key, and a new task takes the key.
        let running = claim_n(&mut store, "w1", 1, 1, 1, at(600));
        assert_eq!(running[0].id, first);
        let second = store.enqueue(NewTask::new("t", json!({"v": 3})).key("k"), at(700)).unwrap();
        assert_ne!(second, first);
        assert_eq!(store.task(first).unwrap().key, None);
        assert_eq!(store.task(second).unwrap().key.as_deref(), Some("k"));

        // Finished: the key is free, the finished row gives it up.
        finish(&mut store, "w1", lease(&running[0]), FinishOutcome::Completed(json!(1)), at(800));
        let claimed = claim_n(&mut store, "w1", 2, 1, 1, at(900));
        finish(&mut store, "w1", lease(&claimed[0]), FinishOutcome::Completed(json!(2)), at(950));
        let third = store.enqueue(NewTask::new("t", json!({"v": 4})).key("k"), at(1_000)).unwrap();
        assert!(third > second);
        assert_eq!(store.task(second).unwrap().key, None);
    }

    #[test]
    fn replace_appends_arrays_resets_retries_and_preserve_keeps_run_at() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("batch", json!([1, 2])).key("b").run_at(RunAt::DelayMs(1_000)));
        assert_eq!(store.enqueue(NewTask::new("batch", json!([3])).key("b"), at(10)), Ok(id));
        assert_eq!(store.task(id).unwrap().args, json!([1, 2, 3]));
        assert_eq!(store.task(id).unwrap().run_at, at(10), "replace moves run-at");

        let kept = store
            .enqueue(
                NewTask::new("batch", json!([4]))
                    .key_with_mode("b", KeyMode::PreserveRunAt)
                    .run_at(RunAt::DelayMs(9_000)),
                at(20),
            )
            .unwrap();
        assert_eq!(kept, id);
        assert_eq!(store.task(id).unwrap().run_at, at(10), "preserve_run_at keeps it while it never ran");

        // A task that ran and waits for a retry: its retry budget starts over, and
        // preserve_run_at no longer applies.
        let claimed = claim_n(&mut store, "w", 1, 1, 1, at(30));
        let error = TaskError::new(ErrorCode::TaskError, "boom");
        finish(&mut store, "w", lease(&claimed[0]), FinishOutcome::Retry { error, delay_ms: 5_000 }, at(40));
        assert_eq!(store.task(id).unwrap().retries, 1);
        let mode = KeyMode::PreserveRunAt;
        store.enqueue(NewTask::new("batch", json!("x")).key_with_mode("b", mode), at(50)).unwrap();
        let row = store.task(id).unwrap();
        assert_eq!((row.retries, row.error.is_none(), row.run_at, &row.args), (0, true, at(50), &json!("x")));
        assert_eq!(row.attempts, 1, "attempts never decrease");
    }

    #[test]
    fn unsafe_dedupe_keeps_a_live_task_and_bulk_applies_in_order() {
        let mut store = MemoryStore::new(AppConfig::default());
        let mode = KeyMode::UnsafeDedupe;
        let batch = vec![
            NewTask::new("t", json!(1)).key_with_mode("d", mode),
            NewTask::new("t", json!(2)).key_with_mode("d", mode),
            NewTask::new("t", json!(3)),
            NewTask::new("t", json!(4)).key("r"),
            NewTask::new("t", json!(5)).key("r"),
        ];
        let ids = store.enqueue_many(batch, T0).unwrap();
        assert_eq!(ids, vec![TaskId(1), TaskId(1), TaskId(2), TaskId(3), TaskId(3)]);
        assert_eq!(store.task(TaskId(1)).unwrap().args, json!(1), "dedupe keeps the first");
        assert_eq!(store.task(TaskId(3)).unwrap().args, json!(5), "replace takes the last");

        let claimed = claim_n(&mut store, "w", 1, 1, 1, at(1));
        assert_eq!(claimed[0].id, TaskId(1));
        assert_eq!(store.enqueue(NewTask::new("t", json!(9)).key_with_mode("d", mode), at(2)), Ok(TaskId(1)));

        let mixed = vec![NewTask::new("t", json!(1)).key("m"), NewTask::new("t", json!(1)).key_with_mode("m", mode)];
        assert_eq!(store.enqueue_many(mixed, at(3)), Err(EnqueueError::MixedKeyModes("m".into())));
        assert_eq!(store.tasks().count(), 3);
    }

    #[test]
    fn forbidden_flags_are_not_claimed() {
        let mut store = MemoryStore::new(AppConfig::default());
        let slow = add(&mut store, NewTask::new("t", json!(1)).flag("slow").flag("gpu").flag("slow"));
        let plain = add(&mut store, NewTask::new("t", json!(2)));
        assert_eq!(store.task(slow).unwrap().flags, vec!["gpu".to_owned(), "slow".to_owned()]);
        let worker = WorkerConfig { forbidden_flags: vec!["slow".into()], ..WorkerConfig::default() };
        let picky = Arc::new(ClaimPolicy::from_config(store.app(), &worker));
        assert_eq!(ids(&claim_with(&mut store, "w", 1, &picky, 0, T0)), vec![plain.0]);
        assert_eq!(ids(&claim_n(&mut store, "w", 2, 4, 0, T0)), vec![slow.0]);
        assert_eq!(
            store.enqueue(NewTask::new("t", json!(3)).flag("Bad"), T0),
            Err(EnqueueError::InvalidFlag("Bad".into()))
        );
    }

    #[test]
    fn a_serial_queue_holds_one_claim_at_a_time_in_soft_cap_mode_too() {
        let mut app = custom(vec![CustomQueue::new("s").serial(), CustomQueue::new("free")]);
        app.prefetch_buffer = 8;
        app.claim_lease_ms = Some(LEASE_MS);
        let mut store = MemoryStore::new(app);
        for n in 0..3 {
            add(&mut store, NewTask::new("t", json!(n)).queue("s"));
        }
        let policy = policy(&store, 4);
        let first = claim_with(&mut store, "a", 1, &policy, 0, T0);
        assert_eq!(ids(&first), vec![1], "one claim, though the buffer has room");
        assert!(claim_with(&mut store, "b", 2, &policy, 0, T0).is_empty(), "another worker waits for it");
        finish(&mut store, "a", lease(&first[0]), FinishOutcome::Completed(json!(0)), at(1));
        assert_eq!(ids(&claim_with(&mut store, "b", 3, &policy, 0, at(2))), vec![2], "then the next, in order");
        // A lapsed claim frees the queue.
        assert_eq!(ids(&claim_with(&mut store, "a", 4, &policy, 0, at(2 + LEASE_MS as i64))), vec![2]);
    }

    /// Regression (simulation seed 6012823): a heartbeat renewed a lapsed claim of a serial
    /// queue after another worker, counting it out, had claimed the queue's next task.
    #[test]
    fn a_lapsed_claim_is_not_renewed_by_a_late_heartbeat() {
        let mut app = custom(vec![CustomQueue::new("s").serial()]);
        app.prefetch_buffer = 8;
        app.claim_lease_ms = Some(LEASE_MS);
        let mut store = MemoryStore::new(app);
        add(&mut store, NewTask::new("t", json!(1)).queue("s"));
        let policy = policy(&store, 1);
        let first = claim_with(&mut store, "a", 1, &policy, 0, T0);
        let later = at(LEASE_MS as i64 + 1);
        store.enqueue(NewTask::new("t", json!(2)).queue("s").priority(-1), later).unwrap();
        let second = claim_with(&mut store, "b", 2, &policy, 1, later);
        assert_eq!(ids(&second), vec![2], "the lapsed claim is counted out; the urgent task goes first");
        let beat = DbRequest::Heartbeat {
            worker: w("a"),
            claimed: vec![lease(&first[0])],
            running: vec![],
            lease_ms: LEASE_MS,
            max_renew_age_ms: 10 * LEASE_MS,
            abandoned: vec![],
        };
        store.apply(&beat, later.plus_ms(1));
        assert_eq!(store.task(first[0].id).unwrap().claim_expires_at, Some(at(LEASE_MS as i64)), "not renewed");
        let reply = start(&mut store, "a", vec![lease(&first[0])], &policy, later.plus_ms(2));
        assert_eq!(started(&reply), vec![], "and it cannot start");
    }

    #[test]
    fn a_partial_failure_keeps_only_the_failed_items() {
        let mut store = MemoryStore::new(AppConfig::default());
        let id = add(&mut store, NewTask::new("batch", json!([1, 2, 3])));
        let claimed = claim_n(&mut store, "w", 1, 1, 1, T0);
        let error = TaskError::new(ErrorCode::TaskError, "2 failed");
        let completion = Completion {
            task: lease(&claimed[0]),
            outcome: FinishOutcome::Retry { error, delay_ms: 1_000 },
            args: Some(json!([2])),
        };
        store.apply(&DbRequest::Finish { worker: w("w"), completions: vec![completion] }, at(1));
        assert_eq!(store.task(id).unwrap().args, json!([2]));
        assert_eq!(store.task(id).unwrap().state, TaskState::Pending);
    }

    #[test]
    fn refused_enqueues_write_nothing() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a")]));
        let refusals = [
            NewTask::new("t", json!(1)).queue("b"),
            NewTask::new("t", json!(1)).queue("Bad-Name"),
            NewTask::new("t", json!(1)).queue("a").run_at(RunAt::DelayMs(100)).good_until(at(100)),
            NewTask::new("", json!(1)),
        ];
        assert!(matches!(store.enqueue(refusals[0].clone(), T0), Err(EnqueueError::UnknownQueue { .. })));
        assert!(matches!(store.enqueue(refusals[1].clone(), T0), Err(EnqueueError::InvalidQueueName(_))));
        assert!(matches!(store.enqueue(refusals[2].clone(), T0), Err(EnqueueError::RunAtAfterGoodUntil { .. })));
        let mut batch = vec![NewTask::new("t", json!(0))];
        batch.extend(refusals);
        assert!(store.enqueue_many(batch, T0).is_err());
        assert_eq!(store.tasks().count(), 0);
        assert!(store.take_notifications().is_empty());
        // No task means the default queue: the first queue in custom mode.
        let id = add(&mut store, NewTask::new("t", json!(1)));
        assert_eq!((id, store.get(id).unwrap().queue), (TaskId(1), "a".to_owned()));
    }

    #[test]
    fn abandon_claim_releases_exactly_that_tokens_rows() {
        let mut store = MemoryStore::new(AppConfig::default());
        for i in 0..5 {
            add(&mut store, NewTask::new("t", json!(i)));
        }
        let p = policy(&store, 2);
        assert_eq!(ids(&claim_with(&mut store, "a", 1, &p, 1, T0)), vec![1, 2]);
        let one = policy(&store, 1);
        assert_eq!(ids(&claim_with(&mut store, "a", 2, &one, 0, T0)), vec![3]);
        assert_eq!(ids(&claim_with(&mut store, "b", 1, &one, 0, T0)), vec![4]);
        store.take_notifications();
        let reply = store.apply(&DbRequest::AbandonClaim { worker: w("a"), token: 1 }, at(1));
        assert_eq!(reply, DbReply::Released { released: vec![TaskId(1), TaskId(2)], lost: vec![] });
        let states: Vec<TaskState> = (1..=5).map(|i| state(&store, TaskId(i))).collect();
        use TaskState::{Claimed, Pending};
        assert_eq!(states, vec![Pending, Pending, Claimed, Claimed, Pending]);
        let one = store.task(TaskId(1)).unwrap();
        // The claim started it, and nothing ran: the attempt goes back, the lease stays (it
        // fences whatever the claim's holder might still write).
        assert_eq!((one.attempts, one.retries, one.lease), (0, 0, Lease(1)));
        assert_eq!(one.started_at, None);
        assert_eq!(
            store.take_notifications(),
            vec![Notification::TaskReady { queue: "default".into(), priority: None }]
        );
        let again = store.apply(&DbRequest::AbandonClaim { worker: w("a"), token: 1 }, at(2));
        assert_eq!(again, DbReply::Released { released: vec![], lost: vec![] });
        assert!(store.take_notifications().is_empty());
    }

    #[test]
    fn notifications_come_one_per_statement_per_queue() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
        let batch = vec![
            NewTask::new("t", json!(1)).queue("a"),
            NewTask::new("t", json!(2)).queue("b"),
            NewTask::new("t", json!(3)).queue("a"),
            NewTask::new("t", json!(4)).queue("a"),
        ];
        store.enqueue_many(batch, T0).unwrap();
        // An enqueue announces the most urgent priority it wrote; a release announces none.
        let ready = |q: &str, priority| Notification::TaskReady { queue: q.into(), priority };
        assert_eq!(store.take_notifications(), vec![ready("a", Some(0)), ready("b", Some(0))]);
        let claimed = claim(&mut store, "w", 4, T0);
        assert!(store.take_notifications().is_empty());
        let tasks = claimed.iter().map(lease).collect();
        store.apply(&DbRequest::Release { worker: w("w"), tasks }, at(1));
        assert_eq!(store.take_notifications(), vec![ready("a", None), ready("b", None)]);
        let urgent = vec![
            NewTask::new("t", json!(5)).queue("a").priority(3),
            NewTask::new("t", json!(6)).queue("a").priority(-2),
        ];
        store.enqueue_many(urgent, at(1)).unwrap();
        assert_eq!(store.take_notifications(), vec![ready("a", Some(-2))]);
        let p = policy(&store, 4);
        let claimed = claim_with(&mut store, "w", 2, &p, 4, at(2));
        let completions = claimed
            .iter()
            .map(|t| Completion { task: lease(t), outcome: FinishOutcome::Completed(json!(t.id.0)), args: None })
            .collect();
        store.apply(&DbRequest::Finish { worker: w("w"), completions }, at(3));
        let finished: Vec<Notification> =
            claimed.iter().map(|t| Notification::TaskFinished { task: t.id, state: TaskState::Completed }).collect();
        assert_eq!(store.take_notifications(), finished);
        assert_eq!(store.get(claimed[0].id).unwrap().result, Some(json!(claimed[0].id.0)));
    }

    #[test]
    fn the_attempts_history_has_one_record_per_finished_run() {
        let mut store = MemoryStore::new(AppConfig::default());
        let first = running_task(&mut store, NewTask::new("t", json!(null)), "a", T0);
        let retry = FinishOutcome::Retry { error: err(ErrorCode::TaskTimeout), delay_ms: 1_000 };
        finish(&mut store, "a", first, retry, at(10));
        let p = policy(&store, 1);
        let second = lease(&claim_with(&mut store, "b", 3, &p, 0, at(1_010))[0]);
        // A released run writes no record, and the release spends no retry.
        assert_eq!(started(&start(&mut store, "b", vec![second], &p, at(1_011))), vec![(1, 2)]);
        let release = DbRequest::Release { worker: w("b"), tasks: vec![second] };
        assert_eq!(store.apply(&release, at(1_012)), DbReply::Released { released: vec![first.task], lost: vec![] });
        let third = lease(&claim_with(&mut store, "c", 4, &p, 1, at(1_013))[0]);
        finish(&mut store, "c", third, FinishOutcome::Completed(json!("done")), at(1_020));
        let history = store.attempts(first.task);
        type Shape = (u32, Option<WorkerId>, TaskState, Option<ErrorCode>, DbTime);
        let shape: Vec<Shape> = history
            .into_iter()
            .map(|r| (r.attempt.0, r.worker, r.outcome, r.error.map(|e| e.code), r.finished_at))
            .collect();
        assert_eq!(
            shape,
            vec![
                (1, Some(w("a")), TaskState::Pending, Some(ErrorCode::TaskTimeout), at(10)),
                (3, Some(w("c")), TaskState::Completed, None, at(1_020)),
            ]
        );
        let record = store.get(first.task).unwrap();
        assert_eq!((record.state, record.attempts, record.retries, record.error), (TaskState::Completed, 3, 1, None));
        assert_eq!(store.attempts(TaskId(77)), vec![]);
    }

    #[test]
    fn heartbeats_renew_young_claims_only_and_mark_the_worker_seen() {
        let mut store = MemoryStore::new(AppConfig::default());
        add(&mut store, NewTask::new("t", json!(null)));
        let held = lease(&claim(&mut store, "a", 1, T0)[0]);
        let beat = DbRequest::Heartbeat {
            worker: w("a"),
            claimed: vec![held],
            running: vec![],
            lease_ms: LEASE_MS,
            max_renew_age_ms: 50_000,
            abandoned: vec![],
        };
        assert_eq!(
            store.apply(&beat, at(50_000)),
            DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] }
        );
        assert_eq!(store.task(held.task).unwrap().claim_expires_at, Some(at(110_000)));
        // Too old to renew: left to lapse, yet still held.
        assert_eq!(
            store.apply(&beat, at(50_001)),
            DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] }
        );
        let row = store.task(held.task).unwrap();
        assert_eq!((row.claim_expires_at, row.heartbeat_at), (Some(at(110_000)), Some(at(50_000))));
        assert_eq!(
            store.workers(),
            vec![WorkerRecord {
                info: WorkerInfo { worker: w("a"), queues: vec![], concurrency: 0 },
                last_seen: at(50_001),
                stopped: false,
            }]
        );
        let info = WorkerInfo { worker: w("a"), queues: vec!["default".into()], concurrency: 4 };
        assert_eq!(store.apply(&DbRequest::RegisterWorker(info.clone()), at(100_002)), DbReply::Done);
        store.apply(&DbRequest::DeregisterWorker(w("a")), at(100_003));
        store.apply(&DbRequest::DeregisterWorker(w("nobody")), at(100_003));
        assert_eq!(store.workers(), vec![WorkerRecord { info, last_seen: at(100_002), stopped: true }]);
    }

    #[test]
    fn inspection_lists_filters_and_counts() {
        let mut store = MemoryStore::new(custom(vec![CustomQueue::new("a"), CustomQueue::new("b")]));
        for i in 0..3 {
            add(&mut store, NewTask::new("t", json!(i)).queue("a"));
            add(&mut store, NewTask::new("t", json!(i)).queue("b"));
        }
        store.cancel(TaskId(1), T0).unwrap();
        let filter = TaskFilter { queue: Some("a".into()), ..TaskFilter::default() };
        let listed: Vec<i64> = store.list(&filter).iter().map(|r| r.id.0).collect();
        assert_eq!(listed, vec![1, 3, 5]);
        let filter = TaskFilter { state: Some(TaskState::Pending), limit: Some(2), ..TaskFilter::default() };
        let listed: Vec<i64> = store.list(&filter).iter().map(|r| r.id.0).collect();
        assert_eq!(listed, vec![2, 3]);
        let counts = store.counts();
        assert_eq!(counts[&("a".to_owned(), TaskState::Pending)], 2);
        assert_eq!(counts[&("a".to_owned(), TaskState::Cancelled)], 1);
        assert_eq!(counts[&("b".to_owned(), TaskState::Pending)], 3);
        assert_eq!(counts.len(), 3);
    }
}
