"""Ownership end to end: real ``sidecar run`` processes, a real PostgreSQL and real tool
process trees. A frozen (SIGSTOP) or killed sidecar, an operator's cancel, a restarted pod
and pod termination must never leave two owners at work, a stale result committed, or a
tool tree running without its lease (P5, P6, P7, P13, P25; cases F1, F3, F8).

Timing is read from the database's clock where the protocol is about the lease
(``lease_until``, journal ``at``); waits are polls with generous bounds, since other test
files run on the same small machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import orjson
import psutil
import pytest

from kit import (
    FAST_PROFILE,
    base_env,
    cli,
    enqueue,
    job_row,
    pid_alive,
    query,
    read_pids,
    run,
    scalar,
    sidecar_backends,
    wait_attempt_counted,
    wait_until,
)
from sidecar.protocol.model import ClaimedJob
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

pytestmark = [pytest.mark.e2e, pytest.mark.server]

LEASE = float(FAST_PROFILE["SIDECAR_LEASE_SECONDS"])          # L = 3 s
HEARTBEAT = float(FAST_PROFILE["SIDECAR_HEARTBEAT_SECONDS"])  # H = 0.5 s
GRACE = float(FAST_PROFILE["SIDECAR_KILL_GRACE_SECONDS"])     # G = 1 s

HANG = "hang_tree.py"
SINK_JOB = "own_sink_job.py"


# --- helpers ------------------------------------------------------------------


def journal(dsn: str, job_id: str) -> list[dict]:
    """The job's rows in tool_job_events, oldest first."""
    return [dict(r) for r in query(
        dsn, "SELECT id, fencing_token, event, at, details FROM tool_job_events "
             "WHERE job_id = $1 ORDER BY id", job_id)]


def journal_events(dsn: str, job_id: str, name: str) -> list[dict]:
    return [e for e in journal(dsn, job_id) if e["event"] == name]


def wait_journal(dsn: str, job_id: str, name: str, timeout: float = 15.0, **match) -> dict:
    def found():
        for event in journal_events(dsn, job_id, name):
            if all(event.get(k) == v for k, v in match.items()):
                return event
        return None

    return wait_until(found, timeout, interval=0.2, what=f"journal event {name} {match or ''}")


def lease_expired(dsn: str, job_id: str) -> bool:
    """True once the job's lease has ended by the database's clock (P3)."""
    return bool(scalar(dsn, "SELECT lease_until < now() FROM tool_jobs WHERE id = $1", job_id))


def claim_as(dsn: str, tool: str, owner_id: str, lease_seconds: float) -> ClaimedJob | None:
    """Another owner takes the job through the real claim statement (P4)."""

    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, init=init_connection)
        try:
            return await WorkerStore(pool, timeout=10).claim(tool, owner_id, lease_seconds)
        finally:
            await pool.close()

    return run(go())


def wait_all_dead(pids: list[int], timeout: float, what: str = "the tool tree to die") -> None:
    wait_until(lambda: not any(pid_alive(p) for p in pids), timeout, what=what)


def kill_leftovers(pids: list[int]) -> None:
    """Test hygiene only: never leave a hung tool running after a failed assertion."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_fresh_heartbeat(sc, timeout: float = 10.0) -> None:
    """Return right after the sidecar logged a new heartbeat_ok (needs debug logging), so a
    SIGSTOP now lands in the heartbeat task's sleep, not in the middle of a renewal."""
    seen = len(sc.events("heartbeat_ok"))
    wait_until(lambda: len(sc.events("heartbeat_ok")) > seen, timeout, interval=0.02,
               what="a fresh heartbeat_ok")


