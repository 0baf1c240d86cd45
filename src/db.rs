//! The database protocol: what the worker machine asks a store to do, and what it answers.
//!
//! Every store (the [memory store](crate::memory), PostgreSQL) applies these requests with the
//! same semantics; the conformance suite checks that they agree. The rules every store keeps:
//!
//! - **The database clock is the only wall clock.** Requests carry durations (`lease_ms`,
//!   `delay_ms`); the store adds them to its own `now`. Workers never send instants.
//! - **Fencing.** A write about a task a worker holds names the task and its [`Lease`] (the
//!   claim generation) and expects a state; when the row no longer matches it changes nothing
//!   and the task is reported `lost`. A write that was already applied (a re-send after an
//!   [`DbFailure::Unknown`]) is reported lost too, never applied twice.
//! - **Eligibility** to be claimed: Pending, or Claimed with an expired lease; `run_at` reached;
//!   good-until not reached. **Order**: queue priority, task priority, `run_at`, id.
//! - **Attempts and retries.** `attempts` counts starts and never decreases. `retries` counts
//!   retries spent; [`Release`](DbRequest::Release) does not spend one.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::budget::ClaimPolicy;
use crate::config::{AppConfig, RetryPolicy, is_valid_flag, is_valid_queue_name};
use crate::task::{Attempt, ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};

/// How many finished tasks one purge statement deletes unless told otherwise (see
/// [`DbRequest::Purge`]): small enough that no statement holds its locks for long.
pub const DEFAULT_PURGE_BATCH: u32 = 1_000;

/// A time on the database's clock: milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DbTime(pub i64);

impl DbTime {
    /// This time plus `ms` milliseconds (saturating).
    pub fn plus_ms(self, ms: u64) -> DbTime {
        DbTime(self.0.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX)))
    }
}

/// Correlates a request with its reply. Issued by the worker machine; replies carrying an id
/// the machine no longer waits for are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OpId(pub u64);

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// When a new task becomes claimable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunAt {
    /// At once.
    Now,
    /// After this many milliseconds on the database clock.
    DelayMs(u64),
    /// At this database time (a time in the past means at once).
    At(DbTime),
}

/// A task to enqueue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewTask {
    /// The registered name of the handler that runs it.
    pub name: String,
    /// Its arguments, as JSON.
    pub args: serde_json::Value,
    /// Its queue; `None` is the default queue (and is the only choice in default queue mode).
    pub queue: Option<String>,
    /// Lower runs first within a queue.
    pub priority: i16,
    /// When it becomes claimable.
    pub run_at: RunAt,
    /// After this database time it expires instead of running.
    pub good_until: Option<DbTime>,
    /// Its retry policy; `None` takes the app's default.
    pub retry: Option<RetryPolicy>,
    /// A key naming the task while it is live (or, in [`KeyMode::Idempotent`], for good):
    /// what enqueueing the key again does is its [`KeyMode`].
    pub key: Option<String>,
    /// What an enqueue with a key that names a task already does (ignored without a key).
    #[serde(default)]
    pub key_mode: KeyMode,
    /// Flags, which workers may be told to skip (`WorkerConfig::forbidden_flags`): each 1 to
    /// 64 bytes of `a-z`, `0-9`, `_`, `-`, `.` and `:`.
    #[serde(default)]
    pub flags: Vec<String>,
}

/// What enqueueing a key that already names a task does: graphile-worker's job key modes
/// (`replace`, `preserve_run_at`, `unsafe_dedupe`) and horsies' idempotency keys.
///
/// In the first three modes a key names a task only while it is live (Pending, Claimed or
/// Running); once it finished the key is free again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
#[serde(rename_all = "snake_case")]
pub enum KeyMode {
    /// A Pending task with the key is updated in place: name, queue, args, run-at, priority,
    /// good-until, retry policy and flags are replaced and its retry budget starts over (when
    /// its args and the new ones are both JSON arrays, the new items are appended instead:
    /// batch tasks collect items). A Claimed or Running task loses its key (it runs on) and a
    /// new task is inserted, as when no live task has the key.
    #[default]
    Replace,
    /// As [`KeyMode::Replace`], except that a Pending task that never ran keeps its run-at
    /// (a debounce that does not postpone).
    PreserveRunAt,
    /// A live task with the key is kept unchanged and its id returned; otherwise a new task is
    /// inserted. "Unsafe": the live task may already be running with the old arguments.
    UnsafeDedupe,
    /// The key names its task for good, finished or not: enqueueing it again with the same
    /// name and arguments returns that task, with others it is refused
    /// ([`EnqueueError::PayloadMismatch`]).
    Idempotent,
}

impl KeyMode {
    /// The mode's name in SQL and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyMode::Replace => "replace",
            KeyMode::PreserveRunAt => "preserve_run_at",
            KeyMode::UnsafeDedupe => "unsafe_dedupe",
            KeyMode::Idempotent => "idempotent",
        }
    }

    /// The mode named `name` (as [`KeyMode::as_str`] writes it).
    pub fn parse(name: &str) -> Option<KeyMode> {
        [KeyMode::Replace, KeyMode::PreserveRunAt, KeyMode::UnsafeDedupe, KeyMode::Idempotent]
            .into_iter()
            .find(|mode| mode.as_str() == name)
    }
}

/// Flags as stored: sorted, each once.
pub fn normalized_flags(flags: &[String]) -> Vec<String> {
    let mut flags = flags.to_vec();
    flags.sort();
    flags.dedup();
    flags
}

