//! Waiting for a result.
//!
//! Finishing statements notify the schema's done channel
//! ([`PgSchema::done_channel`](crate::postgres::PgSchema::done_channel)) with the ids they
//! finished, while a waiter is registered for it (see [`register_listener`]: without waiters,
//! finishes send nothing). A waiter listens, registers, then reads the task, and re-reads it
//! after every notification naming it (a notification can arrive before its commit is visible
//! to another connection, so the notification itself is never trusted), until it is terminal
//! or the caller's timeout future resolves. Waiting is runtime-agnostic: the timeout is any
//! future (a runtime's sleep).
//!
//! [`PgStore::wait_result`] opens a listening connection per call. A process with many waiters
//! runs one [`DoneRouter`] instead: one listener routes each notification to the waiters of the
//! ids it names, and [`PgStore::wait_result_with`] waits through it.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use futures::channel::oneshot;
use futures::future::{Either, select};
use sqlx::postgres::PgListener;

use crate::postgres::listeners::{register_listener, unregister_listener};
use crate::postgres::store::PgStore;
use crate::store::TaskRecord;
use crate::task::{ErrorCode, TaskId};

/// Why waiting for a result ended without one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The timeout resolved first; the task may still finish later.
    #[error("timed out waiting for task {0}")]
    Timeout(TaskId),
    /// No task has this id.
    #[error("task {0} not found")]
    NotFound(TaskId),
    /// The database or the listening connection failed.
    #[error("database error while waiting: {}", super::error_text(.0))]
    Database(#[from] sqlx::Error),
}

impl WaitError {
    /// The error code callers see: `WAIT_TIMEOUT`, `TASK_NOT_FOUND` or `BROKER_ERROR`.
    pub fn code(&self) -> ErrorCode {
        match self {
            WaitError::Timeout(_) => ErrorCode::WaitTimeout,
            WaitError::NotFound(_) => ErrorCode::TaskNotFound,
            WaitError::Database(_) => ErrorCode::BrokerError,
        }
    }
}

impl PgStore {
    /// Waits until the task is terminal and returns it, or fails with [`WaitError::Timeout`]
    /// when `timeout` resolves first. Opens its own listening connection for the wait, which
    /// registers as a waiter (a moment's exclusive lock that finishing statements wait
    /// behind); see [`wait_result_with`](PgStore::wait_result_with) to share one.
    ///
    /// A wait that ends by itself deletes its registration before the connection goes back to
    /// the pool; one cut short by `timeout` leaves it until that session ends or registers
    /// again (finishes meanwhile notify for nobody, the cost of every finish before schema 8),
    /// since nothing may wait after the caller's timeout.
    pub async fn wait_result(&self, id: TaskId, timeout: impl Future<Output = ()>) -> Result<TaskRecord, WaitError> {
        let wait = async {
            let channels = [self.schema().done_channel()];
            let mut listener = PgListener::connect_with(self.listening_pool()?).await?;
            listener.listen(&channels[0]).await?;
            register_listener(&mut listener, self.schema(), &channels).await?;
            let found = self.wait_listening(&mut listener, &channels, id).await;
            // Best effort: a session that cannot be reached takes its registration with it.
            let _ = unregister_listener(&mut listener, self.schema()).await;
            found
        };
        race(wait, timeout, id).await
    }

    /// Reads the task until it is terminal, again after every notification naming it and
    /// after every reconnect of `listener` (a new session, registered again: notifications may
    /// have been missed).
    async fn wait_listening(
        &self,
        listener: &mut PgListener,
        channels: &[String],
        id: TaskId,
    ) -> Result<TaskRecord, WaitError> {
        loop {
            // Read after listening, so a finish between the two is not missed.
            if let Some(record) = self.terminal(id).await? {
                return Ok(record);
            }
            loop {
                match listener.try_recv().await? {
                    None => {
                        register_listener(listener, self.schema(), channels).await?;
                        break;
                    }
                    Some(note) if names(note.payload(), id) => break,
                    Some(_) => {}
                }
            }
        }
    }

    /// Waits like [`wait_result`](PgStore::wait_result), through a shared [`DoneRouter`]
    /// (whose [`run`](DoneRouter::run) must be driven for waits to see notifications).
    pub async fn wait_result_with(
        &self,
        router: &DoneRouter,
        id: TaskId,
        timeout: impl Future<Output = ()>,
    ) -> Result<TaskRecord, WaitError> {
        let wait = async {
            loop {
                // Subscribe before reading, so a finish between the two is not missed.
                let signal = router.subscribe(id);
                if let Some(record) = self.terminal(id).await? {
                    return Ok(record);
                }
                signal.await;
            }
        };
        race(wait, timeout, id).await
    }

    /// The task if it is terminal; `NotFound` if it does not exist.
    async fn terminal(&self, id: TaskId) -> Result<Option<TaskRecord>, WaitError> {
        match self.get(id).await? {
            None => Err(WaitError::NotFound(id)),
            Some(record) if record.state.is_terminal() => Ok(Some(record)),
            Some(_) => Ok(None),
        }
    }
}

async fn race<T>(
    wait: impl Future<Output = Result<T, WaitError>>,
    timeout: impl Future<Output = ()>,
    id: TaskId,
) -> Result<T, WaitError> {
    match select(pin!(wait), pin!(timeout)).await {
        Either::Left((result, _)) => result,
        Either::Right(((), _)) => Err(WaitError::Timeout(id)),
    }
}

/// Whether a done-channel payload (comma-separated ids) names `id`.
fn names(payload: &str, id: TaskId) -> bool {
    payload.split(',').any(|part| part.trim().parse::<i64>() == Ok(id.0))
}

