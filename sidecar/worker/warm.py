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

Agent sessions (issue 43, point 3; docs/callers.md "Sessions"): a process started for a
call of a session is bound to that ``Session`` and serves only its calls, never the idle
list; it keeps its state between them. It ends with its session: ``SESSION_IDLE_SECONDS``
without a call, ``SESSION_MAX_SECONDS`` of age, shutdown (the session ``ended``), or any
end of the process but those (the session ``lost``: its state is gone, and a later call
of it fails ``session_lost``). A session whose lease this sidecar lost (``lose_session``)
has its process stopped without a write: the session is no longer ours.
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


# Why a session's process stops that ends the session in order (state ``ended``); any
# other reason means its state is gone unasked (``lost``).
SESSION_ENDINGS = frozenset({"idle", "shutdown", "session_max_seconds", "max_jobs",
                             "max_seconds"})


@dataclass
class Session:
    """One agent session this sidecar holds (issue 43): its ``tool`` and ``key``, its
    ``generation`` (the session's fencing token, tool_sessions.generation), its warm
    ``process`` (None until its first call's process has started), whether a call of it
    runs now (``busy``), when it started and was last used (``started``, ``last_used``:
    monotonic s) and until when its lease is known to hold (``confirmed_until``: monotonic
    s, the lease less the safety margin, from the start of the statement that set it)."""

    tool: str
    key: str
    generation: int
    confirmed_until: float
    process: WarmProcess | None = None
    busy: bool = False
    started: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)

    def held(self) -> tuple[str, str, int]:
        """``(tool, key, generation)``: what the heartbeat renews."""
        return self.tool, self.key, self.generation


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
    # The agent session it serves (issue 43), None for a process of the idle list.
    session: Session | None = None
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
                 stop: Callable[[WarmProcess, str], Awaitable[None]],
                 end_session: Callable[[Session, str, str], Awaitable[None]] | None = None,
                 begin_session: Callable[[str, str], Awaitable[tuple[str, int, str | None]]]
                 | None = None,
                 queued_call: Callable[[str, str], Awaitable[bool]] | None = None,
                 drain: bool = False):
        """``end_session(session, state, reason)``: write a session's end (state ``ended``
        or ``lost``), fenced by owner and generation; it must not raise.
        ``begin_session(tool, key)``: what a call of that session just claimed here runs
        in, ``(status, generation, end_reason)`` (WorkerStore.session_begin with this
        sidecar's owner, lease and SESSION_RESTART); raises what the store raises.
        ``queued_call(tool, key)``: whether a call of that session waits in the queue (an
        idle session with one does not end; raises what the store raises). ``drain``: the
        sidecar drains (``--drain``): a session with no call waiting gives its place up to
        a new one at MAX_SESSIONS."""
        self.profile = profile
        self._queued_call = queued_call
        self.drain = drain
        # Sessions being opened now (their first call awaits the database): counted
        # against MAX_SESSIONS with the ones held.
        self.opening = 0
        self._make = make
        self._stop = stop
        self._end_session = end_session
        self._begin_session = begin_session
        # The agent sessions this sidecar holds, by key (issue 43).
        self.sessions: dict[str, Session] = {}
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
        """After a job it answered: keep ``process`` idle for the next job (a session's:
        for its session's next call), or retire it when it is spent
        (MAX_JOBS_PER_PROCESS, MAX_PROCESS_SECONDS; a session's SESSION_MAX_SECONDS too),
        exited, or the pool is closed."""
        reason = self._unfit(process) or ("shutdown" if self._closed else None)
        session = process.session
        if reason is None and session is not None:
            reason = self._session_over(session, time.monotonic(), idle_too=False)
        if reason is not None:
            self.retire(process, reason)
            return
        process.relay = None
        process.last_used = time.monotonic()
        if session is not None:
            session.busy = False
            session.last_used = process.last_used
            return
        self._idle.append(process)

    # --- agent sessions (issue 43) ------------------------------------------------

    async def begin_session(self, tool: str, key: str) -> tuple[str, int, str | None]:
        """The database's word on session ``key`` for a call just claimed here:
        ``(status, generation, end_reason)`` (functions/sessions.sql). Raises what the
        store raises."""
        if self._begin_session is None:
            raise RuntimeError("this pool serves no sessions")
        return await self._begin_session(tool, key)

    async def end_session_row(self, tool: str, key: str, generation: int, state: str,
                              reason: str) -> None:
        """Write the end of session ``key`` at ``generation`` that no Session here holds
        (its process is gone); never raises."""
        await self._end_logged(Session(tool, key, generation, 0.0), state, reason)

    def open_session(self, tool: str, key: str, generation: int,
                     confirmed_until: float) -> Session:
        """Hold session ``key`` at ``generation`` (started or restarted here just now), busy
        with the call that started it; a process of an older generation still held here
        is retired (its session was lost)."""
        old = self.sessions.pop(key, None)
        if old is not None and old.process is not None:
            self.retire(old.process, "session_replaced", write=False)
        session = Session(tool, key, generation, confirmed_until, busy=True)
        self.sessions[key] = session
        return session

    def continue_session(self, key: str, generation: int,
                         confirmed_until: float) -> Session | None:
        """Session ``key`` at ``generation`` held here with a process that may serve its
        next call, now busy with it; None when it is not held here or its process is
        gone (the caller ends it lost)."""
        session = self.sessions.get(key)
        if session is None or session.generation != generation or session.busy:
            return None
        process = session.process
        if process is None or process.retired or self._unfit(process) is not None:
            return None
        session.busy = True
        session.confirmed_until = max(session.confirmed_until, confirmed_until)
        return session

    def bind(self, process: WarmProcess, session: Session) -> None:
        """``process`` (just started) serves ``session`` from now on."""
        process.session = session
        session.process = process

    def drop_session(self, session: Session, state: str, reason: str) -> None:
        """End ``session`` here: no process of it serves again; its end (``state``
        ``ended`` or ``lost``) is written in the pool's own task, after which its
        process, if any, is stopped."""
        if self.sessions.get(session.key) is session:
            del self.sessions[session.key]
        process = session.process
        if process is not None and not process.retired:
            self.retire(process, reason, state=state)
            return
        self._spawn(self._end_logged(session, state, reason))

    def lose_session(self, key: str, reason: str) -> None:
        """This sidecar no longer holds session ``key`` (its lease was not renewed, or ran
        out here): its process is stopped, and nothing is written (the session is not
        ours to end)."""
        session = self.sessions.pop(key, None)
        if session is not None and session.process is not None:
            self.retire(session.process, reason, write=False)

    async def call_waits(self, session: Session) -> bool:
        """Whether a call of ``session`` waits in the queue (True when that cannot be
        told: a session is never ended on a guess)."""
        if self._queued_call is None:
            return False
        try:
            return await self._queued_call(session.tool, session.key)
        except Exception:  # noqa: BLE001 - unknown: keep the session
            return True

    def room(self) -> bool:
        """Whether one more session may open here (MAX_SESSIONS, those opening counted)."""
        return len(self.sessions) + self.opening < self.profile.max_sessions

    async def free_a_place(self) -> bool:
        """When draining: end the idle session used longest ago that has no call waiting
        (``drained``), so a new session's call can run; True when a place was freed."""
        if not self.drain:
            return False
        for session in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if not session.busy and not await self.call_waits(session) \
                    and self.sessions.get(session.key) is session and not session.busy:
                self.drop_session(session, "ended", "drained")
                return True
        return False

    def held_sessions(self) -> list[Session]:
        """The sessions held here (the heartbeat renews their leases)."""
        return list(self.sessions.values())

    def _session_over(self, session: Session, now: float, idle_too: bool) -> str | None:
        if self.profile.session_max_seconds \
                and now - session.started >= self.profile.session_max_seconds:
            return "session_max_seconds"
        if idle_too and now - session.last_used >= self.profile.session_idle_seconds:
            return "idle"
        return None

    async def _end_logged(self, session: Session, state: str, reason: str) -> None:
        if self._end_session is not None:
            with contextlib.suppress(Exception):
                await self._end_session(session, state, reason)

    def _unfit(self, process: WarmProcess) -> str | None:
        if process.child is None or process.child.exited.done():
            return "exited"
        if mounts_moved(process.mounts):
            return "sandbox_moved"
        return process.spent(self.profile)

    def retire(self, process: WarmProcess, reason: str, *, state: str | None = None,
               write: bool = True) -> None:
        """Stop ``process`` (not idle: the caller held it) in a task the pool keeps and
        ``close`` waits for. A session's process ends its session first: ``state`` (by
        default ``ended`` for the SESSION_ENDINGS reasons, else ``lost``) is written
        unless ``write`` is False (a session no longer ours)."""
        if process.retired:
            return
        process.retired = True
        process.relay = None
        session = process.session
        end = None
        if session is not None:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            if write:
                end = (session, state or ("ended" if reason in SESSION_ENDINGS else "lost"),
                       reason)
        self._spawn(self._stop_logged(process, reason, end))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _stop_logged(self, process: WarmProcess, reason: str,
                           end: tuple[Session, str, str] | None = None) -> None:
        # The session's end first: no call of it is handed to this process meanwhile.
        if end is not None:
            await self._end_logged(*end)
        # stop_warm_process logs what it could not remove; one stop that raised must
        # not end the loop or the close that stops the others
        with contextlib.suppress(Exception):
            await self._stop(process, reason)

    async def run_idle(self) -> None:
        """Retire, every few seconds (at most 5, at least 0.1 apart), the processes idle
        for WARM_IDLE_SECONDS, spent, or gone, and end the sessions with no call for
        SESSION_IDLE_SECONDS (unless a call of it waits in the queue) or older than
        SESSION_MAX_SECONDS (runs until cancelled)."""
        period = max(MIN_IDLE_CHECK_SECONDS,
                     min(IDLE_CHECK_SECONDS, self.profile.warm_idle_seconds / 2,
                         self.profile.session_idle_seconds / 2))
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
            for session in list(self.sessions.values()):
                if session.busy:
                    continue
                reason = self._session_over(session, now, idle_too=True)
                if reason is None and session.process is not None:
                    reason = self._unfit(session.process)
                # Idle here, but its next call waits in the queue (this sidecar's slots
                # were busy): the agent called in time, so the session stays.
                if reason == "idle" and await self.call_waits(session):
                    continue
                if reason is not None and self.sessions.get(session.key) is session \
                        and not session.busy:
                    self.drop_session(session, "ended" if reason in SESSION_ENDINGS
                                      else "lost", reason)

    async def close(self) -> None:
        """Take no process back from now on, stop every idle one (all at once; the
        sessions not running a call end, ``shutdown``) and wait for every stop under way,
        those begun before included."""
        self._closed = True
        idle, self._idle = self._idle, []
        for process in idle:
            self.retire(process, "shutdown")
        for session in list(self.sessions.values()):
            if not session.busy:
                self.drop_session(session, "ended", "shutdown")
        while self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)
