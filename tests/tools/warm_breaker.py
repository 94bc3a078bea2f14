#!/usr/bin/env python3
"""A warm tool (PROCESS=warm) for tests/test_warm_breakers.py: one request line per job on
stdin, one response line on stdout, with the unlucky and hostile behaviours the breakers
need. Payload {"mode": ..., ...}:
- "count" (default): {"pid", "served", "job_id"}
- "slow": sleeps payload["delay"] seconds, then answers as "count"
- "burn": uses payload["cpu"] seconds of CPU, then answers as "count" plus {"cpu": the
  process's CPU time so far}
- "late_line": answers as "count", then, payload["delay"] seconds later, unasked, writes
  one more answer to the same job, {"late_for": <its id>} (a second line for one request, split
  from the first by time: a library's late print, a background thread)
- "big": answers one JSON array of about payload["bytes"] bytes of 17-digit numbers
  (valid JSON, exact numbers a float would change: the parse is the slow, exact one)
- "answer_flood": answers as "count" and, in the same write, one more line of about
  payload["bytes"] bytes
- "echo_token": answers {"token": <this request's guard token>}
- "echo": answers {"echo": payload["value"]}
- "prev_token": asks the guard (URL) with the previous job's token and with this job's,
  answers {"prev": status, "own": status}
- "stat": answers as "count" plus {"exists": whether payload["path"] exists}
- "nul": answers a line with a raw NUL byte inside a JSON string
- "latin1": answers a line that is not UTF-8
- "close_stdin": answers as "count", then closes its stdin and stays alive
- "daemon": starts a double-forked, setsid daemon that sleeps for ever (its pid in the
  answer), then answers as "count"
- "daemon_noenv": as "daemon", the daemon exec'ing sleep with an empty environment
- "die_later": answers as "count", then exits (payload["code"]) payload["delay"] s later
- "hang": never answers

Options (argv): ``--linger DIR``: on stdin EOF write DIR/eof-<pid> and keep running; on
SIGTERM write DIR/term-<pid> and exit 0 (a tool slow to let go: the stop's kill grace).
``--stubborn DIR``: as --linger, but SIGTERM is only recorded, not obeyed (SIGKILL ends
it).
"""
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

marker_dir = None
stubborn = False
args = sys.argv[1:]
if args[:1] in (["--linger"], ["--stubborn"]):
    stubborn = args[0] == "--stubborn"
    marker_dir = args[1]


def mark(name):
    if marker_dir:
        with open(os.path.join(marker_dir, f"{name}-{os.getpid()}"), "w") as f:
            f.write(str(time.time()))


def on_term(signum, frame):
    mark("term")
    if not stubborn:
        os._exit(0)


if marker_dir:
    signal.signal(signal.SIGTERM, on_term)


def guard_status(url, token):
    req = urllib.request.Request(url + "/v1/guard", data=b"{}", method="POST",
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:
        return str(exc)


def write(data: bytes):
    os.write(1, data)


def answer(job_id, result) -> bytes:
    """The response line answering ``job_id`` with ``result`` (a value, or raw JSON
    bytes written as they are)."""
    raw = result if isinstance(result, bytes) else json.dumps(result).encode()
    return b'{"job_id": ' + json.dumps(job_id).encode() + b', "result": ' + raw + b"}\n"


served = 0
previous_token = None
stdin = sys.stdin.buffer
while True:
    line = stdin.readline()
    if not line:
        if marker_dir:
            mark("eof")
            while True:
                time.sleep(3600)
        break
    request = json.loads(line)
    served += 1
    payload = request.get("payload") or {}
    mode = payload.get("mode", "count")
    guard = request.get("guard") or {}
    token = guard.get("token")
    count = {"pid": os.getpid(), "served": served, "job_id": request["job_id"]}
    if mode == "hang":
        time.sleep(3600)
    if mode == "slow":
        time.sleep(payload.get("delay", 1))
    if mode == "burn":
        start = time.process_time()
        while time.process_time() - start < payload.get("cpu", 0.5):
            pass
        count["cpu"] = round(time.process_time(), 3)
    if mode == "big":
        size = int(payload["bytes"])
        item = b"0.12345678901234567"
        n = max(1, size // (len(item) + 1))
        write(answer(request["job_id"], b"[" + b",".join([item] * n) + b"]"))
    elif mode == "answer_flood":
        extra = int(payload.get("bytes", 8192))
        write(answer(request["job_id"], count) + b'{"x": "' + b"y" * extra + b'"}\n')
    elif mode == "echo_token":
        write(answer(request["job_id"], {"token": token}))
    elif mode == "echo":
        write(answer(request["job_id"], {"echo": payload.get("value")}))
    elif mode == "prev_token":
        url = guard.get("url")
        statuses = {"prev": guard_status(url, previous_token) if previous_token else None,
                    "own": guard_status(url, token)}
        write(answer(request["job_id"], statuses))
    elif mode == "stat":
        path = payload.get("path")
        write(answer(request["job_id"], {**count, "exists": os.path.exists(path)}))
    elif mode == "nul":
        write(answer(request["job_id"], b'{"a": "x\x00y"}'))
    elif mode == "latin1":
        write(answer(request["job_id"], b'{"a": "caf\xe9"}'))
    elif mode in ("daemon", "daemon_noenv"):
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                if mode == "daemon_noenv":  # no SIDECAR_* mark left: only the cgroup knows
                    os.execve("/bin/sleep", ["sleep", "3600"], {})
                while True:
                    time.sleep(3600)
            os._exit(0)
        os.close(w)
        daemon = int(os.read(r, 32))
        os.close(r)
        os.wait()
        write(answer(request["job_id"], {**count, "daemon": daemon}))
    else:
        write(answer(request["job_id"], count))
    previous_token = token
    if mode == "late_line":
        time.sleep(payload.get("delay", 0.3))
        write(answer(request["job_id"], {"late_for": request["job_id"]}))
    if mode == "die_later":
        time.sleep(payload.get("delay", 0.3))
        os._exit(payload.get("code", 0))
    if mode == "close_stdin":
        os.close(0)
        while True:
            time.sleep(3600)
