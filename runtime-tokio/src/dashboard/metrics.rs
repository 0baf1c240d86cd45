//! The dashboard's `/metrics`: each queue's depth and age from the shared overview.

use canter::driver::metrics::{QueueGauges, render_queues};
use canter::task::TaskState;

use super::snapshot::Overview;

/// The overview's queues and workers as metrics.
pub(crate) fn render(overview: &Overview) -> String {
    let queues: Vec<QueueGauges> = overview
        .queues
        .iter()
        .map(|q| QueueGauges {
            queue: q.queue.clone(),
            due: q.due,
            scheduled: q.scheduled,
            claimed: q.claimed,
            running: q.running,
            oldest_due_age_seconds: q.oldest_due_at.map(|at| (overview.at - at).max(0) as f64 / 1_000.0),
            paused: q.paused,
            finished: vec![
                (TaskState::Completed, q.completed),
                (TaskState::Failed, q.failed),
                (TaskState::Cancelled, q.cancelled),
                (TaskState::Expired, q.expired),
                (TaskState::Skipped, q.skipped),
            ],
        })
        .collect();
    render_queues(&queues, overview.workers.iter().filter(|w| !w.stopped).count() as u64)
}

/// Before the first reading: no queue yet.
pub(crate) fn render_empty() -> String {
    render_queues(&[], 0)
}
