//! The smol adapter for Canter (also runs under async-std's executor).
//!
//! Not built yet (issue 5): this crate will implement the core's `Runtime` trait on smol and
//! expose `Worker` and `Client`. Until then it re-exports the core so the workspace layout of
//! DESIGN.md section 1 holds.

pub use canter;
