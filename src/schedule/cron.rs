//! Crontab expressions: five fields, `minute hour day-of-month month day-of-week`, or a
//! nickname (`@daily`).

use std::fmt;
use std::str::FromStr;

use jiff::civil::DateTime;

use super::calendar::{Pattern, SEARCH};
use super::civil::CivilDateTime;

/// One of the five fields of a crontab expression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CronField {
    /// Minute, 0–59.
    Minute,
    /// Hour, 0–23.
    Hour,
    /// Day of the month, 1–31.
    DayOfMonth,
    /// Month, 1–12 or `jan`–`dec`.
    Month,
    /// Day of the week, 0–7 (0 and 7 are Sunday) or `sun`–`sat`.
    DayOfWeek,
}

impl CronField {
    const ALL: [CronField; 5] =
        [CronField::Minute, CronField::Hour, CronField::DayOfMonth, CronField::Month, CronField::DayOfWeek];

    fn min(self) -> u32 {
        match self {
            CronField::DayOfMonth | CronField::Month => 1,
            _ => 0,
        }
    }

    fn max(self) -> u32 {
        match self {
            CronField::Minute => 59,
            CronField::Hour => 23,
            CronField::DayOfMonth => 31,
            CronField::Month => 12,
            CronField::DayOfWeek => 7,
        }
    }

    /// The names the field accepts, the first one standing for [`min`](Self::min).
    fn names(self) -> &'static [&'static str] {
        match self {
            CronField::Month => &["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"],
            CronField::DayOfWeek => &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
            _ => &[],
        }
    }

    fn values(self) -> &'static str {
        match self {
            CronField::Minute => "0-59",
            CronField::Hour => "0-23",
            CronField::DayOfMonth => "1-31",
            CronField::Month => "1-12 or jan-dec",
            CronField::DayOfWeek => "0-7 or sun-sat (0 and 7 are sunday)",
        }
    }
}

impl fmt::Display for CronField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CronField::Minute => "minute",
            CronField::Hour => "hour",
            CronField::DayOfMonth => "day-of-month",
            CronField::Month => "month",
            CronField::DayOfWeek => "day-of-week",
        })
    }
}

/// Why a crontab expression was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CronError {
    /// Not five fields and not a nickname.
    #[error(
        "invalid cron expression {text:?}: expected 5 fields (minute hour day-of-month month day-of-week) \
         or a nickname such as @daily, found {found} fields"
    )]
    FieldCount {
        /// The expression.
        text: String,
        /// How many whitespace-separated fields it has.
        found: usize,
    },
    /// One field does not parse or is out of range.
    #[error("invalid {field} field {text:?}: expected {expected}")]
    Field {
        /// Which field.
        field: CronField,
        /// The field's text.
        text: String,
        /// What the field allows.
        expected: String,
    },
    /// An `@` word that is not a nickname.
    #[error(
        "unknown cron nickname {0:?}: expected @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly"
    )]
    Nickname(String),
    /// Every field parses but no date matches (`0 0 30 2 *`).
    #[error("cron expression {0:?} never fires: expected a day of the month that the chosen months have")]
    Never(String),
}

/// A parsed crontab expression. Ticks fall at second 0 of every local minute that matches.
///
/// Syntax per field: `*`, `n`, `a-b`, `*/n`, `a-b/n`, `n/step` (from `n` to the field's
/// maximum), and comma lists of these; month names `jan`–`dec` and day names `sun`–`sat` in any
/// case, also in ranges (`mon-fri`); day-of-week 0–7 with 0 and 7 both Sunday. Nicknames:
/// `@yearly`/`@annually` (`0 0 1 1 *`), `@monthly` (`0 0 1 * *`), `@weekly` (`0 0 * * 0`),
/// `@daily`/`@midnight` (`0 0 * * *`), `@hourly` (`0 * * * *`).
///
/// Days follow Vixie cron: when the day-of-month and the day-of-week fields are both
/// restricted, a day matches if EITHER matches (`0 0 13 * fri` fires on every 13th and every
/// Friday). A field counts as unrestricted when it starts with `*` (so `*/2` counts as
/// unrestricted, exactly as in Vixie cron); then a day must match both.
///
/// An expression that can never fire (`0 0 30 2 *`, `0 0 31 4,6 *`) is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    text: String,
    pattern: Pattern,
}

