"""Case F20: clocks that stop (suspend, pause, live migration).

The kind of fault: a local deadline of ownership kept on a clock that does not count the
time the host spent suspended. CLOCK_MONOTONIC stops in a suspend; the database clock
that ends a lease does not, so after a suspend past the lease the guard answered "go"
for a lease that had been taken over. Every local deadline of ownership now runs on
CLOCK_BOOTTIME (sidecar.protocol.clock): the conservative local deadline (tolerated silence),
the guard's answers, the renewal's new deadline, the fenced commit's retry bound, the
stage deadline and the lifetime cap. After a jump between the two clocks every lease is
unknown until a renewal sent after the jump confirms it.

A real suspend cannot be had in a test, so two tests stand for it:
- the control: the sidecar process is SIGSTOPped past its lease and taken over (both
  clocks go on, as they do in a pause the kernel sees); the tool asks the guard the whole
  time, and no "go" is answered after the takeover;
- a simulated suspend inside one process: a real lease keeper, guard and database, and
  the two clocks of sidecar.protocol.clock read with a suspend added (CLOCK_BOOTTIME jumps ahead
  of CLOCK_MONOTONIC, as the kernel does on resume), while the job is taken over in the
  database meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid

import asyncpg
import orjson
import pytest

from kit import FAST_PROFILE, base_env, enqueue, query, run, wait_until
from sidecar.protocol import clock
from sidecar.protocol.vocabulary import StopReason
from sidecar.runtime.config import load_settings
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker import supervisor
from sidecar.worker.guard import GuardServer
from sidecar.worker.lease import LeaseKeeper

TOOL = "clocked"
# L = 10 s, H = 0.5 s, J = 0.5 s: the local deadline lies 8 s after a renewal is sent
# (kill grace 1 s + L/10), and the guard says "go" while at least H + J = 1 s of it is left.
PROFILE = load_settings({**FAST_PROFILE, "SIDECAR_LEASE_SECONDS": "10",
                         "SIDECAR_JITTER_SECONDS": "0.5"}).profile(TOOL)


class Suspend:
    """sidecar.protocol.clock as a host that was suspended for ``seconds``: CLOCK_BOOTTIME and
    (CLOCK_BOOTTIME - CLOCK_MONOTONIC) read ``seconds`` more, the monotonic clock (and so
    the event loop) does not. Only the readings move; nothing else is replaced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch
        self.extra = 0.0
        real_now, real_suspended = clock.ownership_now, clock.suspended_seconds
        monkeypatch.setattr(clock, "ownership_now", lambda: real_now() + self.extra)
        monkeypatch.setattr(clock, "suspended_seconds", lambda: real_suspended() + self.extra)

    def resume_after(self, seconds: float) -> None:
        self.extra += seconds


@pytest.mark.unit
def test_the_ownership_clock_is_boottime_and_the_jump_rule():
    """Case F20 (pure): the ownership clock reads CLOCK_BOOTTIME, and only a growth of
    (BOOTTIME - MONOTONIC) beyond the tolerance counts as a suspend."""
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    now = clock.ownership_now()
    assert before <= now <= time.clock_gettime(time.CLOCK_BOOTTIME)
    base = clock.suspended_seconds()
    assert not clock.jumped(base, clock.suspended_seconds())
    assert not clock.jumped(base, base + clock.JUMP_TOLERANCE_SECONDS / 2)
    assert clock.jumped(base, base + 5.0)


async def _claim(store: WorkerStore, owner: str):
    await CallerStore(store.pool, store.timeout).enqueue(TOOL, {"n": uuid.uuid4().hex}, None, 3, {})
    job = await store.claim(TOOL, owner, PROFILE.lease_seconds)
    assert job is not None
    return job


async def _guard(url: str, token: str) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/guard", headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, orjson.loads(await response.read())


