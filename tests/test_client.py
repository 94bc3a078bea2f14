"""The Python client (issue 26, point 5), on a real PostgreSQL with real sidecars:
enqueue in the caller's own transaction (rolled back: no job, no wake-up; committed: the
job runs and ``wait`` returns it), ``call`` returning a result or raising JobFailed or a
TimeoutError, ``cancel(tag=...)``, ``progress`` as an async iterator, the options on the
row, bad input refused with nothing written, the DSN resolved as the CLI resolves it, and
the same calls behind PgBouncer in transaction mode (the waiter polls)."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import asyncpg
import pytest

from kit import (
    TOOLS,
    base_env,
    job_processes,
    job_row,
    journal_details,
    scalar,
    wait_until,
    wait_until_async,
)
from sidecar.client import Client, Job, JobEnd, JobFailed, JobNotFound, JobTimeout
from sidecar.protocol.errors import ConfigError, IdempotencyConflict, UsageError

TOOL = "pt"
COMMAND = [str(TOOLS / "progress_tool.py")]
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Rollback(Exception):
    pass


def _idle_channel(dsn: str) -> str:
    """The wake-up channel of the one idle sidecar (tool_idle_sidecars)."""
    wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars") == 1, 20,
               what="the sidecar to be idle and listening")
    return scalar(dsn, "SELECT channel FROM tool_idle_sidecars")


@pytest.mark.e2e
@pytest.mark.server
def test_enqueue_in_the_callers_transaction_rolled_back_then_committed(dsn, sidecars):
    """The caller's own asyncpg connection (no codec of the sidecar's on it): rolled back,
    neither the job nor the caller's row exists and no idle sidecar is woken; committed,
    both exist, the idle sidecar (polling once a minute only) is woken at the commit and
    ``wait`` returns the result."""
    sidecars(dsn, COMMAND, "--tool", TOOL, env=base_env(dsn, SIDECAR_POLL_SECONDS="60"))
    channel = _idle_channel(dsn)

    async def main():
        heard: list[str] = []
        listener = await asyncpg.connect(dsn)
        own = await asyncpg.connect(dsn)
        await own.execute("CREATE TABLE orders (id int PRIMARY KEY, job uuid)")
        await listener.add_listener(channel, lambda *args: heard.append(args[3]))
        try:
            async with Client(dsn) as client:
                refs = []
                with pytest.raises(Rollback):
                    async with own.transaction():
                        ref = await client.enqueue(TOOL, {"steps": []}, connection=own)
                        refs.append(ref)
                        await own.execute("INSERT INTO orders VALUES (1, $1)", ref.id)
                        raise Rollback
                assert refs[0].created
                with pytest.raises(JobNotFound):
                    await client.get(refs[0])
                assert await own.fetchval("SELECT count(*) FROM orders") == 0
                assert await own.fetchval("SELECT count(*) FROM tool_job_events") == 0
                await asyncio.sleep(0.5)
                assert heard == []
                assert await own.fetchval("SELECT count(*) FROM tool_idle_sidecars") == 1

                async with own.transaction():
                    ref = await client.enqueue(TOOL, {"steps": []}, connection=own,
                                               tags={"order": "2"})
                    await own.execute("INSERT INTO orders VALUES (2, $1)", ref.id)
                    with pytest.raises(JobNotFound):  # not visible before the commit
                        await client.get(ref)
                    await asyncio.sleep(0.3)
                    assert heard == []
                end = await client.wait(ref, timeout=30)
                assert isinstance(end, JobEnd)
                assert (end.id, end.state, end.attempt) == (ref.id, "succeeded", 1)
                assert end.result == {"done": True, "statuses": []}
                assert heard == [TOOL]
                assert await own.fetchval("SELECT job FROM orders WHERE id = 2") == ref.id
                assert (await client.get(ref)).tags == {"order": "2"}
        finally:
            await listener.close()
            await own.close()

    asyncio.run(main())


@pytest.mark.e2e
@pytest.mark.server
def test_call_returns_the_result_raises_job_failed_and_times_out(dsn, sidecars):
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "2")

    async def main():
        async with Client(dsn) as client:
            result = await client.call(TOOL, {"steps": []}, timeout=30)
            assert result == {"done": True, "statuses": []}

            with pytest.raises(JobFailed) as failed:
                await client.call(TOOL, {"exit": 65}, timeout=30, max_attempts=1)
            err = failed.value
            row = await asyncio.to_thread(job_row, dsn, err.job_id)
            assert (err.state, err.attempt, err.kind) == ("failed", 1, "exit_code")
            assert err.error == row["error"] and err.message == row["error"]["message"]
            assert str(err.job_id) in str(err)

            with pytest.raises(TimeoutError) as timed_out:
                await client.call(TOOL, {"steps": [{"sleep": 120}]},
                                  timeout=dt.timedelta(seconds=1))
            assert isinstance(timed_out.value, JobTimeout)
            slow = timed_out.value.job_id
            assert (await client.get(slow)).state in ("queued", "running")  # it goes on

            # wait on several: in the order given; --any: the first to end
            quick = await client.enqueue(TOOL, {"steps": []})
            ends = await client.wait([slow, quick], any=True, timeout=30)
            assert [e.id for e in ends] == [quick.id]
            with pytest.raises(JobTimeout) as partial:
                await client.wait([quick, slow], timeout=0.5)
            assert partial.value.job_ids == [slow]
            assert [e.id for e in partial.value.ended] == [quick.id]

            assert await client.cancel(slow) == {slow: "running"}
            ends = await client.wait([quick, str(slow)], timeout=30)
            assert [(e.id, e.state) for e in ends] == [(quick.id, "succeeded"),
                                                       (slow, "cancelled")]
            # a call whose job is cancelled (by its tag, as a "stop" button would)
            stop = {"run": "stop-me"}
            calling = asyncio.ensure_future(client.call(
                TOOL, {"steps": [{"sleep": 120}]}, timeout=60, tags=stop))
            await wait_until_async(lambda: client._opened().list_jobs(None, TOOL, 10, stop),
                                   20, 0.05, "the call's job to be enqueued")
            assert len(await client.cancel(tag=stop)) == 1
            with pytest.raises(JobFailed) as cancelled:
                await calling
            assert (cancelled.value.state, cancelled.value.kind) == ("cancelled", "cancelled")
            assert await client.cancel(slow) == {}  # finished already: nothing

            missing = uuid.uuid4()
            with pytest.raises(JobNotFound):
                await client.wait([quick, missing], timeout=5)
            with pytest.raises(JobNotFound):
                await client.get(missing)

    asyncio.run(main())


@pytest.mark.e2e
@pytest.mark.server
def test_cancel_by_tag_cancels_every_job_of_the_tag_and_kills_running_trees(dsn, sidecars):
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "2")

    async def main():
        async with Client(dsn) as client:
            run = {"agent-run": "r-1"}
            running = await client.enqueue(TOOL, {"steps": [{"sleep": 120}]}, tags=run)
            queued = await client.enqueue(TOOL, {"steps": []}, tags=run, run_after=3600)
            other = await client.enqueue(TOOL, {"steps": [{"sleep": 120}]},
                                         tags={"agent-run": "r-2"})
            await asyncio.to_thread(
                wait_until, lambda: job_processes(str(running.id)) != [], 20, 0.05,
                "the tagged job's tool to run")
            cancelled = await client.cancel(tag=run)
            assert cancelled == {running.id: "running", queued.id: "queued"}
            ends = await client.wait([running, queued], timeout=30)
            assert {e.state for e in ends} == {"cancelled"}
            await asyncio.to_thread(
                wait_until, lambda: job_processes(str(running.id)) == [], 15, 0.05,
                "the cancelled job's tree to be killed")
            assert (await client.get(other)).state in ("queued", "running")
            assert await client.cancel(tag={"agent-run": "nobody"}) == {}
            for bad in ({}, {"job_id": running, "tag": run}):
                with pytest.raises(UsageError):
                    await client.cancel(**bad)
            await client.cancel(other)

    asyncio.run(main())


@pytest.mark.e2e
@pytest.mark.server
def test_progress_is_an_async_iterator_until_the_job_ends(dsn, sidecars, tmp_path):
    release = tmp_path / "release"
    sidecars(dsn, COMMAND, "--tool", TOOL)

    async def main():
        async with Client(dsn) as client:
            ref = await client.enqueue(TOOL, {"steps": [
                {"http": {"progress": 0.25, "message": "http step"}}, {"sleep": 1.2},
                {"file": {"progress": 0.75, "message": "file step"}},
                {"wait_for": str(release)}]})
            seen = []
            async with asyncio.timeout(60):
                async for update in client.progress(ref):
                    seen.append((update.id, update.value, update.message, update.attempt))
                    if update.value == 0.75:
                        release.touch()
            assert seen == [(ref.id, 0.25, "http step", 1), (ref.id, 0.75, "file step", 1)]
            job = await client.get(ref)
            assert isinstance(job, Job) and job.finished and job.state == "succeeded"
            assert job.progress["value"] == 0.75
            # a finished job: no update, the iteration ends at once
            assert [u async for u in client.progress(ref)] == []

    asyncio.run(main())


@pytest.mark.database
def test_options_reach_the_row_and_bad_input_writes_nothing(dsn):
    async def main():
        async with Client(dsn) as client:
            ref = await client.enqueue(
                TOOL, {"n": 1}, idempotency_key="order-42:ocr", priority=3,
                run_after=dt.timedelta(hours=1), expires_in=7200,
                tags={"run": "r-7", "order": "42"}, max_attempts=2, traceparent=TP,
                tracestate="congo=t61rcWkgMzE")
            job = await client.get(ref)
            assert (job.tool, job.state, job.payload, job.priority, job.max_attempts) == (
                TOOL, "queued", {"n": 1}, 3, 2)
            assert job.tags == {"run": "r-7", "order": "42"}
            assert (job.traceparent, job.tracestate) == (TP, "congo=t61rcWkgMzE")
            assert job.idempotency_key == "order-42:ocr"
            assert dt.timedelta(minutes=59) < job.run_after - job.created_at \
                <= dt.timedelta(hours=1)
            assert job.expires_at - job.created_at == dt.timedelta(hours=2)
            [details] = await asyncio.to_thread(journal_details, dsn, str(ref.id),
                                                "job_enqueued")
            assert details["by"] == "sidecar.client" and details["traceparent"] == TP

            again = await client.enqueue(TOOL, {"n": 1}, idempotency_key="order-42:ocr")
            assert (again.id, again.created) == (ref.id, False)
            with pytest.raises(IdempotencyConflict):
                await client.enqueue(TOOL, {"n": 2}, idempotency_key="order-42:ocr")

            at = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
            timed = await client.get(await client.enqueue(
                TOOL, None, run_after=at, expires_in=at + dt.timedelta(hours=1)))
            assert timed.payload == {} and timed.max_attempts is None  # the profile's
            assert abs(timed.run_after - at) < dt.timedelta(seconds=1)
            assert abs(timed.expires_at - at - dt.timedelta(hours=1)) < dt.timedelta(seconds=5)

            # Every digit of an integer past 64 bits is kept, as the CLI keeps it.
            big = await client.enqueue(TOOL, {"n": 2**70 + 1})
            assert (await client.get(big.id)).payload == {"n": 2**70 + 1}

            before = await asyncio.to_thread(scalar, dsn, "SELECT count(*) FROM tool_jobs")
            bad_calls = [
                ({"priority": 12}, UsageError, "priority"),
                ({"priority": True}, UsageError, "priority"),
                ({"tags": {"run": 1}}, UsageError, "run"),
                ({"tags": {"bad key": "x"}}, UsageError, "bad key"),
                ({"traceparent": "00-xyz"}, UsageError, "traceparent"),
                ({"tracestate": "a=b"}, UsageError, "tracestate"),
                ({"max_attempts": 0}, UsageError, "max_attempts"),
                ({"expires_in": 0}, UsageError, "expires_in"),
                ({"expires_in": 60, "run_after": 120}, UsageError, "expire"),
                ({"run_after": dt.datetime(2030, 1, 1)}, UsageError, "timezone"),
                ({"run_after": dt.timedelta(days=400)}, UsageError, "366"),
                ({"idempotency_key": "x:stage:2"}, UsageError, "stage"),
                ({"idempotency_key": "a\nb"}, UsageError, "idempotency"),
                # sidecar mcp's namespaces (issue 41 point 2)
                ({"tags": {"mcp.principal": "bob"}}, UsageError, "tags mcp.principal"),
                ({"idempotency_key": "mcp:0123"}, UsageError, "reserved for sidecar mcp"),
                ({"payload": {"x": object()}}, UsageError, "payload"),
                ({"payload": {"x": "\u0000"}}, UsageError, "jsonb"),
                # a new user's trial: NaN was stored as null, these raised raw errors
                ({"payload": {"x": [1.0, float("nan")]}}, UsageError, "NaN"),
                ({"run_after": float("nan")}, UsageError, "run_after"),
                ({"run_after": float("inf")}, UsageError, "run_after"),
                ({"expires_in": float("nan")}, UsageError, "expires_in"),
                ({"tags": {"run": "a\udcffb"}}, UsageError, "run"),
                ({"tool": "no such tool!"}, ConfigError, "tool"),
            ]
            for kwargs, error, named in bad_calls:
                tool = kwargs.pop("tool", TOOL)
                payload = kwargs.pop("payload", {})
                with pytest.raises(error) as raised:
                    await client.enqueue(tool, payload, **kwargs)
                assert named in str(raised.value), (kwargs, str(raised.value))
                assert "\n" not in str(raised.value)
            assert await asyncio.to_thread(
                scalar, dsn, "SELECT count(*) FROM tool_jobs") == before

    asyncio.run(main())


@pytest.mark.database
def test_the_dsn_is_resolved_as_the_cli_resolves_it(dsn, monkeypatch, tmp_path):
    """SIDECAR_DATABASE_URL, then SIDECAR_DATABASE_URL_FILE; a bad variable is the CLI's
    ConfigError; an explicit dsn wins."""
    import os

    for name in [n for n in os.environ if n.startswith("SIDECAR_")
                 and n != "SIDECAR_TEST_DATABASE_URL"]:
        monkeypatch.delenv(name)

    async def enqueue_one() -> uuid.UUID:
        async with Client() as client:
            return (await client.enqueue(TOOL, {})).id

    monkeypatch.setenv("SIDECAR_DATABASE_URL", dsn)
    first = asyncio.run(enqueue_one())
    monkeypatch.delenv("SIDECAR_DATABASE_URL")
    secret = tmp_path / "dsn"
    secret.write_text(dsn + "\n")
    monkeypatch.setenv("SIDECAR_DATABASE_URL_FILE", str(secret))
    second = asyncio.run(enqueue_one())
    assert {job_row(dsn, first)["state"], job_row(dsn, second)["state"]} == {"queued"}

    monkeypatch.setenv("SIDECAR_DATABSE_URL", dsn)  # misspelled: refused as by the CLI
    with pytest.raises(ConfigError, match="SIDECAR_DATABSE_URL"):
        asyncio.run(enqueue_one())
    monkeypatch.delenv("SIDECAR_DATABSE_URL")

    async def not_open():
        with pytest.raises(RuntimeError, match="not open"):
            await Client(dsn).enqueue(TOOL, {})
        with pytest.raises(UsageError, match="postgresql://"):
            await Client("mysql://x@y/z").open()
        client = await Client.connect(dsn)
        try:
            assert (await client.get(first)).state == "queued"
        finally:
            await client.close()

    asyncio.run(not_open())


@pytest.mark.e2e
@pytest.mark.server
def test_the_client_behind_pgbouncer_in_transaction_mode(dsn, bouncer, sidecars):
    """Enqueue in the caller's transaction through the pooler, then ``call`` and
    ``progress``: the waiter cannot LISTEN there and reads the jobs every second."""
    bdsn = bouncer.dsn_for(dsn)
    sidecars(dsn, COMMAND, "--tool", TOOL)

    async def main():
        async with Client(bdsn, pooler="transaction") as client:
            own = await asyncpg.connect(bdsn, statement_cache_size=0)
            try:
                async with own.transaction():
                    ref = await client.enqueue(TOOL, {"steps": [
                        {"http": {"progress": 0.5}}, {"sleep": 1.5}]}, connection=own)
            finally:
                await own.close()
            updates = []
            async with asyncio.timeout(60):
                async for update in client.progress(ref):
                    updates.append(update.value)
            assert updates == [0.5]
            end = await client.wait(ref, timeout=30)
            assert end.state == "succeeded"
            assert await client.call(TOOL, {"steps": []}, timeout=30) == {
                "done": True, "statuses": []}
            with pytest.raises(JobFailed):
                await client.call(TOOL, {"exit": 3}, timeout=30, max_attempts=1)

    asyncio.run(main())
