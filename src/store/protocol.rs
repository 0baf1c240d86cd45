//! The worker↔store protocol: what the worker machine asks a store to do ([`DbRequest`]),
//! what it answers ([`DbReply`]) or how it failed ([`DbFailure`]), correlated by an [`OpId`];
//! and what a store announces ([`Notification`]).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::budget::ClaimPolicy;
use crate::config::RetryPolicy;
pub use crate::task::DbTime;
use crate::task::{Attempt, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};

/// How many finished tasks one purge statement deletes unless told otherwise (see
/// [`DbRequest::Purge`]): small enough that no statement holds its locks for long.
pub const DEFAULT_PURGE_BATCH: u32 = 1_000;

/// Correlates a request with its reply. Issued by the worker machine, opaque to everyone else
/// (a driver hands back the one it was given); replies carrying an id the machine no longer
/// waits for are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(pub(crate) u64);

impl OpId {
    /// An id from its number, which only the machine issues: for tests that reply to an op
    /// the machine never sent (feature `sim`).
    #[cfg(feature = "sim")]
    pub fn from_raw(n: u64) -> OpId {
        OpId(n)
    }

    /// Its number: a claim's token is the number of its op (feature `sim`, for tests).
    #[cfg(feature = "sim")]
    pub fn raw(self) -> u64 {
        self.0
    }
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// A task as a claim hands it to a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimedTask {
    /// The task.
    pub id: TaskId,
    /// The claim generation this worker now holds.
    pub lease: Lease,
    /// The registered handler name.
    pub name: String,
    /// Its queue.
    pub queue: String,
    /// Its arguments.
    pub args: serde_json::Value,
    /// Its priority.
    pub priority: i16,
    /// When it was enqueued (or last replaced by a key), on the store's clock.
    pub enqueued_at: DbTime,
    /// When it became claimable, on the store's clock.
    pub run_at: DbTime,
    /// Whether the claim also started it (it is Running, `attempt` is this run's number);
    /// otherwise it is Claimed and `attempt` is the number its start will have.
    pub started: bool,
    /// The run this is: 1 for the first.
    pub attempt: Attempt,
    /// Retries already spent.
    pub retries: u32,
    /// Its retry policy: its own, or the app's (resolved at enqueue by the memory store, at
    /// claim by PostgreSQL, which stores no copy of the default in every row).
    pub retry: RetryPolicy,
    /// Whether it has a good-until: then only a [`DbRequest::Start`], which checks it on the
    /// store's clock, may start it.
    pub expires: bool,
    /// Why the store could not read the stored arguments (nested too deep, a number out of
    /// range: anything its decoder refuses), if it could not; `args` is then `null`. The
    /// worker fails such a task with `WORKER_SERIALIZATION_ERROR` without running it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_error: Option<String>,
    /// Why the store could not read the task's own stored retry policy, if it could not;
    /// `retry` is then the app's. The worker reports it and runs the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_error: Option<String>,
}

/// A finished run and what it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The task and the lease it ran under.
    pub task: TaskLease,
    /// What to record.
    pub outcome: FinishOutcome,
    /// New arguments to store with a failure (retried or not): the items of a batch task that
    /// failed, so only those run again. `None` keeps the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<serde_json::Value>,
}

/// What a finished run records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishOutcome {
    /// Completed with this result.
    Completed(serde_json::Value),
    /// Failed, and runs again after `delay_ms` unless that is at or past good-until, in which
    /// case the store fails it with `error` instead.
    Retry {
        /// The error of this run.
        error: TaskError,
        /// How long to wait before it is claimable again.
        delay_ms: u64,
    },
    /// Failed for good.
    Failed(TaskError),
}

/// Identity and shape of a worker, kept in the worker registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker.
    pub worker: WorkerId,
    /// The queues it serves.
    pub queues: Vec<String>,
    /// Its concurrency.
    pub concurrency: u32,
}

