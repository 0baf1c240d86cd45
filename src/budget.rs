//! The claim budget: how many tasks one claim pass may take from each queue.
//!
//! [`plan`] is the specification of a claim: the memory store calls it with the counts it
//! observes, and the SQL claim statement computes the same thing (the conformance suite runs
//! both). The formula is horsies' (reference/seeds.md §1.1, "Budget formula (Rust)"):
//!
//! - `max_claimed` = `max_claim_per_worker`, or automatically the capacity: `concurrency +
//!   claim_ahead` (hard-cap mode) or `concurrency + prefetch_buffer` (soft-cap mode); nothing
//!   is claimed once this worker holds that many live claims;
//! - `local_available` = capacity `− my_running − my_claimed`;
//! - `global_remaining` = `cluster_wide_cap − cluster in-flight` (hard mode only);
//! - `total` = min(local_available, max_claimed − my_claimed, global_remaining);
//! - per queue, in priority order: min(what is left of `total`, the queue's cap minus its
//!   in-flight count, `max_claim_batch` (0 = no limit), the eligible tasks the pass sees).
//!
//! In hard-cap mode in-flight means Running plus live Claimed; in soft-cap mode per-queue counts
//! are Running only (a prefetched claim does not hold a queue slot until it starts), except
//! for serial queues, whose live claims always count: one task at a time, in order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::{AppConfig, WorkerConfig};
use crate::task::DbTime;

/// One queue as a claim pass sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuePolicy {
    /// The queue's name.
    pub name: String,
    /// Lower claims first.
    pub priority: u8,
    /// The most tasks in flight in this queue across the cluster; `Some(0)` pauses it.
    pub max_concurrency: Option<u32>,
    /// A serial queue counts its live claims against its cap in soft-cap mode too.
    #[serde(default)]
    pub serial: bool,
}

impl From<crate::config::CustomQueue> for QueuePolicy {
    fn from(queue: crate::config::CustomQueue) -> Self {
        QueuePolicy {
            max_concurrency: queue.effective_cap(),
            name: queue.name,
            priority: queue.priority,
            serial: queue.serial,
        }
    }
}

/// Everything about a worker's configuration that bounds its claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimPolicy {
    /// Handlers this worker runs at once.
    pub concurrency: u32,
    /// Extra claims a worker may hold beyond `concurrency`; 0 is hard-cap mode.
    pub prefetch_buffer: u32,
    /// Hard-cap mode: claims a worker may take beyond its free slots, left Claimed (they count
    /// against every cap as any live claim does, and the worker starts them as slots free).
    /// The worker sets it per claim from its rate of work; 0 claims for free slots only.
    #[serde(default)]
    pub claim_ahead: u32,
    /// Most tasks taken from one queue in one pass; 0 = no limit beyond the budget.
    pub max_claim_batch: u32,
    /// Most live claims this worker may hold; 0 = automatic.
    pub max_claim_per_worker: u32,
    /// Most tasks in flight across the cluster (hard-cap mode only).
    pub cluster_wide_cap: Option<u32>,
    /// The queues served, in the order they are claimed from.
    pub queues: Vec<QueuePolicy>,
    /// Tasks with any of these flags are not claimed.
    #[serde(default)]
    pub forbidden_flags: Vec<String>,
    /// Only tasks of this priority or a more urgent (lower) one are claimed, and seen: a claim
    /// for announced urgent tasks beside a pass in flight. `None` claims any.
    #[serde(default)]
    pub max_priority: Option<i16>,
    /// Only tasks of this priority or a less urgent (higher) one are claimed, and seen: a large
    /// pass through a backlog leaves tasks more urgent than the backlog to the small urgent
    /// claims, so none waits for a large statement. `None` claims any.
    #[serde(default)]
    pub min_priority: Option<i16>,
    /// Only Pending tasks due at this time or later are claimed, and seen (lapsed claims are
    /// taken whatever their run-at): a pass woken only by enqueues that announced their run-at
    /// need not look before the earliest of them. It starts the claim's index walk past the
    /// rows claimed before, which another session holding the xmin keeps as dead entries.
    /// `None` claims any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_run_at: Option<DbTime>,
}

impl ClaimPolicy {
    /// The policy of a worker with this configuration. The configs are assumed validated.
    pub fn from_config(app: &AppConfig, worker: &WorkerConfig) -> Self {
        ClaimPolicy {
            concurrency: worker.concurrency,
            prefetch_buffer: app.prefetch_buffer,
            claim_ahead: 0,
            max_claim_batch: worker.max_claim_batch,
            max_claim_per_worker: worker.max_claim_per_worker,
            cluster_wide_cap: app.cluster_wide_cap,
            queues: worker.served_queues(app).into_iter().map(QueuePolicy::from).collect(),
            forbidden_flags: crate::task::normalized_flags(&worker.forbidden_flags),
            max_priority: None,
            min_priority: None,
            min_run_at: None,
        }
    }

