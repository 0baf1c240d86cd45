//! What the built-in providers share: a thread of their own for the broker client, the
//! outbox and its publisher task, subscriptions and their reconnects.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};

use super::{WakeupProviderError, WakeupStats};
use crate::config::ResilienceConfig;
use crate::driver::retry::Retry;
use crate::wake::Wakeup;
use crate::worker::Input;

/// How many batches of wake-ups wait to be published before more are dropped.
const OUTBOX: usize = 1024;

/// How many inputs a subscription holds for a worker that does not take them (more are
/// dropped: wake-ups of a queue coalesce anyway).
const HEARD_BUFFER: usize = 256;

/// What a subscription hears from its broker.
pub(crate) enum Heard {
    /// A message, and what acknowledges it (when the broker wants acknowledgements).
    Message(Vec<u8>, Option<BoxFuture<'static, ()>>),
    /// The connection was lost (`false`) and the client reconnected by itself (`true`).
    Connected(bool),
}

/// The part of a provider that speaks to its broker: connecting, publishing, subscribing.
pub(crate) trait Broker: Send + Sync + 'static {
    /// The provider's name.
    const NAME: &'static str;
    /// A connection to publish on.
    type Publisher: Send + 'static;
    /// Connects to publish.
    fn connect_publisher(self: Arc<Self>) -> BoxFuture<'static, Result<Self::Publisher, String>>;
    /// Publishes `wakeups` (an error: the publisher is dropped and connected again).
    fn publish<'a>(
        &'a self,
        publisher: &'a mut Self::Publisher,
        wakeups: &'a [Wakeup],
    ) -> BoxFuture<'a, Result<(), String>>;
    /// Returns once what was published on `publisher` has reached the broker.
    fn flush<'a>(&'a self, publisher: &'a mut Self::Publisher) -> BoxFuture<'a, Result<(), String>>;
    /// Subscribes to `queues`: what it hears, ending when the connection is gone for good.
    fn subscribe(self: Arc<Self>, queues: Vec<String>)
    -> BoxFuture<'static, Result<BoxStream<'static, Heard>, String>>;
}

/// `impl WakeupProvider` for a provider whose `inner` is a [`BrokerWakeups`].
macro_rules! delegate_provider {
    ($provider:ty) => {
        impl super::WakeupProvider for $provider {
            fn name(&self) -> &'static str {
                self.inner.name()
            }

            fn publish(&self, wakeups: Vec<crate::wake::Wakeup>) {
                self.inner.publish(wakeups);
            }

            fn subscribe(&self, queues: Vec<String>) -> futures::stream::BoxStream<'static, crate::worker::Input> {
                self.inner.subscribe(queues)
            }

            fn flush(&self) -> futures::future::BoxFuture<'static, ()> {
                self.inner.flush()
            }

            fn stats(&self) -> super::WakeupStats {
                self.inner.stats()
            }
        }
    };
}
pub(crate) use delegate_provider;

/// What the outbox holds.
enum Outgoing {
    /// Wake-ups to publish.
    Wakeups(Vec<Wakeup>),
    /// Answered once what came before is published or dropped.
    Flush(futures::channel::oneshot::Sender<()>),
}

/// A thread running a small tokio runtime for a broker client's I/O; it stops when dropped
/// (its tasks with it).
struct Host {
    handle: tokio::runtime::Handle,
    stop: Option<futures::channel::oneshot::Sender<()>>,
}

