"""The attempts' traces on the OpenTelemetry SDK (the ``[otel]`` extra, issue 30).

Imported only by ``sidecar.ops.tracing.implementation`` when the environment asks for traces;
``sidecar run`` without them never imports it (tests/test_import_graph.py). The OTEL_*
variables configure the SDK itself: endpoint, headers, timeout and certificates of the
OTLP/HTTP exporter, the sampler, the resource (``OTEL_SERVICE_NAME``, default
``sidecar``; ``OTEL_RESOURCE_ATTRIBUTES``) and the batching (``OTEL_BSP_*``).

One span per attempt, ``execute_tool {tool}``, kind CONSUMER (the job crossed a queue from
the process that enqueued it; the span follows the GenAI tool-execution conventions for
its attributes: ``gen_ai.operation.name`` = ``execute_tool``, ``gen_ai.tool.name``,
``gen_ai.tool.call.id`` = the job id, ``error.type``), from the claim to the supervisor's
end, with the child spans ``claim``, ``spawn``, ``run``, ``kill`` (only when the tree was
signalled) and ``commit``, and a ``result_rejected`` event for a stale result.

Its parent is the job's ``traceparent`` (and ``tracestate``) from enqueue; a job enqueued
without one gets a trace of its own whose id is the job id's 128 bits. Its span id is
derived from the job id and the fencing token (``attempt_span_id``): every claim of a job
bumps the token by exactly one (sql/queries.sql, claim), so an attempt with token N > 1
links to the span of the claim before it, token N - 1, in the same trace, without asking
the database or the journal for it (the linked span may be missing when that claim's
sidecar died or did not sample it).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sidecar import __version__
from sidecar.ops.trace_hooks import FLUSH_SECONDS, NO_TRACE, AttemptTrace, Tracer
from sidecar.protocol import clock
from sidecar.protocol.masking import mask_url
from sidecar.protocol.vocabulary import Outcome
from sidecar.runtime.log import log, log_fields

# Outcomes that are not an error of the attempt: its result is stored, or its lease was
# given back without spending it (shutdown, a shortage of the host).
_FINE = frozenset({Outcome.SUCCEEDED, Outcome.RELEASED})
# The ways of ending (commit.How) whose log field ``reason`` is the failure kind or the
# stop reason: the attempt's ``error.type``; any other error is named by its outcome.
_REASON_IS_KIND = frozenset({"requeued", "failed", "lease_ended"})
_PROPAGATOR = TraceContextTextMapPropagator()


def attempt_span_id(job_id: Any, fencing_token: int) -> int:
    """The span id of the attempt of ``job_id`` (a UUID) whose claim took
    ``fencing_token``: the first 64 bits of sha256("{job_id}:{token}"), never 0. The same
    on every sidecar, so the next attempt can link to it (issue 30)."""
    digest = hashlib.sha256(f"{job_id}:{fencing_token}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


class _ChosenIds(RandomIdGenerator):
    """The SDK's random ids, except for the next span when ``choose`` named its ids first
    (the attempt's span: derived ids; everything else stays random). Used on the event
    loop's thread only, where spans are started."""

    def __init__(self) -> None:
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def choose(self, trace_id: int | None, span_id: int) -> None:
        self.trace_id, self.span_id = trace_id, span_id

    def generate_trace_id(self) -> int:
        chosen, self.trace_id = self.trace_id, None
        return chosen or super().generate_trace_id()

    def generate_span_id(self) -> int:
        chosen, self.span_id = self.span_id, None
        return chosen or super().generate_span_id()


class OtelTracer(Tracer):
    """The SDK's tracer of one sidecar (``owner_id`` is the resource's
    ``service.instance.id``): its own TracerProvider (the process-global one is left
    alone), a batch span processor and the OTLP/HTTP exporter, all configured by the
    OTEL_* variables."""

    enabled = True

    def __init__(self, owner_id: str, tool: str):
        resource = Resource.create({"service.instance.id": owner_id, "sidecar.tool": tool})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "sidecar"}))
        self.ids = _ChosenIds()
        self.provider = TracerProvider(resource=resource, id_generator=self.ids,
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("sidecar", __version__)
        endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318")
        log.emit("tracing_started", tool=tool, endpoint=mask_url(endpoint),
                 service=resource.attributes.get("service.name"))
        self.tool = tool

    def attempt(self, job: Any, claim_sent_at: float) -> AttemptTrace:
        """The attempt's span, started now (back-dated to the claim); NO_TRACE, logged as
        ``tracing_error``, should the SDK fail: a trace never stops a job."""
        try:
            return OtelAttempt(self, job, claim_sent_at)
        except Exception as exc:  # noqa: BLE001 - the attempt runs untraced
            log.emit("tracing_error", "warning", **log_fields(job),
                     reason=f"{type(exc).__name__}: {exc}"[:200])
            return NO_TRACE

    def shutdown(self) -> None:
        """Export the spans still queued and stop, waiting at most FLUSH_SECONDS (an
        unreachable collector must not hold a stopping sidecar); logs ``traces_flushed``
        or, past the bound, ``traces_unexported``."""
        done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown",
                                daemon=True)
        started = time.monotonic()
        done.start()
        done.join(FLUSH_SECONDS)
        if done.is_alive():
            log.emit("traces_unexported", "warning", tool=self.tool,
                     reason=f"the span exporter did not finish within {FLUSH_SECONDS:g} s; "
                            "the spans still queued are dropped")
        else:
            log.emit("traces_flushed", tool=self.tool,
                     duration_s=round(time.monotonic() - started, 3))


