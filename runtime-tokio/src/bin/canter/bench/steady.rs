//! The steady-load workloads: `held-xmin` and `no-vacuum`. A producer enqueues `--rate` tasks a
//! second (a call of `rate / 100` every 10 ms) to an idle worker for `--duration-s`; each task's
//! pickup latency (enqueue commit to handler start) falls in the window of its commit, and at
//! the end of every window the live table's size and dead rows are read.
//!
//! - `held-xmin`: a transaction of another session (`REPEATABLE READ` with an xid, idle) holds
//!   the xmin from 20 s for `--hold-s` (90) and then rolls back: nothing either mode deletes or
//!   updates in that time can be vacuumed or pruned, and index entries of dead rows stay;
//! - `no-vacuum`: autovacuum disabled on every table of the schema (as on a server running
//!   without it), 10 minutes in windows of a minute: how the live table grows, and latency
//!   with it;
//! - `backend-kills`: from 10 s to 50 s of a minute, every `--kill-every-ms` every other
//!   session of the bench (`application_name` `canter-bench`) is ended with
//!   `pg_terminate_backend`. An enqueue that may or may not have committed is counted and its
//!   tasks left out of the latencies.

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::pool::PoolConnection;
use tokio::time::Instant;

use super::{BenchError, Options, Sample, Scratch, Workload, failed, latency_summary, round};

/// When the xmin is held in `held-xmin`: from this far into the run.
const HOLD_FROM: Duration = Duration::from_secs(20);

/// When `backend-kills` ends sessions: from and until this far into the run.
const KILLS: (Duration, Duration) = (Duration::from_secs(10), Duration::from_secs(50));

/// How long a steady workload runs and what it does meanwhile.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub workload: Workload,
    /// Tasks a second.
    pub rate: u32,
    pub duration: Duration,
    pub window: Duration,
    /// From and until when (since the start) another session holds the xmin.
    pub hold: Option<(Duration, Duration)>,
    /// Autovacuum off on every table of the schema.
    pub no_autovacuum: bool,
    /// From and until when (since the start), and how often, the bench's other sessions are
    /// terminated.
    pub kills: Option<(Duration, Duration, Duration)>,
}

impl Plan {
    /// The plan of `workload` with the command line's `--rate`, `--hold-s`, `--duration-s` and
    /// `--window-s` (each `None` where not given); `None` for the other workloads.
    pub(super) fn of(workload: Workload, options: &Options) -> Option<Plan> {
        let seconds = |s: Option<u64>, default: u64| Duration::from_secs(s.unwrap_or(default));
        match workload {
            Workload::HeldXmin => {
                let hold = seconds(options.hold_s, 90);
                Some(Plan {
                    workload,
                    rate: options.rate,
                    duration: seconds(options.duration_s, (HOLD_FROM + hold).as_secs() + 50),
                    window: seconds(options.window_s, 10),
                    hold: Some((HOLD_FROM, HOLD_FROM + hold)),
                    no_autovacuum: false,
                    kills: None,
                })
            }
            Workload::NoVacuum => Some(Plan {
                workload,
                rate: options.rate,
                duration: seconds(options.duration_s, 600),
                window: seconds(options.window_s, 60),
                hold: None,
                no_autovacuum: true,
                kills: None,
            }),
            Workload::BackendKills => Some(Plan {
                workload,
                rate: options.rate,
                duration: seconds(options.duration_s, 60),
                window: seconds(options.window_s, 10),
                hold: None,
                no_autovacuum: false,
                kills: Some((KILLS.0, KILLS.1, options.kill_every)),
            }),
            _ => None,
        }
    }

    fn windows(&self) -> usize {
        (self.duration.as_millis().div_ceil(self.window.as_millis().max(1))) as usize
    }
}

/// One window of a steady run.
#[derive(Debug, Clone)]
pub(super) struct Window {
    /// Tasks committed in the window.
    pub tasks: usize,
    /// Their pickup latency in ms: p50, p90, p99, max.
    pub latency: [f64; 4],
    /// The live table's size with its indexes at the window's end, in MiB.
    pub live_mib: f64,
    /// Its dead rows then, as the statistics have them.
    pub dead_rows: i64,
    /// Sessions terminated in the window.
    pub kills: u64,
    /// Tasks whose enqueue may or may not have committed (left out of the latencies).
    pub unsure: usize,
}

