//! The faults a run injects during its safety phase, and how each is sampled.
//!
//! Faults are inputs to the worker machine, never errors of the harness: a database request
//! meets latency, an outage, a failure before it is applied, or a lost reply after it is
//! applied (the `commit_unknown_result` of FoundationDB); notifications are lost, duplicated
//! and delayed; listeners disconnect; workers crash (their in-flight requests may still land)
//! and restart under a new id, or shut down gracefully and restart; handlers are slow, hang,
//! fail and panic (see [`LoadOptions`](super::LoadOptions)); a handler's answer may arrive
//! after its abort. And the faults of bad data and slow locks: handlers answer values the
//! database refuses (U+0000, values over a server-side limit), other producers write rows no
//! reader can decode, requests commit after their reply timed out (and after the worker tried
//! to undo them), and other transactions hold rows locked for seconds.

use crate::rng::Rng;

/// What happens to one database request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Applied, and the reply arrives.
    Delivered,
    /// Not applied: the connection or pool failed first (`DbFailure::Unavailable`).
    Unavailable,
    /// Not applied, and no answer came (`DbFailure::Unknown`).
    LostRequest,
    /// Applied (committed), and the reply was lost (`DbFailure::Unknown`).
    LostReply,
    /// Refused by the database (`DbFailure::Rejected`): nothing applied.
    Rejected,
    /// No answer came (`DbFailure::Unknown`), and the request commits later still: after the
    /// worker was told it is unknown, and after whatever it sent to undo it.
    LateCommit,
}

/// Fault rates and windows. Chances are per request, per notification or per handler answer.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultOptions {
    /// Shortest one-way database latency.
    pub latency_min_ms: u64,
    /// Longest one-way database latency (before spikes).
    pub latency_max_ms: u64,
    /// Chance a one-way trip takes a spike instead: up to `spike_max_ms`.
    pub spike_chance: f64,
    /// The longest spike.
    pub spike_max_ms: u64,
    /// Chance a request fails unapplied with `Unavailable`.
    pub unavailable_chance: f64,
    /// Chance a request is lost before it is applied (`Unknown`).
    pub lost_request_chance: f64,
    /// Chance a request is applied and its reply lost (`Unknown`).
    pub lost_reply_chance: f64,
    /// Chance a request is rejected (`Rejected`).
    pub rejected_chance: f64,
    /// How long a driver waits before it reports `Unknown`: up to this many ms.
    pub unknown_after_max_ms: u64,
    /// Chance a reply is delivered twice (the second must be ignored as stale).
    pub duplicate_reply_chance: f64,
    /// Database outages, as `[start, end)` windows in ms of virtual time: every request that
    /// reaches the database then fails with `Unavailable`.
    pub outages: Vec<(u64, u64)>,
    /// Chance a notification is lost on its way to one worker.
    pub notify_loss_chance: f64,
    /// Chance a notification reaches one worker twice.
    pub notify_duplicate_chance: f64,
    /// The longest notification delay.
    pub notify_delay_max_ms: u64,
    /// Listener disconnections, as `(at_ms, slot, down_for_ms)`.
    pub listener_drops: Vec<(u64, usize, u64)>,
    /// Worker crashes, as `(at_ms, slot)`: the process dies with its handlers.
    pub crashes: Vec<(u64, usize)>,
    /// Graceful shutdowns, as `(at_ms, slot)`: the worker drains, then restarts.
    pub shutdowns: Vec<(u64, usize)>,
    /// Stalls, as `(at_ms, slot, for_ms)`: the worker process freezes (a long pause, or a
    /// partition from the database) while its handlers run on; its timers and everything
    /// addressed to it wait until it wakes. Long enough, the reaper gives its tasks to others
    /// and its late writes must be fenced.
    pub stalls: Vec<(u64, usize, u64)>,
    /// The longest a dead worker stays down before it restarts (during the safety phase).
    pub restart_after_max_ms: u64,
    /// Chance a crashed worker's in-flight request still reaches the database.
    pub dead_apply_chance: f64,
    /// Chance an aborted handler's answer still arrives (and must be ignored).
    pub late_finish_chance: f64,
    /// Chance a handler's answer holds a value the database refuses: U+0000 in its result or
    /// in its error's message, or (with `db_value_limit_bytes`) a result over that limit.
    pub poison_outcome_chance: f64,
    /// A limit on stored values the database enforces below the worker's
    /// `max_result_bytes` (a trigger, a managed server's cap): a finish carrying a larger
    /// result is refused as a whole (`DbFailure::Invalid`), though the worker let it through.
    pub db_value_limit_bytes: Option<u64>,
    /// Chance an enqueue statement is followed by a row another producer wrote by hand, with
    /// arguments nested deeper than a reader can decode.
    pub poison_row_chance: f64,
    /// Chance a request commits after its reply timed out ([`Fate::LateCommit`]).
    pub late_commit_chance: f64,
    /// Rows locked by other transactions, as `(at_ms, for_ms)`: a live row, in flight if
    /// there is one, is locked for that long (an application's transaction, an operator's).
    pub row_locks: Vec<(u64, u64)>,
    /// Failovers, as `(at_ms, back_ms)`: the database comes back as it was `back_ms` earlier
    /// (a restore from a backup, a promoted replica that lagged). Every write since is gone:
    /// leases go back, tasks finished since run again, tasks enqueued since vanish.
    pub failovers: Vec<(u64, u64)>,
    /// Liveness-token connections that drop, as `(at_ms, slot, down_ms)`: the worker lives on
    /// while the server releases its token, and takes it again `down_ms` later (a backend
    /// killed, a connection cut). Down longer than `recovery.liveness_grace_ms`, the worker
    /// counts as dead and its runs are taken: their writes must be fenced.
    pub token_drops: Vec<(u64, usize, u64)>,
    /// Whether a stall (a partition from the database) also ends the worker's token session
    /// until it wakes.
    pub stalls_drop_tokens: bool,
    /// A wake-up provider beside LISTEN (a message broker) and its faults, when the client
    /// announces its enqueues there (`None`: LISTEN/NOTIFY alone).
    pub broker: Option<BrokerFaults>,
}

