-- Flow control (issue 27; migration 016 explains the limits, keys and slots): the triggers
-- that keep a tool's flow row and wake a sidecar when a slot frees, and what the claim
-- (claim.sql) asks of the limits (with claimable.sql).

-- A job with a key or a session (migration 026) gives its tool a flow row, whatever
-- inserted it (an enqueue, a next stage, a caller's own INSERT): the fast claim reads
-- only jobs without a key, and only tool_job_claim_flow checks the session rules
-- (claimable.sql tool_job_session_free).
CREATE OR REPLACE FUNCTION tool_job_keyed_flow() RETURNS trigger
SET search_path FROM CURRENT
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tool_flow (tool, updated_by)
    VALUES (NEW.tool, CASE WHEN NEW.concurrency_key <> '' THEN 'a job with a concurrency key'
                           ELSE 'a job with a session' END)
    ON CONFLICT (tool) DO NOTHING;
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS tool_jobs_keyed_flow ON tool_jobs;
CREATE TRIGGER tool_jobs_keyed_flow
    AFTER INSERT OR UPDATE OF concurrency_key, session_key ON tool_jobs
    FOR EACH ROW WHEN (NEW.concurrency_key <> '' OR NEW.session_key IS NOT NULL)
    EXECUTE FUNCTION tool_job_keyed_flow();

-- A freed slot wakes one idle sidecar of a capped tool at commit, as an enqueue does: a
-- job that stops running, or a cancelled one whose tree its owner confirmed dead.
CREATE OR REPLACE FUNCTION tool_job_slot_freed() RETURNS trigger
SET search_path FROM CURRENT
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM tool_flow f
               WHERE f.tool = NEW.tool AND f.paused_at IS NULL
                 AND (f.max_running IS NOT NULL OR f.max_running_per_key IS NOT NULL)) THEN
        PERFORM tool_job_wake(NEW.tool, 1);
    END IF;
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS tool_jobs_slot_freed ON tool_jobs;
CREATE TRIGGER tool_jobs_slot_freed
    AFTER UPDATE OF state, cancel_pending ON tool_jobs
    FOR EACH ROW WHEN ((OLD.state = 'running' AND NEW.state <> 'running'
                        AND NOT NEW.cancel_pending)
                       OR (OLD.cancel_pending AND NOT NEW.cancel_pending))
    EXECUTE FUNCTION tool_job_slot_freed();

-- Slots taken in tool p_tool (of key p_key; NULL: every key): jobs running under a live
-- lease, and jobs cancelled while they ran whose owner has not yet confirmed the tree
-- dead and whose lease has not ended.
CREATE OR REPLACE FUNCTION tool_flow_occupied(p_tool text, p_key text) RETURNS bigint
SET search_path FROM CURRENT
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM tool_jobs j
            WHERE j.tool = p_tool AND j.state = 'running' AND j.lease_until >= now()
              AND (p_key IS NULL OR j.concurrency_key = p_key))
         + (SELECT count(*) FROM tool_jobs j
            WHERE j.tool = p_tool AND j.cancel_pending AND j.lease_until > now()
              AND (p_key IS NULL OR j.concurrency_key = p_key))
$$;

-- The row tool_job_claim_flow returns when a limit held the tool's jobs back: no job,
-- only the reason and, for a rate, the seconds until this owner's turn. Its type is the
-- claim's row (tool_job_claim_row, migration 017; migration 020 changed it to that).
CREATE OR REPLACE FUNCTION tool_flow_held(p_tool text, p_reason text, p_retry_in float8)
RETURNS SETOF tool_job_claim_row
SET search_path FROM CURRENT
LANGUAGE sql IMMUTABLE AS $$
    SELECT NULL::uuid, p_tool, NULL::text, NULL::bigint, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::text, NULL::text, NULL::boolean, NULL::float8,
           NULL::text, NULL::integer, NULL::text, NULL::text, NULL::float8, p_reason,
           p_retry_in, NULL::text, NULL::text
$$;

-- Whether a set_tool_limits call ($3: the fields it sets) changes the bucket of the row
-- `old` into `new`: a rate or burst given with another value than it had.
CREATE OR REPLACE FUNCTION tool_flow_bucket_changed(old tool_flow, new tool_flow, changes jsonb)
RETURNS boolean
SET search_path FROM CURRENT
LANGUAGE sql IMMUTABLE AS $$
    SELECT (changes ? 'rate' AND new.rate_per_second IS DISTINCT FROM old.rate_per_second)
        OR (changes ? 'burst' AND new.burst IS DISTINCT FROM old.burst)
$$;

-- The limits' answers (free slots, tokens, room, and why a key is held back) are in
-- claimable.sql, next to the row rules they complete.
