//! Configuration: the application's queues, caps, leases, recovery and retry defaults
//! ([`AppConfig`]), one worker process's settings ([`WorkerConfig`]), and their validation.
//!
//! Everything here is plain data with the defaults of reference/seeds.md §1.1 and §2.1.
//! Validation collects every problem of a configuration at once, each naming its field by
//! dotted path, its value and what is allowed, so an operator fixes a file in one pass. This
//! module reads no file: [`Config::from_file_text`] parses what the caller read.
//!
//! A configuration file has an `[app]` and a `[worker]` table; every key is optional and
//! unknown keys are rejected:
//!
//! ```toml
//! [app]
//! queue_mode = "custom"
//! prefetch_buffer = 4
//! claim_lease_ms = 60000
//!
//! [[app.custom_queues]]
//! name = "emails"
//! priority = 1
//! max_concurrency = 20
//!
//! [app.retry]
//! max_retries = 3
//! intervals_secs = [60, 300, 900]
//!
//! [worker]
//! concurrency = 32
//! deployment_mode = "Hybrid"
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::check::{Check, ConfigError};
use crate::schedule::ScheduleConfig;
use crate::task::{ErrorCode, QUEUE_NAME_RULE, is_valid_flag, is_valid_queue_name};

/// The claim lease used when [`AppConfig::claim_lease_ms`] is not set: 60 s.
pub const DEFAULT_CLAIM_LEASE_MS: u64 = 60_000;

/// The name of the single queue of [`QueueMode::Default`].
pub const DEFAULT_QUEUE_NAME: &str = "default";

// Allowed ranges, from the seeds (reference/seeds.md §1.1, §2.1).
const QUEUE_PRIORITY: RangeInclusive<u8> = 1..=100;
const DB_RETRY_INITIAL_MS: RangeInclusive<u64> = 100..=60_000;
const DB_RETRY_MAX_MS: RangeInclusive<u64> = 500..=300_000;
const DB_RETRY_MAX_ATTEMPTS: RangeInclusive<u32> = 0..=10_000;
const CLAIMED_STALE_THRESHOLD_MS: RangeInclusive<u64> = 1_000..=3_600_000;
const RUNNING_STALE_THRESHOLD_MS: RangeInclusive<u64> = 1_000..=7_200_000;
const CHECK_INTERVAL_MS: RangeInclusive<u64> = 1_000..=600_000;
const LIVENESS_CHECK_INTERVAL_MS: RangeInclusive<u64> = 100..=60_000;
const LIVENESS_GRACE_MS: RangeInclusive<u64> = 0..=600_000;
const CRASH_RETRIES: RangeInclusive<u32> = 0..=100;
const VACUUM_DEAD_ROWS: RangeInclusive<u64> = 100..=1_000_000_000;
const HEARTBEAT_INTERVAL_MS: RangeInclusive<u64> = 1_000..=120_000;
const FINISHED_RETENTION_MS: RangeInclusive<u64> = 60_000..=3_153_600_000_000;
const MAX_RETRIES: RangeInclusive<u32> = 0..=20;
const RETRY_INTERVALS: RangeInclusive<usize> = 1..=20;
const RETRY_INTERVAL_SECS: RangeInclusive<u32> = 1..=86_400;
const CONCURRENCY: RangeInclusive<u32> = 1..=10_000;
const MAX_CLAIM_BATCH: RangeInclusive<u32> = 0..=10_000;
const COALESCE_NOTIFIES: RangeInclusive<u32> = 1..=10_000;
const POLL_INTERVAL_MS: RangeInclusive<u64> = 1_000..=300_000;
const HANDLER_TIMEOUT_MS: RangeInclusive<u64> = 1..=86_400_000;
const SHUTDOWN_GRACE_MS: RangeInclusive<u64> = 0..=3_600_000;
const COMPLETION_BATCH_MAX: RangeInclusive<u32> = 1..=10_000;
const MAX_RESULT_BYTES: RangeInclusive<u64> = 1_024..=MAX_STORED_VALUE_BYTES;

/// The largest JSON value PostgreSQL's `jsonb` holds (just under 256 MiB): a bound for
/// `WorkerConfig::max_result_bytes`.
pub const MAX_STORED_VALUE_BYTES: u64 = 268_435_455;

// ---------------------------------------------------------------------------------------------
// Queues
// ---------------------------------------------------------------------------------------------

/// How an application's queues are declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueMode {
    /// One uncapped queue named [`DEFAULT_QUEUE_NAME`]; `custom_queues` must be empty.
    #[default]
    #[serde(alias = "DEFAULT")]
    Default,
    /// The queues of [`AppConfig::custom_queues`], claimed in priority order.
    #[serde(alias = "CUSTOM")]
    Custom,
}

/// A named queue with its claim priority and its cluster-wide cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomQueue {
    /// The queue's name: 1 to [`MAX_QUEUE_NAME_LEN`](crate::task::MAX_QUEUE_NAME_LEN) bytes of `a-z`, `0-9` and `_`.
    pub name: String,
    /// Claim order across queues, lower first: 1 to 100, default 1.
    pub priority: u8,
    /// The most tasks of this queue in flight across the cluster. `None` leaves the queue
    /// uncapped; `Some(0)` pauses it (nothing is claimed from it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// A serial queue runs one task at a time across the cluster, in claim order (priority,
    /// run-at, id), whatever the workers prefetch: its claimed tasks count against its cap of
    /// 1 in soft-cap mode too. `max_concurrency` must then be unset (1) or 0 (paused).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub serial: bool,
}

impl Default for CustomQueue {
    // No default name: a queue table without one fails validation instead of silently
    // becoming some queue.
    fn default() -> Self {
        CustomQueue { name: String::new(), priority: 1, max_concurrency: None, serial: false }
    }
}

impl CustomQueue {
    /// An uncapped queue of priority 1.
    pub fn new(name: impl Into<String>) -> Self {
        CustomQueue { name: name.into(), ..CustomQueue::default() }
    }

    /// The same queue with another priority.
    pub fn with_priority(mut self, priority: u8) -> Self {
        self.priority = priority;
        self
    }

    /// The same queue with a cluster-wide cap (`0` pauses it).
    pub fn with_max_concurrency(mut self, max_concurrency: u32) -> Self {
        self.max_concurrency = Some(max_concurrency);
        self
    }

    /// The same queue, serial: one task at a time across the cluster, in order.
    pub fn serial(mut self) -> Self {
        self.serial = true;
        self
    }

    /// The cap claims count against: `max_concurrency`, and at most 1 for a serial queue.
    pub fn effective_cap(&self) -> Option<u32> {
        if self.serial { Some(self.max_concurrency.map_or(1, |cap| cap.min(1))) } else { self.max_concurrency }
    }
}

// ---------------------------------------------------------------------------------------------
// Resilience and recovery
// ---------------------------------------------------------------------------------------------

/// How a worker backs off while the database fails: startup, the listener and the claim loop.
///
/// The delay of the n-th consecutive failure is `min(max, initial * 2^(n-1)) * U(0.75, 1.25)`,
/// at least 100 ms (see `crate::backoff`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ResilienceConfig {
    /// The first delay: 100 to 60 000 ms, default 500.
    #[serde(deserialize_with = "millis::deserialize")]
    pub db_retry_initial_ms: u64,
    /// The cap before jitter: 500 to 300 000 ms and at least `db_retry_initial_ms`,
    /// default 30 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub db_retry_max_ms: u64,
    /// Consecutive failures before giving up: 0 (retry forever, the default) to 10 000.
    pub db_retry_max_attempts: u32,
}

impl Default for ResilienceConfig {
    fn default() -> Self {
        ResilienceConfig { db_retry_initial_ms: 500, db_retry_max_ms: 30_000, db_retry_max_attempts: 0 }
    }
}

/// Heartbeats and the reaper that recovers tasks of workers that went silent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecoveryConfig {
    /// Whether the reaper returns Claimed tasks with a silent claimer to Pending (default true).
    pub auto_requeue_stale_claimed: bool,
    /// How long a claimer may stay silent: 1 000 to 3 600 000 ms and at least twice
    /// `claimer_heartbeat_interval_ms` (one lost beat is not a crash), default 120 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub claimed_stale_threshold_ms: u64,
    /// Whether the reaper retries or fails Running tasks with a silent runner (default true).
    pub auto_fail_stale_running: bool,
    /// How long a runner may stay silent: 1 000 to 7 200 000 ms and at least twice
    /// `runner_heartbeat_interval_ms`, default 300 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub running_stale_threshold_ms: u64,
    /// How often the reaper runs: 1 000 to 600 000 ms, default 30 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub check_interval_ms: u64,
    /// How often a worker beats for the tasks it runs: 1 000 to 120 000 ms, default 30 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub runner_heartbeat_interval_ms: u64,
    /// How often a worker beats (and renews leases) for the tasks it holds claimed:
    /// 1 000 to 120 000 ms, default 30 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub claimer_heartbeat_interval_ms: u64,
    /// How long finished tasks are kept, in ms: 60 000 to 3 153 600 000 000 (a hundred
    /// years). When set, every worker deletes older ones (with their attempts and keys) once
    /// an hour, in short batches; `None` (the default) keeps them forever.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "millis::option")]
    pub finished_retention_ms: Option<u64>,
    /// How long an idempotency key ([`KeyMode::Idempotent`](crate::store::KeyMode)) keeps its
    /// finished task from that purge, in ms after the key was taken: 60 000 to
    /// 3 153 600 000 000. An idempotent enqueue of the same key within it gives the task's id
    /// instead of running it again. `None` (the default) keeps such tasks forever.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "millis::option")]
    pub idempotency_retention_ms: Option<u64>,
    /// How long the worker registry keeps a worker that stopped, or went silent, and holds no
    /// task: 60 000 to 3 153 600 000 000 ms, default 604 800 000 (seven days). The reaper
    /// deletes older ones, so a fleet that restarts often leaves no growing table behind.
    #[serde(deserialize_with = "millis::deserialize")]
    pub worker_retention_ms: u64,
    /// Whether workers recover at once the tasks of workers whose liveness token PostgreSQL
    /// released (default true): every worker holds a lock on a connection of its own, which
    /// the server lets go when that session dies with its process, so a killed worker's tasks
    /// need not wait out the stale thresholds (which stay, for workers that hang).
    pub auto_recover_dead_workers: bool,
    /// How often a worker looks for released tokens: 100 to 60 000 ms, default 1 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub liveness_check_interval_ms: u64,
    /// How long a token must stay released before its worker counts as dead: 0 to 600 000 ms,
    /// default 2 000. A worker whose token connection drops and comes back within it loses
    /// nothing.
    #[serde(deserialize_with = "millis::deserialize")]
    pub liveness_grace_ms: u64,
    /// Runs again a task whose run ended with `WORKER_CRASHED` (its worker died, or went
    /// silent) though its retry policy does not retry that code, while the task has spent
    /// fewer retries than this: 0 to 100, default 2 (0: such a run fails, as in the seed
    /// systems). A crash is rarely the task's fault; a task that keeps killing its workers
    /// stops after this many.
    pub crash_retries: u32,
    /// Canter's own vacuum: every 10 s a worker vacuums the hot tables (live tasks, keys, the
    /// registry, locks) that gained at least this many dead rows since its last vacuum of them
    /// left them (100 to 1 000 000 000, default 10 000; `None` leaves vacuuming to the server,
    /// written 0 in files). On a server that vacuums them in time it finds nothing to do;
    /// where autovacuum is off or falls behind, it keeps the live table small.
    #[serde(with = "zero_is_none")]
    pub vacuum_dead_rows: Option<u64>,
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        RecoveryConfig {
            auto_requeue_stale_claimed: true,
            claimed_stale_threshold_ms: 120_000,
            auto_fail_stale_running: true,
            running_stale_threshold_ms: 300_000,
            check_interval_ms: 30_000,
            runner_heartbeat_interval_ms: 30_000,
            claimer_heartbeat_interval_ms: 30_000,
            finished_retention_ms: None,
            idempotency_retention_ms: None,
            worker_retention_ms: 604_800_000,
            auto_recover_dead_workers: true,
            liveness_check_interval_ms: 1_000,
            liveness_grace_ms: 2_000,
            crash_retries: 2,
            vacuum_dead_rows: Some(10_000),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Retry policy
// ---------------------------------------------------------------------------------------------

/// How retry delays grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackoffStrategy {
    /// Retry n waits `intervals_secs[n-1]` (the last interval repeats).
    #[default]
    Fixed,
    /// Retry n waits `intervals_secs[0] * 2^(n-1)`.
    Exponential,
}

