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
