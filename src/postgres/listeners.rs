//! Registered listeners: statements notify a channel only while a session listening on it is
//! registered (migration 0008), because every committing transaction that sent a NOTIFY waits
//! for the one before it (PostgreSQL's notification queue lock).
//!
//! The calling contract, for every session that LISTENs: LISTEN, then
//! [`register_listener`] with the same channels, then read what the session waits for; after a
//! reconnect (a new session) the same again. A notifying statement reads the registrations in
//! its own text, so it holds a lock on them from before its snapshot to its commit, and a
//! registration waits for such statements in flight and holds back new ones until it commits:
//! whatever committed without notifying, the first read after the registration sees.

use sqlx::postgres::PgListener;

use crate::postgres::schema::{LOCK_NOT_AVAILABLE, PgSchema, sqlstate};

/// How many times a registration is tried: each try waits at most 250 ms for the statements
/// in flight that read the registrations (its `lock_timeout`), which paces the tries.
const REGISTER_TRIES: u32 = 20;

/// Registers `listener`'s session as the listener of `channels` in `schema`, replacing its
/// earlier registration, and deletes those of sessions that ended. Call it after LISTEN and
/// before the first read, and again after every reconnect.
pub async fn register_listener(
    listener: &mut PgListener,
    schema: &PgSchema,
    channels: &[String],
) -> Result<(), sqlx::Error> {
    let mut tries = 0;
    loop {
        tries += 1;
        let registered = schema.sql().register_listener.query().bind(channels).execute(&mut *listener).await;
        match registered {
            Err(error) if tries < REGISTER_TRIES && sqlstate(&error).as_deref() == Some(LOCK_NOT_AVAILABLE) => {}
            other => return other.map(|_| ()),
        }
    }
}

/// Deletes the registrations of `listener`'s session, before it goes back to a pool. Needs no
/// lock: a statement that still sees them only notifies for nobody.
pub async fn unregister_listener(listener: &mut PgListener, schema: &PgSchema) -> Result<(), sqlx::Error> {
    schema.sql().unregister_listener.query().execute(&mut *listener).await.map(|_| ())
}
