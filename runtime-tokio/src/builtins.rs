//! Built-in tasks, for trying things out and for tests: `noop`, `sleep {"ms": N}`,
//! `fail {"code": "X"}`, `panic`, `echo {...}` (returns its arguments) and
//! `cpu {"iterations": N}` (blocking).

use std::time::Duration;

use canter::driver::{Registry, TaskContext};
use canter::task::{ErrorCode, TaskError};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Sleep {
    ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fail {
    #[serde(default = "default_code")]
    code: String,
    #[serde(default)]
    message: Option<String>,
}

fn default_code() -> String {
    "TASK_ERROR".to_owned()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cpu {
    iterations: u64,
}

/// The names of the built-in tasks.
pub const NAMES: [&str; 6] = ["noop", "sleep", "fail", "panic", "echo", "cpu"];

/// Registers the built-in tasks in `registry`.
pub fn register(registry: &mut Registry) -> Result<(), canter::driver::RegistryError> {
    registry.register("noop", |_: Value, _: TaskContext| async { Ok::<_, TaskError>(Value::Null) })?;
    registry.register("sleep", |args: Sleep, _| async move {
        tokio::time::sleep(Duration::from_millis(args.ms)).await;
        Ok::<_, TaskError>(json!({ "slept_ms": args.ms }))
    })?;
    registry.register("fail", |args: Fail, _| async move {
        let code = ErrorCode::user(&args.code).map_err(|e| TaskError::new(ErrorCode::TaskError, e.to_string()))?;
        Err::<Value, _>(TaskError::new(code, args.message.unwrap_or_else(|| "failed on request".to_owned())))
    })?;
    registry.register("panic", |_: Value, _| async move {
        if true {
            panic!("the panic task panics on request");
        }
        Ok::<Value, TaskError>(Value::Null)
    })?;
    registry.register("echo", |args: Value, _| async move { Ok::<_, TaskError>(args) })?;
    registry.register_blocking("cpu", |args: Cpu, _| -> Result<Value, TaskError> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in 0..args.iterations {
            x = (x ^ i).wrapping_mul(0xBF58_476D_1CE4_E5B9).rotate_left(17);
        }
        Ok(json!({ "iterations": args.iterations, "hash": format!("{x:016x}") }))
    })?;
    Ok(())
}

/// A registry with only the built-in tasks.
pub fn registry() -> Registry {
    let mut registry = Registry::new();
    register(&mut registry).expect("the built-in names are distinct and valid");
    registry
}
