"""13. WAL per no-op job (issue 28, point 5): the write-ahead log one job costs from its
enqueue to its prune, journal included, split by phase, by relation and by record type.

The section works in a scratch database of its own on the bench's server, so nothing the
other sections left behind is pruned or vacuumed in its window. It runs the job's whole
life with the real code paths:

- enqueue: ``jobs`` jobs one at a time by the statement ``sidecar enqueue`` runs
  (``enqueue_job``: tool_job_enqueue, its journal row, no key), no sidecar of the tool
  running;
- claim + run + complete: one real ``sidecar run --drain`` (concurrency 8, default
  profile) drains them; the tool is ``/bin/echo {}``, a no-op that succeeds (``/bin/true``
  prints nothing, which fails the job as bad_result); heartbeats would fall in this phase
  (a no-op has none);
- prune: ``sidecar prune --older-than 1d`` (the pruner's own ``retention.prune``)
  removes as many jobs as were enqueued, older ones, with their journal rows: the steady
  state of a queue under retention, one job out for each job in;
- then a plain ``VACUUM`` of tool_jobs and tool_job_events, reported apart: it is what
  makes the pruned rows' space reusable, but not part of "enqueue to prune".

Before the window (not measured): a warm-up of up to WARM real jobs, then RETAINED times
``jobs`` finished jobs kept as retention keeps them (copies of the warm-up's rows and
journal rows; the oldest ``jobs`` of them are what the window's prune removes), then
VACUUM ANALYZE. Retained rows matter: the prune deletes old rows from old pages, and
inserts into big indexes with random keys land on pages the window has not touched yet.

The WAL is cluster-wide and the bench's server may be shared, so the figures come from
``pg_walinspect`` (PostgreSQL 15+; the extension is created in the section's database):
each record in the window whose first block reference lies in the section's database,
plus every record (commits) of a transaction that wrote one. A record's bytes are its
``record_length`` rounded up to 8 (WAL records are MAXALIGNed; the 24-byte headers of WAL
pages, 0.3 %, are not counted); full-page images are given apart (``fpi_length``). Without
the extension (an older server, or a role that may not create it) the phases are
``pg_current_wal_insert_lsn()`` differences, cluster-wide, and the rows say so.

Full-page images depend on when the last checkpoint was: the first change of a page
after one logs the whole page. Where the bench owns the server (the embedded one, no
``--dsn`` and no ``SIDECAR_DATABASE_URL``) a ``CHECKPOINT`` precedes the measured window,
so every page's first touch in it carries its image (the worst case for a window this
long); on a server given by ``--dsn`` nothing server-wide is run or changed, and the
checkpoints that began in the window are counted.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson

from bench.common import (
    BenchError,
    Context,
    Sidecar,
    connect,
    create_scratch_database,
    drop_database,
    enqueue_one,
    progress,
    sidecar_env,
)
from bench.report import Row

TOOL = "wal-noop"
COMMAND = ["/bin/echo", "{}"]   # a no-op that succeeds, with the smallest result
CONCURRENCY = 8                 # one sidecar at 8, the CI shape of section 1
PHASES = ("enqueue", "claim+run+complete", "prune", "vacuum")
LIFE = PHASES[:3]               # enqueue to prune: what "per job" means
TABLES = ("tool_jobs", "tool_job_events")
TOP = 5                         # relations and record kinds named in a row
PAGE = 8192                     # bytes of a page: the most a full-page image takes
RETAINED = 10                   # finished jobs kept (retention) per job of the window
WARM = 300                      # most real jobs run before the window (the copies' models)

# $3 copies of the finished jobs of the tool $1 that the warm-up ran (each taken in turn,
# whatever columns tool_jobs has now): a new id, which is also its key (as for a job
# enqueued without one), finished $2 ago (+ 1 ms per copy: pruned oldest first), and
# copies of its journal rows.
CLONE = """
WITH src AS (
    SELECT j.*, row_number() OVER (ORDER BY j.id) - 1 AS k, count(*) OVER () AS m
    FROM tool_jobs j
    WHERE j.tool = $1 AND j.state = 'succeeded'
      AND j.finished_at > now() - interval '10 minutes'
), copies AS MATERIALIZED (
    SELECT s.id AS src_id, gen_random_uuid() AS id, g AS n
    FROM generate_series(0, $3 - 1) AS g JOIN src s ON s.k = g % s.m
), jobs AS (
    INSERT INTO tool_jobs
    SELECT (jsonb_populate_record(NULL::tool_jobs, to_jsonb(s) || jsonb_build_object(
               'id', c.id, 'idempotency_key', c.id::text,
               'finished_at', now() - $2::text::interval + c.n * interval '1 ms'))).*
    FROM copies c JOIN src s ON s.id = c.src_id
)
INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
SELECT c.id, e.fencing_token, e.event, e.at, e.details
FROM copies c JOIN tool_job_events e ON e.job_id = c.src_id
ORDER BY c.n, e.id
"""

# One row per (phase, record kind, relation, fork) of the section's database. $1, $2 the
# window; $3 the database's oid; $4 the later phases' first LSNs. A record is ours when
# its first block reference lies in our database, or when its transaction wrote one
# (commit records carry no block reference). Checkpoint records of the whole cluster
# come along so the window's checkpoints can be counted (kind 'XLOG CHECKPOINT_*').
WAL_BY_KIND = r"""
WITH r AS (
    SELECT start_lsn, xid::text::bigint AS x,
           resource_manager || ' ' || record_type AS kind,
           (record_length + 7) / 8 * 8 AS bytes, fpi_length,
           substring(block_ref FROM 'rel \d+/(\d+)/\d+')::oid AS db,
           substring(block_ref FROM 'rel \d+/\d+/(\d+)')::oid AS filenode,
           substring(block_ref FROM 'rel \d+/\d+/\d+ fork (\w+)') AS fork
    FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
), ours AS (
    SELECT DISTINCT x FROM r WHERE db = $3::oid AND x <> 0
)
SELECT (SELECT count(*) FROM unnest($4::pg_lsn[]) AS m WHERE m <= r.start_lsn)::int AS phase,
       kind, CASE WHEN db = $3::oid THEN filenode END AS filenode,
       CASE WHEN db = $3::oid THEN coalesce(fork, 'main') END AS fork,
       count(*)::bigint AS records, sum(bytes)::bigint AS bytes,
       sum(fpi_length)::bigint AS fpi_bytes,
       count(*) FILTER (WHERE fpi_length > 0)::bigint AS fpi_records
