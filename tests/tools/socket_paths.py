#!/usr/bin/env python3
"""Test tool: binds a unix socket named by 60 characters under $TMPDIR, $HOME and
$XDG_RUNTIME_DIR (what Chromium, LibreOffice and D-Bus do), writes a file in HOME, and
prints {"tmpdir": PATH_LENGTH, "home": ..., "runtime": ..., "home_dir": HOME,
"runtime_mode": "0o700"}. A path too long for sun_path fails with OSError (exit 1)."""
import json
import os
import socket
import sys

sys.stdin.read()
name = "s" * 60
out = {"home_dir": os.environ["HOME"]}
for key, var in (("tmpdir", "TMPDIR"), ("home", "HOME"), ("runtime", "XDG_RUNTIME_DIR")):
    directory = os.environ[var]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)
    os.unlink(path)
    out[key] = len(os.fsencode(path))
with open(os.path.join(os.environ["HOME"], ".profile-written"), "w") as f:
    f.write("ok")
out["runtime_mode"] = oct(os.stat(os.environ["XDG_RUNTIME_DIR"]).st_mode & 0o777)
print(json.dumps(out))
