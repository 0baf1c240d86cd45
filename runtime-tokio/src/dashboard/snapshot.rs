//! The overview every page and every open dashboard shares: read by one task per dashboard
//! (not per request, not per viewer), at most every `refresh` and never more than 1/20 of the
//! time (a read that took 300 ms waits 6 s for the next), sooner when a queue is notified.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use canter::postgres::PgStore;
use canter::store::{DbTime, FinishedCount, PausedQueue, QueueDepth, WorkerLoad, WorkerRecord};
use canter::task::TaskState;
use serde::Serialize;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio::time::Instant;

/// How far behind the database's clock the finished tasks are counted: a finishing
/// transaction commits after its `finished_at`, and one that commits after the count would be
/// missed for good.
const FINISH_LAG_MS: i64 = 2_000;

/// How long the throughput chart reaches back.
const THROUGHPUT_SPAN_MS: i64 = 10 * 60 * 1_000;

/// The share of its time the refresher may spend reading: it waits 20 times its last read.
const READ_SHARE: u32 = 20;

/// The least time between two refreshes, however often queues are notified.
const DEBOUNCE: Duration = Duration::from_millis(250);

/// How long the refresher keeps reading after the last request or viewer went away.
const IDLE_AFTER: Duration = Duration::from_secs(30);

/// One queue as the overview shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct QueueRow {
    pub(crate) queue: String,
    pub(crate) due: u64,
    pub(crate) scheduled: u64,
    pub(crate) claimed: u64,
    pub(crate) running: u64,
    pub(crate) oldest_due_at: Option<i64>,
    pub(crate) paused: bool,
    pub(crate) paused_at: Option<i64>,
    pub(crate) max_concurrency: Option<u32>,
    pub(crate) serial: bool,
    pub(crate) completed: u64,
    pub(crate) failed: u64,
    pub(crate) cancelled: u64,
    pub(crate) expired: u64,
    pub(crate) skipped: u64,
}

/// A point of the throughput chart: tasks per second since the point before.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Rate {
    at: i64,
    completed: f64,
    failed: f64,
}

/// A worker as the overview shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct WorkerRow {
    id: String,
    queues: Vec<String>,
    concurrency: u32,
    last_seen: i64,
    pub(crate) stopped: bool,
    claimed: u64,
    running: u64,
}

/// What the overview page, the queues page, `/metrics` and the event stream show.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Overview {
    pub(crate) at: i64,
    pub(crate) since: i64,
    pub(crate) read_only: bool,
    pub(crate) refresh_ms: u64,
    pub(crate) took_ms: u64,
    pub(crate) queues: Vec<QueueRow>,
    pub(crate) throughput: VecDeque<Rate>,
    pub(crate) workers: Vec<WorkerRow>,
    /// Why the last refresh failed, while the database does not answer.
    pub(crate) error: Option<String>,
}

/// The overview as served: the value and its JSON, rendered once for every viewer.
#[derive(Debug)]
pub(crate) struct Published {
    pub(crate) overview: Option<Overview>,
    pub(crate) json: Arc<str>,
}

/// The finished tasks counted so far, from the first refresh on.
#[derive(Debug, Default)]
struct Tally {
    /// The span counted: [since, upto).
    since: Option<i64>,
    upto: i64,
    by_queue: BTreeMap<(String, TaskState), u64>,
    throughput: VecDeque<Rate>,
}

impl Tally {
    /// Adds what finished in [upto, to) and the rate it makes.
    fn add(&mut self, counts: &[FinishedCount], to: i64) {
        let (mut completed, mut failed) = (0u64, 0u64);
        for count in counts {
            *self.by_queue.entry((count.queue.clone(), count.state)).or_insert(0) += count.tasks;
            match count.state {
                TaskState::Completed => completed += count.tasks,
                TaskState::Failed => failed += count.tasks,
                _ => {}
            }
        }
        let seconds = (to - self.upto) as f64 / 1_000.0;
        if seconds > 0.0 {
            self.throughput.push_back(Rate {
                at: to,
                completed: completed as f64 / seconds,
                failed: failed as f64 / seconds,
            });
        }
        while self.throughput.front().is_some_and(|rate| rate.at < to - THROUGHPUT_SPAN_MS) {
            self.throughput.pop_front();
        }
        self.upto = to;
    }

    fn finished(&self, queue: &str, state: TaskState) -> u64 {
        self.by_queue.get(&(queue.to_owned(), state)).copied().unwrap_or(0)
    }
}

/// What one refresh reads: five statements, none of which scans history.
struct Reading {
    now: DbTime,
    depths: Vec<QueueDepth>,
    paused: Vec<PausedQueue>,
    workers: Vec<WorkerRecord>,
    loads: Vec<WorkerLoad>,
    finished: Vec<FinishedCount>,
}

