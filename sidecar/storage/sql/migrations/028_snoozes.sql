-- Snoozes (issue 44, point 3; docs/side-effects.md "Snooze"): a tool may ask to run again
-- later without spending an attempt (POST /v1/snooze, or the profile's SNOOZE_EXIT_CODE).
-- The job goes back to the queue with run_after = now() + the delay and its attempt given
-- back; snoozes counts how often, which the profile's MAX_SNOOZES bounds (one more fails
-- the job snooze_limit), as MAX_LIFETIME_SECONDS from its first claim bounds how late the
-- job may be snoozed to (queries.sql snooze_job_if_owner).
ALTER TABLE tool_jobs ADD COLUMN snoozes integer NOT NULL DEFAULT 0;
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_snoozes_check CHECK (snoozes >= 0) NOT VALID;
