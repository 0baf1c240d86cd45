//! Properties of the pure functions: the claim budget, backoff and configuration validation.

use std::collections::BTreeMap;
use std::time::Duration;

use canter::backoff::{MIN_DB_RETRY_DELAY, MIN_RETRY_DELAY, db_retry_delay, retry_delay};
use canter::budget::{ClaimCounts, ClaimPolicy, InFlight, QueuePolicy, plan};
use canter::config::{AppConfig, BackoffStrategy, Config, ResilienceConfig, RetryPolicy, WorkerConfig};
use proptest::prelude::*;

fn queue_policies() -> impl Strategy<Value = Vec<QueuePolicy>> {
    prop::collection::vec((1u8..=100, prop::option::of(0u32..20), any::<bool>()), 1..5).prop_map(|queues| {
        let mut queues: Vec<QueuePolicy> = queues
            .into_iter()
            .enumerate()
            .map(|(i, (priority, max_concurrency, serial))| QueuePolicy {
                name: format!("q{i}"),
                priority,
                // A serial queue's cap is 1 (or 0), as `CustomQueue::effective_cap` makes it.
                max_concurrency: if serial { Some(max_concurrency.map_or(1, |c| c.min(1))) } else { max_concurrency },
                serial,
            })
            .collect();
        queues.sort_by_key(|q| q.priority);
        queues
    })
}

fn claim_policies() -> impl Strategy<Value = ClaimPolicy> {
    (
        1u32..32,
        prop_oneof![Just(0u32), 1u32..16],
        0u32..10,
        0u32..40,
        prop::option::of(1u32..64),
        queue_policies(),
        prop_oneof![Just(0u32), 1u32..40],
    )
        .prop_map(|(concurrency, prefetch, batch, per_worker, cap, queues, ahead)| ClaimPolicy {
            concurrency,
            prefetch_buffer: prefetch,
            // Claims ahead of free slots are a hard-cap mode setting.
            claim_ahead: if prefetch == 0 { ahead } else { 0 },
            max_claim_batch: batch,
            max_claim_per_worker: per_worker,
            // A cluster-wide cap with a prefetch buffer is a configuration error.
            cluster_wide_cap: if prefetch == 0 { cap } else { None },
            queues,
            forbidden_flags: Vec::new(),
            max_priority: None,
            min_priority: None,
            min_run_at: None,
        })
}

fn in_flight() -> impl Strategy<Value = InFlight> {
    (0u32..40, 0u32..40).prop_map(|(running, claimed)| InFlight { running, claimed })
}

fn counts_for(policy: &ClaimPolicy) -> impl Strategy<Value = ClaimCounts> + use<> {
    let names: Vec<String> = policy.queues.iter().map(|q| q.name.clone()).collect();
    let n = names.len();
    (0u32..40, 0u32..40, in_flight(), prop::collection::vec(in_flight(), n), prop::collection::vec(0u32..50, n))
        .prop_map(move |(my_running, my_claimed, cluster, queues, available)| ClaimCounts {
            my_running,
            my_claimed,
            cluster,
            queues: names.iter().cloned().zip(queues).collect(),
            available: names.iter().cloned().zip(available).collect(),
        })
}

fn policy_and_counts() -> impl Strategy<Value = (ClaimPolicy, ClaimCounts)> {
    claim_policies().prop_flat_map(|policy| {
        let counts = counts_for(&policy);
        (Just(policy), counts)
    })
}

