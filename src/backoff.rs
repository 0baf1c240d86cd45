//! Backoff: when a failed task runs again, and how long to wait after a database error.
//!
//! Both are pure functions of a policy, an attempt number and an entropy value (64 random
//! bits the caller draws from its seeded [`Rng`]), so they can be tested
//! for every entropy and replayed exactly.

use std::time::Duration;

use crate::config::{BackoffStrategy, ResilienceConfig, RetryPolicy};
use crate::rng::{Rng, unit};
use crate::task::ErrorCode;

/// The shortest delay before a retry.
pub const MIN_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The shortest wait after a database error.
pub const MIN_DB_RETRY_DELAY: Duration = Duration::from_millis(100);

/// The longest retry delay this function returns (exponential growth is otherwise unbounded).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(366 * 24 * 3600);

/// A factor in `[1 − spread, 1 + spread)` drawn from `entropy`.
fn jitter_factor(entropy: u64, spread: f64) -> f64 {
    1.0 - spread + 2.0 * spread * unit(entropy)
}

/// The delay before retry number `retry` (1 for the first retry) of a task under `policy`.
///
/// Fixed: `intervals[min(retry − 1, len − 1)]`; exponential: `intervals[0] · 2^(retry − 1)`;
/// then ±25% jitter when the policy asks for it, and never less than one second
/// (reference/seeds.md §1.1, "Task retry delay formula").
pub fn retry_delay(policy: &RetryPolicy, retry: u32, entropy: u64) -> Duration {
    let retry = retry.max(1);
    let first = policy.intervals_secs.first().copied().unwrap_or(1);
    let base_secs = match policy.backoff {
        BackoffStrategy::Fixed => {
            let index = (retry as usize - 1).min(policy.intervals_secs.len().saturating_sub(1));
            f64::from(policy.intervals_secs.get(index).copied().unwrap_or(first))
        }
        BackoffStrategy::Exponential => f64::from(first) * 2f64.powi((retry - 1).min(1023) as i32),
    };
    let secs = if policy.jitter { base_secs * jitter_factor(entropy, 0.25) } else { base_secs };
    let secs = secs.clamp(MIN_RETRY_DELAY.as_secs_f64(), MAX_RETRY_DELAY.as_secs_f64());
    Duration::from_secs_f64(secs)
}

/// Whether a task that failed with `code` after spending `retries_spent` retries may run
/// again under `policy`. (Good-until is the store's to check: only it knows the time.)
pub fn may_retry(policy: &RetryPolicy, retries_spent: u32, code: &ErrorCode) -> bool {
    // By name, so a hand-built `User("TASK_ERROR")` counts as the built-in it spells.
    retries_spent < policy.max_retries && policy.retries_for(code)
}

/// Whether, and after how long, a task whose run ended with `WORKER_CRASHED` runs again, having
/// spent `retries_spent` retries: as its `policy` says when that retries the code; otherwise
/// at once while it has spent fewer than `crash_retries` (`recovery.crash_retries`), since a
/// crash is rarely the task's fault; otherwise never. (Good-until is the store's to check.)
pub fn crash_retry_delay(
    policy: &RetryPolicy,
    retries_spent: u32,
    crash_retries: u32,
    entropy: u64,
) -> Option<Duration> {
    if may_retry(policy, retries_spent, &ErrorCode::WorkerCrashed) {
        return Some(retry_delay(policy, retries_spent.saturating_add(1), entropy));
    }
    (retries_spent < crash_retries).then_some(Duration::ZERO)
}

/// The wait after the `failures`-th database error in a row (1 for the first):
/// `min(max, initial · 2^(failures − 1)) · U(0.75, 1.25)`, never under 100 ms. The jitter
/// comes after the cap, so a wait can reach 1.25 × max (reference/seeds.md §7, row 14).
/// Never more than [`MAX_RETRY_DELAY`], whatever the settings (unvalidated ones included), so
/// `now + wait` stays within any clock's range.
pub fn db_retry_delay(config: &ResilienceConfig, failures: u32, entropy: u64) -> Duration {
    let exponent = failures.max(1) - 1;
    let initial = config.db_retry_initial_ms as f64;
    let capped = (initial * 2f64.powi(exponent.min(1023) as i32)).min(config.db_retry_max_ms as f64);
    let ms = (capped * jitter_factor(entropy, 0.25)).max(MIN_DB_RETRY_DELAY.as_millis() as f64);
    Duration::try_from_secs_f64(ms / 1000.0).map_or(MAX_RETRY_DELAY, |wait| wait.min(MAX_RETRY_DELAY))
}

/// Database-error backoff as a small sans-IO value: count failures, say when to try again,
/// reset after a success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DbBackoff {
    failures: u32,
}

impl DbBackoff {
    /// No failures yet.
    pub fn new() -> Self {
        DbBackoff { failures: 0 }
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Records a failure and returns how long to wait before the next try.
    pub fn on_failure(&mut self, config: &ResilienceConfig, rng: &mut Rng) -> Duration {
        self.failures = self.failures.saturating_add(1);
        db_retry_delay(config, self.failures, rng.next_u64())
    }

    /// Records a success: the next failure starts from the initial delay again.
    pub fn on_success(&mut self) {
        self.failures = 0;
    }

    /// Whether `max_attempts` failures in a row have happened (0 means never give up).
    pub fn exhausted(&self, config: &ResilienceConfig) -> bool {
        config.db_retry_max_attempts > 0 && self.failures >= config.db_retry_max_attempts
    }
}

impl Default for DbBackoff {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(intervals: &[u32], jitter: bool) -> RetryPolicy {
        RetryPolicy { jitter, ..RetryPolicy::fixed(intervals.to_vec()) }
    }

