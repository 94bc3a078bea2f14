"""The MCP edge keeps what the sidecar keeps inside (issue 41): exact numbers both ways
through `sidecar mcp` (case F11), progress that only grows across a retried attempt, a
cancel described as the MCP client's; sessions any replica serves; SSE streams that can be
resumed from the job."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import re
import urllib.parse

import httpx2
import orjson
import pytest
from test_mcp_gateway import ALICE, BOB, _gateway_env, gateway  # noqa: F401 - the fixture

from kit import TOOLS, admin, job_row, query, read_pids, scalar, wait_until
from sidecar.mcp import wire
from sidecar.mcp.tasks import TasksExtension, get_task
from sidecar.protocol import jsontext, masking

BIG = 2 ** 70
LONG = "0.1000000000000000000000001"
HEADERS = {"Accept": "application/json, text/event-stream",
           "Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"}


def _echo_env(dsn, tmp_path, **extra):
    return _gateway_env(dsn, tmp_path,
                        SIDECAR_PROFILE_ECHO_MCP_DESCRIPTION="Returns its arguments.", **extra)


def _sse_messages(text: str) -> list[bytes]:
    return [line[5:].strip().encode() for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip()]


def _initialize(url: str, version: str = "2025-11-25") -> dict[str, str]:
    """A 2025-revision session opened with raw HTTP: the headers of its next requests."""
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {},
        "clientInfo": {"name": "wire-test", "version": "1"}}}
    answer = httpx2.post(url, json=init, headers=HEADERS, timeout=30)
    assert answer.status_code == 200, answer.text
    headers = {**HEADERS, "Mcp-Session-Id": answer.headers["mcp-session-id"],
               "MCP-Protocol-Version": version}
    done = httpx2.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                       headers=headers, timeout=30)
    assert done.status_code == 202, done.text
    return headers


@pytest.mark.e2e
@pytest.mark.server
def test_exact_numbers_cross_the_mcp_edge_both_ways(dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """An integer of 2**70 and a decimal no double holds, sent as raw JSON, reach the job's
    payload digit for digit, and come back in the result's JSON (text and structured
    content) as the same bare numbers; the SDK's client reads them, and a task of it is
    readable with them."""
    env = _echo_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "echo_payload.py")], "--tool", "echo", env=env)
    g = gateway("--tool", "echo", env=env)
    headers = _initialize(g.url)
    call = (b'{"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "echo", '
            b'"arguments": {"big": ' + str(BIG).encode() + b', "long": ' + LONG.encode()
            + b', "list": [' + LONG.encode() + b'], "huge": 1e400}}}')
    answer = httpx2.post(g.url, content=call, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    [message] = [m for m in _sse_messages(answer.text) if b'"result"' in m]
    result = jsontext.loads(message)["result"]
    assert not result.get("isError"), result
    exact = {"big": BIG, "long": jsontext.ExactNumber(LONG),
             "list": [jsontext.ExactNumber(LONG)], "huge": jsontext.ExactNumber("1e400")}
    assert result["structuredContent"] == exact
    assert jsontext.loads(result["content"][0]["text"]) == exact
    assert b'"long":' + LONG.encode() in message  # a bare number, not a string
    job = result["_meta"]["io.github.sidecar/job"]["id"]
    assert LONG in scalar(dsn, "SELECT payload::text FROM tool_jobs WHERE id = $1::uuid", job)

    async def with_the_sdk():
        async with g.client() as client:
            plain = await client.call_tool("echo", {"big": BIG})
            assert plain.structured_content == {"big": BIG}
        async with g.client(extensions=[TasksExtension()]) as client:
            handle = await client.session.call_tool("echo", {"big": BIG}, allow_claimed=True)
            for _ in range(200):
                task = await get_task(client.session, handle.task_id)
                if task["status"] == "completed":
                    return task
                await asyncio.sleep(0.05)
            raise AssertionError(f"the task did not complete: {task}")

    task = asyncio.run(with_the_sdk())
    assert task["result"]["structuredContent"] == {"big": BIG}
    assert jsontext.loads(task["result"]["content"][0]["text"]) == {"big": BIG}


@pytest.mark.e2e
@pytest.mark.server
def test_progress_only_grows_across_a_retried_attempt(dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A tool that reports 0.5, fails its first attempt and reports 0.5 again in the
    second: every progress the client sees is larger than the one before."""
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_PT_MAX_ATTEMPTS="2")
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway(env=env)
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress, total, message):
        seen.append((progress, total, message))

    async def main():
        async with g.client() as client:
            return await client.call_tool(
                "pt", {"steps": [{"http": {"progress": 0.5, "message": "half"}},
                                 {"sleep": 1}, {"fail_in_attempt": 1},
                                 {"http": {"progress": 0.75, "message": "more"}},
                                 {"sleep": 1}]},
                progress_callback=on_progress)

    result = asyncio.run(main())
    assert not result.is_error and result.meta["io.github.sidecar/job"]["attempt"] == 2
    progress = [p for p, _, _ in seen]
    assert progress == sorted(set(progress)), seen
    assert (1.5, 2.0, "half") in seen and (1.75, 2.0, "more") in seen, seen


