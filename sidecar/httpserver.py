"""A small HTTP/1.1 server for the sidecar's own endpoints (the guard API, /metrics,
/livez, /readyz): h11 parses and frames the protocol, asyncio streams carry it.

Why not aiohttp here: importing it costs every sidecar about 12 MiB of resident memory
(bench section 6), and these endpoints need a few routes, a body limit and keep-alive;
aiohttp stays for the outbox forwarder's client and the reference receiver, imported only
where they run.

Each connection is its own task: a slow or hostile client holds only its own connection.
Headers must arrive within ``header_timeout`` seconds, and an idle keep-alive connection
is closed after ``keepalive_timeout``. A request body is read only when the handler asks
for it (``Request.read``); ``Expect: 100-continue`` is answered then, any other
expectation is ignored. A response sent before the body was read closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11

from sidecar.errors import SidecarError

_READ_CHUNK = 65536
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but HTAB
MAX_HEADER_BYTES = 16384


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


class BodyTooLarge(SidecarError):
    """The request body is longer than the handler's limit (``Request.read``'s ``limit``,
    bytes); the server answers 413."""

    def __init__(self, message: str = "the request body is longer than the handler's limit"):
        super().__init__(message)


@dataclass(frozen=True)
class Response:
    """What a handler returns: ``status``, ``body`` (bytes), its ``content_type`` and any
    extra ``headers`` (name, value) pairs."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


class Request:
    """One request: ``method``, ``path`` (without the query), ``query`` (text after ``?``),
    ``headers`` as (lower-case name, value) pairs decoded as latin-1, ``content_length``
    (None when not given)."""

    def __init__(self, conn: _Connection, event: h11.Request):
        self._conn = conn
        self.method = event.method.decode("ascii", "replace")
        target = event.target.decode("latin-1")
        self.path, _, self.query = target.partition("?")
        self.headers = [(name.decode("latin-1").lower(), value.decode("latin-1"))
                        for name, value in event.headers]
        length = self.header_values("content-length")
        self.content_length = int(length[0]) if len(length) == 1 and length[0].isdigit() \
            else None

    def header_values(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive), in order."""
        name = name.lower()
        return [value for key, value in self.headers if key == name]

    def header(self, name: str, default: str = "") -> str:
        """The first value of header ``name``, else ``default``."""
        values = self.header_values(name)
        return values[0] if values else default

    async def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes. Raises BodyTooLarge past the limit
        (the rest is not read), ConnectionError when the client goes away."""
        return await self._conn.read_body(limit)


Handler = Callable[[Request], Awaitable[Response]]


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.idle = True  # waiting for a request: nothing to lose by closing it

    async def next_event(self):
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.reader.read(_READ_CHUNK)
            self.h11.receive_data(data)  # b"" is EOF

    async def send(self, *events) -> None:
        for event in events:
            data = self.h11.send(event)
            if data:
                self.writer.write(data)
        await self.writer.drain()

    async def read_body(self, limit: int) -> bytes:
        if self.h11.they_are_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[],
                                                      reason=b"Continue"))
        body = bytearray()
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                if len(body) + len(event.data) > limit:
                    raise BodyTooLarge()
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:  # ConnectionClosed or a protocol error's aftermath
                raise ConnectionError("the client closed the connection during the body")


