//! Tests of schedules, time zones and due ticks. The zone tests read Europe/Paris and
//! America/New_York from `$TZDIR` or `/usr/share/zoneinfo` (the tzdata package).

use std::path::PathBuf;

use proptest::prelude::*;

use super::*;
use crate::config::{AppConfig, Config, LoadError};

// --- helpers ---------------------------------------------------------------------------------

fn civil(y: i32, mo: u8, d: u8, h: u8, mi: u8) -> CivilDateTime {
    CivilDateTime::new(y, mo, d, h, mi, 0).unwrap()
}

/// The instant of a UTC civil time.
fn utc(y: i32, mo: u8, d: u8, h: u8, mi: u8) -> DbTime {
    DbTime(civil(y, mo, d, h, mi).to_unix_seconds() * 1000)
}

fn zone(name: &str) -> TimeZone {
    let dir = std::env::var_os("TZDIR").map_or_else(|| PathBuf::from("/usr/share/zoneinfo"), PathBuf::from);
    let path = dir.join(zone_path(name).unwrap());
    let bytes = std::fs::read(&path)
        .unwrap_or_else(|e| panic!("cannot read {} ({e}): these tests need the tzdata package", path.display()));
    TimeZone::from_tzif(name, &bytes).unwrap()
}

/// Paris and New York, read once.
fn zones() -> &'static [TimeZone; 2] {
    static ZONES: std::sync::OnceLock<[TimeZone; 2]> = std::sync::OnceLock::new();
    ZONES.get_or_init(|| [zone("Europe/Paris"), zone("America/New_York")])
}

fn paris() -> TimeZone {
    zone("Europe/Paris")
}

fn new_york() -> TimeZone {
    zone("America/New_York")
}

fn cron(expression: &str) -> Schedule {
    Schedule::Cron(Cron::parse(expression).unwrap())
}

fn daily(at: &str) -> Schedule {
    Schedule::Daily(TimeOfDay::parse(at).unwrap())
}

/// The first `n` ticks after `from`.
fn ticks(schedule: &Schedule, tz: &TimeZone, from: DbTime, n: usize) -> Vec<DbTime> {
    let mut out = Vec::new();
    let mut at = from;
    for _ in 0..n {
        at = schedule.next_after(at, tz).unwrap();
        out.push(at);
    }
    out
}

const MINUTE: i64 = 60_000;
const HOUR: i64 = 3_600_000;

// --- next ticks in UTC -----------------------------------------------------------------------

#[test]
fn business_hours_roll_over_the_weekend() {
    let s = cron("*/15 9-17 * * 1-5");
    // 2026-01-02 is a Friday.
    assert_eq!(s.next_after(utc(2026, 1, 2, 17, 50), &TimeZone::Utc), Some(utc(2026, 1, 5, 9, 0)));
    assert_eq!(s.next_after(utc(2026, 1, 2, 17, 44), &TimeZone::Utc), Some(utc(2026, 1, 2, 17, 45)));
    assert_eq!(s.next_after(utc(2026, 1, 2, 8, 0), &TimeZone::Utc), Some(utc(2026, 1, 2, 9, 0)));
    assert_eq!(s.prev_at_or_before(utc(2026, 1, 5, 8, 59), &TimeZone::Utc), Some(utc(2026, 1, 2, 17, 45)));
}

#[test]
fn next_is_strictly_after_and_prev_is_at_or_before() {
    let s = cron("0 * * * *");
    let noon = utc(2026, 6, 1, 12, 0);
    assert_eq!(s.next_after(noon, &TimeZone::Utc), Some(utc(2026, 6, 1, 13, 0)));
    assert_eq!(s.next_after(DbTime(noon.0 - 1), &TimeZone::Utc), Some(noon));
    assert_eq!(s.prev_at_or_before(noon, &TimeZone::Utc), Some(noon));
    assert_eq!(s.prev_at_or_before(DbTime(noon.0 + 999), &TimeZone::Utc), Some(noon));
    assert_eq!(s.prev_at_or_before(DbTime(noon.0 - 1), &TimeZone::Utc), Some(utc(2026, 6, 1, 11, 0)));
    // Before the epoch too.
    assert_eq!(s.next_after(DbTime(-1), &TimeZone::Utc), Some(DbTime(0)));
    assert_eq!(s.prev_at_or_before(DbTime(-1), &TimeZone::Utc), Some(DbTime(-HOUR)));
}

#[test]
fn day_31_skips_shorter_months() {
    let s = cron("0 0 31 * *");
    let expected = [(1, 31), (3, 31), (5, 31), (7, 31), (8, 31), (10, 31), (12, 31)];
    let expected: Vec<DbTime> = expected.iter().map(|&(m, d)| utc(2026, m, d, 0, 0)).collect();
    assert_eq!(ticks(&s, &TimeZone::Utc, utc(2025, 12, 31, 0, 0), 7), expected);
    let monthly = Schedule::Monthly { day: 31, at: TimeOfDay::MIDNIGHT };
    assert_eq!(ticks(&monthly, &TimeZone::Utc, utc(2025, 12, 31, 0, 0), 7), expected);
}

#[test]
fn february_29_only_in_leap_years() {
    let s = cron("0 0 29 2 *");
    assert_eq!(s.next_after(utc(2024, 2, 29, 0, 0), &TimeZone::Utc), Some(utc(2028, 2, 29, 0, 0)));
    // 2100 is not a leap year: eight years to wait.
    assert_eq!(s.next_after(utc(2096, 2, 29, 0, 0), &TimeZone::Utc), Some(utc(2104, 2, 29, 0, 0)));
    assert_eq!(s.prev_at_or_before(utc(2104, 2, 28, 0, 0), &TimeZone::Utc), Some(utc(2096, 2, 29, 0, 0)));
    let monthly = Schedule::Monthly { day: 29, at: TimeOfDay::MIDNIGHT };
    assert_eq!(monthly.next_after(utc(2026, 1, 29, 0, 0), &TimeZone::Utc), Some(utc(2026, 3, 29, 0, 0)));
}

#[test]
fn day_of_month_or_day_of_week() {
    // 2026-01-02 is a Friday; January 13 a Tuesday.
    let s = cron("0 0 13 * fri");
    let days = [2, 9, 13, 16, 23, 30];
    let expected: Vec<DbTime> = days.iter().map(|&d| utc(2026, 1, d, 0, 0)).collect();
    assert_eq!(ticks(&s, &TimeZone::Utc, utc(2026, 1, 1, 0, 0), 6), expected);
    // Unrestricted day-of-month: only Fridays.
    let fridays = cron("0 0 * * 5");
    assert_eq!(fridays.next_after(utc(2026, 1, 10, 0, 0), &TimeZone::Utc), Some(utc(2026, 1, 16, 0, 0)));
}

