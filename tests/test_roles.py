"""The three database roles of a deployment (docs/operations.md, "Roles and Secrets"): the
schema owner migrates and, with `sidecar migrate --worker-role W --scaler-role K`, grants
the worker role exactly the documented worker privileges and the scaler role EXECUTE on
tool_job_demand alone. On a real PostgreSQL: the worker runs a job end to end and every
command it needs, and can neither change the schema nor read what is not the queue's; the
scaler reads the demand and nothing else (issue 25, point 5)."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from kit import base_env, cli, enqueue, job_row, query, run, scalar

# The worker's privileges as docs/operations.md lists them: (kind, object, privileges).
WORKER_PRIVILEGES = {
    ("schema", "public", "USAGE"),
    *(("table", t, p) for t in ("tool_jobs", "tool_job_outbox", "tool_idle_sidecars",
                                "tool_flow_keys", "tool_sweeps", "tool_sessions",
                                "tool_approvals")
      for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    # the journals are appended and pruned, never rewritten (issue 41, point 2)
    *(("table", t, p) for t in ("tool_job_events", "tool_flow_events")
      for p in ("SELECT", "INSERT", "DELETE")),
    *(("table", t, p) for t in ("tool_flow", "tool_dedupe")
      for p in ("SELECT", "INSERT", "UPDATE")),
    ("table", "sidecar_schema_migrations", "SELECT"),
    ("table", "sidecar_schema_repeatables", "SELECT"),
    ("table", "tool_interests", "SELECT"),
    ("table", "tool_interests", "DELETE"),
    ("sequence", "tool_job_events_id_seq", "USAGE"),
    ("sequence", "tool_job_outbox_id_seq", "USAGE"),
    ("sequence", "tool_jobs_session_seq", "USAGE"),
    ("function", "tool_job_channel", "EXECUTE"),
    ("function", "tool_job_expiry_refunded", "EXECUTE"),
    ("function", "tool_job_journal_rows", "EXECUTE"),
    ("function", "tool_job_notify_end", "EXECUTE"),
    ("function", "tool_job_still_needed", "EXECUTE"),
    ("function", "tool_job_prunable", "EXECUTE"),
    ("function", "tool_job_wake", "EXECUTE"),
    ("function", "tool_job_enqueue", "EXECUTE"),
    ("function", "tool_job_dedupe_window", "EXECUTE"),
    ("function", "tool_job_key_freeable", "EXECUTE"),
    ("function", "tool_job_free_key", "EXECUTE"),
    ("function", "tool_job_key_freed_at_end", "EXECUTE"),
    ("function", "tool_job_interest_check_key", "EXECUTE"),
    ("function", "tool_job_interest_hold", "EXECUTE"),
    ("function", "tool_job_interest_lapse", "EXECUTE"),
    ("function", "tool_job_interest_requeued", "EXECUTE"),
    ("function", "tool_job_approval_answer", "EXECUTE"),
    ("function", "tool_job_park", "EXECUTE"),
    ("function", "tool_job_keyed_flow", "EXECUTE"),
    ("function", "tool_job_slot_freed", "EXECUTE"),
    ("function", "tool_job_claim_flow", "EXECUTE"),
    ("function", "tool_job_claim_flow_many", "EXECUTE"),
    ("function", "tool_job_new_id", "EXECUTE"),
    ("function", "tool_job_payload_ceiling", "EXECUTE"),
    ("function", "tool_job_cancel", "EXECUTE"),
    ("function", "tool_job_check_actor", "EXECUTE"),
    ("function", "tool_job_retry", "EXECUTE"),
    ("function", "tool_flow_pause", "EXECUTE"),
    ("function", "tool_flow_resume", "EXECUTE"),
    ("function", "tool_job_queued_due", "EXECUTE"),
    ("function", "tool_job_attempt_left", "EXECUTE"),
    ("function", "tool_job_lease_retakeable", "EXECUTE"),
    ("function", "tool_job_claimable", "EXECUTE"),
    ("function", "tool_flow_slots", "EXECUTE"),
    ("function", "tool_flow_tokens", "EXECUTE"),
    ("function", "tool_flow_bucket_size", "EXECUTE"),
    ("function", "tool_flow_room", "EXECUTE"),
    ("function", "tool_job_tell_owner", "EXECUTE"),
    ("function", "tool_job_expire", "EXECUTE"),
    ("function", "tool_job_wait_reasons", "EXECUTE"),
    ("function", "tool_flow_key_blocked", "EXECUTE"),
    ("function", "tool_flow_key_wait", "EXECUTE"),
    ("function", "tool_flow_occupied", "EXECUTE"),
    ("function", "tool_flow_bucket_changed", "EXECUTE"),
    ("function", "tool_flow_held", "EXECUTE"),
    ("function", "sidecar_enqueue", "EXECUTE"),
    ("function", "tool_job_session_free", "EXECUTE"),
    ("function", "tool_job_session_begin", "EXECUTE"),
    ("function", "tool_job_session_order", "EXECUTE"),
}
SCALER_PRIVILEGES = {("schema", "public", "USAGE"), ("function", "tool_job_demand", "EXECUTE")}

# Every privilege granted to one role by name (not through PUBLIC) in the database.
GRANTED_TO = """
SELECT 'schema' AS kind, n.nspname AS name, a.privilege_type AS privilege
  FROM pg_namespace n, aclexplode(n.nspacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT CASE c.relkind WHEN 'S' THEN 'sequence' ELSE 'table' END, c.relname, a.privilege_type
  FROM pg_class c, aclexplode(c.relacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT 'function', p.proname, a.privilege_type
  FROM pg_proc p, aclexplode(p.proacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT 'database', d.datname, a.privilege_type
  FROM pg_database d, aclexplode(d.datacl) a WHERE a.grantee = $1::regrole
"""


def _as(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@pytest.fixture
def roles(dsn):
    """A worker and a scaler login role of our own, granted by the shipped command run as
    the schema owner (the test's server user), dropped afterwards."""
    suffix = uuid.uuid4().hex[:10]
    worker, scaler = f"sidecar_w_{suffix}", f"sidecar_k_{suffix}"
    for name in (worker, scaler):
        query(dsn, f'CREATE ROLE "{name}" LOGIN')
    # PostgreSQL 15 and later already keep PUBLIC from creating in schema public; older
    # servers need this once (docs/operations.md says so).
    query(dsn, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    done = cli(dsn, "migrate", "--worker-role", worker, "--scaler-role", scaler)
    assert done.returncode == 0, done.stderr.decode()
    try:
        yield worker, scaler
    finally:
        for name in (worker, scaler):
            query(dsn, f'DROP OWNED BY "{name}"')
            query(dsn, f'DROP ROLE "{name}"')


def _granted(dsn: str, role: str) -> set[tuple[str, str, str]]:
    return {tuple(row) for row in query(dsn, GRANTED_TO, role)}


@pytest.mark.e2e
@pytest.mark.server
def test_the_shipped_grants_are_exactly_the_documented_ones(dsn, roles):
    worker, scaler = roles
    assert _granted(dsn, worker) == WORKER_PRIVILEGES
    assert _granted(dsn, scaler) == SCALER_PRIVILEGES
    # Granting again (the migration Job of the next release) changes nothing.
    again = cli(dsn, "migrate", "--worker-role", worker, "--scaler-role", scaler)
    assert again.returncode == 0, again.stderr.decode()
    assert _granted(dsn, worker) == WORKER_PRIVILEGES


@pytest.mark.e2e
@pytest.mark.server
def test_a_worker_runs_a_job_end_to_end_with_the_worker_grants(dsn, roles):
    worker = _as(dsn, roles[0])
    env = base_env(worker)
    job = enqueue(worker, "cat", {"n": 1}, env=env)
    done = cli(worker, "run", "--drain", "--", "cat", env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    row = job_row(dsn, job)
    assert row["state"] == "succeeded" and row["result"] == {"n": 1}
    for args in (["show", job], ["events", job], ["jobs"], ["prune", "--older-than", "1"],
                 ["retry", "--tool", "cat"]):
        assert cli(worker, *args, env=env).returncode == 0, args
    doomed = enqueue(worker, "cat", {"n": 2}, env=env)
    assert cli(worker, "cancel", doomed, env=env).returncode == 0
    # A producer may run as the worker role: the SQL function too (migration 014).
    from_sql = scalar(worker, "SELECT sidecar_enqueue('cat', '{\"n\": 3}', tags => "
                              "'{\"run\": \"r1\"}')")
    assert job_row(dsn, from_sql)["tags"] == {"run": "r1"}
    assert cli(worker, "cancel", "--tag", "run=r1", env=env).returncode == 0


def _refused(dsn: str, sql: str) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        query(dsn, sql)


@pytest.mark.e2e
@pytest.mark.server
def test_a_worker_can_neither_change_the_schema_nor_read_beyond_the_queue(dsn, roles):
    query(dsn, "CREATE SCHEMA other")
    query(dsn, "CREATE TABLE other.accounts (password text)")
    query(dsn, "CREATE TABLE public.app_secrets (password text)")
    worker = _as(dsn, roles[0])
    for sql in ("CREATE TABLE public.mine (x int)",
                "CREATE SCHEMA mine",
                "CREATE FUNCTION public.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
                "ALTER TABLE tool_jobs ADD COLUMN x int",
                "DROP TABLE tool_job_events",
                "CREATE INDEX ON tool_jobs (tool)",
                "TRUNCATE tool_jobs",
                "INSERT INTO sidecar_schema_migrations (version, name) VALUES (999, 'x')",
                "SELECT * FROM other.accounts",
                "SELECT * FROM public.app_secrets",
                "SELECT * FROM fence_effects",
                "SELECT tool_job_demand('cat')"):
        _refused(worker, sql)
    assert scalar(worker, "SELECT count(*) FROM tool_jobs") == 0  # and it does read its own


@pytest.mark.e2e
@pytest.mark.server
def test_the_scaler_can_only_call_the_demand_function(dsn, roles):
    scaler = _as(dsn, roles[1])
    enqueue(dsn, "ocr", {})
    assert scalar(scaler, "SELECT tool_job_demand('ocr')") == 1
    for table in ("tool_jobs", "tool_job_events", "tool_job_outbox", "tool_idle_sidecars",
                  "sidecar_schema_migrations", "fence_effects"):
        _refused(scaler, f"SELECT * FROM {table}")
    _refused(scaler, "UPDATE tool_jobs SET state = 'cancelled'")
    _refused(scaler, "SELECT tool_job_wake('ocr', 1)")  # PUBLIC's EXECUTE, no table rights
    _refused(scaler, "CREATE TABLE public.mine (x int)")
    # Its search_path cannot put a table of its own before the function's (migration 013).
    async def shadowed():
        conn = await asyncpg.connect(scaler)
        try:
            await conn.execute("CREATE TEMP TABLE tool_jobs (tool text)")  # pg_temp: allowed
            await conn.execute("INSERT INTO tool_jobs SELECT 'ocr' FROM generate_series(1, 5)")
            await conn.execute("SET search_path = pg_temp, public")
            return await conn.fetchval("SELECT tool_job_demand('ocr')")
        finally:
            await conn.close()

    assert run(shadowed()) == 1


@pytest.mark.database
def test_only_the_owner_and_the_granted_scaler_may_call_the_demand_function(dsn):
    role = f"sidecar_x_{uuid.uuid4().hex[:10]}"
    query(dsn, f'CREATE ROLE "{role}" LOGIN')
    try:
        query(dsn, f'GRANT USAGE ON SCHEMA public TO "{role}"')
        query(dsn, f'GRANT SELECT ON tool_jobs TO "{role}"')
        _refused(_as(dsn, role), "SELECT tool_job_demand('ocr')")  # no EXECUTE by PUBLIC
    finally:
        query(dsn, f'DROP OWNED BY "{role}"')
        query(dsn, f'DROP ROLE "{role}"')


@pytest.mark.e2e
@pytest.mark.server
def test_a_worker_on_an_older_schema_exits_instead_of_migrating_it(dsn, roles):
    """The workers' role cannot apply a migration: on a schema older than its release a
    worker stops at start (its pod restarts until the migration Job has run), and the
    schema is left as it was for the owner to migrate."""
    latest = scalar(dsn, "SELECT max(version) FROM sidecar_schema_migrations")
    previous = scalar(dsn, "SELECT max(version) FROM sidecar_schema_migrations "
                           "WHERE version < $1", latest)  # versions may skip a number
    query(dsn, "DELETE FROM sidecar_schema_migrations WHERE version = $1", latest)
    worker = _as(dsn, roles[0])
    done = cli(worker, "run", "--drain", "--", "cat", env=base_env(worker))
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    assert "permission denied" in done.stderr.decode() or \
        "must be owner" in done.stderr.decode(), done.stderr.decode()[-2000:]
    assert scalar(dsn, "SELECT max(version) FROM sidecar_schema_migrations") == previous
