"""Hostile tests of `sidecar mcp` (issue 29): each one a promise of docs/mcp.md pushed on
by a client that misbehaves or attacks, against a real gateway process, real sidecars and
a real PostgreSQL (no mocks). Each test asserts the correct behaviour; those that say
"Was:" reproduce a defect found in commit 8bdf297, fixed since.

Raw JSON-RPC over HTTP (the 2025-11-25 revision's session, or a 2026-07-28 request) is
used where the SDK's client would refuse to send what a hostile client can."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import httpx2
import orjson
import pytest
from mcp.shared.exceptions import MCPError
from netproxy import through
from test_mcp_gateway import (  # noqa: F401 - the fixture
    ALICE,
    BOB,
    _gateway_env,
    gateway,
)

from kit import (
    TOOLS,
    base_env,
    cli,
    job_row,
    one_line_error,
    pid_alive,
    read_pids,
    scalar,
    wait_until,
)
from sidecar.mcp.tasks import TaskHandle, TasksExtension, get_task, list_tasks

pytestmark = pytest.mark.e2e

HEADERS = {"Accept": "application/json, text/event-stream",
           "Content-Type": "application/json"}
MODERN = "2026-07-28"
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {}}


def _post(g, body, token=ALICE, session=None, timeout=60, **headers):
    """One raw POST to /mcp on the 2025-11-25 revision; the httpx response."""
    sent = {**HEADERS, "Authorization": f"Bearer {token}", "MCP-Protocol-Version": "2025-11-25",
            **headers}
    if session:
        sent["Mcp-Session-Id"] = session
    data = orjson.dumps(body) if isinstance(body, dict) else body
    return httpx2.post(g.url, content=data, headers=sent, timeout=timeout)


def _answer(response) -> dict | None:
    """The JSON-RPC message of a response (a JSON body or the last SSE data line)."""
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        text = data[-1] if data else ""
    return orjson.loads(text) if text.strip() else None


def _session(g, token=ALICE) -> str:
    """A 2025-11-25 session of ``token``'s principal (initialize + initialized)."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "hostile", "version": "1"}}}
    response = _post(g, init, token=token)
    assert response.status_code == 200, response.text
    session = response.headers["mcp-session-id"]
    _post(g, {"jsonrpc": "2.0", "method": "notifications/initialized"}, token=token,
          session=session)
    return session


def _call(request_id, name, arguments, meta=None) -> dict:
    params = {"name": name, "arguments": arguments}
    if meta is not None:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


