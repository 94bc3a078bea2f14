"""Wake-ups without a herd (issue 15): a job queued for a tool wakes one idle sidecar of
that tool on its own channel, not every sidecar of every tool; the claims this costs are
counted by outcome; a wake-up sent to a sidecar that died leaves the job to polling."""

from __future__ import annotations

import sys
import time

import pytest

from kit import base_env, enqueue, metric_total, metrics_text, query, scalar, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.server]

TOOL_OK = [sys.executable, "-c", "print('{\"ok\": true}')"]


def _claims(addr: str) -> dict[str, float]:
    page = metrics_text(f"http://{addr}", timeout=5)
    return {outcome: metric_total(page, "sidecar_claim_attempts_total", outcome=outcome)
            for outcome in ("claimed", "empty")}


def _start(dsn, sidecars, tool, count, poll):
    env = base_env(dsn, SIDECAR_POLL_SECONDS=str(poll), SIDECAR_HTTP_ADDR="127.0.0.1:0")
    procs = [sidecars(dsn, TOOL_OK, "--tool", tool, env=env) for _ in range(count)]
    return [p.wait_event("worker_started")["http_addr"] for p in procs]


def _idle(dsn, tool) -> int:
    return scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars WHERE tool = $1", tool)


def test_one_enqueue_wakes_one_idle_sidecar_of_its_tool_and_no_other(dsn, sidecars):
    mine = _start(dsn, sidecars, "wake-a", 4, poll=60)
    others = _start(dsn, sidecars, "wake-b", 2, poll=60)
    wait_until(lambda: _idle(dsn, "wake-a") == 4 and _idle(dsn, "wake-b") == 2, 20,
               what="every sidecar on the idle list")
    before = [_claims(a) for a in mine + others]
    started = time.monotonic()
    job = enqueue(dsn, "wake-a", {})
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                             job)[0]["state"] == "succeeded", 10, what="the job done")
    assert time.monotonic() - started < 10  # woken, not polled (the poll is 60 s)
    wait_until(lambda: _idle(dsn, "wake-a") == 4, 10, what="the woken one idle again")
    after = [_claims(a) for a in mine + others]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    mine_delta, others_delta = delta[:4], delta[4:]
    assert sum(d["claimed"] for d in mine_delta) == 1, delta
    # The woken sidecar claims the job, then finds no second one: two statements in all.
    assert sum(d["claimed"] + d["empty"] for d in mine_delta) <= 2, delta
    assert all(d == {"claimed": 0.0, "empty": 0.0} for d in others_delta), delta


def test_a_wake_up_sent_to_a_dead_sidecar_leaves_the_job_to_polling(dsn, sidecars):
    _start(dsn, sidecars, "wake-c", 1, poll=1)
    wait_until(lambda: _idle(dsn, "wake-c") == 1, 20, what="the sidecar on the idle list")
    # A sidecar that died while idle: registered longest, so the next wake-up goes to it.
    query(dsn, "INSERT INTO tool_idle_sidecars (owner_id, tool, channel, seen_at) VALUES "
               "('dead:1:0', 'wake-c', 'sidecar_wake_nobody', now() - interval '1 minute')")
    job = enqueue(dsn, "wake-c", {})
    assert scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars WHERE owner_id = "
                       "'dead:1:0'") == 0  # its wake-up was spent on it
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                             job)[0]["state"] == "succeeded", 10,
               what="the job claimed at the live sidecar's next poll")


SLEEPER = [sys.executable, "-c", "import json, sys, time; time.sleep(json.load(sys.stdin)"
           ".get('sleep', 0)); print('{\"ok\": true}')"]


def test_a_sidecar_that_fills_up_without_a_wake_up_leaves_the_idle_list(dsn, sidecars):
    """X (registered first, polling every second) takes a job queued without a wake-up and
    is then full; the next job's wake-up must go to Y, which is idle, not to X."""
    env = base_env(dsn, SIDECAR_HTTP_ADDR="127.0.0.1:0")
    sidecars(dsn, SLEEPER, "--tool", "wake-d", env={**env, "SIDECAR_POLL_SECONDS": "1"})
    wait_until(lambda: _idle(dsn, "wake-d") == 1, 20, what="X on the idle list")
    sidecars(dsn, SLEEPER, "--tool", "wake-d", env={**env, "SIDECAR_POLL_SECONDS": "60"})
    wait_until(lambda: _idle(dsn, "wake-d") == 2, 20, what="Y on the idle list")
    [quiet] = query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, "
                         "max_attempts) VALUES (gen_random_uuid(), 'wake-d', 'quiet', "
                         "'{\"sleep\": 20}', 1) RETURNING id::text AS id")
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1::uuid",
                             quiet["id"])[0]["state"] == "running", 10,
               what="X polled the quiet job")
    wait_until(lambda: _idle(dsn, "wake-d") == 1, 5, what="X off the idle list, full")
    job = enqueue(dsn, "wake-d", {})
    wait_until(lambda: query(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                             job)[0]["state"] == "succeeded", 10,
               what="the second job, woken at Y (X is busy for 20 s, Y polls every 60 s)")
