"""What the tool may see and use: its environment, its work directory, its limits and its
user. The supervisor asks this module for an attempt's ``Sandbox`` and hands the pieces to
the child; docs/isolation.md states what is contained and what is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field

from sidecar.protocol.errors import ConfigError
from sidecar.protocol.model import LeaseProfile, tool_env_key
from sidecar.protocol.results import BadResult
from sidecar.protocol.vocabulary import FailureKind
from sidecar.runtime.config import Settings
from sidecar.worker import safefs
from sidecar.worker.cgroups import CgroupError, CgroupHost, JobCgroup
from sidecar.worker.leftovers import lock_directory, remove_tree  # noqa: F401 - re-exported
from sidecar.worker.linux import PR_SET_PDEATHSIG, _prctl, reset_signal_handlers

RESULT_FILE_NAME = "result.json"
# The attempt's own Unix socket to the guard (SIDECAR_GUARD_SOCKET, issue 41).
GUARD_SOCKET_NAME = "guard.sock"
_RLIMIT_NAMES = {getattr(resource, name): name for name in (
    "RLIMIT_CORE", "RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC")}
# The tool's own temporary files go to its work directory too, and are removed with it.
TMPDIR_VARIABLES = ("TMPDIR", "TMP", "TEMP")

# A unix socket's path holds at most 107 bytes (sun_path is 108 with its NUL). Chromium,
# LibreOffice, D-Bus and X put sockets under TMPDIR, HOME or XDG_RUNTIME_DIR: every
# directory handed to a tool leaves SOCKET_NAME_BYTES of it to the tool's own names.
SOCKET_PATH_MAX_BYTES = 107
SOCKET_NAME_BYTES = 64
# An attempt's work directory is <work root>/<owner key (12)>.j<8 random>; HOME and
# XDG_RUNTIME_DIR are one letter below it, the XDG config, cache and data homes below HOME.
WORK_DIR_NAME_BYTES = 12 + 2 + 8
HOME_DIR_NAME = "h"
RUNTIME_DIR_NAME = "r"
MAX_WORK_ROOT_BYTES = (SOCKET_PATH_MAX_BYTES - SOCKET_NAME_BYTES - 1 - len(HOME_DIR_NAME) - 1
                       - WORK_DIR_NAME_BYTES - 1)


def run_as_ids(spec: str) -> tuple[int, int] | None:
    """``uid[:gid]`` -> (uid, gid); the gid defaults to the uid's primary group, else the
    uid itself. None for an empty spec."""
    if not spec:
        return None
    uid_text, _, gid_text = spec.partition(":")
    uid = int(uid_text)
    if gid_text:
        return uid, int(gid_text)
    try:
        return uid, pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid, uid


def check_profile(profile: LeaseProfile, host: CgroupHost, euid: int | None = None) -> None:
    """Refuse a profile whose isolation this host cannot give (ConfigError, one line):
    RUN_AS without root, and PROCESSES with neither a pids cgroup nor RUN_AS (RLIMIT_NPROC
    does not bind root, and for any other user counts all its processes on the host)."""
    euid = os.geteuid() if euid is None else euid
    var = "SIDECAR" if profile.tool.startswith("(") else \
        f"SIDECAR_PROFILE_{tool_env_key(profile.tool)}"  # "(defaults)": SIDECAR_<FIELD>
    if profile.run_as and euid != 0:
        raise ConfigError(f"{profile.sources.get('RUN_AS', var + '_RUN_AS')}={profile.run_as}: "
                          "the sidecar must run as root to start a tool as another user; "
                          "unset it, or run the sidecar as root")
    nr_open = _nr_open()
    if profile.open_files and nr_open and profile.open_files > nr_open:
        raise ConfigError(
            f"{profile.sources.get('OPEN_FILES', var + '_OPEN_FILES')}={profile.open_files}: "
            f"above this kernel's fs.nr_open ({nr_open}), so no process could get it; "
            "lower it")
    if profile.processes and host.pids is None and not profile.run_as:
        raise ConfigError(
            f"{profile.sources.get('PROCESSES', var + '_PROCESSES')}={profile.processes} "
            "cannot be enforced here: no pids cgroup can be made "
            f"({'; '.join(host.notes) or 'none'}) and without one only RLIMIT_NPROC is left, "
            "which needs the tool to run as its own user: set "
            f"{var}_RUN_AS=uid[:gid], or give the sidecar a writable cgroup")


# --- the namespace sandbox (bubblewrap) -------------------------------------------------

# Where bwrap is looked for when it is not on the sidecar's PATH (Debian's bubblewrap).
BWRAP_PATHS = ("/usr/bin/bwrap", "/usr/local/bin/bwrap")
# The sandbox's own tmpfs mounts: what the tool sees there is its own, empty at the start.
SANDBOX_TMPFS = ("/tmp",)
# Why bwrap cannot mount the attempt's own /proc in a container, and the fix: the runtime
# masks parts of the container's /proc, and the kernel then refuses a new proc mount in a
# user namespace (it would reveal what the mask hides). docs/isolation.md, "In a container".
MASKED_PROC_HINT = ("the container runtime masks /proc: run the container with an unmasked "
                    "/proc (Kubernetes: securityContext.procMount: Unmasked with "
                    "hostUsers: false; podman: --security-opt unmask=/proc/*; docker: "
                    "--security-opt systempaths=unconfined)")
# The longest the start-up probe of the sandbox may take (seconds).
PROBE_TIMEOUT_SECONDS = 10.0
# bwrap reports a tool killed by signal N as exit status 128 + N (bash's convention);
# signals are 1..64 on Linux.
_SIGNAL_EXIT_BASE = 128
_MAX_SIGNAL = 64


def find_bwrap() -> str | None:
    """The bubblewrap executable: ``bwrap`` on PATH, else one of BWRAP_PATHS, else the
    one the relocatable bundle carries (``bwrap/bwrap`` beside the frozen executable,
    packaging/build_bundle.py); None when there is none."""
    found = shutil.which("bwrap")
    if found:
        return os.path.realpath(found)
    candidates = list(BWRAP_PATHS)
    if getattr(sys, "frozen", False):
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(sys.executable)),
                                       "bwrap", "bwrap"))
    return next((path for path in candidates if os.access(path, os.X_OK)), None)


def secret_files(settings: Settings) -> list[str]:
    """The files holding secrets the sidecar reads: every ``SIDECAR_*_FILE`` setting of
    sidecar.runtime.config's GLOBAL_FIELDS that is set (today ``SIDECAR_DATABASE_URL_FILE`` and
    ``SIDECAR_LISTEN_DATABASE_URL_FILE``)."""
    from sidecar.runtime.config import GLOBAL_FIELDS

    out = []
    for name in GLOBAL_FIELDS:
        value = getattr(settings, name.lower(), "") if name.endswith("_FILE") else ""
        if value:
            out.append(value)
    return out


def decode_sandbox_status(code: int) -> int:
    """The tool's exit status as ``subprocess`` reports it (negative: the signal that
    killed it) from the ``exit-code`` bwrap reports (``--json-status-fd``): bwrap turns
    a death by signal N into 128 + N (its ``propagate_exit_status``), so 129..192 are
    read back as -1..-64. A tool that itself exits with 129..192 is therefore reported
    as killed by that signal, as bash reports it (docs/isolation.md)."""
    if _SIGNAL_EXIT_BASE < code <= _SIGNAL_EXIT_BASE + _MAX_SIGNAL:
        return -(code - _SIGNAL_EXIT_BASE)
    return code


@dataclass(frozen=True)
class SandboxPlan:
    """How every attempt of one sidecar is wrapped in bubblewrap (docs/isolation.md).

    ``bwrap``: the executable (absolute path). ``work_root``: the real path of
    ``SIDECAR_WORK_DIR``, hidden (an empty tmpfs) but for the attempt's own directory.
    ``hidden_dirs``: directories replaced by an empty tmpfs (those of every
    ``*_FILE`` secret); ``hidden_files``: secret files directly under ``/``, covered by
    ``/dev/null``. ``network``: ``host`` or ``none`` (a new, empty network namespace).
    ``extra_paths``: ``(path, "ro"|"rw")`` bound at the same place. The attempt's guard
    socket is in its work directory (Sandbox.guard_listener), bound with it: reachable
    with either ``network``, and only by that attempt (the work root is hidden)."""

    bwrap: str
    work_root: str
    hidden_dirs: tuple[str, ...] = ()
    hidden_files: tuple[str, ...] = ()
    network: str = "host"
    extra_paths: tuple[tuple[str, str], ...] = ()

    def mounted_paths(self) -> tuple[str, ...]:
        """The host paths whose mounts bwrap sets up by name (``mounts_moved``): the
        work root, each hidden directory and file, each EXTRA_PATHS entry."""
        return (self.work_root, *self.hidden_dirs, *self.hidden_files,
                *(path for path, _mode in self.extra_paths))

    def argv(self, command: list[str], job_dir: str | None = None,
             status_fd: int | None = None) -> list[str]:
        """The bwrap command line that runs ``command`` in the attempt's sandbox: user,
        mount, PID, IPC and UTS namespaces (and network with ``none``), no capabilities,
        no further user namespaces, a new session, SIGKILL when the sidecar's spawning
        thread dies; ``/`` read-only, its own ``/dev``, ``/proc`` and ``/tmp``, the
        secrets' directories and the work root hidden, ``job_dir`` (its work directory,
        HOME and TMPDIR) read-write and its current directory. ``status_fd``: a
        descriptor the child inherits, where bwrap writes its JSON status (the
        ``exit-code`` line tells a tool that ran from a sandbox that failed to start)."""
        args = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts"]
        if self.network == "none":
            args.append("--unshare-net")
        args += ["--disable-userns", "--die-with-parent", "--new-session",
                 "--cap-drop", "ALL",
                 "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for path in SANDBOX_TMPFS:
            args += ["--tmpfs", path]
        for path in self.hidden_dirs:
            args += ["--tmpfs", path]
        for path in self.hidden_files:
            args += ["--ro-bind", "/dev/null", path]
        if self.work_root not in SANDBOX_TMPFS:
            args += ["--tmpfs", self.work_root]
        if job_dir:
            args += ["--bind", job_dir, job_dir]
        for path, mode in self.extra_paths:
            args += ["--bind" if mode == "rw" else "--ro-bind", path, path]
        if job_dir:
            args += ["--chdir", job_dir]
        if status_fd is not None:
            args += ["--json-status-fd", str(status_fd)]
        return [*args, "--", *command]


# What each path a sandbox mounts by name (``SandboxPlan.mounted_paths``) named when it
# was set up: ``(path, (st_dev, st_ino))``, None for a path that did not exist.
MountIdentities = tuple[tuple[str, "tuple[int, int] | None"], ...]


def mount_identities(paths: tuple[str, ...] | list[str]) -> MountIdentities:
    """The identity of what each of ``paths`` names now, links followed: ``(path,
    (st_dev, st_ino))``, or ``(path, None)`` when it cannot be stat'ed. One ``stat`` each;
    never raises."""
    found = []
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found.append((path, None))
        else:
            found.append((path, (info.st_dev, info.st_ino)))
    return tuple(found)


def mounts_moved(identities: MountIdentities) -> bool:
    """True when a path of ``identities`` (``mount_identities`` when a sandbox was set
    up) names something else now: removed, renamed away, replaced, or a link turned.

    bwrap mounts each hidden directory's tmpfs, each hidden file's /dev/null and each
    ``EXTRA_PATHS`` bind on what its path named at set-up. A sandbox that outlives a
    change keeps the old object: since Linux 3.18 a directory or file of the host that
    is renamed or removed takes the mounts on it in other namespaces along, so a secrets'
    directory replaced on the host shows its new contents in a sandbox set up before
    (and a bind shows the old, or a deleted, directory). A sandbox that waits for jobs
    (a prepared launcher, a warm process) is checked with this before each job and
    replaced when it is true."""
    return bool(identities) and mount_identities([p for p, _ in identities]) != identities


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


# How to give a sandboxed tool its inputs, said where the sandbox hides a path (issue 41).
BIND_HINT = ("put inputs elsewhere, or bind their directory with EXTRA_PATHS "
             "(e.g. SIDECAR_EXTRA_PATHS=/srv/inputs:ro; per tool "
             "SIDECAR_PROFILE_<TOOL>_EXTRA_PATHS)")


def hidden_paths(plan: SandboxPlan) -> list[str]:
    """The host paths a tool under ``plan`` cannot see, sorted: the sandbox's own /tmp
    (SANDBOX_TMPFS: the tool sees an empty one), the work root (but for the attempt's own
    directory) and every secret's directory or file. ``EXTRA_PATHS`` may bind a
    directory below one of them back in (``plan.extra_paths``)."""
    return sorted({*SANDBOX_TMPFS, plan.work_root, *plan.hidden_dirs, *plan.hidden_files})


# An absolute path inside a text (a JSON payload): a "/" at the start or after a quote,
# a space, "=", ":", ",", "(" or "[", up to the next such character or a backslash.
_PATH_IN_TEXT = re.compile(r"(?<![^\s\"'=:,(\[])/[^\s\"'\\,;]*")
# A payload is scanned for hidden paths up to this many characters, naming at most
# HIDDEN_PATHS_NAMED of them.
HIDDEN_PATH_SCAN_CHARS = 1 << 20
HIDDEN_PATHS_NAMED = 3


def hidden_paths_named(plan: SandboxPlan, text: str) -> list[str]:
    """The absolute paths ``text`` (a job's payload as JSON text; its first
    HIDDEN_PATH_SCAN_CHARS characters) names under a path the sandbox hides
    (``hidden_paths``) and that no ``EXTRA_PATHS`` entry binds back: up to
    HIDDEN_PATHS_NAMED of them, as written, in order. A tool given such a path as its
    input finds nothing there and fails with its own status (issue 41, point 8): the
    sidecar says why in the failed job's error (``hidden_path_hint``)."""
    hidden = hidden_paths(plan)
    found: list[str] = []
    for match in _PATH_IN_TEXT.finditer(text, 0, HIDDEN_PATH_SCAN_CHARS):
        path = os.path.normpath(match.group())
        if any(_under(path, h) for h in hidden) \
                and not any(_under(path, bound) for bound, _ in plan.extra_paths) \
                and match.group() not in found:
            found.append(match.group())
            if len(found) == HIDDEN_PATHS_NAMED:
                break
    return found


