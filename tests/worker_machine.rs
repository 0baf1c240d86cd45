//! The worker machine driven by hand: each test scripts the store's replies and checks the
//! commands, events and timers that come out.

use std::time::{Duration, Instant};

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, CustomQueue, DeploymentMode, QueueMode, RetryPolicy, WorkerConfig};
use canter::store::{
    ClaimedTask, Completion, DbFailure, DbReply, DbRequest, DbTime, FinishOutcome, OpId, VacuumedTable,
};
use canter::task::{Attempt, ErrorCode, Lease, TaskError, TaskId, TaskLease, TaskState, WorkerId};
use canter::worker::{Command, DEAF_FAST_POLL_FOR, DEAF_POLL_INTERVAL, Event, Input, TaskOutcome, Timer, Worker};
use serde_json::json;

/// The default app without the liveness check's timer (its own tests turn it on), so that the
/// timers these tests step through are the ones they are about.
fn app() -> AppConfig {
    let mut app = AppConfig::default();
    app.recovery.auto_recover_dead_workers = false;
    // Its timer would come between the ones tests look for; one test below turns it on.
    app.recovery.vacuum_dead_rows = None;
    app
}

struct Harness {
    worker: Worker,
    now: Instant,
    events: Vec<Event>,
}

impl Harness {
    fn new(app: AppConfig, config: WorkerConfig) -> (Harness, Vec<Command>) {
        // Any instant will do: the machine only ever compares instants it was given.
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        let worker = Worker::new(WorkerId("w1".into()), app, config, now).expect("valid config");
        let mut h = Harness { worker, now, events: Vec::new() };
        let commands = h.drain();
        (h, commands)
    }

    fn default(concurrency: u32) -> (Harness, Vec<Command>) {
        Harness::new(app(), WorkerConfig { concurrency, seed: Some(1), ..WorkerConfig::default() })
    }

    fn drain(&mut self) -> Vec<Command> {
        let mut commands = Vec::new();
        while let Some(c) = self.worker.poll_command() {
            commands.push(c);
        }
        while let Some(e) = self.worker.poll_event() {
            self.events.push(e);
        }
        commands
    }

    fn input(&mut self, input: Input) -> Vec<Command> {
        self.worker.handle_input(input, self.now);
        self.drain()
    }

    fn reply(&mut self, op: OpId, reply: DbReply) -> Vec<Command> {
        self.input(Input::Db { op, reply: Ok(reply) })
    }

    fn fail(&mut self, op: OpId, failure: DbFailure) -> Vec<Command> {
        self.input(Input::Db { op, reply: Err(failure) })
    }

    /// Advances to the next deadline and fires it.
    fn fire(&mut self) -> (Timer, Vec<Command>) {
        let (at, timer) = self.worker.poll_timeout().expect("a timer is armed");
        self.now = self.now.max(at);
        self.worker.handle_timeout(self.now);
        (timer, self.drain())
    }

    fn finished(&mut self, run: &canter::worker::TaskRun, outcome: TaskOutcome) -> Vec<Command> {
        self.input(Input::TaskFinished { task: run.id, lease: run.lease, outcome })
    }
}

fn task(id: i64, started: bool) -> ClaimedTask {
    ClaimedTask {
        id: TaskId(id),
        lease: Lease(1),
        name: "job".into(),
        queue: "default".into(),
        args: json!({"n": id}),
        priority: 0,
        enqueued_at: DbTime(0),
        run_at: DbTime(0),
        started,
        attempt: Attempt(1),
        retries: 0,
        retry: RetryPolicy::none(),
        expires: false,
        args_error: None,
        retry_error: None,
    }
}

fn db_ops(commands: &[Command]) -> Vec<(OpId, &DbRequest)> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Db { op, request } => Some((*op, request)),
            _ => None,
        })
        .collect()
}

fn find(commands: &[Command], kind: &str) -> OpId {
    db_ops(commands)
        .into_iter()
        .find(|(_, r)| r.kind() == kind)
        .unwrap_or_else(|| panic!("no {kind} in {commands:?}"))
        .0
}

fn has(commands: &[Command], kind: &str) -> bool {
    db_ops(commands).iter().any(|(_, r)| r.kind() == kind)
}

fn spawns(commands: &[Command]) -> Vec<canter::worker::TaskRun> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Spawn(run) => Some(run.clone()),
            _ => None,
        })
        .collect()
}

/// Registers and answers the first claim with `tasks`; returns the commands that followed.
fn start(h: &mut Harness, first: &[Command], tasks: Vec<ClaimedTask>, more: bool) -> Vec<Command> {
    let register = find(first, "register_worker");
    h.reply(register, DbReply::Done);
    h.reply(find(first, "claim"), DbReply::Claimed { tasks, more, next_run_in_ms: None })
}

#[test]
fn a_new_worker_registers_and_claims_up_to_its_concurrency() {
    let (_, commands) = Harness::default(4);
    let claim = db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "claim").unwrap().1.clone();
    match claim {
        DbRequest::Claim { my_running, my_claimed, start_now, lease_ms, .. } => {
            assert_eq!((my_running, my_claimed, start_now, lease_ms), (0, 0, 4, 60_000));
        }
        other => panic!("{other:?}"),
    }
    assert!(has(&commands, "register_worker"));
}

#[test]
fn a_claim_that_left_work_behind_claims_again_at_once() {
    let (mut h, first) = Harness::default(4);
    let next = start(&mut h, &first, vec![task(1, true), task(2, true)], true);
    assert_eq!(spawns(&next).len(), 2);
    match db_ops(&next).iter().find(|(_, r)| r.kind() == "claim").map(|(_, r)| (*r).clone()) {
        Some(DbRequest::Claim { my_running: 2, start_now: 2, .. }) => {}
        other => panic!("expected a second claim for the 2 free permits, got {other:?}"),
    }
}

#[test]
fn a_claim_that_found_all_there_was_waits_for_a_notification_or_the_poll() {
    let (mut h, first) = Harness::default(4);
    let next = start(&mut h, &first, vec![task(1, true)], false);
    assert!(!has(&next, "claim"));
    let (at, timer) = h.worker.poll_timeout().unwrap();
    assert_eq!(timer, Timer::Poll);
    assert_eq!(at, h.now + Duration::from_millis(5_000));
    // A notification for a queue this worker does not serve changes nothing.
    assert!(!has(&h.input(Input::Notified { queue: "other".into(), priority: None, run_at: None }), "claim"));
    assert!(has(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim"));
}

#[test]
fn notifications_during_a_claim_coalesce_into_one_more_pass() {
    let (mut h, first) = Harness::default(4);
    for _ in 0..5 {
        assert!(!has(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim"));
    }
    let next = start(&mut h, &first, vec![], false);
    assert_eq!(db_ops(&next).iter().filter(|(_, r)| r.kind() == "claim").count(), 1);
    assert_eq!(h.worker.stats().notifications_coalesced, 4);
}

#[test]
fn polling_only_ignores_notifications_and_event_driven_only_does_not_poll_while_listening() {
    let config = WorkerConfig { deployment_mode: DeploymentMode::PollingOnly, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    start(&mut h, &first, vec![], false);
    assert!(!has(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim"));
    let (timer, commands) = h.fire();
    assert_eq!(timer, Timer::Poll);
    assert!(has(&commands, "claim"));

    let config = WorkerConfig { deployment_mode: DeploymentMode::EventDrivenOnly, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    h.input(Input::Listener { connected: true });
    start(&mut h, &first, vec![], false);
    assert_ne!(h.worker.poll_timeout().unwrap().1, Timer::Poll);
    h.input(Input::Listener { connected: false });
    assert_eq!(h.worker.poll_timeout().unwrap().1, Timer::Poll, "deaf: falls back to polling");
}

/// Issue 19, item 8: notifications sent while the listener reconnects are gone, and the
/// reconnect can take a TLS handshake's delayed ACKs: the worker polls every 20 ms for 2 s after
/// losing it, then at its own interval, and listening again ends it.
#[test]
fn a_worker_whose_listener_was_lost_polls_soon_until_it_listens_again() {
    let config = WorkerConfig { poll_interval_ms: 5_000, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    h.input(Input::Listener { connected: true });
    let next = start(&mut h, &first, vec![], false);
    // The catch-up pass the listener asked for.
    h.reply(find(&next, "claim"), DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: None });
    let idle = h.worker.poll_timeout().unwrap();
    assert_eq!(idle, (h.now + Duration::from_secs(5), Timer::Poll), "listening and idle: the usual poll");

    h.input(Input::Listener { connected: false });
    let lost = h.now;
    assert_eq!(h.worker.poll_timeout().unwrap(), (lost + DEAF_POLL_INTERVAL, Timer::Poll));
    let (_, commands) = h.fire();
    let claim = find(&commands, "claim");
    h.reply(claim, DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: None });
    assert_eq!(h.worker.poll_timeout().unwrap(), (h.now + DEAF_POLL_INTERVAL, Timer::Poll), "and again");

    // Still deaf after 2 s: an outage, the usual interval (other timers fire meanwhile).
    let empty = || DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: None };
    while h.now < lost + DEAF_FAST_POLL_FOR {
        let (timer, commands) = h.fire();
        if timer == Timer::Poll {
            h.reply(find(&commands, "claim"), empty());
        }
    }
    let next_poll = |h: &Harness| h.worker.timer(Timer::Poll);
    assert_eq!(next_poll(&h), Some(h.now + Duration::from_secs(5)));

    // Lost again after listening again: soon again; listening ends it (after the catch-up pass).
    let commands = h.input(Input::Listener { connected: true });
    h.reply(find(&commands, "claim"), empty());
    h.input(Input::Listener { connected: false });
    assert_eq!(next_poll(&h), Some(h.now + DEAF_POLL_INTERVAL));
    let commands = h.input(Input::Listener { connected: true });
    h.reply(find(&commands, "claim"), empty());
    assert_eq!(next_poll(&h), Some(h.now + Duration::from_secs(5)));
}

#[test]
fn a_cap_blocked_claim_does_not_spin() {
    let (mut h, first) = Harness::default(4);
    let next = start(&mut h, &first, vec![], true);
    assert!(!has(&next, "claim"), "nothing taken but work seen: wait, do not spin");
    let (timer, commands) = h.fire();
    assert_eq!(timer, Timer::Poll);
    assert!(has(&commands, "claim"));
}

#[test]
fn completions_batch_while_one_write_is_in_flight() {
    let (mut h, first) = Harness::default(4);
    let next = start(&mut h, &first, (1..=4).map(|i| task(i, true)).collect(), false);
    let runs = spawns(&next);
    let c1 = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    let finish = find(&c1, "finish");
    for run in &runs[1..] {
        assert!(!has(&h.finished(run, TaskOutcome::Success(json!(0))), "finish"));
    }
    let after = h.reply(finish, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    let (_, request) = db_ops(&after).into_iter().find(|(_, r)| r.kind() == "finish").unwrap();
    match request {
        DbRequest::Finish { completions, .. } => assert_eq!(completions.len(), 3),
        other => panic!("{other:?}"),
    }
    assert!(h.events.contains(&Event::Finished { task: TaskId(1), state: TaskState::Completed }));
}

#[test]
fn a_freed_permit_claims_again_after_a_full_claim() {
    let (mut h, first) = Harness::default(2);
    let next = start(&mut h, &first, vec![task(1, true), task(2, true)], true);
    assert!(!has(&next, "claim"), "no permit free");
    let runs = spawns(&next);
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(null)));
    // In hard-cap mode the claim goes with the finish, in one request.
    assert!(
        has(&after, "claim") || has(&after, "finish_and_claim"),
        "the permit is free before the completion is written"
    );
}

#[test]
fn failures_retry_as_the_policy_says() {
    let (mut h, first) = Harness::default(2);
    let mut retried = task(1, true);
    retried.retry = RetryPolicy::fixed(vec![10, 20]).with_codes(vec![ErrorCode::User("FLAKY".into())]);
    let mut spent = task(2, true);
    spent.retry = retried.retry.clone();
    spent.retries = 2;
    let runs = spawns(&start(&mut h, &first, vec![retried, spent], false));
    let c = h.finished(&runs[0], TaskOutcome::Failure(TaskError::new(ErrorCode::User("FLAKY".into()), "x")));
    h.finished(&runs[1], TaskOutcome::Failure(TaskError::new(ErrorCode::User("FLAKY".into()), "x")));
    let finish = find(&c, "finish");
    let DbRequest::Finish { completions, .. } = db_ops(&c).into_iter().find(|(op, _)| *op == finish).unwrap().1.clone()
    else {
        unreachable!()
    };
    match &completions[0].outcome {
        FinishOutcome::Retry { delay_ms, .. } => assert!((7_500..=12_500).contains(delay_ms), "{delay_ms}"),
        other => panic!("{other:?}"),
    }
    let after = h.reply(finish, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Pending)], lost: vec![] });
    let DbRequest::Finish { completions, .. } =
        db_ops(&after).into_iter().find(|(_, r)| r.kind() == "finish").unwrap().1.clone()
    else {
        unreachable!()
    };
    assert!(matches!(completions[0].outcome, FinishOutcome::Failed(_)), "no retry left");
}

#[test]
fn a_handler_past_its_timeout_is_aborted_and_fails_with_task_timeout() {
    let config = WorkerConfig { handler_timeout_ms: Some(1_000), ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, vec![task(7, true)], false));
    assert_eq!(runs[0].deadline, Some(h.now + Duration::from_millis(1_000)));
    let (timer, commands) = h.fire();
    assert_eq!(timer, Timer::HandlerTimeout(TaskId(7)));
    assert!(commands.contains(&Command::Abort { task: TaskId(7), lease: Lease(1) }));
    let DbRequest::Finish { completions, .. } =
        db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "finish").unwrap().1.clone()
    else {
        unreachable!()
    };
    assert!(matches!(&completions[0].outcome, FinishOutcome::Failed(e) if e.code == ErrorCode::TaskTimeout));
    // The late answer of the aborted handler is ignored.
    assert!(h.finished(&runs[0], TaskOutcome::Success(json!(1))).is_empty());
}

