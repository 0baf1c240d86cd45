//! Claims: the regular pass (sized by the budget and the buffer), the urgent claim beside it
//! for an announced task more urgent than the buffer holds, notifications and their rate, and
//! what a claim's answer puts in the worker's hands.

use super::*;

/// A claim pass about to be sent: its token (the op id it goes out under), whether a
/// notification woke it, and the counts it claims for.
pub(super) struct ClaimPass {
    pub(super) token: u64,
    pub(super) notified: bool,
    pub(super) running: u32,
    pub(super) claimed: u32,
    pub(super) start_now: u32,
    /// The worker's policy with the buffer sized for this pass.
    pub(super) policy: Arc<ClaimPolicy>,
}

/// A token bucket of empty notified claim passes (see [`NOTIFIED_PASS_BURST`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct PassBudget {
    pub(super) tokens: u32,
    /// When the last token was added (or the bucket was full).
    pub(super) refilled_at: Instant,
}

impl PassBudget {
    pub(super) fn refill(&mut self, now: Instant) {
        let per_token = Duration::from_secs(1) / NOTIFIED_PASSES_PER_SECOND;
        while self.tokens < NOTIFIED_PASS_BURST {
            let Some(next) = self.refilled_at.checked_add(per_token) else { break };
            if next > now {
                return;
            }
            self.tokens += 1;
            self.refilled_at = next;
        }
        self.refilled_at = now;
    }

    /// When the next token comes, if the bucket is empty.
    pub(super) fn next_token_at(&self) -> Option<Instant> {
        (self.tokens == 0).then(|| self.refilled_at + Duration::from_secs(1) / NOTIFIED_PASSES_PER_SECOND)
    }
}

/// Claim passes woken by a notification that came back empty may run this many times in a
/// burst, and then [`NOTIFIED_PASSES_PER_SECOND`] a second: a flood of notifications (anyone
/// who can connect can send them) costs a bounded number of claims.
pub const NOTIFIED_PASS_BURST: u32 = 20;

/// The rate empty notified passes may keep up once their burst is spent.
pub const NOTIFIED_PASSES_PER_SECOND: u32 = 20;

/// While regular passes leave tasks more urgent than their floor to urgent claims, an urgent
/// claim below the floor (a sweep) goes this long after a pass with a floor is sent, once per
/// interval: for tasks no notification announced (due by time, handed back, announced while
/// the worker was deaf). A sweep that leaves more, or one that finds no room, lifts the floor:
/// the next pass takes those tasks in claim order.
pub const FLOOR_SWEEP_INTERVAL: Duration = Duration::from_millis(50);

/// Which Pending rows a regular pass must look at to take every eligible one nobody else has.
///
/// A pass that answers "no more" has left nothing behind in its range. Rows that become
/// claimable after it are either announced by an enqueue that names their priority and run-at,
/// or come some other way (due by time, handed back, retried, promoted, announced without a
/// run-at, or while the worker was deaf or its notification dropped): the next pass looks at
/// the rows as urgent as the most urgent announced or less, due at the earliest announced
/// run-at or later, when only the first kind asked for it since the last pass was sent, and at
/// every row otherwise. A pass that leaves more passes its range on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PassBound {
    /// Nothing asked for a pass since the last one was sent.
    Covered,
    /// Only announcements with a run-at: the most urgent priority and the earliest run-at of
    /// them (each on its own).
    From { priority: i16, run_at: DbTime },
    /// Anything else: every row.
    Everything,
}

impl PassBound {
    /// The range that covers both.
    pub(super) fn widen(self, other: PassBound) -> PassBound {
        match (self, other) {
            (PassBound::Everything, _) | (_, PassBound::Everything) => PassBound::Everything,
            (PassBound::Covered, bound) | (bound, PassBound::Covered) => bound,
            (PassBound::From { priority: p, run_at: r }, PassBound::From { priority: q, run_at: s }) => {
                PassBound::From { priority: p.min(q), run_at: r.min(s) }
            }
        }
    }
}

impl Worker {
    /// A claim pass is wanted for a reason other than a notification: it looks at every row.
    pub(super) fn want_pass(&mut self) {
        self.want_pass_over_range();
        self.pass_bound = PassBound::Everything;
    }

    /// Another claim pass over the range the next one already has (what a pass left is there).
    fn want_pass_over_range(&mut self) {
        self.more_work = true;
        self.notified_pass = false;
    }

