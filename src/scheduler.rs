//! The scheduler's decisions, pure: from the states a store read and the database's `now`,
//! which rows to write and which tasks to enqueue ([`Scheduler::plan`], each a schedule's
//! [`new_task`](ParsedSchedule::new_task)), and how long to sleep before the next check
//! ([`check_delay_ms`]). Above [`schedule`](crate::schedule) (timetables, which know nothing
//! of tasks) and the stores' enqueue checks.
//!
//! A check is: read every schedule's state and `now` (one round trip), [`plan`](Scheduler::plan),
//! then apply each [`ScheduleWrite`] by compare-and-set on [`ScheduleWrite::read`]: a write
//! that finds another value lost a race, enqueues nothing, and its schedule is planned again
//! from a fresh read. Writes with tasks commit together with their tasks.

use std::collections::BTreeMap;

use crate::check::ConfigError;
use crate::config::AppConfig;
use crate::schedule::{Due, ParsedSchedule, ScheduleError, TimeZone, ZoneId};
use crate::store::{DbTime, EnqueueError, NewTask, check_new_task};
use crate::task::TaskId;

impl ParsedSchedule {
    /// The task to enqueue at each tick: the configured task, arguments, queue and priority,
    /// claimable at once (the tick is not added to the arguments).
    pub fn new_task(&self) -> NewTask {
        let task =
            NewTask::new(self.config().task.clone(), self.config().args.clone()).priority(self.config().priority);
        match &self.config().queue {
            Some(queue) => task.queue(queue.clone()),
            None => task,
        }
    }
}

/// The shortest sleep between two checks, so that a schedule that keeps losing races or a
/// timer that fires early can never spin.
pub const MIN_CHECK_DELAY_MS: u64 = 25;

/// The default longest sleep between two checks: a check at least once a minute bounds the
/// drift between the local timer and the database's clock.
pub const DEFAULT_MAX_CHECK_DELAY_MS: u64 = 60_000;

/// What a store holds for one schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleRecord {
    /// The schedule's name.
    pub name: String,
    /// The last tick recorded (for a new schedule, when it was first seen).
    pub last_tick: DbTime,
    /// The next tick as of the last write.
    pub next_tick: Option<DbTime>,
    /// The last task enqueued for it.
    pub last_task_id: Option<TaskId>,
    /// How many tasks it has enqueued.
    pub run_count: u64,
    /// When the record was last written.
    pub updated_at: DbTime,
}

/// Why a scheduler could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// The app's configuration breaks rules.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// A schedule and its zone do not go together.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// Two schedules have one name.
    #[error("duplicate schedule name {0:?}")]
    DuplicateName(String),
    /// A schedule's task would be refused by every store.
    #[error("the task of schedule {schedule:?} would be refused: {error}")]
    Task {
        /// The schedule.
        schedule: String,
        /// Why.
        error: EnqueueError,
    },
    /// A time zone could not be loaded.
    #[error("time zone {zone} of schedule {schedule:?} could not be loaded: {error}")]
    Zone {
        /// The schedule.
        schedule: String,
        /// The zone it names.
        zone: ZoneId,
        /// What went wrong.
        error: String,
    },
}

/// The schedules one scheduler process runs, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduler {
    schedules: Vec<ParsedSchedule>,
}

impl Scheduler {
    /// A scheduler of `schedules`, whose names must be unique.
    pub fn new(schedules: Vec<ParsedSchedule>) -> Result<Scheduler, SchedulerError> {
        let mut seen = std::collections::BTreeSet::new();
        for schedule in &schedules {
            if !seen.insert(schedule.name()) {
                return Err(SchedulerError::DuplicateName(schedule.name().to_owned()));
            }
        }
        Ok(Scheduler { schedules })
    }

    /// The schedules of `app` (validated here, and each one's task checked as every store
    /// checks an enqueue), each with its time zone from `load_zone`, called once per distinct
    /// named zone (UTC and fixed offsets need no loading). The caller does the I/O: the
    /// driver reads the system's zoneinfo files.
    pub fn from_app(
        app: &AppConfig,
        mut load_zone: impl FnMut(&ZoneId) -> Result<TimeZone, String>,
    ) -> Result<Scheduler, SchedulerError> {
        app.validate()?;
        let mut zones: BTreeMap<String, TimeZone> = BTreeMap::new();
        let mut schedules = Vec::with_capacity(app.schedules.len());
        for config in &app.schedules {
            let id = config.zone_id()?;
            let tz = match id.builtin() {
                Some(tz) => tz,
                None => match zones.get(&id.to_string()) {
                    Some(tz) => tz.clone(),
                    None => {
                        let tz = load_zone(&id).map_err(|error| SchedulerError::Zone {
                            schedule: config.name.clone(),
                            zone: id.clone(),
                            error,
                        })?;
                        zones.insert(id.to_string(), tz.clone());
                        tz
                    }
                },
            };
            let schedule = ParsedSchedule::new(config.clone(), tz)?;
            // Checked once here, so that a check never meets a refusal it would meet forever.
            check_new_task(app, &schedule.new_task(), DbTime(0))
                .map_err(|error| SchedulerError::Task { schedule: config.name.clone(), error })?;
            schedules.push(schedule);
        }
        Scheduler::new(schedules)
    }

