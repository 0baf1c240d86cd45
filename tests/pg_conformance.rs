//! Conformance: the same scripts of operations applied to the memory store and to PostgreSQL,
//! comparing every reply, the full state after every step, and the notifications.
//!
//! Time: the PostgreSQL store runs on a one-connection pool whose session pins the database
//! clock (`SET canter.now`, read by the schema's `db_now()`) to the script's clock before every
//! operation, so both stores see the same `now` to the millisecond: lease expiry, run-at
//! delays, good-until, reaper thresholds and retry delays are compared exactly, with no sleeps.
//!
//! Scripts: a few written by hand for the behaviours that matter most (claim ordering, caps in
//! both modes, leases lapsing and re-claimed, fencing of stale writes, retries, expiry,
//! cancellation, the operator actions), then random scripts generated from the memory store's state by a seeded
//! PRNG over three applications (the default queue; custom queues with caps in hard-cap mode;
//! soft-cap mode with a prefetch buffer). `CANTER_CONFORMANCE_SEEDS=n` runs more seeds; a
//! failure names its seed and step.
//!
//! Bad data and locks: the stores must also agree when a finish carries a value PostgreSQL
//! refuses (U+0000: both answer `Invalid` and write nothing), when another transaction holds a
//! row locked (a second connection in PostgreSQL, [`MemoryStore::lock_row`] in memory: the
//! statements that skip locked rows skip it, the others give up with `LockTimeout` after the
//! pair's short `lock_timeout`), when a row was written by hand with arguments no reader
//! decodes (claims and inspection say so for that row alone), and when heartbeats carry the
//! tokens of abandoned claims.

#[path = "common/pg.rs"]
mod pg;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use canter::budget::{ClaimPolicy, QueuePolicy};
use canter::config::{AppConfig, CustomQueue, QueueMode, RecoveryConfig, RetryPolicy};
use canter::memory::MemoryStore;
use canter::postgres::{PgAdminError, PgEnqueueError, PgStore, PgSubmitError, PgWorkflowError};
use canter::rng::Rng;
use canter::store::{AdminError, AdminReply, AdminRequest, KeyRemoval, Notification, Reschedule, TaskFilter};
use canter::store::{
    Completion, DbFailure, DbReply, DbRequest, DbTime, EnqueueError, FinishOutcome, KeyMode, NewTask, RunAt,
    TaskRecord, WorkerInfo,
};
use canter::store::{NewWorkflow, WorkflowId, WorkflowRecord};
use canter::task::{ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
use canter::workflow::{EdgePolicy, Join, OnError, StepId};
use pg::{TestDb, pin_clock};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgListener};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

const T0: DbTime = DbTime(1_700_000_000_000);

/// One step of a script.
#[derive(Debug, Clone)]
enum Op {
    Enqueue(Vec<NewTask>),
    Db(DbRequest),
    Admin(AdminRequest),
    Advance(u64),
    /// Another transaction locks the row.
    Lock(TaskId),
    /// That transaction ends.
    Unlock(TaskId),
    /// A producer writes a row of this queue by hand, with arguments no reader decodes.
    EnqueueUnreadable(String),
    /// The worker's session takes its liveness token (a connection of its own in PostgreSQL).
    TakeToken(WorkerId),
    /// That session ends, and the server releases the token.
    DropToken(WorkerId),
    /// A workflow is submitted.
    Submit(NewWorkflow),
    /// A workflow is paused, resumed, cancelled or retried.
    Workflow(WorkflowAction, WorkflowId),
}

#[derive(Debug, Clone, Copy)]
enum WorkflowAction {
    Pause,
    Resume,
    Cancel,
    /// Its steps that did not complete, and with `true` everything finished below them.
    Retry(bool),
}

/// How deep the hand-written rows' arguments are nested: past what serde_json decodes (128).
const UNREADABLE_DEPTH: usize = 130;

/// Both stores, side by side.
struct Pair {
    memory: MemoryStore,
    pg: PgStore,
    pool: PgPool,
    listener: PgListener,
    marker: String,
    /// Where the marker is sent from: not `pool`, whose short lock_timeout would give up on
    /// the cluster-wide lock a commit with notifications takes (held by other tests' commits).
    marker_pool: PgPool,
    now: DbTime,
    step: usize,
    label: String,
    /// The step's operation, for failure messages.
    last_op: String,
    /// What the replies showed, to check that random scripts reach the interesting cases.
    seen: BTreeMap<&'static str, usize>,
    /// Compare the attempts histories after every step, not every tenth.
    every_history: bool,
    /// The connections whose open transactions lock rows.
    locks: BTreeMap<TaskId, PgConnection>,
    /// The sessions holding workers' liveness tokens.
    tokens: BTreeMap<WorkerId, PgConnection>,
    db: TestDb,
}

impl Pair {
    async fn new(app: AppConfig, label: &str) -> Pair {
        let db = TestDb::new().await;
        // A short lock_timeout: a statement that waits for a row another transaction holds
        // gives up quickly, as a worker's does after its session's 5 s.
        let options: PgConnectOptions = db.url.parse().unwrap();
        let options = options.application_name(db.schema.name()).options([("lock_timeout", "300ms")]);
        let pool = canter::postgres::pool_options(&options)
            .max_connections(1)
            .connect_with(options.disable_statement_logging())
            .await
            .unwrap();
        let pg = PgStore::new(pool.clone(), db.schema.clone(), app.clone());
        let mut listener = PgListener::connect_with(&db.pool(1).await).await.unwrap();
        let marker = format!("{}_marker", db.schema.name());
        let mut channels = vec![marker.clone(), db.schema.done_channel(), db.schema.abort_channel()];
        channels.extend(app.queues().iter().map(|q| db.schema.queue_channel(&q.name)));
        for channel in &channels {
            listener.listen(channel).await.unwrap();
        }
        // A registered listener, so the server notifies what the memory store announces.
        canter::postgres::register_listener(&mut listener, &db.schema, &channels).await.unwrap();
        Pair {
            memory: MemoryStore::new(app),
            pg,
            pool,
            listener,
            marker,
            marker_pool: db.pool(1).await,
            now: T0,
            step: 0,
            label: label.into(),
            last_op: String::new(),
            seen: BTreeMap::new(),
            every_history: false,
            locks: BTreeMap::new(),
            tokens: BTreeMap::new(),
            db,
        }
    }

    fn see(&mut self, feature: &'static str) {
        *self.seen.entry(feature).or_default() += 1;
    }

    fn at(&self) -> String {
        format!("{} step {} ({})", self.label, self.step, self.last_op)
    }

