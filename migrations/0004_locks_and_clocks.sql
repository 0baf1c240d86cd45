-- Canter schema, version 4: locks only Canter's roles can take, and clocks read after locks.
--
-- 1. The locks that serialize capped claims and starts (`claim_locks`) and reapers
--    (`reaper_lock`) are row locks of this schema's tables. The advisory locks they replace
--    were public numbers: any role that could connect could hold one and stall every claim of
--    a capped queue, or every reaper. Locking a row takes the UPDATE privilege on its table.
-- 2. `enqueue()` and `remove_key()` wait for a key's advisory lock at most 5 s, whatever
--    session calls them.
-- 3. `db_clock()`: the time now, as opposed to `db_now()`, the time the transaction began.
--    `claim()` and `start_tasks()` take their times after their locks: a claim that waited
--    for a lock dated its starts and leases from before the wait, so its tasks looked stale to
--    the reaper as soon as it committed.
--
-- `claim()` and `start_tasks()` keep their signatures and contracts (see 0001_schema.sql):
-- workers of every version call the same functions, so a mixed fleet shares one set of locks.
--
-- Online-safe: two new tables and functions replaced in place; no lock is waited for longer
-- than the timeout below.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (4, 1, 'claim and reaper locks on rows of claim_locks and reaper_lock; db_clock() read after locks');

-- Enqueuers of a key take turns on an advisory lock of the key (0003), a number anyone who can
-- connect could hold: an application's own connection (enqueue_in) may carry no lock_timeout,
-- so the functions bound their waits themselves.
ALTER FUNCTION enqueue(text[], jsonb[], text[], smallint[], bigint[], bigint[], bigint[], jsonb[], text[], text[],
                       text[], boolean, text, text)
    SET lock_timeout = '5s';
ALTER FUNCTION remove_key(text, jsonb, text, text) SET lock_timeout = '5s';

-- The time now (`clock_timestamp()`), for times taken after a statement waited.
CREATE FUNCTION db_clock() RETURNS timestamptz
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT clock_timestamp() $$;

-- One row per lock key of a capped queue or of the cluster-wide cap
-- (`canter::postgres::claim_lock_keys`), created at its first use.
CREATE TABLE claim_locks (
    key bigint PRIMARY KEY
);

-- The one row a reaper locks (`FOR UPDATE SKIP LOCKED`): one reaper at a time.
CREATE TABLE reaper_lock (
    id boolean PRIMARY KEY DEFAULT true CHECK (id)
);
INSERT INTO reaper_lock DEFAULT VALUES;

