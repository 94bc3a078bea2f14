"""12. Flow control (issue 27, point 5): what the limits cost and whether they do what they
say, with real ``sidecar run`` processes and the limits set by ``sidecar limit`` /
``pause`` / ``resume`` as an operator would set them.

- Cost: no-op throughput (``/bin/true``) of a 2×8 fleet whose tool has ``--max-running
  16`` (the fleet's total concurrency, so the cap itself never holds a job back: what is
  measured is the flow claim's price) against the same fleet without limits, the two
  taking turns as section 8 does.
- Statements: claim statements per job with ``--max-running-per-key 1``, the jobs spread
  over 100 concurrency keys, counted by the server: pg_stat_statements where the server
  has it loaded, else the calls of ``tool_job_claim_flow`` in pg_stat_user_functions
  (``track_functions = 'pl'`` set on the scratch database only; each claim statement of
  a tool with a flow row calls that function once). The sidecars' own
  ``sidecar_claim_attempts_total`` is given beside it.
- Fairness: 1,000 jobs of key A queued before 10 of key B, ``--max-running 2``: where B's
  first job comes in the claim order (the journal's ``job_claimed`` rows, in id order:
  claims of a tool with a flow row take turns on its row, so ids follow the claims).
- Rate: ``--rate 10/s``, 8 sidecars competing, more jobs queued than the window can take:
  claims per second by the database's clock (the journal's ``job_claimed`` times).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import asyncpg
import orjson

from bench.common import (
    ROOT,
    BenchError,
    Context,
    Sidecar,
    clean_env,
    database_name,
    enqueue_many,
    kit,
    progress,
    rate,
    stop_all,
    until,
)
from bench.report import Row
from bench.throughput import sidecar_run

TRUE = ["/bin/true"]
FLEET = (2, 8)        # sidecars × concurrency of the cost and statement runs
ROUNDS = 3            # cost runs per side (medium, full), taking turns
KEYS = 100            # concurrency keys of the statement run
KEY_JOBS = 20         # jobs per key (medium, full); quick: 2
BACKLOG, LATE = 1000, 10  # fairness: jobs of key A queued before those of key B
FAIR_CAP = 2          # max_running of the fairness run
RATE_PER_S = 10.0     # the rate limit (claims per second)
RATE_SIDECARS = 8     # sidecars competing for its tokens
RATE_WINDOW = {"quick": 5.0, "medium": 60.0, "full": 60.0}  # seconds measured
COST_TARGET, STATEMENTS_TARGET, FAIR_TARGET, RATE_TOLERANCE = 0.8, 2.0, 3, 0.03
# The plpgsql functions of the flow claim: the claim itself, the per-key check (one call
# per key looked at) and the trigger that wakes an idle sidecar when a slot frees.
FUNCTIONS = ("tool_job_claim_flow", "tool_flow_key_blocked", "tool_job_slot_freed")

CLAIM_STATEMENTS = """
SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query LIKE '%tool_job_claim_flow($1, $2, $3, $4, $5)%'
"""
FUNCTION_STATS = """
SELECT funcname, calls::float8, total_time, self_time FROM pg_stat_user_functions
WHERE funcname = ANY($1::text[])
"""
OTHER_BACKENDS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend'
"""
CLAIM_ORDER = """
SELECT j.concurrency_key, extract(epoch FROM e.at)::float8 AS at
FROM tool_job_events e JOIN tool_jobs j ON j.id = e.job_id
WHERE j.tool = $1 AND e.event = 'job_claimed'
ORDER BY e.id
"""


