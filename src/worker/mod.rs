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
//! # What it does
//!
//! - Claims with one request per pass, sized by [`ClaimPolicy::local_budget`]; claims again at
//!   once after a pass that left work behind, otherwise when a notification arrives or the poll
//!   interval passes (by deployment mode). Notifications that arrive while a claim is in
//!   flight coalesce into one more pass.
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

mod flow;
mod held;
mod slots;
mod timers;

use crate::task::{Attempt, DbTime, ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
pub use flow::{BUFFER_WINDOW_MIN, HARD_CAP_CLAIM_AHEAD_MAX, URGENT_CLAIM_MAX};
use flow::{Buffer, ClaimFlow};
use held::{Held, HeldTasks, RUNNING, Stage};
use slots::Slots;
use timers::Timers;

/// After the shutdown grace period, this many database failures in a row stop a draining
/// worker and leave what it still holds to the reaper.
const SHUTDOWN_DB_FAILURES: u32 = 3;

/// How often a worker purges finished tasks past `recovery.finished_retention_ms`: an hour.
pub const PURGE_INTERVAL_MS: u64 = 3_600_000;

/// How often a worker checks whether the hot tables need its vacuum
/// (`recovery.vacuum_dead_rows`): a check is one read of the table statistics.
pub const VACUUM_CHECK_INTERVAL_MS: u64 = 10_000;

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

/// The most bytes of outcomes (results, errors, new arguments; as [`check_storable`] counts
/// them) one finish request carries: a batch of large results is cut short of it, though a
/// single completion goes alone whatever its size.
pub const MAX_FINISH_BATCH_BYTES: u64 = 64 * 1024 * 1024;

/// A completion the database refuses alone this many times (other than for a lock) is
/// dropped: the worker stops renewing its task and leaves it to the reaper, rather than
/// sending it forever.
pub const MAX_LONE_REFUSALS: u32 = 8;

/// Claim passes woken by a notification that came back empty may run this many times in a
/// burst, and then [`NOTIFIED_PASSES_PER_SECOND`] a second: a flood of notifications (anyone
/// who can connect can send them) costs a bounded number of claims.
pub const NOTIFIED_PASS_BURST: u32 = 20;

/// The rate empty notified passes may keep up once their burst is spent.
pub const NOTIFIED_PASSES_PER_SECOND: u32 = 20;

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
}

/// A claim pass about to be sent: its token (the op id it goes out under), whether a
/// notification woke it, and the counts it claims for.
struct ClaimPass {
    token: u64,
    notified: bool,
    running: u32,
    claimed: u32,
    start_now: u32,
    /// The worker's policy with the buffer sized for this pass.
    policy: Arc<ClaimPolicy>,
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
}

/// A completion waiting to be written.
#[derive(Debug, Clone)]
struct Queued {
    completion: Completion,
    /// A re-send after an unknown reply: a loss it meets was most likely its own first send.
    resent: bool,
    /// Already rewritten after the database refused its values: refused again, it is not the
    /// values.
    sanitized: bool,
    /// Its outcome's size, as [`check_storable`] counts it: what batches are cut by.
    bytes: u64,
    /// Refusals of it alone so far (locks aside): at [`MAX_LONE_REFUSALS`] it is dropped.
    refusals: u32,
}

impl Queued {
    fn new(completion: Completion, bytes: u64) -> Queued {
        Queued { completion, resent: false, sanitized: false, bytes, refusals: 0 }
    }
}

/// A token bucket of empty notified claim passes (see [`NOTIFIED_PASS_BURST`]).
#[derive(Debug, Clone, Copy)]
struct PassBudget {
    tokens: u32,
    /// When the last token was added (or the bucket was full).
    refilled_at: Instant,
}

impl PassBudget {
    fn refill(&mut self, now: Instant) {
        let per_token = Duration::from_secs(1) / NOTIFIED_PASSES_PER_SECOND;
        while self.tokens < NOTIFIED_PASS_BURST {
            let Some(next) = self.refilled_at.checked_add(per_token) else { break };
            if next > now {
                return;
            }
            self.tokens += 1;
            self.refilled_at = next;
        }
        self.refilled_at = now;
    }

