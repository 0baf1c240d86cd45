//! `canter`: run workers, enqueue tasks and inspect the queue from the command line.
//!
//! Exit codes: 0 success, 1 failure, 2 usage.

mod admin;
mod args;
mod bench;
mod builtins;
mod connect;
mod dashboard;
mod demo;
mod enqueue;
mod inspect;
#[cfg(feature = "otel")]
mod otel;
mod output;
mod schedules;
mod settings;
mod workflows;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;

use canter_tokio::canter::driver::isolation::{IsolatedTasks, Isolation, IsolationOptions, ProcessPool};

use canter_tokio::canter::config::Config;
use canter_tokio::canter::postgres::{MIGRATE_LOCK_WAIT, SchemaStatus};
use canter_tokio::{Worker, WorkerId};
use clap::{CommandFactory, Parser};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;

use crate::args::{Cli, Command, Output, SchemaArg, WorkerArgs};
use crate::connect::Database;
use crate::output::printable;

#[cfg(feature = "otel")]
use crate::otel::Export as SpanExport;

/// Nothing to export without feature `otel`.
#[cfg(not(feature = "otel"))]
enum SpanExport {}

#[cfg(not(feature = "otel"))]
impl SpanExport {
    fn shutdown(self) {
        match self {}
    }
}
pub(crate) use crate::output::{errln, outln};

/// Why a command did not succeed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The arguments cannot work: printed with the command's usage, exit status 2.
    Usage(String),
    /// The command failed: exit status 1.
    Failed(String),
    /// Ctrl-C or SIGTERM stopped the command after it cleaned up: exit status 130.
    Interrupted,
}

/// What a command returns.
pub(crate) type Outcome = Result<(), Failure>;

/// A failure whose message may carry names and errors from the data: one line, with its
/// control characters escaped.
pub(crate) fn failed(message: impl std::fmt::Display) -> Failure {
    Failure::Failed(printable(&message.to_string()).to_string())
}

/// A usage failure.
pub(crate) fn usage(message: impl std::fmt::Display) -> Failure {
    Failure::Usage(message.to_string())
}

fn main() -> ExitCode {
    // A child of a worker's process pool (`canter worker --processes N`) serves and exits here.
    canter_tokio::isolation::serve_child_if_asked(&Arc::new(builtins::registry()));
    // Usage errors exit with 2, `--help` and `--version` with 0, as clap decides.
    let cli = Cli::parse();
    let name = subcommand_name(&cli.command);
    if let Command::Completions { shell } = cli.command {
        // Written at once, so a reader that goes away ends the program as for any output.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "canter", &mut script);
        outln!("{}", String::from_utf8_lossy(&script).trim_end());
        return ExitCode::SUCCESS;
    }
    // The demo prints its own progress: only warnings from the workers.
    let export = init_logging(if name == "demo" { LevelFilter::WARN } else { LevelFilter::INFO });
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            errln!("canter: cannot start the runtime: {error}");
            return ExitCode::from(1);
        }
    };
    let database = Database {
        url: cli.database_url,
        listen_url: cli.listen_database_url,
        transaction_pooler: cli.transaction_pooler,
        wakeups: cli.wakeups,
        wakeup_url: cli.wakeup_url,
    };
    let outcome = runtime.block_on(run(cli.command, database));
    let code = match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            let mut command = Cli::command();
            let sub = command.find_subcommand_mut(name).cloned().unwrap_or(command);
            sub.bin_name(format!("canter {name}")).error(clap::error::ErrorKind::ValueValidation, message).exit()
        }
        Err(Failure::Failed(message)) => {
            errln!("canter {name}: {message}");
            ExitCode::from(1)
        }
        Err(Failure::Interrupted) => {
            errln!("canter {name}: interrupted; stopped and cleaned up");
            ExitCode::from(130)
        }
    };
    // Outside the runtime: the exporter's client blocks.
    drop(runtime);
    if let Some(export) = export {
        export.shutdown();
    }
    code
}

