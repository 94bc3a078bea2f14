"""One lease's state machine, and the guard's answer as a pure function of it.

A ``Lease`` is written only through its transitions, each setting every field of its
cause in one call (the lease keeper, sidecar.worker.lease: ``confirm``, ``mark_unknown``,
``restart_suspend_episode``, ``lose``; the supervisor: ``stop``, ``settle``; the fenced
commit: ``keep_evidence``, ``keep_for_journal``; the guard: ``note_request``). Its
``state`` is one ``LeaseState``, by this precedence (the first that holds):

    LOST / ABANDONED  no longer ours (expired, taken over, cancelled: ``reason``), or
                      given up locally at the local deadline with ownership unknown
    STOPPING          the supervisor is stopping the tool (``stopping`` says why)
    SETTLING          the owner is writing the attempt's outcome: no more renewals
    UNKNOWN           the database has not confirmed the lease since it went silent, a
                      row lock skipped its renewal, or the host was suspended (F20)
    HELD              ours, confirmed by the last renewal

``guard_refusal`` maps a state (and the time left before the local deadline) to the
guard's answer (sidecar.worker.guard): None means the tool may take an irreversible step now.

Pure: no I/O. Times are sidecar.protocol.clock CLOCK_BOOTTIME seconds (``ownership_now``);
``suspended`` values are sidecar.protocol.clock.suspended_seconds().
"""

from __future__ import annotations

import asyncio
import datetime as dt
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sidecar.protocol import clock
from sidecar.protocol.verdict import Failure, Park, Snooze
from sidecar.protocol.vocabulary import GuardRefusal, StopReason

if TYPE_CHECKING:
    from sidecar.protocol.model import ClaimedJob


class LeaseState(StrEnum):
    """Where one lease stands (module docstring: the precedence)."""

    HELD = "held"
    UNKNOWN = "unknown"
    SETTLING = "settling"
    STOPPING = "stopping"
    LOST = "lost"
    ABANDONED = "abandoned"


def guard_refusal(state: LeaseState, reason: StopReason | None, fenced_out: bool,
                  time_left: float, min_remaining: float) -> GuardRefusal | None:
    """The guard's answer for a lease in ``state`` (``reason``: why it was lost) whose
    local deadline is ``time_left`` seconds away: None (go) only while it is HELD with at
    least ``min_remaining`` seconds (H + J) left. ``fenced_out``: a fenced write made for
    this attempt (a checkpoint) already found the job no longer ours."""
    if state is LeaseState.LOST:
        return GuardRefusal.CANCELLED if reason is StopReason.CANCELLED \
            else GuardRefusal.LEASE_LOST
    if state is LeaseState.ABANDONED:
        return GuardRefusal.OWNERSHIP_UNKNOWN
    if fenced_out:
        return GuardRefusal.LEASE_LOST
    if state is LeaseState.STOPPING:
        return GuardRefusal.DEADLINE
    if state is LeaseState.SETTLING:
        return GuardRefusal.LEASE_LOST
    if state is LeaseState.UNKNOWN:
        return GuardRefusal.OWNERSHIP_UNKNOWN
    if time_left < min_remaining:
        return GuardRefusal.LEASE_ENDING
    return None


