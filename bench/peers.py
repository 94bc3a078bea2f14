"""The peers, PgQueuer and Procrastinate, doing a sidecar's work per job: run ``/bin/true``
as a child in its own session with stdout and stderr captured (the payload is empty, so
stdin is /dev/null), then complete the job.
Helper processes (the bench's own process never imports them):

``python -m bench.peers prepare KIND DSN COUNT``  install the schema, enqueue COUNT jobs
``python -m bench.peers run KIND DSN CONCURRENCY START_AT``  work until the queue is empty;
    print ``{"jobs", "first", "last"}`` (wall-clock start of the first job, end of the last)

KIND is ``pgqueuer`` or ``procrastinate``. Both run on uvloop, like the sidecar.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta

import orjson

ENTRYPOINT = "bench_true"
STATS = {"jobs": 0, "first": None, "last": 0.0}


async def run_true() -> None:
    """The work of one job: what the sidecar does for ``/bin/true`` minus its bookkeeping."""
    t0 = time.time()
    proc = await asyncio.create_subprocess_exec(
        "/bin/true", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    await proc.communicate()
    STATS["jobs"] += 1
    STATS["first"] = t0 if STATS["first"] is None else min(STATS["first"], t0)
    STATS["last"] = max(STATS["last"], time.time())


async def _sleep_until(start_at: float) -> None:
    await asyncio.sleep(max(0.0, start_at - time.time()))


# --- PgQueuer -------------------------------------------------------------------


async def pgqueuer_prepare(dsn: str, count: int) -> dict:
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        if not await queries.schema_is_installed():
            await queries.install()
        await queries.clear_queue()
        for start in range(0, count, 2000):
            n = min(2000, count - start)
            await queries.enqueue([ENTRYPOINT] * n, [None] * n, [0] * n)
    finally:
        await conn.close()
    return {"enqueued": count}


async def pgqueuer_run(dsn: str, concurrency: int, start_at: float) -> dict:
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.types import QueueExecutionMode

    conn = await asyncpg.connect(dsn)
    pgq = PgQueuer.from_asyncpg_connection(conn)

    @pgq.entrypoint(ENTRYPOINT, concurrency_limit=1 if concurrency == 1 else 0)
    async def bench_true(job) -> None:
        await run_true()

    batch = max(1, concurrency // 2)
    await _sleep_until(start_at)
    try:
        await pgq.qm.run(dequeue_timeout=timedelta(seconds=1), batch_size=batch,
                         mode=QueueExecutionMode.drain,
                         max_concurrent_tasks=max(concurrency, 2 * batch))
    finally:
        await conn.close()
    return dict(STATS)


# --- Procrastinate ----------------------------------------------------------------


def _procrastinate_app(dsn: str):
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=dsn, min_size=1, max_size=12))

    @app.task(name=ENTRYPOINT, queue="bench")
    async def bench_true() -> None:
        await run_true()

    return app, bench_true


async def procrastinate_prepare(dsn: str, count: int) -> dict:
    import psycopg

    app, task = _procrastinate_app(dsn)
    async with app.open_async():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
            installed = (await cur.fetchone())[0]
        if not installed:
            await app.schema_manager.apply_schema_async()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("DELETE FROM procrastinate_jobs")
        for start in range(0, count, 2000):
            n = min(2000, count - start)
            await task.batch_defer_async(*({} for _ in range(n)))
    return {"enqueued": count}


async def procrastinate_run(dsn: str, concurrency: int, start_at: float) -> dict:
    import logging

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    app, _ = _procrastinate_app(dsn)
    async with app.open_async():
        await _sleep_until(start_at)
        await app.run_worker_async(queues=["bench"], concurrency=concurrency, wait=False,
                                   install_signal_handlers=False)
    return dict(STATS)


def main(argv: list[str]) -> int:
    import uvloop

    action, kind, dsn = argv[0], argv[1], argv[2]
    table = {("prepare", "pgqueuer"): lambda: pgqueuer_prepare(dsn, int(argv[3])),
             ("prepare", "procrastinate"): lambda: procrastinate_prepare(dsn, int(argv[3])),
             ("run", "pgqueuer"): lambda: pgqueuer_run(dsn, int(argv[3]), float(argv[4])),
             ("run", "procrastinate"):
                 lambda: procrastinate_run(dsn, int(argv[3]), float(argv[4]))}
    if (action, kind) not in table:
        print(f"unknown: {action} {kind}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(table[action, kind]())
    sys.stdout.buffer.write(orjson.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
