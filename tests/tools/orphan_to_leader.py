#!/usr/bin/env python3
"""Test tool: becomes a child subreaper with a second thread, and has that thread fork a
child which double-forks a grandchild and exits, as a tool's launcher does. Prints one
JSON line: the orphaned grandchild's pid, the children listed for the leader thread and
for the forking thread (from /proc/<pid>/task/<tid>/children), and what
sidecar.worker.linux.adopted_pids returns; then kills the grandchild it made and exits."""
import ctypes
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, sys.argv[1])
from sidecar.worker import linux  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
me = os.getpid()
read_end, write_end = os.pipe()
done, forked = threading.Event(), threading.Event()
info = {}


def listed(tid):
    with open(f"/proc/{me}/task/{tid}/children") as f:
        return [int(p) for p in f.read().split()]


def launcher():
    info["thread"] = threading.get_native_id()
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(30)
            os._exit(0)
        os._exit(0)  # the middle exits: its child is orphaned
    os.waitpid(middle, 0)
    forked.set()
    done.wait(30)  # the forking thread stays alive while the leader looks


thread = threading.Thread(target=launcher)
thread.start()
forked.wait(30)
grandchild = int(os.read(read_end, 64).split()[0])
deadline = time.monotonic() + 5
while grandchild not in listed(me) and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"grandchild": grandchild, "leader": listed(me),
                  "thread": listed(info["thread"]), "adopted_pids": linux.adopted_pids(me)}))
os.kill(grandchild, signal.SIGKILL)
os.waitpid(grandchild, 0)
done.set()
thread.join()
