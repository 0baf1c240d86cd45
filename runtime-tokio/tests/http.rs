//! A worker's HTTP endpoints against PostgreSQL: /metrics carries what the worker did (parsed
//! as a scraper would), /healthz answers, /readyz says ready while the worker runs and why not
//! once it stopped.

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use canter_tokio::http::{Endpoints, worker_router};
use canter_tokio::{AppConfig, Client, Registry, TaskError, TokioRuntime, Worker, WorkerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET path` on `addr`: the status and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut response))
        .await
        .expect("an answer within 10 s")
        .expect("read");
    let (head, body) = response.split_once("\r\n\r\n").expect("head and body");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status");
    (status, body.to_owned())
}

/// The samples of an OpenMetrics text (chunked bodies are not sent for these sizes; a
/// chunk-size line would not parse and fail the test).
fn samples(text: &str) -> BTreeMap<String, f64> {
    assert!(text.trim_end().ends_with("# EOF"), "an OpenMetrics text: {text}");
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
            let value =
                if value == "+Inf" { f64::INFINITY } else { value.parse().unwrap_or_else(|_| panic!("{line}")) };
            (key.to_owned(), value)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_follow_the_worker() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    let mut registry = Registry::new();
    let double = registry.register("double", |n: i64, _| async move { Ok::<_, TaskError>(n * 2) }).unwrap();
    let app = AppConfig::default();
    let worker = Worker::new(pool.clone(), app.clone(), WorkerConfig::default(), Arc::new(registry))
        .unwrap()
        .schema(db.schema.clone());
    let router = worker_router(worker.worker_id().clone(), worker.counters());
    let endpoints = Endpoints::bind("127.0.0.1:0", router).await.expect("bind");
    let addr = endpoints.local_addr;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));

    let client = Client::new(Arc::new(TokioRuntime), pool, db.schema.clone(), app);
    let mut handles = Vec::new();
    for n in 0..20 {
        handles.push(client.enqueue(&double, &n).await.expect("enqueue"));
    }
    for handle in handles {
        handle.wait(Duration::from_secs(30)).await.expect("a result");
    }

    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
    assert_eq!(get(addr, "/readyz").await, (200, "ready\n".to_owned()));
    // Finishes are written before results are awaited, and counted after the turn that
    // handled their reply: give that turn a moment.
    let mut metrics = BTreeMap::new();
    for _ in 0..100 {
        let (status, text) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        metrics = samples(&text);
        if metrics["canter_worker_tasks_completed_total"] >= 20.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metrics["canter_worker_tasks_completed_total"], 20.0, "{metrics:?}");
    assert_eq!(metrics["canter_worker_tasks_claimed_total"], 20.0);
    assert_eq!(metrics["canter_worker_tasks_failed_total"], 0.0);
    assert_eq!(metrics["canter_worker_concurrency"], f64::from(WorkerConfig::default().concurrency));
    assert_eq!(metrics["canter_worker_ready"], 1.0);
    // Every request is in its kind's histogram: claims (alone, or with a finish in hard-cap
    // mode, the default) brought back the 20 tasks.
    let claims = metrics["canter_db_request_duration_seconds_count{kind=\"claim\"}"];
    assert!(claims >= 1.0, "{metrics:?}");
    assert_eq!(metrics["canter_db_request_duration_seconds_bucket{le=\"+Inf\",kind=\"claim\"}"], claims);
    let claimed = metrics["canter_db_request_tasks_sum{kind=\"claim\"}"];
    assert!((1.0..=20.0).contains(&claimed), "{metrics:?}");
    assert!(metrics.keys().any(|k| k.starts_with("canter_db_request_tasks_sum{kind=\"finish")), "{metrics:?}");
    assert_eq!(metrics["canter_db_request_failures_total{kind=\"claim\"}"], 0.0);

    stop.send(()).expect("the worker runs");
    running.await.expect("joined").expect("served");
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (503, "not ready: shutting down\n"));
    endpoints.stop().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "stopped endpoints do not listen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_the_endpoints_cuts_off_a_stalled_client() {
    let counters = Arc::new(canter_tokio::Counters::new());
    let endpoints = Endpoints::bind("127.0.0.1:0", worker_router(canter_tokio::WorkerId("w".into()), counters))
        .await
        .expect("bind");
    // Half a request, then nothing: graceful shutdown alone would wait for it forever.
    let mut stalled = tokio::net::TcpStream::connect(endpoints.local_addr).await.expect("connect");
    stalled.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await.expect("send");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let began = tokio::time::Instant::now();
    tokio::time::timeout(canter_tokio::http::STOP_WAIT * 3, endpoints.stop()).await.expect("stopped within its bound");
    assert!(began.elapsed() < canter_tokio::http::STOP_WAIT * 2, "{:?}", began.elapsed());
}
