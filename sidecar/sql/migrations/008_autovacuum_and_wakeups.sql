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

-- Wake up to `jobs` idle sidecars of `wake_tool` (the longest idle first; registrations
-- not refreshed for two minutes belong to sidecars that died and are skipped); each is
-- taken off the list and gets one NOTIFY on its channel at commit. Returns how many.
CREATE FUNCTION tool_job_wake(wake_tool text, jobs bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    WITH picked AS (
        DELETE FROM tool_idle_sidecars s
        WHERE s.owner_id IN (
            SELECT i.owner_id FROM tool_idle_sidecars i
            WHERE i.tool = wake_tool AND i.seen_at > now() - interval '2 minutes'
            ORDER BY i.seen_at
            LIMIT greatest(jobs, 0)
            FOR UPDATE SKIP LOCKED)
        RETURNING s.channel)
    SELECT count(*) FROM picked, LATERAL pg_notify(picked.channel, wake_tool)
$$;
