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

Descriptors (issue 25): the server accepts connections itself, so it decides before a
socket is accepted and can count what it holds. Every server of the process shares one
``DescriptorBudget``: no connection is accepted while fewer than ``DESCRIPTOR_RESERVE``
descriptors below the soft ``RLIMIT_NOFILE`` would remain, so a flood of connections never
takes the descriptors a job's setup (work directory, cgroup files, pipes) needs; accepting
pauses and resumes when a connection closes or after ``PAUSE_SECONDS``. With
``ConnectionLimits`` (the guard) a server also caps its connections in total and those
not yet bound to a key (authenticated): a connection over a cap is closed at once, with a
reset, before anything is read. A handler binds the connection to a key
(``Request.bind``), at most ``per_key`` connections per key; the first request of a
connection must bind it within ``bind_seconds`` of the accept or the connection closes
after its answer. Every refusal is reported to ``on_refuse(reason, key)``.

Besides its TCP address, a server may serve listening sockets made elsewhere, each under a
key (``add_listener``: the guard's per-attempt Unix socket, issue 41): a request that came
through one says so in ``Request.via``, so a handler can serve that key alone. The same
caps, timeouts and reserve apply to their connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from http import HTTPStatus

import h11

from sidecar.protocol.errors import SidecarError
from sidecar.protocol.vocabulary import ConnectionRefusal

_READ_CHUNK = 65536
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but HTAB
MAX_HEADER_BYTES = 16384
DESCRIPTOR_RESERVE = 128   # descriptors below the soft RLIMIT_NOFILE no connection may take
RESAMPLE_SECONDS = 1.0     # how old the count of the process's other descriptors may get
PAUSE_SECONDS = 0.25       # accepting paused for the reserve: look again this often
ACCEPT_BATCH = 64          # connections accepted per wake-up of a listener
LISTEN_BACKLOG = 128
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, leaves no TIME_WAIT

# The reasons given to ``on_refuse`` (a key bound to its cap: the guard's attempt).
REFUSED_TOTAL = ConnectionRefusal.TOTAL_CAP
REFUSED_UNBOUND = ConnectionRefusal.UNAUTHENTICATED_CAP
REFUSED_KEY = ConnectionRefusal.ATTEMPT_CAP
REFUSED_RESERVE = ConnectionRefusal.DESCRIPTOR_RESERVE


def _open_descriptors() -> int | None:
    """How many descriptors this process has open now (one listing of /proc/self/fd, less
    the listing's own), or None when /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return None


class DescriptorBudget:
    """How many descriptors the HTTP servers of this process may still take.

    Counting the process's open descriptors on every accept (a listing of /proc/self/fd)
    costs more than the accept; so the servers count what they hold themselves
    (``opened``/``closed``, exact), and the rest of the process (the pool, the tools' pipes,
    work directories, cgroup files) is a listing at most ``resample_seconds`` old. The
    reserve covers what the rest opens between two listings. The limit is the soft
    RLIMIT_NOFILE, read again with each listing."""

    def __init__(self, reserve: int = DESCRIPTOR_RESERVE,
                 resample_seconds: float = RESAMPLE_SECONDS):
        self.reserve = reserve
        self.resample_seconds = resample_seconds
        self.held = 0                 # sockets the servers accepted and have not closed
        self._others = 0              # every other open descriptor, at the last listing
        self._limit = 0
        self._sampled_at = float("-inf")

    def sample(self) -> None:
        """List the process's descriptors now and read the soft RLIMIT_NOFILE."""
        self._limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if self._limit == resource.RLIM_INFINITY:
            self._limit = 1 << 30
        total = _open_descriptors()
        self._others = max(0, total - self.held) if total is not None else 0
        self._sampled_at = time.monotonic()

    def open_estimate(self) -> int:
        """Open descriptors of the process by this count (the servers' own, exact, plus the
        others at the last listing)."""
        return self._others + self.held

    def room(self) -> int:
        """Descriptors the servers may still take before the reserve (may be negative);
        lists /proc/self/fd again when the last listing is older than resample_seconds."""
        if time.monotonic() - self._sampled_at >= self.resample_seconds:
            self.sample()
        return self._limit - self.reserve - self.open_estimate()

    @property
    def limit(self) -> int:
        """The soft RLIMIT_NOFILE at the last listing."""
        if self._sampled_at == float("-inf"):
            self.sample()
        return self._limit

    def opened(self) -> None:
        """A server accepted a socket."""
        self.held += 1

    def closed(self) -> None:
        """A server closed a socket it had accepted."""
        self.held -= 1


# One budget for every server of the process: the descriptors are the process's.
DESCRIPTORS = DescriptorBudget()


@dataclass(frozen=True)
class ConnectionLimits:
    """Caps on one server's connections (module docstring): ``total`` open at once,
    ``unbound`` open and not yet bound to a key, ``per_key`` bound to one key; the first
    request must bind its connection within ``bind_seconds`` of the accept."""

    total: int
    unbound: int
    per_key: int
    bind_seconds: float


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
        self.via: Hashable | None = conn.via  # the key of the listener it came through
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

    def bind(self, key: Hashable) -> bool:
        """Bind this request's connection to ``key`` (the guard: the attempt whose secret
        it sent). False when ``key`` already has ``per_key`` connections (the refusal is
        reported to ``on_refuse``): the connection then closes after the answer. Always
        True on a server without ConnectionLimits."""
        return self._conn.server.bind(self._conn, key)


Handler = Callable[[Request], Awaitable[Response]]


class _Connection:
    def __init__(self, server: HttpServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, accepted_at: float,
                 via: Hashable | None = None):
        self.server = server
        self.via = via  # the key of the listener (add_listener) it was accepted on
        self.reader = reader
        self.writer = writer
        self.accepted_at = accepted_at
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.idle = True  # waiting for a request: nothing to lose by closing it
        self.key: Hashable | None = None  # what Request.bind bound it to
        self.closing = False              # close after the request in flight

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
    TCP address (and the keyed listeners ``add_listener`` gives it). ``start`` binds;
    ``stop`` closes every listener and connection.

    ``limits``: the ConnectionLimits of this server, or None (no caps, no binding; the
    descriptor reserve holds anyway). ``max_connections``: a cap on connections open at
    once for a server whose connections bind to no key (the health server), None: none.
    ``on_refuse(reason, key)`` is called for every connection refused over a cap
    (``key``: the key of an ``attempt_cap`` refusal, else None) and once each time
    accepting pauses for the descriptor reserve (reasons: ConnectionRefusal).
    ``budget``: the process's DescriptorBudget."""

    def __init__(self, routes: dict[tuple[str, str], Handler], *,
                 keepalive_timeout: float = 15.0, header_timeout: float = 10.0,
                 server_name: str = "sidecar", limits: ConnectionLimits | None = None,
                 max_connections: int | None = None,
                 on_refuse: Callable[[str, Hashable | None], None] | None = None,
                 budget: DescriptorBudget = DESCRIPTORS):
        self.routes = routes
        self.max_connections = max_connections
        self.keepalive_timeout = keepalive_timeout
        self.header_timeout = header_timeout
        self.server_name = server_name.encode()
        self.limits = limits
        self.on_refuse = on_refuse or (lambda reason, key: None)
        self.budget = budget
        self._listeners: list[socket.socket] = []
        self._keyed: dict[Hashable, socket.socket] = {}  # add_listener's, by key
        self._tasks: dict[asyncio.Task, _Connection | None] = {}
        self._unbound = 0                           # connections bound to no key
        self._per_key: dict[Hashable, int] = {}     # connections bound to each key
        self._paused: asyncio.TimerHandle | None = None
        self._stopping = False

    @property
    def connections(self) -> int:
        """Connections open now (accepted, not yet closed)."""
        return len(self._tasks)

    def bound(self, key: Hashable) -> int:
        """Connections bound to ``key`` now."""
        return self._per_key.get(key, 0)

    async def start(self, host: str | None, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: any free one; host None or "": every
        interface); return the first bound address. Raises OSError when it cannot be
        bound."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        seen = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError:
                    continue  # a family this host does not have (as asyncio does)
                self._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(address)
                except OSError as err:  # the message asyncio.start_server gave
                    raise OSError(err.errno, "error while attempting to bind on address "
                                  f"{address!r}: {(err.strerror or '').lower()}") from None
                sock.listen(LISTEN_BACKLOG)
                sock.setblocking(False)
        except OSError:
            self._close_listeners()
            raise
        if not self._listeners:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
        self._listen(True)
        bound = self._listeners[0].getsockname()
        return bound[0], bound[1]

    def add_listener(self, sock: socket.socket, key: Hashable) -> bool:
        """Serve ``sock`` (bound and listening, e.g. a Unix socket) too, under ``key``:
        its requests carry ``Request.via == key``. The server owns it from now on and closes
        it in ``remove_listener`` or ``stop``. False, ``sock`` closed, when the server is not
        started or is stopping; a listener already under ``key`` is removed first."""
        self.remove_listener(key)
        if self._stopping or not self._listeners:
            sock.close()
            return False
        sock.setblocking(False)
        self._keyed[key] = sock
        if self._paused is None:
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept, sock, key)
        return True

    def listening(self, key: Hashable) -> bool:
        """Whether a listener added under ``key`` is served now."""
        return key in self._keyed

    def remove_listener(self, key: Hashable) -> None:
        """Stop serving the listener added under ``key`` and close it (connections it
        accepted stay, until ``close_bound`` or their end). Unknown keys are ignored."""
        sock = self._keyed.pop(key, None)
        if sock is None:
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()

    async def stop(self, grace: float = 2.0) -> None:
        """Stop listening, close idle keep-alive connections at once (a Prometheus scrape
        connection holds one open between scrapes, case F24), give in-flight requests up
        to ``grace`` seconds (their connections close after the response), close the rest.
        Safe to call twice."""
        self._stopping = True
        self._close_listeners()
        for conn in self._tasks.values():
            if conn is not None and conn.idle:
                conn.writer.close()  # the pending read sees EOF: the task ends by itself
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def close_bound(self, key: Hashable) -> int:
        """Close the connections bound to ``key`` (idle ones at once, busy ones after
        their answer); return how many."""
        found = 0
        for conn in self._tasks.values():
            if conn is not None and conn.key == key:
                found += 1
                conn.closing = True
                if conn.idle:
                    conn.writer.close()
        return found

    # --- accepting ------------------------------------------------------------

    def _listen(self, on: bool) -> None:
        loop = asyncio.get_running_loop()
        for key, sock in [*((None, sock) for sock in self._listeners), *self._keyed.items()]:
            if on:
                loop.add_reader(sock.fileno(), self._accept, sock, key)
            else:
                loop.remove_reader(sock.fileno())

    def _close_listeners(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        with contextlib.suppress(RuntimeError):  # no running loop: nothing was added
            self._listen(False)
        for sock in [*self._listeners, *self._keyed.values()]:
            sock.close()
        self._listeners = []
        self._keyed = {}

    def _pause(self) -> None:
        """Stop accepting for the descriptor reserve; look again after PAUSE_SECONDS or
        when a connection closes. Reported once per pause."""
        if self._paused is not None:
            return
        self._listen(False)
        self._paused = asyncio.get_running_loop().call_later(PAUSE_SECONDS, self._resume)
        self.on_refuse(REFUSED_RESERVE, None)

    def _resume(self) -> None:
        if self._paused is None or self._stopping:
            return
        self._paused.cancel()
        self._paused = None
        self._listen(True)  # a pending connection makes the listener readable at once

    def _cap_reached(self) -> str | None:
        """The cap a new connection would go over, or None."""
        if self.max_connections is not None and len(self._tasks) >= self.max_connections:
            return REFUSED_TOTAL
        limits = self.limits
        if limits is None:
            return None
        if len(self._tasks) >= limits.total:
            return REFUSED_TOTAL
        if self._unbound >= limits.unbound:
            return REFUSED_UNBOUND
        return None

    def _accept(self, listener: socket.socket, via: Hashable | None = None) -> None:
        """The listener is readable: accept what waits, up to ACCEPT_BATCH; a connection
        over a cap is reset at once, unread; none is accepted into the reserve."""
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            if self._stopping or self._paused is not None:
                return
            if self.budget.room() < 1:
                self._pause()
                return
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.budget.sample()  # the count was wrong: take it again
                    self._pause()
                    return
                raise
            reason = self._cap_reached()
            if reason is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                sock.close()
                self.on_refuse(reason, None)
                continue
            self.budget.opened()
            self._unbound += 1
            task = loop.create_task(self._serve_socket(sock, time.monotonic(), via))
            self._tasks[task] = None

    def bind(self, conn: _Connection, key: Hashable) -> bool:
        """Request.bind: bind ``conn`` to ``key`` unless ``key`` has its cap."""
        if self.limits is None or conn.key == key:
            return True
        if self._per_key.get(key, 0) >= self.limits.per_key:
            self.on_refuse(REFUSED_KEY, key)
            return False
        self._unbind(conn)
        self._per_key[key] = self._per_key.get(key, 0) + 1
        conn.key = key
        return True

    def _unbind(self, conn: _Connection) -> None:
        if conn.key is None:
            self._unbound -= 1
            return
        left = self._per_key[conn.key] - 1
        if left:
            self._per_key[conn.key] = left
        else:
            del self._per_key[conn.key]
        conn.key = None
        self._unbound += 1

    async def _serve_socket(self, sock: socket.socket, accepted_at: float,
                            via: Hashable | None = None) -> None:
        """One connection's whole life, from the accepted socket to its close."""
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        writer = None
        try:
            reader = asyncio.StreamReader(limit=_READ_CHUNK, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            conn = _Connection(self, reader, writer, accepted_at, via)
            self._tasks[task] = conn
            await self._requests(conn)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except OSError:
            pass  # the socket could not be set up (ENOMEM...): it closes below
        except asyncio.CancelledError:
            # Cancelled by stop() after its grace: this task is the connection's whole
            # life; ending it cancelled would only log an error.
            pass
        finally:
            conn = self._tasks.pop(task, None)
            if conn is not None and conn.key is not None:
                self._unbind(conn)
            self._unbound -= 1
            if writer is None:
                sock.close()
            else:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
                writer.transport.abort()  # closed already, unless the peer never read
            self.budget.closed()
            if self._paused is not None:
                self._resume()

    async def _requests(self, conn: _Connection) -> None:
        first = True
        while True:
            if self._stopping or conn.closing:
                return
            conn.idle = True
            if first and self.limits is not None:
                # The first request binds the connection (the guard: its secret) soon
                # after the accept, or the connection goes.
                left = conn.accepted_at + self.limits.bind_seconds - time.monotonic()
                wait = min(self.header_timeout, max(0.0, left))
            else:
                wait = self.header_timeout if first else self.keepalive_timeout
            try:
                async with asyncio.timeout(wait):
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
            if self.limits is not None and conn.key is None:
                conn.closing = True  # not bound by its request: no second chance
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
        if conn.h11.their_state is not h11.DONE or self._stopping or conn.closing:
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
