"""Per-job cgroups: the kernel's container for one attempt's process tree.

Where the host lets the sidecar make cgroups (root with a writable cgroup filesystem),
every attempt gets its own, named ``job-<id>-<token>`` under ``sidecar-jobs`` beside the
sidecar's own cgroup:

- cgroup v2: ``memory.max`` and ``pids.max`` when those controllers can be delegated to
  job cgroups; ``cgroup.kill`` kills the whole tree at once, escapees included; ``cpu.stat``
  and ``memory.peak`` give the attempt's CPU time and peak memory.
- cgroup v1 (the ``memory`` and ``pids`` hierarchies, on hosts that still mount them):
  ``memory.limit_in_bytes`` (and ``memsw``, so swap is no way out) and ``pids.max``;
  peak memory from ``memory.max_usage_in_bytes``.

A host may offer both (a "hybrid" layout: v1 controllers plus a bare v2 hierarchy), and
the sidecar then uses each for what it can do. Where neither is writable, ``detect``
returns a host with nothing usable and the supervisor falls back to rlimits and the psutil
tree scan; ``CgroupHost.describe`` says which, for ``sidecar config``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sidecar.protocol.errors import SidecarError
from sidecar.protocol.model import Usage
from sidecar.worker.linux import read_pseudo_file

PARENT_NAME = "sidecar-jobs"
_SUPERVISOR_LEAF = "sidecar-supervisor"


class CgroupError(SidecarError):
    """A job cgroup could not be made or configured; the message names the file,
    ``errno`` is the error number of the operation that failed (None when unknown), so a
    transient shortage (EAGAIN, ENOSPC, ENOMEM: sidecar.protocol.shortage) is told apart."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class CgroupHost:
    """Where this sidecar may put job cgroups (absolute directories, or None).

    ``v2_dir``: parent of job cgroups in the v2 hierarchy (tree kill, CPU time);
    ``v2_controllers``: which of ``memory`` and ``pids`` job cgroups get there;
    ``v1_memory_dir`` / ``v1_pids_dir``: parents in the v1 hierarchies;
    ``notes``: why a part is not used (shown by ``sidecar config``).
    """

    v2_dir: str | None = None
    v2_controllers: frozenset[str] = frozenset()
    v1_memory_dir: str | None = None
    v1_pids_dir: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def memory(self) -> str | None:
        """Which cgroup version limits memory: "cgroup2", "cgroup1" or None (rlimits)."""
        if "memory" in self.v2_controllers:
            return "cgroup2"
        return "cgroup1" if self.v1_memory_dir else None

    @property
    def pids(self) -> str | None:
        """Which cgroup version limits the process count: "cgroup2", "cgroup1" or None."""
        if "pids" in self.v2_controllers:
            return "cgroup2"
        return "cgroup1" if self.v1_pids_dir else None

    @property
    def usable(self) -> bool:
        """True when at least one hierarchy takes job cgroups."""
        return bool(self.v2_dir or self.v1_memory_dir or self.v1_pids_dir)

    @property
    def parents(self) -> list[str]:
        """The directories job cgroups are made in (one per hierarchy used)."""
        return [d for d in (self.v2_dir, self.v1_memory_dir, self.v1_pids_dir) if d]

    def describe(self) -> dict[str, object]:
        """The active isolation mode, for ``sidecar config`` and the startup log."""
        return {
            "mode": "cgroup" if self.usable else "rlimit",
            "memory_limit": {"cgroup2": "cgroup2 memory.max",
                             "cgroup1": "cgroup1 memory.limit_in_bytes"}.get(
                                 self.memory or "", "RLIMIT_AS per process"),
            "process_limit": {"cgroup2": "cgroup2 pids.max", "cgroup1": "cgroup1 pids.max"}.get(
                self.pids or "", "RLIMIT_NPROC of the RUN_AS user"),
            "cpu_limit": "RLIMIT_CPU per process + CPU time of the tree"
                         + (" (cgroup2 cpu.stat)" if self.v2_dir else " (psutil)"),
            "tree_kill": "cgroup2 cgroup.kill" if self.v2_dir else (
                "cgroup1 members + psutil" if self.usable else "psutil tree scan"),
            "cgroup_dirs": [d for d in (self.v2_dir, self.v1_memory_dir, self.v1_pids_dir) if d],
            "notes": list(self.notes),
        }


