//! Time zones, pure: UTC, fixed offsets, and the rules of a zone read from TZif bytes (RFC 8536
//! versions 1 to 4, with the POSIX TZ footer for instants after the last transition). jiff
//! ([`jiff::tz::TimeZone`]) holds the rules and does every conversion; this module names zones,
//! checks TZif data for what jiff lets through (transitions out of order, unknown versions) and
//! keeps the types the schedules use.
//!
//! Nothing here reads a file. An I/O adapter reads `/usr/share/zoneinfo/<name>` (or
//! `$TZDIR/<name>`) after checking the name with [`zone_path`], and hands the bytes to
//! [`TimeZone::from_tzif`].
//!
//! Instants are Unix time, as everywhere in Canter, so the `right/` zones (with leap seconds)
//! are not meaningful here. jiff covers the years -9999 to 9999: an instant outside them is
//! taken at the nearest end of that range.

use std::borrow::Cow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use jiff::civil::DateTime;
use jiff::tz::{AmbiguousOffset, Offset};
use jiff::{SignedDuration, Timestamp};

use super::DbTime;
use super::civil::CivilDateTime;

/// How far before an instant the zone looks for transitions that set the clocks back: more than
/// any overlap of real zones.
const WINDOW: SignedDuration = SignedDuration::from_hours(3 * 24);

/// The most transitions looked at in one window or for one change of offset (real zones have
/// at most a few).
const MAX_WINDOW_TRANSITIONS: usize = 64;

/// Why a time zone, its name or its data was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TzError {
    /// The name is not a zone name a file may be read for.
    #[error("invalid time zone name {name:?}: expected {expected}")]
    InvalidName {
        /// The name given.
        name: String,
        /// What a name may be.
        expected: &'static str,
    },
    /// A fixed offset out of range or not written `+HH:MM`.
    #[error("invalid utc offset {0:?}: expected +HH:MM or -HH:MM, at most 23:59")]
    InvalidOffset(String),
    /// The bytes are not valid TZif data.
    #[error("invalid tzif data for time zone {name:?}: {problem}")]
    InvalidTzif {
        /// The zone's name.
        name: String,
        /// What was wrong and what was expected.
        problem: String,
    },
    /// A POSIX TZ string (a TZif footer) that does not parse.
    #[error("invalid posix tz string {text:?}: {problem}")]
    InvalidPosixTz {
        /// The string.
        text: String,
        /// What was wrong and what was expected.
        problem: String,
    },
}

const ZONE_NAME_RULE: &str =
    "1 to 255 bytes of A-Z, a-z, 0-9, _, +, - and /, not starting or ending with /, without empty components";

/// Checks a zone name (`Europe/Paris`) and returns the relative path of its TZif file under
/// the zoneinfo directory. The name must be 1 to 255 bytes of `A-Za-z0-9_+-/`, must not start
/// or end with `/` and must not have empty components, so joining it to a directory can never
/// leave that directory (there is no `.` at all, so no `..`).
pub fn zone_path(name: &str) -> Result<&Path, TzError> {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b'-' | b'/');
    let valid = (1..=255).contains(&name.len())
        && name.bytes().all(allowed)
        && name.split('/').all(|component| !component.is_empty() && component != "." && component != "..");
    if valid {
        Ok(Path::new(name))
    } else {
        Err(TzError::InvalidName { name: name.to_owned(), expected: ZONE_NAME_RULE })
    }
}

/// A UTC offset in seconds east of Greenwich, less than 26 hours either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct UtcOffset(i32);

impl UtcOffset {
    /// UTC itself.
    pub const ZERO: UtcOffset = UtcOffset(0);

    /// The offset of `seconds` east of Greenwich, if less than 26 hours either way.
    pub fn from_seconds(seconds: i32) -> Option<UtcOffset> {
        (seconds.unsigned_abs() < 26 * 3600).then_some(UtcOffset(seconds))
    }

    /// Seconds east of Greenwich.
    pub fn seconds(self) -> i32 {
        self.0
    }

