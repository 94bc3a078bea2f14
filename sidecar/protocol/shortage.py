"""Transient shortages of the host (case F19): which errors mean "not now" rather than
"never", and how long the claim loop holds off after one.

A process table, memory, descriptor table or disk that is full for a moment says nothing
about the job: the attempt that met it is released without spending it, journaled
(``attempt_shortage``) and counted, and the sidecar pauses claiming for a while instead of
failing its backlog one job after another. Only an error of the program itself (ENOENT,
EACCES, ENOEXEC, a bad interpreter) is a permanent ``spawn_failed``.

Pure: no I/O; the clock is ``time.monotonic``.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable

# The errno values that mean the host ran short of something, not that the tool is broken.
# ETXTBSY: the program file is open for writing by someone else (a concurrent install or
# a fork that still holds a descriptor to it): gone a moment later.
SHORTAGE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE,
                             errno.ENOSPC, errno.ETXTBSY})
# Their names, the ``errno`` label of sidecar_attempt_shortages_total.
SHORTAGE_NAMES = tuple(sorted(errno.errorcode[n] for n in SHORTAGE_ERRNOS))

# The pause after the first shortage, doubled per shortage in a row, capped (seconds).
PAUSE_BASE_SECONDS = 1.0
PAUSE_MAX_SECONDS = 30.0


def shortage_errno(exc: BaseException) -> str | None:
    """The errno name (``"EAGAIN"``...) when ``exc`` is a transient shortage, else None.

    An OSError counts by its errno (a ``CgroupError`` carries the errno of the write that
    failed as ``errno`` too); a RuntimeError "can't start new thread" (a thread pool that
    could not grow at the process limit) counts as EAGAIN."""
    number = getattr(exc, "errno", None)
    if isinstance(number, int) and number in SHORTAGE_ERRNOS:
        return errno.errorcode[number]
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return "EAGAIN"
    return None


class ClaimPause:
    """How long this sidecar holds off claiming after a shortage: PAUSE_BASE_SECONDS after
    the first, doubled for each further one before a tool starts again, at most
    PAUSE_MAX_SECONDS. ``on_end`` is what the caller schedules for the end of a pause it
    began (the claim loop's wake-up), so a waiting claim loop goes on at once."""

    def __init__(self, on_end: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.on_end = on_end
        self._clock = clock
        self._until = 0.0
        self._in_a_row = 0

    def begin(self) -> float:
        """Record one shortage; return the pause it starts (seconds)."""
        self._in_a_row += 1
        pause = min(PAUSE_MAX_SECONDS, PAUSE_BASE_SECONDS * 2 ** (self._in_a_row - 1))
        self._until = max(self._until, self._clock() + pause)
        return pause

    def started(self) -> None:
        """A tool started: the next shortage pauses for PAUSE_BASE_SECONDS again."""
        self._in_a_row = 0

    def remaining(self) -> float:
        """Seconds left of the pause now; 0.0 when claiming may go on."""
        return max(0.0, self._until - self._clock())
