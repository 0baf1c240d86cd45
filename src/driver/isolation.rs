//! The isolated executor: tasks registered as isolated run in child processes of a pool, so
//! that a task that aborts, segfaults, overflows its stack, is killed by the OOM killer or runs
//! past its timeout costs that task and its child, never the worker.
//!
//! A child is the worker's own program started again (the same path and arguments) with
//! [`CHILD_ENV`] set: its `main` calls the adapter's child entry first thing
//! (`canter_tokio::isolation::serve_child_if_asked`), which serves tasks with the same
//! registry, so the user's handlers are the child's. Worker and child speak over a Unix socket
//! of their own in length-prefixed frames ([`crate::isolation`]); the child's stdout and stderr
//! stay the worker's, so a handler's prints are harmless.
//!
//! One task at a time per child. A child that dies or breaks the protocol mid-task fails that
//! task with `WORKER_CHILD_CRASHED` and is replaced on the next task. A task aborted by the
//! worker (its timeout, a revocation, the end of the shutdown grace) kills its child: blocking
//! code stops at last. The pool's I/O runs on threads of its own, so it works on any runtime.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};

use super::Handlers;
use crate::isolation::{
    CHILD_ENV, CHILD_MEMORY_ENV, ChildFailure, FrameReader, FromChild, ToChild, child_failure, encode_frame,
};
use crate::task::{ErrorCode, TaskError};
use crate::worker::{TaskOutcome, TaskRun};

/// How long a new child may take to connect before it counts as failed.
const CHILD_START_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a starting child's connection is looked for.
const CHILD_START_POLL: Duration = Duration::from_millis(2);

/// The settings of a pool of children.
#[derive(Debug, Clone)]
pub struct IsolationOptions {
    /// How many children run tasks at once (at least 1).
    pub processes: usize,
    /// Each child's address space limit in bytes (`RLIMIT_AS`): an allocation past it fails
    /// (the child aborts) instead of the machine's OOM killer taking a process.
    pub memory_limit_bytes: Option<u64>,
    /// A child is replaced after running this many tasks (a cure for leaky native libraries).
    pub recycle_after: Option<u64>,
    /// The program children run: this process's own by default.
    pub program: Option<PathBuf>,
    /// Its arguments: this process's own by default (so that a `main` that parses them first
    /// parses them the same way).
    pub args: Option<Vec<OsString>>,
}

impl Default for IsolationOptions {
    fn default() -> Self {
        IsolationOptions { processes: 2, memory_limit_bytes: None, recycle_after: None, program: None, args: None }
    }
}

/// Counts of a pool's work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Children started.
    pub started: u64,
    /// Tasks run to an answer.
    pub answered: u64,
    /// Children that died or broke the protocol holding a task.
    pub crashed: u64,
    /// Children killed because their task was aborted (a timeout, a revocation, a shutdown).
    pub killed: u64,
    /// Children replaced after `recycle_after` tasks.
    pub recycled: u64,
}

/// A pool of child processes that run isolated tasks. Cheap to clone.
#[derive(Clone)]
pub struct ProcessPool {
    inner: Arc<Pool>,
}

struct Pool {
    options: IsolationOptions,
    state: Mutex<PoolState>,
    started: AtomicU64,
    answered: AtomicU64,
    crashed: AtomicU64,
    killed: AtomicU64,
    recycled: AtomicU64,
    /// Where the children's sockets are bound.
    socket_dir: PathBuf,
}

#[derive(Default)]
struct PoolState {
    idle: Vec<ChildProcess>,
    /// Children running a task (or starting).
    busy: usize,
    waiting: VecDeque<oneshot::Sender<()>>,
    next_number: u64,
}

/// A live child: its process, its socket and what its reader thread hears.
struct ChildProcess {
    process: Child,
    socket: UnixStream,
    heard: mpsc::UnboundedReceiver<Result<FromChild, ChildFailure>>,
    tasks_run: u64,
}

impl ProcessPool {
    /// A pool with `options`; children start when tasks need them. Refused in a child of a
    /// pool (whose `main` went on instead of serving): children of children would start
    /// without end.
    pub fn new(options: IsolationOptions) -> std::io::Result<ProcessPool> {
        if child_socket().is_some() {
            return Err(std::io::Error::other(format!(
                "this process is a child of a process pool ({CHILD_ENV} is set): main must call the child entry \
                 (serve_child_if_asked) before it builds a worker"
            )));
        }
        let socket_dir = private_dir()?;
        let options = IsolationOptions { processes: options.processes.max(1), ..options };
        Ok(ProcessPool {
            inner: Arc::new(Pool {
                options,
                state: Mutex::new(PoolState::default()),
                started: AtomicU64::new(0),
                answered: AtomicU64::new(0),
                crashed: AtomicU64::new(0),
                killed: AtomicU64::new(0),
                recycled: AtomicU64::new(0),
                socket_dir,
            }),
        })
    }