class HttpServer:
    """Serve ``routes`` ({(method, path): handler}; a GET route also answers HEAD) on one
    TCP address. ``start`` binds; ``stop`` closes the listener and every connection."""

    def __init__(self, routes: dict[tuple[str, str], Handler], *,
                 keepalive_timeout: float = 15.0, header_timeout: float = 10.0,
                 server_name: str = "sidecar"):
        self.routes = routes
        self.keepalive_timeout = keepalive_timeout
        self.header_timeout = header_timeout
        self.server_name = server_name.encode()
        self._server: asyncio.Server | None = None
        self._tasks: dict[asyncio.Task, _Connection] = {}
        self._stopping = False

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: any free one); return the bound address.
        Raises OSError when it cannot be bound."""
        self._server = await asyncio.start_server(self._serve, host, port,
                                                  reuse_address=True)
        bound = self._server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def stop(self, grace: float = 2.0) -> None:
        """Stop listening, close idle keep-alive connections at once (a Prometheus scrape
        connection holds one open between scrapes, case F24), give in-flight requests up
        to ``grace`` seconds (their connections close after the response), close the rest.
        Safe to call twice."""
        self._stopping = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in self._tasks.values():
            if conn.idle:
                conn.writer.close()  # the pending read sees EOF: the task ends by itself
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), grace)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        conn = _Connection(reader, writer)
        self._tasks[task] = conn
        try:
            await self._requests(conn)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Cancelled by stop() after its grace: this task is the connection's whole
            # life, and asyncio's stream callback logs an error for a cancelled one.
            pass
        finally:
            self._tasks.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _requests(self, conn: _Connection) -> None:
        first = True
        while True:
            if self._stopping:
                return
            conn.idle = True
            try:
                async with asyncio.timeout(self.header_timeout if first
                                           else self.keepalive_timeout):
                    event = await conn.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(conn, exc)
                return
            finally:
                conn.idle = False
            first = False
            if not isinstance(event, h11.Request):
                return  # ConnectionClosed
            if any(_CONTROL.search(value) for _, value in event.headers):
                # RFC 9110 5.5: a control character makes the field invalid. h11 lets them
                # through; refused here, they never reach a handler or a log line.
                await self._protocol_error(conn, h11.RemoteProtocolError(
                    "control character in a header value", 400))
                return
            request = Request(conn, event)
            response = await self._dispatch(request)
            await self._respond(conn, request, response)
            if conn.h11.their_state is not h11.DONE or conn.h11.our_state is not h11.DONE:
                return  # body left unread, or Connection: close
            conn.h11.start_next_cycle()

    async def _dispatch(self, request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        handler = self.routes.get((method, request.path))
        if handler is None:
            allowed = [m for m, path in self.routes if path == request.path]
            if allowed:
                return Response(405, b'{"error": "method_not_allowed"}',
                                headers=(("Allow", ", ".join(allowed)),))
            return Response(404, b'{"error": "not_found"}')
        try:
            return await handler(request)
        except h11.RemoteProtocolError:
            raise ConnectionError("bad request body") from None

    async def _respond(self, conn: _Connection, request: Request, response: Response) -> None:
        if conn.h11.their_state is h11.SEND_BODY:
            # A request without a body (or one fully received) ends here without a read;
            # a body the handler did not read means the connection closes after this.
            with contextlib.suppress(h11.RemoteProtocolError):
                conn.h11.next_event()
        body = b"" if request.method == "HEAD" else response.body
        headers = [(b"Server", self.server_name),
                   (b"Content-Type", response.content_type.encode("latin-1")),
                   (b"Content-Length", str(len(response.body)).encode()),
                   *((k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers)]
        if conn.h11.their_state is not h11.DONE or self._stopping:
            headers.append((b"Connection", b"close"))
        await conn.send(h11.Response(status_code=response.status, headers=headers,
                                     reason=_reason(response.status)))
        await conn.send(h11.Data(data=body) if body else h11.EndOfMessage(),
                        *((h11.EndOfMessage(),) if body else ()))

    async def _protocol_error(self, conn: _Connection, exc: h11.RemoteProtocolError) -> None:
        """A request h11 cannot parse: answer its status (400, 431, ...) if we still may."""
        if conn.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = exc.error_status_hint or 400
        body = b'{"error": "bad_request"}'
        with contextlib.suppress(h11.LocalProtocolError, ConnectionError):
            await conn.send(h11.Response(status_code=status, headers=[
                (b"Content-Type", b"application/json"),
                (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]),
                h11.Data(data=body), h11.EndOfMessage())
