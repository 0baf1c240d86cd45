//! Concurrent claimers on real PostgreSQL: no task is claimed twice, and in hard-cap mode no
//! cap is ever exceeded (a sampler reads the in-flight counts while the claimers run). Keyed
//! enqueues: concurrent enqueuers of a key, an enqueue in an open transaction beside the
//! worker running the key's holder, and enqueues racing removals of the key.

#[path = "common/admin.rs"]
mod admin;
#[path = "common/pg.rs"]
mod pg;

use admin::Admin;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, CustomQueue, QueueMode, WorkerConfig};
use canter::postgres::{PgAdminError, PgEnqueueError, PgStore, enqueue_in};
use canter::store::{AdminError, KeyRemoval};
use canter::store::{ClaimedTask, Completion, DbReply, DbRequest, FinishOutcome, KeyMode, NewTask};
use canter::task::{TaskId, TaskLease, TaskState, WorkerId};
use pg::TestDb;
use serde_json::json;

/// Every claim any worker made: (task, lease).
type Claims = Arc<Mutex<Vec<(TaskId, i64)>>>;

/// One pass of a worker: claims and starts up to `concurrency` tasks, runs each for `work`,
/// completes them (none may be lost), and returns what it claimed.
async fn claim_and_complete(
    store: &PgStore,
    worker: &WorkerId,
    token: u64,
    policy: &Arc<ClaimPolicy>,
    concurrency: u32,
    work: Duration,
) -> Vec<ClaimedTask> {
    let request = DbRequest::Claim {
        worker: worker.clone(),
        token,
        policy: Arc::clone(policy),
        my_running: 0,
        my_claimed: 0,
        start_now: concurrency,
        lease_ms: 60_000,
    };
    let DbReply::Claimed { tasks, .. } = store.execute(&request).await.expect("claim") else { panic!() };
    if tasks.is_empty() {
        return tasks;
    }
    assert!(tasks.iter().all(|t| t.started));
    tokio::time::sleep(work).await;
    let completions = tasks
        .iter()
        .map(|t| Completion {
            task: TaskLease { task: t.id, lease: t.lease },
            outcome: FinishOutcome::Completed(json!(t.id.0)),
            args: None,
        })
        .collect();
    let reply = store.execute(&DbRequest::Finish { worker: worker.clone(), completions }).await.expect("finish");
    let DbReply::Finished { applied, lost } = reply else { panic!() };
    assert!(lost.is_empty(), "a worker lost tasks it held: {lost:?}");
    assert_eq!(applied.len(), tasks.len());
    tasks
}

