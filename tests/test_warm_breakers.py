"""Breakers of warm mode (issue 43, point 1; docs/child-process.md "Warm mode"): races,
shutdown, limits and hostile answers aimed at the promises each job of a warm process
keeps. Real `sidecar run` processes (or an in-process Worker where the event loop itself
is measured), a real PostgreSQL and a real warm tool (tests/tools/warm_breaker.py).

The first group reproduces defects (each fails on the code it was written against and
passes once the defect is fixed); the second holds promises tests/test_warm.py does not
cover."""

from __future__ import annotations

import asyncio
import io
import signal
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
    owner_processes,
    parse_events,
    pid_alive,
    sandbox_extra_paths,
    wait_until,
)

pytestmark = pytest.mark.e2e

BREAKER = [sys.executable, str(TOOLS / "warm_breaker.py")]
MIB = 1024 * 1024


def _env(dsn, **extra):
    return base_env(dsn, **{"SIDECAR_PROCESS": "warm", "SIDECAR_STAGE_TIMEOUT_SECONDS": "5",
                            **extra})


def _drain(dsn, env, payloads, command=BREAKER, *options, tool="warm"):
    """Enqueue one job per payload (one attempt each), drain them with one slot (in
    order); return (job ids, the drain's events)."""
    ids = [enqueue(dsn, tool, payload, "--max-attempts", "1", env=env) for payload in payloads]
    done = cli(dsn, "run", "--tool", tool, "--drain", *options, "--", *command, env=env,
               timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return ids, parse_events(done.stderr)


def _succeeded(dsn, job, timeout=30):
    wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed", "cancelled"),
               timeout, what=f"job {job} ended")
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row
    return row["result"]


# --- defects --------------------------------------------------------------------------------


def test_a_shutdown_while_an_idle_warm_process_is_being_stopped_still_stops_it(dsn, tmp_path):
    """WARM_IDLE_SECONDS stops an idle process: its stdin is closed and it gets the kill
    grace to exit. A SIGTERM of the sidecar during that grace cancels the idle-stopper
    task (Worker._stop_background) in the middle of stop_warm_process; the process was
    already taken off the idle list, so WarmPool.close does not see it either. Nothing of
    the sidecar stops it (no SIGTERM, no warm_process_stopped, its work directory and
    cgroup not removed by the sidecar): only the guardian's SIGKILL after the exit does.
    Expected: the stop begun goes on (or close() finishes it) before the sidecar exits."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = _env(dsn, SIDECAR_WARM_IDLE_SECONDS="1", SIDECAR_KILL_GRACE_SECONDS="3",
               SIDECAR_LEASE_SECONDS="10")
    job = enqueue(dsn, "warm", {"mode": "count"}, env=env)
    sidecar = SidecarProcess(dsn, [*BREAKER, "--linger", str(marks)], "--tool", "warm",
                             env=env, tmp=tmp_path)
    try:
        pid = _succeeded(dsn, job)["pid"]
        # The idle stop has begun: the tool saw EOF on its stdin and lingers.
        wait_until(lambda: (marks / f"eof-{pid}").exists(), 15, what="the idle stop begun")
        sidecar.proc.send_signal(signal.SIGTERM)
        code = sidecar.wait(40)
    finally:
        sidecar.stop()
    assert code == 0, sidecar.stderr_text()[-3000:]
    stopped = [e for e in sidecar.events("warm_process_stopped") if e.get("pid") == pid]
    assert (marks / f"term-{pid}").exists() and stopped, (
        f"the sidecar exited without stopping its warm process {pid} (no SIGTERM reached "
        f"it: {sorted(p.name for p in marks.iterdir())}; warm_process_stopped: {stopped})")


def test_an_idle_warm_process_past_max_process_seconds_serves_no_further_job(dsn, tmp_path):
    """MAX_PROCESS_SECONDS bounds a process's age (a leaking browser is replaced). It is
    only looked at when a job ends (WarmPool.give_back): a process that grew too old while
    idle is handed to the next job by WarmPool.take as it is, and serves it. Expected: a
    job never starts in a process older than MAX_PROCESS_SECONDS (a fresh one instead)."""
    env = _env(dsn, SIDECAR_MAX_PROCESS_SECONDS="1")
    first = enqueue(dsn, "warm", {"mode": "count"}, env=env)
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        before = _succeeded(dsn, first)
        time.sleep(2.5)  # the idle process is now past MAX_PROCESS_SECONDS
        after = _succeeded(dsn, enqueue(dsn, "warm", {"mode": "count"}, env=env))
    finally:
        sidecar.stop()
    assert (after["served"], after["pid"] != before["pid"]) == (1, True), (
        f"a process {after['served'] - 1} job(s) and over 2.5 s old (MAX_PROCESS_SECONDS=1) "
        f"served the next job: {before} then {after}")


def test_a_late_second_line_of_one_job_is_never_taken_for_the_next_jobs_answer(dsn):
    """A tool writes its answer to job 1, then, 0.5 s later, one more line (a library's
    late print, a thread finishing): a second line for one request, which the docs say
    fails the job and ends the process. Only a second line already buffered when the
    answer is judged is seen (``elif child.stdout``); a later one, arriving after job 2's
    request was written, is taken as job 2's answer (stored as job 2's result), and job
    2's real answer, arriving after, becomes job 3's. Expected: no job's result is
    another job's answer (the late line fails job 2 or its process, never answers it)."""
    env = _env(dsn)
    ids, _events = _drain(dsn, env, [{"mode": "late_line", "delay": 0.5},
                                     {"mode": "slow", "delay": 1.5},
                                     {"mode": "count"}])
    rows = [job_row(dsn, job) for job in ids]
    wrong = [(str(job), row["result"]) for job, row in zip(ids, rows, strict=True)
             if row["state"] == "succeeded" and row["result"].get("job_id") != str(job)]
    assert not wrong, f"results taken from another job's line: {wrong}"


