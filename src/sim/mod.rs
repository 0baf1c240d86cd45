//! The deterministic simulation harness (feature `sim`): many real [`Worker`] machines, one
//! [`MemoryStore`] as the database, a virtual clock, and faults, all derived from one seed.
//!
//! # Shape
//!
//! A run is a discrete-event simulation (DESIGN.md §5, aesthetics §2.5, TigerBeetle's VOPR):
//!
//! - **One seed derives everything**: [`SimOptions::swarm`] draws the configuration (hard or
//!   soft caps, queues, leases, intervals, 1 to 5 workers), the task load and the fault mix;
//!   the same seed then drives every random choice of the run. Nothing reads a clock or the
//!   OS: two runs of a seed produce the same trace, byte for byte ([`SimReport::trace_hash`]).
//! - **Virtual time**: `now = epoch + offset`, and the store's clock is
//!   [`DB_EPOCH_MS`] `+ offset` in ms. Pending work sits in one event queue ordered by
//!   `(instant, sequence number)`, a total order. Each step takes the earliest of the queue's
//!   head and every live worker's [`Worker::poll_timeout`], advances the clock to it, and
//!   delivers exactly **one** input (or one `handle_timeout`); then the worker is drained of
//!   commands and events, and each command becomes scheduled events: a database request is
//!   applied after a sampled latency and its reply delivered after another, a spawned handler
//!   answers after a sampled duration with a sampled outcome, an abort cancels that answer.
//! - **Faults** ([`FaultOptions`]): latency spikes, outages, requests that fail unapplied,
//!   requests applied whose reply is lost, rejected requests, duplicated replies, lost,
//!   duplicated and delayed notifications, listener drops, worker crashes (the process dies
//!   with its handlers, its in-flight requests may still land, and it restarts under a new
//!   id) and graceful restarts, slow, hanging, failing and panicking handlers, handler answers
//!   that arrive after their abort.
//! - **Workflows in the load** (in about two seeds of three: none in the others, dozens in
//!   some): beside the plain tasks the client submits random graphs drawn from the seed
//!   (`src/sim/workflows.rs`): chains, stacked diamonds, wide fan-outs, fan-ins and random
//!   DAGs, with joins all, any and quorum(n), `allow_failed` edges in some seeds and
//!   pause-on-error workflows in some. Their steps are ordinary tasks run by the same handlers
//!   with the same sampled outcomes (failures, retries, expiry), and the plain cancels may hit
//!   them. During the safety phase the operator pauses, resumes, cancels or retries
//!   (downstream or not) a random workflow at seed-drawn times; a cancel takes claimed and
//!   running steps from their workers, whose listeners hear of it (a revocation, with the
//!   notifications' faults) and whose heartbeats learn it. After healing the operator resumes
//!   every paused workflow, and again every [`OPERATOR_SWEEP_MS`] as errors pause more.
//! - **Invariants after every step** (`src/sim/invariants.rs`): no task lost or duplicated;
//!   no task run under two live leases and no write from a stale lease applied (every reply of
//!   the store is checked against the rows as they were before the request); caps never
//!   exceeded (per worker always; per queue and cluster-wide in hard-cap mode; Running per
//!   queue in soft-cap mode); attempts and leases never decrease; a terminal task never
//!   changes; nothing starts at or after its good-until, no retry is scheduled at or after
//!   it; the handlers the harness runs for a worker are exactly those it believes run (the
//!   spawn and abort contract); a worker never drops a run the store still holds for it under
//!   its lease (that leaves the task to the reaper); the worker never busy-loops (after
//!   `handle_timeout(now)` its next deadline is later than `now`, and no worker sends more
//!   than [`MAX_REQUESTS_PER_SECOND`]). For workflows, from the graphs the harness submitted
//!   and the steps' rows: no step leaves Waiting (is promoted, claimed or run) before its join
//!   is satisfied by its parents' rows, and none is skipped while its join can still be; no
//!   step of a running workflow waits with its join decided; a skipped step never ran (never
//!   claimed, no attempt); no step of a cancelled workflow is promoted after the cancel (nor
//!   left live by it); a retry resets exactly the steps it should; the workflow's step counts
//!   and status agree with the rows (no step runs under two live leases is the general
//!   invariant above: steps are rows).
//! - **Phases**: a *safety* phase with faults for a seed-derived virtual duration; then the
//!   faults *heal* (dead workers restart, listeners reconnect, paused workflows resume) and
//!   in the *liveness* phase every task must become terminal, and every workflow Completed,
//!   Failed or Cancelled, within a bound computed from the configuration and the workflows'
//!   depth ("no liveness" otherwise); finally every worker is asked to shut down and must
//!   *drain*: stop holding nothing, deregistered.
//!
//! # Use
//!
//! ```no_run
//! let report = canter::sim::run_seed(42).unwrap_or_else(|failure| panic!("{failure}"));
//! println!("{} steps, trace hash {:016x}", report.steps, report.trace_hash);
//! ```
//!
//! A [`SimFailure`] prints the seed, the message, the last trace lines and the command that
//! replays it. `tests/sim.rs` runs the sweep, the replay and the determinism check.
//!
//! # Operation sequences
//!
//! [`store_ops`] is a smaller harness over the same invariants: sequences of store operations
//! (enqueue, claim, finish, release, heartbeat, the passing of time, the reaper) applied to one
//! [`MemoryStore`] without worker machines. Its operation type is the vocabulary shared by the
//! claim/cap model (`tests/model_claim_cap.rs`) and the `store_ops` fuzz target (with the
//! feature `arbitrary`).

mod faults;
mod invariants;
mod options;
pub mod store_ops;
mod trace;
pub mod workflows;

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::budget::ClaimPolicy;
use crate::config::{DeploymentMode, WorkerConfig};
use crate::memory::{MemoryStore, READABLE_JSON_DEPTH, json_depth};
use crate::rng::{Rng, mix};
use crate::store::{AdminReply, AdminRequest, Cancelled, Notification, WorkflowActionError, WorkflowId};
use crate::store::{Completion, DbFailure, DbReply, DbRequest, DbTime, FinishOutcome, NewTask, OpId, RunAt};
use crate::task::{ErrorCode, Lease, TaskError, TaskId, TaskState, WorkerId};
use crate::wake::WakeSources;
use crate::worker::{ABANDONED_CLAIM_MEMORY, Command, Event, Input, LostReason, TaskOutcome, TaskRun, Worker};
use crate::workflow::WorkflowStatus;

pub use faults::{BrokerFaults, Fate, FaultOptions};
pub use options::{LoadOptions, SimOptions, USER_ERROR_CODE};
pub use trace::{DEFAULT_TRACE_LINES, Trace};

use invariants::Checker;

/// The store's clock at virtual time zero: 2023-11-14T22:13:20Z, in ms since the Unix epoch.
pub const DB_EPOCH_MS: i64 = 1_700_000_000_000;

/// How many trace lines a [`SimFailure`] carries.
pub const FAILURE_TRACE_LINES: usize = 50;

/// The most database requests one worker may send in one virtual second before the run fails
/// as a busy loop.
pub const MAX_REQUESTS_PER_SECOND: u32 = 2_000;

/// How often, after healing, the operator resumes the workflows that paused on an error (in
/// virtual ms).
pub const OPERATOR_SWEEP_MS: u64 = 2_000;

/// What a successful run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// Steps taken.
    pub steps: u64,
    /// Virtual time at the end.
    pub elapsed: Duration,
    /// Virtual time at which the faults healed.
    pub healed_at: Duration,
    /// Virtual time at which every task was terminal.
    pub settled_at: Duration,
    /// The hash of every trace line: equal for two runs of one seed.
    pub trace_hash: u64,
    /// Trace lines recorded.
    pub trace_lines: u64,
    /// Workers slots.
    pub workers: usize,
    /// Tasks enqueued (distinct ids).
    pub tasks: usize,
    /// Final states: completed, failed, expired, and pending in paused queues.
    pub completed: usize,
    /// Tasks that failed for good.
    pub failed: usize,
    /// Tasks that expired.
    pub expired: usize,
    /// Tasks left pending in paused queues (cap 0).
    pub paused: usize,
    /// Tasks cancelled (alone, or with their workflow).
    pub cancelled: usize,
    /// Workflow steps skipped (their joins could no longer be satisfied).
    pub skipped: usize,
    /// Workflows submitted.
    pub workflows: usize,
    /// Workflows that completed.
    pub workflows_completed: usize,
    /// Workflows that failed.
    pub workflows_failed: usize,
    /// Workflows the operator cancelled.
    pub workflows_cancelled: usize,
    /// Database requests sent.
    pub requests: u64,
    /// Requests that met an injected fault (outage, loss, rejection).
    pub faulted_requests: u64,
    /// Worker crashes.
    pub crashes: u64,
    /// Worker starts, restarts included.
    pub starts: u64,
    /// Handlers spawned.
    pub spawns: u64,
    /// Handlers spawned when the store no longer had the task Running under their lease (a
    /// reply that arrived late): they run as zombies and their writes must be fenced.
    pub stale_spawns: u64,
    /// Stale writes the store refused.
    pub fenced: u64,
    /// Aborts for handlers the harness did not run (never spawned, or already answered).
    pub unknown_aborts: u64,
    /// The most requests one worker sent in one virtual second.
    pub max_requests_per_second: u32,
    /// Workers found dead by their released liveness tokens (and their tasks recovered).
    pub dead_workers: u64,
    /// Wake-ups a broker delivered to workers (with [`BrokerFaults`]).
    pub broker_wakeups: u64,
    /// Claim passes sent with a priority floor (through a backlog). A pass from an announced
    /// run-at carries the announced priority as its `min_priority` too, and is counted below.
    pub floored_passes: u64,
    /// Claim passes sent from an announced run-at (woken only by such announcements).
    pub bounded_passes: u64,
    /// Looks at every row sent beside such passes (once a poll interval).
    pub looks: u64,
    /// Queues a client's enqueue did not notify because no worker of them was marked waiting.
    pub unnotified_enqueues: u64,
    /// Looks at such tasks that workers owed (and took: each was checked, see `wakeup_debts`).
    pub wakeup_debts: u64,
    /// Whether the run injected any fault besides latency.
    pub faulty: bool,
}

/// A failed run: the seed, what broke, and the end of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimFailure {
    /// The seed.
    pub seed: u64,
    /// What broke.
    pub message: String,
    /// Virtual time of the failure.
    pub at: Duration,
    /// The step of the failure.
    pub step: u64,
    /// The last trace lines, oldest first.
    pub trace_tail: Vec<String>,
    /// The trace hash at the failure.
    pub trace_hash: u64,
}

impl SimFailure {
    /// The shell command that replays this seed with its full trace.
    pub fn replay_command(&self) -> String {
        format!("CANTER_SEED={} cargo test --test sim -- --nocapture replay", self.seed)
    }
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation seed {} failed at +{}.{:03}s (step {}): {}",
            self.seed,
            self.at.as_secs(),
            self.at.subsec_millis(),
            self.step,
            self.message
        )?;
        writeln!(f, "last {} trace lines:", self.trace_tail.len())?;
        for line in &self.trace_tail {
            writeln!(f, "  {line}")?;
        }
        write!(f, "replay: {}", self.replay_command())
    }
}

impl std::error::Error for SimFailure {}

/// Runs seed `seed` with its swarm options and a trace of [`DEFAULT_TRACE_LINES`] lines.
pub fn run_seed(seed: u64) -> Result<SimReport, SimFailure> {
    run_seed_with(seed, Trace::default())
}

/// Runs seed `seed` with its swarm options and this trace (an echoing trace for a replay).
pub fn run_seed_with(seed: u64, trace: Trace) -> Result<SimReport, SimFailure> {
    // The one place the harness reads the real clock: only to have an `Instant` to add
    // durations to. Nothing depends on its value; traces print offsets from it.
    #[allow(clippy::disallowed_methods)]
    let epoch = Instant::now();
    Sim::new(seed, SimOptions::from_seed(seed), trace, epoch).run()
}

/// Phases of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Faults on.
    Safety,
    /// Faults healed; every task must become terminal by `deadline`.
    Liveness { deadline: Instant },
    /// Every worker was asked to shut down and must stop by `deadline`.
    Drain { deadline: Instant },
}

/// A scheduled happening. Events for a worker name its slot and incarnation: when that
/// incarnation is dead they are dropped (a database request may still land).
#[derive(Debug, Clone)]
enum SimEvent {
    Enqueue {
        count: u32,
    },
    /// The client submits a workflow drawn now.
    SubmitWorkflow,
    /// The operator pauses, resumes or cancels a random workflow.
    WorkflowAction,
    /// After healing: the operator resumes the workflows paused on an error.
    ResumeWorkflows,
    Apply {
        slot: usize,
        incarnation: u32,
        worker: WorkerId,
        op: OpId,
        request: DbRequest,
        fate: Fate,
        /// Heartbeats: the claims the worker had abandoned when it sent the beat, whose
        /// late-committed rows the beat must hand back.
        abandoned: Vec<u64>,
    },
    /// A request that timed out commits after all.
    LateApply {
        worker: WorkerId,
        op: OpId,
        request: DbRequest,
    },
    /// Another transaction locks a live row for `for_ms`.
    LockRow {
        for_ms: u64,
    },
    /// The database comes back as it was `back_ms` ago.
    Failover {
        back_ms: u64,
    },
    /// A worker's liveness-token connection drops for `down_ms`.
    TokenDrop {
        slot: usize,
        down_ms: u64,
    },
    /// A live worker's token connection is back: it takes its token again.
    TokenBack {
        slot: usize,
        incarnation: u32,
    },
    /// That transaction ends.
    UnlockRow {
        task: TaskId,
    },
    Reply {
        slot: usize,
        incarnation: u32,
        op: OpId,
        reply: Result<DbReply, DbFailure>,
    },
    Finished {
        slot: usize,
        incarnation: u32,
        task: TaskId,
        lease: Lease,
        outcome: TaskOutcome,
    },
    Notify {
        slot: usize,
        incarnation: u32,
        queue: String,
        priority: Option<i16>,
        run_at: Option<DbTime>,
    },
    /// A revocation reaches a worker's listener.
    Revoked {
        slot: usize,
        incarnation: u32,
        tasks: Vec<TaskId>,
    },
    Listener {
        slot: usize,
        incarnation: u32,
        connected: bool,
    },
    ListenerDrop {
        slot: usize,
        down_ms: u64,
    },
    /// A broker's wake-up reaches a worker's subscription.
    BrokerWakeup {
        slot: usize,
        incarnation: u32,
        queue: String,
        priority: Option<i16>,
    },
    /// A worker's broker subscription comes up or is lost.
    BrokerListener {
        slot: usize,
        incarnation: u32,
        connected: bool,
    },
    BrokerDrop {
        slot: usize,
        down_ms: u64,
    },
    Stall {
        slot: usize,
        for_ms: u64,
    },
    Crash {
        slot: usize,
    },
    Shutdown {
        slot: usize,
    },
    Restart {
        slot: usize,
    },
    Heal,
}

