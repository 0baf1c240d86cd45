//! The SQL text of the store's statements, with the schema filled in once per [`PgSchema`].
//!
//! Batches travel as parallel arrays expanded with `unnest(...) WITH ORDINALITY`, so a batch of
//! any size is one prepared statement. Every write about a held task names its lease and the
//! state it expects, and locks the rows it decides on (`FOR UPDATE`, in id order, so two
//! statements of one worker cannot deadlock) before deciding: a concurrent writer (another
//! worker, the reaper) either went first and the row no longer matches, or waits.
//!
//! Heartbeats lock with `SKIP LOCKED` and report the rows they skipped as `busy` (still held,
//! not renewed this time): a row another transaction keeps locked (an application's, an
//! operator's) never holds up the beat of the others. The other statements wait for locks,
//! bounded by the session's `lock_timeout` (a finish that gives up is split by the worker
//! until the row it waits for is alone). A claim's `SKIP LOCKED` scan can hold a row it
//! looked at and passed over until it commits, so statements meet short waits routinely:
//! skipping instead of waiting is for statements that can do without the row.
//!
//! Held rows are found by `t.id = ANY ($ids)` on the primary key with `t.state <> 'PENDING'`
//! (the same rows as `IN ('CLAIMED', 'RUNNING')` under the state check), a condition the
//! in-flight index cannot serve: otherwise a generic plan (sqlx reuses prepared statements, and
//! PostgreSQL switches to a generic plan after five runs) scans that index and tests each row
//! against the id array one element at a time, quadratic in the batch.
//!
//! Notifications are sent from the same statement: a `notified` CTE that the final SELECT
//! cross-joins, so it runs whenever there is something to announce.
//!
//! [`PgSchema`]: crate::postgres::PgSchema

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// The columns of `finished_tasks`, in the order the moves below fill them.
const FINISHED_COLUMNS: &str = "id, name, queue, priority, args, state, lease, claimed_by, claim_token, claimed_at, \
     heartbeat_at, started_at, attempts, retries, run_at, enqueued_at, good_until, retry, key, flags, error, result, \
     finished_at";

/// The columns of a moved live row `m` that `finished_tasks` keeps as they are, in order
/// after `state`.
const KEPT: &str = "m.lease, m.claimed_by, m.claim_token, m.claimed_at, m.heartbeat_at, m.started_at, m.attempts, \
     m.retries, m.run_at, m.enqueued_at, m.good_until, m.retry, m.key, m.flags";

/// The ids of the rows of CTE `{rows}` as comma-separated lists of at most 300 (one
/// notification payload each: PostgreSQL caps a payload at 8,000 bytes).
const ID_CHUNKS: &str = "\
SELECT string_agg(r.id::text, ',') AS ids
FROM (SELECT r.id, (row_number() OVER () - 1) / 300 AS chunk FROM {rows} r) r
GROUP BY r.chunk";

/// Clears the holder of a row going back to Pending.
const UNCLAIM: &str =
    "state = 'PENDING', claimed_by = NULL, claim_token = NULL, claim_expires_at = NULL, heartbeat_at = NULL";

/// Gives back the attempt a claim counted when it started a row (`t`, as it was) whose
/// worker never saw the claim: an undone claim ran nothing.
const UNSTART: &str = "attempts = t.attempts - CASE WHEN t.state = 'RUNNING' THEN 1 ELSE 0 END, \
     started_at = CASE WHEN t.state = 'RUNNING' AND t.attempts <= 1 THEN NULL ELSE t.started_at END";

const CLAIM: &str = "\
SELECT id, lease, name, queue, args, priority, started, attempt, retries, retry, expires, more, next_run_in_ms,
       enqueued_at_ms, run_at_ms
FROM {s}.claim_tasks($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)";

const START: &str = "\
SELECT ord, id, outcome, attempt FROM {s}.start_tasks($1, $2, $3, $4, $5, $6, $7, $8)";

/// The finish (see [`FINISH`]) up to its answer: every CTE, the writes included.
const FINISH_WITH: &str = "\
WITH input AS (
    SELECT i.id, i.lease, i.kind, i.result, i.error, i.delay_ms, i.args, i.ord
    FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::jsonb[], $6::jsonb[], $7::bigint[], $10::jsonb[])
         WITH ORDINALITY AS i(id, lease, kind, result, error, delay_ms, args, ord)
),
-- Running, or Claimed by a worker that started it without a start request (the run counts
-- as an attempt here). The lock also keeps this CTE materialized: inlined into `chosen`'s
-- join, its plan took a drain from 30,000 to 3,500 tasks/s.
held AS (
    SELECT t.id, t.lease, t.good_until, t.state, t.attempts, t.started_at, t.name, t.queue, t.priority,
           t.args AS held_args, t.claimed_by, t.claim_token, t.claimed_at, t.heartbeat_at, t.retries,
           t.run_at AS held_run_at, t.enqueued_at, t.retry, t.key, t.flags
    FROM {s}.tasks t
    WHERE t.id = ANY ($2::bigint[]) AND t.state <> 'PENDING' AND t.claimed_by = $1
    ORDER BY t.id
    FOR UPDATE
),
-- Each held row with what its run came to. The writes below name rows by `t.id = ANY (ARRAY(
-- SELECT ... FROM chosen))` and take the rest from here, never joining `tasks` with a CTE:
-- with statistics of a few live rows (an empty queue's, or a vacuum's under a held xmin)
-- the planner walks the whole primary key for such a join, dead entries and all.
chosen AS (
    SELECT DISTINCT ON (i.id) i.id, i.ord, i.result, i.error, i.args, h.lease, h.good_until, h.name, h.queue,
           h.priority, h.held_args, h.claimed_by, h.claim_token, h.claimed_at, h.heartbeat_at, h.retries,
           h.held_run_at, h.enqueued_at, h.retry, h.key, h.flags,
           h.attempts + CASE WHEN h.state = 'CLAIMED' THEN 1 ELSE 0 END AS attempts,
           CASE WHEN h.state = 'CLAIMED' THEN {s}.db_now() ELSE h.started_at END AS started_at,
           {s}.db_now() + i.delay_ms * interval '1 millisecond' AS run_at,
           CASE WHEN i.kind = 'completed' THEN 'COMPLETED'
                WHEN i.kind = 'retry'
                     AND (h.good_until IS NULL OR {s}.db_now() + i.delay_ms * interval '1 millisecond' < h.good_until)
                    THEN 'PENDING'
                ELSE 'FAILED' END AS state
    FROM input i JOIN held h ON h.id = i.id AND h.lease = i.lease
    ORDER BY i.id, i.ord
),
moved AS (
    DELETE FROM {s}.tasks t
    WHERE t.id = ANY (ARRAY(SELECT c.id FROM chosen c WHERE c.state <> 'PENDING'))
    RETURNING t.id
),
-- The rows `held` locked, so the ones `moved` deletes, as they were.
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT c.id, c.name, c.queue, c.priority,
           CASE WHEN c.state = 'COMPLETED' THEN c.held_args ELSE coalesce(c.args, c.held_args) END,
           c.state, c.lease, c.claimed_by, c.claim_token, c.claimed_at,
           c.heartbeat_at, c.started_at, c.attempts, c.retries, c.held_run_at, c.enqueued_at, c.good_until, c.retry,
           c.key, c.flags,
           CASE WHEN c.state = 'COMPLETED' THEN NULL ELSE c.error END,
           CASE WHEN c.state = 'COMPLETED' THEN c.result END,
           {s}.db_now()
    FROM chosen c WHERE c.state <> 'PENDING'
),
-- Takes its values from `chosen`, so it joins; a finish without retries (nearly all) does
-- not run the join at all.
retried AS (
    UPDATE {s}.tasks t SET {unclaim}, retries = t.retries + 1, run_at = c.run_at, error = c.error,
        attempts = c.attempts, started_at = c.started_at, args = coalesce(c.args, t.args)
    FROM chosen c
    WHERE t.id = c.id AND c.state = 'PENDING' AND EXISTS (SELECT FROM chosen r WHERE r.state = 'PENDING')
    RETURNING t.queue
),
-- Only a run the task outlives gets an attempts row; a terminal task's last run is its
-- finished row (see ATTEMPTS).
history AS (
    INSERT INTO {s}.attempts (task_id, attempt, worker, outcome, error, finished_at)
    SELECT c.id, c.attempts, $1, c.state, c.error, {s}.db_now()
    FROM chosen c WHERE c.state = 'PENDING'
),
notified AS (
    SELECT count(pg_notify($8, n.ids)) AS n FROM ({id_chunks_of_moved}) n WHERE {heard:$8}
),
-- A retry is work that becomes ready later: listeners claim and learn when (the wake-up hint).
ready AS (
    SELECT count(pg_notify($9 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM retried r) q
)";

/// The finish's answer, in input order: each task with its new state (NULL: not held). Reading
/// `notified` and `ready` makes the statement run the moves and retries before it answers.
const FINISH_ANSWER: &str = "\
SELECT i.ord, i.id, c.state FROM input i LEFT JOIN chosen c ON c.id = i.id AND c.ord = i.ord CROSS JOIN notified
CROSS JOIN ready";

/// Records finished runs ([`DbRequest::Finish`](crate::store::DbRequest::Finish)).
const FINISH: &str = "{finish_with}\n{finish_answer}\nORDER BY i.ord";

/// A finish and then a claim in one statement ([`DbRequest::FinishAndClaim`](crate::store::DbRequest::FinishAndClaim)):
/// the finish's parameters `$1` to `$10`, the claim's `$11` to `$26`. The claim runs after the
/// finish has answered (its filter reads the answer first), and `claim_tasks()`, a volatile
/// function, sees what the statement wrote so far: the rows it moved and retried. Rows of
/// part 0 answer the finish, of part 1 the claim, each in its order.
const FINISH_AND_CLAIM: &str = "\
{finish_with},
finish_answer AS ({finish_answer})
SELECT 0 AS part, f.ord, f.id, f.state, NULL::bigint AS lease, NULL::text AS name, NULL::text AS queue,
       NULL::jsonb AS args, NULL::smallint AS priority, NULL::boolean AS started, NULL::integer AS attempt,
       NULL::integer AS retries, NULL::jsonb AS retry, NULL::boolean AS expires, NULL::boolean AS more,
       NULL::bigint AS next_run_in_ms, NULL::bigint AS enqueued_at_ms, NULL::bigint AS run_at_ms
FROM finish_answer f
UNION ALL
SELECT 1, c.ord, c.id, NULL, c.lease, c.name, c.queue, c.args, c.priority, c.started, c.attempt, c.retries, c.retry,
       c.expires, c.more, c.next_run_in_ms, c.enqueued_at_ms, c.run_at_ms
FROM {s}.claim_tasks($11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26)
     WITH ORDINALITY AS c(id, lease, name, queue, args, priority, started, attempt, retries, retry, expires, more,
                          next_run_in_ms, enqueued_at_ms, run_at_ms, ord)
WHERE (SELECT count(*) FROM finish_answer) >= 0
ORDER BY part, ord";

const RECORD_STARTS: &str = "\
WITH input AS (
    SELECT i.id, i.lease, i.ord FROM unnest($2::bigint[], $3::bigint[]) WITH ORDINALITY AS i(id, lease, ord)
),
held AS (
    SELECT t.id, t.lease, t.state, t.attempts FROM {s}.tasks t
    WHERE t.id = ANY ($2::bigint[]) AND t.state <> 'PENDING' AND t.claimed_by = $1
    ORDER BY t.id
    FOR UPDATE
),
started AS (
    UPDATE {s}.tasks t SET state = 'RUNNING', attempts = t.attempts + 1, started_at = {s}.db_now(),
        heartbeat_at = {s}.db_now(), claim_expires_at = NULL
    WHERE t.id = ANY (ARRAY(SELECT h.id FROM held h JOIN input i ON i.id = h.id AND i.lease = h.lease
                            WHERE h.state = 'CLAIMED'))
    RETURNING t.id, t.attempts
)
SELECT i.id, coalesce(s.attempts, CASE WHEN h.state = 'RUNNING' THEN h.attempts END) AS attempt
FROM input i
LEFT JOIN held h ON h.id = i.id AND h.lease = i.lease
LEFT JOIN started s ON s.id = i.id
ORDER BY i.ord";

