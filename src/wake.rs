//! Wake-ups carried by a provider other than PostgreSQL's LISTEN/NOTIFY (a message broker), as
//! data: what a publisher sends after its enqueue committed, the bytes on the wire, and what a
//! worker's machine makes of them ([`Input::Notified`]).
//!
//! A wake-up is a hint, never the truth: the claim in the store decides what runs. A lost one
//! leaves work for the next wake-up or poll of its queue, a duplicated or late one costs an
//! empty claim pass at most (coalesced by the machine), so a provider may lose, repeat, delay
//! and reorder them.
//!
//! A worker that hears from several sources at once (a broker for enqueues and PostgreSQL for
//! what statements make ready) reports one listening state to its machine: [`WakeSources`].

use serde::{Deserialize, Serialize};

use crate::task::TaskId;
use crate::worker::Input;

/// How many task ids one wake-up names at most: a wake-up of a bulk enqueue names its first
/// tasks only (the ids are a hint; the claim takes tasks in its own order).
pub const MAX_TASKS_PER_WAKEUP: usize = 256;

/// How many bytes an encoded wake-up may have: a queue name, a priority and
/// [`MAX_TASKS_PER_WAKEUP`] ids fit with room to spare.
pub const MAX_WAKEUP_BYTES: usize = 8 * 1024;

/// Tasks became claimable in `queue`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wakeup {
    /// The queue.
    pub queue: String,
    /// The most urgent priority among the tasks (lower runs first), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i16>,
    /// Some of the tasks (at most [`MAX_TASKS_PER_WAKEUP`]), in enqueue order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<TaskId>,
}

/// A wake-up's bytes that are not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WakeupDecodeError {
    /// Longer than any wake-up a publisher sends.
    #[error("a wake-up of {0} bytes, expected at most {MAX_WAKEUP_BYTES}")]
    TooLong(usize),
    /// Not the JSON of a wake-up.
    #[error(
        "a wake-up that is not the JSON of one ({0}), expected {{\"queue\": ..., \"priority\": ..., \"tasks\": [...]}}"
    )]
    Malformed(String),
    /// A wake-up of a queue without a name.
    #[error("a wake-up without a queue name")]
    EmptyQueue,
}

impl Wakeup {
    /// The wake-ups of newly enqueued tasks, one per queue in order of first appearance: each
    /// with its queue's most urgent priority and its first task ids. `tasks` gives each task's
    /// queue, priority and id.
    pub fn of_tasks<'a>(tasks: impl IntoIterator<Item = (&'a str, i16, TaskId)>) -> Vec<Wakeup> {
        let mut wakeups: Vec<Wakeup> = Vec::new();
        for (queue, priority, id) in tasks {
            // Few queues per batch: a linear search beats a map here.
            let wakeup = match wakeups.iter().position(|w| w.queue == queue) {
                Some(at) => &mut wakeups[at],
                None => {
                    wakeups.push(Wakeup { queue: queue.to_owned(), priority: Some(priority), tasks: Vec::new() });
                    wakeups.last_mut().expect("just pushed")
                }
            };
            wakeup.priority = wakeup.priority.map(|p| p.min(priority)).or(Some(priority));
            if wakeup.tasks.len() < MAX_TASKS_PER_WAKEUP {
                wakeup.tasks.push(id);
            }
        }
        wakeups
    }

    /// The bytes a provider carries.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a wake-up always serializes")
    }

    /// A wake-up from the bytes a provider delivered. Anything else is an error for that
    /// message alone.
    pub fn decode(bytes: &[u8]) -> Result<Wakeup, WakeupDecodeError> {
        if bytes.len() > MAX_WAKEUP_BYTES {
            return Err(WakeupDecodeError::TooLong(bytes.len()));
        }
        let mut wakeup: Wakeup =
            serde_json::from_slice(bytes).map_err(|e| WakeupDecodeError::Malformed(e.to_string()))?;
        if wakeup.queue.is_empty() {
            return Err(WakeupDecodeError::EmptyQueue);
        }
        wakeup.tasks.truncate(MAX_TASKS_PER_WAKEUP);
        Ok(wakeup)
    }

    /// What the worker machine makes of it.
    pub fn into_input(self) -> Input {
        Input::Notified { queue: self.queue, priority: self.priority, run_at: None }
    }
}

/// A queue's name as one token of a subject or routing key that allows only some characters
/// (NATS subjects: no spaces, dots or wildcards): its UTF-8 bytes in lower-case hex, so that
/// every queue name maps to a distinct token.
pub fn queue_token(queue: &str) -> String {
    use std::fmt::Write;
    let mut token = String::with_capacity(queue.len() * 2);
    for byte in queue.bytes() {
        let _ = write!(token, "{byte:02x}");
    }
    token
}

