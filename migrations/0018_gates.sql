-- Canter schema, version 18: a fan-out's children are claimed straight from WAITING, behind a
-- gate their parent's completion opens.
--
-- Schema 17 promoted a root's children one row at a time: each a WAITING row updated to
-- PENDING (a new row version and its index entries) in the statement that finished the
-- root, and claimed afterwards (another version). A fan-out of 49,999 children spent 0.41 s
-- on that update alone while nothing else was claimable, and ran at 0.6–0.7× the plain
-- drain. Now a step whose join is its one parent's completion (one parent, `required` 1, an
-- edge that does not allow failure) and that runs as soon as it is ready (no delay, run-at or
-- good-until) is written with `gate` = its parent's id, and `task_gates` holds one row per
-- (parent, queue) of such children. The parent's completion opens the gate (`opened_at`: one
-- row written per queue, not one per child) and the claim takes the gate's WAITING rows as it
-- takes PENDING ones: `tasks_gated_idx` orders a gate's rows as the claim wants them, and the
-- claim merges them with the PENDING rows in one order (priority, then run-at: an open gate's
-- rows are due when it opened, as a promotion would have made them, then id).
--
-- Readers see such a row as its promotion would have left it: PENDING, due when its gate
-- opened (`seen_tasks`). Writers that act on PENDING rows act on them too, and write them
-- PENDING (`gate` cleared). A gate that never opens (its parent failed, or its workflow
-- held the children when the parent completed) is deleted, and its children settle one by
-- one as before; so does a child a retry wrote back (its gate is gone). An open gate whose
-- rows are all gone is deleted by the claim that finds it so.
--
-- Which children are gated is the submit's choice (`canter.gate_min_children`, in
-- `SUBMIT_WORKFLOW`): a gate costs about what promoting three children does, so a parent of
-- fewer than 8 such children in a queue promotes them as before; and a gate's children share
-- one priority (the gate's, by which claims choose gates) and carry no flags (any worker of
-- the queue may take them).
--
-- Online-safe with one exception, below: new columns without defaults (no rewrite), a new
-- table and view, functions replaced with the same signatures. Binaries of schema 13 and later
-- call the replaced `claim_tasks()`; earlier ones call 0012's overload, which does not see
-- gated rows, so they refuse this schema (`min_code_version` 13). Binaries of schemas 13 to
-- 17 submit no gates, and read a row behind an open gate as WAITING until it is claimed. The index is built in the
-- migration's transaction, not `CONCURRENTLY`: a concurrent build waits for every transaction
-- of the database older than it, and a held xmin (issue 19) would stall the migration until
-- its lock timeout; this one reads the live table once (live tasks only) while it blocks
-- writes to it.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (18, 13, 'workflows: a fan-out''s children claimed from WAITING behind their parent''s gate');

-- The parent whose completion makes this WAITING row claimable (NULL for every other row).
ALTER TABLE tasks ADD COLUMN gate bigint;

-- The claim's gated arm: a gate's rows of a queue, in claim order.
CREATE INDEX tasks_gated_idx ON tasks (gate, hashtext(queue), priority, id)
    WHERE state = 'WAITING' AND gate IS NOT NULL;

-- The edge leads to a gated child (written at submit).
ALTER TABLE workflow_edges ADD COLUMN gated boolean NOT NULL DEFAULT false;

-- One row per parent with gated children, per queue of those children: opened when the
-- parent completes, deleted once no WAITING row of it is left.
CREATE TABLE task_gates (
    gate      bigint      NOT NULL,
    queue     text        NOT NULL,
    -- The most urgent priority of its children at submit: what the opening announces.
    priority  smallint    NOT NULL,
    opened_at timestamptz,
    PRIMARY KEY (gate, queue)
) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 100
);

-- A queue's open gates, for its claims.
CREATE INDEX task_gates_open_idx ON task_gates (queue, priority, opened_at, gate) WHERE opened_at IS NOT NULL;

-- The live rows as readers see them: a WAITING row behind an open gate is PENDING, due when
-- the gate opened.
CREATE VIEW seen_tasks AS
SELECT t.id, t.name, t.queue, t.priority, t.args,
       CASE WHEN g.opened_at IS NOT NULL AND t.state = 'WAITING' THEN 'PENDING' ELSE t.state END AS state,
       t.lease, t.claimed_by, t.claim_token, t.claimed_at, t.claim_expires_at, t.heartbeat_at, t.started_at,
       t.attempts, t.retries,
       CASE WHEN g.opened_at IS NOT NULL AND t.state = 'WAITING' THEN greatest(t.run_at, g.opened_at)
            ELSE t.run_at END AS run_at,
       t.enqueued_at, t.good_until, t.retry, t.key, t.flags, t.error, t.gate
FROM tasks t
LEFT JOIN task_gates g ON g.gate = t.gate AND g.queue = t.queue AND g.opened_at IS NOT NULL AND t.state = 'WAITING';

