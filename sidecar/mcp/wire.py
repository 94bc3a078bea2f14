"""Exact numbers across the MCP edge (issue 41, point 16; case F11 carried to ``sidecar mcp``).

Inside, the sidecar keeps every digit of a JSON number (sidecar.protocol.jsontext: an
integer of 2**64 or more, a decimal beyond a double's precision is an ``ExactNumber``).
The MCP SDK would not carry them: it parses a request with pydantic (a long decimal
becomes the nearest double) and writes a response with pydantic (an ``ExactNumber`` is
"not JSON serializable"). So the edge does both ends itself:

- in: ``ExactWire`` reads the body of a POST (at most ``limit`` bytes; a larger one is
  passed on for the SDK's 413) and, when it may hold such a number
  (``jsontext.number_shape``), parses it exactly and keeps the request's ``params`` in the
  scope (``EXACT_BODY``) for ``exact_arguments``, which the call handler takes instead of
  the SDK's rounded ones;
- out: ``Marks.encode`` turns every ``ExactNumber`` of a result into a string holding its
  digits between marks no one else can write (a per-process random nonce, in ASCII), which pydantic
  writes as any string; ``ExactWire`` rewrites each marked string of a response body back
  into the bare number, so the JSON text the client reads holds the same digits.

Over stdio (no HTTP bodies to rewrite) ``Marks`` is None and ``plain`` writes an integer
as a Python int (exact) and a decimal as the nearest float; the text content keeps every
digit either way.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Mapping
from typing import Any

from sidecar.protocol import jsontext

# The scope key of a request's exactly parsed JSON-RPC message (a dict), when it has one.
EXACT_BODY = "sidecar.exact_body"
# What a request body that cannot be parsed exactly leaves there instead: the reason.
EXACT_ERROR = "sidecar.exact_error"


class Marks:
    """The marks of one gateway process: ``encode(value)`` replaces each ``ExactNumber`` of
    ``value`` (dicts and lists, any depth) by a marked string; ``restore(body)`` turns the
    JSON text of each marked string in ``body`` (UTF-8 bytes) back into the number. The
    nonce (64 random bits) keeps a tool's own strings from ever being read as marks."""

    def __init__(self) -> None:
        # ASCII only: every JSON writer leaves it as it is (no \u escapes to undo).
        self.start = f"sidecar-exact-number-{secrets.token_hex(8)}:"
        self.end = ";"
        self.prefix = self.start.encode()
        self.pattern = re.compile(
            b'"' + re.escape(self.prefix) + rb"(-?[0-9][0-9.eE+-]{0,200000})"
            + re.escape(self.end.encode()) + b'"')

    def encode(self, value: Any) -> Any:
        """``value`` with every ExactNumber marked (a new structure where one was found)."""
        if isinstance(value, jsontext.ExactNumber):
            return f"{self.start}{value.text}{self.end}"
        if isinstance(value, dict):
            return {key: self.encode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.encode(item) for item in value]
        return value

    def restore(self, body: bytes) -> bytes:
        """``body`` with every marked string written as its bare number."""
        if self.prefix not in body:
            return body
        return self.pattern.sub(rb"\1", body)


