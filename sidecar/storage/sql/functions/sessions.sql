-- Agent sessions (issue 43, point 3; migration 026 explains the table and the claim's
-- rules; docs/callers.md "Sessions"). A session is started, continued, renewed and ended
-- only by the sidecar that holds it, each write fenced by owner and generation (the
-- session's own fencing token), as a job's lease is by owner and token.

-- Each call of a session gets its place in the session's order as it is inserted, however
-- it is inserted (an enqueue, a next stage, a caller's own INSERT): a number from one
-- sequence (migration 026 says why not created_at or the id).
CREATE OR REPLACE FUNCTION tool_job_session_order() RETURNS trigger
SET search_path FROM CURRENT
LANGUAGE plpgsql AS $$
BEGIN
    NEW.session_seq := nextval('tool_jobs_session_seq');
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS tool_jobs_session_order ON tool_jobs;
CREATE TRIGGER tool_jobs_session_order
    BEFORE INSERT ON tool_jobs
    FOR EACH ROW WHEN (NEW.session_key IS NOT NULL)
    EXECUTE FUNCTION tool_job_session_order();

-- What a call of session (p_tool, p_key), just claimed by p_owner, runs in. status:
--   'new'        no such session yet: it starts now, held by p_owner (generation 1);
--   'continued'  p_owner holds it under a live lease: the call runs in its process;
--   'restarted'  it had ended or was lost and p_restart (SESSION_RESTART=fresh): it
--                starts again, generation + 1, held by p_owner;
--   'lost'       it had ended or was lost (end_reason says how): the call fails
--                session_lost;
--   'elsewhere'  another owner holds it under a live lease (a claim that raced its start):
--                the call goes back to the queue.
-- A live session whose lease ran out is marked lost here first (its holder can no longer
-- renew it). Each start or call sets lease_until p_lease seconds from now.
CREATE OR REPLACE FUNCTION tool_job_session_begin(
    p_tool text, p_key text, p_owner text, p_lease float8, p_restart boolean)
RETURNS TABLE (status text, generation integer, end_reason text)
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    s tool_sessions%ROWTYPE;
    v_until timestamptz := now() + p_lease * interval '1 second';
BEGIN
    INSERT INTO tool_sessions AS t (tool, session_key, state, owner_id, generation,
                                    lease_until, last_call_at, calls)
    VALUES (p_tool, p_key, 'live', p_owner, 1, v_until, now(), 1)
    ON CONFLICT (tool, session_key) DO NOTHING;
    IF FOUND THEN
        RETURN QUERY SELECT 'new'::text, 1, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO s FROM tool_sessions t
    WHERE t.tool = p_tool AND t.session_key = p_key FOR UPDATE;
    IF s.state = 'live' AND s.lease_until > now() THEN
        IF s.owner_id <> p_owner THEN
            RETURN QUERY SELECT 'elsewhere'::text, s.generation, NULL::text;
            RETURN;
        END IF;
        UPDATE tool_sessions t
        SET lease_until = greatest(t.lease_until, v_until), last_call_at = now(),
            calls = t.calls + 1
        WHERE t.tool = p_tool AND t.session_key = p_key;
        RETURN QUERY SELECT 'continued'::text, s.generation, NULL::text;
        RETURN;
    END IF;
    IF s.state = 'live' THEN  -- its lease ran out: its holder can no longer renew it
        s.end_reason := format('its lease ran out (held by %s)', s.owner_id);
        UPDATE tool_sessions t
        SET state = 'lost', lease_until = NULL, ended_at = now(), end_reason = s.end_reason
        WHERE t.tool = p_tool AND t.session_key = p_key;
    END IF;
    IF p_restart THEN
        UPDATE tool_sessions t
        SET state = 'live', owner_id = p_owner, generation = t.generation + 1,
            lease_until = v_until, started_at = now(), last_call_at = now(), calls = 1,
            ended_at = NULL, end_reason = NULL
        WHERE t.tool = p_tool AND t.session_key = p_key;
        RETURN QUERY SELECT 'restarted'::text, s.generation + 1, s.end_reason;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'lost'::text, s.generation, s.end_reason;
END
$$;
