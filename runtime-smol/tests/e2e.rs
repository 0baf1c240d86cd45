//! The shared end-to-end suite on smol, against PostgreSQL (one schema per test), and one
//! scenario under async-std's executor.

#[path = "../../tests/common/pg.rs"]
mod pg;

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

scenario!(many_tasks_through_several_workers);
scenario!(caps_hold_under_load);
scenario!(failures_end_with_their_codes);
scenario!(waiting_timeouts_and_cancel);
scenario!(graceful_shutdown);
scenario!(hooks_see_lifecycle_events);
scenario!(serial_queue_runs_one_at_a_time_in_order);
scenario!(batch_tasks_retry_only_failed_items);
scenario!(forbidden_flags_leave_tasks_to_other_workers);
scenario!(schedules_fire_inside_a_worker);
scenario!(racing_scheduler_loops);
scenario!(waits_leave_nothing_behind);
scenario!(poison_outcomes_fail_alone);
scenario!(undecodable_rows_fail_alone);

/// async-std's executor shares async-io with smol: the smol adapter's worker runs from it.
#[test]
fn a_worker_runs_under_async_std() {
    async_std::task::block_on(async {
        let db = pg::TestDb::new().await;
        let pool = db.pool(20).await;
        body::failures_end_with_their_codes(Arc::new(SmolRuntime), pool, db.schema.clone()).await;
    })
}
