"""Metrics (P21), health endpoints, logs and the no-payload rule (P23), on real sidecars."""

from __future__ import annotations

import json
import signal
import socket
import urllib.error
import urllib.request

import orjson
import pytest
from netproxy import BlackholeProxy, through, upstream_of

from kit import base_env, cli, enqueue, metric_value, query, wait_until

pytestmark = pytest.mark.e2e


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _addr(sc) -> str:
    return "http://" + sc.wait_event("worker_started")["http_addr"]


def test_metrics_start_at_zero_and_count_ownership_events(dsn, sidecars):
    env = base_env(dsn, SIDECAR_PROFILE_HANG_TREE_PY_PROVIDER="acme",
                   SIDECAR_PROFILE_HANG_TREE_PY_STAGE_TIMEOUT_SECONDS="1",
                   SIDECAR_LOG_LEVEL="debug")
    sc = sidecars(dsn, ["hang_tree.py"], env=env)
    base = _addr(sc)
    status, text = _get(base + "/metrics")
    assert status == 200
    labels = {"tool": "hang_tree.py", "provider": "acme"}
    # Known label sets exist before anything happened.
    assert metric_value(text, "sidecar_attempts_finished_total", outcome="failed", **labels) == 0
    assert metric_value(text, "sidecar_heartbeats_total", result="lost", **labels) == 0
    assert metric_value(text, "sidecar_child_kills_total", reason="stage_timeout",
                        signal="SIGKILL", **labels) == 0
    assert "job_id" not in text

    job_id = enqueue(dsn, "hang_tree.py", {"pidfile": "/dev/null"}, "--max-attempts", "1",
                     env=env)
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]
               ["state"] == "failed", 20, what="the stage timeout")
    _, text = _get(base + "/metrics")
    assert metric_value(text, "sidecar_jobs_claimed_total", **labels) == 1
    assert metric_value(text, "sidecar_attempts_finished_total", outcome="failed", **labels) == 1
    assert metric_value(text, "sidecar_child_kills_total", reason="stage_timeout",
                        signal="SIGKILL", **labels) == 1
    assert metric_value(text, "sidecar_processes_left_after_kill_total", **labels) == 0
    assert metric_value(text, "sidecar_heartbeats_total", result="ok", **labels) >= 1
    assert metric_value(text, "sidecar_last_heartbeat_timestamp_seconds", **labels) > 1.7e9
    assert metric_value(text, "sidecar_lease_slack_seconds_count", **labels) >= 1
    assert metric_value(text, "sidecar_attempt_duration_seconds_count", **labels) == 1
    assert metric_value(text, "sidecar_queue_depth", **labels) == 0
    # Issue 30's series: the failure under its kind, the kill's latency, and this one
    # sidecar alive; nothing waits in the queue or the outbox.
    assert metric_value(text, "sidecar_attempt_failures_total", kind="stage_timeout",
                        **labels) == 1
    assert metric_value(text, "sidecar_attempt_failures_total", kind="exit_code",
                        **labels) == 0
    assert metric_value(text, "sidecar_kill_duration_seconds_count", **labels) == 1
    assert 0 < metric_value(text, "sidecar_kill_duration_seconds_sum", **labels) < 10
    assert metric_value(text, "sidecar_up", **labels) == 1
    assert metric_value(text, "sidecar_queue_oldest_age_seconds", **labels) == 0
    assert metric_value(text, "sidecar_forward_backlog", **labels) == 0
    assert metric_value(text, "sidecar_leases_ownership_unknown", **labels) == 0


