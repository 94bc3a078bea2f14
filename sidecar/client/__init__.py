"""The caller's half of a tool call, from Python (issue 26, point 5): ``Client``.

```python
from sidecar.client import Client, JobFailed

async with Client() as sidecar:            # the DSN as the CLI resolves it
    result = await sidecar.call("ocr", {"file": "/data/scan.png"}, timeout=300)
```

A thin layer over what the CLI uses, with no second implementation: the DSN resolved as the
CLI does (``SIDECAR_DATABASE_URL``, ``SIDECAR_DATABASE_URL_FILE``, else the embedded
PostgreSQL: sidecar.runtime.config.load_settings, sidecar.storage.db.resolve_dsn), the
options checked by sidecar.protocol.enqueue_args and then by the database in
``tool_job_enqueue`` (CallerStore.enqueue, the statement ``sidecar enqueue`` and
``sidecar_enqueue`` run), the waiter of ``sidecar wait`` (sidecar.client.waiting.follow:
LISTEN on each job's own channel, on ``SIDECAR_LISTEN_DATABASE_URL`` when it is set; or,
with ``SIDECAR_DATABASE_POOLER=transaction`` and no such URL, a read of the unfinished jobs
every waiting.POLL_SECONDS). It imports nothing of the worker (tests/test_import_graph.py),
and ``sidecar run`` does not import it. docs/callers.md#from-python has the whole story.

Errors: bad input raises sidecar.protocol.errors.UsageError (or ConfigError for a bad tool name or
environment), one line naming the argument, before anything is written; an unreachable
database raises DatabaseUnavailable; a database whose schema is older than this sidecar
(or missing) raises SchemaMismatch at open, with nothing changed (``sidecar migrate``
applies migrations, never the client); a statement raises what asyncpg raises.

The package ``sidecar.client`` is the caller's end: this library (Client) and waiting for
jobs without polling (sidecar.client.waiting). It imports sidecar.protocol, sidecar.runtime
and sidecar.storage only; never the worker's end (tests/test_package_rules.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import math
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from sidecar.client import waiting
from sidecar.client.waiting import JobEnd, JobNotFound, JobProgress, JobWaiting
from sidecar.protocol import enqueue_args, jsontext, parsing
from sidecar.protocol.errors import SchemaMismatch, UsageError, one_line
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import RawJson
from sidecar.runtime.config import (
    POOLER_MODES,
    Settings,
    check_postgres_url,
    load_settings,
    register_secrets,
    validate_tool_name,
)
from sidecar.storage import db, schema
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.store import check_producer_key

__all__ = ["Client", "Job", "JobEnd", "JobFailed", "JobNotFound", "JobProgress", "JobRef",
           "JobTimeout", "JobWaiting", "SchemaMismatch"]

# What the client's journal row (job_enqueued) says enqueued the job.
ENQUEUED_BY = "sidecar.client"


@dataclass(frozen=True)
class JobRef:
    """One enqueued job: its ``id``, and ``created`` (False when the idempotency key named
    a job that existed already, whose id this is). Accepted wherever a job id is;
    ``str()`` is the id."""

    id: uuid.UUID
    created: bool

    def __str__(self) -> str:
        return str(self.id)


JobId = uuid.UUID | str | JobRef


class JobFailed(Exception):
    """A job called ended ``failed`` or ``cancelled``: ``job_id``, ``state``, ``error``
    (the row's error object, e.g. ``{"kind": "exit_code", "message": "..."}``; ``kind``
    and ``message`` are its two fields) and the ``attempt`` that ended it."""

    def __init__(self, end: JobEnd):
        self.job_id: uuid.UUID = end.id
        self.state: str = end.state
        self.error: dict[str, Any] = end.error if isinstance(end.error, dict) else {}
        self.attempt: int = end.attempt
        super().__init__(one_line(f"job {end.id} {end.state} on attempt {end.attempt}: "
                                  f"{self.kind or 'unknown'}: {self.message or ''}"[:1000]))

    @property
    def kind(self) -> str | None:
        """The error's kind (``exit_code``, ``timeout``, ``expired``, ``cancelled``...)."""
        return self.error.get("kind")

    @property
    def message(self) -> str | None:
        """The error's message."""
        text = self.error.get("message")
        return text if isinstance(text, str) else None


