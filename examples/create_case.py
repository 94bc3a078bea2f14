#!/usr/bin/env python3
"""A tool that performs one irreversible side effect safely, in Python (stdlib only).

The sidecar gives every attempt SIDECAR_IDEMPOTENCY_KEY (stable across attempts) and
SIDECAR_FENCING_TOKEN (grows with every claim). Derive one key per operation from the
first, send the second as X-Execution-Fence: the receiver then replays a duplicate instead
of acting twice, and refuses a late request from an owner that lost the job.

    RECEIVER_URL=http://127.0.0.1:8900 SIDECAR_PROFILE_CREATE_CASE_ENV_PASSTHROUGH=PATH,RECEIVER_URL \
        sidecar run --tool create-case -- examples/create_case.py
    sidecar enqueue create-case --payload '{"customer": "c-1048", "summary": "check invoice"}'
"""
import json
import os
import sys
import urllib.error
import urllib.request

receiver = os.environ.get("RECEIVER_URL", "http://127.0.0.1:8900")
payload = json.load(sys.stdin)
request = urllib.request.Request(
    f"{receiver}/effects", method="POST", data=json.dumps(payload).encode(),
    headers={
        "Content-Type": "application/json",
        "Idempotency-Key": os.environ["SIDECAR_IDEMPOTENCY_KEY"] + ":create_case",
        "X-Execution-Fence": os.environ["SIDECAR_FENCING_TOKEN"],
    })
try:
    with urllib.request.urlopen(request, timeout=30) as response:
        print(json.dumps({"status": response.status, "receiver": json.load(response)}))
except urllib.error.HTTPError as exc:
    retryable = exc.code in (408, 429) or exc.code >= 500
    print(f"receiver answered {exc.code}: {exc.read()[:500]!r}", file=sys.stderr)
    sys.exit(75 if retryable else 65)  # 65 (EX_DATAERR) is non-retryable by default
except OSError as exc:
    print(f"receiver unreachable: {exc}", file=sys.stderr)
    sys.exit(75)  # retried with backoff