/// When and how a failed task runs again.
///
/// The default is [`RetryPolicy::none`]: tasks retry only when asked to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Retries after the first run: 0 (never retry) to 20.
    pub max_retries: u32,
    /// Delays in seconds, each 1 to 86 400, 1 to 20 of them. With fixed backoff and
    /// `max_retries > 0` there is one per retry; with exponential backoff exactly one, the base.
    pub intervals_secs: Vec<u32>,
    /// How delays grow.
    pub backoff: BackoffStrategy,
    /// Whether each delay is spread by ±25 % so retries of a burst do not arrive together
    /// (default true).
    pub jitter: bool,
    /// The error codes that may be retried; at least one when `max_retries > 0`. Default:
    /// `TASK_ERROR`, `UNHANDLED_ERROR`, `TASK_TIMEOUT`, `WORKER_CRASHED`.
    pub auto_retry_for: Vec<ErrorCode>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::none()
    }
}

/// A retry policy as stored with a task: the fields of [`RetryPolicy`], each optional, and
/// any others (a newer writer's) ignored.
#[derive(Deserialize)]
#[serde(default)]
struct StoredRetryPolicy {
    max_retries: u32,
    intervals_secs: Vec<u32>,
    backoff: BackoffStrategy,
    jitter: bool,
    auto_retry_for: Vec<ErrorCode>,
}

impl Default for StoredRetryPolicy {
    fn default() -> Self {
        let RetryPolicy { max_retries, intervals_secs, backoff, jitter, auto_retry_for } = RetryPolicy::none();
        StoredRetryPolicy { max_retries, intervals_secs, backoff, jitter, auto_retry_for }
    }
}

impl RetryPolicy {
    /// A policy as a task's row stores it, read leniently: fields this version does not know
    /// (written by a newer client, or another writer) are ignored, missing ones take their
    /// defaults. A value that is not a policy, or breaks a rule, is an error saying why.
    pub fn from_stored(value: serde_json::Value) -> Result<RetryPolicy, String> {
        let StoredRetryPolicy { max_retries, intervals_secs, backoff, jitter, auto_retry_for } =
            serde_json::from_value(value).map_err(|e| e.to_string())?;
        let policy = RetryPolicy { max_retries, intervals_secs, backoff, jitter, auto_retry_for };
        policy.validate().map_err(|e| e.to_string())?;
        Ok(policy)
    }

    /// The codes retried unless a policy says otherwise: every failure of the task itself.
    pub fn default_codes() -> Vec<ErrorCode> {
        vec![ErrorCode::TaskError, ErrorCode::UnhandledError, ErrorCode::TaskTimeout, ErrorCode::WorkerCrashed]
    }

    /// Never retry. Its other fields are valid defaults, so raising `max_retries` to 1 gives a
    /// usable policy.
    pub fn none() -> Self {
        RetryPolicy {
            max_retries: 0,
            intervals_secs: vec![60],
            backoff: BackoffStrategy::Fixed,
            jitter: true,
            auto_retry_for: Self::default_codes(),
        }
    }

    /// One retry per interval, waiting that many seconds (jitter on, default codes).
    pub fn fixed(intervals_secs: Vec<u32>) -> Self {
        RetryPolicy {
            max_retries: u32::try_from(intervals_secs.len()).unwrap_or(u32::MAX),
            intervals_secs,
            backoff: BackoffStrategy::Fixed,
            jitter: true,
            auto_retry_for: Self::default_codes(),
        }
    }

    /// Up to `max_retries` retries waiting `base_secs * 2^(n-1)` (jitter on, default codes).
    pub fn exponential(base_secs: u32, max_retries: u32) -> Self {
        RetryPolicy {
            max_retries,
            intervals_secs: vec![base_secs],
            backoff: BackoffStrategy::Exponential,
            jitter: true,
            auto_retry_for: Self::default_codes(),
        }
    }

    /// The same policy retrying exactly these codes.
    pub fn with_codes(mut self, codes: Vec<ErrorCode>) -> Self {
        self.auto_retry_for = codes;
        self
    }

    /// The same policy with jitter switched on or off.
    pub fn with_jitter(mut self, jitter: bool) -> Self {
        self.jitter = jitter;
        self
    }

    /// Whether a failure with `code` may be retried under this policy (retries left aside).
    pub fn retries_for(&self, code: &ErrorCode) -> bool {
        // Compared by name: `User("TASK_ERROR")` built by hand is the built-in code.
        self.max_retries > 0 && self.auto_retry_for.iter().any(|c| c.as_str() == code.as_str())
    }

    /// Every problem of this policy; fields are named without a prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    fn check(&self, c: &mut Check<'_>) {
        let retries_ok = c.range("max_retries", self.max_retries, MAX_RETRIES);
        let n = self.intervals_secs.len();
        let intervals = format!("{:?}", self.intervals_secs);
        // One length rule applies, the most specific one, so a wrong list is reported once.
        match self.backoff {
            BackoffStrategy::Exponential if n != 1 => {
                c.problem("intervals_secs", intervals, "exactly 1 interval (the base) with exponential backoff")
            }
            BackoffStrategy::Fixed if retries_ok && self.max_retries > 0 && n != self.max_retries as usize => c
                .problem(
                    "intervals_secs",
                    intervals,
                    format!("exactly {} intervals (one per retry) with fixed backoff", self.max_retries),
                ),
            _ if !RETRY_INTERVALS.contains(&n) => c.problem("intervals_secs", intervals, "1 to 20 intervals"),
            _ => {}
        }
        for (i, &secs) in self.intervals_secs.iter().enumerate() {
            c.range(&format!("intervals_secs[{i}]"), secs, RETRY_INTERVAL_SECS);
        }
        if self.max_retries > 0 && self.auto_retry_for.is_empty() {
            c.problem("auto_retry_for", "[]", "at least one error code when max_retries > 0");
        }
        for (i, code) in self.auto_retry_for.iter().enumerate() {
            if let ErrorCode::User(name) = code {
                if ErrorCode::user(name).is_err() {
                    c.problem(
                        &format!("auto_retry_for[{i}]"),
                        format!("{name:?}"),
                        "an error code of 1 to 64 characters of A-Z, 0-9 and _, starting with a letter",
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Application
// ---------------------------------------------------------------------------------------------

/// The configuration every process of one application shares: queues, caps, leases,
/// database resilience, recovery and the default retry policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AppConfig {
    /// Whether the application has the one default queue or its own queues.
    pub queue_mode: QueueMode,
    /// The queues of [`QueueMode::Custom`]: non-empty, unique names. Empty in default mode.
    pub custom_queues: Vec<CustomQueue>,
    /// The most tasks in flight across the cluster; `None` = no cap, else at least 1.
    /// Needs hard-cap mode (`prefetch_buffer = 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster_wide_cap: Option<u32>,
    /// Extra tasks a worker may hold claimed beyond its concurrency. 0 (the default) is
    /// hard-cap mode: caps count Running and live Claimed tasks. Above 0 is soft-cap mode:
    /// caps count Running only and `claim_lease_ms` must be set.
    pub prefetch_buffer: u32,
    /// How long a claim lasts unless renewed, in ms (at least 1). `None` means
    /// [`DEFAULT_CLAIM_LEASE_MS`]. The effective lease must be at least twice
    /// `recovery.claimer_heartbeat_interval_ms`, so one late renewal does not lose a claim.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "millis::option")]
    pub claim_lease_ms: Option<u64>,
    /// Claims older than this are no longer renewed and lapse, so a claim orphaned by a
    /// failed hand-back cannot live forever: at least 1 and at least the effective lease,
    /// default 180 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub max_claim_renew_age_ms: u64,
    /// Backoff while the database fails.
    pub resilience: ResilienceConfig,
    /// Heartbeats and the reaper.
    pub recovery: RecoveryConfig,
    /// The policy of tasks enqueued without one.
    pub retry: RetryPolicy,
    /// Tasks enqueued on a timetable (`[[app.schedules]]`): unique names, known queues.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<ScheduleConfig>,
}

impl Default for AppConfig {
    fn default() -> Self {
        AppConfig {
            queue_mode: QueueMode::Default,
            custom_queues: Vec::new(),
            cluster_wide_cap: None,
            prefetch_buffer: 0,
            claim_lease_ms: None,
            max_claim_renew_age_ms: 180_000,
            resilience: ResilienceConfig::default(),
            recovery: RecoveryConfig::default(),
            retry: RetryPolicy::none(),
            schedules: Vec::new(),
        }
    }
}

impl AppConfig {
    /// The defaults: one default queue, hard-cap mode, the default lease.
    pub fn new() -> Self {
        AppConfig::default()
    }

    /// The claim lease in ms: `claim_lease_ms`, or [`DEFAULT_CLAIM_LEASE_MS`].
    pub fn effective_claim_lease_ms(&self) -> u64 {
        self.claim_lease_ms.unwrap_or(DEFAULT_CLAIM_LEASE_MS)
    }

    /// Whether caps count live Claimed tasks too (`prefetch_buffer = 0`).
    pub fn is_hard_cap_mode(&self) -> bool {
        self.prefetch_buffer == 0
    }

    /// The application's queues: in default mode the one uncapped queue
    /// [`DEFAULT_QUEUE_NAME`] of priority 1, in custom mode `custom_queues` in their order.
    pub fn queues(&self) -> Vec<CustomQueue> {
        match self.queue_mode {
            QueueMode::Default => vec![CustomQueue::new(DEFAULT_QUEUE_NAME)],
            QueueMode::Custom => self.custom_queues.clone(),
        }
    }

    /// The queue named `name`, if the application has it.
    pub fn queue(&self, name: &str) -> Option<CustomQueue> {
        self.queues().into_iter().find(|q| q.name == name)
    }

    /// The names of [`queues`](Self::queues), in order, borrowed (enqueue checks every task's
    /// queue against them).
    pub fn queue_names(&self) -> impl Iterator<Item = &str> {
        let (default, custom) = match self.queue_mode {
            QueueMode::Default => (Some(DEFAULT_QUEUE_NAME), &[][..]),
            QueueMode::Custom => (None, &self.custom_queues[..]),
        };
        default.into_iter().chain(custom.iter().map(|q| q.name.as_str()))
    }

    /// Whether the application has a queue named `name`.
    pub fn has_queue(&self, name: &str) -> bool {
        self.queue_names().any(|q| q == name)
    }

    /// Every problem of this configuration; fields are named without a prefix
    /// (`prefetch_buffer`, `recovery.check_interval_ms`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    /// Parses TOML (the keys of an `[app]` table, at top level), then validates.
    pub fn from_toml_str(s: &str) -> Result<Self, LoadError> {
        let app: AppConfig = parse_toml(s)?;
        app.validate()?;
        Ok(app)
    }

    /// Parses JSON (the object of `"app"`), then validates.
    pub fn from_json_str(s: &str) -> Result<Self, LoadError> {
        let app: AppConfig = parse_json(s)?;
        app.validate()?;
        Ok(app)
    }

    fn check(&self, c: &mut Check<'_>) {
        self.check_queues(c);

        if self.cluster_wide_cap == Some(0) {
            c.problem("cluster_wide_cap", 0, "at least 1 when set (leave it out for no cluster-wide cap)");
        }
        // Soft-cap mode counts Running only, so a cluster-wide count of it would let the
        // cluster overshoot by every worker's buffer.
        if self.cluster_wide_cap.is_some() && self.prefetch_buffer > 0 {
            c.problem("prefetch_buffer", self.prefetch_buffer, "0 when cluster_wide_cap is set");
        }

        let lease = self.effective_claim_lease_ms();
        let lease_ok = match self.claim_lease_ms {
            None if self.prefetch_buffer > 0 => {
                c.problem("claim_lease_ms", "none", "a lease in ms when prefetch_buffer > 0 (soft-cap mode)");
                false
            }
            Some(0) => {
                c.problem("claim_lease_ms", 0, "at least 1");
                false
            }
            _ => true,
        };
        let claimer_hb = self.recovery.claimer_heartbeat_interval_ms;
        if lease_ok && HEARTBEAT_INTERVAL_MS.contains(&claimer_hb) {
            let floor = claimer_hb.saturating_mul(2);
            if lease < floor {
                let value = match self.claim_lease_ms {
                    Some(ms) => ms.to_string(),
                    None => format!("none ({DEFAULT_CLAIM_LEASE_MS} by default)"),
                };
                c.problem(
                    "claim_lease_ms",
                    value,
                    format!("at least {floor} (twice recovery.claimer_heartbeat_interval_ms)"),
                );
            }
        }

        let renew_age = self.max_claim_renew_age_ms;
        if renew_age == 0 || (lease_ok && renew_age < lease) {
            let expected = if lease_ok {
                format!("at least {lease} (the effective claim lease)")
            } else {
                "at least 1".to_owned()
            };
            c.problem("max_claim_renew_age_ms", renew_age, expected);
        }

        self.resilience.check(&mut c.nested("resilience"));
        self.recovery.check(&mut c.nested("recovery"));
        self.retry.check(&mut c.nested("retry"));
        self.check_schedules(c);
    }

    /// The checks of the app's schedules: each one's fields, unique names, known queues.
    fn check_schedules(&self, c: &mut Check<'_>) {
        let mut first_at: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, schedule) in self.schedules.iter().enumerate() {
            schedule.check(&mut c.nested(&format!("schedules[{i}]")));
            if is_valid_queue_name(&schedule.name) {
                if let Some(first) = first_at.get(schedule.name.as_str()) {
                    c.problem(
                        &format!("schedules[{i}].name"),
                        format!("{:?}", schedule.name),
                        format!("a name not already used by schedules[{first}]"),
                    );
                } else {
                    first_at.insert(&schedule.name, i);
                }
            }
            if let Some(queue) = &schedule.queue {
                if is_valid_queue_name(queue) && !self.has_queue(queue) {
                    let known = self.queue_names().collect::<Vec<_>>().join(", ");
                    c.problem(
                        &format!("schedules[{i}].queue"),
                        format!("{queue:?}"),
                        format!("one of the app's queues: {known}"),
                    );
                }
            }
        }
    }

    fn check_queues(&self, c: &mut Check<'_>) {
        match self.queue_mode {
            QueueMode::Default if !self.custom_queues.is_empty() => {
                let names: Vec<&str> = self.custom_queues.iter().map(|q| &*q.name).collect();
                c.problem(
                    "custom_queues",
                    format!("{names:?}"),
                    "no custom queues in default queue mode (or queue_mode = \"custom\")",
                );
            }
            QueueMode::Custom if self.custom_queues.is_empty() => {
                c.problem("custom_queues", "[]", "at least one queue in custom queue mode");
            }
            _ => {}
        }
        let mut first_at: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, queue) in self.custom_queues.iter().enumerate() {
            let name_field = format!("custom_queues[{i}].name");
            if !is_valid_queue_name(&queue.name) {
                c.problem(&name_field, format!("{:?}", queue.name), QUEUE_NAME_RULE);
            } else if let Some(first) = first_at.get(queue.name.as_str()) {
                c.problem(
                    &name_field,
                    format!("{:?}", queue.name),
                    format!("a name not already used by custom_queues[{first}]"),
                );
            } else {
                first_at.insert(&queue.name, i);
            }
            c.range(&format!("custom_queues[{i}].priority"), queue.priority, QUEUE_PRIORITY);
            if let (true, Some(cap @ 2..)) = (queue.serial, queue.max_concurrency) {
                c.problem(
                    &format!("custom_queues[{i}].max_concurrency"),
                    cap,
                    "unset, 1, or 0 (paused) for a serial queue",
                );
            }
        }
    }
}

impl ResilienceConfig {
    /// Every problem of these settings; fields are named without a prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    fn check(&self, c: &mut Check<'_>) {
        let initial_ok = c.range("db_retry_initial_ms", self.db_retry_initial_ms, DB_RETRY_INITIAL_MS);
        let max_ok = c.range("db_retry_max_ms", self.db_retry_max_ms, DB_RETRY_MAX_MS);
        if initial_ok && max_ok && self.db_retry_max_ms < self.db_retry_initial_ms {
            c.problem(
                "db_retry_max_ms",
                self.db_retry_max_ms,
                format!("at least {} (db_retry_initial_ms)", self.db_retry_initial_ms),
            );
        }
        c.range("db_retry_max_attempts", self.db_retry_max_attempts, DB_RETRY_MAX_ATTEMPTS);
    }
}

impl RecoveryConfig {
    /// Every problem of these settings; fields are named without a prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    fn check(&self, c: &mut Check<'_>) {
        let claimer_ok = HEARTBEAT_INTERVAL_MS.contains(&self.claimer_heartbeat_interval_ms);
        let runner_ok = HEARTBEAT_INTERVAL_MS.contains(&self.runner_heartbeat_interval_ms);