const HEARTBEAT: &str = "\
WITH claimed_in AS (
    SELECT c.id, c.lease, c.ord FROM unnest($2::bigint[], $3::bigint[]) WITH ORDINALITY AS c(id, lease, ord)
),
running_in AS (
    SELECT r.id, r.lease, r.ord FROM unnest($4::bigint[], $5::bigint[]) WITH ORDINALITY AS r(id, lease, ord)
),
-- Both lists' rows, locked in one pass in id order as every other statement locks them (two
-- passes could deadlock with a finish). A listed claim may have started under the same lease
-- since the beat was sent (a start that raced it): still held, and alive. A lapsed claim is
-- not renewed: claimers already count it out, and may take it. Rows another transaction
-- holds locked are skipped, and reported busy below when they are still the worker's.
held AS (
    SELECT t.id, t.lease, t.state,
           t.claimed_at >= {s}.db_now() - $7 * interval '1 millisecond'
           AND (t.claim_expires_at IS NULL OR t.claim_expires_at > {s}.db_now()) AS renewable
    FROM {s}.tasks t
    WHERE t.id = ANY ($2::bigint[] || $4::bigint[]) AND t.state <> 'PENDING' AND t.claimed_by = $1
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
),
busy AS (
    SELECT t.id, t.lease FROM {s}.tasks t
    WHERE t.id IN (SELECT u.id FROM unnest($2::bigint[] || $4::bigint[]) AS u(id)
                   WHERE NOT EXISTS (SELECT FROM held h WHERE h.id = u.id))
      AND t.state <> 'PENDING' AND t.claimed_by = $1
),
-- Rows a claim this worker abandoned left claimed by it when it committed late: handed back
-- as the abandon does (`$8`, usually empty, when nothing is scanned).
late AS (
    SELECT t.id FROM {s}.tasks t
    WHERE cardinality($8::bigint[]) > 0 AND t.state IN ('CLAIMED', 'RUNNING') AND t.claimed_by = $1
      AND t.claim_token = ANY ($8::bigint[])
      -- A row the beat names under its current lease is the worker's.
      AND NOT EXISTS (SELECT 1 FROM claimed_in c WHERE c.id = t.id AND c.lease = t.lease)
      AND NOT EXISTS (SELECT 1 FROM running_in r WHERE r.id = t.id AND r.lease = t.lease)
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
),
handed_back AS (
    UPDATE {s}.tasks t SET {unclaim}, {unstart}
    WHERE t.id = ANY (ARRAY(SELECT l.id FROM late l))
    RETURNING t.id, t.queue
),
late_notified AS (
    SELECT count(pg_notify($9 || q.queue, '')) AS n FROM (SELECT DISTINCT h.queue FROM handed_back h) q
),
held_claimed AS (
    SELECT h.id, h.lease, h.state, h.renewable FROM held h WHERE h.id = ANY ($2::bigint[])
),
held_running AS (
    SELECT h.id, h.lease FROM held h WHERE h.id = ANY ($4::bigint[]) AND h.state = 'RUNNING'
),
renewed AS (
    UPDATE {s}.tasks t
    SET claim_expires_at = {s}.db_now() + $6 * interval '1 millisecond', heartbeat_at = {s}.db_now()
    WHERE t.id = ANY (ARRAY(SELECT h.id FROM held_claimed h
                            WHERE h.state = 'CLAIMED' AND h.renewable
                              AND EXISTS (SELECT 1 FROM claimed_in c WHERE c.id = h.id AND c.lease = h.lease)))
),
beaten AS (
    UPDATE {s}.tasks t SET heartbeat_at = {s}.db_now()
    WHERE t.id = ANY (ARRAY(SELECT h.id FROM held_running h JOIN running_in r ON r.id = h.id AND r.lease = h.lease
                            UNION
                            SELECT h.id FROM held_claimed h JOIN claimed_in c ON c.id = h.id AND c.lease = h.lease
                            WHERE h.state = 'RUNNING'))
),
-- The registry's row is not waited for either: one another transaction holds (an operator's
-- release of workers) is seen at the next beat. A row that is gone (pruned) comes back.
seen_row AS (
    SELECT w.id FROM {s}.workers w WHERE w.id = $1 FOR UPDATE SKIP LOCKED
),
seen AS (
    UPDATE {s}.workers w SET last_seen = {s}.db_now() FROM seen_row r WHERE w.id = r.id
),
seen_again AS (
    INSERT INTO {s}.workers (id, queues, concurrency, started_at, last_seen)
    SELECT $1, '{}', 0, {s}.db_now(), {s}.db_now()
    WHERE NOT EXISTS (SELECT FROM {s}.workers w WHERE w.id = $1)
    ON CONFLICT (id) DO NOTHING
)
SELECT l.id, l.what FROM (
    SELECT 0 AS list, c.ord, c.id,
           CASE WHEN EXISTS (SELECT 1 FROM busy b WHERE b.id = c.id AND b.lease = c.lease) THEN 'busy' ELSE 'lost' END
               AS what
    FROM claimed_in c
    WHERE NOT EXISTS (SELECT 1 FROM held_claimed h WHERE h.id = c.id AND h.lease = c.lease)
    UNION ALL
    SELECT 1, r.ord, r.id,
           CASE WHEN EXISTS (SELECT 1 FROM busy b WHERE b.id = r.id AND b.lease = r.lease) THEN 'busy' ELSE 'lost' END
    FROM running_in r
    WHERE NOT EXISTS (SELECT 1 FROM held_running h WHERE h.id = r.id AND h.lease = r.lease)
    UNION ALL
    SELECT 2, 0, h.id, 'handed_back' FROM handed_back h CROSS JOIN late_notified
) l
ORDER BY l.list, l.ord, l.id";

