//! Canter through a real PgBouncer in transaction mode (`pool_mode = transaction`, Debian's
//! 1.18, started by the test on a free port with a pool of 3 server connections, so every
//! client's transactions share them): workers, clients, a scheduler and operator actions send
//! every statement through it, with LISTEN and the liveness token on a direct session pool;
//! and a worker without one polls. The invariants of the e2e suite: every task runs exactly
//! once, a capped queue never runs more than its cap, results are awaited, and nothing fails
//! with a prepared statement missing or clashing on a server connection.
//!
//! Needs `pgbouncer` (`apt-get install pgbouncer`; `.ci/run` installs it), so it runs with
//! feature `pgbouncer-tests`: `cargo test -p canter-tokio --features pgbouncer-tests --test
//! pgbouncer`.

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::collections::BTreeMap;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use canter_tokio::canter::config::QueueMode;
use canter_tokio::canter::driver::connect_through_pooler;
use canter_tokio::canter::store::{AdminReply, AdminRequest};
use canter_tokio::{
    AppConfig, Client, CustomQueue, Registry, ScheduleConfig, TaskError, TaskState, TokioRuntime, Worker, WorkerConfig,
};
use sqlx::postgres::PgConnectOptions;

/// A PgBouncer in transaction mode in front of the test server, until dropped.
struct Bouncer {
    child: Child,
    /// Its URL, for the test's database.
    url: String,
    _dir: TempDir,
}

/// A directory removed when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Bouncer {
    fn start(server_url: &str) -> Bouncer {
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("pgbouncer is missing: apt-get install pgbouncer");
        let server: PgConnectOptions = server_url.parse().expect("the server's url");
        let database = server.get_database().unwrap_or("postgres").to_owned();
        let user = server.get_username().to_owned();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = std::env::temp_dir().join(format!("canter-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(
            "[databases]\n{database} = host={} port={} dbname={database} user={user}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {dir}/users.txt\npool_mode = transaction\n\
             default_pool_size = 3\nmax_client_conn = 500\nlogfile = {dir}/pgbouncer.log\n",
            server.get_host(),
            server.get_port(),
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), config).unwrap();
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        // PgBouncer refuses to run as root: as the server's own user then.
        let mut command = Command::new(binary);
        if is_root() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
            command.args(["-u", "postgres"]);
        }
        let child = command.arg(dir.join("pgbouncer.ini")).spawn().expect("pgbouncer starts");
        let url = format!("postgres://{user}@127.0.0.1:{port}/{database}?sslmode=disable");
        Bouncer { child, url, _dir: TempDir(dir) }
    }

    /// Waits until it answers.
    async fn ready(&self) {
        for _ in 0..100 {
            if let Ok(pool) = connect_through_pooler(&self.url, 2)
                && sqlx::query("SELECT 1").persistent(false).execute(&pool).await.is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("pgbouncer did not answer at {}", self.url);
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// The queue `capped` runs at most 2 at once across the cluster.
fn app() -> AppConfig {
    let mut capped = CustomQueue::new("capped");
    capped.max_concurrency = Some(2);
    let mut app = AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue::new("default"), capped],
        ..AppConfig::default()
    };
    app.schedules = vec![ScheduleConfig { every: Some("1s".into()), ..ScheduleConfig::new("tick", "tick") }];
    app
}

/// What the handlers saw: runs per task argument, and the most `capped` tasks running at once.
#[derive(Default)]
struct Seen {
    runs: Mutex<BTreeMap<i64, u32>>,
    capped_now: AtomicI64,
    capped_most: AtomicI64,
    ticks: AtomicI64,
}