def test_leases_of_unknown_ownership_are_counted_while_the_database_is_silent(dsn, sidecars,
                                                                             tmp_path):
    """sidecar_leases_ownership_unknown (issue 30) is 1 while a running job's renewals go
    unanswered (a blackholed path, well inside the local deadline of a 20 s lease) and 0
    again once the database confirms the lease; the job succeeds."""
    proxy = BlackholeProxy(upstream_of(dsn))
    proxy.start()
    try:
        side_dsn = through(dsn, proxy.port)
        env = base_env(side_dsn, SIDECAR_LEASE_SECONDS="20")
        sc = sidecars(side_dsn, ["fault_sleep.py"], env=env)
        base = _addr(sc)
        labels = {"tool": "fault_sleep.py", "provider": ""}

        def unknown() -> float | None:
            return metric_value(_get(base + "/metrics")[1],
                                "sidecar_leases_ownership_unknown", **labels)

        assert unknown() == 0
        job_id = enqueue(dsn, "fault_sleep.py", {"seconds": 6, "pidfile": str(tmp_path / "p")})
        sc.wait_event("tool_request_started", job_id=job_id)
        proxy.blackhole()
        sc.wait_event("ownership_unknown", job_id=job_id)
        wait_until(lambda: unknown() == 1, 10, what="the gauge to count the lease")
        proxy.restore()
        sc.wait_event("ownership_confirmed", job_id=job_id)
        wait_until(lambda: unknown() == 0, 10, what="the gauge back at zero")
        wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]
                   ["state"] == "succeeded", 30, what="the job to succeed")
    finally:
        proxy.stop()


def test_livez_and_readyz_and_draining(dsn, sidecars):
    env = base_env(dsn, SIDECAR_DRAIN_SECONDS="30")
    sc = sidecars(dsn, ["hang_tree.py"], env=env)
    base = _addr(sc)
    assert _get(base + "/livez")[0] == 200
    status, body = _get(base + "/readyz")
    assert status == 200 and json.loads(body)["ready"] is True
    enqueue(dsn, "hang_tree.py", {"pidfile": "/dev/null", "ignore_term": False}, env=env)
    sc.wait_event("tool_request_started")
    sc.proc.send_signal(signal.SIGTERM)  # drains for up to 30 s: not ready meanwhile
    sc.wait_event("draining")
    status, body = _get(base + "/readyz")
    assert status == 503 and "draining" in json.loads(body)["problems"]
    assert _get(base + "/livez")[0] == 200  # liveness never depends on work or database


def test_readyz_fails_when_the_database_is_not_reached_but_livez_stays_up(dsn, sidecars):
    proxy = BlackholeProxy(upstream_of(dsn))
    proxy.start()
    try:
        env = base_env(through(dsn, proxy.port), SIDECAR_POLL_SECONDS="0.5")
        sc = sidecars(through(dsn, proxy.port), ["cat"], env=env)
        base = _addr(sc)
        assert _get(base + "/readyz")[0] == 200
        proxy.blackhole()
        wait_until(lambda: _get(base + "/readyz")[0] == 503, 30, interval=0.5,
                   what="readyz to notice the database is gone")
        assert "database" in _get(base + "/readyz")[1]
        assert _get(base + "/livez")[0] == 200
        proxy.restore()
        wait_until(lambda: _get(base + "/readyz")[0] == 200, 30, interval=0.5,
                   what="readyz to recover")
    finally:
        proxy.stop()


def test_no_payload_result_or_stderr_content_in_logs_or_journal(dsn, sidecars, tmp_path):
    secret = "sk_live_51HxSECRETdoNotLog"
    env = base_env(dsn)
    job_id = enqueue(dsn, "leaky", {"api_key": secret}, env=env)
    # A tool that echoes its payload to stdout (the result) and to stderr.
    done = cli(dsn, "run", "--tool", "leaky", "--drain", "--", "sh", "-c", "tee /dev/stderr",
               env=env)
    assert done.returncode == 0
    assert query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]["state"] == \
        "succeeded"
    assert secret not in done.stderr.decode()
    journal = query(dsn, "SELECT event, details FROM tool_job_events WHERE job_id = $1", job_id)
    assert journal and all(secret not in orjson.dumps(dict(r)).decode() for r in journal)
    summary = [json.loads(line) for line in done.stderr.decode().splitlines()
               if '"tool_stderr"' in line]
    assert summary and summary[0]["lines"] == 1 and "line" not in summary[0]

    # Opting in puts the stderr lines themselves in the log.
    enqueue(dsn, "leaky", {"api_key": secret}, env=env)
    loud = cli(dsn, "run", "--tool", "leaky", "--drain", "--", "sh", "-c", "tee /dev/stderr",
               env=base_env(dsn, SIDECAR_LOG_TOOL_STDERR="true"))
    assert secret in loud.stderr.decode()


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_log_lines_have_fixed_keys(dsn, fmt):
    env = base_env(dsn, SIDECAR_LOG_FORMAT=fmt)
    job_id = enqueue(dsn, "cat", {"x": 1}, env=env)
    done = cli(dsn, "run", "--drain", "--", "cat", env=env)
    lines = done.stderr.decode().splitlines()
    if fmt == "json":
        events = [json.loads(line) for line in lines]
        assert all(list(e)[:3] == ["ts", "level", "event"] for e in events)
        claimed = next(e for e in events if e["event"] == "job_claimed")
        assert list(claimed)[3:8] == ["job_id", "tool", "fencing_token", "attempt",
                                      "lease_until"]
        assert claimed["job_id"] == job_id
    else:
        claimed = next(line for line in lines if " job_claimed " in line)
        assert f"job_id={job_id}" in claimed and "fencing_token=1" in claimed
        assert not any(line.startswith("{") for line in lines)