/// A request the worker machine asks a store to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DbRequest {
    /// Claim tasks for `worker` under `policy`, following [`budget::plan`](crate::budget::plan)
    /// with the counts the store observes. Claimed rows get `lease = previous + 1`,
    /// `claimed_by = worker`, `claim_token = token`, a lease until `now + lease_ms`. The first
    /// `start_now` of them in claim order start at once (Running, `attempts + 1`). Replies
    /// [`DbReply::Claimed`] in claim order, with `more` set when some eligible row of a served
    /// queue was left behind.
    Claim {
        /// Who claims.
        worker: WorkerId,
        /// Stamped on the claimed rows so an unanswered claim can be undone
        /// ([`DbRequest::AbandonClaim`]).
        token: u64,
        /// The caps to respect.
        policy: Arc<ClaimPolicy>,
        /// Handlers this worker runs now.
        my_running: u32,
        /// Claims this worker holds that have not started.
        my_claimed: u32,
        /// How many of the claimed tasks to start in the same statement.
        start_now: u32,
        /// The claim lease.
        lease_ms: u64,
    },
    /// Start claimed tasks: Claimed to Running when held by `worker` under that lease and not
    /// past its claim lease. Past good-until it becomes Expired instead; in soft-cap mode a
    /// task whose queue is at its cap stays Claimed (`deferred`), as does one whose row
    /// another transaction holds locked (skipped, not waited for). Replies
    /// [`DbReply::Started`].
    Start {
        /// Who starts them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
        /// The queue caps to re-check (soft-cap mode).
        policy: Arc<ClaimPolicy>,
    },
    /// Record that claimed tasks already run (see [`DbRequest::Finish`] for why a worker may
    /// start a task without asking): Claimed to Running when held by `worker` under that
    /// lease, whatever its claim lease, good-until or queue cap (the start already happened,
    /// and was allowed when it did); a task already Running under that lease is reported
    /// started again. Replies [`DbReply::Started`] with nothing expired or deferred.
    RecordStarts {
        /// Who runs them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
    },
    /// Record finished runs, each fenced by lease: completed and failed tasks become terminal
    /// (and move to the finished table), retried ones Pending with `run_at = now + delay_ms`
    /// and `retries + 1`. A task held Running, or held Claimed by a worker that started it
    /// without a [`DbRequest::Start`] (soft-cap mode, a queue without a cap, no good-until:
    /// nothing the store would check), is applied; a Claimed one counts its run as an
    /// attempt here. Replies [`DbReply::Finished`].
    Finish {
        /// Who ran them.
        worker: WorkerId,
        /// The outcomes.
        completions: Vec<Completion>,
    },
    /// A [`DbRequest::Finish`] and then a [`DbRequest::Claim`] by the same worker, in one
    /// statement (one transaction, one round trip): the claim sees what the finish did, so the
    /// slots and cap room the finish frees are claimed at once. Replies
    /// [`DbReply::FinishedAndClaimed`]; fails as a whole. The worker machine sends it in
    /// hard-cap mode, where every claim is bounded by free slots.
    FinishAndClaim {
        /// Who ran them, and claims.
        worker: WorkerId,
        /// The outcomes, as [`DbRequest::Finish`] carries them.
        completions: Vec<Completion>,
        /// The claim's token, as [`DbRequest::Claim`]'s.
        token: u64,
        /// As [`DbRequest::Claim`]'s.
        policy: Arc<ClaimPolicy>,
        /// As [`DbRequest::Claim`]'s: handlers running once these outcomes are written.
        my_running: u32,
        /// As [`DbRequest::Claim`]'s.
        my_claimed: u32,
        /// As [`DbRequest::Claim`]'s.
        start_now: u32,
        /// As [`DbRequest::Claim`]'s.
        lease_ms: u64,
    },
    /// Renew what `worker` holds: Claimed tasks get their lease extended to `now + lease_ms`
    /// (unless claimed more than `max_renew_age_ms` ago, or lapsed already: claimers count a
    /// lapsed claim out), Running tasks a fresh heartbeat; the worker's registry row is
    /// marked alive. Rows another transaction has locked are skipped, not waited for
    /// (`busy`): one locked row never holds up the beat of the others. Replies
    /// [`DbReply::Heartbeat`] with the tasks no longer held.
    Heartbeat {
        /// Who beats.
        worker: WorkerId,
        /// Held claims.
        claimed: Vec<TaskLease>,
        /// Running tasks.
        running: Vec<TaskLease>,
        /// The claim lease.
        lease_ms: u64,
        /// Claims older than this are not renewed and expire naturally.
        max_renew_age_ms: u64,
        /// Tokens of claims this worker abandoned ([`DbRequest::AbandonClaim`]) lately: rows a
        /// late commit of such a claim left claimed by the worker are handed back, as the
        /// abandon hands them back, so a claim that commits after its client gave up never
        /// keeps tasks nobody runs.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        abandoned: Vec<u64>,
    },
    /// Hand tasks back: Claimed or Running held under that lease becomes Pending without
    /// spending a retry, claimable at once. Replies [`DbReply::Released`].
    Release {
        /// Who holds them.
        worker: WorkerId,
        /// The tasks and their leases.
        tasks: Vec<TaskLease>,
    },
    /// Undo a claim whose reply never came: every row still Claimed or Running by `worker`
    /// under claim `token` goes back to Pending as by [`DbRequest::Release`], and a row the
    /// claim started gives back the attempt it counted (its handler never ran: the worker never
    /// saw the claim). Replies [`DbReply::Released`].
    AbandonClaim {
        /// Who claimed.
        worker: WorkerId,
        /// The claim's token.
        token: u64,
    },
    /// Recover what dead workers left, as one reaper (a store lets one act at a time):
    /// Claimed tasks with no claimer heartbeat (or claim) for `claimed_stale_ms` back to
    /// Pending; Running tasks with no runner heartbeat (or start) for `running_stale_ms`
    /// retried with `WORKER_CRASHED` if their policy allows it before good-until, else Failed;
    /// Pending tasks past good-until Expired. `None` thresholds skip that step. Workers the
    /// registry has not seen for the store's `recovery.worker_retention_ms` and that hold no
    /// task are deleted. Replies [`DbReply::Reaped`].
    Reap {
        /// Who reaps.
        worker: WorkerId,
        /// Threshold for stale claims.
        claimed_stale_ms: Option<u64>,
        /// Threshold for stale runs.
        running_stale_ms: Option<u64>,
        /// Entropy for the jitter of crash retries.
        entropy: u64,
    },
    /// Recover at once what dead workers left: a worker whose liveness token (a lock its
    /// session holds, see `recovery.auto_recover_dead_workers`) the store finds released, in
    /// the server incarnation the worker took it in, for at least `grace_ms`, is dead. Its
    /// Claimed tasks go back to Pending and its Running tasks are retried or failed with
    /// `WORKER_CRASHED` as the reaper does stale runs; the store forgets its token so it is
    /// not looked at again (until the worker, alive after all, takes it again). A token seen
    /// released for the first time is noted, not acted on. Any number may run at once: each
    /// dead worker is recovered by one. Replies [`DbReply::Reaped`] (`dead_workers`).
    ReapDead {
        /// Who reaps.
        worker: WorkerId,
        /// How long a token must have been released.
        grace_ms: u64,
        /// Entropy for the jitter of crash retries.
        entropy: u64,
    },
    /// Delete finished tasks that finished more than `older_than_ms` ago, with their attempts
    /// history and the keys they still hold, at most `batch` per statement (PostgreSQL repeats
    /// until a batch comes back short, each statement its own transaction). Tasks an
    /// idempotency key names stay for the store's `recovery.idempotency_retention_ms`. Replies
    /// [`DbReply::Purged`].
    Purge {
        /// The retention.
        older_than_ms: u64,
        /// Tasks per statement (0 is taken as 1).
        batch: u32,
    },
    /// Vacuum the store's hot tables (the live tasks, keys, the registry, the lock and queue
    /// tables) that hold at least `min_dead_rows` dead rows more than a vacuum of this store
    /// last left there: what keeps them small on a server that does not vacuum them (no
    /// autovacuum, or one too slow for a queue's churn). A table another vacuum is working on
    /// is skipped. Replies [`DbReply::Vacuumed`]; a store without dead rows vacuums nothing.
    Vacuum {
        /// The threshold.
        min_dead_rows: u64,
    },
    /// Add or refresh `worker` in the worker registry.
    RegisterWorker(WorkerInfo),
    /// Mark `worker` stopped in the worker registry (and no longer waiting, see
    /// [`DbRequest::SetWaiting`]).
    DeregisterWorker(WorkerId),
    /// Mark `worker` waiting on `queues`, or (`waiting` false) not, or only for tasks more
    /// urgent than `urgent_below`. Enqueues a client commits in their own statement notify a
    /// queue only while some worker's mark of it takes their most urgent task in, so a worker
    /// marks itself once a claim pass leaves nothing behind, claims once more after the mark
    /// (what committed without a notification meanwhile), and narrows its mark to tasks more
    /// urgent than its backlog while it works through one (an urgent task still overtakes its
    /// buffer). A mark waits for the enqueues in flight (and holds new ones back) until it is
    /// written; a mark already there as asked is left as it is, which makes marking again a
    /// cheap renewal. A written mark, and any unmark, deletes the marks of other workers the
    /// registry has stopped, has not, or has not seen for their own stale thresholds. Replies
    /// [`DbReply::WaitingSet`].
    SetWaiting {
        /// Who waits.
        worker: WorkerId,
        /// The queues it serves.
        queues: Vec<String>,
        /// Marked (true) or not.
        waiting: bool,
        /// Not waiting: still notified of tasks more urgent (lower) than this, the least
        /// urgent priority of the backlog it works through; `None`: of nothing.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        urgent_below: Option<i16>,
        /// This worker's own stale threshold (its `running_stale_threshold_ms`), kept with its
        /// mark: another worker's mark or unmark deletes the mark once the registry has not
        /// seen this worker for that long (or has it stopped, or does not have it).
        stale_ms: u64,
    },
}

