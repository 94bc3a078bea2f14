-- The grants of the two roles that do not own the schema (docs/operations.md, "Roles and
-- Secrets"), as statements for the schema owner to run: `sidecar migrate --worker-role
-- ROLE --scaler-role ROLE` runs them after migrating, so every release's migration Job
-- grants what its own migrations created. format()'s %I quotes the role and schema names;
-- the schema is the one the migrations just wrote to (current_schema()). Loaded by
-- sidecar/queries.py; run only from sidecar/store.py.

-- name: worker_grants
-- What a worker uses and nothing more: the queue's eight tables (rows only: no DDL, no
-- TRUNCATE, no REFERENCES or TRIGGER), the migration ledgers read to check the schema, the
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
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations, '
              '%I.sidecar_schema_repeatables TO %I', current_schema(), current_schema(),
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

-- name: caller_grants
-- A caller's role (the MCP gateway's, `sidecar mcp`; any producer that only enqueues,
-- waits, reads and cancels through sidecar.client or the CLI), found by running those
-- calls as a role with nothing and granting what each refusal named (tests/test_roles.py):
-- the migration ledgers read when a client opens; the job rows read (waiting reads the
-- job's row and progress, get reads all of it); an INSERT of only the columns
-- tool_job_enqueue writes (no state, owner, lease, token or attempt: a job it inserts is
-- queued, not claimed), the enqueue journal row and its sequence; the idle sidecars' list
-- that tool_job_wake takes a sidecar off (read and DELETE); the flow row a job with a
-- concurrency key gives its tool (migration 016's trigger; INSERT of tool and updated_by);
-- and EXECUTE on the functions it calls. No UPDATE or DELETE on tool_jobs: a cancel is
-- tool_job_cancel (migration 018, the owner's rights); why a waited job waits is
-- tool_job_wait_reasons (migration 023, the owner's rights). Not the journal's reads, the
-- outbox, the sweeps, the fence_* tables, the demand function or the claim functions.
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations, '
              '%I.sidecar_schema_repeatables TO %I', current_schema(), current_schema(),
              $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT (id, tool, idempotency_key, payload, max_attempts, '
              'priority, run_after, expires_at, tags, traceparent, tracestate, '
              'concurrency_key) ON TABLE %I.tool_jobs TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT INSERT (job_id, fencing_token, event, details) ON TABLE '
              '%I.tool_job_events TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT USAGE ON SEQUENCE %s TO %I',
              pg_get_serial_sequence(format('%I.tool_job_events', current_schema()), 'id'),
              $1::text)
UNION ALL
SELECT format('GRANT SELECT, UPDATE (seen_at), DELETE ON TABLE %I.tool_idle_sidecars TO %I',
              current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT (tool), INSERT (tool, updated_by) ON TABLE %I.tool_flow TO %I',
              current_schema(), $1::text)
UNION ALL
(SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, $1::text)
 FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND p.proname IN ('tool_job_enqueue', 'sidecar_enqueue', 'tool_job_new_id',
                     'tool_job_wake', 'tool_job_cancel', 'tool_job_wait_reasons')
 ORDER BY p.proname);