/// A message broker that carries the client's enqueues instead of NOTIFY (their statements
/// send none; those of tasks with keys still do), and what goes wrong with it: a wake-up is
/// lost, duplicated, delayed (so reordered), and a worker's subscription drops for a while.
/// Everything else that makes a task ready still notifies through PostgreSQL.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerFaults {
    /// Chance a wake-up is lost on its way to one worker (only to workers that also poll: to
    /// an event-driven one it would be lost by design).
    pub loss_chance: f64,
    /// Chance a wake-up reaches one worker twice.
    pub duplicate_chance: f64,
    /// The longest delay of a wake-up (each drawn alone, so they arrive in any order).
    pub delay_max_ms: u64,
    /// Subscriptions lost, as `(at_ms, slot, down_for_ms)`.
    pub drops: Vec<(u64, usize, u64)>,
}

impl BrokerFaults {
    /// Draws a broker for one seed in three: faults at rates of their own, delays of up to
    /// half a second, a few subscription drops.
    pub fn swarm(rng: &mut Rng, safety_ms: u64, workers: usize) -> Option<BrokerFaults> {
        if !rng.chance(1.0 / 3.0) {
            return None;
        }
        let on = |rng: &mut Rng, max: f64| if rng.chance(0.5) { rng.next_f64() * max } else { 0.0 };
        let loss_chance = on(rng, 0.5);
        let duplicate_chance = on(rng, 0.3);
        let delay_max_ms = rng.range(1, 501);
        let drops = if rng.chance(0.4) {
            let mut drops: Vec<(u64, usize, u64)> = (0..rng.range(1, 5))
                .map(|_| (rng.range(0, safety_ms), rng.range(0, workers as u64) as usize, rng.range(100, 20_001)))
                .collect();
            drops.sort_unstable();
            drops
        } else {
            Vec::new()
        };
        Some(BrokerFaults { loss_chance, duplicate_chance, delay_max_ms, drops })
    }
}

