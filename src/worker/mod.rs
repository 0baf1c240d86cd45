//! The sans-IO worker machine: it decides what a worker does and does none of it.
//!
//! A [`Worker`] holds everything one worker process knows: the tasks it claimed, which of them
//! run, the completions it has not written yet, its timers and its database backoff. It is
//! driven by inputs and drained of outputs; it never reads a clock, sleeps, spawns or talks to
//! a database. Whoever drives it (the `driver` feature's async loop, the simulation, a
//! hand-written loop) does those things and reports back.
//!
//! # The calling contract
//!
//! The [crate docs](crate#the-calling-contract) state it once: inputs, outputs, the next
//! deadline, and what every command must be answered with.
//!
//! # Layout
//!
//! This file holds the machine's inputs and outputs, its state, and the dispatch of inputs,
//! timers, replies and failures. Each concern is a file of its own, from the timer or input
//! that starts a request to the reply or failure that ends it: `claims` (passes, urgent
//! claims, notifications), `starts` (asked and unasked starts, their records), `completions`
//! (outcomes written in batches, poison ones split off), `heartbeat`, `maintenance` (reaper,
//! dead workers, purge, vacuum, registration), `waiting` (the waiting mark) and `shutdown`;
//! with `held` (the tasks held and their stages), `slots` (one request of each kind in flight,
//! or owed), `timers` (named deadlines and handler timeouts) and `flow` (the buffer's size and
//! order).
//!
//! # What it does
//!
//! - Claims with one request per pass, sized by [`ClaimPolicy::local_budget`]; claims again at
//!   once after a pass that left work behind, otherwise when a notification arrives or the poll
//!   interval passes (by deployment mode). Notifications that arrive while a claim is in
//!   flight coalesce into one more pass. A worker that listens marks itself waiting in the
//!   store when a pass leaves nothing behind (clients' enqueues notify a queue only while a
//!   worker's mark takes the task in), claims once more after a new mark, and narrows its mark
//!   to tasks more urgent than its backlog while the backlog fills its passes.
//! - Claims for its free permits, which start in the claim itself (hard-cap mode) or, where
//!   the store has nothing to check, at once (soft-cap mode), and for a buffer beyond them
//!   sized by its rate of work (`flow`): buffered tasks start, most urgent first, as permits
//!   free up. In hard-cap mode a finish and the next claim share one request.
//! - Writes completions in batches: the first at once, and while one batch is in flight the
//!   next accumulates (up to `completion_batch_max`). A handler's permit is freed when it
//!   finishes, before its completion is written (tasker's backpressure rule).
//! - Renews leases and sends liveness for everything it holds in one request per heartbeat
//!   interval; runs the reaper every check interval, and with a retention for finished tasks
//!   purges older ones every hour.
//! - Backs off on database errors (`min(max, initial·2^(n−1))·U(0.75, 1.25)`) and re-sends what
//!   was not confirmed; undoes claims whose reply never came.
//! - On shutdown stops claiming, hands buffered claims back, lets handlers finish within the
//!   grace period, then aborts the rest and returns them to Pending without spending a retry.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backoff::{self, DbBackoff};
use crate::budget::ClaimPolicy;
use crate::check::ConfigError;
use crate::config::{AppConfig, DeploymentMode, WorkerConfig};
use crate::rng::Rng;
use crate::store::{
    ClaimedTask, Completion, DEFAULT_PURGE_BATCH, DbFailure, DbReply, DbRequest, FinishOutcome, OpId, ReapReport,
    VacuumedTable, WorkerInfo, check_storable, check_storable_error, printable,
};

mod claims;
mod completions;
mod flow;
mod heartbeat;
mod held;
mod maintenance;
mod shutdown;
mod slots;
mod starts;
mod timers;
mod waiting;

