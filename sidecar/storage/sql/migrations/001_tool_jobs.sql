-- The job table of the article (P1-P7) plus what the sidecar needs to pick a
-- lease profile (tool), bound retries (max_attempts, run_after) and investigate
-- (created_at, first_claimed_at, finished_at).
CREATE TABLE tool_jobs (
    id               uuid PRIMARY KEY,
    tool             text NOT NULL,
    state            text NOT NULL DEFAULT 'queued'
                     CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    owner_id         text,
    lease_until      timestamptz,
    fencing_token    bigint NOT NULL DEFAULT 0,
    heartbeat_at     timestamptz,
    attempt          integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    idempotency_key  text NOT NULL UNIQUE,
    payload          jsonb NOT NULL,
    result           jsonb,
    error            jsonb,
    run_after        timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    first_claimed_at timestamptz,
    finished_at      timestamptz
) WITH (fillfactor = 80);

-- Serves the claim of queued jobs: per tool, oldest eligible first.
CREATE INDEX tool_jobs_queued_idx ON tool_jobs (tool, run_after) WHERE state = 'queued';
-- Serves the re-claim of running jobs whose lease expired. lease_until and
-- heartbeat_at are deliberately not indexed: heartbeats then stay HOT updates.
CREATE INDEX tool_jobs_running_idx ON tool_jobs (tool) WHERE state = 'running';

-- Append-only journal (P22). Rejected results appear here as hash and size only (P6, P23).
CREATE TABLE tool_job_events (
    id            bigserial PRIMARY KEY,
    job_id        uuid NOT NULL,
    fencing_token bigint,
    event         text NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    details       jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX tool_job_events_job_idx ON tool_job_events (job_id, id);