#[test]
fn database_errors_back_off_and_the_writes_are_sent_again() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    let finish = find(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish");
    let after = h.fail(finish, DbFailure::Unavailable("connection refused".into()));
    assert!(after.is_empty(), "nothing is sent while backing off");
    assert!(matches!(h.events.last(), Some(Event::DbUnavailable { failures: 1, .. })));
    let (at, timer) = h.worker.poll_timeout().unwrap();
    assert_eq!(timer, Timer::DbRetry);
    let wait = at - h.now;
    assert!(wait >= Duration::from_millis(375) && wait <= Duration::from_millis(625), "{wait:?}");
    let (_, again) = h.fire();
    let finish = find(&again, "finish");
    h.reply(finish, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    assert!(h.events.contains(&Event::DbRecovered));
    assert_eq!(h.worker.db_failures(), 0);
}

#[test]
fn a_claim_without_an_answer_is_undone_by_its_token() {
    let (mut h, first) = Harness::default(2);
    h.reply(find(&first, "register_worker"), DbReply::Done);
    let claim = find(&first, "claim");
    let DbRequest::Claim { token, .. } = db_ops(&first).into_iter().find(|(op, _)| *op == claim).unwrap().1.clone()
    else {
        unreachable!()
    };
    h.fail(claim, DbFailure::Unknown("timed out".into()));
    let (_, again) = h.fire();
    let abandon = db_ops(&again).into_iter().find(|(_, r)| r.kind() == "abandon_claim").unwrap().1.clone();
    assert_eq!(abandon, DbRequest::AbandonClaim { worker: WorkerId("w1".into()), token });
    assert!(has(&again, "claim"), "and claims afresh");
}

#[test]
fn stale_and_duplicate_replies_are_ignored() {
    let (mut h, first) = Harness::default(2);
    let claim = find(&first, "claim");
    h.reply(claim, DbReply::Claimed { tasks: vec![task(1, true)], more: false, next_run_in_ms: None });
    let again = h.reply(claim, DbReply::Claimed { tasks: vec![task(1, true)], more: false, next_run_in_ms: None });
    assert!(spawns(&again).is_empty());
    assert!(h.reply(OpId::from_raw(999), DbReply::Done).is_empty());
    assert_eq!(h.worker.held(), 1);
}

/// Soft-cap mode with a cap on the only queue: buffered tasks start by a start request.
fn soft_cap_app(cap: Option<u32>) -> AppConfig {
    AppConfig {
        prefetch_buffer: 2,
        claim_lease_ms: Some(60_000),
        queue_mode: QueueMode::Custom,
        custom_queues: vec![CustomQueue { name: "default".into(), priority: 1, max_concurrency: cap, serial: false }],
        ..app()
    }
}

#[test]
fn soft_cap_mode_buffers_claims_and_starts_them_as_permits_free() {
    let app = soft_cap_app(Some(5));
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 1, ..WorkerConfig::default() });
    let DbRequest::Claim { start_now, .. } =
        db_ops(&first).into_iter().find(|(_, r)| r.kind() == "claim").unwrap().1.clone()
    else {
        unreachable!()
    };
    assert_eq!(start_now, 1);
    let next = start(&mut h, &first, vec![task(1, true), task(2, false), task(3, false)], false);
    let runs = spawns(&next);
    assert_eq!(runs.len(), 1);
    assert_eq!(h.worker.claimed(), 2);
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    let (op, request) = db_ops(&after).into_iter().find(|(_, r)| r.kind() == "start").unwrap();
    match request {
        DbRequest::Start { tasks, .. } => assert_eq!(tasks.iter().map(|t| t.task).collect::<Vec<_>>(), vec![TaskId(2)]),
        other => panic!("{other:?}"),
    }
    let started = h.reply(
        op,
        DbReply::Started { started: vec![(TaskId(2), Attempt(1))], expired: vec![], deferred: vec![], lost: vec![] },
    );
    assert_eq!(spawns(&started)[0].id, TaskId(2));
}

#[test]
fn soft_cap_mode_starts_tasks_of_an_uncapped_queue_without_asking_and_records_long_runs() {
    let (mut h, first) = Harness::new(soft_cap_app(None), WorkerConfig { concurrency: 1, ..WorkerConfig::default() });
    let expiring = ClaimedTask { expires: true, ..task(3, false) };
    let next = start(&mut h, &first, vec![task(1, true), task(2, false), expiring], false);
    let runs = spawns(&next);
    assert_eq!(runs.len(), 1);
    // The first run ends: the second starts at once, with no start request, as attempt 1.
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert!(!has(&after, "start"), "{after:?}");
    let second = spawns(&after);
    assert_eq!((second.len(), second[0].id, second[0].attempt), (1, TaskId(2), Attempt(1)));
    assert_eq!(h.worker.running(), 1);
    // Still running a quarter of the claim lease (at most a second) later: its start is recorded.
    let (timer, commands) = h.fire();
    assert_eq!(timer, Timer::RecordStarts);
    let record = find(&commands, "record_starts");
    let request = db_ops(&commands).into_iter().find(|(op, _)| *op == record).unwrap().1.clone();
    assert_eq!(request, DbRequest::RecordStarts { worker: WorkerId("w1".into()), tasks: vec![runs_lease(&second[0])] });
    h.reply(
        record,
        DbReply::Started { started: vec![(TaskId(2), Attempt(1))], expired: vec![], deferred: vec![], lost: vec![] },
    );
    // Its end frees the permit; the third task has a good-until, so only the store may start it.
    let after = h.finished(&second[0], TaskOutcome::Success(json!(2)));
    let start = db_ops(&after).into_iter().find(|(_, r)| r.kind() == "start").map(|(_, r)| r.clone());
    assert!(matches!(start, Some(DbRequest::Start { ref tasks, .. }) if tasks[0].task == TaskId(3)), "{after:?}");
    assert!(spawns(&after).is_empty());
}

#[test]
fn a_run_started_without_asking_that_the_store_lost_is_aborted() {
    let (mut h, first) = Harness::new(soft_cap_app(None), WorkerConfig { concurrency: 1, ..WorkerConfig::default() });
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, false)], false));
    let second = spawns(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    let (_, commands) = h.fire();
    let record = find(&commands, "record_starts");
    let aborted =
        h.reply(record, DbReply::Started { started: vec![], expired: vec![], deferred: vec![], lost: vec![TaskId(2)] });
    assert!(
        aborted
            .iter()
            .any(|c| matches!(c, Command::Abort { task, lease } if *task == TaskId(2) && *lease == second[0].lease)),
        "{aborted:?}"
    );
    assert_eq!(h.worker.running(), 0);
    // Heartbeats list a run the store does not know started as a claim (it renews the claim).
    let (mut h, first) = Harness::new(soft_cap_app(None), WorkerConfig { concurrency: 1, ..WorkerConfig::default() });
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, false)], false));
    h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    let beat = loop {
        let (_, commands) = h.fire();
        if let Some((_, request)) = db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "heartbeat") {
            break request.clone();
        }
    };
    let DbRequest::Heartbeat { claimed, .. } = beat else { unreachable!() };
    assert!(claimed.iter().any(|t| t.task == TaskId(2)), "{claimed:?}");
}

fn runs_lease(run: &canter::worker::TaskRun) -> canter::task::TaskLease {
    canter::task::TaskLease { task: run.id, lease: run.lease }
}

#[test]
fn heartbeats_cover_everything_held_and_lost_tasks_are_aborted() {
    let config = WorkerConfig { concurrency: 2, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], false));
    h.finished(&runs[1], TaskOutcome::Success(json!(2)));
    // Several timers can fall due at one instant: fire until the heartbeat goes out.
    let commands = loop {
        let (_, commands) = h.fire();
        if has(&commands, "heartbeat") {
            break commands;
        }
    };
    let (op, request) = db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "heartbeat").unwrap();
    match request {
        DbRequest::Heartbeat { running, .. } => assert_eq!(running.len(), 2, "finishing tasks too"),
        other => panic!("{other:?}"),
    }
    let after = h.reply(op, DbReply::Heartbeat { lost: vec![TaskId(1)], busy: vec![], handed_back: vec![] });
    assert!(after.contains(&Command::Abort { task: TaskId(1), lease: Lease(1) }));
    assert_eq!(h.worker.running(), 0);
}

#[test]
fn a_revoked_task_it_holds_makes_the_worker_beat_at_once_and_abort_what_it_lost() {
    let config = WorkerConfig { concurrency: 2, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], false));
    assert_eq!(runs.len(), 2);
    // Tasks it does not hold: nothing to do.
    let none = h.input(Input::Revoked { tasks: vec![TaskId(7)] });
    assert!(!has(&none, "heartbeat"), "{none:?}");
    // One it holds: a beat goes out now, not at the interval.
    let beat = h.input(Input::Revoked { tasks: vec![TaskId(7), TaskId(2)] });
    assert!(has(&beat, "heartbeat"), "{beat:?}");
    // A second revocation while that beat is out waits for its answer.
    assert!(!has(&h.input(Input::Revoked { tasks: vec![TaskId(1)] }), "heartbeat"));
    let lost = DbReply::Heartbeat { lost: vec![TaskId(2)], busy: vec![], handed_back: vec![] };
    let after = h.reply(find(&beat, "heartbeat"), lost);
    assert!(after.contains(&Command::Abort { task: TaskId(2), lease: Lease(1) }), "{after:?}");
    // ... and then goes out at once: task 1 may have been revoked after the first was sent.
    assert!(has(&after, "heartbeat"), "{after:?}");
    assert_eq!(h.worker.running(), 1);
}

#[test]
fn a_task_handed_back_under_the_lease_of_an_aborted_run_goes_back_instead_of_running_twice() {
    // Simulation seed 13448: a database gone back in time hands a task out again under the
    // lease of a run this worker aborted, whose answer (a driver that cannot stop a handler)
    // still comes: a second run under that lease would take it for its own.
    let config = WorkerConfig { concurrency: 2, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    // More was left behind: the next claim goes out at once, and stays out.
    let started = start(&mut h, &first, vec![task(1, true)], true);
    let runs = spawns(&started);
    let claim = find(&started, "claim");
    let commands = loop {
        let (_, commands) = h.fire();
        if has(&commands, "heartbeat") {
            break commands;
        }
    };
    let lost = DbReply::Heartbeat { lost: vec![TaskId(1)], busy: vec![], handed_back: vec![] };
    let after = h.reply(find(&commands, "heartbeat"), lost);
    assert!(after.contains(&Command::Abort { task: TaskId(1), lease: Lease(1) }), "{after:?}");
    let again = h.reply(claim, DbReply::Claimed { tasks: vec![task(1, true)], more: false, next_run_in_ms: None });
    assert!(spawns(&again).is_empty(), "a second run under lease 1: {again:?}");
    let released = db_ops(&again).into_iter().any(|(_, r)| {
        matches!(r, DbRequest::Release { tasks, .. } if tasks == &vec![TaskLease { task: TaskId(1), lease: Lease(1) }])
    });
    assert!(released, "handed back to be claimed under a new lease: {again:?}");
    // The aborted run's late answer is written for nothing.
    assert!(finishes(&h.finished(&runs[0], TaskOutcome::Success(json!(1)))).is_empty());
}

#[test]
fn graceful_shutdown_waits_for_handlers_then_deregisters() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    assert!(h.input(Input::Shutdown).is_empty(), "nothing to hand back, one handler running");
    let c = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    let after = h.reply(
        find(&c, "finish"),
        DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] },
    );
    let deregister = find(&after, "deregister_worker");
    h.reply(deregister, DbReply::Done);
    assert!(h.worker.is_stopped());
    assert!(h.events.contains(&Event::Drained { abandoned: 0 }));
    assert_eq!(h.worker.poll_timeout(), None);
}