def hidden_path_hint(paths: list[str]) -> str:
    """The ``hint`` of a failed job whose payload names ``paths`` (``hidden_paths_named``):
    which paths, why the tool could not read them, how to bind inputs."""
    return (f"the payload names {', '.join(paths)}, which the sandbox hides from the tool "
            "(it has an empty /tmp of its own and sees neither the work root nor the "
            f"secrets' directories); {BIND_HINT}")


def plan_sandbox(settings: Settings, profile: LeaseProfile, work_root: str, bwrap: str,
                 ids: tuple[int, int] | None = None) -> SandboxPlan:
    """The SandboxPlan of ``profile``'s attempts under ``work_root``. Each secret file's
    directory is hidden (both the one named and the one its links lead to, as a mounted
    Kubernetes Secret's ``..data`` links do) unless the tool's user (``ids``, RUN_AS)
    cannot even reach it. Raises ConfigError (one line) for an ``EXTRA_PATHS`` entry that
    does not exist, or that would show a hidden directory or the work root."""
    var = profile.sources.get("EXTRA_PATHS", "SIDECAR_EXTRA_PATHS")
    hidden_dirs: dict[str, None] = {}
    hidden_files: dict[str, None] = {}
    for secret in secret_files(settings):
        for path in dict.fromkeys((os.path.abspath(secret), os.path.realpath(secret))):
            parent = os.path.dirname(path)
            if ids is not None and _unsearchable_ancestor(parent, *ids):
                continue  # the tool's user cannot reach it anyway (nor could bwrap mount)
            if parent == "/":
                hidden_files[path] = None
            elif not any(_under(parent, tmp) for tmp in SANDBOX_TMPFS):
                hidden_dirs[parent] = None
    root = os.path.realpath(work_root)
    for path, _mode in profile.extra_paths:
        if not os.path.exists(path):
            raise ConfigError(f"{var}: {path} does not exist, so no attempt could be "
                              "sandboxed; make it or remove it from the list")
        # A path inside the work root is allowed (the default root is /tmp); one that
        # holds it, or touches a secret's directory, is not.
        for hidden in [*hidden_dirs, *hidden_files, root]:
            if _under(hidden, path) or (hidden != root and _under(path, hidden)):
                raise ConfigError(f"{var}: {path} would show {hidden} to the tool, which "
                                  "the sandbox hides (a secret's directory or the work "
                                  "root); bind another path")
    return SandboxPlan(bwrap, root, tuple(hidden_dirs), tuple(hidden_files),
                       profile.network, profile.extra_paths)


