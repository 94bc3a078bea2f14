"""Fenced side effects at the receiver (P7, P17, P18): the reference receiver as a real
`sidecar receiver` process over real HTTP, fence_middleware in an in-process aiohttp
server, and run_fenced directly; every test on a fresh PostgreSQL database."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kit import Receiver, base_env, cli, query, run, scalar, wait_until_async
from sidecar.ops.fence import FencedRequest, fence_middleware, fenced, run_fenced
from sidecar.storage import db

KEY = "tool-job:8f1b:create_case"

# The spec puts the FencedRequest at request["fence"]; aiohttp would prefer a RequestKey
# and says so with a warning that it filters out itself outside pytest.
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web.NotAppKeyWarning")


@pytest.fixture
def receiver(receiver):
    """conftest's receiver, which must print its exact ready line and exit 0 on SIGTERM."""
    assert f"sidecar: receiver listening on {receiver.url}" in receiver.stderr()
    yield receiver
    assert receiver.stop() == 0, receiver.stderr()


def fence_headers(key: str | None = KEY, fence: int | str | None = 42,
                  entity: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if fence is not None:
        headers["X-Execution-Fence"] = str(fence)
    if entity is not None:
        headers["X-Fence-Entity"] = entity
    return headers


async def _request(session, method: str, url: str, headers=None, body: bytes | None = None):
    async with session.request(method, url, headers=headers, data=body) as resp:
        return resp.status, orjson.loads(await resp.read()), dict(resp.headers)


def http(method: str, url: str, headers=None, body=None):
    """One real HTTP request: (status, JSON body, headers)."""
    data = body if body is None or isinstance(body, bytes) else orjson.dumps(body)

    async def go():
        async with aiohttp.ClientSession() as session:
            return await _request(session, method, url, headers, data)

    return run(go())


def post(receiver: Receiver, body=None, **headers):
    return http("POST", receiver.url + "/effects", fence_headers(**headers),
                {"case": "A-1"} if body is None else body)


def effects(dsn: str) -> list[dict]:
    return [dict(r) for r in query(dsn, "SELECT * FROM fence_effects ORDER BY id")]


LAST_FENCE = "SELECT last_fence FROM fence_entities WHERE entity = $1"


def last_fence(dsn: str, entity: str):
    return scalar(dsn, LAST_FENCE, entity)


async def keys(pool, table: str) -> list[str]:
    """Idempotency keys in ``table``, sorted (from inside a running event loop)."""
    return [r[0] for r in await pool.fetch(f"SELECT idempotency_key FROM {table} ORDER BY 1")]


# --- the reference receiver, as a real process --------------------------------


@pytest.mark.e2e
@pytest.mark.server
def test_accepted_effect_is_recorded_and_listed(dsn, receiver):
    status, body, _ = post(receiver, {"case": "A-1", "amount": 3})
    assert (status, body) == (201, {"effect_id": 1, "entity": "tool-job:8f1b", "fence": 42})
    status, listed, _ = http("GET", receiver.url + "/effects")
    assert status == 200
    [effect] = listed["effects"]
    assert {k: effect[k] for k in ("id", "idempotency_key", "entity", "fence", "body")} == {
        "id": 1, "idempotency_key": KEY, "entity": "tool-job:8f1b", "fence": 42,
        "body": {"case": "A-1", "amount": 3}}
    assert effect["received_at"]
    assert http("GET", receiver.url + "/effects?entity=tool-job:8f1b")[1] == listed
    assert http("GET", receiver.url + "/effects?entity=other")[1] == {"effects": []}
    assert last_fence(dsn, "tool-job:8f1b") == 42


@pytest.mark.e2e
@pytest.mark.server
def test_same_key_same_body_replays_without_a_second_effect(dsn, receiver):
    first = post(receiver)
    second = post(receiver)
    assert first[:2] == second[:2] == (201, {"effect_id": 1, "entity": "tool-job:8f1b",
                                             "fence": 42})
    assert "Idempotent-Replayed" not in first[2]
    assert second[2]["Idempotent-Replayed"] == "true"
    assert len(effects(dsn)) == 1


@pytest.mark.e2e
@pytest.mark.server
def test_same_key_different_body_is_refused(dsn, receiver):
    assert post(receiver, {"case": "A-1"})[0] == 201
    status, body, _ = post(receiver, {"case": "B-2"})
    assert status == 422
    assert body["error"] == "idempotency_key_reused" and body["idempotency_key"] == KEY
    assert [e["body"] for e in effects(dsn)] == [{"case": "A-1"}]


@pytest.mark.e2e
@pytest.mark.server
def test_lower_fence_is_stale_even_with_an_accepted_key(dsn, receiver):
    assert post(receiver, key=KEY, fence=42)[0] == 201
    # An old owner (token 41) of the same job, with another operation's key ...
    status, body, _ = post(receiver, key="tool-job:8f1b:send_mail", fence=41)
    assert (status, body) == (409, {"error": "stale_fence", "fence": 41, "current": 42})
    # ... and with the very key the new owner used: stale, not a replay (check order).
    status, body, headers = post(receiver, key=KEY, fence=41)
    assert (status, body) == (409, {"error": "stale_fence", "fence": 41, "current": 42})
    assert "Idempotent-Replayed" not in headers
    assert len(effects(dsn)) == 1
    assert last_fence(dsn, "tool-job:8f1b") == 42
    assert scalar(dsn, "SELECT count(*) FROM fence_requests") == 1


@pytest.mark.e2e
@pytest.mark.server
def test_equal_or_higher_fence_is_accepted(dsn, receiver):
    assert post(receiver, key="job:1:a", fence=42)[0] == 201
    assert post(receiver, key="job:1:b", fence=42)[0] == 201
    assert post(receiver, key="job:1:c", fence=43)[:2] == (
        201, {"effect_id": 3, "entity": "job:1", "fence": 43})
    assert post(receiver, key="job:1:d", fence=42)[1] == {
        "error": "stale_fence", "fence": 42, "current": 43}
    assert last_fence(dsn, "job:1") == 43
    assert [e["fence"] for e in effects(dsn)] == [42, 42, 43]


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("headers, named", [
    ({"key": None}, "Idempotency-Key"),
    ({"key": ""}, "Idempotency-Key"),
    ({"key": "x" * 513}, "Idempotency-Key"),
    ({"fence": None}, "X-Execution-Fence"),
    ({"fence": "abc"}, "X-Execution-Fence"),
    ({"fence": "-1"}, "X-Execution-Fence"),
    ({"fence": "1.5"}, "X-Execution-Fence"),
    ({"fence": ""}, "X-Execution-Fence"),
    ({"fence": "+7"}, "X-Execution-Fence"),
    ({"fence": str(2**63)}, "X-Execution-Fence"),
    ({"entity": ""}, "X-Fence-Entity"),
])
def test_missing_or_malformed_header_is_400_naming_it(dsn, receiver, headers, named):
    status, body, _ = post(receiver, **headers)
    assert status == 400
    assert body["error"] == "bad_header" and body["header"] == named and body["message"]
    assert effects(dsn) == []
    assert scalar(dsn, "SELECT count(*) FROM fence_requests") == 0


@pytest.mark.e2e
@pytest.mark.server
def test_fence_entity_header_overrides_the_default(dsn, receiver):
    assert post(receiver, key="tool-job:1:open", fence=5, entity="case:7")[1]["entity"] == "case:7"
    # Another job's stale token for the same case is refused ...
    assert post(receiver, key="tool-job:2:close", fence=3, entity="case:7")[1] == {
        "error": "stale_fence", "fence": 3, "current": 5}
    # ... while without the header the key's job part is the entity, which is fresh.
    assert post(receiver, key="tool-job:2:close", fence=3)[1]["entity"] == "tool-job:2"
    # A key without ':' is its own entity.
    assert post(receiver, key="invoice-42", fence=1)[1]["entity"] == "invoice-42"
    assert {r["entity"]: r["last_fence"] for r in query(
        dsn, "SELECT entity, last_fence FROM fence_entities")} == {
        "case:7": 5, "tool-job:2": 3, "invoice-42": 1}


@pytest.mark.e2e
@pytest.mark.server
def test_concurrent_identical_requests_execute_once(dsn, receiver):
    body = orjson.dumps({"case": "C-3"})

    async def go():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(
                _request(session, "POST", receiver.url + "/effects", fence_headers(), body)
                for _ in range(20)))

    answers = run(go())
    accepted = [(s, b) for s, b, _ in answers if s == 201]
    assert accepted, answers
    assert all(a == (201, {"effect_id": 1, "entity": "tool-job:8f1b", "fence": 42})
               for a in accepted)
    assert all(s == 201 or (s == 409 and b["error"] == "in_progress") for s, b, _ in answers)
    assert sum("Idempotent-Replayed" not in h for s, _, h in answers if s == 201) == 1
    assert len(effects(dsn)) == 1


