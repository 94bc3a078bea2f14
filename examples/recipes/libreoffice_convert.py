#!/usr/bin/env python3
"""Recipe: LibreOffice converts a document (to PDF by default) (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "format": "pdf"}; result: {"output": PATH,
"bytes": N}. soffice keeps its user profile under HOME: with the default HOME=job each
attempt has its own, so conversions run side by side (one shared profile makes a second
soffice hand its work to the first, or refuse). soffice can exit 0 without writing
anything: a missing output fails the job. Both paths must lie under CONVERT_DOC_ROOT
(libreoffice.env: the profile passes it through); the format is a file extension.

A payload of the wrong shape or a path outside CONVERT_DOC_ROOT exits 65 with one line
(bad input, never retried); CONVERT_DOC_ROOT unset exits 78.
"""
import json
import os
import subprocess
import sys

EXAMPLE = '{"input": "/data/a.docx", "output_dir": "/data/out", "format": "pdf"}'

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


def under_root(value: str, name: str, variable: str) -> str:
    """``value`` with every symlink resolved, if that is under the directory the
    environment variable ``variable`` names (the tool's profile passes it through):
    a payload chooses files there, never elsewhere (a mounted Secret, /proc, ...).
    The real path is what the binary gets, so a link swapped later points nowhere new
    for components already resolved. Unset or relative root: exit 78 (EX_CONFIG)."""
    root = os.environ.get(variable, "")
    if not os.path.isabs(root):
        print(f"{variable} must name the directory payload paths are confined to "
              f"(examples/recipes/*.env), not {root!r}", file=sys.stderr)
        sys.exit(78)
    if "\0" in value or not os.path.isabs(value):
        bad(f"{name!r} must be an absolute path, not {json.dumps(value)[:80]}")
    real, base = os.path.realpath(value), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        bad(f"{name!r} must be under {variable} ({base}), not {json.dumps(value)[:80]}")
    return real


payload = read_payload({"input": (str, True), "output_dir": (str, True),
                        "format": (str, False)})
fmt = payload.get("format", "pdf")
if not (fmt.isascii() and fmt.isalnum() and len(fmt) <= 10):
    bad(f"'format' must be a file extension such as pdf or odt, not {json.dumps(fmt)[:40]}")
source = under_root(payload["input"], "input", "CONVERT_DOC_ROOT")
output_dir = under_root(payload["output_dir"], "output_dir", "CONVERT_DOC_ROOT")
done = subprocess.run(["soffice", "--headless", "--norestore", "--nolockcheck", "--nodefault",
                       "--convert-to", fmt, "--outdir", output_dir, source],
                      stdin=subprocess.DEVNULL, stdout=sys.stderr)
if done.returncode != 0:
    print(f"soffice exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
stem = os.path.splitext(os.path.basename(source))[0]
output = os.path.join(output_dir, f"{stem}.{fmt}")
if not os.path.isfile(output) or os.path.getsize(output) == 0:
    print(f"soffice wrote no {output}", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"output": output, "bytes": os.path.getsize(output)}))