        let claimed = self.claimed_stale_threshold_ms;
        if c.range("claimed_stale_threshold_ms", claimed, CLAIMED_STALE_THRESHOLD_MS) && claimer_ok {
            let floor = self.claimer_heartbeat_interval_ms.saturating_mul(2);
            if claimed < floor {
                c.problem(
                    "claimed_stale_threshold_ms",
                    claimed,
                    format!("at least {floor} (twice claimer_heartbeat_interval_ms)"),
                );
            }
        }

        let running = self.running_stale_threshold_ms;
        if c.range("running_stale_threshold_ms", running, RUNNING_STALE_THRESHOLD_MS) && runner_ok {
            let floor = self.runner_heartbeat_interval_ms.saturating_mul(2);
            if running < floor {
                c.problem(
                    "running_stale_threshold_ms",
                    running,
                    format!("at least {floor} (twice runner_heartbeat_interval_ms)"),
                );
            }
        }

        c.range("check_interval_ms", self.check_interval_ms, CHECK_INTERVAL_MS);
        if let Some(retention) = self.finished_retention_ms {
            c.range("finished_retention_ms", retention, FINISHED_RETENTION_MS);
        }
        c.range("worker_retention_ms", self.worker_retention_ms, FINISHED_RETENTION_MS);
        if let Some(retention) = self.idempotency_retention_ms {
            c.range("idempotency_retention_ms", retention, FINISHED_RETENTION_MS);
        }
        c.range("runner_heartbeat_interval_ms", self.runner_heartbeat_interval_ms, HEARTBEAT_INTERVAL_MS);
        c.range("claimer_heartbeat_interval_ms", self.claimer_heartbeat_interval_ms, HEARTBEAT_INTERVAL_MS);
        c.range("liveness_check_interval_ms", self.liveness_check_interval_ms, LIVENESS_CHECK_INTERVAL_MS);
        c.range("liveness_grace_ms", self.liveness_grace_ms, LIVENESS_GRACE_MS);
        c.range("crash_retries", self.crash_retries, CRASH_RETRIES);
        if let Some(rows) = self.vacuum_dead_rows {
            c.range("vacuum_dead_rows", rows, VACUUM_DEAD_ROWS);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Worker
// ---------------------------------------------------------------------------------------------

/// How a worker learns that there is work.
///
/// Serialized as `"PollingOnly"`, `"EventDrivenOnly"`, `"Hybrid"`; the snake_case spellings
/// `polling_only`, `event_driven_only` and `hybrid` are accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub enum DeploymentMode {
    /// Poll every `poll_interval_ms`; no LISTEN connection.
    #[serde(alias = "polling_only")]
    PollingOnly,
    /// Wake on NOTIFY only. A lost notification leaves work waiting until the next one.
    #[serde(alias = "event_driven_only")]
    EventDrivenOnly,
    /// Wake on NOTIFY, and poll as a fallback for lost notifications and future run-at times.
    #[default]
    #[serde(alias = "hybrid")]
    Hybrid,
}

impl DeploymentMode {
    /// Whether the worker LISTENs for notifications.
    pub fn listens(self) -> bool {
        matches!(self, DeploymentMode::EventDrivenOnly | DeploymentMode::Hybrid)
    }

    /// Whether the worker polls on a timer.
    pub fn polls(self) -> bool {
        matches!(self, DeploymentMode::PollingOnly | DeploymentMode::Hybrid)
    }
}

/// The settings of one worker process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// The queues this worker serves, each a queue of the app, no duplicates. Empty (the
    /// default) serves every queue of the app.
    pub queues: Vec<String>,
    /// The most tasks this worker runs at once: 1 to 10 000, default 16.
    pub concurrency: u32,
    /// The most tasks claimed from one queue in one pass: 0 (the default) fills the budget,
    /// else 1 to 10 000.
    pub max_claim_batch: u32,
    /// The most live Claimed tasks this worker holds. 0 (the default) is automatic:
    /// `concurrency` in hard-cap mode, `concurrency + prefetch_buffer` in soft-cap mode.
    pub max_claim_per_worker: u32,
    /// This worker's own queue priorities (1 to 100), overriding the app's; each key a
    /// queue this worker serves.
    pub queue_priorities: BTreeMap<String, u8>,
    /// The most queued notifications drained into one claim pass: 1 to 10 000, default 100.
    pub coalesce_notifies: u32,
    /// Whether the worker listens, polls, or both.
    pub deployment_mode: DeploymentMode,
    /// The poll period (`notify_poll_interval_ms` in the seeds): 1 000 to 300 000 ms,
    /// default 5 000. In every mode that listens, also how often at least a claim pass looks
    /// at every row, where passes woken by announced run-ats start at their bound.
    #[serde(deserialize_with = "millis::deserialize")]
    pub poll_interval_ms: u64,
    /// How long a handler may run before it fails with `TASK_TIMEOUT`: 1 to 86 400 000 ms,
    /// default 30 000; `None` = no timeout. In files, 0 (or JSON null) means `None`, and
    /// `None` is written as 0, because TOML has no null.
    #[serde(serialize_with = "zero_is_none::serialize", deserialize_with = "millis::zero_is_none")]
    pub handler_timeout_ms: Option<u64>,
    /// How long running tasks may finish after shutdown is asked before they are handed
    /// back: 0 to 3 600 000 ms, default 30 000.
    #[serde(deserialize_with = "millis::deserialize")]
    pub shutdown_grace_ms: u64,
    /// The most completions written in one statement: 1 to 10 000, default 500.
    pub completion_batch_max: u32,
    /// The largest result (or error data) a handler may return, as JSON bytes: 1 024 to
    /// 268 435 455 (PostgreSQL's limit), default 8 MiB. A larger one, or one PostgreSQL cannot
    /// hold (text with U+0000, nesting over [`MAX_JSON_DEPTH`](crate::store::MAX_JSON_DEPTH)), fails
    /// its own task with `WORKER_SERIALIZATION_ERROR` instead of being written.
    pub max_result_bytes: u64,
    /// The seed of the worker's PRNG (jitter); `None` lets the adapter pick one. In TOML it
    /// must fit an `i64`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Tasks carrying any of these flags are not claimed by this worker (graphile-worker's
    /// forbidden flags); each a valid flag ([`is_valid_flag`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forbidden_flags: Vec<String>,
    /// Whether this worker also runs the scheduler of the app's schedules
    /// ([`AppConfig::schedules`]) beside its worker loop, default false: schedules then fire
    /// only where a process opts in (a few workers, or `canter scheduler`), so a large fleet
    /// does not send every check from every worker. Any number of schedulers may run: each
    /// tick is enqueued once.
    pub run_scheduler: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            queues: Vec::new(),
            concurrency: 16,
            max_claim_batch: 0,
            max_claim_per_worker: 0,
            queue_priorities: BTreeMap::new(),
            coalesce_notifies: 100,
            deployment_mode: DeploymentMode::Hybrid,
            poll_interval_ms: 5_000,
            handler_timeout_ms: Some(30_000),
            shutdown_grace_ms: 30_000,
            completion_batch_max: 500,
            max_result_bytes: 8 * 1024 * 1024,
            seed: None,
            forbidden_flags: Vec::new(),
            run_scheduler: false,
        }
    }
}

