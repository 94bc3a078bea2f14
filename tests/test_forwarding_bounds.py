"""Case F21: forwarding is bounded and a redirect is not a delivery.

Kind: a delivery outcome taken for something it is not, and a delivery that never ends.
(1) The HTTP client followed redirects, so a receiver answering ``POST /hook`` with a 301
to a page answering GET 200 made the outbox row ``delivered`` although the receiver never
saw the result (the POST became a bodyless GET); every 3xx (301, 302, 303, 307, 308) is the
same fault, and a followed 307/308 is a delivery only when the profile opts in
(``FORWARD_FOLLOW_REDIRECTS``, same method, body and headers). (2) A receiver answering 5xx
(or 408/429, or not answering) was retried for ever and the job was never pruned: retries
are bounded by ``FORWARD_MAX_ATTEMPTS`` and ``FORWARD_MAX_AGE_SECONDS`` per profile, then
dead-lettered, journaled (``forward_dead_lettered`` with its kind), counted
(``sidecar_forward_dead_letters_total``), shown by ``sidecar show``, prunable by retention,
and delivered again by ``sidecar retry --forwarding JOB_ID``.

Real aiohttp receivers on loopback (tests/http_sink.py), real sidecar processes, a real
PostgreSQL.
"""

from __future__ import annotations

import orjson
import pytest

from kit import (
    base_env,
    cli,
    enqueue,
    journal_rows,
    one_line_error,
    query,
    scraped_metric,
    wait_until,
)
from sidecar.runtime.config import load_settings

TOOL = "echo-json"


def _env(dsn, url, **profile):
    extra = {f"SIDECAR_PROFILE_ECHO_JSON_{k}": str(v) for k, v in profile.items()}
    return base_env(dsn, SIDECAR_PROFILE_ECHO_JSON_RESULT_URL=f"{url}/hook", **extra)


def _outbox(dsn, job_id):
    return query(dsn, "SELECT * FROM tool_job_outbox WHERE job_id = $1", job_id)


