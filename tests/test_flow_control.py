"""Flow control in the claim (issue 27): caps per tool and per key, rates, keys in turn,
pause and resume, enforced by the claim statement every sidecar runs against a real
PostgreSQL. Claims here are the sidecar's own statement (WorkerStore.claim) on connections of
their own, as many sidecars would run it; the invariants are read back from the database.
The command line and real sidecars are in tests/test_flow_commands.py."""

from __future__ import annotations

import asyncio
import uuid
from itertools import pairwise

import asyncpg
import pytest

from sidecar.protocol.enqueue_args import EnqueueOptions
from sidecar.protocol.flow import ClaimHeld, Held, limit_changes, parse_rate
from sidecar.protocol.model import ClaimedJob, JobState, RawJson
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.operator_store import OperatorStore
from sidecar.storage.worker_store import WorkerStore
from tests.kit import run

pytestmark = pytest.mark.database

LEASE = 60.0  # long enough that no lease ends by itself during a test


class Fleet:
    """``size`` claimers, each a WorkerStore on a one-connection pool of its own (as
    separate sidecars would be), and one more pool for enqueues (``caller``), limits and
    checks (``admin``, the operator's store) and the statements of a sidecar that claims
    nothing here (``worker``: wake-ups, sweeps, fenced ends)."""

    def __init__(self, dsn: str, size: int):
        self.dsn, self.size = dsn, size
        self.pools: list[asyncpg.Pool] = []
        self.stores: list[WorkerStore] = []
        self.admin: OperatorStore | None = None
        self.caller: CallerStore | None = None
        self.worker: WorkerStore | None = None

    async def __aenter__(self) -> Fleet:
        for _ in range(self.size + 1):
            pool = await db.create_pool(self.dsn, 30, max_size=1)
            self.pools.append(pool)
            self.stores.append(WorkerStore(pool, 30))
        self.worker = self.stores.pop()
        self.admin = OperatorStore(self.worker.pool, 30)
        self.caller = CallerStore(self.worker.pool, 30)
        return self

    async def __aexit__(self, *exc) -> None:
        for pool in self.pools:
            await pool.close()

    async def enqueue(self, tool: str, count: int, key: str | None = None,
                      priority: int = 0) -> list[uuid.UUID]:
        ids = []
        for _ in range(count):
            job_id, _ = await self.caller.enqueue(
                tool, RawJson("{}"), None, 3, {"by": "test"},
                EnqueueOptions(priority=priority, concurrency_key=key))
            ids.append(job_id)
        return ids

    async def claim_all(self, tool: str, who: list[int] | None = None) -> list:
        """One claim from each claimer (or those in ``who``) at once."""
        who = list(range(self.size)) if who is None else who
        return list(await asyncio.gather(*(
            self.stores[i].claim(tool, f"owner-{i}", LEASE, None, 3) for i in who)))

    async def claim_batches(self, tool: str, who: list[int], sizes: list[int]) -> list:
        """One claim of up to ``sizes[n]`` jobs from each claimer ``who[n]`` at once
        (WorkerStore.claim_many, issue 28): a list of (jobs, held) per claimer."""
        return list(await asyncio.gather(*(
            self.stores[i].claim_many(tool, f"owner-{i}", LEASE, size, None, 3)
            for i, size in zip(who, sizes, strict=True))))

    async def running(self, tool: str) -> dict[str, int]:
        """Jobs running under a live lease, by concurrency key ('' = none)."""
        rows = await self.admin.db.fetch(
            "SELECT concurrency_key, count(*) AS n FROM tool_jobs WHERE tool = $1 "
            "AND state = 'running' AND lease_until >= now() GROUP BY 1", tool)
        return {row["concurrency_key"]: row["n"] for row in rows}

    async def finish(self, job: ClaimedJob, owner: str) -> None:
        assert await self.worker.finish_if_owner(job, owner, JobState.SUCCEEDED, RawJson("{}"),
                                                 None, "job_succeeded", {})


def claimed(results: list) -> list[ClaimedJob]:
    return [r for r in results if isinstance(r, ClaimedJob)]


def test_max_running_holds_under_concurrent_claims_and_a_freed_slot_is_taken(dsn):
    async def go():
        async with Fleet(dsn, 12) as fleet:
            await fleet.enqueue("erp", 20)
            await fleet.admin.set_limits("erp", limit_changes(max_running=3), "test")
            first = await fleet.claim_all("erp")
            got = claimed(first)
            assert len(got) == 3
            # Every other claim says why it took nothing.
            assert {r for r in first if not isinstance(r, ClaimedJob)} == {
                ClaimHeld(Held.MAX_RUNNING)}
            assert sum((await fleet.running("erp")).values()) == 3
            # A second round takes nothing more: queued jobs stay queued, no attempt spent.
            assert not claimed(await fleet.claim_all("erp"))
            spent = await fleet.admin.db.fetchval(
                "SELECT count(*) FROM tool_jobs WHERE tool = 'erp' AND state = 'queued' "
                "AND attempt > 0")
            assert spent == 0
            # One ends: exactly one more starts.
            owner = next(i for i, r in enumerate(first) if isinstance(r, ClaimedJob))
            await fleet.finish(first[owner], f"owner-{owner}")
            assert len(claimed(await fleet.claim_all("erp"))) == 1
            assert sum((await fleet.running("erp")).values()) == 3

    run(go())


