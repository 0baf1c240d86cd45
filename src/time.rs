//! Time as text, one grammar for the command line, the configuration and schedules:
//! durations (`500ms`, `90s`, `1h30m`) and instants (RFC 3339 timestamps, or a duration from
//! now). jiff parses both; this module narrows its grammar where a looser reading would
//! surprise, bounds the values to what Canter stores, and says what was wrong.
//!
//! # Durations
//!
//! [`parse_duration_ms`] reads jiff's "friendly" format: one or more `<number><unit>`, largest
//! unit first, each unit at most once, optionally separated by spaces or commas (`1h30m`,
//! `1h 30m`, `1h, 30m`). Units are `ms`, `s`, `m`, `h`, `d` or their longer names (`msec`,
//! `sec`/`secs`/`second`/`seconds`, `min`/`mins`/`minute`/`minutes`, `hr`/`hrs`/`hour`/`hours`,
//! `day`/`days`), and `us`/`µs`/`ns` so long as the total is whole milliseconds. A day is
//! 24 hours. The narrowing: a number touches its unit (`15m`, not `15 m`), numbers are whole
//! (`1h30m`, not `1.5h`), no sign but `+`, no `ago`, no `H:M:S`, and no weeks, months or years
//! (`7d`, not `1w`). At most [`MAX_DURATION_MS`].
//!
//! # Instants
//!
//! [`parse_instant`] reads an RFC 3339 timestamp with any offset (`2026-11-22T10:00:00Z`,
//! `2026-11-22T11:00:00.5+01:00`; jiff also takes a space for `T` and a trailing `[zone]`
//! annotation) or a duration from `now`, in milliseconds, from [`MIN_INSTANT`] to
//! [`MAX_INSTANT`]. [`format_instant`] writes RFC 3339 in UTC.

use jiff::fmt::friendly::SpanParser;
use jiff::{SpanRelativeTo, Timestamp};

use crate::task::DbTime;

/// The longest duration [`parse_duration_ms`] reads: 7 304 484 days (about 20 000 years),
/// jiff's largest number of days.
pub const MAX_DURATION_MS: u64 = 7_304_484 * 86_400_000;

/// The earliest instant [`parse_instant`] reads: `0000-01-01T00:00:00Z`, the first that
/// RFC 3339's four-digit years can write.
pub const MIN_INSTANT: DbTime = DbTime(-62_167_219_200_000);

/// The latest instant [`parse_instant`] reads: `9999-12-30T22:00:00Z`, jiff's latest in
/// milliseconds.
pub const MAX_INSTANT: DbTime = DbTime(253_402_207_200_000);

/// What a duration may be, for messages.
pub(crate) const DURATION_RULE: &str = "a duration like 500ms, 90s, 15m, 1h30m, 1h 30m or 7d";

const INSTANT_RULE: &str =
    "an rfc 3339 timestamp like 2026-11-22T10:00:00Z or 2026-11-22T11:00:00.5+01:00, or a duration from now like 15m";

/// A value that does not parse: a duration, an instant, a time of day, a weekday.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {text:?}: expected {expected}")]
pub struct ParseError {
    /// What was being parsed.
    pub what: &'static str,
    /// The text.
    pub text: String,
    /// What is allowed.
    pub expected: String,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, text: &str, expected: impl Into<String>) -> ParseError {
        ParseError { what, text: text.to_owned(), expected: expected.into() }
    }
}

/// Parses a duration (see the [module documentation](self)) in milliseconds: `500ms`, `90s`,
/// `15m`, `1h30m`, `1h 30m`, `2hours`, `7d`. Surrounding whitespace is ignored. Refused with
/// what was expected: anything else, negative durations, fractions (`1.5h`), weeks and longer
/// units, a remainder below a millisecond (`1500us`), and more than [`MAX_DURATION_MS`].
pub fn parse_duration_ms(text: &str) -> Result<u64, ParseError> {
    duration_ms(text).map_err(|expected| ParseError::new("duration", text, expected))
}