/// The keys of one batch so far, to refuse what the stores cannot apply as one set of writes:
/// a key used in two modes ([`EnqueueError::MixedKeyModes`]), and an idempotency key used
/// twice with different names or arguments ([`EnqueueError::BatchKeyConflict`]).
#[derive(Debug, Default)]
pub struct BatchKeys<'a>(BTreeMap<&'a str, (usize, &'a NewTask)>);

impl<'a> BatchKeys<'a> {
    /// Records the key of `task`, the batch's task `index`, refusing it if an earlier task
    /// used it in another mode or, in [`KeyMode::Idempotent`], with another name or args.
    pub fn check(&mut self, index: usize, task: &'a NewTask) -> Result<(), EnqueueError> {
        let Some(key) = task.key.as_deref() else { return Ok(()) };
        match self.0.get(key) {
            Some((_, first)) if first.key_mode != task.key_mode => Err(EnqueueError::MixedKeyModes(key.to_owned())),
            Some((first_index, first))
                if task.key_mode == KeyMode::Idempotent && (first.name != task.name || first.args != task.args) =>
            {
                Err(EnqueueError::BatchKeyConflict { key: key.to_owned(), first: *first_index, second: index })
            }
            Some(_) => Ok(()),
            None => {
                self.0.insert(key, (index, task));
                Ok(())
            }
        }
    }
}

impl NewTask {
    /// A task with these name and arguments and every other field defaulted.
    pub fn new(name: impl Into<String>, args: serde_json::Value) -> Self {
        NewTask {
            name: name.into(),
            args,
            queue: None,
            priority: 0,
            run_at: RunAt::Now,
            good_until: None,
            retry: None,
            key: None,
            key_mode: KeyMode::Replace,
            flags: Vec::new(),
        }
    }

    /// The same task in another queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The same task with another priority (lower runs first).
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = priority;
        self
    }

    /// The same task, claimable only from `run_at`.
    pub fn run_at(mut self, run_at: RunAt) -> Self {
        self.run_at = run_at;
        self
    }

    /// The same task, expiring at `good_until`.
    pub fn good_until(mut self, good_until: DbTime) -> Self {
        self.good_until = Some(good_until);
        self
    }

    /// The same task with its own retry policy.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// The same task with a job key in the default mode, [`KeyMode::Replace`].
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// The same task with a key in `mode`.
    pub fn key_with_mode(mut self, key: impl Into<String>, mode: KeyMode) -> Self {
        self.key = Some(key.into());
        self.key_mode = mode;
        self
    }

    /// The same task with an idempotency key ([`KeyMode::Idempotent`]).
    pub fn idempotency_key(self, key: impl Into<String>) -> Self {
        self.key_with_mode(key, KeyMode::Idempotent)
    }

    /// The same task with one more flag.
    pub fn flag(mut self, flag: impl Into<String>) -> Self {
        self.flags.push(flag.into());
        self
    }
}

/// Why an enqueue was refused. Nothing is written when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    /// The task name is empty or too long.
    #[error("invalid task name {0:?}: expected 1 to 128 bytes")]
    InvalidTaskName(String),
    /// The queue name has characters or a length queues cannot have.
    #[error("invalid queue name {0:?}: expected 1 to 52 bytes of a-z, 0-9 and _")]
    InvalidQueueName(String),
    /// The queue is not one the app configures.
    #[error("unknown queue {queue:?}: expected one of {known}")]
    UnknownQueue {
        /// The queue asked for.
        queue: String,
        /// The configured queues, comma-separated.
        known: String,
    },
    /// The task would become claimable after it expires.
    #[error("run_at {run_at} ms is not before good_until {good_until} ms: the task could never run")]
    RunAtAfterGoodUntil {
        /// When it would become claimable.
        run_at: i64,
        /// When it would expire.
        good_until: i64,
    },
    /// The task's retry policy breaks a rule.
    #[error("invalid retry policy: {0}")]
    InvalidRetryPolicy(String),
    /// The key is empty or too long.
    #[error("invalid key {0:?}: expected 1 to 256 bytes")]
    InvalidKey(String),
    /// A batch uses one idempotency key for two tasks with different names or arguments.
    #[error(
        "idempotency key {key:?} names tasks {first} and {second} of the batch with different arguments: expected the same task twice"
    )]
    BatchKeyConflict {
        /// The key.
        key: String,
        /// The first task of the batch using it.
        first: usize,
        /// The task that differs from it.
        second: usize,
    },
    /// A batch uses one key in two modes.
    #[error("key {0:?} is used in two modes in one batch: expected one mode per key")]
    MixedKeyModes(String),
    /// A flag has characters or a length flags cannot have.
    #[error("invalid flag {0:?}: expected 1 to 64 bytes of a-z, 0-9, _, -, . and :")]
    InvalidFlag(String),
    /// The arguments could not be stored, or not read back once stored.
    #[error("invalid args: {0}")]
    InvalidArgs(UnstorableValue),
    /// The key names a task with other arguments (`PAYLOAD_MISMATCH`).
    #[error("idempotency key {key:?} already names task {existing} with different arguments")]
    PayloadMismatch {
        /// The key.
        key: String,
        /// The task it names.
        existing: TaskId,
    },
}

impl EnqueueError {
    /// The error code callers see for this refusal.
    pub fn code(&self) -> ErrorCode {
        match self {
            EnqueueError::PayloadMismatch { .. } | EnqueueError::BatchKeyConflict { .. } => ErrorCode::PayloadMismatch,
            _ => ErrorCode::User("VALIDATION_FAILED".into()),
        }
    }
}

