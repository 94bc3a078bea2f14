"""The one shape of a periodic background service of a sidecar: the pruner
(sidecar.ops.retention), the result forwarder (sidecar.worker.forwarder), the leftover sweep,
the adopted-orphan reaper and the cancel check (sidecar.worker.claim_loop), the event-loop
watch (sidecar.ops.health).

A service runs one step, then waits a period, until it is cancelled. It has a name, a
period (seconds), a first run after a delay plus a random jitter (so sidecars started
together spread out), one error event (the errors it catches are logged under it and
retried at the next period; any other error ends the service, which the Worker takes
as its own failure) and one metric, ``sidecar_service_runs_total{service, result}``
(``result`` ``ok`` or ``error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar.ops import metrics
from sidecar.runtime.log import log

# How much shorter than its period a poll's wait may be drawn (sidecar.worker.claim_loop's claim
# loop, the forwarder): 0.2 = between 0.8 and 1 period.
POLL_SPREAD = 0.2
# The spread of a wait drawn after a pause (spread_after): between 0.1 and 1 period, as a
# claim loop's first poll.
RESYNC_SPREAD = 0.9


def spread_period(period: float, draw: float, spread: float) -> float:
    """A wait of ``period`` seconds shortened by up to ``spread`` of itself:
    ``period * (1 - spread * draw)`` seconds, ``draw`` in [0, 1] (``random.random()``).

    Never longer than ``period``, so every bound stated in periods still holds, and never
    the same twice, so sidecars started together drift apart instead of polling the
    database at the same instant. Issue 28's bench: a fleet of 8 sidecars behind
    PgBouncer, started together and polling every 2 s in step, waited 1.95 s (p50) for
    each job and sent 1.22 claim statements per job, where phases spread over the period
    wait about period / 8. ValueError when ``period`` < 0, ``draw`` or ``spread`` outside
    [0, 1]."""
    if period < 0 or not 0.0 <= draw <= 1.0 or not 0.0 <= spread <= 1.0:
        raise ValueError(f"spread_period({period!r}, {draw!r}, {spread!r}): period >= 0, "
                         "draw and spread in [0, 1]")
    return period * (1.0 - spread * draw)


def spread_after(late_by: float, period: float, spread: float) -> float:
    """The spread of the next wait of a service whose last wait ended ``late_by`` seconds
    later than asked (``period`` seconds, its usual ``spread``): RESYNC_SPREAD when that is
    more than the spread's own width (``spread * period``), else ``spread``.

    A narrow spread keeps phases apart only if they started apart. A pause of the whole
    host (a frozen VM, SIGSTOP, a stalled node) or of the database ends every sidecar's
    wait in the same instant, and draws over 0.8-1 of a period left a fleet of 8 polling
    within 0.2 s of each other (CI of 2026-12-04: 12 empty claims for 3 jobs); a wait that
    ends that late is drawn over RESYNC_SPREAD instead, as at start. A spread of 0 stays 0
    (a service that asked for none). ValueError when ``late_by`` or ``period`` < 0 or
    ``spread`` is outside [0, 1]."""
    if late_by < 0 or period < 0 or not 0.0 <= spread <= 1.0:
        raise ValueError(f"spread_after({late_by!r}, {period!r}, {spread!r}): late_by and "
                         "period >= 0, spread in [0, 1]")
    if spread == 0.0 or late_by <= spread * period:
        return spread
    return max(spread, RESYNC_SPREAD)


def error_reason(exc: BaseException) -> dict[str, Any]:
    """The default fields of a service's error event: ``reason`` = ``Type: message``."""
    return {"reason": f"{type(exc).__name__}: {exc}"}


class Periodic:
    """A periodic service. ``step()`` is awaited once per run; it may return True to be
    run again at once (more work is waiting: the forwarder's full batch), anything else
    to wait ``period`` seconds (a number, or a callable read before each wait).

    ``first``: seconds before the first run (default ``period``; 0 runs at once), plus a
    random 0 to ``jitter`` seconds. ``spread``: each later wait is drawn between
    ``(1 - spread) * period`` and ``period`` (spread_period), so the same service of
    sidecars started together does not run in step; after a wait that ended late by more
    than that width (a pause of the host), over RESYNC_SPREAD (spread_after). ``wake``:
    an event that ends a wait early (cleared before each run). ``errors``: what a step may
    raise and the service survives; each is counted as an ``error`` run and logged as
    ``error_event`` (level ``warning``) with ``fields`` and ``error_fields(exc)`` (default
    ``error_reason``; None logs nothing, the run still counts). Anything else ends ``run``
    with that exception.

    ``lateness`` is how many seconds later than asked the last wait ended (0 for a wait
    a wake-up ended; the event-loop watch reads it)."""

    def __init__(self, name: str, period: float | Callable[[], float],
                 step: Callable[[], Awaitable[Any]], *, first: float | None = None,
                 jitter: float = 0.0, spread: float = 0.0,
                 wake: asyncio.Event | None = None,
                 errors: tuple[type[BaseException], ...] = (Exception,),
                 error_event: str | None = None,
                 error_fields: Callable[[BaseException], dict[str, Any] | None] = error_reason,
                 fields: dict[str, Any] | None = None):
        if errors and error_event is None:
            raise ValueError(f"service {name}: errors it survives need an error event")
        self.name = name
        self._period = period
        self.step = step
        self.first = first
        self.jitter = jitter
        self.spread = spread
        self.wake = wake
        self.errors = errors
        self.error_event = error_event
        self.error_fields = error_fields
        self.fields = fields or {}
        self.lateness = 0.0

    @property
    def period(self) -> float:
        """The wait between runs, seconds."""
        return self._period() if callable(self._period) else self._period

    async def run(self) -> None:
        """Run until cancelled (or until a step raises what ``errors`` does not hold)."""
        first = self.period if self.first is None else self.first
        if self.jitter:
            first += random.uniform(0.0, self.jitter)
        if first > 0:
            await self._wait(first)
        while True:
            if self.wake is not None:
                self.wake.clear()
            if await self.run_once():
                continue
            period = self.period
            spread = spread_after(self.lateness, period, self.spread)
            await self._wait(spread_period(period, random.random(), spread)
                             if spread else period)

    async def run_once(self) -> bool:
        """One run of the step, counted and, on an error it survives, logged. Returns
        True when the step asked to run again at once."""
        try:
            more = await self.step()
        except self.errors as exc:
            metrics.SERVICE_RUNS.labels(self.name, "error").inc()
            fields = self.error_fields(exc)
            if fields is not None:
                log.emit(self.error_event, "warning", **self.fields, **fields)
            return False
        except asyncio.CancelledError:
            raise
        except BaseException:
            metrics.SERVICE_RUNS.labels(self.name, "error").inc()
            raise
        metrics.SERVICE_RUNS.labels(self.name, "ok").inc()
        return more is True

    async def _wait(self, seconds: float) -> None:
        before = time.monotonic()
        if self.wake is None:
            await asyncio.sleep(seconds)
        else:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation
            # that meets the wake-up or the timeout, and the service then never stops.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await self.wake.wait()
            if self.wake.is_set():
                self.lateness = 0.0  # ended early by its wake-up, not late
                return
        self.lateness = max(0.0, time.monotonic() - before - seconds)
