"""The schema's front door: every entry point but ``sidecar migrate`` and ``sidecar run``
(and ``sidecar demo``, which migrates as its own documented step) checks the database's
schema once when it starts, and refuses one it may not work on, changing nothing.

The rule is /readyz's (sidecar.ops.health.Readiness): the schema of this release's newest
migration, or a newer one whose every newer migration declares ``-- compatible-from:`` at
most that version (docs/operations.md, "Schema versions").
"""

from __future__ import annotations

from sidecar.protocol.errors import SchemaMismatch
from sidecar.storage.queries import migrations
from sidecar.storage.store import StoreBase


def expected_version() -> int:
    """The schema version this sidecar is built for: its newest migration's."""
    return migrations()[-1].version


async def require_current(store: StoreBase) -> int:
    """Read the schema's version (one SELECT, no DDL, no lock) and return it when this
    sidecar may work on it; raise SchemaMismatch (exit 1, one line naming both versions
    and the fix) when it is older (0: none at all) or newer without declaring
    compatibility. Database errors propagate as asyncpg raises them."""
    expected = expected_version()
    version, compatible = await store.schema_compatibility(expected)
    if version < expected or (version > expected and not compatible):
        raise SchemaMismatch(version, expected)
    return version