-- As 0017's, except that a finish satisfying gated edges opens their gates (when the
-- workflow does not hold its promotions) instead of promoting the children, and deletes the
-- gates that will not open: those of parents that did not complete or whose workflow held
-- the children (they settle as before).
CREATE OR REPLACE FUNCTION workflow_settle(p_finished bigint[], p_states text[], p_decide bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_decide     bigint[] := coalesce(p_decide, '{}');
    v_skipped    bigint[];
    v_channels   text[] := '{}';
    v_priorities smallint[] := '{}';
    v_woken      text[];
    v_urgency    smallint[];
    v_sole       bigint[];
    v_counted    bigint[];
    v_satisfies  boolean[];
    -- Parents whose completion satisfies gated edges, parents whose finish does not.
    v_gates      bigint[];
    v_shut       bigint[];
    v_opened     bigint[];
BEGIN
    p_finished := coalesce(p_finished, '{}');
    p_states := coalesce(p_states, '{}');
    LOOP
        -- Completions alone neither pause a workflow nor fail a sink.
        IF EXISTS (SELECT FROM unnest(p_states) AS f(state) WHERE f.state <> 'COMPLETED') THEN
            -- Only failures pause (a skip is the workflow's own decision); a sink that did
            -- not complete fails the workflow, whatever becomes of its row.
            UPDATE workflows w
            SET paused = w.paused OR (x.failed AND w.on_error = 'PAUSE' AND NOT w.cancelled),
                sink_failed = w.sink_failed OR x.sink_failed
            FROM (SELECT s.workflow_id, bool_or(f.state IN ('FAILED', 'CANCELLED', 'EXPIRED')) AS failed,
                         bool_or(s.sink AND f.state <> 'COMPLETED') AS sink_failed
                  FROM unnest(p_finished, p_states) AS f(id, state)
                  JOIN workflow_steps s ON s.task_id = f.id
                  WHERE s.task_id = ANY (p_finished)
                  GROUP BY s.workflow_id) x
            WHERE w.id = x.workflow_id
              AND ((x.failed AND w.on_error = 'PAUSE' AND NOT w.cancelled AND NOT w.paused)
                   OR (x.sink_failed AND NOT w.sink_failed));
        END IF;
        EXIT WHEN cardinality(p_finished) = 0 AND cardinality(v_decide) = 0;

        -- The finished steps' edges, read once: gated edges this finish satisfies name a gate
        -- to open; the other sole ones that it satisfies lead to children that need no
        -- counting (one parent, now satisfied, and `required` 1: ready, unless the workflow
        -- holds its promotions); the others are counted below.
        SELECT coalesce(array_agg(e.child) FILTER (WHERE e.sole AND e.satisfies AND NOT e.gated), '{}'),
               coalesce(array_agg(DISTINCT e.parent) FILTER (WHERE e.gated AND e.satisfies), '{}'),
               coalesce(array_agg(DISTINCT e.parent) FILTER (WHERE e.gated AND NOT e.satisfies), '{}'),
               coalesce(array_agg(e.child) FILTER (WHERE NOT (e.sole AND e.satisfies)), '{}'),
               coalesce(array_agg(e.satisfies) FILTER (WHERE NOT (e.sole AND e.satisfies)), '{}')
        INTO v_sole, v_gates, v_shut, v_counted, v_satisfies
        FROM (SELECT e.parent, e.child, e.sole, e.gated, f.state = 'COMPLETED' OR e.allow_failed AS satisfies
              FROM unnest(p_finished, p_states) AS f(id, state)
              JOIN workflow_edges e ON e.parent = f.id
              WHERE e.parent = ANY (p_finished)) e;

        IF cardinality(v_gates) > 0 THEN
            -- A gate opens unless its workflow holds the children (paused or cancelled): a
            -- row per queue, whatever the number of children.
            WITH opened AS (
                UPDATE task_gates g SET opened_at = db_now()
                FROM workflow_steps s JOIN workflows w ON w.id = s.workflow_id
                WHERE s.task_id = ANY (v_gates) AND g.gate = s.task_id AND g.opened_at IS NULL
                  AND NOT (w.paused OR w.cancelled)
                RETURNING g.gate, w.queue_channel_prefix || g.queue AS channel, g.priority
            )
            SELECT coalesce(array_agg(DISTINCT o.gate), '{}'),
                   coalesce(array_agg(o.channel), '{}'), coalesce(array_agg(o.priority), '{}')
            INTO v_opened, v_woken, v_urgency
            FROM opened o;
            v_channels := v_channels || v_woken;
            v_priorities := v_priorities || v_urgency;
            -- A gate that did not open (held, or deleted when an earlier finish of its parent
            -- failed): its children settle one by one, as sole children do.
            IF cardinality(v_opened) < cardinality(v_gates) THEN
                v_shut := v_shut || ARRAY(SELECT g.id FROM unnest(v_gates) AS g(id) WHERE g.id <> ALL (v_opened));
                v_sole := v_sole || ARRAY(
                    SELECT e.child FROM workflow_edges e
                    WHERE e.parent = ANY (ARRAY(SELECT g.id FROM unnest(v_gates) AS g(id) WHERE g.id <> ALL (v_opened)))
                      AND e.gated);
            END IF;
        END IF;
        IF cardinality(v_shut) > 0 THEN
            DELETE FROM task_gates g WHERE g.gate = ANY (v_shut) AND g.opened_at IS NULL;
        END IF;

        -- No other finish can settle such a child, so its row is not locked (as below).
        WITH sole AS (
            SELECT s.task_id, s.satisfied + 1 AS satisfied, w.paused OR w.cancelled AS held,
                   w.queue_channel_prefix
            FROM workflow_steps s JOIN workflows w ON w.id = s.workflow_id
            WHERE s.task_id = ANY (v_sole)
        ),
        kept AS (
            UPDATE workflow_steps s SET satisfied = o.satisfied
            FROM sole o
            WHERE s.task_id = o.task_id AND o.held
        ),
        promoted AS (
            UPDATE tasks t SET state = 'PENDING', run_at = greatest(t.run_at, db_now()), gate = NULL
            WHERE t.id = ANY (ARRAY(SELECT o.task_id FROM sole o WHERE NOT o.held)) AND t.state = 'WAITING'
            RETURNING t.queue, t.priority
        )
        -- Every workflow of a schema has the schema's prefix.
        SELECT coalesce(array_agg(x.prefix || p.queue), '{}'), coalesce(array_agg(p.priority), '{}')
        INTO v_woken, v_urgency
        FROM (SELECT p.queue, min(p.priority) AS priority FROM promoted p GROUP BY p.queue) p
        CROSS JOIN (SELECT DISTINCT o.queue_channel_prefix AS prefix FROM sole o WHERE NOT o.held) x;
        v_channels := v_channels || v_woken;
        v_priorities := v_priorities || v_urgency;
        -- Nothing left to count: a fan-out's root, a link of a chain.
        EXIT WHEN cardinality(v_counted) = 0 AND cardinality(v_decide) = 0;

        WITH deltas AS (
            SELECT x.child,
                   count(*) FILTER (WHERE x.satisfies) AS satisfied,
                   count(*) FILTER (WHERE NOT x.satisfies) AS unsatisfied
            FROM (SELECT c.child, c.satisfies FROM unnest(v_counted, v_satisfies) AS c(child, satisfies)
                  UNION ALL
                  SELECT d.id, NULL FROM unnest(v_decide) AS d(id)) x
            GROUP BY x.child
        ),
        children AS (
            SELECT s.task_id, s.workflow_id, s.parents, s.required,
                   s.satisfied + d.satisfied AS satisfied, s.unsatisfied + d.unsatisfied AS unsatisfied
            FROM deltas d JOIN workflow_steps s ON s.task_id = d.child
            WHERE s.task_id = ANY (ARRAY(SELECT x.child FROM deltas x))
        ),
        -- A child of several parents may be counted by finishes of its other parents in other
        -- transactions: its row is locked, in id order (as every statement locks rows: two
        -- finishes never deadlock), and read as the last of them left it.
        locked AS (
            SELECT s.task_id, s.workflow_id, s.parents, s.required, s.satisfied, s.unsatisfied
            FROM workflow_steps s
            WHERE s.task_id = ANY (ARRAY(SELECT c.task_id FROM children c WHERE c.parents > 1))
            ORDER BY s.task_id
            FOR UPDATE
        ),
        counted AS (
            SELECT c.task_id, c.workflow_id, c.parents, c.required, c.satisfied, c.unsatisfied
            FROM children c
            WHERE c.parents <= 1
            UNION ALL
            SELECT l.task_id, l.workflow_id, l.parents, l.required,
                   l.satisfied + d.satisfied, l.unsatisfied + d.unsatisfied
            FROM locked l JOIN deltas d ON d.child = l.task_id
        ),
        -- The join's decision (`canter::workflow::decide`): R ready, S skip, W wait (or held).
        judged AS (
            SELECT c.task_id, c.satisfied, c.unsatisfied, w.queue_channel_prefix, w.done_channel,
                   CASE WHEN w.paused OR w.cancelled THEN 'W'
                        WHEN c.satisfied >= c.required THEN 'R'
                        WHEN c.parents - c.unsatisfied < c.required THEN 'S'
                        ELSE 'W' END AS verdict
            FROM counted c JOIN workflows w ON w.id = c.workflow_id
            WHERE w.id = ANY (ARRAY(SELECT DISTINCT x.workflow_id FROM counted x))
        ),
        kept AS (
            UPDATE workflow_steps s SET satisfied = j.satisfied, unsatisfied = j.unsatisfied
            FROM judged j
            WHERE s.task_id = j.task_id AND j.verdict = 'W'
              AND (s.satisfied <> j.satisfied OR s.unsatisfied <> j.unsatisfied)
        ),
        -- By `id = ANY (ids)`: the index scan writes them in id order.
        promoted AS (
            UPDATE tasks t SET state = 'PENDING', run_at = greatest(t.run_at, db_now()), gate = NULL
            WHERE t.id = ANY (ARRAY(SELECT j.task_id FROM judged j WHERE j.verdict = 'R')) AND t.state = 'WAITING'
            RETURNING t.id, t.queue, t.priority
        ),
        doomed AS (
            DELETE FROM tasks t
            USING judged j
            WHERE t.id = j.task_id AND j.verdict = 'S' AND t.state = 'WAITING'
            RETURNING t.*, j.done_channel
        ),
        moved AS (
            INSERT INTO finished_tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token,
                                        claimed_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at,
                                        good_until, retry, key, flags, error, result, finished_at)
            SELECT d.id, d.name, d.queue, d.priority, d.args, 'SKIPPED', d.lease, d.claimed_by, d.claim_token,
                   d.claimed_at, d.heartbeat_at, d.started_at, d.attempts, d.retries, d.run_at, d.enqueued_at,
                   d.good_until, d.retry, d.key, d.flags, NULL, NULL, db_now()
            FROM doomed d
            RETURNING id
        ),
        -- The skipped steps' waiters, 300 ids per payload (PostgreSQL takes 8,000 bytes at most:
        -- in one payload a big skip failed the finish that caused it).
        notified AS (
            SELECT count(pg_notify(c.done_channel, c.ids)) AS n
            FROM (SELECT d.done_channel, string_agg(d.id::text, ',') AS ids
                  FROM (SELECT d.done_channel, d.id, (row_number() OVER () - 1) / 300 AS chunk FROM doomed d) d
                  GROUP BY d.done_channel, d.chunk) c
            WHERE EXISTS (SELECT FROM listeners l WHERE l.channel = c.done_channel)
        ),
        woken AS (
            SELECT coalesce(array_agg(p.channel), '{}') AS channels, coalesce(array_agg(p.priority), '{}') AS priorities
            FROM (SELECT j.queue_channel_prefix || p.queue AS channel, min(p.priority) AS priority
                  FROM promoted p JOIN judged j ON j.task_id = p.id
                  GROUP BY 1) p
        )
        SELECT (SELECT coalesce(array_agg(m.id), '{}') FROM moved m CROSS JOIN notified), k.channels, k.priorities
        INTO v_skipped, v_woken, v_urgency
        FROM woken k;

        v_channels := v_channels || v_woken;
        v_priorities := v_priorities || v_urgency;
        p_finished := v_skipped;
        p_states := array_fill('SKIPPED'::text, ARRAY[cardinality(v_skipped)]);
        v_decide := '{}';
    END LOOP;

    PERFORM pg_notify(q.channel, q.priority::text)
    FROM (SELECT x.channel, min(x.priority) AS priority
          FROM unnest(v_channels, v_priorities) AS x(channel, priority)
          GROUP BY x.channel) q;
