//! The isolation scenarios both adapters run (in test programs without libtest's harness:
//! such a program is also the children its pools start). Every way a child can fail costs its
//! task alone, with `WORKER_CHILD_CRASHED` and the way it failed, while a task beside it in
//! another child finishes; an aborted task kills its child; a child that writes garbage is
//! killed; a storm of crashes leaves the pool serving; children are recycled after their share.

use std::io::Write;
use std::time::Duration;

use canter::driver::isolation::{IsolationOptions, ProcessPool, child_socket};
use canter::driver::{Registry, Runtime};
use canter::store::DbTime;
use canter::task::{Attempt, ErrorCode, Lease, TaskError, TaskId};
use canter::worker::{TaskOutcome, TaskRun};

/// The handlers the scenarios' children serve.
pub fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.register_blocking("double", |n: u64, _| -> Result<u64, TaskError> { Ok(n * 2) }).unwrap();
    registry
        .register_blocking("abort", |_: serde_json::Value, _| -> Result<(), TaskError> { std::process::abort() })
        .unwrap();
    registry
        .register_blocking("segfault", |_: (), _| -> Result<(), TaskError> {
            // A SIGSEGV as a bad pointer raises it, without undefined behaviour here. The first
            // meets std's guard-page handler, which finds no overflow, restores the default
            // action and returns; the second kills.
            let pid = std::process::id().to_string();
            for _ in 0..2 {
                let _ = std::process::Command::new("kill").args(["-SEGV", &pid]).status();
                std::thread::sleep(Duration::from_millis(100));
            }
            std::thread::sleep(Duration::from_secs(10));
            Ok(())
        })
        .unwrap();
    registry.register_blocking("overflow", |depth: u64, _| -> Result<u64, TaskError> { Ok(recurse(depth)) }).unwrap();
    registry
        .register_blocking("hog", |_: (), _| -> Result<usize, TaskError> {
            let mut held: Vec<Vec<u8>> = Vec::new();
            loop {
                held.push(vec![1u8; 64 << 20]);
                if held.len() > 1 << 20 {
                    return Ok(held.len());
                }
            }
        })
        .unwrap();
    registry.register_blocking("exit", |code: i32, _| -> Result<(), TaskError> { std::process::exit(code) }).unwrap();
    registry
        .register_blocking("sleep", |ms: u64, _| -> Result<(), TaskError> {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(())
        })
        .unwrap();
    registry
        .register_blocking("print", |_: (), _| -> Result<&'static str, TaskError> {
            // A handler's prints go to the worker's stdout, not into the protocol.
            println!("printed by a child");
            let _ = std::io::stdout().flush();
            Ok("fine")
        })
        .unwrap();
    registry
}

fn recurse(depth: u64) -> u64 {
    let frame = std::hint::black_box([depth; 512]);
    if depth == 0 { frame[0] } else { recurse(depth + 1).wrapping_add(frame[1]) }
}

fn run(id: i64, name: &str, args: serde_json::Value) -> TaskRun {
    TaskRun {
        id: TaskId(id),
        lease: Lease(1),
        attempt: Attempt(1),
        name: name.to_owned(),
        queue: "default".to_owned(),
        priority: 0,
        enqueued_at: DbTime(0),
        run_at: DbTime(0),
        args,
        deadline: None,
    }
}

fn pool(options: IsolationOptions) -> ProcessPool {
    ProcessPool::new(IsolationOptions { args: Some(options.args.clone().unwrap_or_default()), ..options }).unwrap()
}

#[track_caller]
fn crashed(outcome: &TaskOutcome, expected: &str) {
    let TaskOutcome::Failure(error) = outcome else { panic!("expected a crash, got {outcome:?}") };
    assert_eq!(error.code, ErrorCode::WorkerChildCrashed, "{error:?}");
    assert!(error.message.contains(expected), "{expected:?} not in {:?}", error.message);
}

async fn each_failure_costs_its_task_alone() {
    let pool = pool(IsolationOptions { processes: 2, memory_limit_bytes: Some(1 << 30), ..Default::default() });
    let cases: [(&str, serde_json::Value, &str); 6] = [
        ("abort", serde_json::json!(null), "signal 6"),
        ("segfault", serde_json::json!(null), "signal 11"),
        ("overflow", serde_json::json!(1), "signal 6"),
        ("hog", serde_json::json!(null), "signal 6"),
        ("exit", serde_json::json!(3), "exited with status 3"),
        ("exit", serde_json::json!(0), "exited with status 0"),
    ];
    for (i, (name, args, expected)) in cases.into_iter().enumerate() {
        let i = i as i64 * 2;
        let (failed, fine) =
            futures::join!(pool.run(run(i, name, args)), pool.run(run(i + 1, "double", serde_json::json!(21))));
        crashed(&failed, expected);
        assert_eq!(fine, TaskOutcome::Success(serde_json::json!(42)), "beside {name}");
    }
    let printed = pool.run(run(100, "print", serde_json::json!(null))).await;
    assert_eq!(printed, TaskOutcome::Success(serde_json::json!("fine")));
    let stats = pool.stats();
    assert_eq!(stats.crashed, 6, "{stats:?}");
    println!("each failure kind: ok ({stats:?})");
}