const RELEASE: &str = "\
WITH input AS (
    SELECT i.id, i.lease, i.ord FROM unnest($2::bigint[], $3::bigint[]) WITH ORDINALITY AS i(id, lease, ord)
),
held AS (
    SELECT t.id, t.lease FROM {s}.tasks t
    WHERE t.id = ANY ($2::bigint[]) AND t.state <> 'PENDING' AND t.claimed_by = $1
    ORDER BY t.id
    FOR UPDATE
),
chosen AS (
    SELECT DISTINCT ON (i.id) i.id, i.ord
    FROM input i JOIN held h ON h.id = i.id AND h.lease = i.lease
    ORDER BY i.id, i.ord
),
released AS (
    UPDATE {s}.tasks t SET {unclaim}
    WHERE t.id = ANY (ARRAY(SELECT c.id FROM chosen c))
    RETURNING t.queue
),
notified AS (
    SELECT count(pg_notify($4 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM released r) q
)
SELECT i.id, c.id IS NOT NULL AS released
FROM input i LEFT JOIN chosen c ON c.id = i.id AND c.ord = i.ord CROSS JOIN notified
ORDER BY i.ord";

const ABANDON: &str = "\
WITH released AS (
    UPDATE {s}.tasks t SET {unclaim}, {unstart}
    WHERE t.state IN ('CLAIMED', 'RUNNING') AND t.claimed_by = $1 AND t.claim_token = $2
    RETURNING t.id, t.queue
),
notified AS (
    SELECT count(pg_notify($3 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM released r) q
)
SELECT r.id FROM released r CROSS JOIN notified ORDER BY r.id";

/// The reaper's lock: a row only roles that may update the table can lock (a row back when
/// this transaction holds it, none when another reaper does).
const REAP_LOCK: &str = "SELECT true FROM {s}.reaper_lock FOR UPDATE SKIP LOCKED";

/// Claims with no heartbeat (or claim) for `$1` ms (NULL: none by age), and those of the dead
/// workers `$3`, back to Pending.
const REAP_CLAIMED: &str = "\
WITH stale AS (
    SELECT t.id FROM {s}.tasks t
    WHERE t.state = 'CLAIMED'
      AND (coalesce(t.heartbeat_at, t.claimed_at) < {s}.db_now() - $1 * interval '1 millisecond'
           OR t.claimed_by = ANY ($3::text[]))
    FOR UPDATE SKIP LOCKED
),
released AS (
    UPDATE {s}.tasks t SET {unclaim}
    FROM stale s
    WHERE t.id = s.id
    RETURNING t.id, t.queue
),
notified AS (
    SELECT count(pg_notify($2 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM released r) q
)
SELECT r.id FROM released r CROSS JOIN notified ORDER BY r.id";

/// Runs with no heartbeat (or start) for `$1` ms (NULL: none by age), and those of the dead
/// workers `$2`.
const REAP_RUNNING_SELECT: &str = "\
SELECT t.id, t.retry, t.retries FROM {s}.tasks t
WHERE t.state = 'RUNNING'
  AND (coalesce(t.heartbeat_at, t.started_at) < {s}.db_now() - $1 * interval '1 millisecond'
       OR t.claimed_by = ANY ($2::text[]))
ORDER BY t.id
FOR UPDATE SKIP LOCKED";

/// The workers whose liveness token, recorded in this server incarnation, this transaction
/// can take (their sessions ended: the lock stays taken until commit, so one reaper acts on
/// each), noted free since now if not before; returns those free for `$2` ms. `$1` is the
/// schema's liveness-lock prefix (the worker's key is `hashtextextended($1 || id, 0)`).
const REAP_DEAD_FIND: &str = "\
WITH candidates AS MATERIALIZED (
    SELECT w.id FROM {s}.workers w WHERE w.token_epoch = pg_postmaster_start_time() ORDER BY w.id
),
free AS MATERIALIZED (
    SELECT c.id FROM candidates c WHERE pg_try_advisory_xact_lock(hashtextextended($1 || c.id, 0))
),
noted AS (
    UPDATE {s}.workers w SET token_free_since = coalesce(w.token_free_since, {s}.db_now())
    FROM free f
    WHERE w.id = f.id
    RETURNING w.id, w.token_free_since
)
SELECT n.id FROM noted n WHERE n.token_free_since <= {s}.db_now() - $2 * interval '1 millisecond' ORDER BY n.id";

/// Of the workers `$2`, those whose liveness token is recorded in this server incarnation, each
/// with whether a session holds it now (a free token is taken for this statement's transaction
/// only, as the reaper's look does). `$1` is the schema's liveness-lock prefix.
const LIVENESS_TOKENS: &str = "\
SELECT w.id, NOT pg_try_advisory_xact_lock(hashtextextended($1 || w.id, 0)) AS held
FROM {s}.workers w
WHERE w.id = ANY ($2::text[]) AND w.token_epoch = pg_postmaster_start_time()
ORDER BY w.id";

/// Forgets the tokens of the dead workers `$1`, whose tasks were recovered.
const REAP_DEAD_FORGET: &str = "\
UPDATE {s}.workers SET token_epoch = NULL, token_free_since = NULL WHERE id = ANY ($1::text[])";

/// Takes worker `$2`'s liveness token (key `hashtextextended($1 || $2, 0)`) for this session and
/// records it in this server incarnation; no row when another session holds it.
const TAKE_TOKEN: &str = "\
WITH got AS (SELECT pg_try_advisory_lock(hashtextextended($1 || $2, 0)) AS held)
INSERT INTO {s}.workers (id, queues, concurrency, started_at, last_seen, token_epoch, token_free_since)
SELECT $2, '{}', 0, {s}.db_now(), {s}.db_now(), pg_postmaster_start_time(), NULL FROM got WHERE got.held
ON CONFLICT (id) DO UPDATE SET token_epoch = EXCLUDED.token_epoch, token_free_since = NULL
RETURNING true";

const REAP_RUNNING_APPLY: &str = "\
WITH input AS (
    SELECT i.id, i.delay_ms, i.may_retry FROM unnest($1::bigint[], $2::bigint[], $3::boolean[]) AS i(id, delay_ms, may_retry)
),
chosen AS (
    SELECT t.id, t.attempts, t.claimed_by, {s}.db_now() + i.delay_ms * interval '1 millisecond' AS run_at,
           CASE WHEN i.may_retry
                     AND (t.good_until IS NULL OR {s}.db_now() + i.delay_ms * interval '1 millisecond' < t.good_until)
                    THEN 'PENDING'
                ELSE 'FAILED' END AS state
    FROM input i JOIN {s}.tasks t ON t.id = i.id AND t.state = 'RUNNING'
),
moved AS (
    DELETE FROM {s}.tasks t USING chosen c
    WHERE t.id = c.id AND c.state = 'FAILED'
    RETURNING t.*
),
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT m.id, m.name, m.queue, m.priority, m.args, 'FAILED', {kept}, $4, NULL, {s}.db_now()
    FROM moved m
),
retried AS (
    UPDATE {s}.tasks t SET {unclaim}, retries = t.retries + 1, run_at = c.run_at, error = $4
    FROM chosen c
    WHERE t.id = c.id AND c.state = 'PENDING'
    RETURNING t.queue
),
ready AS (
    SELECT count(pg_notify($6 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM retried r) q
),
history AS (
    INSERT INTO {s}.attempts (task_id, attempt, worker, outcome, error, finished_at)
    SELECT c.id, c.attempts, c.claimed_by, c.state, $4, {s}.db_now() FROM chosen c WHERE c.state = 'PENDING'
),
notified AS (
    SELECT count(pg_notify($5, n.ids)) AS n FROM ({id_chunks_of_moved}) n WHERE {heard:$5}
)
SELECT c.id, c.state FROM chosen c CROSS JOIN notified CROSS JOIN ready ORDER BY c.id";

const REAP_EXPIRE: &str = "\
WITH expired AS (
    DELETE FROM {s}.tasks t
    WHERE t.state = 'PENDING' AND t.id IN (
        SELECT x.id FROM {s}.tasks x
        WHERE x.state = 'PENDING' AND x.good_until <= {s}.db_now()
        FOR UPDATE SKIP LOCKED
    )
    RETURNING t.*
),
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT m.id, m.name, m.queue, m.priority, m.args, 'EXPIRED', {kept}, $1, NULL, {s}.db_now()
    FROM expired m
),
notified AS (
    SELECT count(pg_notify($2, n.ids)) AS n FROM ({id_chunks_of_expired}) n WHERE {heard:$2}
)
SELECT e.id FROM expired e CROSS JOIN notified ORDER BY e.id";

/// Deletes the workers last seen more than `$1` ms ago that hold no task; returns how many.
const PRUNE_WORKERS: &str = "\
WITH gone AS (
    DELETE FROM {s}.workers w
    WHERE w.last_seen < {s}.db_now() - $1 * interval '1 millisecond'
      AND NOT EXISTS (SELECT FROM {s}.tasks t WHERE t.claimed_by = w.id AND t.state IN ('CLAIMED', 'RUNNING'))
    RETURNING w.id
)
SELECT count(*) FROM gone";

const REGISTER_WORKER: &str = "\
INSERT INTO {s}.workers (id, queues, concurrency, started_at, last_seen, stopped_at)
VALUES ($1, $2, $3, {s}.db_now(), {s}.db_now(), NULL)
ON CONFLICT (id) DO UPDATE SET queues = EXCLUDED.queues, concurrency = EXCLUDED.concurrency,
    started_at = EXCLUDED.started_at, last_seen = EXCLUDED.last_seen, stopped_at = NULL";

/// Marks the worker stopped; a worker whose row was pruned (silent for the retention) gets a
/// stopped one, so a heartbeat of it still in flight, landing after this, finds it stopped.
const DEREGISTER_WORKER: &str = "\
INSERT INTO {s}.workers (id, queues, concurrency, started_at, last_seen, stopped_at)
VALUES ($1, '{}', 0, {s}.db_now(), {s}.db_now(), {s}.db_now())
ON CONFLICT (id) DO UPDATE SET stopped_at = EXCLUDED.stopped_at";

/// The queue channel's payload of an enqueue without keys, for its tasks of one queue `q`
/// (columns `priority` and `run_at`): their most urgent priority and earliest run-at (ms),
/// `"<priority> <run-at>"`, as the listener's `parse_ready` reads it. A worker
/// woken only by such payloads claims from the earliest run-at on (`ClaimPolicy::min_run_at`).
/// Keyed enqueues (`enqueue()`) and workflow promotions announce the priority alone.
const ANNOUNCED: &str = "q.priority::text || ' ' || {s}.ms(q.run_at)::text";

const ENQUEUE: &str = "\
SELECT ord, id, problem, detail_id, run_at_ms, good_until_ms
FROM {s}.enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