use crate::task::{Attempt, DbTime, ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
pub use claims::{FLOOR_SWEEP_INTERVAL, NOTIFIED_PASS_BURST, NOTIFIED_PASSES_PER_SECOND};
use claims::{PassBound, PassBudget};
pub use completions::{MAX_FINISH_BATCH_BYTES, MAX_LONE_REFUSALS};
use completions::{Queued, own_outcome_bytes};
pub use flow::{BUFFER_WINDOW_MIN, HARD_CAP_CLAIM_AHEAD_MAX, URGENT_CLAIM_MAX};
use flow::{Buffer, ClaimFlow};
use held::{Held, HeldTasks, RUNNING, Stage};
pub use maintenance::{PURGE_INTERVAL_MS, VACUUM_CHECK_INTERVAL_MS};
use slots::Slots;
use timers::Timers;

/// How often a worker whose listener was lost polls while it reconnects (at most its
/// `poll_interval_ms`): notifications sent meanwhile are gone, and a reconnect can take a TLS
/// handshake's delayed ACKs (about 100 ms). Only for [`DEAF_FAST_POLL_FOR`] after the loss: a
/// listener that stays down is an outage, and the usual interval applies.
pub const DEAF_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// How long after losing its listener a worker polls every [`DEAF_POLL_INTERVAL`].
pub const DEAF_FAST_POLL_FOR: Duration = Duration::from_secs(2);

/// How long a worker remembers the token of a claim it abandoned, handing back with every
/// heartbeat whatever a late commit of that claim left claimed by it: longer than any
/// statement can wait to reach the server or run there (sessions carry `statement_timeout`),
/// short because every beat that names a token scans the claimed rows for it.
pub const ABANDONED_CLAIM_MEMORY: Duration = Duration::from_secs(3 * 60);

/// The first wait before trying again what another transaction's lock held up: a heartbeat's
/// `busy` rows, or a request that gave up after `lock_timeout`. It doubles while locks keep
/// holding things up, up to the heartbeat interval. A lock is not an outage: heartbeats and
/// everything else go on meanwhile.
pub const BUSY_RETRY_MIN: Duration = Duration::from_secs(1);

/// Something that happened, reported to [`Worker::handle_input`].
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// The answer to the [`Command::Db`] with this op id.
    Db {
        /// The request's op id.
        op: OpId,
        /// The store's reply, or why there is none.
        reply: Result<DbReply, DbFailure>,
    },
    /// A handler spawned by [`Command::Spawn`] returned.
    TaskFinished {
        /// The task.
        task: TaskId,
        /// The lease it ran under.
        lease: Lease,
        /// What it returned. A panic is reported as a failure with `UNHANDLED_ERROR`, undecodable
        /// arguments as `WORKER_SERIALIZATION_ERROR`, an unknown task name as
        /// `WORKER_RESOLUTION_ERROR`.
        outcome: TaskOutcome,
    },
    /// A notification said a task is ready in this queue.
    Notified {
        /// The queue.
        queue: String,
        /// The most urgent priority an enqueue announced (PostgreSQL's notification payload),
        /// if it announced one: a task more urgent than some the worker holds in its buffer is
        /// claimed at once, beside a claim already in flight.
        priority: Option<i16>,
        /// The earliest run-at among the tasks, if the announcement names it (PostgreSQL's
        /// enqueues of tasks without keys do): a pass woken only by such announcements since
        /// the last pass claims from the earliest of them on, without walking the rows before
        /// (see [`ClaimPolicy::min_run_at`]). `None` makes the next pass look at every row.
        run_at: Option<DbTime>,
    },
    /// A notification said these tasks were taken from their holders (a workflow's cancel,
    /// [`Notification::TasksRevoked`](crate::store::Notification::TasksRevoked)): if the
    /// worker holds one, it beats at once, and the beat's answer says which it lost (their
    /// handlers are aborted). The store's answer decides, not the notification.
    Revoked {
        /// The tasks.
        tasks: Vec<TaskId>,
    },
    /// The notification listener connected (`true`) or lost its connection (`false`). While it
    /// is down the worker polls even in [`DeploymentMode::EventDrivenOnly`].
    Listener {
        /// Whether it is listening now.
        connected: bool,
    },
    /// Stop gracefully.
    Shutdown,
}

/// What a handler returned.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskOutcome {
    /// A result.
    Success(serde_json::Value),
    /// An error.
    Failure(TaskError),
    /// A batch task failed for some of its items: `error` is recorded, and the task's arguments
    /// become `remaining` (the items that failed), so a retry runs only those.
    PartialFailure {
        /// The error to record.
        error: TaskError,
        /// The arguments to keep: the failed items.
        remaining: serde_json::Value,
    },
}

/// Something for the driver to do, drained with [`Worker::poll_command`]. Later versions may
/// add commands: a driver's match ends with an arm that fails loudly on one it cannot carry out.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Command {
    /// Run this database request and report the answer as [`Input::Db`] with the same op id.
    Db {
        /// Correlates the reply.
        op: OpId,
        /// What to run.
        request: DbRequest,
    },
    /// Run this task's handler and report [`Input::TaskFinished`].
    Spawn(TaskRun),
    /// Stop this handler if it still runs; its answer, if any, will be ignored.
    Abort {
        /// The task.
        task: TaskId,
        /// The lease it ran under.
        lease: Lease,
    },
}

/// A task to run, as [`Command::Spawn`] hands it over.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRun {
    /// The task.
    pub id: TaskId,
    /// The lease to report back with.
    pub lease: Lease,
    /// Which run this is (1 for the first).
    pub attempt: Attempt,
    /// The handler's registered name.
    pub name: String,
    /// The queue.
    pub queue: String,
    /// Its priority (lower runs first).
    pub priority: i16,
    /// When it was enqueued (or last replaced by a key), on the database's clock.
    pub enqueued_at: DbTime,
    /// When it became claimable, on the database's clock.
    pub run_at: DbTime,
    /// The arguments.
    pub args: serde_json::Value,
    /// When the machine will time the handler out, if it has a timeout.
    pub deadline: Option<Instant>,
}

/// Why a task left this worker's hands without this worker finishing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// A write about it found another lease or state: another worker or the reaper took it.
    LeaseLost,
    /// A re-sent completion (after an unanswered one) found it already moved, most likely by
    /// the first send.
    Unconfirmed,
}

impl std::fmt::Display for LostReason {
    /// What happened, in words, for logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::LeaseLost => "another worker or the reaper took it",
            LostReason::Unconfirmed => "a re-sent completion found it already moved",
        })
    }
}

