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

``python -m bench.baseline child COUNT CONCURRENCY START_AT [--sandbox] [--prepared]``
    spawn and reap ``/bin/true`` the way the sidecar does, CONCURRENCY at a time, in one
    asyncio (uvloop) process: ``sidecar.worker.child.Child.spawn`` (vfork from the long-lived
    spawn thread, new session, pipes for stdin, stdout and stderr, the payload ``{}``
    written, an environment with the job's marks, its own working directory), then its
    exit seen through the pidfd and the pipes drained to EOF. No database, no work
    directory or cgroup made per job, no tree check after the exit. ``--sandbox``: inside
    the bubblewrap sandbox the sidecar would use here with its default settings
    (sidecar.worker.isolation.check_sandbox; exit 3 when there is none), bwrap's status read.

``claim`` and ``child`` also report ``cpu_s``: the CPU seconds (user + system) the
helper itself used from its first job to its last, the process's own part of each job.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
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
    from sidecar.protocol.model import JobState
    from sidecar.protocol.vocabulary import FailureKind
    from sidecar.storage.db import connect
    from sidecar.storage.queries import Q

    owner = f"bench-bare:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    conns = [await connect(dsn, 10) for _ in range(concurrency)]
    done, first, last = 0, None, 0.0
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu0 = _cpu_seconds()

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
        cpu = _cpu_seconds() - cpu0
    finally:
        for conn in conns:
            await conn.close()
    return {"jobs": done, "first": first, "last": last, "cpu_s": cpu}


def _cpu_seconds() -> float:
    """CPU seconds (user + system) this process used so far, its reaped children not."""
    usage = os.times()
    return usage.user + usage.system


def sandbox_wrap(workdir: str):
    """The sidecar's bwrap wrapper for ``/bin/true`` run in ``workdir``, by the default
    settings and profile (as ``sidecar run`` would check it), or None when attempts would
    run unsandboxed here."""
    from sidecar.runtime.config import load_settings
    from sidecar.worker import isolation

    settings = load_settings()
    profile = settings.profile("true")
    work_root = isolation.check_work_dir(settings, profile)
    plan, _off = isolation.check_sandbox(settings, profile, work_root, ["/bin/true"])
    if plan is None:
        return None
    return lambda argv, status_fd: plan.argv(argv, workdir, status_fd)


async def child_loop(count: int, concurrency: int, start_at: float,
                     sandbox: bool = False, prepared: bool = False) -> dict:
    """Spawn and reap ``/bin/true`` ``count`` times through the sidecar's own spawn path
    (sidecar.worker.child.Child), ``concurrency`` at once, in the sidecar's sandbox when
    ``sandbox``; the window and the CPU it took. ``prepared``: as the sidecar does by
    default (sidecar.worker.prepared), each slot launches its next launcher while its
    current job runs, and a job only writes its line and waits for the exit; ``go_ms``
    then lists each job's time from its line to its exit. Raises LookupError when
    ``sandbox`` is asked for where there is none."""
    from sidecar.worker.child import Child, ProcessTable
    from sidecar.worker.prepared import job_line, launcher_argv, wait_ready

    processes = ProcessTable()
    left, done, first, last = count, 0, None, 0.0
    workdir = tempfile.mkdtemp(prefix="bench-spawn-")
    wrap = sandbox_wrap(workdir) if sandbox else None
    if sandbox and wrap is None:
        os.rmdir(workdir)
        raise LookupError("no bubblewrap sandbox here")
    # The variables a job adds to the sidecar's (supervisor.job_variables), roughly.
    base = {**os.environ, "SIDECAR_TOOL": "true", "SIDECAR_ATTEMPT": "1",
            "SIDECAR_STAGE_TIMEOUT_SECONDS": "600", "SIDECAR_JOB_DIR": workdir,
            "SIDECAR_RESULT_FILE": os.path.join(workdir, "result.json"),
            "TMPDIR": workdir, "HOME": workdir}
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu0 = _cpu_seconds()

    go_ms: list[float] = []

    async def launch():
        if wrap is None:
            launched = await Child.launch(launcher_argv(["/bin/true"], [], None, True), base,
                                          cwd=workdir, processes=processes)
        else:
            launched = await Child.launch(
                ["/bin/true"], base, cwd=workdir, processes=processes,
                wrap=lambda argv, fd: launcher_argv(argv, [], lambda inner: wrap(inner, fd),
                                                    False))
        await wait_ready(launched)
        return launched

    async def loop() -> None:
        nonlocal left, done, first, last
        ahead = asyncio.ensure_future(launch()) if prepared else None
        while left > 0:
            left -= 1
            job = str(uuid.uuid4())
            cookie = {"SIDECAR_JOB_ID": job, "SIDECAR_FENCING_TOKEN": "1"}
            if ahead is not None:
                launched = await ahead
                t0 = time.time()
                ahead = asyncio.ensure_future(launch()) if left > 0 else None
                child = Child.start(launched, job_line(cookie) + b"{}", 8 << 20,
                                    lambda _line: None, cookie)
            else:
                t0 = time.time()
                child = await Child.spawn(["/bin/true"], {**base, **cookie}, b"{}", 8 << 20,
                                          lambda _line: None, cookie, cwd=workdir,
                                          processes=processes, wrap=wrap)
            await child.exited
            go_ms.append(1000 * (time.time() - t0))
            await child.close_pipes(timeout=1.0)
            processes.attempt_ended()
            first = t0 if first is None else min(first, t0)
            last = max(last, time.time())
            done += 1

    try:
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        cpu = _cpu_seconds() - cpu0
    finally:
        os.rmdir(workdir)
    return {"jobs": done, "first": first, "last": last, "cpu_s": cpu, "go_ms": go_ms}


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
    elif kind == "child":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            try:
                out = runner.run(child_loop(int(argv[1]), int(argv[2]), float(argv[3]),
                                            "--sandbox" in argv[4:], "--prepared" in argv[4:]))
            except LookupError as exc:
                print(exc, file=sys.stderr)
                return 3
    else:
        print(f"unknown baseline {kind!r}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(orjson.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
