//! An in-memory store: the database of the [protocol](crate::store) without PostgreSQL.
//!
//! [`MemoryStore`] applies the worker machine's [`DbRequest`](crate::store::DbRequest)s with exactly the semantics the
//! SQL has, so the core's tests, the deterministic simulation and users' unit tests can run
//! the whole system with no database. Like the SQL schema it keeps two tables: the live table
//! (Pending, Claimed and Running tasks, the only ones a claim scans) and the finished table
//! (terminal tasks with their result or error); a terminal transition moves the row. It also
//! keeps the attempts history (one record per finished run), the task keys, the worker
//! registry, paused queues, schedule records, workflows and the notifications PostgreSQL would
//! send.
//!
//! Every request applies atomically: [`MemoryStore::apply`] takes `&mut self`, so no two
//! requests interleave. That is what `FOR UPDATE SKIP LOCKED` achieves across workers in
//! PostgreSQL (no row is handed to two claimers, and a claimer never waits for a row another
//! holds), and the advisory locks around capped claims (the counts a claim sees are the counts
//! it acts on). A claim here never meets a locked row, so it sees every eligible row: the
//! PostgreSQL store may claim fewer under contention, never more.
//!
//! The store is pure like the rest of the core: `now` is always an argument, and the only
//! randomness is the `entropy` a [`DbRequest::Reap`](crate::store::DbRequest::Reap) carries. Every state change goes through
//! [`transition`](crate::task::transition); a refused one is a broken invariant of this module and panics. Bad input
//! (unknown ids, stale leases, other workers' tasks) never panics: it is reported `lost` or
//! returned as an error.

mod admin;
mod enqueue;
mod protocol;
mod records;
mod schedules;
mod store;
mod workflow;

pub use store::{LOCK_TIMEOUT_MESSAGE, LOCK_TIMEOUT_MS, MemoryStore, READABLE_JSON_DEPTH, StoredTask, json_depth};

#[cfg(test)]
mod tests;