def test_an_expired_lease_frees_its_slot(dsn):
    async def go():
        async with Fleet(dsn, 2) as fleet:
            await fleet.enqueue("api", 3)
            await fleet.admin.set_limits("api", limit_changes(max_running=1), "test")
            job = await fleet.stores[0].claim("api", "owner-0", LEASE, None, 3)
            assert isinstance(job, ClaimedJob)
            assert await fleet.stores[1].claim("api", "owner-1", LEASE, None, 3) == \
                ClaimHeld(Held.MAX_RUNNING)
            # The owner gives its lease up (the sidecar's own statement when it abandons a
            # job): the lease is over by the database's clock, and the slot is free.
            conn = await asyncpg.connect(dsn)
            try:
                assert await WorkerStore.expire_lease_if_owner(conn, "owner-0", job.id,
                                                         job.fencing_token, 10)
            finally:
                await conn.close()
            again = await fleet.stores[1].claim("api", "owner-1", LEASE, None, 3)
            assert isinstance(again, ClaimedJob)
            # The expired attempt is taken over first, under a new token.
            assert again.id == job.id and again.fencing_token == job.fencing_token + 1
            assert sum((await fleet.running("api")).values()) == 1

    run(go())


def test_per_key_caps_hold_and_other_keys_go_on(dsn):
    async def go():
        async with Fleet(dsn, 8) as fleet:
            await fleet.enqueue("browser", 10, key="acct-a")
            await fleet.enqueue("browser", 10, key="acct-b")
            await fleet.enqueue("browser", 2)  # no key: never held by a per-key cap
            await fleet.admin.set_limits("browser", limit_changes(max_running_per_key=1),
                                         "test")
            for _ in range(3):
                await fleet.claim_all("browser")
            running = await fleet.running("browser")
            assert running == {"acct-a": 1, "acct-b": 1, "": 2}
            held = await fleet.stores[0].claim("browser", "owner-0", LEASE, None, 3)
            assert held == ClaimHeld(Held.MAX_RUNNING_PER_KEY)

    run(go())


