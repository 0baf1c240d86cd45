//! Schedules on the command line: `canter scheduler` (run, `--once`, `--dry-run`, `--list`)
//! and `canter schedules`.

use std::path::PathBuf;

use canter_tokio::canter::postgres::CheckReport;
use canter_tokio::canter::schedule::{ParsedSchedule, TimeZone};
use canter_tokio::canter::scheduler::{Plan, ScheduleRecord, ScheduleWrite};
use canter_tokio::canter::store::DbTime;
use canter_tokio::{AppConfig, Scheduler, TaskId};
use serde_json::Value;

use crate::args::{Output, SchedulerArgs, SchemaArg};
use crate::connect::Database;
use crate::output::{Table, printable};
use crate::{Failure, Outcome, builtins, errln, failed, outln, usage};

/// The app of `--config FILE`, or the defaults.
fn app(config: Option<&PathBuf>) -> Result<AppConfig, Failure> {
    match config {
        Some(path) => Ok(canter_tokio::canter::driver::read_config(path).map_err(usage)?.app),
        None => Ok(AppConfig::default()),
    }
}

/// Refuses, before anything connects, schedules that would enqueue what fails: zones that do
/// not load, and (unless `force`: the caller's own workers serve them) tasks the `canter`
/// worker does not serve or built-in tasks' args their handlers cannot decode.
pub(crate) fn check_schedules(app: &AppConfig, force: bool) -> Result<(), Failure> {
    canter_tokio::canter::driver::load_scheduler(app).map_err(usage)?;
    let mut unknown = Vec::new();
    for schedule in &app.schedules {
        match builtins::check_args(&schedule.task, &schedule.args) {
            Some(Err(problem)) => {
                return Err(usage(format!(
                    "schedule {}: args {} do not fit task {}: {problem}",
                    schedule.name, schedule.args, schedule.task
                )));
            }
            None if !force => unknown.push(format!("{} (task {:?})", schedule.name, schedule.task)),
            _ => {}
        }
    }
    if unknown.is_empty() {
        return Ok(());
    }
    Err(usage(format!(
        "schedules {} name tasks the canter worker does not serve ({}); pass --force if your own workers serve them",
        unknown.join(", "),
        builtins::NAMES.join(", ")
    )))
}

/// The scheduler of `app`; a `service` (the long-running loop, which may start before its
/// database) waits for the database as its resilience settings say.
async fn scheduler_of(
    database: &Database,
    app: AppConfig,
    schema: &SchemaArg,
    migrate: bool,
    service: bool,
) -> Result<Scheduler, Failure> {
    let pool = match service {
        true => database.service_pool(4, app.resilience.db_retry_max_attempts).await?,
        false => database.pool(4).await?,
    };
    Ok(Scheduler::new(pool, app).map_err(usage)?.schema(database.schema(schema)).migrate(migrate))
}

pub(crate) async fn scheduler(database: &Database, args: SchedulerArgs) -> Outcome {
    let app = app(args.config.as_ref())?;
    if app.schedules.is_empty() && !args.list {
        return Err(usage("no schedules: give --config FILE with [[app.schedules]] tables"));
    }
    // Listing enqueues nothing: what it shows is whatever the file holds.
    if !args.list {
        check_schedules(&app, args.force)?;
    }
    let service = !(args.list || args.dry_run || args.once);
    if service && args.json {
        return Err(usage("--json goes with --once, --dry-run or --list"));
    }
    let scheduler = scheduler_of(database, app, &args.schema, !args.no_migrate, service).await?;
    if args.list {
        return list_schedules(database, &scheduler, args.json).await;
    }
    if args.dry_run {
        let plan = database.retrying("read the schedules", || scheduler.plan()).await?;
        if args.json {
            outln!("{}", plan_json(&plan));
        } else {
            print_plan(&scheduler, &plan);
        }
        return Ok(());
    }
    if args.once {
        let store = scheduler.store();
        if args.no_migrate {
            database
                .retrying("check the schema", || {
                    canter_tokio::canter::postgres::require_current(store.pool(), store.schema())
                })
                .await?;
        } else {
            database.retrying("migrate", || store.migrate()).await?;
        }
        let report = scheduler.check().await.map_err(|e| failed(format!("check failed: {e}")))?;
        if args.json {
            outln!("{}", report_json(&report));
        } else {
            print_report(&scheduler, &report);
        }
        return if report.refused.is_empty() { Ok(()) } else { Err(failed("some schedules' tasks were refused")) };
    }
    crate::output::note_line(format_args!(
        "scheduler of {} schedules starting; stop it with Ctrl-C or SIGTERM",
        scheduler.scheduler().schedules().len()
    ));
    let stats = scheduler.run().await.map_err(|e| failed(crate::connect::explain(&e.to_string())))?;
    crate::output::note_line(format_args!(
        "scheduler stopped: {} checks, {} tasks enqueued, {} races lost",
        stats.checks, stats.tasks, stats.lost
    ));
    Ok(())
}

