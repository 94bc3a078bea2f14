"""3. Heartbeat cost of one sidecar holding 1, 8 and 64 leases (tool ``/bin/sleep``, the
short profile: H = 0.5 s).

Measured from outside, without ``pg_stat_statements`` (it needs a server restart):
- statements: ``pg_stat_activity`` sampled every 25 ms; each heartbeat statement shows up
  with its own ``query_start`` and, once done, ``state_change``: their difference is the
  statement's time in the database. Cross-checked with the sidecar's ``heartbeat_ok``
  debug lines (one per lease per beat);
- rows and HOT: ``pg_stat_user_tables`` deltas of ``tool_jobs`` (backends flush these
  about once a second, so a window's edges are blurred by up to one beat);
- all of the sidecar's statements: every other (pid, query_start) of the scratch
  database's backends that are not the bench's own, by their first line.

The baseline is the same ``extend_leases_if_owner`` statement run bare on as many leases
the bench holds itself, and the per-lease alternative (one UPDATE per lease per period).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import asyncpg

from bench.common import (
    SHORT_PROFILE,
    BenchError,
    Context,
    Sidecar,
    connect,
    database_name,
    enqueue_many,
    ms,
    percentile,
    progress,
    until,
)
from bench.report import Row
from sidecar.storage.queries import Q

LEASES = (1, 8, 64)
# How the heartbeat statement (queries.sql extend_leases_if_owner) shows in pg_stat_activity.
HEARTBEAT_LIKE = "%jsonb_to_recordset($2::jsonb)%"

TABLE_STATS = """
SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'tool_jobs'
"""

PER_LEASE = """
UPDATE tool_jobs SET lease_until = now() + $4::float8 * interval '1 second', heartbeat_at = now()
WHERE id = $2 AND fencing_token = $3 AND owner_id = $1 AND state = 'running'
  AND lease_until > now()