#[test]
fn nicknames_tick_as_their_expansions() {
    let after = utc(2026, 6, 15, 10, 30);
    let cases = [
        ("@yearly", utc(2027, 1, 1, 0, 0)),
        ("@monthly", utc(2026, 7, 1, 0, 0)),
        ("@weekly", utc(2026, 6, 21, 0, 0)),
        ("@daily", utc(2026, 6, 16, 0, 0)),
        ("@hourly", utc(2026, 6, 15, 11, 0)),
    ];
    for (nickname, next) in cases {
        assert_eq!(cron(nickname).next_after(after, &TimeZone::Utc), Some(next), "{nickname}");
    }
}

#[test]
fn intervals_tick_at_multiples_since_the_epoch() {
    let every_15m = Schedule::Interval(Interval::new(15 * MINUTE as u64, 0).unwrap());
    let tz = paris(); // ignored
    assert_eq!(every_15m.next_after(utc(2026, 1, 1, 10, 7), &tz), Some(utc(2026, 1, 1, 10, 15)));
    assert_eq!(every_15m.next_after(utc(2026, 1, 1, 10, 15), &tz), Some(utc(2026, 1, 1, 10, 30)));
    assert_eq!(every_15m.prev_at_or_before(utc(2026, 1, 1, 10, 15), &tz), Some(utc(2026, 1, 1, 10, 15)));
    assert_eq!(every_15m.next_after(DbTime(-1), &tz), Some(DbTime(0)));
    assert_eq!(every_15m.prev_at_or_before(DbTime(-1), &tz), Some(DbTime(-15 * MINUTE)));
    let shifted = Schedule::Interval(Interval::new(HOUR as u64, 5 * MINUTE as u64).unwrap());
    assert_eq!(shifted.next_after(utc(2026, 1, 1, 10, 5), &TimeZone::Utc), Some(utc(2026, 1, 1, 11, 5)));
    assert_eq!(shifted.prev_at_or_before(utc(2026, 1, 1, 10, 4), &TimeZone::Utc), Some(utc(2026, 1, 1, 9, 5)));
    assert_eq!(shifted.to_string(), "every 1h offset 5m");
    assert_eq!(every_15m.next_after(DbTime(i64::MAX - 1), &tz), None);
    assert_eq!(Interval::new(999, 0), None);
    assert_eq!(Interval::new(MAX_INTERVAL_MS + 1, 0), None);
    assert_eq!(Interval::new(1_000, 1_000), None);
}

#[test]
fn weekly_and_daily_in_utc() {
    let days: WeekdaySet = [Weekday::Monday, Weekday::Friday].into_iter().collect();
    let at = TimeOfDay::parse("09:30").unwrap();
    let weekly = Schedule::Weekly { days, at };
    let expected = vec![utc(2026, 1, 2, 9, 30), utc(2026, 1, 5, 9, 30), utc(2026, 1, 9, 9, 30)];
    assert_eq!(ticks(&weekly, &TimeZone::Utc, utc(2026, 1, 1, 0, 0), 3), expected);
    assert_eq!(weekly.to_string(), "weekly on mon,fri at 09:30");
    let with_seconds = daily("03:00:15");
    assert_eq!(
        with_seconds.next_after(utc(2026, 1, 1, 3, 0), &TimeZone::Utc),
        Some(DbTime(utc(2026, 1, 1, 3, 0).0 + 15_000))
    );
    let never = Schedule::Weekly { days: WeekdaySet::EMPTY, at };
    assert_eq!(never.next_after(utc(2026, 1, 1, 0, 0), &TimeZone::Utc), None);
    let bad_day = Schedule::Monthly { day: 0, at };
    assert_eq!(bad_day.prev_at_or_before(utc(2026, 1, 1, 0, 0), &TimeZone::Utc), None);
}

#[test]
fn fixed_offsets_shift_local_times() {
    let tz = TimeZone::Fixed(UtcOffset::parse("-05:30").unwrap());
    let s = daily("09:00");
    assert_eq!(s.next_after(utc(2026, 1, 1, 0, 0), &tz), Some(utc(2026, 1, 1, 14, 30)));
    assert_eq!(s.next_after(utc(2026, 1, 1, 14, 30), &tz), Some(utc(2026, 1, 2, 14, 30)));
    let plus_two = TimeZone::Fixed(UtcOffset::parse("+02:00").unwrap());
    assert_eq!(cron("0 0 * * *").next_after(utc(2026, 1, 1, 0, 0), &plus_two), Some(utc(2026, 1, 1, 22, 0)));
}

// --- time zones and daylight saving time -----------------------------------------------------

#[test]
fn paris_offsets_across_2026() {
    let tz = paris();
    let spring = utc(2026, 3, 29, 1, 0);
    let autumn = utc(2026, 10, 25, 1, 0);
    assert_eq!(tz.offset_at(DbTime(spring.0 - 1)).seconds(), 3600);
    assert_eq!(tz.offset_at(spring).seconds(), 7200);
    assert_eq!(tz.offset_at(DbTime(autumn.0 - 1)).seconds(), 7200);
    assert_eq!(tz.offset_at(autumn).seconds(), 3600);
    assert_eq!(tz.next_transition(utc(2026, 1, 1, 0, 0)), Some(spring));
    assert_eq!(tz.next_transition(spring), Some(autumn));
    assert_eq!(tz.to_local(spring).to_string(), "2026-03-29T03:00:00+02:00");
    assert_eq!(tz.to_utc(civil(2026, 3, 29, 2, 30)), Some(LocalResult::Gap { after: spring }));
    assert_eq!(
        tz.to_utc(civil(2026, 10, 25, 2, 30)),
        Some(LocalResult::Ambiguous { earlier: utc(2026, 10, 25, 0, 30), later: utc(2026, 10, 25, 1, 30) })
    );
    assert_eq!(tz.to_utc(civil(2026, 7, 14, 12, 0)), Some(LocalResult::Single(utc(2026, 7, 14, 10, 0))));
    assert_eq!(tz.resolve(civil(2026, 3, 29, 2, 30)), Some(spring));
    assert_eq!(tz.id(), ZoneId::Named("Europe/Paris".into()));
    assert_eq!(tz.to_string(), "Europe/Paris");
}

#[test]
fn paris_daily_tick_in_the_gap_fires_once_after_it() {
    let tz = paris();
    let s = daily("02:30");
    let expected = vec![
        utc(2026, 3, 28, 1, 30), // 02:30 CET
        utc(2026, 3, 29, 1, 0),  // 02:30 does not exist: 03:00 CEST
        utc(2026, 3, 30, 0, 30), // 02:30 CEST
    ];
    assert_eq!(ticks(&s, &tz, utc(2026, 3, 27, 12, 0), 3), expected);
    assert_eq!(s.prev_at_or_before(utc(2026, 3, 30, 0, 0), &tz), Some(utc(2026, 3, 29, 1, 0)));
}

