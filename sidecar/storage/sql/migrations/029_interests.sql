-- Interest leases (issue 44, point 2; docs/callers.md "Interest"): a caller holds an
-- interest under a key for a while (ttl) and renews it while it still wants the answers;
-- the calls it enqueues under the key belong to it. When the interest lapses (not renewed
-- in time, or let go), the calls nobody waits for any more stop: its queued calls end
-- failed/expired, its running ones are cancelled through the fenced path with kind
-- abandoned_by_caller (their owners told at once, the trees killed within about a second),
-- and the claim takes none of them meanwhile (claimable.sql tool_job_queued_due, by
-- tool_jobs.interest_until).
--
-- tool_interests: one row per key, live until expires_at, or lapsed/released (the calls
-- of it ended then). A key held again after it lapsed is a new interest (generation + 1);
-- the calls of the old one stay ended.
-- No compatible-from: an older release calls the enqueue function replaced here.

CREATE TABLE tool_interests (
    interest_key text PRIMARY KEY CHECK (length(interest_key) BETWEEN 1 AND 256),
    state        text NOT NULL CHECK (state IN ('live', 'lapsed', 'released')),
    holder       text,
    generation   integer NOT NULL DEFAULT 1 CHECK (generation >= 1),
    expires_at   timestamptz NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    renewed_at   timestamptz NOT NULL DEFAULT now(),
    ended_at     timestamptz
);
-- The sweep's read: live interests past their end.
CREATE INDEX tool_interests_live_idx ON tool_interests (expires_at) WHERE state = 'live';

ALTER TABLE tool_jobs ADD COLUMN interest_key text;
-- The end of its interest, as last renewed, kept on each queued call of it: the claim's
-- row rule reads a column of the row (claimable.sql tool_job_queued_due), never the
-- interests' table, so its index scans stay as they were.
ALTER TABLE tool_jobs ADD COLUMN interest_until timestamptz;
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_interest_key_check
    CHECK (length(interest_key) BETWEEN 1 AND 256) NOT VALID;
-- An interest's unfinished calls: what its lapse ends.
CREATE INDEX tool_jobs_interest_calls_idx ON tool_jobs (interest_key)
    WHERE interest_key IS NOT NULL AND state IN ('queued', 'running', 'waiting');

DROP FUNCTION IF EXISTS sidecar_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                        jsonb, integer, text, text, text, text, text);
DROP FUNCTION IF EXISTS tool_job_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                         interval, jsonb, integer, text, text, bigint, jsonb,
                                         text, text, text);
