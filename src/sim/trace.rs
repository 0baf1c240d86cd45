//! The run's trace: readable lines with virtual timestamps, the last few kept for a failure
//! report, and a running hash of every line for the determinism check.
//!
//! A line reads `+  12.345s w2.1  -> claim op17 start 3` : the virtual time since the start of
//! the run, who acted (`w<slot>.<incarnation>`, `db`, `client`, `sim`) and what happened.
//! Timestamps are offsets from the run's epoch, so two runs of one seed print the same bytes
//! and hash to the same value.

use std::collections::VecDeque;
use std::fmt::{self, Write as _};
use std::time::Duration;

/// How many lines a trace keeps by default: enough context for a failure report.
pub const DEFAULT_TRACE_LINES: usize = 200;

const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01B3;

/// A bounded ring of trace lines plus an FNV-1a hash of every line ever recorded.
#[derive(Debug, Clone)]
pub struct Trace {
    lines: VecDeque<String>,
    capacity: usize,
    hash: u64,
    recorded: u64,
    echo: bool,
}

impl Trace {
    /// A trace keeping the last `capacity` lines (at least one).
    pub fn new(capacity: usize) -> Trace {
        Trace { lines: VecDeque::new(), capacity: capacity.max(1), hash: FNV_OFFSET, recorded: 0, echo: false }
    }

    /// The same trace, also printing every line to stderr as it is recorded (for replays: the
    /// whole story is on screen even if the run panics).
    pub fn echo(mut self, echo: bool) -> Trace {
        self.echo = echo;
        self
    }

    /// Records one line at virtual time `at` by `who`.
    pub fn record(&mut self, at: Duration, who: &str, what: fmt::Arguments<'_>) {
        // Reuse the oldest line's buffer once the ring is full.
        let mut line =
            if self.lines.len() >= self.capacity { self.lines.pop_front().unwrap_or_default() } else { String::new() };
        line.clear();
        let _ = write!(line, "+{:>4}.{:03}s {who:<6} {what}", at.as_secs(), at.subsec_millis());
        for byte in line.bytes().chain([b'\n']) {
            self.hash = (self.hash ^ u64::from(byte)).wrapping_mul(FNV_PRIME);
        }
        self.recorded += 1;
        if self.echo {
            eprintln!("{line}");
        }
        self.lines.push_back(line);
    }

    /// The hash of every line recorded so far.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// How many lines were recorded in all (kept or not).
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The last `n` lines kept, oldest first.
    pub fn tail(&self, n: usize) -> Vec<String> {
        self.lines.iter().skip(self.lines.len().saturating_sub(n)).cloned().collect()
    }
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new(DEFAULT_TRACE_LINES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_lines_and_hashes_all_of_them() {
        let mut short = Trace::new(2);
        let mut long = Trace::new(10);
        for i in 0..5u64 {
            short.record(Duration::from_millis(i * 1_500), "sim", format_args!("line {i}"));
            long.record(Duration::from_millis(i * 1_500), "sim", format_args!("line {i}"));
        }
        assert_eq!(short.tail(10), vec!["+   4.500s sim    line 3", "+   6.000s sim    line 4"]);
        assert_eq!(short.hash(), long.hash());
        assert_eq!(short.recorded(), 5);
        long.record(Duration::ZERO, "sim", format_args!("more"));
        assert_ne!(short.hash(), long.hash());
    }
}
