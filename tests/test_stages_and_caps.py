"""Stages (P19, P20), the lifetime cap (P12), the idle watchdog, cancellation of a chain and
the retry policy (P16), with real sidecar processes and a real PostgreSQL."""

from __future__ import annotations

import asyncpg
import orjson
import pytest

from kit import (
    base_env,
    cli,
    enqueue,
    job_row,
    journal_rows,
    pid_alive,
    query,
    run,
    wait_until,
)
from sidecar.protocol.model import NextStage, RawJson
from sidecar.runtime.config import load_settings
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker.commit import backoff_seconds

TOOL = "stage_tool.py"


def _drain(dsn, env, tool, command=(TOOL,)):
    done = cli(dsn, "run", "--tool", tool, "--drain", "--", *command, env=env, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done


@pytest.mark.e2e
def test_a_result_naming_an_allowed_next_stage_creates_it_once(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_FETCH_NEXT_TOOLS="publish",
                   SIDECAR_PROFILE_PUBLISH_MAX_ATTEMPTS="2")
    parent = enqueue(dsn, "fetch", {"mode": "first", "next": "publish"}, "--idempotency-key",
                     "report-7", env=env)
    _drain(dsn, env, "fetch")
    row = job_row(dsn, parent)
    assert row["state"] == "succeeded" and row["result"] == {"fetched": 3}
    [child] = query(dsn, "SELECT * FROM tool_jobs WHERE parent_id = $1", parent)
    assert child["tool"] == "publish" and child["stage"] == 1 and child["state"] == "queued"
    assert child["idempotency_key"] == "report-7:stage:1"
    assert child["payload"] == {"mode": "last", "n": 3} and child["max_attempts"] == 2
    shown = orjson.loads(cli(dsn, "show", parent, env=env).stdout)
    assert [s["id"] for s in shown["next_stages"]] == [str(child["id"])]

    _drain(dsn, env, "publish")
    done = job_row(dsn, child["id"])
    assert done["state"] == "succeeded" and done["result"] == {"got": {"mode": "last", "n": 3}}


@pytest.mark.e2e
def test_a_next_stage_tool_not_in_the_profile_fails_stage_not_allowed(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_FETCH_NEXT_TOOLS="publish")
    parent = enqueue(dsn, "fetch", {"mode": "first", "next": "rm-rf"}, env=env)
    _drain(dsn, env, "fetch")
    row = job_row(dsn, parent)
    assert row["state"] == "failed" and row["error"]["kind"] == "stage_not_allowed"
    assert row["attempt"] == 1 and "rm-rf" in row["error"]["message"]
    assert query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1", parent) == []


@pytest.mark.database
def test_a_repeated_completion_never_creates_two_next_stages(dsn):
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, init=init_connection)
        store, caller = WorkerStore(pool, 10), CallerStore(pool, 10)
        job_id, _ = await caller.enqueue("fetch", {}, "k-1", 3, {})
        job = await store.claim("fetch", "w1", 30)
        nxt = NextStage("publish", {"n": 1}, 3)
        first = await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                            "job_succeeded", {}, None, nxt)
        second = await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                             "job_succeeded", {}, None, nxt)
        # Even a stale owner's completion (the same job, an old token) cannot add one.
        await pool.execute("UPDATE tool_jobs SET state = 'running', lease_until = now() + "
                           "interval '1 minute', owner_id = 'w1' WHERE id = $1", job_id)
        third = await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                            "job_succeeded", {}, None, nxt)
        await pool.close()
        return job_id, first, second, third

    job_id, first, second, third = run(go())
    assert first is True and second is False and third is True
    children = query(dsn, "SELECT idempotency_key FROM tool_jobs WHERE parent_id = $1", job_id)
    assert [c["idempotency_key"] for c in children] == ["k-1:stage:1"]


@pytest.mark.e2e
def test_cancelling_a_parent_cancels_its_queued_stages(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_FETCH_NEXT_TOOLS="publish")
    parent = enqueue(dsn, "fetch", {"mode": "first", "next": "publish"}, env=env)
    _drain(dsn, env, "fetch")
    [child] = query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1", parent)
    done = cli(dsn, "cancel", parent, env=env)
    assert done.returncode == 0, done.stderr.decode()
    out = orjson.loads(done.stdout)
    assert out["cancelled"] is False and out["previous_state"] == "succeeded"
    assert out["cancelled_stages"] == [str(child["id"])]
    assert job_row(dsn, child["id"])["state"] == "cancelled"
    assert job_row(dsn, parent)["state"] == "succeeded"


