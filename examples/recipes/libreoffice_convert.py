#!/usr/bin/env python3
"""Recipe: LibreOffice converts a document (to PDF by default) (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "format": "pdf"}; result: {"output": PATH,
"bytes": N}. soffice keeps its user profile under HOME: with the default HOME=job each
attempt has its own, so conversions run side by side (one shared profile makes a second
soffice hand its work to the first, or refuse). soffice can exit 0 without writing
anything: a missing output fails the job.
"""
import json
import os
import subprocess
import sys

payload = json.load(sys.stdin)
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
