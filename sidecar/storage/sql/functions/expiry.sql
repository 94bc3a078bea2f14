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

-- Issue 26: no attempt starts after a job's expires_at (the claim skips it). Up to p_limit
-- jobs (of p_ids, a JSON array of job ids as text; NULL: of any tool) whose expiry has
-- passed while they were queued (a first attempt or a retry), or running under an expired
-- lease (no attempt runs), end failed with kind "expired", journaled job_expired. A
-- running attempt under a live lease is not touched: it ends as it would have. SKIP
-- LOCKED, so sidecars sweeping at once share the work. The sidecars' sweep
-- (queries.sql fail_expired_jobs) calls it for every tool, and a waiter's
-- tool_job_wait_reasons (waiting.sql) for the jobs it waits for, so a job whose start
-- deadline passed ends even when no sidecar of its tool runs (issue 41).
CREATE OR REPLACE FUNCTION tool_job_fail_expired(p_limit integer, p_ids jsonb)
RETURNS TABLE (id uuid, tool text, fencing_token bigint, attempt integer)
SET search_path FROM CURRENT
LANGUAGE sql VOLATILE AS $$
    WITH doomed AS (
        SELECT j.id, j.state AS previous_state FROM tool_jobs j
        WHERE j.state IN ('queued', 'running') AND j.expires_at <= now()
          AND (j.state = 'queued' OR j.lease_until < now())
          AND (p_ids IS NULL
               OR j.id IN (SELECT w.id::uuid FROM jsonb_array_elements_text(p_ids) w(id)))
        ORDER BY j.expires_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), expired AS (
        UPDATE tool_jobs j
        SET state = 'failed', finished_at = now(), lease_until = NULL,
            error = jsonb_build_object(
                'kind', 'expired',
                'message', format('no attempt started before the job''s expiry (%s, %s after '
                                  'enqueue); %s attempt(s) ran', j.expires_at,
                                  j.expires_at - j.created_at, j.attempt))
        FROM doomed
        WHERE j.id = doomed.id
        RETURNING j.id, j.tool, j.fencing_token, j.attempt, j.expires_at,
                  doomed.previous_state
    ), journal AS (
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT e.id, e.fencing_token, 'job_expired',
               jsonb_build_object('expires_at', e.expires_at, 'attempts', e.attempt,
                                  'previous_state', e.previous_state)
        FROM expired e
    )
    SELECT e.id, e.tool, e.fencing_token, e.attempt FROM expired e
$$;
