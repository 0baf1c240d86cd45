//! The worker protocol on PostgreSQL: each [`DbRequest`] as one round trip (a statement or a
//! function), its failures mapped to [`DbFailure`].

use serde_json::Value;
use sqlx::{Acquire, PgConnection, Row};

use crate::backoff;
use crate::budget::ClaimPolicy;
use crate::config::RetryPolicy;
use crate::postgres::replay::{Replay, ReplayError, in_own_transaction, replayed};
use crate::postgres::schema::PgSchema;
use crate::rng::mix;
use crate::store::{ClaimedTask, Completion, DbFailure, DbReply, DbRequest, DbTime, FinishOutcome, ReapReport};
use crate::store::{TASK_EXPIRED_MESSAGE, WORKER_CRASHED_MESSAGE};
use crate::task::{Attempt, ErrorCode, Lease, TaskError, TaskId, WorkerId};

use crate::postgres::store::*;

/// The longest stale threshold a waiting mark's request is taken with: a hundred years.
const STALE_MS_MAX: i64 = 3_153_600_000_000;

impl PgStore {
    /// Runs one request of the worker machine and returns its reply, with the semantics
    /// [`DbRequest`] documents. See the module docs for how failures map.
    pub async fn execute(&self, request: &DbRequest) -> Result<DbReply, DbFailure> {
        // Sent again on another connection when its session ended before it was applied (see
        // `replay`): a terminated backend is not an outage. A lost reply is `Unknown`, which the
        // machine resolves with its fencing.
        // VACUUM refuses to run in a transaction; a purge runs each batch in its own.
        let own_transaction = !matches!(request, DbRequest::Vacuum { .. } | DbRequest::Purge { .. });
        let lane = if request.is_urgent_claim() { Lane::Urgent } else { Lane::Shared };
        let reply: Result<DbReply, RequestError> = replayed!(@lane lane, @transaction own_transaction, self, Replay::IfNotApplied, |conn| async {
            self.run(conn, request).await.map_err(RequestError::Sent)
        });
        reply.map_err(|error| match error {
            RequestError::Unsent(e) => DbFailure::Unavailable(e.to_string()),
            RequestError::Sent(e) => failure(e),
        })
    }

