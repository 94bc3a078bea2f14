"""8. Host scale: the sidecar's own CPU per job follows the tool's tree, not the host.
One sidecar at concurrency 8 runs no-op jobs with N extra idle processes on the host
(``sleep`` processes this section starts and ends), against the same run without them,
both in this run. Before the tree was read from its root down, every job read
/proc/*/stat of every process on the host."""

from __future__ import annotations

import asyncpg

from bench.common import Context, progress
from bench.report import Row
from bench.throughput import sidecar_run

TARGET = 1.2  # at most this many times the CPU per job without the extra processes


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    extra = 300 if ctx.mode.name == "quick" else 3000
    progress(f"host scale: {ctx.mode.jobs} no-op jobs at 1x8, without and with {extra} "
             "idle processes")
    quiet = await sidecar_run(ctx, conn, 1, 8, tag="quiet")
    sleepers = [ctx.popen(["sleep", "3600"]) for _ in range(extra)]
    try:
        crowded = await sidecar_run(ctx, conn, 1, 8, tag=f"{extra}-idle")
    finally:
        for proc in sleepers:
            proc.kill()
        for proc in sleepers:
            proc.wait()
    ctx.settings.append(f"8: {ctx.mode.jobs} no-op jobs (/bin/true) per run, one sidecar at "
                        f"concurrency 8, {extra} extra `sleep` processes in the second run")
    base, loaded = quiet["cpu_ms_per_job"], crowded["cpu_ms_per_job"]
    ratio = loaded / base if base else float("inf")
    return [Row("8", f"sidecar CPU per job, 1×8, with {extra} idle processes on the host",
                f"{loaded:.1f} ms", f"{base:.1f} ms without them", f"{ratio:.2f} ×",
                f"≤ {TARGET} × without", ratio <= TARGET)]