    /// Parses `+HH:MM` or `-HH:MM` (hours 00–23, minutes 00–59).
    pub fn parse(text: &str) -> Result<UtcOffset, TzError> {
        let invalid = || TzError::InvalidOffset(text.to_owned());
        let bytes = text.as_bytes();
        let sign = match bytes.first() {
            Some(b'+') => 1,
            Some(b'-') => -1,
            _ => return Err(invalid()),
        };
        let digits = |range: std::ops::Range<usize>| -> Option<i32> {
            let part = bytes.get(range)?;
            part.iter().all(u8::is_ascii_digit).then(|| part.iter().fold(0, |n, &b| n * 10 + i32::from(b - b'0')))
        };
        match (bytes.len(), bytes.get(3), digits(1..3), digits(4..6)) {
            (6, Some(b':'), Some(hours), Some(minutes)) if hours < 24 && minutes < 60 => {
                Ok(UtcOffset(sign * (hours * 3600 + minutes * 60)))
            }
            _ => Err(invalid()),
        }
    }
}

impl fmt::Display for UtcOffset {
    /// `+HH:MM`, or `+HH:MM:SS` when the offset has seconds.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { '-' } else { '+' };
        let abs = self.0.unsigned_abs();
        write!(f, "{sign}{:02}:{:02}", abs / 3600, abs / 60 % 60)?;
        if abs % 60 != 0 {
            write!(f, ":{:02}", abs % 60)?;
        }
        Ok(())
    }
}

/// A time zone as configured: `UTC`, a fixed offset (`+02:00`), or a zone name whose rules
/// must be read from its TZif file (`Europe/Paris`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ZoneId {
    /// `UTC`: needs no file.
    Utc,
    /// A fixed offset: needs no file.
    Fixed(UtcOffset),
    /// A zone of the tz database, by a name [`zone_path`] accepts.
    Named(String),
}

impl ZoneId {
    /// Parses `UTC`, `+HH:MM` / `-HH:MM`, or a zone name (checked with [`zone_path`]).
    pub fn parse(text: &str) -> Result<ZoneId, TzError> {
        if text == "UTC" {
            Ok(ZoneId::Utc)
        } else if text.starts_with(['+', '-']) {
            UtcOffset::parse(text).map(ZoneId::Fixed)
        } else {
            zone_path(text).map(|_| ZoneId::Named(text.to_owned()))
        }
    }

    /// The zone when it needs no file (UTC or a fixed offset).
    pub fn builtin(&self) -> Option<TimeZone> {
        match self {
            ZoneId::Utc => Some(TimeZone::Utc),
            ZoneId::Fixed(offset) => Some(TimeZone::Fixed(*offset)),
            ZoneId::Named(_) => None,
        }
    }

    /// The path of the zone's TZif file relative to the zoneinfo directory, for a named zone.
    pub fn file_path(&self) -> Option<&Path> {
        match self {
            ZoneId::Named(name) => zone_path(name).ok(),
            _ => None,
        }
    }
}

impl fmt::Display for ZoneId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZoneId::Utc => f.write_str("UTC"),
            ZoneId::Fixed(offset) => offset.fmt(f),
            ZoneId::Named(name) => f.write_str(name),
        }
    }
}

/// What instants a local civil time names in a zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocalResult {
    /// Exactly one instant.
    Single(DbTime),
    /// Two instants: the local time occurs twice (the clocks were set back).
    Ambiguous {
        /// The first occurrence.
        earlier: DbTime,
        /// The second occurrence.
        later: DbTime,
    },
    /// None: the local time is skipped (the clocks were set forward over it).
    Gap {
        /// The first instant after the gap: the transition, when local time resumes later
        /// than the time asked for.
        after: DbTime,
    },
}

impl LocalResult {
    /// The instant a schedule fires at for this local time: the only one, the first of two,
    /// or the first instant after a gap.
    pub fn earliest(self) -> DbTime {
        match self {
            LocalResult::Single(at) | LocalResult::Ambiguous { earlier: at, .. } | LocalResult::Gap { after: at } => at,
        }
    }
}

/// A local civil date-time with the UTC offset in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalDateTime {
    /// The wall-clock date and time (to the second).
    pub datetime: CivilDateTime,
    /// The offset from UTC in effect.
    pub offset: UtcOffset,
}

impl fmt::Display for LocalDateTime {
    /// RFC 3339: `2026-03-29T03:00:00+02:00`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.datetime, self.offset)
    }
}

/// A time zone: UTC, a fixed offset, or the rules of a tz database zone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TimeZone {
    /// UTC.
    Utc,
    /// A fixed offset from UTC.
    Fixed(UtcOffset),
    /// The rules of a zone, from its TZif data (or a POSIX TZ string).
    Rules(Arc<ZoneRules>),
}

