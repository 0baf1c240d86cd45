-- Canter schema, version 1: tables, indexes, the clock, and the functions that need more than
-- one statement (enqueue, claim, start).
--
-- Every name here is unqualified: `canter::postgres::migrate` runs this file with `search_path`
-- set to the target schema alone, so everything lands in that schema, and each function pins
-- it with `SET search_path FROM CURRENT`. Statements sent from Rust qualify every name instead.
--
-- The functions below plan their statements once per connection (`force_generic_plan`: no
-- re-planning on every call), at each statement's first run, and keep those plans until the
-- table's statistics change. A worker's first claim often meets a nearly empty table, where a
-- sequential scan looks cheapest, and a plan made then would scan the whole table on every
-- call once it fills, for as long as no vacuum or analyze comes (over 1,000 one-task claims
-- from an empty table, the median claim took 1.3 times as long). So they also
-- `SET enable_seqscan = off`: every statement of theirs has an index to walk, whatever the
-- statistics say.
--
-- States: the live table `tasks` holds PENDING, CLAIMED and RUNNING tasks only (the rows a
-- claim scans); a terminal transition moves the row to `finished_tasks` in the same statement.

-- The clock. The database's `now()` is the only wall clock; tests may pin it per session with
-- `SET canter.now = '<timestamptz>'` (unset or empty: `now()`).
CREATE FUNCTION db_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT coalesce(nullif(current_setting('canter.now', true), '')::timestamptz, now()) $$;

-- Milliseconds since the Unix epoch (the `DbTime` of the Rust API), and back.
CREATE FUNCTION ms(t timestamptz) RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT floor(extract(epoch FROM t) * 1000)::bigint $$;

CREATE FUNCTION at_ms(ms bigint) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT timestamptz 'epoch' + ms * interval '1 millisecond' $$;

-- When an enqueued task becomes due: after its delay in ms, at its run-at (never before now),
-- or now (`canter::db::RunAt`). Self-contained (no call of `at_ms`), so that it resolves and
-- inlines from statements sent with any search_path.
CREATE FUNCTION due_at(delay_ms bigint, at bigint, now timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN delay_ms IS NOT NULL THEN now + delay_ms * interval '1 millisecond'
                WHEN at IS NOT NULL THEN greatest(timestamptz 'epoch' + at * interval '1 millisecond', now)
                ELSE now END
$$;

-- Live tasks. Columns mirror `canter::memory::StoredTask`.
--
-- No CHECK constraints on the states (here and in `finished_tasks`): PostgreSQL rebuilds a
-- check's expression from its stored text in every statement that writes the table, about
-- 8 µs, a tenth of a one-row enqueue's server time and paid again by each claim, start and
-- finish. Only the statements in this file and in `canter::postgres` write these columns,
-- with the literal states of `canter::task::TaskState`.
CREATE TABLE tasks (
    id               bigint GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME task_id_seq) PRIMARY KEY,
    name             text        NOT NULL,
    queue            text        NOT NULL,
    priority         smallint    NOT NULL,
    args             jsonb       NOT NULL,
    state            text        NOT NULL, -- PENDING, CLAIMED or RUNNING
    lease            bigint      NOT NULL DEFAULT 0,
    claimed_by       text,
    claim_token      bigint,
    claimed_at       timestamptz,
    claim_expires_at timestamptz,
    heartbeat_at     timestamptz,
    started_at       timestamptz,
    attempts         integer     NOT NULL DEFAULT 0,
    retries          integer     NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL,
    enqueued_at      timestamptz NOT NULL,
    good_until       timestamptz,
    -- The task's own retry policy; NULL (most tasks) follows the app's, as configured where
    -- the task is claimed (the row stays small: every byte here is written three times).
    retry            jsonb,
    key              text,
    -- Flags a worker may refuse (`WorkerConfig::forbidden_flags`); NULL for none.
    flags            text[],
    error            jsonb
) WITH (
    -- Room for HOT updates (heartbeats touch no indexed column), and vacuum that keeps up with
    -- a table whose every row is updated and deleted within minutes.
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 100,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_cost_limit = 10000
);

