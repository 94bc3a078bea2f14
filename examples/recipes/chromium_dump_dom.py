#!/usr/bin/env python3
"""Recipe: headless Chromium as a sidecar tool (README "Recipes").

Payload: {"url": "https://... or file:///..."}; result: {"url": URL, "dom": SERIALIZED_DOM}.
Chromium keeps its profile in the attempt's private HOME (the default HOME=job), so jobs
running side by side never share one. A crashed or killed browser fails the job: a
non-zero exit is passed on, and an empty DOM is an error, never a result.

A payload of the wrong shape exits 65 with one line (bad input, never retried).
"""
import json
import os
import subprocess
import sys


def read_payload(fields: dict, example: str) -> dict:
    """The payload on stdin: a JSON object whose fields (name -> (type, required)) have
    those types. Anything else is bad input, not a failure worth a retry: one line on
    stderr and exit 65 (EX_DATAERR, non-retryable in the default profile)."""
    def bad(why: str):
        print(f"bad payload: {why}; expected e.g. {example}", file=sys.stderr)
        sys.exit(65)
    try:
        payload = json.load(sys.stdin)
    except ValueError as exc:
        bad(f"not JSON ({exc})")
    if not isinstance(payload, dict):
        bad(f"a JSON object is needed, not {type(payload).__name__}")
    for name, (kind, required) in fields.items():
        if name not in payload:
            if required:
                bad(f"{name!r} is missing")
            continue
        value = payload[name]
        if not isinstance(value, kind) or isinstance(value, bool) or value in ("", None):
            bad(f"{name!r} must be a non-empty {kind.__name__}, not {json.dumps(value)[:40]}")
    return payload


CHROMIUM = os.environ.get("CHROMIUM", "chromium")
# Without the background-networking flags Chromium dials out at every start; a pod with a
# closed network then waits on refused connections.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions"]

url = read_payload({"url": (str, True)}, '{"url": "https://example.org/"}')["url"]
profile = os.path.join(os.environ.get("HOME") or os.environ["SIDECAR_JOB_DIR"], "chromium")
done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"chromium exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
dom = done.stdout.decode("utf-8", "replace").strip()
if not dom:
    print("chromium printed no DOM (crashed renderer?)", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"url": url, "dom": dom}))
