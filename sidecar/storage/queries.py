"""Loads the named SQL statements of ``sql/*.sql``, the numbered migrations and the
repeatable definitions of ``sql/functions/``.

A block starts with ``-- name: NAME``; its text runs to the next such line.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{3})_(\w+)\.sql$")
# A migration's declaration that releases built for schema N or later keep running
# correctly on it (docs/operations.md, "Schema upgrades"): a line of its own in the file.
_COMPATIBLE_FROM = re.compile(r"^--\s*compatible-from:\s*(\d+)\s*$", re.MULTILINE)


def _load_named(text: str) -> dict[str, str]:
    parts = _NAME.split(text)
    named = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in named:
            raise ValueError(f"query {name!r} is defined twice")
        named[name] = body.strip().rstrip(";")
    return named


def _load_all() -> dict[str, str]:
    named: dict[str, str] = {}
    for entry in sorted(resources.files("sidecar.storage").joinpath("sql").iterdir(),
                        key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            for name, body in _load_named(entry.read_text(encoding="utf-8")).items():
                if name in named:
                    raise ValueError(f"query {name!r} is defined twice in sidecar/storage/sql")
                named[name] = body
    return named


# Every named statement of sidecar/storage/sql/*.sql (queries.sql: the lease protocol).
Q: dict[str, str] = _load_all()


@dataclass(frozen=True)
class Migration:
    """One schema step: ``version`` (1, 2, ...), ``name`` and its SQL text;
    ``compatible_from``: the oldest schema version whose releases keep working on it (its
    ``-- compatible-from: N`` line), None when it declares none (case F24)."""

    version: int
    name: str
    sql: str
    compatible_from: int | None = None

    @property
    def only_comments(self) -> bool:
        """Whether the migration runs nothing: one whose functions moved to sql/functions
        keeps its number and its explanation (asyncpg cannot send an empty query)."""
        return all(not line.strip() or line.lstrip().startswith("--")
                   for line in self.sql.splitlines())


def migrations() -> list[Migration]:
    """All migrations shipped with the package, in version order."""
    found = []
    for entry in resources.files("sidecar.storage").joinpath("sql/migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            sql = entry.read_text(encoding="utf-8")
            marker = _COMPATIBLE_FROM.search(sql)
            found.append(Migration(int(match.group(1)), match.group(2), sql,
                                   int(marker.group(1)) if marker else None))
    return sorted(found, key=lambda m: m.version)


# The files of sql/functions/ (without ".sql"), in the order Store.migrate applies them:
# each file after those whose functions it needs when it is created. PostgreSQL checks the
# body of a LANGUAGE sql function at CREATE (the tables, types and functions it names must
# exist), a trigger needs its function, and the migrations (tables, types) all come first;
# plpgsql bodies are only parsed. So: expiry before claimable (its row rules call
# tool_job_expiry_refunded), flow before claimable (tool_flow_occupied), claimable before
# demand; within a file, a function before the SQL ones calling it.
REPEATABLE_ORDER = ("journal", "retention", "wake", "expiry", "waiting", "dedupe", "enqueue",
                    "flow", "claimable", "claim", "demand", "cancel", "actions", "sessions",
                    "interests", "approvals")


@dataclass(frozen=True)
class Repeatable:
    """One file of repeatable definitions (functions, views, triggers): ``name`` as
    recorded in sidecar_schema_repeatables ("functions/claim.sql"), its SQL text and the
    sha256 of that text, which says whether the database holds this version of it."""

    name: str
    sql: str
    checksum: str


def repeatables() -> list[Repeatable]:
    """The repeatable definitions shipped with the package, in REPEATABLE_ORDER. Raises
    ValueError when a file of sql/functions/ is not in the order, or one listed is
    missing (a packaging or editing slip: nothing may be applied half)."""
    folder = resources.files("sidecar.storage").joinpath("sql/functions")
    present = {entry.name[:-4] for entry in folder.iterdir() if entry.name.endswith(".sql")}
    if present != set(REPEATABLE_ORDER):
        raise ValueError(
            "sidecar/storage/sql/functions does not match queries.REPEATABLE_ORDER: "
            f"not in the order {sorted(present - set(REPEATABLE_ORDER))}, "
            f"missing {sorted(set(REPEATABLE_ORDER) - present)}")
    found = []
    for name in REPEATABLE_ORDER:
        sql = folder.joinpath(f"{name}.sql").read_text(encoding="utf-8")
        found.append(Repeatable(f"functions/{name}.sql", sql,
                                hashlib.sha256(sql.encode("utf-8")).hexdigest()))
    return found
