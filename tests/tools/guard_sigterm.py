#!/usr/bin/env python3
"""Test tool: works "forever"; on SIGTERM (the sidecar stopping it, e.g. at the stage
deadline) it asks the guard (expecting 409 "deadline"), saves a checkpoint of its progress,
writes both answers to REPORT (JSON) and exits 1.

Payload: {"report": PATH, "readyfile": PATH}. The readyfile appears once the handler is
installed and one guard call succeeded.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from guard_client import GuardRefused, checkpoint, guard  # noqa: E402

payload = json.load(sys.stdin)
progress = {"pages": 0}


def on_term(_signum, _frame):
    report = {}
    try:
        report["guard"] = guard()
    except GuardRefused as exc:
        report["guard_refused"] = exc.reason
    report["checkpoint"] = checkpoint(progress)
    tmp = payload["report"] + ".tmp"
    Path(tmp).write_text(json.dumps(report))
    os.replace(tmp, payload["report"])
    sys.exit(1)


signal.signal(signal.SIGTERM, on_term)
report_first = guard(request_id="first-step")
Path(payload["readyfile"]).write_text(json.dumps(report_first))
while True:
    progress["pages"] += 1
    time.sleep(0.05)