    /// The schedules, in configured order.
    pub fn schedules(&self) -> &[ParsedSchedule] {
        &self.schedules
    }

    /// The schedule named `name`.
    pub fn get(&self, name: &str) -> Option<&ParsedSchedule> {
        self.schedules.iter().find(|s| s.name() == name)
    }

    /// The schedules' names, in configured order.
    pub fn names(&self) -> Vec<&str> {
        self.schedules.iter().map(ParsedSchedule::name).collect()
    }

    /// What to do at `now`, the database's clock, given the last tick each schedule has
    /// recorded (`recorded[name]`; a schedule missing from it is new).
    pub fn plan(&self, recorded: &BTreeMap<String, DbTime>, now: DbTime) -> Plan {
        let mut writes = Vec::new();
        let mut next_check: Option<DbTime> = None;
        for schedule in &self.schedules {
            let read = recorded.get(schedule.name()).copied();
            let due = schedule.due(read, now);
            next_check = earliest(next_check, due.next_check);
            if let Some(write) = ScheduleWrite::from_due(schedule, read, due) {
                writes.push(write);
            }
        }
        Plan { now, writes, next_check }
    }
}

fn earliest(a: Option<DbTime>, b: Option<DbTime>) -> Option<DbTime> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The writes of one check, and when the next tick of any schedule falls due.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The database's clock the plan was made at.
    pub now: DbTime,
    /// One write per schedule whose record changes, in configured order.
    pub writes: Vec<ScheduleWrite>,
    /// The earliest next tick of any schedule (`None`: none ever fires again).
    pub next_check: Option<DbTime>,
}

/// One schedule's record to write, and the tasks that go with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleWrite {
    /// The schedule.
    pub name: String,
    /// The last tick read: the write applies only if the record still holds it. `None`
    /// inserts a new record, only if there is none.
    pub read: Option<DbTime>,
    /// The last tick to record.
    pub advance_to: DbTime,
    /// The schedule's next tick after this write.
    pub next_tick: Option<DbTime>,
    /// The ticks enqueued, ascending; one task each, in `tasks`.
    pub ticks: Vec<DbTime>,
    /// How many of `ticks`, from the first, are missed ticks being backfilled.
    pub backfilled: usize,
    /// Whether due ticks are left out (missed beyond the backfill).
    pub skipped: bool,
    /// The tasks to enqueue, one per tick, in the write's transaction.
    pub tasks: Vec<NewTask>,
}

impl ScheduleWrite {
    fn from_due(schedule: &ParsedSchedule, read: Option<DbTime>, due: Due) -> Option<ScheduleWrite> {
        let advance_to = due.advance_to?;
        let tasks = due.ticks.iter().map(|_| schedule.new_task()).collect();
        Some(ScheduleWrite {
            name: schedule.name().to_owned(),
            read,
            advance_to,
            next_tick: due.next_check,
            ticks: due.ticks,
            backfilled: due.backfilled,
            skipped: due.skipped,
            tasks,
        })
    }
}

