//! The raw baseline: the same workloads with the least hand-written SQL that does the same work
//! (tasks with a payload, claimed with `FOR UPDATE SKIP LOCKED`, results kept, notifications
//! on enqueue), through sqlx with its statement cache and no library.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use tokio::time::Instant;

use super::{
    BenchError, Options, Paced, Sample, Scratch, Workload, checkpoint, connect, failed, steady, task_args,
    wal_position, wal_since,
};

const CREATE: &str = "\
CREATE SCHEMA {s};
CREATE TABLE {s}.jobs (
    id          bigserial   PRIMARY KEY,
    state       text        NOT NULL DEFAULT 'pending',
    payload     jsonb       NOT NULL,
    result      jsonb,
    attempts    integer     NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
CREATE INDEX jobs_pending_idx ON {s}.jobs (id) WHERE state = 'pending';";

const ENQUEUE_ONE: &str = "\
WITH j AS (INSERT INTO {s}.jobs (payload) VALUES ($1) RETURNING id)
SELECT j.id FROM (SELECT pg_notify($2, '')) n, j";

const ENQUEUE_MANY: &str = "\
WITH j AS (INSERT INTO {s}.jobs (payload) SELECT p FROM unnest($1::jsonb[]) AS p RETURNING id)
SELECT j.id FROM (SELECT pg_notify($2, '')) n, j";

const CLAIM: &str = "\
WITH c AS (SELECT id FROM {s}.jobs WHERE state = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
UPDATE {s}.jobs j SET state = 'running', attempts = j.attempts + 1 FROM c WHERE j.id = c.id
RETURNING j.id, j.payload";

/// The workflow workloads' baseline: each job waits for its parents (`waiting_on` of them
/// unfinished), and the statement that completes a parent makes its children whose last parent
/// it was pending; loops poll (1 ms) while jobs wait. Jobs and edges are written with the ids
/// the graphs give them.
const CREATE_GRAPH: &str = "\
ALTER TABLE {s}.jobs ADD COLUMN waiting_on integer NOT NULL DEFAULT 0, ADD COLUMN started_at timestamptz;
CREATE TABLE {s}.deps (parent bigint NOT NULL, child bigint NOT NULL, PRIMARY KEY (parent, child));";

const SUBMIT_GRAPH: &str = "\
WITH jobs AS (
    INSERT INTO {s}.jobs (id, state, payload, waiting_on)
    SELECT j.id, CASE WHEN j.waiting_on = 0 THEN 'pending' ELSE 'waiting' END, j.payload, j.waiting_on
    FROM unnest($1::bigint[], $2::jsonb[], $3::integer[]) AS j(id, payload, waiting_on)
)
INSERT INTO {s}.deps (parent, child) SELECT * FROM unnest($4::bigint[], $5::bigint[])";

const CLAIM_GRAPH: &str = "\
WITH c AS (SELECT id FROM {s}.jobs WHERE state = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
UPDATE {s}.jobs j SET state = 'running', attempts = j.attempts + 1, started_at = clock_timestamp() FROM c
WHERE j.id = c.id
RETURNING j.id, j.payload";

const COMPLETE_GRAPH: &str = "\
WITH done AS (
    UPDATE {s}.jobs j SET state = 'done', result = r.result, finished_at = clock_timestamp()
    FROM unnest($1::bigint[], $2::jsonb[]) AS r(id, result) WHERE j.id = r.id
    RETURNING j.id
),
kids AS (SELECT d.child, count(*) AS n FROM {s}.deps d JOIN done ON d.parent = done.id GROUP BY d.child)
UPDATE {s}.jobs j SET waiting_on = j.waiting_on - k.n, state = CASE WHEN j.waiting_on = k.n THEN 'pending' ELSE j.state END
FROM kids k WHERE j.id = k.child";

const COMPLETE: &str = "\
UPDATE {s}.jobs j SET state = 'done', result = r.result, finished_at = now()
FROM unnest($1::bigint[], $2::jsonb[]) AS r(id, result) WHERE j.id = r.id";

