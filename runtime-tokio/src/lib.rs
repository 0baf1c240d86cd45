//! The tokio adapter for Canter.
//!
//! Not built yet (issue 4): this crate will implement the core's `Runtime` trait on tokio and
//! expose `Worker` and `Client`. Until then it re-exports the core so the workspace layout of
//! DESIGN.md section 1 holds.

pub use canter;