def probe_sandbox(plan: SandboxPlan, ids: tuple[int, int] | None = None) -> str | None:
    """Run ``true`` once in a sandbox of ``plan`` (as the tool's user ``ids``, RUN_AS):
    None when it works, else why not (bwrap's own last line of error, e.g. no
    unprivileged user namespaces). Blocks up to PROBE_TIMEOUT_SECONDS."""
    true = shutil.which("true") or "/bin/true"
    kwargs: dict[str, object] = {}
    if ids is not None:
        kwargs = {"user": ids[0], "group": ids[1], "extra_groups": []}
    try:
        done = subprocess.run(plan.argv([os.path.realpath(true)]), stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=PROBE_TIMEOUT_SECONDS,
                              close_fds=True, cwd="/", **kwargs)
    except subprocess.TimeoutExpired:
        return f"{plan.bwrap} did not finish within {PROBE_TIMEOUT_SECONDS:g} s"
    except OSError as exc:
        return f"cannot run {plan.bwrap}: {exc.strerror or exc}"
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return (lines[-1] if lines else f"{plan.bwrap} exited with {done.returncode}")[:300]
    return None


def check_sandbox(settings: Settings, profile: LeaseProfile, work_root: str,
                  command: list[str] | None = None) -> tuple[SandboxPlan | None, str]:
    """Decide, once at start, whether ``profile``'s attempts run sandboxed: returns
    ``(plan, "")`` when they do, ``(None, reason)`` when they do not (``SANDBOX=off``, or
    ``auto`` where bwrap or unprivileged user namespaces do not work here: the caller
    warns ``sandbox_unavailable`` with the reason). Raises ConfigError (exit 2, one line)
    for ``SANDBOX=required`` where the sandbox cannot work, for a bad ``EXTRA_PATHS``,
    and for a ``command`` the sandbox would hide (under /tmp or the work root)."""
    var = profile.sources.get("SANDBOX", "SIDECAR_SANDBOX")
    if profile.sandbox == "off":
        return None, f"{var}=off"
    ids = run_as_ids(profile.run_as)
    bwrap = find_bwrap()
    if bwrap is None:
        reason = ("bwrap (bubblewrap) is not installed: not on PATH nor in "
                  f"{', '.join(BWRAP_PATHS)}; install Debian's bubblewrap package")
    else:
        plan = plan_sandbox(settings, profile, work_root, bwrap, ids)
        if command:
            # bwrap executes the path as given, so it and the file it links to must both
            # be visible inside (a venv's bin/python under /tmp links out of /tmp).
            given = os.path.abspath(shutil.which(command[0]) or command[0])
            for program in dict.fromkeys((given, os.path.realpath(given))):
                for hidden in (*SANDBOX_TMPFS, plan.work_root, *plan.hidden_dirs):
                    if _under(program, hidden) and not any(
                            _under(program, extra) for extra, _ in plan.extra_paths):
                        raise ConfigError(
                            f"{var}={profile.sandbox}: the command {program} is under "
                            f"{hidden}, which the sandbox hides from the tool; install it "
                            "elsewhere, bind its directory with EXTRA_PATHS, or set "
                            "SANDBOX=off")
        probe = plan
        if not os.path.isdir(plan.work_root):  # `sidecar config`: not made yet
            existing = plan.work_root
            while not os.path.isdir(existing):
                existing = os.path.dirname(existing)
            probe = dataclasses.replace(plan, work_root=existing)
        failed = probe_sandbox(probe, ids)
        if failed is None:
            return plan, ""
        reason = f"{bwrap} cannot make a sandbox here: {failed}"
        if "mount proc" in failed:
            reason += f" ({MASKED_PROC_HINT})"
    if profile.sandbox == "required":
        raise ConfigError(f"{var}=required: {reason}; or set it to auto or off")
    return None, reason