/// Something observers may want to know, drained with [`Worker::poll_event`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// A task was claimed.
    Claimed {
        /// The task.
        task: TaskId,
        /// Its queue.
        queue: String,
    },
    /// A task's handler was spawned.
    Started {
        /// The task.
        task: TaskId,
        /// Which run.
        attempt: Attempt,
    },
    /// A task's outcome was written: Completed, Failed, or Pending for a retry.
    Finished {
        /// The task.
        task: TaskId,
        /// The state it is in now.
        state: TaskState,
    },
    /// A task expired before it could start.
    Expired {
        /// The task.
        task: TaskId,
    },
    /// A handler ran past its timeout and was aborted.
    TimedOut {
        /// The task.
        task: TaskId,
    },
    /// A task left this worker's hands.
    Lost {
        /// The task.
        task: TaskId,
        /// Why.
        reason: LostReason,
    },
    /// A database request failed; the worker waits `retry_in` before trying again.
    DbUnavailable {
        /// Failures in a row.
        failures: u32,
        /// The wait before the next try.
        retry_in: Duration,
        /// The failure.
        error: DbFailure,
    },
    /// The database answered again after failures.
    DbRecovered,
    /// The reaper changed something.
    Reaped(ReapReport),
    /// This many finished tasks past `recovery.finished_retention_ms` were deleted.
    Purged {
        /// How many.
        tasks: u64,
    },
    /// The worker's vacuum check (`recovery.vacuum_dead_rows`) vacuumed these tables.
    Vacuumed(Vec<VacuumedTable>),
    /// `db_retry_max_attempts` failures in a row: the worker is shutting down.
    GaveUp,
    /// A claimed task's row held a value the store could not read: the task fails with
    /// `WORKER_SERIALIZATION_ERROR` without running (unreadable arguments), or runs under the
    /// app's retry policy (an unreadable policy of its own).
    UnreadableRow {
        /// The task.
        task: TaskId,
        /// What could not be read, and why.
        problem: String,
    },
    /// What a handler returned could not be stored (text with U+0000, over
    /// `max_result_bytes`, nested too deep), or the database refused it: the task fails
    /// with `WORKER_SERIALIZATION_ERROR` instead.
    OutcomeRefused {
        /// The task.
        task: TaskId,
        /// Why.
        problem: String,
    },
    /// The store handed a task out under an older lease than the one this worker held (a
    /// restore from a backup, a failover to a lagging replica): the old run is dropped and
    /// the task taken as the store has it now.
    LeaseWentBack {
        /// The task.
        task: TaskId,
        /// The lease this worker held.
        held: Lease,
        /// The lease the store handed out.
        claimed: Lease,
    },
    /// The database refused a task's finish [`MAX_LONE_REFUSALS`] times, alone and with
    /// values of the worker's own: the worker drops it and leaves the task to the reaper.
    OutcomeDropped {
        /// The task.
        task: TaskId,
        /// The last refusal.
        problem: String,
    },
    /// A reaper pass did nothing: another reaper held the reaper's lock.
    ReapSkipped,
    /// Shutdown finished: nothing is held and nothing is in flight (or the database was down
    /// after the grace period and `abandoned` tasks were left to the reaper).
    Drained {
        /// Tasks left behind unwritten.
        abandoned: usize,
    },
}

/// The worker's named timers; [`Worker::poll_timeout`] says which is due next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Timer {
    /// Claim again if nothing woke the worker sooner.
    Poll,
    /// Claim again: a delayed or retried task becomes due (whatever the deployment mode).
    Wake,
    /// Renew leases and send liveness.
    Heartbeat,
    /// Run the reaper.
    Reaper,
    /// Look for dead workers by their released liveness tokens
    /// (`recovery.liveness_check_interval_ms`).
    LivenessCheck,
    /// Delete finished tasks past their retention (only with `recovery.finished_retention_ms`).
    Purge,
    /// Vacuum the hot tables that need it (only with `recovery.vacuum_dead_rows`).
    Vacuum,
    /// Try the database again after a failure.
    DbRetry,
    /// The shutdown grace period ends.
    ShutdownGrace,
    /// A handler's timeout.
    HandlerTimeout(TaskId),
    /// Tell the store about handlers started without a start request that still run.
    RecordStarts,
    /// Notifications held back by the rate of empty notified passes may claim again.
    NotifiedPass,
    /// Try again what a lock held up.
    LockRetry,
    /// While passes leave tasks more urgent than their floor to urgent claims, claim those
    /// that came unannounced (due by time, handed back): an urgent claim below the floor,
    /// [`FLOOR_SWEEP_INTERVAL`] after a pass with a floor was sent.
    FloorSweep,
}

/// What the machine knows of its own state, for health checks and gauges: a worker is ready
/// while it runs (no shutdown begun), no database outage is being waited out, and it hears of
/// new tasks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// Shutdown has begun: the worker claims nothing more.
    pub shutting_down: bool,
    /// The database backoff's step: outages in a row with no successful request since (the
    /// requests failing together in one outage count once; a lock held too long is no outage).
    pub db_failures_in_a_row: u32,
    /// Whether the LISTEN connection is up.
    pub listening: bool,
    /// Whether the poll timer runs (polling-only and hybrid modes, or a lost listener).
    pub polling: bool,
    /// Handlers running now.
    pub running: u32,
    /// Claims held that have not started (the buffer, and starts in flight).
    pub buffered: u32,
    /// The worker's concurrency.
    pub concurrency: u32,
}

impl Health {
    /// Whether the worker should receive work: it runs, no outage is being waited out, and it
    /// hears of new tasks (a listener, or polling; one of them from its first turn on).
    pub fn ready(&self) -> bool {
        !self.shutting_down && self.db_failures_in_a_row == 0 && (self.listening || self.polling)
    }
}

/// Counters an operator can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Tasks claimed.
    pub claimed: u64,
    /// Handlers spawned.
    pub started: u64,
    /// Tasks completed (written).
    pub completed: u64,
    /// Tasks failed for good (written).
    pub failed: u64,
    /// Runs that failed and will be retried (written).
    pub retried: u64,
    /// Tasks that expired at start.
    pub expired: u64,
    /// Handlers timed out.
    pub timed_out: u64,
    /// Tasks lost to another lease holder.
    pub lost: u64,
    /// Notifications that arrived while a claim was already due and added nothing.
    pub notifications_coalesced: u64,
    /// Claim requests sent.
    pub claim_passes: u64,
    /// Database failures.
    pub db_failures: u64,
    /// Reaper passes skipped because another reaper held the lock.
    pub reaps_skipped: u64,
    /// Dead workers this worker recovered the tasks of, found by their released liveness
    /// tokens.
    pub dead_workers_recovered: u64,
    /// Claim passes held back by the rate of empty notified passes.
    pub notified_passes_limited: u64,
    /// Outcomes that could not be stored, failed with `WORKER_SERIALIZATION_ERROR` instead.
    pub outcomes_refused: u64,
    /// Completions the database kept refusing, dropped and left to the reaper.
    pub outcomes_dropped: u64,
    /// Waiting marks written: each time the worker ran out of work to claim and asked to be
    /// notified of enqueues again (or its mark, deleted as stale, was written again).
    pub waiting_marks: u64,
    /// Looks at every row sent beside claim passes bounded by announcements: small claims, in
    /// claim order from the first row, at least once a poll interval.
    pub looks: u64,
}