impl Cron {
    /// Parses a crontab expression (see the type's documentation).
    pub fn parse(text: &str) -> Result<Cron, CronError> {
        let trimmed = text.trim();
        let expanded = if trimmed.starts_with('@') {
            match trimmed.to_ascii_lowercase().as_str() {
                "@yearly" | "@annually" => "0 0 1 1 *",
                "@monthly" => "0 0 1 * *",
                "@weekly" => "0 0 * * 0",
                "@daily" | "@midnight" => "0 0 * * *",
                "@hourly" => "0 * * * *",
                _ => return Err(CronError::Nickname(trimmed.to_owned())),
            }
        } else {
            trimmed
        };
        let fields: Vec<&str> = expanded.split_ascii_whitespace().collect();
        if fields.len() != 5 {
            return Err(CronError::FieldCount { text: text.to_owned(), found: fields.len() });
        }
        let mut masks = [0u64; 5];
        let mut stars = [false; 5];
        for ((field, text), (mask, star)) in
            CronField::ALL.into_iter().zip(&fields).zip(masks.iter_mut().zip(&mut stars))
        {
            *mask = parse_field(field, text)?;
            *star = text.starts_with('*');
        }
        let [minutes, hours, days, months, weekdays] = masks;
        // Day-of-week 7 is Sunday.
        let weekdays = (weekdays | weekdays >> 7) & 0x7f;
        let pattern = Pattern { seconds: 1, minutes, hours, days, months, weekdays, days_or: !stars[2] && !stars[4] };
        let start = DateTime::constant(2000, 1, 1, 0, 0, 0, 0);
        if pattern.next_at_or_after(start, start.saturating_add(SEARCH)).is_none() {
            return Err(CronError::Never(trimmed.to_owned()));
        }
        Ok(Cron { text: trimmed.to_owned(), pattern })
    }

    /// Whether the local time `local` is a tick: second 0 of a matching minute.
    pub fn matches(&self, local: CivilDateTime) -> bool {
        let p = &self.pattern;
        let bit = |mask: u64, n: u8| mask >> n & 1 == 1;
        let dom = bit(p.days, local.day());
        let dow = bit(p.weekdays, local.weekday().number());
        let day = if p.days_or { dom || dow } else { dom && dow };
        local.second() == 0
            && bit(p.minutes, local.minute())
            && bit(p.hours, local.hour())
            && bit(p.months, local.month())
            && day
    }

    /// The expression as written (trimmed).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub(crate) fn pattern(&self) -> &Pattern {
        &self.pattern
    }
}

impl FromStr for Cron {
    type Err = CronError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Cron::parse(s)
    }
}

