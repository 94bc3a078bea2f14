#!/usr/bin/env python3
"""Test tool for the database-fault tests: a healthy tool that takes its time.

Payload: {"seconds": S, "pidfile": PATH, "grandchild": bool}.
It starts a grandchild (`sleep`) when asked, writes its own pid and the grandchild's to
PIDFILE (one per line, written atomically), sleeps S seconds, stops its grandchild, and
prints {"ok": true, "pid", "token", "attempt"}. It does not ignore SIGTERM: a tree kill
ends it at once.
"""
import json
import os
import subprocess
import sys
import time


def main():
    payload = json.load(sys.stdin)
    pids = [os.getpid()]
    grandchild = None
    if payload.get("grandchild"):
        grandchild = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids.append(grandchild.pid)
    pidfile = payload.get("pidfile")
    if pidfile:
        tmp = f"{pidfile}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(str(p) for p in pids) + "\n")
        os.replace(tmp, pidfile)
    time.sleep(float(payload.get("seconds", 1)))
    if grandchild is not None:
        grandchild.kill()
        grandchild.wait()
    print(json.dumps({"ok": True, "pid": os.getpid(),
                      "token": int(os.environ["SIDECAR_FENCING_TOKEN"]),
                      "attempt": int(os.environ["SIDECAR_ATTEMPT"])}))


main()
