//! Schedules against PostgreSQL: exactly-once enqueue under racing schedulers, backfill and
//! misfires after downtime, new schedules, time zones, dry runs.
//!
//! Time: every scheduler here has a one-connection pool whose session pins the database clock
//! (`SET canter.now`, read by `db_now()`), so checks run at chosen instants with no sleeps.

#[path = "common/pg.rs"]
mod pg;

use std::collections::{BTreeMap, BTreeSet};

use canter::config::AppConfig;
use canter::postgres::{CheckReport, PgStore};
use canter::rng::Rng;
use canter::schedule::{CivilDateTime, ScheduleConfig};
use canter::scheduler::Scheduler;
use canter::store::DbTime;
use canter::task::TaskId;
use pg::{TestDb, pin_clock};

const SECOND: i64 = 1_000;
const MINUTE: i64 = 60 * SECOND;

/// `y-m-d h:mi:s` UTC.
fn utc(y: i32, m: u8, d: u8, h: u8, mi: u8, s: u8) -> DbTime {
    DbTime(CivilDateTime::new(y, m, d, h, mi, s).unwrap().to_unix_seconds() * 1000)
}

fn app(schedules: Vec<ScheduleConfig>) -> AppConfig {
    AppConfig { schedules, ..AppConfig::default() }
}

fn every(name: &str, every: &str, backfill: u32) -> ScheduleConfig {
    ScheduleConfig { every: Some(every.into()), backfill, ..ScheduleConfig::new(name, name) }
}

fn utc_scheduler(app: &AppConfig) -> Scheduler {
    Scheduler::from_app(app, |id| Err(format!("no zone file in this test: {id}"))).unwrap()
}

/// A store on a pool of one connection, so that pinning its clock pins every statement.
async fn pinned_store(db: &TestDb, app: &AppConfig) -> PgStore {
    db.store(app.clone(), 1).await
}

async fn check_at(store: &PgStore, scheduler: &Scheduler, now: DbTime) -> CheckReport {
    pin_clock(store.pool(), store.schema(), now).await;
    store.check_schedules(scheduler).await.unwrap()
}

/// Tasks in the live table by task name.
async fn tasks_named(store: &PgStore, name: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {}.tasks WHERE name = $1", store.schema().quoted());
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(name).fetch_one(store.pool()).await.unwrap()
}

async fn record(store: &PgStore, name: &str) -> canter::scheduler::ScheduleRecord {
    store.schedule_records().await.unwrap().into_iter().find(|r| r.name == name).expect("a record")
}

