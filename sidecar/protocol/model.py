"""The small data types every floor of the house passes around, on the ground floor.

A job's state, JSON text already checked, a claimed job, the next stage a result names, what an
attempt's tree used and a tool's lease profile: plain values that the SQL layer, the
sandbox and the pure decisions (``verdict``, ``results``) all speak. Pure: nothing here
does I/O or imports a module that does (tests/test_import_graph.py checks it), so a pure
module can use these types without pulling in asyncpg, the sandbox or env parsing
(``sidecar.runtime.config`` builds and validates a LeaseProfile; this module only holds it).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sidecar.protocol.masking import mask_url
from sidecar.protocol.vocabulary import AttemptId


class JobState(StrEnum):
    """The ``state`` of a ``tool_jobs`` row (its CHECK constraint, migration 001).

    A job is ``queued`` until claimed, ``running`` while a lease is held on it (or until
    a sweep notices the lease expired), ``waiting`` while parked for a person's answer
    (issue 44: no slot, no lease), and ends ``succeeded``, ``failed`` (dead letter) or
    ``cancelled``. Values are the strings the database stores. Being a ``str``, a
    member passes as a text parameter as is; it is not a valid ``orjson`` dict key
    (use ``.value`` there)."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"  # parked until a person answers its tool's approval (issue 44)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The states a job ends in: nothing changes it afterwards but an operator's retry, and
# retention deletes it some time after ``finished_at``.
FINISHED_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class RawJson(str):
    """JSON text already validated; sent to a jsonb parameter without re-encoding
    (sidecar.storage.db's codec passes it through as is)."""


