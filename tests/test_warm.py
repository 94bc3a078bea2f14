"""Warm mode (issue 43, point 1; docs/child-process.md "Warm mode"): one tool process
serves consecutive jobs of a slot over one JSON line each way, and every job keeps its
own lease, deadline, fencing and journal. Real `sidecar run` processes, a real
PostgreSQL, a real warm tool (tests/tools/warm_tool.py: it counts the jobs it served)
and the two documented examples (examples/warm/)."""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from kit import (
    TOOLS,
    SidecarProcess,
    base_env,
    cli,
    enqueue,
    job_row,
    journal_details,
    parse_events,
    pid_alive,
    sandbox_extra_paths,
    wait_until,
)

pytestmark = pytest.mark.e2e

WARM_TOOL = [sys.executable, str(TOOLS / "warm_tool.py")]
EXAMPLES = TOOLS.parent.parent / "examples" / "warm"


def _env(dsn, **extra):
    return base_env(dsn, **{"SIDECAR_PROCESS": "warm", "SIDECAR_STAGE_TIMEOUT_SECONDS": "3",
                            **extra})


def _run(dsn, env, tool, modes, command=WARM_TOOL, *options):
    """Enqueue one job per payload mode (one attempt each), drain them with one slot (in
    order), and return (job ids, the drain's events)."""
    ids = [enqueue(dsn, tool, {"mode": mode}, "--max-attempts", "1", env=env)
           for mode in modes]
    done = cli(dsn, "run", "--tool", tool, "--drain", *options, "--", *command, env=env,
               timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return ids, parse_events(done.stderr)


def _results(dsn, ids):
    return [job_row(dsn, job)["result"] for job in ids]


def _events(events, name):
    return [e for e in events if e["event"] == name]


def test_one_warm_process_serves_consecutive_jobs_and_keeps_its_state(dsn):
    """Three jobs, one process: the same pid answers, its own count goes 1, 2, 3 (the
    state is kept), each request carries that job's id, fencing token and idempotency
    key, the process has SIDECAR_PROCESS_ID and no job's variables, each job's journal
    says which process ran it, and the drain stops it (its pid gone)."""
    env = _env(dsn)
    ids, events = _run(dsn, env, "warm", ["count"] * 3)
    results = _results(dsn, ids)
    assert [r["served"] for r in results] == [1, 2, 3]
    assert len({r["pid"] for r in results}) == 1
    for job, result in zip(ids, results, strict=True):
        row = job_row(dsn, job)
        assert (result["job_id"], result["token"], result["key"]) == \
            (str(job), row["fencing_token"], f"tool-job:{job}")
        assert result["process"] and not result["has_job_env"]
    started = [journal_details(dsn, job, "tool_request_started")[0] for job in ids]
    assert [s["warm"]["jobs_before"] for s in started] == [0, 1, 2]
    assert [s["warm"]["fresh"] for s in started] == [True, False, False]
    assert {s["pid"] for s in started} == {results[0]["pid"]}
    assert [e["reason"] for e in _events(events, "warm_process_stopped")] == ["shutdown"]
    assert not pid_alive(results[0]["pid"])


def test_a_job_past_its_stage_deadline_kills_the_whole_warm_tree_and_the_next_is_fresh(dsn):
    """A job that never answers fails ``stage_timeout``; the process and the child an
    earlier job left running in its tree are killed, and the next job runs in a new
    process whose count starts again."""
    env = _env(dsn)
    ids, events = _run(dsn, env, "warm", ["child", "hang", "count"])
    first, hung, after = (job_row(dsn, job) for job in ids)
    assert first["state"] == "succeeded"
    assert (hung["state"], hung["error"]["kind"]) == ("failed", "stage_timeout")
    assert after["state"] == "succeeded"
    assert after["result"]["served"] == 1 and after["result"]["pid"] != first["result"]["pid"]
    assert not pid_alive(first["result"]["pid"])
    assert not pid_alive(first["result"]["child"])
    assert [e["reason"] for e in _events(events, "warm_process_stopped")] == \
        ["stage_timeout", "shutdown"]
    assert journal_details(dsn, ids[1], "child_killed")[0]["reason"] == "stage_timeout"


def test_max_jobs_per_process_replaces_the_process_when_its_job_ends(dsn):
    env = _env(dsn, SIDECAR_MAX_JOBS_PER_PROCESS="2")
    ids, events = _run(dsn, env, "warm", ["count"] * 3)
    results = _results(dsn, ids)
    assert [r["served"] for r in results] == [1, 2, 1]
    assert results[0]["pid"] == results[1]["pid"] != results[2]["pid"]
    assert [e["reason"] for e in _events(events, "warm_process_stopped")] == \
        ["max_jobs", "shutdown"]


def test_what_a_warm_process_answers_decides_its_job_and_whether_it_is_kept(dsn):
    """An ``error`` answer fails its job as that exit code would (65: not retried) and
    keeps the process; a line that is not JSON fails ``bad_result`` and keeps it; two
    lines for one request fail ``bad_result`` and end it; an exit while holding a job
    fails that job by its exit code; exit 0 without an answer is ``bad_result``; an
    answer naming another job fails ``bad_result`` and ends the process; each job after
    one that ended the process runs in a fresh one."""
    env = _env(dsn)
    modes = ["count", "error", "garbage", "count", "chatty", "count", "exit", "count",
             "exit0", "count", "stranger", "count"]
    ids, events = _run(dsn, env, "warm", modes)
    rows = [job_row(dsn, job) for job in ids]
    kinds = [(r["state"], (r["error"] or {}).get("kind")) for r in rows]
    assert kinds == [("succeeded", None), ("failed", "exit_code"), ("failed", "bad_result"),
                     ("succeeded", None), ("failed", "bad_result"), ("succeeded", None),
                     ("failed", "exit_code"), ("succeeded", None), ("failed", "bad_result"),
                     ("succeeded", None), ("failed", "bad_result"), ("succeeded", None)]
    assert rows[1]["error"]["exit_code"] == 65 and "refused" in rows[1]["error"]["message"]
    assert rows[6]["error"]["exit_code"] == 3
    served = [rows[i]["result"]["served"] for i in (0, 3, 5, 7, 9, 11)]
    assert served == [1, 4, 1, 1, 1, 1]
    assert "answers job" in rows[10]["error"]["message"]
    assert sorted(e["reason"] for e in _events(events, "warm_process_stopped")) == \
        sorted(["broken", "exited", "exited", "broken", "shutdown"])


def test_a_cancelled_job_kills_its_warm_process(dsn, tmp_path):
    """An operator's cancel of the job a warm process is running: the job ends
    ``cancelled``, the process's tree is killed, and the next job gets a fresh one."""
    env = _env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    first = enqueue(dsn, "warm", {"mode": "count"}, env=env)
    sidecar = SidecarProcess(dsn, WARM_TOOL, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, first)["state"] == "succeeded", 30,
                   what="the first job")
        pid = job_row(dsn, first)["result"]["pid"]
        hung = enqueue(dsn, "warm", {"mode": "hang"}, env=env)
        wait_until(lambda: journal_details(dsn, hung, "tool_request_started"), 30,
                   what="the hanging job started")
        done = cli(dsn, "cancel", str(hung), env=env)
        assert done.returncode == 0, done.stderr.decode()
        wait_until(lambda: not pid_alive(pid), 15, what="the warm process killed")
        assert job_row(dsn, hung)["state"] == "cancelled"
        after = enqueue(dsn, "warm", {"mode": "count"}, env=env)
        wait_until(lambda: job_row(dsn, after)["state"] == "succeeded", 30,
                   what="the next job")
        assert job_row(dsn, after)["result"]["served"] == 1
        assert job_row(dsn, after)["result"]["pid"] != pid
    finally:
        sidecar.stop()


