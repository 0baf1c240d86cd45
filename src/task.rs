//! Tasks: their states, the transitions between them, ids, lease tokens and error codes.
//!
//! The state machine here is the one every store follows (reference/seeds.md §1.2). A store
//! asks [`transition`] before it moves a row, so the memory store, the SQL and the simulation
//! agree on what is allowed.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A task's id, assigned by the store at enqueue (a PostgreSQL `bigint` identity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TaskId(pub i64);

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The claim generation of a task: bumped by every claim, carried by every write the claimer
/// makes about the task. A write naming an older lease changes nothing (fencing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Lease(pub i64);

impl fmt::Display for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How many times a task has been started (1 for its first run). Never decreases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Attempt(pub u32);

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A task together with the lease its holder claimed it under: the fencing token of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskLease {
    /// The task.
    pub task: TaskId,
    /// The claim generation the writer holds.
    pub lease: Lease,
}

/// The identity of a worker process, unique across the cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub String);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The states of a task. The last five are terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TaskState {
    /// A workflow step whose parents have not decided it yet: no claim takes it until it is
    /// promoted to Pending (or skipped).
    Waiting,
    /// Waiting to be claimed (possibly not before its run-at time).
    Pending,
    /// Claimed by a worker under a lease, not started yet (a prefetched task).
    Claimed,
    /// Its handler is running on the worker that holds it.
    Running,
    /// Finished with a result.
    Completed,
    /// Finished with an error and no retry left.
    Failed,
    /// Cancelled before it ran.
    Cancelled,
    /// Its good-until time passed before it ran.
    Expired,
    /// A workflow step that never runs: its parents' outcomes can no longer satisfy its join.
    Skipped,
}

impl TaskState {
    /// Every state, in declaration order.
    pub const ALL: [TaskState; 9] = [
        TaskState::Waiting,
        TaskState::Pending,
        TaskState::Claimed,
        TaskState::Running,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Cancelled,
        TaskState::Expired,
        TaskState::Skipped,
    ];

    /// Whether no transition leaves this state.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Cancelled | TaskState::Expired | TaskState::Skipped
        )
    }

    /// The stable upper-case name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Waiting => "WAITING",
            TaskState::Pending => "PENDING",
            TaskState::Claimed => "CLAIMED",
            TaskState::Running => "RUNNING",
            TaskState::Completed => "COMPLETED",
            TaskState::Failed => "FAILED",
            TaskState::Cancelled => "CANCELLED",
            TaskState::Expired => "EXPIRED",
            TaskState::Skipped => "SKIPPED",
        }
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name that is not one of [`TaskState`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown task state {0:?}: expected one of WAITING, PENDING, CLAIMED, RUNNING, COMPLETED, FAILED, CANCELLED, \
     EXPIRED, SKIPPED"
)]
pub struct UnknownState(pub String);

impl FromStr for TaskState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskState::ALL
            .into_iter()
            .find(|state| state.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

/// What happens to a task. Each event is legal from some states only; see [`transition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskEvent {
    /// A worker claims it: from Pending, or from Claimed whose lease expired.
    Claim,
    /// A worker claims it and starts it in the same statement (hard-cap mode, free permits).
    ClaimAndStart,
    /// Its holder starts it: Claimed to Running.
    Start,
    /// It goes back to Pending without spending a retry: a buffered claim handed back, a stale
    /// claim requeued by the reaper, or a run cut off by shutdown.
    Release,
    /// Its handler returned a result.
    Complete,
    /// It failed and will run again later (spends one retry).
    Retry,
    /// It failed for good: a handler error with no retry left, an unknown task name while
    /// claimed, or a crashed worker with no retry left.
    Fail,
    /// Its good-until time passed before it ran.
    Expire,
    /// Someone cancelled it before it ran.
    Cancel,
    /// An operator put a failed task back to Pending.
    Requeue,
    /// An operator completed it by hand before or while it ran.
    CompleteByHand,
    /// An operator failed it by hand before or while it ran (no retry).
    FailByHand,
    /// A waiting workflow step's join is satisfied: it becomes claimable.
    Promote,
    /// A waiting workflow step's join can no longer be satisfied: it never runs.
    Skip,
    /// Its workflow was cancelled while it ran: it is Cancelled, and its worker, whose lease
    /// is gone, aborts the handler.
    Abort,
    /// Its workflow's retry puts the finished step back to Waiting: its parents decide it
    /// again.
    Reset,
}

