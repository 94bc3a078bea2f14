#!/usr/bin/env python3
"""Test tool: ignores SIGTERM and hangs, after starting descendants that must all die.

Payload: {"pidfile": PATH, "tree": bool}. With "tree", it starts a normal grandchild,
a double-forked one (re-parented away from us) and one that calls setsid (leaves our
session); every pid goes to PIDFILE, one per line, before it hangs (case F7).
"""
import json
import os
import signal
import sys
import time


def hang(ignore_term=True):
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(3600)


def main():
    payload = json.load(sys.stdin)
    pids = [os.getpid()]
    if payload.get("tree"):
        normal = os.fork()
        if normal == 0:
            hang()
        pids.append(normal)
        r, w = os.pipe()
        first = os.fork()
        if first == 0:
            second = os.fork()
            if second == 0:
                os.close(r)
                os.write(w, f"{os.getpid()}\n".encode())
                os.close(w)
                hang()
            os._exit(0)
        os.close(w)
        os.waitpid(first, 0)
        pids.append(int(os.read(r, 64).decode().strip()))
        os.close(r)
        r, w = os.pipe()
        escaped = os.fork()
        if escaped == 0:
            os.close(r)
            os.setsid()
            os.close(w)  # only now: the pidfile must not name it before it left
            hang()
        os.close(w)
        os.read(r, 1)  # EOF once the escapee is in its own session
        os.close(r)
        pids.append(escaped)
    with open(payload["pidfile"], "w") as f:
        f.write("\n".join(str(p) for p in pids) + "\n")
    hang(ignore_term=payload.get("ignore_term", True))


main()
