#!/usr/bin/env python3
"""Recipe: Ghostscript renders PostScript or PDF pages to PNG (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "resolution": 72}; result:
{"pages": [PATH, ...]}. -dSAFER keeps the document from reading or writing other files;
a document whose program never ends is stopped by the stage deadline, not by Ghostscript.
Both paths must lie under RENDER_ROOT (ghostscript.env: the profile passes it through).

A payload of the wrong shape or a path outside RENDER_ROOT exits 65 with one line (bad
input, never retried); RENDER_ROOT unset exits 78.
"""
import glob
import json
import os
import subprocess
import sys

EXAMPLE = '{"input": "/data/a.pdf", "output_dir": "/data/out", "resolution": 72}'

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
                        "resolution": (int, False)})
if not 1 <= payload.get("resolution", 72) <= 2400:
    bad("'resolution' must be from 1 to 2400 (dpi)")
source = under_root(payload["input"], "input", "RENDER_ROOT")
output_dir = under_root(payload["output_dir"], "output_dir", "RENDER_ROOT")
if "%" in output_dir:  # gs reads % in -sOutputFile as a page number or a %pipe%
    bad(f"'output_dir' must not contain %, not {json.dumps(payload['output_dir'])[:80]}")
out = os.path.join(output_dir, f"{os.environ.get('SIDECAR_JOB_ID', 'page')}-%03d.png")
done = subprocess.run(["gs", "-q", "-dSAFER", "-dBATCH", "-dNOPAUSE", "-sDEVICE=png16m",
                       f"-r{int(payload.get('resolution', 72))}", f"-sOutputFile={out}",
                       source], stdin=subprocess.DEVNULL, stdout=sys.stderr)
if done.returncode != 0:
    print(f"gs exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
pages = sorted(glob.glob(out.replace("%03d", "[0-9][0-9][0-9]")))
if not pages:
    print("gs wrote no page", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"pages": pages}))