def test_http_addr_in_use_is_one_clear_line(dsn, sidecars):
    sc = sidecars(dsn, ["cat"])
    addr = sc.wait_event("worker_started")["http_addr"]
    done = cli(dsn, "run", "--drain", "--", "cat", env=base_env(dsn, SIDECAR_HTTP_ADDR=addr))
    assert done.returncode == 2
    err = done.stderr.decode().strip().splitlines()
    assert err[-1].startswith("sidecar: error: SIDECAR_HTTP_ADDR=") and "Traceback" not in \
        done.stderr.decode()


def _without_http_addr(dsn: str) -> dict[str, str]:
    env = base_env(dsn)
    env.pop("SIDECAR_HTTP_ADDR", None)  # the default: 0.0.0.0:9180
    return env


def test_two_sidecars_in_one_network_namespace_both_serve_on_the_default(dsn, sidecars):
    """#16: two tools in one pod, SIDECAR_HTTP_ADDR unset in both: the second finds 9180
    taken, moves to the next free port and says so; each answers /livez on its own port."""
    first = sidecars(dsn, ["cat"], "--tool", "pod-a", env=_without_http_addr(dsn))
    addr_a = first.wait_event("worker_started")["http_addr"]
    second = sidecars(dsn, ["cat"], "--tool", "pod-b", env=_without_http_addr(dsn))
    addr_b = second.wait_event("worker_started")["http_addr"]
    port_a, port_b = int(addr_a.rpartition(":")[2]), int(addr_b.rpartition(":")[2])
    assert 9180 <= port_a < port_b < 9190
    moved = second.wait_event("http_port_moved")
    assert moved["wanted"] == "0.0.0.0:9180" and moved["http_addr"] == addr_b
    for port in (port_a, port_b):
        assert _get(f"http://127.0.0.1:{port}/livez")[0] == 200
    assert first.proc.poll() is None and second.proc.poll() is None


def _hold_ports(ports) -> list[socket.socket]:
    held = []
    for port in ports:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        try:
            sock.bind(("0.0.0.0", port))
            sock.listen()
        except OSError:  # taken already (another process of this machine): as good
            sock.close()
            continue
        held.append(sock)
    return held


def test_the_default_port_moves_as_far_as_9189(dsn, sidecars):
    held = _hold_ports(range(9180, 9189))
    try:
        sc = sidecars(dsn, ["cat"], "--tool", "far", env=_without_http_addr(dsn))
        assert sc.wait_event("worker_started")["http_addr"] == "0.0.0.0:9189"
        assert sc.wait_event("http_port_moved")["http_addr"] == "0.0.0.0:9189"
    finally:
        for sock in held:
            sock.close()


def test_a_default_port_never_moves_past_its_range(dsn, tmp_path):
    """Every port of 9180-9189 taken: one line naming SIDECAR_HTTP_ADDR, exit 2."""
    held = _hold_ports(range(9180, 9190))
    try:
        done = cli(dsn, "run", "--drain", "--", "cat", env=_without_http_addr(dsn))
    finally:
        for sock in held:
            sock.close()
    assert done.returncode == 2
    err = done.stderr.decode().strip().splitlines()
    assert err[-1].startswith("sidecar: error: SIDECAR_HTTP_ADDR=0.0.0.0:9180 (and the next 9")
    assert "Traceback" not in done.stderr.decode()
