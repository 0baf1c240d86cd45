-- Canter schema, version 13: claims that start from an announced run-at.
--
-- `claim_tasks()` gains `p_min_run_at` (ms on the database's clock): a claim takes, and sees
-- (its "more" probes), only Pending tasks due at that time or later; lapsed claims and the
-- wake-up hint (`next_run_in_ms`) are unchanged. Enqueues without keys announce the earliest
-- run-at they wrote beside their most urgent priority (`"<priority> <run-at>"`), and a worker
-- whose passes since its last full look were woken only by such announcements claims from the
-- earliest of them on.
--
-- Why: with the xmin held (a long transaction, a replication slot's feedback), every task
-- claimed leaves an entry in `tasks_claim_idx` that nothing can remove, and each claim walked
-- them all, fetching each row to see it is gone (15 ms a walk after a minute at 1,000 tasks a
-- second, twice a claim). The scans of Pending rows now start at (`p_min_priority`, run-at
-- bound), a row comparison on the index's second and third columns: a worker sends the most
-- urgent announced priority as `p_min_priority` with the earliest announced run-at, and the
-- entries before that key are not visited at all (`run_at >= bound` alone, as a filter on the
-- index's entries, would still read each of them: 5 ms per 100,000).
--
-- A new overload rather than a changed function: workers of earlier versions go on calling
-- 0012's fifteen-argument `claim_tasks()` (and read payloads with a run-at as announcing no
-- priority: they claim in a pass, without an urgent claim).
--
-- Online-safe: a new function.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (13, 1, 'claim_tasks() from an announced run-at: claims pass over rows claimed before');

CREATE FUNCTION claim_tasks(
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
        IF v_want > 0 THEN
            -- Queues are distinct, so rows of earlier queues (in `v_ids`) cannot turn up here.
            WITH pend AS (
                SELECT t.id, t.priority, t.run_at, true AS pending FROM tasks t
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
                SELECT t.id, t.priority, t.run_at, false AS pending FROM tasks t
                WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                  AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                  AND t.priority BETWEEN coalesce(p_min_priority, -32768) AND coalesce(p_max_priority, 32767)
                ORDER BY t.priority, t.run_at, t.id
                LIMIT v_want
                FOR UPDATE SKIP LOCKED
            ),
            chosen AS (
                SELECT u.id, u.priority, u.run_at, u.pending
                FROM (SELECT * FROM pend UNION ALL SELECT * FROM lapsed) u
                ORDER BY u.priority, u.run_at, u.id
                LIMIT v_want
            )
            SELECT coalesce(array_agg(c.id ORDER BY c.priority, c.run_at, c.id), '{}'),
                   (array_agg(c.priority ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   (array_agg(c.run_at ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   (array_agg(c.id ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1],
                   count(*) FILTER (WHERE c.pending)
            INTO v_got, v_last_priority, v_last_run_at, v_last_id, v_got_pending
            FROM chosen c;
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
                                        ELSE v_now + p_lease_ms * interval '1 millisecond' END
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
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::text, NULL::text, NULL::jsonb, NULL::smallint,
                        NULL::boolean, NULL::integer, NULL::integer, NULL::jsonb, NULL::boolean, v_more, v_next,
                        NULL::bigint, NULL::bigint;
END;
$$;
