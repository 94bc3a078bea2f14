"""The guard before irreversible steps and checkpoints (sidecar/worker/guard.py): a real aiohttp
server on loopback, real leases claimed from a real PostgreSQL, real HTTP clients (aiohttp,
curl, urllib) and, at the end, a real ``sidecar run``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg
import orjson
import pytest

from kit import (
    FAST_PROFILE,
    TOOLS,
    base_env,
    cli,
    enqueue,
    journal_rows,
    query,
    run,
    wait_until_async,
)
from sidecar.protocol.clock import ownership_now
from sidecar.protocol.vocabulary import StopReason
from sidecar.runtime.config import load_settings
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker import safefs
from sidecar.worker.guard import (
    CHECKPOINT_LIMIT,
    CONFIRM_REUSE_SECONDS,
    CONNECTIONS_PER_ATTEMPT,
    GuardServer,
)
from sidecar.worker.lease import Lease

EXAMPLES = Path(__file__).parent.parent / "examples"
TOOL = "guarded"
PROFILE = load_settings(FAST_PROFILE).profile(TOOL)
H_PLUS_J = PROFILE.heartbeat_seconds + PROFILE.jitter_seconds  # 1.5 s
UNAUTHORIZED = {"error": "unauthorized"}


@dataclass
class Harness:
    store: WorkerStore
    guard: GuardServer
    url: str
    owner: str

    async def claim(self, remaining: float = 60.0) -> tuple[Lease, str]:
        """Enqueue and claim one job; hold it as a Lease with ``remaining`` seconds before
        its local deadline; register it with the guard. Returns (lease, secret)."""
        caller = CallerStore(self.store.pool, self.store.timeout)
        await caller.enqueue(TOOL, {"n": time.monotonic_ns()}, None, 3, {})
        # The database's lease outlasts the local deadline, as a real one does (the local
        # deadline is the renewal's send time plus the lease, less a margin).
        job = await self.store.claim(TOOL, self.owner, remaining + 60)
        assert job is not None
        lease = Lease(job, local_deadline=ownership_now() + remaining,
                      lease_until=job.lease_until)
        return lease, self.guard.register(lease)


@contextlib.asynccontextmanager
async def guarded(dsn: str, owner: str = "w1", store_timeout: float = 10, **options):
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init_connection)
    store = WorkerStore(pool, timeout=store_timeout)
    guard = GuardServer(store, PROFILE, owner, **options)
    url = await guard.start()
    try:
        yield Harness(store, guard, url, owner)
    finally:
        await guard.stop()
        await pool.close()


async def post(url: str, path: str, token: str | None = None, *, body=None,
               headers: dict | None = None) -> tuple[int, object, dict]:
    """POST and return (status, JSON body, headers)."""
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    if isinstance(body, dict | list):
        body = orjson.dumps(body)
    async with aiohttp.ClientSession() as session, \
            session.post(url + path, data=body, headers=hdrs) as response:
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw else None, dict(response.headers)


async def guard_call(h: Harness, token: str | None, body=None) -> tuple[int, object]:
    status, answer, _ = await post(h.url, "/v1/guard", token, body=body)
    return status, answer


@pytest.mark.database
def test_guard_answers_the_fencing_token_while_ownership_is_confirmed(dsn):
    async def go():
        async with guarded(dsn) as h:
            assert h.url.startswith("http://127.0.0.1:") and not h.url.endswith(":0")
            lease, token = await h.claim(remaining=60)
            before = ownership_now()
            status, answer = await guard_call(h, token)
            assert status == 200, answer
            assert set(answer) == {"fencing_token", "lease_remaining_seconds"}
            assert answer["fencing_token"] == lease.job.fencing_token == 1
            remaining = answer["lease_remaining_seconds"]
            assert 58 < remaining <= lease.local_deadline - before
            assert round(remaining, 3) == remaining  # milliseconds
            assert lease.request_id is None

            # A request id is kept on the lease for the ownership-unknown event (P15).
            status, answer = await guard_call(h, token, {"request_id": "tool-job:x:email"})
            assert status == 200
            assert lease.request_id == "tool-job:x:email"
            # A later call without one keeps it; an empty body or {} is fine.
            assert (await guard_call(h, token, b""))[0] == 200
            assert (await guard_call(h, token, {}))[0] == 200
            assert lease.request_id == "tool-job:x:email"

            # Just above H + J left: still allowed.
            _deadline_in(lease, H_PLUS_J + 0.5)
            status, answer = await guard_call(h, token)
            assert status == 200 and answer["lease_remaining_seconds"] > H_PLUS_J

    run(go())


def _deadline_in(lease, seconds: float) -> None:
    """A renewal confirmed ``lease`` with its local deadline ``seconds`` from now."""
    lease.confirm(lease.lease_until, ownership_now() + seconds, lease.suspended_at_confirm)


REFUSALS = [
    # (what happened, how to put the lease in that state, expected reason)
    ("cancelled by an operator", lambda lease: lease.lose(StopReason.CANCELLED), "cancelled"),
    ("zero rows at a heartbeat", lambda lease: lease.lose(StopReason.LEASE_LOST), "lease_lost"),
    ("outcome being written", lambda lease: lease.settle(), "lease_lost"),
    ("database not answering", lambda lease: lease.mark_unknown(ownership_now() - 2),
     "ownership_unknown"),
    ("given up at the local deadline", lambda lease: lease.lose(StopReason.LOCAL_DEADLINE),
     "ownership_unknown"),
    ("stage deadline", lambda lease: lease.stop(StopReason.STAGE_TIMEOUT), "deadline"),
    ("shutdown", lambda lease: lease.stop(StopReason.SHUTDOWN), "deadline"),
    ("less than H + J left", lambda lease: _deadline_in(lease, H_PLUS_J - 0.3), "lease_ending"),
    ("local deadline passed", lambda lease: _deadline_in(lease, -1), "lease_ending"),
    # Two states at once: the lost lease says more than the stop.
    ("cancelled while stopping", lambda lease: (lease.stop(StopReason.STAGE_TIMEOUT),
                                                lease.lose(StopReason.CANCELLED)), "cancelled"),
]


@pytest.mark.database
def test_guard_refuses_with_the_reason_of_each_state(dsn):
    async def go():
        async with guarded(dsn) as h:
            for what, put, reason in REFUSALS:
                lease, token = await h.claim()
                assert (await guard_call(h, token))[0] == 200, what
                put(lease)
                status, answer = await guard_call(h, token, {"request_id": f"req:{what}"})
                assert (status, answer) == (409, {"reason": reason}), what
                # A refused request is not the one in flight: it is not recorded.
                assert lease.request_id is None, what

    run(go())


@pytest.mark.database
def test_a_go_rests_on_a_fenced_read_of_the_row_not_on_local_clocks(dsn):
    """Issue 41 point 9: with the local clocks frozen (a paused VM whose clocks were
    stepped back), the lease looked held for seconds after another sidecar had taken the
    job, and the guard kept answering go with the old token. Now a go needs a fenced read
    of the row on the database's clock: the job taken over (token 2) while the local lease
    still says held with a minute left gets no at once, every time; a lease nearly over by
    the database's clock gets ``lease_ending``; a database that does not answer in time
    gets ``ownership_unknown``."""
    async def go():
        async with guarded(dsn, store_timeout=1.0) as h:
            lease, token = await h.claim(remaining=60)
            assert (await guard_call(h, token))[0] == 200
            # Our lease ends by the database's clock and w2 claims the job; locally
            # nothing changed: the lease is HELD with a minute before its local deadline.
            await h.store.pool.execute(
                "UPDATE tool_jobs SET lease_until = now() - interval '1 ms' WHERE id = $1",
                lease.job.id)
            taken = await h.store.claim(TOOL, "w2", 30)
            assert (taken.id, taken.fencing_token) == (lease.job.id, 2)
            await asyncio.sleep(CONFIRM_REUSE_SECONDS + 0.05)  # past the read's reuse
            assert lease.state.value == "held"
            assert lease.local_deadline - ownership_now() > 50
            for _ in range(7):
                assert await guard_call(h, token) == (409, {"reason": "lease_lost"})

            # Ours by the database, but less than H + J left by its clock.
            ending, ending_token = await h.claim(remaining=60)
            await h.store.pool.execute(
                "UPDATE tool_jobs SET lease_until = now() + interval '1 second' "
                "WHERE id = $1", ending.job.id)
            assert await guard_call(h, ending_token) == (409, {"reason": "lease_ending"})

            # A database that does not answer within the bound: no.
            quiet, quiet_token = await h.claim(remaining=60)
            await asyncio.sleep(CONFIRM_REUSE_SECONDS + 0.05)
            blocker = await asyncpg.connect(dsn)
            try:
                tx = blocker.transaction()
                await tx.start()
                await blocker.execute("LOCK TABLE tool_jobs IN ACCESS EXCLUSIVE MODE")
                t0 = time.monotonic()
                assert await guard_call(h, quiet_token) == (
                    409, {"reason": "ownership_unknown"})
                assert time.monotonic() - t0 < 5  # bounded, never a hang
                await tx.rollback()
            finally:
                await blocker.close()
            # Answering again, the database says go.
            status, answer = await guard_call(h, quiet_token)
            assert status == 200 and answer["fencing_token"] == quiet.job.fencing_token

    run(go())


@pytest.mark.database
def test_unauthorized_requests_all_get_the_same_answer(dsn):
    async def go():
        async with guarded(dsn) as h, guarded(dsn, owner="w2") as other:
            lease_a, token_a = await h.claim()
            lease_b, token_b = await h.claim()
            _, token_elsewhere = await other.claim()    # another sidecar's job
            lease_gone, token_gone = await h.claim()
            h.guard.unregister(lease_gone.job.attempt_id)

            # Each secret names its own job only.
            assert (await guard_call(h, token_a))[1]["fencing_token"] == lease_a.job.fencing_token
            lease_b.lose(StopReason.CANCELLED)
            assert (await guard_call(h, token_a))[0] == 200
            assert (await guard_call(h, token_b)) == (409, {"reason": "cancelled"})

            bad = {
                "no header": {},
                "wrong scheme": {"Authorization": f"Basic {token_a}"},
                "bare scheme": {"Authorization": "Bearer"},
                "no scheme": {"Authorization": token_a},
                "tampered": {"Authorization": f"Bearer {token_a[:-1]}"
                                              f"{'A' if token_a[-1] != 'A' else 'B'}"},
                "garbage": {"Authorization": "Bearer " + "x" * 5000},
                "non-ascii": {"Authorization": "Bearer jöb"},
                "another sidecar's secret": {"Authorization": f"Bearer {token_elsewhere}"},
                "unregistered job": {"Authorization": f"Bearer {token_gone}"},
            }
            answers = []
            for what, headers in bad.items():
                for path in ("/v1/guard", "/v1/checkpoint"):
                    status, answer, hdrs = await post(h.url, path, headers=headers,
                                                      body={"step": 1})
                    assert (status, answer) == (401, UNAUTHORIZED), (what, path)
                    answers.append((hdrs["Content-Type"], hdrs.get("WWW-Authenticate"),
                                    hdrs["Content-Length"]))
            assert len(set(answers)) == 1  # nothing tells one case from another

            # Two Authorization headers are refused too, valid or not.
            async with aiohttp.ClientSession() as session:
                hdrs = [("Authorization", f"Bearer {token_a}"),
                        ("Authorization", f"Bearer {token_a}")]
                async with session.post(h.url + "/v1/guard", headers=hdrs) as response:
                    assert response.status == 401
                    assert await response.json() == UNAUTHORIZED

    run(go())
    rows = query(dsn, "SELECT count(*) AS n FROM tool_jobs WHERE checkpoint IS NOT NULL")
    assert rows[0]["n"] == 0


async def unix_post(path: str, route: str, token: str, body=None) -> tuple[int, object]:
    """POST over the Unix socket ``path``: (status, JSON body)."""
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session, \
            session.post("http://localhost" + route, data=orjson.dumps(body or {}),
                         headers={"Authorization": f"Bearer {token}"}) as response:
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw else None


@pytest.mark.database
def test_each_attempt_has_its_own_socket_that_serves_it_alone(dsn, tmp_path):
    """Issue 41 point 1: an attempt's Unix socket (made by safefs.listen_unix, as the
    sandbox makes it in the work directory) answers that attempt: a go and a fenced
    checkpoint through it. Another attempt's secret sent through it gets the same 401 as
    a wrong one (without the sandbox, a tool of the same user can reach a sibling's
    socket; it still gets nothing). Unregistered, the socket is closed."""
    async def go():
        async with guarded(dsn) as h:
            dirs = []
            for name in ("a", "b"):
                (tmp_path / name).mkdir()
                dirs.append(os.open(tmp_path / name, os.O_RDONLY | os.O_DIRECTORY))
            try:
                lease_a, _ = await h.claim()
                lease_b, _ = await h.claim()
                token_a = h.guard.register(lease_a, listener=safefs.listen_unix(
                    dirs[0], "guard.sock"))
                token_b = h.guard.register(lease_b, listener=safefs.listen_unix(
                    dirs[1], "guard.sock"))
                sock_a, sock_b = (str(tmp_path / n / "guard.sock") for n in ("a", "b"))
                assert oct(os.stat(sock_a).st_mode & 0o777) == "0o600"
                assert h.guard.has_socket(lease_a.job.attempt_id)
                status, answer = await unix_post(sock_a, "/v1/guard", token_a)
                assert (status, answer["fencing_token"]) == (200, lease_a.job.fencing_token)
                assert await unix_post(sock_a, "/v1/checkpoint", token_a, {"via": "unix"}) \
                    == (200, {"saved": True, "bytes": len(b'{"via":"unix"}')})
                # B's secret through A's socket, and A's through B's: refused alike.
                assert await unix_post(sock_a, "/v1/guard", token_b) == (401, UNAUTHORIZED)
                assert await unix_post(sock_b, "/v1/checkpoint", token_a, {"x": 1}) \
                    == (401, UNAUTHORIZED)
                assert (await unix_post(sock_b, "/v1/guard", token_b))[0] == 200
                # Over TCP each secret still works (NETWORK=host gets both ways).
                assert (await guard_call(h, token_a))[0] == 200
                h.guard.unregister(lease_a.job.attempt_id)
                assert not h.guard.has_socket(lease_a.job.attempt_id)
                with pytest.raises(aiohttp.ClientConnectionError):
                    await unix_post(sock_a, "/v1/guard", token_a)
                assert (await unix_post(sock_b, "/v1/guard", token_b))[0] == 200
                return lease_a, lease_b
            finally:
                for fd in dirs:
                    os.close(fd)

    lease_a, lease_b = run(go())
    assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1", lease_a.job.id)[0][0] \
        == {"via": "unix"}
    assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1", lease_b.job.id)[0][0] \
        is None


@pytest.mark.database
def test_guard_rejects_bad_bodies(dsn):
    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim()
            for body in (b"{not json", b'{"request_id": "x"', b"\xff\xfe"):
                status, answer = await guard_call(h, token, body)
                assert status == 400 and answer["error"] == "bad_json", body
            for body in ([1, 2], {"request_id": 42}, {"request_id": ""},
                         {"request_id": "x" * 201}, {"request_id": "a\nb"}):
                status, answer = await guard_call(h, token, body)
                assert status == 400 and answer["error"] == "bad_request", body
            assert lease.request_id is None
            status, answer = await guard_call(h, token, {"request_id": "x" * 200})
            assert status == 200 and lease.request_id == "x" * 200
            status, answer = await guard_call(h, token, b" " * 5000)
            assert (status, answer) == (413, {"error": "body_too_large", "limit": 4096})

    run(go())


@pytest.mark.database
def test_checkpoint_is_saved_with_the_job_and_journaled(dsn):
    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim()
            first = orjson.dumps({"page": 3, "cursor": "abc"})
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=first)
            assert (status, answer) == (200, {"saved": True, "bytes": len(first)})
            second = b'{"page": 4, "cursor": "abd"}'
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=second)
            assert (status, answer) == (200, {"saved": True, "bytes": len(second)})
            # Any JSON value; exactly the limit is allowed.
            exact = b'"' + b"x" * (CHECKPOINT_LIMIT - 2) + b'"'
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=exact)
            assert (status, answer) == (200, {"saved": True, "bytes": CHECKPOINT_LIMIT})
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=second)
            assert status == 200
            return lease, first, second

    lease, first, second = run(go())
    job_id = lease.job.id
    assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1", job_id)[0][0] \
        == {"page": 4, "cursor": "abd"}
    events = journal_rows(dsn, job_id, "checkpoint_saved")
    assert len(events) == 4
    assert {e["fencing_token"] for e in events} == {lease.job.fencing_token}
    assert events[0]["details"] == {"bytes": len(first),
                                    "sha256": hashlib.sha256(first).hexdigest()}
    assert events[1]["details"]["sha256"] == hashlib.sha256(second).hexdigest()
    assert "abc" not in str(events)  # P23: size and hash, never the content


@pytest.mark.database
def test_checkpoint_limits_and_bad_json(dsn):
    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim()
            too_large = {"error": "checkpoint_too_large", "limit": 65536}
            over = b'"' + b"x" * (CHECKPOINT_LIMIT - 1) + b'"'
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=over)
            assert (status, answer) == (413, too_large)

            async def chunks():  # no Content-Length: the cap applies while reading
                for _ in range(20):
                    yield b" " * 4096

            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=chunks())
            assert (status, answer) == (413, too_large)
            for body in (b"", b"{", b"{'a': 1}", b"NaN", b"\xff", b'{"a": 1} {"b": 2}'):
                status, answer, _ = await post(h.url, "/v1/checkpoint", token, body=body)
                assert status == 400 and answer["error"] == "bad_json", body
            # Valid JSON that jsonb refuses.
            status, answer, _ = await post(h.url, "/v1/checkpoint", token,
                                           body=b'{"a": "\\u0000"}')
            assert status == 400 and answer["error"] == "bad_json"
            # The guard is still fine afterwards.
            assert (await guard_call(h, token))[0] == 200
            return lease

    lease = run(go())
    assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1", lease.job.id)[0][0] \
        is None
    assert journal_rows(dsn, lease.job.id, "checkpoint_saved") == []


@pytest.mark.database
def test_checkpoint_is_refused_after_another_owner_took_the_job(dsn):
    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim()
            status, _, _ = await post(h.url, "/v1/checkpoint", token, body={"page": 1})
            assert status == 200
            # Our lease expires by the database's clock and w2 claims the job (token 2);
            # locally nothing has noticed yet.
            await h.store.pool.execute(
                "UPDATE tool_jobs SET lease_until = now() - interval '1 ms' WHERE id = $1",
                lease.job.id)
            taken = await h.store.claim(TOOL, "w2", 30)
            assert taken.id == lease.job.id and taken.fencing_token == 2
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body={"page": 99})
            assert (status, answer) == (409, {"reason": "lease_lost"})
            # From then on the guard knows too, before any heartbeat says so.
            assert await guard_call(h, token) == (409, {"reason": "lease_lost"})
            # A lease lost locally is refused without asking the database.
            other, other_token = await h.claim()
            other.lose(StopReason.LEASE_LOST)
            status, answer, _ = await post(h.url, "/v1/checkpoint", other_token, body={"x": 1})
            assert (status, answer) == (409, {"reason": "lease_lost"})
            return lease, other

    lease, other = run(go())
    row = query(dsn, "SELECT checkpoint, owner_id FROM tool_jobs WHERE id = $1", lease.job.id)[0]
    assert row["checkpoint"] == {"page": 1} and row["owner_id"] == "w2"
    assert [e["fencing_token"] for e in journal_rows(dsn, lease.job.id, "checkpoint_saved")] == [1]
    assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1", other.job.id)[0][0] \
        is None


@pytest.mark.database
def test_checkpoint_database_trouble_is_503_and_never_blocks_the_guard(dsn):
    async def go():
        async with guarded(dsn, store_timeout=1.0) as h:
            lease, token = await h.claim()
            # Another transaction holds the job's row: the fenced write cannot finish.
            blocker = await asyncpg.connect(dsn)
            try:
                tx = blocker.transaction()
                await tx.start()
                await blocker.execute("SELECT 1 FROM tool_jobs WHERE id = $1 FOR UPDATE",
                                      lease.job.id)
                started = time.monotonic()
                stuck = asyncio.create_task(
                    post(h.url, "/v1/checkpoint", token, body={"page": 1}))
                await wait_until_async(lambda: blocker.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"), what="the checkpoint to wait on the row")
                # Meanwhile the guard answers at once (nothing blocks the event loop).
                t0 = time.monotonic()
                assert (await guard_call(h, token))[0] == 200
                assert time.monotonic() - t0 < 0.5
                status, answer, _ = await stuck
                assert (status, answer) == (503, {"error": "database_unavailable"})
                assert time.monotonic() - started < 3
                await tx.rollback()
            finally:
                await blocker.close()
            # The database answers again: the same checkpoint goes through.
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body={"page": 1})
            assert status == 200, answer
            # A database that is gone altogether.
            await h.store.pool.close()
            status, answer, _ = await post(h.url, "/v1/checkpoint", token, body={"page": 2})
            assert (status, answer) == (503, {"error": "database_unavailable"})

    run(go())


@pytest.mark.database
def test_slow_and_idle_clients_do_not_wedge_the_guard(dsn):
    async def go():
        async with guarded(dsn, body_timeout=0.5) as h:
            lease, token = await h.claim()
            port = int(h.url.rsplit(":", 1)[1])
            # One client sends half its headers and stops; another announces a body and
            # sends a few bytes of it.
            idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
            idle_w.write(b"POST /v1/guard HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthor")
            slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
            slow_w.write(b"POST /v1/checkpoint HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Authorization: Bearer " + token.encode() +
                         b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            await slow_w.drain()
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            # As many at once as the attempt may hold besides the slow client's
            # connection (CONNECTIONS_PER_ATTEMPT; tests/test_guard_flood.py goes over).
            answers = await asyncio.gather(*(guard_call(h, token)
                                             for _ in range(CONNECTIONS_PER_ATTEMPT - 1)))
            assert all(status == 200 for status, _ in answers)
            assert time.monotonic() - t0 < 2
            # The slow body is given up after body_timeout.
            head = await asyncio.wait_for(slow_r.read(4096), 5)
            assert head.startswith(b"HTTP/1.1 408"), head
            assert b'"body_timeout"' in head
            for writer in (idle_w, slow_w):
                writer.close()
            # Nothing was saved by the slow client.
            status, _, _ = await post(h.url, "/v1/checkpoint", token, body={"ok": 1})
            assert status == 200

    run(go())


@pytest.mark.database
def test_start_stop_and_reregistration(dsn):
    async def go():
        async with guarded(dsn) as h:
            with pytest.raises(RuntimeError):
                await h.guard.start()
            lease, token = await h.claim()
            # The same job registered again by this sidecar (given back and claimed anew,
            # token + 1): each attempt has its own registration (case F14), so ending the
            # old attempt leaves the new attempt's secret working, whatever order the
            # two supervisors end in.
            again = Lease(dataclasses.replace(lease.job,
                                              fencing_token=lease.job.fencing_token + 1),
                          local_deadline=ownership_now() + 60, lease_until=lease.lease_until)
            token2 = h.guard.register(again)
            assert token2 != token and len(token2) >= 43
            assert (await guard_call(h, token))[0] == 200  # not settled: still its own
            h.guard.unregister(lease.job.attempt_id)
            assert (await guard_call(h, token))[0] == 401
            # The row now says the new attempt holds the job (its go rests on the row).
            await h.store.pool.execute("UPDATE tool_jobs SET fencing_token = $2 WHERE id = $1",
                                       again.job.id, again.job.fencing_token)
            assert (await guard_call(h, token2))[0] == 200
            h.guard.unregister(again.job.attempt_id)
            assert (await guard_call(h, token2))[0] == 401
            h.guard.unregister(again.job.attempt_id)  # unknown: ignored
            url = h.url
            await h.guard.stop()
            await h.guard.stop()
            with pytest.raises(aiohttp.ClientConnectionError):
                await guard_call(h, token2)
            return url

    run(go())


# --- the examples -------------------------------------------------------------------------


def _example_argv(example: str) -> list[str]:
    path = str(EXAMPLES / example)
    return [sys.executable, path] if example.endswith(".py") else [path]


async def _run_example(h: Harness, token: str, example: str, *args: str,
                       socket_path: str | None = None) -> tuple[int, str, str]:
    """Run an example as a tool would: with the guard's URL, or, given ``socket_path``,
    with its Unix socket only (NETWORK=none, issue 41)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    # A proxy setting must not divert the loopback call (this one would refuse it).
    env.update(SIDECAR_GUARD_TOKEN=token,
               http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    if socket_path is None:
        env["SIDECAR_GUARD_URL"] = h.url
    else:
        env["SIDECAR_GUARD_SOCKET"] = socket_path
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    proc = await asyncio.create_subprocess_exec(
        *_example_argv(example), *args, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.e2e
@pytest.mark.parametrize("example", ["guard.sh", "guard_client.py"])
def test_examples_ask_the_guard(dsn, example):
    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim()
            code, out, err = await _run_example(h, token, example)
            assert code == 0, err
            answer = orjson.loads(out)
            assert answer["fencing_token"] == lease.job.fencing_token
            assert answer["lease_remaining_seconds"] > 50

            request_id = 'tool-job:abc:send "mail" \\ now'
            code, out, err = await _run_example(h, token, example, request_id)
            assert code == 0, err
            assert lease.request_id == request_id

            lease.lose(StopReason.CANCELLED)
            code, out, err = await _run_example(h, token, example, "later")
            assert (code, out) == (1, "")
            assert err.strip() == "guard: cancelled"
            assert lease.request_id == request_id

            code, out, err = await _run_example(h, "not-a-secret", example)
            assert code == 2 and "401" in err and out == ""

            other, other_token = await h.claim()
            _deadline_in(other, 1)
            code, out, err = await _run_example(h, other_token, example)
            assert (code, err.strip()) == (1, "guard: lease_ending")

            if example.endswith(".py"):
                code, out, err = await _run_example(h, other_token, example, "--checkpoint",
                                                    '{"page": 7}')
                assert code == 0, err
                assert orjson.loads(out) == {"saved": True, "bytes": len('{"page":7}')}
                code, out, err = await _run_example(h, token, example, "--checkpoint", "{}")
                assert (code, err.strip()) == (1, "guard: lease_lost")
            return other

    other = run(go())
    if example.endswith(".py"):
        assert query(dsn, "SELECT checkpoint FROM tool_jobs WHERE id = $1",
                     other.job.id)[0][0] == {"page": 7}


@pytest.mark.e2e
@pytest.mark.parametrize("example", ["guard.sh", "guard_client.py"])
def test_examples_ask_the_guard_over_the_socket_without_a_url(dsn, example, tmp_path):
    """Issue 41 point 1: a tool with NETWORK=none has no SIDECAR_GUARD_URL, only its own
    socket; the examples ask there (the shell one with curl --unix-socket)."""
    async def go():
        async with guarded(dsn) as h:
            dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                lease, _ = await h.claim()
                token = h.guard.register(lease, listener=safefs.listen_unix(dir_fd, "g.sock"))
                path = str(tmp_path / "g.sock")
                code, out, err = await _run_example(h, token, example, "req:1",
                                                    socket_path=path)
                assert code == 0, err
                assert orjson.loads(out)["fencing_token"] == lease.job.fencing_token
                assert lease.request_id == "req:1"
                lease.lose(StopReason.LEASE_LOST)
                code, out, err = await _run_example(h, token, example, socket_path=path)
                assert (code, err.strip()) == (1, "guard: lease_lost")
                h.guard.unregister(lease.job.attempt_id)
                code, out, err = await _run_example(h, token, example, socket_path=path)
                assert code == 2 and out == "", err
            finally:
                os.close(dir_fd)

    run(go())


@pytest.mark.database
def test_guard_client_retries_lease_ending_until_renewed(dsn):
    """``guard(retry_seconds=...)`` waits out the short window before a heartbeat."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import guard_client
    finally:
        sys.path.remove(str(EXAMPLES))

    async def go():
        async with guarded(dsn) as h:
            lease, token = await h.claim(remaining=1.0)
            loop = asyncio.get_running_loop()
            # The "heartbeat" renews the lease a moment later.
            loop.call_later(0.7, _deadline_in, lease, 60)
            env = {"SIDECAR_GUARD_URL": h.url, "SIDECAR_GUARD_TOKEN": token}
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                answer = await asyncio.to_thread(guard_client.guard, "r1", 5.0)
                assert answer["fencing_token"] == lease.job.fencing_token
                lease.lose(StopReason.LEASE_LOST)
                with pytest.raises(guard_client.GuardRefused) as refused:
                    await asyncio.to_thread(guard_client.guard, "r2", 5.0)
                assert refused.value.reason == "lease_lost"
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    run(go())


# --- end to end through `sidecar run` -----------------------------------------------------


def _require_wired_guard(result: dict) -> None:
    assert result.get("guard") is not None, "the child got no SIDECAR_GUARD_URL"


@pytest.mark.e2e
def test_sidecar_run_gives_the_tool_a_working_guard(dsn):
    env = base_env(dsn, SIDECAR_LEASE_SECONDS="6")  # the guard's window always open
    job_id = enqueue(dsn, TOOL, {"step": "publish"}, env=env)
    done = cli(dsn, "run", "--tool", TOOL, "--drain", "--", str(TOOLS / "guard_steps.py"),
               env=env)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    job = query(dsn, "SELECT state, result, checkpoint, fencing_token FROM tool_jobs "
                     "WHERE id = $1", job_id)[0]
    assert job["state"] == "succeeded", job
    _require_wired_guard(job["result"])
    assert job["result"]["guard"]["fencing_token"] == job["fencing_token"] == 1
    assert job["result"]["checkpoint"] == {"saved": True, "bytes": len('{"done":"publish"}')}
    assert job["checkpoint"] == {"done": "publish"}
    [event] = journal_rows(dsn, job_id, "checkpoint_saved")
    assert event["fencing_token"] == 1
    assert b"SIDECAR_GUARD_TOKEN" not in done.stderr  # the secret is never logged


@pytest.mark.e2e
def test_a_tool_stopped_at_its_stage_deadline_is_refused_but_may_checkpoint(dsn, tmp_path):
    # A 6 s lease: the guard's window (H + J = 1.5 s before the local deadline) is then
    # open all the time; with the 3 s fast profile it is open about half of each period.
    env = base_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="2", SIDECAR_LEASE_SECONDS="6")
    report, ready = tmp_path / "report.json", tmp_path / "ready.json"
    job_id = enqueue(dsn, TOOL, {"report": str(report), "readyfile": str(ready)},
                     "--max-attempts", "1", env=env)
    done = cli(dsn, "run", "--tool", TOOL, "--drain", "--", str(TOOLS / "guard_sigterm.py"),
               env=env)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    job = query(dsn, "SELECT state, error, checkpoint FROM tool_jobs WHERE id = $1",
                job_id)[0]
    assert ready.exists(), f"the tool never got its first guard answer: " \
        f"{done.stderr.decode()[-3000:]}"
    assert orjson.loads(ready.read_bytes())["fencing_token"] == 1
    assert report.exists(), done.stderr.decode()[-3000:]
    got = orjson.loads(report.read_bytes())
    assert got.get("guard_refused") == "deadline", got
    assert got["checkpoint"]["saved"] is True
    assert job["state"] == "failed" and job["error"]["kind"] == "stage_timeout", job
    assert job["checkpoint"]["pages"] > 0
