"""The verdict on an attempt (sidecar.protocol.verdict) without processes or a database: every stop
reason against every class of exit status, with and without a limit's evidence, and the
vocabulary the metrics are built from."""

from __future__ import annotations

import signal

import pytest

from sidecar.ops import metrics
from sidecar.protocol.model import Usage
from sidecar.protocol.verdict import Commit, Failure, Observed, Reject, Release, decide
from sidecar.protocol.vocabulary import (
    LEASE_ENDINGS,
    RETRYABLE,
    FailureKind,
    HeartbeatResult,
    KillSignal,
    Outcome,
    StopReason,
)
from sidecar.runtime.config import load_settings

pytestmark = pytest.mark.unit

PROFILE = load_settings({"SIDECAR_PROFILE_T_NON_RETRYABLE_EXIT_CODES": "64"}).profile("t")
LIMITED = load_settings({"SIDECAR_PROFILE_T_MEMORY_BYTES": str(100 << 20),
                         "SIDECAR_PROFILE_T_CPU_SECONDS": "5"}).profile("t")

# (returncode, status_lost): every class of exit status a child can end with.
STATUSES = {"ok": (0, False), "retryable": (3, False), "non_retryable": (64, False),
            "sigkill": (-signal.SIGKILL, False), "sigsegv": (-signal.SIGSEGV, False),
            "lost": (None, True)}
# The reasons the race can return (ORPHANED_DESCENDANTS only names a kill after EXITED).
RACE_REASONS = [r for r in StopReason if r is not StopReason.ORPHANED_DESCENDANTS]
BY_REASON = {StopReason.STAGE_TIMEOUT: FailureKind.STAGE_TIMEOUT,
             StopReason.IDLE_TIMEOUT: FailureKind.IDLE_TIMEOUT,
             StopReason.MAX_LIFETIME: FailureKind.MAX_LIFETIME,
             StopReason.RESULT_TOO_LARGE: FailureKind.RESULT_TOO_LARGE}


def _seen(reason, status, **extra) -> Observed:
    code, lost = STATUSES[status]
    return Observed(reason, code, lost, **extra)


def _expected_on_exit(status: str) -> FailureKind | None:
    return {"ok": None, "retryable": FailureKind.EXIT_CODE,
            "non_retryable": FailureKind.EXIT_CODE, "sigkill": FailureKind.SIGNAL,
            "sigsegv": FailureKind.SIGNAL, "lost": FailureKind.EXIT_STATUS_LOST}[status]


@pytest.mark.parametrize("status", list(STATUSES))
@pytest.mark.parametrize("reason", RACE_REASONS, ids=str)
def test_every_reason_against_every_exit_status(reason, status):
    verdict = decide(_seen(reason, status), PROFILE)
    if reason in LEASE_ENDINGS:  # ownership first, whatever the tool did (P13)
        assert verdict == Reject(reason)
    elif reason is StopReason.SHUTDOWN:
        assert verdict == Release()
    elif reason in BY_REASON:
        assert isinstance(verdict, Failure) and verdict.kind is BY_REASON[reason]
        assert verdict.retryable is RETRYABLE[verdict.kind]
    elif reason is StopReason.CPU_LIMIT:  # no CPU_SECONDS in this profile: judged on exit
        expected = _expected_on_exit(status)
        assert (verdict == Commit()) if expected is None else verdict.kind is expected
    else:
        assert reason is StopReason.EXITED
        expected = _expected_on_exit(status)
        if expected is None:
            assert verdict == Commit()
        else:
            assert isinstance(verdict, Failure) and verdict.kind is expected, verdict
            assert verdict.retryable is (status != "non_retryable")