/// The name a command is invoked by.
fn subcommand_name(command: &Command) -> &'static str {
    match command {
        Command::Migrate { .. } => "migrate",
        Command::Worker(_) => "worker",
        Command::Enqueue(_) => "enqueue",
        Command::Status { .. } => "status",
        Command::List(_) => "list",
        Command::Show { .. } => "show",
        Command::Result { .. } => "result",
        Command::Cancel(_) => "cancel",
        Command::Retry(_) => "retry",
        Command::Reschedule(_) => "reschedule",
        Command::Delete(_) => "delete",
        Command::Complete { .. } => "complete",
        Command::Fail { .. } => "fail",
        Command::ForceUnlock { .. } => "force-unlock",
        Command::RemoveKey { .. } => "remove-key",
        Command::Purge { .. } => "purge",
        Command::Pause(_) => "pause",
        Command::Resume(_) => "resume",
        Command::Scheduler(_) => "scheduler",
        Command::Schedules { .. } => "schedules",
        Command::Dashboard(_) => "dashboard",
        Command::Workflow(_) => "workflow",
        Command::Demo(_) => "demo",
        Command::Bench(_) => "bench",
        Command::Completions { .. } => "completions",
    }
}

async fn run(command: Command, database: Database) -> Outcome {
    match command {
        Command::Migrate { schema, output } => migrate(&database, &schema, output).await,
        Command::Worker(args) => worker(&database, *args).await,
        Command::Enqueue(args) => enqueue::enqueue(&database, *args).await,
        Command::Status { schema, output } => inspect::status(&database, &schema, output).await,
        Command::List(args) => inspect::list(&database, args).await,
        Command::Show { id, schema, output } => inspect::show(&database, id.0, &schema, output).await,
        Command::Result { id, wait, schema, output } => inspect::result(&database, id.0, wait, &schema, output).await,
        Command::Scheduler(args) => schedules::scheduler(&database, args).await,
        Command::Schedules { config, schema, output } => schedules::list(&database, config, &schema, output).await,
        Command::Dashboard(args) => dashboard::run(&database, args).await,
        Command::Workflow(command) => workflows::run(&database, command).await,
        Command::Demo(args) => demo::run(&database, args).await.map_err(|e| match e {
            demo::DemoError::Failed(m) => Failure::Failed(m),
            demo::DemoError::Connect(failure) => failure,
            demo::DemoError::Interrupted => Failure::Interrupted,
            // As `outln!` does, once the demo has cleaned up.
            demo::DemoError::OutputClosed => output::exit_output_closed(),
        }),
        Command::Bench(args) => bench::run(&database, *args).await.map_err(|e| e.split().map_or_else(failed, usage)),
        Command::Completions { .. } => Ok(()),
        admin => admin::run(&database, admin).await,
    }
}

/// Logs to stderr as `CANTER_LOG` says (see [`log_filter`]); `default` when it is unset, and,
/// said so, when it cannot be read. Colours only on a terminal, and never with `NO_COLOR`. With
/// feature `otel`, exports spans too when the environment names a collector: the export to
/// shut down at exit.
fn init_logging(default: LevelFilter) -> Option<SpanExport> {
    let value = std::env::var("CANTER_LOG").unwrap_or_default();
    let (filter, max) = log_filter(&value, default).unwrap_or_else(|| {
        errln!("canter: CANTER_LOG={value:?} is neither a level nor target=level directives; logging at {default}");
        (Targets::new().with_default(default), default)
    });
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(max)
        .with_writer(std::io::stderr)
        .with_ansi(output::colour(std::io::stderr().is_terminal()))
        .with_target(false)
        // A log that cannot be written is dropped: by default the subscriber reports it with
        // `eprintln!`, which panics when stderr is gone, inside whatever task logged (a worker's
        // loop, whose process then hangs).
        .log_internal_errors(false)
        .finish()
        .with(filter);
    #[cfg(feature = "otel")]
    {
        let (layer, export) = match otel::layer() {
            Ok(Some((layer, export))) => (Some(layer), Some(export)),
            Ok(None) => (None, None),
            Err(message) => {
                errln!("canter: {message}; spans are not exported");
                (None, None)
            }
        };
        let _ = tracing::subscriber::set_global_default(subscriber.with(layer));
        export
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = tracing::subscriber::set_global_default(subscriber);
        None
    }
}