#[test]
fn paris_ticks_in_one_gap_fire_once_together() {
    let tz = paris();
    let quarter_past_two = cron("*/15 2 * * *");
    let expected = vec![utc(2026, 3, 28, 1, 45), utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 0)];
    assert_eq!(ticks(&quarter_past_two, &tz, utc(2026, 3, 28, 1, 30), 3), expected);
    // Hourly at :30: 01:30 CET, then 02:30 is skipped and fires at 03:00, then 03:30 CEST.
    let half_past = cron("30 * * * *");
    let expected = vec![utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 30)];
    assert_eq!(ticks(&half_past, &tz, utc(2026, 3, 29, 0, 0), 3), expected);
    // A tick at 03:00 and one in the gap are the same instant: once.
    let both = cron("30 2,3 * * *");
    let expected = vec![utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 30), utc(2026, 3, 30, 0, 30)];
    assert_eq!(ticks(&both, &tz, utc(2026, 3, 29, 0, 0), 3), expected);
}

#[test]
fn paris_tick_in_the_overlap_fires_at_its_first_occurrence() {
    let tz = paris();
    let s = daily("02:30");
    let expected = vec![utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)];
    assert_eq!(ticks(&s, &tz, utc(2026, 10, 23, 12, 0), 3), expected);
    // Every half hour: 02:00 and 02:30 CEST fire; their second occurrences (CET) do not.
    let half_hours = cron("0,30 * * * *");
    let expected = vec![
        utc(2026, 10, 25, 0, 0),  // 02:00 CEST
        utc(2026, 10, 25, 0, 30), // 02:30 CEST
        utc(2026, 10, 25, 2, 0),  // 03:00 CET
        utc(2026, 10, 25, 2, 30),
    ];
    assert_eq!(ticks(&half_hours, &tz, utc(2026, 10, 24, 23, 45), 4), expected);
    // Seen from inside the second pass, the last tick is the first pass's 02:30.
    assert_eq!(half_hours.prev_at_or_before(utc(2026, 10, 25, 1, 45), &tz), Some(utc(2026, 10, 25, 0, 30)));
    assert_eq!(half_hours.next_after(utc(2026, 10, 25, 1, 15), &tz), Some(utc(2026, 10, 25, 2, 0)));
}

#[test]
fn new_york_across_both_changes_of_2026() {
    let tz = new_york();
    let spring = utc(2026, 3, 8, 7, 0);
    let autumn = utc(2026, 11, 1, 6, 0);
    assert_eq!(tz.next_transition(utc(2026, 1, 1, 0, 0)), Some(spring));
    assert_eq!(tz.next_transition(spring), Some(autumn));
    assert_eq!(tz.to_local(DbTime(spring.0 - 1000)).to_string(), "2026-03-08T01:59:59-05:00");
    assert_eq!(tz.to_local(spring).to_string(), "2026-03-08T03:00:00-04:00");
    assert_eq!(tz.to_local(autumn).to_string(), "2026-11-01T01:00:00-05:00");
    let gap = daily("02:30");
    assert_eq!(
        ticks(&gap, &tz, utc(2026, 3, 7, 0, 0), 3),
        vec![utc(2026, 3, 7, 7, 30), spring, utc(2026, 3, 9, 6, 30)]
    );
    let overlap = daily("01:30");
    assert_eq!(
        ticks(&overlap, &tz, utc(2026, 10, 31, 0, 0), 3),
        vec![utc(2026, 10, 31, 5, 30), utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30)]
    );
    let business = cron("0 9 * * mon-fri");
    // Friday 2026-03-06 09:00 EST, then Monday 2026-03-09 09:00 EDT.
    assert_eq!(ticks(&business, &tz, utc(2026, 3, 6, 0, 0), 2), vec![utc(2026, 3, 6, 14, 0), utc(2026, 3, 9, 13, 0)]);
}

#[test]
fn after_the_last_transition_the_footer_rules() {
    let (paris, new_york) = (paris(), new_york());
    // zdump: Paris 2040-03-25 01:00 UT and 2040-10-28 01:00 UT; New York 2040-03-11 07:00 UT and
    // 2040-11-04 06:00 UT.
    assert_eq!(paris.next_transition(utc(2040, 1, 1, 0, 0)), Some(utc(2040, 3, 25, 1, 0)));
    assert_eq!(paris.next_transition(utc(2040, 3, 25, 1, 0)), Some(utc(2040, 10, 28, 1, 0)));
    assert_eq!(new_york.next_transition(utc(2040, 1, 1, 0, 0)), Some(utc(2040, 3, 11, 7, 0)));
    assert_eq!(new_york.next_transition(utc(2040, 3, 11, 7, 0)), Some(utc(2040, 11, 4, 6, 0)));
    let s = daily("02:30");
    assert_eq!(
        ticks(&s, &paris, utc(2040, 3, 24, 0, 0), 3),
        vec![utc(2040, 3, 24, 1, 30), utc(2040, 3, 25, 1, 0), utc(2040, 3, 26, 0, 30)]
    );
    assert_eq!(
        ticks(&s, &paris, utc(2040, 10, 27, 0, 0), 3),
        vec![utc(2040, 10, 27, 0, 30), utc(2040, 10, 28, 0, 30), utc(2040, 10, 29, 1, 30)]
    );
}

#[test]
fn zone_table_and_footer_agree_where_both_apply() {
    // The EU rule has held since 1996, the US rule since 2007.
    let cases = [(paris(), "CET-1CEST,M3.5.0,M10.5.0/3", 1997), (new_york(), "EST5EDT,M3.2.0,M11.1.0", 2008)];
    for (table, footer, from_year) in cases {
        let rule = TimeZone::from_posix_tz("rule", footer).unwrap();
        let mut at = utc(from_year, 1, 1, 0, 0);
        while at < utc(2060, 1, 1, 0, 0) {
            assert_eq!(table.next_transition(at), rule.next_transition(at), "{table} after {at:?}");
            at = table.next_transition(at).unwrap();
            assert_eq!(table.offset_at(at), rule.offset_at(at));
            assert_eq!(table.offset_at(DbTime(at.0 - 1)), rule.offset_at(DbTime(at.0 - 1)));
        }
    }
}

/// TZif bytes: `version` 1 to 4, transitions `(at, type)`, types `(offset, is_dst)`, footer.
fn tzif(version: u8, transitions: &[(i64, u8)], types: &[i32], footer: &str) -> Vec<u8> {
    fn block(out: &mut Vec<u8>, version: u8, transitions: &[(i64, u8)], types: &[i32], wide: bool) {
        out.extend(b"TZif");
        out.push(if version == 1 { 0 } else { b'0' + version });
        out.extend([0; 15]);
        for count in [0, 0, 0, transitions.len(), types.len(), 4] {
            out.extend(u32::try_from(count).unwrap().to_be_bytes());
        }
        for &(at, _) in transitions {
            if wide {
                out.extend(at.to_be_bytes());
            } else {
                out.extend(i32::try_from(at).unwrap().to_be_bytes());
            }
        }
        out.extend(transitions.iter().map(|&(_, t)| t));
        for &offset in types {
            out.extend(offset.to_be_bytes());
            out.extend([0, 0]);
        }
        out.extend(b"XYZ\0");
    }
    let mut out = Vec::new();
    block(&mut out, version, transitions, types, false);
    if version >= 2 {
        block(&mut out, version, transitions, types, true);
        out.push(b'\n');
        out.extend(footer.as_bytes());
        out.push(b'\n');
    }
    out
}