def check_work_dir(settings: Settings, profile: LeaseProfile | None = None,
                   create: bool = True) -> str:
    """Make sure attempts can get work directories under ``SIDECAR_WORK_DIR`` (default the
    system temp directory), short enough to leave a tool room for socket paths (at most
    MAX_WORK_ROOT_BYTES), and that the profile's RUN_AS user can reach them; return the
    root. With ``create`` false (``sidecar config``) nothing is left behind: the same probe
    (make and remove a directory) runs in the nearest directory that exists, so config
    refuses what run would (case F24). Raises ConfigError naming the variable."""
    root = settings.work_dir or tempfile.gettempdir()
    if len(os.fsencode(root)) > MAX_WORK_ROOT_BYTES:
        var = "SIDECAR_WORK_DIR" if settings.work_dir else "SIDECAR_WORK_DIR (unset: TMPDIR)"
        raise ConfigError(
            f"{var}={root} is {len(os.fsencode(root))} bytes long; at most "
            f"{MAX_WORK_ROOT_BYTES} leave a tool {SOCKET_NAME_BYTES} bytes for a unix socket "
            f"path under its TMPDIR and HOME (a socket path holds {SOCKET_PATH_MAX_BYTES} "
            "bytes, and Chromium aborts without room for its own); set a shorter "
            "SIDECAR_WORK_DIR, e.g. /tmp/sidecar")
    # One check for `run` and `config` (case F24): a directory is made and removed again
    # in the root, or (config: nothing may stay) in its nearest existing ancestor.
    probe_in = root
    if not create:
        while not os.path.lexists(probe_in) and os.path.dirname(probe_in) != probe_in:
            probe_in = os.path.dirname(probe_in)
    try:
        if create:
            os.makedirs(root, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix="sidecar-probe-", dir=probe_in))
    except OSError as exc:
        raise ConfigError(f"SIDECAR_WORK_DIR={root}: cannot make work directories there "
                          f"({exc.strerror or exc}); point it at a writable "
                          "directory") from None
    ids = run_as_ids(profile.run_as) if profile is not None else None
    if ids is not None:
        # Through any symlink on the way: the kernel walks the real path's ancestors.
        blocked = _unsearchable_ancestor(os.path.realpath(root), *ids)
        if blocked:
            raise ConfigError(
                f"SIDECAR_WORK_DIR={root}: the tool's user {ids[0]}:{ids[1]} (RUN_AS) cannot "
                f"enter {blocked}; point SIDECAR_WORK_DIR at a directory every user can "
                "reach (mode 0711 or wider on the way), e.g. /tmp/sidecar")
    return root


def _unsearchable_ancestor(path: str, uid: int, gid: int) -> str | None:
    """The first directory from ``/`` down to ``path`` that ``uid:gid`` (no supplementary
    groups) may not search, or None."""
    current = os.path.abspath(path)
    chain = []
    while True:
        chain.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(chain):
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            return None  # made later by the sidecar, searchable (mode 0755)
        if info.st_uid == uid:
            bit = stat.S_IXUSR
        elif info.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return directory
    return None


def _nr_open() -> int | None:
    """The kernel's cap on open files per process (fs.nr_open), or None if unknown."""
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def rlimits(profile: LeaseProfile, cgroup: JobCgroup | None) -> list[tuple[int, int, int]]:
    """The (resource, soft, hard) limits set in the child before exec, inherited by its
    tree. Memory and processes go to the cgroup when it has the controller."""
    limits: list[tuple[int, int, int]] = []
    if not profile.core_dumps:
        limits.append((resource.RLIMIT_CORE, 0, 0))
    if profile.open_files:
        limits.append((resource.RLIMIT_NOFILE, profile.open_files, profile.open_files))
    if profile.cpu_seconds:
        soft = max(1, math.ceil(profile.cpu_seconds))
        # SIGXCPU at the soft limit (a tool may catch it and exit), SIGKILL one grace later.
        limits.append((resource.RLIMIT_CPU, soft,
                       soft + max(1, math.ceil(profile.kill_grace_seconds))))
    if profile.memory_bytes and (cgroup is None or cgroup.host.memory is None):
        limits.append((resource.RLIMIT_AS, profile.memory_bytes, profile.memory_bytes))
    if profile.processes and (cgroup is None or cgroup.host.pids is None):
        limits.append((resource.RLIMIT_NPROC, profile.processes, profile.processes))
    return limits


