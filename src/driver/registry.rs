//! The task registry: handlers by name, with typed arguments and results.
//!
//! Registering a handler returns a [`TaskHandle`] that carries its argument and result types,
//! so enqueueing through the handle is checked at compile time. One registry serves the
//! workers (as [`Handlers`]) and the clients (for the handles) of a process.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use futures::channel::oneshot;
use futures::future::{BoxFuture, FutureExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Handlers, Runtime, panic_error};
use crate::task::{Attempt, DbTime, ErrorCode, TaskError, TaskId};
use crate::worker::{TaskOutcome, TaskRun};

/// What a handler knows about the run it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskContext {
    /// The task.
    pub id: TaskId,
    /// Which run this is (1 for the first).
    pub attempt: Attempt,
    /// The task's queue.
    pub queue: String,
    /// The task's priority (lower runs first).
    pub priority: i16,
    /// When the task was enqueued (or last replaced by a key), on the database's clock.
    pub enqueued_at: DbTime,
    /// When it became claimable (its run-at), on the database's clock: with the enqueue time,
    /// how long it waited to run.
    pub run_at: DbTime,
}

/// A registered task: its name, argument type `A` and result type `R`.
pub struct TaskHandle<A, R> {
    name: Arc<str>,
    types: PhantomData<fn(A) -> R>,
}

impl<A, R> TaskHandle<A, R> {
    /// A handle for a task registered elsewhere (another process) under `name`. Nothing
    /// checks that its types match that registration: prefer the handle `register` returns.
    pub fn named(name: impl Into<Arc<str>>) -> Self {
        TaskHandle { name: name.into(), types: PhantomData }
    }

    /// The registered name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<A, R> Clone for TaskHandle<A, R> {
    fn clone(&self) -> Self {
        TaskHandle { name: self.name.clone(), types: PhantomData }
    }
}

impl<A, R> fmt::Debug for TaskHandle<A, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TaskHandle").field(&self.name).finish()
    }
}

impl<A: Serialize, R> TaskHandle<A, R> {
    /// The JSON arguments of a call with `args`.
    pub fn encode(&self, args: &A) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::to_value(args)
    }
}

impl<A, R: DeserializeOwned> TaskHandle<A, R> {
    /// The typed result from a stored JSON result.
    pub fn decode_result(&self, value: serde_json::Value) -> Result<R, TaskError> {
        serde_json::from_value(value).map_err(|e| {
            TaskError::new(
                ErrorCode::ResultDeserializationError,
                format!("result of {} did not decode: {e}", self.name),
            )
        })
    }
}

type Erased =
    Arc<dyn Fn(serde_json::Value, TaskContext, &dyn Runtime) -> BoxFuture<'static, TaskOutcome> + Send + Sync>;

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The name is taken.
    #[error("a task is already registered as {0:?}: expected each name once")]
    Duplicate(String),
    /// The name is empty or too long.
    #[error("invalid task name {0:?}: expected 1 to 128 bytes")]
    InvalidName(String),
}

/// Task handlers by name.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: BTreeMap<String, Erased>,
    /// The names registered with [`Registry::register_blocking`].
    blocking: std::collections::BTreeSet<String>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.handlers.keys()).finish()
    }
}

fn decode<A: DeserializeOwned>(name: &str, args: serde_json::Value) -> Result<A, TaskError> {
    serde_json::from_value(args).map_err(|e| {
        TaskError::new(ErrorCode::WorkerSerializationError, format!("arguments of {name} did not decode: {e}"))
    })
}

fn encode<R: Serialize>(name: &str, result: Result<R, TaskError>) -> TaskOutcome {
    match result.and_then(|r| {
        serde_json::to_value(r).map_err(|e| {
            TaskError::new(ErrorCode::WorkerSerializationError, format!("result of {name} did not encode: {e}"))
        })
    }) {
        Ok(value) => TaskOutcome::Success(value),
        Err(error) => TaskOutcome::Failure(error),
    }
}