/// A batch without keys (the common case), as one plain statement: only times can
/// refuse such a task, so it checks them and, when none is refused, numbers and inserts the
/// batch in order, with one notification per queue. The rows it returns are those of the
/// `enqueue()` function: per task its id, or one row naming the first refused task. (Keyed
/// batches go through `enqueue()`; a PL/pgSQL call costs about as much again as the insert.)
const ENQUEUE_KEYLESS: &str = "\
WITH items AS (
    SELECT i.ord, i.name, i.queue, i.priority, i.args, i.retry, {s}.at_ms(i.good_until) AS good_until,
           {s}.due_at(i.delay, i.at, {s}.db_now()) AS run_at, string_to_array(i.flags, ',') AS flags
    FROM unnest($1::text[], $3::text[], $4::smallint[], $2::jsonb[], $5::bigint[], $6::bigint[], $7::bigint[],
                $8::jsonb[], $9::text[])
         WITH ORDINALITY AS i(name, queue, priority, args, delay, at, good_until, retry, flags, ord)
),
refused AS (
    SELECT it.ord, it.run_at, it.good_until FROM items it
    WHERE it.good_until IS NOT NULL AND it.run_at >= it.good_until
    ORDER BY it.ord
    LIMIT 1
),
numbered AS (
    SELECT x.*, nextval('{s}.task_id_seq') AS id
    FROM (SELECT it.* FROM items it WHERE NOT EXISTS (SELECT FROM refused) ORDER BY it.ord OFFSET 0) x
),
inserted AS (
    INSERT INTO {s}.tasks (id, name, queue, priority, args, state, run_at, enqueued_at, good_until, retry, flags)
    OVERRIDING SYSTEM VALUE
    SELECT n.id, n.name, n.queue, n.priority, n.args, 'PENDING', n.run_at, {s}.db_now(), n.good_until, n.retry,
           n.flags
    FROM numbered n
    ORDER BY n.id
    RETURNING queue, priority, run_at
),
notified AS (
    SELECT count(pg_notify($10 || q.queue, {announced})) AS n
    FROM (SELECT ins.queue, min(ins.priority) AS priority, min(ins.run_at) AS run_at FROM inserted ins
          GROUP BY ins.queue) q
    WHERE $10 IS NOT NULL AND {waiting:q.queue,q.priority}
)
SELECT n.ord, n.id, NULL::text AS problem, NULL::bigint AS detail_id, NULL::bigint AS run_at_ms,
       NULL::bigint AS good_until_ms
FROM numbered n CROSS JOIN notified
UNION ALL
SELECT r.ord, NULL, 'run_at_after_good_until', NULL, {s}.ms(r.run_at), {s}.ms(r.good_until) FROM refused r
ORDER BY 1";

/// A batch without keys and without good-until times (most batches): nothing can refuse such
/// a task, so it is one INSERT over the arrays and the clock read once, with one notification
/// per queue. It returns the new ids, which the insert draws from the sequence in array order
/// (so the caller sorts them to match the tasks). About a third cheaper than
/// [`ENQUEUE_KEYLESS`]'s checks, numbering and sorts, per task.
const ENQUEUE_PLAIN: &str = "\
WITH c AS (SELECT {s}.db_now() AS now),
inserted AS (
    INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at, retry, flags)
    SELECT i.name, i.queue, i.priority, i.args, 'PENDING', {s}.due_at(i.delay, i.at, c.now), c.now, i.retry,
           string_to_array(i.flags, ',')
    FROM c, unnest($1::text[], $2::text[], $3::smallint[], $4::jsonb[], $5::bigint[], $6::bigint[], $7::jsonb[],
                   $8::text[]) AS i(name, queue, priority, args, delay, at, retry, flags)
    RETURNING id, queue, priority, run_at
),
notified AS (
    SELECT count(pg_notify($9 || q.queue, {announced})) AS n
    FROM (SELECT ins.queue, min(ins.priority) AS priority, min(ins.run_at) AS run_at FROM inserted ins
          GROUP BY ins.queue) q
    WHERE $9 IS NOT NULL AND {waiting:q.queue,q.priority}
)
SELECT ins.id FROM inserted ins CROSS JOIN notified";

/// [`ENQUEUE_PLAIN`] for a batch of one kind (one name, queue and priority, due now, no retry
/// policy or flags of its own: the usual bulk enqueue): the arguments are the only array, and
/// no per-row expression is left but the insert. About a fifth cheaper than the plain insert.
const ENQUEUE_UNIFORM: &str = "\
WITH c AS (SELECT {s}.db_now() AS now),
inserted AS (
    INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at)
    SELECT $1, $2, $3, a.args, 'PENDING', c.now, c.now FROM c, unnest($4::jsonb[]) AS a(args)
    RETURNING id
)
SELECT ins.id
FROM (SELECT count(pg_notify($5 || $2, {announced})) AS n FROM (SELECT $3 AS priority, c.now AS run_at FROM c) q
      WHERE $5 IS NOT NULL AND {waiting:$2,$3}) n,
     inserted ins";

/// [`ENQUEUE_UNIFORM`] for one task (due now, no retry policy or flags of its own: the usual
/// single enqueue), with scalar parameters. About 6% less server time than [`ENQUEUE_ONE`]'s
/// run-at and optional columns (pgbench, the two interleaved).
const ENQUEUE_ONE_NOW: &str = "\
WITH c AS (SELECT {s}.db_now() AS now),
inserted AS (
    INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at)
    SELECT $1, $2, $3, $4, 'PENDING', c.now, c.now FROM c
    RETURNING id
)
SELECT ins.id
FROM (SELECT count(pg_notify($5 || $2, {announced})) AS n FROM (SELECT $3 AS priority, c.now AS run_at FROM c) q
      WHERE $5 IS NOT NULL AND {waiting:$2,$3}) n,
     inserted ins";

/// [`ENQUEUE_PLAIN`] for one task, with scalar parameters: no arrays to build, bind and expand.
const ENQUEUE_ONE: &str = "\
WITH inserted AS (
    INSERT INTO {s}.tasks (name, queue, priority, args, state, run_at, enqueued_at, retry, flags)
    SELECT $1, $2, $3, $4, 'PENDING', {s}.due_at($5, $6, c.now), c.now, $7, string_to_array($8, ',')
    FROM (SELECT {s}.db_now() AS now) c
    RETURNING id, queue, priority, run_at
)
SELECT ins.id FROM inserted ins
LEFT JOIN LATERAL (SELECT pg_notify($9 || ins.queue, {announced}) FROM (SELECT ins.priority, ins.run_at) q
                   WHERE $9 IS NOT NULL AND {waiting:ins.queue,ins.priority}) n ON true";

/// The columns of a [`TaskRecord`](crate::store::TaskRecord), live rows first. A row shows its
/// key while `task_keys` names it: a Claimed or Running holder whose key a keyed enqueue gave
/// to a new task keeps it in its own column (that enqueue does not write, or lock, its row).
const RECORD: &str = "\
SELECT t.id, t.name, t.queue, t.state, t.priority, t.args, t.attempts, t.retries, {s}.ms(t.enqueued_at) AS enqueued_at,
       {s}.ms(t.run_at) AS run_at, {s}.ms(t.good_until) AS good_until, NULL::bigint AS finished_at, t.claimed_by,
       NULL::jsonb AS result, t.error,
       CASE WHEN EXISTS (SELECT FROM {s}.task_keys k WHERE k.key = t.key AND k.task_id = t.id) THEN t.key END AS key,
       t.flags
FROM {s}.seen_tasks t
WHERE {live}
UNION ALL
SELECT f.id, f.name, f.queue, f.state, f.priority, f.args, f.attempts, f.retries, {s}.ms(f.enqueued_at),
       {s}.ms(f.run_at), {s}.ms(f.good_until), {s}.ms(f.finished_at), f.claimed_by, f.result, f.error,
       CASE WHEN EXISTS (SELECT FROM {s}.task_keys k WHERE k.key = f.key AND k.task_id = f.id) THEN f.key END,
       f.flags
FROM {s}.finished_tasks f
WHERE {finished}";

/// The runs of a task: the attempts rows (runs it outlived), then the run that ended it, which
/// its finished row holds (a completed or failed task's attempts count that run).
const ATTEMPTS: &str = "\
SELECT x.task_id, x.attempt, x.worker, x.outcome, x.error, {s}.ms(x.finished_at)
FROM (
    SELECT a.task_id, a.attempt, a.worker, a.outcome, a.error, a.finished_at FROM {s}.attempts a
    WHERE a.task_id = $1
    UNION ALL
    SELECT f.id, f.attempts, f.claimed_by, f.state, f.error, f.finished_at FROM {s}.finished_tasks f
    WHERE f.id = $1 AND f.state IN ('COMPLETED', 'FAILED')
      AND f.attempts > coalesce((SELECT max(a.attempt) FROM {s}.attempts a WHERE a.task_id = $1), 0)
) x
ORDER BY x.attempt";

/// Each queue's live tasks by state, on the database's clock: the live table only.
const QUEUE_DEPTHS: &str = "\
SELECT t.queue,
       count(*) FILTER (WHERE t.state = 'PENDING' AND t.run_at <= c.now) AS due,
       count(*) FILTER (WHERE t.state = 'PENDING' AND t.run_at > c.now) AS scheduled,
       count(*) FILTER (WHERE t.state = 'CLAIMED') AS claimed,
       count(*) FILTER (WHERE t.state = 'RUNNING') AS running,
       {s}.ms(min(t.run_at) FILTER (WHERE t.state = 'PENDING' AND t.run_at <= c.now)) AS oldest_due
FROM {s}.seen_tasks t, (SELECT {s}.db_now() AS now) c
GROUP BY t.queue
ORDER BY t.queue COLLATE \"C\"";

const COUNTS: &str = "\
SELECT queue, state, count(*) FROM {s}.seen_tasks GROUP BY queue, state
UNION ALL
SELECT queue, state, count(*) FROM {s}.finished_tasks GROUP BY queue, state";

/// Tasks that reached a terminal state in [`$1`, `$2`) ms, by queue and state: the finished
/// table's BRIN index on `finished_at` reads the block ranges of that span only.
const FINISHED_COUNTS: &str = "\
SELECT f.queue, f.state, count(*)
FROM {s}.finished_tasks f
WHERE f.finished_at >= timestamptz 'epoch' + $1 * interval '1 millisecond'
  AND f.finished_at < timestamptz 'epoch' + $2 * interval '1 millisecond'
