"""`sidecar mcp` (issue 29), end to end with the official MCP SDK's client against a real
gateway process, real sidecars and a real PostgreSQL: tools listed from their profiles
(and no other), a call that succeeds (a job row tagged with the principal), one that
fails, one whose tool hangs past its stage deadline, progress notifications during a
long call, a cancelled request killing the tool's tree, arguments refused by the schema,
a client's idempotency key scoped to its principal, the per-principal bound, stdio; and
refused: no token, a wrong token, a foreign Origin, a bad setting (one line, exit 2)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx2
import orjson
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from kit import (
    TOOLS,
    base_env,
    cli,
    free_port,
    job_row,
    one_line_error,
    pid_alive,
    read_pids,
    scalar,
    stop_process,
    wait_until,
)
from sidecar.mcp import catalog as mcp_catalog
from sidecar.protocol.errors import ConfigError

EXAMPLES = Path(__file__).parents[1] / "examples"
ALICE = "a" * 40
BOB = "b" * 40
SCHEMA = {
    "type": "object",
    "properties": {"steps": {"type": "array"}, "exit": {"type": "integer"}},
    "additionalProperties": False,
}


def _gateway_env(dsn: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# principals\nalice {ALICE}\nbob {BOB}\n")
    schema = tmp_path / "pt.schema.json"
    schema.write_bytes(orjson.dumps(SCHEMA))
    settings = dict(
        SIDECAR_MCP_TOKEN_FILE=str(tokens),
        SIDECAR_PROFILE_PT_MCP_DESCRIPTION="Runs progress steps, then prints done.",
        SIDECAR_PROFILE_PT_MCP_INPUT_SCHEMA_FILE=str(schema),
        SIDECAR_PROFILE_PT_MAX_ATTEMPTS="1",
        SIDECAR_PROFILE_HANG_MCP_DESCRIPTION="Hangs, with a tree, ignoring SIGTERM.",
        SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="1",
        SIDECAR_PROFILE_HANG_MAX_ATTEMPTS="1")
    return base_env(dsn, **{**settings, **extra})


class Gateway:
    """A `sidecar mcp --listen` process on a free loopback port."""

    def __init__(self, dsn: str, tmp_path: Path, *options: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = tmp_path / f"mcp-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "mcp", "--listen", f"127.0.0.1:{self.port}",
             "--tool", "pt", "--tool", "hang", *options],
            env=env or _gateway_env(dsn, tmp_path), stdout=subprocess.DEVNULL,
            stderr=self._log)
        wait_until(self._live, 30, what=f"sidecar mcp to serve /livez ({self.log})")

    def _live(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx2.get(f"http://127.0.0.1:{self.port}/livez", timeout=1).status_code \
                == 200
        except httpx2.HTTPError:
            return False

    def client(self, token: str = ALICE, **options) -> Client:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        return Client(streamable_http_client(self.url, http_client=http), **options)

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()


@pytest.fixture
def gateway(dsn, tmp_path):
    started: list[Gateway] = []

    def start(*options: str, env: dict | None = None) -> Gateway:
        started.append(Gateway(dsn, tmp_path, *options, env=env))
        return started[-1]

    yield start
    for g in started:
        g.stop()


def _run(coro):
    return asyncio.run(coro)


def _job_id(result) -> str:
    return result.meta[mcp_catalog_job_meta()]["id"]


def mcp_catalog_job_meta() -> str:
    from sidecar.mcp.gateway import JOB_META

    return JOB_META


@pytest.mark.e2e
@pytest.mark.server
def test_calls_are_jobs_success_failure_deadline_and_only_given_tools(dsn, sidecars,
                                                                       gateway, tmp_path):
    """tools/list shows exactly the --tool tools with their descriptions and schemas; a
    call that succeeds returns the tool's JSON (text and structured) and is a job row
    tagged with the principal; a failing tool is isError with its kind; a tool hung past
    its stage deadline is isError stage_timeout and its tree is dead."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = gateway()
    pidfile = tmp_path / "hang.pids"

    async def main():
        async with g.client() as client:
            listed = await client.list_tools()
            tools = {t.name: t for t in listed.tools}
            assert set(tools) == {"pt", "hang"}
            assert tools["pt"].description == "Runs progress steps, then prints done."
            assert tools["pt"].input_schema == SCHEMA
            assert tools["hang"].input_schema == {"type": "object"}

            ok = await client.call_tool("pt", {"steps": []})
            assert not ok.is_error
            assert ok.structured_content == {"done": True, "statuses": []}
            assert orjson.loads(ok.content[0].text) == {"done": True, "statuses": []}
            failed = await client.call_tool("pt", {"steps": [], "exit": 3})
            assert failed.is_error
            assert failed.structured_content["state"] == "failed"
            hung = await client.call_tool("hang", {"pidfile": str(pidfile), "tree": True})
            assert hung.is_error
            assert hung.structured_content["error"]["kind"] == "stage_timeout"
            return _job_id(ok), _job_id(failed), _job_id(hung)

    ok_id, failed_id, hung_id = _run(main())
    row = job_row(dsn, ok_id)
    assert (row["tool"], row["state"], row["tags"]["mcp.principal"]) == ("pt", "succeeded",
                                                                          "alice")
    assert row["tags"]["mcp.tool_call"]
    assert job_row(dsn, failed_id)["state"] == "failed"
    assert job_row(dsn, hung_id)["error"]["kind"] == "stage_timeout"
    for pid in read_pids(pidfile, 4):
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"hung tool pid {pid} to die")

    # The example client: the result on stdout (exit 0), a failed job's error (exit 3).
    example = [sys.executable, str(EXAMPLES / "mcp_client.py"), "pt"]
    example_env = {**os.environ, "MCP_URL": g.url, "MCP_TOKEN": BOB}
    done = subprocess.run([*example, '{"steps": []}'], env=example_env, capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout) == {"done": True, "statuses": []}
    done = subprocess.run([*example, '{"steps": [], "exit": 3}'], env=example_env,
                          capture_output=True, timeout=60)
    assert done.returncode == 3 and b"pt failed (job " in done.stderr, done.stderr.decode()
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE tags->>'mcp.principal' = 'bob'") \
        == 2


