"""One list of what retention removes (issue 41, point 6): sidecar.ops.retention.RETENTION.
A row of every kind in it, old enough to go, is removed by a sidecar's pruner pass
(prune_once, on the worker's store) and by `sidecar prune`, and counted kind by kind by
`sidecar prune --dry-run`, which removes nothing; a recent row of every kind stays. The
fixture names every kind of the list, so a kind added without a row here fails."""

from __future__ import annotations

import orjson
import pytest

from kit import cli, query, run, scalar
from sidecar.ops import retention
from sidecar.storage import db
from sidecar.storage.worker_store import WorkerStore

# kind -> (how many old rows of it the fixture makes, SQL counting those left)
OLD = {
    "jobs": (1, "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'old-job'"),
    "events": (2, "SELECT count(*) FROM tool_job_events e JOIN tool_jobs j "
                  "ON j.id = e.job_id WHERE j.idempotency_key = 'old-job'"),
    "outbox": (1, "SELECT count(*) FROM tool_job_outbox WHERE url = 'http://127.0.0.1:9/old'"),
    "flow_events": (1, "SELECT count(*) FROM tool_flow_events WHERE event = 'old'"),
    "rate_buckets": (1, "SELECT count(*) FROM tool_flow_keys WHERE concurrency_key = 'old'"),
    "ended_cancels": (1, "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'old-cancel' "
                         "AND cancel_pending"),
    "idle_sidecars": (1, "SELECT count(*) FROM tool_idle_sidecars WHERE owner_id = 'old'"),
    "sweeps": (1, "SELECT count(*) FROM tool_sweeps WHERE tool = 'old'"),
    "sessions": (1, "SELECT count(*) FROM tool_sessions WHERE session_key = 'old'"),
    "interests": (1, "SELECT count(*) FROM tool_interests WHERE interest_key = 'old'"),
}
# the recent rows of each kind, which stay
RECENT = {
    "jobs": "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'new-job'",
    "events": "SELECT count(*) FROM tool_job_events e JOIN tool_jobs j ON j.id = e.job_id "
              "WHERE j.idempotency_key = 'new-job'",
    "flow_events": "SELECT count(*) FROM tool_flow_events WHERE event = 'new'",
    "rate_buckets": "SELECT count(*) FROM tool_flow_keys WHERE concurrency_key = 'new'",
    "ended_cancels": "SELECT count(*) FROM tool_jobs WHERE idempotency_key = 'new-cancel' "
                     "AND cancel_pending",
    "idle_sidecars": "SELECT count(*) FROM tool_idle_sidecars WHERE owner_id = 'new'",
    "sweeps": "SELECT count(*) FROM tool_sweeps WHERE tool = 'new'",
    "sessions": "SELECT count(*) FROM tool_sessions WHERE session_key = 'new'",
    "interests": "SELECT count(*) FROM tool_interests WHERE interest_key = 'new'",
}


def _rows_of_every_kind(dsn: str) -> None:
    """An old row and a recent one of every kind RETENTION lists."""
    assert set(OLD) == {kind.name for kind in retention.RETENTION}, \
        "every kind retention removes needs its rows here"
    for key, days in (("old-job", 8), ("new-job", 1)):
        query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, state, "
                   "max_attempts, finished_at) VALUES (gen_random_uuid(), 'ret', $1, '{}', "
                   "'succeeded', 3, now() - $2::int * interval '1 day')", key, days)
        query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event) SELECT id, t, e "
                   "FROM tool_jobs, (VALUES (0, 'job_enqueued'), (1, 'job_succeeded')) v(t, e) "
                   "WHERE idempotency_key = $1", key)
    query(dsn, "INSERT INTO tool_job_outbox (job_id, tool, url, idempotency_key, fencing_token, "
               "body, state) SELECT id, 'ret', 'http://127.0.0.1:9/old', 'r:' || id, 1, '{}', "
               "'delivered' FROM tool_jobs WHERE idempotency_key = 'old-job'")
    query(dsn, "INSERT INTO tool_flow_events (tool, event, at) VALUES "
               "('ret', 'old', now() - interval '40 days'), ('ret', 'new', now())")
    query(dsn, "INSERT INTO tool_flow (tool, rate_per_key, key_rate_per_second, burst, "
               "updated_by) VALUES ('ret', '1/m', 1 / 60.0, 1, 'test')")
    query(dsn, "INSERT INTO tool_flow_keys (tool, concurrency_key, tokens, tokens_at) VALUES "
               "('ret', 'old', 0, now() - interval '1 hour'), ('ret', 'new', 0, now())")
    for key, lease in (("old-cancel", "-1 minute"), ("new-cancel", "1 hour")):
        query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, state, "
                   "max_attempts, owner_id, fencing_token, attempt, lease_until, "
                   "cancel_pending, finished_at) VALUES (gen_random_uuid(), 'ret', $1, '{}', "
                   "'cancelled', 3, 'gone', 1, 1, now() + $2::text::interval, true, now())",
              key, lease)
    query(dsn, "INSERT INTO tool_idle_sidecars (owner_id, tool, channel, seen_at) VALUES "
               "('old', 'ret', 'c1', now() - interval '11 minutes'), ('new', 'ret', 'c2', now())")
    query(dsn, "INSERT INTO tool_sweeps (tool, swept_at) VALUES "
               "('old', now() - interval '2 days'), ('new', now())")
    query(dsn, "INSERT INTO tool_sessions (tool, session_key, state, ended_at, end_reason) "
               "VALUES ('ret', 'old', 'ended', now() - interval '40 days', 'idle'), "
               "('ret', 'new', 'lost', now() - interval '1 day', 'exited')")
    query(dsn, "INSERT INTO tool_interests (interest_key, state, expires_at, ended_at) "
               "VALUES ('old', 'lapsed', now() - interval '40 days', now() - interval "
               "'40 days'), ('new', 'released', now() - interval '1 day', now() - interval "
               "'1 day')")