type Key = (Instant, u64);

/// A handler the harness runs.
#[derive(Debug, Clone)]
struct Handler {
    lease: Lease,
    /// Its scheduled answer; `None` when it hangs.
    answer: Option<Key>,
}

/// What happens to a wake-up on its way to one worker: its chances of loss and of a
/// duplicate, and its longest delay.
#[derive(Debug, Clone, Copy)]
struct Wire {
    loss: f64,
    duplicate: f64,
    delay_max_ms: u64,
}

/// A worker's LISTEN session, as a source of its [`WakeSources`].
const LISTEN_SOURCE: usize = 0;

/// A worker's broker subscription, as a source of its [`WakeSources`].
const BROKER_SOURCE: usize = 1;

/// One worker process slot: its configuration, and the incarnation living in it, if any.
#[derive(Debug)]
struct Slot {
    config: WorkerConfig,
    policy: Arc<ClaimPolicy>,
    incarnation: u32,
    worker: Option<Worker>,
    /// Whether its LISTEN session is up.
    listening: bool,
    /// Whether its broker subscription is up (with a broker).
    broker_listening: bool,
    /// Its wake-up sources (LISTEN, then the broker's), reported to the machine as one.
    sources: WakeSources,
    handlers: BTreeMap<TaskId, Handler>,
    restart_pending: bool,
    /// The last `Drained` event's abandoned count.
    abandoned: Option<usize>,
    /// Whether the incarnation stopped while its database requests were failing (or its
    /// deregistration failed, which a worker does not retry).
    stopped_on_failure: bool,
    /// The op of its deregistration, while in flight.
    deregister_op: Option<OpId>,
    /// What the worker held before its latest input, to judge its `Lost` events.
    held_before: BTreeMap<TaskId, Lease>,
    second: u64,
    requests_this_second: u32,
    /// While stalled: its timers and deliveries wait until then.
    stalled_until: Option<Instant>,
    /// The claims the incarnation abandoned (`AbandonClaim` sent), by token, and when.
    abandoned_claims: BTreeMap<u64, Instant>,
    /// Its last finish refused for its values (`Invalid`): it must never be sent again as it was.
    refused_finish: Option<Vec<Completion>>,
    /// Until when the reaper may take its runs: a fault the run injected into its requests
    /// (or a stall) can keep its heartbeats from landing for that long.
    excused_until: Option<Instant>,
    /// Until when a reap of dead workers may take its runs: its token session was cut (a
    /// token drop, a partition). Nothing else may make a live worker look dead: not a failover
    /// or a restart, which release every token of an older server incarnation.
    token_lost_until: Option<Instant>,
}

impl Slot {
    fn name(&self, index: usize) -> String {
        format!("w{index}.{}", self.incarnation)
    }
}

/// One simulation run. See the [module docs](self).
#[derive(Debug)]
pub struct Sim {
    seed: u64,
    options: SimOptions,
    epoch: Instant,
    now: Instant,
    rng: Rng,
    load_rng: Rng,
    /// The workflows' draws: their graphs and the operator's actions (a stream of its own, so
    /// that seeds without workflows draw as before).
    flow_rng: Rng,
    store: MemoryStore,
    slots: Vec<Slot>,
    queue: BTreeMap<Key, SimEvent>,
    next_seq: u64,
    trace: Trace,
    checker: Checker,
    phase: Phase,
    faults_on: bool,
    steps: u64,
    next_task: u64,
    /// Workflows submitted (their names' numbers).
    next_workflow: u64,
    /// The latest run-at of any task, and the largest retry budget of any task's policy.
    latest_run_at: DbTime,
    retry_budget_ms: u64,
    max_retries: u32,
    healed_at: Duration,
    settled_at: Duration,
    stats: Stats,
    /// Per run (task and lease), whether its handler answered a value the database refuses.
    poisoned: BTreeMap<(TaskId, Lease), bool>,
    /// Rows other transactions locked, and when the lock ended (for the ones that did).
    locked_until: BTreeMap<TaskId, Option<Instant>>,
    /// How long a fault can keep a live worker's heartbeats from landing (see `excuse`).
    excuse_window: Duration,
    /// Copies of the store, oldest first, that a failover can come back to.
    snapshots: std::collections::VecDeque<(Instant, MemoryStore)>,
    /// Tasks a failover took back in time (or forgot): workers may run them under leases the
    /// store never handed out again, or handed out to another, which fencing by lease cannot
    /// tell apart; the checks of runs against the store leave them out.
    rewound: std::collections::BTreeSet<TaskId>,
    /// Whether a failover happened.
    failed_over: bool,
    /// Whether a reaper pruned workers from the registry.
    workers_pruned: bool,
    /// Workers whose registration committed late: it may land after their deregistration
    /// and mark them running again (the registry's word until they are pruned).
    late_registrations: std::collections::BTreeSet<WorkerId>,
    /// Per slot, the tasks a client enqueued without a notification (no worker of their queue
    /// was marked waiting) that its worker, listening and not taking itself to be marked, owes
    /// a look: a claim pass applied after the enqueue whose range takes the row in. Such a
    /// worker must never wait for a wake-up while it owes one (see `check_wakeup_debts`).
    wakeup_debts: BTreeMap<usize, std::collections::BTreeSet<TaskId>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    requests: u64,
    faulted: u64,
    crashes: u64,
    starts: u64,
    spawns: u64,
    stale_spawns: u64,
    unknown_aborts: u64,
    max_per_second: u32,
    dead_workers: u64,
    broker_wakeups: u64,
    floored_passes: u64,
    bounded_passes: u64,
    /// Of workers that are gone; [`Sim::report`] adds the live ones'.
    looks: u64,
    unnotified_enqueues: u64,
    wakeup_debts: u64,
}

impl Sim {
    /// A run of `options` whose random choices follow `seed`, starting at `epoch`.
    pub fn new(seed: u64, options: SimOptions, trace: Trace, epoch: Instant) -> Sim {
        let mut rng = Rng::new(mix(seed));
        let load_rng = rng.fork();
        let slots = options
            .workers
            .iter()
            .map(|config| Slot {
                config: config.clone(),
                policy: Arc::new(ClaimPolicy::from_config(&options.app, config)),
                incarnation: 0,
                worker: None,
                listening: false,
                broker_listening: false,
                sources: WakeSources::new(1),
                handlers: BTreeMap::new(),
                restart_pending: false,
                abandoned: None,
                held_before: BTreeMap::new(),
                stopped_on_failure: false,
                deregister_op: None,
                second: 0,
                requests_this_second: 0,
                stalled_until: None,
                abandoned_claims: BTreeMap::new(),
                refused_finish: None,
                excused_until: None,
                token_lost_until: None,
            })
            .collect();
        Sim {
            seed,
            store: MemoryStore::new(options.app.clone()),
            checker: Checker::new(&options.app),
            epoch,
            now: epoch,
            rng,
            load_rng,
            flow_rng: Rng::new(mix(seed ^ 0x0F10_3F10_3F10_3F10)),
            slots,
            queue: BTreeMap::new(),
            next_seq: 0,
            trace,
            phase: Phase::Safety,
            faults_on: true,
            steps: 0,
            next_task: 0,
            next_workflow: 0,
            latest_run_at: DbTime(DB_EPOCH_MS),
            retry_budget_ms: options::retry_budget_ms(&options.app.retry),
            max_retries: options.app.retry.max_retries,
            healed_at: Duration::ZERO,
            settled_at: Duration::ZERO,
            stats: Stats::default(),
            poisoned: BTreeMap::new(),
            locked_until: BTreeMap::new(),
            excuse_window: excuse_window(&options),
            snapshots: std::collections::VecDeque::new(),
            rewound: std::collections::BTreeSet::new(),
            failed_over: false,
            workers_pruned: false,
            late_registrations: std::collections::BTreeSet::new(),
            wakeup_debts: BTreeMap::new(),
            options,
        }
    }

    /// The options of this run.
    pub fn options(&self) -> &SimOptions {
        &self.options
    }