-- Locks the rows of `p_keys` (sorted by the caller) in key order, creating those that do not
-- exist yet; returns when every one is held by this transaction. Waits are bounded by the
-- session's `lock_timeout`. Nothing is locked before the rows are created: a transaction that
-- held one key while it waited to create another could deadlock with the one creating it.
CREATE FUNCTION take_claim_locks(p_keys bigint[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF coalesce(cardinality(p_keys), 0) = 0 THEN
        RETURN;
    END IF;
    IF (SELECT count(*) FROM claim_locks l WHERE l.key = ANY (p_keys))
       < (SELECT count(DISTINCT k.key) FROM unnest(p_keys) AS k(key)) THEN
        -- A key's first use: a concurrent creator of the same key waits for this one's commit.
        INSERT INTO claim_locks (key) SELECT DISTINCT k.key FROM unnest(p_keys) AS k(key) ORDER BY k.key
        ON CONFLICT (key) DO NOTHING;
    END IF;
    PERFORM FROM claim_locks l WHERE l.key = ANY (p_keys) ORDER BY l.key FOR UPDATE;
END;
$$;

-- One claim pass: as in 0001_schema.sql, with the locks and the clock above.
CREATE OR REPLACE FUNCTION claim(
    p_worker text, p_token bigint, p_queues text[], p_caps integer[], p_budget integer,
    p_hard boolean, p_cluster_cap integer, p_max_batch integer, p_lock_keys bigint[],
    p_start_now integer, p_lease_ms bigint, p_serial boolean[], p_forbidden text[])
RETURNS TABLE (id bigint, lease bigint, name text, queue text, args jsonb, priority smallint, started boolean,
               attempt integer, retries integer, retry jsonb, expires boolean, more boolean, next_run_in_ms bigint)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_next  bigint;
    v_now   timestamptz;
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
                  AND t.run_at <= v_now
                  AND (t.good_until IS NULL OR t.good_until > v_now)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                ORDER BY t.priority, t.run_at, t.id
                LIMIT v_want
                FOR UPDATE SKIP LOCKED
            ),
            lapsed AS (
                SELECT t.id, t.priority, t.run_at, false AS pending FROM tasks t
                WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                  AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
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
        IF NOT v_more AND cardinality(v_got) >= v_want THEN
            -- Was an eligible row left behind? Pending rows are probed after the last one this
            -- pass took, in claim order (one index descent: the rows it took are still Pending
            -- until the update below, and skipping them one by one would cost a pass's size
            -- squared); rows before it were taken by other claimers. Ordered like the claim, so
            -- the planner walks the same indexes (EXISTS would drop the ORDER BY and LIMIT).
            IF v_last_id IS NULL THEN
                v_more := (
                    SELECT t.id FROM tasks t
                    WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                      AND t.run_at <= v_now
                      AND (t.good_until IS NULL OR t.good_until > v_now)
                      AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                    ORDER BY t.priority, t.run_at, t.id
                    LIMIT 1
                ) IS NOT NULL;
            ELSE
                v_more := (
                    SELECT t.id FROM tasks t
                    WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                      AND t.run_at <= v_now
                      AND (t.priority, t.run_at, t.id) > (v_last_priority, v_last_run_at, v_last_id)
                      AND (t.good_until IS NULL OR t.good_until > v_now)
                      AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                    ORDER BY t.priority, t.run_at, t.id
                    LIMIT 1
                ) IS NOT NULL;
            END IF;
            v_more := v_more OR (
                SELECT t.id FROM tasks t
                WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                  AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now) AND t.id <> ALL (v_got)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                ORDER BY t.claim_expires_at
                LIMIT 1
            ) IS NOT NULL;
        ELSIF NOT v_more THEN
            -- The queue ran short of rows it could lock, so every eligible row it did not take is
            -- one another transaction holds (a claimer about to commit, or anyone's lock): left
            -- behind all the same, or a worker that waits for notifications would never come
            -- back for it. Its Pending rows are the ones taken and the held ones: counting to
            -- one past those taken walks no further than that.
            v_more := (
                SELECT count(*) FROM (
                    SELECT 1 FROM tasks t
                    WHERE hashtext(t.queue) = hashtext(v_queue) AND t.queue = v_queue AND t.state = 'PENDING'
                      AND t.run_at <= v_now
                      AND (t.good_until IS NULL OR t.good_until > v_now)
                      AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                    ORDER BY t.priority, t.run_at, t.id
                    LIMIT coalesce(v_got_pending, 0) + 1
                ) x
            ) > coalesce(v_got_pending, 0) OR (
                SELECT t.id FROM tasks t
                WHERE t.queue = v_queue AND t.state = 'CLAIMED' AND t.claim_expires_at <= v_now
                  AND t.run_at <= v_now AND (t.good_until IS NULL OR t.good_until > v_now) AND t.id <> ALL (v_got)
                  AND (p_forbidden IS NULL OR t.flags IS NULL OR NOT t.flags && p_forbidden)
                ORDER BY t.claim_expires_at
                LIMIT 1
            ) IS NOT NULL;
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
                      t.retries, t.retry, t.good_until IS NOT NULL AS expires
        )
        SELECT c.id, c.lease, c.name, c.queue, c.args, c.priority, c.start,
               CASE WHEN c.start THEN c.attempts ELSE c.attempts + 1 END, c.retries, c.retry, c.expires, v_more, v_next
        FROM claimed c
        JOIN unnest(v_ids) WITH ORDINALITY AS o(id, ord) ON o.id = c.id
        ORDER BY o.ord;
    END IF;
    RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::text, NULL::text, NULL::jsonb, NULL::smallint,
                        NULL::boolean, NULL::integer, NULL::integer, NULL::jsonb, NULL::boolean, v_more, v_next;
END;
$$;

-- Start claimed tasks: as in 0001_schema.sql, with the locks and the clock above.
CREATE OR REPLACE FUNCTION start_tasks(
    p_worker text, p_ids bigint[], p_leases bigint[], p_cap_queues text[], p_caps integer[],
    p_lock_keys bigint[], p_done_channel text, p_expired_error jsonb)
RETURNS TABLE (ord bigint, id bigint, outcome text, attempt integer)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz;
    v_ords    bigint[];
    v_ids     bigint[];
    v_out     text[];
    v_attempt integer[];
    v_expired bigint[];
BEGIN
    IF coalesce(cardinality(p_lock_keys), 0) > 0 THEN
        PERFORM take_claim_locks(p_lock_keys);
    END IF;
    -- Times from here on are taken after the locks: the transaction may have waited for them,
    -- and a start or a lease dated from its beginning would be that much older at commit.
    v_now := db_clock();
    WITH input AS (
        SELECT i.id, i.lease, i.ord FROM unnest(p_ids, p_leases) WITH ORDINALITY AS i(id, lease, ord)
    ),
    held AS (
        SELECT t.id, t.lease, t.state, t.queue, t.claim_expires_at, t.good_until, t.attempts
        FROM tasks t
        WHERE t.id = ANY (p_ids) AND t.claimed_by = p_worker AND t.state <> 'PENDING'
        ORDER BY t.id
        FOR UPDATE SKIP LOCKED
    ),
    -- The worker's rows another transaction holds, running or under a live claim as last
    -- committed: deferred, asked again later (not waited for). Others are lost.
    busy AS (
        SELECT t.id, t.lease FROM tasks t
        WHERE t.id = ANY (p_ids) AND t.claimed_by = p_worker
          AND (t.state = 'RUNNING'
               OR (t.state = 'CLAIMED' AND (t.claim_expires_at IS NULL OR t.claim_expires_at > v_now)))
          AND NOT EXISTS (SELECT FROM held h WHERE h.id = t.id)
    ),
    -- Per task, the first entry naming its current lease decides; later ones echo it.
    firsts AS (
        SELECT DISTINCT ON (i.id) i.id, i.ord
        FROM input i JOIN held h ON h.id = i.id AND h.lease = i.lease
        ORDER BY i.id, i.ord
    ),
    decided AS (
        SELECT f.id, f.ord, h.queue, h.attempts,
               CASE WHEN h.state = 'RUNNING' THEN 'started'
                    WHEN h.claim_expires_at IS NOT NULL AND h.claim_expires_at <= v_now THEN 'lost'
                    WHEN h.good_until IS NOT NULL AND h.good_until <= v_now THEN 'expired'
                    ELSE 'candidate' END AS what
        FROM firsts f JOIN held h ON h.id = f.id
    ),
    running AS (
        SELECT t.queue, count(*) AS n FROM tasks t
        WHERE t.state = 'RUNNING' AND t.queue = ANY (p_cap_queues)
        GROUP BY t.queue
    ),
    to_start AS (
        SELECT d.id
        FROM (
            SELECT d.id, d.queue, row_number() OVER (PARTITION BY d.queue ORDER BY d.ord) AS n
            FROM decided d WHERE d.what = 'candidate'
        ) d
        LEFT JOIN unnest(p_cap_queues, p_caps) AS c(queue, cap) ON c.queue = d.queue
        LEFT JOIN running r ON r.queue = d.queue
        WHERE c.cap IS NULL OR d.n <= c.cap - coalesce(r.n, 0)
    ),
    started AS (
        UPDATE tasks t SET state = 'RUNNING', attempts = t.attempts + 1, started_at = v_now, heartbeat_at = v_now,
                           claim_expires_at = NULL
        FROM to_start s
        WHERE t.id = s.id
        RETURNING t.id, t.attempts
    ),
    expired AS (
        DELETE FROM tasks t USING decided d
        WHERE t.id = d.id AND d.what = 'expired'
        RETURNING t.*
    ),
    moved AS (
        INSERT INTO finished_tasks (id, name, queue, priority, args, state, lease, claimed_by, claim_token, claimed_at,
                                    heartbeat_at, started_at, attempts, retries, run_at, enqueued_at, good_until, retry,
                                    key, flags, error, result, finished_at)
        SELECT e.id, e.name, e.queue, e.priority, e.args, 'EXPIRED', e.lease, e.claimed_by, e.claim_token, e.claimed_at,
               e.heartbeat_at, e.started_at, e.attempts, e.retries, e.run_at, e.enqueued_at, e.good_until, e.retry,
               e.key, e.flags, p_expired_error, NULL, v_now
        FROM expired e
        RETURNING finished_tasks.id
    ),
    outcome AS (
        SELECT d.id, coalesce(s.attempts, d.attempts) AS attempts,
               CASE WHEN d.what = 'candidate' THEN CASE WHEN s.id IS NULL THEN 'deferred' ELSE 'started' END
                    ELSE d.what END AS result
        FROM decided d LEFT JOIN started s ON s.id = d.id
    ),
    answer AS (
        SELECT i.ord, i.id,
               CASE WHEN EXISTS (SELECT FROM busy b WHERE b.id = i.id AND b.lease = i.lease) THEN 'deferred'
                    WHEN o.id IS NULL OR h.lease <> i.lease THEN 'lost'
                    WHEN f.ord = i.ord THEN o.result
                    WHEN o.result = 'expired' THEN 'lost'
                    ELSE o.result END AS outcome,
               o.attempts
        FROM input i
        LEFT JOIN held h ON h.id = i.id
        LEFT JOIN firsts f ON f.id = i.id
        LEFT JOIN outcome o ON o.id = i.id
    )
    SELECT coalesce(array_agg(a.ord ORDER BY a.ord), '{}'), coalesce(array_agg(a.id ORDER BY a.ord), '{}'),
           coalesce(array_agg(a.outcome ORDER BY a.ord), '{}'), coalesce(array_agg(a.attempts ORDER BY a.ord), '{}'),
           (SELECT array_agg(m.id) FROM moved m)
    INTO v_ords, v_ids, v_out, v_attempt, v_expired
    FROM answer a;

    -- Result waiters learn of expired tasks; payloads stay under the 8000-byte limit.
    PERFORM pg_notify(p_done_channel, string_agg(e.id::text, ','))
    FROM unnest(v_expired) WITH ORDINALITY AS e(id, n)
    GROUP BY (e.n - 1) / 300;
    RETURN QUERY SELECT a.ord, a.id, a.outcome, a.attempt FROM unnest(v_ords, v_ids, v_out, v_attempt) AS a(ord, id, outcome, attempt);
END;
$$;
