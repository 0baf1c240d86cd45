//! Times on the command line: RFC 3339 in and out.

use canter_tokio::canter::schedule::TimeZone;
use canter_tokio::canter::store::DbTime;

/// Milliseconds since the epoch of `YYYY-MM-DDTHH:MM:SS[.fff]Z`.
pub(crate) fn parse_rfc3339(text: &str) -> Option<DbTime> {
    let text = text.strip_suffix('Z').or_else(|| text.strip_suffix("+00:00"))?;
    let (date, time) = text.split_once(['T', ' '])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    if fraction.is_empty() || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let millis: i64 = format!("{fraction:0<3}")[..3].parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(DbTime(((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + millis))
}

/// `t` in RFC 3339, UTC.
pub(crate) fn format_rfc3339(t: DbTime) -> String {
    TimeZone::Utc.to_local(t).to_string()
}
