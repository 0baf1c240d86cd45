//! The README's programs, as a new user pastes them, against an empty database: each snippet
//! is read from README.md and must be its file of `examples/` byte for byte (so the two cannot
//! drift), and that program is what runs here: the quickstart, the workflow, then the
//! wake-ups through RabbitMQ.

#[path = "../../tests/common/pg.rs"]
mod pg;

// The programs themselves: their `main`s are called by the test below (the harness has its
// own entry).
mod quickstart {
    include!("../examples/quickstart.rs");
    pub(super) fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}
mod workflow {
    include!("../examples/workflow.rs");
    pub(super) fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}
mod wakeups {
    include!("../examples/wakeups.rs");
    pub(super) fn run() -> Result<(), Box<dyn std::error::Error>> {
        main()
    }
}

/// The first `rust` block after `heading` in `text`.
fn rust_block_after<'a>(text: &'a str, heading: &str) -> &'a str {
    let after = &text[text.find(heading).expect("the heading")..];
    let start = after.find("```rust\n").expect("a rust block") + "```rust\n".len();
    let len = after[start..].find("```\n").expect("the block's end");
    &after[start..start + len]
}

#[test]
fn the_readme_programs_run_on_an_empty_database() {
    let readme = include_str!("../../README.md");
    let pasted = rust_block_after(readme, "## Quickstart (tokio)");
    assert_eq!(pasted, include_str!("../examples/quickstart.rs"), "README.md's quickstart is examples/quickstart.rs");
    let pasted = rust_block_after(readme, "## Workflows");
    assert_eq!(pasted, include_str!("../examples/workflow.rs"), "README.md's workflow is examples/workflow.rs");
    let pasted = rust_block_after(readme, "### Wake-ups through RabbitMQ or NATS");
    assert_eq!(pasted, include_str!("../examples/wakeups.rs"), "README.md's wake-ups are examples/wakeups.rs");

    // A database of its own, with nothing in it.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let database = runtime.block_on(pg::FreshDatabase::create(&format!("canter_quickstart_{}", std::process::id())));
    // SAFETY: this test binary's only test sets it before starting anything that reads it.
    unsafe { std::env::set_var("DATABASE_URL", &database.url) };
    let quickstart = quickstart::run();
    let workflow = workflow::run();
    let wakeups = wakeups::run();
    runtime.block_on(database.drop_now());
    quickstart.expect("the quickstart runs on an empty database");
    workflow.expect("the workflow example runs on an empty database");
    wakeups.expect("the wake-ups example runs on an empty database");
}
