//! Schedules: tasks enqueued on a timetable (cron, a fixed interval, daily, weekly, monthly),
//! in a time zone, and the pure decision of which ticks fall due.
//!
//! Everything here is pure: instants are [`DbTime`]s passed in (the database's clock), time
//! zones come from TZif bytes the caller read ([`TimeZone::from_tzif`], after checking the name
//! with [`zone_path`]), and nothing reads a clock or a file. jiff does the calendar and the
//! zones (civil dates, TZif data, POSIX TZ rules, gaps and overlaps); this module keeps the
//! schedules' own types over it ([`CivilDateTime`], [`TimeZone`], [`LocalResult`]) and the
//! search for ticks. Durations (`every`, `offset`) are read by [`parse_duration_ms`], the
//! grammar of [`crate::time`] (`500ms`, `90s`, `15m`, `1h30m`, `1h 30m`, `7d`).
//!
//! # Configuration
//!
//! A schedule is an `[[app.schedules]]` table; exactly one of `cron`, `every`, `daily`,
//! `weekly` and `monthly` says when it fires:
//!
//! ```toml
//! [[app.schedules]]
//! name = "nightly_report"      # unique; 1 to 52 bytes of a-z, 0-9 and _
//! task = "report"              # the task enqueued at each tick
//! args = { kind = "daily" }    # its JSON arguments (default null)
//! queue = "default"            # optional: the app's first queue by default
//! priority = 0                 # optional
//! cron = "0 3 * * *"           # or every = "15m", daily = "03:00",
//!                              # weekly = { days = ["mon", "fri"], at = "09:30" },
//!                              # monthly = { day = 1, at = "00:00" }
//! timezone = "Europe/Paris"    # default "UTC"; also fixed offsets "+02:00", "-05:30"
//! backfill = 0                 # missed ticks to enqueue after downtime, 0 to 10000
//! misfire_ms = 60000           # a tick seen later than this after its time is missed
//! ```
//!
//! # Ticks
//!
//! - **Cron** ([`Cron`]): second 0 of every matching local minute.
//! - **Interval** (`every`, with an optional `offset`): every `offset + k * every` ms since the
//!   Unix epoch, so every scheduler process computes the same instants without shared state.
//!   Time zones do not apply (`timezone` must stay `UTC`).
//! - **Daily**, **weekly**, **monthly**: at a local time of day; monthly on a day of the month
//!   1–31, and a month without that day is skipped (as cron does: day 31 fires in seven
//!   months a year, day 29 of February only in leap years).
//!
//! Local times meet daylight saving time by two rules:
//! - a tick in a **gap** (clocks set forward over it: 02:30 on a day when 02:00 becomes 03:00)
//!   fires once, at the first instant after the gap (03:00 local); several ticks in one gap
//!   fire once together;
//! - a tick in an **overlap** (clocks set back: 02:30 occurs twice) fires once, at its first
//!   occurrence.
//!
//! # Due ticks and exactly-once enqueue
//!
//! [`due`] decides, from the last tick a schedule has recorded and the database's `now`, which
//! ticks to enqueue and what to record. A new schedule (`last_tick = None`) enqueues nothing
//! and records `now`: an hourly schedule added at 10:30 first fires at 11:00. Otherwise the due
//! ticks are those in `(last_tick, now]`; the latest is enqueued when it is at most
//! `misfire_ms` old; the others, and the latest when it is older, are missed ticks, of which
//! the `backfill` most recent are enqueued. So at most `backfill + 1` ticks are enqueued, and
//! the work is bounded by that many steps (plus a search back to the latest tick, month by
//! month for calendar schedules and in constant time for intervals), however long the
//! downtime.
//!
//! The store records the new last tick and enqueues the ticks in one transaction, and only if
//! its record still holds the `last_tick` the decision was computed from (compare-and-set, or
//! an "advance only if greater" upsert that returns the previous value, with only the ticks
//! after that value enqueued). Concurrent schedulers then enqueue each tick exactly once.
//!
//! # Schedulers (in [`scheduler`](crate::scheduler))
//!
//! A [`Scheduler`](crate::scheduler::Scheduler) holds an app's parsed schedules ([`Scheduler::from_app`](crate::scheduler::Scheduler::from_app), with zones from a
//! loader the caller gives) and turns the records a store read into a [`Plan`](crate::scheduler::Plan): one
//! [`ScheduleWrite`](crate::scheduler::ScheduleWrite) per record to change, each with the value it read (for the
//! compare-and-set), the tick to record and the tasks to enqueue, and the instant of the next
//! check ([`check_delay_ms`](crate::scheduler::check_delay_ms) bounds the sleep until then). The PostgreSQL store applies plans
//! (`PgStore::check_schedules`); the driver runs checks in a loop, inside workers or on its own.

