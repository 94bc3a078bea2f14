"""Where the SQL lives (issue 40, point 2; docs/development.md, "SQL functions"): the
migrations hold schema changes and data moves only; functions, views and triggers are
defined once, in sidecar/storage/sql/functions/*.sql, each file re-appliable as it stands and
listed in the order Store.upgrade applies them, and shipped in the package."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from sidecar.storage.queries import REPEATABLE_ORDER, migrations, repeatables

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
FUNCTIONS = ROOT / "sidecar" / "storage/sql" / "functions"
# A definition the migrations no longer hold: made, changed or given settings there.
DEFINITION = re.compile(
    r"\b(CREATE\s+(OR\s+REPLACE\s+)?(FUNCTION|PROCEDURE|VIEW|TRIGGER)|ALTER\s+FUNCTION"
    r"|DO\s+\$)", re.IGNORECASE)


def _code(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def test_no_migration_defines_a_function_view_or_trigger():
    found = [(m.version, hit.group(0)) for m in migrations()
             for hit in DEFINITION.finditer(_code(m.sql))]
    assert found == [], "define these in sidecar/storage/sql/functions/*.sql instead"


def test_every_definition_can_be_applied_again():
    """A file is applied again whenever it changes: every function and view is made with
    CREATE OR REPLACE, every trigger dropped (if it exists) just before it is made."""
    for repeatable in repeatables():
        code = _code(repeatable.sql)
        assert not re.search(r"\bCREATE\s+(FUNCTION|PROCEDURE|VIEW)\b", code, re.IGNORECASE), \
            repeatable.name
        for trigger, table in re.findall(r"\bCREATE\s+TRIGGER\s+(\w+)\s+.*?\bON\s+(\w+)",
                                         code, re.IGNORECASE | re.DOTALL):
            assert f"DROP TRIGGER IF EXISTS {trigger} ON {table};" in code, \
                (repeatable.name, trigger)


def test_the_order_names_every_file_once_and_the_package_ships_them():
    assert len(set(REPEATABLE_ORDER)) == len(REPEATABLE_ORDER)
    assert sorted(f"{name}.sql" for name in REPEATABLE_ORDER) == \
        sorted(p.name for p in FUNCTIONS.glob("*.sql"))
    assert [r.name for r in repeatables()] == [f"functions/{n}.sql" for n in REPEATABLE_ORDER]
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["sidecar.storage"]
    assert "sql/functions/*.sql" in package_data
