"""Issue 44, point 4: the dedupe policy, how long a job holds its idempotency key.

``forever`` (the default): the key names its job for as long as the row lives.
``active``: a finished job's key frees for a new job; the old row stays, with its key,
for audit. A window (``24h``): freed once the job has finished and the window since its
enqueue has passed. Per enqueue (CLI ``--dedupe``, the client's ``dedupe=``,
``sidecar_enqueue(dedupe =>)``, the MCP gateway's ``_meta``) or per tool (the profile's
DEDUPE, written by its sidecars as they start into ``tool_dedupe``). One parser in Python
(sidecar.protocol.enqueue_args.dedupe_window_seconds) and one in SQL
(tool_job_dedupe_window) that must agree.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import asyncpg
import pytest

from kit import base_env, cli, job_row, one_line_error, query, run, scalar
from sidecar.protocol.enqueue_args import EnqueueOptions, dedupe_window_seconds
from sidecar.protocol.errors import IdempotencyConflict, UsageError
from sidecar.protocol.model import NextStage, RawJson
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

ACCEPTED = {"forever": None, "active": 0.0, "1s": 1.0, "90s": 90.0, "30m": 1800.0,
            "24h": 86400.0, "7d": 604800.0, "366d": 366 * 86400.0,
            "31622400s": 366 * 86400.0}
REFUSED = ["", " active", "active ", "Forever", "ACTIVE", "0s", "00h", "01h", "24", "h",
           "1.5h", "-1h", "24H", "367d", "31622401s", "99999999d", "1w", "24 h", "24h\n",
           "２４h", "1e3s", "x" * 1000, "forever;drop"]


@pytest.mark.unit
def test_a_policy_reads_as_its_window_and_anything_else_is_refused_naming_the_field():
    for text, seconds in ACCEPTED.items():
        assert dedupe_window_seconds(text) == seconds, text
    for text in REFUSED:
        with pytest.raises(UsageError, match="^--dedupe .*forever, active or a window"):
            dedupe_window_seconds(text)
    for value in (None, 24, 1.5, b"24h", ["active"]):
        with pytest.raises(UsageError, match="^dedupe "):
            dedupe_window_seconds(value, "dedupe")  # type: ignore[arg-type]


@pytest.mark.database
def test_the_database_reads_every_policy_as_the_client_does(dsn):
    async def go():
        conn = await asyncpg.connect(dsn)
        try:
            got = {}
            for text in [*ACCEPTED, *REFUSED]:
                try:
                    window = await conn.fetchval("SELECT tool_job_dedupe_window($1)", text)
                    got[text] = None if window is None else window.total_seconds()
                except asyncpg.InvalidParameterValueError as exc:
                    assert exc.args[0].startswith("dedupe "), exc.args[0]
                    got[text] = "refused"
            return got
        finally:
            await conn.close()

    got = run(go())
    assert {t: got[t] for t in ACCEPTED} == ACCEPTED
    assert {t: got[t] for t in REFUSED} == {t: "refused" for t in REFUSED}


async def _pool(dsn):
    return await asyncpg.create_pool(dsn, min_size=1, max_size=3, init=init_connection)


async def _enqueue(caller, key, payload, dedupe=None, tool="dd"):
    return await caller.enqueue(tool, payload, key, 3, {},
                                EnqueueOptions(dedupe=dedupe))


async def _run_to_end(store, tool="dd", next_stage=None):
    job = await store.claim(tool, "w1", 30)
    assert job is not None
    assert await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                       "job_succeeded", {}, None, next_stage)
    return job


@pytest.mark.database
def test_active_frees_a_finished_jobs_key_for_a_new_job_and_keeps_the_old_row(dsn):
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            first, created = await _enqueue(caller, "K", {"n": 1}, "active")
            assert created
            # unfinished, the key still names it: the same call joins it
            assert await _enqueue(caller, "K", {"n": 1}, "active") == (first, False)
            with pytest.raises(IdempotencyConflict):  # and another call is refused
                await _enqueue(caller, "K", {"n": 2}, "active")
            await _run_to_end(store)
            second, created = await _enqueue(caller, "K", {"n": 2}, "active")
            assert created and second != first
            assert await _enqueue(caller, "K", {"n": 2}) == (second, False)
            return first, second
        finally:
            await pool.close()

    first, second = run(go())
    old, new = job_row(dsn, first), job_row(dsn, second)
    assert old["state"] == "succeeded" and old["idempotency_key"] == "K"
    assert old["key_held"] is False and new["key_held"] is True
    assert new["payload"] == {"n": 2} and new["state"] == "queued"
    assert new["key_frees_after"] == dt.timedelta(0)


@pytest.mark.database
def test_forever_is_the_default_and_a_finished_job_keeps_its_key(dsn):
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            first, _ = await _enqueue(caller, "F", {"n": 1})
            await _run_to_end(store)
            again = await _enqueue(caller, "F", {"n": 1})
            with pytest.raises(IdempotencyConflict, match="already names job"):
                await _enqueue(caller, "F", {"n": 2})
            with pytest.raises(IdempotencyConflict):
                await _enqueue(caller, "F", {"n": 2}, "forever")
            return first, again
        finally:
            await pool.close()

    first, again = run(go())
    assert again == (first, False)
    assert job_row(dsn, first)["key_held"] is True
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'F'") == 1


@pytest.mark.database
def test_a_window_frees_the_key_only_once_the_job_finished_and_the_window_passed(dsn):
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            first, _ = await _enqueue(caller, "W", {"n": 1}, "1h")
            await _run_to_end(store)
            within = await _enqueue(caller, "W", {"n": 1}, "1h")  # 1 h not yet passed
            # the job is as old as the window (its row's enqueue time moved back, not the
            # database's clock): the next enqueue of the key frees it and takes it
            await pool.execute("UPDATE tool_jobs SET created_at = created_at - interval "
                               "'61 minutes' WHERE id = $1", first)
            after, created = await _enqueue(caller, "W", {"n": 3}, "1h")
            return first, within, after, created
        finally:
            await pool.close()

    first, within, after, created = run(go())
    assert within == (first, False)
    assert created and after != first
    assert job_row(dsn, first)["key_held"] is False
    [freed] = query(dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 "
                         "AND event = 'key_freed'", first)
    assert freed["details"] == {"key_frees_after_s": 3600}


@pytest.mark.database
def test_a_running_job_keeps_its_key_whatever_its_window(dsn):
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            first, _ = await _enqueue(caller, "R", {"n": 1}, "1s")
            job = await store.claim("dd", "w1", 30)
            await pool.execute("UPDATE tool_jobs SET created_at = created_at - interval "
                               "'1 day' WHERE id = $1", first)
            joined = await _enqueue(caller, "R", {"n": 1}, "1s")
            with pytest.raises(IdempotencyConflict):
                await _enqueue(caller, "R", {"n": 2}, "1s")
            return first, job, joined
        finally:
            await pool.close()

    first, job, joined = run(go())
    assert job.id == first and joined == (first, False)


@pytest.mark.database
def test_the_tools_default_comes_from_its_sidecars_and_an_enqueue_overrides_it(dsn):
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            await store.set_dedupe_default("dd", 0.0, "w1")
            by_default, _ = await _enqueue(caller, "D1", {})
            named, _ = await _enqueue(caller, "D2", {}, "forever")
            other_tool, _ = await _enqueue(caller, "D3", {}, tool="other")
            await store.set_dedupe_default("dd", None, "w2")  # a profile back to forever
            after, _ = await _enqueue(caller, "D4", {})
            return by_default, named, other_tool, after
        finally:
            await pool.close()

    by_default, named, other_tool, after = run(go())
    assert job_row(dsn, by_default)["key_frees_after"] == dt.timedelta(0)
    assert job_row(dsn, named)["key_frees_after"] is None
    assert job_row(dsn, other_tool)["key_frees_after"] is None
    assert job_row(dsn, after)["key_frees_after"] is None
    [row] = query(dsn, "SELECT key_frees_after, set_by FROM tool_dedupe WHERE tool = 'dd'")
    assert dict(row) == {"key_frees_after": None, "set_by": "w2"}


@pytest.mark.database
def test_a_freed_keys_chain_gets_its_next_stage_though_the_old_chain_named_the_same(dsn):
    """The next stage's key derives from its parent's (K:stage:1): a new chain under a
    freed K meets the old chain's stage. Under ``active`` that stage let its key go at its
    end; under a window still within it at its end, the finishing parent frees it then
    (tool_job_free_key) and its end is written again, once."""
    async def go():
        pool = await _pool(dsn)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            made = {}
            for policy, key in (("active", "CA"), ("1h", "CW")):
                nxt = NextStage(f"pub-{key}", {"n": 1}, 3)
                old, _ = await _enqueue(caller, key, {"run": 1}, policy)
                await _run_to_end(store, next_stage=nxt)
                await _run_to_end(store, nxt.tool)
                await pool.execute("UPDATE tool_jobs SET created_at = created_at - interval "
                                   "'2 hours' WHERE idempotency_key LIKE $1", key + "%")
                new, created = await _enqueue(caller, key, {"run": 2}, policy)
                assert created
                await _run_to_end(store, next_stage=nxt)
                made[policy] = (old, new)
            return made
        finally:
            await pool.close()

    made = run(go())
    for policy, (old, new) in made.items():
        [old_stage] = query(dsn, "SELECT * FROM tool_jobs WHERE parent_id = $1", old)
        [new_stage] = query(dsn, "SELECT * FROM tool_jobs WHERE parent_id = $1", new)
        assert old_stage["idempotency_key"] == new_stage["idempotency_key"], policy
        assert old_stage["key_held"] is False and new_stage["key_held"] is True, policy
        assert new_stage["key_frees_after"] == job_row(dsn, new)["key_frees_after"], policy
        assert job_row(dsn, new)["state"] == "succeeded", policy


@pytest.mark.database
def test_two_enqueues_racing_for_a_freed_key_make_one_job(dsn):
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=8, max_size=8, init=init_connection)
        caller, store = CallerStore(pool, 10), WorkerStore(pool, 10)
        try:
            first, _ = await _enqueue(caller, "RACE", {"n": 1}, "active")
            await _run_to_end(store)
            got = await asyncio.gather(*(_enqueue(caller, "RACE", {"n": 2}, "active")
                                         for _ in range(8)))
            return first, got
        finally:
            await pool.close()

    first, got = run(go())
    ids = {job_id for job_id, _ in got}
    assert len(ids) == 1 and first not in ids
    assert sum(created for _, created in got) == 1
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'RACE' "
                       "AND key_held") == 1


@pytest.mark.database
def test_sql_callers_name_a_policy_and_a_bad_one_is_one_line_naming_the_field(dsn):
    job = scalar(dsn, "SELECT sidecar_enqueue('dd', '{}', idempotency_key => 'S', "
                      "dedupe => 'active')::text")
    assert job_row(dsn, job)["key_frees_after"] == dt.timedelta(0)
    with pytest.raises(asyncpg.InvalidParameterValueError, match="^dedupe 'weekly': use"):
        query(dsn, "SELECT sidecar_enqueue('dd', '{}', idempotency_key => 'S2', "
                   "dedupe => 'weekly')")
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'S2'") == 0


@pytest.mark.e2e
def test_the_cli_refuses_a_bad_policy_in_one_line_and_writes_nothing(dsn):
    done = cli(dsn, "enqueue", "dd", "--idempotency-key", "C", "--dedupe", "sometimes")
    assert done.returncode == 2
    line = one_line_error(done, no_stdout=True)
    assert "--dedupe 'sometimes'" in line and "forever, active" in line
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0
    done = cli(dsn, "enqueue", "dd", "--idempotency-key", "C", "--dedupe", "active")
    assert done.returncode == 0, done.stderr.decode()
    assert scalar(dsn, "SELECT key_frees_after FROM tool_jobs WHERE idempotency_key = 'C'") \
        == dt.timedelta(0)


@pytest.mark.e2e
def test_a_sidecar_writes_its_profiles_dedupe_and_refuses_a_bad_one(dsn, tmp_path):
    tool = ["/bin/true"]
    env = base_env(dsn, SIDECAR_PROFILE_DD_DEDUPE="24h")
    done = cli(dsn, "run", "--tool", "dd", "--drain", "--", *tool, env=env, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert scalar(dsn, "SELECT key_frees_after FROM tool_dedupe WHERE tool = 'dd'") \
        == dt.timedelta(hours=24)
    env = base_env(dsn, SIDECAR_PROFILE_DD_DEDUPE="daily")
    done = cli(dsn, "run", "--tool", "dd", "--drain", "--", *tool, env=env, timeout=60)
    assert done.returncode == 2
    line = one_line_error(done)
    assert "SIDECAR_PROFILE_DD_DEDUPE='daily'" in line and "use forever" in line