mod calendar;
mod civil;
mod cron;
mod tz;

use std::fmt;

use serde::{Deserialize, Serialize};

use self::calendar::{Pattern, SEARCH_SECS};
pub use self::civil::{CivilDateTime, TimeOfDay, Weekday, WeekdaySet};
pub use self::cron::{Cron, CronError, CronField};
pub use self::tz::{LocalDateTime, LocalResult, TimeZone, TzError, UtcOffset, ZoneId, ZoneRules, zone_path};
use crate::check::{Check, ConfigError};
use crate::task::DbTime;
use crate::task::{QUEUE_NAME_RULE, is_valid_queue_name};
use crate::time::DURATION_RULE;
pub use crate::time::{ParseError, format_duration_ms, parse_duration_ms};

/// The shortest interval: 1 s.
pub const MIN_INTERVAL_MS: u64 = 1_000;
/// The longest interval: 365 days.
pub const MAX_INTERVAL_MS: u64 = 365 * 86_400_000;
/// The most missed ticks a schedule may backfill.
pub const MAX_BACKFILL: u32 = 10_000;
/// The default of [`ScheduleConfig::misfire_ms`]: 60 s.
pub const DEFAULT_MISFIRE_MS: u64 = 60_000;

const MISFIRE_MS: std::ops::RangeInclusive<u64> = 1_000..=86_400_000;
const KINDS: &str = "exactly one of cron, every, daily, weekly or monthly";

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

/// Ticks every `every_ms` milliseconds since the Unix epoch, shifted by `offset_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Interval {
    every_ms: u64,
    offset_ms: u64,
}

impl Interval {
    /// Every `every_ms` ([`MIN_INTERVAL_MS`] to [`MAX_INTERVAL_MS`]) at `offset_ms` past each
    /// multiple (less than `every_ms`).
    pub fn new(every_ms: u64, offset_ms: u64) -> Option<Interval> {
        ((MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(&every_ms) && offset_ms < every_ms)
            .then_some(Interval { every_ms, offset_ms })
    }

    /// The period in ms.
    pub fn every_ms(self) -> u64 {
        self.every_ms
    }

    /// The shift in ms.
    pub fn offset_ms(self) -> u64 {
        self.offset_ms
    }

    /// The tick `k` periods after the epoch's, if it fits.
    fn tick(self, k: i64) -> Option<DbTime> {
        // Both are at most a year in ms, far below i64::MAX.
        let (every, offset) = (self.every_ms as i64, self.offset_ms as i64);
        k.checked_mul(every)?.checked_add(offset).map(DbTime)
    }

    fn next_after(self, after: DbTime) -> Option<DbTime> {
        let k = after.0.checked_sub(self.offset_ms as i64)?.div_euclid(self.every_ms as i64);
        self.tick(k.checked_add(1)?)
    }

    fn prev_at_or_before(self, at: DbTime) -> Option<DbTime> {
        let k = at.0.checked_sub(self.offset_ms as i64)?.div_euclid(self.every_ms as i64);
        self.tick(k)
    }
}

/// When a schedule fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schedule {
    /// At the ticks of a crontab expression, in local time.
    Cron(Cron),
    /// At fixed intervals since the Unix epoch; time zones do not apply.
    Interval(Interval),
    /// Every day at a local time.
    Daily(TimeOfDay),
    /// On some weekdays at a local time.
    Weekly {
        /// The days; none means never.
        days: WeekdaySet,
        /// The local time.
        at: TimeOfDay,
    },
    /// On a day of every month at a local time; months without that day are skipped.
    Monthly {
        /// The day of the month, 1–31 (any other value never fires).
        day: u8,
        /// The local time.
        at: TimeOfDay,
    },
}