/// The queue a new task goes to, after checking everything a store checks before writing:
/// task name, queue, key, retry policy, and run-at against good-until (`now` is the store's).
pub fn check_new_task<'a>(app: &'a AppConfig, task: &'a NewTask, now: DbTime) -> Result<&'a str, EnqueueError> {
    if task.name.is_empty() || task.name.len() > 128 {
        return Err(EnqueueError::InvalidTaskName(task.name.clone()));
    }
    let queue = task.queue.as_deref().unwrap_or_else(|| default_queue(app));
    if !is_valid_queue_name(queue) {
        return Err(EnqueueError::InvalidQueueName(queue.to_owned()));
    }
    if !app.has_queue(queue) {
        let known = app.queue_names().collect::<Vec<_>>().join(", ");
        return Err(EnqueueError::UnknownQueue { queue: queue.to_owned(), known });
    }
    if let Some(key) = &task.key {
        if key.is_empty() || key.len() > 256 {
            return Err(EnqueueError::InvalidKey(key.clone()));
        }
    }
    if let Some(flag) = task.flags.iter().find(|f| !is_valid_flag(f)) {
        return Err(EnqueueError::InvalidFlag(flag.clone()));
    }
    check_storable(&task.args, crate::config::MAX_STORED_VALUE_BYTES).map_err(EnqueueError::InvalidArgs)?;

    if let Some(policy) = &task.retry {
        policy.validate().map_err(|e| EnqueueError::InvalidRetryPolicy(e.to_string()))?;
    }
    if let Some(good_until) = task.good_until {
        let run_at = resolve_run_at(task.run_at, now);
        if run_at >= good_until {
            return Err(EnqueueError::RunAtAfterGoodUntil { run_at: run_at.0, good_until: good_until.0 });
        }
    }
    Ok(queue)
}

/// The queue of tasks enqueued without one: `default`, or in custom mode the first queue.
pub fn default_queue(app: &AppConfig) -> &str {
    app.queue_names().next().unwrap_or(crate::config::DEFAULT_QUEUE_NAME)
}

/// The database time a [`RunAt`] means when enqueued at `now`.
pub fn resolve_run_at(run_at: RunAt, now: DbTime) -> DbTime {
    match run_at {
        RunAt::Now => now,
        RunAt::DelayMs(ms) => now.plus_ms(ms),
        RunAt::At(at) => at.max(now),
    }
}

/// A task as a claim hands it to a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimedTask {
    /// The task.
    pub id: TaskId,
    /// The claim generation this worker now holds.
    pub lease: Lease,
    /// The registered handler name.
    pub name: String,
    /// Its queue.
    pub queue: String,
    /// Its arguments.
    pub args: serde_json::Value,
    /// Its priority.
    pub priority: i16,
    /// Whether the claim also started it (it is Running, `attempt` is this run's number);
    /// otherwise it is Claimed and `attempt` is the number its start will have.
    pub started: bool,
    /// The run this is: 1 for the first.
    pub attempt: Attempt,
    /// Retries already spent.
    pub retries: u32,
    /// Its retry policy: its own, or the app's (resolved at enqueue by the memory store, at
    /// claim by PostgreSQL, which stores no copy of the default in every row).
    pub retry: RetryPolicy,
    /// Whether it has a good-until: then only a [`DbRequest::Start`], which checks it on the
    /// store's clock, may start it.
    pub expires: bool,
    /// Why the store could not read the stored arguments (nested too deep, a number out of
    /// range: anything its decoder refuses), if it could not; `args` is then `null`. The
    /// worker fails such a task with `WORKER_SERIALIZATION_ERROR` without running it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_error: Option<String>,
    /// Why the store could not read the task's own stored retry policy, if it could not;
    /// `retry` is then the app's. The worker reports it and runs the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_error: Option<String>,
}

/// A finished run and what it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The task and the lease it ran under.
    pub task: TaskLease,
    /// What to record.
    pub outcome: FinishOutcome,
    /// New arguments to store with a failure (retried or not): the items of a batch task that
    /// failed, so only those run again. `None` keeps the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<serde_json::Value>,
}

/// What a finished run records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishOutcome {
    /// Completed with this result.
    Completed(serde_json::Value),
    /// Failed, and runs again after `delay_ms` unless that is at or past good-until, in which
    /// case the store fails it with `error` instead.
    Retry {
        /// The error of this run.
        error: TaskError,
        /// How long to wait before it is claimable again.
        delay_ms: u64,
    },
    /// Failed for good.
    Failed(TaskError),
}

/// Identity and shape of a worker, kept in the worker registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker.
    pub worker: WorkerId,
    /// The queues it serves.
    pub queues: Vec<String>,
    /// Its concurrency.
    pub concurrency: u32,
}

