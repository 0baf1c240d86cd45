//! Time zones, pure: UTC, fixed offsets, and the rules of a zone read from TZif bytes (RFC 8536
//! versions 1 to 4) with its POSIX TZ footer for instants after the last transition.
//!
//! Nothing here reads a file. An I/O adapter reads `/usr/share/zoneinfo/<name>` (or
//! `$TZDIR/<name>`) after checking the name with [`zone_path`], and hands the bytes to
//! [`TimeZone::from_tzif`].
//!
//! Leap-second records of TZif data are skipped: instants are Unix time, as everywhere in
//! Canter, so the `right/` zones are not meaningful here.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::DbTime;
use super::civil::{CivilDateTime, civil_from_days, days_from_civil, days_in_month, is_leap_year, weekday_from_days};

const SECS_PER_DAY: i64 = 86_400;

/// How far around an instant the zone searches for transitions when converting local time:
/// more than any UTC offset plus any overlap of real zones.
const WINDOW_SECS: i64 = 3 * SECS_PER_DAY;

/// The most transitions looked at in one window (real zones have at most a few).
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
    /// The rules of a zone, from its TZif data.
    Rules(Arc<ZoneRules>),
}

/// The rules of one zone: its transitions and the POSIX TZ rule after the last of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ZoneRules {
    name: String,
    /// Transition instants (Unix seconds), strictly ascending.
    transitions: Vec<i64>,
    /// The offset from each transition on.
    offsets: Vec<i32>,
    /// The offset before the first transition (local time type 0).
    initial: i32,
    /// The rule after the last transition.
    footer: Option<PosixTz>,
}

impl ZoneRules {
    /// The zone's name, as given when it was loaded.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl TimeZone {
    /// Reads a zone from TZif bytes (RFC 8536, versions 1 to 4: the 64-bit data of version 2
    /// and later and its POSIX TZ footer). `name` is the zone's name (`Europe/Paris`), kept
    /// for [`TimeZone::id`] and messages.
    pub fn from_tzif(name: &str, bytes: &[u8]) -> Result<TimeZone, TzError> {
        let rules =
            parse_tzif(name, bytes).map_err(|problem| TzError::InvalidTzif { name: name.to_owned(), problem })?;
        Ok(TimeZone::Rules(Arc::new(rules)))
    }

    /// A zone named `name` that follows the POSIX TZ rule `spec` at all times (for example
    /// `CET-1CEST,M3.5.0,M10.5.0/3`).
    pub fn from_posix_tz(name: &str, spec: &str) -> Result<TimeZone, TzError> {
        let footer =
            PosixTz::parse(spec).map_err(|problem| TzError::InvalidPosixTz { text: spec.to_owned(), problem })?;
        let initial = footer.std;
        let rules = ZoneRules {
            name: name.to_owned(),
            transitions: Vec::new(),
            offsets: Vec::new(),
            initial,
            footer: Some(footer),
        };
        Ok(TimeZone::Rules(Arc::new(rules)))
    }

    /// What this zone is, as configured: `UTC`, its fixed offset, or its name.
    pub fn id(&self) -> ZoneId {
        match self {
            TimeZone::Utc => ZoneId::Utc,
            TimeZone::Fixed(offset) => ZoneId::Fixed(*offset),
            TimeZone::Rules(rules) => ZoneId::Named(rules.name.clone()),
        }
    }

    /// The offset from UTC in effect at `at`.
    pub fn offset_at(&self, at: DbTime) -> UtcOffset {
        UtcOffset(self.offset_secs(at.0.div_euclid(1000)))
    }

    /// The local date-time at `at` (milliseconds are dropped: the second is rounded down).
    pub fn to_local(&self, at: DbTime) -> LocalDateTime {
        let utc = at.0.div_euclid(1000);
        let offset = self.offset_secs(utc);
        // A DbTime's year is within ±300 million, so the conversion cannot fail.
        let datetime = CivilDateTime::from_unix_seconds(utc + i64::from(offset)).unwrap_or(CivilDateTime::EPOCH);
        LocalDateTime { datetime, offset: UtcOffset(offset) }
    }