    async fn run(&self, conn: &mut PgConnection, request: &DbRequest) -> Result<DbReply, sqlx::Error> {
        let sql = self.schema.sql();
        match request {
            DbRequest::Claim { worker, token, policy, my_running, my_claimed, start_now, lease_ms } => {
                let claim = ClaimArgs::new(&self.schema, policy, *my_running, *my_claimed);
                let query = claim.bind(sql.claim.query(), worker, *token, *start_now, *lease_ms);
                let rows = query.fetch_all(&mut *conn).await?;
                self.claimed_from(&rows)
            }
            DbRequest::FinishAndClaim {
                worker,
                completions,
                token,
                policy,
                my_running,
                my_claimed,
                start_now,
                lease_ms,
            } => {
                let finish = FinishArgs::new(completions)?;
                let claim = ClaimArgs::new(&self.schema, policy, *my_running, *my_claimed);
                let query = self.bind_finish(sql.finish_and_claim.query(), worker, finish);
                let rows = claim.bind(query, worker, *token, *start_now, *lease_ms).fetch_all(&mut *conn).await?;
                let split = rows.iter().position(|row| row.try_get::<i32, _>("part").is_ok_and(|part| part == 1));
                let (finished, claimed) = rows.split_at(split.unwrap_or(rows.len()));
                let mut answers = Vec::with_capacity(finished.len());
                for row in finished {
                    answers.push((row.try_get("id")?, row.try_get("state")?));
                }
                let (finished, claimed) = (finished_from(answers)?, self.claimed_from(claimed)?);
                DbReply::finished_and_claimed(finished, claimed)
                    .ok_or_else(|| sqlx::Error::Protocol("a finish and a claim answered as something else".into()))
            }
            DbRequest::Start { worker, tasks, policy } => {
                let (ids, leases) = split(tasks);
                // Soft-cap mode re-checks queue caps at start, under the claim's queue locks.
                let capped: Vec<(&str, i32)> = if policy.hard_cap_mode() {
                    Vec::new()
                } else {
                    policy.queues.iter().filter_map(|q| Some((q.name.as_str(), int(q.max_concurrency?)))).collect()
                };
                let mut keys: Vec<i64> = capped.iter().map(|(q, _)| self.schema.queue_lock_key(q)).collect();
                keys.sort_unstable();
                keys.dedup();
                let rows = sql
                    .start
                    .query()
                    .bind(&worker.0)
                    .bind(ids)
                    .bind(leases)
                    .bind(capped.iter().map(|(q, _)| *q).collect::<Vec<_>>())
                    .bind(capped.iter().map(|(_, c)| *c).collect::<Vec<_>>())
                    .bind(keys)
                    .bind(self.schema.done_channel())
                    .bind(error_json(&TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE))?)
                    .fetch_all(&mut *conn)
                    .await?;
                let (mut started, mut expired, mut deferred, mut lost) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for row in rows {
                    let id = TaskId(row.try_get("id")?);
                    match row.try_get::<&str, _>("outcome")? {
                        "started" => {
                            let attempt: Option<i32> = row.try_get("attempt")?;
                            started.push((id, Attempt(count(attempt.unwrap_or(0)))));
                        }
                        "expired" => expired.push(id),
                        "deferred" => deferred.push(id),
                        _ => lost.push(id),
                    }
                }
                Ok(DbReply::Started { started, expired, deferred, lost })
            }
            DbRequest::RecordStarts { worker, tasks } => {
                let (ids, leases) = split(tasks);
                let rows: Vec<(i64, Option<i32>)> =
                    sql.record_starts.query_as().bind(&worker.0).bind(ids).bind(leases).fetch_all(&mut *conn).await?;
                let (mut started, mut lost) = (Vec::new(), Vec::new());
                for (id, attempt) in rows {
                    match attempt {
                        Some(attempt) => started.push((TaskId(id), Attempt(count(attempt)))),
                        None => lost.push(TaskId(id)),
                    }
                }
                Ok(DbReply::Started { started, expired: Vec::new(), deferred: Vec::new(), lost })
            }
            DbRequest::Finish { worker, completions } => self.finish(conn, worker, completions).await,
            DbRequest::Heartbeat { worker, claimed, running, lease_ms, max_renew_age_ms, abandoned } => {
                let (claimed_ids, claimed_leases) = split(claimed);
                let (running_ids, running_leases) = split(running);
                let abandoned: Vec<i64> = abandoned.iter().map(|&token| token as i64).collect();
                let rows: Vec<(i64, String)> = sql
                    .heartbeat
                    .query_as()
                    .bind(&worker.0)
                    .bind(claimed_ids)
                    .bind(claimed_leases)
                    .bind(running_ids)
                    .bind(running_leases)
                    .bind(duration(*lease_ms))
                    .bind(duration(*max_renew_age_ms))
                    .bind(abandoned)
                    .bind(self.schema.queue_channel_prefix())
                    .fetch_all(&mut *conn)
                    .await?;
                let (mut lost, mut busy, mut handed_back) = (Vec::new(), Vec::new(), Vec::new());
                for (id, what) in rows {
                    match what.as_str() {
                        "busy" => busy.push(TaskId(id)),
                        "handed_back" => handed_back.push(TaskId(id)),
                        _ => lost.push(TaskId(id)),
                    }
                }
                Ok(DbReply::Heartbeat { lost, busy, handed_back })
            }
            DbRequest::Release { worker, tasks } => {
                let (ids, leases) = split(tasks);
                let rows: Vec<(i64, bool)> = sql
                    .release
                    .query_as()
                    .bind(&worker.0)
                    .bind(ids)
                    .bind(leases)
                    .bind(self.schema.queue_channel_prefix())
                    .fetch_all(&mut *conn)
                    .await?;
                let (mut released, mut lost) = (Vec::new(), Vec::new());
                for (id, ok) in rows {
                    if ok { released.push(TaskId(id)) } else { lost.push(TaskId(id)) }
                }
                Ok(DbReply::Released { released, lost })
            }
            DbRequest::AbandonClaim { worker, token } => {
                let released: Vec<i64> = sql
                    .abandon
                    .query_scalar()
                    .bind(&worker.0)
                    .bind(*token as i64)
                    .bind(self.schema.queue_channel_prefix())
                    .fetch_all(&mut *conn)
                    .await?;
                Ok(DbReply::Released { released: released.into_iter().map(TaskId).collect(), lost: Vec::new() })
            }
            DbRequest::Reap { worker: _, claimed_stale_ms, running_stale_ms, entropy } => {
                self.reap(conn, *claimed_stale_ms, *running_stale_ms, *entropy).await.map(DbReply::Reaped)
            }
            DbRequest::ReapDead { worker: _, grace_ms, entropy } => {
                self.reap_dead(conn, *grace_ms, *entropy).await.map(DbReply::Reaped)
            }
            DbRequest::Purge { older_than_ms, batch } => {
                Ok(DbReply::Purged { tasks: self.purge_on(conn, *older_than_ms, *batch).await? })
            }
            DbRequest::Vacuum { min_dead_rows } => {
                Ok(DbReply::Vacuumed { tables: self.vacuum_on(conn, *min_dead_rows).await? })
            }
            DbRequest::RegisterWorker(info) => {
                sql.register_worker
                    .query()
                    .bind(&info.worker.0)
                    .bind(&info.queues)
                    .bind(int(info.concurrency))
                    .execute(&mut *conn)
                    .await?;
                Ok(DbReply::Done)
            }
            DbRequest::DeregisterWorker(worker) => {
                let none: &[String] = &[];
                let unmark = sql.unmark_waiting.query().bind(&worker.0).bind(none).bind(None::<i16>).bind(None::<i64>);
                unmark.execute(&mut *conn).await?;
                sql.deregister_worker.query().bind(&worker.0).execute(&mut *conn).await?;
                Ok(DbReply::Done)
            }
            DbRequest::SetWaiting { worker, queues, waiting, urgent_below, stale_ms } => {
                // An interval of more than a century would overflow; no registry keeps one.
                let stale_ms = i64::try_from(*stale_ms).unwrap_or(i64::MAX).min(STALE_MS_MAX);
                let written = if *waiting {
                    sql.mark_waiting
                        .query_scalar::<bool>()
                        .bind(&worker.0)
                        .bind(queues)
                        .bind(stale_ms)
                        .fetch_one(&mut *conn)
                        .await?
                } else {
                    let unmark = sql.unmark_waiting.query().bind(&worker.0).bind(queues).bind(urgent_below);
                    unmark.bind(stale_ms).execute(&mut *conn).await?;
                    false
                };
                Ok(DbReply::WaitingSet { written })
            }
        }
    }

    async fn finish(
        &self,
        conn: &mut PgConnection,
        worker: &WorkerId,
        completions: &[Completion],
    ) -> Result<DbReply, sqlx::Error> {
        let query = self.bind_finish(self.schema.sql().finish.query(), worker, FinishArgs::new(completions)?);
        let rows = query.fetch_all(&mut *conn).await?;
        let mut answers = Vec::with_capacity(rows.len());
        for row in &rows {
            answers.push((row.try_get("id")?, row.try_get("state")?));
        }
        finished_from(answers)
    }

    /// A finish's parameters, `$1` to `$10`, bound to `query`.
    fn bind_finish<'q>(&self, query: PgQuery<'q>, worker: &'q WorkerId, args: FinishArgs<'q>) -> PgQuery<'q> {
        query
            .bind(&worker.0)
            .bind(args.ids)
            .bind(args.leases)
            .bind(args.kinds)
            .bind(args.results)
            .bind(args.errors)
            .bind(args.delays)
            .bind(self.schema.done_channel())
            .bind(self.schema.queue_channel_prefix())
            .bind(args.new_args)
    }

    /// The [`DbReply::Claimed`] of a claim's rows (the last row, with no id, carries `more`
    /// and the wake-up hint).
    fn claimed_from(&self, rows: &[sqlx::postgres::PgRow]) -> Result<DbReply, sqlx::Error> {
        let mut tasks = Vec::with_capacity(rows.len().saturating_sub(1));
        let (mut more, mut next_run_in_ms) = (false, None);
        for row in rows {
            let Some(id) = row.try_get::<Option<i64>, _>("id")? else {
                more = row.try_get("more")?;
                next_run_in_ms = row.try_get::<Option<i64>, _>("next_run_in_ms")?.map(|ms| ms.max(0) as u64);
                continue;
            };
            // A stored value one row cannot decode fails that task alone (the worker fails it
            // without running it, or runs it under the app's policy), never the reply.
            let (args, args_error) = match leniently::<Value>(row, "args")? {
                Ok(args) => (args, None),
                Err(problem) => (Value::Null, Some(problem)),
            };
            let (retry, retry_error) = self.stored_policy(row)?;
            tasks.push(ClaimedTask {
                id: TaskId(id),
                lease: Lease(row.try_get("lease")?),
                name: row.try_get("name")?,
                queue: row.try_get("queue")?,
                args,
                priority: row.try_get("priority")?,
                enqueued_at: DbTime(row.try_get("enqueued_at_ms")?),
                run_at: DbTime(row.try_get("run_at_ms")?),
                started: row.try_get("started")?,
                attempt: Attempt(count(row.try_get("attempt")?)),
                retries: count(row.try_get("retries")?),
                retry,
                expires: row.try_get("expires")?,
                args_error,
                retry_error,
            });
        }
        Ok(DbReply::Claimed { tasks, more, next_run_in_ms })
    }

    /// Purges finished tasks on `conn`, `batch` per statement (each its own transaction),
    /// until a batch comes back short; see [`AdminRequest::Purge`](crate::store::AdminRequest::Purge).
    pub(crate) async fn purge_on(
        &self,
        conn: &mut PgConnection,
        retention_ms: u64,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let batch = i64::from(batch.max(1));
        let mut total = 0u64;
        loop {
            // Each batch its own transaction (through a pooler too): locks and snapshot held
            // for one batch, and a failed batch undoes only itself.
            let pooled = self.schema.is_transaction_pooled();
            let n: i64 = in_own_transaction!(pooled, &mut *conn, |conn| self
                .schema
                .sql()
                .purge_finished
                .query_scalar()
                .bind(duration(retention_ms))
                .bind(batch)
                .bind(self.app.recovery.idempotency_retention_ms.map(duration))
                .fetch_one(conn))?;
            total = total.saturating_add(u64::try_from(n).unwrap_or(0));
            if n < batch {
                return Ok(total);
            }
        }
    }

    /// One reaper pass in one transaction, if this process wins the reaper's lock; otherwise
    /// another reaper is acting and the report says it skipped.
    async fn reap(
        &self,
        conn: &mut PgConnection,
        claimed_stale_ms: Option<u64>,
        running_stale_ms: Option<u64>,
        entropy: u64,
    ) -> Result<ReapReport, sqlx::Error> {
        let sql = self.schema.sql();
        let mut report = ReapReport::default();
        let mut tx = conn.begin().await?;
        let ours: Option<bool> = sql.reap_lock.query_scalar().fetch_optional(&mut *tx).await?;
        if ours.is_none() {
            tx.rollback().await?;
            report.skipped = true;
            return Ok(report);
        }
        if claimed_stale_ms.is_some() {
            report.requeued = self.requeue_claims(&mut tx, claimed_stale_ms, &[]).await?;
        }
        if running_stale_ms.is_some() {
            self.crash_runs(&mut tx, running_stale_ms, &[], entropy, &mut report).await?;
        }
        let error = error_json(&TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE))?;
        let expired: Vec<i64> =
            sql.reap_expire.query_scalar().bind(error).bind(self.schema.done_channel()).fetch_all(&mut *tx).await?;
        report.expired = expired.into_iter().map(TaskId).collect();
        let pruned: i64 = sql
            .prune_workers
            .query_scalar()
            .bind(duration(self.app.recovery.worker_retention_ms))
            .fetch_one(&mut *tx)
            .await?;
        report.workers_pruned = u64::try_from(pruned).unwrap_or(0);
        tx.commit().await?;
        Ok(report)
    }

    /// [`DbRequest::ReapDead`] in one transaction: the workers whose token it can take (and
    /// holds until it commits, so no other reaper acts on them), then their tasks.
    async fn reap_dead(&self, conn: &mut PgConnection, grace_ms: u64, entropy: u64) -> Result<ReapReport, sqlx::Error> {
        let sql = self.schema.sql();
        let mut report = ReapReport::default();
        let mut tx = conn.begin().await?;
        let dead: Vec<String> = sql
            .reap_dead_find
            .query_scalar()
            .bind(self.schema.liveness_lock_prefix())
            .bind(duration(grace_ms))
            .fetch_all(&mut *tx)
            .await?;
        if !dead.is_empty() {
            report.requeued = self.requeue_claims(&mut tx, None, &dead).await?;
            self.crash_runs(&mut tx, None, &dead, entropy, &mut report).await?;
            sql.reap_dead_forget.query().bind(&dead).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        report.dead_workers = dead.into_iter().map(WorkerId).collect();
        Ok(report)
    }

    /// Claims with no heartbeat for `stale_ms`, and those of the workers `dead`, back to
    /// Pending.
    async fn requeue_claims(
        &self,
        tx: &mut PgConnection,
        stale_ms: Option<u64>,
        dead: &[String],
    ) -> Result<Vec<TaskId>, sqlx::Error> {
        let ids: Vec<i64> = self
            .schema
            .sql()
            .reap_claimed
            .query_scalar()
            .bind(stale_ms.map(duration))
            .bind(self.schema.queue_channel_prefix())
            .bind(dead)
            .fetch_all(&mut *tx)
            .await?;
        Ok(ids.into_iter().map(TaskId).collect())
    }

    /// Runs with no heartbeat for `stale_ms`, and those of the workers `dead`, retried or failed
    /// with `WORKER_CRASHED` ([`backoff::crash_retry_delay`]), into `report`.
    async fn crash_runs(
        &self,
        tx: &mut PgConnection,
        stale_ms: Option<u64>,
        dead: &[String],
        entropy: u64,
        report: &mut ReapReport,
    ) -> Result<(), sqlx::Error> {
        let sql = self.schema.sql();
        let stale = sql.reap_running_select.query().bind(stale_ms.map(duration)).bind(dead).fetch_all(&mut *tx).await?;
        if stale.is_empty() {
            return Ok(());
        }
        let crash_retries = self.app.recovery.crash_retries;
        let mut ids = Vec::with_capacity(stale.len());
        let mut delays = Vec::with_capacity(stale.len());
        let mut may_retry = Vec::with_capacity(stale.len());
        for row in stale {
            let id: i64 = row.try_get("id")?;
            // The policy its worker ran it under: the one it stores, else the app's.
            let (policy, _) = self.stored_policy(&row)?;
            let retries = count(row.try_get("retries")?);
            let delay = backoff::crash_retry_delay(&policy, retries, crash_retries, mix(entropy ^ id as u64));
            ids.push(id);
            delays.push(duration(delay.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))));
            may_retry.push(delay.is_some());
        }
        let error = error_json(&TaskError::new(ErrorCode::WorkerCrashed, WORKER_CRASHED_MESSAGE))?;
        let rows: Vec<(i64, String)> = sql
            .reap_running_apply
            .query_as()
            .bind(ids)
            .bind(delays)
            .bind(may_retry)
            .bind(error)
            .bind(self.schema.done_channel())
            .bind(self.schema.queue_channel_prefix())
            .fetch_all(&mut *tx)
            .await?;
        for (id, state) in rows {
            if state == "PENDING" { report.retried.push(TaskId(id)) } else { report.failed.push(TaskId(id)) }
        }
        Ok(())
    }

    /// Takes `worker`'s liveness token for the session of `connection` and records it for this
    /// server incarnation (`recovery.auto_recover_dead_workers`): `false` when another session
    /// holds it. The token is held for as long as that session lives: keep the connection open,
    /// idle, for the worker's lifetime (the drivers do), and take it again after a reconnect.
    pub async fn take_token(&self, connection: &mut PgConnection, worker: &WorkerId) -> Result<bool, sqlx::Error> {
        let held: Option<bool> = self
            .schema
            .sql()
            .take_token
            .query_scalar()
            .bind(self.schema.liveness_lock_prefix())
            .bind(&worker.0)
            .fetch_optional(connection)
            .await?;
        Ok(held.unwrap_or(false))
    }
}