impl DbRequest {
    /// A [`DbRequest::FinishAndClaim`] as the [`DbRequest::Finish`] and the
    /// [`DbRequest::Claim`] it is made of, in that order; `None` for any other request.
    pub fn finish_then_claim(&self) -> Option<(DbRequest, DbRequest)> {
        let DbRequest::FinishAndClaim {
            worker,
            completions,
            token,
            policy,
            my_running,
            my_claimed,
            start_now,
            lease_ms,
        } = self
        else {
            return None;
        };
        let finish = DbRequest::Finish { worker: worker.clone(), completions: completions.clone() };
        let claim = DbRequest::Claim {
            worker: worker.clone(),
            token: *token,
            policy: Arc::clone(policy),
            my_running: *my_running,
            my_claimed: *my_claimed,
            start_now: *start_now,
            lease_ms: *lease_ms,
        };
        Some((finish, claim))
    }

    /// How many tasks (or claims) the request names: its batch size, for logs and traces.
    pub fn items(&self) -> usize {
        match self {
            DbRequest::Start { tasks, .. }
            | DbRequest::RecordStarts { tasks, .. }
            | DbRequest::Release { tasks, .. } => tasks.len(),
            DbRequest::Finish { completions, .. } | DbRequest::FinishAndClaim { completions, .. } => completions.len(),
            DbRequest::Heartbeat { claimed, running, .. } => claimed.len() + running.len(),
            DbRequest::Claim { .. }
            | DbRequest::AbandonClaim { .. }
            | DbRequest::Reap { .. }
            | DbRequest::ReapDead { .. }
            | DbRequest::Purge { .. }
            | DbRequest::Vacuum { .. }
            | DbRequest::RegisterWorker(_)
            | DbRequest::DeregisterWorker(_)
            | DbRequest::SetWaiting { .. } => 0,
        }
    }

