//! Running the `canter` program in tests: no `DATABASE_URL` of the caller's, warnings only,
//! two connection attempts, no input.

#![allow(dead_code)]

use std::ffi::OsStr;
use std::process::{Command, Output, Stdio};

/// Runs `canter` with `args` to its end.
pub fn canter<S: AsRef<OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env("CANTER_LOG", "warn")
        .env("CANTER_CONNECT_ATTEMPTS", "2")
        .stdin(Stdio::null())
        .output()
        .expect("run canter")
}