#[test]
fn after_the_grace_period_running_tasks_go_back_without_spending_a_retry() {
    let config = WorkerConfig { shutdown_grace_ms: 2_000, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    start(&mut h, &first, vec![task(1, true)], false);
    h.input(Input::Shutdown);
    let shutdown_at = h.now;
    let commands = loop {
        let (_, commands) = h.fire();
        if has(&commands, "release") {
            break commands;
        }
    };
    assert_eq!(h.now - shutdown_at, Duration::from_millis(2_000), "released when the grace period ends");
    assert!(commands.contains(&Command::Abort { task: TaskId(1), lease: Lease(1) }));
    let release = find(&commands, "release");
    let after = h.reply(release, DbReply::Released { released: vec![TaskId(1)], lost: vec![] });
    h.reply(find(&after, "deregister_worker"), DbReply::Done);
    assert!(h.worker.is_stopped());
}

#[test]
fn shutdown_hands_buffered_claims_back_at_once() {
    let app = AppConfig { prefetch_buffer: 4, claim_lease_ms: Some(60_000), ..app() };
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 1, ..WorkerConfig::default() });
    start(&mut h, &first, vec![task(1, true), task(2, false), task(3, false)], false);
    let commands = h.input(Input::Shutdown);
    match db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "release").unwrap().1 {
        DbRequest::Release { tasks, .. } => assert_eq!(tasks.len(), 2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_next_deadline_moves_forward_after_every_timeout() {
    let (mut h, first) = Harness::default(2);
    start(&mut h, &first, vec![], false);
    let mut previous = h.now;
    for _ in 0..50 {
        let (_, commands) = h.fire();
        for (op, request) in db_ops(&commands) {
            let reply = match request {
                DbRequest::Claim { .. } => DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: None },
                DbRequest::Heartbeat { .. } => DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] },
                DbRequest::Reap { .. } => DbReply::Reaped(Default::default()),
                _ => DbReply::Done,
            };
            h.reply(op, reply);
        }
        let (next, _) = h.worker.poll_timeout().unwrap();
        assert!(next > h.now, "busy loop: next deadline {next:?} is not after now");
        assert!(h.now >= previous);
        previous = h.now;
    }
}

#[test]
fn a_heartbeat_skipped_by_an_outage_goes_out_as_soon_as_the_database_answers() {
    let config = WorkerConfig { concurrency: 1, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    // The database goes away just before the heartbeat is due.
    h.now += Duration::from_millis(29_900);
    let finish = find(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish");
    h.fail(finish, DbFailure::Unavailable("down".into()));
    let outage = h.now;
    let mut beat_sent_at = None;
    for _ in 0..10 {
        let (_, commands) = h.fire();
        if has(&commands, "heartbeat") {
            beat_sent_at = Some(h.now);
            break;
        }
    }
    // It went out with the first retry after the outage, not a whole interval later.
    let sent = beat_sent_at.expect("the owed heartbeat was sent");
    // The interval timer fired 0.1 s into the outage and could not send; the database retry
    // comes about 0.5 s in: the beat goes with it, not 30 s later.
    assert!(sent - outage < Duration::from_secs(2), "sent {:?} after the outage began", sent - outage);
}

#[test]
fn one_outage_is_one_step_of_backoff_however_many_requests_fail() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], false));
    let finish = find(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish");
    let claim = find(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim");
    h.fail(finish, DbFailure::Unavailable("down".into()));
    h.fail(claim, DbFailure::Unknown("down".into()));
    assert_eq!(h.worker.db_failures(), 1);
    assert_eq!(h.events.iter().filter(|e| matches!(e, Event::DbUnavailable { .. })).count(), 1);
}

#[test]
fn a_driver_that_breaks_the_contract_does_not_panic_the_machine() {
    let (mut h, first) = Harness::default(2);
    // Time going backwards is taken as no time passing.
    let earlier = h.now - Duration::from_secs(1);
    h.worker.handle_input(Input::Notified { queue: "default".into(), priority: None, run_at: None }, earlier);
    // A reply of the wrong kind counts as a refused request.
    h.reply(find(&first, "register_worker"), DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] });
    assert!(matches!(h.events.last(), Some(Event::DbUnavailable { error: DbFailure::Rejected(_), .. })));
}

/// Fires timers until `timer` fires or `within` passes; the commands of that firing.
fn fire_until(h: &mut Harness, timer: Timer, within: Duration) -> Option<Vec<Command>> {
    let until = h.now + within;
    while h.worker.poll_timeout().is_some_and(|(at, _)| at <= until) {
        let (fired, commands) = h.fire();
        if fired == timer {
            return Some(commands);
        }
    }
    None
}

#[test]
fn a_retention_for_finished_tasks_purges_them_hourly() {
    let hour = Duration::from_millis(canter::worker::PURGE_INTERVAL_MS);
    let (mut kept, _) = Harness::default(2);
    assert!(fire_until(&mut kept, Timer::Purge, 3 * hour).is_none(), "no retention, no purge");

    let mut app = app();
    app.recovery.finished_retention_ms = Some(86_400_000);
    let (mut h, _) = Harness::new(app, WorkerConfig { concurrency: 2, seed: Some(1), ..WorkerConfig::default() });
    let first = fire_until(&mut h, Timer::Purge, hour + Duration::from_secs(1)).expect("a purge within the hour");
    let (op, request) = db_ops(&first).into_iter().find(|(_, r)| r.kind() == "purge").expect("a purge request");
    assert_eq!(request, &DbRequest::Purge { older_than_ms: 86_400_000, batch: canter::store::DEFAULT_PURGE_BATCH });
    // Still in flight an hour later: not sent twice.
    let second = fire_until(&mut h, Timer::Purge, hour + Duration::from_secs(1)).expect("the next hour's timer");
    assert!(!has(&second, "purge"), "{second:?}");
    h.reply(op, DbReply::Purged { tasks: 3 });
    assert!(h.events.iter().any(|e| matches!(e, Event::Purged { tasks: 3 })), "{:?}", h.events);
    let third = fire_until(&mut h, Timer::Purge, hour + Duration::from_secs(1)).expect("the next hour's timer");
    assert!(has(&third, "purge"));
}

#[test]
fn workers_check_every_ten_seconds_whether_the_hot_tables_need_a_vacuum() {
    let interval = Duration::from_millis(canter::worker::VACUUM_CHECK_INTERVAL_MS);
    let (mut none, _) = Harness::default(2);
    assert!(fire_until(&mut none, Timer::Vacuum, 10 * interval).is_none(), "turned off, no vacuum");

    let mut on = app();
    on.recovery.vacuum_dead_rows = AppConfig::default().recovery.vacuum_dead_rows;
    let (mut h, _) = Harness::new(on, WorkerConfig { concurrency: 2, seed: Some(1), ..WorkerConfig::default() });
    let first = fire_until(&mut h, Timer::Vacuum, interval + Duration::from_millis(1)).expect("a check within 10 s");
    let (op, request) = db_ops(&first).into_iter().find(|(_, r)| r.kind() == "vacuum").expect("a vacuum request");
    assert_eq!(request, &DbRequest::Vacuum { min_dead_rows: 10_000 });
    // Still in flight at the next check: not sent twice.
    let second = fire_until(&mut h, Timer::Vacuum, interval + Duration::from_millis(1)).expect("the next check");
    assert!(!has(&second, "vacuum"), "{second:?}");
    let tables = vec![VacuumedTable { table: "tasks".into(), dead_before: 12_000, dead_after: 0 }];
    h.reply(op, DbReply::Vacuumed { tables: tables.clone() });
    assert!(h.events.iter().any(|e| *e == Event::Vacuumed(tables.clone())), "{:?}", h.events);
    let third = fire_until(&mut h, Timer::Vacuum, interval + Duration::from_millis(1)).expect("the next check");
    let (op, _) = db_ops(&third).into_iter().find(|(_, r)| r.kind() == "vacuum").expect("checked again");
    // A failed vacuum (here its statement timeout) is not an outage, and waits for the next check.
    let after = h.fail(op, DbFailure::Unknown("canceling statement due to statement timeout".into()));
    assert!(!has(&after, "vacuum"), "{after:?}");
    assert_eq!(h.worker.db_failures(), 0);
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "{:?}", h.events);
    let fourth = fire_until(&mut h, Timer::Vacuum, interval + Duration::from_millis(1)).expect("the next check");
    assert!(has(&fourth, "vacuum"));
}

// Issue 18: poison values, lock waits, notification floods, leases going back, counts.

/// The finish requests among `commands`: their ops and completions.
fn finishes(commands: &[Command]) -> Vec<(OpId, Vec<Completion>)> {
    db_ops(commands)
        .into_iter()
        .filter_map(|(op, request)| match request {
            DbRequest::Finish { completions, .. } => Some((op, completions.clone())),
            _ => None,
        })
        .collect()
}

/// Fires timers until a request of `kind` goes out or `within` passes; the commands of that
/// firing. (Timers due at one instant fire together: the first of them is not always `kind`'s.)
fn fire_until_sent(h: &mut Harness, kind: &str, within: Duration) -> Option<Vec<Command>> {
    let until = h.now + within;
    while h.worker.poll_timeout().is_some_and(|(at, _)| at <= until) {
        let (_, commands) = h.fire();
        if has(&commands, kind) {
            return Some(commands);
        }
    }
    None
}

/// The only finish among `commands`, with the ids it carries.
fn one_finish(commands: &[Command]) -> (OpId, Vec<Completion>, Vec<i64>) {
    let mut all = finishes(commands);
    assert_eq!(all.len(), 1, "one finish expected in {commands:?}");
    let (op, completions) = all.pop().expect("checked");
    let ids = completions.iter().map(|c| c.task.task.0).collect();
    (op, completions, ids)
}

fn serialization_failure(completion: &Completion) -> bool {
    matches!(&completion.outcome, FinishOutcome::Failed(e)
        if e.code == ErrorCode::WorkerSerializationError && !e.message.contains('\0'))
}

/// Answers the requests in `commands` as an idle store would (claims find nothing); the
/// commands the answers led to.
fn answer_once(h: &mut Harness, commands: &[Command]) -> Vec<Command> {
    let mut next = Vec::new();
    for (op, request) in db_ops(commands) {
        let reply = match request {
            DbRequest::Claim { .. } => DbReply::Claimed { tasks: vec![], more: false, next_run_in_ms: None },
            DbRequest::Heartbeat { .. } => DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back: vec![] },
            DbRequest::Reap { .. } => DbReply::Reaped(Default::default()),
            DbRequest::AbandonClaim { .. } | DbRequest::Release { .. } => {
                DbReply::Released { released: vec![], lost: vec![] }
            }
            // As a store that has the mark already (a written one asks for one more pass).
            DbRequest::SetWaiting { .. } => DbReply::WaitingSet { written: false },
            _ => DbReply::Done,
        };
        next.extend(h.reply(op, reply));
    }
    next
}

/// Answers the requests in `commands` as an idle store would, and the requests those answers
/// lead to, until none is left.
fn answer_idle(h: &mut Harness, commands: Vec<Command>) {
    let mut pending = commands;
    while !pending.is_empty() {
        pending = answer_once(h, &pending);
    }
}

#[test]
fn an_outcome_that_cannot_be_stored_fails_its_own_task_before_it_is_queued() {
    let config = WorkerConfig { concurrency: 4, max_result_bytes: 1_024, seed: Some(1), ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, (1..=4).map(|i| task(i, true)).collect(), false));
    let (op, _, ids) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!("fine"))));
    assert_eq!(ids, vec![1]);
    // A result with U+0000 (C strings), an error message with one, a result over the limit.
    h.finished(&runs[1], TaskOutcome::Success(json!({"text": "from C\u{0}"})));
    h.finished(&runs[2], TaskOutcome::Failure(TaskError::new(ErrorCode::User("BAD".into()), "nul \0 here")));
    h.finished(&runs[3], TaskOutcome::Success(json!("x".repeat(2_000))));
    let after = h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    let (_, completions, ids) = one_finish(&after);
    assert_eq!(ids, vec![2, 3, 4], "queued with the healthy ones' batch size, each on its own terms");
    assert!(completions.iter().all(serialization_failure), "{completions:?}");
    let refused: Vec<TaskId> = h
        .events
        .iter()
        .filter_map(|e| match e {
            Event::OutcomeRefused { task, .. } => Some(*task),
            _ => None,
        })
        .collect();
    assert_eq!(refused, vec![TaskId(2), TaskId(3), TaskId(4)]);
    assert_eq!(h.worker.stats().outcomes_refused, 3);
}