impl Schedule {
    /// The local times a calendar schedule fires at; `None` for an interval.
    fn pattern(&self) -> Option<Pattern> {
        let every_day = Pattern {
            seconds: 1,
            minutes: 1,
            hours: 1,
            days: 0xffff_fffe,
            months: 0x1ffe,
            weekdays: 0x7f,
            days_or: false,
        };
        let at_time = |at: TimeOfDay| Pattern {
            seconds: 1 << at.second(),
            minutes: 1 << at.minute(),
            hours: 1 << at.hour(),
            ..every_day
        };
        match self {
            Schedule::Cron(cron) => Some(*cron.pattern()),
            Schedule::Interval(_) => None,
            Schedule::Daily(at) => Some(at_time(*at)),
            Schedule::Weekly { days, at } => Some(Pattern { weekdays: u64::from(days.bits()), ..at_time(*at) }),
            Schedule::Monthly { day, at } => {
                let days = if (1..=31).contains(day) { 1 << day } else { 0 };
                Some(Pattern { days, ..at_time(*at) })
            }
        }
    }

    /// The first tick strictly after `after`, in `tz` (ignored by intervals). `None` when
    /// there is none within 401 years or before the end of [`DbTime`].
    pub fn next_after(&self, after: DbTime, tz: &TimeZone) -> Option<DbTime> {
        match (self, self.pattern()) {
            (Schedule::Interval(interval), _) => interval.next_after(after),
            (_, Some(pattern)) => calendar::next_after(&pattern, after, tz),
            (_, None) => None,
        }
    }

    /// The last tick at or before `at`, in `tz` (ignored by intervals). `None` when there is
    /// none within 401 years.
    pub fn prev_at_or_before(&self, at: DbTime, tz: &TimeZone) -> Option<DbTime> {
        let floor = DbTime(at.0.saturating_sub(SEARCH_SECS * 1000));
        self.prev_after_floor(at, floor, tz)
    }

    /// The last tick at or before `at` and strictly after `floor`.
    fn prev_after_floor(&self, at: DbTime, floor: DbTime, tz: &TimeZone) -> Option<DbTime> {
        match (self, self.pattern()) {
            (Schedule::Interval(interval), _) => interval.prev_at_or_before(at).filter(|&t| t > floor),
            (_, Some(pattern)) => calendar::prev_at_or_before(&pattern, at, floor, tz),
            (_, None) => None,
        }
    }
}

