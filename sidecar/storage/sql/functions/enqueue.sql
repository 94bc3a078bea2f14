-- Enqueue (issue 26): tool_job_enqueue, the one implementation behind `sidecar enqueue`,
-- sidecar.client and sidecar_enqueue, the function any language calls; and the job ids.

-- Time-ordered job ids (issue 28). A random uuid (v4) lands each new job's entries on a
-- random leaf page of tool_jobs_pkey, of the idempotency key's index (a job enqueued
-- without a key is keyed by its id) and of the journal's (job_id, id) index, so after
-- each checkpoint nearly every job's first write to each of those pages logs a full page
-- image: measured by bench section 13, the largest part of a job's WAL. A UUIDv7 layout
-- (RFC 9562: 48 bits of Unix milliseconds, then the version and 74 random bits) keeps
-- new entries on the rightmost pages, as a sequence would, and ids stay unguessable. The
-- ids reveal their enqueue time to the millisecond, as created_at does to who reads rows.
CREATE OR REPLACE FUNCTION tool_job_new_id() RETURNS uuid
SET search_path FROM CURRENT
LANGUAGE sql VOLATILE AS $$
    SELECT encode(set_byte(b, 6, (get_byte(b, 6) & 15) | 112), 'hex')::uuid
    FROM (SELECT overlay(uuid_send(gen_random_uuid())
                         PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp())
                                                          * 1000)::bigint) FROM 3)
                         FROM 1 FOR 6) AS b) AS fresh
$$;

