//! Racing schedulers against the memory store (which applies a plan's writes as PostgreSQL
//! does: compare-and-set on the tick each scheduler read), in a deterministic simulation: each
//! step one of four schedulers, on its own skewed clock, reads the records, and applies its
//! plan then or only after others have acted. Every tick of every schedule is enqueued exactly
//! once, and none is lost. `CANTER_SCHEDULE_SEEDS=n` runs more seeds; a failure names its seed.

use std::collections::{BTreeMap, BTreeSet};

use canter::config::AppConfig;
use canter::memory::MemoryStore;
use canter::rng::Rng;
use canter::schedule::ScheduleConfig;
use canter::scheduler::{Plan, Scheduler};
use canter::store::DbTime;

fn app() -> AppConfig {
    let mut every = ScheduleConfig::new("every_second", "tick");
    every.every = Some("1s".into());
    let mut cron = ScheduleConfig::new("every_minute", "tick");
    cron.cron = Some("* * * * *".into());
    let mut daily = ScheduleConfig::new("daily_paris", "tick");
    daily.daily = Some("00:00:30".into());
    daily.timezone = "+02:00".into();
    let mut app = AppConfig::default();
    for mut schedule in [every, cron, daily] {
        // Every due tick is enqueued, late or not: then exactly once is checkable by counting.
        schedule.backfill = 10_000;
        app.schedules.push(schedule);
    }
    app
}

fn run(seed: u64) {
    let app = app();
    let scheduler = Scheduler::from_app(&app, |zone| Err(format!("no zone files here: {zone}"))).expect("valid");
    let mut store = MemoryStore::new(app);
    let mut rng = Rng::new(seed);
    let mut now = DbTime(1_780_000_000_000);
    let skews: Vec<i64> = (0..4).map(|_| rng.range(0, 400) as i64).collect();
    // Plans read but not yet applied, per scheduler.
    let mut pending: BTreeMap<usize, Plan> = BTreeMap::new();
    let mut fired: BTreeMap<String, Vec<DbTime>> = BTreeMap::new();
    let mut first: BTreeMap<String, DbTime> = BTreeMap::new();
    for step in 0..3_000 {
        now = now.plus_ms(rng.range(0, 900));
        let who = rng.range(0, 4) as usize;
        let clock = now.plus_ms(skews[who] as u64);
        let plan = match pending.remove(&who) {
            Some(plan) => plan,
            None => {
                let plan = scheduler.plan(&store.schedule_ticks(), clock);
                if rng.chance(0.4) {
                    // Applied later, after others may have moved the records on.
                    pending.insert(who, plan);
                    continue;
                }
                plan
            }
        };
        for write in &plan.writes {
            let applied =
                store.apply_schedule_write(write, clock).unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            if applied.is_some() {
                first.entry(write.name.clone()).or_insert(write.advance_to);
                fired.entry(write.name.clone()).or_default().extend(&write.ticks);
                assert_eq!(applied.map(|ids| ids.len()), Some(write.ticks.len()), "seed {seed}: one task per tick");
            }
        }
    }
    for config in &scheduler.schedules().to_vec() {
        let name = config.name();
        let ticks = fired.remove(name).unwrap_or_default();
        let unique: BTreeSet<DbTime> = ticks.iter().copied().collect();
        assert_eq!(unique.len(), ticks.len(), "seed {seed}: {name} enqueued a tick twice");
        // Every tick after the record was created, up to the last one recorded, was enqueued.
        let record = store.schedule_record(name).expect("recorded");
        let mut expected = Vec::new();
        let mut tick = first[name];
        while let Some(next) = config.next_after(tick).filter(|t| *t <= record.last_tick) {
            expected.push(next);
            tick = next;
        }
        assert_eq!(ticks, expected, "seed {seed}: {name} lost or reordered ticks");
        assert_eq!(record.run_count, expected.len() as u64, "seed {seed}: {name} run count");
    }
}

#[test]
fn racing_schedulers_enqueue_each_tick_exactly_once() {
    let seeds: u64 = std::env::var("CANTER_SCHEDULE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(20);
    for seed in 0..seeds {
        run(seed);
    }
}