@pytest.mark.e2e
@pytest.mark.server
def test_receiver_exits_0_on_sigint(receiver):
    assert receiver.stop(signal.SIGINT) == 0


@pytest.mark.e2e
@pytest.mark.server
def test_receiver_bad_listen_is_one_line_and_exit_2():
    # The address is checked before the database is touched.
    env = base_env("postgresql://nobody@127.0.0.1:1/none")
    for listen in ("nonsense", "127.0.0.1:99999", "127.0.0.1:", ":8900", "host:80x"):
        done = cli("", "receiver", "--listen", listen, env=env, timeout=30)
        assert done.returncode == 2, (listen, done.stderr)
        lines = done.stderr.decode().splitlines()
        assert len(lines) == 1 and "--listen" in lines[0] and "HOST:PORT" in lines[0], lines


@pytest.mark.e2e
@pytest.mark.server
def test_receiver_port_in_use_is_one_line(dsn):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli(dsn, "receiver", "--listen", f"127.0.0.1:{port}", timeout=30)
    assert done.returncode == 1
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "cannot listen" in lines[0], lines


# --- fence_middleware in an in-process aiohttp server ---------------------------

INSERT_EFFECT = ("INSERT INTO fence_effects (idempotency_key, entity, fence, body) "
                 "VALUES ($1, $2, $3, '{}') RETURNING id")