    /// Runs to the end: the safety phase, healing, liveness and drain. A panic of the worker
    /// or the store is caught and reported as a failure with the trace.
    pub fn run(mut self) -> Result<SimReport, SimFailure> {
        let outcome = catch_unwind(AssertUnwindSafe(|| self.run_phases()));
        let message = match outcome {
            Ok(Ok(())) => return Ok(self.report()),
            Ok(Err(message)) => message,
            Err(payload) => {
                let text = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "a panic without a message".to_owned());
                format!("PANIC: {text}")
            }
        };
        self.note("sim", format_args!("FAILED: {message}"));
        Err(SimFailure {
            seed: self.seed,
            message,
            at: self.elapsed(),
            step: self.steps,
            trace_tail: self.trace.tail(FAILURE_TRACE_LINES),
            trace_hash: self.trace.hash(),
        })
    }

    fn report(&self) -> SimReport {
        let mut completed = 0;
        let mut failed = 0;
        let mut expired = 0;
        let mut paused = 0;
        let mut cancelled = 0;
        let mut skipped = 0;
        for ((_, state), n) in self.store.counts() {
            let n = n as usize;
            match state {
                TaskState::Completed => completed += n,
                TaskState::Failed => failed += n,
                TaskState::Expired => expired += n,
                TaskState::Cancelled => cancelled += n,
                TaskState::Skipped => skipped += n,
                _ => paused += n,
            }
        }
        let statuses: Vec<WorkflowStatus> = self
            .store
            .workflow_ids(usize::MAX)
            .into_iter()
            .filter_map(|id| self.store.workflow_state(id).map(|s| s.status()))
            .collect();
        let with_status = |status: WorkflowStatus| statuses.iter().filter(|&&s| s == status).count();
        SimReport {
            seed: self.seed,
            steps: self.steps,
            elapsed: self.elapsed(),
            healed_at: self.healed_at,
            settled_at: self.settled_at,
            trace_hash: self.trace.hash(),
            trace_lines: self.trace.recorded(),
            workers: self.slots.len(),
            tasks: self.checker.enqueued_count(),
            completed,
            failed,
            expired,
            paused,
            cancelled,
            skipped,
            workflows: statuses.len(),
            workflows_completed: with_status(WorkflowStatus::Completed),
            workflows_failed: with_status(WorkflowStatus::Failed),
            workflows_cancelled: with_status(WorkflowStatus::Cancelled),
            requests: self.stats.requests,
            faulted_requests: self.stats.faulted,
            crashes: self.stats.crashes,
            starts: self.stats.starts,
            spawns: self.stats.spawns,
            stale_spawns: self.stats.stale_spawns,
            fenced: self.checker.fenced,
            unknown_aborts: self.stats.unknown_aborts,
            max_requests_per_second: self.stats.max_per_second,
            dead_workers: self.stats.dead_workers,
            broker_wakeups: self.stats.broker_wakeups,
            floored_passes: self.stats.floored_passes,
            bounded_passes: self.stats.bounded_passes,
            looks: self.stats.looks
                + self.slots.iter().filter_map(|s| s.worker.as_ref()).map(|w| w.stats().looks).sum::<u64>(),
            unnotified_enqueues: self.stats.unnotified_enqueues,
            wakeup_debts: self.stats.wakeup_debts,
            faulty: self.options.faults.any(),
        }
    }

    // ---------------------------------------------------------------------------------------
    // The loop
    // ---------------------------------------------------------------------------------------

    fn run_phases(&mut self) -> Result<(), String> {
        self.setup()?;
        loop {
            if self.steps >= self.options.max_steps {
                return Err(format!("step bound: {} steps without finishing", self.options.max_steps));
            }
            self.steps += 1;
            self.snapshot();
            let timer = self.next_timer();
            let event_at = self.queue.first_key_value().map(|(key, _)| key.0);
            match (timer, event_at) {
                (Some((at, slot)), event) if event.is_none_or(|e| at < e) => {
                    self.advance(at)?;
                    self.fire_timer(slot)?;
                }
                (_, Some(_)) | (Some(_), None) => {
                    let (key, event) = self.queue.pop_first().expect("the queue has a head");
                    self.advance(key.0)?;
                    let stalled = Self::recipient(&event).and_then(|slot| self.slots[slot].stalled_until);
                    match stalled {
                        // A stalled worker gets it when it wakes, in the order it came.
                        Some(until) if until > self.now => {
                            let requeued = self.schedule(until - self.now, event);
                            self.rekey_handler(key, requeued);
                        }
                        _ => self.handle_event(key, event)?,
                    }
                }
                (None, None) => return Err("nothing left to happen: no event and no timer".into()),
            }
            self.check_workers()?;
            if self.progress()? {
                return Ok(());
            }
        }
    }

    fn setup(&mut self) -> Result<(), String> {
        let options = self.options.clone();
        let app = &options.app;
        let queues: Vec<String> = app
            .queues()
            .iter()
            .map(|q| match q.max_concurrency {
                Some(cap) => format!("{}(p{} cap {cap})", q.name, q.priority),
                None => format!("{}(p{})", q.name, q.priority),
            })
            .collect();
        let header = format!(
            "seed {} {} queues [{}] cluster_cap {:?} prefetch {} lease {:?} hb {}/{} stale {}/{} reap {} db_retry {}..{} x{} retry {}x{:?}",
            self.seed,
            if app.is_hard_cap_mode() { "hard" } else { "soft" },
            queues.join(" "),
            app.cluster_wide_cap,
            app.prefetch_buffer,
            app.claim_lease_ms,
            app.recovery.claimer_heartbeat_interval_ms,
            app.recovery.runner_heartbeat_interval_ms,
            app.recovery.claimed_stale_threshold_ms,
            app.recovery.running_stale_threshold_ms,
            app.recovery.check_interval_ms,
            app.resilience.db_retry_initial_ms,
            app.resilience.db_retry_max_ms,
            app.resilience.db_retry_max_attempts,
            app.retry.max_retries,
            app.retry.backoff,
        );
        self.note("sim", format_args!("{header}"));
        for (index, w) in options.workers.iter().enumerate() {
            self.note(
                "sim",
                format_args!(
                    "slot w{index}: concurrency {} batch {} per_worker {} queues {:?} prio {:?} {:?} poll {} timeout {:?} grace {} completions {}",
                    w.concurrency,
                    w.max_claim_batch,
                    w.max_claim_per_worker,
                    w.queues,
                    w.queue_priorities,
                    w.deployment_mode,
                    w.poll_interval_ms,
                    w.handler_timeout_ms,
                    w.shutdown_grace_ms,
                    w.completion_batch_max
                ),
            );
        }
        let load = self.options.load.clone();
        let faults = self.options.faults.clone();
        self.note(
            "sim",
            format_args!(
                "load {} tasks over {} ms; safety {} ms; faults {}: latency {}..{} ms, outages {:?}, crashes {:?}, shutdowns {:?}, listener drops {:?}, stalls {:?}, broker {:?}",
                load.tasks,
                load.enqueue_window_ms,
                options.safety_ms,
                if faults.any() { "on" } else { "off" },
                faults.latency_min_ms,
                faults.latency_max_ms,
                faults.outages,
                faults.crashes,
                faults.shutdowns,
                faults.listener_drops,
                faults.stalls,
                faults.broker
            ),
        );
        self.note(
            "sim",
            format_args!(
                "bad data and locks: poison outcomes {:.3}, db value limit {:?}, poison rows {:.3}, late commits {:.3}, row locks {:?}",
                faults.poison_outcome_chance,
                faults.db_value_limit_bytes,
                faults.poison_row_chance,
                faults.late_commit_chance,
                faults.row_locks
            ),
        );
        for slot in 0..self.slots.len() {
            self.start_worker(slot)?;
        }
        let mut left = load.tasks;
        while left > 0 {
            let count = (self.load_rng.range(1, u64::from(load.batch_max) + 1) as u32).min(left);
            left -= count;
            let at = self.load_rng.range(0, load.enqueue_window_ms.max(1));
            self.schedule_at(Duration::from_millis(at), SimEvent::Enqueue { count });
        }
        if load.workflows > 0 {
            self.note(
                "sim",
                format_args!(
                    "workflows {} of up to {} steps, allow_failed {:.2}, pause on error {:.2}, {} operator actions",
                    load.workflows,
                    load.workflow_steps_max,
                    load.allow_failed_chance,
                    load.pause_on_error_chance,
                    load.workflow_actions
                ),
            );
        }
        for _ in 0..load.workflows {
            let at = self.flow_rng.range(0, load.enqueue_window_ms.max(1));
            self.schedule_at(Duration::from_millis(at), SimEvent::SubmitWorkflow);
        }
        for _ in 0..load.workflow_actions {
            let at = self.flow_rng.range(0, self.options.safety_ms);
            self.schedule_at(Duration::from_millis(at), SimEvent::WorkflowAction);
        }
        for &(at, slot) in &faults.crashes {
            self.schedule_at(Duration::from_millis(at), SimEvent::Crash { slot });
        }
        for &(at, slot) in &faults.shutdowns {
            self.schedule_at(Duration::from_millis(at), SimEvent::Shutdown { slot });
        }
        for &(at, slot, down_ms) in &faults.listener_drops {
            self.schedule_at(Duration::from_millis(at), SimEvent::ListenerDrop { slot, down_ms });
        }
        for &(at, slot, down_ms) in faults.broker.iter().flat_map(|broker| &broker.drops) {
            self.schedule_at(Duration::from_millis(at), SimEvent::BrokerDrop { slot, down_ms });
        }
        for &(at, slot, for_ms) in &faults.stalls {
            self.schedule_at(Duration::from_millis(at), SimEvent::Stall { slot, for_ms });
        }
        for &(at, for_ms) in &faults.row_locks {
            self.schedule_at(Duration::from_millis(at), SimEvent::LockRow { for_ms });
        }
        for &(at, back_ms) in &faults.failovers {
            self.schedule_at(Duration::from_millis(at), SimEvent::Failover { back_ms });
        }
        for &(at, slot, down_ms) in &faults.token_drops {
            self.schedule_at(Duration::from_millis(at), SimEvent::TokenDrop { slot, down_ms });
        }
        self.schedule_at(Duration::from_millis(self.options.safety_ms), SimEvent::Heal);
        Ok(())
    }

    /// The earliest deadline of a live worker (a stalled one's wait for it to wake), and its
    /// slot.
    fn next_timer(&self) -> Option<(Instant, usize)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| {
                let (at, _) = slot.worker.as_ref()?.poll_timeout()?;
                Some((slot.stalled_until.map_or(at, |until| at.max(until)), index))
            })
            .min()
    }

    /// The slot an event is delivered to, if it is a delivery to a worker.
    fn recipient(event: &SimEvent) -> Option<usize> {
        match event {
            SimEvent::Reply { slot, .. }
            | SimEvent::Finished { slot, .. }
            | SimEvent::Notify { slot, .. }
            | SimEvent::Revoked { slot, .. }
            | SimEvent::Listener { slot, .. }
            | SimEvent::ListenerDrop { slot, .. }
            | SimEvent::BrokerWakeup { slot, .. }
            | SimEvent::BrokerListener { slot, .. }
            | SimEvent::BrokerDrop { slot, .. }
            | SimEvent::Shutdown { slot } => Some(*slot),
            _ => None,
        }
    }

    fn advance(&mut self, to: Instant) -> Result<(), String> {
        if to < self.now {
            return Err(format!("time went backwards: {:?} before now {:?}", to - self.epoch, self.now - self.epoch));
        }
        self.now = to;
        Ok(())
    }

    fn elapsed(&self) -> Duration {
        self.now - self.epoch
    }

    fn db_now(&self) -> DbTime {
        DbTime(DB_EPOCH_MS + self.elapsed().as_millis() as i64)
    }

    fn schedule(&mut self, delay: Duration, event: SimEvent) -> Key {
        let key = (self.now + delay, self.next_seq);
        self.next_seq += 1;
        self.queue.insert(key, event);
        key
    }

    fn schedule_at(&mut self, at: Duration, event: SimEvent) -> Key {
        let delay = (self.epoch + at).saturating_duration_since(self.now);
        self.schedule(delay, event)
    }

    fn note(&mut self, who: &str, what: fmt::Arguments<'_>) {
        let at = self.elapsed();
        self.trace.record(at, who, what);
    }

    fn is_current(&self, slot: usize, incarnation: u32) -> bool {
        let s = &self.slots[slot];
        s.worker.is_some() && s.incarnation == incarnation
    }

    // ---------------------------------------------------------------------------------------
    // Phases
    // ---------------------------------------------------------------------------------------

    /// Moves between phases; `true` when the run is over.
    fn progress(&mut self) -> Result<bool, String> {
        match self.phase {
            Phase::Safety => Ok(false),
            Phase::Liveness { deadline } => {
                let open = if self.checker.unfinished() == 0 {
                    self.checker.unfinished_workflows(&self.store)
                } else {
                    Vec::new()
                };
                if !open.is_empty() {
                    return Err(format!(
                        "NO LIVENESS: every task is terminal, but these workflows are not over: {open:?}"
                    ));
                }
                if self.checker.unfinished() == 0 {
                    self.settled_at = self.elapsed();
                    let grace = self.slots.iter().map(|s| s.config.shutdown_grace_ms).max().unwrap_or(0);
                    let deadline = self.now + Duration::from_millis(grace + 120_000);
                    self.phase = Phase::Drain { deadline };
                    self.note("sim", format_args!("every task is terminal: shutting every worker down"));
                    for slot in 0..self.slots.len() {
                        self.schedule(Duration::ZERO, SimEvent::Shutdown { slot });
                    }
                    Ok(false)
                } else if self.now > deadline {
                    let db_now = self.db_now();
                    Err(format!(
                        "NO LIVENESS: {} tasks still unfinished {:?} after healing at +{:?}:{}",
                        self.checker.unfinished(),
                        self.elapsed() - self.healed_at,
                        self.healed_at,
                        self.checker.describe_unfinished(&self.store, db_now, 10)
                    ))
                } else {
                    Ok(false)
                }
            }
            Phase::Drain { deadline } => {
                if self.slots.iter().all(|s| s.worker.is_none()) {
                    self.finish_checks()?;
                    Ok(true)
                } else if self.now > deadline {
                    let alive: Vec<String> = self
                        .slots
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.worker.is_some())
                        .map(|(i, s)| format!("{} holding {}", s.name(i), s.worker.as_ref().map_or(0, Worker::held)))
                        .collect();
                    Err(format!("NO DRAIN: workers still running after shutdown: {alive:?}"))
                } else {
                    Ok(false)
                }
            }
        }
    }

    fn heal(&mut self) -> Result<(), String> {
        self.faults_on = false;
        // Other transactions end with the faults.
        let locked: Vec<TaskId> = self.store.locked_rows().iter().copied().collect();
        for task in locked {
            self.store.unlock_row(task);
            self.locked_until.insert(task, Some(self.now));
        }
        self.healed_at = self.elapsed();
        let bound = self.liveness_bound_ms();
        self.phase = Phase::Liveness { deadline: self.now + Duration::from_millis(bound) };
        self.note("sim", format_args!("HEAL: faults off; every task must be terminal within {bound} ms"));
        if self.checker.workflow_count() > 0 {
            // The operator resumes what paused (now and again, as errors keep pausing some).
            self.resume_paused_workflows()?;
            self.schedule(Duration::from_millis(OPERATOR_SWEEP_MS), SimEvent::ResumeWorkflows);
        }
        for slot in 0..self.slots.len() {
            if self.slots[slot].worker.is_none() {
                self.start_worker(slot)?;
            } else if self.slots[slot].config.deployment_mode.listens() {
                let incarnation = self.slots[slot].incarnation;
                if !self.slots[slot].listening {
                    self.schedule(Duration::from_millis(1), SimEvent::Listener { slot, incarnation, connected: true });
                }
                if self.options.faults.broker.is_some() && !self.slots[slot].broker_listening {
                    let event = SimEvent::BrokerListener { slot, incarnation, connected: true };
                    self.schedule(Duration::from_millis(1), event);
                }
            }
        }
        Ok(())
    }

    /// How long after healing every task may take to become terminal: generous, but finite.
    fn liveness_bound_ms(&self) -> u64 {
        let app = &self.options.app;
        let r = &app.recovery;
        let load = &self.options.load;
        let slots = &self.options.workers;
        let longest_run = slots.iter().map(|w| load.longest_run_ms(w.handler_timeout_ms)).max().unwrap_or(0);
        let poll = slots.iter().map(|w| w.poll_interval_ms).max().unwrap_or(0);
        let recovery = r.running_stale_threshold_ms.max(r.claimed_stale_threshold_ms)
            + r.check_interval_ms
            + app.effective_claim_lease_ms().max(app.max_claim_renew_age_ms);
        let db_backoff = app.resilience.db_retry_max_ms * 5 / 4;
        let per_attempt = longest_run + poll + recovery + db_backoff + 5_000;
        // Throughput: the work left, spread over the narrowest cap.
        let concurrency: u32 = slots.iter().map(|w| w.concurrency).sum();
        let narrowest = app
            .queues()
            .iter()
            // A serial queue runs one task at a time: its cap is 1.
            .filter_map(|q| q.effective_cap().filter(|&cap| cap > 0))
            .chain(app.cluster_wide_cap)
            .chain([concurrency])
            .min()
            .unwrap_or(1)
            .max(1);
        let attempts = u64::from(self.max_retries.max(r.crash_retries)) + 2;
        let serial = self.checker.unfinished() as u64 * attempts * (longest_run + 200) / u64::from(narrowest);
        let run_at_left = u64::try_from(self.latest_run_at.0 - self.db_now().0).unwrap_or(0);
        // A workflow runs its levels one after the other, each as slow as one task, and may
        // pause on an error at each until the operator resumes it.
        let levels = u64::from(self.checker.workflow_levels(&self.store));
        let workflows = levels * (attempts * per_attempt + self.retry_budget_ms + OPERATOR_SWEEP_MS);
        run_at_left + attempts * per_attempt + self.retry_budget_ms + serial + workflows + 60_000
    }

    fn finish_checks(&mut self) -> Result<(), String> {
        let db_now = self.db_now();
        self.checker.check_store(&self.store, db_now, true)?;
        for row in self.store.tasks() {
            let left = matches!(row.state, TaskState::Pending) && self.checker.is_paused(&row.queue);
            if !row.state.is_terminal() && !left {
                return Err(format!("after drain task {} is {}", row.id, row.state));
            }
        }
        let stopped: BTreeMap<WorkerId, bool> =
            self.store.workers().into_iter().map(|r| (r.info.worker.clone(), r.stopped)).collect();
        for (index, slot) in self.slots.iter().enumerate() {
            let id = WorkerId(slot.name(index));
            if slot.stopped_on_failure {
                // It stopped after its grace period while a request failed (a fault of the
                // safety phase still in flight): it may leave deregistration to the registry.
                continue;
            }
            if self.failed_over
                || (self.workers_pruned && !stopped.contains_key(&id))
                || self.late_registrations.contains(&id)
            {
                // A failover may have forgotten its registration or its deregistration; the
                // reaper may have pruned it while it was silent for the registry's retention.
                continue;
            }
            if stopped.get(&id) != Some(&true) {
                return Err(format!("after drain {id} is not deregistered: {:?}", stopped.get(&id)));
            }
            if slot.abandoned != Some(0) {
                return Err(format!("{id} drained with {:?} tasks abandoned", slot.abandoned));
            }
        }
        let open = self.checker.unfinished_workflows(&self.store);
        if !open.is_empty() {
            return Err(format!("after drain these workflows are not over: {open:?}"));
        }
        self.note("sim", format_args!("done: every task terminal, every worker drained"));
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Workers
    // ---------------------------------------------------------------------------------------

    fn start_worker(&mut self, slot: usize) -> Result<(), String> {
        let s = &mut self.slots[slot];
        s.incarnation += 1;
        s.restart_pending = false;
        s.listening = false;
        s.broker_listening = false;
        let broker = self.options.faults.broker.is_some();
        s.sources = WakeSources::new(if broker { 2 } else { 1 });
        s.abandoned = None;
        s.stopped_on_failure = false;
        s.deregister_op = None;
        s.handlers.clear();
        s.abandoned_claims.clear();
        s.refused_finish = None;
        let mut config = s.config.clone();
        config.seed = config.seed.map(|seed| mix(seed ^ u64::from(s.incarnation)));
        let id = WorkerId(s.name(slot));
        let worker = Worker::new(id.clone(), self.options.app.clone(), config, self.now)
            .map_err(|e| format!("worker {id} refused its configuration: {e}"))?;
        s.worker = Some(worker);
        let (incarnation, listens) = (s.incarnation, s.config.deployment_mode.listens());
        // Its driver takes its liveness token before the machine claims anything.
        let now = self.db_now();
        if !self.store.take_token(&id, now) {
            return Err(format!("{id} could not take its liveness token: another session holds it"));
        }
        self.stats.starts += 1;
        self.note(&id.0, format_args!("start"));
        if listens {
            let delay = Duration::from_millis(self.rng.range(1, 50));
            self.schedule(delay, SimEvent::Listener { slot, incarnation, connected: true });
            if broker {
                let delay = Duration::from_millis(self.rng.range(1, 50));
                self.schedule(delay, SimEvent::BrokerListener { slot, incarnation, connected: true });
            }
        }
        self.drain(slot)
    }

    /// Ends the incarnation in `slot`: its handlers die with it.
    fn kill(&mut self, slot: usize) {
        let handlers = std::mem::take(&mut self.slots[slot].handlers);
        for handler in handlers.values() {
            if let Some(key) = handler.answer {
                self.queue.remove(&key);
            }
        }
        // Its sessions end with it, and the server releases its token.
        let id = WorkerId(self.slots[slot].name(slot));
        self.store.release_token(&id);
        // A new incarnation looks at every row in its first pass.
        self.wakeup_debts.remove(&slot);
        let s = &mut self.slots[slot];
        self.stats.looks += s.worker.as_ref().map_or(0, |w| w.stats().looks);
        s.worker = None;
        s.listening = false;
        s.broker_listening = false;
        s.stalled_until = None;
    }

    /// The worker in `slot` loses its token session until `back` from now (its process lives
    /// on, and may find its runs taken: excused).
    fn drop_token(&mut self, slot: usize, back: Duration) {
        let id = WorkerId(self.slots[slot].name(slot));
        if !self.store.holds_token(&id) {
            return;
        }
        self.store.release_token(&id);
        let now = self.now;
        self.excuse(slot, now + back);
        let until = now + back + self.excuse_window;
        let s = &mut self.slots[slot];
        s.token_lost_until = Some(s.token_lost_until.map_or(until, |at| at.max(until)));
        let incarnation = self.slots[slot].incarnation;
        self.schedule(back, SimEvent::TokenBack { slot, incarnation });
        self.note(&id.0, format_args!("TOKEN DROP for {back:?}"));
    }

    fn schedule_restart(&mut self, slot: usize) {
        let delay = match self.phase {
            Phase::Safety => self.rng.range(100, self.options.faults.restart_after_max_ms.max(100) + 1),
            Phase::Liveness { .. } => 1,
            Phase::Drain { .. } => return,
        };
        if !self.slots[slot].restart_pending {
            self.slots[slot].restart_pending = true;
            self.schedule(Duration::from_millis(delay), SimEvent::Restart { slot });
        }
    }

    fn fire_timer(&mut self, slot: usize) -> Result<(), String> {
        let now = self.now;
        let name = self.slots[slot].name(slot);
        self.snapshot_held(slot);
        let worker = self.slots[slot].worker.as_mut().expect("timers come from live workers");
        let timer = worker.poll_timeout().map(|(_, timer)| timer).expect("the slot's timer is due");
        worker.handle_timeout(now);
        let next = worker.poll_timeout();
        self.note(&name, format_args!("timer {timer:?}"));
        if let Some((at, next_timer)) = next {
            if at <= now {
                return Err(format!(
                    "BUSY LOOP: after handle_timeout({timer:?}) at +{:?} the next deadline ({next_timer:?}) is +{:?}",
                    now - self.epoch,
                    at - self.epoch
                ));
            }
        }
        self.drain(slot)
    }

    fn snapshot_held(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if let Some(worker) = &s.worker {
            s.held_before = worker.held_leases().map(|t| (t.task, t.lease)).collect();
        }
    }

    fn handle_input(&mut self, slot: usize, input: Input) -> Result<(), String> {
        self.snapshot_held(slot);
        let now = self.now;
        let worker = self.slots[slot].worker.as_mut().expect("inputs go to live workers");
        worker.handle_input(input, now);
        self.drain(slot)
    }

    /// A client's enqueue wrote `ids`: for each queue it did not notify (no worker of it marked
    /// waiting), every worker of the queue that hears notifications (listening) and does not
    /// take itself to be marked owes its tasks a look. One that takes itself to be marked while
    /// the store has no mark of it (a failover to the past lost the mark) is excused: its mark
    /// is renewed each heartbeat interval.
    fn owe_looks(&mut self, ids: &[TaskId]) {
        // Per queue, the most urgent priority written (what the statement's gate reads) and
        // the tasks.
        let mut written: BTreeMap<String, (i16, Vec<TaskId>)> = BTreeMap::new();
        for &id in ids {
            let Some(row) = self.store.task(id) else { continue };
            let (priority, tasks) = written.entry(row.queue.clone()).or_insert((row.priority, Vec::new()));
            *priority = (*priority).min(row.priority);
            if row.state == TaskState::Pending {
                tasks.push(id);
            }
        }
        let unnotified: Vec<(String, Vec<TaskId>)> = written
            .into_iter()
            .filter(|(queue, (priority, _))| !self.store.waited_on(queue, *priority))
            .map(|(queue, (_, tasks))| (queue, tasks))
            .collect();
        self.stats.unnotified_enqueues += unnotified.len() as u64;
        for (queue, tasks) in unnotified {
            for slot in 0..self.slots.len() {
                let s = &self.slots[slot];
                let owes = s.listening
                    && s.config.deployment_mode != DeploymentMode::PollingOnly
                    && s.policy.queues.iter().any(|q| q.name == queue)
                    && s.worker.as_ref().is_some_and(|w| !w.is_shutting_down() && !w.believes_waiting_marked());
                if owes {
                    self.wakeup_debts.entry(slot).or_default().extend(tasks.iter().copied());
                }
            }
        }
    }

    /// A request of the worker in `slot` applied: a regular claim pass pays the looks it owes
    /// at the rows its range takes in, and rows that are no longer Pending need no look.
    fn pay_wakeup_debts(&mut self, slot: usize, request: &DbRequest, reply: &Result<DbReply, DbFailure>) {
        let Some(debts) = self.wakeup_debts.get_mut(&slot) else { return };
        let policy = match request {
            // An urgent claim looks at the announced priorities only.
            DbRequest::Claim { policy, .. } | DbRequest::FinishAndClaim { policy, .. }
                if policy.max_priority.is_none() && reply.is_ok() =>
            {
                Some(policy)
            }
            _ => None,
        };
        let before = debts.len();
        debts.retain(|id| {
            self.store
                .task(*id)
                .is_some_and(|row| row.state == TaskState::Pending && !policy.is_some_and(|p| row.admitted_by(p)))
        });
        self.stats.wakeup_debts += (before - debts.len()) as u64;
    }

    /// A worker that owes a look at a task no notification announced must not wait for a
    /// wake-up: it would wait until a poll (or, in `EventDrivenOnly` mode, an unrelated wake-up).
    fn check_wakeup_debts(&mut self, slot: usize) -> Result<(), String> {
        let s = &self.slots[slot];
        let Some(worker) = s.worker.as_ref() else { return Ok(()) };
        let Some(debts) = self.wakeup_debts.get(&slot).filter(|debts| !debts.is_empty()) else { return Ok(()) };
        if !s.listening || worker.is_shutting_down() {
            // Deaf, it polls (and claims when it hears again); draining, it claims no more.
            self.wakeup_debts.remove(&slot);
            return Ok(());
        }
        if worker.awaits_wakeup() {
            let name = s.name(slot);
            return Err(format!(
                "LOST WAKE-UP: {name} waits for a wake-up though no notification announced tasks {} \
                 and no claim of its since looked at them",
                ids(debts)
            ));
        }
        Ok(())
    }

    /// Drains the worker in `slot` of commands and events, turning commands into events.
    fn drain(&mut self, slot: usize) -> Result<(), String> {
        loop {
            let Some(worker) = self.slots[slot].worker.as_mut() else { return Ok(()) };
            let Some(command) = worker.poll_command() else { break };
            self.on_command(slot, command)?;
        }
        let name = self.slots[slot].name(slot);
        while let Some(event) = self.slots[slot].worker.as_mut().and_then(Worker::poll_event) {
            match event {
                Event::Claimed { .. } | Event::Started { .. } => {}
                Event::Drained { abandoned } => {
                    self.slots[slot].abandoned = Some(abandoned);
                    self.note(&name, format_args!("event Drained abandoned {abandoned}"));
                }
                Event::Finished { task, state } => self.note(&name, format_args!("event Finished task {task} {state}")),
                Event::Lost { task, reason } => {
                    self.note(&name, format_args!("event Lost task {task} {reason:?}"));
                    self.check_loss(slot, &name, task, reason)?;
                }
                Event::DbUnavailable { error, .. }
                    if error.to_string().contains(crate::memory::LOCK_TIMEOUT_MESSAGE) =>
                {
                    // A lock held elsewhere holds up what waits for it, not the whole worker.
                    return Err(format!(
                        "LOCK TAKEN FOR AN OUTAGE: {name} backs off everything after a lock wait: {error}"
                    ));
                }
                other => self.note(&name, format_args!("event {other:?}")),
            }
        }
        self.check_wakeup_debts(slot)?;
        let stopped = self.slots[slot].worker.as_ref().is_some_and(Worker::is_stopped);
        if stopped {
            let s = &self.slots[slot];
            let held = s.worker.as_ref().map_or(0, Worker::held);
            if s.abandoned == Some(0) && held > 0 {
                return Err(format!("{name} drained with nothing abandoned but still holds {held} tasks"));
            }
            // A run the failover doubled (one lease, two runs) may outlive the worker's belief.
            let left: Vec<&TaskId> = s.handlers.keys().filter(|task| !self.rewound.contains(task)).collect();
            if !left.is_empty() {
                return Err(format!("{name} stopped with handlers still running: {left:?}"));
            }
            // Failing requests, or writes locks held up past the grace period (given up on: a
            // write still in flight then may land later, once the lock is gone, and end the
            // run of hold-ups before the worker stops).
            let failing = s.stopped_on_failure
                || s.worker.as_ref().is_some_and(|w| w.db_failures() > 0)
                || (s.abandoned.is_some_and(|n| n > 0)
                    && s.worker.as_ref().is_some_and(|w| w.lock_waits() > 0 || w.given_up() > 0));
            self.slots[slot].stopped_on_failure = failing;
            self.note(
                &name,
                format_args!("stopped{}: the process exits", if failing { " with the database failing" } else { "" }),
            );
            self.kill(slot);
            self.schedule_restart(slot);
        }
        Ok(())
    }

    /// A worker may drop a task only when the store no longer runs it for the worker under
    /// the lease it had: dropping a run the store still holds for it leaves the task to the
    /// reaper (a spurious `WORKER_CRASHED`, a spent retry or a failure) while the worker is
    /// healthy. (A dropped claim merely lapses and is claimed again: not judged here.)
    fn check_loss(&self, slot: usize, name: &str, task: TaskId, reason: LostReason) -> Result<(), String> {
        let Some(&lease) = self.slots[slot].held_before.get(&task) else { return Ok(()) };
        if self.rewound.contains(&task) {
            return Ok(()); // what the store says of it since a failover is no news to the worker
        }
        // A loss it is sure of (not a re-send meeting its own first send) must not be a run its
        // own finish ended.
        if reason == LostReason::LeaseLost && self.checker.finished_by(task, &WorkerId(name.to_owned()), lease) {
            return Err(format!(
                "SPURIOUS LOSS: {name} reports task {task} lease {lease} lost, but its own finish ended that run"
            ));
        }
        let Some(row) = self.store.task(task) else { return Ok(()) };
        let held = row.lease == lease && row.claimed_by.as_ref().is_some_and(|w| w.0 == name);
        if held && row.state == TaskState::Running {
            return Err(format!(
                "SPURIOUS LOSS: {name} dropped task {task} lease {lease}, which the store still has {} under that lease for it",
                row.state
            ));
        }
        Ok(())
    }

    fn on_command(&mut self, slot: usize, command: Command) -> Result<(), String> {
        let name = self.slots[slot].name(slot);
        match command {
            Command::Db { op, request } => {
                self.stats.requests += 1;
                if let DbRequest::Claim { policy, .. } | DbRequest::FinishAndClaim { policy, .. } = &request {
                    // A floor comes only after a pass that left more, which no run-at bounds.
                    self.stats.floored_passes +=
                        u64::from(policy.min_priority.is_some() && policy.min_run_at.is_none());
                    self.stats.bounded_passes += u64::from(policy.min_run_at.is_some());
                }
                let second = self.elapsed().as_secs();
                let s = &mut self.slots[slot];
                if s.second != second {
                    s.second = second;
                    s.requests_this_second = 0;
                }
                s.requests_this_second += 1;
                let per_second = s.requests_this_second;
                self.stats.max_per_second = self.stats.max_per_second.max(per_second);
                if per_second > MAX_REQUESTS_PER_SECOND {
                    return Err(format!("BUSY LOOP: {name} sent {per_second} requests in one virtual second"));
                }
                self.note(&name, format_args!("-> {} {op} {}", request.kind(), describe_request(&request)));
                let mut abandoned = Vec::new();
                match &request {
                    DbRequest::DeregisterWorker(_) => self.slots[slot].deregister_op = Some(op),
                    DbRequest::AbandonClaim { token, .. } => {
                        let now = self.now;
                        self.slots[slot].abandoned_claims.entry(*token).or_insert(now);
                    }
                    DbRequest::Heartbeat { .. } => {
                        // What the worker must still remember (a second short of its memory).
                        let remembered = ABANDONED_CLAIM_MEMORY.saturating_sub(Duration::from_secs(1));
                        let now = self.now;
                        abandoned = self.slots[slot]
                            .abandoned_claims
                            .iter()
                            .filter(|(_, at)| now.saturating_duration_since(**at) < remembered)
                            .map(|(token, _)| *token)
                            .collect();
                    }
                    DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. } => {
                        self.check_finish_sent(slot, &name, completions)?
                    }
                    _ => {}
                }
                let fate = if self.faults_on { self.options.faults.fate(&mut self.rng) } else { Fate::Delivered };
                let latency = self.latency();
                if fate != Fate::Delivered || latency > Duration::from_millis(self.options.faults.latency_max_ms) {
                    // Counted from when it reaches the database (and, below, from its answer).
                    self.excuse(slot, self.now + latency);
                }
                let incarnation = self.slots[slot].incarnation;
                let worker = WorkerId(name);
                self.schedule(latency, SimEvent::Apply { slot, incarnation, worker, op, request, fate, abandoned });
            }
            Command::Spawn(run) => self.spawn(slot, &name, run)?,
            Command::Abort { task, lease } => {
                let handler = self.slots[slot].handlers.get(&task).cloned();
                match handler {
                    Some(handler) if handler.lease == lease => {
                        self.slots[slot].handlers.remove(&task);
                        let late = self.faults_on && self.rng.chance(self.options.faults.late_finish_chance);
                        if let (Some(key), false) = (handler.answer, late) {
                            self.queue.remove(&key);
                        }
                        self.note(
                            &name,
                            format_args!(
                                "abort task {task} lease {lease}{}",
                                if late { " (its answer will still come)" } else { "" }
                            ),
                        );
                    }
                    _ => {
                        self.stats.unknown_aborts += 1;
                        self.note(&name, format_args!("abort task {task} lease {lease}: no such handler runs"));
                    }
                }
            }
        }
        Ok(())
    }

    fn spawn(&mut self, slot: usize, name: &str, run: TaskRun) -> Result<(), String> {
        self.stats.spawns += 1;
        // After a failover a task id the worker knew may name another task (the one it held was
        // forgotten, and the id written again): its belief is no news about the new row.
        let unreadable = |row: &&crate::memory::StoredTask| json_depth(&row.args) > READABLE_JSON_DEPTH;
        if let Some(row) = self.store.task(run.id).filter(unreadable).filter(|_| !self.rewound.contains(&run.id)) {
            return Err(format!(
                "SPAWNED UNREADABLE: {name} runs task {} (lease {}), whose stored arguments no reader can decode \
                 ({} levels deep)",
                run.id,
                run.lease,
                json_depth(&row.args)
            ));
        }
        if let Some(other) = self.slots[slot].handlers.get(&run.id) {
            return Err(format!(
                "{name} spawned task {} lease {} while its handler under lease {} runs",
                run.id, run.lease, other.lease
            ));
        }
        // A start without a start request (the row still Claimed by this worker under this
        // lease) checks nothing in the store: good-until is the worker's to respect. (After a
        // failover that lost writes, another worker may hold the row under the same lease
        // number: this run is then a stale one, which fencing keeps out.)
        let now = self.db_now();
        if let Some(row) = self.store.task(run.id).filter(|row| {
            row.state == TaskState::Claimed
                && row.lease == run.lease
                && row.claimed_by.as_ref().is_some_and(|w| w.0 == name)
        }) {
            if row.good_until.is_some_and(|at| at <= now) {
                return Err(format!(
                    "{name} started task {} at {} at or past its good_until {:?} without asking the store",
                    run.id, now.0, row.good_until
                ));
            }
            if row.attempts + 1 != run.attempt.0 {
                return Err(format!(
                    "{name} started task {} without asking as attempt {}, the row has {} attempts",
                    run.id, run.attempt, row.attempts
                ));
            }
        }
        let fresh = self.store.task(run.id).is_some_and(|row| {
            let started = (row.state == TaskState::Running && row.attempts == run.attempt.0)
                || (row.state == TaskState::Claimed && row.attempts + 1 == run.attempt.0);
            started && row.lease == run.lease && row.claimed_by.as_ref().is_some_and(|w| w.0 == name)
        });
        if !fresh {
            self.stats.stale_spawns += 1;
        }
        let timeout = self.slots[slot].config.handler_timeout_ms;
        let load = &self.options.load;
        let rng = &mut self.rng;
        let hangs = timeout.is_some() && load.hang_chance > 0.0 && rng.chance(load.hang_chance);
        let answer = if hangs {
            self.note(name, format_args!("spawn task {} lease {} attempt {} -> hangs", run.id, run.lease, run.attempt));
            None
        } else {
            let ms = if load.slow_chance > 0.0 && rng.chance(load.slow_chance) {
                rng.range(1_000, load.slow_max_ms + 1)
            } else {
                rng.range(1, load.duration_max_ms + 1)
            };
            let faults = &self.options.faults;
            let poison =
                self.faults_on && faults.poison_outcome_chance > 0.0 && rng.chance(faults.poison_outcome_chance);
            let outcome = if poison {
                poison_outcome(rng, faults.db_value_limit_bytes, run.id)
            } else {
                sample_outcome(rng, load, run.id)
            };
            self.poisoned.insert((run.id, run.lease), poison);
            self.note(
                name,
                format_args!(
                    "spawn task {} lease {} attempt {}{} -> {} in {ms} ms",
                    run.id,
                    run.lease,
                    run.attempt,
                    if fresh { "" } else { " (stale)" },
                    describe_outcome(&outcome)
                ),
            );
            let incarnation = self.slots[slot].incarnation;
            let event = SimEvent::Finished { slot, incarnation, task: run.id, lease: run.lease, outcome };
            Some(self.schedule(Duration::from_millis(ms), event))
        };
        self.slots[slot].handlers.insert(run.id, Handler { lease: run.lease, answer });
        Ok(())
    }

    /// A handler's answer moved in the queue: its handler entry follows it.
    fn rekey_handler(&mut self, from: Key, to: Key) {
        for slot in &mut self.slots {
            for handler in slot.handlers.values_mut() {
                if handler.answer == Some(from) {
                    handler.answer = Some(to);
                }
            }
        }
    }

    fn latency(&mut self) -> Duration {
        let faults = &self.options.faults;
        let ms = if self.faults_on {
            faults.latency_ms(&mut self.rng)
        } else {
            self.rng.range(faults.latency_min_ms, faults.latency_max_ms + 1)
        };
        Duration::from_millis(ms)
    }

    fn check_workers(&self) -> Result<(), String> {
        for slot in &self.slots {
            if let Some(worker) = &slot.worker {
                let handlers: BTreeMap<TaskId, Lease> = slot.handlers.iter().map(|(t, h)| (*t, h.lease)).collect();
                invariants::check_worker(&self.store, worker, &slot.policy, &handlers, &self.rewound)?;
            }
        }
        let handlers = self
            .slots
            .iter()
            .filter(|slot| slot.worker.is_some())
            .flat_map(|slot| slot.handlers.iter().map(|(t, h)| (*t, h.lease)));
        self.checker.check_running_handlers(&self.store, handlers, &self.rewound)
    }

    // ---------------------------------------------------------------------------------------
    // Events
    // ---------------------------------------------------------------------------------------

    fn handle_event(&mut self, key: Key, event: SimEvent) -> Result<(), String> {
        match event {
            SimEvent::Enqueue { count } => self.enqueue(count),
            SimEvent::SubmitWorkflow => self.submit_workflow(),
            SimEvent::WorkflowAction => {
                if self.faults_on {
                    self.workflow_action()
                } else {
                    Ok(())
                }
            }
            SimEvent::ResumeWorkflows => {
                if !matches!(self.phase, Phase::Liveness { .. }) {
                    return Ok(());
                }
                self.resume_paused_workflows()?;
                self.schedule(Duration::from_millis(OPERATOR_SWEEP_MS), SimEvent::ResumeWorkflows);
                Ok(())
            }
            SimEvent::Apply { slot, incarnation, worker, op, request, fate, abandoned } => {
                self.apply(slot, incarnation, worker, op, request, fate, &abandoned)
            }
            SimEvent::LateApply { worker, op, request } => {
                if matches!(request, DbRequest::RegisterWorker(_)) {
                    self.late_registrations.insert(worker.clone());
                }
                let outcome = self.apply_checked(&worker, op, &request)?;
                let said = match &outcome {
                    Ok(reply) => describe_reply(reply),
                    Err(failure) => failure.to_string(),
                };
                self.note("db", format_args!("{} {op} {worker} commits late -> {said}", request.kind()));
                Ok(())
            }
            SimEvent::LockRow { for_ms } => self.lock_row(for_ms),
            SimEvent::Failover { back_ms } => self.failover(back_ms),
            SimEvent::UnlockRow { task } => {
                if self.store.locked_rows().contains(&task) {
                    self.store.unlock_row(task);
                    self.locked_until.insert(task, Some(self.now));
                    self.note("db", format_args!("row of task {task} unlocked"));
                }
                Ok(())
            }
            SimEvent::Reply { slot, incarnation, op, reply } => {
                if !self.is_current(slot, incarnation) {
                    return Ok(());
                }
                let name = self.slots[slot].name(slot);
                if reply.is_err() && self.slots[slot].deregister_op == Some(op) {
                    self.slots[slot].stopped_on_failure = true;
                }
                match &reply {
                    Ok(_) => self.note(&name, format_args!("<- {op} ok")),
                    Err(failure) => self.note(&name, format_args!("<- {op} {failure}")),
                }
                self.handle_input(slot, Input::Db { op, reply })
            }
            SimEvent::Finished { slot, incarnation, task, lease, outcome } => {
                if !self.is_current(slot, incarnation) {
                    return Ok(());
                }
                let s = &mut self.slots[slot];
                if s.handlers.get(&task).is_some_and(|h| h.answer == Some(key)) {
                    s.handlers.remove(&task);
                }
                let name = s.name(slot);
                self.note(
                    &name,
                    format_args!("handler of task {task} lease {lease} returned {}", describe_outcome(&outcome)),
                );
                self.handle_input(slot, Input::TaskFinished { task, lease, outcome })
            }
            SimEvent::Notify { slot, incarnation, queue, priority, run_at } => {
                if !self.is_current(slot, incarnation) || !self.slots[slot].listening {
                    return Ok(());
                }
                let name = self.slots[slot].name(slot);
                self.note(&name, format_args!("notified {queue} {priority:?} {run_at:?}"));
                self.handle_input(slot, Input::Notified { queue, priority, run_at })
            }
            SimEvent::Revoked { slot, incarnation, tasks } => {
                if !self.is_current(slot, incarnation) || !self.slots[slot].listening {
                    return Ok(());
                }
                let name = self.slots[slot].name(slot);
                self.note(&name, format_args!("revoked {}", ids(&tasks)));
                self.handle_input(slot, Input::Revoked { tasks })
            }
            SimEvent::Listener { slot, incarnation, connected } => {
                self.source_event(slot, incarnation, LISTEN_SOURCE, connected)
            }
            SimEvent::BrokerWakeup { slot, incarnation, queue, priority } => {
                if !self.is_current(slot, incarnation) || !self.slots[slot].broker_listening {
                    return Ok(());
                }
                let name = self.slots[slot].name(slot);
                self.note(&name, format_args!("broker woke {queue} {priority:?}"));
                self.stats.broker_wakeups += 1;
                self.handle_input(slot, Input::Notified { queue, priority, run_at: None })
            }
            SimEvent::BrokerListener { slot, incarnation, connected } => {
                self.source_event(slot, incarnation, BROKER_SOURCE, connected)
            }
            SimEvent::BrokerDrop { slot, down_ms } => {
                if self.slots[slot].worker.is_none() || !self.slots[slot].broker_listening || !self.faults_on {
                    return Ok(());
                }
                let incarnation = self.slots[slot].incarnation;
                let back = SimEvent::BrokerListener { slot, incarnation, connected: true };
                self.schedule(Duration::from_millis(down_ms), back);
                self.handle_event(key, SimEvent::BrokerListener { slot, incarnation, connected: false })
            }
            SimEvent::ListenerDrop { slot, down_ms } => {
                if self.slots[slot].worker.is_none() || !self.slots[slot].listening || !self.faults_on {
                    return Ok(());
                }
                let incarnation = self.slots[slot].incarnation;
                self.schedule(
                    Duration::from_millis(down_ms),
                    SimEvent::Listener { slot, incarnation, connected: true },
                );
                self.handle_event(key, SimEvent::Listener { slot, incarnation, connected: false })
            }
            SimEvent::TokenDrop { slot, down_ms } => {
                if self.slots[slot].worker.is_none() || !self.faults_on {
                    return Ok(());
                }
                self.drop_token(slot, Duration::from_millis(down_ms));
                Ok(())
            }
            SimEvent::TokenBack { slot, incarnation } => {
                if self.is_current(slot, incarnation) {
                    let id = WorkerId(self.slots[slot].name(slot));
                    let now = self.db_now();
                    if self.store.take_token(&id, now) {
                        self.note(&id.0, format_args!("token taken again"));
                    }
                }
                Ok(())
            }
            SimEvent::Stall { slot, for_ms } => {
                // A stall matters when the worker holds work: take the busiest live worker
                // (the drawn slot when none holds anything).
                let busiest = (0..self.slots.len())
                    .filter_map(|i| Some((self.slots[i].worker.as_ref()?.held(), i)))
                    .filter(|&(held, _)| held > 0)
                    .max_by_key(|&(held, i)| (held, std::cmp::Reverse(i)));
                let slot = busiest.map_or(slot, |(_, i)| i);
                if self.slots[slot].worker.is_none()
                    || self.slots[slot].stalled_until.is_some_and(|until| until > self.now)
                    || !self.faults_on
                {
                    return Ok(());
                }
                let until = self.now + Duration::from_millis(for_ms);
                self.slots[slot].stalled_until = Some(until);
                self.excuse(slot, until);
                if self.options.faults.stalls_drop_tokens {
                    // A partition: the server ends its token session too, until it wakes.
                    self.drop_token(slot, Duration::from_millis(for_ms));
                }
                let name = self.slots[slot].name(slot);
                self.note(&name, format_args!("STALL for {for_ms} ms (its handlers run on)"));
                Ok(())
            }
            SimEvent::Crash { slot } => {
                if self.slots[slot].worker.is_none() || !self.faults_on {
                    return Ok(());
                }
                self.stats.crashes += 1;
                let name = self.slots[slot].name(slot);
                let held = self.slots[slot].worker.as_ref().map_or(0, Worker::held);
                self.note(
                    &name,
                    format_args!("CRASH holding {held} tasks, {} handlers die", self.slots[slot].handlers.len()),
                );
                self.kill(slot);
                self.schedule_restart(slot);
                Ok(())
            }
            SimEvent::Shutdown { slot } => {
                if self.slots[slot].worker.is_none() {
                    return Ok(());
                }
                let name = self.slots[slot].name(slot);
                self.note(&name, format_args!("shutdown requested"));
                self.handle_input(slot, Input::Shutdown)
            }
            SimEvent::Restart { slot } => {
                self.slots[slot].restart_pending = false;
                if self.slots[slot].worker.is_some() || matches!(self.phase, Phase::Drain { .. }) {
                    return Ok(());
                }
                self.start_worker(slot)
            }
            SimEvent::Heal => self.heal(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn apply(
        &mut self,
        slot: usize,
        incarnation: u32,
        worker: WorkerId,
        op: OpId,
        request: DbRequest,
        fate: Fate,
        abandoned: &[u64],
    ) -> Result<(), String> {
        let faults = &self.options.faults;
        if !self.is_current(slot, incarnation) {
            // The sender died with the request on the wire: it may still commit.
            if self.rng.chance(faults.dead_apply_chance) {
                let reply = self.apply_checked(&worker, op, &request)?;
                let said = match &reply {
                    Ok(reply) => describe_reply(reply),
                    Err(failure) => failure.to_string(),
                };
                self.note("db", format_args!("{} {op} {worker} (sender dead) -> {said}", request.kind()));
            }
            return Ok(());
        }
        let at_ms = self.elapsed().as_millis() as u64;
        let fate = if self.faults_on && faults.in_outage(at_ms) { Fate::Unavailable } else { fate };
        let unknown_after = Duration::from_millis(self.rng.range(1, faults.unknown_after_max_ms.max(1) + 1));
        if fate != Fate::Delivered {
            // The worker hears of it `unknown_after` later at the latest.
            self.excuse(slot, self.now + unknown_after.max(Duration::from_millis(faults.latency_max_ms)));
        }
        let (reply, delay) = match fate {
            Fate::Unavailable => (Err(DbFailure::Unavailable("connection refused (injected)".into())), self.latency()),
            Fate::Rejected => (Err(DbFailure::Rejected("rejected (injected)".into())), self.latency()),
            Fate::LostRequest => (Err(DbFailure::Unknown("request lost (injected)".into())), unknown_after),
            Fate::LostReply => {
                // Applied (or refused) all the same: the reply is what is lost.
                let reply = self.apply_checked(&worker, op, &request)?;
                self.pay_wakeup_debts(slot, &request, &reply);
                (Err(DbFailure::Unknown("reply lost (injected)".into())), unknown_after)
            }
            Fate::LateCommit => {
                let later = unknown_after + Duration::from_millis(self.rng.range(1, 3_001));
                self.schedule(later, SimEvent::LateApply { worker: worker.clone(), op, request: request.clone() });
                (Err(DbFailure::Unknown("no reply in time; it commits later (injected)".into())), unknown_after)
            }
            Fate::Delivered => {
                let reply = self.apply_checked(&worker, op, &request)?;
                self.pay_wakeup_debts(slot, &request, &reply);
                self.check_applied(slot, &worker, &request, &reply, abandoned)?;
                let mut latency = self.latency();
                if matches!(reply, Err(DbFailure::LockTimeout(_))) {
                    // It waited for the lock until the server gave up.
                    latency += Duration::from_millis(crate::memory::LOCK_TIMEOUT_MS);
                }
                if latency > Duration::from_millis(self.options.faults.latency_max_ms) && reply.is_ok() {
                    self.excuse(slot, self.now + latency);
                }
                (reply, latency)
            }
        };
        if fate != Fate::Delivered {
            self.stats.faulted += 1;
            self.note("db", format_args!("{} {op} {worker} fault {fate:?}", request.kind()));
        }
        let duplicate = self.faults_on && self.rng.chance(self.options.faults.duplicate_reply_chance);
        if duplicate {
            let later = delay + self.latency();
            self.schedule(later, SimEvent::Reply { slot, incarnation, op, reply: reply.clone() });
        }
        self.schedule(delay, SimEvent::Reply { slot, incarnation, op, reply });
        Ok(())
    }

    /// Applies `request` to the store with every check around it. The store may refuse it as
    /// PostgreSQL would ([`MemoryStore::execute`]: a value it cannot hold, a lock it waited for
    /// too long), and so may the run's own limit on stored values.
    fn apply_checked(
        &mut self,
        worker: &WorkerId,
        op: OpId,
        request: &DbRequest,
    ) -> Result<Result<DbReply, DbFailure>, String> {
        if let Some((finish, claim)) = request.finish_then_claim() {
            // One statement: the finish, then the claim in what the finish left, each checked
            // as if alone. A failure fails both (nothing applied). The finished steps'
            // workflows settle when both are done: the claim does not take what they promote.
            self.store.hold_statement();
            let finished = self.apply_checked(worker, op, &finish)?;
            let claimed = match &finished {
                Ok(_) => Some(self.apply_checked(worker, op, &claim)?),
                Err(_) => None,
            };
            let now = self.db_now();
            self.store.end_statement(now);
            self.checker.check_store(&self.store, now, false)?;
            self.notify();
            let finished = match finished {
                Ok(reply) => reply,
                Err(failure) => return Ok(Err(failure)),
            };
            let claimed = claimed
                .expect("claimed after a finish that applied")
                .map_err(|failure| format!("the claim of a finish-and-claim failed after its finish: {failure}"))?;
            return DbReply::finished_and_claimed(finished, claimed)
                .map(Ok)
                .ok_or_else(|| "a finish and a claim answered as something else".to_owned());
        }
        let now = self.db_now();
        if let (Some(limit), DbRequest::Finish { completions, .. }) =
            (self.options.faults.db_value_limit_bytes, request)
        {
            let over = completions.iter().any(|c| match &c.outcome {
                FinishOutcome::Completed(result) => crate::store::check_storable(result, limit).is_err(),
                _ => false,
            });
            if over {
                let failure = DbFailure::Invalid(format!("a value over the database's limit of {limit} bytes"));
                self.note("db", format_args!("{} {op} {worker} -> refused: {failure}", request.kind()));
                return Ok(Err(failure));
            }
        }
        let before = self.checker.before(&self.store, request, now);
        // The holders of the runs a reap may end, to judge below.
        let runs: Vec<(TaskId, Option<WorkerId>, Lease)> = match request {
            DbRequest::Reap { .. } | DbRequest::ReapDead { .. } => self
                .store
                .tasks()
                .take_while(|row| !row.state.is_terminal())
                .filter(|row| row.state == TaskState::Running)
                .map(|row| (row.id, row.claimed_by.clone(), row.lease))
                .collect(),
            _ => Vec::new(),
        };
        let reply = match self.store.execute(request, now) {
            Ok(reply) => reply,
            Err(failure) => {
                self.note("db", format_args!("{} {op} {worker} -> refused: {failure}", request.kind()));
                if matches!(request, DbRequest::Heartbeat { .. }) {
                    return Err(format!("a heartbeat of {worker} was refused ({failure}): beats skip locked rows"));
                }
                return Ok(Err(failure));
            }
        };
        self.note("db", format_args!("{} {op} {worker} -> {}", request.kind(), describe_reply(&reply)));
        if let DbReply::Reaped(report) = &reply {
            self.workers_pruned |= report.workers_pruned > 0;
            self.stats.dead_workers += report.dead_workers.len() as u64;
            let dead = matches!(request, DbRequest::ReapDead { .. });
            for id in report.retried.iter().chain(&report.failed) {
                if let Some((_, Some(holder), lease)) = runs.iter().find(|(task, _, _)| task == id) {
                    self.check_reaped_run(*id, holder, *lease, dead)?;
                }
            }
        }
        self.checker.after(&self.store, worker, request, &before, &reply, now)?;
        self.checker.check_store(&self.store, now, false)?;
        self.notify();
        Ok(Ok(reply))
    }

    /// Checks what a delivered request did for its live worker in `slot`: a finish refused for
    /// its values is remembered (it must never be sent again as it was), and a heartbeat leaves
    /// no row of a claim the worker abandoned before sending it (`abandoned`) behind.
    fn check_applied(
        &mut self,
        slot: usize,
        worker: &WorkerId,
        request: &DbRequest,
        reply: &Result<DbReply, DbFailure>,
        abandoned: &[u64],
    ) -> Result<(), String> {
        match (request, reply) {
            (
                DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. },
                Err(DbFailure::Invalid(_)),
            ) => {
                self.slots[slot].refused_finish = Some(completions.clone());
            }
            (DbRequest::Heartbeat { claimed, running, .. }, Ok(_)) if !abandoned.is_empty() => {
                let locked = self.store.locked_rows();
                // A row the beat names under its current lease is the worker's (after a failover
                // a late claim can hand it the very leases it holds).
                let named = |row: &crate::memory::StoredTask| {
                    claimed.iter().chain(running).any(|t| t.task == row.id && t.lease == row.lease)
                };
                let orphan = self.store.tasks().take_while(|row| !row.state.is_terminal()).find(|row| {
                    row.claimed_by.as_ref() == Some(worker)
                        && row.claim_token.is_some_and(|token| abandoned.contains(&token))
                        && !locked.contains(&row.id)
                        && !named(row)
                });
                if let Some(row) = orphan {
                    return Err(format!(
                        "ORPHAN: task {} is still {} under claim {:?} of {worker}, which the worker abandoned before this \
                         heartbeat: a claim that committed late keeps a task nobody runs",
                        row.id, row.state, row.claim_token
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Checks a finish `name` sends: nothing the worker could have known the database refuses
    /// (U+0000, a value over its own `max_result_bytes`), no healthy outcome written as refused,
    /// and not the batch the database last refused for its values, as it was.
    fn check_finish_sent(&mut self, slot: usize, name: &str, completions: &[Completion]) -> Result<(), String> {
        let max = self.slots[slot].config.max_result_bytes;
        if self.slots[slot].refused_finish.as_deref() == Some(completions) {
            return Err(format!("{name} sent again, unchanged, the finish the database refused for its values"));
        }
        for c in completions {
            let values = match &c.outcome {
                FinishOutcome::Completed(result) => crate::store::check_storable(result, max),
                FinishOutcome::Failed(error) | FinishOutcome::Retry { error, .. } => {
                    crate::store::check_storable_error(error, max)
                }
            };
            let args = c.args.as_ref().map_or(Ok(0), |args| crate::store::check_storable(args, max));
            if let Err(problem) = values.and(args) {
                return Err(format!(
                    "UNCHECKED OUTCOME: {name} sent task {}'s outcome, which cannot be stored ({problem}): it fails the \
                     whole batch",
                    c.task.task
                ));
            }
            let refused = match &c.outcome {
                FinishOutcome::Failed(error) | FinishOutcome::Retry { error, .. } => {
                    error.code == ErrorCode::WorkerSerializationError
                        && (error.message.starts_with("the handler's outcome could not be stored")
                            || error.message.starts_with("the database refused the task's outcome"))
                }
                FinishOutcome::Completed(_) => false,
            };
            // After a failover one lease may have had two runs: their answers cannot be told apart.
            let ran_twice = self.rewound.contains(&c.task.task);
            if refused && !ran_twice && self.poisoned.get(&(c.task.task, c.task.lease)) == Some(&false) {
                return Err(format!(
                    "HEALTHY OUTCOME REFUSED: {name} writes task {} lease {} as refused, but its handler's answer was \
                     sound",
                    c.task.task, c.task.lease
                ));
            }
        }
        Ok(())
    }

    /// A run the reaper ended as crashed must not belong to a healthy worker: one alive and
    /// holding it, none of whose requests met a fault of the run (or a stall) lately, and whose
    /// row no other transaction locked lately. Such a worker's heartbeats land, and keep the
    /// run fresh; that the reaper took it says something kept them from renewing it (one
    /// locked row holding up the beat of the others, a lock wait that backed off every
    /// request as an outage would).
    ///
    /// A reap of dead workers (`by_token`) may take a live worker's run only while that
    /// worker's token session is cut: faults of its requests, a failover or a restart never
    /// make a live worker look dead.
    fn check_reaped_run(&self, task: TaskId, holder: &WorkerId, lease: Lease, by_token: bool) -> Result<(), String> {
        let Some(slot) =
            (0..self.slots.len()).find(|&i| self.slots[i].worker.is_some() && self.slots[i].name(i) == holder.0)
        else {
            return Ok(()); // its worker is dead
        };
        let s = &self.slots[slot];
        if by_token {
            let cut = s.token_lost_until.is_some_and(|until| until > self.now);
            if !cut {
                return Err(format!(
                    "LIVE WORKER FOUND DEAD: a reap of dead workers ended task {task} lease {lease} of {holder}, which \
                     is alive and whose token session was never cut lately"
                ));
            }
            return Ok(());
        }
        let holds = s.worker.as_ref().is_some_and(|w| w.held_leases().any(|t| t.task == task && t.lease == lease));
        let excused = s.excused_until.is_some_and(|until| until > self.now);
        let locked =
            self.locked_until.get(&task).is_some_and(|until| until.is_none_or(|at| at + self.excuse_window > self.now));
        if holds && !excused && !locked {
            return Err(format!(
                "HEALTHY TASK REAPED: the reaper ended task {task} lease {lease} as crashed, but {holder} holds it, is \
                 alive, and none of its requests met a fault for {:?}",
                self.excuse_window
            ));
        }
        Ok(())
    }

    /// Keeps a copy of the store every half second of the safety phase, for the failovers to
    /// come back to (no copies without failovers).
    fn snapshot(&mut self) {
        let Some(longest) = self.options.faults.failovers.iter().map(|&(_, back)| back).max() else { return };
        if !self.faults_on {
            self.snapshots.clear();
            return;
        }
        let due = self.snapshots.back().is_none_or(|(at, _)| self.now >= *at + Duration::from_millis(500));
        if due {
            self.snapshots.push_back((self.now, self.store.clone()));
        }
        while self.snapshots.front().is_some_and(|(at, _)| *at + Duration::from_millis(longest + 1_000) < self.now) {
            self.snapshots.pop_front();
        }
    }

    /// The database comes back as it was `back_ms` ago: every write since is gone. The
    /// workers carry on with what they believe; the store is the truth from now on.
    fn failover(&mut self, back_ms: u64) -> Result<(), String> {
        if !self.faults_on {
            return Ok(());
        }
        let Some(target) = self.now.checked_sub(Duration::from_millis(back_ms)) else { return Ok(()) };
        let Some(index) = self.snapshots.iter().rposition(|(at, _)| *at <= target) else { return Ok(()) };
        let (at, mut restored) = self.snapshots[index].clone();
        // Other transactions died with the old primary's connections.
        let locked: Vec<TaskId> = restored.locked_rows().iter().copied().collect();
        for task in locked {
            restored.unlock_row(task);
        }
        restored.take_notifications();
        // Every task whose row the failover changed (or forgot).
        for row in self.store.tasks() {
            if restored.task(row.id).is_none_or(|was| was != row) {
                self.rewound.insert(row.id);
            }
        }
        self.store = restored;
        // A new server incarnation: every session, and every token, ended.
        self.store.restart_server();
        self.failed_over = true;
        self.locked_until.clear();
        self.snapshots.clear();
        self.checker = self.checker.rebuild(&self.options.app, &self.store);
        let now = self.now;
        for slot in 0..self.slots.len() {
            // Heartbeats from before the failover are gone: the reaper may find runs stale.
            self.excuse(slot, now);
            // The old primary's connections are gone, listeners' too: they connect again (and
            // catch up on what they could not hear).
            if self.slots[slot].worker.is_some() && self.slots[slot].listening {
                let incarnation = self.slots[slot].incarnation;
                self.schedule(Duration::ZERO, SimEvent::Listener { slot, incarnation, connected: false });
                let back = Duration::from_millis(self.rng.range(10, 1_000));
                self.schedule(back, SimEvent::Listener { slot, incarnation, connected: true });
            }
            // Token connections too: each takes its token again once it reconnects, after
            // its backoff (often longer than the liveness grace).
            if self.slots[slot].worker.is_some() {
                let incarnation = self.slots[slot].incarnation;
                let back = Duration::from_millis(self.rng.range(10, 8_000));
                self.schedule(back, SimEvent::TokenBack { slot, incarnation });
            }
        }
        self.note(
            "db",
            format_args!("FAILOVER: the database comes back as it was at +{:?} ({back_ms} ms ago)", at - self.epoch),
        );
        self.checker.check_store(&self.store, self.db_now(), true)
    }

    /// Excuses the worker in `slot` from keeping its runs fresh until `from` plus the window.
    fn excuse(&mut self, slot: usize, from: Instant) {
        let until = from + self.excuse_window;
        let s = &mut self.slots[slot];
        s.excused_until = Some(s.excused_until.map_or(until, |at| at.max(until)));
    }

    /// Locks a row in flight for `for_ms`, as another transaction would (an application's
    /// transaction that enqueued the key a running task holds, an operator's statement):
    /// heartbeats, finishes and the reaper must get past it. (A Pending row locked by a
    /// transaction that never notifies its queue is left to polls: workers that only listen
    /// come back for it at the next notification, as for a lost one.)
    fn lock_row(&mut self, for_ms: u64) -> Result<(), String> {
        if !self.faults_on {
            return Ok(());
        }
        let locked = self.store.locked_rows().clone();
        let live: Vec<(TaskId, TaskState)> = self
            .store
            .tasks()
            .take_while(|row| !row.state.is_terminal())
            .filter(|row| !locked.contains(&row.id))
            .map(|row| (row.id, row.state))
            .collect();
        // Not a waiting step either: the memory store promotes it without waiting for a lock
        // (in PostgreSQL the statement that finishes its parents would).
        let pool: Vec<TaskId> = live
            .iter()
            .filter(|(_, state)| !matches!(state, TaskState::Pending | TaskState::Waiting))
            .map(|(id, _)| *id)
            .collect();
        if pool.is_empty() {
            return Ok(());
        }
        let task = pool[self.rng.range(0, pool.len() as u64) as usize];
        self.store.lock_row(task);
        self.locked_until.insert(task, None);
        self.note("db", format_args!("ROW LOCK: another transaction locks task {task} for {for_ms} ms"));
        self.schedule(Duration::from_millis(for_ms), SimEvent::UnlockRow { task });
        Ok(())
    }

    /// Delivers the store's notifications to every listening worker, with faults.
    fn notify(&mut self) {
        let notifications = self.store.take_notifications();
        self.deliver_notifications(notifications);
    }

    /// Delivers `notifications` to every listening worker, with faults.
    fn deliver_notifications(&mut self, notifications: Vec<Notification>) {
        for notification in notifications {
            match notification {
                Notification::TaskReady { queue, priority, run_at } => {
                    // PostgreSQL does not drop a NOTIFY on a live LISTEN session: notifications
                    // are lost with the connection (listener drops). Random loss is injected
                    // only where a poll makes up for it; in EventDrivenOnly mode it would be lost
                    // by design ("a lost notification leaves work waiting until the next one").
                    let wire = self.notify_wire();
                    let lost = self.deliver_to_listeners(
                        LISTEN_SOURCE,
                        wire,
                        |slot| slot.config.deployment_mode != DeploymentMode::EventDrivenOnly,
                        |slot, incarnation| SimEvent::Notify {
                            slot,
                            incarnation,
                            queue: queue.clone(),
                            priority,
                            run_at,
                        },
                    );
                    if !lost.is_empty() {
                        self.note("db", format_args!("notify {queue}: lost for slots {lost:?}"));
                    }
                }
                // A workflow's cancel took claimed and running steps from their holders: lost
                // (the next heartbeat makes up for it in every mode), duplicated, delayed.
                Notification::TasksRevoked { tasks } => {
                    let wire = self.notify_wire();
                    let lost = self.deliver_to_listeners(
                        LISTEN_SOURCE,
                        wire,
                        |_| true,
                        |slot, incarnation| SimEvent::Revoked { slot, incarnation, tasks: tasks.clone() },
                    );
                    if !lost.is_empty() {
                        self.note("db", format_args!("revoked {}: lost for slots {lost:?}", ids(&tasks)));
                    }
                }
                _ => {}
            }
        }
    }

    /// Wake-up source `source` of the worker in `slot` ([`LISTEN_SOURCE`] or [`BROKER_SOURCE`])
    /// connected or was lost: the machine hears of it as its driver reports it, for all its
    /// sources at once.
    fn source_event(&mut self, slot: usize, incarnation: u32, source: usize, connected: bool) -> Result<(), String> {
        if !self.is_current(slot, incarnation) {
            return Ok(());
        }
        let s = &mut self.slots[slot];
        let up = if source == LISTEN_SOURCE { &mut s.listening } else { &mut s.broker_listening };
        if *up == connected {
            return Ok(());
        }
        *up = connected;
        let what = match (source == LISTEN_SOURCE, connected) {
            (true, true) => "listener connected",
            (true, false) => "listener lost",
            (false, true) => "broker subscription up",
            (false, false) => "broker subscription lost",
        };
        let name = self.slots[slot].name(slot);
        self.note(&name, format_args!("{what}"));
        match self.slots[slot].sources.update(source, connected) {
            Some(input) => self.handle_input(slot, input),
            None => Ok(()),
        }
    }

    /// Publishes the wake-ups of an enqueue on the broker: each subscribed worker gets it
    /// lost (where a poll makes up for it), duplicated, and delayed by its own draw.
    fn publish_to_broker(&mut self, queue: &str, priority: Option<i16>) {
        let Some(broker) = &self.options.faults.broker else { return };
        let wire =
            Wire { loss: broker.loss_chance, duplicate: broker.duplicate_chance, delay_max_ms: broker.delay_max_ms };
        let lost = self.deliver_to_listeners(
            BROKER_SOURCE,
            wire,
            |slot| slot.config.deployment_mode != DeploymentMode::EventDrivenOnly,
            |slot, incarnation| SimEvent::BrokerWakeup { slot, incarnation, queue: queue.to_owned(), priority },
        );
        if !lost.is_empty() {
            self.note("broker", format_args!("wake-up of {queue}: lost for slots {lost:?}"));
        }
    }

    /// The faults of PostgreSQL's notifications on their way to a listener.
    fn notify_wire(&self) -> Wire {
        let faults = &self.options.faults;
        Wire {
            loss: faults.notify_loss_chance,
            duplicate: faults.notify_duplicate_chance,
            delay_max_ms: faults.notify_delay_max_ms,
        }
    }

    /// Schedules `event` for every worker whose wake-up source `source` is up, with `wire`'s
    /// faults: lost (where `may_lose` says a loss is made up for), duplicated, delayed. Returns
    /// the slots it was lost for. The random draws come in the same order for every kind of
    /// event, so seeds replay.
    fn deliver_to_listeners(
        &mut self,
        source: usize,
        wire: Wire,
        may_lose: impl Fn(&Slot) -> bool,
        event: impl Fn(usize, u32) -> SimEvent,
    ) -> Vec<usize> {
        let mut lost = Vec::new();
        for slot in 0..self.slots.len() {
            let s = &self.slots[slot];
            let up = if source == LISTEN_SOURCE { s.listening } else { s.broker_listening };
            if s.worker.is_none() || !up {
                continue;
            }
            if self.faults_on && may_lose(&self.slots[slot]) && self.rng.chance(wire.loss) {
                lost.push(slot);
                continue;
            }
            let copies = if self.faults_on && self.rng.chance(wire.duplicate) { 2 } else { 1 };
            let incarnation = self.slots[slot].incarnation;
            for _ in 0..copies {
                let delay = Duration::from_millis(self.rng.range(0, wire.delay_max_ms + 1));
                self.schedule(delay, event(slot, incarnation));
            }
        }
        lost
    }

    // ---------------------------------------------------------------------------------------
    // The client
    // ---------------------------------------------------------------------------------------

    fn enqueue(&mut self, count: u32) -> Result<(), String> {
        let now = self.db_now();
        let load = self.options.load.clone();
        let queues = self.options.app.queues();
        let mut batch = Vec::new();
        for _ in 0..count {
            let rng = &mut self.load_rng;
            let n = self.next_task;
            self.next_task += 1;
            let mut task = NewTask::new("job", json!({ "n": n }));
            if queues.len() > 1 || rng.chance(0.5) {
                task.queue = Some(queues[rng.range(0, queues.len() as u64) as usize].name.clone());
            }
            let spread = i64::from(load.priority_spread);
            task.priority = (rng.range(0, (2 * spread + 1) as u64) as i64 - spread) as i16;
            let delay_ms = if rng.chance(load.delay_chance) { rng.range(1, load.delay_max_ms + 1) } else { 0 };
            task.run_at = match (delay_ms, rng.range(0, 3)) {
                (0, 0) => RunAt::At(DbTime(now.0 - 5_000)),
                (0, _) => RunAt::Now,
                (ms, 0) => RunAt::At(now.plus_ms(ms)),
                (ms, _) => RunAt::DelayMs(ms),
            };
            if rng.chance(load.good_until_chance) {
                task.good_until = Some(now.plus_ms(delay_ms + rng.range(1, load.good_until_max_ms + 1)));
            }
            if rng.chance(load.retry_chance) {
                let policy = options::swarm_retry(rng);
                self.retry_budget_ms = self.retry_budget_ms.max(options::retry_budget_ms(&policy));
                self.max_retries = self.max_retries.max(policy.max_retries);
                task.retry = Some(policy);
            }
            if rng.chance(load.key_chance) {
                task.key = Some(format!("key-{n}"));
            }
            self.latest_run_at = self.latest_run_at.max(now.plus_ms(delay_ms));
            batch.push(task);
        }
        let keyed: Vec<NewTask> = batch.iter().filter(|t| t.key.is_some()).cloned().collect();
        let ids = self.store.enqueue_many(batch, now).map_err(|e| format!("enqueue refused: {e}"))?;
        if keyed.is_empty() && self.options.faults.broker.is_none() {
            self.owe_looks(&ids);
            // A worker waiting already must not owe a look.
            let owing: Vec<usize> = self.wakeup_debts.keys().copied().collect();
            for slot in owing {
                self.check_wakeup_debts(slot)?;
            }
        }
        if self.options.faults.broker.is_some() {
            // The client announces its enqueue on the broker once it committed, each queue with
            // its most urgent priority (whether a worker waits or not); the statement notified
            // nobody, unless a task had a key (a function that always notifies).
            let notifications = self.store.take_notifications();
            let mut announced: BTreeMap<String, i16> = BTreeMap::new();
            for row in ids.iter().filter_map(|id| self.store.task(*id)) {
                let priority = announced.entry(row.queue.clone()).or_insert(row.priority);
                *priority = (*priority).min(row.priority);
            }
            for (queue, priority) in announced {
                self.publish_to_broker(&queue, Some(priority));
            }
            let notified = notifications
                .into_iter()
                .filter(|n| !keyed.is_empty() || !matches!(n, Notification::TaskReady { .. }))
                .collect();
            self.deliver_notifications(notified);
        }
        for &id in &ids {
            self.checker.enqueued(id)?;
        }
        let listed: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
        self.note("client", format_args!("enqueue {} -> [{}]", ids.len(), listed.join(" ")));
        self.checker.check_store(&self.store, now, false)?;
        // An enqueue retried with the same idempotency key (its first reply was lost) gets the
        // same task back and writes nothing.
        for task in keyed {
            let key = task.key.clone().unwrap_or_default();
            let before = self.checker.enqueued_count();
            let id = self.store.enqueue(task, now).map_err(|e| format!("re-enqueue with key {key} refused: {e}"))?;
            self.checker.enqueued(id)?;
            if self.checker.enqueued_count() != before {
                return Err(format!("re-enqueue with key {key} created task {id}"));
            }
            self.checker.check_store(&self.store, now, false)?;
        }
        if load.cancel_chance > 0.0 && self.load_rng.chance(load.cancel_chance) {
            self.cancel_one(now)?;
        }
        let faults = &self.options.faults;
        if self.faults_on && faults.poison_row_chance > 0.0 && self.rng.chance(faults.poison_row_chance) {
            // Another producer writes a row by hand, nested deeper than any reader decodes.
            let deep = (0..READABLE_JSON_DEPTH + 3).fold(json!("deep"), |inner, _| json!([inner]));
            let mut task = NewTask::new("job", deep);
            task.queue = Some(queues[self.rng.range(0, queues.len() as u64) as usize].name.clone());
            let id = self.store.enqueue_unchecked(task, now);
            self.checker.enqueued(id)?;
            self.note("client", format_args!("a producer writes task {id} by hand, unreadable"));
            self.checker.check_store(&self.store, now, false)?;
        }
        self.notify();
        Ok(())
    }

    /// Cancels a random task enqueued so far; the store refuses unless it is Pending or
    /// Claimed, and a holder's later writes about it must be fenced.
    fn cancel_one(&mut self, now: DbTime) -> Result<(), String> {
        let id = TaskId(self.load_rng.range(1, self.checker.enqueued_count() as u64 + 1) as i64);
        let state = self.store.task(id).map(|row| row.state).ok_or_else(|| format!("cancel: task {id} not found"))?;
        if self.store.locked_rows().contains(&id) {
            // It would wait for the lock, and give up.
            self.note("client", format_args!("cancel task {id} ({state}) -> its row is locked"));
            return Ok(());
        }
        // A Claimed task's holder may run it already (started without telling the store).
        let holder = self.store.task(id).and_then(|row| row.claimed_by.clone());
        self.checker.touch_task(id);
        match self.store.admin(&AdminRequest::Cancel { task: id }, now) {
            Ok(AdminReply::Cancelled { found }) => {
                self.note("client", format_args!("cancel task {id} ({state}) -> cancelled: {found:?}"));
                // A workflow's waiting step may be cancelled too (its children see it cancelled).
                if !matches!(state, TaskState::Pending | TaskState::Claimed | TaskState::Waiting) {
                    return Err(format!("cancel of task {id} in state {state} was accepted"));
                }
                let said = match &found {
                    Cancelled::Pending => None,
                    Cancelled::Claimed { worker } => Some(worker),
                };
                if said != holder.as_ref() {
                    return Err(format!(
                        "SILENT CANCEL: cancel of task {id} ({state}, held by {holder:?}) said {found:?}"
                    ));
                }
            }
            Ok(other) => return Err(format!("cancel of task {id} replied {other:?}")),
            Err(refusal) => {
                self.note("client", format_args!("cancel task {id} ({state}) -> refused"));
                if matches!(state, TaskState::Pending | TaskState::Claimed | TaskState::Waiting) {
                    return Err(format!("cancel of {state} task {id} was refused: {refusal}"));
                }
            }
        }
        self.checker.check_store(&self.store, now, false)
    }
}

impl Sim {
    // ---------------------------------------------------------------------------------------
    // Workflows: the client submits them, the operator acts on them
    // ---------------------------------------------------------------------------------------

    /// Submits a workflow drawn now over the queues that run; the store must take it.
    fn submit_workflow(&mut self) -> Result<(), String> {
        let now = self.db_now();
        let number = self.next_workflow;
        self.next_workflow += 1;
        let queues: Vec<String> =
            self.options.app.queues().into_iter().filter(|q| q.max_concurrency != Some(0)).map(|q| q.name).collect();
        let drawn = workflows::draw(&mut self.flow_rng, &self.options.load, &queues, now, number);
        for policy in drawn.workflow.tasks.iter().filter_map(|task| task.retry.as_ref()) {
            self.retry_budget_ms = self.retry_budget_ms.max(options::retry_budget_ms(policy));
            self.max_retries = self.max_retries.max(policy.max_retries);
        }
        self.latest_run_at = self.latest_run_at.max(drawn.latest_run_at);
        let depth = workflows::depth(&drawn.workflow);
        let submitted = self
            .store
            .submit_workflow(drawn.workflow.clone(), now)
            .map_err(|e| format!("submit of workflow wf{number} refused: {e}"))?;
        self.checker.submitted(submitted.workflow, &drawn.workflow, &submitted.tasks, depth)?;
        let spec = &drawn.workflow.spec;
        let joins: Vec<String> = spec
            .steps
            .iter()
            .enumerate()
            .filter(|(_, step)| step.join != crate::workflow::Join::All)
            .map(|(index, step)| format!("{index}:{}", step.join))
            .collect();
        let edges: Vec<String> = spec
            .edges
            .iter()
            .map(|e| {
                let allow = if e.policy == crate::workflow::EdgePolicy::AllowFailed { "~" } else { "" };
                format!("{}>{}{allow}", e.parent, e.child)
            })
            .collect();
        self.note(
            "client",
            format_args!(
                "submit workflow {} ({}, {} steps, depth {depth}{}) edges [{}] joins [{}] -> tasks {}",
                submitted.workflow,
                drawn.shape,
                spec.steps.len(),
                if spec.on_error == crate::workflow::OnError::Pause { ", pause on error" } else { "" },
                edges.join(" "),
                joins.join(" "),
                ids(&submitted.tasks)
            ),
        );
        self.checker.check_store(&self.store, now, false)?;
        self.notify();
        Ok(())
    }

    /// The operator pauses, resumes, cancels or retries a random workflow (over or not): the
    /// store accepts exactly when the workflow's status allows it, and leaves the status asked
    /// for.
    fn workflow_action(&mut self) -> Result<(), String> {
        let ids = self.store.workflow_ids(usize::MAX);
        if ids.is_empty() {
            return Ok(());
        }
        let id = ids[self.flow_rng.range(0, ids.len() as u64) as usize];
        let before = self.store.workflow_state(id).map(|s| s.status()).ok_or_else(|| format!("no workflow {id}"))?;
        let open = matches!(before, WorkflowStatus::Running | WorkflowStatus::Paused);
        let now = self.db_now();
        let (action, result, allowed) = match self.flow_rng.range(0, 10) {
            0..=2 => ("pause", self.store.pause_workflow(id), open),
            3..=5 => ("resume", self.store.resume_workflow(id, now), open),
            6 | 7 => {
                // Allowed in every status (the simulated apps purge nothing): the steps that did
                // not complete, and with `downstream` the finished ones below them, run again.
                let downstream = self.flow_rng.chance(0.5);
                let rows: Vec<TaskState> = self.store.workflow_steps(id).iter().map(|step| step.state).collect();
                let result = self.store.retry_workflow(id, downstream, now);
                if result.is_ok() {
                    self.checker.workflow_retried(id, downstream, &rows, &self.store, now)?;
                }
                (if downstream { "retry downstream" } else { "retry" }, result, true)
            }
            _ => {
                let live: Vec<TaskId> = self
                    .store
                    .workflow_steps(id)
                    .iter()
                    .filter(|step| !step.state.is_terminal())
                    .map(|step| step.task)
                    .collect();
                if live.iter().any(|task| self.store.locked_rows().contains(task)) {
                    // It would wait for the lock, and give up.
                    self.note("operator", format_args!("cancel workflow {id} ({before}) -> a step's row is locked"));
                    return Ok(());
                }
                let allowed = open || before == WorkflowStatus::Cancelled;
                ("cancel", self.store.cancel_workflow(id, now), allowed)
            }
        };
        self.note("operator", format_args!("{action} workflow {id} ({before}) -> {result:?}"));
        self.checker.touch_workflow(id);
        match result {
            Ok(after) => {
                if !allowed {
                    return Err(format!("{action} of workflow {id} ({before}) was accepted: now {after}"));
                }
                let expected = match action {
                    "pause" => after == WorkflowStatus::Paused,
                    // A resume may apply held skips that finish the whole workflow.
                    "resume" => {
                        matches!(after, WorkflowStatus::Running | WorkflowStatus::Completed | WorkflowStatus::Failed)
                    }
                    "cancel" => after == WorkflowStatus::Cancelled,
                    // A retry reopens a cancelled workflow; a paused one stays paused (its reset
                    // steps wait, held), and nothing else pauses (skips do not).
                    _ => {
                        after != WorkflowStatus::Cancelled
                            && (before == WorkflowStatus::Paused) == (after == WorkflowStatus::Paused)
                    }
                };
                let now_status = self.store.workflow_state(id).map(|s| s.status());
                if !expected || now_status != Some(after) {
                    return Err(format!(
                        "{action} of workflow {id} ({before}) left it {after} (the store reads {now_status:?})"
                    ));
                }
                if action == "cancel" && open {
                    self.checker.workflow_cancelled(id)?;
                }
            }
            Err(WorkflowActionError::Refused { .. }) if !allowed => {}
            Err(refusal) => return Err(format!("{action} of workflow {id} ({before}) was refused: {refusal}")),
        }
        self.checker.check_store(&self.store, now, false)?;
        self.notify();
        Ok(())
    }

    /// The operator resumes every paused workflow (after healing, as an operator would).
    fn resume_paused_workflows(&mut self) -> Result<(), String> {
        let now = self.db_now();
        let paused: Vec<WorkflowId> = self
            .store
            .workflow_ids(usize::MAX)
            .into_iter()
            .rev()
            .filter(|&id| self.store.workflow_state(id).is_some_and(|s| s.status() == WorkflowStatus::Paused))
            .collect();
        for id in paused {
            let status =
                self.store.resume_workflow(id, now).map_err(|e| format!("resume of paused workflow {id}: {e}"))?;
            self.note("operator", format_args!("resume paused workflow {id} -> {status}"));
            self.checker.touch_workflow(id);
            self.checker.check_store(&self.store, now, false)?;
        }
        self.notify();
        Ok(())
    }
}

fn sample_outcome(rng: &mut Rng, load: &LoadOptions, task: TaskId) -> TaskOutcome {
    let roll = rng.next_f64();
    let failure = |code: ErrorCode, message: &str| TaskOutcome::Failure(TaskError::new(code, message));
    if roll < load.error_chance {
        if rng.chance(0.7) {
            // Every third task is a batch whose failed items replace its arguments (decided by
            // id, not by the PRNG, so recorded seeds replay as before).
            let error = TaskError::new(ErrorCode::TaskError, "the handler failed");
            if task.0 % 3 == 0 {
                TaskOutcome::PartialFailure { error, remaining: json!([task.0]) }
            } else {
                TaskOutcome::Failure(error)
            }
        } else {
            failure(ErrorCode::User(USER_ERROR_CODE.into()), "slow down")
        }
    } else if roll < load.error_chance + load.panic_chance {
        // Every fourth of these ran in a child process that died under it (decided by id, so
        // recorded seeds draw as before): the task fails alone, with the child's own code.
        if task.0 % 4 == 0 {
            TaskOutcome::Failure(crate::isolation::child_failure(task, &crate::isolation::ChildFailure::Signalled(9)))
        } else {
            failure(ErrorCode::UnhandledError, "the handler panicked")
        }
    } else if roll < load.error_chance + load.panic_chance + load.odd_error_chance {
        if rng.chance(0.5) {
            failure(ErrorCode::WorkerResolutionError, "no handler named job")
        } else {
            failure(ErrorCode::WorkerSerializationError, "bad arguments")
        }
    } else {
        TaskOutcome::Success(json!({ "done": task.0 }))
    }
}

/// How long after a fault a worker's heartbeats may still fail to land: a stale run's age,
/// the longest database backoff, a heartbeat interval and the longest round trip, with a
/// second to spare.
fn excuse_window(options: &SimOptions) -> Duration {
    let r = &options.app.recovery;
    let backoff = options.app.resilience.db_retry_max_ms * 5 / 4;
    let beat = r.runner_heartbeat_interval_ms.max(r.claimer_heartbeat_interval_ms);
    let ms = r.running_stale_threshold_ms + backoff + beat + 2 * options.faults.latency_max_ms + 1_000;
    Duration::from_millis(ms)
}

/// An answer holding a value the database refuses: U+0000 in a result or in an error's
/// message, or a result over the database's own value limit when there is one.
fn poison_outcome(rng: &mut Rng, db_limit: Option<u64>, task: TaskId) -> TaskOutcome {
    match (rng.range(0, 3), db_limit) {
        (0, _) => TaskOutcome::Success(json!({ "done": task.0, "from_c": "nul\u{0}byte" })),
        (1, _) | (_, None) => TaskOutcome::Failure(TaskError::new(ErrorCode::TaskError, "a C library said: \u{0}")),
        (_, Some(limit)) => TaskOutcome::Success(json!({ "done": task.0, "pad": "x".repeat(limit as usize + 64) })),
    }
}

fn describe_outcome(outcome: &TaskOutcome) -> String {
    match outcome {
        TaskOutcome::Success(_) => "ok".to_owned(),
        TaskOutcome::Failure(error) => error.code.to_string(),
        TaskOutcome::PartialFailure { error, .. } => format!("{} (partial)", error.code),
    }
}

fn ids<T: fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let items: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    format!("[{}]", items.join(" "))
}

fn describe_request(request: &DbRequest) -> String {
    let leases = |tasks: &[crate::task::TaskLease]| ids(tasks.iter().map(|t| format!("{}@{}", t.task, t.lease)));
    match request {
        DbRequest::Claim { my_running, my_claimed, start_now, .. } => {
            format!("running {my_running} claimed {my_claimed} start {start_now}")
        }
        DbRequest::Start { tasks, .. } | DbRequest::RecordStarts { tasks, .. } | DbRequest::Release { tasks, .. } => {
            leases(tasks)
        }
        DbRequest::FinishAndClaim { .. } => {
            let (finish, claim) = request.finish_then_claim().expect("a finish-and-claim");
            format!("{} and claim {}", describe_request(&finish), describe_request(&claim))
        }
        DbRequest::Finish { completions, .. } => ids(completions.iter().map(|c| {
            let outcome = match &c.outcome {
                FinishOutcome::Completed(_) => "ok".to_owned(),
                FinishOutcome::Retry { error, delay_ms } => format!("retry+{delay_ms}ms:{}", error.code),
                FinishOutcome::Failed(error) => format!("fail:{}", error.code),
            };
            format!("{}@{}:{outcome}", c.task.task, c.task.lease)
        })),
        DbRequest::Heartbeat { claimed, running, abandoned, .. } => {
            let abandoned = if abandoned.is_empty() { String::new() } else { format!(" abandoned {}", ids(abandoned)) };
            format!("claimed {} running {}{abandoned}", leases(claimed), leases(running))
        }
        DbRequest::AbandonClaim { token, .. } => format!("token {token}"),
        DbRequest::SetWaiting { waiting, .. } => if *waiting { "mark" } else { "unmark" }.to_owned(),
        DbRequest::Reap { .. }
        | DbRequest::ReapDead { .. }
        | DbRequest::Purge { .. }
        | DbRequest::Vacuum { .. }
        | DbRequest::RegisterWorker(_)
        | DbRequest::DeregisterWorker(_) => String::new(),
    }
}

fn describe_reply(reply: &DbReply) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut part = |name: &str, list: String, empty: bool| {
        if !empty {
            parts.push(format!("{name} {list}"));
        }
    };
    match reply {
        DbReply::FinishedAndClaimed { .. } => {
            let (finished, claimed) = reply.clone().into_finished_and_claimed();
            let claimed = claimed.map(|c| describe_reply(&c)).unwrap_or_default();
            return format!("{}; {claimed}", describe_reply(&finished));
        }
        DbReply::Claimed { tasks, more, .. } => {
            let listed = ids(tasks.iter().map(|t| {
                format!("{}@{}{}", t.id, t.lease, if t.started { format!("/run{}", t.attempt) } else { String::new() })
            }));
            return format!("claimed {listed}{}", if *more { " more" } else { "" });
        }
        DbReply::Started { started, expired, deferred, lost } => {
            part("started", ids(started.iter().map(|(t, a)| format!("{t}/run{a}"))), started.is_empty());
            part("expired", ids(expired), expired.is_empty());
            part("deferred", ids(deferred), deferred.is_empty());
            part("lost", ids(lost), lost.is_empty());
        }
        DbReply::Finished { applied, lost } => {
            part("applied", ids(applied.iter().map(|(t, s)| format!("{t}:{s}"))), applied.is_empty());
            part("lost", ids(lost), lost.is_empty());
        }
        DbReply::Heartbeat { lost, busy, handed_back } => {
            part("lost", ids(lost), lost.is_empty());
            part("busy", ids(busy), busy.is_empty());
            part("handed back", ids(handed_back), handed_back.is_empty());
        }
        DbReply::Released { released, lost } => {
            part("released", ids(released), released.is_empty());
            part("lost", ids(lost), lost.is_empty());
        }
        DbReply::Reaped(report) => {
            part("requeued", ids(&report.requeued), report.requeued.is_empty());
            part("retried", ids(&report.retried), report.retried.is_empty());
            part("failed", ids(&report.failed), report.failed.is_empty());
            part("expired", ids(&report.expired), report.expired.is_empty());
            part("workers pruned", report.workers_pruned.to_string(), report.workers_pruned == 0);
            part("dead", ids(&report.dead_workers), report.dead_workers.is_empty());
        }
        DbReply::Purged { tasks } => return format!("purged {tasks}"),
        DbReply::Vacuumed { tables } => return format!("vacuumed {}", tables.len()),
        DbReply::Done => return "done".to_owned(),
        DbReply::WaitingSet { written } => return if *written { "written" } else { "as it was" }.to_owned(),
    }
    if parts.is_empty() { "nothing".to_owned() } else { parts.join(" ") }
}