/// [`parse_duration_ms`], the error being what was expected.
fn duration_ms(text: &str) -> Result<u64, &'static str> {
    const RANGE: &str = "at most 7304484d (about 20000 years)";
    let text = text.trim();
    // A word of digits alone is a number apart from its unit (`15 m`) or without one.
    let apart = text
        .split(|c: char| c.is_whitespace() || c == ',')
        .any(|word| !word.is_empty() && word.bytes().all(|b| b.is_ascii_digit() || b == b'+' || b == b'-'));
    if apart || text.contains(':') {
        return Err(DURATION_RULE);
    }
    if text.contains('.') {
        return Err("whole numbers of units, like 1h30m (not 1.5h)");
    }
    let span = SpanParser::new()
        .parse_span(text)
        .map_err(|e| if e.is_range() || is_too_long_number(text) { RANGE } else { DURATION_RULE })?;
    if span.is_negative() || text.starts_with('-') || text.ends_with("ago") {
        return Err("a duration of zero or more, without - or ago");
    }
    if span.get_years() != 0 || span.get_months() != 0 || span.get_weeks() != 0 {
        return Err("units from ms to d, like 7d (not 1w)");
    }
    let duration = span.to_duration(SpanRelativeTo::days_are_24_hours()).map_err(|_| RANGE)?;
    if duration.subsec_nanos() % 1_000_000 != 0 {
        return Err("whole milliseconds (not 1500us)");
    }
    u64::try_from(duration.as_millis()).ok().filter(|&ms| ms <= MAX_DURATION_MS).ok_or(RANGE)
}

/// Whether `text` has a number of more digits than an `i64` holds (jiff calls it a syntax
/// error).
fn is_too_long_number(text: &str) -> bool {
    text.split(|c: char| !c.is_ascii_digit()).any(|digits| digits.trim_start_matches('0').len() > 18)
}

/// Writes `ms` as [`parse_duration_ms`] reads it, largest units first with no spaces (`1h30m`,
/// `7d`, `0ms`). Every value up to [`MAX_DURATION_MS`] parses back to itself.
pub fn format_duration_ms(ms: u64) -> String {
    if ms == 0 {
        return "0ms".to_owned();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (unit, unit_ms) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
        if rest >= unit_ms {
            out.push_str(&format!("{}{unit}", rest / unit_ms));
            rest %= unit_ms;
        }
    }
    out
}

/// Parses an instant: an RFC 3339 timestamp with any offset (`2026-11-22T10:00:00Z`,
/// `2026-11-22T11:00:00+01:00`, `2026-11-22T10:00:00.250Z`), or a duration from `now` in the
/// grammar of [`parse_duration_ms`] (`15m`: `now` plus 15 minutes). Text that starts with a
/// year and `-` is a timestamp, anything else a duration. Refused with what was expected:
/// anything else (with jiff's reason for a timestamp), a timestamp without an offset or with a
/// fraction below a millisecond, and an instant before [`MIN_INSTANT`] or after
/// [`MAX_INSTANT`].
pub fn parse_instant(text: &str, now: DbTime) -> Result<DbTime, ParseError> {
    let error = |expected: &str| ParseError::new("instant", text, expected);
    let range = || error("an instant from 0000-01-01T00:00:00Z to 9999-12-30T22:00:00Z");
    let trimmed = text.trim();
    let is_timestamp = trimmed
        .trim_start_matches(['+', '-'])
        .split_once('-')
        .is_some_and(|(year, _)| year.len() >= 4 && year.bytes().all(|b| b.is_ascii_digit()));
    let at = if is_timestamp {
        let at: Timestamp = trimmed.parse().map_err(|e: jiff::Error| error(&format!("{INSTANT_RULE} ({e})")))?;
        if at.subsec_nanosecond() % 1_000_000 != 0 {
            return Err(error("an rfc 3339 timestamp with at most milliseconds (3 decimals)"));
        }
        DbTime(at.as_millisecond())
    } else {
        let ms = duration_ms(trimmed)
            .map_err(|expected| error(if expected == DURATION_RULE { INSTANT_RULE } else { expected }))?;
        DbTime(i64::try_from(ms).ok().and_then(|ms| now.0.checked_add(ms)).ok_or_else(range)?)
    };
    if (MIN_INSTANT..=MAX_INSTANT).contains(&at) { Ok(at) } else { Err(range()) }
}

/// [`format_instant`] of milliseconds since the Unix epoch (for messages of errors that keep
/// their times as numbers).
pub fn format_instant_ms(ms: i64) -> String {
    format_instant(DbTime(ms))
}

