"""1. Throughput of no-op jobs (``/bin/true``, empty payload) per shape (sidecars x
concurrency), against the limit (bare claim+complete, bare spawn-and-reap) and the peers.

The sidecars are real ``sidecar run --drain`` processes. So that their start-up is not
timed, a gate job (queued, due tomorrow) keeps them from draining while they start; the
jobs are then inserted in one transaction with one NOTIFY, and cancelling the gate lets
them drain. A run's throughput is jobs / (last ``finished_at`` - first ``first_claimed_at``)
by the database's clock; the helpers report the same window on the wall clock.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import asyncpg
import psutil

from bench.common import (
    BenchError,
    Context,
    Sidecar,
    enqueue_many,
    helper_argv,
    progress,
    rate,
    run_helpers,
    until,
)
from bench.report import Row

PEERS = ("pgqueuer", "procrastinate")
PEER_LABEL = {"pgqueuer": "PgQueuer", "procrastinate": "Procrastinate"}

WINDOW_SQL = """
SELECT count(*) AS jobs,
       extract(epoch FROM max(finished_at) - min(first_claimed_at))::float8 AS seconds,
       count(*) FILTER (WHERE state = 'failed' AND error->>'kind' = 'bad_result') AS no_op
FROM tool_jobs WHERE tool = $1 AND first_claimed_at IS NOT NULL AND finished_at IS NOT NULL
"""


def peer_available(kind: str) -> bool:
    return importlib.util.find_spec(kind) is not None


async def _window(conn: asyncpg.Connection, tool: str, expected: int,
                  ctx: Context | None = None) -> float:
    row = await conn.fetchrow(WINDOW_SQL, tool)
    if row["jobs"] != expected:
        raise BenchError(f"{tool}: {row['jobs']} of {expected} jobs finished")
    if ctx is not None and row["no_op"] != expected:
        ctx.notes.append(f"{tool}: {expected - row['no_op']} of {expected} jobs did not end "
                         "as failed/bad_result (the no-op's usual end: empty stdout)")
    return expected / row["seconds"]


def _cpu(procs: list[Sidecar]) -> float:
    """CPU seconds (user + system) the sidecar processes used so far, children excluded."""
    total = 0.0
    for p in procs:
        try:
            times = psutil.Process(p.pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


async def sidecar_run(ctx: Context, conn: asyncpg.Connection, sidecars: int,
                      concurrency: int, tag: str = "") -> dict:
    """Throughput of ``sidecars`` real sidecars at ``concurrency`` each; also their CPU.
    ``tag`` tells apart two runs of one shape (a tool of their own)."""
    shape = f"{sidecars}x{concurrency}" + (f"-{tag}" if tag else "")
    tool, jobs = f"true-{shape}", ctx.mode.jobs
    await enqueue_many(conn, tool, 1, notify=False, delay_seconds=86400)  # the gate
    procs = [Sidecar(ctx, f"throughput-{shape}-{i}", tool, ["/bin/true"],
                     concurrency, drain=True) for i in range(sidecars)]
    try:
        await asyncio.gather(*(p.ready() for p in procs))
        cpu0 = _cpu(procs)  # start-up excluded
        await enqueue_many(conn, tool, jobs)

        async def finished():
            for p in procs:
                if p.proc.poll() is not None:
                    raise BenchError(f"sidecar {p.name} exited early: {p.tail()}")
            done = await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = $1 "
                                       "AND finished_at IS NOT NULL", tool)
            return done >= jobs

        await until(finished, timeout=60 + jobs / 5, interval=0.1,
                    what=f"{jobs} jobs of {tool}")
        cpu = _cpu(procs) - cpu0
        async with conn.transaction():  # the gate goes; the NOTIFY makes them drain now
            await conn.execute("UPDATE tool_jobs SET state = 'cancelled', finished_at = now() "
                               "WHERE tool = $1 AND state = 'queued'", tool)
            await conn.execute("SELECT pg_notify('sidecar_jobs', $1)", tool)
        await asyncio.gather(*(p.exit(30) for p in procs))
    finally:
        for p in procs:
            await p.stop()
    ctx.count("sidecars (no-op throughput)", jobs)
    throughput = await _window(conn, tool, jobs, ctx)
    return {"rate": throughput, "cpu_ms_per_job": 1000 * cpu / jobs}


async def claim_limit(ctx: Context, conn: asyncpg.Connection, sidecars: int,
                      concurrency: int) -> float:
    """The bare claim + fenced-complete loop: as many processes and connections."""
    tool, jobs = f"bare-{sidecars}x{concurrency}", ctx.mode.jobs
    await enqueue_many(conn, tool, jobs, notify=False)
    start_at = time.time() + 0.8 + 0.2 * sidecars
    await run_helpers(ctx, [helper_argv("baseline", "claim", ctx.dsn, tool, concurrency,
                                        start_at) for _ in range(sidecars)],
                      timeout=60 + jobs / 20)
    ctx.count("bare claim+complete loops", jobs)
    return await _window(conn, tool, jobs)


def _helper_rate(results: list[dict], expected: int, what: str) -> float:
    jobs = sum(r["jobs"] for r in results)
    if jobs != expected:
        raise BenchError(f"{what}: {jobs} of {expected} jobs done")
    first = min(r["first"] for r in results)
    last = max(r["last"] for r in results)
    return jobs / (last - first)


async def spawn_limit(ctx: Context, sidecars: int, concurrency: int) -> float:
    jobs = ctx.mode.jobs
    shares = [jobs // sidecars + (1 if i < jobs % sidecars else 0) for i in range(sidecars)]
    start_at = time.time() + 0.5 + 0.1 * sidecars
    results = await run_helpers(ctx, [helper_argv("baseline", "spawn", n, concurrency, start_at)
                                      for n in shares], timeout=60 + jobs / 50)
    return _helper_rate(results, jobs, "bare spawn")


async def peer_rate(ctx: Context, kind: str, sidecars: int, concurrency: int) -> float:
    jobs = ctx.mode.jobs
    await run_helpers(ctx, [helper_argv("peers", "prepare", kind, ctx.dsn, jobs)], timeout=120)
    start_at = time.time() + 1.5 + 0.3 * sidecars
    results = await run_helpers(ctx, [helper_argv("peers", "run", kind, ctx.dsn, concurrency,
                                                  start_at) for _ in range(sidecars)],
                                timeout=60 + jobs / 10)
    return _helper_rate(results, jobs, PEER_LABEL[kind])


async def _try(what: str, coro):
    try:
        return await coro
    except Exception as exc:  # noqa: BLE001 - one failed measurement is one cell, not the run
        progress(f"{what} failed: {type(exc).__name__}: {exc}")
        return exc


def _fmt(value) -> str:
    return rate(value) if isinstance(value, float) else f"error ({type(value).__name__})"


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    rows: list[Row] = []
    notes: list[str] = []
    peers = [kind for kind in PEERS if peer_available(kind)]
    for sidecars, concurrency in ctx.mode.shapes:
        shape = f"{sidecars}×{concurrency}"
        progress(f"throughput {shape}: {ctx.mode.jobs} no-op jobs")
        sc = await _try(f"sidecar {shape}", sidecar_run(ctx, conn, sidecars, concurrency))
        claim = await _try(f"bare claim {shape}", claim_limit(ctx, conn, sidecars, concurrency))
        spawn = await _try(f"bare spawn {shape}", spawn_limit(ctx, sidecars, concurrency))
        peer_rates = {kind: await _try(f"{kind} {shape}",
                                       peer_rate(ctx, kind, sidecars, concurrency))
                      for kind in peers}
        value = sc["rate"] if isinstance(sc, dict) else None
        limits = [x for x in (claim, spawn) if isinstance(x, float)]
        limit = min(limits) if len(limits) == 2 else None
        if isinstance(sc, dict):
            notes.append(f"{shape}: sidecar CPU {sc['cpu_ms_per_job']:.1f} ms per job "
                         "(its own process, children excluded)")
        rows.append(Row(
            "1", f"no-op throughput, {shape} (sidecars × concurrency) vs the limit",
            rate(value) if value else _fmt(sc),
            f"claim+complete {_fmt(claim)}; spawn+reap {_fmt(spawn)}",
            f"{value / limit:.2f} × limit" if value and limit else "n/a",
            "≥ 0.70 × limit", value >= 0.7 * limit if value and limit else None))
        ok = {k: v for k, v in peer_rates.items() if isinstance(v, float)}
        baseline = "; ".join(f"{PEER_LABEL[k]} {_fmt(v)}" for k, v in peer_rates.items()) \
            or "peers not installed (pip install -e '.[bench]')"
        ratio = ", ".join(f"{value / v:.2f} × {PEER_LABEL[k]}" for k, v in ok.items()) \
            if value else "n/a"
        met = value > max(ok.values()) if value and len(ok) == len(PEERS) else None
        rows.append(Row("1", f"no-op throughput, {shape} vs the peers", rate(value) if value
                        else _fmt(sc), baseline, ratio or "n/a", "above both peers", met))
    ctx.notes.extend(notes)
    if any(row.met is False for row in rows):
        ctx.notes.append(WHY_SLOW)
    return rows


WHY_SLOW = (
    "**Why the throughput targets are missed, and what would fix it.** The limit loops "
    "spend well under a millisecond of CPU per job; the sidecar spends the figure above, "
    "and on 2 cores shared with PostgreSQL and the children that caps it. The host-wide "
    "process scan that used to dominate (psutil's children() reads /proc/*/stat of every "
    "process) is gone: trees are read from their root down, and the cost no longer grows "
    "with the host (section 8). A py-spy profile of `sidecar run --concurrency 8 -- "
    "/bin/true` over 600 jobs (taken after that change) spreads the rest: the post-exit "
    "tree scan and its psutil objects (about 9 % of all samples, idle threads included), "
    "Popen with preexec_fn, which forces fork instead of vfork (9 %), removing the attempt's "
    "work directory (5 %), the pooled statements (4 %) and the orphan reaper (4 %). Fixes, "
    "biggest first: skip the scan when the tool exited and nothing was adopted; set the "
    "parent-death signal, session and limits without preexec_fn (an exec shim); fold the "
    "`tool_request_started` and `child_killed` journal rows into the finish statement."
)