async def _with_app(dsn: str, routes, test, *, paths=(), lock_timeout=5.0):
    pool = await db.create_pool(dsn, 5, max_size=5)
    try:
        app = web.Application(middlewares=[fence_middleware(pool, paths=paths,
                                                            lock_timeout=lock_timeout)])
        app.router.add_routes(routes)
        async with TestClient(TestServer(app)) as client:
            return await test(client, pool)
    finally:
        await pool.close()


async def _call(client, path: str, body: bytes = b"{}", **headers):
    resp = await client.post(path, data=body, headers=fence_headers(**headers))
    return resp.status, orjson.loads(await resp.read())


@pytest.mark.database
def test_handler_that_raises_rolls_everything_back(dsn):
    fail = {"now": True}

    @fenced
    async def effect(request):
        fence: FencedRequest = request["fence"]
        effect_id = await fence.conn.fetchval(INSERT_EFFECT, fence.idempotency_key,
                                              fence.entity, fence.fence)
        if fail["now"]:
            raise RuntimeError("the handler crashed after writing its row")
        return web.json_response({"effect_id": effect_id}, status=201)

    async def test(client, pool):
        fail["now"] = False
        assert (await _call(client, "/e", key="job:9:prepare", fence=5))[0] == 201
        fail["now"] = True
        status, body = await _call(client, "/e", key="job:9:capture", fence=9)
        assert (status, body["error"]) == (500, "handler_failed")
        # Nothing of the failed request was kept: not its row, not its key, not fence 9 ...
        assert await keys(pool, "fence_effects") == ["job:9:prepare"]
        assert await keys(pool, "fence_requests") == ["job:9:prepare"]
        assert await pool.fetchval(LAST_FENCE, "job:9") == 5
        # ... so token 6 is not stale, and the same key runs again rather than replaying.
        fail["now"] = False
        assert (await _call(client, "/e", b'{"other": 1}', key="job:9:other", fence=6))[0] == 201
        assert (await _call(client, "/e", key="job:9:capture", fence=9))[0] == 201
        assert await keys(pool, "fence_effects") == [
            "job:9:capture", "job:9:other", "job:9:prepare"]
        assert await pool.fetchval(LAST_FENCE, "job:9") == 9

    run(_with_app(dsn, [web.post("/e", effect)], test))