    /// Whether a task with `flags` and `priority` may be claimed under this policy.
    pub fn admits(&self, flags: &[String], priority: i16) -> bool {
        (self.forbidden_flags.is_empty() || !flags.iter().any(|f| self.forbidden_flags.contains(f)))
            && self.max_priority.is_none_or(|max| priority <= max)
            && self.min_priority.is_none_or(|min| priority >= min)
    }

    /// Whether this policy claims (and sees) a claimable row of a served queue: [`admits`]
    /// its flags and priority, and a Pending row's run-at is not before [`min_run_at`].
    ///
    /// [`admits`]: ClaimPolicy::admits
    /// [`min_run_at`]: ClaimPolicy::min_run_at
    pub fn admits_row(&self, flags: &[String], priority: i16, pending: bool, run_at: DbTime) -> bool {
        self.admits(flags, priority) && (!pending || self.min_run_at.is_none_or(|min| run_at >= min))
    }

    /// Hard-cap mode counts live claims against every cap; soft-cap mode (a prefetch buffer)
    /// counts only running tasks against queue caps.
    pub fn hard_cap_mode(&self) -> bool {
        self.prefetch_buffer == 0
    }

    /// The most live claims this worker may hold, with the automatic default resolved.
    pub fn max_claimed(&self) -> u32 {
        if self.max_claim_per_worker > 0 { self.max_claim_per_worker } else { self.capacity() }
    }

    /// What this worker may claim in total, from its own counts alone (no cluster or queue cap
    /// applied): the worker asks for a claim only when this is positive.
    pub fn local_budget(&self, my_running: u32, my_claimed: u32) -> u32 {
        let max_claimed = self.max_claimed();
        if my_claimed >= max_claimed {
            return 0;
        }
        let local_available = self.capacity().saturating_sub(my_running).saturating_sub(my_claimed);
        local_available.min(max_claimed - my_claimed)
    }

    /// The most tasks this worker may hold running and claimed: its concurrency, its prefetch
    /// buffer (soft-cap mode) and what it claims ahead (hard-cap mode).
    pub fn capacity(&self) -> u32 {
        let extra = if self.hard_cap_mode() { self.claim_ahead } else { self.prefetch_buffer };
        self.concurrency.saturating_add(extra)
    }

    /// Whether any cap needs a consistent count across the cluster (and so an advisory lock).
    pub fn needs_cluster_count(&self) -> bool {
        self.cluster_wide_cap.is_some() || self.queues.iter().any(|q| q.max_concurrency.is_some())
    }
}

/// Tasks in flight somewhere, split by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    /// Running tasks.
    pub running: u32,
    /// Claimed tasks whose lease has not expired (expired claims are claimable, not in flight).
    pub claimed: u32,
}

impl InFlight {
    /// The count a cap is checked against in the given mode.
    pub fn counted(&self, hard_cap_mode: bool) -> u32 {
        if hard_cap_mode { self.running.saturating_add(self.claimed) } else { self.running }
    }
}

/// The counts one claim pass observes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimCounts {
    /// Handlers this worker is running.
    pub my_running: u32,
    /// Live claims this worker holds that have not started.
    pub my_claimed: u32,
    /// In flight across the cluster.
    pub cluster: InFlight,
    /// In flight per queue across the cluster; a missing queue has none.
    pub queues: BTreeMap<String, InFlight>,
    /// Eligible tasks per queue that this pass can lock; a missing queue has none.
    pub available: BTreeMap<String, u32>,
}

/// How many tasks to take from each queue, in claim order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimPlan {
    /// The total budget before looking at queues: the most this pass could take.
    pub budget: u32,
    /// Queue name and how many to take from it, in claim order; queues with nothing to take
    /// are left out.
    pub takes: Vec<(String, u32)>,
}

impl ClaimPlan {
    /// How many tasks the plan takes in all.
    pub fn total(&self) -> u32 {
        self.takes.iter().map(|(_, n)| n).sum()
    }
}

