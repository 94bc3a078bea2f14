"""Warm tool processes (issue 43; docs/child-process.md, "Warm mode").

Under ``PROCESS=warm`` one tool process, started in its own sandbox and job cgroup like a
per-job attempt, serves consecutive jobs of one slot: one request line per job on its
stdin, one response line on its stdout (sidecar.protocol.warm). Each job is still
claimed, leased, heartbeated, bounded by its stage deadline, fenced and journaled on its
own (sidecar.worker.supervisor); what a warm process changes is only that the next job
does not pay for a tool start.

A ``WarmPool`` keeps the idle ones of a sidecar (at most one per slot: a job takes one or
starts one, and gives it back when it answered). A process is never given back after a
job that did not answer: a stage deadline, a lost lease, a cancel, shutdown, an exit, an
overflowing or unsolicited line kill its whole tree (the supervisor does), and the next
job gets a fresh one. ``MAX_JOBS_PER_PROCESS`` and ``MAX_PROCESS_SECONDS`` replace a
process when its job ends; ``WARM_IDLE_SECONDS`` stops one no job took for that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sidecar.protocol.model import LeaseProfile
from sidecar.worker import safefs
from sidecar.worker.child import Child
from sidecar.worker.isolation import Sandbox

# The variable a warm process starts with, besides the attempt's static ones: its own id,
# which marks every process of its tree for the tree kill as SIDECAR_JOB_ID marks a
# per-job tool's (and tells a tool that serves both modes which one it is in).
PROCESS_ID_VARIABLE = "SIDECAR_PROCESS_ID"
# How often idle processes are looked at, at most (s): WARM_IDLE_SECONDS / 2 if shorter.
IDLE_CHECK_SECONDS = 5.0


@dataclass
class WarmProcess:
    """One warm tool process: its ``sandbox`` (work directory, job cgroup), its
    ``child`` in line mode, its ``process_id`` (SIDECAR_PROCESS_ID), when it started
    (``started``, monotonic s), how many jobs it answered (``jobs``) and when it was last
    given back (``last_used``). ``relay``: where its stderr lines go while a job runs
    (the job's relay), else they are counted in ``idle_stderr_lines``."""

    serial: int
    sandbox: Sandbox
    process_id: str
    started: float = field(default_factory=time.monotonic)
    child: Child | None = None
    jobs: int = 0
    last_used: float = field(default_factory=time.monotonic)
    relay: Callable[[bytes], None] | None = None
    idle_stderr_lines: int = 0
    _sockets: int = 0

    def on_stderr_line(self, line: bytes) -> None:
        """The process's stderr, line by line: to the running job's relay."""
        if self.relay is not None:
            self.relay(line)
        else:
            self.idle_stderr_lines += 1

    def spent(self, profile: LeaseProfile, now: float | None = None) -> str | None:
        """Why this process may serve no further job (``max_jobs``, ``max_seconds``), or
        None."""
        now = time.monotonic() if now is None else now
        if profile.max_jobs_per_process and self.jobs >= profile.max_jobs_per_process:
            return "max_jobs"
        if profile.max_process_seconds and now - self.started >= profile.max_process_seconds:
            return "max_seconds"
        return None

    def guard_socket(self) -> tuple[str, object]:
        """A new listening guard socket for the next job, in the process's work directory
        (bound into its sandbox), under a name of its own: ``(path, socket)``. Made
        through the directory's descriptor (safefs.listen_unix: no link followed, no name
        reused). Raises OSError."""
        self._sockets += 1
        name = f"guard-{self._sockets}.sock"
        listener = safefs.listen_unix(self.sandbox.dir_lock, name, self.sandbox.ids)
        return os.path.join(self.sandbox.job_dir, name), listener

    def forget_socket(self, path: str) -> None:
        """Remove a job's guard socket name (the guard closed the socket itself)."""
        if self.sandbox.dir_lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.basename(path), dir_fd=self.sandbox.dir_lock)


class WarmPool:
    """The idle warm processes of one sidecar (``profile``'s tool).

    ``make(serial, process_id)`` starts one (async; raises what starting a tool raises);
    ``stop(process, reason)`` ends one (async: its tree killed, its work directory and
    cgroup removed). ``take`` hands out the idle process used last (its caches warmest)
    or None; ``give_back`` keeps it idle, or stops it when it is spent; ``run_idle``
    stops the ones idle for WARM_IDLE_SECONDS; ``close`` stops every idle one."""

    def __init__(self, profile: LeaseProfile,
                 make: Callable[[int, str], Awaitable[WarmProcess]],
                 stop: Callable[[WarmProcess, str], Awaitable[None]]):
        self.profile = profile
        self._make = make
        self._stop = stop
        self._idle: list[WarmProcess] = []
        self._serial = itertools.count(1)
        self._closed = False
        self.started = 0

    def __len__(self) -> int:
        return len(self._idle)

    def take(self) -> WarmProcess | None:
        """The idle process given back last, or None (start one with ``start``)."""
        return self._idle.pop() if self._idle else None

    async def start(self) -> WarmProcess:
        """A new warm process (``make``), not yet serving. Raises what ``make`` raises."""
        process = await self._make(next(self._serial), uuid.uuid4().hex)
        self.started += 1
        return process

    async def give_back(self, process: WarmProcess) -> None:
        """After a job it answered: keep ``process`` idle for the next job, or stop it
        when it is spent (MAX_JOBS_PER_PROCESS, MAX_PROCESS_SECONDS), exited, or the pool
        is closed."""
        reason = process.spent(self.profile)
        if reason is None and (process.child is None or process.child.exited.done()):
            reason = "exited"
        if reason is None and self._closed:
            reason = "shutdown"
        if reason is not None:
            await self._stop(process, reason)
            return
        process.relay = None
        process.last_used = time.monotonic()
        self._idle.append(process)

    async def stop(self, process: WarmProcess, reason: str) -> None:
        """End ``process`` (not idle: the caller holds it)."""
        await self._stop(process, reason)

    async def run_idle(self) -> None:
        """Stop, every few seconds, the processes idle for WARM_IDLE_SECONDS or gone
        (runs until cancelled)."""
        period = min(IDLE_CHECK_SECONDS, self.profile.warm_idle_seconds / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for process in list(self._idle):
                gone = process.child is None or process.child.exited.done()
                idle = now - process.last_used >= self.profile.warm_idle_seconds
                if (gone or idle) and process in self._idle:
                    self._idle.remove(process)
                    # stop_warm_process logs what it could not remove; a stop that
                    # raised must not end the loop that stops the others
                    with contextlib.suppress(Exception):
                        await self._stop(process, "exited" if gone else "idle")

    async def close(self) -> None:
        """Take no process back from now on and stop every idle one."""
        self._closed = True
        idle, self._idle = self._idle, []
        for process in idle:
            with contextlib.suppress(Exception):
                await self._stop(process, "shutdown")