#[test]
fn a_finish_refused_for_a_value_is_halved_until_the_item_is_alone_and_then_rewritten() {
    let (mut h, first) = Harness::default(5);
    let runs = spawns(&start(&mut h, &first, (1..=5).map(|i| task(i, true)).collect(), false));
    let (op, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    for run in &runs[1..] {
        assert!(finishes(&h.finished(run, TaskOutcome::Success(json!(run.id.0)))).is_empty());
    }
    let after = h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    let (op, batch, ids) = one_finish(&after);
    assert_eq!(ids, vec![2, 3, 4, 5]);
    // Task 2's value is what the database refuses (as PostgreSQL refuses U+0000 in jsonb).
    let refused = || DbFailure::Invalid("unsupported Unicode escape sequence (22P05)".into());
    let mut sent = vec![batch];
    let (op, batch, ids) = one_finish(&h.fail(op, refused()));
    assert_eq!(ids, vec![2, 3], "halved, and sent at once: a split is progress, not an outage");
    sent.push(batch);
    let (op, batch, ids) = one_finish(&h.fail(op, refused()));
    assert_eq!(ids, vec![2]);
    sent.push(batch);
    // Alone: rewritten as a failure of its own and sent on its own, beside the next batch.
    let both = finishes(&h.fail(op, refused()));
    assert_eq!(both.len(), 2, "{both:?}");
    let (lone, completions) = both.iter().find(|(_, c)| c[0].task.task == TaskId(2)).cloned().unwrap();
    let (op, _) = both.iter().find(|(_, c)| c[0].task.task == TaskId(3)).cloned().unwrap();
    assert_eq!(completions.len(), 1);
    assert!(serialization_failure(&completions[0]), "{completions:?}");
    assert!(completions[0].args.is_none());
    assert!(h.events.iter().any(|e| matches!(e, Event::OutcomeRefused { task: TaskId(2), .. })));
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "{:?}", h.events);
    sent.push(completions.clone());
    for pair in sent.windows(2) {
        assert_ne!(pair[0], pair[1], "a refused batch was sent again as it was");
    }
    // Refused again once rewritten: not its values. It waits for the lock retry, and the
    // database is not treated as down.
    assert!(finishes(&h.fail(lone, refused())).is_empty(), "no identical re-send at once");
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "{:?}", h.events);
    // The batches go on meanwhile, and double back once they land.
    let (op, _, ids) =
        one_finish(&h.reply(op, DbReply::Finished { applied: vec![(TaskId(3), TaskState::Completed)], lost: vec![] }));
    assert_eq!(ids, vec![4, 5]);
    let applied = vec![(TaskId(4), TaskState::Completed), (TaskId(5), TaskState::Completed)];
    assert!(finishes(&h.reply(op, DbReply::Finished { applied, lost: vec![] })).is_empty());
    let retried = fire_until(&mut h, Timer::LockRetry, Duration::from_secs(5)).expect("a retry after a wait");
    let (op, completions, ids) = one_finish(&retried);
    assert_eq!(ids, vec![2]);
    assert!(serialization_failure(&completions[0]));
    h.reply(op, DbReply::Finished { applied: vec![(TaskId(2), TaskState::Failed)], lost: vec![] });
    let stats = h.worker.stats();
    assert_eq!((stats.completed, stats.failed, stats.lost, h.worker.held()), (4, 1, 0, 0), "{stats:?}");
}

#[test]
fn a_finish_the_database_keeps_refusing_is_dropped_and_never_holds_up_the_others() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], false));
    let (mut op, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    let refused = || DbFailure::Rejected("new row violates check constraint \"app_rule\" (23514)".into());
    let mut tries = 0;
    let mut second_done = false;
    loop {
        tries += 1;
        assert!(tries <= canter::worker::MAX_LONE_REFUSALS, "refused {tries} times and still sent");
        assert!(finishes(&h.fail(op, refused())).is_empty(), "try {tries}: sent again at once");
        assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a refusal is not an outage");
        if !second_done {
            // Another task's finish goes out while the refused one waits.
            let (other, _, ids) = one_finish(&h.finished(&runs[1], TaskOutcome::Success(json!(2))));
            assert_eq!(ids, vec![2]);
            h.reply(other, DbReply::Finished { applied: vec![(TaskId(2), TaskState::Completed)], lost: vec![] });
            second_done = true;
        }
        if h.events.iter().any(|e| matches!(e, Event::OutcomeDropped { task: TaskId(1), .. })) {
            break;
        }
        let retried = fire_until_sent(&mut h, "finish", Duration::from_secs(60)).expect("tried again");
        let (next, _, ids) = one_finish(&retried);
        assert_eq!(ids, vec![1]);
        op = next;
    }
    assert_eq!(tries, canter::worker::MAX_LONE_REFUSALS);
    assert_eq!(h.worker.held(), 0, "dropped: left to the reaper, no longer held");
    assert_eq!(h.worker.stats().outcomes_dropped, 1);
    assert!(fire_until_sent(&mut h, "finish", Duration::from_secs(120)).is_none(), "never sent again");
}

#[test]
fn a_finish_held_up_by_a_lock_is_never_dropped() {
    let (mut h, first) = Harness::default(1);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    let (mut op, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    for _ in 0..3 * canter::worker::MAX_LONE_REFUSALS {
        assert!(finishes(&h.fail(op, lock())).is_empty());
        let retried = fire_until_sent(&mut h, "finish", Duration::from_secs(60)).expect("tried again");
        op = one_finish(&retried).0;
    }
    assert!(!h.events.iter().any(|e| matches!(e, Event::OutcomeDropped { .. })));
    h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    assert_eq!((h.worker.stats().completed, h.worker.held()), (1, 0));
}

#[test]
fn a_finish_that_waited_too_long_for_a_locked_row_is_halved() {
    let (mut h, first) = Harness::default(5);
    let runs = spawns(&start(&mut h, &first, (1..=5).map(|i| task(i, true)).collect(), false));
    let (op, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    for run in &runs[1..] {
        h.finished(run, TaskOutcome::Success(json!(run.id.0)));
    }
    let after = h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    let (op, _, ids) = one_finish(&after);
    assert_eq!(ids, vec![2, 3, 4, 5]);
    // A lock is not an outage: the halves go at once, without the database backoff.
    let retried = h.fail(op, DbFailure::LockTimeout("canceling statement due to lock timeout".into()));
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a lock wait backed everything off");
    let (op, completions, ids) = one_finish(&retried);
    assert_eq!(ids, vec![2, 3], "the row another transaction holds is in one half only");
    assert!(completions.iter().all(|c| matches!(c.outcome, FinishOutcome::Completed(_))), "values untouched");
    let applied = vec![(TaskId(2), TaskState::Completed), (TaskId(3), TaskState::Completed)];
    let (_, _, ids) = one_finish(&h.reply(op, DbReply::Finished { applied, lost: vec![] }));
    assert_eq!(ids, vec![4, 5]);
}

#[test]
fn rows_another_transaction_holds_are_beaten_for_again_soon_with_backoff_and_not_lost() {
    let mut app = app();
    app.recovery.runner_heartbeat_interval_ms = 10_000;
    app.recovery.claimer_heartbeat_interval_ms = 10_000;
    let config = WorkerConfig { concurrency: 2, handler_timeout_ms: None, seed: Some(1), ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app, config);
    start(&mut h, &first, vec![task(1, true), task(2, true)], false);
    let mut gaps = Vec::new();
    let mut last = h.now;
    for round in 0..6 {
        let commands = fire_until_sent(&mut h, "heartbeat", Duration::from_secs(11)).expect("a heartbeat");
        let op = find(&commands, "heartbeat");
        gaps.push(h.now - last);
        last = h.now;
        let busy = if round < 5 { vec![TaskId(1)] } else { vec![] };
        h.reply(op, DbReply::Heartbeat { lost: vec![], busy, handed_back: vec![] });
    }
    let secs: Vec<u64> = gaps.iter().map(Duration::as_secs).collect();
    // The regular beat, then 1 s, 2 s, 4 s, 8 s while task 1 stays busy, at most the interval.
    assert_eq!(secs, vec![10, 1, 2, 4, 8, 10]);
    // After a beat that met no busy row, the interval again.
    fire_until_sent(&mut h, "heartbeat", Duration::from_secs(11)).expect("a heartbeat");
    assert_eq!((h.now - last).as_secs(), 10);
    assert_eq!(h.worker.running(), 2, "busy is not lost");
    assert!(!h.events.iter().any(|e| matches!(e, Event::Lost { .. })), "{:?}", h.events);
}

#[test]
fn a_flood_of_notifications_costs_a_bounded_number_of_claim_passes() {
    use canter::worker::{NOTIFIED_PASS_BURST, NOTIFIED_PASSES_PER_SECOND};
    let (mut h, first) = Harness::default(4);
    let commands = start(&mut h, &first, vec![], false);
    answer_idle(&mut h, commands);
    let (began, before) = (h.now, h.worker.stats().claim_passes);
    // A notification every millisecond; each request is answered a millisecond after it went
    // out (empty), so notifications also arrive while a pass is in flight, as they do. The
    // driver handles an input, then the timers due.
    let mut in_flight: Vec<Command> = Vec::new();
    for _ in 0..1_000 {
        h.now += Duration::from_millis(1);
        let mut commands = h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
        if h.worker.poll_timeout().is_some_and(|(at, _)| at <= h.now) {
            h.worker.handle_timeout(h.now);
            commands.extend(h.drain());
        }
        let answered = answer_once(&mut h, &std::mem::take(&mut in_flight));
        in_flight = [commands, answered].concat();
    }
    answer_idle(&mut h, in_flight);
    let elapsed = (h.now - began).as_secs_f64();
    let passes = h.worker.stats().claim_passes - before;
    let bound = f64::from(NOTIFIED_PASS_BURST) + f64::from(NOTIFIED_PASSES_PER_SECOND) * elapsed + 1.0;
    assert!(passes as f64 <= bound, "{passes} claim passes for 1,000 notifications in {elapsed} s (bound {bound})");
    assert!(passes >= u64::from(NOTIFIED_PASS_BURST), "notifications still wake claims: {passes}");
    assert!(h.worker.stats().notified_passes_limited > 0);
    // A notification for real work still claims within a token's time.
    h.now += Duration::from_millis(60);
    let mut commands = h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None });
    if !has(&commands, "claim") {
        let (timer, fired) = h.fire();
        assert_eq!(timer, Timer::NotifiedPass);
        commands = fired;
    }
    let claim = find(&commands, "claim");
    let next = h.reply(claim, DbReply::Claimed { tasks: vec![task(9, true)], more: false, next_run_in_ms: None });
    assert_eq!(spawns(&next).len(), 1);
}

#[test]
fn a_claim_under_an_older_lease_than_the_one_held_is_an_event_not_a_panic() {
    let (mut h, first) = Harness::default(2);
    let held = ClaimedTask { lease: Lease(5), ..task(1, true) };
    let next = start(&mut h, &first, vec![held], true);
    let old = spawns(&next);
    assert_eq!(old[0].lease, Lease(5));
    // The database went back in time (a restore, a lagging replica): it hands the task out
    // again under lease 3.
    let older = ClaimedTask { lease: Lease(3), ..task(1, true) };
    let claim = find(&next, "claim");
    let after = h.reply(claim, DbReply::Claimed { tasks: vec![older], more: false, next_run_in_ms: None });
    assert!(after.contains(&Command::Abort { task: TaskId(1), lease: Lease(5) }), "{after:?}");
    let new = spawns(&after);
    assert_eq!((new.len(), new[0].lease), (1, Lease(3)));
    assert!(
        h.events.contains(&Event::LeaseWentBack { task: TaskId(1), held: Lease(5), claimed: Lease(3) }),
        "{:?}",
        h.events
    );
    assert_eq!(h.worker.running(), 1);
    // The old run's late answer counts for nothing; the new run's is written under lease 3.
    assert!(finishes(&h.finished(&old[0], TaskOutcome::Success(json!(1)))).is_empty());
    let (_, completions, _) = one_finish(&h.finished(&new[0], TaskOutcome::Success(json!(2))));
    assert_eq!(completions[0].task.lease, Lease(3));
}

