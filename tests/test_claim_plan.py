"""The claim (P4) never sorts the backlog: its queued part reads the claim order straight
from a partial index and its expired-lease part only looks at running jobs, so a claim
over 200,000 queued jobs plans like one over an empty queue. Asserted on PostgreSQL's own
plans, not timings."""

from __future__ import annotations

import datetime as dt
import uuid

import orjson
import pytest

from kit import query, run
from sidecar.protocol.model import new_job_id
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.queries import Q
from sidecar.storage.worker_store import WorkerStore

pytestmark = pytest.mark.database


def _fill(dsn: str, tool: str, queued: int, running: int = 20) -> None:
    query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts) "
               "SELECT gen_random_uuid(), $1, $1 || ':q:' || g, '{}', 3 "
               "FROM generate_series(1, $2) g", tool, queued)
    query(dsn, "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, "
               "state, owner_id, lease_until, attempt, fencing_token) "
               "SELECT gen_random_uuid(), $1, $1 || ':r:' || g, '{}', 3, 'running', 'w', "
               "now() + interval '1 hour', 1, 1 FROM generate_series(1, $2) g", tool, running)
    query(dsn, "ANALYZE tool_jobs")


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _claim_plan(dsn: str, tool: str, size: int = 1) -> dict:
    [[text]] = query(dsn, "EXPLAIN (FORMAT JSON) " + Q["claim_job"], tool, "owner", 30.0, None,
                         3, size)
    return (orjson.loads(text) if isinstance(text, str) else text)[0]["Plan"]


@pytest.mark.parametrize("backlog, size", [(20_000, 1), (200_000, 1), (200_000, 8)])
def test_the_claim_reads_the_backlog_in_order_from_its_index_without_sorting_it(
        dsn, backlog, size):
    _fill(dsn, "ocr", backlog)
    _fill(dsn, "other-tool", 1000)
    plan = _claim_plan(dsn, "ocr", size)
    scans = [n for n in _nodes(plan) if n.get("Relation Name") == "tool_jobs"
             and n["Node Type"] != "ModifyTable"]
    assert {n.get("Index Name") for n in scans} >= {"tool_jobs_queued_order_idx",
                                                    "tool_jobs_running_idx"}, scans
    assert not [n for n in scans if n["Node Type"] == "Seq Scan"], scans
    # The update finds the claimed rows by primary key (a bitmap of the claimed ids at
    # most), never by scanning the table, whatever the claim's size (issue 28).
    assert not [n for n in scans if n["Node Type"] == "Bitmap Heap Scan"
                and "id = ANY" not in n.get("Recheck Cond", "")], scans
    for sort in (n for n in _nodes(plan) if "Sort" in n["Node Type"]):
        below = {n.get("Index Name") for n in _nodes(sort)}
        assert "tool_jobs_queued_order_idx" not in below, sort  # only running jobs sorted


def test_an_expired_lease_is_claimed_before_the_queue_and_the_queue_oldest_first(dsn):
    async def go():
        pool = await db.create_pool(dsn, 5, max_size=2)
        store, caller = WorkerStore(pool, 5), CallerStore(pool, 5)
        try:
            ids = [(await caller.enqueue("ocr", {"n": n}, None, 3, {}))[0] for n in range(3)]
            first = await store.claim("ocr", "a", 30.0)
            # a's tool started (journaled: an expiry spends the attempt, case F16), then
            # a's lease on the oldest job expires; the next claim takes it over first
            await store.record_event(first.id, first.fencing_token, "tool_request_started", {})
            await pool.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 s' "
                               "WHERE id = $1", first.id)
            taken_over = await store.claim("ocr", "b", 30.0)
            second = await store.claim("ocr", "b", 30.0)
            third = await store.claim("ocr", "b", 30.0)
            none = await store.claim("ocr", "b", 30.0)
            return ids, first, taken_over, second, third, none
        finally:
            await pool.close()

    ids, first, taken_over, second, third, none = run(go())
    assert first.id == ids[0] and not first.reclaimed
    assert taken_over.id == ids[0] and taken_over.reclaimed
    assert taken_over.fencing_token == first.fencing_token + 1 and taken_over.attempt == 2
    assert [second.id, third.id] == ids[1:] and none is None
    assert isinstance(taken_over.lease_until, dt.datetime)


