"""The worker's start-up and shutdown are pairs: whatever fails at start, what was started
(the owner lock, the pool, the HTTP endpoints, the guard) is torn down, and no connection
to PostgreSQL is left open."""

from __future__ import annotations

import asyncio
import socket
import uuid
from urllib.parse import urlsplit

import asyncpg
import pytest

from kit import base_env, query, run, wait_until
from sidecar.protocol.errors import ConfigError
from sidecar.runtime.config import load_settings
from sidecar.storage.db import with_database
from sidecar.worker.claim_loop import Worker

pytestmark = pytest.mark.database


@pytest.fixture
def unmigrated_dsn(server_dsn):
    """A fresh database the sidecar has never migrated."""
    name = f"sidecar_t_{uuid.uuid4().hex[:12]}"
    query(server_dsn, f'CREATE DATABASE "{name}"')
    yield with_database(server_dsn, name), name
    query(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _sidecar_connections(server_dsn: str, name: str) -> int:
    return query(server_dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 "
                             "AND application_name = 'sidecar'", name)[0][0]


def test_a_worker_whose_migration_fails_leaves_no_connection_and_no_lock(
        unmigrated_dsn, server_dsn, tmp_path):
    dsn, name = unmigrated_dsn
    # A table in the way of the first migration: CREATE TABLE tool_jobs fails.
    query(dsn, "CREATE TABLE tool_jobs (something_else int)")
    work = tmp_path / "w"
    settings = load_settings(base_env(dsn, SIDECAR_WORK_DIR=str(work),
                                      SIDECAR_HTTP_ADDR="127.0.0.1:0"))
    worker = Worker(settings, settings.profile("t"), dsn, ["/bin/true"], concurrency=2,
                    drain=True, adopt_orphans=False, serve_http=True)

    async def start():
        await asyncio.wait_for(worker.run(), 30)

    with pytest.raises(asyncpg.DuplicateTableError):
        run(start())
    wait_until(lambda: _sidecar_connections(server_dsn, name) == 0, 5,
               what="no connection of the sidecar left open")
    assert not list(work.glob(".owner-*")), "the owner lock was not released"


def test_a_worker_that_cannot_listen_closes_its_pool(dsn, server_dsn, tmp_path):
    """The HTTP address is taken: one ConfigError, and the pool opened before is closed."""
    name = urlsplit(dsn).path.lstrip("/")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = load_settings(base_env(dsn, SIDECAR_WORK_DIR=str(tmp_path / "w"),
                                          SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}"))
        worker = Worker(settings, settings.profile("t"), dsn, ["/bin/true"], concurrency=1,
                        drain=True, adopt_orphans=False, serve_http=True)
        with pytest.raises(ConfigError, match="SIDECAR_HTTP_ADDR"):
            run(asyncio.wait_for(worker.run(), 30))
    wait_until(lambda: _sidecar_connections(server_dsn, name) == 0, 5,
               what="no connection of the sidecar left open")
