"""Retention: what it removes is one list, RETENTION, which the periodic pruner of every
``sidecar run`` (every PRUNE_PERIOD_SECONDS) and ``sidecar prune`` both go through with
``prune`` (issue 41, point 6: the command used to leave out what only the sidecars
pruned), and which ``sidecar prune --dry-run`` counts kind by kind.

Finished jobs (succeeded, failed, cancelled) and their journal and outbox rows go once
older than the retention of their state (``SIDECAR_RETENTION_SECONDS`` for succeeded and
cancelled, ``SIDECAR_RETENTION_FAILED_SECONDS`` for failed, so dead letters stay longer for
inspection; 0 keeps everything), in small batches, by one pruner at a time across every
sidecar of the database (a transaction-scoped advisory lock). A job is kept while a later
stage of it is still queued or running or its result is still to be forwarded. Each batch
is one statement that only touches finished rows, with SKIP LOCKED, so claims, heartbeats
and completions never wait on it. The other kinds are the flow changes as old as the
longest-kept jobs, and the housekeeping rows that no longer mean anything (each kind's
``rule`` says when); each is one statement, safe to run from several sidecars at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from sidecar.ops import metrics
from sidecar.ops.periodic import Periodic
from sidecar.protocol.model import JobState
from sidecar.runtime.config import Settings
from sidecar.runtime.log import log
from sidecar.storage import db
from sidecar.storage.store import Pruning

PRUNE_LOCK_KEY = 0x5DECA4_0002    # the advisory lock one pruner at a time holds
BATCH = 500                        # jobs one statement deletes at most
PRUNE_PERIOD_SECONDS = 60.0        # how often a sidecar prunes


@dataclass(frozen=True)
class Kind:
    """One kind of row retention removes. ``name``: its count's key in ``prune``'s report
    (and the ``jobs_pruned`` event); ``table``: the table it touches (the
    ``sidecar_pruned_rows`` label); ``rule``: when a row goes; ``statement``: the named
    query (sql/queries.sql) that removes them and returns how many, or None for the three
    kinds the finished jobs' batches remove together; ``aged``: the statement takes an age
    in seconds, the longest retention of finished jobs, and is skipped while every
    retention is 0 (keep everything); ``deletes``: False for a flag cleared rather than a
    row deleted (not counted in ``sidecar_pruned_rows``)."""

    name: str
    table: str
    rule: str
    statement: str | None = None
    aged: bool = False
    deletes: bool = True


# Everything retention removes, in the order ``prune`` goes through it.
RETENTION: tuple[Kind, ...] = (
    Kind("jobs", "tool_jobs", "finished jobs older than their state's retention, unless a "
         "later stage is still queued or running or a result is still to be forwarded"),
    Kind("events", "tool_job_events", "the journal rows of those jobs"),
    Kind("outbox", "tool_job_outbox", "the outbox rows of those jobs"),
    Kind("flow_events", "tool_flow_events", "flow changes (limits set, pauses, resumes) "
         "older than the longest retention", "prune_flow_events", aged=True),
    Kind("rate_buckets", "tool_flow_keys", "per-key rate buckets that have refilled, or "
         "of a tool without a per-key rate now (a missing bucket is a full one)",
         "prune_full_key_buckets"),
    Kind("ended_cancels", "tool_jobs", "the slot of a cancelled job whose lease ended "
         "without its owner's confirmation (cancel_pending cleared; no row deleted)",
         "prune_ended_cancels", deletes=False),
    Kind("idle_sidecars", "tool_idle_sidecars", "idle registrations not refreshed for ten "
         "minutes (their sidecars died)", "prune_dead_idle_sidecars"),
    Kind("sweeps", "tool_sweeps", "the sweep turn of a tool no sidecar has sampled for a "
         "day", "prune_idle_sweeps"),
    Kind("sessions", "tool_sessions", "agent sessions that ended or were lost longer ago "
         "than the longest retention, none of whose calls is queued or running (a later "
         "call of the key starts a new session)", "prune_ended_sessions", aged=True),
    Kind("interests", "tool_interests", "callers' interests that lapsed or were let go "
         "longer ago than the longest retention, none of whose calls is unfinished (a key "
         "held again starts anew)", "prune_ended_interests", aged=True),
)
# The kinds the finished jobs' batches remove (statement None), by their report keys.
JOB_KINDS: tuple[Kind, ...] = tuple(kind for kind in RETENTION if kind.statement is None)


def retention_by_state(settings: Settings) -> dict[str, float]:
    """Seconds after finishing that a job of each finished state may be deleted; 0 = never."""
    # Plain str keys: the result is printed with orjson, which refuses str subclasses as keys.
    return {JobState.SUCCEEDED.value: settings.retention_seconds,
            JobState.FAILED.value: settings.retention_failed_seconds,
            JobState.CANCELLED.value: settings.retention_seconds}


async def prune(store: Pruning, ages: dict[str, float], *, dry_run: bool = False,
                batch: int = BATCH, pause: float = 0.0,
                finished_only: bool = False) -> dict[str, Any]:
    """Remove every kind of RETENTION (``dry_run``: only count, removing nothing): per
    state in ``ages`` (state -> seconds; 0 or less keeps that state), the jobs finished
    longer ago with their journal and outbox rows, in batches of ``batch`` jobs with
    ``pause`` seconds between them; then each other kind, the aged ones (flow changes) by
    the longest of ``ages``. ``finished_only``: the finished jobs of ``ages`` alone
    (``sidecar prune --state``). Returns ``{"dry_run", "busy", "removed": {state: {"jobs",
    "events", "outbox"}}}`` and one count per kind by its name (a kind not run counts 0);
    ``busy`` is True when another pruner held the jobs' lock (this one then stopped
    removing jobs; the other kinds need no lock). Counts ``sidecar_pruned_rows`` by table
    when not a dry run. Database errors propagate."""
    removed: dict[str, dict[str, int]] = {}
    busy = False
    for state, age in ages.items():
        if age <= 0:
            continue
        counts = removed.setdefault(state, {kind.name: 0 for kind in JOB_KINDS})
        while True:
            if dry_run:
                row = await store.count_prunable(state, age)
            else:
                row = await store.prune_finished(state, age, batch, PRUNE_LOCK_KEY)
            if not row["locked"]:
                busy = True
                break
            for kind in JOB_KINDS:
                counts[kind.name] += row[kind.name]
                if not dry_run and row[kind.name]:
                    metrics.PRUNED_ROWS.labels(kind.table).inc(row[kind.name])
            if dry_run or row["jobs"] < batch:
                break
            await asyncio.sleep(pause)
        if busy:
            break
    totals = {kind.name: sum(c[kind.name] for c in removed.values()) for kind in JOB_KINDS}
    longest = max(ages.values(), default=0)
    for kind in RETENTION:
        if kind.statement is None:
            continue
        totals[kind.name] = 0
        if finished_only or (kind.aged and longest <= 0):
            continue
        args = (longest,) if kind.aged else ()
        count = await store.prune_rows(kind.statement, *args, dry_run=dry_run)
        totals[kind.name] = count
        if not dry_run and count and kind.deletes:
            metrics.PRUNED_ROWS.labels(kind.table).inc(count)
    return {"dry_run": dry_run, "busy": busy, "removed": removed, **totals}


async def prune_once(store: Pruning, ages: dict[str, float], tool: str) -> dict[str, Any]:
    """One pass of a sidecar's pruner: ``prune`` (every kind of RETENTION) with a short
    pause between batches, logged as ``jobs_pruned`` with every count when anything was
    removed. Returns prune's report. Database errors propagate."""
    done = await prune(store, ages, pause=0.05)
    counts = {kind.name: done[kind.name] for kind in RETENTION}
    if any(counts.values()):
        log.emit("jobs_pruned", tool=tool, **counts,
                 by_state={s: c["jobs"] for s, c in done["removed"].items() if c["jobs"]})
    return done


async def run_pruner(store: Pruning, settings: Settings, tool: str,
                     period: float = PRUNE_PERIOD_SECONDS) -> None:
    """Prune every ``period`` seconds (the first time 1-5 s after start, at a random
    moment, so sidecars started together do not all try at once) until cancelled, one
    ``prune_once`` (every kind of RETENTION, as ``sidecar prune``) a pass. A database error
    is logged (``prune_error``) and tried again next period. The periodic service
    ``pruner`` (sidecar.ops.periodic)."""
    ages = retention_by_state(settings)

    async def step() -> None:
        await prune_once(store, ages, tool)

    await Periodic("pruner", period, step, first=1.0, jitter=4.0, errors=db.DATABASE_ERRORS,
                   error_event="prune_error", fields={"tool": tool},
                   error_fields=lambda exc: {"reason": db.describe_error(exc),
                                             "sqlstate": db.sqlstate(exc)}).run()
