-- Retention (sidecar.retention, migration 007).

-- A finished job retention must keep: a later stage of it (P19) is still queued or
-- running, or its result is still to be forwarded (a pending outbox row).
CREATE OR REPLACE FUNCTION tool_job_still_needed(job uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        WITH RECURSIVE later AS (
            SELECT c.id, c.state FROM tool_jobs c WHERE c.parent_id = job
            UNION ALL
            SELECT c.id, c.state FROM tool_jobs c JOIN later l ON c.parent_id = l.id)
        SELECT FROM later WHERE later.state IN ('queued', 'running'))
    OR EXISTS (SELECT FROM tool_job_outbox o WHERE o.job_id = job AND o.state = 'pending')
$$;
