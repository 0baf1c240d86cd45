use std::sync::Arc;
use std::time::Duration;

use canter_tokio::{
    AppConfig, Client, ErrorCode, PgSchema, Registry, TaskContext, TaskError, TokioRuntime, Worker, WorkerConfig,
    Workflow,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into());
    let pool = canter_tokio::connect(&url, 10)?;
    // This example's tables, left behind when it ends: DROP SCHEMA canter_workflow CASCADE.
    let schema = PgSchema::new("canter_workflow")?;
    let app = AppConfig::default();
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), schema.clone(), app.clone());

    let mut registry = Registry::new();
    let start = registry.register("start", |_: (), _: TaskContext| async { Ok::<_, TaskError>(()) })?;
    let fetch = registry.register("fetch", |page: u32, _: TaskContext| async move {
        match page {
            3 => Err(TaskError::new(ErrorCode::TaskError, "page 3 is gone")),
            page => Ok(page * 10),
        }
    })?;
    // Runs however the pages ended, and reads how: their results, typed, or their errors.
    let reader = client.clone();
    let total = registry.register("total", move |_: (), ctx: TaskContext| {
        let client = reader.clone();
        async move {
            let pages = client
                .parent_results::<u32>(ctx.id)
                .await
                .map_err(|e| TaskError::new(ErrorCode::TaskError, e.to_string()))?;
            let fetched: u32 = pages.iter().filter_map(|page| page.outcome.clone()?.ok()).sum();
            let missing = pages.iter().filter(|page| matches!(page.outcome, Some(Err(_)))).count();
            Ok::<_, TaskError>(format!("{fetched} from {} pages, {missing} missing", pages.len()))
        }
    })?;

    let mut workflow = Workflow::new("crawl");
    let begin = workflow.step(&start, &())?;
    let sum = workflow.step(&total, &())?;
    for page in 1..=3 {
        let fetched = workflow.step(&fetch, &page)?;
        workflow.after(&fetched, &begin); // fan-out: the pages run once `start` completed
        workflow.after_finish(&sum, &fetched); // fan-in: `total` runs once every page ended
    }

    let worker = Worker::new(pool, app, WorkerConfig::default(), Arc::new(registry))?.schema(schema);
    tokio::spawn(worker.run());
    let submitted = client.submit(workflow).await?;
    let ended = submitted.wait(Duration::from_secs(30)).await?;
    let summary = submitted.step(&sum).expect("a step of this workflow").wait(Duration::from_secs(1)).await?;
    println!("workflow {}: {summary}", ended.status);
    Ok(())
}
