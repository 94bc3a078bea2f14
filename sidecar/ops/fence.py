"""Fenced side effects, the receiver's half: refuse stale owners, replay repeats.

A service that performs side effects for sidecar jobs (create a case, capture a
payment) uses this module on its fenced routes. Every fenced request carries

- ``Idempotency-Key`` (required): 1-512 printable characters, stable per operation
  (P17), e.g. ``tool-job:8f1b:create_case``;
- ``X-Execution-Fence`` (required): the job's fencing token, an integer from 0 to
  2**63-1 (P7);
- ``X-Fence-Entity`` (optional): what the token protects. Default: the key up to its
  last ``:`` (``tool-job:8f1b``); a key without one (or starting with it) is its own.

and is decided in ONE PostgreSQL transaction, in this order (P18):

1. the entity's row in ``fence_entities`` is locked, so one entity's requests are
   decided one at a time; a token lower than the last accepted one gets
   ``409 {"error": "stale_fence", "fence": 41, "current": 42}``. This comes before
   the replay: an old owner's late request reuses the stable key and must learn
   that it lost, not receive the new owner's answer.
2. the key is claimed in ``fence_requests``. A key seen before replays its stored
   status and body (header ``Idempotent-Replayed: true``) without running the
   handler; with a different body (sha256 of the bytes) it is
   ``422 {"error": "idempotency_key_reused", "idempotency_key": K, "message": ...}``.
   A concurrent duplicate waits for the first transaction, then replays its answer
   (or, when the first stored nothing, runs in its place); after ``lock_timeout``
   seconds of waiting it gets ``409 {"error": "in_progress", ...}``. A key's handler
   never runs twice in committed transactions.
3. the handler runs on the same connection, so its own writes commit or roll back
   with the bookkeeping.
4. the answer is recorded: 2xx and 4xx are stored for replay, 5xx are not (the
   client may retry). Only 2xx advances the entity's last accepted fence, to
   ``greatest(old, new)``. A replay advances nothing.

Other answers: a missing or malformed header is
``400 {"error": "bad_header", "header": NAME, "message": ...}`` (nothing touched); a
handler that raises rolls everything back (no effect, no record, no fence advance)
and gets ``500 {"error": "handler_failed"}``; a database failure in the bookkeeping
is ``503 {"error": "fence_unavailable", ...}``, and retrying with the same key is
safe either way.

aiohttp::

    @fenced
    async def create_case(request):
        fence = request["fence"]                      # FencedRequest
        case_id = await fence.conn.fetchval("INSERT ... RETURNING id", ...)
        return web.json_response({"case_id": case_id}, status=201)

    app = web.Application(middlewares=[fence_middleware(pool)])

Any other framework: ``await run_fenced(pool, headers, body, handler)``.

The tables are created by ``sidecar migrate`` (``sql/migrations/002_fence.sql``);
``fence_requests`` grows by one row per key, and pruning old keys is the operator's call.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from aiohttp import web

from sidecar.protocol import jsontext
from sidecar.protocol.errors import SidecarError
from sidecar.runtime.log import log
from sidecar.storage import db
from sidecar.storage.queries import Q

IDEMPOTENCY_KEY = "Idempotency-Key"
EXECUTION_FENCE = "X-Execution-Fence"
FENCE_ENTITY = "X-Fence-Entity"
REPLAYED = "Idempotent-Replayed"
MAX_FENCE = 2**63 - 1
MAX_TEXT_LENGTH = 512
DEFAULT_LOCK_TIMEOUT = 5.0

_FENCED_ATTR = "__sidecar_fenced__"
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class FencedRequest:
    """What a fenced handler works with.

    ``conn`` is the connection inside the deciding transaction: write the effect with
    it so effect and bookkeeping commit together, and do not keep it after returning.
    ``body`` is the raw request body (its sha256 tells a repeat from a reused key).
    """

    conn: asyncpg.Connection
    idempotency_key: str
    fence: int
    entity: str
    body: bytes

    @property
    def connection(self) -> asyncpg.Connection:
        """The same as ``conn``."""
        return self.conn

    def json(self) -> Any:
        """The body parsed as JSON, every number exact (sidecar.protocol.jsontext; raises
        ``orjson.JSONDecodeError``)."""
        return jsontext.loads(self.body)


@dataclass(frozen=True)
class FencedResponse:
    """The answer of a fenced request: HTTP ``status``, a JSON-able ``body_json``, and
    ``replayed`` = True when it is a stored answer given again."""

    status: int
    body_json: Any
    replayed: bool = False


# handler(conn, request) -> (status, JSON-able body)
Handler = Callable[[asyncpg.Connection, FencedRequest], Awaitable[tuple[int, Any]]]
_F = TypeVar("_F", bound=Callable[..., Any])


class BadHeader(SidecarError, ValueError):
    """A fenced request's header is missing or malformed; ``header`` names it."""

    def __init__(self, header: str, message: str):
        super().__init__(f"{header}: {message}")
        self.header = header
        self.message = message

    def response(self) -> FencedResponse:
        return FencedResponse(400, {"error": "bad_header", "header": self.header,
                                    "message": self.message})


