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
PEER_TARGET_SHAPES = ((1, 1), (1, 8), (4, 8))
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
                      concurrency: int, tag: str = "", jobs: int | None = None) -> dict:
    """Throughput of ``sidecars`` real sidecars at ``concurrency`` each; also their CPU.
    ``tag`` tells apart two runs of one shape (a tool of their own); ``jobs`` defaults to
    the mode's."""
    shape = f"{sidecars}x{concurrency}" + (f"-{tag}" if tag else "")
    tool, jobs = f"true-{shape}", jobs or ctx.mode.jobs
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
            await conn.execute("SELECT tool_job_wake($1, $2)", tool, sidecars)
        await asyncio.gather(*(p.exit(30) for p in procs))
    finally:
        for p in procs:
            await p.stop()
    ctx.count("sidecars (no-op throughput)", jobs)
    throughput = await _window(conn, tool, jobs, ctx)
    return {"rate": throughput, "cpu_ms_per_job": 1000 * cpu / jobs}


async def claim_limit(ctx: Context, conn: asyncpg.Connection, sidecars: int,
                      concurrency: int, kind: str = "claim") -> float:
    """The bare claim + fenced-complete loop (``kind`` claim) or the bare loop that also
    spawns and awaits the tool (``kind`` loop): as many processes and connections."""
    tool, jobs = f"bare-{kind}-{sidecars}x{concurrency}", ctx.mode.jobs
    await enqueue_many(conn, tool, jobs, notify=False)
    start_at = time.time() + 0.8 + 0.2 * sidecars
    await run_helpers(ctx, [helper_argv("baseline", kind, ctx.dsn, tool, concurrency,
                                        start_at) for _ in range(sidecars)],
                      timeout=60 + jobs / 20)
    ctx.count("bare claim+complete loops" if kind == "claim" else "bare loops (claim, spawn, "
              "wait, complete)", jobs)
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
        bare = await _try(f"bare loop {shape}",
                          claim_limit(ctx, conn, sidecars, concurrency, "loop"))
        claim = await _try(f"bare claim {shape}", claim_limit(ctx, conn, sidecars, concurrency))
        spawn = await _try(f"bare spawn {shape}", spawn_limit(ctx, sidecars, concurrency))
        peer_rates = {kind: await _try(f"{kind} {shape}",
                                       peer_rate(ctx, kind, sidecars, concurrency))
                      for kind in peers}
        value = sc["rate"] if isinstance(sc, dict) else None
        notes.append(f"{shape}: the parts of the bare loop alone: claim+complete "
                     f"{_fmt(claim)}, spawn+reap {_fmt(spawn)}")
        rows.append(Row(
            "1", f"no-op throughput, {shape} (sidecars × concurrency) vs the bare loop",
            rate(value) if value else _fmt(sc),
            f"bare loop (claim, spawn, wait, fenced complete) {_fmt(bare)}",
            f"{value / bare:.2f} × bare" if value and isinstance(bare, float) else "n/a",
            "≥ 0.5 × bare", value >= 0.5 * bare if value and isinstance(bare, float)
            else None))
        ok = {k: v for k, v in peer_rates.items() if isinstance(v, float)}
        baseline = "; ".join(f"{PEER_LABEL[k]} {_fmt(v)}" for k, v in peer_rates.items()) \
            or "peers not installed (pip install -e '.[bench]')"
        ratio = ", ".join(f"{value / v:.2f} × {PEER_LABEL[k]}" for k, v in ok.items()) \
            if value else "n/a"
        # The shapes issue 14 sets the target for; 2×8 is measured for the trend.
        targeted = (sidecars, concurrency) in PEER_TARGET_SHAPES
        met = value >= max(ok.values()) if value and len(ok) == len(PEERS) and targeted \
            else None
        rows.append(Row("1", f"no-op throughput, {shape} vs the peers", rate(value) if value
                        else _fmt(sc), baseline, ratio or "n/a",
                        "≥ 1.0 × the better peer" if targeted else "-", met))
        if isinstance(sc, dict):
            cpu = sc["cpu_ms_per_job"]
            target = (sidecars, concurrency) == (1, 8)
            rows.append(Row("1", f"sidecar CPU per job, {shape}", f"{cpu:.2f} ms",
                            "its own process, children excluded", "-",
                            "≤ 3 ms" if target else "-", cpu <= 3.0 if target else None))
    ctx.notes.extend(notes)
    if any(row.met is False for row in rows):
        ctx.notes.append(WHY_SLOW)
    return rows


WHY_SLOW = (
    "**Why a throughput target is missed.** Each job costs the sidecar the CPU in its row "
    "(its own process); on 2 cores shared with PostgreSQL, the tools and the peers' runs, "
    "that caps jobs/s. Since issue 14 a default-profile tool is started by vfork with no "
    "preexec_fn (a fork+preexec spawn cost the sidecar 6-9 ms a job: copying its page "
    "tables and the copy-on-write faults after), the post-exit tree check is a few /proc "
    "reads on the event loop instead of three hops to threads, pooled statements skip "
    "asyncpg's reset round trip and the journal rows of an attempt travel with its final "
    "statement. What is left is the claim and finish statements, the work directory and "
    "cgroup made and removed per attempt, and the Python of the supervisor itself."
)