impl fmt::Display for Schedule {
    /// As configured: `cron "0 3 * * *"`, `every 15m`, `daily at 03:00`, `weekly on mon,fri at
    /// 09:30`, `monthly on day 1 at 00:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Schedule::Cron(cron) => write!(f, "cron {:?}", cron.as_str()),
            Schedule::Interval(interval) => {
                write!(f, "every {}", format_duration_ms(interval.every_ms))?;
                if interval.offset_ms != 0 {
                    write!(f, " offset {}", format_duration_ms(interval.offset_ms))?;
                }
                Ok(())
            }
            Schedule::Daily(at) => write!(f, "daily at {at}"),
            Schedule::Weekly { days, at } => {
                let days: Vec<&str> = days.iter().map(Weekday::short_name).collect();
                write!(f, "weekly on {} at {at}", days.join(","))
            }
            Schedule::Monthly { day, at } => write!(f, "monthly on day {day} at {at}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Due ticks
// ---------------------------------------------------------------------------------------------

/// How a schedule catches up after downtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CatchUp {
    /// How many missed ticks to enqueue (the most recent ones).
    pub backfill: u32,
    /// A tick more than this many ms old when seen is missed.
    pub misfire_ms: u64,
}

impl Default for CatchUp {
    /// No backfill, [`DEFAULT_MISFIRE_MS`].
    fn default() -> Self {
        CatchUp { backfill: 0, misfire_ms: DEFAULT_MISFIRE_MS }
    }
}

/// What a scheduler does now for one schedule: see [`due`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Due {
    /// The ticks to enqueue, ascending, all in `(last_tick, now]`; at most `backfill + 1`.
    pub ticks: Vec<DbTime>,
    /// How many of `ticks`, from the first, are missed ticks being backfilled (the rest, at
    /// most one, is the latest tick on time).
    pub backfilled: usize,
    /// Whether some due ticks are neither enqueued nor backfilled (misfired, or beyond the
    /// backfill).
    pub skipped: bool,
    /// The last tick to record: the latest due tick (enqueued or not), `now` for a new
    /// schedule, `None` when nothing is due (keep the record as it is).
    pub advance_to: Option<DbTime>,
    /// When the next tick falls due (`None`: never).
    pub next_check: Option<DbTime>,
}

/// Which ticks of `schedule` to enqueue at `now`, given the last tick recorded (`None` for
/// a new schedule). See the [module documentation](self) for the rules.
pub fn due(schedule: &Schedule, tz: &TimeZone, catch_up: CatchUp, last_tick: Option<DbTime>, now: DbTime) -> Due {
    let Some(last) = last_tick else {
        return Due { advance_to: Some(now), next_check: schedule.next_after(now, tz), ..Due::default() };
    };
    let next_check = schedule.next_after(now.max(last), tz);
    let Some(latest) = schedule.prev_after_floor(now, last, tz) else {
        return Due { next_check, ..Due::default() };
    };
    let older = |t: DbTime| schedule.prev_after_floor(DbTime(t.0 - 1), last, tz);
    let on_time = now.0.saturating_sub(latest.0) <= i64::try_from(catch_up.misfire_ms).unwrap_or(i64::MAX);
    let mut ticks = Vec::new();
    let mut candidate = Some(latest);
    if on_time {
        ticks.push(latest);
        candidate = older(latest);
    }
    let mut backfilled = 0;
    let mut skipped = false;
    while let Some(t) = candidate {
        if backfilled >= catch_up.backfill as usize {
            skipped = true;
            break;
        }
        ticks.push(t);
        backfilled += 1;
        candidate = older(t);
    }
    ticks.reverse();
    Due { ticks, backfilled, skipped, advance_to: Some(latest), next_check }
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

/// `weekly = { days = ["mon", "fri"], at = "09:30" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeeklyConfig {
    /// Weekday names, `sun` to `sat` or in full, any case; at least one.
    pub days: Vec<String>,
    /// The local time, `HH:MM` or `HH:MM:SS`.
    pub at: String,
}

/// `monthly = { day = 1, at = "00:00" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MonthlyConfig {
    /// The day of the month, 1–31; months without it are skipped.
    pub day: u32,
    /// The local time, `HH:MM` or `HH:MM:SS`.
    pub at: String,
}

fn default_timezone() -> String {
    "UTC".to_owned()
}

fn default_misfire_ms() -> u64 {
    DEFAULT_MISFIRE_MS
}

fn is_default_timezone(timezone: &str) -> bool {
    timezone == "UTC"
}

