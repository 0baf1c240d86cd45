//! Command-line parsing for the `canter` program: `--name value`, `--name=value`, switches and
//! positional arguments, with every unknown flag refused.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

/// A usage error: the program prints it with the command's help and exits with 2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Parsed arguments of one command.
#[derive(Debug, Default)]
pub struct Args {
    /// Positional arguments in order.
    pub positional: Vec<String>,
    /// `--name value` flags (the last value wins for repeated flags).
    pub values: BTreeMap<String, String>,
    /// `--name` switches.
    pub switches: BTreeSet<String>,
}

impl Args {
    /// Parses `raw` accepting the value flags in `values` and the switches in `switches`;
    /// `open` accepts any other `--name value` too (config fields).
    pub fn parse(raw: &[String], values: &[&str], switches: &[&str], open: bool) -> Result<Args, UsageError> {
        let mut args = Args::default();
        let mut iter = raw.iter();
        while let Some(arg) = iter.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                args.positional.push(arg.clone());
                continue;
            };
            let (name, inline) = match flag.split_once('=') {
                Some((name, value)) => (name, Some(value.to_owned())),
                None => (flag, None),
            };
            if switches.contains(&name) {
                if inline.is_some() {
                    return Err(UsageError(format!("--{name} takes no value")));
                }
                args.switches.insert(name.to_owned());
            } else if values.contains(&name) || open {
                let value = match inline {
                    Some(value) => value,
                    None => iter.next().cloned().ok_or_else(|| UsageError(format!("--{name} needs a value")))?,
                };
                args.values.insert(name.to_owned(), value);
            } else {
                return Err(UsageError(format!("unknown option --{name}")));
            }
        }
        Ok(args)
    }

    /// The value of `--name`, if given.
    pub fn value(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// Whether `--name` was given.
    pub fn switch(&self, name: &str) -> bool {
        self.switches.contains(name)
    }

    /// The value of `--name` parsed as `T`.
    pub fn parsed<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, UsageError>
    where
        T::Err: std::fmt::Display,
    {
        self.value(name).map(|v| v.parse::<T>().map_err(|e| UsageError(format!("--{name} {v:?}: {e}")))).transpose()
    }
}

/// `base` with every flag of `values` laid over it, each named after a configuration setting
/// (`--prefetch-buffer 4` sets `app.prefetch_buffer`); flags in `skip` are left alone.
pub fn config_with_flags(
    base: &canter::config::Config,
    values: &BTreeMap<String, String>,
    skip: &[&str],
) -> Result<canter::config::Config, UsageError> {
    use serde_json::Value;
    let internal = |e: serde_json::Error| UsageError(format!("configuration: {e}"));
    let mut json = serde_json::to_value(base).map_err(internal)?;
    let defaults = serde_json::to_value(canter::config::Config::default()).map_err(internal)?;
    for (flag, value) in values {
        if skip.contains(&flag.as_str()) {
            continue;
        }
        let field = flag.replace('-', "_");
        let section = [&["worker"][..], &["app"], &["app", "recovery"], &["app", "resilience"], &["app", "retry"]]
            .into_iter()
            .find(|path| {
                let mut node = &defaults;
                for key in *path {
                    node = &node[*key];
                }
                node.as_object().is_some_and(|o| o.contains_key(&field))
                    || (path == &["app"] && ["cluster_wide_cap", "claim_lease_ms"].contains(&field.as_str()))
                    || (path == &["worker"] && field == "seed")
                    || (path == &["app", "recovery"]
                        && ["finished_retention_ms", "idempotency_retention_ms"].contains(&field.as_str()))
            })
            .ok_or_else(|| UsageError(format!("unknown option --{flag}: not a configuration setting")))?;
        let parsed = if field == "queues" {
            Value::from(value.split(',').filter(|q| !q.is_empty()).map(str::to_owned).collect::<Vec<_>>())
        } else {
            serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.clone()))
        };
        let mut node = &mut json;
        for key in section {
            node = &mut node[*key];
        }
        node[field.as_str()] = parsed;
    }
    canter::config::Config::from_json_str(&json.to_string()).map_err(|e| UsageError(e.to_string()))
}

