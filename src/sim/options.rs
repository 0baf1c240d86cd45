//! The knobs of one simulation run, every one derived from the seed (VOPR's swarm testing).
//!
//! [`SimOptions::swarm`] draws a whole world from a PRNG: the application configuration (hard
//! or soft caps, custom queues with priorities and caps, a cluster-wide cap, leases, heartbeat
//! and reaper intervals, database backoff, a default retry policy), one configuration per
//! worker, the task load (with the workflows submitted beside the tasks, drawn after every
//! other knob so that older seeds keep their worlds) and the faults. Swarm testing means that the knobs vary *between*
//! seeds as well as within one: some seeds have no faults at all, some have many kinds at high
//! rates, so a bug that only shows when one fault is frequent and another absent is found.
//!
//! Every configuration drawn here passes [`AppConfig::validate`] and
//! [`WorkerConfig::validate`]; intervals are short (seconds) so a few virtual minutes exercise
//! many heartbeats, reaps and polls.

use crate::config::{
    AppConfig, BackoffStrategy, CustomQueue, DeploymentMode, QueueMode, RecoveryConfig, ResilienceConfig, RetryPolicy,
    WorkerConfig,
};
use crate::rng::Rng;
use crate::task::ErrorCode;

use super::faults::{BrokerFaults, FaultOptions};

/// The user error code the simulation's handlers fail with besides `TASK_ERROR`; some retry
/// policies list it, most do not.
pub const USER_ERROR_CODE: &str = "RATE_LIMITED";

/// Everything one run is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct SimOptions {
    /// The configuration the store and every worker share.
    pub app: AppConfig,
    /// One configuration per worker slot (1 to 5 slots); a restarted worker keeps its slot's
    /// configuration under a new worker id.
    pub workers: Vec<WorkerConfig>,
    /// The tasks and how their handlers behave.
    pub load: LoadOptions,
    /// The faults injected during the safety phase.
    pub faults: FaultOptions,
    /// Virtual length of the safety phase in ms; then the faults heal.
    pub safety_ms: u64,
    /// The most simulation steps a run may take before it fails (TIGER_STYLE: put a limit on
    /// everything).
    pub max_steps: u64,
}

/// The task load: how many tasks, when and how they are enqueued, and what their handlers do.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    /// Tasks enqueued in all (duplicates by idempotency key not counted).
    pub tasks: u32,
    /// The most tasks in one enqueue statement.
    pub batch_max: u32,
    /// Tasks are enqueued at random times in `[0, enqueue_window_ms)`.
    pub enqueue_window_ms: u64,
    /// Priorities are drawn from `[-priority_spread, priority_spread]`.
    pub priority_spread: i16,
    /// Chance a task gets a run-at delay of up to `delay_max_ms`.
    pub delay_chance: f64,
    /// The longest run-at delay.
    pub delay_max_ms: u64,
    /// Chance a task gets a good-until time, up to `good_until_max_ms` after its run-at.
    pub good_until_chance: f64,
    /// The longest good-until horizon after run-at.
    pub good_until_max_ms: u64,
    /// Chance a task carries its own retry policy instead of the app's default.
    pub retry_chance: f64,
    /// Chance a task has an idempotency key (and is enqueued a second time with it).
    pub key_chance: f64,
    /// Chance an enqueue statement is followed by the cancellation of a random earlier task
    /// (refused unless it is Pending or Claimed).
    pub cancel_chance: f64,
    /// Chance a run fails with an error (`TASK_ERROR` or [`USER_ERROR_CODE`]).
    pub error_chance: f64,
    /// Chance a run panics (`UNHANDLED_ERROR`).
    pub panic_chance: f64,
    /// Chance a run fails with `WORKER_RESOLUTION_ERROR` or `WORKER_SERIALIZATION_ERROR`.
    pub odd_error_chance: f64,
    /// Chance a run hangs and never returns (only with a handler timeout).
    pub hang_chance: f64,
    /// Chance a run is slow: up to `slow_max_ms`.
    pub slow_chance: f64,
    /// The longest slow run.
    pub slow_max_ms: u64,
    /// The longest ordinary run.
    pub duration_max_ms: u64,
    /// Workflows submitted beside the tasks, at random times of the enqueue window (none in
    /// many seeds: swarm testing). Their steps run on the same handlers, with the same
    /// sampled outcomes.
    pub workflows: u32,
    /// The most steps of one workflow (at least 2).
    pub workflow_steps_max: u32,
    /// Chance an edge lets its child run whatever its parent's outcome (`allow_failed`).
    pub allow_failed_chance: f64,
    /// Chance a workflow pauses when one of its steps fails, is cancelled or expires.
    pub pause_on_error_chance: f64,
    /// Operator actions on a random workflow (pause, resume or cancel) at random times of the
    /// safety phase.
    pub workflow_actions: u32,
}

