//! Civil dates and times of the proleptic Gregorian calendar, and their conversion to and from
//! days and seconds since the Unix epoch (Howard Hinnant's `days_from_civil` and
//! `civil_from_days`, <https://howardhinnant.github.io/date_algorithms.html>).

use std::fmt;

use super::ParseError;

const SECS_PER_DAY: i64 = 86_400;

/// Days since 1970-01-01 of the civil date `year-month-day` (month 1–12, day 1–31; a day past
/// the month's end counts on into the next month).
pub(crate) fn days_from_civil(year: i64, month: u8, day: u8) -> i64 {
    let (month, day) = (i64::from(month), i64::from(day));
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400; // [0, 399]
    let mp = (month + 9) % 12; // March = 0
    let doy = (153 * mp + 2) / 5 + day - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

/// The civil date `(year, month, day)` of `days` since 1970-01-01.
pub(crate) fn civil_from_days(days: i64) -> (i64, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097; // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11]
    let day = doy - (153 * mp + 2) / 5 + 1; // [1, 31]
    let month = if mp < 10 { mp + 3 } else { mp - 9 }; // [1, 12]
    let year = yoe + era * 400 + i64::from(month <= 2);
    // Both fit in a u8 by the ranges above.
    (year, month as u8, day as u8)
}

/// The weekday of `days` since 1970-01-01 (a Thursday), 0 = Sunday.
pub(crate) fn weekday_from_days(days: i64) -> u8 {
    (days + 4).rem_euclid(7) as u8
}

/// Whether `year` has a February 29.
pub(crate) fn is_leap_year(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// The number of days of `month` (1–12) in `year`.
pub(crate) fn days_in_month(year: i64, month: u8) -> u8 {
    match month {
        2 if is_leap_year(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// A day of the week.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Weekday {
    /// Sunday, day 0 (and 7) of crontab.
    Sunday = 0,
    /// Monday, day 1.
    Monday = 1,
    /// Tuesday, day 2.
    Tuesday = 2,
    /// Wednesday, day 3.
    Wednesday = 3,
    /// Thursday, day 4.
    Thursday = 4,
    /// Friday, day 5.
    Friday = 5,
    /// Saturday, day 6.
    Saturday = 6,
}

impl Weekday {
    /// Every weekday, Sunday first.
    pub const ALL: [Weekday; 7] = [
        Weekday::Sunday,
        Weekday::Monday,
        Weekday::Tuesday,
        Weekday::Wednesday,
        Weekday::Thursday,
        Weekday::Friday,
        Weekday::Saturday,
    ];

    const NAMES: [&'static str; 7] = ["sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday"];

    /// The weekday numbered `n` as crontab numbers them: 0 = Sunday … 6 = Saturday, and 7 =
    /// Sunday again.
    pub fn from_number(n: u8) -> Option<Weekday> {
        Weekday::ALL.get(usize::from(n % 7)).copied().filter(|_| n <= 7)
    }

    /// Its crontab number, 0 = Sunday … 6 = Saturday.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The weekday named `name`: the English name or its first three letters, in any case
    /// (`"mon"`, `"Monday"`).
    pub fn from_name(name: &str) -> Option<Weekday> {
        let lower = name.to_ascii_lowercase();
        let matches = |full: &&str| lower == *full || (lower.len() == 3 && full.starts_with(&lower));
        let index = Weekday::NAMES.iter().position(matches)?;
        Weekday::ALL.get(index).copied()
    }

    /// Its three-letter lower-case name (`"mon"`).
    pub fn short_name(self) -> &'static str {
        &Weekday::NAMES[usize::from(self.number())][..3]
    }
}

impl fmt::Display for Weekday {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// A set of weekdays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WeekdaySet(u8);

impl WeekdaySet {
    /// No day.
    pub const EMPTY: WeekdaySet = WeekdaySet(0);
    /// Every day.
    pub const ALL: WeekdaySet = WeekdaySet(0x7f);

    /// The set with `day` added.
    pub fn with(self, day: Weekday) -> WeekdaySet {
        WeekdaySet(self.0 | 1 << day.number())
    }

    /// Whether `day` is in the set.
    pub fn contains(self, day: Weekday) -> bool {
        self.0 & 1 << day.number() != 0
    }

    /// Whether the set has no day.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The days in the set, Sunday first.
    pub fn iter(self) -> impl Iterator<Item = Weekday> {
        Weekday::ALL.into_iter().filter(move |&d| self.contains(d))
    }

    /// The set as a bit mask, bit 0 = Sunday.
    pub(crate) fn bits(self) -> u8 {
        self.0
    }
}

impl FromIterator<Weekday> for WeekdaySet {
    fn from_iter<I: IntoIterator<Item = Weekday>>(iter: I) -> Self {
        iter.into_iter().fold(WeekdaySet::EMPTY, WeekdaySet::with)
    }
}

/// A time of day, to the second: `hour` 0–23, `minute` 0–59, `second` 0–59 (no leap second).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TimeOfDay {
    hour: u8,
    minute: u8,
    second: u8,
}

impl TimeOfDay {
    /// Midnight, 00:00:00.
    pub const MIDNIGHT: TimeOfDay = TimeOfDay { hour: 0, minute: 0, second: 0 };

    /// The time `hour:minute:second`, if each part is in range.
    pub fn new(hour: u8, minute: u8, second: u8) -> Option<TimeOfDay> {
        (hour < 24 && minute < 60 && second < 60).then_some(TimeOfDay { hour, minute, second })
    }

    /// Parses `HH:MM` or `HH:MM:SS` (two digits each, 24-hour clock).
    pub fn parse(text: &str) -> Result<TimeOfDay, ParseError> {
        let invalid = || ParseError::new("time of day", text, "HH:MM or HH:MM:SS, 00:00 to 23:59:59");
        let parts: Vec<&str> = text.split(':').collect();
        if !(2..=3).contains(&parts.len()) {
            return Err(invalid());
        }
        let mut numbers = [0u8; 3];
        for (number, part) in numbers.iter_mut().zip(&parts) {
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid());
            }
            *number = part.parse().map_err(|_| invalid())?;
        }
        TimeOfDay::new(numbers[0], numbers[1], numbers[2]).ok_or_else(invalid)
    }

    /// The hour, 0–23.
    pub fn hour(self) -> u8 {
        self.hour
    }

    /// The minute, 0–59.
    pub fn minute(self) -> u8 {
        self.minute
    }

    /// The second, 0–59.
    pub fn second(self) -> u8 {
        self.second
    }

    /// Seconds since midnight.
    pub fn seconds_of_day(self) -> u32 {
        u32::from(self.hour) * 3600 + u32::from(self.minute) * 60 + u32::from(self.second)
    }
}

impl fmt::Display for TimeOfDay {
    /// `HH:MM`, or `HH:MM:SS` when the second is not 0.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02}:{:02}", self.hour, self.minute)?;
        if self.second != 0 {
            write!(f, ":{:02}", self.second)?;
        }
        Ok(())
    }
}

/// A civil (wall-clock) date and time without a time zone, to the second, in the proleptic
/// Gregorian calendar. Orders chronologically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CivilDateTime {
    year: i32,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
    second: u8,
}

