//! Reaching the database: a pool whose first connection is tried at once, so a wrong host,
//! port, password or database is reported within a second with its cause; waiting (with
//! backoff, said so) only where it can help, a server not up yet; and errors that say what to
//! do (a schema that is not migrated).

use std::time::Duration;

use std::sync::Arc;

use canter_tokio::canter::driver::wakeups::{NatsWakeups, RabbitMqWakeups, WakeupProvider};
use canter_tokio::canter::postgres::with_session_settings;
use canter_tokio::canter::wake::Wakeup;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::{Failure, errln, failed, usage};

/// How long the first connection may take before it counts as timed out.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// The database the command line names (`--database-url` or `DATABASE_URL`).
#[derive(Debug, Clone)]
pub(crate) struct Database {
    /// The URL, if one was given.
    pub(crate) url: Option<String>,
    /// A direct URL for the connections that keep session state (LISTEN, the liveness
    /// token), when `url` goes through a pooler in transaction mode.
    pub(crate) listen_url: Option<String>,
    /// `--transaction-pooler`: the URL goes through a pooler in transaction mode.
    pub(crate) transaction_pooler: bool,
    /// `--wakeups`: postgres, rabbitmq or nats.
    pub(crate) wakeups: String,
    /// `--wakeup-url`: the broker's URL.
    pub(crate) wakeup_url: Option<String>,
}

/// How long a command that enqueued waits for its wake-ups to reach the broker before it exits.
const WAKEUP_FLUSH_WAIT: Duration = Duration::from_secs(2);

/// Why a connection failed, as far as waiting is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cause {
    /// Nothing listens, or nothing answers yet: a server starting may soon.
    Unreachable(String),
    /// Waiting will not help: wrong password, unknown database, bad TLS.
    Refused(String),
    /// The host name does not resolve: a typo for a command, but for a service started
    /// beside its database (a container's name appears when it starts) worth waiting for.
    UnknownHost(String),
}

impl Database {
    /// A lazily connecting pool on `--listen-database-url`, when one was given: nothing is
    /// dialled until a wait or a worker's listener needs it (and then retried as they retry).
    pub(crate) fn session_pool(&self) -> Result<Option<sqlx::PgPool>, Failure> {
        match self.listen_url.as_deref().filter(|url| !url.is_empty()) {
            None => Ok(None),
            Some(url) => canter_tokio::connect(url, 3)
                .map(Some)
                .map_err(|e| usage(format!("invalid --listen-database-url: {e}"))),
        }
    }

    /// The schema `arg` names, sent through the pooler when `--transaction-pooler` says so.
    pub(crate) fn schema(&self, arg: &crate::args::SchemaArg) -> canter_tokio::PgSchema {
        match self.transaction_pooler {
            true => arg.schema.transaction_pooled(),
            false => arg.schema.clone(),
        }
    }

    /// `client` listening on `--listen-database-url`'s connections when one was given.
    pub(crate) fn with_session(&self, client: canter_tokio::Client) -> Result<canter_tokio::Client, Failure> {
        Ok(match self.session_pool()? {
            Some(pool) => client.session_pool(pool),
            None => client,
        })
    }

    /// The wake-up provider `--wakeups` names for `schema`'s queues, if not PostgreSQL's.
    pub(crate) fn wakeup_provider(
        &self,
        schema: &crate::args::SchemaArg,
    ) -> Result<Option<Arc<dyn WakeupProvider>>, Failure> {
        let url = |default: &str| self.wakeup_url.clone().filter(|url| !url.is_empty()).unwrap_or(default.to_owned());
        let name = schema.schema.name();
        let provider: Arc<dyn WakeupProvider> = match self.wakeups.as_str() {
            "rabbitmq" => Arc::new(
                RabbitMqWakeups::new(&url("amqp://guest:guest@127.0.0.1:5672/%2f"), name)
                    .map_err(|e| usage(format!("--wakeup-url: {e}")))?,
            ),
            "nats" => Arc::new(
                NatsWakeups::new(&url("nats://127.0.0.1:4222"), name)
                    .map_err(|e| usage(format!("--wakeup-url: {e}")))?,
            ),
            _ => return Ok(None),
        };
        Ok(Some(provider))
    }

    /// Announces tasks a command enqueued (and committed) on the `--wakeups` broker, if one is
    /// named, and waits a moment for them to leave: the enqueue's NOTIFY served LISTENing
    /// workers, this serves those that hear the broker only.
    pub(crate) async fn announce(&self, schema: &crate::args::SchemaArg, wakeups: Vec<Wakeup>) -> Result<(), Failure> {
        if let Some(provider) = self.wakeup_provider(schema)? {
            provider.publish(wakeups);
            let _ = tokio::time::timeout(WAKEUP_FLUSH_WAIT, provider.flush()).await;
        }
        Ok(())
    }

