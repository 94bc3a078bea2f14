#!/usr/bin/env python3
"""Recipe: tesseract OCR as a sidecar tool (README "Recipes").

Payload: {"image": PATH, "lang": "eng"}; result: {"image": PATH, "text": TEXT}. A
non-zero exit of tesseract fails the job with that exit code.

The image must lie under OCR_ROOT (tesseract.env: the profile passes it through), and be
an image: tesseract takes any other file for a list of file names and reads each one (and
prints a line it cannot open, a password say, as the name it could not read). So the
recipe reads the file itself, checks its format and hands tesseract those bytes on stdin.

A payload of the wrong shape, a path outside OCR_ROOT or a file that is no image exits
65 with one line (bad input, never retried); OCR_ROOT unset exits 78.
"""
import json
import os
import subprocess
import sys

EXAMPLE = '{"image": "/data/scan.png", "lang": "eng"}'
# The formats tesseract reads (leptonica), by their first bytes.
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"II*\x00", b"MM\x00*", b"BM",
               b"GIF87a", b"GIF89a", b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xffO\xffQ",
               *(b"P%d" % n for n in range(1, 7)))


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


payload = read_payload({"image": (str, True), "lang": (str, False)})
lang = payload.get("lang", "eng")
if not all(part.isascii() and part.replace("_", "").isalnum() for part in lang.split("+")):
    bad(f"'lang' must be language codes joined by +, not {json.dumps(lang)[:40]}")
image = under_root(payload["image"], "image", "OCR_ROOT")
try:
    with open(image, "rb") as file:
        data = file.read()
except OSError as exc:
    bad(f"'image' cannot be read ({exc.strerror})")
if not (data.startswith(IMAGE_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")):
    bad("'image' is not a PNG, JPEG, TIFF, BMP, GIF, PNM, WebP or JPEG 2000 image")
done = subprocess.run(["tesseract", "stdin", "stdout", "-l", lang],
                      input=data, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"tesseract exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
print(json.dumps({"image": payload["image"],
                  "text": done.stdout.decode("utf-8", "replace").strip()}))
