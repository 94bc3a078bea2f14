-- Autovacuum on the hot table. tool_jobs keeps its finished jobs for the retention period,
-- so the server's default (vacuum once dead rows pass 20 % of the table) comes ever more
-- rarely as the table grows, while the part the claim reads, the queued and running rows
-- and their partial indexes, churns with every job: bench section 7 measured a claim on an
-- empty queue at 4.38 ms after 100,000 jobs against 0.08 ms once vacuumed. A vacuum after
-- 1,000 dead rows plus 1 % of the table keeps those indexes small; analyze follows at 2 %.
ALTER TABLE tool_jobs SET (
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_analyze_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);
-- The journal only grows, then loses its oldest rows to retention in batches.
ALTER TABLE tool_job_events SET (
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_scale_factor = 0.02
);

-- Wake-ups without a herd. A sidecar with room for a job and none to claim registers here
-- with a channel of its own (refreshing seen_at while it stays idle); whatever queues jobs
-- of a tool wakes at most that many idle sidecars of that tool, each on its own channel,
-- instead of one NOTIFY every idle sidecar of every tool answers with a claim.
CREATE TABLE tool_idle_sidecars (
    owner_id text PRIMARY KEY,
    tool     text NOT NULL,
    channel  text NOT NULL,
    seen_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tool_idle_sidecars_tool_idx ON tool_idle_sidecars (tool, seen_at);

-- The wake-up itself: tool_job_wake (sidecar/sql/functions/wake.sql).
