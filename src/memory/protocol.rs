//! The worker protocol: [`DbRequest`]s applied atomically, as the SQL applies them.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::backoff;
use crate::budget::{self, ClaimCounts, ClaimPolicy, InFlight};
use crate::rng::mix;
use crate::store::{
    self, ClaimedTask, Completion, DbFailure, DbReply, DbRequest, DbTime, FinishOutcome, ReapReport,
    TASK_EXPIRED_MESSAGE, WORKER_CRASHED_MESSAGE, WorkerInfo, WorkerRecord,
};
use crate::task::{Attempt, ErrorCode, Lease, TaskError, TaskEvent, TaskId, TaskLease, TaskState, WorkerId};

use super::store::{
    LOCK_TIMEOUT_MESSAGE, MemoryStore, READABLE_JSON_DEPTH, StoredTask, WaitingMark, json_depth, minus_ms,
};

impl MemoryStore {
    /// Runs one request as PostgreSQL would answer it: a value PostgreSQL refuses (text with
    /// U+0000, a value over its size limit) fails the whole request with
    /// [`DbFailure::Invalid`], and a request that would wait on a row another transaction
    /// locked ([`lock_row`](Self::lock_row)) fails with [`DbFailure::LockTimeout`] as
    /// `lock_timeout` makes it; nothing is applied then. Otherwise as [`apply`](Self::apply).
    pub fn execute(&mut self, request: &DbRequest, now: DbTime) -> Result<DbReply, DbFailure> {
        if let DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. } = request {
            for completion in completions {
                refused_values(completion).map_err(|e| DbFailure::Invalid(e.to_string()))?;
            }
        }
        if self.waits_on_a_lock(request) {
            return Err(DbFailure::LockTimeout(LOCK_TIMEOUT_MESSAGE.into()));
        }
        Ok(self.apply(request, now))
    }

    /// Whether `request` would wait on a row another transaction locked: those that lock the
    /// rows they name without `SKIP LOCKED`.
    pub(super) fn waits_on_a_lock(&self, request: &DbRequest) -> bool {
        if self.locked.is_empty() {
            return false;
        }
        // PostgreSQL locks only the rows its conditions select: the worker's own in-flight rows.
        let held_locked = |worker: &WorkerId, id: TaskId| {
            self.locked.contains(&id)
                && self
                    .live
                    .get(&id)
                    .is_some_and(|row| row.state != TaskState::Pending && row.claimed_by.as_ref() == Some(worker))
        };
        match request {
            DbRequest::RecordStarts { worker, tasks } | DbRequest::Release { worker, tasks } => {
                tasks.iter().any(|t| held_locked(worker, t.task))
            }
            DbRequest::Finish { worker, completions } | DbRequest::FinishAndClaim { worker, completions, .. } => {
                completions.iter().any(|c| held_locked(worker, c.task.task))
            }
            DbRequest::AbandonClaim { worker, token } => self.live.values().any(|row| {
                self.locked.contains(&row.id)
                    && row.claimed_by.as_ref() == Some(worker)
                    && row.claim_token == Some(*token)
            }),
            // A start skips the rows another transaction holds and defers them.
            DbRequest::Claim { .. }
            | DbRequest::Start { .. }
            | DbRequest::Heartbeat { .. }
            | DbRequest::Reap { .. }
            | DbRequest::ReapDead { .. }
            | DbRequest::Purge { .. }
            | DbRequest::Vacuum { .. }
            | DbRequest::RegisterWorker(_)
            | DbRequest::DeregisterWorker(_)
            | DbRequest::SetWaiting { .. } => false,
        }
    }

    /// Applies one request of the worker machine atomically at database time `now`, with the
    /// semantics [`DbRequest`] documents, and returns its reply. Values are taken as they
    /// come and row locks of other transactions only skip rows: see
    /// [`execute`](Self::execute) for PostgreSQL's refusals.
    pub fn apply(&mut self, request: &DbRequest, now: DbTime) -> DbReply {
        let before = self.notifications.len();
        let reply = self.apply_request(request, now);
        // The request's (last) statement ends: the workflows of the steps it finished settle.
        self.settle_workflows(now);
        // PostgreSQL delivers identical notifications of one transaction once (a reap that
        // requeues claims and retries runs of one queue announces it once).
        let mut seen = BTreeSet::new();
        let mut index = 0;
        self.notifications.retain(|note| {
            index += 1;
            index <= before || seen.insert(note.clone())
        });
        reply
    }

    pub(super) fn apply_request(&mut self, request: &DbRequest, now: DbTime) -> DbReply {
        match request {
            DbRequest::Claim { worker, token, policy, my_running, my_claimed, start_now, lease_ms } => {
                let policy = &self.without_paused(policy);
                let counts = self.claim_counts(policy, *my_running, *my_claimed, now);
                let (tasks, more) = self.claim(worker, *token, policy, &counts, *start_now, *lease_ms, now);
                // Only a worker that will wait needs to know when delayed work becomes due.
                let next_run_in_ms = if more {
                    None
                } else {
                    self.live
                        .values()
                        // Delayed tasks only, as PostgreSQL's index of them (a task due when
                        // enqueued is not one, whatever the clock did since).
                        .filter(|row| row.state == TaskState::Pending && row.run_at > now)
                        .filter(|row| row.run_at > row.enqueued_at)
                        .filter(|row| policy.queues.iter().any(|q| q.name == row.queue))
                        .map(|row| row.run_at.0.abs_diff(now.0))
                        .min()
                };
                DbReply::Claimed { tasks, more, next_run_in_ms }
            }
            DbRequest::Start { worker, tasks, policy } => self.start(worker, tasks, policy, now),
            DbRequest::RecordStarts { worker, tasks } => self.record_starts(worker, tasks, now),
            DbRequest::Finish { worker, completions } => self.finish(worker, completions, now),
            DbRequest::FinishAndClaim { .. } => {
                // One statement: the claim sees what the finish did, but not what the finished
                // steps' workflows decide (they settle when the statement ends).
                let (finish, claim) = request.finish_then_claim().expect("a FinishAndClaim");
                let finished = self.apply_request(&finish, now);
                let claimed = self.apply_request(&claim, now);
                DbReply::finished_and_claimed(finished, claimed).expect("a finish and a claim answer as such")
            }
            DbRequest::Heartbeat { worker, claimed, running, lease_ms, max_renew_age_ms, abandoned } => {
                self.heartbeat(worker, claimed, running, *lease_ms, *max_renew_age_ms, abandoned, now)
            }
            DbRequest::Release { worker, tasks } => self.release(worker, tasks),
            DbRequest::AbandonClaim { worker, token } => {
                let released = self.abandon_claims(worker, &[*token], &BTreeSet::new());
                DbReply::Released { released, lost: Vec::new() }
            }
            DbRequest::Reap { worker: _, claimed_stale_ms, running_stale_ms, entropy } => {
                DbReply::Reaped(self.reap(*claimed_stale_ms, *running_stale_ms, *entropy, now))
            }
            DbRequest::ReapDead { worker: _, grace_ms, entropy } => {
                DbReply::Reaped(self.reap_dead(*grace_ms, *entropy, now))
            }
            // Nothing here leaves dead rows behind.
            DbRequest::Vacuum { .. } => DbReply::Vacuumed { tables: Vec::new() },
            DbRequest::Purge { older_than_ms, batch: _ } => {
                DbReply::Purged { tasks: self.purge_finished(*older_than_ms, now) }
            }
            DbRequest::RegisterWorker(info) => {
                self.workers
                    .insert(info.worker.clone(), WorkerRecord { info: info.clone(), last_seen: now, stopped: false });
                DbReply::Done
            }
            DbRequest::DeregisterWorker(worker) => {
                // A worker whose row was pruned (silent for the retention, e.g. through an
                // outage) gets a stopped one: a heartbeat of it still in flight, landing after
                // this, then finds it stopped instead of bringing it back as running.
                self.workers.entry(worker.clone()).and_modify(|record| record.stopped = true).or_insert_with(|| {
                    WorkerRecord {
                        info: WorkerInfo { worker: worker.clone(), queues: Vec::new(), concurrency: 0 },
                        last_seen: now,
                        stopped: true,
                    }
                });
                self.waiting.remove(worker);
                DbReply::Done
            }
            DbRequest::SetWaiting { worker, queues, waiting, urgent_below, stale_ms } => {
                let queues: BTreeSet<String> = queues.iter().cloned().collect();
                // Held as asked already (as PostgreSQL's rows: a mark of no queue is no mark).
                let held =
                    self.waiting.get(worker).map_or(queues.is_empty(), |m| m.below.is_none() && m.queues == queues);
                let written = *waiting && !held;
                if written || !*waiting {
                    self.waiting.remove(worker);
                    // Each by the threshold its worker marked with.
                    let stale = |other: &WorkerId, mark: &WaitingMark| {
                        !self.workers.get(other).is_some_and(|record| {
                            !record.stopped && record.last_seen.0 >= now.0.saturating_sub_unsigned(mark.stale_after_ms)
                        })
                    };
                    let stale: Vec<WorkerId> = self
                        .waiting
                        .iter()
                        .filter(|(other, mark)| stale(other, mark))
                        .map(|(w, _)| w.clone())
                        .collect();
                    for other in stale {
                        self.waiting.remove(&other);
                    }
                }
                let below = if *waiting { None } else { *urgent_below };
                if !queues.is_empty() && (written || below.is_some()) {
                    self.waiting.insert(worker.clone(), WaitingMark { queues, below, stale_after_ms: *stale_ms });
                }
                DbReply::WaitingSet { written }
            }
        }
    }

    /// Ends a Running row whose worker crashed (or went silent) with `WORKER_CRASHED`: retried
    /// as [`backoff::crash_retry_delay`] says if that is before good-until, else failed.
    pub(super) fn crash_run(
        &mut self,
        id: TaskId,
        entropy: u64,
        now: DbTime,
        report: &mut ReapReport,
        ready: &mut BTreeSet<String>,
    ) {
        let crash_retries = self.app.recovery.crash_retries;
        let row = self.live_row(id);
        let delay = backoff::crash_retry_delay(&row.retry, row.retries, crash_retries, mix(entropy ^ id.0 as u64));
        let run_at = delay.map(|delay| now.plus_ms(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)));
        let error = TaskError::new(ErrorCode::WorkerCrashed, WORKER_CRASHED_MESSAGE);
        match run_at.filter(|&run_at| row.good_until.is_none_or(|at| run_at < at)) {
            Some(run_at) => {
                ready.insert(row.queue.clone());
                self.retry_run(id, error, run_at, now);
                report.retried.push(id);
            }
            None => {
                self.fail_run(id, error, now);
                report.failed.push(id);
            }
        }
    }

    /// [`DbRequest::ReapDead`]: the workers whose token was recorded in this incarnation and
    /// has been released for `grace_ms`, and their tasks (rows other transactions hold are
    /// skipped, as the reaper skips them).
    pub(super) fn reap_dead(&mut self, grace_ms: u64, entropy: u64, now: DbTime) -> ReapReport {
        let mut report = ReapReport::default();
        let epoch = self.tokens.epoch;
        let mut dead = Vec::new();
        for (worker, (taken_in, free_since)) in &mut self.tokens.recorded {
            if *taken_in != epoch || self.tokens.held.contains(worker) {
                continue;
            }
            let since = *free_since.get_or_insert(now);
            if minus_ms(now, grace_ms) >= since {
                dead.push(worker.clone());
            }
        }
        let mut ready = BTreeSet::new();
        for worker in &dead {
            self.tokens.recorded.remove(worker);
            let held = |state: TaskState| -> Vec<TaskId> {
                self.live
                    .values()
                    .filter(|row| {
                        row.state == state && row.claimed_by.as_ref() == Some(worker) && !self.locked.contains(&row.id)
                    })
                    .map(|row| row.id)
                    .collect()
            };
            let (claimed, running) = (held(TaskState::Claimed), held(TaskState::Running));
            ready.extend(claimed.iter().map(|&id| self.release_row(id)));
            report.requeued.extend(claimed);
            for id in running {
                self.crash_run(id, entropy, now, &mut report, &mut ready);
            }
        }
        report.requeued.sort_unstable();
        report.retried.sort_unstable();
        report.failed.sort_unstable();
        self.notify_ready(ready);
        report.dead_workers = dead;
        report
    }

    /// The counts a claim pass by a worker with `policy` observes at `now`: the cluster's and
    /// each served queue's in flight (Running, and Claimed with a live lease), and each served
    /// queue's eligible rows. `queues` and `available` have an entry for every queue of
    /// `policy`, zeros included, and for no other queue.
    pub fn claim_counts(&self, policy: &ClaimPolicy, my_running: u32, my_claimed: u32, now: DbTime) -> ClaimCounts {
        let mut counts = ClaimCounts { my_running, my_claimed, ..ClaimCounts::default() };
        for queue in &policy.queues {
            counts.queues.insert(queue.name.clone(), InFlight::default());
            counts.available.insert(queue.name.clone(), 0);
        }
        for row in self.live.values() {
            let in_flight = match row.state {
                TaskState::Running => Some(true),
                TaskState::Claimed if row.claim_expires_at.is_none_or(|at| at > now) => Some(false),
                _ => None,
            };
            if let Some(running) = in_flight {
                add_in_flight(&mut counts.cluster, running);
                if let Some(queue) = counts.queues.get_mut(&row.queue) {
                    add_in_flight(queue, running);
                }
            }
            // A row another transaction locks cannot be taken (`SKIP LOCKED`).
            if row.is_claimable(now) && row.admitted_by(policy) && !self.locked.contains(&row.id) {
                if let Some(available) = counts.available.get_mut(&row.queue) {
                    *available = available.saturating_add(1);
                }
            }
        }
        counts
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn claim(
        &mut self,
        worker: &WorkerId,
        token: u64,
        policy: &ClaimPolicy,
        counts: &ClaimCounts,
        start_now: u32,
        lease_ms: u64,
        now: DbTime,
    ) -> (Vec<ClaimedTask>, bool) {
        let plan = budget::plan(policy, counts);
        let mut chosen: Vec<TaskId> = Vec::new();
        let mut taken: BTreeSet<TaskId> = BTreeSet::new();
        for (queue, take) in &plan.takes {
            let mut candidates: Vec<&StoredTask> = self
                .live
                .values()
                .filter(|row| {
                    &row.queue == queue
                        && row.is_claimable(now)
                        && row.admitted_by(policy)
                        && !taken.contains(&row.id)
                        && !self.locked.contains(&row.id)
                })
                .collect();
            candidates.sort_by_key(|row| (row.priority, row.run_at, row.id));
            for row in candidates.into_iter().take(*take as usize) {
                chosen.push(row.id);
                taken.insert(row.id);
            }
        }
        let more = self.left_behind(policy, counts, plan.budget, &taken, now);
        let mut claimed = Vec::with_capacity(chosen.len());
        for (index, id) in chosen.into_iter().enumerate() {
            let start = index < start_now as usize;
            let row = self.live_row(id);
            row.apply_event(if start { TaskEvent::ClaimAndStart } else { TaskEvent::Claim });
            row.lease = Lease(row.lease.0.saturating_add(1));
            row.claimed_by = Some(worker.clone());
            row.claim_token = Some(token);
            row.claimed_at = Some(now);
            let attempt = if start {
                row.attempts = row.attempts.saturating_add(1);
                row.started_at = Some(now);
                row.heartbeat_at = Some(now);
                row.claim_expires_at = None;
                row.attempts
            } else {
                row.heartbeat_at = None;
                row.claim_expires_at = Some(now.plus_ms(lease_ms));
                row.attempts.saturating_add(1)
            };
            // What PostgreSQL's store could not decode, it hands over as `null` and says why.
            let args_error =
                (json_depth(&row.args) > READABLE_JSON_DEPTH).then(|| "recursion limit exceeded".to_owned());
            claimed.push(ClaimedTask {
                id,
                lease: row.lease,
                name: row.name.clone(),
                queue: row.queue.clone(),
                args: if args_error.is_some() { Value::Null } else { row.args.clone() },
                priority: row.priority,
                enqueued_at: row.enqueued_at,
                run_at: row.run_at,
                started: start,
                attempt: Attempt(attempt),
                retries: row.retries,
                retry: row.retry.clone(),
                expires: row.good_until.is_some(),
                args_error,
                retry_error: None,
            });
        }
        (claimed, more)
    }

    /// Whether a claim pass that took `taken` left an eligible row of a served queue behind,
    /// as PostgreSQL's `claim()` judges it, per queue in claim order: a queue that took all it
    /// wanted (its budget, cap room and batch; wanting nothing counts) is probed for a Pending
    /// row after the last one it took in claim order and a lapsed claim it did not take (a
    /// locked row before the last one taken reads as taken by another claimer); a queue that
    /// ran short, for any eligible row it did not take (one another transaction locks).
    /// Without locked rows this is "more eligible rows than taken".
    pub(super) fn left_behind(
        &self,
        policy: &ClaimPolicy,
        counts: &ClaimCounts,
        budget: u32,
        taken: &BTreeSet<TaskId>,
        now: DbTime,
    ) -> bool {
        let hard = policy.hard_cap_mode();
        let mut left = budget;
        for queue in &policy.queues {
            let in_flight = counts.queues.get(&queue.name).copied().unwrap_or_default();
            let room = queue
                .max_concurrency
                .map_or(u32::MAX, |cap| cap.saturating_sub(in_flight.counted(hard || queue.serial)));
            let batch = if policy.max_claim_batch > 0 { policy.max_claim_batch } else { u32::MAX };
            let want = left.min(room).min(batch);
            let eligible =
                |row: &&StoredTask| row.queue == queue.name && row.is_claimable(now) && row.admitted_by(policy);
            let got: Vec<&StoredTask> =
                self.live.values().filter(eligible).filter(|row| taken.contains(&row.id)).collect();
            left = left.saturating_sub(got.len() as u32);
            if (got.len() as u32) < want {
                if self.live.values().filter(eligible).any(|row| !taken.contains(&row.id)) {
                    return true;
                }
                continue;
            }
            let key = |row: &StoredTask| (row.priority, row.run_at, row.id);
            let last = got.iter().filter(|row| row.state == TaskState::Pending).map(|row| key(row)).max();
            let behind = self.live.values().filter(eligible).any(|row| match row.state {
                TaskState::Pending => last.is_none_or(|last| key(row) > last),
                _ => !taken.contains(&row.id),
            });
            if behind {
                return true;
            }
        }
        false
    }

    pub(super) fn start(
        &mut self,
        worker: &WorkerId,
        tasks: &[TaskLease],
        policy: &ClaimPolicy,
        now: DbTime,
    ) -> DbReply {
        let mut started = Vec::new();
        let mut expired = Vec::new();
        let mut deferred = Vec::new();
        let mut lost = Vec::new();
        let mut running = self.running_per_queue();
        for &TaskLease { task: id, lease } in tasks {
            if self.locked.contains(&id)
                && self.live.get(&id).is_some_and(|row| {
                    row.held_by(worker, lease)
                        && (row.state == TaskState::Running
                            || (row.state == TaskState::Claimed && row.claim_expires_at.is_none_or(|at| at > now)))
                })
            {
                // Skipped, as PostgreSQL's `SKIP LOCKED` does: asked again later. (Any other
                // locked row is lost below, as it is there.)
                deferred.push(id);
                continue;
            }
            let Some(row) = self.live.get(&id).filter(|row| row.held_by(worker, lease)) else {
                lost.push(id);
                continue;
            };
            match row.state {
                // A re-send of a start that was applied: report it started again.
                TaskState::Running => {
                    started.push((id, Attempt(row.attempts)));
                    continue;
                }
                TaskState::Claimed if row.claim_expires_at.is_none_or(|at| at > now) => {}
                _ => {
                    lost.push(id);
                    continue;
                }
            }
            if row.good_until.is_some_and(|at| at <= now) {
                let error = TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE);
                self.finish_row(id, TaskEvent::Expire, now, Some(error), None);
                expired.push(id);
                continue;
            }
            let cap = if policy.hard_cap_mode() {
                None
            } else {
                policy.queues.iter().find(|q| q.name == row.queue).and_then(|q| q.max_concurrency)
            };
            let queue_running = running.entry(row.queue.clone()).or_insert(0);
            if cap.is_some_and(|cap| *queue_running >= cap) {
                deferred.push(id);
                continue;
            }
            *queue_running += 1;
            started.push((id, self.start_row(id, now)));
        }
        DbReply::Started { started, expired, deferred, lost }
    }

    /// Claimed to Running, counting the run as an attempt: the number of this run.
    pub(super) fn start_row(&mut self, id: TaskId, now: DbTime) -> Attempt {
        let row = self.live_row(id);
        row.apply_event(TaskEvent::Start);
        row.attempts = row.attempts.saturating_add(1);
        row.started_at = Some(now);
        row.heartbeat_at = Some(now);
        row.claim_expires_at = None;
        Attempt(row.attempts)
    }

    pub(super) fn record_starts(&mut self, worker: &WorkerId, tasks: &[TaskLease], now: DbTime) -> DbReply {
        let mut started = Vec::new();
        let mut lost = Vec::new();
        for &TaskLease { task: id, lease } in tasks {
            match self.live.get(&id).filter(|row| row.held_by(worker, lease)).map(|row| row.state) {
                Some(TaskState::Running) => started.push((id, Attempt(self.live_row(id).attempts))),
                Some(TaskState::Claimed) => started.push((id, self.start_row(id, now))),
                _ => lost.push(id),
            }
        }
        DbReply::Started { started, expired: Vec::new(), deferred: Vec::new(), lost }
    }

    pub(super) fn finish(&mut self, worker: &WorkerId, completions: &[Completion], now: DbTime) -> DbReply {
        let mut applied = Vec::new();
        let mut lost = Vec::new();
        let mut retried = BTreeSet::new();
        for Completion { task: TaskLease { task: id, lease }, outcome, args } in completions {
            let id = *id;
            match self.live.get(&id).filter(|row| row.held_by(worker, *lease)).map(|row| row.state) {
                Some(TaskState::Running) => {}
                // Started by the worker without a start request: the run counts here.
                Some(TaskState::Claimed) => {
                    self.start_row(id, now);
                }
                _ => {
                    lost.push(id);
                    continue;
                }
            }
            if let (Some(args), false) = (args, matches!(outcome, FinishOutcome::Completed(_))) {
                self.live.get_mut(&id).expect("a held task is live").args = args.clone();
            }
            let state = match outcome {
                FinishOutcome::Completed(result) => {
                    self.record_attempt(id, TaskState::Completed, None, now);
                    self.finish_row(id, TaskEvent::Complete, now, None, Some(result.clone()))
                }
                FinishOutcome::Failed(error) => self.fail_run(id, error.clone(), now),
                FinishOutcome::Retry { error, delay_ms } => {
                    let run_at = now.plus_ms(*delay_ms);
                    if self.live_row(id).good_until.is_some_and(|at| run_at >= at) {
                        self.fail_run(id, error.clone(), now)
                    } else {
                        retried.insert(self.live_row(id).queue.clone());
                        self.retry_run(id, error.clone(), run_at, now)
                    }
                }
            };
            applied.push((id, state));
        }
        // A retry is work that becomes ready later: tell the listeners so their next claim
        // learns when (`next_run_in_ms`).
        self.notify_ready(retried);
        DbReply::Finished { applied, lost }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn heartbeat(
        &mut self,
        worker: &WorkerId,
        claimed: &[TaskLease],
        running: &[TaskLease],
        lease_ms: u64,
        max_renew_age_ms: u64,
        abandoned: &[u64],
        now: DbTime,
    ) -> DbReply {
        let mut lost = Vec::new();
        let mut busy = Vec::new();
        let oldest_renewable = minus_ms(now, max_renew_age_ms);
        for &TaskLease { task: id, lease } in claimed {
            if self.locked.contains(&id) {
                busy_or_lost(self.live.get(&id), worker, lease, id, &mut busy, &mut lost);
                continue;
            }
            match self.live.get_mut(&id) {
                Some(row) if row.state == TaskState::Claimed && row.held_by(worker, lease) => {
                    // A lapsed claim is not renewed: claimers already count it out (a serial
                    // queue or a hard cap would overshoot) and may take it; its start fails.
                    let live = row.claim_expires_at.is_none_or(|at| at > now);
                    if live && row.claimed_at.is_some_and(|at| at >= oldest_renewable) {
                        row.claim_expires_at = Some(now.plus_ms(lease_ms));
                        row.heartbeat_at = Some(now);
                    }
                }
                // Started under the same lease since the beat was sent (a start that raced it):
                // still held, and alive.
                Some(row) if row.state == TaskState::Running && row.held_by(worker, lease) => {
                    row.heartbeat_at = Some(now);
                }
                _ => lost.push(id),
            }
        }
        for &TaskLease { task: id, lease } in running {
            if self.locked.contains(&id) {
                busy_or_lost(self.live.get(&id), worker, lease, id, &mut busy, &mut lost);
                continue;
            }
            match self.live.get_mut(&id) {
                Some(row) if row.state == TaskState::Running && row.held_by(worker, lease) => {
                    row.heartbeat_at = Some(now);
                }
                _ => lost.push(id),
            }
        }
        let handed_back = if abandoned.is_empty() {
            Vec::new()
        } else {
            // Rows the beat names under their current lease are the worker's: not left behind.
            let named: BTreeSet<TaskLease> = claimed.iter().chain(running).copied().collect();
            self.abandon_claims(worker, abandoned, &named)
        };
        self.workers.entry(worker.clone()).and_modify(|record| record.last_seen = now).or_insert_with(|| {
            WorkerRecord {
                info: WorkerInfo { worker: worker.clone(), queues: Vec::new(), concurrency: 0 },
                last_seen: now,
                stopped: false,
            }
        });
        DbReply::Heartbeat { lost, busy, handed_back }
    }

    pub(super) fn release(&mut self, worker: &WorkerId, tasks: &[TaskLease]) -> DbReply {
        let mut released = Vec::new();
        let mut lost = Vec::new();
        let mut queues = BTreeSet::new();
        for &TaskLease { task: id, lease } in tasks {
            let held = self.live.get(&id).is_some_and(|row| {
                matches!(row.state, TaskState::Claimed | TaskState::Running) && row.held_by(worker, lease)
            });
            if held {
                queues.insert(self.release_row(id));
                released.push(id);
            } else {
                lost.push(id);
            }
        }
        self.notify_ready(queues);
        DbReply::Released { released, lost }
    }

    /// Undoes the claims `tokens` of `worker`: every row still held under one of them goes back
    /// to Pending, and a Running one gives back the attempt the claim counted (its worker never
    /// saw the claim, so nothing ran). Rows other transactions hold locked, and rows `except`
    /// names under their current lease, are left. Returns the rows handed back, by id.
    pub(super) fn abandon_claims(
        &mut self,
        worker: &WorkerId,
        tokens: &[u64],
        except: &BTreeSet<TaskLease>,
    ) -> Vec<TaskId> {
        let ids: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| {
                matches!(row.state, TaskState::Claimed | TaskState::Running)
                    && row.claimed_by.as_ref() == Some(worker)
                    && row.claim_token.is_some_and(|token| tokens.contains(&token))
                    && !self.locked.contains(&row.id)
                    && !except.contains(&TaskLease { task: row.id, lease: row.lease })
            })
            .map(|row| row.id)
            .collect();
        let mut queues = BTreeSet::new();
        for &id in &ids {
            let row = self.live_row(id);
            if row.state == TaskState::Running {
                row.attempts = row.attempts.saturating_sub(1);
                if row.attempts == 0 {
                    row.started_at = None;
                }
            }
            queues.insert(self.release_row(id));
        }
        self.notify_ready(queues);
        ids
    }

    pub(super) fn reap(
        &mut self,
        claimed_stale_ms: Option<u64>,
        running_stale_ms: Option<u64>,
        entropy: u64,
        now: DbTime,
    ) -> ReapReport {
        let mut report = ReapReport::default();
        // One transaction in PostgreSQL, which delivers a notification sent twice in one
        // transaction once: each queue is announced once per pass.
        let mut ready = BTreeSet::new();
        if let Some(threshold) = claimed_stale_ms {
            let cutoff = minus_ms(now, threshold);
            let stale: Vec<TaskId> = self
                .live
                .values()
                .filter(|row| {
                    row.state == TaskState::Claimed
                        && row.heartbeat_at.or(row.claimed_at).is_some_and(|at| at < cutoff)
                        && !self.locked.contains(&row.id)
                })
                .map(|row| row.id)
                .collect();
            ready.extend(stale.iter().map(|&id| self.release_row(id)));
            report.requeued = stale;
        }
        if let Some(threshold) = running_stale_ms {
            let cutoff = minus_ms(now, threshold);
            let stale: Vec<TaskId> = self
                .live
                .values()
                .filter(|row| {
                    row.state == TaskState::Running
                        && row.heartbeat_at.or(row.started_at).is_some_and(|at| at < cutoff)
                        && !self.locked.contains(&row.id)
                })
                .map(|row| row.id)
                .collect();
            for id in stale {
                self.crash_run(id, entropy, now, &mut report, &mut ready);
            }
        }
        self.notify_ready(ready);
        // A statement of its own in PostgreSQL: the steps it failed settle before the expiry.
        self.settle_workflows(now);
        let expired: Vec<TaskId> = self
            .live
            .values()
            .filter(|row| {
                row.state == TaskState::Pending
                    && row.good_until.is_some_and(|at| at <= now)
                    && !self.locked.contains(&row.id)
            })
            .map(|row| row.id)
            .collect();
        for &id in &expired {
            let error = TaskError::new(ErrorCode::TaskExpired, TASK_EXPIRED_MESSAGE);
            self.finish_row(id, TaskEvent::Expire, now, Some(error), None);
        }
        report.expired = expired;
        let oldest = minus_ms(now, self.app.recovery.worker_retention_ms);
        let holders: BTreeSet<&WorkerId> = self.live.values().filter_map(|row| row.claimed_by.as_ref()).collect();
        let gone: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, record)| record.last_seen < oldest && !holders.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        report.workers_pruned = gone.len() as u64;
        for id in gone {
            self.workers.remove(&id);
            // Its registry row held the record of its token.
            self.tokens.recorded.remove(&id);
        }
        report
    }
}

