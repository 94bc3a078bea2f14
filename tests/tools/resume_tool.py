#!/usr/bin/env python3
"""Test tool that resumes from its checkpoint: attempt 1 saves {"page": 7} through the
guard API and fails (exit 3, retryable); the next attempt reads SIDECAR_CHECKPOINT_FILE
and prints {"resumed_from": <checkpoint>, "attempt": N}."""
import json
import os
import sys

from tool_checkpoint import save_checkpoint

json.load(sys.stdin)
path = os.environ.get("SIDECAR_CHECKPOINT_FILE")
if path:
    with open(path) as f:
        print(json.dumps({"resumed_from": json.load(f),
                          "attempt": int(os.environ["SIDECAR_ATTEMPT"])}))
    sys.exit(0)
save_checkpoint(json.dumps({"page": 7}).encode())
sys.exit(3)
