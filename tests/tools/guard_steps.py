#!/usr/bin/env python3
"""Test tool: asks the guard before its "irreversible" step and checkpoints, with the
stdlib client in examples/guard_client.py. Prints what it got:

    {"guard": ANSWER | null, "checkpoint": ANSWER | null, "previous_checkpoint": JSON | null,
     "token": SIDECAR_FENCING_TOKEN}

``guard`` is null when the sidecar gave it no guard (SIDECAR_GUARD_URL unset).
Payload: {"step": NAME}.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from guard_client import checkpoint, guard  # noqa: E402

payload = json.load(sys.stdin)
previous = None
if os.environ.get("SIDECAR_CHECKPOINT_FILE"):
    previous = json.loads(Path(os.environ["SIDECAR_CHECKPOINT_FILE"]).read_text())
out = {"guard": None, "checkpoint": None, "previous_checkpoint": previous,
       "token": int(os.environ["SIDECAR_FENCING_TOKEN"])}
if os.environ.get("SIDECAR_GUARD_URL"):
    key = os.environ["SIDECAR_IDEMPOTENCY_KEY"]
    out["guard"] = guard(request_id=f"{key}:{payload['step']}", retry_seconds=5)
    out["checkpoint"] = checkpoint({"done": payload["step"]})
print(json.dumps(out))
