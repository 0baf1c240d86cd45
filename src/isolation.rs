//! Isolated execution, as data: what a worker and the child processes that run its isolated
//! tasks say to each other over pipes, how the bytes are framed, and what a child's failure
//! costs the task it held.
//!
//! A frame is a 4-byte big-endian length and that many bytes of JSON. The worker sends a child
//! one [`ToChild::Run`] at a time and reads back one [`FromChild::Done`] for it; a child says
//! [`FromChild::Ready`] once it has started. Anything else from a child (a frame too long,
//! bytes that are not a message, a message out of turn, the pipe closed mid-task) ends that
//! child, and the task it held fails with [`ErrorCode::WorkerChildCrashed`] as when it dies:
//! [`child_failure`] says how. The frames are read by [`FrameReader`], which takes bytes as they
//! come and never panics on any.

use serde::{Deserialize, Serialize};

use crate::store::DbTime;
use crate::task::{Attempt, ErrorCode, TaskError, TaskId};
use crate::worker::TaskOutcome;

/// The most bytes one frame may carry (a task's arguments or result included): larger ones end
/// the child that sent them.
pub const MAX_FRAME_BYTES: usize = 256 * 1024 * 1024;

/// The environment variable that starts a program in child mode: its value is the socket the
/// child connects to. A child's own subprocesses inherit it (a child cannot make a pool).
pub const CHILD_ENV: &str = "CANTER_ISOLATED_CHILD";

/// The environment variable that gives a child its memory limit in bytes (its address space,
/// `RLIMIT_AS`), when the pool has one.
pub const CHILD_MEMORY_ENV: &str = "CANTER_ISOLATED_CHILD_MEMORY";

/// What a worker tells a child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToChild {
    /// Run this task and answer with [`FromChild::Done`].
    Run {
        /// The task.
        task: TaskId,
        /// Which run this is.
        attempt: Attempt,
        /// The handler's registered name.
        name: String,
        /// The queue.
        queue: String,
        /// Its priority.
        priority: i16,
        /// When it was enqueued, on the database's clock.
        enqueued_at: DbTime,
        /// When it became claimable, on the database's clock.
        run_at: DbTime,
        /// The arguments.
        args: serde_json::Value,
    },
}

/// What a child tells its worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromChild {
    /// Started and waiting for a task.
    Ready {
        /// Its process id.
        pid: u32,
    },
    /// The task it was given ended.
    Done {
        /// The task.
        task: TaskId,
        /// How it ended.
        outcome: ChildOutcome,
    },
}

/// A task's outcome on the wire ([`TaskOutcome`]'s shape).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ChildOutcome {
    /// A result.
    Success {
        /// The result.
        result: serde_json::Value,
    },
    /// An error.
    Failure {
        /// The error.
        error: TaskError,
    },
    /// Some items of a batch failed.
    PartialFailure {
        /// The error to record.
        error: TaskError,
        /// The failed items.
        remaining: serde_json::Value,
    },
}

impl From<TaskOutcome> for ChildOutcome {
    fn from(outcome: TaskOutcome) -> Self {
        match outcome {
            TaskOutcome::Success(result) => ChildOutcome::Success { result },
            TaskOutcome::Failure(error) => ChildOutcome::Failure { error },
            TaskOutcome::PartialFailure { error, remaining } => ChildOutcome::PartialFailure { error, remaining },
        }
    }
}

impl From<ChildOutcome> for TaskOutcome {
    fn from(outcome: ChildOutcome) -> Self {
        match outcome {
            ChildOutcome::Success { result } => TaskOutcome::Success(result),
            ChildOutcome::Failure { error } => TaskOutcome::Failure(error),
            ChildOutcome::PartialFailure { error, remaining } => TaskOutcome::PartialFailure { error, remaining },
        }
    }
}

/// A frame: `message`'s JSON after its length.
pub fn encode_frame<M: Serialize>(message: &M) -> Vec<u8> {
    let json = serde_json::to_vec(message).expect("a message always serializes");
    let mut frame = Vec::with_capacity(4 + json.len());
    frame.extend_from_slice(&(json.len() as u32).to_be_bytes());
    frame.extend_from_slice(&json);
    frame
}

/// Bytes that are no frame of a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A length over [`MAX_FRAME_BYTES`].
    #[error("a frame of {0} bytes, expected at most {MAX_FRAME_BYTES}")]
    TooLong(usize),
    /// A frame whose bytes are not a message.
    #[error("a frame that is not a message ({0})")]
    Malformed(String),
}

/// Reads frames out of bytes as they arrive, however they are split.
#[derive(Debug, Default)]
pub struct FrameReader {
    buffer: Vec<u8>,
}

impl FrameReader {
    /// A reader with nothing read yet.
    pub fn new() -> Self {
        FrameReader::default()
    }

    /// Takes bytes that arrived.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Whether bytes of an unfinished frame are waiting.
    pub fn is_mid_frame(&self) -> bool {
        !self.buffer.is_empty()
    }

    /// The next whole message, if one arrived. After an error the stream is broken: drop the
    /// reader (and end the child).
    pub fn next_message<M: for<'de> Deserialize<'de>>(&mut self) -> Option<Result<M, FrameError>> {
        let header: [u8; 4] = self.buffer.get(..4)?.try_into().expect("four bytes");
        let len = u32::from_be_bytes(header) as usize;
        if len > MAX_FRAME_BYTES {
            return Some(Err(FrameError::TooLong(len)));
        }
        let body = self.buffer.get(4..4 + len)?;
        let message = serde_json::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()));
        self.buffer.drain(..4 + len);
        Some(message)
    }
}