/// One schedule as configured (an `[[app.schedules]]` table). Exactly one of `cron`,
/// `every`, `daily`, `weekly`, `monthly` must be set; [`validate`](Self::validate) says
/// what is wrong with each field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Its unique name, the key of its recorded last tick: 1 to 52 bytes of `a-z`, `0-9`, `_`.
    pub name: String,
    /// The name of the task to enqueue: 1 to 128 bytes.
    pub task: String,
    /// The task's JSON arguments (default null).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub args: serde_json::Value,
    /// The queue; `None` is the app's first queue. Must be one of the app's queues.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// The task's priority (lower runs first).
    #[serde(default)]
    pub priority: i16,
    /// A crontab expression ([`Cron`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    /// An interval, `1s` to `365d` ([`parse_duration_ms`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<String>,
    /// With `every`: the shift of the ticks from multiples of the interval, below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<String>,
    /// Every day at this local time, `HH:MM` or `HH:MM:SS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daily: Option<String>,
    /// On some weekdays at a local time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weekly: Option<WeeklyConfig>,
    /// On a day of the month at a local time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monthly: Option<MonthlyConfig>,
    /// `UTC` (the default), a fixed offset `+HH:MM` / `-HH:MM`, or a tz database name
    /// (`Europe/Paris`). Must be `UTC` for `every`.
    #[serde(default = "default_timezone", skip_serializing_if = "is_default_timezone")]
    pub timezone: String,
    /// How many missed ticks to enqueue after downtime, beyond the latest on-time one:
    /// 0 to [`MAX_BACKFILL`], default 0.
    #[serde(default)]
    pub backfill: u32,
    /// A tick seen more than this many ms after its time is missed: 1 000 to 86 400 000,
    /// default [`DEFAULT_MISFIRE_MS`].
    #[serde(default = "default_misfire_ms")]
    pub misfire_ms: u64,
}

impl ScheduleConfig {
    /// A schedule named `name` enqueueing `task` with every other field defaulted and no
    /// kind set yet (set one of `cron`, `every`, `daily`, `weekly`, `monthly`).
    pub fn new(name: impl Into<String>, task: impl Into<String>) -> ScheduleConfig {
        ScheduleConfig {
            name: name.into(),
            task: task.into(),
            args: serde_json::Value::Null,
            queue: None,
            priority: 0,
            cron: None,
            every: None,
            offset: None,
            daily: None,
            weekly: None,
            monthly: None,
            timezone: default_timezone(),
            backfill: 0,
            misfire_ms: DEFAULT_MISFIRE_MS,
        }
    }

