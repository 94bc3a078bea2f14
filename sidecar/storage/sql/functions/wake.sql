-- Wake-ups without a herd (migration 008: tool_idle_sidecars).

-- Wake up to `jobs` idle sidecars of `wake_tool` (the longest idle first; registrations
-- not refreshed for two minutes belong to sidecars that died and are skipped); each is
-- taken off the list and gets one NOTIFY on its channel at commit. Returns how many.
CREATE OR REPLACE FUNCTION tool_job_wake(wake_tool text, jobs bigint) RETURNS bigint
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
