//! What the dashboard tests share: a schema with tasks in several states and a workflow, and
//! HTTP requests made by hand (one per connection, as a browser's first request is).

use std::net::SocketAddr;
use std::time::Duration;

use canter_tokio::canter::config::QueueMode;
use canter_tokio::canter::postgres::PgStore;
use canter_tokio::canter::store::{AdminRequest, NewTask, NewWorkflow};
use canter_tokio::canter::workflow::{EdgePolicy, Join};
use canter_tokio::{AppConfig, CustomQueue, TaskId, WorkflowId};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The queues [`seed`] writes to: `default`, `mail` (capped at 3) and `flows`; and `jobs`.
pub fn seed_app() -> AppConfig {
    let mut mail = CustomQueue::new("mail");
    mail.max_concurrency = Some(3);
    AppConfig {
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue::new("default"), mail, CustomQueue::new("flows"), CustomQueue::new("jobs")],
        ..AppConfig::default()
    }
}

/// What [`seed`] wrote.
#[allow(dead_code, reason = "each test reads its part")]
pub struct Seeded {
    /// Pending `noop` tasks of queue `default`.
    pub pending: Vec<TaskId>,
    /// Failed `fail` tasks of queue `default`, oldest first.
    pub failed: Vec<TaskId>,
    /// Completed tasks of queue `mail`.
    pub completed: Vec<TaskId>,
    /// A workflow of three steps: two roots and a join.
    pub workflow: WorkflowId,
}

/// Five pending tasks, three failed ones (failed by hand, so no worker is needed), two
/// completed ones in queue `mail`, and a workflow.
pub async fn seed(store: &PgStore) -> Seeded {
    let noop = |n: i64| NewTask::new("noop", json!({"n": n}));
    let pending = store.enqueue_many((0..5).map(noop).collect()).await.expect("enqueue");
    let failed =
        store.enqueue_many((0..3).map(|n| NewTask::new("fail", json!({"n": n}))).collect()).await.expect("enqueue");
    for &task in &failed {
        store.admin(&AdminRequest::Fail { task, message: "it broke".into() }).await.expect("fail by hand");
    }
    let completed = store.enqueue_many((0..2).map(|n| noop(n).queue("mail")).collect()).await.expect("enqueue");
    for &task in &completed {
        store.admin(&AdminRequest::Complete { task, result: json!("sent") }).await.expect("complete by hand");
    }
    let mut flow = NewWorkflow::new("etl");
    let extract = flow.step(NewTask::new("noop", json!("extract")).queue("flows"), Join::All);
    let other = flow.step(NewTask::new("noop", json!("other")).queue("flows"), Join::All);
    let load = flow.step(NewTask::new("noop", json!("load")).queue("flows"), Join::All);
    flow.edge(extract, load, EdgePolicy::RequireSuccess);
    flow.edge(other, load, EdgePolicy::AllowFailed);
    let workflow = store.submit_workflow(&flow).await.expect("submit").workflow;
    Seeded { pending, failed, completed, workflow }
}

/// `method path` with `body` (JSON when given) and extra `headers`: the status and the body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut request = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = body.unwrap_or("");
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_string(&mut response))
        .await
        .expect("an answer within 30 s")
        .expect("read");
    let (head, body) = response.split_once("\r\n\r\n").expect("head and body");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status");
    (status, body.to_owned())
}

/// `GET path`, expecting 200 and JSON.
#[allow(dead_code, reason = "not every test reads JSON")]
pub async fn get_json(addr: SocketAddr, path: &str) -> Value {
    let (status, body) = request(addr, "GET", path, &[], None).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"))
}

/// `POST path` with a JSON body: the status and the JSON answer.
#[allow(dead_code, reason = "not every test acts")]
pub async fn post_json(addr: SocketAddr, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut all = vec![("Content-Type", "application/json")];
    all.extend_from_slice(headers);
    let (status, text) = request(addr, "POST", path, &all, Some(&body.to_string())).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}