/// Routes done-channel notifications from one listening connection to many waiters.
///
/// Cheap to clone (one shared table of waiters). Drive [`run`](DoneRouter::run) on a task of
/// your runtime; waiters [`subscribe`](DoneRouter::subscribe) to an id and are woken when a
/// notification names it, and all of them are woken whenever the listening connection was
/// re-established (notifications may have been lost meanwhile). A [`DoneSignal`] leaves the
/// table when it is dropped, woken or not, so waits that end by a result, a timeout or a
/// dropped future leave nothing behind.
#[derive(Debug, Clone, Default)]
pub struct DoneRouter {
    waiters: Arc<Mutex<Waiters>>,
}

/// The waiters of each task, by subscription number.
#[derive(Debug, Default)]
struct Waiters {
    next: u64,
    by_task: BTreeMap<TaskId, BTreeMap<u64, oneshot::Sender<()>>>,
}

/// Resolves when a notification names the subscribed task, or when every waiter is woken.
/// Dropping it unsubscribes.
#[derive(Debug)]
pub struct DoneSignal {
    receiver: oneshot::Receiver<()>,
    router: Weak<Mutex<Waiters>>,
    task: TaskId,
    number: u64,
}

impl Future for DoneSignal {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        // A dropped sender (the router gone) wakes the waiter too: it re-reads.
        std::pin::Pin::new(&mut self.receiver).poll(cx).map(|_| ())
    }
}

impl Drop for DoneSignal {
    fn drop(&mut self) {
        let Some(waiters) = self.router.upgrade() else { return };
        let mut waiters = waiters.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(list) = waiters.by_task.get_mut(&self.task) {
            list.remove(&self.number);
            if list.is_empty() {
                waiters.by_task.remove(&self.task);
            }
        }
    }
}

impl DoneRouter {
    /// A router with no waiters.
    pub fn new() -> Self {
        DoneRouter::default()
    }

    /// A signal for the next notification naming `id`.
    pub fn subscribe(&self, id: TaskId) -> DoneSignal {
        let (sender, receiver) = oneshot::channel();
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        let number = waiters.next;
        waiters.next = waiters.next.wrapping_add(1);
        waiters.by_task.entry(id).or_default().insert(number, sender);
        DoneSignal { receiver, router: Arc::downgrade(&self.waiters), task: id, number }
    }

    /// Wakes the waiters of every id a done-channel payload names.
    pub fn deliver(&self, payload: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(PoisonError::into_inner);
        for part in payload.split(',') {
            if let Ok(id) = part.trim().parse::<i64>() {
                for sender in waiters.by_task.remove(&TaskId(id)).unwrap_or_default().into_values() {
                    let _ = sender.send(());
                }
            }
        }
    }

    /// Wakes every waiter (after a reconnect, when notifications may have been lost).
    pub fn wake_all(&self) {
        let by_task = std::mem::take(&mut self.waiters.lock().unwrap_or_else(PoisonError::into_inner).by_task);
        for sender in by_task.into_values().flat_map(BTreeMap::into_values) {
            let _ = sender.send(());
        }
    }

    /// How many tasks have waiters.
    pub fn waiting(&self) -> usize {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner).by_task.len()
    }

    /// Listens on `store`'s done channel and routes notifications until the listener fails
    /// for good (it reconnects by itself on a lost connection, waking every waiter). Its
    /// session registers as a waiter (see [`register_listener`]) and stays registered until
    /// that session ends, even when this future is dropped and the session goes back to the
    /// pool: finishes then notify for nobody, as they all did before schema 8.
    pub async fn run(&self, store: &PgStore) -> Result<(), sqlx::Error> {
        let channels = [store.schema().done_channel()];
        let mut listener = PgListener::connect_with(store.listening_pool()?).await?;
        listener.listen(&channels[0]).await?;
        register_listener(&mut listener, store.schema(), &channels).await?;
        // Waiters that subscribed before the listener was up re-read now.
        self.wake_all();
        loop {
            match listener.try_recv().await? {
                Some(note) => self.deliver(note.payload()),
                None => {
                    register_listener(&mut listener, store.schema(), &channels).await?;
                    self.wake_all();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_name_ids() {
        assert!(names("1,22,333", TaskId(22)));
        assert!(!names("1,22,333", TaskId(2)));
        assert!(!names("", TaskId(0)));
    }

    #[test]
    fn the_router_wakes_named_waiters_only() {
        let router = DoneRouter::new();
        let mut one = router.subscribe(TaskId(1));
        let mut two = router.subscribe(TaskId(2));
        router.deliver("1,3");
        assert_eq!(one.receiver.try_recv(), Ok(Some(())));
        assert_eq!(two.receiver.try_recv(), Ok(None));
        router.wake_all();
        assert_eq!(two.receiver.try_recv(), Ok(Some(())));
        assert_eq!(router.waiting(), 0);
    }

    #[test]
    fn dropped_signals_leave_the_router() {
        let router = DoneRouter::new();
        // Never woken (a wait that timed out or was dropped).
        for _ in 0..1_000 {
            drop(router.subscribe(TaskId(7)));
        }
        let kept = router.subscribe(TaskId(7));
        let other = router.subscribe(TaskId(8));
        assert_eq!(router.waiting(), 2);
        drop(kept);
        assert_eq!(router.waiting(), 1, "a task whose last waiter left has no entry");
        // Woken, then dropped after the router let go of it.
        router.deliver("8");
        drop(other);
        assert_eq!(router.waiting(), 0);
        // A signal outliving its router is just dropped.
        let orphan = DoneRouter::new().subscribe(TaskId(1));
        drop(orphan);
    }
}
