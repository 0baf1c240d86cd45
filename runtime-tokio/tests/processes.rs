//! Workers as separate processes (the `canter` program), a worker killed with SIGKILL, and a
//! PostgreSQL restart in the middle of a run.

#[path = "../../tests/common/pg.rs"]
mod pg;

use pg::cluster::{Cluster, sh};

#[path = "../../tests/e2e/body.rs"]
mod body;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use canter_tokio::canter::config::{RecoveryConfig, RetryPolicy};
use canter_tokio::canter::postgres::{PgSchema, migrate};
use canter_tokio::{Client, ErrorCode, NewTask, TaskState, TokioRuntime};
use serde_json::json;

fn spawn_worker(db: &pg::TestDb, config: &std::path::Path, concurrency: u32) -> Child {
    Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["worker", "--database-url", &db.url, "--schema", db.schema.name(), "--config"])
        .arg(config)
        .args(["--concurrency", &concurrency.to_string()])
        .env("CANTER_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start a canter worker process")
}

fn terminate(child: &mut Child) -> std::process::ExitStatus {
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill -TERM");
    assert!(status.success());
    child.wait().expect("the worker exits")
}

fn write_config(name: &str, running_stale_ms: u64) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("canter-{name}-{}.toml", std::process::id()));
    let text = format!(
        "[app]\nclaim_lease_ms = 2000\n[app.recovery]\nclaimer_heartbeat_interval_ms = 1000\n\
         runner_heartbeat_interval_ms = 1000\ncheck_interval_ms = 1000\nclaimed_stale_threshold_ms = 2000\n\
         running_stale_threshold_ms = {running_stale_ms}\n[worker]\npoll_interval_ms = 1000\n"
    );
    std::fs::write(&path, text).expect("write the worker config");
    path
}

async fn wait_drained(client: &Client, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let counts = client.counts().await.unwrap();
        if counts.iter().all(|((_, s), _)| s.is_terminal()) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "not drained within {within:?}: {counts:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_worker_processes_share_the_queue_and_run_each_task_once() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), Default::default());
    let config = write_config("procs", 30_000);
    let mut workers = vec![spawn_worker(&db, &config, 8), spawn_worker(&db, &config, 8)];
    let tasks: Vec<NewTask> =
        (0..2_000)
            .map(|i| {
                if i % 2 == 0 { NewTask::new("echo", json!({"i": i})) } else { NewTask::new("sleep", json!({"ms": 1})) }
            })
            .collect();
    let ids = client.store().enqueue_many(tasks).await.unwrap();
    wait_drained(&client, Duration::from_secs(90)).await;
    for worker in &mut workers {
        assert!(terminate(worker).success(), "a worker exits cleanly on SIGTERM");
    }
    let counts = client.counts().await.unwrap();
    assert_eq!(counts.get(&("default".to_owned(), TaskState::Completed)), Some(&2_000));
    // Each task's runs: the attempts rows of runs it outlived (none here) plus the run that
    // ended it, on its finished row.
    let per_task: Vec<(i64, i32, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT f.id, f.attempts, (SELECT count(*) FROM {s}.attempts a WHERE a.task_id = f.id) FROM {s}.finished_tasks f",
        s = db.schema.quoted()
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(per_task.len(), ids.len());
    assert!(per_task.iter().all(|(_, runs, earlier)| *runs == 1 && *earlier == 0), "no task ran twice");
    let workers_seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(DISTINCT claimed_by) FROM {}.finished_tasks",
        db.schema.quoted()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(workers_seen, 2, "both processes did work");
    let _ = std::fs::remove_file(config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_has_its_tasks_recovered_by_another_workers_reaper() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    let app = body::fast_app();
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), app.clone());
    let config = write_config("kill", 2_000);
    let mut victim = spawn_worker(&db, &config, 4);
    let retry = RetryPolicy::fixed(vec![1]).with_codes(vec![ErrorCode::WorkerCrashed]);
    let tasks: Vec<NewTask> =
        (0..4).map(|_| NewTask::new("sleep", json!({"ms": 3_000})).retry(retry.clone())).collect();
    let ids = client.store().enqueue_many(tasks).await.unwrap();
    // Wait until the victim runs all four, then kill it without a chance to clean up.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while client.counts().await.unwrap().get(&("default".to_owned(), TaskState::Running)) != Some(&4) {
        assert!(tokio::time::Instant::now() < deadline, "the victim never ran the tasks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    victim.kill().expect("SIGKILL");
    victim.wait().unwrap();

    let rescuer = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["worker", "--database-url", &db.url, "--schema", db.schema.name(), "--config"])
        .arg(&config)
        .env("CANTER_LOG", "warn")
        .stdout(Stdio::null())
        .spawn();
    let mut rescuer = rescuer.expect("start the rescuer");
    wait_drained(&client, Duration::from_secs(60)).await;
    assert!(terminate(&mut rescuer).success());
    for id in ids {
        let record = client.get(id).await.unwrap().unwrap();
        assert_eq!(record.state, TaskState::Completed, "task {id} recovered and completed");
        assert_eq!(record.attempts, 2, "run once by the victim, once by the rescuer");
        let attempts = client.attempts(id).await.unwrap();
        assert_eq!(attempts[0].error.as_ref().map(|e| e.code.clone()), Some(ErrorCode::WorkerCrashed));
        assert_ne!(attempts[0].worker, attempts[1].worker);
    }
    let _ = std::fs::remove_file(config);
}

