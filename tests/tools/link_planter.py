#!/usr/bin/env python3
"""Test tool for case F15 (tests/test_link_safety.py), run as a RUN_AS user beside a
sibling attempt of the same user. The payload's "mode":

- plant: until the file "stop" exists (or "max_wait" s), put a symlink named
  "checkpoint.json" to "target" into every other work directory of the work root it
  can write; prints {"planted": <links made>}.
- resume: a retried job with a checkpoint: below attempt "attempts" save {"attempt": N}
  through the guard and exit 3 (retried); at attempt "attempts" touch "stop" and print
  {"resumed_from": <the checkpoint file's JSON>}.
- victim: write {"real": true} to SIDECAR_RESULT_FILE, touch "ready", wait until
  "swapped" exists, exit 0.
- swap: wait until "ready" exists, rename the other work directory that holds a
  result.json to "<name>.moved" (the work root must be writable by this user) and put a
  symlink to "outside" under its name; touch "swapped"; print {"swapped": <name>}.
"""
import json
import os
import sys
import time
import urllib.request

payload = json.load(sys.stdin)
mode = payload["mode"]
own = os.environ["SIDECAR_JOB_DIR"]
root = os.path.dirname(own)


def others():
    return [os.path.join(root, n) for n in os.listdir(root)
            if os.path.join(root, n) != own and not n.startswith(".")]


def wait_for(path, limit):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.005)


if mode == "plant":
    planted = 0
    deadline = time.monotonic() + payload.get("max_wait", 60)
    while not os.path.exists(payload["stop"]) and time.monotonic() < deadline:
        for path in others():
            try:
                os.symlink(payload["target"], os.path.join(path, "checkpoint.json"))
                planted += 1
            except OSError:
                pass
    print(json.dumps({"planted": planted}))
elif mode == "resume":
    attempt = int(os.environ["SIDECAR_ATTEMPT"])
    if attempt >= payload["attempts"]:
        with open(os.environ["SIDECAR_CHECKPOINT_FILE"]) as f:
            resumed = json.load(f)
        open(payload["stop"], "w").close()
        print(json.dumps({"resumed_from": resumed}))
        sys.exit(0)
    request = urllib.request.Request(
        os.environ["SIDECAR_GUARD_URL"] + "/v1/checkpoint", method="POST",
        data=json.dumps({"attempt": attempt}).encode(),
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"],
                 "Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10):
        pass
    sys.exit(3)
elif mode == "victim":
    with open(os.environ["SIDECAR_RESULT_FILE"], "w") as f:
        f.write('{"real": true}')
    open(payload["ready"], "w").close()
    wait_for(payload["swapped"], 60)
elif mode == "swap":
    wait_for(payload["ready"], 60)
    [victim] = [p for p in others()
                if not p.endswith(".moved") and os.path.exists(os.path.join(p, "result.json"))]
    os.rename(victim, victim + ".moved")
    os.symlink(payload["outside"], victim)
    open(payload["swapped"], "w").close()
    print(json.dumps({"swapped": os.path.basename(victim)}))
else:
    sys.exit(f"unknown mode {mode}")
