-- The caller's half of a tool call (issue 26, migration 015): waiting without polling.
--
-- A job's end wakes the callers waiting for it and nobody else: every statement that makes
-- a job terminal (a fenced finish, an exhausted lease, a cancel, and any later one: an
-- expiry, an operator's UPDATE) fires this trigger, which sends one NOTIFY on the job's own
-- channel, 'sidecar_job_' and the id's 32 hex digits (tool_job_channel), with the payload
-- {"id", "state"}. NOTIFY is transactional: the notification leaves at commit, so an end
-- rolled back (a fenced write that lost the lease, a statement cancelled) wakes nobody.
-- The trigger fires only when an UPDATE names the state column and moves it into a
-- terminal state: heartbeats (lease_until, heartbeat_at) and claims do not fire it.

-- The NOTIFY channel of one job: an unquoted identifier (lower-case hex), 44 characters.
CREATE OR REPLACE FUNCTION tool_job_channel(job uuid) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'sidecar_job_' || replace(job::text, '-', '')
$$;

-- The channel is spelled out here rather than calling tool_job_channel: a trigger runs
-- under the search_path of whichever session ends the job.
CREATE OR REPLACE FUNCTION tool_job_notify_end() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sidecar_job_' || replace(NEW.id::text, '-', ''),
                      json_build_object('id', NEW.id, 'state', NEW.state)::text);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS tool_jobs_notify_end ON tool_jobs;
CREATE TRIGGER tool_jobs_notify_end
    AFTER UPDATE OF state ON tool_jobs
    FOR EACH ROW
    WHEN (NEW.state IN ('succeeded', 'failed', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION tool_job_notify_end();

-- Why the queued jobs among p_ids (a JSON array of job ids as text, at most 1,000) wait
-- (issue 41, point 4), when p_explain (else no row: only the expiry below): one row per
-- such job, with reason
--   'scheduled'            its run_after is in the future (detail: that time);
--   'paused'               its tool's flow is paused (detail: the pause's reason);
--   'no_live_sidecar'      no sidecar of its tool was seen for two minutes: no sweep of
--                          the tool (tool_sweeps, moved by its sidecars' polls), no idle
--                          registration (tool_idle_sidecars, as tool_job_wake counts
--                          them) and no job of the tool running under a live lease;
--   'max_running'          the tool's cap is reached (tool_flow_slots);
--   'rate'                 the tool's bucket holds no whole token now (tool_flow_tokens);
--   'max_running_per_key', 'rate_per_key'  its key's slot or turn (tool_flow_key_blocked);
--   'queued_behind'        nothing holds it but the jobs before it;
--   NULL                   a claim could take it now;
-- the limits read through claimable.sql's functions, the ones the claim and the demand
-- use (issue 41, point 3: one definition of what may start now); and ahead, the due queued jobs of its tool before it in claim order (priority,
-- run_after, created_at, id), counted up to 10,000 (more count as 10,000; one read of at
-- most that many rows per tool, not per job). Before that, a job among p_ids whose start
-- deadline (expires_at) passed ends "expired" (tool_job_expire), as the sidecars'
-- sweep would end it: a waiter of a tool no sidecar serves still sees its job end.
-- SECURITY DEFINER (the caller's role reads neither the flow nor the sweeps, and may not
-- end jobs), under the schema's own search_path; EXECUTE for the caller's role
-- (roles.sql caller_grants) and the worker's. plpgsql: it calls flow.sql's functions,
-- created after this file.
CREATE OR REPLACE FUNCTION tool_job_wait_reasons(p_ids jsonb, p_explain boolean)
RETURNS TABLE (id uuid, reason text, ahead bigint, detail text)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c_max_ids constant integer := 1000;
    c_max_ahead constant integer := 10000;
    v_clock timestamptz := clock_timestamp();
    v_job record;
    f tool_flow%ROWTYPE;
    v_reason text;
    v_detail text;
BEGIN
    IF p_ids IS NULL OR jsonb_typeof(p_ids) <> 'array'
            OR jsonb_array_length(p_ids) > c_max_ids THEN
        RAISE EXCEPTION 'tool_job_wait_reasons: give a JSON array of at most % job ids',
                        c_max_ids USING ERRCODE = '22023';
    END IF;
    PERFORM tool_job_expire(p_ids, c_max_ids);
    IF NOT p_explain THEN
        RETURN;
    END IF;
    FOR v_job IN
        WITH wanted AS (
            SELECT t.id, t.tool, t.run_after, t.concurrency_key
            FROM (SELECT DISTINCT w.id::uuid AS id
                  FROM jsonb_array_elements_text(p_ids) w(id)) w
            JOIN tool_jobs t ON t.id = w.id
            WHERE t.state = 'queued'
        ), tools AS (
            SELECT DISTINCT wanted.tool FROM wanted
        ), ranked AS (
            SELECT q.id, q.ahead
            FROM tools, LATERAL (
                SELECT r.id, row_number() OVER (ORDER BY r.priority, r.run_after,
                                                         r.created_at, r.id) - 1 AS ahead
                FROM tool_jobs r
                WHERE r.tool = tools.tool AND r.state = 'queued' AND r.run_after <= now()
                ORDER BY r.priority, r.run_after, r.created_at, r.id
                LIMIT c_max_ahead) q
        ), due AS (
            SELECT tools.tool, (SELECT count(*) FROM (
                       SELECT FROM tool_jobs r
                       WHERE r.tool = tools.tool AND r.state = 'queued'
                         AND r.run_after <= now()
                       LIMIT c_max_ahead) c) AS n
            FROM tools
        )
        SELECT wanted.*, coalesce(ranked.ahead, due.n) AS ahead
        FROM wanted
        JOIN due ON due.tool = wanted.tool
        LEFT JOIN ranked ON ranked.id = wanted.id
    LOOP
        SELECT * INTO f FROM tool_flow WHERE tool_flow.tool = v_job.tool;
        v_reason := NULL;
        v_detail := NULL;
        IF v_job.run_after > now() THEN
            v_reason := 'scheduled';
            v_detail := v_job.run_after::text;
        ELSIF f.paused_at IS NOT NULL THEN
            v_reason := 'paused';
            v_detail := f.pause_reason;
        ELSIF NOT (EXISTS (SELECT FROM tool_sweeps s WHERE s.tool = v_job.tool
                                                     AND s.swept_at > now() - interval '2 minutes')
                   OR EXISTS (SELECT FROM tool_idle_sidecars i
                              WHERE i.tool = v_job.tool
                                AND i.seen_at > now() - interval '2 minutes')
                   OR EXISTS (SELECT FROM tool_jobs r
                              WHERE r.tool = v_job.tool AND r.state = 'running'
                                AND r.lease_until >= now())) THEN
            v_reason := 'no_live_sidecar';
        ELSIF f.tool IS NOT NULL AND tool_flow_slots(f, NULL) <= 0 THEN
            v_reason := 'max_running';
        ELSIF f.tool IS NOT NULL AND tool_flow_tokens(f, NULL, v_clock) < 1 THEN
            v_reason := 'rate';
        ELSIF f.tool IS NOT NULL THEN
            v_reason := tool_flow_key_blocked(f, v_job.concurrency_key, v_clock);
        END IF;
        IF v_reason IS NULL AND v_job.ahead > 0 THEN
            v_reason := 'queued_behind';
        END IF;
        id := v_job.id;
        reason := v_reason;
        ahead := v_job.ahead;
        detail := v_detail;
        RETURN NEXT;
    END LOOP;
END
$$;

REVOKE EXECUTE ON FUNCTION tool_job_wait_reasons(jsonb, boolean) FROM PUBLIC;
