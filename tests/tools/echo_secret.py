#!/usr/bin/env python3
"""Test tool: echoes what it reads, as leptonica does with a "file name" that is a mounted
Secret (issue 25), for tests/test_secret_scrub.py.

stdin: ``{"file": PATH}`` (the text is the file's content, stripped) or ``{"env": NAME}``
(the text is that variable, e.g. SIDECAR_GUARD_TOKEN), and ``"to"``:

- ``"stderr"`` (default): writes ``echo_secret: cannot open <text>`` and ``token=<text>``
  lines to stderr, then ``pad`` bytes of ``x`` (default 0) and a newline, and exits
  ``exit`` (default 1);
- ``"result"``: prints ``{"text": <text>}`` and exits 0;
- ``"next"``: prints ``{"result": {"ok": true}, "next": {"tool": "echo_secret.py",
  "payload": {"text": <text>}}}`` and exits 0;
- ``"checkpoint"``: POSTs ``{"text": <text>}`` to the guard's checkpoint API and prints
  ``{"status": S, "answer": A}`` (the guard's status and JSON answer), exits 0.
"""
import json
import os
import sys
import urllib.error
import urllib.request

payload = json.load(sys.stdin)
if "file" in payload:
    with open(payload["file"], encoding="utf-8") as f:
        text = f.read().strip()
else:
    text = os.environ[payload["env"]]
to = payload.get("to", "stderr")
if to == "stderr":
    sys.stderr.write(f"echo_secret: cannot open {text}\ntoken={text}\n")
    sys.stderr.write("x" * int(payload.get("pad", 0)) + "\n")
    sys.stderr.flush()
    sys.exit(int(payload.get("exit", 1)))
if to == "result":
    json.dump({"text": text}, sys.stdout)
elif to == "next":
    json.dump({"result": {"ok": True},
               "next": {"tool": "echo_secret.py", "payload": {"text": text}}}, sys.stdout)
elif to == "checkpoint":
    request = urllib.request.Request(
        os.environ["SIDECAR_GUARD_URL"] + "/v1/checkpoint",
        data=json.dumps({"text": text}).encode(), method="POST",
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"],
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    json.dump({"status": status, "answer": json.loads(body)}, sys.stdout)
