//! The client: enqueue typed tasks, wait for their results, inspect, and act as an operator
//! (cancel, retry, reschedule, complete or fail by hand, force-unlock, remove a key, purge,
//! pause and resume queues).

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::{AbortHandle, Abortable, FutureExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgPool;

use super::retry::Retry;
use super::wakeups::WakeupProvider;
use super::{Runtime, TaskHandle, sleep_after};
use crate::config::AppConfig;
use crate::postgres::{
    DoneRouter, MIGRATE_LOCK_WAIT, MigrateSchemaError, PgAdminError, PgEnqueueError, PgSchema, PgStore, PgSubmitError,
    PgWorkflowError, WaitError, enqueue_in, migrate_within, require_current, submit_workflow_in,
};
use crate::store::{
    AdminReply, AdminRequest, AttemptRecord, Cancelled, NewTask, PausedQueue, QueueDepth, TaskFilter, TaskRecord,
    WorkerRecord, WorkflowId, WorkflowRecord,
};
use crate::workflow::WorkflowStatus;

use super::workflow::{Workflow, WorkflowHandle};
use crate::task::{ErrorCode, TaskError, TaskId, TaskState};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The arguments did not serialize to JSON.
    #[error("task arguments did not serialize: {0}")]
    Arguments(#[from] serde_json::Error),
    /// The enqueue was refused (bad input, a payload mismatch, or the database failed).
    #[error(transparent)]
    Enqueue(#[from] PgEnqueueError),
    /// An operator action was refused.
    #[error(transparent)]
    Admin(#[from] PgAdminError),
    /// A workflow was refused at submit (bad input, or the database failed).
    #[error(transparent)]
    Submit(#[from] PgSubmitError),
    /// A pause, resume or cancel of a workflow was refused (or the database failed).
    #[error(transparent)]
    Workflow(#[from] PgWorkflowError),
    /// The schema could not be migrated (or, with [`Client::migrate`]`(false)`, is not
    /// migrated) before the client's first write.
    #[error(transparent)]
    Schema(#[from] MigrateSchemaError),
    /// The database failed.
    #[error("database error: {}", crate::postgres::error_text(.0))]
    Database(#[from] sqlx::Error),
    /// The store answered an operator action with the reply of another: a broken store.
    #[error("the store answered a {action} with {reply}: expected the reply of a {action}")]
    UnexpectedReply {
        /// The action sent.
        action: &'static str,
        /// What came back.
        reply: String,
    },
}

impl ClientError {
    /// The error code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::Enqueue(error) => error.code(),
            ClientError::Arguments(_) => ErrorCode::User("VALIDATION_FAILED".into()),
            ClientError::Submit(PgSubmitError::Invalid(_)) => ErrorCode::User("VALIDATION_FAILED".into()),
            ClientError::Admin(_)
            | ClientError::Submit(_)
            | ClientError::Workflow(_)
            | ClientError::Schema(_)
            | ClientError::Database(_)
            | ClientError::UnexpectedReply { .. } => ErrorCode::BrokerError,
        }
    }
}

/// Why waiting for a result gave no result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResultError {
    /// The task failed for good.
    #[error("task failed: {0}")]
    Failed(TaskError),
    /// The task was cancelled.
    #[error("task was cancelled")]
    Cancelled,
    /// The task expired before it ran.
    #[error("task expired before it ran")]
    Expired,
    /// The task is a workflow's step that never ran: its parents could not satisfy its join.
    #[error("step was skipped: its parents' outcomes could not satisfy its join")]
    Skipped,
    /// The wait timed out; the task may still run.
    #[error(
        "no result within {}: the task may still run",
        crate::time::format_duration_ms(u64::try_from(.0.as_millis()).unwrap_or(u64::MAX))
    )]
    Timeout(Duration),
    /// No task has this id.
    #[error("no task {0}")]
    NotFound(TaskId),
    /// No workflow has this id.
    #[error("no workflow {0}")]
    WorkflowNotFound(WorkflowId),
    /// The stored result did not decode into the result type.
    #[error("{0}")]
    Decode(TaskError),
    /// The database failed.
    #[error("database error: {}", crate::postgres::error_text(.0))]
    Database(#[from] sqlx::Error),
}

impl ResultError {
    /// The error code of this outcome (`WAIT_TIMEOUT`, `TASK_CANCELLED`, the task's own code…).
    pub fn code(&self) -> ErrorCode {
        match self {
            ResultError::Failed(error) | ResultError::Decode(error) => error.code.clone(),
            ResultError::Cancelled => ErrorCode::TaskCancelled,
            ResultError::Expired => ErrorCode::TaskExpired,
            ResultError::Skipped => ErrorCode::StepSkipped,
            ResultError::Timeout(_) => ErrorCode::WaitTimeout,
            ResultError::NotFound(_) | ResultError::WorkflowNotFound(_) => ErrorCode::TaskNotFound,
            ResultError::Database(_) => ErrorCode::BrokerError,
        }
    }
}

struct Inner<R> {
    store: PgStore,
    runtime: Arc<R>,
    router: DoneRouter,
    /// The router's listening task, started by the first wait.
    listening: Mutex<Option<AbortHandle>>,
    /// Where enqueues are announced instead of by NOTIFY, if anywhere.
    wakeups: Option<Arc<dyn WakeupProvider>>,
    /// Whether the first write migrates the schema (else it only checks it).
    migrate: AtomicBool,
    /// Whether the schema was found current (or migrated), so writes need not look again.
    schema_ready: AtomicBool,
}

impl<R> Drop for Inner<R> {
    fn drop(&mut self) {
        if let Some(handle) = self.listening.lock().unwrap_or_else(PoisonError::into_inner).take() {
            handle.abort();
        }
    }
}

/// Enqueues tasks and reads their results. Cheap to clone; one listening connection per
/// client (opened by the first wait) serves every waiter.
pub struct Client<R> {
    inner: Arc<Inner<R>>,
}

impl<R> Clone for Client<R> {
    fn clone(&self) -> Self {
        Client { inner: self.inner.clone() }
    }
}

impl<R: Runtime> Client<R> {
    /// A client on `pool`, checking enqueues against `app`, in `schema`.
    ///
    /// Its first write (an enqueue or an operator action) applies the migrations the schema
    /// lacks, as a worker does at startup (one process migrates at a time; the others wait
    /// and find it done), so client and worker may start in any order on an empty database.
    /// [`Client::migrate`]`(false)` only checks the schema instead.
    pub fn new(runtime: Arc<R>, pool: PgPool, schema: PgSchema, app: AppConfig) -> Self {
        Client::on_store(runtime, PgStore::new(pool, schema, app), None, true)
    }

    fn on_store(runtime: Arc<R>, store: PgStore, wakeups: Option<Arc<dyn WakeupProvider>>, migrate: bool) -> Self {
        Client {
            inner: Arc::new(Inner {
                store,
                runtime,
                wakeups,
                router: DoneRouter::new(),
                listening: Mutex::new(None),
                migrate: AtomicBool::new(migrate),
                schema_ready: AtomicBool::new(false),
            }),
        }
    }

    /// Opens the connection result waits listen on from `pool` (see
    /// [`PgStore::with_session_pool`]): a direct connection when the client's pool goes
    /// through PgBouncer in transaction mode, where LISTEN does not work. A client of its own:
    /// clones made before keep listening on the client's pool.
    pub fn session_pool(self, pool: PgPool) -> Self {
        let store = self.inner.store.clone().with_session_pool(pool);
        Client::on_store(
            self.inner.runtime.clone(),
            store,
            self.inner.wakeups.clone(),
            self.inner.migrate.load(Ordering::Relaxed),
        )
    }

    /// Announces this client's enqueues through `provider` (RabbitMQ, NATS: see
    /// [`wakeups`](crate::driver::wakeups)) instead of PostgreSQL's NOTIFY: the enqueue commits
    /// without a NOTIFY, so producers' commits do not queue behind each other on PostgreSQL's
    /// notification lock, and the wake-up is published once it committed. Workers must
    /// subscribe to the same provider. Enqueues inside the caller's transaction
    /// ([`enqueue_in`](Client::enqueue_in)), tasks with keys and workflows still notify, at
    /// their commit. A client of its own: clones made before announce by NOTIFY.
    pub fn wakeups(self, provider: Arc<dyn WakeupProvider>) -> Self {
        let store = self.inner.store.clone();
        Client::on_store(self.inner.runtime.clone(), store, Some(provider), self.inner.migrate.load(Ordering::Relaxed))
    }

    /// Enqueues `tasks` in one statement, announced by NOTIFY (only of the queues a worker
    /// waits on: see [`DbRequest::SetWaiting`](crate::store::DbRequest::SetWaiting)) or by the
    /// client's provider.
    async fn enqueue_announced(&self, tasks: Vec<NewTask>) -> Result<Vec<TaskId>, ClientError> {
        self.schema_ready().await?;
        let store = &self.inner.store;
        Ok(match &self.inner.wakeups {
            Some(provider) => {
                let (ids, wakeups) = store.enqueue_many_unnotified(tasks).await?;
                provider.publish(wakeups);
                ids
            }
            None => store.enqueue_many(tasks).await?,
        })
    }

    /// Whether the first write migrates the schema (the default) or only checks that it is
    /// current, failing with [`ClientError::Schema`] if it is not: for clients whose role may
    /// only read and write (README: Privileges). Applies to every clone.
    pub fn migrate(self, migrate: bool) -> Self {
        self.inner.migrate.store(migrate, Ordering::Relaxed);
        self
    }

    /// Makes sure the schema is there before a write: migrates it (or checks it) once.
    async fn schema_ready(&self) -> Result<(), ClientError> {
        if self.inner.schema_ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let store = &self.inner.store;
        if self.inner.migrate.load(Ordering::Relaxed) && store.can_migrate() {
            migrate_within(store.session_pool(), store.schema(), MIGRATE_LOCK_WAIT).await?;
        } else {
            require_current(store.pool(), store.schema()).await?;
        }
        self.inner.schema_ready.store(true, Ordering::Release);
        Ok(())
    }

    /// The underlying store (enqueue without types, inspection, migrations).
    pub fn store(&self) -> &PgStore {
        &self.inner.store
    }

    /// Enqueues `task` with `args`.
    pub async fn enqueue<A: Serialize, T>(
        &self,
        task: &TaskHandle<A, T>,
        args: &A,
    ) -> Result<ResultHandle<R, T>, ClientError> {
        self.enqueue_with(task, args, |t| t).await
    }

    /// Enqueues `task` with `args`, shaped by `options` (queue, priority, run-at, good-until,
    /// retry policy, key and key mode, flags: see [`NewTask`]'s builder methods).
    pub async fn enqueue_with<A: Serialize, T>(
        &self,
        task: &TaskHandle<A, T>,
        args: &A,
        options: impl FnOnce(NewTask) -> NewTask,
    ) -> Result<ResultHandle<R, T>, ClientError> {
        let new = options(NewTask::new(task.name(), task.encode(args)?));
        let id = crate::postgres::only_id(self.enqueue_announced(vec![new]).await?)?;
        Ok(self.handle(id))
    }

    /// Enqueues one `task` per item of `args` in one statement.
    pub async fn enqueue_many<A: Serialize, T>(
        &self,
        task: &TaskHandle<A, T>,
        args: impl IntoIterator<Item = A>,
    ) -> Result<Vec<ResultHandle<R, T>>, ClientError> {
        let tasks = args
            .into_iter()
            .map(|a| Ok(NewTask::new(task.name(), task.encode(&a)?)))
            .collect::<Result<Vec<_>, serde_json::Error>>()?;
        let ids = self.enqueue_announced(tasks).await?;
        Ok(ids.into_iter().map(|id| self.handle(id)).collect())
    }

    /// Enqueues inside the caller's own transaction (or on any executor): the task exists
    /// only if that transaction commits.
    pub async fn enqueue_in<'e, E: sqlx::PgExecutor<'e>, A: Serialize, T>(
        &self,
        executor: E,
        task: &TaskHandle<A, T>,
        args: &A,
        options: impl FnOnce(NewTask) -> NewTask,
    ) -> Result<ResultHandle<R, T>, ClientError> {
        let new = options(NewTask::new(task.name(), task.encode(args)?));
        self.schema_ready().await?;
        let store = &self.inner.store;
        let id = enqueue_in(executor, store.schema(), store.app(), new).await?;
        Ok(self.handle(id))
    }

    /// Submits `workflow` in one statement: its steps without parents become claimable, the
    /// others wait for their parents (see [`Workflow`]).
    pub async fn submit(&self, workflow: Workflow) -> Result<WorkflowHandle<R>, ClientError> {
        let new = workflow.into_new();
        self.schema_ready().await?;
        let submitted = self.inner.store.submit_workflow(&new).await?;
        Ok(self.workflow_handle(&new, submitted))
    }

    /// Submits `workflow` inside the caller's own transaction (or on any executor): it exists
    /// only if that transaction commits.
    pub async fn submit_in<'e, E: sqlx::PgExecutor<'e>>(
        &self,
        executor: E,
        workflow: Workflow,
    ) -> Result<WorkflowHandle<R>, ClientError> {
        let new = workflow.into_new();
        self.schema_ready().await?;
        let store = &self.inner.store;
        let submitted = submit_workflow_in(executor, store.schema(), store.app(), &new).await?;
        Ok(self.workflow_handle(&new, submitted))
    }

    fn workflow_handle(
        &self,
        new: &crate::store::NewWorkflow,
        submitted: crate::store::SubmittedWorkflow,
    ) -> WorkflowHandle<R> {
        let mut sinks = vec![true; submitted.tasks.len()];
        for edge in &new.spec.edges {
            if let Some(sink) = sinks.get_mut(edge.parent.index()) {
                *sink = false;
            }
        }
        let sink_tasks = submitted.tasks.iter().zip(&sinks).filter(|(_, sink)| **sink).map(|(id, _)| *id).collect();
        WorkflowHandle { client: self.clone(), id: submitted.workflow, tasks: submitted.tasks, sinks: sink_tasks }
    }

    /// The workflow `id` as stored now: its status and its steps per state.
    pub async fn workflow(&self, id: WorkflowId) -> Result<Option<WorkflowRecord>, ClientError> {
        Ok(self.inner.store.workflow(id).await?)
    }

    /// Pauses workflow `id`: no step is promoted or skipped until it is resumed.
    pub async fn pause_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, ClientError> {
        self.schema_ready().await?;
        Ok(self.inner.store.pause_workflow(id).await?)
    }

    /// Resumes workflow `id`: what its steps' joins decided meanwhile applies now.
    pub async fn resume_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, ClientError> {
        self.schema_ready().await?;
        Ok(self.inner.store.resume_workflow(id).await?)
    }

    /// Cancels workflow `id` in one statement: every step not finished is cancelled, and the
    /// workers of the claimed and running ones, told on the abort channel, beat at once, find
    /// their leases gone and abort the handlers.
    pub async fn cancel_workflow(&self, id: WorkflowId) -> Result<WorkflowStatus, ClientError> {
        self.schema_ready().await?;
        Ok(self.inner.store.cancel_workflow(id).await?)
    }

    /// Retries workflow `id` in one statement: its steps that did not complete (failed,
    /// cancelled, expired, skipped) and, if `downstream`, every finished step below them
    /// (completed ones run again on their parents' new results) wait again, and their joins
    /// decide. A cancelled workflow is reopened; a paused one stays paused until resumed.
    pub async fn retry_workflow(&self, id: WorkflowId, downstream: bool) -> Result<WorkflowStatus, ClientError> {
        self.schema_ready().await?;
        Ok(self.inner.store.retry_workflow(id, downstream).await?)
    }

    /// The client's runtime.
    pub(crate) fn runtime(&self) -> &R {
        &self.inner.runtime
    }

    /// A result handle for a task enqueued elsewhere.
    pub fn handle<T>(&self, id: TaskId) -> ResultHandle<R, T> {
        ResultHandle { client: self.clone(), id, result: PhantomData }
    }

    /// The task as stored now.
    pub async fn get(&self, id: TaskId) -> Result<Option<TaskRecord>, ClientError> {
        Ok(self.inner.store.get(id).await?)
    }

    /// The finished runs of a task.
    pub async fn attempts(&self, id: TaskId) -> Result<Vec<AttemptRecord>, ClientError> {
        Ok(self.inner.store.attempts(id).await?)
    }

    /// Applies an operator's action (cancel, retry, reschedule, complete or fail by hand,
    /// force-unlock, remove a key, purge, pause or resume a queue): see [`AdminRequest`] for
    /// what each does and replies.
    pub async fn admin(&self, request: &AdminRequest) -> Result<AdminReply, ClientError> {
        self.schema_ready().await?;
        Ok(self.inner.store.admin(request).await?)
    }

    /// The paused queues.
    pub async fn paused_queues(&self) -> Result<Vec<PausedQueue>, ClientError> {
        Ok(self.inner.store.paused_queues().await?)
    }

    /// Tasks matching `filter`.
    pub async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, ClientError> {
        Ok(self.inner.store.list(filter).await?)
    }

    /// Task counts by queue and state.
    pub async fn counts(&self) -> Result<BTreeMap<(String, TaskState), u64>, ClientError> {
        Ok(self.inner.store.counts().await?)
    }

    /// Each queue's live tasks by state: the live table only, cheap to poll (see
    /// [`QueueDepth`]).
    pub async fn queue_depths(&self) -> Result<Vec<QueueDepth>, ClientError> {
        Ok(self.inner.store.queue_depths().await?)
    }

    /// The worker registry.
    pub async fn workers(&self) -> Result<Vec<WorkerRecord>, ClientError> {
        Ok(self.inner.store.workers().await?)
    }

    /// Waits until task `id` is terminal, or `timeout` passes.
    pub async fn wait(&self, id: TaskId, timeout: Duration) -> Result<TaskRecord, ResultError> {
        if !self.inner.store.keeps_sessions() {
            return self.wait_by_polling(id, timeout).await;
        }
        self.ensure_listening();
        let runtime = &*self.inner.runtime;
        let deadline = sleep_after(runtime, runtime.now(), timeout);
        match self.inner.store.wait_result_with(&self.inner.router, id, deadline).await {
            Ok(record) => Ok(record),
            Err(WaitError::Timeout(_)) => Err(ResultError::Timeout(timeout)),
            Err(WaitError::NotFound(id)) => Err(ResultError::NotFound(id)),
            Err(WaitError::Database(error)) => Err(ResultError::Database(error)),
        }
    }

    /// Waits by reading the task again and again (10 ms apart at first, up to 500 ms): through
    /// a transaction pooler with no session pool, a LISTEN would hear nothing.
    async fn wait_by_polling(&self, id: TaskId, timeout: Duration) -> Result<TaskRecord, ResultError> {
        let runtime = &*self.inner.runtime;
        // A timeout past what the clock can count is no deadline.
        let end = runtime.now().checked_add(timeout);
        let mut pause = Duration::from_millis(10);
        loop {
            match self.inner.store.get(id).await.map_err(ResultError::Database)? {
                None => return Err(ResultError::NotFound(id)),
                Some(record) if record.state.is_terminal() => return Ok(record),
                Some(_) => {}
            }
            let now = runtime.now();
            if end.is_some_and(|end| now >= end) {
                return Err(ResultError::Timeout(timeout));
            }
            let next = now.checked_add(pause).unwrap_or(now);
            runtime.sleep_until(end.map_or(next, |end| next.min(end))).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// How many tasks have waiters on this client's listening connection (for tests: waits
    /// that ended must leave none).
    #[doc(hidden)]
    pub fn waited_tasks(&self) -> usize {
        self.inner.router.waiting()
    }

    /// Starts the one listening connection of this client, kept up with backoff.
    fn ensure_listening(&self) {
        let mut listening = self.inner.listening.lock().unwrap_or_else(PoisonError::into_inner);
        if listening.is_some() {
            return;
        }
        let (handle, registration) = AbortHandle::new_pair();
        let (store, router, runtime) =
            (self.inner.store.clone(), self.inner.router.clone(), self.inner.runtime.clone());
        let resilience = store.app().resilience.clone();
        let keep_listening = async move {
            let mut retry = Retry::new(&resilience, 0x5EED);
            loop {
                if let Err(error) = router.run(&store).await {
                    // Waiters still re-read at every wake below, only later than notified.
                    tracing::warn!(target: "canter::client", %error, "result listener failed; listening again");
                }
                // Waiters re-read on every wake: wake them so none sleeps through the outage.
                router.wake_all();
                retry.pause(&*runtime).await;
            }
        };
        self.inner.runtime.spawn(Box::pin(Abortable::new(keep_listening, registration).map(|_| ())));
        *listening = Some(handle);
    }
}

/// A task's future result, typed `T`.
pub struct ResultHandle<R, T> {
    client: Client<R>,
    id: TaskId,
    result: PhantomData<fn() -> T>,
}

impl<R, T> Clone for ResultHandle<R, T> {
    fn clone(&self) -> Self {
        ResultHandle { client: self.client.clone(), id: self.id, result: PhantomData }
    }
}

impl<R, T> std::fmt::Debug for ResultHandle<R, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ResultHandle").field(&self.id).finish()
    }
}

impl<R: Runtime, T: DeserializeOwned> ResultHandle<R, T> {
    /// The task's id.
    pub fn id(&self) -> TaskId {
        self.id
    }

    /// The task as stored now.
    pub async fn status(&self) -> Result<Option<TaskRecord>, ClientError> {
        self.client.get(self.id).await
    }

    /// Waits for the result, at most `timeout`.
    pub async fn wait(&self, timeout: Duration) -> Result<T, ResultError> {
        let record = self.client.wait(self.id, timeout).await?;
        let error =
            || record.error.clone().unwrap_or_else(|| TaskError::new(ErrorCode::TaskError, "no error recorded"));
        match record.state {
            TaskState::Completed => serde_json::from_value(record.result.clone().unwrap_or_default()).map_err(|e| {
                ResultError::Decode(TaskError::new(
                    ErrorCode::ResultDeserializationError,
                    format!("result of task {} did not decode: {e}", self.id),
                ))
            }),
            TaskState::Cancelled => Err(ResultError::Cancelled),
            TaskState::Expired => Err(ResultError::Expired),
            TaskState::Skipped => Err(ResultError::Skipped),
            _ => Err(ResultError::Failed(error())),
        }
    }

    /// Cancels the task if it has not started (see [`AdminRequest::Cancel`]).
    pub async fn cancel(&self) -> Result<Cancelled, ClientError> {
        match self.client.admin(&AdminRequest::Cancel { task: self.id }).await? {
            AdminReply::Cancelled { found } => Ok(found),
            other => Err(ClientError::UnexpectedReply { action: "cancel", reply: format!("{other:?}") }),
        }
    }
}
