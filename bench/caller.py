"""11. The caller's half of a tool call (issue 26, point 8): a caller's round trip, the
fan-out of completion notifications to waiting callers, and the round trip behind PgBouncer.

Round trip: enqueue a no-op job, then wait until the wait returns with its result. The
tool is ``/bin/cat``: its result is its payload (``{"n": i}``, checked). The sidecar's
path is what a caller of the project uses: ``CallerStore.enqueue`` over a pool (the statement
``sidecar enqueue`` and the SQL function ``sidecar_enqueue`` share: tool_job_enqueue),
then ``sidecar.client.waiting.watch`` on a connection of its own (LISTEN on the job's channel,
read, NOTIFY from the fenced end, read, UNLISTEN), served by a real ``sidecar run``. The
bare loop does the same with raw asyncpg in this process: the caller LISTENs on the job's
channel and inserts the job with its journal row and the wake NOTIFY in one statement; a
worker LISTENing on its wake channel claims it (the sidecar's claim statement), spawns
the same ``/bin/cat`` with the payload on stdin, ends it with the sidecar's fenced finish
(whose trigger sends the job's NOTIFY); the caller, woken, reads the result and
UNLISTENs. The two take turns call by call, so the machine's noise falls on both.

Fan-out: W callers, each with a connection of its own, wait on W different jobs while
W more jobs nobody waits for end beside them. Counted: the notifications the waiters'
connections receive (every one asyncpg hands to the connection, whatever the channel).

PgBouncer (transaction mode): no session to LISTEN in, so the sidecar polls for work
(SIDECAR_POLL_SECONDS) and the waiter reads the job again every waiting.POLL_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from typing import Any

import asyncpg

from bench.common import (
    BenchError,
    Context,
    Sidecar,
    connect,
    enqueue_one,
    ms,
    percentile,
    progress,
    until,
)
from bench.report import Row
from sidecar.client import waiting
from sidecar.protocol.model import JobState, RawJson
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.queries import Q
from sidecar.worker.claim_loop import wake_channel

CAT = ["/bin/cat"]
WARM_UP = 2  # calls of each side not measured (prepared statements, first spawns)

BARE_INSERT = """
WITH ins AS (
    INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts)
    VALUES ($1::uuid, $2, $1::uuid::text, $3::text::jsonb, 1) RETURNING id
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, 0, 'job_enqueued', '{}'::jsonb FROM ins
)
SELECT tool_job_wake($2, 1) FROM ins
"""
READ_RESULT = "SELECT state, result FROM tool_jobs WHERE id = $1"


def _check(n: int, state: str, result: Any, who: str) -> None:
    if state != JobState.SUCCEEDED or result != {"n": n}:
        raise BenchError(f"{who} call {n} ended {state} with {result!r}, not {{'n': {n}}}")


async def real_call(store: CallerStore, waiter: asyncpg.Connection, tool: str, n: int, *,
                    listen: bool = True) -> float:
    """One caller's round trip through the sidecar's path; seconds."""
    started = time.perf_counter()
    job_id, _ = await store.enqueue(tool, RawJson(f'{{"n": {n}}}'), None, None,
                                    {"by": "bench caller"})
    end = None
    async for event in waiting.watch(waiter, [job_id], listen=listen):
        if isinstance(event, waiting.JobEnd):
            elapsed = time.perf_counter() - started
            end = event
    if end is None:
        raise BenchError(f"the wait for call {n} returned no end")
    _check(n, end.state, end.result, "sidecar")
    return elapsed


async def bare_call(enq: asyncpg.Connection, waiter: asyncpg.Connection, tool: str,
                    n: int) -> float:
    """The same round trip by the bare loop's caller; seconds."""
    job_id = uuid.uuid4()
    channel = waiting.job_channel(job_id)
    ended = asyncio.get_running_loop().create_future()

    def heard(*_: Any) -> None:
        if not ended.done():
            ended.set_result(None)

    started = time.perf_counter()
    await waiter.add_listener(channel, heard)
    await enq.execute(BARE_INSERT, job_id, tool, f'{{"n": {n}}}')
    await asyncio.wait_for(ended, 30)
    row = await waiter.fetchrow(READ_RESULT, job_id)
    await waiter.remove_listener(channel, heard)
    elapsed = time.perf_counter() - started
    _check(n, row["state"], row["result"], "bare")
    return elapsed


