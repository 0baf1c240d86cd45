//! The tasks a worker holds, each at its stage (buffered, starting, running, finished and
//! waiting to be written), counted per stage so the machine's budget never scans them.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::config::RetryPolicy;
use crate::task::{Attempt, DbTime, Lease, TaskId};

/// What the worker knows of one task it holds.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub(super) lease: Lease,
    pub(super) attempt: Attempt,
    pub(super) name: String,
    pub(super) queue: String,
    /// Its priority (lower runs first): the buffer's order.
    pub(super) priority: i16,
    /// When it was enqueued and when it became claimable, on the store's clock.
    pub(super) enqueued_at: DbTime,
    pub(super) run_at: DbTime,
    pub(super) args: serde_json::Value,
    pub(super) retries: u32,
    pub(super) retry: RetryPolicy,
    pub(super) stage: Stage,
    /// It has a good-until: only a start request, on the store's clock, may start it.
    pub(super) expires: bool,
    /// Started without a start request and the store does not know yet: it is Claimed there
    /// (its heartbeat renews the claim) until a finish or a [`DbRequest::RecordStarts`](crate::store::DbRequest::RecordStarts).
    pub(super) unrecorded: bool,
    /// The first op id not yet sent when it was taken: a claim with a lower token (op ids
    /// number requests in the order they are sent) was in flight by then, and the database
    /// may have applied it before or after the one that took this.
    pub(super) taken_before_op: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Claimed, waiting for a permit (soft-cap mode).
    Buffered,
    /// A start request is out.
    Starting,
    /// The handler runs.
    Running { deadline: Option<Instant> },
    /// The handler returned (or was cut off); its outcome waits to be written.
    Finishing,
    /// Shutdown or a timeout took it away from its handler; it waits to be released.
    Releasing,
}

impl Stage {
    /// The index of this stage in [`HeldTasks`]' counts.
    pub(super) fn index(self) -> usize {
        match self {
            Stage::Buffered => 0,
            Stage::Starting => 1,
            Stage::Running { .. } => 2,
            Stage::Finishing => 3,
            Stage::Releasing => 4,
        }
    }
}

/// The tasks a worker holds, with how many are in each stage: the machine asks for those
/// counts after every input, and a scan would make each input cost as much as the buffer is
/// long. Stages change only through [`HeldTasks::set_stage`].
#[derive(Debug, Default)]
pub(super) struct HeldTasks {
    pub(super) tasks: BTreeMap<TaskId, Held>,
    pub(super) counts: [u32; 5],
}

impl HeldTasks {
    pub(super) fn get(&self, id: &TaskId) -> Option<&Held> {
        self.tasks.get(id)
    }

    /// The task, to change anything but its stage.
    pub(super) fn get_mut(&mut self, id: &TaskId) -> Option<&mut Held> {
        self.tasks.get_mut(id)
    }

    pub(super) fn insert(&mut self, id: TaskId, held: Held) -> Option<Held> {
        self.counts[held.stage.index()] += 1;
        let previous = self.tasks.insert(id, held);
        if let Some(previous) = &previous {
            self.counts[previous.stage.index()] -= 1;
        }
        previous
    }

    pub(super) fn remove(&mut self, id: &TaskId) -> Option<Held> {
        let held = self.tasks.remove(id)?;
        self.counts[held.stage.index()] -= 1;
        Some(held)
    }

    /// Moves a held task to `stage`; `None` if it is not held.
    pub(super) fn set_stage(&mut self, id: &TaskId, stage: Stage) -> Option<&mut Held> {
        let held = self.tasks.get_mut(id)?;
        self.counts[held.stage.index()] -= 1;
        self.counts[stage.index()] += 1;
        held.stage = stage;
        Some(held)
    }

    /// How many tasks are in the stages `stages` names.
    pub(super) fn count(&self, stages: &[Stage]) -> u32 {
        let n = stages.iter().map(|s| self.counts[s.index()]).sum();
        debug_assert_eq!(
            n,
            self.tasks.values().filter(|t| stages.iter().any(|s| s.index() == t.stage.index())).count() as u32,
            "held task counts out of step"
        );
        n
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&TaskId, &Held)> {
        self.tasks.iter()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Held> {
        self.tasks.values()
    }

    pub(super) fn len(&self) -> usize {
        self.tasks.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

/// The stages a handler runs in (its deadline aside), for [`HeldTasks::count`].
pub(super) const RUNNING: Stage = Stage::Running { deadline: None };