END;
$$;
-- Promotes the steps of workflow `p_workflow` that wait behind open gates, as their gates'
-- opening would have (PENDING, due then), and deletes those gates: no row is left behind
-- them (a claim that held one took it). Run before a cancel and a retry of the workflow,
-- which act on Pending steps as such.
CREATE FUNCTION promote_opened_steps(p_workflow bigint) RETURNS void
LANGUAGE sql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
    UPDATE tasks t SET state = 'PENDING', run_at = greatest(t.run_at, g.opened_at), gate = NULL
    FROM task_gates g
    WHERE t.id = ANY (ARRAY(SELECT s.task_id FROM workflow_steps s WHERE s.workflow_id = p_workflow))
      AND t.state = 'WAITING' AND g.gate = t.gate AND g.queue = t.queue AND g.opened_at IS NOT NULL;
    DELETE FROM task_gates g
    WHERE g.gate = ANY (ARRAY(SELECT s.task_id FROM workflow_steps s WHERE s.workflow_id = p_workflow))
      AND g.opened_at IS NOT NULL;
$$;

-- As 0011's, but the steps behind the workflow's open gates are promoted first, and a reset
-- step rejoins its parent's gate while that gate is shut.
-- Retries workflow `p_workflow`: its steps that finished without completing (failed,
-- cancelled, expired, skipped) and, with `p_downstream`, every finished step below them go back
-- to WAITING (retries spent reset; attempts, history and last error kept; the run a finished row
-- held becomes an attempts row, as a requeue's); they and their children count their parents again;
-- the workflow is no longer cancelled and no sink of it failed; then their joins decide, unless
-- the workflow is still paused (its resume decides them): a workflow whose steps had all
-- finished, or that was cancelled, is not. Refused whole, with `purged` > 0, when rows
-- of its steps were purged: their outcomes are gone. `known` is false for an unknown workflow.
CREATE OR REPLACE FUNCTION workflow_retry(p_workflow bigint, p_downstream boolean,
                               OUT known boolean, OUT purged integer, OUT reset integer)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
DECLARE
    v_reset  bigint[];
    v_decide bigint[];
    v_over   boolean;
BEGIN
    -- The workflow's row first: a concurrent retry, cancel or pause of it waits for this one.
    PERFORM FROM workflows w WHERE w.id = p_workflow FOR UPDATE;
    known := FOUND;
    purged := 0;
    reset := 0;
    IF NOT known THEN
        RETURN;
    END IF;
    SELECT count(*) INTO purged
    FROM workflow_steps s
    WHERE s.workflow_id = p_workflow
      AND NOT EXISTS (SELECT FROM tasks t WHERE t.id = s.task_id)
      AND NOT EXISTS (SELECT FROM finished_tasks f WHERE f.id = s.task_id);
    IF purged > 0 THEN
        RETURN;
    END IF;
    -- A workflow whose steps all finished is no longer paused (nothing is left to hold), though
    -- its row may say so: a retry reopens it running.
    v_over := NOT EXISTS (SELECT FROM workflow_steps s JOIN tasks t ON t.id = s.task_id
                          WHERE s.workflow_id = p_workflow);

    WITH RECURSIVE failed AS (
        SELECT f.id
        FROM workflow_steps s JOIN finished_tasks f ON f.id = s.task_id
        WHERE s.workflow_id = p_workflow AND f.state <> 'COMPLETED'
    ),
    below (id) AS (
        SELECT e.child FROM workflow_edges e WHERE p_downstream AND e.parent IN (SELECT x.id FROM failed x)
        UNION
        SELECT e.child FROM below b JOIN workflow_edges e ON e.parent = b.id
    )
    SELECT coalesce(array_agg(r.id ORDER BY r.id), '{}') INTO v_reset
    FROM (SELECT x.id FROM failed x
          UNION
          SELECT b.id FROM below b WHERE EXISTS (SELECT FROM finished_tasks f WHERE f.id = b.id)) r;
    reset := cardinality(v_reset);
    -- Its steps behind open gates are Pending to the retry, as their promotion left them in
    -- schema 17: a reset parent that fails again must not skip them. After the reset steps are
    -- chosen: a parent that completed since, opening its gate, is among them, and its gate is
    -- seen here.
    PERFORM promote_opened_steps(p_workflow);

    SELECT coalesce(array_agg(DISTINCT x.id ORDER BY x.id), '{}') INTO v_decide
    FROM (SELECT unnest(v_reset) AS id
          UNION
          SELECT e.child FROM workflow_edges e WHERE e.parent = ANY (v_reset)) x;

    WITH gone AS (
        DELETE FROM finished_tasks f WHERE f.id = ANY (v_reset) RETURNING f.*
    ),
    history AS (
        INSERT INTO attempts (task_id, attempt, worker, outcome, error, finished_at)
        SELECT g.id, g.attempts, g.claimed_by, g.state, g.error, g.finished_at FROM gone g
        WHERE g.state IN ('COMPLETED', 'FAILED')
          AND g.attempts > coalesce((SELECT max(a.attempt) FROM attempts a WHERE a.task_id = g.id), 0)
    )
    -- A step whose gate has not opened yet (its parent is still to finish: the step was
    -- cancelled alone) waits behind it again; the parent's completion, which opens the gate,
    -- promotes none of its gated children one by one. The gate's row is locked: a claim that
    -- empties the gate meanwhile (this row is not visible to it yet) skips it rather than
    -- deleting it, and a completion opening it waits for this retry.
    INSERT INTO tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, claimed_at,
                       claim_expires_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at,
                       good_until, retry, key, flags, error, gate)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, g.name, g.queue, g.priority, g.args, 'WAITING', g.lease, NULL, NULL, g.claimed_at, NULL, NULL,
           g.started_at, g.attempts, 0, g.run_at, g.enqueued_at, g.good_until, g.retry, g.key, g.flags, g.error,
           (SELECT e.parent FROM workflow_edges e JOIN task_gates x ON x.gate = e.parent AND x.queue = g.queue
            WHERE e.child = g.id AND e.gated AND x.opened_at IS NULL
            FOR SHARE OF x)
    FROM gone g;

    -- The reset steps and their children count their parents again: the finished ones (a
    -- promoted or skipped step's counts were left as they were when it left WAITING). Locked
    -- in id order, as the finish trigger locks them.
    WITH locked AS (
        SELECT s.task_id FROM workflow_steps s WHERE s.task_id = ANY (v_decide) ORDER BY s.task_id FOR UPDATE
    ),
    recounted AS (
        SELECT l.task_id,
               count(f.id) FILTER (WHERE f.state = 'COMPLETED' OR e.allow_failed) AS satisfied,
               count(f.id) FILTER (WHERE NOT (f.state = 'COMPLETED' OR e.allow_failed)) AS unsatisfied
        FROM locked l
        LEFT JOIN workflow_edges e ON e.child = l.task_id
        LEFT JOIN finished_tasks f ON f.id = e.parent
        GROUP BY l.task_id
    )
    UPDATE workflow_steps s SET satisfied = r.satisfied, unsatisfied = r.unsatisfied
    FROM recounted r
    WHERE s.task_id = r.task_id;

    UPDATE workflows w
    SET cancelled = false, sink_failed = false, paused = w.paused AND NOT w.cancelled AND NOT v_over
    WHERE w.id = p_workflow;
    PERFORM workflow_settle('{}', '{}', v_decide);
END;
$$;

-- Whether a claim under these bounds may take a WAITING row behind a gate that opened at
-- `p_opened_at`: the Pending rows' filters, its run-at the gate's opening. One SQL expression
-- without settings, so the planner inlines it where it is called.
CREATE FUNCTION gated_claimable(p_run_at timestamptz, p_good_until timestamptz, p_flags text[], p_priority smallint,
                                p_opened_at timestamptz, p_now timestamptz, p_min_run_at timestamptz,
                                p_forbidden text[], p_min_priority smallint, p_max_priority smallint)
RETURNS boolean
LANGUAGE sql IMMUTABLE
AS $$
    SELECT greatest(p_run_at, p_opened_at) <= p_now AND greatest(p_run_at, p_opened_at) >= p_min_run_at
       AND (p_good_until IS NULL OR p_good_until > p_now)
       AND (p_forbidden IS NULL OR p_flags IS NULL OR NOT p_flags && p_forbidden)
       AND (p_priority, greatest(p_run_at, p_opened_at)) >= (coalesce(p_min_priority, -32768), p_min_run_at)
       AND p_priority <= coalesce(p_max_priority, 32767)
$$;

-- As 0013's, with a third source beside the Pending rows and the lapsed claims: the WAITING
-- rows behind the queue's open gates, merged in the same order, claimed as Pending rows are
-- (their run-at becomes their gate's opening, `gate` is cleared); its "more" covers them as
-- it covers Pending rows; and it deletes the open gates it emptied.
CREATE OR REPLACE FUNCTION claim_tasks(
    p_worker text, p_token bigint, p_queues text[], p_caps integer[], p_budget integer,
    p_hard boolean, p_cluster_cap integer, p_max_batch integer, p_lock_keys bigint[],
    p_start_now integer, p_lease_ms bigint, p_serial boolean[], p_forbidden text[], p_max_priority smallint,
    p_min_priority smallint, p_min_run_at bigint)
RETURNS TABLE (id bigint, lease bigint, name text, queue text, args jsonb, priority smallint, started boolean,
               attempt integer, retries integer, retry jsonb, expires boolean, more boolean, next_run_in_ms bigint,
               enqueued_at_ms bigint, run_at_ms bigint)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_next  bigint;
    v_now   timestamptz;
    -- Pending rows due before this are left out (`p_min_run_at`, ms; NULL: none are).
    v_min_run_at timestamptz;
    v_left  integer := greatest(p_budget, 0);
    v_ids   bigint[] := '{}';
    v_start bigint[];
    v_got   bigint[];
    v_want  integer;
    v_count integer;
    v_queue text;
    v_more  boolean := false;
    -- The last Pending row a queue's pass took, in claim order (priority, run_at, id).
    v_last_priority smallint;
    v_last_run_at   timestamptz;
    v_last_id       bigint;
    -- How many Pending rows the queue's pass took.
    v_got_pending   integer;
    -- The queue's open gates the pass visits (with when each opened), whether it has more.
    v_open          bigint[];
    v_opened_at     timestamptz[];
    v_open_more     boolean;
    -- Rows of open gates the pass saw (one more a gate than it wants: whether any is left)
    -- and took.
    v_gated_seen    integer;
    v_got_gated     integer;
    -- Gates the pass may have emptied, with their queues: deleted once nothing WAITING is left.
    v_drained       bigint[] := '{}';
    v_drained_queue text[] := '{}';
    v_emptied       bigint[];
    -- Every gate the claim visited, with when it opened: the run-at of the rows it takes.
    v_seen_gates    bigint[] := '{}';
    v_seen_opened   timestamptz[] := '{}';
BEGIN
    -- Paused queues (`queue_states`) leave the pass before anything else: one probe of a tiny
    -- table, and the queue list is rebuilt only when one of its queues is paused.
    IF EXISTS (SELECT FROM queue_states s WHERE s.paused AND s.queue = ANY (p_queues)) THEN
        SELECT coalesce(array_agg(q.name ORDER BY q.ord), '{}'), coalesce(array_agg(q.cap ORDER BY q.ord), '{}'),
               coalesce(array_agg(q.serial ORDER BY q.ord), '{}')
        INTO p_queues, p_caps, p_serial
        FROM unnest(p_queues, p_caps, p_serial) WITH ORDINALITY AS q(name, cap, serial, ord)
        WHERE NOT EXISTS (SELECT FROM queue_states s WHERE s.paused AND s.queue = q.name);
    END IF;
    -- End of the paused-queue filter.
    IF coalesce(cardinality(p_lock_keys), 0) > 0 THEN
        PERFORM take_claim_locks(p_lock_keys);
    END IF;
    -- Times from here on are taken after the locks: the transaction may have waited for them,
    -- and a start or a lease dated from its beginning would be that much older at commit.
    v_now := db_clock();
    v_min_run_at := coalesce(at_ms(p_min_run_at), '-infinity');
    -- Each statement below takes a fresh snapshot, so the counts include every claim committed
    -- by the previous holder of the locks.
    IF p_hard AND p_cluster_cap IS NOT NULL THEN
        SELECT count(*) INTO v_count FROM tasks t
        WHERE t.state IN ('CLAIMED', 'RUNNING')
          AND (t.state = 'RUNNING' OR t.claim_expires_at IS NULL OR t.claim_expires_at > v_now);
        v_left := least(v_left, greatest(p_cluster_cap - v_count, 0));
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_queues), 0) LOOP
        v_queue := p_queues[i];
        v_want := v_left;
        IF v_want > 0 AND p_caps[i] IS NOT NULL THEN
            SELECT count(*) INTO v_count FROM tasks t
            WHERE t.queue = v_queue AND t.state IN ('CLAIMED', 'RUNNING')
              AND (t.state = 'RUNNING'
                   OR ((p_hard OR p_serial[i]) AND (t.claim_expires_at IS NULL OR t.claim_expires_at > v_now)));
            v_want := least(v_want, greatest(p_caps[i] - v_count, 0));
        END IF;
        IF p_max_batch > 0 THEN
            v_want := least(v_want, p_max_batch);
        END IF;
        v_got := '{}';
        v_last_id := NULL;
        v_got_pending := 0;
        v_got_gated := 0;
        v_gated_seen := 0;
        -- The queue's open gates within the pass's bounds (a gate's rows share its priority:
        -- the submit gates no other), most urgent first. It visits 16 at most: each may lock as
        -- many rows as the pass wants, which it merges in claim order. (ARRAY() in the index's
        -- order: an aggregate's ORDER BY set up a sort at each call, 45 µs of a small claim's
        -- 0.6 ms.)
        v_open := ARRAY(SELECT g.gate FROM task_gates g
                        WHERE g.queue = v_queue AND g.opened_at IS NOT NULL
                          AND (g.priority, g.opened_at) >= (coalesce(p_min_priority, -32768), v_min_run_at)
                          AND g.priority <= coalesce(p_max_priority, 32767)
                        ORDER BY g.priority, g.opened_at, g.gate
                        LIMIT 17);
        v_open_more := cardinality(v_open) > 16;
        v_open := v_open[1:16];
        v_opened_at := '{}';
        IF cardinality(v_open) > 0 THEN
            v_opened_at := ARRAY(SELECT g.opened_at FROM unnest(v_open) WITH ORDINALITY AS o(gate, ord)
                                 -- Deleted since (emptied by another claim): NULL, in its place.
                                 LEFT JOIN task_gates g ON g.gate = o.gate AND g.queue = v_queue
                                 ORDER BY o.ord);
            v_seen_gates := v_seen_gates || v_open;
            v_seen_opened := v_seen_opened || v_opened_at;
        END IF;
        IF v_want > 0 THEN
            -- Queues are distinct, so rows of earlier queues (in `v_ids`) cannot turn up here.
            WITH pend AS (
                SELECT t.id, t.priority, t.run_at, true AS pending, NULL::bigint AS gate FROM tasks t
                WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                  AND t.run_at <= v_now AND t.run_at >= v_min_run_at
                  AND (t.good_until IS NULL OR t.good_until > v_now)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                  AND (t.priority, t.run_at) >= (coalesce(p_min_priority, -32768), v_min_run_at) AND t.priority <= coalesce(p_max_priority, 32767)
                ORDER BY t.priority, t.run_at, t.id
                LIMIT v_want
                FOR UPDATE SKIP LOCKED
            ),
            lapsed AS (
                SELECT t.id, t.priority, t.run_at, false AS pending, NULL::bigint AS gate FROM tasks t
                WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                  AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                  AND t.priority BETWEEN coalesce(p_min_priority, -32768) AND coalesce(p_max_priority, 32767)
                ORDER BY t.priority, t.run_at, t.id
                LIMIT v_want
                FOR UPDATE SKIP LOCKED
            ),
            -- Rows behind the open gates, due when their gate opened (as if promoted then), in
            -- the same order: a gate's rows share that run-at.
            gated AS (
                SELECT x.id, x.priority, x.run_at, false AS pending, x.gate
                FROM unnest(v_open, v_opened_at) AS g(gate, opened_at)
                CROSS JOIN LATERAL (
                    SELECT t.id, t.priority, greatest(t.run_at, g.opened_at) AS run_at, t.gate FROM tasks t
                    WHERE t.gate = g.gate AND hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue
                      AND t.state = 'WAITING'
                      AND gated_claimable(t.run_at, t.good_until, t.flags, t.priority, g.opened_at, v_now, v_min_run_at,
                                           p_forbidden, p_min_priority, p_max_priority)
                    ORDER BY t.priority, t.id
                    LIMIT v_want + 1
                    FOR UPDATE OF t SKIP LOCKED
                ) x
            ),
            chosen AS (
                SELECT u.id, u.priority, u.run_at, u.pending, u.gate
                FROM (SELECT * FROM pend UNION ALL SELECT * FROM lapsed UNION ALL SELECT * FROM gated) u
                ORDER BY u.priority, u.run_at, u.id
                LIMIT v_want
            )
            SELECT coalesce(array_agg(c.id ORDER BY c.priority, c.run_at, c.id), '{}'),
                   (array_agg(c.priority ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   (array_agg(c.run_at ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   (array_agg(c.id ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   count(*) FILTER (WHERE c.pending),
                   count(*) FILTER (WHERE c.gate IS NOT NULL),
                   (SELECT count(*) FROM gated),
                   ARRAY(SELECT g.gate FROM unnest(v_open) AS g(gate)
                         LEFT JOIN (SELECT x.gate, count(*) AS n FROM gated x GROUP BY x.gate) n ON n.gate = g.gate
                         WHERE coalesce(n.n, 0) <= v_want)
            INTO v_got, v_last_priority, v_last_run_at, v_last_id, v_got_pending, v_got_gated, v_gated_seen,
                 v_emptied
            FROM chosen c;
            v_drained := v_drained || v_emptied;
            v_drained_queue := v_drained_queue || array_fill(v_queue, ARRAY[cardinality(v_emptied)]);
            v_ids := v_ids || v_got;
            v_left := v_left - cardinality(v_got);
        END IF;
        IF NOT v_more THEN
            IF cardinality(v_got) >= v_want THEN
                -- Was an eligible row left behind? Pending rows are probed after the last one this
                -- pass took, in claim order (one index descent: the rows it took are still Pending
                -- until the update below, and skipping them one by one would cost a pass's size
                -- squared); rows before it were taken by other claimers. Ordered like the claim, so
                -- the planner walks the same indexes (EXISTS would drop the ORDER BY and LIMIT).
                IF v_last_id IS NULL THEN
                    v_more := (
                        SELECT t.id FROM tasks t
                        WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                          AND t.run_at <= v_now AND t.run_at >= v_min_run_at
                          AND (t.good_until IS NULL OR t.good_until > v_now)
                          AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                          AND (t.priority, t.run_at) >= (coalesce(p_min_priority, -32768), v_min_run_at) AND t.priority <= coalesce(p_max_priority, 32767)
                        ORDER BY t.priority, t.run_at, t.id
                        LIMIT 1
                    ) IS NOT NULL;
                ELSE
                    v_more := (
                        SELECT t.id FROM tasks t
                        WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                          AND t.run_at <= v_now AND t.run_at >= v_min_run_at
                          AND (t.priority, t.run_at, t.id) > (v_last_priority, v_last_run_at, v_last_id)
                          AND (t.good_until IS NULL OR t.good_until > v_now)
                          AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                          AND t.priority BETWEEN coalesce(p_min_priority, -32768) AND coalesce(p_max_priority, 32767)
                        ORDER BY t.priority, t.run_at, t.id
                        LIMIT 1
                    ) IS NOT NULL;
                END IF;
            ELSE
                -- The queue ran short of rows it could lock, so every eligible row it did not take is
                -- one another transaction holds (a claimer about to commit, or anyone's lock): left
                -- behind all the same, or a worker that waits for notifications would never come
                -- back for it. Its Pending rows are the ones taken and the held ones: counting to
                -- one past those taken walks no further than that.
                v_more := (
                    SELECT count(*) FROM (
                        SELECT 1 FROM tasks t
                        WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                          AND t.run_at <= v_now AND t.run_at >= v_min_run_at
                          AND (t.good_until IS NULL OR t.good_until > v_now)
                          AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                          AND (t.priority, t.run_at) >= (coalesce(p_min_priority, -32768), v_min_run_at) AND t.priority <= coalesce(p_max_priority, 32767)
                        ORDER BY t.priority, t.run_at, t.id
                        LIMIT coalesce(v_got_pending, 0) + 1
                    ) x
                ) > coalesce(v_got_pending, 0);
            END IF;
            IF NOT v_more THEN
                -- Lapsed claims it did not take are left behind too, whichever way it ended.
                v_more := (
                    SELECT t.id FROM tasks t
                    WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                      AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now) AND t.id <> ALL (v_got)
                      AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                      AND t.priority BETWEEN coalesce(p_min_priority, -32768) AND coalesce(p_max_priority, 32767)
                    ORDER BY t.claim_expires_at
                    LIMIT 1
                ) IS NOT NULL;
            END IF;
            IF NOT v_more AND cardinality(v_open) > 0 THEN
                IF cardinality(v_got) >= v_want THEN
                    -- Rows it saw and did not take; with nothing wanted, any row behind a gate.
                    v_more := v_gated_seen > v_got_gated
                        OR (v_want = 0 AND EXISTS (
                            SELECT FROM unnest(v_open, v_opened_at) AS g(gate, opened_at)
                            CROSS JOIN LATERAL (
                                SELECT 1 FROM tasks t
                                WHERE t.gate = g.gate AND hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue
                                  AND t.state = 'WAITING'
                                  AND gated_claimable(t.run_at, t.good_until, t.flags, t.priority, g.opened_at, v_now, v_min_run_at,
                                                       p_forbidden, p_min_priority, p_max_priority)
                                LIMIT 1
                            ) x));
                ELSE
                    -- Short of rows it could lock: rows of its gates that others hold are left
                    -- behind too (as Pending ones are, above).
                    v_more := (
                        SELECT count(*) FROM (
                            SELECT 1 FROM unnest(v_open, v_opened_at) AS g(gate, opened_at)
                            CROSS JOIN LATERAL (
                                SELECT 1 FROM tasks t
                                WHERE t.gate = g.gate AND hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue
                                  AND t.state = 'WAITING'
                                  AND gated_claimable(t.run_at, t.good_until, t.flags, t.priority, g.opened_at, v_now, v_min_run_at,
                                                       p_forbidden, p_min_priority, p_max_priority)
                                LIMIT v_got_gated + 1
                            ) x
                            LIMIT v_got_gated + 1
                        ) y
                    ) > v_got_gated;
                END IF;
                IF NOT v_more AND v_open_more THEN
                    -- Rows behind the open gates it did not visit.
                    v_more := EXISTS (
                        SELECT FROM task_gates g
                        CROSS JOIN LATERAL (
                            SELECT 1 FROM tasks t
                            WHERE t.gate = g.gate AND hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue
                              AND t.state = 'WAITING'
                              AND gated_claimable(t.run_at, t.good_until, t.flags, t.priority, g.opened_at, v_now, v_min_run_at,
                                                   p_forbidden, p_min_priority, p_max_priority)
                            LIMIT 1
                        ) x
                        WHERE g.queue = v_queue AND g.opened_at IS NOT NULL AND g.gate <> ALL (v_open)
                          AND (g.priority, g.opened_at) >= (coalesce(p_min_priority, -32768), v_min_run_at)
                          AND g.priority <= coalesce(p_max_priority, 32767));
                END IF;
            END IF;
        END IF;
    END LOOP;
    IF NOT v_more THEN
        SELECT ms(min(d.run_at)) - ms(v_now) INTO v_next
        FROM unnest(p_queues) AS q(name),
        LATERAL (
            SELECT t.run_at FROM tasks t
            WHERE t.queue = q.name AND t.state = 'PENDING' AND t.run_at > v_now AND t.run_at > t.enqueued_at
            ORDER BY t.run_at
            LIMIT 1
        ) d;
    END IF;

    IF cardinality(v_ids) > 0 THEN
        -- Rows by `id = ANY (array)`, an index scan of the primary key: a join with the id list
        -- lets the planner hash the whole live table instead, once the batch is large.
        v_start := v_ids[1:greatest(p_start_now, 0)];
        RETURN QUERY
        WITH claimed AS (
            UPDATE tasks t SET
                state = CASE WHEN t.id = ANY (v_start) THEN 'RUNNING' ELSE 'CLAIMED' END,
                lease = t.lease + 1,
                claimed_by = p_worker,
                claim_token = p_token,
                claimed_at = v_now,
                attempts = t.attempts + CASE WHEN t.id = ANY (v_start) THEN 1 ELSE 0 END,
                started_at = CASE WHEN t.id = ANY (v_start) THEN v_now ELSE t.started_at END,
                heartbeat_at = CASE WHEN t.id = ANY (v_start) THEN v_now END,
                claim_expires_at = CASE WHEN t.id = ANY (v_start) THEN NULL
                                        ELSE v_now + p_lease_ms * interval '1 millisecond' END,
                -- A row behind a gate becomes due when its gate opened, as a promotion makes it.
                run_at = CASE WHEN t.state = 'WAITING'
                              THEN greatest(t.run_at, (SELECT o.opened_at
                                                       FROM unnest(v_seen_gates, v_seen_opened) AS o(gate, opened_at)
                                                       WHERE o.gate = t.gate AND o.opened_at IS NOT NULL
                                                       LIMIT 1))
                              ELSE t.run_at END,
                gate = NULL
            WHERE t.id = ANY (v_ids)
            RETURNING t.id, t.lease, t.name, t.queue, t.args, t.priority, t.state = 'RUNNING' AS start, t.attempts,
                      t.retries, t.retry, t.good_until IS NOT NULL AS expires, t.enqueued_at, t.run_at
        )
        SELECT c.id, c.lease, c.name, c.queue, c.args, c.priority, c.start,
               CASE WHEN c.start THEN c.attempts ELSE c.attempts + 1 END, c.retries, c.retry, c.expires, v_more, v_next,
               ms(c.enqueued_at), ms(c.run_at)
        FROM claimed c
        JOIN unnest(v_ids) WITH ORDINALITY AS o(id, ord) ON o.id = c.id
        ORDER BY o.ord;
    END IF;
    IF cardinality(v_drained) > 0 THEN
        -- Open gates with nothing WAITING left (taken, this claim's rows included, or
        -- cancelled). A row another transaction holds is still WAITING here: its gate stays.
        DELETE FROM task_gates g
        USING (SELECT x.gate, x.queue FROM task_gates x
               JOIN unnest(v_drained, v_drained_queue) AS d(gate, queue) ON x.gate = d.gate AND x.queue = d.queue
               WHERE NOT EXISTS (SELECT FROM tasks t
                                 WHERE t.gate = x.gate AND hashtext(t.queue) = hashtext(x.queue) AND t.queue = x.queue
                                   AND t.state = 'WAITING')
               FOR UPDATE OF x SKIP LOCKED) d
        WHERE g.gate = d.gate AND g.queue = d.queue;
    END IF;
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::text, NULL::text, NULL::jsonb, NULL::smallint,
                        NULL::boolean, NULL::integer, NULL::integer, NULL::jsonb, NULL::boolean, v_more, v_next,
                        NULL::bigint, NULL::bigint;
END;
$$;
