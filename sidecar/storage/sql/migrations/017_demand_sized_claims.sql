-- Demand-sized claims (issue 28): a sidecar with several free slots claims up to that
-- many jobs in one statement, each with its own fencing token, attempt and lease, instead
-- of one statement per slot.
--
-- A tool without a flow row claims in claim_job itself (queries.sql: LIMIT $6 on each
-- part). A tool with one claims through tool_job_claim_flow_many (functions/claim.sql),
-- which calls tool_job_claim_flow once per job: every call sees the claims made before it
-- in the same transaction (its own writes), so the caps, rates and the round-robin of keys
-- hold exactly as they do one statement at a time, and the flow row stays locked (claims
-- of the tool take turns) for the whole batch.
-- compatible-from: 16

-- The row of a claim, by name: tool_job_claim_flow's columns (claim_job's too).
CREATE TYPE tool_job_claim_row AS (
    id uuid, tool text, payload_text text, fencing_token bigint, attempt integer,
    max_attempts integer, lease_until timestamptz, idempotency_key text,
    previous_state text, refunded boolean, lease_remaining float8, checkpoint_text text,
    stage integer, traceparent text, tracestate text, lifetime_remaining float8,
    blocked text, retry_in float8);

-- tool_job_claim_flow_many: sidecar/sql/functions/claim.sql.

-- Sweeps taken in turns (issue 28): every sidecar used to run the lease and expiry sweeps
-- once per poll period, so a fleet of N sidecars of a tool ran them N times a period for
-- the same rows. The sidecar that finds its tool's last sweep at least a poll period old
-- takes the turn (sample_tool in queries.sql moves swept_at with a plain UPDATE: a
-- concurrent one waits for it, then finds the turn taken); the others only sample.
CREATE TABLE tool_sweeps (
    tool text PRIMARY KEY,
    swept_at timestamptz NOT NULL DEFAULT now()
);

-- Time-ordered job ids (issue 28), which tool_job_enqueue now uses: tool_job_new_id
-- (sidecar/sql/functions/enqueue.sql).
