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
import pathlib
import subprocess
import sys
import urllib.parse

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



def allowed_url(url: str) -> str:
    """The URL Chromium may load, or bad(): http(s) with a host; file under
    CHROMIUM_FILE_ROOT (symlinks resolved); a scheme of CHROMIUM_EXTRA_SCHEMES."""
    if any(ord(c) <= 0x20 or ord(c) == 0x7f for c in url):
        bad(f"'url' must not contain spaces or control characters: {json.dumps(url)[:80]}")
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        bad(f"'url' is not a URL ({exc})")
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        if not host:
            bad(f"'url' names no host: {json.dumps(url)[:80]}")
        return url
    if scheme == "file" and os.environ.get("CHROMIUM_FILE_ROOT"):
        root = os.environ["CHROMIUM_FILE_ROOT"]
        if not os.path.isabs(root):
            print(f"CHROMIUM_FILE_ROOT must be an absolute directory, not {root!r}",
                  file=sys.stderr)
            sys.exit(78)
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or "\0" in path or not path.startswith("/"):
            bad(f"'url' must be file:///PATH, not {json.dumps(url)[:80]}")
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            bad(f"'url' must be under CHROMIUM_FILE_ROOT ({base}), not {json.dumps(url)[:80]}")
        return pathlib.Path(real).as_uri()
    extra = {s.strip().lower() for s in os.environ.get("CHROMIUM_EXTRA_SCHEMES", "").split(",")}
    if scheme and scheme != "file" and scheme in extra:
        return url
    bad(f"'url' must be http or https (file only under CHROMIUM_FILE_ROOT), "
        f"not {json.dumps(url)[:80]}")


url = read_payload({"url": (str, True)})["url"]
load = allowed_url(url)
profile = os.path.join(os.environ.get("HOME") or os.environ["SIDECAR_JOB_DIR"], "chromium")
done = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", load],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"chromium exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
dom = done.stdout.decode("utf-8", "replace").strip()
if not dom:
    print("chromium printed no DOM (crashed renderer?)", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"url": url, "dom": dom}))