def test_a_large_warm_answer_is_not_parsed_on_the_event_loop(dsn, monkeypatch, tmp_path):
    """A per-job tool's result over 64 KiB is parsed off the event loop (supervisor.
    PARSE_ON_LOOP_BYTES: the loop heartbeats every lease). A warm answer of any size is
    parsed on it (JobSupervisor._answered: check_no_secret, parse_result, split_next_stage
    and freeing the value), so an 8 MiB answer of exact numbers (the slow, exact parse)
    stalls the loop past a heartbeat period while another job's lease needs renewing.
    Expected: the loop stays under one heartbeat period late, as in per-job mode."""
    from sidecar.runtime import log as log_mod
    from sidecar.runtime.config import load_settings
    from sidecar.storage import db
    from sidecar.storage.caller_store import CallerStore
    from sidecar.worker.claim_loop import Worker

    tool = "warm"
    settings = load_settings(_env(dsn, SIDECAR_MAX_RESULT_BYTES=str(16 * MIB),
                                  SIDECAR_STAGE_TIMEOUT_SECONDS="60"))
    profile = settings.profile(tool)
    sink = io.BytesIO()
    monkeypatch.setattr(log_mod.log, "stream", sink)
    monkeypatch.setattr(log_mod.log, "fmt", "json")
    monkeypatch.setattr(log_mod.log, "threshold", 20)

    async def go():
        pool = await db.create_pool(dsn, 5, max_size=2)
        store = CallerStore(pool, 5)
        ids = [(await store.enqueue(tool, payload, None, 1, {}))[0] for payload in (
            {"mode": "slow", "delay": 4}, {"mode": "big", "bytes": 8 * MIB},
            {"mode": "big", "bytes": 8 * MIB})]
        await pool.close()
        worker = Worker(settings, profile, dsn, BREAKER, concurrency=2, drain=True,
                        adopt_orphans=False)
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
            code = await asyncio.wait_for(worker.run(), 120)
        finally:
            stop.set()
            await probe_task
        return ids, code, lags

    ids, code, lags = asyncio.run(go())
    (tmp_path / "worker.log").write_bytes(sink.getvalue())
    assert code == 0
    states = [job_row(dsn, job)["state"] for job in ids]
    assert states == ["succeeded"] * 3, states
    worst = max(lags)
    assert worst < profile.heartbeat_seconds, (
        f"event-loop lag {worst * 1000:.0f} ms while a warm answer was parsed "
        f"(heartbeat period {profile.heartbeat_seconds * 1000:.0f} ms)")


