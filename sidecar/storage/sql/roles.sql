-- The grants of the roles that do not own the schema (docs/operations.md, "Roles and
-- Secrets"), as statements for the schema owner to run: `sidecar migrate --worker-role
-- ROLE --scaler-role ROLE --caller-role ROLE --web-role ROLE` runs them after migrating,
-- so every release's migration Job grants what its own migrations created. format()'s %I
-- quotes the role and schema names; the schema is the one the migrations just wrote to
-- (current_schema()). Loaded by sidecar/storage/queries.py; run only from
-- sidecar/storage/operator_store.py (grant_roles), which runs every role's *_revokes
-- first and then every role's *_grants, in one transaction: a role named twice (worker
-- and caller, say) ends with the rights of both.
--
-- Least privilege (issue 41, point 2): a role reaches the queue's rows only through what
-- its documented work needs. Where a function checks what is written (enqueue, cancel,
-- retry, pause, resume, wake), the roles that are not trusted with the rows (callers, the
-- web view) get EXECUTE on the function (SECURITY DEFINER, pinned search_path) and no
-- write on the tables it writes, so no direct write goes around its checks. The *_revokes
-- take back what earlier releases of this command granted and this one does not.

-- name: worker_revokes
-- What earlier releases granted the workers and they never use: UPDATE of the two
-- journals (tool_job_events, tool_flow_events: rows are added and pruned, never
-- rewritten) and DELETE of flow rows (a tool's limits and pause are the operator's).
SELECT format('REVOKE UPDATE ON TABLE %I.tool_job_events, %I.tool_flow_events FROM %I',
              current_schema(), current_schema(), $1::text)
UNION ALL
SELECT format('REVOKE DELETE ON TABLE %I.tool_flow FROM %I', current_schema(), $1::text);

-- name: worker_grants
-- What a worker uses and nothing more: the queue's eight tables (rows only: no DDL, no
-- TRUNCATE, no REFERENCES or TRIGGER; the journals append-only but for the retention's
-- deletes, no DELETE of a flow row; a sweep's turn is deleted by the retention's `sweeps`
-- kind once no sidecar samples its tool), the migration ledgers read to check
-- the schema, the two sequences its inserts draw from, and the queue's own functions but
-- tool_job_demand (the scaler's), sidecar_enqueue included (migration 014: a producer may
-- run as this role). The workers are trusted with the rows: the lease protocol is their
-- UPDATEs (claims, heartbeats, fenced ends), next stages their INSERTs, the retention
-- their DELETEs. The fence_* tables belong to the reference receiver, not the workers. The
-- flow tables (migration 016) are read and written by every claim of a limited tool;
-- tool_sweeps (migration 017) by every sidecar's poll; tool_sessions (migration 026) by
-- the sidecars that hold agent sessions, and its ended rows deleted by the retention;
-- tool_dedupe (migration 027) by each sidecar as it starts (its profile's DEDUPE).
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %I.tool_jobs, '
              '%I.tool_job_outbox, %I.tool_idle_sidecars, %I.tool_flow_keys TO %I',
              current_schema(), current_schema(), current_schema(), current_schema(),
              $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, DELETE ON TABLE %I.tool_job_events, '
              '%I.tool_flow_events TO %I', current_schema(), current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, UPDATE ON TABLE %I.tool_flow, %I.tool_dedupe TO %I',
              current_schema(), current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %I.tool_sweeps, '
              '%I.tool_sessions, %I.tool_approvals TO %I', current_schema(), current_schema(),
              current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations, '
              '%I.sidecar_schema_repeatables TO %I', current_schema(), current_schema(),
              $1::text)
UNION ALL
-- callers' interests (migration 029): read by the claim's rules, their ended rows deleted
-- by the retention; held and lapsed only through the definer functions
SELECT format('GRANT SELECT, DELETE ON TABLE %I.tool_interests TO %I', current_schema(),
              $1::text)
UNION ALL
SELECT format('GRANT USAGE ON SEQUENCE %s, %s, %I.tool_jobs_session_seq TO %I',
              pg_get_serial_sequence(format('%I.tool_job_events', current_schema()), 'id'),
              pg_get_serial_sequence(format('%I.tool_job_outbox', current_schema()), 'id'),
              current_schema(), $1::text)
UNION ALL
(SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, $1::text)
 FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND (p.proname LIKE 'tool\_job\_%' OR p.proname LIKE 'tool\_flow\_%'
        OR p.proname = 'sidecar_enqueue')
   AND p.proname <> 'tool_job_demand'
 ORDER BY p.oid::regprocedure::text);

-- name: scaler_grants
-- KEDA's role: the schema's name lookup and the demand function (SECURITY DEFINER since
-- migration 013, so it needs no right on the tables it reads).
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT EXECUTE ON FUNCTION %I.tool_job_demand(text) TO %I', current_schema(),
              $1::text);

-- name: caller_revokes
-- Every write on the queue's rows, and what earlier releases granted for the writes the
-- definer functions now make (issue 29's INSERT of a queued job and of its journal row,
-- the idle list tool_job_wake takes a sidecar off, the flow row a keyed job gives its
-- tool, the journal's sequence, EXECUTE on tool_job_wake and tool_job_new_id).
SELECT format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON TABLE '
              '%I.tool_jobs, %I.tool_job_events, %I.tool_job_outbox, %I.tool_idle_sidecars, '
              '%I.tool_flow, %I.tool_flow_keys, %I.tool_flow_events, %I.tool_sweeps FROM %I',
              current_schema(), current_schema(), current_schema(), current_schema(),
              current_schema(), current_schema(), current_schema(), current_schema(),
              $1::text)
UNION ALL
SELECT format('REVOKE SELECT ON TABLE %I.tool_idle_sidecars, %I.tool_flow FROM %I',
              current_schema(), current_schema(), $1::text)
UNION ALL
SELECT format('REVOKE USAGE ON SEQUENCE %s FROM %I',
              pg_get_serial_sequence(format('%I.tool_job_events', current_schema()), 'id'),
              $1::text)
UNION ALL
SELECT format('REVOKE EXECUTE ON FUNCTION %I.tool_job_wake(text, bigint), '
              '%I.tool_job_new_id() FROM %I', current_schema(), current_schema(), $1::text);

-- name: caller_grants
-- A caller's role (the MCP gateway's, `sidecar mcp`; any producer that only enqueues,
-- waits, reads and cancels through sidecar.client, the CLI or sidecar_enqueue): the
-- migration ledgers read when a client opens; the job rows read (waiting reads the job's
-- row and progress, get reads all of it, the gateway counts a principal's unfinished
-- jobs); and EXECUTE on the three functions that write for it, each SECURITY DEFINER and
-- checking its inputs: tool_job_enqueue (and sidecar_enqueue, which calls it in the
-- caller's own transaction) inserts a queued job, journals it and wakes a sidecar;
-- tool_job_cancel cancels; tool_job_expire settles a job a read finds past its expiry
-- (issue 41, point 13); tool_job_wait_reasons tells a waiter why its job waits (issue
-- 41, point 4; the owner's rights: the caller reads neither the flow nor the sweeps). No write on any queue table (issue 41, point 2; its MCP
-- sessions are its own rows): not a job inserted around the enqueue's checks, not a
-- journal row, not the idle list or a flow row. Not the journal's reads, the outbox, the
-- sweeps, the fence_* tables, the demand function or the claim functions.
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations, '
              '%I.sidecar_schema_repeatables, %I.tool_jobs, %I.tool_approvals TO %I',
              current_schema(), current_schema(), current_schema(), current_schema(),
              $1::text)
UNION ALL
-- The MCP gateway's sessions, shared by its replicas (issue 41, point 15; migration 024):
-- open, look up (and mark used), close, and delete the expired ones.
SELECT format('GRANT SELECT, INSERT, UPDATE (last_seen_at), DELETE ON TABLE '
              '%I.sidecar_mcp_sessions TO %I', current_schema(), $1::text)
UNION ALL
(SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, $1::text)
 FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND p.proname IN ('tool_job_enqueue', 'sidecar_enqueue', 'tool_job_cancel',
                     'tool_job_expire', 'tool_job_wait_reasons', 'tool_job_interest_hold',
                     'tool_job_interest_lapse', 'tool_job_approval_answer')
 ORDER BY p.oid::regprocedure::text);

-- name: web_grants
-- The web view's role (`sidecar web`, issue 30; issue 41, point 2): reads of what its
-- pages show (the jobs, their journal and forwarding rows, the tools' flow rows, the idle
-- list it counts sidecars from, the agent sessions) and the migration ledgers (its schema check); its admin
-- actions only through SECURITY DEFINER functions that check their inputs:
-- tool_job_cancel, tool_job_retry, tool_flow_pause and tool_flow_resume (and
-- tool_job_expire: a job page settles a job past its expiry). No write on any
-- table of the queue, no claim, no limits (`sidecar limit` is the owner's or the worker
-- role's), not the fence_* tables or the demand.
-- Its logins (issue 41, point 5; migration 025): the sessions and failed-login windows are
-- rows every replica reads and writes (SELECT, INSERT, UPDATE, DELETE on those two only).
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), $1::text)
UNION ALL
SELECT format('GRANT SELECT ON TABLE %I.sidecar_schema_migrations, '
              '%I.sidecar_schema_repeatables, %I.tool_jobs, %I.tool_job_events, '
              '%I.tool_job_outbox, %I.tool_flow, %I.tool_idle_sidecars, %I.tool_sessions, '
              '%I.tool_interests, %I.tool_approvals TO %I', current_schema(), current_schema(),
              current_schema(), current_schema(), current_schema(), current_schema(),
              current_schema(), current_schema(), current_schema(), current_schema(),
              $1::text)
UNION ALL
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE %I.sidecar_web_sessions, '
              '%I.sidecar_web_login_failures TO %I', current_schema(), current_schema(),
              $1::text)
UNION ALL
(SELECT format('GRANT EXECUTE ON FUNCTION %s TO %I', p.oid::regprocedure, $1::text)
 FROM pg_proc p
 WHERE p.pronamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
   AND p.proname IN ('tool_job_cancel', 'tool_job_retry', 'tool_job_approval_answer',
                     'tool_flow_pause',
                     'tool_flow_resume', 'tool_job_expire')
 ORDER BY p.oid::regprocedure::text);
