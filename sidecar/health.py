"""The sidecar's own HTTP endpoints on ``SIDECAR_HTTP_ADDR`` (all interfaces by default):
``/metrics`` (prometheus-client's aiohttp handler), ``/livez`` and ``/readyz``.

``/livez`` says only that the event loop is not wedged (a loop-lag watchdog ticks every
quarter second); it never looks at the database, because a failing liveness probe restarts
the container and with it the tool. ``/readyz`` says whether the sidecar should get work:
configuration valid, database reached recently, schema at the expected version, not
draining. The guard API for tools is separate and loopback-only (sidecar/guard.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from sidecar import metrics

LOOP_TICK_SECONDS = 0.25
WEDGED_AFTER_SECONDS = 5.0


@dataclass
class Readiness:
    """What /readyz reports. ``db_ok_at`` (monotonic) is refreshed by every successful
    query of the claim loop; ``db_fresh_seconds`` is how old it may be."""

    expected_schema: int
    schema: int = 0
    db_ok_at: float = 0.0
    db_fresh_seconds: float = 10.0
    draining: Callable[[], bool] = lambda: False
    last_tick: float = field(default_factory=time.monotonic)

    def problems(self) -> list[str]:
        out = []
        if time.monotonic() - self.db_ok_at > self.db_fresh_seconds:
            out.append("database not reached recently")
        if self.schema != self.expected_schema:
            out.append(f"schema version {self.schema}, expected {self.expected_schema}")
        if self.draining():
            out.append("draining")
        return out


async def watch_loop(readiness: Readiness) -> None:
    """Tick every LOOP_TICK_SECONDS and record the loop's lag (how late each tick ran)."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(LOOP_TICK_SECONDS)
        now = time.monotonic()
        metrics.LOOP_LAG.observe(max(0.0, now - before - LOOP_TICK_SECONDS))
        readiness.last_tick = now


def make_app(readiness: Readiness) -> web.Application:
    """The aiohttp application serving /metrics, /livez and /readyz."""

    async def livez(_request: web.Request) -> web.Response:
        since = time.monotonic() - readiness.last_tick
        if since > WEDGED_AFTER_SECONDS:
            return web.json_response({"live": False, "loop_stalled_s": round(since, 3)},
                                     status=503)
        return web.json_response({"live": True})

    async def readyz(_request: web.Request) -> web.Response:
        problems = readiness.problems()
        return web.json_response({"ready": not problems, "problems": problems},
                                 status=503 if problems else 200)

    app = web.Application()
    app.router.add_get("/metrics", make_aiohttp_handler())
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    return app


async def serve(readiness: Readiness, addr: str) -> tuple[web.AppRunner, str]:
    """Listen on ``addr`` (HOST:PORT; port 0 = any); return the runner and the bound address.

    Raises OSError when the address cannot be bound."""
    host, _, port = addr.rpartition(":")
    runner = web.AppRunner(make_app(readiness), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]"), int(port))
    await site.start()
    bound = site._server.sockets[0].getsockname()  # noqa: SLF001 - the port the OS chose
    return runner, f"{bound[0]}:{bound[1]}"
