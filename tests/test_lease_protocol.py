"""The lease protocol at the database: atomic claim (P4), conditional heartbeat (P5),
conditional completion (P6) and the fencing token (P7), against a real PostgreSQL."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from kit import query, run, scalar
from sidecar.protocol.model import RawJson
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

pytestmark = pytest.mark.database


async def _stores(dsn: str, size: int = 4) -> tuple[CallerStore, WorkerStore]:
    """A caller's store (enqueue, cancel) and a worker's (claims, leases, fenced writes) on
    one pool, as a producer and a sidecar on one database."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, init=init_connection)
    return CallerStore(pool, timeout=10), WorkerStore(pool, timeout=10)


async def _expire(store: WorkerStore, job_id) -> None:
    """End a lease by the database's clock (as if its owner stopped heartbeating)."""
    await store.pool.execute(
        "UPDATE tool_jobs SET lease_until = now() - interval '1 millisecond' WHERE id = $1",
        job_id)


def test_concurrent_claimers_never_share_a_job(dsn):
    async def go():
        caller, store = await _stores(dsn, size=10)
        for i in range(200):
            await caller.enqueue("t", {"i": i}, None, 3, {})

        async def claimer(name):
            got = []
            while (job := await store.claim("t", name, 30)) is not None:
                got.append(job.id)
            return got

        results = await asyncio.gather(*(claimer(f"w{i}") for i in range(8)))
        await store.pool.close()
        return results

    results = run(go())
    claimed = [job for got in results for job in got]
    assert len(claimed) == 200
    assert len(set(claimed)) == 200
    assert sum(1 for got in results if got) > 1  # really concurrent
    rows = query(dsn, "SELECT attempt, fencing_token, state FROM tool_jobs")
    assert {(r["attempt"], r["fencing_token"], r["state"]) for r in rows} == {(1, 1, "running")}


async def _tool_started(store: WorkerStore, job) -> None:
    """What an owner journals once its tool started (sidecar.worker.supervisor, within
    JOURNAL_DEFER_SECONDS): an expiry of that attempt spends it. Without it the expired
    attempt is given back, not spent (case F16: tests/test_lost_answers.py)."""
    await store.record_event(job.id, job.fencing_token, "tool_request_started", {})


def test_expired_lease_is_reclaimed_with_next_token_and_old_owner_is_fenced(dsn):
    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {"x": 1}, None, 3, {})
        first = await store.claim("t", "w1", 30)
        await _tool_started(store, first)
        assert await store.claim("t", "w2", 30) is None  # a live lease is not handed out
        await _expire(store, job_id)
        second = await store.claim("t", "w2", 30)
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        renewed_old = await WorkerStore.extend_leases_if_owner(
            conn, "w1", [(job_id, first.fencing_token)], 30, 5)
        renewed_new = await WorkerStore.extend_leases_if_owner(
            conn, "w2", [(job_id, second.fencing_token)], 30, 5)
        await conn.close()
        stale_commit = await store.finish_if_owner(
            first, "w1", "succeeded", RawJson('{"from": "w1"}'), None, "job_succeeded", {})
        good_commit = await store.finish_if_owner(
            second, "w2", "succeeded", RawJson('{"from": "w2"}'), None, "job_succeeded", {})
        await store.pool.close()
        return job_id, first, second, renewed_old, renewed_new, stale_commit, good_commit

    job_id, first, second, renewed_old, renewed_new, stale, good = run(go())
    assert second.fencing_token == first.fencing_token + 1
    assert second.attempt == 2 and second.reclaimed
    assert renewed_old == {}  # zero rows: the old owner extends nothing
    assert (job_id, second.fencing_token) in renewed_new  # keyed by attempt (case F14)
    assert stale is False and good is True
    row = query(dsn, "SELECT state, result, fencing_token FROM tool_jobs WHERE id = $1", job_id)[0]
    assert row["state"] == "succeeded" and row["result"] == {"from": "w2"}
    assert row["fencing_token"] == second.fencing_token


def test_same_owner_name_with_old_token_cannot_extend(dsn):
    """P7: the token, not owner_id, tells the old owner from the new one."""

    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {}, None, 3, {})
        first = await store.claim("t", "same-name", 30)
        await _expire(store, job_id)
        await store.claim("t", "same-name", 30)
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        renewed = await WorkerStore.extend_leases_if_owner(
            conn, "same-name", [(job_id, first.fencing_token)], 30, 5)
        await conn.close()
        await store.pool.close()
        return renewed

    assert run(go()) == {}


