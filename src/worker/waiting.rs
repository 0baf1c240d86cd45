//! The waiting mark: a worker whose claim pass left nothing behind marks itself waiting on its
//! queues in the store, and narrows its mark to tasks more urgent than its backlog while the
//! backlog keeps it claiming, because a client's enqueue notifies a queue only while some
//! worker's mark of it takes the enqueued task in (a commit that sends a NOTIFY queues behind
//! every other such commit). From the pass that decides it, through the request, to the pass
//! after a new mark (what committed before the mark notified nobody).

use super::*;

/// What the store holds of this worker's waiting mark, and what the worker wants it to hold.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct WaitingMark {
    /// Marked while the worker's passes leave nothing behind; not after a pass that filled its
    /// room and left more (the worker claims again without being told). A pass a cap cut
    /// short changes nothing: the worker's other queues may be idle.
    pub(super) wanted: bool,
    /// While not wanted: the least urgent priority of the backlog, which enqueues more urgent
    /// than it are still announced for (to overtake the buffer with an urgent claim).
    pub(super) urgent_below: Option<i16>,
    /// What the store holds, as far as the worker knows: set by a mark's answer, cleared by an
    /// unmark's (an unmark that never landed only costs notifications).
    pub(super) marked: bool,
    /// A renewal is owed (each heartbeat interval while marked): a mark another worker deleted
    /// as stale (this one was silent that long) is written again.
    pub(super) renew: bool,
}

impl Worker {
    /// Whether this worker marks itself waiting: one that hears notifications.
    fn marks_waiting(&self) -> bool {
        self.config.deployment_mode != DeploymentMode::PollingOnly
    }

    /// A regular pass answered, having taken `tasks` of its `budget`: wait marked if it left
    /// nothing behind; narrowed to tasks more urgent than the least urgent it took if it
    /// filled its room and left more.
    pub(super) fn on_pass_left(&mut self, tasks: &[ClaimedTask], budget: u32, more: bool) {
        if !more {
            self.waiting.wanted = true;
        } else if !tasks.is_empty() && tasks.len() >= budget as usize {
            self.waiting.wanted = false;
            self.waiting.urgent_below = tasks.iter().map(|t| t.priority).max();
        }
    }

    /// The heartbeat timer fired, or the listener came back (after a failover the store may
    /// have lost the mark): a mark held is renewed.
    pub(super) fn renew_waiting(&mut self) {
        self.waiting.renew = self.waiting.marked;
    }

    /// Sends the mark, unmark or renewal owed, one at a time. Only once registered: another
    /// worker's mark deletes the marks of workers the registry does not have.
    pub(super) fn send_waiting(&mut self) {
        let mark = self.waiting;
        let owed = mark.wanted != mark.marked || (mark.wanted && mark.renew);
        if !owed
            || !self.marks_waiting()
            || !self.registered
            || self.phase != Phase::Running
            || self.slots.waiting.is_out()
            || self.lock_blocked
        {
            return;
        }
        self.waiting.renew = false;
        self.slots.waiting.sending(self.next_op_id());
        let request = DbRequest::SetWaiting {
            worker: self.id.clone(),
            queues: self.queue_names(),
            waiting: mark.wanted,
            urgent_below: if mark.wanted { None } else { mark.urgent_below },
            stale_ms: self.app.recovery.running_stale_threshold_ms,
        };
        self.send(request, Op::SetWaiting { waiting: mark.wanted });
    }

    /// The store holds the mark (`waiting`) or not. A mark the worker did not hold before asks
    /// for one more pass, and so does a renewal that wrote it again: an enqueue that committed
    /// before it notified nobody, and that pass sees it. (Written or not: a mark whose answer
    /// was lost may have committed after all, and its retry then finds it there.)
    pub(super) fn on_waiting_set(&mut self, waiting: bool, written: bool) {
        self.slots.waiting.answered();
        let newly = waiting && !self.waiting.marked;
        self.waiting.marked = waiting;
        if written {
            self.stats.waiting_marks += 1;
        }
        if newly || (waiting && written) {
            self.want_pass();
        }
    }

    /// A mark or unmark that failed: sent again once the outage or the lock lets it (a
    /// renewal too, which sending had cleared). Until a new mark is held the worker polls: no
    /// enqueue notifies it meanwhile. An unmark that failed may have committed (its answer
    /// lost): the worker takes itself to be unmarked, so its next mark is sent, and followed by
    /// a pass, whatever the store holds.
    pub(super) fn waiting_failed(&mut self, waiting: bool) {
        self.slots.waiting.answered();
        if !waiting {
            self.waiting.marked = false;
        } else if self.waiting.marked {
            self.waiting.renew = true;
        } else {
            self.poll_while_blocked();
        }
    }
}
