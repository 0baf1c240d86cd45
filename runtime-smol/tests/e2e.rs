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
        scenario!($name, None);
    };
    ($name:ident, $wakeups:expr) => {
        #[test]
        fn $name() {
            smol::block_on(async {
                let (db, pool) = body::prepare($wakeups).await;
                body::$name(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
            })
        }
    };
}

every_scenario!(scenario);

with_every_provider!();

/// async-std's executor shares async-io with smol: the smol adapter's worker runs from it.
#[test]
fn a_worker_runs_under_async_std() {
    async_std::task::block_on(async {
        let (db, pool) = body::prepare(None).await;
        body::failures_end_with_their_codes(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
    })
}
