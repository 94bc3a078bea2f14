-- Stages (P19): a job may be the next stage of a parent job, created by the parent's
-- fenced completion. Checkpoints: progress an attempt saved for the next one.
ALTER TABLE tool_jobs
    ADD COLUMN parent_id  uuid,
    ADD COLUMN stage      integer NOT NULL DEFAULT 0,
    ADD COLUMN checkpoint jsonb;
CREATE INDEX tool_jobs_parent_idx ON tool_jobs (parent_id) WHERE parent_id IS NOT NULL;
