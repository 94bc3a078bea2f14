"""The verdict on one attempt: from what the supervisor observed once the tool's tree was
dead (stop reason, exit status, overflow, resource usage) and the tool's profile, to one
of: commit the output, fail (kind, message, retryable), release the lease (shutdown),
snooze (the tool asked to run again later), or reject (the lease is no longer ours). No
I/O: the supervisor observes, this decides, and ``sidecar.worker.commit`` writes.

Order of precedence, ownership first (P13): a lease that ended -> reject; shutdown ->
release; a limit's evidence (an OOM kill, CPU time) -> that limit, whatever ended the
attempt (case F13); a denied or unanswered approval -> that failure; a park or a snooze
the tool asked through the guard, when it then exited -> that (its output is not
committed); then the stop reason; then the exit status (a lost status is never
exit 0, case F9; the profile's SNOOZE_EXIT_CODE is a snooze); then stdout overflow; else
commit.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from sidecar.protocol.model import LeaseProfile, NextStage, RawJson, Usage, tool_env_key
from sidecar.protocol.vocabulary import LEASE_ENDINGS, RETRYABLE, FailureKind, StopReason

# What a process refused memory under RLIMIT_AS typically writes last (lower case): the
# Python and C++ runtimes, libc's strerror(ENOMEM), and the dynamic loader.
OUT_OF_MEMORY_MARKERS = ("memoryerror", "cannot allocate memory", "out of memory",
                         "bad_alloc", "failed to allocate", "failed to map segment")


@dataclass(frozen=True)
class Snooze:
    """The tool asked to run again later (issue 44, point 3): the job goes back to the
    queue for ``delay_seconds`` without spending the attempt, bounded by the profile's
    MAX_SNOOZES and MAX_LIFETIME_SECONDS (checked by the fenced write, on the database's
    clock). ``reason``: the tool's words (at most 200 printable characters, or None);
    ``via``: ``guard`` (POST /v1/snooze) or ``exit_code`` (SNOOZE_EXIT_CODE)."""

    delay_seconds: float
    reason: str | None = None
    via: str = "guard"


# The longest snooze a tool may ask (s): the queue's own horizon for run_after.
SNOOZE_MAX_SECONDS = 366 * 86400
SNOOZE_BODY_LIMIT = 1024  # bytes of a POST /v1/snooze body
SNOOZE_REASON_CHARS = 200


def _body_object(body: bytes, fields: tuple[str, ...], example: str,
                 wanted: str) -> dict[str, Any]:
    """A guard request's body as a JSON object of ``fields`` only; ValueError naming the
    problem (not an object, with ``example``; an unknown field, saying ``wanted``)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"the body must be a JSON object, e.g. {example}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"unknown field {unknown[0][:40]!r}: give {wanted}")
    return value


def parse_snooze(body: bytes) -> Snooze:
    """A ``POST /v1/snooze`` body, ``{"delay_seconds": S, "reason": "..."}``, as a Snooze:
    S a number of seconds more than 0 and at most SNOOZE_MAX_SECONDS (366 days), the
    reason optional, 1-200 printable characters; no other field. ValueError with a
    message naming the field otherwise."""
    value = _body_object(body, ("delay_seconds", "reason"),
                         '{"delay_seconds": 60, "reason": "rate limited"}',
                         "delay_seconds and an optional reason")
    delay = value.get("delay_seconds")
    if isinstance(delay, bool) or not isinstance(delay, int | float) \
            or not 0 < delay <= SNOOZE_MAX_SECONDS:
        raise ValueError(f"delay_seconds: a number of seconds more than 0 and at most "
                         f"{SNOOZE_MAX_SECONDS} (366 days)")
    reason = value.get("reason")
    if reason is not None and (not isinstance(reason, str) or not reason.strip()
                               or len(reason) > SNOOZE_REASON_CHARS
                               or not reason.isprintable()):
        raise ValueError(f"reason: 1-{SNOOZE_REASON_CHARS} printable characters, or leave "
                         "it out")
    return Snooze(float(delay), reason, "guard")