    /// How many children run tasks at once.
    pub fn processes(&self) -> usize {
        self.inner.options.processes
    }

    /// Counts so far.
    pub fn stats(&self) -> PoolStats {
        let p = &self.inner;
        PoolStats {
            started: p.started.load(Ordering::Relaxed),
            answered: p.answered.load(Ordering::Relaxed),
            crashed: p.crashed.load(Ordering::Relaxed),
            killed: p.killed.load(Ordering::Relaxed),
            recycled: p.recycled.load(Ordering::Relaxed),
        }
    }

    /// Runs `run` in a child: its outcome, or `WORKER_CHILD_CRASHED` if the child fails it.
    /// Dropping the future (an abort) kills the child.
    pub fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome> {
        let pool = self.inner.clone();
        async move {
            let task = run.id;
            let mut lease = match pool.clone().acquire().await {
                Ok(lease) => lease,
                Err(error) => {
                    return TaskOutcome::Failure(TaskError::new(
                        ErrorCode::WorkerChildCrashed,
                        format!("no child process could be started for task {task}: {error}"),
                    ));
                }
            };
            let message = ToChild::Run {
                task,
                attempt: run.attempt,
                name: run.name,
                queue: run.queue,
                priority: run.priority,
                enqueued_at: run.enqueued_at,
                run_at: run.run_at,
                args: run.args,
            };
            let child = lease.child.as_mut().expect("a leased child");
            let sent = write_frame(&child.socket, &encode_frame(&message));
            let answer = match sent {
                Err(_) => Err(ChildFailure::Closed),
                Ok(()) => loop {
                    match child.heard.next().await {
                        Some(Ok(FromChild::Done { task: done, outcome })) if done == task => break Ok(outcome),
                        Some(Ok(FromChild::Ready { .. })) => continue,
                        Some(Ok(FromChild::Done { task: other, .. })) => {
                            break Err(ChildFailure::Garbled(format!("the outcome of task {other}, not {task}")));
                        }
                        Some(Err(failure)) => break Err(failure),
                        None => break Err(ChildFailure::Closed),
                    }
                },
            };
            match answer {
                Ok(outcome) => {
                    pool.answered.fetch_add(1, Ordering::Relaxed);
                    lease.release();
                    TaskOutcome::from(outcome)
                }
                Err(failure) => {
                    pool.crashed.fetch_add(1, Ordering::Relaxed);
                    let failure = lease.end(failure).await;
                    TaskOutcome::Failure(child_failure(task, &failure))
                }
            }
        }
        .boxed()
    }
}

