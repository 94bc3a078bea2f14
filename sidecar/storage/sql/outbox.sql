-- Named statements of the result outbox (see migrations/003_outbox.sql).

-- name: claim_outbox_rows
-- Take up to $3 deliverable rows under a forwarding lease of $2 seconds.
UPDATE tool_job_outbox o
SET owner_id = $1, lease_until = now() + $2::float8 * interval '1 second',
    attempts = o.attempts + 1
WHERE o.id IN (
    SELECT id FROM tool_job_outbox
    WHERE state = 'pending' AND next_attempt_at <= now()
      AND (lease_until IS NULL OR lease_until < now())
    ORDER BY next_attempt_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED)
RETURNING o.id, o.job_id, o.tool, o.url, o.idempotency_key, o.fencing_token,
          o.body::text AS body_text, o.attempts,
          -- seconds since the row became pending, by the database's clock (case F21)
          extract(epoch FROM now() - o.pending_since)::float8 AS age_s;

-- name: outbox_delivered_if_owner
WITH delivered AS (
    UPDATE tool_job_outbox
    SET state = 'delivered', finished_at = now(), lease_until = NULL, last_status = $3,
        last_error = NULL
    WHERE id = $1 AND owner_id = $2 AND state = 'pending'
    RETURNING job_id, fencing_token, attempts
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'effect_forwarded',
           jsonb_build_object('status', $3::int, 'outbox_id', $1::bigint, 'attempts', attempts)
    FROM delivered
)
SELECT job_id FROM delivered;

-- name: outbox_dead_letter_if_owner
-- Delivery ends without a delivery ($5, the kind): 'refused' (409 stale_fence, or another
-- 4xx: also journaled as effect_rejected), 'redirect' (a 3xx, never a delivery; its
-- Location in $6), 'max_attempts' or 'max_age' (the profile's forwarding bounds, F21).
WITH dead AS (
    UPDATE tool_job_outbox
    SET state = 'dead_lettered', finished_at = now(), lease_until = NULL, last_status = $3,
        last_error = $4
    WHERE id = $1 AND owner_id = $2 AND state = 'pending'
    RETURNING job_id, fencing_token, attempts,
              extract(epoch FROM now() - pending_since)::float8 AS age_s
), rejected AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'effect_rejected',
           jsonb_build_object('status', $3::int, 'reason', $4::text, 'outbox_id', $1::bigint)
    FROM dead
    WHERE $5::text = 'refused'
), dead_lettered AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'forward_dead_lettered',
           jsonb_build_object('status', $3::int, 'reason', $4::text, 'outbox_id', $1::bigint,
                              'attempts', attempts, 'kind', $5::text,
                              'age_s', round(age_s::numeric, 3)) || $6::jsonb
    FROM dead
)
SELECT job_id FROM dead;

-- name: outbox_retry_later_if_owner
UPDATE tool_job_outbox
SET lease_until = NULL, next_attempt_at = now() + $3::float8 * interval '1 second',
    last_status = $4, last_error = $5
WHERE id = $1 AND owner_id = $2 AND state = 'pending'
RETURNING next_attempt_at;

-- name: outbox_of_job
SELECT id, url, idempotency_key, fencing_token, state, attempts, next_attempt_at,
       last_status, last_error, created_at, pending_since, finished_at
FROM tool_job_outbox WHERE job_id = $1 ORDER BY id;

-- name: outbox_redeliver
-- An operator's re-delivery (`sidecar retry --forwarding`): the job's dead-lettered rows
-- become pending again with fresh attempts and age; journaled as forward_redelivery.
WITH target AS (
    SELECT id FROM tool_job_outbox
    WHERE job_id = $1 AND state = 'dead_lettered'
    FOR UPDATE
), redone AS (
    UPDATE tool_job_outbox o
    SET state = 'pending', attempts = 0, next_attempt_at = now(), pending_since = now(),
        owner_id = NULL, lease_until = NULL, finished_at = NULL
    FROM target
    WHERE o.id = target.id
    RETURNING o.id, o.job_id, o.fencing_token, o.last_status, o.last_error
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'forward_redelivery',
           jsonb_build_object('outbox_id', id, 'previous_status', last_status,
                              'previous_error', last_error, 'by', $2::text)
    FROM redone
)
SELECT id FROM redone;

-- name: due_outbox_rows_of_tool
-- --drain also waits for results of its tool due for delivery within $2 seconds.
SELECT count(*) FROM tool_job_outbox
WHERE tool = $1 AND state = 'pending'
  AND next_attempt_at <= now() + $2::float8 * interval '1 second';