/// The rules of one zone, as jiff holds them, with the name they were loaded under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZoneRules {
    name: String,
    rules: jiff::tz::TimeZone,
}

impl ZoneRules {
    /// The zone's name, as given when it was loaded.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Hash for ZoneRules {
    /// By name (equal rules have equal names; jiff's zones are not hashable).
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

/// The instant of `at`, taken at the nearest end of jiff's range when outside it.
fn timestamp(at: DbTime) -> Timestamp {
    Timestamp::from_millisecond(at.0).unwrap_or(if at.0 < 0 { Timestamp::MIN } else { Timestamp::MAX })
}

/// The instant of `at`'s second (milliseconds dropped), within jiff's range as [`timestamp`].
fn timestamp_second(at: DbTime) -> Timestamp {
    let second = at.0.div_euclid(1000);
    Timestamp::from_second(second).unwrap_or(if second < 0 { Timestamp::MIN } else { Timestamp::MAX })
}

/// `at` in ms (jiff's instants all fit).
fn db_time(at: Timestamp) -> DbTime {
    DbTime(at.as_millisecond())
}

impl UtcOffset {
    fn to_jiff(self) -> Offset {
        // Less than 26 hours either way, as jiff's offsets.
        Offset::from_seconds(self.0).unwrap_or(Offset::UTC)
    }
}

impl TimeZone {
    /// Reads a zone from TZif bytes (RFC 8536, versions 1 to 4: the 64-bit data of version 2
    /// and later and its POSIX TZ footer). `name` is the zone's name (`Europe/Paris`), kept
    /// for [`TimeZone::id`] and messages.
    pub fn from_tzif(name: &str, bytes: &[u8]) -> Result<TimeZone, TzError> {
        let invalid = |problem: String| TzError::InvalidTzif { name: name.to_owned(), problem };
        check_tzif(bytes).map_err(invalid)?;
        let rules = jiff::tz::TimeZone::tzif(name, bytes).map_err(|e| invalid(e.to_string()))?;
        Ok(TimeZone::Rules(Arc::new(ZoneRules { name: name.to_owned(), rules })))
    }

    /// A zone named `name` that follows the POSIX TZ rule `spec` at all times (for example
    /// `CET-1CEST,M3.5.0,M10.5.0/3`). Daylight saving time needs its rule: `EST5EDT` alone is
    /// refused (POSIX leaves its dates unspecified).
    pub fn from_posix_tz(name: &str, spec: &str) -> Result<TimeZone, TzError> {
        let rules = jiff::tz::TimeZone::posix(spec)
            .map_err(|e| TzError::InvalidPosixTz { text: spec.to_owned(), problem: e.to_string() })?;
        Ok(TimeZone::Rules(Arc::new(ZoneRules { name: name.to_owned(), rules })))
    }

    /// What this zone is, as configured: `UTC`, its fixed offset, or its name.
    pub fn id(&self) -> ZoneId {
        match self {
            TimeZone::Utc => ZoneId::Utc,
            TimeZone::Fixed(offset) => ZoneId::Fixed(*offset),
            TimeZone::Rules(rules) => ZoneId::Named(rules.name.clone()),
        }
    }

    /// The zone as jiff's.
    fn rules(&self) -> Cow<'_, jiff::tz::TimeZone> {
        match self {
            TimeZone::Utc => Cow::Owned(jiff::tz::TimeZone::UTC),
            TimeZone::Fixed(offset) => Cow::Owned(jiff::tz::TimeZone::fixed(offset.to_jiff())),
            TimeZone::Rules(rules) => Cow::Borrowed(&rules.rules),
        }
    }

    /// The offset from UTC in effect at `at`.
    pub fn offset_at(&self, at: DbTime) -> UtcOffset {
        UtcOffset(self.rules().to_offset(timestamp(at)).seconds())
    }

    /// The local date-time at `at` (milliseconds are dropped: the second is rounded down).
    pub fn to_local(&self, at: DbTime) -> LocalDateTime {
        let at = timestamp_second(at);
        let offset = self.rules().to_offset(at);
        LocalDateTime {
            datetime: CivilDateTime::from_jiff(offset.to_datetime(at)),
            offset: UtcOffset(offset.seconds()),
        }
    }

