-- An operator's actions on jobs and tools (issue 41, point 2): retry, pause and resume,
-- as `sidecar retry/pause/resume` and the web view's buttons run them (queries.sql
-- retry_jobs, pause_tool, resume_tool). Each writes with its owner's rights (SECURITY
-- DEFINER, the schema owner that ran the migrations) under a search_path pinned to its
-- own schema with pg_temp last, and checks its inputs first (22023 naming the field), so
-- the web view's role (`sidecar migrate --web-role`, docs/operations.md "Roles and
-- Secrets") needs no write on tool_jobs, tool_job_events, tool_flow, tool_flow_events or
-- tool_idle_sidecars: what it can change is what these functions (and tool_job_cancel)
-- do, and nothing around them. EXECUTE is taken from PUBLIC: the owner, the worker role
-- (every tool_job_* and tool_flow_* function) and the web role may call them.

-- Requeue failed or cancelled jobs with fresh attempts and lifetime: the one p_job, or
-- every one of tool p_tool and/or whose tags contain p_tags, only in state p_state when
-- given ('failed' or 'cancelled'), and a fresh expiry as long as the one given at enqueue.
-- At least one of p_job, p_tool, p_tags (a retry of every job is not one click). The
-- fencing token is kept, so the next claim's token is still higher than any before (P7).
-- A job cancelled while it ran is left alone until its owner acknowledged the cancel or
-- the lease it held ended (case F14; queries.sql unacknowledged_cancels). Journaled
-- job_retried with p_by; one idle sidecar of each job's tool woken. Returns each job's
-- id, tool and previous state.
CREATE OR REPLACE FUNCTION tool_job_retry(p_job uuid, p_state text, p_tool text,
                                          p_by text, p_tags jsonb)
RETURNS TABLE (retried_id uuid, retried_tool text, previous_state text)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM tool_job_check_actor(p_by, p_tags);
    IF p_job IS NULL AND p_tool IS NULL AND p_tags IS NULL THEN
        RAISE EXCEPTION 'retry: give a job id, or a tool and/or tags to select jobs'
            USING ERRCODE = '22023';
    END IF;
    IF p_state IS NOT NULL AND p_state NOT IN ('failed', 'cancelled') THEN
        RAISE EXCEPTION 'state %: only failed or cancelled jobs are retried',
                        quote_literal(left(p_state, 40)) USING ERRCODE = '22023';
    END IF;
    IF p_tool IS NOT NULL AND p_tool !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
        RAISE EXCEPTION 'tool %: use 1-63 letters, digits, ''.'', ''_'' or ''-'', starting '
                        'with a letter or digit', quote_literal(left(p_tool, 80))
            USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    WITH target AS (
        SELECT id, state AS previous_state, attempt AS previous_attempts,
               error->>'kind' AS kind
        FROM tool_jobs
        WHERE state IN ('failed', 'cancelled')
          AND (p_job IS NULL OR id = p_job)
          AND (p_state IS NULL OR state = p_state)
          AND (p_tool IS NULL OR tool = p_tool)
          AND (p_tags IS NULL OR (tags @> p_tags AND tags <> '{}'::jsonb))
          -- F14: not a cancel whose owner may still run the tree (see cancel.sql)
          AND (state <> 'cancelled' OR lease_until IS NULL OR lease_until <= now())
        FOR UPDATE
    ), retried AS (
        UPDATE tool_jobs j
        SET state = 'queued', attempt = 0, run_after = now(), owner_id = NULL,
            lease_until = NULL, heartbeat_at = NULL, error = NULL, finished_at = NULL,
            cancel_pending = false,
            first_claimed_at = NULL,
            expires_at = now() + (j.expires_at - j.created_at)  -- NULL stays NULL
        FROM target
        WHERE j.id = target.id
        RETURNING j.id, j.tool, j.fencing_token, target.previous_state,
                  target.previous_attempts, target.kind
    ), journal AS (
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT id, fencing_token, 'job_retried',
               jsonb_build_object('previous_state', previous_state,
                                  'previous_attempts', previous_attempts,
                                  'previous_error', kind, 'by', p_by)
        FROM retried
    )
    SELECT r.id, r.tool, r.previous_state FROM retried r,
        LATERAL (SELECT tool_job_wake(r.tool, 1)) AS woken;
