#!/usr/bin/env python3
"""Test tool for stages and watchdogs. Payload {"mode": ...}:
- "first": prints {"result": {"fetched": N}, "next": {"tool": NEXT, "payload": {...}}}
- "last": prints {"got": <payload>}
- "idle": sleeps forever, doing nothing
- "busy": spins the CPU for "seconds", printing nothing, then {"spun": true}
"""
import json
import sys
import time

payload = json.load(sys.stdin)
mode = payload["mode"]
if mode == "first":
    print(json.dumps({"result": {"fetched": 3},
                      "next": {"tool": payload["next"], "payload": {"mode": "last", "n": 3}}}))
elif mode == "last":
    print(json.dumps({"got": payload}))
elif mode == "idle":
    time.sleep(3600)
elif mode == "busy":
    end = time.monotonic() + payload["seconds"]
    while time.monotonic() < end:
        sum(range(10000))
    print(json.dumps({"spun": True}))