/// How a child ended or broke while it held a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildFailure {
    /// It exited with this status code.
    Exited(i32),
    /// A signal killed it (11: SIGSEGV, 6: SIGABRT, 9: SIGKILL, the OOM killer's too).
    Signalled(i32),
    /// It closed its end of the pipe and is gone.
    Closed,
    /// It wrote something that is not a message in turn (it was killed for it).
    Garbled(String),
}

/// What a child's failure costs the task it held: the task fails with
/// [`ErrorCode::WorkerChildCrashed`] (retried as its policy says), the message saying how.
pub fn child_failure(task: TaskId, failure: &ChildFailure) -> TaskError {
    let how = match failure {
        ChildFailure::Exited(code) => format!("exited with status {code}"),
        ChildFailure::Signalled(signal) => format!("was killed by signal {signal}{}", signal_name(*signal)),
        ChildFailure::Closed => "closed its pipe".to_owned(),
        ChildFailure::Garbled(what) => format!("wrote {what}, and was killed"),
    };
    TaskError::new(ErrorCode::WorkerChildCrashed, format!("the child process running task {task} {how}"))
}

/// The usual name of a signal, for messages.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        4 => " (SIGILL)",
        6 => " (SIGABRT: an abort, a failed allocation or a stack overflow)",
        7 => " (SIGBUS)",
        8 => " (SIGFPE)",
        9 => " (SIGKILL: killed, by the kernel's OOM killer or an operator)",
        11 => " (SIGSEGV)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> ToChild {
        ToChild::Run {
            task: TaskId(7),
            attempt: Attempt(2),
            name: "resize".into(),
            queue: "images".into(),
            priority: -1,
            enqueued_at: DbTime(1),
            run_at: DbTime(2),
            args: serde_json::json!({"w": 640}),
        }
    }

    #[test]
    fn frames_round_trip_however_the_bytes_are_split() {
        let messages = [
            FromChild::Ready { pid: 42 },
            FromChild::Done { task: TaskId(7), outcome: ChildOutcome::Success { result: serde_json::json!([1, 2]) } },
            FromChild::Done {
                task: TaskId(8),
                outcome: ChildOutcome::Failure { error: TaskError::new(ErrorCode::TaskError, "no") },
            },
        ];
        let bytes: Vec<u8> = messages.iter().flat_map(encode_frame).collect();
        for chunk in [1, 3, 7, bytes.len()] {
            let mut reader = FrameReader::new();
            let mut read = Vec::new();
            for piece in bytes.chunks(chunk) {
                reader.push(piece);
                while let Some(message) = reader.next_message::<FromChild>() {
                    read.push(message.unwrap());
                }
            }
            assert_eq!(read, messages);
            assert!(!reader.is_mid_frame());
        }
        let mut reader = FrameReader::new();
        reader.push(&encode_frame(&run()));
        assert_eq!(reader.next_message::<ToChild>(), Some(Ok(run())));
    }

    #[test]
    fn garbage_and_huge_lengths_are_errors_not_panics() {
        let mut reader = FrameReader::new();
        reader.push(&[0, 0, 0, 3, b'x', b'y', b'z']);
        assert!(matches!(reader.next_message::<FromChild>(), Some(Err(FrameError::Malformed(_)))));
        let mut reader = FrameReader::new();
        reader.push(&[0xff, 0xff, 0xff, 0xff]);
        assert_eq!(reader.next_message::<FromChild>(), Some(Err(FrameError::TooLong(u32::MAX as usize))));
        let mut reader = FrameReader::new();
        reader.push(&[0, 0]);
        assert_eq!(reader.next_message::<FromChild>(), None, "half a header waits");
        assert!(reader.is_mid_frame());
    }

    #[test]
    fn outcomes_cross_the_pipe_unchanged() {
        let outcomes = [
            TaskOutcome::Success(serde_json::json!({"a": 1})),
            TaskOutcome::Failure(TaskError::new(ErrorCode::User("BAD_IMAGE".into()), "bad")),
            TaskOutcome::PartialFailure {
                error: TaskError::new(ErrorCode::TaskError, "1 of 2"),
                remaining: serde_json::json!([2]),
            },
        ];
        for outcome in outcomes {
            let wire = ChildOutcome::from(outcome.clone());
            let mut reader = FrameReader::new();
            reader.push(&encode_frame(&FromChild::Done { task: TaskId(1), outcome: wire }));
            let Some(Ok(FromChild::Done { outcome: back, .. })) = reader.next_message::<FromChild>() else { panic!() };
            assert_eq!(TaskOutcome::from(back), outcome);
        }
    }

    #[test]
    fn a_child_failure_fails_its_task_with_its_own_code() {
        let error = child_failure(TaskId(3), &ChildFailure::Signalled(11));
        assert_eq!(error.code, ErrorCode::WorkerChildCrashed);
        assert_eq!(error.code.as_str(), "WORKER_CHILD_CRASHED");
        assert!(error.message.contains("task 3") && error.message.contains("SIGSEGV"), "{}", error.message);
        let error = child_failure(TaskId(3), &ChildFailure::Garbled("a frame that is not a message".into()));
        assert!(error.message.contains("killed"), "{}", error.message);
    }
}
