//! The shared end-to-end suite on tokio, against PostgreSQL (one schema per test).

#[path = "../../tests/common/pg.rs"]
mod pg;

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