impl std::fmt::Display for Stats {
    /// The counts people read, for logs: `claimed 3, completed 2, …`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "claimed {}, started {}, completed {}, failed {}, retried {}, expired {}, timed out {}, lost {}, \
             database failures {}",
            self.claimed,
            self.started,
            self.completed,
            self.failed,
            self.retried,
            self.expired,
            self.timed_out,
            self.lost,
            self.db_failures
        )
    }
}

/// An outstanding database request and what it was about.
#[derive(Debug, Clone)]
enum Op {
    Claim {
        token: u64,
        /// Woken by a notification only: it spent a pass of the budget when sent, which it
        /// gives back if it finds work.
        notified: bool,
        /// When it was sent: its round trip sizes the buffer.
        sent: Instant,
        /// A claim for an announced urgent task, beside the regular pass.
        urgent: bool,
    },
    Start(Vec<TaskLease>),
    RecordStarts(Vec<TaskLease>),
    Finish {
        batch: Vec<Queued>,
        /// A completion the database refused before, sent on its own (see `Worker::lone`).
        lone: bool,
    },
    /// A finish of `batch` and a claim in one request (hard-cap mode): both in flight.
    FinishAndClaim {
        batch: Vec<Queued>,
        token: u64,
        notified: bool,
        sent: Instant,
    },
    /// The leases the beat named: a loss it reports concerns those leases only.
    Heartbeat(Vec<TaskLease>),
    Release(Vec<TaskLease>),
    Abandon(u64),
    Reap,
    ReapDead,
    Purge,
    Vacuum,
    Register,
    Deregister,
    /// A waiting mark (`waiting`) or unmark.
    SetWaiting {
        waiting: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Draining { grace_over: bool },
    Stopped,
}

/// The sans-IO worker machine. The [crate docs](crate#the-calling-contract) state the calling
/// contract.
#[derive(Debug)]
pub struct Worker {
    id: WorkerId,
    app: AppConfig,
    config: WorkerConfig,
    policy: Arc<ClaimPolicy>,
    served: BTreeSet<String>,
    rng: Rng,
    now: Instant,
    next_op: u64,
    ops: BTreeMap<OpId, Op>,
    held: HeldTasks,
    /// Buffered claims, most urgent first.
    buffer: Buffer,
    /// The rate of work and the claim round trip, which size the buffer.
    flow: ClaimFlow,
    /// The policy of the last claim pass, with the buffer it was sized for.
    claim_policy: Arc<ClaimPolicy>,
    /// The regular claim pass in flight: its budget and how many it may start.
    claim_out: (u32, u32),
    /// Announcements of tasks more urgent than what the worker holds, not claimed yet: the
    /// budget of the next urgent claim.
    urgent_due: u32,
    /// The least urgent priority among them: the urgent claim takes nothing less urgent.
    urgent_bound: i16,
    /// The least urgent rank (queue priority, priority) of the last pass that took tasks: what
    /// the worker is working through when its buffer is empty.
    working_rank: Option<(u8, i16)>,
    /// A claim for it is in flight: its budget and how many it may start.
    urgent_out: Option<(u32, u32)>,
    /// The priority floor of the next regular pass, while the worker works through a backlog:
    /// the most urgent priority the last pass took, when it left more (see [`Timer::FloorSweep`]).
    pass_floor: Option<i16>,
    /// The regular pass in flight has a floor: its "more" says nothing of what is below it.
    floor_out: bool,
    /// The next pass goes without a floor: what is below it cannot wait for urgent claims (a
    /// sweep left more, an urgent claim found no room or failed).
    floor_lifted: bool,
    /// The next urgent claim sweeps below the floor.
    sweep_due: bool,
    /// The urgent claim in flight is a sweep below the floor.
    sweep_out: bool,
    /// The next urgent claim looks at every row, in claim order (once a poll interval while
    /// passes are bounded by announcements).
    look_due: bool,
    /// The urgent claim in flight is such a look.
    look_out: bool,
    /// How far back the next regular pass looks, from what asked for it since the last pass
    /// was sent.
    pass_bound: PassBound,
    /// How far back the regular pass in flight looks: what it leaves behind is in that range.
    bound_out: PassBound,
    /// When the last regular pass that looked at every row, or the last look, was sent.
    full_pass_at: Option<Instant>,
    timers: Timers,
    commands: VecDeque<Command>,
    events: VecDeque<Event>,
    /// A claim pass is wanted: a notification, the poll timer, or a pass that left work.
    more_work: bool,
    /// The last pass took nothing but saw work: only our own completions or a notification
    /// can change that before the next poll.
    cap_blocked: bool,
    /// Starts were deferred at a queue cap; retried on the next poll or completion.
    start_blocked: bool,
    /// The requests of each kind in flight, and those owed.
    slots: Slots,
    listening: bool,
    /// When the listener was lost, while it is down.
    deaf_since: Option<Instant>,
    /// Runs aborted whose answer may still come (a driver that cannot stop a handler answers
    /// anyway), and when: a claim that hands the task back under the same lease (a database
    /// gone back in time) must not start a second run that late answer would be taken for.
    aborted: BTreeMap<TaskLease, Instant>,
    /// Completions not yet sent.
    completions: VecDeque<Queued>,
    /// Hold-ups by other transactions' locks in a row: the backoff of trying again.
    busy_streak: u32,
    /// A release, an abandon, a record of starts, the registration or a waiting mark gave up on
    /// a lock: those wait for [`Timer::LockRetry`] (claims, starts, heartbeats and finishes go on).
    lock_blocked: bool,
    /// A claim gave up on a lock (a queue's claim lock): claims wait for [`Timer::LockRetry`].
    claims_held: bool,
    /// Completions the database refused (or a lock held up) alone: sent one at a time beside
    /// the batches, which they never hold up, taking turns when one is refused again.
    lone: VecDeque<Queued>,
    /// The last lone finish was refused: the next waits for [`Timer::LockRetry`].
    lone_waiting: bool,
    /// The most completions the next finish may carry: halved when the database refuses a
    /// batch, to isolate the item it refuses; doubled back after every batch that lands.
    finish_limit: usize,
    /// Claims abandoned lately, and until when each is remembered.
    abandoned: BTreeMap<u64, Instant>,
    /// The pass in flight (or due) was woken by a notification only.
    notified_pass: bool,
    /// Empty notified passes allowed now.
    pass_budget: PassBudget,
    releases: Vec<TaskLease>,
    abandons: Vec<u64>,
    registered: bool,
    /// This worker's waiting mark in the store.
    waiting: waiting::WaitingMark,
    deregister_sent: bool,
    /// Tasks shutdown gave up on after its grace period while locks held their writes up (the
    /// reaper's now): the `abandoned` count of its `Drained` event.
    given_up: usize,
    backoff: DbBackoff,
    db_down: bool,
    phase: Phase,
    stats: Stats,
}

impl Worker {
    /// A worker machine for `id` with this configuration, starting at `now`. It registers
    /// itself and claims at once.
    pub fn new(id: WorkerId, app: AppConfig, config: WorkerConfig, now: Instant) -> Result<Worker, ConfigError> {
        crate::config::validate_pair(&app, &config)?;
        let policy = Arc::new(ClaimPolicy::from_config(&app, &config));
        let claim_policy = Arc::clone(&policy);
        let served = policy.queues.iter().map(|q| q.name.clone()).collect();
        let seed = config.seed_for(&id);
        let finish_limit = config.completion_batch_max.max(1) as usize;
        let mut worker = Worker {
            id,
            app,
            config,
            policy,
            served,
            rng: Rng::new(seed),
            now,
            next_op: 1,
            ops: BTreeMap::new(),
            held: HeldTasks::default(),
            buffer: Buffer::default(),
            flow: ClaimFlow::new(now),
            claim_policy,
            claim_out: (0, 0),
            urgent_due: 0,
            urgent_bound: i16::MIN,
            working_rank: None,
            urgent_out: None,
            pass_floor: None,
            floor_out: false,
            floor_lifted: false,
            pass_bound: PassBound::Everything,
            bound_out: PassBound::Everything,
            full_pass_at: None,
            sweep_due: false,
            sweep_out: false,
            look_due: false,
            look_out: false,
            timers: Timers::default(),
            commands: VecDeque::new(),
            events: VecDeque::new(),
            more_work: true,
            cap_blocked: false,
            start_blocked: false,
            slots: Slots::default(),
            listening: false,
            deaf_since: None,
            aborted: BTreeMap::new(),
            completions: VecDeque::new(),
            busy_streak: 0,
            lock_blocked: false,
            claims_held: false,
            lone: VecDeque::new(),
            lone_waiting: false,
            finish_limit,
            abandoned: BTreeMap::new(),
            notified_pass: false,
            pass_budget: PassBudget { tokens: NOTIFIED_PASS_BURST, refilled_at: now },
            releases: Vec::new(),
            abandons: Vec::new(),
            registered: false,
            waiting: waiting::WaitingMark::default(),
            deregister_sent: false,
            given_up: 0,
            backoff: DbBackoff::new(),
            db_down: false,
            phase: Phase::Running,
            stats: Stats::default(),
        };
        worker.arm(Timer::Heartbeat, now + worker.heartbeat_interval());
        worker.arm_upkeep(now);
        worker.pump(now);
        Ok(worker)
    }

