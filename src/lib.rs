//! Canter: a PostgreSQL-backed distributed task queue with a sans-IO core.
//!
//! Applications enqueue tasks; any number of workers claim them with `FOR UPDATE SKIP LOCKED`,
//! run them under concurrency caps (per worker, per queue across the cluster, across the whole
//! cluster), write results back, and recover from crashes, outages and lost notifications.
//!
//! This crate is the core. Without features it is pure: deterministic state machines driven
//! by events, with time and randomness passed in. It reads no clock, draws no OS randomness
//! and does no I/O, so it runs the same under tokio, smol, a hand-written loop or a
//! deterministic simulation.
//!
//! # Modules
//!
//! - [`task`]: task states and the transitions between them, ids, lease tokens, database
//!   times, flags, error codes.
//! - [`config`]: all configuration, validated (every violation reported at once, by the
//!   leaf [`check`]).
//! - [`budget`]: how many tasks one claim pass may take from which queue, under every cap.
//! - [`backoff`]: retry delays and database-error backoff as pure functions.
//! - [`store`]: the vocabulary every store speaks: the protocol between the worker machine
//!   and a store, operator actions as data, new tasks and their checks, inspection records.
//! - [`worker`]: the sans-IO worker machine.
//! - [`memory`]: an in-memory store with exactly the semantics of the SQL, for tests,
//!   simulation and running without PostgreSQL (`postgres` is the other, file for file).
//! - [`rng`]: a small seeded PRNG.
//! - [`schedule`]: tasks enqueued on a timetable (cron, intervals, daily, weekly, monthly) in
//!   a time zone read from TZif bytes, and which ticks fall due; [`scheduler`]: what the
//!   app's schedules enqueue, and when to look again.
//! - [`time`]: durations (`90s`, `1h30m`) and instants (RFC 3339, or a duration from now) as
//!   text, one grammar for the command line, the configuration and schedules.
//! - [`isolation`]: what a worker and the child processes running its isolated tasks say to
//!   each other, framed, and what a child's failure costs its task.
//! - [`wake`]: wake-ups carried by a message broker instead of LISTEN/NOTIFY, as data.
//! - [`workflow`]: graphs of steps that wait for their parents (fan-out, fan-in, any and
//!   quorum joins, recovery steps): the checks, the per-edge decision and the workflow machine.
//!
//! Behind features: `postgres` (the PostgreSQL store), `driver` (one async loop over a small
//! runtime trait, shared by the tokio and smol adapters), `metrics` (a worker's counters in the
//! Prometheus text format, `driver::metrics`), `isolation` (isolated tasks in child processes,
//! `driver::isolation`), `rabbitmq` and `nats` (wake-ups through a broker,
//! `driver::wakeups`), `sim` (the simulation harness),
//! `arbitrary` (`arbitrary::Arbitrary` for the simulation's operation sequences, for fuzzing).
//!
//! # The calling contract
//!
//! A driver owns a [`Worker`](worker::Worker). Its methods come in four kinds (after
//! quinn-proto's `Connection`):
//!
//! - **inputs**: [`handle_input`] for something that happened (a database reply, a handler
//!   finished, a notification, a shutdown request) and [`handle_timeout`] when the deadline of
//!   [`poll_timeout`] is reached;
//! - **outputs**: [`poll_command`] (run this database request, spawn this handler, abort that
//!   one) and [`poll_event`] (for observers);
//! - **the next deadline**: [`poll_timeout`];
//! - **getters**: [`stats`], [`is_stopped`] and friends.
//!
//! After **every** input, drain `poll_command` until `None` and execute each command, drain
//! `poll_event`, then read `poll_timeout` and call `handle_timeout` no earlier than its deadline.
//! `now` must never go backwards between calls. An early or spurious `handle_timeout` does
//! nothing. Every [`Command::Db`] must eventually be answered with exactly one [`Input::Db`]
//! carrying the same [`OpId`]: a reply, or a [`DbFailure`] (`Unknown` when the request was sent
//! and no answer came). Every [`Command::Spawn`] must eventually be answered with an
//! [`Input::TaskFinished`] unless an [`Command::Abort`] for it came first (an answer after an
//! abort is ignored). Replies may come in any order.
//!
//! [`handle_input`]: worker::Worker::handle_input
//! [`handle_timeout`]: worker::Worker::handle_timeout
//! [`poll_timeout`]: worker::Worker::poll_timeout
//! [`poll_command`]: worker::Worker::poll_command
//! [`poll_event`]: worker::Worker::poll_event
//! [`stats`]: worker::Worker::stats
//! [`is_stopped`]: worker::Worker::is_stopped
//! [`Command::Db`]: worker::Command::Db
//! [`Command::Spawn`]: worker::Command::Spawn
//! [`Command::Abort`]: worker::Command::Abort
//! [`Input::Db`]: worker::Input::Db
//! [`Input::TaskFinished`]: worker::Input::TaskFinished
//! [`OpId`]: store::OpId
//! [`DbFailure`]: store::DbFailure
//!
//! Database faults are inputs, not errors: a reply can be `Unavailable`, `Unknown` (sent, no
//! answer), `Rejected`, `Invalid` (a value the database refuses) or `LockTimeout` (a lock held
//! elsewhere for too long), and the machine stays correct under all of them.
//!
//! ```
//! use std::time::Instant;
//! use canter::config::{AppConfig, WorkerConfig};
//! use canter::store::{DbTime, NewTask};
//! use canter::memory::MemoryStore;
//! use canter::task::WorkerId;
//! use canter::worker::{Command, Input, TaskOutcome, Worker};
//!
//! let app = AppConfig::default();
//! let mut store = MemoryStore::new(app.clone());
//! let db_now = DbTime(1_700_000_000_000);
//! let id = store.enqueue(NewTask::new("greet", serde_json::json!({"name": "Ada"})), db_now).unwrap();
//!
//! let now = Instant::now();
//! let mut worker = Worker::new(WorkerId("w1".into()), app, WorkerConfig::default(), now).unwrap();
//! // Drive it until the task is written back.
//! while !store.get(id).unwrap().state.is_terminal() {
//!     let Some(command) = worker.poll_command() else { break };
//!     match command {
//!         Command::Db { op, request } => {
//!             let reply = store.apply(&request, db_now);
//!             worker.handle_input(Input::Db { op, reply: Ok(reply) }, now);
//!         }
//!         Command::Spawn(run) => {
//!             let greeting = format!("hello, {}", run.args["name"].as_str().unwrap());
//!             let outcome = TaskOutcome::Success(greeting.into());
//!             worker.handle_input(Input::TaskFinished { task: run.id, lease: run.lease, outcome }, now);
//!         }
//!         Command::Abort { .. } => {}
//!         other => panic!("a command this driver does not know: {other:?}"),
//!     }
//! }
//! assert_eq!(store.get(id).unwrap().result, Some("hello, Ada".into()));
//! ```
// One module borrows socket descriptors sqlx does not expose (`postgres::tcp`).
#![deny(unsafe_code)]

pub mod backoff;
pub mod budget;
pub mod check;
pub mod config;
pub mod isolation;
pub mod memory;
pub mod rng;
pub mod schedule;
pub mod scheduler;
pub mod store;
pub mod task;
pub mod time;
pub mod wake;
pub mod worker;
pub mod workflow;

#[cfg(feature = "driver")]
pub mod driver;

#[cfg(feature = "postgres")]
pub mod postgres;

#[cfg(feature = "sim")]
pub mod sim;
