-- Dedupe policy (issue 44, point 4; migration 027, docs/callers.md "Idempotency keys"):
-- the parse of a policy's text, the release of a finished job's key, and the trigger that
-- releases it at the job's end when its policy already allows it.

-- A dedupe policy's text as tool_jobs.key_frees_after: 'forever' = NULL (the key is
-- never freed), 'active' = 0 (freed once the job has finished), a window of 1 to 366 days
-- written as a whole number and a unit ('90s', '30m', '24h', '7d') = freed once the job
-- has finished and that long has passed since its enqueue. sidecar/protocol/enqueue_args.py
-- (check_dedupe) holds the same rules (tests/test_dedupe.py checks both agree). Anything
-- else raises 22023 naming the field.
CREATE OR REPLACE FUNCTION tool_job_dedupe_window(p_policy text) RETURNS interval
SET search_path FROM CURRENT
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_window interval;
BEGIN
    IF p_policy = 'forever' THEN
        RETURN NULL;
    ELSIF p_policy = 'active' THEN
        RETURN interval '0';
    ELSIF p_policy ~ '^[1-9][0-9]{0,7}[smhd]$' THEN
        v_window := left(p_policy, -1)::bigint * CASE right(p_policy, 1)
            WHEN 's' THEN interval '1 second' WHEN 'm' THEN interval '1 minute'
            WHEN 'h' THEN interval '1 hour' ELSE interval '1 day' END;
        IF v_window <= interval '366 days' THEN
            RETURN v_window;
        END IF;
    END IF;
    RAISE EXCEPTION 'dedupe %: use forever, active or a window of 1s to 366d, e.g. 24h',
                    coalesce(quote_literal(left(p_policy, 80)), 'NULL')
        USING ERRCODE = '22023';
END
$$;

-- Whether a job's key may be freed now by its policy: finished, and its window (0 for
-- `active`) since its enqueue passed. A `forever` job never.
CREATE OR REPLACE FUNCTION tool_job_key_freeable(p_state text, p_created_at timestamptz,
                                                 p_window interval) RETURNS boolean
SET search_path FROM CURRENT
LANGUAGE sql STABLE AS $$
    SELECT p_window IS NOT NULL AND p_state IN ('succeeded', 'failed', 'cancelled')
           AND p_created_at + p_window <= now()
$$;

-- Free the key p_key if the job holding it lets it go now (tool_job_key_freeable): its
-- row keeps the key (for audit) but no longer holds it, and the journal says
-- `key_freed` on it. Returns the freed job's id, or NULL (no holder, or one that keeps
-- it). Called by tool_job_enqueue when the key is taken and by a finishing job whose next
-- stage's key is taken (sidecar/storage/worker_store.py).
CREATE OR REPLACE FUNCTION tool_job_free_key(p_key text) RETURNS uuid
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id uuid;
    v_token bigint;
    v_window interval;
BEGIN
    UPDATE tool_jobs j SET key_held = false
    WHERE j.idempotency_key = p_key AND j.key_held
      AND tool_job_key_freeable(j.state, j.created_at, j.key_frees_after)
    RETURNING j.id, j.fencing_token, j.key_frees_after INTO v_id, v_token, v_window;
    IF v_id IS NOT NULL THEN
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT v_id, v_token, 'key_freed',
               jsonb_build_object('key_frees_after_s', extract(epoch FROM v_window));
    END IF;
    RETURN v_id;
END
$$;

-- A job that finishes lets its key go at once when its policy already allows it
-- (`active`, or a window already past), so the next enqueue of the key finds it free.
CREATE OR REPLACE FUNCTION tool_job_key_freed_at_end() RETURNS trigger
SET search_path FROM CURRENT
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.key_held AND tool_job_key_freeable(NEW.state, NEW.created_at, NEW.key_frees_after)
    THEN
        NEW.key_held := false;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS tool_jobs_key_freed ON tool_jobs;
CREATE TRIGGER tool_jobs_key_freed
    BEFORE UPDATE OF state ON tool_jobs
    FOR EACH ROW
    WHEN (NEW.key_frees_after IS NOT NULL AND NEW.state IS DISTINCT FROM OLD.state)
    EXECUTE FUNCTION tool_job_key_freed_at_end();

REVOKE EXECUTE ON FUNCTION tool_job_free_key(text) FROM PUBLIC;
