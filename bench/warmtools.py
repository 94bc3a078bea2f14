"""15. Warm tools (issue 43, point 4): how much of a real tool's job is its start.

The same batch of jobs through the recipe a user would run (examples/recipes) twice in one
run, per-job (a fresh tool per job: today's recipe) and warm (one tool process per slot
serves the jobs, PROCESS=warm: the warm recipe), each through a real ``sidecar run
--drain`` with the recipe's own profile (its .env), the sandbox on by default, two slots.

- LibreOffice: one-page text documents converted to PDF (libreoffice_convert.py against
  libreoffice_warm.py, which keeps one soffice per process over the UNO bridge).
- Chromium: one small page served on 127.0.0.1 dumped as its DOM (chromium_dump_dom.py
  against chromium_warm.py, one browser per process, a fresh browser context per job).

Throughput is jobs over the time from the first claim to the last end, by the database's
clock: the warm side pays its process starts inside that window. Every job must succeed
and return what the recipe promises (a PDF that starts with %PDF, the page's marker in
the DOM); each job keeps its own lease, heartbeat, stage deadline and fencing. Targets:
warm at least 5 x per-job for LibreOffice, 3 x for Chromium.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import shutil
import threading
from pathlib import Path

import asyncpg
import orjson

from bench.common import ROOT, BenchError, Context, Sidecar, enqueue_one, progress
from bench.report import Row

RECIPES = ROOT / "examples" / "recipes"
SLOTS = 2
# A lease wide enough for the recipes' kill graces (P10), as tests/test_real_tools.py.
LEASE = {"SIDECAR_LEASE_SECONDS": "30", "SIDECAR_HEARTBEAT_SECONDS": "3"}
MARKER = "sidecar-bench-page"


def _recipe_env(name: str) -> dict[str, str]:
    """examples/recipes/<name>.env as ``KEY=VALUE`` pairs, as a user would load it."""
    env = {}
    for line in (RECIPES / f"{name}.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


async def _batch(ctx: Context, conn: asyncpg.Connection, name: str, tool: str,
                 command: list[str], payloads: list[dict], env: dict[str, str]
                 ) -> tuple[float, list, float | None]:
    """Enqueue ``payloads`` for ``tool``, drain them with one sidecar of SLOTS slots, check
    every job succeeded: (jobs per second from the first claim to the last end, their
    results, the median tool CPU per job in seconds or None)."""
    ids = [await enqueue_one(conn, tool, orjson.dumps(p).decode(), max_attempts=1)
           for p in payloads]
    sidecar = Sidecar(ctx, name, tool, command, concurrency=SLOTS, drain=True,
                      **{**LEASE, **env})
    code = await sidecar.exit(600)
    rows = await conn.fetch("SELECT state, result, error, first_claimed_at, finished_at "
                            "FROM tool_jobs WHERE id = ANY($1::uuid[])", ids)
    bad = [dict(r) for r in rows if r["state"] != "succeeded"]
    if code != 0 or bad or len(rows) != len(ids):
        raise BenchError(f"{name}: exit {code}, {len(bad)} of {len(ids)} jobs not succeeded: "
                         f"{bad[:1]} {sidecar.tail()}")
    window = (max(r["finished_at"] for r in rows)
              - min(r["first_claimed_at"] for r in rows)).total_seconds()
    # Each job's CPU as its journal has it (the job cgroup's, or for a warm job what its
    # process's cgroup used during it): the median, so a warm process's first job (which
    # may start the tool) does not stand for the rest.
    cpu = sorted(await conn.fetchval(
        "SELECT array_agg((details->>'cpu_seconds')::float8) FROM tool_job_events "
        "WHERE job_id = ANY($1::uuid[]) AND event = 'job_succeeded' "
        "AND details ? 'cpu_seconds'", ids) or [])
    ctx.notes.append(f"15: {name}: median tool CPU per job {cpu[len(cpu) // 2]:.3f} s "
                     f"({len(cpu)} jobs measured)" if cpu else
                     f"15: {name}: no per-job CPU in the journal (no job cgroup here)")
    return len(ids) / window, [r["result"] for r in rows], \
        (cpu[len(cpu) // 2] if cpu else None)


def _pair(measure: str, warm: float, per_job: float, target: float, jobs: int) -> Row:
    ratio = warm / per_job
    return Row("15", f"{measure}, {jobs} jobs, {SLOTS} slots, warm vs per-job",
               f"{warm:.2f} jobs/s", f"per-job recipe {per_job:.2f} jobs/s",
               f"{ratio:.2f} ×", f"≥ {target:g} ×", ratio >= target)


async def _libreoffice(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    if shutil.which("soffice") is None:
        raise BenchError("soffice is not installed (apt-get install libreoffice-writer-nogui)")
    root = ctx.tmp / "docs"
    jobs = ctx.mode.warm_tool_jobs
    payloads: dict[str, list[dict]] = {}
    for side in ("per-job", "warm"):
        (root / side / "out").mkdir(parents=True)
        payloads[side] = []
        for i in range(jobs):
            doc = root / side / f"page-{i}.txt"
            doc.write_text(f"One page, number {i}.\n" + "A line of text.\n" * 30)
            payloads[side].append({"input": str(doc), "output_dir": str(root / side / "out"),
                                   "format": "pdf"})
    # The documents live under the scratch directory (in /tmp, which the sandbox hides):
    # bound back in, as a user binds an input volume (docs/isolation.md).
    common = {"CONVERT_DOC_ROOT": str(root), "SIDECAR_EXTRA_PATHS": f"{root}:rw"}
    progress(f"warm tools: {jobs} one-page LibreOffice conversions per-job")
    per_job, _, _ = await _batch(ctx, conn, "lo-per-job", "convert-doc",
                              [str(RECIPES / "libreoffice_convert.py")], payloads["per-job"],
                              {**_recipe_env("libreoffice"), **common})
    progress(f"warm tools: {jobs} one-page LibreOffice conversions warm")
    warm, results, _ = await _batch(ctx, conn, "lo-warm", "convert-doc-warm",
                                 [str(RECIPES / "libreoffice_warm.py")], payloads["warm"],
                                 {**_recipe_env("libreoffice_warm"), **common})
    for result in results:
        data = json.loads(result) if isinstance(result, str) else result
        if not Path(data["output"]).read_bytes().startswith(b"%PDF"):
            raise BenchError(f"LibreOffice warm: {data['output']} is not a PDF")
    ctx.settings.append(f"15: LibreOffice {jobs} one-page .txt → PDF per side, {SLOTS} slots, "
                        "recipes' profiles, SANDBOX=auto")
    return [_pair("LibreOffice one-page conversions", warm, per_job, 5, jobs)]


@contextlib.contextmanager
def _pages(directory: Path):
    """A small page served on 127.0.0.1 (a thread of this process); its base URL."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "page.html").write_text(
        f"<!doctype html><html><body><h1 id='{MARKER}'>bench page</h1>"
        + "<p>paragraph</p>" * 50 + "</body></html>")
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no access log on the bench's stderr
        pass


