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

-- Whether an expired lease is given back: tool_job_expiry_refunded, and the demand
-- counting such a lease as claimable (sidecar/sql/functions/expiry.sql, demand.sql).
