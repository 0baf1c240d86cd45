//! Canter: a PostgreSQL-backed distributed task queue with a sans-IO core.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod budget;
pub mod config;
pub mod db;
pub mod memory;
pub mod rng;
pub mod task;
pub mod worker;

#[cfg(feature = "postgres")]
pub mod postgres;

#[cfg(feature = "sim")]
pub mod sim;
