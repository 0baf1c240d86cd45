//! `canter workflow`: submit a workflow of built-in tasks from JSON, show one, list the newest,
//! pause, resume, cancel and retry.

use std::collections::BTreeMap;
use std::io::Read;

use canter_tokio::canter::store::{NewWorkflow, StepRecord, WorkflowRecord};
use canter_tokio::canter::workflow::{EdgePolicy, Join, StepId};
use canter_tokio::{Client, NewTask, TaskState, TokioRuntime, WorkflowId};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::args::{SchemaArg, WorkflowArgs, WorkflowCommand};
use crate::connect::Database;
use crate::output::{Table, printable, time};
use crate::{Failure, Outcome, builtins, failed, outln, usage};

/// A workflow as `canter workflow submit` reads it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkflowFile {
    name: String,
    #[serde(default)]
    pause_on_error: bool,
    steps: Vec<StepFile>,
}

/// One step of a [`WorkflowFile`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepFile {
    name: String,
    task: String,
    #[serde(default)]
    args: Value,
    #[serde(default)]
    queue: Option<String>,
    #[serde(default)]
    priority: i16,
    /// Steps that must complete first.
    #[serde(default)]
    after: Vec<String>,
    /// Steps that must end first, however they end.
    #[serde(default)]
    after_finish: Vec<String>,
    #[serde(default)]
    join: JoinFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
enum JoinFile {
    #[default]
    All,
    Any,
    Quorum(u32),
}

pub(crate) async fn run(database: &Database, command: WorkflowCommand) -> Outcome {
    match command {
        WorkflowCommand::Submit { file, force, schema, output } => {
            let workflow = read(&file, force)?;
            let names: Vec<String> = workflow.1;
            let client =
                Client::new(std::sync::Arc::new(TokioRuntime), database.pool(4).await?, database.schema(&schema), {
                    app_for(&workflow.0)
                });
            let submitted = client.store().submit_workflow(&workflow.0).await.map_err(|e| match e {
                canter_tokio::canter::postgres::PgSubmitError::Invalid(e) => usage(e),
                other => failed(crate::connect::explain(&other.to_string())),
            })?;
            if output.json {
                let tasks: BTreeMap<&str, i64> =
                    names.iter().map(String::as_str).zip(submitted.tasks.iter().map(|t| t.0)).collect();
                outln!("{}", json!({"workflow": submitted.workflow, "tasks": tasks}));
            } else {
                outln!("workflow {} submitted: {} steps", submitted.workflow, submitted.tasks.len());
            }
            Ok(())
        }
        WorkflowCommand::Show { id, schema, output } => show(database, id.0, &schema, output.json).await,
        WorkflowCommand::List { limit, schema, output } => list(database, limit, &schema, output.json).await,
        WorkflowCommand::Pause(args) => act(database, args, Action::Pause).await,
        WorkflowCommand::Resume(args) => act(database, args, Action::Resume).await,
        WorkflowCommand::Cancel(args) => act(database, args, Action::Cancel).await,
        WorkflowCommand::Retry { workflow, downstream } => act(database, workflow, Action::Retry { downstream }).await,
    }
}

/// The app the workflow's queues need: any queue name a worker may be configured with.
fn app_for(workflow: &NewWorkflow) -> canter_tokio::AppConfig {
    let mut app = canter_tokio::AppConfig::default();
    let queues: std::collections::BTreeSet<&str> = workflow.tasks.iter().filter_map(|t| t.queue.as_deref()).collect();
    if queues.iter().any(|q| *q != canter_tokio::canter::config::DEFAULT_QUEUE_NAME) {
        app.queue_mode = canter_tokio::QueueMode::Custom;
        app.custom_queues = std::iter::once(canter_tokio::canter::config::DEFAULT_QUEUE_NAME)
            .chain(queues.iter().copied().filter(|q| *q != canter_tokio::canter::config::DEFAULT_QUEUE_NAME))
            .map(canter_tokio::CustomQueue::new)
            .collect();
    }
    app
}

/// Reads and checks the workflow's JSON: the graph by step names, built-in tasks and their
/// arguments (unless `force`). Returns it with its steps' names.
fn read(file: &str, force: bool) -> Result<(NewWorkflow, Vec<String>), Failure> {
    let text = if file == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(|e| usage(format!("cannot read standard input: {e}")))?;
        text
    } else {
        std::fs::read_to_string(file).map_err(|e| usage(format!("cannot read {file}: {e}")))?
    };
    let parsed: WorkflowFile = serde_json::from_str(&text).map_err(|e| usage(format!("{file}: {e}")))?;
    let mut index: BTreeMap<&str, StepId> = BTreeMap::new();
    for (i, step) in parsed.steps.iter().enumerate() {
        if index.insert(step.name.as_str(), StepId(i as u32)).is_some() {
            return Err(usage(format!("{file}: two steps are named {:?}", step.name)));
        }
    }
    let mut workflow = NewWorkflow::new(parsed.name.clone());
    if parsed.pause_on_error {
        workflow = workflow.pause_on_error();
    }
    for step in &parsed.steps {
        match builtins::check_args(&step.task, &step.args) {
            Some(Err(why)) => {
                return Err(usage(format!(
                    "step {}: args do not suit the built-in task {}: {why}",
                    step.name, step.task
                )));
            }
            None if !force => {
                return Err(usage(format!(
                    "step {}: unknown task name {:?}: the canter worker serves {}; pass --force to submit it anyway",
                    step.name,
                    step.task,
                    builtins::NAMES.join(", ")
                )));
            }
            _ => {}
        }
        let mut task = NewTask::new(step.task.clone(), step.args.clone()).priority(step.priority);
        if let Some(queue) = &step.queue {
            task = task.queue(queue);
        }
        let join = match step.join {
            JoinFile::All => Join::All,
            JoinFile::Any => Join::Any,
            JoinFile::Quorum(n) => Join::Quorum(n),
        };
        workflow.step(task, join);
    }
    for (i, step) in parsed.steps.iter().enumerate() {
        let edges = step.after.iter().map(|p| (p, EdgePolicy::RequireSuccess));
        for (parent, policy) in edges.chain(step.after_finish.iter().map(|p| (p, EdgePolicy::AllowFailed))) {
            let Some(parent) = index.get(parent.as_str()) else {
                return Err(usage(format!("{file}: step {} comes after {parent:?}, which is no step", step.name)));
            };
            workflow.edge(*parent, StepId(i as u32), policy);
        }
    }
    let names = parsed.steps.into_iter().map(|s| s.name).collect();
    Ok((workflow, names))
}

