//! Schema versions, privileges and startup: what a worker does with a schema that is current,
//! behind, ahead or not its own to migrate; the README's grants; the migrate lock; the clock;
//! and an upgrade from the last release while a worker of that release runs.

#[path = "../../tests/common/pg.rs"]
mod pg;
#[path = "common/program.rs"]
mod program;

use program::canter as run_canter;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use canter_tokio::canter::postgres::{
    MIGRATE_LOCK_KEY, MIGRATOR, MigrateSchemaError, PgSchema, SchemaStatus, code_schema_version, migrate,
    register_listener, schema_status, unregister_listener,
};
use canter_tokio::canter::store::AdminRequest;
use canter_tokio::{
    AppConfig, Client, NewTask, Registry, ServeError, TaskError, TaskState, TokioRuntime, Worker, WorkerConfig,
};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;

/// The last release before schema versions: it knows migration 0001 only.
const RELEASE: &str = "3a4071ceb204c4ea5c9cca459be40d2cb9a71c70";

fn sql(text: String) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(text)
}

async fn exec(pool: &PgPool, text: String) {
    sqlx::raw_sql(sql(text.clone())).execute(pool).await.unwrap_or_else(|e| panic!("{text}: {e}"));
}

/// Applies migration 1 alone to `schema`, as the last release did.
async fn migrate_to_v1(url: &str, schema: &PgSchema) {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sql(format!("CREATE SCHEMA {0}; SET search_path TO {0}", schema.quoted())))
        .execute(&mut conn)
        .await
        .unwrap();
    MIGRATOR.run_direct(Some(1), &mut conn, false).await.unwrap();
    conn.close().await.unwrap();
}

fn app() -> AppConfig {
    AppConfig::default()
}

fn fast_worker() -> WorkerConfig {
    WorkerConfig { concurrency: 4, poll_interval_ms: 1_000, ..WorkerConfig::default() }
}

/// The tasks these tests enqueue: `noop`, `echo` (returns its arguments) and `sleep {"ms": N}`,
/// as the `canter` program's built-in tasks do.
fn registry() -> Registry {
    #[derive(serde::Deserialize)]
    struct Sleep {
        ms: u64,
    }
    let mut registry = Registry::new();
    registry.register("noop", |_: serde_json::Value, _| async { Ok::<_, TaskError>(serde_json::Value::Null) }).unwrap();
    registry.register("echo", |args: serde_json::Value, _| async move { Ok::<_, TaskError>(args) }).unwrap();
    registry
        .register("sleep", |args: Sleep, _| async move {
            tokio::time::sleep(Duration::from_millis(args.ms)).await;
            Ok::<_, TaskError>(serde_json::Value::Null)
        })
        .unwrap();
    registry
}

/// A worker of the test tasks on `pool` in `schema`, stopped by the returned sender.
fn worker(
    pool: &PgPool,
    schema: &PgSchema,
    migrate: bool,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<canter_tokio::Stats, ServeError>>) {
    let worker = Worker::new(pool.clone(), app(), fast_worker(), Arc::new(registry()))
        .unwrap()
        .schema(schema.clone())
        .migrate(migrate);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));
    (stop, run)
}

/// Starts a worker expected to refuse the schema, and returns its error (it must not retry).
async fn refusal(pool: &PgPool, schema: &PgSchema, migrate: bool) -> MigrateSchemaError {
    let (_stop, run) = worker(pool, schema, migrate);
    match tokio::time::timeout(Duration::from_secs(20), run).await {
        Ok(Ok(Err(ServeError::Schema(error)))) => error,
        Ok(other) => panic!("expected a refusal, got {other:?}"),
        Err(_) => panic!("the worker kept retrying instead of refusing"),
    }
}

