"""A TCP proxy the tests control, in a thread: pass traffic, or blackhole it.

Blackholed, it keeps every socket open and drops every byte in both directions, and new
connections are accepted and held without reaching the server: the silent path of a
network partition, which a client notices only by its own timeouts (a closed socket would
be far kinder). ``restore()`` forwards again; connections that lost bytes are garbage to
their clients, which must reconnect, as after a real partition.

The upstream is ``(host, port)`` or a Unix socket path (the embedded PostgreSQL).
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import parse_qs, urlsplit, urlunsplit


def upstream_of(dsn: str):
    """The server a DSN points at: (host, port) or a Unix socket path."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = parts.hostname or (query.get("host") or ["127.0.0.1"])[0]
    port = parts.port or int((query.get("port") or ["5432"])[0])
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}"
    return host, port


def through(dsn: str, port: int) -> str:
    """The same DSN (user, database, options) pointed at 127.0.0.1:port."""
    parts = urlsplit(dsn)
    query = "&".join(f"{k}={v[0]}" for k, v in parse_qs(parts.query).items()
                     if k not in ("host", "port"))
    user = parts.username or "postgres"
    auth = f"{user}:{parts.password}@" if parts.password else f"{user}@"
    return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{port}", parts.path, query, ""))


class BlackholeProxy:
    def __init__(self, upstream):
        self.upstream = upstream
        self.blackholed = False
        self.port = 0
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()  # one per connection (its _accept)

    def start(self) -> int:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._accept, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.port

    def blackhole(self) -> None:
        self.blackholed = True

    def restore(self) -> None:
        self.blackholed = False

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            # Every connection's relays end here, on the running loop, not when a closed
            # loop's leftovers are collected.
            tasks = [task for task in self._tasks if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        self._tasks.add(asyncio.current_task())
        try:
            await self._relay(client_r, client_w)
        finally:
            self._tasks.discard(asyncio.current_task())

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        """One connection: held while blackholed, then piped both ways."""
        self.connections += 1
        self._writers.add(client_w)
        try:
            while self.blackholed:  # held: accepted, never connected upstream
                if await self._drop(client_r):
                    return
            server_r, server_w = await self._open_upstream()
        except OSError:
            client_w.transport.abort()
            return
        self._writers.add(server_w)
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        for writer in (client_w, server_w):
            writer.transport.abort()
            self._writers.discard(writer)

    async def _open_upstream(self):
        """A connection to the server: (reader, writer). Raises OSError."""
        if isinstance(self.upstream, str):
            return await asyncio.open_unix_connection(self.upstream)
        return await asyncio.open_connection(*self.upstream)

    async def _drop(self, reader: asyncio.StreamReader) -> bool:
        """Read and discard for a moment; True at EOF."""
        try:
            data = await asyncio.wait_for(reader.read(65536), 0.05)
        except TimeoutError:
            return False
        return not data

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if not self.blackholed:
                    writer.write(data)
                    await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            writer.transport.abort()
