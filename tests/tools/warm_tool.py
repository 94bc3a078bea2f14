#!/usr/bin/env python3
"""A warm tool (PROCESS=warm, docs/child-process.md): one request line per job on stdin,
one response line on stdout ({"job_id", "result"} or {"job_id", "error"}). It counts the
jobs it served, so a result shows whether the process (and its state) was kept.
Payload {"mode": ...}:
- "count" (default): {"pid": <its pid>, "served": n, "job_id": ..., "token": ...,
  "process": $SIDECAR_PROCESS_ID, "has_job_env": whether SIDECAR_JOB_ID is in its
  environment, "session": the request's session or null}
- "hang": never answers (the stage deadline kills it)
- "exit": exits with status 3 before answering
- "exit0": exits with status 0 before answering
- "error": answers with the error {"message": "refused", "exit_code": 65}
- "garbage": answers a line that is not JSON
- "chatty": writes an unasked line first, then answers
- "stranger": answers naming another job
- "child": starts a child that sleeps for ever (its pid in the result), then answers
- "checkpoint": answers {"checkpoint": <the request's checkpoint>}
- "flood": answers as "count", then, half a second later, unasked, writes 1 MB of lines
- "slow": appends a line to the file "mark", sleeps "seconds", then answers as "count"
- "read": reads the file "path": answers {"bytes": its size}, or the error
  {"message": "cannot read ...", "exit_code": 2}
"""
import json
import os
import subprocess
import sys
import time

served = 0
for line in sys.stdin:
    request = json.loads(line)
    served += 1
    mode = (request.get("payload") or {}).get("mode", "count")
    if mode == "hang":
        time.sleep(3600)
    elif mode == "slow":
        with open(request["payload"]["mark"], "a") as mark:
            mark.write(request["job_id"] + "\n")
        time.sleep(float(request["payload"]["seconds"]))
    elif mode == "exit":
        sys.exit(3)
    elif mode == "exit0":
        sys.exit(0)
    if mode == "error":
        answer = {"job_id": request["job_id"],
                  "error": {"message": "refused", "exit_code": 65}}
    elif mode == "garbage":
        sys.stdout.write("this is not json\n")
        sys.stdout.flush()
        continue
    elif mode == "checkpoint":
        answer = {"job_id": request["job_id"],
                  "result": {"checkpoint": request.get("checkpoint")}}
    elif mode == "read":
        try:
            with open(request["payload"]["path"], "rb") as f:
                answer = {"job_id": request["job_id"], "result": {"bytes": len(f.read())}}
        except OSError as exc:
            answer = {"job_id": request["job_id"],
                      "error": {"message": f"cannot read: {exc.strerror}", "exit_code": 2}}
    elif mode == "stranger":
        answer = {"job_id": "00000000-0000-0000-0000-000000000000", "result": {}}
    else:
        answer = {"pid": os.getpid(), "served": served, "job_id": request["job_id"],
                  "token": request["fencing_token"], "key": request["idempotency_key"],
                  "process": os.environ.get("SIDECAR_PROCESS_ID"),
                  "has_job_env": "SIDECAR_JOB_ID" in os.environ,
                  "session": request.get("session")}
        if mode == "child":
            answer["child"] = subprocess.Popen(["sleep", "3600"]).pid
        if mode == "chatty":
            sys.stdout.write('{"unasked": true}\n')
        answer = {"job_id": request["job_id"], "result": answer}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    if mode == "flood":
        time.sleep(0.5)
        for _ in range(1000):
            sys.stdout.write('{"unasked": "' + "x" * 1000 + '"}\n')
        sys.stdout.flush()