GROUP BY f.queue, f.state";

/// What each worker holds: the in-flight index's rows only.
const WORKER_LOADS: &str = "\
SELECT t.claimed_by, count(*) FILTER (WHERE t.state = 'CLAIMED'), count(*) FILTER (WHERE t.state = 'RUNNING')
FROM {s}.tasks t
WHERE t.state IN ('CLAIMED', 'RUNNING') AND t.claimed_by IS NOT NULL
GROUP BY t.claimed_by
ORDER BY t.claimed_by COLLATE \"C\"";

const WORKERS: &str = "\
SELECT id, queues, concurrency, {s}.ms(last_seen), stopped_at IS NOT NULL FROM {s}.workers ORDER BY id COLLATE \"C\"";

/// Registers the session as a listener of the channels `$1` (see migration 0008).
const REGISTER_LISTENER: &str = "SELECT {s}.register_listener($1)";

/// Deletes the session's registrations as a listener.
const UNREGISTER_LISTENER: &str = "SELECT {s}.unregister_listener()";

/// Marks a worker waiting on its queues (migration 0014): whether it wrote the mark.
const MARK_WAITING: &str = "SELECT {s}.mark_waiting($1, $2, $3)";

/// Deletes a worker's waiting mark, and stale marks of others.
const UNMARK_WAITING: &str = "SELECT {s}.unmark_waiting($1, $2, $3, $4)";

/// Promotes task `$1` if it waits behind an open gate (migration 0018) as a promotion would
/// have when the gate opened: PENDING, due then. The writers that act on a Pending row (cancel,
/// reschedule, finish by hand) run it first, so that they see and write such a row as Pending.
/// The gate is deleted when no other row is left behind it (a row a claim holds is).
const PROMOTE_OPENED: &str = "\
WITH promoted AS (
    UPDATE {s}.tasks t SET state = 'PENDING', run_at = greatest(t.run_at, g.opened_at), gate = NULL
    FROM {s}.task_gates g
    WHERE t.id = $1 AND t.state = 'WAITING' AND g.gate = t.gate AND g.queue = t.queue AND g.opened_at IS NOT NULL
    RETURNING g.gate, g.queue
)
DELETE FROM {s}.task_gates x USING promoted p
WHERE x.gate = p.gate AND x.queue = p.queue
  AND NOT EXISTS (SELECT FROM {s}.tasks t
                  WHERE t.gate = p.gate AND hashtext(t.queue) = hashtext(p.queue) AND t.queue = p.queue
                    AND t.state = 'WAITING' AND t.id <> $1)";

/// [`PROMOTE_OPENED`] for every step of workflow `$1`, before its cancel (the function of
/// migration 0018, which its retry runs too).
const PROMOTE_OPENED_STEPS: &str = "SELECT {s}.promote_opened_steps($1)";

const CANCEL: &str = "\
WITH gone AS (
    DELETE FROM {s}.tasks t WHERE t.id = $1 AND t.state IN ('WAITING', 'PENDING', 'CLAIMED') RETURNING t.*
),
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT m.id, m.name, m.queue, m.priority, m.args, 'CANCELLED', {kept}, $2, NULL, {s}.db_now()
    FROM gone m
),
notified AS (
    SELECT count(pg_notify($3, g.id::text)) AS n FROM gone g WHERE {heard:$3}
)
SELECT g.id, g.state, g.claimed_by FROM gone g CROSS JOIN notified";

/// Submits a workflow (migration 0010) in one statement: the steps' tasks as
/// [`ENQUEUE_KEYLESS`] writes tasks (refused whole when a run-at is not before its good-until),
/// the steps with parents WAITING, then the workflow, its steps and its edges (steps named by
/// their index, `$13` to `$15`), and one notification per queue of a step due now. Returns
/// each step's task id in step order with the workflow's id, or the refusal.
///
/// A step gated on its parent (migration 0018: its one parent's completion readies it, it has
/// no delay, run-at, good-until or flags, and the parent has at least
/// `canter.gate_min_children` (a session setting, 8 when unset) such children in its queue,
/// all of one priority) is written with the parent's id as its `gate`, beside one
/// `task_gates` row per parent and queue. A gate costs
/// about what promoting three children does (a row written at submit, at the opening and at
/// the end, and the claims' visits: 12,500 diamonds of 4 steps, two children a gate, drained
/// 8% slower gated), so a parent of a few children promotes them. Ids are drawn in step
/// order before the insert, so a child can name its parent's.
const SUBMIT_WORKFLOW: &str = "\
WITH items AS (
    SELECT i.ord, i.name, i.queue, i.priority, i.args, i.retry, {s}.at_ms(i.good_until) AS good_until,
           {s}.due_at(i.delay, i.at, {s}.db_now()) AS run_at, string_to_array(i.flags, ',') AS flags,
           i.parents, i.required, i.sink,
           i.delay IS NULL AND i.at IS NULL AND i.good_until IS NULL AND i.flags IS NULL AND i.parents = 1
               AND i.required = 1 AS gateable
    FROM unnest($1::text[], $3::text[], $4::smallint[], $2::jsonb[], $5::bigint[], $6::bigint[], $7::bigint[],
                $8::jsonb[], $9::text[], $10::integer[], $11::integer[], $12::boolean[])
         WITH ORDINALITY AS i(name, queue, priority, args, delay, at, good_until, retry, flags, parents, required,
                              sink, ord)
),
refused AS (
    SELECT it.ord, it.run_at, it.good_until FROM items it
    WHERE it.good_until IS NOT NULL AND it.run_at >= it.good_until
    ORDER BY it.ord
    LIMIT 1
),
workflow AS (
    INSERT INTO {s}.workflows (name, on_error, submitted_at, queue_channel_prefix, done_channel)
    SELECT $16, $17, {s}.db_now(), $18, $19 WHERE NOT EXISTS (SELECT FROM refused)
    RETURNING id
),
-- Ids in step order (as ENQUEUE_KEYLESS draws them).
numbered AS (
    SELECT x.*, nextval('{s}.task_id_seq') AS id
    FROM (SELECT it.* FROM items it WHERE NOT EXISTS (SELECT FROM refused) ORDER BY it.ord OFFSET 0) x
),
-- Each edge with its ends' ids; `gated` when it is its child's one edge, does not allow
-- failure, the child can be claimed by any worker of its queue as soon as the parent
-- completes (no delay, run-at, good-until or flags), and enough of the parent's children in
-- the child's queue are so, all of one priority (the gate's: claims order gates by it).
edges_by_id AS (
    SELECT p.id AS parent, c.id AS child, e.allow_failed, c.parents = 1 AND c.required = 1 AS sole,
           c.gateable AND NOT e.allow_failed AS gateable, c.queue, c.priority
    FROM unnest($13::integer[], $14::integer[], $15::boolean[]) AS e(parent, child, allow_failed)
    JOIN numbered p ON p.ord = e.parent + 1
    JOIN numbered c ON c.ord = e.child + 1
),
linked AS (
    SELECT e.parent, e.child, e.allow_failed, e.sole, e.queue, e.priority,
           e.gateable AND count(*) OVER w >= coalesce(nullif(current_setting('canter.gate_min_children', true), '')::integer, 8)
               AND min(e.priority) OVER w = max(e.priority) OVER w AS gated
    FROM edges_by_id e
    WINDOW w AS (PARTITION BY e.parent, e.queue, e.gateable)
),
inserted AS (
    INSERT INTO {s}.tasks (id, name, queue, priority, args, state, run_at, enqueued_at, good_until, retry, flags, gate)
    OVERRIDING SYSTEM VALUE
    SELECT n.id, n.name, n.queue, n.priority, n.args, CASE WHEN n.parents = 0 THEN 'PENDING' ELSE 'WAITING' END,
           n.run_at, {s}.db_now(), n.good_until, n.retry, n.flags, l.parent
    FROM numbered n
    -- A gated child has one edge.
    LEFT JOIN linked l ON l.child = n.id AND l.gated
    ORDER BY n.id
    RETURNING id, queue, priority, state
),
gates AS (
    INSERT INTO {s}.task_gates (gate, queue, priority)
    SELECT l.parent, l.queue, min(l.priority) FROM linked l WHERE l.gated GROUP BY l.parent, l.queue
),
steps AS (
    INSERT INTO {s}.workflow_steps (task_id, workflow_id, step, parents, required, sink)
    SELECT n.id, w.id, n.ord - 1, n.parents, n.required, n.sink FROM numbered n CROSS JOIN workflow w
),
edges AS (
    INSERT INTO {s}.workflow_edges (parent, child, allow_failed, sole, gated)
    SELECT l.parent, l.child, l.allow_failed, l.sole, l.gated FROM linked l
),
notified AS (
    SELECT count(pg_notify($18 || q.queue, q.priority::text)) AS n
    FROM (SELECT ins.queue, min(ins.priority) AS priority FROM inserted ins WHERE ins.state = 'PENDING'
          GROUP BY ins.queue) q
)
SELECT n.ord, n.id, w.id AS workflow_id, NULL::bigint AS run_at_ms, NULL::bigint AS good_until_ms
FROM numbered n CROSS JOIN workflow w CROSS JOIN notified
UNION ALL
SELECT r.ord, NULL, NULL, {s}.ms(r.run_at), {s}.ms(r.good_until) FROM refused r
ORDER BY 1";

/// A workflow's row and its steps' rows counted by state (none for an unknown workflow; purged
/// rows count no more).
const WORKFLOW_RECORD: &str = "\
SELECT w.name, w.on_error, w.paused, w.cancelled, w.sink_failed, {s}.ms(w.submitted_at) AS submitted_at_ms,
       c.state, c.n
