"""Retention: finished jobs (succeeded, failed, cancelled) and their journal and outbox
rows are deleted once older than the retention of their state (``SIDECAR_RETENTION_SECONDS``
for succeeded and cancelled, ``SIDECAR_RETENTION_FAILED_SECONDS`` for failed, so dead
letters stay longer for inspection; 0 keeps everything), in small batches, by one pruner
at a time across every sidecar of the database (a transaction-scoped advisory lock).

A job is kept while a later stage of it is still queued or running or its result is still
to be forwarded. Each batch is one statement that only touches finished rows, with SKIP
LOCKED, so claims, heartbeats and completions never wait on it. ``sidecar prune`` runs the
same on demand; every ``sidecar run`` prunes every PRUNE_PERIOD_SECONDS.
"""

from __future__ import annotations

import asyncio
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
_TABLES = {"jobs": "tool_jobs", "events": "tool_job_events", "outbox": "tool_job_outbox"}


def retention_by_state(settings: Settings) -> dict[str, float]:
    """Seconds after finishing that a job of each finished state may be deleted; 0 = never."""
    # Plain str keys: the result is printed with orjson, which refuses str subclasses as keys.
    return {JobState.SUCCEEDED.value: settings.retention_seconds,
            JobState.FAILED.value: settings.retention_failed_seconds,
            JobState.CANCELLED.value: settings.retention_seconds}


async def prune(store: Pruning, ages: dict[str, float], *, dry_run: bool = False,
                batch: int = BATCH, pause: float = 0.0) -> dict[str, Any]:
    """Delete, per state in ``ages`` (state -> seconds; 0 or less keeps that state), the
    jobs finished longer ago, in batches of ``batch`` jobs with ``pause`` seconds between
    them; ``dry_run`` only counts. Returns ``{"dry_run", "busy", "removed": {state:
    {"jobs", "events", "outbox"}}, "jobs", "events", "outbox"}``; ``busy`` is True when
    another pruner held the lock (this one then stopped). Database errors propagate."""
    removed: dict[str, dict[str, int]] = {}
    busy = False
    for state, age in ages.items():
        if age <= 0:
            continue
        counts = removed.setdefault(state, dict.fromkeys(_TABLES, 0))
        while True:
            if dry_run:
                row = await store.count_prunable(state, age)
            else:
                row = await store.prune_finished(state, age, batch, PRUNE_LOCK_KEY)
            if not row["locked"]:
                busy = True
                break
            for key, table in _TABLES.items():
                counts[key] += row[key]
                if not dry_run and row[key]:
                    metrics.PRUNED_ROWS.labels(table).inc(row[key])
            if dry_run or row["jobs"] < batch:
                break
            await asyncio.sleep(pause)
        if busy:
            break
    totals = {key: sum(c[key] for c in removed.values()) for key in _TABLES}
    return {"dry_run": dry_run, "busy": busy, "removed": removed, **totals}


async def run_pruner(store: Pruning, settings: Settings, tool: str,
                     period: float = PRUNE_PERIOD_SECONDS) -> None:
    """Prune every ``period`` seconds (the first time 1-5 s after start, at a random
    moment, so sidecars started together do not all try at once) until cancelled; also
    forget idle registrations of sidecars that died (migration 008), per-key rate
    buckets that refilled (migration 016: a missing bucket is a full one) and flow
    changes older than the longest retention. Logs
    ``jobs_pruned`` when something was deleted; a database error is logged
    (``prune_error``) and tried again next period. The periodic service ``pruner``
    (sidecar.ops.periodic)."""
    ages = retention_by_state(settings)

    async def step() -> None:
        await store.forget_dead_idle()
        await store.forget_full_key_buckets()
        if max(ages.values()) > 0:  # flow changes stay as long as the longest-kept jobs
            await store.prune_flow_events(max(ages.values()))
        done = await prune(store, ages, pause=0.05)
        if done["jobs"]:
            log.emit("jobs_pruned", tool=tool, jobs=done["jobs"], events=done["events"],
                     outbox=done["outbox"],
                     by_state={s: c["jobs"] for s, c in done["removed"].items()
                               if c["jobs"]})

    await Periodic("pruner", period, step, first=1.0, jitter=4.0, errors=db.DATABASE_ERRORS,
                   error_event="prune_error", fields={"tool": tool},
                   error_fields=lambda exc: {"reason": db.describe_error(exc),
                                             "sqlstate": db.sqlstate(exc)}).run()
