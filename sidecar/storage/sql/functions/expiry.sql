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
-- jobs (NULL: no bound) whose expiry has passed while they were queued (a first attempt
-- or a retry), or running under an expired lease (no attempt runs), end failed with kind
-- "expired", journaled job_expired; of the jobs p_ids names (a jsonb array of ids as
-- text, as jobs_to_wait_for takes them), or of any job when p_ids is NULL. A running
-- attempt under a live lease is not touched: it ends as it would have. SKIP LOCKED, so
-- sweepers at once share the work. Returns id, tool, fencing_token, attempt of each.
--
-- Two kinds of caller (issue 41): the sweep one running sidecar takes in turn
-- (queries.sql fail_expired_jobs, p_ids NULL, read through tool_jobs_expiry_idx), and
-- every read of a job for a caller (the waiter, get and show: queries.sql
-- settle_expired), so a job past its expiry is `failed`/`expired` when read even while
-- every sidecar is down, the very outage expiry is for. The callers' role writes no job
-- row itself, so this writes with its owner's rights (SECURITY DEFINER under a pinned
-- search_path, as tool_job_cancel); it does nothing a sweep would not do.
CREATE OR REPLACE FUNCTION tool_job_expire(p_ids jsonb, p_limit integer)
RETURNS TABLE (id uuid, tool text, fencing_token bigint, attempt integer)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
-- Its inputs are checked as every definer function's (issue 41, point 2): a caller may
-- name at most 1,000 jobs at a time, as an array; a limit, when given, is positive.
IF p_ids IS NOT NULL AND (jsonb_typeof(p_ids) <> 'array'
                          OR jsonb_array_length(p_ids) > 1000) THEN
    RAISE EXCEPTION 'ids: a JSON array of at most 1000 job ids (NULL: every job)'
        USING ERRCODE = '22023';
END IF;
IF p_limit IS NOT NULL AND p_limit < 1 THEN
    RAISE EXCEPTION 'limit: a positive number of jobs (NULL: no bound)'
        USING ERRCODE = '22023';
END IF;
RETURN QUERY
WITH doomed AS (
    SELECT j.id, j.state AS previous_state FROM tool_jobs j
    WHERE j.state IN ('queued', 'running') AND j.expires_at <= now()
      AND (j.state = 'queued' OR j.lease_until < now())
      AND (p_ids IS NULL
           OR j.id IN (SELECT wanted::uuid FROM jsonb_array_elements_text(p_ids) wanted))
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
    RETURNING j.id, j.tool, j.fencing_token, j.attempt, j.expires_at, doomed.previous_state
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT expired.id, expired.fencing_token, 'job_expired',
           jsonb_build_object('expires_at', expired.expires_at, 'attempts', expired.attempt,
                              'previous_state', expired.previous_state)
    FROM expired
)
SELECT expired.id, expired.tool, expired.fencing_token, expired.attempt FROM expired;
END
$$;

REVOKE EXECUTE ON FUNCTION tool_job_expire(jsonb, integer) FROM PUBLIC;