#[derive(Clone)]
struct Sql {
    enqueue_one: String,
    enqueue_many: String,
    claim: String,
    complete: String,
    channel: String,
}

impl Sql {
    fn new(scratch: &Scratch) -> Sql {
        let s = scratch.quoted();
        Sql {
            enqueue_one: ENQUEUE_ONE.replace("{s}", &s),
            enqueue_many: ENQUEUE_MANY.replace("{s}", &s),
            claim: CLAIM.replace("{s}", &s),
            complete: COMPLETE.replace("{s}", &s),
            channel: format!("{}_jobs", scratch.name),
        }
    }
}

fn q(sql: &str) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
}

pub(super) async fn run(options: &Options, scratch: &Scratch, workload: Workload) -> Result<Vec<Sample>, BenchError> {
    let pool = connect(&scratch.url, options.raw_loops * options.workers + 4)?;
    let create = CREATE.replace("{s}", &scratch.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&pool).await.map_err(|e| failed("create", e))?;
    let sql = Sql::new(scratch);
    let result = match workload {
        Workload::EnqueueOne | Workload::EnqueueBulk | Workload::EnqueueOneRabbitmq | Workload::EnqueueOneNats => {
            unreachable!("the enqueue workloads run through RawEnqueuer")
        }
        // No baseline: the raw loop has no wake-up provider but NOTIFY, and no processes.
        Workload::LatencyRabbitmq | Workload::LatencyNats => Ok(Vec::new()),
        Workload::IsolatedOverhead | Workload::DrainBlocking | Workload::DrainIsolated => Ok(Vec::new()),
        Workload::Drain => drain(options, &pool, &sql, scratch, 0).await.map(|s| vec![s]),
        Workload::History => {
            fill_history(&pool, scratch, options.history_tasks).await?;
            drain(options, &pool, &sql, scratch, options.history_tasks).await.map(|s| vec![s])
        }
        Workload::Latency => latency(options, scratch, &pool, &sql).await.map(|s| vec![s]),
        // No baseline: the raw loop has no priorities to honour beside a backlog.
        Workload::LatencyUnderLoad => Ok(Vec::new()),
        // No baseline: the raw loop has no dashboard.
        Workload::Watched | Workload::Pooled => Ok(Vec::new()),
        // No baseline: the raw loop has no reconnects to measure.
        Workload::BackendKills => Ok(Vec::new()),
        Workload::FanOut | Workload::FanIn | Workload::Chain | Workload::Diamonds => {
            graph_drain(options, &pool, scratch, workload).await.map(|s| vec![s])
        }
        Workload::HeldXmin | Workload::NoVacuum => {
            let plan = steady::Plan::of(workload, options).expect("a steady workload");
            steady(options, scratch, &pool, &sql, plan).await.map(|s| vec![s])
        }
    };
    pool.close().await;
    result
}

/// The enqueue workloads' client: the jobs table in a fresh schema and a connection per
/// producer.
pub(super) struct RawEnqueuer {
    options: Options,
    pool: PgPool,
    conns: Vec<PoolConnection<Postgres>>,
    sql: Sql,
}

impl RawEnqueuer {
    /// Creates the table and connects (before any clock starts).
    pub(super) async fn new(options: &Options, scratch: &Scratch) -> Result<RawEnqueuer, BenchError> {
        let pool = connect(&scratch.url, options.producers as u32 + 1)?;
        let create = CREATE.replace("{s}", &scratch.quoted());
        sqlx::raw_sql(sqlx::AssertSqlSafe(create)).execute(&pool).await.map_err(|e| failed("create", e))?;
        let mut conns = Vec::with_capacity(options.producers);
        for _ in 0..options.producers {
            conns.push(pool.acquire().await.map_err(|e| failed("connect", e))?);
        }
        let mut sql = Sql::new(scratch);
        if options.raw_quiet {
            for statement in [&mut sql.enqueue_one, &mut sql.enqueue_many] {
                *statement = statement.replace("(SELECT pg_notify($2, '')) n", "(SELECT $2::text) n");
            }
        }
        Ok(RawEnqueuer { options: options.clone(), pool, conns, sql })
    }

