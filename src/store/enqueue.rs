//! The enqueue vocabulary: a new task ([`NewTask`]), when it runs ([`RunAt`]), what its key
//! does ([`KeyMode`]), and the checks every store applies before it writes
//! ([`check_new_task`], [`BatchKeys`], [`EnqueueError`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::{AppConfig, RetryPolicy};
use crate::store::values::{UnstorableValue, check_storable};
use crate::task::{DbTime, ErrorCode, TaskId, is_valid_flag};
use crate::task::{QUEUE_NAME_RULE, is_valid_queue_name};

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
#[non_exhaustive]
pub enum EnqueueError {
    /// The task name is empty or too long.
    #[error("invalid task name {0:?}: expected 1 to 128 bytes")]
    InvalidTaskName(String),
    /// The queue name has characters or a length queues cannot have.
    #[error("invalid queue name {0:?}: expected {QUEUE_NAME_RULE}")]
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
    #[error(
        "run_at {} is not before good_until {}: the task could never run",
        crate::time::format_instant_ms(*.run_at),
        crate::time::format_instant_ms(*.good_until)
    )]
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

/// Whether `key` can be an idempotency key: 1 to 256 bytes.
pub fn is_valid_key(key: &str) -> bool {
    (1..=256).contains(&key.len())
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
    if let Some(key) = task.key.as_ref().filter(|key| !is_valid_key(key)) {
        return Err(EnqueueError::InvalidKey(key.clone()));
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::values::MAX_JSON_DEPTH;
    use crate::store::values::tests::nested;

    #[test]
    fn enqueue_refuses_args_that_could_not_be_read_back() {
        let app = AppConfig::default();
        let deep = NewTask::new("t", nested(MAX_JSON_DEPTH + 1));
        assert!(matches!(check_new_task(&app, &deep, DbTime(0)), Err(EnqueueError::InvalidArgs(_))));
        let nul = NewTask::new("t", json!("\u{0}"));
        assert!(matches!(check_new_task(&app, &nul, DbTime(0)), Err(EnqueueError::InvalidArgs(_))));
    }
}
