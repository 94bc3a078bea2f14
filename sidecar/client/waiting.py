"""Waiting for jobs to end, without polling (issue 26): the caller's half of a tool call.

Every statement that makes a job terminal sends one NOTIFY on that job's own channel,
``job_channel(id)`` (``sidecar_job_`` and the id's 32 hex digits), with the payload
``{"id", "state"}``; a progress report sends ``{"id", "state": "running", "progress":
{value, message, at, attempt}}`` on the same channel (migration 015; docs/callers.md). A
waiter therefore hears only the jobs it waits for, and a rolled-back end (the NOTIFY leaves
at commit) wakes nobody.

``watch`` is the reusable part: on one asyncpg connection it LISTENs on each job's channel
first, then reads the rows (so an end committed in between is in what it reads, never
lost), then waits for notifications and reads again only the jobs that ended. Behind a
transaction pooler (``listen=False``) there is no session to LISTEN in: it reads the
unfinished jobs again every ``poll_seconds`` (POLL_SECONDS, 1 s) instead, unless a session
elsewhere is given for it (SIDECAR_LISTEN_DATABASE_URL: ``db.listen_target``).

``WaitHub`` is what every waiter of a process uses (sidecar.client.Client, the MCP
gateway, ``sidecar wait``; issue 41): ONE LISTEN connection for all its waiters, reads
batched through the pool, so waiting costs the pool's connections + 1 whatever the number
of waiters; and, while a waited job is queued, why it waits (JobWaiting, from the SQL
function tool_job_wait_reasons), asked for all of them in one statement every
REASON_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from sidecar.protocol.errors import SidecarError
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import FINISHED_STATES, JobState
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore

# Behind a transaction pooler (no LISTEN): how often the unfinished jobs are read again.
POLL_SECONDS = 1.0
# With LISTEN: how long the waiter stays without reading anything. The jobs are read again
# then, which also proves the connection alive (a silently dropped path is noticed).
CHECK_SECONDS = 30.0
# ``follow``: the pause before connecting again after the waiter's connection failed.
RECONNECT_SECONDS = 1.0
_FINISHED = frozenset(state.value for state in FINISHED_STATES)


def job_channel(job_id: uuid.UUID | str) -> str:
    """The NOTIFY channel of one job: ``sidecar_job_`` and its 32 lower-case hex digits,
    an identifier that needs no quoting (``LISTEN sidecar_job_...``); the SQL function
    ``tool_job_channel(id)`` gives the same."""
    return "sidecar_job_" + uuid.UUID(str(job_id)).hex


class JobNotFound(SidecarError):
    """A job waited for does not exist (never enqueued, or pruned): exit 1."""


@dataclass(frozen=True)
class JobEnd:
    """A job waited for is finished: ``state`` succeeded, failed or cancelled, with its
    ``result`` (succeeded) or ``error``, and the ``attempt`` that ended it."""

    id: uuid.UUID
    state: str
    attempt: int
    result: Any = None
    error: Any = None

    @property
    def succeeded(self) -> bool:
        return self.state == JobState.SUCCEEDED

    def as_json(self) -> dict[str, Any]:
        """``{"id", "state", "result" | "error", "attempt"}``: what ``sidecar wait`` prints."""
        out: dict[str, Any] = {"id": str(self.id), "state": self.state}
        if self.succeeded:
            out["result"] = self.result
        else:
            out["error"] = self.error
        out["attempt"] = self.attempt
        return out


@dataclass(frozen=True)
class JobProgress:
    """The latest progress a running job's tool reported: ``value`` (0..1 or None),
    ``message`` (or None), ``at`` (the database's time, ISO 8601 text) and ``attempt``.
    Or, with ``waiting`` set, why the job still waits in the queue (a reason of
    WAIT_REASONS: ``no_live_sidecar``, ``paused``, ...; ``message`` says it in one line;
    ``value``, ``at`` and ``attempt`` None): JobWaiting.as_progress."""

    id: uuid.UUID
    value: float | None
    message: str | None
    at: str | None
    attempt: int | None
    waiting: str | None = None

    @classmethod
    def of(cls, job_id: uuid.UUID, progress: dict[str, Any]) -> JobProgress:
        at = progress.get("at")
        return cls(job_id, progress.get("value"), progress.get("message"),
                   at.isoformat() if isinstance(at, dt.datetime) else at,
                   progress.get("attempt"))

    def as_json(self) -> dict[str, Any]:
        """``{"id", "progress", "message", "at", "attempt"}`` (and ``"waiting"``, the
        reason, when it says why the job waits): what ``wait --progress`` prints on
        stderr."""
        out = {"id": str(self.id), "progress": self.value, "message": self.message,
               "at": self.at, "attempt": self.attempt}
        if self.waiting is not None:
            out["waiting"] = self.waiting
        return out


async def watch(conn: asyncpg.Connection, job_ids: Iterable[uuid.UUID], *,
                listen: bool = True, poll_seconds: float = POLL_SECONDS,
                check_seconds: float = CHECK_SECONDS, statement_timeout: float = 10.0,
                ) -> AsyncIterator[JobEnd | JobProgress]:
    """Yield each job's progress reports (``JobProgress``, the latest one first if it has
    one) and its end (``JobEnd``), until every job of ``job_ids`` has ended; jobs already
    finished end at once, in the order given.

    ``conn``: a connection of its own (sidecar.storage.db.connect), not a pooled one: with
    ``listen`` it LISTENs there (and UNLISTENs each job once it ended). ``listen=False``
    (behind a transaction pooler) reads the unfinished jobs every ``poll_seconds``
    instead. With ``listen``, the jobs are also read after ``check_seconds`` without a
    notification. Each statement is bounded by ``statement_timeout`` seconds.

    Raises JobNotFound when a job does not exist (before anything is yielded) or is
    deleted while waited for (at the next read: within ``check_seconds`` or
    ``poll_seconds``), and what
    the connection raises when it fails (the caller connects again and calls ``watch``
    with the jobs not yet ended: nothing is lost, the first read comes after LISTEN)."""
    pending = list(dict.fromkeys(uuid.UUID(str(job_id)) for job_id in job_ids))
    heard: asyncio.Queue[str | None] = asyncio.Queue()

    def on_notify(_conn, _pid, _channel, payload: str) -> None:
        heard.put_nowait(payload)

    def on_close(_conn) -> None:
        heard.put_nowait(None)

    listening: dict[uuid.UUID, str] = {}
    seen_at: dict[uuid.UUID, Any] = {}
    # When a read would settle a pending job as expired (loop time; issue 41): the
    # waiter reads again then, so a job that expires while every sidecar is down ends.
    settle_at: dict[uuid.UUID, float] = {}
    loop = asyncio.get_running_loop()
    if listen:
        conn.add_termination_listener(on_close)
    try:
        if listen:
            # LISTEN and UNLISTEN are round trips like any statement: each is bounded, so
            # a path that went silent ends in TimeoutError (follow connects again), never
            # in a wait without end.
            async with asyncio.timeout(statement_timeout):
                for job_id in pending:
                    listening[job_id] = job_channel(job_id)
                    await conn.add_listener(listening[job_id], on_notify)
        rows = await _read(conn, pending, statement_timeout)
        while True:
            by_id = {row["id"]: row for row in rows}
            for job_id in [j for j in pending if j in by_id]:
                row = by_id[job_id]
                if row.get("settle_in_s") is not None:
                    settle_at[job_id] = loop.time() + row["settle_in_s"]
                progress = row["progress"]
                if row["state"] not in _FINISHED and isinstance(progress, dict) \
                        and progress.get("at") != seen_at.get(job_id):
                    seen_at[job_id] = progress.get("at")
                    yield JobProgress.of(job_id, progress)
                if row["state"] in _FINISHED:
                    pending.remove(job_id)
                    settle_at.pop(job_id, None)
                    channel = listening.pop(job_id, None)
                    if channel is not None and not conn.is_closed():
                        async with asyncio.timeout(statement_timeout):
                            await conn.remove_listener(channel, on_notify)
                    yield JobEnd(job_id, row["state"], row["attempt"], row["result"],
                                 row["error"])
            if not pending:
                return
            if not listen:
                await asyncio.sleep(poll_seconds)
                rows = await _read(conn, pending, statement_timeout)
                continue
            ended: list[uuid.UUID] = []
            check = check_seconds if not settle_at else min(check_seconds, max(
                POLL_SECONDS, min(settle_at.values()) - loop.time() + 0.05))
            async for note in _notifications(heard, check):
                if note is None:  # no notification for check_seconds: read them all
                    ended = list(pending)
                    break
                job_id, state, progress = note
                if job_id not in pending:
                    continue
                if state in _FINISHED:
                    ended.append(job_id)
                elif isinstance(progress, dict) and progress.get("at") != seen_at.get(job_id):
                    seen_at[job_id] = progress.get("at")
                    yield JobProgress.of(job_id, progress)
            if conn.is_closed():
                raise asyncpg.InterfaceError("the waiter's connection was closed")
            rows = await _read(conn, ended, statement_timeout) if ended else []
    finally:
        if listen:
            conn.remove_termination_listener(on_close)
            if listening and not conn.is_closed():
                # Bounded: after a failure the path may be silent (the caller terminates
                # the connection next; the server forgets its LISTENs with it).
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(statement_timeout):
                        for channel in listening.values():
                            await conn.remove_listener(channel, on_notify)


async def _read(conn: asyncpg.Connection, job_ids: list[uuid.UUID],
                timeout: float) -> list[asyncpg.Record]:
    """The rows of ``job_ids``; raises JobNotFound for one that does not exist (never
    enqueued, or deleted while waited for: pruned, or removed by hand)."""
    rows = await CallerStore.jobs_to_wait_for(conn, job_ids, timeout)
    missing = set(job_ids) - {row["id"] for row in rows}
    if missing:
        raise JobNotFound("no job " + ", ".join(str(j) for j in job_ids if j in missing))
    return rows


async def _notifications(heard: asyncio.Queue, check_seconds: float
                         ) -> AsyncIterator[tuple[uuid.UUID, str, Any] | None]:
    """The notifications heard: the first one waited for (at most ``check_seconds``; then
    one None), then every one already queued. A notification that is not ours in shape is
    skipped; a closed connection (None queued by the termination listener) ends it with a
    None."""
    try:
        async with asyncio.timeout(check_seconds):  # not wait_for: it can lose a cancel (3.11)
            first = await heard.get()
    except TimeoutError:
        yield None
        return
    payloads = [first]
    while not heard.empty():
        payloads.append(heard.get_nowait())
    for payload in payloads:
        if payload is None:
            yield None
            return
        try:
            note = orjson.loads(payload)
            # scrubbed as the rows a waiter reads are (CallerStore.jobs_to_wait_for)
            yield uuid.UUID(note["id"]), note["state"], SECRETS.scrub_value(
                note.get("progress"))
        except (ValueError, KeyError, TypeError):
            continue


# --- the hub: every waiter of a process on one LISTEN connection (issue 41, point 14) ----

# How many jobs one read of the hub asks for at most (one statement through the pool).
READ_BATCH = 500
# While a waited job is queued: how often the hub asks why (one statement for all of them),
# once it has been queued for REASON_GRACE_SECONDS (most jobs are claimed well before: no
# reason to tell then).
REASON_SECONDS = 2.0
REASON_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class JobWaiting:
    """Why a queued job waits, as the database sees it (``tool_job_wait_reasons``,
    sidecar/storage/sql/functions/waiting.sql): ``reason`` one of WAIT_REASONS, ``ahead``
    (queued jobs of its tool claimed before it, counted up to 10,000), ``detail`` (the
    pause's reason, the time a schedule or a key's turn comes, or None) and ``message``,
    one line for a person. Yielded again only when the reason (or ``ahead``) changes."""

    id: uuid.UUID
    reason: str
    ahead: int
    detail: str | None
    message: str

    def as_progress(self) -> JobProgress:
        """The reason as a JobProgress (``value`` None, ``message`` this one, ``waiting``
        the reason): what ``Client.progress``, ``wait --progress`` and MCP progress
        notifications carry."""
        return JobProgress(self.id, None, self.message, None, None, waiting=self.reason)


# The reasons tool_job_wait_reasons gives, and their one line.
WAIT_REASONS = {
    "scheduled": "scheduled: not to run before {detail}",
    "paused": "paused: the tool's flow is paused ({detail})",
    "no_live_sidecar": "no live sidecar: no sidecar of the tool has been seen for two "
                       "minutes; the job starts when one runs",
    "max_running": "at the tool's limit: max_running jobs are running",
    "rate": "rate-limited: the tool's rate lets the next job start later",
    "max_running_per_key": "waiting for its key's slot: max_running_per_key jobs of its "
                           "concurrency key are running",
    "rate_per_key": "waiting for its key's turn: its concurrency key's rate lets it "
                    "start later",
    "queued_behind": "queued behind {ahead} job(s) of its tool",
}


def waiting_message(reason: str, ahead: int, detail: str | None) -> str:
    """The one line of a wait reason (WAIT_REASONS), ``ahead`` appended when other jobs
    are queued before it."""
    text = WAIT_REASONS.get(reason, reason).format(detail=detail or "no reason given",
                                                   ahead=ahead)
    if reason != "queued_behind" and ahead:
        text += f"; {ahead} job(s) queued before it"
    return text


class _Waiter:
    """One subscription to the hub: the jobs it waits for, in order, and what the hub
    hands it (rows read, progress heard, reasons found), turned into events."""

    def __init__(self, job_ids: list[uuid.UUID], reasons: bool):
        self.pending = job_ids
        self.reasons = reasons
        self.inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.seen_at: dict[uuid.UUID, Any] = {}
        self.reason: dict[uuid.UUID, tuple[str, int]] = {}

    def _progress(self, job_id: uuid.UUID, progress: Any) -> JobProgress | None:
        if isinstance(progress, dict) and progress.get("at") != self.seen_at.get(job_id):
            self.seen_at[job_id] = progress.get("at")
            return JobProgress.of(job_id, progress)
        return None

    async def events(self) -> AsyncIterator[JobEnd | JobProgress | JobWaiting]:
        while self.pending:
            kind, value = await self.inbox.get()
            if kind == "missing":
                missing = [j for j in self.pending if j in value]
                if missing:
                    raise JobNotFound("no job " + ", ".join(str(j) for j in missing))
            elif kind == "rows":
                for job_id in [j for j in self.pending if j in value]:
                    row = value[job_id]
                    if row["state"] not in _FINISHED:
                        event = self._progress(job_id, row["progress"])
                        if event is not None:
                            yield event
                        continue
                    self.pending.remove(job_id)
                    yield JobEnd(job_id, row["state"], row["attempt"], row["result"],
                                 row["error"])
            elif kind == "progress":
                job_id, progress = value
                if job_id in self.pending:
                    event = self._progress(job_id, progress)
                    if event is not None:
                        yield event
            elif kind == "reason" and self.reasons:
                job_id, waiting = value
                if job_id in self.pending and self.reason.get(job_id) != (
                        waiting.reason, waiting.ahead):
                    self.reason[job_id] = (waiting.reason, waiting.ahead)
                    yield waiting


class WaitHub:
    """Every waiter of one process (a Client, the MCP gateway, ``sidecar wait``) on ONE
    LISTEN connection, whatever their number (issue 41, point 14): the hub LISTENs on
    each waited job's channel there (once, however many wait for it; UNLISTEN when the
    last one leaves) and fans the notifications out; it reads the rows of jobs that ended
    (and of every waited job when it starts, reconnects, and every ``check_seconds``)
    through ``store``'s pool, in batches of at most READ_BATCH ids, one statement at a
    time. So a process that waits costs its pool's connections plus one: the Client's
    ``max_connections`` + 1 (docs/callers.md), for 1 waiter or 10,000.

    ``connect``: makes the LISTEN connection (db.connect to the listen target); None
    behind a transaction pooler without a session elsewhere: every waited job is read
    every ``poll_seconds`` instead. The connection is made when the first waiter comes
    and again after it fails (after RECONNECT_SECONDS; ``on_reconnect(error, jobs
    waited)`` is called), LISTENs on every waited channel, then reads every waited job,
    so an end in the gap is not lost. Until that connection was made once, a waiter
    waits for the connect under way (or the next one) and raises what it raised
    (DatabaseUnavailable naming the setting: a wrong listen URL is said at once). A
    read that fails (any error: the hub's tasks never die while it is open) is tried
    again the same way: after the first connection, waiters never see the database's
    failures, only their jobs' ends (bound them with a timeout). While a waited job is
    queued, why it waits (JobWaiting) is asked every ``reason_seconds`` for all such
    jobs in one statement (CallerStore.wait_reasons).

    Use ``follow(job_ids)``; ``close()`` ends the hub's tasks and connection."""

    def __init__(self, store: CallerStore,
                 connect: Callable[[], Awaitable[asyncpg.Connection]] | None, *,
                 timeout: float, poll_seconds: float = POLL_SECONDS,
                 check_seconds: float = CHECK_SECONDS,
                 reason_seconds: float = REASON_SECONDS,
                 on_reconnect: Callable[[BaseException, int], None] | None = None):
        self.store = store
        self._connect = connect
        self.timeout = timeout
        self.poll_seconds = poll_seconds
        self.check_seconds = check_seconds
        self.reason_seconds = reason_seconds
        self.on_reconnect = on_reconnect
        self._waiters: dict[uuid.UUID, set[_Waiter]] = {}
        self._state: dict[uuid.UUID, str] = {}  # the last state read of each waited job
        self._queued_since: dict[uuid.UUID, float] = {}  # loop time it was first read queued
        self._to_read: set[uuid.UUID] = set()
        self._to_explain: set[uuid.UUID] = set()
        self._work = asyncio.Event()
        self._lock = asyncio.Lock()  # statements on the LISTEN connection, one at a time
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._started = False
        self._listened: set[uuid.UUID] = set()
        # Until the LISTEN connection was made once: whether a connect was tried, and
        # why the last one failed (a waiter then raises it: a wrong listen URL is a
        # configuration error, not a wait without end).
        self._connected_once = False
        self._attempt_ended = asyncio.Event()  # set, then replaced, as each connect ends
        self._connect_error: BaseException | None = None
        self.reads = 0  # statements the hub ran through the pool (bench, tests)

    @property
    def waited(self) -> int:
        """How many jobs are waited for now."""
        return len(self._waiters)

    @property
    def listening(self) -> int:
        """How many job channels the LISTEN connection listens on now."""
        return len(self._listened)

    async def follow(self, job_ids: Iterable[uuid.UUID], *, reasons: bool = False,
                     ) -> AsyncIterator[JobEnd | JobProgress | JobWaiting]:
        """Yield each job's progress reports (JobProgress, the latest first when it has
        one), with ``reasons`` why it waits while queued (JobWaiting, when that changes),
        and its end (JobEnd), until every job of ``job_ids`` has ended; jobs already
        finished end at once, in the order given. Raises JobNotFound when a job does not
        exist or is deleted while waited for. Close it (``contextlib.aclosing``) when
        leaving early."""
        if self._closed:
            raise RuntimeError("the wait hub is closed")
        ids = list(dict.fromkeys(uuid.UUID(str(job_id)) for job_id in job_ids))
        waiter = _Waiter(list(ids), reasons)
        fresh = [j for j in ids if j not in self._waiters]
        for job_id in ids:
            self._waiters.setdefault(job_id, set()).add(waiter)
        try:
            self._start()
            if self._connect is not None and not self._connected_once:
                await self._attempt_ended.wait()  # the one under way, or the next one
                if not self._connected_once and self._connect_error is not None:
                    raise self._connect_error
            if fresh and self._conn is not None:
                await self._listen(fresh)
            self._request(ids)
            async for event in waiter.events():
                yield event
        finally:
            gone = []
            for job_id in ids:
                holders = self._waiters.get(job_id)
                if holders is not None:
                    holders.discard(waiter)
                    if not holders:
                        del self._waiters[job_id]
                        self._state.pop(job_id, None)
                        self._queued_since.pop(job_id, None)
                        gone.append(job_id)
            if gone and self._conn is not None and not self._closed:
                task = asyncio.get_running_loop().create_task(self._unlisten(gone))
                self._tasks.append(task)
                task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._read_loop(), name="wait-hub-read"))
        self._tasks.append(loop.create_task(self._tick_loop(), name="wait-hub-tick"))
        if self._connect is not None:
            self._tasks.append(loop.create_task(self._listen_loop(), name="wait-hub-listen"))

    def _request(self, job_ids: Iterable[uuid.UUID]) -> None:
        self._to_read.update(j for j in job_ids if j in self._waiters)
        self._work.set()

    async def close(self) -> None:
        """Stop the hub's tasks and close its LISTEN connection (waiters still iterating
        are left to their timeouts; their Client is closing)."""
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    # --- the LISTEN connection ---------------------------------------------------------

    def _on_notify(self, _conn, _pid, _channel, payload: str) -> None:
        try:
            note = orjson.loads(payload)
            job_id, state = uuid.UUID(note["id"]), note["state"]
        except (ValueError, KeyError, TypeError):
            return
        holders = self._waiters.get(job_id)
        if not holders:
            return
        if state in _FINISHED:
            self._request([job_id])
            return
        self._state[job_id] = state
        progress = note.get("progress")
        if progress is not None:
            for waiter in list(holders):
                waiter.inbox.put_nowait(("progress", (job_id, progress)))

    def _on_close(self, _conn) -> None:
        self._lost.set()

    async def _listen(self, job_ids: list[uuid.UUID]) -> None:
        """LISTEN on the channels of ``job_ids`` (bounded); a failure drops the
        connection, and the listen loop makes it again (LISTENing on every waited job)."""
        async with self._lock:
            conn = self._conn
            if conn is None or conn.is_closed():
                return
            try:
                async with asyncio.timeout(self.timeout):
                    for job_id in job_ids:
                        if job_id in self._waiters:
                            await conn.add_listener(job_channel(job_id), self._on_notify)
                            self._listened.add(job_id)
            except (*db.DATABASE_ERRORS, *db.TIMEOUT_ERRORS):
                conn.terminate()
                self._lost.set()

    async def _unlisten(self, job_ids: list[uuid.UUID]) -> None:
        async with self._lock:
            conn = self._conn
            if conn is None or conn.is_closed():
                return
            try:
                async with asyncio.timeout(self.timeout):
                    for job_id in job_ids:
                        if job_id not in self._waiters:  # not waited for again meanwhile
                            await conn.remove_listener(job_channel(job_id), self._on_notify)
                            self._listened.discard(job_id)
            except (*db.DATABASE_ERRORS, *db.TIMEOUT_ERRORS):
                conn.terminate()
                self._lost.set()

    async def _listen_loop(self) -> None:
        assert self._connect is not None
        while True:
            conn = None
            try:
                try:
                    conn = await self._connect()
                    self._connected_once = True
                except BaseException as exc:
                    self._connect_error = exc
                    raise
                finally:
                    ended, self._attempt_ended = self._attempt_ended, asyncio.Event()
                    ended.set()
                self._lost.clear()
                conn.add_termination_listener(self._on_close)
                async with self._lock:
                    self._conn = conn
                await self._listen(list(self._waiters))
                self._request(list(self._waiters))  # whatever ended before the LISTEN
                while not self._lost.is_set():
                    try:
                        # asyncio.timeout: wait_for (3.11) can lose the cancellation.
                        async with asyncio.timeout(self.check_seconds):
                            await self._lost.wait()
                    except TimeoutError:  # prove the path alive; read everything again
                        async with self._lock, asyncio.timeout(self.timeout):
                            await conn.execute("SELECT 1")
                        self._request(list(self._waiters))
                raise asyncpg.InterfaceError("the wait hub's LISTEN connection was closed")
            except Exception as exc:  # noqa: BLE001 - whatever failed, the waiters go on
                # (before the first connection, the waiters raise the error themselves)
                if self._connected_once and self.on_reconnect is not None:
                    self.on_reconnect(exc, len(self._waiters))
            finally:
                async with self._lock:
                    self._conn = None
                    self._listened.clear()
                if conn is not None:
                    conn.terminate()
            await asyncio.sleep(RECONNECT_SECONDS)

    # --- reads through the pool ----------------------------------------------------------

    async def _tick_loop(self) -> None:
        """Every ``poll_seconds`` without LISTEN, read every waited job; every
        ``reason_seconds``, ask why the queued ones wait."""
        period = min(self.reason_seconds,
                     self.poll_seconds if self._connect is None else self.reason_seconds)
        since_reasons = 0.0
        while True:
            await asyncio.sleep(period)
            since_reasons += period
            if self._connect is None:
                self._request(list(self._waiters))
            if since_reasons >= self.reason_seconds:
                since_reasons = 0.0
                now = asyncio.get_running_loop().time()
                self._to_explain.update(
                    j for j, since in self._queued_since.items()
                    if self._state.get(j) == "queued" and now - since >= REASON_GRACE_SECONDS)
                self._work.set()

    async def _read_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while self._to_read or self._to_explain:
                try:
                    if self._to_read:
                        batch = _take(self._to_read, READ_BATCH)
                        try:
                            await self._read(batch)
                        except BaseException:
                            self._to_read.update(batch)
                            raise
                    else:
                        batch = _take(self._to_explain, READ_BATCH)
                        await self._explain(batch)
                except Exception as exc:  # noqa: BLE001 - a dead reader would hang them all
                    if self.on_reconnect is not None:
                        self.on_reconnect(exc, len(self._waiters))
                    await asyncio.sleep(RECONNECT_SECONDS)

    async def _read(self, batch: list[uuid.UUID]) -> None:
        wanted = [j for j in batch if j in self._waiters]
        if not wanted:
            return
        self.reads += 1
        rows = {row["id"]: row for row in await self.store.wait_rows(wanted)}
        missing = {j for j in wanted if j not in rows}
        by_waiter: dict[_Waiter, dict[uuid.UUID, Any]] = {}
        now = asyncio.get_running_loop().time()
        for job_id, row in rows.items():
            if row["state"] == "queued":
                self._queued_since.setdefault(job_id, now)
            self._state[job_id] = row["state"]
            if row["expired"]:  # its start deadline passed: tool_job_wait_reasons ends it
                self._to_explain.add(job_id)
            for waiter in self._waiters.get(job_id, ()):
                by_waiter.setdefault(waiter, {})[job_id] = row
        for waiter, found in by_waiter.items():
            waiter.inbox.put_nowait(("rows", found))
        if missing:
            for waiter in {w for j in missing for w in self._waiters.get(j, ())}:
                waiter.inbox.put_nowait(("missing", missing))

    async def _explain(self, batch: list[uuid.UUID]) -> None:
        """Ask why the queued jobs of ``batch`` wait, for those a waiter wants reasons
        of; the others only have their start deadline checked (the same statement ends
        them ``expired`` when it passed: no job waits past it for want of a sidecar)."""
        queued = [j for j in batch if self._state.get(j) == "queued"]
        wanted = [j for j in queued if any(w.reasons for w in self._waiters.get(j, ()))]
        if len(wanted) < len(queued):
            self.reads += 1
            chosen = set(wanted)
            await self.store.wait_reasons([j for j in queued if j not in chosen],
                                          explain=False)
        if not wanted:
            return
        self.reads += 1
        for row in await self.store.wait_reasons(wanted):
            if row["reason"] is None:
                continue
            ahead = int(row["ahead"] or 0)
            event = JobWaiting(row["id"], row["reason"], ahead, row["detail"],
                               waiting_message(row["reason"], ahead, row["detail"]))
            for waiter in self._waiters.get(row["id"], ()):
                waiter.inbox.put_nowait(("reason", (row["id"], event)))


def _take(wanted: set[uuid.UUID], limit: int) -> list[uuid.UUID]:
    batch = []
    while wanted and len(batch) < limit:
        batch.append(wanted.pop())
    return batch
