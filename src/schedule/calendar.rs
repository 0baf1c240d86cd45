//! Calendar patterns: the local civil times a cron, daily, weekly or monthly schedule fires at,
//! and the search for the next or previous one, in local time and then through a time zone.
//!
//! A pattern is a set of bit masks (seconds, minutes, hours, days of the month, months,
//! weekdays) and a rule combining the day of the month with the weekday. The searches walk
//! month by month and skip with bit scans, so finding the next tick of a sparse pattern costs
//! a few hundred steps, not one per minute. jiff's civil dates do the calendar (days of a
//! month, weekdays, the next and previous day).

use jiff::SignedDuration;
use jiff::civil::{Date, DateTime, Time};

use super::DbTime;
use super::civil::{CivilDateTime, Weekday};
use super::tz::TimeZone;

const SECS_PER_DAY: i64 = 86_400;

/// How far a search looks: 401 Gregorian years. The calendar repeats every 400 years, so a
/// pattern with no match in this span has none at all.
pub(crate) const SEARCH_SECS: i64 = 401 * 146_097 / 400 * SECS_PER_DAY;

/// [`SEARCH_SECS`] as a duration.
pub(crate) const SEARCH: SignedDuration = SignedDuration::from_secs(SEARCH_SECS);

/// How many local ticks a search through a time zone may pass over because they resolve to
/// instants on the wrong side (ticks inside an overlap). Real zones need at most a day of
/// minutes; the bound only keeps corrupt zone data from looping for long.
const MAX_ZONE_STEPS: usize = 10_000;

/// A set of local civil times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pattern {
    /// Bits 0–59.
    pub(crate) seconds: u64,
    /// Bits 0–59.
    pub(crate) minutes: u64,
    /// Bits 0–23.
    pub(crate) hours: u64,
    /// Bits 1–31.
    pub(crate) days: u64,
    /// Bits 1–12.
    pub(crate) months: u64,
    /// Bits 0–6, 0 = Sunday.
    pub(crate) weekdays: u64,
    /// A day matches when its day of the month OR its weekday is in the sets (crontab's rule
    /// when both fields are restricted); otherwise when both are.
    pub(crate) days_or: bool,
}

fn next_bit(mask: u64, from: u64) -> Option<u64> {
    if from >= 64 {
        return None;
    }
    let rest = mask >> from;
    (rest != 0).then(|| from + u64::from(rest.trailing_zeros()))
}

fn prev_bit(mask: u64, from: u64) -> Option<u64> {
    let below = if from >= 63 { mask } else { mask & ((1 << (from + 1)) - 1) };
    (below != 0).then(|| 63 - u64::from(below.leading_zeros()))
}

fn has(mask: u64, bit: u8) -> bool {
    mask >> bit & 1 == 1
}

/// The hour, minute and second of `time`.
fn hms(time: Time) -> (u64, u64, u64) {
    let part = |n: i8| u64::from(n.unsigned_abs());
    (part(time.hour()), part(time.minute()), part(time.second()))
}

/// The time `hour:minute:second`, if each is in range.
fn time(hour: u64, minute: u64, second: u64) -> Option<Time> {
    let part = |n: u64| i8::try_from(n).ok();
    Time::new(part(hour)?, part(minute)?, part(second)?, 0).ok()
}

impl Pattern {
    /// Whether no time can match (an empty field), checked before any search.
    fn is_empty(&self) -> bool {
        let (seconds, minutes) = (self.seconds & ((1 << 60) - 1), self.minutes & ((1 << 60) - 1));
        let (hours, days) = (self.hours & ((1 << 24) - 1), self.days & 0xffff_fffe);
        let (months, weekdays) = (self.months & 0x1ffe, self.weekdays & 0x7f);
        let no_day = if self.days_or { days == 0 && weekdays == 0 } else { days == 0 || weekdays == 0 };
        seconds == 0 || minutes == 0 || hours == 0 || months == 0 || no_day
    }

    fn day_matches(&self, date: Date) -> bool {
        let dom = has(self.days, date.day().unsigned_abs());
        let dow = has(self.weekdays, Weekday::from_jiff(date.weekday()).number());
        if self.days_or { dom || dow } else { dom && dow }
    }

