-- Least privilege for the scaler (k8s/base/scaledobject.yaml, docs/operations.md "Roles
-- and Secrets"): KEDA's role is given EXECUTE on tool_job_demand and nothing else, no
-- SELECT on tool_jobs. So the function reads the queue with its owner's rights
-- (SECURITY DEFINER, the schema owner that ran the migrations), under a search_path
-- pinned to its own schema with pg_temp last, so a caller cannot put a table or an
-- operator of its own in front of the function's. EXECUTE is taken from PUBLIC: only
-- the owner and the roles `sidecar migrate --scaler-role` names may call it. The workers
-- never call it. A later CREATE OR REPLACE of the function resets SECURITY DEFINER and
-- the search_path (not the grants): it must say both again.
-- compatible-from: 12
DO $$
DECLARE
    home text := (SELECT n.nspname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                  WHERE p.oid = 'tool_job_demand(text)'::regprocedure);
BEGIN
    EXECUTE format('ALTER FUNCTION %I.tool_job_demand(text) SECURITY DEFINER '
                   'SET search_path = %I, pg_temp', home, home);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %I.tool_job_demand(text) FROM PUBLIC', home);
END
$$;
