-- Flow control across the fleet (issue 27): limits kept as data, so every sidecar of a tool
-- obeys the same values from its next claim on, and enforced inside the claim.
--
-- A tool's flow row (tool_flow) holds its limits, its pause and the round-robin cursor of
-- its concurrency keys. A tool with no flow row claims as before (queries.sql claim_job,
-- one statement, no lock beyond the job's row). A tool with one claims through
-- tool_job_claim_flow, which first locks that row: claims of the same tool take turns (a
-- few index probes each), claims of different tools never wait for each other. With the
-- row locked, each statement of the function reads a fresh snapshot (READ COMMITTED), so
-- it counts every claim committed before it: caps hold exactly under any number of
-- concurrent claims from any number of sidecars.
--
-- Concurrency keys: a job may carry one (tenant, account, customer); '' is "no key". Keys
-- take turns within a tool (round-robin over the keys with queued jobs, starting after
-- the key served last; priority and age within a key), per-key caps and per-key rates
-- apply to each key, never to jobs without one. A job with a key makes a flow row for its
-- tool (trigger below), so its tool claims fairly even without limits.
--
-- Slots: a job occupies one while it is running under a live lease (lease_until >= now()),
-- and after a cancel until its owner confirms the tree dead; an expired lease frees it.
-- Rates: token buckets on the database's clock, refilled at the rate up to the burst
-- (default 1), one token per claim; a job that cannot start for a limit stays queued
-- with no attempt spent.
-- No compatible-from: an older release claims without the limits.

ALTER TABLE tool_jobs ADD COLUMN concurrency_key text NOT NULL DEFAULT '';
ALTER TABLE tool_jobs ADD CONSTRAINT tool_jobs_concurrency_key_check
    CHECK (length(concurrency_key) <= 256) NOT VALID;
-- A job cancelled while it ran keeps its slot until its owner acknowledges that the tree
-- is dead (acknowledge_cancel_if_owner) or the lease it held ends: the tool is still
-- running until then (case F14's window). Set by cancel_job, cleared by the
-- acknowledgement, a retry, or the pruner once the lease is over.
ALTER TABLE tool_jobs ADD COLUMN cancel_pending boolean NOT NULL DEFAULT false;

-- The claim order, now per key: the fast claim reads (tool, '', priority, run_after,
-- created_at, id) in order as before; the fair claim steps from key to key on the same
-- index (each step one probe, never a sort of the backlog).
DROP INDEX tool_jobs_queued_order_idx;
CREATE INDEX tool_jobs_queued_order_idx
    ON tool_jobs (tool, concurrency_key, priority, run_after, created_at, id)
    WHERE state = 'queued';
-- Per-key occupancy: running jobs of a key. Neither column changes on a heartbeat, so
-- renewals stay HOT.
CREATE INDEX tool_jobs_running_key_idx ON tool_jobs (tool, concurrency_key)
    WHERE state = 'running' AND concurrency_key <> '';
CREATE INDEX tool_jobs_cancel_pending_idx ON tool_jobs (tool, concurrency_key)
    WHERE cancel_pending;
-- Whether a keyed tool has any job due at all, in one probe: before a claim walks its
-- keys (thousands of keys waiting out a retry's backoff cost nothing then). Only jobs
-- with a key are in it.
CREATE INDEX tool_jobs_queued_keyed_due_idx ON tool_jobs (tool, run_after)
    WHERE state = 'queued' AND concurrency_key <> '';

CREATE TABLE tool_flow (
    tool                text PRIMARY KEY,
    max_running         integer CHECK (max_running >= 1),
    max_running_per_key integer CHECK (max_running_per_key >= 1),
    -- rates as given ("10/s", "600/m") and as tokens per second
    rate                text,
    rate_per_second     float8 CHECK (rate_per_second > 0),
    rate_per_key        text,
    key_rate_per_second float8 CHECK (key_rate_per_second > 0),
    burst               integer NOT NULL DEFAULT 1 CHECK (burst >= 1),
    tokens              float8,       -- the tool's bucket after its last claim
    tokens_at           timestamptz,
    paused_at           timestamptz,
    pause_reason        text,
    paused_by           text,
    rr_key              text,         -- the key served last (round-robin cursor)
    rr_walk             boolean NOT NULL DEFAULT false,  -- a walk of keys goes on
    rr_walk_from        text,         -- ... the key it started after
    rr_walk_wrapped     boolean NOT NULL DEFAULT false,  -- ... and whether it wrapped
    rate_queue          jsonb,        -- turns promised to held owners: [{o, at}]
    updated_at          timestamptz NOT NULL DEFAULT now(),
    updated_by          text,
    CHECK ((rate IS NULL) = (rate_per_second IS NULL)),
    CHECK ((rate_per_key IS NULL) = (key_rate_per_second IS NULL))
);

-- Per-key token buckets (only with a per-key rate). A missing row is a full bucket, so
-- rows of keys idle past a refill are deleted by retention at no risk.
CREATE TABLE tool_flow_keys (
    tool            text NOT NULL,
    concurrency_key text NOT NULL,
    tokens          float8 NOT NULL,
    tokens_at       timestamptz NOT NULL,
    PRIMARY KEY (tool, concurrency_key)
);

-- The journal of flow changes (limit, clear, pause, resume), by whom.
CREATE TABLE tool_flow_events (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tool    text NOT NULL,
    event   text NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    details jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX tool_flow_events_tool_idx ON tool_flow_events (tool, id);

-- A job with a key gives its tool a flow row, whatever inserted it (an enqueue, a next
-- stage, a caller's own INSERT): the fast claim reads only jobs without a key.
CREATE FUNCTION tool_job_keyed_flow() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO tool_flow (tool, updated_by) VALUES (NEW.tool, 'a job with a concurrency key')
    ON CONFLICT (tool) DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER tool_jobs_keyed_flow
    AFTER INSERT OR UPDATE OF concurrency_key ON tool_jobs
    FOR EACH ROW WHEN (NEW.concurrency_key <> '')
    EXECUTE FUNCTION tool_job_keyed_flow();

-- A freed slot wakes one idle sidecar of a capped tool at commit, as an enqueue does: a
-- job that stops running, or a cancelled one whose tree its owner confirmed dead.
CREATE FUNCTION tool_job_slot_freed() RETURNS trigger
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
CREATE TRIGGER tool_jobs_slot_freed
    AFTER UPDATE OF state, cancel_pending ON tool_jobs
    FOR EACH ROW WHEN ((OLD.state = 'running' AND NEW.state <> 'running'
                        AND NOT NEW.cancel_pending)
                       OR (OLD.cancel_pending AND NOT NEW.cancel_pending))
    EXECUTE FUNCTION tool_job_slot_freed();

-- Slots taken in tool p_tool (of key p_key; NULL: every key): jobs running under a live
-- lease, and jobs cancelled while they ran whose owner has not yet confirmed the tree
-- dead and whose lease has not ended.
CREATE FUNCTION tool_flow_occupied(p_tool text, p_key text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT (SELECT count(*) FROM tool_jobs j
            WHERE j.tool = p_tool AND j.state = 'running' AND j.lease_until >= now()
              AND (p_key IS NULL OR j.concurrency_key = p_key))
         + (SELECT count(*) FROM tool_jobs j
            WHERE j.tool = p_tool AND j.cancel_pending AND j.lease_until > now()
              AND (p_key IS NULL OR j.concurrency_key = p_key))
$$;

-- The row tool_job_claim_flow returns when a limit held the tool's jobs back: no job,
-- only the reason and, for a rate, the seconds until this owner's turn.
CREATE FUNCTION tool_flow_held(p_tool text, p_reason text, p_retry_in float8)
RETURNS TABLE (id uuid, tool text, payload_text text, fencing_token bigint, attempt integer,
               max_attempts integer, lease_until timestamptz, idempotency_key text,
               previous_state text, refunded boolean, lease_remaining float8,
               checkpoint_text text, stage integer, traceparent text, tracestate text,
               lifetime_remaining float8, blocked text, retry_in float8)
LANGUAGE sql IMMUTABLE AS $$
    SELECT NULL::uuid, p_tool, NULL::text, NULL::bigint, NULL::integer, NULL::integer,
           NULL::timestamptz, NULL::text, NULL::text, NULL::boolean, NULL::float8,
           NULL::text, NULL::integer, NULL::text, NULL::text, NULL::float8, p_reason,
           p_retry_in
$$;

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
-- token. A turn not taken within 0.25 s and one token (at most 1 s) of its time is
-- dropped: its sidecar stopped or fell behind (it only loses its place), and the others
-- never wait long for a turn nobody takes.
CREATE FUNCTION tool_job_claim_flow(
    p_tool text, p_owner text, p_lease float8, p_lifetime float8, p_max_attempts integer)
RETURNS TABLE (id uuid, tool text, payload_text text, fencing_token bigint, attempt integer,
               max_attempts integer, lease_until timestamptz, idempotency_key text,
               previous_state text, refunded boolean, lease_remaining float8,
               checkpoint_text text, stage integer, traceparent text, tracestate text,
               lifetime_remaining float8, blocked text, retry_in float8)
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
    IF f.max_running IS NOT NULL AND tool_flow_occupied(p_tool, NULL) >= f.max_running THEN
        RETURN QUERY SELECT * FROM tool_flow_held(p_tool, 'max_running', NULL::float8);
        RETURN;
    END IF;
    IF f.rate_per_second IS NOT NULL THEN
        v_tokens := least(f.burst, coalesce(f.tokens, f.burst) + f.rate_per_second
                          * greatest(0, extract(epoch FROM
                                                v_clock - coalesce(f.tokens_at, v_clock))));
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
                <> jsonb_array_length(coalesce(f.rate_queue, '[]'::jsonb)) THEN
            -- Our turn is used (or we need none). Taken late, it moves the later turns
            -- as late: a full bucket kept no token for the time we lost.
            UPDATE tool_flow
            SET rate_queue = (
                SELECT coalesce(jsonb_agg(jsonb_build_object(
                           'o', r->>'o',
                           'at', (r->>'at')::timestamptz
                                 + greatest(interval '0', v_clock - coalesce(v_mine, v_clock)))),
                       '[]'::jsonb)
                FROM jsonb_array_elements(v_queue) r WHERE r->>'o' <> p_owner)
            WHERE tool_flow.tool = p_tool;
        END IF;
    END IF;

    -- Expired leases first (their jobs were started), each subject to its key's limits.
    FOR v_candidate IN
        SELECT j.id, j.concurrency_key, tool_job_expiry_refunded(j) AS refunded
        FROM tool_jobs j
        WHERE j.tool = p_tool AND j.state = 'running' AND j.lease_until < now()
          AND (j.attempt < coalesce(j.max_attempts, p_max_attempts)
               OR tool_job_expiry_refunded(j))
          AND (j.expires_at IS NULL OR j.expires_at > now())
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
                    WHERE j.tool = p_tool AND j.state = 'queued' AND j.concurrency_key <> ''
                      AND j.run_after <= now())
            OR EXISTS (SELECT FROM tool_jobs j
                       WHERE j.tool = p_tool AND j.state = 'queued'
                         AND j.concurrency_key = '' AND j.run_after <= now())) THEN
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
            WHERE j.tool = p_tool AND j.state = 'queued' AND j.concurrency_key = v_key
              AND j.run_after <= now() AND (j.expires_at IS NULL OR j.expires_at > now())
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
        INSERT INTO tool_flow_keys AS k (tool, concurrency_key, tokens, tokens_at)
        VALUES (p_tool, v_job_key, f.burst - 1, v_clock)
        ON CONFLICT (tool, concurrency_key) DO UPDATE
        SET tokens = least(f.burst, k.tokens + f.key_rate_per_second
                           * greatest(0, extract(epoch FROM v_clock - k.tokens_at))) - 1,
            tokens_at = v_clock;
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
                  j.first_claimed_at, j.concurrency_key
    ), journal AS (
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT c.id, c.fencing_token, 'job_claimed',
               jsonb_build_object('owner_id', p_owner, 'attempt', c.attempt,
                                  'lease_until', c.lease_until,
                                  'reclaimed', v_previous = 'running')
               || CASE WHEN c.concurrency_key <> '' THEN
                      jsonb_build_object('concurrency_key', c.concurrency_key)
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
           NULL::text, NULL::float8
    FROM claimed c;
END
$$;

-- Whether a set_tool_limits call ($3: the fields it sets) changes the bucket of the row
-- `old` into `new`: a rate or burst given with another value than it had.
CREATE FUNCTION tool_flow_bucket_changed(old tool_flow, new tool_flow, changes jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT (changes ? 'rate' AND new.rate_per_second IS DISTINCT FROM old.rate_per_second)
        OR (changes ? 'burst' AND new.burst IS DISTINCT FROM old.burst)
$$;

-- Whether key p_key may start a job now under the flow row f: NULL when it may, else
-- 'max_running_per_key' or 'rate_per_key'. Jobs without a key ('') are never held back.
CREATE FUNCTION tool_flow_key_blocked(f tool_flow, p_key text, p_clock timestamptz)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_key = '' THEN
        RETURN NULL;
    END IF;
    IF f.max_running_per_key IS NOT NULL
            AND tool_flow_occupied(f.tool, p_key) >= f.max_running_per_key THEN
        RETURN 'max_running_per_key';
    END IF;
    IF f.key_rate_per_second IS NOT NULL AND tool_flow_key_wait(f, p_key, p_clock) > 0 THEN
        RETURN 'rate_per_key';
    END IF;
    RETURN NULL;
END
$$;

-- Seconds until key p_key's bucket holds a token (0: it holds one now).
CREATE FUNCTION tool_flow_key_wait(f tool_flow, p_key text, p_clock timestamptz)
RETURNS float8
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT greatest(0, 1 - least(f.burst, k.tokens + f.key_rate_per_second
                    * greatest(0, extract(epoch FROM p_clock - k.tokens_at))))
                / f.key_rate_per_second
         FROM tool_flow_keys k
         WHERE k.tool = f.tool AND k.concurrency_key = p_key), 0)
$$;

-- Enqueue with a concurrency key: tool_job_enqueue and sidecar_enqueue of migration 014,
-- restated with one more argument (last, so every call written for 014 by name or
-- position means the same). A key is 1-256 printable characters; NULL is no key. The
-- same idempotency key with another concurrency key is a different operation (23505).
DROP FUNCTION sidecar_enqueue(text, jsonb, text, integer, timestamptz, interval, jsonb,
                              integer, text, text);
DROP FUNCTION tool_job_enqueue(text, jsonb, text, integer, timestamptz, interval, interval,
                               jsonb, integer, text, text, bigint, jsonb);

CREATE FUNCTION tool_job_enqueue(
    p_tool text, p_payload jsonb, p_idempotency_key text, p_priority integer,
    p_run_after timestamptz, p_run_in interval, p_expires_in interval, p_tags jsonb,
    p_max_attempts integer, p_traceparent text, p_tracestate text,
    p_max_payload_bytes bigint, p_details jsonb, p_concurrency_key text)
RETURNS TABLE (enqueued_id uuid, created boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id uuid := gen_random_uuid();
    v_key text := coalesce(p_idempotency_key, v_id::text);
    v_priority integer := coalesce(p_priority, 0);
    v_tags jsonb := coalesce(p_tags, '{}'::jsonb);
    v_due timestamptz;
    v_expiry timestamptz;
    v_payload_text text;
    v_existing record;
    v_tag record;
    v_member text;
    v_name text;
    v_names text[] := '{}';
    v_horizon constant interval := interval '366 days';
BEGIN
    IF p_tool IS NULL OR p_tool !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
        RAISE EXCEPTION 'tool %: use 1-63 letters, digits, ''.'', ''_'' or ''-'', starting '
                        'with a letter or digit', coalesce(quote_literal(p_tool), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'payload is NULL: pass a JSON value, e.g. ''{}''::jsonb'
            USING ERRCODE = '22023';
    END IF;
    v_payload_text := p_payload::text;
    IF coalesce(p_max_payload_bytes, 0) > 0
            AND octet_length(v_payload_text) > p_max_payload_bytes THEN
        RAISE EXCEPTION 'payload: % bytes as stored, more than the limit of % bytes '
                        '(sidecar.max_payload_bytes); pass a reference (a URL or an object '
                        'key) instead', octet_length(v_payload_text), p_max_payload_bytes
            USING ERRCODE = '22023';
    END IF;
    IF p_idempotency_key IS NOT NULL AND (
            length(p_idempotency_key) NOT BETWEEN 1 AND 512
            OR btrim(p_idempotency_key) = ''
            OR p_idempotency_key ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'idempotency_key must be 1-512 printable characters, '
                        'e.g. invoice-42:capture' USING ERRCODE = '22023';
    END IF;
    IF p_idempotency_key ~ ':stage:[0-9]+$' THEN
        RAISE EXCEPTION 'idempotency_key %: a key ending in '':stage:N'' is reserved for the '
                        'next stages a job creates (P19); use another key',
                        quote_literal(p_idempotency_key) USING ERRCODE = '22023';
    END IF;
    IF p_concurrency_key IS NOT NULL AND (
            length(p_concurrency_key) NOT BETWEEN 1 AND 256
            OR btrim(p_concurrency_key) = ''
            OR p_concurrency_key ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'concurrency_key must be 1-256 printable characters, e.g. '
                        'tenant-42 (NULL: no key)' USING ERRCODE = '22023';
    END IF;
    IF v_priority NOT BETWEEN 0 AND 9 THEN
        RAISE EXCEPTION 'priority %: must be from 0 (claimed first) to 9', v_priority
            USING ERRCODE = '22023';
    END IF;
    IF p_max_attempts IS NOT NULL AND p_max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts %: must be from 1 to 1000 (NULL: the profile''s '
                        'MAX_ATTEMPTS)', p_max_attempts USING ERRCODE = '22023';
    END IF;
    IF p_run_after IS NOT NULL AND p_run_in IS NOT NULL THEN
        RAISE EXCEPTION 'run_after: give a time or an interval from now, not both'
            USING ERRCODE = '22023';
    END IF;
    IF p_run_in < interval '0' OR p_run_in > v_horizon THEN
        RAISE EXCEPTION 'run_after %: must be from 0 to 366 days from now', p_run_in
            USING ERRCODE = '22023';
    END IF;
    IF p_run_after > now() + v_horizon THEN
        RAISE EXCEPTION 'run_after %: at most 366 days from now', p_run_after
            USING ERRCODE = '22023';
    END IF;
    -- a time already past runs now, in its place by the time it is queued
    v_due := greatest(coalesce(p_run_after, now() + p_run_in, now()), now());
    IF p_expires_in IS NOT NULL THEN
        IF p_expires_in <= interval '0' OR p_expires_in > v_horizon THEN
            RAISE EXCEPTION 'expires_in %: must be more than 0 and at most 366 days',
                            p_expires_in USING ERRCODE = '22023';
        END IF;
        v_expiry := now() + p_expires_in;
        IF v_due >= v_expiry THEN
            RAISE EXCEPTION 'expires_in %: the job would expire before its run_after (%)',
                            p_expires_in, v_due USING ERRCODE = '22023';
        END IF;
    END IF;
    IF jsonb_typeof(v_tags) <> 'object' THEN
        RAISE EXCEPTION 'tags: a JSON object of strings, e.g. ''{"run": "42"}''::jsonb'
            USING ERRCODE = '22023';
    END IF;
    IF (SELECT count(*) FROM jsonb_object_keys(v_tags)) > 16 THEN
        RAISE EXCEPTION 'tags: at most 16 per job' USING ERRCODE = '22023';
    END IF;
    FOR v_tag IN SELECT t.key, t.value FROM jsonb_each(v_tags) t LOOP
        IF v_tag.key !~ '^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,62}$' THEN
            RAISE EXCEPTION 'tags: key %: use 1-63 letters, digits, ''_'', ''.'', '':'', '
                            '''/'' or ''-'', starting with a letter or digit',
                            quote_literal(v_tag.key) USING ERRCODE = '22023';
        END IF;
        IF jsonb_typeof(v_tag.value) <> 'string'
                OR length(v_tag.value #>> '{}') NOT BETWEEN 1 AND 256
                OR (v_tag.value #>> '{}') ~ '[\x01-\x1f\x7f-\x9f]' THEN
            RAISE EXCEPTION 'tags: the value of % must be a string of 1-256 printable '
                            'characters', quote_literal(v_tag.key) USING ERRCODE = '22023';
        END IF;
    END LOOP;
    IF p_traceparent IS NOT NULL AND (
            p_traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            OR left(p_traceparent, 2) = 'ff'
            OR substr(p_traceparent, 4, 32) = repeat('0', 32)
            OR substr(p_traceparent, 37, 16) = repeat('0', 16)) THEN
        RAISE EXCEPTION 'traceparent %: not a W3C traceparent (version-traceid-parentid-'
                        'flags in lower-case hex, e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-'
                        '00f067aa0ba902b7-01)', quote_literal(left(p_traceparent, 80))
            USING ERRCODE = '22023';
    END IF;
    IF p_tracestate IS NOT NULL THEN
        IF p_traceparent IS NULL THEN
            RAISE EXCEPTION 'tracestate: given without a traceparent' USING ERRCODE = '22023';
        END IF;
        IF length(p_tracestate) > 512 THEN
            RAISE EXCEPTION 'tracestate: at most 512 characters' USING ERRCODE = '22023';
        END IF;
        FOREACH v_member IN ARRAY string_to_array(p_tracestate, ',') LOOP
            v_member := btrim(v_member, E' \t');
            CONTINUE WHEN v_member = '';
            v_name := split_part(v_member, '=', 1);
            IF v_member !~ '^([a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13}|[a-z][a-z0-9_*/-]{0,255})=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$'
                    OR v_name = ANY (v_names) THEN
                RAISE EXCEPTION 'tracestate: member % is not a W3C list member (key=value, '
                                'each key once)', quote_literal(left(v_member, 80))
                    USING ERRCODE = '22023';
            END IF;
            v_names := v_names || v_name;
        END LOOP;
        IF cardinality(v_names) > 32 THEN
            RAISE EXCEPTION 'tracestate: at most 32 list members' USING ERRCODE = '22023';
        END IF;
    END IF;

    -- The insert is skipped when the key exists; a skipped insert is never taken as done:
    -- the holder of the key is read and compared, and when it vanished in between (a
    -- pruned job) the insert is tried again.
    FOR v_try IN 1..3 LOOP
        INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, priority,
                               run_after, expires_at, tags, traceparent, tracestate,
                               concurrency_key)
        VALUES (v_id, p_tool, v_key, p_payload, p_max_attempts, v_priority, v_due, v_expiry,
                v_tags, p_traceparent, p_tracestate, coalesce(p_concurrency_key, ''))
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF FOUND THEN
            -- P23: the payload's sha256 and size as the tool will receive it
            INSERT INTO tool_job_events (job_id, fencing_token, event, details)
            VALUES (v_id, 0, 'job_enqueued', coalesce(p_details, '{}'::jsonb)
                    || jsonb_build_object('payload', jsonb_build_object(
                           'sha256', encode(sha256(convert_to(v_payload_text, 'UTF8')), 'hex'),
                           'bytes', octet_length(v_payload_text)))
                    || jsonb_strip_nulls(jsonb_build_object(
                           'priority', v_priority, 'max_attempts', p_max_attempts,
                           'run_after', CASE WHEN v_due > now() THEN v_due END,
                           'expires_at', v_expiry,
                           'tags', CASE WHEN v_tags <> '{}'::jsonb THEN v_tags END,
                           'traceparent', p_traceparent, 'tracestate', p_tracestate,
                           'concurrency_key', p_concurrency_key)));
            IF v_due <= now() THEN
                PERFORM tool_job_wake(p_tool, 1);
            END IF;
            RETURN QUERY SELECT v_id, true;
            RETURN;
        END IF;
        SELECT j.id, j.tool, j.payload = p_payload AS same_payload, j.concurrency_key
        INTO v_existing
        FROM tool_jobs j WHERE j.idempotency_key = v_key;
        IF FOUND THEN
            IF v_existing.tool <> p_tool OR NOT v_existing.same_payload
                    OR v_existing.concurrency_key <> coalesce(p_concurrency_key, '') THEN
                RAISE EXCEPTION 'idempotency_key % already names job % with a different tool, '
                                'payload or concurrency key; use a new key for a different '
                                'operation',
                                quote_literal(v_key), v_existing.id USING ERRCODE = '23505';
            END IF;
            RETURN QUERY SELECT v_existing.id, false;
            RETURN;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'idempotency_key %: the job holding it kept vanishing while it was read '
                    '(retention pruning it?); try again', quote_literal(v_key)
        USING ERRCODE = '40001';
END
$$;

-- Enqueue from any language, in the caller's own transaction: the job exists (and an idle
-- sidecar of the tool is woken) only if that transaction commits. Same validation and
-- defaults as `sidecar enqueue`; the payload limit is the setting sidecar.max_payload_bytes
-- (ALTER DATABASE ... SET, or SET LOCAL), 8 MiB when unset, as SIDECAR_MAX_PAYLOAD_BYTES.
-- Runs with the caller's rights (the worker role's grants suffice: sql/roles.sql).
CREATE FUNCTION sidecar_enqueue(
    tool text, payload jsonb, idempotency_key text DEFAULT NULL, priority integer DEFAULT 0,
    run_after timestamptz DEFAULT NULL, expires_in interval DEFAULT NULL,
    tags jsonb DEFAULT NULL, max_attempts integer DEFAULT NULL,
    traceparent text DEFAULT NULL, tracestate text DEFAULT NULL,
    concurrency_key text DEFAULT NULL)
RETURNS uuid
LANGUAGE sql VOLATILE AS $$
    SELECT e.enqueued_id FROM tool_job_enqueue(
        $1, $2, $3, $4, $5, NULL, $6, $7, $8, $9, $10,
        coalesce(nullif(current_setting('sidecar.max_payload_bytes', true), '')::bigint,
                 8388608),
        '{"by": "sidecar_enqueue"}'::jsonb, $11) e
$$;

-- The scaler's demand (KEDA) counts only what may run: a paused tool wants no more than
-- its jobs running now, a capped one no more than max_running. The rest of the backlog
-- would only start pods that wait. (Per-key caps are not counted: the keys' turns need
-- the claim's walk.) As migration 013 says, a CREATE OR REPLACE resets SECURITY DEFINER
-- and the search_path, said again below.
CREATE OR REPLACE FUNCTION tool_job_demand(wanted_tool text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    WITH wanted AS (
        SELECT count(*) FILTER (WHERE j.state = 'running' AND j.lease_until >= now())
                   AS running,
               count(*) AS claimable
        FROM tool_jobs j
        WHERE j.tool = wanted_tool
          AND ((j.state = 'queued' AND j.run_after <= now())
               OR (j.state = 'running' AND (j.lease_until >= now()
                                            OR j.attempt < j.max_attempts
                                            OR tool_job_expiry_refunded(j))))
    )
    SELECT CASE WHEN f.paused_at IS NOT NULL THEN w.running
                ELSE least(w.claimable, coalesce(f.max_running, w.claimable)) END
    FROM wanted w LEFT JOIN tool_flow f ON f.tool = wanted_tool
$$;

-- The functions find the queue's tables in their own schema whatever the search_path of
-- the session that ends a job or claims one (pg_temp last).
DO $$
DECLARE
    home text := current_schema();
BEGIN
    EXECUTE format('ALTER FUNCTION %I.tool_job_demand(text) SECURITY DEFINER '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_job_keyed_flow() SET search_path = %I, pg_temp',
                   home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_job_slot_freed() SET search_path = %I, pg_temp',
                   home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_flow_bucket_changed(tool_flow, tool_flow, jsonb) '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_flow_held(text, text, float8) '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_flow_occupied(text, text) '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_job_claim_flow(text, text, float8, float8, '
                   'integer) SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_flow_key_blocked(tool_flow, text, timestamptz) '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_flow_key_wait(tool_flow, text, timestamptz) '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.tool_job_enqueue(text, jsonb, text, integer, '
                   'timestamptz, interval, interval, jsonb, integer, text, text, bigint, '
                   'jsonb, text) SET search_path = %I, pg_temp', home, home);
    EXECUTE format('ALTER FUNCTION %I.sidecar_enqueue(text, jsonb, text, integer, '
                   'timestamptz, interval, jsonb, integer, text, text, text) '
                   'SET search_path = %I, pg_temp', home, home);
END
$$;