pub(crate) async fn list(database: &Database, config: Option<PathBuf>, schema: &SchemaArg, output: Output) -> Outcome {
    let app = app(config.as_ref())?;
    let scheduler = scheduler_of(database, app, schema, false, false).await?;
    list_schedules(database, &scheduler, output.json).await
}

/// `t` in the schedule's zone (UTC when it is not configured), RFC 3339.
fn tick_time(schedule: Option<&ParsedSchedule>, t: DbTime) -> String {
    match schedule {
        // UTC as every other time is printed, with a Z.
        Some(schedule) if !matches!(schedule.time_zone(), TimeZone::Utc) => {
            schedule.time_zone().to_local(t).to_string()
        }
        _ => crate::output::time(t),
    }
}

fn tick_or(schedule: Option<&ParsedSchedule>, t: Option<DbTime>, none: &str) -> String {
    t.map_or_else(|| none.to_owned(), |t| tick_time(schedule, t))
}

/// Each tick of a write, for JSON: its schedule, instant, task and whether it is backfilled.
fn ticks_json(write: &ScheduleWrite, ids: Option<&[TaskId]>) -> Vec<Value> {
    write
        .ticks
        .iter()
        .enumerate()
        .map(|(i, tick)| {
            serde_json::json!({
                "schedule": write.name,
                "tick": crate::output::time(*tick),
                "task": write.tasks.get(i).map(|t| t.name.as_str()),
                "task_id": ids.and_then(|ids| ids.get(i)),
                "backfilled": i < write.backfilled,
            })
        })
        .collect()
}

/// What a dry run would do, as JSON.
fn plan_json(plan: &Plan) -> Value {
    let ticks: Vec<Value> = plan.writes.iter().flat_map(|w| ticks_json(w, None)).collect();
    let recorded: Vec<&str> = plan.writes.iter().filter(|w| w.read.is_none()).map(|w| w.name.as_str()).collect();
    serde_json::json!({
        "now": crate::output::time(plan.now),
        "would_enqueue": ticks,
        "would_record": recorded,
        "next_check": plan.next_check.map(crate::output::time),
    })
}

/// What a check did, as JSON.
fn report_json(report: &CheckReport) -> Value {
    let ticks: Vec<Value> = report.applied.iter().flat_map(|a| ticks_json(&a.write, Some(&a.task_ids))).collect();
    let refused: Vec<Value> =
        report.refused.iter().map(|r| serde_json::json!({"schedule": r.name, "error": r.error.to_string()})).collect();
    serde_json::json!({
        "enqueued": ticks,
        "refused": refused,
        "next_check": report.next_check.map(crate::output::time),
    })
}

fn print_plan(scheduler: &Scheduler, plan: &Plan) {
    outln!("dry run at {}: nothing is written", tick_time(None, plan.now));
    for write in &plan.writes {
        let schedule = scheduler.scheduler().get(&write.name);
        for (i, tick) in write.ticks.iter().enumerate() {
            let task = write.tasks.get(i).map_or("", |t| t.name.as_str());
            let kind = if i < write.backfilled { " (backfilled)" } else { "" };
            outln!(
                "would enqueue {} for schedule {} at tick {}{kind}",
                printable(task),
                printable(&write.name),
                tick_time(schedule, *tick)
            );
        }
        if write.read.is_none() {
            outln!(
                "would record new schedule {}: first tick {}",
                printable(&write.name),
                tick_or(schedule, write.next_tick, "never")
            );
        }
        if write.skipped {
            outln!(
                "would skip missed ticks of schedule {} up to {}",
                printable(&write.name),
                tick_time(schedule, write.advance_to)
            );
        }
    }
    if plan.writes.iter().all(|w| w.ticks.is_empty()) {
        outln!("nothing due; next tick {}", tick_or(None, plan.next_check, "never"));
    }
}