    pub(super) fn claim(&mut self, now: Instant) {
        let Some(claim) = self.begin_claim(now) else { return };
        let request = DbRequest::Claim {
            worker: self.id.clone(),
            token: claim.token,
            policy: claim.policy,
            my_running: claim.running,
            my_claimed: claim.claimed,
            start_now: claim.start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::Claim { token: claim.token, notified: claim.notified, sent, urgent: false });
    }

    /// Starts a claim pass if one is due and there is room: the pass is in flight from here
    /// (the caller sends it, alone or with a finish). `None` when no pass goes now.
    pub(super) fn begin_claim(&mut self, now: Instant) -> Option<ClaimPass> {
        if self.phase != Phase::Running || self.slots.claim.is_out() || self.claims_held || !self.more_work {
            return None;
        }
        // An urgent claim in flight may bring what it asked for: counted as held already.
        let (urgent_budget, urgent_start) = self.urgent_out.unwrap_or((0, 0));
        let running = self.executing() + urgent_start;
        let claimed = self.claimed() as u32 + urgent_budget.saturating_sub(urgent_start);
        let policy = self.sized_policy();
        let budget = policy.local_budget(running, claimed);
        if budget == 0 {
            return None; // a freed permit calls pump again
        }
        // Through a backlog, a large pass must not take (and hold for its whole statement) a
        // task enqueued more urgent than the backlog: urgent claims take those.
        // A floor is lifted for one pass when what is below it cannot wait for urgent claims.
        let floor = self.pass_floor.filter(|_| !std::mem::take(&mut self.floor_lifted));
        self.floor_out = floor.is_some();
        if floor.is_some() && !self.timers.contains(Timer::FloorSweep) {
            self.arm(Timer::FloorSweep, now + FLOOR_SWEEP_INTERVAL);
        }
        // Woken only by announced run-ats since the last pass: from the most urgent announced
        // priority and the earliest announced run-at on (the claim's index walk then starts
        // at that key, past the entries of rows claimed before).
        let bound = match std::mem::replace(&mut self.pass_bound, PassBound::Covered) {
            PassBound::Covered => PassBound::Everything,
            bound => bound,
        };
        let looked_at =
            self.full_pass_at.is_some_and(|at| now < at + Duration::from_millis(self.config.poll_interval_ms));
        if bound == PassBound::Everything {
            self.full_pass_at = Some(now);
        } else if !looked_at {
            // Rows can wait below the bound with nothing to announce them (a row another
            // transaction held as a pass went by, a wake-up dropped on a full channel, a lapsed
            // claim more urgent than the announcements): every row is looked at at least once a
            // poll interval, however busy the queue (each pass pushes the poll back). A small
            // claim beside this pass looks (`claim_urgent`): under a held xmin its walk of the
            // dead index entries then holds up no pass.
            self.look_due = true;
            self.full_pass_at = Some(now);
        }
        self.bound_out = bound;
        let (min_priority, min_run_at) = match bound {
            PassBound::From { priority, run_at } => (Some(floor.map_or(priority, |f| f.max(priority))), Some(run_at)),
            _ => (floor, None),
        };
        let policy = if min_priority.is_some() || min_run_at.is_some() {
            let mut bounded = (*policy).clone();
            bounded.min_priority = min_priority;
            bounded.min_run_at = min_run_at;
            Arc::new(bounded)
        } else {
            policy
        };
        let start_now = self.config.concurrency.saturating_sub(running + claimed);
        self.claim_out = (budget, start_now.min(budget));
        self.more_work = false;
        self.slots.claim.sending(self.next_op_id());
        self.stats.claim_passes += 1;
        // The request's op id: sent next.
        let token = self.next_op;
        let notified = std::mem::take(&mut self.notified_pass);
        if notified {
            // Spent when sent (a pass in flight holds its token), given back if it finds work.
            self.pass_budget.refill(now);
            self.pass_budget.tokens = self.pass_budget.tokens.saturating_sub(1);
        }
        if self.polls() {
            self.arm(Timer::Poll, now + self.poll_interval(now));
        }
        Some(ClaimPass { token, notified, running, claimed, start_now, policy })
    }

