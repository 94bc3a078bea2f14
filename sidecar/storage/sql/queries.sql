-- Every statement the sidecar runs, by name. Loaded by sidecar/queries.py;
-- run only from sidecar/store.py. A write whose name ends in _if_owner carries
-- the four ownership conditions of P5/P6: id, owner_id, fencing_token, and a
-- lease still in the future by the database's clock (P3).

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS sidecar_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: add_migrations_compatible_from
-- compatible_from: the oldest schema version whose releases keep working on this
-- migration (its "-- compatible-from: N" line); NULL when it declares none. One
-- statement per named query: every one of them must prepare (tests/test_pgbouncer.py).
ALTER TABLE sidecar_schema_migrations ADD COLUMN IF NOT EXISTS compatible_from integer;

-- name: lock_migrations
SELECT pg_advisory_xact_lock($1::bigint);

-- name: applied_migrations
SELECT version FROM sidecar_schema_migrations ORDER BY version;

-- name: record_migration
INSERT INTO sidecar_schema_migrations (version, name, compatible_from) VALUES ($1, $2, $3);

-- name: create_repeatables_table
-- The repeatable definitions (sql/functions/*.sql) the schema holds: each file's sha256 as
-- last applied. A file whose checksum differs is applied again (Store.migrate).
CREATE TABLE IF NOT EXISTS sidecar_schema_repeatables (
    name       text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_repeatables
SELECT name, checksum FROM sidecar_schema_repeatables ORDER BY name;

-- name: forget_repeatable
DELETE FROM sidecar_schema_repeatables WHERE name = $1;

-- name: record_repeatable
INSERT INTO sidecar_schema_repeatables (name, checksum) VALUES ($1, $2);

-- name: pin_search_path
-- For the rest of the migrating transaction: the schema migrated, then pg_temp. The
-- repeatable definitions say SET search_path FROM CURRENT, so a function pinned that way
-- finds the queue's tables in its own schema whatever the caller's search_path, and a
-- caller cannot put a table or an operator of its own in front of them.
SELECT set_config('search_path', format('%I, pg_temp', current_schema()), true);

-- name: schema_compatibility
-- The highest applied version, and whether a release built for schema $1 may run on it:
-- the same version, or every migration above $1 declares compatible_from <= $1.
SELECT coalesce(max(version), 0) AS version,
       coalesce(bool_and(compatible_from IS NOT NULL AND compatible_from <= $1)
                FILTER (WHERE version > $1), true) AS compatible
FROM sidecar_schema_migrations;

-- name: schema_version
SELECT coalesce(max(version), 0) FROM sidecar_schema_migrations;

-- name: enqueue_job
-- One job through tool_job_enqueue (migration 014), the implementation sidecar_enqueue
-- shares: validated, inserted unless the idempotency key exists (then that job, or 23505
-- when it differs), journaled and, when due now, one idle sidecar of the tool woken.
-- $1 tool, $2 payload, $3 key, $4 priority, $5 run_after, $6 run_in, $7 expires_in,
-- $8 tags, $9 max_attempts (NULL: the claiming profile's), $10 traceparent,
-- $11 tracestate, $12 payload limit (NULL: checked by the caller), $13 journal details,
-- $14 an expiry time instead of $7 (turned into an interval by the database's clock),
-- $15 concurrency key (NULL: none; migration 016), $16 session key (NULL: none;
-- migration 026), $17 dedupe policy (NULL: the tool's default; migration 027), $18
-- the caller's interest (NULL: none; migration 029).
-- The JSON parameters ($2, $8, $13) are text cast here, so the statement runs the same on
-- the sidecar's connections and on a caller's own (sidecar.client), whatever jsonb codec
-- that one has.
SELECT enqueued_id AS id, created
FROM tool_job_enqueue($1, $2::text::jsonb, $3, $4, $5, $6,
                      coalesce($7::interval, $14::timestamptz - now()), $8::text::jsonb,
                      $9, $10, $11, $12, $13::text::jsonb, $15, $16, $17, $18);

-- name: hold_interest
-- Hold or renew the caller's interest $1 for $2 seconds from now, by $3 (migration 029).
SELECT generation, expires_at FROM tool_job_interest_hold($1, $2::float8 * interval '1 second', $3);

-- name: release_interest
-- Let go of the interest $1 now: its unfinished calls stop (tool_job_interest_lapse).
SELECT job_id, tool, previous_state FROM tool_job_interest_lapse($1);

-- name: lapse_interests
-- The sweep: every interest whose time ran out lapses and its unfinished calls stop.
SELECT job_id, tool, previous_state, interest_key FROM tool_job_interest_lapse(NULL);

-- name: set_dedupe_default
-- A sidecar's profile's DEDUPE as its tool's default dedupe policy (migration 027): $2
-- the window (NULL: forever), $3 who set it (the sidecar's owner id).
INSERT INTO tool_dedupe (tool, key_frees_after, set_by) VALUES ($1, $2, $3)
ON CONFLICT (tool) DO UPDATE SET key_frees_after = EXCLUDED.key_frees_after,
                                 set_by = EXCLUDED.set_by, set_at = now()
WHERE tool_dedupe.key_frees_after IS DISTINCT FROM EXCLUDED.key_frees_after;

-- name: find_job_by_idempotency_key
-- The job holding the key (a freed key names none; migration 027). jsonb equality: the
-- same payload whatever its key order or spacing.
SELECT id, tool, payload = $2::jsonb AS same_payload
FROM tool_jobs WHERE idempotency_key = $1 AND key_held;

-- name: free_key
-- The job holding $1, if its dedupe policy lets it go now (finished, its window past):
-- freed and journaled (tool_job_free_key). Returns the freed job's id, or NULL.
SELECT tool_job_free_key($1);

-- name: fail_exhausted_leases
-- Running jobs whose lease expired with no attempt left become terminal (P16)
-- instead of being claimed again; not one whose expired attempt is given back because
-- its tool never started (case F16, migration 012): the claim takes that one.
WITH exhausted AS (
    UPDATE tool_jobs
    SET state = 'failed', finished_at = now(), lease_until = NULL,
        error = jsonb_build_object(
            'kind', 'max_attempts_exceeded',
            'message', format('lease expired on attempt %s of %s; no attempts left',
                              attempt, max_attempts))
    WHERE id IN (
        SELECT id FROM tool_jobs
        WHERE tool = $1 AND state = 'running' AND lease_until < now()
          AND NOT tool_job_attempt_left(tool_jobs, NULL)  -- claimable.sql
        FOR UPDATE SKIP LOCKED)
    RETURNING id, fencing_token, owner_id, attempt
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'job_failed',
           jsonb_build_object('kind', 'max_attempts_exceeded', 'previous_owner', owner_id,
                              'attempt', attempt)
    FROM exhausted
)
SELECT id, fencing_token FROM exhausted;

-- name: fail_expired_jobs
-- Issue 26: the sweep of expired jobs of any tool, up to $1 of them (tool_job_expire,
-- functions/expiry.sql, which the reads of a job for a caller share: settle_expired).
SELECT id, tool, fencing_token, attempt FROM tool_job_expire(NULL, $1::integer);

-- name: settle_expired
-- Issue 41: before a caller reads jobs $1 (a jsonb array of ids as text: the waiter, get,
-- show), those past their expiry that no attempt runs end failed/expired, as the sweep
-- would end them (tool_job_expire), so a read never shows `queued` a job that can no
-- longer start, even while every sidecar is down. Returns the ids it ended.
SELECT id FROM tool_job_expire($1::jsonb, NULL);

-- name: claim_job
-- P4: one statement picks a running job whose lease expired or, when there is none, the
-- oldest due queued job, and takes it, bumping fencing_token and attempt. Each part is an
-- ordered LIMIT over its own partial index, so the backlog is never sorted: the queued
-- part reads tool_jobs_queued_order_idx in claim order (migration 005) and takes only
-- what the expired part left of the claim's size. Case F16: an expired attempt whose
-- tool never started is given back (migration 012): the claim keeps its attempt number
-- and counts the refund, so it is never what exhausts max_attempts. Migration 014: the
-- queued part reads priority first (0 first) from the same index, no attempt starts once
-- a job's expires_at has passed (fail_expired_jobs ends it), and a job enqueued without
-- max_attempts gets this claim's profile value ($5) on its row.
-- Issue 27 (migration 016): a tool with a flow row (limits, a pause, or jobs with
-- concurrency keys) claims through tool_job_claim_flow instead, which enforces them; this
-- statement's own parts then do nothing (one-time filters). blocked and retry_in say why
-- that claim took nothing: NULL here, and on every row that holds a job.
-- Issue 41: which rows may be taken is said once, in claimable.sql (tool_job_queued_due,
-- tool_job_lease_retakeable), which the scaler's demand counts with; the planner inlines
-- them, so each part still reads its partial index.
-- Issue 28 (migration 017): up to $6 jobs (the sidecar's free slots; NULL or less than 1
-- counts as 1) in this one statement, each with its own token, attempt, lease and
-- job_claimed row: expired leases first, the rest of $6 from the queue in claim order; a
-- tool with a flow row claims them through tool_job_claim_flow_many, one after another
-- under its lock, and a limit that held the rest back adds its row (blocked) last.
WITH flow AS (
    SELECT FROM tool_flow WHERE tool = $1
), expired AS (
    SELECT id, 'running'::text AS previous_state, tool_job_expiry_refunded(j) AS refunded
    FROM tool_jobs j
    WHERE tool = $1 AND tool_job_lease_retakeable(j, $5::int)
      AND NOT EXISTS (SELECT FROM flow)
    ORDER BY priority, run_after, created_at, id
    LIMIT greatest($6::int, 1)
    FOR UPDATE SKIP LOCKED
), queued AS (
    SELECT id, 'queued'::text AS previous_state, false AS refunded
    FROM tool_jobs j
    WHERE tool = $1 AND concurrency_key = '' AND tool_job_queued_due(j)
      AND NOT EXISTS (SELECT FROM flow)
    ORDER BY priority, run_after, created_at, id
    LIMIT greatest($6::int, 1) - (SELECT count(*) FROM expired)
    FOR UPDATE SKIP LOCKED
), candidate AS (
    SELECT * FROM expired
    UNION ALL
    SELECT * FROM queued
), claimed AS (
    UPDATE tool_jobs j
    SET state = 'running',
        owner_id = $2,
        lease_until = now() + $3::float8 * interval '1 second',
        heartbeat_at = now(),
        claimed_at = now(),  -- heartbeat_at = claimed_at: not renewed yet (migration 012)
        fencing_token = j.fencing_token + 1,
        -- P4's bump; the expired attempt it takes over is given back when its tool never
        -- started (F16), as release_if_owner gives one back (attempt - 1)
        attempt = j.attempt + 1 - candidate.refunded::int,
        unstarted_expiries = j.unstarted_expiries + candidate.refunded::int,
        first_claimed_at = coalesce(j.first_claimed_at, now()),
        max_attempts = coalesce(j.max_attempts, $5::int)
    FROM candidate
    -- the ids as an array too: an index probe of the primary key per candidate whatever
    -- the planner guesses of a claim's size (it cannot know $6 less the expired part)
    WHERE j.id = candidate.id AND j.id = ANY (ARRAY(SELECT id FROM candidate))
    RETURNING j.id, j.tool, j.payload::text AS payload_text, j.fencing_token, j.attempt, j.max_attempts,
              j.lease_until, j.idempotency_key, candidate.previous_state, candidate.refunded,
              extract(epoch FROM j.lease_until - now())::float8 AS lease_remaining,
              j.checkpoint::text AS checkpoint_text, j.stage, j.traceparent, j.tracestate,
              -- P12: seconds left of the job's lifetime cap ($4, NULL = none), counted
              -- from its first claim by the database's clock
              extract(epoch FROM j.first_claimed_at + $4::float8 * interval '1 second'
                      - now())::float8 AS lifetime_remaining, j.session_key,
              j.approval::text AS approval_text
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'job_claimed',
           jsonb_build_object('owner_id', $2::text, 'attempt', attempt,
                              'lease_until', lease_until,
                              'reclaimed', previous_state = 'running')
           || CASE WHEN refunded THEN jsonb_build_object(
                  'attempt_refunded', 'the expired attempt''s tool never started (F16)')
              ELSE '{}'::jsonb END
    FROM claimed
)
-- The row in tool_job_claim_row's order (session_key, migration 026; approval_text last,
-- migration 031).
SELECT id, tool, payload_text, fencing_token, attempt, max_attempts, lease_until,
       idempotency_key, previous_state, refunded, lease_remaining, checkpoint_text, stage,
       traceparent, tracestate, lifetime_remaining, NULL::text AS blocked,
       NULL::float8 AS retry_in, session_key, approval_text
FROM claimed
UNION ALL
SELECT * FROM tool_job_claim_flow_many($1, $2, $3, $4, $5, $6) WHERE EXISTS (SELECT FROM flow);

-- name: extend_leases_if_owner
-- P5: one statement renews every lease this sidecar holds, answering per attempt
-- (id, token; case F14). The held leases come as one
-- jsonb array of {id, token} ($2), not as uuid[]/bigint[] parameters: asyncpg looks array
-- types up with an introspection query on every new connection, and behind PgBouncer its
-- "jit off" guard around that query lands on another server connection, so PostgreSQL
-- JIT-compiles it (1-2 s of CPU on a loaded server, longer than a heartbeat's timeout).
-- Case F17: a row another session has locked (an operator's SELECT ... FOR UPDATE, a
-- cancel in progress) is skipped, never waited on, so one lock cannot stall every lease.
-- One row per held lease: locked = false with the new lease_until when renewed; locked =
-- true when the row is ours by this statement's snapshot but was locked (ownership
-- unknown for this beat); no row when it is no longer ours (expired, taken over,
-- cancelled, changed by policy).
WITH held AS (
    SELECT * FROM jsonb_to_recordset($2::jsonb) AS held(id uuid, token bigint)
), ours AS (
    SELECT j.id, j.fencing_token FROM tool_jobs j JOIN held ON j.id = held.id
    WHERE j.fencing_token = held.token
      AND j.owner_id = $1
      AND j.state = 'running'
      AND j.lease_until > now()
), lockable AS (
    SELECT j.id FROM tool_jobs j JOIN held ON j.id = held.id
    WHERE j.fencing_token = held.token
      AND j.owner_id = $1
      AND j.state = 'running'
      AND j.lease_until > now()
    FOR UPDATE OF j SKIP LOCKED
), renewed AS (
    UPDATE tool_jobs j
    SET lease_until = now() + $3::float8 * interval '1 second',
        heartbeat_at = now()
    FROM lockable
    WHERE j.id = lockable.id
    RETURNING j.id, j.fencing_token, j.lease_until,
              extract(epoch FROM j.lease_until - now())::float8 AS lease_remaining
)
SELECT id, fencing_token, lease_until, lease_remaining, false AS locked FROM renewed
UNION ALL
SELECT id, fencing_token, NULL, NULL, true FROM ours WHERE id NOT IN (SELECT id FROM lockable);

-- name: session_begin
-- Issue 43: what the call just claimed of session ($1 tool, $2 key) runs in, for owner $3
-- with a session lease of $4 seconds; $5 SESSION_RESTART=fresh (functions/sessions.sql).
SELECT status, generation, end_reason FROM tool_job_session_begin($1, $2, $3, $4, $5);

-- name: extend_sessions_if_owner
-- Issue 43: renew every session lease owner $1 holds ($2: a jsonb array of {tool, key,
-- generation}) by $3 seconds, in one statement beside the job leases' renewal. One row
-- per session renewed; none for one no longer ours (its lease ran out and a claim found
-- it lost, or another owner restarted it): the sidecar stops its process.
UPDATE tool_sessions s
SET lease_until = now() + $3::float8 * interval '1 second'
FROM jsonb_to_recordset($2::jsonb) AS held(tool text, key text, generation integer)
WHERE s.tool = held.tool AND s.session_key = held.key AND s.generation = held.generation
  AND s.owner_id = $1 AND s.state = 'live' AND s.lease_until > now()
RETURNING s.tool, s.session_key, s.generation;

-- name: session_call_queued
-- Issue 43: whether a call of session ($1 tool, $2 key) waits in the queue (an idle
-- session with one is not ended; a draining sidecar frees only a session without one).
SELECT EXISTS (SELECT FROM tool_jobs
               WHERE tool = $1 AND session_key = $2 AND state = 'queued');

-- name: lose_expired_sessions
-- Issue 43, the sweep (on the tool's sweep turn): live sessions of tool $1 whose lease ran
-- out (their holder died or was cut off and no longer renews them) are lost, so no
-- session stays live without a holder; a later call of one fails session_lost (or starts
-- it again, SESSION_RESTART=fresh). Returns the sessions marked.
UPDATE tool_sessions
SET state = 'lost', lease_until = NULL, ended_at = now(),
    end_reason = format('its lease ran out (held by %s)', owner_id)
WHERE tool = $1 AND state = 'live' AND lease_until < now()
RETURNING session_key, owner_id, generation;

-- name: end_session_if_owner
-- Issue 43: session ($1 tool, $2 key, generation $3) held by $4 ends: state $5 (ended:
-- idle, its age, a shutdown; lost: its process died or was killed), reason $6. No row
-- when it is no longer ours.
UPDATE tool_sessions
SET state = $5, lease_until = NULL, ended_at = now(), end_reason = $6
WHERE tool = $1 AND session_key = $2 AND generation = $3 AND owner_id = $4
  AND state = 'live'
RETURNING tool;

-- name: session_of_job
-- Issue 43: the session of job $1, for `sidecar show` (none: no row).
SELECT s.tool, s.session_key, s.state, s.owner_id, s.generation, s.lease_until,
       s.started_at, s.last_call_at, s.ended_at, s.end_reason, s.calls
FROM tool_jobs j JOIN tool_sessions s ON s.tool = j.tool AND s.session_key = j.session_key
WHERE j.id = $1;

-- name: live_sessions
-- Issue 43: the live sessions (of tool $1; NULL: every tool), newest first, at most $2.
SELECT tool, session_key, state, owner_id, generation, lease_until, started_at,
       last_call_at, calls,
       extract(epoch FROM lease_until - now())::float8 AS lease_remaining
FROM tool_sessions
WHERE state = 'live' AND ($1::text IS NULL OR tool = $1)
ORDER BY started_at DESC
LIMIT $2;

-- name: cancelled_leases_of_owner
-- Which of the leases owner $1 holds ($2: a jsonb array of {id, token}, as
-- extend_leases_if_owner) were cancelled while they ran: the check a sidecar that cannot
-- LISTEN makes about every second in place of the cancel NOTIFY (tool_job_tell_owner,
-- issue 41). Read-only, by primary key: one cheap statement for all its running jobs.
SELECT j.id FROM tool_jobs j
JOIN jsonb_to_recordset($2::jsonb) AS held(id uuid, token bigint) ON j.id = held.id
WHERE j.fencing_token = held.token
  AND j.owner_id = $1
  AND j.state = 'cancelled';

-- name: finish_job_if_owner
-- P6: the terminal write (succeeded or failed) commits only for the owner. A success of
-- a tool with a RESULT_URL ($9) queues its forwarding in the same statement, so a
-- rejected completion is never forwarded and an accepted one always is. A success that
-- names a next stage (P19: tool $10, payload $11, max attempts $12, new id $13) creates
-- it here too, keyed '{parent key}:stage:{n}': a repeated completion cannot make two.
-- No ON CONFLICT (case F22): the insert skips only this parent's own stage (a repeated
-- completion); a key held by any other job raises the unique violation, which rolls the
-- whole statement back (Store.finish_if_owner raises NextStageConflict).
WITH finished AS (
    UPDATE tool_jobs
    SET state = $4, result = $5, error = $6, finished_at = now(), lease_until = NULL
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    RETURNING id, tool, fencing_token, attempt, result, idempotency_key, stage, priority,
              tags, traceparent, tracestate, concurrency_key, session_key, key_frees_after
), next_stage AS (
    -- inherits the parent's priority, tags (group actions reach it), trace context,
    -- concurrency key (the same tenant's work; migration 016) and session (the same
    -- agent's: it joins its tool's session of that key, after the calls queued before it;
    -- migration 026) and dedupe policy (migration 027)
    INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, parent_id, stage,
                           priority, tags, traceparent, tracestate, concurrency_key,
                           session_key, key_frees_after)
    SELECT $13::uuid, $10::text, f.idempotency_key || ':stage:' || (f.stage + 1), $11::jsonb,
           $12::int, f.id, f.stage + 1, f.priority, f.tags, f.traceparent, f.tracestate,
           f.concurrency_key, f.session_key, f.key_frees_after
    FROM finished f
    WHERE $10::text IS NOT NULL
      AND NOT EXISTS (SELECT FROM tool_jobs own
                      WHERE own.parent_id = f.id AND own.stage = f.stage + 1)
    RETURNING id, tool, parent_id, stage, tags, traceparent
), next_journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, 0, 'job_enqueued', jsonb_strip_nulls(jsonb_build_object(
               'parent_id', parent_id, 'stage', stage, 'traceparent', traceparent,
               'tags', CASE WHEN tags <> '{}'::jsonb THEN tags END))
    FROM next_stage
), journal AS (
    -- the attempt's earlier events ($14, migration 006) first, then its final one
    INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
    SELECT f.id, f.fencing_token, j.event, j.at, j.details
    FROM finished f CROSS JOIN LATERAL tool_job_journal_rows($14::jsonb, $7, $8) j
    ORDER BY j.n
), outbox AS (
    INSERT INTO tool_job_outbox (job_id, tool, url, idempotency_key, fencing_token, body)
    SELECT id, tool, $9::text, 'tool-job:' || id || ':result', fencing_token,
           jsonb_build_object('job_id', id, 'tool', tool, 'fencing_token', fencing_token,
                              'attempt', attempt, 'result', result)
    FROM finished
    WHERE $9::text IS NOT NULL AND $4 = 'succeeded'
)
SELECT f.id,
       (SELECT n.id FROM next_stage n CROSS JOIN LATERAL tool_job_wake(n.tool, 1)
        LIMIT 1) AS next_id
FROM finished f;

-- name: requeue_job_if_owner
-- A retryable failure with attempts left: back to queued after a backoff.
WITH requeued AS (
    UPDATE tool_jobs
    SET state = 'queued', owner_id = NULL, lease_until = NULL, error = $4,
        run_after = now() + $5::float8 * interval '1 second'
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    RETURNING id, fencing_token, run_after
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
    SELECT r.id, r.fencing_token, j.event, j.at, j.details
    FROM requeued r CROSS JOIN LATERAL tool_job_journal_rows(
        $7::jsonb, 'job_retry_scheduled', $6::jsonb || jsonb_build_object('run_after', r.run_after)) j
    ORDER BY j.n
)
SELECT id, run_after FROM requeued;

-- name: park_job_if_owner
-- The tool asked a person's yes in park mode (issue 44): tool_job_park ($1 job, $2 owner,
-- $3 token, $4 request, $5 details, $6 the attempt's earlier events). Its outcome and the
-- request's deadline; no row when the attempt does not own the job.
SELECT outcome, deadline FROM tool_job_park($1, $2, $3, $4::uuid, $5::jsonb, $6::jsonb);

-- name: expire_parked_approvals
-- The fleet's sweep (issue 44): parked jobs whose request got no answer by its deadline
-- fail approval_expired (not retried), the request expired; journaled approval_expired.
-- The jobs are locked first (SKIP LOCKED: one an answer holds is left to the next
-- sweep), then their requests: the order the answer and the park take.
WITH parked AS (
    SELECT j.id FROM tool_jobs j
    WHERE j.state = 'waiting'
      AND EXISTS (SELECT FROM tool_approvals a WHERE a.job_id = j.id AND a.state = 'pending'
                    AND a.deadline <= now() AND a.fencing_token = j.fencing_token)
    FOR UPDATE SKIP LOCKED
), expired AS (
    UPDATE tool_approvals a SET state = 'expired'
    FROM parked p, tool_jobs j
    WHERE a.job_id = p.id AND j.id = p.id AND a.state = 'pending' AND a.deadline <= now()
      AND a.fencing_token = j.fencing_token
    RETURNING a.id, a.job_id, a.action, a.deadline
), failed AS (
    UPDATE tool_jobs j
    SET state = 'failed', finished_at = now(),
        error = jsonb_build_object('kind', 'approval_expired', 'message',
            format('nobody answered the approval of the step %s by its deadline (%s)',
                   quote_literal(e.action), e.deadline), 'action', e.action)
    FROM expired e
    WHERE j.id = e.job_id
    RETURNING j.id, j.tool, j.fencing_token, e.id AS request_id, e.deadline
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT f.id, f.fencing_token, 'approval_expired',
           jsonb_build_object('request_id', f.request_id, 'deadline', f.deadline,
                              'parked', true)
    FROM failed f
)
SELECT id, tool, fencing_token FROM failed;

-- name: snooze_job_if_owner
-- The tool asked to run again in $4 seconds (issue 44, point 3): back to queued with
-- run_after = now() + $4, the attempt given back (as a release) and snoozes + 1, if this
-- attempt still owns the job, the job has snoozed fewer than $5 times, and (with a
-- lifetime cap, $6 seconds from its first claim; NULL: none) it would run again before
-- that cap, by the database's clock. Journals job_snoozed after the attempt's earlier
-- events ($8) with $7 plus run_after and snoozes. Returns one row (outcome 'snoozed',
-- 'snooze_limit' or 'past_lifetime'; run_after and snoozes when snoozed), none when the
-- attempt does not own the job.
WITH job AS (
    SELECT id, snoozes, first_claimed_at
    FROM tool_jobs
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    FOR UPDATE
), verdict AS (
    SELECT id, CASE
        WHEN snoozes >= $5::int THEN 'snooze_limit'
        WHEN $6::float8 IS NOT NULL AND coalesce(first_claimed_at, now())
             + $6::float8 * interval '1 second' < now() + $4::float8 * interval '1 second'
            THEN 'past_lifetime'
        ELSE 'snoozed' END AS outcome
    FROM job
), snoozed AS (
    UPDATE tool_jobs j
    SET state = 'queued', owner_id = NULL, lease_until = NULL, attempt = j.attempt - 1,
        run_after = now() + $4::float8 * interval '1 second', snoozes = j.snoozes + 1
    FROM verdict v
    WHERE j.id = v.id AND v.outcome = 'snoozed'
    RETURNING j.id, j.fencing_token, j.run_after, j.snoozes
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
    SELECT s.id, s.fencing_token, e.event, e.at, e.details
    FROM snoozed s CROSS JOIN LATERAL tool_job_journal_rows(
        $8::jsonb, 'job_snoozed',
        $7::jsonb || jsonb_build_object('run_after', s.run_after, 'snoozes', s.snoozes)) e
    ORDER BY e.n
)
SELECT v.outcome, s.run_after, s.snoozes FROM verdict v LEFT JOIN snoozed s ON s.id = v.id;

-- name: ask_approval
-- An attempt that owns its job ($1 job, $2 owner, $3 token; running, lease not ended)
-- asks for a person's yes: request $8 with action $4, summary $5, details $6, answered
-- within $7 seconds by the database's clock; journaled approval_requested. The open
-- requests of older attempts of the job can no longer be answered: expired first (the
-- insert reads their count, so it runs after). Returns id, attempt and deadline; no row
-- when the attempt does not own the job; a unique violation (tool_approvals_pending_idx)
-- when one of its own requests is open already.
WITH job AS (
    SELECT id, attempt, fencing_token FROM tool_jobs
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
), stale AS (
    UPDATE tool_approvals a SET state = 'expired'
    FROM job
    WHERE a.job_id = job.id AND a.state = 'pending' AND a.fencing_token <> job.fencing_token
    RETURNING a.id
), asked AS (
    INSERT INTO tool_approvals (id, job_id, attempt, fencing_token, action, summary, details,
                                deadline)
    SELECT $8::uuid, id, attempt, fencing_token, $4, $5, $6::jsonb,
           now() + $7::float8 * interval '1 second'
    FROM job CROSS JOIN (SELECT count(*) FROM stale) expired_first
    RETURNING id, job_id, attempt, fencing_token, action, summary, deadline
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'approval_requested',
           jsonb_build_object('request_id', id, 'attempt', attempt, 'action', action,
                              'summary', summary, 'deadline', deadline)
    FROM asked
)
SELECT id, attempt, deadline FROM asked;

-- name: approval_state
-- One approval request's state and answer; waited_s from the ask to the answer.
SELECT state, answered_by, reason,
       extract(epoch FROM answered_at - asked_at)::float8 AS waited_s
FROM tool_approvals WHERE id = $1;

-- name: expire_approval
-- The request $1 got no answer by its deadline: expired (if still open), journaled
-- approval_expired. Returns its id, none when it was answered meanwhile.
WITH expired AS (
    UPDATE tool_approvals SET state = 'expired'
    WHERE id = $1 AND state = 'pending'
    RETURNING id, job_id, fencing_token, attempt, deadline
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'approval_expired',
           jsonb_build_object('request_id', id, 'attempt', attempt, 'deadline', deadline)
    FROM expired
)
SELECT id FROM expired;

-- name: open_approval_of_job
-- The job's open approval request, if any, while the job can still take an answer
-- (running or parked): what an answer names (attempt, token).
SELECT a.id, a.job_id, a.attempt, a.fencing_token, a.action, a.summary, a.details,
       a.asked_at, a.deadline
FROM tool_approvals a JOIN tool_jobs j ON j.id = a.job_id
WHERE a.job_id = $1 AND a.state = 'pending' AND j.state IN ('running', 'waiting');

-- name: answer_approval
-- A person's answer (tool_job_approval_answer): $1 job, $2 attempt, $3 token, $4 approve,
-- $5 reason, $6 who. Returns the outcome.
SELECT tool_job_approval_answer($1::uuid, $2::int, $3::bigint, $4::boolean, $5, $6);

-- name: release_lease_if_owner
-- Shutdown: give the job back at once without spending the attempt.
WITH released AS (
    UPDATE tool_jobs
    SET state = 'queued', owner_id = NULL, lease_until = NULL,
        attempt = attempt - 1, run_after = now()
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    RETURNING id, fencing_token, tool
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
    SELECT r.id, r.fencing_token, j.event, j.at, j.details
    FROM released r CROSS JOIN LATERAL tool_job_journal_rows($5::jsonb, 'lease_released', $4) j
    ORDER BY j.n
)
SELECT id, tool_job_wake(tool, 1) FROM released;

-- name: release_unheld_claims
-- Case F16: a claim whose answer was lost (connection dropped, timeout) may have committed:
-- the job is running under this sidecar's own owner id ($2) while the sidecar holds no
-- lease of it. Every such row of the tool ($1) whose attempt ($3: held {id, token}) this
-- sidecar does not hold goes back to the queue at once, without spending the attempt (its
-- tool never started). Locked rows are skipped (F17) and settled at the next round.
WITH held AS (
    SELECT * FROM jsonb_to_recordset($3::jsonb) AS held(id uuid, token bigint)
), unheld AS (
    SELECT j.id FROM tool_jobs j
    WHERE j.tool = $1 AND j.owner_id = $2 AND j.state = 'running'
      AND NOT EXISTS (SELECT FROM held WHERE held.id = j.id AND held.token = j.fencing_token)
    FOR UPDATE SKIP LOCKED
), released AS (
    UPDATE tool_jobs j
    SET state = 'queued', owner_id = NULL, lease_until = NULL, heartbeat_at = NULL,
        attempt = greatest(j.attempt - 1, 0), run_after = now()
    FROM unheld
    WHERE j.id = unheld.id
    RETURNING j.id, j.tool, j.fencing_token, j.attempt
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'lease_released',
           jsonb_build_object('reason', 'claim_answer_lost', 'owner_id', $2::text,
                              'attempt_spent', false)
    FROM released
)
SELECT r.id, r.fencing_token, tool_job_wake(r.tool, 1) FROM released r;

-- name: journaled_outcome
-- Case F16: whether the fenced write of attempt ($1, token $2) whose answer was lost did
-- commit: each such write journals its event ($3) in the same statement. Returns the
-- event's details, or no row.
SELECT details FROM tool_job_events
WHERE job_id = $1 AND fencing_token = $2 AND event = $3
ORDER BY id DESC LIMIT 1;

-- name: cancel_job
-- Cancels the job $1, or every queued or running job whose tags contain $2 (jsonb, e.g.
-- {"run": "42"}; read through tool_jobs_tags_idx), and every later stage of them still
-- queued or running: tool_job_cancel (migration 018), which writes with the schema
-- owner's rights so that the callers' role needs no UPDATE on tool_jobs. A running job
-- keeps its owner, token and lease end: its owner may still run the tree until it notices
-- at its next heartbeat (zero rows) and kills it (acknowledge_cancel_if_owner) or, at the
-- latest, until that lease ends, and retry_jobs waits for one of the two (case F14). A
-- cancelled job's completion is refused by its fence, so it creates no next stage.
-- $3: who asked (journaled as job_cancelled's "by"; NULL: not said; migration 019).
SELECT cancelled_id AS id, previous_state FROM tool_job_cancel($1::uuid, $2::jsonb, $3::text);

-- name: retry_jobs
-- An operator's re-run: failed or cancelled jobs, one ($1) or every one of a tool ($3)
-- and/or of a tag set ($5, jsonb), optionally only in state $2, back to queued with fresh
-- attempts and lifetime, journaled job_retried with $4 (who): tool_job_retry
-- (sql/functions/actions.sql), which writes with the schema owner's rights so that the
-- web view's role needs no UPDATE on tool_jobs (issue 41). The fencing token is kept, so
-- the next claim's token is still higher than any before (P7).
SELECT retried_id AS id, retried_tool AS tool, previous_state
FROM tool_job_retry($1::uuid, $2::text, $3::text, $4::text, $5::jsonb);

-- name: cancel_kill_bound
-- The jobs of $1 (a jsonb array of ids as text, see extend_leases_if_owner) cancelled
-- while they ran whose owners have not yet confirmed the tree
-- dead: how many, and the seconds until the latest of their leases ends (the owner kills
-- the tree by then at the latest: its local deadline lies before it). `sidecar cancel`
-- says so (issue 41).
SELECT count(*) AS pending,
       extract(epoch FROM max(lease_until) - now())::float8 AS latest_s
FROM tool_jobs
WHERE id IN (SELECT wanted::uuid FROM jsonb_array_elements_text($1::jsonb) wanted)
  AND state = 'cancelled' AND cancel_pending AND lease_until > now();

-- name: unacknowledged_cancels
-- Cancelled jobs retry_jobs leaves alone for now (same selection, $1-$3, tags $4): the owner of the
-- cancelled attempt has not acknowledged it and its lease has not ended (case F14).
SELECT id, owner_id, fencing_token,
       extract(epoch FROM lease_until - now())::float8 AS wait_seconds
FROM tool_jobs
WHERE state = 'cancelled' AND lease_until > now()
  AND ($1::uuid IS NULL OR id = $1)
  AND ($2::text IS NULL OR state = $2)
  AND ($3::text IS NULL OR tool = $3)
  AND ($4::jsonb IS NULL OR (tags @> $4::jsonb AND tags <> '{}'::jsonb))
ORDER BY id;

-- name: acknowledge_cancel_if_owner
-- The owner of a cancelled attempt ($2, token $3) has killed its tree: the job may be
-- retried at once (case F14). Journaled in the same statement.
WITH acknowledged AS (
    UPDATE tool_jobs SET lease_until = NULL, cancel_pending = false
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'cancelled' AND lease_until IS NOT NULL
    RETURNING id, fencing_token
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'cancel_acknowledged', $4::jsonb FROM acknowledged
)
SELECT id FROM acknowledged;

-- name: save_checkpoint_if_owner
-- A tool's progress, kept for the next attempt; only while this owner holds the lease.
WITH saved AS (
    UPDATE tool_jobs SET checkpoint = $4
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    RETURNING id, fencing_token
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'checkpoint_saved', $5 FROM saved
)
SELECT id FROM saved;

-- name: confirm_lease_if_owner
-- The guard's fenced read (issue 41): a tool's "go" before an irreversible step rests on
-- this row, read for the request on the database's clock (P3), never on local clocks
-- alone. One row, with the seconds the lease has left, while this owner ($2) holds the
-- attempt (id $1, token $3) by the four conditions of P5; no row when it does not.
SELECT extract(epoch FROM lease_until - now())::float8 AS lease_remaining
FROM tool_jobs
WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
  AND state = 'running' AND lease_until > now();

-- name: report_progress_if_owner
-- A tool's progress report (issue 26): $4 is {value, message}; stored with the database's
-- time and the attempt only while this owner holds the lease (the four conditions of P5/P6),
-- journaled as job_progress when the caller says so ($6: its throttle, $5: details), and
-- sent to the job's waiters on its own channel (migration 015), at commit.
WITH reported AS (
    UPDATE tool_jobs
    SET progress = $4::jsonb || jsonb_build_object('at', now(), 'attempt', attempt)
    WHERE id = $1 AND owner_id = $2 AND fencing_token = $3
      AND state = 'running' AND lease_until > now()
    RETURNING id, fencing_token, progress
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'job_progress', progress || $5::jsonb
    FROM reported
    WHERE $6::boolean
)
SELECT id, pg_notify(tool_job_channel(id), jsonb_build_object(
           'id', id, 'state', 'running', 'progress', progress)::text)
FROM reported;

-- name: jobs_to_wait_for
-- the waiter's read (sidecar.waiting): the jobs $1 names (a jsonb array of ids as text:
-- no uuid[] parameter, see extend_leases_if_owner), as they are now (settle_expired ran
-- first). A job missing from the answer does not exist (or was pruned). settle_in_s: for
-- an unfinished job with an expiry, the seconds until a read would settle it as expired
-- (a queued job's expiry; a running one's expiry or lease end, the later), so the waiter
-- reads it again then (issue 41); NULL for the others. expired: a queued job whose start
-- deadline passed (tool_job_wait_reasons ends it: sidecar.client.waiting.WaitHub).
SELECT j.id, j.state, j.attempt, j.result, j.error, j.progress,
       CASE WHEN j.state = 'queued'
            THEN extract(epoch FROM j.expires_at - now())::float8
            WHEN j.state = 'running'
            THEN extract(epoch FROM greatest(j.expires_at, j.lease_until) - now())::float8
       END AS settle_in_s,
       j.state = 'queued' AND coalesce(j.expires_at <= now(), false) AS expired
FROM jsonb_array_elements_text($1::jsonb) AS wanted(id)
JOIN tool_jobs j ON j.id = wanted.id::uuid;

-- name: wait_reasons
-- Why the queued jobs of $1 (a jsonb array of ids as text) wait (with $2; without: no
-- row), after ending those whose start deadline passed: tool_job_wait_reasons
-- (sql/functions/waiting.sql).
SELECT id, reason, ahead, detail FROM tool_job_wait_reasons($1::jsonb, $2::boolean);

-- name: record_event
INSERT INTO tool_job_events (job_id, fencing_token, event, details) VALUES ($1, $2, $3, $4);

-- name: record_events
-- An attempt's events noted earlier ($3, migration 006) and then $4 with $5, in order.
INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
SELECT $1, $2, j.event, j.at, j.details
FROM tool_job_journal_rows($3::jsonb, $4, $5) j
ORDER BY j.n;

-- name: ownership_of_job
SELECT state, owner_id, fencing_token FROM tool_jobs WHERE id = $1;

-- name: get_job
SELECT id, tool, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, idempotency_key, payload, result, error, run_after, created_at,
       first_claimed_at, finished_at, parent_id, stage, checkpoint, priority, expires_at, tags,
       traceparent, tracestate, progress, concurrency_key, session_key, interest_key,
       snoozes, key_held, key_frees_after
FROM tool_jobs WHERE id = $1;

-- name: job_events
SELECT fencing_token, event, at, details FROM tool_job_events WHERE job_id = $1 ORDER BY at, id;

-- name: children_of_job
SELECT id, tool, state, stage FROM tool_jobs WHERE parent_id = $1 ORDER BY created_at, id;

-- name: list_jobs
-- $4: only jobs whose tags contain it (jsonb, read through tool_jobs_tags_idx).
SELECT id, tool, state, attempt, max_attempts, fencing_token, owner_id, lease_until,
       created_at, finished_at, error->>'kind' AS error_kind, tags
FROM tool_jobs
WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR tool = $2)
  AND ($4::jsonb IS NULL OR (tags @> $4::jsonb AND tags <> '{}'::jsonb))
ORDER BY created_at DESC, id
LIMIT $3;

-- name: unfinished_jobs_tagged
-- How many queued, running or waiting jobs carry all of $1's tags (sidecar mcp's bound
-- on a principal's unfinished tasks); through tool_jobs_tags_idx. Counts at most $2 + 1.
SELECT count(*) FROM (
  SELECT 1 FROM tool_jobs
  WHERE tags @> $1::jsonb AND state IN ('queued', 'running', 'waiting')
  LIMIT $2::int + 1) AS found;

-- name: unfinished_same_jobs
-- The oldest unfinished jobs (at most $4) of tool $2 with payload $3 whose tags contain
-- $1's (sidecar mcp, issue 41: a call sent again without an idempotency key joins its
-- job); through tool_jobs_tags_idx.
SELECT id, tags FROM tool_jobs
WHERE tags @> $1::jsonb AND tool = $2 AND state IN ('queued', 'running', 'waiting')
  AND payload = $3::jsonb
ORDER BY created_at, id
LIMIT $4::int;

-- name: unfinished_jobs_of_tool
-- --drain waits while any job of the tool is queued or running (not one parked for a
-- person's answer, which may take days: another sidecar takes it once answered).
SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state IN ('queued', 'running');

-- name: expire_lease_if_owner
-- An owner that gave a job up locally (ownership unknown past its local deadline)
-- ends its lease now, if it is still its own, so the job is claimable at once.
UPDATE tool_jobs SET lease_until = now()
WHERE id = $2 AND owner_id = $1 AND fencing_token = $3
  AND state = 'running' AND lease_until > now()
RETURNING id;

-- name: sample_tool
-- Once per poll period per sidecar (issue 28): whether it is this sidecar's turn to sweep
-- ($2: its poll period in seconds; the tool's last sweep is at least that old), the queue
-- depth (jobs the claim's row rules admit now: queued, due and not past their expiry, or
-- under an expired lease with an attempt left; claimable.sql tool_job_claimable; the flow
-- limits are not applied here: the claim says which one holds a job back, and the
-- scaler's tool_job_demand counts them), how long the oldest of those queued jobs has
-- been due (queue_age, seconds; 0 when none), the results waiting in
-- the outbox (forward_backlog, issue 30), the jobs parked for a person's answer
-- (waiting_approval, issue 44; tool_jobs_waiting_idx) and the tool's flow row with its slots taken
-- (has_flow false and NULLs without one), in one round trip, in place of the four
-- statements a poll used to cost. The turn moves with a plain UPDATE: a concurrent sample waits for it, then finds it taken,
-- so one sidecar of the fleet sweeps per period. The first sample of a tool makes its row.
WITH turn AS (
    UPDATE tool_sweeps SET swept_at = now()
    WHERE tool = $1 AND swept_at <= now() - $2::float8 * interval '1 second'
    RETURNING tool
), first_turn AS (
    INSERT INTO tool_sweeps (tool)
    SELECT $1 WHERE NOT EXISTS (SELECT FROM tool_sweeps WHERE tool = $1)
    ON CONFLICT (tool) DO NOTHING
    RETURNING tool
)
SELECT EXISTS (SELECT FROM turn) OR EXISTS (SELECT FROM first_turn) AS sweep,
       (SELECT count(*) FROM tool_jobs j
        WHERE tool = $1 AND tool_job_claimable(j, NULL)) AS depth,
       (SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(run_after))::float8, 0)
        FROM tool_jobs j WHERE tool = $1 AND tool_job_queued_due(j)) AS queue_age,
       (SELECT count(*) FROM tool_job_outbox WHERE tool = $1 AND state = 'pending')
           AS forward_backlog,
       (SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state = 'waiting')
           AS waiting_approval,
       f.tool IS NOT NULL AS has_flow,
       f.max_running, f.max_running_per_key, f.rate, f.rate_per_key, f.burst,
       f.rate_per_second, f.key_rate_per_second, f.paused_at, f.pause_reason,
       CASE WHEN f.tool IS NOT NULL THEN tool_flow_occupied(f.tool, NULL) END AS running
FROM (SELECT) AS one LEFT JOIN tool_flow f ON f.tool = $1;

-- name: prune_finished_jobs
-- Retention: delete up to $3 jobs in state $1 that finished more than $2 seconds ago,
-- oldest first, with their journal and outbox rows. Kept: a job with a later stage still
-- queued or running, or with a result still to be forwarded (a pending outbox row). One
-- pruner at a time: the transaction-scoped advisory lock $4 (also behind a transaction
-- pooler); a second one deletes nothing and says so (locked = false). SKIP LOCKED: a row
-- an operator is retrying right now is left for the next batch.
WITH lock AS (
    SELECT pg_try_advisory_xact_lock($4::bigint) AS held
), doomed AS (
    SELECT j.id FROM tool_jobs j
    WHERE (SELECT held FROM lock) AND tool_job_prunable(j, $1, $2::float8)
    ORDER BY j.finished_at
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), jobs AS (
    DELETE FROM tool_jobs j USING doomed d WHERE j.id = d.id RETURNING j.id
), events AS (
    DELETE FROM tool_job_events e USING doomed d WHERE e.job_id = d.id RETURNING e.id
), outbox AS (
    DELETE FROM tool_job_outbox o USING doomed d WHERE o.job_id = d.id RETURNING o.id
)
SELECT (SELECT held FROM lock) AS locked, (SELECT count(*) FROM jobs) AS jobs,
       (SELECT count(*) FROM events) AS events, (SELECT count(*) FROM outbox) AS outbox;

-- name: count_prunable_jobs
-- What prune_finished_jobs would delete for state $1 and age $2 seconds, all batches: the
-- same rule (retention.sql tool_job_prunable).
WITH doomed AS (
    SELECT j.id FROM tool_jobs j WHERE tool_job_prunable(j, $1, $2::float8)
)
SELECT true AS locked, (SELECT count(*) FROM doomed) AS jobs,
       (SELECT count(*) FROM tool_job_events e JOIN doomed d ON e.job_id = d.id) AS events,
       (SELECT count(*) FROM tool_job_outbox o JOIN doomed d ON o.job_id = d.id) AS outbox;

-- name: register_idle_sidecar
-- This sidecar has room for a job and found none: wake it on $3 when one is queued.
INSERT INTO tool_idle_sidecars (owner_id, tool, channel) VALUES ($1, $2, $3)
ON CONFLICT (owner_id) DO UPDATE SET tool = excluded.tool, channel = excluded.channel,
                                     seen_at = now();

-- name: unregister_idle_sidecar
DELETE FROM tool_idle_sidecars WHERE owner_id = $1;

-- name: prune_dead_idle_sidecars
-- Retention (sidecar.ops.retention RETENTION, like every prune_* statement below: one
-- statement per kind, returning how many rows it removed; `sidecar prune --dry-run` runs
-- it in a transaction it rolls back). Idle registrations not refreshed for ten minutes:
-- their sidecars died without unregistering.
WITH gone AS (
    DELETE FROM tool_idle_sidecars WHERE seen_at < now() - interval '10 minutes' RETURNING 1
)
SELECT count(*) FROM gone;

-- name: set_tool_limits
-- Issue 27: a tool's limits, set fleet-wide. $2 holds only the fields to change
-- as JSON text (max_running, max_running_per_key, rate, rate_per_second, rate_per_key,
-- key_rate_per_second, burst); a field given as null is cleared. A rate or burst that
-- changes starts with a full bucket (one given again unchanged keeps the bucket as it is). Journaled (limits_set, with $3, who), and every idle sidecar of the
-- tool is woken, so the change takes effect at the next claim.
WITH before AS (
    SELECT key_rate_per_second, burst FROM tool_flow WHERE tool = $1
), applied AS (
    INSERT INTO tool_flow AS f (tool, max_running, max_running_per_key, rate,
                                rate_per_second, rate_per_key, key_rate_per_second, burst,
                                updated_by)
    VALUES ($1, ($2::text::jsonb->>'max_running')::int, ($2::text::jsonb->>'max_running_per_key')::int,
            $2::text::jsonb->>'rate', ($2::text::jsonb->>'rate_per_second')::float8,
            $2::text::jsonb->>'rate_per_key', ($2::text::jsonb->>'key_rate_per_second')::float8,
            coalesce(($2::text::jsonb->>'burst')::int, 1), $3)
    ON CONFLICT (tool) DO UPDATE SET
        max_running = CASE WHEN $2::text::jsonb ? 'max_running' THEN excluded.max_running
                           ELSE f.max_running END,
        max_running_per_key = CASE WHEN $2::text::jsonb ? 'max_running_per_key'
                                   THEN excluded.max_running_per_key
                                   ELSE f.max_running_per_key END,
        rate = CASE WHEN $2::text::jsonb ? 'rate' THEN excluded.rate ELSE f.rate END,
        rate_per_second = CASE WHEN $2::text::jsonb ? 'rate' THEN excluded.rate_per_second
                               ELSE f.rate_per_second END,
        rate_per_key = CASE WHEN $2::text::jsonb ? 'rate_per_key' THEN excluded.rate_per_key
                            ELSE f.rate_per_key END,
        key_rate_per_second = CASE WHEN $2::text::jsonb ? 'rate_per_key'
                                   THEN excluded.key_rate_per_second
                                   ELSE f.key_rate_per_second END,
        burst = CASE WHEN $2::text::jsonb ? 'burst' THEN excluded.burst ELSE f.burst END,
        tokens = CASE WHEN tool_flow_bucket_changed(f, excluded, $2::text::jsonb) THEN NULL
                      ELSE f.tokens END,
        tokens_at = CASE WHEN tool_flow_bucket_changed(f, excluded, $2::text::jsonb) THEN NULL
                         ELSE f.tokens_at END,
        rate_queue = CASE WHEN tool_flow_bucket_changed(f, excluded, $2::text::jsonb)
                          THEN NULL ELSE f.rate_queue END,
        updated_at = now(), updated_by = $3
    RETURNING f.tool
), keys_reset AS (
    -- per-key buckets start full again only when the per-key rate or the burst changed
    DELETE FROM tool_flow_keys k USING applied
    WHERE k.tool = applied.tool
      AND (($2::text::jsonb ? 'rate_per_key' AND (SELECT b.key_rate_per_second FROM before b)
              IS DISTINCT FROM ($2::text::jsonb->>'key_rate_per_second')::float8)
           OR ($2::text::jsonb ? 'burst' AND (SELECT b.burst FROM before b)
              IS DISTINCT FROM coalesce(($2::text::jsonb->>'burst')::int, 1)))
), journal AS (
    INSERT INTO tool_flow_events (tool, event, details)
    SELECT tool, 'limits_set', $2::text::jsonb || jsonb_build_object('by', $3::text) FROM applied
)
SELECT tool, tool_job_wake(tool, 1000) AS woken FROM applied;

-- name: known_tools
-- Whether tool $1 was ever seen here (a job of it, a flow row: a limit or a pause, or an
-- idle sidecar of it), and up to $2 names of tools that were, sorted: `sidecar pause`
-- refuses a tool never seen (a typo) unless told `--new` (issue 41). The names of
-- tool_jobs come from a skip scan of tool_jobs_tool_id_idx, one probe per tool.
WITH RECURSIVE job_tools(tool) AS (
    (SELECT tool FROM tool_jobs ORDER BY tool LIMIT 1)
    UNION ALL
    SELECT (SELECT j.tool FROM tool_jobs j WHERE j.tool > t.tool ORDER BY j.tool LIMIT 1)
    FROM job_tools t WHERE t.tool IS NOT NULL
), names AS (
    SELECT tool FROM (SELECT tool FROM job_tools WHERE tool IS NOT NULL LIMIT $2) j
    UNION SELECT tool FROM tool_flow
    UNION SELECT tool FROM tool_idle_sidecars
)
SELECT EXISTS (SELECT 1 FROM tool_jobs WHERE tool = $1)
       OR EXISTS (SELECT 1 FROM tool_flow WHERE tool = $1)
       OR EXISTS (SELECT 1 FROM tool_idle_sidecars WHERE tool = $1) AS known,
       ARRAY(SELECT tool FROM names ORDER BY tool LIMIT $2) AS tools;

-- name: pause_tool
-- Issue 27: no claim of tool $1 starts from now on, on any sidecar (running jobs go on);
-- $2 the reason (NULL keeps an earlier one), $3 who. Journaled tool_paused. Returns the
-- pause's time and reason, and whether it was paused already: tool_flow_pause
-- (sql/functions/actions.sql, SECURITY DEFINER: the web role writes no flow row itself).
SELECT paused_at, pause_reason, was_paused FROM tool_flow_pause($1::text, $2::text, $3::text);

-- name: resume_tool
-- Issue 27: claims of tool $1 start again; every idle sidecar of it is woken. Journaled
-- tool_resumed with $2 (who). No row when the tool was not paused: tool_flow_resume
-- (sql/functions/actions.sql, SECURITY DEFINER).
SELECT resumed_tool AS tool, woken FROM tool_flow_resume($1::text, $2::text);

-- name: tool_limits
-- Issue 27: every tool with a flow row (or only $1), with what it is doing now: jobs
-- running under a live lease, and queued.
SELECT f.tool, f.max_running, f.max_running_per_key, f.rate, f.rate_per_key, f.burst,
       f.rate_per_second, f.key_rate_per_second,
       f.paused_at, f.pause_reason, f.paused_by, f.updated_at, f.updated_by,
       tool_flow_occupied(f.tool, NULL) AS running,
       (SELECT count(*) FROM tool_jobs j
        WHERE j.tool = f.tool AND j.state = 'queued') AS queued
FROM tool_flow f
WHERE $1::text IS NULL OR f.tool = $1
ORDER BY f.tool;

-- name: drop_rate_turns
-- A sidecar ($2) that stops gives up its turns at tool $1's rate (migration 016).
UPDATE tool_flow
SET rate_queue = (SELECT coalesce(jsonb_agg(r), '[]'::jsonb)
                  FROM jsonb_array_elements(rate_queue) r WHERE r->>'o' <> $2::text)
WHERE tool = $1 AND rate_queue @> jsonb_build_array(jsonb_build_object('o', $2::text));

-- name: running_jobs_of_tool
-- pause --cancel-running: the jobs of tool $1 running now.
SELECT id FROM tool_jobs WHERE tool = $1 AND state = 'running' ORDER BY id;

-- name: flow_events
-- The journal of a tool's flow changes, oldest first ($2 at most, the newest ones).
SELECT * FROM (
    SELECT id, tool, event, at, details FROM tool_flow_events
    WHERE $1::text IS NULL OR tool = $1
    ORDER BY id DESC LIMIT $2) newest
ORDER BY id;

-- name: prune_ended_cancels
-- Retention: a cancelled job's slot whose lease ended without its owner's confirmation
-- (the owner died): no longer taken (the count already ignores it; this keeps the index
-- small). A flag cleared, no row deleted; returns how many.
WITH cleared AS (
    UPDATE tool_jobs SET cancel_pending = false
    WHERE cancel_pending AND (lease_until IS NULL OR lease_until <= now())
    RETURNING 1
)
SELECT count(*) FROM cleared;

-- name: prune_full_key_buckets
-- Retention: per-key buckets that refilled (a claim leaves at least no token, so a bucket
-- is full tool_flow_bucket_size / rate seconds after its last claim), or of a tool
-- without a per-key rate now. A missing bucket is a full one, so nothing
-- changes for the claim; a bucket a claim refreshes meanwhile is re-checked under its row
-- lock and kept.
WITH gone AS (
    DELETE FROM tool_flow_keys k
    USING tool_flow f
    WHERE k.tool = f.tool
      AND (f.key_rate_per_second IS NULL
           OR k.tokens_at < now() - (tool_flow_bucket_size(f.burst) / f.key_rate_per_second)
                                    * interval '1 second')
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_flow_events
-- Retention: flow changes (limits set, pauses, resumes) older than $1 seconds (the
-- longest retention of finished jobs).
WITH gone AS (
    DELETE FROM tool_flow_events WHERE at < now() - $1::float8 * interval '1 second'
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_idle_sweeps
-- Retention: the sweep turn (tool_sweeps, migration 017) of a tool no sidecar has sampled
-- for a day: a tool renamed or retired. The first sample of a tool makes its row again.
WITH gone AS (
    DELETE FROM tool_sweeps WHERE swept_at < now() - interval '1 day' RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_ended_interests
-- Retention (issue 44): callers' interests that lapsed or were let go more than $1
-- seconds ago (the longest retention of finished jobs), none of whose calls is still
-- queued, running or waiting. A key held again then starts at generation 1.
WITH gone AS (
    DELETE FROM tool_interests i
    WHERE i.state <> 'live' AND i.ended_at < now() - $1::float8 * interval '1 second'
      AND NOT EXISTS (SELECT FROM tool_jobs j
                      WHERE j.interest_key = i.interest_key
                        AND j.state IN ('queued', 'running', 'waiting'))
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: prune_ended_sessions
-- Retention (issue 43): agent sessions that ended or were lost more than $1 seconds ago
-- (the longest retention of finished jobs), none of whose calls is still queued or
-- running. A later call of the same key then starts a new session.
WITH gone AS (
    DELETE FROM tool_sessions s
    WHERE s.state <> 'live' AND s.ended_at < now() - $1::float8 * interval '1 second'
      AND NOT EXISTS (SELECT FROM tool_jobs j
                      WHERE j.tool = s.tool AND j.session_key = s.session_key
                        AND j.state IN ('queued', 'running', 'waiting'))
    RETURNING 1
)
SELECT count(*) FROM gone;

-- The operator's web view (`sidecar web`, issue 30). Read-only statements; every one runs
-- with custom plans (web_custom_plans), so an unset filter ($n IS NULL) drops out of the
-- plan and each set one reads its own index (migration 019).

-- name: web_custom_plans
-- First statement of every transaction of `sidecar web`: plan each statement for its own
-- parameters (a generic plan of "$1 IS NULL OR state = $1" reads the whole table), and
-- without JIT (the tools' counts on a large queue are estimated costly enough to compile
-- for 0.7 s, several times what they take).
-- One statement (every named query must prepare: tests/test_pgbouncer.py), local to the
-- transaction.
SELECT set_config('plan_cache_mode', 'force_custom_plan', true), set_config('jit', 'off', true);

-- name: web_tools
-- One row per tool that has jobs, a flow row or a live sidecar: jobs queued and running,
-- failed in the last hour, the oldest due queued job's wait, the pause and limits (flow
-- control, migration 016) and the sidecars seen (owners of live leases, idle ones
-- registered in the last ten minutes). The tools are found with a skip scan of
-- tool_jobs_tool_id_idx (one probe per tool, not a read of every job); the counts
-- per tool read the partial indexes of queued and running jobs; the failures of the last
-- hour and the live owners are each read once for every tool. At most $1 tools, in
-- name order (callers can make any number of tool names: the page stays bounded).
WITH RECURSIVE job_tools AS (
    (SELECT tool, 1 AS n FROM tool_jobs ORDER BY tool LIMIT 1)
    UNION ALL
    SELECT (SELECT j.tool FROM tool_jobs j WHERE j.tool > t.tool ORDER BY j.tool LIMIT 1),
           t.n + 1
    FROM job_tools t WHERE t.tool IS NOT NULL AND t.n < $1::int
), tools AS (
    (SELECT tool FROM job_tools WHERE tool IS NOT NULL
     UNION SELECT tool FROM tool_flow
     UNION SELECT tool FROM tool_idle_sidecars)
    ORDER BY tool LIMIT $1::int
), failed AS (
    SELECT tool, count(*) AS n FROM tool_jobs
    WHERE state = 'failed' AND finished_at > now() - interval '1 hour'
    GROUP BY tool
), seen AS (
    SELECT tool, count(DISTINCT owner) AS n FROM (
        SELECT tool, owner_id AS owner FROM tool_jobs
        WHERE state = 'running' AND lease_until > now()
        UNION ALL
        SELECT tool, owner_id FROM tool_idle_sidecars
        WHERE seen_at > now() - interval '10 minutes') owners
    GROUP BY tool
)
SELECT t.tool,
       (SELECT count(*) FROM tool_jobs j WHERE j.tool = t.tool AND j.state = 'queued')
           AS queued,
       (SELECT count(*) FROM tool_jobs j WHERE j.tool = t.tool AND j.state = 'running')
           AS running,
       coalesce(failed.n, 0) AS failed_last_hour,
       (SELECT extract(epoch FROM now() - min(j.run_after))::float8 FROM tool_jobs j
        WHERE j.tool = t.tool AND tool_job_queued_due(j))  -- claimable.sql
           AS oldest_queued_s,
       f.paused_at, f.pause_reason, f.paused_by, f.max_running, f.max_running_per_key,
       f.rate, f.rate_per_key, f.burst,
       coalesce(seen.n, 0) AS sidecars_seen
FROM tools t
LEFT JOIN tool_flow f ON f.tool = t.tool
LEFT JOIN failed ON failed.tool = t.tool
LEFT JOIN seen ON seen.tool = t.tool
ORDER BY t.tool;

-- name: web_running
-- Every running job (of tool $1, or all; at most $2), oldest claim first: owner, attempt,
-- token, the lease's slack and the time since the claim by the database's clock, progress.
-- Through tool_jobs_running_idx.
SELECT id, tool, owner_id, attempt, max_attempts, fencing_token, stage, progress,
       extract(epoch FROM lease_until - now())::float8 AS lease_slack_s,
       extract(epoch FROM now() - claimed_at)::float8 AS in_stage_s,
       extract(epoch FROM now() - heartbeat_at)::float8 AS since_heartbeat_s,
       concurrency_key
FROM tool_jobs
WHERE state = 'running' AND ($1::text IS NULL OR tool = $1)
ORDER BY claimed_at, id
LIMIT $2;

-- name: web_jobs_page
-- One page of jobs, newest first (ids are time-ordered: migration 017), after the keyset
-- ($5: the id of the last row of the page before; NULL for the first page): filtered by
-- state $1, tool $2, tags $3 (all of them) and error kind $4; at most $6 rows. No OFFSET:
-- a page costs its LIMIT.
SELECT id, tool, state, attempt, max_attempts, fencing_token, owner_id, created_at,
       finished_at, error->>'kind' AS error_kind, tags, stage
FROM tool_jobs
WHERE ($1::text IS NULL OR state = $1)
  AND ($2::text IS NULL OR tool = $2)
  AND ($3::jsonb IS NULL OR (tags @> $3::jsonb AND tags <> '{}'::jsonb))
  AND ($4::text IS NULL OR error->>'kind' = $4)
  AND ($5::uuid IS NULL OR id < $5)
ORDER BY id DESC
LIMIT $6;

-- name: web_job
-- One job for its page: the row without the payload, result and checkpoint themselves,
-- but each one's size and sha256 as stored (jsonb text), and the database's now() for the
-- lease's slack.
SELECT id, tool, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
       max_attempts, idempotency_key, error, run_after, created_at, first_claimed_at,
       claimed_at, finished_at, parent_id, stage, priority, expires_at, tags, traceparent,
       progress, concurrency_key, unstarted_expiries, session_key,
       extract(epoch FROM lease_until - now())::float8 AS lease_slack_s,
       octet_length(payload::text) AS payload_bytes,
       encode(sha256(convert_to(payload::text, 'UTF8')), 'hex') AS payload_sha256,
       octet_length(result::text) AS result_bytes,
       encode(sha256(convert_to(result::text, 'UTF8')), 'hex') AS result_sha256,
       octet_length(checkpoint::text) AS checkpoint_bytes
FROM tool_jobs WHERE id = $1;

-- name: web_open_approval
-- Issue 44: the approval request job $1's tool waits on, for its page (no row: none).
SELECT id, attempt, fencing_token, action, summary, details, asked_at, deadline,
       extract(epoch FROM deadline - now())::float8 AS left_s
FROM tool_approvals WHERE job_id = $1 AND state = 'pending';

-- name: web_session_of_job
-- Issue 43: the agent session of job $1 for its page (no row: none, or not started yet).
SELECT s.session_key, s.state, s.owner_id, s.generation, s.calls, s.started_at,
       s.last_call_at, s.ended_at, s.end_reason,
       extract(epoch FROM s.lease_until - now())::float8 AS lease_slack_s
FROM tool_jobs j JOIN tool_sessions s ON s.tool = j.tool AND s.session_key = j.session_key
WHERE j.id = $1;

-- name: web_sessions
-- Issue 43: the live agent sessions (of tool $1; NULL: every tool), newest first, at most
-- $2, with their lease's slack by the database's clock and the call running now, if any.
SELECT s.tool, s.session_key, s.owner_id, s.generation, s.calls, s.started_at,
       s.last_call_at, extract(epoch FROM s.lease_until - now())::float8 AS lease_slack_s,
       (SELECT j.id FROM tool_jobs j
        WHERE j.tool = s.tool AND j.session_key = s.session_key AND j.state = 'running'
        LIMIT 1) AS running_job
FROM tool_sessions s
WHERE s.state = 'live' AND ($1::text IS NULL OR s.tool = $1)
ORDER BY s.started_at DESC
LIMIT $2;

-- name: web_job_content
-- The payload ($2 = 'payload') or result ('result') of job $1 as JSON text, at most $3
-- characters, and its whole length; no row when the job does not exist.
SELECT left(CASE $2::text WHEN 'payload' THEN payload::text
                          WHEN 'result' THEN result::text END, $3::int) AS text,
       length(CASE $2::text WHEN 'payload' THEN payload::text
                            WHEN 'result' THEN result::text END) AS chars
FROM tool_jobs WHERE id = $1;

-- name: web_job_events
-- The journal of job $1, oldest first, at most $2 rows (the newest), through
-- tool_job_events_job_idx; and how many there are.
SELECT id, fencing_token, event, at, details FROM (
    SELECT id, fencing_token, event, at, details FROM tool_job_events
    WHERE job_id = $1 ORDER BY id DESC LIMIT $2) newest
ORDER BY at, id;

-- name: web_job_event_count
SELECT count(*) FROM tool_job_events WHERE job_id = $1;

-- name: web_session_create
-- A session of principal $2 (issue 41, migration 025): the sha256 of its key ($1), its CSRF
-- token ($3), ending $4 seconds from now. Expired sessions are deleted first, and the
-- oldest beyond $5 - 1 of the principal's and beyond $6 - 1 of all, so that with this one
-- at most $5 and $6 are kept.
WITH expired AS (
    DELETE FROM sidecar_web_sessions WHERE expires_at <= now()
), over_principal AS (
    DELETE FROM sidecar_web_sessions WHERE key_sha256 IN (
        SELECT key_sha256 FROM sidecar_web_sessions WHERE principal = $2
        ORDER BY created_at DESC, key_sha256 OFFSET greatest($5::int - 1, 0))
), over_all AS (
    DELETE FROM sidecar_web_sessions WHERE key_sha256 IN (
        SELECT key_sha256 FROM sidecar_web_sessions
        ORDER BY created_at DESC, key_sha256 OFFSET greatest($6::int - 1, 0))
)
INSERT INTO sidecar_web_sessions (key_sha256, principal, csrf, expires_at)
VALUES ($1, $2, $3, now() + make_interval(secs => $4::float8));

-- name: web_session_get
-- The live session whose key has the sha256 $1: its principal and CSRF token; no row when
-- there is none or it has expired.
SELECT principal, csrf FROM sidecar_web_sessions WHERE key_sha256 = $1 AND expires_at > now();

-- name: web_session_delete
-- Log out: the session whose key has the sha256 $1 is gone, on every replica.
DELETE FROM sidecar_web_sessions WHERE key_sha256 = $1;

-- name: web_login_lock
-- The lock, if any, on source $1 or on the token whose sha256 is $2 (NULL: none
-- presented): the scope locked ('source' or 'token', the later-ending lock) and the whole
-- seconds it still holds; no row when neither is locked.
SELECT scope, ceil(extract(epoch FROM locked_until - now()))::int AS retry_after_s
FROM sidecar_web_login_failures
WHERE ((scope = 'source' AND subject = $1) OR (scope = 'token' AND subject = $2))
  AND locked_until > now()
ORDER BY locked_until DESC
LIMIT 1;

-- name: web_login_failed
-- One failed login from source $1 with a token whose sha256 is $2, counted for both in a
-- window of $3 seconds that starts at the first failure (a window that is over, or a lock
-- that has ended, starts again at 1); the failure that makes $4 locks its subject for $5
-- seconds. Rows whose window and lock are over are deleted, and the oldest unlocked rows
-- beyond $6 in all: the table stays bounded whatever an attacker sends. Returns each
-- subject counted: its scope, failures in the window, and locked_now (true only for the
-- failure that locked it, so each lockout is logged and counted once).
WITH stale AS (
    DELETE FROM sidecar_web_login_failures
    WHERE (window_start <= now() - make_interval(secs => $3::float8)
           OR locked_until <= now())
      AND (locked_until IS NULL OR locked_until <= now())
      AND (scope, subject) NOT IN (('source', $1::text), ('token', $2::text))
), over AS (
    DELETE FROM sidecar_web_login_failures WHERE (scope, subject) IN (
        SELECT scope, subject FROM sidecar_web_login_failures
        WHERE (scope, subject) NOT IN (('source', $1::text), ('token', $2::text))
        ORDER BY coalesce(locked_until > now(), false) DESC, window_start DESC
        OFFSET greatest($6::int - 2, 0))
)
INSERT INTO sidecar_web_login_failures AS f (scope, subject, failures, locked_until)
VALUES ('source', $1::text, 1,
        CASE WHEN $4::int <= 1 THEN now() + make_interval(secs => $5::float8) END),
       ('token', $2::text, 1,
        CASE WHEN $4::int <= 1 THEN now() + make_interval(secs => $5::float8) END)
ON CONFLICT (scope, subject) DO UPDATE SET
    window_start = CASE WHEN f.window_start <= now() - make_interval(secs => $3::float8)
                             OR f.locked_until <= now() THEN now()
                        ELSE f.window_start END,
    failures = CASE WHEN f.window_start <= now() - make_interval(secs => $3::float8)
                         OR f.locked_until <= now() THEN 1
                    ELSE f.failures + 1 END,
    locked_until = CASE
        WHEN (CASE WHEN f.window_start <= now() - make_interval(secs => $3::float8)
                        OR f.locked_until <= now() THEN 1
                   ELSE f.failures + 1 END) = $4::int
            THEN now() + make_interval(secs => $5::float8)
        WHEN f.window_start <= now() - make_interval(secs => $3::float8)
             OR f.locked_until <= now() THEN NULL
        ELSE f.locked_until END
RETURNING scope, failures, failures = $4::int AS locked_now;

-- name: mcp_sessions_live
-- How many unexpired MCP sessions ($2: the idle timeout in seconds) the principal $1 has,
-- counted up to $3 + 1 (sidecar mcp's bound on a principal's sessions; issue 41).
SELECT count(*) FROM (
  SELECT 1 FROM sidecar_mcp_sessions
  WHERE principal = $1 AND last_seen_at >= now() - make_interval(secs => $2::float8)
  LIMIT $3::int + 1) AS found;

-- name: mcp_session_open
-- Record the MCP session $1 the principal $2 opened, and delete at most 100 sessions
-- unused for longer than $3 seconds. The id is a fresh random one: a conflict is not
-- skipped silently (case F22), it fails the statement.
WITH expired AS (
  DELETE FROM sidecar_mcp_sessions WHERE id IN (
    SELECT id FROM sidecar_mcp_sessions
    WHERE last_seen_at < now() - make_interval(secs => $3::float8)
    ORDER BY last_seen_at LIMIT 100)
)
INSERT INTO sidecar_mcp_sessions (id, principal) VALUES ($1, $2);

-- name: mcp_session_principal
-- The principal of the unexpired MCP session $1 ($2: the idle timeout in seconds), and
-- marks it used now; no row when there is no such session.
UPDATE sidecar_mcp_sessions SET last_seen_at = now()
WHERE id = $1 AND last_seen_at >= now() - make_interval(secs => $2::float8)
RETURNING principal;

-- name: mcp_session_close
-- The client ended its MCP session $1 (HTTP DELETE) with the token of principal $2.
DELETE FROM sidecar_mcp_sessions WHERE id = $1 AND principal = $2;
