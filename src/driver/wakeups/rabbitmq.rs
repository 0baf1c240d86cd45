//! Wake-ups through RabbitMQ (AMQP 0-9-1, the `lapin` client).
//!
//! Publishers send each wake-up to a durable direct exchange named after the schema
//! (`canter.<schema>`), with the queue's name as routing key. Every subscribed worker has a
//! queue of its own (server-named, exclusive, deleted with its connection), bound once per
//! Canter queue it serves: every worker of a queue hears every wake-up, as with LISTEN. It
//! consumes with a bounded prefetch and acknowledges each message once its machine has it;
//! its queue drops the oldest messages past a bound and any older than a minute, so a stalled
//! worker costs the broker little. Publishing needs no confirms: the claim is the truth.

use std::sync::Arc;

use futures::future::{BoxFuture, FutureExt};
use futures::stream::{BoxStream, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

use super::WakeupProviderError;
use super::broker::{Broker, BrokerWakeups, Heard};
use crate::wake::Wakeup;

/// How many wake-ups a worker's queue hands it before it acknowledges some.
const PREFETCH: u16 = 64;

/// How many wake-ups wait in a worker's queue before the oldest are dropped.
const QUEUE_MAX_LENGTH: i32 = 1024;

/// How long a wake-up waits in a worker's queue before it is dropped, in milliseconds.
const QUEUE_MESSAGE_TTL_MS: i32 = 60_000;

/// Wake-ups through RabbitMQ. Cheap to share (`Arc`); one connection for publishing and one
/// per subscription.
pub struct RabbitMqWakeups {
    inner: BrokerWakeups<RabbitMq>,
}

impl RabbitMqWakeups {
    /// A provider for `schema`'s queues on the broker at `url` (`amqp://user:password@host:port/vhost`,
    /// the default vhost spelled `%2f`). It connects when first used.
    pub fn new(url: &str, schema: &str) -> Result<Self, WakeupProviderError> {
        url.parse::<lapin::uri::AMQPUri>().map_err(WakeupProviderError::Address)?;
        let broker = RabbitMq { url: url.to_owned(), exchange: format!("canter.{schema}") };
        Ok(RabbitMqWakeups { inner: BrokerWakeups::start(broker)? })
    }
}

super::broker::delegate_provider!(RabbitMqWakeups);

pub(crate) struct RabbitMq {
    url: String,
    exchange: String,
}

impl RabbitMq {
    /// A connection and a channel on which the exchange is declared.
    async fn open(&self) -> Result<(Connection, Channel), lapin::Error> {
        let connection = Connection::connect(&self.url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        let options = ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() };
        channel
            .exchange_declare(self.exchange.as_str().into(), ExchangeKind::Direct, options, FieldTable::default())
            .await?;
        Ok((connection, channel))
    }
}

impl Broker for RabbitMq {
    const NAME: &'static str = "rabbitmq";
    type Publisher = (Connection, Channel);

    fn connect_publisher(self: Arc<Self>) -> BoxFuture<'static, Result<Self::Publisher, String>> {
        async move {
            let (connection, channel) = self.open().await.map_err(|e| e.to_string())?;
            // Confirms, waited for only by a flush: publishing never waits for the broker.
            channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| e.to_string())?;
            Ok((connection, channel))
        }
        .boxed()
    }

    fn publish<'a>(
        &'a self,
        publisher: &'a mut Self::Publisher,
        wakeups: &'a [Wakeup],
    ) -> BoxFuture<'a, Result<(), String>> {
        async move {
            let (_, channel) = publisher;
            for wakeup in wakeups {
                channel
                    .basic_publish(
                        self.exchange.as_str().into(),
                        wakeup.queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &wakeup.encode(),
                        BasicProperties::default(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        .boxed()
    }

    fn flush<'a>(&'a self, publisher: &'a mut Self::Publisher) -> BoxFuture<'a, Result<(), String>> {
        // Every publish so far confirmed by the broker.
        async move { publisher.1.wait_for_confirms().await.map(drop).map_err(|e| e.to_string()) }.boxed()
    }

    fn subscribe(
        self: Arc<Self>,
        queues: Vec<String>,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Heard>, String>> {
        async move {
            let (connection, channel) = self.open().await.map_err(|e| e.to_string())?;
            let mut arguments = FieldTable::default();
            arguments.insert("x-max-length".into(), AMQPValue::LongInt(QUEUE_MAX_LENGTH));
            arguments.insert("x-message-ttl".into(), AMQPValue::LongInt(QUEUE_MESSAGE_TTL_MS));
            let options = QueueDeclareOptions { exclusive: true, auto_delete: true, ..QueueDeclareOptions::default() };
            let queue = channel.queue_declare("".into(), options, arguments).await.map_err(|e| e.to_string())?;
            for name in &queues {
                channel
                    .queue_bind(
                        queue.name().clone(),
                        self.exchange.as_str().into(),
                        name.as_str().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            channel.basic_qos(PREFETCH, BasicQosOptions::default()).await.map_err(|e| e.to_string())?;
            let consumer = channel
                .basic_consume(queue.name().clone(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
                .await
                .map_err(|e| e.to_string())?;
            // The stream keeps the connection open while it lives; an error of the consumer
            // (the connection lost) ends it.
            let heard =
                consumer.take_while(|delivery| futures::future::ready(delivery.is_ok())).filter_map(move |delivery| {
                    let _connection = &connection;
                    let heard = delivery.ok().map(|mut delivery| {
                        let bytes = std::mem::take(&mut delivery.data);
                        let ack = async move {
                            let _ = delivery.ack(BasicAckOptions::default()).await;
                        };
                        Heard::Message(bytes, Some(ack.boxed()))
                    });
                    futures::future::ready(heard)
                });
            Ok(heard.boxed())
        }
        .boxed()
    }
}
