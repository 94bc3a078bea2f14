"""``python -m bench``: run the sections, print the table, write ``bench/RESULTS.md``."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import (
    caller,
    fleet,
    flowctl,
    footprint,
    gateway,
    health,
    heartbeat,
    hostscale,
    lag,
    pickup,
    reaction,
    soak,
    throughput,
    wal,
    warmtools,
)
from bench.common import (
    MODES,
    BenchError,
    Context,
    connect,
    create_scratch_database,
    database_name,
    drop_database,
    measure_clock_offset,
    progress,
)
from bench.report import Row, earlier_results, machine, table, write_results

# Section number -> (title, module). Each module's ``run(ctx, conn)`` returns its rows.
SECTIONS = {
    "1": ("throughput", throughput),
    "2": ("pickup latency", pickup),
    "3": ("heartbeat cost", heartbeat),
    "4": ("reaction times", reaction),
    "5": ("event-loop lag", lag),
    "6": ("footprint", footprint),
    "7": ("queue health", health),
    "8": ("host scale", hostscale),
    "9": ("fleet", fleet),
    "10": ("soak", soak),
    "11": ("caller round trip", caller),
    "12": ("flow control", flowctl),
    "13": ("WAL per job", wal),
    "14": ("MCP gateway", gateway),
    "15": ("warm tools", warmtools),
}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark the sidecar against the limit and the peers; print one "
                    "markdown table and write it to bench/RESULTS.md.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CI size: under 60 s in all")
    size.add_argument("--medium", action="store_true",
                      help="between quick and full: about 15 minutes on 2 cores")
    parser.add_argument("--dsn", help="PostgreSQL server to use (a scratch database is "
                        "created on it and dropped); default: SIDECAR_DATABASE_URL, else the "
                        "embedded PostgreSQL")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help=f"where to write the results (default {DEFAULT_OUTPUT})")
    parser.add_argument("--only", default="",
                        help="comma-separated section numbers to run, e.g. 1,5 (default all)")
    parser.add_argument("--jobs", type=int, help="override the no-op jobs per throughput shape")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch database and the logs (for a post-mortem)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(amain(args))


def _admin_dsn(args: argparse.Namespace) -> tuple[str, bool]:
    """The server's DSN, and whether it is the embedded server the bench started or found
    (no --dsn, no SIDECAR_DATABASE_URL): only there may a section run server-wide commands
    such as CHECKPOINT."""
    if args.dsn:
        return args.dsn, False
    from sidecar.runtime.config import load_settings
    from sidecar.storage.db import resolve_dsn

    settings = load_settings()
    return resolve_dsn(settings), not settings.database_url


async def amain(args: argparse.Namespace) -> int:
    mode_name = "quick" if args.quick else "medium" if args.medium else "full"
    mode = MODES[mode_name]
    if args.jobs:
        from dataclasses import replace

        mode = replace(mode, jobs=args.jobs)
    only = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        print(f"--only: unknown section(s) {', '.join(unknown)}; use 1-{len(SECTIONS)}",
              file=sys.stderr)
        return 2
    started, load_start = time.monotonic(), os.getloadavg()
    try:
        admin_dsn, owns_server = _admin_dsn(args)
        dsn = await create_scratch_database(admin_dsn)
    except Exception as exc:  # noqa: BLE001 - one line for people
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="sidecar-bench-"))
    ctx = Context(dsn=dsn, admin_dsn=admin_dsn, tmp=tmp, mode=mode, owns_server=owns_server)
    progress(f"{mode_name} mode; scratch database {database_name(dsn)}; logs in {tmp}")
    rows: list[Row] = []
    failed = []
    try:
        conn = await connect(dsn)
        try:
            from sidecar.storage.db import create_pool
            from sidecar.storage.store import StoreBase

            pool = await create_pool(dsn, 10, max_size=1)
            await StoreBase(pool, 10).migrate()
            await pool.close()
            ctx.clock_offset = await measure_clock_offset(conn)
            pg_version = await conn.fetchval("SELECT version()")
            if await conn.fetchval("SELECT current_setting('autovacuum')") == "off":
                warning = ("autovacuum is off on this server, so sections 7 and 10 measure "
                           "tables no vacuum ever ran on; run them on a server with it on "
                           "(the embedded default has it on)")
                progress(warning)
                ctx.notes.append(warning)
            for number, (title, module) in SECTIONS.items():
                if number not in only:
                    continue
                progress(f"section {number}: {title}")
                section_started = time.monotonic()
                try:
                    rows += await module.run(ctx, conn)
                except Exception as exc:  # noqa: BLE001 - the table says what failed
                    failed.append(number)
                    detail = f"{type(exc).__name__}: {exc}"
                    progress(f"section {number} failed: {detail}")
                    if not isinstance(exc, BenchError):
                        traceback.print_exc()
                    rows.append(Row(number, f"{title}: not measured", f"error: {detail}"[:300]))
                finally:
                    ctx.cleanup()
                progress(f"section {number} took {time.monotonic() - section_started:.1f} s")
        finally:
            await conn.close()
    finally:
        ctx.cleanup()
        if args.keep:
            progress(f"kept the scratch database {dsn} and the logs in {tmp}")
        else:
            try:
                await drop_database(admin_dsn, dsn)
            except Exception as exc:  # noqa: BLE001
                progress(f"could not drop {dsn}: {exc}")
            shutil.rmtree(tmp, ignore_errors=True)
    rows.sort(key=lambda r: int(r.section))  # stable: each section keeps its own order
    if mode_name != "full":
        full = MODES["full"]
        rates = [float(r.value.split()[0].replace(",", "")) for r in rows
                 if r.section == "1" and "vs the bare loop" in r.measure
                 and r.value.endswith("jobs/s")]
        if rates:
            minutes = len(full.shapes) * full.jobs / (sum(rates) / len(rates)) / 60
            ctx.notes.insert(0, f"Why not the full mode: at the sidecar's {min(rates):.0f}-"
                             f"{max(rates):.0f} no-op jobs/s measured here, its "
                             f"{len(full.shapes) * full.jobs:,} sidecar jobs alone would take "
                             f"about {minutes:.0f} minutes on this machine, before the "
                             "peers' and the baselines' runs.")
        ctx.notes.insert(0, f"{mode_name} mode: {mode.jobs:,} no-op jobs per throughput shape "
                         f"(full: {full.jobs:,}), {mode.pickup_samples} NOTIFY pickups (full: "
                         f"{full.pickup_samples}), {mode.reaction_trials} trials per reaction "
                         f"(full: {full.reaction_trials}); queue health after "
                         f"{mode.health_jobs:,} jobs (full: {full.health_jobs:,}).")
    if ctx.jobs_run:
        ctx.notes.append("jobs through tool_jobs in this run: " + ", ".join(
            f"{who} {n:,}" for who, n in ctx.jobs_run.items()))
    elapsed = time.monotonic() - started
    # --only rewrites the file with the other sections' rows kept from the earlier run.
    earlier = earlier_results(args.output, set(only)) if args.only else None
    write_results(args.output, mode_name, rows, machine(pg_version.split(" on ")[0]),
                  ctx.notes, ctx.settings, elapsed, load_start, earlier)
    print(table(rows), end="")
    progress(f"done in {elapsed:.0f} s; wrote {args.output}")
    if failed:
        progress(f"section(s) {', '.join(failed)} could not be measured")
        return 1
    return 0
