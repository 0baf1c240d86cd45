//! The message brokers the wake-up providers' tests use: the machine's RabbitMQ and NATS, or
//! those `CANTER_TEST_RABBITMQ_URL` and `CANTER_TEST_NATS_URL` name. A test fails when its
//! broker is down (`.ci/run` starts them): it never skips.

#![allow(dead_code)]

use std::sync::Arc;

use canter::driver::wakeups::{NatsWakeups, RabbitMqWakeups, WakeupProvider};
use canter::postgres::PgSchema;

pub fn rabbitmq_url() -> String {
    std::env::var("CANTER_TEST_RABBITMQ_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

pub fn nats_url() -> String {
    std::env::var("CANTER_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// RabbitMQ wake-ups for `schema`.
pub fn rabbitmq(schema: &PgSchema) -> Arc<dyn WakeupProvider> {
    Arc::new(RabbitMqWakeups::new(&rabbitmq_url(), schema.name()).expect("a RabbitMQ provider"))
}

/// NATS wake-ups for `schema`.
pub fn nats(schema: &PgSchema) -> Arc<dyn WakeupProvider> {
    Arc::new(NatsWakeups::new(&nats_url(), schema.name()).expect("a NATS provider"))
}
