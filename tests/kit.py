"""Helpers the tests and the benchmark share, one copy of each: the test database (query,
scalar), waiting for a condition, the environment and CLI of a sidecar under test, a
running sidecar or reference receiver, reading a sidecar's JSON events, stopping a process
we started, checking and finding processes (pid_alive, job_processes), the isolation
tests' cgroup and work-root helpers, and a PgBouncer of our own. Fixtures live in
tests/conftest.py and use these; tests import them from here (``from kit import ...``),
and so does bench/common.py. Nothing here imports pytest at module level: the benchmark
runs without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import asyncpg
import orjson
import psutil

from sidecar.storage.db import init_connection
from sidecar.worker import linux

# The small real executables tests and the benchmark run as tools.
TOOLS = Path(__file__).resolve().parent / "tools"

# Short periods so the suite runs in seconds, at the floors config's checks allow while a
# loaded 2-core machine keeps its leases: P10 holds (3 > 1 x 0.5 + 0.5) and the tolerated
# silence (L - H - kill grace - L/10 = 1.7 s) is over three heartbeats. The lease stays at
# 3 s: at 2 s that silence would be 0.8 s, less than a busy CI worker's stalls.
FAST_PROFILE = {
    "SIDECAR_LEASE_SECONDS": "3",
    "SIDECAR_HEARTBEAT_SECONDS": "0.5",
    "SIDECAR_JITTER_SECONDS": "0.5",
    "SIDECAR_TOLERATED_MISSES": "1",
    "SIDECAR_KILL_GRACE_SECONDS": "0.5",
    "SIDECAR_POLL_SECONDS": "0.2",
    "SIDECAR_BACKOFF_BASE_SECONDS": "0.1",
    "SIDECAR_BACKOFF_MAX_SECONDS": "0.5",
    "SIDECAR_DRAIN_SECONDS": "5",
    "SIDECAR_DB_TIMEOUT_SECONDS": "2",
    "SIDECAR_HTTP_ADDR": "127.0.0.1:0",  # many sidecars at once: any free port
    # The suite's tools write reports to the test's temporary directory and print their
    # own pids for the test to check: both need the host's view, so the bubblewrap
    # sandbox (the product's default, SANDBOX=auto) is off here; tests/test_containment.py
    # runs it.
    "SIDECAR_SANDBOX": "off",
}


# --- the database ----------------------------------------------------------------------------

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


def admin(server_dsn: str, sql: str) -> None:
    """Run one statement on the server's maintenance database (CREATE/DROP DATABASE).
    A copy from a template fails while another session is still connected to the
    template (a copy just made lingers a moment): retried for up to 5 s."""

    async def go():
        for attempt in range(50):
            conn = await asyncpg.connect(server_dsn)
            try:
                await conn.execute(sql)
                return
            except asyncpg.ObjectInUseError:
                if attempt == 49:
                    raise
            finally:
                await conn.close()
            await asyncio.sleep(0.1)

    run(go())


def job_row(dsn: str, job_id) -> dict:
    """The tool_jobs row of one job (``job_id`` a string or a UUID), as a dict."""
    rows = query(dsn, "SELECT * FROM tool_jobs WHERE id = $1::uuid", str(job_id))
    assert rows, f"no job {job_id}"
    return dict(rows[0])


def journal_details(dsn: str, job_id, event: str) -> list:
    """The details of every journal row of ``event`` for the job, oldest first."""
    return [r["details"] for r in query(
        dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 AND event = $2 ORDER BY id",
        job_id, event)]


def journal_rows(dsn: str, job_id, event: str) -> list:
    """Every journal row of ``event`` for the job, oldest first: ``fencing_token``,
    ``details`` and ``at`` of each."""
    return query(dsn, "SELECT fencing_token, details, at FROM tool_job_events "
                      "WHERE job_id = $1::uuid AND event = $2 ORDER BY id", str(job_id), event)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels...}`` in a Prometheus text exposition (the
    first whose labels include all of ``labels``), None when there is none."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of every sample ``name{...}`` whose labels include all of ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def metrics_text(base: str, timeout: float = 10.0) -> str:
    """What ``base``/metrics serves now (``base``: ``http://host:port``)."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=timeout) as response:
        return response.read().decode()


def scraped_metric(base: str, name: str, **labels: str) -> float | None:
    """``metric_value`` of what ``base``/metrics serves now."""
    return metric_value(metrics_text(base), name, **labels)


def wait_attempt_counted(dsn: str, job_id, timeout: float = 10.0) -> None:
    """Wait until the job's current attempt counts (case F16): its owner renewed the lease
    once, or its tool's start is in the journal. Before that, an owner that vanishes
    (killed, frozen, cut off) has the attempt given back when its lease expires, so a test
    of a takeover that expects the attempt spent waits for this first."""
    sql = ("SELECT j.heartbeat_at > j.claimed_at OR EXISTS ("
           " SELECT FROM tool_job_events e WHERE e.job_id = j.id"
           " AND e.fencing_token = j.fencing_token AND e.event = 'tool_request_started')"
           " AS counted FROM tool_jobs j WHERE j.id = $1::uuid")
    wait_until(lambda: query(dsn, sql, str(job_id))[0]["counted"], timeout, interval=0.02,
               what="the attempt to count (a renewal or its start journaled)")


def sidecar_backends(dsn: str) -> set[int]:
    """Server pids of the sessions sidecars hold on ``dsn``'s database now."""
    return {r[0] for r in query(
        dsn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
             "AND application_name = 'sidecar' AND pid <> pg_backend_pid()")}


# --- waiting ---------------------------------------------------------------------------------

def eventually(predicate, timeout: float = 15.0, interval: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value, and return it; after ``timeout``
    seconds return its last (falsy) value instead. For a wait whose failure the caller
    asserts in its own words."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    value = eventually(predicate, timeout, interval)
    if not value:
        import pytest

        pytest.fail(f"timed out after {timeout}s waiting for {what}")
    return value


async def wait_until_async(predicate, timeout: float = 15.0, interval: float = 0.05,
                           what: str = "condition"):
    """``wait_until`` inside a running event loop: ``predicate`` may be a coroutine
    function; the loop runs on while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            import pytest

            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def read_pids(path: Path, count: int, timeout: float = 15.0) -> list[int]:
    """Pids a test tool wrote to ``path``, once it has written ``count`` of them."""

    def ready():
        try:
            pids = [int(x) for x in path.read_text().split()]
        except (OSError, ValueError):
            return None
        return pids if len(pids) >= count else None

    return wait_until(ready, timeout, what=f"{count} pids in {path}")


# --- a sidecar under test --------------------------------------------------------------------

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
    """Run ``sidecar ARGS`` to completion. One still running after ``timeout`` seconds is
    a hang: it is made to print every thread's Python stack (PYTHONFAULTHANDLER, SIGABRT
    to the pid started here), then killed, and HangError carries the end of its stderr
    with those stacks, so a hang in CI says where it was."""
    env = dict(env or base_env(dsn))
    env.setdefault("PYTHONFAULTHANDLER", "1")
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", *args], env=env,
                            stdin=subprocess.PIPE if input is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise HangError(f"sidecar {shlex.join(args)} still ran after {timeout} s; the end of "
                        f"its stderr, stacks last:\n{err.decode(errors='replace')[-8000:]}"
                        ) from None
    except BaseException:  # the test itself was stopped: never leave the sidecar running
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class HangError(AssertionError):
    """A ``sidecar`` command (kit.cli) that did not end in time; the message holds the
    end of its stderr with every thread's stack."""


def enqueue(dsn: str, tool: str, payload=None, *extra: str, env=None) -> str:
    """Enqueue one job through the CLI; return its id."""
    args = ["enqueue", tool, "--payload", orjson.dumps(payload if payload is not None else {})
            .decode(), *extra]
    done = cli(dsn, *args, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)["id"]


def one_line_error(done: subprocess.CompletedProcess, no_stdout: bool = False) -> str:
    """The stderr of a failed command: exactly one line, no traceback; returned as text.
    ``no_stdout``: the command printed nothing on stdout either."""
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}: {err!r}"
    if no_stdout:
        assert done.stdout == b""
    return lines[0]


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
            argv = [*wrap, " ".join(shlex.quote(a) for a in argv)]
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