@pytest.mark.e2e
@pytest.mark.server
def test_progress_notifications_during_a_long_call(dsn, sidecars, gateway, tmp_path):
    """The tool's progress reports reach the client as notifications/progress while the
    call is still running (the client sent a progress token)."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    seen: list[tuple[float, float | None, str | None, float]] = []

    async def on_progress(progress, total, message):
        seen.append((progress, total, message, time.monotonic()))

    async def main():
        async with g.client() as client:
            result = await client.call_tool(
                "pt", {"steps": [{"http": {"progress": 0.25, "message": "first"}},
                                 {"sleep": 1.5},
                                 {"http": {"progress": 0.75, "message": "second"}},
                                 {"sleep": 1.5}]},
                progress_callback=on_progress)
            return result, time.monotonic()

    result, ended = _run(main())
    assert not result.is_error
    assert [(p, t, m) for p, t, m, _ in seen] == [(0.25, 1.0, "first"), (0.75, 1.0, "second")]
    assert seen[0][3] < ended - 1.0  # arrived while the call was still running


@pytest.mark.e2e
@pytest.mark.server
def test_a_cancelled_request_cancels_the_job_and_kills_its_tree(dsn, sidecars, gateway,
                                                                  tmp_path):
    """Cancelling the client's call (the SDK sends notifications/cancelled) cancels the
    job: the row ends cancelled and every process of the tool's tree is gone."""
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

    _run(main())
    pids = read_pids(pidfile, 4)
    job = scalar(dsn, "SELECT id FROM tool_jobs WHERE tool = 'hang'")
    wait_until(lambda: job_row(dsn, job)["state"] == "cancelled", 10,
               what="the job to be cancelled")
    for pid in pids:
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"tool pid {pid} to die")


@pytest.mark.e2e
@pytest.mark.server
def test_bad_arguments_unknown_tools_and_the_per_principal_bound(dsn, sidecars, gateway,
                                                                  tmp_path):
    """Arguments the schema refuses and a tool not given are JSON-RPC errors naming what
    is wrong, with no job written; a principal at its bound of calls in flight is refused
    while another principal is not."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway("--max-calls-per-principal", "1")

    async def main():
        async with g.client() as client:
            with pytest.raises(MCPError) as bad:
                await client.call_tool("pt", {"steps": 5})
            assert "$.steps" in str(bad.value) and "array" in str(bad.value)
            with pytest.raises(MCPError) as extra:
                await client.call_tool("pt", {"steps": [], "rm": "-rf"})
            assert "rm" in str(extra.value)
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("sh", {})
            assert "unknown tool 'sh'" in str(unknown.value)
            assert await asyncio.to_thread(scalar, dsn, "SELECT count(*) FROM tool_jobs") == 0

            slow = asyncio.create_task(client.call_tool("pt", {"steps": [{"sleep": 2}]}))
            await asyncio.sleep(0.8)
            with pytest.raises(MCPError) as busy:
                await client.call_tool("pt", {"steps": []})
            assert "too many calls in flight for principal alice" in str(busy.value)
            async with g.client(BOB) as other:
                assert not (await other.call_tool("pt", {"steps": []})).is_error
            assert not (await slow).is_error

    _run(main())


@pytest.mark.e2e
@pytest.mark.server
def test_a_clients_idempotency_key_joins_the_job_within_its_principal_only(
        dsn, sidecars, gateway, tmp_path):
    """The same `_meta` idempotency key from the same principal returns the same job (the
    tool ran once); from another principal it is another job."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    meta = {"io.github.sidecar/idempotency-key": "order-42"}

    async def main():
        async with g.client() as alice, g.client(BOB) as bob:
            first = await alice.call_tool("pt", {"steps": []}, meta=meta)
            again = await alice.call_tool("pt", {"steps": []}, meta=meta)
            other = await bob.call_tool("pt", {"steps": []}, meta=meta)
            return _job_id(first), _job_id(again), _job_id(other)

    first, again, other = _run(main())
    assert first == again != other
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 2
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_claimed'") == 2


