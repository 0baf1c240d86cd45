//! A worker's counters in the Prometheus (OpenMetrics) text format: the machine's own
//! [`Stats`](crate::worker::Stats) as counters, its [`Health`](crate::worker::Health) as
//! gauges, and the driver's measures of each kind of database request as histograms. Rendered
//! from a snapshot when scraped, so nothing is counted twice; any HTTP server can serve it
//! (the tokio adapter's `http` feature does, with health checks beside it).

use std::collections::BTreeMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use super::observe::{CounterSnapshot, REQUEST_SECONDS_BUCKETS, REQUEST_TASKS_BUCKETS, RequestStats};

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The metrics of one worker, every name prefixed `canter_`: `worker` is its id (on the
/// `canter_worker_info` metric only, so that a restart does not start new series).
pub fn render(worker: &str, snapshot: &CounterSnapshot, requests: &BTreeMap<&'static str, RequestStats>) -> String {
    let mut registry = Registry::with_prefix("canter");
    registry.register_collector(Box::new(WorkerMetrics {
        worker: worker.to_owned(),
        snapshot: *snapshot,
        requests: requests.iter().map(|(kind, stats)| (*kind, stats.clone())).collect(),
    }));
    let mut text = String::new();
    // Writing to a String does not fail, and every value here encodes.
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoding to a string");
    text
}

/// One queue as a dashboard sees it, for [`render_queues`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueGauges {
    /// The queue.
    pub queue: String,
    /// Pending tasks claimable now.
    pub due: u64,
    /// Pending tasks whose run-at is ahead.
    pub scheduled: u64,
    /// Claimed tasks not started.
    pub claimed: u64,
    /// Running tasks.
    pub running: u64,
    /// How long its oldest claimable task has waited, if it has one.
    pub oldest_due_age_seconds: Option<f64>,
    /// Whether it is paused.
    pub paused: bool,
    /// Tasks that reached each terminal state since the dashboard started counting.
    pub finished: Vec<(crate::task::TaskState, u64)>,
}

/// The metrics of a dashboard: each queue's depth by state, the age of its oldest claimable
/// task, whether it is paused, its finished tasks by state (counters from the dashboard's
/// start), and the live workers.
pub fn render_queues(queues: &[QueueGauges], live_workers: u64) -> String {
    let mut registry = Registry::with_prefix("canter");
    registry.register_collector(Box::new(QueueMetrics { queues: queues.to_vec(), live_workers }));
    let mut text = String::new();
    // Writing to a String does not fail, and every value here encodes.
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoding to a string");
    text
}

#[derive(Debug)]
struct QueueMetrics {
    queues: Vec<QueueGauges>,
    live_workers: u64,
}

impl Collector for QueueMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut depth = encoder.encode_descriptor(
            "queue_tasks",
            "Live tasks per queue and state (due and scheduled are Pending now or later).",
            None,
            MetricType::Gauge,
        )?;
        for q in &self.queues {
            for (state, n) in
                [("due", q.due), ("scheduled", q.scheduled), ("claimed", q.claimed), ("running", q.running)]
            {
                ConstGauge::new(n as i64)
                    .encode(depth.encode_family(&[("queue", q.queue.as_str()), ("state", state)])?)?;
            }
        }
        let mut age = encoder.encode_descriptor(
            "queue_oldest_due_age",
            "How long the oldest claimable task of each queue has waited (0 when none).",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        for q in &self.queues {
            ConstGauge::new(q.oldest_due_age_seconds.unwrap_or(0.0))
                .encode(age.encode_family(&[("queue", q.queue.as_str())])?)?;
        }
        let mut paused =
            encoder.encode_descriptor("queue_paused", "1 while the queue is paused.", None, MetricType::Gauge)?;
        for q in &self.queues {
            ConstGauge::new(i64::from(q.paused)).encode(paused.encode_family(&[("queue", q.queue.as_str())])?)?;
        }
        let mut finished = encoder.encode_descriptor(
            "queue_tasks_finished",
            "Tasks that reached a terminal state, per queue and state, since the dashboard started.",
            None,
            MetricType::Counter,
        )?;
        for q in &self.queues {
            for (state, n) in &q.finished {
                ConstCounter::new(*n)
                    .encode(finished.encode_family(&[("queue", q.queue.as_str()), ("state", state.as_str())])?)?;
            }
        }
        let workers = ConstGauge::new(self.live_workers as i64);
        workers.encode(encoder.encode_descriptor(
            "workers_live",
            "Registered workers not stopped.",
            None,
            workers.metric_type(),
        )?)?;
        Ok(())
    }
}

