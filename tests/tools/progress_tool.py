#!/usr/bin/env python3
"""A tool for the waiting and progress tests: runs the steps of its payload in order, then
prints {"done": true, "statuses": [...]} (the HTTP status of each progress report) and
exits with "exit" (default 0).

Steps: {"http": {"progress": P, "message": M}} posts a report to the guard;
{"file": {...}} rewrites $SIDECAR_PROGRESS_FILE; {"sleep": S}; {"wait_for": PATH} sleeps
until PATH exists; {"fail_in_attempt": N} exits 3 (retryable) in attempt N. "info": PATH
first writes the guard's URL and token and the progress file's path there as JSON (for a
test that reports on the tool's behalf)."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

payload = json.load(sys.stdin)
if payload.get("info"):
    info = {"url": os.environ.get("SIDECAR_GUARD_URL"),
            "token": os.environ.get("SIDECAR_GUARD_TOKEN"),
            "file": os.environ.get("SIDECAR_PROGRESS_FILE")}
    with open(payload["info"] + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(payload["info"] + ".tmp", payload["info"])
statuses = []
for step in payload.get("steps", []):
    if "http" in step:
        request = urllib.request.Request(
            os.environ["SIDECAR_GUARD_URL"] + "/v1/progress",
            data=json.dumps(step["http"]).encode(), method="POST",
            headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"]})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
    elif "file" in step:
        path = os.environ["SIDECAR_PROGRESS_FILE"]
        with open(path + ".tmp", "w") as f:
            json.dump(step["file"], f)
        os.rename(path + ".tmp", path)
    elif "sleep" in step:
        time.sleep(step["sleep"])
    elif "fail_in_attempt" in step:
        if os.environ.get("SIDECAR_ATTEMPT") == str(step["fail_in_attempt"]):
            sys.exit(3)
    elif "wait_for" in step:
        while not os.path.exists(step["wait_for"]):
            time.sleep(0.05)
print(json.dumps({"done": True, "statuses": statuses}))
sys.exit(payload.get("exit", 0))
