#!/usr/bin/env python3
"""Recipe: Ghostscript renders PostScript or PDF pages to PNG (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "resolution": 72}; result:
{"pages": [PATH, ...]}. -dSAFER keeps the document from reading or writing other files;
a document whose program never ends is stopped by the stage deadline, not by Ghostscript.

A payload of the wrong shape exits 65 with one line (bad input, never retried).
"""
import glob
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
                        "resolution": (int, False)},
                       '{"input": "/data/a.pdf", "output_dir": "/data/out", "resolution": 72}')
if not 1 <= payload.get("resolution", 72) <= 2400:
    print("bad payload: 'resolution' must be from 1 to 2400 (dpi)", file=sys.stderr)
    sys.exit(65)
out = os.path.join(payload["output_dir"], f"{os.environ.get('SIDECAR_JOB_ID', 'page')}-%03d.png")
done = subprocess.run(["gs", "-q", "-dSAFER", "-dBATCH", "-dNOPAUSE", "-sDEVICE=png16m",
                       f"-r{int(payload.get('resolution', 72))}", f"-sOutputFile={out}",
                       payload["input"]], stdin=subprocess.DEVNULL, stdout=sys.stderr)
if done.returncode != 0:
    print(f"gs exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
pages = sorted(glob.glob(out.replace("%03d", "[0-9][0-9][0-9]")))
if not pages:
    print("gs wrote no page", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"pages": pages}))
