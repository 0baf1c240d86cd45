-- Canter schema, version 14: enqueues notify a queue only while a worker of it waits.
--
-- Every transaction that sent a NOTIFY takes, to commit, a lock all notifying commits of the
-- database share, so producers that enqueue one task per transaction commit one at a time (8
-- producers: 11,000 commits/s with a NOTIFY each, 25,000 without). A worker working through a
-- backlog needs no notification: it claims again as soon as it has room. So a worker that
-- finds nothing more to claim marks itself waiting on its queues here, a worker that fills its
-- room and leaves more behind narrows its mark to tasks more urgent than the backlog it works
-- through (`below_priority`: an urgent task still overtakes its buffer), and a client's own
-- enqueue (its statement in its own transaction) notifies a queue only while a mark of it
-- takes the task in.
--
-- Why no wake-up is lost: the enqueue reads `waiting_workers` in its own text, so it holds
-- ACCESS SHARE on the table from before its snapshot to its commit; `mark_waiting()` takes
-- ACCESS EXCLUSIVE, which waits for every such statement in flight and holds back new ones
-- until it commits, and the worker claims once more after its mark committed. Narrowing a mark
-- takes no such lock: an enqueue that read the wider mark only notifies for nothing. An enqueue
-- either committed before the mark (that claim sees its rows) or sees the mark and notifies.
-- As with `listeners` (0008), an enqueue inside the caller's own transaction always notifies:
-- it would hold the lock until the caller commits, and stall every mark meanwhile.
--
-- A mark is deleted by its worker (busy again, or stopped) and by any mark or unmark of
-- another worker once the registry last saw its worker longer ago than the worker's own stale
-- threshold (or has it stopped, or not at all); until then its queues are notified as before,
-- which is only the cost of today. A worker renews its mark now and then: a renewal that finds
-- it deleted (the worker was silent that long, and alive) writes it again and says so.
--
-- Workers of earlier releases never mark: see the README's upgrade notes.
--
-- Online-safe: a new table and new functions.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (14, 1, 'waiting_workers: enqueues notify a queue only while a worker of it waits');

CREATE TABLE waiting_workers (
    queue  text        NOT NULL,
    worker text        NOT NULL,
    since  timestamptz NOT NULL,
    -- NULL: the worker waits for work, and every enqueue of the queue notifies; a priority:
    -- it works through a backlog, and only enqueues more urgent (lower) than it notify.
    below_priority smallint,
    -- The marking worker's own stale threshold (its `running_stale_threshold_ms`): others
    -- delete the mark once the registry has not seen the worker for that long.
    stale_after_ms bigint      NOT NULL,
    PRIMARY KEY (queue, worker)
);

-- The marks of workers the registry has not seen for `p_stale_ms` (or has stopped, or does
-- not have); none when `p_stale_ms` is NULL.
CREATE FUNCTION stale_waiting_worker(p_worker text, p_stale_ms bigint) RETURNS boolean
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT p_stale_ms IS NOT NULL AND NOT EXISTS (
        SELECT FROM workers k
        WHERE k.id = p_worker AND k.stopped_at IS NULL
          AND k.last_seen >= db_now() - p_stale_ms * interval '1 millisecond'
    );
$$;

-- Marks `p_worker` waiting on `p_queues` (replacing its earlier mark) once every statement
-- that read `waiting_workers` before it has ended, and deletes stale marks of others (each by
-- the threshold its worker marked with; `p_stale_ms` is this worker's own, kept with its
-- mark). Returns
-- whether it wrote: false when the worker's mark of exactly these queues was there already
-- (then it does not hold enqueues back). Markers go one at a time (SHARE UPDATE EXCLUSIVE,
-- taken before the table is read: two that read it and then both asked for ACCESS EXCLUSIVE
-- would wait for each other). Waits at most 250 ms for the table: meanwhile enqueues wait
-- behind it, so the worker tries again later instead. SECURITY DEFINER: a worker writes its own
-- mark without rights on the table (EXECUTE is granted to the worker role only).
CREATE FUNCTION mark_waiting(p_worker text, p_queues text[], p_stale_ms bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
SET lock_timeout = '250ms'
AS $$
BEGIN
    LOCK TABLE waiting_workers IN SHARE UPDATE EXCLUSIVE MODE;
    IF NOT EXISTS (SELECT FROM waiting_workers w WHERE w.worker = p_worker AND w.below_priority IS NOT NULL)
       AND (SELECT coalesce(array_agg(w.queue ORDER BY w.queue), '{}') FROM waiting_workers w WHERE w.worker = p_worker)
           = (SELECT coalesce(array_agg(DISTINCT q.queue ORDER BY q.queue), '{}') FROM unnest(p_queues) AS q(queue)) THEN
        RETURN false;
    END IF;
    LOCK TABLE waiting_workers IN ACCESS EXCLUSIVE MODE;
    DELETE FROM waiting_workers w WHERE w.worker = p_worker OR stale_waiting_worker(w.worker, w.stale_after_ms);
    INSERT INTO waiting_workers (queue, worker, since, stale_after_ms)
    SELECT q.queue, p_worker, clock_timestamp(), p_stale_ms
    FROM (SELECT DISTINCT u.queue FROM unnest(p_queues) AS u(queue)) q;
    RETURN true;
END;
$$;

-- Deletes `p_worker`'s mark and (with `p_stale_ms`, this worker's own threshold) stale marks
-- of others, then (with `p_below`) marks it on
-- `p_queues` for enqueues more urgent than `p_below` only. No lock: an enqueue that still
-- sees the wider mark only notifies for nothing (and one that misses the narrow one costs an
-- urgent task its overtaking, not its claim: the worker claims through its backlog anyway).
CREATE FUNCTION unmark_waiting(p_worker text, p_queues text[], p_below smallint, p_stale_ms bigint)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    DELETE FROM waiting_workers w
    WHERE w.worker = p_worker OR (p_stale_ms IS NOT NULL AND stale_waiting_worker(w.worker, w.stale_after_ms));
    INSERT INTO waiting_workers (queue, worker, since, below_priority, stale_after_ms)
    SELECT q.queue, p_worker, clock_timestamp(), p_below, p_stale_ms
    FROM (SELECT DISTINCT u.queue FROM unnest(p_queues) AS u(queue)) q
    WHERE p_below IS NOT NULL AND p_stale_ms IS NOT NULL;
$$;

-- Workers only: any other role could delete every mark, or hold enqueues back.
REVOKE EXECUTE ON FUNCTION mark_waiting(text, text[], bigint), unmark_waiting(text, text[], smallint, bigint)
    FROM PUBLIC;