    /// A task announced more urgent than some in the buffer is claimed at once by a small claim
    /// of its own, beside a pass in flight or while the buffer is full (at most [`URGENT_CLAIM_MAX`], within the
    /// worker's largest buffer, and starting only what the pass in flight leaves room for): it
    /// then starts before the buffer, instead of waiting for the pass in flight and the next.
    pub(super) fn claim_urgent(&mut self) {
        // Called after the regular pass had its chance: if none is in flight, none could go
        // (the buffer is full, or passes are held back), and none comes before a slot frees.
        if (self.urgent_due == 0 && !self.look_due)
            || self.urgent_out.is_some()
            || self.phase != Phase::Running
            || self.claims_held
        {
            return;
        }
        let hard = self.policy.hard_cap_mode();
        let (out_budget, out_start) = self.claim_out;
        let (running, claimed) = (self.executing(), self.claimed() as u32);
        let most = self.config.concurrency + if hard { HARD_CAP_CLAIM_AHEAD_MAX } else { self.policy.prefetch_buffer };
        let mut room = most.saturating_sub(running + claimed + out_budget);
        if self.policy.max_claim_per_worker > 0 {
            // What the pass in flight brings counts against the worker's most live claims.
            room = room.min(self.policy.max_claim_per_worker.saturating_sub(claimed + out_budget));
        }
        // As many as were announced: the claim takes the most urgent first. A look takes what
        // comes first in claim order, the announced urgent tasks included.
        let wanted = if self.look_due { URGENT_CLAIM_MAX } else { self.urgent_due };
        let budget = URGENT_CLAIM_MAX.min(wanted).min(room);
        if budget == 0 {
            // Due still: asked once the pass in flight is back. Passes take the room first
            // (`max_claim_per_worker` may leave none beside one): the next takes these in
            // claim order, without a floor.
            if self.urgent_due > 0 {
                self.floor_lifted = true;
            }
            if std::mem::take(&mut self.look_due) {
                // No room beside the passes: the next one looks at every row itself.
                self.pass_bound = self.pass_bound.widen(PassBound::Everything);
            }
            return;
        }
        self.urgent_due = 0;
        self.sweep_out = std::mem::take(&mut self.sweep_due);
        self.look_out = std::mem::take(&mut self.look_due);
        self.stats.looks += u64::from(self.look_out);
        let start_now = self.config.concurrency.saturating_sub(running + claimed + out_start).min(budget);
        // The store sees this worker's held tasks only: it may take `budget`, no more.
        let mut policy = (*self.policy).clone();
        let extra = (running + claimed + budget).saturating_sub(self.config.concurrency);
        if hard {
            policy.claim_ahead = extra;
        } else {
            policy.prefetch_buffer = extra.max(1);
        }
        let cap = claimed + budget;
        policy.max_claim_per_worker =
            if policy.max_claim_per_worker > 0 { policy.max_claim_per_worker.min(cap) } else { cap };
        // Only tasks as urgent as those announced: a few rows, not the ones the pass holds. A
        // look takes any.
        policy.max_priority = if self.look_out { None } else { Some(self.urgent_bound) };
        self.urgent_out = Some((budget, start_now));
        let token = self.next_op;
        let request = DbRequest::Claim {
            worker: self.id.clone(),
            token,
            policy: Arc::new(policy),
            my_running: running,
            my_claimed: claimed,
            start_now,
            lease_ms: self.app.effective_claim_lease_ms(),
        };
        let sent = self.now;
        self.send(request, Op::Claim { token, notified: false, sent, urgent: true });
    }

    /// The policy to claim with now: the buffer (the prefetch buffer in soft-cap mode, the
    /// claims ahead in hard-cap mode) sized by [`ClaimFlow::buffer`] for the work this worker
    /// does, up to its maximum.
    pub(super) fn sized_policy(&mut self) -> Arc<ClaimPolicy> {
        let hard = self.policy.hard_cap_mode();
        // Room is left for a claim of an urgent task beside the buffer (`claim_urgent`).
        let (current, floor, max) = if hard {
            (self.claim_policy.claim_ahead, 0, HARD_CAP_CLAIM_AHEAD_MAX - URGENT_CLAIM_MAX)
        } else {
            // At least 1: a buffer of 0 would be hard-cap mode.
            let max = self.policy.prefetch_buffer.saturating_sub(URGENT_CLAIM_MAX).max(1);
            (self.claim_policy.prefetch_buffer, 1, max)
        };
        let buffer = self.flow.buffer(self.now, floor, max);
        if buffer != current {
            let mut policy = (*self.policy).clone();
            if hard {
                policy.claim_ahead = buffer;
            } else {
                policy.prefetch_buffer = buffer;
            }
            self.claim_policy = Arc::new(policy);
        }
        Arc::clone(&self.claim_policy)
    }