def test_exhausted_expired_lease_fails_instead_of_running_again(dsn):
    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {}, None, 1, {})
        await _tool_started(store, await store.claim("t", "w1", 30))
        await _expire(store, job_id)
        claimed = await store.claim("t", "w2", 30)
        failed = await store.fail_exhausted_leases("t")
        await store.pool.close()
        return job_id, claimed, failed

    job_id, claimed, failed = run(go())
    assert claimed is None
    assert [r["id"] for r in failed] == [job_id]
    row = query(dsn, "SELECT state, error FROM tool_jobs WHERE id = $1", job_id)[0]
    assert row["state"] == "failed" and row["error"]["kind"] == "max_attempts_exceeded"
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE job_id = $1 AND event = "
                       "'job_failed'", job_id) == 1


def test_run_after_delays_the_claim(dsn):
    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {}, None, 3, {})
        job = await store.claim("t", "w1", 30)
        await store.requeue_if_owner(job, "w1", {"kind": "exit_code"}, 60, {})
        early = await store.claim("t", "w1", 30)
        await store.pool.execute("UPDATE tool_jobs SET run_after = now() WHERE id = $1", job_id)
        later = await store.claim("t", "w1", 30)
        await store.pool.close()
        return early, later

    early, later = run(go())
    assert early is None
    assert later is not None and later.attempt == 2 and later.fencing_token == 2


def test_cancel_makes_the_owner_heartbeat_get_zero_rows(dsn):
    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {}, None, 3, {})
        job = await store.claim("t", "w1", 30)
        previous = await caller.cancel(job_id)
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        renewed = await WorkerStore.extend_leases_if_owner(
            conn, "w1", [(job_id, job.fencing_token)], 30, 5)
        await conn.close()
        again = await caller.cancel(job_id)
        await store.pool.close()
        return previous, renewed, again

    previous, renewed, again = run(go())
    assert list(previous.values()) == ["running"] and renewed == {} and again == {}


def test_the_cancel_check_finds_only_the_owners_own_cancelled_attempts(dsn):
    """The check of a sidecar that cannot LISTEN (issue 41 point 12): among the leases it
    holds, the attempts cancelled while they ran, fenced on owner and token like the
    heartbeat; a running job, a stale token and another owner's cancel are not its."""

    async def go():
        caller, store = await _stores(dsn)
        for n in range(3):
            await caller.enqueue("t", {"n": n}, None, 3, {})
        mine = [await store.claim("t", "w1", 30) for _ in range(2)]
        theirs = await store.claim("t", "w2", 30)
        for job in (*mine[:1], theirs):
            await caller.cancel(job.id)
        held = [(job.id, job.fencing_token) for job in mine]
        found = await store.cancelled_leases("w1", held)
        stale = await store.cancelled_leases("w1", [(mine[0].id, mine[0].fencing_token + 1)])
        other = await store.cancelled_leases("w1", [(theirs.id, theirs.fencing_token)])
        nothing = await store.cancelled_leases("w1", [])
        await store.pool.close()
        return mine, found, stale, other, nothing

    mine, found, stale, other, nothing = run(go())
    assert found == [mine[0].id]
    assert stale == [] and other == [] and nothing == []


def test_heartbeats_are_hot_updates(dsn):
    """lease_until and heartbeat_at are unindexed, so renewals do not touch indexes."""

    async def go():
        caller, store = await _stores(dsn)
        job_id, _ = await caller.enqueue("t", {}, None, 3, {})
        job = await store.claim("t", "w1", 30)
        conn = await asyncpg.connect(dsn)
        await init_connection(conn)
        for _ in range(200):
            await WorkerStore.extend_leases_if_owner(conn, "w1", [(job_id, job.fencing_token)],
                                                     30, 5)
        await conn.close()
        await store.pool.close()

    run(go())
    indexed = {r["col"] for r in query(dsn, """
        SELECT a.attname AS col FROM pg_index i
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
        WHERE i.indrelid = 'tool_jobs'::regclass""")}
    assert not indexed & {"lease_until", "heartbeat_at"}


