"""The schema's front door (issue 40, point 4): only `sidecar migrate` and `sidecar run` (and
`sidecar demo`, as its own step) apply migrations. Every caller's entry point (each CLI
command that reads or writes jobs, `Client`, `sidecar web`, `sidecar mcp`, `sidecar
receiver`) checks the schema once at start and, on an empty database or one at an older
schema, refuses with one line naming both versions and the fix, changing nothing: no
table, index, function or migration row appears. A newer schema that declares
compatibility (`-- compatible-from:`, as /readyz accepts it) keeps working.

The older schema is a real one: a fresh database migrated by the same statements
Store.migrate runs, up to the migration before this release's newest.
"""

from __future__ import annotations

import uuid

import asyncpg
import pytest

import kit
from kit import base_env, cli, one_line_error
from sidecar.storage.db import with_database
from sidecar.storage.queries import Q, migrations

LATEST = migrations()[-1].version
OLDER = migrations()[-2].version
JOB = str(uuid.uuid4())

# Every caller command of the CLI, with arguments that pass its own checks, so the
# schema check is what answers.
CALLER_COMMANDS = {
    "enqueue": ["enqueue", "ocr", "--payload", "{}"],
    "enqueue --wait": ["enqueue", "ocr", "--wait", "--timeout", "5"],
    "wait": ["wait", JOB, "--timeout", "5"],
    "wait --tag": ["wait", "--tag", "run=1", "--timeout", "5"],
    "jobs": ["jobs"],
    "show": ["show", JOB],
    "events": ["events", JOB],
    "cancel": ["cancel", JOB],
    "cancel --tag": ["cancel", "--tag", "run=1"],
    "retry": ["retry", JOB],
    "retry --forwarding": ["retry", "--forwarding", JOB],
    "limit": ["limit", "ocr", "--max-running", "2"],
    "limits": ["limits"],
    "pause": ["pause", "ocr"],
    "resume": ["resume", "ocr"],
    "prune": ["prune", "--dry-run"],
}



