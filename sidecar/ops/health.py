"""The sidecar's own HTTP endpoints on ``SIDECAR_HTTP_ADDR`` (all interfaces by default):
``/metrics`` (prometheus-client's exposition, in the format the scraper's ``Accept`` asks
for), ``/livez`` and ``/readyz``, served by sidecar.ops.httpserver.

``/livez`` says only that the event loop is not wedged (a loop-lag watchdog ticks every
quarter second); it never looks at the database, because a failing liveness probe restarts
the container and with it the tool. ``/readyz`` says whether the sidecar should get work:
configuration valid, database reached recently, schema at the expected version, not
draining. The guard API for tools is separate and loopback-only (sidecar/worker/guard.py).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from sidecar.ops import metrics
from sidecar.ops.httpserver import Handler, HttpServer, Request, Response
from sidecar.ops.periodic import Periodic
from sidecar.protocol import parsing

LOOP_TICK_SECONDS = 0.25
WEDGED_AFTER_SECONDS = 5.0
SCHEMA_RECHECK_SECONDS = 10.0


@dataclass
class Readiness:
    """What /readyz reports. ``db_ok_at`` (monotonic) is refreshed by every successful
    query of the claim loop; ``db_fresh_seconds`` is how old it may be. ``schema`` and
    ``schema_compatible`` are read at start and rechecked every SCHEMA_RECHECK_SECONDS
    (a migration applied while this release runs)."""

    expected_schema: int
    schema: int = 0
    # A newer schema this release was declared compatible with (StoreBase.schema_compatibility)
    schema_compatible: bool = False
    db_ok_at: float = 0.0
    db_fresh_seconds: float = 10.0
    draining: Callable[[], bool] = lambda: False
    last_tick: float = field(default_factory=time.monotonic)
    # The tool's flow control as last read (issue 27): limits, pause, running; shown by
    # /readyz as detail, never a problem (a paused tool's sidecars are healthy).
    flow: dict | None = None

    def problems(self) -> list[str]:
        out = []
        if time.monotonic() - self.db_ok_at > self.db_fresh_seconds:
            out.append("database not reached recently")
        if self.schema != self.expected_schema and not (
                self.schema > self.expected_schema and self.schema_compatible):
            out.append(f"schema version {self.schema}, expected {self.expected_schema}"
                       + (" or a newer one whose migrations declare compatible-from <= "
                          f"{self.expected_schema}" if self.schema > self.expected_schema
                          else ""))
        if self.draining():
            out.append("draining")
        return out


async def watch_loop(readiness: Readiness) -> None:
    """Tick every LOOP_TICK_SECONDS and record the loop's lag (how late each tick ran),
    as the periodic service ``loop_watch`` (sidecar.ops.periodic); runs until cancelled."""
    async def tick() -> None:
        metrics.LOOP_LAG.observe(service.lateness)
        readiness.last_tick = time.monotonic()

    service = Periodic("loop_watch", LOOP_TICK_SECONDS, tick, errors=())
    await service.run()


def make_routes(readiness: Readiness) -> dict[tuple[str, str], Handler]:
    """The routes of /metrics, /livez and /readyz (GET, and HEAD)."""

    async def metrics_page(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.header("accept"))
        return Response(200, encoder(REGISTRY), content_type)

    async def livez(_request: Request) -> Response:
        since = time.monotonic() - readiness.last_tick
        if since > WEDGED_AFTER_SECONDS:
            return Response(503, orjson.dumps({"live": False,
                                               "loop_stalled_s": round(since, 3)}))
        return Response(200, orjson.dumps({"live": True}))

    async def readyz(_request: Request) -> Response:
        problems = readiness.problems()
        body: dict = {"ready": not problems, "problems": problems}
        if readiness.flow is not None:
            body["flow"] = readiness.flow
        return Response(503 if problems else 200, orjson.dumps(body))

    return {("GET", "/metrics"): metrics_page, ("GET", "/livez"): livez,
            ("GET", "/readyz"): readyz}


DEFAULT_PORT_TRIES = 10  # with SIDECAR_HTTP_ADDR unset: 9180, else 9181 ... 9189
# Connections open at once on the health server (probes and scrapes need a few): a tool
# that floods the port is refused past it, so it never takes the descriptors the guard
# and other jobs' setup need (issue 25); an idle keep-alive connection closes after
# HEALTH_KEEPALIVE_SECONDS.
HEALTH_MAX_CONNECTIONS = 64
HEALTH_KEEPALIVE_SECONDS = 5.0


def _count_refusal(reason: str, _key) -> None:
    metrics.HEALTH_CONNECTIONS_REFUSED.labels(reason).inc()


async def serve(readiness: Readiness, addr: str, *,
                next_free: bool = False) -> tuple[HttpServer, str]:
    """Listen on ``addr`` (HOST:PORT, ``[IPV6]:PORT``, as sidecar.protocol.parsing reads it;
    port 0 =
    any); return the server (``stop()`` it) and the bound address in the same form. With
    ``next_free`` (the default address, not one the user set), a port in use moves to the
    next of DEFAULT_PORT_TRIES ports, so two sidecars in one pod (one network namespace)
    both start. Raises OSError when no address can be bound."""
    host, port = parsing.split_host_port(addr)
    tries = DEFAULT_PORT_TRIES if next_free and port else 1
    for offset in range(tries):
        server = HttpServer(make_routes(readiness), max_connections=HEALTH_MAX_CONNECTIONS,
                            keepalive_timeout=HEALTH_KEEPALIVE_SECONDS,
                            on_refuse=_count_refusal)
        try:
            bound_host, bound_port = await server.start(host, port + offset)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or offset == tries - 1:
                exc.ports_tried = offset + 1  # for the caller's message
                raise
            continue
        return server, parsing.format_host_port(bound_host, bound_port)
    raise AssertionError("unreachable")
