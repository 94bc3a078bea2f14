"""Input rules shared by the Chromium recipes (chromium_dump_dom.py, per job, and
chromium_warm.py, warm): which payloads and URLs they accept, and the flags they start
Chromium with. Standard library only: the recipes run with the system python3, inside
the sandbox too. A recipe imports this module from its own directory, so copy the two
files together.

A check never exits: it raises BadPayload (bad input: a per-job recipe exits 65, a warm
one answers the job with exit_code 65 and keeps serving) or BadSetting (the recipe's
own variables are wrong: exit 78, EX_CONFIG). Both carry one line for the operator.
"""
from __future__ import annotations

import json
import os
import pathlib
import urllib.parse

CHROMIUM = os.environ.get("CHROMIUM", "chromium")
# Without the background-networking flags Chromium dials out at every start; a pod with a
# closed network then waits on refused connections.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--no-first-run", "--no-default-browser-check",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-extensions"]


class BadPayload(ValueError):
    """The payload is not one the recipe takes; ``str()`` says why in one line (the
    recipe prefixes ``bad payload: ``)."""


class BadSetting(ValueError):
    """A variable of the recipe's profile (CHROMIUM_FILE_ROOT) is unusable; ``str()``
    says which, in one line."""


def checked_fields(payload, fields: dict) -> dict:
    """``payload`` (a decoded JSON value) when it is an object whose fields (name ->
    (type, required)) are non-empty values of those types; else BadPayload."""
    if not isinstance(payload, dict):
        raise BadPayload(f"a JSON object is needed, not {type(payload).__name__}")
    for name, (kind, required) in fields.items():
        if name not in payload:
            if required:
                raise BadPayload(f"{name!r} is missing")
            continue
        value = payload[name]
        if not isinstance(value, kind) or isinstance(value, bool) or value in ("", None):
            raise BadPayload(f"{name!r} must be a non-empty {kind.__name__}, "
                             f"not {json.dumps(value)[:40]}")
    return payload


def allowed_url(url: str, environ=os.environ) -> str:
    """The URL Chromium may load for ``url`` (a str): an http(s) URL with a host as
    given; a file URL under CHROMIUM_FILE_ROOT, symlinks resolved (the resolved file's
    URL); a URL of a scheme CHROMIUM_EXTRA_SCHEMES names (comma-separated; never file).
    Anything else raises BadPayload; a CHROMIUM_FILE_ROOT that is not absolute raises
    BadSetting. ``environ``: where those two variables are read."""
    if any(ord(c) <= 0x20 or ord(c) == 0x7f for c in url):
        raise BadPayload("'url' must not contain spaces or control characters: "
                         f"{json.dumps(url)[:80]}")
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        raise BadPayload(f"'url' is not a URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        if not host:
            raise BadPayload(f"'url' names no host: {json.dumps(url)[:80]}")
        return url
    root = environ.get("CHROMIUM_FILE_ROOT")
    if scheme == "file" and root:
        if not os.path.isabs(root):
            raise BadSetting(f"CHROMIUM_FILE_ROOT must be an absolute directory, not {root!r}")
        path = urllib.parse.unquote(parts.path)
        if parts.netloc not in ("", "localhost") or "\0" in path or not path.startswith("/"):
            raise BadPayload(f"'url' must be file:///PATH, not {json.dumps(url)[:80]}")
        real, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise BadPayload(f"'url' must be under CHROMIUM_FILE_ROOT ({base}), "
                             f"not {json.dumps(url)[:80]}")
        return pathlib.Path(real).as_uri()
    extra = {s.strip().lower() for s in environ.get("CHROMIUM_EXTRA_SCHEMES", "").split(",")}
    if scheme and scheme != "file" and scheme in extra:
        return url
    raise BadPayload("'url' must be http or https (file only under CHROMIUM_FILE_ROOT), "
                     f"not {json.dumps(url)[:80]}")