    /// Inserts jobs `range` from `--producers` concurrent connections (a part of it each): one
    /// statement per job, or one per part when `bulk`.
    pub(super) async fn enqueue(&mut self, range: Range<usize>, bulk: bool) -> Result<(), BenchError> {
        let (options, sql) = (&self.options, &self.sql);
        let parts = super::split_range(range, options.producers);
        let work = self.conns.iter_mut().zip(parts).map(|(conn, part)| async move {
            if bulk {
                let payloads: Vec<Value> = part.map(|i| task_args(options, i)).collect();
                let rows = q(&sql.enqueue_many)
                    .bind(payloads)
                    .bind(&sql.channel)
                    .fetch_all(&mut **conn)
                    .await
                    .map_err(|e| failed("insert", e))?;
                let _ids: Vec<i64> =
                    rows.iter().map(|r| r.try_get(0)).collect::<Result<_, _>>().map_err(|e| failed("ids", e))?;
                return Ok(());
            }
            for i in part {
                let _id: i64 = q(&sql.enqueue_one)
                    .bind(task_args(options, i))
                    .bind(&sql.channel)
                    .fetch_one(&mut **conn)
                    .await
                    .map_err(|e| failed("insert", e))?
                    .try_get(0)
                    .map_err(|e| failed("insert", e))?;
            }
            Ok::<_, BenchError>(())
        });
        futures::future::try_join_all(work).await?;
        Ok(())
    }

    /// Closes the connections and pool.
    pub(super) async fn close(self) {
        drop(self.conns);
        self.pool.close().await;
    }
}

/// `n` finished jobs in the same table, vacuumed and analyzed.
async fn fill_history(pool: &PgPool, scratch: &Scratch, n: usize) -> Result<(), BenchError> {
    if n == 0 {
        return Ok(());
    }
    let s = scratch.quoted();
    let fill = format!(
        "INSERT INTO {s}.jobs (state, payload, result, attempts, finished_at) \
         SELECT 'done', jsonb_build_object('i', g), 'null'::jsonb, 1, now() FROM generate_series(1, $1::bigint) g"
    );
    q(&fill).bind(n as i64).execute(pool).await.map_err(|e| failed("fill", e))?;
    let vacuum = format!("VACUUM ANALYZE {s}.jobs");
    sqlx::raw_sql(sqlx::AssertSqlSafe(vacuum)).execute(pool).await.map_err(|e| failed("vacuum", e))?;
    Ok(())
}

/// What a handler of a no-op task does with its payload.
fn noop(payload: Value) -> Value {
    std::hint::black_box(payload);
    Value::Null
}

/// Claims up to `batch` jobs, runs them, writes their results: the number claimed.
async fn claim_run_complete(
    conn: &mut PgConnection,
    sql: &Sql,
    batch: u32,
    mut on_start: impl FnMut(&Value),
) -> Result<usize, sqlx::Error> {
    let rows = q(&sql.claim).bind(i64::from(batch)).fetch_all(&mut *conn).await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let mut ids = Vec::with_capacity(rows.len());
    let mut results = Vec::with_capacity(rows.len());
    for row in rows {
        let id: i64 = row.try_get(0)?;
        let payload: Value = row.try_get(1)?;
        on_start(&payload);
        ids.push(id);
        results.push(noop(payload));
    }
    q(&sql.complete).bind(&ids).bind(results).execute(&mut *conn).await?;
    Ok(ids.len())
}