def _in_background(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# --- security: sessions ----------------------------------------------------------------

def test_another_principal_can_neither_cancel_nor_end_a_session_it_did_not_open(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """Bob, holding his own valid token and Alice's Mcp-Session-Id (it
    is in every job's `mcp.session` tag, in logs, in proxies), must be answered as for a
    session that does not exist (404). Was: the session was bound to no principal
    (BearerAuth put the principal in scope["sidecar.principal"], never in scope["user"],
    which is what the SDK's session manager compares): Bob's `notifications/cancelled`
    for Alice's request id is accepted (202) and cancels Alice's job, killing her tool's
    tree; Bob's DELETE ends Alice's session (200) and cancels her calls in flight."""
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600")
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = gateway(env=env)
    pidfile = tmp_path / "alice.pids"
    session = _session(g, ALICE)

    # Bob reads with Alice's session: refused as unknown.
    listed = _post(g, {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
                   token=BOB, session=session)
    other_status = listed.status_code

    thread, box = _in_background(lambda: _post(
        g, _call("alice-1", "hang", {"pidfile": str(pidfile), "tree": True}),
        session=session, timeout=30))
    pids = read_pids(pidfile, 4)
    cancel = _post(g, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": "alice-1", "reason": "bob"}},
                   token=BOB, session=session)
    deleted = httpx2.delete(g.url, headers={"Authorization": f"Bearer {BOB}",
                                            "Mcp-Session-Id": session,
                                            "MCP-Protocol-Version": "2025-11-25"})
    time.sleep(2)
    job = scalar(dsn, "SELECT id FROM tool_jobs WHERE tags->>'mcp.tool_call' = 'alice-1'")
    state = job_row(dsn, job)["state"]
    alive = [pid for pid in pids if pid_alive(pid)]
    # clean up Alice's hung call whatever happened
    cli(dsn, "cancel", str(job))
    thread.join(30)

    problems = []
    if other_status != 404:
        problems.append(f"bob's tools/list on alice's session: {other_status}")
    if cancel.status_code != 404:
        problems.append(f"bob's notifications/cancelled on it: {cancel.status_code}")
    if deleted.status_code != 404:
        problems.append(f"bob's DELETE of it: {deleted.status_code}")
    if state != "running" or len(alive) != 4:
        problems.append(f"alice's job is {state}, {len(alive)} of its 4 processes alive")
    assert not problems, "; ".join(problems)


# --- idempotency ------------------------------------------------------------------------

def test_a_task_call_reusing_a_plain_calls_key_is_answered_not_an_internal_error(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A client's idempotency key first used by a plain call, then by a
    call that asks for a task (the Tasks extension), joins a job that has no `mcp.task`
    tag. Was: `Gateway._task` read job.tags["mcp.task"] and raised KeyError, which the
    client saw as a bare -32603 "Internal server error" (the gateway logs `KeyError: 'mcp.task'`).
    Expected: a task handle for the job, or one clear -32602 line saying the key names a
    call that is not a task."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    meta = {"io.github.sidecar/idempotency-key": "plain-then-task"}

    async def main():
        async with g.client() as plain:
            first = await plain.call_tool("pt", {"steps": []}, meta=meta)
            assert not first.is_error
        async with g.client(extensions=[TasksExtension()]) as tasks:
            try:
                handle = await tasks.session.call_tool("pt", {"steps": []}, meta=meta,
                                                       allow_claimed=True)
            except MCPError as exc:
                return exc
            return handle

    answer = asyncio.run(main())
    if isinstance(answer, MCPError):
        assert answer.error.code != -32603 and "internal" not in str(answer).lower(), (
            f"an internal error for a reused key: {answer}")
        assert "idempotency" in str(answer).lower() or "task" in str(answer).lower()
    else:
        assert isinstance(answer, TaskHandle) and answer.status == "completed"
    assert "KeyError" not in g.log.read_text()


def test_an_idempotency_conflict_names_the_clients_own_key(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """The same `_meta` key with other arguments is a -32602 error. Was: its
    message named the gateway's internal derived key
    (`idempotency_key 'mcp:533a…' already names job …`), a value the client never sent and
    cannot match to anything; expected: the client's key (or the _meta field's name). The
    same happened on a 2025 session when a request id was reused with other arguments."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    session = _session(g)
    meta = {"io.github.sidecar/idempotency-key": "order-77"}
    first = _answer(_post(g, _call("c1", "pt", {"steps": []}, meta), session=session))
    assert "result" in first, first
    conflict = _answer(_post(g, _call("c2", "pt", {"steps": [], "exit": 2}, meta),
                             session=session))
    assert conflict["error"]["code"] == -32602, conflict
    message = conflict["error"]["message"]
    assert "\n" not in message
    assert "order-77" in message or "io.github.sidecar/idempotency-key" in message, message
    assert "mcp:" not in message, f"the internal key leaks into the message: {message}"


# --- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("request_id", ["", "\t", "line\nbreak", "a\u0000b"])
def test_any_legal_json_rpc_request_id_is_served(
        dsn, sidecars, gateway, tmp_path, request_id):  # noqa: F811 - the fixture
    """JSON-RPC allows any string as a request id. Was: the gateway copied the
    id into the job's `mcp.tool_call` tag, whose values must be 1-256 printable
    characters, so a call whose id is "", or holds a tab, a newline or a NUL, was refused
    with `--tag mcp.tool_call: the value must be 1-256 printable characters of valid
    UTF-8`: a message about a command-line flag the client never used, for a request
    that is valid. Expected: the call is served (the id stored escaped or not at all)."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    session = _session(g)
    answer = _answer(_post(g, _call(request_id, "pt", {"steps": []}), session=session))
    assert answer["id"] == request_id
    assert "error" not in answer, answer["error"]["message"]
    assert answer["result"]["structuredContent"] == {"done": True, "statuses": []}


@pytest.mark.parametrize("params, what", [
    ({"name": "pt", "arguments": [1, 2]}, "arguments"),
    ({"name": "pt", "arguments": "steps"}, "arguments"),
    ({"name": "pt", "arguments": 5}, "arguments"),
    ({"name": None, "arguments": {}}, "name"),
    ({"name": "pt", "arguments": {}, "_meta": {"progressToken": {"a": 1}}}, "progressToken"),
    ({"name": "pt", "arguments": {}, "_meta": []}, "_meta"),
])
def test_malformed_call_params_get_one_message_naming_the_field(
        dsn, gateway, tmp_path, params, what):  # noqa: F811 - the fixture
    """Non-object `arguments`, a non-string tool name, a progressToken
    or `_meta` of the wrong type: the answer is -32602 with nothing written. Was: its
    message was only "Invalid request parameters" with `data: ""`, naming nothing.
    docs/mcp.md: bad input is a JSON-RPC error with one clear line naming what is
    wrong (as the schema check does: `pt: $.steps: 5 is not of type 'array'`)."""
    g = gateway()
    session = _session(g)
    answer = _answer(_post(g, {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                               "params": params}, session=session))
    assert answer["error"]["code"] == -32602, answer
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0
    said = answer["error"]["message"] + " " + str(answer["error"].get("data") or "")
    assert what in said, f"the error names nothing: {answer['error']}"


@pytest.mark.parametrize("raw, expected", [
    ('{"x": NaN}', "NaN"),
    ('{"x": -Infinity}', "NaN"),
    ('{"x": 1e-20000}', "jsonb"),  # issue 41: was read as 0.0; 1e400 is kept exactly now
    ('{"x": "a\\u0000b"}', "jsonb"),
])
def test_values_json_cannot_store_are_clear_errors_with_nothing_written(
        dsn, gateway, tmp_path, raw, expected):  # noqa: F811 - the fixture
    """Holds on 8bdf297: NaN/Infinity literals and NUL in the raw body are one -32602 line
    each, and no job is written; so is a number jsonb cannot store (issue 41, point 16:
    the SDK read 1e-20000 as 0.0 and 1e400 as infinity; the gateway reads the body exactly,
    and 1e400, which jsonb stores, reaches the job: tests/test_mcp_wire.py)."""
    g = gateway()
    session = _session(g)
    body = ('{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"hang",'
            f'"arguments":{raw}}}}}').encode()
    answer = _answer(_post(g, body, session=session))
    assert answer["error"]["code"] == -32602 and expected in answer["error"]["message"]
    assert "\n" not in answer["error"]["message"]
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0


def test_deep_nesting_and_oversized_bodies_are_refused_at_once(
        dsn, gateway, tmp_path):  # noqa: F811 - the fixture
    """Holds on 8bdf297: 10,000 levels of nesting is a -32700 parse error; a body past
    --max-request-bytes is 413, with a Content-Length or chunked; nothing is written."""
    g = gateway()
    session = _session(g)
    deep = ('{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"hang",'
            '"arguments":{"x":' + "[" * 10_000 + "]" * 10_000 + "}}}").encode()
    answer = _answer(_post(g, deep, session=session))
    assert answer["error"]["code"] == -32700
    big = b'{"a":"' + b"x" * (1024 * 1024 + 10) + b'"}'
    assert _post(g, big, session=session).status_code == 413

    def chunks():
        yield b'{"a":"'
        for _ in range(20):
            yield b"x" * 100_000
        yield b'"}'

    assert _post(g, chunks(), session=session).status_code == 413
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0


# --- tasks -------------------------------------------------------------------------------

def test_tasks_list_shows_the_newest_tasks_however_many_plain_calls_came_after(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """docs/mcp.md: tasks/list is "the principal's newest 100 tasks".
    Was: it read the principal's newest 100 *jobs* and dropped those that were not tasks,
    so a task followed by 100 plain calls of the same principal disappeared from
    tasks/list although tasks/get still found it."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()

    async def main():
        async with g.client(extensions=[TasksExtension()]) as tasks:
            handle = await tasks.session.call_tool("pt", {"steps": []}, allow_claimed=True)
        async with g.client() as plain:
            for start in range(0, 100, 25):
                await asyncio.gather(*(plain.call_tool("pt", {"steps": []})
                                       for _ in range(start, start + 25)))
        async with g.client(extensions=[TasksExtension()]) as tasks:
            return handle.task_id, await list_tasks(tasks.session)

    task_id, listed = asyncio.run(main())
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 101
    assert [t["taskId"] for t in listed] == [task_id]


# --- lifecycle -------------------------------------------------------------------------

def test_sigterm_leaves_calls_in_flight_running_and_a_modern_disconnect_cancels(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """Holds on 8bdf297: SIGTERM of the gateway during a 2025-session call leaves the job
    running (its tree alive); a 2026-07-28 request whose client closes the response
    stream cancels its job and the tree dies."""
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600")
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = gateway(env=env)
    kept = tmp_path / "kept.pids"
    session = _session(g)
    thread, _ = _in_background(lambda: _post(
        g, _call("kept", "hang", {"pidfile": str(kept), "tree": True}), session=session,
        timeout=30))
    kept_pids = read_pids(kept, 4)
    g.stop()  # SIGTERM
    thread.join(30)
    kept_job = scalar(dsn, "SELECT id FROM tool_jobs WHERE tags->>'mcp.tool_call' = 'kept'")
    assert job_row(dsn, kept_job)["state"] == "running"
    assert all(pid_alive(pid) for pid in kept_pids)

    g2 = gateway(env=env)
    gone = tmp_path / "gone.pids"
    headers = {**HEADERS, "Authorization": f"Bearer {ALICE}", "MCP-Protocol-Version": MODERN,
               "Mcp-Method": "tools/call", "Mcp-Name": "hang"}
    body = orjson.dumps({"jsonrpc": "2.0", "id": "gone", "method": "tools/call", "params": {
        "name": "hang", "arguments": {"pidfile": str(gone), "tree": True},
        "_meta": ENVELOPE}})
    with httpx2.Client(timeout=30) as http, \
            http.stream("POST", g2.url, headers=headers, content=body) as response:
        assert response.status_code == 200
        gone_pids = read_pids(gone, 4)
    gone_job = scalar(dsn, "SELECT id FROM tool_jobs WHERE tags->>'mcp.tool_call' = 'gone'")
    wait_until(lambda: job_row(dsn, gone_job)["state"] == "cancelled", 10,
               what="the disconnected request's job to be cancelled")
    for pid in gone_pids:
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"pid {pid} to die")
    cli(dsn, "cancel", str(kept_job))


def test_the_database_going_away_mid_call_is_a_clear_error_then_recovery(
        dsn, proxy, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """The gateway reaches PostgreSQL through a proxy (the sidecar does
    not). While a call waits for its job, the gateway's path is blackholed for 15 s; the
    job ends meanwhile. Expected: a call made during the outage ends within a bound as
    an error (never hangs), and once the path is back the waiting call ends with the
    job's result (or a clear error) and new calls work, without restarting the gateway.
    Was: the waiting call never answered (still hung 45 s after the restore, though
    its job succeeded 60 s before)."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    release = tmp_path / "release"
    g = gateway(env=base_env(through(dsn, proxy.port),
                             **{k: v for k, v in env.items() if k.startswith("SIDECAR_")
                                and k != "SIDECAR_DATABASE_URL"}))
    session = _session(g)
    waiting, box = _in_background(lambda: _post(
        g, _call("during", "pt", {"steps": [{"wait_for": str(release)}]}), session=session,
        timeout=150))
    wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE state = 'running'")
               == 1, 20, what="the call's job to run")
    proxy.blackhole()
    release.touch()  # the job ends while the gateway cannot see the database
    started = time.monotonic()
    fresh, fresh_box = _in_background(lambda: _post(
        g, _call("fresh", "pt", {"steps": []}), session=session, timeout=120))
    fresh.join(30)
    fresh_took = time.monotonic() - started
    time.sleep(max(0.0, 40 - fresh_took))
    proxy.restore()
    # Bounded, not fast: the watch notices the dead path at its next check (every
    # CHECK_SECONDS without a notification) and reconnects; a connect begun during the
    # outage times out first. 45 s was passed by a loaded machine (full suite beside three
    # other test runs), with the job done: a hang is forever, so 90 s tells one apart.
    waiting.join(90)
    problems = []
    job = scalar(dsn, "SELECT state FROM tool_jobs WHERE tags->>'mcp.tool_call' = 'during'")
    if fresh.is_alive():
        problems.append(f"a call made during the outage hung {fresh_took:.0f}s")
    elif "value" in fresh_box and not _answer(fresh_box["value"]):
        problems.append("a call made during the outage got an empty answer")
    if waiting.is_alive():
        problems.append(f"the waiting call still hangs 90s after the restore (its job: {job})")
    elif "value" in box and not _answer(box["value"]):
        problems.append(f"the waiting call got an empty answer (its job: {job})")
    elif "error" in box:  # the client gave up: no answer came
        problems.append(f"the waiting call failed: {box['error']!r} (its job: {job})")
    try:
        after = _answer(_post(g, _call("after", "pt", {"steps": []}), session=session,
                              timeout=30))
        if not after or after.get("result", {}).get("isError") is not False:
            problems.append(f"a call after the restore: {after}")
    except httpx2.HTTPError as exc:
        problems.append(f"a call after the restore: {exc!r}")
    assert not problems, "; ".join(problems)


# --- forged mcp.* tags and mcp: keys (issue 41 point 2) -------------------------------

def _plant(dsn, tags, key=None):
    """A job of `pt` written around the gateway by another producer: sidecar_enqueue, the
    SQL function any caller may run, with the gateway's tag names (and key)."""
    return scalar(dsn, "SELECT sidecar_enqueue('pt', '{\"steps\": []}', "
                  "idempotency_key => $1, tags => $2::jsonb)", key, tags)


def test_a_task_planted_in_another_principals_name_is_neither_listed_nor_counted(
        dsn, gateway, tmp_path):  # noqa: F811 - the fixture
    """Any producer may write tags. Was: two jobs tagged mcp.principal=bob, mcp.kind=task,
    mcp.task=... showed in bob's tasks/list, tasks/get found them, and with
    --max-tasks-per-principal 2 bob's own task call was refused. Expected: the gateway
    trusts only the mcp.* tags it signed (docs/mcp.md, Security)."""
    planted = ["p" * 32, "q" * 32]
    for task_id in planted:
        _plant(dsn, {"mcp.principal": "bob", "mcp.kind": "task", "mcp.task": task_id,
                     "mcp.tool_call": "x", "mcp.sig": "0" * 64})
    g = gateway("--max-tasks-per-principal", "2")

    async def main():
        async with g.client(BOB, extensions=[TasksExtension()]) as bob:
            handle = await bob.session.call_tool("pt", {"steps": []}, allow_claimed=True)
            listed = await list_tasks(bob.session)
            with pytest.raises(MCPError, match="no task"):
                await get_task(bob.session, planted[0])
            return handle, listed

    handle, listed = asyncio.run(main())
    assert isinstance(handle, TaskHandle)
    assert [t["taskId"] for t in listed] == [handle.task_id]


def test_a_job_planted_under_a_principals_derived_key_is_not_joined(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """Was: the gateway's key of bob's `_meta` key k was mcp:sha256(["bob", "k"]), which
    anyone can compute: a job planted under it (same tool and arguments) was the one
    bob's call joined, so bob got the planter's job. Expected: bob's call gets its own
    job (the key is an HMAC under the gateway's secret)."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    old_key = "mcp:" + hashlib.sha256(orjson.dumps(["bob", "order-7"])).hexdigest()
    planted = _plant(dsn, {"mcp.principal": "bob", "mcp.tool_call": "1"}, key=old_key)
    g = gateway()

    async def main():
        async with g.client(BOB) as bob:
            return await bob.call_tool(
                "pt", {"steps": []}, meta={"io.github.sidecar/idempotency-key": "order-7"})

    result = asyncio.run(main())
    joined = result.meta["io.github.sidecar/job"]["id"]
    assert joined != str(planted)
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 2


def test_the_cli_refuses_the_gateways_tags_and_keys_in_one_line(dsn):
    """`sidecar enqueue --tag mcp.x=y` (or `--idempotency-key mcp:...`) is refused, exit
    2, one line naming the option and the reserved prefix; nothing is written."""
    for args, named in ((["--tag", "mcp.principal=bob"], "--tag mcp.principal"),
                        (["--idempotency-key", "mcp:abc"], "--idempotency-key")):
        done = cli(dsn, "enqueue", "pt", *args)
        assert done.returncode == 2, done.stderr.decode()
        line = one_line_error(done, no_stdout=True)
        assert named in line and "reserved for sidecar mcp" in line, line
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0