class ServerCounts:
    """What the server counts of the flow claim: its statements (pg_stat_statements,
    when loaded) and its plpgsql functions' calls and milliseconds (pg_stat_user_functions,
    when ``track_functions`` could be set on the scratch database). ``method`` names what
    counts the claim statements: the first available of the two, else None."""

    def __init__(self) -> None:
        self.statements = False
        self.functions = False

    async def setup(self, conn: asyncpg.Connection) -> None:
        """Probe both; set ``track_functions = 'pl'`` on the scratch database (sessions
        opened from now on count; the server's own settings are not touched)."""
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await conn.fetchval(CLAIM_STATEMENTS)
            self.statements = True
        except asyncpg.PostgresError as exc:  # not in shared_preload_libraries
            progress(f"flow control: no pg_stat_statements ({exc})")
        name = await conn.fetchval("SELECT current_database()")
        try:
            await conn.execute(f'ALTER DATABASE "{name}" SET track_functions = \'pl\'')
            self.functions = True
        except asyncpg.PostgresError as exc:  # not a superuser
            progress(f"flow control: cannot set track_functions ({exc})")

    @property
    def method(self) -> str | None:
        if self.statements:
            return "pg_stat_statements calls of the claim statement"
        if self.functions:
            return ("pg_stat_user_functions calls of tool_job_claim_flow (track_functions = "
                    "'pl' on the scratch database; one call per claim statement)")
        return None

    async def read(self, conn: asyncpg.Connection) -> dict[str, float]:
        """The counts now, once every other session of the scratch database has ended (a
        session reports its counts at the latest when it ends): ``claims`` (by
        ``method``; NaN without one) and ``<function>.calls`` / ``.ms`` / ``.self_ms``."""
        async def alone():
            return await conn.fetchval(OTHER_BACKENDS) == 0

        await until(alone, 30, interval=0.1, what="the sidecars' sessions to end")
        await asyncio.sleep(0.5)  # a backend leaves pg_stat_activity just before its flush
        out: dict[str, float] = {}
        if self.functions:
            for row in await conn.fetch(FUNCTION_STATS, list(FUNCTIONS)):
                out[f"{row['funcname']}.calls"] = row["calls"]
                out[f"{row['funcname']}.ms"] = row["total_time"]
                out[f"{row['funcname']}.self_ms"] = row["self_time"]
        if self.statements:
            out["claims"] = await conn.fetchval(CLAIM_STATEMENTS)
        elif self.functions:
            out["claims"] = out.get("tool_job_claim_flow.calls", 0.0)
        else:
            out["claims"] = float("nan")
        return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _claim_profile(d: dict[str, float]) -> str:
    """Time inside the flow claim per call, and keys looked at per claim, from a delta."""
    calls = d.get("tool_job_claim_flow.calls", 0.0)
    if not calls:
        return "no function timings (track_functions not set)"
    probes = d.get("tool_flow_key_blocked.calls", 0.0)
    freed = d.get("tool_job_slot_freed.calls", 0.0)
    text = (f"{calls:.0f} calls of tool_job_claim_flow, {d['tool_job_claim_flow.ms'] / calls:.3f}"
            f" ms each (self {d['tool_job_claim_flow.self_ms'] / calls:.3f} ms), "
            f"{probes / calls:.2f} per-key checks per call")
    if freed:
        text += (f"; slot-freed trigger {freed:.0f} calls, "
                 f"{d['tool_job_slot_freed.ms'] / freed:.3f} ms each")
    return text


async def _cli(ctx: Context, *args: str) -> dict[str, Any]:
    """``sidecar ARGS`` against the scratch database, as an operator runs it; its JSON."""
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "sidecar", *args],
        env=clean_env(SIDECAR_DATABASE_URL=ctx.dsn), cwd=ROOT, capture_output=True,
        timeout=60)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.decode(errors="replace").strip().splitlines()[-3:])
        raise BenchError(f"sidecar {' '.join(args)} exited {done.returncode}: {tail}")
    return orjson.loads(done.stdout) if done.stdout.strip() else {}


async def _limit(ctx: Context, conn: asyncpg.Connection, tool: str, **limits: Any) -> None:
    """``sidecar limit TOOL --max-running N ...`` (``limits``: limit_changes' arguments),
    then the stored row is read back: a row not as asked is a BenchError."""
    from sidecar.protocol.flow import limit_changes

    changes = limit_changes(**limits)
    await _cli(ctx, "limit", tool, *(f"--{k.replace('_', '-')}={v}"
                                     for k, v in limits.items()))
    row = await conn.fetchrow("SELECT * FROM tool_flow WHERE tool = $1", tool)
    wrong = [f"{k} {None if row is None else row[k]!r} (asked {v!r})"
             for k, v in changes.items() if row is None or row[k] != v]
    if wrong:
        raise BenchError(f"sidecar limit {tool} stored other limits: {'; '.join(wrong)}")


async def _start(ctx: Context, name: str, tool: str, count: int,
                 concurrency: int) -> tuple[list[Sidecar], list[str]]:
    """``count`` sidecars of ``tool`` running ``/bin/true``, each serving /metrics on a
    port the OS picks; returns them and their HTTP addresses once all have started."""
    procs = [Sidecar(ctx, f"{name}-{i}", tool, TRUE, concurrency,
                     SIDECAR_HTTP_ADDR="127.0.0.1:0") for i in range(count)]
    try:
        addrs = [(await p.wait_event("worker_started", 120))["http_addr"] for p in procs]
    except BaseException:
        await stop_all(procs)
        raise
    await asyncio.sleep(0.5)  # their LISTEN connections up, as Sidecar.ready waits
    return procs, addrs


