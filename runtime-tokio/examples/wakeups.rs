use std::sync::Arc;
use std::time::Duration;

use canter_tokio::canter::driver::wakeups::{RabbitMqWakeups, WakeupProvider};
use canter_tokio::{AppConfig, Client, PgSchema, Registry, TaskError, TokioRuntime, Worker, WorkerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = Registry::new();
    let double = registry.register("double", |n: u64, _ctx| async move { Ok::<_, TaskError>(n * 2) })?;

    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
    let pool = canter_tokio::connect(&url, 10)?;
    // This example's tables, left behind when it ends: DROP SCHEMA canter_wakeups CASCADE.
    let schema = PgSchema::new("canter_wakeups")?;
    let app = AppConfig::default();

    // One provider per process: the schema's name keeps two schemas' wake-ups apart.
    let amqp = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let wakeups: Arc<dyn WakeupProvider> = Arc::new(RabbitMqWakeups::new(&amqp, schema.name())?);

    // The worker hears of enqueues on RabbitMQ (and of the rest by LISTEN, as ever).
    let worker = Worker::new(pool.clone(), app.clone(), WorkerConfig::default(), Arc::new(registry))?
        .schema(schema.clone())
        .wakeups(wakeups.clone());
    tokio::spawn(worker.run());

    // The client's enqueues commit without a NOTIFY and are announced on RabbitMQ.
    let client = Client::new(Arc::new(TokioRuntime), pool, schema, app).wakeups(wakeups.clone());
    let four = client.enqueue(&double, &2).await?;
    println!("2 × 2 = {}", four.wait(Duration::from_secs(10)).await?);
    // What was published before this line has left when it returns.
    wakeups.flush().await;
    Ok(())
}
