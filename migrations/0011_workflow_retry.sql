-- Canter schema, version 11: retrying a workflow (`canter::workflow`'s `retry_failed`).
--
-- Online-safe: one new function.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (11, 1, 'workflows: retry of the steps that did not complete, alone or with everything below them');

-- Retries workflow `p_workflow`: its steps that finished without completing (failed,
-- cancelled, expired, skipped) and, with `p_downstream`, every finished step below them go back
-- to WAITING (retries spent reset; attempts, history and last error kept; the run a finished row
-- held becomes an attempts row, as a requeue's); their children's counts forget their outcomes;
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

    -- The reset steps' children forget their outcomes; the rows are locked in id order, as the
    -- finish trigger locks them.
    WITH deltas AS (
        SELECT e.child,
               count(*) FILTER (WHERE f.state = 'COMPLETED' OR e.allow_failed) AS satisfied,
               count(*) FILTER (WHERE NOT (f.state = 'COMPLETED' OR e.allow_failed)) AS unsatisfied
        FROM finished_tasks f JOIN workflow_edges e ON e.parent = f.id
        WHERE f.id = ANY (v_reset)
        GROUP BY e.child
    ),
    locked AS (
        SELECT s.task_id FROM workflow_steps s
        WHERE s.task_id IN (SELECT d.child FROM deltas d)
        ORDER BY s.task_id
        FOR UPDATE
    )
    UPDATE workflow_steps s
    SET satisfied = s.satisfied - d.satisfied, unsatisfied = s.unsatisfied - d.unsatisfied
    FROM deltas d
    WHERE s.task_id = d.child AND s.task_id IN (SELECT l.task_id FROM locked l);

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

    UPDATE workflows w
    SET cancelled = false, sink_failed = false, paused = w.paused AND NOT w.cancelled AND NOT v_over
    WHERE w.id = p_workflow;
    PERFORM workflow_settle('{}', '{}', v_decide);
END;
$$;