def test_shutdown_stops_idle_warm_processes_at_once_not_one_after_another(dsn, tmp_path):
    """At shutdown WarmPool.close stops the idle processes one after another, each given
    the kill grace to exit on EOF and then the kill grace again after SIGTERM: with N
    slots of a tool slow to exit the sidecar's exit takes N x 2 x KILL_GRACE_SECONDS
    after the drain, past the bound docs/operations.md gives for
    terminationGracePeriodSeconds (one kill grace), so the kubelet's SIGKILL ends it.
    Expected: the idle processes are stopped together (about 2 x the grace in all)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    grace = 2.0
    env = _env(dsn, SIDECAR_KILL_GRACE_SECONDS=f"{grace:g}", SIDECAR_LEASE_SECONDS="10")
    jobs = [enqueue(dsn, "warm", {"mode": "slow", "delay": 1.5}, env=env) for _ in range(3)]
    sidecar = SidecarProcess(dsn, [*BREAKER, "--stubborn", str(marks)], "--tool", "warm",
                             "--concurrency", "3", env=env, tmp=tmp_path)
    try:
        pids = {_succeeded(dsn, job)["pid"] for job in jobs}
        assert len(pids) == 3  # three slots, three processes, all idle now
        started = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        code = sidecar.wait(60)
        took = time.monotonic() - started
    finally:
        sidecar.stop()
    assert code == 0
    assert took < 2 * grace + 3, (
        f"the sidecar took {took:.1f} s to exit with 3 idle warm processes "
        f"(KILL_GRACE_SECONDS={grace:g}): they were stopped one after another")


def test_a_recycled_warm_processs_stop_does_not_cost_its_answered_job_its_lease(dsn, tmp_path):
    """MAX_JOBS_PER_PROCESS=1: the process is stopped when its job ends. In
    JobSupervisor._supervise_warm the answered job's lease is settled (``lease.settle()``:
    no more renewals) and only then is the process given back (WarmPool.give_back), whose
    stop of a spent process (close stdin, the kill grace, SIGTERM, the kill grace) is
    awaited before the job's ending is written. With a tool slow to exit, 2 x
    KILL_GRACE_SECONDS (a valid profile: LEASE 4, KILL_GRACE 2.5) outlasts the lease: the
    answer, final since it came, is refused by the fenced commit, and the job runs again
    (a second side effect), every attempt the same way. Expected: the job succeeds at its
    first attempt, its result committed without waiting for the process's stop."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = _env(dsn, SIDECAR_KILL_GRACE_SECONDS="2.5", SIDECAR_LEASE_SECONDS="4",
               SIDECAR_MAX_JOBS_PER_PROCESS="1")
    job = enqueue(dsn, "warm", {"mode": "count"}, "--max-attempts", "2", env=env)
    sidecar = SidecarProcess(dsn, [*BREAKER, "--stubborn", str(marks)], "--tool", "warm",
                             env=env, tmp=tmp_path)
    try:
        started = time.monotonic()
        wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed"), 60,
                   what="the job ended")
        took = time.monotonic() - started
    finally:
        sidecar.stop()
    row = job_row(dsn, job)
    rejected = [e["event"] for e in sidecar.events()
                if e.get("event") in ("result_rejected", "heartbeat_lost", "lease_lost")]
    assert (row["state"], row["attempt"]) == ("succeeded", 1), (
        f"answered at once, yet {row['state']} after {took:.1f} s at attempt "
        f"{row['attempt']} ({(row['error'] or {}).get('kind')}); events: {rejected}")


