//! The store boundary: the vocabulary every store speaks, one file per part of it.
//!
//! - [`protocol`]: what the worker machine asks a store ([`DbRequest`]), what it answers
//!   ([`DbReply`]) or how the request failed ([`DbFailure`]), correlated by an [`OpId`], and
//!   what a store announces ([`Notification`]).
//! - [`admin`]: what operators do to tasks and queues, as data ([`AdminRequest`], answered by
//!   [`AdminReply`] or refused with [`AdminError`]).
//! - [`enqueue`]: a new task ([`NewTask`]) and the checks every store applies to it.
//! - [`records`]: what inspection reads (tasks, runs, workers, paused queues, filters).
//! - [`values`]: the JSON values and text a store can hold.
//! - [`workflow`]: a graph of new tasks to submit ([`NewWorkflow`]) and what reading a
//!   workflow gives ([`WorkflowRecord`]).
//!
//! Two stores implement it side by side, file for file: [`memory`](crate::memory) (the
//! reference, in memory) and `postgres` (feature `postgres`), each with `protocol.rs` (applies
//! [`DbRequest`]), `admin.rs` (applies [`AdminRequest`]), `enqueue.rs`, `records.rs` and
//! `schedules.rs`; the conformance suite (`tests/pg_conformance.rs`) sends both the same values
//! and compares what they answer.
//!
//! The rules every store keeps:
//!
//! - **The database clock is the only wall clock.** Requests carry durations (`lease_ms`,
//!   `delay_ms`); the store adds them to its own `now`. Workers never send instants.
//! - **Fencing.** A write about a task a worker holds names the task and its
//!   [`Lease`](crate::task::Lease) (the claim generation) and expects a state; when the row no
//!   longer matches it changes nothing and the task is reported `lost`. A write that was
//!   already applied (a re-send after an [`DbFailure::Unknown`]) is reported lost too, never
//!   applied twice.
//! - **Eligibility** to be claimed: Pending, or Claimed with an expired lease; `run_at` reached;
//!   good-until not reached. **Order**: queue priority, task priority, `run_at`, id.
//! - **Attempts and retries.** `attempts` counts starts and never decreases. `retries` counts
//!   retries spent; [`Release`](DbRequest::Release) does not spend one.

pub mod admin;
pub mod enqueue;
pub mod protocol;
pub mod records;
pub mod values;
pub mod workflow;

pub use admin::*;
pub use enqueue::*;
pub use protocol::*;
pub use records::*;
pub use values::*;
pub use workflow::*;
