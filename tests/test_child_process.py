"""The tool as a child process, end to end: real `sidecar run` processes (and one in-process
Worker), a real PostgreSQL, real child trees checked with psutil.

Covers the stage deadline and the tree kill (F7), a grandchild holding the pipes (F6),
large stdin with chatty output (F5), a result over the cap with bounded memory, spawn
failures, bad results, exit-code retry policy, event-loop lag under load, and zombies.
"""

from __future__ import annotations

import asyncio
import io
import os
import shlex
import time
from pathlib import Path

import orjson
import psutil
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_row,
    pid_alive,
    query,
    read_pids,
    scalar,
    wait_until,
)
from sidecar.runtime import log as log_mod
from sidecar.runtime.config import load_settings
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.worker.claim_loop import Worker

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
HANG_TREE = str(TOOLS / "hang_tree.py")
CP_SLOW = str(TOOLS / "cp_slow.py")
CP_CHATTY = str(TOOLS / "cp_chatty.py")
CP_EXIT = str(TOOLS / "cp_exit.py")
CP_FLOOD = str(TOOLS / "cp_flood.py")


# --- helpers --------------------------------------------------------------------


def job_state(dsn: str, job_id) -> str:
    return scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1::uuid", str(job_id))


def journal(dsn: str, job_id, event: str | None = None) -> list[dict]:
    rows = query(dsn, "SELECT id, fencing_token, event, at, details FROM tool_job_events "
                      "WHERE job_id = $1::uuid AND ($2::text IS NULL OR event = $2) ORDER BY id",
                 str(job_id), event)
    return [dict(r) for r in rows]


def only(rows: list[dict], what: str) -> dict:
    assert len(rows) == 1, f"expected exactly one {what}, got {rows}"
    return rows[0]


def seconds_between(dsn: str, job_id, first: str, last: str) -> float:
    """Database-clock seconds from the first journal event ``first`` to the last ``last``."""
    return scalar(dsn, """
        SELECT extract(epoch FROM
            (SELECT max(at) FROM tool_job_events WHERE job_id = $1::uuid AND event = $3)
          - (SELECT min(at) FROM tool_job_events WHERE job_id = $1::uuid AND event = $2))::float8
        """, str(job_id), first, last)


def enqueue_raw(dsn: str, tool: str, raw: bytes, *extra: str, env=None) -> str:
    """Enqueue a payload too large for argv (1 MiB) through --payload-file -."""
    done = cli(dsn, "enqueue", tool, "--payload-file", "-", *extra, input=raw, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)["id"]


def own_stderr(sidecar) -> str:
    """The sidecar's stderr without the relayed lines of the tool itself (tool_stderr)."""
    kept = []
    for line in sidecar.stderr_text().splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            kept.append(line)
            continue
        if not (isinstance(event, dict) and event.get("event") == "tool_stderr"):
            kept.append(line)
    return "\n".join(kept)


def assert_no_crash_text(sidecar, *words: str) -> None:
    text = own_stderr(sidecar)
    for word in ("Traceback", *words):
        assert word not in text, f"{word!r} in the sidecar's stderr:\n{text[-4000:]}"


def assert_all_lines_json(sidecar) -> None:
    """Every stderr line is one JSON event: no multi-line traceback, no stray prints."""
    for line in sidecar.stderr_text().splitlines():
        if line.strip():
            try:
                orjson.loads(line)
            except orjson.JSONDecodeError:
                pytest.fail(f"non-JSON line in the sidecar's stderr: {line!r}")


