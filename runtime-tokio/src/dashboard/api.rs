//! The dashboard's JSON API, its event stream and its `/metrics`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use canter::postgres::{PgAdminError, PgWorkflowError, error_text};
use canter::store::{AdminError, AdminRequest, DbTime, TaskFilter, WorkflowActionError, WorkflowId};
use canter::task::{TaskId, TaskState};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Shared, user_of};

/// The most tasks a listing returns.
const MAX_PAGE: usize = 500;

/// The most steps (and edges) a workflow's page draws.
const MAX_STEPS: usize = 500;

/// How many refusals a bulk action lists (it counts them all).
const REFUSALS_LISTED: usize = 100;

/// A failed request: its status and `{"error": message}`.
pub(crate) struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

fn unavailable(error: &sqlx::Error) -> Failure {
    Failure(StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {}", error_text(error)))
}

fn refused(error: PgAdminError) -> Failure {
    match error {
        PgAdminError::Refused(AdminError::NotFound(id)) => {
            Failure(StatusCode::NOT_FOUND, format!("task {id} not found"))
        }
        PgAdminError::Refused(refusal) => Failure(StatusCode::CONFLICT, refusal.to_string()),
        other => Failure(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    }
}

type Reply = Result<Response, Failure>;

fn json_reply(value: Value) -> Reply {
    Ok(Json(value).into_response())
}

pub(crate) async fn overview(State(shared): State<Arc<Shared>>) -> Response {
    shared.demand.ask();
    let mut published = shared.published.clone();
    // The first request after a quiet spell waits (briefly) for the reading it asked for.
    if published.borrow().overview.is_none() {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), published.changed()).await;
    }
    let json = published.borrow().json.clone();
    ([(header::CONTENT_TYPE, "application/json")], json.to_string()).into_response()
}

