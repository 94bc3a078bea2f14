-- What "claimable now" means (issue 41, point 3), said once. Two halves:
--
-- The row rules: which job rows a claim may take now. Every claim applies them
-- (queries.sql claim_job, claim.sql tool_job_claim_flow), and every count that says
-- "claimable" counts with them (demand.sql tool_job_demand; queries.sql sample_tool, the
-- poll's depth and queue age; web_tools, the oldest due job's wait). They are SQL
-- functions of one expression with no SET clause and not SECURITY DEFINER, so the planner
-- puts the expression in place of the call (inlining): each statement still reads its
-- partial index as if the conditions were written out (tests/test_claim_plan.py). The
-- caller needs EXECUTE on them (the worker's grants name every tool_job_* function).
--
-- The limits of a tool's flow row (migration 016): how many jobs the tool, and each of its
-- concurrency keys, may start now (free slots under a cap, whole tokens in a bucket,
-- nothing while paused). The claim asks them job by job and says which one held a job
-- back; the demand asks them once per tool and key and counts what they admit.
-- tests/test_demand.py checks, case by case, that the demand is what claims take.

-- A queued job that may start now: due (run_after passed) and not past its expiry (issue
-- 26: no attempt starts after expires_at; fail_expired_jobs ends it within a poll period).
CREATE OR REPLACE FUNCTION tool_job_queued_due(j tool_jobs) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT j.state = 'queued' AND j.run_after <= now()
       AND (j.expires_at IS NULL OR j.expires_at > now())
       -- a call of an interest nobody renewed is not started (migration 029)
       AND (j.interest_until IS NULL OR j.interest_until > now())
$$;

-- Whether job j has an attempt left (P16): fewer attempts than its max_attempts (or, for a
-- job enqueued without one, p_max_attempts: the claiming profile's), or its last expired
-- attempt is given back because its tool never started (case F16). NULL, as false, for a
-- job without max_attempts when p_max_attempts is NULL too. queries.sql
-- fail_exhausted_leases ends the expired leases that have none.
CREATE OR REPLACE FUNCTION tool_job_attempt_left(j tool_jobs, p_max_attempts integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT j.attempt < coalesce(j.max_attempts, p_max_attempts) OR tool_job_expiry_refunded(j)
$$;

-- A running job whose lease expired that a claim may take over (P1, P4): an attempt left,
-- and not past its expiry.
CREATE OR REPLACE FUNCTION tool_job_lease_retakeable(j tool_jobs, p_max_attempts integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT j.state = 'running' AND j.lease_until < now()
       AND tool_job_attempt_left(j, p_max_attempts)
       AND (j.expires_at IS NULL OR j.expires_at > now())
$$;

-- Either: a job a claim may take now by the row rules (before any flow limit).
CREATE OR REPLACE FUNCTION tool_job_claimable(j tool_jobs, p_max_attempts integer)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT tool_job_queued_due(j) OR tool_job_lease_retakeable(j, p_max_attempts)
$$;

-- Free slots under tool f's max_running (p_key NULL) or under its max_running_per_key for
-- key p_key: the cap less the slots taken (tool_flow_occupied; may be negative after a cap
-- was lowered). NULL when there is no such cap; always NULL for jobs without a key ('').
-- The limits' functions are plpgsql: their plans are kept for the session, where a SQL
-- function called from another one would be planned again at every call (the demand asks
-- once per key).
CREATE OR REPLACE FUNCTION tool_flow_slots(f tool_flow, p_key text) RETURNS bigint
SET search_path FROM CURRENT
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_key IS NULL AND f.max_running IS NOT NULL THEN
        RETURN f.max_running - tool_flow_occupied(f.tool, NULL);
    ELSIF p_key <> '' AND f.max_running_per_key IS NOT NULL THEN
        RETURN f.max_running_per_key - tool_flow_occupied(f.tool, p_key);
    END IF;
    RETURN NULL;
END
$$;

-- The most a rate's bucket holds (issue 42, point 4): its burst and half a token. A claim
-- takes one whole token, so no more than `burst` claims start at once (floor(burst + 0.5)
-- is burst); the half token keeps the part of a period a claim comes late by, up to half
-- a period, where a bucket of exactly `burst` would lose it: claimants that each come a
-- few milliseconds after their token (the round trip, a wake-up) no longer fall behind the
-- rate by those milliseconds at every claim. The bound it gives, over any window of T
-- seconds: at most burst + 0.5 + rate x T claims start (the bucket's most, plus what it
-- refills), so burst + rate x T over whole periods as before, and one more than that
-- only in a window at least half a period past a whole number of them (docs/operations.md,
-- "Flow control"). The same for the tool's bucket and each key's.
CREATE OR REPLACE FUNCTION tool_flow_bucket_size(p_burst integer) RETURNS float8
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_burst + 0.5::float8
$$;

-- Tokens in tool f's bucket (p_key NULL) or in key p_key's at p_clock: what the last claim
-- left, refilled at the rate since, up to tool_flow_bucket_size. A bucket not yet used (or
-- forgotten: queries.sql prune_full_key_buckets) is full. NULL when there is no such rate;
-- always NULL for jobs without a key ('').
CREATE OR REPLACE FUNCTION tool_flow_tokens(f tool_flow, p_key text, p_clock timestamptz)
RETURNS float8
SET search_path FROM CURRENT
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_size constant float8 := tool_flow_bucket_size(f.burst);
    v_tokens float8;
BEGIN
    IF p_key IS NULL AND f.rate_per_second IS NOT NULL THEN
        RETURN least(v_size, coalesce(f.tokens, v_size) + f.rate_per_second
                     * greatest(0, extract(epoch FROM p_clock - coalesce(f.tokens_at, p_clock))));
    ELSIF p_key <> '' AND f.key_rate_per_second IS NOT NULL THEN
        SELECT least(v_size, k.tokens + f.key_rate_per_second
                     * greatest(0, extract(epoch FROM p_clock - k.tokens_at)))
        INTO v_tokens
        FROM tool_flow_keys k
        WHERE k.tool = f.tool AND k.concurrency_key = p_key;
        RETURN coalesce(v_tokens, v_size);
    END IF;
    RETURN NULL;
END
$$;

-- How many jobs tool f (p_key NULL) or its key p_key may start at p_clock, one claim
-- after another: none while the tool is paused, else the fewer of its free slots and its
-- whole tokens. NULL when no limit holds them (f NULL: the tool has no flow row).
CREATE OR REPLACE FUNCTION tool_flow_room(f tool_flow, p_key text, p_clock timestamptz)
RETURNS bigint
SET search_path FROM CURRENT
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_room bigint;
BEGIN
    IF f.tool IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_key IS NULL AND f.paused_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    v_room := least(tool_flow_slots(f, p_key), floor(tool_flow_tokens(f, p_key, p_clock)));
    RETURN CASE WHEN v_room IS NOT NULL THEN greatest(v_room, 0) END;
END
$$;

-- Whether key p_key may start a job now under the flow row f: NULL when it may, else
-- 'max_running_per_key' (no free slot) or 'rate_per_key' (no whole token). Jobs without a
-- key ('') are never held back. The claim's reasons for tool_flow_room's answer of 0.
CREATE OR REPLACE FUNCTION tool_flow_key_blocked(f tool_flow, p_key text, p_clock timestamptz)
RETURNS text
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_key = '' THEN
        RETURN NULL;
    END IF;
    IF tool_flow_slots(f, p_key) < 1 THEN
        RETURN 'max_running_per_key';
    END IF;
    IF tool_flow_tokens(f, p_key, p_clock) < 1 THEN
        RETURN 'rate_per_key';
    END IF;
    RETURN NULL;
END
$$;

-- Seconds until key p_key's bucket holds a token (0: it holds one now, or has no rate).
CREATE OR REPLACE FUNCTION tool_flow_key_wait(f tool_flow, p_key text, p_clock timestamptz)
RETURNS float8
SET search_path FROM CURRENT
LANGUAGE sql STABLE AS $$
    SELECT coalesce(greatest(0, 1 - tool_flow_tokens(f, p_key, p_clock))
                    / f.key_rate_per_second, 0)
$$;

-- Agent sessions (migration 026): whether owner p_owner may take job j (queued, or running
-- under an expired lease) as far as its session is concerned. A job without a session: yes.
-- A call of a session: no other call of its session is running under a live lease (one at
-- a time), no older call of its session is still queued (in order), and no live session
-- lease of another owner holds it (its process is that sidecar's). A session whose lease
-- expired holds nothing: the claimer finds it lost (tool_session_begin).
CREATE OR REPLACE FUNCTION tool_job_session_free(j tool_jobs, p_owner text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT j.session_key IS NULL OR (
        NOT EXISTS (SELECT FROM tool_jobs o
                    WHERE o.tool = j.tool AND o.session_key = j.session_key
                      AND o.id <> j.id AND o.state IN ('running', 'waiting'))
        AND NOT EXISTS (SELECT FROM tool_jobs o
                        WHERE o.tool = j.tool AND o.session_key = j.session_key
                          AND o.state = 'queued' AND o.session_seq < j.session_seq)
        AND NOT EXISTS (SELECT FROM tool_sessions s
                        WHERE s.tool = j.tool AND s.session_key = j.session_key
                          AND s.state = 'live' AND s.owner_id <> p_owner
                          AND s.lease_until > now()))
$$;
