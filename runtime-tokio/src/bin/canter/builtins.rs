//! Built-in tasks, for trying things out and for tests: `noop`, `sleep {"ms": N}`,
//! `fail {"code": "X"}`, `panic`, `echo {...}` (returns its arguments) and
//! `cpu {"iterations": N}` (blocking).

use std::time::Duration;

use canter_tokio::canter::driver::{Registry, RegistryError, TaskContext};
use canter_tokio::canter::task::{ErrorCode, TaskError};
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
pub(crate) const NAMES: [&str; 9] = ["noop", "sleep", "fail", "panic", "echo", "cpu", "block", "crash", "hog"];

/// What the `panic` task panics with: the demo's panic hook knows it from any other panic.
pub(crate) const PANIC_MESSAGE: &str = "the panic task panics on request";

/// Whether `args` are arguments the built-in task `name` can run with (the types its handler
/// decodes), so the command line refuses at enqueue what would fail at run time; `None` for a
/// name that is not a built-in.
pub(crate) fn check_args(name: &str, args: &Value) -> Option<Result<(), String>> {
    fn decode<T: serde::de::DeserializeOwned>(args: &Value) -> Result<T, String> {
        T::deserialize(args).map_err(|e| e.to_string())
    }
    Some(match name {
        "noop" | "panic" | "echo" | "crash" | "hog" => Ok(()),
        "sleep" | "block" => decode::<Sleep>(args).map(drop),
        "cpu" => decode::<Cpu>(args).map(drop),
        "fail" => {
            decode::<Fail>(args).and_then(|fail| ErrorCode::user(&fail.code).map(drop).map_err(|e| e.to_string()))
        }
        _ => return None,
    })
}

/// Leaves the process's panic hook printing every panic but the `panic` task's deliberate
/// ones: the worker logs each task failure in one line, and a panic message (or a backtrace)
/// for a panic that was asked for would only alarm.
pub(crate) fn quiet_deliberate_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&PANIC_MESSAGE) {
            default(info);
        }
    }));
}

/// Registers the built-in tasks in `registry`.
pub(crate) fn register(registry: &mut Registry) -> Result<(), RegistryError> {
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
            std::panic::panic_any(PANIC_MESSAGE);
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
    // Sleeps on a thread of the blocking pool (or in a child, with --processes).
    registry.register_blocking("block", |args: Sleep, _| -> Result<Value, TaskError> {
        std::thread::sleep(Duration::from_millis(args.ms));
        Ok(json!({ "slept_ms": args.ms }))
    })?;
    // For trying isolation (`canter worker --processes N`): in a child they end the child; in
    // a worker's own process they refuse, rather than take the worker down.
    registry.register_blocking("crash", |_: Value, _| -> Result<Value, TaskError> {
        in_a_child("crash")?;
        std::process::abort()
    })?;
    registry.register_blocking("hog", |_: Value, _| -> Result<Value, TaskError> {
        in_a_child("hog")?;
        let mut held: Vec<Vec<u8>> = Vec::new();
        loop {
            // Touched, so that the memory is really taken.
            held.push(vec![1u8; 16 << 20]);
        }
    })?;
    Ok(())
}

/// Refuses to run `name` outside a child process of an isolated pool.
fn in_a_child(name: &str) -> Result<(), TaskError> {
    if canter_tokio::isolation::child_socket().is_some() {
        return Ok(());
    }
    Err(TaskError::new(
        ErrorCode::TaskError,
        format!("the {name} task ends its process: it runs only in a worker with --processes"),
    ))
}

/// A registry with only the built-in tasks.
pub(crate) fn registry() -> Registry {
    let mut registry = Registry::new();
    register(&mut registry).expect("the built-in names are distinct and valid");
    registry
}