def test_cpu_seconds_bounds_each_warm_job_not_the_processs_whole_life(dsn):
    """CPU_SECONDS bounds a job's CPU time (watch_cpu: the cgroup's CPU time less its
    value at the job's start). But every tool process also gets RLIMIT_CPU =
    ceil(CPU_SECONDS) (isolation.rlimits), which in a warm process counts all the jobs
    it served: once their sum passes it, the kernel's SIGXCPU kills the process during
    whichever job runs then, a job that used a fraction of its CPU_SECONDS. Expected:
    four jobs of 0.6 s CPU each under CPU_SECONDS=1.5 all succeed (from one process or
    several)."""
    env = _env(dsn, SIDECAR_CPU_SECONDS="1.5")
    ids, _ = _drain(dsn, env, [{"mode": "burn", "cpu": 0.6}] * 4)
    rows = [job_row(dsn, job) for job in ids]
    ends = [(r["state"], (r["error"] or {}).get("kind")) for r in rows]
    started = [journal_details(dsn, job, "tool_request_started")[0] for job in ids]
    assert all(s.get("cgroup") for s in started), started  # watch_cpu has the cgroup's figure
    assert ends == [("succeeded", None)] * 4, (ends, [r["error"] for r in rows])


def test_cpu_seconds_without_a_cgroup_bounds_each_warm_job_not_the_processs_life(dsn):
    """Without a job cgroup (SIDECAR_CGROUPS=off, or a host that gives none), watch_cpu
    falls back to the live tree's CPU time (tree_activity), which for a warm process is
    its whole life: ``base`` (the CPU time at the job's start) is only taken from the
    cgroup, so it is 0 here. The third job of 0.6 s under CPU_SECONDS=1.5 is killed
    ``cpu_limit`` at 1.5 s of the process's total. Expected: each job is bounded by its
    own CPU time; all three succeed."""
    env = _env(dsn, SIDECAR_CGROUPS="off", SIDECAR_CPU_SECONDS="1.5")
    ids, _ = _drain(dsn, env, [{"mode": "burn", "cpu": 0.6}] * 3)
    rows = [job_row(dsn, job) for job in ids]
    ends = [(r["state"], (r["error"] or {}).get("kind")) for r in rows]
    assert ends == [("succeeded", None)] * 3, ends


def test_a_tiny_warm_idle_seconds_does_not_make_the_idle_sidecar_spin(dsn, tmp_path):
    """WARM_IDLE_SECONDS is refused only when not positive (config.py); WarmPool.run_idle
    then looks at the idle processes every min(5, WARM_IDLE_SECONDS / 2) s: with
    WARM_IDLE_SECONDS=0.000001 the idle sidecar, with no job and no process, busy-loops
    on its event loop (a sleep of half a microsecond, for ever). Expected: the check has
    a floor (or the setting a minimum), and an idle sidecar uses little CPU."""
    import psutil

    env = _env(dsn, SIDECAR_WARM_IDLE_SECONDS="0.000001")
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        sidecar.wait_event("worker_started", 30)
        time.sleep(1.0)
        proc = psutil.Process(sidecar.pid)
        before = sum(proc.cpu_times()[:2])
        time.sleep(3.0)
        used = sum(proc.cpu_times()[:2]) - before
    finally:
        sidecar.stop()
    assert used < 0.6, f"an idle sidecar used {used:.2f} s of CPU in 3 s"


def test_an_answer_followed_by_an_overflowing_line_is_not_reported_as_a_signal(dsn):
    """An answer line and, in the same write, a second line over MAX_RESULT_BYTES: the
    answer future and the overflow resolve together, _race returns EXITED (it comes
    before RESULT_TOO_LARGE), ``answered`` is False (stdout_overflow), the tree is killed
    by the sidecar itself and the verdict is taken from the exit status of that kill:
    ``signal`` "the tool was killed by signal 15" (retryable: the job runs again), and
    child_killed journals reason ``orphaned_descendants``. Expected: the job fails
    ``result_too_large`` (or ``bad_result``: two lines for one request)."""
    env = _env(dsn, SIDECAR_MAX_RESULT_BYTES="4096")
    ids, _ = _drain(dsn, env, [{"mode": "answer_flood", "bytes": 8192}])
    row = job_row(dsn, ids[0])
    assert row["state"] == "failed"
    assert row["error"]["kind"] in ("result_too_large", "bad_result"), (
        row["error"], journal_details(dsn, ids[0], "child_killed"))


