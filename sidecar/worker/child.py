"""The tool as a child process: spawn, feed stdin, drain stdout/stderr, kill the tree, reap.

Contract (docs/child-process.md): payload JSON on stdin, then EOF; result JSON on
stdout (capped at ``max_stdout`` bytes, the excess read and dropped, never held);
stderr streamed line by line, its last 4 KiB kept. The child starts in a new session and
its exit is observed through a pidfd, so the job ends when the child exits even if a
grandchild still holds the pipes (case F6).

Two ways to start it. Where the child needs nothing set between fork and exec (no RUN_AS,
no rlimit the sidecar does not already have, no cgroup limit) there is no ``preexec_fn``,
so CPython uses vfork: no copy of the sidecar's page tables and no copy-on-write faults
after it, which cost a fork+preexec spawn several milliseconds of the sidecar's CPU. The
job cgroup, if any, is then joined from the parent right after exec, with every process
the tool forked before that. Otherwise the ``preexec_fn`` (sidecar.worker.isolation) joins the
cgroup, sets the limits and the identity and the parent-death signal in the child. In
both cases a SIGKILLed sidecar's tools are killed by its guardian (sidecar.worker.guardian).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from sidecar.protocol.errors import SidecarError, one_line
from sidecar.protocol.shortage import shortage_errno
from sidecar.worker import linux
from sidecar.worker.cgroups import JobCgroup

STDERR_TAIL_BYTES = 4096
# Kept beyond the tail, so that a secret that straddles the tail's start is scrubbed whole
# before the tail is cut (sidecar.protocol.results.stderr_tail_text): longer than any DSN.
STDERR_TAIL_MARGIN = 4096
_STDERR_KEPT = STDERR_TAIL_BYTES + STDERR_TAIL_MARGIN
STDERR_LINE_BYTES = 4096
_READ_CHUNK = 65536
_READS_PER_WAKEUP = 4  # bounds the time one flooding pipe holds the event loop
# A sandboxed tool exited: how long its namespace's init may take to exit after bwrap did
# (seconds) before what is left counts as orphaned descendants to kill.
SANDBOX_SETTLE_SECONDS = 1.0

class ProcessTable:
    """The children of this process that the sidecar starts and reaps itself, and what a
    tree scan and the adopted-orphan reaper must know about them (cases F7, F9). One per
    process: ``sidecar run``'s bootstrap makes it and hands it to its Worker; a Worker or
    a spawn given none makes one of its own (then nothing else in the process shares it).

    ``subreaper``: this process is a child subreaper (``sidecar run``): every descendant
    of a tool then stays either a descendant of the tool or becomes our own (adopted)
    child, so a tree scan need not read the environment of every process on the host.

    Invariants (tests/test_process_table.py):

    - a pid is *managed* from before its fork returns (under ``reap_lock``) until its
      exit status is collected; ``reap_adopted`` never takes a managed or exempt pid's
      status, and waits for ``reap_lock``, so it never takes a tool's that exited right
      after exec, before its pid was recorded (F9);
    - every ``spawn_begun`` bumps the spawn generation and is matched by exactly one
      ``spawn_done`` once the pid is recorded or the spawn failed (``spawn_quiet``);
    - ``live_attempts`` counts attempts whose tree is not yet dead; with exactly one, an
      adopted orphan with no ``SIDECAR_JOB_ID`` started after it can only be that
      attempt's (``alone``).

    The spawn threads (``spawn_thread``) are the process's too: the parent-death signal
    is tied by Linux to the forking *thread*.
    """

    def __init__(self, subreaper: bool = False):
        self.subreaper = subreaper
        # Pids whose exit status the sidecar collects itself; the adopted-orphan reaper
        # skips them.
        self._managed: set[int] = set()
        # Children of the sidecar that are no tool's (the guardian): never part of a
        # job's tree.
        self._exempt: set[int] = set()
        # Attempts whose tree is not yet dead (counted on the event loop thread).
        self._live_attempts = 0
        # A child between fork and exec is not yet managed and still carries the
        # sidecar's own environment: a scan must not take it for an env-less escapee.
        # Spawns bump the generation before they fork and count themselves in flight
        # until the pid is recorded; a scan claims unmarked processes only if neither
        # moved while it listed them.
        self._spawn_generation = 0
        self._spawns_in_flight = 0
        self._spawn_count_lock = threading.Lock()  # the loop counts up, the spawn thread down
        # Held from before a tool's fork until its pid is managed, and by the adopted-
        # orphan reaper while it lists and reaps: a tool that exits right after exec is
        # otherwise a zombie child that no set names yet, and the reaper would take its
        # exit status (case F9).
        self.reap_lock = threading.Lock()
        self._spawner: concurrent.futures.ThreadPoolExecutor | None = None
        self._spawner_privileged: concurrent.futures.ThreadPoolExecutor | None = None
        self._spawner_lock = threading.Lock()

    # --- pids ---------------------------------------------------------------

    def manage(self, pid: int) -> None:
        """Record ``pid`` as a child whose exit status the sidecar collects itself. Call
        it holding ``reap_lock``, before the lock is released after the fork."""
        self._managed.add(pid)

    def unmanage(self, pid: int) -> None:
        """``pid``'s exit status was collected (or it never ran): no longer managed."""
        self._managed.discard(pid)

    def exempt(self, pid: int) -> None:
        """Record ``pid`` as a child that belongs to no job's tree (the guardian)."""
        self._exempt.add(pid)

    def is_own(self, pid: int) -> bool:
        """True when ``pid`` is a managed tool or an exempt child: never an adopted
        orphan, never reaped by ``reap_adopted``."""
        return pid in self._managed or pid in self._exempt

    # --- spawns -------------------------------------------------------------

    def spawn_begun(self) -> None:
        """A spawn is about to fork (on the event loop): bump the generation and count it
        in flight until ``spawn_done``."""
        with self._spawn_count_lock:
            self._spawn_generation += 1
            self._spawns_in_flight += 1

    def spawn_done(self) -> None:
        """The spawn's pid is managed, or the spawn failed (any thread)."""
        with self._spawn_count_lock:
            self._spawns_in_flight -= 1

    def spawn_mark(self) -> tuple[int, bool]:
        """``(generation, quiet)`` before a scan: quiet when no spawn is in flight."""
        return self._spawn_generation, self._spawns_in_flight == 0

    def spawn_moved(self, generation: int) -> bool:
        """True when a spawn began since ``spawn_mark`` gave ``generation``, or one is in
        flight now: a process a scan found unmarked may be that spawn's child."""
        return self._spawn_generation != generation or self._spawns_in_flight != 0

    # --- attempts -----------------------------------------------------------

    def attempt_started(self) -> None:
        """A Child was made: its tree is alive (event loop thread)."""
        self._live_attempts += 1

    def attempt_ended(self) -> None:
        """A Child's tree is dead (event loop thread; once per ``attempt_started``)."""
        self._live_attempts -= 1

    @property
    def live_attempts(self) -> int:
        """Attempts whose tree is not yet dead."""
        return self._live_attempts

    def alone(self) -> bool:
        """True while exactly one attempt's tree is alive, and this process is not PID 1
        (as PID 1 every orphan of the container is ours to adopt: only marked processes
        are claimed then)."""
        return self._live_attempts == 1 and os.getpid() != 1

    # --- reaping ------------------------------------------------------------

    def reap_adopted(self) -> int:
        """Reap zombie children this process adopted as a subreaper and does not manage
        itself (never ``waitpid(-1)``: that would steal statuses asyncio or Popen wait
        for). Blocks while a tool is being spawned (``reap_lock``), so it never takes the
        exit status of a child the sidecar started, whatever the timing (case F9).
        Returns how many were reaped. Call it off the event loop."""
        reaped = 0
        with self.reap_lock:
            for pid in _children(os.getpid()):
                if self.is_own(pid) or not _zombie(pid):
                    continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                    reaped += 1
                except ChildProcessError:
                    continue
        return reaped

    def reap_listed(self, pids: list[int]) -> list[int]:
        """Of ``pids``, children of this process a tree scan just listed, reap the
        adopted ones that have exited (``waitpid(WNOHANG)``, as ``reap_adopted`` would a
        second later) and return the rest, in order: those still running, and every
        managed or exempt pid untouched. An exited orphan is no member of any tree (it
        can neither fork nor be signalled, and its children were re-parented when it
        died), yet each scan would read it from /proc until the periodic reaper came: a
        sandboxed tool leaves one (bwrap's namespace init) per attempt, so at a hundred
        attempts a second every job end read dozens of them. Never blocks, so it may run
        on the event loop: while a spawn holds ``reap_lock`` (case F9) nothing is reaped
        and ``pids`` comes back whole."""
        if not pids or not self.reap_lock.acquire(blocking=False):
            return pids
        try:
            left = []
            for pid in pids:
                if self.is_own(pid):
                    left.append(pid)
                    continue
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        left.append(pid)  # still running
                except ChildProcessError:
                    continue  # not our child (any more): nothing of a tree
            return left
        finally:
            self.reap_lock.release()

    # --- spawn threads ------------------------------------------------------

    def spawn_thread(self, new_privileges: bool) -> concurrent.futures.ThreadPoolExecutor:
        """The long-lived thread tools are spawned on, made at its first use: the fork
        stays off the event loop thread, and the parent-death signal (tied by Linux to
        the forking *thread*) fires only when the sidecar process itself ends. That
        thread has ``no_new_privs`` (case F23): a thread attribute every process it forks
        inherits, through vfork too, so no tool and nothing a tool starts can gain
        privileges by exec (a setuid-root helper stays the tool's user and within reach
        of the tree kill). ``new_privileges`` (a profile's ALLOW_NEW_PRIVS) gives a
        second thread without it."""
        with self._spawner_lock:
            if new_privileges:
                if self._spawner_privileged is None:
                    self._spawner_privileged = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="spawn-privileged")
                return self._spawner_privileged
            if self._spawner is None:
                self._spawner = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="spawn",
                    initializer=linux.forbid_new_privileges)
            return self._spawner


