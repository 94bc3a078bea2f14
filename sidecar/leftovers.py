"""What a sidecar that died hard leaves behind, and how it is cleared: job cgroups with
escaped processes still in them, and attempts' work directories.

Every job cgroup is named ``<owner key>.job-<id>-<token>`` and every work directory
``<owner key>.j<random>``, the owner key being a short hash of the sidecar's owner id. A
live sidecar holds an exclusive ``flock`` on ``<work root>/.owner-<key>.lock`` for its
whole life; the kernel drops it when the process dies, however it dies. So:

- the guardian (sidecar.guardian), on its sidecar's death, kills and removes that owner's
  job cgroups and work directories at once;
- every ``sidecar run`` start clears the job cgroups of owners whose lock it can take
  (dead ones) in its work root, and work directories whose own lock (held by each live
  attempt) it can take.

Nothing here touches another live sidecar's cgroups or directories. Kept free of heavy
imports: the guardian imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import stat
import time

from sidecar.cgroups import kill_cgroup

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
    follows): kept short so sockets fit under it (sidecar.isolation)."""
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
        """Create the lock file (and the work root) and hold an exclusive flock on it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweeper may have removed the file between our open and our lock: then the
            # lock guards nothing anyone can see; take a fresh file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (a clean stop leaves nothing behind)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def clear_owner(key: str, cgroup_dirs: list[str], work_root: str | None) -> int:
    """Kill the processes left in the owner's job cgroups, remove the cgroups and the
    owner's work directories that no live attempt holds. For an owner known to be dead
    (the guardian's own sidecar; an owner lock the sweep could take). Returns how many
    cgroups and directories were removed."""
    prefix = f"{key}{_ATTEMPT_MARK}"
    removed = 0
    for parent in cgroup_dirs:
        for path in _entries(parent, prefix):
            if kill_cgroup(path):
                removed += 1
    if work_root:
        for path in _entries(work_root, prefix):
            removed += remove_if_abandoned(path, min_age=0.0)
    return removed


def sweep_dead_owners(work_root: str, cgroup_dirs: list[str]) -> int:
    """Clear what dead sidecars left: the job cgroups of every owner whose lock file in
    ``work_root`` is ours to trust and not held, and every attempt's work directory there
    that no live attempt holds (older than a minute). Returns how many cgroups and
    directories were removed.

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
            removed += clear_owner(key, cgroup_dirs, None)
            with contextlib.suppress(OSError):
                os.unlink(path)
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


def hold_directory(path: str) -> int:
    """Lock an attempt's work directory for the attempt's life (exclusive flock on a
    close-on-exec descriptor, returned; close it to let go). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def remove_if_abandoned(path: str, min_age: float) -> bool:
    """Remove the work directory at ``path`` if no attempt holds it and it is at least
    ``min_age`` seconds old; a symlink or anything but a directory is left alone. True
    when it was removed."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or time.time() - info.st_mtime < min_age:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live attempt holds it
        remove_tree(path)
        return not os.path.lexists(path)
    finally:
        os.close(fd)


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
    the tool put in place of ``root`` itself (that link is removed, not its target).
    Directories the tool made read-only inside ``root`` are made writable (never anything
    outside it) and the removal is tried again (at most 8 passes)."""
    try:
        if os.path.islink(root) or not os.path.isdir(root):
            os.unlink(root)
            return
    except FileNotFoundError:
        return

    def unlock(_func, path, _exc_info) -> None:
        for candidate in (os.path.dirname(path), path):
            if candidate != root and not candidate.startswith(root + os.sep):
                continue
            with contextlib.suppress(OSError):
                fd = os.open(candidate, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    os.fchmod(fd, stat.S_IRWXU)
                finally:
                    os.close(fd)

    for _ in range(8):  # each pass unlocks at least one more level of locked directories
        shutil.rmtree(root, onerror=unlock)
        if not os.path.lexists(root):
            return
