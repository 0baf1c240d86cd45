//! The `canter` program: exit codes, messages, and a whole flow against PostgreSQL.

#[path = "../../tests/common/pg.rs"]
mod pg;
#[path = "common/program.rs"]
mod program;

use program::canter;

use std::process::{Command, Output, Stdio};

/// Runs `canter` with `args` against the test database's schema.
fn against(db: &pg::TestDb) -> impl Fn(&[&str]) -> Output + use<> {
    let (url, schema) = (db.url.clone(), db.schema.name().to_owned());
    move |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--database-url", &url, "--schema", &schema]);
        canter(&all)
    }
}

/// `canter worker` against the test database's schema, to be given more flags and spawned.
fn worker_command(db: &pg::TestDb) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_canter"));
    command.args(["worker", "--database-url", &db.url, "--schema", db.schema.name()]);
    command
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A dead port: nothing listens on port 1.
const DEAD: &str = "postgres://postgres@127.0.0.1:1/x";

/// Asserts `output` is a usage error (status 2) whose text contains each of `expected`.
#[track_caller]
fn usage_error(output: &Output, expected: &[&str]) {
    assert_eq!(output.status.code(), Some(2), "{}", text(output));
    for part in expected {
        assert!(text(output).contains(part), "{part:?} not in {}", text(output));
    }
}

#[test]
fn help_and_usage_errors_exit_with_their_codes() {
    assert_eq!(canter(&["--help"]).status.code(), Some(0));
    let version = canter(&["--version"]);
    assert_eq!(
        (version.status.code(), first_line(&version)),
        (Some(0), format!("canter {}", env!("CARGO_PKG_VERSION")))
    );
    usage_error(&canter::<&str>(&[]), &["Usage: canter"]);
    usage_error(&canter(&["frobnicate"]), &["unrecognized subcommand 'frobnicate'"]);
    // A typo gets a suggestion.
    usage_error(&canter(&["statsu"]), &["tip: a similar subcommand exists: 'status'"]);
    let commands = [
        "migrate",
        "worker",
        "enqueue",
        "status",
        "list",
        "show",
        "result",
        "cancel",
        "retry",
        "reschedule",
        "complete",
        "fail",
        "force-unlock",
        "remove-key",
        "purge",
        "pause",
        "resume",
        "scheduler",
        "schedules",
        "workflow",
        "demo",
        "bench",
        "completions",
    ];
    for command in commands {
        let help = canter(&[command, "--help"]);
        assert_eq!(help.status.code(), Some(0), "{command} --help");
        assert!(text(&help).contains(&format!("Usage: canter {command}")), "{command}: {}", text(&help));
        let help = canter(&["help", command]);
        assert_eq!(help.status.code(), Some(0), "help {command}");
        assert!(text(&help).contains(&format!("Usage: canter {command}")), "help {command}: {}", text(&help));
    }
    usage_error(&canter(&["status"]), &["pass --database-url URL or set DATABASE_URL"]);
    usage_error(&canter(&["status", "--database-url", "not a url"]), &["invalid database url"]);
    usage_error(&canter(&["list", "--colour", "red"]), &["unexpected argument '--colour'"]);
    // Nothing is silently ignored: a flag or an argument a command does not take is refused.
    usage_error(&canter(&["status", "-j"]), &["unexpected argument '-j'"]);
    usage_error(&canter(&["status", "extra"]), &["unexpected argument 'extra'"]);
    usage_error(&canter(&["list", "-n", "x"]), &["invalid value 'x' for '--limit <N>'"]);
    usage_error(&canter(&["list", "--status", "sleeping"]), &["possible values: waiting, pending, claimed"]);
    usage_error(&canter(&["show", "-3"]), &["unexpected argument '-3'"]);
    usage_error(&canter(&["show", "abc"]), &["expected a task id"]);
    usage_error(&canter(&["demo", "--database-url", DEAD, "--tasks", "0"]), &["--tasks <N>"]);
}

#[test]
fn worker_flags_are_typed_and_name_the_flag() {
    let worker = |flags: &[&str]| canter(&[&["worker", "--database-url", DEAD][..], flags].concat());
    usage_error(&worker(&["--concurrency", "0"]), &["--concurrency is 0, expected 1 to 10000"]);
    usage_error(&worker(&["--concurrency", "many"]), &["invalid value 'many' for '--concurrency <N>'"]);
    usage_error(&worker(&["--deployment-mode", "sometimes"]), &["possible values: hybrid, polling_only"]);
    usage_error(&worker(&["--check-interval-ms", "5"]), &["--check-interval-ms is 5, expected"]);
    usage_error(&worker(&["--custom-queues", "[{\"name\": 3}]"]), &["--custom-queues"]);
    let internal = text(&worker(&["--queue-mode", "custom", "--custom-queues", "[{\"name\":\"Bad\"}]"]));
    assert!(internal.contains("--custom-queues[0].name is \"Bad\""), "{internal}");
    assert!(!internal.contains("line 1 column"), "no position in an internal document: {internal}");
    // The README's and `worker --help`'s own example is taken: the run fails on the dead port
    // only (status 1), not on its arguments (2).
    let example = worker(&["--concurrency", "16", "--queues", "default,emails", "--claim-lease-ms", "90s"]);
    assert_eq!(example.status.code(), Some(1), "{}", text(&example));
    assert!(text(&example).contains("cannot connect to 127.0.0.1:1"), "{}", text(&example));
}

#[test]
fn values_are_checked_before_connecting() {
    // Each is a usage error on the dead port: refused by its type, not after a connection.
    let url = ["--database-url", DEAD];
    let cases: [(&[&str], &str); 7] = [
        (&["enqueue", "echo", "--queue", "Bad Name"], "invalid queue name \"Bad Name\""),
        (&["enqueue", "echo", "--key", ""], "invalid key \"\": expected 1 to 256 bytes"),
        (&["enqueue", "echo", "--flags", "ok,Bad Flag"], "invalid flag \"Bad Flag\""),
        (&["list", "--queue", "Bad Name"], "invalid queue name"),
        (&["pause", "Bad Name"], "invalid queue name"),
        (&["remove-key", ""], "invalid key"),
        // Regression: the store clamped it to 2147483647 without a word.
        (&["reschedule", "1", "--retries", "4000000000"], "4000000000 is not in 0..=2147483647"),
    ];
    for (command, expected) in cases {
        usage_error(&canter(&[command, &url].concat()), &[expected]);
    }
}