def vm_hwm_bytes(pid: int) -> int | None:
    """Peak resident set size (VmHWM) of a live process, in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def zombie_children(pid: int) -> list[int]:
    out = []
    for child in psutil.Process(pid).children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.Error:
            continue
    return out


# --- 1. stage deadline ----------------------------------------------------------


def test_stage_timeout_kills_a_child_that_ignores_sigterm(dsn, sidecars, tmp_path):
    job = enqueue(dsn, "cp-hang", {"pidfile": str(tmp_path / "pids")}, "--max-attempts", "1")
    sc = sidecars(dsn, [HANG_TREE], "--tool", "cp-hang", "--drain",
                  env=base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="1"))
    assert sc.wait(30) == 0

    row = job_row(dsn, job)
    assert row["state"] == "failed"
    assert row["error"]["kind"] == "stage_timeout"
    assert row["attempt"] == 1 and row["fencing_token"] == 1
    child_pid = only(journal(dsn, job, "tool_request_started"), "tool_request_started")[
        "details"]["pid"]
    assert not pid_alive(child_pid)
    killed = only(journal(dsn, job, "child_killed"), "child_killed")["details"]
    assert killed["reason"] == "stage_timeout"
    assert killed["signal"] == "SIGKILL"  # SIGTERM was ignored; the grace ran out
    assert killed["survivors"] == 0
    only(journal(dsn, job, "job_failed"), "job_failed")
    assert_no_crash_text(sc, "NoSuchProcess")


# --- 2. F7: the tree kill reaches every descendant, and only them -----------------


def test_f7_tree_kill_reaches_every_descendant_and_spares_the_other_job(dsn, sidecars,
                                                                        tmp_path):
    stage = 2.0
    tree_pidfile = tmp_path / "tree.pids"
    slow_pidfile, gofile = tmp_path / "slow.pid", tmp_path / "go"
    tree_job = enqueue(dsn, "cp-tree", {"pidfile": str(tree_pidfile), "tree": True},
                       "--max-attempts", "1")
    slow_job = enqueue(dsn, "cp-slow", {"pidfile": str(slow_pidfile), "gofile": str(gofile),
                                        "max_wait": 30}, "--max-attempts", "1")
    tree_sc = sidecars(dsn, [HANG_TREE], "--tool", "cp-tree", "--drain",
                       env=base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS=f"{stage:g}"))
    slow_sc = sidecars(dsn, [CP_SLOW], "--tool", "cp-slow", "--drain")

    tree_pids = read_pids(tree_pidfile, 4)  # tool, normal, double-forked, setsid
    slow_pid = read_pids(slow_pidfile, 1)[0]
    assert all(pid_alive(pid) for pid in tree_pids)
    assert os.getsid(tree_pids[3]) != tree_pids[0]  # really left the tool's session

    wait_until(lambda: job_state(dsn, tree_job) == "failed", 20, what="tree job failed")
    # Once the row is failed, the kill has finished: every descendant is gone.
    assert [pid for pid in tree_pids if pid_alive(pid)] == []
    # The other job's tool is untouched and still at work.
    assert pid_alive(slow_pid)
    assert job_state(dsn, slow_job) == "running"

    gofile.touch()
    assert slow_sc.wait(30) == 0
    assert tree_sc.wait(30) == 0

    tree_row = job_row(dsn, tree_job)
    assert tree_row["error"]["kind"] == "stage_timeout"
    killed = only(journal(dsn, tree_job, "child_killed"), "child_killed")["details"]
    assert killed["reason"] == "stage_timeout" and killed["signal"] == "SIGKILL"
    assert killed["killed"] >= 4 and killed["survivors"] == 0
    # All gone within deadline + grace + 1 s (plus slack for a busy machine).
    elapsed = seconds_between(dsn, tree_job, "tool_request_started", "child_killed")
    assert elapsed < stage + 1 + 1 + 3, f"tree kill took {elapsed:.2f}s"

    slow_row = job_row(dsn, slow_job)
    assert slow_row["state"] == "succeeded"
    assert slow_row["result"] == {"ok": True, "pid": slow_pid}
    assert slow_row["attempt"] == 1
    assert journal(dsn, slow_job, "child_killed") == []
    for sc in (tree_sc, slow_sc):
        assert_no_crash_text(sc, "NoSuchProcess")


# --- 3. F6: a grandchild holding stdout does not hold the job ---------------------


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_f6_grandchild_holding_the_pipe_does_not_hold_the_job(dsn, sidecars, tmp_path,
                                                              event_loop):
    pidfile = tmp_path / "sleep.pid"
    script = ("sleep 600 & echo $! > " + shlex.quote(str(pidfile))
              + '; echo "{\\"ok\\":true}"; exit 0')
    job = enqueue(dsn, "cp-f6", {}, "--max-attempts", "1")
    # A sidecar that waited for pipe EOF would end in stage_timeout after 10 s instead.
    sc = sidecars(dsn, ["sh", "-c", script], "--tool", "cp-f6", "--drain",
                  env=base_env(dsn, SIDECAR_EVENT_LOOP=event_loop,
                               SIDECAR_STAGE_TIMEOUT_SECONDS="10"))
    assert sc.wait(30) == 0

    sleep_pid = read_pids(pidfile, 1)[0]
    assert not pid_alive(sleep_pid), "the orphaned sleep survived the job"
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"ok": True}
    assert row["attempt"] == 1
    elapsed = seconds_between(dsn, job, "tool_request_started", "job_succeeded")
    assert elapsed < 5, f"the job took {elapsed:.2f}s after the tool started"
    killed = only(journal(dsn, job, "child_killed"), "child_killed")["details"]
    assert killed["reason"] == "orphaned_descendants" and killed["survivors"] == 0
    assert_no_crash_text(sc, "NoSuchProcess")


# --- 4. F5: large stdin, chatty stderr, big result; a tool that never reads stdin --


def test_f5_large_payload_and_chatty_output_do_not_deadlock(dsn, sidecars):
    blob = "p" * MIB
    raw = orjson.dumps({"blob": blob})
    job = enqueue_raw(dsn, "cp-chatty", raw, "--max-attempts", "1")
    # A deadlock would end in stage_timeout after 15 s, not hang the test.
    sc = sidecars(dsn, [CP_CHATTY, str(MIB), str(5 * MIB)], "--tool", "cp-chatty", "--drain",
                  env=base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="15"))
    assert sc.wait(40) == 0

    row = query(dsn, "SELECT state, error, attempt, (result->>'payload_blob_len')::int AS n, "
                     "length(result->>'data') AS data_len FROM tool_jobs WHERE id = $1::uuid",
                job)[0]
    assert row["state"] == "succeeded", row["error"]
    assert row["n"] == MIB  # the whole payload reached the tool
    assert row["data_len"] == 5 * MIB  # the whole result was stored
    assert row["attempt"] == 1
    elapsed = seconds_between(dsn, job, "tool_request_started", "job_succeeded")
    assert elapsed < 10, f"F5 job took {elapsed:.2f}s"
    assert_no_crash_text(sc, "BrokenPipe")


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_f5_tool_exiting_without_reading_stdin_fails_with_its_exit_code(dsn, sidecars,
                                                                        event_loop):
    raw = orjson.dumps({"blob": "p" * MIB})
    job = enqueue_raw(dsn, "cp-noread", raw, "--max-attempts", "1")
    sc = sidecars(dsn, [CP_EXIT, "3"], "--tool", "cp-noread", "--drain",
                  env=base_env(dsn, SIDECAR_EVENT_LOOP=event_loop,
                               SIDECAR_STAGE_TIMEOUT_SECONDS="15"))
    assert sc.wait(40) == 0

    row = job_row(dsn, job)
    assert row["state"] == "failed"
    assert row["error"]["kind"] == "exit_code"
    assert row["error"]["exit_code"] == 3
    assert row["attempt"] == 1
    assert_no_crash_text(sc, "BrokenPipe", "EPIPE")


# --- 5. a huge stdout fails result_too_large with bounded memory -----------------


def test_huge_stdout_fails_result_too_large_with_bounded_memory(dsn, sidecars):
    total = 200 * MIB
    job = enqueue(dsn, "cp-flood", {"stdout_bytes": total, "stderr_bytes": 0},
                  "--max-attempts", "1")
    # No --drain: the sidecar stays up so its peak RSS can be read after the job.
    sc = sidecars(dsn, [CP_FLOOD], "--tool", "cp-flood",
                  env=base_env(dsn, SIDECAR_MAX_RESULT_BYTES=str(MIB),
                               SIDECAR_STAGE_TIMEOUT_SECONDS="60"))
    proc = psutil.Process(sc.pid)
    peak = 0
    deadline = time.monotonic() + 60
    while job_state(dsn, job) not in ("failed", "succeeded") and time.monotonic() < deadline:
        try:
            peak = max(peak, proc.memory_info().rss, vm_hwm_bytes(sc.pid) or 0)
        except psutil.Error:
            break
        time.sleep(0.05)
    assert sc.proc.poll() is None, "the sidecar died"
    peak = max(peak, vm_hwm_bytes(sc.pid) or 0)  # VmHWM: the peak over its whole life

    row = job_row(dsn, job)
    assert row["state"] == "failed", row
    assert row["error"]["kind"] == "result_too_large"
    assert "1048576" in row["error"]["message"]  # the cap, named
    # The result was lost at the cap, so the tool was stopped there, not left to write on.
    killed = query(dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 AND event = "
                        "'child_killed'", job)
    assert killed and killed[0]["details"]["reason"] == "result_too_large"
    assert total > 1048576
    assert row["attempt"] == 1
    assert 0 < peak < 150 * MIB, f"sidecar peak RSS {peak / MIB:.1f} MiB"
    assert_no_crash_text(sc)


# --- 6. a missing binary -------------------------------------------------------


def test_a_missing_or_non_executable_command_is_refused_at_start(dsn, sidecars, tmp_path):
    """A typo in the tool path used to turn every queued job into a permanent
    spawn_failed within a second; now `run` refuses at start and nothing is claimed."""
    job = enqueue(dsn, "nosuch", {}, "--max-attempts", "3")
    not_executable = tmp_path / "tool.sh"
    not_executable.write_text("#!/bin/sh\necho '{}'\n")
    for command in ("/nonexistent/tool", str(not_executable), "no-such-tool-on-path"):
        sc = sidecars(dsn, [command], "--tool", "nosuch", "--drain")
        assert sc.wait(30) == 2
        err = sc.stderr_text()
        assert len(err.strip().splitlines()) == 1 and command in err, err
        assert "Traceback" not in err
    row = job_row(dsn, job)
    assert (row["state"], row["attempt"], row["fencing_token"]) == ("queued", 0, 0)


def test_a_binary_gone_after_start_fails_spawn_failed_once_with_one_clear_line(
        dsn, sidecars, tmp_path):
    tool = tmp_path / "vanishing-tool"
    tool.write_text("#!/bin/sh\necho '{}'\n")
    tool.chmod(0o755)
    sc = sidecars(dsn, [str(tool)], "--tool", "nosuch")
    sc.wait_event("worker_started")
    tool.unlink()  # e.g. an image upgrade under a running sidecar
    job = enqueue(dsn, "nosuch", {}, "--max-attempts", "3")
    wait_until(lambda: job_state(dsn, job) == "failed", 20, what="the job to fail")

    row = job_row(dsn, job)
    assert row["error"]["kind"] == "spawn_failed"
    assert row["error"]["exit_code"] == 127
    assert str(tool) in row["error"]["message"]
    assert row["attempt"] == 1 and row["fencing_token"] == 1
    assert journal(dsn, job, "job_retry_scheduled") == []

    assert_all_lines_json(sc)
    assert_no_crash_text(sc)
    spawn = [e for e in sc.events("spawn_failed") if e.get("job_id") == str(job)]
    assert len(spawn) == 1
    assert str(tool) in spawn[0]["reason"] and "not found" in spawn[0]["reason"]


# --- 7. a result that is not JSON -----------------------------------------------


def test_non_json_result_fails_bad_result_without_retry(dsn, sidecars):
    job = enqueue(dsn, "cp-hello", {}, "--max-attempts", "3")
    sc = sidecars(dsn, ["sh", "-c", "echo hello"], "--tool", "cp-hello", "--drain")
    assert sc.wait(30) == 0

    row = job_row(dsn, job)
    assert row["state"] == "failed"
    assert row["error"]["kind"] == "bad_result"
    assert row["result"] is None
    assert row["attempt"] == 1 and row["fencing_token"] == 1
    assert journal(dsn, job, "job_retry_scheduled") == []
    assert_no_crash_text(sc)


# --- 8. non-retryable exit codes ------------------------------------------------


def test_non_retryable_exit_codes_fail_at_the_first_attempt(dsn, sidecars):
    override = {"SIDECAR_PROFILE_CP_EXIT7_NON_RETRYABLE_EXIT_CODES": "7"}
    env = base_env(dsn, **override)
    job64 = enqueue(dsn, "cp-exit64", {}, "--max-attempts", "3", env=env)
    job7 = enqueue(dsn, "cp-exit7", {}, "--max-attempts", "3", env=env)
    sc64 = sidecars(dsn, [CP_EXIT, "64"], "--tool", "cp-exit64", "--drain", env=env)
    sc7 = sidecars(dsn, [CP_EXIT, "7"], "--tool", "cp-exit7", "--drain", env=env)
    assert sc64.wait(30) == 0
    assert sc7.wait(30) == 0

    for job, code in ((job64, 64), (job7, 7)):
        row = job_row(dsn, job)
        assert row["state"] == "failed", (code, row)
        assert row["error"]["kind"] == "exit_code"
        assert row["error"]["exit_code"] == code
        assert row["attempt"] == 1 and row["max_attempts"] == 3, (code, row["attempt"])
        assert journal(dsn, job, "job_retry_scheduled") == []
    for sc in (sc64, sc7):
        assert_no_crash_text(sc)


# --- 9. a retryable exit code ---------------------------------------------------


def test_retryable_exit_code_runs_every_attempt_with_backoff(dsn, sidecars):
    job = enqueue(dsn, "cp-exit3", {}, "--max-attempts", "3")
    sc = sidecars(dsn, [CP_EXIT, "3"], "--tool", "cp-exit3", "--drain")
    assert sc.wait(40) == 0

    row = job_row(dsn, job)
    assert row["state"] == "failed"
    assert row["attempt"] == 3 and row["fencing_token"] == 3
    assert row["error"]["kind"] == "exit_code" and row["error"]["exit_code"] == 3
    assert "cp_exit: attempt 3 exits with 3" in row["error"]["stderr_tail"]

    assert [r["fencing_token"] for r in journal(dsn, job, "job_claimed")] == [1, 2, 3]
    retries = journal(dsn, job, "job_retry_scheduled")
    assert [r["fencing_token"] for r in retries] == [1, 2]
    for retry in retries:
        assert retry["details"]["kind"] == "exit_code"
        # run_after lies after the failing attempt, and the next claim waited for it.
        later = scalar(dsn, """
            SELECT ($2::text)::timestamptz > e.at
               AND ($2::text)::timestamptz <= (SELECT at FROM tool_job_events
                                               WHERE job_id = e.job_id AND event = 'job_claimed'
                                                 AND fencing_token = e.fencing_token + 1)
            FROM tool_job_events e WHERE e.id = $1""", retry["id"], retry["details"]["run_after"])
        assert later is True, retry
    only(journal(dsn, job, "job_failed"), "job_failed")
    assert_no_crash_text(sc)


# --- 10. event-loop lag while children flood and spawn ---------------------------


def test_event_loop_lag_stays_low_while_children_flood_and_spawn(dsn, monkeypatch, tmp_path):
    """An in-process Worker: 8 children at a time flood stdout and stderr while new ones keep
    spawning. The loop must stay responsive (heartbeats run on it) and no lease is lost."""
    tool, jobs, concurrency = "cp-flood", 40, 8
    settings = load_settings(base_env(dsn, SIDECAR_MAX_RESULT_BYTES=str(MIB),
                                      SIDECAR_STAGE_TIMEOUT_SECONDS="60"))
    profile = settings.profile(tool)
    sink = io.BytesIO()
    monkeypatch.setattr(log_mod.log, "stream", sink)
    monkeypatch.setattr(log_mod.log, "fmt", "json")
    monkeypatch.setattr(log_mod.log, "threshold", 20)

    def payload(i: int) -> dict:
        if i % 2 == 0:  # a valid 512 KiB JSON result
            return {"stdout_bytes": MIB // 2, "stderr_bytes": 2 * MIB, "json": True}
        return {"stdout_bytes": 3 * MIB, "stderr_bytes": 2 * MIB, "json": False}

    async def go():
        pool = await db.create_pool(dsn, 5, max_size=2)
        store = CallerStore(pool, 5)
        ids = [(await store.enqueue(tool, payload(i), None, 1, {}))[0] for i in range(jobs)]
        await pool.close()
        worker = Worker(settings, profile, dsn, [CP_FLOOD], concurrency=concurrency,
                        drain=True, adopt_orphans=False)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        lags: list[float] = []

        async def probe():
            while not stop.is_set():
                start = loop.time()
                await asyncio.sleep(0.01)
                lags.append(loop.time() - start - 0.01)

        probe_task = asyncio.create_task(probe())
        try:
            code = await asyncio.wait_for(worker.run(), 90)
        finally:
            stop.set()
            await probe_task
        return ids, code, lags

    started = time.monotonic()
    ids, code, lags = asyncio.run(go())
    elapsed = time.monotonic() - started
    log_path = tmp_path / "worker.log"
    log_path.write_bytes(sink.getvalue())  # kept for a post-mortem
    assert code == 0

    rows = {r["id"]: r for r in query(dsn, "SELECT id, state, error->>'kind' AS kind "
                                           "FROM tool_jobs")}
    outcomes = [(rows[job_id]["state"], rows[job_id]["kind"]) for job_id in ids]
    assert outcomes == [("succeeded", None) if i % 2 == 0 else ("failed", "result_too_large")
                        for i in range(jobs)]

    events = [orjson.loads(line) for line in sink.getvalue().splitlines() if line.strip()]
    assert len(lags) > 50
    worst = max(lags)
    problems = []
    # Bounded by one heartbeat period: on this 2-core machine eight flooding children
    # preempt the sidecar itself (the lag shows inside os.read and send, not in Python
    # code), by 0.25-0.45 s at times on the base commit too; what P9 needs is that no
    # renewal is late by a whole period, and that no lease is lost (checked below).
    if worst >= profile.heartbeat_seconds:
        problems.append(f"event-loop lag {worst * 1000:.0f} ms (run {elapsed:.1f}s, "
                        f"{len(lags)} samples)")
    for bad in ("heartbeat_lost", "lease_abandoned", "supervisor_error", "worker_failed"):
        problems += [f"{bad}: {e}" for e in events if e["event"] == bad]
    # The journal must not claim a lost lease for a job that ended normally.
    problems += [f"journal {r['event']} after {r['ended']}: job {r['job_id']} {r['details']}"
                 for r in query(dsn, """
        SELECT e.job_id, e.event, e.details, j.state || '/' || coalesce(j.error->>'kind', '')
               AS ended
        FROM tool_job_events e JOIN tool_jobs j ON j.id = e.job_id
        WHERE e.event IN ('heartbeat_lost', 'result_rejected') ORDER BY e.id""")]
    assert not problems, (f"max lag {worst * 1000:.0f} ms; log {log_path}\n"
                          + "\n".join(problems))


# --- 11. no zombie children while the sidecar runs ------------------------------


def test_no_zombie_children_of_a_running_sidecar_after_a_tree_kill(dsn, sidecars, tmp_path):
    pidfile = tmp_path / "tree.pids"
    job = enqueue(dsn, "cp-tree", {"pidfile": str(pidfile), "tree": True}, "--max-attempts", "1")
    # No --drain: the sidecar must stay up and keep its adopted children reaped.
    sc = sidecars(dsn, [HANG_TREE], "--tool", "cp-tree",
                  env=base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="3"))
    tree_pids = read_pids(pidfile, 4)
    # The double-forked process was adopted by the sidecar (a child subreaper).
    assert psutil.Process(tree_pids[2]).ppid() == sc.pid

    wait_until(lambda: job_state(dsn, job) == "failed", 20, what="tree job failed")
    assert [pid for pid in tree_pids if pid_alive(pid)] == []
    wait_until(lambda: not zombie_children(sc.pid), 5, interval=0.1,
               what=f"no zombie children of sidecar {sc.pid}")
    assert sc.proc.poll() is None, "the sidecar exited"
    left = {child.pid for child in psutil.Process(sc.pid).children()}
    assert not left & set(tree_pids), "tree processes still parented to the sidecar"
    assert job_row(dsn, job)["error"]["kind"] == "stage_timeout"
    assert_no_crash_text(sc, "NoSuchProcess")