/// A duration like `500ms`, `10s`, `2m`, `1h`, `30d` or a bare number of seconds, at most
/// [`MAX_DURATION_MS`](canter::postgres::MAX_DURATION_MS) (about 3,170 years, the longest the
/// database stores): every duration of the program fits in milliseconds and in the clock.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, UsageError> {
    let seconds = duration_seconds(text)?;
    let max_secs = canter::postgres::MAX_DURATION_MS / 1000;
    if seconds > max_secs as f64 {
        return Err(UsageError(format!(
            "invalid duration {:?}: expected at most {max_secs}s (about 3170 years)",
            text.trim()
        )));
    }
    std::time::Duration::try_from_secs_f64(seconds).map_err(|_| UsageError(format!("invalid duration {text:?}")))
}

/// Whether `text` is written as a duration (whatever its length), not as something else.
pub fn is_duration(text: &str) -> bool {
    duration_seconds(text).is_ok()
}

/// The seconds a duration's text says, unbounded.
fn duration_seconds(text: &str) -> Result<f64, UsageError> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 =
        number.parse().map_err(|_| UsageError(format!("invalid duration {text:?}: expected e.g. 500ms, 10s, 2m")))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86_400.0,
        _ => return Err(UsageError(format!("invalid duration unit {unit:?}: expected ms, s, m, h or d"))),
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(UsageError(format!("invalid duration {text:?}")));
    }
    Ok(seconds)
}

/// Ends the program because its output's reader went away, with status 141 (128 + SIGPIPE),
/// as Unix tools do.
pub fn exit_output_closed() -> ! {
    std::process::exit(141)
}

/// Writes one line of the program's output to stdout. When the reader has gone away
/// (`canter list | head`), the program ends quietly ([`exit_output_closed`]), where
/// `println!` would panic.
pub fn print_line(line: std::fmt::Arguments<'_>) {
    match write_line(line) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => exit_output_closed(),
        // Another failure (a full disk) is not the reader leaving: say so, as `println!` would.
        Err(e) => panic!("failed printing to stdout: {e}"),
        Ok(()) => {}
    }
}

/// Writes one line to stdout, or says why it could not (for output that must clean up first).
/// Control characters other than line breaks and tabs are escaped ([`Printable`]), so nothing
/// the line carries can drive the terminal.
pub fn write_line(line: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    writeln!(std::io::stdout().lock(), "{}", Printable::keeping_lines(&line.to_string()))
}

/// Writes one line to stdout and ignores a failure: for the start and stop lines of a
/// long-running service, which must not end because nobody reads its output.
pub fn note_line(line: std::fmt::Arguments<'_>) {
    let _ = write_line(line);
}

/// Writes one line to stderr and ignores a failure: a message nobody can read must not turn
/// into a panic (and its exit status 101) where the program would say what went wrong.
pub fn say_line(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{}", Printable::keeping_lines(&line.to_string()));
}

/// Text from the data (task and queue names, keys, worker ids, error messages) as it may be
/// shown in a table or a line: control characters (an escape sequence, a line break that would
/// fake another row, C1 controls, DEL) and the bidirectional-text controls that reorder what
/// the terminal shows are written escaped, as `\n`, `\r`, `\t` or `\u001b`.
#[derive(Debug, Clone, Copy)]
pub struct Printable<'a> {
    text: &'a str,
    keep_lines: bool,
}

impl<'a> Printable<'a> {
    /// Every control character of `text` escaped (a field of a table or line).
    pub fn new(text: &'a str) -> Self {
        Printable { text, keep_lines: false }
    }

    /// Like [`new`](Printable::new) but keeping line breaks and tabs (a whole message that
    /// may span lines; its fields should be [`printable`] already).
    pub fn keeping_lines(text: &'a str) -> Self {
        Printable { text, keep_lines: true }
    }
}

/// Shorthand for [`Printable::new`].
pub fn printable(text: &str) -> Printable<'_> {
    Printable::new(text)
}

/// Whether `c` must not reach a terminal raw: controls, the bidirectional-text marks and
/// overrides, and the Unicode line and paragraph separators.
fn is_unprintable(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        || matches!(c, '\u{2028}' | '\u{2029}')
}