/// `event: overview` with the overview's JSON at each refresh, from the current one on.
pub(crate) async fn events(
    State(shared): State<Arc<Shared>>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    shared.demand.ask();
    let mut published = shared.published.clone();
    published.mark_changed();
    let closed = shared.closed.subscribe();
    let stream = futures::stream::unfold((published, closed), |(mut published, mut closed)| async move {
        loop {
            tokio::select! {
                changed = published.changed() => changed.ok()?,
                _ = closed.wait_for(|closed| *closed) => return None,
            }
            let json = published.borrow_and_update().json.clone();
            if &*json != "null" {
                return Some((Ok(Event::default().event("overview").data(&*json)), (published, closed)));
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `/readyz`: the database answers the overview's reader.
pub(crate) async fn ready(State(shared): State<Arc<Shared>>) -> Response {
    match shared.store.now().await {
        Ok(_) => (StatusCode::OK, "ready\n").into_response(),
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the database did not answer: {}\n", error_text(&error)),
        )
            .into_response(),
    }
}

pub(crate) async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    shared.demand.ask();
    let published = shared.published.borrow().clone();
    let text = match &published.overview {
        Some(overview) => super::metrics::render(overview),
        None => super::metrics::render_empty(),
    };
    ([(header::CONTENT_TYPE, canter::driver::metrics::CONTENT_TYPE)], text).into_response()
}

/// A listing's filter, as the query string gives it.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Filter {
    state: Option<String>,
    queue: Option<String>,
    name: Option<String>,
    /// Enqueued at or after (ms).
    from: Option<i64>,
    /// Enqueued before (ms).
    to: Option<i64>,
}

impl Filter {
    fn task_filter(&self) -> Result<TaskFilter, Failure> {
        let nonempty = |text: &Option<String>| text.as_ref().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty());
        let state = match nonempty(&self.state) {
            None => None,
            Some(text) => {
                Some(TaskState::ALL.into_iter().find(|s| s.as_str().eq_ignore_ascii_case(&text)).ok_or_else(|| {
                    Failure(StatusCode::BAD_REQUEST, format!("unknown state {text:?}: expected one of {}", states()))
                })?)
            }
        };
        Ok(TaskFilter {
            state,
            queue: nonempty(&self.queue),
            name: nonempty(&self.name),
            enqueued_from: self.from.map(DbTime),
            enqueued_before: self.to.map(DbTime),
            newest_first: true,
            ..TaskFilter::default()
        })
    }
}

fn states() -> String {
    TaskState::ALL.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}

/// A page of a listing: its filter (not flattened: a query string's numbers would stay
/// strings), the last id of the page before, and its size.
#[derive(Debug, Deserialize)]
pub(crate) struct Page {
    state: Option<String>,
    queue: Option<String>,
    name: Option<String>,
    from: Option<i64>,
    to: Option<i64>,
    before: Option<i64>,
    limit: Option<usize>,
}

pub(crate) async fn tasks(State(shared): State<Arc<Shared>>, Query(page): Query<Page>) -> Reply {
    let limit = page.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    let Page { state, queue, name, from, to, before, .. } = page;
    let filter = Filter { state, queue, name, from, to };
    let filter = TaskFilter { after: before.map(TaskId), limit: Some(limit), ..filter.task_filter()? };
    let tasks = shared.store.list(&filter).await.map_err(|e| unavailable(&e))?;
    let next_before = (tasks.len() == limit).then(|| tasks.last().map(|t| t.id)).flatten();
    json_reply(json!({"tasks": tasks, "next_before": next_before}))
}

pub(crate) async fn task(State(shared): State<Arc<Shared>>, Path(id): Path<i64>) -> Reply {
    let store = &shared.store;
    let id = TaskId(id);
    let task = store.get(id).await.map_err(|e| unavailable(&e))?;
    let Some(task) = task else {
        return Err(Failure(StatusCode::NOT_FOUND, format!("task {id} not found")));
    };
    let attempts = store.attempts(id).await.map_err(|e| unavailable(&e))?;
    let workflow = store.step_of(id).await.map_err(|e| unavailable(&e))?;
    let workflow = workflow.map(|(workflow, step)| json!({"id": workflow, "step": step}));
    json_reply(json!({"task": task, "attempts": attempts, "workflow": workflow}))
}

/// Refuses actions on a read-only dashboard, and actions a page of another site sent (its
/// `Origin` names another host than the one asked), logging the try.
fn writable(shared: &Shared, headers: &HeaderMap, what: &str) -> Result<String, Failure> {
    let user = user_of(shared, headers);
    let origin = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok());
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if let Some(origin) = origin {
        let origin_host = origin.split_once("://").map_or(origin, |(_, rest)| rest);
        if host != Some(origin_host) {
            tracing::warn!(target: "canter::dashboard", %user, action = what, origin, "refused: sent from another site");
            return Err(Failure(StatusCode::FORBIDDEN, "refused: the request came from another site".to_owned()));
        }
    }
    if shared.options.read_only {
        tracing::warn!(target: "canter::dashboard", %user, action = what, "refused: the dashboard is read-only");
        return Err(Failure(StatusCode::FORBIDDEN, "the dashboard is read-only".to_owned()));
    }
    Ok(user)
}

pub(crate) async fn admin(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Json(request): Json<AdminRequest>,
) -> Reply {
    let user = writable(&shared, &headers, request.name())?;
    let reply = shared.store.admin(&request).await;
    shared.demand.acted.notify_one();
    let detail = serde_json::to_string(&request).unwrap_or_default();
    match &reply {
        Ok(reply) => {
            tracing::info!(target: "canter::dashboard", %user, action = request.name(), request = %detail, ?reply, "applied")
        }
        Err(error) => {
            tracing::info!(target: "canter::dashboard", %user, action = request.name(), request = %detail, %error, "refused")
        }
    }
    json_reply(json!({"reply": reply.map_err(refused)?}))
}

/// What a bulk action does to each task.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum BulkAction {
    Cancel,
    Retry,
    Delete,
}

