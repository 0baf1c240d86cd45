//! `canter dashboard`: the web dashboard of a schema, until SIGINT or SIGTERM.

use canter_tokio::canter::postgres::require_current;
use canter_tokio::dashboard::{Dashboard, DashboardOptions};

use crate::args::DashboardArgs;
use crate::connect::Database;
use crate::{Outcome, failed, output, usage};

/// `canter dashboard`: serves until SIGINT or SIGTERM.
pub(crate) async fn run(database: &Database, args: DashboardArgs) -> Outcome {
    let app = match &args.config {
        Some(path) => canter_tokio::canter::driver::read_config(path).map_err(usage)?.app,
        None => canter_tokio::AppConfig::default(),
    };
    let schedules = canter_tokio::canter::driver::load_scheduler(&app).map_err(usage)?;
    let pool = database.pool(4).await?;
    let client = database.with_session(
        canter_tokio::Client::new(
            std::sync::Arc::new(canter_tokio::TokioRuntime),
            pool,
            database.schema(&args.schema),
            app,
        )
        .migrate(false),
    )?;
    let store = client.store().clone();
    database.retrying("check the schema", || require_current(store.pool(), store.schema())).await?;
    let options = DashboardOptions {
        read_only: args.read_only,
        basic_auth: args.auth,
        allowed_hosts: args.allowed_host,
        refresh: std::time::Duration::from_millis(args.refresh),
        schedules: Some(std::sync::Arc::new(schedules)),
    };
    let dashboard = Dashboard::new(store, options);
    let endpoints = canter_tokio::http::Endpoints::bind(args.addr.as_str(), dashboard.router())
        .await
        .map_err(|e| failed(format!("--addr {}: cannot listen there: {e}", args.addr)))?;
    output::note_line(format_args!(
        "dashboard on http://{}/{}; stop it with Ctrl-C or SIGTERM",
        endpoints.local_addr,
        if args.read_only { " (read-only)" } else { "" }
    ));
    canter_tokio::shutdown_signal().await;
    dashboard.close();
    endpoints.stop().await;
    Ok(())
}
