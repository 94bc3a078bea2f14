-- Fenced side effects at the receiver (sidecar/fence.py, sidecar/receiver.py).
-- One transaction per request: lock the entity and compare tokens (P7), claim the
-- idempotency key (P17), run the handler on the same connection, record the
-- answer (P18). JSON goes in and out as text so any asyncpg pool works.

-- name: fence_set_lock_timeout
-- Sets lock_timeout until the end of the transaction; returns the value it replaced.
WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS value)
SELECT value, set_config('lock_timeout', $1, true) FROM previous;

-- name: fence_lock_entity
-- Takes the entity's row lock (creating the row) until the end of the transaction,
-- so the requests of one entity are decided one at a time. Returns the last
-- accepted fence, NULL when none yet. ON CONFLICT DO UPDATE waits for a
-- concurrent holder and then sees its committed row.
INSERT INTO fence_entities AS e (entity) VALUES ($1)
ON CONFLICT (entity) DO UPDATE SET entity = e.entity
RETURNING e.last_fence;

-- name: fence_claim_key
-- Claims an idempotency key; no row back means the key is already recorded. A
-- concurrent claim of the same key waits here until the first transaction ends.
INSERT INTO fence_requests (idempotency_key, entity, fence, body_sha256)
VALUES ($1, $2, $3, $4)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING true;

-- name: fence_stored_response
SELECT body_sha256, status, response::text AS response_text
FROM fence_requests
WHERE idempotency_key = $1;

-- name: fence_record_response
-- Stores the handler's answer for replay; a 2xx answer also advances the entity's
-- last accepted fence, never backwards.
WITH advanced AS (
    UPDATE fence_entities
    SET last_fence = greatest(last_fence, $3::bigint), updated_at = now()
    WHERE entity = $2 AND $4::integer BETWEEN 200 AND 299
)
UPDATE fence_requests
SET status = $4::integer, response = $5::text::json, recorded_at = now()
WHERE idempotency_key = $1;

-- name: fence_insert_effect
-- The reference receiver's effect, on the connection fence.py hands its handler.
INSERT INTO fence_effects (idempotency_key, entity, fence, body)
VALUES ($1, $2, $3, $4::text::jsonb)
RETURNING id;

-- name: fence_list_effects
SELECT id, idempotency_key, entity, fence, body, received_at
FROM fence_effects
WHERE $1::text IS NULL OR entity = $1
ORDER BY id;