class _HandlerFailed(SidecarError):
    """The handler raised or returned something unusable; the transaction rolls back."""


def default_entity(idempotency_key: str) -> str:
    """The job part of a key: ``tool-job:8f1b:create_case`` -> ``tool-job:8f1b``."""
    job, _, _ = idempotency_key.rpartition(":")
    return job or idempotency_key


def _text_header(name: str, value: str) -> str:
    if not value.strip() or len(value) > MAX_TEXT_LENGTH or not value.isprintable():
        raise BadHeader(name, f"must be 1-{MAX_TEXT_LENGTH} printable characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadHeader(name, "is not valid UTF-8") from None
    return value


def parse_fence_headers(headers: Mapping[str, str]) -> tuple[str, int, str]:
    """``(idempotency_key, fence, entity)`` from request headers (names case-insensitive).

    Raises BadHeader for a missing, repeated or malformed header.
    """
    found: dict[str, list[str]] = {}
    for name, value in headers.items():
        found.setdefault(name.lower(), []).append(value)

    def one(name: str, required: bool) -> str | None:
        values = found.get(name.lower(), [])
        if len(values) > 1:
            raise BadHeader(name, "is given more than once")
        if not values and required:
            raise BadHeader(name, "is required on this fenced route")
        return values[0] if values else None

    key = _text_header(IDEMPOTENCY_KEY, one(IDEMPOTENCY_KEY, True))
    raw_fence = one(EXECUTION_FENCE, True)
    if not _DIGITS.fullmatch(raw_fence) or int(raw_fence) > MAX_FENCE:
        raise BadHeader(EXECUTION_FENCE, f"must be an integer from 0 to {MAX_FENCE} "
                                         f"(the job's fencing token), got {raw_fence[:40]!r}")
    entity = one(FENCE_ENTITY, False)
    entity = default_entity(key) if entity is None else _text_header(FENCE_ENTITY, entity)
    return key, int(raw_fence), entity


async def run_fenced(
    pool: asyncpg.Pool, headers: Mapping[str, str], body: bytes, handler: Handler, *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> FencedResponse:
    """Decide one fenced request and run ``handler`` at most once for its key.

    ``headers``: the request headers (any mapping; names case-insensitive).
    ``body``: the raw request body. ``handler(conn, FencedRequest)`` returns
    ``(status, JSON-able body)`` and writes its effect with ``conn``.
    ``lock_timeout``: seconds to wait for a concurrent request of the same entity or
    key before answering 409 in_progress. Never raises for a request or database
    problem: every outcome is a FencedResponse (see the module docstring).
    """
    response, _ = await _run(pool, headers, body, handler, lock_timeout, ())
    return response


async def _run(
    pool: asyncpg.Pool, headers: Mapping[str, str], body: bytes, handler: Handler,
    lock_timeout: float, passthrough: tuple[type[BaseException], ...],
) -> tuple[FencedResponse, bool]:
    """run_fenced, plus: exceptions of ``passthrough`` types raised by the handler
    propagate after the rollback; the bool says whether the handler gave the answer."""
    if not lock_timeout > 0:
        raise ValueError("lock_timeout must be a positive number of seconds")
    try:
        key, fence, entity = parse_fence_headers(headers)
    except BadHeader as exc:
        return exc.response(), False
    fields = {"idempotency_key": key, "entity": entity, "fencing_token": fence}
    try:
        async with pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                local = db.local_settings_sql(conn)  # behind a transaction pooler (F18)
                if local:
                    await conn.execute(local)
                response, commit, from_handler = await _decide(
                    conn, key, fence, entity, body, handler, lock_timeout, passthrough)
            except BaseException:
                with contextlib.suppress(Exception):
                    await tx.rollback()
                raise
            await (tx.commit() if commit else tx.rollback())
            return response, from_handler
    except asyncpg.LockNotAvailableError:
        return _in_progress(key, entity, lock_timeout), False
    except _HandlerFailed as exc:
        cause = exc.__cause__ or exc
        log.emit("fence_handler_failed", "error", reason=type(cause).__name__,
                 message=str(cause).splitlines()[0][:200] if str(cause) else None, **fields)
        return FencedResponse(500, {"error": "handler_failed", "message":
                                    "the handler failed; nothing was recorded"}), False
    except db.DATABASE_ERRORS as exc:
        log.emit("fence_unavailable", "error", reason=type(exc).__name__, **fields)
        return FencedResponse(503, {
            "error": "fence_unavailable",
            "message": f"the fence bookkeeping failed ({type(exc).__name__}); nothing was "
                       "recorded unless a retry with the same key replays it"}), False


def _in_progress(key: str, entity: str, lock_timeout: float) -> FencedResponse:
    return FencedResponse(409, {
        "error": "in_progress",
        "message": f"a request for key {key!r} or entity {entity!r} was still running after "
                   f"{lock_timeout:g} s; retry with the same {IDEMPOTENCY_KEY}"})


async def _decide(
    conn: asyncpg.Connection, key: str, fence: int, entity: str, body: bytes,
    handler: Handler, lock_timeout: float, passthrough: tuple[type[BaseException], ...],
) -> tuple[FencedResponse, bool, bool]:
    """The steps inside the transaction; returns (answer, commit?, from handler?)."""
    wait_ms = max(1, round(lock_timeout * 1000))  # 0 would mean "wait forever"
    previous = await conn.fetchval(Q["fence_set_lock_timeout"], f"{wait_ms}ms")
    current = await conn.fetchval(Q["fence_lock_entity"], entity)
    if current is not None and fence < current:
        log.emit("fence_stale", "warning", idempotency_key=key, entity=entity,
                 fencing_token=fence, current=current)
        return FencedResponse(409, {"error": "stale_fence", "fence": fence,
                                    "current": current}), False, False
    digest = hashlib.sha256(body).hexdigest()
    # A skipped claim is never taken as done (case F22): the stored answer is read, and a
    # row deleted in between (an operator pruning keys) is claimed again.
    stored = None
    for _ in range(3):
        if await conn.fetchval(Q["fence_claim_key"], key, entity, fence, digest):
            break
        stored = await conn.fetchrow(Q["fence_stored_response"], key)
        if stored is not None:
            break
    else:
        return _in_progress(key, entity, lock_timeout), False, False
    if stored is not None:
        if stored["body_sha256"] != digest:
            return FencedResponse(422, {
                "error": "idempotency_key_reused", "idempotency_key": key,
                "message": "this key was used with a different body; use a new key for a "
                           "different operation"}), False, False
        if stored["status"] is None:  # not reachable: a claim commits with its answer
            return _in_progress(key, entity, lock_timeout), False, False
        return FencedResponse(stored["status"], jsontext.loads(stored["response_text"]),
                              replayed=True), False, False
    # The handler's own statements run under the caller's lock_timeout again.
    await conn.fetchval(Q["fence_set_lock_timeout"], previous)
    try:
        status, answer = await handler(conn, FencedRequest(conn, key, fence, entity, body))
        if not (type(status) is int and 100 <= status <= 599):
            raise TypeError(f"the handler returned status {status!r}; expected 100-599")
        answer_text = jsontext.dumps(answer).decode()
    except passthrough:
        raise
    except Exception as exc:
        raise _HandlerFailed(str(exc)) from exc
    if status >= 500:
        return FencedResponse(status, answer), False, True
    await conn.execute(Q["fence_record_response"], key, entity, fence, status, answer_text)
    return FencedResponse(status, answer), True, True


# --- aiohttp ------------------------------------------------------------------


def fenced(handler: _F) -> _F:
    """Mark an aiohttp handler as fenced (for ``fence_middleware``); returns it unchanged.

    The handler finds a FencedRequest in ``request["fence"]`` and must answer with a
    JSON response (``web.json_response``), which is what gets stored and replayed.
    Raising ``web.HTTPException`` rolls back and answers without recording anything.
    """
    setattr(handler, _FENCED_ATTR, True)
    return handler


def fence_middleware(
    pool: asyncpg.Pool, *, paths: Iterable[str] = (),
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
):
    """aiohttp middleware running ``@fenced`` handlers, and every handler of a path in
    ``paths`` (any method), through the fence (see ``run_fenced``); other routes pass."""
    fenced_paths = frozenset(paths)

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if not (getattr(request.match_info.handler, _FENCED_ATTR, False)
                or getattr(handler, _FENCED_ATTR, False) or request.path in fenced_paths):
            return await handler(request)
        original: list[web.StreamResponse] = []

        async def call(conn: asyncpg.Connection, fence: FencedRequest) -> tuple[int, Any]:
            request["fence"] = fence
            response = await handler(request)
            body = getattr(response, "body", None)
            if not isinstance(body, bytes):
                raise TypeError("a fenced handler must return a JSON web.Response")
            original.append(response)
            return response.status, jsontext.loads(body)

        result, from_handler = await _run(pool, request.headers, await request.read(), call,
                                          lock_timeout, (web.HTTPException,))
        if from_handler:
            return original[0]
        headers = {REPLAYED: "true"} if result.replayed else None
        return web.Response(body=jsontext.dumps(result.body_json), status=result.status,
                            headers=headers, content_type="application/json")

    return middleware
