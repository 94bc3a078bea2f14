"""Issue 44, point 3: a tool asks to run again later without spending an attempt.

Through the guard (``POST /v1/snooze {"delay_seconds", "reason"}``, then it exits) or by
its profile's SNOOZE_EXIT_CODE (the delay then SNOOZE_SECONDS). The job goes back to the
queue at ``now() + delay`` by the database's clock, its attempt given back, ``snoozes``
one higher, journaled ``job_snoozed``; bounded by MAX_SNOOZES (one more fails it
``snooze_limit``) and by MAX_LIFETIME_SECONDS from its first claim (a snooze past it
fails ``max_lifetime_exceeded``). A snooze never outranks a lost lease.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncpg
import pytest

from kit import base_env, cli, enqueue, job_row, query, run
from sidecar.protocol.model import LeaseProfile, Usage
from sidecar.protocol.verdict import (
    SNOOZE_MAX_SECONDS,
    Failure,
    Observed,
    Reject,
    Release,
    Snooze,
    decide,
    parse_snooze,
)
from sidecar.protocol.vocabulary import FailureKind, StopReason
from sidecar.runtime.config import load_settings
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

TOOL = [sys.executable, str(Path(__file__).parent / "tools" / "snooze_tool.py")]


def _profile(**fields) -> LeaseProfile:
    env = {"SIDECAR_DATABASE_URL": "postgresql://127.0.0.1/x"}
    env.update({f"SIDECAR_PROFILE_SZ_{k}": str(v) for k, v in fields.items()})
    return load_settings(env).profile("sz")


# --- the pure rules ------------------------------------------------------------------

@pytest.mark.unit
def test_a_snooze_body_is_a_delay_and_an_optional_reason_and_nothing_else():
    assert parse_snooze(b'{"delay_seconds": 60}') == Snooze(60.0, None, "guard")
    assert parse_snooze(b'{"delay_seconds": 0.5, "reason": "rate limited"}') \
        == Snooze(0.5, "rate limited", "guard")
    assert parse_snooze(f'{{"delay_seconds": {SNOOZE_MAX_SECONDS}}}'.encode()).delay_seconds \
        == SNOOZE_MAX_SECONDS
    refused = {
        b"": "JSON object", b"[]": "JSON object", b'"60"': "JSON object", b"{": "JSON object",
        b"{}": "delay_seconds", b'{"delay_seconds": 0}': "delay_seconds",
        b'{"delay_seconds": -1}': "delay_seconds", b'{"delay_seconds": "60"}': "delay_seconds",
        b'{"delay_seconds": true}': "delay_seconds", b'{"delay_seconds": null}': "delay_seconds",
        b'{"delay_seconds": 1e400}': "delay_seconds",
        f'{{"delay_seconds": {SNOOZE_MAX_SECONDS + 1}}}'.encode(): "delay_seconds",
        b'{"delay_seconds": NaN}': "JSON object",
        b'{"delay_seconds": 5, "reason": ""}': "reason",
        b'{"delay_seconds": 5, "reason": "a\\nb"}': "reason",
        b'{"delay_seconds": 5, "reason": 7}': "reason",
        ('{"delay_seconds": 5, "reason": "' + "x" * 201 + '"}').encode(): "reason",
        b'{"delay_seconds": 5, "attempt": 0}': "unknown field 'attempt'",
    }
    for body, field in refused.items():
        with pytest.raises(ValueError, match=field):
            parse_snooze(body)


@pytest.mark.unit
def test_a_snooze_wins_over_a_result_but_not_over_ownership_shutdown_or_a_limit():
    profile = _profile(SNOOZE_EXIT_CODE=75, SNOOZE_SECONDS=30, MEMORY_BYTES=1 << 30)
    asked = Snooze(5.0, "later", "guard")
    assert decide(Observed(StopReason.EXITED, 0, snooze=asked), profile) == asked
    # asked, then hung until its deadline: the deadline's failure, the attempt spent
    hung = decide(Observed(StopReason.STAGE_TIMEOUT, -9, snooze=asked), profile)
    assert isinstance(hung, Failure) and hung.kind is FailureKind.STAGE_TIMEOUT
    assert isinstance(decide(Observed(StopReason.LEASE_LOST, 0, snooze=asked), profile), Reject)
    assert isinstance(decide(Observed(StopReason.CANCELLED, 0, snooze=asked), profile), Reject)
    assert isinstance(decide(Observed(StopReason.SHUTDOWN, 0, snooze=asked), profile), Release)
    oom = decide(Observed(StopReason.EXITED, -9, usage=Usage(oom_kills=1), snooze=asked),
                 profile)
    assert isinstance(oom, Failure) and oom.kind is FailureKind.MEMORY_LIMIT
    # the exit code asks it too, with the profile's delay; other codes stay failures
    assert decide(Observed(StopReason.EXITED, 75), profile) == Snooze(30.0, None, "exit_code")
    other = decide(Observed(StopReason.EXITED, 74), profile)
    assert isinstance(other, Failure) and other.kind is FailureKind.EXIT_CODE
    plain = decide(Observed(StopReason.EXITED, 75), _profile())  # none by default
    assert isinstance(plain, Failure) and plain.kind is FailureKind.EXIT_CODE


@pytest.mark.unit
def test_a_profile_refuses_a_snooze_code_that_also_fails_the_job_or_a_bad_one():
    from sidecar.protocol.errors import ConfigError
    with pytest.raises(ConfigError, match="SNOOZE_EXIT_CODE=64 is also in"):
        _profile(SNOOZE_EXIT_CODE=64)
    for bad in ("256", "-1", "x"):
        with pytest.raises(ConfigError, match="SNOOZE_EXIT_CODE"):
            _profile(SNOOZE_EXIT_CODE=bad)
    with pytest.raises(ConfigError, match="SNOOZE_SECONDS"):
        _profile(SNOOZE_SECONDS=0)
    with pytest.raises(ConfigError, match="MAX_SNOOZES"):
        _profile(MAX_SNOOZES=-1)
    with pytest.raises(ConfigError, match="SNOOZE_SECONDS=4e\\+07: at most 366 days"):
        _profile(SNOOZE_SECONDS=40000000)
    with pytest.raises(ConfigError, match="APPROVAL_WAIT_SECONDS=90000: at most 1 day"):
        _profile(APPROVAL_WAIT_SECONDS=90000)


# --- the fenced write ----------------------------------------------------------------

@pytest.mark.database
def test_a_snooze_is_written_only_by_the_attempt_that_owns_the_job(dsn):
    """A snooze written after the lease was taken over (a stale token) changes nothing;
    the owner's gives the attempt back and counts the snooze; the limit and the lifetime
    are read on the database's clock."""
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, init=init_connection)
        store, caller = WorkerStore(pool, 10), CallerStore(pool, 10)
        try:
            job_id, _ = await caller.enqueue("sz", {}, None, 3, {})
            old = await store.claim("sz", "w1", 30)
            await pool.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 s' "
                               "WHERE id = $1", job_id)
            new = await store.claim("sz", "w2", 30)  # taken over: token 2
            stale = await store.snooze_if_owner(old, "w1", 60, 10, None, {})
            snoozed = await store.snooze_if_owner(new, "w2", 60, 10, None, {})
            row = dict(await pool.fetchrow("SELECT state, attempt, snoozes, owner_id, "
                                           "run_after - now() AS wait FROM tool_jobs"))
            await pool.execute("UPDATE tool_jobs SET run_after = now() WHERE id = $1", job_id)
            third = await store.claim("sz", "w3", 30)
            limited = await store.snooze_if_owner(third, "w3", 60, 1, None, {})
            late = await store.snooze_if_owner(third, "w3", 3600, 10, 60, {})
            return old, new, stale, dict(snoozed), row, dict(limited), dict(late)
        finally:
            await pool.close()

    old, new, stale, snoozed, row, limited, late = run(go())
    assert stale is None and old.fencing_token < new.fencing_token
    assert snoozed["outcome"] == "snoozed" and snoozed["snoozes"] == 1
    assert row["state"] == "queued" and row["owner_id"] is None
    # the second claim's attempt given back (the first's, never started, was refunded)
    assert row["attempt"] == new.attempt - 1 and row["snoozes"] == 1
    assert 55 < row["wait"].total_seconds() <= 60
    assert limited["outcome"] == "snooze_limit" and limited["run_after"] is None
    assert late["outcome"] == "past_lifetime"
    events = [r["event"] for r in query(dsn, "SELECT event FROM tool_job_events "
                                             "WHERE event = 'job_snoozed'")]
    assert events == ["job_snoozed"]


