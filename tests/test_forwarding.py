"""Result forwarding through the outbox: at least once, idempotent, fenced, dead-lettered
when the receiver refuses for good, and never for a rejected completion."""

from __future__ import annotations

import orjson
import pytest

from kit import base_env, cli, enqueue, free_port, journal_rows, query, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.server]


def _env(dsn, url, tool="echo-json", **extra):
    key = tool.upper().replace("-", "_")
    return base_env(dsn, **{f"SIDECAR_PROFILE_{key}_RESULT_URL": f"{url}/results"}, **extra)


def _outbox(dsn, job_id):
    return query(dsn, "SELECT * FROM tool_job_outbox WHERE job_id = $1", job_id)


def _run_drain(dsn, env, tool="echo-json", command=("cat",)):
    done = cli(dsn, "run", "--tool", tool, "--drain", "--", *command, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done


def test_accepted_result_is_posted_once_with_key_and_fence(dsn, sink):
    server = sink([(201, {"effect_id": 1})])
    env = _env(dsn, server.url)
    job_id = enqueue(dsn, "echo-json", {"answer": 42}, env=env)
    _run_drain(dsn, env)
    assert len(server.requests) == 1
    request = server.requests[0]
    assert request.path == "/results"
    assert request.headers["Idempotency-Key"] == f"tool-job:{job_id}:result"
    assert request.headers["X-Execution-Fence"] == "1"
    assert request.body == {"job_id": job_id, "tool": "echo-json", "fencing_token": 1,
                            "attempt": 1, "result": {"answer": 42}}
    [row] = _outbox(dsn, job_id)
    assert row["state"] == "delivered" and row["attempts"] == 1 and row["last_status"] == 201
    assert journal_rows(dsn, job_id, "effect_forwarded")[0]["details"]["status"] == 201
    shown = orjson.loads(cli(dsn, "show", job_id, env=env).stdout)
    assert shown["forwarding"][0]["state"] == "delivered"


def test_server_errors_are_retried_with_backoff_until_delivered(dsn, sink):
    server = sink([(503, {"error": "busy"}), (429, {"error": "slow down"}), (200, {})])
    env = _env(dsn, server.url)
    job_id = enqueue(dsn, "echo-json", {"n": 1}, env=env)
    _run_drain(dsn, env)
    assert [r.headers["Idempotency-Key"] for r in server.requests] == \
        [f"tool-job:{job_id}:result"] * 3
    [row] = _outbox(dsn, job_id)
    assert row["state"] == "delivered" and row["attempts"] == 3


@pytest.mark.parametrize("status, body, reason", [
    (409, {"error": "stale_fence", "fence": 1, "current": 2}, "stale_fence"),
    (422, {"error": "idempotency_key_reused"}, "idempotency_key_reused"),
    (400, {"error": "bad_header"}, "bad_header"),
])
def test_permanent_refusal_dead_letters_with_the_reason(dsn, sink, status, body, reason):
    server = sink([(status, body)])
    env = _env(dsn, server.url)
    job_id = enqueue(dsn, "echo-json", {"n": 1}, env=env)
    _run_drain(dsn, env)
    assert len(server.requests) == 1  # never retried
    [row] = _outbox(dsn, job_id)
    assert row["state"] == "dead_lettered" and row["last_error"] == reason
    assert journal_rows(dsn, job_id, "effect_rejected")[0]["details"]["reason"] == reason
    assert journal_rows(dsn, job_id, "forward_dead_lettered")[0]["details"]["status"] == status
    # The job's own outcome stands: the result was accepted before it was forwarded.
    assert query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]["state"] == \
        "succeeded"
    shown = orjson.loads(cli(dsn, "show", job_id, env=env).stdout)
    assert shown["forwarding"][0]["state"] == "dead_lettered"


def test_failed_job_is_not_forwarded(dsn, sink):
    server = sink()
    env = _env(dsn, server.url, tool="not-json")
    job_id = enqueue(dsn, "not-json", {}, env=env)
    _run_drain(dsn, env, tool="not-json", command=("echo", "not json"))
    assert query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job_id)[0]["state"] == "failed"
    assert _outbox(dsn, job_id) == [] and server.requests == []


def test_delivery_survives_a_sidecar_restart_and_any_sidecar_delivers(dsn, sink, sidecars):
    """The receiver is down while the job completes; the row waits in the outbox and a
    later sidecar, of another tool even, delivers it."""
    down = f"http://127.0.0.1:{free_port()}"
    env = _env(dsn, down, SIDECAR_BACKOFF_BASE_SECONDS="30", SIDECAR_BACKOFF_MAX_SECONDS="30")
    job_id = enqueue(dsn, "echo-json", {"n": 7}, env=env)
    _run_drain(dsn, env)  # delivery refused: retried later, the sidecar exits
    [row] = _outbox(dsn, job_id)
    assert row["state"] == "pending" and row["attempts"] == 1 and row["last_status"] is None

    server = sink([(200, {})])
    query(dsn, "UPDATE tool_job_outbox SET url = $1, next_attempt_at = now() WHERE id = $2",
          f"{server.url}/results", row["id"])
    sidecars(dsn, ["cat"], "--tool", "other-tool")  # serves another tool, stays up
    wait_until(lambda: _outbox(dsn, job_id)[0]["state"] == "delivered", 15,
               what="delivery by another sidecar")
    assert len(server.requests) == 1 and server.requests[0].body["result"] == {"n": 7}


def test_result_url_must_be_http(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_X_RESULT_URL="ftp://example/x")
    done = cli(dsn, "enqueue", "x", env=env)
    assert done.returncode == 2
    assert "SIDECAR_PROFILE_X_RESULT_URL" in done.stderr.decode()
