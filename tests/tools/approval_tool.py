#!/usr/bin/env python3
"""Test tool that asks a person's yes before its "irreversible" step (issue 44, point 1):
POST /v1/approval with the payload's action and summary, then prints what the guard
answered and whether it took the step: {"status": S, "answer": {...}, "step_taken": bool,
"attempt": N}. It exits 0 whatever the answer (a denial must still fail the job).

Parked (a 202), it saves a checkpoint and exits; its next attempt, approved, finds
SIDECAR_APPROVAL and prints {"resumed": APPROVAL, "checkpoint": ..., "step_taken": true,
"attempt": N, "token": T}.

Payload: {"action": A, "summary": S} (default refund, "refund 40 EUR to c-1048"; other
fields are ignored) or {"probe": [BODY, ...]} (each sent as is; the
statuses printed: {"statuses": [...]})."""
import json
import os
import sys
import urllib.error
import urllib.request

opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        os.environ["SIDECAR_GUARD_URL"] + "/v1/approval", data=body, method="POST",
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"]})
    try:
        with opener.open(request, timeout=600) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read() or b"{}")


payload = json.load(sys.stdin)
if os.environ.get("SIDECAR_APPROVAL"):  # parked, approved: the step, with this attempt's token
    checkpoint = None
    if os.environ.get("SIDECAR_CHECKPOINT_FILE"):
        with open(os.environ["SIDECAR_CHECKPOINT_FILE"]) as f:
            checkpoint = json.load(f)
    print(json.dumps({"resumed": json.loads(os.environ["SIDECAR_APPROVAL"]),
                      "checkpoint": checkpoint, "step_taken": True,
                      "attempt": int(os.environ["SIDECAR_ATTEMPT"]),
                      "token": int(os.environ["SIDECAR_FENCING_TOKEN"])}))
    sys.exit(0)
if payload.get("via") == "file":  # a tool without HTTP: the request as a file, then exit
    with open(os.environ["SIDECAR_APPROVAL_REQUEST_FILE"], "w") as f:
        f.write(payload.get("raw") or json.dumps({"action": "refund",
                                                  "summary": "refund 40 EUR to c-1048"}))
    print(json.dumps({"asked_by_file": True}))
    sys.exit(0)
if "probe" in payload:
    print(json.dumps({"statuses": [post(body.encode())[0] for body in payload["probe"]]}))
    sys.exit(0)
status, answer = post(json.dumps({
    "action": payload.get("action", "refund"),
    "summary": payload.get("summary", "refund 40 EUR to c-1048"),
    "details": payload.get("details", {})}).encode())
if status == 202:  # parked: save what the next attempt needs, and exit
    request = urllib.request.Request(
        os.environ["SIDECAR_GUARD_URL"] + "/v1/checkpoint", method="POST",
        data=json.dumps({"asked": answer["request_id"]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"]})
    opener.open(request, timeout=30).read()
    print(json.dumps({"parked": answer}))
    sys.exit(0)
print(json.dumps({"status": status, "answer": answer,
                  "step_taken": status == 200 and answer.get("approved") is True,
                  "attempt": int(os.environ["SIDECAR_ATTEMPT"])}))