impl WorkerConfig {
    /// How many connections the pool of a worker with these settings should allow: a quarter
    /// of its concurrency, at least 4 and at most 32. The worker has at most one request of
    /// each kind in flight (claim, urgent claim, start, finish, heartbeat, reaper, purge,
    /// vacuum) and keeps a few connections between statements; its listener and its liveness
    /// token take one each beside the pool. What `canter worker` and the bench use.
    pub fn pool_size(&self) -> u32 {
        (self.concurrency / 4).clamp(4, 32)
    }

    /// The PRNG seed of worker `id`: the configured one, or one derived from the id (never
    /// from the OS, so a run replays).
    pub fn seed_for(&self, id: &crate::task::WorkerId) -> u64 {
        self.seed.unwrap_or_else(|| id.0.bytes().fold(0x6A09_E667_F3BC_C909, |h, b| crate::rng::mix(h ^ u64::from(b))))
    }

    /// Every problem of these settings against `app`; fields are named without a prefix.
    pub fn validate(&self, app: &AppConfig) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(app, &mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    /// The queues this worker serves, with its priority overrides applied, sorted by
    /// priority and then by configured order (its `queues` list, or the app's order when
    /// that is empty). Names the app does not have and repeats are left out.
    pub fn served_queues(&self, app: &AppConfig) -> Vec<CustomQueue> {
        let app_queues = app.queues();
        let mut served: Vec<CustomQueue> = if self.queues.is_empty() {
            app_queues
        } else {
            let mut picked: Vec<CustomQueue> = Vec::new();
            for name in &self.queues {
                if picked.iter().any(|q| &q.name == name) {
                    continue;
                }
                if let Some(queue) = app_queues.iter().find(|q| &q.name == name) {
                    picked.push(queue.clone());
                }
            }
            picked
        };
        for queue in &mut served {
            if let Some(&priority) = self.queue_priorities.get(&queue.name) {
                queue.priority = priority;
            }
        }
        // A stable sort keeps the configured order among equal priorities.
        served.sort_by_key(|q| q.priority);
        served
    }

    /// The most live Claimed tasks this worker holds: `max_claim_per_worker`, or when that
    /// is 0, `concurrency` (hard-cap mode) or `concurrency + prefetch_buffer` (soft-cap mode).
    pub fn effective_max_claim_per_worker(&self, app: &AppConfig) -> u32 {
        if self.max_claim_per_worker > 0 {
            self.max_claim_per_worker
        } else if app.is_hard_cap_mode() {
            self.concurrency
        } else {
            self.concurrency.saturating_add(app.prefetch_buffer)
        }
    }

    fn check(&self, app: &AppConfig, c: &mut Check<'_>) {
        let app_queues = app.queues();
        let app_names = || app_queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>().join(", ");
        let mut first_at: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, name) in self.queues.iter().enumerate() {
            let field = format!("queues[{i}]");
            if !app_queues.iter().any(|q| &q.name == name) {
                c.problem(&field, format!("{name:?}"), format!("one of the app's queues: {}", app_names()));
            } else if let Some(first) = first_at.get(name.as_str()) {
                c.problem(&field, format!("{name:?}"), format!("a queue not already listed at queues[{first}]"));
            } else {
                first_at.insert(name, i);
            }
        }

        c.range("concurrency", self.concurrency, CONCURRENCY);
        if !MAX_CLAIM_BATCH.contains(&self.max_claim_batch) {
            c.problem("max_claim_batch", self.max_claim_batch, "0 (automatic) or 1 to 10000");
        }

        let served: BTreeSet<String> = self.served_queues(app).into_iter().map(|q| q.name).collect();
        for (name, &priority) in &self.queue_priorities {
            let field = format!("queue_priorities.{}", key_path(name));
            if !served.contains(name) {
                let served_names: Vec<&str> = served.iter().map(String::as_str).collect();
                c.problem(
                    &field,
                    format!("{name:?}"),
                    format!("a queue this worker serves: {}", served_names.join(", ")),
                );
            }
            c.range(&field, priority, QUEUE_PRIORITY);
        }

        c.range("coalesce_notifies", self.coalesce_notifies, COALESCE_NOTIFIES);
        c.range("poll_interval_ms", self.poll_interval_ms, POLL_INTERVAL_MS);
        if let Some(ms) = self.handler_timeout_ms {
            if !HANDLER_TIMEOUT_MS.contains(&ms) {
                c.problem("handler_timeout_ms", ms, "1 to 86400000 (or none for no timeout)");
            }
        }
        c.range("shutdown_grace_ms", self.shutdown_grace_ms, SHUTDOWN_GRACE_MS);
        c.range("completion_batch_max", self.completion_batch_max, COMPLETION_BATCH_MAX);
        c.range("max_result_bytes", self.max_result_bytes, MAX_RESULT_BYTES);
        for (i, flag) in self.forbidden_flags.iter().enumerate() {
            if !is_valid_flag(flag) {
                c.problem(
                    &format!("forbidden_flags[{i}]"),
                    format!("{flag:?}"),
                    "1 to 64 bytes of a-z, 0-9, _, -, . and :",
                );
            }
        }
    }
}

/// A key as one step of a dotted path: bare when it is a plain name, quoted otherwise.
fn key_path(key: &str) -> String {
    let bare = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare { key.to_owned() } else { format!("{key:?}") }
}

/// Serde for optional numbers whose 0 would mean nothing (`handler_timeout_ms`,
/// `vacuum_dead_rows`): TOML has no null, so 0 stands for `None`.
/// Milliseconds in a file: a whole number, or a duration as text (`"90s"`, `"1h30m"`, read by
/// [`parse_duration_ms`](crate::time::parse_duration_ms): one grammar with the command line and
/// the schedules). Written back as numbers.
mod millis {
    use std::fmt;

    use serde::Deserializer;
    use serde::de::{self, Visitor};

    struct Millis;

    impl<'de> Visitor<'de> for Millis {
        type Value = u64;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("milliseconds: a whole number, or a duration like \"90s\" or \"1h30m\"")
        }

        fn visit_u64<E: de::Error>(self, ms: u64) -> Result<u64, E> {
            Ok(ms)
        }

        fn visit_i64<E: de::Error>(self, ms: i64) -> Result<u64, E> {
            u64::try_from(ms).map_err(|_| E::invalid_value(de::Unexpected::Signed(ms), &self))
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<u64, E> {
            crate::time::parse_duration_ms(text).map_err(E::custom)
        }
    }

    /// Nothing (JSON null) or milliseconds.
    struct MaybeMillis;

    impl<'de> Visitor<'de> for MaybeMillis {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            Millis.expecting(f)
        }

        fn visit_none<E: de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Option<u64>, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<u64>, D::Error> {
            deserializer.deserialize_any(Millis).map(Some)
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(Millis)
    }

    pub(super) fn option<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        deserializer.deserialize_option(MaybeMillis)
    }

    /// Milliseconds where 0 (or null) means none.
    pub(super) fn zero_is_none<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        Ok(option(deserializer)?.filter(|&ms| ms != 0))
    }
}

mod zero_is_none {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(value: &Option<u64>, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(value.unwrap_or(0))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
        Ok(Option::<u64>::deserialize(deserializer)?.filter(|&ms| ms != 0))
    }
}

// ---------------------------------------------------------------------------------------------
// A whole configuration file
// ---------------------------------------------------------------------------------------------

/// The format of a configuration file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileFormat {
    /// TOML (`.toml`).
    Toml,
    /// JSON (`.json`).
    Json,
}

/// A configuration file: an `[app]` table and a `[worker]` table.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The application's shared configuration.
    pub app: AppConfig,
    /// This worker process's settings.
    pub worker: WorkerConfig,
}

impl Config {
    /// The configuration for throughput: soft-cap mode with a buffer of up to 2,048 claims
    /// beyond the worker's slots (sized to a few round trips of work at the measured rate), a
    /// 60 s claim lease, and completions written in batches of up to 5,000. Queue caps then
    /// count Running tasks only (a buffered claim is not counted), and an urgent task claimed
    /// during a backlog starts after an urgent claim of its own rather than at once. What
    /// `canter bench` runs; see the README's benchmarks.
    pub fn throughput() -> Config {
        Config {
            app: AppConfig { prefetch_buffer: 2_048, claim_lease_ms: Some(60_000), ..AppConfig::default() },
            worker: WorkerConfig { completion_batch_max: 5_000, ..WorkerConfig::default() },
        }
    }

    /// The configuration for exact caps and latency: hard-cap mode (no buffer beyond what
    /// the caps allow: every cap counts live claims too), finishes that claim the freed slots
    /// in the same round trip, completions written as they come. The seeds' defaults, which
    /// [`Config::default`] is.
    pub fn latency() -> Config {
        Config::default()
    }

