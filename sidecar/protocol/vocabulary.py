"""The sidecar's words for how things end, in one place at the bottom of the house.

Every module that names a stop reason, an outcome, a failure kind or a guard refusal
imports it from here, and every metric label set is built from these enums, so a new
reason cannot miss its series or be spelled two ways. Each member's value is the string
that appears in logs, the journal, the ``error.kind`` of a job row and metric labels.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import NamedTuple


class AttemptId(NamedTuple):
    """One attempt of one job: the job id and the fencing token its claim took (case F14).

    A sidecar may hold two attempts of one job for a moment (an operator cancels and
    retries it within a heartbeat, and this sidecar claims it again while the old tree is
    still being killed), so every map of leases, tasks, guard registrations, cgroups and
    work directories is keyed by this pair, never by the job id alone."""

    job_id: uuid.UUID
    fencing_token: int


class StopReason(StrEnum):
    """Why one attempt's tool stopped: the first one observed wins (P8, P13). All but
    ``EXITED`` mean the sidecar killed the tree; ``ORPHANED_DESCENDANTS`` names the kill
    of what an exited tool left running."""

    EXITED = "exited"
    STAGE_TIMEOUT = "stage_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    MAX_LIFETIME = "max_lifetime_exceeded"
    RESULT_TOO_LARGE = "result_too_large"
    CPU_LIMIT = "cpu_limit"
    SHUTDOWN = "shutdown"
    LEASE_LOST = "lease_lost"          # zero rows: expired and taken over, or changed by policy
    CANCELLED = "cancelled"            # zero rows because an operator cancelled the job
    LOCAL_DEADLINE = "local_deadline"  # ownership unknown until the local deadline passed
    ORPHANED_DESCENDANTS = "orphaned_descendants"


# The stop reasons that mean the lease is no longer ours (P13): nothing is committed.
LEASE_ENDINGS = frozenset({StopReason.LEASE_LOST, StopReason.CANCELLED,
                           StopReason.LOCAL_DEADLINE})


class Outcome(StrEnum):
    """How one attempt ended for the job row (the ``outcome`` metric label)."""

    SUCCEEDED = "succeeded"    # result committed
    FAILED = "failed"          # terminal failure committed (dead letter)
    REQUEUED = "requeued"      # failure committed, retried after backoff
    RELEASED = "released"      # shutdown: lease given back, attempt not spent
    SNOOZED = "snoozed"        # the tool asked to run later: queued, attempt not spent
    PARKED = "parked"          # waiting for a person's answer: no slot, attempt not spent
    CANCELLED = "cancelled"    # an operator cancelled the job while it ran
    LEASE_LOST = "lease_lost"  # the lease was lost before the outcome could be committed
    REJECTED = "rejected"      # the fenced commit found another owner (P6)
    ABANDONED = "abandoned"    # ownership unknown past the local deadline (P14b)


class FailureKind(StrEnum):
    """``error.kind`` of a failed attempt (docs/child-process.md)."""

    EXIT_CODE = "exit_code"
    SIGNAL = "signal"
    EXIT_STATUS_LOST = "exit_status_lost"
    BAD_RESULT = "bad_result"
    RESULT_TOO_LARGE = "result_too_large"
    STAGE_TIMEOUT = "stage_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    MAX_LIFETIME = "max_lifetime_exceeded"
    STAGE_NOT_ALLOWED = "stage_not_allowed"
    SPAWN_FAILED = "spawn_failed"
    SANDBOX_FAILED = "sandbox_failed"
    MEMORY_LIMIT = "memory_limit"
    CPU_LIMIT = "cpu_limit"
    PROCESS_LIMIT = "process_limit"
    # The server cancelled the commit of the result on the sidecar's own statement_timeout
    # (57014, case F18): too large to store within SIDECAR_DB_TIMEOUT_SECONDS.
    COMMIT_TIMEOUT = "commit_timeout"
    # The next stage's key is held by another job (case F22): the completion wrote nothing.
    NEXT_STAGE_CONFLICT = "next_stage_conflict"
    # The result or a next stage's payload holds a secret the sidecar knows (the database
    # URL or password, a guard token; issue 25): nothing of it was stored.
    SECRET_IN_OUTPUT = "secret_in_output"
    # Written by SQL, never by a supervisor: the lease expired on the last attempt, and an
    # operator's cancel.
    MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"
    CANCELLED = "cancelled"
    # Written by SQL (fail_expired_jobs): no attempt started before the job's expiry, the
    # caller's --expires-in (issue 26).
    EXPIRED = "expired"
    # A call of an agent session (issue 43) whose session ended or was lost (its process
    # died, its lease ran out, its sidecar stopped): it is not run in a fresh process
    # unless the profile says SESSION_RESTART=fresh.
    SESSION_LOST = "session_lost"
    # A call of a session for a tool whose profile is PROCESS=per-job: no process outlives
    # a call there, so no state could be kept.
    SESSION_UNSUPPORTED = "session_unsupported"
    # The tool asked to run later (a snooze, issue 44) more often than the profile's
    # MAX_SNOOZES allows.
    SNOOZE_LIMIT = "snooze_limit"
    # Written by SQL (tool_job_interest_lapse): the caller's interest in a running call
    # lapsed or was let go (issue 44, point 2); the call was cancelled through the fenced
    # path.
    ABANDONED_BY_CALLER = "abandoned_by_caller"
    # A person denied the step the tool asked approval for, or nobody answered before its
    # deadline (issue 44, point 1).
    DENIED = "denied"
    APPROVAL_EXPIRED = "approval_expired"


# Whether another attempt may help (P16): a transient fault is retried with backoff while
# attempts remain; bad input or a limit the same input would hit again is not. An exit
# code is retried unless the profile's NON_RETRYABLE_EXIT_CODES names it.
RETRYABLE: dict[FailureKind, bool] = {
    FailureKind.EXIT_CODE: True,
    FailureKind.SIGNAL: True,
    FailureKind.EXIT_STATUS_LOST: True,
    FailureKind.BAD_RESULT: False,
    FailureKind.RESULT_TOO_LARGE: False,
    FailureKind.STAGE_TIMEOUT: True,
    FailureKind.IDLE_TIMEOUT: True,
    FailureKind.MAX_LIFETIME: False,
    FailureKind.STAGE_NOT_ALLOWED: False,
    FailureKind.SPAWN_FAILED: False,
    FailureKind.SANDBOX_FAILED: True,
    FailureKind.MEMORY_LIMIT: False,
    FailureKind.CPU_LIMIT: False,
    FailureKind.PROCESS_LIMIT: False,
    # Not retried: the tool would run again for a result that cannot be stored either
    # (its side effects too); raise the timeout and `sidecar retry` the job.
    FailureKind.COMMIT_TIMEOUT: False,
    FailureKind.NEXT_STAGE_CONFLICT: False,
    # Not retried: the same input makes the tool echo the same secret again (a page or a
    # file that names the Secret's path); the journal keeps only the output's digest.
    FailureKind.SECRET_IN_OUTPUT: False,
    FailureKind.MAX_ATTEMPTS_EXCEEDED: False,
    FailureKind.CANCELLED: False,
    FailureKind.EXPIRED: False,
    # Not retried: another attempt would find the session gone just the same.
    FailureKind.SESSION_LOST: False,
    FailureKind.SESSION_UNSUPPORTED: False,
    # Not retried: a tool that keeps asking for later would ask again.
    FailureKind.SNOOZE_LIMIT: False,
    FailureKind.ABANDONED_BY_CALLER: False,
    # Not retried: the same step would be asked for again, and the person said no (or
    # nobody is there to say yes).
    FailureKind.DENIED: False,
    FailureKind.APPROVAL_EXPIRED: False,
}


class GuardRefusal(StrEnum):
    """Why the guard answered 409 to a tool asking before an irreversible step."""

    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    OWNERSHIP_UNKNOWN = "ownership_unknown"
    DEADLINE = "deadline"          # the supervisor is stopping the tool
    LEASE_ENDING = "lease_ending"  # too little of the lease left for the step


class ConnectionRefusal(StrEnum):
    """Why the guard's server refused a connection (sidecar.ops.httpserver; the ``reason``
    label of sidecar_guard_connections_refused_total)."""

    ATTEMPT_CAP = "attempt_cap"                  # the attempt has its connections already
    TOTAL_CAP = "total_cap"                      # the guard has its connections already
    UNAUTHENTICATED_CAP = "unauthenticated_cap"  # too many connections not yet authenticated
    DESCRIPTOR_RESERVE = "descriptor_reserve"    # accepting paused: the reserve is reached


class HeartbeatResult(StrEnum):
    """One renewal's result (the heartbeat metric's ``result`` label)."""

    OK = "ok"
    LOST = "lost"        # zero rows
    ERROR = "error"      # the database answered with an error
    TIMEOUT = "timeout"  # no answer in time, or ended by statement/lock timeout
    LOCKED = "locked"    # another session holds the job's row locked: skipped (case F17)


class KillSignal(StrEnum):
    """The strongest signal a tree kill sent (``already_exited``: nothing was left to kill,
    so no signal was needed; never the label value ``none``, case F24)."""

    SIGTERM = "SIGTERM"
    SIGKILL = "SIGKILL"
    ALREADY_EXITED = "already_exited"
