//! Isolated tasks in child processes on smol: the shared scenarios (`tests/isolation/body.rs`).
//! No libtest harness: this program is also the children its pools start, so `main` serves as
//! a child first when it is one.

#[path = "../../tests/isolation/body.rs"]
mod body;

use std::sync::Arc;

use canter_smol::SmolRuntime;
use canter_smol::isolation::serve_child_if_asked;

fn main() {
    if body::tried_a_pool_in_a_child() || body::served_as_garbage_child() {
        return;
    }
    serve_child_if_asked(&Arc::new(body::registry()));
    smol::block_on(body::every_scenario(&SmolRuntime));
}
