"""10. Soak: a million jobs through ``tool_jobs`` with retention on, and whether the queue
stays as fast and as small at the end as near the start.

Bare claim/complete loops (the sidecar's own ``claim_job`` and ``finish_job_if_owner``
with its journal rows, in this process, CONSUMERS connections) take the jobs while a
producer keeps about QUEUED of them queued; the retention the sidecar runs
(sidecar.ops.retention.prune, RETENTION_SECONDS) deletes finished jobs every second, and the
server's autovacuum runs with the options of migration 008. Table and index sizes are
sampled every 2 s; each claim is timed. The first and the last tenth of the run are
compared: sizes (the largest sample in each; the table starts empty and reaches the size
retention keeps it at within the first tenth) and the claim's p50, at most 1.5x.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg

from bench.common import Context, connect, enqueue_many, mib, ms, percentile, progress
from bench.report import Row

CONSUMERS = 8
QUEUED = 5000
RETENTION_SECONDS = 5.0
TARGET = 1.5
SIZES_SQL = """
SELECT pg_relation_size('tool_jobs') AS heap, pg_indexes_size('tool_jobs') AS indexes,
       pg_total_relation_size('tool_job_events') AS journal
"""


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    from sidecar.ops.retention import prune
    from sidecar.protocol.model import JobState
    from sidecar.protocol.vocabulary import FailureKind
    from sidecar.storage.db import create_pool
    from sidecar.storage.queries import Q
    from sidecar.storage.worker_store import WorkerStore

    total = 10_000 if ctx.mode.name == "quick" else 1_000_000
    tool, owner = "soak", f"bench-soak:{uuid.uuid4().hex[:12]}"
    progress(f"soak: {total:,} jobs, {CONSUMERS} bare claim/complete loops, retention "
             f"{RETENTION_SECONDS:g} s")
    done = 0
    claims: list[tuple[int, float]] = []        # (jobs done when it ran, seconds)
    sizes: list[tuple[int, asyncpg.Record]] = []
    pruned = {"jobs": 0, "events": 0}
    stop = asyncio.Event()
    conns = [await connect(ctx.dsn) for _ in range(CONSUMERS)]
    producer, sampler = await connect(ctx.dsn), await connect(ctx.dsn)
    pool = await create_pool(ctx.dsn, 10, max_size=1)
    store = WorkerStore(pool, 30)
    error = {"kind": FailureKind.BAD_RESULT, "message": "exit 0 but stdout is not one JSON value"}
    earlier = [{"event": "tool_request_started", "age_s": 0.001,
                "details": {"pid": 0, "argv0": "/bin/true"}}]

    async def consume(c: asyncpg.Connection) -> None:
        nonlocal done
        while not stop.is_set():
            t0 = time.perf_counter()
            row = await c.fetchrow(Q["claim_job"], tool, owner, 90.0, None, 3, 1, timeout=30)
            claims.append((done, time.perf_counter() - t0))
            if row is None:
                await asyncio.sleep(0.01)
                continue
            await c.fetchrow(Q["finish_job_if_owner"], row["id"], owner, row["fencing_token"],
                             JobState.FAILED, None, error, "job_failed",
                             {"attempt": row["attempt"], "kind": FailureKind.BAD_RESULT},
                             None, None, None, None, None, earlier, timeout=30)
            done += 1
            if done >= total:
                stop.set()

    async def produce() -> None:
        enqueued = 0
        while not stop.is_set() and enqueued < total:
            queued = await producer.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = $1 "
                                             "AND state = 'queued'", tool)
            if queued < QUEUED // 2:
                n = min(QUEUED, total - enqueued)
                await enqueue_many(producer, tool, n, notify=False, max_attempts=1)
                enqueued += n
            await asyncio.sleep(0.05)

    async def retain() -> None:
        while not stop.is_set():
            got = await prune(store, {"failed": RETENTION_SECONDS})
            pruned["jobs"] += got["jobs"]
            pruned["events"] += got["events"]
            await asyncio.sleep(1.0)

    async def sample() -> None:
        while not stop.is_set():
            sizes.append((done, await sampler.fetchrow(SIZES_SQL)))
            await asyncio.sleep(2.0)

    started = time.monotonic()
    tasks = [asyncio.create_task(consume(c)) for c in conns]
    helpers = [asyncio.create_task(f()) for f in (produce, retain, sample)]
    last_report = started
    try:
        while not stop.is_set():
            await asyncio.sleep(1.0)
            if time.monotonic() - last_report > 60:
                last_report = time.monotonic()
                progress(f"soak: {done:,} of {total:,} jobs")
            for task in (*tasks, *helpers):
                if task.done() and task.exception() is not None:
                    stop.set()
                    raise task.exception()
        sizes.append((done, await sampler.fetchrow(SIZES_SQL)))
    finally:
        stop.set()
        await asyncio.gather(*tasks, *helpers, return_exceptions=True)
        for c in (*conns, producer, sampler):
            await c.close()
        await pool.close()
    elapsed = time.monotonic() - started
    ctx.count("soak (bare claim/complete loops)", done)

    tenth = total / 10

    def window(first: bool) -> tuple[list[float], list[asyncpg.Record]]:
        inside = (lambda n: n < tenth) if first else (lambda n: n >= total - tenth)
        return ([s for n, s in claims if inside(n)], [r for n, r in sizes if inside(n)])

    (claims_a, sizes_a), (claims_b, sizes_b) = window(True), window(False)
    rows = []
    for key, label in (("heap", "tool_jobs heap"), ("indexes", "tool_jobs indexes"),
                       ("journal", "tool_job_events with its indexes")):
        a = max((r[key] for r in sizes_a), default=0)
        b = max((r[key] for r in sizes_b), default=0)
        rows.append(Row("10", f"soak, {label}: last tenth vs first tenth of {total:,} jobs",
                        mib(b), f"first tenth {mib(a)}", f"{b / a:.2f} ×" if a else "n/a",
                        f"≤ {TARGET} × first", b <= TARGET * a if a else None))
    a50, b50 = percentile(claims_a, 50), percentile(claims_b, 50)
    rows.append(Row("10", "soak, claim statement p50 / p99: last tenth vs first tenth",
                    f"{ms(b50)} / {ms(percentile(claims_b, 99))}",
                    f"first tenth {ms(a50)} / {ms(percentile(claims_a, 99))}",
                    f"{b50 / a50:.2f} × (p50)", f"p50 ≤ {TARGET} × first", b50 <= TARGET * a50))
    rows.append(Row("10", "soak throughput and retention", f"{done / elapsed:,.0f} jobs/s",
                    f"{elapsed:.0f} s in all; retention removed {pruned['jobs']:,} jobs and "
                    f"{pruned['events']:,} journal rows"))
    ctx.settings.append(
        f"10: soak of {total:,} no-op jobs (bare loops on {CONSUMERS} connections, claim and "
        f"fenced finish with the journal rows the sidecar writes), about {QUEUED:,} kept "
        f"queued, retention {RETENTION_SECONDS:g} s pruned every second, autovacuum as the "
        "migrations set it; sizes sampled every 2 s")
    return rows