def _left(dsn: str) -> dict[str, int]:
    return {kind: scalar(dsn, sql) for kind, (_, sql) in OLD.items()}


def _recent(dsn: str) -> dict[str, int]:
    return {kind: scalar(dsn, sql) for kind, sql in RECENT.items()}


EVERY_OLD_ROW = {kind: count for kind, (count, _) in OLD.items()}
NONE_LEFT = dict.fromkeys(OLD, 0)


@pytest.mark.database
def test_a_sidecars_pruner_removes_every_kind_on_the_list(dsn):
    _rows_of_every_kind(dsn)
    recent = _recent(dsn)

    async def go():
        pool = await db.create_pool(dsn, 30, max_size=1)
        try:
            ages = {"succeeded": 7 * 86400.0, "failed": 30 * 86400.0, "cancelled": 7 * 86400.0}
            return await retention.prune_once(WorkerStore(pool, 30), ages, "ret")
        finally:
            await pool.close()

    done = run(go())
    assert {kind: done[kind] for kind in OLD} == EVERY_OLD_ROW, done
    assert _left(dsn) == NONE_LEFT
    assert _recent(dsn) == recent


@pytest.mark.e2e
def test_sidecar_prune_counts_then_removes_every_kind_on_the_list(dsn):
    _rows_of_every_kind(dsn)
    recent = _recent(dsn)

    done = cli(dsn, "prune", "--dry-run")
    assert done.returncode == 0, done.stderr.decode()
    dry = orjson.loads(done.stdout)
    assert {kind: dry[kind] for kind in OLD} == EVERY_OLD_ROW, dry
    assert _left(dsn) == EVERY_OLD_ROW  # a dry run removes nothing
    assert _recent(dsn) == recent

    # --state: only finished jobs of that state, nothing of the other kinds
    done = cli(dsn, "prune", "--state", "failed")
    assert done.returncode == 0, done.stderr.decode()
    assert {kind: orjson.loads(done.stdout)[kind] for kind in OLD} == NONE_LEFT
    assert _left(dsn) == EVERY_OLD_ROW

    done = cli(dsn, "prune")
    assert done.returncode == 0, done.stderr.decode()
    pruned = orjson.loads(done.stdout)
    assert {kind: pruned[kind] for kind in OLD} == EVERY_OLD_ROW, pruned
    assert _left(dsn) == NONE_LEFT
    assert _recent(dsn) == recent


@pytest.mark.unit
def test_every_kind_on_the_list_names_its_own_retention_statement():
    """Each kind is removed by a named statement of queries.sql of its own (the finished
    jobs' three kinds by their batches), and the report keys are unique."""
    from sidecar.storage.queries import Q

    names = [kind.name for kind in retention.RETENTION]
    assert len(set(names)) == len(names)
    statements = [kind.statement for kind in retention.RETENTION if kind.statement]
    assert len(set(statements)) == len(statements)
    assert all(name.startswith("prune_") and name in Q for name in statements), statements
    assert [kind.name for kind in retention.JOB_KINDS] == ["jobs", "events", "outbox"]
