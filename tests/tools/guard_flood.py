#!/usr/bin/env python3
"""Test tool: floods the sidecar's guard with connections and holds them (issue 25), or,
with ``connections`` 0, is an ordinary job that asks the guard once.

Payload: {"connections": N, "workers": W, "report": PATH, "release": PATH,
"hold_seconds": S}. W forked processes (each under the tool's own RLIMIT_NOFILE, so N may
be above it) share N connections: the first half of each one's share sends one guard
request with the attempt's secret and keeps the connection alive, the second half only
connects and sends nothing. Once every connection is opened or refused, the counts go to
REPORT (JSON) and the tool holds everything until RELEASE exists (at most S seconds),
then prints the counts again with how many of its connections were still open.

Counts: ``served`` (got 200 or 409 and stayed open), ``too_many`` (got 429), ``reset``
(reset or closed before any answer), ``other`` (any other status), ``bare_open`` and
``bare_refused`` (the silent connections still open, or reset or closed, half a second
after the last was opened), ``connect_failed`` (connect() itself failed or timed out;
``connect_<ERRNO>`` by errno), ``served_open_at_end`` (served connections still open at
the release).

An ordinary job prints {"guard": STATUS, "tries": N} of one POST /v1/guard, asked again
for up to 10 s while its connection is refused.
"""
import errno
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit


def _request(host: str, token: str) -> bytes:
    return (f"POST /v1/guard HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Length: 0\r\n\r\n").encode()


def _status(sock: socket.socket) -> int | None:
    """The status of the answer on ``sock`` (its whole body read), None when the
    connection was reset or closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1])


def _is_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _flood(count: int, address: tuple[str, int], token: str) -> tuple[dict, list, list]:
    counts = dict.fromkeys(("served", "too_many", "reset", "other", "bare_open",
                            "bare_refused", "connect_failed"), 0)
    served: list[socket.socket] = []
    bare: list[socket.socket] = []
    request = _request(f"{address[0]}:{address[1]}", token)
    for i in range(count):
        try:
            sock = socket.create_connection(address, timeout=2)
        except ConnectionResetError:
            # Reset by the server before connect() returned here: refused at the accept.
            counts["bare_refused" if i >= count // 2 else "reset"] += 1
            continue
        except OSError as exc:
            counts["connect_failed"] += 1
            name = f"connect_{errno.errorcode.get(exc.errno, type(exc).__name__)}"
            counts[name] = counts.get(name, 0) + 1
            continue
        if i >= count // 2:
            bare.append(sock)
            continue
        try:
            sock.sendall(request)
            status = _status(sock)
        except OSError:
            status = None
        if status in (200, 409):
            counts["served"] += 1
            served.append(sock)
            continue
        counts["too_many" if status == 429 else "reset" if status is None else "other"] += 1
        sock.close()
    time.sleep(0.5)
    for sock in bare:
        counts["bare_open" if _is_open(sock) else "bare_refused"] += 1
    return counts, served, bare


def main() -> int:
    payload = json.load(sys.stdin)
    url = os.environ["SIDECAR_GUARD_URL"]
    token = os.environ["SIDECAR_GUARD_TOKEN"]
    if not payload.get("connections"):
        # As a tool should: a guard that cannot be asked (a connection refused while
        # another tool floods it) is asked again, for a while.
        request = urllib.request.Request(url + "/v1/guard", data=b"", method="POST",
                                         headers={"Authorization": f"Bearer {token}"})
        tries, give_up = 0, time.monotonic() + 10
        while True:
            tries += 1
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    status = response.status
                break
            except urllib.error.HTTPError as exc:
                status = exc.code
                break
            except OSError:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)
        print(json.dumps({"guard": status, "tries": tries}))
        return 0
    parts = urlsplit(url)
    address = (parts.hostname, parts.port)
    workers = int(payload.get("workers", 4))
    share = payload["connections"] // workers
    deadline = time.monotonic() + float(payload.get("hold_seconds", 60))
    pipes = []
    for _ in range(workers):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            counts, served, _bare = _flood(share, address, token)
            os.write(write_end, (json.dumps(counts) + "\n").encode())
            while not os.path.exists(payload["release"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            counts["served_open_at_end"] = sum(_is_open(sock) for sock in served)
            os.write(write_end, (json.dumps(counts) + "\n").encode())
            os._exit(0)
        os.close(write_end)
        pipes.append((pid, os.fdopen(read_end)))

    def total(lines: list[dict]) -> dict:
        out: dict[str, int] = {}
        for counts in lines:
            for key, value in counts.items():
                out[key] = out.get(key, 0) + value
        return out

    opened = total([json.loads(f.readline()) for _, f in pipes])
    with open(payload["report"] + ".tmp", "w") as f:
        json.dump(opened, f)
    os.rename(payload["report"] + ".tmp", payload["report"])
    final = total([json.loads(f.readline() or "{}") for _, f in pipes])
    for pid, f in pipes:
        f.close()
        os.waitpid(pid, 0)
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