    /// This worker's id.
    pub fn id(&self) -> &WorkerId {
        &self.id
    }

    /// The claim policy this worker sends with every claim.
    pub fn policy(&self) -> &ClaimPolicy {
        &self.policy
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Handlers running now.
    pub fn running(&self) -> usize {
        self.held.count(&[RUNNING]) as usize
    }

    /// Claims held that have not started (buffered or starting).
    pub fn claimed(&self) -> usize {
        self.held.count(&[Stage::Buffered, Stage::Starting]) as usize
    }

    /// Every task this worker holds in any stage.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The tasks this worker holds with their leases (for invariant checks).
    pub fn held_leases(&self) -> impl Iterator<Item = TaskLease> + '_ {
        self.held.iter().map(|(task, held)| TaskLease { task: *task, lease: held.lease })
    }

    /// The tasks whose handlers run now, with their leases.
    #[cfg(feature = "sim")]
    pub fn running_leases(&self) -> impl Iterator<Item = TaskLease> + '_ {
        self.held
            .iter()
            .filter(|(_, t)| matches!(t.stage, Stage::Running { .. }))
            .map(|(task, held)| TaskLease { task: *task, lease: held.lease })
    }

    /// Its state for health checks and gauges.
    pub fn health(&self) -> Health {
        Health {
            shutting_down: self.phase != Phase::Running,
            db_failures_in_a_row: self.backoff.failures(),
            listening: self.listening,
            polling: self.polls(),
            running: self.running() as u32,
            buffered: self.claimed() as u32,
            concurrency: self.config.concurrency,
        }
    }