async fn read(store: &PgStore, tally: &Tally) -> Result<(Reading, i64), sqlx::Error> {
    let now = store.now().await?;
    let to = now.0 - FINISH_LAG_MS;
    let finished = match tally.since {
        // The first refresh starts the count.
        None => Vec::new(),
        Some(_) => store.finished_counts(DbTime(tally.upto), DbTime(to)).await?,
    };
    let reading = Reading {
        now,
        depths: store.queue_depths().await?,
        paused: store.paused_queues().await?,
        workers: store.workers().await?,
        loads: store.worker_loads().await?,
        finished,
    };
    Ok((reading, to))
}

fn overview(store: &PgStore, reading: Reading, tally: &Tally, read_only: bool, refresh: Duration) -> Overview {
    let app = store.app();
    let configured = app.queues();
    // Every queue that has live tasks, is paused, is configured or finished tasks lately.
    let mut names: std::collections::BTreeSet<String> = reading.depths.iter().map(|d| d.queue.clone()).collect();
    names.extend(reading.paused.iter().map(|p| p.queue.clone()));
    names.extend(configured.iter().map(|q| q.name.clone()));
    names.extend(tally.by_queue.keys().map(|(queue, _)| queue.clone()));
    let queues = names
        .into_iter()
        .map(|queue| {
            let depth = reading.depths.iter().find(|d| d.queue == queue);
            let paused = reading.paused.iter().find(|p| p.queue == queue);
            let config = configured.iter().find(|q| q.name == queue);
            let n = |f: fn(&QueueDepth) -> u64| depth.map_or(0, f);
            QueueRow {
                due: n(|d| d.due),
                scheduled: n(|d| d.scheduled),
                claimed: n(|d| d.claimed),
                running: n(|d| d.running),
                oldest_due_at: depth.and_then(|d| d.oldest_due).map(|t| t.0),
                paused: paused.is_some(),
                paused_at: paused.map(|p| p.paused_at.0),
                max_concurrency: config.and_then(|q| q.max_concurrency),
                serial: config.is_some_and(|q| q.serial),
                completed: tally.finished(&queue, TaskState::Completed),
                failed: tally.finished(&queue, TaskState::Failed),
                cancelled: tally.finished(&queue, TaskState::Cancelled),
                expired: tally.finished(&queue, TaskState::Expired),
                skipped: tally.finished(&queue, TaskState::Skipped),
                queue,
            }
        })
        .collect();
    let workers = reading
        .workers
        .into_iter()
        .map(|w| {
            let load = reading.loads.iter().find(|l| l.worker == w.info.worker);
            WorkerRow {
                claimed: load.map_or(0, |l| l.claimed),
                running: load.map_or(0, |l| l.running),
                id: w.info.worker.0,
                queues: w.info.queues,
                concurrency: w.info.concurrency,
                last_seen: w.last_seen.0,
                stopped: w.stopped,
            }
        })
        .collect();
    Overview {
        at: reading.now.0,
        since: tally.since.unwrap_or(reading.now.0),
        read_only,
        refresh_ms: refresh.as_millis() as u64,
        took_ms: 0,
        queues,
        throughput: tally.throughput.clone(),
        workers,
        error: None,
    }
}

/// What the refresher needs to know of its viewers.
#[derive(Debug)]
pub(crate) struct Demand {
    /// Set by each request that reads the overview: the refresher reads on for a while after.
    pub(crate) asked: tokio::sync::Notify,
    /// Set by each action: the next reading shows what it did as soon as the bound allows.
    pub(crate) acted: tokio::sync::Notify,
    pub(crate) last_asked: std::sync::Mutex<Option<Instant>>,
}

impl Demand {
    pub(crate) fn new() -> Demand {
        Demand {
            asked: tokio::sync::Notify::new(),
            acted: tokio::sync::Notify::new(),
            last_asked: std::sync::Mutex::new(None),
        }
    }

    /// A request wants a fresh overview.
    pub(crate) fn ask(&self) {
        if let Ok(mut last) = self.last_asked.lock() {
            *last = Some(Instant::now());
        }
        self.asked.notify_one();
    }

    fn recently(&self) -> bool {
        self.last_asked.lock().ok().and_then(|last| *last).is_some_and(|at| at.elapsed() < IDLE_AFTER)
    }
}