-- The claim's pending arm: `queue = $q AND state = 'PENDING' ORDER BY priority, run_at, id`.
-- The queue is keyed by its hash (the claim also compares the name itself): with every key
-- column fixed-width, a B-tree insert or descent reads them at fixed offsets instead of walking
-- past a text; bulk enqueues of 1,000 took about 7% less server time (pgbench, interleaved).
-- A hash shared by two queues only makes one's claim step over the other's rows.
CREATE INDEX tasks_claim_idx ON tasks (hashtext(queue), priority, run_at, id) WHERE state = 'PENDING';
-- When the next delayed task of a queue becomes due (the claim's wake-up hint). Only delayed
-- tasks (run_at after enqueued_at: a delay, a future run-at, a retry) can become due later; a
-- task due at once never enters this index, so most enqueues skip it.
CREATE INDEX tasks_due_idx ON tasks (queue, run_at) WHERE state = 'PENDING' AND run_at > enqueued_at;
-- Tasks in flight: the claim's lapsed-lease arm, cap counts, heartbeats and the reaper.
CREATE INDEX tasks_in_flight_idx ON tasks (queue, state, claim_expires_at) WHERE state IN ('CLAIMED', 'RUNNING');
-- The reaper's expiry of pending tasks.
CREATE INDEX tasks_good_until_idx ON tasks (good_until) WHERE state = 'PENDING' AND good_until IS NOT NULL;

-- Terminal tasks with their result or error; rows come from `tasks` in the finishing statement.
CREATE TABLE finished_tasks (
    id           bigint      PRIMARY KEY,
    name         text        NOT NULL,
    queue        text        NOT NULL,
    priority     smallint    NOT NULL,
    args         jsonb       NOT NULL,
    state        text        NOT NULL, -- COMPLETED, FAILED, CANCELLED or EXPIRED
    lease        bigint      NOT NULL,
    claimed_by   text,
    claim_token  bigint,
    claimed_at   timestamptz,
    heartbeat_at timestamptz,
    started_at   timestamptz,
    attempts     integer     NOT NULL,
    retries      integer     NOT NULL,
    run_at       timestamptz NOT NULL,
    enqueued_at  timestamptz NOT NULL,
    good_until   timestamptz,
    retry        jsonb,
    key          text,
    flags        text[],
    error        jsonb,
    result       jsonb,
    finished_at  timestamptz NOT NULL
);

-- Retention deletes by age. Rows arrive in finishing order, so a BRIN index (a few pages, next
-- to nothing per insert) serves where a B-tree would cost every finish an index insert.
CREATE INDEX finished_tasks_finished_at_idx ON finished_tasks USING brin (finished_at);

-- Keys: which task a key names (`canter::db::KeyMode`). An idempotency key names its task for
-- good; in the other modes a key whose task finished is free (the next enqueue points it at a
-- new task). Enqueuers of a key serialize on a transaction advisory lock of the key.
CREATE TABLE task_keys (
    key     text   PRIMARY KEY,
    task_id bigint NOT NULL
);

-- One row per run the task outlived (it was retried, or handed back failed and requeued); the
-- run that ended a task is on its `finished_tasks` row.
CREATE TABLE attempts (
    task_id     bigint      NOT NULL,
    attempt     integer     NOT NULL,
    worker      text,
    outcome     text        NOT NULL CHECK (outcome IN ('PENDING', 'COMPLETED', 'FAILED')),
    error       jsonb,
    finished_at timestamptz NOT NULL,
    PRIMARY KEY (task_id, attempt)
);

-- The worker registry.
CREATE TABLE workers (
    id          text        PRIMARY KEY,
    queues      text[]      NOT NULL DEFAULT '{}',
    concurrency integer     NOT NULL DEFAULT 0,
    started_at  timestamptz NOT NULL,
    last_seen   timestamptz NOT NULL,
    stopped_at  timestamptz
);

-- Queue states set by operators. A paused queue's Pending tasks are not claimed (its Claimed
-- and Running ones go on); see `canter::postgres::PgStore::pause_queue`. One row per queue ever
-- paused: the claim probes it once per pass.
CREATE TABLE queue_states (
    queue     text        PRIMARY KEY,
    paused    boolean     NOT NULL DEFAULT false,
    paused_at timestamptz
);

-- Schedules' records (`canter::schedule`): the last tick each schedule recorded. A scheduler
-- writes a row only by compare-and-set on the last tick it read (an insert only if there is no
-- row), in the transaction that enqueues the ticks' tasks, so however many schedulers race,
-- each tick is enqueued once. A row of a schedule no longer configured is left alone.
CREATE TABLE schedules (
    name         text        PRIMARY KEY,
    last_tick    timestamptz NOT NULL,
    next_tick    timestamptz,
    last_task_id bigint,
    run_count    bigint      NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL
);

