//! Schedules in PostgreSQL: the `schedules` records and one scheduler check.
//!
//! A check ([`PgStore::check_schedules`]) reads every schedule's record and the database's
//! clock in one statement, lets the pure [`Scheduler`] plan, then writes:
//! - records without tasks (new schedules, ticks skipped as missed) in one statement, each by
//!   compare-and-set on the last tick read (or an insert only if there is no record);
//! - each schedule with due ticks in a transaction of its own: the compare-and-set update
//!   first (it holds the row until commit, so a racing scheduler's update waits and then finds
//!   another last tick), then the ticks' tasks in one enqueue, then the last task's id.
//!
//! A write that lost its race enqueued nothing; the check plans again from a fresh read, a
//! few rounds at most, so a tick is enqueued exactly once however many schedulers race.

use std::collections::BTreeMap;

use sqlx::Row;

use crate::postgres::enqueue::{PgEnqueueError, enqueue_many_in};
use crate::postgres::replay::{Replay, in_own_transaction, replayed};
use crate::postgres::store::{PgStore, db_time};
use crate::scheduler::{Plan, ScheduleRecord, ScheduleWrite, Scheduler};
use crate::store::DbTime;
use crate::task::TaskId;

/// How many times one check plans again after losing races before it leaves the rest to the
/// next check.
pub const MAX_CHECK_ROUNDS: u32 = 4;

/// A write that committed, with the ids of the tasks it enqueued (one per tick).
#[derive(Debug, Clone, PartialEq)]
pub struct AppliedWrite {
    /// The write.
    pub write: ScheduleWrite,
    /// The tasks enqueued, in tick order.
    pub task_ids: Vec<TaskId>,
}

/// A write whose tasks the store refused (nothing of it was written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedWrite {
    /// The schedule.
    pub name: String,
    /// Why the enqueue was refused.
    pub error: String,
}

/// What applying a plan did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlanOutcome {
    /// The writes that committed.
    pub applied: Vec<AppliedWrite>,
    /// The schedules whose compare-and-set lost to another scheduler.
    pub lost: Vec<String>,
    /// The writes whose tasks were refused.
    pub refused: Vec<RefusedWrite>,
}

/// What one check did.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// The database's clock at the last read.
    pub now: DbTime,
    /// The writes that committed, over every round.
    pub applied: Vec<AppliedWrite>,
    /// Races lost (each was planned again).
    pub lost: u32,
    /// The writes whose tasks were refused.
    pub refused: Vec<RefusedWrite>,
    /// When to check next: the earliest next tick, or `now` when races were still being lost
    /// after [`MAX_CHECK_ROUNDS`].
    pub next_check: Option<DbTime>,
}

impl CheckReport {
    /// How many tasks the check enqueued.
    pub fn tasks(&self) -> usize {
        self.applied.iter().map(|a| a.task_ids.len()).sum()
    }
}

impl PgStore {
    /// The database's clock and the records of the schedules `names`, in order (`None` for a
    /// schedule without a record), in one statement.
    pub async fn schedule_states(&self, names: &[&str]) -> Result<(DbTime, Vec<Option<ScheduleRecord>>), sqlx::Error> {
        if names.is_empty() {
            return Ok((self.now().await?, Vec::new()));
        }
        let rows = replayed!(self, Replay::Safe, |conn| self
            .schema()
            .sql()
            .schedule_states
            .query()
            .bind(names)
            .fetch_all(conn))?;
        let mut now = None;
        let mut records = Vec::with_capacity(rows.len());
        for row in &rows {
            now = Some(DbTime(row.try_get("now")?));
            records.push(match row.try_get::<Option<i64>, _>("last_tick")? {
                Some(_) => Some(record(row)?),
                None => None,
            });
        }
        let now = match now {
            Some(now) => now,
            None => self.now().await?,
        };
        Ok((now, records))
    }

    /// Every schedule record, configured or not, by name.
    pub async fn schedule_records(&self) -> Result<Vec<ScheduleRecord>, sqlx::Error> {
        let rows = replayed!(self, Replay::Safe, |conn| self.schema().sql().schedule_records.query().fetch_all(conn))?;
        rows.iter().map(record).collect()
    }

    /// Reads the records of `scheduler`'s schedules and the clock, and plans (writes nothing:
    /// what a dry run shows).
    pub async fn plan_schedules(&self, scheduler: &Scheduler) -> Result<Plan, sqlx::Error> {
        let (now, records) = self.schedule_states(&scheduler.names()).await?;
        let recorded: BTreeMap<String, DbTime> = records.into_iter().flatten().map(|r| (r.name, r.last_tick)).collect();
        Ok(scheduler.plan(&recorded, now))
    }

