#!/usr/bin/env python3
"""Recipe: tesseract OCR as a sidecar tool (README "Recipes").

Payload: {"image": PATH, "lang": "eng"}; result: {"image": PATH, "text": TEXT}. A
non-zero exit of tesseract fails the job with that exit code.

A payload of the wrong shape exits 65 with one line (bad input, never retried).
"""
import json
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


payload = read_payload({"image": (str, True), "lang": (str, False)},
                       '{"image": "/data/scan.png", "lang": "eng"}')
done = subprocess.run(["tesseract", payload["image"], "stdout", "-l", payload.get("lang", "eng")],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"tesseract exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
print(json.dumps({"image": payload["image"],
                  "text": done.stdout.decode("utf-8", "replace").strip()}))