def share_limits(profile: LeaseProfile) -> None:
    """Give the sidecar itself the limits its tools inherit when it costs the sidecar
    nothing, so a default profile needs no ``preexec_fn``: no core dumps (RLIMIT_CORE 0)
    unless CORE_DUMPS is on. The sidecar is non-dumpable (sidecar.worker.linux.make_undumpable),
    so it would write no core of its own anyway. Call it once, before the first spawn."""
    if not profile.core_dumps:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def make_preexec(parent_pid: int, procs_files: list[str], limits: list[tuple[int, int, int]],
                 ids: tuple[int, int] | None, report_fd: int):
    """A Popen ``preexec_fn``, run in the child between fork and exec: join the job's
    cgroups, set the rlimits, drop to ``ids`` (uid, gid) with no supplementary groups, then
    ask for SIGKILL when the sidecar dies (after the identity change, which clears it), and
    exit at once if the sidecar already died during the fork.

    A step that fails writes ``b"<errno> <what failed>"`` (errno 0 when the error had
    none) to ``report_fd``, the write end of a pipe the parent made for this spawn, and
    raises, so the tool never runs and Popen fails in the parent, which reads the report
    (sidecar.worker.child.read_setup_report): an EAGAIN or EMFILE while joining a cgroup is a
    shortage of the host, not an exit status of the tool (case F19). The pipe's write end
    is closed by ``close_fds`` before exec, so a clean start reports nothing."""
    sigkill = int(signal.SIGKILL)

    def _in_child() -> None:
        reset_signal_handlers()
        step = "join cgroup"
        try:
            for path in procs_files:
                step = f"join cgroup {path}"
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            for res, soft, hard in limits:
                step = f"set {_RLIMIT_NAMES.get(res, res)} to {soft}"
                resource.setrlimit(res, (soft, hard))
            if ids is not None:
                step = f"switch to uid:gid {ids[0]}:{ids[1]}"
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])
        except (OSError, ValueError, OverflowError) as exc:  # a limit above the hard one
            reason = getattr(exc, "strerror", None) or exc
            number = getattr(exc, "errno", None) or 0
            with contextlib.suppress(OSError):
                os.write(report_fd, f"{number} cannot {step}: {reason}".encode()[:512])
            raise
        _prctl(PR_SET_PDEATHSIG, sigkill)
        if os.getppid() != parent_pid:
            os._exit(125)

    return _in_child


def child_environment(base_env: dict[str, str], profile: LeaseProfile,
                      job_vars: dict[str, str]) -> dict[str, str]:
    """The child's environment: only the variables named in the profile's
    ``ENV_PASSTHROUGH`` (never a ``SIDECAR_*`` one, so never the database URL), plus the
    job's own ``SIDECAR_*`` variables (docs/child-process.md)."""
    env = {k: v for k, v in base_env.items()
           if k in profile.env_passthrough and not k.startswith("SIDECAR_")}
    env.update(job_vars)
    return env


MAX_SPARE_DIRS = 16  # per key of a SparePool
_ACL_ATTRS = frozenset(("system.posix_acl_access", "system.posix_acl_default"))
_KEPT_NAMES = frozenset((HOME_DIR_NAME, RUNTIME_DIR_NAME))


def _pristine(path: str, with_home: bool, fd: int) -> bool:
    """True when ``path`` is still the directory ``fd`` locks (not renamed away and
    replaced), ours, mode 0700 with no ACL, on the work root's filesystem (no mount on
    top), holding exactly the empty HOME and runtime directories (``with_home``) or
    nothing; never follows a symlink. Runs twice per reused directory (when it is kept
    and when it is taken): the locked directory and what is in it are read through
    ``fd`` (sidecar.worker.safefs)."""
    try:
        locked = os.fstat(fd)
        uid = os.geteuid()
        info = os.lstat(path)
        if not (os.path.samestat(info, locked) and _private_dir(info, uid, locked.st_dev)) \
                or _has_acl(fd):
            return False
        names = os.listdir(fd)
        if not with_home:
            return not names
        if len(names) != 2 or not _KEPT_NAMES.issuperset(names):
            return False
        for name in names:
            sub = safefs.open_subdir(fd, name)
            try:
                if not _private_dir(os.fstat(sub), uid, locked.st_dev) or _has_acl(sub) \
                        or os.listdir(sub):
                    return False
            finally:
                os.close(sub)
        return True
    except OSError:
        return False


def _private_dir(info: os.stat_result, uid: int, dev: int) -> bool:
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid \
        and stat.S_IMODE(info.st_mode) == 0o700 and info.st_dev == dev


def _has_acl(fd: int) -> bool:
    """True when the directory open at ``fd`` has a POSIX ACL."""
    try:
        names = os.listxattr(fd)
    except OSError:  # no xattr support: no ACL either
        return False
    return not _ACL_ATTRS.isdisjoint(names)


def _discard(path: str, fd: int) -> None:
    """Remove a kept work directory through the descriptor that locks it, then let go."""
    try:
        safefs.remove_held_path(path, fd)
    finally:
        os.close(fd)


SpareKey = tuple[str, str, bool]  # (work root, owner's directory prefix, HOME is `job`)