def test_an_idle_warm_process_that_floods_stdout_is_not_given_the_next_job(dsn, tmp_path):
    """Output no request asked for, written while the process is idle: at most
    MAX_RESULT_BYTES of it is kept, and the next job runs in a fresh process (the old one
    logged broken and gone), never taking a flooded line for its answer."""
    env = _env(dsn, SIDECAR_MAX_RESULT_BYTES="4096")
    first = enqueue(dsn, "warm", {"mode": "flood"}, env=env)
    sidecar = SidecarProcess(dsn, WARM_TOOL, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, first)["state"] == "succeeded", 30,
                   what="the first job")
        pid = job_row(dsn, first)["result"]["pid"]
        time.sleep(1.5)  # the flood comes half a second after the answer
        after = enqueue(dsn, "warm", {"mode": "count"}, env=env)
        wait_until(lambda: job_row(dsn, after)["state"] == "succeeded", 30,
                   what="the next job")
        result = job_row(dsn, after)["result"]
        assert (result["served"], result["pid"] != pid) == (1, True)
        broken = sidecar.wait_event("warm_process_broken", 10)
        assert broken["pid"] == pid
        wait_until(lambda: not pid_alive(pid), 10, what="the flooding process gone")
    finally:
        sidecar.stop()


def test_a_warm_process_no_job_took_for_warm_idle_seconds_is_stopped(dsn, tmp_path):
    env = _env(dsn, SIDECAR_WARM_IDLE_SECONDS="1")
    job = enqueue(dsn, "warm", {"mode": "count"}, env=env)
    sidecar = SidecarProcess(dsn, WARM_TOOL, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, job)["state"] == "succeeded", 30, what="the job")
        pid = job_row(dsn, job)["result"]["pid"]
        event = sidecar.wait_event("warm_process_stopped", 15)
        assert (event["reason"], event["jobs"], event["pid"]) == ("idle", 1, pid)
        assert not pid_alive(pid)
    finally:
        sidecar.stop()


