//! A flag for every setting of the configuration file: `canter worker --concurrency 32` sets
//! `worker.concurrency` over what `--config` gave. Each flag is typed (clap checks its value
//! and names the flag when it is wrong); the configuration's own rules (ranges, pairs of
//! settings) are checked once everything is laid over the file, and their problems name the
//! flag that set the value.

use std::collections::BTreeMap;

use canter_tokio::canter::check::{ConfigError, ConfigProblem};
use canter_tokio::canter::config::{BackoffStrategy, Config, CustomQueue, DeploymentMode, QueueMode};
use canter_tokio::canter::schedule::ScheduleConfig;
use canter_tokio::canter::task::ErrorCode;
use clap::Args;
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::args::{Millis, duration, json_value};

/// Every configuration setting as a flag (`None`: not given, the file's or default value stays).
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Settings (each overrides --config; ms values also take durations: 30s, 5m)")]
pub(crate) struct WorkerSettings {
    // [app]
    /// Whether the app has the one default queue or its own (--custom-queues)
    #[arg(long, value_name = "MODE", value_parser = enum_parser::<QueueMode>(&[("default", &[]), ("custom", &[])]))]
    pub(crate) queue_mode: Option<QueueMode>,
    /// The app's queues as JSON: [{"name":"emails","priority":1,"max_concurrency":4}]
    #[arg(long, value_name = "JSON", value_parser = json_of::<Vec<CustomQueue>>)]
    pub(crate) custom_queues: Option<std::vec::Vec<CustomQueue>>,
    /// The most tasks in flight across the cluster (hard-cap mode only)
    #[arg(long, value_name = "N")]
    pub(crate) cluster_wide_cap: Option<u32>,
    /// Tasks claimed beyond the concurrency; 0 is hard-cap mode (default 0)
    #[arg(long, value_name = "N")]
    pub(crate) prefetch_buffer: Option<u32>,
    /// How long a claim lasts unless renewed (default 60000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) claim_lease_ms: Option<Millis>,
    /// Claims older than this are not renewed (default 180000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) max_claim_renew_age_ms: Option<Millis>,
    /// The app's schedules as JSON (one object per [[app.schedules]] table)
    #[arg(long, value_name = "JSON", value_parser = json_of::<Vec<ScheduleConfig>>)]
    pub(crate) schedules: Option<std::vec::Vec<ScheduleConfig>>,

    // [app.resilience]
    /// The first delay after a database failure, 100 to 60000 (default 500)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) db_retry_initial_ms: Option<Millis>,
    /// The longest delay between database retries, 500 to 300000 (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) db_retry_max_ms: Option<Millis>,
    /// Consecutive database failures before giving up; 0 retries forever (default 0)
    #[arg(long, value_name = "N")]
    pub(crate) db_retry_max_attempts: Option<u32>,

    // [app.recovery]
    /// Return claimed tasks of silent claimers to pending (default true)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) auto_requeue_stale_claimed: Option<bool>,
    /// How long a claimer may stay silent (default 120000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) claimed_stale_threshold_ms: Option<Millis>,
    /// Retry or fail running tasks of silent runners (default true)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) auto_fail_stale_running: Option<bool>,
    /// How long a runner may stay silent (default 300000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) running_stale_threshold_ms: Option<Millis>,
    /// How often the reaper runs (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) check_interval_ms: Option<Millis>,
    /// How often a worker beats for the tasks it runs (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) runner_heartbeat_interval_ms: Option<Millis>,
    /// How often a worker beats for the tasks it holds claimed (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) claimer_heartbeat_interval_ms: Option<Millis>,
    /// Delete finished tasks older than this (default: keep them)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) finished_retention_ms: Option<Millis>,
    /// Keep finished tasks holding an idempotency key this long (default: forever)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) idempotency_retention_ms: Option<Millis>,
    /// How long the registry keeps stopped workers (default 7d)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) worker_retention_ms: Option<Millis>,
    /// Recover at once the tasks of workers whose session died (default true)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) auto_recover_dead_workers: Option<bool>,
    /// How often a worker looks for dead workers' released tokens (default 1000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) liveness_check_interval_ms: Option<Millis>,
    /// How long a token must stay released before its worker counts as dead (default 2000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) liveness_grace_ms: Option<Millis>,
    /// Re-runs of a task whose worker crashed, 0 to 100 (default 2)
    #[arg(long, value_name = "N")]
    pub(crate) crash_retries: Option<u32>,
    /// Vacuum hot tables that gained this many dead rows; 0 leaves it to the server (default 10000)
    #[arg(long, value_name = "N")]
    pub(crate) vacuum_dead_rows: Option<u64>,

