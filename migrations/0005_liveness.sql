-- Canter schema, version 5: liveness tokens.
--
-- Every worker holds a session advisory lock of its own (its liveness token), on a connection
-- it keeps for that, and records here the server incarnation it took it in
-- (`pg_postmaster_start_time()`). PostgreSQL releases the lock when the session ends: when the
-- worker's process dies, the next worker to look (`recovery.liveness_check_interval_ms`) can
-- take the lock, and once it has stayed free for `recovery.liveness_grace_ms` recovers the
-- dead worker's tasks at once instead of waiting out the stale thresholds. A token recorded in
-- another incarnation (before a restart or a failover) counts for nothing until its worker
-- takes it again. Heartbeats and the reaper's thresholds stay, for workers that hang.
--
-- Online-safe: two nullable columns (no rewrite); older workers never record a token and are
-- recovered by the thresholds alone.
SET lock_timeout = '5s';

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (5, 1, 'liveness tokens: workers.token_epoch and workers.token_free_since');

ALTER TABLE workers
    -- The server incarnation in which the worker's session took its token; NULL: none.
    ADD COLUMN token_epoch timestamptz,
    -- When a worker looking for dead ones first found the token free.
    ADD COLUMN token_free_since timestamptz;
