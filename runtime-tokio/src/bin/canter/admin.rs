//! The operator commands: each builds one [`AdminRequest`] (and the app settings the action
//! reads), which [`run`] checks, sends and whose reply it prints.

use canter_tokio::canter::config::AppConfig;
use canter_tokio::canter::store::{
    AdminReply, AdminRequest, Cancelled, FAILED_BY_OPERATOR_MESSAGE, KeyRemoval, Reschedule, RunAt,
};
use canter_tokio::{Client, TokioRuntime, WorkerId};
use serde_json::json;

use crate::args::{Command, Output, QueueArgs, RescheduleArgs, SchemaArg, TaskArgs, When};
use crate::connect::Database;
use crate::output::{Progress, printable};
use crate::{Failure, Outcome, failed, outln, usage};

/// One operator action, ready to send.
struct Action {
    request: AdminRequest,
    app: AppConfig,
    schema: SchemaArg,
    output: Output,
    /// Whether to refuse acting on queues or workers that look wrong (`--force` not given).
    careful: bool,
}

impl Action {
    fn new(request: AdminRequest, schema: SchemaArg, output: Output) -> Action {
        Action { request, app: AppConfig::default(), schema, output, careful: true }
    }
}

/// Runs an operator command (the commands [`crate::run`] does not handle itself).
pub(crate) async fn run(database: &Database, command: Command) -> Outcome {
    let action = action(command)?;
    let pool = database.pool(4).await?;
    // An operator command never creates a schema: a mistyped --schema is an error.
    let client =
        Client::new(std::sync::Arc::new(TokioRuntime), pool, database.schema(&action.schema), action.app.clone())
            .migrate(false);
    if action.careful {
        check(database, &client, &action).await?;
    }
    let spinner = Progress::new("purging", 0, matches!(action.request, AdminRequest::Purge { .. }));
    let reply = client.admin(&action.request).await.map_err(|e| failed(crate::connect::explain(&e.to_string())))?;
    spinner.finish();
    print(&action.request, reply, action.output.json)
}

fn action(command: Command) -> Result<Action, Failure> {
    Ok(match command {
        Command::Cancel(TaskArgs { id, schema, output }) => {
            Action::new(AdminRequest::Cancel { task: id.0 }, schema, output)
        }
        Command::Retry(TaskArgs { id, schema, output }) => {
            Action::new(AdminRequest::Retry { task: id.0 }, schema, output)
        }
        Command::Reschedule(args) => reschedule(args),
        Command::Delete(TaskArgs { id, schema, output }) => {
            Action::new(AdminRequest::Delete { task: id.0 }, schema, output)
        }
        Command::Complete { task: TaskArgs { id, schema, output }, result } => Action::new(
            AdminRequest::Complete { task: id.0, result: result.unwrap_or(serde_json::Value::Null) },
            schema,
            output,
        ),
        Command::Fail { task: TaskArgs { id, schema, output }, message } => Action::new(
            AdminRequest::Fail {
                task: id.0,
                message: message.unwrap_or_else(|| FAILED_BY_OPERATOR_MESSAGE.to_owned()),
            },
            schema,
            output,
        ),
        Command::ForceUnlock { workers, force, config, schema, output } => Action {
            careful: !force,
            // The stale threshold a worker without a liveness token is judged by.
            app: match config {
                Some(path) => canter_tokio::canter::driver::read_config(&path).map_err(usage)?.app,
                None => AppConfig::default(),
            },
            ..Action::new(
                AdminRequest::ForceUnlock { workers: workers.into_iter().map(WorkerId).collect() },
                schema,
                output,
            )
        },
        Command::RemoveKey { key, schema, output } => Action::new(AdminRequest::RemoveKey { key }, schema, output),
        Command::Purge { older_than, idempotency_retention, batch, schema, output } => {
            let mut action = Action::new(AdminRequest::Purge { retention_ms: older_than, batch }, schema, output);
            action.app.recovery.idempotency_retention_ms = idempotency_retention;
            action
        }
        Command::Pause(QueueArgs { queue, force, schema, output }) => {
            Action { careful: !force, ..Action::new(AdminRequest::Pause { queue }, schema, output) }
        }
        Command::Resume(QueueArgs { queue, force, schema, output }) => {
            Action { careful: !force, ..Action::new(AdminRequest::Resume { queue }, schema, output) }
        }
        other => return Err(failed(format!("{other:?} is not an operator command"))),
    })
}

fn reschedule(args: RescheduleArgs) -> Action {
    let run_at = match (args.now, args.run_at) {
        (true, _) => Some(RunAt::Now),
        // A duration is from the database's now; a time is absolute.
        (false, Some(When::In(ms))) => Some(RunAt::DelayMs(ms)),
        (false, Some(When::At(t))) => Some(RunAt::At(t)),
        (false, None) => None,
    };
    let change = Reschedule { run_at, priority: args.priority, retries: args.retries };
    Action::new(AdminRequest::Reschedule { task: args.id.0, change }, args.schema, args.output)
}

