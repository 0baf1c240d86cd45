//! The dashboard in a real browser (headless Chromium through playwright-core, driven by
//! `tests/browser/dashboard.spec.mjs`): the overview goes live, the tasks page filters and
//! bulk-retries with a confirmation, a task's page shows its attempts and retries it, the
//! queues page pauses and resumes, the workflow page draws its graph; a read-only dashboard
//! offers no action. Screenshots of each page land in `target/dashboard-screenshots`.
//!
//! Needs Node.js and Chromium (`apt-get install chromium`; `.ci/run` installs both), so it
//! runs with feature `browser-tests`: `cargo test -p canter-tokio --features browser-tests
//! --test dashboard_browser`. It installs the script's npm packages when they are missing.

#[path = "../../tests/common/pg.rs"]
mod pg;

#[path = "common/dashboard.rs"]
mod dashboard_common;

use std::path::{Path, PathBuf};
use std::process::Command;

use canter_tokio::dashboard::{Dashboard, DashboardOptions};
use canter_tokio::http::Endpoints;
use std::sync::Arc;

use canter_tokio::canter::postgres::PgStore;
use canter_tokio::canter::store::NewTask;
use canter_tokio::{ErrorCode, Registry, TaskError, TaskId, TaskState, Worker, WorkerConfig};
use dashboard_common::{seed, seed_app};
use serde_json::json;

fn script_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// `npm ci` once, when the packages are missing.
fn install_packages() {
    let dir = script_dir();
    if dir.join("node_modules/playwright-core").exists() {
        return;
    }
    let status = Command::new("npm").args(["ci", "--no-audit", "--no-fund"]).current_dir(&dir).status();
    assert!(status.is_ok_and(|s| s.success()), "npm ci in {} failed: is Node.js installed?", dir.display());
}

/// Runs the browser script against `url` with `env`; panics with its output when it fails.
fn run_script(url: &str, env: &[(&str, String)]) {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
    assert!(Path::new(&chromium).exists(), "{chromium} is missing: apt-get install chromium (or set CHROMIUM)");
    // `CANTER_SCREENSHOTS=docs/screenshots` (from the repository's root) regenerates the
    // README's: see scripts/readme-screenshots.
    let shots = match std::env::var("CANTER_SCREENSHOTS") {
        Ok(dir) => Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir),
        Err(_) => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard-screenshots"),
    };
    std::fs::create_dir_all(&shots).expect("a screenshot directory");
    let output = Command::new("node")
        .arg("dashboard.spec.mjs")
        .current_dir(script_dir())
        .env("DASHBOARD_URL", url)
        .env("CHROMIUM", &chromium)
        .env("SCREENSHOTS", &shots)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("node runs");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    println!("{text}");
    assert!(output.status.success(), "the browser checks failed:\n{text}");
}

fn joined(ids: &[TaskId]) -> String {
    ids.iter().map(|id| id.0.to_string()).collect::<Vec<_>>().join(",")
}