    /// The URL, or a usage error saying how to give one.
    pub(crate) fn url(&self) -> Result<&str, Failure> {
        self.url
            .as_deref()
            .filter(|url| !url.is_empty())
            .ok_or_else(|| usage("no database: pass --database-url URL or set DATABASE_URL"))
    }

    /// The connection options of the URL.
    pub(crate) fn options(&self) -> Result<PgConnectOptions, Failure> {
        let url = self.url()?;
        url.parse::<PgConnectOptions>().map_err(|e| usage(format!("invalid database url: {e}")))
    }

    /// `host:port/database` of the URL, for messages.
    pub(crate) fn target(&self) -> String {
        match self.options() {
            Ok(options) => target_of(&options),
            Err(_) => "the database".to_owned(),
        }
    }

    /// A pool of at most `size` connections, once one connection could be made: refused,
    /// unreachable and misconfigured databases are reported here, each with its cause.
    /// Unreachable ones are tried again with backoff, said so on stderr, up to
    /// `CANTER_CONNECT_ATTEMPTS` tries (default 4, about 4 s).
    pub(crate) async fn pool(&self, size: u32) -> Result<PgPool, Failure> {
        self.pool_trying(size, Some(connect_attempts()), false).await
    }

    /// As [`pool`](Database::pool), for a service (a worker, a scheduler) that may start before
    /// its database: an unreachable one is waited for, `attempts` tries (the configuration's
    /// `db_retry_max_attempts`; `0`: as long as it takes) unless `CANTER_CONNECT_ATTEMPTS`
    /// says otherwise, saying so at each. A host name that does not resolve yet is waited for
    /// too (see [`Cause::UnknownHost`]).
    pub(crate) async fn service_pool(&self, size: u32, attempts: u32) -> Result<PgPool, Failure> {
        let attempts = connect_attempts_set().unwrap_or(attempts);
        self.pool_trying(size, (attempts > 0).then_some(attempts), true).await
    }

    async fn pool_trying(&self, size: u32, attempts: Option<u32>, wait_for_host: bool) -> Result<PgPool, Failure> {
        let options = self.options()?;
        let target = target_of(&options);
        let mut delay = Duration::from_millis(500);
        let mut attempt = 0u32;
        loop {
            attempt = attempt.saturating_add(1);
            let probe = match self.transaction_pooler {
                true => options.clone().extra_float_digits(None),
                false => with_session_settings(options.clone()),
            };
            let why = match tokio::time::timeout(CONNECT_TIMEOUT, probe.connect()).await {
                Ok(Ok(connection)) => {
                    // Closing is a courtesy: the pool makes its own connections.
                    let _ = tokio::time::timeout(CONNECT_TIMEOUT, connection.close()).await;
                    let url = self.url()?;
                    let pool = match self.transaction_pooler {
                        true => canter_tokio::canter::driver::connect_through_pooler(url, size),
                        false => canter_tokio::connect(url, size),
                    };
                    return pool.map_err(|e| usage(format!("invalid database url: {e}")));
                }
                Ok(Err(error)) => match cause(&error) {
                    Cause::Refused(why) => return Err(failed(format!("cannot connect to {target}: {why}"))),
                    Cause::UnknownHost(why) if !wait_for_host => {
                        return Err(failed(format!("cannot connect to {target}: {why}")));
                    }
                    Cause::Unreachable(why) | Cause::UnknownHost(why) => why,
                },
                Err(_) => format!("no answer within {}s", CONNECT_TIMEOUT.as_secs()),
            };
            if attempts.is_some_and(|limit| attempt >= limit) {
                let tries = if attempt > 1 { format!(" ({attempt} tries)") } else { String::new() };
                return Err(failed(format!("cannot connect to {target}: {why}{tries}")));
            }
            let of = attempts.map_or_else(String::new, |limit| format!("/{}", limit - 1));
            errln!("cannot connect to {target}: {why}; trying again in {:.1}s ({attempt}{of})", delay.as_secs_f64());
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(8));
        }
    }

    /// Runs `op` (a read, or a write that is safe to repeat), trying again with backoff when
    /// the database could not be reached, and says so; any other error fails at once, with
    /// [`explain`]'s advice.
    pub(crate) async fn retrying<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
        &self,
        what: &str,
        mut op: impl FnMut() -> F,
    ) -> Result<T, Failure> {
        let attempts = connect_attempts();
        let mut delay = Duration::from_millis(500);
        for attempt in 1..=attempts {
            match op().await {
                Ok(value) => return Ok(value),
                Err(error) => {
                    let text = error.to_string();
                    if !is_unreachable(&text) || attempt == attempts {
                        return Err(failed(format!("{what} failed: {}", explain(&text))));
                    }
                    errln!(
                        "{what}: {} unreachable ({}); trying again in {:.1}s ({attempt}/{})",
                        self.target(),
                        output_line(&text),
                        delay.as_secs_f64(),
                        attempts - 1
                    );
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(4));
                }
            }
        }
        Err(failed(format!("{what} failed")))
    }
}