def sink_lines(path: Path) -> list[list[str]]:
    try:
        return [line.split() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def assert_no_outcome_events(events: list[dict]) -> None:
    names = {e["event"] for e in events}
    assert not names & {"job_succeeded", "job_failed", "job_retry_scheduled",
                        "lease_released"}, names


# --- 1. heartbeat after a takeover (P5, P25) ------------------------------------


def test_frozen_sidecar_resumes_after_takeover_loses_heartbeat_and_kills_tree(
        dsn, sidecars, tmp_path):
    pidfile = tmp_path / "pids"
    sc = sidecars(dsn, [HANG], env=base_env(dsn, SIDECAR_LOG_LEVEL="debug"))
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True})
    pids = read_pids(pidfile, 4)  # the tool, a grandchild, a double-forked one, a setsid one
    try:
        sc.wait_event("tool_request_started", job_id=job_id)
        before = job_row(dsn, job_id)
        assert (before["state"], before["fencing_token"], before["attempt"]) == ("running", 1, 1)
        old_owner = before["owner_id"]

        wait_fresh_heartbeat(sc)
        os.kill(sc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: lease_expired(dsn, job_id), 20, interval=0.2,
                       what="the frozen sidecar's lease to expire by the database clock")
            taken = claim_as(dsn, HANG, "usurper", 60)
            assert taken is not None and str(taken.id) == job_id
            assert (taken.fencing_token, taken.attempt, taken.reclaimed) == (2, 2, True)
            # Frozen, the sidecar could not act: its tree is still running.
            assert all(pid_alive(p) for p in pids)
            takeover = journal_events(dsn, job_id, "job_claimed")[-1]
            takeover_event_id = takeover["id"]
        finally:
            os.kill(sc.pid, signal.SIGCONT)

        lost = sc.wait_event("heartbeat_lost", job_id=job_id, timeout=15)
        assert lost["fencing_token"] == 1
        wait_all_dead(pids, 15, "the child and its descendants to die after heartbeat_lost")
        killed = wait_journal(dsn, job_id, "child_killed", fencing_token=1)
        sc.wait_event("lease_lost", job_id=job_id, timeout=15)
        # Logged before it is journaled (the abandoned lease's probe asks the row first).
        wait_journal(dsn, job_id, "heartbeat_lost", fencing_token=1)
    finally:
        kill_leftovers(pids)

    events = journal(dsn, job_id)
    hb_lost = [e for e in events if e["event"] == "heartbeat_lost"]
    assert len(hb_lost) == 1 and hb_lost[0]["fencing_token"] == 1
    assert hb_lost[0]["details"]["owner_id"] == old_owner
    assert hb_lost[0]["details"].get("current_token") == 2
    assert killed["details"]["killed"] >= 1
    # After the takeover the old owner wrote only its evidence, never an outcome.
    after = [e for e in events if e["id"] > takeover_event_id]
    # (lease_abandoned when, on waking, its local deadline had passed before a renewal;
    # tool_request_started when the sidecar froze before that row, noted at the spawn, was
    # written: its time is the spawn's, before the takeover)
    assert {e["event"] for e in after} <= {"heartbeat_lost", "child_killed",
                                           "lease_abandoned", "tool_request_started"}, after
    assert all(e["at"] < takeover["at"] for e in after
               if e["event"] == "tool_request_started"), after
    assert all(e["fencing_token"] == 1 for e in after)
    assert_no_outcome_events(events)
    assert not [e for e in events if e["event"] == "result_rejected"]

    row = job_row(dsn, job_id)
    assert row["state"] == "running" and row["owner_id"] == "usurper"
    assert row["fencing_token"] == 2 and row["attempt"] == 2
    assert row["result"] is None and row["error"] is None
    # The old sidecar did not renew (or otherwise touch) the new owner's lease.
    assert row["lease_until"] == taken.lease_until
    assert sc.proc.poll() is None  # the sidecar itself lives on, lease-less


# --- 2. stale completion end to end (P6, P13, P23) ---------------------------------