impl TaskEvent {
    /// Every event, in declaration order.
    pub const ALL: [TaskEvent; 16] = [
        TaskEvent::Claim,
        TaskEvent::ClaimAndStart,
        TaskEvent::Start,
        TaskEvent::Release,
        TaskEvent::Complete,
        TaskEvent::Retry,
        TaskEvent::Fail,
        TaskEvent::Expire,
        TaskEvent::Cancel,
        TaskEvent::Requeue,
        TaskEvent::CompleteByHand,
        TaskEvent::FailByHand,
        TaskEvent::Promote,
        TaskEvent::Skip,
        TaskEvent::Abort,
        TaskEvent::Reset,
    ];
}

/// An event that is not allowed in the state the task is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("task event {event:?} is not allowed in state {from}: {expected}")]
pub struct TransitionError {
    /// The state the task was in.
    pub from: TaskState,
    /// The event that was refused.
    pub event: TaskEvent,
    /// Where the event is allowed, for the message.
    pub expected: &'static str,
}

/// The state a task moves to when `event` happens in state `from`, or why it cannot.
///
/// Conditions that need the row (lease expiry, owner, good-until) are the store's to check;
/// this function says which moves exist at all.
pub fn transition(from: TaskState, event: TaskEvent) -> Result<TaskState, TransitionError> {
    use TaskEvent as E;
    use TaskState as S;
    let (to, expected) = match event {
        E::Claim => (
            matches!(from, S::Pending | S::Claimed).then_some(S::Claimed),
            "expected PENDING or CLAIMED with an expired lease",
        ),
        E::ClaimAndStart => (
            matches!(from, S::Pending | S::Claimed).then_some(S::Running),
            "expected PENDING or CLAIMED with an expired lease",
        ),
        E::Start => ((from == S::Claimed).then_some(S::Running), "expected CLAIMED"),
        E::Release => (matches!(from, S::Claimed | S::Running).then_some(S::Pending), "expected CLAIMED or RUNNING"),
        E::Complete => ((from == S::Running).then_some(S::Completed), "expected RUNNING"),
        E::Retry => ((from == S::Running).then_some(S::Pending), "expected RUNNING"),
        E::Fail => (matches!(from, S::Claimed | S::Running).then_some(S::Failed), "expected CLAIMED or RUNNING"),
        E::Expire => (matches!(from, S::Pending | S::Claimed).then_some(S::Expired), "expected PENDING or CLAIMED"),
        E::Cancel => (
            matches!(from, S::Waiting | S::Pending | S::Claimed).then_some(S::Cancelled),
            "expected WAITING, PENDING or CLAIMED",
        ),
        E::Requeue => ((from == S::Failed).then_some(S::Pending), "expected FAILED"),
        E::CompleteByHand => (
            matches!(from, S::Pending | S::Claimed | S::Running).then_some(S::Completed),
            "expected PENDING, CLAIMED or RUNNING",
        ),
        E::FailByHand => (
            matches!(from, S::Pending | S::Claimed | S::Running).then_some(S::Failed),
            "expected PENDING, CLAIMED or RUNNING",
        ),
        E::Promote => ((from == S::Waiting).then_some(S::Pending), "expected WAITING"),
        E::Skip => ((from == S::Waiting).then_some(S::Skipped), "expected WAITING"),
        E::Abort => ((from == S::Running).then_some(S::Cancelled), "expected RUNNING"),
        E::Reset => (from.is_terminal().then_some(S::Waiting), "expected a terminal state"),
    };
    to.ok_or(TransitionError { from, event, expected })
}

/// Why a task failed: a built-in code, or one the user's handler chose.
///
/// Serialized as a plain string: built-ins by their stable UPPER_SNAKE names, user codes as
/// given. A user code spelled like a built-in reads back as the built-in.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorCode {
    /// The handler panicked.
    UnhandledError,
    /// The handler returned an error without a code of its own.
    TaskError,
    /// The handler ran past its timeout.
    TaskTimeout,
    /// The worker holding the task stopped sending heartbeats.
    WorkerCrashed,
    /// No handler is registered under the task's name.
    WorkerResolutionError,
    /// The task's arguments did not decode into the handler's argument type.
    WorkerSerializationError,
    /// The stored result did not decode into the caller's result type.
    ResultDeserializationError,
    /// The task's good-until time passed before it ran.
    TaskExpired,
    /// The task was cancelled.
    TaskCancelled,
    /// An enqueue reused an idempotency key with different arguments.
    PayloadMismatch,
    /// Waiting for a result timed out; the task may still run.
    WaitTimeout,
    /// No task has the id asked about.
    TaskNotFound,
    /// The database failed while serving the request.
    BrokerError,
    /// The worker lost the task's lease before it could write its outcome.
    ClaimLost,
    /// An operator failed the task by hand.
    FailedByOperator,
    /// A workflow step never ran: its parents' outcomes could not satisfy its join.
    StepSkipped,
    /// The child process running an isolated task died or broke its pipe (a crash, a signal,
    /// the OOM killer, garbage on the pipe).
    WorkerChildCrashed,
    /// A code chosen by user code.
    User(String),
}