APPROVAL_BODY_LIMIT = 16384  # bytes of a POST /v1/approval body
APPROVAL_DETAILS_BYTES = 8192  # of its details, as JSON
_ACTION = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Park:
    """The tool asked a person's yes with APPROVAL_MODE=park (issue 44): its job waits for
    the answer to request ``request_id`` (of step ``action``) as ``waiting``, with neither
    a slot nor a lease, its attempt not spent."""

    request_id: str
    action: str


@dataclass(frozen=True)
class ApprovalAsk:
    """A tool's request for a person's yes before an irreversible step (issue 44):
    ``action`` (a name: 1-64 of ``a-z0-9_.-``, starting with a letter), ``summary`` (one
    line of 1-200 printable characters) and ``details`` (a JSON object, at most 8 KiB)."""

    action: str
    summary: str
    details: Mapping[str, Any]


def parse_approval(body: bytes) -> ApprovalAsk:
    """A ``POST /v1/approval`` body, ``{"action", "summary", "details"}``, as an
    ApprovalAsk; ValueError with a message naming the field otherwise (no other field)."""
    value = _body_object(body, ("action", "summary", "details"),
                         '{"action": "refund", "summary": "refund 40 EUR to c-1048"}',
                         "action, summary and optional details")
    action, summary = value.get("action"), value.get("summary")
    if not isinstance(action, str) or not _ACTION.fullmatch(action):
        raise ValueError("action: 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter, "
                         "e.g. refund")
    if not isinstance(summary, str) or not summary.strip() or len(summary) > 200 \
            or not summary.isprintable():
        raise ValueError("summary: one line of 1-200 printable characters")
    details = value.get("details", {})
    if not isinstance(details, dict) or len(orjson.dumps(details)) > APPROVAL_DETAILS_BYTES:
        raise ValueError(f"details: a JSON object of at most {APPROVAL_DETAILS_BYTES} bytes")
    return ApprovalAsk(action, summary, details)


def approval_failure(outcome: str, action: str, by: str | None = None,
                     reason: str | None = None) -> Failure:
    """How an attempt whose approval was denied (``outcome`` ``denied``) or not answered in
    time (``expired``) fails: ``denied`` / ``approval_expired``, not retried."""
    if outcome == "denied":
        return failure(FailureKind.DENIED, f"{by or 'a person'} denied the step {action!r}"
                       + (f": {reason}" if reason else ""), action=action)
    return failure(FailureKind.APPROVAL_EXPIRED, f"nobody answered the approval of the step "
                   f"{action!r} in time (APPROVAL_WAIT_SECONDS)", action=action)


@dataclass(frozen=True)
class Observed:
    """One attempt as the supervisor saw it after the tree kill.

    ``returncode``: the tool's exit status (negative: killed by that signal), None when it
    was lost (``status_lost``) or never collected. ``memory_cgroup``: the attempt had a
    memory cgroup (else MEMORY_BYTES is RLIMIT_AS). ``stdout_bytes``: bytes the tool wrote
    to stdout, kept or not."""

    reason: StopReason
    returncode: int | None = None
    status_lost: bool = False
    stdout_overflow: bool = False
    stdout_bytes: int = 0
    usage: Usage = field(default_factory=Usage)
    stderr_tail: str | None = None
    memory_cgroup: bool = False
    snooze: Snooze | None = None  # what the tool asked through the guard, if it did
    refused: Failure | None = None  # its approval was denied or not answered in time
    park: Park | None = None  # it asked a person's yes and parks until the answer


@dataclass(frozen=True)
class Commit:
    """The tool succeeded: its output (result file, else stdout) is to be committed."""


@dataclass(frozen=True)
class Release:
    """Give the lease back, the attempt not spent: shutdown stopped the tool, or
    (``reason`` "shortage", case F19) the host ran short of something before it ran."""

    reason: str = "shutdown"


@dataclass(frozen=True)
class Reject:
    """The lease ended (``reason``: lease_lost, cancelled, local_deadline): nothing may be
    committed; what the tool returned (``digest``: sha256 and size, None when nothing) is
    only journaled (P6, P13)."""

    reason: StopReason
    digest: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Succeeded:
    """A Commit verdict with the output checked (sidecar.protocol.results): the ``result`` to
    store, its ``digest`` (sha256, bytes), the ``next_stage`` it names (P19) and the
    tool's ``stderr_tail``."""

    result: RawJson
    digest: Mapping[str, Any]
    next_stage: NextStage | None = None
    stderr_tail: str | None = None