    /// The first time of day at or after `h:m:s` that matches.
    fn time_at_or_after(&self, (h, m, s): (u64, u64, u64)) -> Option<Time> {
        let mut hour = next_bit(self.hours, h)?;
        loop {
            let mut minute = next_bit(self.minutes, if hour == h { m } else { 0 });
            while let Some(mm) = minute {
                let from = if hour == h && mm == m { s } else { 0 };
                if let Some(second) = next_bit(self.seconds, from) {
                    return time(hour, mm, second);
                }
                minute = next_bit(self.minutes, mm + 1);
            }
            hour = next_bit(self.hours, hour + 1)?;
        }
    }

    /// The last time of day at or before `h:m:s` that matches.
    fn time_at_or_before(&self, (h, m, s): (u64, u64, u64)) -> Option<Time> {
        let mut hour = prev_bit(self.hours & ((1 << 24) - 1), h)?;
        loop {
            let minutes = self.minutes & ((1 << 60) - 1);
            let mut minute = prev_bit(minutes, if hour == h { m } else { 59 });
            while let Some(mm) = minute {
                let from = if hour == h && mm == m { s } else { 59 };
                if let Some(second) = prev_bit(self.seconds & ((1 << 60) - 1), from) {
                    return time(hour, mm, second);
                }
                minute = mm.checked_sub(1).and_then(|below| prev_bit(minutes, below));
            }
            hour = hour.checked_sub(1).and_then(|below| prev_bit(self.hours, below))?;
        }
    }

    /// The first matching local time at or after `start` and not after `limit`.
    pub(crate) fn next_at_or_after(&self, start: DateTime, limit: DateTime) -> Option<DateTime> {
        if self.is_empty() {
            return None;
        }
        let mut date = start.date();
        let mut time = start.time();
        loop {
            if date > limit.date() {
                return None;
            }
            if has(self.months, date.month().unsigned_abs()) {
                loop {
                    if self.day_matches(date) {
                        if let Some(t) = self.time_at_or_after(hms(time)) {
                            let at = date.to_datetime(t);
                            return (at <= limit).then_some(at);
                        }
                    }
                    time = Time::midnight();
                    if date.day() == date.days_in_month() {
                        break;
                    }
                    date = date.tomorrow().ok()?;
                }
            }
            date = date.last_of_month().tomorrow().ok()?;
            time = Time::midnight();
        }
    }

    /// The last matching local time at or before `start` and not before `floor`.
    pub(crate) fn prev_at_or_before(&self, start: DateTime, floor: DateTime) -> Option<DateTime> {
        if self.is_empty() {
            return None;
        }
        let last_second = Time::constant(23, 59, 59, 0);
        let mut date = start.date();
        let mut time = start.time();
        loop {
            if date < floor.date() {
                return None;
            }
            if has(self.months, date.month().unsigned_abs()) {
                loop {
                    if self.day_matches(date) {
                        if let Some(t) = self.time_at_or_before(hms(time)) {
                            let at = date.to_datetime(t);
                            return (at >= floor).then_some(at);
                        }
                    }
                    time = last_second;
                    if date.day() == 1 {
                        break;
                    }
                    date = date.yesterday().ok()?;
                }
            }
            date = date.first_of_month().yesterday().ok()?;
            time = last_second;
        }
    }

    /// Whether the local time `local` matches.
    #[cfg(test)]
    pub(crate) fn matches(&self, local: DateTime) -> bool {
        self.next_at_or_after(local, local) == Some(local)
    }
}

/// The first tick of `pattern` in `tz` strictly after `after`: the earliest instant of the
/// first local tick whose instant is after `after` (a tick inside a gap resolves to the end of
/// the gap, a tick inside an overlap to its first occurrence).
pub(crate) fn next_after(pattern: &Pattern, after: DbTime, tz: &TimeZone) -> Option<DbTime> {
    // Local ticks up to the latest local time already shown are at or before `after`.
    let mut local = tz.high_water_local(after);
    let limit = local.saturating_add(SEARCH);
    for _ in 0..MAX_ZONE_STEPS {
        let tick = pattern.next_at_or_after(local.checked_add(SignedDuration::from_secs(1)).ok()?, limit)?;
        let at = tz.resolve(CivilDateTime::from_jiff(tick))?;
        if at > after {
            return Some(at);
        }
        local = tick;
    }
    None
}

