#!/usr/bin/env python3
"""Test tool for the guarantees that hold through the bubblewrap sandbox
(tests/test_sandbox.py). Payload ``{"mode": M, ...}``:

- ``exit``: exit with ``code``; ``signal``: kill itself with signal ``signal``;
- ``read``: read the file ``path`` (an input, as an OCR tool reads its image); exit 2
  when it cannot (as such a tool does), else print its size;
- ``term_trap``: wait; on SIGTERM write "got SIGTERM" to stderr and exit 3;
- ``inside``: print what it sees: its pid, the pids in /proc, whether HOME, TMPDIR and
  the work directory are writable and /usr is not, the payload it read, and the guard's
  answer (or the error reaching it), plus whether it can connect to ``connect`` (a
  host:port).
- ``guard_socket``: talk to the guard over ``$SIDECAR_GUARD_SOCKET`` only (issue 41):
  ask for a go, save a checkpoint, report progress whose message is the socket's path;
  with ``other_socket``, try to reach that socket (another attempt's) and ask it with its
  own secret; with ``hold``, then wait until a file ``release`` appears in its work
  directory (at most that many seconds). Prints the statuses and answers.
"""
import json
import os
import signal
import socket
import sys
import time
import urllib.request

payload = json.load(sys.stdin)
mode = payload["mode"]
if mode == "exit":
    sys.exit(payload["code"])
if mode == "signal":
    signal.signal(payload["signal"], signal.SIG_DFL)
    os.kill(os.getpid(), payload["signal"])
    time.sleep(5)
if mode == "read":
    try:
        with open(payload["path"], "rb") as f:
            size = len(f.read())
    except OSError as exc:
        sys.stderr.write(f"cannot read {payload['path']}: {exc.strerror}\n")
        sys.exit(2)
    print(json.dumps({"bytes": size}))
    sys.exit(0)
if mode == "term_trap":
    def on_term(signum, frame):
        sys.stderr.write("got SIGTERM\n")
        sys.stderr.flush()
        os._exit(3)
    signal.signal(signal.SIGTERM, on_term)
    sys.stderr.write("ready\n")
    sys.stderr.flush()
    while True:
        time.sleep(0.1)


def writable(path):
    try:
        with open(os.path.join(path, f".w{os.getpid()}"), "w") as f:
            f.write("x")
        return True
    except OSError:
        return False


def over_unix(path, route, body):
    """POST ``body`` to the guard's ``route`` over the Unix socket ``path``: (status, answer)."""
    import http.client

    class UnixConnection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(path)

    conn = UnixConnection("localhost", timeout=10)
    try:
        conn.request("POST", route, body=json.dumps(body).encode(), headers={
            "Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"],
            "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


if mode == "guard_socket":
    path = os.environ.get("SIDECAR_GUARD_SOCKET")
    out = {"guard_url": os.environ.get("SIDECAR_GUARD_URL"), "socket": path,
           "token": bool(os.environ.get("SIDECAR_GUARD_TOKEN"))}
    if path:
        out["guard"] = over_unix(path, "/v1/guard", {"request_id": "probe:go"})
        out["checkpoint"] = over_unix(path, "/v1/checkpoint", {"through": "socket"})
        out["progress"] = over_unix(path, "/v1/progress", {"progress": 0.5, "message": path})
    if payload.get("other_socket"):
        try:
            out["other"] = over_unix(payload["other_socket"], "/v1/guard", {})
        except OSError as exc:
            out["other"] = type(exc).__name__
    if payload.get("hold"):
        release = os.path.join(os.environ["SIDECAR_JOB_DIR"], "release")
        deadline = time.monotonic() + payload["hold"]
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    print(json.dumps(out))
    sys.exit(0)

out = {"pid": os.getpid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
       "home": writable(os.environ["HOME"]), "tmpdir": writable(os.environ["TMPDIR"]),
       "job_dir": writable(os.environ["SIDECAR_JOB_DIR"]), "usr": writable("/usr"),
       "payload": payload, "guard_url": os.environ.get("SIDECAR_GUARD_URL")}
if out["guard_url"]:
    request = urllib.request.Request(
        out["guard_url"] + "/v1/guard", data=b"{}", method="POST",
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"]})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            out["guard_status"] = response.status
    except OSError as exc:
        out["guard_status"] = str(getattr(exc, "code", exc))
if payload.get("connect"):
    host, port = payload["connect"].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), 2).close()
        out["connect"] = "connected"
    except OSError as exc:
        out["connect"] = type(exc).__name__
print(json.dumps(out))