    /// Waits until no session holds `worker`'s liveness lock any more.
    async fn wait_token_free(&self, worker: &WorkerId) {
        let sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                   AND ((classid::bigint << 32) | objid::bigint) = hashtextextended($1 || $2, 0)";
        for _ in 0..500 {
            let held: i64 = sqlx::query_scalar(sql)
                .bind(self.pg.schema().liveness_lock_prefix())
                .bind(&worker.0)
                .fetch_one(&self.pool)
                .await
                .unwrap();
            if held == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{}: the token session of {worker} never ended", self.at());
    }

    async fn apply(&mut self, op: &Op) {
        self.step += 1;
        self.last_op = format!("{op:?}").chars().take(400).collect();
        pin_clock(&self.pool, self.pg.schema(), self.now).await;
        let at = self.at();
        match op {
            Op::Advance(ms) => self.now = self.now.plus_ms(*ms),
            Op::Enqueue(tasks) => {
                let memory = self.memory.enqueue_many(tasks.clone(), self.now);
                self.see(match &memory {
                    Ok(_) => "enqueued",
                    Err(EnqueueError::PayloadMismatch { .. }) => "payload mismatch",
                    Err(EnqueueError::RunAtAfterGoodUntil { .. }) => "run_at after good_until",
                    Err(_) => "refused",
                });
                let pg = self.pg.enqueue_many(tasks.clone()).await.map_err(|e| match e {
                    PgEnqueueError::Invalid(e) => e,
                    other => panic!("{at}: enqueue failed: {other}"),
                });
                assert_eq!(pg, memory, "{at}: enqueue {tasks:?}");
            }
            Op::Db(request) => {
                if let DbRequest::Claim { policy, .. } | DbRequest::FinishAndClaim { policy, .. } = request {
                    // A floor that has something below it to leave (to urgent claims).
                    let below = |t: &canter::memory::StoredTask| {
                        t.state == TaskState::Pending
                            && policy.min_priority.is_some_and(|floor| t.priority < floor)
                            && policy.queues.iter().any(|q| q.name == t.queue)
                    };
                    if self.memory.tasks().any(below) {
                        self.see("floor left a more urgent task");
                    }
                    // A run-at bound that has an earlier due task to leave (to the next pass).
                    let earlier = |t: &canter::memory::StoredTask| {
                        t.state == TaskState::Pending
                            && policy.min_run_at.is_some_and(|min| t.run_at < min)
                            && t.run_at <= self.now
                            && policy.queues.iter().any(|q| q.name == t.queue)
                    };
                    if self.memory.tasks().any(earlier) {
                        self.see("run-at bound left an earlier task");
                    }
                }
                let memory = self.memory.execute(request, self.now).map(normalized).map_err(failure_kind);
                match &memory {
                    Ok(reply) => {
                        for feature in features(reply) {
                            self.see(feature);
                        }
                    }
                    Err(kind) => self.see(kind),
                }
                let pg = self.pg.execute(request).await.map(normalized).map_err(failure_kind);
                if let Err(kind) = &pg {
                    assert!(
                        matches!(*kind, "refused: invalid" | "refused: lock timeout"),
                        "{at}: {request:?} failed: {kind}"
                    );
                }
                assert_eq!(pg, memory, "{at}: {request:?}");
            }
            Op::Lock(id) => {
                self.memory.lock_row(*id);
                let mut conn = PgConnection::connect(&self.db.url).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe("BEGIN")).execute(&mut conn).await.unwrap();
                let lock = format!("SELECT 1 FROM {}.tasks WHERE id = $1 FOR UPDATE", self.pg.schema().quoted());
                sqlx::query(sqlx::AssertSqlSafe(lock)).bind(id.0).execute(&mut conn).await.unwrap();
                self.locks.insert(*id, conn);
                self.see("row locked");
            }
            Op::Unlock(id) => {
                self.memory.unlock_row(*id);
                if let Some(mut conn) = self.locks.remove(id) {
                    sqlx::raw_sql(sqlx::AssertSqlSafe("ROLLBACK")).execute(&mut conn).await.unwrap();
                    conn.close().await.unwrap();
                }
            }
            Op::TakeToken(worker) => {
                let memory = self.memory.take_token(worker, self.now);
                let mut conn = PgConnection::connect(&self.db.url).await.unwrap();
                // The token session's statement reads the script's clock too.
                pin_clock(&mut conn, self.pg.schema(), self.now).await;
                let pg = self.pg.take_token(&mut conn, worker).await.unwrap();
                assert_eq!(pg, memory, "{at}: take the token of {worker}");
                if pg {
                    self.tokens.insert(worker.clone(), conn);
                    self.see("token taken");
                }
            }
            Op::DropToken(worker) => {
                self.memory.release_token(worker);
                if let Some(conn) = self.tokens.remove(worker) {
                    conn.close().await.unwrap();
                    // The server ends the session (and lets go of its locks) after the close.
                    self.wait_token_free(worker).await;
                }
            }
            Op::EnqueueUnreadable(queue) => {
                let deep = (0..UNREADABLE_DEPTH).fold(json!("deep"), |inner, _| json!([inner]));
                self.memory.enqueue_unchecked(NewTask::new("t", deep).queue(queue.clone()), self.now);
                let s = self.pg.schema().quoted();
                let sql = format!(
                    "WITH written AS (
                         INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at)
                         VALUES ('t', $1, 0, (repeat('[', $2) || '\"deep\"' || repeat(']', $2))::jsonb, 'PENDING',
                                 {s}.db_now(), {s}.db_now())
                         RETURNING queue
                     )
                     SELECT pg_notify($3 || w.queue, '') FROM written w"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(queue)
                    .bind(UNREADABLE_DEPTH as i32)
                    .bind(self.pg.schema().queue_channel_prefix())
                    .execute(&self.pool)
                    .await
                    .unwrap();
            }
            Op::Submit(workflow) => {
                let memory = self.memory.submit_workflow(workflow.clone(), self.now);
                self.see(if memory.is_ok() { "workflow submitted" } else { "workflow refused" });
                let pg = self.pg.submit_workflow(workflow).await.map_err(|e| match e {
                    PgSubmitError::Invalid(e) => e,
                    other => panic!("{at}: submit failed: {other}"),
                });
                assert_eq!(pg, memory, "{at}: submit");
            }
            Op::Workflow(action, id) => {
                let (memory, pg) = match action {
                    WorkflowAction::Pause => (self.memory.pause_workflow(*id), self.pg.pause_workflow(*id).await),
                    WorkflowAction::Resume => {
                        (self.memory.resume_workflow(*id, self.now), self.pg.resume_workflow(*id).await)
                    }
                    WorkflowAction::Cancel => {
                        (self.memory.cancel_workflow(*id, self.now), self.pg.cancel_workflow(*id).await)
                    }
                    WorkflowAction::Retry(downstream) => (
                        self.memory.retry_workflow(*id, *downstream, self.now),
                        self.pg.retry_workflow(*id, *downstream).await,
                    ),
                };
                let pg = pg.map_err(|e| match e {
                    PgWorkflowError::Refused(e) => e,
                    other => panic!("{at}: {action:?} failed: {other}"),
                });
                assert_eq!(pg, memory, "{at}: {action:?} workflow {id}");
            }
            Op::Admin(request) => {
                let memory = self.memory.admin(request, self.now);
                if let Some(seen) = seen_of(request, &memory) {
                    self.see(seen);
                }
                let pg = self.pg.admin(request).await.map_err(admin);
                assert_eq!(pg, memory, "{at}: {request:?}");
            }
        }
        if std::env::var_os("CANTER_CONFORMANCE_TRACE").is_some() {
            eprintln!("{at}: {op:?}");
        }
        self.compare_notifications().await;
        self.compare_state(self.every_history || self.step % 10 == 0).await;
    }

    async fn compare_state(&self, with_attempts: bool) {
        let at = self.at();
        let memory = records(self.memory.list(&TaskFilter::default()));
        let pg = records(self.pg.list(&TaskFilter::default()).await.unwrap());
        if pg != memory {
            for (m, p) in memory.iter().zip(&pg) {
                assert_eq!(p, m, "{at}: first differing task");
            }
            assert_eq!(pg.len(), memory.len(), "{at}: task counts");
        }
        assert_eq!(self.pg.counts().await.unwrap(), self.memory.counts(), "{at}: counts");
        // On the script's clock as it is after the step (an `Advance` moves it).
        pin_clock(&self.pool, self.pg.schema(), self.now).await;
        assert_eq!(self.pg.queue_depths().await.unwrap(), self.memory.queue_depths(self.now), "{at}: queue depths");
        assert_eq!(self.pg.workers().await.unwrap(), self.memory.workers(), "{at}: workers");
        assert_eq!(self.pg.paused_queues().await.unwrap(), self.memory.paused_queues(), "{at}: paused queues");
        assert_eq!(self.pg.worker_loads().await.unwrap(), self.memory.worker_loads(), "{at}: worker loads");
        for (from, to) in [(DbTime(0), DbTime(i64::MAX)), (DbTime(self.now.0 - 2_000), self.now)] {
            let mut pg = self.pg.finished_counts(from, to).await.unwrap();
            pg.sort_by(|a, b| (&a.queue, a.state).cmp(&(&b.queue, b.state)));
            assert_eq!(pg, self.memory.finished_counts(from, to), "{at}: finished in {from:?}..{to:?}");
        }
        let newest = self.memory.workflow_ids(3);
        assert_eq!(self.pg.workflow_ids(3).await.unwrap(), newest, "{at}: newest workflows");
        for record in &memory {
            if self.memory.step_of(record.id).is_some() {
                let parents = self.memory.parents(record.id);
                assert_eq!(self.pg.parents(record.id).await.unwrap(), parents, "{at}: parents of {}", record.id);
            }
        }
        for id in (1..).map(WorkflowId) {
            let memory = self.memory.workflow(id);
            assert_eq!(self.pg.workflow(id).await.unwrap(), memory, "{at}: workflow {id}");
            let steps = self.memory.workflow_steps(id);
            let edges = self.memory.workflow_edges(id, 7);
            assert_eq!(self.pg.workflow_edges(id, 7).await.unwrap(), edges, "{at}: edges of workflow {id}");
            assert_eq!(self.pg.workflow_steps(id).await.unwrap(), steps, "{at}: steps of workflow {id}");
            if memory.is_none() {
                break;
            }
        }
        if with_attempts {
            for record in &memory {
                assert_eq!(
                    self.pg.attempts(record.id).await.unwrap(),
                    self.memory.attempts(record.id),
                    "{at}: attempts"
                );
            }
        }
        for filter in [
            TaskFilter { state: Some(TaskState::Pending), limit: Some(3), ..TaskFilter::default() },
            TaskFilter { queue: memory.first().map(|r| r.queue.clone()), ..TaskFilter::default() },
            TaskFilter { newest_first: true, offset: 1, limit: Some(4), ..TaskFilter::default() },
            TaskFilter {
                name: memory.last().map(|r| r.name.clone()),
                after: memory.get(memory.len() / 2).map(|r| r.id),
                newest_first: memory.len() % 2 == 0,
                ..TaskFilter::default()
            },
            TaskFilter { after: memory.first().map(|r| r.id), offset: 2, ..TaskFilter::default() },
            TaskFilter {
                enqueued_from: memory.get(1).map(|r| r.enqueued_at),
                enqueued_before: memory.last().map(|r| r.enqueued_at),
                newest_first: true,
                ..TaskFilter::default()
            },
        ] {
            let (pg, memory) = (records(self.pg.list(&filter).await.unwrap()), records(self.memory.list(&filter)));
            assert_eq!(pg, memory, "{at}: list {filter:?}");
        }
    }

    /// The notifications of the last step: ready queues per statement (with the priority an
    /// enqueue announces) and finished ids, in any order (PostgreSQL batches finished ids into
    /// one payload).
    async fn compare_notifications(&mut self) {
        let at = self.at();
        let (mut ready, mut done, mut revoked) = (Vec::new(), Vec::new(), Vec::new());
        for note in self.memory.take_notifications() {
            match note {
                // The channel and the payload: the most urgent priority an enqueue wrote, and
                // the earliest run-at (ms) where it announces one.
                Notification::TaskReady { queue, priority, run_at } => ready.push((
                    self.pg.schema().queue_channel(&queue),
                    match (priority, run_at) {
                        (Some(p), Some(r)) => format!("{p} {}", r.0),
                        (Some(p), None) => p.to_string(),
                        (None, _) => String::new(),
                    },
                )),
                Notification::TaskFinished { task, .. } => done.push(task.0),
                Notification::TasksRevoked { tasks } => revoked.extend(tasks.iter().map(|t| t.0)),
                other => panic!("{at}: a notification this suite does not know: {other:?}"),
            }
        }
        sqlx::query("SELECT pg_notify($1, '')").bind(&self.marker).execute(&self.marker_pool).await.unwrap();
        let (mut pg_ready, mut pg_done, mut pg_revoked) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let note = tokio::time::timeout(Duration::from_secs(10), self.listener.recv())
                .await
                .unwrap_or_else(|_| panic!("{at}: the marker never came"))
                .unwrap();
            if note.channel() == self.marker {
                break;
            }
            if note.channel() == self.pg.schema().done_channel() {
                pg_done.extend(note.payload().split(',').map(|id| id.parse::<i64>().unwrap()));
            } else if note.channel() == self.pg.schema().abort_channel() {
                pg_revoked.extend(note.payload().split(',').map(|id| id.parse::<i64>().unwrap()));
            } else {
                pg_ready.push((note.channel().to_owned(), note.payload().to_owned()));
            }
        }
        for list in [&mut ready, &mut pg_ready] {
            list.sort();
        }
        for list in [&mut done, &mut pg_done, &mut revoked, &mut pg_revoked] {
            list.sort_unstable();
        }
        assert_eq!(pg_ready, ready, "{at}: ready notifications");
        assert_eq!(pg_done, done, "{at}: finished notifications");
        assert_eq!(pg_revoked, revoked, "{at}: revoked notifications");
    }

    async fn run(&mut self, script: &[Op]) {
        for op in script {
            self.apply(op).await;
        }
        self.compare_state(true).await;
    }
}

/// The interesting cases a reply shows.
fn features(reply: &DbReply) -> Vec<&'static str> {
    let mut seen = Vec::new();
    let mut see = |on: bool, feature| {
        if on {
            seen.push(feature);
        }
    };
    match reply {
        DbReply::FinishedAndClaimed { .. } => {
            let (finished, claimed) = reply.clone().into_finished_and_claimed();
            seen.push("finished and claimed");
            seen.extend(features(&finished));
            seen.extend(claimed.iter().flat_map(features));
        }
        DbReply::Claimed { tasks, more, next_run_in_ms } => {
            see(next_run_in_ms.is_some(), "wake-up hint");
            see(!tasks.is_empty(), "claimed");
            see(tasks.iter().any(|t| t.started), "claimed and started");
            see(tasks.iter().any(|t| t.lease.0 > 1), "re-claimed");
            see(*more, "more");
            see(tasks.iter().any(|t| t.args_error.is_some()), "claimed unreadable");
        }
        DbReply::Started { started, expired, deferred, lost } => {
            see(!started.is_empty(), "started");
            see(!expired.is_empty(), "expired at start");
            see(!deferred.is_empty(), "deferred");
            see(!lost.is_empty(), "start lost");
        }
        DbReply::Finished { applied, lost } => {
            see(applied.iter().any(|(_, s)| *s == TaskState::Completed), "completed");
            see(applied.iter().any(|(_, s)| *s == TaskState::Failed), "failed");
            see(applied.iter().any(|(_, s)| *s == TaskState::Pending), "retried");
            see(!lost.is_empty(), "finish lost");
        }
        DbReply::Heartbeat { lost, busy, handed_back } => {
            see(!lost.is_empty(), "heartbeat lost");
            see(!busy.is_empty(), "heartbeat busy");
            see(!handed_back.is_empty(), "late claim handed back");
        }
        DbReply::Released { released, lost } => {
            see(!released.is_empty(), "released");
            see(!lost.is_empty(), "release lost");
        }
        DbReply::Reaped(report) => {
            see(!report.dead_workers.is_empty(), "dead worker");
            see(!report.requeued.is_empty(), "reaped claimed");
            see(!report.retried.is_empty(), "reaped and retried");
            see(!report.failed.is_empty(), "reaped and failed");
            see(!report.expired.is_empty(), "expired pending");
        }
        DbReply::Purged { tasks } => see(*tasks > 0, "purged"),
        DbReply::WaitingSet { written } => see(*written, "waiting mark written"),
        // The stores differ here by design (memory keeps no dead rows); not generated.
        DbReply::Vacuumed { .. } | DbReply::Done => {}
        other => panic!("a reply this suite does not know: {other:?}"),
    }
    seen
}

/// A reply with what differs between the stores' wording taken out: why a row's arguments
/// could not be read (each decoder says it its own way).
fn normalized(mut reply: DbReply) -> DbReply {
    if let DbReply::Claimed { tasks, .. } | DbReply::FinishedAndClaimed { tasks, .. } = &mut reply {
        for task in tasks {
            task.args_error = task.args_error.take().map(|_| "unreadable".to_owned());
        }
    }
    reply
}

/// Records with why their arguments could not be read taken out, as [`normalized`].
fn records(mut records: Vec<TaskRecord>) -> Vec<TaskRecord> {
    for record in &mut records {
        record.args_error = record.args_error.take().map(|_| "unreadable".to_owned());
    }
    records
}

/// The kind of a failure, which both stores must agree on (their messages differ).
fn failure_kind(failure: DbFailure) -> &'static str {
    match failure {
        DbFailure::Invalid(_) => "refused: invalid",
        DbFailure::LockTimeout(_) => "refused: lock timeout",
        DbFailure::Rejected(_) => "refused: rejected",
        DbFailure::Unavailable(_) => "refused: unavailable",
        DbFailure::Unknown(_) => "refused: unknown",
        other => panic!("a failure this suite does not know: {other}"),
    }
}

/// What an operator action the memory store applied shows of the suite's reach.
fn seen_of(request: &AdminRequest, memory: &Result<AdminReply, AdminError>) -> Option<&'static str> {
    Some(match (request, memory) {
        (AdminRequest::Reschedule { .. }, Ok(_)) => "rescheduled",
        (AdminRequest::Reschedule { .. }, Err(_)) => "reschedule refused",
        (AdminRequest::Complete { .. }, Ok(_)) => "completed by hand",
        (AdminRequest::Fail { .. }, Ok(_)) => "failed by hand",
        (AdminRequest::Complete { .. } | AdminRequest::Fail { .. }, Err(_)) => "finish by hand refused",
        (_, Ok(AdminReply::Released { tasks: 1.. })) => "force-unlocked",
        (_, Ok(AdminReply::KeyRemoved { removal: KeyRemoval::Cancelled(_) })) => "key of a pending task",
        (_, Ok(AdminReply::KeyRemoved { removal: KeyRemoval::Detached(_) })) => "key of a held task",
        (_, Ok(AdminReply::KeyRemoved { removal: KeyRemoval::Freed(_) })) => "key of a finished task",
        (AdminRequest::RemoveKey { .. }, Err(_)) => "unknown key",
        (_, Ok(AdminReply::Purged { tasks: 1.. })) => "purged",
        (AdminRequest::Pause { .. }, _) => "paused",
        (_, Ok(AdminReply::Resumed { was_paused: true })) => "resumed",
        _ => return None,
    })
}

fn admin(error: PgAdminError) -> AdminError {
    match error {
        PgAdminError::Refused(e) => e,
        PgAdminError::Database(e) | PgAdminError::OutcomeUnknown(e) => panic!("database error: {e}"),
        other => panic!("an admin error this suite does not know: {other}"),
    }
}

fn w(name: &str) -> WorkerId {
    WorkerId(name.into())
}

