-- Canter schema, version 10: workflows, graphs of tasks where a task runs once the tasks it
-- depends on have finished (`canter::workflow` states the rules; this is their SQL).
--
-- A step is an ordinary task row. A step with parents is written WAITING, which no claim takes
-- (the claim's index holds PENDING rows only); the finish of its parents decides it: promoted
-- to PENDING, or moved to `finished_tasks` as SKIPPED. Two small tables hold the graph:
-- `workflows` (one row per workflow, written at submit, at pause, resume and cancel, when a
-- step's failure pauses it, and when a sink step finishes without completing) and
-- `workflow_edges`; `workflow_steps` holds each step's join: its
-- parents, how many must satisfy their edge (`required`), and how many finished satisfying it
-- or not. No per-state counts are kept on the workflow's row: a fan-out of 10,000 steps
-- finishing at once would serialize on it; reading a workflow counts its steps' rows.
--
-- Promotion happens in the statement that finishes a parent, whatever statement that is (a
-- worker's finish, an operator's, a cancel, an expiry, the reaper, a release of earlier
-- code), when it ends: a trigger on `finished_tasks` sees the rows the statement moved (one
-- call per statement, over all its rows: one event for their workflows, so a failure among
-- them pauses a workflow that pauses on error before any of their children decide), updates
-- their children's counts, promotes the children whose join is satisfied and skips those it
-- can no longer be, goes on with the skipped ones as finished parents until nothing more is
-- skipped, and then notifies each queue that received promoted steps once.
--
-- Online-safe: new tables, functions and a trigger; earlier releases never write WAITING rows,
-- and their finishes of steps promote as this release's do.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (10, 1, 'workflows: steps that wait for their parents, promoted in the finishing statement');

CREATE TABLE workflows (
    id                   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                 text        NOT NULL,
    on_error             text        NOT NULL, -- CONTINUE or PAUSE
    paused               boolean     NOT NULL DEFAULT false,
    cancelled            boolean     NOT NULL DEFAULT false,
    -- A sink step (one without children) finished without completing: the workflow fails
    -- once every step finished. Kept here, as purge may delete the step's row.
    sink_failed          boolean     NOT NULL DEFAULT false,
    submitted_at         timestamptz NOT NULL,
    -- The notification channels of the schema (PgSchema's), for the trigger, which has no
    -- parameters: queues of promoted steps, and the done channel for skipped ones.
    queue_channel_prefix text        NOT NULL,
    done_channel         text        NOT NULL
);

CREATE TABLE workflow_steps (
    task_id     bigint  PRIMARY KEY,
    workflow_id bigint  NOT NULL,
    step        integer NOT NULL,
    parents     integer NOT NULL,
    -- Parents that must finish satisfying their edge: all, one, or a quorum.
    required    integer NOT NULL,
    satisfied   integer NOT NULL DEFAULT 0,
    unsatisfied integer NOT NULL DEFAULT 0,
    -- A step without children: the workflow completes when every sink completed.
    sink        boolean NOT NULL,
    -- A workflow's steps, for reading it and for its cancel (a new table: built empty).
    UNIQUE (workflow_id, step)
);

CREATE TABLE workflow_edges (
    parent       bigint  NOT NULL,
    child        bigint  NOT NULL,
    -- Any finish of the parent satisfies the edge, not only its completion.
    allow_failed boolean NOT NULL,
    PRIMARY KEY (parent, child),
    -- A step's parents: what it waits for, and their results.
    UNIQUE (child, parent)
);

-- Promotes the WAITING steps among `p_steps` whose join is satisfied and skips those whose join
-- can no longer be, unless their workflow is paused or cancelled. Returns the skipped ones
-- (moved to `finished_tasks` as SKIPPED), whose own children the caller settles next, and the
-- promoted ones, whose queues the caller notifies.
CREATE FUNCTION workflow_decide(p_steps bigint[], OUT skipped bigint[], OUT promoted bigint[])
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
BEGIN
    WITH ready AS (
        UPDATE tasks t SET state = 'PENDING', run_at = greatest(t.run_at, db_now())
        FROM workflow_steps s JOIN workflows w ON w.id = s.workflow_id
        WHERE s.task_id = ANY (p_steps) AND t.id = s.task_id AND t.state = 'WAITING'
          AND NOT w.paused AND NOT w.cancelled AND s.satisfied >= s.required
        RETURNING t.id
    )
    SELECT coalesce(array_agg(r.id), '{}') INTO promoted FROM ready r;

    WITH doomed AS (
        DELETE FROM tasks t
        USING workflow_steps s, workflows w
        WHERE s.task_id = ANY (p_steps) AND t.id = s.task_id AND w.id = s.workflow_id AND t.state = 'WAITING'
          AND NOT w.paused AND NOT w.cancelled AND s.parents - s.unsatisfied < s.required
        RETURNING t.*, w.done_channel
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
    notified AS (
        SELECT count(pg_notify(c.done_channel, c.ids)) AS n
        FROM (SELECT d.done_channel, string_agg(d.id::text, ',') AS ids FROM doomed d GROUP BY d.done_channel) c
        WHERE EXISTS (SELECT FROM listeners l WHERE l.channel = c.done_channel)
    )
    SELECT coalesce(array_agg(m.id), '{}') INTO skipped FROM moved m CROSS JOIN notified;
END;
$$;

-- Settles the children of steps that finished (`p_finished`, in states `p_states`), and the
-- steps `p_decide` (a resume's): each child's counts take its parents' outcomes (satisfied by
-- a completion, or by any finish through an `allow_failed` edge), then `workflow_decide`
-- promotes or skips it; skipped children are finished parents in turn, until nothing more is
-- skipped. A failure, cancel or expiry pauses a workflow whose `on_error` says so, before any
-- step decides. Each queue that received promoted steps is notified once, at the end, with
-- their most urgent priority.
CREATE FUNCTION workflow_settle(p_finished bigint[], p_states text[], p_decide bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
DECLARE
    v_children bigint[] := coalesce(p_decide, '{}');
    v_skipped  bigint[];
    v_ready    bigint[];
    v_promoted bigint[] := '{}';
BEGIN
    LOOP
        IF cardinality(p_finished) > 0 THEN
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

            WITH deltas AS (
                SELECT e.child,
                       count(*) FILTER (WHERE f.state = 'COMPLETED' OR e.allow_failed) AS satisfied,
                       count(*) FILTER (WHERE NOT (f.state = 'COMPLETED' OR e.allow_failed)) AS unsatisfied
                FROM unnest(p_finished, p_states) AS f(id, state)
                JOIN workflow_edges e ON e.parent = f.id
                GROUP BY e.child
            ),
            -- In id order, as every statement locks rows: two finishes of parents of the same
            -- children never deadlock.
            locked AS (
                SELECT s.task_id FROM workflow_steps s
                WHERE s.task_id IN (SELECT d.child FROM deltas d)
                ORDER BY s.task_id
                FOR UPDATE
            ),
            counted AS (
                UPDATE workflow_steps s
                SET satisfied = s.satisfied + d.satisfied, unsatisfied = s.unsatisfied + d.unsatisfied
                FROM deltas d
                WHERE s.task_id = d.child AND s.task_id IN (SELECT l.task_id FROM locked l)
                RETURNING s.task_id
            )
            SELECT v_children || coalesce(array_agg(c.task_id ORDER BY c.task_id), '{}') INTO v_children
            FROM counted c;
        END IF;
        EXIT WHEN cardinality(v_children) = 0;

        SELECT d.skipped, d.promoted INTO v_skipped, v_ready FROM workflow_decide(v_children) d;
        v_promoted := v_promoted || v_ready;
        p_finished := v_skipped;
        p_states := array_fill('SKIPPED'::text, ARRAY[cardinality(v_skipped)]);
        v_children := '{}';
    END LOOP;

    PERFORM pg_notify(q.prefix || q.queue, q.priority::text)
    FROM (SELECT t.queue, w.queue_channel_prefix AS prefix, min(t.priority) AS priority
          FROM tasks t
          JOIN workflow_steps s ON s.task_id = t.id
          JOIN workflows w ON w.id = s.workflow_id
          WHERE t.id = ANY (v_promoted)
          GROUP BY t.queue, w.queue_channel_prefix) q;
END;
$$;

-- The trigger: every statement that moves rows to `finished_tasks` settles the steps among
-- them. The skips `workflow_settle` makes move rows too, which call it again (one level down,
-- or at the top in a resume): those are left to the loop that made them, so a long chain of
-- skips is a loop, not a recursion.
-- SECURITY DEFINER: a role that may finish tasks (a worker's, an operator's, one granted before
-- this version) settles their children without rights on the workflow tables.
CREATE FUNCTION workflow_after_finish() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_min bigint;
    v_max bigint;
    v_ids bigint[];
    v_states text[];
BEGIN
    IF pg_trigger_depth() > 1 THEN
        RETURN NULL;
    END IF;
    -- Most finishes hold no step: one probe of the ids' range keeps them at the cost of a
    -- finish without workflows (a probe per row costs a 5,000-row finish about a fifth more).
    SELECT min(m.id), max(m.id) INTO v_min, v_max FROM moved m;
    IF v_min IS NULL OR NOT EXISTS (SELECT FROM workflow_steps s WHERE s.task_id BETWEEN v_min AND v_max) THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(m.id), array_agg(m.state) INTO v_ids, v_states
    FROM moved m
    WHERE m.state <> 'SKIPPED' AND EXISTS (SELECT FROM workflow_steps s WHERE s.task_id = m.id);
    IF v_ids IS NOT NULL THEN
        PERFORM workflow_settle(v_ids, v_states, '{}');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER workflow_after_finish
AFTER INSERT ON finished_tasks
REFERENCING NEW TABLE AS moved
FOR EACH STATEMENT EXECUTE FUNCTION workflow_after_finish();

-- Resumes workflow `p_workflow`: what its waiting steps' joins decided while it was paused
-- applies now, skips and what they decide included, with one notification per queue. Returns
-- whether it was paused.
CREATE FUNCTION workflow_resume(p_workflow bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
DECLARE
    v_resumed boolean;
BEGIN
    UPDATE workflows w SET paused = false WHERE w.id = p_workflow AND w.paused AND NOT w.cancelled
    RETURNING true INTO v_resumed;
    IF v_resumed THEN
        PERFORM workflow_settle('{}', '{}', ARRAY(
            SELECT s.task_id FROM workflow_steps s JOIN tasks t ON t.id = s.task_id
            WHERE s.workflow_id = p_workflow AND t.state = 'WAITING'
            ORDER BY s.task_id));
    END IF;
    RETURN coalesce(v_resumed, false);
END;
$$;