FROM r
WHERE db = $3::oid OR (x <> 0 AND x IN (SELECT x FROM ours))
   OR kind LIKE 'XLOG CHECKPOINT%'
GROUP BY 1, 2, 3, 4
"""

# filenode -> what to call it: tables by name, indexes by name with their table, TOAST
# with its table, the system catalogs as one.
RELATIONS = """
SELECT pg_relation_filenode(c.oid)::bigint AS filenode, c.relname, c.relkind::text AS kind,
       n.nspname, t.relname AS index_of, o.relname AS toast_of
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_index i ON i.indexrelid = c.oid
LEFT JOIN pg_class t ON t.oid = i.indrelid
LEFT JOIN pg_class o ON o.reltoastrelid = coalesce(t.oid, c.oid)
WHERE pg_relation_filenode(c.oid) IS NOT NULL
"""

# Distinct pages of each relation of the database $3 that records between $1 and $2
# changed (every block reference, not only the first): each would carry a full-page
# image at its first change after a checkpoint.
PAGES = r"""
SELECT m[1]::bigint AS filenode, m[2] AS fork, count(DISTINCT m[3]::bigint)::bigint AS pages
FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) AS r,
     regexp_matches(r.block_ref, 'rel \d+/' || $3::oid || '/(\d+) fork (\w+) blk (\d+)', 'g')
     AS m
