"""Resumable SSE streams of ``sidecar mcp`` (issue 41, point 11; SEP-1699).

On the 2025-11-25 revision a POST's response is an SSE stream, and a client whose
connection drops mid-call may reconnect with a GET carrying ``Last-Event-ID``. The SDK
does that with an ``EventStore``: every event of the stream gets an id, the stream starts
with a priming event (an id and empty data) and a ``retry:`` field, and a reconnect is
answered by replaying what the store kept after that id.

``JobReplay`` is that store without storing anything: the job row already holds what a
client missed. An event id is ``REQUEST.N`` (the JSON-RPC request id the stream answers,
base64url, and a count). A GET with ``Last-Event-ID`` on any replica (the session is the
database's, sidecar.mcp.sessions) finds the job of that session's request by its tags
(``mcp.session``, ``mcp.tool_call``), waits for its end without polling, and sends the
tool result as the request's response. A request that was not a job (``tools/list``, a
refused call) has nothing to replay: the stream ends. Not replayed: the progress
notifications the client missed (the stream carries the end); a request id written as a
string of digits is answered as the number.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.streamable_http import EventCallback, EventMessage, EventStore
from mcp_types import JSONRPCResponse

# A request id longer than this (as text) is not replayable: its events get ids all the same.
MAX_REQUEST_TEXT = 256
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")

# (session id, request id as text) -> the result of the request's job (a JSON-RPC result
# dict), or None when that request was not a job.
Replayer = Callable[[str, str], Awaitable[dict[str, Any] | None]]


class JobReplay(EventStore):
    """The EventStore of one session (see the module): ``replay(session_id, request)``
    waits for the end of the request's job and gives its result (Gateway.replay)."""

    def __init__(self, session_id: str, replay: Replayer):
        self.session_id = session_id
        self.replay = replay
        self._count = itertools.count(1)

    async def store_event(self, stream_id: str, message: Any) -> str:
        """An id for the next event of ``stream_id`` (nothing is stored)."""
        return event_id(stream_id, next(self._count))

    async def replay_events_after(self, last_event_id: str,
                                  send_callback: EventCallback) -> str | None:
        """Send the response of the request ``last_event_id`` belongs to, from its job;
        None: the SDK ends the stream after it (no live tail)."""
        request = request_of(last_event_id)
        if request is None:
            return None
        result = await self.replay(self.session_id, request)
        if result is None:
            return None
        rid: int | str = int(request) if _INTEGER.fullmatch(request) else request
        response = JSONRPCResponse(jsonrpc="2.0", id=rid, result=result)
        await send_callback(EventMessage(response, event_id(request, next(self._count))))
        return None


def event_id(stream_id: str, count: int) -> str:
    """``REQUEST.N``: the stream's request id (base64url, no padding) and a count."""
    if len(stream_id) > MAX_REQUEST_TEXT:
        return f"-.{count}"
    encoded = base64.urlsafe_b64encode(stream_id.encode("utf-8", "surrogatepass"))
    return f"{encoded.decode().rstrip('=')}.{count}"


def request_of(event: str) -> str | None:
    """The request id (as text) of an ``event_id``; None for one that is not ours."""
    encoded, dot, count = event.rpartition(".")
    if not dot or not count.isdigit() or not encoded or encoded == "-" \
            or len(encoded) > 2 * MAX_REQUEST_TEXT:
        return None
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, ValueError):
        return None