@dataclass(frozen=True)
class Failure:
    """A failed attempt: ``kind``, the one-line ``message`` a user sees, whether another
    attempt may help (``retryable``), and ``details`` for the job's ``error`` (exit_code,
    signal, stderr_tail, cpu_seconds, peak_memory_bytes; None values dropped)."""

    kind: FailureKind
    message: str
    retryable: bool
    details: Mapping[str, Any] = field(default_factory=dict)

    def error(self) -> dict[str, Any]:
        """The job row's ``error`` object."""
        return {"kind": str(self.kind), "message": self.message,
                **{k: v for k, v in self.details.items() if v is not None}}

    def with_note(self, note: str) -> Failure:
        """The same failure with ``note`` appended to its message."""
        return Failure(self.kind, f"{self.message}; {note}", self.retryable, self.details)


Verdict = Commit | Release | Reject | Failure | Snooze | Park
# What ends an attempt (sidecar.worker.commit.FencedCommit.end): a verdict, with a Commit's
# output checked into Succeeded.
Ending = Succeeded | Release | Reject | Failure | Snooze | Park


def failure(kind: FailureKind, message: str, **details: Any) -> Failure:
    """A Failure whose ``retryable`` comes from the one table (vocabulary.RETRYABLE)."""
    return Failure(kind, message, RETRYABLE[kind], details)


def profile_var(profile: LeaseProfile, field_name: str) -> str:
    """The variable that sets ``field_name`` for this profile's tool, for messages."""
    return f"SIDECAR_PROFILE_{tool_env_key(profile.tool)}_{field_name}"


def decide(seen: Observed, profile: LeaseProfile) -> Verdict:
    """The verdict on one attempt (see the module docstring for the precedence)."""
    if seen.reason in LEASE_ENDINGS:
        return Reject(seen.reason)
    if seen.reason is StopReason.SHUTDOWN:
        return Release()
    limit = limit_failure(seen, profile)
    if limit is not None:
        return limit
    if seen.refused is not None:
        return seen.refused
    # A park or a snooze the tool asked is taken when it then exited: one that hung until
    # a deadline killed it is that deadline's failure (an attempt spent), so a tool that
    # asks and hangs cannot run its deadlines without end.
    if seen.park is not None and seen.reason is StopReason.EXITED:
        return seen.park
    if seen.snooze is not None and seen.reason is StopReason.EXITED:
        return seen.snooze
    by_reason = _stopped(seen, profile)
    if by_reason is not None:
        return by_reason
    return _exited(seen, profile)


def _stopped(seen: Observed, profile: LeaseProfile) -> Failure | None:
    tail = seen.stderr_tail
    match seen.reason:
        case StopReason.STAGE_TIMEOUT:
            return failure(FailureKind.STAGE_TIMEOUT,
                           f"no result within the stage deadline of "
                           f"{profile.stage_timeout_seconds:g} s; the tree was killed",
                           stderr_tail=tail)
        case StopReason.IDLE_TIMEOUT:
            return failure(FailureKind.IDLE_TIMEOUT,
                           f"no CPU time, I/O or output for {profile.idle_timeout_seconds:g} s; "
                           "the tree was killed", stderr_tail=tail)
        case StopReason.RESULT_TOO_LARGE:
            return failure(FailureKind.RESULT_TOO_LARGE,
                           f"stdout passed {profile.max_result_bytes} bytes; the tree was "
                           f"killed. Return less, or raise "
                           f"{profile_var(profile, 'MAX_RESULT_BYTES')}", stderr_tail=tail)
        case StopReason.MAX_LIFETIME:
            return lifetime_failure(profile, stderr_tail=tail)
    return None