#[test]
fn tzif_versions_1_to_4() {
    let one_hour = 3600;
    let t = utc(2000, 1, 1, 0, 0).0 / 1000;
    for version in 1..=4 {
        let bytes = tzif(version, &[(t, 1), (t + 1000, 0)], &[0, one_hour], "XYZ0");
        let tz = TimeZone::from_tzif("Test/Zone", &bytes).unwrap();
        assert_eq!(tz.offset_at(DbTime((t - 1) * 1000)).seconds(), 0, "v{version}");
        assert_eq!(tz.offset_at(DbTime(t * 1000)).seconds(), one_hour, "v{version}");
        assert_eq!(tz.offset_at(DbTime((t + 1000) * 1000)).seconds(), 0, "v{version}");
        assert_eq!(tz.offset_at(utc(2100, 1, 1, 0, 0)).seconds(), 0, "v{version}");
    }
    // A slim file: no transitions, the footer does everything.
    let slim = TimeZone::from_tzif("Slim", &tzif(2, &[], &[3600], "CET-1CEST,M3.5.0,M10.5.0/3")).unwrap();
    assert_eq!(slim.next_transition(utc(2026, 1, 1, 0, 0)), Some(utc(2026, 3, 29, 1, 0)));
    // No footer: the last type holds.
    let bare = TimeZone::from_tzif("Bare", &tzif(2, &[(t, 0)], &[7200], "")).unwrap();
    assert_eq!(bare.offset_at(utc(2100, 1, 1, 0, 0)).seconds(), 7200);
}

#[test]
fn bad_tzif_is_refused_with_the_reason() {
    let message = |bytes: &[u8]| TimeZone::from_tzif("Bad", bytes).unwrap_err().to_string();
    assert!(message(&tzif(2, &[(10, 0), (5, 0)], &[0], "")).contains("ascending"));
    assert!(message(&tzif(2, &[(10, 3)], &[0], "")).contains("transition type 3 out of range: expected 0 to 0"));
    assert!(message(&tzif(2, &[], &[100_000], "")).contains("utc offset 100000 s out of range"));
    assert!(message(&tzif(2, &[], &[0], "CET-1CEST,M3")).contains("invalid footer"));
    assert!(message(&tzif(2, &[], &[], "")).contains("no local time types"));
    let mut no_footer = tzif(2, &[], &[0], "");
    no_footer.truncate(no_footer.len() - 2);
    assert!(message(&no_footer).contains("missing footer"));
    assert!(message(b"TZif9").contains("truncated header"));
    let mut v9 = tzif(2, &[], &[0], "");
    v9[4] = b'9';
    assert!(message(&v9).contains("unsupported version byte 0x39: expected 1, 2, 3 or 4"));
    assert!(message(b"Nope and more bytes than a header has, really, many more").contains("magic"));
    // Every prefix and every single-byte change of a real file: an error or a zone, never a panic.
    let real = std::fs::read(
        std::env::var_os("TZDIR")
            .map_or_else(|| PathBuf::from("/usr/share/zoneinfo"), PathBuf::from)
            .join("Europe/Paris"),
    )
    .unwrap();
    for len in 0..real.len() {
        assert!(TimeZone::from_tzif("Prefix", &real[..len]).is_err(), "{len}");
    }
    for i in 0..real.len() {
        let mut changed = real.clone();
        changed[i] ^= 0x5a;
        if let Ok(tz) = TimeZone::from_tzif("Changed", &changed) {
            let _ = daily("02:30").next_after(utc(2026, 3, 28, 0, 0), &tz);
        }
    }
}

// --- due ticks -------------------------------------------------------------------------------

fn hourly() -> Schedule {
    cron("0 * * * *")
}

fn catch_up(backfill: u32) -> CatchUp {
    CatchUp { backfill, misfire_ms: 60_000 }
}

#[test]
fn a_new_schedule_waits_for_its_next_tick() {
    let d = due(&hourly(), &TimeZone::Utc, catch_up(5), None, utc(2026, 1, 1, 10, 30));
    assert_eq!(
        d,
        Due { advance_to: Some(utc(2026, 1, 1, 10, 30)), next_check: Some(utc(2026, 1, 1, 11, 0)), ..Due::default() }
    );
}

#[test]
fn an_on_time_tick_is_enqueued_once() {
    let last = Some(utc(2026, 1, 1, 10, 0));
    let now = DbTime(utc(2026, 1, 1, 11, 0).0 + 500);
    let d = due(&hourly(), &TimeZone::Utc, catch_up(0), last, now);
    assert_eq!(d.ticks, [utc(2026, 1, 1, 11, 0)]);
    assert_eq!((d.backfilled, d.skipped), (0, false));
    assert_eq!(d.advance_to, Some(utc(2026, 1, 1, 11, 0)));
    assert_eq!(d.next_check, Some(utc(2026, 1, 1, 12, 0)));
    // Once recorded, nothing more is due until the next tick.
    let again = due(&hourly(), &TimeZone::Utc, catch_up(0), d.advance_to, DbTime(now.0 + 1000));
    assert_eq!(again, Due { next_check: Some(utc(2026, 1, 1, 12, 0)), ..Due::default() });
}

#[test]
fn missed_ticks_after_downtime() {
    let last = Some(utc(2026, 1, 1, 10, 0));
    // 15:10: the 15:00 tick is ten minutes late.
    let late = utc(2026, 1, 1, 15, 10);
    let d = due(&hourly(), &TimeZone::Utc, catch_up(0), last, late);
    assert_eq!((d.ticks.len(), d.backfilled, d.skipped), (0, 0, true));
    assert_eq!(d.advance_to, Some(utc(2026, 1, 1, 15, 0)));
    assert_eq!(d.next_check, Some(utc(2026, 1, 1, 16, 0)));
    let d = due(&hourly(), &TimeZone::Utc, catch_up(2), last, late);
    assert_eq!(d.ticks, [utc(2026, 1, 1, 14, 0), utc(2026, 1, 1, 15, 0)]);
    assert_eq!((d.backfilled, d.skipped), (2, true));
    let d = due(&hourly(), &TimeZone::Utc, catch_up(10), last, late);
    assert_eq!(d.ticks, (11..=15).map(|h| utc(2026, 1, 1, h, 0)).collect::<Vec<_>>());
    assert_eq!((d.backfilled, d.skipped), (5, false));
    // 15:00:30: the latest is on time, two more are backfilled.
    let d = due(&hourly(), &TimeZone::Utc, catch_up(2), last, DbTime(utc(2026, 1, 1, 15, 0).0 + 30_000));
    assert_eq!(d.ticks, [utc(2026, 1, 1, 13, 0), utc(2026, 1, 1, 14, 0), utc(2026, 1, 1, 15, 0)]);
    assert_eq!((d.backfilled, d.skipped), (2, true));
}

