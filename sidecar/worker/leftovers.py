"""What a sidecar that died hard leaves behind, and how it is cleared: job cgroups with
escaped processes still in them, and attempts' work directories.

Every job cgroup is named ``<owner key>.job-<id>-<token>`` and every work directory
``<owner key>.j<random>``, the owner key being a short hash of the sidecar's owner id. A
live sidecar holds an exclusive ``flock`` on ``<work root>/.owner-<key>.lock`` for its
whole life; the kernel drops it when the process dies, however it dies. So:

- the guardian (sidecar.worker.guardian), on its sidecar's death, kills and removes that owner's
  job cgroups and work directories at once;
- every ``sidecar run`` start, and every running sidecar every
  SIDECAR_LEFTOVER_SWEEP_SECONDS, clears the tools and job cgroups of owners whose lock it
  can take (dead ones) in its work root, and work directories whose own lock (held by
  each live attempt) it can take: a sidecar SIGKILLed together with its guardian leaves
  nothing running for longer than that (F24).

Nothing here touches another live sidecar's cgroups or directories. Kept free of heavy
imports: the guardian imports it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import time

from sidecar.worker import safefs
from sidecar.worker.cgroups import kill_cgroup

LOCK_PREFIX = ".owner-"
LOCK_SUFFIX = ".lock"


def owner_key(owner_id: str) -> str:
    """The 12-hex-digit key of an owner id, the prefix of its cgroups and directories."""
    return hashlib.sha256(owner_id.encode()).hexdigest()[:12]


def job_name(owner_id: str, job_id: object, fencing_token: int) -> str:
    """The name of one attempt's cgroup: ``<owner key>.job-<id>-<token>``."""
    return f"{owner_key(owner_id)}.job-{job_id}-{fencing_token}"


def work_dir_prefix(owner_id: str) -> str:
    """The prefix of an attempt's work directory, ``<owner key>.j`` (a random suffix
    follows): kept short so sockets fit under it (sidecar.worker.isolation)."""
    return f"{owner_key(owner_id)}{_ATTEMPT_MARK}"


# What follows the owner key in the name of every job cgroup and work directory.
_ATTEMPT_MARK = ".j"


