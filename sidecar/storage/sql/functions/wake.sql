-- Wake-ups without a herd (migration 008: tool_idle_sidecars).

-- Wake up to `jobs` idle sidecars of `wake_tool` (the longest idle first; registrations
-- not refreshed for two minutes belong to sidecars that died and are skipped); each is
-- taken off the list and gets one NOTIFY on its channel at commit. Returns how many.
--
-- Least privilege (issue 41, point 2; docs/operations.md "Roles and Secrets"): the wake
-- deletes rows of the idle list, which only the workers (who register there) may write.
-- A caller's enqueue and the web view's retry and resume wake through their own SECURITY
-- DEFINER functions, so this one also writes with its owner's rights (SECURITY DEFINER,
-- search_path pinned to its own schema with pg_temp last) and no role needs a write on
-- tool_idle_sidecars to wake. EXECUTE is taken from PUBLIC: the owner and the worker role
-- (every tool_job_* function) may call it directly. `jobs` is bounded: 0 to 1000.
CREATE OR REPLACE FUNCTION tool_job_wake(wake_tool text, jobs bigint) RETURNS bigint
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE sql VOLATILE AS $$
    WITH picked AS (
        DELETE FROM tool_idle_sidecars s
        WHERE s.owner_id IN (
            SELECT i.owner_id FROM tool_idle_sidecars i
            WHERE i.tool = wake_tool AND i.seen_at > now() - interval '2 minutes'
            ORDER BY i.seen_at
            LIMIT least(greatest(jobs, 0), 1000)
            FOR UPDATE SKIP LOCKED)
        RETURNING s.channel)
    SELECT count(*) FROM picked, LATERAL pg_notify(picked.channel, wake_tool)
$$;

REVOKE EXECUTE ON FUNCTION tool_job_wake(text, bigint) FROM PUBLIC;
