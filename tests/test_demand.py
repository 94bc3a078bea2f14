"""The scaler's demand is what claims can really take (issue 41, point 3): tool_job_demand
(what KEDA scales on) counts the jobs running under a live lease plus those claims could
take now, by the claim's own rules (sidecar/storage/sql/functions/claimable.sql): per-key
caps, rates, a pause, expiries and due times. Each case is set up, its demand read, and
then the sidecar's own claim statement (WorkerStore.claim) is run until it takes nothing
more: the jobs it took are exactly what the demand said could start. On a real PostgreSQL,
with the operator's own statements for limits and pauses."""

from __future__ import annotations

import pytest

from sidecar.protocol.enqueue_args import EnqueueOptions
from sidecar.protocol.flow import ClaimHeld, Held, limit_changes
from sidecar.protocol.model import ClaimedJob, RawJson
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.operator_store import OperatorStore
from sidecar.storage.worker_store import WorkerStore
from tests.kit import run

pytestmark = pytest.mark.database

LEASE = 60.0  # no lease ends by itself during a test


class Queue:
    """One pool, and the three stores a test needs on it: the caller's (enqueue), the
    operator's (limits, pause, cancel) and the worker's (the claim)."""

    def __init__(self, pool):
        self.pool = pool
        self.caller, self.admin, self.worker = (CallerStore(pool, 30), OperatorStore(pool, 30),
                                                WorkerStore(pool, 30))

    async def enqueue(self, tool: str, count: int, key: str | None = None) -> list:
        return [(await self.caller.enqueue(tool, RawJson("{}"), None, 3, {"by": "test"},
                                           EnqueueOptions(concurrency_key=key)))[0]
                for _ in range(count)]

    async def limit(self, tool: str, **limits) -> None:
        await self.admin.set_limits(tool, limit_changes(**limits), "test")

    async def claim(self, tool: str, count: int) -> list[ClaimedJob]:
        jobs = [await self.worker.claim(tool, "before", LEASE, None, 3) for _ in range(count)]
        assert all(isinstance(job, ClaimedJob) for job in jobs), jobs
        return jobs

    async def demand(self, tool: str) -> int:
        return await self.pool.fetchval("SELECT tool_job_demand($1)", tool)

    async def running(self, tool: str) -> int:
        return await self.pool.fetchval(
            "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state = 'running' "
            "AND lease_until >= now()", tool)

    async def claim_until_none(self, tool: str) -> int:
        """Claims, one after another, until one takes nothing (a limit held the rest, or
        nothing is left; a claim that stopped after its bound of keys goes on)."""
        taken = 0
        while True:
            outcome = await self.worker.claim(tool, "counter", LEASE, None, 3)
            if isinstance(outcome, ClaimedJob):
                taken += 1
            elif outcome != ClaimHeld(Held.MORE_KEYS, 0.0):
                return taken


async def _one_key_capped(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 30, key="tenant-a")
    await q.limit(tool, max_running_per_key=1)


async def _keys_capped_and_keyless(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 30, key="tenant-a")
    await q.limit(tool, max_running_per_key=2)
    await q.claim(tool, 1)  # one of tenant-a's, now running: a has one slot left
    await q.enqueue(tool, 5, key="tenant-b")
    await q.enqueue(tool, 3)  # no key: no per-key cap holds them


async def _paused(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 10)
    await q.claim(tool, 1)
    await q.admin.pause(tool, None, "test")


async def _rate(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 10)
    await q.limit(tool, rate="6/m")


async def _rate_with_burst(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 10)
    await q.limit(tool, rate="6/m", burst=3)


async def _rate_per_key(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 5, key="a")
    await q.enqueue(tool, 5, key="b")
    await q.enqueue(tool, 2)
    await q.limit(tool, rate_per_key="6/m")


async def _max_running(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 10)
    await q.limit(tool, max_running=4)
    await q.claim(tool, 1)


async def _cancelled_slot(q: Queue, tool: str) -> None:
    """A job cancelled while it ran keeps its slot until its owner confirms the tree dead
    (case F14): it is not running, yet a claim may not use its slot."""
    await q.enqueue(tool, 5)
    await q.limit(tool, max_running=3)
    [job] = await q.claim(tool, 1)
    assert await q.admin.cancel(job.id) == {job.id: "running"}


async def _past_expiry(q: Queue, tool: str) -> None:
    """Jobs past their expiry stay queued until a sidecar's sweep ends them (up to a poll
    period): no claim takes them."""
    expired = await q.enqueue(tool, 5)
    await q.enqueue(tool, 2)
    await q.pool.execute("UPDATE tool_jobs SET expires_at = now() - interval '1 second' "
                         "WHERE id = ANY($1::uuid[])", expired)