@pytest.mark.database
def test_middleware_fences_listed_paths_and_leaves_other_routes_alone(dsn):
    calls = []

    async def by_path(request):
        calls.append(request["fence"].fence)
        return web.json_response({"ok": True})

    async def plain(request):
        return web.json_response({"fence": request.get("fence")})

    async def test(client, pool):
        status, body = await _call(client, "/fenced", fence="x")
        assert (status, body["header"]) == (400, "X-Execution-Fence")
        assert await _call(client, "/fenced", fence=3) == (200, {"ok": True})
        resp = await client.post("/plain")
        assert (resp.status, await resp.json()) == (200, {"fence": None})
        return calls

    assert run(_with_app(dsn, [web.post("/fenced", by_path), web.post("/plain", plain)], test,
                         paths={"/fenced"})) == [3]


@pytest.mark.database
def test_http_exception_from_a_fenced_handler_is_not_recorded(dsn):
    @fenced
    async def missing(request):
        await request["fence"].conn.fetchval(INSERT_EFFECT, "k", "e", 1)
        raise web.HTTPNotFound(text="no such case")

    async def test(client, pool):
        resp = await client.post("/m", data=b"{}", headers=fence_headers(key="job:1:m", fence=1))
        assert resp.status == 404
        assert await keys(pool, "fence_effects") == await keys(pool, "fence_requests") == []

    run(_with_app(dsn, [web.post("/m", missing)], test))


# --- run_fenced directly --------------------------------------------------------


def _fence_run(dsn: str, coro_factory):
    async def go():
        pool = await db.create_pool(dsn, 5, max_size=5)
        try:
            return await coro_factory(pool)
        finally:
            await pool.close()

    return run(go())


@pytest.mark.database
def test_run_fenced_with_a_custom_handler(dsn):
    calls: list[FencedRequest] = []

    def answering(status, body):
        async def handler(conn, request: FencedRequest):
            calls.append(request)
            await conn.fetchval(INSERT_EFFECT, request.idempotency_key, request.entity,
                                request.fence)
            return status, body
        return handler

    async def scenario(pool):
        h = {"idempotency-key": "payment:inv-7:capture", "x-execution-fence": "10"}
        first = await run_fenced(pool, h, b'{"amount": 5}', answering(201, {"captured": 5}))
        assert (first.status, first.body_json, first.replayed) == (201, {"captured": 5}, False)
        request = calls[0]
        assert (request.idempotency_key, request.fence, request.entity, request.body) == (
            "payment:inv-7:capture", 10, "payment:inv-7", b'{"amount": 5}')
        assert request.json() == {"amount": 5}
        again = await run_fenced(pool, h, b'{"amount": 5}', answering(201, {"other": 1}))
        assert (again.status, again.body_json, again.replayed) == (201, {"captured": 5}, True)
        assert len(calls) == 1

        # A 4xx answer is stored and replayed, but does not advance the fence.
        h4 = {"Idempotency-Key": "payment:inv-8:refund", "X-Execution-Fence": "50"}
        refused = await run_fenced(pool, h4, b"", answering(404, {"error": "no_invoice"}))
        assert (refused.status, refused.body_json) == (404, {"error": "no_invoice"})
        replay = await run_fenced(pool, h4, b"", answering(201, {}))
        assert (replay.status, replay.body_json, replay.replayed) == (
            404, {"error": "no_invoice"}, True)
        assert await pool.fetchval(LAST_FENCE, "payment:inv-8") is None

        # A 5xx answer is neither stored nor kept: the next try runs the handler again.
        h5 = {"Idempotency-Key": "payment:inv-9:capture", "X-Execution-Fence": "1"}
        down = await run_fenced(pool, h5, b"", answering(503, {"error": "bank_down"}))
        assert (down.status, down.body_json) == (503, {"error": "bank_down"})
        ok = await run_fenced(pool, h5, b"", answering(200, {"captured": 9}))
        assert (ok.status, ok.replayed) == (200, False)

        # Stale before replay; a bad header before anything.
        stale = await run_fenced(pool, {**h, "x-execution-fence": "9"}, b'{"amount": 5}',
                                 answering(201, {}))
        assert (stale.status, stale.body_json) == (
            409, {"error": "stale_fence", "fence": 9, "current": 10})
        bad = await run_fenced(pool, {"X-Execution-Fence": "1"}, b"", answering(201, {}))
        assert (bad.status, bad.body_json["header"]) == (400, "Idempotency-Key")

        # A handler returning something unusable is a failed handler: rolled back.
        broken = await run_fenced(pool, {"Idempotency-Key": "x:1", "X-Execution-Fence": "1"},
                                  b"", answering(201, {"not json": {1, 2}}))
        assert (broken.status, broken.body_json["error"]) == (500, "handler_failed")

    _fence_run(dsn, scenario)
    assert [(r["idempotency_key"], r["fence"]) for r in effects(dsn)] == [
        ("payment:inv-7:capture", 10), ("payment:inv-8:refund", 50), ("payment:inv-9:capture", 1)]
    assert {r[0]: r[1] for r in query(dsn, "SELECT idempotency_key, status FROM fence_requests")
            } == {"payment:inv-7:capture": 201, "payment:inv-8:refund": 404,
                  "payment:inv-9:capture": 200}


