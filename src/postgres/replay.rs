//! Statements whose connection died: sent again on another connection when that is safe.
//!
//! A session can end under a statement: an operator or a pooler ran `pg_terminate_backend`,
//! the server restarted, a failover moved the primary, a connection sat idle past a firewall's
//! timeout. What the client then knows decides what may be done:
//!
//! - the server said so (a `FATAL` error in place of the reply, such as 57P01 `terminating
//!   connection due to administrator command`): the statement did not commit. PostgreSQL ends a
//!   session only between commands or by aborting the one it runs, and after a commit it sends
//!   the reply before it would send the error (when it cannot, during a synchronous-replication
//!   wait, it closes without one: a lost reply). Any statement is sent again;
//! - the connection broke with no word from the server (end of stream, reset, a TLS failure):
//!   the reply is lost and the statement may or may not have committed. Only a [`Replay::Safe`]
//!   statement is sent again; any other fails as [`ReplayError::unknown_outcome`] says.
//!
//! Each try takes another connection, and the dead one is closed rather than handed back to
//! the pool: connections that sat idle in the pool when their sessions were ended fail at once
//! (the server's error is already waiting in the socket), so there are at most as many tries as
//! the store holds connections (the pool's and the kept ones), and one more.
//!
//! A write sent again after a lost reply has its effect once, but its answer is the second
//! try's: a pause that had paused says the queue was paused already, a force-unlock or purge
//! counts only what the second try did. When no try gets an answer, a safe write's error is
//! the last try's, and the first may have committed. No try waits before it is sent: a session
//! that ended is not an outage, and when the server is really gone, getting a connection is
//! what fails (and what the caller's backoff is for).

use sqlx::postgres::{PgDatabaseError, PgSeverity};

use crate::postgres::store::{PgStore, StoreConnection};

/// Whether a statement may be sent again after its reply was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Replay {
    /// A read, or a write whose effect is the same applied twice (an idempotency key, a pause):
    /// sent again after a lost reply too (see the module docs for what it then answers).
    Safe,
    /// Any other write: sent again only when the server said it did not apply it; after a lost
    /// reply it fails with an error saying it may or may not have committed.
    IfNotApplied,
}

/// An error a statement can fail with, as the replay reads it.
pub(crate) trait ReplayError: From<sqlx::Error> {
    /// The database's error inside it, if the database (or the connection) failed.
    fn database(&self) -> Option<&sqlx::Error>;

    /// The error to return when the reply of a write that is not [`Replay::Safe`] was lost: by
    /// default itself (the caller maps a lost reply on its own).
    fn unknown_outcome(self) -> Self {
        self
    }
}

impl ReplayError for sqlx::Error {
    fn database(&self) -> Option<&sqlx::Error> {
        Some(self)
    }
}

/// [`ReplayError`] for an error enum with a `Database(sqlx::Error)` variant, what a replay reads,
/// and an `OutcomeUnknown(sqlx::Error)` one, what a lost reply of a write becomes.
macro_rules! replay_error_with_unknown_outcome {
    ($error:ident) => {
        impl $crate::postgres::replay::ReplayError for $error {
            fn database(&self) -> Option<&sqlx::Error> {
                match self {
                    $error::Database(error) => Some(error),
                    _ => None,
                }
            }

            fn unknown_outcome(self) -> Self {
                match self {
                    $error::Database(error) => $error::OutcomeUnknown(error),
                    other => other,
                }
            }
        }
    };
}
pub(crate) use replay_error_with_unknown_outcome;

/// Whether the server ended the session in place of a reply (a `FATAL` error): the statement did
/// not commit, and the connection is gone. (A `PANIC` is not counted: crash recovery may find
/// the commit; it is followed by a broken connection, a lost reply.)
pub(crate) fn session_ended(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(error) = error else { return false };
    error.try_downcast_ref::<PgDatabaseError>().is_some_and(|error| error.severity() == PgSeverity::Fatal)
}

/// Whether the connection failed after the statement was handed to it, with no word from the
/// server: the statement may or may not have been applied.
/// (`Protocol` is not counted: the store raises it itself for replies it cannot use.)
pub(crate) fn reply_lost(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed)
}

