"""Loads the named SQL statements of ``sql/*.sql`` and the numbered migrations.

A block starts with ``-- name: NAME``; its text runs to the next such line.
"""

from __future__ import annotations

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
    for entry in sorted(resources.files("sidecar").joinpath("sql").iterdir(),
                        key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            for name, body in _load_named(entry.read_text(encoding="utf-8")).items():
                if name in named:
                    raise ValueError(f"query {name!r} is defined twice in sidecar/sql")
                named[name] = body
    return named


# Every named statement of sidecar/sql/*.sql (queries.sql: the lease protocol).
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


def migrations() -> list[Migration]:
    """All migrations shipped with the package, in version order."""
    found = []
    for entry in resources.files("sidecar").joinpath("sql/migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            sql = entry.read_text(encoding="utf-8")
            marker = _COMPATIBLE_FROM.search(sql)
            found.append(Migration(int(match.group(1)), match.group(2), sql,
                                   int(marker.group(1)) if marker else None))
    return sorted(found, key=lambda m: m.version)