async def bare_worker(dsn: str, tool: str, ready: asyncio.Event) -> None:
    """The bare loop's worker: LISTEN on its wake channel, claim, spawn ``/bin/cat`` with
    the payload on stdin, fenced finish (the trigger NOTIFYs the job's channel). A wake
    missed is made up by a claim every second."""
    owner = f"bench-bare-caller:{uuid.uuid4().hex[:12]}"
    listener, work = await connect(dsn), await connect(dsn)
    wake = asyncio.Event()
    channel = wake_channel(owner)
    try:
        await listener.add_listener(channel, lambda *_: wake.set())
        ready.set()
        while True:
            await work.execute(Q["register_idle_sidecar"], owner, tool, channel)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), 1.0)
            wake.clear()
            while (row := await work.fetchrow(Q["claim_job"], tool, owner, 30.0, None, 3, 1)):
                proc = await asyncio.create_subprocess_exec(
                    *CAT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    start_new_session=True)
                out, _ = await proc.communicate(row["payload_text"].encode())
                await work.fetchrow(Q["finish_job_if_owner"], row["id"], owner,
                                    row["fencing_token"], JobState.SUCCEEDED,
                                    RawJson(out.decode()), None, "job_succeeded", {}, None,
                                    None, None, None, None, None)
    finally:
        await listener.close()
        await work.close()


# --- 1. round trip, direct ---------------------------------------------------------


async def round_trips(ctx: Context) -> dict[str, list[float]]:
    """Round trips of the sidecar (job cgroups as the host allows), of a sidecar with
    SIDECAR_CGROUPS=off and of the bare loop, taking turns call by call; seconds by side
    (``real``, ``nocg``, ``bare``)."""
    calls = ctx.mode.caller_calls
    sidecars = [Sidecar(ctx, "caller", "caller-noop", CAT, 1),
                Sidecar(ctx, "caller-nocg", "caller-nocg", CAT, 1, SIDECAR_CGROUPS="off")]
    ready = asyncio.Event()
    worker = asyncio.create_task(bare_worker(ctx.dsn, "caller-bare", ready))
    pool = await db.create_pool(ctx.dsn, 10, max_size=1, pooler="none")
    waiter = await db.connect(ctx.dsn, 10, pooler="none")
    enq, bare_waiter = await connect(ctx.dsn), await connect(ctx.dsn)
    out: dict[str, list[float]] = {"real": [], "nocg": [], "bare": []}
    sides = list(out)
    try:
        for sc in sidecars:
            await sc.ready()
        await asyncio.wait_for(ready.wait(), 30)
        store = CallerStore(pool, 10)
        for n in range(WARM_UP + calls):
            for side in sides[n % 3:] + sides[:n % 3]:  # each side first in turn
                await asyncio.sleep(random.uniform(0.02, 0.1))
                if side == "bare":
                    took = await bare_call(enq, bare_waiter, "caller-bare", n)
                else:
                    tool = "caller-noop" if side == "real" else "caller-nocg"
                    took = await real_call(store, waiter, tool, n)
                if n >= WARM_UP:
                    out[side].append(took)
        ctx.notes.append("11: where a round trip's time goes, p50 by the database's clock "
                         "from the enqueue: " + await _phases(enq))
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker
        await pool.close()
        for conn in (waiter, enq, bare_waiter):
            await conn.close()
        for sc in sidecars:
            await sc.stop()
    ctx.count("caller round trips (two sidecars and the bare loop)", 3 * (WARM_UP + calls))
    return out


PHASES = """
SELECT j.tool, e.event,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - j.created_at))
           AS seconds
FROM tool_jobs j JOIN tool_job_events e ON e.job_id = j.id
WHERE j.tool = ANY($1::text[])
  AND e.event IN ('job_claimed', 'tool_request_started', 'job_succeeded')
GROUP BY 1, 2 ORDER BY 1, 3
"""


async def _phases(conn: asyncpg.Connection) -> str:
    """The journal's times of claim, tool start and committed end after the enqueue."""
    names = {"caller-noop": "sidecar", "caller-nocg": "sidecar with SIDECAR_CGROUPS=off",
             "caller-bare": "bare loop"}
    parts: dict[str, list[str]] = {}
    for row in await conn.fetch(PHASES, list(names)):
        event = {"job_claimed": "claimed", "tool_request_started": "tool started",
                 "job_succeeded": "end committed"}[row["event"]]
        parts.setdefault(names[row["tool"]], []).append(f"{event} {ms(row['seconds'])}")
    return "; ".join(f"{who}: {', '.join(what)}" for who, what in parts.items())


# --- 2. fan-out ------------------------------------------------------------------


class CountingConnection(asyncpg.Connection):
    """An asyncpg connection that counts every notification the server delivers to it
    (before asyncpg looks for a listener of its channel)."""

    def _process_notification(self, pid, channel, payload):  # noqa: ANN001 - asyncpg's
        self.heard = getattr(self, "heard", 0) + 1
        super()._process_notification(pid, channel, payload)


