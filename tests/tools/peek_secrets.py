#!/usr/bin/env python3
"""Test tool: looks for the payload's "needle" (the database password) where a tool of the
sidecar's own uid could read it: /proc/<sidecar>/environ, the guardian's environ, the
sidecar's memory (/proc/<sidecar>/mem through its maps), and its own environment. Prints
{"sidecar_environ": V, "guardian_environ": V, "sidecar_mem": V, "own_environ": V,
"guardian_pid": PID}, V being "found", "clean" or the errno name that refused the read."""
import errno
import json
import os
import sys

needle = json.load(sys.stdin)["needle"].encode()
sidecar = os.getppid()
owner = os.environ["SIDECAR_OWNER_ID"].encode()


def look(path):
    try:
        with open(path, "rb") as f:
            return "found" if needle in f.read() else "clean"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def look_in_memory(pid):
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
            for line in maps:
                addresses, perms = line.split()[:2]
                if not perms.startswith("r"):
                    continue
                start, end = (int(x, 16) for x in addresses.split("-"))
                try:
                    mem.seek(start)
                    if needle in mem.read(min(end - start, 64 << 20)):
                        return "found"
                except (OSError, OverflowError, ValueError):
                    continue
        return "clean"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


guardian = None
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"guardian" in cmdline and owner in cmdline:
            guardian = int(entry)
print(json.dumps({
    "sidecar_environ": look(f"/proc/{sidecar}/environ"),
    "guardian_environ": look(f"/proc/{guardian}/environ") if guardian else "no guardian",
    "sidecar_mem": look_in_memory(sidecar),
    "own_environ": "found" if any(needle in v.encode() for v in os.environ.values())
    else "clean",
    "guardian_pid": guardian,
}))
