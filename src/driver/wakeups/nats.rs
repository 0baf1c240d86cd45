//! Wake-ups through NATS (core NATS, the `async-nats` client).
//!
//! Each wake-up is published on the subject `canter.<schema>.<queue>`, the queue's name in hex
//! ([`queue_token`]: subjects allow no spaces, dots or wildcards in a token), and every worker
//! of the queue subscribes to it: every worker hears every wake-up, as with LISTEN. Core NATS
//! delivers at most once, which is all a hint needs; JetStream's persistence would add a
//! stream and acknowledgements for nothing the claim does not already guarantee. The client
//! reconnects by itself and subscribes again; the worker is told it was deaf meanwhile.

use std::sync::Arc;

use futures::future::{BoxFuture, FutureExt};
use futures::stream::{BoxStream, StreamExt};

use super::WakeupProviderError;
use super::broker::{Broker, BrokerWakeups, Heard};
use crate::wake::{Wakeup, queue_token};

/// Wake-ups through NATS. Cheap to share (`Arc`); one connection for publishing and one per
/// subscription.
pub struct NatsWakeups {
    inner: BrokerWakeups<Nats>,
}

impl NatsWakeups {
    /// A provider for `schema`'s queues on the server at `url` (`nats://host:4222`, or a
    /// comma-separated list). It connects when first used.
    pub fn new(url: &str, schema: &str) -> Result<Self, WakeupProviderError> {
        use async_nats::ServerAddr;
        for server in url.split(',') {
            server.trim().parse::<ServerAddr>().map_err(|e| WakeupProviderError::Address(e.to_string()))?;
        }
        let broker = Nats { url: url.to_owned(), prefix: format!("canter.{schema}.") };
        Ok(NatsWakeups { inner: BrokerWakeups::start(broker)? })
    }
}

super::broker::delegate_provider!(NatsWakeups);

pub(crate) struct Nats {
    url: String,
    prefix: String,
}

impl Nats {
    fn subject(&self, queue: &str) -> String {
        format!("{}{}", self.prefix, queue_token(queue))
    }
}

/// What a subscription's client hears besides messages.
enum Event {
    Message(Vec<u8>),
    Connected(bool),
    Closed,
}

impl Broker for Nats {
    const NAME: &'static str = "nats";
    type Publisher = async_nats::Client;

    fn connect_publisher(self: Arc<Self>) -> BoxFuture<'static, Result<Self::Publisher, String>> {
        async move { async_nats::connect(self.url.as_str()).await.map_err(|e| e.to_string()) }.boxed()
    }

    fn publish<'a>(
        &'a self,
        publisher: &'a mut Self::Publisher,
        wakeups: &'a [Wakeup],
    ) -> BoxFuture<'a, Result<(), String>> {
        async move {
            for wakeup in wakeups {
                publisher
                    .publish(self.subject(&wakeup.queue), wakeup.encode().into())
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        .boxed()
    }

    fn flush<'a>(&'a self, publisher: &'a mut Self::Publisher) -> BoxFuture<'a, Result<(), String>> {
        // A round trip to the server: everything written before has reached it.
        async move { publisher.flush().await.map_err(|e| e.to_string()) }.boxed()
    }

    fn subscribe(
        self: Arc<Self>,
        queues: Vec<String>,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Heard>, String>> {
        async move {
            let (events_tx, events_rx) = futures::channel::mpsc::unbounded::<Event>();
            let options = async_nats::ConnectOptions::new().event_callback(move |event| {
                let state = match event {
                    async_nats::Event::Connected => Some(Event::Connected(true)),
                    async_nats::Event::Disconnected => Some(Event::Connected(false)),
                    async_nats::Event::Closed => Some(Event::Closed),
                    _ => None,
                };
                if let Some(state) = state {
                    let _ = events_tx.unbounded_send(state);
                }
                async {}
            });
            let client = options.connect(self.url.as_str()).await.map_err(|e| e.to_string())?;
            let mut subscribers = Vec::with_capacity(queues.len());
            for queue in &queues {
                subscribers.push(client.subscribe(self.subject(queue)).await.map_err(|e| e.to_string())?);
            }
            // Subscribed once the server has seen the subscriptions: wake-ups published from
            // then on are heard.
            client.flush().await.map_err(|e| e.to_string())?;
            let messages =
                futures::stream::select_all(subscribers).map(|message| Event::Message(message.payload.to_vec()));
            let heard = futures::stream::select(messages, events_rx)
                .take_while(|event| futures::future::ready(!matches!(event, Event::Closed)))
                .filter_map(move |event| {
                    // The stream keeps the client, and so the connection, while it lives.
                    let _client = &client;
                    futures::future::ready(match event {
                        Event::Message(bytes) => Some(Heard::Message(bytes, None)),
                        Event::Connected(connected) => Some(Heard::Connected(connected)),
                        Event::Closed => None,
                    })
                });
            Ok(heard.boxed())
        }
        .boxed()
    }
}
