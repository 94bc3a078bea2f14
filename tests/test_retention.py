"""Retention (issue 15): finished jobs and their journal and outbox rows are deleted once
older than their state's retention, by `sidecar prune` and by every `sidecar run`; a job
with a live later stage or a result still to forward is kept; one pruner at a time."""

from __future__ import annotations

import sys
import urllib.request

import asyncpg
import orjson
import pytest

from kit import base_env, cli, one_line_error, query, run, scalar
from sidecar.ops.retention import PRUNE_LOCK_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.server]

DAY = 86400


def _job(dsn: str, name: str, state: str, finished_days_ago: float | None,
         parent: str | None = None) -> str:
    """One job row as the sidecar leaves it, finished ``finished_days_ago`` days ago, with
    two journal rows (enqueued, and its end)."""
    [row] = query(dsn, """
        INSERT INTO tool_jobs (id, tool, idempotency_key, payload, state, parent_id,
                               max_attempts, finished_at)
        VALUES (gen_random_uuid(), 'ret', $1, '{}', $2, $3::uuid, 3,
                CASE WHEN $4::float8 IS NULL THEN NULL
                     ELSE now() - $4::float8 * interval '1 day' END)
        RETURNING id::text AS id""", name, state, parent, finished_days_ago)
    query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event) VALUES "
               "($1::uuid, 0, 'job_enqueued'), ($1::uuid, 1, 'job_' || $2)", row["id"], state)
    return row["id"]


def _outbox(dsn: str, job: str, state: str) -> None:
    query(dsn, "INSERT INTO tool_job_outbox (job_id, tool, url, idempotency_key, "
               "fencing_token, body, state) VALUES ($1::uuid, 'ret', 'http://127.0.0.1:9/', "
               "'tool-job:' || $1 || ':result', 1, '{}', $2)", job, state)


def _ids(dsn: str) -> set[str]:
    return {r["id"] for r in query(dsn, "SELECT id::text AS id FROM tool_jobs")}


def _prune(dsn: str, *args: str, env: dict | None = None) -> dict:
    done = cli(dsn, "prune", *args, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)


def _fixture(dsn: str) -> dict[str, str]:
    jobs = {
        "old_ok": _job(dsn, "old_ok", "succeeded", 8),
        "new_ok": _job(dsn, "new_ok", "succeeded", 6),
        "old_cancelled": _job(dsn, "old_cancelled", "cancelled", 8),
        "failed_10d": _job(dsn, "failed_10d", "failed", 10),
        "failed_31d": _job(dsn, "failed_31d", "failed", 31),
        "queued": _job(dsn, "queued", "queued", None),
        "old_outbox_pending": _job(dsn, "old_outbox_pending", "succeeded", 8),
        "old_outbox_delivered": _job(dsn, "old_outbox_delivered", "succeeded", 8),
        "old_parent": _job(dsn, "old_parent", "succeeded", 9),
    }
    # A finished stage whose own next stage is still running: the chain is kept whole.
    jobs["old_middle"] = _job(dsn, "old_middle", "succeeded", 8, parent=jobs["old_parent"])
    jobs["running_stage"] = _job(dsn, "running_stage", "running", None,
                                 parent=jobs["old_middle"])
    _outbox(dsn, jobs["old_outbox_pending"], "pending")
    _outbox(dsn, jobs["old_outbox_delivered"], "delivered")
    return jobs