# --- promises that held -----------------------------------------------------------------------


def test_answers_with_nul_bytes_or_not_utf8_fail_only_their_job(dsn):
    """A raw NUL byte in a JSON string and a line that is not UTF-8: each fails its job
    ``bad_result``; the process is kept and the next job's answer is its own."""
    env = _env(dsn)
    ids, _ = _drain(dsn, env, [{"mode": "nul"}, {"mode": "latin1"}, {"mode": "count"}])
    rows = [job_row(dsn, job) for job in ids]
    assert [(r["state"], (r["error"] or {}).get("kind")) for r in rows] == [
        ("failed", "bad_result"), ("failed", "bad_result"), ("succeeded", None)]
    assert rows[2]["result"]["job_id"] == str(ids[2])


def test_secrets_in_a_warm_answer_are_refused_and_a_finished_jobs_token_is_dead(dsn):
    """An answer echoing its guard token, or the database URL, fails
    ``secret_in_output`` with nothing stored; a later job of the same process finds the
    previous job's guard token refused (401) and its own accepted (200)."""
    env = _env(dsn)
    ids, _ = _drain(dsn, env, [{"mode": "echo_token"}, {"mode": "echo", "value": dsn},
                               {"mode": "count"}, {"mode": "prev_token"}])
    rows = [job_row(dsn, job) for job in ids]
    assert [(r["state"], (r["error"] or {}).get("kind")) for r in rows[:2]] == [
        ("failed", "secret_in_output")] * 2
    assert rows[0]["result"] is None and rows[1]["result"] is None
    assert rows[3]["result"] == {"prev": 401, "own": 200}, rows[3]


def test_a_warm_tool_that_closes_its_stdin_is_replaced_for_the_next_job(dsn):
    """A process that closed its stdin (alive, but deaf): the next job's request cannot be
    written (EPIPE); that job runs in a fresh process instead of failing."""
    env = _env(dsn)
    ids, events = _drain(dsn, env, [{"mode": "close_stdin"}, {"mode": "count"}])
    first, second = (job_row(dsn, job)["result"] for job in ids)
    assert second["served"] == 1 and second["pid"] != first["pid"]
    assert second["job_id"] == str(ids[1])
    assert not pid_alive(first["pid"])


@pytest.mark.parametrize("mode", ["daemon", "daemon_noenv"])
def test_sigkill_of_the_sidecar_leaves_no_warm_process_or_its_daemon(dsn, tmp_path, mode):
    """The sidecar SIGKILLed while its warm process is idle and holds a double-forked,
    setsid daemon (``daemon_noenv``: one that dropped its environment, found by the job
    cgroup alone): the guardian kills both."""
    env = _env(dsn)
    job = enqueue(dsn, "warm", {"mode": mode}, env=env)
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        result = _succeeded(dsn, job)
        assert pid_alive(result["pid"]) and pid_alive(result["daemon"])
        sidecar.proc.kill()
        sidecar.wait(10)
        wait_until(lambda: not pid_alive(result["pid"]) and not pid_alive(result["daemon"]),
                   15, what="the warm process and its daemon killed by the guardian")
    finally:
        sidecar.stop()


def test_a_sandboxed_warm_process_sees_no_host_tmp(dsn, tmp_path):
    """SANDBOX=required (bwrap): a warm process, started once for many jobs, still cannot
    see a file the host has under /tmp, for its first job and its second."""
    secret_file = tmp_path / "host-only.txt"
    secret_file.write_text("x")
    extra = {"SIDECAR_EXTRA_PATHS": sandbox_extra_paths()} if sandbox_extra_paths() else {}
    env = _env(dsn, SIDECAR_SANDBOX="required", **extra)
    ids, _ = _drain(dsn, env, [{"mode": "stat", "path": str(secret_file)}] * 2)
    rows = [job_row(dsn, job) for job in ids]
    assert [r["state"] for r in rows] == ["succeeded"] * 2, rows
    assert [r["result"]["exists"] for r in rows] == [False, False]
    assert [r["result"]["served"] for r in rows] == [1, 2]