impl Window {
    pub(super) fn json(&self, index: usize, plan: &Plan) -> Value {
        json!({
            "from_s": index as u64 * plan.window.as_secs(),
            "tasks": self.tasks,
            "p50_ms": round(self.latency[0], 3),
            "p99_ms": round(self.latency[2], 3),
            "max_ms": round(self.latency[3], 3),
            "live_mib": round(self.live_mib, 2),
            "dead_rows": self.dead_rows,
            "kills": self.kills,
            "unsure_enqueues": self.unsure,
        })
    }
}

/// Turns autovacuum off on every table of the scratch schema.
async fn disable_autovacuum(pool: &PgPool, scratch: &Scratch) -> Result<(), BenchError> {
    let tables: Vec<String> = sqlx::query_scalar("SELECT tablename::text FROM pg_tables WHERE schemaname = $1")
        .bind(&scratch.name)
        .fetch_all(pool)
        .await
        .map_err(|e| failed("list tables", e))?;
    for table in tables {
        let sql = format!(
            "ALTER TABLE {}.\"{}\" SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)",
            scratch.quoted(),
            table.replace('"', "\"\"")
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await.map_err(|e| failed("autovacuum off", e))?;
    }
    Ok(())
}

/// Runs `plan` against a worker already waiting: `enqueue(range)` enqueues tasks `range` (whose
/// handlers stamp `stamps[i]` when they start; `Ok(false)`: the enqueue may or may not have
/// committed), and `live_table` is the mode's table of live tasks in the scratch schema.
pub(super) async fn run<E>(
    plan: Plan,
    scratch: &Scratch,
    live_table: &str,
    stamps: &Mutex<Vec<Option<Instant>>>,
    mut enqueue: E,
) -> Result<Sample, BenchError>
where
    E: AsyncFnMut(Range<usize>) -> Result<bool, BenchError>,
{
    let (tick, per_tick) = if plan.rate >= 100 {
        (Duration::from_millis(10), (plan.rate / 100) as usize)
    } else {
        (Duration::from_millis(1_000 / u64::from(plan.rate.max(1))), 1)
    };
    let most = stamps.lock().unwrap_or_else(PoisonError::into_inner).len();
    let mut ticks = tokio::time::interval(tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let began = Instant::now();
    // When each task's enqueue returned, and whether it surely committed.
    let mut committed: Vec<(Instant, bool)> = Vec::with_capacity(most);
    let mut sizes: Vec<(f64, i64)> = Vec::with_capacity(plan.windows());
    // When sessions were terminated, and how many.
    let mut kills: Vec<(Instant, u64)> = Vec::new();
    let mut next_kill = plan.kills.map(|(from, _, _)| from);
    let mut holder: Option<PoolConnection<sqlx::Postgres>> = None;
    let mut held = false;
    let result = async {
        loop {
            ticks.tick().await;
            let elapsed = began.elapsed();
            if elapsed >= plan.window * (sizes.len() as u32 + 1) {
                sizes.push(live_size(&scratch.pool, scratch, live_table).await?);
            }
            if elapsed >= plan.duration {
                break;
            }
            if let Some((from, until)) = plan.hold {
                if !held && elapsed >= from {
                    holder = Some(hold_xmin(&scratch.pool).await?);
                    held = true;
                }
                if elapsed >= until
                    && let Some(mut conn) = holder.take()
                {
                    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.map_err(|e| failed("end the hold", e))?;
                }
            }
            if let (Some((_, until, every)), Some(at)) = (plan.kills, next_kill)
                && elapsed >= at
            {
                kills.push((Instant::now(), terminate_others(&scratch.pool).await?));
                // After a stall, the next kill is `every` from now, not a burst catching up.
                next_kill = Some((at + every).max(elapsed)).filter(|next| *next < until);
            }
            let from = committed.len();
            let to = (from + per_tick).min(most);
            if from == to {
                return Err(BenchError::Failed(format!("more than {most} tasks offered")));
            }
            let sure = enqueue(from..to).await?;
            let now = Instant::now();
            committed.extend(std::iter::repeat_n((now, sure), to - from));
        }
        Ok(())
    }
    .await;
    if let Some(mut conn) = holder.take() {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await;
    }
    result?;
    let n = committed.len();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let waiting = {
            let stamps = stamps.lock().unwrap_or_else(PoisonError::into_inner);
            committed.iter().zip(stamps.iter()).filter(|((_, sure), s)| *sure && s.is_none()).count()
        };
        if waiting == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(BenchError::Failed(format!("{waiting} of {n} tasks did not start within 120 s of the last")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stamps = stamps.lock().unwrap_or_else(PoisonError::into_inner);
    let latency_ms =
        |i: usize| stamps[i].map_or(f64::NAN, |s| s.saturating_duration_since(committed[i].0).as_secs_f64() * 1e3);
    let last = sizes.len().max(1) - 1;
    let window_of = |at: Instant| (((at - began).as_millis() / plan.window.as_millis().max(1)) as usize).min(last);
    let mut by_window: Vec<(Vec<f64>, usize)> = vec![(Vec::new(), 0); last + 1];
    for (i, (at, sure)) in committed.iter().enumerate() {
        let w = &mut by_window[window_of(*at)];
        if *sure { w.0.push(latency_ms(i)) } else { w.1 += 1 }
    }
    let mut kills_by_window = vec![0; last + 1];
    for (at, ended) in kills {
        kills_by_window[window_of(at)] += ended;
    }
    let windows = by_window
        .into_iter()
        .zip(sizes.iter().copied().chain(std::iter::repeat((f64::NAN, 0))))
        .zip(kills_by_window)
        .map(|(((ms, unsure), (live_mib, dead_rows)), kills)| Window {
            tasks: ms.len(),
            latency: latency_summary(ms),
            live_mib,
            dead_rows,
            kills,
            unsure,
        })
        .collect();
    let mut sample = Sample::new(plan.workload.name(), scratch.mode, n, plan.duration.as_secs_f64());
    sample.latency = Some(latency_summary((0..n).filter(|&i| committed[i].1).map(latency_ms).collect()));
    sample.windows = Some((plan, windows));
    Ok(sample)
}

/// Terminates every session of the system under test (not the bench's own, `canter-bench-admin`);
/// how many it ended.
async fn terminate_others(pool: &PgPool) -> Result<u64, BenchError> {
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = 'canter-bench'",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| failed("terminate the other sessions", e))?;
    Ok(ended.max(0) as u64)
}

/// A transaction of its own holding the xmin (a snapshot and an xid), idle until rolled back.
async fn hold_xmin(pool: &PgPool) -> Result<PoolConnection<sqlx::Postgres>, BenchError> {
    let mut conn = pool.acquire().await.map_err(|e| failed("hold the xmin", e))?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT txid_current()")
        .execute(&mut *conn)
        .await
        .map_err(|e| failed("hold the xmin", e))?;
    Ok(conn)
}

/// The live table's size with its indexes in MiB, and its dead rows.
async fn live_size(pool: &PgPool, scratch: &Scratch, table: &str) -> Result<(f64, i64), BenchError> {
    let relation = format!("{}.{table}", scratch.quoted());
    let (bytes, dead): (i64, Option<i64>) = sqlx::query_as(
        "SELECT pg_total_relation_size($1::regclass), \
                (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass)",
    )
    .bind(relation)
    .fetch_one(pool)
    .await
    .map_err(|e| failed("table size", e))?;
    Ok((bytes as f64 / (1024.0 * 1024.0), dead.unwrap_or(0)))
}

/// Stamps enough for `plan` at its rate (and some more: ticks come late, never early).
/// What both modes do before the load starts: autovacuum off when the plan says so, and the
/// start stamps for every task the plan can enqueue.
pub(super) async fn prepare(plan: &Plan, scratch: &Scratch) -> Result<Arc<Mutex<Vec<Option<Instant>>>>, BenchError> {
    if plan.no_autovacuum {
        disable_autovacuum(&scratch.pool, scratch).await?;
    }
    Ok(stamps_for(plan))
}

fn stamps_for(plan: &Plan) -> Arc<Mutex<Vec<Option<Instant>>>> {
    let most = (u64::from(plan.rate) * plan.duration.as_secs() + u64::from(plan.rate) * 2 + 100) as usize;
    Arc::new(Mutex::new(vec![None; most]))
}