#[test]
fn a_heartbeat_that_reports_a_task_lost_while_its_finish_is_in_flight_is_not_a_loss() {
    let config = WorkerConfig { concurrency: 1, handler_timeout_ms: None, seed: Some(1), ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    let (finish, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    let commands = fire_until_sent(&mut h, "heartbeat", Duration::from_secs(31)).expect("a heartbeat");
    let beat = find(&commands, "heartbeat");
    match db_ops(&commands).into_iter().find(|(op, _)| *op == beat).map(|(_, r)| r.clone()) {
        Some(DbRequest::Heartbeat { running, .. }) => assert_eq!(running.len(), 1, "the finishing task is beaten for"),
        other => panic!("{other:?}"),
    }
    // The finish landed first: the beat finds the row gone.
    let after = h.reply(beat, DbReply::Heartbeat { lost: vec![TaskId(1)], busy: vec![], handed_back: vec![] });
    assert!(!after.iter().any(|c| matches!(c, Command::Abort { .. })), "{after:?}");
    assert!(!h.events.iter().any(|e| matches!(e, Event::Lost { .. })), "{:?}", h.events);
    assert_eq!(h.worker.stats().lost, 0);
    h.reply(finish, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    assert!(h.events.contains(&Event::Finished { task: TaskId(1), state: TaskState::Completed }));
    let stats = h.worker.stats();
    assert_eq!((stats.completed, stats.lost, h.worker.held()), (1, 0, 0), "{stats:?}");
}

#[test]
fn an_unanswered_claims_token_rides_on_heartbeats_for_three_minutes() {
    let (mut h, first) = Harness::default(2);
    h.reply(find(&first, "register_worker"), DbReply::Done);
    let claim = find(&first, "claim");
    let DbRequest::Claim { token, .. } = db_ops(&first).into_iter().find(|(op, _)| *op == claim).unwrap().1.clone()
    else {
        unreachable!()
    };
    let lost_at = h.now;
    h.fail(claim, DbFailure::Unknown("no reply within 30s".into()));
    let (_, again) = h.fire();
    answer_idle(&mut h, again);
    let mut carried_until = None;
    while h.now - lost_at < Duration::from_secs(4 * 60) {
        let (_, commands) = h.fire();
        let beat = db_ops(&commands).into_iter().find(|(_, r)| r.kind() == "heartbeat").map(|(op, r)| (op, r.clone()));
        if let Some((op, DbRequest::Heartbeat { abandoned, .. })) = beat {
            if abandoned == vec![token] {
                carried_until = Some(h.now - lost_at);
            } else {
                assert!(abandoned.is_empty(), "{abandoned:?}");
            }
            // A late commit of the claim left a row: the store handed it back.
            let handed_back = if carried_until.is_some() { vec![TaskId(77)] } else { vec![] };
            let after = h.reply(op, DbReply::Heartbeat { lost: vec![], busy: vec![], handed_back });
            answer_idle(&mut h, after);
        }
        let others: Vec<Command> = commands
            .into_iter()
            .filter(|c| !matches!(c, Command::Db { request: DbRequest::Heartbeat { .. }, .. }))
            .collect();
        answer_idle(&mut h, others);
    }
    let carried = carried_until.expect("the token rode on heartbeats");
    let memory = canter::worker::ABANDONED_CLAIM_MEMORY;
    assert!(carried >= memory - Duration::from_secs(60) && carried <= memory, "{carried:?}");
    assert_eq!(h.worker.stats().lost, 0);
    assert_eq!(h.worker.held(), 0);
}

#[test]
fn a_claimed_task_whose_stored_values_could_not_be_read_fails_alone_without_running() {
    let (mut h, first) = Harness::default(4);
    let unreadable = ClaimedTask {
        args: serde_json::Value::Null,
        args_error: Some("recursion limit exceeded at line 1 column 128".into()),
        ..task(2, true)
    };
    let other_policy =
        ClaimedTask { retry_error: Some("max_retries is 999: expected 0 to 20".into()), ..task(3, true) };
    let next = start(&mut h, &first, vec![task(1, true), unreadable, other_policy], false);
    let ran: Vec<TaskId> = spawns(&next).iter().map(|r| r.id).collect();
    assert_eq!(ran, vec![TaskId(1), TaskId(3)], "the others of the claim run; the unreadable one does not");
    let (_, completions, ids) = one_finish(&next);
    assert_eq!(ids, vec![2], "failed at once, in the attempt the claim counted");
    assert!(serialization_failure(&completions[0]), "{completions:?}");
    let unreadable_rows: Vec<TaskId> = h
        .events
        .iter()
        .filter_map(|e| match e {
            Event::UnreadableRow { task, .. } => Some(*task),
            _ => None,
        })
        .collect();
    assert_eq!(unreadable_rows, vec![TaskId(2), TaskId(3)]);
}

#[test]
fn a_reaper_pass_skipped_for_another_reaper_is_counted() {
    let (mut h, first) = Harness::default(2);
    let commands = start(&mut h, &first, vec![], false);
    answer_idle(&mut h, commands);
    let commands = fire_until_sent(&mut h, "reap", Duration::from_secs(31)).expect("a reaper pass");
    let reap = find(&commands, "reap");
    let report = canter::store::ReapReport { skipped: true, ..Default::default() };
    h.reply(reap, DbReply::Reaped(report));
    assert!(h.events.contains(&Event::ReapSkipped), "{:?}", h.events);
    assert_eq!(h.worker.stats().reaps_skipped, 1);
    assert!(!h.events.iter().any(|e| matches!(e, Event::Reaped(_))));
}

/// Item 4: the row a lock holds up, alone in its finish, waits for the lock retry (backing off
/// while the lock holds) without the database backoff: heartbeats and the other finishes go on.
#[test]
fn a_finish_alone_on_a_locked_row_waits_for_the_lock_retry_while_the_rest_goes_on() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], false));
    let (op, _, ids) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    assert_eq!(ids, vec![1]);
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    assert!(finishes(&h.fail(op, lock())).is_empty(), "held back, not sent again at once");
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a lock is not an outage");
    // The other task's finish is not held up.
    let (op, _, ids) = one_finish(&h.finished(&runs[1], TaskOutcome::Success(json!(2))));
    assert_eq!(ids, vec![2]);
    h.reply(op, DbReply::Finished { applied: vec![(TaskId(2), TaskState::Completed)], lost: vec![] });
    let retried = fire_until(&mut h, Timer::LockRetry, Duration::from_secs(2)).expect("the lock retry, a second on");
    let (op, _, ids) = one_finish(&retried);
    assert_eq!(ids, vec![1]);
    // Still locked: held back again, a little longer.
    let failed_at = h.now;
    assert!(finishes(&h.fail(op, lock())).is_empty());
    let retried = fire_until(&mut h, Timer::LockRetry, Duration::from_secs(3)).expect("the lock retry, two seconds on");
    assert_eq!(h.now - failed_at, Duration::from_secs(2), "the lock retry backs off");
    assert_eq!(one_finish(&retried).2, vec![1]);
    // Heartbeats went on for it all along: it is still the worker's.
    let beat = fire_until_sent(&mut h, "heartbeat", Duration::from_secs(31)).expect("a heartbeat");
    let (_, request) = db_ops(&beat).into_iter().find(|(_, r)| r.kind() == "heartbeat").unwrap();
    let DbRequest::Heartbeat { running, .. } = request else { unreachable!() };
    assert_eq!(running.iter().map(|t| t.task).collect::<Vec<_>>(), vec![TaskId(1)]);
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a lock is not an outage");
}

#[test]
fn after_the_grace_period_a_release_a_lock_keeps_holding_up_does_not_hold_shutdown_up() {
    let config = WorkerConfig { shutdown_grace_ms: 2_000, handler_timeout_ms: None, ..WorkerConfig::default() };
    let (mut h, first) = Harness::new(app(), config);
    start(&mut h, &first, vec![task(1, true)], false);
    h.input(Input::Shutdown);
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    let mut release = find(&fire_until_sent(&mut h, "release", Duration::from_secs(3)).unwrap(), "release");
    let mut deregister = None;
    for _ in 0..10 {
        let next = h.fail(release, lock());
        if has(&next, "deregister_worker") {
            deregister = Some(find(&next, "deregister_worker"));
            break;
        }
        let Some(again) = fire_until_sent(&mut h, "release", Duration::from_secs(60)) else { break };
        if has(&again, "deregister_worker") {
            deregister = Some(find(&again, "deregister_worker"));
            break;
        }
        release = find(&again, "release");
    }
    // What the lock holds up is given up on; the worker still deregisters.
    let deregister = deregister.expect("a deregistration once the lock has held shutdown up past its grace");
    h.reply(deregister, DbReply::Done);
    assert!(h.worker.is_stopped(), "still waiting on a lock: {:?}", h.events);
    assert!(h.events.contains(&Event::Drained { abandoned: 1 }), "{:?}", h.events);
}

