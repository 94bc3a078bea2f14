#!/usr/bin/env python3
"""Bench tool: floods stdout and stderr, interleaved, in 64 KiB pieces, then exits 0.

Payload: {"stdout_bytes": N, "stderr_bytes": M, "json": BOOL}. With "json", stdout is one
JSON string of N bytes of "x" (a valid result); without it, N raw bytes (not JSON).
stderr is 128-byte lines, which the sidecar relays as ``tool_stderr`` events.
"""

import json
import os
import sys

CHUNK = 65536


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main():
    payload = json.load(sys.stdin)
    out_left = int(payload.get("stdout_bytes", 0))
    err_left = int(payload.get("stderr_bytes", 0))
    as_json = bool(payload.get("json"))
    block = b"x" * CHUNK
    line = (b"y" * 127 + b"\n") * (CHUNK // 128)
    if as_json:
        write_all(1, b'"')
    while out_left > 0 or err_left > 0:
        if out_left > 0:
            n = min(CHUNK, out_left)
            write_all(1, block[:n])
            out_left -= n
        if err_left > 0:
            n = min(CHUNK, err_left)
            write_all(2, line[:n])
            err_left -= n
    if as_json:
        write_all(1, b'"\n')


main()
