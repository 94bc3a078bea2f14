#!/usr/bin/env python3
"""The sidecar's guard from a Python tool (stdlib only): copy this file next to your tool.

Call ``guard()`` just before each irreversible step (sending an email, capturing a payment,
creating a case). It returns ``{"fencing_token": N, "lease_remaining_seconds": S}`` while
this attempt still owns the job with time to spare; send N as ``X-Execution-Fence``. It
raises ``GuardRefused`` (``.reason``: cancelled, lease_lost, ownership_unknown, deadline,
lease_ending) when the step must not start; stop, or for ``lease_ending`` (transient) pass
``retry_seconds`` to wait for the next heartbeat. ``checkpoint(obj)`` saves progress (one
JSON value, at most 64 KiB) for the next attempt, which finds it in the file named by
``SIDECAR_CHECKPOINT_FILE``. ``snooze(delay_seconds, reason)`` asks to run again later
without spending an attempt: exit right after it returns.

    from guard_client import GuardRefused, checkpoint, guard

    for page in pages:
        fence = guard(request_id=f"{os.environ['SIDECAR_IDEMPOTENCY_KEY']}:page:{page}")
        send(page, fence=fence["fencing_token"])
        checkpoint({"done": page})

The guard is asked over ``SIDECAR_GUARD_URL`` (the loopback), or, where there is none
(a sandbox with ``NETWORK=none``), over the attempt's own Unix socket
``SIDECAR_GUARD_SOCKET``.

As a script: ``guard_client.py [REQUEST_ID]`` asks the guard and prints its answer, and
``guard_client.py --checkpoint JSON`` (``-`` reads stdin) saves a checkpoint. Exit 0 on
success, 1 with the reason on stderr when refused (409), 2 when the guard cannot be asked.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

TIMEOUT = 10  # seconds; the guard is local, a checkpoint is one database write
RETRYABLE = ("lease_ending",)

# The guard is on 127.0.0.1: never send it (or its secret) through an http_proxy.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class GuardError(Exception):
    """The guard could not be asked: not run by a sidecar, 401, unreachable, other errors."""


class GuardRefused(Exception):
    """The guard said no (409). ``reason`` says why; do not start the step."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over the Unix socket at ``path`` (SIDECAR_GUARD_SOCKET)."""

    def __init__(self, path: str):
        super().__init__("localhost", timeout=TIMEOUT)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(self.path)


def _answer(path: str, status: int, answer: bytes) -> dict:
    if status == 200:
        return json.loads(answer)
    if status == 409:
        try:
            raise GuardRefused(json.loads(answer)["reason"])
        except (ValueError, KeyError, TypeError):
            pass
    raise GuardError(f"{path} answered {status}: {answer[:1000]!r}")


def _post(path: str, body: bytes) -> dict:
    url, token = os.environ.get("SIDECAR_GUARD_URL"), os.environ.get("SIDECAR_GUARD_TOKEN")
    unix = os.environ.get("SIDECAR_GUARD_SOCKET")
    if not (url or unix) or not token:
        raise GuardError("SIDECAR_GUARD_URL (or SIDECAR_GUARD_SOCKET) and SIDECAR_GUARD_TOKEN "
                         "are not set (not run by a sidecar?)")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if not url:  # NETWORK=none: the attempt's own socket
        conn = _UnixConnection(unix)
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            return _answer(path, response.status, response.read())
        except OSError as exc:
            raise GuardError(f"{unix} unreachable: {exc}") from None
        finally:
            conn.close()
    request = urllib.request.Request(url + path, data=body, method="POST", headers=headers)
    try:
        with _opener.open(request, timeout=TIMEOUT) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        return _answer(path, exc.code, exc.read())
    except OSError as exc:
        raise GuardError(f"{url} unreachable: {exc}") from None


def guard(request_id: str | None = None, retry_seconds: float = 0.0) -> dict:
    """May this attempt start an irreversible step now? Returns ``{"fencing_token": N,
    "lease_remaining_seconds": S}``; raises GuardRefused or GuardError. ``request_id``
    (1-200 characters) names the request you are about to send (logged by the sidecar if
    ownership becomes unknown meanwhile). ``retry_seconds``: how long to keep asking
    while the reason is ``lease_ending``."""
    body = json.dumps({"request_id": request_id} if request_id is not None else {}).encode()
    give_up = time.monotonic() + retry_seconds
    while True:
        try:
            return _post("/v1/guard", body)
        except GuardRefused as exc:
            if exc.reason not in RETRYABLE or time.monotonic() >= give_up:
                raise
            time.sleep(0.5)


def checkpoint(obj) -> dict:
    """Save ``obj`` (JSON-able, at most 64 KiB encoded) as the job's progress, fenced on this
    attempt. Returns ``{"saved": true, "bytes": n}``; raises GuardRefused ("lease_lost") when
    the job is no longer ours, GuardError otherwise (413 too large, 503 database down)."""
    return _post("/v1/checkpoint", json.dumps(obj, separators=(",", ":")).encode())


def snooze(delay_seconds: float, reason: str | None = None) -> dict:
    """Ask to run this job again in ``delay_seconds`` (more than 0, at most 366 days)
    without spending an attempt; ``reason``: 1-200 printable characters, journaled. Returns
    ``{"snoozed": true, ...}``: then exit (what you print after is not kept). Raises
    GuardRefused ("lease_lost", "cancelled") when the job is no longer ours, GuardError
    otherwise (400 names the bad field)."""
    body = {"delay_seconds": delay_seconds, **({"reason": reason} if reason else {})}
    return _post("/v1/snooze", json.dumps(body).encode())


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["--checkpoint"] and len(argv) == 2:
            text = sys.stdin.read() if argv[1] == "-" else argv[1]
            answer = checkpoint(json.loads(text))
        elif len(argv) <= 1 and argv[:1] != ["--checkpoint"]:
            answer = guard(argv[0] if argv else None)
        else:
            print("usage: guard_client.py [REQUEST_ID] | --checkpoint JSON|-", file=sys.stderr)
            return 2
    except GuardRefused as exc:
        print(f"guard: {exc.reason}", file=sys.stderr)
        return 1
    except (GuardError, ValueError) as exc:
        print(f"guard: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