async def _fan_out_on(ctx: Context, dsn: str, conn: asyncpg.Connection,
                      waiters: int) -> dict[str, Any]:
    tool = "caller-fan"
    waited = [await _enqueue(conn, tool, n) for n in range(waiters)]
    for n in range(waiters):  # ended beside them, waited for by nobody
        await _enqueue(conn, tool, waiters + n)
    conns: list[CountingConnection] = []
    for start in range(0, waiters, 20):
        conns += await asyncio.gather(*(
            asyncpg.connect(dsn, connection_class=CountingConnection,
                            server_settings={"application_name": "bench-waiter"})
            for _ in range(start, min(start + 20, waiters))))
    ends: dict[uuid.UUID, float] = {}

    async def wait_one(c: asyncpg.Connection, job_id: uuid.UUID) -> None:
        await db.init_connection(c)
        async for event in waiting.watch(c, [job_id]):
            if isinstance(event, waiting.JobEnd):
                _check(waited.index(job_id), event.state, event.result, "fan-out")
                ends[job_id] = time.perf_counter()

    tasks = [asyncio.create_task(wait_one(c, j)) for c, j in zip(conns, waited, strict=True)]
    sc = None
    try:
        async def listening():
            for task in tasks:
                if task.done():
                    task.result()  # raises what the waiter raised
            return all(c._listeners for c in conns)  # noqa: SLF001 - LISTEN done

        await until(listening, 30, what="every waiter to LISTEN")
        await asyncio.sleep(0.5)  # each waiter's first read (one round trip) is done
        before = sum(getattr(c, "heard", 0) for c in conns)
        sc = Sidecar(ctx, "caller-fan", tool, CAT, 8, dsn=dsn)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        left = await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = $1 AND "
                                   "state NOT IN ('succeeded', 'failed', 'cancelled')", tool)
        await until(lambda: _none_left(conn, tool), 60, what="the bystander jobs to end")
        await asyncio.sleep(0.3)  # a late notification would still arrive now
        heard = sum(getattr(c, "heard", 0) for c in conns) - before
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            await c.close()
        if sc is not None:
            await sc.stop()
    ctx.count("fan-out jobs", 2 * waiters)
    return {"heard": heard, "waited": waiters, "bystanders": waiters,
            "left_when_waiters_done": left}


async def _none_left(conn: asyncpg.Connection, tool: str) -> bool:
    return not await conn.fetchval(
        "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state IN ('queued', 'running')",
        tool)


async def _enqueue(conn: asyncpg.Connection, tool: str, n: int) -> uuid.UUID:
    return await enqueue_one(conn, tool, f'{{"n": {n}}}', None, {"by": "bench caller"})


async def fan_out(ctx: Context, conn: asyncpg.Connection) -> dict[str, Any]:
    """W waiters with a connection each; on a roomier embedded server of the bench's own
    (as section 9) when this server allows too few connections."""
    waiters = ctx.mode.caller_waiters
    allowed = await conn.fetchval("SELECT current_setting('max_connections')::int - "
                                  "current_setting('superuser_reserved_connections')::int")
    need = waiters + 12  # the sidecar's pool, listener and lease keeper, ours, slack
    if need <= allowed:
        return await _fan_out_on(ctx, ctx.dsn, conn, waiters)
    from bench.fleet import _roomy_server

    ctx.notes.append(f"11: {waiters} waiters with a connection each need about {need} "
                     f"connections and this server allows {allowed}, so the fan-out ran on "
                     "a second embedded PostgreSQL of the bench's own (same binaries, same "
                     f"machine) with max_connections = {need + 20}")
    async with _roomy_server(ctx, need + 20) as (dsn, _admin, roomy, _monitor):
        return await _fan_out_on(ctx, dsn, roomy, waiters)


# --- 3. behind PgBouncer -----------------------------------------------------------


async def behind_bouncer(ctx: Context) -> list[float]:
    """Round trips with the sidecar and the caller behind PgBouncer in transaction mode:
    the sidecar polls every ``mode.poll_seconds``, the waiter every POLL_SECONDS."""
    from kit import BouncerError, PgBouncer

    try:
        bouncer = PgBouncer(ctx.admin_dsn, pool_size=4)
    except BouncerError as exc:
        raise BenchError(f"no PgBouncer: {exc}") from None
    poll = ctx.mode.poll_seconds
    sc = None
    pool = waiter = None
    try:
        bdsn = bouncer.dsn_for(ctx.dsn)
        sc = Sidecar(ctx, "caller-bouncer", "caller-bouncer", CAT, 1, dsn=bdsn,
                     SIDECAR_DATABASE_POOLER="transaction",
                     SIDECAR_POLL_SECONDS=f"{poll:g}")
        await sc.ready()
        pool = await db.create_pool(bdsn, 10, max_size=1, pooler="transaction")
        waiter = await db.connect(bdsn, 10, pooler="transaction")
        store = CallerStore(pool, 10)
        out = []
        for n in range(ctx.mode.bouncer_calls + 1):
            await asyncio.sleep(random.uniform(0, poll))  # a random phase of the polls
            took = await real_call(store, waiter, "caller-bouncer", n, listen=False)
            if n:
                out.append(took)
        ctx.count("caller round trips behind PgBouncer", ctx.mode.bouncer_calls + 1)
        return out
    finally:
        if waiter is not None:
            await waiter.close()
        if pool is not None:
            await pool.close()
        if sc is not None:
            await sc.stop()
        bouncer.stop()


