//! Isolated tasks in child processes on tokio: the shared scenarios (`tests/isolation/body.rs`),
//! then the README's isolation program (`examples/isolation.rs`) against an empty database.
//! No libtest harness: this program is also the children its pools start, so `main` serves as
//! a child first when it is one, and it runs the README's program as a process of its own
//! (whose children are this program again, serving that program's tasks).

#[path = "../../tests/isolation/body.rs"]
mod body;
#[path = "../../tests/common/pg.rs"]
mod pg;

mod example {
    include!("../examples/isolation.rs");
    pub(super) fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

use std::sync::Arc;

use canter_tokio::TokioRuntime;
use canter_tokio::isolation::serve_child_if_asked;

/// The argument that makes this program the README's.
const EXAMPLE: &str = "readme-isolation-example";

/// The README's program, run as a process of its own on a database of its own.
fn the_readme_program_runs(runtime: &tokio::runtime::Runtime) {
    let readme = include_str!("../../README.md");
    let after = &readme[readme.find("## Isolated execution").expect("the heading")..];
    let start = after.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let len = after[start..].find("```\n").expect("the block's end");
    assert_eq!(
        &after[start..start + len],
        include_str!("../examples/isolation.rs"),
        "README.md's is examples/isolation.rs"
    );

    let database = runtime.block_on(pg::FreshDatabase::create(&format!("canter_isolation_{}", std::process::id())));
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .arg(EXAMPLE)
        .env("DATABASE_URL", &database.url)
        .output()
        .unwrap();
    runtime.block_on(database.drop_now());
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{printed}{}", String::from_utf8_lossy(&output.stderr));
    assert!(printed.contains("poison: WORKER_CHILD_CRASHED") && printed.contains("hello: 5 bytes"), "{printed}");
    println!("the README's program: ok");
}

fn main() {
    if std::env::args().any(|arg| arg == EXAMPLE) {
        // The README's program (or, started by its pool, one of its children).
        if let Err(error) = example::run() {
            eprintln!("{error}");
            std::process::exit(1);
        }
        return;
    }
    if body::tried_a_pool_in_a_child() || body::served_as_garbage_child() {
        return;
    }
    serve_child_if_asked(&Arc::new(body::registry()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(body::every_scenario(&TokioRuntime));
    the_readme_program_runs(&runtime);
}
