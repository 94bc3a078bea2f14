"""The clock of ownership (case F20): every local deadline that decides whether this
sidecar may still act for a lease runs on ``CLOCK_BOOTTIME``, never on ``CLOCK_MONOTONIC``.

``CLOCK_MONOTONIC`` stops while the host (or the sidecar's VM) is suspended; the database
clock that ends a lease does not. A lease of L seconds that was ours before a 60 s suspend
is gone after it, although the monotonic clock says a second passed. ``CLOCK_BOOTTIME``
counts the suspended time, so a local deadline on it passes as the lease does.

A jump between the two clocks (their difference grows only across a suspend) means this
process lost time it cannot account for: the lease keeper and the guard then treat every
lease as unknown until a renewal sent after the jump confirms it (``clock_jump`` in the
log). Durations that only measure (metrics, log fields) keep the monotonic clock.

Pure: reads two clocks, imports no I/O.
"""

from __future__ import annotations

import time

# Seconds of growth of (CLOCK_BOOTTIME - CLOCK_MONOTONIC) taken as a suspend. The two
# clocks run at the same rate while the host runs, so their difference is constant to
# well under a millisecond; a quarter second leaves room for reading them one after the
# other on a loaded host.
JUMP_TOLERANCE_SECONDS = 0.25


def ownership_now() -> float:
    """Seconds on CLOCK_BOOTTIME (counts time suspended): the clock of every local
    deadline of ownership (the conservative local deadline, the guard's answers, the
    stage deadline, the lifetime cap)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def suspended_seconds() -> float:
    """CLOCK_BOOTTIME - CLOCK_MONOTONIC, in seconds: how long the host has been suspended
    since it booted. It grows only across a suspend; compare two readings with
    ``jumped``.

    The two clocks are read one after the other, and a process preempted between the two
    reads would see their difference move by the preemption; so the boot-time reading is
    taken between two monotonic ones, and the narrowest of up to three such sandwiches
    is used (off by at most half its width)."""
    best_width, best = float("inf"), 0.0
    for _ in range(3):
        before = time.monotonic()
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        after = time.monotonic()
        if after - before < best_width:
            best_width, best = after - before, boot - (before + after) / 2
        if best_width < 0.001:
            break
    return best


def jumped(before: float, after: float) -> bool:
    """Whether the host was suspended between two ``suspended_seconds()`` readings."""
    return after - before > JUMP_TOLERANCE_SECONDS