async fn client(database: &Database, schema: &SchemaArg) -> Result<Client, crate::Failure> {
    let pool = database.pool(4).await?;
    database.with_session(
        Client::new(std::sync::Arc::new(TokioRuntime), pool, database.schema(schema), Default::default())
            .migrate(false),
    )
}

async fn record(database: &Database, client: &Client, id: WorkflowId) -> Result<WorkflowRecord, Failure> {
    database
        .retrying("read the workflow", || client.workflow(id))
        .await?
        .ok_or_else(|| failed(format!("no workflow {id}")))
}

fn record_json(record: &WorkflowRecord) -> Value {
    json!({
        "id": record.id,
        "name": record.name,
        "status": record.status,
        "on_error": record.on_error,
        "steps": record.steps,
        "submitted_at": time(record.submitted_at),
        "submitted_at_ms": record.submitted_at.0,
    })
}

/// What a waiting step waits for, in words.
fn waits_for(step: &StepRecord) -> String {
    match step.waiting {
        Some((satisfied, _)) if step.state == TaskState::Waiting => {
            format!("{} more of its {} parents", step.required.saturating_sub(satisfied), step.parents)
        }
        _ => String::new(),
    }
}

async fn show(database: &Database, id: WorkflowId, schema: &SchemaArg, json: bool) -> Outcome {
    let client = client(database, schema).await?;
    let record = record(database, &client, id).await?;
    let steps = database.retrying("read the steps", || client.store().workflow_steps(id)).await?;
    if json {
        outln!("{}", json!({"workflow": record_json(&record), "steps": steps}));
        return Ok(());
    }
    outln!(
        "workflow {} \"{}\": {} (on a step's failure: {}), submitted {}",
        record.id,
        printable(&record.name),
        record.status,
        match record.on_error {
            canter_tokio::canter::workflow::OnError::Continue => "skip what needs it",
            canter_tokio::canter::workflow::OnError::Pause => "pause",
        },
        time(record.submitted_at)
    );
    let mut table = Table::new(&[">STEP", ">TASK", "NAME", "STATE", "WAITS FOR"]);
    for step in &steps {
        table.row(vec![
            step.step.to_string(),
            step.task.to_string(),
            step.name.clone(),
            step.state.to_string(),
            waits_for(step),
        ]);
    }
    table.print();
    Ok(())
}

async fn list(database: &Database, limit: u32, schema: &SchemaArg, json: bool) -> Outcome {
    let client = client(database, schema).await?;
    let ids = database.retrying("list workflows", || client.store().workflow_ids(limit)).await?;
    let mut records = Vec::with_capacity(ids.len());
    for id in ids {
        if let Some(record) = database.retrying("read the workflow", || client.workflow(id)).await? {
            records.push(record);
        }
    }
    if json {
        outln!("{}", Value::Array(records.iter().map(record_json).collect()));
        return Ok(());
    }
    if records.is_empty() {
        outln!("(no workflows)");
        return Ok(());
    }
    let mut table = Table::new(&[">ID", "NAME", "STATUS", ">STEPS", "SUBMITTED"]);
    for record in &records {
        let steps: u32 = record.steps.values().sum();
        table.row(vec![
            record.id.to_string(),
            record.name.clone(),
            record.status.to_string(),
            steps.to_string(),
            time(record.submitted_at),
        ]);
    }
    table.print();
    Ok(())
}

/// An action on a whole workflow.
#[derive(Debug, Clone, Copy)]
enum Action {
    Pause,
    Resume,
    Cancel,
    Retry { downstream: bool },
}

async fn act(database: &Database, args: WorkflowArgs, action: Action) -> Outcome {
    let client = client(database, &args.schema).await?;
    let id = args.id.0;
    let (status, done) = match action {
        Action::Pause => (client.pause_workflow(id).await, "paused"),
        Action::Resume => (client.resume_workflow(id).await, "resumed"),
        Action::Cancel => (client.cancel_workflow(id).await, "cancelled"),
        Action::Retry { downstream } => (client.retry_workflow(id, downstream).await, "retried"),
    };
    let status = status.map_err(|e| failed(crate::connect::explain(&e.to_string())))?;
    if args.output.json {
        outln!("{}", json!({"workflow": id, "status": status}));
    } else {
        outln!("workflow {id} {done}: now {status}");
    }
    Ok(())
}