@pytest.mark.unit
def test_progress_clock_is_strictly_increasing():
    """Attempt n maps v to (n - 1) + v of n; a count without values; never back."""
    clock = wire.ProgressClock()
    assert clock.next(0.5, 1) == (0.5, 1.0)
    assert clock.next(0.5, 1) == (math.nextafter(0.5, math.inf), 1.0)
    assert clock.next(0.25, 2) == (1.25, 2.0)
    assert clock.next(0.1, 2)[0] > 1.25
    counted = wire.ProgressClock()
    assert [counted.next(None, 1)[0] for _ in range(3)] == [1.0, 2.0, 3.0]


@pytest.mark.unit
def test_marks_restore_exact_numbers_and_nothing_else():
    """Marked numbers become bare numbers in the JSON text; a tool's string that looks
    like a mark (without the process's nonce) stays a string."""
    marks = wire.Marks()
    value = {"n": jsontext.ExactNumber(LONG), "s": "sidecar-exact-number-feed:1;",
             "l": [jsontext.ExactNumber("-1e400")]}
    body = orjson.dumps(marks.encode(value))
    restored = marks.restore(body)
    assert restored == (b'{"n":' + LONG.encode() + b',"s":"sidecar-exact-number-feed:1;",'
                        b'"l":[-1e400]}')
    assert wire.plain({"n": jsontext.ExactNumber(str(BIG))}) == {"n": BIG}


@pytest.mark.e2e
@pytest.mark.server
def test_a_job_cancelled_by_its_mcp_client_says_so(dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A request the client cancels ends its job with "cancelled by its MCP client", and
    the journal says which principal's gateway asked."""
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600")
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = gateway(env=env)
    pidfile = tmp_path / "hang.pids"

    async def main():
        async with g.client() as client:
            call = asyncio.create_task(
                client.call_tool("hang", {"pidfile": str(pidfile), "tree": True}))
            await asyncio.to_thread(read_pids, pidfile, 4)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0.5)  # the client's session stays open meanwhile

    asyncio.run(main())
    job = scalar(dsn, "SELECT id FROM tool_jobs")
    wait_until(lambda: job_row(dsn, job)["state"] == "cancelled", 10,
               what="the job to be cancelled")
    assert job_row(dsn, job)["error"]["message"] == "cancelled by its MCP client"
    [by] = [r[0] for r in query(dsn, "SELECT details->>'by' FROM tool_job_events "
                                     "WHERE event = 'job_cancelled'")]
    assert by == "sidecar mcp (alice)"


