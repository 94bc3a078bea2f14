"""One definition per SQL function (issue 40, point 2): functions and triggers live once, in
sidecar/storage/sql/functions/*.sql, applied by `sidecar migrate` after the migrations whenever a
file's checksum changes (docs/development.md, "SQL functions").

A database built fresh and databases upgraded from the schemas 9 and 19 as releases shipped
them (tests/data/, frozen) end with the same definitions: every function's
pg_get_functiondef (its settings and SECURITY DEFINER included) and rights, every view's
and trigger's definition, and the same tables, columns, indexes and constraints. A second
`sidecar migrate` applies nothing; a changed file is applied again with the roles' EXECUTE
rights kept; a database at a newer schema than the release keeps its definitions."""

from __future__ import annotations

import gzip
import uuid
from pathlib import Path

import asyncpg
import orjson
import pytest

from kit import admin, cli, query, run
from sidecar.storage.db import with_database
from sidecar.storage.queries import migrations, repeatables

pytestmark = [pytest.mark.e2e, pytest.mark.server]

DATA = Path(__file__).resolve().parent / "data"
ALL_VERSIONS = [m.version for m in migrations()]
ALL_DEFINITIONS = [r.name for r in repeatables()]

# What a schema defines, each as a set of rows of text, for schema public (the tests'
# databases use it): name -> catalog query.
CATALOG = {
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid),
               coalesce(p.proacl::text, 'default'), pg_get_userbyid(p.proowner)::text
        FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace""",
    "views": """
        SELECT c.relname::text, pg_get_viewdef(c.oid)
        FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('v', 'm')""",
    "triggers": """
        SELECT t.tgname::text, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal""",
    "columns": """
        SELECT table_name::text, column_name::text, ordinal_position::text, data_type::text,
               is_nullable::text, coalesce(column_default, '')
        FROM information_schema.columns WHERE table_schema = 'public'""",
    "indexes": "SELECT indexname::text, indexdef FROM pg_indexes WHERE schemaname = 'public'",
    "constraints": """
        SELECT conrelid::regclass::text, conname::text, pg_get_constraintdef(oid),
               convalidated::text
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace""",
    "types": """
        SELECT t.typname::text, format_type(t.oid, NULL)
        FROM pg_type t JOIN pg_class c ON c.oid = t.typrelid
        WHERE t.typnamespace = 'public'::regnamespace AND c.relkind = 'c'""",
    "table options": """
        SELECT relname::text, reloptions::text FROM pg_class
        WHERE relnamespace = 'public'::regnamespace AND reloptions IS NOT NULL""",
}


def _definitions(dsn: str) -> dict[str, set[tuple[str, ...]]]:
    return {kind: {tuple(row) for row in query(dsn, sql)} for kind, sql in CATALOG.items()}


def _migrate(dsn: str, *args: str) -> dict:
    done = cli(dsn, "migrate", *args)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return orjson.loads(done.stdout)



async def _load(dsn: str, frozen: Path) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(gzip.decompress(frozen.read_bytes()).decode("utf-8"))
    finally:
        await conn.close()


@pytest.fixture
def databases(server_dsn):
    """Factory of empty databases (``frozen``: loaded with a release's schema from
    tests/data/); every one is dropped afterwards."""
    made: list[str] = []

    def make(frozen: str | None = None) -> str:
        name = f"sidecar_defs_{uuid.uuid4().hex[:12]}"
        admin(server_dsn, f'CREATE DATABASE "{name}"')
        made.append(name)
        url = with_database(server_dsn, name)
        if frozen:
            run(_load(url, DATA / frozen))
        return url

    yield make
    for name in made:
        admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_fresh_and_upgraded_databases_hold_the_same_definitions(databases):
    fresh, from_9, from_19 = databases(), databases("schema_009.sql.gz"), \
        databases("schema_019.sql.gz")
    assert _migrate(fresh) == {"applied": ALL_VERSIONS, "definitions": ALL_DEFINITIONS,
                               "version": ALL_VERSIONS[-1]}
    assert _migrate(from_9)["applied"] == [v for v in ALL_VERSIONS if v > 9]
    # schema 19 as shipped had every function already: only the definitions are applied
    assert _migrate(from_19) == {"applied": [v for v in ALL_VERSIONS if v > 19],
                                 "definitions": ALL_DEFINITIONS, "version": ALL_VERSIONS[-1]}

    expected = _definitions(fresh)
    assert len(expected["functions"]) >= 21 and len(expected["triggers"]) == 6
    for upgraded in (from_9, from_19):
        got = _definitions(upgraded)
        for kind in CATALOG:
            assert got[kind] == expected[kind], (
                f"{kind} differ: only in the upgraded database "
                f"{sorted(got[kind] - expected[kind])}, only in the fresh one "
                f"{sorted(expected[kind] - got[kind])}")
    # 014's enqueue signatures, dropped by 016, stay dropped
    assert query(fresh, "SELECT oid FROM pg_proc WHERE proname = 'tool_job_enqueue' "
                        "AND pronargs = 13") == []

    # A second run applies nothing, whichever way the database came.
    for dsn in (fresh, from_9, from_19):
        assert _migrate(dsn) == {"applied": [], "definitions": [],
                                 "version": ALL_VERSIONS[-1]}


def test_a_changed_definition_is_applied_again_and_the_grants_stay(dsn):
    """A file whose checksum differs from the recorded one (a release that changed it) is
    applied again, alone; CREATE OR REPLACE keeps every right a role was granted."""
    suffix = uuid.uuid4().hex[:10]
    worker, caller = f"sidecar_dw_{suffix}", f"sidecar_dc_{suffix}"
    rights = ("SELECT p.oid::regprocedure::text, coalesce(p.proacl::text, '') FROM pg_proc p "
              "WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1")
    for name in (worker, caller):
        query(dsn, f'CREATE ROLE "{name}"')
    try:
        _migrate(dsn, "--worker-role", worker, "--caller-role", caller)
        before = query(dsn, rights)
        assert any(worker in acl and caller in acl for _, acl in before)
        query(dsn, "UPDATE sidecar_schema_repeatables SET checksum = 'changed' "
                   "WHERE name = 'functions/cancel.sql'")
        assert _migrate(dsn)["definitions"] == ["functions/cancel.sql"]
        query(dsn, "UPDATE sidecar_schema_repeatables SET checksum = 'changed'")
        assert _migrate(dsn)["definitions"] == ALL_DEFINITIONS
        assert query(dsn, rights) == before
        assert {row[0] for row in query(dsn, "SELECT checksum FROM sidecar_schema_repeatables")
                } == {r.checksum for r in repeatables()}
    finally:
        for name in (worker, caller):
            query(dsn, f'DROP OWNED BY "{name}"')
            query(dsn, f'DROP ROLE "{name}"')


def test_a_newer_schema_keeps_its_definitions(dsn):
    """A release running on a newer schema (its migrations declared compatible) never puts
    its own definitions back over the newer release's."""
    query(dsn, "INSERT INTO sidecar_schema_migrations (version, name, compatible_from) "
               "VALUES (999, 'from_a_newer_release', 1)")
    query(dsn, "UPDATE sidecar_schema_repeatables SET checksum = 'newer'")
    assert _migrate(dsn) == {"applied": [], "definitions": [], "version": 999}
    assert {row[0] for row in query(dsn, "SELECT checksum FROM sidecar_schema_repeatables")
            } == {"newer"}