async def _chromium(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    if shutil.which("chromium") is None:
        raise BenchError("chromium is not installed (apt-get install chromium)")
    warm_recipe = RECIPES / "chromium_warm.py"
    if not warm_recipe.exists():
        raise BenchError(f"{warm_recipe} is missing")
    jobs = ctx.mode.warm_tool_jobs
    with _pages(ctx.tmp / "pages") as base:
        payloads = [{"url": f"{base}/page.html?n={i}"} for i in range(jobs)]
        progress(f"warm tools: {jobs} Chromium page renders per-job")
        per_job, _, cpu_per_job = await _batch(ctx, conn, "chromium-per-job", "chromium",
                                  [str(RECIPES / "chromium_dump_dom.py")], payloads,
                                  _recipe_env("chromium"))
        progress(f"warm tools: {jobs} Chromium page renders warm")
        warm, results, cpu_warm = await _batch(ctx, conn, "chromium-warm", "chromium-warm",
                                     [str(warm_recipe)], payloads,
                                     _recipe_env("chromium_warm"))
    for result in results:
        data = json.loads(result) if isinstance(result, str) else result
        if MARKER not in data["dom"]:
            raise BenchError("Chromium warm: a DOM without the page's marker")
    ctx.settings.append(f"15: Chromium {jobs} renders of one local page per side, {SLOTS} "
                        "slots, recipes' profiles, SANDBOX=auto")
    if cpu_warm and cpu_per_job:
        ctx.notes.append(
            f"15: Chromium's ratio is bounded by the tool's CPU per job on a CPU-bound host "
            f"(two slots, two cores): {cpu_warm:.2f} s warm against {cpu_per_job:.2f} s "
            f"per-job ({cpu_per_job / cpu_warm:.1f} x), less the browser start each warm "
            f"process pays once ({SLOTS} starts in {jobs} jobs here; a process serves up to "
            "MAX_JOBS_PER_PROCESS=200). A warm job is not free: the fresh browser context "
            "each job gets (the issue's isolation) starts a renderer process of its own "
            "(by hand, alone, createTarget and Page.enable are about 200 ms of a warm job's "
            "360 ms).")
    return [_pair("Chromium page renders (DOM dump)", warm, per_job, 3, jobs)]


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    """Section 15's rows: LibreOffice, then Chromium (each: per-job, then warm)."""
    return [*await _libreoffice(ctx, conn), *await _chromium(ctx, conn)]
