"""A PostgreSQL protocol proxy that loses the answer of one statement after it committed
(case F16).

It relays the frontend/backend protocol (v3, no TLS: the client's DSN carries
``sslmode=disable``) message by message in a thread of its own. A statement is chosen by
a piece of its SQL text (``match``): the proxy learns the names of the prepared statements
whose Parse carries it, and watches each Bind of one (or a simple Query with it). The
server's answer to a watched statement is held until its ReadyForQuery; when it holds a
DataRow (the statement returned a row: a claim that took a job, a fenced write that was
accepted) and ``arm(n)`` left drops, the whole answer is thrown away and both sides of
the connection are cut: the server has committed, the client learns nothing but a lost
connection. Any other answer is passed on unchanged.
"""

from __future__ import annotations

import asyncio
import struct
import threading

from netproxy import BlackholeProxy

SSL_REQUEST = 80877103


class AnswerDropProxy(BlackholeProxy):
    """tests/netproxy.BlackholeProxy's thread, loop and start/stop, relaying the
    PostgreSQL protocol message by message instead of bytes (never blackholed)."""

    def __init__(self, upstream, match: str):
        super().__init__(upstream)
        self.match = match
        self.dropped = 0
        self._drops = 0
        self._isolate = False
        self.isolated = threading.Event()
        self._lock = threading.Lock()

    def arm(self, drops: int = 1, isolate: bool = False) -> None:
        """Lose the answer of the next ``drops`` watched statements that return a row.
        With ``isolate``, the first drop also cuts every other connection and refuses new
        ones from then on (``isolated`` is set): the client cannot settle what it lost,
        as one that died at that moment."""
        with self._lock:
            self._drops = drops
            self._isolate = isolate

    async def _relay(self, client_r, client_w) -> None:
        if self.isolated.is_set():
            client_w.transport.abort()
            return
        try:
            server_r, server_w = await self._open_upstream()
        except OSError:
            client_w.transport.abort()
            return
        self._writers.update((client_w, server_w))
        state = {"names": set(), "watching": 0, "cut": False}
        try:
            await asyncio.gather(self._frontend(client_r, server_w, state),
                                 self._backend(server_r, client_w, server_w, state))
        finally:
            for writer in (client_w, server_w):
                writer.transport.abort()
                self._writers.discard(writer)

    async def _frontend(self, reader, server_w, state) -> None:
        """Client -> server: the startup packet, then typed messages, relayed as they are."""
        try:
            length = struct.unpack("!I", await reader.readexactly(4))[0]
            body = await reader.readexactly(length - 4)
            if struct.unpack("!I", body[:4])[0] == SSL_REQUEST:
                raise RuntimeError("pgproxy relays no TLS: give the client sslmode=disable")
            server_w.write(struct.pack("!I", length) + body)
            while not state["cut"]:
                kind = await reader.readexactly(1)
                length = struct.unpack("!I", await reader.readexactly(4))[0]
                body = await reader.readexactly(length - 4)
                self._watch(kind, body, state)
                server_w.write(kind + struct.pack("!I", length) + body)
                await server_w.drain()
        except (asyncio.IncompleteReadError, OSError, ConnectionError):
            pass
        finally:
            server_w.transport.abort()

    def _watch(self, kind: bytes, body: bytes, state) -> None:
        if kind == b"P":  # Parse: statement name, query text, ...
            name, _, rest = body.partition(b"\0")
            query = rest.partition(b"\0")[0].decode("utf-8", "replace")
            if self.match in query:
                state["names"].add(name)
            else:
                state["names"].discard(name)
        elif kind == b"B":  # Bind: portal, statement name, ...
            statement = body.split(b"\0", 2)[1]
            if statement in state["names"]:
                state["watching"] += 1
        elif kind == b"Q" and self.match in body.decode("utf-8", "replace"):
            state["watching"] += 1

    async def _backend(self, reader, client_w, server_w, state) -> None:
        """Server -> client, message by message; a watched answer is held to its end."""
        held: list[bytes] = []
        try:
            while True:
                kind = await reader.readexactly(1)
                length = struct.unpack("!I", await reader.readexactly(4))[0]
                message = kind + struct.pack("!I", length) + await reader.readexactly(length - 4)
                if not state["watching"]:
                    client_w.write(message)
                    await client_w.drain()
                    continue
                held.append(message)
                if kind != b"Z":  # ReadyForQuery ends the answer
                    continue
                state["watching"] = 0
                returned_row = any(m[:1] == b"D" for m in held)
                with self._lock:
                    drop = returned_row and self._drops > 0
                    if drop:
                        self._drops -= 1
                        self.dropped += 1
                if drop:
                    state["cut"] = True
                    if self._isolate:
                        self.isolated.set()
                        for writer in list(self._writers):
                            writer.transport.abort()
                    return  # the answer is lost: both sides are cut below
                for m in held:
                    client_w.write(m)
                held = []
                await client_w.drain()
        except (asyncio.IncompleteReadError, OSError, ConnectionError):
            pass
        finally:
            client_w.transport.abort()
            server_w.transport.abort()