    /// Whether this is a claim bounded by priority: the small claim beside the passes for
    /// announced tasks more urgent than the buffer, or for what waits below a pass's floor. It
    /// goes on a connection of its own.
    pub fn is_urgent_claim(&self) -> bool {
        matches!(self, DbRequest::Claim { policy, .. } if policy.max_priority.is_some())
    }

    /// A short name for logs and traces.
    pub fn kind(&self) -> &'static str {
        match self {
            DbRequest::Claim { .. } => "claim",
            DbRequest::Start { .. } => "start",
            DbRequest::RecordStarts { .. } => "record_starts",
            DbRequest::Finish { .. } => "finish",
            DbRequest::FinishAndClaim { .. } => "finish_and_claim",
            DbRequest::Heartbeat { .. } => "heartbeat",
            DbRequest::Release { .. } => "release",
            DbRequest::AbandonClaim { .. } => "abandon_claim",
            DbRequest::Reap { .. } => "reap",
            DbRequest::ReapDead { .. } => "reap_dead",
            DbRequest::Purge { .. } => "purge",
            DbRequest::Vacuum { .. } => "vacuum",
            DbRequest::RegisterWorker(_) => "register_worker",
            DbRequest::DeregisterWorker(_) => "deregister_worker",
            DbRequest::SetWaiting { .. } => "set_waiting",
        }
    }
}

