//! Civil (wall-clock) dates and times: thin wrappers over [`jiff::civil`], which does all the
//! calendar arithmetic, with the names and crontab numbering the schedules use.

use std::fmt;

use jiff::SignedDuration;
use jiff::civil::DateTime;

use super::ParseError;

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

    /// The weekday of jiff's `weekday`.
    pub(crate) fn from_jiff(weekday: jiff::civil::Weekday) -> Weekday {
        // 0 to 6.
        Weekday::ALL[weekday.to_sunday_zero_offset() as usize]
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
/// Gregorian calendar, years -9999 to 9999 (jiff's range). Orders chronologically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CivilDateTime(DateTime);

impl CivilDateTime {
    /// 1970-01-01 00:00:00.
    pub const EPOCH: CivilDateTime = CivilDateTime(DateTime::constant(1970, 1, 1, 0, 0, 0, 0));

    /// The date-time `year-month-day hour:minute:second`, if each part is in range (year -9999
    /// to 9999, month 1–12, day within the month, hour 0–23, minute and second 0–59).
    pub fn new(year: i32, month: u8, day: u8, hour: u8, minute: u8, second: u8) -> Option<CivilDateTime> {
        let small = |n: u8| i8::try_from(n).ok();
        let year = i16::try_from(year).ok()?;
        DateTime::new(year, small(month)?, small(day)?, small(hour)?, small(minute)?, small(second)?, 0)
            .ok()
            .map(CivilDateTime)
    }

    /// The date `year-month-day` at the time `time`, if the date exists.
    pub fn from_date_time(year: i32, month: u8, day: u8, time: TimeOfDay) -> Option<CivilDateTime> {
        CivilDateTime::new(year, month, day, time.hour, time.minute, time.second)
    }

    /// The civil date-time `seconds` after 1970-01-01 00:00:00, if its year is within -9999 to
    /// 9999.
    pub fn from_unix_seconds(seconds: i64) -> Option<CivilDateTime> {
        CivilDateTime::EPOCH.0.checked_add(SignedDuration::from_secs(seconds)).ok().map(CivilDateTime)
    }

    /// Seconds from 1970-01-01 00:00:00 to this date-time.
    pub fn to_unix_seconds(self) -> i64 {
        self.0.duration_since(CivilDateTime::EPOCH.0).as_secs()
    }

    /// The date-time of jiff's `datetime`, to the second (a fraction is dropped).
    pub(crate) fn from_jiff(datetime: DateTime) -> CivilDateTime {
        CivilDateTime(datetime.with().subsec_nanosecond(0).build().unwrap_or(datetime))
    }

    /// As jiff's date-time.
    pub(crate) fn to_jiff(self) -> DateTime {
        self.0
    }

    /// The year, -9999 to 9999.
    pub fn year(self) -> i32 {
        i32::from(self.0.year())
    }

    /// The month, 1–12.
    pub fn month(self) -> u8 {
        self.0.month().unsigned_abs()
    }

    /// The day of the month, 1–31.
    pub fn day(self) -> u8 {
        self.0.day().unsigned_abs()
    }

    /// The hour, 0–23.
    pub fn hour(self) -> u8 {
        self.0.hour().unsigned_abs()
    }

    /// The minute, 0–59.
    pub fn minute(self) -> u8 {
        self.0.minute().unsigned_abs()
    }

    /// The second, 0–59.
    pub fn second(self) -> u8 {
        self.0.second().unsigned_abs()
    }

    /// The time of day.
    pub fn time(self) -> TimeOfDay {
        TimeOfDay { hour: self.hour(), minute: self.minute(), second: self.second() }
    }

    /// The day of the week.
    pub fn weekday(self) -> Weekday {
        Weekday::from_jiff(self.0.weekday())
    }
}

impl fmt::Display for CivilDateTime {
    /// ISO 8601: `2026-03-29T02:30:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates_and_weekdays() {
        let days = |y, mo, d| CivilDateTime::new(y, mo, d, 0, 0, 0).unwrap().to_unix_seconds() / 86_400;
        assert_eq!(days(1970, 1, 1), 0);
        assert_eq!(days(2000, 3, 1), 11_017);
        assert_eq!(days(1969, 12, 31), -1);
        assert_eq!(CivilDateTime::new(2026, 3, 29, 0, 0, 0).unwrap().weekday(), Weekday::Sunday);
        assert_eq!(CivilDateTime::new(1900, 1, 1, 0, 0, 0).unwrap().weekday(), Weekday::Monday);
        assert!(
            CivilDateTime::new(2024, 2, 29, 0, 0, 0).is_some() && CivilDateTime::new(2000, 2, 29, 0, 0, 0).is_some()
        );
        assert!(
            CivilDateTime::new(2100, 2, 29, 0, 0, 0).is_none() && CivilDateTime::new(2026, 2, 29, 0, 0, 0).is_none()
        );
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
        assert_eq!(CivilDateTime::from_unix_seconds(i64::MAX / 1000), None);
        assert_eq!(CivilDateTime::new(10_000, 1, 1, 0, 0, 0), None);
        for (y, mo, d, h, mi, s) in [(-9999, 1, 1, 0, 0, 0), (9999, 12, 31, 23, 59, 59)] {
            let edge = CivilDateTime::new(y, mo, d, h, mi, s).unwrap();
            assert_eq!(CivilDateTime::from_unix_seconds(edge.to_unix_seconds()), Some(edge));
        }
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