# --- the reference receiver and HTTP ---------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get_json(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


class Receiver:
    """A running reference receiver (`sidecar receiver`) with the environment ``env``, its
    stdout and stderr in ``log_path``; ready once it printed its listening line (after its
    pool and migrations)."""

    def __init__(self, env: dict[str, str], log_path: Path, timeout: float = 20.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "receiver", "--listen", f"127.0.0.1:{self.port}"],
            env=env, stdout=self._log, stderr=self._log)
        wait_until(lambda: self.proc.poll() is not None or "listening on" in self.stderr(),
                   timeout, what="the receiver's ready line")
        assert self.proc.poll() is None, self.stderr()

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop it with ``sig`` (SIGKILL after 10 s); its exit status."""
        code = stop_process(self.proc, 10, sig)
        self._log.close()
        return code


# --- events ----------------------------------------------------------------------------------

def parse_events(data: bytes, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON events in ``data`` (a sidecar's stderr), oldest first; only those named
    ``name`` when given. Lines that are not JSON objects are skipped."""
    out = []
    for line in data.splitlines():
        if name is not None and name.encode() not in line:
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and (name is None or event.get("event") == name):
            out.append(event)
    return out


def read_events(log_path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON events of a sidecar's log file (its stderr), as ``parse_events``; a missing
    file has none."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return []
    return parse_events(data, name)


# --- processes -------------------------------------------------------------------------------

def stop_process(proc: subprocess.Popen, timeout: float = 10.0,
                 sig: int | None = signal.SIGTERM) -> int:
    """Send ``sig`` to a process this code started (SIGTERM: a sidecar drains on it; None:
    it is ending by itself), wait up to ``timeout`` seconds, then SIGKILL it; return its
    exit status."""
    if proc.poll() is None:
        if sig is not None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(5)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid`` if it still exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _processes_with(name: str, value: str) -> list[int]:
    """Live processes whose environment has ``name`` = ``value``. Zombies count as gone."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def job_processes(job_id: str) -> list[int]:
    """Live processes carrying the job's id in their environment (SIDECAR_JOB_ID): its
    whole tree, re-parented and ``setsid`` escapees included. Zombies count as gone."""
    return _processes_with("SIDECAR_JOB_ID", job_id)


def owner_processes(owner_id: str) -> list[int]:
    """Live processes carrying a sidecar's owner id in their environment
    (SIDECAR_OWNER_ID): every tool tree of that sidecar, and its attempts prepared ahead
    (their launchers, bwrap and its namespace init: started before any job, they carry the
    attempt's variables but no job's). Zombies count as gone."""
    return _processes_with("SIDECAR_OWNER_ID", owner_id)


# --- isolation: cgroups and work roots -------------------------------------------------------

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


# The links short_root made; the session's fixture in conftest.py removes them.
SHORT_LINKS: list[Path] = []


def short_root(path: Path) -> Path:
    """``path`` (made if missing) as a work root short enough for SIDECAR_WORK_DIR (at most
    isolation.MAX_WORK_ROOT_BYTES, so tools keep room for socket paths): itself when short
    enough, else a symlink /tmp/scXXXXXXXX to it, removed at the end of the session."""
    from sidecar.worker.isolation import MAX_WORK_ROOT_BYTES

    if not path.is_absolute() or len(os.fsencode(str(path))) <= MAX_WORK_ROOT_BYTES:
        return path
    path.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
    holder.rmdir()
    holder.symlink_to(path)
    SHORT_LINKS.append(holder)
    return holder


# --- the import graph ------------------------------------------------------------------------

def chain(via: dict[str, str], start: str, target: str) -> str:
    """``start -> ... -> target`` as an import graph walk reached ``target`` (``via``:
    {module: the module that imports it}); the import-graph tests' failure messages."""
    path = [target]
    while path[-1] != start:
        path.append(via[path[-1]])
    return " -> ".join(reversed(path))


# --- PgBouncer -------------------------------------------------------------------------------

class BouncerError(RuntimeError):
    """PgBouncer is missing, exited or did not listen; the message says which."""


class PgBouncer:
    """A pgbouncer process of our own (Debian's package) in front of ``server_dsn``'s
    server: pool_mode = transaction, at most ``pool_size`` server connections per database.
    PgBouncer refuses to run as root: as root it runs as the owner of the server's socket
    directory, or as ``nobody``. Raises BouncerError."""

    def __init__(self, server_dsn: str, pool_size: int = 2):
        binary = shutil.which("pgbouncer") or next(
            (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)),
            None)
        if binary is None:
            raise BouncerError("pgbouncer is not installed; install it with "
                               "'apt-get install -y pgbouncer' (.ci/run does)")
        parts = urlsplit(server_dsn)
        query_args = parse_qs(parts.query)
        host = parts.hostname or (query_args.get("host") or ["127.0.0.1"])[0]
        port = parts.port or int((query_args.get("port") or ["5432"])[0])
        self.user = unquote(parts.username or "postgres")
        password = unquote(parts.password or "")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sidecar-pgbouncer-"))
        run_as = None
        if os.geteuid() == 0:
            # The embedded server's socket directory is readable by its owner only.
            owner = os.stat(host).st_uid if host.startswith("/") else 0
            run_as = pwd.getpwuid(owner).pw_name if owner != 0 else "nobody"
        server = f"host={host} port={port} user={self.user}"
        if password:
            server += f" password={password}"
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = {server}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "min_pool_size = 0\n"
            "reserve_pool_size = 0\n"
            "max_client_conn = 2000\n"
            # SHOW POOLS / SHOW CLIENTS on the admin console, for post-mortems.
            f"admin_users = {self.user}\n"
            f"max_db_connections = {pool_size}\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        if run_as is not None:
            pw = pwd.getpwnam(run_as)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        # Not pgbouncer's own -u: its setuid would clear the parent-death signal, and a
        # bench or test run killed by SIGKILL would leave it listening. The child drops to
        # run_as first (Popen's user/group), then asks for SIGTERM when we die.
        argv = [binary, str(self.dir / "pgbouncer.ini")]
        drop = {}
        if run_as is not None:
            drop = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        # Its stderr goes to a file, never a pipe: PgBouncer logs every connection there as
        # well, and once an unread pipe's 64 KiB fill up its single thread blocks in
        # write(2) and every client waits (seen as fleets of ~56 sidecars timing out).
        self._stderr_path = self.dir / "stderr.log"
        with open(self._stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr,
                                         preexec_fn=_die_with_parent, **drop)
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise BouncerError(f"pgbouncer exited with {self.proc.returncode}: "
                            f"{self._stderr_path.read_text(errors='replace')[-2000:]}"
                            f"{self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise BouncerError(f"pgbouncer did not listen on {self.port}: "
                                       f"{self.log()[-2000:]}") from None
                time.sleep(0.05)

    def dsn_for(self, database_dsn: str) -> str:
        """The DSN of ``database_dsn``'s database through this pgbouncer."""
        name = urlsplit(database_dsn).path.lstrip("/")
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{name}"

    def log(self) -> str:
        try:
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc, 10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _die_with_parent() -> None:
    """In a helper process's child before exec (after any uid change, which would clear
    it): SIGTERM when the thread that started it exits, and now if that already
    happened."""
    parent = os.getppid()
    linux.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def sandbox_extra_paths() -> str:
    """The EXTRA_PATHS value a sandboxed test tool needs to see the test tools and this
    interpreter's environment: the project's checkout and the venv when they lie under
    /tmp, which the sandbox replaces with an empty one (a clean clone may live there);
    "" when nothing needs binding."""
    project = Path(__file__).resolve().parent.parent
    paths = {project, Path(sys.prefix).resolve()}
    under_tmp = sorted(p for p in paths if p.is_relative_to("/tmp") and p != Path("/tmp"))
    kept = [p for p in under_tmp if not any(p != q and p.is_relative_to(q) for q in under_tmp)]
    return ",".join(f"{p}:ro" for p in kept)


def python_for(uid: int) -> tuple[str, dict[str, str]]:
    """An interpreter user ``uid`` can run the sidecar with, and the environment it needs:
    this one when that user may execute it; else the system's ``python3.X`` of the same
    version, given this interpreter's site-packages and the project on PYTHONPATH (a
    pyenv or venv interpreter under a 0700 home, /root, is closed to other users)."""
    import sysconfig

    probe = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    check = "import os, sys; sys.exit(not os.access(sys.executable, os.X_OK))"
    if subprocess.run([*probe, sys.executable, "-c", check], capture_output=True).returncode == 0:
        return sys.executable, {}
    system = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}",
                          path="/usr/local/bin:/usr/bin:/bin")
    if system is None:
        raise RuntimeError(f"no Python {sys.version_info[:2]} that uid {uid} can run")
    project = str(Path(__file__).resolve().parent.parent)
    return system, {"PYTHONPATH": os.pathsep.join([project, sysconfig.get_paths()["purelib"],
                                                   sysconfig.get_paths()["platlib"]])}
