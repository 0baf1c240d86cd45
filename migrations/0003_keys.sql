-- Canter schema, version 3: keys.
--
-- 1. Which keys are idempotency keys (`KeyMode::Idempotent`), so that a purge of finished tasks
--    keeps the tasks they name for `recovery.idempotency_retention_ms` (forever by default).
-- 2. `enqueue()` locks and writes only the Pending holders it updates in place: a Claimed or
--    Running holder's row is left alone (its worker's heartbeats and finish never wait on an
--    enqueuer's transaction); the key moves to the new task in `task_keys` alone.
-- 3. `remove_key()`: takes the key's advisory lock first, then rows, as `enqueue()` does.
--
-- A key belongs to a task while `task_keys` names it: a row's own `key` column may still carry
-- a key that moved on (`canter::postgres` reads keys through `task_keys`).
--
-- Online-safe: the column is added without a rewrite (a constant default is stored once in the
-- catalog), and no lock is waited for longer than the timeout below.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (3, 1, 'keys: which are idempotency keys; enqueue() and remove_key() leave the rows of running holders alone');

-- When an idempotent enqueue took the key, or first relied on it when another mode took it;
-- NULL for a key of another mode. Rows written before this migration read '-infinity': their
-- mode was not stored, so they count as idempotency keys (the safe reading), aged from their
-- task's enqueue (`greatest(idempotent_since, enqueued_at)` is the key's age everywhere).
ALTER TABLE task_keys ADD COLUMN idempotent_since timestamptz DEFAULT '-infinity';
ALTER TABLE task_keys ALTER COLUMN idempotent_since DROP DEFAULT;

-- Enqueue a batch as one statement; see 0001_schema.sql for the contract, unchanged. Locks:
-- the keys' advisory locks (in key order), then the Pending holders this batch may update in
-- place (replace modes, in id order, as finishers lock rows). Holders other modes only read,
-- and Claimed or Running holders, are not locked. A finished holder of a key that moves gives
-- it up on its row (no worker writes a finished row).
CREATE OR REPLACE FUNCTION enqueue(
    p_names text[], p_args jsonb[], p_queues text[], p_priorities smallint[],
    p_delays bigint[], p_ats bigint[], p_good_until bigint[], p_retry jsonb[], p_keys text[],
    p_modes text[], p_flags text[], p_write boolean, p_channel_prefix text, p_lock_prefix text)
RETURNS TABLE (ord bigint, id bigint, problem text, detail_id bigint, run_at_ms bigint, good_until_ms bigint)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz := db_now();
    v_key    text;
    v_bad    record;
    r        record;
    v_holder bigint;
    v_since  timestamptz;
    v_state  text;
    v_id     bigint;
    v_ids    bigint[] := '{}';
    v_queues text[] := '{}';
