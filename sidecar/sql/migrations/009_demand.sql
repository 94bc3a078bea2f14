-- A tool's demand, for an autoscaler (k8s/base/scaledobject.yaml: KEDA's PostgreSQL
-- trigger runs SELECT tool_job_demand('ocr')): the jobs a claim of the tool could take
-- now, by the claim's own rules (queued and due, or running under an expired lease with
-- attempts left; queries.sql claim_job), plus the jobs running under a live lease, so a
-- scaler counting only the backlog does not take pods away from jobs still running.
-- Each part reads the claim's partial indexes.
CREATE FUNCTION tool_job_demand(wanted_tool text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM tool_jobs
    WHERE tool = wanted_tool
      AND ((state = 'queued' AND run_after <= now())
           OR (state = 'running' AND (lease_until >= now() OR attempt < max_attempts)))
$$;