/// A query with its parameters, as sqlx builds it.
type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// A finish's outcomes as the statement's arrays.
struct FinishArgs<'a> {
    ids: Vec<i64>,
    leases: Vec<i64>,
    kinds: Vec<&'static str>,
    results: Vec<Value>,
    errors: Vec<Value>,
    delays: Vec<i64>,
    new_args: Vec<Option<&'a Value>>,
}

impl<'a> FinishArgs<'a> {
    fn new(completions: &'a [Completion]) -> Result<FinishArgs<'a>, sqlx::Error> {
        let n = completions.len();
        let mut args = FinishArgs {
            ids: Vec::with_capacity(n),
            leases: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            results: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            new_args: Vec::with_capacity(n),
        };
        for Completion { task, outcome, args: new_args } in completions {
            args.new_args.push(new_args.as_ref());
            args.ids.push(task.task.0);
            args.leases.push(task.lease.0);
            let (kind, result, error, delay) = match outcome {
                FinishOutcome::Completed(result) => ("completed", result.clone(), Value::Null, 0),
                FinishOutcome::Failed(error) => ("failed", Value::Null, error_json(error)?, 0),
                FinishOutcome::Retry { error, delay_ms } => {
                    ("retry", Value::Null, error_json(error)?, duration(*delay_ms))
                }
            };
            args.kinds.push(kind);
            args.results.push(result);
            args.errors.push(error);
            args.delays.push(delay);
        }
        Ok(args)
    }
}

/// A claim's parameters as `claim_tasks()` takes them (but the worker, token, start-now and lease).
struct ClaimArgs<'a> {
    queues: Vec<&'a str>,
    caps: Vec<Option<i32>>,
    serial: Vec<bool>,
    budget: i32,
    hard: bool,
    cluster_cap: Option<i32>,
    max_batch: i32,
    lock_keys: Vec<i64>,
    forbidden: Option<&'a Vec<String>>,
    max_priority: Option<i16>,
    min_priority: Option<i16>,
    min_run_at: Option<i64>,
}