#[test]
fn a_clock_that_went_back_enqueues_nothing() {
    let last = Some(utc(2026, 1, 1, 12, 0));
    let d = due(&hourly(), &TimeZone::Utc, catch_up(3), last, utc(2026, 1, 1, 11, 30));
    assert_eq!(d, Due { next_check: Some(utc(2026, 1, 1, 13, 0)), ..Due::default() });
}

#[test]
fn long_downtime_is_bounded_work() {
    // A year of every-minute ticks with the largest backfill.
    let every_minute = cron("* * * * *");
    let last = Some(utc(2025, 1, 1, 0, 0));
    let now = DbTime(utc(2026, 1, 1, 0, 0).0 + 5_000);
    let d = due(&every_minute, &paris(), catch_up(MAX_BACKFILL), last, now);
    assert_eq!(d.ticks.len(), MAX_BACKFILL as usize + 1);
    assert_eq!(d.ticks.last(), Some(&utc(2026, 1, 1, 0, 0)));
    assert_eq!(d.ticks[0], DbTime(utc(2026, 1, 1, 0, 0).0 - MAX_BACKFILL as i64 * MINUTE));
    assert!(d.skipped);
    // A century of every-second intervals.
    let every_second = Schedule::Interval(Interval::new(1_000, 0).unwrap());
    let d = due(&every_second, &TimeZone::Utc, catch_up(3), Some(DbTime(0)), utc(2100, 1, 1, 0, 0));
    assert_eq!(d.ticks.len(), 4);
    assert_eq!(d.advance_to, Some(utc(2100, 1, 1, 0, 0)));
    // A sparse cron after 300 years.
    let leap_day = cron("0 0 29 2 *");
    let d = due(&leap_day, &TimeZone::Utc, catch_up(2), Some(utc(1800, 1, 1, 0, 0)), utc(2101, 1, 1, 0, 0));
    // The latest is late, so both are backfilled.
    assert_eq!(d.ticks, [utc(2092, 2, 29, 0, 0), utc(2096, 2, 29, 0, 0)]);
    assert_eq!((d.backfilled, d.skipped), (2, true));
}

#[test]
fn due_ticks_in_a_gap_are_one_tick() {
    let tz = paris();
    let s = cron("*/15 2 * * *");
    let d = due(&s, &tz, catch_up(100), Some(utc(2026, 3, 28, 23, 0)), utc(2026, 3, 29, 1, 0));
    assert_eq!(d.ticks, [utc(2026, 3, 29, 1, 0)]);
    assert_eq!(d.backfilled, 0);
}

// --- configuration ---------------------------------------------------------------------------

const EXAMPLE: &str = r#"
[[app.schedules]]
name = "nightly_report"
task = "report"
args = { kind = "daily" }
queue = "default"
priority = 0
cron = "0 3 * * *"
timezone = "Europe/Paris"
backfill = 0
misfire_ms = 60000

[[app.schedules]]
name = "poll"
task = "poll"
every = "15m"
offset = "1m30s"

[[app.schedules]]
name = "standup"
task = "remind"
weekly = { days = ["mon", "Friday"], at = "09:30" }
timezone = "-05:30"

[[app.schedules]]
name = "rent"
task = "pay"
monthly = { day = 31, at = "00:00:30" }
backfill = 3

[[app.schedules]]
name = "wake"
task = "wake"
daily = "07:00"
"#;

#[test]
fn the_documented_toml_loads() {
    let config = Config::from_toml_str(EXAMPLE).unwrap();
    let schedules = &config.app.schedules;
    assert_eq!(schedules.len(), 5);
    let nightly = &schedules[0];
    assert_eq!(nightly.args, serde_json::json!({"kind": "daily"}));
    assert_eq!(nightly.zone_id().unwrap(), ZoneId::Named("Europe/Paris".into()));
    assert_eq!(nightly.schedule().unwrap(), cron("0 3 * * *"));
    let parsed = ParsedSchedule::new(nightly.clone(), paris()).unwrap();
    assert_eq!(parsed.next_after(utc(2026, 7, 1, 0, 0)), Some(utc(2026, 7, 1, 1, 0)));
    assert_eq!(parsed.new_task().queue.as_deref(), Some("default"));
    let poll = schedules[1].schedule().unwrap();
    assert_eq!(poll, Schedule::Interval(Interval::new(900_000, 90_000).unwrap()));
    assert_eq!(schedules[1].args, serde_json::Value::Null);
    assert_eq!(schedules[1].catch_up(), CatchUp::default());
    let standup = schedules[2].schedule().unwrap();
    assert_eq!(standup.to_string(), "weekly on mon,fri at 09:30");
    assert_eq!(
        schedules[2].zone_id().unwrap().builtin(),
        Some(TimeZone::Fixed(UtcOffset::from_seconds(-19_800).unwrap()))
    );
    assert_eq!(schedules[3].schedule().unwrap().to_string(), "monthly on day 31 at 00:00:30");
    assert_eq!(schedules[4].schedule().unwrap(), daily("07:00"));
    // And back through JSON.
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(Config::from_json_str(&json).unwrap(), config);
    assert!(!json.contains("\"timezone\":\"UTC\""), "{json}");
}

/// The problems of one schedule in an app: `(field, expected)`.
fn problems(schedule: ScheduleConfig) -> Vec<(String, String)> {
    let app = AppConfig { schedules: vec![schedule], ..AppConfig::default() };
    match app.validate() {
        Ok(()) => Vec::new(),
        Err(e) => e.problems.into_iter().map(|p| (p.field, p.expected)).collect(),
    }
}

fn fields(schedule: ScheduleConfig) -> Vec<String> {
    problems(schedule).into_iter().map(|(field, _)| field).collect()
}

fn base() -> ScheduleConfig {
    ScheduleConfig { cron: Some("@hourly".into()), ..ScheduleConfig::new("s", "t") }
}

