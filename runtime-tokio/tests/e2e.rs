//! The shared end-to-end suite on tokio, against PostgreSQL (one schema per test): with
//! LISTEN/NOTIFY, then with RabbitMQ's and NATS's wake-ups.

#[path = "../../tests/common/pg.rs"]
mod pg;

#[path = "../../tests/common/brokers.rs"]
mod brokers;

#[macro_use]
#[path = "../../tests/e2e/body.rs"]
mod body;

use std::sync::Arc;

use canter_tokio::TokioRuntime;

macro_rules! scenario {
    ($name:ident) => {
        scenario!($name, None);
    };
    ($name:ident, $wakeups:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let (db, pool) = body::prepare($wakeups).await;
            body::$name(Arc::new(TokioRuntime), pool, db.schema.clone()).await;
        }
    };
}

every_scenario!(scenario);

with_every_provider!();