impl LoadOptions {
    /// The longest a handler can run before it returns or its timeout fires.
    pub fn longest_run_ms(&self, handler_timeout_ms: Option<u64>) -> u64 {
        let longest = self.slow_max_ms.max(self.duration_max_ms);
        match handler_timeout_ms {
            Some(timeout) => longest.min(timeout),
            None => longest,
        }
    }
}

impl SimOptions {
    /// The options seed `seed` runs with: [`swarm`](Self::swarm) on a generator seeded with it.
    pub fn from_seed(seed: u64) -> SimOptions {
        SimOptions::swarm(&mut Rng::new(seed ^ 0x005E_ED0F_5EED))
    }

    /// Draws every knob from `rng` (see the module docs).
    pub fn swarm(rng: &mut Rng) -> SimOptions {
        let app = swarm_app(rng);
        let queue_names: Vec<String> = app.queue_names().map(str::to_owned).collect();
        let worker_count = rng.range(1, 6) as usize;
        let mut workers: Vec<WorkerConfig> = (0..worker_count).map(|_| swarm_worker(rng, &app, &queue_names)).collect();
        // Every queue must be served by some worker, or its tasks could never run.
        for name in &queue_names {
            let served = workers.iter().any(|w| w.queues.is_empty() || w.queues.contains(name));
            if !served {
                let slot = rng.range(0, worker_count as u64) as usize;
                workers[slot].queues.push(name.clone());
            }
        }
        let safety_ms = rng.range(60_000, 300_001);
        let load = swarm_load(rng, safety_ms);
        let faults = FaultOptions::swarm(rng, safety_ms, worker_count);
        let mut app = app;
        // Drawn last, so that the draws above are those of seeds recorded before these knobs.
        swarm_liveness(rng, &mut app.recovery);
        let mut load = load;
        // Later still: seeds recorded before workflows joined the load draw what they drew.
        swarm_workflows(rng, &mut load, &app);
        // Later still: a broker carrying enqueues (seeds recorded before it draw as they did).
        let mut faults = faults;
        faults.broker = BrokerFaults::swarm(rng, safety_ms, worker_count);
        SimOptions { app, workers, load, faults, safety_ms, max_steps: 3_000_000 }
    }

    /// The same options with every fault switched off.
    pub fn without_faults(mut self) -> SimOptions {
        // A broker is no fault: it stays, faultless.
        let broker = self.faults.broker.take().map(|broker| BrokerFaults {
            loss_chance: 0.0,
            duplicate_chance: 0.0,
            drops: Vec::new(),
            ..broker
        });
        self.faults = FaultOptions { broker, ..FaultOptions::none() };
        self
    }
}

fn swarm_app(rng: &mut Rng) -> AppConfig {
    let hard = rng.chance(0.6);
    let claimer_hb = rng.range(1_000, 5_001);
    let runner_hb = rng.range(1_000, 5_001);
    let recovery = RecoveryConfig {
        auto_requeue_stale_claimed: true,
        claimed_stale_threshold_ms: claimer_hb * rng.range(2, 6),
        auto_fail_stale_running: true,
        running_stale_threshold_ms: runner_hb * rng.range(2, 6),
        check_interval_ms: rng.range(1_000, 10_001),
        runner_heartbeat_interval_ms: runner_hb,
        claimer_heartbeat_interval_ms: claimer_hb,
        finished_retention_ms: None,
        idempotency_retention_ms: None,
        // The shortest: crashed workers' rows are pruned within a run.
        worker_retention_ms: 60_000,
        // Drawn at the end of `swarm` (see `swarm_liveness`).
        ..RecoveryConfig::default()
    };
    // Soft-cap mode needs an explicit lease; hard-cap mode sometimes keeps the 60 s default.
    let claim_lease_ms =
        if hard && rng.chance(0.4) { None } else { Some(claimer_hb * 2 + rng.range(0, claimer_hb * 4 + 1)) };
    let lease = claim_lease_ms.unwrap_or(crate::config::DEFAULT_CLAIM_LEASE_MS);
    let max_claim_renew_age_ms = lease + rng.range(0, lease * 3);
    let db_retry_initial_ms = rng.range(100, 1_001);
    let resilience = ResilienceConfig {
        db_retry_initial_ms,
        db_retry_max_ms: rng.range(db_retry_initial_ms.max(500), 5_001),
        db_retry_max_attempts: if rng.chance(0.15) { rng.range(3, 20) as u32 } else { 0 },
    };
    let (queue_mode, custom_queues) = if rng.chance(0.4) {
        (QueueMode::Default, Vec::new())
    } else {
        let count = rng.range(1, 4);
        let queues = (0..count)
            .map(|i| {
                let mut queue = CustomQueue::new(format!("q{i}")).with_priority(rng.range(1, 4) as u8);
                if rng.chance(0.5) {
                    let cap = rng.range(1, 7) as u32;
                    // The first queue is serial when its cap came out 1 or 2 (derived from the
                    // draw, not drawn, so recorded seeds replay as before).
                    queue = if i == 0 && cap <= 2 { queue.serial() } else { queue.with_max_concurrency(cap) };
                } else if rng.chance(0.05) {
                    queue = queue.with_max_concurrency(0);
                }
                queue
            })
            .collect();
        (QueueMode::Custom, queues)
    };
    AppConfig {
        queue_mode,
        custom_queues,
        cluster_wide_cap: if hard && rng.chance(0.3) { Some(rng.range(1, 11) as u32) } else { None },
        prefetch_buffer: if hard { 0 } else { rng.range(1, 5) as u32 },
        claim_lease_ms,
        max_claim_renew_age_ms,
        resilience,
        recovery,
        retry: if rng.chance(0.5) { RetryPolicy::none() } else { swarm_retry(rng) },
        schedules: Vec::new(),
    }
}