/// A request the worker machine asks a store to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DbRequest {
    /// Claim tasks for `worker` under `policy`, following [`budget::plan`](crate::budget::plan)
    /// with the counts the store observes. Claimed rows get `lease = previous + 1`,
    /// `claimed_by = worker`, `claim_token = token`, a lease until `now + lease_ms`. The first
    /// `start_now` of them in claim order start at once (Running, `attempts + 1`). Replies
    /// [`DbReply::Claimed`] in claim order, with `more` set when some eligible row of a served
    /// queue was left behind.
    Claim {
        /// Who claims.
        worker: WorkerId,
        /// Stamped on the claimed rows so an unanswered claim can be undone
        /// ([`DbRequest::AbandonClaim`]).
        token: u64,
        /// The caps to respect.
        policy: Arc<ClaimPolicy>,
        /// Handlers this worker runs now.
        my_running: u32,
        /// Claims this worker holds that have not started.
        my_claimed: u32,
        /// How many of the claimed tasks to start in the same statement.
        start_now: u32,
        /// The claim lease.
        lease_ms: u64,
    },
    /// Start claimed tasks: Claimed to Running when held by `worker` under that lease and not
    /// past its claim lease. Past good-until it becomes Expired instead; in soft-cap mode a
    /// task whose queue is at its cap stays Claimed (`deferred`), as does one whose row
    /// another transaction holds locked (skipped, not waited for). Replies
    /// [`DbReply::Started`].
    Start {
        /// Who starts them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
        /// The queue caps to re-check (soft-cap mode).
        policy: Arc<ClaimPolicy>,
    },
    /// Record that claimed tasks already run (see [`DbRequest::Finish`] for why a worker may
    /// start a task without asking): Claimed to Running when held by `worker` under that
    /// lease, whatever its claim lease, good-until or queue cap (the start already happened,
    /// and was allowed when it did); a task already Running under that lease is reported
    /// started again. Replies [`DbReply::Started`] with nothing expired or deferred.
    RecordStarts {
        /// Who runs them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
    },
    /// Record finished runs, each fenced by lease: completed and failed tasks become terminal
    /// (and move to the finished table), retried ones Pending with `run_at = now + delay_ms`
    /// and `retries + 1`. A task held Running, or held Claimed by a worker that started it
    /// without a [`DbRequest::Start`] (soft-cap mode, a queue without a cap, no good-until:
    /// nothing the store would check), is applied; a Claimed one counts its run as an
    /// attempt here. Replies [`DbReply::Finished`].
    Finish {
        /// Who ran them.
        worker: WorkerId,
        /// The outcomes.
        completions: Vec<Completion>,
    },
    /// A [`DbRequest::Finish`] and then a [`DbRequest::Claim`] by the same worker, in one
    /// statement (one transaction, one round trip): the claim sees what the finish did, so the
    /// slots and cap room the finish frees are claimed at once. Replies
    /// [`DbReply::FinishedAndClaimed`]; fails as a whole. The worker machine sends it in
    /// hard-cap mode, where every claim is bounded by free slots.
    FinishAndClaim {
        /// Who ran them, and claims.
        worker: WorkerId,
        /// The outcomes, as [`DbRequest::Finish`] carries them.
        completions: Vec<Completion>,
        /// The claim's token, as [`DbRequest::Claim`]'s.
        token: u64,
        /// As [`DbRequest::Claim`]'s.
        policy: Arc<ClaimPolicy>,
        /// As [`DbRequest::Claim`]'s: handlers running once these outcomes are written.
        my_running: u32,
        /// As [`DbRequest::Claim`]'s.
        my_claimed: u32,
        /// As [`DbRequest::Claim`]'s.
        start_now: u32,
        /// As [`DbRequest::Claim`]'s.
        lease_ms: u64,
    },
    /// Renew what `worker` holds: Claimed tasks get their lease extended to `now + lease_ms`
    /// (unless claimed more than `max_renew_age_ms` ago, or lapsed already: claimers count a
    /// lapsed claim out), Running tasks a fresh heartbeat; the worker's registry row is
    /// marked alive. Rows another transaction has locked are skipped, not waited for
    /// (`busy`): one locked row never holds up the beat of the others. Replies
    /// [`DbReply::Heartbeat`] with the tasks no longer held.
    Heartbeat {
        /// Who beats.
        worker: WorkerId,
        /// Held claims.
        claimed: Vec<TaskLease>,
        /// Running tasks.
        running: Vec<TaskLease>,
        /// The claim lease.
        lease_ms: u64,
        /// Claims older than this are not renewed and expire naturally.
        max_renew_age_ms: u64,
        /// Tokens of claims this worker abandoned ([`DbRequest::AbandonClaim`]) lately: rows a
        /// late commit of such a claim left claimed by the worker are handed back, as the
        /// abandon hands them back, so a claim that commits after its client gave up never
        /// keeps tasks nobody runs.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        abandoned: Vec<u64>,
    },
    /// Hand tasks back: Claimed or Running held under that lease becomes Pending without
    /// spending a retry, claimable at once. Replies [`DbReply::Released`].
    Release {
        /// Who holds them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
    },
    /// Undo a claim whose reply never came: every row still Claimed or Running by `worker`
    /// under claim `token` goes back to Pending as by [`DbRequest::Release`], and a row the
    /// claim started gives back the attempt it counted (its handler never ran: the worker never
    /// saw the claim). Replies [`DbReply::Released`].
    AbandonClaim {
        /// Who claimed.
        worker: WorkerId,
        /// The claim's token.
        token: u64,
    },
    /// Recover what dead workers left, as one reaper (a store lets one act at a time):
    /// Claimed tasks with no claimer heartbeat (or claim) for `claimed_stale_ms` back to
    /// Pending; Running tasks with no runner heartbeat (or start) for `running_stale_ms`
    /// retried with `WORKER_CRASHED` if their policy allows it before good-until, else Failed;
    /// Pending tasks past good-until Expired. `None` thresholds skip that step. Workers the
    /// registry has not seen for the store's `recovery.worker_retention_ms` and that hold no
    /// task are deleted. Replies [`DbReply::Reaped`].
    Reap {
        /// Who reaps.
        worker: WorkerId,
        /// Threshold for stale claims.
        claimed_stale_ms: Option<u64>,
        /// Threshold for stale runs.
        running_stale_ms: Option<u64>,
        /// Entropy for the jitter of crash retries.
        entropy: u64,
    },
    /// Recover at once what dead workers left: a worker whose liveness token (a lock its
    /// session holds, see `recovery.auto_recover_dead_workers`) the store finds released, in
    /// the server incarnation the worker took it in, for at least `grace_ms`, is dead. Its
    /// Claimed tasks go back to Pending and its Running tasks are retried or failed with
    /// `WORKER_CRASHED` as the reaper does stale runs; the store forgets its token so it is
    /// not looked at again (until the worker, alive after all, takes it again). A token seen
    /// released for the first time is noted, not acted on. Any number may run at once: each
    /// dead worker is recovered by one. Replies [`DbReply::Reaped`] (`dead_workers`).
    ReapDead {
        /// Who reaps.
        worker: WorkerId,
        /// How long a token must have been released.
        grace_ms: u64,
        /// Entropy for the jitter of crash retries.
        entropy: u64,
    },
    /// Delete finished tasks that finished more than `older_than_ms` ago, with their attempts
    /// history and the keys they still hold, at most `batch` per statement (PostgreSQL repeats
    /// until a batch comes back short, each statement its own transaction). Tasks an
    /// idempotency key names stay for the store's `recovery.idempotency_retention_ms`. Replies
    /// [`DbReply::Purged`].
    Purge {
        /// The retention.
        older_than_ms: u64,
        /// Tasks per statement (0 is taken as 1).
        batch: u32,
    },
    /// Vacuum the store's hot tables (the live tasks, keys, the registry, the lock and queue
    /// tables) that hold at least `min_dead_rows` dead rows more than a vacuum of this store
    /// last left there: what keeps them small on a server that does not vacuum them (no
    /// autovacuum, or one too slow for a queue's churn). A table another vacuum is working on
    /// is skipped. Replies [`DbReply::Vacuumed`]; a store without dead rows vacuums nothing.
    Vacuum {
        /// The threshold.
        min_dead_rows: u64,
    },
    /// Add or refresh `worker` in the worker registry.
    RegisterWorker(WorkerInfo),
    /// Mark `worker` stopped in the worker registry.
    DeregisterWorker(WorkerId),
}