    /// Whether shutdown has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.phase != Phase::Running
    }

    /// Whether shutdown has finished: the driver can stop.
    pub fn is_stopped(&self) -> bool {
        self.phase == Phase::Stopped
    }

    /// Database failures in a row right now.
    #[cfg(feature = "sim")]
    pub fn db_failures(&self) -> u32 {
        self.backoff.failures()
    }

    /// Requests held up by locks of other transactions in a row right now.
    #[cfg(feature = "sim")]
    pub fn lock_waits(&self) -> u32 {
        self.busy_streak
    }

    /// Tasks this draining worker left to the reaper because locks of other transactions kept
    /// holding its writes up past the grace period (what its `Drained` event reports as
    /// abandoned when it deregisters).
    #[cfg(feature = "sim")]
    pub fn given_up(&self) -> usize {
        self.given_up
    }

    /// Whether the worker sends nothing more until a wake-up, a poll or a timer of its own:
    /// running, no pass wanted or held back (by a cap, which it polls for, a lock, an outage or
    /// the rate of notified passes), and no request in flight. Such a worker must not owe a
    /// look at a task a client enqueued without notifying (the simulation checks it).
    #[cfg(feature = "sim")]
    pub fn awaits_wakeup(&self) -> bool {
        self.phase == Phase::Running
            && !self.more_work
            && self.ops.is_empty()
            && !self.cap_blocked
            && !self.claims_held
            && !self.lock_blocked
            && !self.db_down
            && !self.timers.contains(Timer::NotifiedPass)
    }

    /// Whether the worker takes itself to be marked waiting in the store.
    #[cfg(feature = "sim")]
    pub fn believes_waiting_marked(&self) -> bool {
        self.waiting.marked
    }

    /// Reports something that happened. Drain the outputs afterwards.
    pub fn handle_input(&mut self, input: Input, now: Instant) {
        self.handle_inputs([input], now);
    }

    /// Reports several things that happened at once (handlers that finished together, say),
    /// then decides what to send: one claim for every slot they freed, one finish for all their
    /// outcomes, where reporting them one by one would send a request for the first alone.
    /// Drain the outputs afterwards.
    pub fn handle_inputs(&mut self, inputs: impl IntoIterator<Item = Input>, now: Instant) {
        let now = self.advance(now);
        for input in inputs {
            if self.phase == Phase::Stopped {
                return;
            }
            self.take_input(input, now);
        }
        if self.phase != Phase::Stopped {
            self.pump(now);
        }
    }

    fn take_input(&mut self, input: Input, now: Instant) {
        match input {
            Input::Db { op, reply } => self.on_db(op, reply, now),
            Input::TaskFinished { task, lease, outcome } => self.on_task_finished(task, lease, outcome),
            Input::Notified { queue, priority, run_at } => self.on_notified(&queue, priority, run_at),
            Input::Listener { connected } => {
                if connected && !self.listening {
                    // Notifications sent while the listener was down are gone: catch up (and a
                    // failover that cut the session may have taken the waiting mark).
                    self.want_pass();
                    self.cap_blocked = false;
                    self.renew_waiting();
                }
                if !connected && self.listening {
                    self.deaf_since = Some(now);
                } else if connected {
                    self.deaf_since = None;
                }
                self.listening = connected;
                if !self.polls() {
                    self.timers.remove(Timer::Poll);
                } else if self.phase == Phase::Running {
                    // Deaf: poll (soon, if the listener was just lost) until it is back.
                    let at = now + self.poll_interval(now);
                    if self.timers.get(Timer::Poll).is_none_or(|armed| armed > at) {
                        self.arm(Timer::Poll, at);
                    }
                }
            }
            Input::Revoked { tasks } => self.on_revoked(&tasks),
            Input::Shutdown => self.begin_shutdown(now),
        }
    }

    /// Handles every timer due at `now`. Early or repeated calls do nothing harmful.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.advance(now);
        if self.phase == Phase::Stopped {
            return;
        }
        for timer in self.timers.take_due(now) {
            match timer {
                Timer::Poll => {
                    self.want_pass();
                    self.cap_blocked = false;
                    self.start_blocked = false;
                    if self.polls() {
                        self.arm(Timer::Poll, now + self.poll_interval(now));
                    }
                }
                Timer::Wake => {
                    self.want_pass();
                    self.cap_blocked = false;
                    self.start_blocked = false;
                }
                Timer::Heartbeat => self.on_heartbeat_timer(now),
                Timer::Reaper | Timer::LivenessCheck | Timer::Purge | Timer::Vacuum => self.on_upkeep_timer(timer, now),
                Timer::DbRetry => self.db_down = false,
                Timer::ShutdownGrace => self.end_grace(),
                Timer::HandlerTimeout(task) => self.time_out(task),
                Timer::RecordStarts => self.slots.record.owe(),
                Timer::LockRetry => {
                    self.lock_blocked = false;
                    self.claims_held = false;
                    self.lone_waiting = false;
                }
                Timer::NotifiedPass => {
                    self.more_work = true;
                    self.notified_pass = true;
                }
                Timer::FloorSweep => self.sweep_below_floor(),
            }
        }
        self.pump(now);
    }

    /// The next deadline and its timer; `None` when nothing is scheduled (stopped).
    pub fn poll_timeout(&self) -> Option<(Instant, Timer)> {
        self.timers.next()
    }

    /// When `timer` is due, if it is armed (for drivers' diagnostics and tests).
    #[cfg(feature = "sim")]
    pub fn timer(&self, timer: Timer) -> Option<Instant> {
        self.timers.get(timer)
    }

    /// The next command for the driver.
    #[must_use]
    pub fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// The next event for observers.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Takes `now` as the time, never going back: a driver that passes an earlier instant
    /// (a contract break) gets the latest one it passed instead of a panic.
    fn advance(&mut self, now: Instant) -> Instant {
        self.now = self.now.max(now);
        self.now
    }

    fn arm(&mut self, timer: Timer, at: Instant) {
        self.timers.arm(timer, at);
    }

    /// The poll interval at `now`: [`DEAF_POLL_INTERVAL`] for a while after the listener was lost.
    fn poll_interval(&self, now: Instant) -> Duration {
        let configured = Duration::from_millis(self.config.poll_interval_ms);
        match self.deaf_since {
            Some(since) if now.saturating_duration_since(since) < DEAF_FAST_POLL_FOR => {
                configured.min(DEAF_POLL_INTERVAL)
            }
            _ => configured,
        }
    }

    /// Whether the poll timer runs: always but in event-driven mode with a live listener.
    fn polls(&self) -> bool {
        match self.config.deployment_mode {
            DeploymentMode::PollingOnly | DeploymentMode::Hybrid => true,
            DeploymentMode::EventDrivenOnly => !self.listening,
        }
    }

    /// The op id the next request sent gets: a slot marks its request in flight with it, and
    /// a claim stamps it as its token.
    fn next_op_id(&self) -> OpId {
        OpId(self.next_op)
    }

    fn send(&mut self, request: DbRequest, op: Op) {
        let id = self.next_op_id();
        self.next_op += 1;
        self.ops.insert(id, op);
        self.commands.push_back(Command::Db { op: id, request });
    }

    fn executing(&self) -> u32 {
        self.running() as u32
    }

    /// Sends whatever is due and allowed. Called after every input.
    fn pump(&mut self, now: Instant) {
        if self.phase == Phase::Stopped || self.db_down {
            self.check_drained();
            return;
        }
        self.send_register();
        self.send_waiting();
        if self.slots.heartbeat.is_due() {
            self.send_heartbeat();
        }
        self.finish_and_claim(now);
        self.flush_completions();
        self.flush_lone();
        if !self.lock_blocked {
            for token in std::mem::take(&mut self.abandons) {
                self.send(DbRequest::AbandonClaim { worker: self.id.clone(), token }, Op::Abandon(token));
            }
            if !self.releases.is_empty() {
                let tasks = std::mem::take(&mut self.releases);
                self.send(DbRequest::Release { worker: self.id.clone(), tasks: tasks.clone() }, Op::Release(tasks));
            }
            if self.slots.record.is_due() {
                self.send_record_starts();
            }
        }
        self.start_buffered(now);
        self.claim(now);
        self.claim_urgent();
        self.check_drained();
    }

    fn on_db(&mut self, op: OpId, reply: Result<DbReply, DbFailure>, now: Instant) {
        let Some(kind) = self.ops.remove(&op) else {
            return; // a stale or duplicated reply
        };
        match reply {
            Ok(reply) => {
                if self.backoff.failures() > 0 {
                    self.backoff.on_success();
                    self.events.push_back(Event::DbRecovered);
                }
                self.on_reply(kind, reply);
            }
            Err(failure) => self.on_failure(kind, failure, now),
        }
    }

    fn on_reply(&mut self, op: Op, reply: DbReply) {
        match (op, reply) {
            (Op::FinishAndClaim { batch, token, notified, sent }, reply @ DbReply::FinishedAndClaimed { .. }) => {
                let (finished, claimed) = reply.into_finished_and_claimed();
                self.on_reply(Op::Finish { batch, lone: false }, finished);
                if let Some(claimed) = claimed {
                    self.on_reply(Op::Claim { token, notified, sent, urgent: false }, claimed);
                }
            }
            (Op::Claim { urgent: true, token, .. }, DbReply::Claimed { tasks, more, .. }) => {
                self.on_urgent_claimed(tasks, more, token)
            }
            (Op::Claim { notified, sent, token, .. }, DbReply::Claimed { tasks, more, next_run_in_ms }) => {
                self.on_pass_claimed(notified, sent, token, tasks, more, next_run_in_ms)
            }
            (Op::Start(sent), DbReply::Started { started, expired, deferred, lost }) => {
                self.on_start_answered(sent, started, expired, deferred, lost)
            }
            (Op::RecordStarts(sent), DbReply::Started { started, expired, deferred, lost }) => {
                self.on_starts_recorded(sent, started, expired, deferred, lost)
            }
            (Op::Finish { batch, lone }, DbReply::Finished { applied, lost }) => {
                self.on_finished(batch, lone, applied, lost)
            }
            (Op::Heartbeat(sent), DbReply::Heartbeat { lost, busy, handed_back: _ }) => {
                self.on_heartbeat(sent, lost, busy)
            }
            (Op::Release(_) | Op::Abandon(_), DbReply::Released { released, lost }) => self.on_released(released, lost),
            (Op::Reap, DbReply::Reaped(report)) => self.on_reaped(report),
            (Op::ReapDead, DbReply::Reaped(report)) => self.on_dead_reaped(report),
            (Op::Purge, DbReply::Purged { tasks }) => self.on_purged(tasks),
            (Op::Vacuum, DbReply::Vacuumed { tables }) => self.on_vacuumed(tables),
            (Op::Register, DbReply::Done) => self.on_registered(),
            (Op::Deregister, DbReply::Done) => self.stop(self.given_up),
            (Op::SetWaiting { waiting }, DbReply::WaitingSet { written }) => self.on_waiting_set(waiting, written),
            (op, reply) => {
                // A store that answers a request with another request's reply breaks its
                // contract: count it as a refusal and try again later.
                let failure = DbFailure::Rejected(format!("a {} reply to a {op:?} request", reply.kind()));
                self.on_failure(op, failure, self.now);
            }
        }
    }

    /// Drops every unwritten completion of `task`.
    fn forget_writes(&mut self, task: TaskId) {
        self.completions.retain(|q| q.completion.task.task != task);
        self.lone.retain(|q| q.completion.task.task != task);
    }

    /// Arms the lock retry (once), backing off while locks keep holding things up.
    fn hold_up(&mut self, now: Instant) {
        if !self.timers.contains(Timer::LockRetry) {
            let at = now + self.busy_delay();
            self.arm(Timer::LockRetry, at);
        }
        self.busy_streak = self.busy_streak.saturating_add(1);
    }

    /// How long to wait before trying again what locks held up: doubling from
    /// [`BUSY_RETRY_MIN`] with each hold-up in a row, at most a heartbeat interval.
    fn busy_delay(&self) -> Duration {
        let doubled = BUSY_RETRY_MIN.saturating_mul(1u32 << self.busy_streak.min(16));
        doubled.min(self.heartbeat_interval()).max(BUSY_RETRY_MIN)
    }

    fn time_out(&mut self, task: TaskId) {
        let Some(held) = self.held.get(&task) else { return };
        if !matches!(held.stage, Stage::Running { .. }) {
            return;
        }
        let lease = held.lease;
        let timeout = self.config.handler_timeout_ms.unwrap_or_default();
        self.abort(task, lease);
        self.stats.timed_out += 1;
        self.events.push_back(Event::TimedOut { task });
        let error = TaskError::new(ErrorCode::TaskTimeout, format!("handler ran past its timeout of {timeout} ms"));
        let outcome = self.failure_outcome(task, error);
        let bytes = own_outcome_bytes(&outcome);
        self.finish(task, outcome, None, bytes);
    }

    /// Tells the driver to abort the handler of `task` under `lease`, and remembers the run for
    /// a while: its answer may still come (see `aborted`).
    fn abort(&mut self, task: TaskId, lease: Lease) {
        self.commands.push_back(Command::Abort { task, lease });
        let now = self.now;
        self.aborted.retain(|_, at| now.saturating_duration_since(*at) < ABANDONED_CLAIM_MEMORY);
        self.aborted.insert(TaskLease { task, lease }, now);
    }

    /// Whether the run of `task` under `lease` was aborted and its answer may still come.
    fn aborted_run(&self, task: TaskId, lease: Lease) -> bool {
        self.aborted.contains_key(&TaskLease { task, lease })
    }

    /// Drops a task that is no longer ours under `lease`, aborting its handler if it runs. A
    /// loss reported for another lease than the one held now (an older one) changes nothing.
    fn lose(&mut self, TaskLease { task, lease }: TaskLease, reason: LostReason) {
        if self.held.get(&task).is_none_or(|held| held.lease != lease) {
            return;
        }
        let Some(held) = self.held.remove(&task) else { return };
        if matches!(held.stage, Stage::Running { .. }) {
            self.abort(task, held.lease);
        }
        self.timers.remove(Timer::HandlerTimeout(task));
        self.buffer.remove(task);
        self.forget_writes(task);
        self.stats.lost += 1;
        self.events.push_back(Event::Lost { task, reason });
    }

    fn on_failure(&mut self, op: Op, failure: DbFailure, now: Instant) {
        self.stats.db_failures += 1;
        let unknown = matches!(failure, DbFailure::Unknown(_));
        // A lock another transaction held too long: not an outage, so no backoff of everything.
        let lock = matches!(failure, DbFailure::LockTimeout(_));
        let handled = match op {
            Op::FinishAndClaim { batch, token, .. } => {
                // Both parts failed together. A lock or a refusal is the finish's: its rows are
                // what the statement locks or writes values into.
                self.claim_failed(token, unknown, false, now);
                self.finish_failed(batch, false, &failure, unknown, now)
            }
            Op::Claim { token, urgent, .. } => self.claim_pass_failed(token, urgent, unknown, lock, now),
            Op::Start(tasks) => self.start_failed(tasks, lock),
            Op::Finish { batch, lone } => self.finish_failed(batch, lone, &failure, unknown, now),
            Op::Heartbeat(_) => self.heartbeat_failed(lock, now),
            Op::RecordStarts(_) => self.record_failed(),
            Op::Release(tasks) => {
                self.releases.extend(tasks);
                false
            }
            Op::Abandon(token) => {
                self.abandons.push(token);
                false
            }
            Op::Reap => self.reap_failed(lock),
            Op::ReapDead => self.reap_dead_failed(lock),
            Op::Purge => self.purge_failed(lock),
            Op::Vacuum => self.vacuum_failed(),
            Op::Register => {
                self.slots.register.answered();
                false
            }
            Op::SetWaiting { waiting } => {
                self.waiting_failed(waiting);
                false
            }
            Op::Deregister => {
                // Not worth waiting for: the registry marks silent workers dead anyway.
                self.stop(self.given_up);
                true
            }
        };
        if handled {
            return;
        }
        if lock {
            // A release, an abandon, a record of starts, the registration or a waiting mark:
            // those wait.
            self.lock_blocked = true;
            self.hold_up(now);
            return;
        }
        // An outage ends a run of hold-ups: nothing says the locks of before still hold (and
        // shutdown gives up on writes only while they do).
        self.busy_streak = 0;
        if self.db_down {
            // Other requests in flight when the database went away fail too: one outage,
            // one step of backoff.
            return;
        }
        let delay = self.backoff.on_failure(&self.app.resilience, &mut self.rng);
        self.db_down = true;
        self.arm(Timer::DbRetry, now + delay);
        self.events.push_back(Event::DbUnavailable {
            failures: self.backoff.failures(),
            retry_in: delay,
            error: failure,
        });
        if self.backoff.exhausted(&self.app.resilience) && self.phase == Phase::Running {
            self.events.push_back(Event::GaveUp);
            self.begin_shutdown(now);
        }
    }
}

/// The task leases a request named, looked up while its reply is handled: a reply names up
/// to a whole batch of tasks, so a scan of the request per task would be quadratic.
struct SentLeases(BTreeSet<TaskLease>);

impl SentLeases {
    fn new(sent: impl IntoIterator<Item = TaskLease>) -> SentLeases {
        SentLeases(sent.into_iter().collect())
    }

    fn contains(&self, lease: TaskLease) -> bool {
        self.0.contains(&lease)
    }

    /// The lease named for `task` (start, record and heartbeat requests name each task once),
    /// or `Lease(-1)`, which no task holds.
    fn lease_of(&self, task: TaskId) -> Lease {
        self.0
            .range(TaskLease { task, lease: Lease(i64::MIN) }..)
            .next()
            .filter(|t| t.task == task)
            .map_or(Lease(-1), |t| t.lease)
    }
}