impl std::fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let escaped = |c: char| is_unprintable(c) && !(self.keep_lines && matches!(c, '\n' | '\t'));
        if !self.text.contains(escaped) {
            // Width and alignment (`{:<20}`) apply as to any string.
            return f.pad(self.text);
        }
        let mut out = String::with_capacity(self.text.len() + 8);
        for c in self.text.chars() {
            match c {
                c if !escaped(c) => out.push(c),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                // Every such character is in the Basic Multilingual Plane: four digits, as JSON
                // writes them, so a line of JSON stays JSON with the same value.
                c => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            }
        }
        f.pad(&out)
    }
}

/// `eprintln!` for the program's messages (see [`say_line`]).
#[macro_export]
#[doc(hidden)]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::cli::say_line(format_args!($($arg)*))
    };
}

/// `println!` for the program's output (see [`print_line`]).
#[macro_export]
#[doc(hidden)]
macro_rules! outln {
    () => {
        $crate::cli::print_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::cli::print_line(format_args!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_switches_and_positionals() {
        let args = Args::parse(
            &strings(&["sleep", "--count", "3", "--json", "--queue=fast"]),
            &["count", "queue"],
            &["json"],
            false,
        )
        .unwrap();
        assert_eq!(args.positional, vec!["sleep"]);
        assert_eq!(args.value("count"), Some("3"));
        assert_eq!(args.value("queue"), Some("fast"));
        assert!(args.switch("json"));
        assert_eq!(args.parsed::<u32>("count").unwrap(), Some(3));
    }

    #[test]
    fn unknown_and_incomplete_flags_are_usage_errors() {
        assert!(Args::parse(&strings(&["--nope", "1"]), &["count"], &[], false).is_err());
        assert!(Args::parse(&strings(&["--count"]), &["count"], &[], false).is_err());
        assert!(Args::parse(&strings(&["--json=1"]), &[], &["json"], false).is_err());
        assert!(Args::parse(&strings(&["--anything", "1"]), &[], &[], true).is_ok());
    }

    #[test]
    fn optional_settings_are_flags_too() {
        let values: BTreeMap<String, String> = [
            ("finished-retention-ms".to_owned(), "86400000".to_owned()),
            ("claim-lease-ms".to_owned(), "90000".to_owned()),
        ]
        .into_iter()
        .collect();
        let config = config_with_flags(&canter::config::Config::default(), &values, &[]).unwrap();
        assert_eq!(config.app.recovery.finished_retention_ms, Some(86_400_000));
        assert_eq!(config.app.claim_lease_ms, Some(90_000));
    }

    #[test]
    fn control_characters_are_escaped_for_the_terminal() {
        let name = "a\u{1b}[2J\nFAKE\r\t\u{7f}\u{9b}\u{202e}é";
        assert_eq!(printable(name).to_string(), "a\\u001b[2J\\nFAKE\\r\\t\\u007f\\u009b\\u202eé");
        assert_eq!(Printable::keeping_lines("a\nb\tc\u{1b}[0m").to_string(), "a\nb\tc\\u001b[0m");
        assert_eq!(printable("\u{2028}\u{61c}").to_string(), "\\u2028\\u061c");
        // JSON stays JSON, with the same value.
        let json = serde_json::json!({"name": name}).to_string();
        let shown = Printable::keeping_lines(&json).to_string();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&shown).unwrap()["name"], name);
        // Widths apply to the escaped text.
        assert_eq!(format!("[{:<8}]", printable("q\n")), "[q\\n     ]");
        assert_eq!(format!("[{:>4}]", printable("ok")), "[  ok]");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap().as_millis(), 500);
        assert_eq!(parse_duration("2m").unwrap().as_secs(), 120);
        assert_eq!(parse_duration("3").unwrap().as_secs(), 3);
        assert_eq!(parse_duration("30d").unwrap().as_secs(), 30 * 86_400);
        assert!(parse_duration("3 weeks").is_err());
        assert_eq!(parse_duration("1157407d").unwrap().as_secs(), 1_157_407 * 86_400);
        for huge in ["999999999999999999999d", "1157408d", "18446744073709551616"] {
            let error = parse_duration(huge).unwrap_err();
            assert!(error.0.starts_with(&format!("invalid duration {huge:?}")), "{error}");
        }
    }
}
