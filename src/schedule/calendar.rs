//! Calendar patterns: the local civil times a cron, daily, weekly or monthly schedule fires at,
//! and the search for the next or previous one, in local time and then through a time zone.
//!
//! A pattern is a set of bit masks (seconds, minutes, hours, days of the month, months,
//! weekdays) and a rule combining the day of the month with the weekday. The searches walk
//! month by month and skip with bit scans, so finding the next tick of a sparse pattern costs
//! a few hundred steps, not one per minute.

use super::DbTime;
use super::civil::{civil_from_days, days_from_civil, days_in_month, weekday_from_days};
use super::tz::TimeZone;

const SECS_PER_DAY: i64 = 86_400;

/// How far a search looks: 401 Gregorian years. The calendar repeats every 400 years, so a
/// pattern with no match in this span has none at all.
pub(crate) const SEARCH_SECS: i64 = 401 * 146_097 / 400 * SECS_PER_DAY;

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

impl Pattern {
    /// Whether no time can match (an empty field), checked before any search.
    fn is_empty(&self) -> bool {
        let (seconds, minutes) = (self.seconds & ((1 << 60) - 1), self.minutes & ((1 << 60) - 1));
        let (hours, days) = (self.hours & ((1 << 24) - 1), self.days & 0xffff_fffe);
        let (months, weekdays) = (self.months & 0x1ffe, self.weekdays & 0x7f);
        let no_day = if self.days_or { days == 0 && weekdays == 0 } else { days == 0 || weekdays == 0 };
        seconds == 0 || minutes == 0 || hours == 0 || months == 0 || no_day
    }

    fn day_matches(&self, year: i64, month: u8, day: u8) -> bool {
        let dom = has(self.days, day);
        let dow = has(self.weekdays, weekday_from_days(days_from_civil(year, month, day)));
        if self.days_or { dom || dow } else { dom && dow }
    }

    /// The first time of day at or after `h:m:s` that matches.
    fn time_at_or_after(&self, h: u64, m: u64, s: u64) -> Option<u64> {
        let mut hour = next_bit(self.hours, h)?;
        loop {
            let mut minute = next_bit(self.minutes, if hour == h { m } else { 0 });
            while let Some(mm) = minute {
                let from = if hour == h && mm == m { s } else { 0 };
                if let Some(second) = next_bit(self.seconds, from) {
                    return (hour < 24 && mm < 60 && second < 60).then_some(hour * 3600 + mm * 60 + second);
                }
                minute = next_bit(self.minutes, mm + 1);
            }
            hour = next_bit(self.hours, hour + 1)?;
        }
    }

    /// The last time of day at or before `h:m:s` that matches.
    fn time_at_or_before(&self, h: u64, m: u64, s: u64) -> Option<u64> {
        let mut hour = prev_bit(self.hours & ((1 << 24) - 1), h)?;
        loop {
            let minutes = self.minutes & ((1 << 60) - 1);
            let mut minute = prev_bit(minutes, if hour == h { m } else { 59 });
            while let Some(mm) = minute {
                let from = if hour == h && mm == m { s } else { 59 };
                if let Some(second) = prev_bit(self.seconds & ((1 << 60) - 1), from) {
                    return Some(hour * 3600 + mm * 60 + second);
                }
                minute = mm.checked_sub(1).and_then(|below| prev_bit(minutes, below));
            }
            hour = hour.checked_sub(1).and_then(|below| prev_bit(self.hours, below))?;
        }
    }

    /// The first matching local time (seconds since 1970-01-01 00:00:00 local) at or after
    /// `start` and not after `limit`.
    pub(crate) fn next_at_or_after(&self, start: i64, limit: i64) -> Option<i64> {
        if self.is_empty() {
            return None;
        }
        let (mut year, mut month, mut day) = civil_from_days(start.div_euclid(SECS_PER_DAY));
        let mut time = start.rem_euclid(SECS_PER_DAY).unsigned_abs();
        loop {
            if days_from_civil(year, month, day).checked_mul(SECS_PER_DAY)? > limit {
                return None;
            }
            if has(self.months, month) {
                while day <= days_in_month(year, month) {
                    if self.day_matches(year, month, day) {
                        if let Some(t) = self.time_at_or_after(time / 3600, time / 60 % 60, time % 60) {
                            let at = days_from_civil(year, month, day) * SECS_PER_DAY + t as i64;
                            return (at <= limit).then_some(at);
                        }
                    }
                    day += 1;
                    time = 0;
                }
            }
            (month, year) = if month == 12 { (1, year + 1) } else { (month + 1, year) };
            day = 1;
            time = 0;
        }
    }

