#!/usr/bin/env python3
"""Test tool that resumes from its checkpoint: attempt 1 saves {"page": 7} through the
guard API and fails (exit 3, retryable); the next attempt reads SIDECAR_CHECKPOINT_FILE
and prints {"resumed_from": <checkpoint>, "attempt": N}."""
import json
import os
import sys
import urllib.request

json.load(sys.stdin)
path = os.environ.get("SIDECAR_CHECKPOINT_FILE")
if path:
    with open(path) as f:
        print(json.dumps({"resumed_from": json.load(f),
                          "attempt": int(os.environ["SIDECAR_ATTEMPT"])}))
    sys.exit(0)
request = urllib.request.Request(
    os.environ["SIDECAR_GUARD_URL"] + "/v1/checkpoint", method="POST",
    data=json.dumps({"page": 7}).encode(),
    headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"],
             "Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(request, timeout=10) as response:
    print(f"checkpoint saved: {response.status}", file=sys.stderr)
sys.exit(3)