/// The ticks a report enqueued, per schedule, with their tasks.
fn enqueued(report: &CheckReport) -> Vec<(String, DbTime, TaskId)> {
    let mut out = Vec::new();
    for applied in &report.applied {
        assert_eq!(applied.write.ticks.len(), applied.task_ids.len(), "one task per tick");
        for (tick, id) in applied.write.ticks.iter().zip(&applied.task_ids) {
            out.push((applied.write.name.clone(), *tick, *id));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_schedulers_enqueue_each_tick_exactly_once() {
    let db = TestDb::new().await;
    // Every second with room to backfill the ticks between two checks; every minute (cron)
    // with no backfill at all.
    let app = app(vec![
        every("per_second", "1s", 5),
        ScheduleConfig { cron: Some("* * * * *".into()), ..ScheduleConfig::new("per_minute", "per_minute") },
    ]);
    let scheduler = utc_scheduler(&app);
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(pinned_store(&db, &app).await);
    }
    let mut rng = Rng::new(9);
    let mut now = utc(2026, 3, 1, 12, 0, 40);
    let mut seen: BTreeMap<(String, DbTime), Vec<TaskId>> = BTreeMap::new();
    let mut lost = 0;
    let mut first: Option<BTreeMap<String, DbTime>> = None;
    for _ in 0..70 {
        // Each scheduler's clock is up to 300 ms off the others', so some see a tick that
        // others do not yet.
        for store in &stores {
            pin_clock(store.pool(), store.schema(), DbTime(now.0 + rng.range(0, 300) as i64)).await;
        }
        let checks = stores.iter().map(|store| store.check_schedules(&scheduler));
        for report in futures::future::join_all(checks).await {
            let report = report.unwrap();
            assert!(report.refused.is_empty());
            lost += report.lost;
            for (name, tick, id) in enqueued(&report) {
                seen.entry((name, tick)).or_default().push(id);
            }
        }
        if first.is_none() {
            let records = stores[0].schedule_records().await.unwrap();
            first = Some(records.into_iter().map(|r| (r.name, r.last_tick)).collect());
        }
        now = DbTime(now.0 + rng.range(300, 1_700) as i64);
    }
    assert!(lost > 0, "the schedulers raced");

    let first = first.unwrap();
    for (name, period) in [("per_second", SECOND), ("per_minute", MINUTE)] {
        let from = first[name];
        let to = record(&stores[0], name).await.last_tick;
        // Every tick after the first record up to the last one recorded, each exactly once.
        let expected: Vec<DbTime> = ((from.0 / period + 1)..=(to.0 / period)).map(|k| DbTime(k * period)).collect();
        let got: Vec<DbTime> = seen.keys().filter(|(n, _)| n == name).map(|(_, t)| *t).collect();
        assert_eq!(got, expected, "{name}: the ticks enqueued");
        for tick in &got {
            assert_eq!(seen[&(name.to_owned(), *tick)].len(), 1, "{name}: tick {tick:?} enqueued once");
        }
        assert_eq!(tasks_named(&stores[0], name).await, got.len() as i64, "{name}: tasks in the table");
        let record = record(&stores[0], name).await;
        assert_eq!(record.run_count, got.len() as u64);
        assert_eq!(record.last_task_id, seen[&(name.to_owned(), to)].first().copied());
    }
    let minutes = seen.keys().filter(|(n, _)| n == "per_minute").count();
    assert!(minutes >= 1, "the run crossed a minute");
    let ids: BTreeSet<TaskId> = seen.values().flatten().copied().collect();
    assert_eq!(ids.len(), seen.len(), "distinct tasks");
}

#[tokio::test]
async fn downtime_is_backfilled_up_to_the_limit_and_misfires_are_skipped() {
    let db = TestDb::new().await;
    // A tick seen more than 20 s late is missed.
    let late = |c: ScheduleConfig| ScheduleConfig { misfire_ms: 20_000, ..c };
    let app = app(vec![late(every("bf3", "1m", 3)), late(every("bf0", "1m", 0))]);
    let scheduler = utc_scheduler(&app);
    let store = pinned_store(&db, &app).await;
    let t0 = utc(2026, 3, 1, 12, 0, 10);

    let report = check_at(&store, &scheduler, t0).await;
    assert_eq!(report.tasks(), 0, "new schedules record themselves");
    assert_eq!(report.next_check, Some(utc(2026, 3, 1, 12, 1, 0)));

    // Down for ten minutes; back 10 s after a tick: the latest tick is on time.
    let report = check_at(&store, &scheduler, utc(2026, 3, 1, 12, 10, 10)).await;
    assert_eq!(
        ticks_of(&report, "bf3"),
        [7, 8, 9, 10].map(|m| utc(2026, 3, 1, 12, m, 0)),
        "the latest and three missed"
    );
    assert_eq!(ticks_of(&report, "bf0"), [utc(2026, 3, 1, 12, 10, 0)], "only the latest");
    for applied in &report.applied {
        assert!(applied.write.skipped, "older missed ticks are skipped");
        assert_eq!(applied.write.backfilled, if applied.write.name == "bf3" { 3 } else { 0 });
    }
    assert_eq!((tasks_named(&store, "bf3").await, tasks_named(&store, "bf0").await), (4, 1));

    // Back 40 s after a tick: even the latest is missed.
    let report = check_at(&store, &scheduler, utc(2026, 3, 1, 12, 31, 40)).await;
    assert_eq!(ticks_of(&report, "bf3"), [29, 30, 31].map(|m| utc(2026, 3, 1, 12, m, 0)), "three missed ones");
    assert!(ticks_of(&report, "bf0").is_empty(), "no backfill: nothing");
    assert_eq!((tasks_named(&store, "bf3").await, tasks_named(&store, "bf0").await), (7, 1));
    assert_eq!(record(&store, "bf0").await.last_tick, utc(2026, 3, 1, 12, 31, 0), "the misfired tick is recorded");
    assert_eq!(record(&store, "bf0").await.next_tick, Some(utc(2026, 3, 1, 12, 32, 0)));

    // The next tick on time fires in both, once.
    let report = check_at(&store, &scheduler, utc(2026, 3, 1, 12, 32, 0)).await;
    assert_eq!(report.tasks(), 2);
    assert_eq!(check_at(&store, &scheduler, utc(2026, 3, 1, 12, 32, 30)).await.tasks(), 0);
}

fn ticks_of(report: &CheckReport, name: &str) -> Vec<DbTime> {
    enqueued(report).into_iter().filter(|(n, ..)| n == name).map(|(_, t, _)| t).collect()
}

#[tokio::test]
async fn a_new_schedule_does_not_fire_for_the_past() {
    let db = TestDb::new().await;
    // Its time passed an hour ago today, and it may backfill: still nothing until tomorrow.
    let daily = ScheduleConfig { daily: Some("09:00".into()), backfill: 100, ..ScheduleConfig::new("daily", "d") };
    let app = app(vec![daily]);
    let scheduler = utc_scheduler(&app);
    let store = pinned_store(&db, &app).await;
    let added = utc(2026, 3, 1, 10, 0, 0);
    let report = check_at(&store, &scheduler, added).await;
    assert_eq!(report.tasks(), 0);
    assert_eq!(record(&store, "daily").await.last_tick, added);
    assert_eq!(record(&store, "daily").await.next_tick, Some(utc(2026, 3, 2, 9, 0, 0)));
    assert_eq!(check_at(&store, &scheduler, utc(2026, 3, 2, 8, 59, 59)).await.tasks(), 0);
    let report = check_at(&store, &scheduler, utc(2026, 3, 2, 9, 0, 0)).await;
    assert_eq!(ticks_of(&report, "daily"), [utc(2026, 3, 2, 9, 0, 0)]);
    assert_eq!(tasks_named(&store, "d").await, 1);
}

#[tokio::test]
async fn a_daily_schedule_in_a_time_zone_fires_at_its_local_time() {
    let db = TestDb::new().await;
    let paris = ScheduleConfig {
        daily: Some("09:00".into()),
        timezone: "Europe/Paris".into(),
        ..ScheduleConfig::new("paris", "morning")
    };
    let app = app(vec![paris]);
    // The zone's rules come from the system's tz database, as in production.
    let scheduler = canter::driver::load_scheduler(&app).unwrap();
    let store = pinned_store(&db, &app).await;

    // Winter: 09:00 in Paris is 08:00 UTC.
    check_at(&store, &scheduler, utc(2026, 1, 15, 7, 0, 0)).await;
    assert_eq!(record(&store, "paris").await.next_tick, Some(utc(2026, 1, 15, 8, 0, 0)));
    let early = check_at(&store, &scheduler, DbTime(utc(2026, 1, 15, 8, 0, 0).0 - 1)).await;
    assert_eq!(early.tasks(), 0);
    let report = check_at(&store, &scheduler, utc(2026, 1, 15, 8, 0, 0)).await;
    assert_eq!(ticks_of(&report, "paris"), [utc(2026, 1, 15, 8, 0, 0)]);
    assert_eq!(report.next_check, Some(utc(2026, 1, 16, 8, 0, 0)));

    // Summer, after months down: the missed ticks are skipped; 09:00 is then 07:00 UTC.
    let report = check_at(&store, &scheduler, utc(2026, 7, 15, 6, 0, 0)).await;
    assert_eq!(report.tasks(), 0);
    assert!(report.applied.iter().all(|a| a.write.skipped));
    assert_eq!(report.next_check, Some(utc(2026, 7, 15, 7, 0, 0)));
    let report = check_at(&store, &scheduler, DbTime(utc(2026, 7, 15, 7, 0, 0).0 + 250)).await;
    assert_eq!(ticks_of(&report, "paris"), [utc(2026, 7, 15, 7, 0, 0)]);
    assert_eq!(tasks_named(&store, "morning").await, 2);
}

#[tokio::test]
async fn a_dry_run_writes_nothing() {
    let db = TestDb::new().await;
    let app = app(vec![every("e", "1m", 2)]);
    let scheduler = utc_scheduler(&app);
    let store = pinned_store(&db, &app).await;
    check_at(&store, &scheduler, utc(2026, 3, 1, 12, 0, 10)).await;
    pin_clock(store.pool(), store.schema(), utc(2026, 3, 1, 12, 5, 1)).await;
    let plan = store.plan_schedules(&scheduler).await.unwrap();
    assert_eq!(plan.writes.len(), 1);
    assert_eq!(plan.writes[0].ticks, [3, 4, 5].map(|m| utc(2026, 3, 1, 12, m, 0)));
    assert_eq!(tasks_named(&store, "e").await, 0);
    assert_eq!(record(&store, "e").await.last_tick, utc(2026, 3, 1, 12, 0, 10));
    // The check then does what the plan said.
    let report = store.check_schedules(&scheduler).await.unwrap();
    assert_eq!(ticks_of(&report, "e"), plan.writes[0].ticks);
}

#[tokio::test]
async fn a_stale_read_loses_and_enqueues_nothing() {
    let db = TestDb::new().await;
    let app = app(vec![every("e", "1m", 0)]);
    let scheduler = utc_scheduler(&app);
    let store = pinned_store(&db, &app).await;
    check_at(&store, &scheduler, utc(2026, 3, 1, 12, 0, 10)).await;
    pin_clock(store.pool(), store.schema(), utc(2026, 3, 1, 12, 1, 1)).await;
    // Two schedulers planned from the same read; the first applies, the second must lose.
    let plan = store.plan_schedules(&scheduler).await.unwrap();
    let first = store.apply_schedule_plan(plan.clone()).await.unwrap();
    assert_eq!((first.applied.len(), first.lost.len()), (1, 0));
    let second = store.apply_schedule_plan(plan).await.unwrap();
    assert_eq!((second.applied.len(), second.lost), (0, vec!["e".to_owned()]));
    assert_eq!(tasks_named(&store, "e").await, 1);
    // A new schedule's insert loses the same way.
    let fresh = store.schedule_states(&["e"]).await.unwrap();
    assert!(fresh.1[0].is_some());
    let mut stale = scheduler.plan(&BTreeMap::new(), utc(2026, 3, 1, 12, 1, 2));
    stale.writes.retain(|w| w.read.is_none());
    let outcome = store.apply_schedule_plan(stale).await.unwrap();
    assert_eq!(outcome.lost, vec!["e".to_owned()]);
}
