"""Issue 28, point 1: wake-ups behind a transaction pooler. A sidecar behind PgBouncer in
transaction mode (SIDECAR_DATABASE_POOLER=transaction) with SIDECAR_LISTEN_DATABASE_URL
holds one session for LISTEN only, to the server itself, and sends everything else
through the pooler: a NOTIFY wakes it (its poll is 60 s, so nothing else could make it
claim in time); a listen connection the server ends is logged once (``listen_lost``), the
sidecar leaves the idle list and ``sidecar_listening`` is 0 until it reconnects
(``listen_restored``, 1 again) and is woken again; the server sees the pooler's pool plus
one connection per sidecar. ``sidecar wait`` and the Python client LISTEN there too.

The listen path of the recovery test runs through a TCP proxy the test controls
(tests/netproxy.py), so the outage lasts until the test ends it: the server ends the
listen backend (found by its application_name ``sidecar-listen`` in the test's own
database) while the proxy holds every new connection.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import asyncpg
import orjson
import pytest
from netproxy import through

from kit import (
    base_env,
    enqueue,
    metric_value,
    metrics_text,
    one_line_error,
    query,
    scalar,
    stop_process,
    wait_until,
)
from sidecar.client import Client
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore

pytestmark = [pytest.mark.e2e, pytest.mark.server]

TOOL = "listen-echo"
TOOL_OK = [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"ok\": true}')"]
SLEEPY = [sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(0.2); "
          "print('{\"ok\": true}')"]
# As tests/test_pgbouncer.py's (heartbeats interleave with two server connections), but a
# poll of 60 s: a job claimed within the tests' timeouts was claimed on a wake-up.
PROFILE = {
    "SIDECAR_LEASE_SECONDS": "10",
    "SIDECAR_HEARTBEAT_SECONDS": "0.5",
    "SIDECAR_JITTER_SECONDS": "5",
    "SIDECAR_DB_TIMEOUT_SECONDS": "5",
    "SIDECAR_POLL_SECONDS": "60",
    "SIDECAR_DATABASE_POOLER": "transaction",
    "SIDECAR_HTTP_ADDR": "127.0.0.1:0",
    "SIDECAR_LOG_LEVEL": "debug",  # listen_error: each failed reconnect of one outage
}
WOKEN = 30  # seconds a woken job may take, well inside the 60 s poll


def _env(bdsn: str, listen_dsn: str, **extra: str) -> dict[str, str]:
    return base_env(bdsn, **{**PROFILE, "SIDECAR_LISTEN_DATABASE_URL": listen_dsn, **extra})


def _idle(dsn: str) -> int:
    return scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars WHERE tool = $1", TOOL)


def _listeners(dsn: str) -> list[int]:
    """Server pids of the LISTEN connections in this test's own database."""
    return [r["pid"] for r in query(
        dsn, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
             "AND application_name = $1 AND pid <> pg_backend_pid()",
        db.LISTEN_APPLICATION_NAME)]


def _listening(addr: str) -> float | None:
    return metric_value(metrics_text(addr, timeout=5), "sidecar_listening", tool=TOOL)


def _succeeded(dsn: str, job_id: str, what: str) -> None:
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1::uuid",
                             job_id)[0]["state"] == "succeeded", WOKEN, interval=0.1,
               what=what)


