-- Canter schema, version 6: enqueues announce the priority of what they wrote.
--
-- A queue's notification after an enqueue carries, as its payload, the most urgent (lowest)
-- priority among the tasks the statement wrote to that queue. A worker whose buffer holds less
-- urgent tasks claims the announced one at once, beside a claim pass already in flight, and it
-- starts before them (see `canter::worker`). Other notifications keep an empty payload, which
-- announces nothing; workers of earlier versions ignore payloads.
--
-- `enqueue()` (the keyed path) is replaced with that one change; its contract, signature and
-- settings (0004's lock timeout included) are as before. The other enqueue statements live in
-- the code.
--
-- Online-safe: a function replaced in place.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (6, 1, 'enqueue notifications announce the most urgent priority written');

CREATE OR REPLACE FUNCTION enqueue(
    p_names text[], p_args jsonb[], p_queues text[], p_priorities smallint[],
    p_delays bigint[], p_ats bigint[], p_good_until bigint[], p_retry jsonb[], p_keys text[],
    p_modes text[], p_flags text[], p_write boolean, p_channel_prefix text, p_lock_prefix text)
RETURNS TABLE (ord bigint, id bigint, problem text, detail_id bigint, run_at_ms bigint, good_until_ms bigint)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET lock_timeout = '5s'
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
    v_prios  smallint[] := '{}';
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
                    v_prios := v_prios || r.priority;
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
            v_prios := v_prios || r.priority;
        END IF;
        v_ids := v_ids || v_id;
    END LOOP;

    -- One notification per queue that received a new or updated task, announcing the most
    -- urgent priority among them.
    PERFORM pg_notify(p_channel_prefix || q.queue, q.priority::text)
    FROM (SELECT x.queue, min(x.priority) AS priority FROM unnest(v_queues, v_prios) AS x(queue, priority)
          GROUP BY x.queue) q;

    RETURN QUERY
    SELECT o.ord, o.id, NULL::text, NULL::bigint, NULL::bigint, NULL::bigint
    FROM unnest(v_ids) WITH ORDINALITY AS o(id, ord)
    ORDER BY o.ord;
END;
$$;
