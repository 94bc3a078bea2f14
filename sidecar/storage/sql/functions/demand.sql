-- A tool's demand, for an autoscaler (k8s/base/scaledobject.yaml: KEDA's PostgreSQL
-- trigger runs SELECT tool_job_demand('ocr')): the jobs running under a live lease, so a
-- scaler does not take pods away from jobs still running, plus the jobs claims could take
-- now, one after another (issue 41, point 3): the jobs the claim's row rules admit
-- (claimable.sql tool_job_claimable: queued, due and not past their expiry, or under an
-- expired lease with an attempt left), per concurrency key no more than the key's room
-- (free slots under max_running_per_key, whole tokens of its rate), and for the tool no
-- more than its room (none while paused, free slots under max_running, whole tokens of
-- its rate). The limits are the claim's own functions (claimable.sql tool_flow_room), so
-- a backlog a limit holds starts no pods that would only wait; tests/test_demand.py
-- claims until nothing more is taken and finds the same count. Costs one read of the
-- tool's claimable jobs (grouped by key) and running ones; a tool with per-key limits
-- adds one or two index probes per key that has claimable jobs.
--
-- Least privilege for the scaler (docs/operations.md "Roles and Secrets"): KEDA's role is
-- given EXECUTE on tool_job_demand and nothing else, no SELECT on tool_jobs. So the
-- function reads the queue with its owner's rights (SECURITY DEFINER, the schema owner
-- that ran the migrations), under a search_path pinned to its own schema with pg_temp
-- last, so a caller cannot put a table or an operator of its own in front of the
-- function's. EXECUTE is taken from PUBLIC: only the owner and the roles `sidecar migrate
-- --scaler-role` names may call it. The workers never call it.
CREATE OR REPLACE FUNCTION tool_job_demand(wanted_tool text) RETURNS bigint
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE sql STABLE AS $$
    WITH flow AS (
        SELECT f FROM tool_flow f WHERE f.tool = wanted_tool
    ), by_key AS (
        SELECT j.concurrency_key AS key, count(*) AS claimable
        FROM tool_jobs j
        WHERE j.tool = wanted_tool AND tool_job_claimable(j, NULL)
        GROUP BY j.concurrency_key
    ), startable AS (
        -- a key's room is asked only when a per-key limit is set (one call per key)
        SELECT sum(CASE WHEN (f).max_running_per_key IS NULL
                             AND (f).key_rate_per_second IS NULL THEN b.claimable
                        ELSE least(b.claimable, tool_flow_room(f, b.key, now())) END) AS n
        FROM by_key b LEFT JOIN flow ON true
    )
    SELECT (SELECT count(*) FROM tool_jobs j
            WHERE j.tool = wanted_tool AND j.state = 'running' AND j.lease_until >= now())
         + least(coalesce((SELECT n FROM startable), 0),
                 tool_flow_room((SELECT f FROM flow), NULL, now()))::bigint
$$;

REVOKE EXECUTE ON FUNCTION tool_job_demand(text) FROM PUBLIC;
