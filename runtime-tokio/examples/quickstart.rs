//! Quickstart: define two tasks, enqueue them, run a worker, wait for the results.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run -p canter-tokio --example quickstart
//! ```

use std::sync::Arc;
use std::time::Duration;

use canter_tokio::{AppConfig, Client, PgSchema, Registry, TaskContext, TaskError, TokioRuntime, Worker, WorkerConfig};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Greet {
    name: String,
}

#[derive(Serialize, Deserialize)]
struct Resize {
    width: u32,
    height: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. Register the tasks. The handles carry the argument and result types.
    let mut registry = Registry::new();
    let greet = registry.register("greet", |args: Greet, ctx: TaskContext| async move {
        Ok::<_, TaskError>(format!("hello, {} (task {}, attempt {})", args.name, ctx.id, ctx.attempt))
    })?;
    // Blocking work runs on tokio's blocking pool.
    let resize = registry.register_blocking("resize", |args: Resize, _ctx| -> Result<u64, TaskError> {
        Ok(u64::from(args.width) * u64::from(args.height))
    })?;
    let registry = Arc::new(registry);

    // 2. Connect. The pool connects lazily; the worker waits out a database that is down.
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = canter_tokio::connect(&url, 10)?;
    let schema = PgSchema::new("canter_quickstart")?;
    let app = AppConfig::default();

    // 3. Run a worker (it migrates the schema at startup) until we say stop.
    let worker = Worker::new(pool.clone(), app.clone(), WorkerConfig::default(), registry)?.schema(schema.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));

    // 4. Enqueue (checked at compile time against the handlers' types) and wait.
    let client = Client::new(Arc::new(TokioRuntime), pool, schema, app);
    client.store().migrate().await?;
    let hello = client.enqueue(&greet, &Greet { name: "Ada".into() }).await?;
    let area = client.enqueue_with(&resize, &Resize { width: 640, height: 480 }, |t| t.priority(-1)).await?;
    println!("{}", hello.wait(Duration::from_secs(10)).await?);
    println!("area: {}", area.wait(Duration::from_secs(10)).await?);

    // 5. Stop gracefully.
    let _ = stop.send(());
    let stats = running.await??;
    println!("worker completed {} tasks", stats.completed);
    Ok(())
}