/// Refreshes the overview while anyone looks (an event stream is open, or a request asked
/// lately), until `published` has no receiver left or `closed` fires.
pub(crate) async fn refresh(
    store: PgStore,
    published: watch::Sender<Arc<Published>>,
    demand: Arc<Demand>,
    read_only: bool,
    refresh_every: Duration,
    mut closed: watch::Receiver<bool>,
) {
    let mut tally = Tally::default();
    let mut listener: Option<PgListener> = None;
    let mut heard: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
    loop {
        // The event streams hold receivers; requests ask. Nobody looking: nothing is read, and
        // nothing listens (unread notifications would hold up the server's queue of them).
        if published.receiver_count() <= 1 && !demand.recently() {
            listener = None;
            heard.clear();
        }
        while published.receiver_count() <= 1 && !demand.recently() {
            tokio::select! {
                () = demand.asked.notified() => {}
                _ = closed.changed() => return,
            }
        }
        let started = Instant::now();
        let next = match read(&store, &tally).await {
            Ok((reading, to)) => {
                if tally.since.is_none() {
                    tally.since = Some(to);
                    tally.upto = to;
                }
                tally.add(&reading.finished, to);
                let queues: Vec<String> = reading.depths.iter().map(|d| d.queue.clone()).collect();
                let mut value = overview(&store, reading, &tally, read_only, refresh_every);
                value.took_ms = started.elapsed().as_millis() as u64;
                listen(&store, &mut listener, &mut heard, queues).await;
                value
            }
            Err(error) => {
                let mut value = published.borrow().overview.clone().unwrap_or_else(|| Overview {
                    read_only,
                    refresh_ms: refresh_every.as_millis() as u64,
                    ..Overview::default()
                });
                value.error = Some(format!("the database did not answer: {}", canter::postgres::error_text(&error)));
                listener = None;
                heard.clear();
                value
            }
        };
        let json: Arc<str> = serde_json::to_string(&next).unwrap_or_else(|_| "{}".to_owned()).into();
        published.send_replace(Arc::new(Published { overview: Some(next), json }));
        let took = started.elapsed();
        let soonest = started + (took * READ_SHARE).max(DEBOUNCE);
        let latest = started + refresh_every.max(took * READ_SHARE).max(DEBOUNCE);
        // Sooner when a queue is notified (new or resumed work) or an action was taken, never
        // before `soonest`. Every notification is read as it comes, whatever is waited for.
        let woken = tokio::select! {
            heard = hear(&mut listener, latest, true) => heard,
            () = demand.acted.notified() => true,
            _ = closed.changed() => return,
        };
        if woken {
            tokio::select! {
                _ = hear(&mut listener, soonest, false) => {}
                _ = closed.changed() => return,
            }
        }
        if published.is_closed() {
            return;
        }
    }
}

/// Listens to the channels of `queues` not listened to yet, on the store's session pool.
async fn listen(
    store: &PgStore,
    listener: &mut Option<PgListener>,
    heard: &mut std::collections::BTreeSet<String>,
    queues: Vec<String>,
) {
    // Through a transaction pooler without a session pool: by the timer only.
    if !store.keeps_sessions() {
        return;
    }
    if listener.is_none() {
        match PgListener::connect_with(store.session_pool()).await {
            Ok(new) => *listener = Some(new),
            // Polling on: the next refresh tries again.
            Err(_) => return,
        }
    }
    let Some(connection) = listener.as_mut() else { return };
    let channels: Vec<String> =
        queues.into_iter().filter(|q| !heard.contains(q)).map(|q| store.schema().queue_channel(&q)).collect();
    if channels.is_empty() {
        return;
    }
    let names: Vec<&str> = channels.iter().map(String::as_str).collect();
    match connection.listen_all(names).await {
        Ok(()) => heard.extend(channels),
        Err(_) => {
            *listener = None;
            heard.clear();
        }
    }
}

/// Reads notifications until `until`: returns at the first when `early` (true), else at
/// `until` (whether any came). A broken listener is dropped (listened again at the next
/// reading) and the rest of the time slept.
async fn hear(listener: &mut Option<PgListener>, until: Instant, early: bool) -> bool {
    let mut heard = false;
    loop {
        let Some(connection) = listener.as_mut() else {
            tokio::time::sleep_until(until).await;
            return heard;
        };
        match tokio::time::timeout_at(until, connection.try_recv()).await {
            Ok(Ok(Some(_))) if early => return true,
            Ok(Ok(Some(_))) => heard = true,
            Ok(Ok(None)) | Ok(Err(_)) => *listener = None,
            Err(_) => return heard,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tally_adds_spans_and_keeps_ten_minutes_of_rates() {
        let mut tally = Tally { since: Some(0), ..Tally::default() };
        let count = |state, tasks| FinishedCount { queue: "q".into(), state, tasks };
        tally.add(&[count(TaskState::Completed, 20), count(TaskState::Failed, 2)], 2_000);
        tally.add(&[count(TaskState::Completed, 10), count(TaskState::Cancelled, 1)], 4_000);
        assert_eq!(tally.finished("q", TaskState::Completed), 30);
        assert_eq!(tally.finished("q", TaskState::Cancelled), 1);
        let rates: Vec<(i64, f64, f64)> = tally.throughput.iter().map(|r| (r.at, r.completed, r.failed)).collect();
        assert_eq!(rates, [(2_000, 10.0, 1.0), (4_000, 5.0, 0.0)]);
        // An empty span adds no point; one past ten minutes drops the old ones.
        tally.add(&[], 4_000);
        assert_eq!(tally.throughput.len(), 2);
        tally.add(&[], 4_000 + THROUGHPUT_SPAN_MS + 1);
        assert_eq!(tally.throughput.len(), 1);
    }
}
