#!/usr/bin/env python3
"""Test tool (case F10): hangs with a SIGTERM handler that writes "TERM" to the file named
by the payload's "trapfile" and exits 0, as a tool that cleans up on SIGTERM would."""
import json
import os
import signal
import sys
import time

path = json.load(sys.stdin)["trapfile"]


def on_term(signum, frame):
    with open(path, "w") as f:
        f.write("TERM")
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
with open(path + ".ready", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(1)