/// A worker that claims and completes tasks until a pass finds nothing and nothing is left.
async fn claimer(store: PgStore, name: String, concurrency: u32, work: Duration, total: usize, claims: Claims) {
    let config = WorkerConfig { concurrency, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let worker = WorkerId(name);
    for token in 1.. {
        let tasks = claim_and_complete(&store, &worker, token, &policy, concurrency, work).await;
        if tasks.is_empty() {
            if claims.lock().unwrap().len() >= total {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        claims.lock().unwrap().extend(tasks.iter().map(|t| (t.id, t.lease.0)));
    }
}

fn assert_claimed_once(claims: &Claims, total: usize) {
    let claims = claims.lock().unwrap();
    let mut per_task: BTreeMap<TaskId, usize> = BTreeMap::new();
    for (id, lease) in claims.iter() {
        *per_task.entry(*id).or_default() += 1;
        assert_eq!(*lease, 1, "task {id} was claimed under lease {lease}");
    }
    assert_eq!(per_task.len(), total, "every task claimed");
    let twice: Vec<_> = per_task.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "tasks claimed twice: {twice:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claimers_never_claim_a_task_twice() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 8).await;
    let total = 3_000;
    store.enqueue_many((0..total).map(|i| NewTask::new("t", json!(i))).collect()).await.unwrap();
    let claims: Claims = Arc::default();
    let workers: Vec<_> = (0..6)
        .map(|i| tokio::spawn(claimer(store.clone(), format!("w{i}"), 16, Duration::ZERO, total, Arc::clone(&claims))))
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    assert_claimed_once(&claims, total);
    let counts = store.counts().await.unwrap();
    assert_eq!(counts.get(&("default".to_owned(), TaskState::Completed)), Some(&(total as u64)));
    assert_eq!(counts.len(), 1, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hard_caps_hold_under_concurrent_claimers() {
    let caps = [("a", Some(3)), ("b", Some(5)), ("c", None)];
    let cluster_cap = 10;
    let app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: caps
            .iter()
            .enumerate()
            .map(|(i, (name, cap))| {
                let queue = CustomQueue::new(*name).with_priority(i as u8 + 1);
                match cap {
                    Some(cap) => queue.with_max_concurrency(*cap),
                    None => queue,
                }
            })
            .collect(),
        cluster_wide_cap: Some(cluster_cap),
        ..AppConfig::default()
    };
    let db = TestDb::new().await;
    let store = db.store(app, 10).await;
    let total = 1_200;
    let tasks = (0..total).map(|i| NewTask::new("t", json!(i)).queue(caps[i % 3].0)).collect();
    store.enqueue_many(tasks).await.unwrap();

    let running = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn({
        let (store, running) = (store.clone(), Arc::clone(&running));
        let sql = format!(
            "SELECT queue, count(*) FROM {}.tasks WHERE state = 'RUNNING' \
             OR (state = 'CLAIMED' AND claim_expires_at > now()) GROUP BY queue",
            store.schema().quoted()
        );
        async move {
            let (mut samples, mut max_total) = (0u32, 0i64);
            let mut max_queue: BTreeMap<String, i64> = BTreeMap::new();
            while running.load(Ordering::Relaxed) {
                let rows: Vec<(String, i64)> =
                    sqlx::query_as(sqlx::AssertSqlSafe(sql.clone())).fetch_all(store.pool()).await.unwrap();
                let total: i64 = rows.iter().map(|(_, n)| n).sum();
                assert!(total <= i64::from(cluster_cap), "cluster cap exceeded: {rows:?}");
                for (queue, n) in rows {
                    let cap = caps.iter().find(|(q, _)| *q == queue).and_then(|(_, cap)| *cap);
                    assert!(cap.is_none_or(|cap| n <= i64::from(cap)), "queue {queue} over its cap: {n}");
                    let max = max_queue.entry(queue).or_default();
                    *max = (*max).max(n);
                }
                max_total = max_total.max(total);
                samples += 1;
            }
            (samples, max_total, max_queue)
        }
    });
    let claims: Claims = Arc::default();
    let workers: Vec<_> = (0..6)
        .map(|i| {
            let work = Duration::from_millis(2);
            tokio::spawn(claimer(store.clone(), format!("w{i}"), 4, work, total, Arc::clone(&claims)))
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    running.store(false, Ordering::Relaxed);
    let (samples, max_total, max_queue) = sampler.await.unwrap();
    eprintln!("{samples} samples, most in flight {max_total}, per queue {max_queue:?}");
    assert!(samples > 20, "the sampler ran while the claimers did");
    assert!(max_total > 3, "the claimers ran in parallel");
    assert_claimed_once(&claims, total);
}

/// Many clients enqueue batches over the same four job keys (mode `replace`, array args, each
/// batch's keys in its own order) while two workers claim and complete: every enqueued item
/// ends up in exactly one task (appended to a waiting holder, or in a new task once the holder
/// was claimed), and each key names at most one live task.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_enqueuers_of_one_key_lose_and_double_nothing() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 12).await;
    let (clients, rounds) = (8u64, 25u64);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let (store, stop) = (store.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let policy = Arc::new(ClaimPolicy::from_config(store.app(), &WorkerConfig::default()));
                let worker = WorkerId(format!("w{i}"));
                for token in 1.. {
                    let tasks = claim_and_complete(&store, &worker, token, &policy, 16, Duration::ZERO).await;
                    if tasks.is_empty() {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(3)).await;
                    }
                }
            })
        })
        .collect();
    let enqueuers: Vec<_> = (0..clients)
        .map(|client| {
            let store = store.clone();
            tokio::spawn(async move {
                for round in 0..rounds {
                    let mut keys: Vec<u64> = (0..4).collect();
                    keys.rotate_left(((client + round) % 4) as usize);
                    let batch = keys
                        .iter()
                        .map(|k| NewTask::new("t", json!([[client, round, k]])).key(format!("k{k}")))
                        .collect();
                    store.enqueue_many(batch).await.expect("keyed enqueue");
                }
            })
        })
        .collect();
    for enqueuer in enqueuers {
        enqueuer.await.unwrap();
    }
    // Let the workers drain what is left.
    while store.counts().await.unwrap().keys().any(|(_, state)| !state.is_terminal()) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }

    let mut items: BTreeMap<(u64, u64, u64), usize> = BTreeMap::new();
    for record in store.list(&Default::default()).await.unwrap() {
        for item in record.args.as_array().expect("array args") {
            let item: (u64, u64, u64) = serde_json::from_value(item.clone()).unwrap();
            assert!(record.key.as_deref().is_none_or(|k| k == format!("k{}", item.2)), "an item under another key");
            *items.entry(item).or_default() += 1;
        }
    }
    assert_eq!(items.len() as u64, clients * rounds * 4, "every item is in some task");
    assert!(items.values().all(|n| *n == 1), "no item is in two tasks");
    let keyed: Vec<_> =
        store.list(&Default::default()).await.unwrap().into_iter().filter(|r| r.key.is_some()).collect();
    assert!(keyed.len() <= 4, "one task per key at most: {}", keyed.len());
}