def _drain(dsn, env):
    done = cli(dsn, "run", "--tool", TOOL, "--drain", "--", "cat", env=env, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def _wait_state(dsn, job_id, state, timeout=30.0):
    wait_until(lambda: (_outbox(dsn, job_id) or [{}])[0].get("state") == state, timeout,
               what=f"outbox row {state}")
    return _outbox(dsn, job_id)[0]


@pytest.mark.e2e
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_never_a_delivery(dsn, sink, status):
    """The case's input (301 to a page that answers GET 200), and every other 3xx."""
    server = sink([(status, {}, {"Location": "/page"}), (200, {"page": True})])
    env = _env(dsn, server.url)
    job_id = enqueue(dsn, TOOL, {"n": 1}, env=env)
    _drain(dsn, env)

    [row] = _outbox(dsn, job_id)
    assert row["state"] == "dead_lettered", row
    assert row["last_status"] == status
    assert "/page" in row["last_error"] and "redirect" in row["last_error"]
    assert [(r.method, r.path) for r in server.requests] == [("POST", "/hook")]
    [dead] = journal_rows(dsn, job_id, "forward_dead_lettered")
    assert dead["details"]["kind"] == "redirect" and dead["details"]["location"] == "/page"
    assert journal_rows(dsn, job_id, "effect_forwarded") == []
    assert journal_rows(dsn, job_id, "effect_rejected") == []  # the receiver refused nothing
    shown = orjson.loads(cli(dsn, "show", job_id, env=env).stdout)
    assert shown["forwarding"][0]["state"] == "dead_lettered"
    assert "/page" in shown["forwarding"][0]["last_error"]


@pytest.mark.e2e
@pytest.mark.parametrize("status", [307, 308])
def test_a_307_or_308_is_followed_only_when_the_profile_opts_in(dsn, sink, status):
    server = sink([(status, {}, {"Location": "/v2/hook"}), (201, {"ok": True})])
    env = _env(dsn, server.url, FORWARD_FOLLOW_REDIRECTS="true")
    job_id = enqueue(dsn, TOOL, {"n": 2}, env=env)
    _drain(dsn, env)

    [row] = _outbox(dsn, job_id)
    assert row["state"] == "delivered" and row["last_status"] == 201
    first, second = server.requests
    assert (first.method, first.path, second.method, second.path) == \
        ("POST", "/hook", "POST", "/v2/hook")
    assert second.body == first.body and second.body["result"] == {"n": 2}
    assert second.headers["Idempotency-Key"] == f"tool-job:{job_id}:result"
    assert second.headers["X-Execution-Fence"] == "1"


@pytest.mark.e2e
def test_the_opt_in_never_follows_a_301(dsn, sink):
    server = sink([(301, {}, {"Location": "/page"}), (200, {})])
    env = _env(dsn, server.url, FORWARD_FOLLOW_REDIRECTS="true")
    job_id = enqueue(dsn, TOOL, {"n": 3}, env=env)
    _drain(dsn, env)
    assert _outbox(dsn, job_id)[0]["state"] == "dead_lettered"
    assert len(server.requests) == 1


@pytest.mark.e2e
def test_a_redirect_loop_ends_in_a_dead_letter(dsn, sink):
    server = sink([(307, {}, {"Location": "/hook"})])
    env = _env(dsn, server.url, FORWARD_FOLLOW_REDIRECTS="true")
    job_id = enqueue(dsn, TOOL, {"n": 4}, env=env)
    _drain(dsn, env)
    row = _outbox(dsn, job_id)[0]
    assert row["state"] == "dead_lettered" and row["last_status"] == 307
    assert len(server.requests) == 6  # the first POST and MAX_REDIRECTS hops


@pytest.mark.e2e
def test_retries_end_after_max_attempts_and_the_job_can_then_be_pruned(dsn, sink, sidecars):
    """The case's second input: a receiver answering 500 for ever."""
    server = sink([(500, {"error": "boom"})])
    env = _env(dsn, server.url, FORWARD_MAX_ATTEMPTS=3)
    sc = sidecars(dsn, ["cat"], "--tool", TOOL, env=env)
    base = "http://" + sc.wait_event("worker_started")["http_addr"]
    job_id = enqueue(dsn, TOOL, {"n": 5}, env=env)

    row = _wait_state(dsn, job_id, "dead_lettered")
    assert row["attempts"] == 3 and len(server.requests) == 3 and row["last_status"] == 500
    [dead] = journal_rows(dsn, job_id, "forward_dead_lettered")
    assert dead["details"]["kind"] == "max_attempts" and dead["details"]["attempts"] == 3
    assert journal_rows(dsn, job_id, "effect_rejected") == []
    logged = sc.wait_event("forward_dead_lettered", job_id=job_id)
    assert logged["kind"] == "max_attempts" and logged["level"] == "warning"
    assert scraped_metric(base, "sidecar_forward_dead_letters_total", tool=TOOL,
                          kind="max_attempts") == 1
    assert scraped_metric(base, "sidecar_forward_dead_letters_total", tool=TOOL,
                          kind="max_age") == 0
    shown = orjson.loads(cli(dsn, "show", job_id, env=env).stdout)
    assert shown["forwarding"][0]["state"] == "dead_lettered"
    assert "3 delivery attempts" in shown["forwarding"][0]["last_error"]

    # Retention keeps a job only while its result is still to be forwarded.
    query(dsn, "UPDATE tool_jobs SET finished_at = now() - interval '1 hour' WHERE id = $1",
          job_id)
    done = cli(dsn, "prune", "--older-than", "60", "--state", "succeeded", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["outbox"] == 1
    assert query(dsn, "SELECT id FROM tool_jobs WHERE id = $1", job_id) == []
    assert _outbox(dsn, job_id) == []


@pytest.mark.e2e
def test_retries_end_at_max_age(dsn, sink, sidecars):
    server = sink([(503, {"error": "busy"})])
    env = _env(dsn, server.url, FORWARD_MAX_ATTEMPTS=10000, FORWARD_MAX_AGE_SECONDS=2)
    sidecars(dsn, ["cat"], "--tool", TOOL, env=env)
    job_id = enqueue(dsn, TOOL, {"n": 6}, env=env)

    row = _wait_state(dsn, job_id, "dead_lettered")
    assert 1 < row["attempts"] < 10000 and row["last_status"] == 503
    [dead] = journal_rows(dsn, job_id, "forward_dead_lettered")
    assert dead["details"]["kind"] == "max_age" and dead["details"]["age_s"] >= 2
    assert len(server.requests) == row["attempts"]


@pytest.mark.e2e
def test_retry_forwarding_delivers_a_dead_letter_again(dsn, sink, sidecars):
    server = sink([(500, {}), (500, {}), (200, {"ok": True})])
    env = _env(dsn, server.url, FORWARD_MAX_ATTEMPTS=2)
    sidecars(dsn, ["cat"], "--tool", TOOL, env=env)
    job_id = enqueue(dsn, TOOL, {"n": 7}, env=env)
    _wait_state(dsn, job_id, "dead_lettered")

    done = cli(dsn, "retry", "--forwarding", job_id, env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["count"] == 1
    row = _wait_state(dsn, job_id, "delivered")
    assert row["attempts"] == 1 and len(server.requests) == 3
    [again] = journal_rows(dsn, job_id, "forward_redelivery")
    assert again["details"]["previous_status"] == 500
    assert again["details"]["by"] == "sidecar retry --forwarding"

    # Nothing dead-lettered any more: one line, exit 1.
    done = cli(dsn, "retry", "--forwarding", job_id, env=env)
    assert done.returncode == 1
    assert "no dead-lettered forwarding" in one_line_error(done)


@pytest.mark.e2e
def test_retry_forwarding_refuses_bad_input_with_one_line(dsn):
    env = base_env(dsn)
    cli(dsn, "migrate", env=env)
    done = cli(dsn, "retry", "--forwarding", "not-a-uuid", env=env)
    assert done.returncode == 2 and "JOB_ID" in one_line_error(done)
    done = cli(dsn, "retry", "--forwarding", "--tool", "x", env=env)
    assert done.returncode == 2 and "--forwarding" in one_line_error(done)
    done = cli(dsn, "retry", "--forwarding", "00000000-0000-0000-0000-000000000001", env=env)
    assert done.returncode == 1 and "no job" in one_line_error(done)
    job_id = enqueue(dsn, TOOL, {}, env=env)  # no RESULT_URL: no forwarding at all
    done = cli(dsn, "retry", "--forwarding", job_id, env=env)
    assert done.returncode == 1 and "no dead-lettered forwarding" in one_line_error(done)


@pytest.mark.unit
def test_forwarding_bounds_are_profile_fields_with_defaults():
    settings = load_settings({"SIDECAR_PROFILE_ECHO_JSON_FORWARD_MAX_ATTEMPTS": "4",
                              "SIDECAR_PROFILE_ECHO_JSON_FORWARD_MAX_AGE_SECONDS": "60",
                              "SIDECAR_PROFILE_ECHO_JSON_MAX_ATTEMPTS": "2"})
    profile = settings.profile(TOOL)
    assert (profile.forward_max_attempts, profile.forward_max_age_seconds,
            profile.max_attempts, profile.forward_follow_redirects) == (4, 60, 2, False)
    default = settings.profile("other")
    assert (default.forward_max_attempts, default.forward_max_age_seconds) == (20, 86400)


@pytest.mark.e2e
@pytest.mark.parametrize("var", ["SIDECAR_FORWARD_MAX_ATTEMPTS",
                                 "SIDECAR_PROFILE_X_FORWARD_MAX_AGE_SECONDS"])
def test_a_bound_of_zero_is_refused_with_one_line(dsn, var):
    done = cli(dsn, "config", env=base_env(dsn, **{var: "0"}))
    line = one_line_error(done)
    assert done.returncode == 2 and var in line and "must be a positive number" in line
