#!/usr/bin/env python3
"""Recipe: headless Chromium as a sidecar tool (README "Recipes").

Payload: {"url": "https://..."}; result: {"url": URL, "dom": SERIALIZED_DOM}.
Chromium keeps its profile in the attempt's private HOME (the default HOME=job), so jobs
running side by side never share one. A crashed or killed browser fails the job: a
non-zero exit is passed on, and an empty DOM is an error, never a result.

Only http and https URLs are loaded: a payload that names file:///etc/sidecar/db/url
would otherwise get the mounted database Secret back as its DOM. Allowed explicitly,
through the profile's passthrough (chromium.env): file URLs under CHROMIUM_FILE_ROOT, and
the schemes CHROMIUM_EXTRA_SCHEMES lists (comma-separated; never file).

A payload of the wrong shape or a URL not allowed exits 65 with one line (bad input,
never retried); a CHROMIUM_FILE_ROOT that is not absolute exits 78.
"""
import json
import os
import subprocess
import sys

# The allow rules and Chromium's flags, shared with chromium_warm.py (this directory).
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from recipe_input import (  # noqa: E402
    CHROMIUM,
    CHROMIUM_FLAGS,
    BadPayload,
    BadSetting,
    allowed_url,
    checked_fields,
)

EXAMPLE = '{"url": "https://example.org/"}'


def bad(why: str):
    """Bad input, not a failure worth a retry: one line on stderr and exit 65 (EX_DATAERR,
    non-retryable in the default profile), never a traceback."""
    print(f"bad payload: {why}; expected e.g. {EXAMPLE}", file=sys.stderr)
    sys.exit(65)


def read_payload(fields: dict) -> dict:
    """The payload on stdin: a JSON object whose fields (name -> (type, required)) have
    those types; anything else is bad()."""
    try:
        return checked_fields(json.load(sys.stdin), fields)
    except ValueError as exc:  # not JSON, or BadPayload
        bad(str(exc) if isinstance(exc, BadPayload) else f"not JSON ({exc})")


url = read_payload({"url": (str, True)})["url"]
try:
    load = allowed_url(url)
except BadPayload as exc:
    bad(str(exc))
except BadSetting as exc:
    print(exc, file=sys.stderr)
    sys.exit(78)
profile = os.path.join(os.environ.get("HOME") or os.environ["SIDECAR_JOB_DIR"], "chromium")
done = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                       load], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"chromium exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
dom = done.stdout.decode("utf-8", "replace").strip()
if not dom:
    print("chromium printed no DOM (crashed renderer?)", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"url": url, "dom": dom}))
