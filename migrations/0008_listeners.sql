-- Canter schema, version 8: notifications only where someone listens.
--
-- A transaction that sent NOTIFY takes, to commit, a lock that every notifying commit of the
-- database shares (PostgreSQL's notification queue), so notifying committers go one at a time,
-- each with its WAL flush: 8 clients insert 11,000 rows/s with a NOTIFY each and 25,000 without.
-- So statements now notify a channel only while a listener of it is registered in `listeners`.
--
-- The protocol: a session LISTENs, then calls `register_listener()` with its channels, then
-- reads what it waits for. A notifying statement reads `listeners` in its own text (never
-- through a function), so it holds ACCESS SHARE on the table from before its snapshot to its
-- commit; the registration takes ACCESS EXCLUSIVE, which waits for every such statement in
-- flight and holds back new ones until it commits. A statement either commits before the
-- registration (the listener's first read, after it, sees its rows) or reads the table after
-- the registration committed and notifies. A registration whose session is gone is deleted by
-- the next one (its pid is not in `pg_stat_activity`); until then its channels are notified as
-- before, which is only the cost of today.
--
-- Processes of earlier releases listen without registering: see the README's upgrade notes.
--
-- Online-safe: a new table and new functions.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (8, 1, 'listeners: statements notify only channels someone listens on');

CREATE TABLE listeners (
    channel     text        NOT NULL,
    pid         integer     NOT NULL,
    listened_at timestamptz NOT NULL,
    PRIMARY KEY (channel, pid)
);

-- Registers the calling session as a listener of `p_channels` (replacing its earlier
-- registration) once every statement that read `listeners` before it has ended, and deletes
-- the registrations of sessions that ended. A registration waits at most 250 ms for the table:
-- meanwhile, notifying statements wait behind it, so the caller retries later instead.
-- SECURITY DEFINER: any role that may wait for results (a reader's `canter result --wait`
-- too) registers without rights on the table, and its own registration is all it can write.
CREATE FUNCTION register_listener(p_channels text[]) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
SET lock_timeout = '250ms'
AS $$
BEGIN
    LOCK TABLE listeners IN ACCESS EXCLUSIVE MODE;
    DELETE FROM listeners l
    WHERE l.pid = pg_backend_pid() OR NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = l.pid);
    INSERT INTO listeners (channel, pid, listened_at)
    SELECT DISTINCT c.channel, pg_backend_pid(), clock_timestamp() FROM unnest(p_channels) AS c(channel);
END;
$$;

-- Deletes the calling session's registrations (before its connection goes back to a pool).
-- No lock: a statement that still sees them only notifies for nobody.
CREATE FUNCTION unregister_listener() RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    DELETE FROM listeners WHERE pid = pg_backend_pid();
$$;
