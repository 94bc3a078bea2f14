#!/usr/bin/env python3
"""Test tool for tests/test_isolation_breakers.py: attacks its own sandbox as the payload's
"mode" says.

Modes:
- vanish: remove its own work directory, then print a result.
- swap_link: move its work directory to payload "stash" and put a symlink to payload
  "target" in its place.
- swap_fifo: remove its work directory and put a FIFO in its place.
- inner_links: leave symlinks to payload "target" inside its work directory (one replacing
  a subdirectory, one inside a read-only subdirectory).
- escape: start a descendant that leaves the tree (double fork, setsid, exec with an empty
  environment, stdio on /dev/null), write its pid to payload "pidfile", print a result.
  With "hang", the tool then sleeps; with "once", only the first attempt does any of it.
  The escapee sleeps payload "sleep" seconds, or with "truncate" set: writes a result file
  of payload "size" bytes (a JSON array of many small numbers, slow to parse) first, keeps
  it open read-write, and truncates it to 0 bytes 5 ms after somebody else opens it
  (inotify IN_OPEN: the sidecar about to map the result).
- victim / attacker: two jobs of the same tool running at once (RUN_AS, one uid). The
  victim writes a result file of "size" bytes, marks its directory "ready" and waits for
  "armed"; the attacker finds the victim's result file, watches it, writes "armed" and
  truncates the file when the sidecar opens it.
- threads: start payload "n" threads in one process (exit 3 when refused).
- cpu_workers: run payload "workers" child processes one after another, each burning
  payload "each" seconds of CPU time, then print a result.
- count_forks: fork up to payload "n" children that wait on a pipe; print how many forks
  succeeded (the children exit when the pipe closes).
- result_text: write payload "text" to SIDECAR_RESULT_FILE (relative to nothing: the path
  exactly as given), print payload "stdout" (default nothing).
- result_kind: make SIDECAR_RESULT_FILE a "fifo", a "dir" or an "empty" file.
- hang_first: sleep on the first attempt, succeed on the later ones.
- cgroup_escape: try to move itself into the root cgroup of every hierarchy it is in;
  print what succeeded.
"""
import ctypes
import json
import os
import shutil
import sys
import time

payload = json.load(sys.stdin)
mode = payload["mode"]
job_dir = os.environ["SIDECAR_JOB_DIR"]
result_file = os.environ["SIDECAR_RESULT_FILE"]

IN_OPEN = 0x20
_ESCAPEE = r"""
import ctypes, os, sys, time
args = sys.argv[1:]
pidfile, seconds, path = args[0], float(args[1]), args[2]
if path:
    size = int(args[3])
    with open(path, "w") as f:  # slow to parse: many small values
        f.write("[" + "1," * ((size - 2) // 2) + "1]")
    fd = os.open(path, os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    ifd = libc.inotify_init1(0)
    libc.inotify_add_watch(ifd, path.encode(), 0x20)
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
if path:
    os.read(ifd, 4096)  # somebody opened the result file: the sidecar, about to map it
    time.sleep(0.005)  # it has checked the size and mapped the file: now cut it short
    os.ftruncate(fd, 0)
    time.sleep(2)
else:
    time.sleep(seconds)
"""


def result(value) -> None:
    sys.stdout.write(json.dumps(value))
    sys.stdout.flush()