def test_the_journal_has_one_index_its_key_and_a_jobs_events_are_read_through_it(dsn):
    """Migration 010: every journal row costs one index insert, and a job's events, the
    only way the journal is read, still come from an index, not a scan of the journal."""
    indexes = query(dsn, "SELECT indexname, indexdef FROM pg_indexes "
                         "WHERE tablename = 'tool_job_events'")
    assert [(r["indexname"], r["indexdef"].split(" USING ")[1]) for r in indexes] == \
        [("tool_job_events_pkey", "btree (job_id, id)")]
    query(dsn, "INSERT INTO tool_job_events (job_id, fencing_token, event) "
               "SELECT gen_random_uuid(), 1, 'job_claimed' FROM generate_series(1, 20000)")
    [[job]] = query(dsn, "SELECT job_id FROM tool_job_events LIMIT 1")
    query(dsn, "ANALYZE tool_job_events")
    [[text]] = query(dsn, "EXPLAIN (FORMAT JSON) " + Q["job_events"], job)
    plan = (orjson.loads(text) if isinstance(text, str) else text)[0]["Plan"]
    assert "tool_job_events_pkey" in {n.get("Index Name") for n in _nodes(plan)}, plan
    assert not [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan"], plan


def test_one_claim_takes_a_job_for_each_free_slot_expired_leases_first(dsn):
    """Issue 28: a claim of up to N jobs takes the expired lease first, then the queue in
    claim order (priority, then age), each job under its own token, attempt, lease and
    job_claimed row; a claim that takes fewer than asked found nothing more."""
    async def go():
        pool = await db.create_pool(dsn, 5, max_size=2)
        store, caller = WorkerStore(pool, 5), CallerStore(pool, 5)
        try:
            low = [(await caller.enqueue("pdf", {"n": n}, None, 3, {}))[0] for n in range(3)]
            high = (await caller.enqueue("pdf", {"n": 9}, None, 3, {}))[0]  # priority 0
            await pool.execute("UPDATE tool_jobs SET priority = 5 WHERE id = ANY($1::uuid[])",
                               low)
            first = await store.claim("pdf", "a", 30.0)
            assert first.id == high
            await store.record_event(first.id, first.fencing_token, "tool_request_started", {})
            await pool.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 s' "
                               "WHERE id = $1", first.id)
            jobs, held = await store.claim_many("pdf", "b", 30.0, 3)
            rest, _ = await store.claim_many("pdf", "b", 30.0, 5)
            events = await pool.fetch(
                "SELECT job_id, fencing_token FROM tool_job_events "
                "WHERE event = 'job_claimed' AND details->>'owner_id' = 'b'")
            return low, high, first, jobs, held, rest, events
        finally:
            await pool.close()

    low, high, first, jobs, held, rest, events = run(go())
    assert held is None
    by_id = {job.id: job for job in jobs}
    assert set(by_id) == {high, low[0], low[1]}  # the expired one, then the oldest two
    taken_over = by_id[high]
    assert taken_over.reclaimed and taken_over.fencing_token == first.fencing_token + 1
    assert all(not by_id[i].reclaimed and by_id[i].fencing_token == 1
               and by_id[i].attempt == 1 for i in low[:2])
    assert [job.id for job in rest] == [low[2]]  # one left of five asked for
    assert sorted((e["job_id"], e["fencing_token"]) for e in events) == sorted(
        (job.id, job.fencing_token) for job in [*jobs, *rest])


def test_job_ids_are_time_ordered_from_sql_and_from_python(dsn):
    """Issue 28: ids made by the database (tool_job_new_id, every enqueue) and by the
    sidecar (a next stage's, sidecar.protocol.model.new_job_id) are UUIDv7: version 7, RFC 9562
    variant, the enqueue's millisecond first, so later jobs sort after earlier ones and
    land on the rightmost index pages; the rest stays random."""
    async def go():
        pool = await db.create_pool(dsn, 5, max_size=2)
        caller = CallerStore(pool, 5)
        try:
            ids = [(await caller.enqueue("ids", {"n": n}, None, 3, {}))[0] for n in range(5)]
            made = await pool.fetch("SELECT tool_job_new_id() AS id, "
                                    "(extract(epoch FROM clock_timestamp()) * 1000)::bigint "
                                    "AS ms FROM generate_series(1, 50)")
            created = await pool.fetch("SELECT id, created_at FROM tool_jobs WHERE tool = 'ids' "
                                       "ORDER BY created_at")
            return ids, made, created
        finally:
            await pool.close()

    ids, made, created = run(go())
    python_ids = [new_job_id() for _ in range(50)]
    for job_id in [*ids, *(r["id"] for r in made), *python_ids]:
        assert job_id.version == 7 and job_id.variant == uuid.RFC_4122, job_id
    assert [r["id"] for r in created] == ids
    stamps = [job_id.int >> 80 for job_id in ids]  # the milliseconds, in enqueue order
    assert stamps == sorted(stamps)
    for row in made:
        assert abs((row["id"].int >> 80) - row["ms"]) <= 1000  # its own millisecond
    assert len({r["id"] for r in made}) == 50 and len(set(python_ids)) == 50
    assert new_job_id(0).int >> 80 == 0 and new_job_id((1 << 48) - 1).int >> 80 == (1 << 48) - 1
    with pytest.raises(ValueError):
        new_job_id(1 << 48)