async fn an_aborted_task_kills_its_child<R: Runtime>(runtime: &R) {
    let pool = pool(IsolationOptions { processes: 1, ..Default::default() });
    let slow = pool.run(run(1, "sleep", serde_json::json!(60_000)));
    let waited = runtime.sleep_until(runtime.now() + Duration::from_millis(500));
    assert!(matches!(futures::future::select(slow, waited).await, futures::future::Either::Right(_)), "still sleeping");
    let stats = pool.stats();
    assert_eq!(stats.killed, 1, "{stats:?}");
    // The pool's one room is free again, with a new child.
    let next = pool.run(run(2, "double", serde_json::json!(1))).await;
    assert_eq!(next, TaskOutcome::Success(serde_json::json!(2)), "the room came back");
    assert_eq!(pool.stats().started, 2);
    println!("an aborted task: ok");
}

async fn a_child_that_writes_garbage_is_killed() {
    let pool = pool(IsolationOptions { processes: 1, args: Some(vec!["garbage".into()]), ..Default::default() });
    let outcome = pool.run(run(1, "double", serde_json::json!(1))).await;
    crashed(&outcome, "killed");
    println!("garbage: ok");
}

async fn a_storm_of_crashes_leaves_the_pool_serving() {
    let pool = pool(IsolationOptions { processes: 2, ..Default::default() });
    let runs = (0..40).map(|i| {
        let name = if i % 2 == 0 { "abort" } else { "double" };
        pool.run(run(i, name, serde_json::json!(i)))
    });
    let outcomes = futures::future::join_all(runs).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        if i % 2 == 0 {
            crashed(outcome, "signal 6");
        } else {
            assert_eq!(outcome, &TaskOutcome::Success(serde_json::json!(i * 2)));
        }
    }
    assert_eq!(pool.stats().crashed, 20);
    println!("a storm: ok ({:?})", pool.stats());
}

async fn children_are_recycled_after_their_share() {
    let pool = pool(IsolationOptions { processes: 1, recycle_after: Some(2), ..Default::default() });
    for i in 0..5 {
        assert_eq!(
            pool.run(run(i, "double", serde_json::json!(i))).await,
            TaskOutcome::Success(serde_json::json!(i * 2))
        );
    }
    let stats = pool.stats();
    assert_eq!((stats.started, stats.recycled), (3, 2), "{stats:?}");
    println!("recycling: ok");
}

/// Serves as the garbage child when this program was started as one (its pool's arguments
/// say so): returns whether it did.
pub fn served_as_garbage_child() -> bool {
    if child_socket().is_none() || !std::env::args().any(|arg| arg == "garbage") {
        return false;
    }
    // A child that answers with bytes that are no frame of a message.
    let socket = child_socket().unwrap();
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.write_all(&[0, 0, 0, 5, b'h', b'e', b'l', b'l', b'o']).unwrap();
    std::thread::sleep(Duration::from_secs(30));
    true
}

/// Whether this program was started to try making a pool as a child would: it prints what
/// came of it.
pub fn tried_a_pool_in_a_child() -> bool {
    if !std::env::args().any(|arg| arg == "pool-in-child") {
        return false;
    }
    match ProcessPool::new(IsolationOptions::default()) {
        Ok(_) => println!("made a pool"),
        Err(error) => println!("refused: {error}"),
    }
    true
}

/// A child whose `main` goes on instead of serving cannot start children of its own.
fn a_child_cannot_make_a_pool() {
    let program = std::env::current_exe().unwrap();
    let output = std::process::Command::new(program)
        .arg("pool-in-child")
        .env(canter::isolation::CHILD_ENV, "/nonexistent/canter.sock")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(printed.contains("refused: this process is a child of a process pool"), "{printed}");
    println!("a pool in a child: refused, ok");
}

/// Every scenario, one after the other.
pub async fn every_scenario<R: Runtime>(runtime: &R) {
    each_failure_costs_its_task_alone().await;
    an_aborted_task_kills_its_child(runtime).await;
    a_child_that_writes_garbage_is_killed().await;
    a_storm_of_crashes_leaves_the_pool_serving().await;
    children_are_recycled_after_their_share().await;
    a_child_cannot_make_a_pool();
}