/// A user error code that is empty, too long, or not UPPER_SNAKE.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid error code {0:?}: expected 1 to 64 characters of A-Z, 0-9 and _, starting with a letter")]
pub struct InvalidErrorCode(pub String);

impl ErrorCode {
    const BUILTIN: [(ErrorCode, &'static str); 17] = [
        (ErrorCode::UnhandledError, "UNHANDLED_ERROR"),
        (ErrorCode::TaskError, "TASK_ERROR"),
        (ErrorCode::TaskTimeout, "TASK_TIMEOUT"),
        (ErrorCode::WorkerCrashed, "WORKER_CRASHED"),
        (ErrorCode::WorkerResolutionError, "WORKER_RESOLUTION_ERROR"),
        (ErrorCode::WorkerSerializationError, "WORKER_SERIALIZATION_ERROR"),
        (ErrorCode::ResultDeserializationError, "RESULT_DESERIALIZATION_ERROR"),
        (ErrorCode::TaskExpired, "TASK_EXPIRED"),
        (ErrorCode::TaskCancelled, "TASK_CANCELLED"),
        (ErrorCode::PayloadMismatch, "PAYLOAD_MISMATCH"),
        (ErrorCode::WaitTimeout, "WAIT_TIMEOUT"),
        (ErrorCode::TaskNotFound, "TASK_NOT_FOUND"),
        (ErrorCode::BrokerError, "BROKER_ERROR"),
        (ErrorCode::ClaimLost, "CLAIM_LOST"),
        (ErrorCode::FailedByOperator, "FAILED_BY_OPERATOR"),
        (ErrorCode::StepSkipped, "STEP_SKIPPED"),
        (ErrorCode::WorkerChildCrashed, "WORKER_CHILD_CRASHED"),
    ];

    /// Every built-in code.
    pub fn builtins() -> impl Iterator<Item = ErrorCode> {
        Self::BUILTIN.into_iter().map(|(code, _)| code)
    }

    /// A code for user code to fail with: UPPER_SNAKE, 1 to 64 characters.
    pub fn user(code: &str) -> Result<ErrorCode, InvalidErrorCode> {
        let valid = !code.is_empty()
            && code.len() <= 64
            && code.starts_with(|c: char| c.is_ascii_uppercase())
            && code.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(InvalidErrorCode(code.to_owned()));
        }
        Ok(Self::parse(code))
    }

    /// Reads a stored code: a built-in name gives the built-in, anything else a user code.
    pub fn parse(code: &str) -> ErrorCode {
        Self::BUILTIN
            .iter()
            .find(|(_, name)| *name == code)
            .map(|(builtin, _)| builtin.clone())
            .unwrap_or_else(|| ErrorCode::User(code.to_owned()))
    }

    /// The stable string form.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorCode::User(code) => code,
            builtin => Self::BUILTIN
                .iter()
                .find(|(code, _)| code == builtin)
                .map(|(_, name)| *name)
                .expect("every built-in code has a name in BUILTIN"),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let code = String::deserialize(deserializer)?;
        if code.is_empty() {
            return Err(serde::de::Error::custom("empty error code: expected a non-empty UPPER_SNAKE string"));
        }
        Ok(ErrorCode::parse(&code))
    }
}

/// How a task failed: a code, a human message, and optional structured details.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskError {
    /// The code retry policies match against.
    pub code: ErrorCode,
    /// A message for people.
    pub message: String,
    /// Structured details, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

impl TaskError {
    /// An error with a code and a message and no data.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        TaskError { code, message: message.into(), data: None }
    }

    /// The same error carrying structured details.
    pub fn with_data(mut self, data: serde_json::Value) -> Self {
        self.data = Some(data);
        self
    }
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for TaskError {}

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

/// Flags as stored: sorted, each once.
pub fn normalized_flags(flags: &[String]) -> Vec<String> {
    let mut flags = flags.to_vec();
    flags.sort();
    flags.dedup();
    flags
}

/// Whether `flag` is a valid task flag: 1 to 64 bytes of `a-z`, `0-9`, `_`, `-`, `.`, `:`.
pub fn is_valid_flag(flag: &str) -> bool {
    !flag.is_empty()
        && flag.len() <= 64
        && flag.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.:".contains(&b))
}

