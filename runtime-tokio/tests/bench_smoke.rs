//! `canter bench` with tiny sizes: every workload and both modes run to the end and print
//! parseable JSON. Nothing here is timed: a benchmark is a program that prints numbers.

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::process::Command;

use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_every_workload_with_tiny_sizes_and_prints_json() {
    let url = pg::server_url().await;
    let output = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["bench", "--database-url", &url, "--workload", "all", "--baseline", "both", "--runs", "1"])
        .args(["--tasks", "300", "--enqueue-tasks", "50", "--bulk-size", "20", "--latency-tasks", "20"])
        .args(["--interval-ms", "2", "--history-tasks", "500", "--concurrency", "4", "--json-only"])
        .env("CANTER_LOG", "warn")
        .output()
        .expect("run canter bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "canter bench failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    let mut seen: Vec<(String, String)> = lines
        .iter()
        .map(|l| (l["workload"].as_str().unwrap().to_owned(), l["mode"].as_str().unwrap().to_owned()))
        .collect();
    seen.sort();
    let mut expected = Vec::new();
    for workload in ["drain", "enqueue_bulk", "enqueue_one", "history", "latency"] {
        for mode in ["canter", "raw"] {
            expected.push((workload.to_owned(), mode.to_owned()));
        }
    }
    // Urgent tasks during a drain: Canter alone (the raw loop has no priorities).
    expected.push(("latency_under_load".to_owned(), "canter".to_owned()));
    assert_eq!(seen, expected);
    for line in &lines {
        assert!(line["per_sec"].as_f64().is_some(), "{line}");
        if line["workload"] == "latency" || line["workload"] == "latency_under_load" {
            assert!(line["p99_ms"].as_f64().is_some(), "{line}");
        }
    }
    if cfg!(target_os = "linux") {
        assert!(lines.iter().any(|l| l["workload"] == "drain" && l["peak_rss_mib"].as_f64().is_some()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_drains_with_several_worker_processes() {
    let url = pg::server_url().await;
    let output = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["bench", "--database-url", &url, "--workload", "drain", "--runs", "1", "--workers", "2"])
        .args(["--tasks", "400", "--concurrency", "2", "--json-only"])
        .env("CANTER_LOG", "warn")
        .output()
        .expect("run canter bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "canter bench failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let lines: Vec<Value> = stdout.lines().map(|line| serde_json::from_str(line).expect("JSON")).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines.iter().all(|l| l["workers"] == 2 && l["tasks"] == 400), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_times_a_drain_without_a_result_waiter() {
    let url = pg::server_url().await;
    let output = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["bench", "--database-url", &url, "--workload", "drain", "--runs", "1", "--baseline", "none"])
        .args(["--tasks", "400", "--concurrency", "2", "--json-only", "--no-result-waiter"])
        .env("CANTER_LOG", "warn")
        .output()
        .expect("run canter bench");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "canter bench failed: {stderr}\n{stdout}");
    let lines: Vec<Value> = stdout.lines().map(|line| serde_json::from_str(line).expect("JSON")).collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert!(lines[0]["tasks"] == 400 && lines[0]["mode"] == "canter", "{stdout}");
}
