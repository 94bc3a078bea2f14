"""The guard protects itself (issue 25, case of the 1,200 keep-alive connections): a real
``sidecar run`` under RLIMIT_NOFILE 1024 (set by its launcher, ``prlimit``), concurrency
2, runs a tool that opens 2,000 connections to the guard and holds them; meanwhile a
second job of the same sidecar starts, asks the guard and succeeds on its first attempt.
The flood's connections beyond the caps are refused, the refusals are logged once per
episode and counted, and the sidecar's open descriptors stay below its limit minus the
reserve."""

from __future__ import annotations

import os
import shutil
import threading

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    enqueue,
    job_row,
    metric_total,
    metric_value,
    metrics_text,
    wait_until,
)
from sidecar.ops.httpserver import DESCRIPTOR_RESERVE
from sidecar.worker.guard import CONNECTIONS_PER_ATTEMPT, UNAUTHENTICATED_CONNECTIONS

pytestmark = pytest.mark.e2e

TOOL = "guard-flood"
LIMIT = 1024  # the RLIMIT_NOFILE
FLOOD = 2000


class FdWatch:
    """The most descriptors the sidecar ``pid`` had open, sampled every 20 ms from
    /proc/PID/fd (root may read it though the sidecar is non-dumpable), else from its
    ``process_open_fds`` metric."""

    def __init__(self, pid: int, metrics_base: str):
        self.pid = pid
        self.base = metrics_base
        self.peak = 0
        self.current = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _count(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except PermissionError:
            return int(metric_value(metrics_text(self.base), "process_open_fds") or 0)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                count = self._count()
            except (OSError, ValueError):
                continue  # a scrape refused while descriptors are short: no sample
            self.current = count
            self.peak = max(self.peak, count)
            self.samples += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def _result(row: dict):
    result = row["result"]
    return orjson.loads(result) if isinstance(result, str | bytes) else result


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_tool_flooding_the_guard_fails_no_other_job(dsn, sidecars, tmp_path):
    report, release = tmp_path / "flood.json", tmp_path / "release"
    env = base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="120")
    sidecar = sidecars(dsn, [str(TOOLS / "guard_flood.py")], "--tool", TOOL,
                       "--concurrency", "2", env=env,
                       launcher=["prlimit", f"--nofile={LIMIT}:{LIMIT}"])
    started = sidecar.wait_event("worker_started", 30)
    assert started["open_files_limit"] == LIMIT  # soft raised to hard: both 1024 here
    watch = FdWatch(sidecar.pid, f"http://{started['http_addr']}")
    try:
        flood = enqueue(dsn, TOOL, {"connections": FLOOD, "workers": 4, "report": str(report),
                                    "release": str(release), "hold_seconds": 90})
        # The other job comes once the flood has opened its connections, or as soon as
        # the sidecar holds hundreds of descriptors (without the caps: mid-flood).
        wait_until(lambda: report.exists() or watch.current > 300, 60,
                   what="the flood to open its connections")

        # While the flood holds its connections, another job of the same sidecar sets up
        # (work directory, pipes, checkpoint file), asks the guard and succeeds at once:
        # no shortage of descriptors, no attempt spent.
        other = enqueue(dsn, TOOL, {"connections": 0})
        done = wait_until(lambda: (row := job_row(dsn, other))["state"] in
                          ("succeeded", "failed") and row, 30, what="the other job's end")
        assert done["state"] == "succeeded", done["error"]
        assert done["attempt"] == 1
        assert not sidecar.events("attempt_shortage"), sidecar.events("attempt_shortage")
        # Promptly: its tool asks the guard again while a connection is refused (at most
        # 10 s); without the caps the guard, out of descriptors, answered after ~10 s.
        succeeded = sidecar.wait_event("job_succeeded", 10, job_id=other)
        assert succeeded["duration_s"] < 5, (succeeded, _result(done))
        wait_until(report.exists, 60, what="the flood to open its connections")
        opened = orjson.loads(report.read_bytes())
        # Answered (409 is lease_ending: the fast profile's lease is 3 s, H + J 1.5 s).
        assert _result(done)["guard"] in (200, 409)
        assert job_row(dsn, flood)["state"] == "running"  # the flood still holds
    finally:
        release.touch()
        peak = watch.stop()
    row = wait_until(lambda: (row := job_row(dsn, flood))["state"] != "running" and row, 30,
                     what="the flood's end")
    assert row["state"] == "succeeded", row["error"]
    held = _result(row)

    # The sidecar never went into its descriptor reserve.
    assert watch.samples > 10
    assert peak < LIMIT - DESCRIPTOR_RESERVE, (peak, opened)

    # Every connection was opened or refused at once; beyond the caps, refused.
    assert opened["connect_failed"] == 0, orjson.dumps(opened).decode()
    attempted = sum(opened[k] for k in ("served", "too_many", "reset", "other",
                                        "bare_open", "bare_refused"))
    assert attempted == FLOOD
    assert opened["other"] == 0
    assert opened["served"] <= CONNECTIONS_PER_ATTEMPT
    assert held["served_open_at_end"] <= CONNECTIONS_PER_ATTEMPT
    assert opened["bare_open"] <= UNAUTHENTICATED_CONNECTIONS
    assert opened["too_many"] + opened["reset"] + opened["bare_refused"] >= \
        FLOOD - CONNECTIONS_PER_ATTEMPT - UNAUTHENTICATED_CONNECTIONS

    # Counted per connection, logged once per episode (and attempt).
    text = metrics_text(f"http://{started['http_addr']}")
    name = "sidecar_guard_connections_refused_total"
    assert metric_total(text, name, tool=TOOL, reason="attempt_cap") == opened["too_many"]
    assert metric_total(text, name, tool=TOOL, reason="unauthenticated_cap") + \
        metric_total(text, name, tool=TOOL, reason="total_cap") >= opened["reset"]
    refused = sidecar.events("guard_connections_refused")
    assert refused, sidecar.stderr_text()[-3000:]
    episodes = [(e["reason"], e.get("job_id")) for e in refused]
    assert len(episodes) == len(set(episodes)), episodes
    assert ("attempt_cap", flood) in episodes


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_flood_of_the_health_port_is_capped_and_jobs_still_run(dsn, sidecars):
    """The health server is reachable by a tool too (NETWORK=host): 600 connections held
    open to it leave at most HEALTH_MAX_CONNECTIONS in the sidecar, the rest reset at
    once and counted; a job asking the guard meanwhile succeeds on its first attempt."""
    import socket

    from sidecar.ops.health import HEALTH_MAX_CONNECTIONS

    env = base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    sidecar = sidecars(dsn, [str(TOOLS / "guard_flood.py")], "--tool", TOOL,
                       "--concurrency", "2", env=env,
                       launcher=["prlimit", f"--nofile={LIMIT}:{LIMIT}"])
    started = sidecar.wait_event("worker_started", 30)
    host, port = started["http_addr"].rsplit(":", 1)
    watch = FdWatch(sidecar.pid, f"http://{started['http_addr']}")
    held: list[socket.socket] = []
    reset_at_connect = 0
    try:
        for _ in range(600):
            try:
                held.append(socket.create_connection((host, int(port)), 5))
            except ConnectionResetError:
                reset_at_connect += 1  # reset before connect() even returned

        # Past the cap the server resets a connection at once, unread.
        def reset_count():
            gone = reset_at_connect
            for sock in held:
                sock.setblocking(False)
                try:
                    gone += sock.recv(1) == b""
                except BlockingIOError:
                    pass
                except ConnectionResetError:
                    gone += 1
            return gone
        gone = wait_until(lambda: (n := reset_count()) >= 600 - HEALTH_MAX_CONNECTIONS and n,
                          15, what="the connections past the cap to be reset")
        other = enqueue(dsn, TOOL, {"connections": 0})
        done = wait_until(lambda: (row := job_row(dsn, other))["state"] in
                          ("succeeded", "failed") and row, 30, what="the job's end")
        assert done["state"] == "succeeded" and done["attempt"] == 1, done["error"]
        assert watch.current < 300
    finally:
        for sock in held:
            sock.close()
        watch.stop()
    text = wait_until(lambda: metrics_text(f"http://{started['http_addr']}"), 15,
                      what="the health server to answer again")
    refused = metric_value(text, "sidecar_health_connections_refused_total", reason="total_cap")
    assert refused is not None and refused >= gone - HEALTH_MAX_CONNECTIONS, (refused, gone)