impl fmt::Display for Cron {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The bit mask of the values `text` selects in `field`.
fn parse_field(field: CronField, text: &str) -> Result<u64, CronError> {
    let error = |expected: String| CronError::Field { field, text: text.to_owned(), expected };
    let (min, max) = (field.min(), field.max());
    let value = |s: &str| -> Result<u32, CronError> {
        let number = if !s.is_empty() && s.len() <= 2 && s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse::<u32>().ok()
        } else {
            field.names().iter().position(|name| name.eq_ignore_ascii_case(s)).map(|i| i as u32 + min)
        };
        number.filter(|n| (min..=max).contains(n)).ok_or_else(|| error(field.values().to_owned()))
    };
    let mut mask = 0u64;
    for item in text.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => {
                let width = max - min + 1;
                let step = Some(step)
                    .filter(|s| !s.is_empty() && s.len() <= 2 && s.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|s| s.parse::<u32>().ok())
                    .filter(|s| (1..=width).contains(s))
                    .ok_or_else(|| error(format!("a step of 1-{width} after /")))?;
                (range, Some(step))
            }
            None => (item, None),
        };
        let (low, high) = if range == "*" {
            (min, max)
        } else if let Some((low, high)) = range.split_once('-') {
            let (low, high) = (value(low)?, value(high)?);
            if low > high {
                return Err(error(format!("a range low-high with low <= high, within {}", field.values())));
            }
            (low, high)
        } else {
            let single = value(range)?;
            // `n/step` runs from n to the field's maximum.
            (single, if step.is_some() { max } else { single })
        };
        let step = step.unwrap_or(1) as usize;
        for n in (low..=high).step_by(step) {
            mask |= 1 << n;
        }
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(mask: u64) -> Vec<u32> {
        (0..64).filter(|n| mask >> n & 1 == 1).collect()
    }

    fn field(field: CronField, text: &str) -> Vec<u32> {
        bits(parse_field(field, text).unwrap())
    }

    #[test]
    fn each_field_form() {
        use CronField::*;
        assert_eq!(field(Minute, "*").len(), 60);
        assert_eq!(field(Minute, "7"), [7]);
        assert_eq!(field(Minute, "10-13"), [10, 11, 12, 13]);
        assert_eq!(field(Minute, "*/15"), [0, 15, 30, 45]);
        assert_eq!(field(Minute, "10-30/10"), [10, 20, 30]);
        assert_eq!(field(Minute, "50/3"), [50, 53, 56, 59]);
        assert_eq!(field(Minute, "1,5,10-12,*/30"), [0, 1, 5, 10, 11, 12, 30]);
        assert_eq!(field(Hour, "0,23"), [0, 23]);
        assert_eq!(field(DayOfMonth, "*/10"), [1, 11, 21, 31]);
        assert_eq!(field(DayOfMonth, "31"), [31]);
        assert_eq!(field(Month, "jan,MAR,Dec"), [1, 3, 12]);
        assert_eq!(field(Month, "feb-apr"), [2, 3, 4]);
        assert_eq!(field(Month, "*/3"), [1, 4, 7, 10]);
        assert_eq!(field(DayOfWeek, "mon-fri"), [1, 2, 3, 4, 5]);
        assert_eq!(field(DayOfWeek, "SUN,sat"), [0, 6]);
        assert_eq!(field(DayOfWeek, "5-7"), [5, 6, 7]);
        assert_eq!(field(Minute, "*/60"), [0]);
    }

    #[test]
    fn sunday_is_0_and_7() {
        let zero = Cron::parse("0 0 * * 0").unwrap();
        let seven = Cron::parse("0 0 * * 7").unwrap();
        let name = Cron::parse("0 0 * * sun").unwrap();
        assert_eq!(zero.pattern, seven.pattern);
        assert_eq!(zero.pattern, name.pattern);
        assert_eq!(zero.pattern.weekdays, 1);
        assert_eq!(Cron::parse("0 0 * * 5-7").unwrap().pattern.weekdays, 0b110_0001);
    }

    #[test]
    fn nicknames() {
        let cases = [
            ("@yearly", "0 0 1 1 *"),
            ("@annually", "0 0 1 1 *"),
            ("@monthly", "0 0 1 * *"),
            ("@weekly", "0 0 * * 0"),
            ("@daily", "0 0 * * *"),
            ("@midnight", "0 0 * * *"),
            ("@hourly", "0 * * * *"),
            (" @HOURLY ", "0 * * * *"),
        ];
        for (nickname, expression) in cases {
            assert_eq!(Cron::parse(nickname).unwrap().pattern, Cron::parse(expression).unwrap().pattern, "{nickname}");
        }
        assert_eq!(Cron::parse("@daily").unwrap().to_string(), "@daily");
        assert_eq!(
            Cron::parse("@reboot").unwrap_err().to_string(),
            "unknown cron nickname \"@reboot\": expected @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly"
        );
    }

    #[test]
    fn day_rule_is_vixie() {
        // Both restricted: either matches.
        assert!(Cron::parse("0 0 13 * 5").unwrap().pattern.days_or);
        assert!(Cron::parse("0 0 1-31 * 1").unwrap().pattern.days_or);
        // A field starting with * is unrestricted: both must match.
        assert!(!Cron::parse("0 0 13 * *").unwrap().pattern.days_or);
        assert!(!Cron::parse("0 0 * * 5").unwrap().pattern.days_or);
        assert!(!Cron::parse("0 0 */2 * 5").unwrap().pattern.days_or);
        let friday_13 = CivilDateTime::new(2026, 2, 13, 0, 0, 0).unwrap();
        let friday_6 = CivilDateTime::new(2026, 2, 6, 0, 0, 0).unwrap();
        let tuesday_13 = CivilDateTime::new(2026, 1, 13, 0, 0, 0).unwrap();
        let wednesday_7 = CivilDateTime::new(2026, 1, 7, 0, 0, 0).unwrap();
        let either = Cron::parse("0 0 13 * fri").unwrap();
        assert!(either.matches(friday_13) && either.matches(friday_6) && either.matches(tuesday_13));
        assert!(!either.matches(wednesday_7));
        let both = Cron::parse("0 0 */2 * fri").unwrap(); // odd days that are Fridays
        assert!(both.matches(friday_13) && !both.matches(friday_6) && !both.matches(tuesday_13));
    }

    #[test]
    fn errors_name_the_field_the_text_and_the_range() {
        let cases = [
            ("0 25 * * *", "invalid hour field \"25\": expected 0-23"),
            ("60 * * * *", "invalid minute field \"60\": expected 0-59"),
            ("* * 0 * *", "invalid day-of-month field \"0\": expected 1-31"),
            ("* * 32 * *", "invalid day-of-month field \"32\": expected 1-31"),
            ("* * * 13 *", "invalid month field \"13\": expected 1-12 or jan-dec"),
            ("* * * foo *", "invalid month field \"foo\": expected 1-12 or jan-dec"),
            ("* * * * 8", "invalid day-of-week field \"8\": expected 0-7 or sun-sat (0 and 7 are sunday)"),
            ("* * * * monday", "invalid day-of-week field \"monday\": expected 0-7 or sun-sat (0 and 7 are sunday)"),
            ("*/0 * * * *", "invalid minute field \"*/0\": expected a step of 1-60 after /"),
            ("* */25 * * *", "invalid hour field \"*/25\": expected a step of 1-24 after /"),
            ("* */x * * *", "invalid hour field \"*/x\": expected a step of 1-24 after /"),
            (
                "30-10 * * * *",
                "invalid minute field \"30-10\": expected a range low-high with low <= high, within 0-59",
            ),
            ("1,,2 * * * *", "invalid minute field \"1,,2\": expected 0-59"),
            ("-1 * * * *", "invalid minute field \"-1\": expected 0-59"),
            ("1-2-3 * * * *", "invalid minute field \"1-2-3\": expected 0-59"),
            ("** * * * *", "invalid minute field \"**\": expected 0-59"),
            ("+5 * * * *", "invalid minute field \"+5\": expected 0-59"),
            ("005 * * * *", "invalid minute field \"005\": expected 0-59"),
            ("1/2/3 * * * *", "invalid minute field \"1/2/3\": expected a step of 1-60 after /"),
            (
                "* * * *",
                "invalid cron expression \"* * * *\": expected 5 fields (minute hour day-of-month month day-of-week) \
                 or a nickname such as @daily, found 4 fields",
            ),
            (
                "0 0 30 2 *",
                "cron expression \"0 0 30 2 *\" never fires: expected a day of the month that the chosen months have",
            ),
            (
                "0 0 31 4,6,9,11 *",
                "cron expression \"0 0 31 4,6,9,11 *\" never fires: expected a day of the month that the chosen months have",
            ),
        ];
        for (text, message) in cases {
            assert_eq!(Cron::parse(text).unwrap_err().to_string(), message, "{text}");
        }
        assert!(matches!(Cron::parse(""), Err(CronError::FieldCount { found: 0, .. })));
        assert!(matches!(Cron::parse("* * * * * *"), Err(CronError::FieldCount { found: 6, .. })));
        // February 29 exists, and a restricted weekday rescues February 30 (either matches).
        assert!(Cron::parse("0 0 29 2 *").is_ok());
        assert!(Cron::parse("0 0 30 2 mon").is_ok());
    }
}
