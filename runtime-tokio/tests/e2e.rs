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
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let db = pg::TestDb::new().await;
            let pool = db.pool(20).await;
            body::$name(Arc::new(TokioRuntime), pool, db.schema.clone()).await;
        }
    };
}

every_scenario!(scenario);

/// The suite with the wake-ups of each broker provider.
macro_rules! with_provider {
    ($provider:ident) => {
        mod $provider {
            use super::*;

            macro_rules! scenario {
                ($name:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        let db = pg::TestDb::new().await;
                        let pool = db.pool(20).await;
                        body::use_wakeups(&db.schema, brokers::$provider(&db.schema));
                        body::$name(Arc::new(TokioRuntime), pool, db.schema.clone()).await;
                    }
                };
            }

            every_scenario!(scenario);
            every_provider_scenario!(scenario);
        }
    };
}

with_provider!(rabbitmq);
with_provider!(nats);