fn custom(queues: Vec<CustomQueue>) -> AppConfig {
    AppConfig { queue_mode: QueueMode::Custom, custom_queues: queues, ..AppConfig::default() }
}

fn policy(app: &AppConfig, concurrency: u32) -> Arc<ClaimPolicy> {
    let mut queues: Vec<QueuePolicy> = app.queues().into_iter().map(QueuePolicy::from).collect();
    queues.sort_by_key(|q| q.priority);
    Arc::new(ClaimPolicy {
        concurrency,
        prefetch_buffer: app.prefetch_buffer,
        claim_ahead: 0,
        max_claim_batch: 0,
        max_claim_per_worker: 0,
        cluster_wide_cap: app.cluster_wide_cap,
        queues,
        forbidden_flags: Vec::new(),
        max_priority: None,
        min_priority: None,
        min_run_at: None,
    })
}

fn claim(worker: &str, token: u64, policy: &Arc<ClaimPolicy>, start_now: u32, lease_ms: u64) -> Op {
    Op::Db(DbRequest::Claim {
        worker: w(worker),
        token,
        policy: Arc::clone(policy),
        my_running: 0,
        my_claimed: 0,
        start_now,
        lease_ms,
    })
}

fn lease(id: i64, lease: i64) -> TaskLease {
    TaskLease { task: TaskId(id), lease: Lease(lease) }
}

fn finish(worker: &str, task: TaskLease, outcome: FinishOutcome) -> Op {
    Op::Db(DbRequest::Finish { worker: w(worker), completions: vec![Completion { task, outcome, args: None }] })
}

fn error(code: ErrorCode) -> TaskError {
    TaskError::new(code, "boom").with_data(json!({"detail": [1, 2]}))
}

#[tokio::test]
async fn claim_order_caps_and_more_in_hard_mode() {
    let app = custom(vec![
        CustomQueue::new("low").with_priority(2),
        CustomQueue::new("high").with_priority(1).with_max_concurrency(2),
        CustomQueue::new("paused").with_max_concurrency(0),
    ]);
    let p = policy(&app, 10);
    let mut pair = Pair::new(app, "hard caps").await;
    let script = vec![
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)).queue("low").priority(3),
            NewTask::new("t", json!(2)).queue("high").priority(5),
            NewTask::new("t", json!(3)).queue("high").priority(1).run_at(RunAt::DelayMs(500)),
            NewTask::new("t", json!(4)).queue("high").priority(1).run_at(RunAt::DelayMs(100)),
            NewTask::new("t", json!(5)).queue("high").priority(1).run_at(RunAt::DelayMs(100)),
            NewTask::new("t", json!(6)).queue("low").priority(-1),
            NewTask::new("t", json!(7)).queue("paused"),
        ]),
        Op::Advance(1_000),
        claim("a", 1, &p, 0, 60_000),
        // The high queue's cap of 2 is full: nothing more from it, even for another worker.
        claim("b", 1, &p, 2, 60_000),
        Op::Enqueue(vec![NewTask::new("t", json!(8)).queue("low")]),
        claim("b", 2, &p, 2, 60_000),
        Op::Db(DbRequest::Release { worker: w("a"), tasks: vec![lease(4, 1), lease(5, 1)] }),
        claim("c", 1, &Arc::new(ClaimPolicy { max_claim_batch: 1, ..(*p).clone() }), 1, 60_000),
    ];
    pair.run(&script).await;
}

#[tokio::test]
async fn a_finish_and_claim_refills_the_cap_slot_its_finish_frees() {
    let app = AppConfig { cluster_wide_cap: Some(2), ..custom(vec![CustomQueue::new("q").with_max_concurrency(1)]) };
    let p = policy(&app, 4);
    let mut pair = Pair::new(app, "finish and claim").await;
    let finish_and_claim = |task: TaskLease, token: u64| {
        Op::Db(DbRequest::FinishAndClaim {
            worker: w("a"),
            completions: vec![Completion { task, outcome: FinishOutcome::Completed(json!(task.task.0)), args: None }],
            token,
            policy: Arc::clone(&p),
            my_running: 0,
            my_claimed: 0,
            start_now: 4,
            lease_ms: 60_000,
        })
    };
    let script = vec![
        Op::Enqueue((1..=3).map(|i| NewTask::new("t", json!(i)).queue("q")).collect()),
        claim("a", 1, &p, 4, 60_000),
        // The queue's one slot is taken: nothing for another worker.
        claim("b", 1, &p, 4, 60_000),
        // Finishing task 1 frees it, and the same statement takes task 2 into it.
        finish_and_claim(lease(1, 1), 2),
        claim("b", 2, &p, 4, 60_000),
        // A stale lease finishes nothing (fenced), and the claim finds the slot taken.
        finish_and_claim(lease(1, 1), 3),
        finish_and_claim(lease(2, 1), 4),
    ];
    pair.run(&script).await;
    let states: Vec<TaskState> = (1..=3).map(|id| pair.memory.task(TaskId(id)).expect("task").state).collect();
    assert_eq!(states, vec![TaskState::Completed, TaskState::Completed, TaskState::Running]);
    assert_eq!(pair.memory.task(TaskId(3)).and_then(|t| t.claimed_by.clone()), Some(w("a")));
}

#[tokio::test]
async fn cluster_cap_soft_caps_and_deferred_starts() {
    let app = AppConfig { cluster_wide_cap: Some(3), ..AppConfig::default() };
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "cluster cap").await;
    let mut script = vec![Op::Enqueue((0..8).map(|i| NewTask::new("t", json!(i))).collect())];
    script.extend([claim("a", 1, &p, 1, 60_000), claim("b", 1, &p, 2, 60_000), claim("c", 1, &p, 2, 60_000)]);
    pair.run(&script).await;

    let app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue::new("q").with_max_concurrency(2)],
        prefetch_buffer: 4,
        claim_lease_ms: Some(10_000),
        ..AppConfig::default()
    };
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "soft caps").await;
    let script = vec![
        Op::Enqueue((0..8).map(|i| NewTask::new("t", json!(i)).queue("q")).collect()),
        // Soft mode counts only running tasks against the cap: the claim fills the buffer.
        claim("a", 1, &p, 1, 10_000),
        claim("b", 1, &p, 1, 10_000),
        Op::Db(DbRequest::Start {
            worker: w("a"),
            tasks: vec![lease(2, 1), lease(3, 1), lease(2, 1), lease(3, 0)],
            policy: Arc::clone(&p),
        }),
        Op::Db(DbRequest::Start { worker: w("b"), tasks: vec![lease(7, 1), lease(8, 1)], policy: Arc::clone(&p) }),
    ];
    pair.run(&script).await;
}

#[tokio::test]
async fn leases_lapse_and_stale_writes_are_fenced() {
    let app = AppConfig::default();
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "leases").await;
    let beat = |worker: &str, claimed: Vec<TaskLease>, running: Vec<TaskLease>| {
        Op::Db(DbRequest::Heartbeat {
            worker: w(worker),
            claimed,
            running,
            lease_ms: 1_000,
            max_renew_age_ms: 1_500,
            abandoned: vec![],
        })
    };
    let script = vec![
        Op::Enqueue(vec![NewTask::new("t", json!(1)), NewTask::new("t", json!(2)), NewTask::new("t", json!(3))]),
        claim("a", 7, &p, 1, 1_000),
        Op::Advance(900),
        beat("a", vec![lease(2, 1)], vec![lease(1, 1), lease(3, 1)]),
        Op::Advance(900),
        // Renewed at 900: still a's at 1 800.
        claim("b", 1, &p, 0, 1_000),
        Op::Advance(900),
        // Too old to renew: the claim lapses and b takes it over with a new lease.
        beat("a", vec![lease(2, 1)], vec![]),
        Op::Advance(1_000),
        claim("b", 2, &p, 0, 1_000),
        Op::Db(DbRequest::Start { worker: w("a"), tasks: vec![lease(2, 1)], policy: Arc::clone(&p) }),
        Op::Db(DbRequest::Start { worker: w("b"), tasks: vec![lease(2, 2), lease(2, 2)], policy: Arc::clone(&p) }),
        finish("a", lease(2, 1), FinishOutcome::Completed(json!("stale"))),
        finish("b", lease(2, 2), FinishOutcome::Completed(json!(null))),
        finish("b", lease(2, 2), FinishOutcome::Completed(json!("again"))),
        Op::Db(DbRequest::AbandonClaim { worker: w("a"), token: 7 }),
        Op::Db(DbRequest::Release { worker: w("a"), tasks: vec![lease(1, 1), lease(1, 0)] }),
        beat("a", vec![], vec![lease(1, 1)]),
        Op::Db(DbRequest::RegisterWorker(WorkerInfo {
            worker: w("a"),
            queues: vec!["default".into()],
            concurrency: 2,
        })),
        Op::Db(DbRequest::DeregisterWorker(w("a"))),
        // A worker whose row is gone (pruned) deregisters with a beat of it in flight that
        // lands after: it stays stopped.
        Op::Db(DbRequest::DeregisterWorker(w("c"))),
        beat("c", vec![], vec![]),
    ];
    pair.run(&script).await;
}

#[tokio::test]
async fn retries_expiry_cancellation_reaping_and_requeue() {
    let app = AppConfig::default();
    let p = policy(&app, 4);
    let mut pair = Pair::new(app, "lifecycle").await;
    let retry = RetryPolicy::fixed(vec![1, 2]).with_jitter(true);
    let script = vec![
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)).retry(retry.clone()),
            NewTask::new("t", json!(2)).good_until(T0.plus_ms(5_000)),
            NewTask::new("t", json!(3)).retry(retry.clone()).good_until(T0.plus_ms(2_500)),
            NewTask::new("t", json!(4)).run_at(RunAt::DelayMs(100_000)),
            NewTask::new("t", json!(5)).retry(RetryPolicy::exponential(1, 5)),
        ]),
        claim("a", 1, &p, 3, 60_000),
        finish("a", lease(1, 1), FinishOutcome::Retry { error: error(ErrorCode::TaskError), delay_ms: 1_000 }),
        // Past good-until with the delay: fails instead of retrying.
        finish("a", lease(3, 1), FinishOutcome::Retry { error: error(ErrorCode::TaskTimeout), delay_ms: 3_000 }),
        Op::Advance(1_000),
        claim("a", 2, &p, 1, 60_000),
        finish("a", lease(1, 2), FinishOutcome::Failed(error(ErrorCode::User("NOPE".into())))),
        Op::Admin(AdminRequest::Retry { task: TaskId(1) }),
        Op::Admin(AdminRequest::Retry { task: TaskId(2) }),
        Op::Admin(AdminRequest::Cancel { task: TaskId(4) }),
        Op::Admin(AdminRequest::Cancel { task: TaskId(4) }),
        Op::Admin(AdminRequest::Cancel { task: TaskId(99) }),
        Op::Admin(AdminRequest::Cancel { task: TaskId(5) }),
        Op::Advance(5_000),
        // Task 2 is claimed and now past good-until: starting it expires it.
        Op::Db(DbRequest::Start { worker: w("a"), tasks: vec![lease(2, 1)], policy: Arc::clone(&p) }),
        claim("b", 1, &p, 1, 60_000),
        Op::Advance(10_000),
        Op::Db(DbRequest::Reap {
            worker: w("r"),
            claimed_stale_ms: Some(5_000),
            running_stale_ms: Some(5_000),
            entropy: 42,
        }),
        Op::Db(DbRequest::Reap { worker: w("r"), claimed_stale_ms: None, running_stale_ms: None, entropy: 1 }),
    ];
    pair.run(&script).await;
}

#[tokio::test]
async fn idempotency_keys_and_refusals() {
    let mut pair = Pair::new(custom(vec![CustomQueue::new("a")]), "keys").await;
    let script = vec![
        Op::Enqueue(vec![NewTask::new("t", json!(0)).idempotency_key("k0")]),
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)),
            NewTask::new("t", json!(0)).idempotency_key("k0"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
            NewTask::new("t", json!(3)).idempotency_key("k1"),
        ]),
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)),
            NewTask::new("t", json!(0)).idempotency_key("k0"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
            NewTask::new("t", json!(2)).idempotency_key("k1"),
        ]),
        Op::Enqueue(vec![NewTask::new("other", json!(0)).idempotency_key("k0")]),
        Op::Enqueue(vec![NewTask::new("t", json!(9)).queue("b"), NewTask::new("t", json!(0)).idempotency_key("k0")]),
        Op::Enqueue(vec![NewTask::new("t", json!(0)).idempotency_key("k9"), NewTask::new("t", json!(1)).queue("Bad")]),
        Op::Enqueue(vec![NewTask::new("t", json!(1)).run_at(RunAt::DelayMs(100)).good_until(T0.plus_ms(100))]),
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)).idempotency_key("k1"),
            NewTask::new("t", json!(1)).good_until(T0),
        ]),
        Op::Admin(AdminRequest::Cancel { task: TaskId(1) }),
        Op::Enqueue(vec![NewTask::new("t", json!(0)).idempotency_key("k0")]),
        Op::Enqueue(vec![NewTask::new("t", json!(1)).run_at(RunAt::At(DbTime(T0.0 - 5_000)))]),
    ];
    pair.run(&script).await;
}

