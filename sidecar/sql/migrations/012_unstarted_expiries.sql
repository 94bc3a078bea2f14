-- Case F16: an attempt whose tool never started is never what exhausts max_attempts.
-- A sidecar that lost the answer of its claim (the claim committed) and died before it
-- could settle it leaves the row running under its owner id with no tool started; so
-- does one that died between its claim and its spawn. When such a lease expires, the
-- attempt is given back instead of spent: the next claim keeps the attempt number
-- (the fencing token still moves on) and counts the refund in unstarted_expiries, at
-- most max_attempts times, so a tool that kills its sidecar before its start reaches the
-- journal cannot loop for ever.
-- compatible-from: 11
ALTER TABLE tool_jobs ADD COLUMN unstarted_expiries integer NOT NULL DEFAULT 0;

-- Whether the tool of attempt (job, token) started, by the journal: its
-- tool_request_started row, written within a second of the start (commit.py,
-- JOURNAL_DEFER_SECONDS) or with the statement that ends the attempt. Read through
-- tool_job_events_job_idx, and only for rows under an expired lease.
CREATE FUNCTION tool_job_attempt_started(job uuid, token bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT FROM tool_job_events e
                   WHERE e.job_id = job AND e.fencing_token = token
                     AND e.event = 'tool_request_started')
$$;

-- Whether the expired lease of attempt (job, token) is given back rather than spent: its
-- tool never started and the job has refunds left (refunds < max_attempts).
CREATE FUNCTION tool_job_expiry_refunded(job uuid, token bigint, refunds integer,
                                         max_attempts integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT refunds < max_attempts AND NOT tool_job_attempt_started(job, token)
$$;

-- The demand counts what a claim could take: an expired lease whose attempt is given
-- back is claimable too.
CREATE OR REPLACE FUNCTION tool_job_demand(wanted_tool text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM tool_jobs
    WHERE tool = wanted_tool
      AND ((state = 'queued' AND run_after <= now())
           OR (state = 'running' AND (lease_until >= now() OR attempt < max_attempts
                                      OR tool_job_expiry_refunded(id, fencing_token,
                                                                  unstarted_expiries,
                                                                  max_attempts))))
$$;