impl<'a> ClaimArgs<'a> {
    fn new(schema: &PgSchema, policy: &'a ClaimPolicy, my_running: u32, my_claimed: u32) -> ClaimArgs<'a> {
        // claim() relies on distinct queues (a queue named twice is served once).
        let mut seen = std::collections::BTreeSet::new();
        let served: Vec<_> = policy.queues.iter().filter(|q| seen.insert(q.name.as_str())).collect();
        ClaimArgs {
            queues: served.iter().map(|q| q.name.as_str()).collect(),
            caps: served.iter().map(|q| q.max_concurrency.map(int)).collect(),
            serial: served.iter().map(|q| q.serial).collect(),
            budget: int(policy.local_budget(my_running, my_claimed)),
            hard: policy.hard_cap_mode(),
            cluster_cap: policy.cluster_wide_cap.map(int),
            max_batch: int(policy.max_claim_batch),
            lock_keys: claim_lock_keys(schema, policy),
            forbidden: (!policy.forbidden_flags.is_empty()).then_some(&policy.forbidden_flags),
            max_priority: policy.max_priority,
            min_priority: policy.min_priority,
            min_run_at: policy.min_run_at.map(|at| at.0),
        }
    }

    /// The sixteen parameters of `claim_tasks()`, bound to `query` after those it has.
    fn bind<'q>(
        self,
        query: PgQuery<'q>,
        worker: &'q WorkerId,
        token: u64,
        start_now: u32,
        lease_ms: u64,
    ) -> PgQuery<'q>
    where
        'a: 'q,
    {
        query
            .bind(&worker.0)
            .bind(token as i64)
            .bind(self.queues)
            .bind(self.caps)
            .bind(self.budget)
            .bind(self.hard)
            .bind(self.cluster_cap)
            .bind(self.max_batch)
            .bind(self.lock_keys)
            .bind(int(start_now))
            .bind(duration(lease_ms))
            .bind(self.serial)
            .bind(self.forbidden)
            .bind(self.max_priority)
            .bind(self.min_priority)
            .bind(self.min_run_at)
    }
}