impl Pool {
    /// An idle child, a new one when the pool has room, or the first to come free.
    async fn acquire(self: Arc<Self>) -> std::io::Result<Lease> {
        loop {
            let wait = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                // Idle children are not counted in `busy`: a new one starts only when none is.
                let mut found = None;
                while let Some(mut child) = state.idle.pop() {
                    if child.is_alive() {
                        found = Some(child);
                        break;
                    }
                    // Died while idle (an operator, the OOM killer): no task pays for it.
                    end_child(child);
                }
                if let Some(child) = found {
                    state.busy += 1;
                    return Ok(Lease { pool: self.clone(), child: Some(child) });
                }
                if state.busy < self.options.processes {
                    state.busy += 1;
                    state.next_number += 1;
                    Err(state.next_number)
                } else {
                    let (tx, rx) = oneshot::channel();
                    state.waiting.push_back(tx);
                    Ok(rx)
                }
            };
            match wait {
                Ok(freed) => {
                    let _ = freed.await;
                }
                Err(number) => {
                    // The room is this task's until the child runs; an abort meanwhile gives
                    // it back (and the child, started late, is ended).
                    let room = Room { pool: self.clone(), taken: true };
                    let pool = self.clone();
                    let (tx, rx) = oneshot::channel();
                    let start = std::thread::Builder::new().name("canter-child-start".into()).spawn(move || {
                        if let Err(Ok(late)) = tx.send(pool.spawn_child(number)) {
                            end_child(late);
                        }
                    });
                    start?;
                    let started = rx.await.unwrap_or_else(|_| Err(std::io::Error::other("the start thread vanished")));
                    let child = started?;
                    room.keep();
                    return Ok(Lease { pool: self.clone(), child: Some(child) });
                }
            }
        }
    }

    /// Starts child `number` and waits for it to connect (blocking: on a thread of its own).
    fn spawn_child(&self, number: u64) -> std::io::Result<ChildProcess> {
        let path = self.socket_dir.join(format!("child-{number}.sock"));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let program = match &self.options.program {
            Some(program) => program.clone(),
            None => std::env::current_exe()?,
        };
        let args = self.options.args.clone().unwrap_or_else(|| std::env::args_os().skip(1).collect());
        let mut command = Command::new(program);
        command.args(args).env(CHILD_ENV, &path).stdin(Stdio::null());
        // A group of its own: a Ctrl-C at the terminal (or a signal to the worker's group) is
        // the worker's to handle; its children end when it closes their sockets.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        match self.options.memory_limit_bytes {
            Some(limit) => command.env(CHILD_MEMORY_ENV, limit.to_string()),
            None => command.env_remove(CHILD_MEMORY_ENV),
        };
        let mut process = Starting { process: Some(command.spawn()?), path: path.clone() };
        self.started.fetch_add(1, Ordering::Relaxed);
        // Tries, CHILD_START_POLL apart, within CHILD_START_TIMEOUT.
        let mut tries_left = CHILD_START_TIMEOUT.as_millis() / CHILD_START_POLL.as_millis();
        let socket = loop {
            match listener.accept() {
                Ok((socket, _)) => break socket,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    let gone = process.get().try_wait()?.map(|status| format!("it exited at start ({status})"));
                    tries_left = tries_left.saturating_sub(1);
                    let late = (tries_left == 0).then(|| "it did not connect within 10 s".to_owned());
                    if let Some(why) = gone.or(late) {
                        return Err(std::io::Error::other(format!(
                            "child {number} failed to start: {why} (does main call the child entry first?)"
                        )));
                    }
                    std::thread::sleep(CHILD_START_POLL);
                }
                Err(error) => return Err(error),
            }
        };
        let _ = std::fs::remove_file(&path);
        socket.set_nonblocking(false)?;
        let (heard_tx, heard) = mpsc::unbounded();
        let reading = socket.try_clone()?;
        std::thread::Builder::new()
            .name(format!("canter-child-{number}"))
            .spawn(move || read_child(reading, heard_tx))?;
        Ok(ChildProcess { process: process.started(), socket, heard, tasks_run: 0 })
    }

    /// A child's room is free: wake the first waiter.
    fn free_room(&self, child: Option<ChildProcess>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.busy = state.busy.saturating_sub(1);
        if let Some(child) = child {
            state.idle.push(child);
        }
        // Every waiter looks again (a woken one whose task was aborted meanwhile would
        // otherwise swallow the wake-up); those that find no room wait again.
        for waiter in state.waiting.drain(..) {
            let _ = waiter.send(());
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut self.state.get_mut().unwrap_or_else(PoisonError::into_inner).idle);
        for child in idle {
            // Closing its socket ends its loop; kill in case it does not listen.
            end_child(child);
        }
        let _ = std::fs::remove_dir(&self.socket_dir);
    }
}

/// A pool's room taken for a child that is starting: given back if dropped before
/// [`keep`](Room::keep).
struct Room {
    pool: Arc<Pool>,
    taken: bool,
}

impl Room {
    fn keep(mut self) {
        self.taken = false;
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if self.taken {
            self.pool.free_room(None);
        }
    }
}

/// A directory of this pool's own for its children's sockets, readable by this user only.
fn private_dir() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    static POOLS: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = POOLS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("canter-isolation-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            // Left by an earlier process of the same id: the next name.
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(error),
        }
    }
}

/// A child process until it connected: killed, reaped and its socket file removed if its start
/// fails on any path.
struct Starting {
    process: Option<Child>,
    path: PathBuf,
}

impl Starting {
    fn get(&mut self) -> &mut Child {
        self.process.as_mut().expect("a starting child")
    }

    /// It connected: the caller keeps it.
    fn started(mut self) -> Child {
        self.process.take().expect("a starting child")
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }
}

/// A child held by one task. Dropped unfinished (the task aborted), it kills the child.
struct Lease {
    pool: Arc<Pool>,
    child: Option<ChildProcess>,
}

impl Lease {
    /// The task is answered: the child goes back to the pool, or is replaced when it has run
    /// its share.
    fn release(mut self) {
        let mut child = self.child.take();
        if let Some(running) = child.as_mut() {
            running.tasks_run += 1;
            if self.pool.options.recycle_after.is_some_and(|n| running.tasks_run >= n) {
                self.pool.recycled.fetch_add(1, Ordering::Relaxed);
                if let Some(done) = child.take() {
                    end_child(done);
                }
            }
        }
        self.pool.free_room(child);
    }

