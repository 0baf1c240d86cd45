//! A worker's HTTP endpoints (feature `http`): `/metrics` (its counters, health and database
//! request histograms in the Prometheus text format, see [`canter::driver::metrics`]),
//! `/healthz` (the process answers) and `/readyz` (the worker runs, its database answers and it
//! hears of new tasks: 200, else 503 with the reason), as Prometheus and Kubernetes expect.
//!
//! ```no_run
//! # async fn demo(worker: canter_tokio::Worker) -> Result<(), Box<dyn std::error::Error>> {
//! let router = canter_tokio::http::worker_router(worker.worker_id().clone(), worker.counters());
//! let endpoints = canter_tokio::http::Endpoints::bind("127.0.0.1:9464", router).await?;
//! worker.run().await?;
//! endpoints.stop().await;
//! # Ok(()) }
//! ```
//!
//! The router is an [`axum::Router`]: mount it in a server of your own with `nest` or `merge`.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::routing::get;
use canter::driver::Counters;
use canter::driver::metrics::{CONTENT_TYPE, render};
use canter::task::WorkerId;
use canter::worker::Health;

/// `/metrics`, `/healthz` and `/readyz` of the worker `id` whose counters are `counters`
/// ([`Worker::counters`](crate::Worker)).
pub fn worker_router(id: WorkerId, counters: Arc<Counters>) -> Router {
    let id = Arc::new(id.0);
    let for_metrics = counters.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let (id, counters) = (id.clone(), for_metrics.clone());
                async move {
                    let text = render(&id, &counters.snapshot(), &counters.requests());
                    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text)
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let health = counters.snapshot().health;
                async move { readiness(&health) }
            }),
        )
}

/// 200 `ready`, or 503 with every reason the worker is not.
fn readiness(health: &Health) -> (StatusCode, String) {
    if health.ready() {
        return (StatusCode::OK, "ready\n".to_owned());
    }
    let mut reasons = Vec::new();
    if health.shutting_down {
        reasons.push("shutting down".to_owned());
    }
    if health.db_failures_in_a_row > 0 {
        reasons.push(format!("the database is unavailable ({} failed tries in a row)", health.db_failures_in_a_row));
    }
    if !health.listening && !health.polling {
        reasons.push("starting: neither listening nor polling yet".to_owned());
    }
    (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", reasons.join("; ")))
}

/// How long [`Endpoints::stop`] waits for connections still open.
pub const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// An HTTP server of a router on a task of its own, until [`stop`](Endpoints::stop)ped (or
/// dropped, which stops it too).
#[derive(Debug)]
pub struct Endpoints {
    /// The address it listens on (the port the system chose for port 0).
    pub local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
}

impl Endpoints {
    /// Listens on `addr` (e.g. `127.0.0.1:9464`; port 0 lets the system choose) and serves
    /// `router` there.
    pub async fn bind(addr: impl tokio::net::ToSocketAddrs, router: Router) -> std::io::Result<Endpoints> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local_addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        let server = tokio::spawn(async move {
            if let Err(error) = serve.into_future().await {
                tracing::warn!(%error, "the HTTP endpoints stopped");
            }
        });
        Ok(Endpoints { local_addr, stop: Some(stop), server })
    }

    /// Stops listening and waits for requests in flight, at most [`STOP_WAIT`]: a client that
    /// sent half a request and stalled is cut off then.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(STOP_WAIT, &mut self.server).await.is_err() {
            self.server.abort();
        }
    }
}

impl Drop for Endpoints {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.server.abort();
        }
    }
}
