-- The receiver side of fenced side effects (sidecar/fence.py): per entity the last
-- fencing token accepted (P7), per idempotency key the answer given (P17), both
-- written in the transaction that carries the effect itself (P18).
CREATE TABLE fence_entities (
    entity     text PRIMARY KEY,
    -- Highest token accepted with a 2xx answer; NULL until one is accepted.
    last_fence bigint,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE fence_requests (
    idempotency_key text PRIMARY KEY,
    entity          text NOT NULL,
    fence           bigint NOT NULL,
    body_sha256     text NOT NULL,
    -- Set by the transaction that inserts the row, so never NULL once committed.
    status          integer,
    response        json,           -- json, not jsonb: replays keep the key order
    recorded_at     timestamptz NOT NULL DEFAULT now()
);

-- What the reference receiver (`sidecar receiver`) accepted: one row per effect.
CREATE TABLE fence_effects (
    id              bigserial PRIMARY KEY,
    idempotency_key text NOT NULL,
    entity          text NOT NULL,
    fence           bigint NOT NULL,
    body            jsonb,
    received_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX fence_effects_entity_idx ON fence_effects (entity, id);