def _exited(seen: Observed, profile: LeaseProfile) -> Verdict:
    tail, code = seen.stderr_tail, seen.returncode
    if seen.status_lost or code is None:
        # Case F9: with no exit status there is no telling a success from a failure that
        # printed partial output.
        return failure(FailureKind.EXIT_STATUS_LOST,
                       "the tool's exit status could not be collected (ECHILD: it was reaped "
                       "by someone else, e.g. a launcher that left SIGCHLD ignored); its "
                       "output is not trusted", stderr_tail=tail)
    if code < 0:
        return failure(FailureKind.SIGNAL, f"the tool was killed by signal {-code}",
                       signal=-code, stderr_tail=tail)
    if code != 0 and code == profile.snooze_exit_code:
        return Snooze(profile.snooze_seconds, None, "exit_code")
    if code != 0:
        retryable = code not in profile.non_retryable_exit_codes
        return Failure(FailureKind.EXIT_CODE,
                       f"the tool exited with code {code}"
                       + ("" if retryable else " (non-retryable for this profile)"),
                       retryable, {"exit_code": code, "stderr_tail": tail})
    if seen.stdout_overflow:
        return failure(FailureKind.RESULT_TOO_LARGE,
                       f"stdout exceeded {profile.max_result_bytes} bytes "
                       f"({seen.stdout_bytes} bytes written); return less, or raise "
                       f"{profile_var(profile, 'MAX_RESULT_BYTES')}", stderr_tail=tail)
    return Commit()


def limit_failure(seen: Observed, profile: LeaseProfile) -> Failure | None:
    """The failure of a tool stopped by one of its profile's limits, or None.

    ``cpu_limit``: the tree's CPU time reached CPU_SECONDS (our watcher, or RLIMIT_CPU's
    SIGXCPU/SIGKILL); ``memory_limit``: the cgroup's OOM killer fired in the attempt
    (whatever ended it, exit 0 included: a process of the tree was killed), or without a
    memory cgroup the attempt did not succeed and its stderr says it ran out of memory under
    RLIMIT_AS (a helper's MemoryError counts, case F13); ``process_limit``: a fork was
    refused at PROCESSES and the tool failed."""
    code, usage, tail = seen.returncode, seen.usage, seen.stderr_tail
    cpu = usage.cpu_seconds or 0.0
    if profile.cpu_seconds and (
            seen.reason is StopReason.CPU_LIMIT or code == -signal.SIGXCPU
            or (code == -signal.SIGKILL and cpu >= profile.cpu_seconds)):
        return failure(FailureKind.CPU_LIMIT,
                       f"the tool's tree reached its CPU time limit of "
                       f"{profile.cpu_seconds:g} s (measured {cpu:.2f} s); the tree was "
                       f"killed. Raise {profile_var(profile, 'CPU_SECONDS')} or give it less "
                       "work", stderr_tail=tail, cpu_seconds=round(cpu, 3))
    exited = seen.reason is StopReason.EXITED
    succeeded = exited and code == 0
    under_rlimit_as = bool(profile.memory_bytes) and not seen.memory_cgroup
    if profile.memory_bytes and usage.oom_kills:
        how = "killed by the cgroup's OOM killer"
    elif under_rlimit_as and not succeeded and any(
            marker in (tail or "").lower() for marker in OUT_OF_MEMORY_MARKERS):
        how = "RLIMIT_AS: an allocation was refused"
    elif under_rlimit_as and exited and code == -signal.SIGSEGV:
        how = "RLIMIT_AS: killed by SIGSEGV, most likely a refused stack or heap growth"
    else:
        how = ""
    if how:
        return failure(FailureKind.MEMORY_LIMIT,
                       f"the tool ran out of its memory limit of {profile.memory_bytes} bytes "
                       f"({how}); raise {profile_var(profile, 'MEMORY_BYTES')}",
                       stderr_tail=tail, peak_memory_bytes=usage.peak_memory_bytes)
    if profile.processes and usage.process_limit_hits and exited and not succeeded:
        return failure(FailureKind.PROCESS_LIMIT,
                       f"the tool failed after the kernel refused {usage.process_limit_hits} "
                       f"new process(es) or thread(s) at its limit of {profile.processes} "
                       f"(threads count: pids.max limits tasks); raise "
                       f"{profile_var(profile, 'PROCESSES')}", stderr_tail=tail)
    return None


def lifetime_failure(profile: LeaseProfile, **details: Any) -> Failure:
    """The job outlived MAX_LIFETIME_SECONDS from its first claim (P12)."""
    return failure(FailureKind.MAX_LIFETIME,
                   f"the job outlived its cap of {profile.max_lifetime_seconds:g} s from its "
                   "first claim (P12); split it into stages", **details)
