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

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))  # recipe_paths, beside us
from recipe_paths import (  # noqa: E402
    BadPayload,
    NotConfigured,
    check_extension,
    check_fields,
    under_root,
)

EXAMPLE = '{"input": "/data/a.docx", "output_dir": "/data/out", "format": "pdf"}'


def bad(why: str):
    """Bad input, not a failure worth a retry: one line on stderr and exit 65 (EX_DATAERR,
    non-retryable in the default profile), never a traceback."""
    print(f"bad payload: {why}; expected e.g. {EXAMPLE}", file=sys.stderr)
    sys.exit(65)


try:
    payload = check_fields(json.load(sys.stdin), {
        "input": (str, True), "output_dir": (str, True), "format": (str, False)})
    fmt = check_extension(payload.get("format", "pdf"))
    source = under_root(payload["input"], "input", "CONVERT_DOC_ROOT")
    output_dir = under_root(payload["output_dir"], "output_dir", "CONVERT_DOC_ROOT")
except NotConfigured as exc:
    print(exc, file=sys.stderr)
    sys.exit(78)
except BadPayload as exc:
    bad(str(exc))
except ValueError as exc:  # json.load
    bad(f"not JSON ({exc})")
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