impl CivilDateTime {
    /// 1970-01-01 00:00:00.
    pub const EPOCH: CivilDateTime = CivilDateTime { year: 1970, month: 1, day: 1, hour: 0, minute: 0, second: 0 };

    /// The date-time `year-month-day hour:minute:second`, if each part is in range (month
    /// 1–12, day within the month, hour 0–23, minute and second 0–59).
    pub fn new(year: i32, month: u8, day: u8, hour: u8, minute: u8, second: u8) -> Option<CivilDateTime> {
        let date_ok = (1..=12).contains(&month) && day >= 1 && day <= days_in_month(i64::from(year), month);
        (date_ok && hour < 24 && minute < 60 && second < 60).then_some(CivilDateTime {
            year,
            month,
            day,
            hour,
            minute,
            second,
        })
    }

    /// The date `year-month-day` at the time `time`, if the date exists.
    pub fn from_date_time(year: i32, month: u8, day: u8, time: TimeOfDay) -> Option<CivilDateTime> {
        CivilDateTime::new(year, month, day, time.hour, time.minute, time.second)
    }

    /// The civil date-time `seconds` after 1970-01-01 00:00:00, if its year fits an `i32`.
    pub fn from_unix_seconds(seconds: i64) -> Option<CivilDateTime> {
        let days = seconds.div_euclid(SECS_PER_DAY);
        let secs = seconds.rem_euclid(SECS_PER_DAY);
        let (year, month, day) = civil_from_days(days);
        Some(CivilDateTime {
            year: i32::try_from(year).ok()?,
            month,
            day,
            // Each below 60 or 24.
            hour: (secs / 3600) as u8,
            minute: (secs / 60 % 60) as u8,
            second: (secs % 60) as u8,
        })
    }

    /// Seconds from 1970-01-01 00:00:00 to this date-time (never overflows: the year is an
    /// `i32`).
    pub fn to_unix_seconds(self) -> i64 {
        days_from_civil(i64::from(self.year), self.month, self.day) * SECS_PER_DAY
            + i64::from(self.time().seconds_of_day())
    }

    /// The year.
    pub fn year(self) -> i32 {
        self.year
    }