    /// The child failed its task: kill it (it may still live, if it only broke the protocol),
    /// reap it on a thread, and say how it ended.
    async fn end(mut self, failure: ChildFailure) -> ChildFailure {
        let Some(child) = self.child.take() else { return failure };
        // The room is free before the wait: an abort during it must not keep it.
        self.pool.free_room(None);
        let (tx, rx) = oneshot::channel();
        reap(child, Some(tx));
        let status = rx.await.ok().flatten();
        match (failure, status) {
            // A garbled child was killed for it: that is the story.
            (ChildFailure::Garbled(what), _) => ChildFailure::Garbled(what),
            (failure, Some(status)) => ended_by(status).unwrap_or(failure),
            (failure, None) => failure,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            // Dropped mid-task: the task was aborted, its child goes with it.
            self.pool.killed.fetch_add(1, Ordering::Relaxed);
            end_child(child);
            self.pool.free_room(None);
        }
    }
}

impl ChildProcess {
    /// Whether it still runs and its socket has not broken.
    fn is_alive(&mut self) -> bool {
        let broken = matches!(self.heard.try_recv(), Ok(Err(_)) | Err(mpsc::TryRecvError::Closed));
        !broken && matches!(self.process.try_wait(), Ok(None))
    }
}

/// Kills `child` and reaps it on a thread (never blocking the caller).
fn end_child(child: ChildProcess) {
    reap(child, None);
}

/// Kills `child` and reaps it on a thread, sending how it ended to `status` if given. (Without
/// a thread to spare, the process stays a zombie until the worker exits; never a panic.)
fn reap(mut child: ChildProcess, status: Option<oneshot::Sender<Option<ExitStatus>>>) {
    let _ = child.socket.shutdown(std::net::Shutdown::Both);
    let _ = child.process.kill();
    let _ = std::thread::Builder::new().name("canter-reap".into()).spawn(move || {
        let ended = child.process.wait().ok();
        if let Some(status) = status {
            let _ = status.send(ended);
        }
    });
}

/// How a child that ended did, if a signal or its status says more than the pipe.
#[cfg(unix)]
fn ended_by(status: ExitStatus) -> Option<ChildFailure> {
    use std::os::unix::process::ExitStatusExt;
    match (status.signal(), status.code()) {
        (Some(signal), _) => Some(ChildFailure::Signalled(signal)),
        (None, Some(code)) => Some(ChildFailure::Exited(code)),
        (None, None) => None,
    }
}

/// Reads frames from a child until its socket closes or breaks; each message or the failure
/// goes to `heard`.
fn read_child(socket: UnixStream, heard: mpsc::UnboundedSender<Result<FromChild, ChildFailure>>) {
    let heard_all = read_frames::<FromChild>(socket, |message| {
        heard.unbounded_send(message.map_err(|e| ChildFailure::Garbled(e.to_string()))).is_ok()
    });
    if heard_all {
        let _ = heard.unbounded_send(Err(ChildFailure::Closed));
    }
}

/// Reads frames from `socket` and hands each message (or the error of a broken frame, the
/// last) to `take`, until the socket closes or breaks (then `true`), a frame breaks, or `take`
/// says to stop (then `false`).
fn read_frames<M: for<'de> serde::Deserialize<'de>>(
    mut socket: UnixStream,
    mut take: impl FnMut(Result<M, crate::isolation::FrameError>) -> bool,
) -> bool {
    let mut reader = FrameReader::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match socket.read(&mut buffer) {
            Ok(0) | Err(_) => return true,
            Ok(n) => {
                reader.push(&buffer[..n]);
                while let Some(message) = reader.next_message::<M>() {
                    let broken = message.is_err();
                    if !take(message) || broken {
                        return false;
                    }
                }
            }
        }
    }
}

fn write_frame(mut socket: &UnixStream, frame: &[u8]) -> std::io::Result<()> {
    socket.write_all(frame)?;
    socket.flush()
}

/// Which of a worker's tasks run in its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IsolatedTasks {
    /// Every task registered with `register_blocking`.
    Blocking,
    /// Every task.
    All,
    /// These tasks.
    Named(std::collections::BTreeSet<String>),
}

/// A worker's process pool and the tasks it runs.
#[derive(Clone)]
pub struct Isolation {
    /// The pool.
    pub pool: ProcessPool,
    /// The tasks it runs.
    pub tasks: IsolatedTasks,
}