#[tokio::test]
async fn operator_actions() {
    let app = custom(vec![CustomQueue::new("a"), CustomQueue::new("b").with_priority(2)]);
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "operator").await;
    pair.every_history = true;
    let register = |worker: &str| {
        Op::Db(DbRequest::RegisterWorker(WorkerInfo { worker: w(worker), queues: vec!["a".into()], concurrency: 2 }))
    };
    let at = |run_at| Some(run_at);
    let script = vec![
        Op::Enqueue(vec![
            NewTask::new("t", json!(1)).queue("a").key("k1"),
            NewTask::new("t", json!(2)).queue("a").key("k2"),
            NewTask::new("t", json!(3)).queue("a").key("k3").run_at(RunAt::DelayMs(60_000)),
            NewTask::new("t", json!(4)).queue("b").good_until(T0.plus_ms(10_000)),
            NewTask::new("t", json!(5)).queue("b").key("k5"),
            NewTask::new("t", json!(6)).queue("b").key("k6").run_at(RunAt::DelayMs(60_000)),
        ]),
        register("a"),
        register("b"),
        // 1 runs, 2 is claimed (both a's).
        claim("a", 1, &p, 1, 60_000),
        // Due now and first in its queue; notified.
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(3),
            change: Reschedule { run_at: at(RunAt::Now), priority: Some(-1), retries: None },
        }),
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(4),
            change: Reschedule { run_at: at(RunAt::DelayMs(20_000)), ..Reschedule::default() },
        }),
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(4),
            change: Reschedule { run_at: at(RunAt::At(T0.plus_ms(5_000))), priority: Some(3), retries: Some(2) },
        }),
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(6),
            change: Reschedule { priority: Some(7), ..Reschedule::default() },
        }),
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(1),
            change: Reschedule { run_at: at(RunAt::Now), ..Reschedule::default() },
        }),
        Op::Admin(AdminRequest::Reschedule { task: TaskId(99), change: Reschedule::default() }),
        // More retries spent than the column holds: refused by both, not clamped.
        Op::Admin(AdminRequest::Reschedule {
            task: TaskId(6),
            change: Reschedule { retries: Some(u32::MAX), ..Reschedule::default() },
        }),
        // b takes 3 and 5; 4 is due in 5 s (the wake-up hint).
        claim("b", 1, &p, 0, 60_000),
        Op::Advance(100),
        // By hand: a's running and claimed tasks, a pending one; the holder's writes are lost.
        Op::Admin(AdminRequest::Complete { task: TaskId(1), result: json!({"done": "by hand"}) }),
        finish("a", lease(1, 1), FinishOutcome::Completed(json!("late"))),
        Op::Admin(AdminRequest::Fail { task: TaskId(2), message: "stuck".into() }),
        Op::Db(DbRequest::Start { worker: w("a"), tasks: vec![lease(2, 1)], policy: Arc::clone(&p) }),
        Op::Admin(AdminRequest::Fail { task: TaskId(4), message: "not wanted".into() }),
        Op::Admin(AdminRequest::Complete { task: TaskId(2), result: json!(null) }),
        Op::Admin(AdminRequest::Fail { task: TaskId(99), message: "nope".into() }),
        Op::Admin(AdminRequest::Retry { task: TaskId(4) }),
        // Keys: held tasks run on without theirs, a pending one is cancelled, a finished one's
        // key is freed; freed keys take new tasks.
        Op::Admin(AdminRequest::RemoveKey { key: "k3".into() }),
        Op::Admin(AdminRequest::RemoveKey { key: "k6".into() }),
        Op::Admin(AdminRequest::RemoveKey { key: "k1".into() }),
        Op::Admin(AdminRequest::RemoveKey { key: "k1".into() }),
        Op::Enqueue(vec![
            NewTask::new("t", json!("new")).queue("a").key("k1"),
            NewTask::new("t", json!("new")).queue("a").key("k3"),
        ]),
        // b dies holding a started task and a claimed one: both go back without a retry spent.
        Op::Db(DbRequest::Start { worker: w("b"), tasks: vec![lease(3, 1)], policy: Arc::clone(&p) }),
        Op::Admin(AdminRequest::ForceUnlock { workers: vec![w("b"), w("nobody")] }),
        finish("b", lease(3, 1), FinishOutcome::Completed(json!("late"))),
        Op::Admin(AdminRequest::ForceUnlock { workers: vec![w("b")] }),
        // Paused: no claim takes a's tasks; resumed: notified and claimed again.
        Op::Admin(AdminRequest::Pause { queue: "a".into() }),
        Op::Admin(AdminRequest::Pause { queue: "a".into() }),
        Op::Admin(AdminRequest::Pause { queue: "Bad".into() }),
        claim("c", 1, &p, 1, 60_000),
        Op::Advance(100),
        Op::Admin(AdminRequest::Resume { queue: "a".into() }),
        Op::Admin(AdminRequest::Resume { queue: "a".into() }),
        Op::Admin(AdminRequest::Resume { queue: "b".into() }),
        claim("c", 2, &p, 1, 60_000),
        // Retention: tasks finished 10 s ago and more go, with their histories and keys.
        Op::Advance(10_000),
        Op::Admin(AdminRequest::Complete { task: TaskId(5), result: json!(5) }),
        Op::Admin(AdminRequest::Purge { retention_ms: 5_000, batch: 2 }),
        // Deleting: a finished task goes with its key (k2 takes a new task), a live one and an
        // unknown id are refused.
        Op::Admin(AdminRequest::Delete { task: TaskId(5) }),
        Op::Admin(AdminRequest::Delete { task: TaskId(5) }),
        Op::Admin(AdminRequest::Delete { task: TaskId(1) }),
        Op::Admin(AdminRequest::Delete { task: TaskId(999) }),
        Op::Enqueue(vec![NewTask::new("t", json!("other")).queue("a").key("k2")]),
        Op::Db(DbRequest::Purge { older_than_ms: 5_000, batch: 2 }),
        Op::Advance(1),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
    ];
    pair.run(&script).await;
}

/// A workflow of `tasks` steps (each a task of queue `a` with its index as arguments) and
/// `edges` (parent, child, allow_failed); joins as given (`All` for the rest).
fn workflow(name: &str, steps: u32, edges: &[(u32, u32, bool)], joins: &[(u32, Join)]) -> NewWorkflow {
    let mut workflow = NewWorkflow::new(name);
    for step in 0..steps {
        let join = joins.iter().find(|(s, _)| *s == step).map_or(Join::All, |(_, join)| *join);
        workflow.step(NewTask::new("t", json!(step)).queue("a"), join);
    }
    for &(parent, child, allow_failed) in edges {
        let policy = if allow_failed { EdgePolicy::AllowFailed } else { EdgePolicy::RequireSuccess };
        workflow.edge(StepId(parent), StepId(child), policy);
    }
    workflow
}

#[tokio::test]
async fn workflows_promote_skip_pause_and_cancel_alike() {
    let app = custom(vec![CustomQueue::new("a")]);
    let p = policy(&app, 4);
    let mut pair = Pair::new(app, "workflows").await;
    let failed = |code| FinishOutcome::Failed(error(code));
    let done = |value: i64| FinishOutcome::Completed(json!(value));
    let register =
        Op::Db(DbRequest::RegisterWorker(WorkerInfo { worker: w("a"), queues: vec!["a".into()], concurrency: 4 }));
    let script = vec![
        register,
        // 1: a diamond 0 -> (1, 2) -> 3, tasks 1 to 4.
        Op::Submit(workflow("diamond", 4, &[(0, 1, false), (0, 2, false), (1, 3, false), (2, 3, false)], &[])),
        claim("a", 1, &p, 1, 60_000),
        finish("a", lease(1, 1), done(0)),
        // Both children promoted by that finish; 2 fails, so 3 is skipped while 1 runs on.
        claim("a", 2, &p, 2, 60_000),
        finish("a", lease(3, 1), failed(ErrorCode::TaskError)),
        finish("a", lease(2, 1), done(1)),
        // 2: a chain of five, tasks 5 to 9, whose first is cancelled: the rest skip in turn.
        Op::Submit(workflow("chain", 5, &[(0, 1, false), (1, 2, false), (2, 3, false), (3, 4, false)], &[])),
        Op::Admin(AdminRequest::Cancel { task: TaskId(5) }),
        // 3: fan-in with any, quorum and a recovery edge, tasks 10 to 15: 0, 1, 2 -> 3 (any),
        // 4 (quorum 2), 5 (allow_failed from 0, all).
        Op::Submit(workflow(
            "fan-in",
            6,
            &[(0, 3, false), (1, 3, false), (2, 3, false), (0, 4, false), (1, 4, false), (2, 4, false), (0, 5, true)],
            &[(3, Join::Any), (4, Join::Quorum(2))],
        )),
        // Only its parents decide a waiting step: completing or failing it by hand is refused
        // (regression: PostgreSQL moved it).
        Op::Admin(AdminRequest::Complete { task: TaskId(13), result: json!(1) }),
        Op::Admin(AdminRequest::Fail { task: TaskId(14), message: "by hand".into() }),
        claim("a", 3, &p, 3, 60_000),
        finish("a", lease(10, 1), failed(ErrorCode::TaskError)),
        finish("a", lease(11, 1), done(1)),
        finish("a", lease(12, 1), failed(ErrorCode::TaskTimeout)),
        // A step's task is retried only with its workflow.
        Op::Admin(AdminRequest::Retry { task: TaskId(10) }),
        // 4: paused before its root finishes, then resumed; tasks 16 to 18.
        Op::Submit(workflow("paused", 3, &[(0, 1, false), (0, 2, false)], &[])),
        Op::Workflow(WorkflowAction::Pause, WorkflowId(4)),
        Op::Workflow(WorkflowAction::Pause, WorkflowId(4)),
        claim("a", 4, &p, 4, 60_000),
        finish("a", lease(16, 1), done(0)),
        Op::Advance(1_000),
        Op::Workflow(WorkflowAction::Resume, WorkflowId(4)),
        // Cancelled with one step running and one pending: both are cancelled (the running
        // one's worker finds its lease gone).
        claim("a", 5, &p, 1, 60_000),
        Op::Workflow(WorkflowAction::Cancel, WorkflowId(4)),
        Op::Workflow(WorkflowAction::Cancel, WorkflowId(4)),
        Op::Workflow(WorkflowAction::Resume, WorkflowId(4)),
        // Over: refused.
        Op::Workflow(WorkflowAction::Pause, WorkflowId(1)),
        Op::Workflow(WorkflowAction::Cancel, WorkflowId(1)),
        Op::Workflow(WorkflowAction::Pause, WorkflowId(99)),
        // 5: pauses on a failure before anything is skipped; tasks 19 to 20.
        Op::Submit(workflow("careful", 2, &[(0, 1, false)], &[]).pause_on_error()),
        claim("a", 6, &p, 1, 60_000),
        finish("a", lease(19, 1), failed(ErrorCode::TaskError)),
        Op::Workflow(WorkflowAction::Resume, WorkflowId(5)),
        // Refused whole: a cycle, a key, a run-at past its good-until (on the database's clock).
        Op::Submit(workflow("cycle", 2, &[(0, 1, false), (1, 0, false)], &[])),
        Op::Submit({
            let mut keyed = workflow("keyed", 1, &[], &[]);
            keyed.tasks[0] = NewTask::new("t", json!(0)).queue("a").key("k");
            keyed
        }),
        Op::Submit({
            let mut late = workflow("late", 2, &[(0, 1, false)], &[]);
            late.tasks[1] = NewTask::new("t", json!(1)).queue("a").run_at(RunAt::DelayMs(5_000)).good_until(T0);
            late
        }),
    ];
    pair.run(&script).await;
    assert_reached(&pair.seen, &["workflow submitted", "workflow refused"]);
    // The script reached what it says (the stores agreed on all of it).
    let status = |id| pair.memory.workflow(WorkflowId(id)).map(|w| (w.status, w.steps));
    let steps = |states: &[(TaskState, u32)]| states.iter().copied().collect::<BTreeMap<_, _>>();
    use TaskState::{Cancelled, Completed, Failed, Running, Skipped};
    use canter::workflow::WorkflowStatus as S;
    assert_eq!(status(1), Some((S::Failed, steps(&[(Completed, 2), (Failed, 1), (Skipped, 1)]))));
    assert_eq!(status(2), Some((S::Failed, steps(&[(Cancelled, 1), (Skipped, 4)]))));
    // Any: promoted by one completion; quorum(2): skipped after two failures; the recovery
    // step: promoted by the failure. Both promoted ones were claimed and started since.
    assert_eq!(status(3), Some((S::Running, steps(&[(Completed, 1), (Failed, 2), (Running, 2), (Skipped, 1)]))));
    assert_eq!(status(4), Some((S::Cancelled, steps(&[(Completed, 1), (Cancelled, 2)]))));
    assert_eq!(status(5), Some((S::Failed, steps(&[(Failed, 1), (Skipped, 1)]))));
    assert_eq!(status(6), None, "refused submits write nothing");
}