impl FaultOptions {
    /// No faults at all: latencies of 1 to 5 ms and nothing else.
    pub fn none() -> FaultOptions {
        FaultOptions {
            latency_min_ms: 1,
            latency_max_ms: 5,
            spike_chance: 0.0,
            spike_max_ms: 0,
            unavailable_chance: 0.0,
            lost_request_chance: 0.0,
            lost_reply_chance: 0.0,
            rejected_chance: 0.0,
            unknown_after_max_ms: 1_000,
            duplicate_reply_chance: 0.0,
            outages: Vec::new(),
            notify_loss_chance: 0.0,
            notify_duplicate_chance: 0.0,
            notify_delay_max_ms: 5,
            listener_drops: Vec::new(),
            crashes: Vec::new(),
            shutdowns: Vec::new(),
            stalls: Vec::new(),
            restart_after_max_ms: 1_000,
            dead_apply_chance: 0.0,
            late_finish_chance: 0.0,
            poison_outcome_chance: 0.0,
            db_value_limit_bytes: None,
            poison_row_chance: 0.0,
            late_commit_chance: 0.0,
            row_locks: Vec::new(),
            failovers: Vec::new(),
            token_drops: Vec::new(),
            stalls_drop_tokens: false,
            broker: None,
        }
    }

    /// Draws a fault mix for a safety phase of `safety_ms` with `workers` slots: about one
    /// seed in six has no faults, the others enable each kind with probability one half at a
    /// rate of their own.
    pub fn swarm(rng: &mut Rng, safety_ms: u64, workers: usize) -> FaultOptions {
        let mut faults = FaultOptions::none();
        faults.latency_min_ms = rng.range(1, 5);
        faults.latency_max_ms = faults.latency_min_ms + rng.range(0, 100);
        faults.notify_delay_max_ms = rng.range(1, 200);
        if rng.chance(1.0 / 6.0) {
            return faults;
        }
        let on = |rng: &mut Rng, max: f64| if rng.chance(0.5) { rng.next_f64() * max } else { 0.0 };
        faults.spike_chance = on(rng, 0.05);
        faults.spike_max_ms = rng.range(100, 10_001);
        faults.unavailable_chance = on(rng, 0.1);
        faults.lost_request_chance = on(rng, 0.05);
        faults.lost_reply_chance = on(rng, 0.1);
        faults.rejected_chance = on(rng, 0.01);
        faults.unknown_after_max_ms = rng.range(10, 10_001);
        faults.duplicate_reply_chance = on(rng, 0.05);
        faults.notify_loss_chance = on(rng, 0.5);
        faults.notify_duplicate_chance = on(rng, 0.2);
        faults.dead_apply_chance = rng.next_f64();
        faults.late_finish_chance = on(rng, 0.5);
        faults.restart_after_max_ms = rng.range(100, 30_001);
        if rng.chance(0.4) {
            for _ in 0..rng.range(1, 4) {
                let start = rng.range(0, safety_ms);
                let end = (start + rng.range(100, 30_001)).min(safety_ms);
                faults.outages.push((start, end));
            }
            faults.outages.sort_unstable();
        }
        let events = |rng: &mut Rng, max: u64| -> Vec<(u64, usize)> {
            let mut at: Vec<(u64, usize)> = (0..rng.range(1, max + 1))
                .map(|_| (rng.range(0, safety_ms), rng.range(0, workers as u64) as usize))
                .collect();
            at.sort_unstable();
            at
        };
        if rng.chance(0.5) {
            faults.crashes = events(rng, 6);
        }
        if rng.chance(0.3) {
            faults.shutdowns = events(rng, 3);
        }
        if rng.chance(0.3) {
            faults.listener_drops =
                events(rng, 4).into_iter().map(|(at, slot)| (at, slot, rng.range(100, 20_001))).collect();
        }
        // Drawn last, so that adding stalls left every other draw of a seed as it was.
        if rng.chance(0.3) {
            faults.stalls = events(rng, 3)
                .into_iter()
                .map(|(at, slot)| (at, slot, rng.range(1_000, 40_001).min(safety_ms - at)))
                .collect();
        }
        // The faults of bad data and slow locks, drawn after all the others for the same reason.
        faults.poison_outcome_chance = on(rng, 0.05);
        if rng.chance(0.3) {
            faults.db_value_limit_bytes = Some(rng.range(2_048, 16_385));
        }
        faults.poison_row_chance = on(rng, 0.05);
        faults.late_commit_chance = on(rng, 0.05);
        if rng.chance(0.4) {
            faults.row_locks = events(rng, 8).into_iter().map(|(at, _)| (at, rng.range(100, 60_001))).collect();
        }
        if rng.chance(0.15) {
            faults.failovers = events(rng, 2).into_iter().map(|(at, _)| (at, rng.range(500, 20_001))).collect();
        }
        // Drawn after the faults above, for the same reason.
        if rng.chance(0.3) {
            faults.token_drops =
                events(rng, 4).into_iter().map(|(at, slot)| (at, slot, rng.range(50, 10_001))).collect();
        }
        faults.stalls_drop_tokens = rng.chance(0.5);
        if rng.chance(0.2) {
            // Bad data and locks alone, on a network that never fails: what they do to healthy
            // workers is not hidden behind other faults.
            faults = FaultOptions {
                latency_min_ms: faults.latency_min_ms,
                latency_max_ms: faults.latency_max_ms,
                notify_delay_max_ms: faults.notify_delay_max_ms,
                poison_outcome_chance: faults.poison_outcome_chance,
                db_value_limit_bytes: faults.db_value_limit_bytes,
                poison_row_chance: faults.poison_row_chance,
                row_locks: faults.row_locks,
                ..FaultOptions::none()
            };
        }
        faults
    }

