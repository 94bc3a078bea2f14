-- A tool's demand, for an autoscaler (k8s/base/scaledobject.yaml: KEDA's PostgreSQL
-- trigger runs SELECT tool_job_demand('ocr')): the jobs a claim of the tool could take
-- now, by the claim's own rules (queued and due, or running under an expired lease with
-- attempts left or given back; queries.sql claim_job), plus the jobs running under a live
-- lease, so a scaler counting only the backlog does not take pods away from jobs still
-- running. Each part reads the claim's partial indexes. Only what may run counts: a
-- paused tool wants no more than its jobs running now, a capped one no more than
-- max_running; the rest of the backlog would only start pods that wait. (Per-key caps are
-- not counted: the keys' turns need the claim's walk.)
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
    WITH wanted AS (
        SELECT count(*) FILTER (WHERE j.state = 'running' AND j.lease_until >= now())
                   AS running,
               count(*) AS claimable
        FROM tool_jobs j
        WHERE j.tool = wanted_tool
          AND ((j.state = 'queued' AND j.run_after <= now())
               OR (j.state = 'running' AND (j.lease_until >= now()
                                            OR j.attempt < j.max_attempts
                                            OR tool_job_expiry_refunded(j))))
    )
    SELECT CASE WHEN f.paused_at IS NOT NULL THEN w.running
                ELSE least(w.claimable, coalesce(f.max_running, w.claimable)) END
    FROM wanted w LEFT JOIN tool_flow f ON f.tool = wanted_tool
$$;

REVOKE EXECUTE ON FUNCTION tool_job_demand(text) FROM PUBLIC;