class OtelAttempt(AttemptTrace):
    """One attempt's span and its child spans (see the module). The child spans are made
    when their phase ends, with the times the hooks took."""

    __slots__ = ("owner", "span", "context", "marks", "outcome")

    def __init__(self, owner: OtelTracer, job: Any, claim_sent_at: float):
        self.owner = owner
        now = time.time_ns()
        sent = now - int(max(0.0, clock.ownership_now() - claim_sent_at) * 1e9)
        parent = None
        if job.traceparent:
            carrier = {"traceparent": job.traceparent}
            if job.tracestate:
                carrier["tracestate"] = job.tracestate
            parent = _PROPAGATOR.extract(carrier)
        caller = trace.get_current_span(parent).get_span_context() if parent else None
        remote = caller is not None and caller.is_valid
        trace_id = caller.trace_id if remote else job.id.int
        links = []
        if job.fencing_token > 1:
            flags = caller.trace_flags if remote else TraceFlags(TraceFlags.SAMPLED)
            links.append(Link(SpanContext(trace_id, attempt_span_id(job.id,
                                                                     job.fencing_token - 1),
                                          is_remote=True, trace_flags=flags),
                              {"sidecar.job.fencing_token": job.fencing_token - 1}))
        owner.ids.choose(None if remote else trace_id,
                         attempt_span_id(job.id, job.fencing_token))
        self.span = owner.tracer.start_span(
            f"execute_tool {job.tool}", context=parent if remote else None,
            kind=SpanKind.CONSUMER, links=links, start_time=sent, attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": job.tool,
                "gen_ai.tool.call.id": str(job.id),
                "sidecar.job.id": str(job.id),
                "sidecar.job.attempt": job.attempt,
                "sidecar.job.max_attempts": job.max_attempts,
                "sidecar.job.fencing_token": job.fencing_token,
                "sidecar.job.stage": job.stage,
                "sidecar.job.reclaimed": job.reclaimed,
            })
        self.context = trace.set_span_in_context(self.span)
        self.marks: dict[str, int] = {}
        self.outcome: str | None = None
        self._child("claim", sent, now)

    def _child(self, name: str, start: int | None, end: int,
               attributes: Mapping[str, Any] | None = None,
               error: str | None = None) -> None:
        if start is None:
            return
        child = self.owner.tracer.start_span(name, context=self.context, start_time=start,
                                             attributes=attributes)
        if error is not None:
            child.set_status(Status(StatusCode.ERROR, error))
        child.end(end_time=end)

    def tool_context(self) -> dict[str, str] | None:
        ctx = self.span.get_span_context()
        variables = {"TRACEPARENT":
                     f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}
        state = ctx.trace_state.to_header()
        if state:
            variables["TRACESTATE"] = state
        return variables

    def spawning(self) -> None:
        self.marks["spawn"] = time.time_ns()

    def spawned(self, pid: int) -> None:
        now = time.time_ns()
        self._child("spawn", self.marks.pop("spawn", None), now, {"process.pid": pid})
        self.marks["run"] = now

    def stopped(self, reason: str) -> None:
        now = time.time_ns()
        self._child("run", self.marks.pop("run", None), now, {"sidecar.stop_reason": reason})
        self.span.set_attribute("sidecar.stop_reason", reason)
        self.marks["kill"] = now

    def killed(self, reason: str, signal: str | None, killed: int, survivors: int) -> None:
        attributes = {"sidecar.kill.reason": reason, "sidecar.kill.killed": killed,
                      "sidecar.kill.survivors": survivors}
        if signal is not None:
            attributes["sidecar.kill.signal"] = signal
        self._child("kill", self.marks.pop("kill", None), time.time_ns(), attributes)
        self.span.set_attributes(attributes)

    def rejected(self, digest: Mapping[str, Any] | None, why: str) -> None:
        attributes: dict[str, Any] = {"sidecar.reject.why": why}
        if digest is not None:
            attributes["sidecar.result.sha256"] = str(digest.get("sha256"))
            attributes["sidecar.result.bytes"] = int(digest.get("bytes") or 0)
        self.span.add_event("result_rejected", attributes)

    def committing(self) -> None:
        self.marks["commit"] = time.time_ns()

    def ended(self, outcome: str, how: str, fields: Mapping[str, Any]) -> None:
        fine = outcome in _FINE
        error_type = str(fields.get("reason")) if how in _REASON_IS_KIND else None
        self._child("commit", self.marks.pop("commit", None), time.time_ns(),
                    {"sidecar.outcome": outcome, "sidecar.ending": how})
        self.outcome = outcome
        self.span.set_attribute("sidecar.outcome", outcome)
        if not fine:
            self.span.set_attribute("error.type", error_type or outcome)
            self.span.set_status(Status(StatusCode.ERROR, error_type or outcome))

    def finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.span.record_exception(error)
            self.span.set_attribute("error.type", type(error).__qualname__)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__qualname__))
        self.span.end()
