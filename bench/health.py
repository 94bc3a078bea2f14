"""7. Queue health after many jobs: the size of ``tool_jobs`` and its indexes, dead tuples,
autovacuum activity and the autovacuum settings on the table, and the journal's size.

The jobs the other sections ran count; the rest up to the mode's number go through the
bare loop of ``bench.baseline claim --journal``, which writes exactly what a sidecar writes
per no-op job (claim, ``tool_request_started``, fenced completion), without spawning, so a
hundred thousand jobs take minutes instead of an hour; 5,000 at a time, because the claim
costs grow with the backlog (measured below). The baseline is the same rows compacted by
VACUUM FULL at the end (the fillfactor kept). Last, the claim statement itself (EXPLAIN
ANALYZE, rolled back): with the queue empty, and with a large backlog queued.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import asyncpg
import orjson

from bench.common import (
    Context,
    enqueue_many,
    helper_argv,
    mib,
    ms,
    progress,
    run_helpers,
)
from bench.report import Row
from sidecar.queries import Q

SIZES = """
SELECT pg_relation_size('tool_jobs') AS heap, pg_indexes_size('tool_jobs') AS indexes,
       pg_total_relation_size('tool_jobs') - pg_relation_size('tool_jobs')
           - pg_indexes_size('tool_jobs') AS toast,
       pg_total_relation_size('tool_job_events') AS events,
       (SELECT count(*) FROM tool_jobs) AS jobs,
       (SELECT count(*) FROM tool_job_events) AS event_rows
"""
INDEXES = """
SELECT indexrelname AS name, pg_relation_size(indexrelid) AS size
FROM pg_stat_user_indexes WHERE relname = 'tool_jobs' ORDER BY indexrelname
"""
STATS = """
SELECT n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd, autovacuum_count,
       autoanalyze_count, last_autovacuum
FROM pg_stat_user_tables WHERE relname = 'tool_jobs'
"""
SERVER = """
SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum',
    'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_threshold', 'autovacuum_naptime',
    'autovacuum_vacuum_insert_scale_factor', 'autovacuum_vacuum_cost_limit')
