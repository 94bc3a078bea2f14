"""Case F22: a write skipped by ``ON CONFLICT DO NOTHING`` is never treated as done.

Kind: an insert that a unique key can silently skip, after which the caller carries on as
if the row were written (here: a parent ``succeeded`` while the next stage it named was
never created, because an unrelated job already held the derived key ``K:stage:1``).

Fixes: the stage-key namespace (``...:stage:N``) is reserved for the stages a job creates
(P19) and refused at enqueue with one line naming ``--idempotency-key`` (exit 2), in the
CLI and in ``CallerStore.enqueue`` (the only SQL enqueue); and every insert a conflict can skip is
detected and handled. The audit of every ``ON CONFLICT`` in sidecar/storage/sql and sidecar/*.py
(``test_every_on_conflict_is_audited`` fails when one is added or removed without
updating this list):

- ``functions/enqueue.sql`` ``tool_job_enqueue`` (behind ``queries.sql``
  ``enqueue_job`` and ``sidecar_enqueue``): ``ON CONFLICT (idempotency_key) WHERE key_held
  DO NOTHING``. On a skip the function reads the holder: one whose dedupe policy lets the
  key go (migration 027) -> freed, and the insert tried again; same tool and payload ->
  the existing job, ``created: false`` (the idempotent replay); another tool or payload ->
  SQLSTATE 23505, IdempotencyConflict in ``CallerStore.enqueue`` (exit 2); the holder gone
  in between (pruned) -> the insert is tried again, never a crash or a silent "done".
- ``queries.sql`` ``finish_job_if_owner`` (next stage): no ``ON CONFLICT`` any more. The
  insert skips only the parent's own stage (``NOT EXISTS`` a row with the same key,
  parent and stage: a repeated completion, idempotent); a key held by anything else raises
  the unique violation, the whole statement (result, journal, outbox) rolls back, and the
  attempt fails ``next_stage_conflict`` (not retried) with the holder journaled
  (``next_stage_conflict`` event) and logged at error level.
- ``fence.sql`` ``fence_claim_key``: ``ON CONFLICT (idempotency_key) DO NOTHING``. On a
  skip ``sidecar.ops.fence`` replays the stored answer (or 422 for another body); a stored row
  deleted in between (an operator's pruning) -> the key is claimed again.
- ``fence.sql`` ``fence_lock_entity``: ``ON CONFLICT (entity) DO UPDATE``: never skips; it
  waits for and locks the existing row.
- ``queries.sql`` ``register_idle_sidecar``: ``ON CONFLICT (owner_id) DO UPDATE``: never
  skips; it refreshes the registration.
- ``functions/flow.sql``: the trigger ``tool_job_keyed_flow``'s ``ON CONFLICT (tool) DO
  NOTHING`` skips only when the tool has its flow row already, which is all it is for.
- ``functions/claim.sql``: ``tool_job_claim_flow``'s per-key bucket ``ON CONFLICT (tool,
  concurrency_key) DO UPDATE`` never skips (it refills and takes the token).
- ``queries.sql`` ``set_tool_limits`` and ``functions/actions.sql`` ``tool_flow_pause``
  (behind ``pause_tool``): ``ON CONFLICT (tool) DO UPDATE``: never skip; they change the
  existing flow row, journaled.
- ``queries.sql`` ``web_login_failed``: ``ON CONFLICT (scope, subject) DO UPDATE``: never
  skips; a failure counts on the subject's existing window.
- ``functions/sessions.sql`` ``tool_job_session_begin``: ``ON CONFLICT (tool, session_key)
  DO NOTHING`` skips when the session exists; the function then reads and locks that row
  and decides from it (continued, lost, restarted or elsewhere), never taking the skip
  as a start.
- ``queries.sql`` ``set_dedupe_default``: ``ON CONFLICT (tool) DO UPDATE ... WHERE`` the
  policy differs: a skip means the tool's default is already the one written.
- ``functions/interests.sql`` ``tool_job_interest_hold``: ``ON CONFLICT (interest_key) DO
  UPDATE``: never skips; it renews the live interest or starts its next generation.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import asyncpg
import pytest

from kit import base_env, cli, enqueue, job_row, one_line_error, parse_events, query, run
from sidecar.protocol.errors import NextStageConflict, UsageError
from sidecar.protocol.model import NextStage, RawJson
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

TOOL = "stage_tool.py"
ROOT = Path(__file__).resolve().parent.parent / "sidecar"

# Every ON CONFLICT of the package: (file, statement name) -> what a skip does (above).
AUDITED = {
    ("storage/sql/functions/enqueue.sql", "?"),  # tool_job_enqueue
    ("storage/sql/fence.sql", "fence_lock_entity"),
    ("storage/sql/fence.sql", "fence_claim_key"),
    ("storage/sql/queries.sql", "register_idle_sidecar"),
    ("storage/sql/functions/flow.sql", "?"),  # keyed flow row
    ("storage/sql/functions/claim.sql", "?"),  # key bucket
    ("storage/sql/queries.sql", "set_tool_limits"),
    ("storage/sql/functions/actions.sql", "?"),  # tool_flow_pause
    ("storage/sql/queries.sql", "web_login_failed"),
    # a concurrent first sample made the tool's sweep row: the turn is that sample's
    ("storage/sql/queries.sql", "sample_tool"),
    ("storage/sql/functions/sessions.sql", "?"),  # a session's first call
    ("storage/sql/queries.sql", "set_dedupe_default"),  # the same default already
    ("storage/sql/functions/interests.sql", "?"),  # an interest held again: updated
}


def _insert_legacy_job(dsn, tool, key):
    """A job holding ``key`` written before the namespace was reserved (an older release,
    or a producer writing SQL directly): the refusal at enqueue cannot stop it."""
    job_id = uuid.uuid4()
    query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts) "
               "VALUES ($1, $2, $3, '{}', 1)", job_id, tool, key)
    return str(job_id)


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("key", ["K:stage:1", "report-7:stage:12", "a:stage:0"])
def test_a_stage_key_is_refused_at_enqueue_with_one_line(dsn, key):
    done = cli(dsn, "enqueue", "report", "--idempotency-key", key)
    assert done.returncode == 2, done.stdout
    line = one_line_error(done)
    assert "--idempotency-key" in line and ":stage:" in line
    assert query(dsn, "SELECT id FROM tool_jobs") == []


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("key", ["K:stage", "K:stage:x", "K:stage:1:final", "stage:1"])
def test_keys_outside_the_stage_namespace_are_accepted(dsn, key):
    job_id = enqueue(dsn, "report", {}, "--idempotency-key", key)
    assert job_row(dsn, job_id)["idempotency_key"] == key


@pytest.mark.database
def test_the_store_refuses_a_stage_key_too(dsn):
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, init=init_connection)
        try:
            with pytest.raises(UsageError, match="--idempotency-key"):
                await CallerStore(pool, 10).enqueue("report", {}, "K:stage:1", 1, {})
        finally:
            await pool.close()

    run(go())
    assert query(dsn, "SELECT id FROM tool_jobs") == []


@pytest.mark.e2e
@pytest.mark.server
def test_a_next_stage_whose_key_is_taken_fails_the_parent_loudly(dsn, sidecars):
    """The case's input: an unrelated job holds K:stage:1; ocr (key K) names a pub stage."""
    env = base_env(dsn, SIDECAR_PROFILE_OCR_NEXT_TOOLS="pub")
    holder = _insert_legacy_job(dsn, "report", "K:stage:1")
    parent = enqueue(dsn, "ocr", {"mode": "first", "next": "pub"}, "--idempotency-key", "K",
                     env=env)
    done = cli(dsn, "run", "--tool", "ocr", "--drain", "--", TOOL, env=env, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    row = job_row(dsn, parent)
    assert row["state"] == "failed", row
    assert row["error"]["kind"] == "next_stage_conflict"
    assert "K:stage:1" in row["error"]["message"] and holder in row["error"]["message"]
    assert row["attempt"] == 1  # not retried: the same result would hit the same key
    assert row["result"] is None  # nothing of the rolled-back completion was kept
    assert query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1", parent) == []
    [event] = query(dsn, "SELECT details FROM tool_job_events WHERE job_id = $1 AND "
                         "event = 'next_stage_conflict'", parent)
    assert event["details"]["key"] == "K:stage:1"
    assert event["details"]["holder_id"] == holder
    logged = parse_events(done.stderr, "next_stage_conflict")
    assert any(e.get("event") == "next_stage_conflict" and e.get("level") == "error"
               for e in logged), done.stderr.decode()[-2000:]
    # The unrelated job is untouched.
    assert job_row(dsn, holder)["state"] == "queued" and job_row(dsn, holder)["parent_id"] is None


@pytest.mark.database
def test_the_store_tells_its_own_stage_from_someone_elses(dsn):
    """A repeated completion meets its own stage (fine, no second one); a completion whose
    key is held by another job raises NextStageConflict and writes nothing."""

    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, init=init_connection)
        store, caller = WorkerStore(pool, 10), CallerStore(pool, 10)
        try:
            nxt = NextStage("pub", {"n": 1}, 3)
            own_id, _ = await caller.enqueue("ocr", {}, "own", 3, {})
            job = await store.claim("ocr", "w1", 30)
            assert await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                               "job_succeeded", {}, None, nxt)
            await pool.execute("UPDATE tool_jobs SET state = 'running', lease_until = now() "
                               "+ interval '1 minute' WHERE id = $1", own_id)
            again = await store.finish_if_owner(job, "w1", "succeeded", RawJson("{}"), None,
                                                "job_succeeded", {}, None, nxt)

            holder = str(uuid.uuid4())
            await pool.execute("INSERT INTO tool_jobs (id, tool, idempotency_key, payload, "
                               "max_attempts) VALUES ($1, 'report', 'other:stage:1', '{}', 1)",
                               uuid.UUID(holder))
            other_id, _ = await caller.enqueue("ocr", {}, "other", 3, {})
            other = await store.claim("ocr", "w1", 30)
            assert other.id == other_id
            with pytest.raises(NextStageConflict) as caught:
                await store.finish_if_owner(other, "w1", "succeeded", RawJson('{"a": 1}'),
                                            None, "job_succeeded", {}, None, nxt)
            return own_id, again, other_id, holder, caught.value
        finally:
            await pool.close()

    own_id, again, other_id, holder, conflict = run(go())
    assert again is True
    assert len(query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1", own_id)) == 1
    assert conflict.key == "other:stage:1" and str(conflict.holder_id) == holder
    row = job_row(dsn, other_id)
    assert row["state"] == "running" and row["result"] is None  # rolled back whole
    assert query(dsn, "SELECT event FROM tool_job_events WHERE job_id = $1 AND "
                      "event = 'job_succeeded'", other_id) == []


def _on_conflict_sites() -> set[tuple[str, str]]:
    """(file, statement name or function) of every ON CONFLICT in the package."""
    found = set()
    for path in sorted([*ROOT.glob("storage/sql/**/*.sql"), *ROOT.rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        name = "?"
        for line in text.splitlines():
            named = re.match(r"\s*--\s*name:\s*(\w+)", line)
            if named:
                name = named.group(1)
            code = line.split("--", 1)[0] if path.suffix == ".sql" else line
            if re.search(r"\bON\s+CONFLICT\b", code, re.IGNORECASE) and \
                    not code.lstrip().startswith("#"):
                found.add((str(path.relative_to(ROOT)), name))
    return found


@pytest.mark.unit
def test_every_on_conflict_is_audited():
    assert _on_conflict_sites() == AUDITED