/// Claims and starts the first pending task of the default queue for `worker`.
async fn run_one(store: &PgStore, worker: &WorkerId) -> TaskLease {
    let policy =
        Arc::new(ClaimPolicy::from_config(store.app(), &WorkerConfig { concurrency: 1, ..Default::default() }));
    let request = DbRequest::Claim {
        worker: worker.clone(),
        token: 1,
        policy,
        my_running: 0,
        my_claimed: 0,
        start_now: 1,
        lease_ms: 60_000,
    };
    let DbReply::Claimed { tasks, .. } = store.execute(&request).await.expect("claim") else { panic!() };
    assert!(tasks.len() == 1 && tasks[0].started, "{tasks:?}");
    TaskLease { task: tasks[0].id, lease: tasks[0].lease }
}

/// An application's transaction enqueues a task whose key a Running task holds, and stays
/// open: the running task's heartbeat and finish do not wait for it (the enqueue used to lock
/// the holder's row, and in the replace modes to write it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_enqueue_in_an_open_transaction_leaves_the_running_holder_alone() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 4).await;
    let worker = WorkerId("w".into());
    let bounded = Duration::from_secs(5);
    for mode in [KeyMode::Replace, KeyMode::PreserveRunAt, KeyMode::UnsafeDedupe, KeyMode::Idempotent] {
        let key = format!("k-{}", mode.as_str());
        let task = || NewTask::new("t", json!(1)).key_with_mode(key.clone(), mode);
        let holder = store.enqueue(task()).await.unwrap();
        let running = run_one(&store, &worker).await;
        assert_eq!(running.task, holder);

        let mut tx = store.pool().begin().await.unwrap();
        let enqueued = enqueue_in(&mut *tx, store.schema(), store.app(), task()).await.unwrap();
        let moved = matches!(mode, KeyMode::Replace | KeyMode::PreserveRunAt);
        assert_eq!(enqueued != holder, moved, "{mode:?}");
        if mode == KeyMode::Idempotent {
            // A mismatch is refused without waiting either.
            let other = NewTask::new("t", json!(2)).key_with_mode(key.clone(), mode);
            let refused = enqueue_in(&mut *tx, store.schema(), store.app(), other).await;
            assert!(matches!(refused, Err(PgEnqueueError::Invalid(_))), "{refused:?}");
        }
        let beat = DbRequest::Heartbeat {
            worker: worker.clone(),
            claimed: Vec::new(),
            running: vec![running],
            lease_ms: 60_000,
            max_renew_age_ms: 60_000,
            abandoned: vec![],
        };
        let reply = tokio::time::timeout(bounded, store.execute(&beat)).await;
        let reply = reply.unwrap_or_else(|_| panic!("{mode:?}: the heartbeat waited on the enqueuer"));
        assert_eq!(reply.unwrap(), DbReply::Heartbeat { lost: Vec::new(), busy: vec![], handed_back: vec![] });
        let finish = DbRequest::Finish {
            worker: worker.clone(),
            completions: vec![Completion { task: running, outcome: FinishOutcome::Completed(json!(1)), args: None }],
        };
        let reply = tokio::time::timeout(bounded, store.execute(&finish)).await;
        let reply = reply.unwrap_or_else(|_| panic!("{mode:?}: the finish waited on the enqueuer"));
        let DbReply::Finished { applied, lost } = reply.unwrap() else { panic!() };
        assert!(lost.is_empty() && applied == [(holder, TaskState::Completed)], "{mode:?}");
        tx.commit().await.unwrap();

        // The key is the new task's (moved) or still the finished holder's.
        let shows = |id| {
            let store = store.clone();
            async move { store.get(id).await.unwrap().unwrap().key }
        };
        assert_eq!(shows(enqueued).await.as_deref(), Some(key.as_str()), "{mode:?}");
        if moved {
            assert_eq!(shows(holder).await, None, "{mode:?}: the finished holder gave the key up");
            assert_eq!(store.remove_key(&key).await.unwrap(), KeyRemoval::Cancelled(enqueued));
            assert_eq!(store.purge_finished(0, 10).await.unwrap(), 2, "{mode:?}");
        }
    }
}