async def _past_expiry_keyed(q: Queue, tool: str) -> None:
    expired = await q.enqueue(tool, 4, key="k")
    await q.enqueue(tool, 1, key="k")
    await q.pool.execute("UPDATE tool_jobs SET expires_at = now() - interval '1 second' "
                         "WHERE id = ANY($1::uuid[])", expired)


async def _not_yet_due(q: Queue, tool: str) -> None:
    later = await q.enqueue(tool, 4)
    await q.enqueue(tool, 3)
    await q.pool.execute("UPDATE tool_jobs SET run_after = now() + interval '1 hour' "
                         "WHERE id = ANY($1::uuid[])", later)


async def _expired_leases(q: Queue, tool: str) -> None:
    """Two jobs whose owner's lease ended after their tools started (journaled, so the
    attempt is spent: case F16): one with an attempt left, taken over; one with none left,
    for the sweep to fail."""
    await q.enqueue(tool, 2)
    first, last = await q.claim(tool, 2)
    for job in (first, last):
        await q.worker.record_event(job.id, job.fencing_token, "tool_request_started", {})
    await q.pool.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 second', "
                         "attempt = CASE WHEN id = $2 THEN max_attempts ELSE attempt END "
                         "WHERE tool = $1", tool, last.id)


async def _no_limits(q: Queue, tool: str) -> None:
    await q.enqueue(tool, 7)
    await q.claim(tool, 2)


# case -> (setup, the demand it must give)
CASES = {
    "30 queued of one key, per-key cap 1": (_one_key_capped, 1),
    "keys under a per-key cap of 2, and jobs without a key": (_keys_capped_and_keyless,
                                                              1 + 1 + 2 + 3),
    "paused, one running": (_paused, 1),
    "a rate of 6/min": (_rate, 1),
    "a rate of 6/min with a burst of 3": (_rate_with_burst, 3),
    "a per-key rate of 6/min, two keys and jobs without one": (_rate_per_key, 1 + 1 + 2),
    "max_running 4, one running": (_max_running, 4),
    "max_running 3, a cancelled job's slot still taken": (_cancelled_slot, 2),
    "5 of 7 queued past their expiry": (_past_expiry, 2),
    "4 of a key's 5 past their expiry": (_past_expiry_keyed, 1),
    "4 of 7 due in an hour": (_not_yet_due, 3),
    "expired leases, one with an attempt left": (_expired_leases, 1),
    "no limits, two running": (_no_limits, 7),
}


def test_the_demand_is_what_claims_can_take_now(dsn):
    """For each case: the demand is the jobs running plus what claims, one after another,
    take now; after those claims it is the jobs running (nothing else could start)."""
    async def go():
        pool = await db.create_pool(dsn, 30, max_size=2)
        q = Queue(pool)
        found = {}
        try:
            for n, (case, (setup, _)) in enumerate(CASES.items()):
                tool = f"t{n}"
                await setup(q, tool)
                running, demand = await q.running(tool), await q.demand(tool)
                taken = await q.claim_until_none(tool)
                found[case] = {"demand": demand, "running then": running, "claims took": taken,
                               "demand after": await q.demand(tool),
                               "running after": await q.running(tool)}
        finally:
            await pool.close()
        return found

    found = run(go())
    wrong = {case: seen for case, seen in found.items()
             if seen["demand"] != CASES[case][1]
             or seen["demand"] != seen["running then"] + seen["claims took"]
             or seen["demand after"] != seen["running after"]}
    assert not wrong, wrong


def test_the_polls_depth_counts_only_what_the_claim_may_take(dsn):
    """The poll's depth (sidecar_queue_depth, and whether the poll claims at all) and queue
    age use the claim's row rules: not jobs past their expiry, nor expired leases with no
    attempt left, nor jobs due later."""
    async def go():
        pool = await db.create_pool(dsn, 30, max_size=2)
        q = Queue(pool)
        try:
            await _past_expiry(q, "d")  # 2 of 7 claimable
            await pool.execute("UPDATE tool_jobs SET run_after = now() - interval '1 hour' "
                               "WHERE tool = 'd' AND expires_at IS NOT NULL")
            sample = await q.worker.sample_tool("d", 3600)
            assert sample["depth"] == 2
            assert sample["queue_age"] < 600  # the jobs due an hour ago are past expiry
            await _expired_leases(q, "e")
            assert (await q.worker.sample_tool("e", 3600))["depth"] == 1
            await _not_yet_due(q, "f")
            assert (await q.worker.sample_tool("f", 3600))["depth"] == 3
        finally:
            await pool.close()

    run(go())
