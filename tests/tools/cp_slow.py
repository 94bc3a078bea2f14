#!/usr/bin/env python3
"""Test tool: a well-behaved slower tool. Reads its payload, writes its pid to PIDFILE,
waits until GOFILE exists (at most MAX_WAIT seconds, then exits 9), prints a result.

Payload: {"pidfile": PATH, "gofile": PATH, "max_wait": SECONDS}.
"""
import json
import os
import sys
import time


def main():
    payload = json.load(sys.stdin)
    with open(payload["pidfile"], "w") as f:
        f.write(f"{os.getpid()}\n")
    deadline = time.monotonic() + float(payload.get("max_wait", 30))
    while not os.path.exists(payload["gofile"]):
        if time.monotonic() > deadline:
            print("cp_slow: gofile never appeared", file=sys.stderr)
            sys.exit(9)
        time.sleep(0.05)
    print(json.dumps({"ok": True, "pid": os.getpid()}))


main()