    pub(super) fn on_notified(&mut self, queue: &str, priority: Option<i16>, run_at: Option<DbTime>) {
        if self.config.deployment_mode == DeploymentMode::PollingOnly || !self.served.contains(queue) {
            return;
        }
        let announced = match (priority, run_at) {
            (Some(priority), Some(run_at)) => PassBound::From { priority, run_at },
            _ => PassBound::Everything,
        };
        self.pass_bound = self.pass_bound.widen(announced);
        if let Some(priority) = priority {
            let rank = (self.queue_priority(queue), priority);
            // More urgent than a buffered task, or, with none buffered, than what the worker
            // is working through (a pass in flight brings more of it).
            let overtakes = if self.buffer.is_empty() {
                self.working_rank.is_some_and(|working| rank < working)
            } else {
                self.buffer.would_overtake(rank.0, rank.1)
            };
            if overtakes {
                self.urgent_bound = if self.urgent_due == 0 { priority } else { self.urgent_bound.max(priority) };
                self.urgent_due = self.urgent_due.saturating_add(1);
            }
        }
        if self.more_work && !self.cap_blocked {
            self.stats.notifications_coalesced += 1;
        }
        self.cap_blocked = false;
        self.start_blocked = false;
        if self.more_work {
            return;
        }
        self.pass_budget.refill(self.now);
        if let Some(at) = self.pass_budget.next_token_at() {
            // Empty notified passes spent their budget: this one waits for the next token, with
            // every notification until then.
            if !self.timers.contains(Timer::NotifiedPass) {
                self.stats.notified_passes_limited += 1;
                self.arm(Timer::NotifiedPass, at);
            }
            return;
        }
        // This notification takes the pass a held-back one was waiting for.
        self.timers.remove(Timer::NotifiedPass);
        self.more_work = true;
        self.notified_pass = true;
    }

    /// The answer of an urgent claim: what it took joins the buffer.
    pub(super) fn on_urgent_claimed(&mut self, tasks: Vec<ClaimedTask>, more: bool, token: u64) {
        // What it took joins the buffer, most urgent first; the regular passes go on.
        let budget = self.urgent_out.take().map_or(0, |(budget, _)| budget);
        if std::mem::take(&mut self.sweep_out) && more {
            // More waits below the floor than a small claim takes (a bulk enqueue of urgent
            // tasks announces itself once): the next pass takes it in claim order.
            self.floor_lifted = true;
        }
        if std::mem::take(&mut self.look_out) && more {
            if tasks.len() as u32 >= budget {
                // More than a look takes: another looks on at once, beside the passes (an
                // unbounded pass would walk what the look walks, and hold up the passes).
                self.look_due = true;
            } else {
                // Left rows it could not take (held by others, or a cap): the next pass looks
                // at every row and deals with them as with any.
                self.want_pass();
            }
        }
        self.take_claimed(tasks, token);
    }

    /// Asks the next urgent claim to take what waits below the pass floor, unannounced.
    pub(super) fn sweep_below_floor(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        // Nothing is more urgent than the most urgent priority.
        let Some(below) = self.pass_floor.and_then(|floor| floor.checked_sub(1)) else { return };
        self.urgent_bound = if self.urgent_due == 0 { below } else { self.urgent_bound.max(below) };
        self.urgent_due = self.urgent_due.max(URGENT_CLAIM_MAX);
        self.sweep_due = true;
    }

    /// The answer of a claim pass (alone or inside a finish).
    pub(super) fn on_pass_claimed(
        &mut self,
        notified: bool,
        sent: Instant,
        token: u64,
        tasks: Vec<ClaimedTask>,
        more: bool,
        next_run_in_ms: Option<u64>,
    ) {
        self.flow.on_claim_answered(sent, self.now);
        // A wake-up hint past the end of this clock's range is no hint at all.
        let hint = next_run_in_ms.and_then(|ms| self.now.checked_add(Duration::from_millis(ms)));
        if let Some(at) = hint.filter(|_| self.phase == Phase::Running) {
            if self.timers.get(Timer::Wake).is_none_or(|armed| armed > at) {
                self.arm(Timer::Wake, at);
            }
        }
        if notified && (!tasks.is_empty() || more) {
            self.pass_budget.tokens = (self.pass_budget.tokens + 1).min(NOTIFIED_PASS_BURST);
        }
        self.on_claimed(tasks, more, token)
    }

