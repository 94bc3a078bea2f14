-- Parked jobs (issue 44, point 1; docs/side-effects.md "Approval"): a tool whose profile
-- says APPROVAL_MODE=park asks a person's yes, saves its checkpoint and exits; its job
-- becomes `waiting` with the request, holding neither a slot nor a lease, its attempt not
-- spent. Approved, it is queued again and the next attempt finds the answer in
-- SIDECAR_APPROVAL (tool_jobs.approval, carried by the claim row) beside its checkpoint;
-- denied, it fails `denied`; unanswered by the request's deadline, `approval_expired`
-- (the fleet's sweep). A waiting job is unfinished: cancels, interests and retention
-- treat it so.
ALTER TABLE tool_jobs DROP CONSTRAINT tool_jobs_state_check;
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_state_check
    CHECK (state IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled'))
    NOT VALID;
ALTER TABLE tool_jobs ADD COLUMN approval jsonb;
ALTER TYPE tool_job_claim_row ADD ATTRIBUTE approval_text text;
-- A session's unfinished calls, parked ones too: one parked for an answer holds its
-- session's turn (claimable.sql tool_job_session_free; replaces migration 026's).
DROP INDEX tool_jobs_session_calls_idx;
CREATE INDEX tool_jobs_session_calls_idx ON tool_jobs (tool, session_key, created_at, id)
    WHERE session_key IS NOT NULL AND state IN ('queued', 'running', 'waiting');
-- Each poll counts its tool's parked jobs (sidecar_jobs_waiting_approval).
CREATE INDEX tool_jobs_waiting_idx ON tool_jobs (tool) WHERE state = 'waiting';
-- The sweep's read: open requests by deadline.
CREATE INDEX tool_approvals_deadline_idx ON tool_approvals (deadline) WHERE state = 'pending';
