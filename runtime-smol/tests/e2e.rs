//! The shared end-to-end suite on smol, against PostgreSQL (one schema per test): with
//! LISTEN/NOTIFY, then with RabbitMQ's and NATS's wake-ups; and one scenario under async-std's
//! executor.

#[path = "../../tests/common/pg.rs"]
mod pg;

#[path = "../../tests/common/brokers.rs"]
mod brokers;

#[macro_use]
#[path = "../../tests/e2e/body.rs"]
mod body;

use std::sync::Arc;

use canter_smol::SmolRuntime;

macro_rules! scenario {
    ($name:ident) => {
        #[test]
        fn $name() {
            smol::block_on(async {
                let db = pg::TestDb::new().await;
                let pool = db.pool(20).await;
                body::$name(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
            })
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
                    #[test]
                    fn $name() {
                        smol::block_on(async {
                            let db = pg::TestDb::new().await;
                            let pool = db.pool(20).await;
                            body::use_wakeups(&db.schema, brokers::$provider(&db.schema));
                            body::$name(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
                        })
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

/// async-std's executor shares async-io with smol: the smol adapter's worker runs from it.
#[test]
fn a_worker_runs_under_async_std() {
    async_std::task::block_on(async {
        let db = pg::TestDb::new().await;
        let pool = db.pool(20).await;
        body::failures_end_with_their_codes(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
    })
}