impl Isolation {
    /// The names `registry` runs in the pool (`None`: all).
    pub fn names(&self, registry: &super::Registry) -> Option<std::collections::BTreeSet<String>> {
        match &self.tasks {
            IsolatedTasks::Blocking => Some(registry.blocking_names().map(str::to_owned).collect()),
            IsolatedTasks::All => None,
            IsolatedTasks::Named(names) => Some(names.clone()),
        }
    }
}

/// The handlers of a worker whose isolated tasks run in a [`ProcessPool`]: those named in
/// `isolated` (or every one, for `None`) go to the pool, the others to `inner`.
pub struct IsolatedHandlers<H> {
    inner: H,
    pool: ProcessPool,
    isolated: Option<std::collections::BTreeSet<String>>,
}

impl<H: Handlers> IsolatedHandlers<H> {
    /// `inner`'s handlers, the tasks named in `isolated` (all, for `None`) run by `pool`.
    pub fn new(inner: H, pool: ProcessPool, isolated: Option<std::collections::BTreeSet<String>>) -> Self {
        IsolatedHandlers { inner, pool, isolated }
    }
}

impl<H: Handlers> Handlers for IsolatedHandlers<H> {
    fn run(&self, run: TaskRun) -> BoxFuture<'static, TaskOutcome> {
        if self.isolated.as_ref().is_none_or(|names| names.contains(&run.name)) {
            self.pool.run(run)
        } else {
            self.inner.run(run)
        }
    }
}

/// Whether this process was started as a child of a pool: the socket it must serve on.
pub fn child_socket() -> Option<PathBuf> {
    std::env::var_os(CHILD_ENV).map(PathBuf::from)
}

/// Why a child could not serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChildServeError {
    /// Its socket could not be reached or broke.
    #[error("the child's socket failed: {0}")]
    Socket(#[from] std::io::Error),
    /// Its memory limit is not a number of bytes.
    #[error("{CHILD_MEMORY_ENV}={0:?} is not a number of bytes")]
    MemoryLimit(String),
    /// The system refused its memory limit.
    #[error("the memory limit of {bytes} bytes could not be set: {error}")]
    MemoryLimitRefused {
        /// The limit.
        bytes: u64,
        /// Why.
        error: std::io::Error,
    },
    /// Its worker sent something that is not a message.
    #[error("the worker sent {0}")]
    Garbled(String),
}

/// Serves tasks as a child of a pool: connects to `socket`, applies its memory limit, then
/// runs each task it is sent with `handlers`, one at a time, until the worker closes the
/// socket. Call it first thing in `main` when [`child_socket`] is set.
pub async fn serve_child<H: Handlers>(socket: PathBuf, handlers: H) -> Result<(), ChildServeError> {
    if let Some(limit) = std::env::var_os(CHILD_MEMORY_ENV) {
        let limit = limit.to_string_lossy().into_owned();
        let bytes: u64 = limit.parse().map_err(|_| ChildServeError::MemoryLimit(limit.clone()))?;
        rlimit::Resource::AS.set(bytes, bytes).map_err(|error| ChildServeError::MemoryLimitRefused { bytes, error })?;
    }
    let stream = UnixStream::connect(&socket)?;
    write_frame(&stream, &encode_frame(&FromChild::Ready { pid: std::process::id() }))?;
    let (runs_tx, mut runs) = mpsc::unbounded::<Result<ToChild, String>>();
    let reading = stream.try_clone()?;
    std::thread::Builder::new().name("canter-child-read".into()).spawn(move || {
        read_frames::<ToChild>(reading, |message| runs_tx.unbounded_send(message.map_err(|e| e.to_string())).is_ok());
    })?;
    while let Some(message) = runs.next().await {
        let ToChild::Run { task, attempt, name, queue, priority, enqueued_at, run_at, args } =
            message.map_err(ChildServeError::Garbled)?;
        let run = TaskRun {
            id: task,
            lease: crate::task::Lease(0),
            attempt,
            name,
            queue,
            priority,
            enqueued_at,
            run_at,
            args,
            deadline: None,
        };
        let outcome = std::panic::AssertUnwindSafe(handlers.run(run))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| TaskOutcome::Failure(super::panic_error(panic.as_ref())));
        write_frame(&stream, &encode_frame(&FromChild::Done { task, outcome: outcome.into() }))?;
    }
    Ok(())
}

/// Ends a child process once [`serve_child`] returned: status 0 when its worker closed it, 1
/// on a failure (said on stderr). The adapters' child entries end with it.
pub fn exit_child(served: Result<(), ChildServeError>) -> ! {
    match served {
        Ok(()) => std::process::exit(0),
        Err(error) => {
            eprintln!("canter child: {error}");
            std::process::exit(1);
        }
    }
}
