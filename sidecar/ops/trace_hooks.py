"""The hooks of an attempt's trace (issue 30), with nothing behind them: ``AttemptTrace``
and ``Tracer`` are tracing off (``NO_TRACE``, ``OFF``); sidecar.ops.otel subclasses them on the
OpenTelemetry SDK. A module of its own so that sidecar.ops.tracing (the seam, which imports
sidecar.ops.otel lazily) and sidecar.ops.otel (which subclasses the hooks) do not import each other.
sidecar.ops.tracing re-exports every name here: the worker's modules import them from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# How long a stopping sidecar waits for its last spans to be exported (seconds).
FLUSH_SECONDS = 5.0


class AttemptTrace:
    """The trace of one attempt. This base does nothing at every point (``NO_TRACE``);
    sidecar.ops.otel's subclass records them as one span with child spans. Every hook is
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
        sent at ``claim_sent_at`` (sidecar.protocol.clock.ownership_now seconds)."""
        return NO_TRACE

    def shutdown(self) -> None:
        """Export what is left, waiting at most FLUSH_SECONDS; then stop."""


NO_TRACE = AttemptTrace()
OFF = Tracer()