def test_keys_take_turns_so_a_backlog_does_not_delay_another_keys_first_job(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.admin.db.execute(
                "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, "
                "concurrency_key) SELECT gen_random_uuid(), 'ocr', gen_random_uuid()::text, "
                "'{}', 3, 'tenant-a' FROM generate_series(1, 1000)")
            b_jobs = set(await fleet.enqueue("ocr", 10, key="tenant-b"))
            await fleet.admin.set_limits("ocr", limit_changes(max_running=2), "test")
            store, order, held = fleet.stores[0], [], []
            for _ in range(6):
                job = await store.claim("ocr", "owner-0", LEASE, None, 3)
                if isinstance(job, ClaimHeld):  # both slots taken: end the oldest
                    await fleet.finish(held.pop(0), "owner-0")
                    job = await store.claim("ocr", "owner-0", LEASE, None, 3)
                assert isinstance(job, ClaimedJob)
                order.append("b" if job.id in b_jobs else "a")
                held.append(job)
            assert "b" in order[:3], order
            assert order == ["a", "b", "a", "b", "a", "b"], order

    run(go())


def test_round_robin_visits_every_key_and_keeps_priority_within_a_key(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            low = await fleet.enqueue("t", 2, key="k1", priority=5)
            high = await fleet.enqueue("t", 1, key="k1", priority=0)
            await fleet.enqueue("t", 2, key="k2")
            await fleet.enqueue("t", 2, key="k3")
            unkeyed = await fleet.enqueue("t", 2)
            keys = []
            for _ in range(9):
                job = await fleet.stores[0].claim("t", "o", LEASE, None, 3)
                assert isinstance(job, ClaimedJob)
                row = await fleet.admin.get_job(job.id)
                keys.append(row["concurrency_key"])
                if row["concurrency_key"] == "k1" and keys.count("k1") == 1:
                    assert job.id in high  # priority first within the key
            # No key ('') is a key of its own in the turns; each key once per round.
            assert keys == ["", "k1", "k2", "k3", "", "k1", "k2", "k3", "k1"], keys
            assert set(unkeyed) | set(low) <= {
                r["id"] for r in await fleet.admin.db.fetch(
                    "SELECT id FROM tool_jobs WHERE state = 'running'")}
            assert await fleet.stores[0].claim("t", "o", LEASE, None, 3) is None

    run(go())


def test_pause_stops_every_claim_of_the_tool_and_resume_lets_them_start(dsn):
    async def go():
        async with Fleet(dsn, 4) as fleet:
            await fleet.enqueue("erp", 4)
            await fleet.enqueue("other", 1)
            row = await fleet.admin.pause("erp", "ERP down for maintenance", "test")
            assert row["was_paused"] is False
            results = await fleet.claim_all("erp")
            assert results == [ClaimHeld(Held.PAUSED)] * 4
            # Another tool is not paused.
            assert isinstance(await fleet.stores[0].claim("other", "o", LEASE, None, 3),
                              ClaimedJob)
            assert (await fleet.admin.pause("erp", None, "test"))["was_paused"] is True
            assert await fleet.admin.resume("erp", "test") is True
            assert await fleet.admin.resume("erp", "test") is False
            assert len(claimed(await fleet.claim_all("erp"))) == 4
            events = [(r["tool"], r["event"]) for r in await fleet.admin.flow_events(None, 10)]
            assert events == [("erp", "tool_paused"), ("erp", "tool_paused"),
                              ("erp", "tool_resumed")]

    run(go())


def test_a_rate_is_a_token_bucket_on_the_database_clock(dsn):
    async def go():
        async with Fleet(dsn, 4) as fleet:
            await fleet.enqueue("search", 40)
            await fleet.admin.set_limits("search", limit_changes(rate="5/s"), "test")
            start = await fleet.admin.db.fetchval("SELECT clock_timestamp()")
            got, waits = 0, []
            while got < 6:
                for result in await fleet.claim_all("search"):
                    if isinstance(result, ClaimedJob):
                        got += 1
                    else:
                        assert result.reason == Held.RATE
                        waits.append(result.retry_in)
                await asyncio.sleep(0.02)
            end = await fleet.admin.db.fetchval("SELECT clock_timestamp()")
            elapsed = (end - start).total_seconds()
            # Burst 1: at most 1 + 0.5 + 5/s x elapsed claims (the bucket's most,
            # tool_flow_bucket_size, and its refill), whatever the claimers did.
            total = await fleet.admin.db.fetchval(
                "SELECT count(*) FROM tool_jobs WHERE tool = 'search' AND state = 'running'")
            assert total <= 1 + 0.5 + 5 * elapsed, (total, elapsed)
            # A held claim says when its turn comes: the four claimers wait for four
            # successive tokens at most, never all for the same one.
            assert waits and all(0 < w <= 4 * 0.2 + 0.05 for w in waits), waits

    run(go())


def test_held_owners_get_successive_turns_and_keep_theirs(dsn):
    """N sidecars held by one bucket wake one per token, not all at each token: each
    owner held is given the next free token time and keeps it when it asks again early.
    The turns are read from the flow row (database times), so a slow host changes
    nothing."""
    turns_sql = ("SELECT r->>'o' AS owner, (r->>'at')::timestamptz AS at FROM tool_flow, "
                 "jsonb_array_elements(rate_queue) r WHERE tool = 'search' ORDER BY 2")

    async def go():
        async with Fleet(dsn, 4) as fleet:
            await fleet.enqueue("search", 10)
            await fleet.admin.set_limits("search", limit_changes(rate="2/s"), "test")
            first = await fleet.stores[0].claim("search", "owner-0", LEASE, None, 3)
            assert isinstance(first, ClaimedJob)  # the bucket starts full (burst 1)
            held = [await fleet.stores[i].claim("search", f"owner-{i}", LEASE, None, 3)
                    for i in (1, 2, 3)]
            assert [h.reason for h in held] == [Held.RATE] * 3
            assert all(h.retry_in > 0 for h in held)
            turns = await fleet.admin.db.fetch(turns_sql)
            assert [t["owner"] for t in turns] == ["owner-1", "owner-2", "owner-3"]
            # one token (0.5 s) apart: each owner's turn is the token after the one before
            gaps = [(b["at"] - a["at"]).total_seconds() for a, b in pairwise(turns)]
            assert gaps == [pytest.approx(0.5, abs=1e-3)] * 2, gaps
            # Asking again early keeps the turn (it is not pushed to the end).
            again = await fleet.stores[2].claim("search", "owner-2", LEASE, None, 3)
            assert again.reason == Held.RATE
            assert await fleet.admin.db.fetch(turns_sql) == turns
            # At owner-1's turn, an owner without a turn may not take the token promised.
            await fleet.admin.db.execute("SELECT pg_sleep_until($1)", turns[0]["at"])
            stranger = await fleet.stores[0].claim("search", "owner-0", LEASE, None, 3)
            assert stranger.reason == Held.RATE
            turn = await fleet.stores[1].claim("search", "owner-1", LEASE, None, 3)
            assert isinstance(turn, ClaimedJob)

    run(go())


PACE_RATE = 5.0  # claims a second in the pace test: a period of 200 ms
PACE_WINDOW = 4.0  # seconds of the database's clock counted


@pytest.mark.parametrize(("limit", "claimers"),
                         [("rate", 1), ("rate", 4), ("rate_per_key", 1)])
def test_a_rate_keeps_its_pace_when_every_claim_comes_late(dsn, limit, claimers):
    """Issue 42, point 4: claimers that each come up to 0.3 of a period after their token
    (the answer's retry_in, then a deliberate stall on top of the round trip, as a busy
    sidecar would) still get the configured rate: over a window of the database's clock,
    rate x window claims within one token. A bucket of exactly the burst lost each claim's
    lateness (bench section 12 measured 0.939 x the limit); the half token
    (tool_flow_bucket_size) keeps it, and a turn taken late moves no other turn."""
    import random

    rng = random.Random(f"{limit}-{claimers}")
    tool = f"pace-{claimers}-{limit.replace('_', '-')}"
    key = "k" if limit == "rate_per_key" else None

    async def go():
        async with Fleet(dsn, claimers) as fleet:
            await fleet.enqueue(tool, int(PACE_RATE * PACE_WINDOW * 2) + 10, key=key)
            await fleet.admin.set_limits(
                tool, limit_changes(**{limit: f"{PACE_RATE:g}/s"}), "test")
            stop = asyncio.Event()
            stalls: list[float] = []

            async def claimer(i: int) -> None:
                while not stop.is_set():
                    got = await fleet.stores[i].claim(tool, f"owner-{i}", LEASE, None, 3)
                    if isinstance(got, ClaimedJob):
                        continue  # a free slot asks again at once, as a sidecar does
                    assert got is not None and got.reason in (Held.RATE, Held.RATE_PER_KEY)
                    stalls.append(rng.uniform(0.0, 0.3) / PACE_RATE)
                    await asyncio.sleep(got.retry_in + stalls[-1])

            async def span() -> float:
                return await fleet.admin.db.fetchval(
                    "SELECT coalesce(extract(epoch FROM max(claimed_at) - min(claimed_at)), 0)"
                    "::float8 FROM tool_jobs WHERE tool = $1", tool)

            tasks = [asyncio.create_task(claimer(i)) for i in range(claimers)]
            try:
                while await span() < PACE_WINDOW + 3 / PACE_RATE:
                    assert not any(t.done() for t in tasks), [t.exception() for t in tasks
                                                              if t.done()]
                    await asyncio.sleep(0.1)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            times = [r[0] for r in await fleet.admin.db.fetch(
                "SELECT extract(epoch FROM claimed_at)::float8 FROM tool_jobs "
                "WHERE tool = $1 AND claimed_at IS NOT NULL ORDER BY 1", tool)]
            # From the second claim on (the first found the bucket full): rate x window.
            inside = [t for t in times if times[1] <= t <= times[1] + PACE_WINDOW]
            gaps = [round(b - a, 3) for a, b in pairwise(inside)]
            assert abs(len(inside) - PACE_RATE * PACE_WINDOW) <= 1, (len(inside), gaps)
            assert max(stalls) > 0.2 / PACE_RATE  # the claims did come late

    run(go())


@pytest.mark.parametrize("burst", [1, 3])
def test_after_an_idle_period_a_rate_starts_its_burst_at_once_and_no_more(dsn, burst):
    """The bound docs/operations.md ("Flow control") gives: at one instant at most `burst`
    claims start, whatever number of claimers ask for however many jobs; over any window of
    T seconds at most burst + 0.5 + rate x T, so after an idle period the burst starts at
    once, the next claim half a period later and then one a period. The claims' times are
    the database's own (tool_flow.tokens_at, the bucket's clock, read after each claim of
    a lone claimer)."""
    rate = 10.0
    tool = f"idle-{burst}"
    idle = (burst + 0.5) / rate + 1.0  # past the refill, and past any turn held before

    async def go():
        async with Fleet(dsn, 4) as fleet:
            db_ = fleet.admin.db
            await fleet.enqueue(tool, 80)
            await fleet.admin.set_limits(tool, limit_changes(rate=f"{rate:g}/s", burst=burst),
                                         "test")
            for _ in range(2):  # a new bucket, then one idle after use
                await db_.execute("SELECT pg_sleep($1)", idle)
                results = await fleet.claim_batches(tool, [0, 1, 2, 3], [8] * 4)
                assert sum(len(jobs) for jobs, _ in results) == burst, results
                waits = [held.retry_in for _, held in results]
                assert all(held.reason == Held.RATE for _, held in results), results
                # the next token half a period after the burst (less the time it took)
                assert 0 < min(waits) <= 0.5 / rate + 1e-3, waits

            await db_.execute("SELECT pg_sleep($1)", idle)
            times: list[float] = []
            end = asyncio.get_running_loop().time() + 1.5
            while asyncio.get_running_loop().time() < end:
                got = await fleet.stores[0].claim(tool, "owner-0", LEASE, None, 3)
                if isinstance(got, ClaimedJob):
                    times.append(await db_.fetchval(
                        "SELECT extract(epoch FROM tokens_at)::float8 FROM tool_flow "
                        "WHERE tool = $1", tool))
                else:
                    assert got.reason == Held.RATE
                    await asyncio.sleep(0.002)
            at = [round(t - times[0], 4) for t in times]
            assert at[burst - 1] < 0.5 / rate and at[burst] >= 0.5 / rate - 1e-6, at
            for i in range(len(times)):
                for j in range(i, len(times)):
                    assert j - i + 1 <= burst + 0.5 + rate * (times[j] - times[i]) + 1e-6, \
                        (i, j, at)
            # ... and a claimer that keeps asking gets that many: the bound is met.
            assert len(times) >= burst + rate * (times[-1] - times[0]) - 1, at

    run(go())


def test_a_per_key_rate_holds_each_key_alone(dsn):
    async def go():
        async with Fleet(dsn, 2) as fleet:
            await fleet.enqueue("api", 5, key="a")
            await fleet.enqueue("api", 5, key="b")
            await fleet.admin.set_limits("api", limit_changes(rate_per_key="1/m"), "test")
            results = [await fleet.stores[0].claim("api", "o", LEASE, None, 3)
                       for _ in range(3)]
            assert len(claimed(results)) == 2  # one of each key, then both buckets empty
            assert results[2].reason == Held.RATE_PER_KEY
            assert 0 < results[2].retry_in <= 60
            assert await fleet.running("api") == {"a": 1, "b": 1}

    run(go())


def test_a_keyed_job_gives_its_tool_fair_claims_and_unkeyed_jobs_still_run(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            assert await fleet.admin.limits("mixed") == []
            await fleet.enqueue("mixed", 1)
            await fleet.enqueue("mixed", 1, key="k")
            [row] = await fleet.admin.limits("mixed")
            assert row["max_running"] is None and row["queued"] == 2
            got = [await fleet.stores[0].claim("mixed", "o", LEASE, None, 3) for _ in range(3)]
            assert len(claimed(got)) == 2 and got[2] is None

    run(go())


def test_a_limited_claim_refuses_an_isolation_level_that_would_count_stale_rows(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("erp", 1)
            await fleet.admin.set_limits("erp", limit_changes(max_running=1), "test")
            conn = await asyncpg.connect(dsn)
            try:
                async with conn.transaction(isolation="repeatable_read"):
                    from sidecar.storage.queries import Q
                    with pytest.raises(asyncpg.PostgresError, match="READ COMMITTED"):
                        await conn.fetch(Q["claim_job"], "erp", "o", LEASE, None, 3, 1)
            finally:
                await conn.close()

    run(go())


def test_a_freed_slot_wakes_one_idle_sidecar_at_commit(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("erp", 2)
            await fleet.admin.set_limits("erp", limit_changes(max_running=1), "test")
            job = await fleet.stores[0].claim("erp", "owner-0", LEASE, None, 3)
            assert isinstance(job, ClaimedJob)
            listener = await asyncpg.connect(dsn)
            woken: asyncio.Queue = asyncio.Queue()
            try:
                await listener.add_listener("idle_test_channel",
                                            lambda *args: woken.put_nowait(args[3]))
                await fleet.worker.register_idle("idle-1", "erp", "idle_test_channel")
                ender = await asyncpg.connect(dsn)
                try:
                    async with ender.transaction():
                        await ender.execute("UPDATE tool_jobs SET state = 'failed', "
                                            "finished_at = now() WHERE id = $1", job.id)
                        await asyncio.sleep(0.2)
                        assert woken.empty()  # not before the end commits
                finally:
                    await ender.close()
                assert await asyncio.wait_for(woken.get(), 10) == "erp"
            finally:
                await listener.close()

    run(go())


# --- the property: random fleets, limits, ends and expiries ------------------------------

CLAIMABLE = """
SELECT count(*) FROM tool_jobs j
WHERE j.tool = $1
  AND (j.state = 'queued' OR (j.state = 'running' AND j.lease_until < now()
                              AND j.attempt < j.max_attempts))
  AND (j.concurrency_key = '' OR $2::int IS NULL OR (
       SELECT count(*) FROM tool_jobs r
       WHERE r.tool = j.tool AND r.state = 'running' AND r.lease_until >= now()
         AND r.concurrency_key = j.concurrency_key) < $2::int)
"""

CLOCK = "SELECT extract(epoch FROM clock_timestamp())::float8"  # the database's, seconds


def _random_limits(rng) -> dict:
    """Some of the limits set to random values, some cleared (null), the rest kept."""
    changes: dict = {}
    if rng.random() < 0.7:
        changes["max_running"] = rng.choice([None, 1, 2, 3, 5])
    if rng.random() < 0.5:
        changes["max_running_per_key"] = rng.choice([None, 1, 2])
    if rng.random() < 0.3:
        rate = rng.choice([None, "40/s", "120/s"])
        changes["rate"] = rate
        changes["rate_per_second"] = parse_rate(rate, "rate")[1] if rate else None
    if rng.random() < 0.3:
        changes["burst"] = rng.choice([1, 3])
    return changes


@pytest.mark.parametrize("seed", range(8))
def test_property_no_claim_breaks_a_limit_and_no_free_slot_is_left_idle(dsn, seed):
    """Random fleets (2-6 claimers, each claim asking for 1-4 jobs at once), random limits
    changed as the fleet runs, random job ends, lease expiries (the owner's own expire
    statement), pauses and enqueues. At every step, from the database: a step with claims
    leaves running <= max_running and each claimed key <= max_running_per_key; no claim
    while paused; claims over any window with one rate <= burst + 0.5 + rate x window
    (database clock; the bucket holds half a token more than the burst); and when the
    database shows a claimable job with a free slot and no rate set, a claim takes one."""
    import random

    rng = random.Random(seed)
    tool = "prop"

    async def go():
        async with Fleet(dsn, rng.randint(2, 6)) as fleet:
            keys = [f"k{i}" for i in range(rng.randint(1, 4))] + [None]
            for _ in range(rng.randint(10, 30)):
                await fleet.enqueue(tool, 1, key=rng.choice(keys))
            limits = {"max_running": None, "max_running_per_key": None, "rate": None,
                      "burst": 1}
            paused = False
            held: dict[uuid.UUID, tuple[ClaimedJob, str]] = {}
            windows: list[tuple[float, float, int]] = []  # one rate's steps: t0, t1, claims

            async def change_limits():
                changes = _random_limits(rng)
                if not changes:
                    return
                await fleet.admin.set_limits(tool, changes, "property")
                for name in ("max_running", "max_running_per_key", "rate", "burst"):
                    if name in changes:
                        limits[name] = changes[name]
                if "rate" in changes or "burst" in changes:
                    windows.clear()  # a new bucket, full

            await change_limits()
            for step in range(30):
                # Between steps: ends, expiries, limit changes, pauses, more jobs.
                for job_id in list(held):
                    job, owner = held[job_id]
                    roll = rng.random()
                    if roll < 0.3:
                        await fleet.finish(job, owner)
                        del held[job_id]
                    elif roll < 0.4:
                        conn = await asyncpg.connect(dsn)
                        try:
                            assert await WorkerStore.expire_lease_if_owner(
                                conn, owner, job.id, job.fencing_token, 10)
                        finally:
                            await conn.close()
                        del held[job_id]
                await fleet.worker.fail_exhausted_leases(tool)
                if rng.random() < 0.2:
                    await change_limits()
                if rng.random() < 0.1:
                    if paused:
                        await fleet.admin.resume(tool, "property")
                    else:
                        await fleet.admin.pause(tool, None, "property")
                    paused = not paused
                if rng.random() < 0.3:
                    await fleet.enqueue(tool, rng.randint(1, 5), key=rng.choice(keys))

                claimers = rng.sample(range(fleet.size), rng.randint(1, fleet.size))
                t0 = await fleet.admin.db.fetchval(CLOCK)
                # Each claimer asks for 1-4 jobs in one statement (issue 28); every job
                # and every held row it got counts as one result of that claimer.
                sizes = [rng.randint(1, 4) for _ in claimers]
                results, who = [], []
                for i, (jobs, held_back) in zip(
                        claimers, await fleet.claim_batches(tool, claimers, sizes),
                        strict=True):
                    got = [*jobs, held_back] if held_back is not None else jobs
                    results.extend(got or [None])
                    who.extend([i] * len(got or [None]))
                # One more claim on its own: when a job can start, it must.
                running = await fleet.running(tool)
                claimable = await fleet.admin.db.fetchval(CLAIMABLE, tool,
                                                          limits["max_running_per_key"])
                room = (limits["max_running"] is None
                        or sum(running.values()) < limits["max_running"])
                single = await fleet.stores[who[0]].claim(tool, f"owner-{who[0]}", LEASE,
                                                          None, 3)
                results.append(single)
                who.append(who[0])
                t1 = await fleet.admin.db.fetchval(CLOCK)
                after = await fleet.running(tool)
                new = [(r, i) for r, i in zip(results, who, strict=True)
                       if isinstance(r, ClaimedJob)]
                for job, i in new:
                    held[job.id] = (job, f"owner-{i}")
                context = (seed, step, limits, paused, running, after, results)

                if paused:
                    assert not new and all(r == ClaimHeld(Held.PAUSED) for r in results), \
                        context
                    continue
                if new and limits["max_running"] is not None:
                    assert sum(after.values()) <= limits["max_running"], context
                if limits["max_running_per_key"] is not None:
                    rows = await fleet.admin.db.fetch(
                        "SELECT concurrency_key FROM tool_jobs WHERE id = ANY($1::uuid[])",
                        [job.id for job, _ in new])
                    for key in {row["concurrency_key"] for row in rows} - {""}:
                        assert after.get(key, 0) <= limits["max_running_per_key"], context
                if limits["rate"] is not None:
                    rate = parse_rate(limits["rate"], "rate")[1]
                    windows.append((t0, t1, len(new)))
                    for i in range(len(windows)):
                        count = sum(n for _, _, n in windows[i:])
                        assert count <= limits["burst"] + 0.5 + rate * (t1 - windows[i][0]) \
                            + 1e-9, \
                            (context, windows)
                elif room and claimable:
                    # Liveness: a slot is free and a job may take it: the single claim (or
                    # one of the concurrent ones) took a job.
                    assert new, context

    run(go())


def test_refilled_per_key_buckets_are_forgotten_and_fresh_ones_kept(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("fast", 1, key="a")
            await fleet.enqueue("slow", 1, key="a")
            await fleet.admin.set_limits("fast", limit_changes(rate_per_key="600/m"), "test")
            await fleet.admin.set_limits("slow", limit_changes(rate_per_key="1/m"), "test")
            for tool in ("fast", "slow"):
                assert isinstance(await fleet.stores[0].claim(tool, "o", LEASE, None, 3),
                                  ClaimedJob)
            buckets = "SELECT tool FROM tool_flow_keys ORDER BY tool"
            assert [r["tool"] for r in await fleet.admin.db.fetch(buckets)] == ["fast", "slow"]
            # 600/m refills its bucket (1.5 tokens: tool_flow_bucket_size) in 0.15 s of the
            # database's clock.
            await fleet.admin.db.execute("SELECT pg_sleep(0.2)")
            await fleet.admin.prune_rows("prune_full_key_buckets")
            assert [r["tool"] for r in await fleet.admin.db.fetch(buckets)] == ["slow"]

    run(go())


def test_the_scalers_demand_counts_only_what_may_run(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("erp", 10)
            demand = "SELECT tool_job_demand('erp')"
            assert await fleet.admin.db.fetchval(demand) == 10
            await fleet.admin.set_limits("erp", limit_changes(max_running=4), "test")
            assert await fleet.admin.db.fetchval(demand) == 4
            assert isinstance(await fleet.stores[0].claim("erp", "o", LEASE, None, 3),
                              ClaimedJob)
            await fleet.admin.pause("erp", None, "test")
            assert await fleet.admin.db.fetchval(demand) == 1  # the one running
            await fleet.admin.resume("erp", "test")
            await fleet.admin.set_limits("erp", limit_changes(clear=True), "test")
            assert await fleet.admin.db.fetchval(demand) == 10

    run(go())


def test_a_cancelled_job_keeps_its_slot_until_its_owner_confirms_the_tree_dead(dsn):
    """Case F14's window: a running job cancelled by an operator may still run its tree
    until the owner's next heartbeat; its slot is free only once the owner acknowledges
    the kill (or its lease ends)."""
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("erp", 2)
            await fleet.admin.set_limits("erp", limit_changes(max_running=1), "test")
            store = fleet.stores[0]
            job = await store.claim("erp", "owner-0", LEASE, None, 3)
            assert await fleet.admin.cancel(job.id) == {job.id: "running"}
            assert await store.claim("erp", "owner-0", LEASE, None, 3) == \
                ClaimHeld(Held.MAX_RUNNING)
            [row] = await fleet.admin.limits("erp")
            assert row["running"] == 1  # shown as taken too
            assert await fleet.worker.acknowledge_cancel_if_owner(job, "owner-0",
                                                                 {"signal": "SIGKILL"})
            assert isinstance(await store.claim("erp", "owner-0", LEASE, None, 3), ClaimedJob)

    run(go())


def test_a_claim_visits_a_bounded_number_of_keys_and_the_next_goes_on(dsn):
    """Keys held by their cap cost a probe or two each; a claim stops after 200 of them
    (blocked more_keys) and the next claim goes on from there, so a due job behind
    hundreds of held keys is reached in a few claims, none of them long, and a walk that
    finds nothing ends (no endless more_keys)."""
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.admin.db.execute(
                "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, "
                "concurrency_key) SELECT gen_random_uuid(), 'held', gen_random_uuid()::text, "
                "'{}', 3, 'k' || lpad((g % 450)::text, 5, '0') FROM generate_series(0, 899) g")
            await fleet.admin.set_limits("held", limit_changes(max_running_per_key=1), "test")
            store = fleet.stores[0]
            for _ in range(450):  # one running per key: every key is at its cap
                assert isinstance(await store.claim("held", "o", LEASE, None, 3), ClaimedJob)
            for _ in range(2):  # two walks over 450 held keys: each ends after three claims
                outcomes = []
                while (outcome := await store.claim("held", "o", LEASE, None, 3)) \
                        != ClaimHeld(Held.MAX_RUNNING_PER_KEY):
                    outcomes.append(outcome)
                    assert len(outcomes) <= 2, outcomes
                assert outcomes == [ClaimHeld(Held.MORE_KEYS, 0.0)] * 2
            [due] = await fleet.enqueue("held", 1, key="z-last")
            outcomes = []
            while not isinstance(job := await store.claim("held", "o", LEASE, None, 3),
                                 ClaimedJob):
                outcomes.append(job)
                assert len(outcomes) <= 3, outcomes
            assert job.id == due
            assert set(outcomes) <= {ClaimHeld(Held.MORE_KEYS, 0.0)}

    run(go())


def test_keys_whose_jobs_are_all_due_later_cost_one_probe(dsn):
    """Thousands of keys waiting out a retry's backoff: the claim sees in one probe that
    nothing is due and walks no key; a due job among them is claimed at once."""
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.admin.db.execute(
                "INSERT INTO tool_jobs (id, tool, idempotency_key, payload, max_attempts, "
                "concurrency_key, run_after) SELECT gen_random_uuid(), 'later', "
                "gen_random_uuid()::text, '{}', 3, 'k' || lpad(g::text, 5, '0'), "
                "now() + interval '1 hour' FROM generate_series(1, 3000) g")
            store = fleet.stores[0]
            assert await store.claim("later", "o", LEASE, None, 3) is None
            [due] = await fleet.enqueue("later", 1, key="k01500x")
            outcomes = []
            while not isinstance(job := await store.claim("later", "o", LEASE, None, 3),
                                 ClaimedJob):
                outcomes.append(job)
                assert len(outcomes) <= 15, outcomes
            assert job.id == due

    run(go())


def test_setting_the_same_rate_again_keeps_the_bucket(dsn):
    """Limits applied again from configuration on a schedule must not refill the bucket:
    only a rate or burst that changes starts a full one."""
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.enqueue("quota", 5)
            await fleet.admin.set_limits("quota", limit_changes(rate="1/m"), "test")
            store = fleet.stores[0]
            assert isinstance(await store.claim("quota", "o", LEASE, None, 3), ClaimedJob)
            for again in (limit_changes(rate="1/m"), limit_changes(burst=1),
                          limit_changes(max_running=5)):
                await fleet.admin.set_limits("quota", again, "test")
                held = await store.claim("quota", "o", LEASE, None, 3)
                assert held.reason == Held.RATE, again
            await fleet.admin.set_limits("quota", limit_changes(rate="2/m"), "test")
            assert isinstance(await store.claim("quota", "o", LEASE, None, 3), ClaimedJob)

    run(go())


def test_a_stopping_sidecar_gives_up_its_rate_turns(dsn):
    async def go():
        async with Fleet(dsn, 2) as fleet:
            await fleet.enqueue("search", 5)
            await fleet.admin.set_limits("search", limit_changes(rate="1/m"), "test")
            assert isinstance(await fleet.stores[0].claim("search", "a", LEASE, None, 3),
                              ClaimedJob)
            for owner in ("a", "b"):
                assert (await fleet.stores[1].claim("search", owner, LEASE, None, 3)).reason \
                    == Held.RATE
            queue = "SELECT rate_queue FROM tool_flow WHERE tool = 'search'"
            await fleet.worker.drop_rate_turns("search", "a")
            assert [t["o"] for t in await fleet.admin.db.fetchval(queue)] == ["b"]

    run(go())

def test_old_flow_changes_are_pruned_and_recent_ones_kept(dsn):
    async def go():
        async with Fleet(dsn, 1) as fleet:
            await fleet.admin.pause("erp", "old", "test")
            await fleet.admin.db.execute(
                "UPDATE tool_flow_events SET at = now() - interval '40 days'")
            await fleet.admin.resume("erp", "test")
            assert await fleet.admin.prune_rows("prune_flow_events", 30 * 86400) == 1
            assert [r["event"] for r in await fleet.admin.flow_events("erp", 10)] == \
                ["tool_resumed"]

    run(go())


def test_a_turn_its_sidecar_never_takes_is_dropped(dsn):
    """A sidecar that stops while it holds a rate's turn does not hold the others up for
    more than 0.25 s and one token after that turn's time."""
    async def go():
        async with Fleet(dsn, 3) as fleet:
            await fleet.enqueue("search", 5)
            await fleet.admin.set_limits("search", limit_changes(rate="2/s"), "test")
            assert isinstance(await fleet.stores[0].claim("search", "owner-0", LEASE, None, 3),
                              ClaimedJob)
            gone = await fleet.stores[1].claim("search", "owner-1", LEASE, None, 3)
            assert gone.reason == Held.RATE  # owner-1's turn: the next token; it never comes
            await fleet.admin.db.execute("SELECT pg_sleep($1)", gone.retry_in + 0.25 + 0.5 + 0.05)
            job = await fleet.stores[2].claim("search", "owner-2", LEASE, None, 3)
            assert isinstance(job, ClaimedJob)
            queue = await fleet.admin.db.fetchval(
                "SELECT rate_queue FROM tool_flow WHERE tool = 'search'")
            assert "owner-1" not in str(queue)

    run(go())


def test_one_claim_of_several_jobs_keeps_caps_and_turns_and_says_what_held_the_rest(dsn):
    """Issue 28: a claim of up to N jobs under flow limits takes them one after another
    under the tool's lock, so the caps hold inside one statement, keys take turns within
    it, and the limit that stopped it comes back beside the jobs it took."""
    async def go():
        async with Fleet(dsn, 2) as fleet:
            for key in ("a", "b", "c"):
                await fleet.enqueue("batch", 3, key=key)
            await fleet.admin.set_limits("batch", limit_changes(max_running=4,
                                                                max_running_per_key=2), "t")
            jobs, held = await fleet.stores[0].claim_many("batch", "owner-0", LEASE, 8,
                                                          None, 3)
            assert len(jobs) == 4 and held == ClaimHeld(Held.MAX_RUNNING)
            assert len({(j.id, j.fencing_token) for j in jobs}) == 4
            keys = [(await fleet.admin.get_job(j.id))["concurrency_key"] for j in jobs]
            assert sorted(keys) == ["a", "a", "b", "c"], keys  # in turn: a, b, c, a
            assert await fleet.running("batch") == {"a": 2, "b": 1, "c": 1}
            # One journal row per job claimed, under its own token.
            claims = await fleet.admin.db.fetchval(
                "SELECT count(*) FROM tool_job_events e JOIN tool_jobs j ON j.id = e.job_id "
                "AND e.fencing_token = j.fencing_token WHERE j.tool = 'batch' "
                "AND e.event = 'job_claimed'")
            assert claims == 4
            # The other claimer, asking for 8, is held at once and takes nothing.
            assert await fleet.stores[1].claim_many("batch", "owner-1", LEASE, 8, None, 3) \
                == ([], ClaimHeld(Held.MAX_RUNNING))
            # Room again: the next batch takes what the per-key cap allows and no more.
            await fleet.admin.set_limits("batch", {"max_running": None}, "t")
            jobs, held = await fleet.stores[1].claim_many("batch", "owner-1", LEASE, 8,
                                                          None, 3)
            assert await fleet.running("batch") == {"a": 2, "b": 2, "c": 2}
            assert len(jobs) == 2 and held == ClaimHeld(Held.MAX_RUNNING_PER_KEY)

    run(go())
