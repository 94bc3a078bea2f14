"""Attempts prepared ahead of their jobs (issue 42: the sandbox off the job's path).

What an attempt needs before its tool can run costs milliseconds that have nothing to do
with the job: a work directory, a job cgroup, a process started in that cgroup and (by
default) a bubblewrap sandbox, whose namespaces and mounts alone take about 4 ms of the
kernel's time. A ``Preparer`` keeps one such attempt per slot ready: a **launcher**, a
tiny POSIX shell script that has joined its job cgroup and entered its sandbox and now
waits for one line on its stdin. When a job is claimed, the supervisor writes that line
(the job's own variables) followed by the payload, and the launcher ``exec``s the tool
with the line's variables added to its environment, in its work directory, keeping its
pid: the tool starts as soon as the line arrives.

The launcher (``launcher_argv``):

- joins every ``cgroup.procs`` of its job cgroup itself, before it execs anything (so
  everything the tool ever forks is born in the cgroup: no live move of a running tool,
  and the cgroup is the tree, ``Child.cgroup_from_exec``), then execs bwrap when
  sandboxed;
- inside, reads one line, ``NAME=value`` pairs separated by the unit separator (0x1F),
  exports each, and execs the tool. ``read`` takes a pipe byte by byte, so the tool's
  stdin starts exactly at the payload. A variable whose name or value could not travel
  on that line (a newline, a 0x1F, a NUL) makes ``job_line`` refuse, and the attempt is
  started the usual way.

What the prepared attempt shares with its job is only what the profile fixes (the
command, the static environment, the work directory, the cgroup and sandbox); nothing of
the job exists before the line. A launcher never used is killed with its process group
(``Launched.discard``) and its work directory and cgroup removed, at shutdown or when its
work directory can no longer be reused. docs/isolation.md, "Prepared attempts".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import re
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.runtime.log import log
from sidecar.worker.child import Child, Launched
from sidecar.worker.isolation import MountIdentities, Sandbox, mounts_moved

SH = "/bin/sh"
# The launcher's argv[0] ($0 of its scripts): what `ps` shows while it waits.
LAUNCHER_NAME = "sidecar-launcher"
FIELD_SEPARATOR = "\x1f"  # ASCII unit separator: between NAME=value pairs of the job line
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Host side, before the sandbox: join each cgroup.procs named before "--" (125 when one
# cannot be joined: the preparer sees a dead launcher and the attempt starts cold).
_JOIN = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; '
# The job's line: export its pairs, then exec the tool (argv after $0). set -f: no
# pathname expansion of the values; IFS only splits the line into its pairs.
# First it says it is ready (READY on stdout, taken by ``wait_ready`` before the stdout
# pipe is the tool's): cgroup joined, sandbox set up, waiting for the line.
READY = b"R"
# Its own variables are SIDECAR_ names, which no ENV_PASSTHROUGH passes and no job line
# carries (job_line); IFS is the shell's, never in the tool's environment here (SHELL_SET).
_LINE, _PAIR = "SIDECAR_LAUNCHER_LINE", "SIDECAR_LAUNCHER_PAIR"
_READ = ("printf " + READY.decode() + "; IFS='" + FIELD_SEPARATOR + "'; "
         f"read -r {_LINE} || exit 125; set -f; "
         f'for {_PAIR} in ${_LINE}; do export "${_PAIR}"; done; unset IFS {_PAIR} {_LINE}; ')
# Variables POSIX sh (dash) sets at its start whatever its environment says: an imported
# IFS is reset to <space><tab><newline>, OPTIND to 1, PPID to its parent's pid, and a
# PWD that does not name its directory to the one it does (bwrap sets PWD to the
# sandbox's directory itself, as a cold start in it gives). A tool's environment with one
# of them cannot be a launcher's (shell_altered).
SHELL_SET = ("IFS", "OPTIND", "PPID")
READY_SECONDS = 30.0  # a launcher not ready by then is discarded (a stuck mount, a host
#                       out of processes): the attempt starts cold


def launcher_argv(tool_argv: list[str], procs_files: list[str],
                  wrap: Callable[[list[str]], list[str]] | None,
                  unset_pwd: bool) -> list[str]:
    """The launcher's command line: join ``procs_files`` (the job cgroup's
    ``cgroup.procs``, none without a cgroup or when a preexec_fn joins them), then
    ``wrap`` (bwrap's argv around the inner command; None unsandboxed), read the job's
    line and exec ``tool_argv``. ``unset_pwd``: drop the PWD the shell exports, so an
    unsandboxed tool's environment is exactly the one a cold start gives (bwrap sets PWD
    itself)."""
    read = _READ + ("unset PWD; " if unset_pwd else "") + 'exec "$@"'
    if wrap is not None:
        inner = wrap([SH, "-c", read, LAUNCHER_NAME, *tool_argv])
        if not procs_files:
            return inner
        return [SH, "-c", _JOIN + 'exec "$@"', LAUNCHER_NAME, *procs_files, "--", *inner]
    if not procs_files:
        return [SH, "-c", read, LAUNCHER_NAME, *tool_argv]
    return [SH, "-c", _JOIN + read, LAUNCHER_NAME, *procs_files, "--", *tool_argv]


async def wait_ready(launched: Launched, timeout: float = READY_SECONDS) -> None:
    """Return once the launcher has said READY on its stdout (the byte is taken, so the
    tool's output starts clean). Raises OSError when it ended first or said something
    else, TimeoutError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    fd = launched.stdout_fd
    os.set_blocking(fd, False)
    ready = loop.create_future()

    def on_readable() -> None:
        try:
            data = os.read(fd, len(READY))
        except BlockingIOError:
            return
        except OSError as exc:
            data, error = b"", exc
        else:
            error = None
        if not ready.done():
            if data == READY:
                ready.set_result(None)
            else:
                ready.set_exception(error or OSError(
                    f"the launcher {'ended' if not data else 'wrote ' + repr(data[:20])} "
                    "before it was ready"))

    loop.add_reader(fd, on_readable)
    try:
        await asyncio.wait_for(ready, timeout)
    finally:
        loop.remove_reader(fd)


# What execve needs to tell an executable file it can run: Linux reads the first 256
# bytes (BINPRM_BUF_SIZE) for a "#!" line, and follows at most 4 interpreters deep.
_HEADER_BYTES = 256
_MAX_INTERPRETERS = 4
_ELF_MAGIC = b"\x7fELF"
_INTERPRETER_END = re.compile(rb"[ \t]")
Fingerprint = tuple[int, int, int, int, int, int]


def _fingerprint(info: os.stat_result) -> Fingerprint:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
            info.st_mode)