/// Writes `t` in RFC 3339, in UTC, with milliseconds when they are not zero
/// (`2026-11-22T10:00:00Z`, `2026-11-22T10:00:00.500Z`), as [`parse_instant`] reads it. An
/// instant outside jiff's years -9999 to 9999 (a [`DbTime`] can be; RFC 3339 cannot write
/// it) is written as milliseconds from the epoch: `8000000000000000ms from
/// 1970-01-01T00:00:00Z`.
pub fn format_instant(t: DbTime) -> String {
    match Timestamp::from_millisecond(t.0) {
        Ok(at) if t.0 % 1000 == 0 => at.to_string(),
        Ok(at) => format!("{at:.3}"),
        Err(_) => format!("{}ms from 1970-01-01T00:00:00Z", t.0),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn durations_in_the_grammar() {
        let cases = [
            ("500ms", 500),
            ("90s", 90_000),
            ("15m", 900_000),
            ("1h30m", 5_400_000),
            ("1h 30m", 5_400_000),
            ("1h, 30m", 5_400_000),
            ("7d", 604_800_000),
            ("2hours", 7_200_000),
            ("1hour 30mins", 5_400_000),
            ("0ms", 0),
            ("+5m", 300_000),
            ("00015m", 900_000),
            (" 5m ", 300_000),
            ("1000us", 1),
            ("1d 1h 1m 1s 1ms", 90_061_001),
            ("7304484d", MAX_DURATION_MS),
        ];
        for (text, ms) in cases {
            assert_eq!(parse_duration_ms(text), Ok(ms), "{text}");
        }
    }

    #[test]
    fn durations_refused_say_what_was_expected() {
        let cases = [
            ("", "a duration like"),
            ("15", "a duration like"),
            ("m", "a duration like"),
            ("15 m", "a duration like"),
            ("2 hours", "a duration like"),
            ("1H", "a duration like"),
            ("30s1m", "a duration like"),
            ("1s1s", "a duration like"),
            ("1:30:00", "a duration like"),
            ("PT1H", "a duration like"),
            ("1.5h", "whole numbers of units"),
            ("1,5h", "a duration like"),
            ("-5m", "a duration of zero or more"),
            ("5m ago", "a duration of zero or more"),
            ("1w", "units from ms to d"),
            ("1mo", "units from ms to d"),
            ("1y", "units from ms to d"),
            ("1500us", "whole milliseconds"),
            ("1ns", "whole milliseconds"),
            ("999999999999999999999d", "at most 7304484d"),
            ("99999999999999999999ms", "at most 7304484d"),
            ("9999999999999999d", "at most 7304484d"),
            ("7304485d", "at most 7304484d"),
            ("7304484d 1ms", "at most 7304484d"),
            ("１５m", "a duration like"),
            ("15ｍ", "a duration like"),
            ("é", "a duration like"),
            ("1hé", "a duration like"),
            ("1h\u{0}", "a duration like"),
        ];
        for (text, expected) in cases {
            let err = parse_duration_ms(text).unwrap_err();
            assert_eq!(err.what, "duration");
            assert!(err.expected.starts_with(expected), "{text}: {err}");
            assert!(err.to_string().starts_with(&format!("invalid duration {text:?}: expected ")), "{err}");
        }
    }

    #[test]
    fn durations_format_as_they_parse() {
        assert_eq!(format_duration_ms(0), "0ms");
        assert_eq!(format_duration_ms(5_400_000), "1h30m");
        assert_eq!(format_duration_ms(90_061_001), "1d1h1m1s1ms");
        assert_eq!(format_duration_ms(MAX_DURATION_MS), "7304484d");
        assert_eq!(
            parse_duration_ms(&format_duration_ms(MAX_DURATION_MS + 1)).unwrap_err().expected,
            "at most 7304484d (about 20000 years)"
        );
    }

    const NOW: DbTime = DbTime(1_795_341_600_000); // 2026-11-22T10:00:00Z

    #[test]
    fn instants_as_timestamps_or_durations_from_now() {
        let cases = [
            ("2026-11-22T10:00:00Z", NOW.0),
            ("2026-11-22T11:00:00+01:00", NOW.0),
            ("2026-11-22T05:30:00-04:30", NOW.0),
            ("2026-11-22T10:00:00.5Z", NOW.0 + 500),
            ("2026-11-22T10:00:00.250000Z", NOW.0 + 250),
            ("2026-11-22 10:00:00z", NOW.0),
            ("2026-11-22T10:00Z", NOW.0),
            ("2026-11-22T11:00:00+01:00[Europe/Paris]", NOW.0),
            ("1969-12-31T23:59:59.999Z", -1),
            ("0000-01-01T00:00:00Z", MIN_INSTANT.0),
            ("15m", NOW.0 + 900_000),
            ("0s", NOW.0),
            ("1h 30m", NOW.0 + 5_400_000),
        ];
        for (text, ms) in cases {
            assert_eq!(parse_instant(text, NOW), Ok(DbTime(ms)), "{text}");
        }
        assert!(Timestamp::from_millisecond(MAX_INSTANT.0).is_ok());
        assert!(Timestamp::from_millisecond(MAX_INSTANT.0 + 1).is_err());
        assert_eq!(parse_instant("9999-12-30T22:00:00Z", NOW), Ok(MAX_INSTANT));
    }

    #[test]
    fn instants_refused_say_what_was_expected() {
        let cases = [
            ("2026-11-22T10:00:00", "an rfc 3339 timestamp like"),
            ("2026-13-22T10:00:00Z", "an rfc 3339 timestamp like"),
            ("2026-02-30T10:00:00Z", "an rfc 3339 timestamp like"),
            ("2026-01-01T00:00:00.\u{e9}\u{e9}Z", "an rfc 3339 timestamp like"),
            ("2026-11-22T10:00:00.0005Z", "an rfc 3339 timestamp with at most milliseconds"),
            ("9999-12-31T23:59:59Z", "an rfc 3339 timestamp like"),
            ("9999-12-30T22:00:00.001Z", "an instant from"),
            ("-000001-01-01T00:00:00Z", "an instant from"),
            ("yesterday", "an rfc 3339 timestamp like"),
            ("", "an rfc 3339 timestamp like"),
            ("15 m", "an rfc 3339 timestamp like"),
            ("-5m", "a duration of zero or more"),
            ("1.5h", "whole numbers of units"),
            ("7304484d", "an instant from"),
            ("999999999999999999999d", "at most 7304484d"),
            ("２０２６-11-22T10:00:00Z", "an rfc 3339 timestamp like"),
        ];
        for (text, expected) in cases {
            let err = parse_instant(text, NOW).unwrap_err();
            assert_eq!(err.what, "instant");
            assert!(err.expected.starts_with(expected), "{text}: {err}");
        }
        // A timestamp refused by jiff says why.
        let err = parse_instant("2026-13-22T10:00:00Z", NOW).unwrap_err();
        assert!(err.expected.contains("month"), "{err}");
        // A duration from a `now` near the end of time.
        assert_eq!(
            parse_instant("1ms", MAX_INSTANT).unwrap_err().expected,
            "an instant from 0000-01-01T00:00:00Z to 9999-12-30T22:00:00Z"
        );
        assert!(parse_instant("1ms", DbTime(i64::MAX)).is_err());
    }

    #[test]
    fn instants_format_in_utc() {
        assert_eq!(format_instant(NOW), "2026-11-22T10:00:00Z");
        assert_eq!(format_instant(DbTime(NOW.0 + 500)), "2026-11-22T10:00:00.500Z");
        assert_eq!(format_instant(DbTime(NOW.0 + 7)), "2026-11-22T10:00:00.007Z");
        assert_eq!(format_instant(DbTime(-1)), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_instant(MIN_INSTANT), "0000-01-01T00:00:00Z");
        assert_eq!(format_instant(MAX_INSTANT), "9999-12-30T22:00:00Z");
        assert_eq!(format_instant(DbTime(8_000_000_000_000_000)), "8000000000000000ms from 1970-01-01T00:00:00Z");
        assert_eq!(format_instant(DbTime(i64::MIN)), "-9223372036854775808ms from 1970-01-01T00:00:00Z");
    }

    proptest! {
        #[test]
        fn formatted_durations_parse_back(ms in prop_oneof![0u64..100_000_000, 0..=MAX_DURATION_MS]) {
            prop_assert_eq!(parse_duration_ms(&format_duration_ms(ms)), Ok(ms));
        }

        #[test]
        fn formatted_instants_parse_back(ms in MIN_INSTANT.0..=MAX_INSTANT.0) {
            prop_assert_eq!(parse_instant(&format_instant(DbTime(ms)), NOW), Ok(DbTime(ms)));
        }

        #[test]
        fn any_text_is_an_answer_not_a_panic(text in prop_oneof!["\\PC{0,40}", "[0-9a-zµ .,:+-]{0,30}", "[0-9TZ:.+-]{0,40}"], now in any::<i64>()) {
            let _ = parse_duration_ms(&text);
            if let Ok(at) = parse_instant(&text, DbTime(now)) {
                prop_assert!((MIN_INSTANT..=MAX_INSTANT).contains(&at));
            }
        }
    }
}
