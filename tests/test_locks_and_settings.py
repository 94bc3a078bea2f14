"""Cases F17 and F18: the lease path waits on nobody else's lock, and the sidecar's
sessions run under settings of its own, not the server's.

F17, kind "a lock held by someone else stalls the whole lease path": every statement of
the lease path is bounded against another session's lock. The renewal skips a locked row
(SKIP LOCKED; only that lease is "ownership unknown" and keeps its local deadline), and
the claim, commit, release, abandoned-lease probe and prune paths end a lock wait after the
sidecar's own lock_timeout (55P03: rolled back, known outcome, retried while the local
deadline allows; a lock timeout on a commit is never read as a lost lease).

F18, kind "the sidecar's sessions inherit the server's settings": statement_timeout,
lock_timeout, idle_in_transaction_session_timeout, the isolation level and the time zone
are set at connect (SET) or, behind a transaction pooler, per transaction (SET LOCAL); a
statement the server cancels on a timeout is logged with its SQLSTATE and is not an
outage; a commit too slow for the sidecar's own statement_timeout fails the attempt once
(``commit_timeout``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import asyncpg
import pytest

from kit import TOOLS, BouncerError, PgBouncer, base_env, cli, enqueue, query, scalar, wait_until
from sidecar.storage import db

TOOL = str(TOOLS / "lock_probe.py")
# A lease long enough to hold a table lock of a few seconds inside its local deadline:
# local deadline = renewal + 12 - (kill grace 1 + 1.2) = 9.8 s after a renewal is sent.
LONG = {"SIDECAR_LEASE_SECONDS": "12", "SIDECAR_HEARTBEAT_SECONDS": "2",
        "SIDECAR_DB_TIMEOUT_SECONDS": "4"}
LONG_POOL_LOCK_TIMEOUT = 2.0  # half of SIDECAR_DB_TIMEOUT_SECONDS (db.session_settings)


class HeldLock:
    """Another session (not a sidecar: application_name ``locker``) that runs ``sql`` in a
    transaction and holds what it locked for ``seconds``, then rolls back; in a thread."""

    def __init__(self, dsn: str, sql: str, *args, seconds: float):
        self.dsn, self.sql, self.args, self.seconds = dsn, sql, args, seconds
        self.acquired = threading.Event()
        self.error: BaseException | None = None
        self.released_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.acquired.wait(30), "the locker did not get its lock"
        assert self.error is None, self.error

    def _run(self) -> None:
        async def go():
            conn = await asyncpg.connect(self.dsn, server_settings={"application_name": "locker"})
            try:
                tx = conn.transaction()
                await tx.start()
                await conn.execute(self.sql, *self.args)
                self.acquired.set()
                await asyncio.sleep(self.seconds)
                await tx.rollback()
                self.released_at = time.monotonic()
            finally:
                await conn.close()

        try:
            asyncio.run(go())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self.acquired.set()

    def join(self) -> None:
        self.thread.join(60)
        assert self.error is None, self.error


def _runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _job(dsn: str, job_id: str):
    return query(dsn, "SELECT state, attempt, error->>'kind' AS kind FROM tool_jobs "
                      "WHERE id = $1", job_id)[0]


def _journal(dsn: str, job_id: str) -> list[str]:
    return [r["event"] for r in query(
        dsn, "SELECT event FROM tool_job_events WHERE job_id = $1 ORDER BY id", job_id)]


def _terminal(dsn: str, ids: list[str]) -> bool:
    return all(_job(dsn, i)["state"] in ("succeeded", "failed") for i in ids)


def _start_jobs(dsn, sidecars, tmp_path, count, seconds, env, nbytes=0):
    runs = [tmp_path / f"runs-{n}" for n in range(count)]
    ids = [enqueue(dsn, "probe", {"seconds": seconds, "runs": str(r), "bytes": nbytes},
                   env=env) for r in runs]
    sc = sidecars(dsn, [TOOL], "--tool", "probe", "--concurrency", str(count), env=env)
    wait_until(lambda: all(_runs(r) == 1 for r in runs), 30, what="every tool started")
    return ids, runs, sc


UNKNOWN = {"ownership_unknown", "lease_abandoned", "heartbeat_lost", "result_rejected"}


@pytest.mark.e2e
@pytest.mark.server
def test_f17_a_locked_row_costs_only_its_own_lease(dsn, sidecars, tmp_path):
    """Case F17 (kind: a lock held by someone else stalls the whole lease path), the issue's
    input on the fast profile (L = 3 s, H = 0.5 s): three running jobs on one sidecar,
    another session holds SELECT ... FOR UPDATE on job 1's row for 5 s, longer than the
    lease. Jobs 2 and 3 keep being renewed and finish on their first attempt with no
    "ownership unknown" at all; only job 1 is affected: unknown ("row locked"), abandoned
    at its local deadline (its tree killed), and run again once the lock is gone."""
    env = base_env(dsn)
    ids, runs, sc = _start_jobs(dsn, sidecars, tmp_path, 3, 7, env)
    lock = HeldLock(dsn, "SELECT 1 FROM tool_jobs WHERE id = $1 FOR UPDATE", ids[0],
                    seconds=5)
    lock.join()
    wait_until(lambda: _terminal(dsn, ids), 60, what="all three jobs to end")
    for job_id, run in zip(ids[1:], runs[1:], strict=True):
        assert dict(_job(dsn, job_id)) == {"state": "succeeded", "attempt": 1, "kind": None}
        assert _runs(run) == 1
        assert not UNKNOWN & set(_journal(dsn, job_id)), _journal(dsn, job_id)
        assert not [e for e in sc.events() if e.get("job_id") == job_id
                    and e["event"] in UNKNOWN], "a lock on job 1 touched another job"
    unknown = [e for e in sc.events("ownership_unknown") if e.get("job_id") == ids[0]]
    assert unknown and "locked" in unknown[0]["reason"], sc.events("ownership_unknown")
    assert [e for e in sc.events("lease_abandoned") if e.get("job_id") == ids[0]]
    assert _job(dsn, ids[0])["state"] == "succeeded"
    assert _runs(runs[0]) == 2


def _longest_lock_wait(dsn: str) -> float:
    return scalar(dsn, """
        SELECT coalesce(max(extract(epoch FROM clock_timestamp() - query_start)), 0)::float8
        FROM pg_stat_activity
        WHERE datname = current_database() AND application_name = 'sidecar'
          AND wait_event_type = 'Lock'""")


@pytest.mark.e2e
@pytest.mark.server
def test_f17_a_table_lock_is_waited_on_in_bounded_steps(dsn, sidecars, tmp_path):
    """Case F17 (kind: a lock held by someone else stalls the whole lease path): an
    ACCESS EXCLUSIVE lock on tool_jobs (what a non-concurrent CREATE INDEX or VACUUM FULL
    takes) held 6 s, well inside the local deadline (9.8 s after a renewal at L = 12 s).
    No statement of the sidecar waits on it longer than its own lock_timeout (no backend
    left waiting behind a client that gave up, to run its claim or renewal later); each
    renewal ends in 55P03, logged with its SQLSTATE as ownership unknown, and once the
    lock is gone the three jobs are renewed and finish on their first attempt."""
    env = base_env(dsn, **LONG)
    ids, runs, sc = _start_jobs(dsn, sidecars, tmp_path, 3, 9, env)
    lock = HeldLock(dsn, "LOCK TABLE tool_jobs IN ACCESS EXCLUSIVE MODE", seconds=6)
    longest = 0.0
    while lock.released_at is None and lock.thread.is_alive():
        longest = max(longest, _longest_lock_wait(dsn))
        time.sleep(0.1)
    lock.join()
    assert longest < LONG_POOL_LOCK_TIMEOUT + 1.0, \
        f"a sidecar statement waited {longest:.1f} s on the table lock"
    codes = {e.get("sqlstate") for e in sc.events("ownership_unknown")}
    assert "55P03" in codes, sc.events("ownership_unknown")
    wait_until(lambda: _terminal(dsn, ids), 60, what="all three jobs to end")
    for job_id, run in zip(ids, runs, strict=True):
        assert dict(_job(dsn, job_id)) == {"state": "succeeded", "attempt": 1, "kind": None}
        assert _runs(run) == 1
    assert not sc.events("lease_abandoned")


@pytest.mark.e2e
@pytest.mark.server
def test_f17_a_commit_waits_out_a_row_lock_without_losing_the_lease(dsn, sidecars, tmp_path):
    """Case F17 (kind: a lock held by someone else stalls the whole lease path), the commit
    path: the tool ends while another session holds its row FOR UPDATE for 5 s (less than
    the local deadline). The fenced commit ends each wait at the lock_timeout (55P03, logged
    with its SQLSTATE as commit_retry), which is neither an outage nor a lost lease, and
    commits once the lock is gone: one run, first attempt, nothing rejected."""
    env = base_env(dsn, **LONG)
    ids, runs, sc = _start_jobs(dsn, sidecars, tmp_path, 1, 1.5, env)
    lock = HeldLock(dsn, "SELECT 1 FROM tool_jobs WHERE id = $1 FOR UPDATE", ids[0],
                    seconds=5)
    lock.join()
    wait_until(lambda: _terminal(dsn, ids), 30, what="the job to end")
    assert dict(_job(dsn, ids[0])) == {"state": "succeeded", "attempt": 1, "kind": None}
    assert _runs(runs[0]) == 1
    retries = [e for e in sc.events("commit_retry") if e.get("job_id") == ids[0]]
    assert retries and {e.get("sqlstate") for e in retries} == {"55P03"}, retries
    assert not sc.events("result_rejected") and not sc.events("lease_abandoned")


@pytest.fixture(params=["none", "transaction"])
def pooled_dsn(request, dsn, server_dsn):
    """The test database directly, or through a PgBouncer in transaction mode."""
    if request.param == "none":
        yield dsn, {}
        return
    try:
        bouncer = PgBouncer(server_dsn)
    except BouncerError as exc:
        pytest.fail(f"{exc} (case F18 behind a transaction pooler needs it)")
    try:
        yield bouncer.dsn_for(dsn), {"SIDECAR_DATABASE_POOLER": "transaction"}
    finally:
        bouncer.stop()


def _alter_database(dsn: str, *settings: str) -> None:
    name = query(dsn, "SELECT current_database()")[0][0]  # any DSN form (the embedded one
    # names its socket directory in the query string)
    for setting in settings:
        query(dsn, f'ALTER DATABASE "{name}" SET {setting}')


@pytest.mark.e2e
@pytest.mark.server
def test_f18_server_timeouts_do_not_reach_the_sidecar(pooled_dsn, dsn, sidecars, tmp_path):
    """Case F18 (kind: the sidecar's sessions inherit the server's settings), the issue's
    input: the database says statement_timeout = 100ms (and idles out transactions after
    100 ms, and defaults to serializable); a tool returns a 7 MiB result. The sidecar's own
    settings apply, directly and behind PgBouncer in transaction mode (SET LOCAL per
    transaction): the commit succeeds and the tool ran exactly once."""
    target, extra = pooled_dsn
    _alter_database(dsn, "statement_timeout = '100ms'",
                    "idle_in_transaction_session_timeout = '100ms'",
                    "default_transaction_isolation = 'serializable'")
    assert scalar(dsn, "SHOW statement_timeout") == "100ms"  # a new session inherits it
    env = base_env(target, **extra)
    runs = tmp_path / "runs"
    job_id = enqueue(target, "probe", {"runs": str(runs), "bytes": 7 * 2**20}, env=env)
    sidecars(target, [TOOL], "--tool", "probe", env=env)
    wait_until(lambda: _terminal(dsn, [job_id]), 60, what="the job to end")
    assert dict(_job(dsn, job_id)) == {"state": "succeeded", "attempt": 1, "kind": None}
    assert _runs(runs) == 1
    assert scalar(dsn, "SELECT octet_length(result::text) FROM tool_jobs WHERE id = $1",
                  job_id) > 7 * 2**20


SLOW_SUCCESS = ("""
CREATE FUNCTION f18_slow_success() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'succeeded' THEN PERFORM pg_sleep(3); END IF;
    RETURN NEW;
