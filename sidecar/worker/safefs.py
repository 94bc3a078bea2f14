"""File operations inside a directory that another user may write: an attempt's work
directory once a ``RUN_AS`` tool owns it (a sibling attempt of the same user may write
there too), and a shared work root such as ``/tmp`` or a Kubernetes ``emptyDir``.

The sidecar may be root there, and any name in such a directory may be swapped for a
symlink, a FIFO or another directory between two system calls. So every operation here
names one path component relative to a directory descriptor (``dir_fd``), opens with
``O_NOFOLLOW`` (a symlink is never followed, in the last component or anywhere: there is
only one), creates with ``O_EXCL`` (never an existing file), changes ownership and modes
with ``fchown``/``fchmod`` on a descriptor, and never descends into another filesystem.
A path is followed only for the directory the operator configured (``open_dir``). Case
F15, docs/isolation.md.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # those of tempfile.mkdtemp
# Directory descriptors held at once while a tree is removed; a deeper subtree is first
# moved up to the top directory (same filesystem) and removed from there.
MAX_HELD_DIRS = 32
# Passes over the top directory before clear_dir gives up on what keeps coming back.
MAX_CLEAR_PASSES = 4096


def _name(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a single path component: {name!r}")
    return name


def open_dir(path: str) -> int:
    """A close-on-exec descriptor of the directory at ``path``, which the operator chose
    (the work root): the only path this module follows. Raises OSError."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_subdir(dir_fd: int, name: str) -> int:
    """A descriptor of the directory ``name`` in ``dir_fd``. Raises OSError (ELOOP or
    ENOTDIR when ``name`` is a symlink or anything but a directory)."""
    return os.open(_name(name), _DIR_FLAGS, dir_fd=dir_fd)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """The entry ``name`` of ``dir_fd`` itself (a symlink is not followed), or None."""
    try:
        return os.stat(_name(name), dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def make_private_dir(parent_fd: int, prefix: str, suffix_chars: int = 8) -> tuple[str, int]:
    """Make a new directory ``<prefix><random>`` in ``parent_fd``, mode 0700, owned by this
    process's user (like ``tempfile.mkdtemp``), and return (name, descriptor). The
    descriptor is checked to be that directory: ours and private, whatever another user
    of the parent did to the name meanwhile. Raises OSError."""
    for _ in range(100):
        name = prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(suffix_chars))
        try:
            os.mkdir(_name(name), 0o700, dir_fd=parent_fd)
        except FileExistsError:
            continue
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_nlink != 2:
            os.close(fd)
            raise PermissionError(errno.EPERM, "the new directory was replaced", name)
        os.fchmod(fd, 0o700)  # whatever the umask left
        return name, fd
    raise FileExistsError(errno.EEXIST, "no free directory name", prefix)