impl Host {
    fn start(name: &str) -> Result<Host, std::io::Error> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = futures::channel::oneshot::channel::<()>();
        std::thread::Builder::new().name(format!("canter-{name}")).spawn(move || {
            let _ = runtime.block_on(stopped);
        })?;
        Ok(Host { handle, stop: Some(stop) })
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[derive(Default)]
struct Counts {
    published: AtomicU64,
    dropped: AtomicU64,
    heard: AtomicU64,
    malformed: AtomicU64,
}

/// A provider over a [`Broker`]: the outbox and its publisher task, subscriptions and their
/// reconnects, shared by every broker.
pub(crate) struct BrokerWakeups<B: Broker> {
    broker: Arc<B>,
    outbox: tokio::sync::mpsc::Sender<Outgoing>,
    counts: Arc<Counts>,
    // Last: dropped after everything that spawns on it.
    host: Host,
}

impl<B: Broker> BrokerWakeups<B> {
    pub(crate) fn start(broker: B) -> Result<Self, WakeupProviderError> {
        let host = Host::start(B::NAME)?;
        let broker = Arc::new(broker);
        let counts = Arc::new(Counts::default());
        let (outbox, pending) = tokio::sync::mpsc::channel(OUTBOX);
        host.handle.spawn(publish_loop(broker.clone(), pending, counts.clone()));
        Ok(BrokerWakeups { broker, outbox, counts, host })
    }

    pub(crate) fn name(&self) -> &'static str {
        B::NAME
    }

    pub(crate) fn publish(&self, wakeups: Vec<Wakeup>) {
        if wakeups.is_empty() {
            return;
        }
        let n = wakeups.len() as u64;
        if self.outbox.try_send(Outgoing::Wakeups(wakeups)).is_err() {
            self.counts.dropped.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn flush(&self) -> BoxFuture<'static, ()> {
        let (done, flushed) = futures::channel::oneshot::channel();
        let outbox = self.outbox.clone();
        Box::pin(async move {
            // A closed outbox (the host stopped) has nothing left to publish.
            if outbox.send(Outgoing::Flush(done)).await.is_ok() {
                let _ = flushed.await;
            }
        })
    }

    pub(crate) fn subscribe(&self, queues: Vec<String>) -> BoxStream<'static, Input> {
        let (heard_tx, heard_rx) = futures::channel::mpsc::channel::<Input>(HEARD_BUFFER);
        let (cancel, cancelled) = futures::channel::oneshot::channel::<()>();
        let subscription = subscribe_loop(self.broker.clone(), queues, heard_tx, self.counts.clone());
        self.host.handle.spawn(async move {
            // Ends when the stream below is dropped (its cancel sender with it).
            futures::future::select(Box::pin(subscription), cancelled).await;
        });
        // The stream owns the cancel sender: dropping it stops the subscription.
        heard_rx
            .map(move |input| {
                let _owner = &cancel;
                input
            })
            .boxed()
    }

    pub(crate) fn stats(&self) -> WakeupStats {
        WakeupStats {
            published: self.counts.published.load(Ordering::Relaxed),
            dropped: self.counts.dropped.load(Ordering::Relaxed),
            heard: self.counts.heard.load(Ordering::Relaxed),
            malformed: self.counts.malformed.load(Ordering::Relaxed),
        }
    }
}

/// The backoff of a provider's reconnects: the database's (`ResilienceConfig`'s defaults).
/// A loop's backoff: the database's (`ResilienceConfig`'s defaults), its jitter drawn from the
/// process id and a count, so that the workers of a fleet do not reconnect in step.
fn reconnects() -> Retry {
    static LOOPS: AtomicU64 = AtomicU64::new(0);
    let seed = crate::rng::mix(u64::from(std::process::id()) << 32 ^ LOOPS.fetch_add(1, Ordering::Relaxed));
    Retry::new(&ResilienceConfig::default(), seed)
}

/// How long a subscription must have lived for its loss to reset the backoff: one lost as soon
/// as it is made counts as a failure (a broker that takes connections and drops them).
const SUBSCRIBED_A_WHILE: Duration = Duration::from_secs(5);

