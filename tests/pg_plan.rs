//! The claim's query plan with a realistic history: 100,000 finished and 10,000 pending tasks.
//! The claim must walk its partial index, never scan the table. Two views of that: EXPLAIN of
//! the claim's candidate query (custom and generic plans), and the statistics of a transaction
//! that runs the real `claim` function (which PL/pgSQL may run with generic plans).
//!
//! With `--nocapture` it also prints the latency of claim and finish statements.

// Timing statements needs the wall clock; the core's rule against it does not apply here.
#![allow(clippy::disallowed_methods)]

#[path = "common/pg.rs"]
mod pg;

use std::sync::Arc;
use std::time::{Duration, Instant};

use canter::budget::ClaimPolicy;
use canter::config::{AppConfig, WorkerConfig};
use canter::postgres::PgStore;
use canter::store::{Completion, DbReply, DbRequest, FinishOutcome, NewTask, NewWorkflow};
use canter::task::{TaskLease, WorkerId};
use canter::workflow::{EdgePolicy, Join};
use pg::TestDb;
use serde_json::{Value, json};
use sqlx::{Acquire, AssertSqlSafe};

const FINISHED: i64 = 100_000;
const PENDING: usize = 10_000;

async fn history(store: &PgStore) {
    let s = store.schema().quoted();
    let fill = format!(
        "INSERT INTO {s}.finished_tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, \
         claimed_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at, good_until, retry, key, error, \
         result, finished_at)
         SELECT g, 'report', 'default', 0, jsonb_build_object('n', g), 'COMPLETED', 1, 'w', 1, now(), now(), now(), \
                1, 0, now(), now(), NULL, '{{}}', NULL, NULL, 'true', now()
         FROM generate_series(1, $1) AS g"
    );
    sqlx::query(AssertSqlSafe(fill)).bind(FINISHED).execute(store.pool()).await.unwrap();
    let bump = format!("SELECT setval('{s}.task_id_seq', $1)");
    sqlx::query(AssertSqlSafe(bump)).bind(FINISHED).execute(store.pool()).await.unwrap();
    let started = Instant::now();
    let tasks = (0..PENDING).map(|i| NewTask::new("report", json!({"n": i})).priority((i % 3) as i16)).collect();
    store.enqueue_many(tasks).await.unwrap();
    eprintln!("enqueue_many of {PENDING} tasks in one statement: {:?}", started.elapsed());
    for table in ["tasks", "finished_tasks"] {
        sqlx::raw_sql(AssertSqlSafe(format!("ANALYZE {s}.{table}"))).execute(store.pool()).await.unwrap();
    }
}

/// Every node of a JSON plan, depth first.
fn nodes(plan: &Value) -> Vec<&Value> {
    let mut out = vec![plan];
    if let Some(children) = plan.get("Plans").and_then(Value::as_array) {
        for child in children {
            out.extend(nodes(child));
        }
    }
    out
}

fn check_plan(explained: &Value, what: &str) {
    let root = &explained[0]["Plan"];
    let all = nodes(root);
    let seq: Vec<_> = all.iter().filter(|n| n["Node Type"] == "Seq Scan").collect();
    assert!(seq.is_empty(), "{what}: sequential scan in {explained:#}");
    let uses_index = all.iter().any(|n| {
        matches!(n["Node Type"].as_str(), Some("Index Scan" | "Index Only Scan"))
            && n["Index Name"] == "tasks_claim_idx"
    });
    assert!(uses_index, "{what}: no scan of tasks_claim_idx in {explained:#}");
}

