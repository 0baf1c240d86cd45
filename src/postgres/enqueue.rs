//! Enqueueing tasks: one, many in one statement, or inside the caller's own transaction.
//!
//! Every enqueue is one statement, whatever the batch size: a plain insert for a batch without
//! keys (over parallel arrays; with scalars for one task; with the arguments the only array for
//! a batch of one kind due now; checking run-at against good-until first when a task has one),
//! `SELECT … FROM <schema>.enqueue(…)` for one with keys (or to check without writing). It
//! sends at most one notification per queue that received a new or updated task (on commit).
//! Checks happen before anything is written and a refused batch writes nothing; a refusal is
//! returned as a value, not raised as an SQL error, so an enqueue inside the caller's
//! transaction never aborts that transaction.
//!
//! What is checked, in task order (the first problem wins, as in the memory store): the
//! rules of [`check_new_task`] (task name, queue name and membership, key, flags, retry
//! policy), one mode per key in a batch ([`BatchKeys`]), arguments PostgreSQL's `jsonb` cannot
//! store (strings with NUL characters), then on the database's clock run-at against
//! good-until, and idempotency keys ([`KeyMode::Idempotent`]): a key that names a task, live
//! or finished, with the same name and arguments gives that task's id and writes no new one;
//! with another name or other arguments it is `PAYLOAD_MISMATCH`. Arguments compare as `jsonb`
//! values (so `1` and `1.0` are the same arguments). Keyed tasks then apply in order, each as
//! its [`KeyMode`] says; enqueuers of one key take turns on an advisory lock of the key, so
//! concurrent enqueuers never make two live tasks of one key.

use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, Row};

use crate::config::AppConfig;
use crate::postgres::replay::{Replay, replay_error_with_unknown_outcome, replayed};
use crate::postgres::schema::PgSchema;
use crate::postgres::sql::{Gated, Stmt};
use crate::postgres::store::{PgStore, db_time, duration};
use crate::store::{BatchKeys, DbTime, EnqueueError, KeyMode, NewTask, RunAt, check_new_task, default_queue};
use crate::task::normalized_flags;
use crate::task::{ErrorCode, TaskId};
use crate::wake::Wakeup;

/// Why an enqueue into PostgreSQL failed. Nothing was written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgEnqueueError {
    /// The task breaks a rule every store checks (see [`EnqueueError`]).
    #[error(transparent)]
    Invalid(#[from] EnqueueError),
    /// The database failed; nothing was written (but see [`PgEnqueueError::OutcomeUnknown`] for
    /// a lost reply, and idempotent enqueues, whose last try's error this is).
    #[error("enqueue failed: {}", super::error_text(.0))]
    Database(#[from] sqlx::Error),
    /// The connection broke after the enqueue was sent, with no reply: it may or may not have
    /// committed. Enqueues with idempotency keys are sent again instead, so only others end
    /// this way.
    #[error(
        "enqueue may or may not have committed: the connection broke before its reply ({}); give tasks idempotency keys to send them again safely",
        super::error_text(.0)
    )]
    OutcomeUnknown(sqlx::Error),
}

impl PgEnqueueError {
    /// The error code callers see: `PAYLOAD_MISMATCH`, `VALIDATION_FAILED`, or `BROKER_ERROR`
    /// for a database failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            PgEnqueueError::Invalid(e) => e.code(),
            PgEnqueueError::Database(_) | PgEnqueueError::OutcomeUnknown(_) => ErrorCode::BrokerError,
        }
    }

    /// Whether the tasks may exist although the call failed ([`PgEnqueueError::OutcomeUnknown`]).
    pub fn may_have_committed(&self) -> bool {
        matches!(self, PgEnqueueError::OutcomeUnknown(_))
    }
}

replay_error_with_unknown_outcome!(PgEnqueueError);

impl PgStore {
    /// Enqueues one task and returns its id (an existing task's id for a known idempotency key
    /// with the same arguments).
    ///
    /// When its connection dies under it, it is sent again on another one if the server said it
    /// did not apply it, or if it has an idempotency key ([`KeyMode::Idempotent`]); otherwise it
    /// fails with [`PgEnqueueError::OutcomeUnknown`].
    pub async fn enqueue(&self, task: NewTask) -> Result<TaskId, PgEnqueueError> {
        only_id(self.enqueue_many(vec![task]).await?)
    }

