#!/usr/bin/env python3
"""Recipe: tesseract OCR as a sidecar tool (README "Recipes").

Payload: {"image": PATH, "lang": "eng"}; result: {"image": PATH, "text": TEXT}. A
non-zero exit of tesseract fails the job with that exit code.
"""
import json
import subprocess
import sys

payload = json.load(sys.stdin)
done = subprocess.run(["tesseract", payload["image"], "stdout", "-l", payload.get("lang", "eng")],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
if done.returncode != 0:
    print(f"tesseract exited with {done.returncode}", file=sys.stderr)
    sys.exit(done.returncode if done.returncode > 0 else 128 - done.returncode)
print(json.dumps({"image": payload["image"],
                  "text": done.stdout.decode("utf-8", "replace").strip()}))