END
$$;

-- Stop every claim of tool p_tool fleet-wide from now on (running jobs go on); p_reason
-- (NULL keeps an earlier one; else 1-500 printable characters, as sidecar.protocol.flow
-- check_reason), p_by who. Journaled tool_paused. Returns the pause's time and reason, and
-- whether it was paused already.
CREATE OR REPLACE FUNCTION tool_flow_pause(p_tool text, p_reason text, p_by text)
RETURNS TABLE (paused_at timestamptz, pause_reason text, was_paused boolean)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM tool_job_check_actor(p_by, NULL);
    IF p_tool IS NULL OR p_tool !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
        RAISE EXCEPTION 'tool %: use 1-63 letters, digits, ''.'', ''_'' or ''-'', starting '
                        'with a letter or digit', coalesce(quote_literal(left(p_tool, 80)),
                                                           'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF p_reason IS NOT NULL AND (length(p_reason) NOT BETWEEN 1 AND 500
                                 OR btrim(p_reason) = ''
                                 OR p_reason ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'reason must be 1-500 printable characters (NULL: keep the '
                        'earlier one)' USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    WITH before AS (
        SELECT f.paused_at IS NOT NULL AS was_paused FROM tool_flow f WHERE f.tool = p_tool
    ), paused AS (
        INSERT INTO tool_flow AS f (tool, paused_at, pause_reason, paused_by, updated_by)
        VALUES (p_tool, now(), p_reason, p_by, p_by)
        ON CONFLICT (tool) DO UPDATE
        SET paused_at = coalesce(f.paused_at, now()),
            pause_reason = coalesce(p_reason, f.pause_reason), paused_by = p_by,
            updated_at = now(), updated_by = p_by
        RETURNING f.tool, f.paused_at, f.pause_reason
    ), journal AS (
        INSERT INTO tool_flow_events (tool, event, details)
        SELECT tool, 'tool_paused', jsonb_build_object('reason', p_reason, 'by', p_by)
        FROM paused
    )
    SELECT paused.paused_at, paused.pause_reason,
           coalesce((SELECT before.was_paused FROM before), false)
    FROM paused;
END
$$;

-- Let claims of tool p_tool start again and wake its idle sidecars (up to 1000),
-- journaled tool_resumed with p_by. No row when the tool was not paused.
CREATE OR REPLACE FUNCTION tool_flow_resume(p_tool text, p_by text)
RETURNS TABLE (resumed_tool text, woken bigint)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM tool_job_check_actor(p_by, NULL);
    IF p_tool IS NULL OR p_tool !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
        RAISE EXCEPTION 'tool %: use 1-63 letters, digits, ''.'', ''_'' or ''-'', starting '
                        'with a letter or digit', coalesce(quote_literal(left(p_tool, 80)),
                                                           'NULL')
            USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    WITH resumed AS (
        UPDATE tool_flow SET paused_at = NULL, pause_reason = NULL, paused_by = NULL,
                             updated_at = now(), updated_by = p_by
        WHERE tool = p_tool AND paused_at IS NOT NULL
        RETURNING tool
    ), journal AS (
        INSERT INTO tool_flow_events (tool, event, details)
        SELECT tool, 'tool_resumed', jsonb_build_object('by', p_by) FROM resumed
    )
    SELECT resumed.tool, tool_job_wake(resumed.tool, 1000) FROM resumed;
END
$$;

REVOKE EXECUTE ON FUNCTION tool_job_retry(uuid, text, text, text, jsonb) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION tool_flow_pause(text, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION tool_flow_resume(text, text) FROM PUBLIC;