@pytest.mark.e2e
def test_lifetime_cap_kills_a_heartbeating_job(dsn, sidecars, tmp_path):
    env = base_env(dsn, SIDECAR_MAX_LIFETIME_SECONDS="2")
    job_id = enqueue(dsn, TOOL, {"mode": "idle"}, env=env)
    sc = sidecars(dsn, [TOOL], env=env)
    started = sc.wait_event("tool_request_started", job_id=job_id)
    wait_until(lambda: job_row(dsn, job_id)["state"] == "failed", 15, what="the lifetime cap")
    row = job_row(dsn, job_id)
    assert row["error"]["kind"] == "max_lifetime_exceeded" and row["attempt"] == 1
    assert not pid_alive(started["pid"])
    [killed] = journal_rows(dsn, job_id, "child_killed")
    assert killed["details"]["reason"] == "max_lifetime_exceeded"
    # Heartbeats kept the lease alive all along: the cap, not the lease, ended it.
    assert journal_rows(dsn, job_id, "heartbeat_lost") == []
    elapsed = (row["finished_at"] - row["first_claimed_at"]).total_seconds()
    assert 2 <= elapsed < 2 + 1 + 3  # cap + kill grace + slack


@pytest.mark.e2e
def test_lifetime_counts_from_the_first_claim_across_attempts(dsn, sidecars):
    """A job whose lifetime is already spent when re-claimed fails at once."""
    env = base_env(dsn, SIDECAR_MAX_LIFETIME_SECONDS="5")
    job_id = enqueue(dsn, TOOL, {"mode": "last"}, env=env)
    query(dsn, "UPDATE tool_jobs SET first_claimed_at = now() - interval '10 seconds' "
               "WHERE id = $1", job_id)
    _drain(dsn, env, TOOL)
    row = job_row(dsn, job_id)
    assert row["state"] == "failed" and row["error"]["kind"] == "max_lifetime_exceeded"
    assert journal_rows(dsn, job_id, "tool_request_started") == []


@pytest.mark.e2e
def test_idle_tool_is_killed_and_busy_one_spared(dsn):
    env = base_env(dsn, SIDECAR_IDLE_TIMEOUT_SECONDS="1.5", SIDECAR_MAX_ATTEMPTS="1")
    idle = enqueue(dsn, TOOL, {"mode": "idle"}, env=env)
    busy = enqueue(dsn, TOOL, {"mode": "busy", "seconds": 4}, env=env)
    done = cli(dsn, "run", "--concurrency", "2", "--drain", "--", TOOL, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    idle_row, busy_row = job_row(dsn, idle), job_row(dsn, busy)
    assert idle_row["state"] == "failed" and idle_row["error"]["kind"] == "idle_timeout"
    assert busy_row["state"] == "succeeded" and busy_row["result"] == {"spun": True}
    assert journal_rows(dsn, idle, "child_killed")[0]["details"]["reason"] == "idle_timeout"


@pytest.mark.unit
def test_backoff_uses_full_jitter_within_the_cap():
    profile = load_settings({"SIDECAR_BACKOFF_BASE_SECONDS": "1",
                             "SIDECAR_BACKOFF_MAX_SECONDS": "8"}).profile("t")
    for attempt, cap in ((1, 1), (2, 2), (3, 4), (4, 8), (9, 8)):
        draws = [backoff_seconds(profile, attempt) for _ in range(400)]
        assert all(0 <= d <= cap for d in draws)
        assert min(draws) < cap * 0.2 and max(draws) > cap * 0.8  # spread over [0, cap]


@pytest.mark.e2e
def test_a_dead_lettered_job_keeps_every_attempt_in_the_journal(dsn):
    env = base_env(dsn)
    job_id = enqueue(dsn, "flaky", {}, "--max-attempts", "3", env=env)
    _drain(dsn, env, "flaky", command=("sh", "-c", "echo boom >&2; exit 3"))
    row = job_row(dsn, job_id)
    assert row["state"] == "failed" and row["error"]["exit_code"] == 3
    assert "boom" in row["error"]["stderr_tail"]
    summaries = [e["details"] for e in journal_rows(dsn, job_id, "job_retry_scheduled")] + \
        [e["details"] for e in journal_rows(dsn, job_id, "job_failed")]
    assert [(s["attempt"], s["kind"], s["exit_code"]) for s in summaries] == \
        [(1, "exit_code", 3), (2, "exit_code", 3), (3, "exit_code", 3)]
    assert all("duration_s" in s for s in summaries)




@pytest.mark.e2e
def test_a_checkpoint_reaches_the_next_attempt(dsn):
    env = base_env(dsn)
    job_id = enqueue(dsn, "resume_tool.py", {}, "--max-attempts", "2", env=env)
    _drain(dsn, env, "resume_tool.py", command=("resume_tool.py",))
    row = job_row(dsn, job_id)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"resumed_from": {"page": 7}, "attempt": 2}
    assert row["checkpoint"] == {"page": 7}
    [saved] = journal_rows(dsn, job_id, "checkpoint_saved")
    assert saved["fencing_token"] == 1 and saved["details"]["bytes"] == len('{"page": 7}')