/// Sends `$statement`, a future of a statement on the connection `$conn`, on a connection of
/// `$store` (kept for the next statement when it succeeds); again on another one when its
/// session ended before it was applied, or when its reply was lost and the [`Replay`] is
/// [`Replay::Safe`] (see the module docs). Evaluates to the statement's `Result`; a failure to
/// get a connection converts into its error type. With an error type after the [`Replay`], the
/// statement's `sqlx::Error` converts into it first. (A macro rather than a function taking an
/// async closure: the futures of those cannot be shown to be `Send`.)
macro_rules! replayed {
    ($store:expr, $replay:expr, $error:ty, |$conn:ident| $statement:expr) => {
        $crate::postgres::replay::replayed!($store, $replay, |$conn| async { $statement.await.map_err(<$error>::from) })
    };
    ($store:expr, $replay:expr, |$conn:ident| $statement:expr) => {
        $crate::postgres::replay::replayed!(@transaction true, $store, $replay, |$conn| $statement)
    };
    // `$own_transaction`: through a pooler in transaction mode, in a transaction of its own (a
    // statement that cannot run in one, such as VACUUM, passes false).
    (@transaction $own_transaction:expr, $store:expr, $replay:expr, |$conn:ident| $statement:expr) => {
        $crate::postgres::replay::replayed!(@lane $crate::postgres::store::Lane::Shared, @transaction $own_transaction, $store, $replay, |$conn| $statement)
    };
    // `$lane`: which connections it may take (see `Lane`).
    (@lane $lane:expr, @transaction $own_transaction:expr, $store:expr, $replay:expr, |$conn:ident| $statement:expr) => {{
        let store: &$crate::postgres::PgStore = $store;
        let own_transaction = $own_transaction && store.schema().is_transaction_pooled();
        let mut tries = $crate::postgres::replay::Tries::new(store, $replay);
        loop {
            let mut held = match store.connection($lane).await {
                Ok(held) => held,
                Err(error) => break Err(error.into()),
            };
            let result =
                $crate::postgres::replay::in_own_transaction!(own_transaction, &mut *held, |$conn| $statement);
            match tries.settle(store, held, result) {
                Ok(Some(done)) => break Ok(done),
                Ok(None) => continue,
                Err(error) => break Err(error),
            }
        }
    }};
}
pub(crate) use replayed;

/// Evaluates `$statement`, a future of statements on the connection `$conn`, on `$held` (a
/// `&mut PgConnection`): when `$pooled`, in a transaction of its own begun with
/// [`pooled_begin`](crate::postgres::store::pooled_begin) (the session settings, set locally)
/// and committed if it succeeds, rolled back if not; otherwise as it is. Through a pooler in
/// transaction mode a statement outside a transaction may have its two rounds (parse, then
/// bind and execute) sent to two server sessions.
macro_rules! in_own_transaction {
    ($pooled:expr, $held:expr, |$conn:ident| $statement:expr) => {
        if $pooled {
            match sqlx::Connection::begin_with($held, $crate::postgres::store::pooled_begin()).await {
                Err(error) => Err(error.into()),
                Ok(mut transaction) => {
                    let done = {
                        let $conn: &mut sqlx::PgConnection = &mut transaction;
                        $statement.await
                    };
                    match done {
                        Ok(value) => transaction.commit().await.map(|()| value).map_err(Into::into),
                        Err(error) => {
                            // A broken connection cannot roll back; the server does.
                            let _ = transaction.rollback().await;
                            Err(error)
                        }
                    }
                }
            }
        } else {
            let $conn: &mut sqlx::PgConnection = $held;
            $statement.await
        }
    };
}
pub(crate) use in_own_transaction;

/// The tries of one statement under [`replayed`].
pub(crate) struct Tries {
    replay: Replay,
    left: u32,
}

impl Tries {
    /// As many tries as `store` holds connections, and one more.
    pub(crate) fn new(store: &PgStore, replay: Replay) -> Tries {
        Tries { replay, left: store.max_connections().saturating_add(1) }
    }

    /// What comes of a try that had `conn`: `Some` answer (and `conn` kept), `None` to try again
    /// on another connection (and `conn` closed), or the error to return.
    pub(crate) fn settle<T, E: ReplayError>(
        &mut self,
        store: &PgStore,
        conn: StoreConnection,
        result: Result<T, E>,
    ) -> Result<Option<T>, E> {
        let error = match result {
            Ok(done) => {
                store.keep(conn);
                return Ok(Some(done));
            }
            Err(error) => error,
        };
        let (ended, lost) = error.database().map_or((false, false), |e| (session_ended(e), reply_lost(e)));
        if !(ended || lost) {
            return Err(error);
        }
        // Closed, not handed back: the next try takes another connection.
        close_dead(conn);
        if lost && self.replay == Replay::IfNotApplied {
            return Err(error.unknown_outcome());
        }
        self.left = self.left.saturating_sub(1);
        if self.left == 0 {
            return Err(error);
        }
        Ok(None)
    }
}

/// Closes a connection whose session is gone instead of handing it back to the pool.
fn close_dead(conn: StoreConnection) {
    match conn {
        StoreConnection::Kept(conn) | StoreConnection::Urgent(conn) => drop(conn),
        StoreConnection::Pooled(conn) => drop(conn.detach()),
    }
}