@pytest.mark.e2e
@pytest.mark.server
def test_a_clients_dedupe_policy_frees_its_key_once_the_job_ended_and_a_bad_one_is_refused(
        dsn, sidecars, gateway, tmp_path):
    """Issue 44, point 4: `_meta` io.github.sidecar/dedupe `active` lets the same key run
    the tool again once its job has ended (the default, forever, would return the first
    job); a policy that is not one is an invalid-params error naming the field, and no
    job is written."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    active = {"io.github.sidecar/idempotency-key": "sync-9", "io.github.sidecar/dedupe": "active"}
    forever = {"io.github.sidecar/idempotency-key": "once-9"}

    async def main():
        async with g.client() as alice:
            first = await alice.call_tool("pt", {"steps": []}, meta=active)
            second = await alice.call_tool("pt", {"steps": []}, meta=active)
            once = await alice.call_tool("pt", {"steps": []}, meta=forever)
            once_again = await alice.call_tool("pt", {"steps": []}, meta=forever)
            with pytest.raises(MCPError) as refused:
                await alice.call_tool("pt", {"steps": []}, meta={
                    "io.github.sidecar/idempotency-key": "bad-9",
                    "io.github.sidecar/dedupe": "hourly"})
            return (_job_id(first), _job_id(second), _job_id(once), _job_id(once_again),
                    str(refused.value))

    first, second, once, once_again, refused = _run(main())
    assert first != second and once == once_again
    assert "io.github.sidecar/dedupe 'hourly'" in refused and "forever, active" in refused
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 3
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_claimed'") == 3


@pytest.mark.e2e
@pytest.mark.server
def test_http_refuses_missing_and_wrong_tokens_and_foreign_origins(dsn, gateway, tmp_path):
    """Without a token, with a wrong one, or from a foreign Origin, /mcp answers 401/403
    and the SDK client fails to connect; /livez needs no token."""
    g = gateway()
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream",
               "Content-Type": "application/json"}
    assert httpx2.post(g.url, json=body, headers=headers).status_code == 401
    wrong = {**headers, "Authorization": "Bearer " + "c" * 40}
    denied = httpx2.post(g.url, json=body, headers=wrong)
    assert denied.status_code == 401 and "bearer" in denied.headers["www-authenticate"].lower()
    foreign = {**headers, "Authorization": f"Bearer {ALICE}", "Origin": "http://evil.example"}
    assert httpx2.post(g.url, json=body, headers=foreign).status_code == 403

    async def main():
        async with g.client("c" * 40) as client:
            await client.list_tools()

    with pytest.raises(BaseException):  # noqa: B017,PT011 - the SDK's own error shape
        _run(main())


@pytest.mark.e2e
@pytest.mark.server
def test_stdio_serves_the_same_calls(dsn, sidecars, tmp_path):
    """`sidecar mcp --stdio`, started by the SDK's stdio client, runs a call as a job
    tagged with the stdio principal."""
    env = _gateway_env(dsn, tmp_path)
    del env["SIDECAR_MCP_TOKEN_FILE"]
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "sidecar", "mcp", "--stdio", "--tool", "pt"],
                                   env=env)

    async def main():
        async with Client(params) as client:
            result = await client.call_tool("pt", {"steps": []})
            return result

    result = _run(main())
    assert not result.is_error and result.structured_content["done"] is True
    row = job_row(dsn, _job_id(result))
    assert row["tags"]["mcp.principal"] == "stdio"


@pytest.mark.e2e
@pytest.mark.server
@pytest.mark.parametrize("case, env_extra, args, expected", [
    ("no tool", {}, [], "give at least one --tool"),
    ("no description", {"SIDECAR_PROFILE_PT_MCP_DESCRIPTION": ""}, ["--tool", "pt"],
     "SIDECAR_PROFILE_PT_MCP_DESCRIPTION is not set"),
    ("no tokens", {"SIDECAR_MCP_TOKEN_FILE": ""}, ["--tool", "pt"],
     "needs bearer tokens: set SIDECAR_MCP_TOKEN_FILE"),
    ("bad listen", {}, ["--tool", "pt", "--listen", "localhost"], "use HOST:PORT"),
    ("start deadline too long", {}, ["--tool", "pt", "--start-deadline", "40d"],
     "--start-deadline '40d': at most 30 days"),
    ("start deadline zero", {}, ["--tool", "pt", "--start-deadline", "0"],
     "--start-deadline '0'"),
    ("control characters", {"SIDECAR_PROFILE_PT_MCP_DESCRIPTION": "a\x07b"}, ["--tool", "pt"],
     "SIDECAR_PROFILE_PT_MCP_DESCRIPTION='a\\x07b' is not valid"),
])
def test_bad_settings_are_one_line_and_exit_2(dsn, tmp_path, case, env_extra, args,
                                              expected):
    env = {**_gateway_env(dsn, tmp_path), **env_extra}
    done = cli(dsn, "mcp", *args, env=env, timeout=30)
    assert done.returncode == 2, done.stderr
    assert expected in one_line_error(done, no_stdout=True)


@pytest.mark.e2e
@pytest.mark.server
def test_schema_files_are_checked(dsn, tmp_path):
    """Not JSON, not an object schema, or not valid in its draft: exit 2 naming the
    variable (or the tool)."""
    env = _gateway_env(dsn, tmp_path)
    schema = Path(env["SIDECAR_PROFILE_PT_MCP_INPUT_SCHEMA_FILE"])
    for text, expected in [("{", "not JSON"), ('{"type": "array"}', '"type": "object"'),
                           ('{"type": "object", "properties": 3}', "not a valid JSON Schema")]:
        schema.write_text(text)
        done = cli(dsn, "mcp", "--tool", "pt", env=env, timeout=30)
        assert done.returncode == 2
        assert expected in one_line_error(done, no_stdout=True)
    # `sidecar config` shows the MCP fields, and refuses what the gateway would refuse.
    schema.write_text('{"type": "array"}')
    done = cli(dsn, "config", "--tool", "pt", env=env, timeout=30)
    assert done.returncode == 2
    profile = orjson.loads(done.stdout)["profiles"][0]
    assert profile["mcp_description"] == "Runs progress steps, then prints done."
    assert '"type": "object"' in profile["mcp_error"]
    schema.write_bytes(orjson.dumps(SCHEMA))
    done = cli(dsn, "config", "--tool", "pt", env=env, timeout=30)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["profiles"][0]["mcp_input_schema_file"] == str(schema)


@pytest.mark.unit
def test_token_file_rules(tmp_path):
    """One `PRINCIPAL TOKEN` per line; short tokens, repeats and empty files refused
    with the line named and no token shown; lookups in constant time per token."""
    path = tmp_path / "tokens"
    path.write_bytes(f"\ufeffalice {ALICE}\r\n\n# comment\nbob {BOB}\n".encode())
    tokens = mcp_catalog.load_tokens(str(path))  # a BOM and CRLF, as some editors write
    assert mcp_catalog.principal_of(tokens, ALICE) == "alice"
    assert mcp_catalog.principal_of(tokens, BOB) == "bob"
    assert mcp_catalog.principal_of(tokens, BOB[:-1]) is None
    for text, expected in [("", "no token"), ("alice short\n", "line 1: the token"),
                           (f"alice {ALICE}\nalice {BOB}\n", "line 2: principal alice"),
                           (f"alice {ALICE}\nbob {ALICE}\n", "line 2: the same token"),
                           (f"al ice {ALICE}\n", "line 1: write PRINCIPAL TOKEN"),
                           (f"-x {ALICE}\n", "line 1: the principal")]:
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            mcp_catalog.load_tokens(str(path))
        assert expected in str(err.value) and ALICE not in str(err.value)


@pytest.mark.unit
def test_call_keys_need_a_session_and_are_scoped():
    """A derived key only with a session and a request id; the same request gives the
    same key, another principal, session or id another, and so does another secret."""
    secret = mcp_catalog.gateway_secret(b"the token file")

    def key(*parts):
        return mcp_catalog.call_idempotency_key(secret, *parts)

    assert key("alice", None, 1) is None and key("alice", "s", None) is None
    assert key("alice", "s", 1) == key("alice", "s", "1")
    assert len({key("alice", "s", 1), key("bob", "s", 1), key("alice", "t", 1),
                key("alice", "s", 2)}) == 4
    assert key("alice", "s", 1) != mcp_catalog.call_idempotency_key(
        mcp_catalog.gateway_secret(b"another file"), "alice", "s", 1)
    scoped = mcp_catalog.client_idempotency_key
    assert scoped(secret, "alice", "k") != scoped(secret, "bob", "k")


@pytest.mark.unit
def test_only_tags_the_gateway_signed_are_its_own():
    """Issue 41 point 2: mcp.sig covers every mcp.* tag; a job without it, with a changed
    mcp.* tag or signed under another secret is not the gateway's; other tags are free."""
    secret = mcp_catalog.gateway_secret(b"the token file")
    tags = mcp_catalog.sign_tags(secret, {"mcp.principal": "bob", "mcp.task": "t" * 32})
    assert mcp_catalog.signed(secret, tags)
    assert mcp_catalog.signed(secret, {**tags, "run": "42"})
    assert not mcp_catalog.signed(secret, {**tags, "mcp.principal": "alice"})
    assert not mcp_catalog.signed(secret, {**tags, "mcp.kind": "task"})
    assert not mcp_catalog.signed(secret, {k: v for k, v in tags.items() if k != "mcp.sig"})
    assert not mcp_catalog.signed(mcp_catalog.gateway_secret(b"another"), tags)
    assert not mcp_catalog.signed(secret, None)


