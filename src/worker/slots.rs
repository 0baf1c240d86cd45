//! The worker's requests of each kind, at most one in flight at a time: for each, whether one
//! is owed (its timer fired, or a failure left it to send again) and the op id of the one out.

use crate::store::OpId;

/// One kind of request: idle, due, in flight (with its op id), or due again while in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Slot {
    due: bool,
    out: Option<OpId>,
}

impl Slot {
    /// One is owed: it goes out as soon as it may.
    pub(super) fn owe(&mut self) {
        self.due = true;
    }

    /// What was owed is being sent (or no longer needed).
    pub(super) fn settle(&mut self) {
        self.due = false;
    }

    /// Whether one is owed.
    pub(super) fn is_due(self) -> bool {
        self.due
    }

    /// Request `op` goes out.
    pub(super) fn sending(&mut self, op: OpId) {
        self.out = Some(op);
    }

    /// Whether one is in flight.
    pub(super) fn is_out(self) -> bool {
        self.out.is_some()
    }

    /// The one in flight was answered, or failed.
    pub(super) fn answered(&mut self) {
        self.out = None;
    }
}

/// Every kind of request the worker keeps one of in flight.
#[derive(Debug, Default)]
pub(super) struct Slots {
    /// The regular claim pass (the urgent claim goes beside it).
    pub(super) claim: Slot,
    /// Starts asked of the store.
    pub(super) start: Slot,
    /// Starts made without asking, recorded later.
    pub(super) record: Slot,
    /// Lease renewals and liveness.
    pub(super) heartbeat: Slot,
    /// The reaper.
    pub(super) reap: Slot,
    /// The look for dead workers by their released liveness tokens.
    pub(super) reap_dead: Slot,
    /// The purge of old finished tasks.
    pub(super) purge: Slot,
    /// The vacuum check of the hot tables.
    pub(super) vacuum: Slot,
    /// A batch of completions.
    pub(super) finish: Slot,
    /// A completion the database refused before, sent on its own.
    pub(super) lone: Slot,
    /// The registration in the worker registry.
    pub(super) register: Slot,
    /// The waiting mark (or unmark, or renewal).
    pub(super) waiting: Slot,
}
