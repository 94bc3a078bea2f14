"""The article's closing "unpleasant test" (P25), black-box, with real processes.

W1 claims a job and its tool starts its work. W1 is cut off from the database (a TCP
proxy that blackholes: sockets held, bytes dropped) or frozen (SIGSTOP). The lease expires
by the database's clock; W2 claims the job with token + 1, its tool sends the effect and
the job succeeds. Then W1 gets its network back (or SIGCONT). W1 must not extend the
lease, must not write a result, and must not cause a second irreversible effect; a late
effect carrying W1's token is refused by the fenced receiver.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
import urllib.error
import urllib.request
import uuid

import pytest
from netproxy import through

from kit import (
    base_env,
    enqueue,
    job_row,
    pid_alive,
    query,
    wait_attempt_counted,
    wait_until,
)

pytestmark = pytest.mark.e2e

TOOL = "effect_tool.py"
PROFILE = "SIDECAR_PROFILE_EFFECT_TOOL_PY_"


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _env(dsn: str, receiver: str, **extra: str) -> dict:
    return base_env(dsn, **{PROFILE + "RESULT_URL": receiver + "/effects"}, **extra)


def _journal(dsn, job_id, token=None):
    rows = query(dsn, "SELECT fencing_token, event, details FROM tool_job_events "
                      "WHERE job_id = $1 ORDER BY id", job_id)
    return [r for r in rows if token is None or r["fencing_token"] == token]


def _lease_expired(dsn, job_id) -> bool:
    return query(dsn, "SELECT lease_until < now() AS expired FROM tool_jobs WHERE id = $1",
                 job_id)[0]["expired"]


def _start_job(dsn, receiver, tmp_path, work_w1: float, effect_w1: bool = True, env=None):
    entity = f"case-{uuid.uuid4().hex[:8]}"
    payload = {"receiver": receiver, "entity": entity, "marker_dir": str(tmp_path),
               "work": {"1": work_w1, "2": 0}, "effect": {"1": effect_w1, "2": True}}
    return enqueue(dsn, TOOL, payload, "--max-attempts", "3", env=env), entity


def _w2_finishes(dsn, receiver, sidecars, job_id):
    """W2, on a direct connection, claims with token 2 and completes the job."""
    w2 = sidecars(dsn, [TOOL], env=_env(dsn, receiver))
    wait_until(lambda: job_row(dsn, job_id)["state"] == "succeeded", 20, what="W2's success")
    return w2


def _assert_w1_fenced_out(dsn, receiver, job_id, entity, tmp_path, w1_tool_pid):
    job = job_row(dsn, job_id)
    # W2's outcome stands: token 2, W2's result, nothing written by W1.
    assert job["state"] == "succeeded" and job["fencing_token"] == 2 and job["attempt"] == 2
    assert job["result"]["token"] == 2
    w1_events = [r["event"] for r in _journal(dsn, job_id, token=1)]
    assert "heartbeat_lost" in w1_events, w1_events
    assert not {"job_succeeded", "job_failed", "job_retry_scheduled", "lease_released"} \
        & set(w1_events), w1_events
    # W1's tool tree is dead.
    assert not pid_alive(w1_tool_pid)
    # A late effect carrying W1's token is refused; the receiver holds W2's effect only.
    status, body = _post(receiver + "/effects", {"case": entity, "by_token": 1},
                         {"Idempotency-Key": f"tool-job:{job_id}:create_case",
                          "X-Execution-Fence": "1", "X-Fence-Entity": entity})
    assert status == 409 and body["error"] == "stale_fence"
    assert body["fence"] == 1 and body["current"] == 2
    effects = _get(f"{receiver}/effects?entity={entity}")["effects"]
    assert len(effects) == 1 and effects[0]["fence"] == 2
    assert effects[0]["body"] == {"case": entity, "by_token": 2}
    # The forwarded result is W2's only.
    forwarded = [e for e in _get(receiver + "/effects")["effects"]
                 if e["idempotency_key"] == f"tool-job:{job_id}:result"]
    wait_until(lambda: [e for e in _get(receiver + "/effects")["effects"]
                        if e["idempotency_key"] == f"tool-job:{job_id}:result"], 10,
               what="the forwarded result")
    forwarded = [e for e in _get(receiver + "/effects")["effects"]
                 if e["idempotency_key"] == f"tool-job:{job_id}:result"]
    assert len(forwarded) == 1 and forwarded[0]["fence"] == 2
    assert forwarded[0]["body"]["result"]["token"] == 2
    outbox = query(dsn, "SELECT fencing_token FROM tool_job_outbox WHERE job_id = $1", job_id)
    assert [r["fencing_token"] for r in outbox] == [2]


def test_p25_partitioned_owner_cannot_extend_commit_or_act_after_takeover(
        dsn, receiver, proxy, sidecars, tmp_path):
    w1_env = _env(through(dsn, proxy.port), receiver.url)
    job_id, entity = _start_job(dsn, receiver.url, tmp_path, work_w1=600)
    w1 = sidecars(through(dsn, proxy.port), [TOOL], env=w1_env)
    started = wait_until(lambda: (tmp_path / "started-1").exists(), 20, what="W1's tool")
    assert started
    w1_tool = int((tmp_path / "started-1").read_text())
    wait_attempt_counted(dsn, job_id)  # else its expiry gives the attempt back (F16)

    proxy.blackhole()
    wait_until(lambda: _lease_expired(dsn, job_id), 20, what="the lease to expire by the DB clock")
    # W1 gave up locally before the database could hand the job to someone else.
    assert not pid_alive(w1_tool), "W1's tool outlived its lease"
    w1.wait_event("ownership_unknown", timeout=1)
    w1.wait_event("lease_abandoned", timeout=1)

    _w2_finishes(dsn, receiver.url, sidecars, job_id)
    proxy.restore()
    wait_until(lambda: "lease_abandoned" in [r["event"] for r in _journal(dsn, job_id, 1)],
               20, what="W1 to report its abandoned lease once the database answers")
    _assert_w1_fenced_out(dsn, receiver.url, job_id, entity, tmp_path, w1_tool)
    assert not (tmp_path / "finished-1").exists()
    assert w1.proc.poll() is None, "W1 must survive the partition"


def test_p25_frozen_owner_wakes_up_to_zero_rows(dsn, receiver, sidecars, tmp_path):
    """Variant (b): a runtime pause (SIGSTOP) instead of a partition."""
    job_id, entity = _start_job(dsn, receiver.url, tmp_path, work_w1=600)
    w1 = sidecars(dsn, [TOOL], env=_env(dsn, receiver.url, SIDECAR_LOG_LEVEL="debug"))
    wait_until(lambda: (tmp_path / "started-1").exists(), 20, what="W1's tool")
    w1_tool = int((tmp_path / "started-1").read_text())
    w1.wait_event("heartbeat_ok", job_id=job_id)

    w1.proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: _lease_expired(dsn, job_id), 20, what="the lease to expire")
        _w2_finishes(dsn, receiver.url, sidecars, job_id)
        assert pid_alive(w1_tool)  # frozen sidecar, running tool: the dangerous moment
    finally:
        w1.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: not pid_alive(w1_tool), 10, what="W1's tool to be killed")
    wait_until(lambda: "heartbeat_lost" in [r["event"] for r in _journal(dsn, job_id, 1)],
               10, what="W1's heartbeat_lost")
    _assert_w1_fenced_out(dsn, receiver.url, job_id, entity, tmp_path, w1_tool)


def test_p25_result_finished_during_the_partition_is_never_committed(
        dsn, receiver, proxy, sidecars, tmp_path):
    """Variant (c): W1's tool finishes while W1 is cut off. Its result must never be
    committed or forwarded, also after the network returns; it is journaled as hash only."""
    slow = {"SIDECAR_LEASE_SECONDS": "6"}  # room for the tool to end before the deadline
    w1_dsn = through(dsn, proxy.port)
    job_id, entity = _start_job(dsn, receiver.url, tmp_path, work_w1=1.5, effect_w1=False)
    w1 = sidecars(w1_dsn, [TOOL], env=_env(w1_dsn, receiver.url, **slow))
    wait_until(lambda: (tmp_path / "started-1").exists(), 20, what="W1's tool")
    w1_tool = int((tmp_path / "started-1").read_text())
    wait_attempt_counted(dsn, job_id)  # else its expiry gives the attempt back (F16)
    proxy.blackhole()
    wait_until(lambda: (tmp_path / "finished-1").exists(), 10, what="W1's tool to finish")
    w1.wait_event("lease_abandoned", timeout=15)
    wait_until(lambda: _lease_expired(dsn, job_id), 20, what="the lease to expire")

    _w2_finishes(dsn, receiver.url, sidecars, job_id)
    proxy.restore()
    wait_until(lambda: "lease_abandoned" in [r["event"] for r in _journal(dsn, job_id, 1)],
               20, what="W1 to report its abandoned lease")
    _assert_w1_fenced_out(dsn, receiver.url, job_id, entity, tmp_path, w1_tool)
    w1_output = (json.dumps({"token": 1, "attempt": 1, "effect": None}) + "\n").encode()
    [rejected] = [r for r in _journal(dsn, job_id, 1) if r["event"] == "result_rejected"]
    assert rejected["details"]["result"] == {"sha256": hashlib.sha256(w1_output).hexdigest(),
                                             "bytes": len(w1_output)}
    time.sleep(1)  # and nothing of W1's arrives later
    assert job_row(dsn, job_id)["result"]["token"] == 2