def _elf_identity(header: bytes) -> bytes:
    """An ELF header's class, byte order and machine (EI_CLASS, EI_DATA, e_machine)."""
    return header[4:6] + header[18:20]


_PT_INTERP = 3


def _elf_loader(path: str) -> str | None:
    """The dynamic loader an ELF file names (its PT_INTERP program header), or None for
    a static one. Raises OSError (ENOEXEC for headers that do not hold together)."""
    with open(path, "rb") as elf:
        ident = elf.read(64)
        if len(ident) < 64:
            raise OSError(errno.ENOEXEC, "truncated ELF header", path)
        wide, order = ident[4] == 2, "<" if ident[5] == 1 else ">"
        if wide:
            phoff, = struct.unpack_from(order + "Q", ident, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", ident, 54)
            layout = order + "IIQQQQQQ"  # type, flags, offset, vaddr, paddr, filesz, ...
        else:
            phoff, = struct.unpack_from(order + "I", ident, 28)
            phentsize, phnum = struct.unpack_from(order + "HH", ident, 42)
            layout = order + "IIIIIIII"  # type, offset, vaddr, paddr, filesz, ...
        if phnum > 4096 or phentsize < struct.calcsize(layout):
            raise OSError(errno.ENOEXEC, "bad ELF program headers", path)
        elf.seek(phoff)
        table = elf.read(phentsize * phnum)
        if len(table) < phentsize * phnum:
            raise OSError(errno.ENOEXEC, "truncated ELF program headers", path)
        for n in range(phnum):
            fields = struct.unpack_from(layout, table, n * phentsize)
            if fields[0] != _PT_INTERP:
                continue
            offset, size = (fields[2], fields[5]) if wide else (fields[1], fields[4])
            elf.seek(offset)
            return os.fsdecode(elf.read(min(size, 4096)).split(b"\0", 1)[0])
    return None


_OWN_ELF: bytes | None = None


def _own_elf_identity() -> bytes:
    global _OWN_ELF
    if _OWN_ELF is None:
        with open("/proc/self/exe", "rb") as exe:
            _OWN_ELF = _elf_identity(exe.read(20))
    return _OWN_ELF


def exec_files(program: str) -> tuple[tuple[str, Fingerprint], ...]:
    """The files execve reads to start ``program`` (the program, then each ``#!``
    interpreter), each with the fingerprint of its ``stat`` (device, inode, size, mtime,
    ctime, mode), for ``PreparedAttempt.start`` to see that none changed since.

    A launcher's ``exec`` is /bin/sh's, which differs from a cold start's execve exactly
    where execve fails: a file without ``#!`` or of a foreign machine (ENOEXEC) is run as
    a shell script, and a missing interpreter is the tool's own exit status 127, not
    spawn_failed. So a launcher is prepared only for a program execve would start: an
    executable regular file that is ELF of this machine (its dynamic loader, if it
    names one, there too: one more file), or a ``#!`` script whose interpreter (at most
    4 deep) is. Raises OSError (ENOEXEC, ENOENT, EACCES) otherwise:
    the attempts then start cold, and a cold start says spawn_failed."""
    files: list[tuple[str, Fingerprint]] = []
    path = program
    for _ in range(_MAX_INTERPRETERS + 1):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            header = os.read(fd, _HEADER_BYTES)
        finally:
            os.close(fd)
        if not stat.S_ISREG(info.st_mode) or not os.access(path, os.X_OK):
            raise PermissionError(errno.EACCES, "not an executable regular file", path)
        files.append((path, _fingerprint(info)))
        if header.startswith(_ELF_MAGIC) and len(header) >= 20:
            if _elf_identity(header) != _own_elf_identity():
                raise OSError(errno.ENOEXEC, "an ELF file of another machine", path)
            loader = _elf_loader(path)
            if loader is not None:  # execve opens it too: ENOENT when it is missing
                try:
                    files.append((loader, _fingerprint(os.stat(loader))))
                except OSError as exc:
                    raise FileNotFoundError(errno.ENOENT, f"its dynamic loader {loader} "
                                            f"is missing ({exc.strerror})", path) from None
            return tuple(files)
        line = header.split(b"\n", 1)[0] if header.startswith(b"#!") else b""
        # As Linux reads it: the interpreter ends at a space or a tab, nothing else
        # ("#!/bin/sh\r" names "/bin/sh\r"), or at the end of the line or of a short
        # file; one cut off by the 256-byte buffer is refused. A relative one would be
        # looked up from the tool's directory, not ours.
        parts = _INTERPRETER_END.split(line[2:].lstrip(b" \t"), maxsplit=1)
        interpreter = parts[0]
        whole = len(parts) > 1 or b"\n" in header or len(header) < _HEADER_BYTES
        if not interpreter.startswith(b"/") or not whole:
            raise OSError(errno.ENOEXEC, "neither ELF nor a #! script with an absolute "
                          "interpreter", path)
        path = os.fsdecode(interpreter)
    raise OSError(errno.ELOOP, "#! interpreters nested too deep", program)


_SHELL_OWN = frozenset(("IFS", "OPTIND", "PPID", "PWD", "SIDECAR_LAUNCHER_LINE",
                        "SIDECAR_LAUNCHER_PAIR"))


class NotPreparable(Exception):
    """This Worker's attempts cannot run in launchers for as long as it runs (its static
    environment holds what the launcher's shell would change, ``shell_altered``): the
    Preparer says so once and prepares no more."""


def shell_altered(env: dict[str, str], sandboxed: bool) -> list[str]:
    """The names of ``env`` a launcher's /bin/sh would not pass on to the tool as they
    are (SHELL_SET, and PWD unsandboxed, where no bwrap sets it); empty when none."""
    names = [name for name in SHELL_SET if name in env]
    if not sandboxed and "PWD" in env:
        names.append("PWD")
    return names


def job_line(variables: dict[str, str]) -> bytes | None:
    """The line a launcher reads: ``NAME=value`` pairs joined by 0x1F, ending in a
    newline, UTF-8. None when one of them cannot travel on it (a name that is no shell
    name or one the launcher's shell sets itself, a value with a newline, a 0x1F or a
    NUL): start that attempt cold."""
    pairs = []
    for name, value in variables.items():
        if not _NAME.fullmatch(name) or name in _SHELL_OWN \
                or any(c in value for c in ("\n", FIELD_SEPARATOR, "\0")):
            return None
        pairs.append(f"{name}={value}")
    return (FIELD_SEPARATOR.join(pairs) + "\n").encode()


@dataclass
class PreparedAttempt:
    """One launcher waiting for its job: its open ``sandbox`` (work directory and
    cgroup; no guard socket and no files yet), the ``launched`` process and the static
    environment it was started with (``env``)."""

    sandbox: Sandbox
    launched: Launched
    env: dict[str, str]
    program: str  # the tool's executable (absolute): checked at start, as exec would
    # exec_files(program) when the launcher was prepared: unchanged at start, or cold.
    files: tuple[tuple[str, Fingerprint], ...] = ()
    # mount_identities(plan.mounted_paths()) before bwrap mounted them: the same at
    # start, or cold (a secrets' directory replaced since must not show).
    mounts: MountIdentities = ()

    def line_for(self, env: dict[str, str]) -> bytes | None:
        """The job line that turns this launcher's environment into ``env`` (the
        variables that differ or are new); None when ``env`` lacks one of the static
        ones (a launcher can add, not remove) or the line cannot carry a value."""
        if any(name not in env for name in self.env):
            return None
        return job_line({k: v for k, v in env.items() if self.env.get(k) != v})

    def start(self, env: dict[str, str], payload: bytes, max_stdout: int,
              on_stderr_line: Callable[[bytes], None], cookie: dict[str, str]
              ) -> Child | None:
        """The job's Child: its line then ``payload`` on the launcher's stdin. None (the
        caller discards this attempt and starts cold) when the line cannot carry ``env``,
        the tool's executable or one of its interpreters changed since it was checked
        (``exec_files``; gone, replaced, rewritten, its mode changed), a path the
        sandbox mounts names something else now (``mounts_moved``), or the launcher is
        no longer running."""
        line = self.line_for(env)
        # A tool gone or changed since the launcher started: a cold start tells what execve
        # makes of it (spawn_failed 127, 126), where the shell's exec would not (exec_files).
        if line is None or not self._unchanged() or mounts_moved(self.mounts) \
                or not self.launched.alive():
            return None
        return Child.start(self.launched, line + payload, max_stdout, on_stderr_line, cookie)

    def _unchanged(self) -> bool:
        """True when every file of ``files`` still stats as it did (one ``stat`` each)."""
        if not self.files:
            return False
        for path, fingerprint in self.files:
            try:
                if _fingerprint(os.stat(path)) != fingerprint:
                    return False
            except OSError:
                return False
        return True


class Preparer:
    """Keeps up to ``size`` PreparedAttempts of one Worker ready (one per slot).

    ``make`` is an async callable that prepares one (opens a Sandbox, launches its
    launcher) or raises; ``discard`` kills one never used and removes its work directory
    and cgroup (blocking: run off the loop). ``take`` hands out a ready one (or None) and
    starts preparing its replacement; ``close`` discards every one left and prepares no
    more. A failure to prepare is logged (``prepare_failed``, once per reason until a
    prepare succeeds) and retried at the next ``take``; meanwhile attempts start cold.
    ``NotPreparable`` is logged once (``prepare_off``) and ends preparing: every attempt
    starts cold."""

    def __init__(self, size: int, make: Callable[[int], object],
                 discard: Callable[[PreparedAttempt], None]):
        self.size = size
        self._make = make
        self._discard = discard
        self._ready: list[PreparedAttempt] = []
        self._pending = 0
        self._closed = False
        self._serial = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self.failures = 0
        self._last_failure: str | None = None  # the reason last logged as prepare_failed

    def __len__(self) -> int:
        return len(self._ready)

    def fill(self) -> None:
        """Start preparing until ``size`` are ready or on their way (on the event loop)."""
        while not self._closed and len(self._ready) + self._pending < self.size:
            self._pending += 1
            task = asyncio.ensure_future(self._prepare_one(next(self._serial)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _prepare_one(self, serial: int) -> None:
        try:
            prepared = await self._make(serial)
        except NotPreparable as exc:
            if not self._closed:
                self._closed = True
                log.emit("prepare_off", "warning", reason=str(exc)[:300])
            return
        except Exception as exc:  # noqa: BLE001 - logged; attempts start cold meanwhile
            self.failures += 1
            reason = f"{type(exc).__name__}: {exc}"[:300]
            # Once per reason until a prepare succeeds: a lasting cause (a program only
            # binfmt_misc runs, a missing EXTRA_PATHS directory) is not a line per job.
            if reason != self._last_failure:
                self._last_failure = reason
                log.emit("prepare_failed", "warning", reason=reason,
                         failures=self.failures)
            return
        finally:
            self._pending -= 1
        if self._closed:
            await asyncio.get_running_loop().run_in_executor(None, self._discard, prepared)
            return
        self._ready.append(prepared)
        self._last_failure = None
        log.emit("attempt_prepared", "debug", pid=prepared.launched.popen.pid,
                 cgroup=prepared.sandbox.cgroup.name if prepared.sandbox.cgroup else None,
                 ready=len(self._ready))

    def take(self) -> PreparedAttempt | None:
        """A ready attempt (the caller owns it now), or None; its replacement is on its
        way. After a failure, preparing is tried again only at the next take."""
        prepared = self._ready.pop() if self._ready else None
        self.fill()
        return prepared

    async def close(self) -> None:
        """Prepare no more; wait for those on their way; discard every unused one."""
        self._closed = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        ready, self._ready = self._ready, []
        loop = asyncio.get_running_loop()
        for prepared in ready:
            with contextlib.suppress(Exception):
                await loop.run_in_executor(None, self._discard, prepared)


def unset_pwd_for(env: dict[str, str], sandboxed: bool) -> bool:
    """True when the launcher must drop the PWD its shell exports: unsandboxed, and the
    tool's environment would have none (bwrap sets PWD itself, as a cold start gives)."""
    return not sandboxed and "PWD" not in env