# --- end to end, with a real tool ----------------------------------------------------

def _events(dsn, job_id, event):
    return [r["details"] for r in query(
        dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 AND event = $2 "
             "ORDER BY id", job_id, event)]


@pytest.mark.e2e
def test_a_tool_that_snoozes_twice_through_the_guard_runs_three_times_on_one_attempt(dsn):
    env = base_env(dsn, SIDECAR_POLL_SECONDS="0.5")
    job = enqueue(dsn, "sz", {"snoozes": 2, "delay": 1})
    done = cli(dsn, "run", "--tool", "sz", "--drain", "--", *TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row
    assert row["result"] == {"runs": 3, "attempt": 1}  # never "must_not_be_kept"
    assert row["attempt"] == 1 and row["snoozes"] == 2 and row["fencing_token"] == 3
    snoozes = query(dsn, "SELECT at, details FROM tool_job_events WHERE job_id = $1 AND "
                         "event = 'job_snoozed' ORDER BY id", job)
    assert [s["details"]["reason"] for s in snoozes] == ["run 1 of 3", "run 2 of 3"]
    assert all(s["details"]["via"] == "guard" and s["details"]["delay_s"] == 1
               for s in snoozes)
    claims = query(dsn, "SELECT at FROM tool_job_events WHERE job_id = $1 AND "
                        "event = 'job_claimed' ORDER BY id", job)
    assert len(claims) == 3
    for snoozed, claimed in zip(snoozes, claims[1:], strict=True):
        assert (claimed["at"] - snoozed["at"]).total_seconds() >= 1.0  # not before its delay


@pytest.mark.e2e
def test_a_tool_without_http_snoozes_by_its_exit_code(dsn):
    env = base_env(dsn, SIDECAR_POLL_SECONDS="0.5", SIDECAR_PROFILE_SZ_SNOOZE_EXIT_CODE="75",
                   SIDECAR_PROFILE_SZ_SNOOZE_SECONDS="1")
    job = enqueue(dsn, "sz", {"snoozes": 1, "via": "exit", "exit_code": 75})
    done = cli(dsn, "run", "--tool", "sz", "--drain", "--", *TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    row = job_row(dsn, job)
    assert row["state"] == "succeeded" and row["result"] == {"runs": 2, "attempt": 1}
    [snoozed] = _events(dsn, job, "job_snoozed")
    assert snoozed["via"] == "exit_code" and snoozed["delay_s"] == 1 and snoozed["snoozes"] == 1


@pytest.mark.e2e
def test_snoozes_past_max_snoozes_or_the_lifetime_fail_the_job_and_are_not_retried(dsn):
    env = base_env(dsn, SIDECAR_POLL_SECONDS="0.5", SIDECAR_PROFILE_SZ_MAX_SNOOZES="2",
                   SIDECAR_PROFILE_SZ_MAX_LIFETIME_SECONDS="600")
    greedy = enqueue(dsn, "sz", {"snoozes": 5, "delay": 0.2})
    too_late = enqueue(dsn, "sz", {"snoozes": 1, "delay": 3600})
    done = cli(dsn, "run", "--tool", "sz", "--drain", "--", *TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    row = job_row(dsn, greedy)
    assert row["state"] == "failed" and row["error"]["kind"] == "snooze_limit", row
    assert "MAX_SNOOZES" in row["error"]["message"]
    assert row["snoozes"] == 2 and row["attempt"] == 1
    row = job_row(dsn, too_late)
    assert row["state"] == "failed" and row["error"]["kind"] == "max_lifetime_exceeded", row
    assert row["snoozes"] == 0 and row["attempt"] == 1


@pytest.mark.e2e
def test_the_guard_refuses_hostile_snooze_bodies_and_keeps_none_of_them(dsn):
    bodies = ["", "[]", "{}", '{"delay_seconds": -5}', '{"delay_seconds": "9"}',
              '{"delay_seconds": 1e999}', '{"delay_seconds": 5, "reason": "\\u0000"}',
              '{"delay_seconds": 5, "x": 1}', "{" * 5000]
    job = enqueue(dsn, "sz", {"probe": bodies})
    done = cli(dsn, "run", "--tool", "sz", "--drain", "--", *TOOL, env=base_env(dsn),
               timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row
    assert row["result"]["statuses"] == [400] * 8 + [413]
    assert row["snoozes"] == 0 and _events(dsn, job, "job_snoozed") == []