proptest! {
    #[test]
    fn a_claim_plan_never_exceeds_a_cap((policy, counts) in policy_and_counts()) {
        let plan = plan(&policy, &counts);
        let hard = policy.hard_cap_mode();
        let total = plan.total();
        // This worker: its capacity and its live-claim limit.
        prop_assert!(total <= plan.budget);
        let extra = if hard { policy.claim_ahead } else { policy.prefetch_buffer };
        prop_assert!(counts.my_running + counts.my_claimed + total
            <= (policy.concurrency + extra).max(counts.my_running + counts.my_claimed));
        prop_assert!(total == 0 || counts.my_claimed + total <= policy.max_claimed());
        // The cluster.
        if let (true, Some(cap)) = (hard, policy.cluster_wide_cap) {
            prop_assert!(total == 0 || counts.cluster.counted(true) + total <= cap);
        }
        // Each queue, in claim order and only once.
        let mut seen = std::collections::BTreeSet::new();
        let order: Vec<&str> = policy.queues.iter().map(|q| q.name.as_str()).collect();
        let mut last_index = None;
        for (name, take) in &plan.takes {
            prop_assert!(*take > 0);
            prop_assert!(seen.insert(name.clone()));
            let index = order.iter().position(|q| q == name).expect("a planned queue is a served queue");
            prop_assert!(last_index.is_none_or(|last| index > last), "queues keep their claim order");
            last_index = Some(index);
            let queue = &policy.queues[index];
            prop_assert!(*take <= counts.available[name]);
            if policy.max_claim_batch > 0 {
                prop_assert!(*take <= policy.max_claim_batch);
            }
            if let Some(cap) = queue.max_concurrency {
                // A serial queue counts its live claims in soft-cap mode too.
                prop_assert!(counts.queues[name].counted(hard || queue.serial) + take <= cap);
            }
            if queue.serial {
                prop_assert!(counts.queues[name].running + counts.queues[name].claimed + take <= 1, "serial: one at a time");
            }
        }
    }

    #[test]
    fn unused_budget_flows_to_the_next_queue((policy, counts) in policy_and_counts()) {
        let plan = plan(&policy, &counts);
        if plan.total() < plan.budget {
            // Then every queue got all it could take on its own.
            let takes: BTreeMap<&str, u32> = plan.takes.iter().map(|(q, n)| (q.as_str(), *n)).collect();
            for queue in &policy.queues {
                let counted = counts.queues[&queue.name].counted(policy.hard_cap_mode() || queue.serial);
                let room = queue.max_concurrency.map_or(u32::MAX, |cap| cap.saturating_sub(counted));
                let batch = if policy.max_claim_batch > 0 { policy.max_claim_batch } else { u32::MAX };
                let could = room.min(batch).min(counts.available[&queue.name]);
                prop_assert_eq!(takes.get(queue.name.as_str()).copied().unwrap_or(0), could, "queue {}", queue.name);
            }
        }
    }

    #[test]
    fn retry_delays_stay_within_a_quarter_of_the_interval_and_above_a_second(
        intervals in prop::collection::vec(1u32..=86_400, 1..=20),
        retry in 1u32..40,
        entropy in any::<u64>(),
        jitter in any::<bool>(),
    ) {
        let policy = RetryPolicy { jitter, ..RetryPolicy::fixed(intervals.clone()) };
        let base = f64::from(intervals[(retry as usize - 1).min(intervals.len() - 1)]);
        let delay = retry_delay(&policy, retry, entropy).as_secs_f64();
        let spread = if jitter { 0.25 } else { 0.0 };
        prop_assert!(delay >= (base * (1.0 - spread)).max(1.0) - 1e-9, "{} < {}", delay, base);
        prop_assert!(delay <= (base * (1.0 + spread)).max(1.0) + 1e-9, "{} > {}", delay, base);
        prop_assert!(retry_delay(&policy, retry, entropy) >= MIN_RETRY_DELAY);
    }

    #[test]
    fn exponential_delays_grow_with_the_retry_for_fixed_entropy(base in 1u32..=3600, retry in 1u32..30, entropy in any::<u64>()) {
        let policy = RetryPolicy { backoff: BackoffStrategy::Exponential, ..RetryPolicy::exponential(base, 20) };
        prop_assert!(retry_delay(&policy, retry + 1, entropy) >= retry_delay(&policy, retry, entropy));
    }

    #[test]
    fn database_backoff_is_capped_jittered_and_floored(
        initial in 100u64..=60_000,
        extra in 0u64..=240_000,
        failures in 1u32..100,
        entropy in any::<u64>(),
    ) {
        let max = (initial + extra).clamp(500, 300_000).max(initial);
        let config = ResilienceConfig { db_retry_initial_ms: initial, db_retry_max_ms: max, db_retry_max_attempts: 0 };
        let delay = db_retry_delay(&config, failures, entropy);
        let capped = (initial as f64 * 2f64.powi(failures as i32 - 1)).min(max as f64);
        prop_assert!(delay >= MIN_DB_RETRY_DELAY);
        prop_assert!(delay.as_secs_f64() * 1000.0 >= (capped * 0.75).max(100.0) - 1e-6);
        prop_assert!(delay.as_secs_f64() * 1000.0 <= capped * 1.25 + 1e-6);
        prop_assert!(delay <= Duration::from_millis(max * 5 / 4 + 1));
    }

    #[test]
    fn validation_never_panics_and_names_real_fields(
        concurrency in 0u32..20_000,
        prefetch in 0u32..10,
        lease in prop::option::of(0u64..200_000),
        cap in prop::option::of(0u32..10),
        heartbeat in 0u64..200_000,
        check in 0u64..700_000,
        poll in 0u64..400_000,
        max_retries in 0u32..30,
    ) {
        let mut config = Config::default();
        config.worker.concurrency = concurrency;
        config.app.prefetch_buffer = prefetch;
        config.app.claim_lease_ms = lease;
        config.app.cluster_wide_cap = cap;
        config.app.recovery.claimer_heartbeat_interval_ms = heartbeat;
        config.app.recovery.check_interval_ms = check;
        config.worker.poll_interval_ms = poll;
        config.app.retry.max_retries = max_retries;
        match config.validate() {
            Ok(()) => {
                // A valid config survives JSON both ways and stays valid.
                let json = serde_json::to_string(&config).unwrap();
                let back = Config::from_json_str(&json).unwrap();
                prop_assert_eq!(back, config);
            }
            Err(error) => {
                prop_assert!(!error.problems.is_empty());
                for problem in &error.problems {
                    prop_assert!(problem.field.starts_with("app.") || problem.field.starts_with("worker."), "{}", problem.field);
                    prop_assert!(!problem.expected.is_empty());
                }
                let text = error.to_string();
                prop_assert!(text.starts_with("invalid configuration"), "{}", text);
            }
        }
    }
}

#[test]
fn the_defaults_are_a_valid_configuration() {
    Config::default().validate().unwrap();
    AppConfig::default().validate().unwrap();
    WorkerConfig::default().validate(&AppConfig::default()).unwrap();
}