    /// Every problem of this schedule; fields are named without a prefix (`cron`,
    /// `weekly.days[1]`). The queue is checked against an app by [`AppConfig::validate`](crate::config::AppConfig::validate).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        self.check(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)
    }

    /// The schedule, if the configuration is valid.
    pub fn schedule(&self) -> Result<Schedule, ConfigError> {
        self.validate()?;
        // Valid: exactly one kind is set, and it parses.
        let mut problems = Vec::new();
        let schedule = self.parse_kind(&mut Check::root(&mut problems));
        ConfigError::from_problems(problems)?;
        schedule.ok_or_else(|| {
            let mut problems = Vec::new();
            Check::root(&mut problems).problem("cron", "none", KINDS);
            ConfigError { problems }
        })
    }

    /// The time zone named by `timezone`, if valid.
    pub fn zone_id(&self) -> Result<ZoneId, ConfigError> {
        ZoneId::parse(&self.timezone).map_err(|e| {
            let mut problems = Vec::new();
            Check::root(&mut problems).problem("timezone", format!("{:?}", self.timezone), zone_expected(&e));
            ConfigError { problems }
        })
    }

    /// How the schedule catches up after downtime.
    pub fn catch_up(&self) -> CatchUp {
        CatchUp { backfill: self.backfill, misfire_ms: self.misfire_ms }
    }

    /// Reports every problem under `c`'s prefix.
    pub(crate) fn check(&self, c: &mut Check<'_>) {
        if !is_valid_queue_name(&self.name) {
            c.problem("name", format!("{:?}", self.name), QUEUE_NAME_RULE);
        }
        if self.task.is_empty() || self.task.len() > 128 {
            c.problem("task", format!("{:?}", self.task), "1 to 128 bytes");
        }
        if let Some(queue) = &self.queue {
            if !is_valid_queue_name(queue) {
                c.problem("queue", format!("{queue:?}"), QUEUE_NAME_RULE);
            }
        }
        let set: Vec<&str> = [
            ("cron", self.cron.is_some()),
            ("every", self.every.is_some()),
            ("daily", self.daily.is_some()),
            ("weekly", self.weekly.is_some()),
            ("monthly", self.monthly.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, is_set)| is_set.then_some(key))
        .collect();
        match set.as_slice() {
            [] => c.problem("cron", "none", format!("{KINDS} (none is set)")),
            [_] => {
                self.parse_kind(c);
            }
            [first, second, ..] => c.problem(second, "set", format!("{KINDS} ({first} is set too)")),
        }
        if self.offset.is_some() && self.every.is_none() {
            c.problem("offset", format!("{:?}", self.offset.as_deref().unwrap_or("")), "no offset without every");
        }
        match ZoneId::parse(&self.timezone) {
            Err(e) => c.problem("timezone", format!("{:?}", self.timezone), zone_expected(&e)),
            Ok(id) if self.every.is_some() && id != ZoneId::Utc => {
                c.problem("timezone", format!("{:?}", self.timezone), "\"UTC\" with every (intervals ignore zones)");
            }
            Ok(_) => {}
        }
        c.range("backfill", self.backfill, 0..=MAX_BACKFILL);
        c.range("misfire_ms", self.misfire_ms, MISFIRE_MS);
    }

    /// Parses the one kind that is set, reporting its problems.
    fn parse_kind(&self, c: &mut Check<'_>) -> Option<Schedule> {
        let quoted = |s: &str| format!("{s:?}");
        if let Some(text) = &self.cron {
            return match Cron::parse(text) {
                Ok(cron) => Some(Schedule::Cron(cron)),
                Err(e) => {
                    c.problem("cron", quoted(text), format!("a cron expression ({e})"));
                    None
                }
            };
        }
        if let Some(text) = &self.every {
            let every = match parse_duration_ms(text) {
                Ok(ms) if (MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(&ms) => Some(ms),
                Ok(_) => {
                    c.problem("every", quoted(text), "an interval from 1s to 365d");
                    None
                }
                Err(_) => {
                    c.problem("every", quoted(text), format!("{DURATION_RULE}, from 1s to 365d"));
                    None
                }
            };
            let offset = match &self.offset {
                None => Some(0),
                Some(text) => match parse_duration_ms(text) {
                    Ok(ms) if every.is_none_or(|every| ms < every) => Some(ms),
                    Ok(_) => {
                        c.problem(
                            "offset",
                            quoted(text),
                            format!("less than every ({})", self.every.as_deref().unwrap_or("")),
                        );
                        None
                    }
                    Err(_) => {
                        c.problem("offset", quoted(text), DURATION_RULE);
                        None
                    }
                },
            };
            return Interval::new(every?, offset?).map(Schedule::Interval);
        }
        let time = |c: &mut Check<'_>, field: &str, text: &str| match TimeOfDay::parse(text) {
            Ok(at) => Some(at),
            Err(e) => {
                c.problem(field, quoted(text), e.expected);
                None
            }
        };
        if let Some(text) = &self.daily {
            return time(c, "daily", text).map(Schedule::Daily);
        }
        if let Some(weekly) = &self.weekly {
            let mut days = WeekdaySet::EMPTY;
            let mut days_ok = true;
            if weekly.days.is_empty() {
                c.problem("weekly.days", "[]", "at least one weekday");
                days_ok = false;
            }
            for (i, name) in weekly.days.iter().enumerate() {
                match Weekday::from_name(name) {
                    Some(day) => days = days.with(day),
                    None => {
                        c.problem(&format!("weekly.days[{i}]"), quoted(name), "a weekday, sun to sat or in full");
                        days_ok = false;
                    }
                }
            }
            let at = time(c, "weekly.at", &weekly.at);
            return at.filter(|_| days_ok).map(|at| Schedule::Weekly { days, at });
        }
        if let Some(monthly) = &self.monthly {
            let day_ok = c.range("monthly.day", monthly.day, 1..=31);
            let at = time(c, "monthly.at", &monthly.at);
            // In range, so it fits a u8.
            return at.filter(|_| day_ok).map(|at| Schedule::Monthly { day: monthly.day as u8, at });
        }
        None
    }
}

