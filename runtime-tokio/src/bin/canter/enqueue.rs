//! `canter enqueue`.

use canter_tokio::canter::config::{AppConfig, CustomQueue, QueueMode, RetryPolicy};
use canter_tokio::canter::postgres::{PgStore, enqueue_many_in};
use canter_tokio::canter::store::{DbTime, KeyMode, NewTask, RunAt, check_new_task};
use canter_tokio::canter::wake::Wakeup;
use canter_tokio::{Client, TaskId, TokioRuntime};
use serde_json::Value;

use crate::args::EnqueueArgs;
use crate::connect::Database;
use crate::output::Progress;
use crate::{Failure, Outcome, builtins, failed, outln, usage};

/// Tasks per statement of a `--count` enqueue.
const CHUNK: usize = 1_000;

pub(crate) async fn enqueue(database: &Database, args: EnqueueArgs) -> Outcome {
    let task_args = args.args.clone().unwrap_or_else(|| Value::Object(Default::default()));
    match builtins::check_args(&args.task, &task_args) {
        Some(Err(why)) => return Err(usage(format!("--args do not suit the built-in task {}: {why}", args.task))),
        None if !args.force => {
            return Err(usage(format!(
                "unknown task name {:?}: the canter worker serves {}; pass --force to enqueue it anyway",
                args.task,
                builtins::NAMES.join(", ")
            )));
        }
        _ => {}
    }
    let mut app = AppConfig::default();
    if let Some(queue) = args.queue.as_deref().filter(|q| *q != "default") {
        // The command line enqueues into any queue name a worker may be configured with.
        app.queue_mode = QueueMode::Custom;
        app.custom_queues = vec![CustomQueue::new(queue)];
    }
    let pool = database.pool(4).await?;
    let client = Client::new(std::sync::Arc::new(TokioRuntime), pool, database.schema(&args.schema), app);
    // Retried: the read-only probe of the clock. Not retried: the write, whose commit a lost
    // connection could hide (a retry would enqueue twice).
    let now = database.retrying("read the database clock", || client.store().now()).await?;
    let template = template(&args, task_args, now)?;
    // What the store would refuse is a usage error, said before anything is written.
    let queue = check_new_task(client.store().app(), &template, now).map_err(usage)?;
    let ids = enqueue_all(client.store(), &template, args.count as usize).await?;
    database.announce(&args.schema, Wakeup::of_tasks(ids.iter().map(|id| (queue, template.priority, *id)))).await?;
    if args.output.json {
        outln!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in ids {
            outln!("{id}");
        }
    }
    Ok(())
}

/// The task the arguments describe.
fn template(args: &EnqueueArgs, task_args: Value, now: DbTime) -> Result<NewTask, Failure> {
    let mut template = NewTask::new(args.task.clone(), task_args);
    if let Some(queue) = &args.queue {
        template = template.queue(queue);
    }
    if let Some(priority) = args.priority {
        template = template.priority(priority);
    }
    if let Some(delay) = args.delay {
        template = template.run_at(RunAt::DelayMs(delay));
    }
    if let Some(at) = args.run_at {
        template = template.run_at(RunAt::At(at.at(now)));
    }
    if let Some(until) = args.good_until {
        template = template.good_until(until.at(now));
    }
    if let Some(retries) = args.max_retries {
        template = template.retry(RetryPolicy::exponential(1, retries));
    }
    if let Some(key) = &args.key {
        template = template.key_with_mode(key, args.key_mode.unwrap_or(KeyMode::Replace));
    }
    for flag in args.flags.iter().filter(|f| !f.is_empty()) {
        template = template.flag(flag);
    }
    Ok(template)
}

/// Enqueues `count` copies of `template` all or nothing: one transaction of statements of
/// [`CHUNK`] tasks (the memory of a million tasks at once is not needed). A failure says what
/// was committed: nothing, or, when the commit itself got no answer, all or nothing.
async fn enqueue_all(store: &PgStore, template: &NewTask, count: usize) -> Result<Vec<TaskId>, Failure> {
    let nothing = |e: &dyn std::fmt::Display| failed(format!("enqueue failed: {e}; nothing was enqueued"));
    let progress = Progress::new("enqueueing", count as u64, count > CHUNK);
    let mut tx = store.pool().begin().await.map_err(|e| nothing(&e))?;
    let mut ids = Vec::with_capacity(count);
    while ids.len() < count {
        let batch = vec![template.clone(); (count - ids.len()).min(CHUNK)];
        // On an error the transaction is dropped, which rolls back what it wrote.
        let written = enqueue_many_in(&mut *tx, store.schema(), store.app(), batch).await.map_err(|e| nothing(&e))?;
        progress.advance(written.len() as u64);
        ids.extend(written);
    }
    progress.set_message("committing");
    tx.commit().await.map_err(|e| {
        failed(format!(
            "enqueue failed at commit: {e}; either all {count} tasks were enqueued or none (see canter list)"
        ))
    })?;
    progress.finish();
    Ok(ids)
}