def test_result_finished_while_frozen_is_rejected_after_takeover(dsn, sidecars, tmp_path):
    sink = tmp_path / "sink"
    secret = f"SECRET-{uuid.uuid4().hex}"
    sc = sidecars(dsn, [SINK_JOB], env=base_env(dsn, SIDECAR_LOG_LEVEL="debug"))
    job_id = enqueue(dsn, SINK_JOB, {"sink": str(sink), "sleep": 2, "secret": secret})
    started = wait_until(lambda: [ln for ln in sink_lines(sink) if ln[0] == "start"], 15,
                         interval=0.02, what="the tool to start")
    wait_attempt_counted(dsn, job_id)  # else its expiry gives the attempt back (F16)
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        child_pid = int(started[0][2])
        wait_until(lambda: any(ln[0] == "done" for ln in sink_lines(sink)), 15, interval=0.1,
                   what="the tool to finish its work")
        wait_until(lambda: not pid_alive(child_pid), 10, what="the tool to exit")
        wait_until(lambda: lease_expired(dsn, job_id), 20, interval=0.2,
                   what="the frozen sidecar's lease to expire by the database clock")
        taken = claim_as(dsn, SINK_JOB, "usurper", 60)
        assert taken is not None and str(taken.id) == job_id and taken.fencing_token == 2
    finally:
        os.kill(sc.pid, signal.SIGCONT)

    rejected = wait_journal(dsn, job_id, "result_rejected", timeout=15)
    expected = (json.dumps({"ok": True, "secret": secret}) + "\n").encode()
    assert rejected["fencing_token"] == 1
    digest = rejected["details"]["result"]
    assert set(digest) == {"sha256", "bytes"}
    assert digest["bytes"] == len(expected)
    assert digest["sha256"] == hashlib.sha256(expected).hexdigest()
    sc.wait_event("result_rejected", job_id=job_id, fencing_token=1, timeout=10)

    events = journal(dsn, job_id)
    assert secret not in orjson.dumps([e["details"] for e in events]).decode()
    assert secret not in sc.stderr_text()
    assert_no_outcome_events(events)
    row = job_row(dsn, job_id)
    assert row["state"] == "running" and row["owner_id"] == "usurper"
    assert row["fencing_token"] == 2 and row["attempt"] == 2
    assert row["result"] is None and row["error"] is None
    assert row["lease_until"] == taken.lease_until


# --- 3. cancel kills within one heartbeat period -----------------------------------


def test_cancel_kills_the_tree_within_one_heartbeat_and_stays_cancelled(dsn, sidecars,
                                                                         tmp_path):
    pidfile = tmp_path / "pids"
    sc = sidecars(dsn, [HANG])
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True})
    pids = read_pids(pidfile, 4)
    try:
        sc.wait_event("tool_request_started", job_id=job_id)
        done = cli(dsn, "cancel", job_id)
        assert done.returncode == 0, done.stderr.decode()
        answer = orjson.loads(done.stdout)
        assert answer.pop("tree_kill").startswith("its owner was told")
        assert answer == {"id": job_id, "cancelled": True, "previous_state": "running"}
        wait_all_dead(pids, 15, "the cancelled job's tree to die")
        killed = wait_journal(dsn, job_id, "child_killed", timeout=15)
        sc.wait_event("lease_lost", job_id=job_id, timeout=15)
    finally:
        kill_leftovers(pids)

    cancelled = journal_events(dsn, job_id, "job_cancelled")
    assert len(cancelled) == 1
    elapsed = (killed["at"] - cancelled[0]["at"]).total_seconds()
    assert 0 <= elapsed < HEARTBEAT + GRACE + 1, f"tree killed {elapsed:.2f} s after the cancel"
    lost = sc.events("heartbeat_lost")
    assert lost and lost[0]["reason"] == "cancelled" and lost[0]["fencing_token"] == 1

    events = journal(dsn, job_id)
    assert_no_outcome_events(events)
    assert not [e for e in events if e["event"] == "result_rejected"]
    row = job_row(dsn, job_id)
    assert row["state"] == "cancelled" and row["result"] is None
    assert row["error"]["kind"] == "cancelled"
    assert row["fencing_token"] == 1 and row["attempt"] == 1
    time.sleep(2 * HEARTBEAT)  # nothing arrives later to overwrite the cancel
    assert job_row(dsn, job_id)["state"] == "cancelled"
    assert len(journal(dsn, job_id)) == len(events)


