"""An OTLP/HTTP trace receiver for tests, in a thread: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (gzip or not), decoded with the official
``opentelemetry-proto`` package, answered with an empty ``ExportTraceServiceResponse``.

No collector is installable here (no OpenTelemetry Collector or Jaeger in Debian's
packages, PyPI or npm as a binary), so this is the receiving end of the tests' spans: it
keeps what arrived as plain ``Span`` values. ``OtlpReceiver().start()`` returns the base
URL (an OTEL_EXPORTER_OTLP_ENDPOINT); ``spans()`` lists what arrived so far.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

# OTLP's Span.SpanKind numbers (trace.proto).
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER",
         5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass
class Span:
    """One received span: ids as lowercase hex ('' for no parent), attributes as plain
    values, links as (trace id, span id, attributes), events as (name, attributes)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    status_message: str
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which) if which else None


def _attributes(pairs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def decode(body: bytes) -> list[Span]:
    """The spans of one ExportTraceServiceRequest (protobuf bytes)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(Span(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                    KINDS.get(s.kind, str(s.kind)), s.start_time_unix_nano,
                    s.end_time_unix_nano, _attributes(s.attributes),
                    STATUS.get(s.status.code, str(s.status.code)), s.status.message,
                    [(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                     for link in s.links],
                    [(e.name, _attributes(e.attributes)) for e in s.events],
                    resource, scope_spans.scope.name))
    return spans


class OtlpReceiver:
    """The receiver on 127.0.0.1 (a free port), in a thread of its own."""

    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    async def _traces(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="application/x-protobuf only")
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            received = decode(body)
        except Exception as exc:  # noqa: BLE001 - a malformed body is the sender's bug
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {exc}")
        with self._lock:
            self._spans.extend(received)
            self.requests += 1
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def start(self) -> str:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application(client_max_size=16 * 1024 * 1024)
            app.router.add_post("/v1/traces", self._traces)
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
