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
from sidecar.worker.isolation import MountIdentities, Sandbox, mounts_moved

# The variable a warm process starts with, besides the attempt's static ones: its own id,
# which marks every process of its tree for the tree kill as SIDECAR_JOB_ID marks a
# per-job tool's (and tells a tool that serves both modes which one it is in).
PROCESS_ID_VARIABLE = "SIDECAR_PROCESS_ID"
# How often idle processes are looked at (s): WARM_IDLE_SECONDS / 2, within these bounds
# (a tiny WARM_IDLE_SECONDS must not make an idle sidecar spin).
IDLE_CHECK_SECONDS = 5.0
MIN_IDLE_CHECK_SECONDS = 0.1


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
    # Set when the pool is told to stop it: no job takes it, nothing more is done in its
    # work directory (its removal is under way).
    retired: bool = False
    # mount_identities of its sandbox's mounted paths at its start: a process whose
    # sandbox would now differ from a fresh one serves no further job (mounts_moved).
    mounts: MountIdentities = ()
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
        """Remove a job's guard socket name (the guard closed the socket itself); once the
        process is retired its whole directory goes instead."""
        if not self.retired and self.sandbox.dir_lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.basename(path), dir_fd=self.sandbox.dir_lock)


class WarmPool:
    """The idle warm processes of one sidecar (``profile``'s tool).

    ``make(serial, process_id)`` starts one (async; raises what starting a tool raises);
    ``stop(process, reason)`` ends one (async: its tree killed, its work directory and
    cgroup removed). ``take`` hands out the idle process used last (its caches warmest)
    or None; ``give_back`` keeps it idle, or retires it when it is spent; ``retire``
    stops one in a task of the pool's own, so no job waits for a stop (its kill grace)
    and a cancelled caller never leaves one half stopped; ``run_idle`` retires the ones
    idle for WARM_IDLE_SECONDS; ``close`` stops every idle one at once and waits for
    every stop under way."""

    def __init__(self, profile: LeaseProfile,
                 make: Callable[[int, str], Awaitable[WarmProcess]],
                 stop: Callable[[WarmProcess, str], Awaitable[None]]):
        self.profile = profile
        self._make = make
        self._stop = stop
        self._idle: list[WarmProcess] = []
        self._stopping: set[asyncio.Task] = set()
        self._serial = itertools.count(1)
        self._closed = False
        self.started = 0

    def __len__(self) -> int:
        return len(self._idle)

    def take(self) -> WarmProcess | None:
        """The idle process given back last that may still serve (spent ones found on the
        way are retired), or None (start one with ``start``)."""
        while self._idle:
            process = self._idle.pop()
            reason = self._unfit(process)
            if reason is None:
                return process
            self.retire(process, reason)
        return None

    async def start(self) -> WarmProcess:
        """A new warm process (``make``), not yet serving. Raises what ``make`` raises."""
        process = await self._make(next(self._serial), uuid.uuid4().hex)
        self.started += 1
        return process

    def give_back(self, process: WarmProcess) -> None:
        """After a job it answered: keep ``process`` idle for the next job, or retire it
        when it is spent (MAX_JOBS_PER_PROCESS, MAX_PROCESS_SECONDS), exited, or the pool
        is closed."""
        reason = self._unfit(process) or ("shutdown" if self._closed else None)
        if reason is not None:
            self.retire(process, reason)
            return
        process.relay = None
        process.last_used = time.monotonic()
        self._idle.append(process)

    def _unfit(self, process: WarmProcess) -> str | None:
        if process.child is None or process.child.exited.done():
            return "exited"
        if mounts_moved(process.mounts):
            return "sandbox_moved"
        return process.spent(self.profile)

    def retire(self, process: WarmProcess, reason: str) -> None:
        """Stop ``process`` (not idle: the caller held it) in a task the pool keeps and
        ``close`` waits for."""
        if process.retired:
            return
        process.retired = True
        process.relay = None
        task = asyncio.ensure_future(self._stop_logged(process, reason))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _stop_logged(self, process: WarmProcess, reason: str) -> None:
        # stop_warm_process logs what it could not remove; one stop that raised must
        # not end the loop or the close that stops the others
        with contextlib.suppress(Exception):
            await self._stop(process, reason)

    async def run_idle(self) -> None:
        """Retire, every few seconds (at most 5, at least 0.1 apart), the processes idle
        for WARM_IDLE_SECONDS, spent, or gone (runs until cancelled)."""
        period = max(MIN_IDLE_CHECK_SECONDS,
                     min(IDLE_CHECK_SECONDS, self.profile.warm_idle_seconds / 2))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for process in list(self._idle):
                reason = self._unfit(process)
                if reason is None and now - process.last_used >= self.profile.warm_idle_seconds:
                    reason = "idle"
                if reason is not None:
                    self._idle.remove(process)
                    self.retire(process, reason)

    async def close(self) -> None:
        """Take no process back from now on, stop every idle one (all at once) and wait
        for every stop under way, those begun before included."""
        self._closed = True
        idle, self._idle = self._idle, []
        for process in idle:
            self.retire(process, "shutdown")
        while self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)
