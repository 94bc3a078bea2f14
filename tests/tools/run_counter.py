#!/usr/bin/env python3
"""Test tool (case F16): appends its fencing token to LOG (one line per run), then exits
with EXIT (default 0), printing {"ok": true} when it is 0.

Payload: {"log": PATH, "exit": CODE}.
"""
import json
import os
import sys

payload = json.load(sys.stdin)
with open(payload["log"], "a") as f:
    f.write(os.environ["SIDECAR_FENCING_TOKEN"] + "\n")
code = int(payload.get("exit", 0))
if code == 0:
    print(json.dumps({"ok": True}))
sys.exit(code)
