"""7. Queue health after many jobs: the size of ``tool_jobs`` and its indexes, dead tuples,
autovacuum activity and the autovacuum settings on the table, and the journal's size.

The jobs the other sections ran count; the rest up to the mode's number go through the
bare loop of ``bench.baseline claim --journal``, which writes exactly what a sidecar writes
per no-op job (claim, ``tool_request_started``, fenced completion), without spawning, so a
hundred thousand jobs take minutes instead of an hour; 5,000 at a time, about the backlog
a throughput run has. The baseline is the same rows compacted by
VACUUM FULL at the end (the fillfactor kept). Last, the claim statement itself (EXPLAIN
ANALYZE, rolled back): with the queue empty, one job and a large backlog queued, taking
turns in rounds so that all see the same machine (see ``CLAIM_ROUNDS``).
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
from sidecar.storage.queries import Q

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
# Rounds for the backlog rows. One claim statement is 30-150 us, and measured one state at
# a time (the empty queue, then the backlog) one round's ratio spread from 1.9 to 5.5 on a
# 2-core machine: the machine's drift between the two phases, not the backlog (queues of
# 1 to 200,000 jobs measured within 20 % of each other when taking turns). So the claims
# of the three queues take turns within each round, and the rows pool the rounds.
CLAIM_ROUNDS = 7


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


async def claim_samples(conn: asyncpg.Connection,
                        *tools: str) -> dict[str, tuple[list[float], str]]:
    """For each of ``tools``: CLAIM_SAMPLES execution times of the claim statement in
    seconds, and its plan's scan nodes, for that tool's queue as it is. Each run is EXPLAIN
    ANALYZE of ``claim_job`` itself, rolled back. The tools take turns, so drift in the
    machine lands on all of them, in an order that rotates: the claim run right after one
    that found nothing measured about 10 us slower than the others, whatever its backlog.
    Node timing is off: only the statement's total is read, which PostgreSQL measures
    either way, and per-node clock reads would add to a plan in proportion to the rows it
    moves (PostgreSQL's EXPLAIN docs, TIMING)."""
    times: dict[str, list[float]] = {tool: [] for tool in tools}
    plans: dict[str, dict] = {}
    for sample in range(CLAIM_SAMPLES):
        turn = sample % len(tools)
        for tool in tools[turn:] + tools[:turn]:
            tr = conn.transaction()
            await tr.start()
            try:
                [plan] = await conn.fetchval(
                    "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + Q["claim_job"],
                    tool, "bench-explain", 90.0, None, 3, 1)
            finally:
                await tr.rollback()
            if isinstance(plan, str):
                plan = orjson.loads(plan)
            times[tool].append(plan["Execution Time"] / 1000)
            plans[tool] = plan
    return {tool: (times[tool], _scan_nodes(plans[tool]["Plan"])) for tool in tools}


def _scan_nodes(plan: dict) -> str:
    """The scan and sort nodes of a plan, each once, in plan order (e.g. "Index Scan
    tool_jobs_queued_order_idx")."""
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

    walk(plan)
    return ", ".join(nodes)


async def claim_cost(conn: asyncpg.Connection, tool: str) -> tuple[float, str]:
    """The median of ``claim_samples`` for ``tool`` in seconds (one run is a tenth of a
    millisecond, within the timer's noise), and the plan's scan nodes."""
    [(times, plan)] = (await claim_samples(conn, tool)).values()
    return statistics.median(times), plan


async def _claims_beside(conn: asyncpg.Connection, tool: str,
                         queued: int) -> dict[str, tuple[list[float], str]]:
    """``claim_samples`` of the empty queue ("fill"), of ``tool`` with ``queued`` jobs and
    of "single" with one, taking turns on one vacuumed table; both queues are deleted
    afterwards."""
    await enqueue_many(conn, tool, queued, notify=False)
    await enqueue_many(conn, "single", 1, notify=False)
    # Vacuumed, as the empty queue was, and as autovacuum leaves a table after an insert
    # of this size.
    await conn.execute("VACUUM ANALYZE tool_jobs")
    taken = await claim_samples(conn, "fill", tool, "single")
    await conn.execute("DELETE FROM tool_jobs WHERE tool IN ($1, 'single')", tool)
    await conn.execute("VACUUM ANALYZE tool_jobs")
    return taken


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
    progress(f"queue health: the claim with {backlog:,} jobs queued, {CLAIM_ROUNDS} rounds")
    empties: list[float] = []
    singles: list[float] = []
    backlogs: list[float] = []
    round_ratios: list[float] = []
    for _ in range(CLAIM_ROUNDS):
        taken = await _claims_beside(conn, "backlog", backlog)
        (empty, _), (full, backlog_plan), (single, _) = (
            taken["fill"], taken["backlog"], taken["single"])
        empties += empty
        singles += single
        backlogs += full
        round_ratios.append(statistics.median(full) / statistics.median(empty))
    empty_pooled = statistics.median(empties)
    with_single = statistics.median(singles)
    with_backlog = statistics.median(backlogs)
    # Once more with ten times the backlog: the claim's cost should not follow it.
    large = 10 * backlog
    progress(f"queue health: the claim with {large:,} jobs queued")
    taken = await _claims_beside(conn, "large", large)
    large_empty, large_full, large_single = (
        statistics.median(taken[tool][0]) for tool in ("fill", "large", "single"))
    ctx.settings.append(
        f"queue health: the backlog claim over {CLAIM_ROUNDS} rounds, each {CLAIM_SAMPLES} "
        f"claims of a tool whose queue is empty, one with {backlog:,} queued and one with "
        "a single job queued, taking turns on the same vacuumed table (EXPLAIN ANALYZE with "
        "node timing off, rolled back); the rows compare the pooled medians; one round's "
        f"ratio {backlog:,} / empty: " + ", ".join(f"{r:.2f}" for r in round_ratios))

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
    if with_backlog > 10 * empty_pooled:
        ctx.notes.append(
            f"**The claim grows with the backlog.** With {backlog:,} jobs queued one claim "
            f"took {ms(with_backlog)} ({backlog_plan}) against {ms(empty_pooled)} with the "
            "queue empty. Each part of `claim_job` should be an ordered LIMIT over its own "
            "partial index (migration 005); a Sort or Seq Scan above over tool_jobs means "
            "that plan was lost (tests/test_claim_plan.py checks it at 20,000 and 200,000).")
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
        Row("7", f"claim statement with {backlog:,} jobs queued (vacuumed table, "
            f"{CLAIM_ROUNDS} rounds)",
            ms(with_backlog), f"empty queue {ms(empty_pooled)}",
            f"{with_backlog / empty_pooled:.1f} × empty queue ({backlog_plan})",
            "≤ 3 × empty", with_backlog <= 3 * empty_pooled),
        Row("7", "claim statement with 1 job queued (same rounds): the work a claim does "
            "whatever the backlog (lock, update, journal row)",
            ms(with_single), f"{backlog:,} queued {ms(with_backlog)}",
            f"{with_backlog / with_single:.2f} × one queued job; "
            f"{with_single / empty_pooled:.1f} × empty queue"),
        Row("7", f"claim statement with {large:,} jobs queued (one more round)",
            ms(large_full), f"1 job queued {ms(large_single)}, empty queue {ms(large_empty)}",
            f"{large_full / large_single:.2f} × one queued job; "
            f"{large_full / large_empty:.1f} × empty queue"),
        Row("7", "autovacuum settings on tool_jobs (from the migrations)",
            ", ".join(reloptions) if reloptions else "none",
            f"server: {av}"),
    ]