# --- 4. case F1: a healthy job longer than its lease -------------------------------


def _run_long_healthy_job(dsn, sidecars, tmp_path, sleep: float, pad_bytes: int = 0,
                          **extra_env: str) -> tuple[str, list, list[str]]:
    """Two sidecars serve one tool; one job runs ``sleep`` seconds. Returns the job id, the
    two sidecars and every moment (as text) at which the running job's lease was not ahead
    of the database's now()."""
    sink = tmp_path / "sink"
    env = base_env(dsn, **extra_env)
    pair = [sidecars(dsn, [SINK_JOB], env=env) for _ in range(2)]
    for sc in pair:
        sc.wait_event("worker_started", timeout=20)
    job_id = enqueue(dsn, SINK_JOB, {"sink": str(sink), "sleep": sleep, "pad_bytes": pad_bytes})
    behind: list[str] = []
    checks = 0
    deadline = time.monotonic() + sleep + 60
    while True:
        row = query(dsn, "SELECT state, lease_until, now() AS db_now, lease_until > now() AS ahead"
                         " FROM tool_jobs WHERE id = $1", job_id)[0]
        if row["state"] == "running":
            checks += 1
            if not row["ahead"]:
                behind.append(f"lease_until {row['lease_until']} <= now() {row['db_now']}")
        elif row["state"] != "queued":
            break
        assert time.monotonic() < deadline, f"job still {row['state']} after {sleep + 60} s"
        time.sleep(0.5)
    assert checks >= sleep  # the lease really was watched for the whole run
    return job_id, pair, behind


def _assert_single_healthy_run(dsn, job_id, pair, behind, sink: Path) -> None:
    assert behind == [], behind
    row = job_row(dsn, job_id)
    assert row["state"] == "succeeded", row["error"]
    assert row["attempt"] == 1 and row["fencing_token"] == 1
    lines = sink_lines(sink)
    assert [(ln[0], ln[1]) for ln in lines] == [("start", "1"), ("done", "1")], lines
    claimed = journal_events(dsn, job_id, "job_claimed")
    assert len(claimed) == 1 and claimed[0]["fencing_token"] == 1
    logged = [len(sc.events("job_claimed")) for sc in pair]
    assert sorted(logged) == [0, 1], f"job_claimed per sidecar: {logged}"
    winner = pair[logged.index(1)]
    assert claimed[0]["details"]["owner_id"] == winner.events("worker_started")[0]["owner_id"]
    assert not [e for e in journal(dsn, job_id) if e["event"] in
                ("heartbeat_lost", "result_rejected", "child_killed", "job_retry_scheduled")]


def test_f1_job_longer_than_lease_is_not_handed_out_again(dsn, sidecars, tmp_path):
    job_id, pair, behind = _run_long_healthy_job(dsn, sidecars, tmp_path, sleep=6 * LEASE)
    _assert_single_healthy_run(dsn, job_id, pair, behind, tmp_path / "sink")
    assert job_row(dsn, job_id)["result"] == {"ok": True}


def test_f1_long_job_with_20mb_output_on_busy_cpus_keeps_its_lease(dsn, sidecars, tmp_path):
    pad = 20 * 1024 * 1024
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2)]
    try:
        job_id, pair, behind = _run_long_healthy_job(
            dsn, sidecars, tmp_path, sleep=4 * LEASE, pad_bytes=pad,
            SIDECAR_MAX_RESULT_BYTES=str(32 * 1024 * 1024))
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait(10)
    _assert_single_healthy_run(dsn, job_id, pair, behind, tmp_path / "sink")
    got = query(dsn, "SELECT result->'ok' AS ok, length(result->>'pad') AS pad "
                     "FROM tool_jobs WHERE id = $1", job_id)[0]
    assert got["ok"] is True and got["pad"] == pad


