//! Inspection on PostgreSQL: tasks, runs, counts, workers and paused queues.

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::postgres::replay::{Replay, replayed};
use crate::postgres::store::{PgStore, count, db_time, json, leniently, parse_state};
use crate::store::{AttemptRecord, DbTime, TaskRecord, WorkerInfo};
use crate::store::{FinishedCount, PausedQueue, QueueDepth, TaskFilter, WorkerLoad, WorkerRecord};
use crate::task::{Attempt, TaskId, TaskState, WorkerId};

/// A row of the attempts history: task, attempt, worker, outcome, error, finished at.
type AttemptRow = (i64, i32, Option<String>, String, Option<Value>, i64);

impl PgStore {
    /// The task with this id, live or finished.
    pub async fn get(&self, id: TaskId) -> Result<Option<TaskRecord>, sqlx::Error> {
        let row =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().get.query().bind(id.0).fetch_optional(conn))?;
        row.map(|row| record(&row)).transpose()
    }

    /// The attempts history of a task, oldest first (empty for an unknown id).
    pub async fn attempts(&self, id: TaskId) -> Result<Vec<AttemptRecord>, sqlx::Error> {
        let rows: Vec<AttemptRow> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().attempts.query_as().bind(id.0).fetch_all(conn))?;
        rows.into_iter()
            .map(|(task, attempt, worker, outcome, error, finished_at)| {
                Ok(AttemptRecord {
                    task: TaskId(task),
                    attempt: Attempt(count(attempt)),
                    worker: worker.map(WorkerId),
                    outcome: parse_state(&outcome)?,
                    error: error.map(json).transpose()?,
                    finished_at: DbTime(finished_at),
                })
            })
            .collect()
    }

    /// The tasks `filter` selects, live and finished together, in its order.
    pub async fn list(&self, filter: &TaskFilter) -> Result<Vec<TaskRecord>, sqlx::Error> {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let limit = filter.limit.map_or(i64::MAX, count);
        let offset = count(filter.offset);
        let sql = self.schema().sql();
        let statement = if filter.newest_first { &sql.list_newest } else { &sql.list };
        let rows = replayed!(self, Replay::Safe, |conn| statement
            .query()
            .bind(filter.queue.as_deref())
            .bind(filter.state.map(TaskState::as_str))
            .bind(limit)
            .bind(filter.name.as_deref())
            .bind(filter.after.map(|id| id.0))
            // Each table's part holds the page and what the offset skips.
            .bind(limit.saturating_add(offset))
            .bind(offset)
            .bind(filter.enqueued_from.map(|t| t.0))
            .bind(filter.enqueued_before.map(|t| t.0))
            .fetch_all(conn))?;
        rows.iter().map(record).collect()
    }

    /// How many tasks each queue has in each state (pairs with none are left out).
    pub async fn counts(&self) -> Result<BTreeMap<(String, TaskState), u64>, sqlx::Error> {
        let rows: Vec<(String, String, i64)> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().counts.query_as().fetch_all(conn))?;
        let mut counts = BTreeMap::new();
        for (queue, state, n) in rows {
            *counts.entry((queue, parse_state(&state)?)).or_insert(0) += u64::try_from(n).unwrap_or(0);
        }
        Ok(counts)
    }

    /// Each queue with live tasks, by name, with how many it holds in each live state on the
    /// database's clock (see [`QueueDepth`]): one statement over the live table only.
    pub async fn queue_depths(&self) -> Result<Vec<QueueDepth>, sqlx::Error> {
        let rows: Vec<(String, i64, i64, i64, i64, Option<i64>)> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().queue_depths.query_as().fetch_all(conn))?;
        let n = |count: i64| u64::try_from(count).unwrap_or(0);
        Ok(rows
            .into_iter()
            .map(|(queue, due, scheduled, claimed, running, oldest_due)| QueueDepth {
                queue,
                due: n(due),
                scheduled: n(scheduled),
                claimed: n(claimed),
                running: n(running),
                oldest_due: oldest_due.map(DbTime),
            })
            .collect())
    }

    /// How many tasks reached each terminal state in [`from`, `to`), by queue: the block
    /// ranges of that span of the finished table only (its BRIN index), however long its
    /// history. A task whose finishing transaction commits after the read, with a
    /// `finished_at` inside the span, is not counted: read a span that ended a moment ago.
    pub async fn finished_counts(&self, from: DbTime, to: DbTime) -> Result<Vec<FinishedCount>, sqlx::Error> {
        let rows: Vec<(String, String, i64)> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .finished_counts
            .query_as()
            .bind(db_time(from))
            .bind(db_time(to))
            .fetch_all(conn))?;
        rows.into_iter()
            .map(|(queue, state, n)| {
                Ok(FinishedCount { queue, state: parse_state(&state)?, tasks: u64::try_from(n).unwrap_or(0) })
            })
            .collect()
    }

    /// What each worker holds now, by worker id (workers holding nothing left out).
    pub async fn worker_loads(&self) -> Result<Vec<WorkerLoad>, sqlx::Error> {
        let rows: Vec<(String, i64, i64)> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().worker_loads.query_as().fetch_all(conn))?;
        let n = |count: i64| u64::try_from(count).unwrap_or(0);
        Ok(rows
            .into_iter()
            .map(|(worker, claimed, running)| WorkerLoad {
                worker: WorkerId(worker),
                claimed: n(claimed),
                running: n(running),
            })
            .collect())
    }

    /// The worker registry, by worker id.
    pub async fn workers(&self) -> Result<Vec<WorkerRecord>, sqlx::Error> {
        let rows: Vec<(String, Vec<String>, i32, i64, bool)> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().workers.query_as().fetch_all(conn))?;
        Ok(rows
            .into_iter()
            .map(|(id, queues, concurrency, last_seen, stopped)| WorkerRecord {
                info: WorkerInfo { worker: WorkerId(id), queues, concurrency: count(concurrency) },
                last_seen: DbTime(last_seen),
                stopped,
            })
            .collect())
    }

    /// Of `workers`, those whose liveness token is recorded (in this server's incarnation),
    /// each with whether a session holds it: `true` is a worker whose session lives, `false`
    /// one whose session ended (a dead process). A worker not in the map has no token to tell
    /// by (recovery of dead workers off, or registered before the server restarted); its last
    /// heartbeat is all there is.
    pub async fn liveness_tokens(&self, workers: &[WorkerId]) -> Result<BTreeMap<WorkerId, bool>, sqlx::Error> {
        let ids: Vec<&str> = workers.iter().map(|w| w.0.as_str()).collect();
        let prefix = self.schema().liveness_lock_prefix();
        let rows: Vec<(String, bool)> = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .liveness_tokens
            .query_as()
            .bind(&prefix)
            .bind(&ids)
            .fetch_all(conn))?;
        Ok(rows.into_iter().map(|(id, held)| (WorkerId(id), held)).collect())
    }

    /// The paused queues, by name.
    pub async fn paused_queues(&self) -> Result<Vec<PausedQueue>, sqlx::Error> {
        let rows: Vec<(String, i64)> =
            replayed!(self, Replay::Safe, |conn| self.schema().sql().paused_queues.query_as().fetch_all(conn))?;
        Ok(rows.into_iter().map(|(queue, at)| PausedQueue { queue, paused_at: DbTime(at) }).collect())
    }
}