def test_prune_removes_what_the_default_retention_allows_and_keeps_the_rest(dsn):
    jobs = _fixture(dsn)
    events_before = scalar(dsn, "SELECT count(*) FROM tool_job_events")

    dry = _prune(dsn, "--dry-run")
    assert dry["dry_run"] is True and dry["busy"] is False
    assert {s: c["jobs"] for s, c in dry["removed"].items()} == {
        "succeeded": 2, "cancelled": 1, "failed": 1}, dry
    assert _ids(dsn) == set(jobs.values())  # a dry run removes nothing
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events") == events_before

    done = _prune(dsn)
    assert done["dry_run"] is False and done["jobs"] == 4, done
    assert done["events"] == 8 and done["outbox"] == 1, done
    assert {s: c["jobs"] for s, c in done["removed"].items()} == {
        s: c["jobs"] for s, c in dry["removed"].items()}
    assert done["older_than_s"] == {"succeeded": 7 * DAY, "failed": 30 * DAY,
                                    "cancelled": 7 * DAY}
    removed = {jobs[k] for k in ("old_ok", "old_cancelled", "failed_31d",
                                 "old_outbox_delivered")}
    assert _ids(dsn) == set(jobs.values()) - removed
    # Nothing of a removed job is left behind; everything of a kept one is.
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE job_id::text = ANY($1)",
                  sorted(removed)) == 0
    assert scalar(dsn, "SELECT count(*) FROM tool_job_outbox") == 1
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events") == events_before - 8
    assert _prune(dsn)["jobs"] == 0  # nothing more to do


def test_prune_by_state_and_age_on_demand(dsn):
    jobs = _fixture(dsn)
    done = _prune(dsn, "--state", "failed", "--older-than", "9d")
    assert done["removed"] == {"failed": {"jobs": 2, "events": 4, "outbox": 0}}, done
    assert done["older_than_s"] == {"failed": 9 * DAY}
    assert jobs["failed_10d"] not in _ids(dsn) and jobs["failed_31d"] not in _ids(dsn)
    assert jobs["old_ok"] in _ids(dsn)


def test_retention_zero_keeps_everything(dsn):
    jobs = _fixture(dsn)
    env = base_env(dsn, SIDECAR_RETENTION_SECONDS="0", SIDECAR_RETENTION_FAILED_SECONDS="0")
    done = _prune(dsn, env=env)
    assert done["jobs"] == 0 and done["removed"] == {}, done
    assert set(done["kept"]) == {"succeeded", "failed", "cancelled"}
    assert _ids(dsn) == set(jobs.values())


def test_bad_retention_values_are_one_line_errors(dsn):
    done = cli(dsn, "prune", "--older-than", "soon")
    assert done.returncode == 2 and "--older-than 'soon'" in one_line_error(done)
    done = cli(dsn, "prune", env=base_env(dsn, SIDECAR_RETENTION_SECONDS="-1d"))
    assert done.returncode == 2 and "SIDECAR_RETENTION_SECONDS" in one_line_error(done)
    done = cli(dsn, "prune", "--older-than", "0")
    assert done.returncode == 2 and "--older-than" in one_line_error(done)


def test_a_second_pruner_deletes_nothing_while_one_holds_the_lock(dsn):
    jobs = _fixture(dsn)

    async def while_locked():
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                assert await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)",
                                           PRUNE_LOCK_KEY)
                done = await _in_thread(_prune, dsn)
        finally:
            await conn.close()
        return done

    done = run(while_locked())
    assert done["busy"] is True and done["jobs"] == 0, done
    assert _ids(dsn) == set(jobs.values())
    assert _prune(dsn)["jobs"] == 4  # once the lock is free


async def _in_thread(fn, *args):
    import asyncio

    return await asyncio.to_thread(fn, *args)


def test_a_running_sidecar_prunes_on_its_own_and_counts_it(dsn, sidecars):
    jobs = _fixture(dsn)
    env = base_env(dsn, SIDECAR_HTTP_ADDR="127.0.0.1:0")
    sc = sidecars(dsn, [sys.executable, "-c", "print('{}')"], "--tool", "ret-idle",
                  env=env)
    event = sc.wait_event("jobs_pruned", timeout=30)
    assert event["jobs"] == 4 and event["by_state"] == {"succeeded": 2, "cancelled": 1,
                                                        "failed": 1}, event
    assert jobs["old_ok"] not in _ids(dsn)
    assert jobs["running_stage"] in _ids(dsn) and jobs["old_parent"] in _ids(dsn)
    addr = sc.wait_event("worker_started")["http_addr"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as response:
        page = response.read().decode()
    counted = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
               for line in page.splitlines() if line.startswith("sidecar_pruned_rows_total")}
    assert counted == {'table="tool_jobs"': 4.0, 'table="tool_job_events"': 8.0,
                       'table="tool_job_outbox"': 1.0}, counted
