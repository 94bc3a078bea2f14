"""Traces of attempts (issue 30): the seam the worker, the supervisor and the fenced
commit call at each point of an attempt, and the rule that decides whether traces are on.

Nothing here imports OpenTelemetry. Tracing is on only when the environment asks for it
(``asked``) and the ``[otel]`` extra is installed; ``start`` then imports
``sidecar.ops.otel``, the implementation on the OpenTelemetry SDK. Otherwise every attempt
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

# The hooks and tracing off, defined apart so sidecar.ops.otel need not import this module.
from sidecar.ops.trace_hooks import FLUSH_SECONDS, NO_TRACE, OFF, AttemptTrace, Tracer  # noqa: F401
from sidecar.protocol.errors import ConfigError

# The traces exporters the sidecar ships (the [otel] extra's OTLP over HTTP/protobuf).
EXPORTERS = ("otlp", "none")
PROTOCOL = "http/protobuf"
# The variables that name an OTLP endpoint; either one asks for traces.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


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
    """The module ``sidecar.ops.otel`` (the OpenTelemetry SDK behind it), imported now.
    Raises ConfigError (one line, exit 2) when the ``[otel]`` extra is not installed."""
    try:
        from sidecar.ops import otel
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