/// Publishes what the outbox holds, connecting (again) with backoff when needed. Batches that
/// wait while the broker is down are sent when it is back (a late wake-up still wakes); a batch
/// whose publish failed is dropped.
async fn publish_loop<B: Broker>(
    broker: Arc<B>,
    mut pending: tokio::sync::mpsc::Receiver<Outgoing>,
    counts: Arc<Counts>,
) {
    let mut retry = reconnects();
    let mut publisher: Option<B::Publisher> = None;
    while let Some(outgoing) = pending.recv().await {
        let batch = match outgoing {
            Outgoing::Wakeups(batch) => batch,
            Outgoing::Flush(done) => {
                // What was published has reached the broker (a client may exit next).
                if let Some(connected) = publisher.as_mut()
                    && let Err(error) = broker.flush(connected).await
                {
                    tracing::warn!(target: "canter::wakeups", provider = B::NAME, %error, "flushing wake-ups failed");
                    publisher = None;
                }
                let _ = done.send(());
                continue;
            }
        };
        let n = batch.len() as u64;
        if publisher.is_none() {
            match broker.clone().connect_publisher().await {
                Ok(connected) => publisher = Some(connected),
                Err(error) => {
                    counts.dropped.fetch_add(n, Ordering::Relaxed);
                    let delay = retry.failed();
                    tracing::warn!(target: "canter::wakeups", provider = B::NAME, %error, ?delay, "cannot publish wake-ups; connecting again");
                    tokio::time::sleep(delay).await;
                    continue;
                }
            }
        }
        let Some(connected) = publisher.as_mut() else { continue };
        match broker.publish(connected, &batch).await {
            Ok(()) => {
                // Only a publish that went through proves the connection.
                retry.succeeded();
                counts.published.fetch_add(n, Ordering::Relaxed);
            }
            Err(error) => {
                counts.dropped.fetch_add(n, Ordering::Relaxed);
                let delay = retry.failed();
                tracing::warn!(target: "canter::wakeups", provider = B::NAME, %error, ?delay, "publishing wake-ups failed; connecting again");
                publisher = None;
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Subscribes, forwards what it hears as inputs, and subscribes again with backoff when the
/// connection is lost. Returns when the worker is gone (its receiver dropped).
async fn subscribe_loop<B: Broker>(
    broker: Arc<B>,
    queues: Vec<String>,
    mut heard_tx: futures::channel::mpsc::Sender<Input>,
    counts: Arc<Counts>,
) {
    let mut retry = reconnects();
    loop {
        match broker.clone().subscribe(queues.clone()).await {
            Ok(mut heard) => {
                let since = tokio::time::Instant::now();
                if futures::SinkExt::send(&mut heard_tx, Input::Listener { connected: true }).await.is_err() {
                    return;
                }
                // Clients report their first connection too: only changes are passed on.
                let mut listening = true;
                while let Some(next) = heard.next().await {
                    let input = match next {
                        Heard::Connected(connected) if connected == listening => continue,
                        Heard::Connected(connected) => {
                            listening = connected;
                            Input::Listener { connected }
                        }
                        Heard::Message(bytes, ack) => {
                            let wakeup = Wakeup::decode(&bytes);
                            if let Some(ack) = ack {
                                ack.await;
                            }
                            match wakeup {
                                Ok(wakeup) => {
                                    counts.heard.fetch_add(1, Ordering::Relaxed);
                                    wakeup.into_input()
                                }
                                Err(error) => {
                                    counts.malformed.fetch_add(1, Ordering::Relaxed);
                                    tracing::warn!(target: "canter::wakeups", provider = B::NAME, %error, "a message that is no wake-up, left out");
                                    continue;
                                }
                            }
                        }
                    };
                    // A full buffer drops a wake-up (they coalesce), never a change of state.
                    let gone = if matches!(input, Input::Listener { .. }) {
                        futures::SinkExt::send(&mut heard_tx, input).await.is_err()
                    } else {
                        heard_tx.try_send(input).is_err_and(|e| e.is_disconnected())
                    };
                    if gone {
                        return;
                    }
                }
                if futures::SinkExt::send(&mut heard_tx, Input::Listener { connected: false }).await.is_err() {
                    return;
                }
                if since.elapsed() >= SUBSCRIBED_A_WHILE {
                    retry.succeeded();
                }
                tracing::warn!(target: "canter::wakeups", provider = B::NAME, "the wake-up subscription was lost; subscribing again");
            }
            Err(error) => {
                tracing::warn!(target: "canter::wakeups", provider = B::NAME, %error, "cannot subscribe to wake-ups; trying again");
            }
        }
        if heard_tx.is_closed() {
            return;
        }
        let delay: Duration = retry.failed();
        tokio::time::sleep(delay).await;
    }
}