#[tokio::test]
async fn the_claim_uses_its_index_with_a_long_history() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    history(&store).await;
    let s = store.schema().quoted();

    // The candidate query of `claim` (migrations/0001_schema.sql, CTE `pend`).
    let candidates = format!(
        "SELECT t.id, t.priority, t.run_at FROM {s}.tasks t
         WHERE hashtext(t.queue) = hashtext($1) AND t.queue = $1 AND t.state = 'PENDING'
           AND t.run_at <= {s}.db_now()
           AND (t.good_until IS NULL OR t.good_until > {s}.db_now()) AND t.id <> ALL ($2::bigint[])
         ORDER BY t.priority, t.run_at, t.id
         LIMIT $3
         FOR UPDATE SKIP LOCKED"
    );
    let mut conn = store.pool().acquire().await.unwrap();
    for (mode, limit) in [("force_custom_plan", 16), ("force_custom_plan", 500), ("force_generic_plan", 16)] {
        sqlx::raw_sql(AssertSqlSafe(format!("SET plan_cache_mode = {mode}"))).execute(&mut *conn).await.unwrap();
        let explain = format!("EXPLAIN (FORMAT JSON) {candidates}");
        let plan: Value = sqlx::query_scalar(AssertSqlSafe(explain))
            .bind("default")
            .bind(Vec::<i64>::new())
            .bind(limit)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        check_plan(&plan, &format!("{mode}, limit {limit}"));
    }
    // The lookup of held rows that finish, record-starts, release and `start_tasks` share, with
    // a generic plan (sqlx reuses its prepared statements; PostgreSQL plans them generically
    // after five runs): the primary key finds the rows. Scanning the in-flight index instead
    // tests each row against the id array element by element, quadratic in the batch.
    let held = format!(
        "SELECT t.id FROM {s}.tasks t
         WHERE t.id = ANY ($2::bigint[]) AND t.state <> 'PENDING' AND t.claimed_by = $1
         ORDER BY t.id
         FOR UPDATE"
    );
    let explain = format!("EXPLAIN (FORMAT JSON) {held}");
    let plan: Value =
        sqlx::query_scalar(AssertSqlSafe(explain)).bind("w").bind(vec![1_i64, 2]).fetch_one(&mut *conn).await.unwrap();
    let scans: Vec<_> = nodes(&plan[0]["Plan"]).into_iter().filter_map(|n| n["Index Name"].as_str()).collect();
    assert_eq!(scans, ["tasks_pkey"], "held rows: {plan:#}");
    sqlx::raw_sql("RESET plan_cache_mode").execute(&mut *conn).await.unwrap();

    // The real function, ten passes in one transaction (its plans are generic, as
    // `force_generic_plan` makes them): its table statistics show index scans only.
    let mut tx = conn.begin().await.unwrap();
    let claim = pg::claim_call(store.schema(), true);
    for _ in 0..10 {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(claim.clone())).fetch_one(&mut *tx).await.unwrap();
        assert_eq!(n, 16);
    }
    let stats = format!(
        "SELECT (SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = '{s}.tasks'::regclass),
                pg_stat_get_xact_numscans('{s}.tasks_claim_idx'::regclass)"
    );
    let (seq_scans, index_scans): (i64, i64) = sqlx::query_as(AssertSqlSafe(stats)).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(seq_scans, 0, "the claim scanned the tasks table");
    assert!(index_scans >= 10, "the claim did not use tasks_claim_idx ({index_scans} scans)");
    tx.rollback().await.unwrap();
    drop(conn);

    latency(&store).await;
}

/// The claim's plans are generic (`force_generic_plan`), made at a connection's first claim
/// (each statement's at its first run) and kept until the table's statistics change. A
/// worker's first claim often meets an empty table; plans made then must still walk indexes
/// once the table fills, even where no vacuum or analyze comes to replace them (they once
/// updated the claimed rows by a sequential scan: over 1,000 one-task claims from an empty
/// table, the median claim took 1.3 times as long).
#[tokio::test]
async fn claim_plans_made_on_an_empty_table_still_use_indexes_once_it_fills() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let s = store.schema().quoted();
    let mut conn = store.pool().acquire().await.unwrap();
    let claim = pg::claim_call(store.schema(), false);
    // One task, so that every statement of the claim runs (and is planned) on a tiny table.
    store.enqueue(NewTask::new("report", json!({"n": -1}))).await.unwrap();
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(claim.clone())).fetch_one(&mut *conn).await.unwrap();
    assert_eq!(n, 1);
    let tasks = (0..5_000).map(|i| NewTask::new("report", json!({"n": i}))).collect();
    store.enqueue_many(tasks).await.unwrap();

    let mut tx = conn.begin().await.unwrap();
    for _ in 0..3 {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(claim.clone())).fetch_one(&mut *tx).await.unwrap();
        assert_eq!(n, 16);
    }
    let stats = format!("SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = '{s}.tasks'::regclass");
    let seq_scans: i64 = sqlx::query_scalar(AssertSqlSafe(stats)).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(seq_scans, 0, "a claim planned on an empty table scanned the tasks table once it filled");
    tx.rollback().await.unwrap();
}