@pytest.mark.unit
def test_the_secret_file_is_bounded_and_named(tmp_path):
    """SIDECAR_MCP_SECRET_FILE wins over the token file; a short one is refused naming
    the variable; the token file's text is the fallback; neither: random per process."""
    secret, tokens = tmp_path / "secret", tmp_path / "tokens"
    secret.write_text("s" * 40 + "\n")
    tokens.write_text(f"alice {ALICE}\n")
    load = mcp_catalog.load_secret
    assert load(str(secret), str(tokens)) == load(str(secret), "") != load("", str(tokens))
    assert load("", str(tokens)) == load("", str(tokens))
    assert load("", "") != load("", "")
    secret.write_text("short\n")
    with pytest.raises(ConfigError, match="SIDECAR_MCP_SECRET_FILE"):
        load(str(secret), str(tokens))


@pytest.mark.e2e
@pytest.mark.server
def test_run_never_imports_the_mcp_sdk():
    """`sidecar run`'s modules import no MCP SDK (the extra is optional)."""
    code = ("import sys, sidecar.cli, sidecar.worker.claim_loop, sidecar.worker.supervisor\n"
            "bad = [m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', "
            "'mcp_types', 'uvicorn', 'starlette', 'jsonschema'))]\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr.decode()


def _rpc(g: Gateway, body: dict, session: str | None = None) -> tuple[dict | None, str | None]:
    """One JSON-RPC POST on the 2025 revision's session (raw HTTP); the response's JSON
    (from a JSON body or the last SSE data line) and the session id header."""
    headers = {"Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "Authorization": f"Bearer {ALICE}",
               "MCP-Protocol-Version": "2025-11-25"}
    if session:
        headers["Mcp-Session-Id"] = session
    response = httpx2.post(g.url, json=body, headers=headers, timeout=60)
    assert response.status_code in (200, 202), response.text
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        text = data[-1] if data else ""
    return (orjson.loads(text) if text.strip() else None,
            response.headers.get("mcp-session-id") or session)


@pytest.mark.e2e
@pytest.mark.server
def test_a_retried_request_of_a_session_joins_its_job(dsn, sidecars, gateway, tmp_path):
    """On a 2025-revision session, the same tools/call request sent twice (a client's
    retry: same session, same JSON-RPC id) is one job, run once; another id is another
    job."""
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    g = gateway()
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "retry-test", "version": "1"}}}
    answer, session = _rpc(g, init)
    assert answer["result"]["protocolVersion"] == "2025-11-25" and session
    _rpc(g, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "pt", "arguments": {"steps": []}}}
    first, _ = _rpc(g, call, session)
    again, _ = _rpc(g, call, session)
    other, _ = _rpc(g, {**call, "id": 8}, session)
    ids = [r["result"]["_meta"]["io.github.sidecar/job"]["id"] for r in (first, again, other)]
    assert ids[0] == ids[1] != ids[2]
    assert job_row(dsn, ids[0])["tags"]["mcp.session"] == session
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events WHERE event = 'job_claimed'") == 2