@dataclass(frozen=True)
class ClaimedJob:
    """A job this sidecar just claimed (P4).

    ``payload_text`` is the payload as JSON text; ``lease_remaining`` (seconds) is
    ``lease_until - now()`` by the database's clock at the claim; ``reclaimed`` is
    True when the job was taken over from an owner whose lease had expired.
    ``checkpoint_text`` is the last checkpoint the tool saved (JSON text) or None;
    ``stage`` counts the stages before this one (0 for a producer's job);
    ``lifetime_remaining`` is seconds left of MAX_LIFETIME_SECONDS (P12), None without a cap.
    ``traceparent``/``tracestate``: the W3C trace context given at enqueue (issue 26), the
    tool's TRACEPARENT/TRACESTATE; None when none was, or when the row's was not W3C trace
    context (``trace_context_ignored`` names those dropped, issue 30).
    ``session_key``: the agent session the call belongs to (issue 43), None for none.
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
    traceparent: str | None = None
    tracestate: str | None = None
    trace_context_ignored: tuple[str, ...] = ()
    session_key: str | None = None
    # The answer to the approval request that parked the job (issue 44), as JSON text:
    # handed to the tool as SIDECAR_APPROVAL. None when it never parked.
    approval_text: str | None = None

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


def new_job_id(now_ms: int | None = None) -> uuid.UUID:
    """A time-ordered job id (UUIDv7 layout, RFC 9562): 48 bits of Unix time in
    milliseconds (``now_ms``, default the clock now), the version 7, the variant and 74
    random bits (a uuid4's, from the OS). ValueError when ``now_ms`` is negative or past
    48 bits. The SQL function ``tool_job_new_id()`` (migration 017) makes
    the same; new ids land on the rightmost index pages, which keeps full page images out
    of a job's WAL (issue 28, bench section 13)."""
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    if not 0 <= ms < 1 << 48:
        raise ValueError(f"now_ms {ms} does not fit in 48 bits")
    value = (ms << 80) | (uuid.uuid4().int & ((1 << 80) - 1))
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # variant 10 (RFC 9562)
    return uuid.UUID(int=value)


def tool_env_key(tool: str) -> str:
    """The TOOL part of ``SIDECAR_PROFILE_<TOOL>_<FIELD>``: ``ocr-fast`` -> ``OCR_FAST``."""
    return re.sub(r"[^A-Z0-9]", "_", tool.upper())


def tolerated_silence(lease: float, heartbeat: float, kill_grace: float) -> float:
    """Seconds without any database answer that a lease survives in the worst case: a
    renewal sent just before the outage, minus one heartbeat period, minus the safety
    margin of the local deadline (kill grace + L/10) that gets the tree killed before the
    database could hand the job to someone else (P14b). All arguments in seconds."""
    return round(lease - heartbeat - kill_grace - 0.1 * lease, 3)


@dataclass(frozen=True)
class LeaseProfile:
    """The effective lease profile of one tool (all durations in seconds).

    Built and validated by ``sidecar.runtime.config`` from the environment (its PROFILE_FIELDS
    name one field each, in this order). ``sources`` maps each field name to the variable
    that set it (or "default"), so an error can name the variable to change.
    """

    tool: str
    lease_seconds: float
    heartbeat_seconds: float
    tolerated_misses: int
    jitter_seconds: float
    stage_timeout_seconds: float
    max_attempts: int
    kill_grace_seconds: float
    non_retryable_exit_codes: frozenset[int]
    backoff_base_seconds: float
    backoff_max_seconds: float
    max_result_bytes: int
    result_url: str
    forward_max_attempts: int
    forward_max_age_seconds: float
    forward_follow_redirects: bool
    idle_timeout_seconds: float
    max_lifetime_seconds: float
    next_tools: frozenset[str]
    provider: str
    memory_bytes: int
    cpu_seconds: float
    open_files: int
    processes: int
    core_dumps: bool
    allow_new_privs: bool
    run_as: str
    env_passthrough: frozenset[str]
    home: str
    sandbox: str
    network: str
    extra_paths: tuple[tuple[str, str], ...]
    mcp_description: str
    mcp_input_schema_file: str
    # Warm tool processes (issue 43): ``per-job`` or ``warm``, and when a warm one is
    # replaced (jobs served, age in s; 0 = no cap) or stopped for want of jobs (s).
    process: str = "per-job"
    max_jobs_per_process: int = 1000
    max_process_seconds: float = 3600.0
    warm_idle_seconds: float = 300.0
    # Agent sessions (issue 43): a session ends after this long without a call, or once
    # this old (0 = no cap); a call whose session is gone fails session_lost, or with
    # ``fresh`` starts it again.
    session_idle_seconds: float = 300.0
    session_max_seconds: float = 3600.0
    max_sessions: int = 8
    session_restart: str = "lost"
    # How long a job holds its idempotency key (issue 44): forever, active or a window
    # (sidecar.protocol.enqueue_args.dedupe_window_seconds); the tool's default for an
    # enqueue that names none.
    dedupe: str = "forever"
    # Snoozes (issue 44): how many times one job may ask to run later without spending an
    # attempt; the exit code that asks it (0: none) and its delay (s).
    max_snoozes: int = 100
    snooze_exit_code: int = 0
    snooze_seconds: float = 60.0
    # Approvals (issue 44): how long a tool's POST /v1/approval waits for a person (s).
    approval_wait_seconds: float = 300.0
    # ``wait`` (the tool blocks, the lease kept) or ``park`` (the job waits, no slot, up to
    # approval_park_seconds for the answer).
    approval_mode: str = "wait"
    approval_park_seconds: float = 604800.0
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def as_dict(self) -> dict[str, object]:
        """The profile as plain JSON-able values, for ``sidecar config`` and the journal:
        ``tool``, ``tolerated_silence_s``, then every field (sets as sorted lists), the
        result URL's credentials masked."""
        out: dict[str, object] = {"tool": self.tool, "tolerated_silence_s": tolerated_silence(
            self.lease_seconds, self.heartbeat_seconds, self.kill_grace_seconds)}
        for name in PROFILE_FIELD_NAMES:
            value = getattr(self, name)
            out[name] = sorted(value) if isinstance(value, frozenset) else value
        out["extra_paths"] = [f"{path}:{mode}" for path, mode in self.extra_paths]
        if self.result_url:
            out["result_url"] = mask_url(self.result_url)
        return out


# The settable fields of a LeaseProfile, in order (lower case: ``lease_seconds``...);
# ``tool`` and ``sources`` are not settings. sidecar.runtime.config checks its PROFILE_FIELDS
# against this at import.
PROFILE_FIELD_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LeaseProfile) if f.name not in ("tool", "sources"))
