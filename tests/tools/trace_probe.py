#!/usr/bin/env python3
"""Test tool (issue 30): reports the trace context it was given.

Payload {"mode": "fail_first"}: the first attempt exits 3 (retryable), a later one prints
{"attempt": N, "traceparent": TRACEPARENT}. {"mode": "hang"}: sleeps until killed (at most
MAX_WAIT seconds, then exits 9). {"mode": "ok"}: prints as a later attempt does.
"""
import json
import os
import sys
import time

payload = json.load(sys.stdin)
mode = payload.get("mode", "ok")
attempt = int(os.environ["SIDECAR_ATTEMPT"])
if mode == "fail_first" and attempt == 1:
    print("trace_probe: failing the first attempt on purpose", file=sys.stderr)
    sys.exit(3)
if mode == "hang":
    deadline = time.monotonic() + float(payload.get("max_wait", 60))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(9)
print(json.dumps({"attempt": attempt, "traceparent": os.environ.get("TRACEPARENT"),
                  "tracestate": os.environ.get("TRACESTATE")}))