async def _migrate_up_to(dsn: str, version: int) -> None:
    """Apply the migrations up to ``version`` as Store.upgrade applies them (one
    transaction, each recorded with its compatible-from marker; a migration of comments
    alone only recorded). The functions of sql/functions are not defined: the schema is
    older, and these tests show callers refuse it whatever it holds."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(Q["create_migrations_table"])
            await conn.execute(Q["add_migrations_compatible_from"])
            for migration in migrations():
                if migration.version <= version:
                    if not migration.only_comments:
                        await conn.execute(migration.sql)
                    await conn.execute(Q["record_migration"], migration.version,
                                       migration.name, migration.compatible_from)
    finally:
        await conn.close()


@pytest.fixture(params=["empty", "older"])
def stale(request, server_dsn):
    """A database this sidecar may not work on: ``empty`` (never migrated) or ``older``
    (migrated up to the migration before the newest); yields (dsn, expected line)."""
    name = f"sidecar_door_{uuid.uuid4().hex[:12]}"
    kit.admin(server_dsn, f'CREATE DATABASE "{name}"')
    url = with_database(server_dsn, name)
    try:
        if request.param == "older":
            kit.run(_migrate_up_to(url, OLDER))
            line = (f"the database schema is at version {OLDER}, this sidecar needs "
                    f"{LATEST}: run 'sidecar migrate' first")
        else:
            line = (f"the database has no sidecar schema, this sidecar needs {LATEST}: "
                    "run 'sidecar migrate' first")
        yield url, line
    finally:
        kit.admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _schema_snapshot(dsn: str) -> tuple:
    """Every relation and function of the public schema, and the migration rows."""
    relations = kit.scalar(dsn, "SELECT coalesce(array_agg(c.relname || ':' || c.relkind::text "
                                "ORDER BY c.relname), '{}') FROM pg_class c JOIN "
                                "pg_namespace n ON n.oid = c.relnamespace "
                                "WHERE n.nspname = 'public'")
    functions = kit.scalar(dsn, "SELECT coalesce(array_agg(p.proname ORDER BY p.proname), "
                                "'{}') FROM pg_proc p JOIN pg_namespace n ON "
                                "n.oid = p.pronamespace WHERE n.nspname = 'public'")
    versions = None
    if kit.scalar(dsn, "SELECT to_regclass('sidecar_schema_migrations') IS NOT NULL"):
        versions = kit.scalar(dsn, "SELECT array_agg(version ORDER BY version)::text "
                                   "FROM sidecar_schema_migrations")
    return tuple(relations), tuple(functions), versions


def _refuses(done, line: str) -> None:
    assert done.returncode == 1, done.stderr.decode(errors="replace")
    assert one_line_error(done) == f"sidecar: error: {line}"


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("command", sorted(CALLER_COMMANDS))
def test_a_caller_command_refuses_a_stale_schema_and_changes_nothing(stale, command):
    dsn, line = stale
    before = _schema_snapshot(dsn)
    done = cli(dsn, *CALLER_COMMANDS[command], timeout=60)
    _refuses(done, line)
    assert done.stdout == b""
    assert _schema_snapshot(dsn) == before


def _mcp_env(dsn: str, tmp_path) -> dict[str, str]:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice a-token-of-at-least-32-characters-0123456789\n")
    return base_env(dsn, SIDECAR_MCP_TOKEN_FILE=str(tokens),
                    SIDECAR_PROFILE_OCR_MCP_DESCRIPTION="Reads text off a scan.")


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("server", ["web", "mcp --listen", "mcp --stdio", "receiver"])
def test_a_server_refuses_to_start_on_a_stale_schema(stale, server, tmp_path):
    """The web view, the MCP gateway (HTTP and stdio) and the reference receiver exit 1
    with the one line before they listen, and change nothing."""
    dsn, line = stale
    before = _schema_snapshot(dsn)
    port = str(kit.free_port())
    argv = {"web": ["web", "--listen", f"127.0.0.1:{port}"],
            "mcp --listen": ["mcp", "--tool", "ocr", "--listen", f"127.0.0.1:{port}"],
            "mcp --stdio": ["mcp", "--tool", "ocr", "--stdio"],
            "receiver": ["receiver", "--listen", f"127.0.0.1:{port}"]}[server]
    done = cli(dsn, *argv, env=_mcp_env(dsn, tmp_path), input=b"", timeout=60)
    _refuses(done, line)
    assert _schema_snapshot(dsn) == before


@pytest.mark.database
def test_the_client_refuses_a_stale_schema_and_changes_nothing(stale):
    from sidecar.client import Client, SchemaMismatch

    dsn, line = stale
    before = _schema_snapshot(dsn)

    async def go():
        with pytest.raises(SchemaMismatch) as caught:
            async with Client(dsn):
                pass
        return caught.value

    error = kit.run(go())
    assert str(error) == line
    assert (error.version, error.expected) == (0 if "no sidecar" in line else OLDER, LATEST)
    assert _schema_snapshot(dsn) == before


@pytest.mark.e2e
@pytest.mark.server
def test_migrate_then_the_callers_work(stale):
    dsn, _ = stale
    assert cli(dsn, "migrate").returncode == 0
    job_id = kit.enqueue(dsn, "ocr", {"n": 1})
    assert cli(dsn, "show", job_id).returncode == 0


@pytest.mark.e2e
@pytest.mark.server
def test_a_newer_compatible_schema_keeps_working_and_an_incompatible_one_is_refused(dsn):
    """A migration declaring `compatible-from` at most this release's schema (an additive
    step of a later release) leaves every caller working, as /readyz accepts it; one that
    declares nothing is refused with the fix (upgrade this sidecar)."""
    from sidecar.client import Client, SchemaMismatch

    kit.query(dsn, "INSERT INTO sidecar_schema_migrations (version, name, compatible_from) "
                   "VALUES ($1, 'a_later_additive_step', $2)", LATEST + 1, LATEST)
    job_id = kit.enqueue(dsn, "ocr", {"n": 1})
    assert cli(dsn, "show", job_id).returncode == 0

    async def client_job():
        async with Client(dsn) as client:
            return (await client.get(job_id)).state

    assert kit.run(client_job()) == "queued"
    kit.query(dsn, "INSERT INTO sidecar_schema_migrations (version, name) "
                   "VALUES ($1, 'a_breaking_step')", LATEST + 2)
    line = (f"the database schema is at version {LATEST + 2}, which declares no "
            f"compatibility with it, this sidecar needs {LATEST}: upgrade this sidecar to "
            "the release that migrated it")
    _refuses(cli(dsn, "jobs"), line)

    async def client_open():
        with pytest.raises(SchemaMismatch) as caught:
            await Client.connect(dsn)
        return str(caught.value)

    assert kit.run(client_open()) == line