    /// The month, 1–12.
    pub fn month(self) -> u8 {
        self.month
    }

    /// The day of the month, 1–31.
    pub fn day(self) -> u8 {
        self.day
    }

    /// The hour, 0–23.
    pub fn hour(self) -> u8 {
        self.hour
    }

    /// The minute, 0–59.
    pub fn minute(self) -> u8 {
        self.minute
    }

    /// The second, 0–59.
    pub fn second(self) -> u8 {
        self.second
    }

    /// The time of day.
    pub fn time(self) -> TimeOfDay {
        TimeOfDay { hour: self.hour, minute: self.minute, second: self.second }
    }

    /// The day of the week.
    pub fn weekday(self) -> Weekday {
        let days = days_from_civil(i64::from(self.year), self.month, self.day);
        Weekday::from_number(weekday_from_days(days)).unwrap_or(Weekday::Sunday)
    }
}

impl fmt::Display for CivilDateTime {
    /// ISO 8601: `2026-03-29T02:30:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_round_trip_and_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(civil_from_days(-719_468), (0, 3, 1));
        for days in (-800_000..800_000).step_by(37) {
            let (y, m, d) = civil_from_days(days);
            assert!(d >= 1 && d <= days_in_month(y, m));
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(weekday_from_days(days_from_civil(2026, 3, 29)), 0);
        assert_eq!(weekday_from_days(days_from_civil(1900, 1, 1)), 1);
    }

    #[test]
    fn leap_years() {
        assert!(is_leap_year(2000) && is_leap_year(2024) && is_leap_year(-4));
        assert!(!is_leap_year(1900) && !is_leap_year(2100) && !is_leap_year(2026));
        assert_eq!(days_in_month(2024, 2), 29);
        assert_eq!(days_in_month(2100, 2), 28);
    }

    #[test]
    fn civil_date_times() {
        let t = CivilDateTime::new(2026, 3, 29, 2, 30, 0).unwrap();
        assert_eq!(t.to_string(), "2026-03-29T02:30:00");
        assert_eq!(t.weekday(), Weekday::Sunday);
        assert_eq!(CivilDateTime::from_unix_seconds(t.to_unix_seconds()), Some(t));
        assert_eq!(CivilDateTime::new(2026, 2, 29, 0, 0, 0), None);
        assert_eq!(CivilDateTime::new(2026, 13, 1, 0, 0, 0), None);
        assert_eq!(CivilDateTime::new(2026, 1, 1, 24, 0, 0), None);
        let before_epoch = CivilDateTime::from_unix_seconds(-1).unwrap();
        assert_eq!(before_epoch.to_string(), "1969-12-31T23:59:59");
        assert_eq!(CivilDateTime::from_unix_seconds(i64::MAX), None);
        let last = CivilDateTime::from_unix_seconds(i64::MAX / 1000).unwrap();
        assert_eq!(CivilDateTime::from_unix_seconds(last.to_unix_seconds()), Some(last));
    }

    #[test]
    fn times_of_day() {
        assert_eq!(TimeOfDay::parse("03:00"), Ok(TimeOfDay::new(3, 0, 0).unwrap()));
        assert_eq!(TimeOfDay::parse("23:59:59").unwrap().seconds_of_day(), 86_399);
        assert_eq!(TimeOfDay::parse("09:30").unwrap().to_string(), "09:30");
        assert_eq!(TimeOfDay::parse("09:30:05").unwrap().to_string(), "09:30:05");
        for bad in ["24:00", "3:00", "03:60", "03", "03:00:00:00", "", "0a:00", "+3:00", "03:00:60"] {
            let err = TimeOfDay::parse(bad).unwrap_err();
            assert!(err.to_string().contains("expected HH:MM"), "{err}");
        }
    }

    #[test]
    fn weekdays() {
        assert_eq!(Weekday::from_name("MON"), Some(Weekday::Monday));
        assert_eq!(Weekday::from_name("friday"), Some(Weekday::Friday));
        assert_eq!(Weekday::from_name("Sun"), Some(Weekday::Sunday));
        assert_eq!(Weekday::from_name("mo"), None);
        assert_eq!(Weekday::from_name("mond"), None);
        assert_eq!(Weekday::from_number(7), Some(Weekday::Sunday));
        assert_eq!(Weekday::from_number(8), None);
        let set: WeekdaySet = [Weekday::Monday, Weekday::Friday].into_iter().collect();
        assert!(set.contains(Weekday::Friday) && !set.contains(Weekday::Sunday));
        assert_eq!(set.iter().map(Weekday::short_name).collect::<Vec<_>>(), ["mon", "fri"]);
        assert!(WeekdaySet::EMPTY.is_empty());
    }
}