/// Reads log directives: comma-separated levels (error, warn, info, debug, trace, off) and
/// `target=level` pairs (`canter::db=trace,info`); targets without a pair of their own log at
/// the bare level, else at `default`. Returns the filter and the most verbose level it lets
/// through, or `None` when a part is neither (a misspelt level must not silence every log).
fn log_filter(directives: &str, default: LevelFilter) -> Option<(Targets, LevelFilter)> {
    let mut targets = Targets::new();
    let (mut fallback, mut max) = (None, LevelFilter::OFF);
    for part in directives.split(',').map(str::trim).filter(|part| !part.is_empty()) {
        match part.split_once('=') {
            Some((target, level)) => {
                let (target, level) = (target.trim(), level.trim().parse::<LevelFilter>().ok()?);
                if target.is_empty() {
                    return None;
                }
                targets = targets.with_target(target.to_owned(), level);
                max = max.max(level);
            }
            None => fallback = Some(part.parse::<LevelFilter>().ok()?),
        }
    }
    let fallback = fallback.unwrap_or(default);
    Some((targets.with_default(fallback), max.max(fallback)))
}

async fn migrate(database: &Database, schema: &SchemaArg, output: Output) -> Outcome {
    // The migrate lock is a session's: on --listen-database-url's connection when given.
    let pool = match database.session_pool()? {
        Some(session) => session,
        None if database.transaction_pooler => {
            return Err(usage(
                "migrations hold a session's lock, which a transaction pooler does not keep: give \
                 --listen-database-url (a direct connection)",
            ));
        }
        None => database.pool(2).await?,
    };
    let schema = &database.schema(schema);
    let before = database
        .retrying("read the schema's version", || canter_tokio::canter::postgres::schema_status(&pool, schema))
        .await?;
    let status = database
        .retrying("migrate", || canter_tokio::canter::postgres::migrate_within(&pool, schema, MIGRATE_LOCK_WAIT))
        .await?;
    let name = schema.name();
    let created = matches!(before, SchemaStatus::Behind { schema_exists: false, .. });
    let applied = match &before {
        SchemaStatus::Behind { missing, .. } => missing.len(),
        _ => 0,
    };
    let version = status.version().unwrap_or(0);
    if output.json {
        outln!(
            "{}",
            serde_json::json!({"schema": name, "version": version, "created": created, "migrations_applied": applied})
        );
        return Ok(());
    }
    match status {
        SchemaStatus::Ahead { version, code_version } => {
            outln!("schema {name} is at version {version}, newer than this binary's {code_version}, which it accepts")
        }
        _ if created => outln!("schema {name} created at version {version}"),
        _ if applied > 0 => outln!("schema {name} upgraded to version {version} ({applied} migrations applied)"),
        _ => outln!("schema {name} is up to date (version {version})"),
    }
    Ok(())
}

/// The configuration of `--config FILE` (or the defaults) with every settings flag laid over it.
fn worker_config(args: &WorkerArgs) -> Result<Config, Failure> {
    let base = match &args.config {
        // Checked once the flags are laid over it: a flag may correct a value of the file.
        Some(path) => canter_tokio::canter::driver::read_config_unchecked(path).map_err(usage)?,
        None => Config::default(),
    };
    let config = args.settings.apply(&base).map_err(usage)?;
    if config.worker.run_scheduler {
        schedules::check_schedules(&config.app, args.force)?;
    }
    Ok(config)
}

