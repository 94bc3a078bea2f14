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
          o.body::text AS body_text, o.attempts;

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
-- The receiver refused the result for good (409 stale_fence, or another 4xx).
WITH dead AS (
    UPDATE tool_job_outbox
    SET state = 'dead_lettered', finished_at = now(), lease_until = NULL, last_status = $3,
        last_error = $4
    WHERE id = $1 AND owner_id = $2 AND state = 'pending'
    RETURNING job_id, fencing_token, attempts
), rejected AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'effect_rejected',
           jsonb_build_object('status', $3::int, 'reason', $4::text, 'outbox_id', $1::bigint)
    FROM dead
), dead_lettered AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT job_id, fencing_token, 'forward_dead_lettered',
           jsonb_build_object('status', $3::int, 'reason', $4::text, 'outbox_id', $1::bigint,
                              'attempts', attempts)
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
       last_status, last_error, created_at, finished_at
FROM tool_job_outbox WHERE job_id = $1 ORDER BY id;

-- name: due_outbox_rows_of_tool
-- --drain also waits for results of its tool due for delivery within $2 seconds.
SELECT count(*) FROM tool_job_outbox
WHERE tool = $1 AND state = 'pending'
  AND next_attempt_at <= now() + $2::float8 * interval '1 second';
