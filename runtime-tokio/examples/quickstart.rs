use std::sync::Arc;
use std::time::Duration;

use canter_tokio::{AppConfig, Client, PgSchema, Registry, TaskContext, TaskError, TokioRuntime, Worker, WorkerConfig};

#[derive(serde::Serialize, serde::Deserialize)]
struct Greet {
    name: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Register tasks: the handles carry the argument and result types.
    let mut registry = Registry::new();
    let greet = registry.register("greet", |args: Greet, ctx: TaskContext| async move {
        Ok::<_, TaskError>(format!("hello, {} (attempt {})", args.name, ctx.attempt))
    })?;
    // Blocking work runs on tokio's blocking pool.
    let area =
        registry.register_blocking("area", |(w, h): (u64, u64), _ctx| -> Result<u64, TaskError> { Ok(w * h) })?;

    // The pool connects lazily and waits out a database that is down.
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
    let pool = canter_tokio::connect(&url, 10)?;
    // This example's tables, left behind when it ends: DROP SCHEMA canter_quickstart CASCADE.
    let schema = PgSchema::new("canter_quickstart")?;
    let app = AppConfig::default();

    // A client: its first write creates (or upgrades) the schema; enqueues are typed.
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), schema.clone(), app.clone());
    let hello = client.enqueue(&greet, &Greet { name: "Ada".into() }).await?;
    let big = client.enqueue_with(&area, &(640, 480), |t| t.priority(-1)).await?;

    // A worker, started second: order does not matter. `run()` stops gracefully on SIGINT or
    // SIGTERM; here the process ends when main returns.
    let worker = Worker::new(pool, app, WorkerConfig::default(), Arc::new(registry))?.schema(schema);
    tokio::spawn(worker.run());

    println!("{} / {}", hello.wait(Duration::from_secs(10)).await?, big.wait(Duration::from_secs(10)).await?);
    Ok(())
}