async fn drain(
    options: &Options,
    pool: &PgPool,
    sql: &Sql,
    scratch: &Scratch,
    history: usize,
) -> Result<Sample, BenchError> {
    let loops = (options.raw_loops * options.workers) as usize;
    let mut conns = Vec::with_capacity(loops);
    for _ in 0..loops {
        conns.push(pool.acquire().await.map_err(|e| failed("connect", e))?);
    }
    checkpoint(pool).await;
    let n = options.tasks;
    let mut tx = pool.begin().await.map_err(|e| failed("begin", e))?;
    let mut done = 0;
    while done < n {
        let size = 1_000.min(n - done);
        let payloads: Vec<Value> = (done..done + size).map(|i| task_args(options, i)).collect();
        q(&sql.enqueue_many)
            .bind(payloads)
            .bind(&sql.channel)
            .execute(&mut *tx)
            .await
            .map_err(|e| failed("insert", e))?;
        done += size;
    }
    // As for Canter: statistics as autovacuum would soon have them.
    let analyze = format!("ANALYZE {}.jobs", scratch.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(analyze)).execute(&mut *tx).await.map_err(|e| failed("analyze", e))?;
    tx.commit().await.map_err(|e| failed("commit", e))?;
    let wal_start = wal_position(pool).await;
    let start = Instant::now();

    let claims = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::with_capacity(loops);
    for mut conn in conns {
        let (sql, claims, batch) = (sql.clone(), claims.clone(), options.raw_batch);
        handles.push(tokio::spawn(async move {
            let mut last = None;
            loop {
                let took = claim_run_complete(&mut conn, &sql, batch, |_| {}).await?;
                if took == 0 {
                    return Ok::<_, sqlx::Error>(last);
                }
                claims.fetch_add(1, Ordering::Relaxed);
                last = Some(Instant::now());
            }
        }));
    }
    let mut end = start;
    for handle in handles {
        let last = handle.await.map_err(|e| failed("drain loop", e))?.map_err(|e| failed("drain", e))?;
        end = end.max(last.unwrap_or(start));
    }
    let seconds = (end - start).as_secs_f64();
    let wal = wal_since(pool, wal_start).await;

    let check = format!(
        "SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state <> 'done') FROM {}.jobs",
        scratch.quoted()
    );
    let (finished, left): (i64, i64) =
        sqlx::query_as(sqlx::AssertSqlSafe(check)).fetch_one(pool).await.map_err(|e| failed("count", e))?;
    if left != 0 || finished as usize != n + history {
        return Err(BenchError::Failed(format!(
            "after the raw drain {left} jobs are not done and {finished} are (expected 0 and {})",
            n + history
        )));
    }
    let workload = if history > 0 { "history" } else { "drain" };
    let mut sample = Sample::new(workload, scratch.mode, n, seconds);
    sample.wal_bytes = wal;
    sample.workers = Some(options.workers);
    sample.history = (history > 0).then_some(history);
    sample.claims = Some(claims.load(Ordering::Relaxed));
    Ok(sample)
}

/// An idle raw worker (LISTEN, then claim until empty) on a runtime of its own, stamping each
/// job's start into `stamps` by its payload's `i`.
struct RawListener {
    runtime: tokio::runtime::Runtime,
    stop: tokio::sync::oneshot::Sender<()>,
    worker: tokio::task::JoinHandle<Result<(), sqlx::Error>>,
}

impl RawListener {
    /// Starts it and waits until it listens (and a little more).
    async fn start(
        options: &Options,
        scratch: &Scratch,
        sql: &Sql,
        stamps: &Arc<Mutex<Vec<Option<Instant>>>>,
    ) -> Result<RawListener, BenchError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-raw-worker")
            .enable_all()
            .build()
            .map_err(|e| failed("worker runtime", e))?;
        let (stop, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        let (url, worker_sql, record, batch) = (scratch.url.clone(), sql.clone(), stamps.clone(), options.raw_batch);
        let worker = runtime.spawn(async move {
            let pool = canter_tokio::connect(&url, 2)?;
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(&worker_sql.channel).await?;
            let mut conn = pool.acquire().await?;
            let _ = ready_tx.send(());
            loop {
                loop {
                    let stamp = |payload: &Value| {
                        let now = Instant::now();
                        let i = payload["i"].as_u64().unwrap_or(u64::MAX) as usize;
                        if let Some(slot) = record.lock().unwrap_or_else(PoisonError::into_inner).get_mut(i) {
                            *slot = Some(now);
                        }
                    };
                    if claim_run_complete(&mut conn, &worker_sql, batch, stamp).await? == 0 {
                        break;
                    }
                }
                tokio::select! {
                    note = listener.recv() => { note?; }
                    _ = &mut stop_rx => break,
                }
            }
            drop(conn);
            drop(listener);
            pool.close().await;
            Ok::<_, sqlx::Error>(())
        });
        let started = RawListener { runtime, stop, worker };
        match tokio::time::timeout(Duration::from_secs(30), ready_rx).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                started.stop().await?;
                return Err(BenchError::Failed("the raw worker failed to start".into()));
            }
            Err(_) => {
                let _ = started.stop().await;
                return Err(BenchError::Failed("the raw worker did not start within 30 s".into()));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(started)
    }