/// A store's answer to a [`DbRequest`], variant for variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DbReply {
    /// What a [`DbRequest::Claim`] took.
    Claimed {
        /// The tasks claimed, in claim order.
        tasks: Vec<ClaimedTask>,
        /// Whether the pass saw eligible tasks in the served queues that it did not take (its
        /// budget or a cap stopped it): the worker claims again when it has room.
        more: bool,
        /// When `more` is false (the worker will wait): milliseconds from the store's now to the
        /// earliest `run_at` still in the future among Pending tasks of the served queues, if
        /// there is one. No notification comes when a delayed or retried task becomes due, so
        /// the worker arms a wake-up for it. Always `None` when `more` is true.
        next_run_in_ms: Option<u64>,
    },
    /// What became of a [`DbRequest::Start`] or [`DbRequest::RecordStarts`].
    Started {
        /// Started, with the number of this run.
        started: Vec<(TaskId, Attempt)>,
        /// Past good-until: now Expired, not to run.
        expired: Vec<TaskId>,
        /// Queue at its cap: still Claimed, try again later.
        deferred: Vec<TaskId>,
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
    },
    /// What became of a [`DbRequest::Finish`].
    Finished {
        /// Applied, with the state each task is in now (Pending for a retry).
        applied: Vec<(TaskId, TaskState)>,
        /// Not held under that lease any more: nothing written.
        lost: Vec<TaskId>,
    },
    /// What a [`DbRequest::FinishAndClaim`] did: the finish's answer, then the claim's.
    FinishedAndClaimed {
        /// As [`DbReply::Finished`]'s.
        applied: Vec<(TaskId, TaskState)>,
        /// As [`DbReply::Finished`]'s.
        lost: Vec<TaskId>,
        /// As [`DbReply::Claimed`]'s.
        tasks: Vec<ClaimedTask>,
        /// As [`DbReply::Claimed`]'s.
        more: bool,
        /// As [`DbReply::Claimed`]'s.
        next_run_in_ms: Option<u64>,
    },
    /// What a [`DbRequest::Heartbeat`] found.
    Heartbeat {
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
        /// Locked by another transaction: not renewed this time; still held, for all the store
        /// knows.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        busy: Vec<TaskId>,
        /// Rows of abandoned claims that committed late, handed back to Pending.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        handed_back: Vec<TaskId>,
    },
    /// What became of a [`DbRequest::Release`] or [`DbRequest::AbandonClaim`].
    Released {
        /// Back to Pending.
        released: Vec<TaskId>,
        /// Not held under that lease any more.
        lost: Vec<TaskId>,
    },
    /// What a [`DbRequest::Reap`] did.
    Reaped(ReapReport),
    /// How many finished tasks a [`DbRequest::Purge`] deleted.
    Purged {
        /// The count.
        tasks: u64,
    },
    /// The tables a [`DbRequest::Vacuum`] vacuumed.
    Vacuumed {
        /// Each table, with its dead rows before and after.
        tables: Vec<VacuumedTable>,
    },
    /// A registry request was applied.
    Done,
    /// What a [`DbRequest::SetWaiting`] did.
    WaitingSet {
        /// Whether it wrote the worker's mark (false: the mark was there as asked, or it was
        /// an unmark or a narrowing). The worker claims once more after a mark it did not hold
        /// before, and after a written one: enqueues that committed before it notified nobody.
        written: bool,
    },
}