FROM {s}.workflows w
LEFT JOIN LATERAL (
    SELECT coalesce(t.state, f.state) AS state, count(*) AS n
    FROM {s}.workflow_steps s
    LEFT JOIN {s}.seen_tasks t ON t.id = s.task_id
    LEFT JOIN {s}.finished_tasks f ON f.id = s.task_id
    WHERE s.workflow_id = w.id AND (t.id IS NOT NULL OR f.id IS NOT NULL)
    GROUP BY 1
) c ON true
WHERE w.id = $1";

/// Pauses workflow `$1` unless it is cancelled: its row is locked for the statement, so a
/// concurrent finish decides before or after it, never half.
const PAUSE_WORKFLOW: &str = "\
UPDATE {s}.workflows w SET paused = true WHERE w.id = $1 AND NOT w.cancelled RETURNING w.id";

const RESUME_WORKFLOW: &str = "SELECT {s}.workflow_resume($1)";

/// Retries workflow `$1` (`$2`: with everything downstream) in one statement (migration
/// 0011): whether it exists, how many of its steps were purged (then nothing changed), and how
/// many steps were reset.
const RETRY_WORKFLOW: &str = "SELECT r.known, r.purged, r.reset FROM {s}.workflow_retry($1, $2) r";

/// Cancels workflow `$1`: flags it, then cancels its Waiting, Pending, Claimed and Running
/// steps as [`CANCEL`] cancels a task (`$2` the error, `$3` the done channel), and names the
/// claimed and running ones on the abort channel `$4`: their workers beat at once, find their
/// leases gone and abort the handlers.
const CANCEL_WORKFLOW: &str = "\
WITH flagged AS (
    UPDATE {s}.workflows w SET cancelled = true WHERE w.id = $1 AND NOT w.cancelled RETURNING w.id
),
doomed AS (
    SELECT t.id FROM {s}.tasks t
    WHERE t.id IN (SELECT s.task_id FROM {s}.workflow_steps s JOIN flagged f ON f.id = s.workflow_id)
      AND t.state IN ('WAITING', 'PENDING', 'CLAIMED', 'RUNNING')
    ORDER BY t.id
    FOR UPDATE
),
gone AS (
    DELETE FROM {s}.tasks t USING doomed d WHERE t.id = d.id RETURNING t.*
),
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT m.id, m.name, m.queue, m.priority, m.args, 'CANCELLED', {kept}, $2, NULL, {s}.db_now()
    FROM gone m
),
notified AS (
    SELECT count(pg_notify($3, n.ids)) AS n FROM ({id_chunks_of_gone}) n WHERE {heard:$3}
),
held AS (
    SELECT g.id FROM gone g WHERE g.state IN ('CLAIMED', 'RUNNING')
),
revoked AS (
    SELECT count(pg_notify($4, n.ids)) AS n FROM ({id_chunks_of_held}) n
)
SELECT count(*) FROM flagged CROSS JOIN notified CROSS JOIN revoked";

/// The parents of step `$1`, by task id: each with its step, edge policy and, once finished,
/// its state, result and error (a parent not finished yet has no row in `finished_tasks`).
const PARENTS_OF: &str = "\
SELECT e.parent, s.step, e.allow_failed, coalesce(f.state, t.state) AS state, f.result, f.error
FROM {s}.workflow_edges e
JOIN {s}.workflow_steps s ON s.task_id = e.parent
LEFT JOIN {s}.finished_tasks f ON f.id = e.parent
LEFT JOIN {s}.seen_tasks t ON t.id = e.parent
WHERE e.child = $1 AND (f.id IS NOT NULL OR t.id IS NOT NULL)
ORDER BY e.parent";

/// The steps of workflow `$1` with their tasks' names and states and their joins, by step.
const WORKFLOW_STEPS: &str = "\
SELECT s.step, s.task_id, coalesce(t.name, f.name) AS name, coalesce(t.state, f.state) AS state, s.parents,
       s.required, s.satisfied, s.unsatisfied
FROM {s}.workflow_steps s
LEFT JOIN {s}.seen_tasks t ON t.id = s.task_id
LEFT JOIN {s}.finished_tasks f ON f.id = s.task_id
WHERE s.workflow_id = $1 AND (t.id IS NOT NULL OR f.id IS NOT NULL)
ORDER BY s.step";

/// A workflow's edges by step, children first, at most `$2`.
const WORKFLOW_EDGES: &str = "\
SELECT p.step, c.step, e.allow_failed
FROM {s}.workflow_steps c
JOIN {s}.workflow_edges e ON e.child = c.task_id
JOIN {s}.workflow_steps p ON p.task_id = e.parent
WHERE c.workflow_id = $1
ORDER BY c.step, p.step
LIMIT $2";

/// The ids of the newest workflows, at most `$1`.
const WORKFLOW_IDS: &str = "SELECT w.id FROM {s}.workflows w ORDER BY w.id DESC LIMIT $1";

/// The workflow of task `$1`, if it is a step.
const STEP_OF: &str = "SELECT s.workflow_id, s.step FROM {s}.workflow_steps s WHERE s.task_id = $1";

const REQUEUE_FAILED: &str = "\
WITH gone AS (
    DELETE FROM {s}.finished_tasks f WHERE f.id = $1 AND f.state = 'FAILED' RETURNING f.*
),
-- The run that failed it was kept on the finished row: it becomes an attempts row.
history AS (
    INSERT INTO {s}.attempts (task_id, attempt, worker, outcome, error, finished_at)
    SELECT g.id, g.attempts, g.claimed_by, 'FAILED', g.error, g.finished_at FROM gone g
    WHERE g.attempts > coalesce((SELECT max(a.attempt) FROM {s}.attempts a WHERE a.task_id = $1), 0)
),
back AS (
    INSERT INTO {s}.tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, claimed_at,
                           claim_expires_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at,
                           good_until, retry, key, flags, error)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, g.name, g.queue, g.priority, g.args, 'PENDING', g.lease, NULL, NULL, g.claimed_at, NULL, NULL,
           g.started_at, g.attempts, 0, {s}.db_now(), g.enqueued_at, g.good_until, g.retry, g.key, g.flags, g.error
    FROM gone g
    RETURNING id, queue
),
notified AS (
    SELECT count(pg_notify($2 || b.queue, '')) AS n FROM back b
)
SELECT b.id FROM back b CROSS JOIN notified";

/// Reschedules a Pending task: `$2` whether to set its run-at (from delay `$3` or time `$4`,
/// as at enqueue), `$5` its priority, `$6` its retries (NULL keeps each). Returns the live
/// row's state, its would-be run-at and good-until, and whether it changed; no row when the
/// task is not live.
const RESCHEDULE: &str = "\
WITH target AS (
    SELECT t.id, t.state, t.good_until,
           CASE WHEN $2 THEN {s}.due_at($3, $4, {s}.db_now()) ELSE t.run_at END AS run_at
    FROM {s}.tasks t
    WHERE t.id = $1
    FOR UPDATE
),
changed AS (
    UPDATE {s}.tasks t SET run_at = g.run_at, priority = coalesce($5, t.priority), retries = coalesce($6, t.retries)
    FROM target g
    WHERE t.id = g.id AND g.state = 'PENDING' AND (g.good_until IS NULL OR g.run_at < g.good_until)
    RETURNING t.queue
),
-- Due now, workers claim it; due later, their claim learns when (the wake-up hint).
notified AS (
    SELECT count(pg_notify($7 || c.queue, '')) AS n FROM changed c
)
SELECT g.state, {s}.ms(g.run_at) AS run_at, {s}.ms(g.good_until) AS good_until,
       EXISTS (SELECT FROM changed) AS changed
FROM target g CROSS JOIN notified";

/// Completes or fails a Pending, Claimed or Running task by hand: state `$2`, error `$3`, result
/// `$4`. Its row moves as a finish moves it, so the holder's later writes find nothing and are
/// reported lost. A Waiting step is refused: only its parents decide it.
const FINISH_BY_HAND: &str = "\
WITH gone AS (
    DELETE FROM {s}.tasks t WHERE t.id = $1 AND t.state IN ('PENDING', 'CLAIMED', 'RUNNING') RETURNING t.*
),
finished AS (
    INSERT INTO {s}.finished_tasks ({finished_columns})
    SELECT m.id, m.name, m.queue, m.priority, m.args, $2, {kept}, $3, $4, {s}.db_now()
    FROM gone m
),
notified AS (
    SELECT count(pg_notify($5, g.id::text)) AS n FROM gone g WHERE {heard:$5}
)
SELECT g.id FROM gone g CROSS JOIN notified";

/// Hands back every Claimed or Running task of the workers `$1`, as RELEASE does, and marks
/// them stopped in the registry. Returns how many tasks.
const FORCE_UNLOCK: &str = "\
WITH released AS (
    UPDATE {s}.tasks t SET {unclaim}
    WHERE t.state IN ('CLAIMED', 'RUNNING') AND t.claimed_by = ANY ($1::text[])
    RETURNING t.queue
),
stopped AS (
    UPDATE {s}.workers w SET stopped_at = coalesce(w.stopped_at, {s}.db_now()) WHERE w.id = ANY ($1::text[])
),
notified AS (
    SELECT count(pg_notify($2 || q.queue, '')) AS n FROM (SELECT DISTINCT r.queue FROM released r) q
)
SELECT count(*) FROM released r CROSS JOIN notified";

/// Frees key `$1`: its task is cancelled (error `$2`, waiters notified on `$3`) if Pending,
/// else keeps running or stays finished; either way it no longer shows the key. Returns the
/// task and what was done; no row for an unknown key. The `remove_key()` function (0003) takes
/// the key's advisory lock before any row, as enqueuers of the key do.
const REMOVE_KEY: &str = "SELECT task_id, action FROM {s}.remove_key($1, $2, $3, $4)";

