#!/usr/bin/env python3
"""Recipe: LibreOffice converts a document (to PDF by default) (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "format": "pdf"}; result: {"output": PATH,
"bytes": N}. soffice keeps its user profile under HOME: with the default HOME=job each
attempt has its own, so conversions run side by side (one shared profile makes a second
soffice hand its work to the first, or refuse). soffice can exit 0 without writing
anything: a missing output fails the job.

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


payload = read_payload({"input": (str, True), "output_dir": (str, True),
                        "format": (str, False)},
                       '{"input": "/data/a.docx", "output_dir": "/data/out", "format": "pdf"}')
fmt = payload.get("format", "pdf")
done = subprocess.run(["soffice", "--headless", "--norestore", "--nolockcheck", "--nodefault",
                       "--convert-to", fmt, "--outdir", payload["output_dir"], payload["input"]],
                      stdin=subprocess.DEVNULL, stdout=sys.stderr)
if done.returncode != 0:
    print(f"soffice exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
stem = os.path.splitext(os.path.basename(payload["input"]))[0]
output = os.path.join(payload["output_dir"], f"{stem}.{fmt}")
if not os.path.isfile(output) or os.path.getsize(output) == 0:
    print(f"soffice wrote no {output}", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"output": output, "bytes": os.path.getsize(output)}))
