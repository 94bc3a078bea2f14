"""What every section shares: the run's mode and context, the scratch database, real
``sidecar run`` processes with their JSON logs, helper processes, and small statistics."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import orjson
import psutil

from sidecar.storage.db import init_connection, with_database

# The helpers and tools the tests use too, one copy of each (tests/kit.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import kit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOOLS = kit.TOOLS  # the tests' tools: the benchmark runs the same programs
T = TypeVar("T")


class BenchError(Exception):
    """A section could not measure what it meant to (its rows then say so)."""


@dataclass(frozen=True)
class Mode:
    """How much each section does. ``quick`` is for CI (under 60 s in all)."""

    name: str
    jobs: int                   # no-op jobs per throughput shape (sidecar, baselines, peers)
    shapes: tuple[tuple[int, int], ...]  # (sidecars, concurrency each)
    pickup_samples: int         # NOTIFY pickups measured (and as many bare ones)
    poll_samples: int           # pickups that must wait for the poll fallback
    poll_seconds: float         # SIDECAR_POLL_SECONDS of the pickup / reaction sidecars
    hb_window: float            # seconds each heartbeat window lasts
    reaction_trials: int        # takeovers, cancels and stage deadlines each
    kill_trials: int            # sidecar SIGKILL -> re-claim trials
    lag_jobs: int               # flooding jobs for the event-loop lag
    idle_window: float          # seconds of idle CPU measurement
    health_jobs: int            # jobs through tool_jobs before the queue-health snapshot
    caller_calls: int           # caller round trips measured (and as many bare ones)
    caller_waiters: int         # callers waiting at once, each on its own job
    bouncer_calls: int          # caller round trips behind PgBouncer (polling waiter)
    mcp_calls: int              # MCP gateway round trips measured (and as many Client.call)
    mcp_in_flight: int          # MCP calls in flight at once for the gateway's memory
    mcp_tasks: int              # MCP tasks left pending at once for the gateway's memory
    warm_tool_jobs: int = 60    # real-tool jobs per side of the warm-tools section (15)


SHAPES = ((1, 1), (1, 8), (2, 8), (4, 8))

MODES = {
    "quick": Mode("quick", jobs=60, shapes=((1, 8),), pickup_samples=12, poll_samples=4,
                  poll_seconds=0.5, hb_window=1.0, reaction_trials=1, kill_trials=1,
                  lag_jobs=16, idle_window=1.5, health_jobs=400, caller_calls=12,
                  caller_waiters=20, bouncer_calls=3, mcp_calls=12,
                  mcp_in_flight=20, mcp_tasks=50, warm_tool_jobs=2),
    "medium": Mode("medium", jobs=3000, shapes=SHAPES, pickup_samples=100, poll_samples=20,
                   poll_seconds=2.0, hb_window=8.0, reaction_trials=6, kill_trials=2,
                   lag_jobs=48, idle_window=10.0, health_jobs=100_000,
                   caller_calls=200, caller_waiters=100, bouncer_calls=12,
                   mcp_calls=200, mcp_in_flight=1000, mcp_tasks=1000),
    "full": Mode("full", jobs=10_000, shapes=SHAPES, pickup_samples=200, poll_samples=40,
                 poll_seconds=2.0, hb_window=10.0, reaction_trials=10, kill_trials=3,
                 lag_jobs=80, idle_window=10.0, health_jobs=100_000,
                 caller_calls=400, caller_waiters=100, bouncer_calls=20,
                 mcp_calls=400, mcp_in_flight=1000, mcp_tasks=1000, warm_tool_jobs=120),
}

# The short lease profile of the pickup, heartbeat and reaction sidecars (keeps P10:
# 3 > 1 x 0.5 + 1), so reactions take seconds instead of the defaults' minutes.
SHORT_PROFILE = {
    "SIDECAR_LEASE_SECONDS": "3",
    "SIDECAR_HEARTBEAT_SECONDS": "0.5",
    "SIDECAR_TOLERATED_MISSES": "1",
    "SIDECAR_JITTER_SECONDS": "1",
    "SIDECAR_KILL_GRACE_SECONDS": "1",
    "SIDECAR_DRAIN_SECONDS": "0",
}


def progress(message: str) -> None:
    """One progress line on stderr (the table goes to stdout)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