def test_a_sidecar_behind_the_pooler_is_woken_on_its_listen_url_and_recovers_it(
        dsn, bouncer, sidecars, proxy):
    bdsn = bouncer.dsn_for(dsn)
    env = _env(bdsn, through(dsn, proxy.port))
    sc = sidecars(bdsn, TOOL_OK, "--tool", TOOL, env=env)
    addr = "http://" + sc.wait_event("worker_started", 30)["http_addr"]
    started = sc.wait_event("listen_started", 30)
    assert started["via"] == "SIDECAR_LISTEN_DATABASE_URL"
    assert not sc.events("listen_disabled")
    wait_until(lambda: _idle(dsn) == 1, 20, what="the sidecar on the idle list")
    assert _listening(addr) == 1
    [listener] = _listeners(dsn)

    job = enqueue(bdsn, TOOL, {}, env=env)  # through the pooler, NOTIFY included
    _succeeded(dsn, job, "the job, claimed on a wake-up (the poll is 60 s)")

    # The server ends the listen backend while the path to it holds every new connection.
    proxy.blackhole()
    [ended] = query(dsn, "SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity "
                         "WHERE pid = $1 AND application_name = $2 "
                         "AND datname = current_database()",
                    listener, db.LISTEN_APPLICATION_NAME)
    assert ended["done"]
    lost = sc.wait_event("listen_lost", 20)
    assert lost["level"] == "warning" and lost["via"] == "SIDECAR_LISTEN_DATABASE_URL"
    assert lost["reason"]
    wait_until(lambda: _listening(addr) == 0, 10, what="sidecar_listening 0")
    wait_until(lambda: _idle(dsn) == 0, 10,
               what="the deaf sidecar off the idle list (a wake-up would be lost)")
    sc.wait_event("listen_error", 30)  # a reconnect failed: the same outage

    proxy.restore()
    restored = sc.wait_event("listen_restored", 60)
    assert restored["down_s"] > 0
    names = [e["event"] for e in sc.events() if e["event"].startswith("listen_")]
    assert names.count("listen_lost") == 1, names  # once per outage, however many retries
    assert names.index("listen_lost") < names.index("listen_restored")
    wait_until(lambda: _listening(addr) == 1, 10, what="sidecar_listening 1 again")
    wait_until(lambda: _idle(dsn) == 1, 20, what="the sidecar on the idle list again")
    assert _listeners(dsn) not in ([], [listener])  # a new session

    again = enqueue(bdsn, TOOL, {}, env=env)
    _succeeded(dsn, again, "a job after the restore, claimed on a wake-up again")
    assert not sc.events("worker_failed")


def test_the_listen_url_is_used_without_a_pooler_too(dsn, sidecars):
    """SIDECAR_DATABASE_POOLER=none with SIDECAR_LISTEN_DATABASE_URL: LISTEN goes there."""
    env = _env(dsn, dsn, SIDECAR_DATABASE_POOLER="none")
    sc = sidecars(dsn, TOOL_OK, "--tool", TOOL, env=env)
    assert sc.wait_event("listen_started", 30)["via"] == "SIDECAR_LISTEN_DATABASE_URL"
    wait_until(lambda: _idle(dsn) == 1, 20, what="the sidecar on the idle list")
    job = enqueue(dsn, TOOL, {})
    _succeeded(dsn, job, "the job, claimed on a wake-up (the poll is 60 s)")


