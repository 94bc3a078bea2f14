"""5. Event-loop lag of an in-process ``sidecar.worker.claim_loop.Worker`` (on uvloop, as
``sidecar run``
runs it) while 8 children at a time flood stdout and stderr and new ones keep spawning: a
probe task sleeps 10 ms in a loop and records how late it wakes. The baseline is the same
probe beside the same Worker with no job.

Runs in a helper process, ``python -m bench.lag DSN JOBS CONCURRENCY``, so the bench's own
work does not disturb the loop; it prints the samples' summary as JSON.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time

import asyncpg
import orjson

from bench.common import TOOLS, Context, clean_env, helper_argv, ms, progress, run_helpers
from bench.report import Row

MIB = 1024 * 1024
PROBE = 0.010


def payload(i: int) -> dict:
    if i % 2 == 0:  # a valid 512 KiB JSON result
        return {"stdout_bytes": MIB // 2, "stderr_bytes": 2 * MIB, "json": True}
    return {"stdout_bytes": 3 * MIB, "stderr_bytes": 2 * MIB, "json": False}


async def probe(stop: asyncio.Event) -> list[float]:
    loop = asyncio.get_running_loop()
    lags = []
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(PROBE)
        lags.append(loop.time() - start - PROBE)
    return lags


def summary(lags: list[float], seconds: float) -> dict:
    from bench.common import percentile

    return {"samples": len(lags), "p50": percentile(lags, 50), "p99": percentile(lags, 99),
            "max": max(lags), "seconds": seconds}


async def measure(dsn: str, jobs: int, concurrency: int) -> dict:
    from sidecar.runtime import log as log_mod
    from sidecar.runtime.config import load_settings
    from sidecar.storage import db
    from sidecar.storage.caller_store import CallerStore
    from sidecar.worker import cgroups, child, isolation, linux
    from sidecar.worker.claim_loop import Worker

    settings = load_settings()
    profile = settings.profile("flood")
    # As `sidecar run` runs it: the child subreaper, so a job's tree is read from the
    # sidecar down on the loop, not by a scan of every process on the host in a thread;
    # the tools' RLIMIT_CORE taken by the sidecar itself, so they start by vfork, not by
    # fork and a preexec_fn; and job cgroups where the host has them.
    isolation.share_limits(profile)
    host = cgroups.detect(settings.cgroups)
    adopt = linux.set_child_subreaper()
    processes = child.ProcessTable(subreaper=adopt)  # one for the process, both Workers
    argv = [sys.executable, str(TOOLS / "cp_flood.py")]
    # The sidecar's events go to a file, as `sidecar run 2>file` would write them.
    log_file = tempfile.NamedTemporaryFile(prefix="bench-lag-", suffix=".log", delete=False)  # noqa: SIM115
    log_mod.log.stream = log_file
    log_mod.log.fmt = "json"
    out = {}
    try:
        # Baseline: the same Worker, started, with nothing to do.
        worker = Worker(settings, profile, dsn, argv, concurrency=concurrency,
                        adopt_orphans=adopt, cgroup_host=host, processes=processes)
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        stop = asyncio.Event()
        probing = asyncio.create_task(probe(stop))
        await asyncio.sleep(2.0)
        stop.set()
        out["idle"] = summary(await probing, 2.0)
        worker.request_stop()
        await running

        pool = await db.create_pool(dsn, 5, max_size=2)
        store = CallerStore(pool, 5)
        for i in range(jobs):
            await store.enqueue("flood", payload(i), None, 1, {})
        await pool.close()
        worker = Worker(settings, profile, dsn, argv, concurrency=concurrency, drain=True,
                        adopt_orphans=adopt, cgroup_host=host, processes=processes)
        stop = asyncio.Event()
        probing = asyncio.create_task(probe(stop))
        started = time.monotonic()
        try:
            code = await asyncio.wait_for(worker.run(), 300)
        finally:
            stop.set()
        out["flood"] = summary(await probing, time.monotonic() - started)
        out["code"] = code
        conn = await asyncpg.connect(dsn)
        try:
            out["outcomes"] = {f"{r['state']}/{r['kind']}": r["n"] for r in await conn.fetch(
                "SELECT state, coalesce(error->>'kind', '') AS kind, count(*) AS n "
                "FROM tool_jobs WHERE tool = 'flood' GROUP BY 1, 2")}
        finally:
            await conn.close()
        log_file.flush()
        lost = sum(1 for line in open(log_file.name, "rb")  # noqa: SIM115
                   if b'"heartbeat_lost"' in line or b'"lease_abandoned"' in line)
        out["leases_lost"] = lost
        out["subreaper"] = adopt
        out["cgroups"] = host.usable
    finally:
        log_file.close()
        os.unlink(log_file.name)
    return out


def main(argv: list[str]) -> int:
    import uvloop

    dsn, jobs, concurrency = argv[0], int(argv[1]), int(argv[2])
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(measure(dsn, jobs, concurrency))
    sys.stdout.buffer.write(orjson.dumps(out))
    return 0


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    jobs, concurrency = ctx.mode.lag_jobs, 8
    progress(f"event-loop lag: {jobs} flooding jobs, concurrency {concurrency}")
    env = clean_env(SIDECAR_DATABASE_URL=ctx.dsn, SIDECAR_MAX_RESULT_BYTES=str(MIB),
                    SIDECAR_STAGE_TIMEOUT_SECONDS="120")
    [out] = await run_helpers(ctx, [helper_argv("lag", ctx.dsn, jobs, concurrency)],
                              timeout=120 + jobs * 2, env=env)
    ctx.count("flood jobs", jobs)
    idle, flood = out["idle"], out["flood"]
    ctx.settings.append(
        f"event-loop lag: in-process Worker on uvloop as `sidecar run` runs it (child "
        f"subreaper: {out.get('subreaper')}, job cgroups: {out.get('cgroups')}), "
        f"concurrency {concurrency}, {jobs} jobs "
        "each writing 2 MiB of 128-byte stderr lines and either a 512 KiB JSON result or 3 MiB "
        f"of stdout over the 1 MiB cap; probe period {PROBE * 1000:g} ms; "
        f"{flood['samples']} samples over {flood['seconds']:.1f} s, baseline "
        f"{idle['samples']} samples with the Worker idle")
    ctx.notes.append(f"event-loop lag run: outcomes {out['outcomes']}, worker exit "
                     f"{out['code']}, heartbeat_lost/lease_abandoned lines {out['leases_lost']}")
    return [
        Row("5", "event-loop lag p99, 8 children flooding stdout+stderr, new ones spawning",
            ms(flood["p99"]), f"idle Worker {ms(idle['p99'])}",
            f"+{ms(flood['p99'] - idle['p99'])}", "< 20 ms", flood["p99"] < 0.020),
        Row("5", "longest single stall of the event loop, same run", ms(flood["max"]),
            f"idle Worker {ms(idle['max'])}", f"+{ms(flood['max'] - idle['max'])}"),
    ]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