fn print_report(scheduler: &Scheduler, report: &CheckReport) {
    for applied in &report.applied {
        let write = &applied.write;
        let schedule = scheduler.scheduler().get(&write.name);
        for (i, (tick, id)) in write.ticks.iter().zip(&applied.task_ids).enumerate() {
            let kind = if i < write.backfilled { " (backfilled)" } else { "" };
            outln!(
                "schedule {}: enqueued task {id} for tick {}{kind}",
                printable(&write.name),
                tick_time(schedule, *tick)
            );
        }
        if write.read.is_none() {
            outln!(
                "schedule {}: recorded; first tick {}",
                printable(&write.name),
                tick_or(schedule, write.next_tick, "never")
            );
        }
        if write.skipped {
            outln!(
                "schedule {}: missed ticks up to {} skipped",
                printable(&write.name),
                tick_time(schedule, write.advance_to)
            );
        }
    }
    for refused in &report.refused {
        errln!("schedule {}: tasks refused: {}", printable(&refused.name), printable(&refused.error.to_string()));
    }
    outln!("{} tasks enqueued; next tick {}", report.tasks(), tick_or(None, report.next_check, "never"));
}

/// One line of `canter schedules`.
struct ScheduleRow {
    name: String,
    kind: String,
    zone: String,
    record: Option<ScheduleRecord>,
    next: Option<DbTime>,
}

async fn list_schedules(database: &Database, scheduler: &Scheduler, json: bool) -> Outcome {
    let store = scheduler.store();
    let names = scheduler.scheduler().names();
    let (now, configured) = database.retrying("read the schedules", || store.schedule_states(&names)).await?;
    let all = database.retrying("read the schedules", || store.schedule_records()).await?;
    // Configured schedules first, then records of schedules the file does not configure.
    let mut rows = Vec::new();
    for (schedule, record) in scheduler.scheduler().schedules().iter().zip(configured) {
        let after = record.as_ref().map_or(now, |r| r.last_tick.max(now));
        rows.push(ScheduleRow {
            name: schedule.name().to_owned(),
            kind: schedule.schedule().to_string(),
            zone: schedule.time_zone().id().to_string(),
            next: schedule.next_after(after),
            record,
        });
    }
    for record in all.into_iter().filter(|r| !names.contains(&r.name.as_str())) {
        rows.push(ScheduleRow {
            name: record.name.clone(),
            kind: "(not configured)".into(),
            zone: "UTC".into(),
            next: record.next_tick,
            record: Some(record),
        });
    }
    if json {
        let rows: Vec<Value> = rows
            .iter()
            .map(|row| {
                let schedule = scheduler.scheduler().get(&row.name);
                let record = row.record.as_ref();
                serde_json::json!({
                    "name": row.name,
                    "schedule": row.kind,
                    "timezone": row.zone,
                    "configured": schedule.is_some(),
                    "last_tick": record.map(|r| tick_time(schedule, r.last_tick)),
                    "last_tick_ms": record.map(|r| r.last_tick.0),
                    "next_tick": row.next.map(|t| tick_time(schedule, t)),
                    "next_tick_ms": row.next.map(|t| t.0),
                    "run_count": record.map_or(0, |r| r.run_count),
                    "last_task_id": record.and_then(|r| r.last_task_id),
                })
            })
            .collect();
        outln!("{}", Value::from(rows));
        return Ok(());
    }
    if rows.is_empty() {
        outln!("(no schedules configured or recorded)");
        return Ok(());
    }
    let mut table = Table::new(&["NAME", "SCHEDULE", "ZONE", "LAST TICK", "NEXT TICK", ">RUNS", ">LAST TASK"]);
    for row in &rows {
        let schedule = scheduler.scheduler().get(&row.name);
        let record = row.record.as_ref();
        table.row(vec![
            row.name.clone(),
            row.kind.clone(),
            row.zone.clone(),
            tick_or(schedule, record.map(|r| r.last_tick), "never"),
            tick_or(schedule, row.next, "never"),
            record.map_or(0, |r| r.run_count).to_string(),
            record.and_then(|r| r.last_task_id).map_or_else(|| "-".to_owned(), |id| id.to_string()),
        ]);
    }
    table.print();
    Ok(())
}