    /// Applies `plan`'s writes, each by compare-and-set on the last tick it read; a write with
    /// tasks commits together with them. See the module docs.
    pub async fn apply_schedule_plan(&self, plan: Plan) -> Result<PlanOutcome, sqlx::Error> {
        let sql = self.schema().sql();
        let mut outcome = PlanOutcome::default();
        let (quiet, firing): (Vec<ScheduleWrite>, Vec<ScheduleWrite>) =
            plan.writes.into_iter().partition(|w| w.tasks.is_empty());
        if !quiet.is_empty() {
            let names: Vec<&str> = quiet.iter().map(|w| w.name.as_str()).collect();
            let reads: Vec<Option<i64>> = quiet.iter().map(|w| w.read.map(db_time)).collect();
            let advances: Vec<i64> = quiet.iter().map(|w| db_time(w.advance_to)).collect();
            let nexts: Vec<Option<i64>> = quiet.iter().map(|w| w.next_tick.map(db_time)).collect();
            let won = sql.advance_schedules.query_scalar().bind(names).bind(reads).bind(advances).bind(nexts);
            let mut conn = self.pool().acquire().await?;
            let pooled = self.schema().is_transaction_pooled();
            let won: Vec<String> = in_own_transaction!(pooled, &mut *conn, |conn| won.fetch_all(conn))?;
            for write in quiet {
                if won.contains(&write.name) {
                    outcome.applied.push(AppliedWrite { write, task_ids: Vec::new() });
                } else {
                    outcome.lost.push(write.name);
                }
            }
        }
        for write in firing {
            // The session settings, set locally: a pooler in transaction mode drops them.
            let mut tx = self.pool().begin_with(crate::postgres::store::pooled_begin()).await?;
            let won = sql
                .fire_schedule
                .query()
                .bind(&write.name)
                .bind(write.read.map(db_time))
                .bind(db_time(write.advance_to))
                .bind(write.next_tick.map(db_time))
                .bind(i64::try_from(write.tasks.len()).unwrap_or(i64::MAX))
                .fetch_optional(&mut *tx)
                .await?
                .is_some();
            if !won {
                tx.rollback().await?;
                outcome.lost.push(write.name);
                continue;
            }
            match enqueue_many_in(&mut *tx, self.schema(), self.app(), write.tasks.clone()).await {
                Ok(task_ids) => {
                    if let Some(last) = task_ids.last() {
                        sql.schedule_last_task.query().bind(&write.name).bind(last.0).execute(&mut *tx).await?;
                    }
                    tx.commit().await?;
                    outcome.applied.push(AppliedWrite { write, task_ids });
                }
                // Dropping the transaction rolls it back.
                Err(PgEnqueueError::Database(error)) => return Err(error),
                Err(refused) => {
                    tx.rollback().await?;
                    outcome.refused.push(RefusedWrite { name: write.name, error: refused.to_string() });
                }
            }
        }
        Ok(outcome)
    }

    /// One scheduler check: read, plan, write; after lost races, again from a fresh read (at
    /// most [`MAX_CHECK_ROUNDS`] rounds). Each due tick of `scheduler`'s schedules is enqueued
    /// exactly once across every scheduler checking the same schema.
    pub async fn check_schedules(&self, scheduler: &Scheduler) -> Result<CheckReport, sqlx::Error> {
        let mut report =
            CheckReport { now: DbTime(0), applied: Vec::new(), lost: 0, refused: Vec::new(), next_check: None };
        for _ in 0..MAX_CHECK_ROUNDS {
            let plan = self.plan_schedules(scheduler).await?;
            report.now = plan.now;
            report.next_check = plan.next_check;
            let outcome = self.apply_schedule_plan(plan).await?;
            report.applied.extend(outcome.applied);
            report.refused.extend(outcome.refused);
            if outcome.lost.is_empty() {
                return Ok(report);
            }
            report.lost = report.lost.saturating_add(u32::try_from(outcome.lost.len()).unwrap_or(u32::MAX));
        }
        // Still racing: the next check comes at once (after the scheduler's shortest sleep).
        report.next_check = Some(report.now);
        Ok(report)
    }
}

fn record(row: &sqlx::postgres::PgRow) -> Result<ScheduleRecord, sqlx::Error> {
    Ok(ScheduleRecord {
        name: row.try_get("name")?,
        last_tick: DbTime(row.try_get("last_tick")?),
        next_tick: row.try_get::<Option<i64>, _>("next_tick")?.map(DbTime),
        last_task_id: row.try_get::<Option<i64>, _>("last_task_id")?.map(TaskId),
        run_count: u64::try_from(row.try_get::<i64, _>("run_count")?).unwrap_or(0),
        updated_at: DbTime(row.try_get("updated_at")?),
    })
}