def _read(path: str) -> str:
    return read_pseudo_file(path).decode("ascii", errors="replace")


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, mount root, super options) of every cgroup mount."""
    out = []
    try:
        text = _read("/proc/self/mountinfo")
    except OSError:
        return out
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((tail[0], point, fields[3], set(tail[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: "" for v2, each v1 controller name else."""
    paths: dict[str, str] = {}
    try:
        text = _read("/proc/self/cgroup")
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[""] = parts[2]
        for controller in parts[1].split(","):
            if controller:
                paths[controller] = parts[2]
    return paths


def _join(point: str, root: str, path: str) -> str:
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


def _make_parent(own: str) -> str:
    parent = os.path.join(own, PARENT_NAME)
    os.makedirs(parent, exist_ok=True)
    probe = os.path.join(parent, f"probe-{os.getpid()}")
    os.mkdir(probe)
    os.rmdir(probe)
    return parent


def _would_make_parent(own: str) -> str:
    """Where ``_make_parent`` would put job cgroups; OSError if it could not."""
    parent = os.path.join(own, PARENT_NAME)
    if not os.access(parent if os.path.isdir(parent) else own, os.W_OK):
        raise PermissionError(13, "Permission denied", own)
    return parent


def _delegate_v2(own: str, parent: str, wanted: set[str]) -> tuple[frozenset[str], str | None]:
    """Enable ``wanted`` controllers for job cgroups under ``parent``. cgroup v2 forbids
    controllers below a cgroup that holds processes, so when ours does, move this process
    into a leaf of its own first (and back, if that does not help)."""
    available = set(_read(os.path.join(own, "cgroup.controllers")).split()) & wanted
    if not available:
        return frozenset(), "cgroup v2 offers no memory or pids controller here"
    request = " ".join("+" + c for c in sorted(available))
    try:
        _write(os.path.join(own, "cgroup.subtree_control"), request)
    except OSError:
        leaf = os.path.join(own, _SUPERVISOR_LEAF)
        try:
            os.makedirs(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
            _write(os.path.join(own, "cgroup.subtree_control"), request)
        except OSError as exc:
            with contextlib.suppress(OSError):
                _write(os.path.join(own, "cgroup.procs"), str(os.getpid()))
            with contextlib.suppress(OSError):
                os.rmdir(leaf)
            return frozenset(), (f"cgroup v2 controllers {request} cannot be delegated to "
                                 f"job cgroups ({exc.strerror}): other processes share the "
                                 "sidecar's cgroup")
    try:
        _write(os.path.join(parent, "cgroup.subtree_control"), request)
    except OSError as exc:
        return frozenset(), f"cannot enable {request} in {parent} ({exc.strerror})"
    return frozenset(available), None


def detect(mode: str = "auto", probe: bool = True) -> CgroupHost:
    """Find where job cgroups can go. ``mode`` is SIDECAR_CGROUPS: "off" uses none.
    ``probe`` false (``sidecar config``) changes nothing on the host: no directory is made
    and no controller delegated; write access is judged from permissions, and v2
    controllers are reported as they would be offered. Never raises: what cannot be used
    is explained in ``notes``."""
    if mode == "off":
        return CgroupHost(notes=("SIDECAR_CGROUPS=off",))
    own = _own_paths()
    notes: list[str] = []
    v2_dir = v1_memory = v1_pids = None
    controllers: frozenset[str] = frozenset()
    for fstype, point, root, options in _mounts():
        try:
            make = _make_parent if probe else _would_make_parent
            if fstype == "cgroup2" and v2_dir is None and "" in own:
                own_dir = _join(point, root, own[""])
                v2_dir = make(own_dir)
                if probe:
                    controllers, note = _delegate_v2(own_dir, v2_dir, {"memory", "pids"})
                else:
                    offered = _read(os.path.join(own_dir, "cgroup.controllers")).split()
                    controllers = frozenset(offered) & {"memory", "pids"}
                    note = None if controllers else \
                        "cgroup v2 offers no memory or pids controller here"
                if note:
                    notes.append(note)
            elif fstype == "cgroup" and "memory" in options and v1_memory is None \
                    and "memory" in own:
                v1_memory = make(_join(point, root, own["memory"]))
            elif fstype == "cgroup" and "pids" in options and v1_pids is None \
                    and "pids" in own:
                v1_pids = make(_join(point, root, own["pids"]))
        except OSError as exc:
            notes.append(f"{point}: cannot make job cgroups ({exc.strerror or exc})")
    if "memory" in controllers:
        v1_memory = None
    if "pids" in controllers:
        v1_pids = None
    host = CgroupHost(v2_dir, controllers, v1_memory, v1_pids, tuple(notes))
    if not host.usable and not notes:
        notes.append("no cgroup filesystem is mounted")
        host = CgroupHost(notes=tuple(notes))
    return host


def kill_cgroup(path: str, timeout: float = 2.0) -> bool:
    """SIGKILL every process in the cgroup at ``path`` (``cgroup.kill`` where the file
    exists, else each member, repeated while members remain) and remove it. True when the
    cgroup is gone. For leftovers of a dead sidecar (sidecar.worker.leftovers)."""
    kill_file = os.path.join(path, "cgroup.kill")
    procs = os.path.join(path, "cgroup.procs")
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(kill_file):
            with contextlib.suppress(OSError):
                _write(kill_file, "1")
        with contextlib.suppress(OSError, ValueError):
            for pid in (int(line) for line in _read(procs).split()):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _keyed(path: str, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class JobCgroup:
    """The cgroups of one attempt. ``create`` makes them and writes the limits (bytes,
    count; 0 = none); the child joins by writing to every file of ``procs_files`` before
    exec. Raises CgroupError naming the file that failed."""

    def __init__(self, host: CgroupHost, name: str, memory_bytes: int, processes: int):
        self.host = host
        self.name = name
        self.memory_bytes = memory_bytes
        self.processes = processes
        self.v2 = os.path.join(host.v2_dir, name) if host.v2_dir else None
        # A v1 hierarchy is joined only for the limit it enforces: each join costs the
        # spawn a few milliseconds (the kernel's cgroup migration lock). Without it the
        # attempt's peak memory comes from the child's rusage instead.
        self.memory = os.path.join(host.v1_memory_dir, name) \
            if host.v1_memory_dir and memory_bytes else None
        self.pids = os.path.join(host.v1_pids_dir, name) \
            if host.v1_pids_dir and processes else None
        self.dirs = [d for d in (self.v2, self.memory, self.pids) if d]

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the child writes itself into (one per hierarchy)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    @property
    def enforces_limits(self) -> bool:
        """True when a memory or process limit is set here (not only kill and accounting):
        the child must then join before exec, so nothing it forks is ever outside."""
        return bool(self.memory_bytes or self.processes)

    def join_tree(self, pid: int, descendants: Callable[[int], list[int]],
                  rounds: int = 8) -> None:
        """Move ``pid``, a tool started without joining itself, into every hierarchy of
        this cgroup, then each process it forked before the move, until none is outside
        (a fork either precedes the parent's move, and the child is listed and moved in a
        later round, or follows it, and the child is born inside). ``descendants(pid)``
        lists the tree. A process that exits meanwhile is skipped. Raises OSError when
        ``pid`` itself cannot be moved. Only for a cgroup that does not
        ``enforce_limits``: its part is the tree kill and the accounting."""
        for path in self.procs_files:
            try:
                _write(path, str(pid))
            except ProcessLookupError:
                return  # exited already: nothing of it is left to move
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    return
                raise
        for _ in range(rounds):
            forked = descendants(pid)
            if not forked:  # the usual case: no cgroup.procs to read back
                return
            inside = self.members()
            outside = [p for p in forked if p not in inside]
            if not outside:
                return
            for member in outside:
                for path in self.procs_files:
                    with contextlib.suppress(OSError):
                        _write(path, str(member))

    def create(self) -> None:
        """Make the cgroups and write the limits; on failure remove what was made and raise
        CgroupError naming the file."""
        made: list[str] = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            if self.memory_bytes:
                if self.host.memory == "cgroup2":
                    self._set(self.v2, "memory.max", self.memory_bytes)
                    self._set(self.v2, "memory.swap.max", 0, optional=True)
                elif self.memory:
                    self._set(self.memory, "memory.limit_in_bytes", self.memory_bytes)
                    self._set(self.memory, "memory.memsw.limit_in_bytes", self.memory_bytes,
                              optional=True)
            if self.processes:
                if self.host.pids == "cgroup2":
                    self._set(self.v2, "pids.max", self.processes)
                elif self.pids:
                    self._set(self.pids, "pids.max", self.processes)
        except OSError as exc:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            raise CgroupError(f"cannot set up job cgroup {self.name}: "
                              f"{exc.filename or ''} {exc.strerror or exc}".strip(),
                              exc.errno) from None

    @staticmethod
    def _set(directory: str | None, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(directory or "", name)
        if optional and not os.path.exists(path):
            return
        try:
            _write(path, str(value))
        except OSError:
            if not optional:
                raise

    def members(self) -> set[int]:
        """Pids of every live process in the job's cgroups (escapees included)."""
        pids: set[int] = set()
        for path in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(line) for line in _read(path).split())
        return pids

    def kill(self) -> None:
        """SIGKILL every member: ``cgroup.kill`` where there is one (atomic, no fork can
        escape it), else each member, repeated while members remain (at most ~1 s)."""
        if self.v2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.v2, "cgroup.kill"), "1")
                return
        for _ in range(50):
            members = self.members()
            if not members:
                return
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, seconds) of every process that ran in the cgroup,
        exited ones included; None without a v2 cgroup."""
        if not self.v2:
            return None
        usec = _keyed(os.path.join(self.v2, "cpu.stat"), "usage_usec")
        return usec / 1e6

    def usage(self) -> Usage:
        """Peak memory, CPU time, OOM kills and refused forks of the attempt so far."""
        usage = Usage(cpu_seconds=self.cpu_seconds())
        if self.host.memory == "cgroup2" and self.v2:
            with contextlib.suppress(OSError, ValueError):
                usage.peak_memory_bytes = int(_read(os.path.join(self.v2, "memory.peak")))
            usage.oom_kills = _keyed(os.path.join(self.v2, "memory.events"), "oom_kill")
        elif self.memory:
            with contextlib.suppress(OSError, ValueError):
                usage.peak_memory_bytes = int(
                    _read(os.path.join(self.memory, "memory.max_usage_in_bytes")))
            usage.oom_kills = _keyed(os.path.join(self.memory, "memory.oom_control"),
                                     "oom_kill")
        if self.host.pids == "cgroup2" and self.v2:
            usage.process_limit_hits = _keyed(os.path.join(self.v2, "pids.events"), "max")
        elif self.pids:
            usage.process_limit_hits = _keyed(os.path.join(self.pids, "pids.events"), "max")
        return usage

    def remove(self, timeout: float = 2.0) -> list[str]:
        """Remove the cgroups once empty, retrying for up to ``timeout`` seconds (0: one
        try); returns the directories that stayed (busy)."""
        deadline = time.monotonic() + timeout
        left = list(self.dirs)
        while left:
            for d in list(left):
                try:
                    os.rmdir(d)
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError:
                    pass
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return left