# --- 5. case F3: a restarted pod keeps its name, not its leases --------------------


def test_f3_restarted_pod_with_same_name_gets_new_owner_and_waits_for_the_lease(
        dsn, sidecars, tmp_path):
    sink = tmp_path / "sink"
    env = base_env(dsn, SIDECAR_WORKER_NAME="pod-0")
    first = sidecars(dsn, [SINK_JOB], env=env)
    job_id = enqueue(dsn, SINK_JOB, {"sink": str(sink), "sleep": 4})
    first.wait_event("tool_request_started", job_id=job_id)
    wait_attempt_counted(dsn, job_id)  # else its expiry gives the attempt back (F16)
    wait_until(lambda: sink_lines(sink), 15, what="the first attempt to start")
    first_child = int(sink_lines(sink)[0][2])

    sessions = sidecar_backends(dsn)  # the first sidecar's
    first.proc.kill()  # kill -9: no drain, no release
    first.wait(10)
    second = sidecars(dsn, [SINK_JOB], env=env)  # restarted at once, same name
    # A renewal already on the wire lands before its session ends: read the lease after.
    wait_until(lambda: not sessions & sidecar_backends(dsn), 10,
               what="the killed sidecar's sessions to end")
    lease_at_death = job_row(dsn, job_id)["lease_until"]

    wait_until(lambda: not pid_alive(first_child), 5, what="the dead sidecar's tool to die")
    wait_until(lambda: job_row(dsn, job_id)["state"] not in ("queued", "running"), 40,
               interval=0.3, what="the job to finish")

    row = job_row(dsn, job_id)
    assert row["state"] == "succeeded", row["error"]
    assert row["attempt"] == 2 and row["fencing_token"] == 2
    claims = journal_events(dsn, job_id, "job_claimed")
    assert len(claims) == 2
    owners = [c["details"]["owner_id"] for c in claims]
    assert owners[0] != owners[1], owners
    assert all(o.startswith("pod-0:") for o in owners), owners
    assert owners[0] == first.events("worker_started")[0]["owner_id"]
    assert owners[1] == second.events("worker_started")[0]["owner_id"] == row["owner_id"]
    assert [c["fencing_token"] for c in claims] == [1, 2]
    assert [c["details"]["attempt"] for c in claims] == [1, 2]
    assert claims[1]["details"]["reclaimed"] is True
    # The row became claimable only when the dead owner's lease ended (database clock).
    assert claims[1]["at"] >= lease_at_death, (claims[1]["at"], lease_at_death)
    succeeded = journal_events(dsn, job_id, "job_succeeded")
    assert len(succeeded) == 1 and succeeded[0]["fencing_token"] == 2
    # The killed attempt never finished; the second did, once.
    assert [(ln[0], ln[1]) for ln in sink_lines(sink)] == [("start", "1"), ("start", "2"),
                                                       ("done", "2")]


# --- 6-8. case F8: pod termination ------------------------------------------------


def _assert_released(dsn: str, job_id: str, pids: list[int]) -> dict:
    wait_all_dead(pids, 10, "the tree to be dead after the drain")
    row = job_row(dsn, job_id)
    assert row["state"] == "queued" and row["attempt"] == 0, (row["state"], row["attempt"])
    assert row["owner_id"] is None and row["lease_until"] is None
    assert row["fencing_token"] == 1
    released = journal_events(dsn, job_id, "lease_released")
    assert len(released) == 1 and released[0]["fencing_token"] == 1
    assert released[0]["details"]["reason"] == "shutdown"
    assert_no_outcome_events([e for e in journal(dsn, job_id) if e["event"] != "lease_released"])
    return released[0]