impl DbReply {
    /// The reply's kind, as logs and errors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            DbReply::FinishedAndClaimed { .. } => "finished_and_claimed",
            DbReply::Claimed { .. } => "claimed",
            DbReply::Started { .. } => "started",
            DbReply::Finished { .. } => "finished",
            DbReply::Heartbeat { .. } => "heartbeat",
            DbReply::Released { .. } => "released",
            DbReply::Reaped(_) => "reaped",
            DbReply::Purged { .. } => "purged",
            DbReply::Vacuumed { .. } => "vacuumed",
            DbReply::Done => "done",
            DbReply::WaitingSet { .. } => "waiting_set",
        }
    }

    /// The [`DbReply::Finished`] and [`DbReply::Claimed`] answers a
    /// [`DbReply::FinishedAndClaimed`] is made of; any other reply as it is, with no second.
    pub fn into_finished_and_claimed(self) -> (DbReply, Option<DbReply>) {
        match self {
            DbReply::FinishedAndClaimed { applied, lost, tasks, more, next_run_in_ms } => {
                (DbReply::Finished { applied, lost }, Some(DbReply::Claimed { tasks, more, next_run_in_ms }))
            }
            other => (other, None),
        }
    }

    /// Joins a finish's answer and a claim's into a [`DbReply::FinishedAndClaimed`]; `None`
    /// unless they are a [`DbReply::Finished`] and a [`DbReply::Claimed`].
    pub fn finished_and_claimed(finished: DbReply, claimed: DbReply) -> Option<DbReply> {
        match (finished, claimed) {
            (DbReply::Finished { applied, lost }, DbReply::Claimed { tasks, more, next_run_in_ms }) => {
                Some(DbReply::FinishedAndClaimed { applied, lost, tasks, more, next_run_in_ms })
            }
            _ => None,
        }
    }
}

/// One table a [`DbRequest::Vacuum`] vacuumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VacuumedTable {
    /// Its name.
    pub table: String,
    /// Dead rows the statistics counted before.
    pub dead_before: u64,
    /// Dead rows left after (rows a transaction may still see: an open snapshot holds them).
    pub dead_after: u64,
}

/// What one reaper pass changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReapReport {
    /// Stale claims put back to Pending.
    pub requeued: Vec<TaskId>,
    /// Stale runs retried with `WORKER_CRASHED`.
    pub retried: Vec<TaskId>,
    /// Stale runs failed with `WORKER_CRASHED`.
    pub failed: Vec<TaskId>,
    /// Pending tasks expired.
    pub expired: Vec<TaskId>,
    /// Whether the pass did nothing because another reaper held the reaper's lock.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Workers deleted from the registry: silent for longer than
    /// `recovery.worker_retention_ms`, holding no task.
    #[serde(default)]
    pub workers_pruned: u64,
    /// Workers found dead by their released liveness token ([`DbRequest::ReapDead`]), whose
    /// tasks the pass recovered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dead_workers: Vec<WorkerId>,
}

impl fmt::Display for ReapReport {
    /// What the pass changed, for logs: `requeued 2 (ids 4, 7), failed 1 (id 9)`; the ids of
    /// each kind up to ten.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for (what, ids) in [
            ("requeued", &self.requeued),
            ("retried", &self.retried),
            ("failed", &self.failed),
            ("expired", &self.expired),
        ] {
            if !ids.is_empty() {
                let shown: Vec<String> = ids.iter().take(10).map(TaskId::to_string).collect();
                let more = if ids.len() > 10 { ", …" } else { "" };
                parts.push(format!("{what} {} (ids {}{more})", ids.len(), shown.join(", ")));
            }
        }
        if !self.dead_workers.is_empty() {
            let dead: Vec<&str> = self.dead_workers.iter().map(|w| w.0.as_str()).collect();
            parts.push(format!("dead workers {}", dead.join(", ")));
        }
        if self.workers_pruned > 0 {
            parts.push(format!("workers pruned {}", self.workers_pruned));
        }
        if parts.is_empty() {
            parts.push(if self.skipped { "skipped: another reaper holds the lock" } else { "nothing" }.to_owned());
        }
        f.write_str(&parts.join(", "))
    }
}

