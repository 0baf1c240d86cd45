//! Isolated tasks in child processes on tokio: the shared scenarios (`tests/isolation/body.rs`).
//! No libtest harness: this program is also the children its pools start, so `main` serves as
//! a child first when it is one.

#[path = "../../tests/isolation/body.rs"]
mod body;

use std::sync::Arc;

use canter_tokio::TokioRuntime;
use canter_tokio::isolation::serve_child_if_asked;

fn main() {
    if body::served_as_garbage_child() {
        return;
    }
    serve_child_if_asked(&Arc::new(body::registry()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(body::every_scenario(&TokioRuntime));
}