/// Three tasks of queue `jobs` that a worker ran and that failed (an attempt each), as the
/// task page's timeline shows them.
async fn run_and_fail(db: &pg::TestDb, store: &PgStore) -> Vec<TaskId> {
    let tasks = (0..3).map(|n| NewTask::new("fail", json!({"n": n})).queue("jobs")).collect();
    let ids = store.enqueue_many(tasks).await.expect("enqueue");
    let mut registry = Registry::new();
    registry
        .register("fail", |_: serde_json::Value, _| async move {
            Err::<(), _>(TaskError::new(ErrorCode::TaskError, "the disk is full"))
        })
        .expect("register");
    let config = WorkerConfig { queues: vec!["jobs".into()], ..WorkerConfig::default() };
    let worker = Worker::new(store.pool().clone(), store.app().clone(), config, Arc::new(registry))
        .expect("a worker")
        .schema(db.schema.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    for &id in &ids {
        while store.get(id).await.expect("read").map(|t| t.state) != Some(TaskState::Failed) {
            assert!(tokio::time::Instant::now() < deadline, "task {id} did not fail");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let _ = stop.send(());
    running.await.expect("the worker's task").expect("the worker");
    ids
}

/// A worker on queue `mail` and a producer of 100 short tasks a second there, until told to
/// stop.
fn keep_working(db: &pg::TestDb, store: &PgStore) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let mut registry = Registry::new();
    registry
        .register("work", |_: serde_json::Value, _| async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            Ok::<_, TaskError>(())
        })
        .expect("register");
    let config = WorkerConfig { queues: vec!["mail".into()], ..WorkerConfig::default() };
    let worker = Worker::new(store.pool().clone(), store.app().clone(), config, Arc::new(registry))
        .expect("a worker")
        .schema(db.schema.clone());
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let (stop_worker, worker_stopped) = tokio::sync::oneshot::channel::<()>();
    let store = store.clone();
    let running = tokio::spawn(async move {
        let worker = tokio::spawn(worker.run_until(async move {
            let _ = worker_stopped.await;
        }));
        let mut n = 0;
        while stopped.try_recv().is_err() {
            let tasks = (0..10).map(|i| NewTask::new("work", json!({"n": n + i})).queue("mail")).collect();
            store.enqueue_many(tasks).await.expect("enqueue");
            n += 10;
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let _ = stop_worker.send(());
        worker.await.expect("the worker's task").expect("the worker");
    });
    (stop, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_works_in_a_browser() {
    install_packages();
    let db = pg::TestDb::production().await;
    let store = db.store(seed_app(), 4).await;
    let seeded = seed(&store).await;
    let failed = run_and_fail(&db, &store).await;
    // Work going on meanwhile in queue `mail`, so the overview has a live worker and a chart.
    let (stop_work, work) = keep_working(&db, &store);

    let options = DashboardOptions { refresh: std::time::Duration::from_millis(500), ..DashboardOptions::default() };
    let dashboard = Dashboard::new(store.clone(), options);
    let endpoints = Endpoints::bind("127.0.0.1:0", dashboard.router()).await.expect("bind");
    let url = format!("http://{}/", endpoints.local_addr);
    // A few readings first: the chart has points to draw.
    let _ = dashboard_common::request(endpoints.local_addr, "GET", "/api/overview", &[], None).await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let env = [("FAILED_IDS", joined(&failed)), ("WORKFLOW_ID", seeded.workflow.0.to_string())];
    tokio::task::spawn_blocking(move || run_script(&url, &env)).await.expect("the script's thread");
    dashboard.close();
    endpoints.stop().await;
    let _ = stop_work.send(());
    work.await.expect("the work's task");
    // The browser's actions reached the database: the failed tasks were retried (no worker
    // serves their queue now), the queue paused and resumed.
    for &id in &failed {
        assert_eq!(store.get(id).await.unwrap().map(|t| t.state), Some(TaskState::Pending), "task {id}");
    }
    assert!(store.paused_queues().await.unwrap().is_empty());

    // Read-only, behind basic auth.
    let options = DashboardOptions {
        read_only: true,
        basic_auth: Some(("ops".into(), "s3cret".into())),
        ..DashboardOptions::default()
    };
    let dashboard = Dashboard::new(store, options);
    let endpoints = Endpoints::bind("127.0.0.1:0", dashboard.router()).await.expect("bind");
    let url = format!("http://{}/", endpoints.local_addr);
    let env = [
        ("READ_ONLY", "1".to_owned()),
        ("WORKFLOW_ID", seeded.workflow.0.to_string()),
        ("DASHBOARD_USER", "ops".to_owned()),
        ("DASHBOARD_PASSWORD", "s3cret".to_owned()),
    ];
    tokio::task::spawn_blocking(move || run_script(&url, &env)).await.expect("the script's thread");
    dashboard.close();
    endpoints.stop().await;
}
