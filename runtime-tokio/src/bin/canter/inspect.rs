//! Reading the queue: `status`, `list`, `show` and `result`.

use std::collections::BTreeMap;
use std::time::Duration;

use canter_tokio::canter::driver::ResultError;
use canter_tokio::canter::store::{AttemptRecord, TaskFilter, TaskRecord};
use canter_tokio::{Client, TaskId, TaskState, TokioRuntime};
use serde_json::{Value, json};

use crate::args::{ListArgs, Millis, Output, SchemaArg};
use crate::connect::Database;
use crate::output::{Progress, Table, printable, time, time_or_dash};
use crate::{Outcome, errln, failed, outln};

/// A client of the database and schema the command line names.
pub(crate) async fn client(database: &Database, schema: &SchemaArg) -> Result<Client, crate::Failure> {
    let pool = database.pool(4).await?;
    database.with_session(
        Client::new(std::sync::Arc::new(TokioRuntime), pool, database.schema(schema), Default::default())
            .migrate(false),
    )
}

pub(crate) async fn status(database: &Database, schema: &SchemaArg, output: Output) -> Outcome {
    let client = client(database, schema).await?;
    let counts = database.retrying("read counts", || client.counts()).await?;
    let workers = database.retrying("read workers", || client.workers()).await?;
    let paused = database.retrying("read paused queues", || client.paused_queues()).await?;
    if output.json {
        let counts: Vec<Value> =
            counts.iter().map(|((queue, state), n)| json!({"queue": queue, "state": state, "count": n})).collect();
        let workers: Vec<Value> = workers
            .iter()
            .map(|w| {
                json!({
                    "id": w.info.worker,
                    "queues": w.info.queues,
                    "concurrency": w.info.concurrency,
                    "last_seen": time(w.last_seen),
                    "last_seen_ms": w.last_seen.0,
                    "stopped": w.stopped,
                })
            })
            .collect();
        outln!("{}", json!({"counts": counts, "workers": workers, "paused": paused}));
        return Ok(());
    }
    let mut by_queue: BTreeMap<&str, BTreeMap<TaskState, u64>> = BTreeMap::new();
    for ((queue, state), n) in &counts {
        by_queue.entry(queue).or_default().insert(*state, *n);
    }
    if by_queue.is_empty() {
        outln!("(no tasks)");
    } else {
        // The workflow steps' own states only when some task is in them.
        let shown: Vec<TaskState> = TaskState::ALL
            .into_iter()
            .filter(|state| {
                !matches!(state, TaskState::Waiting | TaskState::Skipped)
                    || by_queue.values().any(|states| states.contains_key(state))
            })
            .collect();
        let header: Vec<String> =
            std::iter::once("QUEUE".to_owned()).chain(shown.iter().map(|state| format!(">{state}"))).collect();
        let mut table = Table::new(&header);
        for (queue, states) in &by_queue {
            let mut row = vec![queue.to_string()];
            row.extend(shown.iter().map(|s| states.get(s).copied().unwrap_or(0).to_string()));
            table.row(row);
        }
        table.print();
    }
    if !paused.is_empty() {
        let names: Vec<String> = paused.iter().map(|p| printable(&p.queue).to_string()).collect();
        outln!("\npaused queues: {}", names.join(", "));
    }
    let live: Vec<_> = workers.iter().filter(|w| !w.stopped).collect();
    outln!("\n{} live workers", live.len());
    if !live.is_empty() {
        let mut table = Table::new(&["WORKER", "QUEUES", ">CONCURRENCY", "LAST SEEN"]);
        for w in live {
            let queues = if w.info.queues.is_empty() { "(all)".to_owned() } else { w.info.queues.join(",") };
            table.row(vec![w.info.worker.0.clone(), queues, w.info.concurrency.to_string(), time(w.last_seen)]);
        }
        table.print();
    }
    Ok(())
}

pub(crate) async fn list(database: &Database, args: ListArgs) -> Outcome {
    let filter = TaskFilter {
        queue: args.queue.clone(),
        state: args.status,
        name: args.task.clone(),
        after: args.after.map(|id| id.0),
        newest_first: true,
        offset: args.offset,
        limit: Some(args.limit as usize),
        ..TaskFilter::default()
    };
    let client = client(database, &args.schema).await?;
    let records = database.retrying("list tasks", || client.list(&filter)).await?;
    if args.output.json {
        outln!("{}", Value::Array(records.iter().map(record_json).collect()));
        return Ok(());
    }
    if records.is_empty() {
        outln!("(no tasks)");
        return Ok(());
    }
    let mut table =
        Table::new(&[">ID", "STATE", "QUEUE", "TASK", ">PRIORITY", ">ATTEMPTS", "ENQUEUED", "RUN AT", "FINISHED"]);
    for record in &records {
        table.row(vec![
            record.id.to_string(),
            record.state.to_string(),
            record.queue.clone(),
            record.name.clone(),
            record.priority.to_string(),
            record.attempts.to_string(),
            time(record.enqueued_at),
            time(record.run_at),
            time_or_dash(record.finished_at),
        ]);
    }
    table.print();
    if records.len() == args.limit as usize
        && let Some(last) = records.last()
    {
        // On stderr: stdout holds the table alone, for whatever reads it.
        errln!("(more with --after {})", last.id);
    }
    Ok(())
}