-- The largest payload (bytes, as stored: jsonb text) any enqueue accepts, whatever its
-- caller passes (issue 41, point 2: a limit a caller chooses is no limit): the setting
-- sidecar.max_payload_bytes as the database's owner set it for the database (ALTER
-- DATABASE ... SET sidecar.max_payload_bytes = N), read from the catalog, not from the
-- session (a session's SET cannot raise it); 8 MiB when unset or not a positive number.
CREATE OR REPLACE FUNCTION tool_job_payload_ceiling() RETURNS bigint
SET search_path FROM CURRENT
LANGUAGE sql STABLE AS $$
    SELECT coalesce((
        SELECT nullif(substring(setting FROM '^sidecar\.max_payload_bytes=([0-9]{1,15})$')
                      ::bigint, 0)
        FROM pg_db_role_setting s, unnest(s.setconfig) setting
        WHERE s.setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND s.setrole = 0
          AND setting ~ '^sidecar\.max_payload_bytes=[0-9]{1,15}$'
        LIMIT 1), 8388608)
$$;

-- Enqueue one job, validated: the one implementation behind `sidecar enqueue` and
-- sidecar_enqueue. Returns the job's id and whether it was created now (false: the
-- idempotency key already names this job, same tool, payload and concurrency key). Bad
-- input raises SQLSTATE 22023 (invalid_parameter_value) with a message that names the
-- field; a key already naming another tool, payload or concurrency key raises 23505. The
-- limits are those of sidecar/enqueue_args.py (tests/test_caller_options.py checks both
-- agree). run_after (a time) or run_in (an interval from now()) schedules the job, by the
-- database's clock; expires_in bounds when an attempt may start (from now()).
-- max_payload_bytes: the largest payload as stored (jsonb text), NULL or 0 = the ceiling;
-- never above tool_job_payload_ceiling(), which only the database's owner raises.
-- concurrency_key (since migration 016): 1-256 printable characters, NULL is no key.
-- session_key (the last argument since migration 026): the agent session the call
-- belongs to (docs/callers.md "Sessions"), 1-256 printable characters, NULL is none.
-- p_dedupe (the last argument since migration 027): how long the job holds its key
-- (tool_job_dedupe_window: forever, active or a window such as 24h); NULL is the tool's
-- default (tool_dedupe, its sidecars' DEDUPE), forever when it has none. A key whose job
-- lets it go (tool_job_free_key) is freed and taken by the new job. p_interest_key (the
-- last argument since migration 029): the caller's interest the job belongs to, which
-- must be held now (tool_job_interest_hold); its lapse stops the job. The
-- id is time-ordered (tool_job_new_id). Inserted, journaled (job_enqueued) and, when due
-- now, one idle sidecar of the tool woken (tool_job_wake, a NOTIFY sent at commit): a
-- rolled-back transaction leaves none of it. p_details (the journal row's details): a
-- JSON object of at most 4096 bytes as stored, or NULL.
--
-- Least privilege (issue 41, point 2; docs/operations.md "Roles and Secrets"): this is a
-- caller's only way to create a job. The callers' role has no INSERT on tool_jobs or
-- tool_job_events and no write on tool_idle_sidecars or tool_flow, so no direct write
-- goes around the checks below (a job inserted claimed, a tool name or key out of bounds,
-- a forged journal row): the function writes with its owner's rights (SECURITY DEFINER,
-- the schema owner that ran the migrations) under a search_path pinned to its own schema
-- with pg_temp last, as tool_job_cancel and tool_job_demand do, and checks every input.
-- EXECUTE is taken from PUBLIC: the owner and the roles `sidecar migrate --worker-role`
-- and `--caller-role` name may call it (a role given rights by hand needs EXECUTE on it).
CREATE OR REPLACE FUNCTION tool_job_enqueue(
    p_tool text, p_payload jsonb, p_idempotency_key text, p_priority integer,
    p_run_after timestamptz, p_run_in interval, p_expires_in interval, p_tags jsonb,
    p_max_attempts integer, p_traceparent text, p_tracestate text,
    p_max_payload_bytes bigint, p_details jsonb, p_concurrency_key text,
    p_session_key text, p_dedupe text, p_interest_key text)
RETURNS TABLE (enqueued_id uuid, created boolean)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id uuid := tool_job_new_id();  -- time-ordered (migration 017)
    v_key text := coalesce(p_idempotency_key, v_id::text);
    v_priority integer := coalesce(p_priority, 0);
    v_tags jsonb := coalesce(p_tags, '{}'::jsonb);
    v_due timestamptz;
    v_expiry timestamptz;
    v_payload_text text;
    v_ceiling bigint;
    v_limit bigint;
    v_existing record;
    v_tag record;
    v_member text;
    v_name text;
    v_names text[] := '{}';
    v_horizon constant interval := interval '366 days';
    v_frees_after interval;
    v_held boolean;
    v_interest_until timestamptz;
BEGIN
    IF p_tool IS NULL OR p_tool !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$' THEN
        RAISE EXCEPTION 'tool %: use 1-63 letters, digits, ''.'', ''_'' or ''-'', starting '
                        'with a letter or digit', coalesce(quote_literal(p_tool), 'NULL')
            USING ERRCODE = '22023';
    END IF;
    IF p_details IS NOT NULL AND (jsonb_typeof(p_details) <> 'object'
                                  OR octet_length(p_details::text) > 4096) THEN
        RAISE EXCEPTION 'details: a JSON object of at most 4096 bytes, e.g. '
                        '''{"by": "my-app"}''::jsonb (NULL: none)' USING ERRCODE = '22023';
    END IF;
    IF p_payload IS NULL THEN
        RAISE EXCEPTION 'payload is NULL: pass a JSON value, e.g. ''{}''::jsonb'
            USING ERRCODE = '22023';
    END IF;
    v_ceiling := tool_job_payload_ceiling();
    v_limit := CASE WHEN coalesce(p_max_payload_bytes, 0) > 0
                    THEN least(p_max_payload_bytes, v_ceiling) ELSE v_ceiling END;
    v_payload_text := p_payload::text;
    IF octet_length(v_payload_text) > v_limit THEN
        RAISE EXCEPTION 'payload: % bytes as stored, more than the limit of % bytes '
                        '(sidecar.max_payload_bytes; the database''s own setting caps it); '
                        'pass a reference (a URL or an object key) instead',
                        octet_length(v_payload_text), v_limit
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
    IF p_session_key IS NOT NULL AND (
            length(p_session_key) NOT BETWEEN 1 AND 256
            OR btrim(p_session_key) = ''
            OR p_session_key ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'session must be 1-256 printable characters, e.g. agent-run-42 '
                        '(NULL: no session)' USING ERRCODE = '22023';
    END IF;
    IF p_interest_key IS NOT NULL THEN
        PERFORM tool_job_interest_check_key(p_interest_key);
        SELECT i.expires_at INTO v_interest_until FROM tool_interests i
        WHERE i.interest_key = p_interest_key AND i.state = 'live' AND i.expires_at > now();
        IF NOT FOUND THEN
            RAISE EXCEPTION 'interest %: not held now (never, or it lapsed); hold it first '
                            '(Client.interest, sidecar interest, tool_job_interest_hold)',
                            quote_literal(p_interest_key) USING ERRCODE = '22023';
        END IF;
    END IF;
    IF p_dedupe IS NULL THEN
        SELECT d.key_frees_after INTO v_frees_after FROM tool_dedupe d WHERE d.tool = p_tool;
    ELSE
        v_frees_after := tool_job_dedupe_window(p_dedupe);
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
    -- pruned job, or one whose dedupe policy freed its key: tool_job_free_key) the insert
    -- is tried again.
    FOR v_try IN 1..3 LOOP
        INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, priority,
                               run_after, expires_at, tags, traceparent, tracestate,
                               concurrency_key, session_key, key_frees_after, interest_key,
                               interest_until)
        VALUES (v_id, p_tool, v_key, p_payload, p_max_attempts, v_priority, v_due, v_expiry,
                v_tags, p_traceparent, p_tracestate, coalesce(p_concurrency_key, ''),
                p_session_key, v_frees_after, p_interest_key, v_interest_until)
        ON CONFLICT (idempotency_key) WHERE key_held DO NOTHING;
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
                           'concurrency_key', p_concurrency_key,
                           'session_key', p_session_key,
                           'key_frees_after_s', extract(epoch FROM v_frees_after),
                           'interest', p_interest_key)));
            IF v_due <= now() THEN
                PERFORM tool_job_wake(p_tool, 1);
            END IF;
            RETURN QUERY SELECT v_id, true;
            RETURN;
        END IF;
        SELECT j.id, j.tool, j.payload = p_payload AS same_payload, j.concurrency_key,
               j.session_key
        INTO v_existing
        FROM tool_jobs j WHERE j.idempotency_key = v_key AND j.key_held;
        v_held := FOUND;
        IF v_held AND tool_job_free_key(v_key) IS NOT NULL THEN
            CONTINUE;  -- its policy let the key go: this job takes it
        END IF;
        IF v_held AND NOT EXISTS (SELECT FROM tool_jobs j
                                  WHERE j.id = v_existing.id AND j.key_held) THEN
            CONTINUE;  -- a concurrent enqueue freed it first: read the new holder
        END IF;
        IF v_held THEN
            IF v_existing.tool <> p_tool OR NOT v_existing.same_payload
                    OR v_existing.concurrency_key <> coalesce(p_concurrency_key, '')
                    OR v_existing.session_key IS DISTINCT FROM p_session_key THEN
                RAISE EXCEPTION 'idempotency_key % already names job % with a different tool, '
                                'payload, concurrency key or session; use a new key for a '
                                'different operation',
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
-- (ALTER DATABASE ... SET, or SET LOCAL to lower it), 8 MiB when unset, as
-- SIDECAR_MAX_PAYLOAD_BYTES; a session's SET cannot raise it above the database's own
-- (tool_job_payload_ceiling).
-- Runs with the caller's rights; the writes are tool_job_enqueue's (SECURITY DEFINER), so
-- a role needs EXECUTE on both: `sidecar migrate --worker-role` and `--caller-role` grant
-- them (sql/roles.sql), and PUBLIC may call neither.
CREATE OR REPLACE FUNCTION sidecar_enqueue(
    tool text, payload jsonb, idempotency_key text DEFAULT NULL, priority integer DEFAULT 0,
    run_after timestamptz DEFAULT NULL, expires_in interval DEFAULT NULL,
    tags jsonb DEFAULT NULL, max_attempts integer DEFAULT NULL,
    traceparent text DEFAULT NULL, tracestate text DEFAULT NULL,
    concurrency_key text DEFAULT NULL, session_key text DEFAULT NULL,
    dedupe text DEFAULT NULL, interest text DEFAULT NULL)
RETURNS uuid
SET search_path FROM CURRENT
LANGUAGE sql VOLATILE AS $$
    SELECT e.enqueued_id FROM tool_job_enqueue(
        $1, $2, $3, $4, $5, NULL, $6, $7, $8, $9, $10,
        coalesce(nullif(current_setting('sidecar.max_payload_bytes', true), '')::bigint,
                 8388608),
        '{"by": "sidecar_enqueue"}'::jsonb, $11, $12, $13, $14) e
$$;

REVOKE EXECUTE ON FUNCTION tool_job_enqueue(text, jsonb, text, integer, timestamptz,
    interval, interval, jsonb, integer, text, text, bigint, jsonb, text, text, text, text)
    FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION sidecar_enqueue(text, jsonb, text, integer, timestamptz,
    interval, jsonb, integer, text, text, text, text, text, text) FROM PUBLIC;