/// Runs one `echo` task through a worker on `pool` and stops it: the schema was usable.
async fn runs_a_task(pool: &PgPool, client_pool: &PgPool, schema: &PgSchema, migrate: bool) {
    let (stop, run) = worker(pool, schema, migrate);
    let client = Client::new(Arc::new(TokioRuntime), client_pool.clone(), schema.clone(), app());
    let id = client.store().enqueue(NewTask::new("echo", json!({"hello": 1}))).await.unwrap();
    let record = match client.wait(id, Duration::from_secs(30)).await {
        Ok(record) => record,
        Err(error) => {
            let _ = stop.send(());
            panic!("the task did not finish: {error}; worker: {:?}", run.await);
        }
    };
    assert_eq!(record.state, TaskState::Completed);
    assert_eq!(record.result, Some(json!({"hello": 1})));
    let _ = stop.send(());
    run.await.unwrap().expect("the worker stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_first_and_a_client_at_once_share_an_empty_schema() {
    // The README's quickstart starts its client first (tests/quickstart.rs); here the worker
    // starts first and the client writes at once, while the worker may still be migrating.
    let db = pg::TestDb::unmigrated().await;
    let pool = db.pool(8).await;
    let mut registry = Registry::new();
    let echo = registry
        .register(
            "echo",
            |args: serde_json::Value, _ctx: canter_tokio::TaskContext| async move { Ok::<_, TaskError>(args) },
        )
        .unwrap();
    let worker = Worker::new(pool.clone(), app(), fast_worker(), Arc::new(registry)).unwrap().schema(db.schema.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), app());
    let handle = client.enqueue(&echo, &json!({"first": "worker"})).await.expect("the client's first write");
    assert_eq!(handle.wait(Duration::from_secs(30)).await.expect("the task runs"), json!({"first": "worker"}));
    let _ = stop.send(());
    run.await.unwrap().expect("the worker stops cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_reports_where_it_stands() {
    let db = pg::TestDb::unmigrated().await;
    let pool = db.pool(2).await;
    let code = code_schema_version();
    assert!(code >= 2);
    let status = schema_status(&pool, &db.schema).await.unwrap();
    assert_eq!(status, SchemaStatus::Behind { version: None, missing: (1..=code).collect(), schema_exists: false });
    migrate_to_v1(&db.url, &db.schema).await;
    let status = schema_status(&pool, &db.schema).await.unwrap();
    assert_eq!(status, SchemaStatus::Behind { version: Some(1), missing: (2..=code).collect(), schema_exists: true });
    migrate(&pool, &db.schema).await.unwrap();
    assert_eq!(schema_status(&pool, &db.schema).await.unwrap(), SchemaStatus::Current { version: code });
    let declared: Vec<(i64, i64)> = sqlx::query_as(sql(format!(
        "SELECT version, min_code_version FROM {}.schema_versions ORDER BY version",
        db.schema.quoted()
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(declared[..2], [(1, 1), (2, 1)]);
    let versions: Vec<i64> = declared.iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, (1..=code).collect::<Vec<_>>(), "every migration declares the code it accepts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_migrations_a_worker_refuses_a_schema_that_lacks_some() {
    let db = pg::TestDb::unmigrated().await;
    let pool = db.pool(8).await;
    let error = refusal(&pool, &db.schema, false).await;
    let code = code_schema_version();
    assert!(
        matches!(error, MigrateSchemaError::NotMigrated { version: None, code_version, .. } if code_version == code),
        "{error}"
    );
    migrate_to_v1(&db.url, &db.schema).await;
    let error = refusal(&pool, &db.schema, false).await;
    assert!(matches!(error, MigrateSchemaError::NotMigrated { version: Some(1), .. }), "{error}");
    let message = error.to_string();
    assert!(message.contains("at version 1") && message.contains(&format!("needs version {code}")), "{message}");
    assert!(message.contains("run `canter migrate`"), "{message}");

    // The program says the same and exits at once with a failure.
    let output = canter(&db, &["worker", "--no-migrate"]);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(text(&output).contains("run `canter migrate`"), "{}", text(&output));

    // Once migrated, it starts without migrating.
    assert!(canter(&db, &["migrate"]).status.success());
    runs_a_task(&pool, &pool, &db.schema, false).await;
}

/// Records a migration `version` this binary does not know, accepting code from `accepts` on
/// (`None`: no row of its own in `schema_versions`).
async fn pretend_newer(pool: &PgPool, schema: &PgSchema, version: i64, accepts: Option<i64>) {
    let s = schema.quoted();
    exec(
        pool,
        format!(
            "DELETE FROM {s}._sqlx_migrations WHERE version = {version};
             DELETE FROM {s}.schema_versions WHERE version = {version};
             INSERT INTO {s}._sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES ({version}, 'from the future', true, '\\x00', 0)"
        ),
    )
    .await;
    if let Some(accepts) = accepts {
        exec(
            pool,
            format!(
                "INSERT INTO {s}.schema_versions (version, min_code_version, description)
                 VALUES ({version}, {accepts}, 'from the future')"
            ),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_used_within_its_declared_range_and_refused_outside_it() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    let code = code_schema_version();
    pretend_newer(&pool, &db.schema, 99, Some(code)).await;
    // Migrating leaves it alone (sqlx alone would refuse a history it does not know).
    runs_a_task(&pool, &pool, &db.schema, true).await;
    runs_a_task(&pool, &pool, &db.schema, false).await;
    assert_eq!(
        schema_status(&pool, &db.schema).await.unwrap(),
        SchemaStatus::Ahead { version: 99, code_version: code }
    );
    let migrated = canter(&db, &["migrate"]);
    assert!(text(&migrated).contains(&format!("version 99, newer than this binary's {code}")), "{}", text(&migrated));

    for (accepts, needs) in [(Some(50), 50), (None, 99)] {
        pretend_newer(&pool, &db.schema, 99, accepts).await;
        for migrating in [true, false] {
            let error = refusal(&pool, &db.schema, migrating).await;
            assert!(
                matches!(error, MigrateSchemaError::Incompatible { version: 99, code_version: c, needs: n, .. } if n == needs && c == code),
                "{error}"
            );
            let message = error.to_string();
            assert!(message.contains("at version 99") && message.contains(&format!("up to {code}")), "{message}");
        }
        let output = canter(&db, &["worker"]);
        assert_eq!(output.status.code(), Some(1), "{}", text(&output));
        assert!(text(&output).contains("at version 99"), "{}", text(&output));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_migration_is_refused() {
    let db = pg::TestDb::new().await;
    let pool = db.pool(8).await;
    exec(&pool, format!("UPDATE {}._sqlx_migrations SET checksum = '\\x00' WHERE version = 1", db.schema.quoted()))
        .await;
    for migrating in [true, false] {
        let error = refusal(&pool, &db.schema, migrating).await;
        assert!(matches!(error, MigrateSchemaError::Modified { version: 1, .. }), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_production_clock_reads_no_setting() {
    // Version 1's db_now() read `canter.now` on every call; only the tests' override does now.
    for (db, pinned) in [(pg::TestDb::production().await, false), (pg::TestDb::new().await, true)] {
        let pool = PgPoolOptions::new().max_connections(1).connect(&db.url).await.unwrap();
        exec(&pool, "SET canter.now = '2001-02-03 04:05:06+00'".to_owned()).await;
        let year: f64 =
            sqlx::query_scalar(sql(format!("SELECT extract(year FROM {}.db_now())::float8", db.schema.quoted())))
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(year == 2001.0, pinned, "year {year}");
        pool.close().await;
    }
}

// --- privileges -----------------------------------------------------------------------------

/// Login roles made for one test, dropped with it.
struct Roles {
    url: String,
    names: Vec<String>,
}

impl Roles {
    /// Runs `script` (with `{name}` roles made unique by `prefix`) as the superuser.
    async fn create(db: &pg::TestDb, prefix: &str, names: &[&str], script: &str) -> Roles {
        let admin = db.pool(1).await;
        let roles = Roles { url: db.url.clone(), names: names.iter().map(|n| format!("{prefix}_{n}")).collect() };
        for name in &roles.names {
            // Left by an earlier run whose process id this one reuses.
            exec(
                &admin,
                format!(
                    "DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN \
                     EXECUTE 'DROP OWNED BY {name}'; EXECUTE 'DROP ROLE {name}'; END IF; END $$"
                ),
            )
            .await;
        }
        sqlx::raw_sql(sql(script.to_owned())).execute(&admin).await.unwrap_or_else(|e| panic!("{script}\n{e}"));
        for name in &roles.names {
            exec(&admin, format!("ALTER ROLE {name} LOGIN PASSWORD 'canter'")).await;
        }
        admin.close().await;
        roles
    }

    /// The URL of `role`.
    fn url(&self, role: &str) -> String {
        let options: PgConnectOptions = self.url.parse().unwrap();
        let name = self.names.iter().find(|n| n.ends_with(&format!("_{role}"))).expect("a role of this test");
        format!(
            "postgres://{name}:canter@{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("postgres")
        )
    }

    async fn pool(&self, role: &str) -> PgPool {
        PgPoolOptions::new().max_connections(8).connect(&self.url(role)).await.unwrap()
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let (url, names) = (self.url.clone(), self.names.clone());
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            runtime.block_on(async move {
                let mut conn = PgConnection::connect(&url).await.ok()?;
                for name in names {
                    let _ = sqlx::raw_sql(sql(format!(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}';
                         DROP OWNED BY {name}; DROP ROLE {name}"
                    )))
                    .execute(&mut conn)
                    .await;
                }
                conn.close().await.ok()
            })
        })
        .join();
    }
}

/// Creates roles `<prefix>_<name>` with no privileges.
fn create_roles_script(prefix: &str, names: &[&str]) -> String {
    names.iter().map(|n| format!("CREATE ROLE {prefix}_{n};")).collect::<Vec<_>>().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permission_denied_at_startup_is_fatal_and_says_what_is_missing() {
    let db = pg::TestDb::new().await;
    let prefix = db.schema.name().to_owned();
    let roles = Roles::create(&db, &prefix, &["nobody"], &create_roles_script(&prefix, &["nobody"])).await;
    let pool = roles.pool("nobody").await;
    // No USAGE on the schema: the version cannot even be read.
    for migrating in [true, false] {
        let error = refusal(&pool, &db.schema, migrating).await;
        assert!(matches!(error, MigrateSchemaError::PermissionDenied { .. }), "{error}");
        let message = error.to_string();
        assert!(message.contains("permission denied for schema"), "{message}");
        assert!(message.contains("USAGE on the schema"), "{message}");
    }
    // It may read the version, but the schema lacks a migration and it may not create tables.
    let older = pg::TestDb::unmigrated().await;
    migrate_to_v1(&older.url, &older.schema).await;
    let admin = older.pool(1).await;
    let name = format!("{prefix}_nobody");
    exec(
        &admin,
        format!(
            "GRANT USAGE ON SCHEMA {0} TO {name}; GRANT SELECT ON {0}._sqlx_migrations TO {name}",
            older.schema.quoted()
        ),
    )
    .await;
    let error = refusal(&pool, &older.schema, true).await;
    let message = error.to_string();
    assert!(matches!(error, MigrateSchemaError::PermissionDenied { doing: "migrating", .. }), "{message}");
    assert!(message.contains("CREATE on the schema") && message.contains("--no-migrate"), "{message}");
    // The program exits at once with the message.
    let mut args = vec!["worker".to_owned(), "--database-url".to_owned(), roles.url("nobody")];
    args.extend(["--schema".to_owned(), older.schema.name().to_owned()]);
    let output = run_canter(&args);
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    assert!(text(&output).contains("permission denied"), "{}", text(&output));
    pool.close().await;
}

/// The README's grants for the roles of `prefix` on `schema`: the `sql` block under
/// "## Privileges", with `canter_<role>` renamed `<prefix>_<role>` and the schema `canter`
/// renamed.
fn readme_grants(prefix: &str, schema: &str) -> String {
    let readme = include_str!("../../README.md");
    let section = &readme[readme.find("## Privileges").expect("a Privileges section")..];
    let block = &section[section.find("```sql").expect("an sql block") + 6..];
    let block = &block[..block.find("```").expect("the block's end")];
    // Comments may name the program; statements only.
    let mut out: String = block.lines().filter(|l| !l.trim_start().starts_with("--")).collect::<Vec<_>>().join("\n");
    for role in ["worker", "client", "reader", "operator"] {
        out = out.replace(&format!("canter_{role}"), &format!("{prefix}_{role}"));
    }
    // What remains of `canter` as a whole word is the schema.
    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let (mut renamed, mut from) = (String::new(), 0);
    while let Some(offset) = out[from..].find("canter") {
        let at = from + offset;
        let whole = !word(out[..at].chars().last()) && !word(out[at + 6..].chars().next());
        renamed.push_str(&out[from..at]);
        renamed.push_str(if whole { schema } else { "canter" });
        from = at + 6;
    }
    renamed.push_str(&out[from..]);
    renamed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_grants_are_enough_for_each_role() {
    let db = pg::TestDb::new().await;
    let prefix = db.schema.name().to_owned();
    let names = ["worker", "client", "reader", "operator"];
    let script = readme_grants(&prefix, db.schema.name());
    assert!(!script.contains("canter"), "every name renamed:\n{script}");
    let roles = Roles::create(&db, &prefix, &names, &script).await;
    let (worker_pool, client_pool) = (roles.pool("worker").await, roles.pool("client").await);

    // A worker starts with migrations on (the schema is current: it only reads the version)
    // and with them off; a client enqueues, with keys too, and waits for results.
    runs_a_task(&worker_pool, &client_pool, &db.schema, true).await;
    runs_a_task(&worker_pool, &client_pool, &db.schema, false).await;
    let client = Client::new(Arc::new(TokioRuntime), client_pool.clone(), db.schema.clone(), app());
    let (stop, run) = worker(&worker_pool, &db.schema, true);
    for mode in ["replace", "preserve_run_at", "unsafe_dedupe", "idempotent"] {
        let mode = canter_tokio::canter::store::KeyMode::parse(mode).unwrap();
        let task = NewTask::new("echo", json!({"k": 1})).key_with_mode(format!("key-{}", mode.as_str()), mode);
        let ids = client.store().enqueue_many(vec![task.clone(), task]).await.unwrap();
        let record = client.wait(ids[0], Duration::from_secs(30)).await.unwrap();
        assert_eq!(record.state, TaskState::Completed, "{mode:?}");
    }
    // A workflow submitted by the client runs on the worker's grants (the settling of its
    // children is the owner's function's; the claim takes them from behind their parent's
    // gate, schema 18, as 8 children of one parent are gated), and the operator pauses,
    // cancels, retries and resumes another.
    let mut fan_out = canter_tokio::canter::store::NewWorkflow::new("fan-out");
    let first = fan_out.step(NewTask::new("echo", json!(1)), canter_tokio::canter::workflow::Join::All);
    for i in 0..8 {
        let child = fan_out.step(NewTask::new("echo", json!(i)), canter_tokio::canter::workflow::Join::All);
        fan_out.edge(first, child, canter_tokio::canter::workflow::EdgePolicy::RequireSuccess);
    }
    let submitted = client.store().submit_workflow(&fan_out).await.expect("the client submits a workflow");
    for &child in &submitted.tasks[1..] {
        let record = client.wait(child, Duration::from_secs(30)).await.unwrap();
        assert_eq!(record.state, TaskState::Completed, "the children ran");
    }
    let later = {
        let mut later = canter_tokio::canter::store::NewWorkflow::new("later");
        later.step(NewTask::new("noop", json!({})).run_at(canter_tokio::RunAt::DelayMs(3_600_000)), Default::default());
        client.store().submit_workflow(&later).await.unwrap().workflow
    };
    let hour = canter_tokio::RunAt::DelayMs(3_600_000);
    let (a, b) = (
        client.store().enqueue(NewTask::new("noop", json!({})).run_at(hour)).await.unwrap(),
        client.store().enqueue(NewTask::new("noop", json!({})).run_at(hour)).await.unwrap(),
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    // A client is no operator.
    assert!(client.admin(&AdminRequest::Cancel { task: a }).await.is_err(), "a client cannot cancel");

    // The reader sees everything and changes nothing; the operator does every admin action.
    let as_role = |role: &str, args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--database-url".to_owned(), roles.url(role), "--schema".to_owned(), prefix.clone()]);
        run_canter(&all)
    };
    let (a, b) = (a.to_string(), b.to_string());
    for args in [&["status"][..], &["list"], &["show", &a], &["result", &a], &["schedules"]] {
        let output = as_role("reader", args);
        // `result` of a pending task fails by design, after reading it.
        let ok = output.status.success() || (args[0] == "result" && text(&output).contains("no result yet"));
        assert!(ok, "reader {args:?}: {}", text(&output));
    }
    // Any role may wait for results, so any may register as a waiter (`result --wait`).
    for role in names {
        let mut listener = sqlx::postgres::PgListener::connect_with(&roles.pool(role).await).await.unwrap();
        listener.listen(&db.schema.done_channel()).await.unwrap();
        let registered = register_listener(&mut listener, &db.schema, &[db.schema.done_channel()]).await;
        assert!(registered.is_ok(), "{role} registers as a waiter: {registered:?}");
        unregister_listener(&mut listener, &db.schema).await.unwrap();
    }
    for (role, args) in [
        ("reader", &["cancel", &a][..]),
        ("worker", &["pause", "default"]),
        ("client", &["purge", "--older-than", "0s"]),
    ] {
        let denied = as_role(role, args);
        assert_eq!(denied.status.code(), Some(1), "{role} {args:?}: {}", text(&denied));
        assert!(text(&denied).contains("permission denied"), "{role} {args:?}: {}", text(&denied));
    }
    let operator = canter_tokio::canter::postgres::PgStore::new(roles.pool("operator").await, db.schema.clone(), app());
    let paused = operator.pause_workflow(later).await.expect("the operator pauses a workflow");
    assert_eq!(paused, canter_tokio::canter::workflow::WorkflowStatus::Paused);
    let cancelled = operator.cancel_workflow(later).await.expect("the operator cancels a workflow");
    assert_eq!(cancelled, canter_tokio::canter::workflow::WorkflowStatus::Cancelled);
    let retried = operator.retry_workflow(later, true).await.expect("the operator retries a workflow");
    assert_eq!(retried, canter_tokio::canter::workflow::WorkflowStatus::Running);
    operator.pause_workflow(later).await.unwrap();
    let resumed = operator.resume_workflow(later).await.expect("the operator resumes a workflow");
    assert_eq!(resumed, canter_tokio::canter::workflow::WorkflowStatus::Running);
    for args in [
        &["pause", "default"][..],
        &["resume", "default"],
        &["reschedule", &a, "--priority", "3"],
        &["complete", &a],
        &["fail", &b],
        &["retry", &b],
        &["cancel", &b],
        &["remove-key", "key-replace"],
        &["force-unlock", "gone-worker", "--force"],
        &["purge", "--older-than", "0s"],
    ] {
        let output = as_role("operator", args);
        assert!(output.status.success(), "operator {args:?}: {}", text(&output));
    }
    worker_pool.close().await;
    client_pool.close().await;
}

// --- the program ----------------------------------------------------------------------------

/// Runs the program with `args` against the test's schema, as the superuser.
fn canter(db: &pg::TestDb, args: &[&str]) -> Output {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend(["--database-url".to_owned(), db.url.clone(), "--schema".to_owned(), db.schema.name().to_owned()]);
    run_canter(&all)
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A `canter worker` process whose log lines are collected.
struct LoggedWorker {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl LoggedWorker {
    fn start(program: &Path, url: &str, schema: &str, extra: &[&str]) -> LoggedWorker {
        let mut child = Command::new(program)
            .args(["worker", "--database-url", url, "--schema", schema, "--concurrency", "4"])
            .args(["--poll-interval-ms", "1000"])
            .args(extra)
            .env_remove("DATABASE_URL")
            .env("CANTER_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a worker");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (stderr, sink) = (child.stderr.take().unwrap(), lines.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        LoggedWorker { child, lines }
    }

    async fn wait_for_line(&self, what: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(line) = self.lines.lock().unwrap().iter().find(|l| l.contains(what)) {
                return line.clone();
            }
            assert!(Instant::now() < deadline, "no log line with {what:?} within {within:?}: {:?}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Sends `signal` and returns the exit status and how long the process took to end.
    async fn stop(&mut self, signal: &str, within: Duration) -> (std::process::ExitStatus, Duration) {
        let sent = Instant::now();
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, sent.elapsed());
            }
            if sent.elapsed() > within {
                let _ = self.child.kill();
                panic!("the worker did not stop within {within:?} of {signal}: {:?}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for LoggedWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_waiting_for_the_migrate_lock_says_so_and_stops_at_once_when_told() {
    // A schema that lacks migrations, and a session that holds the lock and keeps it.
    let db = pg::TestDb::unmigrated().await;
    let holder = db.pool(1).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&holder).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)").bind(MIGRATE_LOCK_KEY).execute(&holder).await.unwrap();

    let mut worker = LoggedWorker::start(Path::new(env!("CARGO_BIN_EXE_canter")), &db.url, db.schema.name(), &[]);
    let line = worker.wait_for_line("waiting for the migrate lock", Duration::from_secs(30)).await;
    assert!(line.contains(&format!("pid {pid}")), "the log names the holder: {line}");
    let (status, took) = worker.stop("-INT", Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}: {:?}", worker.log());
    assert!(took < Duration::from_secs(5), "took {took:?} to stop");
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(MIGRATE_LOCK_KEY).execute(&holder).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stuck_in_a_startup_statement_stops_at_once_when_told() {
    // The worker's read of the schema's version waits behind this lock.
    let db = pg::TestDb::new().await;
    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::raw_sql(sql(format!("LOCK TABLE {}._sqlx_migrations IN ACCESS EXCLUSIVE MODE", db.schema.quoted())))
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut worker = LoggedWorker::start(Path::new(env!("CARGO_BIN_EXE_canter")), &db.url, db.schema.name(), &[]);
    let watcher = db.pool(1).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(sql(format!(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = '{}._sqlx_migrations'::regclass",
            db.schema.quoted()
        )))
        .fetch_one(&watcher)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the worker never waited on the lock: {:?}", worker.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, took) = worker.stop("-INT", Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}: {:?}", worker.log());
    assert!(took < Duration::from_secs(5), "took {took:?} to stop");
    tx.rollback().await.unwrap();
}

// --- an upgrade under a running worker of the last release -----------------------------------

/// The `canter` program of [`RELEASE`], built from git history once per target directory (in a
/// target directory of its own: a nested build in the one `cargo test` holds would wait for its
/// lock forever).
fn released_canter() -> PathBuf {
    let ours = PathBuf::from(env!("CARGO_BIN_EXE_canter"));
    let target = ours.parent().and_then(Path::parent).expect("the target directory");
    let dir = target.join(format!("canter-release-{}", &RELEASE[..7]));
    let (src, built) = (dir.join("src"), dir.join("target"));
    let program = built.join("debug").join("canter");
    let extracted = dir.join("extracted");
    if !extracted.exists() {
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let archive = Command::new("sh")
            .arg("-c")
            .arg("git -C \"$1\" archive --format=tar \"$2\" | tar -x -C \"$3\"")
            .args(["sh", &root.display().to_string(), RELEASE, &src.display().to_string()])
            .output()
            .expect("run git archive");
        assert!(
            archive.status.success(),
            "extracting release {RELEASE} needs git and the repository's history: {}",
            text(&archive)
        );
        std::fs::write(&extracted, RELEASE).unwrap();
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    // Niced: the other tests of this binary run meanwhile, some of them timed.
    let build = Command::new("nice")
        .args(["-n", "10"])
        .arg(cargo)
        .args(["build", "--locked", "-p", "canter-tokio", "--bin", "canter", "--target-dir"])
        .arg(&built)
        .current_dir(&src)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .env("CARGO_INCREMENTAL", "0")
        .env("CARGO_PROFILE_DEV_DEBUG", "0")
        .output()
        .expect("run cargo build");
    assert!(build.status.success(), "building release {RELEASE}: {}", text(&build));
    program
}

async fn count(pool: &PgPool, query: String) -> i64 {
    sqlx::query_scalar(sql(query)).fetch_one(pool).await.unwrap()
}

async fn wait_for(pool: &PgPool, what: &str, query: String, at_least: i64, within: Duration, logs: &[&LoggedWorker]) {
    let deadline = Instant::now() + within;
    loop {
        let n = count(pool, query.clone()).await;
        if n >= at_least {
            return;
        }
        let logs: Vec<Vec<String>> = logs.iter().map(|w| w.log()).collect();
        assert!(Instant::now() < deadline, "{what}: {n} < {at_least} within {within:?}; logs {logs:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_applies_while_a_worker_of_the_last_release_runs_and_loses_nothing() {
    let old = tokio::task::spawn_blocking(released_canter).await.unwrap();
    let db = pg::TestDb::unmigrated().await;
    let pool = db.pool(4).await;
    let (url, name, s) = (db.url.clone(), db.schema.name().to_owned(), db.schema.quoted().to_owned());
    let released = |args: &[&str]| {
        let output = Command::new(&old)
            .args(args)
            .args(["--database-url", &url, "--schema", &name])
            .env("CANTER_LOG", "warn")
            .output()
            .expect("run the released canter");
        assert!(output.status.success(), "released canter {args:?}: {}", text(&output));
    };
    // The release's schema, with tasks, and its worker at work.
    released(&["migrate"]);
    assert_eq!(
        schema_status(&pool, &db.schema).await.unwrap(),
        SchemaStatus::Behind { version: Some(1), missing: (2..=code_schema_version()).collect(), schema_exists: true }
    );
    released(&["enqueue", "sleep", "--args", r#"{"ms": 20}"#, "--count", "200"]);
    let mut old_worker = LoggedWorker::start(&old, &url, &name, &[]);
    let finished = format!("SELECT count(*) FROM {s}.finished_tasks WHERE state = 'COMPLETED'");
    wait_for(&pool, "the old worker works", finished.clone(), 20, Duration::from_secs(60), &[&old_worker]).await;

    // The upgrade, while it runs.
    migrate(&pool, &db.schema).await.expect("migrate to version 2 under a running worker");
    let current = SchemaStatus::Current { version: code_schema_version() };
    assert_eq!(schema_status(&pool, &db.schema).await.unwrap(), current);
    let upgraded: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8").fetch_one(&pool).await.unwrap();
    let old_id: String = sqlx::query_scalar(sql(format!("SELECT id FROM {s}.workers WHERE stopped_at IS NULL")))
        .fetch_one(&pool)
        .await
        .unwrap();
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), app());
    let batch = || (0..200).map(|_| NewTask::new("sleep", json!({"ms": 20}))).collect::<Vec<_>>();
    client.store().enqueue_many(batch()).await.unwrap();
    let by = |worker: &str| {
        format!(
            "SELECT count(*) FROM {s}.finished_tasks WHERE claimed_by = '{worker}' AND state = 'COMPLETED' \
             AND finished_at > to_timestamp({upgraded})"
        )
    };
    wait_for(&pool, "the old worker works on version 2", by(&old_id), 20, Duration::from_secs(60), &[&old_worker])
        .await;

    // A worker of this binary beside it: the schema is current, so it only reads the version.
    let mut new_worker = LoggedWorker::start(Path::new(env!("CARGO_BIN_EXE_canter")), &url, &name, &[]);
    client.store().enqueue_many(batch()).await.unwrap();
    let live = format!("SELECT count(*) FROM {s}.tasks");
    let deadline = Instant::now() + Duration::from_secs(120);
    while count(&pool, live.clone()).await > 0 {
        assert!(Instant::now() < deadline, "not drained: {:?} {:?}", old_worker.log(), new_worker.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let new_id: String =
        sqlx::query_scalar(sql(format!("SELECT id FROM {s}.workers WHERE stopped_at IS NULL AND id <> '{old_id}'")))
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(count(&pool, by(&new_id)).await > 0, "the new worker did work");
    assert!(new_worker.log().iter().all(|l| !l.contains("migrat")), "{:?}", new_worker.log());

    // None lost, none run twice.
    let (completed, once) = (
        count(&pool, finished.clone()).await,
        count(&pool, format!("SELECT count(*) FROM {s}.finished_tasks WHERE attempts = 1")).await,
    );
    assert_eq!((completed, once), (600, 600));
    assert_eq!(count(&pool, format!("SELECT count(*) FROM {s}.attempts")).await, 0);
    for worker in [&mut old_worker, &mut new_worker] {
        let (status, _) = worker.stop("-TERM", Duration::from_secs(30)).await;
        assert!(status.success(), "{status:?}: {:?}", worker.log());
    }
    pool.close().await;
}