impl BulkAction {
    fn request(self, task: TaskId) -> AdminRequest {
        match self {
            BulkAction::Cancel => AdminRequest::Cancel { task },
            BulkAction::Retry => AdminRequest::Retry { task },
            BulkAction::Delete => AdminRequest::Delete { task },
        }
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct Bulk {
    action: BulkAction,
    ids: Option<Vec<i64>>,
    filter: Option<Filter>,
}

/// What a bulk action did so far.
#[derive(Debug, Default)]
struct BulkOutcome {
    done: u64,
    refused: Vec<Value>,
    refused_total: u64,
}

impl BulkOutcome {
    /// Applies the action to one task: a refusal is that task's alone; a database failure
    /// stops the batch (the caller reports how far it got).
    async fn apply(&mut self, shared: &Shared, action: BulkAction, task: TaskId) -> Result<(), Failure> {
        match shared.store.admin(&action.request(task)).await {
            Ok(_) => self.done += 1,
            Err(PgAdminError::Refused(refusal)) => {
                self.refused_total += 1;
                if self.refused.len() < REFUSALS_LISTED {
                    self.refused.push(json!({"id": task, "error": refusal.to_string()}));
                }
            }
            Err(other) => {
                return Err(Failure(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("stopped after {} tasks: {other}", self.done + self.refused_total),
                ));
            }
        }
        Ok(())
    }
}

pub(crate) async fn bulk(State(shared): State<Arc<Shared>>, headers: HeaderMap, Json(bulk): Json<Bulk>) -> Reply {
    let name = bulk.action.request(TaskId(0)).name();
    let user = writable(&shared, &headers, name)?;
    let mut outcome = BulkOutcome::default();
    let applied = apply_bulk(&shared, &bulk, &mut outcome).await;
    shared.demand.acted.notify_one();
    // Logged however it ended: a database failure part-way leaves what was done logged too.
    let error = applied.as_ref().err().map(|Failure(_, message)| message.as_str());
    tracing::info!(
        target: "canter::dashboard", %user, action = name, ids = ?bulk.ids, filter = ?bulk.filter,
        done = outcome.done, refused = outcome.refused_total, error, "bulk action"
    );
    applied?;
    json_reply(json!({"done": outcome.done, "refused": outcome.refused, "refused_total": outcome.refused_total}))
}

/// Applies a bulk action, counting in `outcome` what it did.
async fn apply_bulk(shared: &Shared, bulk: &Bulk, outcome: &mut BulkOutcome) -> Result<(), Failure> {
    match (&bulk.ids, &bulk.filter) {
        (Some(ids), None) => {
            for &id in ids {
                outcome.apply(shared, bulk.action, TaskId(id)).await?;
            }
        }
        (None, Some(filter)) => {
            // Page by page, newest first: each page starts below the last id seen, so tasks the
            // action moves out of (or into) the filter do not stall it.
            let mut filter = TaskFilter { limit: Some(MAX_PAGE), ..filter.task_filter()? };
            loop {
                let page = shared.store.list(&filter).await.map_err(|e| unavailable(&e))?;
                for task in &page {
                    outcome.apply(shared, bulk.action, task.id).await?;
                }
                match page.last() {
                    Some(last) if page.len() == MAX_PAGE => filter.after = Some(last.id),
                    _ => break,
                }
            }
        }
        _ => return Err(Failure(StatusCode::BAD_REQUEST, "expected either \"ids\" or \"filter\"".to_owned())),
    }
    Ok(())
}

pub(crate) async fn schedules(State(shared): State<Arc<Shared>>) -> Reply {
    let records = shared.store.schedule_records().await.map_err(|e| unavailable(&e))?;
    let configured = shared.options.schedules.as_deref();
    let mut rows: Vec<Value> = Vec::new();
    let schedule_json = |name: &str| -> Value {
        match configured.and_then(|s| s.get(name)) {
            Some(schedule) => json!({
                "task": schedule.config().task,
                "queue": schedule.new_task().queue,
                "cron": schedule.schedule().to_string(),
                "zone": schedule.time_zone().id().to_string(),
            }),
            None => json!({"task": null, "queue": null, "cron": null, "zone": null}),
        }
    };
    for record in &records {
        let mut row = schedule_json(&record.name);
        row["name"] = json!(record.name);
        row["last_tick"] = json!(record.last_tick);
        row["next_tick"] = json!(record.next_tick);
        row["last_task_id"] = json!(record.last_task_id);
        row["run_count"] = json!(record.run_count);
        rows.push(row);
    }
    // Configured schedules that have not ticked yet.
    for schedule in configured.map(|s| s.schedules()).unwrap_or_default() {
        if !records.iter().any(|r| r.name == schedule.name()) {
            let mut row = schedule_json(schedule.name());
            row["name"] = json!(schedule.name());
            row["last_tick"] = Value::Null;
            row["next_tick"] = Value::Null;
            rows.push(row);
        }
    }
    json_reply(json!({"schedules": rows}))
}

#[derive(Debug, Deserialize)]
pub(crate) struct Limit {
    limit: Option<u32>,
}

pub(crate) async fn workflows(State(shared): State<Arc<Shared>>, Query(limit): Query<Limit>) -> Reply {
    let ids = shared.store.workflow_ids(limit.limit.unwrap_or(50).clamp(1, 500)).await.map_err(|e| unavailable(&e))?;
    let mut records = Vec::with_capacity(ids.len());
    for id in ids {
        // One gone between the two reads is left out.
        if let Some(record) = shared.store.workflow(id).await.map_err(|e| unavailable(&e))? {
            records.push(record);
        }
    }
    json_reply(json!({"workflows": records}))
}

pub(crate) async fn workflow(State(shared): State<Arc<Shared>>, Path(id): Path<i64>) -> Reply {
    let id = WorkflowId(id);
    let store = &shared.store;
    let Some(record) = store.workflow(id).await.map_err(|e| unavailable(&e))? else {
        return Err(Failure(StatusCode::NOT_FOUND, format!("no workflow {id}")));
    };
    let mut steps = store.workflow_steps(id).await.map_err(|e| unavailable(&e))?;
    let truncated = steps.len() > MAX_STEPS;
    steps.truncate(MAX_STEPS);
    let edges = store.workflow_edges(id, (MAX_STEPS * 4) as u32).await.map_err(|e| unavailable(&e))?;
    let edges: Vec<_> =
        edges.into_iter().filter(|e| e.child.index() < MAX_STEPS && e.parent.index() < MAX_STEPS).collect();
    json_reply(json!({"workflow": record, "steps": steps, "edges": edges, "truncated": truncated}))
}

/// A workflow action's body: `{}`, or `{"downstream": true}` for a retry. Required, and JSON:
/// a cross-site request cannot send that without the browser asking first.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RetryBody {
    downstream: bool,
}

pub(crate) async fn workflow_action(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((id, action)): Path<(i64, String)>,
    Json(body): Json<RetryBody>,
) -> Reply {
    let id = WorkflowId(id);
    let user = writable(&shared, &headers, &format!("workflow {action}"))?;
    let store = &shared.store;
    let downstream = body.downstream;
    let status = match action.as_str() {
        "cancel" => store.cancel_workflow(id).await,
        "pause" => store.pause_workflow(id).await,
        "resume" => store.resume_workflow(id).await,
        "retry" => store.retry_workflow(id, downstream).await,
        other => {
            return Err(Failure(
                StatusCode::NOT_FOUND,
                format!("unknown workflow action {other:?}: expected cancel, pause, resume or retry"),
            ));
        }
    };
    shared.demand.acted.notify_one();
    match &status {
        Ok(status) => {
            tracing::info!(target: "canter::dashboard", %user, %action, workflow = %id, downstream, ?status, "applied")
        }
        Err(error) => tracing::info!(target: "canter::dashboard", %user, %action, workflow = %id, %error, "refused"),
    }
    let status = status.map_err(|error| match error {
        PgWorkflowError::Refused(WorkflowActionError::NotFound(_)) => Failure(StatusCode::NOT_FOUND, error.to_string()),
        PgWorkflowError::Refused(_) => Failure(StatusCode::CONFLICT, error.to_string()),
        other => Failure(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    })?;
    json_reply(json!({"status": status}))
}