pub(crate) async fn show(database: &Database, id: TaskId, schema: &SchemaArg, output: Output) -> Outcome {
    let client = client(database, schema).await?;
    let record =
        database.retrying("read the task", || client.get(id)).await?.ok_or_else(|| failed(format!("no task {id}")))?;
    let attempts = database.retrying("read attempts", || client.attempts(id)).await?;
    if output.json {
        let runs: Vec<Value> = attempts.iter().map(attempt_json).collect();
        outln!("{}", json!({"task": record_json(&record), "attempts": runs}));
        return Ok(());
    }
    let text = |v: Option<&str>| v.map_or_else(|| "-".to_owned(), |v| printable(v).to_string());
    let fields: [(&str, String); 14] = [
        ("name", printable(&record.name).to_string()),
        ("queue", printable(&record.queue).to_string()),
        ("state", record.state.to_string()),
        ("priority", record.priority.to_string()),
        ("attempts", format!("{} (retries spent {})", record.attempts, record.retries)),
        ("args", record.args_error.as_ref().map_or_else(|| record.args.to_string(), |e| format!("(unreadable: {e})"))),
        ("enqueued", time(record.enqueued_at)),
        ("run at", time(record.run_at)),
        ("good until", time_or_dash(record.good_until)),
        ("finished", time_or_dash(record.finished_at)),
        ("worker", text(record.worker.as_ref().map(|w| w.0.as_str()))),
        ("key", text(record.key.as_deref())),
        ("result", record.result.as_ref().map_or_else(|| "-".to_owned(), Value::to_string)),
        ("error", record.error.as_ref().map_or_else(|| "-".to_owned(), |e| printable(&e.to_string()).to_string())),
    ];
    outln!("task {}", record.id);
    for (name, value) in fields {
        outln!("  {name:<11} {value}");
    }
    if !record.flags.is_empty() {
        outln!("  {:<11} {}", "flags", printable(&record.flags.join(",")));
    }
    if attempts.is_empty() {
        outln!("no runs yet");
    } else {
        outln!("runs");
        for attempt in &attempts {
            let worker = attempt.worker.as_ref().map_or_else(|| "-".to_owned(), |w| printable(&w.0).to_string());
            outln!("  {}  by {worker}  ended {}  {}", attempt.attempt, time(attempt.finished_at), outcome(attempt));
        }
    }
    Ok(())
}

/// What a run ended as, in words: completed, failed (for good or to be retried).
fn outcome(attempt: &AttemptRecord) -> String {
    let error = attempt.error.as_ref().map_or_else(String::new, |e| format!(" with {}", printable(&e.to_string())));
    match attempt.outcome {
        TaskState::Completed => "completed".to_owned(),
        TaskState::Pending => format!("failed{error}; retried"),
        TaskState::Failed => format!("failed{error}"),
        other => format!("{}{error}", other.as_str().to_lowercase()),
    }
}

fn attempt_json(attempt: &AttemptRecord) -> Value {
    json!({
        "attempt": attempt.attempt,
        "worker": attempt.worker,
        "outcome": match attempt.outcome {
            TaskState::Completed => "completed",
            TaskState::Pending => "retried",
            _ => "failed",
        },
        "error": attempt.error,
        "finished_at": time(attempt.finished_at),
        "finished_at_ms": attempt.finished_at.0,
    })
}

/// A task as JSON: its times in RFC 3339 as people read them, each also as `<name>_ms`
/// (milliseconds since the Unix epoch) for programs.
fn record_json(record: &TaskRecord) -> Value {
    let times = [
        ("enqueued_at", Some(record.enqueued_at)),
        ("run_at", Some(record.run_at)),
        ("good_until", record.good_until),
        ("finished_at", record.finished_at),
    ];
    let mut value = serde_json::to_value(record).unwrap_or(Value::Null);
    if let Value::Object(fields) = &mut value {
        for (name, at) in times {
            fields.insert(name.to_owned(), at.map_or(Value::Null, |at| Value::from(time(at))));
            fields.insert(format!("{name}_ms"), at.map_or(Value::Null, |at| Value::from(at.0)));
        }
    }
    value
}

pub(crate) async fn result(
    database: &Database,
    id: TaskId,
    wait: Option<Millis>,
    schema: &SchemaArg,
    output: Output,
) -> Outcome {
    let client = client(database, schema).await?;
    let record: TaskRecord = match wait {
        Some(ms) => {
            let spinner = Progress::new(&format!("waiting for task {id}"), 0, true);
            let waited = client.wait(id, Duration::from_millis(ms)).await;
            drop(spinner);
            match waited {
                Ok(record) => record,
                Err(timeout @ ResultError::Timeout(_)) => {
                    // Say where the task stands, in the form asked for.
                    let state = database.retrying("read the task", || client.get(id)).await?.map(|r| r.state);
                    if output.json {
                        outln!(
                            "{}",
                            json!({"id": id, "state": state, "result": null, "error": null, "timed_out": true})
                        );
                    }
                    let state = state.map_or_else(|| "gone".to_owned(), |s| s.to_string());
                    return Err(failed(format!("task {id} is {state}: {timeout}")));
                }
                Err(error) => return Err(failed(format!("{error} ({})", error.code()))),
            }
        }
        None => database
            .retrying("read the task", || client.get(id))
            .await?
            .ok_or_else(|| failed(format!("no task {id}")))?,
    };
    if output.json {
        outln!("{}", json!({"id": id, "state": record.state, "result": record.result, "error": record.error}));
    } else if record.state == TaskState::Completed {
        outln!("{}", record.result.clone().unwrap_or(Value::Null));
    }
    match record.state {
        TaskState::Completed => Ok(()),
        state if state.is_terminal() => {
            let error = record.error.map(|e| e.to_string()).unwrap_or_default();
            Err(failed(format!("task {id} is {state}: {error}")))
        }
        state => Err(failed(format!("task {id} is {state}: no result yet (use --wait)"))),
    }
}
