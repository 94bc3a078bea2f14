-- The MCP edge (issue 41). tool_job_cancel (sidecar/sql/functions/cancel.sql) says
-- "cancelled by its MCP client" in the job's error when the gateway cancels for its
-- caller (p_by 'sidecar mcp (PRINCIPAL)'), "cancelled by an operator" otherwise.
-- compatible-from: 20

-- MCP sessions of the 2025 protocol revisions (issue 41, point 15), kept where every
-- gateway replica reads them: a session opened on one replica is served by any other, and
-- by the same one after a restart (sidecar.mcp.sessions). A row is a session id the
-- gateway handed out, the principal whose token opened it (any other principal's request
-- with that id is answered as for an unknown session) and when it was last used; a
-- session unused for the idle timeout is gone (deleted when the next one opens).
CREATE TABLE sidecar_mcp_sessions (
    id text PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 256),
    principal text NOT NULL CHECK (length(principal) BETWEEN 1 AND 256),
    created_at timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX sidecar_mcp_sessions_principal_idx
    ON sidecar_mcp_sessions (principal, last_seen_at);
CREATE INDEX sidecar_mcp_sessions_seen_idx ON sidecar_mcp_sessions (last_seen_at);