class _ServerConnections:
    """Samples, in a thread, the server connections of one database (the sampler's own
    excepted): the most there were, the most LISTEN connections among them, and the jobs
    succeeded so far (read here, so the test opens no other connection meanwhile)."""

    def __init__(self, dsn: str):
        self.dsn, self.peak, self.peak_listeners, self.succeeded = dsn, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._sample()))

    async def _sample(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            while not self._stop.is_set():
                row = await conn.fetchrow(
                    "SELECT count(*) AS total, count(*) FILTER (WHERE application_name = $1) "
                    "AS listeners FROM pg_stat_activity WHERE datname = current_database() "
                    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
                    db.LISTEN_APPLICATION_NAME)
                self.peak = max(self.peak, row["total"])
                self.peak_listeners = max(self.peak_listeners, row["listeners"])
                self.succeeded = await conn.fetchval(
                    "SELECT count(*) FROM tool_jobs WHERE state = 'succeeded'")
                await asyncio.sleep(0.02)
        finally:
            await conn.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def test_server_connections_are_the_pool_and_one_listener_per_sidecar(dsn, bouncer,
                                                                       sidecars):
    """Three sidecars at concurrency 2 behind a pool of two server connections, 40 jobs
    queued through the pooler: the server never sees more than 2 + 3 connections of the
    database (the test's own sampler excepted), three of them the listeners."""
    pool_size, count, jobs = 2, 3, 40  # the bouncer fixture's default_pool_size
    bdsn = bouncer.dsn_for(dsn)
    env = _env(bdsn, dsn)
    procs = [sidecars(bdsn, SLEEPY, "--tool", TOOL, "--concurrency", "2", env=env)
             for _ in range(count)]
    for proc in procs:
        proc.wait_event("listen_started", 30)
    wait_until(lambda: _idle(dsn) == count, 20, what="every sidecar on the idle list")

    async def enqueue_all() -> None:
        pool = await db.create_pool(bdsn, 10, max_size=2, pooler="transaction")
        try:
            store = CallerStore(pool, 10)
            for n in range(jobs):
                await store.enqueue(TOOL, {"n": n}, f"listen-{n}", 3, {})
        finally:
            await pool.close()

    with _ServerConnections(dsn) as seen:
        asyncio.run(enqueue_all())
        wait_until(lambda: seen.succeeded == jobs, 60, interval=0.1, what=f"{jobs} jobs done")
    assert seen.peak_listeners == count == len(_listeners(dsn))
    assert count <= seen.peak <= pool_size + count, (seen.peak, seen.peak_listeners)
    claimed = query(dsn, "SELECT DISTINCT details->>'owner_id' AS owner FROM tool_job_events "
                         "WHERE event = 'job_claimed'")
    assert len(claimed) >= 2  # the wake-ups spread the work


def test_wait_and_the_client_listen_on_the_listen_url_behind_the_pooler(dsn, bouncer,
                                                                        sidecars):
    """`sidecar wait` and Client.wait behind the pooler with SIDECAR_LISTEN_DATABASE_URL:
    no listen_disabled, a LISTEN session of their own on the server, the job's end."""
    bdsn = bouncer.dsn_for(dsn)
    env = _env(bdsn, dsn)
    job = enqueue(bdsn, TOOL, {}, env=env)
    waiter = subprocess.Popen([sys.executable, "-m", "sidecar", "wait", job, "--timeout",
                               "60s"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(_listeners(dsn)) == 1, 20, what="the waiter's LISTEN session")
        sidecars(bdsn, TOOL_OK, "--tool", TOOL, env=env)
        out, err = waiter.communicate(timeout=60)
    finally:
        stop_process(waiter, 5)
    assert waiter.returncode == 0, err.decode()
    assert orjson.loads(out)["state"] == "succeeded"
    assert b"listen_disabled" not in err

    async def client_wait() -> str:
        monitor = await asyncpg.connect(dsn)
        try:
            async with Client(bdsn, pooler="transaction", listen_dsn=dsn) as client:
                ref = await client.enqueue("listen-nobody", {})  # no sidecar runs it
                task = asyncio.create_task(client.wait(ref, timeout=WOKEN))
                sql = ("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND application_name = $1")
                while await monitor.fetchval(sql, db.LISTEN_APPLICATION_NAME) < 2:
                    assert not task.done(), task
                    await asyncio.sleep(0.05)  # the sidecar's listener and the waiter's
                await client.cancel(ref.id)
                return (await task).state
        finally:
            await monitor.close()

    assert asyncio.run(client_wait()) == "cancelled"


def test_an_unreachable_listen_url_leaves_the_sidecar_polling_and_is_named(dsn, bouncer,
                                                                          sidecars):
    """A listen server that cannot be reached at start: the sidecar starts all the same,
    says so once (listen_lost, the variable named), stays off the idle list with
    sidecar_listening 0, and its polls run the jobs; `sidecar wait` exits 1 with one line
    naming SIDECAR_LISTEN_DATABASE_URL."""
    bdsn = bouncer.dsn_for(dsn)
    nowhere = "postgresql://app:Unreachable-pw-4d2@127.0.0.1:1/nope"
    env = _env(bdsn, nowhere, SIDECAR_POLL_SECONDS="0.2")
    sc = sidecars(bdsn, TOOL_OK, "--tool", TOOL, env=env)
    addr = "http://" + sc.wait_event("worker_started", 30)["http_addr"]
    lost = sc.wait_event("listen_lost", 30)
    assert "SIDECAR_LISTEN_DATABASE_URL" in lost["reason"]
    assert "Unreachable-pw-4d2" not in sc.stderr_text()
    job = enqueue(bdsn, TOOL, {}, env=env)
    _succeeded(dsn, job, "the job, claimed by a poll")
    assert _listening(addr) == 0 and _idle(dsn) == 0
    assert not sc.events("listen_started") and len(sc.events("listen_lost")) == 1

    done = subprocess.run([sys.executable, "-m", "sidecar", "wait", job, "--timeout", "30s"],
                          env=env, capture_output=True, timeout=60)
    assert done.returncode == 1, done.stderr.decode()
    line = one_line_error(done)
    assert "SIDECAR_LISTEN_DATABASE_URL" in line and "Unreachable-pw-4d2" not in line