/// Claim-and-start passes of 16 and finishes of 16, timed one statement at a time.
async fn latency(store: &PgStore) {
    let config = WorkerConfig { concurrency: 16, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let worker = WorkerId("bench".into());
    let (mut claims, mut finishes) = (Vec::new(), Vec::new());
    for token in 0..100 {
        let request = DbRequest::Claim {
            worker: worker.clone(),
            token,
            policy: Arc::clone(&policy),
            my_running: 0,
            my_claimed: 0,
            start_now: 16,
            lease_ms: 60_000,
        };
        let started = Instant::now();
        let DbReply::Claimed { tasks, .. } = store.execute(&request).await.unwrap() else { panic!() };
        claims.push(started.elapsed());
        assert_eq!(tasks.len(), 16);
        let completions = tasks
            .iter()
            .map(|t| Completion {
                task: TaskLease { task: t.id, lease: t.lease },
                outcome: FinishOutcome::Completed(json!({"ok": t.id.0})),
                args: None,
            })
            .collect();
        let started = Instant::now();
        store.execute(&DbRequest::Finish { worker: worker.clone(), completions }).await.unwrap();
        finishes.push(started.elapsed());
    }
    eprintln!("claim+start of 16 (10k pending, 100k finished): {}", summary(&mut claims));
    eprintln!("finish of 16: {}", summary(&mut finishes));
}

fn summary(times: &mut [Duration]) -> String {
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    format!("p50 {:?}, p99 {:?}", at(0.5), at(0.99))
}

/// Index entries of `tasks_pkey` read so far, once every session that read them has ended
/// (a backend reports its counts when it exits; the caller closes its pools first).
async fn pkey_entries_read(db: &TestDb, since: Option<i64>) -> i64 {
    entries_read(db, "tasks_pkey", since).await
}

/// What `sql` reads of the statistics of the test's schema (`$1` the schema, `$2` the table or
/// index `object`) once two reads a moment apart agree and `ready` takes it: a backend reports
/// its counts when it exits (the caller closes its pools first), a moment later.
async fn settled<T>(db: &TestDb, sql: &'static str, object: &str, ready: impl Fn(&T) -> bool) -> T
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + PartialEq + Send + Unpin,
{
    let pool = db.pool(1).await;
    let mut last = None;
    for _ in 0..100 {
        let read: T = sqlx::query_as(sql).bind(db.schema.name()).bind(object).fetch_one(&pool).await.unwrap();
        if last.as_ref() == Some(&read) && ready(&read) {
            pool.close().await;
            return read;
        }
        last = Some(read);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("the statistics of {object} never settled");
}

/// The entries of index `index` of the test's schema that index scans have read (after a
/// finish, a count other than `since`).
async fn entries_read(db: &TestDb, index: &str, since: Option<i64>) -> i64 {
    let sql = "SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes \
               WHERE schemaname = $1 AND indexrelname = $2";
    let (read,): (i64,) = settled(db, sql, index, |&(read,): &(i64,)| since.is_none_or(|s| read != s)).await;
    read
}

/// While a snapshot holds the xmin, every task finished leaves its dead entry in the primary
/// key, and a vacuum then leaves statistics of a few live rows. The writes that name held
/// rows (start, heartbeat, release, finish) must look them up by id, not walk the whole key:
/// joined with their CTEs, the planner walked it for each statement.
#[tokio::test]
async fn writes_to_held_rows_read_only_their_own_key_entries_under_a_held_xmin() {
    const DEAD: usize = 5_000;
    let db = TestDb::new().await;
    let s = db.schema.quoted();
    let mut holder = db.pool(1).await.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").execute(&mut holder).await.unwrap();

    let store = db.store(AppConfig::default(), 2).await;
    let config = WorkerConfig { concurrency: 1_000, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let tasks = (0..DEAD).map(|i| NewTask::new("report", json!({"n": i}))).collect();
    store.enqueue_many(tasks).await.unwrap();
    let worker = WorkerId("w".into());
    for token in 0.. {
        let DbReply::Claimed { tasks, .. } = store.execute(&pg::claim_by_w(token, &policy, 1_000)).await.unwrap()
        else {
            panic!()
        };
        if tasks.is_empty() {
            break;
        }
        store.execute(&DbRequest::Finish { worker: worker.clone(), completions: completed(&tasks) }).await.unwrap();
    }
    // What the worker's own vacuum does under the hold: nothing removed, statistics of the
    // live rows (none).
    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM {s}.tasks"))).execute(store.pool()).await.unwrap();
    let tasks = (0..16).map(|i| NewTask::new("report", json!({"n": i}))).collect();
    store.enqueue_many(tasks).await.unwrap();
    let DbReply::Claimed { tasks, .. } = store.execute(&pg::claim_by_w(1_000_000, &policy, 0)).await.unwrap() else {
        panic!()
    };
    assert_eq!(tasks.len(), 16);
    store.pool().close().await;
    let before = pkey_entries_read(&db, None).await;

    let store = db.store(AppConfig::default(), 1).await;
    let leases: Vec<_> = tasks.iter().map(|t| TaskLease { task: t.id, lease: t.lease }).collect();
    let beat = DbRequest::Heartbeat {
        worker: worker.clone(),
        claimed: leases.clone(),
        running: Vec::new(),
        lease_ms: 60_000,
        max_renew_age_ms: 180_000,
        abandoned: Vec::new(),
    };
    store.execute(&beat).await.unwrap();
    store.execute(&DbRequest::RecordStarts { worker: worker.clone(), tasks: leases[..8].to_vec() }).await.unwrap();
    let beat = DbRequest::Heartbeat {
        worker: worker.clone(),
        claimed: leases[8..].to_vec(),
        running: leases[..8].to_vec(),
        lease_ms: 60_000,
        max_renew_age_ms: 180_000,
        abandoned: Vec::new(),
    };
    store.execute(&beat).await.unwrap();
    store.execute(&DbRequest::Release { worker: worker.clone(), tasks: leases[12..].to_vec() }).await.unwrap();
    let reply = store
        .execute(&DbRequest::Finish { worker: worker.clone(), completions: completed(&tasks[..12]) })
        .await
        .unwrap();
    let DbReply::Finished { applied, lost } = reply else { panic!("{reply:?}") };
    assert_eq!((applied.len(), lost.len()), (12, 0), "{applied:?} {lost:?}");
    store.pool().close().await;
    let read = pkey_entries_read(&db, Some(before)).await - before;
    eprintln!("start, two heartbeats, release and finish of 16 tasks read {read} entries of tasks_pkey");
    // Each of five statements looks up at most 16 rows (a few entries each: live and dead
    // versions); walking the key reads its 5,000 dead entries.
    assert!(read < 1_000, "the writes read {read} entries of tasks_pkey");
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await.unwrap();
}

/// Every task of `tasks` completed.
fn completed(tasks: &[canter::store::ClaimedTask]) -> Vec<Completion> {
    finished(tasks, &FinishOutcome::Completed(json!(null)))
}

/// Each of `tasks` finished with `outcome`.
fn finished(tasks: &[canter::store::ClaimedTask], outcome: &FinishOutcome) -> Vec<Completion> {
    tasks
        .iter()
        .map(|t| Completion { task: TaskLease { task: t.id, lease: t.lease }, outcome: outcome.clone(), args: None })
        .collect()
}

/// Claims what `policy` lets it (up to 1,000 tasks) as worker `w` (claim `token`) and finishes
/// it all with `outcome`: the ids.
async fn claim_and_finish(
    store: &PgStore,
    policy: &Arc<ClaimPolicy>,
    token: u64,
    outcome: FinishOutcome,
) -> Vec<canter::task::TaskId> {
    let DbReply::Claimed { tasks, .. } = store.execute(&pg::claim_by_w(token, policy, 1_000)).await.unwrap() else {
        panic!()
    };
    if tasks.is_empty() {
        return Vec::new();
    }
    let finish = DbRequest::Finish { worker: WorkerId("w".into()), completions: finished(&tasks, &outcome) };
    let reply = store.execute(&finish).await.unwrap();
    let DbReply::Finished { applied, lost } = reply else { panic!("{reply:?}") };
    assert_eq!((applied.len(), lost.len()), (tasks.len(), 0));
    tasks.iter().map(|t| t.id).collect()
}

/// Claims up to 1,000 tasks as worker `w` (claim `token`) and completes them: how many.
async fn claim_and_complete(store: &PgStore, policy: &Arc<ClaimPolicy>, token: u64) -> usize {
    claim_and_finish(store, policy, token, FinishOutcome::Completed(json!(null))).await.len()
}

/// A workflow of a root and `children` steps that need it.
fn fan_out(children: usize) -> NewWorkflow {
    let mut workflow = NewWorkflow::new("fan-out");
    let root = workflow.step(NewTask::new("report", json!({"n": -1})), Join::All);
    for i in 0..children {
        let child = workflow.step(NewTask::new("report", json!({ "n": i })), Join::All);
        workflow.edge(root, child, EdgePolicy::RequireSuccess);
    }
    workflow
}

/// The finish of a step settles its children in the same statement: it must read the
/// finished steps' own edges, never walk the edges' index. Merged with a batch of finished
/// steps, the planner walked it from its start to the batch's highest id: every finish of a
/// fan-out's children read all of the root's edges.
#[tokio::test]
async fn settling_a_finish_reads_only_the_finished_steps_own_edges() {
    const CHILDREN: usize = 5_000;
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    store.submit_workflow(&fan_out(CHILDREN)).await.unwrap();
    let config = WorkerConfig { concurrency: 1_000, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    // The root: its finish reads its edges and promotes the children.
    assert_eq!(claim_and_complete(&store, &policy, 0).await, 1);
    let mut finished = 0;
    for token in 1.. {
        match claim_and_complete(&store, &policy, token).await {
            0 => break,
            n => finished += n,
        }
    }
    assert_eq!(finished, CHILDREN);
    store.pool().close().await;
    let read = entries_read(&db, "workflow_edges_pkey", Some(0)).await;
    eprintln!("the finishes of a root and its {CHILDREN} children read {read} entries of workflow_edges_pkey");
    // The root's finish reads its 5,000 edges, the children have none: a walk of the index
    // reads the root's again for each finish of a batch of children.
    assert!(read < 2 * CHILDREN as i64, "the finishes read {read} entries of the edges' index");
}

/// A finish settles the child of a `sole` edge straight from the edge, without counting its
/// join (schema 17): an edge must be `sole` exactly when its child has that one parent and
/// needs it. Marked on a child of several parents, the child would run after its first parent.
#[tokio::test]
async fn only_a_child_of_one_needed_parent_has_a_sole_edge() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let mut workflow = NewWorkflow::new("shapes");
    let task = |n: i32| NewTask::new("report", json!({ "n": n }));
    let root = workflow.step(task(0), Join::All);
    let other = workflow.step(task(1), Join::All);
    let all = workflow.step(task(2), Join::All);
    let any = workflow.step(task(3), Join::Any);
    let one = workflow.step(task(4), Join::Quorum(1));
    let recovery = workflow.step(task(5), Join::All);
    let both = workflow.step(task(6), Join::All);
    let either = workflow.step(task(7), Join::Any);
    let one_of_two = workflow.step(task(8), Join::Quorum(1));
    for child in [all, any, one] {
        workflow.edge(root, child, EdgePolicy::RequireSuccess);
    }
    workflow.edge(root, recovery, EdgePolicy::AllowFailed);
    for child in [both, either, one_of_two] {
        workflow.edge(root, child, EdgePolicy::RequireSuccess);
        workflow.edge(other, child, EdgePolicy::RequireSuccess);
    }
    store.submit_workflow(&workflow).await.unwrap();
    let pool = db.pool(1).await;
    let sql = format!(
        "SELECT s.step, bool_and(e.sole) FROM {schema}.workflow_edges e \
         JOIN {schema}.workflow_steps s ON s.task_id = e.child GROUP BY s.step ORDER BY s.step",
        schema = db.schema.quoted()
    );
    let sole: Vec<(i32, bool)> = sqlx::query_as(AssertSqlSafe(sql)).fetch_all(&pool).await.unwrap();
    let expected = [(2, true), (3, true), (4, true), (5, true), (6, false), (7, false), (8, false)];
    assert_eq!(sole, expected, "(step, its edges sole)");
}

/// Updates of table `table` of the test's schema, and how many of them were HOT (the new
/// version on the old one's page, no new index entries), once there are `at_least`.
async fn updates(db: &TestDb, table: &str, at_least: i64) -> (i64, i64) {
    let sql = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2";
    settled(db, sql, table, |read: &(i64, i64)| read.0 >= at_least).await
}

/// A step of several parents takes their outcomes one finish at a time, each rewriting its
/// counts in `workflow_steps`. Submitted together, steps fill their pages: each rewrite was a
/// new version on another page, with new entries in both the table's indexes. The table keeps
/// room on its pages (schema 16), so each is a HOT update.
#[tokio::test]
async fn a_steps_counts_change_in_place() {
    const DIAMONDS: usize = 200;
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    for _ in 0..DIAMONDS {
        let mut workflow = NewWorkflow::new("diamond");
        let top = workflow.step(NewTask::new("report", json!("top")), Join::All);
        // The left branches are claimed before the right ones: the join counts them apart.
        let left = workflow.step(NewTask::new("report", json!("left")), Join::All);
        let right = workflow.step(NewTask::new("report", json!("right")).priority(1), Join::All);
        let join = workflow.step(NewTask::new("report", json!("join")), Join::All);
        for (parent, child) in [(top, left), (top, right), (left, join), (right, join)] {
            workflow.edge(parent, child, EdgePolicy::RequireSuccess);
        }
        store.submit_workflow(&workflow).await.unwrap();
    }
    let config = WorkerConfig { concurrency: DIAMONDS as u32, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    // The tops, the left branches (each join counts one parent), the right ones (each join is
    // promoted), the joins.
    for token in 0..4 {
        assert_eq!(claim_and_complete(&store, &policy, token).await, DIAMONDS);
    }
    assert_eq!(claim_and_complete(&store, &policy, 4).await, 0);
    store.pool().close().await;
    let (updated, hot) = updates(&db, "workflow_steps", DIAMONDS as i64).await;
    eprintln!("{updated} updates of workflow_steps, {hot} of them HOT");
    assert_eq!(updated, DIAMONDS as i64, "one count update per join");
    assert_eq!(hot, updated, "every count update stays on its page");
}

/// A fan-out's children are claimed straight from WAITING once their parent completed (schema
/// 18): the completion opens one gate row per queue instead of writing a Pending version of
/// each child, and the claim that takes the gate's last rows deletes it. A parent of fewer
/// than 8 such children (the default of `canter.gate_min_children`) promotes them as before.
#[tokio::test]
async fn a_wide_fan_outs_children_wait_behind_a_gate_the_claim_opens() {
    const CHILDREN: usize = 100;
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let mut workflow = NewWorkflow::new("fan-outs");
    let task = |n: i32| NewTask::new("report", json!({ "n": n }));
    let wide = workflow.step(task(-1), Join::All);
    let narrow = workflow.step(task(-2), Join::All);
    for i in 0..CHILDREN {
        let child = workflow.step(task(i as i32), Join::All);
        workflow.edge(wide, child, EdgePolicy::RequireSuccess);
    }
    for i in 0..3 {
        let child = workflow.step(task(1_000 + i), Join::All);
        workflow.edge(narrow, child, EdgePolicy::RequireSuccess);
    }
    let ids = store.submit_workflow(&workflow).await.unwrap().tasks;
    let pool = db.pool(1).await;
    let schema = db.schema.quoted();
    let by_state = format!(
        "SELECT t.state, t.gate IS NOT NULL AS gated, count(*) FROM {schema}.tasks t \
         WHERE t.id <> ALL ($1) GROUP BY 1, 2 ORDER BY 1, 2"
    );
    let roots = vec![ids[0].0, ids[1].0];
    let states = |pool| {
        let sql = by_state.clone();
        let roots = roots.clone();
        async move {
            sqlx::query_as::<_, (String, bool, i64)>(AssertSqlSafe(sql)).bind(roots).fetch_all(pool).await.unwrap()
        }
    };
    assert_eq!(
        states(&pool).await,
        [("WAITING".to_owned(), false, 3), ("WAITING".to_owned(), true, CHILDREN as i64)],
        "(state, gated, rows) of the children at submit"
    );
    let config = WorkerConfig { concurrency: 1_000, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    assert_eq!(claim_and_complete(&store, &policy, 0).await, 2, "the two roots");
    // The wide root's children are not written: they wait behind its open gate.
    assert_eq!(
        states(&pool).await,
        [("PENDING".to_owned(), false, 3), ("WAITING".to_owned(), true, CHILDREN as i64)],
        "(state, gated, rows) of the children once their parents completed"
    );
    let seen = format!("SELECT t.state, count(*) FROM {schema}.seen_tasks t GROUP BY 1");
    let seen: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(seen)).fetch_all(&pool).await.unwrap();
    assert_eq!(seen, [("PENDING".to_owned(), CHILDREN as i64 + 3)], "what readers see");
    let gates = format!("SELECT count(*) FILTER (WHERE opened_at IS NOT NULL), count(*) FROM {schema}.task_gates");
    let open: (i64, i64) = sqlx::query_as(AssertSqlSafe(gates.clone())).fetch_one(&pool).await.unwrap();
    assert_eq!(open, (1, 1), "(open gates, gates)");
    assert_eq!(claim_and_complete(&store, &policy, 1).await, CHILDREN + 3);
    let open: (i64, i64) = sqlx::query_as(AssertSqlSafe(gates)).fetch_one(&pool).await.unwrap();
    assert_eq!(open, (0, 0), "the claim that emptied the gate deleted it");
    assert_eq!(claim_and_complete(&store, &policy, 2).await, 0);
}

/// A gated step cancelled alone before its parent finished, then put back by a retry of its
/// workflow, waits behind its parent's gate again. Found in review: the retry wrote it back
/// without its gate, and the parent's completion, which opens the gate and so promotes none
/// of its gated children one by one, left it WAITING for good.
#[tokio::test]
async fn a_gated_step_cancelled_and_retried_before_its_parent_completes_still_runs() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let submitted = store.submit_workflow(&fan_out(8)).await.unwrap();
    store.admin(&canter::store::AdminRequest::Cancel { task: submitted.tasks[1] }).await.unwrap();
    store.retry_workflow(submitted.workflow, false).await.unwrap();
    let config = WorkerConfig { concurrency: 100, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    assert_eq!(claim_and_complete(&store, &policy, 0).await, 1, "the root");
    assert_eq!(claim_and_complete(&store, &policy, 1).await, 8, "every child, the retried one too");
    assert_eq!(claim_and_complete(&store, &policy, 2).await, 0);
}

/// A retry downstream of a step whose gate opened leaves the gate's unclaimed children Pending,
/// as their promotion did before gates (and as the memory store does): the step, reset and
/// failing again, no longer skips them. Found in review: they waited behind the open gate, so
/// the rerun's failure skipped them.
#[tokio::test]
async fn a_retry_downstream_of_an_opened_gate_leaves_its_children_pending() {
    let db = TestDb::new().await;
    let store = db.store(AppConfig::default(), 2).await;
    let mut workflow = NewWorkflow::new("recovery fan-out");
    // More urgent than the children, so that one-task claims take them first.
    let failing = workflow.step(NewTask::new("report", json!("failing")).priority(-1), Join::All);
    let recovery = workflow.step(NewTask::new("report", json!("recovery")).priority(-1), Join::All);
    workflow.edge(failing, recovery, EdgePolicy::AllowFailed);
    for i in 0..8 {
        let child = workflow.step(NewTask::new("report", json!(i)), Join::All);
        workflow.edge(recovery, child, EdgePolicy::RequireSuccess);
    }
    let submitted = store.submit_workflow(&workflow).await.unwrap();
    let config = WorkerConfig { concurrency: 100, max_claim_batch: 1, ..WorkerConfig::default() };
    let one = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let config = WorkerConfig { concurrency: 100, ..WorkerConfig::default() };
    let all = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let failed = || FinishOutcome::Failed(canter::task::TaskError::new(canter::task::ErrorCode::TaskError, "no"));
    let done = || FinishOutcome::Completed(json!(null));
    assert_eq!(claim_and_finish(&store, &one, 0, failed()).await, [submitted.tasks[0]]);
    // The recovery step completes: its children's gate opens; none of them is claimed yet.
    assert_eq!(claim_and_finish(&store, &one, 1, done()).await, [submitted.tasks[1]]);
    store.retry_workflow(submitted.workflow, true).await.unwrap();
    // The failing step fails again, then the recovery step: its children were Pending already.
    assert_eq!(claim_and_finish(&store, &one, 2, failed()).await, [submitted.tasks[0]]);
    assert_eq!(claim_and_finish(&store, &one, 3, failed()).await, [submitted.tasks[1]]);
    assert_eq!(claim_and_finish(&store, &all, 4, done()).await.len(), 8, "the children run");
}

/// A retry that writes a step back behind its parent's shut gate holds the gate's row until it
/// commits: the parent's completion waits to open it. Found in review: the completion opened
/// it at once, a claim emptied it of the rows it could see (the retried row was not visible
/// yet) and deleted it, and the retried step was left WAITING behind a gate that was gone.
#[tokio::test]
async fn a_gate_a_retry_rejoins_outlives_a_claim_that_empties_it_meanwhile() {
    let db = TestDb::new().await;
    let store = Arc::new(db.store(AppConfig::default(), 3).await);
    let submitted = store.submit_workflow(&fan_out(8)).await.unwrap();
    store.admin(&canter::store::AdminRequest::Cancel { task: submitted.tasks[1] }).await.unwrap();
    let config = WorkerConfig { concurrency: 100, ..WorkerConfig::default() };
    let policy = Arc::new(ClaimPolicy::from_config(store.app(), &config));
    let DbReply::Claimed { tasks: roots, .. } = store.execute(&pg::claim_by_w(0, &policy, 1)).await.unwrap() else {
        panic!()
    };
    assert_eq!(roots.len(), 1, "the root");
    // The retry writes the cancelled step back behind the root's shut gate, and stays open.
    let mut retrying = db.pool(1).await.acquire().await.unwrap().detach();
    sqlx::raw_sql("BEGIN").execute(&mut retrying).await.unwrap();
    let retry = format!("SELECT known FROM {}.workflow_retry($1, false)", db.schema.quoted());
    let known: bool =
        sqlx::query_scalar(AssertSqlSafe(retry)).bind(submitted.workflow.0).fetch_one(&mut retrying).await.unwrap();
    assert!(known);
    // The root completes meanwhile (it waits for the retry to open the gate), and a claim takes
    // what it can see.
    let finishing = {
        let store = Arc::clone(&store);
        let finish = DbRequest::Finish { worker: WorkerId("w".into()), completions: completed(&roots) };
        tokio::spawn(async move { store.execute(&finish).await.unwrap() })
    };
    // Until the finish waits on the retry's lock (its statement names this test's schema).
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND position($1 in query) > 0";
    let observer = db.pool(1).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let n: i64 = sqlx::query_scalar(waiting).bind(db.schema.quoted()).fetch_one(&observer).await.unwrap();
        if n > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the root's finish never waited for the retry");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut claimed = claim_and_complete(&store, &policy, 1).await;
    sqlx::raw_sql("COMMIT").execute(&mut retrying).await.unwrap();
    finishing.await.unwrap();
    for token in 2..5 {
        claimed += claim_and_complete(&store, &policy, token).await;
    }
    assert_eq!(claimed, 8, "every child ran, the retried one too");
}