class Lease:
    """One lease this sidecar holds on ``job`` (one attempt: job id and fencing token).

    ``lost`` is set once the lease is no longer ours (supervisors wait on it); ``reason``
    then says why. ``local_deadline`` (CLOCK_BOOTTIME seconds) is when the sidecar gives
    the job up unless a renewal confirms it; ``lease_until`` the end the database last
    confirmed. ``evidence`` holds what the owner could not commit (hash and size only)
    and ``unjournaled`` the events kept while the database did not answer, both journaled
    once it answers. Every field is read-only; the transitions below write them."""

    def __init__(self, job: ClaimedJob, local_deadline: float, lease_until: dt.datetime):
        self.job = job
        self.lost = asyncio.Event()
        self._local_deadline = local_deadline
        self._lease_until = lease_until
        self._reason: StopReason | None = None
        self._stopping: StopReason | None = None
        self._settling = False
        self._unknown_since: float | None = None
        self._suspended_at_confirm = clock.suspended_seconds()
        self._evidence: dict[str, Any] | None = None
        self._request_id: str | None = None
        self._snooze: Snooze | None = None
        self._refused: Failure | None = None
        self._park: Park | None = None
        self._unjournaled: list[tuple[str, dict[str, Any]]] = []

    # --- reading ----------------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        """The lease's one state now, by the module's precedence. A suspend of the host
        since the last confirmation makes it UNKNOWN from the first instant, before the
        lease keeper has looked (case F20)."""
        if self.lost.is_set():
            return LeaseState.ABANDONED if self._reason is StopReason.LOCAL_DEADLINE \
                else LeaseState.LOST
        if self._stopping is not None:
            return LeaseState.STOPPING
        if self._settling:
            return LeaseState.SETTLING
        if self._unknown_since is not None or self.suspended_since_confirm:
            return LeaseState.UNKNOWN
        return LeaseState.HELD

    @property
    def renewable(self) -> bool:
        """Whether the heartbeat still renews it: neither lost nor being settled."""
        return not self.lost.is_set() and not self._settling

    @property
    def suspended_since_confirm(self) -> bool:
        """The host was suspended since ownership was last confirmed (case F20)."""
        return clock.jumped(self._suspended_at_confirm, clock.suspended_seconds())

    @property
    def reason(self) -> StopReason | None:
        """Why the lease was lost (lease_lost, cancelled or local_deadline), else None."""
        return self._reason

    @property
    def abandoned(self) -> bool:
        """Given up locally with ownership unknown: the database must still be told."""
        return self._reason is StopReason.LOCAL_DEADLINE

    @property
    def stopping(self) -> StopReason | None:
        """Why the supervisor is stopping the tool, once it is."""
        return self._stopping

    @property
    def settling(self) -> bool:
        """The owner is writing the attempt's outcome."""
        return self._settling

    @property
    def unknown_since(self) -> float | None:
        """When this episode of unknown ownership began (CLOCK_BOOTTIME s), else None."""
        return self._unknown_since

    @property
    def suspended_at_confirm(self) -> float:
        """sidecar.protocol.clock.suspended_seconds() when ownership was last confirmed."""
        return self._suspended_at_confirm

    @property
    def local_deadline(self) -> float:
        """When the sidecar gives the job up unless a renewal confirms it (CLOCK_BOOTTIME
        seconds)."""
        return self._local_deadline

    @property
    def lease_until(self) -> dt.datetime:
        """The lease end the database last confirmed."""
        return self._lease_until

    @property
    def evidence(self) -> dict[str, Any] | None:
        """What the owner could not commit (hash and size of the result), if anything."""
        return self._evidence

    @property
    def request_id(self) -> str | None:
        """The external request the tool last registered with the guard (P15)."""
        return self._request_id

    @property
    def snooze(self) -> Snooze | None:
        """The snooze the tool asked through the guard (issue 44), the last one wins; None
        when it asked none."""
        return self._snooze

    @property
    def refused(self) -> Failure | None:
        """How the attempt fails because a person denied its step or nobody answered in
        time (issue 44); None otherwise."""
        return self._refused

    @property
    def park(self) -> Park | None:
        """The parked approval request the attempt ends on (APPROVAL_MODE=park); None
        when it asked none."""
        return self._park

    @property
    def unjournaled(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        """The (event, details) kept for the journal, oldest first."""
        return tuple(self._unjournaled)

    # --- transitions ------------------------------------------------------------------

    def confirm(self, lease_until: dt.datetime, local_deadline: float,
                suspended: float) -> float | None:
        """A renewal sent at CLOCK_BOOTTIME ``local_deadline``'s base confirmed the lease
        until ``lease_until``; ``suspended`` is suspended_seconds() when it was sent.
        Ends an episode of unknown ownership: returns when it began, else None."""
        self._lease_until = lease_until
        self._local_deadline = local_deadline
        self._suspended_at_confirm = suspended
        began, self._unknown_since = self._unknown_since, None
        return began

    def mark_unknown(self, now: float) -> bool:
        """Ownership could not be confirmed at ``now``: True when this begins an episode
        (the caller logs and journals it once), False when one is already on."""
        if self._unknown_since is not None:
            return False
        self._unknown_since = now
        return True

    def restart_suspend_episode(self, suspended: float) -> float:
        """A suspend was seen (case F20): count the next one from ``suspended``; returns
        the seconds spent suspended since the last confirmation."""
        jump = suspended - self._suspended_at_confirm
        self._suspended_at_confirm = suspended
        return jump

    def lose(self, reason: StopReason) -> None:
        """The lease is no longer ours for ``reason`` (lease_lost, cancelled, or
        local_deadline: abandoned). The first reason wins."""
        if not self.lost.is_set():
            self._reason = reason
            self.lost.set()

    def stop(self, reason: StopReason) -> None:
        """The supervisor stops the tool for ``reason``: the guard refuses from now on."""
        if self._stopping is None:
            self._stopping = reason

    def settle(self) -> None:
        """The owner is about to write the job's outcome (fenced itself): stop renewing, so
        a renewal racing that write cannot mistake our own commit for a lost lease."""
        self._settling = True

    def keep_evidence(self, details: dict[str, Any]) -> None:
        """Keep what could not be committed (digest, size) for the journal."""
        self._evidence = details

    def note_request(self, request_id: str) -> None:
        """The tool registered the external request it is about to make (P15)."""
        self._request_id = request_id

    def ask_snooze(self, delay_seconds: float, reason: str | None) -> None:
        """The tool asked to run again in ``delay_seconds`` (POST /v1/snooze): the attempt
        ends as a Snooze instead of committing its output (sidecar.protocol.verdict)."""
        self._snooze = Snooze(delay_seconds, reason, "guard")

    def refuse_step(self, failure: Failure) -> None:
        """The approval the tool asked for was denied or expired: the attempt ends as
        ``failure`` whatever the tool does next (sidecar.protocol.verdict)."""
        self._refused = failure

    def park_for(self, request_id: str, action: str) -> None:
        """The tool asked a person's yes in park mode: the attempt ends by parking its job
        until the answer (sidecar.protocol.verdict.Park)."""
        self._park = Park(request_id, action)

    def keep_for_journal(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Keep ``events`` ((event, details), in order) until the database answers."""
        self._unjournaled.extend(events)

    def journaled_first(self) -> None:
        """The oldest kept event was written."""
        self._unjournaled.pop(0)
