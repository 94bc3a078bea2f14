-- Interest leases (issue 44, point 2; migration 029, docs/callers.md "Interest"): hold,
-- renew and let go of an interest, the check an enqueue makes, and the lapse that stops
-- the calls of an interest nobody renews.

-- An interest key: 1-256 printable characters. Raises 22023 naming the field.
CREATE OR REPLACE FUNCTION tool_job_interest_check_key(p_key text) RETURNS void
SET search_path FROM CURRENT
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_key IS NULL OR length(p_key) NOT BETWEEN 1 AND 256 OR btrim(p_key) = ''
            OR p_key ~ '[\x01-\x1f\x7f-\x9f]' THEN
        RAISE EXCEPTION 'interest must be 1-256 printable characters, e.g. agent-run-42'
            USING ERRCODE = '22023';
    END IF;
END
$$;

-- Hold the interest p_key for p_ttl from now (1 second to 1 day), by the database's
-- clock: a new one, a renewal of a live one (its end moved to now() + p_ttl, never
-- earlier than it was), or, after it lapsed or was let go, a new generation (the calls of
-- the old one stay ended). p_holder (who holds it, 1-256 printable characters or NULL) is
-- kept for the operator. Returns the interest's generation and end. Callers may run it
-- (SECURITY DEFINER: they have no write on the table).
CREATE OR REPLACE FUNCTION tool_job_interest_hold(p_key text, p_ttl interval, p_holder text)
RETURNS TABLE (generation integer, expires_at timestamptz)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM tool_job_interest_check_key(p_key);
    IF p_ttl IS NULL OR p_ttl < interval '1 second' OR p_ttl > interval '1 day' THEN
        RAISE EXCEPTION 'ttl %: from 1 second to 1 day, e.g. 30s', coalesce(p_ttl::text, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF p_holder IS NOT NULL AND (length(p_holder) NOT BETWEEN 1 AND 256
                                 OR p_holder ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'holder must be 1-256 printable characters (NULL: not said)'
            USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT FROM tool_interests i
               WHERE i.interest_key = p_key AND (i.state <> 'live' OR i.expires_at <= now()))
    THEN
        -- held again after it ran out: the calls of the old one end first (a sweep of
        -- every interest that ran out), never revived by this renewal
        PERFORM tool_job_interest_lapse(NULL);
    END IF;
    RETURN QUERY
    INSERT INTO tool_interests AS i (interest_key, state, holder, expires_at)
    VALUES (p_key, 'live', p_holder, now() + p_ttl)
    ON CONFLICT (interest_key) DO UPDATE
    SET state = 'live', holder = coalesce(EXCLUDED.holder, i.holder),
        generation = CASE WHEN i.state = 'live' AND i.expires_at > now() THEN i.generation
                          ELSE i.generation + 1 END,
        started_at = CASE WHEN i.state = 'live' AND i.expires_at > now() THEN i.started_at
                          ELSE now() END,
        expires_at = CASE WHEN i.state = 'live' AND i.expires_at > now()
                          THEN greatest(i.expires_at, EXCLUDED.expires_at)
                          ELSE EXCLUDED.expires_at END,
        renewed_at = now(), ended_at = NULL
    RETURNING i.generation, i.expires_at;
    -- its queued calls carry the new end (the claim reads it on the row)
    UPDATE tool_jobs j SET interest_until = i.expires_at
    FROM tool_interests i
    WHERE i.interest_key = p_key AND j.interest_key = p_key AND j.state = 'queued'
      AND j.interest_until IS DISTINCT FROM i.expires_at;
END
$$;

-- End every interest whose time ran out (p_key NULL), or let go of p_key now: its row
-- says lapsed (or released), and the unfinished calls of every interest that is not live
-- (these, and any a lapse missed: a call enqueued as its interest lapsed) stop: queued
-- ones end failed/expired, its running calls are
-- cancelled as tool_job_cancel cancels them (kind abandoned_by_caller; the owner told at
-- commit, so the tree is killed within about a second, and the result of an attempt
-- that ends after is rejected and only journaled, P6). Returns one row per call ended.
CREATE OR REPLACE FUNCTION tool_job_interest_lapse(p_key text)
RETURNS TABLE (job_id uuid, tool text, previous_state text, interest_key text)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    IF p_key IS NOT NULL THEN
        PERFORM tool_job_interest_check_key(p_key);
    END IF;
    RETURN QUERY
    WITH ended AS (
        UPDATE tool_interests i
        SET state = CASE WHEN p_key IS NULL THEN 'lapsed' ELSE 'released' END,
            ended_at = now()
        WHERE i.state = 'live'
          AND (CASE WHEN p_key IS NULL THEN i.expires_at <= now() ELSE i.interest_key = p_key END)
        RETURNING i.interest_key, i.state
    ), target AS (
        SELECT j.id, j.state AS previous_state,
               CASE WHEN i.state = 'released' OR e.state = 'released' THEN 'released'
                    ELSE 'lapsed' END AS how
        FROM tool_jobs j
        JOIN tool_interests i ON i.interest_key = j.interest_key
        LEFT JOIN ended e ON e.interest_key = j.interest_key
        WHERE j.interest_key IS NOT NULL AND j.state IN ('queued', 'running', 'waiting')
          AND (p_key IS NULL OR j.interest_key = p_key)
          AND (e.interest_key IS NOT NULL OR i.state <> 'live' OR i.expires_at <= now())
        FOR UPDATE OF j
    ), stopped AS (
        UPDATE tool_jobs j
        SET state = CASE WHEN t.previous_state = 'running' THEN 'cancelled' ELSE 'failed' END,
            finished_at = now(),
            lease_until = CASE WHEN t.previous_state = 'running' AND j.lease_until > now()
                               THEN j.lease_until END,
            cancel_pending = t.previous_state = 'running' AND j.lease_until > now(),
            error = CASE WHEN t.previous_state = 'running'
                THEN jsonb_build_object('kind', 'abandoned_by_caller', 'message',
                    format('its caller''s interest %s %s while it ran: nobody waits for '
                           'the answer any more', quote_literal(j.interest_key),
                           CASE WHEN t.how = 'lapsed' THEN 'lapsed' ELSE 'was let go' END))
                ELSE jsonb_build_object('kind', 'expired', 'message',
                    format('its caller''s interest %s %s before an attempt started',
                           quote_literal(j.interest_key),
                           CASE WHEN t.how = 'lapsed' THEN 'lapsed' ELSE 'was let go' END))
                END
        FROM target t
        WHERE j.id = t.id
        RETURNING j.id, j.tool, j.fencing_token, t.previous_state, j.owner_id, j.cancel_pending,
                  j.interest_key, t.how
    ), journal AS (
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT s.id, s.fencing_token, 'interest_lapsed',
               jsonb_build_object('interest', s.interest_key, 'previous_state',
                                  s.previous_state, 'how', s.how)
        FROM stopped s
    )
    SELECT s.id, s.tool, s.previous_state, s.interest_key FROM stopped s
    WHERE tool_job_tell_owner(CASE WHEN s.cancel_pending THEN s.owner_id END, s.id);
END
$$;

-- A call of an interest that goes back to the queue (a retry, a snooze, a release, an
-- approved park) carries its interest's end as it is now, not as it was at its enqueue:
-- the claim reads it on the row (claimable.sql). An interest not live: now (not started;
-- the sweep ends it).
CREATE OR REPLACE FUNCTION tool_job_interest_requeued() RETURNS trigger
SET search_path FROM CURRENT
LANGUAGE plpgsql AS $$
BEGIN
    NEW.interest_until := coalesce(
        (SELECT CASE WHEN i.state = 'live' THEN i.expires_at ELSE now() END
         FROM tool_interests i WHERE i.interest_key = NEW.interest_key), now());
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS tool_jobs_interest_requeued ON tool_jobs;
CREATE TRIGGER tool_jobs_interest_requeued
    BEFORE UPDATE OF state ON tool_jobs
    FOR EACH ROW
    WHEN (NEW.interest_key IS NOT NULL AND NEW.state = 'queued' AND OLD.state <> 'queued')
    EXECUTE FUNCTION tool_job_interest_requeued();

REVOKE EXECUTE ON FUNCTION tool_job_interest_hold(text, interval, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION tool_job_interest_lapse(text) FROM PUBLIC;
