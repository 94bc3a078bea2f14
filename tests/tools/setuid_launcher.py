#!/usr/bin/env python3
"""Test tool: starts a setuid-root helper and exits, leaving it running (case F23).

Payload {"helper": PATH, "report": PATH}: run HELPER REPORT in the background, wait until
the helper wrote REPORT ("pid setuid_result euid"), then print {"started": pid} and exit,
so the helper is left to the tree kill.
"""
import json
import os
import subprocess
import sys
import time


def main():
    payload = json.load(sys.stdin)
    helper = subprocess.Popen([payload["helper"], payload["report"]], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL)
    while not os.path.exists(payload["report"]):
        time.sleep(0.02)
    print(json.dumps({"started": helper.pid}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
