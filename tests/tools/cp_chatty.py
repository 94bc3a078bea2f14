#!/usr/bin/env python3
"""Test tool (case F5): writes STDERR_BYTES of stderr lines *before* reading stdin, then
reads the whole payload, then prints a JSON result of about RESULT_BYTES.

argv: STDERR_BYTES RESULT_BYTES. Payload: {"blob": STRING}.
Result: {"payload_blob_len": N, "data": "r" * RESULT_BYTES}.
"""
import json
import sys


def main():
    stderr_bytes, result_bytes = int(sys.argv[1]), int(sys.argv[2])
    line = b"e" * 1023 + b"\n"
    err = sys.stderr.buffer
    written = 0
    while written < stderr_bytes:
        err.write(line)
        written += len(line)
    err.flush()
    payload = json.loads(sys.stdin.buffer.read())
    out = sys.stdout.buffer
    out.write(b'{"payload_blob_len": %d, "data": "' % len(payload["blob"]))
    chunk = b"r" * 65536
    left = result_bytes
    while left > 0:
        out.write(chunk[:left])
        left -= len(chunk)
    out.write(b'"}\n')
    out.flush()


main()