#[derive(Debug)]
struct WorkerMetrics {
    worker: String,
    snapshot: CounterSnapshot,
    requests: Vec<(&'static str, RequestStats)>,
}

impl Collector for WorkerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = &self.snapshot.stats;
        let h = &self.snapshot.health;
        let info = encoder.encode_descriptor("worker", "This worker's id.", None, MetricType::Info)?;
        { info }.encode_info(&[("worker", self.worker.as_str()), ("version", env!("CARGO_PKG_VERSION"))])?;
        let counters: [(&str, &str, u64); 19] = [
            ("worker_tasks_claimed", "Tasks claimed.", s.claimed),
            ("worker_tasks_started", "Handlers started.", s.started),
            ("worker_tasks_completed", "Tasks completed (written).", s.completed),
            ("worker_tasks_failed", "Tasks failed for good (written).", s.failed),
            ("worker_tasks_retried", "Runs that failed and will be retried (written).", s.retried),
            ("worker_tasks_expired", "Tasks that expired at start.", s.expired),
            ("worker_tasks_timed_out", "Handlers that ran past their timeout.", s.timed_out),
            ("worker_tasks_lost", "Tasks whose lease another holder took (their writes were fenced out).", s.lost),
            ("worker_claim_passes", "Claim requests sent.", s.claim_passes),
            (
                "worker_notifications_coalesced",
                "Notifications that added nothing to a claim already due.",
                s.notifications_coalesced,
            ),
            (
                "worker_notified_passes_limited",
                "Claim passes held back by the rate of empty notified passes.",
                s.notified_passes_limited,
            ),
            (
                "worker_db_failures",
                "Database requests that failed (outages, timeouts, refusals, locks held too long).",
                s.db_failures,
            ),
            (
                "worker_reaps_skipped",
                "Reaper passes skipped because another worker's reaper held the lock.",
                s.reaps_skipped,
            ),
            (
                "worker_dead_workers_recovered",
                "Dead workers whose tasks this worker recovered.",
                s.dead_workers_recovered,
            ),
            (
                "worker_outcomes_refused",
                "Outcomes the database could not store, failed with WORKER_SERIALIZATION_ERROR.",
                s.outcomes_refused,
            ),
            (
                "worker_outcomes_dropped",
                "Completions the database kept refusing, left to the reaper.",
                s.outcomes_dropped,
            ),
            (
                "worker_waiting_marks",
                "Times this worker ran out of work and marked itself waiting, so that enqueues notify it.",
                s.waiting_marks,
            ),
            (
                "worker_looks",
                "Small claims that looked at every row beside passes bounded by announced run-ats.",
                s.looks,
            ),
            (
                "worker_hook_events_dropped",
                "Events dropped because a hook fell behind.",
                self.snapshot.hook_events_dropped,
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        let gauges: [(&str, &str, i64); 9] = [
            (
                "worker_tasks_in_flight",
                "Tasks held now: claimed, running, or finished and not yet written.",
                self.snapshot.in_flight as i64,
            ),
            ("worker_tasks_running", "Handlers running now.", i64::from(h.running)),
            ("worker_tasks_buffered", "Claims held that have not started.", i64::from(h.buffered)),
            ("worker_concurrency", "Handlers the worker may run at once.", i64::from(h.concurrency)),
            (
                "worker_db_failures_in_a_row",
                "Database outages in a row with no successful request since (the backoff's step).",
                i64::from(h.db_failures_in_a_row),
            ),
            ("worker_listening", "1 while the LISTEN connection is up.", i64::from(h.listening)),
            ("worker_polling", "1 while the worker polls for work.", i64::from(h.polling)),
            ("worker_shutting_down", "1 once shutdown has begun.", i64::from(h.shutting_down)),
            ("worker_ready", "1 while the worker is ready (what /readyz answers).", i64::from(h.ready())),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let mut durations = encoder.encode_descriptor(
            "db_request_duration",
            "Database requests by kind: from sent to answered.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for (kind, stats) in &self.requests {
            let buckets = with_bounds(&REQUEST_SECONDS_BUCKETS, &stats.seconds_buckets);
            durations.encode_family(&[("kind", *kind)])?.encode_histogram::<NoExemplar>(
                stats.seconds_sum,
                stats.count,
                &buckets,
                None,
            )?;
        }
        let mut sizes = encoder.encode_descriptor(
            "db_request_tasks",
            "Database requests by kind: the tasks each named (a finish's outcomes, a heartbeat's leases) or, for a claim, brought back (batch sizes).",
            None,
            MetricType::Histogram,
        )?;
        for (kind, stats) in &self.requests {
            let buckets = with_bounds(&REQUEST_TASKS_BUCKETS, &stats.tasks_buckets);
            sizes.encode_family(&[("kind", *kind)])?.encode_histogram::<NoExemplar>(
                stats.tasks_sum as f64,
                stats.count,
                &buckets,
                None,
            )?;
        }
        let mut failures = encoder.encode_descriptor(
            "db_request_failures",
            "Database requests by kind that failed.",
            None,
            MetricType::Counter,
        )?;
        for (kind, stats) in &self.requests {
            ConstCounter::new(stats.failures).encode(failures.encode_family(&[("kind", *kind)])?)?;
        }
        Ok(())
    }
}

/// Exemplars are not kept.
type NoExemplar = [(&'static str, &'static str); 0];

/// Per-bucket counts with their upper bounds, the last one unbounded.
fn with_bounds(bounds: &[f64], counts: &[u64]) -> Vec<(f64, u64)> {
    bounds.iter().copied().chain([f64::INFINITY]).zip(counts.iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::driver::Counters;
    use crate::worker::{Health, Stats};

    /// The samples of an OpenMetrics text: name with labels, and value. Lines are checked for
    /// their shape on the way (a comment, or a name, optional labels and a number).
    pub(crate) fn samples(text: &str) -> BTreeMap<String, f64> {
        assert!(text.ends_with("# EOF\n"), "an OpenMetrics text ends with # EOF");
        let mut samples = BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
            let name = key.split('{').next().unwrap_or_default();
            assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "name: {line}");
            let value =
                if value == "+Inf" { f64::INFINITY } else { value.parse().unwrap_or_else(|_| panic!("{line}")) };
            assert!(samples.insert(key.to_owned(), value).is_none(), "twice: {line}");
        }
        samples
    }

    #[test]
    fn the_text_carries_the_machines_counts_health_and_requests() {
        let counters = Counters::new();
        let health =
            Health { running: 3, buffered: 7, concurrency: 16, listening: true, polling: true, ..Health::default() };
        counters.publish(
            Stats { claimed: 12, started: 10, completed: 9, failed: 1, lost: 2, ..Stats::default() },
            health,
            10,
        );
        counters.record_request("claim", Duration::from_millis(2), 12, true);
        counters.record_request("claim", Duration::from_millis(40), 0, false);
        counters.record_request("finish", Duration::from_micros(700), 10, true);
        let text = render("w-1", &counters.snapshot(), &counters.requests());
        let s = samples(&text);
        assert_eq!(s["canter_worker_info{worker=\"w-1\",version=\"0.1.0\"}"], 1.0);
        assert_eq!(s["canter_worker_tasks_claimed_total"], 12.0);
        assert_eq!(s["canter_worker_tasks_completed_total"], 9.0);
        assert_eq!(s["canter_worker_tasks_failed_total"], 1.0);
        assert_eq!(s["canter_worker_tasks_lost_total"], 2.0);
        assert_eq!(s["canter_worker_tasks_in_flight"], 10.0);
        assert_eq!(s["canter_worker_tasks_running"], 3.0);
        assert_eq!(s["canter_worker_tasks_buffered"], 7.0);
        assert_eq!(s["canter_worker_ready"], 1.0);
        assert_eq!(s["canter_db_request_duration_seconds_count{kind=\"claim\"}"], 2.0);
        // Cumulative buckets: 2 ms is under 2.5 ms, 40 ms under 50 ms.
        assert_eq!(s["canter_db_request_duration_seconds_bucket{le=\"0.0025\",kind=\"claim\"}"], 1.0);
        assert_eq!(s["canter_db_request_duration_seconds_bucket{le=\"0.05\",kind=\"claim\"}"], 2.0);
        assert_eq!(s["canter_db_request_duration_seconds_bucket{le=\"+Inf\",kind=\"claim\"}"], 2.0);
        assert_eq!(s["canter_db_request_tasks_sum{kind=\"claim\"}"], 12.0);
        assert_eq!(s["canter_db_request_tasks_bucket{le=\"10.0\",kind=\"finish\"}"], 1.0);
        assert_eq!(s["canter_db_request_failures_total{kind=\"claim\"}"], 1.0);
        assert_eq!(s["canter_db_request_failures_total{kind=\"finish\"}"], 0.0);
        assert!(text.contains("# TYPE canter_worker_tasks_claimed counter"), "{text}");
        assert!(text.contains("# HELP canter_worker_tasks_claimed Tasks claimed."), "{text}");
    }

    #[test]
    fn an_unready_worker_says_so() {
        let counters = Counters::new();
        let health = Health { shutting_down: true, polling: true, ..Health::default() };
        counters.publish(Stats::default(), health, 0);
        let s = samples(&render("w", &counters.snapshot(), &counters.requests()));
        assert_eq!((s["canter_worker_ready"], s["canter_worker_shutting_down"]), (0.0, 1.0));
    }

    #[test]
    fn a_worker_id_of_any_text_keeps_the_text_readable() {
        let counters = Counters::new();
        let text = render("w\"1\n\\x {y}", &counters.snapshot(), &counters.requests());
        let s = samples(&text);
        assert_eq!(s["canter_worker_info{worker=\"w\\\"1\\n\\\\x {y}\",version=\"0.1.0\"}"], 1.0, "{text}");
    }
}