#[test]
fn a_lock_on_an_abandon_holds_up_abandons_and_releases_only() {
    let (mut h, first) = Harness::default(2);
    h.reply(find(&first, "register_worker"), DbReply::Done);
    h.fail(find(&first, "claim"), DbFailure::Unknown("timed out".into()));
    let (_, again) = h.fire();
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    h.fail(find(&again, "abandon_claim"), lock());
    let next = h.reply(
        find(&again, "claim"),
        DbReply::Claimed { tasks: vec![task(1, true)], more: false, next_run_in_ms: None },
    );
    assert!(!has(&next, "abandon_claim"), "the abandon waits for the lock retry");
    let runs = spawns(&next);
    // Claims and finishes go on meanwhile.
    let finish = find(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish");
    h.reply(finish, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    assert!(has(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim"));
    let retried = fire_until(&mut h, Timer::LockRetry, Duration::from_secs(2)).expect("the lock retry");
    assert!(has(&retried, "abandon_claim"));
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { failures: 2.., .. })), "{:?}", h.events);
}

#[test]
fn a_claim_held_up_by_a_lock_waits_for_the_lock_retry_while_finishes_go_on() {
    let (mut h, first) = Harness::default(2);
    let next = start(&mut h, &first, vec![task(1, true)], true);
    let runs = spawns(&next);
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    assert!(!has(&h.fail(find(&next, "claim"), lock()), "claim"), "not at once");
    assert!(
        !has(&h.input(Input::Notified { queue: "default".into(), priority: None, run_at: None }), "claim"),
        "nor for a notification"
    );
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a lock is not an outage");
    assert!(has(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish"));
    let retried = fire_until(&mut h, Timer::LockRetry, Duration::from_secs(2)).expect("the lock retry");
    assert!(has(&retried, "claim"));
}

#[test]
fn a_heartbeat_held_up_by_a_lock_beats_again_after_the_busy_wait_not_at_once() {
    let (mut h, first) = Harness::default(2);
    start(&mut h, &first, vec![task(1, true)], false);
    let beat = fire_until_sent(&mut h, "heartbeat", Duration::from_secs(31)).expect("a heartbeat");
    let lock = || DbFailure::LockTimeout("canceling statement due to lock timeout".into());
    let failed_at = h.now;
    assert!(!has(&h.fail(find(&beat, "heartbeat"), lock()), "heartbeat"), "not at once");
    let again = fire_until_sent(&mut h, "heartbeat", Duration::from_secs(31)).expect("a heartbeat");
    assert_eq!(h.now - failed_at, canter::worker::BUSY_RETRY_MIN);
    assert!(!h.events.iter().any(|e| matches!(e, Event::DbUnavailable { .. })), "a lock is not an outage");
    assert!(has(&again, "heartbeat"));
}

#[test]
fn workers_look_for_dead_ones_every_liveness_interval_one_request_at_a_time() {
    let mut app = AppConfig::default();
    app.recovery.liveness_check_interval_ms = 1_000;
    app.recovery.liveness_grace_ms = 2_500;
    let (mut h, first) = Harness::new(app, WorkerConfig { seed: Some(1), ..WorkerConfig::default() });
    answer_idle(&mut h, first);
    let started = h.now;
    let sent = fire_until(&mut h, Timer::LivenessCheck, Duration::from_secs(2)).expect("a liveness check");
    assert!(h.now - started <= Duration::from_secs(1), "the first within one interval");
    let reap = db_ops(&sent).into_iter().find(|(_, r)| r.kind() == "reap_dead").map(|(op, r)| (op, r.clone()));
    let Some((op, DbRequest::ReapDead { grace_ms, .. })) = reap else { panic!("no reap_dead in {sent:?}") };
    assert_eq!(grace_ms, 2_500);
    // Unanswered, the next interval sends none.
    let again = fire_until(&mut h, Timer::LivenessCheck, Duration::from_secs(2)).expect("the next interval");
    assert!(!has(&again, "reap_dead"), "one at a time");
    let report = canter::store::ReapReport {
        requeued: vec![TaskId(3)],
        dead_workers: vec![WorkerId("gone".into())],
        ..Default::default()
    };
    h.reply(op, DbReply::Reaped(report.clone()));
    assert_eq!(h.worker.stats().dead_workers_recovered, 1);
    assert!(h.events.contains(&Event::Reaped(report)), "{:?}", h.events);
    let next = fire_until(&mut h, Timer::LivenessCheck, Duration::from_secs(2)).expect("the next interval");
    assert!(has(&next, "reap_dead"));
    // Draining, it stops looking.
    h.input(Input::Shutdown);
    assert!(fire_until_sent(&mut h, "reap_dead", Duration::from_secs(10)).is_none());
}

#[test]
fn without_dead_worker_recovery_no_liveness_check_is_sent() {
    let (mut h, first) = Harness::new(app(), WorkerConfig { seed: Some(1), ..WorkerConfig::default() });
    answer_idle(&mut h, first);
    assert!(fire_until_sent(&mut h, "reap_dead", Duration::from_secs(60)).is_none());
}

/// The finish-and-claim requests among `commands`: op, completions, and the claim's counts.
fn finish_and_claims(commands: &[Command]) -> Vec<(OpId, Vec<Completion>, u32, u32)> {
    db_ops(commands)
        .into_iter()
        .filter_map(|(op, request)| match request {
            DbRequest::FinishAndClaim { completions, my_running, start_now, .. } => {
                Some((op, completions.clone(), *my_running, *start_now))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn in_hard_cap_mode_a_finish_and_the_next_claim_share_one_request() {
    let (mut h, first) = Harness::default(3);
    let next = start(&mut h, &first, vec![task(1, true), task(2, true), task(3, true)], true);
    let runs = spawns(&next);
    // Task 1 ends: its finish and a claim for its slot go together.
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert!(!has(&after, "finish") && !has(&after, "claim"), "{after:?}");
    let sent = finish_and_claims(&after);
    assert_eq!(sent.len(), 1, "{after:?}");
    let (op, completions, my_running, start_now) = sent[0].clone();
    assert_eq!(completions.iter().map(|c| c.task.task).collect::<Vec<_>>(), vec![TaskId(1)]);
    assert_eq!((my_running, start_now), (2, 1), "the finishing task's slot is free");
    // Tasks 2 and 3 end meanwhile: queued, no second request while one is out.
    assert!(finish_and_claims(&h.finished(&runs[1], TaskOutcome::Success(json!(2)))).is_empty());
    assert!(finish_and_claims(&h.finished(&runs[2], TaskOutcome::Success(json!(3)))).is_empty());
    // The answer: task 1 written, task 4 claimed and started; then 2 and 3 go with a claim of 2.
    let reply = DbReply::FinishedAndClaimed {
        applied: vec![(TaskId(1), TaskState::Completed)],
        lost: vec![],
        tasks: vec![task(4, true)],
        more: true,
        next_run_in_ms: None,
    };
    let after = h.reply(op, reply);
    assert_eq!(spawns(&after).iter().map(|r| r.id).collect::<Vec<_>>(), vec![TaskId(4)]);
    let sent = finish_and_claims(&after);
    assert_eq!(sent.len(), 1, "{after:?}");
    let (_, completions, my_running, start_now) = sent[0].clone();
    assert_eq!(completions.iter().map(|c| c.task.task).collect::<Vec<_>>(), vec![TaskId(2), TaskId(3)]);
    assert_eq!((my_running, start_now), (1, 2));
    assert_eq!(h.worker.stats().completed, 1);
}

#[test]
fn in_soft_cap_mode_finishes_and_claims_go_apart() {
    let (mut h, first) =
        Harness::new(soft_cap_app(None), WorkerConfig { concurrency: 2, seed: Some(1), ..WorkerConfig::default() });
    let next = start(&mut h, &first, vec![task(1, true), task(2, true)], true);
    let runs = spawns(&next);
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert!(finish_and_claims(&after).is_empty(), "{after:?}");
    assert!(has(&after, "finish"));
}

#[test]
fn a_finish_and_claim_whose_answer_never_came_undoes_the_claim_and_sends_the_finish_again() {
    let (mut h, first) = Harness::default(2);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true), task(2, true)], true));
    let (op, _, _, _) = finish_and_claims(&h.finished(&runs[0], TaskOutcome::Success(json!(1))))[0].clone();
    let after = h.fail(op, DbFailure::Unknown("timed out".into()));
    // Backed off as an outage; then the abandon of the claim's token and the finish again.
    let retried = fire_until(&mut h, Timer::DbRetry, Duration::from_secs(5)).expect("a retry");
    let all: Vec<Command> = after.into_iter().chain(retried).collect();
    let abandon = db_ops(&all).into_iter().find_map(|(_, r)| match r {
        DbRequest::AbandonClaim { token, .. } => Some(*token),
        _ => None,
    });
    assert_eq!(abandon, Some(op.raw()), "the claim is undone by its token");
    let resent: Vec<TaskId> = finish_and_claims(&all)
        .into_iter()
        .flat_map(|(_, c, _, _)| c)
        .chain(finishes(&all).into_iter().flat_map(|(_, c)| c))
        .map(|c| c.task.task)
        .collect();
    assert_eq!(resent, vec![TaskId(1)], "the finish goes again");
}

#[test]
fn a_refused_batch_left_with_one_item_by_losses_sends_that_item_again_unchanged() {
    // Seed 1017170 of the sweep: a batch of three refused for a value over the database's
    // limit, two of whose tasks were lost meanwhile (claimed again under newer leases), left
    // one healthy outcome alone, which was taken for the refused one and rewritten as
    // WORKER_SERIALIZATION_ERROR.
    let app = soft_cap_app(None);
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 4, seed: Some(1), ..WorkerConfig::default() });
    let started = start(&mut h, &first, (1..=4).map(|i| task(i, true)).collect(), true);
    let runs = spawns(&started);
    let claim = find(&started, "claim");
    let (op, _, _) = one_finish(&h.finished(&runs[0], TaskOutcome::Success(json!(1))));
    for run in &runs[1..] {
        h.finished(run, TaskOutcome::Success(json!(run.id.0)));
    }
    let (op, _, ids) =
        one_finish(&h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] }));
    assert_eq!(ids, vec![2, 3, 4]);
    // Tasks 3 and 4 come back in a claim under newer leases: the old runs are lost.
    let mut again: Vec<ClaimedTask> = vec![task(3, true), task(4, true)];
    for t in &mut again {
        t.lease = Lease(2);
    }
    h.reply(claim, DbReply::Claimed { tasks: again, more: false, next_run_in_ms: None });
    let refused = DbFailure::Invalid("a value over the database's limit".into());
    let (_, completions, ids) = one_finish(&h.fail(op, refused));
    assert_eq!(ids, vec![2], "sent again");
    assert!(
        matches!(&completions[0].outcome, FinishOutcome::Completed(v) if *v == json!(2)),
        "unchanged: {completions:?}"
    );
    assert!(!h.events.iter().any(|e| matches!(e, Event::OutcomeRefused { .. })), "{:?}", h.events);
}

#[test]
fn a_more_urgent_task_overtakes_the_buffer() {
    let app = soft_cap_app(None);
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 1, seed: Some(1), ..WorkerConfig::default() });
    // One runs; two wait in the buffer, the more urgent one (priority -1) after the other.
    let mut urgent = task(3, false);
    urgent.priority = -1;
    let next = start(&mut h, &first, vec![task(1, true), task(2, false), urgent], false);
    let runs = spawns(&next);
    assert_eq!(runs.iter().map(|r| r.id).collect::<Vec<_>>(), vec![TaskId(1)]);
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert_eq!(spawns(&after).iter().map(|r| r.id).collect::<Vec<_>>(), vec![TaskId(3)], "the urgent one first");
}

/// Answers `commands` as a store with endless work would: finishes land; a claim takes its
/// whole budget, starting what it may start at once. Returns the commands the answers led to
/// and the most any claim asked to take ahead.
fn answer_busy(h: &mut Harness, commands: &[Command], next_id: &mut i64) -> (Vec<Command>, u32) {
    let mut out = Vec::new();
    let mut ahead = 0;
    let claimed = |policy: &ClaimPolicy, my_running: u32, my_claimed: u32, start_now: u32, next_id: &mut i64| {
        (0..policy.local_budget(my_running, my_claimed))
            .map(|i| {
                *next_id += 1;
                task(*next_id, i < start_now)
            })
            .collect::<Vec<_>>()
    };
    for (op, request) in db_ops(commands) {
        let reply = match request.clone() {
            DbRequest::Finish { completions, .. } => DbReply::Finished {
                applied: completions.iter().map(|c| (c.task.task, TaskState::Completed)).collect(),
                lost: vec![],
            },
            DbRequest::Claim { policy, my_running, my_claimed, start_now, .. } => {
                ahead = ahead.max(policy.claim_ahead);
                let tasks = claimed(&policy, my_running, my_claimed, start_now, next_id);
                DbReply::Claimed { tasks, more: true, next_run_in_ms: None }
            }
            DbRequest::FinishAndClaim { completions, policy, my_running, my_claimed, start_now, .. } => {
                ahead = ahead.max(policy.claim_ahead);
                let tasks = claimed(&policy, my_running, my_claimed, start_now, next_id);
                DbReply::FinishedAndClaimed {
                    applied: completions.iter().map(|c| (c.task.task, TaskState::Completed)).collect(),
                    lost: vec![],
                    tasks,
                    more: true,
                    next_run_in_ms: None,
                }
            }
            _ => continue,
        };
        out.extend(h.reply(op, reply));
    }
    (out, ahead)
}

#[test]
fn a_hard_cap_worker_claims_ahead_of_its_free_slots_as_fast_as_it_works() {
    let (mut h, first) = Harness::default(2);
    let next = start(&mut h, &first, vec![task(1, true), task(2, true)], true);
    let mut running = spawns(&next);
    let mut pending: Vec<Command> = next.into_iter().filter(|c| matches!(c, Command::Db { .. })).collect();
    let mut next_id = 2;
    let mut ahead = 0;
    // Handlers that finish at once, every 200 µs: a rate of thousands a second.
    for _ in 0..100 {
        h.now += Duration::from_micros(200);
        let inputs: Vec<Input> = std::mem::take(&mut running)
            .iter()
            .map(|run| Input::TaskFinished { task: run.id, lease: run.lease, outcome: TaskOutcome::Success(json!(1)) })
            .collect();
        h.worker.handle_inputs(inputs, h.now);
        let mut sent = std::mem::take(&mut pending);
        sent.extend(h.drain());
        running.extend(spawns(&sent));
        let (answered, most) = answer_busy(&mut h, &sent, &mut next_id);
        ahead = ahead.max(most);
        running.extend(spawns(&answered));
        pending = answered.into_iter().filter(|c| matches!(c, Command::Db { .. })).collect();
    }
    assert!(ahead > 0, "it claims ahead once it knows its rate");
    assert!(h.worker.claimed() > 0, "claims wait in its buffer");
    // What waits starts without a request as slots free: its claim counts against the caps.
    let runs = running;
    assert!(!runs.is_empty());
    let before = h.worker.claimed();
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert!(!has(&after, "start"), "{after:?}");
    assert_eq!(spawns(&after).len(), 1, "{after:?}");
    assert_eq!(h.worker.claimed(), before - 1);
}

#[test]
fn an_announced_urgent_task_is_claimed_at_once_and_starts_first() {
    let app = soft_cap_app(None);
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 1, seed: Some(1), ..WorkerConfig::default() });
    // One runs and one waits in the buffer: the buffer is full, no pass goes.
    let next = start(&mut h, &first, vec![task(1, true), task(2, false)], true);
    let runs = spawns(&next);
    assert!(!has(&next, "claim"));
    // A less urgent announcement changes nothing; a more urgent one is claimed at once.
    let calm = h.input(Input::Notified { queue: "default".into(), priority: Some(5), run_at: None });
    assert!(!has(&calm, "claim"), "{calm:?}");
    let urgent = h.input(Input::Notified { queue: "default".into(), priority: Some(-1), run_at: None });
    let claims: Vec<(OpId, DbRequest)> =
        db_ops(&urgent).into_iter().filter(|(_, r)| r.kind() == "claim").map(|(op, r)| (op, r.clone())).collect();
    assert_eq!(claims.len(), 1, "an urgent claim: {urgent:?}");
    let (op, DbRequest::Claim { policy, my_running, my_claimed, start_now, .. }) = &claims[0] else { unreachable!() };
    let budget = policy.local_budget(*my_running, *my_claimed);
    assert!((1..=canter::worker::URGENT_CLAIM_MAX).contains(&budget), "a small claim: {budget}");
    assert_eq!(*start_now, 0, "no slot is free");
    // A second announcement while it is out sends no other.
    assert!(!has(&h.input(Input::Notified { queue: "default".into(), priority: Some(-3), run_at: None }), "claim"));
    let mut found = task(9, false);
    found.priority = -1;
    h.reply(*op, DbReply::Claimed { tasks: vec![found], more: true, next_run_in_ms: None });
    // When the slot frees, the urgent task goes before the one buffered earlier.
    let after = h.finished(&runs[0], TaskOutcome::Success(json!(1)));
    assert_eq!(spawns(&after).iter().map(|r| r.id).collect::<Vec<_>>(), vec![TaskId(9)]);
}

