-- What `sidecar web` (issue 30) reads and writes.
--
-- The jobs list pages newest first by id with a keyset (no OFFSET): job ids are time-ordered
-- (UUIDv7, migration 017), so the primary key is the unfiltered list's index, and each
-- filter reads an index of its own in id order, so a page costs its LIMIT whatever the
-- table holds (tests/test_web.py checks the plans with EXPLAIN). What each costs a job's
-- writes is kept small (bench section 13: every claim and finish is a non-HOT update, which
-- adds an entry to every index whose predicate the new row meets): the states' indexes are
-- partial (a job enters the live one when queued and when claimed, the other only if it
-- fails or is cancelled; a succeeded job is read through the primary key, being most of
-- them), and the error kinds' only holds jobs with an error. Four full indexes on
-- (created_at, id) cost 1.1 KB of WAL per no-op job, these about a third of it. None
-- indexes lease_until, heartbeat_at or progress: a heartbeat (and a progress report) stays
-- a HOT update. A filter by tags reads tool_jobs_tags_idx (migration 014). Built in the
-- migration's transaction, not CONCURRENTLY: on a large queue, migrate when a short pause
-- of enqueues and claims is acceptable.
-- compatible-from: 18
CREATE INDEX tool_jobs_tool_id_idx ON tool_jobs (tool, id);
CREATE INDEX tool_jobs_live_id_idx ON tool_jobs (state, id)
    WHERE state IN ('queued', 'running');
CREATE INDEX tool_jobs_unsucceeded_id_idx ON tool_jobs (state, id)
    WHERE state IN ('failed', 'cancelled');
CREATE INDEX tool_jobs_error_kind_idx ON tool_jobs ((error->>'kind'), id)
    WHERE (error->>'kind') IS NOT NULL;
-- ANALYZE keeps no statistics of a partial index's expression: without these the planner
-- guesses how many jobs failed of a kind, and guessing few, sorts them all.
CREATE STATISTICS tool_jobs_error_kind_stats ON (error->>'kind') FROM tool_jobs;

-- A cancel that says who asked (tool_job_cancel with p_by): sidecar/sql/functions/
-- cancel.sql.