/// The claim plan for `policy` given what the pass observed. See the module docs.
pub fn plan(policy: &ClaimPolicy, counts: &ClaimCounts) -> ClaimPlan {
    let hard = policy.hard_cap_mode();
    let local = policy.local_budget(counts.my_running, counts.my_claimed);
    let global_remaining = match (hard, policy.cluster_wide_cap) {
        (true, Some(cap)) => cap.saturating_sub(counts.cluster.counted(true)),
        _ => u32::MAX,
    };
    let budget = local.min(global_remaining);
    let mut left = budget;
    let mut takes = Vec::new();
    for queue in &policy.queues {
        if left == 0 {
            break;
        }
        let in_flight = counts.queues.get(&queue.name).copied().unwrap_or_default();
        let queue_room =
            queue.max_concurrency.map_or(u32::MAX, |cap| cap.saturating_sub(in_flight.counted(hard || queue.serial)));
        let batch = if policy.max_claim_batch > 0 { policy.max_claim_batch } else { u32::MAX };
        let available = counts.available.get(&queue.name).copied().unwrap_or(0);
        let take = left.min(queue_room).min(batch).min(available);
        if take > 0 {
            takes.push((queue.name.clone(), take));
            left -= take;
        }
    }
    ClaimPlan { budget, takes }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(concurrency: u32, prefetch: u32, queues: &[(&str, Option<u32>)]) -> ClaimPolicy {
        ClaimPolicy {
            max_priority: None,
            min_priority: None,
            min_run_at: None,
            concurrency,
            prefetch_buffer: prefetch,
            claim_ahead: 0,
            max_claim_batch: 0,
            max_claim_per_worker: 0,
            cluster_wide_cap: None,
            queues: queues
                .iter()
                .enumerate()
                .map(|(i, (name, cap))| QueuePolicy {
                    name: name.to_string(),
                    priority: i as u8 + 1,
                    max_concurrency: *cap,
                    serial: false,
                })
                .collect(),
            forbidden_flags: Vec::new(),
        }
    }

    fn counts(my_running: u32, my_claimed: u32, available: &[(&str, u32)]) -> ClaimCounts {
        ClaimCounts {
            my_running,
            my_claimed,
            available: available.iter().map(|(q, n)| (q.to_string(), *n)).collect(),
            ..ClaimCounts::default()
        }
    }

    #[test]
    fn hard_mode_fills_free_permits_in_priority_order() {
        let p = policy(8, 0, &[("high", None), ("low", None)]);
        let plan = plan(&p, &counts(3, 0, &[("high", 2), ("low", 10)]));
        assert_eq!(plan.budget, 5);
        assert_eq!(plan.takes, vec![("high".into(), 2), ("low".into(), 3)]);
    }

    #[test]
    fn soft_mode_claims_into_the_prefetch_buffer() {
        let p = policy(4, 4, &[("default", None)]);
        let plan = plan(&p, &counts(4, 1, &[("default", 100)]));
        assert_eq!(plan.takes, vec![("default".into(), 3)]);
    }

    #[test]
    fn queue_caps_count_claims_only_in_hard_mode() {
        let mut c = counts(0, 0, &[("q", 100)]);
        c.queues.insert("q".into(), InFlight { running: 2, claimed: 3 });
        let hard = policy(10, 0, &[("q", Some(6))]);
        assert_eq!(plan(&hard, &c).total(), 1);
        let soft = policy(10, 5, &[("q", Some(6))]);
        assert_eq!(plan(&soft, &c).total(), 4);
    }

    #[test]
    fn a_paused_queue_gives_nothing_and_the_budget_moves_on() {
        let p = policy(4, 0, &[("paused", Some(0)), ("open", None)]);
        assert_eq!(plan(&p, &counts(0, 0, &[("paused", 9), ("open", 9)])).takes, vec![("open".into(), 4)]);
    }

    #[test]
    fn cluster_cap_bounds_the_total() {
        let mut p = policy(10, 0, &[("a", None)]);
        p.cluster_wide_cap = Some(12);
        let mut c = counts(0, 0, &[("a", 50)]);
        c.cluster = InFlight { running: 9, claimed: 1 };
        assert_eq!(plan(&p, &c).total(), 2);
    }

    #[test]
    fn batch_and_per_worker_limits() {
        let mut p = policy(10, 10, &[("a", None), ("b", None)]);
        p.max_claim_batch = 3;
        assert_eq!(plan(&p, &counts(0, 0, &[("a", 50), ("b", 50)])).takes, vec![("a".into(), 3), ("b".into(), 3)]);
        p.max_claim_per_worker = 4;
        assert_eq!(plan(&p, &counts(0, 2, &[("a", 50), ("b", 50)])).takes, vec![("a".into(), 2)]);
        assert_eq!(plan(&p, &counts(0, 4, &[("a", 50)])).total(), 0);
    }
}