    pub(super) fn on_claimed(&mut self, tasks: Vec<ClaimedTask>, more: bool, token: u64) {
        self.slots.claim.answered();
        let budget = self.claim_out.0;
        self.claim_out = (0, 0);
        self.on_pass_left(&tasks, budget, more);
        let took = tasks.len();
        self.working_rank = tasks.iter().map(|t| (self.queue_priority(&t.queue), t.priority)).max();
        if more {
            // What it left behind is in its range: the next pass looks there too.
            self.pass_bound = self.pass_bound.widen(self.bound_out);
        }
        // Through a backlog the next pass starts at the most urgent priority this one took;
        // a pass that ran short (or took nothing) leaves no floor.
        self.pass_floor = if more { tasks.iter().map(|t| t.priority).min() } else { None };
        if self.pass_floor.is_none() {
            self.timers.remove(Timer::FloorSweep);
            if std::mem::take(&mut self.sweep_due) {
                // A sweep not sent yet has nothing left to sweep: the next pass takes any.
                self.urgent_due = 0;
            }
        }
        if std::mem::take(&mut self.floor_out) && !more {
            // Short above its floor, which says nothing of below it: one pass without a floor
            // before the worker waits (what is left there may have been announced already).
            self.want_pass();
        }
        self.take_claimed(tasks, token);
        if more {
            if took > 0 {
                // Over the range kept above: an unbounded pass would walk, under a held xmin,
                // every dead entry before it.
                self.want_pass_over_range();
            } else {
                self.cap_blocked = true;
                self.poll_while_blocked();
            }
        }
    }

    /// Holds the tasks a claim took: started ones run, the others wait in the buffer.
    pub(super) fn take_claimed(&mut self, tasks: Vec<ClaimedTask>, token: u64) {
        for task in tasks {
            // Two claims may be out at once (a pass and an urgent claim), the database may
            // apply them in either order, and their answers come in any order: a task held
            // under a newer lease since this claim was sent was taken by the other one later
            // (this one's claim lapsed, or was taken back, meanwhile). Only a claim sent after
            // the holding began can say the database went back.
            if self.held.get(&task.id).is_some_and(|held| held.lease > task.lease && token < held.taken_before_op) {
                continue;
            }
            self.stats.claimed += 1;
            self.events.push_back(Event::Claimed { task: task.id, queue: task.queue.clone() });
            let started = task.started;
            let (id, attempt, task_lease) = (task.id, task.attempt, task.lease);
            if let Some(problem) = &task.retry_error {
                self.events.push_back(Event::UnreadableRow {
                    task: id,
                    problem: format!("its retry policy could not be read ({problem}): the app's policy applies"),
                });
            }
            let unreadable = task.args_error.clone();
            let stage = if started { Stage::Starting } else { Stage::Buffered };
            let previous = self.held.insert(
                id,
                Held {
                    lease: task.lease,
                    attempt,
                    name: task.name,
                    queue: task.queue,
                    priority: task.priority,
                    enqueued_at: task.enqueued_at,
                    run_at: task.run_at,
                    args: task.args,
                    retries: task.retries,
                    retry: task.retry,
                    stage,
                    expires: task.expires,
                    unrecorded: false,
                    taken_before_op: self.next_op,
                },
            );
            if let Some(previous) = previous {
                // The store handed the task out again under a newer lease: a write of ours whose
                // reply was lost did land (a retry or a release), or the reaper took the task
                // while we still ran it. What we held under the old lease is stale: drop its
                // handler and its unwritten outcome (a write under it would be fenced anyway).
                // An older lease than ours means the database went back in time (a restore, a
                // lagging replica): the database is the truth, so the same, and say so.
                if previous.lease >= task_lease {
                    self.events.push_back(Event::LeaseWentBack { task: id, held: previous.lease, claimed: task_lease });
                }
                if matches!(previous.stage, Stage::Running { .. }) {
                    self.abort(id, previous.lease);
                }
                self.timers.remove(Timer::HandlerTimeout(id));
                self.buffer.remove(id);
                self.forget_writes(id);
                self.releases.retain(|t| t.task != id);
                self.stats.lost += 1;
                self.events.push_back(Event::Lost { task: id, reason: LostReason::Unconfirmed });
            }
            if let Some(problem) = unreadable {
                // Nothing can run it: fail it as a handler that could not decode its arguments
                // would, without a retry (the row will not read better next time).
                self.events.push_back(Event::UnreadableRow {
                    task: id,
                    problem: format!("its arguments could not be read ({problem})"),
                });
                if !started {
                    // Claimed in the store until its finish lands: heartbeats renew the claim.
                    if let Some(held) = self.held.get_mut(&id) {
                        held.unrecorded = true;
                    }
                }
                let message = format!("the task's stored arguments could not be read: {}", printable(&problem, 500));
                let outcome = FinishOutcome::Failed(TaskError::new(ErrorCode::WorkerSerializationError, message));
                let bytes = own_outcome_bytes(&outcome);
                self.finish(id, outcome, None, bytes);
                continue;
            }
            if self.phase != Phase::Running || self.aborted_run(id, task_lease) {
                // Claimed while shutting down: hand it straight back. Or handed back under
                // the lease of a run aborted here whose answer may still come (the database
                // went back in time): a second run under that lease could take that answer for
                // its own, so it goes back to be claimed under a new lease.
                self.release(id);
            } else if started {
                self.on_started(id, attempt);
            } else {
                self.buffer_task(id, false);
            }
        }
    }