#[tokio::test]
async fn workflows_retry_alike() {
    let app = custom(vec![CustomQueue::new("a")]);
    let p = policy(&app, 4);
    let mut pair = Pair::new(app, "retries").await;
    let failed = || FinishOutcome::Failed(error(ErrorCode::TaskError));
    let done = |value: i64| FinishOutcome::Completed(json!(value));
    let retry = |id, downstream| Op::Workflow(WorkflowAction::Retry(downstream), WorkflowId(id));
    let script = vec![
        // 1: a diamond 0 -> (1, 2) -> 3, tasks 1 to 4: 2 fails, 3 is skipped.
        Op::Submit(workflow("diamond", 4, &[(0, 1, false), (0, 2, false), (1, 3, false), (2, 3, false)], &[])),
        claim("a", 1, &p, 1, 60_000),
        finish("a", lease(1, 1), done(0)),
        claim("a", 2, &p, 2, 60_000),
        finish("a", lease(3, 1), failed()),
        finish("a", lease(2, 1), done(1)),
        // The failed step runs again; the skipped one waits for it.
        retry(1, false),
        claim("a", 3, &p, 1, 60_000),
        finish("a", lease(3, 2), done(2)),
        claim("a", 4, &p, 1, 60_000),
        finish("a", lease(4, 1), done(3)),
        // Completed: nothing to retry, either way.
        retry(1, false),
        retry(1, true),
        // 2: 0 -> 1 (allow_failed) -> 2, tasks 5 to 7: 0 fails, its recovery 1 and then 2
        // complete; a downstream retry runs all three again, in order.
        Op::Submit(workflow("recovered", 3, &[(0, 1, true), (1, 2, false)], &[])),
        claim("a", 5, &p, 1, 60_000),
        finish("a", lease(5, 1), failed()),
        claim("a", 6, &p, 1, 60_000),
        finish("a", lease(6, 1), done(6)),
        claim("a", 7, &p, 1, 60_000),
        finish("a", lease(7, 1), done(7)),
        retry(2, true),
        claim("a", 8, &p, 1, 60_000),
        finish("a", lease(5, 2), done(5)),
        // 3: pauses on error, 0 -> 1 and 2 alone, tasks 8 to 10: a retry during the pause
        // holds the retried step until the resume.
        Op::Submit(workflow("careful", 3, &[(0, 1, false)], &[]).pause_on_error()),
        claim("a", 9, &p, 4, 60_000),
        finish("a", lease(8, 1), failed()),
        retry(3, false),
        Op::Workflow(WorkflowAction::Resume, WorkflowId(3)),
        // 4: cancelled with its root running, tasks 11 and 12; the worker's late finish is
        // lost; a retry reopens the workflow.
        Op::Submit(workflow("cancelled", 2, &[(0, 1, false)], &[])),
        // Takes 8 (promoted by the resume) and 11.
        claim("a", 10, &p, 2, 60_000),
        Op::Workflow(WorkflowAction::Cancel, WorkflowId(4)),
        finish("a", lease(11, 1), done(11)),
        retry(4, false),
        claim("a", 11, &p, 1, 60_000),
        Op::Advance(1_000),
        finish("a", lease(11, 2), done(11)),
        retry(99, false),
        // 5: pauses on error, task 13; its one step failed, so it is over and no longer paused:
        // a retry runs it (regression: PostgreSQL left it paused).
        Op::Submit(workflow("over", 1, &[], &[]).pause_on_error()),
        claim("a", 12, &p, 2, 60_000),
        finish("a", lease(13, 1), failed()),
        retry(5, false),
    ];
    pair.run(&script).await;
    let status = |id| pair.memory.workflow(WorkflowId(id)).map(|w| (w.status, w.steps));
    let steps = |states: &[(TaskState, u32)]| states.iter().copied().collect::<BTreeMap<_, _>>();
    use TaskState::{Completed, Pending, Running, Waiting};
    use canter::workflow::WorkflowStatus as S;
    assert_eq!(status(1), Some((S::Completed, steps(&[(Completed, 4)]))));
    // 6, promoted by 5's completion, was claimed with 8 and 10.
    assert_eq!(status(2), Some((S::Running, steps(&[(Completed, 1), (Running, 1), (Waiting, 1)]))));
    assert_eq!(status(3), Some((S::Running, steps(&[(Running, 2), (Waiting, 1)]))));
    assert_eq!(status(4), Some((S::Running, steps(&[(Completed, 1), (Running, 1)]))));
    assert_eq!(status(5), Some((S::Running, steps(&[(Pending, 1)]))));
}

#[tokio::test]
async fn big_workflows_notify_in_chunks() {
    // A skip or a cancel of thousands of steps names them to the result waiters in payloads
    // PostgreSQL takes (8,000 bytes at most): in one payload, the statement failed, and a
    // worker's finish of the root with it, again and again (regression).
    let app = custom(vec![CustomQueue::new("a")]);
    let p = policy(&app, 1);
    let mut pair = Pair::new(app, "big").await;
    let wide = |name: &str| {
        let edges: Vec<(u32, u32, bool)> = (1..=2_000).map(|child| (0, child, false)).collect();
        workflow(name, 2_001, &edges, &[])
    };
    let script = vec![
        // 1: tasks 1 to 2,001; the root fails, its 2,000 children are skipped.
        Op::Submit(wide("skipped")),
        claim("a", 1, &p, 1, 60_000),
        finish("a", lease(1, 1), FinishOutcome::Failed(error(ErrorCode::TaskError))),
        // 2: tasks 2,002 to 4,002, cancelled while they wait.
        Op::Submit(wide("cancelled")),
        Op::Workflow(WorkflowAction::Cancel, WorkflowId(2)),
    ];
    pair.run(&script).await;
    let status = |id| pair.memory.workflow(WorkflowId(id)).map(|w| (w.status, w.steps));
    let steps = |states: &[(TaskState, u32)]| states.iter().copied().collect::<BTreeMap<_, _>>();
    use canter::workflow::WorkflowStatus as S;
    assert_eq!(status(1), Some((S::Failed, steps(&[(TaskState::Failed, 1), (TaskState::Skipped, 2_000)]))));
    assert_eq!(status(2), Some((S::Cancelled, steps(&[(TaskState::Cancelled, 2_001)]))));
}

#[tokio::test]
async fn workflows_settle_per_statement_alike() {
    // What one statement finishes is one event for each workflow, settled when the statement
    // ends, with one notification per queue; a purge keeps a workflow's outcome.
    let app = custom(vec![CustomQueue::new("a")]);
    let p = policy(&app, 8);
    let mut pair = Pair::new(app, "statements").await;
    let failed = || FinishOutcome::Failed(error(ErrorCode::TaskError));
    let done = |value: i64| FinishOutcome::Completed(json!(value));
    let finish_all = |completions: Vec<(TaskLease, FinishOutcome)>| {
        let completions =
            completions.into_iter().map(|(task, outcome)| Completion { task, outcome, args: None }).collect();
        Op::Db(DbRequest::Finish { worker: w("a"), completions })
    };
    // 1: tasks 1 to 4; 0 -> 1, 1 -> 2 (allow_failed, priority 2), 0 -> 3 (allow_failed,
    // priority 1).
    let mut levels = workflow("levels", 4, &[(0, 1, false), (1, 2, true), (0, 3, true)], &[]);
    levels.tasks[2].priority = 2;
    levels.tasks[3].priority = 1;
    // 2: tasks 5 to 8, pauses on error; 0 -> 2, 1 -> 3.
    let careful = workflow("careful", 4, &[(0, 2, false), (1, 3, false)], &[]).pause_on_error();
    let script = vec![
        Op::Submit(levels),
        claim("a", 1, &p, 1, 60_000),
        // Skips 1, promotes 3 and, a level down, 2: one notification, priority 1.
        finish("a", lease(1, 1), failed()),
        Op::Submit(careful),
        claim("a", 2, &p, 4, 60_000),
        // A completion before a failure of the careful workflow: paused before anything is
        // promoted; the first workflow completes (its sinks 2 and 3 did).
        finish_all(vec![
            (lease(5, 1), done(5)),
            (lease(6, 1), failed()),
            (lease(3, 1), done(3)),
            (lease(4, 1), done(4)),
        ]),
        Op::Workflow(WorkflowAction::Resume, WorkflowId(2)),
        // 3: a chain, tasks 9 and 10.
        Op::Submit(workflow("chain", 2, &[(0, 1, false)], &[])),
        claim("a", 3, &p, 4, 60_000),
        // The claim in the statement that completes 9 does not take 10, promoted at its end.
        Op::Db(DbRequest::FinishAndClaim {
            worker: w("a"),
            completions: vec![
                Completion { task: lease(9, 1), outcome: done(9), args: None },
                Completion { task: lease(7, 1), outcome: done(7), args: None },
            ],
            token: 4,
            policy: Arc::clone(&p),
            my_running: 0,
            my_claimed: 0,
            start_now: 4,
            lease_ms: 60_000,
        }),
        claim("a", 5, &p, 4, 60_000),
        finish("a", lease(10, 1), done(10)),
        // Every finished row goes; the workflows keep their outcomes.
        Op::Advance(1),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 100 }),
        // Their outcomes stay, but a retry needs the rows: refused.
        Op::Workflow(WorkflowAction::Retry(false), WorkflowId(2)),
    ];
    pair.run(&script).await;
    let status = |id| pair.memory.workflow(WorkflowId(id)).map(|w| (w.status, w.steps.len()));
    use canter::workflow::WorkflowStatus as S;
    assert_eq!(
        (status(1), status(2), status(3)),
        (Some((S::Completed, 0)), Some((S::Failed, 0)), Some((S::Completed, 0)))
    );
}

#[tokio::test]
async fn keys_of_held_tasks_and_idempotency_windows() {
    // Keys move from a held task without writing its row; remove-key, finishing and purge then
    // say the same in both stores.
    let app = AppConfig::default();
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "held keys").await;
    pair.every_history = true;
    let script = vec![
        Op::Enqueue(vec![NewTask::new("t", json!(1)).key("k"), NewTask::new("t", json!(2)).key("gone")]),
        claim("a", 1, &p, 2, 60_000),
        // Both holders run: each key goes to a new task, the runners keep running.
        Op::Enqueue(vec![NewTask::new("t", json!(3)).key("k")]),
        Op::Enqueue(vec![NewTask::new("t", json!(4)).key_with_mode("gone", KeyMode::PreserveRunAt)]),
        Op::Admin(AdminRequest::RemoveKey { key: "gone".into() }),
        finish("a", lease(1, 1), FinishOutcome::Completed(json!("one"))),
        finish("a", lease(2, 1), FinishOutcome::Failed(error(ErrorCode::TaskError))),
        Op::Admin(AdminRequest::Retry { task: TaskId(2) }),
        Op::Enqueue(vec![NewTask::new("t", json!(5)).key("k")]),
        Op::Admin(AdminRequest::RemoveKey { key: "k".into() }),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
        Op::Enqueue(vec![NewTask::new("t", json!(6)).key("k"), NewTask::new("t", json!(7)).key("gone")]),
    ];
    pair.run(&script).await;

    // Idempotency keys keep their finished tasks from purge: forever by default...
    let mut pair = Pair::new(AppConfig::default(), "idempotency forever").await;
    let pay = || NewTask::new("pay", json!({"cents": 100})).idempotency_key("p1");
    let script = vec![
        Op::Enqueue(vec![pay(), NewTask::new("t", json!(1)).key("plain")]),
        Op::Admin(AdminRequest::Complete { task: TaskId(1), result: json!("paid") }),
        Op::Admin(AdminRequest::Complete { task: TaskId(2), result: json!(null) }),
        Op::Advance(3_153_600_000_000),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
        Op::Db(DbRequest::Purge { older_than_ms: 0, batch: 1 }),
        Op::Enqueue(vec![pay()]),
    ];
    pair.run(&script).await;
    assert_eq!(ids(&pair), [1], "the payment stayed and did not run again");

    // ...or for a window after the key was taken (or first relied on by an idempotent enqueue).
    let recovery = RecoveryConfig { idempotency_retention_ms: Some(60_000), ..RecoveryConfig::default() };
    let app = AppConfig { recovery, ..AppConfig::default() };
    let p = policy(&app, 2);
    let mut pair = Pair::new(app, "idempotency window").await;
    let script = vec![
        Op::Enqueue(vec![pay(), NewTask::new("t", json!(1)).key("plain"), NewTask::new("t", json!(2)).key("relied")]),
        claim("a", 1, &p, 1, 60_000),
        finish("a", lease(1, 1), FinishOutcome::Completed(json!("paid"))),
        Op::Advance(30_000),
        Op::Enqueue(vec![NewTask::new("t", json!(2)).idempotency_key("relied")]),
        Op::Admin(AdminRequest::Complete { task: TaskId(2), result: json!(null) }),
        Op::Admin(AdminRequest::Complete { task: TaskId(3), result: json!(null) }),
        Op::Advance(29_999),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
    ];
    pair.run(&script).await;
    assert_eq!(ids(&pair), [1, 3], "the plain key's task went at once");
    let script = vec![Op::Advance(1), Op::Db(DbRequest::Purge { older_than_ms: 0, batch: 2 })];
    pair.run(&script).await;
    assert_eq!(ids(&pair), [3], "the payment went a minute after it was enqueued");
    let script = vec![
        Op::Enqueue(vec![pay()]),
        Op::Advance(29_999),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
    ];
    pair.run(&script).await;
    assert_eq!(ids(&pair), [3, 4]);
    let script = vec![
        Op::Advance(1),
        Op::Admin(AdminRequest::Purge { retention_ms: 0, batch: 2 }),
        Op::Enqueue(vec![NewTask::new("t", json!(2)).idempotency_key("relied")]),
    ];
    pair.run(&script).await;
    assert_eq!(ids(&pair), [4, 5], "a minute after an idempotent enqueue relied on it, the other");
}