    // [app.retry]
    /// Retries of tasks enqueued without a policy, 0 to 20 (default 0)
    #[arg(long, value_name = "N")]
    pub(crate) max_retries: Option<u32>,
    /// Retry delays in seconds, comma-separated (exponential backoff: one, the base)
    #[arg(long, value_name = "S,...", value_delimiter = ',', num_args = 1..)]
    pub(crate) intervals_secs: Option<Vec<u32>>,
    /// How retry delays grow
    #[arg(long, value_name = "KIND",
          value_parser = enum_parser::<BackoffStrategy>(&[("fixed", &[]), ("exponential", &[])]))]
    pub(crate) backoff: Option<BackoffStrategy>,
    /// Spread retry delays by ±25% (default true)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) jitter: Option<bool>,
    /// Error codes that are retried, comma-separated (default TASK_ERROR,UNHANDLED_ERROR,TASK_TIMEOUT,WORKER_CRASHED)
    #[arg(long, value_name = "CODE,...", value_delimiter = ',', num_args = 1.., value_parser = error_code)]
    pub(crate) auto_retry_for: Option<Vec<ErrorCode>>,

    // [worker]
    /// The queues this worker serves, comma-separated (default: all of the app's; an app without
    /// queues of its own gets these)
    #[arg(long, value_name = "QUEUE,...", value_delimiter = ',', num_args = 1..)]
    pub(crate) queues: Option<Vec<String>>,
    /// The most tasks this worker runs at once, 1 to 10000 (default 16)
    #[arg(long, value_name = "N")]
    pub(crate) concurrency: Option<u32>,
    /// The most tasks claimed from one queue in one pass; 0 fills the budget (default 0)
    #[arg(long, value_name = "N")]
    pub(crate) max_claim_batch: Option<u32>,
    /// The most live claimed tasks this worker holds; 0 is automatic (default 0)
    #[arg(long, value_name = "N")]
    pub(crate) max_claim_per_worker: Option<u32>,
    /// This worker's own queue priorities, comma-separated QUEUE=PRIORITY pairs (1 to 100)
    #[arg(long, value_name = "QUEUE=N,...", value_delimiter = ',', num_args = 1.., value_parser = queue_priority)]
    pub(crate) queue_priorities: Option<Vec<(String, u8)>>,
    /// The most notifications drained into one claim pass (default 100)
    #[arg(long, value_name = "N")]
    pub(crate) coalesce_notifies: Option<u32>,
    /// How the worker learns of work
    #[arg(long, value_name = "MODE", value_parser = enum_parser::<DeploymentMode>(&[
        ("hybrid", &["Hybrid"]),
        ("polling_only", &["PollingOnly"]),
        ("event_driven_only", &["EventDrivenOnly"]),
    ]))]
    pub(crate) deployment_mode: Option<DeploymentMode>,
    /// The poll period, 1000 to 300000 (default 5000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) poll_interval_ms: Option<Millis>,
    /// How long a handler may run; 0 for no limit (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) handler_timeout_ms: Option<Millis>,
    /// How long running tasks may finish after shutdown is asked (default 30000)
    #[arg(long, value_name = "MS", value_parser = ms)]
    pub(crate) shutdown_grace_ms: Option<Millis>,
    /// The most completions written in one statement, 1 to 10000 (default 500)
    #[arg(long, value_name = "N")]
    pub(crate) completion_batch_max: Option<u32>,
    /// The largest result a handler may return, in JSON bytes (default 8388608)
    #[arg(long, value_name = "BYTES")]
    pub(crate) max_result_bytes: Option<u64>,
    /// The seed of the worker's jitter (default: random)
    #[arg(long, value_name = "N")]
    pub(crate) seed: Option<u64>,
    /// Do not claim tasks carrying any of these flags, comma-separated
    #[arg(long, value_name = "FLAG,...", value_delimiter = ',', num_args = 1..)]
    pub(crate) forbidden_flags: Option<Vec<String>>,
    /// Also run the scheduler of the app's schedules (default false)
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) run_scheduler: Option<bool>,
}

/// What laying flags over a configuration found wrong.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.join("; "))]
pub(crate) struct SettingsError(pub(crate) Vec<String>);

