-- The claim reads the queued part of a tool's backlog in claim order straight from an
-- index (tool, run_after, created_at, id) and stops at the first row it can lock: no
-- sort over the backlog, however long it is. The expired-lease part is read apart
-- through tool_jobs_running_idx, whose size follows the running jobs, not the backlog.
CREATE INDEX tool_jobs_queued_order_idx
    ON tool_jobs (tool, run_after, created_at, id) WHERE state = 'queued';
DROP INDEX tool_jobs_queued_idx;