END $$""", """
CREATE TRIGGER f18_slow_success BEFORE UPDATE ON tool_jobs
    FOR EACH ROW EXECUTE FUNCTION f18_slow_success()""")


@pytest.mark.e2e
@pytest.mark.server
def test_f18_a_commit_too_slow_for_our_own_timeout_fails_once(dsn, sidecars, tmp_path):
    """Case F18 (kind: a statement cancelled by a timeout is treated as an outage): the
    success commit takes 3 s (a trigger of this test's database sleeps), longer than the
    sidecar's own statement_timeout (0.9 x SIDECAR_DB_TIMEOUT_SECONDS = 1.8 s). The server
    cancels it (57014, logged with its SQLSTATE); it is not retried as an outage until the
    local deadline nor re-run: the attempt fails once as ``commit_timeout`` and the tool
    ran exactly once."""
    for statement in SLOW_SUCCESS:
        query(dsn, statement)
    env = base_env(dsn, **{**LONG, "SIDECAR_DB_TIMEOUT_SECONDS": "2"})
    runs = tmp_path / "runs"
    job_id = enqueue(dsn, "probe", {"runs": str(runs), "bytes": 10}, env=env)
    sc = sidecars(dsn, [TOOL], "--tool", "probe", env=env)
    wait_until(lambda: _terminal(dsn, [job_id]), 60, what="the job to end")
    assert dict(_job(dsn, job_id)) == {"state": "failed", "attempt": 1,
                                       "kind": "commit_timeout"}
    assert _runs(runs) == 1
    cancelled = sc.wait_event("commit_cancelled", job_id=job_id)
    assert cancelled["sqlstate"] == "57014"
    assert not sc.events("commit_retry") and not sc.events("lease_abandoned")


@pytest.mark.unit
def test_f18_session_settings_follow_the_client_bound():
    """Case F18: the settings derive from the client-side bound of a session's statements:
    the server ends a statement (0.9 x) before the client stops waiting, a lock wait (0.5 x)
    well before that; idling in a transaction is bounded too."""
    settings = db.session_settings(4.0)
    assert settings["statement_timeout"] == "3600ms"
    assert settings["lock_timeout"] == "2000ms"
    assert settings["idle_in_transaction_session_timeout"] == "60000ms"
    assert settings["default_transaction_isolation"] == "read committed"
    assert db.session_settings(0.4)["lock_timeout"] == "200ms"
    assert all(value != "0" and not value.startswith("0ms")
               for value in db.session_settings(0.001).values())


@pytest.mark.e2e
@pytest.mark.server
def test_f18_cli_sessions_carry_the_settings(dsn):
    """Case F18: a command's session shows the sidecar's own settings, whatever the
    database says (``sidecar jobs`` works under a database statement_timeout of 1 ms)."""
    _alter_database(dsn, "statement_timeout = '1ms'")
    done = cli(dsn, "jobs")
    assert done.returncode == 0, done.stderr.decode()
