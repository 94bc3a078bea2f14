-- The claims of a tool with a flow row (issues 27 and 28; queries.sql claim_job claims
-- the tools without one). Migration 016 explains the limits, the keys and the slots;
-- claimable.sql holds the row rules and the limits' answers the claim applies (issue 41).

-- The claim of a tool with a flow row: same arguments and row as claim_job, plus
-- blocked (NULL when a job was claimed: 'paused', 'max_running', 'max_running_per_key',
-- 'rate', 'rate_per_key', or 'more_keys': the claim visited its bound of keys without
-- finding a due one and the next claim goes on from there) and retry_in (seconds until
-- a rate lets this owner claim). Returns no row when nothing is claimable and no limit
-- held a job back.
--
-- A held rate hands out turns: the owner held gets the next free token time after those
-- already promised (rate_queue: [{o: owner, at}]) and keeps it when it claims again
-- early, so N sidecars waiting on one bucket wake one per token instead of all at each
-- token. A turn taken a little late moves no other turn: the bucket kept the time (up to
-- half a token, claimable.sql tool_flow_bucket_size); only time the full bucket could not
-- keep moves the turns after it as late. A turn not taken within 0.25 s and one token (at
-- most 1 s) of its time is dropped: its sidecar stopped or fell behind (it only loses its
-- place), and the others never wait long for a turn nobody takes.
-- Sessions (migration 026): a call of a session is taken only as claimable.sql
-- tool_job_session_free allows (one at a time, in order, not while another owner's
-- session lease holds it); the row carries the job's session_key.
CREATE OR REPLACE FUNCTION tool_job_claim_flow(
    p_tool text, p_owner text, p_lease float8, p_lifetime float8, p_max_attempts integer)