    /// The claim priority of `queue` for this worker (lower claims first).
    pub(super) fn queue_priority(&self, queue: &str) -> u8 {
        self.policy.queues.iter().find(|q| q.name == queue).map_or(u8::MAX, |q| q.priority)
    }

    /// Puts held task `id` in the buffer by its queue's priority and its own; `front`: before
    /// the others of its rank (a start that did not happen).
    pub(super) fn buffer_task(&mut self, id: TaskId, front: bool) {
        let Some(held) = self.held.get(&id) else { return };
        let (queue_priority, priority) = (self.queue_priority(&held.queue), held.priority);
        if front {
            self.buffer.push_front(id, queue_priority, priority);
        } else {
            self.buffer.push(id, queue_priority, priority);
        }
    }

    /// A cap stopped this worker: capacity freed by others (their completions, the reaper)
    /// comes with no notification, so a blocked worker polls even in event-driven mode.
    pub(super) fn poll_while_blocked(&mut self) {
        if self.phase == Phase::Running && !self.timers.contains(Timer::Poll) {
            let at = self.now + self.poll_interval(self.now);
            self.arm(Timer::Poll, at);
        }
    }

    /// A claim pass that failed; true when nothing more is to be done about it (an urgent
    /// claim's task waits for the next pass; a queue's claim lock is no outage: other workers
    /// claim meanwhile).
    pub(super) fn claim_pass_failed(
        &mut self,
        token: u64,
        urgent: bool,
        unknown: bool,
        lock: bool,
        now: Instant,
    ) -> bool {
        self.claim_failed(token, unknown, urgent, now);
        if urgent {
            return true;
        }
        if lock {
            self.claims_held = true;
            self.hold_up(now);
            return true;
        }
        false
    }

    /// A claim that failed: no pass in flight, another wanted. One whose commit is unknown is
    /// undone by its token now, and with every heartbeat for a while (it may commit later).
    pub(super) fn claim_failed(&mut self, token: u64, unknown: bool, urgent: bool, now: Instant) {
        if urgent {
            self.urgent_out = None;
            self.sweep_out = false;
            // Its tasks wait for the next pass, which must not pass over them.
            self.floor_lifted = true;
            self.pass_bound = PassBound::Everything;
            if std::mem::take(&mut self.look_out) {
                self.more_work = true;
            }
        } else {
            self.slots.claim.answered();
            self.claim_out = (0, 0);
            self.floor_out = false;
            self.want_pass();
        }
        if unknown {
            self.abandons.push(token);
            if let Some(until) = now.checked_add(ABANDONED_CLAIM_MEMORY) {
                self.abandoned.insert(token, until);
            }
        }
    }
}
