-- Result forwarding (transactional outbox). A fenced completion of a tool whose profile
-- sets RESULT_URL inserts one row here in the same statement; forwarders claim rows under
-- a lease of their own (SKIP LOCKED) and POST them until a 2xx, or dead-letter them.
CREATE TABLE tool_job_outbox (
    id              bigserial PRIMARY KEY,
    job_id          uuid NOT NULL,
    tool            text NOT NULL,
    url             text NOT NULL,
    idempotency_key text NOT NULL,
    fencing_token   bigint NOT NULL,
    body            jsonb NOT NULL,
    state           text NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'delivered', 'dead_lettered')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    owner_id        text,
    lease_until     timestamptz,
    last_status     integer,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE INDEX tool_job_outbox_pending_idx ON tool_job_outbox (next_attempt_at) WHERE state = 'pending';
CREATE INDEX tool_job_outbox_job_idx ON tool_job_outbox (job_id);
