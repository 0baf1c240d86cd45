-- Canter schema, version 2: the schema's record of its versions and of the code each accepts,
-- and a clock that reads `now()` alone.
--
-- Online-safe: it adds a table and replaces a function; nothing a running worker uses is
-- altered or locked for long (the lock_timeout below bounds any wait for a lock), so
-- workers of version 1, which never read `schema_versions`, carry on while it applies.
--
-- Every later migration starts with `SET lock_timeout`, builds indexes `CONCURRENTLY` (in a
-- `-- no-transaction` file) and inserts its own row into `schema_versions`.
SET lock_timeout = '5s';

-- One row per migration: `min_code_version` is the oldest code that may run against a schema
-- at this version, as the newest migration that code knows. A binary that knows migrations up
-- to K starts on a schema with newer migrations only if every one of them accepts K (see
-- `canter::postgres::schema_status`); otherwise it refuses, naming both versions.
CREATE TABLE schema_versions (
    version          bigint      PRIMARY KEY,
    min_code_version bigint      NOT NULL CHECK (min_code_version BETWEEN 1 AND version),
    description      text        NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT now()
);

INSERT INTO schema_versions (version, min_code_version, description) VALUES
    (1, 1, 'tables, indexes, the clock, and the enqueue, claim and start functions'),
    (2, 1, 'schema_versions; db_now() reads now() alone');

-- The clock of every statement: the transaction's `now()`. Version 1 also read a test-only
-- setting (`canter.now`) on every call; tests now install that override in their own schemas
-- (tests/common/pg.rs).
CREATE OR REPLACE FUNCTION db_now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT now() $$;