impl WorkerSettings {
    /// `base` with every given flag laid over it, checked as a whole. A problem with a value a
    /// flag set names the flag; one with a value of the file names the file's field.
    pub(crate) fn apply(&self, base: &Config) -> Result<Config, SettingsError> {
        let mut config = base.clone();
        let mut flags = BTreeMap::new();
        let mut set = |path: &'static str| {
            let field = path.rsplit('.').next().unwrap_or(path);
            flags.insert(path, format!("--{}", field.replace('_', "-")));
        };
        let (app, worker) = (&mut config.app, &mut config.worker);
        macro_rules! lay {
            ($path:literal, $slot:expr, $value:expr) => {
                if let Some(value) = $value.clone() {
                    $slot = value;
                    set($path);
                }
            };
        }
        lay!("app.queue_mode", app.queue_mode, self.queue_mode);
        lay!("app.custom_queues", app.custom_queues, self.custom_queues);
        lay!("app.cluster_wide_cap", app.cluster_wide_cap, self.cluster_wide_cap.map(Some));
        lay!("app.prefetch_buffer", app.prefetch_buffer, self.prefetch_buffer);
        lay!("app.claim_lease_ms", app.claim_lease_ms, self.claim_lease_ms.map(Some));
        lay!("app.max_claim_renew_age_ms", app.max_claim_renew_age_ms, self.max_claim_renew_age_ms);
        lay!("app.schedules", app.schedules, self.schedules);
        let resilience = &mut app.resilience;
        lay!("app.resilience.db_retry_initial_ms", resilience.db_retry_initial_ms, self.db_retry_initial_ms);
        lay!("app.resilience.db_retry_max_ms", resilience.db_retry_max_ms, self.db_retry_max_ms);
        lay!("app.resilience.db_retry_max_attempts", resilience.db_retry_max_attempts, self.db_retry_max_attempts);
        let recovery = &mut app.recovery;
        lay!(
            "app.recovery.auto_requeue_stale_claimed",
            recovery.auto_requeue_stale_claimed,
            self.auto_requeue_stale_claimed
        );
        lay!(
            "app.recovery.claimed_stale_threshold_ms",
            recovery.claimed_stale_threshold_ms,
            self.claimed_stale_threshold_ms
        );
        lay!("app.recovery.auto_fail_stale_running", recovery.auto_fail_stale_running, self.auto_fail_stale_running);
        lay!(
            "app.recovery.running_stale_threshold_ms",
            recovery.running_stale_threshold_ms,
            self.running_stale_threshold_ms
        );
        lay!("app.recovery.check_interval_ms", recovery.check_interval_ms, self.check_interval_ms);
        lay!(
            "app.recovery.runner_heartbeat_interval_ms",
            recovery.runner_heartbeat_interval_ms,
            self.runner_heartbeat_interval_ms
        );
        lay!(
            "app.recovery.claimer_heartbeat_interval_ms",
            recovery.claimer_heartbeat_interval_ms,
            self.claimer_heartbeat_interval_ms
        );
        lay!(
            "app.recovery.finished_retention_ms",
            recovery.finished_retention_ms,
            self.finished_retention_ms.map(Some)
        );
        lay!(
            "app.recovery.idempotency_retention_ms",
            recovery.idempotency_retention_ms,
            self.idempotency_retention_ms.map(Some)
        );
        lay!("app.recovery.worker_retention_ms", recovery.worker_retention_ms, self.worker_retention_ms);
        lay!(
            "app.recovery.auto_recover_dead_workers",
            recovery.auto_recover_dead_workers,
            self.auto_recover_dead_workers
        );
        lay!(
            "app.recovery.liveness_check_interval_ms",
            recovery.liveness_check_interval_ms,
            self.liveness_check_interval_ms
        );
        lay!("app.recovery.liveness_grace_ms", recovery.liveness_grace_ms, self.liveness_grace_ms);
        lay!("app.recovery.crash_retries", recovery.crash_retries, self.crash_retries);
        lay!("app.recovery.vacuum_dead_rows", recovery.vacuum_dead_rows, self.vacuum_dead_rows.map(zero_is_none));
        let retry = &mut app.retry;
        lay!("app.retry.max_retries", retry.max_retries, self.max_retries);
        lay!("app.retry.intervals_secs", retry.intervals_secs, self.intervals_secs);
        lay!("app.retry.backoff", retry.backoff, self.backoff);
        lay!("app.retry.jitter", retry.jitter, self.jitter);
        lay!("app.retry.auto_retry_for", retry.auto_retry_for, self.auto_retry_for);
        lay!("worker.queues", worker.queues, self.queues);
        lay!("worker.concurrency", worker.concurrency, self.concurrency);
        lay!("worker.max_claim_batch", worker.max_claim_batch, self.max_claim_batch);
        lay!("worker.max_claim_per_worker", worker.max_claim_per_worker, self.max_claim_per_worker);
        lay!(
            "worker.queue_priorities",
            worker.queue_priorities,
            self.queue_priorities.as_ref().map(|pairs| pairs.iter().cloned().collect())
        );
        lay!("worker.coalesce_notifies", worker.coalesce_notifies, self.coalesce_notifies);
        lay!("worker.deployment_mode", worker.deployment_mode, self.deployment_mode);
        lay!("worker.poll_interval_ms", worker.poll_interval_ms, self.poll_interval_ms);
        lay!("worker.handler_timeout_ms", worker.handler_timeout_ms, self.handler_timeout_ms.map(zero_is_none));
        lay!("worker.shutdown_grace_ms", worker.shutdown_grace_ms, self.shutdown_grace_ms);
        lay!("worker.completion_batch_max", worker.completion_batch_max, self.completion_batch_max);
        lay!("worker.max_result_bytes", worker.max_result_bytes, self.max_result_bytes);
        lay!("worker.seed", worker.seed, self.seed.map(Some));
        lay!("worker.forbidden_flags", worker.forbidden_flags, self.forbidden_flags);
        lay!("worker.run_scheduler", worker.run_scheduler, self.run_scheduler);
        // `--queues default,emails` on an app that declares no queues of its own (no file's,
        // no flag's) makes those its queues, as `canter enqueue --queue` takes any name.
        if let Some(queues) = &self.queues
            && base.app.queue_mode == QueueMode::Default
            && self.queue_mode.is_none()
            && self.custom_queues.is_none()
            && queues.iter().any(|q| q != canter_tokio::canter::config::DEFAULT_QUEUE_NAME)
        {
            config.app.queue_mode = QueueMode::Custom;
            config.app.custom_queues = queues.iter().map(CustomQueue::new).collect();
        }
        config.validate().map_err(|error| SettingsError::naming_flags(error, &flags))?;
        Ok(config)
    }
}

