//! Wake-up providers: where a worker hears that tasks became claimable, besides PostgreSQL's
//! LISTEN/NOTIFY (the default, run by the worker service itself) and polling.
//!
//! A [`WakeupProvider`] publishes [`Wakeup`]s for the tasks a [`Client`](super::Client)
//! enqueued (after the commit, from a statement that sent no NOTIFY) and delivers them to
//! subscribed workers as [`Input`]s for their machines. Two are built in, behind features:
//! RabbitMQ ([`RabbitMqWakeups`], `rabbitmq`) and NATS ([`NatsWakeups`], `nats`). Anyone can
//! write another: the machine only ever sees `Input::Notified` and `Input::Listener`.
//!
//! What a provider carries is a hint: the claim in PostgreSQL stays the only truth, so a lost,
//! repeated, late or reordered wake-up changes nothing but latency. The built-in providers run
//! their broker client on a thread of their own (a small tokio runtime), so they work under
//! any runtime, and reconnect with backoff. A worker listens while its provider and its
//! PostgreSQL listener are both connected ([`WakeSources`](crate::wake::WakeSources)); when
//! either comes back it claims at once, as after a lost LISTEN session.

use futures::future::BoxFuture;
use futures::stream::BoxStream;

use crate::wake::Wakeup;
use crate::worker::Input;

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod broker;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;

#[cfg(feature = "nats")]
pub use nats::NatsWakeups;
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::RabbitMqWakeups;

/// A source and sink of wake-ups other than PostgreSQL's LISTEN/NOTIFY.
pub trait WakeupProvider: Send + Sync + 'static {
    /// A short name for logs ("rabbitmq", "nats").
    fn name(&self) -> &'static str;

    /// Hands `wakeups` over to be published and returns at once, without waiting for the
    /// broker. Call it after the enqueue committed. A wake-up that cannot be published (the
    /// broker unreachable, the outbox full) is dropped and counted, as a hint may be.
    fn publish(&self, wakeups: Vec<Wakeup>);

    /// The wake-ups of `queues` from now on, as the worker machine's inputs: one
    /// `Input::Notified` per wake-up heard, and `Input::Listener` each time the subscription
    /// is up or lost (it reconnects with backoff by itself). It ends only when dropped.
    fn subscribe(&self, queues: Vec<String>) -> BoxStream<'static, Input>;

    /// Resolves once everything handed over before has been published or dropped: call it
    /// before a process that enqueued exits (bound the wait: a broker that is down keeps it).
    fn flush(&self) -> BoxFuture<'static, ()>;

    /// What it published, dropped and heard so far.
    fn stats(&self) -> WakeupStats;
}

/// Counts of a provider's work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WakeupStats {
    /// Wake-ups handed to the broker.
    pub published: u64,
    /// Wake-ups not published: the outbox was full, or the broker refused them or was down.
    pub dropped: u64,
    /// Wake-ups heard by subscriptions.
    pub heard: u64,
    /// Messages heard that were no wake-up (left out, each alone).
    pub malformed: u64,
}

/// Why a provider could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WakeupProviderError {
    /// Its thread or runtime could not be started.
    #[error("the wake-up provider's thread could not start: {0}")]
    Thread(#[from] std::io::Error),
    /// Its address is not one it understands.
    #[error(
        "a wake-up provider address that is not valid ({0}), expected e.g. amqp://host:5672/%2f or nats://host:4222"
    )]
    Address(String),
}