async fn worker(database: &Database, args: WorkerArgs) -> Outcome {
    let config = worker_config(&args)?;
    let size = config.worker.pool_size();
    // A worker may start before its database: it waits as its resilience settings say.
    let pool = database.service_pool(size, config.app.resilience.db_retry_max_attempts).await?;
    builtins::quiet_deliberate_panics();
    let registry = Arc::new(builtins::registry());
    let worker = Worker::new(pool, config.app, config.worker, registry)
        .map_err(usage)?
        .schema(database.schema(&args.schema))
        .migrate(!args.no_migrate);
    let worker = match database.session_pool()? {
        Some(session_pool) => worker.session_pool(session_pool),
        None => worker,
    };
    let worker = match database.wakeup_provider(&args.schema)? {
        Some(provider) => worker.wakeups(provider),
        None => worker,
    };
    let worker = match args.processes {
        Some(processes) => {
            let options = IsolationOptions {
                processes: processes as usize,
                memory_limit_bytes: args.child_memory_mib.map(|mib| mib << 20),
                recycle_after: args.recycle_after,
                ..IsolationOptions::default()
            };
            let pool = ProcessPool::new(options).map_err(|e| failed(format!("--processes: {e}")))?;
            worker.isolate(Isolation { pool, tasks: IsolatedTasks::Blocking })
        }
        None => worker,
    };
    let endpoints = match &args.metrics_addr {
        Some(addr) => {
            let router = canter_tokio::http::worker_router(worker.worker_id().clone(), worker.counters());
            let endpoints = canter_tokio::http::Endpoints::bind(addr.as_str(), router)
                .await
                .map_err(|e| failed(format!("--metrics-addr {addr}: cannot listen there: {e}")))?;
            output::note_line(format_args!(
                "metrics on http://{0}/metrics, health on http://{0}/healthz and http://{0}/readyz",
                endpoints.local_addr
            ));
            Some(endpoints)
        }
        None => None,
    };
    let WorkerId(id) = worker.worker_id();
    output::note_line(format_args!("worker {} starting; stop it with Ctrl-C or SIGTERM", printable(id)));
    let stats = worker.run().await.map_err(|e| failed(connect::explain(&e.to_string())));
    if let Some(endpoints) = endpoints {
        endpoints.stop().await;
    }
    let stats = stats?;
    output::note_line(format_args!(
        "worker stopped: claimed {}, completed {}, failed {}, retried {}, lost {}",
        stats.claimed, stats.completed, stats.failed, stats.retried, stats.lost
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn log_directives_are_levels_and_target_levels() {
        let (filter, max) = log_filter("warn", LevelFilter::INFO).expect("a level");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::WARN), LevelFilter::WARN));

        let (filter, max) = log_filter(" canter::db = trace , info ", LevelFilter::WARN).expect("directives");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::INFO), LevelFilter::TRACE));
        assert!(filter.would_enable("canter::db", &tracing::Level::TRACE));
        assert!(!filter.would_enable("sqlx::query", &tracing::Level::DEBUG));

        // No bare level: other targets keep the default, errors included.
        let (filter, max) = log_filter("canter::db=trace", LevelFilter::WARN).expect("a directive");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::WARN), LevelFilter::TRACE));
        assert!(filter.would_enable("canter::driver", &tracing::Level::ERROR));

        let (filter, max) = log_filter("", LevelFilter::INFO).expect("nothing");
        assert_eq!((filter.default_level(), max), (Some(LevelFilter::INFO), LevelFilter::INFO));
    }

    #[test]
    fn unreadable_log_directives_are_refused() {
        for bad in ["wran", "verbose", "canter::db=loud", "=info", "canter::db=trace,nonsense"] {
            assert!(log_filter(bad, LevelFilter::INFO).is_none(), "{bad}");
        }
    }
}