    /// Enqueues tasks in one statement: all or nothing. Returns one id per task, in order.
    /// A dead connection is handled as [`enqueue`](PgStore::enqueue) says (a batch is sent
    /// again after a lost reply only when every task has an idempotency key).
    ///
    /// It notifies a queue only while a worker of it waits (migration 0014: workers working
    /// through a backlog need no wake-up, and commits that notify queue behind each other).
    pub async fn enqueue_many(&self, tasks: Vec<NewTask>) -> Result<Vec<TaskId>, PgEnqueueError> {
        self.enqueue_replayed(&tasks, Notify::IfWaiting).await
    }

    /// [`enqueue_many`](PgStore::enqueue_many) without the NOTIFY of the tasks' queues, for a
    /// caller that announces them itself once the statement committed (a wake-up provider
    /// such as a message broker): returns the ids and the [`Wakeup`]s to announce. A commit
    /// that sent no NOTIFY does not queue behind other such commits (PostgreSQL's
    /// notification lock). Tasks with keys are enqueued by a function that always notifies.
    pub async fn enqueue_many_unnotified(
        &self,
        tasks: Vec<NewTask>,
    ) -> Result<(Vec<TaskId>, Vec<Wakeup>), PgEnqueueError> {
        let ids = self.enqueue_replayed(&tasks, Notify::Nobody).await?;
        // Checked by the enqueue: only the queue is wanted here.
        let queues = tasks.iter().map(|task| task.queue.as_deref().unwrap_or_else(|| default_queue(self.app())));
        let announced = queues.zip(&tasks).zip(&ids).map(|((queue, task), id)| (queue, task.priority, *id));
        let wakeups = Wakeup::of_tasks(announced);
        Ok((ids, wakeups))
    }

    /// Enqueues `tasks` in one statement, sent again after a lost reply where that is safe.
    async fn enqueue_replayed(&self, tasks: &[NewTask], notify: Notify) -> Result<Vec<TaskId>, PgEnqueueError> {
        // A task with an idempotency key is applied once however often it is sent (other keys
        // deduplicate against live tasks only: the first could have run and finished between).
        let idempotent = |task: &NewTask| task.key.is_some() && task.key_mode == KeyMode::Idempotent;
        let replay = if tasks.iter().all(idempotent) { Replay::Safe } else { Replay::IfNotApplied };
        replayed!(self, replay, |conn| enqueue_tasks(conn, self.schema(), self.app(), tasks, notify))
    }
}

/// Whether an enqueue statement notifies its tasks' queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Notify {
    /// One NOTIFY per queue, sent at commit (an enqueue inside the caller's transaction).
    Queues,
    /// One per queue that a worker is marked waiting on: a statement in its own transaction
    /// (see [`Gated`]).
    IfWaiting,
    /// None: the caller announces the tasks after the commit.
    Nobody,
}

impl Notify {
    /// The form of `statement` to send: only a statement in its own transaction may read the
    /// waiting marks (it holds their lock until it commits, and a mark waits for it).
    fn form(self, statement: &Gated) -> &Stmt {
        match self {
            Notify::IfWaiting => &statement.if_waiting,
            Notify::Queues | Notify::Nobody => &statement.always,
        }
    }
}

/// Enqueues one task with `executor`: a pool, a connection, or the caller's open transaction
/// (the task then becomes visible, and its notification is sent, when that transaction
/// commits).
pub async fn enqueue_in<'e, E: PgExecutor<'e>>(
    executor: E,
    schema: &PgSchema,
    app: &AppConfig,
    task: NewTask,
) -> Result<TaskId, PgEnqueueError> {
    only_id(enqueue_many_in(executor, schema, app, vec![task]).await?)
}

/// The id of a one-task enqueue.
pub(crate) fn only_id(ids: Vec<TaskId>) -> Result<TaskId, PgEnqueueError> {
    ids.into_iter().next().ok_or_else(|| sqlx::Error::Protocol("enqueue returned no id".into()).into())
}

