"""The limits a sidecar's throughput is compared with, as helper processes that print one
JSON object (``jobs``, ``first``, ``last``: wall-clock seconds of the first start and the
last end):

``python -m bench.baseline claim DSN TOOL CONCURRENCY START_AT [--journal]``
    a bare asyncpg loop per connection running the sidecar's own ``claim_job`` and
    ``finish_job_if_owner`` statements with the parameters the sidecar passes for a
    ``/bin/true`` job (which ends ``failed``/``bad_result``: empty stdout is not a JSON
    value), and no child. ``--journal`` adds the ``tool_request_started`` journal row the
    sidecar writes with the finish, so the job table sees exactly the sidecar's writes.

``python -m bench.baseline loop DSN TOOL CONCURRENCY START_AT``
    the bare loop: the same statements and journal rows, and between them ``/bin/true``
    spawned with the payload on its stdin and its stdout read, awaited, in one asyncio
    (uvloop) process: what a job costs without supervision (no lease keeper, no tree kill,
    no work directory, no cgroup).

``python -m bench.baseline spawn COUNT CONCURRENCY START_AT``
    a bare spawn-and-reap loop of ``/bin/true`` (``posix_spawn`` + ``waitpid``) on
    CONCURRENCY threads.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid

import orjson


def _wait_until(start_at: float) -> None:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)


async def claim_loop(dsn: str, tool: str, concurrency: int, start_at: float,
                     journal: bool, spawn: bool = False) -> dict:
    from sidecar.db import connect
    from sidecar.model import JobState
    from sidecar.queries import Q
    from sidecar.vocabulary import FailureKind

    owner = f"bench-bare:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    conns = [await connect(dsn, 10) for _ in range(concurrency)]
    done, first, last = 0, None, 0.0
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def loop(conn) -> None:
        nonlocal done, first, last
        while True:
            started = time.monotonic()
            t0 = time.time()
            row = await conn.fetchrow(Q["claim_job"], tool, owner, 90.0, None, 3, 1, timeout=10)
            if row is None:
                return
            first = t0 if first is None else min(first, t0)
            pid = 0
            if spawn:
                proc = await asyncio.create_subprocess_exec(
                    "/bin/true", stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE, start_new_session=True)
                pid = proc.pid
                try:  # /bin/true exits without reading its stdin
                    proc.stdin.write(row["payload_text"].encode())
                    await proc.stdin.drain()
                    proc.stdin.close()
                except (BrokenPipeError, ConnectionResetError, RuntimeError):
                    pass
                await proc.stdout.read()
                await proc.wait()
            earlier = [{"event": "tool_request_started", "age_s": 0.001, "details": {
                "pid": pid, "argv0": "/bin/true",
                "payload": {"sha256": "0" * 64, "bytes": 2}}}] if journal or spawn else None
            error = {"kind": FailureKind.BAD_RESULT,
                     "message": "exit 0 but stdout is not one JSON value "
                     "(unexpected end of data: line 1 column 1 (char 0)); 0 bytes"}
            summary = {"attempt": row["attempt"], "kind": FailureKind.BAD_RESULT,
                       "duration_s": round(time.monotonic() - started, 3)}
            await conn.fetchrow(Q["finish_job_if_owner"], row["id"], owner,
                                row["fencing_token"], JobState.FAILED, None, error, "job_failed",
                                summary, None, None, None, None, None, earlier,
                                timeout=10)
            done += 1
            last = time.time()

    try:
        await asyncio.gather(*(loop(conn) for conn in conns))
    finally:
        for conn in conns:
            await conn.close()
    return {"jobs": done, "first": first, "last": last}


def spawn_loop(count: int, concurrency: int, start_at: float) -> dict:
    lock = threading.Lock()
    state = {"left": count, "done": 0, "first": None, "last": 0.0}
    env = dict(os.environ)

    def worker() -> None:
        while True:
            with lock:
                if state["left"] <= 0:
                    return
                state["left"] -= 1
            t0 = time.time()
            pid = os.posix_spawn("/bin/true", ["/bin/true"], env)
            os.waitpid(pid, 0)
            t1 = time.time()
            with lock:
                state["done"] += 1
                state["first"] = t0 if state["first"] is None else min(state["first"], t0)
                state["last"] = max(state["last"], t1)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    _wait_until(start_at)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"jobs": state["done"], "first": state["first"], "last": state["last"]}


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "claim":
        import uvloop

        dsn, tool, concurrency, start_at = argv[1], argv[2], int(argv[3]), float(argv[4])
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(claim_loop(dsn, tool, concurrency, start_at,
                                        "--journal" in argv[5:]))
    elif kind == "loop":
        import uvloop

        dsn, tool, concurrency, start_at = argv[1], argv[2], int(argv[3]), float(argv[4])
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(claim_loop(dsn, tool, concurrency, start_at, True, spawn=True))
    elif kind == "spawn":
        out = spawn_loop(int(argv[1]), int(argv[2]), float(argv[3]))
    else:
        print(f"unknown baseline {kind!r}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(orjson.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