/// Deletes at most `$2` finished tasks that finished more than `$1` ms ago (by the BRIN index
/// on finished_at), with their attempts and the key rows that still name them. Returns how
/// many; the caller repeats until a batch comes back short.
///
/// A task an idempotency key names stays while the key is younger than `$3` ms (NULL:
/// forever): an idempotent enqueue of the key compares name and arguments with its row. Every
/// statement reads such kept rows again (the BRIN index has no order to resume from).
const PURGE_FINISHED: &str = "\
WITH doomed AS (
    SELECT f.id FROM {s}.finished_tasks f
    WHERE f.finished_at < {s}.db_now() - $1 * interval '1 millisecond'
      AND NOT EXISTS (
          SELECT FROM {s}.task_keys k
          WHERE k.key = f.key AND k.task_id = f.id AND k.idempotent_since IS NOT NULL
            AND ($3::bigint IS NULL
                 OR greatest(k.idempotent_since, f.enqueued_at) > {s}.db_now() - $3 * interval '1 millisecond'))
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
gone AS (
    DELETE FROM {s}.finished_tasks f USING doomed d WHERE f.id = d.id RETURNING f.id, f.key
),
runs AS (
    DELETE FROM {s}.attempts a USING gone g WHERE a.task_id = g.id
),
-- By key (the primary key); a key taken by another task since is not this task's.
keys AS (
    DELETE FROM {s}.task_keys k USING gone g WHERE k.key = g.key AND k.task_id = g.id
)
SELECT count(*) FROM gone";

/// Deletes finished task `$1` with its attempts and the key it holds; returns its id.
const DELETE_FINISHED: &str = "\
WITH gone AS (
    DELETE FROM {s}.finished_tasks f WHERE f.id = $1 RETURNING f.id, f.key
),
runs AS (
    DELETE FROM {s}.attempts a USING gone g WHERE a.task_id = g.id
),
keys AS (
    DELETE FROM {s}.task_keys k USING gone g WHERE k.key = g.key AND k.task_id = g.id
)
SELECT g.id FROM gone g";

/// Pauses queue `$1`; returns a row when it was not paused already.
const PAUSE_QUEUE: &str = "\
INSERT INTO {s}.queue_states AS q (queue, paused, paused_at) VALUES ($1, true, {s}.db_now())
ON CONFLICT (queue) DO UPDATE SET paused = true, paused_at = {s}.db_now() WHERE NOT q.paused
RETURNING q.queue";

/// Resumes queue `$1` and notifies it; returns a row when it was paused.
const RESUME_QUEUE: &str = "\
WITH resumed AS (
    UPDATE {s}.queue_states q SET paused = false, paused_at = NULL WHERE q.queue = $1 AND q.paused
    RETURNING q.queue
),
notified AS (
    SELECT count(pg_notify($2 || r.queue, '')) AS n FROM resumed r
)
SELECT r.queue FROM resumed r CROSS JOIN notified";

const PAUSED_QUEUES: &str = "\
SELECT queue, {s}.ms(paused_at) FROM {s}.queue_states WHERE paused ORDER BY queue COLLATE \"C\"";

const STATE_OF: &str = "\
SELECT state FROM {s}.seen_tasks WHERE id = $1 UNION ALL SELECT state FROM {s}.finished_tasks WHERE id = $1";

/// The records of the schedules named in `$1`, one row per name in order (NULL columns for a
/// schedule without a record), each with the database's clock.
const SCHEDULE_STATES: &str = "\
SELECT {s}.ms({s}.db_now()) AS now, n.name, {s}.ms(r.last_tick) AS last_tick, {s}.ms(r.next_tick) AS next_tick,
       r.last_task_id, r.run_count, {s}.ms(r.updated_at) AS updated_at
FROM unnest($1::text[]) WITH ORDINALITY AS n(name, ord)
LEFT JOIN {s}.schedules r ON r.name = n.name
ORDER BY n.ord";

/// Every schedule record, by name.
const SCHEDULE_RECORDS: &str = "\
SELECT name, {s}.ms(last_tick) AS last_tick, {s}.ms(next_tick) AS next_tick, last_task_id, run_count,
       {s}.ms(updated_at) AS updated_at
FROM {s}.schedules ORDER BY name COLLATE \"C\"";

/// Records without tasks, by compare-and-set: a name whose read `$2` is NULL is inserted only
/// if it has no record; the others advance to `$3` (next tick `$4`) only if they still hold
/// `$2`. Rows are locked in name order first, so concurrent schedulers cannot deadlock. Returns
/// the names written; the others lost a race.
const ADVANCE_SCHEDULES: &str = "\
WITH input AS (
    SELECT i.name, i.read, i.advance, i.next
    FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[]) AS i(name, read, advance, next)
),
held AS (
    SELECT r.name FROM {s}.schedules r WHERE r.name = ANY ($1::text[]) ORDER BY r.name COLLATE \"C\" FOR UPDATE
),
inserted AS (
    INSERT INTO {s}.schedules AS r (name, last_tick, next_tick, updated_at)
    SELECT i.name, {s}.at_ms(i.advance), {s}.at_ms(i.next), {s}.db_now() FROM input i WHERE i.read IS NULL
    ON CONFLICT (name) DO NOTHING
    RETURNING r.name
),
advanced AS (
    UPDATE {s}.schedules r SET last_tick = {s}.at_ms(i.advance), next_tick = {s}.at_ms(i.next),
        updated_at = {s}.db_now()
    FROM held h JOIN input i ON i.name = h.name
    WHERE r.name = h.name AND i.read IS NOT NULL AND {s}.ms(r.last_tick) = i.read
    RETURNING r.name
)
SELECT name FROM inserted UNION ALL SELECT name FROM advanced";

/// Fires schedule `$1`: advances it from `$2` to `$3` (next tick `$4`) and counts `$5` tasks,
/// only if it still holds `$2`. Returns a row when it won (the caller then enqueues the tasks
/// in the same transaction; a concurrent scheduler's update waits for that commit and then
/// finds another last tick).
const FIRE_SCHEDULE: &str = "\
UPDATE {s}.schedules r SET last_tick = {s}.at_ms($3), next_tick = {s}.at_ms($4), run_count = r.run_count + $5,
    updated_at = {s}.db_now()
WHERE r.name = $1 AND {s}.ms(r.last_tick) = $2
RETURNING r.name";

/// Records the last task enqueued by schedule `$1`.
const SCHEDULE_LAST_TASK: &str = "UPDATE {s}.schedules SET last_task_id = $2 WHERE name = $1";

const NOW: &str = "SELECT {s}.ms({s}.db_now())";

/// One statement of a store, and how to send it: as a named prepared statement sqlx caches on
/// the connection, or unnamed (prepared for this one execution) when the store's connections
/// go through a pooler in transaction mode, where a named statement prepared on one server
/// connection would be missing on the next (see `PgSchema::transaction_pooled`).
#[derive(Debug, Clone)]
pub(crate) struct Stmt {
    text: SqlStr,
    persistent: bool,
}

impl Stmt {
    /// The statement as a query.
    pub(crate) fn query<'q>(&self) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(self.text.clone()).persistent(self.persistent)
    }

    /// The statement as a query of rows of type `O`.
    pub(crate) fn query_as<'q, O>(&self) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        O: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        sqlx::query_as(self.text.clone()).persistent(self.persistent)
    }

    /// The statement as a query of one value of type `O` per row.
    pub(crate) fn query_scalar<'q, O>(
        &self,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        (O,): for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        sqlx::query_scalar(self.text.clone()).persistent(self.persistent)
    }
}

/// Every statement of a store, with its schema filled in.
pub(crate) struct Statements {
    pub(crate) claim: Stmt,
    pub(crate) start: Stmt,
    pub(crate) record_starts: Stmt,
    pub(crate) finish: Stmt,
    pub(crate) finish_and_claim: Stmt,
    pub(crate) heartbeat: Stmt,
    pub(crate) release: Stmt,
    pub(crate) abandon: Stmt,
    pub(crate) reap_lock: Stmt,
    pub(crate) reap_claimed: Stmt,
    pub(crate) reap_running_select: Stmt,
    pub(crate) reap_running_apply: Stmt,
    pub(crate) reap_expire: Stmt,
    pub(crate) reap_dead_find: Stmt,
    pub(crate) reap_dead_forget: Stmt,
    pub(crate) take_token: Stmt,
    pub(crate) prune_workers: Stmt,
    pub(crate) register_worker: Stmt,
    pub(crate) deregister_worker: Stmt,
    pub(crate) enqueue: Stmt,
    pub(crate) enqueue_keyless: Gated,
    pub(crate) enqueue_plain: Gated,
    pub(crate) enqueue_one: Gated,
    pub(crate) enqueue_one_now: Gated,
    pub(crate) enqueue_uniform: Gated,
    pub(crate) get: Stmt,
    pub(crate) list: Stmt,
    pub(crate) list_newest: Stmt,
    pub(crate) attempts: Stmt,
    pub(crate) counts: Stmt,
    pub(crate) queue_depths: Stmt,
    pub(crate) workers: Stmt,
    pub(crate) finished_counts: Stmt,
    pub(crate) worker_loads: Stmt,
    pub(crate) workflow_edges: Stmt,
    pub(crate) liveness_tokens: Stmt,
    pub(crate) cancel: Stmt,
    pub(crate) promote_opened: Stmt,
    pub(crate) promote_opened_steps: Stmt,
    pub(crate) requeue_failed: Stmt,
    pub(crate) reschedule: Stmt,
    pub(crate) finish_by_hand: Stmt,
    pub(crate) force_unlock: Stmt,
    pub(crate) remove_key: Stmt,
    pub(crate) purge_finished: Stmt,
    pub(crate) delete_finished: Stmt,
    pub(crate) pause_queue: Stmt,
    pub(crate) resume_queue: Stmt,
    pub(crate) paused_queues: Stmt,
    pub(crate) state_of: Stmt,
    pub(crate) schedule_states: Stmt,
    pub(crate) schedule_records: Stmt,
    pub(crate) advance_schedules: Stmt,
    pub(crate) fire_schedule: Stmt,
    pub(crate) schedule_last_task: Stmt,
    pub(crate) now: Stmt,
    pub(crate) register_listener: Stmt,
    pub(crate) unregister_listener: Stmt,
    pub(crate) mark_waiting: Stmt,
    pub(crate) unmark_waiting: Stmt,
    pub(crate) submit_workflow: Stmt,
    pub(crate) workflow_record: Stmt,
    pub(crate) pause_workflow: Stmt,
    pub(crate) resume_workflow: Stmt,
    pub(crate) retry_workflow: Stmt,
    pub(crate) cancel_workflow: Stmt,
    pub(crate) step_of: Stmt,
    pub(crate) parents_of: Stmt,
    pub(crate) workflow_steps: Stmt,
    pub(crate) workflow_ids: Stmt,
}