@dataclass
class Context:
    """One run: the scratch database, a temporary directory and the processes started."""

    dsn: str                    # the scratch database
    admin_dsn: str              # the server's database we were given (for pg_stat_activity)
    tmp: Path
    mode: Mode
    clock_offset: float = 0.0   # database clock minus ours (seconds)
    owns_server: bool = False   # the embedded server (no --dsn): server-wide commands allowed
    procs: list[subprocess.Popen] = field(default_factory=list)
    jobs_run: dict[str, int] = field(default_factory=dict)  # who pushed jobs through tool_jobs
    notes: list[str] = field(default_factory=list)     # closing notes of RESULTS.md
    settings: list[str] = field(default_factory=list)  # what each section ran with

    def count(self, who: str, jobs: int) -> None:
        self.jobs_run[who] = self.jobs_run.get(who, 0) + jobs

    def popen(self, argv: list[str], env: dict[str, str] | None = None,
              log: Path | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start a process we own (ended in ``cleanup``); stderr to ``log`` when given."""
        stream = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=kwargs.pop("stdout", subprocess.DEVNULL),
                                    stderr=stream, cwd=kwargs.pop("cwd", ROOT), **kwargs)
        finally:
            if log:
                stream.close()
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        """SIGTERM every process we started that still runs, SIGKILL after 5 s, reap all."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)
        self.procs.clear()


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment without any SIDECAR_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sidecar_env(dsn: str, **extra: str) -> dict[str, str]:
    """The environment of a bench sidecar: ours minus SIDECAR_*, its database, ``extra``.

    Where the sidecar serves its own HTTP endpoints (``SIDECAR_HTTP_ADDR``, one fixed port
    by default), each bench sidecar gets a loopback port of its own, so several can run."""
    from sidecar.runtime.config import GLOBAL_FIELDS

    env = clean_env(SIDECAR_DATABASE_URL=dsn, SIDECAR_WORKER_NAME="bench")
    if "HTTP_ADDR" in GLOBAL_FIELDS:
        env["SIDECAR_HTTP_ADDR"] = f"127.0.0.1:{free_port()}"
    env.update(extra)
    return env


def _runs_a_job(root: psutil.Process) -> bool:
    """True when ``root`` or one of its descendants carries a SIDECAR_JOB_ID."""
    for proc in (root, *root.children(recursive=True)):
        try:
            if "SIDECAR_JOB_ID" in proc.environ():
                return True
        except psutil.Error:
            continue
    return False


class Sidecar:
    """A real ``sidecar run`` process; its stderr (JSON lines) goes to a file."""

    def __init__(self, ctx: Context, name: str, tool: str, command: list[str],
                 concurrency: int = 1, drain: bool = False, dsn: str | None = None,
                 **env: str):
        self.name = name
        self.tool = tool
        self.log_path = ctx.tmp / f"{name}.log"
        argv = [sys.executable, "-m", "sidecar", "run", "--tool", tool,
                "--concurrency", str(concurrency), *(["--drain"] if drain else []),
                "--", *command]
        self.proc = ctx.popen(argv, env=sidecar_env(dsn or ctx.dsn, **env), log=self.log_path)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return kit.read_events(self.log_path, name)

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    async def wait_event(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        async def found():
            if self.proc.poll() is not None:
                raise BenchError(f"sidecar {self.name} exited ({self.proc.returncode}) before "
                                 f"{name}: {self.tail()}")
            events = self.events(name)
            return events[0] if events else None

        return await until(found, timeout, what=f"{name} from sidecar {self.name}")

    async def ready(self, timeout: float = 30.0) -> None:
        """Until the worker has started and its LISTEN connection is surely up."""
        await self.wait_event("worker_started", timeout)
        await asyncio.sleep(0.3)

    async def exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"sidecar {self.name} did not exit within {timeout:g} s: "
                                 f"{self.tail()}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    async def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (drain) and wait; SIGKILL past ``timeout``."""
        await asyncio.to_thread(kit.stop_process, self.proc, timeout)


    def tool_children(self) -> list[psutil.Process]:
        """The sidecar's child processes that run a job's tool: not its guardian, and not
        an attempt prepared ahead of its job (issue 42: its launcher, and bwrap's two
        processes around it, carry no SIDECAR_JOB_ID until the job's line arrives)."""
        try:
            kids = psutil.Process(self.pid).children()
        except psutil.Error:
            return []
        out = []
        for kid in kids:
            try:
                if "sidecar.worker.guardian" not in " ".join(kid.cmdline()) \
                        and kid.status() != psutil.STATUS_ZOMBIE and _runs_a_job(kid):
                    out.append(kid)
            except psutil.Error:
                continue
        return out

    def guardian(self) -> psutil.Process | None:
        try:
            for kid in psutil.Process(self.pid).children():
                if "sidecar.worker.guardian" in " ".join(kid.cmdline()):
                    return kid
        except psutil.Error:
            pass
        return None


async def stop_all(sidecars: list[Sidecar], timeout: float = 15.0) -> None:
    """SIGTERM every sidecar at once (each drains), wait until all have exited, SIGKILL
    what still runs after ``timeout`` seconds. One signal each: a second SIGTERM would
    make a draining sidecar kill its tools at once. (``stop`` one by one would wait in
    turn, a few threads at a time, behind a fleet's slowest.)"""
    running = [s.proc for s in sidecars if s.proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in running) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for proc in running:
        if proc.poll() is None:
            proc.kill()
    for proc in running:
        await asyncio.to_thread(proc.wait, 5)


async def until(predicate: Callable[[], Awaitable[T | None]], timeout: float,
                interval: float = 0.02, what: str = "a condition") -> T:
    """Await ``predicate()`` until it returns something truthy; BenchError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


# --- database -------------------------------------------------------------------


async def connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn, server_settings={"application_name": "bench"})
    await init_connection(conn)
    return conn


def database_name(dsn: str) -> str:
    """The database a DSN names (its path; a socket directory rides in the query)."""
    return urlsplit(dsn).path.lstrip("/")


async def create_scratch_database(admin_dsn: str) -> str:
    """A new database ``bench_<hex>`` on the server of ``admin_dsn``; its DSN."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    except asyncpg.PostgresError as exc:
        raise BenchError(f"cannot create the scratch database {name} ({exc}); the bench needs "
                         "a role allowed to CREATE DATABASE") from None
    finally:
        await conn.close()
    dsn = with_database(admin_dsn, name)
    assert database_name(dsn) == name, dsn
    return dsn


async def drop_database(admin_dsn: str, dsn: str) -> None:
    """Drop the scratch database (only ever one this run created: ``bench_*``)."""
    name = database_name(dsn)
    if not name.startswith("bench_") or name == database_name(admin_dsn):
        raise BenchError(f"refusing to drop {name!r}: not a scratch database of the bench")
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


ENQUEUE_MANY = """
WITH ins AS (
    INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, run_after,
                           created_at, concurrency_key)
    SELECT gen_random_uuid(), $1, $2 || ':' || g, $3::jsonb, $5,
           clock_timestamp() + $6::float8 * interval '1 second', clock_timestamp(),
           coalesce(($7::text[])[1 + (g - 1) % cardinality($7::text[])], '')
    FROM generate_series(1, $4) AS g
    RETURNING id
)
INSERT INTO tool_job_events (job_id, fencing_token, event, details)
SELECT id, 0, 'job_enqueued', '{}'::jsonb FROM ins
"""


async def enqueue_many(conn: asyncpg.Connection, tool: str, count: int, payload: str = "{}",
                       notify: bool = True, max_attempts: int = 3,
                       delay_seconds: float = 0.0,
                       concurrency_keys: list[str] | None = None) -> None:
    """``count`` queued jobs of ``tool`` in one transaction, each with its ``job_enqueued``
    journal row as ``sidecar enqueue`` writes it; one NOTIFY at commit when ``notify``.
    Each row gets its own ``clock_timestamp()``, as jobs enqueued one by one would.
    ``concurrency_keys`` (flow control, issue 27): job i (from 0) gets key
    ``concurrency_keys[i % len]``; None or empty: no key."""
    async with conn.transaction():
        await conn.execute(ENQUEUE_MANY, tool, f"bench:{uuid.uuid4().hex}", payload, count,
                           max_attempts, delay_seconds, concurrency_keys or None)
        if notify:  # as the enqueue statement does: wake idle sidecars of the tool
            await conn.execute("SELECT tool_job_wake($1, $2)", tool, count)


async def enqueue_one(conn: asyncpg.Connection, tool: str, payload: str = "{}",
                      max_attempts: int | None = 1,
                      details: dict[str, Any] | None = None,
                      concurrency_key: str | None = None) -> uuid.UUID:
    """One queued job of ``tool`` by the statement ``sidecar enqueue`` runs (enqueue_job:
    tool_job_enqueue, its journal row, one idle sidecar of the tool woken); its id.
    ``concurrency_key``: the flow-control key (issue 27), None for none."""
    import orjson

    from sidecar.storage.queries import Q

    # The query's JSON parameters are text ($2, $8, $13); $14 an expiry time (none); $15
    # the concurrency key; $16 the session, $17 the dedupe policy, $18 the interest (none).
    row = await conn.fetchrow(Q["enqueue_job"], tool, payload, None, None, None,
                              None, None, None, max_attempts, None, None, None,
                              orjson.dumps(details if details is not None
                                           else {"by": "bench"}).decode(), None,
                              concurrency_key, None, None, None)
    return row["id"]


async def measure_clock_offset(conn: asyncpg.Connection) -> float:
    """Database clock minus this machine's wall clock, in seconds (best of 5 round trips)."""
    best = None
    for _ in range(5):
        before = time.time()
        db_now = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
        after = time.time()
        if best is None or after - before < best[0]:
            best = (after - before, db_now - (before + after) / 2)
    return best[1]


# --- statistics and formatting ----------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def ms(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "n/a"
    value = seconds * 1000
    if value < 1:  # a claim statement: tens of microseconds, two places would hide them
        return f"{value:.3f} ms"
    return f"{value:.2f} ms" if value < 10 else f"{value:.0f} ms" if value >= 100 \
        else f"{value:.1f} ms"


def rate(per_second: float) -> str:
    if per_second is None or math.isnan(per_second):
        return "n/a"
    return f"{per_second:,.0f} jobs/s" if per_second >= 100 else f"{per_second:.1f} jobs/s"


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 1048576:.1f} MiB"


def helper_argv(module: str, *args: Any) -> list[str]:
    """``python -m bench.<module> ARGS`` (a helper process of the bench)."""
    return [sys.executable, "-m", f"bench.{module}", *map(str, args)]


async def run_helpers(ctx: Context, argvs: list[list[str]], timeout: float,
                      env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run helper processes at once; each prints one JSON object on stdout."""
    logs = [ctx.tmp / f"helper-{uuid.uuid4().hex[:8]}.log" for _ in argvs]
    procs = [ctx.popen(argv, env=env or clean_env(), log=log, stdout=subprocess.PIPE)
             for argv, log in zip(argvs, logs, strict=True)]
    loop = asyncio.get_running_loop()
    try:
        outs = await asyncio.wait_for(asyncio.gather(
            *(loop.run_in_executor(None, proc.communicate) for proc in procs)), timeout)
    except TimeoutError:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        raise BenchError(f"helper {argvs[0][2]} did not finish within {timeout:g} s") from None
    results = []
    for proc, (stdout, _), log in zip(procs, outs, logs, strict=True):
        if proc.returncode != 0:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise BenchError(f"helper {' '.join(proc.args[2:4])} exited {proc.returncode}: "
                             f"{tail}")
        results.append(orjson.loads(stdout))
    return results
