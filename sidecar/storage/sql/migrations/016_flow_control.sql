-- Flow control across the fleet (issue 27): limits kept as data, so every sidecar of a tool
-- obeys the same values from its next claim on, and enforced inside the claim.
--
-- A tool's flow row (tool_flow) holds its limits, its pause and the round-robin cursor of
-- its concurrency keys. A tool with no flow row claims as before (queries.sql claim_job,
-- one statement, no lock beyond the job's row). A tool with one claims through
-- tool_job_claim_flow, which first locks that row: claims of the same tool take turns (a
-- few index probes each), claims of different tools never wait for each other. With the
-- row locked, each statement of the function reads a fresh snapshot (READ COMMITTED), so
-- it counts every claim committed before it: caps hold exactly under any number of
-- concurrent claims from any number of sidecars.
--
-- Concurrency keys: a job may carry one (tenant, account, customer); '' is "no key". Keys
-- take turns within a tool (round-robin over the keys with queued jobs, starting after
-- the key served last; priority and age within a key), per-key caps and per-key rates
-- apply to each key, never to jobs without one. A job with a key makes a flow row for its
-- tool (trigger below), so its tool claims fairly even without limits.
--
-- Slots: a job occupies one while it is running under a live lease (lease_until >= now()),
-- and after a cancel until its owner confirms the tree dead; an expired lease frees it.
-- Rates: token buckets on the database's clock, refilled at the rate up to the burst
-- (default 1), one token per claim; a job that cannot start for a limit stays queued
-- with no attempt spent.
-- No compatible-from: an older release claims without the limits.

ALTER TABLE tool_jobs ADD COLUMN concurrency_key text NOT NULL DEFAULT '';
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_concurrency_key_check
    CHECK (length(concurrency_key) <= 256) NOT VALID;
-- A job cancelled while it ran keeps its slot until its owner acknowledges that the tree
-- is dead (acknowledge_cancel_if_owner) or the lease it held ends: the tool is still
-- running until then (case F14's window). Set by cancel_job, cleared by the
-- acknowledgement, a retry, or the pruner once the lease is over.
ALTER TABLE tool_jobs ADD COLUMN cancel_pending boolean NOT NULL DEFAULT false;

-- The claim order, now per key: the fast claim reads (tool, '', priority, run_after,
-- created_at, id) in order as before; the fair claim steps from key to key on the same
-- index (each step one probe, never a sort of the backlog).
DROP INDEX tool_jobs_queued_order_idx;
CREATE INDEX tool_jobs_queued_order_idx
    ON tool_jobs (tool, concurrency_key, priority, run_after, created_at, id)
    WHERE state = 'queued';
-- Per-key occupancy: running jobs of a key. Neither column changes on a heartbeat, so
-- renewals stay HOT.
CREATE INDEX tool_jobs_running_key_idx ON tool_jobs (tool, concurrency_key)
    WHERE state = 'running' AND concurrency_key <> '';
CREATE INDEX tool_jobs_cancel_pending_idx ON tool_jobs (tool, concurrency_key)
    WHERE cancel_pending;
-- Whether a keyed tool has any job due at all, in one probe: before a claim walks its
-- keys (thousands of keys waiting out a retry's backoff cost nothing then). Only jobs
-- with a key are in it.
CREATE INDEX tool_jobs_queued_keyed_due_idx ON tool_jobs (tool, run_after)
    WHERE state = 'queued' AND concurrency_key <> '';

CREATE TABLE tool_flow (
    tool                text PRIMARY KEY,
    max_running         integer CHECK (max_running >= 1),
    max_running_per_key integer CHECK (max_running_per_key >= 1),
    -- rates as given ("10/s", "600/m") and as tokens per second
    rate                text,
    rate_per_second     float8 CHECK (rate_per_second > 0),
    rate_per_key        text,
    key_rate_per_second float8 CHECK (key_rate_per_second > 0),
    burst               integer NOT NULL DEFAULT 1 CHECK (burst >= 1),
    tokens              float8,       -- the tool's bucket after its last claim
    tokens_at           timestamptz,
    paused_at           timestamptz,
    pause_reason        text,
    paused_by           text,
    rr_key              text,         -- the key served last (round-robin cursor)
    rr_walk             boolean NOT NULL DEFAULT false,  -- a walk of keys goes on
    rr_walk_from        text,         -- ... the key it started after
    rr_walk_wrapped     boolean NOT NULL DEFAULT false,  -- ... and whether it wrapped
    rate_queue          jsonb,        -- turns promised to held owners: [{o, at}]
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text,
    CHECK ((rate IS NULL) = (rate_per_second IS NULL)),
    CHECK ((rate_per_key IS NULL) = (key_rate_per_second IS NULL))
);

-- Per-key token buckets (only with a per-key rate). A missing row is a full bucket, so
-- rows of keys idle past a refill are deleted by retention at no risk.
CREATE TABLE tool_flow_keys (
    tool            text NOT NULL,
    concurrency_key text NOT NULL,
    tokens          float8 NOT NULL,
    tokens_at       timestamptz NOT NULL,
    PRIMARY KEY (tool, concurrency_key)
);

-- The journal of flow changes (limit, clear, pause, resume), by whom.
CREATE TABLE tool_flow_events (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tool    text NOT NULL,
    event   text NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    details jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX tool_flow_events_tool_idx ON tool_flow_events (tool, id);

-- The claim, the triggers that keep a tool's flow row and wake a sidecar when a slot
-- frees, and the limits' functions: sidecar/sql/functions/flow.sql and claim.sql.

-- tool_job_enqueue and sidecar_enqueue take a concurrency key since this migration
-- (sidecar/sql/functions/enqueue.sql, one more argument): their versions of migration
-- 014 are dropped (a database built after the functions left the migrations never had
-- them).
DROP FUNCTION IF EXISTS sidecar_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                        jsonb, integer, text, text);
DROP FUNCTION IF EXISTS tool_job_enqueue(text, jsonb, text, integer, timestamptz, interval,
                                         interval, jsonb, integer, text, text, bigint, jsonb);
