"""6. Footprint of one sidecar with the default profile: RSS idle and with 8 running jobs
(``/bin/sleep``), CPU while idle. The baseline is a Python interpreter that imported what
the sidecar imports, then sleeps."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import asyncpg
import psutil

from bench.common import (
    Context,
    Sidecar,
    clean_env,
    enqueue_many,
    mib,
    progress,
    until,
)
from bench.report import Row

MIB = 1048576
IMPORTS = ("import asyncio, asyncpg, h11, orjson, psutil, uvloop, sidecar.cli, "
           "sidecar.worker.claim_loop, sidecar.worker.guardian, sys, time; "
           "print('ready', flush=True); "
           "time.sleep(600)")


IMPORT_COST = ("import psutil, importlib, sys; p = psutil.Process(); r0 = p.memory_info().rss; "
               "importlib.import_module(sys.argv[1]); print(p.memory_info().rss - r0, r0)")
HEAVY = ("asyncio", "asyncpg", "uvloop", "prometheus_client", "h11", "aiohttp")


def _import_costs() -> tuple[int, dict[str, int]]:
    """RSS an interpreter gains by importing each of HEAVY alone (they overlap: asyncio is
    in all of them), and the RSS of the interpreter before."""
    procs = {m: subprocess.Popen([sys.executable, "-c", IMPORT_COST, m], env=clean_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for m in HEAVY}
    costs, base = {}, 0
    for module, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        gained, base = (int(x) for x in out.split())
        costs[module] = gained
    return base, costs


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    window = ctx.mode.idle_window
    progress(f"footprint: idle for {window:g} s, then 8 running jobs")
    bare = ctx.popen([sys.executable, "-c", IMPORTS], env=clean_env(),
                     stdout=subprocess.PIPE)
    # SIDECAR_DRAIN_SECONDS=0: the stop at the end kills the sleeping tools at once.
    sc = Sidecar(ctx, "footprint", "idle", ["/bin/sleep", "600"], 8, SIDECAR_DRAIN_SECONDS="0")
    try:
        await sc.ready()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, bare.stdout.readline)
        await asyncio.sleep(1.0)  # past start-up
        me, other = psutil.Process(sc.pid), psutil.Process(bare.pid)
        cpu0, bare0 = _cpu(me), _cpu(other)
        await asyncio.sleep(window)
        idle_cpu = (_cpu(me) - cpu0) / window
        bare_cpu = (_cpu(other) - bare0) / window
        rss_idle, uss_idle = me.memory_info().rss, me.memory_full_info().uss
        rss_bare = other.memory_info().rss
        guardian = sc.guardian()
        rss_guardian = guardian.memory_info().rss if guardian else float("nan")
        await enqueue_many(conn, "idle", 8, max_attempts=1)

        async def eight():
            return len(sc.tool_children()) >= 8

        await until(eight, 30, what="8 running jobs")
        await asyncio.sleep(1.0)
        rss_busy = me.memory_info().rss
    finally:
        await sc.stop()
        bare.kill()
        bare.wait()
    ctx.count("footprint jobs", 8)
    ctx.notes.append(f"footprint: sidecar USS idle {mib(uss_idle)} (memory only it holds); "
                     f"its guardian process {mib(rss_guardian)} RSS")
    ctx.settings.append(f"footprint: default profile (H = 30 s, poll 2 s), concurrency 8, "
                        f"idle CPU over {window:g} s after 1 s of start-up")
    if rss_idle > 45 * MIB:
        base, costs = await asyncio.get_running_loop().run_in_executor(None, _import_costs)
        ctx.notes.append(
            f"**Why idle RSS misses 45 MiB, and what would fix it.** An interpreter that only "
            f"imports the sidecar's modules and sleeps takes {mib(rss_bare)}; the sidecar's "
            f"own data adds {mib(rss_idle - rss_bare)}. Measured here, a bare interpreter is "
            f"{mib(base)} and each import alone adds: "
            + ", ".join(f"{m} +{mib(c)}" for m, c in costs.items())
            + " (overlapping: asyncio is part of the others). The guard and the HTTP "
            "endpoints run on h11 and asyncio streams; aiohttp is imported only by the "
            "forwarder, at its first result to deliver.")
    return [
        Row("6", "sidecar RSS, idle", mib(rss_idle),
            f"interpreter with the same imports {mib(rss_bare)}; guardian {mib(rss_guardian)}",
            f"{rss_idle / rss_bare:.2f} × bare", "≤ 45 MiB", rss_idle <= 45 * MIB),
        Row("6", "sidecar RSS, 8 running jobs", mib(rss_busy), f"idle {mib(rss_idle)}",
            f"+{mib(rss_busy - rss_idle)}"),
        Row("6", "sidecar CPU while idle", f"{idle_cpu * 100:.2f} % of a core",
            f"sleeping interpreter {bare_cpu * 100:.2f} %"),
    ]
