-- Bounded forwarding (case F21): a result is retried for at most FORWARD_MAX_AGE_SECONDS
-- counted from pending_since, the moment it became pending (its completion, or an
-- operator's re-delivery, `sidecar retry --forwarding`), then dead-lettered. Rows queued
-- before this migration count from their creation.
ALTER TABLE tool_job_outbox ADD COLUMN pending_since timestamptz;
UPDATE tool_job_outbox SET pending_since = created_at;
ALTER TABLE tool_job_outbox ALTER COLUMN pending_since SET DEFAULT now(),
                            ALTER COLUMN pending_since SET NOT NULL;