    /// Every problem of the app and the worker together, named `app.…` and `worker.…`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_pair(&self.app, &self.worker)
    }

    /// Parses TOML, then validates. A value of the wrong type or an unknown key is a
    /// [`LoadError::Toml`] that names every such problem of the document (the first with its
    /// line and column) and then every rule the rest breaks, so one run reports them all.
    pub fn from_toml_str(s: &str) -> Result<Self, LoadError> {
        let config = Config::parse_toml_str(s)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses TOML without checking the rules, reporting shape problems together as
    /// [`from_toml_str`](Config::from_toml_str) does.
    fn parse_toml_str(s: &str) -> Result<Self, LoadError> {
        parse_toml(s).map_err(|error| match (error, toml::from_str::<toml::Table>(s)) {
            (LoadError::Toml(first), Ok(table)) => {
                LoadError::Toml(with_other_problems(first, serde_json::to_value(table).unwrap_or_default()))
            }
            (error, _) => error,
        })
    }

    /// Parses JSON, then validates; shape problems are reported together as
    /// [`from_toml_str`](Config::from_toml_str) does.
    pub fn from_json_str(s: &str) -> Result<Self, LoadError> {
        let config = Config::parse_json_str(s)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses JSON without checking the rules, as [`parse_toml_str`](Config::parse_toml_str).
    fn parse_json_str(s: &str) -> Result<Self, LoadError> {
        parse_json(s).map_err(|error| match (error, serde_json::from_str::<serde_json::Value>(s)) {
            (LoadError::Json(first), Ok(document)) => LoadError::Json(with_other_problems(first, document)),
            (error, _) => error,
        })
    }

    /// The format of a configuration file at `path`, by its extension (`.toml` or `.json`).
    pub fn format_of(path: &Path) -> Result<FileFormat, LoadError> {
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if extension.eq_ignore_ascii_case("toml") {
            Ok(FileFormat::Toml)
        } else if extension.eq_ignore_ascii_case("json") {
            Ok(FileFormat::Json)
        } else {
            Err(LoadError::UnknownFormat(path.to_path_buf()))
        }
    }

    /// Parses `text`, the contents of the file at `path` (TOML for `.toml`, JSON for `.json`;
    /// syntax errors name the file), then validates. Reading the file is the caller's
    /// (`canter::driver::read_config` reads and parses one).
    pub fn from_file_text(path: &Path, text: &str) -> Result<Self, LoadError> {
        let config = Config::parse_file_text(path, text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses `text` as [`from_file_text`](Config::from_file_text) does, without checking the
    /// rules: for a caller that lays its own settings (flags) over the file's and then calls
    /// [`validate`](Config::validate), so a flag can correct a value of the file.
    pub fn parse_file_text(path: &Path, text: &str) -> Result<Self, LoadError> {
        // Name the file in syntax errors: the message alone does not say which file.
        let in_file = |message: String| format!("{}: {message}", path.display());
        match Config::format_of(path)? {
            FileFormat::Toml => Config::parse_toml_str(text).map_err(|e| match e {
                LoadError::Toml(message) => LoadError::Toml(in_file(message)),
                other => other,
            }),
            FileFormat::Json => Config::parse_json_str(text).map_err(|e| match e {
                LoadError::Json(message) => LoadError::Json(in_file(message)),
                other => other,
            }),
        }
    }
}

/// `first`, the deserializer's message, followed by the document's other problems: each
/// value that does not fit its field (or key no table has), found key by key, innermost tables
/// first, and then the rules that what remains breaks ([`Config::validate`]), the fields with a
/// value of the wrong type left out.
fn with_other_problems(first: String, mut document: serde_json::Value) -> String {
    let mut shape: Vec<(String, String)> = Vec::new();
    for (path, section) in [
        ("app.recovery.", ["app", "recovery"]),
        ("app.resilience.", ["app", "resilience"]),
        ("app.retry.", ["app", "retry"]),
    ] {
        if let Some(table) = document.get_mut(section[0]).and_then(|app| app.get_mut(section[1])) {
            match section[1] {
                "recovery" => sift::<RecoveryConfig>(path, table, &mut shape),
                "resilience" => sift::<ResilienceConfig>(path, table, &mut shape),
                _ => sift::<RetryPolicy>(path, table, &mut shape),
            }
        }
    }
    if let Some(app) = document.get_mut("app") {
        sift::<AppConfig>("app.", app, &mut shape);
    }
    if let Some(worker) = document.get_mut("worker") {
        sift::<WorkerConfig>("worker.", worker, &mut shape);
    }
    sift::<Config>("", &mut document, &mut shape);
    let Ok(rest) = serde_json::from_value::<Config>(document) else {
        return first;
    };
    let mut problems: Vec<String> = shape
        .iter()
        .filter(|(_, message)| !first.contains(message.as_str()))
        .map(|(field, message)| format!("`{field}`: {message}"))
        .collect();
    if let Err(error) = rest.validate() {
        let mistyped = |field: &str| {
            shape.iter().any(|(bad, _)| {
                field == bad || field.strip_prefix(bad.as_str()).is_some_and(|r| r.starts_with(['.', '[']))
            })
        };
        problems.extend(error.problems.iter().filter(|p| !mistyped(&p.field)).map(ToString::to_string));
    }
    if problems.is_empty() { first } else { format!("{first}; {}", problems.join("; ")) }
}

/// Moves out of `table` (a table of `T`) each key whose value alone does not deserialize as
/// `T`'s, noting its path and why.
fn sift<T: DeserializeOwned>(path: &str, table: &mut serde_json::Value, problems: &mut Vec<(String, String)>) {
    let Some(object) = table.as_object_mut() else {
        return;
    };
    let keys: Vec<String> = object.keys().cloned().collect();
    for key in keys {
        let Some(value) = object.get(&key) else { continue };
        let alone = serde_json::Value::Object([(key.clone(), value.clone())].into_iter().collect());
        if let Err(error) = serde_json::from_value::<T>(alone) {
            problems.push((format!("{path}{key}"), error.to_string()));
            object.remove(&key);
        }
    }
}

fn parse_toml<T: DeserializeOwned>(s: &str) -> Result<T, LoadError> {
    toml::from_str(s).map_err(|e| LoadError::Toml(toml_message(s, &e)))
}

fn parse_json<T: DeserializeOwned>(s: &str) -> Result<T, LoadError> {
    serde_json::from_str(s).map_err(|e| LoadError::Json(e.to_string()))
}

/// A TOML error on one line: `line L, column C: message`. The toml crate's own rendering
/// spans several lines with a source excerpt.
fn toml_message(input: &str, error: &toml::de::Error) -> String {
    match error.span() {
        Some(span) => {
            let (line, column) = line_column(input, span.start);
            format!("line {line}, column {column}: {}", error.message())
        }
        None => error.to_string().lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; "),
    }
}

/// The 1-based line and column (in characters) of byte `offset` of `input`.
fn line_column(input: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(input.len());
    while !input.is_char_boundary(end) {
        end -= 1;
    }
    let before = &input[..end];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Every problem of `app` and `worker` together, named `app.…` and `worker.…`.
pub fn validate_pair(app: &AppConfig, worker: &WorkerConfig) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    let mut root = Check::root(&mut problems);
    app.check(&mut root.nested("app"));
    worker.check(app, &mut root.nested("worker"));
    ConfigError::from_problems(problems)
}

/// Why a configuration could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The text is not TOML, or does not have the configuration's shape (an unknown key,
    /// a wrong type).
    #[error("invalid toml configuration: {0}")]
    Toml(String),
    /// The text is not JSON, or does not have the configuration's shape.
    #[error("invalid json configuration: {0}")]
    Json(String),
    /// The file could not be read.
    #[error("cannot read configuration file {}: {message}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        message: String,
    },
    /// The file's extension is neither `.toml` nor `.json`.
    #[error("unknown configuration file format {}: expected a .toml or .json file", .0.display())]
    UnknownFormat(PathBuf),
    /// The configuration parsed but breaks rules.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
}

// ---------------------------------------------------------------------------------------------
// The problem collector
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::MAX_QUEUE_NAME_LEN;
    use serde_json::Value;

    /// An edit of a config, for tables of cases.
    type Change<T> = fn(&mut T);

    /// The fields `app.validate()` reports after `change`.
    fn app_fields(change: impl FnOnce(&mut AppConfig)) -> Vec<String> {
        let mut app = AppConfig::default();
        change(&mut app);
        match app.validate() {
            Ok(()) => Vec::new(),
            Err(e) => e.fields().map(str::to_owned).collect(),
        }
    }

    /// The fields `worker.validate(app)` reports after `change`, against `app`.
    fn worker_fields(app: &AppConfig, change: impl FnOnce(&mut WorkerConfig)) -> Vec<String> {
        let mut worker = WorkerConfig::default();
        change(&mut worker);
        match worker.validate(app) {
            Ok(()) => Vec::new(),
            Err(e) => e.fields().map(str::to_owned).collect(),
        }
    }

    fn retry_fields(policy: RetryPolicy) -> Vec<String> {
        match policy.validate() {
            Ok(()) => Vec::new(),
            Err(e) => e.fields().map(str::to_owned).collect(),
        }
    }

    fn custom_app(queues: Vec<CustomQueue>) -> AppConfig {
        AppConfig { queue_mode: QueueMode::Custom, custom_queues: queues, ..AppConfig::default() }
    }

    /// Every field set away from its default, still valid.
    fn full_config() -> Config {
        Config {
            app: AppConfig {
                queue_mode: QueueMode::Custom,
                custom_queues: vec![
                    CustomQueue::new("emails").with_max_concurrency(20),
                    CustomQueue::new("reports").with_priority(5),
                    CustomQueue::new("paused").with_max_concurrency(0),
                    CustomQueue::new("ledger").serial(),
                ],
                cluster_wide_cap: None,
                prefetch_buffer: 4,
                claim_lease_ms: Some(90_000),
                max_claim_renew_age_ms: 240_000,
                resilience: ResilienceConfig {
                    db_retry_initial_ms: 250,
                    db_retry_max_ms: 10_000,
                    db_retry_max_attempts: 50,
                },
                recovery: RecoveryConfig {
                    auto_requeue_stale_claimed: false,
                    claimed_stale_threshold_ms: 90_000,
                    auto_fail_stale_running: false,
                    running_stale_threshold_ms: 600_000,
                    check_interval_ms: 15_000,
                    runner_heartbeat_interval_ms: 20_000,
                    claimer_heartbeat_interval_ms: 10_000,
                    finished_retention_ms: Some(86_400_000),
                    idempotency_retention_ms: Some(604_800_000),
                    worker_retention_ms: 86_400_000,
                    auto_recover_dead_workers: false,
                    liveness_check_interval_ms: 500,
                    liveness_grace_ms: 5_000,
                    crash_retries: 0,
                    vacuum_dead_rows: None,
                },
                retry: RetryPolicy::exponential(5, 8)
                    .with_codes(vec![ErrorCode::TaskTimeout, ErrorCode::User("RATE_LIMITED".into())])
                    .with_jitter(false),
                schedules: vec![ScheduleConfig {
                    cron: Some("0 3 * * *".into()),
                    args: serde_json::json!({"kind": "daily"}),
                    queue: Some("reports".into()),
                    timezone: "Europe/Paris".into(),
                    backfill: 2,
                    ..ScheduleConfig::new("nightly_report", "report")
                }],
            },
            worker: WorkerConfig {
                queues: vec!["reports".into(), "emails".into()],
                concurrency: 32,
                max_claim_batch: 10,
                max_claim_per_worker: 40,
                queue_priorities: BTreeMap::from([("reports".into(), 2), ("emails".into(), 3)]),
                coalesce_notifies: 50,
                deployment_mode: DeploymentMode::PollingOnly,
                poll_interval_ms: 2_000,
                handler_timeout_ms: Some(120_000),
                shutdown_grace_ms: 10_000,
                completion_batch_max: 200,
                max_result_bytes: 65_536,
                seed: Some(42),
                forbidden_flags: vec!["gpu".into()],
                run_scheduler: true,
            },
        }
    }

    /// Writes a JSON object as TOML. The crate is built without toml's serializer, and
    /// every config table is plain: scalars, arrays of scalars, tables and arrays of tables.
    fn to_toml(value: &Value) -> String {
        fn key(k: &str) -> String {
            Value::String(k.to_owned()).to_string()
        }
        fn inline(v: &Value) -> String {
            match v {
                Value::Array(items) => {
                    let items: Vec<String> = items.iter().map(inline).collect();
                    format!("[{}]", items.join(", "))
                }
                other => other.to_string(),
            }
        }
        fn is_table_array(v: &Value) -> bool {
            matches!(v, Value::Array(items) if items.iter().any(Value::is_object))
        }
        fn table(out: &mut String, path: &str, map: &serde_json::Map<String, Value>) {
            for (k, v) in map {
                if !(v.is_null() || v.is_object() || is_table_array(v)) {
                    out.push_str(&format!("{} = {}\n", key(k), inline(v)));
                }
            }
            for (k, v) in map {
                let sub = if path.is_empty() { key(k) } else { format!("{path}.{}", key(k)) };
                match v {
                    Value::Object(inner) => {
                        out.push_str(&format!("\n[{sub}]\n"));
                        table(out, &sub, inner);
                    }
                    Value::Array(items) if is_table_array(v) => {
                        for item in items {
                            out.push_str(&format!("\n[[{sub}]]\n"));
                            table(out, &sub, item.as_object().expect("a table"));
                        }
                    }
                    _ => {}
                }
            }
        }
        let mut out = String::new();
        table(&mut out, "", value.as_object().expect("a table"));
        out
    }

    // --- defaults ------------------------------------------------------------------------

    #[test]
    fn defaults_validate() {
        assert_eq!(AppConfig::default().validate(), Ok(()));
        assert_eq!(WorkerConfig::default().validate(&AppConfig::default()), Ok(()));
        assert_eq!(Config::default().validate(), Ok(()));
        assert_eq!(ResilienceConfig::default().validate(), Ok(()));
        assert_eq!(RecoveryConfig::default().validate(), Ok(()));
        assert_eq!(RetryPolicy::default(), RetryPolicy::none());
        assert_eq!(RetryPolicy::none().validate(), Ok(()));
        assert_eq!(RetryPolicy::fixed(vec![60, 300, 900]).validate(), Ok(()));
        assert_eq!(RetryPolicy::exponential(30, 5).validate(), Ok(()));
        assert_eq!(full_config().validate(), Ok(()));
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let app = AppConfig::default();
        assert_eq!(app.queue_mode, QueueMode::Default);
        assert_eq!(app.max_claim_renew_age_ms, 180_000);
        assert_eq!(app.effective_claim_lease_ms(), DEFAULT_CLAIM_LEASE_MS);
        assert!(app.is_hard_cap_mode());
        assert_eq!(app.resilience.db_retry_initial_ms, 500);
        assert_eq!(app.recovery.claimed_stale_threshold_ms, 120_000);
        assert_eq!(app.recovery.running_stale_threshold_ms, 300_000);
        assert_eq!(app.retry.max_retries, 0);
        assert_eq!(
            app.retry.auto_retry_for,
            [ErrorCode::TaskError, ErrorCode::UnhandledError, ErrorCode::TaskTimeout, ErrorCode::WorkerCrashed]
        );
        let worker = WorkerConfig::default();
        assert_eq!(worker.concurrency, 16);
        assert_eq!(worker.coalesce_notifies, 100);
        assert_eq!(worker.poll_interval_ms, 5_000);
        assert_eq!(worker.handler_timeout_ms, Some(30_000));
        assert_eq!(worker.completion_batch_max, 500);
        assert_eq!(worker.deployment_mode, DeploymentMode::Hybrid);
        // An empty file is the defaults.
        assert_eq!(Config::from_toml_str("").unwrap(), Config::default());
        assert_eq!(Config::from_json_str("{}").unwrap(), Config::default());
    }

    // --- queues ----------------------------------------------------------------------------

    #[test]
    fn default_mode_rejects_custom_queues() {
        assert_eq!(app_fields(|a| a.custom_queues = vec![CustomQueue::new("emails")]), ["custom_queues"]);
    }

    #[test]
    fn custom_mode_needs_queues() {
        assert_eq!(app_fields(|a| a.queue_mode = QueueMode::Custom), ["custom_queues"]);
    }

    #[test]
    fn custom_queue_names_are_unique() {
        let app = custom_app(vec![CustomQueue::new("a"), CustomQueue::new("b"), CustomQueue::new("a")]);
        let err = app.validate().unwrap_err();
        assert_eq!(err.fields().collect::<Vec<_>>(), ["custom_queues[2].name"]);
        assert_eq!(err.problems[0].expected, "a name not already used by custom_queues[0]");
    }

    #[test]
    fn queue_names_are_short_lower_snake() {
        assert!(is_valid_queue_name(&"q".repeat(MAX_QUEUE_NAME_LEN)));
        assert!(is_valid_queue_name("emails_2"));
        for bad in ["", "Emails", "e-mails", "é", "a b", &"q".repeat(MAX_QUEUE_NAME_LEN + 1)] {
            assert!(!is_valid_queue_name(bad), "{bad:?}");
            let app = custom_app(vec![CustomQueue::new("ok"), CustomQueue::new(bad)]);
            assert_eq!(app_fields(|a| *a = app), ["custom_queues[1].name"], "{bad:?}");
        }
    }

    #[test]
    fn queue_priorities_are_1_to_100() {
        let app = custom_app(vec![
            CustomQueue::new("a").with_priority(0),
            CustomQueue::new("b").with_priority(100),
            CustomQueue::new("c").with_priority(101),
        ]);
        assert_eq!(app_fields(|a| *a = app), ["custom_queues[0].priority", "custom_queues[2].priority"]);
    }

    #[test]
    fn queues_of_each_mode() {
        let app = AppConfig::default();
        assert_eq!(app.queues(), [CustomQueue::new("default")]);
        assert_eq!(app.queue("default"), Some(CustomQueue::new("default")));
        assert_eq!(app.queue("emails"), None);
        let app = custom_app(vec![CustomQueue::new("b").with_priority(3), CustomQueue::new("a")]);
        assert_eq!(app.queues().iter().map(|q| q.name.as_str()).collect::<Vec<_>>(), ["b", "a"]);
        assert_eq!(app.queue("b").map(|q| q.priority), Some(3));
        assert_eq!(app.queue("default"), None);
    }

    // --- caps and leases -------------------------------------------------------------------

    #[test]
    fn cluster_wide_cap_is_positive() {
        assert_eq!(app_fields(|a| a.cluster_wide_cap = Some(0)), ["cluster_wide_cap"]);
        assert_eq!(app_fields(|a| a.cluster_wide_cap = Some(1)), Vec::<String>::new());
    }

    #[test]
    fn cluster_wide_cap_excludes_prefetch() {
        let mut app = AppConfig {
            cluster_wide_cap: Some(10),
            prefetch_buffer: 4,
            claim_lease_ms: Some(60_000),
            ..AppConfig::default()
        };
        let err = app.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: 1 problem: `prefetch_buffer` is 4, expected 0 when cluster_wide_cap is set"
        );
        app.cluster_wide_cap = None;
        assert_eq!(app.validate(), Ok(()));
        assert!(!app.is_hard_cap_mode());
    }

    #[test]
    fn prefetch_needs_a_lease() {
        assert_eq!(app_fields(|a| a.prefetch_buffer = 2), ["claim_lease_ms"]);
        assert_eq!(
            app_fields(|a| {
                a.prefetch_buffer = 2;
                a.claim_lease_ms = Some(60_000);
            }),
            Vec::<String>::new()
        );
    }

    #[test]
    fn claim_lease_is_positive() {
        // Reported once, not again as shorter than twice the heartbeat.
        assert_eq!(app_fields(|a| a.claim_lease_ms = Some(0)), ["claim_lease_ms"]);
    }

    #[test]
    fn claim_lease_covers_two_claimer_heartbeats() {
        assert_eq!(app_fields(|a| a.claim_lease_ms = Some(59_999)), ["claim_lease_ms"]);
        assert_eq!(app_fields(|a| a.claim_lease_ms = Some(60_000)), Vec::<String>::new());
        // The default lease counts too.
        let mut app = AppConfig::default();
        app.recovery.claimer_heartbeat_interval_ms = 40_000;
        app.recovery.claimed_stale_threshold_ms = 80_000;
        let err = app.validate().unwrap_err();
        assert_eq!(
            err.problem("claim_lease_ms").unwrap().to_string(),
            "`claim_lease_ms` is none (60000 by default), expected at least 80000 (twice recovery.claimer_heartbeat_interval_ms)"
        );
        assert_eq!(err.problems.len(), 1);
    }

    #[test]
    fn renew_age_is_positive_and_covers_the_lease() {
        assert_eq!(app_fields(|a| a.max_claim_renew_age_ms = 0), ["max_claim_renew_age_ms"]);
        assert_eq!(app_fields(|a| a.max_claim_renew_age_ms = 59_999), ["max_claim_renew_age_ms"]);
        assert_eq!(app_fields(|a| a.max_claim_renew_age_ms = 60_000), Vec::<String>::new());
        assert_eq!(
            app_fields(|a| {
                a.claim_lease_ms = Some(200_000);
            }),
            ["max_claim_renew_age_ms"]
        );
    }

    // --- resilience and recovery -----------------------------------------------------------

    #[test]
    fn resilience_ranges() {
        assert_eq!(app_fields(|a| a.resilience.db_retry_initial_ms = 99), ["resilience.db_retry_initial_ms"]);
        assert_eq!(app_fields(|a| a.resilience.db_retry_initial_ms = 60_001), ["resilience.db_retry_initial_ms"]);
        assert_eq!(app_fields(|a| a.resilience.db_retry_max_ms = 499), ["resilience.db_retry_max_ms"]);
        assert_eq!(app_fields(|a| a.resilience.db_retry_max_ms = 300_001), ["resilience.db_retry_max_ms"]);
        assert_eq!(app_fields(|a| a.resilience.db_retry_max_attempts = 10_001), ["resilience.db_retry_max_attempts"]);
        assert_eq!(app_fields(|a| a.resilience.db_retry_max_attempts = 10_000), Vec::<String>::new());
    }

    #[test]
    fn resilience_max_covers_initial() {
        let fields = app_fields(|a| {
            a.resilience.db_retry_initial_ms = 5_000;
            a.resilience.db_retry_max_ms = 4_000;
        });
        assert_eq!(fields, ["resilience.db_retry_max_ms"]);
    }

    #[test]
    fn recovery_ranges() {
        let cases: [(Change<RecoveryConfig>, &str); 16] = [
            (|r| r.claimed_stale_threshold_ms = 999, "claimed_stale_threshold_ms"),
            (|r| r.claimed_stale_threshold_ms = 3_600_001, "claimed_stale_threshold_ms"),
            (|r| r.running_stale_threshold_ms = 999, "running_stale_threshold_ms"),
            (|r| r.running_stale_threshold_ms = 7_200_001, "running_stale_threshold_ms"),
            (|r| r.check_interval_ms = 999, "check_interval_ms"),
            (|r| r.check_interval_ms = 600_001, "check_interval_ms"),
            (|r| r.runner_heartbeat_interval_ms = 999, "runner_heartbeat_interval_ms"),
            (|r| r.runner_heartbeat_interval_ms = 120_001, "runner_heartbeat_interval_ms"),
            (|r| r.claimer_heartbeat_interval_ms = 999, "claimer_heartbeat_interval_ms"),
            // Also shorter than twice the heartbeat would be, but out of range is the problem.
            (|r| r.claimer_heartbeat_interval_ms = 120_001, "claimer_heartbeat_interval_ms"),
            (|r| r.finished_retention_ms = Some(59_999), "finished_retention_ms"),
            (|r| r.finished_retention_ms = Some(3_153_600_000_001), "finished_retention_ms"),
            (|r| r.idempotency_retention_ms = Some(59_999), "idempotency_retention_ms"),
            (|r| r.idempotency_retention_ms = Some(3_153_600_000_001), "idempotency_retention_ms"),
            (|r| r.vacuum_dead_rows = Some(99), "vacuum_dead_rows"),
            (|r| r.vacuum_dead_rows = Some(1_000_000_001), "vacuum_dead_rows"),
        ];
        for (change, field) in cases {
            let mut recovery = RecoveryConfig::default();
            change(&mut recovery);
            let fields: Vec<String> = recovery.validate().unwrap_err().fields().map(str::to_owned).collect();
            assert_eq!(fields, [field]);
            assert_eq!(app_fields(|a| a.recovery = recovery), [format!("recovery.{field}")]);
        }
        let kept = RecoveryConfig {
            finished_retention_ms: Some(60_000),
            idempotency_retention_ms: Some(3_153_600_000_000),
            vacuum_dead_rows: Some(100),
            ..RecoveryConfig::default()
        };
        assert!(kept.validate().is_ok());
        assert!(
            RecoveryConfig { vacuum_dead_rows: Some(1_000_000_000), ..RecoveryConfig::default() }.validate().is_ok()
        );
    }

    #[test]
    fn stale_thresholds_cover_two_heartbeats() {
        let fields = app_fields(|a| {
            a.recovery.claimed_stale_threshold_ms = 59_999;
            a.recovery.running_stale_threshold_ms = 59_999;
        });
        assert_eq!(fields, ["recovery.claimed_stale_threshold_ms", "recovery.running_stale_threshold_ms"]);
        let fields = app_fields(|a| {
            a.recovery.runner_heartbeat_interval_ms = 100_000;
            a.recovery.running_stale_threshold_ms = 200_000;
        });
        assert_eq!(fields, Vec::<String>::new());
    }

    // --- retry policy ----------------------------------------------------------------------

    #[test]
    fn retry_max_retries_is_at_most_20() {
        let mut policy = RetryPolicy::fixed(vec![1; 20]);
        assert_eq!(retry_fields(policy.clone()), Vec::<String>::new());
        policy.max_retries = 21;
        assert_eq!(retry_fields(policy), ["max_retries"]);
        assert_eq!(retry_fields(RetryPolicy::exponential(1, 21)), ["max_retries"]);
    }

    #[test]
    fn retry_intervals_count_and_range() {
        assert_eq!(retry_fields(RetryPolicy::fixed(vec![])), ["intervals_secs"]);
        assert_eq!(retry_fields(RetryPolicy { intervals_secs: vec![], ..RetryPolicy::none() }), ["intervals_secs"]);
        assert_eq!(
            retry_fields(RetryPolicy { intervals_secs: vec![5; 21], ..RetryPolicy::none() }),
            ["intervals_secs"]
        );
        assert_eq!(retry_fields(RetryPolicy::fixed(vec![0, 60, 86_401])), ["intervals_secs[0]", "intervals_secs[2]"]);
        assert_eq!(retry_fields(RetryPolicy::exponential(0, 3)), ["intervals_secs[0]"]);
    }

    #[test]
    fn fixed_backoff_has_one_interval_per_retry() {
        let policy = RetryPolicy { max_retries: 2, ..RetryPolicy::fixed(vec![60, 300, 900]) };
        let err = policy.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: 1 problem: `intervals_secs` is [60, 300, 900], expected exactly 2 intervals (one per retry) with fixed backoff"
        );
        // Without retries the list only has to be well formed.
        assert_eq!(
            retry_fields(RetryPolicy { max_retries: 0, ..RetryPolicy::fixed(vec![60, 300]) }),
            Vec::<String>::new()
        );
    }

    #[test]
    fn exponential_backoff_has_exactly_one_interval() {
        let policy = RetryPolicy { intervals_secs: vec![5, 10], ..RetryPolicy::exponential(5, 3) };
        assert_eq!(retry_fields(policy), ["intervals_secs"]);
        let policy = RetryPolicy { intervals_secs: vec![], ..RetryPolicy::exponential(5, 3) };
        assert_eq!(retry_fields(policy), ["intervals_secs"]);
    }

    #[test]
    fn retries_need_codes_and_codes_must_be_valid() {
        assert_eq!(retry_fields(RetryPolicy::fixed(vec![60]).with_codes(vec![])), ["auto_retry_for"]);
        assert_eq!(retry_fields(RetryPolicy::none().with_codes(vec![])), Vec::<String>::new());
        let codes = vec![ErrorCode::User("RATE_LIMITED".into()), ErrorCode::User("not-upper".into())];
        assert_eq!(retry_fields(RetryPolicy::fixed(vec![60]).with_codes(codes)), ["auto_retry_for[1]"]);
        // Reached through the app with its prefix.
        assert_eq!(app_fields(|a| a.retry = RetryPolicy::fixed(vec![60]).with_codes(vec![])), ["retry.auto_retry_for"]);
    }

    #[test]
    fn retries_for_matches_codes_by_name() {
        let policy =
            RetryPolicy::fixed(vec![60]).with_codes(vec![ErrorCode::WorkerCrashed, ErrorCode::User("HTTP_503".into())]);
        assert!(policy.retries_for(&ErrorCode::WorkerCrashed));
        assert!(policy.retries_for(&ErrorCode::parse("HTTP_503")));
        assert!(!policy.retries_for(&ErrorCode::TaskError));
        assert!(RetryPolicy::fixed(vec![60]).retries_for(&ErrorCode::User("TASK_ERROR".into())));
        assert!(!RetryPolicy::none().retries_for(&ErrorCode::TaskError));
    }

    #[test]
    fn retry_constructors() {
        let fixed = RetryPolicy::fixed(vec![60, 300]);
        assert_eq!((fixed.max_retries, fixed.backoff, fixed.jitter), (2, BackoffStrategy::Fixed, true));
        let exp = RetryPolicy::exponential(10, 4);
        assert_eq!(
            (exp.max_retries, exp.intervals_secs.as_slice(), exp.backoff),
            (4, &[10][..], BackoffStrategy::Exponential)
        );
    }

    // --- worker ----------------------------------------------------------------------------

    #[test]
    fn worker_ranges() {
        let app = AppConfig::default();
        let cases: [(Change<WorkerConfig>, &str); 12] = [
            (|w| w.concurrency = 0, "concurrency"),
            (|w| w.concurrency = 10_001, "concurrency"),
            (|w| w.max_claim_batch = 10_001, "max_claim_batch"),
            (|w| w.coalesce_notifies = 0, "coalesce_notifies"),
            (|w| w.coalesce_notifies = 10_001, "coalesce_notifies"),
            (|w| w.poll_interval_ms = 999, "poll_interval_ms"),
            (|w| w.poll_interval_ms = 300_001, "poll_interval_ms"),
            (|w| w.handler_timeout_ms = Some(0), "handler_timeout_ms"),
            (|w| w.handler_timeout_ms = Some(86_400_001), "handler_timeout_ms"),
            (|w| w.shutdown_grace_ms = 3_600_001, "shutdown_grace_ms"),
            (|w| w.completion_batch_max = 0, "completion_batch_max"),
            (|w| w.completion_batch_max = 10_001, "completion_batch_max"),
        ];
        for (change, field) in cases {
            assert_eq!(worker_fields(&app, change), [field]);
        }
        let fine: [Change<WorkerConfig>; 5] = [
            |w| w.max_claim_batch = 10_000,
            |w| w.handler_timeout_ms = None,
            |w| w.shutdown_grace_ms = 0,
            |w| w.seed = Some(u64::MAX),
            |w| w.deployment_mode = DeploymentMode::EventDrivenOnly,
        ];
        for change in fine {
            assert_eq!(worker_fields(&app, change), Vec::<String>::new());
        }
    }

    #[test]
    fn worker_queues_belong_to_the_app_once() {
        let app = custom_app(vec![CustomQueue::new("a"), CustomQueue::new("b")]);
        let fields = worker_fields(&app, |w| w.queues = vec!["a".into(), "c".into(), "a".into()]);
        assert_eq!(fields, ["queues[1]", "queues[2]"]);
        let err = WorkerConfig { queues: vec!["c".into()], ..WorkerConfig::default() }.validate(&app).unwrap_err();
        assert_eq!(err.problems[0].to_string(), "`queues[0]` is \"c\", expected one of the app's queues: a, b");
        // The default queue is a queue of a default-mode app.
        assert_eq!(worker_fields(&AppConfig::default(), |w| w.queues = vec!["default".into()]), Vec::<String>::new());
    }

    #[test]
    fn worker_priority_overrides_name_served_queues() {
        let app = custom_app(vec![CustomQueue::new("a"), CustomQueue::new("b")]);
        let fields = worker_fields(&app, |w| {
            w.queues = vec!["a".into()];
            w.queue_priorities = BTreeMap::from([("a".into(), 0), ("b".into(), 5), ("x y".into(), 5)]);
        });
        assert_eq!(fields, ["queue_priorities.a", "queue_priorities.b", "queue_priorities.\"x y\""]);
    }

    #[test]
    fn served_queues_sort_by_priority_then_configured_order() {
        let app = custom_app(vec![
            CustomQueue::new("a").with_priority(5),
            CustomQueue::new("b").with_priority(1),
            CustomQueue::new("c").with_priority(5),
            CustomQueue::new("d").with_priority(3).with_max_concurrency(2),
        ]);
        let names = |w: &WorkerConfig| w.served_queues(&app).into_iter().map(|q| q.name).collect::<Vec<_>>();

        let mut worker = WorkerConfig::default();
        assert_eq!(names(&worker), ["b", "d", "a", "c"]);

        // Overrides re-rank; ties keep the configured order.
        worker.queue_priorities = BTreeMap::from([("c".into(), 1), ("b".into(), 9)]);
        assert_eq!(names(&worker), ["c", "d", "a", "b"]);
        let served = worker.served_queues(&app);
        assert_eq!(served[0].priority, 1);
        assert_eq!(served[1].max_concurrency, Some(2));

        // An explicit list is the configured order and the subset.
        worker.queues = vec!["d".into(), "c".into(), "a".into()];
        worker.queue_priorities = BTreeMap::from([("c".into(), 3)]);
        assert_eq!(names(&worker), ["d", "c", "a"]);
        assert_eq!(worker.validate(&app), Ok(()));
    }

    #[test]
    fn effective_max_claim_per_worker_follows_the_cap_mode() {
        let hard = AppConfig::default();
        let soft = AppConfig { prefetch_buffer: 4, claim_lease_ms: Some(60_000), ..AppConfig::default() };
        let mut worker = WorkerConfig { concurrency: 8, ..WorkerConfig::default() };
        assert_eq!(worker.effective_max_claim_per_worker(&hard), 8);
        assert_eq!(worker.effective_max_claim_per_worker(&soft), 12);
        worker.max_claim_per_worker = 3;
        assert_eq!(worker.effective_max_claim_per_worker(&soft), 3);
    }

    #[test]
    fn deployment_modes() {
        use DeploymentMode::*;
        for (mode, name, alias) in [
            (PollingOnly, "PollingOnly", "polling_only"),
            (EventDrivenOnly, "EventDrivenOnly", "event_driven_only"),
            (Hybrid, "Hybrid", "hybrid"),
        ] {
            assert_eq!(serde_json::to_string(&mode).unwrap(), format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<DeploymentMode>(&format!("\"{name}\"")).unwrap(), mode);
            assert_eq!(serde_json::from_str::<DeploymentMode>(&format!("\"{alias}\"")).unwrap(), mode);
            let worker = Config::from_toml_str(&format!("[worker]\ndeployment_mode = \"{alias}\"\n")).unwrap().worker;
            assert_eq!(worker.deployment_mode, mode);
        }
        assert!(serde_json::from_str::<DeploymentMode>("\"polling\"").is_err());
        assert_eq!(DeploymentMode::default(), Hybrid);
        assert_eq!([PollingOnly.listens(), EventDrivenOnly.listens(), Hybrid.listens()], [false, true, true]);
        assert_eq!([PollingOnly.polls(), EventDrivenOnly.polls(), Hybrid.polls()], [true, false, true]);
    }

    // --- several problems at once ----------------------------------------------------------

    #[test]
    fn every_problem_is_reported_together() {
        let mut config = Config::default();
        config.app.cluster_wide_cap = Some(10);
        config.app.prefetch_buffer = 4;
        config.app.claim_lease_ms = Some(60_000);
        config.worker.concurrency = 0;
        let err = config.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: 2 problems: `app.prefetch_buffer` is 4, expected 0 when cluster_wide_cap is set; \
             `worker.concurrency` is 0, expected 1 to 10000"
        );

        let mut config = Config::default();
        config.app.queue_mode = QueueMode::Custom;
        config.app.custom_queues = vec![CustomQueue::new("ok"), CustomQueue::new("Bad").with_priority(0)];
        config.app.recovery.check_interval_ms = 0;
        config.app.resilience.db_retry_max_attempts = 20_000;
        config.app.retry = RetryPolicy::fixed(vec![0]);
        config.worker.queues = vec!["missing".into()];
        config.worker.poll_interval_ms = 0;
        let err = config.validate().unwrap_err();
        assert_eq!(
            err.fields().collect::<Vec<_>>(),
            [
                "app.custom_queues[1].name",
                "app.custom_queues[1].priority",
                "app.resilience.db_retry_max_attempts",
                "app.recovery.check_interval_ms",
                "app.retry.intervals_secs[0]",
                "worker.queues[0]",
                "worker.poll_interval_ms",
            ]
        );
        assert_eq!(
            err.problem("app.custom_queues[1].name").unwrap().to_string(),
            "`app.custom_queues[1].name` is \"Bad\", expected 1 to 52 bytes of a-z, 0-9 and _"
        );
        let load = Config::from_json_str(&serde_json::to_string(&config).unwrap()).unwrap_err();
        assert_eq!(load, LoadError::Invalid(err.clone()));
        assert_eq!(load.to_string(), err.to_string());
    }

    // --- files -----------------------------------------------------------------------------

    #[test]
    fn full_config_round_trips_through_json() {
        let config = full_config();
        let json = serde_json::to_string_pretty(&config).unwrap();
        assert_eq!(Config::from_json_str(&json).unwrap(), config);
        let value: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["worker"]["deployment_mode"], "PollingOnly");
        assert_eq!(value["app"]["retry"]["backoff"], "exponential");
        assert_eq!(value["app"]["queue_mode"], "custom");
        assert_eq!(value["app"]["retry"]["auto_retry_for"], serde_json::json!(["TASK_TIMEOUT", "RATE_LIMITED"]));
    }

    #[test]
    fn full_config_round_trips_through_toml() {
        let config = full_config();
        let toml = to_toml(&serde_json::to_value(&config).unwrap());
        assert!(toml.contains("[[\"app\".\"custom_queues\"]]"), "{toml}");
        assert_eq!(Config::from_toml_str(&toml).unwrap(), config, "{toml}");
        // And a hand-written file reads as expected.
        let written = r#"
            [app]
            queue_mode = "custom"
            prefetch_buffer = 2
            claim_lease_ms = 60000

            [[app.custom_queues]]
            name = "emails"
            max_concurrency = 0

            [app.retry]
            max_retries = 2
            intervals_secs = [10, 20]
            auto_retry_for = ["TASK_ERROR", "HTTP_503"]

            [app.recovery]
            vacuum_dead_rows = 0

            [worker]
            concurrency = 4
            handler_timeout_ms = 0

            [worker.queue_priorities]
            emails = 7
        "#;
        let config = Config::from_toml_str(written).unwrap();
        assert_eq!(config.app.queues(), [CustomQueue::new("emails").with_max_concurrency(0)]);
        assert_eq!(config.app.retry.auto_retry_for, [ErrorCode::TaskError, ErrorCode::User("HTTP_503".into())]);
        assert_eq!(config.worker.handler_timeout_ms, None);
        assert_eq!(config.app.recovery.vacuum_dead_rows, None);
        assert_eq!(config.worker.served_queues(&config.app)[0].priority, 7);
    }

    #[test]
    fn no_handler_timeout_round_trips() {
        let mut config = Config::default();
        config.worker.handler_timeout_ms = None;
        let json = serde_json::to_string(&config).unwrap();
        assert!(json.contains("\"handler_timeout_ms\":0"), "{json}");
        assert_eq!(Config::from_json_str(&json).unwrap(), config);
        let toml = to_toml(&serde_json::to_value(&config).unwrap());
        assert_eq!(Config::from_toml_str(&toml).unwrap(), config);
        let null = r#"{"worker": {"handler_timeout_ms": null}}"#;
        assert_eq!(Config::from_json_str(null).unwrap(), config);
    }

    #[test]
    fn unknown_fields_are_rejected_by_name() {
        let toml_cases = [
            ("[app]\nbogus_top = 1\n", "bogus_top"),
            ("[apps]\nqueue_mode = \"default\"\n", "apps"),
            ("[app.recovery]\nbogus_nested = 1\n", "bogus_nested"),
            ("[app]\nqueue_mode = \"custom\"\n[[app.custom_queues]]\nnmae = \"x\"\n", "nmae"),
            ("[app.retry]\nbackof = \"fixed\"\n", "backof"),
            ("[worker]\nconcurency = 3\n", "concurency"),
        ];
        for (text, name) in toml_cases {
            let err = Config::from_toml_str(text).unwrap_err();
            assert!(matches!(err, LoadError::Toml(_)), "{err:?}");
            let message = err.to_string();
            assert!(message.contains(&format!("unknown field `{name}`")), "{message}");
            assert!(message.starts_with("invalid toml configuration: line "), "{message}");
            assert!(!message.contains('\n'), "{message}");
        }
        assert!(
            AppConfig::from_toml_str("[resilience]\nbogus_app = 1\n").unwrap_err().to_string().contains("bogus_app")
        );

        let json_cases = [
            (r#"{"app": {"bogus_top": 1}}"#, "bogus_top"),
            (r#"{"apps": {}}"#, "apps"),
            (r#"{"app": {"recovery": {"bogus_nested": 1}}}"#, "bogus_nested"),
            (r#"{"app": {"queue_mode": "custom", "custom_queues": [{"nmae": "x"}]}}"#, "nmae"),
            (r#"{"worker": {"concurency": 3}}"#, "concurency"),
        ];
        for (text, name) in json_cases {
            let err = Config::from_json_str(text).unwrap_err();
            assert!(matches!(err, LoadError::Json(_)), "{err:?}");
            let message = err.to_string();
            assert!(message.contains(&format!("unknown field `{name}`")), "{message}");
            assert!(message.starts_with("invalid json configuration: "), "{message}");
        }
    }

    #[test]
    fn milliseconds_are_numbers_or_durations() {
        let text = "[app]\nclaim_lease_ms = \"1m\"\n[app.recovery]\ncheck_interval_ms = \"1m 30s\"\n\
                    running_stale_threshold_ms = 600000\n[worker]\nhandler_timeout_ms = \"0s\"\npoll_interval_ms = \"90s\"\n";
        let config = Config::from_toml_str(text).expect("durations as text");
        assert_eq!(config.app.claim_lease_ms, Some(60_000));
        assert_eq!(config.app.recovery.check_interval_ms, 90_000);
        assert_eq!(config.app.recovery.running_stale_threshold_ms, 600_000);
        assert_eq!(config.worker.handler_timeout_ms, None);
        assert_eq!(config.worker.poll_interval_ms, 90_000);
        let json =
            r#"{"app": {"claim_lease_ms": null}, "worker": {"shutdown_grace_ms": "2s", "handler_timeout_ms": 5000}}"#;
        let config = Config::from_json_str(json).expect("JSON too");
        assert_eq!((config.app.claim_lease_ms, config.worker.shutdown_grace_ms), (None, 2_000));
        assert_eq!(config.worker.handler_timeout_ms, Some(5_000));
        // Written back as numbers, and read back the same.
        assert_eq!(Config::from_json_str(&serde_json::to_string(&config).unwrap()).unwrap(), config);
        for bad in [
            "[worker]\npoll_interval_ms = -5\n",
            "[worker]\npoll_interval_ms = \"1.5s\"\n",
            "[worker]\npoll_interval_ms = 1.5\n",
        ] {
            assert!(matches!(Config::from_toml_str(bad), Err(LoadError::Toml(_))), "{bad}");
        }
    }

    #[test]
    fn every_problem_of_a_file_is_reported_together() {
        // Two values of the wrong type, an unknown key, and a rule the rest breaks.
        let text = "[worker]\nconcurrency = \"x\"\npoll_interval_ms = 5\nconcurency = 3\n[app]\nprefetch_buffer = -1\n\
                    [app.recovery]\ncheck_interval_ms = \"soon\"\n";
        let message = Config::from_toml_str(text).unwrap_err().to_string();
        assert!(message.starts_with("invalid toml configuration: line "), "{message}");
        for part in [
            "`worker.concurrency`: invalid type: string \"x\", expected u32",
            "unknown field `concurency`",
            "integer `-1`, expected u32",
            "`app.recovery.check_interval_ms`: invalid duration \"soon\"",
            "`worker.poll_interval_ms` is 5, expected 1000 to 300000",
        ] {
            assert!(message.contains(part), "{part:?} not in {message}");
        }
        assert_eq!(message.matches("expected u32").count(), 2, "each problem once: {message}");
        assert!(!message.contains("`worker.concurrency` is"), "a mistyped field is not checked again: {message}");
        let json = r#"{"worker": {"concurrency": "x", "poll_interval_ms": 5}}"#;
        let message = Config::from_json_str(json).unwrap_err().to_string();
        assert!(message.contains("expected u32") && message.contains("`worker.poll_interval_ms` is 5"), "{message}");
    }

    #[test]
    fn bad_values_are_load_errors_not_panics() {
        for text in
            ["[app]\nqueue_mode = \"other\"\n", "[worker]\nconcurrency = -1\n", "[app\n", "[worker]\nseed = \"x\"\n"]
        {
            assert!(matches!(Config::from_toml_str(text), Err(LoadError::Toml(_))), "{text}");
        }
        for text in [r#"{"worker": {"concurrency": 1e3}}"#, "[", r#"{"app": {"retry": {"auto_retry_for": [""]}}}"#] {
            assert!(matches!(Config::from_json_str(text), Err(LoadError::Json(_))), "{text}");
        }
        assert!(matches!(Config::from_toml_str("[app]\nqueue_mode = \"CUSTOM\"\n"), Err(LoadError::Invalid(_))));
        assert_eq!(line_column("ab\ncé\nd", 6), (2, 3));
        assert_eq!(line_column("é", 1), (1, 1));
        assert_eq!(line_column("", 10), (1, 1));
    }

    #[test]
    fn app_alone_loads_with_unprefixed_fields() {
        let err = AppConfig::from_toml_str("cluster_wide_cap = 0\n").unwrap_err();
        let LoadError::Invalid(err) = err else { panic!("{err:?}") };
        assert_eq!(err.fields().collect::<Vec<_>>(), ["cluster_wide_cap"]);
        let app = AppConfig::from_json_str(r#"{"queue_mode": "custom", "custom_queues": [{"name": "a"}]}"#).unwrap();
        assert_eq!(app.queues(), [CustomQueue::new("a")]);
        // A queue without a name is caught, not silently named.
        let err = AppConfig::from_json_str(r#"{"queue_mode": "custom", "custom_queues": [{}]}"#).unwrap_err();
        assert!(err.to_string().contains("`custom_queues[0].name` is \"\""), "{err}");
    }

    #[cfg(feature = "driver")]
    #[test]
    fn from_path_reads_toml_and_json_by_extension() {
        use crate::driver::read_config;
        let dir = std::env::temp_dir().join(format!("canter-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = full_config();

        let toml_path = dir.join("canter.TOML");
        std::fs::write(&toml_path, to_toml(&serde_json::to_value(&config).unwrap())).unwrap();
        assert_eq!(read_config(&toml_path).unwrap(), config);

        let json_path = dir.join("canter.json");
        std::fs::write(&json_path, serde_json::to_string(&config).unwrap()).unwrap();
        assert_eq!(read_config(&json_path).unwrap(), config);

        let bad_path = dir.join("bad.toml");
        std::fs::write(&bad_path, "[worker]\nbogus = 1\n").unwrap();
        let message = read_config(&bad_path).unwrap_err().to_string();
        assert!(message.contains("bad.toml: line 2, column 1: unknown field `bogus`"), "{message}");

        let missing = dir.join("missing.json");
        let err = read_config(&missing).unwrap_err();
        assert!(matches!(&err, LoadError::Io { path, .. } if *path == missing), "{err:?}");
        assert!(err.to_string().starts_with("cannot read configuration file "), "{err}");

        let yaml = dir.join("canter.yaml");
        assert_eq!(read_config(&yaml), Err(LoadError::UnknownFormat(yaml.clone())));
        assert_eq!(read_config(&dir.join("canter")), Err(LoadError::UnknownFormat(dir.join("canter"))));

        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn queue_mode_names() {
        assert_eq!(serde_json::to_string(&QueueMode::Custom).unwrap(), "\"custom\"");
        assert_eq!(serde_json::from_str::<QueueMode>("\"DEFAULT\"").unwrap(), QueueMode::Default);
        assert_eq!(serde_json::to_string(&BackoffStrategy::Exponential).unwrap(), "\"exponential\"");
    }

    #[test]
    fn the_readme_configuration_example_is_valid() {
        let readme = include_str!("../README.md");
        let start = readme.find("```toml\n[app]").expect("the README has a configuration example") + "```toml\n".len();
        let end = start + readme[start..].find("```").expect("the example ends");
        let config = Config::from_toml_str(&readme[start..end]).expect("the README's example is valid");
        assert!(config.app.custom_queues.iter().any(|q| q.serial));
        assert_eq!(config.worker.forbidden_flags, vec!["gpu".to_owned()]);
    }
}