"""


CHUNK = 5_000
CLAIM_SAMPLES = 15  # EXPLAIN ANALYZE runs per claim measurement (their median)


async def top_up(ctx: Context, conn: asyncpg.Connection) -> int:
    """Run jobs through the bare loop until tool_jobs holds the mode's number of jobs, in
    chunks of CHUNK, so the backlog stays what a throughput run has (see ``claim_cost``)."""
    have = await conn.fetchval("SELECT count(*) FROM tool_jobs")
    missing = ctx.mode.health_jobs - have
    if missing <= 0:
        return 0
    progress(f"queue health: {missing:,} more jobs through the sidecar's statements")
    for start in range(0, missing, CHUNK):
        n = min(CHUNK, missing - start)
        await enqueue_many(conn, "fill", n, notify=False)
        start_at = time.time() + 0.8
        await run_helpers(ctx, [helper_argv("baseline", "claim", ctx.dsn, "fill", 8, start_at,
                                            "--journal") for _ in range(2)],
                          timeout=120 + n / 20)
    ctx.count("bare loop for queue health", missing)
    return missing


async def claim_cost(conn: asyncpg.Connection, tool: str) -> tuple[float, str]:
    """The claim statement's execution time (the median of CLAIM_SAMPLES runs: one run is
    a tenth of a millisecond, within the timer's noise) and plan (EXPLAIN ANALYZE of
    ``claim_job`` itself, rolled back), for ``tool``'s queue as it is."""
    times = []
    for _ in range(CLAIM_SAMPLES):
        tr = conn.transaction()
        await tr.start()
        try:
            [plan] = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["claim_job"],
                                         tool, "bench-explain", 90.0, None)
        finally:
            await tr.rollback()
        if isinstance(plan, str):
            plan = orjson.loads(plan)
        times.append(plan["Execution Time"])
    plan["Execution Time"] = statistics.median(times)
    nodes: list[str] = []

    def walk(node: dict) -> None:
        if node["Node Type"] in ("Seq Scan", "Index Scan", "Bitmap Heap Scan", "Sort",
                                 "Index Only Scan", "Bitmap Index Scan"):
            label = node["Node Type"]
            if "Index Name" in node:
                label += f" {node['Index Name']}"
            if label not in nodes:
                nodes.append(label)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return plan["Execution Time"] / 1000, ", ".join(nodes)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    await top_up(ctx, conn)
    await asyncio.sleep(1.5)  # the last backends' counters flushed
    size = await conn.fetchrow(SIZES)
    stats = await conn.fetchrow(STATS)
    indexes = await conn.fetch(INDEXES)
    reloptions = await conn.fetchval("SELECT reloptions FROM pg_class WHERE relname = "
                                     "'tool_jobs' AND relkind = 'r'")
    server = {r["name"].removeprefix("autovacuum_"): r["setting"]
              for r in await conn.fetch(SERVER)}
    queued = await conn.fetchval("SELECT count(*) FROM tool_jobs WHERE state = 'queued'")
    empty_before, _ = await claim_cost(conn, "fill")
    progress("queue health: VACUUM FULL for the compacted baseline")
    await conn.execute("VACUUM FULL tool_jobs")
    await conn.execute("VACUUM FULL tool_job_events")
    compact = await conn.fetchrow(SIZES)
    compact_indexes = {r["name"]: r["size"] for r in await conn.fetch(INDEXES)}
    await conn.execute("ANALYZE tool_jobs")
    empty_after, empty_plan = await claim_cost(conn, "fill")
    backlog = max(CHUNK, ctx.mode.health_jobs // 5)
    progress(f"queue health: the claim with {backlog:,} jobs queued")
    await enqueue_many(conn, "backlog", backlog, notify=False)
    await conn.execute("ANALYZE tool_jobs")
    with_backlog, backlog_plan = await claim_cost(conn, "backlog")
    await conn.execute("DELETE FROM tool_jobs WHERE tool = 'backlog'")

    jobs = size["jobs"]
    live, dead = stats["n_live_tup"], stats["n_dead_tup"]
    ctx.settings.append(f"queue health: {jobs:,} jobs in tool_jobs ({queued} left queued by "
                        "sidecars the bench stopped), measured before VACUUM FULL, compared "
                        "with after it (VACUUM FULL keeps the fillfactor, so its heap can be "
                        "larger than one whose pages updates filled past it)")
    if not any((r or "").startswith("autovacuum") for r in (reloptions or [])):
        queued_idx = next((r["size"] for r in indexes if r["name"] == "tool_jobs_queued_idx"),
                          None)
        ctx.notes.append(
            "**No autovacuum settings on tool_jobs.** The migrations set only the fillfactor, "
            "so the server's defaults apply: a vacuum once dead rows pass 20 % of the table "
            f"(scale factor {server.get('vacuum_scale_factor')}), which on a table that "
            "keeps its finished jobs comes ever more rarely while the hot part, the few "
            "queued and running rows, is what churns. "
            + (f"After {jobs:,} jobs the partial index of queued jobs held "
               f"{mib(queued_idx)} for {queued} queued rows, and a claim on the empty queue "
               f"took {ms(empty_before)} against {ms(empty_after)} once compacted. "
               if queued_idx is not None else "")
            + "A migration setting autovacuum_vacuum_scale_factor = 0.01 (or a fixed "
            "autovacuum_vacuum_threshold) and autovacuum_vacuum_cost_delay = 0 on "
            "tool_jobs, or a periodic move of finished jobs to an archive table, would keep "
            "the claim's indexes small.")
    else:
        ctx.notes.append(
            "**The autovacuum values on tool_jobs (migration 008), and the figures behind "
            "them.** The table keeps its finished jobs for the retention period while the "
            "part the claim reads (queued and running rows, their partial indexes) churns "
            "with every job, so the server's default, a vacuum once 20 % of the table is "
            "dead, comes ever more rarely as the table grows. Before the migration, the "
            "2026-11-30 medium run measured a claim on the empty queue at 4.38 ms after "
            "100,000 jobs against 0.08 ms once compacted (54.8x). With a vacuum after 1,000 "
            f"dead rows plus 1 % of the table this run measured {ms(empty_before)} against "
            f"{ms(empty_after)} ({empty_before / empty_after:.1f}x), with autovacuum "
            f"running {stats['autovacuum_count']}x during the section; the soak (section "
            "10) shows the sizes and the claim staying flat over a million jobs with "
            "retention on.")
    index_list = "; ".join(f"{r['name']} {mib(r['size'])} → {mib(compact_indexes[r['name']])}"
                           for r in indexes)
    ctx.notes.append(f"tool_jobs indexes (as measured → after VACUUM FULL): {index_list}")
    av = ", ".join(f"{k} {v}" for k, v in sorted(server.items()))
    if with_backlog > 10 * empty_after:
        ctx.notes.append(
            f"**The claim grows with the backlog.** With {backlog:,} jobs queued one claim "
            f"took {ms(with_backlog)} ({backlog_plan}) against {ms(empty_after)} with the "
            "queue empty: `claim_job` picks `(state = 'queued' AND run_after <= now()) OR "
            "(state = 'running' AND lease_until < now() ...)` ORDER BY run_after, created_at, "
            "id, and no index yields that order for the OR, so every claim collects and sorts "
            "all eligible rows. A burst of enqueues (or sidecars that fall behind) makes every "
            "claim slower exactly when throughput matters. Fix: claim from each partial index "
            "separately, each an ordered LIMIT 1 (an index on (tool, run_after, created_at, "
            "id) WHERE state = 'queued' for the first), e.g. `(SELECT ... queued ORDER BY ... "
            "LIMIT 1 FOR UPDATE SKIP LOCKED) UNION ALL (SELECT ... expired ...) LIMIT 1`.")
    return [
        Row("7", f"tool_jobs heap + indexes after {jobs:,} jobs",
            f"{mib(size['heap'])} + {mib(size['indexes'])}",
            f"compacted: {mib(compact['heap'])} + {mib(compact['indexes'])}",
            f"{(size['heap'] + size['indexes']) / (compact['heap'] + compact['indexes']):.2f}"
            " × compacted"),
        Row("7", "dead tuples in tool_jobs; autovacuum runs during the bench",
            f"{dead:,} dead / {live:,} live ({dead / max(1, live + dead):.1%}); autovacuum "
            f"{stats['autovacuum_count']}×",
            "0 after VACUUM FULL",
            f"HOT {stats['n_tup_hot_upd'] / max(1, stats['n_tup_upd']):.0%} of "
            f"{stats['n_tup_upd']:,} updates"),
        Row("7", "journal tool_job_events",
            f"{mib(size['events'])}, {size['event_rows'] / max(1, jobs):.1f} rows per job",
            f"compacted: {mib(compact['events'])}",
            f"{size['events'] / max(1, compact['events']):.2f} × compacted"),
        Row("7", f"claim statement (EXPLAIN ANALYZE), empty queue after {jobs:,} jobs",
            ms(empty_before), f"same, compacted: {ms(empty_after)} ({empty_plan})",
            f"{empty_before / empty_after:.1f} × compacted"),
        Row("7", f"claim statement with {backlog:,} jobs queued (compacted table)",
            ms(with_backlog), f"empty queue {ms(empty_after)}",
            f"{with_backlog / empty_after:.1f} × empty queue ({backlog_plan})", "≤ 3 × empty",
            with_backlog <= 3 * empty_after),
        Row("7", "autovacuum settings on tool_jobs (from the migrations)",
            ", ".join(reloptions) if reloptions else "none",
            f"server: {av}"),
    ]