@pytest.mark.parametrize("example", ["echo.py", "echo.js"])
def test_the_documented_warm_examples_serve_jobs_in_one_process(dsn, example):
    """docs/child-process.md's two examples, as shipped: each answers two jobs with their
    payloads from one process."""
    if example.endswith(".js") and shutil.which("node") is None:
        pytest.skip("node is not installed (CI installs it: .ci/run)")
    command = [str(EXAMPLES / example)]
    env = _env(dsn)
    ids = [enqueue(dsn, "echo", {"n": n}, env=env) for n in (1, 2)]
    done = cli(dsn, "run", "--tool", "echo", "--drain", "--", *command, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert _results(dsn, ids) == [{"echo": {"n": 1}}, {"echo": {"n": 2}}]
    assert len(_events(parse_events(done.stderr), "warm_process_started")) == 1


def test_a_line_mode_child_keeps_no_more_than_its_cap_of_output_nobody_asked_for():
    """Child in line mode (sidecar.worker.child), a real process that writes 1 MB of lines
    with no request pending: at most ``max_stdout`` bytes are held, then the overflow
    is flagged and ``request`` refuses the process."""
    import asyncio

    from sidecar.worker.child import Child, LineBroken

    async def run():
        launched = await Child.launch(
            ["/bin/sh", "-c", 'i=0; while [ $i -lt 20000 ]; do echo "0123456789abcdef'
             '0123456789abcdef0123456789abcdef"; i=$((i+1)); done; exec sleep 30'],
            {"PATH": "/usr/bin:/bin", "LINE_TEST": "flood"})
        child = Child.start(launched, b"", 4096, lambda line: None, {"LINE_TEST": "flood"},
                            lines=True)
        try:
            for _ in range(200):
                if child.stdout_overflow:
                    break
                assert len(child.stdout) <= 4096
                await asyncio.sleep(0.05)
            assert child.stdout_overflow and child.overflowed.done()
            assert len(child.stdout) == 0
            with pytest.raises(LineBroken):
                child.request(b"{}\n")
        finally:
            await child.kill_tree(0.5)
            await child.close_pipes(1.0)

    asyncio.run(run())


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
def test_a_warm_process_whose_secrets_directory_was_replaced_serves_no_further_job(
        dsn, sidecars, public_dir):
    """A warm process's sandbox hides the secrets' directory object it found at its start.
    The host rotates that directory (renamed away, a new one in its place), which a
    long-lived sandbox would then show. The next job gets a fresh process whose sandbox
    hides the new one; the old process is stopped with reason sandbox_moved."""
    base = public_dir(0o700, 0, "/var/tmp")
    secrets = base / "s"
    secrets.mkdir()
    secret = secrets / "url"
    secret.write_text(dsn + "\n")
    env = _env(dsn, SIDECAR_SANDBOX="required", SIDECAR_DATABASE_URL_FILE=str(secret))
    del env["SIDECAR_DATABASE_URL"]
    if sandbox_extra_paths():
        env["SIDECAR_EXTRA_PATHS"] = sandbox_extra_paths()
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = enqueue(dsn, "warm", {"mode": "read", "path": str(secret)}, "--max-attempts", "1",
                    env=env)
    wait_until(lambda: job_row(dsn, first)["state"] == "failed", 30, what="the first read")
    secrets.rename(base / "s.old")
    secrets.mkdir()
    secret.write_text(dsn + "\n")
    second = enqueue(dsn, "warm", {"mode": "read", "path": str(secret)}, "--max-attempts", "1",
                     env=env)
    wait_until(lambda: job_row(dsn, second)["state"] in ("failed", "succeeded"), 30,
               what="the second read")
    row = job_row(dsn, second)
    assert row["state"] == "failed" and row["result"] is None, row
    assert sc.wait_event("warm_process_stopped", 15, reason="sandbox_moved")
    started = [journal_details(dsn, job, "tool_request_started")[0]["warm"]
               for job in (first, second)]
    assert started[0]["process_id"] != started[1]["process_id"] and started[1]["fresh"]
