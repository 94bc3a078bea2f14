"""Waiting costs O(1) connections and always says why (issue 41, points 14 and 4), on a
real PostgreSQL: many waits of one Client share ONE LISTEN connection (its pool's
connections + 1 on the server, counted in pg_stat_activity for the test's database) and
every wait gets its job's end; a queued job's waiter learns why it waits (no live
sidecar, paused, its key's slot, the jobs before it), and a job whose start deadline
passed ends ``expired`` even when no sidecar of its tool runs. The MCP side of both
points is in test_mcp_waiting.py."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from kit import query, scalar, wait_until_async
from sidecar.client import Client, JobProgress
from sidecar.protocol.flow import limit_changes
from sidecar.storage import db
from sidecar.storage.operator_store import OperatorStore

pytestmark = pytest.mark.database

WAITERS = 150
POOL = 2


def _connections(dsn: str) -> int:
    """The server's sessions of the sidecar (application_name sidecar, sidecar-listen)
    on the test's own database."""
    return scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND application_name LIKE 'sidecar%'")


def _finish(dsn: str, job_ids: list[uuid.UUID]) -> None:
    """End the jobs succeeded in one statement (the trigger NOTIFYs each one's channel,
    as a sidecar's fenced finish does)."""
    query(dsn, "UPDATE tool_jobs SET state = 'succeeded', finished_at = now(), "
               "result = jsonb_build_object('n', id::text) "
               "WHERE id = ANY($1::uuid[])", [str(j) for j in job_ids])


def test_many_waits_share_one_listen_connection_and_all_end(dsn):
    """150 waits at once on one Client whose pool holds 2 connections: the server sees
    at most 3 sessions of it (the pool + the hub's LISTEN connection), and each wait gets
    its own job's result once the jobs end. Was: one connection per wait (151)."""

    async def main():
        async with Client(dsn, max_connections=POOL) as client:
            refs = [await client.enqueue("nobody", {"i": i}) for i in range(WAITERS)]
            waits = [asyncio.ensure_future(client.wait(ref, timeout=60)) for ref in refs]
            counts = []
            for _ in range(20):  # the waits settle in: sample the server's sessions
                counts.append(await asyncio.to_thread(_connections, dsn))
                await asyncio.sleep(0.1)
            assert max(counts) <= POOL + 1, f"{max(counts)} sessions for {WAITERS} waits"
            hub = client._hub
            await wait_until_async(lambda: hub.listening == WAITERS, 30,
                                   what="every job's channel to be listened on")
            await asyncio.to_thread(_finish, dsn, [ref.id for ref in refs])
            ends = await asyncio.gather(*waits)
            assert [end.state for end in ends] == ["succeeded"] * WAITERS
            assert [end.result["n"] for end in ends] == [str(ref.id) for ref in refs]
            assert await asyncio.to_thread(_connections, dsn) <= POOL + 1
            await wait_until_async(lambda: hub.listening == 0, 10,
                                   what="the ended jobs' channels to be unlistened")

    asyncio.run(main())


async def _first_reason(client: Client, job_id: uuid.UUID) -> JobProgress:
    """The first JobProgress with ``waiting`` set that ``follow(reasons=True)`` yields."""
    async with asyncio.timeout(30):
        async for event in client.follow(job_id, reasons=True):
            if isinstance(event, JobProgress) and event.waiting:
                return event
    raise AssertionError("the job ended before its waiter learned why it waited")


def _sidecar_seen(dsn: str, tool: str) -> None:
    """What a live sidecar of ``tool`` leaves in the database: its fleet's sweep turn."""
    query(dsn, "INSERT INTO tool_sweeps (tool) VALUES ($1) ON CONFLICT (tool) DO UPDATE "
               "SET swept_at = now()", tool)