    /// Whether a request reaching the database at `at_ms` meets an outage.
    pub fn in_outage(&self, at_ms: u64) -> bool {
        self.outages.iter().any(|&(start, end)| (start..end).contains(&at_ms))
    }

    /// A one-way database latency in ms.
    pub fn latency_ms(&self, rng: &mut Rng) -> u64 {
        if self.spike_chance > 0.0 && rng.chance(self.spike_chance) {
            rng.range(self.latency_max_ms, self.spike_max_ms.max(self.latency_max_ms) + 1)
        } else {
            rng.range(self.latency_min_ms, self.latency_max_ms + 1)
        }
    }

    /// What happens to one request.
    pub fn fate(&self, rng: &mut Rng) -> Fate {
        let roll = rng.next_f64();
        let mut edge = self.unavailable_chance;
        if roll < edge {
            return Fate::Unavailable;
        }
        edge += self.lost_request_chance;
        if roll < edge {
            return Fate::LostRequest;
        }
        edge += self.lost_reply_chance;
        if roll < edge {
            return Fate::LostReply;
        }
        edge += self.rejected_chance;
        if roll < edge {
            return Fate::Rejected;
        }
        edge += self.late_commit_chance;
        if roll < edge {
            return Fate::LateCommit;
        }
        Fate::Delivered
    }

    /// Whether this run injects any fault besides plain latency.
    pub fn any(&self) -> bool {
        let chances = [
            self.spike_chance,
            self.unavailable_chance,
            self.lost_request_chance,
            self.lost_reply_chance,
            self.rejected_chance,
            self.duplicate_reply_chance,
            self.notify_loss_chance,
            self.notify_duplicate_chance,
            self.late_finish_chance,
            self.poison_outcome_chance,
            self.poison_row_chance,
            self.late_commit_chance,
        ];
        chances.iter().any(|&c| c > 0.0)
            || !self.outages.is_empty()
            || !self.crashes.is_empty()
            || !self.shutdowns.is_empty()
            || !self.stalls.is_empty()
            || !self.listener_drops.is_empty()
            || !self.row_locks.is_empty()
            || !self.failovers.is_empty()
            || !self.token_drops.is_empty()
            || self
                .broker
                .as_ref()
                .is_some_and(|b| b.loss_chance > 0.0 || b.duplicate_chance > 0.0 || !b.drops.is_empty())
    }
}
