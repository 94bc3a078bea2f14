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

-- A cancel that says who asked: tool_job_cancel of migration 018 with p_by, journaled as
-- job_cancelled's "by" (left out when NULL). The two-argument function stays for
-- releases built for schema 18, as a call of this one without p_by. Both write with the
-- schema owner's rights (see migration 018); `sidecar migrate --caller-role` and
-- `--worker-role` grant EXECUTE on both.
CREATE FUNCTION tool_job_cancel(p_job uuid, p_tags jsonb, p_by text)
RETURNS TABLE (cancelled_id uuid, previous_state text)
LANGUAGE sql VOLATILE AS $$
WITH RECURSIVE chain AS (
    SELECT id FROM tool_jobs WHERE id = p_job
    UNION
    SELECT id FROM tool_jobs
    WHERE p_tags IS NOT NULL AND tags @> p_tags AND tags <> '{}'::jsonb
      AND state IN ('queued', 'running')
    UNION ALL
    SELECT c.id FROM tool_jobs c JOIN chain ON c.parent_id = chain.id
), target AS (
    SELECT j.id, j.state AS previous_state FROM tool_jobs j
    WHERE j.id IN (SELECT id FROM chain) AND j.state IN ('queued', 'running')
    FOR UPDATE
), cancelled AS (
    UPDATE tool_jobs j
    SET state = 'cancelled', finished_at = now(),
        lease_until = CASE WHEN target.previous_state = 'running' AND j.lease_until > now()
                           THEN j.lease_until END,
        -- its slot stays taken until the owner confirms the tree dead (migration 016)
        cancel_pending = target.previous_state = 'running' AND j.lease_until > now(),
        error = jsonb_build_object('kind', 'cancelled', 'message', 'cancelled by an operator')
    FROM target
    WHERE j.id = target.id
    RETURNING j.id, j.fencing_token, target.previous_state
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'job_cancelled',
           jsonb_strip_nulls(jsonb_build_object('previous_state', previous_state,
                                                'by', p_by))
    FROM cancelled
)
SELECT id, previous_state FROM cancelled
$$;

CREATE OR REPLACE FUNCTION tool_job_cancel(p_job uuid, p_tags jsonb)
RETURNS TABLE (cancelled_id uuid, previous_state text)
LANGUAGE sql VOLATILE AS $$
SELECT * FROM tool_job_cancel(p_job, p_tags, NULL::text)
$$;

DO $$
DECLARE
    home text := current_schema();
BEGIN
    -- CREATE OR REPLACE keeps the grants but resets SECURITY DEFINER and the settings
    EXECUTE format('ALTER FUNCTION %I.tool_job_cancel(uuid, jsonb) SECURITY DEFINER '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_job_cancel(uuid, jsonb, text) SECURITY DEFINER '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %I.tool_job_cancel(uuid, jsonb, text) '
                   'FROM PUBLIC', home);
END
$$;
