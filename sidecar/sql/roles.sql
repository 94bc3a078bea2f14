-- The grants of the two roles that do not own the schema (docs/operations.md, "Roles and
-- Secrets"), as statements for the schema owner to run: `sidecar migrate --worker-role
-- ROLE --scaler-role ROLE` runs them after migrating, so every release's migration Job
-- grants what its own migrations created. format()'s %I quotes the role and schema names;
-- the schema is the one the migrations just wrote to (current_schema()). Loaded by
-- sidecar/queries.py; run only from sidecar/store.py.

-- name: worker_grants
-- What a worker uses and nothing more: the queue's eight tables (rows only: no DDL, no
-- TRUNCATE, no REFERENCES or TRIGGER), the migration ledger read to check the schema, the
-- two sequences its inserts draw from, and the queue's own functions but tool_job_demand
-- (the scaler's), sidecar_enqueue included (migration 014: a producer may run as this
-- role). The fence_* tables belong to the reference receiver, not the workers. The flow
-- tables (migration 016) are read and written by every claim of a limited tool;
-- tool_sweeps (migration 017) by every sidecar's poll.
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %I.tool_jobs, %I.tool_job_events, '
              '%I.tool_job_outbox, %I.tool_idle_sidecars, %I.tool_flow, %I.tool_flow_keys, '
              '%I.tool_flow_events, %I.tool_sweeps TO %I', current_schema(),
              current_schema(), current_schema(), current_schema(), current_schema(),
              current_schema(), current_schema(), current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations TO %I', current_schema(),
              $1::text)
UNION ALL
SELECT format('GRANT USAGE ON SEQUENCE %s, %s TO %I',
              pg_get_serial_sequence(format('%I.tool_job_events', current_schema()), 'id'),
              pg_get_serial_sequence(format('%I.tool_job_outbox', current_schema()), 'id'),
              $1::text)
UNION ALL
(SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, $1::text)
 FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND (p.proname LIKE 'tool\_job\_%' OR p.proname LIKE 'tool\_flow\_%'
        OR p.proname = 'sidecar_enqueue')
   AND p.proname <> 'tool_job_demand'
 ORDER BY p.proname);

-- name: scaler_grants
-- KEDA's role: the schema's name lookup and the demand function (SECURITY DEFINER since
-- migration 013, so it needs no right on the tables it reads).
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT EXECUTE ON FUNCTION %I.tool_job_demand(text) TO %I', current_schema(),
              $1::text);