async def _claim_attempts(addrs: list[str]) -> dict[str, float]:
    """Every sidecar's ``sidecar_claim_attempts_total``, summed: all outcomes, claimed."""
    pages = await asyncio.gather(*(asyncio.to_thread(kit.metrics_text, f"http://{a}")
                                   for a in addrs))
    return {"all": sum(kit.metric_total(p, "sidecar_claim_attempts_total") for p in pages),
            "claimed": sum(kit.metric_total(p, "sidecar_claim_attempts_total",
                                            outcome="claimed") for p in pages)}


async def _finished(conn: asyncpg.Connection, tool: str) -> int:
    return await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = $1 AND "
                               "finished_at IS NOT NULL", tool)


async def _cost(ctx: Context, conn: asyncpg.Connection, counts: ServerCounts) -> Row:
    sidecars, concurrency = FLEET
    cap = sidecars * concurrency
    rounds = 1 if ctx.mode.name == "quick" else ROUNDS
    per_run = max(1, ctx.mode.jobs // rounds)
    progress(f"flow control: {rounds} x {per_run} no-op jobs at {sidecars}x{concurrency} "
             f"each, without limits and with max_running {cap}, taking turns")
    free, capped, profile = [], [], {}

    async def limited(i: int) -> dict:
        await _limit(ctx, conn, f"true-{sidecars}x{concurrency}-capped{i}", max_running=cap)
        before = await counts.read(conn)
        result = await sidecar_run(ctx, conn, sidecars, concurrency, tag=f"capped{i}",
                                   jobs=per_run)
        for k, v in _delta(await counts.read(conn), before).items():
            profile[k] = profile.get(k, 0.0) + v
        return result

    for i in range(rounds):  # which side goes first alternates
        if i % 2 == 0:
            free.append(await sidecar_run(ctx, conn, sidecars, concurrency, tag=f"free{i}",
                                          jobs=per_run))
            capped.append(await limited(i))
        else:
            capped.append(await limited(i))
            free.append(await sidecar_run(ctx, conn, sidecars, concurrency, tag=f"free{i}",
                                          jobs=per_run))
    each = ", ".join(f"{c['rate'] / f['rate']:.2f}"
                     for f, c in zip(free, capped, strict=True))
    base = sum(r["rate"] for r in free) / rounds
    limited_rate = sum(r["rate"] for r in capped) / rounds
    ratio = limited_rate / base
    claims = profile.get("claims", float("nan"))
    ctx.settings.append(
        f"12: cost: {rounds} round(s) of {per_run} no-op jobs (/bin/true) per run, "
        f"{sidecars} sidecars at concurrency {concurrency} (`sidecar run --drain`, default "
        f"profile), one run without limits and one with `sidecar limit TOOL --max-running "
        f"{cap}`, taking turns (the side going first alternates); the row pools each side's "
        f"mean; one round's ratio: {each}")
    ctx.notes.append(
        f"12: cost runs with max_running {cap}: {claims / (per_run * rounds):.2f} claim "
        f"statements per job by the server; {_claim_profile(profile)}")
    return Row("12", f"no-op throughput, {sidecars}×{concurrency}, max_running {cap} (the "
               "fleet's total concurrency) vs the same fleet without limits",
               rate(limited_rate), f"no limits {rate(base)}", f"{ratio:.2f} × no limits",
               f"≥ {COST_TARGET} × no limits", ratio >= COST_TARGET)


async def _statements(ctx: Context, conn: asyncpg.Connection, counts: ServerCounts) -> Row:
    sidecars, concurrency = FLEET
    per_key = 2 if ctx.mode.name == "quick" else KEY_JOBS
    jobs, tool = KEYS * per_key, "flow-keys"
    progress(f"flow control: {jobs} no-op jobs over {KEYS} keys, max_running_per_key 1")
    await _limit(ctx, conn, tool, max_running_per_key=1)
    before = await counts.read(conn)
    procs, addrs = await _start(ctx, tool, tool, sidecars, concurrency)
    try:
        await enqueue_many(conn, tool, jobs,
                           concurrency_keys=[f"key-{k:03d}" for k in range(KEYS)])

        async def done():
            for p in procs:
                if p.proc.poll() is not None:
                    raise BenchError(f"sidecar {p.name} exited early: {p.tail()}")
            return await _finished(conn, tool) >= jobs

        await until(done, 120 + jobs / 5, interval=0.1, what=f"{jobs} jobs of {tool}")
        own = await _claim_attempts(addrs)
    finally:
        await stop_all(procs)
    ctx.count("flow control (sidecars)", jobs)
    d = _delta(await counts.read(conn), before)
    method = counts.method
    if method is None:
        per_job, method = own["all"] / jobs, "the sidecars' own sidecar_claim_attempts_total"
    else:
        per_job = d["claims"] / jobs
    ctx.settings.append(
        f"12: statements: {jobs} no-op jobs, {per_key} on each of {KEYS} concurrency keys "
        f"(interleaved, queued in one transaction), {sidecars} sidecars at concurrency "
        f"{concurrency}, `sidecar limit flow-keys --max-running-per-key 1`; the server's "
        "count spans the sidecars' whole lives (start-up claims and idle polls included), "
        "their /metrics were read when the last job had finished")
    ctx.notes.append(f"12: statements run: {_claim_profile(d)}")
    return Row("12", f"claim statements per job, max_running_per_key 1, {jobs} jobs over "
               f"{KEYS} concurrency keys, {sidecars}×{concurrency}", f"{per_job:.2f}",
               f"counted by {method}: {d['claims']:.0f} for {jobs} jobs; the sidecars' own "
               f"sidecar_claim_attempts_total {own['all']:.0f} ({own['all'] / jobs:.2f} per "
               f"job, {own['claimed']:.0f} claimed)", "-", f"≤ {STATEMENTS_TARGET:g}",
               per_job <= STATEMENTS_TARGET)


async def _fairness(ctx: Context, conn: asyncpg.Connection) -> Row:
    tool, big, late = "flow-fair", "tenant-a", "tenant-b"
    progress(f"flow control: fairness, {BACKLOG} jobs of {big} then {LATE} of {late}, "
             f"max_running {FAIR_CAP}")
    await _limit(ctx, conn, tool, max_running=FAIR_CAP)
    await _cli(ctx, "pause", tool, "--reason", "bench: the backlog is queued first")
    procs, _ = await _start(ctx, tool, tool, 2, FAIR_CAP)
    try:
        await enqueue_many(conn, tool, BACKLOG, concurrency_keys=[big])
        await enqueue_many(conn, tool, LATE, concurrency_keys=[late])
        await _cli(ctx, "resume", tool)

        async def served():
            return await conn.fetchval(
                "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND concurrency_key = $2 "
                "AND first_claimed_at IS NOT NULL", tool, late) >= LATE

        await until(served, 120, interval=0.1, what=f"every job of {late} claimed")
    finally:
        await stop_all(procs)
    order = [row["concurrency_key"] for row in await conn.fetch(CLAIM_ORDER, tool)]
    ctx.count("flow control (sidecars)", len(order))
    positions = [i + 1 for i, key in enumerate(order) if key == late]
    if not positions:
        raise BenchError(f"no job_claimed row for {late}")
    first = positions[0]
    ctx.settings.append(
        f"12: fairness: `sidecar limit flow-fair --max-running {FAIR_CAP}`, paused while "
        f"2 sidecars at concurrency {FAIR_CAP} started and {BACKLOG} jobs of key {big} then "
        f"{LATE} of key {late} were queued (two transactions, in that order), then `sidecar "
        "resume`; claim order = the journal's job_claimed rows in id order; the key that "
        "sorts first is the backlog's")
    return Row("12", f"fairness: {BACKLOG:,} jobs of key A queued before {LATE} of key B, "
               f"max_running {FAIR_CAP}: claim position of B's first job", f"#{first}",
               f"B's {LATE} jobs at claims {', '.join(map(str, positions))} of "
               f"{len(order)} claimed when the last of them was", "-",
               f"within the first {FAIR_TARGET}", first <= FAIR_TARGET)


async def _rate(ctx: Context, conn: asyncpg.Connection, counts: ServerCounts) -> Row:
    tool = "flow-rate"
    window = RATE_WINDOW[ctx.mode.name]
    jobs = int(RATE_PER_S * window * 1.5) + 50  # the queue never runs dry in the window
    progress(f"flow control: rate {RATE_PER_S:g}/s, {RATE_SIDECARS} sidecars, "
             f"{window:g} s window")
    await _limit(ctx, conn, tool, rate=f"{RATE_PER_S:g}/s")
    await _cli(ctx, "pause", tool, "--reason", "bench: the sidecars start first")
    before = await counts.read(conn)
    procs, addrs = await _start(ctx, tool, tool, RATE_SIDECARS, 2)
    try:
        await enqueue_many(conn, tool, jobs)
        await _cli(ctx, "resume", tool)

        async def past_window():
            for p in procs:
                if p.proc.poll() is not None:
                    raise BenchError(f"sidecar {p.name} exited early: {p.tail()}")
            span = await conn.fetchval(
                "SELECT extract(epoch FROM max(first_claimed_at) - min(first_claimed_at)) "
                "FROM tool_jobs WHERE tool = $1", tool)
            return span is not None and span > window + 0.5

        await until(past_window, window * 2 + 20, interval=0.2,
                    what=f"{window:g} s of claims of {tool}")
        own = await _claim_attempts(addrs)
    finally:
        await stop_all(procs)
    d = _delta(await counts.read(conn), before)
    times = [row["at"] for row in await conn.fetch(CLAIM_ORDER, tool)]
    ctx.count("flow control (sidecars)", len(times))
    times.sort()
    inside = [t for t in times if t - times[0] <= window]
    if len(inside) < 2:
        raise BenchError(f"{len(inside)} claims in the window")
    span = inside[-1] - inside[0]
    achieved = (len(inside) - 1) / span
    gaps = sorted(b - a for a, b in zip(inside, inside[1:], strict=False))
    off = abs(achieved - RATE_PER_S) / RATE_PER_S
    ctx.settings.append(
        f"12: rate: `sidecar limit flow-rate --rate {RATE_PER_S:g}/s` (burst 1, the "
        f"default), {RATE_SIDECARS} sidecars at concurrency 2 started while the tool was "
        f"paused, {jobs} no-op jobs queued, then `sidecar resume`; rate = (claims - 1) / "
        f"(last - first claim) over the first {window:g} s after the first claim, by the "
        "journal's job_claimed times (the database's clock)")
    ctx.notes.append(
        f"12: rate run: gap between claims p50 {gaps[len(gaps) // 2] * 1000:.1f} ms, min "
        f"{gaps[0] * 1000:.1f} ms, max {gaps[-1] * 1000:.1f} ms (1 / rate = "
        f"{1000 / RATE_PER_S:.0f} ms); claim statements {d['claims']:.0f} by the server, "
        f"{own['all']:.0f} by the sidecars ({own['all'] / max(1.0, own['claimed']):.1f} per "
        f"job claimed); {_claim_profile(d)}")
    quick = " (quick mode: a short window)" if ctx.mode.name == "quick" else ""
    return Row("12", f"claim rate with `--rate {RATE_PER_S:g}/s`, {RATE_SIDECARS} sidecars "
               f"competing, over {window:g} s{quick}", f"{achieved:.2f} claims/s",
               f"{len(inside)} claims in {span:.1f} s by the database's clock",
               f"{achieved / RATE_PER_S:.3f} × the limit",
               f"within {RATE_TOLERANCE:.0%} of {RATE_PER_S:g}/s", off <= RATE_TOLERANCE)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    """The section's four rows (cost, statements, fairness, rate), in one run. A part
    that fails gives a "not measured" row and the others still run."""
    counts = ServerCounts()
    await counts.setup(conn)
    progress(f"flow control: scratch database {database_name(ctx.dsn)}; claim statements "
             f"counted by {counts.method or 'the sidecars only'}")
    rows: list[Row] = []
    parts = (("cost", lambda: _cost(ctx, conn, counts)),
             ("claim statements", lambda: _statements(ctx, conn, counts)),
             ("fairness", lambda: _fairness(ctx, conn)),
             ("rate", lambda: _rate(ctx, conn, counts)))
    for what, part in parts:
        try:
            rows.append(await part())
        except Exception as exc:  # noqa: BLE001 - one part's failure is one row
            progress(f"flow control {what} failed: {type(exc).__name__}: {exc}")
            rows.append(Row("12", f"flow control, {what}: not measured",
                            f"error: {type(exc).__name__}: {exc}"[:300]))
        finally:
            ctx.cleanup()
    return rows