GROUP BY 1, 2
"""

AUTOVACUUMS = """
SELECT coalesce(sum(autovacuum_count), 0)::bigint FROM pg_stat_user_tables
WHERE relname = ANY($1::text[])
"""


@dataclass
class Tally:
    """WAL bytes, images and records, summed over some records."""

    bytes: int = 0
    fpi_bytes: int = 0
    fpi_records: int = 0
    records: int = 0

    def add(self, row: Any) -> None:
        """Add a WAL_BY_KIND row (or another Tally: anything with these four keys)."""
        for name in ("bytes", "fpi_bytes", "fpi_records", "records"):
            setattr(self, name, getattr(self, name) + (
                getattr(row, name) if isinstance(row, Tally) else row[name]))


@dataclass
class Breakdown:
    """The measured window's records of the section's database, summed per phase, per
    (phase, relation) and per (phase, record kind); ``checkpoints`` counts the checkpoint
    records of the whole cluster in the window."""

    phase: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    relation: dict[tuple[str, str], Tally] = field(default_factory=lambda: defaultdict(Tally))
    kind: dict[tuple[str, str], Tally] = field(default_factory=lambda: defaultdict(Tally))
    groups: dict[str, str] = field(default_factory=dict)  # relation label -> its group
    pages: dict[str, int] = field(default_factory=dict)  # relation -> pages, enqueue → prune
    checkpoints: int = 0
    commits: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def life(self, table: dict[tuple[str, str], Tally]) -> dict[str, Tally]:
        """``table`` summed over the phases from enqueue to prune, by its second key."""
        out: dict[str, Tally] = defaultdict(Tally)
        for (phase, key), tally in table.items():
            if phase in LIFE:
                out[key].add(tally)
        return out


def relation_label(row: Any | None, fork: str | None) -> tuple[str, str]:
    """What a WAL record's relation is called, and the group it is summed in:
    ``("tool_jobs_pkey (index)", "tool_jobs indexes")``, ``("tool_jobs (vm)", "tool_jobs
    table")``, ``("system catalogs", "other relations")``; records without a block
    reference (commits) are ``no relation (commits, ...)``. ``row`` is a RELATIONS row or
    None (a relation gone or unknown); ``fork`` the first block's fork (main, fsm, vm)."""
    if fork is None:
        return "no relation (commits, ...)", "commits (no relation)"
    group = "other relations"
    if row is None:
        label = "dropped or unknown relation"
    elif row["nspname"] in ("pg_catalog", "information_schema"):
        return "system catalogs", group
    elif row["nspname"] == "pg_toast":
        label = f"{row['toast_of'] or '?'} (TOAST)"
    elif row["kind"] == "i":
        label = f"{row['relname']} (index)"
        if row["index_of"] in TABLES:
            group = f"{row['index_of']} indexes"
    else:
        label = row["relname"]
        if label in TABLES:
            group = f"{label} table"
    return (label if fork == "main" else f"{label} ({fork})"), group


def per_job(n_bytes: float, jobs: int) -> str:
    """Bytes per job, as the table shows them: ``1,234 B``."""
    return f"{n_bytes / jobs:,.0f} B"


async def _lsn(conn: asyncpg.Connection) -> int:
    """The WAL insert position (asyncpg gives a pg_lsn as an int: bytes from 0/0)."""
    return await conn.fetchval("SELECT pg_current_wal_insert_lsn()")


async def _walinspect(conn: asyncpg.Connection) -> str | None:
    """None when pg_walinspect is usable in this database (created here if need be), else
    why not (one line)."""
    if await conn.fetchval("SELECT current_setting('server_version_num')::int") < 150000:
        return "the server is older than PostgreSQL 15"
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    except asyncpg.PostgresError as exc:
        return f"CREATE EXTENSION pg_walinspect failed ({type(exc).__name__}: {exc})"
    if not await conn.fetchval("SELECT has_function_privilege("
                               "'pg_get_wal_records_info(pg_lsn, pg_lsn)', 'execute')"):
        return "this role may not call pg_get_wal_records_info"
    return None


async def _run_sidecar(ctx: Context, conn: asyncpg.Connection, dsn: str, jobs: int,
                       name: str) -> None:
    """One real ``sidecar run --drain`` until the tool's queue is empty and it exited;
    BenchError unless it exited 0 with ``jobs`` more jobs succeeded than before."""
    count = "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state = 'succeeded'"
    before = await conn.fetchval(count, TOOL)
    sc = Sidecar(ctx, name, TOOL, COMMAND, CONCURRENCY, drain=True, dsn=dsn)
    try:
        code = await sc.exit(60 + jobs / 5)
    finally:
        await sc.stop()
    done = await conn.fetchval(count, TOOL) - before
    if code != 0 or done != jobs:
        raise BenchError(f"sidecar {name} exited {code} with {done} of {jobs} jobs "
                         f"succeeded: {sc.tail()}")


async def _prune(dsn: str, jobs: int) -> None:
    """``sidecar prune --older-than 1d``: the pruner's ``retention.prune`` over the jobs
    that finished over a day ago; BenchError unless it removed ``jobs`` jobs with their
    journal rows."""
    argv = [sys.executable, "-m", "sidecar", "prune", "--older-than", "1d"]
    done = await asyncio.to_thread(subprocess.run, argv, env=sidecar_env(dsn),
                                   capture_output=True, timeout=120)
    if done.returncode != 0:
        raise BenchError(f"sidecar prune exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace')[-300:]}")
    removed = orjson.loads(done.stdout)
    if removed["jobs"] != jobs or removed["busy"] or removed["events"] < jobs:
        raise BenchError(f"sidecar prune removed {removed['jobs']} of {jobs} jobs and "
                         f"{removed['events']} journal rows (busy: {removed['busy']})")


async def _enqueue(conn: asyncpg.Connection, jobs: int) -> None:
    """``jobs`` jobs one at a time, by the statement and journal details of ``sidecar
    enqueue`` (no key: the job's id is its key; max_attempts left to the profile)."""
    for _ in range(jobs):
        await enqueue_one(conn, TOOL, max_attempts=None, details={"by": "sidecar enqueue"})


async def _retain(conn: asyncpg.Connection, jobs: int) -> None:
    """The retained backlog: ``RETAINED × jobs`` copies of the warm-up's finished jobs,
    journal rows included; the first ``jobs`` finished two days ago (the window's prune
    takes them), the others an hour ago."""
    async with conn.transaction():
        await conn.execute(CLONE, TOOL, "2 days", jobs)
        await conn.execute(CLONE, TOOL, "1 hour", (RETAINED - 1) * jobs)


async def _window(ctx: Context, conn: asyncpg.Connection, dsn: str, jobs: int) -> list[int]:
    """The measured job life: the insert LSN before each phase (enqueue, claim+run+
    complete, prune, vacuum) and after the last."""
    marks = [await _lsn(conn)]
    await _enqueue(conn, jobs)
    marks.append(await _lsn(conn))
    await _run_sidecar(ctx, conn, dsn, jobs, "wal")
    marks.append(await _lsn(conn))
    await _prune(dsn, jobs)
    marks.append(await _lsn(conn))
    await conn.execute(f"VACUUM {', '.join(TABLES)}")
    marks.append(await _lsn(conn))
    return marks


async def _breakdown(conn: asyncpg.Connection, marks: list[int]) -> Breakdown:
    """The window's records of this database, summed (``WAL_BY_KIND``)."""
    end = marks[-1]
    for _ in range(100):  # pg_walinspect reads no further than what is flushed
        if await conn.fetchval("SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn", end):
            break
        await asyncio.sleep(0.05)
    oid = await conn.fetchval("SELECT oid FROM pg_database WHERE datname = current_database()")
    names = {r["filenode"]: r for r in await conn.fetch(RELATIONS)}
    rows = await conn.fetch(WAL_BY_KIND, marks[0], end, oid, marks[1:-1])
    out = Breakdown()
    for row in rows:
        if row["kind"].startswith("XLOG CHECKPOINT"):
            out.checkpoints += row["records"]
            if row["filenode"] is None:
                continue  # the cluster's, not ours
        phase = PHASES[min(row["phase"], len(PHASES) - 1)]
        relation, out.groups[relation] = relation_label(names.get(row["filenode"]),
                                                        row["fork"])
        out.phase[phase].add(row)
        out.relation[phase, relation].add(row)
        out.kind[phase, row["kind"]].add(row)
        if row["kind"] == "Transaction COMMIT":
            out.commits[phase] += row["records"]
    for row in await conn.fetch(PAGES, marks[0], marks[len(LIFE)], oid):
        relation, out.groups[relation] = relation_label(names.get(row["filenode"]),
                                                        row["fork"])
        out.pages[relation] = out.pages.get(relation, 0) + row["pages"]
    return out


def _listing(tallies: dict[str, Tally], jobs: int, limit: int | None = None) -> str:
    ranked = sorted(tallies.items(), key=lambda kv: -kv[1].bytes)
    shown = ranked[:limit] if limit else ranked
    parts = [f"{key} {per_job(t.bytes, jobs)}" + (f" (FPI {per_job(t.fpi_bytes, jobs)})"
                                                   if t.fpi_bytes else "")
             for key, t in shown]
    rest = ranked[len(shown):]
    if rest:
        parts.append(f"{len(rest)} more {per_job(sum(t.bytes for _, t in rest), jobs)}")
    return ", ".join(parts)


def _grouped(by_relation: dict[str, Tally], groups: dict[str, str]) -> dict[str, Tally]:
    """``by_relation`` folded into its groups (``relation_label``): tool_jobs table, its
    indexes, tool_job_events table, its indexes, commits and every other relation."""
    out: dict[str, Tally] = defaultdict(Tally)
    for label, tally in by_relation.items():
        out[groups[label]].add(tally)
    return out


async def _settings(conn: asyncpg.Connection) -> str:
    values = [f"{name} {await conn.fetchval('SELECT current_setting($1)', name)}"
              for name in ("full_page_writes", "wal_compression", "data_checksums",
                           "wal_log_hints", "checkpoint_timeout", "autovacuum")]
    return ", ".join(values)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    """Section 13's rows (six with pg_walinspect, one without), measured in a scratch
    database of its own (created, migrated and dropped here; ``conn``, the run's database,
    is not used) with ``ctx.mode.jobs`` jobs in the window. Raises BenchError when a
    sidecar or the prune does not do what the window needs."""
    jobs = ctx.mode.jobs
    dsn = await create_scratch_database(ctx.admin_dsn)
    try:
        from sidecar.storage.db import create_pool
        from sidecar.storage.store import StoreBase

        pool = await create_pool(dsn, 10, max_size=1)
        await StoreBase(pool, 10).migrate()
        await pool.close()
        own = await connect(dsn)
        try:
            return await _measure(ctx, own, dsn, jobs)
        finally:
            await own.close()
    finally:
        await drop_database(ctx.admin_dsn, dsn)


async def _measure(ctx: Context, conn: asyncpg.Connection, dsn: str, jobs: int) -> list[Row]:
    missing = await _walinspect(conn)
    warm = min(jobs, WARM)
    progress(f"WAL: warm-up of {warm:,} no-op jobs, then {RETAINED * jobs:,} finished jobs "
             "retained (not measured)")
    await _enqueue(conn, warm)
    await _run_sidecar(ctx, conn, dsn, warm, "wal-warmup")
    await _retain(conn, jobs)
    await conn.execute(f"VACUUM (ANALYZE) {', '.join(TABLES)}")
    checkpointed = ctx.owns_server
    if checkpointed:  # only on a server the bench started itself
        await conn.execute("CHECKPOINT")
    autovacuums = await conn.fetchval(AUTOVACUUMS, list(TABLES))
    progress(f"WAL: measured: {jobs:,} no-op jobs enqueued and run, {jobs:,} old ones "
             "pruned, then VACUUM")
    marks = await _window(ctx, conn, dsn, jobs)
    autovacuums = await conn.fetchval(AUTOVACUUMS, list(TABLES)) - autovacuums
    ctx.count("WAL per job (warm-up and measured)", warm + jobs)
    settings = await _settings(conn)
    ctx.settings.append(
        f"13: {jobs:,} jobs of `{' '.join(COMMAND)}` enqueued one at a time (`enqueue_job`, "
        f"no key) and drained by 1 sidecar × {CONCURRENCY} (`--drain`, default profile), "
        f"then `sidecar prune --older-than 1d` removing as many older jobs, then `VACUUM "
        f"{', '.join(TABLES)}`; before the window: a warm-up of {warm:,} jobs, "
        f"{RETAINED * jobs:,} finished jobs retained ({RETAINED} × the window's: copies of "
        "the warm-up's, journal included), VACUUM ANALYZE, CHECKPOINT: "
        f"{'yes' if checkpointed else 'no (not the bench’s own server)'}; "
        f"server: {settings}")
    if missing:
        return _lsn_rows(ctx, marks, jobs, missing)
    try:
        found = await _breakdown(conn, marks)
    except asyncpg.UndefinedFileError:
        # A busy server the bench does not own recycled the window's WAL before it was
        # read (a checkpoint of other work meanwhile): the cluster's LSN differences,
        # said so, rather than no figure at all.
        return _lsn_rows(ctx, marks, jobs, "the window's WAL segments were recycled "
                         "before they were read, on a server busy with other work")
    return _rows(ctx, found, jobs, checkpointed, autovacuums)


def _lsn_rows(ctx: Context, marks: list[int], jobs: int, why: str) -> list[Row]:
    """Without pg_walinspect: the cluster's WAL per phase (it includes other databases')."""
    spans = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    ctx.notes.append(f"13: pg_walinspect unavailable ({why}): the figures are "
                     "pg_current_wal_insert_lsn() differences of the whole cluster, "
                     "with whatever else the server wrote meanwhile")
    life = sum(spans[:3])
    return [
        Row("13", f"WAL per no-op job, enqueue → prune, journal included ({jobs:,} jobs; "
            "cluster-wide LSN difference, pg_walinspect unavailable)", per_job(life, jobs),
            "by phase: " + ", ".join(f"{p} {per_job(s, jobs)}"
                                     for p, s in zip(PHASES, spans, strict=True)))]


def _rows(ctx: Context, found: Breakdown, jobs: int, checkpointed: bool,
          autovacuums: int) -> list[Row]:
    life = Tally()
    for phase in LIFE:
        life.add(found.phase[phase])
    if not life.records:
        raise BenchError("pg_walinspect found no WAL record of the section's database")
    vacuum = found.phase["vacuum"]
    commits = sum(found.commits[p] for p in LIFE)
    if checkpointed:
        images = "after a CHECKPOINT just before the window"
    else:
        images = (f"{found.checkpoints} checkpoint record(s) in the window; no CHECKPOINT "
                  "run (not the bench's own server)")
    by_relation = found.life(found.relation)
    by_kind = found.life(found.kind)
    groups = _grouped(by_relation, found.groups)
    updates = sum(t.records for k, t in by_kind.items() if k.startswith(("Heap UPDATE",
                                                                         "Heap HOT_UPDATE")))
    hot = sum(t.records for k, t in by_kind.items() if k.startswith("Heap HOT_UPDATE"))
    pages = sum(found.pages.values())
    rows = [
        Row("13", f"WAL per no-op job, enqueue → prune, journal included ({jobs:,} jobs, "
            f"1×{CONCURRENCY})", per_job(life.bytes, jobs),
            f"without full-page images {per_job(life.bytes - life.fpi_bytes, jobs)}; images "
            f"{per_job(life.fpi_bytes, jobs)} ({life.fpi_records / jobs:.2f} per job, "
            f"{images})"),
        Row("13", "WAL per job by phase", ", ".join(
            f"{p} {per_job(found.phase[p].bytes, jobs)}" for p in LIFE),
            f"then VACUUM of the pruned rows {per_job(vacuum.bytes, jobs)} (images "
            f"{per_job(vacuum.fpi_bytes, jobs)})"),
        Row("13", "WAL per job by relation, enqueue → prune", _listing(groups, jobs),
            f"largest: {_listing(by_relation, jobs, 3)}"),
        Row("13", "WAL per job by record kind, enqueue → prune",
            _listing(by_kind, jobs, TOP), f"heap updates per job: {updates / jobs:.2f}, of "
            f"which HOT {hot / jobs:.2f}"),
        Row("13", "WAL records per job, enqueue → prune", f"{life.records / jobs:.1f}",
            f"{commits / jobs:.2f} commits per job"),
        Row("13", "pages changed, enqueue → prune (an image each at its first change after "
            "a checkpoint)", f"{pages:,} ({pages / jobs:.2f} per job)",
            f"≤ {per_job(pages * PAGE, jobs)} of images per job if a checkpoint came just "
            f"before the window; most pages: " + ", ".join(
                f"{k} {v:,}" for k, v in sorted(found.pages.items(),
                                                 key=lambda kv: -kv[1])[:TOP])),
    ]
    ctx.notes.append("13: WAL per job by relation, enqueue → prune (bytes per job, full-page "
                     "images included): " + _listing(by_relation, jobs))
    for phase in PHASES:
        kinds = {k: t for (p, k), t in found.kind.items() if p == phase}
        rels = {k: t for (p, k), t in found.relation.items() if p == phase}
        ctx.notes.append(f"13: {phase} {per_job(found.phase[phase].bytes, jobs)} per job; by "
                         f"record kind: {_listing(kinds, jobs)}; by relation: "
                         f"{_listing(rels, jobs)}")
    if autovacuums:
        ctx.notes.append(f"13: autovacuum ran {autovacuums} time(s) on {', '.join(TABLES)} "
                         "in the measured window; its records fall in the phase it ran in "
                         "(Heap2 PRUNE/VACUUM/VISIBLE, Btree VACUUM/DELETE)")
    ctx.notes.append("13: bytes are WAL record lengths rounded up to 8 (the 24-byte WAL "
                     "page headers, 0.3 %, not counted), of the records of the section's own "
                     "database and the commits of its transactions (pg_walinspect)")
    return rows

