-- Case F16 (migration 012): an attempt whose tool never started is never what exhausts
-- max_attempts.
--
-- Whether the expired lease of this row is given back rather than spent: its owner never
-- renewed it (heartbeat_at is still the claim's own now(): an owner that knew of its
-- claim renews within H), its tool's start is not in the journal (tool_request_started
-- for this token, written within a second of the start: commit.py
-- JOURNAL_DEFER_SECONDS), and refunds are left (fewer than max_attempts). Read through
-- tool_job_events_job_idx, and only for rows under an expired lease.
CREATE OR REPLACE FUNCTION tool_job_expiry_refunded(j tool_jobs) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce(j.heartbeat_at = j.claimed_at, false)  -- claimed before 012: spent
       AND j.unstarted_expiries < j.max_attempts
       AND NOT EXISTS (SELECT FROM tool_job_events e
                       WHERE e.job_id = j.id AND e.fencing_token = j.fencing_token
                         AND e.event = 'tool_request_started')
$$;
