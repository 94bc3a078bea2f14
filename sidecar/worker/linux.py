"""The Linux process controls Python does not wrap: prctl() subreaper and parent-death signal."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> bool:
    if _libc is None:
        return False
    # prctl reads its arguments as unsigned long: pass them so (PR_SET_NO_NEW_PRIVS
    # refuses anything but zeros in the unused ones).
    zero = ctypes.c_ulong(0)
    return _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero) == 0


# /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN, on in the usual kernels) lists
# the children of one thread: reading a tree down from its root then costs the tree, not
# a read of every /proc/<pid>/stat on the host (what psutil's children() does).
HAVE_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def read_pseudo_file(path: str) -> bytes:
    """The whole content of a small kernel file (/proc, cgroupfs) read with bare
    ``os.open``/``os.read`` until end of file: no buffered file object, no ``fstat`` or
    ``isatty`` probe, which is half the cost of ``open(path, "rb").read()`` on such files
    (read on every job end). Raises OSError like ``open``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
        while data and (more := os.read(fd, 65536)):
            data += more
        return data
    finally:
        os.close(fd)


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (the children of every one of its threads); empty
    when ``pid`` is gone. Needs HAVE_PROC_CHILDREN. Like any /proc walk it can miss a
    child forked or re-parented while it reads: callers that kill re-scan."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            listed = read_pseudo_file(f"/proc/{pid}/task/{tid}/children")
            if listed:
                found.extend(map(int, listed.split()))
        except (OSError, ValueError):
            continue
    return found


def adopted_pids(pid: int) -> list[int]:
    """The children of the thread group leader of ``pid`` (a child subreaper, the
    sidecar): where the kernel puts every orphan it hands to a subreaper. Linux gives an
    orphan to the first live thread of the subreaper's thread group (kernel/exit.c,
    find_new_reaper -> find_alive_thread, walking the group from its leader), so while
    the leader lives no orphan is a child of another thread; children those threads
    forked themselves (the tools, forked by the spawn thread) are not listed. One read
    instead of one per thread. Empty when ``pid`` is gone."""
    try:
        listed = read_pseudo_file(f"/proc/{pid}/task/{pid}/children")
        return [int(part) for part in listed.split()]
    except (OSError, ValueError):
        return []


def descendant_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children, their children, ...), ``pid`` excluded,
    read from the tree down (see child_pids)."""
    found: list[int] = []
    seen = {pid}
    pending = [pid]
    while pending:
        for child in child_pids(pending.pop()):
            if child not in seen:
                seen.add(child)
                found.append(child)
                pending.append(child)
    return found


def is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited and waits to be reaped (state Z in /proc/<pid>/stat)."""
    try:
        stat = read_pseudo_file(f"/proc/{pid}/stat")
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE of this process to its hard limit where the kernel
    allows (issue 25): descriptors are what a flood of connections to the guard takes, and
    a soft limit of 1024 under a hard one of 524288 (systemd's default) leaves most of
    them unused. Returns (soft before, soft after); unchanged when refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, soft
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def set_child_subreaper() -> bool:
    """Make this process adopt orphaned descendants (double-forked tool processes) instead
    of PID 1, so the tree kill can still find them. True on success (Linux only)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def make_undumpable() -> bool:
    """Make this process non-dumpable: another process of the same uid (a tool) can then
    neither read its /proc/<pid>/environ, mem, maps or fds, nor ptrace it; only
    CAP_SYS_PTRACE can. Exec resets it, so tools are unaffected. True on success."""
    return _prctl(PR_SET_DUMPABLE, 0)


def forbid_new_privileges() -> bool:
    """Set ``no_new_privs`` on the calling *thread* (case F23): no ``execve`` by it or by
    any process it forks from then on can gain privileges (setuid/setgid bits and file
    capabilities are ignored). It cannot be unset, and children inherit it. True on
    success (Linux 3.5 and later)."""
    return _prctl(PR_SET_NO_NEW_PRIVS, 1)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that forked it ends."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


# The sidecar's own handlers write to its event loop's wakeup fd, which a freshly forked
# child shares: a signal reaching the child before exec would look like one to the sidecar.
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# What the sidecar relies on receiving or collecting (case F10): SIGCHLD ignored makes the
# kernel reap every child, so no exit status can be read (case F9); the termination
# signals ignored or blocked make a pod's SIGTERM never arrive.
_RESET_AT_START = (signal.SIGCHLD, *_HANDLED_SIGNALS)
# Every signal a process may change: SIGKILL and SIGSTOP cannot be caught or ignored.
_SETTABLE_SIGNALS = tuple(sig for sig in signal.valid_signals()
                          if sig not in (signal.SIGKILL, signal.SIGSTOP))
# Ignored by Python itself at start-up; subprocess's restore_signals gives tools SIG_DFL.
_PYTHON_IGNORES = frozenset(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ")
                            if hasattr(signal, name))


def reset_inherited_signal_state() -> list[str]:
    """At start, in the main thread before any other thread exists: unblock every signal
    and restore the default disposition of every signal the launcher left ignored (Linux
    keeps a blocked mask and ``SIG_IGN`` across exec; launchers in Perl, Node or some
    thread runtimes leave them so, nohup ignores SIGHUP). Case F10.

    A tool started by vfork (sidecar.worker.child) keeps what the sidecar ignores, so nothing
    may stay ignored here but what Python ignores for itself (SIGPIPE, SIGXFSZ; tools get
    those back at SIG_DFL). SIGINT goes back to Python's own KeyboardInterrupt handler.
    Returns the names of the signals that were reset, for the start-up log (the ones the
    sidecar relies on first). Threads started later inherit the cleared mask, and so do
    the tools."""
    fixed = [_signal_name(sig)
             for sig in signal.pthread_sigmask(signal.SIG_SETMASK, [])]
    ordered = [*_RESET_AT_START, *(sig for sig in _SETTABLE_SIGNALS
                                   if sig not in _RESET_AT_START)]
    for sig in ordered:
        if sig in _PYTHON_IGNORES:
            continue
        try:
            ignored = signal.getsignal(sig) == signal.SIG_IGN
        except (OSError, ValueError):
            continue
        if ignored:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                              else signal.SIG_DFL)
                fixed.append(f"{_signal_name(sig)}:ignored")
    return fixed


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal
        return f"SIGRT{sig - signal.SIGRTMIN}" if sig >= signal.SIGRTMIN else str(sig)


def reset_signal_handlers() -> None:
    """In a forked child before exec: an empty signal mask and the default disposition for
    every signal (only ``SIG_IGN`` and the mask survive exec, so a tool would inherit
    them; the sidecar's own handlers would be reset by exec anyway), and no wakeup fd.
    A tool thus starts as if launched by a clean shell, whatever launched the sidecar."""
    with contextlib.suppress(OSError, ValueError):
        signal.set_wakeup_fd(-1)
    for sig in _SETTABLE_SIGNALS:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
