//! The web dashboard (feature `dashboard`): pages for the queues, tasks, workers, schedules and
//! workflows of one schema, live over server-sent events, with the operator's actions, and
//! `/metrics` with each queue's depth and age. `canter dashboard` serves it; mount
//! [`Dashboard::router`] in a server of your own with `nest` or `merge`.
//!
//! ```no_run
//! # async fn demo(client: canter_tokio::Client) -> std::io::Result<()> {
//! use canter_tokio::dashboard::{Dashboard, DashboardOptions};
//! let store = client.store().clone(); // its schema and app settings (the queues' caps)
//! let dashboard = Dashboard::new(store, DashboardOptions { read_only: true, ..Default::default() });
//! let endpoints = canter_tokio::http::Endpoints::bind("127.0.0.1:8080", dashboard.router()).await?;
//! canter_tokio::shutdown_signal().await;
//! dashboard.close();
//! endpoints.stop().await;
//! # Ok(()) }
//! ```
//!
//! What it costs the database: one task per dashboard reads the overview (five statements
//! over the live table's rows, the finished tasks of the last seconds through their BRIN
//! index, and the registry) while anyone looks, at most every `refresh`, and never more than a
//! twentieth of the time; every viewer and every event stream shares that one reading. Lists
//! and details are read per request, a page at a time. Actions are [`AdminRequest`]s, as the
//! command line sends them, each logged (target `canter::dashboard`) with who sent it.

mod api;
mod metrics;
mod snapshot;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use canter::postgres::PgStore;
use canter::scheduler::Scheduler;
use tokio::sync::watch;

use snapshot::{Demand, Published};

/// How a dashboard serves.
#[derive(Debug, Clone)]
pub struct DashboardOptions {
    /// Refuse every action (403): a dashboard for people who look.
    pub read_only: bool,
    /// Ask for this user name and password (HTTP basic auth) on every page but `/healthz`
    /// and `/readyz`. Serve it over TLS (a proxy in front) beyond a trusted network.
    pub basic_auth: Option<(String, String)>,
    /// Host names (as the browser's `Host` header gives them, with or without the port) a
    /// dashboard without basic auth answers besides IP addresses and `localhost`: a page of
    /// another site whose name was made to resolve to this address (DNS rebinding) is refused.
    pub allowed_hosts: Vec<String>,
    /// How often the overview is read while anyone looks (the cost bound may stretch it).
    pub refresh: Duration,
    /// The configured schedules, to show what each runs and its zone.
    pub schedules: Option<Arc<Scheduler>>,
}

impl Default for DashboardOptions {
    fn default() -> Self {
        DashboardOptions {
            read_only: false,
            basic_auth: None,
            allowed_hosts: Vec::new(),
            refresh: Duration::from_secs(2),
            schedules: None,
        }
    }
}

/// A dashboard of one store (its schema and app settings: the queues' caps come from them).
#[derive(Debug, Clone)]
pub struct Dashboard {
    shared: Arc<Shared>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) store: PgStore,
    pub(crate) options: DashboardOptions,
    pub(crate) published: watch::Receiver<Arc<Published>>,
    pub(crate) demand: Arc<Demand>,
    pub(crate) closed: watch::Sender<bool>,
}

impl Dashboard {
    /// A dashboard of `store`; its reader runs on a tokio task from here until
    /// [`close`](Dashboard::close) (call it inside a tokio runtime).
    pub fn new(store: PgStore, options: DashboardOptions) -> Dashboard {
        let empty = Arc::new(Published { overview: None, json: Arc::from("null") });
        let (sender, published) = watch::channel(empty);
        let (closed, closed_rx) = watch::channel(false);
        let demand = Arc::new(Demand::new());
        tokio::spawn(snapshot::refresh(
            store.clone(),
            sender,
            demand.clone(),
            options.read_only,
            options.refresh,
            closed_rx,
        ));
        Dashboard { shared: Arc::new(Shared { store, options, published, demand, closed }) }
    }

    /// Stops its reader and ends its event streams (a server's graceful shutdown waits for
    /// open streams otherwise).
    pub fn close(&self) {
        self.shared.closed.send_replace(true);
    }

