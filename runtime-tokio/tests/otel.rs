//! The program's spans exported over OTLP/HTTP (feature `otel`) to a collector that records
//! what it receives: a worker's `canter.task` spans arrive, under the service name `canter`.
#![cfg(feature = "otel")]

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A collector on a port of its own: each request's head and body, answered 200.
async fn collector() -> (String, Arc<Mutex<Vec<(String, Vec<u8>)>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received = Arc::new(Mutex::new(Vec::new()));
    let record = received.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut data = Vec::new();
                let mut buffer = [0u8; 8192];
                // The head, then as much body as it announces.
                let (head, body_start) = loop {
                    let n = stream.read(&mut buffer).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buffer[..n]);
                    if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                        break (String::from_utf8_lossy(&data[..end]).to_string(), end + 4);
                    }
                };
                let length = head
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned()))
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
                while data.len() < body_start + length {
                    let n = stream.read(&mut buffer).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    data.extend_from_slice(&buffer[..n]);
                }
                record.lock().unwrap().push((head, data[body_start..].to_vec()));
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
            });
        }
    });
    (url, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_exports_a_span_per_task_run() {
    let db = pg::TestDb::new().await;
    let (url, received) = collector().await;
    let canter = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_canter"));
        command.args(args).args(["--database-url", &db.url, "--schema", db.schema.name()]);
        command
    };
    assert!(canter(&["migrate"]).output().unwrap().status.success());
    let worker = canter(&["worker"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &url)
        .env_remove("OTEL_SERVICE_NAME")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let enqueued = canter(&["enqueue", "echo", "--args", r#"{"a":1}"#]).output().unwrap();
    let id = String::from_utf8_lossy(&enqueued.stdout).trim().to_owned();
    let result = canter(&["result", &id, "--wait", "20s"]).output().unwrap();
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    // Spans go in batches; the rest at exit.
    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    let worker = tokio::task::spawn_blocking(move || worker.wait_with_output()).await.unwrap().unwrap();
    assert!(worker.status.success(), "{}", String::from_utf8_lossy(&worker.stderr));
    let mut exports = Vec::new();
    for _ in 0..100 {
        exports = received.lock().unwrap().clone();
        if !exports.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (head, body) = exports.first().expect("an export reached the collector");
    assert!(head.starts_with("POST /v1/traces "), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/x-protobuf"), "{head}");
    // Protobuf keeps strings as they are: the span's name, its task's id, the service's name.
    let all: Vec<u8> = exports.iter().flat_map(|(_, body)| body.clone()).collect();
    let contains = |needle: &[u8]| all.windows(needle.len()).any(|w| w == needle);
    assert!(contains(b"canter.task"), "{} bytes without the task span", body.len());
    assert!(contains(b"echo"), "the task's name");
    // The resource names the service: ours, not the SDK's default `unknown_service:...`.
    // KeyValue { key: "service.name", value: AnyValue { string_value: "canter" } } as protobuf.
    assert!(contains(b"service.name\x12\x08\x0a\x06canter"), "the service name");
    assert!(!contains(b"unknown_service"));
}