class OwnerLock:
    """The exclusive flock a live sidecar holds on ``<work root>/.owner-<key>.lock``.
    ``acquire`` raises OSError when the work root is unusable. Keep the object alive as
    long as the sidecar runs; the descriptor is close-on-exec, so tools never inherit it."""

    def __init__(self, work_root: str, owner_id: str):
        self.key = owner_key(owner_id)
        self.path = os.path.join(work_root, f"{LOCK_PREFIX}{self.key}{LOCK_SUFFIX}")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Create the lock file (and the work root) and hold an exclusive flock on it. A
        symlink, FIFO or foreign file a tool put under the lock's name (the work root may be
        shared with tools) is removed, never opened through (case F15); raises OSError
        when that keeps happening."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # a symlink in its place: removed, not followed
                continue
            if not _trusted(os.fstat(fd)):
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweeper may have removed the file between our open and our lock: then the
            # lock guards nothing anyone can see; take a fresh file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)
        raise OSError(errno.EAGAIN, "the owner lock file keeps being replaced", self.path)

    def release(self) -> None:
        """Remove the lock file and drop the lock (a clean stop leaves nothing behind)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def kill_owner_processes(key: str) -> int:
    """SIGKILL every process whose ``SIDECAR_OWNER_ID`` (the variable every tool of a
    sidecar inherits) has the owner key ``key``: the tools of a dead sidecar whose
    guardian died with it and that had no job cgroup (F24). Only for an owner known to be
    dead; refuses anything but one exact owner key (never an empty or partial selector).
    Returns how many were signalled."""
    if not _OWNER_KEY.fullmatch(key):
        raise ValueError(f"not an owner key: {key!r}")
    import psutil  # here, not at the top: the guardian imports this module

    me, killed = os.getpid(), 0
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            owner = proc.environ().get("SIDECAR_OWNER_ID")
            if owner and owner_key(owner) == key:
                proc.kill()
                killed += 1
    return killed


def clear_owner(key: str, cgroup_dirs: list[str], work_root: str | None,
                kill_processes: bool = False) -> int:
    """Kill the processes left in the owner's job cgroups (and, with ``kill_processes``,
    every process carrying the owner's id: kill_owner_processes), remove the cgroups and
    the owner's work directories that no live attempt holds. For an owner known to be
    dead (the guardian's own sidecar; an owner lock the sweep could take). Returns how
    many cgroups and directories were removed."""
    prefix = f"{key}{_ATTEMPT_MARK}"
    removed = 0
    if kill_processes:
        kill_owner_processes(key)
    for parent in cgroup_dirs:
        for path in _entries(parent, prefix):
            if kill_cgroup(path):
                removed += 1
    if work_root:
        for path in _entries(work_root, prefix):
            removed += remove_if_abandoned(path, min_age=0.0)
    return removed


def sweep_dead_owners(work_root: str, cgroup_dirs: list[str]) -> int:
    """Clear what dead sidecars left: the processes carrying the id and the job cgroups of
    every owner whose lock file in ``work_root`` is ours to trust and not held, and every
    attempt's work directory there that no live attempt holds (older than a minute). Run
    at every start and, every SIDECAR_LEFTOVER_SWEEP_SECONDS, by every running sidecar, so
    a sidecar killed together with its guardian leaves nothing running for long (F24).
    Returns how many cgroups and directories were removed.

    A lock file is trusted only if it is a regular file of this process's user, with one
    link and writable by no one else: a tool sharing the work root can neither forge one
    (to get a live sidecar's cgroups killed) nor replace one. An untrusted or missing lock
    file clears nothing; work directories are judged by their own lock, never by it."""
    removed = 0
    for path in _entries(work_root, LOCK_PREFIX):
        key = os.path.basename(path)[len(LOCK_PREFIX):-len(LOCK_SUFFIX)]
        if not _OWNER_KEY.fullmatch(key):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _trusted(os.fstat(fd)):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its sidecar is alive
            removed += clear_owner(key, cgroup_dirs, work_root, kill_processes=True)
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                    os.unlink(path)  # only the file we locked, never a swapped-in one
        finally:
            os.close(fd)
    for path in _entries(work_root, ""):
        key, dot, rest = os.path.basename(path).partition(".")
        if dot and rest.startswith(_ATTEMPT_MARK[1:]) and _OWNER_KEY.fullmatch(key):
            removed += remove_if_abandoned(path, min_age=ABANDONED_AFTER_SECONDS)
    return removed


# A work directory is made, then locked by its attempt a moment later: one changed more
# recently than this (mtime) is never taken for abandoned.
ABANDONED_AFTER_SECONDS = 60.0
_OWNER_KEY = re.compile(r"[0-9a-f]{12}")


def lock_directory(fd: int) -> None:
    """Take the attempt's exclusive flock on the work directory open at ``fd``. Raises
    OSError (BlockingIOError when someone holds it)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def remove_if_abandoned(path: str, min_age: float) -> bool:
    """Remove the work directory at ``path`` if no attempt holds it and it is at least
    ``min_age`` seconds old; a symlink or anything but a directory is left alone. Removed
    through the descriptor that holds its lock (sidecar.worker.safefs: no link followed, also
    not when a tool swaps the name meanwhile). True when it was removed."""
    parent, name = os.path.split(path)
    try:
        parent_fd = safefs.open_dir(parent)
    except OSError:
        return False
    try:
        info = safefs.lstat_at(parent_fd, name)
        if info is None or not stat.S_ISDIR(info.st_mode) \
                or time.time() - info.st_mtime < min_age:
            return False
        try:
            fd = safefs.open_subdir(parent_fd, name)
        except OSError:
            return False
        try:
            try:
                lock_directory(fd)
            except OSError:
                return False  # a live attempt holds it
            if not os.path.samestat(os.fstat(fd), info):
                return False  # swapped since it was looked at: judged on the next sweep
            return safefs.remove_held(parent_fd, name, fd)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


def _trusted(info: os.stat_result) -> bool:
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _entries(parent: str, prefix: str) -> list[str]:
    try:
        return [entry.path for entry in os.scandir(parent) if entry.name.startswith(prefix)]
    except OSError:
        return []


def remove_tree(root: str) -> None:
    """Remove ``root`` and all in it without following a symlink anywhere, also not one
    the tool put in place of ``root`` itself (that link is removed, not its target), and
    without entering another filesystem. Every step goes through directory descriptors
    (sidecar.worker.safefs, case F15); directories of the sidecar's own user that a tool made
    read-only are made writable through their descriptor, never anything outside
    ``root``."""
    safefs.remove_path(root)
