#!/usr/bin/env python3
"""Test tool for the lock and session-setting tests (cases F17, F18).

Payload: {"seconds": S, "runs": PATH, "bytes": N}. Appends one line (its pid and
SIDECAR_ATTEMPT) to RUNS, so a test counts how often it ran, sleeps S seconds, then prints
the result {"pad": "x" * N} (N bytes of padding: a large result when asked).
"""
import json
import os
import sys
import time


def main():
    payload = json.load(sys.stdin)
    with open(payload["runs"], "a") as runs:
        runs.write(f"{os.getpid()} {os.environ.get('SIDECAR_ATTEMPT')}\n")
    time.sleep(float(payload.get("seconds", 0)))
    sys.stdout.write(json.dumps({"pad": "x" * int(payload.get("bytes", 0))}))


if __name__ == "__main__":
    main()
