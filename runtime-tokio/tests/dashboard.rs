//! The dashboard's API against PostgreSQL: the overview and its event stream follow the
//! queues (an action shows at once), listings filter and page, details carry each attempt,
//! bulk actions refuse one task alone, the finished tasks are counted, and the read-only mode
//! and basic auth guard it all.

#[path = "../../tests/common/pg.rs"]
mod pg;

#[path = "common/dashboard.rs"]
mod dashboard_common;

use std::time::Duration;

use canter_tokio::dashboard::{Dashboard, DashboardOptions};
use canter_tokio::http::Endpoints;
use dashboard_common::{get_json, post_json, request, seed, seed_app};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

fn queue<'a>(overview: &'a Value, name: &str) -> &'a Value {
    overview["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == name)
        .unwrap_or_else(|| panic!("{name}: {overview}"))
}

fn ids(listing: &Value) -> Vec<i64> {
    listing["tasks"].as_array().unwrap().iter().map(|t| t["id"].as_i64().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_reads_acts_and_streams() {
    let db = pg::TestDb::production().await;
    let store = db.store(seed_app(), 4).await;
    let seeded = seed(&store).await;
    let options = DashboardOptions { refresh: Duration::from_millis(300), ..DashboardOptions::default() };
    let dashboard = Dashboard::new(store.clone(), options);
    let endpoints = Endpoints::bind("127.0.0.1:0", dashboard.router()).await.expect("bind");
    let addr = endpoints.local_addr;

    // The pages are the embedded assets.
    let (status, page) = request(addr, "GET", "/", &[], None).await;
    assert_eq!(status, 200);
    assert!(page.contains("app.js"), "{page}");

    // The overview: live counts, caps from the settings, the oldest due task's age.
    let overview = get_json(addr, "/api/overview").await;
    let default = queue(&overview, "default");
    assert_eq!((default["due"].as_u64(), default["paused"].as_bool()), (Some(5), Some(false)), "{overview}");
    assert!(default["oldest_due_at"].as_i64().unwrap() <= overview["at"].as_i64().unwrap());
    assert_eq!(queue(&overview, "mail")["max_concurrency"], 3);
    // Two roots of the workflow are due, its join waits.
    assert_eq!(queue(&overview, "flows")["due"], 2);

    // The event stream: the current overview at once, then one showing a pause soon after it.
    let mut events = tokio::net::TcpStream::connect(addr).await.unwrap();
    events
        .write_all(
            format!(
                "GET /api/events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut events = tokio::io::BufReader::new(events);
    let mut next_overview = async || -> Value {
        let mut line = String::new();
        loop {
            line.clear();
            let read = tokio::time::timeout(Duration::from_secs(10), events.read_line(&mut line)).await;
            assert!(read.expect("an event within 10 s").unwrap() > 0, "the stream ended");
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return serde_json::from_str(data).unwrap();
            }
        }
    };
    assert_eq!(queue(&next_overview().await, "default")["due"], 5);
    let (status, reply) = post_json(addr, "/api/admin", json!({"action": "pause", "queue": "mail"}), &[]).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["reply"]["was_running"], true);
    let paused_within = tokio::time::Instant::now();
    while queue(&next_overview().await, "mail")["paused"] != true {}
    assert!(paused_within.elapsed() < Duration::from_secs(5), "the pause showed after {:?}", paused_within.elapsed());

    // Listings: by state, newest first, a page at a time; by enqueue time.
    let failed = get_json(addr, "/api/tasks?state=failed&limit=2").await;
    let newest: Vec<i64> = seeded.failed.iter().rev().map(|t| t.0).collect();
    assert_eq!(ids(&failed), newest[..2]);
    let rest = get_json(addr, &format!("/api/tasks?state=FAILED&limit=2&before={}", failed["next_before"])).await;
    assert_eq!(ids(&rest), newest[2..]);
    assert_eq!(rest["next_before"], Value::Null);
    let future = overview["at"].as_i64().unwrap() + 3_600_000;
    assert!(ids(&get_json(addr, &format!("/api/tasks?from={future}")).await).is_empty());
    assert_eq!(ids(&get_json(addr, &format!("/api/tasks?name=fail&to={future}")).await), newest);
    let (status, body) = request(addr, "GET", "/api/tasks?state=LOST", &[], None).await;
    assert_eq!(status, 400, "{body}");

    // A task's detail: its error and each attempt.
    let detail = get_json(addr, &format!("/api/tasks/{}", seeded.failed[0])).await;
    assert_eq!(detail["task"]["error"]["code"], "FAILED_BY_OPERATOR", "{detail}");
    assert_eq!(detail["workflow"], Value::Null);
    let (status, _) = request(addr, "GET", "/api/tasks/999999", &[], None).await;
    assert_eq!(status, 404);

    // Actions: a refusal says why, a form post (no JSON) is not an action.
    let (status, reply) =
        post_json(addr, "/api/admin", json!({"action": "cancel", "task": seeded.failed[0]}), &[]).await;
    assert_eq!(status, 409, "{reply}");
    assert!(reply["error"].as_str().unwrap().contains("expected PENDING or CLAIMED"), "{reply}");
    let form = format!("action=cancel&task={}", seeded.pending[0]);
    let headers = [("Content-Type", "application/x-www-form-urlencoded")];
    let (status, _) = request(addr, "POST", "/api/admin", &headers, Some(&form)).await;
    assert_eq!(status, 415);
    assert_eq!(store.get(seeded.pending[0]).await.unwrap().unwrap().state, canter_tokio::TaskState::Pending);

    // Bulk: one refused task fails alone; a filter reaches every matching task.
    let (status, reply) = post_json(
        addr,
        "/api/bulk",
        json!({"action": "retry", "ids": [seeded.failed[0], seeded.pending[0], seeded.failed[1]]}),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!((reply["done"].as_u64(), reply["refused_total"].as_u64()), (Some(2), Some(1)), "{reply}");
    assert_eq!(reply["refused"][0]["id"], seeded.pending[0].0);
    let (status, reply) = post_json(
        addr,
        "/api/bulk",
        json!({"action": "delete", "filter": {"queue": "mail", "state": "COMPLETED"}}),
        &[],
    )
    .await;
    assert_eq!((status, reply["done"].as_u64()), (200, Some(2)), "{reply}");
    assert!(store.get(seeded.completed[0]).await.unwrap().is_none());

    // Workflows: the graph by step, and the actions on it.
    let flow = get_json(addr, &format!("/api/workflows/{}", seeded.workflow)).await;
    assert_eq!(flow["steps"].as_array().unwrap().len(), 3, "{flow}");
    let edges: Vec<(u64, u64, bool)> = flow["edges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["parent"].as_u64().unwrap(), e["child"].as_u64().unwrap(), e["allow_failed"].as_bool().unwrap()))
        .collect();
    assert_eq!(edges, [(0, 2, false), (1, 2, true)]);
    assert_eq!(flow["steps"][2]["state"], "WAITING");
    let listed = get_json(addr, "/api/workflows").await;
    assert_eq!(listed["workflows"][0]["id"], seeded.workflow.0);
    let (status, reply) = post_json(addr, &format!("/api/workflows/{}/pause", seeded.workflow), json!({}), &[]).await;
    assert_eq!((status, reply["status"].as_str()), (200, Some("paused")), "{reply}");
    let (status, _) = post_json(addr, "/api/workflows/999999/cancel", json!({}), &[]).await;
    assert_eq!(status, 404);
    // A name made to resolve here (DNS rebinding) is refused without auth; IPs are answered.
    let (status, _) = request(addr, "GET", "/api/overview", &[("Host", "evil.example:8080")], None).await;
    assert_eq!(status, 403);
    // Another site's page cannot act: its Origin is refused, a body-less POST is not JSON.
    let evil = [("Origin", "http://evil.example")];
    let (status, reply) =
        post_json(addr, &format!("/api/workflows/{}/cancel", seeded.workflow), json!({}), &evil).await;
    assert_eq!(status, 403, "{reply}");
    let (status, _) = request(addr, "POST", &format!("/api/workflows/{}/cancel", seeded.workflow), &[], None).await;
    assert_eq!(status, 415);
    let same = format!("http://{addr}");
    let (status, reply) =
        post_json(addr, &format!("/api/workflows/{}/resume", seeded.workflow), json!({}), &[("Origin", &same)]).await;
    assert_eq!((status, reply["status"].as_str()), (200, Some("running")), "{reply}");

    // Tasks finished after the dashboard started are counted per queue, a moment behind.
    for &task in &seeded.pending[1..4] {
        store.admin(&canter_tokio::canter::store::AdminRequest::Complete { task, result: json!(1) }).await.unwrap();
    }
    let counted = tokio::time::Instant::now();
    loop {
        let overview = next_overview().await;
        if queue(&overview, "default")["completed"] == 3 {
            assert!(!overview["throughput"].as_array().unwrap().is_empty(), "{overview}");
            break;
        }
        assert!(counted.elapsed() < Duration::from_secs(10), "never counted: {overview}");
    }

    // Metrics: each queue's depth and age.
    let (status, metrics) = request(addr, "GET", "/metrics", &[], None).await;
    assert_eq!(status, 200);
    // Two pending left of five, and the two failed ones retried.
    assert!(metrics.contains("canter_queue_tasks{queue=\"default\",state=\"due\"} 4"), "{metrics}");
    assert!(metrics.contains("canter_queue_paused{queue=\"mail\"} 1"), "{metrics}");
    assert!(
        metrics.contains("canter_queue_tasks_finished_total{queue=\"default\",state=\"COMPLETED\"} 3"),
        "{metrics}"
    );

    // Closing ends the event stream, so the server stops at once.
    dashboard.close();
    let mut rest = String::new();
    let ended =
        tokio::time::timeout(Duration::from_secs(5), async { while events.read_line(&mut rest).await.unwrap() > 0 {} });
    assert!(ended.await.is_ok(), "the event stream did not end");
    endpoints.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_and_basic_auth_guard_the_dashboard() {
    let db = pg::TestDb::production().await;
    let store = db.store(seed_app(), 4).await;
    let seeded = seed(&store).await;
    let options = DashboardOptions {
        read_only: true,
        basic_auth: Some(("ops".into(), "s3cret".into())),
        ..DashboardOptions::default()
    };
    let dashboard = Dashboard::new(store.clone(), options);
    let endpoints = Endpoints::bind("127.0.0.1:0", dashboard.router()).await.expect("bind");
    let addr = endpoints.local_addr;

    // ops:s3cret and a wrong password.
    let good = [("Authorization", "Basic b3BzOnMzY3JldA==")];
    let bad = [("Authorization", "Basic b3BzOnMzY3JldHg=")];
    for path in ["/", "/api/overview", "/api/tasks", "/metrics"] {
        assert_eq!(request(addr, "GET", path, &[], None).await.0, 401, "{path}");
        assert_eq!(request(addr, "GET", path, &bad, None).await.0, 401, "{path}");
        assert_eq!(request(addr, "GET", path, &good, None).await.0, 200, "{path}");
    }
    // Probes need no password.
    assert_eq!(request(addr, "GET", "/healthz", &[], None).await.0, 200);
    assert_eq!(request(addr, "GET", "/readyz", &[], None).await, (200, "ready\n".to_owned()));

    let overview: Value = serde_json::from_str(&request(addr, "GET", "/api/overview", &good, None).await.1).unwrap();
    assert_eq!(overview["read_only"], true);
    let task = seeded.failed[0];
    for (path, body) in [
        ("/api/admin", json!({"action": "retry", "task": task})),
        ("/api/bulk", json!({"action": "retry", "ids": [task]})),
        (&*format!("/api/workflows/{}/cancel", seeded.workflow), json!({})),
    ] {
        let (status, reply) = post_json(addr, path, body, &good).await;
        assert_eq!(status, 403, "{path}: {reply}");
        assert_eq!(reply["error"], "the dashboard is read-only");
    }
    assert_eq!(store.get(task).await.unwrap().unwrap().state, canter_tokio::TaskState::Failed);
    dashboard.close();
    endpoints.stop().await;
}
