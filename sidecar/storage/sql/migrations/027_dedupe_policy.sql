-- Dedupe policy (issue 44, point 4; docs/callers.md "Idempotency keys"): how long a job
-- holds its idempotency key. Until now a key named one job for as long as its row lived
-- (`forever`, still the default). `active` frees the key once the job has finished (a new
-- job may then take it; the old row stays, with its key, for audit); a window (`24h`)
-- frees it once the job has finished and the window since its enqueue has passed.
--
-- key_frees_after: NULL = forever, '0' = active, else the window. key_held: whether the
-- row still holds its key; uniqueness is now over the held keys only (a partial unique
-- index instead of the column's UNIQUE constraint). A finished job's key is freed at its
-- end when its policy already allows it (functions/dedupe.sql, trigger
-- tool_jobs_key_freed), else by the first enqueue that wants the key after the window
-- (tool_job_free_key), journaled `key_freed` on the old job.
--
-- tool_dedupe: a tool's default policy, the DEDUPE of its sidecars' profile, written by
-- each sidecar as it starts and read by an enqueue that names no policy.
-- No compatible-from: an older release calls the enqueue function replaced here.

ALTER TABLE tool_jobs ADD COLUMN key_frees_after interval;
ALTER TABLE tool_jobs ADD COLUMN key_held boolean NOT NULL DEFAULT true;
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_key_frees_after_check
    CHECK (key_frees_after BETWEEN interval '0' AND interval '366 days') NOT VALID;
CREATE UNIQUE INDEX tool_jobs_held_key_idx ON tool_jobs (idempotency_key) WHERE key_held;
ALTER TABLE tool_jobs DROP CONSTRAINT tool_jobs_idempotency_key_key;

CREATE TABLE tool_dedupe (
    tool            text PRIMARY KEY,
    key_frees_after interval CHECK (key_frees_after BETWEEN interval '0' AND interval '366 days'),
    set_by          text NOT NULL,
    set_at          timestamptz NOT NULL DEFAULT now()
);

-- tool_job_enqueue and sidecar_enqueue take a dedupe policy (one more argument, last):
-- the old ones are dropped here and sidecar/sql/functions/ defines the new ones.
DROP FUNCTION IF EXISTS sidecar_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                        jsonb, integer, text, text, text, text);
DROP FUNCTION IF EXISTS tool_job_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                         interval, jsonb, integer, text, text, bigint, jsonb,
                                         text, text);