#[test]
fn each_field_is_validated() {
    assert_eq!(fields(base()), Vec::<String>::new());
    let cases: Vec<(ScheduleConfig, &str, &str)> = vec![
        (ScheduleConfig { name: "Nightly".into(), ..base() }, "schedules[0].name", "1 to 52 bytes"),
        (ScheduleConfig { name: "x".repeat(53), ..base() }, "schedules[0].name", "1 to 52 bytes"),
        (ScheduleConfig { task: String::new(), ..base() }, "schedules[0].task", "1 to 128 bytes"),
        (ScheduleConfig { queue: Some("Bad Queue".into()), ..base() }, "schedules[0].queue", "1 to 52 bytes"),
        (
            ScheduleConfig { queue: Some("other".into()), ..base() },
            "schedules[0].queue",
            "one of the app's queues: default",
        ),
        (
            ScheduleConfig { cron: None, ..base() },
            "schedules[0].cron",
            "exactly one of cron, every, daily, weekly or monthly (none is set)",
        ),
        (ScheduleConfig { daily: Some("03:00".into()), ..base() }, "schedules[0].daily", "(cron is set too)"),
        (
            ScheduleConfig { cron: Some("0 25 * * *".into()), ..base() },
            "schedules[0].cron",
            "invalid hour field \"25\": expected 0-23",
        ),
        (
            ScheduleConfig { cron: None, every: Some("15 minutes".into()), ..base() },
            "schedules[0].every",
            "a duration like",
        ),
        (ScheduleConfig { cron: None, every: Some("500ms".into()), ..base() }, "schedules[0].every", "from 1s to 365d"),
        (ScheduleConfig { cron: None, every: Some("366d".into()), ..base() }, "schedules[0].every", "from 1s to 365d"),
        (
            ScheduleConfig { cron: None, every: Some("1h".into()), offset: Some("1h".into()), ..base() },
            "schedules[0].offset",
            "less than every (1h)",
        ),
        (
            ScheduleConfig { cron: None, every: Some("1h".into()), offset: Some("x".into()), ..base() },
            "schedules[0].offset",
            "a duration like",
        ),
        (ScheduleConfig { offset: Some("1m".into()), ..base() }, "schedules[0].offset", "no offset without every"),
        (
            ScheduleConfig { cron: None, every: Some("1h".into()), timezone: "Europe/Paris".into(), ..base() },
            "schedules[0].timezone",
            "\"UTC\" with every",
        ),
        (
            ScheduleConfig { cron: None, daily: Some("3:00".into()), ..base() },
            "schedules[0].daily",
            "HH:MM or HH:MM:SS",
        ),
        (
            ScheduleConfig { cron: None, weekly: Some(WeeklyConfig { days: vec![], at: "09:00".into() }), ..base() },
            "schedules[0].weekly.days",
            "at least one weekday",
        ),
        (
            ScheduleConfig {
                cron: None,
                weekly: Some(WeeklyConfig { days: vec!["mon".into(), "mo".into()], at: "09:00".into() }),
                ..base()
            },
            "schedules[0].weekly.days[1]",
            "a weekday",
        ),
        (
            ScheduleConfig {
                cron: None,
                weekly: Some(WeeklyConfig { days: vec!["mon".into()], at: "9am".into() }),
                ..base()
            },
            "schedules[0].weekly.at",
            "HH:MM",
        ),
        (
            ScheduleConfig { cron: None, monthly: Some(MonthlyConfig { day: 32, at: "00:00".into() }), ..base() },
            "schedules[0].monthly.day",
            "1 to 31",
        ),
        (
            ScheduleConfig { cron: None, monthly: Some(MonthlyConfig { day: 0, at: "00:00".into() }), ..base() },
            "schedules[0].monthly.day",
            "1 to 31",
        ),
        (
            ScheduleConfig { timezone: "Europe/../etc".into(), ..base() },
            "schedules[0].timezone",
            "a zone name of 1 to 255 bytes",
        ),
        (
            ScheduleConfig { timezone: "+25:00".into(), ..base() },
            "schedules[0].timezone",
            "a fixed offset +HH:MM or -HH:MM",
        ),
        (ScheduleConfig { backfill: 10_001, ..base() }, "schedules[0].backfill", "0 to 10000"),
        (ScheduleConfig { misfire_ms: 999, ..base() }, "schedules[0].misfire_ms", "1000 to 86400000"),
        (ScheduleConfig { misfire_ms: 86_400_001, ..base() }, "schedules[0].misfire_ms", "1000 to 86400000"),
    ];
    for (schedule, field, expected) in cases {
        let found = problems(schedule.clone());
        assert_eq!(found.len(), 1, "{schedule:?}: {found:?}");
        assert_eq!(found[0].0, field, "{schedule:?}");
        assert!(found[0].1.contains(expected), "{schedule:?}: {} lacks {expected}", found[0].1);
    }
}

#[test]
fn names_are_unique_and_problems_come_together() {
    let app = AppConfig {
        schedules: vec![base(), base(), ScheduleConfig { backfill: 20_000, ..base() }],
        ..AppConfig::default()
    };
    let err = app.validate().unwrap_err();
    let fields: Vec<&str> = err.fields().collect();
    assert_eq!(fields, ["schedules[1].name", "schedules[2].backfill", "schedules[2].name"]);
    assert_eq!(err.problem("schedules[1].name").unwrap().expected, "a name not already used by schedules[0]");
    let in_file = Config { app, ..Config::default() }.validate().unwrap_err();
    assert_eq!(in_file.problems[0].field, "app.schedules[1].name");
    // The schedule alone names its fields without a prefix.
    let alone = ScheduleConfig { cron: Some("* * * * 8".into()), ..base() }.validate().unwrap_err();
    assert_eq!(alone.problems[0].field, "cron");
    assert_eq!(alone.problems[0].value, "\"* * * * 8\"");
    assert!(ScheduleConfig { cron: None, ..base() }.schedule().is_err());
}

#[test]
fn unknown_keys_and_wrong_types_are_load_errors() {
    for (text, message) in [
        (
            "[[app.schedules]]\nname = \"a\"\ntask = \"t\"\ncron = \"@daily\"\ncrontab = \"x\"\n",
            "unknown field `crontab`",
        ),
        (
            "[[app.schedules]]\nname = \"a\"\ntask = \"t\"\nweekly = { days = [\"mon\"], at = \"09:00\", tz = 1 }\n",
            "unknown field `tz`",
        ),
        ("[[app.schedules]]\nname = \"a\"\ncron = \"@daily\"\n", "missing field `task`"),
        ("[[app.schedules]]\nname = \"a\"\ntask = \"t\"\ncron = \"@daily\"\npriority = 40000\n", "i16"),
    ] {
        let err = Config::from_toml_str(text).unwrap_err();
        assert!(matches!(err, LoadError::Toml(_)), "{err:?}");
        assert!(err.to_string().contains(message), "{err}");
    }
}