impl DbRequest {
    /// A [`DbRequest::FinishAndClaim`] as the [`DbRequest::Finish`] and the
    /// [`DbRequest::Claim`] it is made of, in that order; `None` for any other request.
    pub fn finish_then_claim(&self) -> Option<(DbRequest, DbRequest)> {
        let DbRequest::FinishAndClaim {
            worker,
            completions,
            token,
            policy,
            my_running,
            my_claimed,
            start_now,
            lease_ms,
        } = self
        else {
            return None;
        };
        let finish = DbRequest::Finish { worker: worker.clone(), completions: completions.clone() };
        let claim = DbRequest::Claim {
            worker: worker.clone(),
            token: *token,
            policy: Arc::clone(policy),
            my_running: *my_running,
            my_claimed: *my_claimed,
            start_now: *start_now,
            lease_ms: *lease_ms,
        };
        Some((finish, claim))
    }

    /// How many tasks (or claims) the request names: its batch size, for logs and traces.
    pub fn items(&self) -> usize {
        match self {
            DbRequest::Start { tasks, .. }
            | DbRequest::RecordStarts { tasks, .. }
            | DbRequest::Release { tasks, .. } => tasks.len(),
            DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. } => completions.len(),
            DbRequest::Heartbeat { claimed, running, .. } => claimed.len() + running.len(),
            DbRequest::Claim { .. }
            | DbRequest::AbandonClaim { .. }
            | DbRequest::Reap { .. }
            | DbRequest::ReapDead { .. }
            | DbRequest::Purge { .. }
            | DbRequest::Vacuum { .. }
            | DbRequest::RegisterWorker(_)
            | DbRequest::DeregisterWorker(_) => 0,
        }
    }

    /// A short name for logs and traces.
    pub fn kind(&self) -> &'static str {
        match self {
            DbRequest::Claim { .. } => "claim",
            DbRequest::Start { .. } => "start",
            DbRequest::RecordStarts { .. } => "record_starts",
            DbRequest::Finish { .. } => "finish",
            DbRequest::FinishAndClaim { .. } => "finish_and_claim",
            DbRequest::Heartbeat { .. } => "heartbeat",
            DbRequest::Release { .. } => "release",
            DbRequest::AbandonClaim { .. } => "abandon_claim",
            DbRequest::Reap { .. } => "reap",
            DbRequest::ReapDead { .. } => "reap_dead",
            DbRequest::Purge { .. } => "purge",
            DbRequest::Vacuum { .. } => "vacuum",
            DbRequest::RegisterWorker(_) => "register_worker",
            DbRequest::DeregisterWorker(_) => "deregister_worker",
        }
    }
}