impl SettingsError {
    /// Each problem, naming the flag that set its field when a flag did.
    fn naming_flags(error: ConfigError, flags: &BTreeMap<&'static str, String>) -> SettingsError {
        let describe = |problem: &ConfigProblem| {
            // `app.custom_queues[2].name` was set by `--custom-queues` as a whole.
            let flag = flags
                .iter()
                .find(|(path, _)| {
                    problem.field == **path
                        || problem.field.strip_prefix(**path).is_some_and(|rest| rest.starts_with(['[', '.']))
                })
                .map(|(path, flag)| format!("{flag}{}", &problem.field[path.len()..]));
            match flag {
                Some(flag) => format!("{flag} is {}, expected {}", problem.value, problem.expected),
                None => format!(
                    "`{}` (in the configuration file) is {}, expected {}",
                    problem.field, problem.value, problem.expected
                ),
            }
        };
        SettingsError(error.problems.iter().map(describe).collect())
    }
}

fn zero_is_none(value: u64) -> Option<u64> {
    (value != 0).then_some(value)
}

/// Milliseconds: a whole number, or a duration (`30s`, `5m`).
fn ms(text: &str) -> Result<Millis, String> {
    match text.trim().parse::<u64>() {
        Ok(ms) => Ok(ms),
        Err(_) => duration(text).map_err(|e| format!("{e}; or a whole number of milliseconds")),
    }
}

/// JSON decoded into `T`.
fn json_of<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    serde_json::from_value(json_value(text)?).map_err(|e| e.to_string())
}

/// An error code: a built-in's name, or a code of the user's.
fn error_code(text: &str) -> Result<ErrorCode, String> {
    match text.trim() {
        "" => Err("expected an error code, e.g. TASK_ERROR".into()),
        code => Ok(ErrorCode::parse(code)),
    }
}

/// `QUEUE=PRIORITY`.
fn queue_priority(text: &str) -> Result<(String, u8), String> {
    let (queue, priority) =
        text.split_once('=').ok_or_else(|| format!("expected QUEUE=PRIORITY, e.g. emails=1, not {text:?}"))?;
    let priority =
        priority.trim().parse::<u8>().map_err(|_| format!("expected a priority 1 to 100, not {priority:?}"))?;
    Ok((queue.trim().to_owned(), priority))
}

