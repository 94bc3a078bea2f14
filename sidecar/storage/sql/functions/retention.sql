-- Retention (sidecar.ops.retention, migration 007).

-- A finished job retention must keep: a later stage of it (P19) is still queued or
-- running, or its result is still to be forwarded (a pending outbox row).
CREATE OR REPLACE FUNCTION tool_job_still_needed(job uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        WITH RECURSIVE later AS (
            SELECT c.id, c.state FROM tool_jobs c WHERE c.parent_id = job
            UNION ALL
            SELECT c.id, c.state FROM tool_jobs c JOIN later l ON c.parent_id = l.id)
        SELECT FROM later WHERE later.state IN ('queued', 'running', 'waiting'))
    OR EXISTS (SELECT FROM tool_job_outbox o WHERE o.job_id = job AND o.state = 'pending')
$$;

-- A finished job retention removes now (issue 41, point 6: one rule, read by the pruner's
-- deletes and by `sidecar prune --dry-run`'s count, queries.sql prune_finished_jobs and
-- count_prunable_jobs): in state p_state, finished more than p_age seconds ago, and not
-- still needed. One expression, no SET clause: the planner inlines it, so both read
-- tool_jobs_finished_idx as before.
CREATE OR REPLACE FUNCTION tool_job_prunable(j tool_jobs, p_state text, p_age float8)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT j.state = p_state AND j.finished_at < now() - p_age * interval '1 second'
       AND NOT tool_job_still_needed(j.id)
$$;