#[test]
fn a_parsed_schedule_needs_its_own_zone() {
    let config = ScheduleConfig { timezone: "Europe/Paris".into(), ..base() };
    let err = ParsedSchedule::new(config.clone(), TimeZone::Utc).unwrap_err();
    assert_eq!(err.to_string(), "time zone UTC given for schedule \"s\": expected its configured zone Europe/Paris");
    let parsed = ParsedSchedule::new(config, paris()).unwrap();
    assert_eq!(parsed.name(), "s");
    assert_eq!(parsed.time_zone().id(), ZoneId::Named("Europe/Paris".into()));
    let invalid = ParsedSchedule::new(ScheduleConfig { backfill: 20_000, ..base() }, TimeZone::Utc).unwrap_err();
    assert!(matches!(invalid, ScheduleError::Invalid(_)), "{invalid}");
}

#[test]
fn durations() {
    let cases =
        [("500ms", 500), ("1s", 1_000), ("15m", 900_000), ("1h30m", 5_400_000), ("7d", 604_800_000), ("1m30s", 90_000)];
    for (text, ms) in cases {
        assert_eq!(parse_duration_ms(text), Ok(ms), "{text}");
        assert_eq!(parse_duration_ms(&format_duration_ms(ms)), Ok(ms));
    }
    assert_eq!(format_duration_ms(5_400_000), "1h30m");
    assert_eq!(format_duration_ms(0), "0ms");
    for bad in ["", "15", "m", "1.5h", "15 m", "1H", "-1s", "1w", "99999999999999999999d", "9999999999999999d"] {
        let err = parse_duration_ms(bad).unwrap_err();
        assert!(err.to_string().starts_with("invalid duration"), "{bad}: {err}");
    }
}

// --- properties ------------------------------------------------------------------------------

/// One item of a cron field, with the values it selects computed independently of the parser.
#[derive(Debug, Clone)]
enum Item {
    Star,
    Value(u32),
    Range(u32, u32),
    StarStep(u32),
    RangeStep(u32, u32, u32),
    ValueStep(u32, u32),
}

impl Item {
    fn text(&self) -> String {
        match self {
            Item::Star => "*".into(),
            Item::Value(n) => n.to_string(),
            Item::Range(a, b) => format!("{a}-{b}"),
            Item::StarStep(s) => format!("*/{s}"),
            Item::RangeStep(a, b, s) => format!("{a}-{b}/{s}"),
            Item::ValueStep(n, s) => format!("{n}/{s}"),
        }
    }

    fn values(&self, min: u32, max: u32) -> Vec<u32> {
        let (from, to, step) = match *self {
            Item::Star => (min, max, 1),
            Item::Value(n) => (n, n, 1),
            Item::Range(a, b) => (a, b, 1),
            Item::StarStep(s) => (min, max, s),
            Item::RangeStep(a, b, s) => (a, b, s),
            Item::ValueStep(n, s) => (n, max, s),
        };
        (from..=to).step_by(step as usize).collect()
    }
}

fn item(min: u32, max: u32) -> impl Strategy<Value = Item> {
    let width = max - min + 1;
    let pair = (min..=max, min..=max).prop_map(|(a, b)| (a.min(b), a.max(b)));
    prop_oneof![
        2 => Just(Item::Star),
        3 => (min..=max).prop_map(Item::Value),
        2 => pair.clone().prop_map(|(a, b)| Item::Range(a, b)),
        2 => (1..=width).prop_map(Item::StarStep),
        1 => (pair, 1..=width).prop_map(|((a, b), s)| Item::RangeStep(a, b, s)),
        1 => (min..=max, 1..=width).prop_map(|(n, s)| Item::ValueStep(n, s)),
    ]
}

/// A field: its text, its value set as a mask, and whether it starts with `*`.
fn field(min: u32, max: u32) -> impl Strategy<Value = (String, u64, bool)> {
    prop::collection::vec(item(min, max), 1..=3).prop_map(move |items| {
        let text: Vec<String> = items.iter().map(Item::text).collect();
        let mask = items.iter().flat_map(|i| i.values(min, max)).fold(0u64, |m, v| m | 1 << v);
        (text.join(","), mask, matches!(items[0], Item::Star | Item::StarStep(_)))
    })
}

/// An expression and an independent matcher of its ticks.
#[derive(Debug, Clone)]
struct Expr {
    text: String,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    either: bool,
}

impl Expr {
    fn day_matches(&self, t: CivilDateTime) -> bool {
        let dom = self.days >> t.day() & 1 == 1;
        let dow = self.weekdays >> t.weekday().number() & 1 == 1;
        self.months >> t.month() & 1 == 1 && if self.either { dom || dow } else { dom && dow }
    }

    fn matches(&self, t: CivilDateTime) -> bool {
        t.second() == 0 && self.minutes >> t.minute() & 1 == 1 && self.hours >> t.hour() & 1 == 1 && self.day_matches(t)
    }
}

fn expr() -> impl Strategy<Value = Expr> {
    (field(0, 59), field(0, 23), field(1, 31), field(1, 12), field(0, 7)).prop_map(|(mi, h, dom, mo, dow)| Expr {
        text: format!("{} {} {} {} {}", mi.0, h.0, dom.0, mo.0, dow.0),
        minutes: mi.1,
        hours: h.1,
        days: dom.1,
        months: mo.1,
        weekdays: (dow.1 | dow.1 >> 7) & 0x7f,
        either: !dom.2 && !dow.2,
    })
}

/// 1970 to 2100, in ms.
fn instant() -> impl Strategy<Value = DbTime> {
    (0i64..4_102_444_800_000).prop_map(DbTime)
}

fn local(t: i64) -> CivilDateTime {
    CivilDateTime::from_unix_seconds(t).unwrap()
}