    /// The pages, the JSON API under `api/`, `/metrics`, `/healthz` and `/readyz`.
    pub fn router(&self) -> Router {
        let shared = self.shared.clone();
        let guarded = Router::new()
            .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
            .route("/app.js", get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }))
            .route("/style.css", get(|| async { asset("text/css; charset=utf-8", STYLE_CSS) }))
            .route("/metrics", get(api::metrics))
            .route("/api/overview", get(api::overview))
            .route("/api/events", get(api::events))
            .route("/api/tasks", get(api::tasks))
            .route("/api/tasks/{id}", get(api::task))
            .route("/api/admin", post(api::admin))
            .route("/api/bulk", post(api::bulk))
            .route("/api/schedules", get(api::schedules))
            .route("/api/workflows", get(api::workflows))
            .route("/api/workflows/{id}", get(api::workflow))
            .route("/api/workflows/{id}/{action}", post(api::workflow_action))
            .layer(axum::middleware::from_fn_with_state(shared.clone(), authenticate));
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(api::ready))
            .merge(guarded)
            .with_state(shared)
    }
}

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// Refuses a request without the configured credentials (401 and a basic-auth challenge);
/// without credentials to ask for, one addressed to a host name it does not know (403).
async fn authenticate(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let Some((user, password)) = &shared.options.basic_auth else {
        if !host_allowed(request.headers(), &shared.options.allowed_hosts) {
            let text = "refused: unknown host name (a dashboard without --auth answers IP addresses, localhost \
                        and --allowed-host names)\n";
            return (StatusCode::FORBIDDEN, text).into_response();
        }
        return next.run(request).await;
    };
    if presented(request.headers()).is_some_and(|(u, p)| equal(&u, user) & equal(&p, password)) {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Basic realm=\"canter\", charset=\"UTF-8\"")],
        "unauthorized\n",
    )
        .into_response()
}

/// Whether the `Host` header names an IP address, `localhost` or an allowed name (a request
/// without one, from no browser, is let through).
fn host_allowed(headers: &HeaderMap, allowed: &[String]) -> bool {
    let Some(host) = headers.get(header::HOST).map(|h| h.to_str().unwrap_or("")) else {
        return true;
    };
    let host = host.trim().to_ascii_lowercase();
    // `[::1]:8080`, `127.0.0.1:8080`, `name:8080`, `name`.
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host.as_str(), |(name, _)| name),
    };
    name.parse::<std::net::IpAddr>().is_ok()
        || name == "localhost"
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name) || a.eq_ignore_ascii_case(&host))
}

/// The user name and password of a basic-auth header.
fn presented(headers: &HeaderMap) -> Option<(String, String)> {
    use base64::Engine;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value.strip_prefix("Basic ").or_else(|| value.strip_prefix("basic "))?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

/// Compares without stopping at the first difference, so the time taken says nothing of how
/// much of a secret was guessed.
fn equal(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let mut differ = u8::from(a.len() != b.len());
    for (i, &byte) in b.iter().enumerate() {
        differ |= byte ^ a.get(i).copied().unwrap_or(0);
    }
    differ == 0
}

/// The user an action is logged with.
pub(crate) fn user_of(shared: &Shared, headers: &HeaderMap) -> String {
    match &shared.options.basic_auth {
        Some(_) => presented(headers).map_or_else(|| "?".to_owned(), |(user, _)| user),
        None => "anonymous".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_read_from_the_header_and_compared_whole() {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "Basic b3BzOnMzY3JldDpwYXJ0".parse().unwrap());
        assert_eq!(presented(&headers), Some(("ops".to_owned(), "s3cret:part".to_owned())));
        headers.insert(header::AUTHORIZATION, "Basic !!".parse().unwrap());
        assert_eq!(presented(&headers), None);
        assert!(equal("s3cret", "s3cret"));
        assert!(!equal("s3cre", "s3cret"));
        assert!(!equal("s3cretx", "s3cret"));
        assert!(!equal("", "s3cret"));
    }

    #[test]
    fn without_auth_only_addresses_localhost_and_allowed_names_are_answered() {
        let allowed = vec!["queue.internal".to_owned()];
        let with = |host: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::HOST, host.parse().unwrap());
            host_allowed(&headers, &allowed)
        };
        for ok in ["127.0.0.1:8080", "10.1.2.3", "[::1]:8080", "localhost:8080", "LOCALHOST", "queue.internal:443"] {
            assert!(with(ok), "{ok}");
        }
        for refused in ["evil.example:8080", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example:80"] {
            assert!(!with(refused), "{refused}");
        }
        assert!(host_allowed(&HeaderMap::new(), &allowed));
    }
}
