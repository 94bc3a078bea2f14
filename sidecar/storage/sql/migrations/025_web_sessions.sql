-- The web view's sessions and failed logins (issue 41, point 5), in the database so that a
-- session outlives the process that made it and works on every replica of `sidecar web`,
-- and a lockout holds on all of them.
--
-- sidecar_web_sessions: one row per logged-in browser. The cookie's key is never stored,
-- only its sha256 (a copy of the table logs nobody in); the CSRF token its forms carry;
-- when it ends. Bounded by `sidecar web` at each login: expired rows deleted, at most
-- sidecar.ops.web.MAX_SESSIONS_PER_PRINCIPAL per principal and MAX_SESSIONS in all (the
-- oldest go first). Logging out deletes the row.
--
-- sidecar_web_login_failures: failed logins (a token that is none of the token file's, on
-- the login form or as a bearer token) counted per source address ('source') and per
-- sha256 of the token presented ('token') in a window that starts at the first failure;
-- LOGIN_FAILURES_ALLOWED of them lock that source or that token until locked_until.
-- Bounded too: rows whose window and lock are over are deleted at each failure, and at
-- most MAX_FAILURE_ROWS are kept (the oldest unlocked go first).
--
-- No function reads them: `sidecar web` runs the named queries web_session_* and
-- web_login_* of queries.sql (SELECT, INSERT, UPDATE, DELETE on both tables).
-- compatible-from: 20
CREATE TABLE sidecar_web_sessions (
    key_sha256 bytea PRIMARY KEY CHECK (octet_length(key_sha256) = 32),
    principal text NOT NULL CHECK (length(principal) BETWEEN 1 AND 200),
    csrf text NOT NULL CHECK (length(csrf) BETWEEN 32 AND 100),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE INDEX sidecar_web_sessions_principal_idx ON sidecar_web_sessions (principal, created_at);
CREATE INDEX sidecar_web_sessions_created_idx ON sidecar_web_sessions (created_at);

CREATE TABLE sidecar_web_login_failures (
    scope text NOT NULL CHECK (scope IN ('source', 'token')),
    subject text NOT NULL CHECK (length(subject) BETWEEN 1 AND 100),
    window_start timestamptz NOT NULL DEFAULT now(),
    failures integer NOT NULL CHECK (failures >= 1),
    locked_until timestamptz,
    PRIMARY KEY (scope, subject)
);
CREATE INDEX sidecar_web_login_failures_window_idx
    ON sidecar_web_login_failures (window_start);