    /// Stops it (up to 10 s): its error, if it failed.
    async fn stop(self) -> Result<(), BenchError> {
        let _ = self.stop.send(());
        let stopped = tokio::time::timeout(Duration::from_secs(10), self.worker).await;
        self.runtime.shutdown_background();
        match stopped {
            Ok(Ok(Err(error))) => Err(failed("raw worker", error)),
            _ => Ok(()),
        }
    }
}

/// The raw listener; jobs inserted one at a time with a notification.
async fn latency(options: &Options, scratch: &Scratch, pool: &PgPool, sql: &Sql) -> Result<Sample, BenchError> {
    let n = options.latency_tasks;
    let stamps: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; n]));
    let worker = RawListener::start(options, scratch, sql, &stamps).await?;
    let result = async {
        let mut conn = pool.acquire().await.map_err(|e| failed("connect", e))?;
        let mut paced = Paced::new(options.interval, n);
        for i in 0..n {
            paced.next().await;
            q(&sql.enqueue_one)
                .bind(task_args(options, i))
                .bind(&sql.channel)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| failed("insert", e))?;
            paced.committed();
        }
        paced.sample(scratch.mode, &stamps).await
    }
    .await;
    let stopped = worker.stop().await;
    let sample = result?;
    stopped?;
    Ok(sample)
}

/// A steady workload (see [`steady`]) against the raw listener, jobs inserted in calls of
/// `rate / 100`.
async fn steady(
    options: &Options,
    scratch: &Scratch,
    pool: &PgPool,
    sql: &Sql,
    plan: steady::Plan,
) -> Result<Sample, BenchError> {
    let stamps = steady::prepare(&plan, scratch).await?;
    let worker = RawListener::start(options, scratch, sql, &stamps).await?;
    let result = async {
        let mut conn = pool.acquire().await.map_err(|e| failed("connect", e))?;
        steady::run(plan, scratch, "jobs", &stamps, async |range: Range<usize>| {
            let payloads: Vec<Value> = range.map(|i| task_args(options, i)).collect();
            q(&sql.enqueue_many)
                .bind(payloads)
                .bind(&sql.channel)
                .fetch_all(&mut *conn)
                .await
                .map(|_| true)
                .map_err(|e| failed("insert", e))
        })
        .await
    }
    .await;
    let stopped = worker.stop().await;
    let sample = result?;
    stopped?;
    Ok(sample)
}

