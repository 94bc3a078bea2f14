#!/usr/bin/env python3
"""Recipe: Ghostscript renders PostScript or PDF pages to PNG (README "Recipes").

Payload: {"input": PATH, "output_dir": DIR, "resolution": 72}; result:
{"pages": [PATH, ...]}. -dSAFER keeps the document from reading or writing other files;
a document whose program never ends is stopped by the stage deadline, not by Ghostscript.
"""
import glob
import json
import os
import subprocess
import sys

payload = json.load(sys.stdin)
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
