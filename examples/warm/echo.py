#!/usr/bin/env python3
"""A warm tool (PROCESS=warm, docs/child-process.md "Warm mode"): one request line per job
on stdin, one response line per job on stdout, naming the job it answers."""
import json
import sys

for line in sys.stdin:                      # one request per line
    request = json.loads(line)
    answer = {"job_id": request["job_id"], "result": {"echo": request["payload"]}}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()                      # the answer must leave now