/// Liveness tokens and crash re-runs: mostly on, checked every 0.5 to 5 s, with a grace of
/// none to 5 s (shorter and longer than the token drops of [`FaultOptions`]), 0 to 3 crash
/// retries.
fn swarm_liveness(rng: &mut Rng, recovery: &mut RecoveryConfig) {
    recovery.auto_recover_dead_workers = rng.chance(0.8);
    recovery.liveness_check_interval_ms = rng.range(500, 5_001);
    recovery.liveness_grace_ms = rng.range(0, 5_001);
    recovery.crash_retries = rng.range(0, 4) as u32;
}

/// A random valid retry policy with at most 3 retries of at most 10 s base delay.
pub(crate) fn swarm_retry(rng: &mut Rng) -> RetryPolicy {
    let max_retries = rng.range(0, 4) as u32;
    let mut policy = if rng.chance(0.5) {
        RetryPolicy::exponential(rng.range(1, 6) as u32, max_retries)
    } else if max_retries == 0 {
        RetryPolicy::none()
    } else {
        RetryPolicy::fixed((0..max_retries).map(|_| rng.range(1, 11) as u32).collect())
    };
    policy.jitter = rng.chance(0.7);
    let user = ErrorCode::User(USER_ERROR_CODE.into());
    policy.auto_retry_for = match rng.range(0, 4) {
        0 => vec![ErrorCode::TaskError],
        1 => {
            let mut codes = RetryPolicy::default_codes();
            codes.push(user);
            codes
        }
        _ => RetryPolicy::default_codes(),
    };
    policy
}

/// The longest total retry delay `policy` can add to a task, jitter included.
pub(crate) fn retry_budget_ms(policy: &RetryPolicy) -> u64 {
    let first = u64::from(policy.intervals_secs.first().copied().unwrap_or(1));
    (1..=u64::from(policy.max_retries))
        .map(|retry| {
            let secs = match policy.backoff {
                BackoffStrategy::Fixed => {
                    let index = (retry as usize - 1).min(policy.intervals_secs.len().saturating_sub(1));
                    u64::from(policy.intervals_secs.get(index).copied().unwrap_or(1))
                }
                BackoffStrategy::Exponential => first << (retry - 1).min(20),
            };
            secs * 1_250 + 1_000
        })
        .sum()
}

fn swarm_worker(rng: &mut Rng, app: &AppConfig, queue_names: &[String]) -> WorkerConfig {
    let concurrency = rng.range(1, 9) as u32;
    let queues = if queue_names.len() > 1 && rng.chance(0.3) {
        let picked: Vec<String> = queue_names.iter().filter(|_| rng.chance(0.5)).cloned().collect();
        if picked.is_empty() { vec![queue_names[0].clone()] } else { picked }
    } else {
        Vec::new()
    };
    let served: Vec<String> = if queues.is_empty() { queue_names.to_vec() } else { queues.clone() };
    let mut queue_priorities = std::collections::BTreeMap::new();
    if rng.chance(0.2) {
        for name in &served {
            if rng.chance(0.5) {
                queue_priorities.insert(name.clone(), rng.range(1, 4) as u8);
            }
        }
    }
    let capacity = concurrency + app.prefetch_buffer;
    WorkerConfig {
        queues,
        concurrency,
        max_claim_batch: if rng.chance(0.6) { 0 } else { rng.range(1, 5) as u32 },
        max_claim_per_worker: if rng.chance(0.7) { 0 } else { rng.range(1, u64::from(capacity) + 3) as u32 },
        queue_priorities,
        coalesce_notifies: 100,
        deployment_mode: match rng.range(0, 10) {
            0..=4 => DeploymentMode::Hybrid,
            5..=7 => DeploymentMode::PollingOnly,
            _ => DeploymentMode::EventDrivenOnly,
        },
        poll_interval_ms: rng.range(1_000, 10_001),
        handler_timeout_ms: if rng.chance(0.3) { None } else { Some(rng.range(1_000, 30_001)) },
        shutdown_grace_ms: rng.range(0, 10_001),
        completion_batch_max: rng.range(1, 11) as u32,
        max_result_bytes: WorkerConfig::default().max_result_bytes,
        seed: Some(rng.next_u64()),
        forbidden_flags: Vec::new(),
        run_scheduler: false,
    }
}