    #[test]
    fn a_crashed_run_follows_its_policy_else_runs_again_at_once_a_few_times() {
        // A policy that retries crashes decides, with its own delays.
        let retrying = fixed(&[60], false);
        assert_eq!(crash_retry_delay(&retrying, 0, 2, 0), Some(Duration::from_secs(60)));
        // One that does not: at once while fewer than `crash_retries` retries were spent.
        let none = RetryPolicy::none();
        assert_eq!(crash_retry_delay(&none, 0, 2, 0), Some(Duration::ZERO));
        assert_eq!(crash_retry_delay(&none, 1, 2, 0), Some(Duration::ZERO));
        assert_eq!(crash_retry_delay(&none, 2, 2, 0), None);
        assert_eq!(crash_retry_delay(&none, 0, 0, 0), None, "0 fails a crashed run, as the seeds did");
        // Codes a policy leaves out fall back to the allowance too; spent retries count.
        let only_errors = RetryPolicy { auto_retry_for: vec![ErrorCode::TaskError], ..fixed(&[5, 5, 5], false) };
        assert_eq!(crash_retry_delay(&only_errors, 1, 2, 0), Some(Duration::ZERO));
        assert_eq!(crash_retry_delay(&only_errors, 2, 2, 0), None);
    }

    #[test]
    fn fixed_intervals_then_the_last_one() {
        let p = fixed(&[60, 300, 900], false);
        let secs: Vec<u64> = (1..=5).map(|r| retry_delay(&p, r, 0).as_secs()).collect();
        assert_eq!(secs, vec![60, 300, 900, 900, 900]);
    }

    #[test]
    fn exponential_doubles_from_the_base() {
        let p = RetryPolicy { jitter: false, ..RetryPolicy::exponential(5, 10) };
        let secs: Vec<u64> = (1..=4).map(|r| retry_delay(&p, r, 0).as_secs()).collect();
        assert_eq!(secs, vec![5, 10, 20, 40]);
        assert_eq!(retry_delay(&p, u32::MAX, 0), MAX_RETRY_DELAY);
    }

    #[test]
    fn jitter_is_a_quarter_either_way_and_never_under_a_second() {
        let p = fixed(&[100], true);
        assert_eq!(retry_delay(&p, 1, 0), Duration::from_secs(75));
        // The top of the range, to within float rounding.
        assert!(retry_delay(&p, 1, u64::MAX) <= Duration::from_secs(125));
        assert!(retry_delay(&p, 1, u64::MAX) > Duration::from_millis(124_999));
        assert_eq!(retry_delay(&fixed(&[1], true), 1, 0), MIN_RETRY_DELAY);
    }

    #[test]
    fn db_backoff_doubles_caps_and_floors() {
        let config = ResilienceConfig { db_retry_initial_ms: 500, db_retry_max_ms: 4_000, db_retry_max_attempts: 0 };
        let mid = 1u64 << 63; // unit(mid) = 0.5, so the jitter factor is exactly 1
        let ms: Vec<u128> = (1..=6).map(|n| db_retry_delay(&config, n, mid).as_millis()).collect();
        assert_eq!(ms, vec![500, 1000, 2000, 4000, 4000, 4000]);
        assert_eq!(db_retry_delay(&config, 1, 0).as_millis(), 375);
        let tiny = ResilienceConfig { db_retry_initial_ms: 100, ..config };
        assert_eq!(db_retry_delay(&tiny, 1, 0), MIN_DB_RETRY_DELAY);
    }

    #[test]
    fn db_backoff_resets_after_success() {
        let config = ResilienceConfig { db_retry_initial_ms: 500, db_retry_max_ms: 30_000, db_retry_max_attempts: 3 };
        let mut backoff = DbBackoff::new();
        let mut rng = Rng::new(1);
        for _ in 0..3 {
            backoff.on_failure(&config, &mut rng);
        }
        assert!(backoff.exhausted(&config));
        backoff.on_success();
        assert_eq!(backoff.failures(), 0);
        assert!(!backoff.exhausted(&config));
    }

    #[test]
    fn db_waits_stay_bounded_whatever_the_settings() {
        let huge =
            ResilienceConfig { db_retry_initial_ms: u64::MAX, db_retry_max_ms: u64::MAX, db_retry_max_attempts: 0 };
        for failures in [1, 2, 64, u32::MAX] {
            for entropy in [0, u64::MAX] {
                assert!(db_retry_delay(&huge, failures, entropy) <= MAX_RETRY_DELAY, "{failures} {entropy}");
            }
        }
        let valid = ResilienceConfig { db_retry_initial_ms: 500, db_retry_max_ms: 300_000, db_retry_max_attempts: 0 };
        assert_eq!(db_retry_delay(&valid, 1, 0), Duration::from_millis(375), "valid settings are unchanged");
    }

    #[test]
    fn retry_needs_budget_and_a_listed_code() {
        let p = RetryPolicy::fixed(vec![1, 1]).with_codes(vec![ErrorCode::TaskTimeout]);
        assert!(may_retry(&p, 0, &ErrorCode::TaskTimeout));
        assert!(may_retry(&p, 1, &ErrorCode::TaskTimeout));
        assert!(!may_retry(&p, 2, &ErrorCode::TaskTimeout));
        assert!(!may_retry(&p, 0, &ErrorCode::TaskError));
        assert!(!may_retry(&RetryPolicy::none(), 0, &ErrorCode::TaskError));
        let builtin = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::TaskError]);
        assert!(may_retry(&builtin, 0, &ErrorCode::User("TASK_ERROR".into())), "codes compare by name");
    }
}
