"""The Linux process controls Python does not wrap: prctl() subreaper and parent-death signal."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> bool:
    if _libc is None:
        return False
    return _libc.prctl(option, value, 0, 0, 0) == 0


def set_child_subreaper() -> bool:
    """Make this process adopt orphaned descendants (double-forked tool processes) instead
    of PID 1, so the tree kill can still find them. True on success (Linux only)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it ends."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


# The sidecar's own handlers write to its event loop's wakeup fd, which a freshly forked
# child shares: a signal reaching the child before exec would look like one to the sidecar.
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def reset_signal_handlers() -> None:
    """In a forked child before exec: default dispositions for the signals the sidecar
    handles, and no wakeup fd."""
    for sig in _HANDLED_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.set_wakeup_fd(-1)


def child_preexec(parent_pid: int):
    """A Popen ``preexec_fn``: SIGKILL the child when the sidecar dies (a SIGKILLed sidecar
    leaves no tool running); exit at once if the sidecar already died during the fork."""
    sigkill = int(signal.SIGKILL)

    def _in_child() -> None:
        reset_signal_handlers()
        _prctl(PR_SET_PDEATHSIG, sigkill)
        if os.getppid() != parent_pid:
            os._exit(125)

    return _in_child
