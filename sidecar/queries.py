"""Loads the named SQL statements of ``sql/queries.sql`` and the numbered migrations.

A block starts with ``-- name: NAME``; its text runs to the next such line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_MIGRATION = re.compile(r"^(\d{3})_(\w+)\.sql$")


def _load_named(text: str) -> dict[str, str]:
    parts = _NAME.split(text)
    named = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in named:
            raise ValueError(f"query {name!r} is defined twice in queries.sql")
        named[name] = body.strip().rstrip(";")
    return named


Q: dict[str, str] = _load_named(
    resources.files("sidecar").joinpath("sql/queries.sql").read_text(encoding="utf-8")
)


@dataclass(frozen=True)
class Migration:
    """One schema step: ``version`` (1, 2, ...), ``name`` and its SQL text."""

    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """All migrations shipped with the package, in version order."""
    found = []
    for entry in resources.files("sidecar").joinpath("sql/migrations").iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append(
                Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8"))
            )
    return sorted(found, key=lambda m: m.version)
