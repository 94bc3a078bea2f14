#!/usr/bin/env python3
"""Test tool with one irreversible side effect, sent the way README tells tool authors to.

Payload: {"receiver": URL, "entity": E, "work": {"<attempt>": seconds},
"effect": bool or {"<attempt>": bool}, "marker_dir": DIR}.
It records that it started (DIR/started-<token>), works for the attempt's seconds, then
(when "effect") POSTs its effect to RECEIVER/effects with the stable per-operation key
$SIDECAR_IDEMPOTENCY_KEY:create_case, X-Execution-Fence set to its fencing token and
X-Fence-Entity E, and prints {"token": ..., "attempt": ..., "effect": answer}.
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

payload = json.load(sys.stdin)
token = os.environ["SIDECAR_FENCING_TOKEN"]
attempt = os.environ["SIDECAR_ATTEMPT"]
marker_dir = payload["marker_dir"]
with open(os.path.join(marker_dir, f"started-{token}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(float(payload["work"].get(attempt, 0)))
answer = None
effect = payload.get("effect", True)
if isinstance(effect, dict):
    effect = effect.get(attempt, True)
if effect:
    request = urllib.request.Request(
        payload["receiver"] + "/effects", method="POST",
        data=json.dumps({"case": payload["entity"], "by_token": int(token)}).encode(),
        headers={"Content-Type": "application/json",
                 "Idempotency-Key": os.environ["SIDECAR_IDEMPOTENCY_KEY"] + ":create_case",
                 "X-Execution-Fence": token,
                 "X-Fence-Entity": payload["entity"]})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = {"status": response.status, "body": json.load(response)}
    except urllib.error.HTTPError as exc:
        answer = {"status": exc.code, "body": json.load(exc)}
with open(os.path.join(marker_dir, f"finished-{token}"), "w") as f:
    f.write(json.dumps(answer))
print(json.dumps({"token": int(token), "attempt": int(attempt), "effect": answer}))