def test_f8_sigterm_drains_kills_tree_and_releases_for_an_immediate_reclaim(
        dsn, sidecars, tmp_path):
    pidfile = tmp_path / "pids"
    env = base_env(dsn, SIDECAR_DRAIN_SECONDS="1")
    first = sidecars(dsn, [HANG], env=env)
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True})
    pids = read_pids(pidfile, 4)
    try:
        first.wait_event("tool_request_started", job_id=job_id)
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(20) == 0, first.stderr_text()[-2000:]
        released = _assert_released(dsn, job_id, pids)
    finally:
        kill_leftovers(pids)
    assert wait_journal(dsn, job_id, "child_killed")["fencing_token"] == 1
    first.wait_event("lease_released", job_id=job_id, timeout=1)

    pidfile.unlink()
    second = sidecars(dsn, [HANG], env=env)
    claim = wait_journal(dsn, job_id, "job_claimed", timeout=15, fencing_token=2)
    second.wait_event("job_claimed", job_id=job_id, timeout=10)
    gap = (claim["at"] - released["at"]).total_seconds()
    assert gap < LEASE, f"re-claimed {gap:.2f} s after the release"
    assert claim["details"]["attempt"] == 1  # the drained attempt was not spent
    assert claim["details"]["reclaimed"] is False
    kill_leftovers(read_pids(pidfile, 4))  # hygiene: the second run's tree


def test_f8_sigterm_to_entrypoint_shell_drains_through_parent_death_signal(
        dsn, sidecars, tmp_path):
    pidfile = tmp_path / "pids"
    env = base_env(dsn, SIDECAR_DRAIN_SECONDS="1")
    # `sh -c '<sidecar command>; true'`: the trailing `; true` keeps sh from exec-ing, so
    # sh stays the sidecar's parent and takes the SIGTERM meant for it.
    shell = sidecars(dsn, [HANG], env=env, wrap=["sh", "-c", 'eval "$0"; true'])
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True})
    pids = read_pids(pidfile, 4)
    try:
        shell.wait_event("tool_request_started", job_id=job_id)
        children = psutil.Process(shell.pid).children()
        assert len(children) == 1, children
        sidecar_proc = children[0]
        assert sidecar_proc.pid != shell.pid and "sidecar" in " ".join(sidecar_proc.cmdline())

        os.kill(shell.pid, signal.SIGTERM)  # only the shell
        assert shell.wait(10) == -signal.SIGTERM
        wait_until(lambda: not pid_alive(sidecar_proc.pid), 20,
                   what="the orphaned sidecar to drain and exit")
        _assert_released(dsn, job_id, pids)
    finally:
        kill_leftovers(pids)
    assert shell.events("lease_released")
    assert wait_journal(dsn, job_id, "child_killed")["fencing_token"] == 1
    stopped = shell.events("worker_stopped")
    assert stopped and "reason" not in stopped[0]


def test_f8_kill_9_takes_the_tree_down_and_writes_nothing(dsn, sidecars, tmp_path):
    pidfile = tmp_path / "pids"
    sc = sidecars(dsn, [HANG])
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True})
    pids = read_pids(pidfile, 4)
    try:
        sc.wait_event("tool_request_started", job_id=job_id)
        wait_journal(dsn, job_id, "tool_request_started")
        events_before = journal(dsn, job_id)
        sessions = sidecar_backends(dsn)
        sc.proc.kill()
        sc.wait(10)
        killed_at = time.monotonic()
        wait_all_dead(pids, 3, "the tool and its descendants to die after kill -9")
        assert time.monotonic() - killed_at < 3
    finally:
        kill_leftovers(pids)

    # A renewal already on the wire may still land, before its session ends; nothing after.
    wait_until(lambda: not sessions & sidecar_backends(dsn), 10,
               what="the killed sidecar's sessions to end")
    row = job_row(dsn, job_id)
    assert row["state"] == "running" and row["fencing_token"] == 1 and row["attempt"] == 1
    assert row["result"] is None and row["error"] is None
    wait_until(lambda: lease_expired(dsn, job_id), 15, interval=0.2,
               what="the dead owner's lease to expire")
    time.sleep(2 * HEARTBEAT)
    assert job_row(dsn, job_id) == row  # untouched, lease and heartbeat_at included
    assert journal(dsn, job_id) == events_before
