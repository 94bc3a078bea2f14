#!/usr/bin/env python3
"""Test tool: misbehaves as the payload's "mode" says (docs/isolation.md).

Modes: memory_hog (allocate and touch 8 MiB chunks forever), fork_bomb (every process forks
until refused; the first one exits 3 after 2 s), cpu_spin (burn CPU in "procs" processes),
fd_leak (open /dev/null until refused, print how many), inspect (print what the tool can
see: environment, fds, cwd, ids, rlimits, umask, its guard socket's owner and mode),
result_file (write "size" bytes of JSON to SIDECAR_RESULT_FILE, junk to stdout),
result_symlink / result_hardlink (make SIDECAR_RESULT_FILE a link to the payload's
"target"), litter (leave files, a read-only directory and a TMPDIR file behind),
emit (write the payload's "stdout" bytes, given in hex, to stdout and "stderr" to stderr,
exit "code").
"""
import json
import os
import resource
import sys
import tempfile
import time

payload = json.load(sys.stdin)
mode = payload["mode"]

if mode == "memory_hog":
    chunks = []
    while True:
        chunk = bytearray(8 * 1024 * 1024)
        for i in range(0, len(chunk), 4096):  # touch every page: resident, not just reserved
            chunk[i] = 1
        chunks.append(chunk)

elif mode == "fork_bomb":
    first = os.getpid()
    started = time.monotonic()
    while True:
        if os.getpid() == first and time.monotonic() - started > 2:
            os._exit(3)
        try:
            os.fork()
        except OSError:
            time.sleep(0.05)

elif mode == "cpu_spin":
    for _ in range(payload.get("procs", 1) - 1):
        if os.fork() == 0:
            break
    while True:
        pass

elif mode == "fd_leak":
    fds = []
    try:
        while True:
            fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        print(json.dumps({"opened": len(fds), "errno": exc.errno}))

elif mode == "inspect":
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    # The listdir's own descriptor is closed by now.
    fds = [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/cgroup") as f:
        cgroup = f.read()
    guard_socket = None
    if os.environ.get("SIDECAR_GUARD_SOCKET"):  # its owner and mode, and whether it answers
        import socket
        info = os.lstat(os.environ["SIDECAR_GUARD_SOCKET"])
        guard_socket = {"uid": info.st_uid, "mode": oct(info.st_mode & 0o7777)}
        try:
            with socket.socket(socket.AF_UNIX) as probe:
                probe.connect(os.environ["SIDECAR_GUARD_SOCKET"])
            guard_socket["connect"] = "ok"
        except OSError as exc:
            guard_socket["connect"] = type(exc).__name__
    print(json.dumps({
        "guard_socket": guard_socket,
        # The guard token is a secret of the sidecar's: echoed in a result it fails the
        # attempt (secret_in_output, issue 25); its presence is what is reported.
        "env": {k: "(set)" if k == "SIDECAR_GUARD_TOKEN" else v for k, v in os.environ.items()},
        "fds": fds,
        "cwd": os.getcwd(),
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "core": resource.getrlimit(resource.RLIMIT_CORE),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "tmp": tempfile.gettempdir(),
        "cgroup": cgroup,
    }))

elif mode == "result_file":
    size = payload["size"]
    with open(os.environ["SIDECAR_RESULT_FILE"], "w") as f:
        f.write('{"blob": "')
        f.write("r" * size)
        f.write('"}')
    print("this stdout is ignored when the result file exists")

elif mode == "result_symlink":
    os.symlink(payload["target"], os.environ["SIDECAR_RESULT_FILE"])

elif mode == "result_hardlink":
    os.link(payload["target"], os.environ["SIDECAR_RESULT_FILE"])

elif mode == "litter":
    job_dir = os.environ["SIDECAR_JOB_DIR"]
    os.makedirs(os.path.join(job_dir, "deep", "er"))
    with open(os.path.join(job_dir, "deep", "er", "file"), "w") as f:
        f.write("x")
    os.chmod(os.path.join(job_dir, "deep"), 0o500)
    with tempfile.NamedTemporaryFile(delete=False) as f:
        tmp_file = f.name
    print(json.dumps({"job_dir": job_dir, "tmp_file": tmp_file, "cwd": os.getcwd()}))

elif mode == "emit":
    sys.stdout.buffer.write(bytes.fromhex(payload.get("stdout", "")))
    sys.stderr.buffer.write(bytes.fromhex(payload.get("stderr", "")))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(payload.get("code", 0))
