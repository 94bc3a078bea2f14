"""Issue 44, point 2: interest leases. Calls nobody waits for any more stop.

A caller holds an interest under a key for a ttl and renews it (Client.interest, `sidecar
interest KEY --ttl D`); calls enqueued with ``interest=KEY`` belong to it. Once it lapses
(not renewed in time) or is let go, its queued calls end failed/expired, its running ones
are cancelled through the fenced path (kind abandoned_by_caller, the owner told at once,
the tree killed within about a second), and a result that arrives after is only
journaled (P6). The claim never starts a call of an interest past its end, swept or not.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import asyncpg
import orjson
import pytest

from kit import (
    SidecarProcess,
    base_env,
    cli,
    job_processes,
    job_row,
    one_line_error,
    query,
    read_pids,
    run,
    wait_until,
)
from sidecar.client import Client
from sidecar.protocol.enqueue_args import EnqueueOptions
from sidecar.protocol.errors import UsageError
from sidecar.protocol.model import RawJson
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

HANG = [sys.executable, str(Path(__file__).parent / "tools" / "hang_tree.py")]


async def _stores(dsn, size=3):
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, init=init_connection)
    return pool, CallerStore(pool, 10), WorkerStore(pool, 10)


@pytest.mark.database
def test_an_interest_is_held_renewed_and_held_again_as_a_new_generation(dsn):
    async def go():
        pool, caller, _ = await _stores(dsn)
        try:
            first = await caller.hold_interest("run-1", 30, "agent-a")
            renewed = await caller.hold_interest("run-1", 60, None)
            await caller.release_interest("run-1")
            again = await caller.hold_interest("run-1", 30, None)
            for bad in (("", 30, None), ("a\nb", 30, None), ("x" * 257, 30, None),
                        ("run-2", 0.5, None), ("run-2", 86401, None), ("run-2", 30, "a\tb")):
                with pytest.raises(UsageError, match="interest|ttl|holder"):
                    await caller.hold_interest(*bad)
            return first, renewed, again
        finally:
            await pool.close()

    first, renewed, again = run(go())
    assert first["generation"] == renewed["generation"] == 1
    assert renewed["expires_at"] > first["expires_at"]
    assert again["generation"] == 2
    [row] = query(dsn, "SELECT state, holder FROM tool_interests")
    assert dict(row) == {"state": "live", "holder": "agent-a"}


@pytest.mark.database
def test_a_call_needs_a_held_interest_and_is_not_started_once_it_ran_out(dsn):
    async def go():
        pool, caller, store = await _stores(dsn)
        try:
            with pytest.raises(UsageError, match="^interest 'nobody': not held now"):
                await caller.enqueue("it", {}, None, 3, {}, EnqueueOptions(interest="nobody"))
            await caller.hold_interest("brief", 1, None)
            job_id, _ = await caller.enqueue("it", {}, None, 3, {},
                                             EnqueueOptions(interest="brief"))
            await asyncio.sleep(1.3)  # by the database's clock, past its end; not swept
            claimed = await store.claim("it", "w1", 30)
            return job_id, claimed
        finally:
            await pool.close()

    job_id, claimed = run(go())
    assert claimed is None
    assert query(dsn, "SELECT count(*) AS n FROM tool_jobs")[0]["n"] == 1
    assert job_row(dsn, job_id)["state"] == "queued"  # until the sweep ends it


@pytest.mark.database
def test_a_lapse_ends_queued_calls_cancels_running_ones_and_refuses_their_late_results(dsn):
    async def go():
        pool, caller, store = await _stores(dsn)
        try:
            await caller.hold_interest("run-9", 1, None)
            running_id, _ = await caller.enqueue("it", {"n": 1}, None, 3, {},
                                                 EnqueueOptions(interest="run-9"))
            job = await store.claim("it", "w1", 60)
            queued_id, _ = await caller.enqueue("it", {"n": 2}, None, 3, {},
                                                EnqueueOptions(interest="run-9"))
            other_id, _ = await caller.enqueue("it", {"n": 3}, None, 3, {})
            await asyncio.sleep(1.3)
            ended = await store.lapse_interests()
            async with pool.acquire() as conn:  # the owner's heartbeat: zero rows
                renewed = await WorkerStore.extend_leases_if_owner(
                    conn, "w1", [(job.id, job.fencing_token)], 60, 10)
            late = await store.finish_if_owner(job, "w1", "succeeded", RawJson('{"late": 1}'),
                                               None, "job_succeeded", {})
            again = await store.lapse_interests()
            return running_id, queued_id, other_id, ended, renewed, late, again
        finally:
            await pool.close()

    running_id, queued_id, other_id, ended, renewed, late, again = run(go())
    assert {(r["job_id"], r["previous_state"]) for r in ended} == {
        (running_id, "running"), (queued_id, "queued")}
    assert again == []  # once
    running, queued = job_row(dsn, running_id), job_row(dsn, queued_id)
    assert running["state"] == "cancelled" and running["error"]["kind"] == "abandoned_by_caller"
    assert "'run-9' lapsed while it ran" in running["error"]["message"]
    assert running["result"] is None and late is False and renewed == {}
    assert queued["state"] == "failed" and queued["error"]["kind"] == "expired"
    assert job_row(dsn, other_id)["state"] == "queued"  # no interest, untouched
    assert query(dsn, "SELECT state FROM tool_interests")[0]["state"] == "lapsed"
    details = [r["details"] for r in query(
        dsn, "SELECT details FROM tool_job_events WHERE event = 'interest_lapsed' ORDER BY id")]
    assert sorted(d["previous_state"] for d in details) == ["queued", "running"]


@pytest.mark.database
def test_an_interest_lapsing_during_the_commit_wins_or_loses_whole(dsn):
    """The race: the lapse locks the call's row first; the owner's commit waits for it and
    then finds the call cancelled (nothing of the result kept). The other order: the
    commit first; the lapse then finds nothing unfinished."""
    async def go():
        pool, caller, store = await _stores(dsn, size=4)
        try:
            out = {}
            for order in ("lapse_first", "commit_first"):
                key = f"race-{order}"
                await caller.hold_interest(key, 30, None)
                job_id, _ = await caller.enqueue("it", {}, None, 3, {},
                                                 EnqueueOptions(interest=key))
                job = await store.claim("it", "w1", 60)
                conn = await pool.acquire()
                tx = conn.transaction()
                await tx.start()
                if order == "lapse_first":
                    await conn.fetch("SELECT * FROM tool_job_interest_lapse($1)", key)
                    commit = asyncio.ensure_future(store.finish_if_owner(
                        job, "w1", "succeeded", RawJson('{"r": 1}'), None, "job_succeeded", {}))
                    await asyncio.sleep(0.5)
                    assert not commit.done()  # waits on the lapse's row lock
                    await tx.commit()
                    out[order] = (job_id, await commit, [])
                else:
                    committed = await store.finish_if_owner(
                        job, "w1", "succeeded", RawJson('{"r": 1}'), None, "job_succeeded", {})
                    await tx.rollback()
                    ended = await caller.release_interest(key)
                    out[order] = (job_id, committed, ended)
                await pool.release(conn)
            return out
        finally:
            await pool.close()

    out = run(go())
    job_id, committed, _ = out["lapse_first"]
    row = job_row(dsn, job_id)
    assert committed is False and row["state"] == "cancelled" and row["result"] is None
    job_id, committed, ended = out["commit_first"]
    assert committed is True and ended == [] and job_row(dsn, job_id)["state"] == "succeeded"


@pytest.mark.database
def test_leaving_the_clients_interest_block_stops_its_unfinished_calls(dsn):
    async def go():
        async with Client(dsn) as client:
            async with client.interest("block-1", ttl=5) as key:
                ref = await client.enqueue("it", {}, interest=key)
            with pytest.raises(UsageError, match="ttl"):
                async with client.interest("block-2", ttl=0.1):
                    pass
            return ref

    ref = run(go())
    row = job_row(dsn, ref.id)
    assert row["state"] == "failed" and row["error"]["kind"] == "expired"
    assert "was let go" in row["error"]["message"]


@pytest.mark.e2e
def test_a_running_calls_tree_dies_once_nobody_renews_its_interest(dsn, tmp_path):
    """The agent stops renewing (it crashed): within the ttl plus a poll period the sweep
    lapses the interest, the owner hears the cancel and kills the whole tree."""
    env = base_env(dsn, SIDECAR_POLL_SECONDS="0.5")
    done = cli(dsn, "interest", "crashed-agent", "--ttl", "2s", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["generation"] == 1
    pidfile = tmp_path / "pids"
    done = cli(dsn, "enqueue", "it", "--interest", "crashed-agent", "--payload",
               orjson.dumps({"pidfile": str(pidfile), "tree": True}).decode(), env=env)
    assert done.returncode == 0, done.stderr.decode()
    job_id = orjson.loads(done.stdout)["id"]
    sidecar = SidecarProcess(dsn, HANG, "--tool", "it", env=env, tmp=tmp_path)
    try:
        pids = read_pids(pidfile, 4, timeout=30)
        wait_until(lambda: job_row(dsn, job_id)["state"] == "cancelled", 30,
                   what="the call to be cancelled by the lapse")
        wait_until(lambda: not job_processes(job_id), 30, what="the tree to be killed")
        assert pids
    finally:
        sidecar.stop()
    row = job_row(dsn, job_id)
    assert row["error"]["kind"] == "abandoned_by_caller"
    assert query(dsn, "SELECT count(*) AS n FROM tool_job_events WHERE job_id = $1 AND "
                      "event = 'interest_lapsed'", job_id)[0]["n"] == 1


@pytest.mark.e2e
def test_the_cli_holds_releases_and_refuses_bad_interests_in_one_line(dsn):
    done = cli(dsn, "enqueue", "it", "--interest", "not-held")
    assert done.returncode == 2 and "interest 'not-held': not held now" in one_line_error(done)
    assert cli(dsn, "interest", "shell-1", "--ttl", "1m").returncode == 0
    done = cli(dsn, "enqueue", "it", "--interest", "shell-1")
    assert done.returncode == 0, done.stderr.decode()
    job_id = orjson.loads(done.stdout)["id"]
    done = cli(dsn, "interest", "shell-1", "--release")
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["job_id"] == job_id
    assert job_row(dsn, job_id)["state"] == "failed"
    for bad, field in ((["bad\tkey"], "interest"), (["k", "--ttl", "2d"], "--ttl"),
                       (["k", "--ttl", "0s"], "--ttl")):
        done = cli(dsn, "interest", *bad)
        assert done.returncode == 2, (bad, done.stdout)
        assert field in one_line_error(done), bad


@pytest.mark.database
def test_a_renewal_keeps_queued_calls_claimable_and_a_call_a_lapse_missed_is_swept(dsn):
    async def go():
        pool, caller, store = await _stores(dsn)
        try:
            await caller.hold_interest("kept", 2, None)
            kept_id, _ = await caller.enqueue("it", {}, None, 3, {},
                                              EnqueueOptions(interest="kept"))
            await caller.hold_interest("kept", 60, None)  # renewed before its end
            await asyncio.sleep(2.2)
            claimed = await store.claim("it", "w1", 30)
            # a call enqueued as its interest lapsed, which that lapse did not see
            await caller.hold_interest("missed", 60, None)
            missed_id, _ = await caller.enqueue("it", {}, None, 3, {},
                                                EnqueueOptions(interest="missed"))
            await pool.execute("UPDATE tool_interests SET state = 'lapsed', ended_at = now() "
                               "WHERE interest_key = 'missed'")
            swept = await store.lapse_interests()
            return kept_id, claimed, missed_id, swept
        finally:
            await pool.close()

    kept_id, claimed, missed_id, swept = run(go())
    assert claimed is not None and claimed.id == kept_id
    assert [(r["job_id"], r["previous_state"]) for r in swept] == [(missed_id, "queued")]
    assert job_row(dsn, missed_id)["error"]["kind"] == "expired"


@pytest.mark.database
def test_a_call_queued_again_carries_its_interests_end_as_it_is_now(dsn):
    """Review of issue 44: a renewal moves the end only on queued calls; a running call
    that goes back to the queue (a retry) takes the interest's current end, so the claim
    does not skip it as if the interest had lapsed."""
    async def go():
        pool, caller, store = await _stores(dsn)
        try:
            await caller.hold_interest("moving", 2, None)
            job_id, _ = await caller.enqueue("it", {}, None, 3, {},
                                             EnqueueOptions(interest="moving"))
            job = await store.claim("it", "w1", 60)
            await caller.hold_interest("moving", 60, None)  # renewed while it runs
            await store.requeue_if_owner(job, "w1", {"kind": "exit_code"}, 0.0, {})
            await asyncio.sleep(2.3)  # past the end it was enqueued with
            again = await store.claim("it", "w1", 60)
            return job_id, again
        finally:
            await pool.close()

    job_id, again = run(go())
    assert again is not None and again.id == job_id and again.attempt == 2