/// The last tick of `pattern` in `tz` at or before `at` and strictly after `floor`.
pub(crate) fn prev_at_or_before(pattern: &Pattern, at: DbTime, floor: DbTime, tz: &TimeZone) -> Option<DbTime> {
    if at <= floor {
        return None;
    }
    let mut local = tz.high_water_local(at);
    // A tick after `floor` is at most a UTC offset plus an overlap before it in local time.
    let floor_as_local =
        TimeZone::Utc.to_local(floor).datetime.to_jiff().saturating_sub(SignedDuration::from_hours(3 * 24));
    let local_floor = floor_as_local.max(local.saturating_sub(SEARCH));
    for _ in 0..MAX_ZONE_STEPS {
        let tick = pattern.prev_at_or_before(local, local_floor)?;
        let instant = tz.resolve(CivilDateTime::from_jiff(tick))?;
        if instant <= at {
            return (instant > floor).then_some(instant);
        }
        local = tick.checked_sub(SignedDuration::from_secs(1)).ok()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Pattern = Pattern {
        seconds: 1,
        minutes: (1 << 60) - 1,
        hours: (1 << 24) - 1,
        days: 0xffff_fffe,
        months: 0x1ffe,
        weekdays: 0x7f,
        days_or: false,
    };

    #[test]
    fn bit_scans() {
        assert_eq!(next_bit(0b1010, 0), Some(1));
        assert_eq!(next_bit(0b1010, 2), Some(3));
        assert_eq!(next_bit(0b1010, 4), None);
        assert_eq!(next_bit(u64::MAX, 64), None);
        assert_eq!(prev_bit(0b1010, 2), Some(1));
        assert_eq!(prev_bit(0b1010, 0), None);
        assert_eq!(prev_bit(1 << 63, 200), Some(63));
    }

    fn at(seconds: i64) -> DateTime {
        CivilDateTime::from_unix_seconds(seconds).unwrap().to_jiff()
    }

    #[test]
    fn every_minute_steps_by_sixty_seconds() {
        assert_eq!(ALL.next_at_or_after(at(0), DateTime::MAX), Some(at(0)));
        assert_eq!(ALL.next_at_or_after(at(1), DateTime::MAX), Some(at(60)));
        assert_eq!(ALL.prev_at_or_before(at(59), DateTime::MIN), Some(at(0)));
        assert_eq!(ALL.prev_at_or_before(at(-1), DateTime::MIN), Some(at(-60)));
        assert_eq!(ALL.next_at_or_after(at(1), at(59)), None);
        assert_eq!(ALL.prev_at_or_before(at(-1), at(-59)), None);
        assert!(ALL.matches(at(120)) && !ALL.matches(at(121)));
        // At the ends of the calendar the search ends.
        assert_eq!(ALL.next_at_or_after(DateTime::MAX, DateTime::MAX), None);
        assert_eq!(ALL.prev_at_or_before(DateTime::MIN, DateTime::MIN), Some(DateTime::MIN));
    }

    #[test]
    fn empty_patterns_never_match() {
        let no_month = Pattern { months: 1, ..ALL };
        assert_eq!(no_month.next_at_or_after(at(0), DateTime::MAX), None);
        let no_weekday = Pattern { weekdays: 0, ..ALL };
        assert_eq!(no_weekday.prev_at_or_before(at(0), DateTime::MIN), None);
        // February 30 is not empty field by field, but the bounded search ends.
        let feb_30 = Pattern { days: 1 << 30, months: 1 << 2, ..ALL };
        assert_eq!(feb_30.next_at_or_after(at(0), at(SEARCH_SECS)), None);
        assert_eq!(feb_30.prev_at_or_before(at(0), at(-SEARCH_SECS)), None);
        assert_eq!(feb_30.next_at_or_after(DateTime::MIN, DateTime::MAX), None);
    }
}