def watch_and_truncate(path: str, armed: str) -> None:
    fd = os.open(path, os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    ifd = libc.inotify_init1(0)
    if libc.inotify_add_watch(ifd, path.encode(), IN_OPEN) < 0:
        raise OSError(ctypes.get_errno(), "inotify_add_watch")
    with open(armed, "w"):
        pass
    os.read(ifd, 4096)
    time.sleep(0.005)
    os.ftruncate(fd, 0)


def write_blob(path: str, size: int) -> None:
    with open(path, "w") as f:  # slow to parse: many small values
        f.write("[" + "1," * ((size - 2) // 2) + "1]")


if mode == "vanish":
    os.chdir("/")
    shutil.rmtree(job_dir)
    result({"vanished": job_dir})

elif mode == "swap_link":
    os.chdir("/")
    os.rename(job_dir, payload["stash"])
    os.symlink(payload["target"], job_dir)
    result({"swapped": job_dir})

elif mode == "swap_fifo":
    os.chdir("/")
    shutil.rmtree(job_dir)
    os.mkfifo(job_dir)
    result({"fifo": job_dir})

elif mode == "inner_links":
    target = payload["target"]
    os.mkdir(os.path.join(job_dir, "sub"))
    os.rmdir(os.path.join(job_dir, "sub"))
    os.symlink(target, os.path.join(job_dir, "sub"))
    locked = os.path.join(job_dir, "locked")
    os.makedirs(os.path.join(locked, "inner"))
    os.symlink(target, os.path.join(locked, "inner", "out"))
    os.symlink(os.path.join(target, "keep.txt"), os.path.join(locked, "file"))
    os.chmod(os.path.join(locked, "inner"), 0o500)
    os.chmod(locked, 0o500)
    result({"links": 3})

elif mode == "escape" and payload.get("once") and os.environ["SIDECAR_ATTEMPT"] != "1":
    result({"escaped": False})

elif mode == "escape":
    pidfile = payload["pidfile"]
    truncate = result_file if payload.get("truncate") else ""
    argv = [sys.executable, "-c", _ESCAPEE, pidfile, str(payload.get("sleep", 30)), truncate,
            str(payload.get("size", 0))]
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execve(sys.executable, argv, {})
        os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(pidfile) and time.monotonic() < deadline:
        time.sleep(0.01)
    if payload.get("hang"):
        time.sleep(60)
    result({"escaped": True})

elif mode == "victim":
    write_blob(result_file, payload["size"])
    with open(os.path.join(job_dir, "ready"), "w"):
        pass
    deadline = time.monotonic() + 15
    while not os.path.exists(os.path.join(job_dir, "armed")) and time.monotonic() < deadline:
        time.sleep(0.01)
    result({"victim": True})

elif mode == "attacker":
    root = os.path.dirname(job_dir)
    deadline = time.monotonic() + 15
    victim = None
    while victim is None and time.monotonic() < deadline:
        for name in os.listdir(root):
            other = os.path.join(root, name)
            if other != job_dir and os.path.exists(os.path.join(other, "ready")):
                victim = other
        time.sleep(0.01)
    if victim is None:
        sys.exit("no victim found")
    watch_and_truncate(os.path.join(victim, "result.json"), os.path.join(victim, "armed"))
    result({"attacked": victim})

elif mode == "cpu_workers":
    for _ in range(payload["workers"]):
        pid = os.fork()
        if pid == 0:
            while time.process_time() < payload["each"]:
                pass
            os._exit(0)
        os.waitpid(pid, 0)
    result({"workers": payload["workers"]})

elif mode == "count_forks":
    r, w = os.pipe()
    forked, pids = 0, []
    for _ in range(payload["n"]):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        pids.append(pid)
        forked += 1
    os.close(w)
    for pid in pids:
        os.waitpid(pid, 0)
    result({"forked": forked})

elif mode == "threads":
    import threading

    stop = threading.Event()
    started = 0
    try:
        for _ in range(payload["n"]):
            threading.Thread(target=stop.wait, daemon=True).start()
            started += 1
    except RuntimeError as exc:
        result({"threads": started, "error": str(exc)})
        sys.exit(3)
    stop.set()
    result({"threads": started})

elif mode == "result_text":
    with open(result_file, "w") as f:
        f.write(payload["text"])
    sys.stdout.write(payload.get("stdout", ""))

elif mode == "result_kind":
    kind = payload["kind"]
    if kind == "fifo":
        os.mkfifo(result_file)
    elif kind == "dir":
        os.mkdir(result_file)
    elif kind == "empty":
        open(result_file, "w").close()
    result({"from": "stdout"})

elif mode == "hang_first":
    if os.environ["SIDECAR_ATTEMPT"] == "1":
        with open(payload["pidfile"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    result({"attempt": int(os.environ["SIDECAR_ATTEMPT"])})

elif mode == "cgroup_escape":
    moved = {}
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids"):
        try:
            with open(os.path.join(base, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            moved[base] = "moved"
        except OSError as exc:
            moved[base] = exc.strerror
    with open("/proc/self/cgroup") as f:
        result({"moved": moved, "cgroup": f.read()})