class JobTimeout(TimeoutError):
    """The timeout of a ``wait`` or ``call`` passed before the jobs ended. ``job_ids``: the
    jobs still unfinished (``job_id`` the first of them); ``ended``: the JobEnd of those
    that ended meanwhile. The jobs go on: ``Client.cancel`` stops them."""

    def __init__(self, job_ids: list[uuid.UUID], timeout: float,
                 ended: Iterable[JobEnd] = ()):
        self.job_ids = list(job_ids)
        self.timeout = timeout
        self.ended = list(ended)
        shown = ", ".join(str(job_id) for job_id in self.job_ids[:5])
        more = f" and {len(self.job_ids) - 5} more" if len(self.job_ids) > 5 else ""
        super().__init__(f"timed out after {timeout:g} s; still unfinished: {shown}{more}")

    @property
    def job_id(self) -> uuid.UUID:
        return self.job_ids[0]


@dataclass(frozen=True)
class Job:
    """One job's row as ``sidecar show`` reads it (docs/protocol.md names every column).
    Times are timezone-aware datetimes; ``payload``, ``result``, ``error``, ``checkpoint``
    and ``progress`` (``{"value", "message", "at", "attempt"}``) are decoded JSON."""

    id: uuid.UUID
    tool: str
    state: str
    attempt: int
    max_attempts: int | None
    priority: int
    tags: dict[str, str]
    payload: Any
    result: Any
    error: dict[str, Any] | None
    progress: dict[str, Any] | None
    idempotency_key: str
    run_after: dt.datetime | None
    expires_at: dt.datetime | None
    created_at: dt.datetime
    first_claimed_at: dt.datetime | None
    finished_at: dt.datetime | None
    parent_id: uuid.UUID | None
    stage: int
    traceparent: str | None
    tracestate: str | None
    owner_id: str | None
    lease_until: dt.datetime | None
    fencing_token: int
    heartbeat_at: dt.datetime | None
    checkpoint: Any
    interest_key: str | None = None  # the caller's interest it belongs to (issue 44)

    @property
    def finished(self) -> bool:
        """Succeeded, failed or cancelled."""
        return self.state in ("succeeded", "failed", "cancelled")


_JOB_FIELDS = tuple(field.name for field in dataclasses.fields(Job))


def _job_id(value: JobId) -> uuid.UUID:
    """A job id as the client takes it: a JobRef, a UUID or its text
    (sidecar.protocol.parsing.parse_job_id); UsageError otherwise."""
    if isinstance(value, JobRef):
        return value.id
    return parsing.parse_job_id(value, "job id")


def _seconds(value: float | dt.timedelta | None, what: str) -> float | None:
    """A timeout in seconds (more than 0), None when None; UsageError otherwise."""
    if value is None:
        return None
    return parsing.seconds_value(value, what, positive=True)


def enqueue_options(*, priority: int = 0,
                    run_after: dt.datetime | dt.timedelta | float | str | None = None,
                    expires_in: dt.datetime | dt.timedelta | float | str | None = None,
                    tags: Mapping[str, str] | None = None, traceparent: str | None = None,
                    tracestate: str | None = None,
                    concurrency_key: str | None = None,
                    session: str | None = None,
                    dedupe: str | None = None,
                    interest: str | None = None) -> enqueue_args.EnqueueOptions:
    """The client's options as EnqueueOptions: the one parser of the CLI's options
    (sidecar.protocol.enqueue_args.enqueue_options), errors naming the Python arguments.
    ``run_after`` an aware datetime (not claimed before) or a delay (seconds, a timedelta
    or a duration's text such as ``"30m"``, counted by the database's clock);
    ``expires_in`` a duration (more than 0) or an aware datetime (no attempt starts after
    it). UsageError for the first that is not allowed."""
    return enqueue_args.enqueue_options(
        priority, run_after, expires_in, tags, traceparent, tracestate, concurrency_key,
        session=session, dedupe=dedupe, interest=interest, names=enqueue_args.PYTHON_NAMES)


