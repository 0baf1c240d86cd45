//! Embedding without an adapter: the worker machine driven by a hand-written loop on one
//! thread, with a timer heap for handler work and blocking database calls.
//!
//! No tokio, no smol: handlers here are simulated jobs (`sleep`) whose completion is an entry
//! in the timer heap; the database is PostgreSQL through blocking calls
//! (`futures::executor::block_on` over the store; sqlx's async-io backend needs no runtime)
//! when `DATABASE_URL` is set, and the in-memory store otherwise.
//!
//! ```sh
//! cargo run --example custom_executor
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run --example custom_executor
//! ```

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use canter::config::{AppConfig, WorkerConfig};
use canter::memory::MemoryStore;
use canter::postgres::{PgSchema, PgStore};
use canter::store::{DbFailure, DbReply, DbRequest, DbTime, NewTask};
use canter::task::{Lease, TaskId, WorkerId};
use canter::worker::{Command, Input, TaskOutcome, Worker};
use serde_json::json;

/// The one place this loop reads the clock.
#[allow(clippy::disallowed_methods)]
fn now() -> Instant {
    Instant::now()
}

/// Where requests go: both answer synchronously.
enum Database {
    Memory { store: Box<MemoryStore>, epoch: Instant },
    Postgres(PgStore),
}

impl Database {
    fn execute(&mut self, request: &DbRequest) -> Result<DbReply, DbFailure> {
        match self {
            Database::Memory { store, epoch } => {
                let db_now = DbTime(1_700_000_000_000 + epoch.elapsed().as_millis() as i64);
                Ok(store.apply(request, db_now))
            }
            // A blocking call: this thread waits for PostgreSQL.
            Database::Postgres(store) => futures::executor::block_on(store.execute(request)),
        }
    }

    fn enqueue(&mut self, tasks: Vec<NewTask>) -> Vec<TaskId> {
        match self {
            Database::Memory { store, epoch } => {
                let db_now = DbTime(1_700_000_000_000 + epoch.elapsed().as_millis() as i64);
                store.enqueue_many(tasks, db_now).expect("valid tasks")
            }
            Database::Postgres(store) => futures::executor::block_on(store.enqueue_many(tasks)).expect("enqueue"),
        }
    }
}

fn main() {
    let app = AppConfig::default();
    let mut database = match std::env::var("DATABASE_URL") {
        Ok(url) => {
            let pool = futures::executor::block_on(sqlx::PgPool::connect(&url)).expect("connect to PostgreSQL");
            let store = PgStore::new(pool, PgSchema::new("canter_custom_executor").expect("schema"), app.clone());
            futures::executor::block_on(store.migrate()).expect("migrate");
            println!("custom executor on PostgreSQL (schema canter_custom_executor)");
            Database::Postgres(store)
        }
        Err(_) => {
            println!("custom executor on the in-memory store (set DATABASE_URL for PostgreSQL)");
            Database::Memory { store: Box::new(MemoryStore::new(app.clone())), epoch: now() }
        }
    };
    let ids = database.enqueue((0..50).map(|i| NewTask::new("sleep", json!({"ms": 5 + i % 20}))).collect());

    let config = WorkerConfig { concurrency: 8, ..WorkerConfig::default() };
    let mut worker = Worker::new(WorkerId("custom-1".into()), app, config, now()).expect("valid config");
    // The timer heap: when each simulated job finishes.
    let mut jobs: BinaryHeap<Reverse<(Instant, TaskId, Lease)>> = BinaryHeap::new();
    let mut completed = 0;
    loop {
        // 1. Do what the machine asks: database calls block this thread; spawns go on the heap.
        while let Some(command) = worker.poll_command() {
            match command {
                Command::Db { op, request } => {
                    let reply = database.execute(&request);
                    worker.handle_input(Input::Db { op, reply }, now());
                }
                Command::Spawn(run) => {
                    let ms = run.args["ms"].as_u64().unwrap_or(1);
                    jobs.push(Reverse((now() + Duration::from_millis(ms), run.id, run.lease)));
                }
                // A simulated job is aborted by forgetting it.
                Command::Abort { task, .. } => jobs.retain(|Reverse((_, id, _))| *id != task),
                // A command of a later core: this driver cannot carry it out.
                other => panic!("a command this driver does not know: {other:?}"),
            }
        }
        while let Some(event) = worker.poll_event() {
            if let canter::worker::Event::Finished { task, state } = event {
                completed += 1;
                println!("task {task} {state} ({completed}/{})", ids.len());
            }
        }
        if worker.is_stopped() {
            break;
        }
        if completed == ids.len() && !worker.is_shutting_down() {
            worker.handle_input(Input::Shutdown, now());
            continue;
        }
        // 2. Sleep until the earlier of the next job and the machine's next deadline.
        let next_job = jobs.peek().map(|Reverse((at, _, _))| *at);
        let next_timer = worker.poll_timeout().map(|(at, _)| at);
        let wake =
            [next_job, next_timer].into_iter().flatten().min().unwrap_or_else(|| now() + Duration::from_millis(50));
        std::thread::sleep(wake.saturating_duration_since(now()));
        // 3. Feed back what is due.
        let at = now();
        while jobs.peek().is_some_and(|Reverse((due, _, _))| *due <= at) {
            let Reverse((_, task, lease)) = jobs.pop().expect("peeked");
            worker.handle_input(Input::TaskFinished { task, lease, outcome: TaskOutcome::Success(json!("done")) }, at);
        }
        if worker.poll_timeout().is_some_and(|(deadline, _)| deadline <= at) {
            worker.handle_timeout(at);
        }
    }
    println!("all {} tasks done; worker drained", ids.len());
}