/// Expands every `{heard:$N}` of a statement: whether a listener of the channel in parameter
/// `$N` is registered (migration 0008). Written into the statement's own text, never behind a
/// function, so the statement locks `listeners` before it takes its snapshot: a registration
/// either waited for it or is seen by it.
fn heard(text: &str) -> String {
    expand(text, "heard", |channel| format!("EXISTS (SELECT FROM {{s}}.listeners l WHERE l.channel = {channel})"))
}

/// Expands every `{waiting:QUEUE,PRIORITY}` of a statement: with `gated`, whether a worker of
/// queue `QUEUE` is marked waiting for a task of priority `PRIORITY` (migration 0014: any task
/// while it waits for work, one more urgent than its backlog while it works through one),
/// written into the statement's own text for the reason [`heard`] gives; without, `true`.
fn waiting(text: &str, gated: bool) -> String {
    expand(text, "waiting", |args| {
        let (queue, priority) = args.split_once(',').expect("a {waiting:QUEUE,PRIORITY} placeholder");
        if gated {
            format!(
                "EXISTS (SELECT FROM {{s}}.waiting_workers w WHERE w.queue = {queue} \
                 AND (w.below_priority IS NULL OR {priority} < w.below_priority))"
            )
        } else {
            "true".into()
        }
    })
}

/// Replaces every `{name:ARG}` of `text` by `with(ARG)`.
fn expand(text: &str, name: &str, with: impl Fn(&str) -> String) -> String {
    let open = format!("{{{name}:");
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(&open) {
        out.push_str(&rest[..at]);
        let after = &rest[at + open.len()..];
        let end = after.find('}').expect("a placeholder is closed");
        out.push_str(&with(&after[..end]));
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

/// An enqueue statement in its two forms: notifying its queues always (inside the caller's
/// transaction, whose commit it cannot see coming), or only while a worker of them waits.
#[derive(Debug, Clone)]
pub(crate) struct Gated {
    /// Notifies every queue it wrote to.
    pub(crate) always: Stmt,
    /// Notifies a queue only while a worker of it is marked waiting.
    pub(crate) if_waiting: Stmt,
}

impl Statements {
    /// The statements of the schema whose quoted name is `quoted`, sent as named prepared
    /// statements when `persistent`, else unnamed.
    pub(crate) fn new(quoted: &str, persistent: bool) -> Self {
        let fill = |template: &str| -> Stmt {
            let text = template
                .replace("{finish_with}", FINISH_WITH)
                .replace("{finish_answer}", FINISH_ANSWER)
                .replace("{finished_columns}", FINISHED_COLUMNS)
                .replace("{kept}", KEPT)
                .replace("{announced}", ANNOUNCED)
                .replace("{unclaim}", UNCLAIM)
                .replace("{unstart}", UNSTART)
                .replace("{id_chunks_of_moved}", &ID_CHUNKS.replace("{rows}", "moved"))
                .replace("{id_chunks_of_expired}", &ID_CHUNKS.replace("{rows}", "expired"))
                .replace("{id_chunks_of_gone}", &ID_CHUNKS.replace("{rows}", "gone"))
                .replace("{id_chunks_of_held}", &ID_CHUNKS.replace("{rows}", "held"));
            let text = waiting(&heard(&text), false).replace("{s}", quoted);
            Stmt { text: AssertSqlSafe(Arc::<str>::from(text)).into_sql_str(), persistent }
        };
        let gated = |template: &str| Gated { always: fill(template), if_waiting: fill(&waiting(template, true)) };
        let record = |live: &str, finished: &str| RECORD.replace("{live}", live).replace("{finished}", finished);
        // Each table's part is ordered and limited on its own (its primary key serves it), so a
        // page of a long history reads a page of rows, not the history.
        let list = |newest_first: bool| {
            let (direction, past) = if newest_first { ("DESC", "<") } else { ("ASC", ">") };
            let filter = "($1::text IS NULL OR {a}.queue = $1) AND ($2::text IS NULL OR {a}.state = $2) \
                AND ($4::text IS NULL OR {a}.name = $4) AND ($5::bigint IS NULL OR {a}.id {past} $5) \
                AND ($8::bigint IS NULL OR {s}.ms({a}.enqueued_at) >= $8) \
                AND ($9::bigint IS NULL OR {s}.ms({a}.enqueued_at) < $9) \
                ORDER BY {a}.id {direction} LIMIT $6"
                .replace("{past}", past)
                .replace("{direction}", direction);
            let record = record(&filter.replace("{a}", "t"), &filter.replace("{a}", "f"));
            let (live, finished) = record.split_once("\nUNION ALL\n").expect("RECORD is a union of two selects");
            format!("SELECT * FROM (({live}) UNION ALL ({finished})) r ORDER BY r.id {direction} OFFSET $7 LIMIT $3")
        };
        Statements {
            claim: fill(CLAIM),
            start: fill(START),
            record_starts: fill(RECORD_STARTS),
            finish: fill(FINISH),
            finish_and_claim: fill(FINISH_AND_CLAIM),
            heartbeat: fill(HEARTBEAT),
            release: fill(RELEASE),
            abandon: fill(ABANDON),
            reap_lock: fill(REAP_LOCK),
            reap_claimed: fill(REAP_CLAIMED),
            reap_running_select: fill(REAP_RUNNING_SELECT),
            reap_running_apply: fill(REAP_RUNNING_APPLY),
            reap_expire: fill(REAP_EXPIRE),
            reap_dead_find: fill(REAP_DEAD_FIND),
            reap_dead_forget: fill(REAP_DEAD_FORGET),
            take_token: fill(TAKE_TOKEN),
            prune_workers: fill(PRUNE_WORKERS),
            register_worker: fill(REGISTER_WORKER),
            deregister_worker: fill(DEREGISTER_WORKER),
            enqueue: fill(ENQUEUE),
            enqueue_keyless: gated(ENQUEUE_KEYLESS),
            enqueue_plain: gated(ENQUEUE_PLAIN),
            enqueue_one: gated(ENQUEUE_ONE),
            enqueue_one_now: gated(ENQUEUE_ONE_NOW),
            enqueue_uniform: gated(ENQUEUE_UNIFORM),
            get: fill(&record("t.id = $1", "f.id = $1")),
            list: fill(&list(false)),
            list_newest: fill(&list(true)),
            attempts: fill(ATTEMPTS),
            counts: fill(COUNTS),
            queue_depths: fill(QUEUE_DEPTHS),
            workers: fill(WORKERS),
            finished_counts: fill(FINISHED_COUNTS),
            worker_loads: fill(WORKER_LOADS),
            workflow_edges: fill(WORKFLOW_EDGES),
            liveness_tokens: fill(LIVENESS_TOKENS),
            cancel: fill(CANCEL),
            promote_opened: fill(PROMOTE_OPENED),
            promote_opened_steps: fill(PROMOTE_OPENED_STEPS),
            requeue_failed: fill(REQUEUE_FAILED),
            reschedule: fill(RESCHEDULE),
            finish_by_hand: fill(FINISH_BY_HAND),
            force_unlock: fill(FORCE_UNLOCK),
            remove_key: fill(REMOVE_KEY),
            purge_finished: fill(PURGE_FINISHED),
            delete_finished: fill(DELETE_FINISHED),
            pause_queue: fill(PAUSE_QUEUE),
            resume_queue: fill(RESUME_QUEUE),
            paused_queues: fill(PAUSED_QUEUES),
            state_of: fill(STATE_OF),
            schedule_states: fill(SCHEDULE_STATES),
            schedule_records: fill(SCHEDULE_RECORDS),
            advance_schedules: fill(ADVANCE_SCHEDULES),
            fire_schedule: fill(FIRE_SCHEDULE),
            schedule_last_task: fill(SCHEDULE_LAST_TASK),
            now: fill(NOW),
            register_listener: fill(REGISTER_LISTENER),
            unregister_listener: fill(UNREGISTER_LISTENER),
            mark_waiting: fill(MARK_WAITING),
            unmark_waiting: fill(UNMARK_WAITING),
            submit_workflow: fill(SUBMIT_WORKFLOW),
            workflow_record: fill(WORKFLOW_RECORD),
            pause_workflow: fill(PAUSE_WORKFLOW),
            resume_workflow: fill(RESUME_WORKFLOW),
            retry_workflow: fill(RETRY_WORKFLOW),
            cancel_workflow: fill(CANCEL_WORKFLOW),
            step_of: fill(STEP_OF),
            parents_of: fill(PARENTS_OF),
            workflow_steps: fill(WORKFLOW_STEPS),
            workflow_ids: fill(WORKFLOW_IDS),
        }
    }
}