impl ReapReport {
    /// Whether the pass changed anything: a task, or the worker registry.
    pub fn changed_anything(&self) -> bool {
        !(self.requeued.is_empty() && self.retried.is_empty() && self.failed.is_empty() && self.expired.is_empty())
            || self.workers_pruned > 0
            || !self.dead_workers.is_empty()
    }
}

/// Why a request has no reply. Faults are inputs to the worker machine, not errors of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum DbFailure {
    /// The request was not applied: no connection, the pool timed out, the database is down.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The request was sent and no answer came: it may or may not have been applied.
    #[error("database reply unknown: {0}")]
    Unknown(String),
    /// The database refused the request (a bug or a schema mismatch); nothing was applied.
    #[error("database rejected the request: {0}")]
    Rejected(String),
    /// The database (or the client, encoding it) refused a value the request carries: text
    /// with U+0000, a value over a size limit, a number out of range (SQLSTATE classes 22 and
    /// 54). Nothing was applied. The request is not at fault as a whole: a batch is split until
    /// the item that carries the value is alone.
    #[error("database refused a value of the request: {0}")]
    Invalid(String),
    /// Another transaction held a row (or a lock) the request needed for longer than the
    /// session's `lock_timeout`; nothing was applied. A batch is split, so that one row held
    /// for long does not hold up the others.
    #[error("a lock the request waited for was held too long: {0}")]
    LockTimeout(String),
}

/// The message of the error a task gets when the reaper finds its worker gone.
pub const WORKER_CRASHED_MESSAGE: &str = "worker stopped sending heartbeats";

/// The message of the error a task gets when its good-until time passes before it runs.
pub const TASK_EXPIRED_MESSAGE: &str = "good_until passed before the task ran";

/// Something PostgreSQL would announce with `NOTIFY`, for drivers to deliver.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Notification {
    /// Tasks of this queue may have become claimable (one per statement per queue).
    TaskReady {
        /// The queue.
        queue: String,
        /// For tasks enqueued (or updated by a key), the most urgent priority among them: a
        /// worker whose buffer holds less urgent tasks claims it at once. `None` for tasks that
        /// became claimable otherwise (released, retried, rescheduled, resumed).
        priority: Option<i16>,
        /// For tasks enqueued without keys, the earliest run-at among them: a worker whose
        /// claims since its last full look were woken only by such announcements claims from
        /// the earliest of their run-ats on (see [`ClaimPolicy::min_run_at`]). `None` otherwise.
        ///
        /// [`ClaimPolicy::min_run_at`]: crate::budget::ClaimPolicy::min_run_at
        run_at: Option<DbTime>,
    },
    /// A task reached a terminal state.
    TaskFinished {
        /// The task.
        task: TaskId,
        /// Its terminal state.
        state: TaskState,
    },
    /// Claimed or running tasks were taken from their holders (a workflow's cancel): a worker
    /// holding one beats at once, and the beat's answer says which it lost, so it aborts their
    /// handlers without waiting for its heartbeat interval.
    TasksRevoked {
        /// The tasks.
        tasks: Vec<TaskId>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reap_report_reads_as_words() {
        let report = ReapReport {
            requeued: (1..=12).map(TaskId).collect(),
            failed: vec![TaskId(40)],
            dead_workers: vec![WorkerId("w-1".into())],
            ..ReapReport::default()
        };
        assert_eq!(
            report.to_string(),
            "requeued 12 (ids 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, …), failed 1 (ids 40), dead workers w-1"
        );
        let skipped = ReapReport { skipped: true, ..ReapReport::default() };
        assert_eq!(skipped.to_string(), "skipped: another reaper holds the lock");
    }
}
