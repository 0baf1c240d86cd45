//! What the program prints: lines that never panic when nobody reads them, text from the data
//! escaped for the terminal, times in RFC 3339, tables, colour only where it belongs, and
//! progress bars on a terminal.

use std::io::{IsTerminal, Write};

use canter_tokio::canter::store::DbTime;

/// Ends the program because its output's reader went away, with status 141 (128 + SIGPIPE),
/// as Unix tools do.
pub(crate) fn exit_output_closed() -> ! {
    std::process::exit(141)
}

/// Writes one line of the program's output to stdout. When the reader has gone away
/// (`canter list | head`), the program ends quietly ([`exit_output_closed`]), where
/// `println!` would panic.
pub(crate) fn print_line(line: std::fmt::Arguments<'_>) {
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
pub(crate) fn write_line(line: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    writeln!(std::io::stdout().lock(), "{}", Printable::keeping_lines(&line.to_string()))
}

/// Writes one line to stdout and ignores a failure: for the start and stop lines of a
/// long-running service, which must not end because nobody reads its output.
pub(crate) fn note_line(line: std::fmt::Arguments<'_>) {
    let _ = write_line(line);
}

/// Writes one line to stderr and ignores a failure: a message nobody can read must not turn
/// into a panic (and its exit status 101) where the program would say what went wrong.
pub(crate) fn say_line(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{}", Printable::keeping_lines(&line.to_string()));
}

/// Text from the data (task and queue names, keys, worker ids, error messages) as it may be
/// shown in a table or a line: control characters (an escape sequence, a line break that would
/// fake another row, C1 controls, DEL) and the bidirectional-text controls that reorder what
/// the terminal shows are written escaped, as `\n`, `\r`, `\t` or `\u001b`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Printable<'a> {
    text: &'a str,
    keep_lines: bool,
}

impl<'a> Printable<'a> {
    /// Every control character of `text` escaped (a field of a table or line).
    pub(crate) fn new(text: &'a str) -> Self {
        Printable { text, keep_lines: false }
    }

    /// Like [`new`](Printable::new) but keeping line breaks and tabs (a whole message that
    /// may span lines; its fields should be [`printable`] already).
    pub(crate) fn keeping_lines(text: &'a str) -> Self {
        Printable { text, keep_lines: true }
    }
}

/// Shorthand for [`Printable::new`].
pub(crate) fn printable(text: &str) -> Printable<'_> {
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
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::say_line(format_args!($($arg)*))
    };
}

/// `println!` for the program's output (see [`print_line`]).
macro_rules! outln {
    () => {
        $crate::output::print_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::print_line(format_args!($($arg)*))
    };
}

pub(crate) use {errln, outln};

/// Whether to colour output going to a terminal (`is_terminal`): never when `NO_COLOR` is set
/// to anything but the empty string (no-color.org).
pub(crate) fn colour(is_terminal: bool) -> bool {
    is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// A database time in RFC 3339, UTC, with milliseconds when it has them.
pub(crate) fn time(t: DbTime) -> String {
    canter_tokio::canter::time::format_instant(t)
}

/// An optional time, or `-`.
pub(crate) fn time_or_dash(t: Option<DbTime>) -> String {
    t.map_or_else(|| "-".to_owned(), time)
}

/// A table printed with aligned columns: a header, then rows; each cell's text escaped.
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Columns aligned to the right (numbers).
    right: Vec<bool>,
}

impl Table {
    /// A table with these column names; a name starting with `>` is a right-aligned column.
    pub(crate) fn new<S: AsRef<str>>(columns: &[S]) -> Table {
        let columns: Vec<&str> = columns.iter().map(AsRef::as_ref).collect();
        Table {
            header: columns.iter().map(|c| c.trim_start_matches('>').to_owned()).collect(),
            right: columns.iter().map(|c| c.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (one cell per column).
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells.iter().map(|c| printable(c).to_string()).collect());
    }

    /// Prints the header and the rows.
    pub(crate) fn print(&self) {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut out = String::new();
            for (i, cell) in cells.enumerate() {
                let width = widths.get(i).copied().unwrap_or(0);
                if i > 0 {
                    out.push_str("  ");
                }
                if self.right.get(i) == Some(&true) {
                    out.push_str(&format!("{cell:>width$}"));
                } else {
                    out.push_str(&format!("{cell:<width$}"));
                }
            }
            out.trim_end().to_owned()
        };
        outln!("{}", line(&mut self.header.iter().map(String::as_str)));
        for row in &self.rows {
            outln!("{}", line(&mut row.iter().map(String::as_str)));
        }
    }
}

/// A progress bar on stderr for a long command, drawn only when stderr is a terminal (and
/// hidden otherwise, so scripts and logs see no bars).
pub(crate) struct Progress(indicatif::ProgressBar);

impl Progress {
    /// A bar of `total` steps (a spinner when `total` is 0), shown when `wanted` and stderr
    /// is a terminal.
    pub(crate) fn new(what: &str, total: u64, wanted: bool) -> Progress {
        if !wanted || !std::io::stderr().is_terminal() {
            return Progress(indicatif::ProgressBar::hidden());
        }
        let bar = if total == 0 { indicatif::ProgressBar::new_spinner() } else { indicatif::ProgressBar::new(total) };
        let template =
            if total == 0 { "{spinner} {msg} {elapsed}" } else { "{msg} [{bar:30}] {pos}/{len} {per_sec} eta {eta}" };
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_owned());
        if total == 0 {
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
        }
        Progress(bar)
    }

    /// `n` more steps done.
    pub(crate) fn advance(&self, n: u64) {
        self.0.inc(n);
    }

    /// Says what is going on now.
    pub(crate) fn set_message(&self, message: &str) {
        self.0.set_message(message.to_owned());
    }

    /// Removes the bar.
    pub(crate) fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