/// A [`TaskRecord`] from a row of the `get`/`list` statements.
fn record(row: &PgRow) -> Result<TaskRecord, sqlx::Error> {
    let state = parse_state(row.try_get("state")?)?;
    let held = matches!(state, TaskState::Claimed | TaskState::Running);
    let claimed_by: Option<String> = row.try_get("claimed_by")?;
    // One row whose arguments cannot be read fails neither a listing nor a wait.
    let (args, args_error) = match leniently::<Value>(row, "args")? {
        Ok(args) => (args, None),
        Err(problem) => (Value::Null, Some(problem)),
    };
    Ok(TaskRecord {
        id: TaskId(row.try_get("id")?),
        name: row.try_get("name")?,
        queue: row.try_get("queue")?,
        state,
        priority: row.try_get("priority")?,
        args,
        args_error,
        attempts: count(row.try_get("attempts")?),
        retries: count(row.try_get("retries")?),
        enqueued_at: DbTime(row.try_get("enqueued_at")?),
        run_at: DbTime(row.try_get("run_at")?),
        good_until: row.try_get::<Option<i64>, _>("good_until")?.map(DbTime),
        finished_at: row.try_get::<Option<i64>, _>("finished_at")?.map(DbTime),
        worker: if held { claimed_by.map(WorkerId) } else { None },
        result: row.try_get("result")?,
        error: row.try_get::<Option<Value>, _>("error")?.map(json).transpose()?,
        key: row.try_get("key")?,
        flags: row.try_get::<Option<Vec<String>>, _>("flags")?.unwrap_or_default(),
    })
}
