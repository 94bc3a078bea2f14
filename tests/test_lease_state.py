"""The lease as a state machine with one writer, and the guard's answer as a pure function of
its state (sidecar.protocol.lease_state): fast unit tests, no database and no process (the rules
are also exercised end to end by test_guard.py, test_ownership.py and test_clocks.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import uuid

import pytest

from sidecar.protocol.clock import ownership_now, suspended_seconds
from sidecar.protocol.lease_state import Lease, LeaseState, guard_refusal
from sidecar.protocol.model import ClaimedJob
from sidecar.protocol.vocabulary import GuardRefusal, StopReason

pytestmark = pytest.mark.unit

UNTIL = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
MIN_LEFT = 2.0  # H + J


def _lease(seconds_left: float = 60.0) -> Lease:
    job = ClaimedJob(id=uuid.uuid4(), tool="t", payload_text="{}", fencing_token=3, attempt=1,
                     max_attempts=3, lease_until=UNTIL, lease_remaining=seconds_left,
                     idempotency_key="k", reclaimed=False)
    return Lease(job, ownership_now() + seconds_left, UNTIL)


@pytest.fixture
def loop():
    """Lease.lost is an asyncio.Event: give it a loop of its own."""
    running = asyncio.new_event_loop()
    asyncio.set_event_loop(running)
    yield running
    asyncio.set_event_loop(None)
    running.close()


def test_a_new_lease_is_held_and_renewable(loop):
    lease = _lease()
    assert lease.state is LeaseState.HELD and lease.renewable
    assert lease.reason is None and lease.stopping is None and not lease.abandoned


@pytest.mark.parametrize("reason, state", [
    (StopReason.LEASE_LOST, LeaseState.LOST),
    (StopReason.CANCELLED, LeaseState.LOST),
    (StopReason.LOCAL_DEADLINE, LeaseState.ABANDONED),
])
def test_losing_sets_state_reason_and_event_in_one_call_and_the_first_reason_wins(
        loop, reason, state):
    lease = _lease()
    lease.lose(reason)
    assert lease.lost.is_set() and lease.state is state and lease.reason is reason
    assert not lease.renewable
    assert lease.abandoned is (reason is StopReason.LOCAL_DEADLINE)
    lease.lose(StopReason.CANCELLED if reason is not StopReason.CANCELLED
               else StopReason.LEASE_LOST)
    assert lease.reason is reason and lease.state is state


def test_unknown_begins_one_episode_and_a_confirmation_ends_it(loop):
    lease = _lease()
    began = ownership_now()
    assert lease.mark_unknown(began) is True
    assert lease.mark_unknown(began + 1) is False  # one episode, one log line
    assert lease.state is LeaseState.UNKNOWN and lease.unknown_since == began
    later = UNTIL + dt.timedelta(seconds=30)
    assert lease.confirm(later, began + 30, suspended_seconds()) == began
    assert lease.state is LeaseState.HELD and lease.unknown_since is None
    assert lease.lease_until == later and lease.local_deadline == began + 30
    assert lease.confirm(later, began + 31, suspended_seconds()) is None


def test_a_suspend_since_the_last_confirmation_makes_the_lease_unknown(loop):
    """Case F20: a jump between the clocks since the confirmation is unknown ownership
    from the first instant; restarting the episode counts the jump once."""
    lease = _lease()
    lease.confirm(UNTIL, ownership_now() + 60, suspended_seconds() - 5.0)  # 5 s suspended since
    assert lease.suspended_since_confirm and lease.state is LeaseState.UNKNOWN
    jump = lease.restart_suspend_episode(suspended_seconds())
    assert jump >= 4.99 and not lease.suspended_since_confirm
    assert lease.state is LeaseState.HELD


def test_precedence_lost_over_stopping_over_settling_over_unknown(loop):
    lease = _lease()
    lease.mark_unknown(ownership_now())
    lease.settle()
    assert lease.state is LeaseState.SETTLING and not lease.renewable
    lease.stop(StopReason.STAGE_TIMEOUT)
    lease.stop(StopReason.SHUTDOWN)  # the first stop reason stays
    assert lease.state is LeaseState.STOPPING and lease.stopping is StopReason.STAGE_TIMEOUT
    lease.lose(StopReason.CANCELLED)
    assert lease.state is LeaseState.LOST


def test_events_kept_for_the_journal_leave_in_order(loop):
    lease = _lease()
    lease.keep_for_journal([("a", {}), ("b", {"x": 1})])
    lease.keep_for_journal([("c", {})])
    assert [e for e, _ in lease.unjournaled] == ["a", "b", "c"]
    lease.journaled_first()
    assert [e for e, _ in lease.unjournaled] == ["b", "c"]
    lease.keep_evidence({"sha256": "00", "bytes": 2})
    lease.note_request("req-1")
    assert lease.evidence == {"sha256": "00", "bytes": 2} and lease.request_id == "req-1"


def test_no_field_is_writable_from_outside(loop):
    lease = _lease()
    for name in ("reason", "stopping", "settling", "unknown_since", "local_deadline",
                 "lease_until", "evidence", "request_id", "unjournaled", "state"):
        with pytest.raises(AttributeError):
            setattr(lease, name, None)


EXPECTED = {
    # state: the answer with plenty of time left (and not fenced out)
    LeaseState.HELD: None,
    LeaseState.UNKNOWN: GuardRefusal.OWNERSHIP_UNKNOWN,
    LeaseState.SETTLING: GuardRefusal.LEASE_LOST,
    LeaseState.STOPPING: GuardRefusal.DEADLINE,
    LeaseState.ABANDONED: GuardRefusal.OWNERSHIP_UNKNOWN,
}


@pytest.mark.parametrize("state, reason, fenced_out, time_left", list(itertools.product(
    list(LeaseState), [None, StopReason.LEASE_LOST, StopReason.CANCELLED,
                       StopReason.LOCAL_DEADLINE],
    [False, True], [60.0, MIN_LEFT + 0.01, MIN_LEFT - 0.01, -1.0])))
def test_the_guard_answer_over_every_state(state, reason, fenced_out, time_left):
    """Every state x cause x fenced-out x time left: "go" (None) only for a HELD lease,
    not fenced out, with at least H + J left; a lost lease says why (cancelled or lost),
    an abandoned one that ownership is unknown; a fenced-out attempt is lost unless the
    lease already says more; a short lease is "lease_ending" only when nothing else
    refuses."""
    answer = guard_refusal(state, reason, fenced_out, time_left, MIN_LEFT)
    if state is LeaseState.LOST:
        expected = GuardRefusal.CANCELLED if reason is StopReason.CANCELLED \
            else GuardRefusal.LEASE_LOST
    elif state is LeaseState.ABANDONED:
        expected = GuardRefusal.OWNERSHIP_UNKNOWN
    elif fenced_out:
        expected = GuardRefusal.LEASE_LOST
    elif EXPECTED[state] is not None:
        expected = EXPECTED[state]
    else:
        expected = GuardRefusal.LEASE_ENDING if time_left < MIN_LEFT else None
    assert answer == expected
    assert (answer is None) == (state is LeaseState.HELD and not fenced_out
                                and time_left >= MIN_LEFT)