def plain(value: Any) -> Any:
    """``value`` with every ExactNumber as a Python int when it is an integer (exact on
    every wire) and as the nearest float otherwise (stdio, where bodies are not rewritten)."""
    if isinstance(value, jsontext.ExactNumber):
        text = value.text.lstrip("-")
        if text.isdigit() and len(text) <= 4000:  # int() refuses longer texts
            return int(value.text)
        return float(value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def exact_arguments(scope: Mapping[str, Any] | None, request_id: Any,
                    name: str) -> dict[str, Any] | None:
    """The ``arguments`` of the tools/call ``request_id`` of tool ``name`` as the client
    wrote them, every number exact, when ``ExactWire`` parsed its body; None when the body
    held no number a double could change (the SDK's arguments are exact then). Raises
    ``jsontext.NumberOutOfRange`` for a number PostgreSQL's jsonb cannot store."""
    if scope is None:
        return None
    if (error := scope.get(EXACT_ERROR)) is not None:
        raise error
    message = scope.get(EXACT_BODY)
    if not isinstance(message, dict) or message.get("method") != "tools/call":
        return None
    if str(message.get("id")) != str(request_id):
        return None
    params = message.get("params")
    if not isinstance(params, dict) or params.get("name") != name:
        return None
    arguments = params.get("arguments")
    return arguments if isinstance(arguments, dict) else None


class ExactWire:
    """ASGI middleware of the HTTP transport (see the module): exact request numbers into
    the scope, marked numbers out of every response body. ``limit``: the largest body it
    reads (the gateway's --max-request-bytes); bodies are bounded by the SDK as before."""

    def __init__(self, app: Any, marks: Marks, limit: int):
        self.app = app
        self.marks = marks
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "POST":
            receive = await self._read_body(scope, receive)
        await self.app(scope, receive, self._sender(send))

    async def _read_body(self, scope: dict, receive: Any) -> Any:
        """Read the body (up to ``limit`` + 1 bytes), parse it exactly when it may need it,
        and give the app a ``receive`` that replays what was read, then the rest."""
        read: list[dict] = []
        size, more = 0, True
        while more and size <= self.limit:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        if not more and size <= self.limit:
            body = b"".join(m.get("body", b"") for m in read if m["type"] == "http.request")
            shape = jsontext.number_shape(body)
            if b"0" * 16 in shape or b"0e" in shape:
                try:
                    scope[EXACT_BODY] = jsontext.loads(body, shape, bounded=True)
                except jsontext.NumberOutOfRange as exc:
                    scope[EXACT_ERROR] = exc
                except ValueError:  # not JSON: the SDK answers its parse error
                    pass

        async def replay() -> dict:
            if read:
                return read.pop(0)
            return await receive()

        return replay

    def _sender(self, send: Any) -> Any:
        """``send`` rewriting marked numbers in every body; a response with a
        Content-Length is held until its (single) body is known, so the length is right."""
        held: list[dict] = []

        async def sender(message: dict) -> None:
            if message["type"] == "http.response.start":
                if any(name.lower() == b"content-length" for name, _ in message.get("headers", ())):
                    held.append(message)
                    return
                await send(message)
                return
            if message["type"] == "http.response.body":
                body = self.marks.restore(message.get("body", b""))
                if held:
                    start = held.pop()
                    if message.get("more_body", False):  # streamed after all: no rewrite
                        await send(start)
                        await send(message)
                        return
                    headers = [(n, v) for n, v in start.get("headers", ())
                               if n.lower() != b"content-length"]
                    headers.append((b"content-length", str(len(body)).encode()))
                    await send({**start, "headers": headers})
                await send({**message, "body": body})
                return
            await send(message)

        return sender


class ProgressClock:
    """The ``progress`` of one call's ``notifications/progress``, which MCP requires to
    increase with every notification, even across a retried attempt whose tool starts
    again from 0. A report with a value v (0..1) in attempt n is ``(n - 1) + v`` of a
    ``total`` of n (attempt 1: v of 1, as the tool said); a report without a value is the
    count of reports so far, with no total. A report that would not increase it (the tool
    went back, or repeated itself) is sent as the smallest double above the last one."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.reports = 0

    def next(self, value: float | None, attempt: int | None) -> tuple[float, float | None]:
        """``(progress, total)`` of the next report: ``value`` (0..1 or None) reported in
        ``attempt`` (1-based; None counts as 1)."""
        self.reports += 1
        if value is not None:
            number = max(attempt or 1, 1)
            progress, total = float(number - 1) + float(value), float(number)
        else:
            progress, total = float(self.reports), None
        if self.last is not None and not progress > self.last:
            progress = math.nextafter(self.last, math.inf)
        self.last = progress
        return progress, total
