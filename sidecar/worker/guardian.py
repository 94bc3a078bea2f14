"""A tiny watchdog process that outlives a SIGKILLed sidecar just long enough to kill the
descendants that the parent-death signal cannot reach (grandchildren, double-forked and
``setsid`` processes).

The sidecar starts it with a pipe on its stdin and never writes to it. When the sidecar
dies, for any reason, the pipe reaches EOF; the guardian then SIGKILLs every process
whose environment carries ``SIDECAR_OWNER_ID=<the sidecar's owner id>`` (the variable
every tool inherits), kills and removes the sidecar's job cgroups (which also holds
escapees that dropped their environment) and its attempts' work directories
(sidecar.worker.leftovers), and exits. Run as
``python -m sidecar.worker.guardian OWNER_ID [WORK_ROOT [CGROUP_PARENT...]]``, or
``sidecar _guardian ...`` from the frozen bundle.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

from sidecar.worker.linux import make_undumpable


def processes_with_env(name: str, value: str, exclude: set[int]) -> list[psutil.Process]:
    """Running processes whose environment has ``name=value`` (unreadable ones skipped)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def start(owner_id: str, work_root: str = "", cgroup_parents: list[str] | None = None,
          ) -> subprocess.Popen:
    """Start the guardian for this sidecar; keep the returned Popen (its stdin) open.
    ``work_root`` and ``cgroup_parents`` say where the sidecar's leftovers would be.

    In a frozen bundle (PyInstaller) there is no ``python -m``: the bundle's own
    executable runs it as ``sidecar _guardian OWNER_ID`` (dispatched by cli.main).
    """
    args = [owner_id, work_root, *(cgroup_parents or [])]
    if getattr(sys, "frozen", False):
        argv = [sys.executable, "_guardian", *args]
    else:
        argv = [sys.executable, "-m", "sidecar.worker.guardian", *args]
    # Nothing secret: a tool of the same uid can read the guardian's /proc/<pid>/environ
    # until it makes itself non-dumpable, and the guardian needs no database.
    env = {k: v for k, v in os.environ.items() if k in _GUARDIAN_ENV}
    return subprocess.Popen(
        argv, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


# The variables the guardian runs with: what finds and runs the interpreter, no more.
_GUARDIAN_ENV = frozenset({"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH",
                           "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "TMPDIR"})


def main(argv: list[str]) -> int:
    """Wait for the sidecar to end (EOF on stdin), then kill every process still carrying
    its SIDECAR_OWNER_ID and clear its leftovers. argv: OWNER_ID [WORK_ROOT [CGROUP_DIR...]]."""
    owner_id = argv[0]
    make_undumpable()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    me = {os.getpid()}
    for _ in range(5):
        procs = processes_with_env("SIDECAR_OWNER_ID", owner_id, me)
        if not procs:
            break
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        time.sleep(0.05)
    work_root, cgroup_parents = (argv[1] if len(argv) > 1 else ""), argv[2:]
    if work_root or cgroup_parents:
        from sidecar.worker.leftovers import clear_owner, owner_key

        clear_owner(owner_key(owner_id), cgroup_parents, work_root or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
