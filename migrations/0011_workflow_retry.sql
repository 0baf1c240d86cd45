-- Canter schema, version 11: retrying a workflow (`canter::workflow`'s `retry_failed`), and a
-- cheaper settling of finished steps' children.
--
-- The settling of version 10 wrote every child's counts, locked every child, and read the
-- promoted rows again to notify their queues: a 1 -> 10,000 fan-out's root finish took 200 ms.
-- Now the counts of a child are written only while it stays WAITING (a promoted or skipped
-- child's counts no longer matter: reading a workflow shows them for waiting steps only, and a
-- retry counts its steps' parents again); a child of one parent is not locked (no other finish
-- counts it); the promoted rows' queues come from the promoting statement itself.
--
-- Online-safe: functions replaced with the same signatures, one new, one dropped (only
-- `workflow_settle` called it). The trigger function is still its owner's (SECURITY DEFINER).
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (11, 1, 'workflows: retry of the steps that did not complete, alone or with everything below them; cheaper settling');

-- Settles the children of steps that finished (`p_finished`, in states `p_states`), and the
-- steps `p_decide` (a resume's, a retry's): each child's counts take its parents' outcomes
-- (satisfied by a completion, or by any finish through an `allow_failed` edge); a WAITING child
-- whose join is satisfied is promoted, one whose join can no longer be is skipped (moved to
-- `finished_tasks` as SKIPPED, its waiters notified), unless its workflow is paused or
-- cancelled; the others keep their new counts. Skipped children are finished parents in turn,
-- until nothing more is skipped. A failure, cancel or expiry pauses a workflow whose `on_error`
-- says so, before any step decides. Each queue that received promoted steps is notified once,
-- at the end, with their most urgent priority.
CREATE OR REPLACE FUNCTION workflow_settle(p_finished bigint[], p_states text[], p_decide bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
DECLARE
    v_decide     bigint[] := coalesce(p_decide, '{}');
    v_skipped    bigint[];
    v_channels   text[] := '{}';
    v_priorities smallint[] := '{}';
    v_woken      text[];
    v_urgency    smallint[];
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
                  GROUP BY s.workflow_id) x
            WHERE w.id = x.workflow_id
              AND ((x.failed AND w.on_error = 'PAUSE' AND NOT w.cancelled AND NOT w.paused)
                   OR (x.sink_failed AND NOT w.sink_failed));
        END IF;
        EXIT WHEN cardinality(p_finished) = 0 AND cardinality(v_decide) = 0;

        WITH deltas AS (
            SELECT x.child,
                   count(*) FILTER (WHERE x.satisfies) AS satisfied,
                   count(*) FILTER (WHERE NOT x.satisfies) AS unsatisfied
            FROM (SELECT e.child, f.state = 'COMPLETED' OR e.allow_failed AS satisfies
                  FROM unnest(p_finished, p_states) AS f(id, state)
                  JOIN workflow_edges e ON e.parent = f.id
                  UNION ALL
                  SELECT d.id, NULL FROM unnest(v_decide) AS d(id)) x
            GROUP BY x.child
        ),
        children AS (
            SELECT s.task_id, s.workflow_id, s.parents, s.required,
                   s.satisfied + d.satisfied AS satisfied, s.unsatisfied + d.unsatisfied AS unsatisfied
            FROM deltas d JOIN workflow_steps s ON s.task_id = d.child
        ),
        -- A child of several parents may be counted by finishes of its other parents in other
        -- transactions: its row is locked, in id order (as every statement locks rows: two
        -- finishes never deadlock), and read as the last of them left it.
        locked AS (
            SELECT s.task_id, s.workflow_id, s.parents, s.required, s.satisfied, s.unsatisfied
            FROM workflow_steps s
            WHERE s.task_id IN (SELECT c.task_id FROM children c WHERE c.parents > 1)
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
        ),
        kept AS (
            UPDATE workflow_steps s SET satisfied = j.satisfied, unsatisfied = j.unsatisfied
            FROM judged j
            WHERE s.task_id = j.task_id AND j.verdict = 'W'
              AND (s.satisfied <> j.satisfied OR s.unsatisfied <> j.unsatisfied)
        ),
        promoted AS (
            UPDATE tasks t SET state = 'PENDING', run_at = greatest(t.run_at, db_now())
            FROM judged j
            WHERE t.id = j.task_id AND j.verdict = 'R' AND t.state = 'WAITING'
            RETURNING j.queue_channel_prefix || t.queue AS channel, t.priority
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
            FROM (SELECT p.channel, min(p.priority) AS priority FROM promoted p GROUP BY p.channel) p
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

-- Settled by `workflow_settle` alone now.
DROP FUNCTION workflow_decide(bigint[]);

-- The trigger of version 10, probing each finished row once less: past the range probe, every
-- finished row goes to `workflow_settle`, whose joins leave the rows of plain tasks out.
CREATE OR REPLACE FUNCTION workflow_after_finish() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_min bigint;
    v_max bigint;
    v_ids bigint[];
    v_states text[];
BEGIN
    -- The skips `workflow_settle` makes move rows too: those are left to the loop that made
    -- them.
    IF pg_trigger_depth() > 1 THEN
        RETURN NULL;
    END IF;
    -- Most finishes hold no step: one probe of the ids' range keeps them at the cost of a
    -- finish without workflows.
    SELECT min(m.id), max(m.id) INTO v_min, v_max FROM moved m;
    IF v_min IS NULL OR NOT EXISTS (SELECT FROM workflow_steps s WHERE s.task_id BETWEEN v_min AND v_max) THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(m.id), array_agg(m.state) INTO v_ids, v_states FROM moved m WHERE m.state <> 'SKIPPED';
    IF v_ids IS NOT NULL THEN
        PERFORM workflow_settle(v_ids, v_states, '{}');
    END IF;
    RETURN NULL;
END;
$$;

-- Retries workflow `p_workflow`: its steps that finished without completing (failed,
-- cancelled, expired, skipped) and, with `p_downstream`, every finished step below them go back
-- to WAITING (retries spent reset; attempts, history and last error kept; the run a finished row
-- held becomes an attempts row, as a requeue's); they and their children count their parents again;
-- the workflow is no longer cancelled and no sink of it failed; then their joins decide, unless
-- the workflow is still paused (its resume decides them): a workflow whose steps had all
-- finished, or that was cancelled, is not. Refused whole, with `purged` > 0, when rows
-- of its steps were purged: their outcomes are gone. `known` is false for an unknown workflow.
CREATE FUNCTION workflow_retry(p_workflow bigint, p_downstream boolean,
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
    INSERT INTO tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, claimed_at,
                       claim_expires_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at,
                       good_until, retry, key, flags, error)
    OVERRIDING SYSTEM VALUE
    SELECT g.id, g.name, g.queue, g.priority, g.args, 'WAITING', g.lease, NULL, NULL, g.claimed_at, NULL, NULL,
           g.started_at, g.attempts, 0, g.run_at, g.enqueued_at, g.good_until, g.retry, g.key, g.flags, g.error
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
