"""The peers, PgQueuer, Procrastinate and DBOS, doing a sidecar's work per job: run
``/bin/true`` as a child in its own session with stdout and stderr captured (the payload is
empty, so stdin is /dev/null), then complete the job.
Helper processes (the bench's own process never imports them):

``python -m bench.peers prepare KIND DSN COUNT``  install the schema, enqueue COUNT jobs
``python -m bench.peers run KIND DSN CONCURRENCY START_AT``  work until the queue is empty;
    print ``{"jobs", "first", "last"}`` (wall-clock start of the first job, end of the last)

KIND is ``pgqueuer``, ``procrastinate`` or ``dbos``. The helpers run on uvloop, like the
sidecar; PgQueuer and Procrastinate run their jobs on it, DBOS on its executor's threads.
DBOS keeps its queue in its own system database: give it a database of its own (the
bench makes a scratch one per run), since its ``prepare`` empties the queue's workflows.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
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


_STATS_LOCK = threading.Lock()


def run_true_blocking() -> None:
    """run_true for a worker that runs each job on a thread of its own (DBOS's workflows
    without async): the same child, with the same session, stdin and captured output, by
    subprocess.run."""
    t0 = time.time()
    subprocess.run(["/bin/true"], stdin=subprocess.DEVNULL, capture_output=True,
                   start_new_session=True, check=False)
    t1 = time.time()
    with _STATS_LOCK:
        STATS["jobs"] += 1
        STATS["first"] = t0 if STATS["first"] is None else min(STATS["first"], t0)
        STATS["last"] = max(STATS["last"], t1)


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


# --- DBOS -------------------------------------------------------------------------
#
# One DBOS queue, each worker process an executor of its own with the queue's
# worker_concurrency = the slots of one process (no queue-wide limit: that would make the
# claim take its locks with NOWAIT in REPEATABLE READ). A DBOS queue is polled, not woken:
# each process's queue thread looks for work every polling_interval_sec and starts at most
# worker_concurrency - running workflows per look. At its default of 1 s a process could
# start no more than worker_concurrency jobs per second, so the bench sets it to
# DBOS_POLL_S: at 1x1 each job waits about one interval after the previous one ends, and
# 1, 2, 5 and 10 ms tried twice each at 1x1 and 1x8 on this machine (2026-12-04, load 3-4
# on 2 cores) differed by less than the noise between the two rounds (2 ms the fastest at
# 1x1 in the quieter one, 5 ms at 1x8); 2 ms keeps that wait small without doubling the
# idle polling of 1 ms. bench/throughput.py writes it in the settings.

DBOS_QUEUE = "bench"
DBOS_POLL_S = 0.002


def _dbos_launch(dsn: str, executor_id: str, listen: bool):
    """Configure, register the workflow and launch DBOS in this process (on the running
    event loop, so the workflows run on it); its system database is ``dsn``. ``listen``:
    whether this process dequeues from DBOS_QUEUE. Returns the DBOS class."""
    import logging

    from dbos import DBOS

    DBOS(config={"name": "sidecar_bench", "system_database_url": dsn,
                 "executor_id": executor_id, "application_version": "bench",
                 "log_level": "WARNING"})
    logging.getLogger("dbos").setLevel(logging.WARNING)

    # A workflow with no steps: DBOS records its start (the claim) and its outcome, as the
    # other peers record a job's claim and end; a step would add a checkpoint per job.
    # Not async: DBOS runs such a workflow on a thread of its executor, and that was its
    # fastest way here. As an async workflow on this uvloop loop (libuv forks the whole
    # DBOS process for each child) it ran 26 jobs/s at 1x1 and 55 at 1x8 against 45 and
    # 191 this way, and 37 and 127 on DBOS's own asyncio loop (2026-12-04, load 3-4).
    @DBOS.workflow(name=ENTRYPOINT)
    def bench_true() -> None:
        run_true_blocking()

    if not listen:
        DBOS.listen_queues([])
    DBOS.launch()
    return DBOS, bench_true


async def dbos_prepare(dsn: str, count: int) -> dict:
    """DBOS's system database in ``dsn`` created or migrated by its launch; DBOS_QUEUE
    registered closed (worker_concurrency 0: no worker starts a job until ``dbos_run``
    opens it at its START_AT, as the sidecars' gate job holds them) and emptied; ``count``
    workflows enqueued on it (50 enqueues in flight at a time)."""
    import psycopg

    DBOS, bench_true = _dbos_launch(dsn, "bench-prepare", listen=False)
    try:
        await DBOS.register_queue_async(DBOS_QUEUE, worker_concurrency=0,
                                        polling_interval_sec=DBOS_POLL_S,
                                        on_conflict="always_update")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("DELETE FROM dbos.workflow_status WHERE queue_name = %s",
                               (DBOS_QUEUE,))
        for start in range(0, count, 50):
            await asyncio.gather(*(DBOS.enqueue_workflow_async(DBOS_QUEUE, bench_true)
                                   for _ in range(min(50, count - start))))
    finally:
        DBOS.destroy()
    return {"enqueued": count}


async def dbos_run(dsn: str, concurrency: int, start_at: float) -> dict:
    """One DBOS worker process (executor ``bench-PID``): launched before ``start_at``, at
    ``start_at`` it sets DBOS_QUEUE's worker_concurrency to ``concurrency`` (every worker
    sets the same value; each process's queue thread reads it at its next poll), then works
    until no workflow of the queue is enqueued or running (checked every 0.1 s), so every
    job it ran has its outcome recorded. Returns STATS."""
    DBOS, _ = _dbos_launch(dsn, f"bench-{os.getpid()}", listen=True)
    try:
        queue = await DBOS.retrieve_queue_async(DBOS_QUEUE)
        await _sleep_until(start_at)
        await queue.set_worker_concurrency_async(concurrency)  # the gate opens
        while await DBOS.list_queued_workflows_async(queue_name=DBOS_QUEUE, limit=1,
                                                     load_input=False, load_output=False):
            await asyncio.sleep(0.1)
    finally:
        DBOS.destroy()
    return dict(STATS)


def main(argv: list[str]) -> int:
    import uvloop

    action, kind, dsn = argv[0], argv[1], argv[2]
    table = {("prepare", "pgqueuer"): lambda: pgqueuer_prepare(dsn, int(argv[3])),
             ("prepare", "procrastinate"): lambda: procrastinate_prepare(dsn, int(argv[3])),
             ("run", "pgqueuer"): lambda: pgqueuer_run(dsn, int(argv[3]), float(argv[4])),
             ("run", "procrastinate"):
                 lambda: procrastinate_run(dsn, int(argv[3]), float(argv[4])),
             ("prepare", "dbos"): lambda: dbos_prepare(dsn, int(argv[3])),
             ("run", "dbos"): lambda: dbos_run(dsn, int(argv[3]), float(argv[4]))}
    if (action, kind) not in table:
        print(f"unknown: {action} {kind}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(table[action, kind]())
    sys.stdout.buffer.write(orjson.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