/// Whether some tick of `e` lies strictly between the UTC seconds `a` and `b`: minute by minute
/// on the first and last days, day by day in between (a matching day has a tick: the hour and
/// minute sets are never empty).
fn tick_between(e: &Expr, a: i64, b: i64) -> Option<i64> {
    let first_minute = (a.div_euclid(60) + 1) * 60;
    let first_day_end = (a.div_euclid(86_400) + 1) * 86_400;
    let last_day_start = b.div_euclid(86_400) * 86_400;
    let minutes = |from: i64, to: i64| (from..to).step_by(60).find(|&m| e.matches(local(m)));
    if last_day_start <= first_day_end {
        return minutes(first_minute, b);
    }
    minutes(first_minute, first_day_end)
        .or_else(|| (first_day_end..last_day_start).step_by(86_400).find(|&d| e.day_matches(local(d))))
        .or_else(|| minutes(last_day_start, b))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn cron_next_and_prev_are_the_nearest_ticks(e in expr(), t in instant()) {
        let parsed = match Cron::parse(&e.text) {
            Ok(parsed) => parsed,
            Err(CronError::Never(_)) => {
                // Only a restricted day of the month the chosen months lack, with any weekday.
                prop_assert!(!e.either && (e.days & !(0b11 << 30)) == 0, "{}", e.text);
                return Ok(());
            }
            Err(other) => return Err(TestCaseError::fail(format!("{}: {other}", e.text))),
        };
        let s = Schedule::Cron(parsed.clone());
        let next = s.next_after(t, &TimeZone::Utc).unwrap();
        prop_assert!(next > t);
        prop_assert!(e.matches(local(next.0 / 1000)), "{} next {}", e.text, local(next.0 / 1000));
        prop_assert!(parsed.matches(local(next.0 / 1000)));
        let between = tick_between(&e, t.0.div_euclid(1000), next.0 / 1000);
        prop_assert_eq!(between, None, "{} from {:?} to {:?}", e.text, t, next);
        let prev = s.prev_at_or_before(t, &TimeZone::Utc).unwrap();
        prop_assert!(prev <= t);
        prop_assert!(e.matches(local(prev.0 / 1000)));
        prop_assert_eq!(tick_between(&e, prev.0 / 1000, t.0.div_euclid(1000) + 1), None);
        prop_assert_eq!(s.next_after(prev, &TimeZone::Utc), Some(next));
    }

    #[test]
    fn due_is_bounded_ascending_and_within_the_window(
        e in expr(),
        every_s in 1u64..100_000,
        use_interval in any::<bool>(),
        last in prop::option::of(instant()),
        span in prop_oneof![0i64..600_000, 0i64..100_000_000, 0i64..4_000_000_000],
        backfill in 0u32..30,
        misfire_ms in 1_000u64..1_000_000,
    ) {
        let schedule = if use_interval {
            Schedule::Interval(Interval::new(every_s * 1000, 0).unwrap())
        } else {
            match Cron::parse(&e.text) {
                Ok(parsed) => Schedule::Cron(parsed),
                Err(_) => return Ok(()),
            }
        };
        let now = DbTime(last.unwrap_or(DbTime(1_700_000_000_000)).0 + span);
        let catch_up = CatchUp { backfill, misfire_ms };
        let d = due(&schedule, &TimeZone::Utc, catch_up, last, now);
        prop_assert!(d.ticks.len() <= backfill as usize + 1);
        prop_assert!(d.ticks.windows(2).all(|w| w[0] < w[1]));
        prop_assert!(d.backfilled <= d.ticks.len());
        let Some(last) = last else {
            prop_assert!(d.ticks.is_empty());
            prop_assert_eq!(d.advance_to, Some(now));
            return Ok(());
        };
        for &t in &d.ticks {
            prop_assert!(last < t && t <= now);
            prop_assert!(d.advance_to.is_some_and(|a| a >= t));
        }
        prop_assert!(d.advance_to.is_none_or(|a| last < a && a <= now));
        prop_assert!(d.next_check.is_none_or(|n| n > now));
        // Exactly the rule, against every due tick listed one by one (short windows).
        let few = if use_interval { span / (every_s as i64 * 1000) < 1000 } else { span <= 100_000_000 && e.minutes.count_ones() <= 2 };
        if span <= 600_000 || few {
            let mut all = Vec::new();
            let mut at = last;
            while let Some(t) = schedule.next_after(at, &TimeZone::Utc).filter(|&t| t <= now) {
                all.push(t);
                at = t;
            }
            prop_assert_eq!(d.advance_to, all.last().copied());
            let on_time = all.last().is_some_and(|&t| now.0 - t.0 <= misfire_ms as i64);
            let missed = all.len() - usize::from(on_time);
            let take = missed.min(backfill as usize) + usize::from(on_time);
            prop_assert_eq!(&d.ticks[..], &all[all.len() - take..]);
            prop_assert_eq!(d.backfilled, missed.min(backfill as usize));
            prop_assert_eq!(d.skipped, missed > backfill as usize);
        }
    }

    #[test]
    fn local_and_utc_round_trip_in_paris_and_new_york(t in instant(), zone_index in 0usize..2) {
        let tz = &zones()[zone_index];
        let whole = DbTime(t.0.div_euclid(1000) * 1000);
        let l = tz.to_local(t);
        prop_assert_eq!(l.datetime.to_unix_seconds() - i64::from(l.offset.seconds()), whole.0 / 1000);
        match tz.to_utc(l.datetime).unwrap() {
            LocalResult::Single(u) => prop_assert_eq!(u, whole),
            LocalResult::Ambiguous { earlier, later } => prop_assert!(earlier == whole || later == whole),
            LocalResult::Gap { .. } => return Err(TestCaseError::fail(format!("{} was shown at {t:?}", l.datetime))),
        }
        // And from a civil time: it is shown at the instant it resolves to, unless skipped.
        let c = local(whole.0 / 1000);
        let resolved = tz.resolve(c).unwrap();
        match tz.to_utc(c).unwrap() {
            LocalResult::Gap { after } => {
                prop_assert_eq!(resolved, after);
                prop_assert!(tz.to_local(resolved).datetime > c);
                prop_assert!(tz.to_local(DbTime(resolved.0 - 1000)).datetime < c);
            }
            _ => prop_assert_eq!(tz.to_local(resolved).datetime, c),
        }
    }

    #[test]
    fn zoned_schedules_tick_forward(t in instant(), hour in 0u8..24, minute in 0u8..60, zone_index in 0usize..2) {
        let tz = &zones()[zone_index];
        let s = Schedule::Daily(TimeOfDay::new(hour, minute, 0).unwrap());
        let next = s.next_after(t, tz).unwrap();
        prop_assert!(next > t && next.0 - t.0 <= 26 * HOUR);
        let shown = tz.to_local(next).datetime;
        let wanted = CivilDateTime::new(shown.year(), shown.month(), shown.day(), hour, minute, 0).unwrap();
        if shown.time() != wanted.time() {
            // Only in a gap, and then at its end.
            let at_gap_end = matches!(tz.to_utc(wanted), Some(LocalResult::Gap { after }) if after == next);
            prop_assert!(at_gap_end, "{} shown for {}", shown, wanted);
        }
        let prev = s.prev_at_or_before(DbTime(next.0 - 1), tz).unwrap();
        prop_assert!(prev <= t);
        prop_assert_eq!(s.next_after(prev, tz), Some(next));
    }
}

proptest! {
    #[test]
    fn any_text_is_an_answer_not_a_panic(
        text in prop_oneof![
            "\\PC{0,40}",
            "[0-9*/,a-zA-Z@ -]{0,30}",
            "[A-Z<>+0-9,.:/JM-]{0,40}",
            "[0-9a-z]{0,12}",
        ],
    ) {
        let _ = Cron::parse(&text);
        let _ = TimeZone::from_posix_tz("x", &text);
        let _ = ZoneId::parse(&text);
        let _ = parse_duration_ms(&text);
        let _ = TimeOfDay::parse(&text);
        let _ = Weekday::from_name(&text);
        if let Ok(tz) = TimeZone::from_posix_tz("x", &text) {
            let _ = daily("02:30").next_after(DbTime(1_700_000_000_000), &tz);
        }
    }
}