BEGIN
    IF coalesce(cardinality(p_names), 0) = 0 THEN
        RETURN;
    END IF;
    FOR v_key IN SELECT DISTINCT k.key FROM unnest(p_keys) AS k(key) WHERE k.key IS NOT NULL ORDER BY k.key LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_prefix || v_key, 0));
    END LOOP;
    IF p_write THEN
        -- A holder claimed meanwhile fails the state check once its claimer commits, and is
        -- not locked.
        PERFORM FROM tasks t
        WHERE t.id IN (SELECT k.task_id FROM task_keys k
                       JOIN unnest(p_keys, p_modes) AS i(key, mode) ON k.key = i.key
                       WHERE i.mode IN ('replace', 'preserve_run_at'))
          AND t.state = 'PENDING'
        ORDER BY t.id
        FOR UPDATE;
    END IF;

    -- The checks, against the rows before the batch (a batch uses a key in one mode, and an
    -- idempotency key with one name and args: the client refuses others before sending).
    SELECT c.ord, c.problem, c.run_at, c.good_until, c.holder INTO v_bad
    FROM (
        SELECT i.ord, due_at(i.delay, i.at, v_now) AS run_at, i.good_until, coalesce(t.id, f.id) AS holder,
               CASE WHEN i.good_until IS NOT NULL AND due_at(i.delay, i.at, v_now) >= at_ms(i.good_until)
                        THEN 'run_at_after_good_until'
                    WHEN coalesce(t.id, f.id) IS NOT NULL
                         AND (coalesce(t.name, f.name), coalesce(t.args, f.args)) IS DISTINCT FROM (i.name, i.args)
                        THEN 'payload_mismatch'
               END AS problem
        FROM unnest(p_names, p_args, p_delays, p_ats, p_good_until, p_keys, p_modes)
             WITH ORDINALITY AS i(name, args, delay, at, good_until, key, mode, ord)
        LEFT JOIN task_keys k ON k.key = i.key AND i.mode = 'idempotent'
        LEFT JOIN tasks t ON t.id = k.task_id
        LEFT JOIN finished_tasks f ON f.id = k.task_id
    ) c
    WHERE c.problem IS NOT NULL
    ORDER BY c.ord
    LIMIT 1;
    IF FOUND THEN
        IF v_bad.problem = 'run_at_after_good_until' THEN
            RETURN QUERY SELECT v_bad.ord, NULL::bigint, v_bad.problem, NULL::bigint, ms(v_bad.run_at), v_bad.good_until;
        ELSE
            RETURN QUERY SELECT v_bad.ord, NULL::bigint, v_bad.problem, v_bad.holder, NULL::bigint, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    IF NOT p_write THEN
        RETURN;
    END IF;

    FOR r IN
        SELECT i.ord, i.name, i.args, i.queue, i.priority, at_ms(i.good_until) AS good_until, i.retry, i.key,
               i.mode, due_at(i.delay, i.at, v_now) AS run_at, string_to_array(i.flags, ',') AS flags
        FROM unnest(p_names, p_args, p_queues, p_priorities, p_delays, p_ats, p_good_until, p_retry, p_keys,
                    p_modes, p_flags)
             WITH ORDINALITY AS i(name, args, queue, priority, delay, at, good_until, retry, key, mode, flags, ord)
        ORDER BY i.ord
    LOOP
        v_id := NULL;
        v_holder := NULL;
        v_since := NULL;
        v_state := NULL;
        IF r.key IS NOT NULL THEN
            SELECT k.task_id, k.idempotent_since INTO v_holder, v_since FROM task_keys k WHERE k.key = r.key;
            -- NULL when the holder finished (or is gone).
            SELECT t.state INTO v_state FROM tasks t WHERE t.id = v_holder;
            IF r.mode = 'idempotent' AND (v_state IS NOT NULL OR EXISTS (SELECT FROM finished_tasks f WHERE f.id = v_holder)) THEN
                v_id := v_holder;
                IF v_since IS NULL THEN
                    -- Taken in another mode, relied on as an idempotency key from now on.
                    UPDATE task_keys k SET idempotent_since = v_now WHERE k.key = r.key;
                END IF;
            ELSIF r.mode = 'unsafe_dedupe' AND v_state IS NOT NULL THEN
                v_id := v_holder;
            ELSIF r.mode IN ('replace', 'preserve_run_at') AND v_state = 'PENDING' THEN
                UPDATE tasks t SET
                    name = r.name, queue = r.queue, priority = r.priority,
                    -- Batch tasks collect items: arrays append.
                    args = CASE WHEN jsonb_typeof(t.args) = 'array' AND jsonb_typeof(r.args) = 'array'
                                THEN t.args || r.args ELSE r.args END,
                    run_at = CASE WHEN r.mode = 'preserve_run_at' AND t.attempts = 0 THEN t.run_at ELSE r.run_at END,
                    good_until = r.good_until, retry = r.retry, flags = r.flags, retries = 0, error = NULL
                WHERE t.id = v_holder AND t.state = 'PENDING';
                -- Not found: claimed since it was read; it runs on and a new task takes the key.
                IF FOUND THEN
                    v_id := v_holder;
                    v_queues := v_queues || r.queue;
                END IF;
            ELSIF v_state IS NULL AND v_holder IS NOT NULL THEN
                UPDATE finished_tasks f SET key = NULL WHERE f.id = v_holder;
            END IF;
            -- A Claimed or Running holder is not written: it runs on, and no longer holds the
            -- key once `task_keys` names the new task.
        END IF;
        IF v_id IS NULL THEN
            INSERT INTO tasks (name, queue, priority, args, state, run_at, enqueued_at, good_until, retry, key, flags)
            VALUES (r.name, r.queue, r.priority, r.args, 'PENDING', r.run_at, v_now, r.good_until, r.retry, r.key,
                    r.flags)
            RETURNING tasks.id INTO v_id;
            IF r.key IS NOT NULL THEN
                INSERT INTO task_keys AS k (key, task_id, idempotent_since)
                VALUES (r.key, v_id, CASE WHEN r.mode = 'idempotent' THEN v_now END)
                ON CONFLICT (key) DO UPDATE SET task_id = EXCLUDED.task_id, idempotent_since = EXCLUDED.idempotent_since;
            END IF;
            v_queues := v_queues || r.queue;
        END IF;
        v_ids := v_ids || v_id;
    END LOOP;

    -- One notification per queue that received a new or updated task.
    PERFORM pg_notify(p_channel_prefix || q.queue, '') FROM (SELECT DISTINCT x.queue FROM unnest(v_queues) AS x(queue)) q;

    RETURN QUERY
    SELECT o.ord, o.id, NULL::text, NULL::bigint, NULL::bigint, NULL::bigint
    FROM unnest(v_ids) WITH ORDINALITY AS o(id, ord)
    ORDER BY o.ord;