fn add_in_flight(in_flight: &mut InFlight, running: bool) {
    if running {
        in_flight.running = in_flight.running.saturating_add(1);
    } else {
        in_flight.claimed = in_flight.claimed.saturating_add(1);
    }
}

/// A row named by a beat that another transaction holds locked: still held (busy) when its
/// holder and lease match, else lost.
fn busy_or_lost(
    row: Option<&StoredTask>,
    worker: &WorkerId,
    lease: Lease,
    id: TaskId,
    busy: &mut Vec<TaskId>,
    lost: &mut Vec<TaskId>,
) {
    let held = row
        .is_some_and(|row| matches!(row.state, TaskState::Claimed | TaskState::Running) && row.held_by(worker, lease));
    if held { busy.push(id) } else { lost.push(id) }
}

/// What PostgreSQL refuses in a completion's values: text with U+0000 (`jsonb` cannot hold
/// it) and values over its size limit. Depth it stores (it is reading them back that fails).
fn refused_values(completion: &Completion) -> Result<(), store::UnstorableValue> {
    let limit = crate::config::MAX_STORED_VALUE_BYTES;
    let refused = |value: &Value| match store::check_storable(value, limit) {
        Err(store::UnstorableValue::TooDeep { .. }) | Ok(_) => Ok(()),
        Err(other) => Err(other),
    };
    match &completion.outcome {
        FinishOutcome::Completed(result) => refused(result)?,
        FinishOutcome::Failed(error) | FinishOutcome::Retry { error, .. } => {
            match store::check_storable_error(error, limit) {
                Err(store::UnstorableValue::TooDeep { .. }) | Ok(_) => {}
                Err(other) => return Err(other),
            }
        }
    }
    completion.args.as_ref().map_or(Ok(()), refused)
}