/// The ids of the tasks the pair holds (both stores agree, or the step failed).
fn ids(pair: &Pair) -> Vec<i64> {
    pair.memory.list(&TaskFilter::default()).iter().map(|r| r.id.0).collect()
}

// ---------------------------------------------------------------------------------------------
// Random scripts
// ---------------------------------------------------------------------------------------------

const WORKERS: [&str; 3] = ["w1", "w2", "w3"];

/// A claim by `worker` (holding `running` and `claimed` tasks) at `now` under a random policy
/// of `app`.
fn random_claim(
    rng: &mut Rng,
    app: &AppConfig,
    now: DbTime,
    worker: &str,
    running: usize,
    claimed: usize,
    tokens: &mut u64,
) -> Op {
    let soft = app.prefetch_buffer > 0;
    let mut queues: Vec<QueuePolicy> =
        app.queues().into_iter().filter(|_| rng.chance(0.85)).map(QueuePolicy::from).collect();
    queues.sort_by_key(|q| q.priority);
    let policy = ClaimPolicy {
        concurrency: rng.range(1, 5) as u32,
        prefetch_buffer: app.prefetch_buffer,
        // Hard-cap workers claim ahead of their free slots as their rate of work says.
        claim_ahead: if soft || rng.chance(0.5) { 0 } else { rng.range(1, 4) as u32 },
        max_claim_batch: rng.range(0, 3) as u32,
        max_claim_per_worker: if rng.chance(0.2) { rng.range(1, 4) as u32 } else { 0 },
        cluster_wide_cap: if soft { None } else { app.cluster_wide_cap },
        queues,
        forbidden_flags: if rng.chance(0.3) { vec!["slow".into()] } else { Vec::new() },
        // A claim of urgent tasks alone, now and then.
        max_priority: rng.chance(0.15).then(|| rng.range(0, 4) as i16 - 2),
        // A pass through a backlog, which leaves more urgent tasks to urgent claims, now and
        // then: taken from the claim count, not the random stream, so that the scripts reach
        // what they reached before floors came.
        min_priority: (*tokens % 13 == 6).then(|| (*tokens % 3) as i16 - 1),
        // A pass woken only by enqueues that announced their run-ats, now and then (from the
        // claim count too): from now, or up to 1.6 s before.
        min_run_at: (*tokens % 17 == 9).then(|| DbTime(now.0 - (*tokens % 5) as i64 * 400)),
    };
    *tokens += 1;
    Op::Db(DbRequest::Claim {
        worker: w(worker),
        token: *tokens % 4,
        policy: Arc::new(policy),
        my_running: running as u32,
        my_claimed: claimed as u32,
        start_now: rng.range(0, 4) as u32,
        lease_ms: [500, 2_000, 60_000][rng.range(0, 3) as usize],
    })
}

/// The next operation, chosen from what the memory store holds now; with `operator`, the
/// operator actions (reschedule, complete and fail by hand, force-unlock, remove key, purge,
/// pause, resume) are in the mix too (without, the scripts are those of the worker protocol).
fn random_op(rng: &mut Rng, memory: &MemoryStore, now: DbTime, tokens: &mut u64, operator: bool, faults: bool) -> Op {
    let app = memory.app().clone();
    let locked: BTreeSet<TaskId> = memory.locked_rows().clone();
    let worker = WORKERS[rng.range(0, 3) as usize];
    let held = |state: TaskState| -> Vec<TaskLease> {
        memory
            .tasks()
            .filter(|t| t.state == state && t.claimed_by.as_ref().is_some_and(|c| c.0 == worker))
            .map(|t| TaskLease { task: t.id, lease: t.lease })
            .collect()
    };
    let max_id = memory.tasks().map(|t| t.id.0).max().unwrap_or(0);
    // Sometimes a stale or foreign lease, sometimes a duplicate.
    let pick = |rng: &mut Rng, mut tasks: Vec<TaskLease>| -> Vec<TaskLease> {
        if rng.chance(0.3) && max_id > 0 {
            let id = rng.range(1, max_id as u64 + 2) as i64;
            tasks.push(TaskLease { task: TaskId(id), lease: Lease(rng.range(0, 3) as i64) });
        }
        if rng.chance(0.15) && !tasks.is_empty() {
            let i = rng.range(0, tasks.len() as u64) as usize;
            tasks.push(tasks[i]);
        }
        tasks.retain(|_| rng.chance(0.85));
        tasks
    };
    let base = if operator { 115 } else { 100 };
    let roll = rng.range(0, base + if faults { 16 } else { 0 });
    // Bad data and locks come after the other kinds: their rolls are 200 and up.
    let roll = if roll >= base { 200 + roll - base } else { roll };
    let any_id = |rng: &mut Rng| TaskId(rng.range(1, max_id as u64 + 2) as i64);
    let any_queue = |rng: &mut Rng| {
        let queues = app.queues();
        queues[rng.range(0, queues.len() as u64) as usize].name.clone()
    };
    match roll {
        0..=19 => {
            let n = rng.range(1, 5);
            let queues = app.queues();
            let tasks = (0..n)
                .map(|_| {
                    let queue = if rng.chance(0.03) {
                        "nope".to_owned()
                    } else {
                        queues[rng.range(0, queues.len() as u64) as usize].name.clone()
                    };
                    let mut task = NewTask::new("t", json!({"v": rng.range(0, 3)})).queue(queue);
                    task.priority = rng.range(0, 5) as i16 - 2;
                    task.run_at = match rng.range(0, 4) {
                        0 | 1 => RunAt::Now,
                        2 => RunAt::DelayMs(rng.range(0, 3_000)),
                        _ => RunAt::At(DbTime(now.0 + rng.range(0, 4_000) as i64 - 1_000)),
                    };
                    if rng.chance(0.35) {
                        task.good_until = Some(DbTime(now.0 + rng.range(0, 5_000) as i64));
                    }
                    // A keyed enqueue waits for a locked Pending holder (the memory store does not
                    // model an enqueuer's lock wait): no keys while rows are locked.
                    if rng.chance(0.3) && locked.is_empty() {
                        // Each key has its mode, but now and then another (across batches a key
                        // may change modes; within one it is refused).
                        let key = rng.range(0, 4);
                        let modes =
                            [KeyMode::Idempotent, KeyMode::Replace, KeyMode::PreserveRunAt, KeyMode::UnsafeDedupe];
                        let mode = if rng.chance(0.1) { modes[rng.range(0, 4) as usize] } else { modes[key as usize] };
                        task = task.key_with_mode(format!("k{key}"), mode);
                        if rng.chance(0.3) {
                            task.args = json!([rng.range(0, 3)]);
                        }
                    }
                    if rng.chance(0.25) {
                        task = task.flag("slow");
                    }
                    if rng.chance(0.6) {
                        let policy = if rng.chance(0.5) {
                            RetryPolicy::fixed(vec![1, 2])
                        } else {
                            RetryPolicy::exponential(1, 3).with_codes(vec![ErrorCode::WorkerCrashed])
                        };
                        task.retry = Some(policy.with_jitter(rng.chance(0.5)));
                    }
                    task
                })
                .collect();
            Op::Enqueue(tasks)
        }
        20..=39 => {
            random_claim(rng, &app, now, worker, held(TaskState::Running).len(), held(TaskState::Claimed).len(), tokens)
        }
        40..=49 => {
            let tasks = pick(rng, held(TaskState::Claimed));
            let policy = random_policy(rng, &app);
            Op::Db(DbRequest::Start { worker: w(worker), tasks, policy })
        }
        50..=64 => {
            let completions: Vec<Completion> = pick(rng, held(TaskState::Running))
                .into_iter()
                .map(|task| {
                    let outcome = match rng.range(0, 4) {
                        0 => FinishOutcome::Completed(json!({"r": rng.range(0, 9)})),
                        1 => FinishOutcome::Failed(error(ErrorCode::TaskError)),
                        _ => {
                            FinishOutcome::Retry { error: error(ErrorCode::TaskTimeout), delay_ms: rng.range(0, 3_000) }
                        }
                    };
                    // A batch task's failed items replace its args (ignored on completion).
                    let args = rng.chance(0.3).then(|| json!([rng.range(0, 3)]));
                    Completion { task, outcome, args }
                })
                .collect();
            if !rng.chance(0.3) {
                return Op::Db(DbRequest::Finish { worker: w(worker), completions });
            }
            // The finish and a claim in one statement: the claim counts what the finish freed.
            let running = held(TaskState::Running).len().saturating_sub(completions.len());
            let Op::Db(DbRequest::Claim { token, policy, my_running, my_claimed, start_now, lease_ms, .. }) =
                random_claim(rng, &app, now, worker, running, held(TaskState::Claimed).len(), tokens)
            else {
                unreachable!("random_claim makes claims")
            };
            Op::Db(DbRequest::FinishAndClaim {
                worker: w(worker),
                completions,
                token,
                policy,
                my_running,
                my_claimed,
                start_now,
                lease_ms,
            })
        }
        65..=72 => Op::Db(DbRequest::Heartbeat {
            worker: w(worker),
            claimed: pick(rng, held(TaskState::Claimed)),
            running: pick(rng, held(TaskState::Running)),
            lease_ms: [500, 2_000][rng.range(0, 2) as usize],
            max_renew_age_ms: [0, 1_000, 100_000][rng.range(0, 3) as usize],
            abandoned: Vec::new(),
        }),
        73..=77 => {
            let mut tasks = held(TaskState::Claimed);
            tasks.extend(held(TaskState::Running));
            Op::Db(DbRequest::Release { worker: w(worker), tasks: pick(rng, tasks) })
        }
        78..=79 => Op::Db(DbRequest::AbandonClaim { worker: w(worker), token: rng.range(0, 4) }),
        80..=84 => Op::Db(DbRequest::Reap {
            worker: w("reaper"),
            claimed_stale_ms: rng.chance(0.7).then(|| rng.range(500, 3_000)),
            running_stale_ms: rng.chance(0.7).then(|| rng.range(500, 3_000)),
            entropy: rng.next_u64(),
        }),
        85..=87 => {
            let id = TaskId(rng.range(1, max_id as u64 + 2) as i64);
            // A cancel waits for a locked row (not modelled by the memory store's operator actions).
            if locked.contains(&id) { Op::Advance(1) } else { Op::Admin(AdminRequest::Cancel { task: id }) }
        }
        88..=89 => {
            let failed: Vec<TaskId> = memory.tasks().filter(|t| t.state == TaskState::Failed).map(|t| t.id).collect();
            match failed.is_empty() || rng.chance(0.2) {
                true => Op::Admin(AdminRequest::Retry { task: TaskId(rng.range(1, max_id as u64 + 2) as i64) }),
                false => Op::Admin(AdminRequest::Retry { task: failed[rng.range(0, failed.len() as u64) as usize] }),
            }
        }
        90 => Op::Db(DbRequest::RegisterWorker(WorkerInfo {
            worker: w(worker),
            queues: app.queues().into_iter().map(|q| q.name).collect(),
            concurrency: rng.range(1, 9) as u32,
        })),
        91 if rng.chance(0.5) => Op::Db(DbRequest::DeregisterWorker(w(worker))),
        // Waiting marks decide which enqueues notify (compared after every step).
        91 => Op::Db(DbRequest::SetWaiting {
            worker: w(worker),
            queues: app.queues().into_iter().map(|q| q.name).filter(|_| rng.chance(0.7)).collect(),
            waiting: rng.chance(0.7),
            urgent_below: rng.chance(0.5).then(|| rng.range(0, 5) as i16 - 2),
            stale_ms: [500, 2_000, 100_000][rng.range(0, 3) as usize],
        }),
        92..=99 => Op::Advance(rng.range(0, 1_500)),
        100 | 101 => {
            // Mostly pending tasks, which a reschedule applies to.
            let pending: Vec<TaskId> = memory.tasks().filter(|t| t.state == TaskState::Pending).map(|t| t.id).collect();
            let id = match pending.is_empty() || rng.chance(0.2) {
                true => any_id(rng),
                false => pending[rng.range(0, pending.len() as u64) as usize],
            };
            let run_at = match rng.range(0, 4) {
                0 => None,
                1 => Some(RunAt::Now),
                2 => Some(RunAt::DelayMs(rng.range(0, 4_000))),
                _ => Some(RunAt::At(DbTime(now.0 + rng.range(0, 4_000) as i64 - 1_000))),
            };
            let priority = rng.chance(0.5).then(|| rng.range(0, 5) as i16 - 2);
            let retries = rng.chance(0.4).then(|| rng.range(0, 3) as u32);
            Op::Admin(AdminRequest::Reschedule { task: id, change: Reschedule { run_at, priority, retries } })
        }
        102 | 103 => {
            let live: Vec<TaskId> = memory.tasks().filter(|t| !t.state.is_terminal()).map(|t| t.id).collect();
            let id = match live.is_empty() || rng.chance(0.2) {
                true => any_id(rng),
                false => live[rng.range(0, live.len() as u64) as usize],
            };
            match roll {
                102 => {
                    Op::Admin(AdminRequest::Complete { task: id, result: json!({"by": "hand", "n": rng.range(0, 9)}) })
                }
                _ => Op::Admin(AdminRequest::Fail { task: id, message: "stop".to_owned() }),
            }
        }
        104 | 105 => {
            let mut workers = vec![w(worker)];
            if rng.chance(0.3) {
                workers.push(w(WORKERS[rng.range(0, 3) as usize]));
            }
            Op::Admin(AdminRequest::ForceUnlock { workers })
        }
        106 | 107 => {
            // A key a Claimed or Running task holds, one any task holds, or any (k4 is never
            // used).
            let choice = rng.range(0, 3);
            let keys: Vec<String> = memory
                .tasks()
                .filter(|t| choice == 2 || matches!(t.state, TaskState::Claimed | TaskState::Running))
                .filter_map(|t| t.key.clone())
                .collect();
            match keys.is_empty() || choice == 0 {
                true => Op::Admin(AdminRequest::RemoveKey { key: format!("k{}", rng.range(0, 5)) }),
                false => {
                    Op::Admin(AdminRequest::RemoveKey { key: keys[rng.range(0, keys.len() as u64) as usize].clone() })
                }
            }
        }
        108 | 109 => Op::Admin(AdminRequest::Purge { retention_ms: rng.range(0, 3_000), batch: 2 }),
        110 | 111 => {
            Op::Admin(AdminRequest::Pause { queue: if rng.chance(0.05) { "Bad".to_owned() } else { any_queue(rng) } })
        }
        112 | 113 => Op::Admin(AdminRequest::Resume { queue: any_queue(rng) }),
        114 => {
            // Mostly a finished task; sometimes a live one or an unknown id.
            let finished: Vec<TaskId> = memory.tasks().filter(|t| t.state.is_terminal()).map(|t| t.id).collect();
            let task = match finished.is_empty() || rng.chance(0.2) {
                true => any_id(rng),
                false => finished[rng.range(0, finished.len() as u64) as usize],
            };
            Op::Admin(AdminRequest::Delete { task })
        }
        200..=202 => {
            // Mostly rows in flight, which heartbeats and finishes must get past.
            let live: Vec<(TaskId, TaskState)> = memory
                .tasks()
                .filter(|t| !t.state.is_terminal() && !locked.contains(&t.id))
                .map(|t| (t.id, t.state))
                .collect();
            let in_flight: Vec<TaskId> =
                live.iter().filter(|(_, s)| *s != TaskState::Pending).map(|(id, _)| *id).collect();
            let pool: Vec<TaskId> = if in_flight.is_empty() || rng.chance(0.2) {
                live.iter().map(|(id, _)| *id).collect()
            } else {
                in_flight
            };
            match pool.is_empty() {
                true => Op::Advance(1),
                false => Op::Lock(pool[rng.range(0, pool.len() as u64) as usize]),
            }
        }
        203..=205 => match locked.iter().nth(rng.range(0, locked.len().max(1) as u64) as usize) {
            Some(id) => Op::Unlock(*id),
            None => Op::Advance(1),
        },
        206 | 207 => Op::EnqueueUnreadable(any_queue(rng)),
        212 => Op::TakeToken(w(worker)),
        213 => Op::DropToken(w(worker)),
        214 | 215 => Op::Db(DbRequest::ReapDead {
            worker: w("reaper"),
            grace_ms: [0, 500, 2_000][rng.range(0, 3) as usize],
            entropy: rng.next_u64(),
        }),
        208 | 209 => {
            // A finish whose batch carries a value PostgreSQL refuses: nothing is written.
            let mut completions: Vec<Completion> = pick(rng, held(TaskState::Running))
                .into_iter()
                .map(|task| Completion { task, outcome: FinishOutcome::Completed(json!({"r": 1})), args: None })
                .collect();
            if let Some(first) = completions.first_mut() {
                first.outcome = match rng.range(0, 3) {
                    0 => FinishOutcome::Completed(json!({"from_c": "nul\u{0}"})),
                    1 => FinishOutcome::Failed(TaskError::new(ErrorCode::TaskError, "nul\u{0}")),
                    _ => FinishOutcome::Failed(error(ErrorCode::TaskError).with_data(json!(["\u{0}"]))),
                };
            }
            Op::Db(DbRequest::Finish { worker: w(worker), completions })
        }
        _ => {
            // A beat that names only some of what the worker holds: the rest is what claims it
            // abandoned left behind (claims use tokens 0 to 3).
            let mut claimed = pick(rng, held(TaskState::Claimed));
            let mut running = pick(rng, held(TaskState::Running));
            claimed.retain(|_| rng.chance(0.5));
            running.retain(|_| rng.chance(0.5));
            Op::Db(DbRequest::Heartbeat {
                worker: w(worker),
                claimed,
                running,
                lease_ms: [500, 2_000][rng.range(0, 2) as usize],
                max_renew_age_ms: [0, 1_000, 100_000][rng.range(0, 3) as usize],
                abandoned: (0..4).filter(|_| rng.chance(0.5)).collect(),
            })
        }
    }
}