/// Refuses what is most likely a mistake: pausing a queue nothing knows (a typo pauses
/// nothing), force-unlocking a worker that is still alive (its tasks would run twice).
async fn check(database: &Database, client: &Client, action: &Action) -> Outcome {
    let request = &action.request;
    match request {
        AdminRequest::Pause { queue } | AdminRequest::Resume { queue } => {
            let counts = database.retrying("read counts", || client.counts()).await?;
            let workers = database.retrying("read workers", || client.workers()).await?;
            let paused = database.retrying("read paused queues", || client.paused_queues()).await?;
            let known = queue == canter_tokio::canter::config::DEFAULT_QUEUE_NAME
                || counts.keys().any(|(q, _)| q == queue)
                || workers.iter().any(|w| !w.stopped && w.info.queues.contains(queue))
                || paused.iter().any(|p| &p.queue == queue);
            if !known {
                return Err(usage(format!(
                    "queue \"{}\" has no tasks and no live worker serves it by name; pass --force to act on it anyway",
                    printable(queue)
                )));
            }
        }
        AdminRequest::ForceUnlock { workers: ids } => {
            let store = client.store();
            let now = database.retrying("read the database clock", || store.now()).await?;
            let workers = database.retrying("read workers", || client.workers()).await?;
            let tokens = database.retrying("read liveness tokens", || store.liveness_tokens(ids)).await?;
            // A held liveness token is a live session; a free one, a dead process. Without a
            // token, a worker seen within the stale threshold may still be running its tasks.
            let stale_ms = i64::try_from(action.app.recovery.claimed_stale_threshold_ms).unwrap_or(i64::MAX);
            // An id no worker has registered under is a typo: it would release nothing.
            let unknown: Vec<String> = ids
                .iter()
                .filter(|id| !workers.iter().any(|w| &w.info.worker == *id))
                .map(|id| printable(&id.0).to_string())
                .collect();
            if !unknown.is_empty() {
                return Err(failed(format!(
                    "no worker {} is registered (canter status lists the live ones); pass --force to release \
                     tasks claimed under these ids anyway",
                    unknown.join(", ")
                )));
            }
            let alive: Vec<String> = workers
                .iter()
                .filter(|w| ids.contains(&w.info.worker) && !w.stopped)
                .filter_map(|w| {
                    let seen = now.0.saturating_sub(w.last_seen.0) / 1000;
                    match tokens.get(&w.info.worker) {
                        Some(true) => {
                            Some(format!("{} (its session holds its liveness token)", printable(&w.info.worker.0)))
                        }
                        Some(false) => None,
                        None if now.0.saturating_sub(w.last_seen.0) < stale_ms => {
                            Some(format!("{} (seen {seen}s ago)", printable(&w.info.worker.0)))
                        }
                        None => None,
                    }
                })
                .collect();
            if !alive.is_empty() {
                return Err(usage(format!(
                    "worker {} looks alive: its tasks would run twice; stop it first, or pass --force",
                    alive.join(", ")
                )));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Prints the reply to `request`, as text or JSON.
fn print(request: &AdminRequest, reply: AdminReply, as_json: bool) -> Outcome {
    let (text, value) = match (request, reply) {
        (AdminRequest::Cancel { task }, AdminReply::Cancelled { found: Cancelled::Pending }) => {
            (format!("task {task} cancelled"), json!({"task": task, "cancelled": true, "claimed_by": null}))
        }
        (AdminRequest::Cancel { task }, AdminReply::Cancelled { found: Cancelled::Claimed { worker } }) => (
            format!(
                "task {task} cancelled; worker {} had claimed it and may be running it: that run goes on to its end, \
                 and its outcome will not be recorded",
                printable(&worker.0)
            ),
            json!({"task": task, "cancelled": true, "claimed_by": worker}),
        ),
        (AdminRequest::Retry { task }, AdminReply::Done) => {
            (format!("task {task} is pending again"), json!({"task": task, "state": "PENDING"}))
        }
        (AdminRequest::Reschedule { task, .. }, AdminReply::Done) => {
            (format!("task {task} rescheduled"), json!({"task": task, "rescheduled": true}))
        }
        (AdminRequest::Delete { task }, AdminReply::Done) => {
            (format!("task {task} deleted"), json!({"task": task, "deleted": true}))
        }
        (AdminRequest::Complete { task, .. }, AdminReply::Done) => {
            (format!("task {task} completed"), json!({"task": task, "state": "COMPLETED"}))
        }
        (AdminRequest::Fail { task, .. }, AdminReply::Done) => {
            (format!("task {task} failed"), json!({"task": task, "state": "FAILED"}))
        }
        (AdminRequest::ForceUnlock { workers }, AdminReply::Released { tasks }) => {
            (format!("{tasks} tasks back to pending"), json!({"workers": workers, "tasks": tasks}))
        }
        (AdminRequest::RemoveKey { key }, AdminReply::KeyRemoved { removal }) => {
            let key_text = printable(key);
            let text = match removal {
                KeyRemoval::Cancelled(id) => format!("key \"{key_text}\" freed; its pending task {id} cancelled"),
                KeyRemoval::Detached(id) => format!("key \"{key_text}\" freed; task {id} runs on without it"),
                KeyRemoval::Freed(id) => format!("key \"{key_text}\" freed from finished task {id}"),
            };
            (text, json!({"key": key, "removal": removal}))
        }
        (AdminRequest::Purge { .. }, AdminReply::Purged { tasks }) => {
            (format!("{tasks} finished tasks purged"), json!({"purged": tasks}))
        }
        (AdminRequest::Pause { queue }, AdminReply::Paused { was_running: changed })
        | (AdminRequest::Resume { queue }, AdminReply::Resumed { was_paused: changed }) => {
            let pausing = matches!(request, AdminRequest::Pause { .. });
            let state = if pausing { "paused" } else { "running" };
            let text = format!("queue {} {}{state}", printable(queue), if changed { "" } else { "was already " });
            (text, json!({"queue": queue, "paused": pausing, "changed": changed}))
        }
        (request, reply) => return Err(failed(format!("{} replied {reply:?}", request.name()))),
    };
    if as_json {
        outln!("{value}");
    } else {
        outln!("{text}");
    }
    Ok(())
}