    /// The instants the local time `local` names: one, two (an overlap) or none (a gap).
    /// `None` when they lie outside the range of [`DbTime`].
    pub fn to_utc(&self, local: CivilDateTime) -> Option<LocalResult> {
        let (first, last, gap) = self.local_candidates(local.to_unix_seconds())?;
        let ms = |secs: i64| secs.checked_mul(1000).map(DbTime);
        Some(match (first, last) {
            (Some(a), Some(b)) if a != b => LocalResult::Ambiguous { earlier: ms(a)?, later: ms(b)? },
            (Some(a), _) => LocalResult::Single(ms(a)?),
            _ => LocalResult::Gap { after: ms(gap)? },
        })
    }

    /// The instant a schedule fires at for the local time `local`: the only one, the first
    /// of two in an overlap, or the first instant after a gap. `None` outside the range of
    /// [`DbTime`].
    pub fn resolve(&self, local: CivilDateTime) -> Option<DbTime> {
        self.to_utc(local).map(LocalResult::earliest)
    }

    /// [`resolve`](Self::resolve) for local seconds since 1970-01-01 00:00:00 local.
    pub(crate) fn resolve_local(&self, local: i64) -> Option<DbTime> {
        let (first, _, gap) = self.local_candidates(local)?;
        first.unwrap_or(gap).checked_mul(1000).map(DbTime)
    }

    /// The first instant strictly after `after` at which the offset changes.
    pub fn next_transition(&self, after: DbTime) -> Option<DbTime> {
        let (at, _) = self.next_transition_secs(after.0.div_euclid(1000))?;
        at.checked_mul(1000).map(DbTime)
    }

    fn offset_secs(&self, utc: i64) -> i32 {
        match self {
            TimeZone::Utc => 0,
            TimeZone::Fixed(offset) => offset.0,
            TimeZone::Rules(rules) => rules.offset_secs(utc),
        }
    }

    /// The first transition strictly after `utc`, with the offset from then on.
    fn next_transition_secs(&self, utc: i64) -> Option<(i64, i32)> {
        match self {
            TimeZone::Utc | TimeZone::Fixed(_) => None,
            TimeZone::Rules(rules) => rules.next_transition(utc),
        }
    }

    /// The transitions in `(from, to]`: instant, offset before, offset after.
    fn transitions_in(&self, from: i64, to: i64) -> Vec<(i64, i32, i32)> {
        let mut out = Vec::new();
        let mut before = self.offset_secs(from);
        let mut cursor = from;
        while out.len() < MAX_WINDOW_TRANSITIONS {
            match self.next_transition_secs(cursor) {
                Some((at, after)) if at <= to && at > cursor => {
                    out.push((at, before, after));
                    before = after;
                    cursor = at;
                }
                _ => break,
            }
        }
        out
    }

    /// The latest local time (seconds since 1970-01-01 00:00:00 local) shown at any instant
    /// up to `utc`: the local time at `utc`, or higher just after clocks were set back.
    pub(crate) fn high_water_local(&self, utc: i64) -> Option<i64> {
        let mut high = utc.checked_add(i64::from(self.offset_secs(utc)))?;
        for (at, before, _) in self.transitions_in(utc.checked_sub(WINDOW_SECS)?, utc) {
            high = high.max(at - 1 + i64::from(before));
        }
        Some(high)
    }

    /// For local seconds `local`: the first and last instants (Unix seconds) showing it, and
    /// the end of the gap it falls in when none does.
    fn local_candidates(&self, local: i64) -> Option<(Option<i64>, Option<i64>, i64)> {
        let from = local.checked_sub(WINDOW_SECS)?;
        let to = local.checked_add(WINDOW_SECS)?;
        let transitions = self.transitions_in(from, to);
        let mut offsets = vec![self.offset_secs(from)];
        offsets.extend(transitions.iter().map(|&(_, _, after)| after));
        let mut valid: Vec<i64> = offsets
            .iter()
            .map(|&offset| local - i64::from(offset))
            .filter(|&utc| i64::from(self.offset_secs(utc)) == local - utc)
            .collect();
        valid.sort_unstable();
        let gap_end = transitions
            .iter()
            .find(|&&(at, before, after)| at + i64::from(before) <= local && local < at + i64::from(after))
            .map(|&(at, _, _)| at)
            // Not reached for consistent data: read the local time with the offset at itself.
            .unwrap_or_else(|| local - i64::from(self.offset_secs(local)));
        Some((valid.first().copied(), valid.last().copied(), gap_end))
    }
}

impl fmt::Display for TimeZone {
    /// `UTC`, the offset (`+02:00`) or the zone's name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.id().fmt(f)
    }
}