def test_an_answer_over_max_result_bytes_ends_its_process_and_the_next_job_is_fresh(dsn):
    """A response line over MAX_RESULT_BYTES fails its job ``result_too_large`` and kills
    the process (its tail could not be told from the next answer); the next job runs in a
    fresh process and gets its own answer."""
    env = _env(dsn, SIDECAR_MAX_RESULT_BYTES="4096")
    ids, events = _drain(dsn, env, [{"mode": "count"}, {"mode": "big", "bytes": 8192},
                                    {"mode": "count"}])
    first, big, after = (job_row(dsn, job) for job in ids)
    assert (big["state"], big["error"]["kind"]) == ("failed", "result_too_large")
    assert after["result"]["served"] == 1 and after["result"]["pid"] != first["result"]["pid"]
    assert after["result"]["job_id"] == str(ids[2])
    assert not pid_alive(first["result"]["pid"])


def test_sigkill_of_the_sidecar_leaves_no_sandboxed_warm_process(dsn, tmp_path):
    """SANDBOX=required: the sidecar SIGKILLed while its bwrap-wrapped warm process is
    idle; nothing carrying its owner id survives (bwrap, the namespace's init, the tool)."""
    extra = {"SIDECAR_EXTRA_PATHS": sandbox_extra_paths()} if sandbox_extra_paths() else {}
    env = _env(dsn, SIDECAR_SANDBOX="required", **extra)
    job = enqueue(dsn, "warm", {"mode": "count"}, env=env)
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        _succeeded(dsn, job)
        started = sidecar.wait_event("warm_process_started", 10)
        owner = sidecar.wait_event("worker_started", 10)["owner_id"]
        assert pid_alive(started["pid"])
        sidecar.proc.kill()
        sidecar.wait(10)
        wait_until(lambda: not owner_processes(owner), 15,
                   what="every process of the SIGKILLed sidecar's warm process gone")
        assert not pid_alive(started["pid"])
    finally:
        sidecar.stop()


def test_a_warm_process_that_dies_while_idle_is_replaced_for_the_next_job(dsn, tmp_path):
    """A process that answered, then exited (status 3) while idle: the next job runs in a
    fresh process and succeeds; the dead one is logged stopped."""
    env = _env(dsn)
    first = enqueue(dsn, "warm", {"mode": "die_later", "delay": 0.2, "code": 3}, env=env)
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        before = _succeeded(dsn, first)
        wait_until(lambda: not pid_alive(before["pid"]), 10, what="the idle process exited")
        after = _succeeded(dsn, enqueue(dsn, "warm", {"mode": "count"}, env=env))
        assert (after["served"], after["pid"] != before["pid"]) == (1, True)
        assert after["job_id"] != before["job_id"]
    finally:
        sidecar.stop()


def test_sigterm_past_the_drain_releases_a_running_warm_job_and_kills_its_process(dsn,
                                                                                  tmp_path):
    """SIGTERM while a warm job runs past SIDECAR_DRAIN_SECONDS: the process's tree is
    killed, the job goes back to ``queued``, and nothing of the process survives the
    sidecar's exit."""
    env = _env(dsn, SIDECAR_DRAIN_SECONDS="1", SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    job = enqueue(dsn, "warm", {"mode": "hang"}, env=env)
    sidecar = SidecarProcess(dsn, BREAKER, "--tool", "warm", env=env, tmp=tmp_path)
    try:
        started = sidecar.wait_event("warm_process_started", 30)
        wait_until(lambda: journal_details(dsn, job, "tool_request_started"), 30,
                   what="the job started")
        sidecar.proc.send_signal(signal.SIGTERM)
        assert sidecar.wait(30) == 0
    finally:
        sidecar.stop()
    row = job_row(dsn, job)
    assert row["state"] == "queued", row
    assert not pid_alive(started["pid"])
    stopped = sidecar.events("warm_process_stopped")
    assert [e["reason"] for e in stopped] == ["shutdown"], stopped
