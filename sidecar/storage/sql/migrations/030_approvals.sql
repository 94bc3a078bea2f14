-- Approvals (issue 44, point 1; docs/side-effects.md "Approval"): a tool asks a person
-- "may I?" before an irreversible step, through the guard. The request is bound to the
-- attempt that asked (job, attempt, fencing token): an answer names all three, and one
-- for an attempt that no longer owns the job, for a request already answered or past its
-- deadline, is refused and journaled (functions/approvals.sql).
CREATE TABLE tool_approvals (
    id            uuid PRIMARY KEY,
    job_id        uuid NOT NULL REFERENCES tool_jobs (id) ON DELETE CASCADE,
    attempt       integer NOT NULL,
    fencing_token bigint NOT NULL,
    action        text NOT NULL CHECK (length(action) BETWEEN 1 AND 64),
    summary       text NOT NULL CHECK (length(summary) BETWEEN 1 AND 200),
    details       jsonb NOT NULL DEFAULT '{}'::jsonb,
    state         text NOT NULL DEFAULT 'pending'
                  CHECK (state IN ('pending', 'approved', 'denied', 'expired')),
    asked_at      timestamptz NOT NULL DEFAULT now(),
    deadline      timestamptz NOT NULL,
    answered_at   timestamptz,
    answered_by   text,
    reason        text
);
-- At most one open request per job; the open ones by deadline (the guard's wait, the web).
CREATE UNIQUE INDEX tool_approvals_pending_idx ON tool_approvals (job_id)
    WHERE state = 'pending';
CREATE INDEX tool_approvals_job_idx ON tool_approvals (job_id, asked_at);