-- The functions below pin generic plans (`plan_cache_mode`): their statements take the same
-- shapes on every call, and a custom plan would be planned again on every call (a third of an
-- idle claim's time).

-- Enqueue a batch as one statement (see `canter::postgres::enqueue`). Batches without keys use a
-- plain INSERT statement instead; this function serves keyed batches and checks.
--
-- The arrays are parallel, one element per task (`p_flags`: each task's flags joined by commas,
-- NULL for none). Every task is checked before any is written; on a problem the function
-- writes nothing and returns one row naming the first task (in order) with a problem:
-- `run_at_after_good_until`, or `payload_mismatch` (an idempotency key naming a task with
-- another name or args). Otherwise, when `p_write`, the tasks apply in order, as if enqueued one
-- by one, following their key mode (`canter::db::KeyMode`), and it returns one row per task with
-- its id. With `p_write` false it only checks.
--
-- Enqueuers of a key take turns on a transaction advisory lock of the key (taken in key order,
-- then the holders' rows in id order, as finishers lock them, so nothing deadlocks): each
-- statement after the locks sees what the previous holder committed.
CREATE FUNCTION enqueue(
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
    PERFORM FROM tasks t
    WHERE t.id IN (SELECT k.task_id FROM task_keys k WHERE k.key = ANY (p_keys))
    ORDER BY t.id
    FOR UPDATE;

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
        v_state := NULL;
        IF r.key IS NOT NULL THEN
            SELECT k.task_id INTO v_holder FROM task_keys k WHERE k.key = r.key;
            -- NULL when the holder finished (or is gone).
            SELECT t.state INTO v_state FROM tasks t WHERE t.id = v_holder;
            IF r.mode = 'idempotent' AND (v_state IS NOT NULL OR EXISTS (SELECT FROM finished_tasks f WHERE f.id = v_holder)) THEN
                v_id := v_holder;
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
                WHERE t.id = v_holder;
                v_id := v_holder;
                v_queues := v_queues || r.queue;
            ELSIF v_state IS NOT NULL THEN
                -- Claimed or Running: it runs on without its key.
                UPDATE tasks t SET key = NULL WHERE t.id = v_holder;
            ELSIF v_holder IS NOT NULL THEN
                UPDATE finished_tasks f SET key = NULL WHERE f.id = v_holder;
            END IF;
        END IF;
        IF v_id IS NULL THEN
            INSERT INTO tasks (name, queue, priority, args, state, run_at, enqueued_at, good_until, retry, key, flags)
            VALUES (r.name, r.queue, r.priority, r.args, 'PENDING', r.run_at, v_now, r.good_until, r.retry, r.key,
                    r.flags)
            RETURNING tasks.id INTO v_id;
            IF r.key IS NOT NULL THEN
                INSERT INTO task_keys AS k (key, task_id) VALUES (r.key, v_id)
                ON CONFLICT (key) DO UPDATE SET task_id = EXCLUDED.task_id;
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

-- One claim pass (see `canter::postgres::store` and `canter::budget::plan`, which this follows).
--
-- `p_budget` is the worker's own budget (`ClaimPolicy::local_budget`); the function takes the
-- advisory locks `p_lock_keys` (sorted; empty when no cap needs a consistent count), lowers the
-- budget to the cluster cap's room, then per queue in order takes
-- min(budget left, cap room, max batch) rows of both arms (Pending, and Claimed with a lapsed
-- lease) with FOR UPDATE SKIP LOCKED in (priority, run_at, id) order. The first `p_start_now`
-- rows in claim order start at once. Returns the rows in claim order, then one last row with a
-- NULL id carrying `more`: whether an eligible row of a served queue was left behind, and,
-- when it is false, `next_run_in_ms`: how long until the earliest delayed Pending task of a
-- served queue becomes due (one probe of `tasks_due_idx` per queue). Paused queues are not
-- served: they leave `p_queues` (and `p_caps`, `p_serial`) first.
--
-- A serial queue (`p_serial`) counts its live claims against its cap in soft-cap mode too.
-- Tasks with a flag in `p_forbidden` (NULL: none forbidden) are not claimed.
CREATE FUNCTION claim(
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
    v_now   timestamptz := db_now();
    v_key   bigint;
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
    IF p_lock_keys IS NOT NULL THEN
        FOREACH v_key IN ARRAY p_lock_keys LOOP
            PERFORM pg_advisory_xact_lock(v_key);
        END LOOP;
    END IF;
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
                   (array_agg(c.id ORDER BY c.priority DESC, c.run_at DESC, c.id DESC) FILTER (WHERE c.pending))[1]
            INTO v_got, v_last_priority, v_last_run_at, v_last_id
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

-- Start claimed tasks (see `DbRequest::Start`): Claimed to Running when held by `p_worker`
-- under that lease with a live claim; Expired instead past good-until; left Claimed
-- (`deferred`) when its queue is at its cap (`p_cap_queues`/`p_caps`, soft-cap mode only).
-- Returns one row per input entry, in input order: started, expired, deferred or lost.
CREATE FUNCTION start_tasks(
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
    v_now     timestamptz := db_now();
    v_key     bigint;
    v_ords    bigint[];
    v_ids     bigint[];
    v_out     text[];
    v_attempt integer[];
    v_expired bigint[];
BEGIN
    IF p_lock_keys IS NOT NULL THEN
        FOREACH v_key IN ARRAY p_lock_keys LOOP
            PERFORM pg_advisory_xact_lock(v_key);
        END LOOP;
    END IF;
    WITH input AS (
        SELECT i.id, i.lease, i.ord FROM unnest(p_ids, p_leases) WITH ORDINALITY AS i(id, lease, ord)
    ),
    held AS (
        SELECT t.id, t.lease, t.state, t.queue, t.claim_expires_at, t.good_until, t.attempts
        FROM tasks t
        WHERE t.id = ANY (p_ids) AND t.claimed_by = p_worker AND t.state <> 'PENDING'
        ORDER BY t.id
        FOR UPDATE
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
               CASE WHEN o.id IS NULL OR h.lease <> i.lease THEN 'lost'
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
