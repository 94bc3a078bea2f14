#!/usr/bin/env python3
"""Test tool for tests/test_leftovers.py: what a (hostile) tool can do to the leftovers
sweep of sidecar.worker.leftovers, as the payload's "mode" says.

Modes:
- ok: print {"ok": true}.
- sleep: write its pid to payload "pidfile", sleep payload "seconds", print {"slept": n}.
- forge: find the owner keys of other sidecars' work directories in payload "scan" (a
  directory it may list) and create ``.owner-<key>.lock`` for each in payload "root" (a
  directory it may write, e.g. a sticky /tmp). Only keys found in "scan" are forged (the
  test's own sidecars: the host's other sidecars share the cgroup parents); "in_cgroups"
  says whether each was also visible as a sibling of its own job cgroup (world-readable).
  Prints {"forged": [...], "in_cgroups": [...], "uid": n}.
- replace_locks: remove every ``.owner-*.lock`` in payload "root" that is not its own
  sidecar's (a work root it may write, mode 0777 like an emptyDir) and, unless payload
  "replace" is false, put an empty file of its own in its place. Prints
  {"replaced": [...]} (the names it removed).
- sleep_tree: start a grandchild that leaves the tree (double fork, setsid; it keeps the
  environment), write the tool's and the grandchild's pids to payload "pidfile" (one a
  line), then sleep payload "seconds" (both do) and print {"slept": n}.
- linger_result: write payload "text" to SIDECAR_RESULT_FILE, start a child (same session,
  same environment) that ignores SIGTERM and sleeps payload "seconds", write that child's
  pid to payload "pidfile", exit 0 without printing anything.
"""
import json
import os
import re
import signal
import sys
import time

payload = json.load(sys.stdin)
mode = payload["mode"]
KEY = re.compile(r"^([0-9a-f]{12})\.j")


def own_key() -> str:
    return os.path.basename(os.environ["SIDECAR_JOB_DIR"])[:12]


def keys_in(directory: str) -> set[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    return {m.group(1) for m in map(KEY.match, names) if m}


if mode == "ok":
    print(json.dumps({"ok": True}))
elif mode == "sleep":
    with open(payload["pidfile"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(payload["seconds"]))
    print(json.dumps({"slept": payload["seconds"]}))
elif mode == "sleep_tree":
    seconds = float(payload["seconds"])
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.closerange(0, 3)
            os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(seconds)
            os._exit(0)
        os._exit(0)
    os.wait()
    grandchild = os.read(read_end, 64).decode().strip()
    with open(payload["pidfile"], "w") as f:
        f.write(f"{os.getpid()}\n{grandchild}\n")
    time.sleep(seconds)
    print(json.dumps({"slept": payload["seconds"]}))
elif mode == "forge":
    keys: set[str] = set()
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if "sidecar-jobs" not in path:
                continue
            parent = os.path.dirname(path)
            if controllers == "":
                keys |= keys_in("/sys/fs/cgroup/unified" + parent)
            for name in ("memory", "pids"):
                if name in controllers.split(","):
                    keys |= keys_in(f"/sys/fs/cgroup/{name}" + parent)
    targets = keys_in(payload["scan"]) - {own_key()}
    forged = []
    for key in sorted(targets):
        path = os.path.join(payload["root"], f".owner-{key}.lock")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            forged.append(key)
        except OSError as exc:
            print(f"{path}: {exc}", file=sys.stderr)
    print(json.dumps({"forged": forged, "in_cgroups": sorted(targets & keys),
                      "uid": os.getuid()}))
elif mode == "replace_locks":
    root = payload["root"]
    replaced = []
    for name in sorted(os.listdir(root)):
        if not (name.startswith(".owner-") and name.endswith(".lock")):
            continue
        if name[len(".owner-"):-len(".lock")] == own_key():
            continue
        path = os.path.join(root, name)
        os.unlink(path)
        if payload.get("replace", True):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        replaced.append(name)
    print(json.dumps({"replaced": replaced, "uid": os.getuid()}))
elif mode == "linger_result":
    with open(os.environ["SIDECAR_RESULT_FILE"], "w") as f:
        f.write(payload["text"])
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.closerange(0, 3)
        time.sleep(float(payload["seconds"]))
        os._exit(0)
    with open(payload["pidfile"], "w") as f:
        f.write(str(pid))
    sys.exit(0)
else:
    print(f"unknown mode {mode}", file=sys.stderr)
    sys.exit(2)