    /// The last matching local time at or before `start` and not before `floor`.
    pub(crate) fn prev_at_or_before(&self, start: i64, floor: i64) -> Option<i64> {
        if self.is_empty() {
            return None;
        }
        const LAST_SECOND: u64 = 86_399;
        let (mut year, mut month, mut day) = civil_from_days(start.div_euclid(SECS_PER_DAY));
        let mut time = start.rem_euclid(SECS_PER_DAY).unsigned_abs();
        loop {
            let day_end = (days_from_civil(year, month, day) + 1).checked_mul(SECS_PER_DAY)?;
            if day_end <= floor {
                return None;
            }
            if has(self.months, month) {
                while day >= 1 {
                    if self.day_matches(year, month, day) {
                        if let Some(t) = self.time_at_or_before(time / 3600, time / 60 % 60, time % 60) {
                            let at = days_from_civil(year, month, day) * SECS_PER_DAY + t as i64;
                            return (at >= floor).then_some(at);
                        }
                    }
                    day -= 1;
                    time = LAST_SECOND;
                }
            }
            (month, year) = if month == 1 { (12, year - 1) } else { (month - 1, year) };
            day = days_in_month(year, month);
            time = LAST_SECOND;
        }
    }

    /// Whether the local time `local` (seconds since 1970-01-01 00:00:00 local) matches.
    #[cfg(test)]
    pub(crate) fn matches(&self, local: i64) -> bool {
        self.next_at_or_after(local, local) == Some(local)
    }
}

/// The first tick of `pattern` in `tz` strictly after `after`: the earliest instant of the
/// first local tick whose instant is after `after` (a tick inside a gap resolves to the end of
/// the gap, a tick inside an overlap to its first occurrence).
pub(crate) fn next_after(pattern: &Pattern, after: DbTime, tz: &TimeZone) -> Option<DbTime> {
    let after_s = after.0.div_euclid(1000);
    // Local ticks up to the latest local time already shown are at or before `after`.
    let mut local = tz.high_water_local(after_s)?;
    let limit = local.checked_add(SEARCH_SECS)?;
    for _ in 0..MAX_ZONE_STEPS {
        let tick = pattern.next_at_or_after(local.checked_add(1)?, limit)?;
        let at = tz.resolve_local(tick)?;
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
    let at_s = at.0.div_euclid(1000);
    let mut local = tz.high_water_local(at_s)?;
    // A tick after `floor` is at most a UTC offset plus an overlap before it in local time.
    let local_floor = floor.0.div_euclid(1000).saturating_sub(3 * SECS_PER_DAY).max(local.saturating_sub(SEARCH_SECS));
    for _ in 0..MAX_ZONE_STEPS {
        let tick = pattern.prev_at_or_before(local, local_floor)?;
        let instant = tz.resolve_local(tick)?;
        if instant <= at {
            return (instant > floor).then_some(instant);
        }
        local = tick.checked_sub(1)?;
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

    #[test]
    fn every_minute_steps_by_sixty_seconds() {
        assert_eq!(ALL.next_at_or_after(0, i64::MAX), Some(0));
        assert_eq!(ALL.next_at_or_after(1, i64::MAX), Some(60));
        assert_eq!(ALL.prev_at_or_before(59, i64::MIN), Some(0));
        assert_eq!(ALL.prev_at_or_before(-1, i64::MIN), Some(-60));
        assert_eq!(ALL.next_at_or_after(1, 59), None);
        assert_eq!(ALL.prev_at_or_before(-1, -59), None);
        assert!(ALL.matches(120) && !ALL.matches(121));
    }

    #[test]
    fn empty_patterns_never_match() {
        let no_month = Pattern { months: 1, ..ALL };
        assert_eq!(no_month.next_at_or_after(0, i64::MAX), None);
        let no_weekday = Pattern { weekdays: 0, ..ALL };
        assert_eq!(no_weekday.prev_at_or_before(0, i64::MIN), None);
        // February 30 is not empty field by field, but the bounded search ends.
        let feb_30 = Pattern { days: 1 << 30, months: 1 << 2, ..ALL };
        assert_eq!(feb_30.next_at_or_after(0, SEARCH_SECS), None);
        assert_eq!(feb_30.prev_at_or_before(0, -SEARCH_SECS), None);
    }
}
