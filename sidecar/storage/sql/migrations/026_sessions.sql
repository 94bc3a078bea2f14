-- Agent sessions (issue 43, point 3; docs/callers.md "Sessions"): a caller may name a
-- session when it enqueues (session_key). The calls of one session run one at a time, in
-- the order they were enqueued, in one warm tool process that keeps its state between
-- them, held by one sidecar under a session lease of its own (tool_sessions).
--
-- A call of a session may be claimed only when no other call of its session is running,
-- no older call of its session is queued, and no live session lease of another sidecar
-- holds its session (claimable.sql tool_job_session_free). A job with a session makes a
-- flow row for its tool (flow.sql), so its tool claims through tool_job_claim_flow,
-- the one place that checks those rules.
--
-- The session's row says who holds it (owner_id, until lease_until, renewed with the
-- job leases), which incarnation it is (generation: bumped at every start, the session's
-- fencing token) and how it ended (state live | ended | lost, end_reason). A call that
-- finds its session ended or lost fails `session_lost` rather than running in a fresh
-- process, unless the tool's profile says SESSION_RESTART=fresh.
-- No compatible-from: an older release calls the enqueue and claim functions replaced here.

ALTER TABLE tool_jobs ADD COLUMN session_key text;
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_session_key_check
    CHECK (length(session_key) BETWEEN 1 AND 256) NOT VALID;
-- A session's calls are ordered by when they were inserted: a number from one sequence,
-- given to each call as it is inserted (functions/sessions.sql's trigger). Neither
-- created_at (the transaction's start: every call enqueued in one transaction has the
-- same) nor the id (random below the millisecond) orders calls of one transaction.
CREATE SEQUENCE tool_jobs_session_seq;
ALTER TABLE tool_jobs ADD COLUMN session_seq bigint;
-- A session's unfinished calls in order: which one is next, and whether one runs.
CREATE INDEX tool_jobs_session_calls_idx ON tool_jobs (tool, session_key, session_seq)
    WHERE session_key IS NOT NULL AND state IN ('queued', 'running');

CREATE TABLE tool_sessions (
    tool          text NOT NULL,
    session_key   text NOT NULL CHECK (length(session_key) BETWEEN 1 AND 256),
    state         text NOT NULL CHECK (state IN ('live', 'ended', 'lost')),
    owner_id      text,
    generation    integer NOT NULL DEFAULT 1 CHECK (generation >= 1),
    lease_until   timestamptz,
    started_at    timestamptz NOT NULL DEFAULT now(),
    last_call_at  timestamptz,
    ended_at      timestamptz,
    end_reason    text,
    calls         bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tool, session_key),
    CHECK ((state = 'live') = (lease_until IS NOT NULL))
);
-- The live sessions, by tool and lease end: the sweep that marks lost those whose
-- holder died (queries.sql lose_expired_sessions), `sidecar sessions`, the web view.
CREATE INDEX tool_sessions_live_idx ON tool_sessions (tool, lease_until) WHERE state = 'live';

-- The claim's row carries the job's session (NULL: none).
ALTER TYPE tool_job_claim_row ADD ATTRIBUTE session_key text;

-- tool_job_claim_flow now returns tool_job_claim_row (with session_key) and
-- tool_job_enqueue and sidecar_enqueue take a session key (one more argument, last):
-- CREATE OR REPLACE cannot change a return type or add an argument, so the old ones are
-- dropped here and sidecar/sql/functions/ defines the new ones right after the
-- migrations.
DROP FUNCTION IF EXISTS tool_job_claim_flow(text, text, float8, float8, integer);
DROP FUNCTION IF EXISTS sidecar_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                        jsonb, integer, text, text, text);
DROP FUNCTION IF EXISTS tool_job_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                         interval, jsonb, integer, text, text, bigint, jsonb,
                                         text);