/// A batch's outcome from its items and the failures among them (by item index).
fn batch_outcome(items: Vec<serde_json::Value>, mut failed: Vec<(usize, TaskError)>) -> TaskOutcome {
    if failed.is_empty() {
        return TaskOutcome::Success(serde_json::Value::from(items.len()));
    }
    failed.sort_by_key(|(index, _)| *index);
    let (_, first) = &failed[0];
    let details: Vec<serde_json::Value> = failed
        .iter()
        .map(|(index, e)| serde_json::json!({"index": index, "code": e.code.as_str(), "message": e.message}))
        .collect();
    let message = format!("{} of {} items failed; first: {}", failed.len(), items.len(), first.message);
    let error = TaskError::new(first.code.clone(), message).with_data(serde_json::json!({ "failed": details }));
    let remaining = failed.iter().map(|(index, _)| items[*index].clone()).collect();
    TaskOutcome::PartialFailure { error, remaining: serde_json::Value::Array(remaining) }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// The registered names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }

    /// The names of the blocking handlers ([`Registry::register_blocking`]).
    pub fn blocking_names(&self) -> impl Iterator<Item = &str> {
        self.blocking.iter().map(String::as_str)
    }

    fn insert<A, R>(&mut self, name: &str, handler: Erased) -> Result<TaskHandle<A, R>, RegistryError> {
        if name.is_empty() || name.len() > 128 {
            return Err(RegistryError::InvalidName(name.to_owned()));
        }
        if self.handlers.contains_key(name) {
            return Err(RegistryError::Duplicate(name.to_owned()));
        }
        self.handlers.insert(name.to_owned(), handler);
        Ok(TaskHandle::named(name))
    }

    /// Registers an async handler under `name`.
    pub fn register<A, R, F, Fut>(&mut self, name: &str, handler: F) -> Result<TaskHandle<A, R>, RegistryError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: Fn(A, TaskContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, TaskError>> + Send + 'static,
    {
        let owned: Arc<str> = name.into();
        let handler = Arc::new(handler);
        let erased: Erased = Arc::new(move |args, context, _runtime| {
            let name = owned.clone();
            let handler = handler.clone();
            // Called inside the future, so even a panic before the first await is caught by
            // the driver's catch_unwind around it.
            async move {
                match decode::<A>(&name, args) {
                    Ok(args) => encode(&name, handler(args, context).await),
                    Err(error) => TaskOutcome::Failure(error),
                }
            }
            .boxed()
        });
        self.insert(name, erased)
    }

    /// Registers a batch handler under `name`: the task's arguments are a JSON array, the
    /// handler gets the items and answers one result per item, in order. When some items
    /// fail, the task fails with the first failure's code (which decides a retry) and its
    /// arguments become the failed items, so a retry runs only those (graphile-worker's batch
    /// jobs). An item that does not decode fails on its own (`WORKER_SERIALIZATION_ERROR`).
    /// The result is the number of items done. Enqueueing more items under the same job key
    /// (mode `replace`) while the task waits appends them.
    pub fn register_batch<A, F, Fut>(
        &mut self,
        name: &str,
        handler: F,
    ) -> Result<TaskHandle<Vec<A>, usize>, RegistryError>
    where
        A: DeserializeOwned + Send + 'static,
        F: Fn(Vec<A>, TaskContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<(), TaskError>>> + Send + 'static,
    {
        let owned: Arc<str> = name.into();
        let handler = Arc::new(handler);
        let erased: Erased = Arc::new(move |args, context, _runtime| {
            let name = owned.clone();
            let handler = handler.clone();
            async move {
                let items = match args {
                    serde_json::Value::Array(items) => items,
                    other => vec![other],
                };
                let mut decoded = Vec::with_capacity(items.len());
                let mut failed: Vec<(usize, TaskError)> = Vec::new();
                let mut positions = Vec::with_capacity(items.len());
                for (index, item) in items.iter().enumerate() {
                    match decode::<A>(&name, item.clone()) {
                        Ok(value) => {
                            decoded.push(value);
                            positions.push(index);
                        }
                        Err(error) => failed.push((index, error)),
                    }
                }
                let expected = decoded.len();
                let results = if expected == 0 { Vec::new() } else { handler(decoded, context).await };
                if results.len() != expected {
                    let message =
                        format!("batch handler {name} answered {} results for {expected} items", results.len());
                    return TaskOutcome::Failure(TaskError::new(ErrorCode::UnhandledError, message));
                }
                failed.extend(positions.into_iter().zip(results).filter_map(|(i, r)| r.err().map(|e| (i, e))));
                batch_outcome(items, failed)
            }
            .boxed()
        });
        self.insert(name, erased)
    }

    /// Registers a blocking handler under `name`: it runs on the runtime's blocking pool, and
    /// a panic in it ends the task with `UNHANDLED_ERROR`.
    pub fn register_blocking<A, R, F>(&mut self, name: &str, handler: F) -> Result<TaskHandle<A, R>, RegistryError>
    where
        A: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: Fn(A, TaskContext) -> Result<R, TaskError> + Send + Sync + 'static,
    {
        let owned: Arc<str> = name.into();
        let handler = Arc::new(handler);
        let erased: Erased = Arc::new(move |args, context, runtime| {
            let name = owned.clone();
            let args = match decode::<A>(&name, args) {
                Ok(args) => args,
                Err(error) => return futures::future::ready(TaskOutcome::Failure(error)).boxed(),
            };
            let (tx, rx) = oneshot::channel();
            let handler = handler.clone();
            let done = runtime.spawn_blocking(Box::new(move || {
                let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(args, context)));
                let outcome = match caught {
                    Ok(result) => encode(&name, result),
                    Err(panic) => TaskOutcome::Failure(panic_error(panic.as_ref())),
                };
                let _ = tx.send(outcome);
            }));
            async move {
                done.await;
                rx.await.unwrap_or_else(|_| {
                    TaskOutcome::Failure(TaskError::new(ErrorCode::UnhandledError, "blocking handler vanished"))
                })
            }
            .boxed()
        });
        let handle = self.insert(name, erased)?;
        self.blocking.insert(name.to_owned());
        Ok(handle)
    }

    /// The handlers bound to a runtime, for the driver.
    pub fn bind<R: Runtime>(self: Arc<Self>, runtime: Arc<R>) -> BoundRegistry<R> {
        BoundRegistry { registry: self, runtime }
    }
}

/// A registry bound to a runtime (blocking handlers need its pool): the driver's [`Handlers`].
pub struct BoundRegistry<R> {
    registry: Arc<Registry>,
    runtime: Arc<R>,
}

impl<R: Runtime> Handlers for BoundRegistry<R> {
    fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome> {
        let context = TaskContext {
            id: run.id,
            attempt: run.attempt,
            queue: run.queue,
            priority: run.priority,
            enqueued_at: run.enqueued_at,
            run_at: run.run_at,
        };
        match self.registry.handlers.get(&run.name) {
            Some(handler) => handler(run.args, context, &*self.runtime),
            None => {
                let error = TaskError::new(
                    ErrorCode::WorkerResolutionError,
                    format!("no handler is registered as {:?} on this worker", run.name),
                );
                futures::future::ready(TaskOutcome::Failure(error)).boxed()
            }
        }
    }
}
