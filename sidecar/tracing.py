"""Traces of attempts (issue 30): the seam the worker, the supervisor and the fenced
commit call at each point of an attempt, and the rule that decides whether traces are on.

Nothing here imports OpenTelemetry. Tracing is on only when the environment asks for it
(``asked``) and the ``[otel]`` extra is installed; ``start`` then imports
``sidecar.otel``, the implementation on the OpenTelemetry SDK. Otherwise every attempt
gets ``NO_TRACE``, whose hooks do nothing (no clock read, no allocation): the cost of
tracing that is off is a few empty method calls per attempt.

The points of an attempt, in order (``AttemptTrace``): ``spawning``/``spawned`` (the
tool's process), ``stopped`` (the race's winner: exit or a kill reason), ``killed`` (the
tree kill's signal and survivors), ``rejected`` (a stale result, by digest), ``ended``
(the fenced write's outcome, from FencedCommit.end) and ``finish`` (the supervisor is
done). ``tool_context`` is the TRACEPARENT/TRACESTATE the tool gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.errors import ConfigError

# The traces exporters the sidecar ships (the [otel] extra's OTLP over HTTP/protobuf).
EXPORTERS = ("otlp", "none")
PROTOCOL = "http/protobuf"
# The variables that name an OTLP endpoint; either one asks for traces.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# How long a stopping sidecar waits for its last spans to be exported (seconds).
FLUSH_SECONDS = 5.0


def asked(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` (the process environment) asks for traces: not when
    ``OTEL_SDK_DISABLED`` is ``true``; yes when ``OTEL_TRACES_EXPORTER`` is ``otlp``, or
    when it is unset and an OTLP endpoint variable (``OTEL_EXPORTER_OTLP_ENDPOINT``,
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set. Raises ConfigError (one line, exit 2)
    for an exporter other than ``otlp``/``none`` or an OTLP protocol other than
    ``http/protobuf``: the only ones the ``[otel]`` extra brings (issue 30), and for an
    OTEL_* number the SDK would refuse with a traceback (_check_sdk_numbers)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if e.strip()]
    for exporter in exporters:
        if exporter not in EXPORTERS:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter}: the sidecar exports traces "
                              "over OTLP only; set otlp (or none)")
    on = "otlp" in exporters if exporters else any(
        environ.get(name, "").strip() for name in ENDPOINT_VARIABLES)
    if on:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(name, "").strip()
            if protocol:
                if protocol != PROTOCOL:
                    raise ConfigError(f"{name}={protocol}: the [otel] extra exports over "
                                      f"{PROTOCOL} only; set {PROTOCOL} or unset it")
                break
        _check_sdk_numbers(environ)
    return on


def implementation():
    """The module ``sidecar.otel`` (the OpenTelemetry SDK behind it), imported now.
    Raises ConfigError (one line, exit 2) when the ``[otel]`` extra is not installed."""
    try:
        from sidecar import otel
    except ValueError as exc:  # an OTEL_* value the SDK reads as it is imported
        raise ConfigError(f"traces: the OpenTelemetry SDK refused an OTEL_* variable "
                          f"({str(exc)[:200]}); fix it, or set OTEL_SDK_DISABLED=true to "
                          "run without traces") from None
    except ImportError as exc:
        raise ConfigError(f"traces are asked for (OTEL_TRACES_EXPORTER or an OTLP endpoint "
                          f"is set) but the [otel] extra is missing ({exc.name or exc}): "
                          "pip install 'sidecar[otel]', or unset them or set "
                          "OTEL_SDK_DISABLED=true") from None
    return otel


class AttemptTrace:
    """The trace of one attempt. This base does nothing at every point (``NO_TRACE``);
    sidecar.otel's subclass records them as one span with child spans. Every hook is
    synchronous, never raises and never blocks; times are taken inside the hook."""

    __slots__ = ()

    def tool_context(self) -> dict[str, str] | None:
        """TRACEPARENT (and TRACESTATE) naming this attempt's span, for the tool's
        environment; None when untraced (the tool then gets the enqueue's)."""
        return None

    def spawning(self) -> None:
        """The tool's process is being started."""

    def spawned(self, pid: int) -> None:
        """The tool runs as ``pid``."""

    def stopped(self, reason: str) -> None:
        """The race ended: ``reason`` is a StopReason (``exited``, or why the tree is
        killed); the tree kill starts now."""

    def killed(self, reason: str, signal: str | None, killed: int, survivors: int) -> None:
        """The tree was killed for ``reason`` with ``signal`` (None: it had exited);
        ``killed`` processes signalled, ``survivors`` left."""

    def rejected(self, digest: Mapping[str, Any] | None, why: str) -> None:
        """A result that may not be committed (P6): journaled by ``digest`` only."""

    def committing(self) -> None:
        """The fenced write that ends the attempt starts."""

    def ended(self, outcome: str, how: str, fields: Mapping[str, Any]) -> None:
        """The fenced write is done: ``outcome`` (an Outcome), ``how`` (a commit.How) and
        the ending's log fields (``reason``: the failure kind or stop reason where ``how``
        is requeued, failed or lease_ended)."""

    def finish(self, error: BaseException | None = None) -> None:
        """The attempt's supervisor is done (``error``: the bug that ended it)."""


class Tracer:
    """Makes the trace of each attempt. This base is tracing off (``OFF``)."""

    enabled = False

    def attempt(self, job: Any, claim_sent_at: float) -> AttemptTrace:
        """The trace of the attempt ``job`` (a model.ClaimedJob), claimed by a statement
        sent at ``claim_sent_at`` (sidecar.clock.ownership_now seconds)."""
        return NO_TRACE

    def shutdown(self) -> None:
        """Export what is left, waiting at most FLUSH_SECONDS; then stop."""


NO_TRACE = AttemptTrace()
OFF = Tracer()


def start(environ: Mapping[str, str], owner_id: str, tool: str) -> Tracer:
    """The tracer of one sidecar: ``OFF`` unless ``asked(environ)``, else the SDK's (the
    OTEL_* variables configure it: endpoint, headers, timeout, sampler, resource,
    batching). Raises ConfigError as ``asked`` and ``implementation`` do, and for an
    OTEL_* value the SDK would refuse (one line, never its traceback)."""
    if not asked(environ):
        return OFF
    otel = implementation()
    try:
        return otel.OtelTracer(owner_id, tool)
    except ValueError as exc:  # the SDK's own check of a variable it reads at start
        raise ConfigError(f"traces: the OpenTelemetry SDK refused an OTEL_* variable "
                          f"({str(exc)[:200]}); fix it, or set OTEL_SDK_DISABLED=true to "
                          "run without traces") from None


# OTEL_* numbers the SDK refuses at start with a traceback (ValueError) instead of falling
# back to its default: batch sizes must be positive, limits not negative.
_POSITIVE = ("OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")


def _check_sdk_numbers(environ: Mapping[str, str]) -> None:
    """ConfigError (one line naming the variable, exit 2) for a batch size that is not a
    positive integer or an ``OTEL_*_LIMIT`` that is not a non-negative one (issue 30)."""
    for name, value in environ.items():
        if not name.startswith("OTEL_") or not value.strip():
            continue
        if name in _POSITIVE or name.endswith("_LIMIT"):
            text = value.strip()
            least = 1 if name in _POSITIVE else 0
            if not (text.isascii() and text.isdigit() and int(text) >= least):
                raise ConfigError(f"{name}={value[:40]}: must be an integer of at least "
                                  f"{least}; fix it or unset it")