/// Removals of a key race enqueues of it, over and over, while its holder is Running,
/// finished or Pending: both take the key's lock before any row, so neither ever deadlocks
/// (PostgreSQL would abort one with SQLSTATE 40P01).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn removing_a_key_while_it_is_enqueued_never_deadlocks() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 8).await;
    let worker = WorkerId("w".into());
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for round in 0..90 {
        let key = format!("k{round}");
        // First in claim order: the tasks earlier rounds left pending have priority 0.
        let holder = store.enqueue(NewTask::new("t", json!(round)).key(key.clone()).priority(-1)).await.unwrap();
        match round % 3 {
            0 => assert_eq!(run_one(&store, &worker).await.task, holder),
            1 => store.complete(holder, json!(null)).await.unwrap(),
            _ => {}
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let remove = tokio::spawn({
            let (store, key, barrier) = (store.clone(), key.clone(), Arc::clone(&barrier));
            async move {
                barrier.wait().await;
                store.remove_key(&key).await
            }
        });
        let enqueue = tokio::spawn({
            let (store, key, barrier) = (store.clone(), key.clone(), Arc::clone(&barrier));
            async move {
                let mut tx = store.pool().begin().await.unwrap();
                barrier.wait().await;
                // The enqueue holds its connection already and so tends to go first: now and
                // then it lets the removal start ahead (under load in CI it once went first in
                // all 90 rounds), so that both orders come for each kind of holder.
                tokio::time::sleep(Duration::from_millis([0, 1, 3, 15][(round / 3) % 4])).await;
                let id =
                    enqueue_in(&mut *tx, store.schema(), store.app(), NewTask::new("t", json!("new")).key(key)).await?;
                // Holding the key's rows a little longer, as an application's transaction would.
                tokio::time::sleep(Duration::from_millis(2)).await;
                tx.commit().await?;
                Ok::<_, PgEnqueueError>(id)
            }
        });
        let removed = remove.await.unwrap();
        let enqueued = enqueue.await.unwrap();
        let deadlock = |text: String| text.contains("40P01") || text.contains("deadlock");
        if let Err(PgAdminError::Database(error)) = &removed {
            assert!(!deadlock(format!("{error:?}")), "round {round}: remove-key deadlocked: {error}");
        }
        if let Err(error) = &enqueued {
            assert!(!deadlock(format!("{error:?}")), "round {round}: enqueue deadlocked: {error}");
        }
        let enqueued = enqueued.unwrap();
        let outcome = match removed {
            Ok(KeyRemoval::Cancelled(id)) if id == enqueued || id == holder => "cancelled",
            Ok(KeyRemoval::Detached(id)) if id == holder => "detached",
            Ok(KeyRemoval::Freed(id)) if id == holder => "freed",
            Err(PgAdminError::Refused(AdminError::KeyNotFound(_))) => "not found",
            other => panic!("round {round}: {other:?} (holder {holder}, enqueued {enqueued})"),
        };
        *outcomes.entry(outcome).or_default() += 1;
        // Whatever the order, the key names one task at most, and that task shows it.
        let holders: Vec<TaskId> = store
            .list(&Default::default())
            .await
            .unwrap()
            .into_iter()
            .filter(|r| r.key == Some(key.clone()))
            .map(|r| r.id)
            .collect();
        assert!(holders.len() <= 1, "round {round}: {holders:?}");
    }
    eprintln!("key removal raced with enqueues: {outcomes:?}");
    assert!(outcomes.len() >= 2, "the two went first in turn: {outcomes:?}");
}