fn zone_expected(error: &TzError) -> String {
    match error {
        TzError::InvalidOffset(_) => "a fixed offset +HH:MM or -HH:MM, at most 23:59".to_owned(),
        TzError::InvalidName { expected, .. } => format!("\"UTC\", +HH:MM, -HH:MM or a zone name of {expected}"),
        other => other.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// A parsed schedule
// ---------------------------------------------------------------------------------------------

/// Why a schedule could not be prepared.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The configuration breaks rules.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// The time zone given is not the one the configuration names.
    #[error("time zone {found} given for schedule {schedule:?}: expected its configured zone {expected}")]
    ZoneMismatch {
        /// The schedule's name.
        schedule: String,
        /// The zone the configuration names.
        expected: ZoneId,
        /// The zone given.
        found: ZoneId,
    },
}

/// A schedule parsed once, with its time zone loaded: what a scheduler keeps.
///
/// ```
/// use canter::store::DbTime;
/// use canter::schedule::{ParsedSchedule, ScheduleConfig};
///
/// let config = ScheduleConfig { cron: Some("0 * * * *".into()), ..ScheduleConfig::new("hourly", "tick") };
/// // UTC and fixed offsets need no file; a named zone's TZif bytes come from the caller:
/// // TimeZone::from_tzif(name, &std::fs::read(dir.join(zone_path(name)?))?)?
/// let tz = config.zone_id().unwrap().builtin().unwrap();
/// let schedule = ParsedSchedule::new(config, tz).unwrap();
///
/// let added = DbTime(1_767_263_400_000); // 2026-01-01 10:30 UTC
/// let due = schedule.due(None, added);
/// assert!(due.ticks.is_empty());
/// assert_eq!(due.next_check, Some(DbTime(1_767_265_200_000))); // 11:00
/// let due = schedule.due(due.advance_to, DbTime(1_767_265_200_500));
/// assert_eq!(due.ticks, [DbTime(1_767_265_200_000)]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSchedule {
    config: ScheduleConfig,
    schedule: Schedule,
    tz: TimeZone,
}

impl ParsedSchedule {
    /// Validates `config` and pairs it with its time zone `tz` (the zone [`ScheduleConfig::zone_id`]
    /// names: built in, or read from TZif bytes by the caller).
    pub fn new(config: ScheduleConfig, tz: TimeZone) -> Result<ParsedSchedule, ScheduleError> {
        let schedule = config.schedule()?;
        let expected = config.zone_id()?;
        let found = tz.id();
        if found != expected {
            return Err(ScheduleError::ZoneMismatch { schedule: config.name, expected, found });
        }
        Ok(ParsedSchedule { config, schedule, tz })
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Its configuration.
    pub fn config(&self) -> &ScheduleConfig {
        &self.config
    }

    /// When it fires.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Its time zone.
    pub fn time_zone(&self) -> &TimeZone {
        &self.tz
    }

    /// The first tick strictly after `after`.
    pub fn next_after(&self, after: DbTime) -> Option<DbTime> {
        self.schedule.next_after(after, &self.tz)
    }

    /// Which ticks to enqueue at `now` given the last tick recorded: [`due`].
    pub fn due(&self, last_tick: Option<DbTime>, now: DbTime) -> Due {
        due(&self.schedule, &self.tz, self.config.catch_up(), last_tick, now)
    }
}

#[cfg(test)]
mod tests;
