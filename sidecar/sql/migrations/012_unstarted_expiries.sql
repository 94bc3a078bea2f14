-- Case F16: an attempt whose tool never started is never what exhausts max_attempts.
-- A sidecar that lost the answer of its claim (the claim committed) and died before it
-- could settle it leaves the row running under its owner id with no tool started; so
-- does one that died between its claim and its spawn. When such a lease expires, the
-- attempt is given back instead of spent: the next claim keeps the attempt number
-- (the fencing token still moves on) and counts the refund in unstarted_expiries, at
-- most max_attempts times, so a tool that kills its sidecar at once cannot loop for ever.
-- compatible-from: 11
ALTER TABLE tool_jobs ADD COLUMN unstarted_expiries integer NOT NULL DEFAULT 0,
                      ADD COLUMN claimed_at timestamptz;

-- Whether the expired lease of this row is given back rather than spent: its owner never
-- renewed it (heartbeat_at is still the claim's own now(): an owner that knew of its
-- claim renews within H), its tool's start is not in the journal (tool_request_started
-- for this token, written within a second of the start: commit.py
-- JOURNAL_DEFER_SECONDS), and refunds are left (fewer than max_attempts). Read through
-- tool_job_events_job_idx, and only for rows under an expired lease.
CREATE FUNCTION tool_job_expiry_refunded(j tool_jobs) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(j.heartbeat_at = j.claimed_at, false)  -- claimed before 012: spent
       AND j.unstarted_expiries < j.max_attempts
       AND NOT EXISTS (SELECT FROM tool_job_events e
                       WHERE e.job_id = j.id AND e.fencing_token = j.fencing_token
                         AND e.event = 'tool_request_started')
$$;

-- The demand counts what a claim could take: an expired lease whose attempt is given
-- back is claimable too.
CREATE OR REPLACE FUNCTION tool_job_demand(wanted_tool text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM tool_jobs j
    WHERE j.tool = wanted_tool
      AND ((j.state = 'queued' AND j.run_after <= now())
           OR (j.state = 'running' AND (j.lease_until >= now() OR j.attempt < j.max_attempts
                                        OR tool_job_expiry_refunded(j))))
$$;