/// A store's answer to a [`DbRequest`], variant for variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum DbReply {
    /// What a [`DbRequest::Claim`] took.
    Claimed {
        /// The tasks claimed, in claim order.
        tasks: Vec<ClaimedTask>,
        /// Whether the pass saw eligible tasks in the served queues that it did not take (its
        /// budget or a cap stopped it): the worker claims again when it has room.
        more: bool,
        /// When `more` is false (the worker will wait): milliseconds from the store's now to the
        /// earliest `run_at` still in the future among Pending tasks of the served queues, if
        /// there is one. No notification comes when a delayed or retried task becomes due, so
        /// the worker arms a wake-up for it. Always `None` when `more` is true.
        next_run_in_ms: Option<u64>,
    },
    /// What became of a [`DbRequest::Start`] or [`DbRequest::RecordStarts`].
    Started {
        /// Started, with the number of this run.
        started: Vec<(TaskId, Attempt)>,
        /// Past good-until: now Expired, not to run.
        expired: Vec<TaskId>,
        /// Queue at its cap: still Claimed, try again later.
        deferred: Vec<TaskId>,
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
    },
    /// What became of a [`DbRequest::Finish`].
    Finished {
        /// Applied, with the state each task is in now (Pending for a retry).
        applied: Vec<(TaskId, TaskState)>,
        /// Not held under that lease any more: nothing written.
        lost: Vec<TaskId>,
    },
    /// What a [`DbRequest::FinishAndClaim`] did: the finish's answer, then the claim's.
    FinishedAndClaimed {
        /// As [`DbReply::Finished`]'s.
        applied: Vec<(TaskId, TaskState)>,
        /// As [`DbReply::Finished`]'s.
        lost: Vec<TaskId>,
        /// As [`DbReply::Claimed`]'s.
        tasks: Vec<ClaimedTask>,
        /// As [`DbReply::Claimed`]'s.
        more: bool,
        /// As [`DbReply::Claimed`]'s.
        next_run_in_ms: Option<u64>,
    },
    /// What a [`DbRequest::Heartbeat`] found.
    Heartbeat {
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
        /// Locked by another transaction: not renewed this time; still held, for all the store
        /// knows.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        busy: Vec<TaskId>,
        /// Rows of abandoned claims that committed late, handed back to Pending.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        handed_back: Vec<TaskId>,
    },
    /// What became of a [`DbRequest::Release`] or [`DbRequest::AbandonClaim`].
    Released {
        /// Back to Pending.
        released: Vec<TaskId>,
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
    },
    /// What a [`DbRequest::Reap`] did.
    Reaped(ReapReport),
    /// How many finished tasks a [`DbRequest::Purge`] deleted.
    Purged {
        /// The count.
        tasks: u64,
    },
    /// The tables a [`DbRequest::Vacuum`] vacuumed.
    Vacuumed {
        /// Each table, with its dead rows before and after.
        tables: Vec<VacuumedTable>,
    },
    /// A registry request was applied.
    Done,
}

impl DbReply {
    /// The [`DbReply::Finished`] and [`DbReply::Claimed`] answers a
    /// [`DbReply::FinishedAndClaimed`] is made of; any other reply as it is, with no second.
    pub fn into_finished_and_claimed(self) -> (DbReply, Option<DbReply>) {
        match self {
            DbReply::FinishedAndClaimed { applied, lost, tasks, more, next_run_in_ms } => {
                (DbReply::Finished { applied, lost }, Some(DbReply::Claimed { tasks, more, next_run_in_ms }))
            }
            other => (other, None),
        }
    }

    /// Joins a finish's answer and a claim's into a [`DbReply::FinishedAndClaimed`]; `None`
    /// unless they are a [`DbReply::Finished`] and a [`DbReply::Claimed`].
    pub fn finished_and_claimed(finished: DbReply, claimed: DbReply) -> Option<DbReply> {
        match (finished, claimed) {
            (DbReply::Finished { applied, lost }, DbReply::Claimed { tasks, more, next_run_in_ms }) => {
                Some(DbReply::FinishedAndClaimed { applied, lost, tasks, more, next_run_in_ms })
            }
            _ => None,
        }
    }
}

/// One table a [`DbRequest::Vacuum`] vacuumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VacuumedTable {
    /// Its name.
    pub table: String,
    /// Dead rows the statistics counted before.
    pub dead_before: u64,
    /// Dead rows left after (rows a transaction may still see: an open snapshot holds them).
    pub dead_after: u64,
}

/// What one reaper pass changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReapReport {
    /// Stale claims put back to Pending.
    pub requeued: Vec<TaskId>,
    /// Stale runs retried with `WORKER_CRASHED`.
    pub retried: Vec<TaskId>,
    /// Stale runs failed with `WORKER_CRASHED`.
    pub failed: Vec<TaskId>,
    /// Pending tasks expired.
    pub expired: Vec<TaskId>,
    /// Whether the pass did nothing because another reaper held the reaper's lock.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Workers deleted from the registry: silent for longer than
    /// `recovery.worker_retention_ms`, holding no task.
    #[serde(default)]
    pub workers_pruned: u64,
    /// Workers found dead by their released liveness token ([`DbRequest::ReapDead`]), whose
    /// tasks the pass recovered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dead_workers: Vec<WorkerId>,
}

impl ReapReport {
    /// Whether the pass changed anything: a task, or the worker registry.
    pub fn changed_anything(&self) -> bool {
        !(self.requeued.is_empty() && self.retried.is_empty() && self.failed.is_empty() && self.expired.is_empty())
            || self.workers_pruned > 0
            || !self.dead_workers.is_empty()
    }
}

/// Why a request has no reply. Faults are inputs to the worker machine, not errors of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum DbFailure {
    /// The request was not applied: no connection, the pool timed out, the database is down.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The request was sent and no answer came: it may or may not have been applied.
    #[error("database reply unknown: {0}")]
    Unknown(String),
    /// The database refused the request (a bug or a schema mismatch); nothing was applied.
    #[error("database rejected the request: {0}")]
    Rejected(String),
    /// The database (or the client, encoding it) refused a value the request carries: text
    /// with U+0000, a value over a size limit, a number out of range (SQLSTATE classes 22 and
    /// 54). Nothing was applied. The request is not at fault as a whole: a batch is split until
    /// the item that carries the value is alone.
    #[error("database refused a value of the request: {0}")]
    Invalid(String),
    /// Another transaction held a row (or a lock) the request needed for longer than the
    /// session's `lock_timeout`; nothing was applied. A batch is split, so that one row held
    /// for long does not hold up the others.
    #[error("a lock the request waited for was held too long: {0}")]
    LockTimeout(String),
}

