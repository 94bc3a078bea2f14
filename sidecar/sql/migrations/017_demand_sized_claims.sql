-- Demand-sized claims (issue 28): a sidecar with several free slots claims up to that
-- many jobs in one statement, each with its own fencing token, attempt and lease, instead
-- of one statement per slot.
--
-- A tool without a flow row claims in claim_job itself (queries.sql: LIMIT $6 on each
-- part). A tool with one claims through tool_job_claim_flow_many below, which calls
-- tool_job_claim_flow once per job: every call sees the claims made before it in the same
-- transaction (its own writes), so the caps, rates and the round-robin of keys hold
-- exactly as they do one statement at a time, and the flow row stays locked (claims of
-- the tool take turns) for the whole batch.
-- compatible-from: 16

-- The row of a claim, by name: tool_job_claim_flow's columns (claim_job's too).
CREATE TYPE tool_job_claim_row AS (
    id uuid, tool text, payload_text text, fencing_token bigint, attempt integer,
    max_attempts integer, lease_until timestamptz, idempotency_key text,
    previous_state text, refunded boolean, lease_remaining float8, checkpoint_text text,
    stage integer, traceparent text, tracestate text, lifetime_remaining float8,
    blocked text, retry_in float8);

-- Up to p_limit claims of a tool with a flow row: one row per job claimed, then, when a
-- limit held the tool back before p_limit jobs were claimed, one more row with blocked
-- and retry_in set (tool_job_claim_flow's held row: the rate turn it promised this owner
-- is kept for it). No row: nothing claimable, nothing held. p_limit below 1 counts as 1.
CREATE FUNCTION tool_job_claim_flow_many(
    p_tool text, p_owner text, p_lease float8, p_lifetime float8, p_max_attempts integer,
    p_limit integer)
RETURNS SETOF tool_job_claim_row
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v tool_job_claim_row;
BEGIN
    FOR i IN 1..greatest(coalesce(p_limit, 1), 1) LOOP
        SELECT * INTO v
        FROM tool_job_claim_flow(p_tool, p_owner, p_lease, p_lifetime, p_max_attempts);
        EXIT WHEN NOT FOUND;
        RETURN NEXT v;
        EXIT WHEN v.blocked IS NOT NULL;
    END LOOP;
    RETURN;
END
$$;

DO $$
DECLARE
    home text := current_schema();
BEGIN
    EXECUTE format('ALTER FUNCTION %I.tool_job_claim_flow_many(text, text, float8, float8, '
                   'integer, integer) SET search_path = %I, pg_temp', home, home);
END
$$;

-- Sweeps taken in turns (issue 28): every sidecar used to run the lease and expiry sweeps
-- once per poll period, so a fleet of N sidecars of a tool ran them N times a period for
-- the same rows. The sidecar that finds its tool's last sweep at least a poll period old
-- takes the turn (sample_tool in queries.sql moves swept_at with a plain UPDATE: a
-- concurrent one waits for it, then finds the turn taken); the others only sample.
CREATE TABLE tool_sweeps (
    tool text PRIMARY KEY,
    swept_at timestamptz NOT NULL DEFAULT now()
);