# --- the section ---------------------------------------------------------------------


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    mode = ctx.mode
    progress(f"caller: {mode.caller_calls} round trips through a sidecar and as many through "
             f"the bare loop, {mode.caller_waiters} waiters on as many jobs, "
             f"{mode.bouncer_calls} round trips behind PgBouncer")
    rows: list[Row] = []
    trips = await round_trips(ctx)
    real, bare = trips["real"], trips["bare"]
    b50, b99 = percentile(bare, 50), percentile(bare, 99)
    for side, label in (("real", "job cgroups on"), ("nocg", "SIDECAR_CGROUPS=off")):
        s50, s99 = percentile(trips[side], 50), percentile(trips[side], 99)
        rows += [
            Row("11", f"caller round trip p50, no-op tool (enqueue, then wait returns the "
                f"result), {label}", ms(s50), f"bare asyncpg loop {ms(b50)}",
                f"{s50 / b50:.2f} × bare", "≤ 1.3 × bare", s50 <= 1.3 * b50),
            Row("11", f"caller round trip p99, same calls, {label}", ms(s99),
                f"bare asyncpg loop {ms(b99)}", f"{s99 / b99:.2f} × bare", "≤ 2 × bare",
                s99 <= 2 * b99),
        ]
    p99 = percentile(real, 99)

    progress(f"caller: {mode.caller_waiters} waiters, each on its own job and connection")
    fan = await fan_out(ctx, conn)
    per_job = fan["heard"] / fan["waited"]
    shared = fan["waited"] + fan["bystanders"]  # what one shared channel would deliver
    rows.append(Row(
        "11", f"notifications received by {fan['waited']} waiting callers (own connection "
        f"each) per job waited for, {fan['bystanders']} other jobs ending beside them",
        f"{per_job:.2f} ({fan['heard']} in all)",
        f"one channel for every end: each waiter hears all {shared} ends, {shared} per "
        "job waited for", f"{per_job / shared:.3f} × one channel", "≤ 2 per job",
        per_job <= 2))

    poll = mode.poll_seconds
    bound = poll + waiting.POLL_SECONDS + p99
    label = (f"caller round trip behind PgBouncer (transaction mode): sidecar polls every "
             f"{poll:g} s, waiter every {waiting.POLL_SECONDS:g} s (POLL_SECONDS)")
    try:
        progress(f"caller: {mode.bouncer_calls} round trips behind PgBouncer")
        polled = await behind_bouncer(ctx)
    except BenchError as exc:
        progress(f"caller: behind PgBouncer not measured: {exc}")
        rows.append(Row("11", f"{label}: not measured", f"error: {exc}"[:300]))
    else:
        q50, q99 = percentile(polled, 50), max(polled)
        rows.append(Row(
            "11", f"{label}, p50 / max (n = {len(polled)})", f"{ms(q50)} / {ms(q99)}",
            f"bound: sidecar poll {poll:g} s + POLL_SECONDS {waiting.POLL_SECONDS:g} s + "
            f"direct p99 {ms(p99)} = {ms(bound)}", f"max {q99 / bound:.2f} × bound",
            "max ≤ bound", q99 <= bound))
    ctx.settings.append(
        f"11: tool `/bin/cat` (result = payload, checked), one sidecar at concurrency 1 "
        f"(default profile), one more with SIDECAR_CGROUPS=off and the bare loop in the "
        f"bench's process, {len(real)} calls each "
        f"taking turns 20-100 ms apart after {WARM_UP} unmeasured; fan-out: "
        f"{fan['waited']} waiters (one asyncpg connection each, sidecar.client.waiting.watch), "
        f"{fan['bystanders']} more jobs of the same tool, one sidecar at concurrency 8 "
        f"started once every waiter listened ({fan['left_when_waiters_done']} jobs left when "
        f"the last waiter returned); PgBouncer pool_mode = transaction, pool size 4, sidecar "
        f"SIDECAR_DATABASE_POOLER=transaction with SIDECAR_POLL_SECONDS={poll:g}, the waiter "
        "watch(listen=False), calls at a random phase of the polls")
    return rows