/// A task as inspection shows it: its row in the live table or the finished table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// The task.
    pub id: TaskId,
    /// Its handler name.
    pub name: String,
    /// Its queue.
    pub queue: String,
    /// Its state.
    pub state: TaskState,
    /// Its priority.
    pub priority: i16,
    /// Its arguments (`null` when they could not be read: see `args_error`).
    pub args: serde_json::Value,
    /// Why the stored arguments could not be read (nested deeper than a reader decodes, a
    /// number out of range), if they could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_error: Option<String>,
    /// Runs started.
    pub attempts: u32,
    /// Retries spent.
    pub retries: u32,
    /// When it was enqueued.
    pub enqueued_at: DbTime,
    /// When it is (or was) claimable.
    pub run_at: DbTime,
    /// When it expires.
    pub good_until: Option<DbTime>,
    /// When it reached a terminal state.
    pub finished_at: Option<DbTime>,
    /// The worker holding it, while Claimed or Running.
    pub worker: Option<WorkerId>,
    /// Its result, once Completed.
    pub result: Option<serde_json::Value>,
    /// Its last error: the final one once Failed, Expired or Cancelled, the latest retried
    /// one while it waits for its next run.
    pub error: Option<TaskError>,
    /// Its key, while it holds one.
    pub key: Option<String>,
    /// Its flags, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<String>,
}

/// One finished run of a task, as the attempts history keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The task.
    pub task: TaskId,
    /// Which run.
    pub attempt: Attempt,
    /// Who ran it.
    pub worker: Option<WorkerId>,
    /// What the task became: Completed, Failed, or Pending when it will be retried.
    pub outcome: TaskState,
    /// The error, if it failed.
    pub error: Option<TaskError>,
    /// When the run ended.
    pub finished_at: DbTime,
}

/// The deepest nesting of arrays and objects a stored JSON value may have. Readers decode
/// stored values with serde_json, which stops at 128 levels: a deeper value could be written
/// and never read back (and every claim that met it would fail).
pub const MAX_JSON_DEPTH: usize = 100;

/// Why a JSON value cannot be stored, or could not be read back once stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnstorableValue {
    /// Text (a string or an object key) holds U+0000, which PostgreSQL's `jsonb` refuses.
    #[error("{path} contains U+0000, which PostgreSQL cannot store: expected text without NUL characters")]
    Nul {
        /// Where, as `$` followed by keys and indexes (`$.a[2]`).
        path: String,
    },
    /// Nested deeper than [`MAX_JSON_DEPTH`].
    #[error("{path} is nested more than {MAX_JSON_DEPTH} levels deep: expected at most {MAX_JSON_DEPTH}")]
    TooDeep {
        /// Where the limit was passed.
        path: String,
    },
    /// Larger than the limit.
    #[error("it takes more than {max} bytes as JSON: expected at most {max}")]
    TooLarge {
        /// The limit, in bytes.
        max: u64,
    },
}

/// Checks that `value` can be stored as `jsonb` and read back: no U+0000 in any string or
/// key, at most [`MAX_JSON_DEPTH`] levels, at most `max_bytes` bytes as JSON. Returns its size
/// as JSON, estimated: exact for integers, strings and structure (escapes aside), 24 bytes for
/// a float. Walks the value without recursion.
pub fn check_storable(value: &serde_json::Value, max_bytes: u64) -> Result<u64, UnstorableValue> {
    use serde_json::Value;
    enum Step<'a> {
        Key(&'a str),
        Index(usize),
    }
    fn path_of(steps: &[Step<'_>]) -> String {
        let mut path = String::from("$");
        for step in steps {
            match step {
                Step::Key(key) => {
                    path.push('.');
                    // Escaped: the key itself may be what is wrong.
                    path.push_str(&printable(key, 64));
                }
                Step::Index(index) => path.push_str(&format!("[{index}]")),
            }
        }
        path
    }
    // Each entry: a value, its depth (1 for the root) and the step that led to it.
    let mut stack: Vec<(&Value, usize, Option<Step<'_>>)> = vec![(value, 1, None)];
    let mut steps: Vec<Step<'_>> = Vec::new();
    let mut bytes: u64 = 0;
    while let Some((value, depth, step)) = stack.pop() {
        steps.truncate(depth.saturating_sub(2));
        if let Some(step) = step {
            steps.push(step);
        }
        let nul = |text: &str| text.contains('\0');
        // Each value: its own bytes and a separator.
        bytes = bytes.saturating_add(1).saturating_add(match value {
            Value::Null | Value::Bool(_) => 5,
            Value::Number(number) => match (number.as_u64(), number.as_i64()) {
                (Some(n), _) => digits(n),
                (None, Some(n)) => digits(n.unsigned_abs()) + 1,
                _ => 24,
            },
            Value::String(text) => {
                if nul(text) {
                    return Err(UnstorableValue::Nul { path: path_of(&steps) });
                }
                text.len() as u64 + 3
            }
            Value::Array(items) => {
                if depth > MAX_JSON_DEPTH {
                    return Err(UnstorableValue::TooDeep { path: path_of(&steps) });
                }
                stack.extend(items.iter().enumerate().rev().map(|(i, item)| (item, depth + 1, Some(Step::Index(i)))));
                2
            }
            Value::Object(fields) => {
                if depth > MAX_JSON_DEPTH {
                    return Err(UnstorableValue::TooDeep { path: path_of(&steps) });
                }
                let mut size = 2u64;
                for (key, _) in fields {
                    if nul(key) {
                        steps.push(Step::Key(key));
                        return Err(UnstorableValue::Nul { path: path_of(&steps) });
                    }
                    size = size.saturating_add(key.len() as u64 + 3);
                }
                let children: Vec<_> =
                    fields.iter().map(|(k, v)| (v, depth + 1, Some(Step::Key(k.as_str())))).collect();
                stack.extend(children.into_iter().rev());
                size
            }
        });
        if bytes > max_bytes {
            return Err(UnstorableValue::TooLarge { max: max_bytes });
        }
    }
    Ok(bytes)
}

/// How many decimal digits `n` has.
fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |log| u64::from(log) + 1)
}