class Client:
    """A caller of the sidecar's tools: enqueue, wait, call, cancel, progress, get.

    ``dsn``: a PostgreSQL URL; None resolves it as the CLI does (``SIDECAR_DATABASE_URL``,
    ``SIDECAR_DATABASE_URL_FILE``, else the embedded PostgreSQL in ``SIDECAR_DATA_DIR``,
    started if needed). ``settings``: default ``load_settings()`` of the environment
    (ConfigError for a bad ``SIDECAR_*`` variable); from them come the statement bound
    (``SIDECAR_DB_TIMEOUT_SECONDS``), the payload limit (``SIDECAR_MAX_PAYLOAD_BYTES``)
    and the pooler (``SIDECAR_DATABASE_POOLER``; ``pooler`` overrides it: ``transaction``
    behind PgBouncer in transaction mode, where waiting polls every
    waiting.POLL_SECONDS instead of LISTEN). ``listen_dsn``: where a wait's connection
    goes to LISTEN, a session (the server itself, or a session-mode pool), even behind a
    transaction pooler (default ``SIDECAR_LISTEN_DATABASE_URL``; unset: ``dsn``, or
    polling behind a transaction pooler; ConfigError when it is not a PostgreSQL URL).
    ``max_connections``: the pool's size. Every wait of the client shares one more
    connection, its LISTEN connection (sidecar.client.waiting.WaitHub, made at the first
    wait): a client holds at most ``max_connections`` + 1 server connections however
    many calls it waits for at once (issue 41). ``session``: every call this client
    enqueues belongs to that agent session (1-256 printable characters; a call's own
    ``session=`` overrides it): they run one at a time, in order, in one warm process of
    the tool that keeps its state (docs/callers.md "Sessions"; the tool's profile must be
    PROCESS=warm).

    Use it as ``async with Client() as client:`` or ``client = await Client.connect()``
    (then ``await client.close()``). Opening checks the schema and never changes it:
    sidecar.protocol.errors.SchemaMismatch when it is older than this sidecar or missing (run
    ``sidecar migrate``), or newer without declaring compatibility."""

    def __init__(self, dsn: str | None = None, *, settings: Settings | None = None,
                 pooler: str | None = None, listen_dsn: str | None = None,
                 max_connections: int = 4, session: str | None = None):
        if max_connections < 1:
            raise UsageError(f"max_connections {max_connections}: must be at least 1")
        # checked now: a bad session is the constructor's error, not each call's
        self.session = enqueue_options(session=session).session
        self._dsn_given = dsn
        self._settings_given = settings
        self._pooler_given = pooler
        self._listen_dsn_given = listen_dsn
        self._max_connections = max_connections
        self._pool: asyncpg.Pool | None = None
        self._store: CallerStore | None = None
        self._secret_keys: list = []  # this client's keys in masking.SECRETS
        self._hub: waiting.WaitHub | None = None
        self.dsn: str | None = None
        self.settings: Settings | None = None
        self.pooler = "none"
        self.listen_dsn = ""  # where waits LISTEN ("": on dsn, or none behind a pooler)

    @classmethod
    async def connect(cls, dsn: str | None = None, **options: Any) -> Client:
        """A Client already open (``options`` as the constructor's)."""
        client = cls(dsn, **options)
        await client.open()
        return client

    async def open(self) -> None:
        """Resolve the DSN, open the pool and check the schema (one read, no DDL);
        DatabaseUnavailable when the database cannot be reached, SchemaMismatch when its
        schema is one this sidecar may not work on (nothing is changed). Calling it again
        does nothing."""
        if self._store is not None:
            return
        settings = self._settings_given or load_settings()
        if self._dsn_given is not None:
            settings = dataclasses.replace(settings, database_url=self._dsn_given)
        # The embedded server may take seconds to start: not on the event loop.
        dsn = await asyncio.to_thread(db.resolve_dsn, settings)
        pooler = self._pooler_given or settings.database_pooler
        if pooler not in POOLER_MODES:
            raise UsageError(f"pooler {pooler!r}: use none or transaction")
        listen_dsn = settings.listen_database_url
        if self._listen_dsn_given is not None:
            listen_dsn = self._listen_dsn_given and check_postgres_url(
                "listen_dsn", self._listen_dsn_given)
        pool = await db.create_pool(dsn, settings.db_timeout_seconds, self._max_connections,
                                    pooler=pooler)
        try:
            store = CallerStore(pool, settings.db_timeout_seconds)
            await schema.require_current(store)
        except BaseException:
            pool.terminate()
            raise
        self.dsn, self.settings, self.pooler = dsn, settings, pooler
        self.listen_dsn = listen_dsn
        self._pool, self._store = pool, store
        # What this client reads back (get, jobs, wait) is scrubbed of the secrets it
        # knows, in rows written before scrubbing existed too (issue 41).
        self._secret_keys = register_secrets(
            dataclasses.replace(settings, listen_database_url=listen_dsn or None), dsn,
            ("client", id(self)))
        self._hub = waiting.WaitHub(store, self._listen_connector(),
                                    timeout=settings.db_timeout_seconds)

    def _listen_connector(self):
        """What makes the hub's LISTEN connection: db.connect to the listen target
        (``listen_dsn``, else ``dsn``), or None behind a transaction pooler without
        ``listen_dsn`` (the hub polls)."""
        assert self.dsn is not None and self.settings is not None
        target = db.listen_target(self.dsn, self.pooler, self.listen_dsn)
        if target is None:
            return None
        timeout = self.settings.db_timeout_seconds
        setting = ("SIDECAR_LISTEN_DATABASE_URL (listen_dsn)" if self.listen_dsn
                   else "SIDECAR_DATABASE_URL")

        async def connect() -> asyncpg.Connection:
            return await db.connect(target[0], timeout, pooler=target[1], setting=setting,
                                    application_name=db.LISTEN_APPLICATION_NAME)
        return connect

    async def close(self) -> None:
        """Close the pool (bounded by the statement bound; then its connections are
        terminated)."""
        pool, self._pool, self._store = self._pool, None, None
        hub, self._hub = self._hub, None
        if hub is not None:
            await hub.close()
        if pool is None:
            return
        for key in self._secret_keys:
            SECRETS.discard(key)
        self._secret_keys = []
        try:
            await asyncio.wait_for(pool.close(), self._timeout)
        except (TimeoutError, *db.DATABASE_ERRORS):
            pool.terminate()

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def _timeout(self) -> float:
        return self.settings.db_timeout_seconds if self.settings else 10.0

    @property
    def store(self) -> CallerStore:
        """The open CallerStore, for statements of the caller's role that are not jobs
        (the MCP gateway's sessions, sidecar.mcp.sessions). RuntimeError when not open."""
        return self._opened()

    def _opened(self) -> CallerStore:
        if self._store is None:
            raise RuntimeError("the Client is not open: use 'async with Client() as c' or "
                               "'await Client.connect()'")
        return self._store

    # --- enqueue --------------------------------------------------------------

    async def enqueue(self, tool: str, payload: Any = None, *,
                      idempotency_key: str | None = None, priority: int = 0,
                      run_after: dt.datetime | dt.timedelta | float | None = None,
                      expires_in: dt.datetime | dt.timedelta | float | None = None,
                      tags: Mapping[str, str] | None = None, max_attempts: int | None = None,
                      traceparent: str | None = None, tracestate: str | None = None,
                      concurrency_key: str | None = None,
                      session: str | None = None, dedupe: str | None = None,
                      interest: str | None = None,
                      connection: asyncpg.Connection | None = None,
                      gateway_tags: bool = False) -> JobRef:
        """Queue one call of ``tool`` with ``payload`` (any JSON value, None is ``{}``; a
        sidecar.protocol.model.RawJson is sent as the JSON text it is) and return its JobRef.

        ``idempotency_key``: the same key returns the existing job (``created`` False)
        when tool and payload are the same, and raises IdempotencyConflict otherwise.
        ``priority`` 0 (claimed first) to 9. ``run_after``: an aware datetime, or a delay
        in seconds or as a timedelta. ``expires_in``: seconds or a timedelta (no attempt
        starts later than that after enqueue), or an aware datetime. ``tags``: at most 16
        ``{key: value}`` strings (``cancel(tag=...)`` acts on them). ``max_attempts``
        1-1000, None: the profile's MAX_ATTEMPTS. ``traceparent``/``tracestate``: W3C
        trace context, given to the tool as TRACEPARENT/TRACESTATE. ``concurrency_key``:
        1-256 printable characters (a tenant, an account): flow control caps it and lets
        keys take turns (``sidecar limit``, issue 27); None: no key. ``session``: the agent
        session of the call (None: the client's own ``session``, if any): its calls run
        one at a time, in order, in one warm process; a call whose session ended or was
        lost fails with kind ``session_lost`` (docs/callers.md "Sessions"). ``dedupe``: how
        long the job holds ``idempotency_key``: ``"forever"``, ``"active"`` (until it
        finishes; the key then frees for a new job, the old row kept) or a window such as
        ``"24h"``; None: the tool's DEDUPE (docs/callers.md "Idempotency keys").
        ``interest``: the key of an interest held now (``Client.interest``): the call
        belongs to it and stops when it lapses (docs/callers.md "Interest").

        ``connection``: your own asyncpg connection, in a transaction you opened: the job
        is written in it and exists only if that transaction commits; the wake-up of an
        idle sidecar is a NOTIFY, sent at commit (none on rollback). Without it the job is
        written and committed at once on the client's pool.

        Tags named ``mcp.*`` and keys starting ``mcp:`` are ``sidecar mcp``'s (issue 41
        point 2): refused with UsageError unless ``gateway_tags`` (the gateway's own
        calls, whose ``mcp.*`` tags it signs; it ignores any job whose tags it did not
        sign, so the flag opens nothing to another producer: docs/mcp.md, Security).

        Raises UsageError (or ConfigError for the tool name) for bad input, with nothing
        written; IdempotencyConflict; DatabaseUnavailable or asyncpg errors."""
        store = self._opened()
        assert self.settings is not None
        tool = validate_tool_name(tool)
        options = enqueue_options(priority=priority, run_after=run_after,
                                  expires_in=expires_in, tags=tags, traceparent=traceparent,
                                  tracestate=tracestate, concurrency_key=concurrency_key,
                                  session=session if session is not None else self.session,
                                  dedupe=dedupe, interest=interest)
        enqueue_args.check_max_attempts(max_attempts, "max_attempts")
        if idempotency_key is not None:
            check_producer_key(enqueue_args.check_idempotency_key(idempotency_key,
                                                                  "idempotency_key"))
        if not gateway_tags:
            enqueue_args.refuse_reserved(options.tags, idempotency_key,
                                         enqueue_args.PYTHON_NAMES)
        text = _payload_text({} if payload is None else payload,
                             self.settings.max_payload_bytes)
        job_id, created = await store.enqueue(tool, text, idempotency_key, max_attempts,
                                              {"by": ENQUEUED_BY}, options, conn=connection)
        return JobRef(uuid.UUID(str(job_id)), bool(created))

    # --- interest (issue 44, point 2) ---------------------------------------------

    async def hold_interest(self, key: str, ttl: float, holder: str | None = None) -> None:
        """Hold or renew the interest ``key`` for ``ttl`` seconds (1 s to 1 day) from now,
        once: what ``interest`` does in its block, for a caller that renews on its own
        schedule (the MCP gateway renews on its clients' requests). UsageError for a bad
        key, ttl or holder."""
        await self._opened().hold_interest(key, ttl, holder)

    @contextlib.asynccontextmanager
    async def interest(self, key: str, ttl: float | dt.timedelta = 30.0, *,
                       holder: str | None = None) -> AsyncIterator[str]:
        """Hold the interest ``key`` (1-256 printable characters) while the block runs:
        held for ``ttl`` seconds (1 s to 1 day) and renewed every third of it by a task of
        this client; calls enqueued with ``interest=key`` belong to it. Leaving the block
        lets it go: its calls still unfinished stop (queued ones end expired, running ones
        are cancelled with kind ``abandoned_by_caller``), as they do when this process
        dies and the renewals stop (then within ``ttl`` plus a poll period). Yields
        ``key``. UsageError for a bad key, ttl or holder (docs/callers.md "Interest")."""
        store = self._opened()
        seconds = ttl.total_seconds() if isinstance(ttl, dt.timedelta) else float(ttl)
        if not isinstance(key, str):
            raise UsageError("interest must be a string, e.g. 'agent-run-42'")
        if not 1.0 <= seconds <= 86400.0:
            raise UsageError(f"ttl {seconds:g}: from 1 second to 1 day, e.g. 30")
        await store.hold_interest(key, seconds, holder)

        async def renew() -> None:
            while True:
                await asyncio.sleep(seconds / 3)
                try:
                    await store.hold_interest(key, seconds, holder)
                except (asyncpg.PostgresError, OSError, TimeoutError):
                    continue  # the next renewal tries again; the ttl is the slack

        renewer = asyncio.create_task(renew(), name=f"interest {key[:40]}")
        try:
            yield key
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            with contextlib.suppress(asyncpg.PostgresError, OSError, TimeoutError):
                await store.release_interest(key)

    # --- waiting ----------------------------------------------------------------

    def _follow(self, job_ids: list[uuid.UUID], reasons: bool = False,
                ) -> AsyncIterator[JobEnd | JobProgress | JobWaiting]:
        self._opened()
        assert self._hub is not None
        return self._hub.follow(job_ids, reasons=reasons)

    async def wait(self, jobs: JobId | Iterable[JobId], *,
                   timeout: float | dt.timedelta | None = None,
                   any: bool = False,  # noqa: A002 - as the CLI's
                   on_progress: Callable[[JobProgress], Any] | None = None,
                   ) -> JobEnd | list[JobEnd]:
        """Wait until the jobs end, without polling (a NOTIFY on each job's channel, heard
        on the client's one LISTEN connection; behind a transaction pooler without
        ``listen_dsn`` a read every waiting.POLL_SECONDS).

        ``jobs``: one id (a UUID, its text or a JobRef): returns its JobEnd; or several:
        returns their JobEnd in the order given (a repeated id counts once), or with
        ``any`` a list of the first one to end. A JobEnd has ``id``, ``state``
        (``succeeded``, ``failed`` or ``cancelled``), ``result`` or ``error`` and
        ``attempt``; a failed job does not raise here (``call`` does). ``timeout``:
        seconds or a timedelta, None waits for as long as it takes. ``on_progress``: called
        with each JobProgress as it comes: the tool's reports, and while a job is queued
        why it waits when that changes (``waiting`` set: ``no_live_sidecar``, ``paused``,
        ``max_running``, ``rate``, ``max_running_per_key``, ``rate_per_key``,
        ``scheduled``, ``queued_behind``; ``message`` says it in one line).

        Raises JobTimeout (a TimeoutError) when the timeout passes first, JobNotFound when
        a job does not exist, DatabaseUnavailable when the client's LISTEN connection has
        never been made and cannot be (a wrong ``listen_dsn``). A connection that fails
        while waiting is made again, nothing missed: the wait goes on until its timeout."""
        single = isinstance(jobs, uuid.UUID | str | JobRef)
        ids = list(dict.fromkeys(_job_id(job) for job in ([jobs] if single else jobs)))
        if not ids:
            raise UsageError("wait: give at least one job id")
        seconds = _seconds(timeout, "timeout")
        ended: dict[uuid.UUID, JobEnd] = {}
        try:
            async with asyncio.timeout(seconds), \
                    contextlib.aclosing(self._follow(ids, on_progress is not None)) as events:
                async for event in events:
                    if on_progress is not None and not isinstance(event, JobEnd):
                        on_progress(event.as_progress() if isinstance(event, JobWaiting)
                                    else event)
                    if isinstance(event, JobEnd):
                        ended[event.id] = event
                        if any:
                            break
        except TimeoutError:
            if len(ended) == len(ids) or (any and ended):
                pass  # ended just as the timeout passed
            else:
                raise JobTimeout([j for j in ids if j not in ended], seconds or 0.0,
                                 ended.values()) from None
        if single:
            return ended[ids[0]]
        return [ended[j] for j in ids if j in ended]

    async def call(self, tool: str, payload: Any = None, *,
                   timeout: float | dt.timedelta | None,
                   idempotency_key: str | None = None, priority: int = 0,
                   run_after: dt.datetime | dt.timedelta | float | None = None,
                   expires_in: dt.datetime | dt.timedelta | float | None = None,
                   tags: Mapping[str, str] | None = None, max_attempts: int | None = None,
                   traceparent: str | None = None, tracestate: str | None = None,
                   concurrency_key: str | None = None, session: str | None = None,
                   dedupe: str | None = None, interest: str | None = None) -> Any:
        """Enqueue ``tool`` with ``payload`` (options as ``enqueue``'s; no ``connection``:
        a job in an open transaction could not run before it commits) and wait for it;
        return its result (the JSON the tool printed, decoded).

        ``timeout``: seconds or a timedelta for the wait (None: no bound; say so). Raises
        JobFailed (``job_id``, ``state``, ``error`` with ``kind`` and ``message``,
        ``attempt``) when the job ends failed or cancelled, JobTimeout (a TimeoutError,
        ``job_id``) when the timeout passes first (the job goes on: ``cancel`` it if it
        should not), and what ``enqueue`` raises."""
        seconds = _seconds(timeout, "timeout")
        ref = await self.enqueue(tool, payload, idempotency_key=idempotency_key,
                                 priority=priority, run_after=run_after,
                                 expires_in=expires_in, tags=tags, max_attempts=max_attempts,
                                 traceparent=traceparent, tracestate=tracestate,
                                 concurrency_key=concurrency_key, session=session,
                                 dedupe=dedupe, interest=interest)
        end = await self.wait(ref, timeout=seconds)
        assert isinstance(end, JobEnd)
        if not end.succeeded:
            raise JobFailed(end)
        return end.result

    async def follow(self, job_id: JobId, *, reasons: bool = False,
                     ) -> AsyncIterator[JobProgress | JobEnd]:
        """What happens to one job, as it happens: its progress reports (the latest one
        first when it has one), then its JobEnd, after which the iteration stops. With
        ``reasons``, while the job is queued, why it waits too, each time that changes
        (a JobProgress whose ``waiting`` is set, as ``wait``'s ``on_progress`` gets).
        No polling (as ``wait``); raises JobNotFound for a job that does not exist. Bound
        it with ``asyncio.timeout`` if needed."""
        async with contextlib.aclosing(self._follow([_job_id(job_id)], reasons)) as events:
            async for event in events:
                yield event.as_progress() if isinstance(event, JobWaiting) else event
                if isinstance(event, JobEnd):
                    return

    async def progress(self, job_id: JobId, *, reasons: bool = False,
                       ) -> AsyncIterator[JobProgress]:
        """The progress reports of a job as they come (the latest one first when it has
        one), until it ends; then the iteration stops (``wait`` gives its end at once).
        A JobProgress has ``value`` (0..1 or None), ``message``, ``at`` (ISO 8601, the
        database's time) and ``attempt``; with ``reasons``, while the job is queued, why
        it waits comes as one with ``waiting`` set (see ``wait``), when that changes.
        Behind a transaction pooler a report replaced within one poll is not seen. Bound
        it with ``asyncio.timeout`` if needed; raises JobNotFound for a job that does not
        exist."""
        async with contextlib.aclosing(self._follow([_job_id(job_id)], reasons)) as events:
            async for event in events:
                if isinstance(event, JobWaiting):
                    yield event.as_progress()
                elif isinstance(event, JobProgress):
                    yield event

    # --- acting on jobs ---------------------------------------------------------

    async def cancel(self, job_id: JobId | None = None, *,
                     tag: Mapping[str, str] | None = None,
                     by: str | None = None) -> dict[uuid.UUID, str]:
        """Cancel one job, or with ``tag`` (``{key: value, ...}``) every queued or running
        job whose tags include all of them; their later stages too. A running job's tree
        is killed by its sidecar within about a second (told at commit, or its own check
        every second when it cannot LISTEN). Returns ``{id: previous state}``
        of every job cancelled, empty when none was (already finished, or no such job).
        ``by``: who asked, journaled as job_cancelled's ``by`` (at most 200 characters;
        ``sidecar mcp (PRINCIPAL)`` makes the job's error say "cancelled by its MCP
        client"). UsageError unless exactly one of ``job_id`` and ``tag`` is given."""
        store = self._opened()
        if (job_id is None) == (not tag):
            raise UsageError("cancel: give one job_id, or tag={key: value} for every "
                             "queued or running job with those tags")
        if tag:
            if not isinstance(tag, Mapping):
                raise UsageError("tag: give a dict of strings, e.g. {'run': '42'}")
            return await store.cancel(None, enqueue_args.check_tags(dict(tag)),
                                      by[:200] if by else None)
        return await store.cancel(_job_id(job_id), by=by[:200] if by else None)

    async def approval_request(self, job_id: JobId) -> dict[str, Any] | None:
        """The approval request the job's tool waits on now (issue 44): ``id, job_id,
        attempt, fencing_token, action, summary, details, asked_at, deadline``; None when
        there is none."""
        row = await self._opened().open_approval(_job_id(job_id))
        return dict(row) if row is not None else None

    async def approve(self, job_id: JobId, *, approve: bool = True, reason: str | None = None,
                      attempt: int | None = None, token: int | None = None,
                      by: str = "sidecar.client") -> str:
        """Answer the approval request a tool of job ``job_id`` is waiting on (issue 44,
        point 1): approve it, or with ``approve=False`` deny it (the job then fails
        ``denied``), with ``reason`` (1-500 printable characters) and ``by`` (who answers,
        1-256). The answer names the attempt and fencing token it answers: ``attempt`` and
        ``token``, or when not given those of the request open now. Returns ``approved``
        or ``denied``; for a refusal, journaled on the job, the reason: ``no_request``,
        ``already_answered``, ``expired`` or ``stale_attempt`` (the attempt that asked no
        longer owns the job). UsageError for bad input."""
        store = self._opened()
        job = _job_id(job_id)
        if (attempt is None) != (token is None):
            raise UsageError("approve: give both attempt and token, or neither (the open "
                             "request's)")
        if attempt is None:
            request = await store.open_approval(job)
            if request is None:
                return "no_request"
            attempt, token = request["attempt"], request["fencing_token"]
        return await store.answer_approval(job, attempt, token, bool(approve), reason, by)

    async def jobs(self, *, tags: Mapping[str, str] | None = None, state: str | None = None,
                   tool: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The newest jobs first (at most ``limit``, 1-1000), filtered by ``state``,
        ``tool`` and ``tags`` (all of them), as dicts of ``id``, ``tool``, ``state``,
        ``attempt``, ``max_attempts``, ``fencing_token``, ``owner_id``, ``lease_until``,
        ``created_at``, ``finished_at``, ``error_kind`` (as ``sidecar jobs``) and ``tags``."""
        if not 1 <= limit <= 1000:
            raise UsageError(f"limit {limit}: must be from 1 to 1000")
        checked = enqueue_args.check_tags(dict(tags)) if tags else None
        rows = await self._opened().list_jobs(state, tool, limit, checked)
        return [dict(row) for row in rows]

    async def unfinished_like(self, tool: str, payload: Any, tags: Mapping[str, str],
                              limit: int = 10) -> list[dict[str, Any]]:
        """The oldest queued or running jobs (at most ``limit``, 1-1000) of ``tool`` with
        the same ``payload`` (as JSON) whose tags include all of ``tags`` (a non-empty
        dict), as dicts of ``id`` and ``tags``: the job a call sent again would join (the
        MCP gateway's calls without an idempotency key). One statement."""
        if not tags:
            raise UsageError("unfinished_like: give at least one tag")
        if not 1 <= limit <= 1000:
            raise UsageError(f"limit {limit}: must be from 1 to 1000")
        text = _payload_text({} if payload is None else payload, 0)  # as enqueue stores it
        rows = await self._opened().unfinished_same_jobs(
            validate_tool_name(tool), text, enqueue_args.check_tags(dict(tags)), limit)
        return [dict(row) for row in rows]

    async def count_unfinished(self, tags: Mapping[str, str], up_to: int = 10_000) -> int:
        """How many queued or running jobs carry all of ``tags`` (a non-empty dict),
        counted up to ``up_to`` + 1."""
        if not tags:
            raise UsageError("count_unfinished: give at least one tag")
        return await self._opened().unfinished_jobs_tagged(
            enqueue_args.check_tags(dict(tags)), up_to)

    async def waiting_reason(self, job_id: JobId) -> JobWaiting | None:
        """Why a queued job waits now (a JobWaiting), None when it is not queued, does not
        exist, or a claim could take it now. One statement (CallerStore.wait_reasons),
        which also ends the job ``expired`` when its start deadline passed."""
        wanted = _job_id(job_id)
        for row in await self._opened().wait_reasons([wanted]):
            if row["reason"] is not None:
                ahead = int(row["ahead"] or 0)
                return JobWaiting(row["id"], row["reason"], ahead, row["detail"],
                                  waiting.waiting_message(row["reason"], ahead,
                                                          row["detail"]))
        return None

    async def get(self, job_id: JobId) -> Job:
        """The job's row as a Job; JobNotFound when there is none (never enqueued, or
        pruned)."""
        wanted = _job_id(job_id)
        row = await self._opened().get_job(wanted)
        if row is None:
            raise JobNotFound(f"no job {wanted}")
        return Job(**{name: row[name] for name in _JOB_FIELDS})


def _non_finite(value: Any) -> bool:
    """True when ``value`` (JSON-like: dicts, lists, scalars) holds a NaN or an infinity
    anywhere; walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _payload_text(payload: Any, limit: int) -> RawJson:
    """The payload as JSON text, at most ``limit`` bytes (0: any), as the CLI checks it;
    UsageError otherwise."""
    if isinstance(payload, RawJson):
        text = payload.encode()
    else:
        if _non_finite(payload):
            raise UsageError("payload holds NaN or an infinity, which JSON cannot write "
                             "(it would be stored as null); send null or a string")
        try:
            text = jsontext.dumps(payload)
        except TypeError as exc:
            try:  # an integer past 64 bits: the standard encoder keeps every digit
                text = json.dumps(payload, ensure_ascii=False, allow_nan=False,
                                  separators=(",", ":")).encode()
            except (TypeError, ValueError, UnicodeEncodeError):
                raise UsageError(f"payload is not JSON ({exc}); pass dicts, lists, "
                                 "strings, numbers, booleans and None") from None
    if limit and len(text) > limit:
        raise UsageError(f"payload: {len(text)} bytes, larger than SIDECAR_MAX_PAYLOAD_BYTES="
                         f"{limit} bytes; pass a reference (a URL or object key) instead, "
                         "or raise that limit")
    return RawJson(text.decode())