def test_a_waiter_learns_why_its_job_waits(dsn):
    """Through the hub (follow with reasons) and Client.wait's on_progress: no live
    sidecar of the tool; its tool paused (with the reason given); its key's slot taken;
    queued behind two jobs; and a claimable job says nothing."""

    async def main():
        async with Client(dsn) as client:
            lonely = await client.enqueue("lonely", {})
            reason = await _first_reason(client, lonely.id)
            assert reason.waiting == "no_live_sidecar" and "no live sidecar" in reason.message
            seen: list[JobProgress] = []
            with pytest.raises(TimeoutError):
                await client.wait(lonely, timeout=4, on_progress=seen.append)
            assert [p.waiting for p in seen] == ["no_live_sidecar"]

            await asyncio.to_thread(_sidecar_seen, dsn, "held")
            pool = await db.create_pool(dsn, 10, 1)
            try:
                operator = OperatorStore(pool, 10)
                await operator.pause("held", "maintenance window", "test")
                paused = await client.enqueue("held", {})
                reason = await _first_reason(client, paused.id)
                assert reason.waiting == "paused" and "maintenance window" in reason.message
                await operator.resume("held", "test")
                await operator.set_limits("held", {"max_running_per_key": 1}, "test")
                # the tool's own cap and rate, read as the claim reads them (claimable.sql)
                for tool in ("capped", "slow"):
                    await asyncio.to_thread(_sidecar_seen, dsn, tool)
                await operator.set_limits("capped", limit_changes(max_running=1), "test")
                await operator.set_limits("slow", limit_changes(rate="1/m", burst=1), "test")
            finally:
                await pool.close()
            taken = await client.enqueue("capped", {"n": 1})
            await asyncio.to_thread(query, dsn, (
                "UPDATE tool_jobs SET state = 'running', owner_id = 'a-sidecar', "
                "lease_until = now() + interval '5 minutes', heartbeat_at = now(), "
                "attempt = 1 WHERE id = $1"), taken.id)
            capped = await client.enqueue("capped", {"n": 2})
            assert (await client.waiting_reason(capped.id)).reason == "max_running"
            await asyncio.to_thread(query, dsn, (
                "UPDATE tool_flow SET tokens = 0, tokens_at = now() WHERE tool = 'slow'"))
            slow = await client.enqueue("slow", {})
            assert (await client.waiting_reason(slow.id)).reason == "rate"
            running = await client.enqueue("held", {"n": 1}, concurrency_key="acme")
            await asyncio.to_thread(query, dsn, (
                "UPDATE tool_jobs SET state = 'running', owner_id = 'a-sidecar', "
                "lease_until = now() + interval '5 minutes', heartbeat_at = now(), "
                "attempt = 1 WHERE id = $1"), running.id)
            keyed = await client.enqueue("held", {"n": 2}, concurrency_key="acme")
            reason = await _first_reason(client, keyed.id)
            assert reason.waiting == "max_running_per_key"
            assert "key's slot" in reason.message

            await asyncio.to_thread(_sidecar_seen, dsn, "busy")
            first = await client.enqueue("busy", {"n": 1})
            await client.enqueue("busy", {"n": 2})
            third = await client.enqueue("busy", {"n": 3})
            reason = await _first_reason(client, third.id)
            assert (reason.waiting, reason.message) == (
                "queued_behind", "queued behind 2 job(s) of its tool")
            assert await client.waiting_reason(first.id) is None  # a claim takes it now

    asyncio.run(main())


def test_a_start_deadline_ends_a_waited_job_no_sidecar_serves(dsn):
    """A job with expires_in and no sidecar of its tool: its waiter (no reasons asked)
    gets it ended failed, kind expired, journaled job_expired; nobody else swept it."""

    async def main():
        async with Client(dsn) as client:
            ref = await client.enqueue("nobody", {}, expires_in=1)
            end = await client.wait(ref, timeout=30)
            assert end.state == "failed" and end.error["kind"] == "expired"
            return ref

    ref = asyncio.run(main())
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE job_id = $1 "
                       "AND event = 'job_expired'", ref.id) == 1
