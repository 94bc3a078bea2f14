"""Waiting MCP calls (issue 41, points 14 and 4), end to end with the official MCP SDK's
client against a real `sidecar mcp` process: 100 calls of two principals waiting at once
hold at most the gateway's pool + 1 server connections and all get their result; a
2026-07-28 request sent again (no session, same id) joins its job instead of starting a
second; a call with a progress token learns why its job waits ("no live sidecar"), and a
call whose job no sidecar starts ends `expired` after the gateway's --start-deadline."""

from __future__ import annotations

import asyncio
import time

import httpx2
import orjson
import pytest
from test_mcp_gateway import ALICE, BOB, _gateway_env, gateway  # noqa: F401 - the fixture

from kit import TOOLS, scalar, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.server]

# sidecar.client.Client's default pool (max_connections) + the hub's LISTEN connection.
GATEWAY_CONNECTIONS = 4 + 1
MODERN = "2026-07-28"


def _connections(dsn: str) -> int:
    return scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                       "current_database() AND application_name LIKE 'sidecar%'")


def _modern_call(url: str, request_id: str, arguments: dict) -> dict:
    """One tools/call of `pt` on the 2026-07-28 revision (no session), raw HTTP; the
    JSON-RPC answer."""
    headers = {"Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "Authorization": f"Bearer {ALICE}",
               "MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "pt"}
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {
        "name": "pt", "arguments": arguments,
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN,
                  "io.modelcontextprotocol/clientCapabilities": {}}}}
    response = httpx2.post(url, content=orjson.dumps(body), headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        text = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")][-1]
    return orjson.loads(text)


def test_a_hundred_waiting_calls_hold_a_bounded_number_of_connections(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """2 principals x 50 calls wait while no sidecar runs: the gateway's server sessions
    stay within GATEWAY_CONNECTIONS; a 2026-07-28 request sent twice is one job; once a
    sidecar runs, every call gets its own job's result. Was: one connection per waiting
    call (100+), "too many clients" for some callers."""
    env = _gateway_env(dsn, tmp_path)
    g = gateway(env=env)
    counts: list[int] = []

    async def calls(token: str, first: int) -> list:
        async with g.client(token) as client:
            return await asyncio.gather(*(
                client.call_tool("pt", {"steps": [{"http": {"progress": i / 100}}]})
                for i in range(first, first + 50)))

    async def main():
        both = asyncio.gather(calls(ALICE, 0), calls(BOB, 50))
        retry = [asyncio.ensure_future(asyncio.to_thread(
            _modern_call, g.url, "again", {"steps": []}))]
        await asyncio.to_thread(wait_until, lambda: scalar(
            dsn, "SELECT count(*) FROM tool_jobs WHERE state = 'queued'") == 101, 60,
            what="101 queued jobs")
        retry.append(asyncio.ensure_future(asyncio.to_thread(
            _modern_call, g.url, "again", {"steps": []})))
        for _ in range(20):  # the calls wait: sample the gateway's sessions
            counts.append(await asyncio.to_thread(_connections, dsn))
            await asyncio.sleep(0.1)
        sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", "--concurrency",
                 "8", env=env)
        return await both, await asyncio.gather(*retry)

    (alice, bob), retried = asyncio.run(main())
    assert max(counts) <= GATEWAY_CONNECTIONS, counts
    results = [*alice, *bob]
    assert not any(r.is_error for r in results)
    job_ids = {r.meta["io.github.sidecar/job"]["id"] for r in results}
    assert len(job_ids) == 100
    again = [r["result"]["_meta"]["io.github.sidecar/job"]["id"] for r in retried]
    assert again[0] == again[1]
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE tags->>'mcp.tool_call' = "
                       "'again'") == 1
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 101


def test_a_waiting_call_learns_why_and_ends_expired_after_the_start_deadline(
        dsn, gateway, tmp_path):  # noqa: F811 - the fixture
    """No sidecar of `hang` runs: the call with a progress token gets a notification
    saying "no live sidecar", and ends isError `expired` after --start-deadline 4s (the
    job row failed, kind expired)."""
    g = gateway("--start-deadline", "4s")
    messages: list[str | None] = []

    async def on_progress(progress, total, message):
        messages.append(message)

    async def main():
        async with g.client() as client:
            started = time.monotonic()
            result = await client.call_tool("hang", {}, progress_callback=on_progress)
            return result, time.monotonic() - started

    result, took = asyncio.run(main())
    assert result.is_error
    assert result.structured_content["error"]["kind"] == "expired"
    assert any(m and m.startswith("no live sidecar") for m in messages), messages
    job = result.meta["io.github.sidecar/job"]["id"]
    assert scalar(dsn, "SELECT error->>'kind' FROM tool_jobs WHERE id = $1", job) == "expired"
    assert took >= 3.5


def test_a_queued_tasks_status_message_says_why(dsn, gateway, tmp_path):  # noqa: F811
    """A task-augmented call of `hang`, which no sidecar serves: tasks/get's
    statusMessage says "queued: no live sidecar ..." (was: "queued")."""
    from sidecar.mcp.tasks import TaskHandle, TasksExtension, cancel_task, get_task

    g = gateway()

    async def main():
        async with g.client(extensions=[TasksExtension()]) as client:
            handle = await client.session.call_tool("hang", {}, allow_claimed=True)
            assert isinstance(handle, TaskHandle)
            task = await get_task(client.session, handle.task_id)
            await cancel_task(client.session, handle.task_id)
            return task

    task = asyncio.run(main())
    assert task["status"] == "working"
    assert task["statusMessage"].startswith("queued: no live sidecar"), task