class SparePool:
    """Work directories an attempt returned exactly as they were made (HOME and the
    runtime directory empty, nothing else, modes unchanged) from a job cgroup that was
    removed empty (so no process of the tool is left to write into them), kept locked
    for the next attempt of the same owner: making and removing three directories costs
    six journaled metadata operations, about 0.6 ms of kernel time a job on an ext4 root
    mounted with `discard` (bench section 1). RUN_AS attempts and attempts without a
    cgroup never keep one.

    One per Worker (its owner's prefix): keyed by ``SpareKey``, at most ``limit`` a key,
    each held as ``(path, fd)`` with ``fd`` the directory's locking descriptor, which the
    pool owns while the directory is kept. Thread-safe: ``take`` and ``keep`` run on the
    event loop and in executor threads. ``close`` (at the Worker's shutdown) removes
    them all and keeps none from then on; a SIGKILLed sidecar's are unlocked then and
    swept by leftovers.
    """

    def __init__(self, limit: int = MAX_SPARE_DIRS):
        self.limit = limit
        self._dirs: dict[SpareKey, list[tuple[str, int]]] = {}
        self._closed = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(kept) for kept in self._dirs.values())

    def take(self, key: SpareKey, stale: list[tuple[str, int]] | None = None
             ) -> tuple[str, int] | None:
        """A kept directory of ``key`` that is still pristine, with its lock (the caller
        owns it from now on), or None. One found touched is removed here, or, given
        ``stale``, appended to it (path and lock) for the caller to remove (a tree of any
        size: not on the event loop) and None returned."""
        while True:
            with self._lock:
                spares = self._dirs.get(key)
                if not spares:
                    return None
                path, fd = spares.pop()
            if _pristine(path, key[2], fd):
                return path, fd
            if stale is None:
                _discard(path, fd)
            else:
                stale.append((path, fd))
                return None

    def keep(self, key: SpareKey, path: str, fd: int) -> bool:
        """Keep ``path`` (locked by ``fd``) for a later ``take`` of ``key``. True when
        kept (the pool owns ``fd`` now); False when the pool is closed or holds ``limit``
        directories of ``key`` already (the caller still owns both)."""
        with self._lock:
            if self._closed:
                return False
            spares = self._dirs.setdefault(key, [])
            if len(spares) >= self.limit:
                return False
            spares.append((path, fd))
            return True

    def close(self) -> None:
        """Remove every kept directory (through its lock) and keep none from then on;
        safe to call twice."""
        with self._lock:
            self._closed = True
            kept = [spare for spares in self._dirs.values() for spare in spares]
            self._dirs.clear()
        for path, fd in kept:
            _discard(path, fd)


