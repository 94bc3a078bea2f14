"""A real HTTP server for tests, in a thread: records every request, answers from a script.

``HttpSink().start()`` returns the base URL; ``script`` is a list of (status, json body)
or (status, json body, headers) answers used in order (the last one repeats); ``requests``
lists what arrived (method, path, headers, body).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import orjson
from aiohttp import web


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict | list | None
    method: str = "POST"


class HttpSink:
    def __init__(self, script: list[tuple] | None = None):
        self.script = list(script or [(200, {"ok": True})])
        self.requests: list[Received] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        self.requests.append(Received(request.path, dict(request.headers), body,
                                      request.method))
        status, answer, *extra = self.script[min(len(self.requests), len(self.script)) - 1]
        return web.json_response(answer, status=status, headers=extra[0] if extra else None)

    def start(self) -> str:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.url

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