/// Issue 19, item 4: with default settings (stale thresholds of minutes), a worker killed with
/// SIGKILL has its running tasks running again on another worker within 5 s: its liveness
/// token went with its session, and `crash_retries` runs again what the default policy would
/// not retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_workers_tasks_run_again_on_another_worker_within_five_seconds_by_default() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), Default::default());
    let config = std::env::temp_dir().join(format!("canter-defaults-{}.toml", std::process::id()));
    std::fs::write(&config, "[app]\n[worker]\n").expect("write an empty config");
    let mut victim = spawn_worker(&db, &config, 4);
    let tasks: Vec<NewTask> = (0..4).map(|_| NewTask::new("sleep", json!({"ms": 4_000}))).collect();
    let ids = client.store().enqueue_many(tasks).await.unwrap();
    let running_on = |worker: Option<String>| {
        let (pool, schema) = (pool.clone(), db.schema.clone());
        async move {
            let sql = format!(
                "SELECT count(*) FROM {}.tasks WHERE state = 'RUNNING' AND ($1::text IS NULL OR claimed_by <> $1)",
                schema.quoted()
            );
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).bind(worker).fetch_one(&pool).await.unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while running_on(None).await != 4 {
        assert!(tokio::time::Instant::now() < deadline, "the victim never ran the tasks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let victim_id: String =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT claimed_by FROM {}.tasks LIMIT 1", db.schema.quoted())))
            .fetch_one(&pool)
            .await
            .unwrap();
    // The rescuer is up (registered) before the kill.
    let mut rescuer = spawn_worker(&db, &config, 4);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let live: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.workers WHERE stopped_at IS NULL AND token_epoch IS NOT NULL",
            db.schema.quoted()
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        if live == 2 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the rescuer did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    victim.kill().expect("SIGKILL");
    let killed = tokio::time::Instant::now();
    victim.wait().unwrap();
    let deadline = killed + Duration::from_secs(5);
    while running_on(Some(victim_id.clone())).await != 4 {
        assert!(tokio::time::Instant::now() < deadline, "the killed worker's tasks were not running again within 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("the killed worker's 4 tasks were running again on another worker {:?} after SIGKILL", killed.elapsed());
    wait_drained(&client, Duration::from_secs(60)).await;
    assert!(terminate(&mut rescuer).success());
    for id in ids {
        let record = client.get(id).await.unwrap().unwrap();
        assert_eq!(record.state, TaskState::Completed, "task {id} ran again and completed");
        assert_eq!(record.attempts, 2);
        let attempts = client.attempts(id).await.unwrap();
        assert_eq!(attempts[0].error.as_ref().map(|e| e.code.clone()), Some(ErrorCode::WorkerCrashed));
        assert_eq!(attempts[0].worker.as_ref().map(|w| w.0.as_str()), Some(victim_id.as_str()));
    }
    let _ = std::fs::remove_file(config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_run_loses_no_task_and_workers_carry_on() {
    let cluster = Cluster::start(
        &format!("canter_restart_{}", std::process::id() % 500),
        5400 + (std::process::id() % 500) as u16,
    );
    let pool = canter_tokio::connect(&cluster.url, 16).unwrap();
    let schema = PgSchema::new("canter_restart").unwrap();
    migrate(&pool, &schema).await.expect("migrate the restart cluster");
    let runtime = Arc::new(TokioRuntime);
    // Stale thresholds well above the outage: nothing is taken from a live worker.
    let app = canter_tokio::AppConfig {
        recovery: RecoveryConfig {
            running_stale_threshold_ms: 60_000,
            claimed_stale_threshold_ms: 60_000,
            ..body::fast_app().recovery
        },
        claim_lease_ms: Some(30_000),
        ..body::fast_app()
    };
    let tasks = body::tasks(runtime.clone());
    let client = Client::new(runtime.clone(), pool.clone(), schema.clone(), app.clone());
    let total = 1_500u64;
    client.enqueue_many(&tasks.work, (0..total).map(|id| body::Work { id, ms: 3 })).await.unwrap();
    let workers: Vec<_> = (0..2)
        .map(|i| {
            body::start_worker(
                &runtime,
                &pool,
                &schema,
                app.clone(),
                body::fast_worker(4),
                tasks.registry.clone(),
                &format!("r{i}"),
            )
        })
        .collect();
    // Restart once a part of the work is done.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tasks.seen.runs.lock().unwrap().len() < 300 {
        assert!(tokio::time::Instant::now() < deadline, "no progress before the restart");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(sh(&cluster.stop), "stop the server");
    // Longer than the pool's 5 s acquire timeout: a statement cut by the shutdown is sent again
    // once a connection can be had, so a shorter outage may be waited out without a failure.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(sh(&cluster.start), "start the server again");
    // Workers carry on by themselves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let counts = client.counts().await.ok();
        if counts.is_some_and(|c| c.get(&("default".to_owned(), TaskState::Completed)) == Some(&total)) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the workers did not finish after the restart");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let failures: u64 = workers
        .iter()
        .map(|w| {
            w.events.lock().unwrap().iter().filter(|e| matches!(e, canter_tokio::Event::DbUnavailable { .. })).count()
                as u64
        })
        .sum();
    for worker in workers {
        worker.stop().await;
    }
    eprintln!("the workers saw {failures} failed requests during the outage");
    assert!(failures > 0, "the workers saw the outage");
    {
        let runs = tasks.seen.runs.lock().unwrap();
        assert_eq!(runs.len() as u64, total, "no task lost");
        assert!(
            runs.values().all(|n| *n == 1),
            "no task ran twice: {:?}",
            runs.iter().filter(|(_, n)| **n > 1).collect::<Vec<_>>()
        );
    }
    assert_eq!(tasks.seen.running.load(Ordering::SeqCst), 0);
    pool.close().await;
}
