"""Issue 28: a fleet's polls do not come in step (sidecar.ops.periodic.spread_period).

Sidecars that cannot LISTEN (behind a transaction pooler, no SIDECAR_LISTEN_DATABASE_URL)
find their jobs by polling. If their polls fall at the same instant, every one of them
counts the same queued job and sends a claim, and all but one come back empty: the bench
found a fleet of 8 started together doing that, 1.22 claim statements per job and a job
waiting the whole poll period. Here 8 such sidecars are put in step on purpose: each is
stopped (SIGSTOP, by the pid this test started) past its poll period and all are
continued at once, so every one's wait ends in the same instant and each polls then. A
job queued between that poll and the next is claimed by one sidecar; the others' next
polls, drawn at different times, count nothing queued and send no claim. Each job also
costs one empty claim of the sidecar that ran it (it looks for more once its job ends).
Polls in step would send about 8 claims per job, 7 of them empty.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import pytest

import kit
from sidecar.ops.periodic import POLL_SPREAD, RESYNC_SPREAD, Periodic, spread_after, spread_period

TOOL = "poll-spread"
FLEET = 8
ROUNDS = 3
POLL = 1.0
TOOL_OK = [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"ok\": true}')"]


def _empty_claims(ports: list[int]) -> float:
    return sum(kit.metric_total(kit.metrics_text(f"http://127.0.0.1:{port}"),
                                "sidecar_claim_attempts_total", outcome="empty")
               for port in ports)


def _polls(port: int) -> float:
    return kit.metric_total(kit.metrics_text(f"http://127.0.0.1:{port}"), "sidecar_polls_total")


@pytest.mark.e2e
def test_a_fleet_put_in_step_sends_one_claim_per_job_not_one_per_sidecar(dsn, tmp_path):
    ports = [kit.free_port() for _ in range(FLEET)]
    fleet = [kit.SidecarProcess(dsn, TOOL_OK, "--tool", TOOL, env=kit.base_env(
        dsn, SIDECAR_DATABASE_POOLER="transaction", SIDECAR_POLL_SECONDS=str(POLL),
        SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}"), tmp=tmp_path) for port in ports]
    stopped: list[int] = []
    try:
        for sidecar in fleet:
            sidecar.wait_event("listen_disabled", timeout=60)
        before = _empty_claims(ports)  # every sidecar's /metrics, served before it polls
        jobs = []
        for n in range(ROUNDS):
            polled = []
            for sidecar, port in zip(fleet, ports, strict=True):
                polled.append(_polls(port))  # read the instant before its stop
                os.kill(sidecar.pid, signal.SIGSTOP)
                stopped.append(sidecar.pid)
            time.sleep(1.5 * POLL)  # every wait of the claim loops ends while stopped
            for sidecar in fleet:
                os.kill(sidecar.pid, signal.SIGCONT)
            stopped.clear()
            # All of them poll now, in the same instant, and count nothing queued: the job
            # comes after every one of those polls (on a busy machine they may take longer
            # than a fixed sleep, and a job queued before one would be claimed in step).
            for port, before_continue in zip(ports, polled, strict=True):
                kit.wait_until(lambda port=port, n=before_continue: _polls(port) > n, 30,
                               what="each sidecar's poll after its continue")
            jobs.append(kit.scalar(dsn, "SELECT sidecar_enqueue($1, $2::jsonb)::text",
                                   TOOL, f'{{"round": {n}}}'))
            kit.wait_until(lambda job=jobs[-1]: kit.job_row(dsn, job)["state"] == "succeeded",
                           30, what=f"round {n}'s job to succeed")
            time.sleep(1.5 * POLL)  # every sidecar's next poll has come and gone
        empty = _empty_claims(ports) - before
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for sidecar in fleet:
            sidecar.stop()
    claims = kit.scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_claimed' "
                             "AND job_id = ANY($1::uuid[])", jobs)
    assert claims == ROUNDS  # each job claimed once
    # One empty claim per job is the runner's own look for more; polls in step add
    # FLEET - 1 more per job (21 for 3 jobs when this was written without the spread; 3 to
    # 5 with it). Polls that happen to fall within a claim's time of each other are allowed.
    print("EMPTY", empty)
    assert empty <= 3 * ROUNDS + 2, f"{empty:g} empty claims for {ROUNDS} jobs"


# --- the pure rule and the periodic services that use it ---------------------------------

@pytest.mark.unit
def test_spread_period_stays_within_its_period_and_refuses_nonsense():
    assert spread_period(2.0, 0.0, POLL_SPREAD) == 2.0  # never longer than the period
    assert spread_period(2.0, 1.0, POLL_SPREAD) == pytest.approx(1.6)
    assert spread_period(2.0, 0.5, 0.9) == pytest.approx(1.1)
    assert spread_period(2.0, 0.7, 0.0) == 2.0  # no spread: the period itself
    for bad in ((-1.0, 0.5, 0.2), (2.0, 1.5, 0.2), (2.0, 0.5, -0.1), (2.0, 0.5, 1.1)):
        with pytest.raises(ValueError, match="spread_period"):
            spread_period(*bad)


@pytest.mark.unit
def test_a_wait_that_ended_later_than_its_spread_draws_the_next_over_the_wide_spread():
    # On time or late by less than the spread's width (0.2 of 1 s): the narrow spread.
    assert spread_after(0.0, 1.0, POLL_SPREAD) == POLL_SPREAD
    assert spread_after(0.2, 1.0, POLL_SPREAD) == POLL_SPREAD
    # Later than that (a pause ended every sidecar's wait at once): drawn as at start.
    assert spread_after(0.21, 1.0, POLL_SPREAD) == RESYNC_SPREAD
    assert spread_after(30.0, 2.0, POLL_SPREAD) == RESYNC_SPREAD
    assert spread_after(30.0, 2.0, 0.95) == 0.95  # never narrower than asked
    assert spread_after(30.0, 2.0, 0.0) == 0.0  # a service that asked for no spread
    for bad in ((-0.1, 1.0, 0.2), (0.0, -1.0, 0.2), (0.0, 1.0, 1.5)):
        with pytest.raises(ValueError, match="spread_after"):
            spread_after(*bad)


@pytest.mark.unit
def test_a_periodic_service_whose_wait_ended_late_draws_its_next_wait_wide(monkeypatch):
    """The event loop blocked in the middle of a wait (the shape of a host pause) ends it
    0.2 s late, more than the spread's width: the next wait is drawn over RESYNC_SPREAD
    (a draw of 1 makes a 0.05 s period's wait 0.005 s), and the one after, on time, over
    POLL_SPREAD again (0.04 s)."""
    monkeypatch.setattr(random, "random", lambda: 1.0)
    waits: list[float] = []

    async def step() -> None:
        return None

    async def main() -> None:
        loop = asyncio.get_running_loop()
        service = Periodic("late-test", 0.05, step, first=0, spread=POLL_SPREAD, errors=())
        measured = service._wait

        async def recorded(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 1:
                loop.call_later(0.01, time.sleep, 0.2)  # blocks the loop mid-wait
            await measured(seconds)
        service._wait = recorded  # type: ignore[method-assign]
        task = asyncio.ensure_future(service.run())
        while len(waits) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    kit.run(main())
    assert waits[:3] == pytest.approx([0.05 * (1 - POLL_SPREAD), 0.05 * (1 - RESYNC_SPREAD),
                                       0.05 * (1 - POLL_SPREAD)])


@pytest.mark.unit
def test_a_periodic_service_with_a_spread_draws_each_wait(monkeypatch):
    """The forwarder's shape (sidecar.worker.forwarder): with ``spread`` each wait after a run is
    drawn by spread_period. A draw of 1 with a spread of 1 makes a 30 s period's wait 0 s:
    the service runs again at once, where a plain one would wait the 30 s."""
    monkeypatch.setattr(random, "random", lambda: 1.0)

    async def runs(spread: float) -> int:
        count = 0

        async def step() -> None:
            nonlocal count
            count += 1

        service = asyncio.ensure_future(
            Periodic("spread-test", 30.0, step, first=0, spread=spread, errors=()).run())
        await asyncio.sleep(0.5)
        service.cancel()
        await asyncio.gather(service, return_exceptions=True)
        return count

    assert kit.run(runs(0.0)) == 1
    assert kit.run(runs(1.0)) > 3