@pytest.mark.database
def test_concurrent_duplicate_waits_or_gets_in_progress(dsn):
    calls = []

    async def slow(conn, request):
        calls.append(request.idempotency_key)
        await asyncio.sleep(1.0)
        return 201, {"done": True}

    async def scenario(pool):
        headers = {"Idempotency-Key": "job:5:slow", "X-Execution-Fence": "1"}
        started = time.monotonic()
        first = asyncio.create_task(run_fenced(pool, headers, b"", slow))
        await wait_until_async(lambda: calls, what="the first request in its handler")
        impatient = await run_fenced(pool, headers, b"", slow, lock_timeout=0.2)
        assert impatient.status == 409 and impatient.body_json["error"] == "in_progress"
        patient = await run_fenced(pool, headers, b"", slow, lock_timeout=5)
        assert (await first).status == 201
        assert (patient.status, patient.body_json, patient.replayed) == (201, {"done": True}, True)
        assert time.monotonic() - started >= 1.0
        # The lock_timeout of the fence does not leak into the handler's statements: they
        # run under the pool's own session setting again (case F18: 0.5 x its 5 s bound).
        headers2 = {"Idempotency-Key": "job:6:t", "X-Execution-Fence": "1"}

        async def setting(conn, request):
            return 200, {"lock_timeout": await conn.fetchval("SHOW lock_timeout")}

        shown = await run_fenced(pool, headers2, b"", setting, lock_timeout=0.25)
        assert shown.body_json == {"lock_timeout": db.session_settings(5)["lock_timeout"]}

    _fence_run(dsn, scenario)
    assert calls == ["job:5:slow"]


@pytest.mark.e2e
@pytest.mark.server
def test_reference_receiver_takes_a_forwarded_result_of_several_mib_and_refuses_a_nul_query(
        receiver):
    import json as _json
    import urllib.error as _error
    import urllib.request as _request

    body = _json.dumps({"result": "x" * (3 * 1024 * 1024)}).encode()
    req = _request.Request(receiver.url + "/effects", method="POST", data=body, headers={
        "Content-Type": "application/json", "Idempotency-Key": "tool-job:big:result",
        "X-Execution-Fence": "1"})
    with _request.urlopen(req, timeout=10) as response:
        assert response.status == 201
    try:
        _request.urlopen(receiver.url + "/effects?entity=%00", timeout=5)
        raise AssertionError("a NUL in the entity filter must be refused")
    except _error.HTTPError as exc:
        assert exc.code == 400
