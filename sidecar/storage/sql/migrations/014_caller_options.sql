-- The caller's options at enqueue (issue 26, points 3, 4, 6, 7): when a job may start
-- (priority, run_after, expires_at), tags for group actions, the W3C trace context the
-- tool gets as TRACEPARENT/TRACESTATE, and max_attempts left to the claiming worker's
-- profile when the caller gives none (NULL until the first claim writes the profile's
-- MAX_ATTEMPTS on the row). One implementation of enqueue, tool_job_enqueue, used by the
-- CLI and by sidecar_enqueue, the function any language calls in its own transaction.
-- No compatible-from: an older release would claim rows whose max_attempts is NULL and
-- read the queue without the claim-order index it expects (docs/operations.md).

-- New columns carry defaults that are constants (no table rewrite); the CHECKs are NOT
-- VALID, so adding them does not scan the table under its lock: every existing row has
-- priority 0 and no tags, and new rows are checked.
ALTER TABLE tool_jobs
    ADD COLUMN priority    smallint NOT NULL DEFAULT 0,
    ADD COLUMN expires_at  timestamptz,
    ADD COLUMN tags        jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate  text,
    ALTER COLUMN max_attempts DROP NOT NULL;
ALTER TABLE tool_jobs
    ADD CONSTRAINT tool_jobs_priority_check CHECK (priority BETWEEN 0 AND 9) NOT VALID,
    ADD CONSTRAINT tool_jobs_tags_check CHECK (jsonb_typeof(tags) = 'object') NOT VALID;

-- The claim's queued part reads (tool, priority, run_after, created_at, id) in order from
-- this index and stops at the first row it can lock: priority 0 first, then the order of
-- migration 005, never a sort. Jobs of a higher priority scheduled for later are index
-- entries the scan steps over (run_after is checked in the index, no heap visit).
DROP INDEX tool_jobs_queued_order_idx;
CREATE INDEX tool_jobs_queued_order_idx
    ON tool_jobs (tool, priority, run_after, created_at, id) WHERE state = 'queued';

-- The expiry sweep (queries.sql fail_expired_jobs) reads only jobs that have an expiry
-- and are not finished. Neither column changes on a heartbeat: renewals stay HOT.
CREATE INDEX tool_jobs_expiry_idx ON tool_jobs (expires_at)
    WHERE expires_at IS NOT NULL AND state IN ('queued', 'running');

-- Group actions by tag (jobs, cancel and retry --tag: tags @> '{"k": "v"}'); jobs
-- without tags are not in the index.
CREATE INDEX tool_jobs_tags_idx ON tool_jobs USING gin (tags jsonb_path_ops)
    WHERE tags <> '{}'::jsonb;

-- tool_job_enqueue and sidecar_enqueue: sidecar/sql/functions/enqueue.sql.