@contextlib.asynccontextmanager
async def held_lease(dsn: str):
    """A real lease keeper (heartbeating), guard and store of owner "w1", holding one
    freshly claimed job whose lease was renewed twice: yields (store, guard URL, lease,
    guard secret, job)."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init_connection)
    store = WorkerStore(pool, timeout=5)
    keeper = LeaseKeeper(dsn, "w1", PROFILE, store, db_timeout=2)
    guard = GuardServer(store, PROFILE, "w1")
    url = await guard.start()
    beating = asyncio.create_task(keeper.run())
    try:
        job = await _claim(store, "w1")
        lease = keeper.hold(job, clock.ownership_now())
        secret = guard.register(lease)
        await asyncio.sleep(PROFILE.heartbeat_seconds * 2)
        yield store, url, lease, secret, job
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await guard.stop()
        await pool.close()


@pytest.mark.database
def test_a_suspend_past_the_lease_makes_ownership_unknown_at_once_and_kills(
        dsn, monkeypatch):
    """Case F20: a suspend longer than the lease, during which the job is taken over in the
    database. From the first instant after the resume the guard refuses
    (ownership_unknown, never "go"), and the lease keeper gives the lease up by its local
    deadline on CLOCK_BOOTTIME at its next look, without waiting out the monotonic one."""
    suspend = Suspend(monkeypatch)

    async def go():
        async with held_lease(dsn) as (store, url, lease, secret, job):
            assert (await _guard(url, secret))[0] == 200  # confirmed, plenty left
            # The host sleeps for 2 L; meanwhile the lease ends by the database clock and
            # another owner takes the job (token 2).
            await store.db.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 s'"
                                   " WHERE id = $1", job.id)
            taken = await store.claim(TOOL, "usurper", 60)
            assert taken is not None and taken.fencing_token == job.fencing_token + 1
            suspend.resume_after(2 * PROFILE.lease_seconds)
            # The first question after the resume: the monotonic deadline is far off, the
            # boot-time one has passed.
            status, answer = await _guard(url, secret)
            assert (status, answer) == (409, {"reason": "ownership_unknown"})
            await asyncio.wait_for(lease.lost.wait(), PROFILE.heartbeat_seconds + 1)
            assert lease.reason in (StopReason.LOCAL_DEADLINE, StopReason.LEASE_LOST)
            status, answer = await _guard(url, secret)
            assert status == 409 and answer["reason"] in ("ownership_unknown", "lease_lost")
            row = await store.db.fetchrow("SELECT owner_id, fencing_token FROM tool_jobs "
                                          "WHERE id = $1", job.id)
            assert (row["owner_id"], row["fencing_token"]) == ("usurper", 2)

    run(go())


@pytest.mark.database
def test_a_short_suspend_is_unknown_until_a_renewal_after_it_confirms(dsn, monkeypatch):
    """Case F20: a suspend shorter than the local deadline. The lease is unknown from the
    resume (guard: ownership_unknown, ``clock_jump`` handled once) until a renewal sent
    after the jump confirms it; then the guard answers "go" again with the database's new
    lease, and nothing was killed."""
    suspend = Suspend(monkeypatch)

    async def go():
        async with held_lease(dsn) as (store, url, lease, secret, job):
            assert (await _guard(url, secret))[0] == 200
            suspend.resume_after(0.4)  # well inside the 3 s lease
            assert await _guard(url, secret) == (409, {"reason": "ownership_unknown"})
            # The keeper's next renewal (sent after the resume) confirms the lease.
            wait = time.monotonic() + 5
            while (await _guard(url, secret))[0] != 200:
                assert time.monotonic() < wait, "never confirmed again"
                await asyncio.sleep(0.05)
            assert not lease.lost.is_set() and lease.unknown_since is None
            while True:  # the episode is journaled by the round that confirmed it
                journal = [r["event"] for r in await store.db.fetch(
                    "SELECT event FROM tool_job_events WHERE job_id = $1 ORDER BY id",
                    job.id)]
                if "ownership_confirmed" in journal or time.monotonic() > wait:
                    break
                await asyncio.sleep(0.05)
            assert journal.count("ownership_unknown") == 1
            assert journal.count("ownership_confirmed") == 1

    run(go())


@pytest.mark.unit
def test_the_stage_deadline_counts_suspended_time(monkeypatch):
    """Case F20: the stage deadline runs on CLOCK_BOOTTIME: after a suspend longer than the
    time left, the deadline watcher returns within DEADLINE_CHECK_SECONDS of the resume,
    although the monotonic clock says almost nothing has passed."""
    suspend = Suspend(monkeypatch)

    async def go():
        watcher = asyncio.create_task(supervisor.watch_deadline(clock.ownership_now() + 600))
        await asyncio.sleep(0.1)
        assert not watcher.done()
        started = time.monotonic()
        suspend.resume_after(601)
        await asyncio.wait_for(watcher, supervisor.DEADLINE_CHECK_SECONDS + 1)
        return time.monotonic() - started

    assert run(go()) <= supervisor.DEADLINE_CHECK_SECONDS + 1


GUARD_POLLER = r"""#!/usr/bin/env python3
import json, os, signal, sys, time, urllib.request, urllib.error
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # asks on through the kill grace
log = json.load(sys.stdin)["log"]
url = os.environ["SIDECAR_GUARD_URL"] + "/v1/guard"
token = os.environ["SIDECAR_GUARD_TOKEN"]
while True:
    req = urllib.request.Request(url, data=b"", method="POST",
                                 headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = 0
    with open(log, "a") as f:
        f.write(f"{time.clock_gettime(time.CLOCK_REALTIME)} {status}\n")
    time.sleep(0.05)
"""


@pytest.mark.e2e
@pytest.mark.server
def test_control_a_stopped_sidecar_never_answers_go_after_a_takeover(
        dsn, sidecars, tmp_path):
    """Case F20, the control: the sidecar is SIGSTOPped past its lease while its tool asks
    the guard in a loop (ignoring SIGTERM, so it asks on through the kill grace); the job
    is taken over meanwhile. After SIGCONT, no answer of the guard given after the
    takeover is a "go" (200), and the tree is killed."""
    tool = tmp_path / "guard_poller.py"
    tool.write_text(GUARD_POLLER)
    tool.chmod(0o755)
    answers = tmp_path / "answers"
    sc = sidecars(dsn, [str(tool)], env=base_env(dsn))
    job_id = enqueue(dsn, tool.name, {"log": str(answers)})
    wait_until(lambda: answers.exists() and " 200" in answers.read_text(), 20,
               what="a first go from the guard")
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: query(dsn, "SELECT lease_until < now() AS gone FROM tool_jobs "
                                      "WHERE id = $1", uuid.UUID(job_id))[0]["gone"],
                   20, interval=0.2, what="the lease to end by the database clock")
        taken_at = query(dsn, """
            UPDATE tool_jobs SET owner_id = 'usurper', fencing_token = fencing_token + 1,
                lease_until = now() + interval '60 s'
            WHERE id = $1 RETURNING extract(epoch FROM clock_timestamp())::float8 AS at""",
                         uuid.UUID(job_id))[0]["at"]
        time.sleep(1.0)
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    sc.wait_event("child_killed", job_id=job_id, timeout=15)
    after = [line.split() for line in answers.read_text().splitlines()]
    late = [status for at, status in after if float(at) > taken_at]
    assert late, "the tool asked nothing after the takeover"
    assert "200" not in late, late