fn swarm_load(rng: &mut Rng, safety_ms: u64) -> LoadOptions {
    let busy = rng.chance(0.4);
    // A burst early, a steady stream, or work arriving until the very end of the safety phase.
    let window_tenths = match rng.range(0, 3) {
        0 => rng.range(0, 2),
        1 => rng.range(2, 8),
        _ => rng.range(8, 11),
    };
    LoadOptions {
        tasks: if busy { rng.range(100, 301) as u32 } else { rng.range(5, 101) as u32 },
        batch_max: if rng.chance(0.3) { rng.range(8, 33) as u32 } else { rng.range(1, 8) as u32 },
        enqueue_window_ms: safety_ms * window_tenths / 10,
        priority_spread: rng.range(0, 4) as i16,
        delay_chance: rng.next_f64() * 0.4,
        delay_max_ms: rng.range(1_000, 60_001),
        good_until_chance: rng.next_f64() * 0.4,
        good_until_max_ms: rng.range(1_000, 120_001),
        retry_chance: rng.next_f64() * 0.6,
        key_chance: rng.next_f64() * 0.3,
        cancel_chance: if rng.chance(0.3) { rng.next_f64() * 0.5 } else { 0.0 },
        error_chance: rng.next_f64() * 0.4,
        panic_chance: rng.next_f64() * 0.1,
        odd_error_chance: rng.next_f64() * 0.05,
        hang_chance: if rng.chance(0.5) { rng.next_f64() * 0.1 } else { 0.0 },
        slow_chance: rng.next_f64() * 0.2,
        slow_max_ms: rng.range(1_000, 20_001),
        duration_max_ms: if rng.chance(0.5) { rng.range(5, 201) } else { rng.range(200, 5_001) },
        workflows: 0,
        workflow_steps_max: 2,
        allow_failed_chance: 0.0,
        pause_on_error_chance: 0.0,
        workflow_actions: 0,
    }
}

/// The workflow knobs of the load: none in a third of the seeds, a few in most, dozens in
/// some; small graphs or large ones; `allow_failed` edges and pause-on-error workflows in some
/// seeds only; operator actions in some. No workflow when every queue is paused (cap 0): its
/// steps could never run.
fn swarm_workflows(rng: &mut Rng, load: &mut LoadOptions, app: &AppConfig) {
    let runnable = app.queues().iter().any(|q| q.max_concurrency != Some(0));
    let workflows = match rng.range(0, 20) {
        0..=6 => 0,
        7..=15 => rng.range(1, 5),
        16..=18 => rng.range(5, 13),
        _ => rng.range(13, 33),
    };
    load.workflows = if runnable { workflows as u32 } else { 0 };
    load.workflow_steps_max = match rng.range(0, 4) {
        0 => rng.range(2, 5),
        1 | 2 => rng.range(5, 11),
        _ => rng.range(11, 25),
    } as u32;
    load.allow_failed_chance = if rng.chance(0.3) { 0.0 } else { rng.next_f64() * 0.6 };
    load.pause_on_error_chance = if rng.chance(0.4) { 0.0 } else { rng.next_f64() * 0.7 };
    load.workflow_actions =
        if load.workflows == 0 || rng.chance(0.4) { 0 } else { rng.range(1, 2 * u64::from(load.workflows) + 2) as u32 };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swarmed_configurations_are_valid() {
        let mut rng = Rng::new(1);
        for _ in 0..2_000 {
            let options = SimOptions::swarm(&mut rng);
            options.app.validate().unwrap_or_else(|e| panic!("{e}\n{:#?}", options.app));
            for worker in &options.workers {
                worker.validate(&options.app).unwrap_or_else(|e| panic!("{e}\n{worker:#?}"));
            }
            assert!((1..=5).contains(&options.workers.len()));
        }
    }

    #[test]
    fn swarmed_retry_policies_are_valid() {
        let mut rng = Rng::new(2);
        for _ in 0..2_000 {
            let policy = swarm_retry(&mut rng);
            policy.validate().unwrap_or_else(|e| panic!("{e}\n{policy:#?}"));
        }
    }
}