END;
$$;

-- Frees key `p_key` (see `canter::postgres::PgStore::remove_key`): its task is cancelled (error
-- `p_error`, waiters notified on `p_done_channel`) if Pending, runs on if Claimed or Running,
-- and gives it up if finished. Returns the task and `cancelled`, `detached` or `freed`; no row
-- for an unknown key. Locks as `enqueue()` does: the key's advisory lock, then the Pending
-- holder's row, then the key's row; a Claimed or Running holder's row is not touched.
CREATE FUNCTION remove_key(p_key text, p_error jsonb, p_done_channel text, p_lock_prefix text)
RETURNS TABLE (task_id bigint, action text)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_holder bigint;
    v_action text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_prefix || p_key, 0));
    SELECT k.task_id INTO v_holder FROM task_keys k WHERE k.key = p_key;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- A holder claimed meanwhile fails the state check once its claimer commits, and is not
    -- locked.
    PERFORM FROM tasks t WHERE t.id = v_holder AND t.state = 'PENDING' FOR UPDATE;
    IF FOUND THEN
        WITH gone AS (
            DELETE FROM tasks t WHERE t.id = v_holder RETURNING t.*
        )
        INSERT INTO finished_tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token,
                                    claimed_at, heartbeat_at, started_at, attempts, retries, run_at, enqueued_at,
                                    good_until, retry, key, flags, error, result, finished_at)
        SELECT g.id, g.name, g.queue, g.priority, g.args, 'CANCELLED', g.lease, g.claimed_by, g.claim_token,
               g.claimed_at, g.heartbeat_at, g.started_at, g.attempts, g.retries, g.run_at, g.enqueued_at,
               g.good_until, g.retry, NULL, g.flags, p_error, NULL, db_now()
        FROM gone g;
        PERFORM pg_notify(p_done_channel, v_holder::text);
        v_action := 'cancelled';
    ELSIF EXISTS (SELECT FROM tasks t WHERE t.id = v_holder) THEN
        v_action := 'detached';
    ELSE
        UPDATE finished_tasks f SET key = NULL WHERE f.id = v_holder;
        v_action := 'freed';
    END IF;
    DELETE FROM task_keys k WHERE k.key = p_key;
    RETURN QUERY SELECT v_holder, v_action;
END;
$$;