/// A worker of one slot (grace period 2 s) whose running task 1 was held up by a lock in three
/// heartbeats in a row, then finished: the harness and the finish's op.
fn finishing_after_three_hold_ups() -> (Harness, OpId) {
    let mut app = app();
    app.recovery.runner_heartbeat_interval_ms = 10_000;
    let config = WorkerConfig {
        concurrency: 1,
        shutdown_grace_ms: 2_000,
        handler_timeout_ms: None,
        seed: Some(1),
        ..WorkerConfig::default()
    };
    let (mut h, first) = Harness::new(app, config);
    let runs = spawns(&start(&mut h, &first, vec![task(1, true)], false));
    for _ in 0..3 {
        let op =
            find(&fire_until_sent(&mut h, "heartbeat", Duration::from_secs(11)).expect("a heartbeat"), "heartbeat");
        h.reply(op, DbReply::Heartbeat { lost: vec![], busy: vec![TaskId(1)], handed_back: vec![] });
    }
    let finish = find(&h.finished(&runs[0], TaskOutcome::Success(json!(1))), "finish_and_claim");
    (h, finish)
}

/// Sim seed 10198: lock hold-ups long before, then an outage through the grace period. When the
/// database answers again nothing is held up by a lock: the finish goes out and lands, and
/// nothing is given up on.
#[test]
fn hold_ups_before_an_outage_do_not_make_shutdown_give_up_after_it() {
    let (mut h, finish) = finishing_after_three_hold_ups();
    h.fail(finish, DbFailure::Unavailable("down".into()));
    h.input(Input::Shutdown);
    // The finish goes out again after the outage and is answered only after the grace period.
    let mut resent = None;
    loop {
        let (timer, commands) = h.fire();
        if has(&commands, "finish") {
            let (op, _, ids) = one_finish(&commands);
            assert_eq!(ids, vec![1]);
            resent = Some(op);
        }
        if timer == Timer::ShutdownGrace {
            break;
        }
    }
    let op = resent.expect("the finish went out again within the grace period");
    let next = h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    h.reply(find(&next, "deregister_worker"), DbReply::Done);
    assert!(h.events.contains(&Event::Drained { abandoned: 0 }), "{:?}", h.events);
}

/// Sim seed 55848: a pass and an urgent claim out at once, applied by the database in the other
/// order than they were sent: the urgent claim took task 9 under lease 1, its claim lapsed and
/// the pass took it again under lease 2. The pass's answer comes first; the urgent claim's
/// late answer is older news, not a database gone back in time.
#[test]
fn a_late_answer_of_a_claim_applied_before_the_other_one_out_is_ignored() {
    let app = soft_cap_app(None);
    let (mut h, first) = Harness::new(app, WorkerConfig { concurrency: 2, seed: Some(1), ..WorkerConfig::default() });
    let next = start(&mut h, &first, vec![task(1, true)], true);
    let pass = find(&next, "claim");
    let urgent = find(&h.input(Input::Notified { queue: "default".into(), priority: Some(-1), run_at: None }), "claim");
    assert!(urgent.raw() > pass.raw(), "the urgent claim is sent after the pass");
    let mut newer = task(9, true);
    newer.lease = Lease(2);
    newer.attempt = Attempt(2);
    let runs = spawns(&h.reply(pass, DbReply::Claimed { tasks: vec![newer], more: false, next_run_in_ms: None }));
    assert_eq!(runs.iter().map(|r| (r.id, r.lease)).collect::<Vec<_>>(), vec![(TaskId(9), Lease(2))]);
    let mut older = task(9, true);
    older.priority = -1;
    let late = h.reply(urgent, DbReply::Claimed { tasks: vec![older], more: false, next_run_in_ms: None });
    assert!(late.iter().all(|c| !matches!(c, Command::Abort { .. } | Command::Spawn(_))), "{late:?}");
    assert!(!h.events.iter().any(|e| matches!(e, Event::Lost { .. } | Event::LeaseWentBack { .. })), "{:?}", h.events);
    assert_eq!(h.worker.running(), 2);
}

/// Sim seed 74029: a finish waits on a locked row through the grace period, and its lock
/// timeout comes back after it, when the row is free again. Hold-ups of before the grace period
/// do not count: the finish is tried again, lands, and nothing is given up on.
#[test]
fn hold_ups_before_the_grace_period_ends_do_not_make_shutdown_give_up() {
    let (mut h, finish) = finishing_after_three_hold_ups();
    h.input(Input::Shutdown);
    fire_until(&mut h, Timer::ShutdownGrace, Duration::from_secs(3)).expect("the grace period ends");
    h.fail(finish, DbFailure::LockTimeout("canceling statement due to lock timeout".into()));
    let again = fire_until_sent(&mut h, "finish", Duration::from_secs(30)).expect("the finish tried again");
    let (op, _, ids) = one_finish(&again);
    assert_eq!(ids, vec![1]);
    let next = h.reply(op, DbReply::Finished { applied: vec![(TaskId(1), TaskState::Completed)], lost: vec![] });
    h.reply(find(&next, "deregister_worker"), DbReply::Done);
    assert!(h.events.contains(&Event::Drained { abandoned: 0 }), "{:?}", h.events);
}

/// The claims among `commands`, with their policies.
fn claims_with_policies(commands: &[Command]) -> Vec<(OpId, std::sync::Arc<ClaimPolicy>)> {
    db_ops(commands)
        .into_iter()
        .filter_map(|(op, r)| match r {
            DbRequest::Claim { policy, .. } => Some((op, policy.clone())),
            _ => None,
        })
        .collect()
}

fn with_priority(id: i64, started: bool, priority: i16) -> ClaimedTask {
    ClaimedTask { priority, ..task(id, started) }
}

/// A worker of 64 slots whose first pass took priorities 3 and 2 and left more: the second
/// pass, in flight, and its policy.
fn through_a_backlog(config: WorkerConfig) -> (Harness, OpId, std::sync::Arc<ClaimPolicy>) {
    let (mut h, first) = Harness::new(app(), config);
    let opening = claims_with_policies(&first);
    assert_eq!(opening[0].1.min_priority, None, "the first pass takes any");
    let next = start(&mut h, &first, vec![with_priority(1, true, 3), with_priority(2, true, 2)], true);
    let passes = claims_with_policies(&next);
    assert_eq!(passes.len(), 1, "{next:?}");
    let (pass, policy) = passes[0].clone();
    (h, pass, policy)
}

fn slots(concurrency: u32) -> WorkerConfig {
    WorkerConfig { concurrency, seed: Some(1), ..WorkerConfig::default() }
}

fn claimed(tasks: Vec<ClaimedTask>, more: bool) -> DbReply {
    DbReply::Claimed { tasks, more, next_run_in_ms: None }
}

/// Through a backlog (every pass leaves more) each pass starts at the most urgent priority the
/// last one took, so a task enqueued more urgent than the backlog is left to the small urgent
/// claims and never held for the whole of a large statement. What came below the floor
/// unannounced is swept by an urgent claim `FLOOR_SWEEP_INTERVAL` after a pass with a floor;
/// a sweep that leaves more lifts the floor for the next pass, which takes the rest in order.
#[test]
fn passes_through_a_backlog_leave_more_urgent_tasks_to_urgent_claims() {
    let (mut h, pass, policy) = through_a_backlog(slots(64));
    assert_eq!((policy.min_priority, policy.max_priority), (Some(2), None), "the floor: the most urgent taken");
    let sent_at = h.now;
    let sweep = loop {
        let (timer, commands) = h.fire();
        if timer == Timer::FloorSweep {
            break commands;
        }
    };
    assert_eq!(h.now - sent_at, canter::worker::FLOOR_SWEEP_INTERVAL);
    let sweeps = claims_with_policies(&sweep);
    assert_eq!(sweeps.len(), 1, "{sweep:?}");
    let (op, policy) = sweeps[0].clone();
    assert_eq!((policy.min_priority, policy.max_priority), (None, Some(1)), "below the floor only");
    let asked = canter::worker::URGENT_CLAIM_MAX;
    assert_eq!(policy.max_claim_per_worker, asked, "a small claim");
    // It left more (a bulk enqueue of urgent tasks): no sweep after sweep, eight at a time;
    // the next pass goes without a floor, whatever the pass in flight brings back.
    let full = (0..asked as i64).map(|i| with_priority(100 + i, false, 0)).collect();
    assert!(claims_with_policies(&h.reply(op, claimed(full, true))).is_empty());
    let next = h.reply(pass, claimed(vec![with_priority(3, true, 2)], true));
    let lifted = claims_with_policies(&next);
    assert_eq!(lifted.len(), 1, "{next:?}");
    assert_eq!(lifted[0].1.min_priority, None, "the floor lifted for one pass");
    // That pass left more: the one after has a floor again.
    let again = h.reply(lifted[0].0, claimed(vec![with_priority(4, true, 1)], true));
    assert_eq!(claims_with_policies(&again)[0].1.min_priority, Some(1));
}

/// A pass that ran short above its floor says nothing of what is below it: a pass without a
/// floor follows at once (sim seeds 3002020 and 3005577: an event-driven worker waited with
/// tasks below the floor), and once that one runs short, no floor and no sweep are left.
#[test]
fn a_pass_that_ran_short_above_its_floor_is_followed_by_one_without() {
    let (mut h, pass, _) = through_a_backlog(slots(64));
    let ran_short = h.reply(pass, claimed(vec![with_priority(3, true, 2)], false));
    let unfloored = claims_with_policies(&ran_short);
    assert_eq!(unfloored.len(), 1, "{ran_short:?}");
    assert_eq!(unfloored[0].1.min_priority, None, "no floor after a pass that ran short");
    let idle = h.reply(unfloored[0].0, claimed(vec![], false));
    assert!(claims_with_policies(&idle).is_empty(), "an unfloored pass that ran short ends: {idle:?}");
    let start = h.now;
    while let Some((at, timer)) = h.worker.poll_timeout() {
        assert_ne!(timer, Timer::FloorSweep, "a sweep with no floor");
        if at > start + Duration::from_secs(1) {
            break;
        }
        h.fire();
    }
}

/// With `max_claim_per_worker` binding, the pass in flight takes all the room and no urgent
/// claim can go beside it: the next pass goes without a floor, so what was announced below it
/// does not wait for the backlog to end.
#[test]
fn an_urgent_claim_with_no_room_lifts_the_floor() {
    let config = WorkerConfig { max_claim_per_worker: 2, ..slots(8) };
    let (mut h, pass, policy) = through_a_backlog(config);
    assert_eq!(policy.min_priority, Some(2));
    let announced = h.input(Input::Notified { queue: "default".into(), priority: Some(-1), run_at: None });
    assert!(claims_with_policies(&announced).is_empty(), "no room beside the pass: {announced:?}");
    let next = h.reply(pass, claimed(vec![with_priority(3, false, 2)], true));
    let passes = claims_with_policies(&next);
    assert_eq!(passes.len(), 1, "{next:?}");
    assert_eq!(passes[0].1.min_priority, None, "the announced task is taken in claim order");
}