    /// The instants the local time `local` names: one, two (an overlap) or none (a gap).
    /// `None` when they lie outside jiff's range (years -9999 to 9999).
    pub fn to_utc(&self, local: CivilDateTime) -> Option<LocalResult> {
        let rules = self.rules();
        let local = local.to_jiff();
        let at = |offset: Offset| offset.to_timestamp(local).ok().map(db_time);
        Some(match rules.to_ambiguous_timestamp(local).offset() {
            AmbiguousOffset::Unambiguous { offset } => LocalResult::Single(at(offset)?),
            AmbiguousOffset::Fold { before, after } => {
                LocalResult::Ambiguous { earlier: at(before)?, later: at(after)? }
            }
            AmbiguousOffset::Gap { after, .. } => {
                // Read with the offset after the gap, the local time falls before the
                // transition that opens it.
                let before_gap = after.to_timestamp(local).ok()?;
                LocalResult::Gap { after: db_time(rules.following(before_gap).next()?.timestamp()) }
            }
        })
    }

    /// The instant a schedule fires at for the local time `local`: the only one, the first
    /// of two in an overlap, or the first instant after a gap. `None` outside jiff's range.
    pub fn resolve(&self, local: CivilDateTime) -> Option<DbTime> {
        self.to_utc(local).map(LocalResult::earliest)
    }

    /// The first instant strictly after `after` at which the offset changes.
    pub fn next_transition(&self, after: DbTime) -> Option<DbTime> {
        let rules = self.rules();
        let start = timestamp(after);
        let mut before = rules.to_offset(start);
        for transition in rules.following(start).take(MAX_WINDOW_TRANSITIONS) {
            if transition.offset() != before {
                return Some(db_time(transition.timestamp()));
            }
            before = transition.offset();
        }
        None
    }

    /// The latest local time shown at any instant up to `at` (to the second): the local time
    /// at `at`, or later just after clocks were set back.
    pub(crate) fn high_water_local(&self, at: DbTime) -> DateTime {
        let rules = self.rules();
        let at = timestamp_second(at);
        let mut high = rules.to_datetime(at);
        let window_start = at.checked_sub(WINDOW).unwrap_or(Timestamp::MIN);
        // Transitions strictly before the next second: up to and including `at`.
        let upto = at.checked_add(SignedDuration::from_secs(1)).unwrap_or(Timestamp::MAX);
        for transition in rules.preceding(upto).take(MAX_WINDOW_TRANSITIONS) {
            if transition.timestamp() < window_start {
                break;
            }
            if let Ok(just_before) = transition.timestamp().checked_sub(SignedDuration::from_secs(1)) {
                high = high.max(rules.to_datetime(just_before));
            }
        }
        high
    }
}

impl fmt::Display for TimeZone {
    /// `UTC`, the offset (`+02:00`) or the zone's name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.id().fmt(f)
    }
}

// ---------------------------------------------------------------------------------------------
// TZif checks: what jiff lets through (transitions out of order, unknown versions), with the
// reasons an operator reads
// ---------------------------------------------------------------------------------------------

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(len).filter(|&end| end <= self.bytes.len()).ok_or_else(|| {
            format!(
                "truncated {what}: expected {len} bytes at offset {}, found {}",
                self.pos,
                self.bytes.len() - self.pos
            )
        })?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }
}

struct Header {
    version: u8,
    isutcnt: usize,
    isstdcnt: usize,
    leapcnt: usize,
    timecnt: usize,
    typecnt: usize,
    charcnt: usize,
}

impl Header {
    fn read(r: &mut Reader<'_>) -> Result<Header, String> {
        let bytes = r.take(44, "header")?;
        if &bytes[..4] != b"TZif" {
            return Err("expected the magic bytes \"TZif\" at the start of a header".to_owned());
        }
        let version = match bytes[4] {
            0 => 1,
            v @ b'2'..=b'4' => v - b'0',
            other => return Err(format!("unsupported version byte {other:#04x}: expected 1, 2, 3 or 4")),
        };
        let count = |i: usize| {
            let word = [bytes[20 + 4 * i], bytes[21 + 4 * i], bytes[22 + 4 * i], bytes[23 + 4 * i]];
            usize::try_from(u32::from_be_bytes(word)).unwrap_or(usize::MAX)
        };
        Ok(Header {
            version,
            isutcnt: count(0),
            isstdcnt: count(1),
            leapcnt: count(2),
            timecnt: count(3),
            typecnt: count(4),
            charcnt: count(5),
        })
    }

