#!/usr/bin/env python3
"""Test tool: fills the process table it may use, then waits (case F19).

Payload {"fill": {"ready": PATH, "release": PATH}}: fork children (each only sleeps)
until fork fails with EAGAIN, write how many to READY, wait until RELEASE exists, then
kill and reap its own children (by the pids fork returned) and print {"forked": N}.
Any other payload: print {"ok": true} at once.
"""
import json
import os
import signal
import sys
import time


def main():
    payload = json.load(sys.stdin)
    fill = payload.get("fill")
    if not fill:
        print(json.dumps({"ok": True}))
        return 0
    children = []
    while True:
        try:
            pid = os.fork()
        except BlockingIOError:  # EAGAIN: the pids limit is reached
            break
        if pid == 0:
            while True:
                time.sleep(3600)
        children.append(pid)
    with open(fill["ready"] + ".tmp", "w") as f:
        f.write(str(len(children)))
    os.rename(fill["ready"] + ".tmp", fill["ready"])
    while not os.path.exists(fill["release"]):
        time.sleep(0.05)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    print(json.dumps({"forked": len(children)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
