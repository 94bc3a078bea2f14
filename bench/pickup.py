"""2. Pickup latency, enqueue -> child start, of an idle sidecar: woken by NOTIFY, and by its
poll fallback when the NOTIFY is missed (the job inserted without one).

The tool is ``/bin/date +%s%N``: its stdout, the wall-clock nanoseconds at which it ran, is
a JSON number, stored as the job's result. Latency = that time - our clock just before the
enqueue statement was sent (same machine, same clock). The baseline is a bare loop in this
process: LISTEN, the same claim statement, spawn the same tool, complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import asyncpg

from bench.common import (
    SHORT_PROFILE,
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
from sidecar.protocol.model import JobState, RawJson
from sidecar.storage.queries import Q
from sidecar.worker.claim_loop import wake_channel

DATE = ["/bin/date", "+%s%N"]

INSERT_QUIETLY = """
WITH ins AS (
    INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts)
    VALUES ($1::uuid, $2, $1::uuid::text, '{}'::jsonb, 1) RETURNING id
)
INSERT INTO tool_job_events (job_id, fencing_token, event, details)
SELECT id, 0, 'job_enqueued', '{}'::jsonb FROM ins
"""


async def _one(conn: asyncpg.Connection, tool: str, notify: bool) -> float:
    sent = time.time()
    if notify:  # exactly what `sidecar enqueue` runs
        job_id = await enqueue_one(conn, tool, details={"payload": {"bytes": 2}})
    else:       # a NOTIFY that never arrived
        job_id = uuid.uuid4()
        await conn.execute(INSERT_QUIETLY, job_id, tool)

    async def result():
        row = await conn.fetchrow("SELECT state, result FROM tool_jobs WHERE id = $1", job_id)
        return row if row["state"] not in ("queued", "running") else None

    row = await until(result, timeout=30, interval=0.005, what=f"pickup job of {tool}")
    if row["state"] != "succeeded" or not isinstance(row["result"], int):
        raise RuntimeError(f"pickup job ended {row['state']} with {row['result']!r}")
    return row["result"] / 1e9 - sent


async def _samples(conn: asyncpg.Connection, tool: str, count: int, notify: bool,
                   gap: tuple[float, float]) -> list[float]:
    out = []
    for _ in range(count):
        await asyncio.sleep(random.uniform(*gap))
        out.append(await _one(conn, tool, notify))
    return out


async def bare(ctx: Context, conn: asyncpg.Connection, count: int) -> list[float]:
    """The same pickups served by the bare loop: LISTEN -> claim -> spawn -> complete."""
    tool, owner = "pickup-bare", f"bench-bare:{uuid.uuid4().hex[:12]}"
    listener, work = await connect(ctx.dsn), await connect(ctx.dsn)
    wake = asyncio.Event()
    channel = wake_channel(owner)  # woken as a sidecar is: on the idle list, own channel
    await listener.add_listener(channel, lambda *_: wake.set())

    async def serve() -> None:
        while True:
            await work.execute(Q["register_idle_sidecar"], owner, tool, channel)
            await wake.wait()
            wake.clear()
            while (row := await work.fetchrow(Q["claim_job"], tool, owner, 3.0, None, 3, 1)):
                proc = await asyncio.create_subprocess_exec(
                    *DATE, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    start_new_session=True)
                out, _ = await proc.communicate()
                await work.fetchrow(Q["finish_job_if_owner"], row["id"], owner,
                                    row["fencing_token"], JobState.SUCCEEDED, RawJson(out.decode()),
                                    None, "job_succeeded", {}, None, None, None, None, None,
                                    None)

    server = asyncio.create_task(serve())
    try:
        return await _samples(conn, tool, count, True, (0.02, 0.1))
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        await listener.close()
        await work.close()


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    mode, poll = ctx.mode, ctx.mode.poll_seconds
    progress(f"pickup: {mode.pickup_samples} NOTIFY pickups with job cgroups as the host "
             f"allows and as many with SIDECAR_CGROUPS=off, {mode.poll_samples} poll pickups "
             f"(poll {poll:g} s)")
    sc = Sidecar(ctx, "pickup", "pickup", DATE, 1, SIDECAR_POLL_SECONDS=f"{poll:g}",
                 **SHORT_PROFILE)
    await sc.ready()
    notified = await _samples(conn, "pickup", mode.pickup_samples, True, (0.02, 0.1))
    polled = await _samples(conn, "pickup", mode.poll_samples, False, (0.0, poll))
    await sc.stop()
    sc = Sidecar(ctx, "pickup-nocg", "pickup-nocg", DATE, 1, SIDECAR_POLL_SECONDS=f"{poll:g}",
                 SIDECAR_CGROUPS="off", **SHORT_PROFILE)
    await sc.ready()
    no_cgroups = await _samples(conn, "pickup-nocg", mode.pickup_samples, True, (0.02, 0.1))
    await sc.stop()
    base = await bare(ctx, conn, mode.pickup_samples)
    ctx.count("pickup jobs", 3 * mode.pickup_samples + mode.poll_samples)
    ctx.settings.append(
        f"pickup: one idle sidecar, concurrency 1, SIDECAR_POLL_SECONDS={poll:g}; tool "
        f"`/bin/date +%s%N` (its own start time is its result); {len(notified)} NOTIFY "
        f"pickups 20-100 ms apart with job cgroups, {len(no_cgroups)} with SIDECAR_CGROUPS=off, "
        f"{len(polled)} inserted without NOTIFY at a random phase of the poll; the bare loop "
        f"served {len(base)} NOTIFY pickups")
    b50, b99 = percentile(base, 50), percentile(base, 99)
    rows = []
    for label, samples in (("job cgroups on", notified), ("SIDECAR_CGROUPS=off", no_cgroups)):
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        rows += [
            Row("2", f"pickup latency p50, idle sidecar woken by NOTIFY, {label}", ms(p50),
                f"bare LISTEN+claim+spawn {ms(b50)}", f"{p50 / b50:.2f} × bare",
                "≤ 1.3 × bare", p50 <= 1.3 * b50),
            Row("2", f"pickup latency p99, idle sidecar woken by NOTIFY, {label}", ms(p99),
                f"bare LISTEN+claim+spawn {ms(b99)}", f"{p99 / b99:.2f} × bare",
                "≤ 2 × bare", p99 <= 2 * b99)]
    q50, q99 = percentile(polled, 50), percentile(polled, 99)
    # Poll periods drawn over [0.8, 1] x poll (sidecar.ops.periodic.spread_period): a job
    # arriving at a random moment waits 0.449 x poll at the median and 0.941 x poll at
    # the 99th percentile (a renewal process of such periods, simulated).
    e50, e99 = 0.449 * poll, 0.941 * poll
    return [
        *rows,
        Row("2", f"pickup latency p50 / p99, NOTIFY missed (poll every {poll:g} s)",
            f"{ms(q50)} / {ms(q99)}", f"a uniform phase would give {ms(e50)} / "
            f"{ms(e99)} (periods of 0.8-1 × poll)", f"{q50 / e50:.2f} × expected p50"),
    ]