#[test]
fn worker_configuration_is_checked_as_a_whole_before_connecting() {
    let dir = std::env::temp_dir().join(format!("canter-worker-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let worker = |flags: &[&str]| canter(&[&["worker", "--database-url", DEAD][..], flags].concat());

    // A flag corrects a value of the file: the run gets as far as the dead port (status 1).
    let zero = file("zero.toml", "[worker]\nconcurrency = 0\n");
    usage_error(&worker(&["--config", &zero]), &["`worker.concurrency` (in the configuration file) is 0"]);
    let corrected = worker(&["--config", &zero, "--concurrency", "2"]);
    assert_eq!(corrected.status.code(), Some(1), "{}", text(&corrected));
    assert!(text(&corrected).contains("connection refused"), "{}", text(&corrected));

    // Schedules run by the worker are checked as `canter scheduler` checks them.
    let schedule = |task: &str, args: &str, zone: &str| {
        format!(
            "[worker]\nrun_scheduler = true\n[[app.schedules]]\nname = \"s\"\ntask = \"{task}\"\nargs = {args}\n\
             daily = \"09:00\"\ntimezone = \"{zone}\"\n"
        )
    };
    let unknown = file("unknown.toml", &schedule("report", "{}", "UTC"));
    usage_error(&worker(&["--config", &unknown]), &["report", "--force"]);
    let forced = worker(&["--config", &unknown, "--force"]);
    assert_eq!(forced.status.code(), Some(1), "{}", text(&forced));
    let mistyped = file("mistyped.toml", &schedule("sleep", "{ ms = \"abc\" }", "UTC"));
    usage_error(&worker(&["--config", &mistyped]), &["schedule s: args", "expected u64"]);
    // Regression: a zone that does not load was reported after the worker started (status 1).
    let nowhere = file("nowhere.toml", &schedule("noop", "{}", "Mars/Olympus_Mons"));
    usage_error(&worker(&["--config", &nowhere]), &["Mars/Olympus_Mons"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_host_is_reported_at_once() {
    // Regression: a name that does not resolve was tried again, like a server not up yet.
    let output = canter(&["status", "--database-url", "postgres://x@no-such-host.invalid/x"]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(text(&output).contains("no-such-host.invalid:5432 database x: unknown host"), "{}", text(&output));
    assert!(!text(&output).contains("trying again"), "{}", text(&output));
}

#[test]
fn a_worker_waits_for_a_database_that_is_not_up_yet() {
    let mut worker = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["worker", "--database-url", DEAD])
        .env_remove("CANTER_CONNECT_ATTEMPTS")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run canter");
    std::thread::sleep(std::time::Duration::from_secs(2));
    let waiting = worker.try_wait().expect("wait for canter").is_none();
    worker.kill().unwrap();
    let output = worker.wait_with_output().unwrap();
    assert!(waiting, "the worker gave up: {}", text(&output));
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("cannot connect to 127.0.0.1:1 database x: connection refused")
            && said.contains("trying again in 1.0s (2)"),
        "{said}"
    );
}

#[test]
fn completions_for_each_shell() {
    for (shell, marker) in [("bash", "complete -F _canter"), ("zsh", "#compdef canter"), ("fish", "complete -c canter")]
    {
        let output = canter(&["completions", shell]);
        assert_eq!(output.status.code(), Some(0), "{shell}");
        assert!(text(&output).contains(marker) && text(&output).contains("force-unlock"), "{shell}: {}", text(&output));
    }
    usage_error(&canter(&["completions", "cmd"]), &["possible values: bash"]);
}

#[test]
fn enqueue_refuses_unknown_tasks_and_malformed_json() {
    let url = ["--database-url", DEAD];
    usage_error(&canter(&[&["enqueue", "nosuch"][..], &url].concat()), &["unknown task name \"nosuch\""]);
    usage_error(&canter(&[&["enqueue", "echo", "--args", "{not json"][..], &url].concat()), &["not valid JSON"]);
    // The built-in tasks' arguments are checked by type before anything is sent.
    usage_error(
        &canter(&[&["enqueue", "sleep", "--args", r#"{"ms":"abc"}"#][..], &url].concat()),
        &["--args do not suit the built-in task sleep", "expected u64"],
    );
    usage_error(&canter(&[&["enqueue", "cpu"][..], &url].concat()), &["missing field `iterations`"]);
    usage_error(&canter(&[&["enqueue", "fail", "--args", r#"{"code":"lower"}"#][..], &url].concat()), &["fail"]);
    usage_error(
        &canter(&[&["enqueue", "echo", "--args", "@/no/such/file"][..], &url].concat()),
        &["cannot read /no/such/file"],
    );
    usage_error(&canter(&[&["enqueue", "echo", "--key", "k", "--count", "2"][..], &url].concat()), &["--count"]);
    usage_error(&canter(&[&["enqueue", "echo", "--key-mode", "idempotent"][..], &url].concat()), &["--key <KEY>"]);
}

#[test]
fn postgres_s_own_schemas_are_refused() {
    // Regression: `canter migrate --schema information_schema` put eight tables into it.
    for schema in ["information_schema", "pg_catalog"] {
        let output = canter(&["migrate", "--schema", schema, "--database-url", DEAD]);
        usage_error(&output, &[&format!("invalid schema name \"{schema}\"")]);
    }
}

#[test]
fn huge_durations_are_refused_not_panicked_on() {
    // Regression: `Duration::from_secs_f64` panicked on them (exit status 101).
    let url = ["--database-url", DEAD];
    let huge = "999999999999999999999d";
    let commands: [&[&str]; 5] = [
        &["enqueue", "echo", "--delay", huge],
        &["enqueue", "echo", "--run-at", huge],
        &["purge", "--older-than", huge],
        &["result", "1", "--wait", huge],
        &["reschedule", "1", "--run-at", huge],
    ];
    for command in commands {
        let output = canter(&[command, &url].concat());
        usage_error(&output, &[&format!("invalid value '{huge}'"), "invalid duration"]);
    }
    usage_error(&canter(&[&["enqueue", "echo", "--delay", "3 weeks"][..], &url].concat()), &["invalid duration"]);
}

#[test]
#[allow(clippy::disallowed_methods)] // The test times the program, as a user would.
fn an_unreachable_server_is_named_with_its_cause_at_once() {
    let started = std::time::Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["status", "--database-url", DEAD])
        .env("CANTER_CONNECT_ATTEMPTS", "1")
        .output()
        .expect("run canter");
    assert!(started.elapsed() < std::time::Duration::from_secs(1), "{:?}", started.elapsed());
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output).contains("cannot connect to 127.0.0.1:1 database x: connection refused"),
        "{}",
        text(&output)
    );
    // Tried again with backoff, and said so.
    let output = canter(&["status", "--database-url", DEAD]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        text(&output).contains("trying again in 0.5s (1/1)") && text(&output).contains("(2 tries)"),
        "{}",
        text(&output)
    );
}

#[test]
fn the_demo_runs_on_the_embedded_store() {
    let output = canter(&["demo", "--tasks", "200", "--workers", "2"]);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output));
    let text = text(&output);
    assert!(text.contains("in-memory store") && text.contains("summary") && text.contains("tasks/s"), "{text}");
    // Its deliberate panics are counted, not printed; it says which failures are on purpose.
    assert!(!text.contains("panicked") && !text.contains("RUST_BACKTRACE"), "{text}");
    assert!(text.contains("on purpose") && text.contains("outcomes by kind"), "{text}");
    let panics = text.lines().find(|l| l.starts_with("panic ")).unwrap_or_default();
    assert!(panics.contains("panics on purpose"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_postgres_demo_drops_its_schema() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(1).await;
    // Ctrl-C and SIGTERM alike.
    for signal in ["-INT", "-TERM"] {
        let demo = Command::new(env!("CARGO_BIN_EXE_canter"))
            .args(["demo", "--tasks", "50000", "--database-url", &db.url])
            .env("CANTER_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let schema = format!("canter_demo_{}", demo.id());
        let exists = || async {
            sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
                .bind(&schema)
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        let mut made = false;
        for _ in 0..300 {
            if exists().await {
                made = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(made, "the demo made its schema");
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        assert!(Command::new("kill").args([signal, &demo.id().to_string()]).status().unwrap().success());
        let output = demo.wait_with_output().unwrap();
        assert_eq!(output.status.code(), Some(130), "{signal}: {}", text(&output));
        assert!(text(&output).contains("interrupted; stopped and cleaned up"), "{signal}: {}", text(&output));
        assert!(!text(&output).contains("NOTICE"), "{}", text(&output));
        assert!(!exists().await, "{signal}: the demo's schema is dropped");
    }
}

/// `canter demo` of `tasks` tasks and one worker on the embedded store, logging as `log` says.
fn embedded_demo(tasks: &str, log: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_canter"));
    command
        .args(["demo", "--tasks", tasks, "--workers", "1"])
        .env_remove("DATABASE_URL")
        .env("CANTER_LOG", log)
        .stdin(Stdio::null());
    command
}

#[test]
fn canter_log_takes_a_level_or_per_target_directives() {
    let demo = |log: &str| {
        let output = embedded_demo("50", log).output().expect("run canter");
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    // Every database request of the workers is traced under the target `canter::db`.
    let request = "kind=";
    assert!(demo("trace").contains(request));
    assert!(demo("sqlx=trace, canter::db=trace,warn").contains(request));
    assert!(!demo("canter::db=warn,trace").contains(request));
    assert!(!demo("warn").contains(request));
    let misspelt = demo("wran");
    assert!(misspelt.contains("CANTER_LOG=\"wran\" is neither") && !misspelt.contains(request), "{misspelt}");
}

#[test]
fn a_reader_that_goes_away_ends_the_program_quietly() {
    // `canter demo | head -1`: the output's reader leaves; the program ends with 128 + SIGPIPE
    // as Unix tools do, not with a panic.
    let mut child =
        embedded_demo("200", "warn").stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run canter");
    drop(child.stdout.take());
    let output = child.wait_with_output().expect("wait for canter");
    assert_eq!(output.status.code(), Some(141), "{}", text(&output));
    // `println!`'s panic says this (a handler of the demo's `panic` tasks may panic on purpose).
    assert!(!text(&output).contains("failed printing"), "{}", text(&output));
}

#[test]
fn a_closed_stderr_keeps_the_exit_status() {
    // Regression: `eprintln!` panicked when nobody read stderr, and the usage error's status 2
    // became a panic's 101.
    let mut child = Command::new(env!("CARGO_BIN_EXE_canter"))
        .arg("no-such-command")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run canter");
    drop(child.stderr.take());
    assert_eq!(child.wait().expect("wait for canter").code(), Some(2));
}

#[test]
fn a_closed_stderr_does_not_stop_the_workers() {
    // Regression: the log subscriber reported a failed write with `eprintln!`, which panicked
    // inside the worker's loop at its first traced request, and the demo waited forever.
    let mut child =
        embedded_demo("50", "trace").stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("run canter");
    drop(child.stderr.take());
    // About 60 s in steps of 50 ms.
    let mut steps = 1_200;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for canter") {
            break status;
        }
        steps -= 1;
        if steps == 0 {
            let _ = child.kill();
            panic!("the demo did not finish within 60 s with its stderr closed");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_flow_against_postgres() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let enqueued = run(&["enqueue", "echo", "--args", r#"{"a":1}"#, "--count", "3"]);
    assert_eq!(enqueued.status.code(), Some(0), "{}", text(&enqueued));
    let ids: Vec<String> = String::from_utf8_lossy(&enqueued.stdout).lines().map(str::to_owned).collect();
    assert_eq!(ids.len(), 3);
    let failing = run(&["enqueue", "fail", "--args", r#"{"code":"NOPE"}"#]);
    let failing = String::from_utf8_lossy(&failing.stdout).trim().to_owned();
    let panicking = run(&["enqueue", "panic"]);
    let panicking = String::from_utf8_lossy(&panicking.stdout).trim().to_owned();
    let pending = run(&["result", &ids[0]]);
    assert_eq!(pending.status.code(), Some(1));
    assert!(text(&pending).contains("no result yet"));
    // A wait that times out says so, in JSON too.
    let timed_out = run(&["result", &ids[0], "--wait", "100ms", "--json"]);
    assert_eq!(timed_out.status.code(), Some(1));
    let timed_out: serde_json::Value = serde_json::from_slice(&timed_out.stdout).expect("JSON on a timeout");
    assert_eq!((&timed_out["state"], &timed_out["timed_out"]), (&"PENDING".into(), &true.into()));

    let worker = worker_command(&db)
        .args(["--poll-interval-ms", "1000"])
        .env("CANTER_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let result = run(&["result", &ids[0], "--wait", "20s"]);
    assert_eq!(result.status.code(), Some(0), "{}", text(&result));
    assert_eq!(String::from_utf8_lossy(&result.stdout).trim(), r#"{"a":1}"#);
    let failed = run(&["result", &failing, "--wait", "20s"]);
    assert_eq!(failed.status.code(), Some(1));
    assert!(text(&failed).contains("FAILED") && text(&failed).contains("NOPE"), "{}", text(&failed));
    let panicked = run(&["result", &panicking, "--wait", "20s"]);
    assert!(text(&panicked).contains("handler panicked"), "{}", text(&panicked));
    // Each attempt's real outcome, in words.
    let shown = run(&["show", &failing]);
    assert!(text(&shown).contains("failed with NOPE"), "{}", text(&shown));
    // `-n` limits the listing.
    let two = run(&["list", "-n", "2", "--json"]);
    let two: Vec<serde_json::Value> = serde_json::from_slice(&two.stdout).expect("list --json is JSON");
    assert_eq!(two.len(), 2);

    let status = run(&["status", "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json is JSON");
    assert!(status["workers"].as_array().is_some_and(|w| !w.is_empty()));
    let table = run(&["status"]);
    assert!(text(&table).contains("QUEUE") && text(&table).contains("live workers"));
    let listed = run(&["list", "--status", "COMPLETED", "--json"]);
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout).expect("list --json is JSON");
    assert!(!listed.is_empty());
    // Times as people read them, and as numbers for programs.
    assert!(listed[0]["enqueued_at"].as_str().is_some_and(|t| t.ends_with('Z')), "{}", listed[0]);
    assert!(listed[0]["enqueued_at_ms"].is_i64(), "{}", listed[0]);
    let shown = run(&["show", &ids[0], "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["task"]["state"], "COMPLETED");
    assert_eq!(shown["attempts"].as_array().map(Vec::len), Some(1));

    let cancel_done = run(&["cancel", &ids[0]]);
    assert_eq!(cancel_done.status.code(), Some(1));
    assert!(text(&cancel_done).contains("COMPLETED"), "{}", text(&cancel_done));
    let retried = run(&["retry", &failing]);
    assert_eq!(retried.status.code(), Some(0), "{}", text(&retried));
    let later = run(&["enqueue", "sleep", "--args", r#"{"ms":1}"#, "--delay", "1h"]);
    let later = String::from_utf8_lossy(&later.stdout).trim().to_owned();
    assert_eq!(run(&["cancel", &later]).status.code(), Some(0));
    let cancelled = run(&["result", &later]);
    assert!(text(&cancelled).contains("CANCELLED"));

    let status = Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap();
    assert!(status.success());
    let worker = worker.wait_with_output().unwrap();
    assert!(worker.status.success(), "the worker exits 0 on SIGTERM");
    // The deliberate panic is one log line, not the default panic message.
    let log = String::from_utf8_lossy(&worker.stderr);
    assert!(!log.contains("panicked at"), "{log}");
    assert!(log.lines().any(|line| line.contains(&format!("task {panicking} failed: handler panicked"))), "{log}");
}

/// Polls `canter show ID --json` until the task is in `state`.
fn wait_for_state(run: &dyn Fn(&[&str]) -> Output, id: &str, state: &str) -> serde_json::Value {
    for _ in 0..200 {
        let shown = run(&["show", id, "--json"]);
        let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap_or_default();
        if shown["task"]["state"] == state {
            return shown;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("task {id} never reached {state}");
}

fn first_line(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_against_postgres() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    let worker = || {
        worker_command(&db)
            .args(["--poll-interval-ms", "1000"])
            .env("CANTER_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };

    // A paused queue is not served, and status says so; resumed, it is.
    let paused = run(&["pause", "default"]);
    assert_eq!((paused.status.code(), first_line(&paused)), (Some(0), "queue default paused".to_owned()));
    assert_eq!(first_line(&run(&["pause", "default"])), "queue default was already paused");
    let held_back = first_line(&run(&["enqueue", "echo", "--args", "1"]));
    let mut first = worker();
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    assert!(text(&run(&["result", &held_back])).contains("no result yet"));
    let status: serde_json::Value = serde_json::from_slice(&run(&["status", "--json"]).stdout).unwrap();
    assert_eq!(status["paused"][0]["queue"], "default");
    assert!(text(&run(&["status"])).contains("paused queues: default"));
    let resumed = run(&["resume", "default", "--json"]);
    let resumed: serde_json::Value = serde_json::from_slice(&resumed.stdout).unwrap();
    assert_eq!((resumed["paused"].clone(), resumed["changed"].clone()), (false.into(), true.into()));
    let result = run(&["result", &held_back, "--wait", "20s"]);
    assert_eq!((result.status.code(), first_line(&result)), (Some(0), "1".to_owned()), "{}", text(&result));

    // Completed by hand while it runs: the hand's result stands.
    let long = first_line(&run(&["enqueue", "sleep", "--args", r#"{"ms":60000}"#]));
    wait_for_state(&run, &long, "RUNNING");
    assert_eq!(run(&["complete", &long, "--result", r#"{"x":1}"#]).status.code(), Some(0));
    assert_eq!(first_line(&run(&["result", &long])), r#"{"x":1}"#);
    let bad = run(&["complete", &long, "--result", "{nope"]);
    assert_eq!(bad.status.code(), Some(2));

    // A worker killed while running a task: force-unlock hands the task back.
    let stranded = first_line(&run(&["enqueue", "sleep", "--args", r#"{"ms":60000}"#]));
    let shown = wait_for_state(&run, &stranded, "RUNNING");
    let dead = shown["task"]["worker"].as_str().expect("the worker running it").to_owned();
    first.kill().unwrap();
    first.wait().unwrap();
    // `--force`: the killed worker's session may not have ended yet.
    let unlocked = run(&["force-unlock", &dead, "--json", "--force"]);
    let unlocked: serde_json::Value = serde_json::from_slice(&unlocked.stdout).expect("force-unlock --json is JSON");
    assert_eq!(unlocked["tasks"], 1);
    let back = wait_for_state(&run, &stranded, "PENDING");
    assert_eq!((back["task"]["attempts"].clone(), back["task"]["retries"].clone()), (1.into(), 0.into()));
    assert_eq!(first_line(&run(&["force-unlock", &dead])), "0 tasks back to pending");

    // Reschedule, then fail by hand.
    let later = first_line(&run(&["enqueue", "echo", "--args", "2", "--delay", "1h"]));
    assert_eq!(run(&["reschedule", &later]).status.code(), Some(2), "nothing to change");
    let moved = run(&["reschedule", &later, "--run-at", "2h", "--priority", "3", "--retries", "0"]);
    assert_eq!(moved.status.code(), Some(0), "{}", text(&moved));
    let shown = wait_for_state(&run, &later, "PENDING");
    assert_eq!(shown["task"]["priority"], 3);
    assert_eq!(run(&["fail", &later, "--message", "not today"]).status.code(), Some(0));
    let failed = text(&run(&["result", &later]));
    assert!(failed.contains("FAILED_BY_OPERATOR") && failed.contains("not today"), "{failed}");
    let refused = run(&["reschedule", &later, "--now"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused).contains("is FAILED: expected PENDING"), "{}", text(&refused));

    // Remove a key: its pending task is cancelled and the key is free.
    let keyed = first_line(&run(&["enqueue", "echo", "--args", "3", "--delay", "1h", "--key", "kk"]));
    let removed = run(&["remove-key", "kk", "--json"]);
    let removed: serde_json::Value = serde_json::from_slice(&removed.stdout).expect("remove-key --json is JSON");
    assert_eq!(removed["removal"]["action"], "cancelled");
    assert_eq!(removed["removal"]["task"].to_string(), keyed);
    let unknown = run(&["remove-key", "kk"]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(text(&unknown).contains("no task holds idempotency key \"kk\""), "{}", text(&unknown));

    // Purge: every finished task goes.
    let purged = run(&["purge", "--older-than", "0s", "--json"]);
    let purged: serde_json::Value = serde_json::from_slice(&purged.stdout).expect("purge --json is JSON");
    assert_eq!(purged["purged"], 4, "{purged}");
    assert_eq!(run(&["show", &held_back]).status.code(), Some(1));
    assert_eq!(run(&["purge"]).status.code(), Some(2), "--older-than is required");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_keys_and_flags_from_the_command_line() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let id = |output: Output| {
        assert_eq!(output.status.code(), Some(0), "{}", text(&output));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    };
    let first = id(run(&["enqueue", "echo", "--args", "[1]", "--key", "k", "--delay", "1h", "--flags", "gpu,slow"]));
    // Replace (the default) appends array items to the waiting task.
    let again = id(run(&["enqueue", "echo", "--args", "[2]", "--key", "k", "--delay", "1h"]));
    assert_eq!(first, again);
    let shown = run(&["show", &first, "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["task"]["args"], serde_json::json!([1, 2]));
    assert_eq!(shown["task"]["key"], "k");
    let deduped = id(run(&["enqueue", "echo", "--args", "[3]", "--key", "k", "--key-mode", "unsafe_dedupe"]));
    assert_eq!(deduped, first);
    let bad = run(&["enqueue", "echo", "--key", "k", "--key-mode", "sometimes"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad).contains("--key-mode"), "{}", text(&bad));
    let flagged = id(run(&["enqueue", "echo", "--flags", "gpu"]));
    let shown = run(&["show", &flagged, "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(shown["task"]["flags"], serde_json::json!(["gpu"]));
    usage_error(&run(&["enqueue", "echo", "--flags", "GPU"]), &["invalid flag \"GPU\""]);

    // An idempotency key keeps its finished task from purge, unless told how long to.
    let paid = id(run(&["enqueue", "echo", "--args", "7", "--key", "pay-1", "--key-mode", "idempotent"]));
    assert_eq!(run(&["complete", &paid]).status.code(), Some(0));
    let purged = |extra: &[&str]| {
        let output = run(&[&["purge", "--older-than", "0s", "--json"][..], extra].concat());
        let purged: serde_json::Value = serde_json::from_slice(&output.stdout).expect("purge --json is JSON");
        purged["purged"].as_u64()
    };
    assert_eq!(purged(&[]), Some(0));
    assert_eq!(id(run(&["enqueue", "echo", "--args", "7", "--key", "pay-1", "--key-mode", "idempotent"])), paid);
    assert_eq!(purged(&["--idempotency-retention", "0s"]), Some(1));
    assert_ne!(id(run(&["enqueue", "echo", "--args", "7", "--key", "pay-1", "--key-mode", "idempotent"])), paid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_command_against_postgres() {
    let db = pg::TestDb::new().await;
    let config = std::env::temp_dir().join(format!("canter-schedules-{}.toml", db.schema.name()));
    std::fs::write(
        &config,
        r#"
[[app.schedules]]
name = "every_second"
task = "echo"
args = { hello = "schedule" }
every = "1s"
backfill = 2

[[app.schedules]]
name = "paris_morning"
task = "noop"
daily = "09:00"
timezone = "Europe/Paris"
"#,
    )
    .unwrap();
    let (url, schema, file) = (db.url.clone(), db.schema.name().to_owned(), config.display().to_string());
    let run = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", &file, "--database-url", &url, "--schema", &schema]);
        canter(&all)
    };
    let count = |name: &str| -> i64 {
        let listed = run(&["schedules", "--json"]);
        let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("schedules --json is JSON");
        let row = listed.as_array().unwrap().iter().find(|r| r["name"] == name).cloned().unwrap_or_default();
        row["run_count"].as_i64().unwrap_or(0)
    };

    let none = canter(&["scheduler", "--database-url", &db.url]);
    assert_eq!(none.status.code(), Some(2));
    assert!(text(&none).contains("no schedules"), "{}", text(&none));
    let both = run(&["scheduler", "--once", "--dry-run"]);
    assert_eq!(both.status.code(), Some(2));

    let dry = run(&["scheduler", "--dry-run"]);
    assert_eq!(dry.status.code(), Some(0), "{}", text(&dry));
    assert!(text(&dry).contains("would record new schedule every_second"), "{}", text(&dry));
    assert!(text(&dry).contains("would record new schedule paris_morning"), "{}", text(&dry));

    // Recorded ten seconds ago: the latest tick is on time and two missed ones are backfilled.
    let sql = format!(
        "INSERT INTO {s}.schedules (name, last_tick, updated_at) VALUES ('every_second', {s}.db_now() - interval '10 s', {s}.db_now())",
        s = db.schema.quoted()
    );
    let pool = db.pool(1).await;
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap();
    let dry = run(&["scheduler", "--dry-run"]);
    assert_eq!(text(&dry).matches("would enqueue echo for schedule every_second").count(), 3, "{}", text(&dry));
    assert_eq!(count("every_second"), 0, "a dry run writes nothing");

    let dry_json = run(&["scheduler", "--dry-run", "--json"]);
    let dry_json: serde_json::Value = serde_json::from_slice(&dry_json.stdout).expect("--dry-run --json is JSON");
    assert_eq!(dry_json["would_enqueue"].as_array().map(Vec::len), Some(3), "{dry_json}");
    usage_error(&run(&["scheduler", "--json"]), &["--json goes with --once, --dry-run or --list"]);
    let once = run(&["scheduler", "--once"]);
    assert_eq!(once.status.code(), Some(0), "{}", text(&once));
    let out = text(&once);
    assert_eq!(out.matches("schedule every_second: enqueued task").count(), 3, "{out}");
    assert_eq!(out.matches("(backfilled)").count(), 2, "{out}");
    assert!(out.contains("schedule paris_morning: recorded; first tick") && out.contains(":00:00+0"), "{out}");
    assert_eq!(count("every_second"), 3);

    let table = text(&run(&["schedules"]));
    assert!(table.contains("NEXT TICK") && table.contains("every 1s") && table.contains("Europe/Paris"), "{table}");
    assert!(table.contains("daily at 09:00"), "{table}");
    // UTC as everywhere else: with a Z.
    assert!(
        !table.contains("+00:00") && table.lines().any(|l| l.contains("every_second") && l.contains('Z')),
        "{table}"
    );

    // The long-running scheduler enqueues as ticks fall due and stops cleanly on SIGTERM.
    let mut scheduler = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["scheduler", "--config", &file, "--database-url", &db.url, "--schema", db.schema.name()])
        .env("CANTER_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut fired = false;
    for _ in 0..60 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        if count("every_second") > 3 {
            fired = true;
            break;
        }
    }
    let status = Command::new("kill").args(["-TERM", &scheduler.id().to_string()]).status().unwrap();
    assert!(status.success());
    assert!(scheduler.wait().unwrap().success(), "the scheduler exits 0 on SIGTERM");
    assert!(fired, "the scheduler enqueued the next ticks");
    let _ = std::fs::remove_file(&config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_count_commits_all_or_nothing() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    let pool = db.pool(1).await;
    let count = || async {
        let sql = format!("SELECT count(*) FROM {}.tasks", db.schema.quoted());
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql)).fetch_one(&pool).await.unwrap()
    };
    // The 1,500th row fails: the second statement of 1,000.
    let trigger = format!(
        "CREATE FUNCTION {s}.boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.id >= 1500 THEN RAISE EXCEPTION 'no room for task %', NEW.id; END IF; RETURN NEW; END $$; \
         CREATE TRIGGER boom BEFORE INSERT ON {s}.tasks FOR EACH ROW EXECUTE FUNCTION {s}.boom()",
        s = db.schema.quoted()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(trigger)).execute(&pool).await.unwrap();
    let failed = run(&["enqueue", "echo", "--count", "2500"]);
    assert_eq!(failed.status.code(), Some(1), "{}", text(&failed));
    assert_eq!(count().await, 0, "the first 1,000 were rolled back with the rest");
    assert!(text(&failed).contains("no room for task 1500") && text(&failed).contains("nothing was enqueued"));
    assert!(failed.stdout.is_empty(), "no ids printed: {}", text(&failed));

    let drop = format!("DROP TRIGGER boom ON {}.tasks", db.schema.quoted());
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop)).execute(&pool).await.unwrap();
    let enqueued = run(&["enqueue", "echo", "--count", "2500", "--delay", "1h"]);
    assert_eq!(enqueued.status.code(), Some(0), "{}", text(&enqueued));
    let ids: Vec<i64> = String::from_utf8_lossy(&enqueued.stdout).lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!((ids.len(), count().await), (2500, 2500));
    assert!(ids.windows(2).all(|w| w[0] < w[1]));

    // A run-at too far to store is refused before anything is written.
    let far = run(&["enqueue", "echo", "--run-at", "999999999999999999999d"]);
    assert_eq!(far.status.code(), Some(2), "{}", text(&far));
    assert!(text(&far).contains("invalid duration"), "{}", text(&far));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_names_never_reach_the_terminal() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    let pool = db.pool(1).await;
    let evil = "evil\u{1b}[2J\nFAKE row\u{7}\u{202e}";
    let id = first_line(&run(&["enqueue", evil, "--force", "--key", evil, "--args", "1", "--delay", "1h"]));
    assert!(id.parse::<i64>().is_ok(), "{id}");
    // Rows no enqueue would write: a queue and a worker id with control characters.
    let s = db.schema.quoted();
    let rows = format!(
        "INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at) \
         VALUES ('t', $1, 0, '1', 'PENDING', now() + interval '1 hour', now()); \
         INSERT INTO {s}.workers (id, queues, concurrency, started_at, last_seen) VALUES ($1, ARRAY[$1], 1, now(), now())"
    );
    for statement in rows.split("; ") {
        sqlx::query(sqlx::AssertSqlSafe(statement.to_owned())).bind(evil).execute(&pool).await.unwrap();
    }
    let failed = first_line(&run(&["enqueue", "echo", "--args", "2", "--delay", "1h"]));
    assert_eq!(run(&["fail", &failed, "--message", evil]).status.code(), Some(0));

    let outputs = [
        run(&["list"]),
        run(&["status"]),
        run(&["show", &id]),
        run(&["result", &failed]),
        run(&["remove-key", evil]),
        run(&["cancel", "999999"]),
    ];
    for output in &outputs {
        let all = text(output);
        assert!(!all.contains(['\u{1b}', '\u{7}', '\u{202e}']), "raw control characters: {all:?}");
        assert!(!all.lines().any(|line| line.starts_with("FAKE")), "a faked line: {all:?}");
    }
    let listed = text(&outputs[0]);
    assert!(listed.contains("evil\\u001b[2J\\nFAKE row\\u0007\\u202e"), "escaped, not dropped: {listed}");
    assert!(text(&outputs[3]).contains("FAILED_BY_OPERATOR"), "{}", text(&outputs[3]));
    // JSON output was escaped by serde already: the name reads back exactly.
    let shown: serde_json::Value = serde_json::from_slice(&run(&["show", &id, "--json"]).stdout).unwrap();
    assert_eq!(shown["task"]["name"], evil);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_write_nothing_and_say_what_to_do() {
    let db = pg::TestDb::unmigrated().await;
    let run = against(&db);
    // Not migrated yet: the hint, not PostgreSQL's source line.
    let unmigrated = run(&["list"]);
    assert_eq!(unmigrated.status.code(), Some(1));
    assert!(text(&unmigrated).contains("run canter migrate"), "{}", text(&unmigrated));
    assert!(!text(&unmigrated).contains(" at line "), "{}", text(&unmigrated));

    // The first migrate says it created the schema; later ones that it is up to date.
    let version = canter_tokio::canter::postgres::code_schema_version();
    assert_eq!(first_line(&run(&["migrate"])), format!("schema {} created at version {version}", db.schema.name()));
    let migrated = run(&["migrate", "--json"]);
    let migrated: serde_json::Value = serde_json::from_slice(&migrated.stdout).expect("migrate --json is JSON");
    assert_eq!((migrated["version"].as_i64(), &migrated["created"]), (Some(version), &false.into()));
    assert_eq!(
        first_line(&run(&["migrate"])),
        format!("schema {} is up to date (version {version})", db.schema.name())
    );

    // An enqueue the store would refuse is a usage error, its times as people read them.
    let never = run(&["enqueue", "echo", "--run-at", "2h", "--good-until", "1h"]);
    usage_error(&never, &["is not before good_until", "Z"]);
    assert!(!text(&never).contains(" ms "), "{}", text(&never));
    // A worker id nobody registered under releases nothing: said, not "0 tasks".
    let nobody = run(&["force-unlock", "nobody"]);
    assert_eq!(nobody.status.code(), Some(1), "{}", text(&nobody));
    assert!(text(&nobody).contains("no worker nobody is registered"), "{}", text(&nobody));

    // A queue nothing knows is not paused (a typo would pause nothing), unless forced.
    usage_error(&run(&["pause", "emials"]), &["queue \"emials\" has no tasks", "--force"]);
    let status: serde_json::Value = serde_json::from_slice(&run(&["status", "--json"]).stdout).unwrap();
    assert_eq!(status["paused"], serde_json::json!([]), "nothing paused on refusal");
    assert_eq!(first_line(&run(&["pause", "emials", "--force"])), "queue emials paused");
    assert_eq!(first_line(&run(&["resume", "emials"])), "queue emials running");

    // Refused enqueues write nothing.
    usage_error(&run(&["enqueue", "sleep", "--args", r#"{"ms":"abc"}"#]), &["expected u64"]);
    assert_eq!(first_line(&run(&["list"])), "(no tasks)");

    // Arguments from a file and from standard input; JSON out.
    let file = std::env::temp_dir().join(format!("canter-args-{}.json", db.schema.name()));
    std::fs::write(&file, r#"{"from": "file"}"#).unwrap();
    let from_file = run(&["enqueue", "echo", "--args", &format!("@{}", file.display()), "--json"]);
    let from_file: serde_json::Value = serde_json::from_slice(&from_file.stdout).expect("enqueue --json is JSON");
    let id = from_file["ids"][0].to_string();
    let _ = std::fs::remove_file(&file);
    let mut piped = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["enqueue", "echo", "--args", "-", "--database-url", &db.url, "--schema", db.schema.name()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut piped.stdin.take().unwrap(), br#"{"from": "stdin"}"#).unwrap();
    let piped = piped.wait_with_output().unwrap();
    assert_eq!(piped.status.code(), Some(0), "{}", text(&piped));
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&run(&["list", "--json"]).stdout).unwrap();
    let args: Vec<String> = listed.iter().map(|t| t["args"]["from"].as_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(args, ["stdin", "file"], "newest first");

    // The list pages: a header, newest first, --after and --offset, by task name.
    let table = text(&run(&["list"]));
    assert!(table.starts_with("ID") && table.contains("ENQUEUED") && table.contains("Z  "), "{table}");
    let after = run(&["list", "--after", &first_line(&run(&["enqueue", "noop"])), "--json"]);
    let after: Vec<serde_json::Value> = serde_json::from_slice(&after.stdout).unwrap();
    assert_eq!(after.len(), 2);
    let named: Vec<serde_json::Value> =
        serde_json::from_slice(&run(&["list", "--task", "noop", "--json"]).stdout).unwrap();
    assert_eq!(named.len(), 1);
    let skipped: Vec<serde_json::Value> =
        serde_json::from_slice(&run(&["list", "--offset", "2", "--json"]).stdout).unwrap();
    assert_eq!(skipped.len(), 1);
    // The hint for the next page goes to stderr: stdout is the table alone.
    let page = run(&["list", "-n", "1"]);
    assert!(String::from_utf8_lossy(&page.stderr).contains("(more with --after "), "{}", text(&page));
    assert!(!String::from_utf8_lossy(&page.stdout).contains("more with"), "{}", text(&page));

    // Each action answers in JSON too.
    let result = run(&["complete", &id, "--result", "5", "--json"]);
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&result.stdout).unwrap()["state"], "COMPLETED");
    let result = run(&["result", &id, "--json"]);
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&result.stdout).unwrap()["result"], 5);
    let shown = text(&run(&["show", &id]));
    assert!(!shown.contains("Some(") && shown.contains("result      5"), "{shown}");

    // A schedule naming a task the built-in worker does not serve is refused like enqueue.
    let config = std::env::temp_dir().join(format!("canter-unknown-{}.toml", db.schema.name()));
    std::fs::write(&config, "[[app.schedules]]\nname = \"s\"\ntask = \"report\"\nevery = \"1m\"\n").unwrap();
    let scheduler = run(&["scheduler", "--once", "--config", &config.display().to_string()]);
    let _ = std::fs::remove_file(&config);
    usage_error(&scheduler, &["report", "--force"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflows_from_the_command_line() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    let dir = std::env::temp_dir().join(format!("canter-workflow-{}", db.schema.name()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let graph = file(
        "graph.json",
        r#"{"name": "graph", "steps": [
            {"name": "a", "task": "echo", "args": {"x": 1}},
            {"name": "b", "task": "echo", "args": 2, "after": ["a"]},
            {"name": "c", "task": "fail", "args": {"code": "NOPE"}, "after": ["a"]},
            {"name": "d", "task": "echo", "args": 4, "after": ["b", "c"]},
            {"name": "e", "task": "noop", "after_finish": ["c"]},
            {"name": "f", "task": "noop", "after": ["b", "c"], "join": "any"}
        ]}"#,
    );
    let submitted = run(&["workflow", "submit", &graph, "--json"]);
    assert_eq!(submitted.status.code(), Some(0), "{}", text(&submitted));
    let submitted: serde_json::Value = serde_json::from_slice(&submitted.stdout).expect("submit --json is JSON");
    let id = submitted["workflow"].to_string();
    assert_eq!(submitted["tasks"]["a"], 1);
    let shown = text(&run(&["workflow", "show", &id]));
    assert!(shown.contains("running") && shown.contains("2 more of its 2 parents"), "{shown}");

    let mut worker = worker_command(&db).env("CANTER_LOG", "warn").stdout(Stdio::null()).spawn().unwrap();
    let mut ended = serde_json::Value::Null;
    for _ in 0..200 {
        ended = serde_json::from_slice(&run(&["workflow", "show", &id, "--json"]).stdout).unwrap();
        if ended["workflow"]["status"] != "running" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    worker.kill().unwrap();
    worker.wait().unwrap();
    // d needed c, which failed: skipped, so the workflow failed; e ran after c anyway, and f
    // needed only one of b and c.
    assert_eq!(ended["workflow"]["status"], "failed", "{ended}");
    let states: Vec<&str> = ended["steps"].as_array().unwrap().iter().map(|s| s["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["COMPLETED", "COMPLETED", "FAILED", "SKIPPED", "COMPLETED", "COMPLETED"]);
    let listed = text(&run(&["workflow", "list"]));
    assert!(listed.contains("graph") && listed.contains("failed"), "{listed}");
    // Over: a cancel is refused; an unknown workflow is said so.
    let refused = run(&["workflow", "cancel", &id]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused).contains("cannot be cancelled"), "{}", text(&refused));
    assert!(text(&run(&["workflow", "pause", "99"])).contains("no workflow 99"));
    // A retry with everything downstream: c failed, d was skipped, e and f completed below c.
    let retried = run(&["workflow", "retry", &id, "--downstream", "--json"]);
    assert_eq!(retried.status.code(), Some(0), "{}", text(&retried));
    let retried: serde_json::Value = serde_json::from_slice(&retried.stdout).expect("retry --json is JSON");
    assert_eq!(retried["status"], "running", "{retried}");
    let shown: serde_json::Value = serde_json::from_slice(&run(&["workflow", "show", &id, "--json"]).stdout).unwrap();
    let states: Vec<&str> = shown["steps"].as_array().unwrap().iter().map(|s| s["state"].as_str().unwrap()).collect();
    // f needs any of b and c: b's completion promotes it again at once.
    assert_eq!(states, ["COMPLETED", "COMPLETED", "PENDING", "WAITING", "WAITING", "PENDING"]);
    assert!(text(&run(&["workflow", "retry", &id])).contains(&format!("workflow {id} retried: now running")));
    assert!(text(&run(&["workflow", "retry", "99"])).contains("no workflow 99"));

    // Refused before anything is written: unknown tasks, their args, cycles, unknown steps.
    let unknown = file("unknown.json", r#"{"name": "u", "steps": [{"name": "a", "task": "report"}]}"#);
    usage_error(&run(&["workflow", "submit", &unknown]), &["unknown task name \"report\"", "--force"]);
    let args = file("args.json", r#"{"name": "u", "steps": [{"name": "a", "task": "sleep", "args": {"ms": "x"}}]}"#);
    usage_error(&run(&["workflow", "submit", &args]), &["step a: args do not suit"]);
    let cycle = file(
        "cycle.json",
        r#"{"name": "c", "steps": [{"name": "a", "task": "noop", "after": ["b"]}, {"name": "b", "task": "noop", "after": ["a"]}]}"#,
    );
    usage_error(&run(&["workflow", "submit", &cycle]), &["cycle"]);
    let dangling = file("dangling.json", r#"{"name": "d", "steps": [{"name": "a", "task": "noop", "after": ["z"]}]}"#);
    usage_error(&run(&["workflow", "submit", &dangling]), &["comes after \"z\", which is no step"]);
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&run(&["workflow", "list", "--json"]).stdout).unwrap();
    assert_eq!(listed.len(), 1, "refusals wrote nothing");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_unlock_refuses_a_live_worker() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let mut worker = worker_command(&db).env("CANTER_LOG", "warn").stdout(Stdio::null()).spawn().unwrap();
    let id = first_line(&run(&["enqueue", "sleep", "--args", r#"{"ms":60000}"#]));
    let shown = wait_for_state(&run, &id, "RUNNING");
    let live = shown["task"]["worker"].as_str().expect("its worker").to_owned();
    usage_error(&run(&["force-unlock", &live]), &["looks alive", "liveness token", "--force"]);
    assert_eq!(wait_for_state(&run, &id, "RUNNING")["task"]["worker"], live.as_str(), "nothing was unlocked");
    worker.kill().unwrap();
    worker.wait().unwrap();
    // Its session ends with the process: then it is dead and its tasks may go back.
    let mut unlocked = None;
    for _ in 0..50 {
        let output = run(&["force-unlock", &live]);
        if output.status.code() == Some(0) {
            unlocked = Some(first_line(&output));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(unlocked.as_deref(), Some("1 tasks back to pending"));
}

#[test]
fn the_readme_shows_the_program_s_help() {
    let readme = include_str!("../../README.md");
    let section = &readme[readme.find("## The command line").expect("the section")..];
    let start = section.find("```text\n").expect("the help block") + "```text\n".len();
    let shown = &section[start..start + section[start..].find("```\n").expect("its end")];
    let help = canter(&["--help"]);
    assert_eq!(shown, String::from_utf8_lossy(&help.stdout), "README.md's help is `canter --help`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_its_metrics_and_health_where_asked() {
    use std::io::{Read, Write};

    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let mut worker = worker_command(&db)
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The address the system chose, as the program prints it.
    let addr = printed_address(&mut worker, "metrics on http://");
    let get = |path: &str| {
        let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
        write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    };
    assert!(run(&["enqueue", "echo", "--args", "{}", "--count", "3"]).status.success());
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = get("/metrics");
        if metrics.contains("canter_worker_tasks_completed_total 3\n") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(metrics.contains("content-type: application/openmetrics-text"), "{metrics}");
    assert!(metrics.contains("canter_worker_tasks_completed_total 3\n"), "{metrics}");
    assert!(metrics.contains("canter_worker_ready 1\n"), "{metrics}");
    assert!(get("/healthz").starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").ends_with("\r\n\r\nready\n"), "{}", get("/readyz"));

    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    assert!(worker.wait().unwrap().success(), "the worker exits 0 on SIGTERM");
    assert!(std::net::TcpStream::connect(&addr).is_err(), "the endpoints end with the worker");

    // An address it cannot listen on ends the worker before it starts, saying why.
    let occupied = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = occupied.local_addr().unwrap().to_string();
    let refused = run(&["worker", "--metrics-addr", &taken]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains(&format!("--metrics-addr {taken}: cannot listen there")), "{}", text(&refused));
    drop(occupied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_statement_is_no_warning_with_its_whole_text() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    let enqueued = run(&["enqueue", "echo", "--args", "{}"]);
    let id = String::from_utf8_lossy(&enqueued.stdout).trim().to_owned();
    // Another session holds the task's row for 1.5 s: the cancel's statement waits that long.
    let pool = db.pool(1).await;
    let mut holder = pool.begin().await.unwrap();
    let lock = format!("SELECT 1 FROM {}.tasks WHERE id = $1 FOR UPDATE", db.schema.quoted());
    sqlx::query(sqlx::AssertSqlSafe(lock)).bind(id.parse::<i64>().unwrap()).execute(&mut *holder).await.unwrap();
    let cancel = tokio::task::spawn_blocking(move || run(&["cancel", &id]));
    // The 1.5 s count from when the cancel's statement waits on the lock.
    let waiting =
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%DELETE FROM%tasks%'";
    let observer = db.pool(1).await;
    for _ in 0..400 {
        if sqlx::query_scalar::<_, i64>(waiting).fetch_one(&observer).await.unwrap() > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(
        sqlx::query_scalar::<_, i64>(waiting).fetch_one(&observer).await.unwrap() > 0,
        "the cancel waits on the lock"
    );
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    holder.rollback().await.unwrap();
    let cancelled = cancel.await.unwrap();
    assert_eq!(cancelled.status.code(), Some(0), "{}", text(&cancelled));
    assert!(!text(&cancelled).contains("slow statement"), "{}", text(&cancelled));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listen_url_serves_waits_and_workers() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    // An unreadable URL is refused by name, by the worker and by a wait.
    usage_error(&run(&["worker", "--listen-database-url", "nonsense"]), &["invalid --listen-database-url"]);
    usage_error(
        &run(&["result", "1", "--wait", "1s", "--listen-database-url", "nonsense"]),
        &["invalid --listen-database-url"],
    );
    // A good one: a worker and a wait that listen there (the server's URL again here).
    let worker = worker_command(&db)
        .env("CANTER_LISTEN_DATABASE_URL", &db.url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let enqueued = run(&["enqueue", "echo", "--args", r#"{"b":2}"#]);
    let id = String::from_utf8_lossy(&enqueued.stdout).trim().to_owned();
    let waited = run(&["result", &id, "--wait", "20s", "--listen-database-url", &db.url]);
    assert_eq!(waited.status.code(), Some(0), "{}", text(&waited));
    assert_eq!(String::from_utf8_lossy(&waited.stdout).trim(), r#"{"b":2}"#);
    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    assert!(worker.wait_with_output().unwrap().status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_serves_acts_and_stops_with_its_streams_open() {
    use std::io::{Read, Write};

    let db = pg::TestDb::new().await;
    let run = against(&db);
    usage_error(&run(&["dashboard", "--auth", "nocolon"]), &["--auth", "USER:PASSWORD"]);
    let done = first_line(&run(&["enqueue", "echo", "--args", "1"]));
    assert!(run(&["complete", &done]).status.success());
    let pending = first_line(&run(&["enqueue", "echo", "--args", "2"]));
    // A live task is not deleted; a finished one is, from the command line or the dashboard.
    let refused = run(&["delete", &pending]);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("expected finished"), "{}", text(&refused));

    let mut dashboard = Command::new(env!("CARGO_BIN_EXE_canter"))
        .args(["dashboard", "--addr", "127.0.0.1:0", "--database-url", &db.url, "--schema", db.schema.name()])
        .env("CANTER_DASHBOARD_AUTH", "ops:s3cret")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = printed_address(&mut dashboard, "dashboard on http://");
    let send = |request: String| {
        let mut stream = std::net::TcpStream::connect(&addr).expect("connect");
        stream.write_all(request.as_bytes()).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    };
    let auth = "Authorization: Basic b3BzOnMzY3JldA==\r\n";
    let get =
        |path: &str, auth: &str| send(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"));
    assert!(get("/api/overview", "").starts_with("HTTP/1.1 401"));
    let overview = get("/api/overview", auth);
    assert!(overview.starts_with("HTTP/1.1 200") && overview.contains("\"queue\":\"default\""), "{overview}");
    let body = format!(r#"{{"action":"delete","task":{done}}}"#);
    let deleted = send(format!(
        "POST /api/admin HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ));
    assert!(deleted.starts_with("HTTP/1.1 200"), "{deleted}");
    assert!(text(&run(&["show", &done])).contains(&format!("no task {done}")));

    // An open event stream does not hold up the stop.
    let mut events = std::net::TcpStream::connect(&addr).unwrap();
    write!(events, "GET /api/events HTTP/1.1\r\nHost: x\r\n{auth}\r\n").unwrap();
    let mut first = [0u8; 64];
    assert!(events.read(&mut first).unwrap() > 0);
    let asked = tokio::time::Instant::now();
    assert!(Command::new("kill").args(["-TERM", &dashboard.id().to_string()]).status().unwrap().success());
    let status = dashboard.wait().unwrap();
    assert!(status.success(), "the dashboard exits 0 on SIGTERM");
    assert!(asked.elapsed() < std::time::Duration::from_secs(3), "it took {:?} to stop", asked.elapsed());
    let mut log = String::new();
    dashboard.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(log.contains("action=\"delete\""), "every action is logged: {log}");
}

/// The address a spawned `canter` prints on stdout after `marker` (the system's choice for
/// port 0), up to the next `/`.
fn printed_address(child: &mut std::process::Child, marker: &str) -> String {
    use std::io::BufRead;
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(stdout.read_line(&mut line).expect("read stdout") > 0, "the program ended without its address");
        if let Some(rest) = line.split(marker).nth(1) {
            return rest.split('/').next().expect("an address").to_owned();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueues_are_announced_on_the_broker_the_worker_hears() {
    use canter_tokio::canter::driver::wakeups::{NatsWakeups, WakeupProvider};
    use futures::StreamExt;

    let db = pg::TestDb::new().await;
    let run = against(&db);
    let nats = std::env::var("CANTER_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    // A subscriber of the schema's default queue, as a worker is.
    let provider = NatsWakeups::new(&nats, db.schema.name()).unwrap();
    let mut heard = provider.subscribe(vec!["default".to_owned()]);
    let first = tokio::time::timeout(std::time::Duration::from_secs(10), heard.next()).await.unwrap();
    assert_eq!(first, Some(canter_tokio::canter::worker::Input::Listener { connected: true }));
    let worker = worker_command(&db)
        .args(["--wakeups", "nats", "--wakeup-url", &nats])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let enqueued =
        run(&["enqueue", "echo", "--args", "{}", "--count", "3", "--wakeups", "nats", "--wakeup-url", &nats]);
    assert!(enqueued.status.success(), "{}", text(&enqueued));
    let wakeup = tokio::time::timeout(std::time::Duration::from_secs(10), heard.next()).await.unwrap();
    assert_eq!(
        wakeup,
        Some(canter_tokio::canter::worker::Input::Notified {
            queue: "default".into(),
            priority: Some(0),
            run_at: None
        })
    );
    let ids: Vec<String> = String::from_utf8_lossy(&enqueued.stdout).lines().map(str::to_owned).collect();
    assert_eq!(ids.len(), 3);
    for id in &ids {
        wait_for_state(&run, id, "COMPLETED");
    }
    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    let output = worker.wait_with_output().unwrap();
    assert!(output.status.success());
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("hearing of enqueues through a wake-up provider") && log.contains("nats"), "{log}");

    // An address the provider does not understand is a usage error naming the flag.
    usage_error(&run(&["worker", "--wakeups", "rabbitmq", "--wakeup-url", "http://x"]), &["--wakeup-url"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolated_tasks_crash_alone_and_time_out_for_good() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let worker = worker_command(&db)
        .args(["--processes", "2", "--child-memory-mib", "512", "--handler-timeout-ms", "1500"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let enqueue = |args: &[&str]| first_line(&run(&[&["enqueue"], args].concat()));
    let crash = enqueue(&["crash"]);
    let hog = enqueue(&["hog"]);
    // Blocking code past its timeout: its child is killed, so it stops for good.
    let endless = enqueue(&["cpu", "--args", "{\"iterations\": 18000000000000000000}"]);
    let fine: Vec<String> = (0..4).map(|i| enqueue(&["cpu", "--args", &format!("{{\"iterations\": {i}}}")])).collect();
    let echo = enqueue(&["echo", "--args", "{\"in\": \"process\"}"]);
    for (id, code) in [(&crash, "WORKER_CHILD_CRASHED"), (&hog, "WORKER_CHILD_CRASHED"), (&endless, "TASK_TIMEOUT")] {
        let shown = wait_for_state(&run, id, "FAILED");
        assert_eq!(shown["task"]["error"]["code"], code, "{shown}");
    }
    for id in fine.iter().chain([&echo]) {
        wait_for_state(&run, id, "COMPLETED");
    }
    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    let output = worker.wait_with_output().unwrap();
    assert!(output.status.success(), "the worker lived through its children's crashes");
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("isolated tasks run in child processes"), "{log}");
    // No child outlived the worker (children run the worker's own command line).
    assert_no_children(&db);

    // In the worker's own process the crash task refuses.
    let mut plain = worker_command(&db).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let refused = enqueue(&["crash"]);
    let shown = wait_for_state(&run, &refused, "FAILED");
    assert!(shown["task"]["error"]["message"].as_str().unwrap().contains("--processes"), "{shown}");
    assert!(Command::new("kill").args(["-TERM", &plain.id().to_string()]).status().unwrap().success());
    assert!(plain.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_hands_back_what_runs_in_children() {
    let db = pg::TestDb::new().await;
    let run = against(&db);
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let worker = worker_command(&db)
        .args(["--processes", "1", "--shutdown-grace-ms", "300"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let long = first_line(&run(&["enqueue", "block", "--args", "{\"ms\": 600000}"]));
    wait_for_state(&run, &long, "RUNNING");
    assert!(Command::new("kill").args(["-TERM", &worker.id().to_string()]).status().unwrap().success());
    let output = worker.wait_with_output().unwrap();
    assert!(output.status.success());
    // Its child was killed at the grace's end and the task handed back, as from a thread.
    let shown = wait_for_state(&run, &long, "PENDING");
    assert_eq!(shown["task"]["attempts"], 1, "{shown}");
    assert_no_children(&db);
}

/// Asserts no child process of a `--processes` worker on `db`'s schema outlived its worker
/// (children run the worker's own command line).
#[track_caller]
fn assert_no_children(db: &pg::TestDb) {
    std::thread::sleep(std::time::Duration::from_millis(300));
    let pattern = format!("--schema {} --processes", db.schema.name());
    let children = Command::new("pgrep").args(["-f", "--", &pattern]).output().unwrap();
    assert!(children.stdout.is_empty(), "children left: {}", String::from_utf8_lossy(&children.stdout));
}