fn random_policy(rng: &mut Rng, app: &AppConfig) -> Arc<ClaimPolicy> {
    let mut p = (*policy(app, rng.range(1, 5) as u32)).clone();
    if app.prefetch_buffer > 0 {
        for q in &mut p.queues {
            if rng.chance(0.3) {
                q.max_concurrency = Some(rng.range(0, 3) as u32);
            }
        }
    }
    Arc::new(p)
}

fn apps() -> Vec<(&'static str, AppConfig)> {
    vec![
        ("default", AppConfig::default()),
        (
            "hard",
            AppConfig {
                cluster_wide_cap: Some(5),
                // Crashed runs fail here, as in the seed systems; the other apps run them again.
                recovery: RecoveryConfig { crash_retries: 0, ..RecoveryConfig::default() },
                ..custom(vec![
                    CustomQueue::new("a").with_priority(2),
                    CustomQueue::new("b").with_priority(1).with_max_concurrency(2),
                    CustomQueue::new("c").with_priority(3).with_max_concurrency(1),
                ])
            },
        ),
        (
            "soft",
            AppConfig {
                prefetch_buffer: 2,
                claim_lease_ms: Some(2_000),
                ..custom(vec![
                    CustomQueue::new("a").with_max_concurrency(2),
                    CustomQueue::new("b").with_priority(2),
                    CustomQueue::new("s").with_priority(3).serial(),
                ])
            },
        ),
    ]
}

/// Runs the random scripts of every app for `CANTER_CONFORMANCE_SEEDS` seeds (default 2) and
/// returns what their replies showed.
async fn random_scripts(operator: bool, faults: bool) -> BTreeMap<&'static str, usize> {
    let seeds: u64 = std::env::var("CANTER_CONFORMANCE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let steps = 200;
    let mut seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (name, app) in apps() {
        for seed in 0..seeds {
            let label = format!(
                "{name}{}{} seed {seed}",
                if operator { " operator" } else { "" },
                if faults { " bad data and locks" } else { "" }
            );
            let mut pair = Pair::new(app.clone(), &label).await;
            let mut rng = Rng::new(seed.wrapping_mul(0x9E37_79B9) ^ name.len() as u64);
            let mut tokens = 0;
            let mut kinds: BTreeMap<&'static str, usize> = BTreeMap::new();
            for _ in 0..steps {
                let op = random_op(&mut rng, &pair.memory, pair.now, &mut tokens, operator, faults);
                *kinds.entry(kind(&op)).or_default() += 1;
                pair.apply(&op).await;
            }
            pair.compare_state(true).await;
            for (feature, n) in &pair.seen {
                *seen.entry(feature).or_default() += n;
            }
            assert!(kinds.len() >= 10, "{label}: too few kinds of operations: {kinds:?}");
        }
    }
    seen
}

fn assert_reached(seen: &BTreeMap<&'static str, usize>, expected: &[&str]) {
    let missing: Vec<&str> = expected.iter().copied().filter(|f| !seen.contains_key(f)).collect();
    assert!(missing.is_empty(), "the random scripts never reached {missing:?} (seen: {seen:?})");
}

#[tokio::test]
async fn random_scripts_agree() {
    let seen = random_scripts(false, false).await;
    let expected = [
        "enqueued",
        "payload mismatch",
        "run_at after good_until",
        "refused",
        "claimed",
        "claimed and started",
        "re-claimed",
        "more",
        "floor left a more urgent task",
        "run-at bound left an earlier task",
        "wake-up hint",
        "started",
        "expired at start",
        "deferred",
        "start lost",
        "completed",
        "failed",
        "retried",
        "finish lost",
        "heartbeat lost",
        "released",
        "release lost",
        "reaped claimed",
        "reaped and retried",
        "reaped and failed",
        "finished and claimed",
        "expired pending",
        "waiting mark written",
    ];
    assert_reached(&seen, &expected);
}

#[tokio::test]
async fn random_scripts_with_operator_actions_agree() {
    let seen = random_scripts(true, false).await;
    let expected = [
        "claimed",
        "completed",
        "retried",
        "finish lost",
        "rescheduled",
        "reschedule refused",
        "completed by hand",
        "finish by hand refused",
        "failed by hand",
        "force-unlocked",
        "key of a pending task",
        "key of a held task",
        "key of a finished task",
        "unknown key",
        "purged",
        "paused",
        "resumed",
    ];
    assert_reached(&seen, &expected);
}

fn kind(op: &Op) -> &'static str {
    match op {
        Op::Enqueue(_) => "enqueue",
        Op::Db(request) => request.kind(),
        Op::Admin(request) => request.name(),
        Op::Advance(_) => "advance",
        Op::Lock(_) => "lock",
        Op::Unlock(_) => "unlock",
        Op::EnqueueUnreadable(_) => "enqueue unreadable",
        Op::TakeToken(_) => "take token",
        Op::DropToken(_) => "drop token",
        Op::Submit(_) => "submit workflow",
        Op::Workflow(..) => "workflow action",
    }
}

#[tokio::test]
async fn random_scripts_with_bad_data_and_locks_agree() {
    let seen = random_scripts(false, true).await;
    let expected = [
        "claimed",
        "completed",
        "row locked",
        "refused: invalid",
        "refused: lock timeout",
        "heartbeat busy",
        "claimed unreadable",
        "late claim handed back",
        "token taken",
        "dead worker",
    ];
    assert_reached(&seen, &expected);
}

// ---------------------------------------------------------------------------------------------
// Random workflow scripts
// ---------------------------------------------------------------------------------------------

/// A random workflow over `app`'s queues: a chain, stacked diamonds, a fan-out, a fan-in or a
/// random DAG (edges from lower to higher steps only, so no cycle) of 1 to 12 steps, with
/// random joins and edge policies, sometimes paused on error, its steps spread over the queues
/// with now and then a priority, a delay, a good-until or a retry policy. One in twenty is
/// invalid (a cycle, a self edge, a bad join, a key, an unknown queue, no name): both stores
/// must refuse it alike.
fn random_workflow(rng: &mut Rng, app: &AppConfig, now: DbTime, number: u64) -> NewWorkflow {
    // Small graphs more often than large ones: they run to their end within a script.
    let most = rng.range(2, 14);
    let steps = rng.range(1, most) as u32;
    let shape = rng.range(0, 5) as usize;
    let edges = canter::sim::workflows::random_edges(rng, steps, shape, 3);
    let mut parents = vec![0u32; steps as usize];
    for &(_, child) in &edges {
        parents[child as usize] += 1;
    }
    let mut workflow = NewWorkflow::new(format!("wf{number}"));
    if rng.chance(0.3) {
        workflow = workflow.pause_on_error();
    }
    let queues = app.queues();
    for (step, &n) in parents.iter().enumerate() {
        let join = match (n, rng.range(0, 10)) {
            (0, _) | (_, 0..=4) => Join::All,
            (_, 5..=7) => Join::Any,
            _ => Join::Quorum(rng.range(1, u64::from(n) + 1) as u32),
        };
        let queue = queues[rng.range(0, queues.len() as u64) as usize].name.clone();
        let mut task = NewTask::new("step", json!({"wf": number, "step": step})).queue(queue);
        if rng.chance(0.3) {
            task.priority = rng.range(0, 5) as i16 - 2;
        }
        if rng.chance(0.15) {
            task.run_at = RunAt::DelayMs(rng.range(0, 3_000));
        }
        if rng.chance(0.15) {
            task.good_until = Some(DbTime(now.0 + rng.range(500, 8_000) as i64));
        }
        if rng.chance(0.4) {
            task.retry = Some(RetryPolicy::fixed(vec![1, 2]).with_jitter(rng.chance(0.5)));
        }
        if rng.chance(0.15) {
            task = task.flag("slow");
        }
        workflow.step(task, join);
    }
    for (parent, child) in edges {
        let policy = if rng.chance(0.25) { EdgePolicy::AllowFailed } else { EdgePolicy::RequireSuccess };
        workflow.edge(StepId(parent), StepId(child), policy);
    }
    if rng.chance(0.08) {
        let last = steps - 1;
        match rng.range(0, 7) {
            // A cycle: an edge back against an existing one (or a step waiting for itself).
            0 => match workflow.spec.edges.first().copied() {
                Some(edge) => workflow.edge(edge.child, edge.parent, EdgePolicy::RequireSuccess),
                None => workflow.edge(StepId(0), StepId(0), EdgePolicy::RequireSuccess),
            },
            1 => workflow.tasks[last as usize] = workflow.tasks[last as usize].clone().key("k-step"),
            2 => workflow.tasks[0].queue = Some("nope".to_owned()),
            3 => workflow.spec.steps[0].join = Join::Any,
            4 => workflow.spec.steps[last as usize].join = Join::Quorum(parents[last as usize] + 1),
            5 => workflow.name = String::new(),
            _ => workflow.edge(StepId(0), StepId(steps), EdgePolicy::RequireSuccess),
        }
    }
    workflow
}