@dataclass
class Sandbox:
    """One attempt's private work directory and cgroup. ``open`` makes them; ``close``
    removes both (call it only once the tree is dead). ``notes`` collects what degraded
    (a cgroup that could not be made), for the log. ``files`` (name -> text) are written
    into the work directory by ``open``, before the tool's user gets it (case F15). With
    ``guard_socket``, ``open`` (or ``open_kept``) also makes the attempt's listening Unix
    socket to the guard there, ``guard.sock`` (``guard_listener``, for
    GuardServer.register; SIDECAR_GUARD_SOCKET is ``guard_socket_path``), the tool's user's
    and mode 0600, before the hand-over too; ``close`` and ``close_kept`` remove its name.

    Every file operation inside the work directory goes through ``dir_lock``, the
    descriptor of the directory made for this attempt, one name at a time and never
    through a symlink (sidecar.worker.safefs): under ``RUN_AS`` the tool's user, and so every
    sibling attempt of it, owns the directory and may swap any name in it (or, in a work
    root it can write, the directory itself) for a link to a file only root may touch."""

    settings: Settings
    profile: LeaseProfile
    host: CgroupHost
    name: str
    dir_prefix: str = ""  # of the work directory (leftovers.work_dir_prefix); default name-
    # Where untouched work directories are kept for reuse (the Worker's); None: none is.
    spares: SparePool | None = None
    job_dir: str = ""
    cgroup: JobCgroup | None = None
    ids: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    guard_socket: bool = False
    # The attempt's listening guard socket (guard_socket): handed to the guard, which
    # closes it; ``close`` closes it too (twice is harmless) and removes its name.
    guard_listener: socket.socket | None = None
    # flock'ed descriptor of the work dir: marks it as in use, and every file operation
    # inside it goes through it (never through job_dir, a path a tool may redirect)
    dir_lock: int | None = None
    # Set by the supervisor when the tool exited by itself and left no process: only
    # then may close() keep an untouched work directory for the next attempt.
    tree_clean: bool = False
    _root: str = ""
    _stale: list[tuple[str, int]] = field(default_factory=list)
    _handed_over: bool = False  # the RUN_AS user owns the work directory now

    def open(self) -> None:
        """Make the work directory (mode 0700) and the job cgroup, write ``files`` into
        the directory, and only then hand it to the RUN_AS user (``fchown`` of HOME, the
        runtime directory and the work directory, last): no process of that user can put
        anything into it before the sidecar's own writes are done. Raises OSError when
        the work directory cannot be made or a file cannot be written, CgroupError when
        the job cgroup cannot be made although PROCESSES depends on it; a cgroup that
        cannot be made otherwise leaves the attempt to rlimits, with a note."""
        for path, fd in self._stale:  # kept directories open_kept found touched
            _discard(path, fd)
        self._stale.clear()
        self.ids = run_as_ids(self.profile.run_as)
        root = self._root = self.settings.work_dir or tempfile.gettempdir()
        spare = self.spares.take(self._spare_key) if self._reusable else None
        if spare is not None:
            self.job_dir, self.dir_lock = spare
        else:
            self._make_dir(root)
        for name, text in self.files.items():
            self.write_file(name, text)
        self._listen_guard()
        self._hand_over()
        self._make_cgroup()

    def open_kept(self) -> bool:
        """``open`` for the usual case, cheap enough for the event loop: a work directory a
        previous attempt returned untouched is taken (its reuse check is a few ``fstat``
        and ``listdir`` calls through its descriptor) and the job cgroup made (a ``mkdir``
        on cgroupfs). An executor hop costs more CPU than both (bench section 1). Returns
        False, having done nothing, when no directory is kept (or no ``spares`` pool),
        under RUN_AS (whose user lookup may block), or with ``files`` to write: call
        ``open`` in a thread then.
        Raises like ``open``."""
        if self.profile.run_as or not self.dir_prefix or self.files or self.spares is None:
            return False
        self.ids = None
        self._root = self.settings.work_dir or tempfile.gettempdir()
        spare = self.spares.take(self._spare_key, self._stale)  # removed by open, off the loop
        if spare is None:
            return False
        self.job_dir, self.dir_lock = spare
        self._listen_guard()
        self._make_cgroup()
        return True

    def attach(self) -> None:
        """For a Sandbox opened ahead of its job (sidecar.worker.prepared, never under
        RUN_AS): write ``files`` and make the guard socket now that the job is known, while
        the work directory is still the sidecar's own (case F15: through its descriptor,
        never an existing name). Cheap enough for the event loop. Raises OSError."""
        for name, text in self.files.items():
            self.write_file(name, text)
        self._listen_guard()

    def _make_dir(self, root: str) -> None:
        """The new work directory, made and filled through descriptors (sidecar.worker.safefs),
        still the sidecar's own (mode 0700) until ``_hand_over``."""
        os.makedirs(root, exist_ok=True)
        root_fd = safefs.open_dir(root)
        try:
            name, self.dir_lock = safefs.make_private_dir(root_fd,
                                                          self.dir_prefix or self.name + "-")
        finally:
            os.close(root_fd)
        self.job_dir = os.path.join(root, name)
        lock_directory(self.dir_lock)
        if self.profile.home == "job":
            for sub in (HOME_DIR_NAME, RUNTIME_DIR_NAME):
                os.mkdir(sub, 0o700, dir_fd=self.dir_lock)

    def _listen_guard(self) -> None:
        """The attempt's guard socket, while the work directory is still the sidecar's
        (or, kept for reuse, never another user's): safefs.listen_unix."""
        if self.guard_socket and self.guard_listener is None:
            self.guard_listener = safefs.listen_unix(self.dir_lock, GUARD_SOCKET_NAME,
                                                     self.ids)

    def _forget_guard(self) -> None:
        """Close the guard socket and remove its name (through the directory's descriptor;
        whatever the tool left under that name goes too), so a kept directory is as
        made."""
        if self.guard_listener is None:
            return
        self.guard_listener.close()
        self.guard_listener = None
        if self.dir_lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(GUARD_SOCKET_NAME, dir_fd=self.dir_lock)

    @property
    def guard_socket_path(self) -> str:
        """``SIDECAR_GUARD_SOCKET``: the guard socket's path (the tool's, in its work
        directory; the same path inside the sandbox)."""
        return os.path.join(self.job_dir, GUARD_SOCKET_NAME)

    def _hand_over(self) -> None:
        """Give the work directory, and HOME and the runtime directory in it, to the RUN_AS
        user: ``fchown`` through descriptors, the work directory itself last."""
        if self.ids is None or self._handed_over:
            return
        if self.profile.home == "job":
            for sub in (HOME_DIR_NAME, RUNTIME_DIR_NAME):
                fd = safefs.open_subdir(self.dir_lock, sub)
                try:
                    os.fchown(fd, *self.ids)
                finally:
                    os.close(fd)
        os.fchown(self.dir_lock, *self.ids)
        self._handed_over = True

    def _make_cgroup(self) -> None:
        if self.host.usable:
            cgroup = JobCgroup(self.host, self.name, self.profile.memory_bytes,
                               self.profile.processes)
            try:
                cgroup.create()
                self.cgroup = cgroup
            except CgroupError as exc:
                if self.profile.processes and not self.profile.run_as:
                    # Fail closed: without the pids cgroup nothing would bind PROCESSES.
                    raise CgroupError(f"{exc}; PROCESSES={self.profile.processes} cannot be "
                                      "enforced without it (no RUN_AS)", exc.errno) from None
                self.notes.append(str(exc))

    def home_variables(self) -> dict[str, str]:
        """The tool's ``HOME`` and XDG base directories by the profile's ``HOME``: ``job``
        gives each attempt its own (profiles, caches and lock files of Chromium,
        LibreOffice or fontconfig then never collide between concurrent jobs, nor need a
        writable root filesystem), ``inherit`` adds nothing (ENV_PASSTHROUGH decides), a
        path sets HOME to it."""
        home = self.profile.home
        if home == "inherit":
            return {}
        if home != "job":
            return {"HOME": home}
        home = os.path.join(self.job_dir, HOME_DIR_NAME)
        return {"HOME": home,
                "XDG_CONFIG_HOME": os.path.join(home, ".config"),
                "XDG_CACHE_HOME": os.path.join(home, ".cache"),
                "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
                "XDG_RUNTIME_DIR": os.path.join(self.job_dir, RUNTIME_DIR_NAME)}

    @property
    def result_file(self) -> str:
        """``SIDECAR_RESULT_FILE``: ``result.json`` in the work directory (the tool's
        path; the sidecar reads it with ``read_result``, through the directory's
        descriptor)."""
        return os.path.join(self.job_dir, RESULT_FILE_NAME)

    def write_file(self, name: str, text: str) -> str:
        """Create the new file ``name`` in the work directory holding ``text``, mode 0600,
        owned by the tool's user; return its path for the tool. Through the directory's
        descriptor, ``O_CREAT|O_EXCL|O_NOFOLLOW`` and ``fchown`` (sidecar.worker.safefs): never
        an existing name, never through a link. Raises OSError, and RuntimeError once the
        directory belongs to the RUN_AS user (pass the file in ``files`` to ``open``):
        what that user can write, the sidecar does not write into (case F15)."""
        if self._handed_over:
            raise RuntimeError(f"{name}: the work directory already belongs to the tool's "
                               "user; files are written before it is handed over")
        safefs.create_file(self.dir_lock, name, text.encode("utf-8"), self.ids)
        return os.path.join(self.job_dir, name)

    def has_result(self) -> bool:
        """True when the tool left anything named ``result.json`` in its work directory
        (one ``fstatat`` through the directory's descriptor, no link followed)."""
        return self.dir_lock is not None \
            and safefs.lstat_at(self.dir_lock, RESULT_FILE_NAME) is not None

    def read_result(self, max_bytes: int, limit_var: str = "SIDECAR_MAX_RESULT_BYTES"
                    ) -> bytearray:
        """``read_result_file`` of ``result.json`` through the work directory's
        descriptor, checked to belong to the tool's user under RUN_AS. Raises like it."""
        if self.dir_lock is None:
            raise FileNotFoundError(RESULT_FILE_NAME)
        return read_result_file(RESULT_FILE_NAME, max_bytes, self.ids[0] if self.ids else None,
                                limit_var, dir_fd=self.dir_lock)

    @property
    def needs_preexec(self) -> bool:
        """True when the child must set itself up between fork and exec: a RUN_AS
        identity, a cgroup that enforces a limit, or an rlimit the sidecar does not
        already have itself (``share_limits``). Otherwise it is started by vfork with no
        ``preexec_fn`` and the parent moves it into its cgroup (sidecar.worker.child)."""
        if self.ids is not None or (self.cgroup is not None and self.cgroup.enforces_limits):
            return True
        return any(resource.getrlimit(res) != (soft, hard)
                   for res, soft, hard in rlimits(self.profile, self.cgroup))

    def preexec(self, parent_pid: int, report_fd: int):
        """The child's ``preexec_fn`` for this sandbox (see ``make_preexec``)."""
        files = self.cgroup.procs_files if self.cgroup else []
        return make_preexec(parent_pid, files, rlimits(self.profile, self.cgroup), self.ids,
                            report_fd)

    @property
    def _reusable(self) -> bool:
        # Only directories named by owner (leftovers.work_dir_prefix), never a RUN_AS one,
        # and only with a pool to keep them in.
        return self.ids is None and bool(self.dir_prefix) and self.spares is not None

    @property
    def _spare_key(self) -> SpareKey:
        return self._root, self.dir_prefix, self.profile.home == "job"

    def _remove_untouched(self) -> bool:
        """The common case in a few syscalls: the tool left the work directory as it was
        made (HOME and the runtime directory empty, nothing else). rmdir through the
        directory's descriptor never follows a symlink and fails on anything not empty,
        and the work directory's own name goes only while it still is that directory; so
        False (then ``safefs.remove_held``) whenever the tool left anything, replaced a
        directory or changed a mode."""
        try:
            if self.profile.home == "job":
                for name in (HOME_DIR_NAME, RUNTIME_DIR_NAME):
                    os.rmdir(name, dir_fd=self.dir_lock)
            root_fd = safefs.open_dir(self._root)
            try:
                info = safefs.lstat_at(root_fd, os.path.basename(self.job_dir))
                if info is None or not os.path.samestat(info, os.fstat(self.dir_lock)):
                    return False
                os.rmdir(os.path.basename(self.job_dir), dir_fd=root_fd)
            finally:
                os.close(root_fd)
        except OSError:
            return False
        return True

    def close_kept(self) -> bool:
        """``close`` for the usual case, cheap enough for the event loop: the tree is dead
        and left the work directory untouched, so the cgroup is removed (one ``rmdir``
        each, no waiting) and the directory kept for the next attempt. Returns False when
        that does not apply (a busy cgroup, a touched directory, a full pool): call
        ``close`` in a thread then, which finishes the job (removing a cgroup twice is
        harmless)."""
        if not (self.job_dir and self.dir_lock is not None and self.tree_clean
                and self._reusable and self.cgroup is not None):
            return False
        self._forget_guard()
        if self.cgroup.remove(timeout=0) \
                or not _pristine(self.job_dir, self.profile.home == "job", self.dir_lock) \
                or not self.spares.keep(self._spare_key, self.job_dir, self.dir_lock):
            return False
        self.dir_lock = None  # the spare pool holds the lock now
        return True

    def close(self) -> list[str]:
        """Remove the cgroup and the work directory, whatever the tool left in it.
        Returns what could not be removed."""
        left: list[str] = []
        self._forget_guard()
        if self.cgroup is not None:
            left += self.cgroup.remove()
        # Kept only when the cgroup was removed, which the kernel allows only once it is
        # empty: no process of this tool (however it hid) can write into the directory.
        if self.job_dir and self.dir_lock is not None and self.tree_clean \
                and self._reusable and self.cgroup is not None and left == [] \
                and _pristine(self.job_dir, self.profile.home == "job", self.dir_lock) \
                and self.spares.keep(self._spare_key, self.job_dir, self.dir_lock):
            self.dir_lock = None  # the spare pool holds the lock now
            return left
        if self.job_dir and self.dir_lock is not None:
            if not self._remove_untouched():
                safefs.remove_held_path(self.job_dir, self.dir_lock)
            if os.path.lexists(self.job_dir):
                left.append(self.job_dir)
        if self.dir_lock is not None:
            os.close(self.dir_lock)
            self.dir_lock = None
        return left