    /// When the next token comes, if the bucket is empty.
    fn next_token_at(&self) -> Option<Instant> {
        (self.tokens == 0).then(|| self.refilled_at + Duration::from_secs(1) / NOTIFIED_PASSES_PER_SECOND)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Draining { grace_over: bool },
    Stopped,
}

/// The sans-IO worker machine. See the [module docs](self) for the calling contract.
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
    /// Completions not yet sent.
    completions: VecDeque<Queued>,
    /// Hold-ups by other transactions' locks in a row: the backoff of trying again.
    busy_streak: u32,
    /// A release, an abandon, a record of starts or the registration gave up on a lock: those
    /// wait for [`Timer::LockRetry`] (claims, starts, heartbeats and finishes go on).
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
            timers: Timers::default(),
            commands: VecDeque::new(),
            events: VecDeque::new(),
            more_work: true,
            cap_blocked: false,
            start_blocked: false,
            slots: Slots::default(),
            listening: false,
            deaf_since: None,
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
            deregister_sent: false,
            given_up: 0,
            backoff: DbBackoff::new(),
            db_down: false,
            phase: Phase::Running,
            stats: Stats::default(),
        };
        worker.arm(Timer::Heartbeat, now + worker.heartbeat_interval());
        // The first reap comes after a random part of the interval so that workers started
        // together do not reap together.
        let check = worker.app.recovery.check_interval_ms;
        let first_reap = worker.rng.range(check / 10, check + 1);
        worker.arm(Timer::Reaper, now + Duration::from_millis(first_reap));
        if worker.app.recovery.auto_recover_dead_workers {
            let every = worker.app.recovery.liveness_check_interval_ms;
            let first = worker.rng.range(every / 10, every + 1);
            worker.arm(Timer::LivenessCheck, now + Duration::from_millis(first));
        }
        if worker.app.recovery.finished_retention_ms.is_some() {
            // Spread like the reaper; each worker purges (concurrent purges skip each other's
            // rows), so retention holds while any worker runs.
            let first_purge = worker.rng.range(PURGE_INTERVAL_MS / 10, PURGE_INTERVAL_MS + 1);
            worker.arm(Timer::Purge, now + Duration::from_millis(first_purge));
        }
        if worker.app.recovery.vacuum_dead_rows.is_some() {
            // Spread by the worker's name rather than its random stream, which the rest of
            // the machine's choices (and the simulation's recorded seeds) follow.
            let spread = worker.id.0.bytes().fold(0, |h, b| crate::rng::mix(h ^ u64::from(b)));
            let first = VACUUM_CHECK_INTERVAL_MS / 10 + spread % (VACUUM_CHECK_INTERVAL_MS * 9 / 10 + 1);
            worker.arm(Timer::Vacuum, now + Duration::from_millis(first));
        }
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
            Input::Notified { queue, priority } => self.on_notified(&queue, priority),
            Input::Listener { connected } => {
                if connected && !self.listening {
                    // Notifications sent while the listener was down are gone: catch up.
                    self.want_pass();
                    self.cap_blocked = false;
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
                Timer::Heartbeat => {
                    // Owed until sent: a beat skipped by an outage goes out once the database
                    // answers again, not an interval later.
                    self.slots.heartbeat.owe();
                    self.arm(Timer::Heartbeat, now + self.heartbeat_interval());
                }
                Timer::Reaper => {
                    self.send_reap();
                    self.arm(Timer::Reaper, now + Duration::from_millis(self.app.recovery.check_interval_ms));
                }
                Timer::LivenessCheck => {
                    self.send_reap_dead();
                    let every = self.app.recovery.liveness_check_interval_ms;
                    self.arm(Timer::LivenessCheck, now + Duration::from_millis(every));
                }
                Timer::Purge => {
                    self.send_purge();
                    self.arm(Timer::Purge, now + Duration::from_millis(PURGE_INTERVAL_MS));
                }
                Timer::Vacuum => {
                    self.send_vacuum();
                    self.arm(Timer::Vacuum, now + Duration::from_millis(VACUUM_CHECK_INTERVAL_MS));
                }
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

    fn heartbeat_interval(&self) -> Duration {
        let r = &self.app.recovery;
        Duration::from_millis(r.claimer_heartbeat_interval_ms.min(r.runner_heartbeat_interval_ms))
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

    /// A claim pass is wanted for a reason other than a notification.
    fn want_pass(&mut self) {
        self.more_work = true;
        self.notified_pass = false;
    }

    fn send(&mut self, request: DbRequest, op: Op) {
        let id = OpId(self.next_op);
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
        if !self.registered && !self.slots.register.is_out() && !self.lock_blocked {
            self.slots.register.sending(OpId(self.next_op));
            let info = WorkerInfo {
                worker: self.id.clone(),
                queues: self.policy.queues.iter().map(|q| q.name.clone()).collect(),
                concurrency: self.config.concurrency,
            };
            self.send(DbRequest::RegisterWorker(info), Op::Register);
        }
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

    fn flush_completions(&mut self) {
        if let Some(batch) = self.take_finish_batch() {
            self.send_finish(batch, false);
        }
    }

    /// The next batch of completions to finish, marked in flight; `None` while one is out or
    /// none waits. At most `completion_batch_max`, the refusal limit and (after the first)
    /// [`MAX_FINISH_BATCH_BYTES`].
    fn take_finish_batch(&mut self) -> Option<Vec<Queued>> {
        if self.slots.finish.is_out() || self.completions.is_empty() {
            return None;
        }
        let most = self.completions.len().min(self.config.completion_batch_max as usize).min(self.finish_limit.max(1));
        let (mut n, mut bytes) = (0, 0u64);
        for queued in self.completions.iter().take(most) {
            bytes = bytes.saturating_add(queued.bytes);
            if n > 0 && bytes > MAX_FINISH_BATCH_BYTES {
                break;
            }
            n += 1;
        }
        self.slots.finish.sending(OpId(self.next_op));
        Some(self.completions.drain(..n).collect())
    }

    /// In hard-cap mode, when a claim is due and completions wait, one request finishes them
    /// and claims: the claim refills the slots the finish frees, in the same round trip.
    fn finish_and_claim(&mut self, now: Instant) {
        if !self.app.is_hard_cap_mode() || self.slots.finish.is_out() || self.completions.is_empty() {
            return;
        }
        let Some(claim) = self.begin_claim(now) else { return };
        // Checked above: a batch waits and none is in flight.
        let batch = self.take_finish_batch().unwrap_or_default();
        let completions: Vec<Completion> = batch.iter().map(|q| q.completion.clone()).collect();
        let request = DbRequest::FinishAndClaim {
            worker: self.id.clone(),
            completions,
            token: claim.token,
            policy: claim.policy,
            my_running: claim.running,
            my_claimed: claim.claimed,
            start_now: claim.start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::FinishAndClaim { batch, token: claim.token, notified: claim.notified, sent });
    }

    /// Sends the next lone completion, unless one is out or the last was refused.
    fn flush_lone(&mut self) {
        if self.slots.lone.is_out() || self.lone_waiting {
            return;
        }
        let Some(queued) = self.lone.pop_front() else { return };
        self.slots.lone.sending(OpId(self.next_op));
        self.send_finish(vec![queued], true);
    }

    fn send_finish(&mut self, batch: Vec<Queued>, lone: bool) {
        let completions: Vec<Completion> = batch.iter().map(|q| q.completion.clone()).collect();
        self.send(DbRequest::Finish { worker: self.id.clone(), completions }, Op::Finish { batch, lone });
    }

    /// Whether something waits for [`Timer::LockRetry`]: the hold-ups in a row go on counting.
    fn held_up(&self) -> bool {
        self.lock_blocked || self.claims_held || self.lone_waiting
    }

    /// Starts buffered tasks while permits are free: without asking where the store would
    /// check nothing (see [`Worker::starts_unasked`]), else with one start request at a time.
    fn start_buffered(&mut self, now: Instant) {
        if self.phase != Phase::Running || self.buffer.is_empty() {
            return;
        }
        let starting = self.held.count(&[Stage::Starting]);
        // Slots the claims in flight start tasks in are taken already.
        let reserved =
            if self.slots.claim.is_out() { self.claim_out.1 } else { 0 } + self.urgent_out.map_or(0, |(_, s)| s);
        let mut free = self.config.concurrency.saturating_sub(self.executing() + starting + reserved);
        let may_ask = !self.slots.start.is_out() && !self.start_blocked;
        let mut ask = Vec::new();
        let mut kept = VecDeque::new();
        while free > 0 {
            let Some(id) = self.buffer.pop() else { break };
            // A buffered task is held; one the store handed out again under the same lease (a
            // failover) may have been written off meanwhile: it is simply gone.
            let Some(held) = self.held.get_mut(&id).filter(|held| held.stage == Stage::Buffered) else { continue };
            if Self::starts_unasked(&self.policy, held) {
                held.unrecorded = true;
                let attempt = held.attempt;
                self.on_started(id, attempt);
                if !self.timers.contains(Timer::RecordStarts) && !self.slots.record.is_due() {
                    self.arm(Timer::RecordStarts, now + self.record_starts_after());
                }
            } else if may_ask {
                ask.push(TaskLease { task: id, lease: held.lease });
                self.held.set_stage(&id, Stage::Starting);
            } else {
                kept.push_back(id);
                continue;
            }
            free -= 1;
        }
        while let Some(id) = kept.pop_back() {
            self.buffer_task(id, true);
        }
        if !ask.is_empty() {
            self.slots.start.sending(OpId(self.next_op));
            let request = DbRequest::Start { worker: self.id.clone(), tasks: ask.clone(), policy: self.policy.clone() };
            self.send(request, Op::Start(ask));
        }
    }

    /// Whether a claimed task may start without a start request: a start checks the claim
    /// lease (which heartbeats keep), good-until and the caps (soft-cap mode checks them at
    /// start; hard-cap mode counts a claim while its lease is live). With no good-until and no
    /// cap there is nothing to ask, so the handler starts at once and
    /// the store learns of it from the finish, or from [`DbRequest::RecordStarts`] if the
    /// handler is still running [`Worker::record_starts_after`] later.
    fn starts_unasked(policy: &ClaimPolicy, held: &Held) -> bool {
        // Under a cap a start must ask: in soft-cap mode the cap is checked at start; in
        // hard-cap mode the claim counts against it only while its lease is live, which the
        // start request checks on the store's clock (a buffered claim may have lapsed).
        let uncapped = policy.queues.iter().find(|q| q.name == held.queue).is_some_and(|q| q.max_concurrency.is_none());
        !held.expires && uncapped && (!policy.hard_cap_mode() || policy.cluster_wide_cap.is_none())
    }

    /// How long a handler started unasked may run before its start is recorded: a quarter of
    /// the claim lease, at most a second, so the claim never lapses and short tasks never need
    /// the write.
    fn record_starts_after(&self) -> Duration {
        Duration::from_millis((self.app.effective_claim_lease_ms() / 4).clamp(1, 1_000))
    }

    fn send_record_starts(&mut self) {
        if self.slots.record.is_out() || self.db_down || self.phase == Phase::Stopped {
            return;
        }
        self.slots.record.settle();
        let tasks: Vec<TaskLease> = self
            .held
            .iter()
            .filter(|(_, held)| held.unrecorded && matches!(held.stage, Stage::Running { .. }))
            .map(|(id, held)| TaskLease { task: *id, lease: held.lease })
            .collect();
        if tasks.is_empty() {
            return;
        }
        self.slots.record.sending(OpId(self.next_op));
        self.send(DbRequest::RecordStarts { worker: self.id.clone(), tasks: tasks.clone() }, Op::RecordStarts(tasks));
    }

    fn claim(&mut self, now: Instant) {
        let Some(claim) = self.begin_claim(now) else { return };
        let request = DbRequest::Claim {
            worker: self.id.clone(),
            token: claim.token,
            policy: claim.policy,
            my_running: claim.running,
            my_claimed: claim.claimed,
            start_now: claim.start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::Claim { token: claim.token, notified: claim.notified, sent, urgent: false });
    }

    /// Starts a claim pass if one is due and there is room: the pass is in flight from here
    /// (the caller sends it, alone or with a finish). `None` when no pass goes now.
    fn begin_claim(&mut self, now: Instant) -> Option<ClaimPass> {
        if self.phase != Phase::Running || self.slots.claim.is_out() || self.claims_held || !self.more_work {
            return None;
        }
        // An urgent claim in flight may bring what it asked for: counted as held already.
        let (urgent_budget, urgent_start) = self.urgent_out.unwrap_or((0, 0));
        let running = self.executing() + urgent_start;
        let claimed = self.claimed() as u32 + urgent_budget.saturating_sub(urgent_start);
        let policy = self.sized_policy();
        let budget = policy.local_budget(running, claimed);
        if budget == 0 {
            return None; // a freed permit calls pump again
        }
        let start_now = self.config.concurrency.saturating_sub(running + claimed);
        self.claim_out = (budget, start_now.min(budget));
        self.more_work = false;
        self.slots.claim.sending(OpId(self.next_op));
        self.stats.claim_passes += 1;
        // The request's op id: sent next.
        let token = self.next_op;
        let notified = std::mem::take(&mut self.notified_pass);
        if notified {
            // Spent when sent (a pass in flight holds its token), given back if it finds work.
            self.pass_budget.refill(now);
            self.pass_budget.tokens = self.pass_budget.tokens.saturating_sub(1);
        }
        if self.polls() {
            self.arm(Timer::Poll, now + self.poll_interval(now));
        }
        Some(ClaimPass { token, notified, running, claimed, start_now, policy })
    }

    /// A task announced more urgent than some in the buffer is claimed at once by a small claim
    /// of its own, beside a pass in flight or while the buffer is full (at most [`URGENT_CLAIM_MAX`], within the
    /// worker's largest buffer, and starting only what the pass in flight leaves room for): it
    /// then starts before the buffer, instead of waiting for the pass in flight and the next.
    fn claim_urgent(&mut self) {
        // Called after the regular pass had its chance: if none is in flight, none could go
        // (the buffer is full, or passes are held back), and none comes before a slot frees.
        if self.urgent_due == 0 || self.urgent_out.is_some() || self.phase != Phase::Running || self.claims_held {
            return;
        }
        let hard = self.policy.hard_cap_mode();
        let (out_budget, out_start) = self.claim_out;
        let (running, claimed) = (self.executing(), self.claimed() as u32);
        let most = self.config.concurrency + if hard { HARD_CAP_CLAIM_AHEAD_MAX } else { self.policy.prefetch_buffer };
        let mut room = most.saturating_sub(running + claimed + out_budget);
        if self.policy.max_claim_per_worker > 0 {
            // What the pass in flight brings counts against the worker's most live claims.
            room = room.min(self.policy.max_claim_per_worker.saturating_sub(claimed + out_budget));
        }
        // As many as were announced: the claim takes the most urgent first.
        let budget = URGENT_CLAIM_MAX.min(self.urgent_due).min(room);
        if budget == 0 {
            return; // due still: asked once the pass in flight is back
        }
        self.urgent_due = 0;
        let start_now = self.config.concurrency.saturating_sub(running + claimed + out_start).min(budget);
        // The store sees this worker's held tasks only: it may take `budget`, no more.
        let mut policy = (*self.policy).clone();
        let extra = (running + claimed + budget).saturating_sub(self.config.concurrency);
        if hard {
            policy.claim_ahead = extra;
        } else {
            policy.prefetch_buffer = extra.max(1);
        }
        let cap = claimed + budget;
        policy.max_claim_per_worker =
            if policy.max_claim_per_worker > 0 { policy.max_claim_per_worker.min(cap) } else { cap };
        // Only tasks as urgent as those announced: a few rows, not the ones the pass holds.
        policy.max_priority = Some(self.urgent_bound);
        self.urgent_out = Some((budget, start_now));
        let token = self.next_op;
        let request = DbRequest::Claim {
            worker: self.id.clone(),
            token,
            policy: Arc::new(policy),
            my_running: running,
            my_claimed: claimed,
            start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::Claim { token, notified: false, sent, urgent: true });
    }

    /// The policy to claim with now: the buffer (the prefetch buffer in soft-cap mode, the
    /// claims ahead in hard-cap mode) sized by [`ClaimFlow::buffer`] for the work this worker
    /// does, up to its maximum.
    fn sized_policy(&mut self) -> Arc<ClaimPolicy> {
        let hard = self.policy.hard_cap_mode();
        // Room is left for a claim of an urgent task beside the buffer (`claim_urgent`).
        let (current, floor, max) = if hard {
            (self.claim_policy.claim_ahead, 0, HARD_CAP_CLAIM_AHEAD_MAX - URGENT_CLAIM_MAX)
        } else {
            // At least 1: a buffer of 0 would be hard-cap mode.
            let max = self.policy.prefetch_buffer.saturating_sub(URGENT_CLAIM_MAX).max(1);
            (self.claim_policy.prefetch_buffer, 1, max)
        };
        let buffer = self.flow.buffer(self.now, floor, max);
        if buffer != current {
            let mut policy = (*self.policy).clone();
            if hard {
                policy.claim_ahead = buffer;
            } else {
                policy.prefetch_buffer = buffer;
            }
            self.claim_policy = Arc::new(policy);
        }
        Arc::clone(&self.claim_policy)
    }

    fn send_heartbeat(&mut self) {
        if self.slots.heartbeat.is_out() || self.db_down || self.phase == Phase::Stopped {
            return;
        }
        self.slots.heartbeat.settle();
        let mut claimed = Vec::new();
        let mut running = Vec::new();
        let sent: Vec<TaskLease> = self.held_leases().collect();
        for (id, held) in self.held.iter() {
            let lease = TaskLease { task: *id, lease: held.lease };
            match held.stage {
                // Claimed in the database: renew the claim (an unrecorded start runs on it).
                _ if held.unrecorded => claimed.push(lease),
                Stage::Buffered | Stage::Starting => claimed.push(lease),
                // Finishing and releasing tasks are still Running in the database until their
                // write lands: keep them alive so the reaper does not take them meanwhile.
                Stage::Running { .. } | Stage::Finishing | Stage::Releasing => running.push(lease),
            }
        }
        self.slots.heartbeat.sending(OpId(self.next_op));
        let now = self.now;
        self.abandoned.retain(|_, until| *until > now);
        let request = DbRequest::Heartbeat {
            worker: self.id.clone(),
            claimed,
            running,
            lease_ms: self.app.effective_claim_lease_ms(),
            max_renew_age_ms: self.app.max_claim_renew_age_ms,
            abandoned: self.abandoned.keys().copied().collect(),
        };
        self.send(request, Op::Heartbeat(sent));
    }

    fn send_reap(&mut self) {
        if self.slots.reap.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        let recovery = &self.app.recovery;
        let request = DbRequest::Reap {
            worker: self.id.clone(),
            claimed_stale_ms: recovery.auto_requeue_stale_claimed.then_some(recovery.claimed_stale_threshold_ms),
            running_stale_ms: recovery.auto_fail_stale_running.then_some(recovery.running_stale_threshold_ms),
            entropy: self.rng.next_u64(),
        };
        self.slots.reap.sending(OpId(self.next_op));
        self.send(request, Op::Reap);
    }

    /// Skipped (until the next interval) while one is in flight, the database is down or the
    /// worker drains.
    fn send_reap_dead(&mut self) {
        if self.slots.reap_dead.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        let request = DbRequest::ReapDead {
            worker: self.id.clone(),
            grace_ms: self.app.recovery.liveness_grace_ms,
            entropy: self.rng.next_u64(),
        };
        self.slots.reap_dead.sending(OpId(self.next_op));
        self.send(request, Op::ReapDead);
    }

    /// Skipped (until the next interval) while a purge is in flight, the database is down or
    /// the worker drains.
    fn send_purge(&mut self) {
        let Some(older_than_ms) = self.app.recovery.finished_retention_ms else { return };
        if self.slots.purge.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        self.slots.purge.sending(OpId(self.next_op));
        self.send(DbRequest::Purge { older_than_ms, batch: DEFAULT_PURGE_BATCH }, Op::Purge);
    }

    /// Skipped (until the next interval) while a vacuum is in flight, the database is down or
    /// the worker drains.
    fn send_vacuum(&mut self) {
        let Some(min_dead_rows) = self.app.recovery.vacuum_dead_rows else { return };
        if self.slots.vacuum.is_out() || self.db_down || self.phase != Phase::Running {
            return;
        }
        self.slots.vacuum.sending(OpId(self.next_op));
        self.send(DbRequest::Vacuum { min_dead_rows }, Op::Vacuum);
    }

    fn on_notified(&mut self, queue: &str, priority: Option<i16>) {
        if self.config.deployment_mode == DeploymentMode::PollingOnly || !self.served.contains(queue) {
            return;
        }
        if let Some(priority) = priority {
            let rank = (self.queue_priority(queue), priority);
            // More urgent than a buffered task, or, with none buffered, than what the worker
            // is working through (a pass in flight brings more of it).
            let overtakes = if self.buffer.is_empty() {
                self.working_rank.is_some_and(|working| rank < working)
            } else {
                self.buffer.would_overtake(rank.0, rank.1)
            };
            if overtakes {
                self.urgent_bound = if self.urgent_due == 0 { priority } else { self.urgent_bound.max(priority) };
                self.urgent_due = self.urgent_due.saturating_add(1);
            }
        }
        if self.more_work && !self.cap_blocked {
            self.stats.notifications_coalesced += 1;
        }
        self.cap_blocked = false;
        self.start_blocked = false;
        if self.more_work {
            return;
        }
        self.pass_budget.refill(self.now);
        if let Some(at) = self.pass_budget.next_token_at() {
            // Empty notified passes spent their budget: this one waits for the next token, with
            // every notification until then.
            if !self.timers.contains(Timer::NotifiedPass) {
                self.stats.notified_passes_limited += 1;
                self.arm(Timer::NotifiedPass, at);
            }
            return;
        }
        // This notification takes the pass a held-back one was waiting for.
        self.timers.remove(Timer::NotifiedPass);
        self.more_work = true;
        self.notified_pass = true;
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
            (Op::Claim { urgent: true, token, .. }, DbReply::Claimed { tasks, .. }) => {
                self.on_urgent_claimed(tasks, token)
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
            (op, reply) => {
                // A store that answers a request with another request's reply breaks its
                // contract: count it as a refusal and try again later.
                let failure = DbFailure::Rejected(format!("a {} reply to a {op:?} request", reply.kind()));
                self.on_failure(op, failure, self.now);
            }
        }
    }

    /// The answer of an urgent claim: what it took joins the buffer.
    fn on_urgent_claimed(&mut self, tasks: Vec<ClaimedTask>, token: u64) {
        // What it took joins the buffer, most urgent first; the regular passes go on.
        self.urgent_out = None;
        self.take_claimed(tasks, token);
    }

    /// The answer of a claim pass (alone or inside a finish).
    fn on_pass_claimed(
        &mut self,
        notified: bool,
        sent: Instant,
        token: u64,
        tasks: Vec<ClaimedTask>,
        more: bool,
        next_run_in_ms: Option<u64>,
    ) {
        self.flow.on_claim_answered(sent, self.now);
        // A wake-up hint past the end of this clock's range is no hint at all.
        let hint = next_run_in_ms.and_then(|ms| self.now.checked_add(Duration::from_millis(ms)));
        if let Some(at) = hint.filter(|_| self.phase == Phase::Running) {
            if self.timers.get(Timer::Wake).is_none_or(|armed| armed > at) {
                self.arm(Timer::Wake, at);
            }
        }
        if notified && (!tasks.is_empty() || more) {
            self.pass_budget.tokens = (self.pass_budget.tokens + 1).min(NOTIFIED_PASS_BURST);
        }
        self.on_claimed(tasks, more, token)
    }

    /// The answer of a start request.
    fn on_start_answered(
        &mut self,
        sent: Vec<TaskLease>,
        started: Vec<(TaskId, Attempt)>,
        expired: Vec<TaskId>,
        deferred: Vec<TaskId>,
        lost: Vec<TaskId>,
    ) {
        let sent = SentLeases::new(sent);
        self.slots.start.answered();
        // Only tasks this request starts under the lease held now count: one lost and
        // claimed again while the request was in flight belongs to a newer lease.
        for (task, attempt) in started {
            if self.starting(task, &sent) {
                self.on_started(task, attempt);
            }
        }
        for task in expired {
            if self.starting(task, &sent) {
                self.held.remove(&task);
                self.stats.expired += 1;
                self.events.push_back(Event::Expired { task });
            }
        }
        if !deferred.is_empty() {
            self.start_blocked = true;
            self.poll_while_blocked();
        }
        for task in deferred.into_iter().rev() {
            if self.starting(task, &sent) {
                self.unstart(task);
            }
        }
        for task in lost {
            self.lose(TaskLease { task, lease: sent.lease_of(task) }, LostReason::LeaseLost);
        }
    }

    /// The answer of a record of starts made without asking.
    fn on_starts_recorded(
        &mut self,
        sent: Vec<TaskLease>,
        started: Vec<(TaskId, Attempt)>,
        expired: Vec<TaskId>,
        deferred: Vec<TaskId>,
        lost: Vec<TaskId>,
    ) {
        let sent = SentLeases::new(sent);
        self.slots.record.answered();
        for (task, attempt) in started {
            if let Some(held) = self.held.get_mut(&task).filter(|h| sent.contains(TaskLease { task, lease: h.lease })) {
                held.unrecorded = false;
                held.attempt = attempt;
            }
        }
        // Nothing is expired or deferred by a record; a store that says so lost the task.
        for task in lost.into_iter().chain(expired).chain(deferred) {
            let lease = sent.lease_of(task);
            // A finish or release under way reports on its task itself.
            if self.held.get(&task).is_some_and(|h| h.lease == lease && matches!(h.stage, Stage::Running { .. })) {
                self.lose(TaskLease { task, lease }, LostReason::LeaseLost);
            }
        }
        let unrecorded = self.held.values().any(|h| h.unrecorded && matches!(h.stage, Stage::Running { .. }));
        if unrecorded && !self.timers.contains(Timer::RecordStarts) {
            let at = self.now + self.record_starts_after();
            self.arm(Timer::RecordStarts, at);
        }
    }

    /// The answer of a finish (alone or inside a claim).
    fn on_finished(&mut self, batch: Vec<Queued>, lone: bool, applied: Vec<(TaskId, TaskState)>, lost: Vec<TaskId>) {
        if lone {
            self.slots.lone.answered();
        } else {
            self.slots.finish.answered();
            // It landed: the next batch may be as large again (back to the configured
            // size after a refused batch was split).
            self.finish_limit = self.finish_limit.saturating_mul(2).min(self.config.completion_batch_max as usize);
        }
        if !self.held_up() {
            self.busy_streak = 0;
        }
        let sent = SentLeases::new(batch.iter().map(|q| q.completion.task));
        let resent: BTreeSet<TaskLease> = batch.iter().filter(|q| q.resent).map(|q| q.completion.task).collect();
        for (task, state) in applied {
            // The run this finish ended: still finishing under the lease it named (not a
            // new holding under the same lease, after a failover handed it out again).
            let ended = self.held.get(&task).is_some_and(|held| {
                held.stage == Stage::Finishing && sent.contains(TaskLease { task, lease: held.lease })
            });
            if ended {
                self.held.remove(&task);
            }
            match state {
                TaskState::Completed => self.stats.completed += 1,
                TaskState::Pending => self.stats.retried += 1,
                _ => self.stats.failed += 1,
            }
            self.events.push_back(Event::Finished { task, state });
        }
        for task in lost {
            // A batch may name a task twice (a stale re-send, then the fresh run): only a
            // loss of the lease this worker holds now counts.
            if let Some(held) = self.held.get(&task) {
                let lease = TaskLease { task, lease: held.lease };
                if sent.contains(lease) {
                    let reason = if resent.contains(&lease) { LostReason::Unconfirmed } else { LostReason::LeaseLost };
                    self.lose(lease, reason);
                }
            }
        }
        if self.cap_blocked {
            // Our own tasks left their queues: room may have opened.
            self.cap_blocked = false;
            self.want_pass();
        }
        self.start_blocked = false;
    }

    /// The answer of a heartbeat: what it lost, and rows another transaction held.
    fn on_heartbeat(&mut self, sent: Vec<TaskLease>, lost: Vec<TaskId>, busy: Vec<TaskId>) {
        self.slots.heartbeat.answered();
        let sent = SentLeases::new(sent);
        for task in lost {
            let lease = sent.lease_of(task);
            // A write of ours that takes the task out of the live rows is under way
            // (its finish, its release, or a start that may expire it): it says what
            // became of the task, and a loss the beat saw may be that write landing first.
            let writing = self.held.get(&task).is_some_and(|h| {
                h.lease == lease
                    && match h.stage {
                        Stage::Finishing | Stage::Releasing => true,
                        Stage::Starting => h.expires,
                        Stage::Buffered | Stage::Running { .. } => false,
                    }
            });
            if !writing {
                self.lose(TaskLease { task, lease }, LostReason::LeaseLost);
            }
        }
        if busy.is_empty() {
            if !self.held_up() {
                self.busy_streak = 0;
            }
        } else {
            // Rows another transaction locks were not renewed: beat again soon for them,
            // less soon while they stay locked.
            let at = self.now + self.busy_delay();
            self.busy_streak = self.busy_streak.saturating_add(1);
            if self.timers.get(Timer::Heartbeat).is_none_or(|armed| armed > at) {
                self.arm(Timer::Heartbeat, at);
            }
        }
    }

    /// The answer of a release or an abandoned claim's undoing: those tasks are no longer held.
    fn on_released(&mut self, released: Vec<TaskId>, lost: Vec<TaskId>) {
        for task in released.into_iter().chain(lost) {
            if self.held.get(&task).is_some_and(|t| t.stage == Stage::Releasing) {
                self.held.remove(&task);
            }
        }
    }

    /// The reaper's report.
    fn on_reaped(&mut self, report: ReapReport) {
        self.slots.reap.answered();
        if report.skipped {
            self.stats.reaps_skipped += 1;
            self.events.push_back(Event::ReapSkipped);
        } else if report.changed_anything() {
            self.events.push_back(Event::Reaped(report));
        }
    }

    /// The report of a look for dead workers by their released liveness tokens.
    fn on_dead_reaped(&mut self, report: ReapReport) {
        self.slots.reap_dead.answered();
        if !report.dead_workers.is_empty() {
            self.stats.dead_workers_recovered += report.dead_workers.len() as u64;
            self.events.push_back(Event::Reaped(report));
        }
    }

    /// How many finished tasks a purge deleted.
    fn on_purged(&mut self, tasks: u64) {
        self.slots.purge.answered();
        if tasks > 0 {
            self.events.push_back(Event::Purged { tasks });
        }
    }

    /// The hot tables a vacuum check vacuumed.
    fn on_vacuumed(&mut self, tables: Vec<VacuumedTable>) {
        self.slots.vacuum.answered();
        if !tables.is_empty() {
            self.events.push_back(Event::Vacuumed(tables));
        }
    }

    /// The worker is in the registry.
    fn on_registered(&mut self) {
        self.slots.register.answered();
        self.registered = true;
    }

    fn on_claimed(&mut self, tasks: Vec<ClaimedTask>, more: bool, token: u64) {
        self.slots.claim.answered();
        self.claim_out = (0, 0);
        let took = tasks.len();
        self.working_rank = tasks.iter().map(|t| (self.queue_priority(&t.queue), t.priority)).max();
        self.take_claimed(tasks, token);
        if more {
            if took > 0 {
                self.want_pass();
            } else {
                self.cap_blocked = true;
                self.poll_while_blocked();
            }
        }
    }

    /// Holds the tasks a claim took: started ones run, the others wait in the buffer.
    fn take_claimed(&mut self, tasks: Vec<ClaimedTask>, token: u64) {
        for task in tasks {
            // Two claims may be out at once (a pass and an urgent claim), the database may
            // apply them in either order, and their answers come in any order: a task held
            // under a newer lease since this claim was sent was taken by the other one later
            // (this one's claim lapsed, or was taken back, meanwhile). Only a claim sent after
            // the holding began can say the database went back.
            if self.held.get(&task.id).is_some_and(|held| held.lease > task.lease && token < held.taken_before_op) {
                continue;
            }
            self.stats.claimed += 1;
            self.events.push_back(Event::Claimed { task: task.id, queue: task.queue.clone() });
            let started = task.started;
            let (id, attempt, task_lease) = (task.id, task.attempt, task.lease);
            if let Some(problem) = &task.retry_error {
                self.events.push_back(Event::UnreadableRow {
                    task: id,
                    problem: format!("its retry policy could not be read ({problem}): the app's policy applies"),
                });
            }
            let unreadable = task.args_error.clone();
            let stage = if started { Stage::Starting } else { Stage::Buffered };
            let previous = self.held.insert(
                id,
                Held {
                    lease: task.lease,
                    attempt,
                    name: task.name,
                    queue: task.queue,
                    priority: task.priority,
                    enqueued_at: task.enqueued_at,
                    run_at: task.run_at,
                    args: task.args,
                    retries: task.retries,
                    retry: task.retry,
                    stage,
                    expires: task.expires,
                    unrecorded: false,
                    taken_before_op: self.next_op,
                },
            );
            if let Some(previous) = previous {
                // The store handed the task out again under a newer lease: a write of ours whose
                // reply was lost did land (a retry or a release), or the reaper took the task
                // while we still ran it. What we held under the old lease is stale: drop its
                // handler and its unwritten outcome (a write under it would be fenced anyway).
                // An older lease than ours means the database went back in time (a restore, a
                // lagging replica): the database is the truth, so the same, and say so.
                if previous.lease >= task_lease {
                    self.events.push_back(Event::LeaseWentBack { task: id, held: previous.lease, claimed: task_lease });
                }
                if matches!(previous.stage, Stage::Running { .. }) {
                    self.commands.push_back(Command::Abort { task: id, lease: previous.lease });
                }
                self.timers.remove(Timer::HandlerTimeout(id));
                self.buffer.remove(id);
                self.forget_writes(id);
                self.releases.retain(|t| t.task != id);
                self.stats.lost += 1;
                self.events.push_back(Event::Lost { task: id, reason: LostReason::Unconfirmed });
            }
            if let Some(problem) = unreadable {
                // Nothing can run it: fail it as a handler that could not decode its arguments
                // would, without a retry (the row will not read better next time).
                self.events.push_back(Event::UnreadableRow {
                    task: id,
                    problem: format!("its arguments could not be read ({problem})"),
                });
                if !started {
                    // Claimed in the store until its finish lands: heartbeats renew the claim.
                    if let Some(held) = self.held.get_mut(&id) {
                        held.unrecorded = true;
                    }
                }
                let message = format!("the task's stored arguments could not be read: {}", printable(&problem, 500));
                let outcome = FinishOutcome::Failed(TaskError::new(ErrorCode::WorkerSerializationError, message));
                let bytes = own_outcome_bytes(&outcome);
                self.finish(id, outcome, None, bytes);
                continue;
            }
            if self.phase != Phase::Running {
                // Claimed while shutting down: hand it straight back.
                self.release(id);
            } else if started {
                self.on_started(id, attempt);
            } else {
                self.buffer_task(id, false);
            }
        }
    }

    /// The claim priority of `queue` for this worker (lower claims first).
    fn queue_priority(&self, queue: &str) -> u8 {
        self.policy.queues.iter().find(|q| q.name == queue).map_or(u8::MAX, |q| q.priority)
    }

    /// Puts held task `id` in the buffer by its queue's priority and its own; `front`: before
    /// the others of its rank (a start that did not happen).
    fn buffer_task(&mut self, id: TaskId, front: bool) {
        let Some(held) = self.held.get(&id) else { return };
        let (queue_priority, priority) = (self.queue_priority(&held.queue), held.priority);
        if front {
            self.buffer.push_front(id, queue_priority, priority);
        } else {
            self.buffer.push(id, queue_priority, priority);
        }
    }

    /// A cap stopped this worker: capacity freed by others (their completions, the reaper)
    /// comes with no notification, so a blocked worker polls even in event-driven mode.
    fn poll_while_blocked(&mut self) {
        if self.phase == Phase::Running && !self.timers.contains(Timer::Poll) {
            let at = self.now + self.poll_interval(self.now);
            self.arm(Timer::Poll, at);
        }
    }

    /// Whether `task` waits for the start request that named `sent`, under the lease it names.
    fn starting(&self, task: TaskId, sent: &SentLeases) -> bool {
        self.held
            .get(&task)
            .is_some_and(|held| held.stage == Stage::Starting && sent.contains(TaskLease { task, lease: held.lease }))
    }

    /// A start that did not happen (deferred, or no answer): back to the buffer, or, while
    /// shutting down, handed back (nothing else would release it, and a start that did land
    /// is undone by the release too).
    fn unstart(&mut self, task: TaskId) {
        if self.phase != Phase::Running {
            self.release(task);
        } else if self.held.set_stage(&task, Stage::Buffered).is_some() {
            self.buffer_task(task, true);
        }
    }

    fn on_started(&mut self, task: TaskId, attempt: Attempt) {
        let deadline = self.config.handler_timeout_ms.map(|ms| self.now + Duration::from_millis(ms));
        let shutting_down = self.phase != Phase::Running;
        if shutting_down {
            // Started while shutting down: no handler was spawned, so give it straight back.
            let Some(held) = self.held.set_stage(&task, Stage::Starting) else { return };
            held.attempt = attempt;
            self.release(task);
            return;
        }
        let Some(held) = self.held.set_stage(&task, Stage::Running { deadline }) else { return };
        held.attempt = attempt;
        let run = TaskRun {
            id: task,
            lease: held.lease,
            attempt,
            name: held.name.clone(),
            queue: held.queue.clone(),
            priority: held.priority,
            enqueued_at: held.enqueued_at,
            run_at: held.run_at,
            args: std::mem::take(&mut held.args),
            deadline,
        };
        if let Some(deadline) = deadline {
            self.arm(Timer::HandlerTimeout(task), deadline);
        }
        self.stats.started += 1;
        self.events.push_back(Event::Started { task, attempt });
        self.commands.push_back(Command::Spawn(run));
    }

    fn on_task_finished(&mut self, task: TaskId, lease: Lease, outcome: TaskOutcome) {
        let Some(held) = self.held.get(&task) else { return };
        if held.lease != lease || !matches!(held.stage, Stage::Running { .. }) {
            return; // aborted or superseded: its answer no longer counts
        }
        self.flow.on_finished(self.now);
        let max = self.config.max_result_bytes;
        let checked = match &outcome {
            TaskOutcome::Success(value) => check_storable(value, max).map_err(|e| format!("its result: {e}")),
            TaskOutcome::Failure(error) => check_storable_error(error, max).map_err(|e| format!("its error: {e}")),
            TaskOutcome::PartialFailure { error, remaining } => {
                check_storable_error(error, max).map_err(|e| format!("its error: {e}")).and_then(|error_bytes| {
                    check_storable(remaining, max.saturating_sub(error_bytes))
                        .map(|bytes| bytes + error_bytes)
                        .map_err(|e| format!("its remaining items: {e}"))
                })
            }
        };
        let (outcome, args, bytes) = match (checked, outcome) {
            (Err(problem), _) => {
                // Queued as it is, it would be refused with every completion of its batch.
                let message = format!("the handler's outcome could not be stored: {problem}");
                self.stats.outcomes_refused += 1;
                self.events.push_back(Event::OutcomeRefused { task, problem: message.clone() });
                let error = TaskError::new(ErrorCode::WorkerSerializationError, message);
                let outcome = self.failure_outcome(task, error);
                let bytes = own_outcome_bytes(&outcome);
                (outcome, None, bytes)
            }
            (Ok(bytes), TaskOutcome::Success(value)) => (FinishOutcome::Completed(value), None, bytes),
            (Ok(bytes), TaskOutcome::Failure(error)) => (self.failure_outcome(task, error), None, bytes),
            (Ok(bytes), TaskOutcome::PartialFailure { error, remaining }) => {
                (self.failure_outcome(task, error), Some(remaining), bytes)
            }
        };
        self.finish(task, outcome, args, bytes);
    }

    fn failure_outcome(&mut self, task: TaskId, error: TaskError) -> FinishOutcome {
        let held = self.held.get(&task).expect("a failure is decided for a held task");
        if backoff::may_retry(&held.retry, held.retries, &error.code) {
            let delay = backoff::retry_delay(&held.retry, held.retries + 1, self.rng.next_u64());
            FinishOutcome::Retry { error, delay_ms: delay.as_millis() as u64 }
        } else {
            FinishOutcome::Failed(error)
        }
    }

    /// Queues the outcome of `task`, whose size as JSON is about `bytes`.
    fn finish(&mut self, task: TaskId, outcome: FinishOutcome, args: Option<serde_json::Value>, bytes: u64) {
        let held = self.held.set_stage(&task, Stage::Finishing).expect("finish is called for held tasks");
        let lease = held.lease;
        self.timers.remove(Timer::HandlerTimeout(task));
        self.completions.push_back(Queued::new(Completion { task: TaskLease { task, lease }, outcome, args }, bytes));
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
        self.commands.push_back(Command::Abort { task, lease });
        self.stats.timed_out += 1;
        self.events.push_back(Event::TimedOut { task });
        let error = TaskError::new(ErrorCode::TaskTimeout, format!("handler ran past its timeout of {timeout} ms"));
        let outcome = self.failure_outcome(task, error);
        let bytes = own_outcome_bytes(&outcome);
        self.finish(task, outcome, None, bytes);
    }

    /// Drops a task that is no longer ours under `lease`, aborting its handler if it runs. A
    /// loss reported for another lease than the one held now (an older one) changes nothing.
    fn lose(&mut self, TaskLease { task, lease }: TaskLease, reason: LostReason) {
        if self.held.get(&task).is_none_or(|held| held.lease != lease) {
            return;
        }
        let Some(held) = self.held.remove(&task) else { return };
        if matches!(held.stage, Stage::Running { .. }) {
            self.commands.push_back(Command::Abort { task, lease: held.lease });
        }
        self.timers.remove(Timer::HandlerTimeout(task));
        self.buffer.remove(task);
        self.forget_writes(task);
        self.stats.lost += 1;
        self.events.push_back(Event::Lost { task, reason });
    }

    fn release(&mut self, task: TaskId) {
        let held = self.held.get(&task).expect("release is called for held tasks");
        let (lease, was_running) = (held.lease, matches!(held.stage, Stage::Running { .. }));
        if was_running {
            self.commands.push_back(Command::Abort { task, lease });
        }
        self.buffer.remove(task);
        self.held.set_stage(&task, Stage::Releasing);
        self.timers.remove(Timer::HandlerTimeout(task));
        self.releases.push(TaskLease { task, lease });
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
            // A release, an abandon, a record of starts or the registration: those wait.
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

    /// A claim pass that failed; true when nothing more is to be done about it (an urgent
    /// claim's task waits for the next pass; a queue's claim lock is no outage: other workers
    /// claim meanwhile).
    fn claim_pass_failed(&mut self, token: u64, urgent: bool, unknown: bool, lock: bool, now: Instant) -> bool {
        self.claim_failed(token, unknown, urgent, now);
        if urgent {
            return true;
        }
        if lock {
            self.claims_held = true;
            self.hold_up(now);
            return true;
        }
        false
    }

    /// A start request that failed: its tasks are not started (starting again is idempotent:
    /// a started row under our lease counts as started). True for a lock, which is handled
    /// like a start deferred at a cap: asked again at the next poll or finish.
    fn start_failed(&mut self, tasks: Vec<TaskLease>, lock: bool) -> bool {
        self.slots.start.answered();
        let sent = SentLeases::new(tasks.iter().copied());
        for lease in tasks.iter().rev() {
            if self.starting(lease.task, &sent) {
                self.unstart(lease.task);
            }
        }
        if lock {
            self.start_blocked = true;
            self.poll_while_blocked();
            return true;
        }
        false
    }

    /// A heartbeat that failed: owed again. True for a lock, no outage: beat again soon, less
    /// soon while the lock holds.
    fn heartbeat_failed(&mut self, lock: bool, now: Instant) -> bool {
        self.slots.heartbeat.answered();
        if lock {
            let at = now + self.busy_delay();
            self.busy_streak = self.busy_streak.saturating_add(1);
            if self.timers.get(Timer::Heartbeat).is_none_or(|armed| armed > at) {
                self.arm(Timer::Heartbeat, at);
            }
            return true;
        }
        self.slots.heartbeat.owe();
        false
    }

    /// A record of starts that failed: owed again.
    fn record_failed(&mut self) -> bool {
        self.slots.record.answered();
        self.slots.record.owe();
        false
    }

    /// A reaper pass that failed: true for a lock (the next interval tries again; nothing
    /// waits for it).
    fn reap_failed(&mut self, lock: bool) -> bool {
        self.slots.reap.answered();
        lock
    }

    /// A look for dead workers that failed: as [`reap_failed`](Self::reap_failed).
    fn reap_dead_failed(&mut self, lock: bool) -> bool {
        self.slots.reap_dead.answered();
        lock
    }

    /// A purge that failed: as [`reap_failed`](Self::reap_failed).
    fn purge_failed(&mut self, lock: bool) -> bool {
        self.slots.purge.answered();
        lock
    }

    /// A vacuum check that failed, whatever stopped it (a lock, its statement timeout on a
    /// bloated table): upkeep, which the next check tries again; an outage shows in the work
    /// itself. Always handled.
    fn vacuum_failed(&mut self) -> bool {
        self.slots.vacuum.answered();
        true
    }

    /// A claim that failed: no pass in flight, another wanted. One whose commit is unknown is
    /// undone by its token now, and with every heartbeat for a while (it may commit later).
    fn claim_failed(&mut self, token: u64, unknown: bool, urgent: bool, now: Instant) {
        if urgent {
            self.urgent_out = None;
        } else {
            self.slots.claim.answered();
            self.claim_out = (0, 0);
            self.want_pass();
        }
        if unknown {
            self.abandons.push(token);
            if let Some(until) = now.checked_add(ABANDONED_CLAIM_MEMORY) {
                self.abandoned.insert(token, until);
            }
        }
    }

    /// A finish of `batch` that failed: what is still ours goes back to its lane, split when
    /// the database refused it (a value, a lock) so that no refused batch is sent again
    /// unchanged. `true` when the failure is not an outage (nothing to back off from).
    fn finish_failed(
        &mut self,
        batch: Vec<Queued>,
        lone: bool,
        failure: &DbFailure,
        unknown: bool,
        now: Instant,
    ) -> bool {
        if lone {
            self.slots.lone.answered();
        } else {
            self.slots.finish.answered();
        }
        // Only an item refused alone is the refused item: one left alone because the others
        // were lost meanwhile is sent again as it is.
        let sent_alone = batch.len() <= 1;
        // Re-send only what is still ours under the same lease.
        let held = |q: &Queued| {
            self.held
                .get(&q.completion.task.task)
                .is_some_and(|h| h.lease == q.completion.task.lease && h.stage == Stage::Finishing)
        };
        let mut batch: Vec<Queued> = batch.into_iter().filter(held).collect();
        let refused = matches!(failure, DbFailure::Invalid(_) | DbFailure::Rejected(_) | DbFailure::LockTimeout(_));
        if refused && sent_alone {
            // Alone: it goes on in the lone lane, and the other completions without it.
            if let Some(queued) = batch.pop() {
                self.refused_alone(queued, failure, now);
            }
            return true;
        }
        if refused {
            // Never the same refused batch again: halve it until the item the database refuses
            // (or the row another transaction holds) is alone. Not an outage: the split is
            // progress, sent at once.
            self.finish_limit = (batch.len() / 2).max(1);
        }
        let lane = if lone { &mut self.lone } else { &mut self.completions };
        for mut queued in batch.into_iter().rev() {
            queued.resent |= unknown;
            lane.push_front(queued);
        }
        refused
    }

    /// A completion the database refused (or a lock held up) on its own: it goes on in the
    /// lone lane, beside the batches. Refused for its values, its task fails instead with
    /// values of the worker's own, at once; refused otherwise, it waits for
    /// [`Timer::LockRetry`], and after [`MAX_LONE_REFUSALS`] refusals it is dropped. A lock
    /// drops nothing: the row's holder lets go in the end, and heartbeats keep the task.
    fn refused_alone(&mut self, mut queued: Queued, failure: &DbFailure, now: Instant) {
        let task = queued.completion.task.task;
        match failure {
            DbFailure::Invalid(_) if !queued.sanitized => {
                // No new arguments either: they may be what was refused.
                let problem =
                    format!("the database refused the task's outcome: {}", printable(&failure.to_string(), 500));
                self.stats.outcomes_refused += 1;
                self.events.push_back(Event::OutcomeRefused { task, problem: problem.clone() });
                let error = TaskError::new(ErrorCode::WorkerSerializationError, problem);
                queued.completion.outcome = self.failure_outcome(task, error);
                queued.completion.args = None;
                queued.bytes = own_outcome_bytes(&queued.completion.outcome);
                queued.sanitized = true;
                self.lone.push_front(queued);
                return;
            }
            DbFailure::LockTimeout(_) => {}
            _ => {
                queued.refusals += 1;
                if queued.refusals >= MAX_LONE_REFUSALS {
                    self.held.remove(&task);
                    self.stats.outcomes_dropped += 1;
                    let problem = format!(
                        "the database refused the task's finish {} times, the last: {}",
                        queued.refusals,
                        printable(&failure.to_string(), 500)
                    );
                    self.events.push_back(Event::OutcomeDropped { task, problem });
                    return;
                }
            }
        }
        self.lone.push_back(queued);
        self.lone_waiting = true;
        self.hold_up(now);
    }

    fn begin_shutdown(&mut self, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        self.phase = Phase::Draining { grace_over: false };
        self.timers.remove(Timer::Poll);
        self.timers.remove(Timer::Wake);
        self.timers.remove(Timer::Reaper);
        self.timers.remove(Timer::LivenessCheck);
        let buffered: Vec<TaskId> = self.buffer.iter().collect();
        for task in buffered {
            self.release(task);
        }
        self.arm(Timer::ShutdownGrace, now + Duration::from_millis(self.config.shutdown_grace_ms));
    }

    fn end_grace(&mut self) {
        self.phase = Phase::Draining { grace_over: true };
        // Shutdown gives up on writes that locks keep holding up past the grace period: the
        // hold-ups before it (the row may be free by now) do not count.
        self.busy_streak = 0;

        let running: Vec<TaskId> =
            self.held.iter().filter(|(_, t)| matches!(t.stage, Stage::Running { .. })).map(|(id, _)| *id).collect();
        for task in running {
            self.release(task);
        }
    }

    /// Finishes shutdown once nothing is held or in flight; after the grace period, a database
    /// that is down does not hold shutdown up.
    fn check_drained(&mut self) {
        let Phase::Draining { grace_over } = self.phase else { return };
        // A database that keeps failing does not hold shutdown up past the grace period, but
        // one failed request (a lost reply) does not end it either: what it left to do (undo
        // an unanswered claim, hand tasks back) is retried like any write first.
        // Nor do locks that keep holding its writes up.
        if grace_over && self.db_down && self.backoff.failures() >= SHUTDOWN_DB_FAILURES {
            self.stop(self.held.len());
            return;
        }
        if grace_over && self.busy_streak >= SHUTDOWN_DB_FAILURES && !self.held.is_empty() {
            // The database answers, but locks held elsewhere keep holding writes up: what they
            // hold up is left to the reaper, and the worker deregisters as usual.
            self.given_up += self.held.len();
            self.held = HeldTasks::default();
            self.completions.clear();
            self.lone.clear();
            self.releases.clear();
        }
        let idle = self.held.is_empty()
            && self.completions.is_empty()
            && self.lone.is_empty()
            && self.releases.is_empty()
            && self.abandons.is_empty()
            && self.ops.values().all(|op| matches!(op, Op::Heartbeat(_) | Op::Reap | Op::ReapDead | Op::Vacuum));
        if idle && !self.deregister_sent && !self.db_down {
            self.deregister_sent = true;
            self.send(DbRequest::DeregisterWorker(self.id.clone()), Op::Deregister);
        }
    }

    fn stop(&mut self, abandoned: usize) {
        self.phase = Phase::Stopped;
        self.timers.clear();
        self.events.push_back(Event::Drained { abandoned });
    }
}

/// The size of an outcome the worker wrote itself (an error of its own): small, and storable.
fn own_outcome_bytes(outcome: &FinishOutcome) -> u64 {
    match outcome {
        FinishOutcome::Completed(value) => check_storable(value, u64::MAX).unwrap_or(0),
        FinishOutcome::Retry { error, .. } | FinishOutcome::Failed(error) => {
            check_storable_error(error, u64::MAX).unwrap_or(0)
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
