use std::sync::Arc;
use std::time::Duration;

use canter_tokio::isolation::{IsolatedTasks, Isolation, IsolationOptions, ProcessPool};
use canter_tokio::{AppConfig, Client, PgSchema, Registry, ResultError, TaskError, TokioRuntime, Worker, WorkerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = Registry::new();
    // Native code that may crash its process: here it aborts when asked to.
    let parse = registry.register_blocking("parse", |input: String, _ctx| -> Result<usize, TaskError> {
        if input == "poison" {
            std::process::abort();
        }
        Ok(input.len())
    })?;
    let registry = Arc::new(registry);
    // First thing: a child of the worker's pool (this same program, started again) serves
    // here and exits; the worker goes on below.
    canter_tokio::isolation::serve_child_if_asked(&registry);

    tokio::runtime::Runtime::new()?.block_on(async {
        let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
        let pool = canter_tokio::connect(&url, 10)?;
        // This example's tables, left behind when it ends: DROP SCHEMA canter_isolation CASCADE.
        let schema = PgSchema::new("canter_isolation")?;
        let app = AppConfig::default();

        // Blocking tasks run in 2 child processes of at most 1 GiB each.
        let options = IsolationOptions { processes: 2, memory_limit_bytes: Some(1 << 30), ..Default::default() };
        let isolation = Isolation { pool: ProcessPool::new(options)?, tasks: IsolatedTasks::Blocking };
        let worker = Worker::new(pool.clone(), app.clone(), WorkerConfig::default(), registry)?
            .schema(schema.clone())
            .isolate(isolation);
        tokio::spawn(worker.run());

        let client = Client::new(Arc::new(TokioRuntime), pool, schema, app);
        let poison = client.enqueue(&parse, &"poison".to_owned()).await?;
        let fine = client.enqueue(&parse, &"hello".to_owned()).await?;
        match poison.wait(Duration::from_secs(30)).await {
            Err(ResultError::Failed(error)) => println!("poison: {} ({})", error.code.as_str(), error.message),
            other => return Err(format!("the poison task should have crashed its child: {other:?}").into()),
        }
        println!("hello: {} bytes; the worker lives on", fine.wait(Duration::from_secs(30)).await?);
        Ok(())
    })
}