/// How long to sleep after a check made at `now` before the next one: until `next_check`,
/// at least [`MIN_CHECK_DELAY_MS`] and at most `max_ms` (also when nothing is due ever).
pub fn check_delay_ms(now: DbTime, next_check: Option<DbTime>, max_ms: u64) -> u64 {
    let max_ms = max_ms.max(MIN_CHECK_DELAY_MS);
    match next_check {
        Some(at) => u64::try_from(at.0.saturating_sub(now.0)).unwrap_or(0).clamp(MIN_CHECK_DELAY_MS, max_ms),
        None => max_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleConfig;

    const MINUTE: i64 = 60_000;
    // 2026-01-01 00:00 UTC.
    const T0: DbTime = DbTime(1_767_225_600_000);

    fn every(name: &str, every: &str, backfill: u32) -> ScheduleConfig {
        ScheduleConfig { every: Some(every.into()), backfill, ..ScheduleConfig::new(name, "tick") }
    }

    fn scheduler(configs: Vec<ScheduleConfig>) -> Scheduler {
        let app = AppConfig { schedules: configs, ..AppConfig::default() };
        Scheduler::from_app(&app, |id| Err(format!("no file for {id}"))).unwrap()
    }

    #[test]
    fn a_new_schedule_is_recorded_without_tasks() {
        let s = scheduler(vec![every("a", "1m", 0)]);
        let plan = s.plan(&BTreeMap::new(), DbTime(T0.0 + 30_000));
        assert_eq!(plan.writes.len(), 1);
        let write = &plan.writes[0];
        assert_eq!((write.read, write.advance_to), (None, DbTime(T0.0 + 30_000)));
        assert!(write.ticks.is_empty() && write.tasks.is_empty());
        assert_eq!(plan.next_check, Some(DbTime(T0.0 + MINUTE)));
    }

    #[test]
    fn due_ticks_become_tasks_and_the_earliest_next_tick_wins() {
        let s = scheduler(vec![every("a", "1m", 2), every("b", "1h", 0)]);
        let recorded: BTreeMap<String, DbTime> = [("a".to_owned(), T0), ("b".to_owned(), T0)].into_iter().collect();
        // Three minutes later: a's latest tick on time plus two backfilled; b has nothing due.
        let plan = s.plan(&recorded, DbTime(T0.0 + 3 * MINUTE + 10));
        assert_eq!(plan.writes.len(), 1);
        let write = &plan.writes[0];
        assert_eq!(write.name, "a");
        assert_eq!(write.read, Some(T0));
        assert_eq!(write.ticks, [1, 2, 3].map(|k| DbTime(T0.0 + k * MINUTE)));
        assert_eq!((write.backfilled, write.skipped), (2, false));
        assert_eq!(write.tasks.len(), 3);
        assert_eq!(write.tasks[0].name, "tick");
        assert_eq!(plan.next_check, Some(DbTime(T0.0 + 4 * MINUTE)));
        // Nothing due: no writes at all.
        let recorded: BTreeMap<String, DbTime> =
            [("a".to_owned(), write.advance_to), ("b".to_owned(), T0)].into_iter().collect();
        assert!(s.plan(&recorded, DbTime(T0.0 + 3 * MINUTE + 20)).writes.is_empty());
    }

    #[test]
    fn zones_are_loaded_once_and_failures_name_the_schedule() {
        let daily = |name: &str| ScheduleConfig {
            daily: Some("09:00".into()),
            timezone: "Europe/Paris".into(),
            ..ScheduleConfig::new(name, "t")
        };
        let app = AppConfig { schedules: vec![daily("a"), daily("b")], ..AppConfig::default() };
        let mut loads = 0;
        let s = Scheduler::from_app(&app, |id| {
            loads += 1;
            TimeZone::from_posix_tz(&id.to_string(), "CET-1CEST,M3.5.0,M10.5.0/3").map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!((loads, s.schedules().len()), (1, 2));
        let error = Scheduler::from_app(&app, |_| Err("missing".into())).unwrap_err();
        assert!(matches!(&error, SchedulerError::Zone { schedule, .. } if schedule == "a"), "{error}");
        assert!(error.to_string().contains("Europe/Paris"), "{error}");
    }

    #[test]
    fn invalid_apps_and_duplicate_names_are_refused() {
        let app = AppConfig { schedules: vec![every("a", "1m", 0), every("a", "1h", 0)], ..AppConfig::default() };
        assert!(matches!(Scheduler::from_app(&app, |_| Err(String::new())), Err(SchedulerError::Invalid(_))));
        let tz = TimeZone::Utc;
        let one = ParsedSchedule::new(every("a", "1m", 0), tz.clone()).unwrap();
        let two = ParsedSchedule::new(every("a", "1h", 0), tz).unwrap();
        assert_eq!(Scheduler::new(vec![one, two]), Err(SchedulerError::DuplicateName("a".into())));
    }

    #[test]
    fn check_delays_are_bounded() {
        assert_eq!(check_delay_ms(T0, Some(DbTime(T0.0 + 1_500)), 60_000), 1_500);
        assert_eq!(check_delay_ms(T0, Some(DbTime(T0.0 - 5)), 60_000), MIN_CHECK_DELAY_MS);
        assert_eq!(check_delay_ms(T0, Some(DbTime(T0.0 + 86_400_000)), 60_000), 60_000);
        assert_eq!(check_delay_ms(T0, None, 60_000), 60_000);
        assert_eq!(check_delay_ms(T0, None, 0), MIN_CHECK_DELAY_MS);
        assert_eq!(check_delay_ms(DbTime(i64::MIN), Some(DbTime(i64::MAX)), 1_000), 1_000);
    }
}