RETURNS SETOF tool_job_claim_row
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    -- keys one claim visits at most (each one or two index probes) before it hands the
    -- walk on to the next claim: a backlog of keys with no due job never makes one claim
    -- slow, nor holds the tool's row (and pause, limit) for long
    c_max_keys constant integer := 200;
    f tool_flow%ROWTYPE;
    v_clock timestamptz;
    v_tokens float8;
    v_lost float8;    -- seconds of refill the full bucket could not keep since its last claim
    v_queue jsonb;
    v_mine timestamptz;
    v_ahead integer;
    v_turn timestamptz;
    v_job uuid;
    v_job_key text;
    v_previous text;
    v_refunded boolean := false;
    v_key text;
    v_after text;
    v_start text;
    v_walking boolean;
    v_wrapped boolean;
    v_visited integer := 0;
    v_blocked text;
    v_held text;      -- why a key with a due job was passed over, if one was
    v_retry float8;
    v_candidate record;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'the claim of a tool with flow limits needs READ COMMITTED, not %',
                        current_setting('transaction_isolation') USING ERRCODE = '25000';
    END IF;
    SELECT * INTO f FROM tool_flow WHERE tool_flow.tool = p_tool FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Statements from here on see every claim committed before the lock was ours. The
    -- buckets use the time now, after any wait for the lock (still the database's clock).
    v_clock := clock_timestamp();
    IF f.paused_at IS NOT NULL THEN
        RETURN QUERY SELECT * FROM tool_flow_held(p_tool, 'paused', NULL::float8);
        RETURN;
    END IF;
    IF tool_flow_slots(f, NULL) < 1 THEN
        RETURN QUERY SELECT * FROM tool_flow_held(p_tool, 'max_running', NULL::float8);
        RETURN;
    END IF;
    IF f.rate_per_second IS NOT NULL THEN
        v_tokens := tool_flow_tokens(f, NULL, v_clock);
        v_lost := CASE WHEN f.tokens IS NULL THEN 0 ELSE extract(
                      epoch FROM v_clock - f.tokens_at) - (v_tokens - f.tokens)
                      / f.rate_per_second END;
        IF v_lost < 1e-6 THEN  -- below the clock's microsecond: rounding, not lost time
            v_lost := 0;
        END IF;
        -- the turns still awaited, oldest first
        SELECT coalesce(jsonb_agg(r ORDER BY (r->>'at')::timestamptz), '[]'::jsonb)
        INTO v_queue
        FROM jsonb_array_elements(coalesce(f.rate_queue, '[]'::jsonb)) r
        WHERE (r->>'at')::timestamptz > v_clock - interval '250 milliseconds'
                                        - least(1 / f.rate_per_second, 1) * interval '1 second';
        SELECT (r->>'at')::timestamptz INTO v_mine
        FROM jsonb_array_elements(v_queue) r WHERE r->>'o' = p_owner;
        -- tokens promised to owners whose turn came before ours (or has come, for us
        -- without a turn)
        SELECT count(*) INTO v_ahead
        FROM jsonb_array_elements(v_queue) r
        WHERE r->>'o' <> p_owner
          AND (r->>'at')::timestamptz <= least(v_clock, coalesce(v_mine, v_clock));
        IF v_tokens < 1 + v_ahead THEN
            IF v_mine IS NOT NULL THEN
                v_turn := greatest(v_mine, v_clock + ((1 + v_ahead - v_tokens)
                                                      / f.rate_per_second) * interval '1 second');
            ELSE
                v_turn := greatest(
                    v_clock + (greatest(0, 1 - v_tokens) / f.rate_per_second)
                              * interval '1 second',
                    (SELECT max((r->>'at')::timestamptz) FROM jsonb_array_elements(v_queue) r)
                        + (1 / f.rate_per_second) * interval '1 second');
            END IF;
            UPDATE tool_flow
            SET rate_queue = (SELECT coalesce(jsonb_agg(r), '[]'::jsonb)
                              FROM jsonb_array_elements(v_queue) r WHERE r->>'o' <> p_owner)
                             || jsonb_build_array(jsonb_build_object('o', p_owner, 'at', v_turn))
            WHERE tool_flow.tool = p_tool;
            RETURN QUERY SELECT * FROM tool_flow_held(
                p_tool, 'rate', extract(epoch FROM v_turn - v_clock)::float8);
            RETURN;
        END IF;
        IF v_mine IS NOT NULL OR jsonb_array_length(v_queue)
                <> jsonb_array_length(coalesce(f.rate_queue, '[]'::jsonb))
                OR (v_lost > 0 AND jsonb_array_length(v_queue) > 0) THEN
            -- Our turn is used (or we need none). The turns after it move as late as the
            -- time the full bucket lost: none when we came late by less than its half
            -- token's worth, and the schedule keeps the rate.
            UPDATE tool_flow
            SET rate_queue = (
                SELECT coalesce(jsonb_agg(jsonb_build_object(
                           'o', r->>'o',
                           'at', (r->>'at')::timestamptz + v_lost * interval '1 second')),
                       '[]'::jsonb)
                FROM jsonb_array_elements(v_queue) r WHERE r->>'o' <> p_owner)
            WHERE tool_flow.tool = p_tool;
        END IF;
    END IF;

    -- Expired leases first (their jobs were started), each subject to its key's limits.
    FOR v_candidate IN
        SELECT j.id, j.concurrency_key, tool_job_expiry_refunded(j) AS refunded
        FROM tool_jobs j
        WHERE j.tool = p_tool AND tool_job_lease_retakeable(j, p_max_attempts)
          AND tool_job_session_free(j, p_owner)
        ORDER BY j.priority, j.run_after, j.created_at, j.id
        LIMIT 32
        FOR UPDATE OF j SKIP LOCKED
    LOOP
        v_blocked := tool_flow_key_blocked(f, v_candidate.concurrency_key, v_clock);
        v_held := coalesce(v_blocked, v_held);
        IF v_blocked IS NULL THEN
            v_job := v_candidate.id;
            v_job_key := v_candidate.concurrency_key;
            v_previous := 'running';
            v_refunded := v_candidate.refunded;
            EXIT;
        END IF;
    END LOOP;

    -- Then queued jobs, keys in turn: the first key after the one served last that has a
    -- due job and room, wrapping around once. A walk cut short at c_max_keys goes on at
    -- the next claim from where it stopped, towards the same end (rr_walk*).
    -- When no job is due at all (keyed or not), one probe each says so: no key is walked.
    v_walking := f.rr_walk;
    IF v_job IS NULL AND (
            EXISTS (SELECT FROM tool_jobs j
                    WHERE j.tool = p_tool AND j.concurrency_key <> '' AND tool_job_queued_due(j))
            OR EXISTS (SELECT FROM tool_jobs j
                       WHERE j.tool = p_tool AND j.concurrency_key = ''
                         AND tool_job_queued_due(j))) THEN
        v_start := CASE WHEN v_walking THEN f.rr_walk_from ELSE f.rr_key END;
        v_wrapped := v_walking AND f.rr_walk_wrapped;
        v_after := f.rr_key;
        LOOP
            IF v_after IS NULL THEN
                SELECT j.concurrency_key INTO v_key FROM tool_jobs j
                WHERE j.tool = p_tool AND j.state = 'queued'
                ORDER BY j.concurrency_key LIMIT 1;
            ELSE
                SELECT j.concurrency_key INTO v_key FROM tool_jobs j
                WHERE j.tool = p_tool AND j.state = 'queued' AND j.concurrency_key > v_after
                ORDER BY j.concurrency_key LIMIT 1;
            END IF;
            IF NOT FOUND THEN
                EXIT WHEN v_wrapped OR v_start IS NULL;
                v_wrapped := true;
                v_after := NULL;
                CONTINUE;
            END IF;
            EXIT WHEN v_wrapped AND v_key > v_start;
            IF v_visited >= c_max_keys THEN
                UPDATE tool_flow
                SET rr_key = v_after, rr_walk = true, rr_walk_from = v_start,
                    rr_walk_wrapped = v_wrapped
                WHERE tool_flow.tool = p_tool;
                RETURN QUERY SELECT * FROM tool_flow_held(p_tool, 'more_keys', 0::float8);
                RETURN;
            END IF;
            v_visited := v_visited + 1;
            v_after := v_key;
            v_blocked := tool_flow_key_blocked(f, v_key, v_clock);
            IF v_blocked IS NOT NULL THEN
                v_held := v_blocked;
                IF v_blocked = 'rate_per_key' THEN
                    v_retry := least(v_retry, tool_flow_key_wait(f, v_key, v_clock));
                END IF;
                CONTINUE;
            END IF;
            SELECT j.id INTO v_job FROM tool_jobs j
            WHERE j.tool = p_tool AND j.concurrency_key = v_key AND tool_job_queued_due(j)
              AND tool_job_session_free(j, p_owner)
            ORDER BY j.priority, j.run_after, j.created_at, j.id
            LIMIT 1
            FOR UPDATE OF j SKIP LOCKED;
            IF v_job IS NOT NULL THEN
                v_job_key := v_key;
                v_previous := 'queued';
                EXIT;
            END IF;
        END LOOP;
    END IF;

    IF v_job IS NULL THEN
        IF v_walking THEN  -- the walk went round (or nothing is due): start afresh next
            UPDATE tool_flow SET rr_walk = false WHERE tool_flow.tool = p_tool;
        END IF;
        -- the reason of a key held back, when one was (a key with no due job is not)
        IF v_held IS NOT NULL THEN
            RETURN QUERY SELECT * FROM tool_flow_held(p_tool, v_held, v_retry);
        END IF;
        RETURN;
    END IF;

    UPDATE tool_flow
    SET tokens = CASE WHEN rate_per_second IS NOT NULL THEN v_tokens - 1 END,
        tokens_at = CASE WHEN rate_per_second IS NOT NULL THEN v_clock END,
        rr_key = CASE WHEN v_previous = 'queued' THEN v_job_key ELSE rr_key END,
        rr_walk = false
    WHERE tool_flow.tool = p_tool;
    IF f.key_rate_per_second IS NOT NULL AND v_job_key <> '' THEN
        -- the key's bucket as tool_flow_tokens refills it (the tool's row lock keeps any
        -- other claim of the tool from changing it meanwhile), less the token taken
        INSERT INTO tool_flow_keys AS k (tool, concurrency_key, tokens, tokens_at)
        VALUES (p_tool, v_job_key, tool_flow_tokens(f, v_job_key, v_clock) - 1, v_clock)
        ON CONFLICT (tool, concurrency_key) DO UPDATE
        SET tokens = excluded.tokens, tokens_at = excluded.tokens_at;
    END IF;

    RETURN QUERY
    WITH claimed AS (
        UPDATE tool_jobs j
        SET state = 'running',
            owner_id = p_owner,
            lease_until = now() + p_lease * interval '1 second',
            heartbeat_at = now(),
            claimed_at = now(),
            fencing_token = j.fencing_token + 1,
            attempt = j.attempt + 1 - v_refunded::int,
            unstarted_expiries = j.unstarted_expiries + v_refunded::int,
            first_claimed_at = coalesce(j.first_claimed_at, now()),
            max_attempts = coalesce(j.max_attempts, p_max_attempts)
        WHERE j.id = v_job
        RETURNING j.id, j.tool, j.payload::text AS payload_text, j.fencing_token, j.attempt,
                  j.max_attempts, j.lease_until, j.idempotency_key, j.checkpoint::text AS
                  checkpoint_text, j.stage, j.traceparent, j.tracestate,
                  j.first_claimed_at, j.concurrency_key, j.session_key, j.approval
    ), journal AS (
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT c.id, c.fencing_token, 'job_claimed',
               jsonb_build_object('owner_id', p_owner, 'attempt', c.attempt,
                                  'lease_until', c.lease_until,
                                  'reclaimed', v_previous = 'running')
               || CASE WHEN c.concurrency_key <> '' THEN
                      jsonb_build_object('concurrency_key', c.concurrency_key)
                  ELSE '{}'::jsonb END
               || CASE WHEN c.session_key IS NOT NULL THEN
                      jsonb_build_object('session_key', c.session_key)
                  ELSE '{}'::jsonb END
               || CASE WHEN v_refunded THEN jsonb_build_object(
                      'attempt_refunded', 'the expired attempt''s tool never started (F16)')
                  ELSE '{}'::jsonb END
        FROM claimed c
    )
    SELECT c.id, c.tool, c.payload_text, c.fencing_token, c.attempt, c.max_attempts,
           c.lease_until, c.idempotency_key, v_previous, v_refunded,
           extract(epoch FROM c.lease_until - now())::float8,
           c.checkpoint_text, c.stage, c.traceparent, c.tracestate,
           extract(epoch FROM c.first_claimed_at + p_lifetime * interval '1 second'
                   - now())::float8,
           NULL::text, NULL::float8, c.session_key, c.approval::text
    FROM claimed c;
END
$$;

-- Up to p_limit claims of a tool with a flow row: one row per job claimed, then, when a
-- limit held the tool back before p_limit jobs were claimed, one more row with blocked
-- and retry_in set (tool_job_claim_flow's held row: the rate turn it promised this owner
-- is kept for it). No row: nothing claimable, nothing held. p_limit below 1 counts as 1.
-- Its row type, tool_job_claim_row, is schema (migration 017).
CREATE OR REPLACE FUNCTION tool_job_claim_flow_many(
    p_tool text, p_owner text, p_lease float8, p_lifetime float8, p_max_attempts integer,
    p_limit integer)
RETURNS SETOF tool_job_claim_row
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v tool_job_claim_row;
BEGIN
    FOR i IN 1..greatest(coalesce(p_limit, 1), 1) LOOP
        SELECT * INTO v
        FROM tool_job_claim_flow(p_tool, p_owner, p_lease, p_lifetime, p_max_attempts);
        EXIT WHEN NOT FOUND;
        RETURN NEXT v;
        EXIT WHEN v.blocked IS NOT NULL;
    END LOOP;
    RETURN;
END
$$;