/// Enqueues tasks in one statement with `executor` (see [`enqueue_in`]): every task is checked
/// before any is written, and on a refusal nothing is. Returns one id per task, in order.
pub async fn enqueue_many_in<'e, E: PgExecutor<'e>>(
    executor: E,
    schema: &PgSchema,
    app: &AppConfig,
    tasks: Vec<NewTask>,
) -> Result<Vec<TaskId>, PgEnqueueError> {
    enqueue_tasks(executor, schema, app, &tasks, Notify::Queues).await
}

/// [`enqueue_many_in`] of borrowed tasks (so that a retry can send them again).
async fn enqueue_tasks<'e, E: PgExecutor<'e>>(
    executor: E,
    schema: &PgSchema,
    app: &AppConfig,
    tasks: &[NewTask],
    notify: Notify,
) -> Result<Vec<TaskId>, PgEnqueueError> {
    // The channel prefix; NULL makes a keyless statement notify nobody.
    let prefix = (notify != Notify::Nobody).then(|| schema.queue_channel_prefix());
    // The checks that need no clock, in order. The database checks the tasks before the first
    // refused one (without writing), so a problem it finds earlier in the batch still wins.
    let mut queues = Vec::with_capacity(tasks.len());
    let mut refused = None;
    let mut batch_keys = BatchKeys::default();
    for (index, task) in tasks.iter().enumerate() {
        // With the earliest possible `now`, only run-at times given as instants are compared
        // here; the database compares the rest with its own clock.
        let checked = check_new_task(app, task, DbTime(i64::MIN))
            .and_then(|queue| batch_keys.check(index, task).map(|()| queue))
            .map_err(PgEnqueueError::from);
        match checked {
            Ok(queue) => queues.push(queue),
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let write = refused.is_none();
    let tasks = &tasks[..queues.len()];
    if tasks.is_empty() {
        return match refused {
            Some(e) => Err(e),
            None => Ok(Vec::new()),
        };
    }

    let n = tasks.len();
    if write && of_one_kind_due_now(tasks, &queues) {
        let first = &tasks[0];
        if n == 1 {
            let id: i64 = notify
                .form(&schema.sql().enqueue_one_now)
                .query_scalar()
                .bind(first.name.as_str())
                .bind(queues[0])
                .bind(first.priority)
                .bind(&first.args)
                .bind(&prefix)
                .fetch_one(executor)
                .await?;
            return Ok(vec![TaskId(id)]);
        }
        let rows = notify
            .form(&schema.sql().enqueue_uniform)
            .query()
            .bind(first.name.as_str())
            .bind(queues[0])
            .bind(first.priority)
            .bind(tasks.iter().map(|task| &task.args).collect::<Vec<_>>())
            .bind(&prefix)
            .fetch_all(executor)
            .await?;
        return ids_in_task_order(&rows, n);
    }
    let mut names = Vec::with_capacity(n);
    let mut args = Vec::with_capacity(n);
    let mut priorities = Vec::with_capacity(n);
    let mut delays: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut ats: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut good_until: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut retries = Vec::with_capacity(n);
    let mut keys: Vec<Option<&str>> = Vec::with_capacity(n);
    let mut modes: Vec<&str> = Vec::with_capacity(n);
    let mut flags: Vec<Option<String>> = Vec::with_capacity(n);
    for task in tasks {
        names.push(task.name.as_str());
        args.push(&task.args);
        priorities.push(task.priority);
        let (delay, at) = match task.run_at {
            RunAt::Now => (None, None),
            RunAt::DelayMs(ms) => (Some(duration(ms)), None),
            RunAt::At(at) => (None, Some(db_time(at))),
        };
        delays.push(delay);
        ats.push(at);
        good_until.push(task.good_until.map(db_time));
        // No policy of its own: NULL, the app's policy where it is claimed.
        let policy = task.retry.as_ref().map(serde_json::to_value).transpose();
        retries.push(policy.map_err(|e| sqlx::Error::Encode(Box::new(e)))?);
        keys.push(task.key.as_deref());
        modes.push(task.key_mode.as_str());
        // Flags hold no comma (`is_valid_flag`): one string per task, split in SQL.
        flags.push((!task.flags.is_empty()).then(|| normalized_flags(&task.flags).join(",")));
    }
    let keyed = keys.iter().any(Option::is_some);
    if write && !keyed && good_until.iter().all(Option::is_none) && n == 1 {
        // Nothing left to check, one task with a run-at, retry policy or flags: the plain
        // insert of one row.
        let id: i64 = notify
            .form(&schema.sql().enqueue_one)
            .query_scalar()
            .bind(names[0])
            .bind(queues[0])
            .bind(priorities[0])
            .bind(args[0])
            .bind(delays[0])
            .bind(ats[0])
            .bind(&retries[0])
            .bind(&flags[0])
            .bind(&prefix)
            .fetch_one(executor)
            .await?;
        return Ok(vec![TaskId(id)]);
    }
    if write && !keyed && good_until.iter().all(Option::is_none) {
        // Nothing left to check: the plain insert.
        let rows = notify
            .form(&schema.sql().enqueue_plain)
            .query()
            .bind(names)
            .bind(&queues)
            .bind(priorities)
            .bind(args)
            .bind(delays)
            .bind(ats)
            .bind(retries)
            .bind(flags)
            .bind(&prefix)
            .fetch_all(executor)
            .await?;
        return ids_in_task_order(&rows, n);
    }
    let query =
        if write && !keyed { notify.form(&schema.sql().enqueue_keyless).query() } else { schema.sql().enqueue.query() };
    let query = query
        .bind(names)
        .bind(args)
        .bind(&queues)
        .bind(priorities)
        .bind(delays)
        .bind(ats)
        .bind(good_until)
        .bind(retries);
    let query = if write && !keyed {
        query.bind(flags).bind(&prefix)
    } else {
        query
            .bind(keys)
            .bind(modes)
            .bind(flags)
            .bind(write)
            .bind(schema.queue_channel_prefix())
            .bind(schema.key_lock_prefix())
    };
    let rows = query.fetch_all(executor).await?;

    let mut ids = Vec::with_capacity(n);
    for row in rows {
        if let Some(problem) = row.try_get::<Option<String>, _>("problem")? {
            let ord: i64 = row.try_get("ord")?;
            let index = usize::try_from(ord - 1).unwrap_or(0).min(n - 1);
            let error = match problem.as_str() {
                "run_at_after_good_until" => EnqueueError::RunAtAfterGoodUntil {
                    run_at: row.try_get::<Option<i64>, _>("run_at_ms")?.unwrap_or_default(),
                    good_until: row.try_get::<Option<i64>, _>("good_until_ms")?.unwrap_or_default(),
                },
                _ => EnqueueError::PayloadMismatch {
                    key: tasks[index].key.clone().unwrap_or_default(),
                    existing: TaskId(row.try_get::<Option<i64>, _>("detail_id")?.unwrap_or_default()),
                },
            };
            return Err(error.into());
        }
        ids.push(TaskId(row.try_get("id")?));
    }
    match refused {
        Some(e) => Err(e),
        None if ids.len() == n => Ok(ids),
        None => Err(sqlx::Error::Protocol(format!("enqueue returned {} ids for {n} tasks", ids.len())).into()),
    }
}

/// Whether every task is of the first's kind (name, queue, priority), due now, with no key,
/// good-until time, retry policy or flags: the batch the uniform insert writes.
fn of_one_kind_due_now(tasks: &[NewTask], queues: &[&str]) -> bool {
    let first = &tasks[0];
    tasks.iter().zip(queues).all(|(task, queue)| {
        task.name == first.name
            && *queue == queues[0]
            && task.priority == first.priority
            && matches!(task.run_at, RunAt::Now)
            && task.key.is_none()
            && task.good_until.is_none()
            && task.retry.is_none()
            && task.flags.is_empty()
    })
}

/// The ids an insert returned, one per task, in task order: the insert draws them from the
/// sequence in array order, so sorting restores it.
fn ids_in_task_order(rows: &[PgRow], n: usize) -> Result<Vec<TaskId>, PgEnqueueError> {
    let mut ids = rows.iter().map(|row| row.try_get::<i64, _>(0).map(TaskId)).collect::<Result<Vec<_>, _>>()?;
    if ids.len() != n {
        return Err(sqlx::Error::Protocol(format!("enqueue returned {} ids for {n} tasks", ids.len())).into());
    }
    ids.sort_unstable();
    Ok(ids)
}
