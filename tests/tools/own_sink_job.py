#!/usr/bin/env python3
"""Test tool: a healthy job that reports its side effects to a sink file.

Payload: {"sink": PATH, "sleep": SECONDS, "pad_bytes": N, "secret": TEXT}.
Appends "start <token> <pid>" to SINK, writes ``{"pad": "`` and N bytes of "x" to
stdout (when N > 0), sleeps, appends "done <token> <pid>", then completes one JSON
value on stdout: {"pad": "...", "ok": true, "secret": TEXT}. The token comes from
SIDECAR_FENCING_TOKEN.
"""
import json
import os
import sys
import time


def note(path, word):
    token = os.environ.get("SIDECAR_FENCING_TOKEN", "?")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{word} {token} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def main():
    payload = json.load(sys.stdin)
    sink = payload["sink"]
    pad = int(payload.get("pad_bytes", 0))
    out = sys.stdout.buffer
    note(sink, "start")
    if pad:
        out.write(b'{"pad": "')
        chunk = b"x" * 65536
        left = pad
        while left > 0:
            out.write(chunk[:left])
            left -= min(left, len(chunk))
        out.flush()
    time.sleep(float(payload.get("sleep", 0)))
    note(sink, "done")
    tail = {"ok": True}
    if "secret" in payload:
        tail["secret"] = payload["secret"]
    if pad:
        out.write(b'", ' + json.dumps(tail).encode()[1:] + b"\n")
    else:
        out.write(json.dumps(tail).encode() + b"\n")
    out.flush()


main()