@pytest.mark.parametrize("status", list(STATUSES))
@pytest.mark.parametrize("reason", RACE_REASONS, ids=str)
def test_an_oom_kill_is_memory_limit_whatever_ended_the_attempt(reason, status):
    """Case F13: the cgroup's OOM evidence outranks every reason but ownership."""
    verdict = decide(_seen(reason, status, usage=Usage(oom_kills=1), memory_cgroup=True),
                     LIMITED)
    if reason in LEASE_ENDINGS or reason is StopReason.SHUTDOWN:
        assert isinstance(verdict, Reject | Release)
    elif reason is StopReason.CPU_LIMIT:  # the CPU watcher fired first: its limit names it
        assert verdict.kind is FailureKind.CPU_LIMIT
    else:
        assert isinstance(verdict, Failure) and verdict.kind is FailureKind.MEMORY_LIMIT
        assert verdict.retryable is False and "OOM" in verdict.message


@pytest.mark.parametrize("reason", [StopReason.EXITED, StopReason.STAGE_TIMEOUT,
                                    StopReason.IDLE_TIMEOUT], ids=str)
def test_out_of_memory_on_stderr_under_rlimit_as_is_memory_limit_unless_it_succeeded(reason):
    tail = "Traceback ...\nMemoryError"
    failed = decide(Observed(reason, 1, stderr_tail=tail), LIMITED)
    assert failed.kind is FailureKind.MEMORY_LIMIT and "RLIMIT_AS" in failed.message
    succeeded = decide(Observed(StopReason.EXITED, 0, stderr_tail=tail), LIMITED)
    assert succeeded == Commit()  # a tool that only talks about memory is not failed
    with_cgroup = decide(Observed(reason, 1, stderr_tail=tail, memory_cgroup=True), LIMITED)
    assert with_cgroup.kind is not FailureKind.MEMORY_LIMIT  # the cgroup would have said


def test_cpu_time_reached_is_cpu_limit_by_watcher_sigxcpu_or_sigkill_past_the_limit():
    for seen in (Observed(StopReason.CPU_LIMIT, -signal.SIGTERM),
                 Observed(StopReason.EXITED, -signal.SIGXCPU),
                 Observed(StopReason.EXITED, -signal.SIGKILL, usage=Usage(cpu_seconds=6.0))):
        verdict = decide(seen, LIMITED)
        assert verdict.kind is FailureKind.CPU_LIMIT and verdict.retryable is False, seen
    below = decide(Observed(StopReason.EXITED, -signal.SIGKILL, usage=Usage(cpu_seconds=1.0)),
                   LIMITED)
    assert below.kind is FailureKind.SIGNAL


def test_stdout_overflow_of_an_exit_0_is_result_too_large():
    verdict = decide(Observed(StopReason.EXITED, 0, stdout_overflow=True, stdout_bytes=99),
                     PROFILE)
    assert verdict.kind is FailureKind.RESULT_TOO_LARGE and "99 bytes" in verdict.message
    assert "SIDECAR_PROFILE_T_MAX_RESULT_BYTES" in verdict.message


def test_the_error_object_drops_absent_details():
    verdict = decide(Observed(StopReason.EXITED, 3, stderr_tail=None), PROFILE)
    assert verdict.error() == {"kind": "exit_code", "message": "the tool exited with code 3",
                               "exit_code": 3}


def test_every_failure_kind_has_a_retry_rule():
    assert set(RETRYABLE) == set(FailureKind)


def test_metric_label_sets_cover_the_whole_vocabulary():
    assert set(metrics.OUTCOMES) == set(Outcome)
    assert set(metrics.FAILURE_KINDS) == set(FailureKind)
    assert set(metrics.HEARTBEAT_RESULTS) == set(HeartbeatResult)
    assert set(metrics.KILL_SIGNALS) == set(KillSignal)
    assert set(metrics.KILL_REASONS) == set(StopReason) - {StopReason.EXITED}
    metrics.start_at_zero("vocab-test", "")
    for reason in metrics.KILL_REASONS:
        for sig in KillSignal:  # cpu_limit and the "already_exited" signal included
            assert metrics.CHILD_KILLS.labels("vocab-test", "", reason, sig)._value.get() == 0
