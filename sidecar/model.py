"""The small data types every floor of the house passes around, on the ground floor.

JSON text already checked, a claimed job, the next stage a result names and what an
attempt's tree used: plain values that the SQL layer, the sandbox and the pure decisions
(``verdict``, ``results``) all speak. Pure: nothing
here does I/O or imports a module that does (tests/test_import_graph.py checks it), so a
pure module can use these types without pulling in asyncpg, the sandbox or env parsing.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sidecar.vocabulary import AttemptId


class RawJson(str):
    """JSON text already validated; sent to a jsonb parameter without re-encoding
    (sidecar.db's codec passes it through as is)."""


@dataclass(frozen=True)
class ClaimedJob:
    """A job this sidecar just claimed (P4).

    ``payload_text`` is the payload as JSON text; ``lease_remaining`` (seconds) is
    ``lease_until - now()`` by the database's clock at the claim; ``reclaimed`` is
    True when the job was taken over from an owner whose lease had expired.
    ``checkpoint_text`` is the last checkpoint the tool saved (JSON text) or None;
    ``stage`` counts the stages before this one (0 for a producer's job);
    ``lifetime_remaining`` is seconds left of MAX_LIFETIME_SECONDS (P12), None without a cap.
    """

    id: uuid.UUID
    tool: str
    payload_text: str
    fencing_token: int
    attempt: int
    max_attempts: int
    lease_until: dt.datetime
    lease_remaining: float
    idempotency_key: str
    reclaimed: bool
    checkpoint_text: str | None = None
    stage: int = 0
    lifetime_remaining: float | None = None

    @property
    def attempt_id(self) -> AttemptId:
        """This attempt's identity: (job id, fencing token) (case F14)."""
        return AttemptId(self.id, self.fencing_token)


@dataclass(frozen=True)
class NextStage:
    """The next stage a successful job names (P19): a job of ``tool`` with ``payload``
    (any JSON value), allowed ``max_attempts`` by that tool's profile."""

    tool: str
    payload: Any
    max_attempts: int


@dataclass
class Usage:
    """What one attempt's tree used: peak memory (bytes), CPU time (seconds), how often the
    kernel's OOM killer fired and how often a fork was refused at the process limit.
    None where this host does not measure it."""

    peak_memory_bytes: int | None = None
    cpu_seconds: float | None = None
    oom_kills: int = 0
    process_limit_hits: int = 0
