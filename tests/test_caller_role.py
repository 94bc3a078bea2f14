"""The callers' database role (issue 29, point 6; docs/operations.md, "Roles and
Secrets"): `sidecar migrate --caller-role C`, run as the schema owner, grants exactly the
documented privileges. On a real PostgreSQL with a real sidecar, a sidecar.client.Client
and the MCP gateway connected as that role enqueue, wait (LISTEN and the job's row and
progress), get and cancel; the same role is refused DDL, DELETE or UPDATE of jobs (leases,
states, claims), any INSERT of a job or a journal row around tool_job_enqueue (issue 41,
point 2), the idle list and the flow rows, the journal's and the outbox's rows, the
fence_* tables, the demand and the schema ledger's writes."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import httpx2
import pytest
from test_mcp_gateway import ALICE, Gateway, _gateway_env
from test_mcp_wire import _call, _initialize
from test_roles import _as

from kit import TOOLS, base_env, cli, job_row, pid_alive, query, read_pids, wait_until
from sidecar.client import Client, JobEnd, JobFailed, JobProgress
from sidecar.storage.worker_store import WorkerStore

pytestmark = [pytest.mark.e2e, pytest.mark.server]

TOOL = "pt"
COMMAND = [str(TOOLS / "progress_tool.py")]

# The caller's privileges as docs/operations.md lists them: (kind, object, privilege);
# a column's object is "table.column". No write on any table (issue 41, point 2): the
# enqueue and the cancel are SECURITY DEFINER functions that check their inputs.
CALLER_PRIVILEGES = {
    ("schema", "public", "USAGE"),
    ("table", "sidecar_schema_migrations", "SELECT"),
    ("table", "sidecar_schema_repeatables", "SELECT"),
    ("table", "tool_jobs", "SELECT"),
    ("table", "tool_approvals", "SELECT"),  # the open request an answer names (issue 44)
    # the MCP gateway's sessions, shared by its replicas (issue 41, point 15)
    *(("table", "sidecar_mcp_sessions", p) for p in ("SELECT", "INSERT", "DELETE")),
    ("column", "sidecar_mcp_sessions.last_seen_at", "UPDATE"),
    *(("function", f, "EXECUTE") for f in ("tool_job_enqueue", "sidecar_enqueue",
                                           "tool_job_cancel", "tool_job_expire",
                                           "tool_job_wait_reasons", "tool_job_interest_hold",
                                           "tool_job_interest_lapse",
                                           "tool_job_approval_answer")),
}

# Every privilege granted to one role by name (not through PUBLIC), columns included.
GRANTED_TO = """
SELECT 'schema' AS kind, n.nspname AS name, a.privilege_type AS privilege
  FROM pg_namespace n, aclexplode(n.nspacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT CASE c.relkind WHEN 'S' THEN 'sequence' ELSE 'table' END, c.relname, a.privilege_type
  FROM pg_class c, aclexplode(c.relacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT 'column', c.relname || '.' || att.attname, a.privilege_type
  FROM pg_attribute att JOIN pg_class c ON c.oid = att.attrelid, aclexplode(att.attacl) a
  WHERE a.grantee = $1::regrole
UNION ALL
SELECT 'function', p.proname, a.privilege_type
  FROM pg_proc p, aclexplode(p.proacl) a WHERE a.grantee = $1::regrole
UNION ALL
SELECT 'database', d.datname, a.privilege_type
  FROM pg_database d, aclexplode(d.datacl) a WHERE a.grantee = $1::regrole
"""


@pytest.fixture
def caller(dsn):
    """A caller login role of our own (roles are the cluster's: a unique name), granted by
    the shipped command run as the schema owner, dropped afterwards; yields its name."""
    role = f"sidecar_c_{uuid.uuid4().hex[:10]}"
    query(dsn, f'CREATE ROLE "{role}" LOGIN')
    query(dsn, "REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # PostgreSQL < 15
    try:
        done = cli(dsn, "migrate", "--caller-role", role)
        assert done.returncode == 0, done.stderr.decode()
        yield role
    finally:
        query(dsn, f'DROP OWNED BY "{role}"')
        query(dsn, f'DROP ROLE "{role}"')


def test_the_shipped_caller_grants_are_exactly_the_documented_ones(dsn, caller):
    granted = {tuple(row) for row in query(dsn, GRANTED_TO, caller)}
    assert granted == CALLER_PRIVILEGES
    again = cli(dsn, "migrate", "--caller-role", caller)
    assert again.returncode == 0, again.stderr.decode()
    assert {tuple(row) for row in query(dsn, GRANTED_TO, caller)} == CALLER_PRIVILEGES


def test_a_client_as_the_caller_enqueues_waits_gets_and_cancels(dsn, caller, sidecars):
    """Every call of sidecar.client.Client the gateway makes, and the options around them,
    as the caller role, against a sidecar running as the owner."""
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "2",
             env=base_env(dsn, SIDECAR_PROFILE_PT_MAX_ATTEMPTS="1"))
    as_caller = _as(dsn, caller)

    async def main():
        async with Client(as_caller) as client:
            # call = enqueue (a sidecar woken: tool_job_wake) + wait (LISTEN, the row)
            assert await client.call(TOOL, {"steps": []}, timeout=30) == \
                {"done": True, "statuses": []}
            with pytest.raises(JobFailed) as failed:
                await client.call(TOOL, {"steps": [], "exit": 3}, timeout=30)
            assert failed.value.kind == "exit_code"
            # follow: the progress report, then the end
            ref = await client.enqueue(TOOL, {"steps": [
                {"http": {"progress": 0.5, "message": "half"}}, {"sleep": 0.5}]})
            seen = [event async for event in client.follow(ref)]
            assert isinstance(seen[0], JobProgress) and seen[0].value == 0.5
            assert isinstance(seen[-1], JobEnd) and seen[-1].state == "succeeded"
            job = await client.get(ref)
            assert (job.state, job.progress["message"]) == ("succeeded", "half")
            # an idempotency key read back, a concurrency key (the tool's flow row)
            first = await client.enqueue(TOOL, {"n": 1}, idempotency_key="k-1",
                                         run_after=3600)
            again = await client.enqueue(TOOL, {"n": 1}, idempotency_key="k-1",
                                         run_after=3600)
            assert (again.id, again.created) == (first.id, False)
            # why a job waits (tool_job_wait_reasons: the owner's rights, issue 41)
            assert (await client.waiting_reason(first)).reason == "scheduled"
            keyed = await client.enqueue(TOOL, {"n": 2}, concurrency_key="tenant-1",
                                         run_after=3600)
            assert (await client.get(keyed)).state == "queued"
            # cancel: a queued job, every job of a tag, a running one (its tree killed)
            assert await client.cancel(first) == {first.id: "queued"}
            tagged = await client.enqueue(TOOL, {"n": 3}, tags={"run": "r1"}, run_after=3600)
            assert await client.cancel(tag={"run": "r1"}) == {tagged.id: "queued"}
            hung = await client.enqueue(TOOL, {"steps": [{"sleep": 120}]})
            await wait_for_state(client, hung, "running")
            assert await client.cancel(hung) == {hung.id: "running"}
            end = await client.wait(hung, timeout=30)
            assert end.state == "cancelled"
            return keyed, hung

    keyed, hung = asyncio.run(main())
    assert job_row(dsn, keyed)["concurrency_key"] == "tenant-1"
    assert job_row(dsn, hung)["state"] == "cancelled"


async def wait_for_state(client: Client, ref, state: str, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while (await client.get(ref)).state != state:
            await asyncio.sleep(0.05)


def test_the_gateway_runs_as_the_caller(dsn, caller, sidecars, tmp_path):
    """`sidecar mcp` connected as the caller role: a tool call is a job that succeeds, and
    a cancelled request cancels its job and kills the tool's tree."""
    as_caller = _as(dsn, caller)
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600")
    sidecars(dsn, COMMAND, "--tool", "pt", env=env)
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = Gateway(as_caller, tmp_path, env=_gateway_env(
        as_caller, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600"))
    pidfile = tmp_path / "hang.pids"
    try:
        async def main():
            async with g.client(ALICE) as client:
                ok = await client.call_tool("pt", {"steps": []})
                assert not ok.is_error, ok
                assert ok.structured_content == {"done": True, "statuses": []}
                call = asyncio.create_task(
                    client.call_tool("hang", {"pidfile": str(pidfile), "tree": True}))
                await asyncio.to_thread(read_pids, pidfile, 4)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                await asyncio.sleep(0.5)

        asyncio.run(main())
        # A 2025-revision session, recorded and read back as the caller (issue 41).
        headers = _initialize(g.url)
        assert _call(g.url, headers, 2, {"steps": []})["result"]["structuredContent"]["done"]
        other = Gateway(as_caller, tmp_path, env=_gateway_env(as_caller, tmp_path))
        try:
            assert _call(other.url, headers, 3, {"steps": []})["result"]["structuredContent"]
        finally:
            other.stop()
        assert httpx2.delete(g.url, headers=headers, timeout=30).status_code == 200
    finally:
        g.stop()
    assert "permission denied" not in g.log.read_text()
    assert "permission denied" not in other.log.read_text()
    rows = query(dsn, "SELECT tool, state FROM tool_jobs ORDER BY created_at")
    assert [tuple(r) for r in rows][0] == ("pt", "succeeded")
    hang = query(dsn, "SELECT id FROM tool_jobs WHERE tool = 'hang'")[0][0]
    wait_until(lambda: job_row(dsn, hang)["state"] == "cancelled", 10, what="cancelled")
    for pid in read_pids(pidfile, 4):
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"tool pid {pid} to die")


def _refused(dsn: str, sql: str, *args) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        query(dsn, sql, *args)


def test_the_caller_may_not_change_the_schema_claim_or_rewrite_jobs(dsn, caller):
    job = query(dsn, "SELECT sidecar_enqueue('pt', '{}') AS id")[0][0]
    as_caller = _as(dsn, caller)
    for sql in ("CREATE TABLE public.mine (x int)",
                "CREATE SCHEMA mine",
                "ALTER TABLE tool_jobs ADD COLUMN x int",
                "DROP TABLE tool_job_events",
                "CREATE INDEX ON tool_jobs (tool)",
                "TRUNCATE tool_jobs",
                "DELETE FROM tool_jobs",
                "UPDATE tool_jobs SET lease_until = now() + interval '1 hour'",
                "UPDATE tool_jobs SET owner_id = 'me', fencing_token = fencing_token + 1",
                "UPDATE tool_jobs SET state = 'succeeded', result = '{}'",
                "UPDATE tool_jobs SET state = 'cancelled'",
                "SELECT id FROM tool_jobs FOR UPDATE",
                "INSERT INTO tool_jobs (id, tool, idempotency_key, payload) "
                "VALUES (gen_random_uuid(), 'pt', 'around-the-checks', '{}')",
                "INSERT INTO tool_job_events (job_id, fencing_token, event, details) "
                "SELECT id, 0, 'forged', '{}' FROM tool_jobs",
                "DELETE FROM tool_idle_sidecars",
                "INSERT INTO tool_flow (tool, updated_by) VALUES ('pt', 'me')",
                "SELECT tool_job_wake('pt', 1)",
                "INSERT INTO tool_jobs (tool, idempotency_key, payload, state, owner_id) "
                "VALUES ('pt', 'x', '{}', 'running', 'me')",
                "SELECT * FROM tool_job_events",
                "UPDATE tool_job_events SET details = '{}'",
                "DELETE FROM tool_job_events",
                "SELECT * FROM tool_job_outbox",
                "SELECT * FROM tool_sweeps",
                "UPDATE tool_flow SET max_running = 0",
                "INSERT INTO sidecar_schema_migrations (version, name) VALUES (999, 'x')",
                "SELECT * FROM fence_effects",
                "SELECT * FROM fence_requests",
                "INSERT INTO fence_entities DEFAULT VALUES",
                "SELECT tool_job_demand('pt')"):
        _refused(as_caller, sql)

    async def claim():  # the worker's claim, through the worker's own code
        pool = await asyncpg.create_pool(as_caller, min_size=1, max_size=1)
        try:
            return await WorkerStore(pool, 10).claim("pt", "intruder", 60)
        finally:
            await pool.close()

    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        asyncio.run(claim())
    row = job_row(dsn, job)
    assert (row["state"], row["owner_id"], row["fencing_token"]) == ("queued", None, 0)
