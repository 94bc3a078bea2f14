"""Demo tool: checksum and word count of one real file, by the system's own programs.

Payload ``{"path": "/etc/os-release"}``; prints ``{"path", "sha256", "lines", "words",
"bytes"}``. Exits 66 (EX_NOINPUT) when the file cannot be read.
"""
import json
import subprocess
import sys

path = json.load(sys.stdin)["path"]
try:
    sha = subprocess.run(["sha256sum", path], capture_output=True, check=True, text=True)
    wc = subprocess.run(["wc", "-l", "-w", "-c", path], capture_output=True, check=True, text=True)
except subprocess.CalledProcessError as exc:
    print(exc.stderr.strip(), file=sys.stderr)
    sys.exit(66)
lines, words, size = (int(x) for x in wc.stdout.split()[:3])
print(json.dumps({"path": path, "sha256": sha.stdout.split()[0], "lines": lines,
                  "words": words, "bytes": size}))