/// Checks a handler's error as [`check_storable`] checks values: its code and message are
/// text inside the stored JSON, so U+0000 there is refused too; its data counts against
/// `max_bytes`. Returns its estimated size as JSON.
pub fn check_storable_error(error: &TaskError, max_bytes: u64) -> Result<u64, UnstorableValue> {
    if error.message.contains('\0') {
        return Err(UnstorableValue::Nul { path: "$.message".into() });
    }
    if error.code.as_str().contains('\0') {
        return Err(UnstorableValue::Nul { path: "$.code".into() });
    }
    let text = (error.message.len() + error.code.as_str().len()) as u64 + 40;
    match &error.data {
        Some(data) => {
            check_storable(data, max_bytes.saturating_sub(text)).map(|size| size + text).map_err(
                |problem| match problem {
                    UnstorableValue::Nul { path } => UnstorableValue::Nul { path: path.replacen('$', "$.data", 1) },
                    UnstorableValue::TooDeep { path } => {
                        UnstorableValue::TooDeep { path: path.replacen('$', "$.data", 1) }
                    }
                    UnstorableValue::TooLarge { .. } => UnstorableValue::TooLarge { max: max_bytes },
                },
            )
        }
        None if text > max_bytes => Err(UnstorableValue::TooLarge { max: max_bytes }),
        None => Ok(text),
    }
}

/// `text` with control characters (U+0000 among them) escaped and cut to about `max` bytes,
/// for messages that quote what a handler or the database said.
pub fn printable(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max) + 3);
    for c in text.chars() {
        if out.len() >= max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn nested(depth: usize) -> serde_json::Value {
        (1..depth).fold(json!([]), |inner, _| json!([inner]))
    }

    #[test]
    fn storable_values_have_no_nul_no_deep_nesting_and_a_bounded_size() {
        assert!(check_storable(&json!({"a": [1, "ok", {"b": null}]}), 1_000).is_ok());
        let nul = |v: serde_json::Value| check_storable(&v, 1_000).unwrap_err().to_string();
        assert!(
            nul(json!({"a": [1, "no\u{0}"]})).starts_with("$.a[1] contains U+0000"),
            "{}",
            nul(json!({"a": [1, "no\u{0}"]}))
        );
        assert!(nul(json!({"k\u{0}": 1})).starts_with("$.k\\u{0} contains U+0000"));
        assert!(nul(json!([{"x": 1}, {"y": ["\u{0}"]}])).starts_with("$[1].y[0] contains"));
        assert!(check_storable(&nested(MAX_JSON_DEPTH), u64::MAX).is_ok());
        assert!(matches!(check_storable(&nested(MAX_JSON_DEPTH + 1), u64::MAX), Err(UnstorableValue::TooDeep { .. })));
        assert_eq!(check_storable(&json!("x".repeat(100)), 50), Err(UnstorableValue::TooLarge { max: 50 }));
        assert!(check_storable(&json!("x".repeat(10)), 50).is_ok());
        // Integers count by their digits: 400,000 one-digit items are about 800 kB as JSON.
        let digits = serde_json::Value::Array((0..400_000).map(|i| json!(i % 10)).collect());
        let size = check_storable(&digits, 8 * 1024 * 1024).expect("well under 8 MiB");
        assert!((800_000..=900_000).contains(&size), "{size}");
        assert_eq!(
            check_storable(&json!([-12345, 18_446_744_073_709_551_615u64, 1.5]), 1_000).map(|s| s > 30),
            Ok(true)
        );
    }

    #[test]
    fn a_stored_error_is_checked_in_its_message_code_and_data() {
        let error = TaskError::new(ErrorCode::TaskError, "fine");
        assert!(check_storable_error(&error, 100).is_ok());
        let nul = TaskError::new(ErrorCode::TaskError, "from C: \u{0}");
        assert_eq!(check_storable_error(&nul, 100), Err(UnstorableValue::Nul { path: "$.message".into() }));
        let data = error.clone().with_data(json!({"d": "\u{0}"}));
        assert_eq!(check_storable_error(&data, 100), Err(UnstorableValue::Nul { path: "$.data.d".into() }));
        let big = error.with_data(json!("y".repeat(200)));
        assert_eq!(check_storable_error(&big, 100), Err(UnstorableValue::TooLarge { max: 100 }));
    }

    #[test]
    fn printable_text_escapes_control_characters_and_is_cut() {
        assert_eq!(printable("a\u{0}b\nc", 100), "a\\u{0}b\\nc");
        assert_eq!(printable(&"z".repeat(20), 5), "zzzzz…");
    }

    #[test]
    fn enqueue_refuses_args_that_could_not_be_read_back() {
        let app = AppConfig::default();
        let deep = NewTask::new("t", nested(MAX_JSON_DEPTH + 1));
        assert!(matches!(check_new_task(&app, &deep, DbTime(0)), Err(EnqueueError::InvalidArgs(_))));
        let nul = NewTask::new("t", json!("\u{0}"));
        assert!(matches!(check_new_task(&app, &nul, DbTime(0)), Err(EnqueueError::InvalidArgs(_))));
    }
}