def _call(url: str, headers: dict[str, str], request_id: int, arguments: dict) -> dict:
    """One tools/call of pt on a session (raw HTTP); the JSON-RPC answer."""
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": "pt", "arguments": arguments}}
    answer = httpx2.post(url, json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, (answer.status_code, answer.text)
    [message] = [m for m in _sse_messages(answer.text) if b'"id"' in m]
    return orjson.loads(message)


@pytest.mark.e2e
@pytest.mark.server
def test_a_session_is_served_by_every_replica_and_after_a_restart(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A 2025-revision session opened on one gateway is served by a second one on the same
    database, and by a gateway started after the first stopped; another principal's token
    with its id is answered as an unknown session; a DELETE ends it on every replica."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    first, second = gateway(), gateway()
    headers = _initialize(first.url)
    session = headers["Mcp-Session-Id"]
    on_second = _call(second.url, headers, 2, {"steps": []})
    assert on_second["result"]["structuredContent"]["done"] is True, on_second
    job = on_second["result"]["_meta"]["io.github.sidecar/job"]["id"]
    assert job_row(dsn, job)["tags"]["mcp.session"] == session
    first.stop()
    restarted = gateway()
    again = _call(restarted.url, headers, 2, {"steps": []})  # the retry joins the job
    assert again["result"]["_meta"]["io.github.sidecar/job"]["id"] == job
    bob = {**headers, "Authorization": f"Bearer {BOB}"}
    assert httpx2.post(restarted.url, headers=bob, timeout=30, json={
        "jsonrpc": "2.0", "id": 3, "method": "tools/list"}).status_code == 404
    assert scalar(dsn, "SELECT principal FROM sidecar_mcp_sessions WHERE id = $1",
                  session) == "alice"
    assert httpx2.delete(second.url, headers=headers, timeout=30).status_code == 200
    assert scalar(dsn, "SELECT count(*) FROM sidecar_mcp_sessions") == 0
    third = gateway()
    assert httpx2.post(third.url, headers=headers, timeout=30, json={
        "jsonrpc": "2.0", "id": 4, "method": "tools/list"}).status_code == 404


@pytest.mark.unit
def test_database_whereabouts_are_masked_in_caller_errors():
    """Host, port, user and database name of the DSN, what a driver quotes and any IP
    address become ***; times and ids stay."""
    dsn = "postgresql://app:pw@db.internal:6432/jobs?sslmode=require"
    text = ('connection to server at "db.internal" (10.1.2.3), port 6432 failed: FATAL: '
            'password authentication failed for user "app"; database "jobs" does not '
            "exist; Connect call failed ('::1', 6432, 0, 0) at 10:30:45, job "
            "12345678-aaaa-bbbb-cccc-123456789012")
    masked = masking.mask_database(text, [dsn])
    for secret in ("db.internal", "10.1.2.3", "6432", '"app"', '"jobs"', "::1", "pw"):
        assert secret not in masked, masked
    assert "10:30:45" in masked and "12345678-aaaa-bbbb-cccc-123456789012" in masked
    unreachable = masking.mask_database(  # sidecar.storage.db's DatabaseUnavailable
        "cannot reach PostgreSQL at db.internal:6432/jobs (postgresql://app:***@db.internal:"
        "6432/jobs?sslmode=require): timeout", [dsn])
    assert not {"db.internal", "6432", "jobs", "app"} & set(re.split(r"[^\w.]", unreachable))
    assert masking.database_names("host=/run/pg port=5433 user=ops dbname=q") == \
        ["/run/pg", "5433", "ops", "q"]


@pytest.mark.e2e
@pytest.mark.server
def test_errors_sent_to_mcp_callers_do_not_say_where_the_database_is(
        dsn, server_dsn, gateway, tmp_path):  # noqa: F811 - the fixture
    """With its database gone, a call's error names neither the database's host, port,
    user nor its name."""
    g = gateway()
    headers = _initialize(g.url)
    # the database's name and where it is: a host and port, or the embedded server's socket
    parts = urllib.parse.urlsplit(dsn)
    name = parts.path.lstrip("/")
    where = [w for w in (parts.hostname, str(parts.port or ""),
                         *urllib.parse.parse_qs(parts.query).get("host", [])) if w]
    admin(server_dsn, f'DROP DATABASE "{name}" WITH (FORCE)')
    answer = _answer_of(httpx2.post(g.url, headers=headers, timeout=60, json={
        "jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "pt", "arguments": {"steps": []}}}))
    message = answer["error"]["message"]
    assert "database" in message, answer
    for word in (name, *where, '"postgres"'):
        assert word not in message, message


def _answer_of(response) -> dict:
    assert response.status_code == 200, response.text
    [message] = [m for m in _sse_messages(response.text) if b'"id"' in m]
    return orjson.loads(message)


@pytest.mark.e2e
@pytest.mark.server
def test_a_tasks_last_update_follows_its_progress(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A running task's lastUpdatedAt is its last progress report's time, not its claim's."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    release = tmp_path / "release"

    async def main():
        async with g.client(extensions=[TasksExtension()]) as client:
            handle = await client.session.call_tool(
                "pt", {"steps": [{"sleep": 0.5}, {"http": {"progress": 0.5, "message": "half"}},
                                 {"wait_for": str(release)}]}, allow_claimed=True)
            for _ in range(200):
                task = await get_task(client.session, handle.task_id)
                if task.get("statusMessage", "").endswith("half"):
                    return task
                await asyncio.sleep(0.05)
            raise AssertionError(f"no progress: {task}")

    try:
        task = asyncio.run(main())
    finally:
        release.touch()
    claimed, reported = query(dsn, "SELECT first_claimed_at, (progress->>'at')::timestamptz "
                                   "FROM tool_jobs")[0]
    updated = dt.datetime.fromisoformat(task["lastUpdatedAt"].replace("Z", "+00:00"))
    assert updated == reported > claimed, (task, claimed, reported)


def _events(lines):
    """SSE events from an iterator of lines, as dicts of their fields, until it ends."""
    event: dict[str, str] = {}
    for line in lines:
        if line == "":
            if event:
                yield event
            event = {}
            continue
        field, _, value = line.partition(":")
        event[field] = value[1:] if value.startswith(" ") else value


@pytest.mark.e2e
@pytest.mark.server
def test_a_dropped_stream_is_resumed_from_the_job_on_another_replica(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A tools/call's SSE stream opens with a priming event (an id, empty data) and a
    retry field; the client drops it; a GET with Last-Event-ID to another replica gets
    the call's result, every event with an id, and the tool ran once."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    first, second = gateway(), gateway()
    headers = _initialize(first.url)
    release = tmp_path / "release"
    call = {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
            "params": {"name": "pt", "arguments": {"steps": [{"wait_for": str(release)}]}}}
    with httpx2.stream("POST", first.url, json=call, headers=headers, timeout=30) as stream:
        assert stream.status_code == 200
        priming = next(_events(stream.iter_lines()))
    assert priming.get("id") and priming.get("data", "") == "" and priming.get("retry"), priming
    wait_until(lambda: scalar(dsn, "SELECT state FROM tool_jobs") == "running", 20,
               what="the call's job to run")
    release.touch()
    resume = {**headers, "Accept": "text/event-stream", "Last-Event-ID": priming["id"]}
    with httpx2.stream("GET", second.url, headers=resume, timeout=60) as stream:
        assert stream.status_code == 200, stream.read()
        events = list(_events(stream.iter_lines()))
    assert events and all(e.get("id") for e in events), events
    [answer] = [orjson.loads(e["data"]) for e in events if e.get("data")]
    assert answer["id"] == 5 and answer["result"]["structuredContent"]["done"] is True, answer
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_claimed'") == 1


@pytest.mark.e2e
@pytest.mark.server
def test_a_task_nobody_polls_any_more_stops_and_one_still_polled_runs_on(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """Issue 44, point 2: an MCP call belongs to an interest its client renews by its
    signs (here: polling its task). Two tasks run; the client keeps polling one and walks
    away from the other: after --interest-ttl the abandoned one is cancelled through the
    fenced path (kind abandoned_by_caller, its tree killed), the polled one runs on."""
    env = _gateway_env(dsn, tmp_path, SIDECAR_POLL_SECONDS="0.5")
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", "--concurrency", "2",
             env=env)
    g = gateway("--interest-ttl", "2s")
    release = tmp_path / "release"

    async def main():
        async with g.client(extensions=[TasksExtension()]) as client:
            kept = await client.session.call_tool(
                "pt", {"steps": [{"wait_for": str(release)}]}, allow_claimed=True)
            left = await client.session.call_tool(
                "pt", {"steps": [{"wait_for": str(release)}]}, allow_claimed=True)
            ids = {}
            for handle, name in ((kept, "kept"), (left, "left")):
                ids[name] = (await get_task(client.session, handle.task_id))["taskId"]
            jobs = {}
            for name, task in ids.items():
                rows = await asyncio.to_thread(
                    query, dsn, "SELECT id FROM tool_jobs WHERE tags->>'mcp.task' = $1", task)
                jobs[name] = rows[0]["id"]
            for _ in range(60):  # 6 s or more: three times the ttl, polling one task only
                await get_task(client.session, kept.task_id)
                left = await asyncio.to_thread(job_row, dsn, jobs["left"])
                if left["state"] == "cancelled":
                    break
                await asyncio.sleep(0.1)
            kept_task = await get_task(client.session, kept.task_id)
            return jobs, kept_task

    try:
        jobs, kept_task = asyncio.run(main())
    finally:
        release.touch()
    left = job_row(dsn, jobs["left"])
    assert left["state"] == "cancelled" and left["error"]["kind"] == "abandoned_by_caller"
    assert kept_task["status"] == "working", kept_task
    wait_until(lambda: job_row(dsn, jobs["kept"])["state"] == "succeeded", 60,
               what="the polled task's job")
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'interest_lapsed' "
                       "AND job_id = $1", jobs["left"]) == 1