fn output_line(text: &str) -> String {
    crate::output::printable(text).to_string()
}

/// `CANTER_CONNECT_ATTEMPTS`, default 4.
fn connect_attempts() -> u32 {
    connect_attempts_set().unwrap_or(4)
}

/// `CANTER_CONNECT_ATTEMPTS`, if set to a number (1 to 100).
fn connect_attempts_set() -> Option<u32> {
    std::env::var("CANTER_CONNECT_ATTEMPTS").ok().and_then(|a| a.trim().parse::<u32>().ok()).map(|a| a.clamp(1, 100))
}

fn target_of(options: &PgConnectOptions) -> String {
    let database = options.get_database().unwrap_or(options.get_username());
    match options.get_socket() {
        Some(socket) => format!("{} (socket) database {database}", socket.display()),
        None => format!("{}:{} database {database}", options.get_host(), options.get_port()),
    }
}

/// What a failed connection attempt says about waiting.
fn cause(error: &sqlx::Error) -> Cause {
    use std::io::ErrorKind;
    match error {
        sqlx::Error::Io(io) => match io.kind() {
            ErrorKind::ConnectionRefused => Cause::Unreachable("connection refused (is PostgreSQL running?)".into()),
            ErrorKind::TimedOut => Cause::Unreachable("connection timed out".into()),
            ErrorKind::NotFound => Cause::Refused(format!("no such host or socket ({io})")),
            // What the resolver says has no kind of its own.
            _ if io.to_string().contains("failed to lookup address") => {
                Cause::UnknownHost(format!("unknown host ({io})"))
            }
            _ => Cause::Unreachable(io.to_string()),
        },
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                "28P01" | "28000" => Cause::Refused(format!("authentication failed: {}", db.message())),
                "3D000" => Cause::Refused(format!("{} (create it, or name another in the URL)", db.message())),
                // The server is starting up or shutting down.
                "57P03" | "57P01" | "53300" => Cause::Unreachable(db.message().to_owned()),
                _ => Cause::Refused(db.message().to_owned()),
            }
        }
        sqlx::Error::Tls(tls) => Cause::Refused(format!("TLS failed: {tls}")),
        sqlx::Error::Configuration(config) => Cause::Refused(format!("invalid connection settings: {config}")),
        other => Cause::Unreachable(other.to_string()),
    }
}

/// Whether an error's text says the database could not be reached (not that it refused).
fn is_unreachable(text: &str) -> bool {
    let text = text.to_lowercase();
    ["connection refused", "timed out", "pool timed out", "connection reset", "broken pipe", "closed", "io error"]
        .iter()
        .any(|w| text.contains(w))
}

/// An error's text with what to do about it: a schema that is not there (or not migrated)
/// says to run `canter migrate`.
pub(crate) fn explain(text: &str) -> String {
    let text = &without_source_line(text);
    let lower = text.to_lowercase();
    let missing_relation = lower.contains("relation") && lower.contains("does not exist");
    let missing_schema = lower.contains("schema") && lower.contains("does not exist");
    let missing_function = lower.contains("function") && lower.contains("does not exist");
    if missing_relation || missing_schema || missing_function {
        return format!("{text}: the schema is not migrated; run canter migrate (with the same --schema)");
    }
    text.to_owned()
}

/// `text` without the ` at line N` sqlx's `Display` of a database error appends (the line of
/// PostgreSQL's own source, which says nothing to a user).
fn without_source_line(text: &str) -> String {
    let mut out = text.to_owned();
    while let Some(at) = out.find(" at line ") {
        let digits = out[at + " at line ".len()..].bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            break;
        }
        out.replace_range(at..at + " at line ".len() + digits, "");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_schema_says_to_migrate() {
        let text = explain("error returned from database: relation \"x.tasks\" does not exist");
        assert!(text.ends_with("run canter migrate (with the same --schema)"), "{text}");
        assert_eq!(explain("disk full"), "disk full");
        let text = explain("error returned from database: schema \"x\" does not exist at line 3099");
        assert!(!text.contains("at line") && text.contains("run canter migrate"), "{text}");
    }

    #[test]
    fn targets_name_host_port_and_database() {
        let database = Database {
            url: Some("postgres://me@db.example:6543/app".into()),
            listen_url: None,
            transaction_pooler: false,
            wakeups: "postgres".into(),
            wakeup_url: None,
        };
        assert_eq!(database.target(), "db.example:6543 database app");
        assert!(matches!(
            Database {
                url: None,
                listen_url: None,
                transaction_pooler: false,
                wakeups: "postgres".into(),
                wakeup_url: None
            }
            .url(),
            Err(Failure::Usage(_))
        ));
    }
}
