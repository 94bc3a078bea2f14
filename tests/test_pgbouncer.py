"""Case F4: behind PgBouncer in transaction mode (Debian's package, pool size 2) with
SIDECAR_DATABASE_POOLER=transaction, four sidecars run 200 short jobs with claims,
heartbeats and commits interleaving: no prepared-statement error, every job succeeds,
LISTEN is replaced by polling. The reference receiver's fenced transactions work there too.

The test starts its own pgbouncer on a free port in front of the suite's server (TCP, or
the embedded server's Unix socket directory). PgBouncer refuses to run as root: as root
the test runs it as the owner of that socket directory, or as ``nobody``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import orjson
import pytest

from kit import Receiver, base_env, cli, query
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore

JOBS = 200
SIDECARS = 4
TOOL = "bouncer-echo"
# Fast enough that heartbeats interleave with the claims and commits of other jobs, with
# room for a queue of clients in front of two server connections on a busy machine.
PROFILE = {
    "SIDECAR_LEASE_SECONDS": "10",
    "SIDECAR_HEARTBEAT_SECONDS": "0.5",
    "SIDECAR_JITTER_SECONDS": "5",
    "SIDECAR_DB_TIMEOUT_SECONDS": "5",
    "SIDECAR_POLL_SECONDS": "0.2",
    "SIDECAR_DATABASE_POOLER": "transaction",
    "SIDECAR_LOG_LEVEL": "debug",  # heartbeat_ok lines show that renewals interleaved
}
PREPARED_ERRORS = ("prepared statement", "__asyncpg_stmt", "DuplicatePreparedStatement",
                   "InvalidSQLStatementName")


def _enqueue_many(bouncer_dsn: str, count: int) -> list[str]:
    """Enqueue ``count`` jobs through the pooler, 20 at a time, in this process."""

    async def go():
        pool = await db.create_pool(bouncer_dsn, 5, max_size=4, pooler="transaction")
        try:
            store = CallerStore(pool, 10)
            ids = []
            for start in range(0, count, 20):
                batch = await asyncio.gather(*(
                    store.enqueue(TOOL, {"n": n}, f"f4-{n}", 3, {})
                    for n in range(start, min(start + 20, count))))
                ids.extend(str(job_id) for job_id, _ in batch)
            return ids
        finally:
            await pool.close()

    return asyncio.run(go())


@pytest.mark.e2e
@pytest.mark.server
def test_f4_four_sidecars_behind_pgbouncer_transaction_mode(dsn, bouncer, sidecars, tmp_path):
    bdsn = bouncer.dsn_for(dsn)
    env = base_env(bdsn, **PROFILE)
    migrated = cli(bdsn, "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr.decode()
    ids = _enqueue_many(bdsn, JOBS)
    assert len(set(ids)) == JOBS
    # A short tool: sleeps a little so several leases are held and heartbeated at once.
    tool = tmp_path / "bouncer-echo"
    tool.write_text("#!/bin/sh\nsleep 0.3\nexec cat\n")
    tool.chmod(0o755)
    procs = [sidecars(bdsn, [str(tool)], "--tool", TOOL, "--concurrency", "3", "--drain",
                      env=env) for _ in range(SIDECARS)]
    for proc in procs:
        assert proc.wait(timeout=150) == 0, proc.stderr_text()[-3000:]

    states = query(dsn, "SELECT state, count(*) AS n FROM tool_jobs GROUP BY state")
    assert {r["state"]: r["n"] for r in states} == {"succeeded": JOBS}, states
    results = query(dsn, "SELECT idempotency_key, result FROM tool_jobs")
    assert all(r["result"] == {"n": int(r["idempotency_key"][3:])} for r in results)
    logs = "\n".join(proc.stderr_text() for proc in procs) + bouncer.log()
    for marker in PREPARED_ERRORS:
        assert marker not in logs, f"{marker!r} in the logs:\n{logs[-3000:]}"
    for proc in procs:
        assert proc.events("listen_disabled"), "LISTEN must give way to polling"
        assert not proc.events("worker_failed") and not proc.events("supervisor_error")
    assert sum(len(proc.events("heartbeat_ok")) for proc in procs) >= SIDECARS
    # Every sidecar did part of the work, so their statements really interleaved.
    claimed = query(dsn, "SELECT DISTINCT details->>'owner_id' AS owner FROM tool_job_events "
                         "WHERE event = 'job_claimed'")
    assert len(claimed) >= 2
    shown = cli(bdsn, "show", ids[0], env=env)
    assert shown.returncode == 0 and orjson.loads(shown.stdout)["state"] == "succeeded"


def _post(url: str, key: str, fence: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Idempotency-Key": key, "X-Execution-Fence": str(fence),
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.e2e
@pytest.mark.server
def test_reference_receiver_behind_pgbouncer(dsn, bouncer, tmp_path):
    """The receiver's pool gets the same pooler handling (db.create_pool): fenced
    transactions with a transaction-local lock_timeout, replays and stale fences."""
    log_path = tmp_path / "receiver.log"
    receiver = Receiver(base_env(bouncer.dsn_for(dsn), **PROFILE), log_path)
    try:
        url = receiver.url + "/effects"
        for round_ in range(3):  # the second and third rounds are replays
            for n in range(10):
                status, answer = _post(url, f"tool-job:e{n}:create_case", 2, {"case": n})
                assert status == 201, (round_, answer)
                assert answer["fence"] == 2
        status, answer = _post(url, "tool-job:e0:other_step", 1, {"case": 0})
        assert (status, answer["error"]) == (409, "stale_fence")
    finally:
        receiver.stop()
    assert len(query(dsn, "SELECT 1 FROM fence_effects")) == 10
    text = log_path.read_text(errors="replace") + bouncer.log()
    for marker in PREPARED_ERRORS:
        assert marker not in text, text[-3000:]


class _CountingIntrospection(db._PooledConnection):
    """The sidecar's connection class, counting asyncpg's type-introspection queries."""

    introspected: list = []

    async def _introspect_types(self, typeoids, timeout):
        type(self).introspected.append(list(typeoids))
        return await super()._introspect_types(typeoids, timeout)


@pytest.mark.database
def test_no_statement_needs_asyncpgs_type_introspection(dsn):
    """Behind a transaction pooler asyncpg's "jit off" guard around its introspection
    query runs on another server connection, so PostgreSQL JIT-compiles the query: 1-2 s
    of CPU per new connection (seen as heartbeat timeouts in a 64-sidecar fleet behind
    PgBouncer). Every statement of the sidecar's SQL prepares on a fresh connection
    without one."""
    import asyncpg

    from sidecar.storage.queries import Q

    async def check() -> list[str]:
        conn = await asyncpg.connect(dsn, connection_class=_CountingIntrospection)
        try:
            await db.init_connection(conn)
            needing = []
            for name, sql in Q.items():
                before = len(_CountingIntrospection.introspected)
                await conn.prepare(sql)
                if len(_CountingIntrospection.introspected) > before:
                    needing.append(name)
            # The check can fail: a uuid[] parameter is looked up.
            await conn.prepare("SELECT $1::uuid[]")
            assert len(_CountingIntrospection.introspected) >= 1
            return needing
        finally:
            await conn.close()

    _CountingIntrospection.introspected = []
    assert asyncio.run(check()) == []


@pytest.mark.e2e
@pytest.mark.server
def test_the_test_kits_pgbouncer_dies_with_the_process_that_started_it(server_dsn, tmp_path):
    """A bench or test run killed by SIGKILL must not leave its PgBouncer listening (seen:
    pgbouncer's own -u cleared the parent-death signal). A real process starts one through
    kit.PgBouncer, prints its pid and port, and is SIGKILLed: the pgbouncer we recorded
    goes, and its port stops answering."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from kit import pid_alive, wait_until

    starter = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; sys.path.insert(0, sys.argv[2]); import kit; "
         "b = kit.PgBouncer(sys.argv[1]); print(b.proc.pid, b.port, flush=True); "
         "time.sleep(120)", server_dsn, str(Path(__file__).parent)],
        stdout=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, starter.stdout.readline().split())
        assert pid_alive(pid)
        socket.create_connection(("127.0.0.1", port), 2).close()
    finally:
        os.kill(starter.pid, signal.SIGKILL)  # the process this test started
        starter.wait()
    wait_until(lambda: not pid_alive(pid), 10, what="pgbouncer gone with its starter")

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
        except OSError:
            return True
        return False

    assert refused()