/// The listening states of a worker's wake-up sources, reported to its machine as one: it
/// listens while every source is connected. When a source comes back, wake-ups it would have
/// carried meanwhile are gone, so the machine is told it reconnected (`Listener { connected:
/// true }` makes it claim at once) even if another source stayed up the whole time.
#[derive(Debug, Clone, Default)]
pub struct WakeSources {
    connected: Vec<bool>,
}

impl WakeSources {
    /// `sources` sources, none connected yet.
    pub fn new(sources: usize) -> Self {
        WakeSources { connected: vec![false; sources] }
    }

    /// Whether every source is connected.
    pub fn all_connected(&self) -> bool {
        self.connected.iter().all(|c| *c)
    }

    /// Source `source` connected or lost its connection: the input for the machine, if any.
    /// A source out of range changes nothing.
    pub fn update(&mut self, source: usize, connected: bool) -> Option<Input> {
        let was = self.all_connected();
        *self.connected.get_mut(source)? = connected;
        match (was, self.all_connected()) {
            (true, false) => Some(Input::Listener { connected: false }),
            // The last source down came back: catch up on what none carried meanwhile.
            (false, true) => Some(Input::Listener { connected: true }),
            // A source came back while another is still down: the machine polls meanwhile.
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakeups_of_tasks_group_by_queue_with_the_most_urgent_priority() {
        let tasks = [("a", 0, TaskId(1)), ("b", 5, TaskId(2)), ("a", -3, TaskId(3)), ("a", 2, TaskId(4))];
        let wakeups = Wakeup::of_tasks(tasks);
        assert_eq!(
            wakeups,
            vec![
                Wakeup { queue: "a".into(), priority: Some(-3), tasks: vec![TaskId(1), TaskId(3), TaskId(4)] },
                Wakeup { queue: "b".into(), priority: Some(5), tasks: vec![TaskId(2)] },
            ]
        );
    }

    #[test]
    fn a_bulk_wakeup_names_its_first_tasks_only_and_fits_its_bound() {
        let queue = "q".repeat(60);
        let tasks = (0..10_000).map(|i| (queue.as_str(), 0, TaskId(i64::MAX - i)));
        let wakeups = Wakeup::of_tasks(tasks);
        assert_eq!(wakeups.len(), 1);
        assert_eq!(wakeups[0].tasks.len(), MAX_TASKS_PER_WAKEUP);
        let bytes = wakeups[0].encode();
        assert!(bytes.len() <= MAX_WAKEUP_BYTES, "{} bytes", bytes.len());
        assert_eq!(Wakeup::decode(&bytes), Ok(wakeups[0].clone()));
    }

    #[test]
    fn wakeups_round_trip_and_poison_bytes_fail_alone() {
        let wakeup = Wakeup { queue: "emails \"eu\".*".into(), priority: None, tasks: vec![] };
        assert_eq!(Wakeup::decode(&wakeup.encode()), Ok(wakeup.clone()));
        assert_eq!(
            wakeup.into_input(),
            Input::Notified { queue: "emails \"eu\".*".into(), priority: None, run_at: None }
        );
        assert!(matches!(Wakeup::decode(b"\0\xff"), Err(WakeupDecodeError::Malformed(_))));
        assert!(matches!(Wakeup::decode(b"{\"queue\": 7}"), Err(WakeupDecodeError::Malformed(_))));
        assert_eq!(Wakeup::decode(b"{\"queue\": \"\"}"), Err(WakeupDecodeError::EmptyQueue));
        assert_eq!(
            Wakeup::decode(&[b' '; MAX_WAKEUP_BYTES + 1]),
            Err(WakeupDecodeError::TooLong(MAX_WAKEUP_BYTES + 1))
        );
        let priority_out_of_range = b"{\"queue\": \"q\", \"priority\": 40000}";
        assert!(matches!(Wakeup::decode(priority_out_of_range), Err(WakeupDecodeError::Malformed(_))));
    }

    #[test]
    fn queue_tokens_are_distinct_and_plain() {
        assert_eq!(queue_token("a.b"), "612e62");
        assert_ne!(queue_token("ab"), queue_token("a.b"));
        assert!(queue_token("é *>").bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn sources_listen_together_and_a_return_is_a_catch_up() {
        let mut sources = WakeSources::new(2);
        assert_eq!(sources.update(0, true), None);
        assert_eq!(sources.update(1, true), Some(Input::Listener { connected: true }));
        assert_eq!(sources.update(1, true), None, "no change");
        assert_eq!(sources.update(0, false), Some(Input::Listener { connected: false }));
        assert_eq!(sources.update(1, false), None, "still deaf");
        assert_eq!(sources.update(1, true), None, "one still down");
        assert_eq!(sources.update(0, true), Some(Input::Listener { connected: true }));
        assert_eq!(sources.update(7, false), None, "out of range");
        assert!(sources.all_connected());
    }
}