fn registry(seen: &Arc<Seen>) -> (Registry, canter_tokio::TaskHandle<i64, i64>) {
    let mut registry = Registry::new();
    let s = seen.clone();
    let record = registry
        .register("record", move |n: i64, _| {
            let s = s.clone();
            async move {
                *s.runs.lock().unwrap().entry(n).or_insert(0) += 1;
                Ok::<_, TaskError>(n * 2)
            }
        })
        .unwrap();
    let s = seen.clone();
    registry
        .register("capped", move |n: i64, _| {
            let s = s.clone();
            async move {
                let now = s.capped_now.fetch_add(1, Ordering::SeqCst) + 1;
                s.capped_most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                s.capped_now.fetch_sub(1, Ordering::SeqCst);
                *s.runs.lock().unwrap().entry(n).or_insert(0) += 1;
                Ok::<_, TaskError>(n)
            }
        })
        .unwrap();
    let s = seen.clone();
    registry
        .register("tick", move |_: serde_json::Value, _| {
            let s = s.clone();
            async move {
                s.ticks.fetch_add(1, Ordering::SeqCst);
                Ok::<_, TaskError>(())
            }
        })
        .unwrap();
    (registry, record)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_clients_schedules_and_operators_through_pgbouncer() {
    let db = pg::TestDb::unmigrated().await;
    let bouncer = Bouncer::start(&db.url);
    bouncer.ready().await;
    let pooled = db.schema.transaction_pooled();
    let through = || connect_through_pooler(&bouncer.url, 8).expect("a pool");
    let direct = || canter_tokio::connect(&db.url, 3).expect("a session pool");
    let seen = Arc::new(Seen::default());

    // Migrations need a session: refused without one, applied with one.
    let lone = Client::new(Arc::new(TokioRuntime), through(), pooled.clone(), app());
    assert!(!lone.store().can_migrate());
    let client = Client::new(Arc::new(TokioRuntime), through(), pooled.clone(), app()).session_pool(direct());
    client.store().migrate().await.expect("migrate on the session pool");

    // Two workers with a direct session pool (LISTEN, liveness token), one that polls without.
    let mut workers = Vec::new();
    for (i, session) in [Some(direct()), Some(direct()), None].into_iter().enumerate() {
        let (registry, _) = registry(&seen);
        let config =
            WorkerConfig { concurrency: 4, poll_interval_ms: 1_000, run_scheduler: i == 0, ..WorkerConfig::default() };
        let mut worker = Worker::new(through(), app(), config, Arc::new(registry)).unwrap().schema(pooled.clone());
        if let Some(session) = session {
            worker = worker.session_pool(session);
        }
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(worker.run_until(async move {
            let _ = stopped.await;
        }));
        workers.push((stop, running));
    }

    // Bulk and one by one, awaited; a capped queue.
    let (_, record) = registry(&seen);
    let store = client.store();
    let bulk: Vec<_> =
        (0..300).map(|n| canter_tokio::canter::store::NewTask::new("record", serde_json::json!(n))).collect();
    let bulk_ids = store.enqueue_many(bulk).await.expect("bulk enqueue through pgbouncer");
    let capped: Vec<_> = (1_000..1_060)
        .map(|n| canter_tokio::canter::store::NewTask::new("capped", serde_json::json!(n)).queue("capped"))
        .collect();
    let capped_ids = store.enqueue_many(capped).await.expect("enqueue the capped tasks");
    let mut handles = Vec::new();
    for n in 2_000..2_040 {
        handles.push(client.enqueue(&record, &n).await.expect("enqueue one"));
    }
    for (n, handle) in (2_000..2_040).zip(handles) {
        assert_eq!(handle.wait(Duration::from_secs(60)).await.expect("a result"), n * 2);
    }

    // A client without a session pool waits by reading again (a LISTEN through the pooler
    // would hear nothing), served by whichever worker claims first.
    let sessionless = Client::new(Arc::new(TokioRuntime), through(), pooled.clone(), app());
    let handle = sessionless.enqueue(&record, &2_500).await.expect("enqueue without a session pool");
    assert_eq!(handle.wait(Duration::from_secs(15)).await.expect("awaited by polling"), 5_000);
    // A store's own listening wait refuses rather than LISTEN through the pooler.
    let refused = sessionless.store().wait_result(handle.id(), tokio::time::sleep(Duration::from_secs(5))).await;
    assert!(refused.unwrap_err().to_string().contains("needs a session pool"));

    // Operators: pause, a held task cancelled while paused, resume.
    let pause = AdminRequest::Pause { queue: "default".into() };
    assert!(matches!(store.admin(&pause).await.unwrap(), AdminReply::Paused { .. }));
    let held =
        store.enqueue(canter_tokio::canter::store::NewTask::new("record", serde_json::json!(3_000))).await.unwrap();
    assert!(matches!(store.admin(&AdminRequest::Cancel { task: held }).await.unwrap(), AdminReply::Cancelled { .. }));
    store.admin(&AdminRequest::Resume { queue: "default".into() }).await.unwrap();

    // A workflow of two steps, submitted and promoted through the pooler.
    let mut flow = canter_tokio::canter::store::NewWorkflow::new("pair");
    let first =
        flow.step(canter_tokio::canter::store::NewTask::new("record", serde_json::json!(4_000)), Default::default());
    let second =
        flow.step(canter_tokio::canter::store::NewTask::new("record", serde_json::json!(4_001)), Default::default());
    flow.edge(first, second, canter_tokio::canter::workflow::EdgePolicy::RequireSuccess);
    let submitted = store.submit_workflow(&flow).await.expect("submit through pgbouncer");

    // Everything finishes.
    let all: Vec<_> = bulk_ids.iter().chain(&capped_ids).chain(&submitted.tasks).copied().collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    for &id in &all {
        loop {
            let state = store.get(id).await.expect("read through pgbouncer").map(|t| t.state);
            if state == Some(TaskState::Completed) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "task {id} is {state:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let ticked = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.ticks.load(Ordering::SeqCst) == 0 {
        assert!(tokio::time::Instant::now() < ticked, "the schedule never ticked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (stop, running) in workers {
        let _ = stop.send(());
        running.await.expect("the worker's task").expect("the worker ran through pgbouncer");
    }

    // Exactly once each; the cap held; the cancelled one never ran.
    let runs = seen.runs.lock().unwrap().clone();
    for n in (0..300).chain(1_000..1_060).chain(2_000..2_040).chain([2_500, 4_000, 4_001]) {
        assert_eq!(runs.get(&n), Some(&1), "task {n} ran {:?} times", runs.get(&n));
    }
    assert_eq!(runs.get(&3_000), None);
    let most = seen.capped_most.load(Ordering::SeqCst);
    assert!((1..=2).contains(&most), "the capped queue ran {most} at once");
    assert_eq!(store.get(held).await.unwrap().map(|t| t.state), Some(TaskState::Cancelled));

    // The command line through it: operator commands and reads; migrate needs the direct URL.
    let canter = |args: &[&str], listen: bool| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_canter"));
        command.args(["--transaction-pooler", "--database-url", &bouncer.url]);
        if listen {
            command.args(["--listen-database-url", &db.url]);
        }
        let output = command.args(args).args(["--schema", db.schema.name()]).output().expect("canter runs");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr),
        )
    };
    let (code, text) = canter(&["migrate"], false);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--listen-database-url"), "{text}");
    assert_eq!(canter(&["migrate"], true).0, Some(0));
    let (code, id) = canter(&["enqueue", "echo", "--args", "7"], true);
    assert_eq!(code, Some(0), "{id}");
    for args in [&["pause", "default"][..], &["status"], &["list", "--status", "pending"], &["show", id.trim()]] {
        let (code, text) = canter(args, true);
        assert_eq!(code, Some(0), "canter {args:?}: {text}");
    }
    let (code, text) = canter(&["cancel", id.trim()], false);
    assert_eq!((code, text.trim()), (Some(0), &*format!("task {} cancelled", id.trim())));
    assert_eq!(canter(&["resume", "default"], false).0, Some(0));

    // The bench drains through it beside the direct drain.
    let bench = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["--database-url", &db.url, "bench", "--workload", "pgbouncer", "--pooler-url", &bouncer.url])
        .args(["--tasks", "2000", "--runs", "1", "--baseline", "none", "--json-only"])
        .output()
        .expect("canter bench runs");
    let out = String::from_utf8_lossy(&bench.stdout);
    assert!(bench.status.success(), "{out}{}", String::from_utf8_lossy(&bench.stderr));
    assert!(
        out.lines().any(|l| l.contains("\"workload\":\"drain_pgbouncer\"") && l.contains("\"tasks\":2000")),
        "{out}"
    );
}
