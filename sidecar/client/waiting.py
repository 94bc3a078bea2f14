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
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
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
    ``message`` (or None), ``at`` (the database's time, ISO 8601 text) and ``attempt``."""

    id: uuid.UUID
    value: float | None
    message: str | None
    at: str | None
    attempt: int | None

    @classmethod
    def of(cls, job_id: uuid.UUID, progress: dict[str, Any]) -> JobProgress:
        at = progress.get("at")
        return cls(job_id, progress.get("value"), progress.get("message"),
                   at.isoformat() if isinstance(at, dt.datetime) else at,
                   progress.get("attempt"))

    def as_json(self) -> dict[str, Any]:
        """``{"id", "progress", "message", "at", "attempt"}``: what ``wait --progress``
        prints on stderr."""
        return {"id": str(self.id), "progress": self.value, "message": self.message,
                "at": self.at, "attempt": self.attempt}


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


async def follow(dsn: str, job_ids: Iterable[uuid.UUID], *, db_timeout: float,
                 listen: bool = True, pooler: str | None = None,
                 on_reconnect: Callable[[BaseException, int], None] | None = None,
                 setting: str = "SIDECAR_DATABASE_URL",
                 ) -> AsyncIterator[JobEnd | JobProgress]:
    """``watch`` on a connection of its own to ``dsn`` (``db.connect``, ``pooler`` as
    there; with ``listen`` its application_name is ``sidecar-listen``, as a sidecar's
    LISTEN connection's), connecting again after a failure of that connection or a
    statement timeout: ``on_reconnect(error, jobs still pending)`` is called, then after
    RECONNECT_SECONDS it connects, LISTENs and reads the jobs not yet ended again (nothing
    is missed). Yields
    what ``watch`` yields until every job ended; bound it with ``asyncio.timeout``, and
    close it (``contextlib.aclosing``) when leaving early, so its connection is closed at
    once. Raises JobNotFound, and DatabaseUnavailable when a connection cannot be made
    (``db_timeout`` seconds bound each connect and statement; its message names
    ``setting``, the variable ``dsn`` came from). The waiter of ``sidecar
    wait`` and of sidecar.client."""
    pending = list(dict.fromkeys(uuid.UUID(str(job_id)) for job_id in job_ids))
    while pending:
        conn = None
        try:
            conn = await db.connect(dsn, db_timeout, pooler=pooler, setting=setting,
                                    application_name=(db.LISTEN_APPLICATION_NAME if listen
                                                      else db.APPLICATION_NAME))
            async for event in watch(conn, pending, listen=listen,
                                     statement_timeout=db_timeout):
                if isinstance(event, JobEnd):
                    pending.remove(event.id)
                yield event
        except (*db.UNAVAILABLE_ERRORS, *db.TIMEOUT_ERRORS) as exc:
            if on_reconnect is not None:
                on_reconnect(exc, len(pending))
            await asyncio.sleep(RECONNECT_SECONDS)
        finally:
            if conn is not None:
                conn.terminate()


async def _notifications(heard: asyncio.Queue, check_seconds: float
                         ) -> AsyncIterator[tuple[uuid.UUID, str, Any] | None]:
    """The notifications heard: the first one waited for (at most ``check_seconds``; then
    one None), then every one already queued. A notification that is not ours in shape is
    skipped; a closed connection (None queued by the termination listener) ends it with a
    None."""
    try:
        first = await asyncio.wait_for(heard.get(), check_seconds)
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