    /// The length of the data block that follows, with `time_size`-byte times.
    fn block_len(&self, time_size: usize) -> Option<usize> {
        let parts = [
            self.timecnt.checked_mul(time_size + 1)?,
            self.typecnt.checked_mul(6)?,
            self.charcnt,
            self.leapcnt.checked_mul(time_size + 4)?,
            self.isstdcnt,
            self.isutcnt,
        ];
        parts.iter().try_fold(0usize, |sum, &part| sum.checked_add(part))
    }
}

/// The smallest and largest UTC offsets RFC 8536 allows a local time type.
const TZIF_OFFSETS: std::ops::RangeInclusive<i32> = -89_999..=93_599;

/// Checks the structure of TZif bytes: the headers, the lengths, ascending transitions, type
/// indices and offsets in range, and a footer that is a valid POSIX TZ string (version 2 and
/// later). jiff then reads the data.
fn check_tzif(bytes: &[u8]) -> Result<(), String> {
    let mut r = Reader { bytes, pos: 0 };
    let first = Header::read(&mut r)?;
    let (header, time_size) = if first.version == 1 {
        (first, 4)
    } else {
        // Skip the 32-bit data for the 64-bit header and data that follow.
        let len = first.block_len(4).ok_or("version 1 data block too large")?;
        r.take(len, "version 1 data block")?;
        (Header::read(&mut r)?, 8)
    };
    if header.typecnt == 0 {
        return Err("no local time types: expected at least one".to_owned());
    }
    let len = header.block_len(time_size).ok_or("data block too large")?;
    if len > bytes.len() - r.pos {
        return Err(format!("truncated data block: expected {len} bytes, found {}", bytes.len() - r.pos));
    }
    let times = r.take(header.timecnt * time_size, "transition times")?;
    let indices = r.take(header.timecnt, "transition types")?;
    let types = r.take(header.typecnt * 6, "local time types")?;
    r.take(len - times.len() - indices.len() - types.len(), "abbreviations, leap seconds and indicators")?;

    let transitions: Vec<i64> = times
        .chunks_exact(time_size)
        .map(|chunk| match *chunk {
            [a, b, c, d] => i64::from(i32::from_be_bytes([a, b, c, d])),
            [a, b, c, d, e, f, g, h] => i64::from_be_bytes([a, b, c, d, e, f, g, h]),
            _ => 0,
        })
        .collect();
    if transitions.windows(2).any(|pair| pair[0] >= pair[1]) {
        return Err("transition times not in strictly ascending order".to_owned());
    }
    if let Some(&index) = indices.iter().find(|&&index| usize::from(index) >= header.typecnt) {
        return Err(format!("transition type {index} out of range: expected 0 to {}", header.typecnt - 1));
    }
    for chunk in types.chunks_exact(6) {
        let offset = i32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        if !TZIF_OFFSETS.contains(&offset) {
            return Err(format!("utc offset {offset} s out of range: expected -89999 to 93599"));
        }
    }
    if header.version > 1 {
        let text = bytes[r.pos..]
            .strip_prefix(b"\n")
            .and_then(|rest| rest.iter().position(|&b| b == b'\n').map(|end| &rest[..end]))
            .ok_or("missing footer: expected a POSIX TZ string between newlines after the data")?;
        let text = std::str::from_utf8(text).map_err(|_| "footer is not utf-8: expected a POSIX TZ string")?;
        if !text.is_empty() {
            jiff::tz::TimeZone::posix(text).map_err(|e| format!("invalid footer {text:?}: {e}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i32, mo: u8, d: u8, h: u8, mi: u8) -> DbTime {
        DbTime(CivilDateTime::new(y, mo, d, h, mi, 0).unwrap().to_unix_seconds() * 1000)
    }

    fn civil(y: i32, mo: u8, d: u8, h: u8, mi: u8) -> CivilDateTime {
        CivilDateTime::new(y, mo, d, h, mi, 0).unwrap()
    }

    #[test]
    fn zone_names() {
        for good in ["Europe/Paris", "America/Argentina/Buenos_Aires", "Etc/GMT+5", "America/Port-au-Prince", "UTC"] {
            assert_eq!(zone_path(good).unwrap(), Path::new(good));
        }
        for bad in
            ["", "/etc/passwd", "../etc/passwd", "Europe/../../etc", "Europe//Paris", "Europe/", "a b", "Éire", "x\0"]
        {
            let err = zone_path(bad).unwrap_err();
            assert!(err.to_string().starts_with("invalid time zone name"), "{err}");
        }
        assert!(zone_path(&"a".repeat(256)).is_err());
    }

    #[test]
    fn zone_ids() {
        assert_eq!(ZoneId::parse("UTC"), Ok(ZoneId::Utc));
        assert_eq!(ZoneId::parse("+02:00"), Ok(ZoneId::Fixed(UtcOffset(7200))));
        assert_eq!(ZoneId::parse("-05:30"), Ok(ZoneId::Fixed(UtcOffset(-19_800))));
        assert_eq!(ZoneId::parse("Europe/Paris"), Ok(ZoneId::Named("Europe/Paris".into())));
        assert_eq!(ZoneId::parse("-05:30").unwrap().to_string(), "-05:30");
        for bad in ["+2:00", "+24:00", "+02:60", "+0200", "-05:30:00", "+"] {
            assert_eq!(ZoneId::parse(bad), Err(TzError::InvalidOffset(bad.into())), "{bad}");
        }
        assert!(ZoneId::parse("../x").is_err());
        assert_eq!(ZoneId::Utc.builtin(), Some(TimeZone::Utc));
        assert_eq!(ZoneId::Named("Europe/Paris".into()).file_path(), Some(Path::new("Europe/Paris")));
        assert_eq!(UtcOffset(-3661).to_string(), "-01:01:01");
    }

    #[test]
    fn fixed_offsets_convert_both_ways() {
        let tz = TimeZone::Fixed(UtcOffset(-19_800));
        let t = at(2026, 1, 1, 12, 0);
        let local = tz.to_local(t);
        assert_eq!(local.to_string(), "2026-01-01T06:30:00-05:30");
        assert_eq!(tz.to_utc(local.datetime), Some(LocalResult::Single(t)));
        assert_eq!(tz.next_transition(t), None);
    }

    #[test]
    fn posix_rules_of_europe_and_new_york() {
        let paris = TimeZone::from_posix_tz("Paris", "CET-1CEST,M3.5.0,M10.5.0/3").unwrap();
        // 2026: summer time from March 29 01:00 UTC to October 25 01:00 UTC.
        assert_eq!(paris.offset_at(DbTime(at(2026, 3, 29, 1, 0).0 - 1)), UtcOffset(3600));
        assert_eq!(paris.offset_at(at(2026, 3, 29, 1, 0)), UtcOffset(7200));
        assert_eq!(paris.offset_at(DbTime(at(2026, 10, 25, 1, 0).0 - 1)), UtcOffset(7200));
        assert_eq!(paris.offset_at(at(2026, 10, 25, 1, 0)), UtcOffset(3600));
        assert_eq!(paris.next_transition(at(2026, 1, 1, 0, 0)), Some(at(2026, 3, 29, 1, 0)));
        assert_eq!(paris.next_transition(at(2026, 3, 29, 1, 0)), Some(at(2026, 10, 25, 1, 0)));
        assert_eq!(paris.next_transition(at(2026, 10, 25, 1, 0)), Some(at(2027, 3, 28, 1, 0)));

        let new_york = TimeZone::from_posix_tz("New York", "EST5EDT,M3.2.0,M11.1.0").unwrap();
        assert_eq!(new_york.next_transition(at(2026, 1, 1, 0, 0)), Some(at(2026, 3, 8, 7, 0)));
        assert_eq!(new_york.next_transition(at(2026, 3, 8, 7, 0)), Some(at(2026, 11, 1, 6, 0)));
        assert_eq!(new_york.to_utc(civil(2026, 3, 8, 2, 30)), Some(LocalResult::Gap { after: at(2026, 3, 8, 7, 0) }));
        assert_eq!(
            new_york.to_utc(civil(2026, 11, 1, 1, 30)),
            Some(LocalResult::Ambiguous { earlier: at(2026, 11, 1, 5, 30), later: at(2026, 11, 1, 6, 30) })
        );
        assert_eq!(new_york.to_local(at(2026, 11, 1, 6, 30)).to_string(), "2026-11-01T01:30:00-05:00");
    }

    #[test]
    fn posix_date_forms() {
        // Julian day 60 is March 1 with or without February 29.
        let j = TimeZone::from_posix_tz("J", "AAA0BBB,J60/0,J300/0").unwrap();
        assert_eq!(j.next_transition(at(2024, 1, 1, 0, 0)), Some(at(2024, 3, 1, 0, 0)));
        assert_eq!(j.next_transition(at(2025, 1, 1, 0, 0)), Some(at(2025, 3, 1, 0, 0)));
        // Zero-based day 59 is February 29 in a leap year, March 1 otherwise.
        let n = TimeZone::from_posix_tz("N", "AAA0BBB,59/0,300/0").unwrap();
        assert_eq!(n.next_transition(at(2024, 1, 1, 0, 0)), Some(at(2024, 2, 29, 0, 0)));
        assert_eq!(n.next_transition(at(2025, 1, 1, 0, 0)), Some(at(2025, 3, 1, 0, 0)));
        // Quoted names, minutes in offsets, no daylight time.
        let tehran = TimeZone::from_posix_tz("Tehran", "<+0330>-3:30").unwrap();
        assert_eq!(tehran.offset_at(at(2040, 6, 1, 0, 0)), UtcOffset(12_600));
        assert_eq!(tehran.next_transition(at(2040, 6, 1, 0, 0)), None);
        // Southern hemisphere: daylight time across the new year.
        let sydney = TimeZone::from_posix_tz("Sydney", "AEST-10AEDT,M10.1.0,M4.1.0/3").unwrap();
        assert_eq!(sydney.offset_at(at(2026, 1, 15, 0, 0)), UtcOffset(39_600));
        assert_eq!(sydney.offset_at(at(2026, 7, 15, 0, 0)), UtcOffset(36_000));
        // Daylight time all year (RFC 9636's example). jiff 1.0.2 still shows standard time
        // from January 1 00:00 UTC to 00:00 local, and a transition at each end of it (real
        // zones have such footers only in rearguard builds, Africa/Casablanca after 2087).
        let always = TimeZone::from_posix_tz("Always", "XXX3EDT4,0/0,J365/23").unwrap();
        for month in 1..=12 {
            assert_eq!(always.offset_at(at(2026, month, 15, 12, 0)), UtcOffset(-14_400), "{month}");
        }
        // A negative transition time and hours past 24 (RFC 8536 extensions).
        let godthab = TimeZone::from_posix_tz("Nuuk", "<-02>2<-01>,M3.5.0/-1,M10.5.0/0").unwrap();
        assert_eq!(godthab.next_transition(at(2026, 1, 1, 0, 0)), Some(at(2026, 3, 29, 1, 0)));
        assert!(TimeZone::from_posix_tz("x", "AAA3BBB,M3.2.0/167,M11.1.0").is_ok());
        // Daylight time without a rule is refused (POSIX leaves its dates unspecified).
        let err = TimeZone::from_posix_tz("US", "EST5EDT").unwrap_err();
        assert!(err.to_string().starts_with("invalid posix tz string \"EST5EDT\""), "{err}");
    }

    #[test]
    fn bad_posix_strings_are_errors() {
        for bad in [
            "",
            "C",
            "CET",
            "CET-",
            "CET-25",
            "CET-1CEST,M3.5.0",
            "CET-1CEST,M13.5.0,M10.5.0",
            "CET-1CEST,M3.6.0,M10.5.0",
            "CET-1CEST,M3.5.7,M10.5.0",
            "CET-1CEST,J0,J365",
            "CET-1CEST,366,1",
            "<+03",
            "<>3",
            "CET-1CEST,M3.5.0/168,M10.5.0",
            "CET-1:60",
            "CET-1 ",
            "CET-1CEST,M3.5.0,M10.5.0/3x",
        ] {
            let err = TimeZone::from_posix_tz("x", bad).unwrap_err();
            assert!(err.to_string().starts_with("invalid posix tz string"), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_tzif_is_an_error_not_a_panic() {
        let cases: [&[u8]; 5] = [b"", b"TZif", b"NOPE0000000000000000000000000000000000000000", &[0; 44], b"TZif5"];
        for bytes in cases {
            assert!(matches!(TimeZone::from_tzif("x", bytes), Err(TzError::InvalidTzif { .. })), "{bytes:?}");
        }
        let mut huge = b"TZif2".to_vec();
        huge.extend([0; 15]);
        huge.extend([0xff; 24]);
        assert!(TimeZone::from_tzif("x", &huge).is_err());
    }
}