class SpawnFailed(SidecarError):
    """The command could not be started. ``exit_code`` follows tini: 127 not found,
    126 not executable or not a valid program."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class SpawnSetupFailed(SidecarError):
    """The sidecar could not put the child into its sandbox (its job cgroup, rlimits, the
    RUN_AS identity) for a reason other than a shortage of the host. The tool never ran;
    not an error of the program: the attempt fails as ``sandbox_failed`` (retryable)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SpawnShortage(SidecarError):
    """The tool could not be started because the host ran short of something (case F19):
    processes or threads (EAGAIN), memory (ENOMEM), descriptors for its pipes (EMFILE,
    ENFILE). ``errno_name`` says which (sidecar.protocol.shortage). Not the tool's fault: the
    attempt is released, not failed."""

    def __init__(self, message: str, errno_name: str):
        super().__init__(message)
        self.errno_name = errno_name


@dataclass
class KillReport:
    """What a tree kill did: ``signal`` is the strongest signal sent (None when nothing was
    left to kill), ``killed`` the pids signalled, ``survivors`` pids of the tree still
    alive at the end, ``unsignalled`` pids a signal was refused for (EPERM: a process that
    gained another user's identity, case F23); they stay survivors while they live."""

    signal: int | None = None
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    unsignalled: list[int] = field(default_factory=list)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(pid: int) -> list[int]:
    """Children of ``pid``: read from its own /proc entries (O(its children)), else by
    psutil's scan of every process on the host."""
    if linux.HAVE_PROC_CHILDREN:
        return linux.child_pids(pid)
    try:
        return [proc.pid for proc in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (see _children for the cost)."""
    if linux.HAVE_PROC_CHILDREN:
        return linux.descendant_pids(pid)
    try:
        return [proc.pid for proc in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _processes(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out


def tree_processes(root_pid: int) -> list[psutil.Process]:
    """``root_pid`` and its descendants as psutil processes (those still there), read
    from the root down."""
    return _processes([root_pid, *_descendants(root_pid)])


def find_tree(root_pid: int, cookie: dict[str, str],
              claim_unmarked: float | None = None,
              claim_uid: int | None = None,
              root_reaped: bool = False,
              processes: ProcessTable | None = None) -> list[psutil.Process]:
    """Every live process of a job's tree: descendants of ``root_pid``, members of its
    session (the child is a session leader, so sid == root_pid), and any process whose
    environment carries all of ``cookie`` (re-parented or ``setsid`` escapees, case F7).

    As a child subreaper (``processes.subreaper``), escapees can only be our own adopted
    children that ``processes`` does not own (and their
    descendants), so only those are checked for the cookie. ``claim_unmarked`` (a
    ``time.time()``, given only while this is the only attempt running) also claims an
    adopted child with no ``SIDECAR_JOB_ID`` at all that was started after it (and, with
    ``claim_uid``, runs as that uid): it cleared its environment to hide. The tree is read
    from the root and from our own children down, so its cost follows the tree, not the
    host. Without a subreaper every process on the host is checked for the cookie.

    ``root_reaped``: the root's exit status was collected, so ``root_pid`` may already
    belong to an unrelated process; the tree is then not read from it (the root's orphans
    are our adopted children, or, without a subreaper, found by session and cookie).
    ``processes``: the process table (None: not a subreaper, no child of our own).
    Raises ValueError for an empty cookie."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    if not cookie or not all(cookie.values()):
        # An empty cookie would match every process on the host: never scan with one.
        raise ValueError("find_tree needs a cookie of non-empty values")
    if not root_reaped:
        for proc in tree_processes(root_pid):
            found[proc.pid] = proc
    if processes is not None and processes.subreaper:
        # Orphans are the children of our thread group leader (linux.adopted_pids); the
        # tools, children of the spawn thread, are each their own Child's root.
        listed = linux.adopted_pids(me) if linux.HAVE_PROC_CHILDREN else _children(me)
        # Exited orphans are reaped here rather than read (ProcessTable.reap_listed).
        adopted = _processes(processes.reap_listed(
            [pid for pid in listed if not processes.is_own(pid) and pid not in found]))
        for proc in adopted:
            try:
                try:
                    env = proc.environ()
                except psutil.AccessDenied:
                    # A process the sidecar may not read (a setuid exec, or one that made
                    # itself non-dumpable) shows no mark: it counts as unmarked (F23).
                    env = {}
                if all(env.get(k) == v for k, v in cookie.items()) or (
                        claim_unmarked is not None and "SIDECAR_JOB_ID" not in env
                        and proc.create_time() >= claim_unmarked
                        and (claim_uid is None or proc.uids().real == claim_uid)):
                    for member in tree_processes(proc.pid):
                        found[member.pid] = member
            except (psutil.Error, OSError):
                continue
        return [proc for proc in found.values() if proc.pid != me and _alive(proc)]
    for proc in psutil.process_iter():
        if proc.pid in found or proc.pid == me:
            continue
        try:
            if os.getsid(proc.pid) == root_pid:
                found[proc.pid] = proc
                continue
            env = proc.environ()
            if all(env.get(k) == v for k, v in cookie.items()):
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return [proc for proc in found.values() if proc.pid != me and _alive(proc)]


def _remember(members: dict[psutil.Process, None], found: list[psutil.Process]
              ) -> list[psutil.Process]:
    """Add ``found`` to the tree's ``members`` and return every member still alive. A
    psutil.Process is equal to and hashes as (pid, start time): a reused pid is another
    member, and a dead member is never taken for the process that now has its pid."""
    members.update(dict.fromkeys(found))
    return [proc for proc in members if _alive(proc)]


def _zombie(pid: int) -> bool:
    if linux.HAVE_PROC_CHILDREN:
        return linux.is_zombie(pid)
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class CgroupJoinFailed(SidecarError, OSError):
    """The parent could not move a freshly started tool into its job cgroup.

    Also an OSError with the failed write's ``errno``, ``strerror`` and ``filename``
    (its ``str`` and ``message`` are OSError's: ``[Errno 16] ...: 'cgroup.procs'``), so
    ``except OSError`` and the shortage check (sidecar.protocol.shortage) see it as before."""

    def __init__(self, errno: int | None, strerror: str | None, filename: str | None = None):
        OSError.__init__(self, errno, strerror, filename)
        self.message = one_line(str(self))


class PreexecFailed(OSError):
    """The child could not set itself up between fork and exec (sidecar.worker.isolation.
    make_preexec: cgroup join, rlimits, identity); ``errno`` is the failed call's (0 when
    it had none) and ``strerror`` says which step. The tool never ran."""


def read_setup_report(report_r: int) -> PreexecFailed | None:
    """What the child's ``preexec_fn`` reported on its report pipe (read end ``report_r``,
    whose write ends are all closed by now): None when it reported nothing, else the
    failure (``b"<errno> <what failed>"``, at most 512 bytes)."""
    try:
        data = os.read(report_r, 512)
    except OSError:
        return None
    number, _, what = data.decode(errors="replace").partition(" ")
    if not data or not number.isdigit():
        return None
    return PreexecFailed(int(number), what or "cannot set up the child")


def _spawn_blocking(argv: list[str], env: dict[str, str], parent_pid: int, cwd: str | None,
                    make_preexec: Callable[[int, int], Callable[[], None]] | None,
                    join: JobCgroup | None,
                    wrap: Callable[[list[str], int], list[str]] | None,
                    processes: ProcessTable):
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # The sandbox's status pipe: bwrap writes its JSON status to the write end, which only
    # bwrap itself inherits (it is not passed on to the tool).
    status_r, status_w = os.pipe() if wrap else (-1, -1)
    if wrap:
        os.set_inheritable(status_w, True)
        argv = wrap(argv, status_w)
    # The preexec_fn's report of a failed step (errno and step), so a shortage met between
    # fork and exec is told from a tool's exit status (case F19).
    report_r, report_w = os.pipe() if make_preexec else (-1, -1)
    try:
        with processes.reap_lock:
            # No preexec_fn: vfork. restore_signals puts SIGPIPE and SIGXFSZ (which Python
            # ignores for itself) back to SIG_DFL; CPython resets every handled signal in
            # the child and gives it the spawning thread's (empty) mask (case F10).
            try:
                popen = subprocess.Popen(
                    argv, stdin=in_r, stdout=out_w, stderr=err_w, env=env, close_fds=True,
                    cwd=cwd, start_new_session=True, restore_signals=True,
                    preexec_fn=make_preexec(parent_pid, report_w) if make_preexec else None,
                    pass_fds=(status_w,) if wrap else (),
                )
            except subprocess.SubprocessError:
                # Popen has reaped the child; its preexec_fn said why, if it could.
                if report_w >= 0:
                    os.close(report_w)
                    report_w = -1
                    reported = read_setup_report(report_r)
                    if reported is not None:
                        raise reported from None
                raise
            processes.manage(popen.pid)
    except BaseException:
        for fd in (in_w, out_r, err_r, status_r):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w, report_r, report_w, status_w):
            if fd >= 0:
                os.close(fd)
    if join is not None:
        try:
            join.join_tree(popen.pid, linux.descendant_pids if linux.HAVE_PROC_CHILDREN
                           else _descendants)
        except OSError as exc:
            # No tool runs outside its cgroup: kill its process group (the new session,
            # everything it forked in these microseconds but a setsid escapee), reap it,
            # and report the spawn as failed.
            with contextlib.suppress(OSError):
                os.killpg(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(5)
            processes.unmanage(popen.pid)
            for fd in (in_w, out_r, err_r, status_r):
                if fd >= 0:
                    os.close(fd)
            raise CgroupJoinFailed(exc.errno, exc.strerror, exc.filename) from None
    return popen, in_w, out_r, err_r, status_r


def _spawn_failure(program: str, exc: OSError) -> SpawnFailed | SpawnSetupFailed:
    """What a spawn error that is no shortage means. The sidecar's own setup of the child
    (its job cgroup, rlimits, identity) failing is ``SpawnSetupFailed``: not the program's
    fault. Otherwise the permanent failure for an error of the program itself (exit codes
    as tini): 127 not found (a missing program or interpreter), 126 not executable
    (EACCES, ENOEXEC)."""
    if isinstance(exc, CgroupJoinFailed):
        return SpawnSetupFailed(f"cannot move {program} into its job cgroup: "
                                f"{exc.filename or ''} {exc.strerror or exc}".rstrip())
    if isinstance(exc, PreexecFailed):
        return SpawnSetupFailed(f"cannot start {program}: {exc.strerror}")
    if isinstance(exc, FileNotFoundError):
        return SpawnFailed(f"command not found: {program}", 127)
    if isinstance(exc, PermissionError):
        return SpawnFailed(f"command not executable (permission denied): {program}", 126)
    return SpawnFailed(f"cannot execute {program}: {exc.strerror or exc}", 126)


def _spawn_counted(processes: ProcessTable, *args):
    """_spawn_blocking(*args, processes), counted out of the spawns in flight
    (``ProcessTable.spawn_done``) once its pid is recorded (or the spawn failed), on the
    spawn thread itself."""
    try:
        return _spawn_blocking(*args, processes)
    finally:
        processes.spawn_done()


class LineBroken(Exception):
    """A process in line mode cannot take a request (``Child.request``): start another."""


@dataclass
class Launched:
    """A started process and the parent's ends of its pipes (``Child.launch``), not yet
    watched: ``Child.start`` makes the Child, or ``discard`` kills and reaps it.
    ``status_fd`` is bwrap's status pipe (-1 unsandboxed); ``cgroup_from_exec``: it
    joined ``cgroup`` before exec."""

    popen: subprocess.Popen
    stdin_fd: int
    stdout_fd: int
    stderr_fd: int
    status_fd: int
    processes: ProcessTable
    cgroup: JobCgroup | None
    cgroup_from_exec: bool

    def alive(self) -> bool:
        """True while the process runs (a ``waitid`` that does not reap it)."""
        try:
            return os.waitid(os.P_PID, self.popen.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def discard(self) -> None:
        """SIGKILL its process group (its own session: everything it started, a
        sandbox's namespace with it), reap it, close the pipes. Blocks up to 5 s: call it
        off the event loop."""
        with contextlib.suppress(OSError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            self.popen.wait(5)
        self.processes.unmanage(self.popen.pid)
        for fd in (self.stdin_fd, self.stdout_fd, self.stderr_fd, self.status_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


class Child:
    """One running tool process and its pipes. Create with ``await Child.spawn(...)``.

    ``exited`` resolves once the process itself has exited and been reaped;
    ``returncode`` is then set (negative = killed by that signal), or stays None with
    ``status_lost`` True when the exit status could not be collected (case F9: someone
    else reaped it): an unknown status is never taken for exit 0.

    Sandboxed (``status_fd``, the read end of bwrap's JSON status pipe): ``pid`` is
    bwrap's, and ``returncode`` the tool's as bwrap reports it (sidecar.worker.isolation.
    decode_sandbox_status); ``sandbox_failed`` is True when bwrap exited without ever
    starting the tool (its stderr says why).
    """

    def __init__(self, popen: subprocess.Popen, stdin_fd: int, stdout_fd: int, stderr_fd: int,
                 payload: bytes, max_stdout: int, on_stderr_line: Callable[[bytes], None],
                 cookie: dict[str, str], cgroup: JobCgroup | None = None,
                 processes: ProcessTable | None = None, status_fd: int = -1,
                 lines: bool = False):
        self.loop = asyncio.get_running_loop()
        self.status_fd = status_fd
        self.sandboxed = status_fd >= 0
        self.sandbox_failed = False
        # The host pid of bwrap's namespace init (PID 1 of the sandbox), from bwrap's
        # status (``child-pid``): the tree is dead once it is (Child._tree_gone_by_guarantee).
        self.sandbox_init_pid: int | None = None
        self.processes = processes if processes is not None else ProcessTable()
        self.cgroup = cgroup
        # The tool joined ``cgroup`` itself before exec (a preexec_fn), so everything it
        # ever forked was born inside: set by ``spawn``.
        self.cgroup_from_exec = False
        # The child's own resource use (wait4), its reaped descendants included.
        self.rusage: resource.struct_rusage | None = None
        self.popen = popen
        self.pid = popen.pid
        self.cookie = cookie
        self.max_stdout = max_stdout
        self.stdout = bytearray()
        self.stdout_bytes = 0
        self.stdout_overflow = False
        self.stderr_tail = b""  # the last _STDERR_KEPT bytes, unscrubbed: never shown as is
        self.stderr_bytes = 0
        self._stderr_partial = b""
        self._on_stderr_line = on_stderr_line
        self.returncode: int | None = None
        self.status_lost = False
        self.started = time.monotonic()
        self.started_at = time.time() - 1.0  # process start times are rounded (clock ticks)
        self.run_as_uid: int | None = None  # set by the supervisor when RUN_AS applies
        self.exited: asyncio.Future[int] = self.loop.create_future()
        # Resolves when stdout passes max_stdout: the result is lost, so is the attempt.
        self.overflowed: asyncio.Future[None] = self.loop.create_future()
        self._eof = {stdout_fd: self.loop.create_future(), stderr_fd: self.loop.create_future()}
        self._open_fds = {stdout_fd, stderr_fd}
        for fd in (stdin_fd, stdout_fd, stderr_fd):
            os.set_blocking(fd, False)
        self.loop.add_reader(stdout_fd, self._on_readable, stdout_fd, self._take_stdout)
        self.loop.add_reader(stderr_fd, self._on_readable, stderr_fd, self._take_stderr)
        # Line mode (a warm process, sidecar.worker.warm): stdin stays open for one request
        # line per job (``request``), and each job's answer is the next stdout line.
        self.line_mode = lines
        self._stdin_fd = stdin_fd if lines else -1
        self._line: asyncio.Future[bytes] | None = None
        if lines:
            self._stdin_task = None
        else:
            rest = self._write_at_once(stdin_fd, payload)
            # A payload the pipe took whole (most: it holds 64 KiB) needs no task to feed it.
            self._stdin_task = None if rest is None \
                else asyncio.ensure_future(self._feed_stdin(stdin_fd, rest))
        self._watch_exit()
        self.processes.attempt_started()
        self._counted = True

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str], payload: bytes, max_stdout: int,
                    on_stderr_line: Callable[[bytes], None], cookie: dict[str, str],
                    cwd: str | None = None,
                    make_preexec: Callable[[int, int], Callable[[], None]] | None = None,
                    cgroup: JobCgroup | None = None, new_privileges: bool = False,
                    processes: ProcessTable | None = None,
                    wrap: Callable[[list[str], int], list[str]] | None = None) -> Child:
        """Start ``argv`` in a new session with ``env`` in ``cwd``; write ``payload`` to its
        stdin. No file descriptor but stdin, stdout and stderr is inherited. The tool gets
        ``no_new_privs`` (case F23) unless ``new_privileges`` (a profile's
        ALLOW_NEW_PRIVS).

        ``max_stdout`` caps the bytes of stdout kept (bytes). ``cookie`` is a subset of
        ``env`` that marks the job's processes for the tree kill. ``cgroup`` is the job
        cgroup (its members are part of the tree). ``make_preexec(parent_pid, report_fd)``
        gives the ``preexec_fn`` (limits, cgroup join, identity; sidecar.worker.isolation), which
        joins ``cgroup`` in the child and reports a failed step on the pipe ``report_fd``;
        without one the child is started by vfork and the parent moves it (and anything it
        forked meanwhile) into ``cgroup``.
        Raises SpawnFailed when the program is missing or not executable (127, 126);
        SpawnSetupFailed when the child could not be moved into its cgroup or set up by its
        ``preexec_fn``; SpawnShortage when the host ran short of processes, memory or
        descriptors meanwhile, in the parent or in the child before exec (case F19:
        sidecar.protocol.shortage).
        ``processes`` is the process table of the sidecar (sidecar run: the one of the
        process); None gives the child a table of its own.
        ``wrap(argv, status_fd)`` gives the command line that runs ``argv`` in the
        attempt's sandbox (sidecar.worker.isolation.SandboxPlan.argv), ``status_fd`` the
        descriptor bwrap reports its status on; None runs ``argv`` as is.
        """
        if processes is None:
            processes = ProcessTable()
        launched = await cls.launch(argv, env, cwd=cwd, make_preexec=make_preexec,
                                    cgroup=cgroup, new_privileges=new_privileges,
                                    processes=processes, wrap=wrap)
        return cls.start(launched, payload, max_stdout, on_stderr_line, cookie)

    @classmethod
    async def launch(cls, argv: list[str], env: dict[str, str], cwd: str | None = None,
                     make_preexec: Callable[[int, int], Callable[[], None]] | None = None,
                     cgroup: JobCgroup | None = None, new_privileges: bool = False,
                     processes: ProcessTable | None = None,
                     wrap: Callable[[list[str], int], list[str]] | None = None,
                     joins_itself: bool = False) -> Launched:
        """``spawn``'s first half: the process, started and managed, with its pipes, but
        nothing written to its stdin and nothing watched yet (``start`` does both). A
        prepared launcher (sidecar.worker.prepared) is launched ahead of its job this way.
        ``joins_itself``: the command joins ``cgroup`` itself before it execs anything
        (the launcher's first step), so the parent does not move it. Raises like
        ``spawn``."""
        loop = asyncio.get_running_loop()
        if processes is None:
            processes = ProcessTable()
        processes.spawn_begun()  # counted down by _spawn_counted once the pid is recorded
        try:
            popen, in_w, out_r, err_r, status_r = await loop.run_in_executor(
                processes.spawn_thread(new_privileges), _spawn_counted, processes, argv, env,
                os.getpid(), cwd, make_preexec,
                cgroup if make_preexec is None and not joins_itself else None, wrap)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError):  # from submit: _spawn_counted never ran
                processes.spawn_done()
            # Pipes (EMFILE, ENFILE), fork (EAGAIN, ENOMEM), exec (EAGAIN over
            # RLIMIT_NPROC, ENOMEM, ETXTBSY), the cgroup join, a spawn thread that could
            # not start: not the tool's fault (case F19).
            short = shortage_errno(exc)
            if short is None:
                if isinstance(exc, RuntimeError):
                    raise
                raise _spawn_failure(argv[0], exc) from None
            raise SpawnShortage(f"cannot start {argv[0]} now: "
                                f"{getattr(exc, 'strerror', None) or exc}", short) from None
        except subprocess.SubprocessError as exc:
            raise SpawnFailed(f"cannot start {argv[0]}: {exc}", 126) from None
        return Launched(popen, in_w, out_r, err_r, status_r, processes, cgroup,
                        cgroup is not None and (make_preexec is not None or joins_itself))

    @classmethod
    def start(cls, launched: Launched, payload: bytes, max_stdout: int,
              on_stderr_line: Callable[[bytes], None], cookie: dict[str, str],
              lines: bool = False) -> Child:
        """``spawn``'s second half: write ``payload`` to the launched process's stdin and
        watch its pipes and its exit (arguments as ``spawn``). Call it on the event loop,
        once per ``Launched``. ``lines``: line mode (a warm process): nothing is written
        now, stdin stays open for ``request``, and ``max_stdout`` caps each line."""
        child = cls(launched.popen, launched.stdin_fd, launched.stdout_fd, launched.stderr_fd,
                    payload, max_stdout, on_stderr_line, cookie, launched.cgroup,
                    launched.processes, launched.status_fd, lines)
        child.cgroup_from_exec = launched.cgroup_from_exec
        return child

    # --- exit ---------------------------------------------------------------

    def _watch_exit(self) -> None:
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            asyncio.ensure_future(self._poll_exit())
            return

        def on_exit() -> None:
            if self._try_reap():
                self.loop.remove_reader(pidfd)
                os.close(pidfd)

        self.loop.add_reader(pidfd, on_exit)

    def _read_sandbox_status(self) -> None:
        """bwrap has exited: take the tool's exit status from its JSON status (the
        ``exit-code`` document, written before bwrap exits), decoded by
        isolation.decode_sandbox_status. No such document while bwrap exited by itself:
        the tool never started (``sandbox_failed``). bwrap killed by a signal (the tree
        kill) keeps that signal as the status."""
        from sidecar.worker.isolation import decode_sandbox_status

        data = b""
        with contextlib.suppress(OSError):
            os.set_blocking(self.status_fd, False)
            while chunk := os.read(self.status_fd, 4096):
                data += chunk
                if len(data) > 65536:
                    break
        with contextlib.suppress(OSError):
            os.close(self.status_fd)
        self.status_fd = -1
        code = None
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                document = json.loads(line)
            except ValueError:
                continue
            if not isinstance(document, dict):
                continue
            if isinstance(document.get("exit-code"), int):
                code = document["exit-code"]
            pid = document.get("child-pid")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1:
                self.sandbox_init_pid = pid
        if code is not None:
            self.returncode = decode_sandbox_status(code)
        elif self.returncode is not None and self.returncode >= 0:
            self.sandbox_failed = True

    async def _poll_exit(self) -> None:
        while not self._try_reap():
            await asyncio.sleep(0.05)

    def _try_reap(self) -> bool:
        try:
            pid, status, self.rusage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            # ECHILD: the child is gone and its status with it (SIGCHLD ignored, or reaped
            # behind our back). Unknown, not 0 (case F9).
            pid, status, self.status_lost = self.pid, None, True
        if pid == 0:
            self.rusage = None
            return False
        if status is not None:
            self.returncode = os.waitstatus_to_exitcode(status)
            if self.sandboxed:
                self._read_sandbox_status()
        # Popen must never wait on the pid again: it may already belong to someone else.
        self.popen.returncode = self.returncode if status is not None else -signal.SIGKILL
        self.processes.unmanage(self.pid)
        if not self.exited.done():
            self.exited.set_result(self.returncode)
        return True

    # --- pipes --------------------------------------------------------------

    def request(self, line: bytes) -> asyncio.Future[bytes]:
        """Line mode: write one request ``line`` to the open stdin and return the future of
        the next line the process writes to stdout (without its newline). Raises
        ``LineBroken`` when the process cannot take a request: not in line mode, exited,
        its stdin closed (EPIPE), a request still unanswered, or stdout holding bytes no
        request asked for (they would be taken for this job's answer)."""
        if not self.line_mode or self._stdin_fd < 0 or self.exited.done() \
                or self.stdout_overflow or (self._line is not None and not self._line.done()):
            raise LineBroken("the process cannot take a request")
        if self.stdout:
            raise LineBroken(f"the process wrote {len(self.stdout)} bytes to stdout that no "
                             "request asked for")
        if self._stdin_task is not None and not self._stdin_task.done():
            raise LineBroken("the previous request is still being written")
        view = memoryview(line)
        try:
            view = view[os.write(self._stdin_fd, view):]
        except BlockingIOError:
            pass
        except OSError as exc:
            raise LineBroken(f"its stdin is closed ({exc.strerror})") from None
        self._line = self.loop.create_future()
        if view:
            self._stdin_task = asyncio.ensure_future(self._feed_open(self._stdin_fd, view))
        return self._line

    async def _feed_open(self, fd: int, view: memoryview) -> None:
        """The rest of a request line, as the pipe takes it; stdin stays open. A closed
        pipe (EPIPE) leaves the rest unwritten: the process ended or stopped reading, which
        its exit or the stage deadline shows."""
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                await self._writable(fd)
            except OSError:
                return

    def close_stdin(self) -> None:
        """Line mode: close stdin, the process's cue to finish (EOF on its next read)."""
        if self._stdin_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._stdin_fd)
            self._stdin_fd = -1

    @staticmethod
    def _write_at_once(fd: int, payload: bytes) -> memoryview | None:
        """One non-blocking write of ``payload`` to the child's stdin. None when nothing is
        left to do (all written, or the child closed stdin: EPIPE, not our error), and
        ``fd`` is closed then; else the part still to write (all of it after an error
        other than EPIPE, which _feed_stdin then meets and raises)."""
        view = memoryview(payload)
        try:
            view = view[os.write(fd, view):] if view else view
        except BlockingIOError:
            return view
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                return view
            view = view[len(view):]
        if view:
            return view
        os.close(fd)
        return None

    async def _feed_stdin(self, fd: int, payload: bytes | memoryview) -> None:
        view = memoryview(payload)
        try:
            while view:
                try:
                    written = os.write(fd, view)
                except BlockingIOError:
                    await self._writable(fd)
                    continue
                except OSError as exc:  # EPIPE: the child exited or closed stdin; not our error
                    if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                        return
                    raise
                view = view[written:]
        finally:
            os.close(fd)

    async def _writable(self, fd: int) -> None:
        ready = self.loop.create_future()

        def on_writable() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_writer(fd, on_writable)
        try:
            await ready
        finally:
            self.loop.remove_writer(fd)

    def _on_readable(self, fd: int, take: Callable[[bytes], None]) -> None:
        for _ in range(_READS_PER_WAKEUP):
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._close_fd(fd)
                take(b"")
                return
            take(chunk)

    def _close_fd(self, fd: int) -> None:
        if fd in self._open_fds:
            self._open_fds.discard(fd)
            self.loop.remove_reader(fd)
            os.close(fd)
            if not self._eof[fd].done():
                self._eof[fd].set_result(None)

    def _take_stdout(self, chunk: bytes) -> None:
        self.stdout_bytes += len(chunk)
        if self.stdout_overflow:
            return
        if self.line_mode:
            self._take_line(chunk)
            return
        if len(self.stdout) + len(chunk) > self.max_stdout:
            self.stdout_overflow = True
            self.stdout = bytearray()  # the result is lost anyway: free it now
            if not self.overflowed.done():
                self.overflowed.set_result(None)
            return
        self.stdout += chunk

    def _take_line(self, chunk: bytes) -> None:
        """Line mode: keep stdout until a newline; the line up to it answers the pending
        request (what follows it stays, and ``request`` refuses a process that wrote it).
        More than ``max_stdout`` bytes kept, an answer's or not, overflow: the process is
        lost with them (nothing after can be told apart), and an idle process that floods
        stdout holds no more than that."""
        searched = len(self.stdout)
        self.stdout.extend(chunk)
        if self._line is not None and not self._line.done():
            end = self.stdout.find(b"\n", searched)
            if 0 <= end <= self.max_stdout:
                line = bytes(self.stdout[:end])
                del self.stdout[:end + 1]
                self._line.set_result(line)
        if len(self.stdout) > self.max_stdout:
            self.stdout_overflow = True
            self.stdout = bytearray()
            if not self.overflowed.done():
                self.overflowed.set_result(None)

    def _take_stderr(self, chunk: bytes) -> None:
        if not chunk:  # EOF: flush an unterminated last line
            if self._stderr_partial:
                self._on_stderr_line(self._stderr_partial)
                self._stderr_partial = b""
            return
        self.stderr_bytes += len(chunk)
        self.stderr_tail = (self.stderr_tail + chunk)[-_STDERR_KEPT:]
        *lines, self._stderr_partial = (self._stderr_partial + chunk).split(b"\n")
        if len(self._stderr_partial) > STDERR_LINE_BYTES:
            lines.append(self._stderr_partial)
            self._stderr_partial = b""
        for line in lines:
            if line:
                self._on_stderr_line(line[:STDERR_LINE_BYTES])

    async def close_pipes(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for stdout/stderr EOF (after the tree is dead EOF
        is immediate), then close them; stop feeding stdin."""
        pending = [fut for fut in self._eof.values() if not fut.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for fd in list(self._open_fds):
            self._close_fd(fd)
        if self.status_fd >= 0:  # a status never read (it was lost): let go of the pipe
            with contextlib.suppress(OSError):
                os.close(self.status_fd)
            self.status_fd = -1
        if self._stdin_task is not None:
            if not self._stdin_task.done():
                self._stdin_task.cancel()
            await asyncio.gather(self._stdin_task, return_exceptions=True)
        self.close_stdin()

    # --- kill ---------------------------------------------------------------

    async def kill_tree(self, grace: float) -> KillReport:
        """SIGTERM every process of the tree, wait up to ``grace`` seconds, SIGKILL what
        remains (re-scanning for new forks), and wait until all are gone and our child is
        reaped. Safe to call when everything has already exited.

        Every process found by any scan of this kill stays part of the tree while it lives
        (a process re-parented or made unreadable meanwhile is not forgotten), and one
        that is still alive at the end is a survivor, whether a signal was refused for it
        (EPERM, ``report.unsignalled``) or not: "0 survivors" is never said of a tree
        something of which still runs (case F23). The job cgroup, where there is one, is
        killed with ``cgroup.kill``, which reaches every member whatever its identity."""
        report = KillReport()
        if self.exited.done() and await self._tree_gone_by_guarantee():
            # The usual end under a stronger guarantee (issue 42): the PID namespace or
            # the job cgroup says the tree is dead; no scan of /proc.
            self._uncount()
            return report
        members: dict[psutil.Process, None] = {}
        procs = await self._scan()
        if procs and self.sandboxed and self.exited.done():
            # bwrap exits as soon as its namespace's init reports the tool's exit, while
            # init itself (now ours, as subreaper) is still on its way out, taking with it
            # whatever the tool left in the namespace: not an orphan to kill.
            await self._wait_exits(procs, SANDBOX_SETTLE_SECONDS)
            procs = await self._scan()
        if not procs and self.exited.done() and self.run_as_uid is None:
            # The usual end: the tool exited and left nothing. No second scan, and adopted
            # zombies (if any) wait for the periodic sweep (under RUN_AS they are reaped
            # below at once: they count against the user's RLIMIT_NPROC).
            self._uncount()
            return report
        procs = _remember(members, procs)
        if procs:
            report.signal = signal.SIGTERM
            # Sandboxed: SIGTERM to the tool's processes only. bwrap itself would die of
            # it, and its init (PID 1 of the namespace, bound to it by
            # --die-with-parent) would take the whole namespace down with SIGKILL at once,
            # before the tool had its grace; SIGKILL to its init ends the namespace.
            wrappers = self._sandbox_wrappers()
            self._signal([p for p in procs if p.pid not in wrappers], signal.SIGTERM, report)
            await self._wait_gone(procs, grace)
        for _ in range(5):
            procs = _remember(members, await self._scan())
            if not procs:
                break
            report.signal = signal.SIGKILL
            if self.cgroup is not None:  # atomic where cgroup.kill exists: no fork escapes
                await self.loop.run_in_executor(None, self.cgroup.kill)
            self._signal(procs, signal.SIGKILL, report)
            if self.cgroup is None and all(p.pid in report.unsignalled for p in procs):
                break  # only what refuses our signals is left: no round can do more
            await self._wait_gone(procs, 2.0)
        report.survivors = [proc.pid for proc in _remember(members, await self._scan())]
        if not self.exited.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout=2.0)
            except TimeoutError:
                report.survivors.append(self.pid)
        self._uncount()
        if self.processes.subreaper:
            # Reap the killed orphans now, not at the next periodic sweep: as zombies they
            # still count against the RUN_AS user's RLIMIT_NPROC for the next attempt.
            await self.loop.run_in_executor(None, self.processes.reap_adopted)
        return report

    async def _tree_gone_by_guarantee(self) -> bool:
        """True when the tool has exited and a guarantee stronger than a scan says nothing
        of its tree is left, so the tree kill has no work (issue 42: each guarantee paid
        once); False when the caller must scan. Call only once ``exited`` is done.

        - Sandboxed: the tree is the sandbox's PID namespace. bwrap exits as the tool
          does, and its namespace init (``--die-with-parent``) with it; the kernel lets
          PID 1 of a namespace finish exiting only once every process in it is gone
          (``zap_pid_ns_processes``), and no process can leave the namespace (no
          capability, no user namespace inside). So the tree is dead once the init,
          adopted by this subreaper, has exited (waited for up to
          ``SANDBOX_SETTLE_SECONDS``). What the tool left in its namespace was killed by
          the kernel with the init, without a grace, as before: no orphan to report.
        - A job cgroup the tool joined before exec (``cgroup_from_exec``; no RUN_AS; this
          process a subreaper): a fork is born in its parent's cgroup, so empty
          ``cgroup.procs`` are a dead tree *unless* a member moved itself out, which the
          tool's user may wherever it may write cgroup files (root, or the owner of a
          delegated subtree: into a cgroup it makes below its own, whose members the job
          cgroup's ``cgroup.procs`` does not list). Such a process outlives the tool's
          exit only as a descendant of another live member (then the cgroup is not
          empty) or as an orphan adopted by this subreaper (Linux hands orphans to the
          subreaper's thread group leader): so the cgroup is the tree only while this
          process has no adopted child of its own running either (one small read).
          A tool the parent moved after a vfork is no such guarantee: what it forked
          before the move and left behind (it may exit first, and its children are then
          ours, not its) stays outside, and only the scan finds it.

        False when neither applies: no subreaper (the init is then not ours to wait for,
        nor an escapee of the cgroup ours to see), bwrap's status named no init, the init
        still runs after the wait, the cgroup still has members, an adopted orphan runs,
        or RUN_AS without a sandbox (adopted zombies of that user are reaped by the scan
        at once: RLIMIT_NPROC)."""
        if self.sandboxed:
            pid = self.sandbox_init_pid
            if pid is None or not self.processes.subreaper or self.sandbox_failed:
                return False
            if self._init_exited(pid):
                return True
            await self._wait_exits(_processes([pid]), SANDBOX_SETTLE_SECONDS)
            return self._init_exited(pid)
        return self.cgroup_from_exec and self.run_as_uid is None \
            and self.processes.subreaper and not self.cgroup.members() \
            and not self._adopted_running()

    def _adopted_running(self) -> bool:
        """True when an orphan adopted by this subreaper (no managed tool, no exempt
        child) still runs; exited ones are reaped on the way (ProcessTable.reap_listed).
        A process that left its job cgroup and outlived the tool is one of these."""
        me = os.getpid()
        listed = linux.adopted_pids(me) if linux.HAVE_PROC_CHILDREN else _children(me)
        return bool(self.processes.reap_listed(
            [pid for pid in listed if not self.processes.is_own(pid)]))

    def _init_exited(self, pid: int) -> bool:
        """True when the sandbox's init ``pid`` has exited: reaped now (unless a spawn
        holds ``reap_lock``, case F9), a zombie left to the orphan reaper, or no child of
        ours any more (reaped already, by bwrap or the orphan reaper: its pid may be
        another process's by now). False while it runs, or when ``pid`` is a managed
        tool's or an exempt child's (the init's pid was reused: not ours to judge)."""
        if self.processes.is_own(pid):
            return False
        if not self.processes.reap_listed([pid]):
            return True
        return linux.is_zombie(pid)

    def _sandbox_wrappers(self) -> set[int]:
        """bwrap's own processes of a sandboxed child: bwrap (our child) and the
        namespace's init, its child. Empty when not sandboxed or once bwrap is reaped."""
        if not self.sandboxed or self.exited.done():
            return set()
        return {self.pid, *_children(self.pid)}

    def _uncount(self) -> None:
        if self._counted:
            self.processes.attempt_ended()
            self._counted = False

    async def _scan(self) -> list[psutil.Process]:
        # As a subreaper the scan reads the tree and our own children from /proc: a few
        # small reads, cheaper on the event loop than a hop to a thread. Without one it
        # reads every process on the host, off the loop.
        if self.processes.subreaper:
            return self._scan_blocking()
        return await self.loop.run_in_executor(None, self._scan_blocking)

    def _scan_blocking(self) -> list[psutil.Process]:
        # As PID 1 every orphan of the container is ours to adopt (a `kubectl exec` shell's
        # leftovers, an embedded server): only marked processes are claimed then.
        alone = self.processes.alone()
        generation, quiet = self.processes.spawn_mark()
        reaped = self.exited.done()  # our pid may be someone else's from then on
        procs = find_tree(self.pid, self.cookie,
                          claim_unmarked=self.started_at if alone and quiet else None,
                          claim_uid=self.run_as_uid, root_reaped=reaped,
                          processes=self.processes)
        if alone and quiet and self.processes.spawn_moved(generation):
            # A spawn began while we listed: one of the "unmarked" may be its child.
            procs = find_tree(self.pid, self.cookie, root_reaped=reaped,
                              processes=self.processes)
        if self.cgroup is not None:
            known = {proc.pid for proc in procs}
            for pid in self.cgroup.members() - known:
                try:
                    proc = psutil.Process(pid)
                except psutil.Error:
                    continue
                if _alive(proc):
                    procs.append(proc)
        return procs

    @staticmethod
    def _signal(procs: list[psutil.Process], sig: int, report: KillReport) -> None:
        for proc in procs:
            try:
                proc.send_signal(sig)
                if proc.pid not in report.killed:
                    report.killed.append(proc.pid)
            except psutil.AccessDenied:  # EPERM: it took another identity (case F23)
                if proc.pid not in report.unsignalled:
                    report.unsignalled.append(proc.pid)
            except psutil.Error:  # gone meanwhile
                pass

    async def _wait_exits(self, procs: list[psutil.Process], timeout: float) -> None:
        """Return once every one of ``procs`` has exited, or after ``timeout`` seconds:
        told by a pidfd of each (readable at its exit), so the wait ends as the last one
        exits rather than at the next poll. A pidfd is taken for a process only while it
        is still that process (psutil's identity, checked once the pidfd holds its pid);
        where pidfds are not available this is ``_wait_gone``'s poll."""
        fds: list[int] = []
        try:
            for proc in procs:
                try:
                    fd = os.pidfd_open(proc.pid)
                except (AttributeError, OSError) as exc:
                    if isinstance(exc, ProcessLookupError):
                        continue  # gone already
                    await self._wait_gone(procs, timeout)
                    return
                fds.append(fd)
                if not _alive(proc):  # exited, or the pid is another process's by now
                    fds.pop()
                    os.close(fd)
            if not fds:
                return
            waits = []
            for fd in fds:
                done = self.loop.create_future()
                self.loop.add_reader(fd, lambda d=done: d.done() or d.set_result(None))
                waits.append(done)
            try:
                await asyncio.wait(waits, timeout=timeout)
            finally:
                for fd in fds:
                    self.loop.remove_reader(fd)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    async def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(_alive(proc) for proc in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