RETURNING id, lease_until
"""


class Sampler:
    """Samples ``pg_stat_activity`` every 25 ms for the statements of one database's
    backends other than the bench's own: each distinct (pid, query_start) is one statement;
    ``state_change - query_start`` of an idle backend is its time in the database."""

    def __init__(self, admin_dsn: str, database: str):
        self.admin_dsn = admin_dsn
        self.database = database
        self.seen: dict[tuple[int, float], tuple[str, float | None]] = {}
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.conn = await connect(self.admin_dsn)
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            for row in await self.conn.fetch(
                    "SELECT pid, extract(epoch FROM query_start)::float8 AS qs, "
                    "extract(epoch FROM state_change - query_start)::float8 AS took, state, "
                    "query LIKE $2 AS heartbeat, left(query, 300) AS query "
                    "FROM pg_stat_activity WHERE datname = $1 AND application_name <> 'bench' "
                    "AND query_start IS NOT NULL",
                    self.database, HEARTBEAT_LIKE):
                key = (row["pid"], row["qs"])
                kind = "heartbeat" if row["heartbeat"] else _kind(row["query"])
                if row["state"] == "idle" or key not in self.seen:
                    self.seen[key] = (kind, row["took"] if row["state"] == "idle" else None)
            await asyncio.sleep(0.025)

    def between(self, start: float, end: float) -> list[tuple[str, float | None]]:
        return [value for (_pid, qs), value in self.seen.items() if start <= qs < end]

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.conn.close()


def _kind(query: str) -> str:
    """A short name for a statement: its first line that is not a comment."""
    for line in query.splitlines():
        line = line.strip()
        if line and not line.startswith("--"):
            return " ".join(line.split()[:4])[:40]
    return "?"


def _count_beats(sc: Sidecar) -> int:
    try:
        return sc.log_path.read_bytes().count(b'"event":"heartbeat_ok"')
    except OSError:
        return 0


async def _bare(conn: asyncpg.Connection, leases: int, rounds: int = 15) -> tuple[float, float]:
    """Wall time of one extend statement over ``leases`` bench-held leases, and of the
    per-lease alternative (``leases`` statements); medians over ``rounds``."""
    tool, owner = f"hold-bare-{leases}", "bench-bare"
    rows = await conn.fetch(
        "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, state, "
        "owner_id, lease_until, fencing_token, attempt) SELECT gen_random_uuid(), $1, "
        "$1 || ':' || g, '{}'::jsonb, 1, 'running', $2, now() + interval '1 hour', 1, 1 "
        "FROM generate_series(1, $3) g RETURNING id", tool, owner, leases)
    ids = [r["id"] for r in rows]
    held = [{"id": str(job_id), "token": 1} for job_id in ids]
    one, each = [], []
    await conn.fetch(Q["extend_leases_if_owner"], owner, held, 3.0)  # prepared
    await conn.fetchrow(PER_LEASE, owner, ids[0], 1, 3.0)
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = await conn.fetch(Q["extend_leases_if_owner"], owner, held, 3.0)
        one.append(time.perf_counter() - t0)
        assert len(got) == leases
        t0 = time.perf_counter()
        for job_id in ids:
            await conn.fetchrow(PER_LEASE, owner, job_id, 1, 3.0)
        each.append(time.perf_counter() - t0)
    await conn.execute("UPDATE tool_jobs SET state = 'cancelled', finished_at = now(), "
                       "lease_until = NULL WHERE tool = $1", tool)
    return percentile(one, 50), percentile(each, 50)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    period = float(SHORT_PROFILE["SIDECAR_HEARTBEAT_SECONDS"])
    window = ctx.mode.hb_window
    database = database_name(ctx.dsn)
    sc = Sidecar(ctx, "heartbeat", "hold", ["/bin/sleep", "600"], max(LEASES),
                 SIDECAR_LOG_LEVEL="debug", **SHORT_PROFILE)
    sampler = Sampler(ctx.admin_dsn, database)
    await sampler.start()
    results = []
    try:
        await sc.ready()
        held = 0
        for leases in LEASES:
            progress(f"heartbeat: {leases} leases, {window:g} s window")
            await enqueue_many(conn, "hold", leases - held, max_attempts=1)
            held = leases

            async def all_running(n=leases):
                running = await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE tool = "
                                              "'hold' AND state = 'running'")
                return running == n and len(sc.tool_children()) >= n

            await until(all_running, 60, interval=0.05, what=f"{leases} running leases")
            await asyncio.sleep(2 * period)  # every lease in the heartbeat set
            before = await conn.fetchrow(TABLE_STATS)
            beats0 = _count_beats(sc)
            t0 = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
            await asyncio.sleep(window)
            t1 = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
            beats1 = _count_beats(sc)
            await asyncio.sleep(1.2)  # let the sidecar's backends flush their counters
            after = await conn.fetchrow(TABLE_STATS)
            seen = sampler.between(t0, t1)
            took = [t for kind, t in seen if kind == "heartbeat"]
            others = Counter(kind for kind, _ in seen if kind != "heartbeat")
            done = [t for t in took if t is not None]
            elapsed = t1 - t0
            if not took and beats1 > beats0:
                raise BenchError("the sidecar logged heartbeats but no statement in "
                                 f"pg_stat_activity matched {HEARTBEAT_LIKE!r}: the "
                                 "heartbeat statement changed; update HEARTBEAT_LIKE")
            # pg_stat counters reach the view about once a second: the HOT share is over the
            # window widened by that lag, all of it heartbeats.
            updates = after["n_tup_upd"] - before["n_tup_upd"]
            hot = after["n_tup_hot_upd"] - before["n_tup_hot_upd"]
            results.append({
                "leases": leases, "stmts": len(took), "per_s": len(took) / elapsed,
                "per_period": len(took) / elapsed * period,
                "log_beats": (beats1 - beats0) / leases,
                "db_s_per_s": sum(done) / elapsed,
                "stmt_p50": percentile(done, 50),
                "hot": hot / updates if updates else float("nan"),
                "hot_n": hot, "upd_n": updates,
                "all_per_s": len(seen) / elapsed,
                "others": ", ".join(f"{kind} {n / elapsed:.1f}/s"
                                    for kind, n in others.most_common(5)),
            })
    finally:
        await sampler.stop()
        await sc.stop()
    bare = {leases: await _bare(conn, leases) for leases in LEASES}
    ctx.count("heartbeat holds", max(LEASES))
    ctx.settings.append(
        f"heartbeat: one sidecar, concurrency 64, tool `/bin/sleep 600`, H = {period:g} s, "
        f"L = 3 s, SIDECAR_LOG_LEVEL=debug (for `heartbeat_ok`); {window:g} s window per "
        "lease count; pg_stat_activity sampled every 25 ms")
    rows = []
    if any(r["hot"] < 0.95 for r in results):
        ctx.notes.append(
            "**Why heartbeats are not always HOT, and what would fix it.** A heartbeat "
            "changes only unindexed columns (lease_until, heartbeat_at), so it is HOT when "
            "the row's heap page has room for the new version. Claims, completions and "
            "releases change `state`, which the partial indexes' predicates use, so they are "
            "never HOT and fill pages beyond the fillfactor (it applies to inserts only); a "
            "leased row whose page is full then gets a non-HOT update with new entries in all "
            "its indexes, until pruning or vacuum frees space on that page. Fixes: a lower "
            "fillfactor on tool_jobs (e.g. 50), autovacuum settings on the table so pages "
            "are cleaned sooner, or the lease columns in a narrow table of their own "
            "(job id, owner, token, lease_until) that only heartbeats and claims update.")
    for r in results:
        leases = r["leases"]
        one, each = bare[leases]
        ctx.notes.append(
            f"heartbeat with {leases} lease(s): {r['stmts']} heartbeat statements seen in "
            f"pg_stat_activity over the window, {r['log_beats']:.1f} beats by the sidecar's "
            f"log; all of its statements {r['all_per_s']:.1f}/s, besides heartbeats: "
            f"{r['others'] or 'none'} (the poll's claim and queue-depth sample, the "
            "outbox's delivery scan, the idle-list refresh)")
        rows.append(Row(
            "3", f"heartbeat statements per period, 1 sidecar, {leases} lease(s) "
            f"(H = {period:g} s)",
            f"{r['per_period']:.2f} per period ({r['per_s']:.1f}/s), HOT {r['hot']:.0%} "
            f"({r['hot_n']}/{r['upd_n']})",
            f"per-lease heartbeats: {leases} per period",
            f"{r['per_period'] / leases:.2f} × per-lease",
            "1 per period; ≥ 95 % HOT",
            abs(r["per_period"] - 1) <= 0.15 and r["hot"] >= 0.95))
        rows.append(Row(
            "3", f"heartbeat database time, {leases} lease(s)",
            f"{ms(r['stmt_p50'])} per statement, {r['db_s_per_s'] * 1000:.2f} ms/s",
            f"bare statement {ms(one)} round trip; per-lease {leases} statements {ms(each)}",
            f"{r['stmt_p50'] / one:.2f} × bare statement"))
    return rows
