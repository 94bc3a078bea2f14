#!/usr/bin/env python3
"""Test tool that asks to run again later (issue 44, point 3). Each run counts itself in
its checkpoint; while fewer than ``snoozes`` runs came before it, it saves the count and
snoozes ``delay`` seconds, through the guard (examples/guard_client.py snooze, then it
prints a result that must not be kept) or, with ``"via": "exit"``, by exiting with
``exit_code``. Then it prints ``{"runs": N, "attempt": SIDECAR_ATTEMPT}``.

Payload: {"snoozes": N, "delay": S, "via": "guard" | "exit", "exit_code": C}."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from guard_client import checkpoint, snooze  # noqa: E402

payload = json.load(sys.stdin)
if "probe" in payload:  # hostile bodies: print the guard's status for each, then exit 0
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    statuses = []
    for body in payload["probe"]:
        request = urllib.request.Request(
            os.environ["SIDECAR_GUARD_URL"] + "/v1/snooze", data=body.encode(), method="POST",
            headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"]})
        try:
            with opener.open(request, timeout=10) as answer:
                statuses.append(answer.status)
        except urllib.error.HTTPError as refused:
            statuses.append(refused.code)
    print(json.dumps({"statuses": statuses}))
    sys.exit(0)
runs = 0
if os.environ.get("SIDECAR_CHECKPOINT_FILE"):
    runs = json.loads(Path(os.environ["SIDECAR_CHECKPOINT_FILE"]).read_text())["runs"]
runs += 1
if runs <= payload["snoozes"]:
    checkpoint({"runs": runs})
    if payload.get("via") == "exit":
        sys.exit(payload["exit_code"])
    snooze(payload["delay"], f"run {runs} of {payload['snoozes'] + 1}")
    print(json.dumps({"must_not_be_kept": runs}))
    sys.exit(0)
print(json.dumps({"runs": runs, "attempt": int(os.environ["SIDECAR_ATTEMPT"])}))
