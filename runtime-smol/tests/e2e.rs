//! The shared end-to-end suite on smol, against PostgreSQL (one schema per test), and one
//! scenario under async-std's executor.

#[path = "../../tests/common/pg.rs"]
mod pg;

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

/// async-std's executor shares async-io with smol: the smol adapter's worker runs from it.
#[test]
fn a_worker_runs_under_async_std() {
    async_std::task::block_on(async {
        let db = pg::TestDb::new().await;
        let pool = db.pool(20).await;
        body::failures_end_with_their_codes(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
    })
}
