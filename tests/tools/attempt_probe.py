#!/usr/bin/env python3
"""Test tool (case F14): one attempt that says who it is. Appends "start TOKEN PID" to
LOG, runs until ENDFILE.TOKEN exists (at most MAX_WAIT seconds, then exits 9), appends
"end TOKEN" and prints {"token": TOKEN}. SIGTERM is not handled: the default ends it.

Payload: {"log": PATH, "endfile": PATH_PREFIX, "max_wait": SECONDS}.
"""
import json
import os
import sys
import time


def main():
    payload = json.load(sys.stdin)
    token = os.environ["SIDECAR_FENCING_TOKEN"]
    with open(payload["log"], "a") as f:
        f.write(f"start {token} {os.getpid()}\n")
    deadline = time.monotonic() + float(payload.get("max_wait", 30))
    endfile = f"{payload['endfile']}.{token}"
    while not os.path.exists(endfile) and not os.path.exists(payload["endfile"] + ".all"):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.02)
    with open(payload["log"], "a") as f:
        f.write(f"end {token}\n")
    print(json.dumps({"token": int(token)}))


main()
