-- Retention (sidecar.retention): finished jobs are deleted by finished_at, oldest first,
-- per state; this index finds them without reading the live part of the queue. The
-- journal and the outbox go with their job (their indexes lead with job_id).
CREATE INDEX tool_jobs_finished_idx ON tool_jobs (state, finished_at)
    WHERE state IN ('succeeded', 'failed', 'cancelled');

-- What retention must keep: tool_job_still_needed (sidecar/sql/functions/retention.sql).