/// Every workflow the memory store holds, by id (both stores agree, or the step failed).
fn workflow_records(memory: &MemoryStore) -> Vec<WorkflowRecord> {
    (1..).map(WorkflowId).map_while(|id| memory.workflow(id)).collect()
}

/// The next operation of a workflow script: a submit, an action on a workflow (known or not),
/// an operator's action on a step's task (cancel, complete, fail, retry, whatever its state), a
/// finish of several steps one worker holds with mixed outcomes, or else what [`random_op`]
/// chooses (with the operator actions) from what the memory store holds.
fn random_workflow_op(rng: &mut Rng, memory: &MemoryStore, now: DbTime, tokens: &mut u64) -> Op {
    let records = workflow_records(memory);
    let flows = records.len() as u64;
    let steps: Vec<(TaskId, TaskState)> =
        memory.tasks().filter(|t| memory.step_of(t.id).is_some()).map(|t| (t.id, t.state)).collect();
    let any_step = |rng: &mut Rng, states: &[TaskState]| -> Option<TaskId> {
        let pool: Vec<TaskId> =
            steps.iter().filter(|(_, s)| states.is_empty() || states.contains(s)).map(|(id, _)| *id).collect();
        (!pool.is_empty()).then(|| pool[rng.range(0, pool.len() as u64) as usize])
    };
    match rng.range(0, 100) {
        0..=5 => Op::Submit(random_workflow(rng, memory.app(), now, flows + 1)),
        6..=12 => {
            use canter::workflow::WorkflowStatus as S;
            let (action, fits): (_, &[S]) = match rng.range(0, 13) {
                0..=2 => (WorkflowAction::Pause, &[S::Running]),
                3..=7 => (WorkflowAction::Resume, &[S::Paused]),
                8 | 9 => (WorkflowAction::Cancel, &[S::Running, S::Paused]),
                _ => (WorkflowAction::Retry(rng.chance(0.5)), &[S::Failed, S::Cancelled, S::Paused]),
            };
            // Mostly a workflow the action fits; else any id, unknown ones included.
            let fit: Vec<WorkflowId> = records.iter().filter(|f| fits.contains(&f.status)).map(|f| f.id).collect();
            let id = match fit.is_empty() || rng.chance(0.3) {
                true => WorkflowId(rng.range(1, flows + 3) as i64),
                false => fit[rng.range(0, fit.len() as u64) as usize],
            };
            Op::Workflow(action, id)
        }
        13..=19 => {
            use TaskState::{Claimed, Failed, Pending, Running, Waiting};
            let (request, states): (fn(TaskId) -> AdminRequest, &[TaskState]) = match rng.range(0, 4) {
                0 => (|task| AdminRequest::Cancel { task }, &[Waiting, Pending, Claimed]),
                1 => (|task| AdminRequest::Complete { task, result: json!("by hand") }, &[Waiting, Pending, Running]),
                2 => (|task| AdminRequest::Fail { task, message: "stop".to_owned() }, &[Waiting, Claimed, Running]),
                _ => (|task| AdminRequest::Retry { task }, &[Failed]),
            };
            let states = if rng.chance(0.2) { &[] } else { states };
            match any_step(rng, states) {
                Some(task) => Op::Admin(request(task)),
                None => Op::Advance(rng.range(0, 500)),
            }
        }
        20..=39 => {
            // A worker finishes what it holds (steps and plain tasks), in any order, with mixed
            // outcomes: so that workflows move on, and some finish steps of one workflow both
            // ways in one statement. Mostly the worker holding the most steps.
            let steps_of = |worker: &str| {
                memory
                    .tasks()
                    .filter(|t| memory.step_of(t.id).is_some() && t.claimed_by.as_ref().is_some_and(|c| c.0 == worker))
                    .filter(|t| matches!(t.state, TaskState::Claimed | TaskState::Running))
                    .count()
            };
            let busiest = WORKERS.into_iter().max_by_key(|worker| steps_of(worker)).unwrap_or(WORKERS[0]);
            let worker = if rng.chance(0.5) { busiest } else { WORKERS[rng.range(0, 3) as usize] };
            let mut completions: Vec<Completion> = memory
                .tasks()
                .filter(|t| matches!(t.state, TaskState::Claimed | TaskState::Running))
                .filter(|t| t.claimed_by.as_ref().is_some_and(|c| c.0 == worker))
                .map(|t| {
                    let outcome = match rng.range(0, 7) {
                        0..=3 => FinishOutcome::Completed(json!({"r": rng.range(0, 9)})),
                        4 | 5 => FinishOutcome::Failed(error(ErrorCode::TaskError)),
                        _ => {
                            FinishOutcome::Retry { error: error(ErrorCode::TaskTimeout), delay_ms: rng.range(0, 2_000) }
                        }
                    };
                    Completion { task: TaskLease { task: t.id, lease: t.lease }, outcome, args: None }
                })
                .collect();
            // Now and then two steps of one workflow finish both ways, the completion first.
            let mut by_flow: BTreeMap<WorkflowId, Vec<usize>> = BTreeMap::new();
            for (i, c) in completions.iter().enumerate() {
                if let Some((flow, _)) = memory.step_of(c.task.task) {
                    by_flow.entry(flow).or_default().push(i);
                }
            }
            if let Some(pair) = by_flow.values().find(|steps| steps.len() >= 2).filter(|_| rng.chance(0.5)) {
                let (first, second) = (pair[0], pair[1]);
                completions[first].outcome = FinishOutcome::Completed(json!("first"));
                completions[second].outcome = FinishOutcome::Failed(error(ErrorCode::TaskError));
                completions.swap(0, first);
                let second = if second == 0 { first } else { second };
                completions.swap(1, second);
            } else {
                for i in (1..completions.len()).rev() {
                    completions.swap(i, rng.range(0, i as u64 + 1) as usize);
                }
            }
            Op::Db(DbRequest::Finish { worker: w(worker), completions })
        }
        40..=54 => {
            // Claims that start what they take, so that steps run and finish.
            let worker = WORKERS[rng.range(0, 3) as usize];
            match random_claim(rng, memory.app(), now, worker, 0, 0, tokens) {
                Op::Db(DbRequest::Claim { worker, token, policy, my_running, my_claimed, lease_ms, .. }) => {
                    let start_now = rng.range(1, 5) as u32;
                    Op::Db(DbRequest::Claim { worker, token, policy, my_running, my_claimed, start_now, lease_ms })
                }
                other => other,
            }
        }
        _ => match random_op(rng, memory, now, tokens, true, false) {
            // Fewer plain tasks: steps are what these scripts are about.
            Op::Enqueue(_) if rng.chance(0.7) => Op::Advance(rng.range(0, 1_000)),
            op => op,
        },
    }
}

/// What a workflow script's step reached, from the memory store before and after it (both
/// stores agreed on the after, or the step failed).
fn workflow_features(
    op: &Op,
    before: &MemoryStore,
    steps_before: &BTreeMap<TaskId, TaskState>,
    flows_before: &[WorkflowRecord],
    after: &MemoryStore,
) -> Vec<&'static str> {
    use canter::workflow::WorkflowStatus as S;
    let mut seen = Vec::new();
    for (id, &was) in steps_before {
        let now = after.task(*id).map(|t| t.state);
        match (was, now) {
            (TaskState::Waiting, Some(TaskState::Pending)) => seen.push("promoted"),
            (TaskState::Waiting, Some(TaskState::Skipped)) => seen.push("skipped"),
            (TaskState::Waiting, Some(TaskState::Cancelled)) if matches!(op, Op::Admin(_)) => {
                seen.push("waiting step cancelled")
            }
            _ => {}
        }
    }
    let flows = workflow_records(after);
    for flow in &flows {
        let was = flows_before.iter().find(|f| f.id == flow.id).map(|f| f.status);
        match (was, flow.status, op) {
            (Some(S::Running), S::Paused, Op::Workflow(..)) => seen.push("workflow paused"),
            (Some(S::Running), S::Paused, _) => seen.push("paused by error"),
            (Some(S::Paused), S::Running, _) => seen.push("workflow resumed"),
            (Some(S::Failed | S::Cancelled), S::Running | S::Paused, Op::Workflow(WorkflowAction::Retry(down), _)) => {
                seen.push(if *down { "workflow retried downstream" } else { "workflow retried" })
            }
            (Some(S::Running | S::Paused), S::Cancelled, _) => seen.push("workflow cancelled"),
            (Some(S::Running | S::Paused), S::Completed, _) => seen.push("workflow completed"),
            (Some(S::Running | S::Paused), S::Failed, _) => seen.push("workflow failed"),
            _ => {}
        }
    }
    match op {
        Op::Workflow(_, id) if flows_before.iter().all(|f| f.id != *id) => seen.push("unknown workflow"),
        Op::Workflow(_, id) if flows_before.iter().any(|f| f.id == *id && f.status.is_finished()) => {
            seen.push("action on a finished workflow")
        }
        Op::Admin(AdminRequest::Retry { task }) if before.step_of(*task).is_some() => seen.push("step retry refused"),
        Op::Admin(AdminRequest::Complete { task, .. } | AdminRequest::Fail { task, .. })
            if steps_before.get(task) == Some(&TaskState::Waiting) =>
        {
            seen.push("finish of a waiting step refused")
        }
        Op::Db(DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. }) => {
            // A completion and a failure of steps of one workflow that pauses on error, both
            // applied by the one statement.
            let mut outcomes: BTreeMap<WorkflowId, BTreeSet<TaskState>> = BTreeMap::new();
            for completion in completions {
                let id = completion.task.task;
                let Some((flow, _)) = before.step_of(id) else { continue };
                let careful = flows_before.iter().any(|f| f.id == flow && f.on_error == OnError::Pause);
                let state = after.task(id).map(|t| t.state);
                if careful && steps_before.get(&id) != state.as_ref() {
                    outcomes.entry(flow).or_default().extend(state);
                }
            }
            if outcomes.values().any(|s| s.contains(&TaskState::Completed) && s.contains(&TaskState::Failed)) {
                seen.push("completion and failure of a careful workflow in one finish");
            }
        }
        _ => {}
    }
    seen
}

/// Runs random workflow scripts over every app for `CANTER_CONFORMANCE_SEEDS` seeds (default
/// 2) and returns what they reached.
async fn random_workflow_scripts() -> BTreeMap<&'static str, usize> {
    let seeds: u64 = std::env::var("CANTER_CONFORMANCE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let steps = 150;
    let mut seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (name, app) in apps() {
        for seed in 0..seeds {
            let label = format!("{name} workflows seed {seed}");
            let mut pair = Pair::new(app.clone(), &label).await;
            let mut rng = Rng::new(seed.wrapping_mul(0x5851_F42D) ^ 0xF10 ^ name.len() as u64);
            let mut tokens = 0;
            for _ in 0..steps {
                let op = random_workflow_op(&mut rng, &pair.memory, pair.now, &mut tokens);
                let before = pair.memory.clone();
                let steps_before: BTreeMap<TaskId, TaskState> =
                    before.tasks().filter(|t| before.step_of(t.id).is_some()).map(|t| (t.id, t.state)).collect();
                let flows_before = workflow_records(&before);
                pair.apply(&op).await;
                for feature in workflow_features(&op, &before, &steps_before, &flows_before, &pair.memory) {
                    pair.see(feature);
                }
            }
            pair.compare_state(true).await;
            for (feature, n) in &pair.seen {
                *seen.entry(feature).or_default() += n;
            }
        }
    }
    seen
}

#[tokio::test]
async fn random_workflow_scripts_agree() {
    let seen = random_workflow_scripts().await;
    let expected = [
        "workflow submitted",
        "workflow refused",
        "promoted",
        "skipped",
        "paused by error",
        "workflow paused",
        "workflow resumed",
        "workflow cancelled",
        "workflow retried",
        "workflow retried downstream",
        "workflow completed",
        "workflow failed",
        "unknown workflow",
        "action on a finished workflow",
        "waiting step cancelled",
        "finish of a waiting step refused",
        "step retry refused",
        "completion and failure of a careful workflow in one finish",
        "claimed and started",
        "expired pending",
    ];
    assert_reached(&seen, &expected);
}