/// An enum of the configuration by its names (with aliases), decoded as the file decodes it.
fn enum_parser<T: serde::de::DeserializeOwned + Send + Sync + Clone + 'static>(
    names: &'static [(&'static str, &'static [&'static str])],
) -> impl TypedValueParser<Value = T> {
    let values = names.iter().map(|(name, aliases)| PossibleValue::new(*name).aliases(aliases.iter().copied()));
    PossibleValuesParser::new(values).try_map(|name| serde_json::from_value::<T>(serde_json::Value::String(name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Debug, Parser)]
    struct Flags {
        #[command(flatten)]
        settings: WorkerSettings,
    }

    fn apply(args: &[&str]) -> Result<Config, String> {
        let flags =
            Flags::try_parse_from(std::iter::once("worker").chain(args.iter().copied())).map_err(|e| e.to_string())?;
        flags.settings.apply(&Config::default()).map_err(|e| e.to_string())
    }

    /// Every field of the configuration file has a flag of the same name.
    #[test]
    fn every_setting_has_a_flag() {
        let mut full = Config::default();
        full.app.cluster_wide_cap = Some(1);
        full.app.claim_lease_ms = Some(1);
        full.app.recovery.finished_retention_ms = Some(1);
        full.app.recovery.idempotency_retention_ms = Some(1);
        full.worker.seed = Some(1);
        full.worker.forbidden_flags = vec!["x".into()];
        full.app.schedules = Vec::new();
        let json = serde_json::to_value(&full).expect("a configuration serializes");
        let mut fields = vec!["schedules".to_owned()];
        for section in
            [&json["app"], &json["app"]["recovery"], &json["app"]["resilience"], &json["app"]["retry"], &json["worker"]]
        {
            let object = section.as_object().expect("a table");
            fields
                .extend(object.keys().filter(|k| !["recovery", "resilience", "retry"].contains(&k.as_str())).cloned());
        }
        let command = Flags::command();
        let flags: Vec<&str> = command.get_arguments().filter_map(|a| a.get_long()).collect();
        for field in fields {
            let flag = field.replace('_', "-");
            assert!(flags.contains(&flag.as_str()), "no flag --{flag} for the setting {field}");
        }
    }

    #[test]
    fn flags_set_their_settings() {
        let config = apply(&[
            "--concurrency",
            "4",
            "--queues",
            "default,emails",
            "--queue-mode",
            "custom",
            "--custom-queues",
            r#"[{"name":"default"},{"name":"emails","max_concurrency":2}]"#,
            "--claim-lease-ms",
            "90s",
            "--check-interval-ms",
            "5000",
            "--deployment-mode",
            "PollingOnly",
            "--run-scheduler",
            "--jitter",
            "false",
            "--handler-timeout-ms",
            "0",
            "--queue-priorities",
            "emails=3",
            "--auto-retry-for",
            "TASK_ERROR,FLAKY",
        ])
        .expect("valid flags");
        assert_eq!(config.worker.concurrency, 4);
        let queues: Vec<&str> = config.app.custom_queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(queues, ["default", "emails"], "the flag's queues");
        assert_eq!(config.worker.queues, ["default", "emails"]);
        assert_eq!(config.app.claim_lease_ms, Some(90_000));
        assert_eq!(config.app.recovery.check_interval_ms, 5_000);
        assert_eq!(config.worker.deployment_mode, DeploymentMode::PollingOnly);
        assert!(config.worker.run_scheduler);
        assert!(!config.app.retry.jitter);
        assert_eq!(config.worker.handler_timeout_ms, None);
        assert_eq!(config.worker.queue_priorities.get("emails"), Some(&3));
        assert_eq!(config.app.retry.auto_retry_for, [ErrorCode::TaskError, ErrorCode::User("FLAKY".into())]);
    }

    #[test]
    fn problems_name_the_flag_and_what_is_allowed() {
        let error = apply(&["--concurrency", "0"]).unwrap_err();
        assert!(error.contains("--concurrency is 0, expected"), "{error}");
        let error = apply(&["--deployment-mode", "sometimes"]).unwrap_err();
        assert!(error.contains("--deployment-mode") && error.contains("polling_only"), "{error}");
        let error = apply(&["--concurrency", "many"]).unwrap_err();
        assert!(error.contains("--concurrency"), "{error}");
        let error = apply(&["--queue-mode", "custom", "--custom-queues", r#"[{"name":"Bad Name"}]"#]).unwrap_err();
        assert!(error.contains("--custom-queues[0].name is"), "{error}");
        assert!(!error.contains("configuration: "), "no position in an internal document: {error}");
    }

    /// The README's own example: an app without queues of its own serves the named ones.
    #[test]
    fn named_queues_become_the_queues_of_an_app_without_its_own() {
        let config = apply(&["--queues", "default,emails"]).expect("the README's example");
        let queues: Vec<&str> = config.app.custom_queues.iter().map(|q| q.name.as_str()).collect();
        assert_eq!(queues, ["default", "emails"]);
        assert_eq!(config.worker.queues, ["default", "emails"]);
        // Only the default queue: nothing to declare.
        assert_eq!(apply(&["--queues", "default"]).expect("default").app.queue_mode, QueueMode::Default);
    }
}