/// The [`DbReply::Finished`] of a finish's answers: each task with its new state, or none
/// (not held under that lease: lost).
fn finished_from(answers: Vec<(i64, Option<String>)>) -> Result<DbReply, sqlx::Error> {
    let (mut applied, mut lost) = (Vec::new(), Vec::new());
    for (id, state) in answers {
        match state {
            Some(state) => applied.push((TaskId(id), parse_state(&state)?)),
            None => lost.push(TaskId(id)),
        }
    }
    Ok(DbReply::Finished { applied, lost })
}

/// The `claim_locks` rows a claim under `policy` locks, sorted: none without caps, the cluster
/// key with a cluster-wide cap (it covers every queue), else one key per capped queue.
pub fn claim_lock_keys(schema: &PgSchema, policy: &ClaimPolicy) -> Vec<i64> {
    if !policy.needs_cluster_count() {
        return Vec::new();
    }
    if policy.cluster_wide_cap.is_some() {
        return vec![schema.cluster_lock_key()];
    }
    let mut keys: Vec<i64> =
        policy.queues.iter().filter(|q| q.max_concurrency.is_some()).map(|q| schema.queue_lock_key(&q.name)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// A worker request's failure: getting a connection, or once it was sent.
enum RequestError {
    Unsent(sqlx::Error),
    Sent(sqlx::Error),
}

impl From<sqlx::Error> for RequestError {
    /// What arrives by `?` is getting a connection's failure: nothing was sent.
    fn from(error: sqlx::Error) -> Self {
        RequestError::Unsent(error)
    }
}

impl ReplayError for RequestError {
    fn database(&self) -> Option<&sqlx::Error> {
        match self {
            RequestError::Unsent(_) => None,
            RequestError::Sent(error) => Some(error),
        }
    }
}

/// How a sqlx error of a request that had its connection maps onto the protocol.
///
/// A statement the server cancelled was rolled back: after `statement_timeout` (57014) it is
/// `Unavailable`, tried again after a backoff; after `lock_timeout` (55P03) `LockTimeout`,
/// which splits a batch as well. A value it refused (classes 22,
/// data exceptions such as U+0000 in `jsonb`, and 54, limits) or one the client could not
/// encode: `Invalid`, which splits a batch down to the item that carries it.
pub(crate) fn failure(error: sqlx::Error) -> DbFailure {
    let message = super::error_text(&error);
    match &error {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let transient = code.starts_with("08")
                || code.starts_with("40")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code == "57014";
            if code == "55P03" {
                DbFailure::LockTimeout(message)
            } else if transient {
                DbFailure::Unavailable(message)
            } else if code.starts_with("22") || code.starts_with("54") {
                DbFailure::Invalid(message)
            } else {
                DbFailure::Rejected(message)
            }
        }
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Configuration(_)
        | sqlx::Error::BeginFailed => DbFailure::Unavailable(message),
        sqlx::Error::Encode(_) => DbFailure::Invalid(message),
        sqlx::Error::InvalidArgument(_) | sqlx::Error::TypeNotFound { .. } => DbFailure::Rejected(message),
        _ => DbFailure::Unknown(message),
    }
}

impl PgStore {
    /// The retry policy a task row stores in its `retry` column, read leniently
    /// ([`RetryPolicy::from_stored`]): none of its own, or one that cannot be read, is the
    /// app's, and then why it could not be read comes along. The claim and the reaper read
    /// policies alike, so a run is retried by the policy it ran under.
    pub(super) fn stored_policy(
        &self,
        row: &sqlx::postgres::PgRow,
    ) -> Result<(RetryPolicy, Option<String>), sqlx::Error> {
        Ok(match leniently::<Option<Value>>(row, "retry")? {
            Ok(None) => (self.app.retry.clone(), None),
            Ok(Some(stored)) => match RetryPolicy::from_stored(stored) {
                Ok(policy) => (policy, None),
                Err(problem) => (self.app.retry.clone(), Some(problem)),
            },
            Err(problem) => (self.app.retry.clone(), Some(problem)),
        })
    }
}