/// A pass woken only by enqueues that announced their priorities and run-ats claims the rows as
/// urgent as the most urgent announced or less, due at the earliest announced run-at or later
/// (`min_priority`, `min_run_at`): with the xmin held, its index walk then starts past the
/// entries of rows claimed before. Announcements heard while a pass is in flight bound the next
/// one. Anything else since the last pass (a notification without a run-at, a poll) makes the
/// next pass look at every row; a pass that left more, whether it took tasks or none, passes
/// its own bound on.
#[test]
fn passes_woken_by_announced_run_ats_claim_from_the_earliest() {
    let notified = |priority: i16, run_at: Option<i64>| Input::Notified {
        queue: "default".into(),
        priority: Some(priority),
        run_at: run_at.map(DbTime),
    };
    // The pass among `commands` and its bound: (priority, run-at) when it has a run-at bound.
    let the_pass = |commands: &[Command]| {
        let passes = claims_with_policies(commands);
        assert_eq!(passes.len(), 1, "one pass: {commands:?}");
        let policy = &passes[0].1;
        let bound = policy.min_run_at.map(|at| (policy.min_priority.expect("a priority with the run-at"), at.0));
        (passes[0].0, bound)
    };
    let (mut h, first) = Harness::new(app(), slots(64));
    let (op, bound) = the_pass(&first);
    assert_eq!(bound, None, "the first pass looks at every row");
    assert!(claims_with_policies(&h.reply(op, claimed(vec![], false))).is_empty());

    let (op, bound) = the_pass(&h.input(notified(2, Some(5_000))));
    assert_eq!(bound, Some((2, 5_000)), "woken by one announcement: from its priority and run-at");
    // Heard while that pass is in flight: they bound the next one, each on its own.
    assert!(claims_with_policies(&h.input(notified(3, Some(4_500)))).is_empty());
    assert!(claims_with_policies(&h.input(notified(1, Some(4_800)))).is_empty());
    let (op, bound) = the_pass(&h.reply(op, claimed(vec![task(1, true)], false)));
    assert_eq!(bound, Some((1, 4_500)), "the most urgent and the earliest announced since the last pass was sent");

    // It took a task and left more: what it left is in its range, where the next pass goes on.
    let (op, bound) = the_pass(&h.reply(op, claimed(vec![task(2, true)], true)));
    assert_eq!(bound, Some((1, 4_500)), "after a pass that took tasks and left more");
    // That pass carried a priority floor; having run short, one without follows.
    let (op, bound) = the_pass(&h.reply(op, claimed(vec![], false)));
    assert_eq!(bound, None, "a pass that follows a floored one");
    assert!(claims_with_policies(&h.reply(op, claimed(vec![], false))).is_empty());

    // A notification without a run-at (a hand-back, a keyed enqueue), among others.
    let (op, bound) = the_pass(&h.input(notified(0, Some(6_000))));
    assert_eq!(bound, Some((0, 6_000)));
    h.input(notified(0, Some(6_100)));
    h.input(notified(0, None));
    let (op, bound) = the_pass(&h.reply(op, claimed(vec![], false)));
    assert_eq!(bound, None, "a wake-up that names no run-at");

    // Left more but took nothing (a queue at its cap): what it left is in its range.
    h.reply(op, claimed(vec![], false));
    let (op, bound) = the_pass(&h.input(notified(1, Some(7_000))));
    assert_eq!(bound, Some((1, 7_000)));
    assert!(claims_with_policies(&h.reply(op, claimed(vec![], true))).is_empty(), "blocked: no pass at once");
    let (op, bound) = the_pass(&h.input(notified(4, Some(9_000))));
    assert_eq!(bound, Some((1, 7_000)), "the blocked pass's range and the new announcement's");
    h.reply(op, claimed(vec![], false));

    // The poll looks at every row.
    let polled = fire_until_sent(&mut h, "claim", Duration::from_secs(60)).expect("the poll claims");
    let (op, bound) = the_pass(&polled);
    assert_eq!(bound, None, "a poll");
    h.reply(op, claimed(vec![], false));

    // However busy the queue (each pass pushes the poll back), every row is looked at once a
    // poll interval: what waits below the bounds unannounced (a row another transaction held
    // as a pass went by, a dropped wake-up) is not left for long. A small claim beside the
    // bounded pass looks, in claim order from the first row, so that under a held xmin its
    // walk of dead index entries holds up no pass.
    let full_at = h.now;
    let mut run_at = 10_000;
    let mut looks = Vec::new();
    for n in 0..60 {
        h.now += Duration::from_millis(100);
        run_at += 100;
        let commands = h.input(notified(0, Some(run_at)));
        let claims = claims_with_policies(&commands);
        let (op, pass) = claims.first().expect("a pass");
        let op = *op;
        assert!(pass.min_run_at.is_some(), "pass {n} is bounded: {commands:?}");
        if let Some((look, policy)) = claims.get(1) {
            assert_eq!((policy.min_priority, policy.min_run_at, policy.max_priority), (None, None, None));
            looks.push((n, *look));
        }
        h.reply(op, claimed(vec![], false));
    }
    let interval = Duration::from_millis(WorkerConfig::default().poll_interval_ms);
    let at: Vec<usize> = looks.iter().map(|(n, _)| *n).collect();
    assert_eq!(at, vec![interval.as_millis() as usize / 100 - 1], "one look after {interval:?}, from {full_at:?}");
    // A look that takes all it may and finds more: another looks on at once, beside the
    // passes, until one finds no more.
    let (_, mut look) = looks[0];
    for n in 0..3 {
        let full: Vec<_> = (0..8).map(|i| task(100 + 10 * n + i, false)).collect();
        let again = claims_with_policies(&h.reply(look, claimed(full, true)));
        assert_eq!(again.len(), 1, "another look: {again:?}");
        assert_eq!((again[0].1.min_run_at, again[0].1.max_priority), (None, None));
        // A look (the urgent claim's) may take its budget beside what the worker holds, no
        // more; this worker's passes have no such cap.
        assert!(again[0].1.max_claim_per_worker > 0, "a look, not a pass: {again:?}");
        look = again[0].0;
    }
    assert!(claims_with_policies(&h.reply(look, claimed(vec![task(200, false)], false))).is_empty());
    // One that left rows it could not take: the next pass looks at every row.
    h.now += interval;
    let commands = h.input(notified(0, Some(run_at + 1)));
    let claims = claims_with_policies(&commands);
    assert_eq!(claims.len(), 2, "a pass and a look: {commands:?}");
    h.reply(claims[0].0, claimed(vec![], false));
    let (op, bound) = the_pass(&h.reply(claims[1].0, claimed(vec![task(300, false)], true)));
    assert_eq!(bound, None, "after a look that left rows it could not take");
    h.reply(op, claimed(vec![], false));
}

/// Fires timers, answering every request as an idle store would, until one of `kind` goes out:
/// that one, unanswered.
fn fire_answering_until(h: &mut Harness, kind: &str, within: Duration) -> Option<(OpId, DbRequest)> {
    let until = h.now + within;
    while h.worker.poll_timeout().is_some_and(|(at, _)| at <= until) {
        let mut pending = h.fire().1;
        while !pending.is_empty() {
            let found = db_ops(&pending).into_iter().find(|(_, r)| r.kind() == kind).map(|(op, r)| (op, r.clone()));
            if let Some((op, request)) = found {
                pending.retain(|c| !matches!(c, Command::Db { op: other, .. } if *other == op));
                answer_idle(h, pending);
                return Some((op, request));
            }
            pending = answer_once(h, &pending);
        }
    }
    None
}

/// The waiting marks among `commands`: (op, marked or unmarked).
fn waiting_marks(commands: &[Command]) -> Vec<(OpId, bool)> {
    db_ops(commands)
        .into_iter()
        .filter_map(|(op, r)| match r {
            DbRequest::SetWaiting { waiting, queues, .. } => {
                assert_eq!(queues, &vec!["default".to_owned()]);
                Some((op, *waiting))
            }
            _ => None,
        })
        .collect()
}

/// A client's enqueue notifies a queue only while a worker's mark of it takes the task in: a
/// worker marks itself once registered and out of work, claims once more after its mark (what
/// committed before it notified nobody), also when a retried mark finds the lost try's mark
/// there, keeps its mark when a cap cuts a pass short (its other queues may wait for work),
/// renews its mark each heartbeat interval (a renewal that finds it there asks for nothing; one
/// that writes it again, for a pass), polls while a mark it wants keeps failing, and narrows
/// its mark to tasks more urgent than its backlog when a pass fills its room and leaves more.
/// A worker that does not listen never marks.
#[test]
fn a_worker_out_of_work_marks_itself_waiting_and_narrows_its_mark_through_a_backlog() {
    let notified = Input::Notified { queue: "default".into(), priority: Some(0), run_at: None };
    // The only pass among `commands`, and how many tasks it may take.
    let pass_and_budget = |commands: &[Command]| {
        let passes: Vec<(OpId, u32)> = db_ops(commands)
            .into_iter()
            .filter_map(|(op, r)| match r {
                DbRequest::Claim { policy, my_running, my_claimed, .. } => {
                    Some((op, policy.local_budget(*my_running, *my_claimed)))
                }
                _ => None,
            })
            .collect();
        assert_eq!(passes.len(), 1, "one pass: {commands:?}");
        passes[0]
    };
    let one_pass = |commands: &[Command]| pass_and_budget(commands).0;
    let (mut h, first) = Harness::new(app(), slots(4));
    let register = db_ops(&first)
        .into_iter()
        .find_map(|(op, r)| matches!(r, DbRequest::RegisterWorker(_)).then_some(op))
        .expect("it registers");
    // Out of work but not in the registry yet: another worker's mark would delete its mark.
    assert!(waiting_marks(&h.reply(one_pass(&first), claimed(vec![], false))).is_empty());
    let commands = h.reply(register, DbReply::Done);
    let [(mark, true)] = waiting_marks(&commands)[..] else { panic!("one mark: {commands:?}") };
    // Its answer is lost (it may commit all the same, later): the retry finds the mark there
    // ("as it was") and still asks for a pass, since the worker did not hold the mark before.
    h.fail(mark, DbFailure::Unknown("no reply".into()));
    let retry = fire_answering_until(&mut h, "set_waiting", Duration::from_secs(10)).expect("the mark again");
    assert!(matches!(retry.1, DbRequest::SetWaiting { waiting: true, .. }));
    let pass = one_pass(&h.reply(retry.0, DbReply::WaitingSet { written: false }));
    // Marked now: nothing more to send when that pass finds nothing either.
    assert!(waiting_marks(&h.reply(pass, claimed(vec![], false))).is_empty());

    // A pass a cap cut short (less than its room, more left) and one a cap stopped (nothing
    // taken) change nothing.
    let (pass, budget) = pass_and_budget(&h.input(notified.clone()));
    assert!(budget > 1);
    let commands = h.reply(pass, claimed(vec![task(1, true)], true));
    assert!(waiting_marks(&commands).is_empty());
    assert!(waiting_marks(&h.reply(one_pass(&commands), claimed(vec![], true))).is_empty());

    // Renewed each heartbeat interval; a renewal held up by a lock goes again after the
    // lock retry, and one that finds the mark deleted (written) claims once more.
    let renewal = fire_answering_until(&mut h, "set_waiting", Duration::from_secs(120)).expect("a renewal");
    assert!(matches!(renewal.1, DbRequest::SetWaiting { waiting: true, .. }));
    assert!(claims_with_policies(&h.reply(renewal.0, DbReply::WaitingSet { written: false })).is_empty());
    let renewal = fire_answering_until(&mut h, "set_waiting", Duration::from_secs(120)).expect("a renewal");
    assert!(matches!(renewal.1, DbRequest::SetWaiting { waiting: true, .. }));
    h.fail(renewal.0, DbFailure::LockTimeout("waiting_workers".into()));
    let renewal = fire_answering_until(&mut h, "set_waiting", Duration::from_secs(30)).expect("the renewal again");
    assert!(matches!(renewal.1, DbRequest::SetWaiting { waiting: true, .. }));
    let pass = one_pass(&h.reply(renewal.0, DbReply::WaitingSet { written: true }));
    h.reply(pass, claimed(vec![], false));

    // A backlog: a pass that fills its room and leaves more narrows the mark to tasks more
    // urgent than the least urgent it took.
    let (pass, budget) = pass_and_budget(&h.input(notified.clone()));
    let tasks: Vec<ClaimedTask> =
        (10..10 + i64::from(budget)).map(|i| with_priority(i, false, (i % 3) as i16)).collect();
    let commands = h.reply(pass, claimed(tasks, true));
    let narrowed: Vec<(OpId, Option<i16>)> = db_ops(&commands)
        .into_iter()
        .filter_map(|(op, r)| match r {
            DbRequest::SetWaiting { waiting: false, urgent_below, .. } => Some((op, *urgent_below)),
            _ => None,
        })
        .collect();
    let [(_, Some(2))] = narrowed[..] else { panic!("one narrowed mark below 2: {commands:?}") };

    // An event-driven worker whose mark keeps failing (a lock) polls meanwhile: no enqueue
    // notifies it.
    let config = WorkerConfig { deployment_mode: DeploymentMode::EventDrivenOnly, ..slots(4) };
    let (mut h, first) = Harness::new(app(), config);
    h.input(Input::Listener { connected: true });
    h.reply(find(&first, "register_worker"), DbReply::Done);
    let commands = h.reply(find(&first, "claim"), claimed(vec![], false));
    let [(mark, true)] = waiting_marks(&commands)[..] else { panic!("one mark: {commands:?}") };
    // The pass the listener asked for finds nothing either.
    h.reply(one_pass(&commands), claimed(vec![], false));
    h.fail(mark, DbFailure::LockTimeout("waiting_workers".into()));
    let mut polled = false;
    let until = h.now + Duration::from_millis(WorkerConfig::default().poll_interval_ms) * 2;
    while !polled && h.worker.poll_timeout().is_some_and(|(at, _)| at <= until) {
        let commands = h.fire().1;
        polled = has(&commands, "claim");
        if let Some(&(op, _)) = waiting_marks(&commands).first() {
            h.fail(op, DbFailure::LockTimeout("waiting_workers".into()));
        }
    }
    assert!(polled, "no pass while the mark kept failing");

    // A worker that only polls hears no notification: it never marks.
    let config = WorkerConfig { deployment_mode: DeploymentMode::PollingOnly, ..slots(4) };
    let (mut h, first) = Harness::new(app(), config);
    for (op, request) in db_ops(&first) {
        match request {
            DbRequest::RegisterWorker(_) => assert!(waiting_marks(&h.reply(op, DbReply::Done)).is_empty()),
            DbRequest::Claim { .. } => assert!(waiting_marks(&h.reply(op, claimed(vec![], false))).is_empty()),
            _ => {}
        }
    }
    assert!(fire_until_sent(&mut h, "set_waiting", Duration::from_secs(120)).is_none());
}