def create_file(dir_fd: int, name: str, data: bytes, ids: tuple[int, int] | None = None,
                mode: int = 0o600) -> None:
    """Create the new regular file ``name`` in ``dir_fd`` holding ``data``, owned by
    ``ids`` (uid, gid; ``fchown`` on its descriptor) when given. Never opens an existing
    name (FileExistsError, whether a file, a symlink or a FIFO is there); a file left half
    written by a failure is removed. Raises OSError."""
    fd = os.open(_name(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with memoryview(data) as view:
            while view:
                view = view[os.write(fd, view):]
        if ids is not None:
            os.fchown(fd, *ids)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


def clear_dir(top_fd: int) -> None:
    """Remove everything inside the directory open at ``top_fd``, never following a
    symlink (a link is removed, not its target), never entering another filesystem (a
    mount point is left). Directories of this process's user that lack write or search
    permission are ``fchmod``-ed 0700 through their own descriptor first (a root sidecar
    needs none). At most MAX_HELD_DIRS descriptors at any depth; what cannot be removed
    (a mount point, a busy name) is left. Raises OSError only for ``top_fd`` itself."""
    top_dev = os.fstat(top_fd).st_dev
    _writable(top_fd)
    for _ in range(MAX_CLEAR_PASSES):
        if not _clear_pass(top_fd, top_dev):
            return


def _clear_pass(top_fd: int, top_dev: int) -> bool:
    """One walk of the tree under ``top_fd``; True when it removed or moved anything."""
    progress = False
    stack: list[tuple[int, str, object]] = [(top_fd, "", os.scandir(top_fd))]
    try:
        while stack:
            fd, _, entries = stack[-1]
            for entry in entries:  # type: ignore[attr-defined]
                outcome = _clear_entry(fd, entry.name, top_fd, top_dev, len(stack))
                if isinstance(outcome, int) and not isinstance(outcome, bool):
                    stack.append((outcome, entry.name, os.scandir(outcome)))
                    break
                progress = progress or outcome
            else:
                fd, name, entries = stack.pop()
                entries.close()  # type: ignore[attr-defined]
                if stack:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.rmdir(name, dir_fd=stack[-1][0])
                        progress = True
    finally:
        for fd, _, entries in stack:
            entries.close()  # type: ignore[attr-defined]
            if fd != top_fd:
                os.close(fd)
    return progress


def _clear_entry(fd: int, name: str, top_fd: int, top_dev: int, depth: int) -> bool | int:
    """Remove the entry ``name`` of ``fd`` if it is no directory, or an empty one (True
    when something went), move a directory that is too deep up to ``top_fd``, or return
    a descriptor of the directory to descend into."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=fd)
            return True
        if info.st_dev != top_dev:
            return False  # a mount point: never removed through
        os.rmdir(name, dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EACCES, errno.EPERM):
            return False
    if depth >= MAX_HELD_DIRS:
        moved = f".rm-{secrets.token_hex(8)}"
        try:
            os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top_fd)
            return True
        except OSError:
            return False
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or a file
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
                return True
        return False
    if os.fstat(child).st_dev != top_dev:
        os.close(child)
        return False
    _writable(child)
    return child


def _writable(fd: int) -> None:
    """Give a directory of our own that lacks write or search permission both, through
    its descriptor (a tool of the sidecar's user may have made it read-only)."""
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and info.st_mode & 0o300 != 0o300:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | 0o700)


def listen_unix(dir_fd: int, name: str, ids: tuple[int, int] | None = None,
                backlog: int = 128) -> socket.socket:
    """A new Unix stream socket bound at the new name ``name`` in ``dir_fd`` and listening
    (``backlog``), non-blocking and not inherited; the socket file has mode 0600 (set on
    the socket before ``bind``, which Linux gives the file, less the umask) and, given
    ``ids``, is owned by them (``fchownat`` without following a link). Bound through
    ``/proc/self/fd/<dir_fd>/<name>``: the directory is the one the descriptor holds, never
    a path a tool may have swapped, and ``bind`` itself never follows a link in its last
    component nor reuses a name (EADDRINUSE when anything is there). Call it before the
    directory is handed to another user (the ``fchownat`` then races nobody). Raises
    OSError; nothing is left behind."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    bound = False
    try:
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(f"/proc/self/fd/{dir_fd}/{_name(name)}")
        bound = True
        if ids is not None:
            os.chown(name, *ids, dir_fd=dir_fd, follow_symlinks=False)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        if bound:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
        raise
    return sock


def remove_at(parent_fd: int, name: str) -> bool:
    """Remove the entry ``name`` of ``parent_fd`` and, if it is a directory, all in it
    (clear_dir); a symlink is removed, never followed. True when the name is gone."""
    info = lstat_at(parent_fd, name)
    if info is None:
        return True
    if stat.S_ISDIR(info.st_mode):
        try:
            fd = open_subdir(parent_fd, name)
        except OSError:
            fd = None
        if fd is not None:
            try:
                clear_dir(fd)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent_fd)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent_fd)
    return lstat_at(parent_fd, name) is None


def remove_held(parent_fd: int, name: str, fd: int) -> bool:
    """Remove the directory held open at ``fd``, made as ``name`` in ``parent_fd``: its
    contents through ``fd`` (wherever another user moved it meanwhile), then the name if
    it still is that directory. A symlink or a non-directory found in its place is
    removed (the name is ours); another directory found there is left alone (a tool may
    have swapped in someone else's). True when the name is gone."""
    clear_dir(fd)
    info = lstat_at(parent_fd, name)
    if info is None:
        return True
    if os.path.samestat(info, os.fstat(fd)):
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=parent_fd)
    elif not stat.S_ISDIR(info.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent_fd)
    return lstat_at(parent_fd, name) is None


def remove_path(path: str) -> bool:
    """``remove_at`` for ``path``, whose parent directory the operator chose (it is
    followed; ``path``'s own last component is not). True when it is gone."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = open_dir(parent)
    except FileNotFoundError:
        return True
    try:
        return remove_at(parent_fd, name)
    finally:
        os.close(parent_fd)


def remove_held_path(path: str, fd: int) -> bool:
    """``remove_held`` for the directory made at ``path`` and held open at ``fd``."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = open_dir(parent)
    except FileNotFoundError:
        clear_dir(fd)
        return True
    try:
        return remove_held(parent_fd, name, fd)
    finally:
        os.close(parent_fd)


def read_small_file(dir_fd: int, name: str, max_bytes: int,
                    owner_uid: int | None = None) -> tuple[bytes, int] | None:
    """The content and ``st_mtime_ns`` of the regular file ``name`` in ``dir_fd``, which a
    tool may rewrite at any time (its progress file); None when there is none. Opened with
    ``O_NOFOLLOW`` (a symlink is refused, never followed) and ``O_NONBLOCK`` (a FIFO in its
    place cannot block); at most ``max_bytes`` bytes are read. Raises ValueError with the
    reason for a symlink, anything but a regular file, a hard link, a file of another user
    than ``owner_uid`` (RUN_AS), or one larger than ``max_bytes``; OSError otherwise."""
    try:
        fd = os.open(_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("it is a symlink; write a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        if info.st_nlink != 1:
            raise ValueError("it is a hard link to another file; write a new file")
        if owner_uid is not None and info.st_uid != owner_uid:
            raise ValueError(f"it belongs to uid {info.st_uid}, not to the tool's uid "
                             f"{owner_uid}")
        if info.st_size > max_bytes:
            raise ValueError(f"it holds {info.st_size} bytes, more than {max_bytes}")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"it holds more than {max_bytes} bytes")
        return data, info.st_mtime_ns
    finally:
        os.close(fd)