def read_result_file(path: str, max_bytes: int, owner_uid: int | None,
                     limit_var: str = "SIDECAR_MAX_RESULT_BYTES",
                     dir_fd: int | None = None) -> bytearray:
    """The result a tool left in ``SIDECAR_RESULT_FILE``: read once into one buffer of the
    file's exact size (never a growing buffer, never a memory mapping: a file truncated
    under a mapping would kill the sidecar with SIGBUS).

    ``path`` is relative to ``dir_fd`` when given (Sandbox.read_result passes one name and
    the work directory's descriptor, so no component of it can be a tool's link).
    Raises FileNotFoundError when there is no file (stdout is the result), BadResult for a
    symlink, a hard link, anything but a regular file, a file of another user than
    ``owner_uid`` (RUN_AS), or one that changed size while it was read; BadResult of kind
    ``result_too_large`` for one larger than ``max_bytes`` bytes (``limit_var`` names the
    setting in the message)."""
    try:
        # O_NOFOLLOW: the tool could point a symlink at a file only the sidecar can read;
        # O_NONBLOCK: a FIFO in its place must not block the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise BadResult(f"SIDECAR_RESULT_FILE cannot be read: {exc.strerror or exc}; "
                        "write a regular file there") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadResult("SIDECAR_RESULT_FILE is not a regular file")
        if info.st_nlink != 1:
            raise BadResult("SIDECAR_RESULT_FILE is a hard link to another file; write "
                            "the result into a new file")
        if owner_uid is not None and info.st_uid != owner_uid:
            raise BadResult(f"SIDECAR_RESULT_FILE belongs to uid {info.st_uid}, not to the "
                            f"tool's uid {owner_uid}")
        if info.st_size > max_bytes:
            raise BadResult(f"SIDECAR_RESULT_FILE holds {info.st_size} bytes, more than "
                            f"{max_bytes}; return less, or raise {limit_var}",
                            FailureKind.RESULT_TOO_LARGE)
        os.set_blocking(fd, True)
        data = bytearray(info.st_size)
        view, got = memoryview(data), 0
        with view:
            while got < info.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
        if got != info.st_size or os.read(fd, 1):
            raise BadResult("SIDECAR_RESULT_FILE changed while it was read: a process of "
                            "the tool's user still writes to it")
        return data
    finally:
        os.close(fd)