impl ZoneRules {
    fn offset_secs(&self, utc: i64) -> i32 {
        let index = self.transitions.partition_point(|&at| at <= utc);
        if index == self.transitions.len() {
            if let Some(footer) = &self.footer {
                return footer.offset_secs(utc);
            }
        }
        match index.checked_sub(1) {
            Some(i) => self.offsets.get(i).copied().unwrap_or(self.initial),
            None => self.initial,
        }
    }

    fn next_transition(&self, utc: i64) -> Option<(i64, i32)> {
        let index = self.transitions.partition_point(|&at| at <= utc);
        match (self.transitions.get(index), self.offsets.get(index)) {
            (Some(&at), Some(&offset)) => Some((at, offset)),
            _ => self.footer.as_ref()?.next_transition(utc),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TZif
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

fn parse_tzif(name: &str, bytes: &[u8]) -> Result<ZoneRules, String> {
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
    r.take(header.charcnt, "abbreviations")?;
    r.take(header.leapcnt * (time_size + 4), "leap seconds")?;
    r.take(header.isstdcnt + header.isutcnt, "indicators")?;

    let mut offsets_of_types = Vec::with_capacity(header.typecnt);
    for chunk in types.chunks_exact(6) {
        let offset = i32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        if !TZIF_OFFSETS.contains(&offset) {
            return Err(format!("utc offset {offset} s out of range: expected -89999 to 93599"));
        }
        offsets_of_types.push(offset);
    }
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
    let mut offsets = Vec::with_capacity(transitions.len());
    for &index in indices {
        let offset = offsets_of_types
            .get(usize::from(index))
            .ok_or_else(|| format!("transition type {index} out of range: expected 0 to {}", header.typecnt - 1))?;
        offsets.push(*offset);
    }

    let footer = if header.version == 1 {
        None
    } else {
        let rest = &bytes[r.pos..];
        let text = rest
            .strip_prefix(b"\n")
            .and_then(|rest| rest.iter().position(|&b| b == b'\n').map(|end| &rest[..end]))
            .ok_or("missing footer: expected a POSIX TZ string between newlines after the data")?;
        let text = std::str::from_utf8(text).map_err(|_| "footer is not utf-8: expected a POSIX TZ string")?;
        if text.is_empty() {
            None
        } else {
            Some(PosixTz::parse(text).map_err(|problem| format!("invalid footer {text:?}: {problem}"))?)
        }
    };
    Ok(ZoneRules { name: name.to_owned(), transitions, offsets, initial: offsets_of_types[0], footer })
}

// ---------------------------------------------------------------------------------------------
// POSIX TZ strings
// ---------------------------------------------------------------------------------------------

/// A POSIX TZ rule: a standard offset and maybe daylight saving time between two yearly dates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PosixTz {
    /// The standard offset, seconds east.
    std: i32,
    dst: Option<PosixDst>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PosixDst {
    /// The daylight offset, seconds east.
    offset: i32,
    /// When it starts, in standard local time.
    start: RuleDate,
    start_time: i32,
    /// When it ends, in daylight local time.
    end: RuleDate,
    end_time: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RuleDate {
    /// `Jn`: day 1–365, February 29 never counted.
    Julian1(u16),
    /// `n`: day 0–365, February 29 counted in leap years.
    Julian0(u16),
    /// `Mm.w.d`: weekday `d` (0 = Sunday) of week `w` (1–5, 5 = the last) of month `m`.
    MonthWeekDay { month: u8, week: u8, weekday: u8 },
}

impl RuleDate {
    /// Days since 1970-01-01 of this date in `year`.
    fn days_in(self, year: i64) -> i64 {
        let jan1 = days_from_civil(year, 1, 1);
        match self {
            RuleDate::Julian1(n) => jan1 + i64::from(n) - 1 + i64::from(is_leap_year(year) && n >= 60),
            RuleDate::Julian0(n) => jan1 + i64::from(n),
            RuleDate::MonthWeekDay { month, week, weekday } => {
                let first = days_from_civil(year, month, 1);
                let first_match = first + (i64::from(weekday) - i64::from(weekday_from_days(first))).rem_euclid(7);
                let mut day = first_match + 7 * (i64::from(week) - 1);
                let month_end = first + i64::from(days_in_month(year, month));
                while day >= month_end {
                    day -= 7;
                }
                day
            }
        }
    }
}

impl PosixTz {
    fn parse(text: &str) -> Result<PosixTz, String> {
        let mut p = PosixParser { s: text.as_bytes(), i: 0 };
        p.name()?;
        let std = -p.hms(24, "a standard offset like 5, -1 or -3:30")?;
        if p.done() {
            return Ok(PosixTz { std, dst: None });
        }
        p.name()?;
        let offset = if p.done() || p.peek() == Some(b',') { std + 3600 } else { -p.hms(24, "a daylight offset")? };
        // Without a rule POSIX leaves the dates to the implementation; use the US rule, as
        // glibc does.
        let (start, start_time, end, end_time) = if p.done() {
            (
                RuleDate::MonthWeekDay { month: 3, week: 2, weekday: 0 },
                7200,
                RuleDate::MonthWeekDay { month: 11, week: 1, weekday: 0 },
                7200,
            )
        } else {
            p.expect(b',', "a ',' before the start date")?;
            let (start, start_time) = p.rule()?;
            p.expect(b',', "a ',' before the end date")?;
            let (end, end_time) = p.rule()?;
            (start, start_time, end, end_time)
        };
        if !p.done() {
            return Err(format!("unexpected text {:?} at the end", &text[p.i..]));
        }
        Ok(PosixTz { std, dst: Some(PosixDst { offset, start, start_time, end, end_time }) })
    }

    /// The state changes of years `from..=to`: instant and whether daylight time follows,
    /// sorted, with changes at the same instant merged into one.
    fn changes(&self, dst: &PosixDst, from: i64, to: i64) -> Vec<(i64, bool)> {
        let mut events = Vec::with_capacity(2 * usize::try_from(to - from + 1).unwrap_or(0));
        for year in from..=to {
            let start = dst.start.days_in(year) * SECS_PER_DAY + i64::from(dst.start_time) - i64::from(self.std);
            let end = dst.end.days_in(year) * SECS_PER_DAY + i64::from(dst.end_time) - i64::from(dst.offset);
            events.push((start, true));
            events.push((end, false));
        }
        // At equal instants an end sorts before a start: DST all year (`J1/0,J365/25`) stays on.
        events.sort_unstable();
        let mut merged: Vec<(i64, bool)> = Vec::with_capacity(events.len());
        for (at, on) in events {
            match merged.last_mut() {
                Some(last) if last.0 == at => last.1 = on,
                _ => merged.push((at, on)),
            }
        }
        merged
    }

    fn year_of(&self, utc: i64) -> i64 {
        civil_from_days((utc + i64::from(self.std)).div_euclid(SECS_PER_DAY)).0
    }

    fn offset_secs(&self, utc: i64) -> i32 {
        let Some(dst) = &self.dst else { return self.std };
        let year = self.year_of(utc);
        let changes = self.changes(dst, year - 2, year + 1);
        let on = changes.iter().rev().find(|&&(at, _)| at <= utc).is_some_and(|&(_, on)| on);
        if on { dst.offset } else { self.std }
    }

    fn next_transition(&self, utc: i64) -> Option<(i64, i32)> {
        let dst = self.dst.as_ref()?;
        if dst.offset == self.std {
            return None;
        }
        let year = self.year_of(utc);
        // A change can repeat the state before it (at the edge of the years computed, or
        // when daylight time lasts all year): keep only those that change the offset.
        self.changes(dst, year - 2, year + 2)
            .into_iter()
            .map(|(at, _)| at)
            .filter(|&at| at > utc)
            .find(|&at| self.offset_secs(at) != self.offset_secs(at - 1))
            .map(|at| (at, self.offset_secs(at)))
    }
}

struct PosixParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl PosixParser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn expect(&mut self, byte: u8, what: &str) -> Result<(), String> {
        if self.peek() == Some(byte) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected {what} at byte {}", self.i))
        }
    }

    /// A zone abbreviation: three or more letters, or `<...>` of letters, digits, `+`, `-`.
    fn name(&mut self) -> Result<(), String> {
        let start = self.i;
        if self.peek() == Some(b'<') {
            self.i += 1;
            while let Some(b) = self.peek() {
                if b == b'>' {
                    break;
                }
                if !(b.is_ascii_alphanumeric() || b == b'+' || b == b'-') {
                    return Err(format!(
                        "unexpected {:?} in a <...> name at byte {}: expected letters, digits, + or -",
                        b as char, self.i
                    ));
                }
                self.i += 1;
            }
            self.expect(b'>', "a '>' closing the <...> name")?;
            if self.i - start < 3 {
                return Err(format!("empty <> name at byte {start}: expected a name inside"));
            }
        } else {
            while self.peek().is_some_and(|b| b.is_ascii_alphabetic()) {
                self.i += 1;
            }
            if self.i - start < 3 {
                return Err(format!("expected a zone abbreviation of at least 3 letters at byte {start}"));
            }
        }
        Ok(())
    }

    /// Up to `max_digits` decimal digits.
    fn number(&mut self, max_digits: usize) -> Option<i32> {
        let start = self.i;
        let mut n = 0i32;
        while self.i - start < max_digits {
            match self.peek() {
                Some(b) if b.is_ascii_digit() => {
                    n = n * 10 + i32::from(b - b'0');
                    self.i += 1;
                }
                _ => break,
            }
        }
        (self.i > start).then_some(n)
    }

    /// `[+-]hh[:mm[:ss]]` with hours up to `max_hours`, in seconds.
    fn hms(&mut self, max_hours: i32, what: &str) -> Result<i32, String> {
        let at = self.i;
        let sign = match self.peek() {
            Some(b'-') => {
                self.i += 1;
                -1
            }
            Some(b'+') => {
                self.i += 1;
                1
            }
            _ => 1,
        };
        let bad = || format!("expected {what} ([+-]hh[:mm[:ss]], hours at most {max_hours}) at byte {at}");
        let hours = self.number(3).filter(|&h| h <= max_hours).ok_or_else(bad)?;
        let mut seconds = hours * 3600;
        for scale in [60, 1] {
            if self.peek() != Some(b':') {
                break;
            }
            self.i += 1;
            let part = self.number(2).filter(|&n| n < 60).ok_or_else(bad)?;
            seconds += part * scale;
        }
        Ok(sign * seconds)
    }

    /// `date[/time]`.
    fn rule(&mut self) -> Result<(RuleDate, i32), String> {
        let at = self.i;
        let date = match self.peek() {
            Some(b'J') => {
                self.i += 1;
                let n = self.number(3).filter(|n| (1..=365).contains(n));
                RuleDate::Julian1(n.ok_or_else(|| format!("expected Jn with n 1 to 365 at byte {at}"))? as u16)
            }
            Some(b'M') => {
                self.i += 1;
                let bad = || format!("expected Mm.w.d (month 1-12, week 1-5, weekday 0-6) at byte {at}");
                let month = self.number(2).filter(|m| (1..=12).contains(m)).ok_or_else(bad)?;
                self.expect(b'.', "a '.' after the month")?;
                let week = self.number(1).filter(|w| (1..=5).contains(w)).ok_or_else(bad)?;
                self.expect(b'.', "a '.' after the week")?;
                let weekday = self.number(1).filter(|d| (0..=6).contains(d)).ok_or_else(bad)?;
                RuleDate::MonthWeekDay { month: month as u8, week: week as u8, weekday: weekday as u8 }
            }
            _ => {
                let n = self.number(3).filter(|n| (0..=365).contains(n));
                RuleDate::Julian0(n.ok_or_else(|| format!("expected a date Jn, n or Mm.w.d at byte {at}"))? as u16)
            }
        };
        let time = if self.peek() == Some(b'/') {
            self.i += 1;
            self.hms(167, "a transition time")?
        } else {
            7200
        };
        Ok((date, time))
    }
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
        // Daylight time all year.
        let always = TimeZone::from_posix_tz("Always", "EST5EDT,0/0,J365/25").unwrap();
        for month in 1..=12 {
            assert_eq!(always.offset_at(at(2026, month, 1, 0, 0)), UtcOffset(-14_400), "{month}");
        }
        assert_eq!(always.next_transition(at(2026, 1, 1, 0, 0)), None);
        // A negative transition time and hours past 24 (RFC 8536 extensions).
        let godthab = TimeZone::from_posix_tz("Nuuk", "<-02>2<-01>,M3.5.0/-1,M10.5.0/0").unwrap();
        assert_eq!(godthab.next_transition(at(2026, 1, 1, 0, 0)), Some(at(2026, 3, 29, 1, 0)));
        assert!(TimeZone::from_posix_tz("x", "AAA3BBB,M3.2.0/167,M11.1.0").is_ok());
        // Daylight time without a rule takes the US dates.
        let us = TimeZone::from_posix_tz("US", "EST5EDT").unwrap();
        assert_eq!(us.next_transition(at(2026, 1, 1, 0, 0)), Some(at(2026, 3, 8, 7, 0)));
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