/// A workflow workload's graphs as jobs and edges, drained by the raw loops; timed from the
/// commit of the graphs to the last completion, checked by a count. The chain's latency is
/// each parent's finish to its child's start, as Canter's.
async fn graph_drain(
    options: &Options,
    pool: &PgPool,
    scratch: &Scratch,
    workload: Workload,
) -> Result<Sample, BenchError> {
    let s = scratch.quoted();
    sqlx::raw_sql(sqlx::AssertSqlSafe(CREATE_GRAPH.replace("{s}", &s)))
        .execute(pool)
        .await
        .map_err(|e| failed("create", e))?;
    let mut sql = Sql::new(scratch);
    sql.claim = CLAIM_GRAPH.replace("{s}", &s);
    sql.complete = COMPLETE_GRAPH.replace("{s}", &s);
    let (flows, n) = super::canter_mode::workflows(options, workload, options.tasks);
    let (mut ids, mut payloads, mut waiting, mut parents, mut children) = (vec![], vec![], vec![], vec![], vec![]);
    for flow in &flows {
        let base = ids.len() as i64 + 1;
        let mut waits = vec![0i32; flow.tasks.len()];
        for edge in &flow.spec.edges {
            parents.push(base + i64::from(edge.parent.0));
            children.push(base + i64::from(edge.child.0));
            waits[edge.child.index()] += 1;
        }
        for (i, task) in flow.tasks.iter().enumerate() {
            ids.push(base + i as i64);
            payloads.push(task.args.clone());
            waiting.push(waits[i]);
        }
    }
    let loops = (options.raw_loops * options.workers) as usize;
    let mut conns = Vec::with_capacity(loops);
    for _ in 0..loops {
        conns.push(pool.acquire().await.map_err(|e| failed("connect", e))?);
    }
    checkpoint(pool).await;
    let mut tx = pool.begin().await.map_err(|e| failed("begin", e))?;
    q(&SUBMIT_GRAPH.replace("{s}", &s))
        .bind(&ids)
        .bind(payloads)
        .bind(waiting)
        .bind(parents)
        .bind(children)
        .execute(&mut *tx)
        .await
        .map_err(|e| failed("submit", e))?;
    let analyze = format!("ANALYZE {s}.jobs, {s}.deps");
    sqlx::raw_sql(sqlx::AssertSqlSafe(analyze)).execute(&mut *tx).await.map_err(|e| failed("analyze", e))?;
    tx.commit().await.map_err(|e| failed("commit", e))?;
    let wal_start = wal_position(pool).await;
    let start = Instant::now();

    let left = Arc::new(AtomicU64::new(n as u64));
    let claims = Arc::new(AtomicU64::new(0));
    // As generous as Canter's drains: a job that never becomes pending ends the loops, and the
    // count below says what was left.
    let deadline = start + Duration::from_secs(600).max(Duration::from_millis(10 * n as u64));
    let mut handles = Vec::with_capacity(loops);
    for mut conn in conns {
        let (sql, left, claims, batch) = (sql.clone(), left.clone(), claims.clone(), options.raw_batch);
        handles.push(tokio::spawn(async move {
            let mut last = None;
            while left.load(Ordering::Acquire) > 0 {
                let took = claim_run_complete(&mut conn, &sql, batch, |_| {}).await?;
                if took == 0 {
                    if Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                left.fetch_sub(took as u64, Ordering::AcqRel);
                claims.fetch_add(1, Ordering::Relaxed);
                last = Some(Instant::now());
            }
            Ok::<_, sqlx::Error>(last)
        }));
    }
    let mut end = start;
    for handle in handles {
        let last = handle.await.map_err(|e| failed("drain loop", e))?.map_err(|e| failed("drain", e))?;
        end = end.max(last.unwrap_or(start));
    }
    let seconds = (end - start).as_secs_f64();
    let wal = wal_since(pool, wal_start).await;

    let check =
        format!("SELECT count(*) FILTER (WHERE state = 'done'), count(*) FILTER (WHERE state <> 'done') FROM {s}.jobs");
    let (finished, unfinished): (i64, i64) =
        sqlx::query_as(sqlx::AssertSqlSafe(check)).fetch_one(pool).await.map_err(|e| failed("count", e))?;
    if unfinished != 0 || finished as usize != n {
        return Err(BenchError::Failed(format!(
            "after the raw {} drain {unfinished} jobs are not done and {finished} are (expected 0 and {n})",
            workload.name()
        )));
    }
    let mut sample = Sample::new(workload.name(), scratch.mode, n, seconds);
    sample.wal_bytes = wal;
    if workload == Workload::Chain {
        let gaps = format!(
            "SELECT extract(epoch FROM c.started_at - p.finished_at)::float8 * 1000 FROM {s}.deps d \
             JOIN {s}.jobs p ON p.id = d.parent JOIN {s}.jobs c ON c.id = d.child"
        );
        let gaps: Vec<f64> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(gaps)).fetch_all(pool).await.map_err(|e| failed("gaps", e))?;
        sample.latency = Some(super::latency_summary(gaps));
    }
    sample.workers = Some(options.workers);
    sample.claims = Some(claims.load(Ordering::Relaxed));
    Ok(sample)
}