/// The longest queue name in bytes. A queue's NOTIFY channel is its name behind an 11-byte
/// prefix, and PostgreSQL truncates channel names past 63 bytes.
pub const MAX_QUEUE_NAME_LEN: usize = 52;

/// Whether `name` is a valid queue name: 1 to [`MAX_QUEUE_NAME_LEN`] bytes of `a-z`, `0-9`
/// and `_`.
pub fn is_valid_queue_name(name: &str) -> bool {
    (1..=MAX_QUEUE_NAME_LEN).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// What a queue name may be, as every error about one says it ([`is_valid_queue_name`]).
pub const QUEUE_NAME_RULE: &str = "1 to 52 bytes of a-z, 0-9 and _";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_way_out_but_requeue_of_failed_and_a_workflow_s_reset() {
        for from in TaskState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for event in TaskEvent::ALL {
                let allowed = transition(from, event).ok();
                let expected = match event {
                    TaskEvent::Requeue => (from == TaskState::Failed).then_some(TaskState::Pending),
                    TaskEvent::Reset => Some(TaskState::Waiting),
                    _ => None,
                };
                assert_eq!(allowed, expected, "{from} {event:?}");
            }
        }
        // Only a finished task is reset, and only a running one aborted.
        for from in TaskState::ALL.into_iter().filter(|s| !s.is_terminal()) {
            assert!(transition(from, TaskEvent::Reset).is_err());
            assert_eq!(transition(from, TaskEvent::Abort).is_ok(), from == TaskState::Running, "{from}");
        }
    }

    #[test]
    fn the_lifecycle_of_a_retried_task() {
        let mut state = TaskState::Pending;
        for event in
            [TaskEvent::Claim, TaskEvent::Start, TaskEvent::Retry, TaskEvent::ClaimAndStart, TaskEvent::Complete]
        {
            state = transition(state, event).unwrap();
        }
        assert_eq!(state, TaskState::Completed);
    }

    #[test]
    fn a_waiting_step_is_promoted_skipped_or_cancelled_and_nothing_else() {
        let allowed: Vec<(TaskEvent, TaskState)> = TaskEvent::ALL
            .into_iter()
            .filter_map(|event| transition(TaskState::Waiting, event).ok().map(|to| (event, to)))
            .collect();
        assert_eq!(
            allowed,
            [
                (TaskEvent::Cancel, TaskState::Cancelled),
                (TaskEvent::Promote, TaskState::Pending),
                (TaskEvent::Skip, TaskState::Skipped)
            ]
        );
        // Only a waiting step is promoted or skipped.
        for from in TaskState::ALL.into_iter().filter(|s| *s != TaskState::Waiting) {
            assert!(transition(from, TaskEvent::Promote).is_err() && transition(from, TaskEvent::Skip).is_err());
        }
    }

    #[test]
    fn refused_events_say_what_was_expected() {
        let err = transition(TaskState::Pending, TaskEvent::Complete).unwrap_err();
        assert_eq!(err.to_string(), "task event Complete is not allowed in state PENDING: expected RUNNING");
    }

    #[test]
    fn state_names_round_trip() {
        for state in TaskState::ALL {
            assert_eq!(state.as_str().parse::<TaskState>().unwrap(), state);
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(json, format!("\"{}\"", state.as_str()));
            assert_eq!(serde_json::from_str::<TaskState>(&json).unwrap(), state);
        }
        assert!("WAIT".parse::<TaskState>().is_err());
    }

    #[test]
    fn error_codes_round_trip_as_stable_strings() {
        for code in ErrorCode::builtins().chain([ErrorCode::User("RATE_LIMITED".into())]) {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
        assert_eq!(serde_json::to_string(&ErrorCode::WorkerCrashed).unwrap(), "\"WORKER_CRASHED\"");
        assert_eq!(ErrorCode::user("TASK_TIMEOUT").unwrap(), ErrorCode::TaskTimeout);
        assert!(ErrorCode::user("lower").is_err());
        assert!(ErrorCode::user("").is_err());
        assert!(serde_json::from_str::<ErrorCode>("\"\"").is_err());
    }

    #[test]
    fn task_errors_round_trip() {
        let error = TaskError::new(ErrorCode::User("HTTP_503".into()), "upstream down")
            .with_data(serde_json::json!({"retry_after": 3}));
        let json = serde_json::to_string(&error).unwrap();
        assert_eq!(json, r#"{"code":"HTTP_503","message":"upstream down","data":{"retry_after":3}}"#);
        assert_eq!(serde_json::from_str::<TaskError>(&json).unwrap(), error);
    }
}
