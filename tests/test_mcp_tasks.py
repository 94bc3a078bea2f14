"""Durable MCP Tasks through `sidecar mcp` (issue 29, point 3), with the SDK's client and
sidecar.mcp.tasks: a call returns a task at once; the task outlives the client's
connection, a restart of the gateway, and is served by a second replica on the same
database; `tasks/result` waits for it; `tasks/cancel` kills the tool's tree; another
principal can neither see, read nor cancel it; task ids are random UUIDs."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from mcp.shared.exceptions import MCPError
from test_mcp_gateway import BOB, _gateway_env, gateway  # noqa: F401 - the fixture

from kit import TOOLS, job_row, pid_alive, read_pids, scalar, wait_until
from sidecar.mcp.tasks import (
    TaskHandle,
    TasksExtension,
    cancel_task,
    get_task,
    list_tasks,
    task_result,
)

pytestmark = [pytest.mark.e2e, pytest.mark.server]


def _tasks_client(g, token=None):
    return g.client(token, extensions=[TasksExtension()]) if token else \
        g.client(extensions=[TasksExtension()])


def test_a_task_outlives_its_connection_a_restart_and_is_served_by_any_replica(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    env = _gateway_env(dsn, tmp_path)
    sidecars(dsn, [str(TOOLS / "progress_tool.py")], "--tool", "pt", env=env)
    first, second = gateway(), gateway()
    release = tmp_path / "release"

    async def create() -> TaskHandle:
        async with _tasks_client(first) as client:
            handle = await client.session.call_tool(
                "pt", {"steps": [{"http": {"progress": 0.5, "message": "half"}},
                                 {"wait_for": str(release)}]}, allow_claimed=True)
            assert isinstance(handle, TaskHandle)
            assert handle.status == "working"
            return handle

    handle = asyncio.run(create())  # the client's connection is gone now
    task_id = handle.task_id
    assert len(task_id) == 32  # 192 random bits, not the job's id
    job_id = scalar(dsn, "SELECT id FROM tool_jobs WHERE tags->>'mcp.task' = $1", task_id)
    assert job_row(dsn, job_id)["tags"]["mcp.principal"] == "alice"

    async def from_the_other_replica():
        async with _tasks_client(second) as client:
            for _ in range(100):
                task = await get_task(client.session, task_id)
                if task.get("statusMessage", "").endswith("half"):
                    break
                await asyncio.sleep(0.1)
            assert task["status"] == "working"
            assert task["statusMessage"] == "running, attempt 1: half"
            assert [t["taskId"] for t in await list_tasks(client.session)] == [task_id]

    asyncio.run(from_the_other_replica())
    first.stop()
    restarted = gateway()
    release.touch()

    async def after_the_restart():
        async with _tasks_client(restarted) as client:
            result = await task_result(client.session, task_id)
            assert not result.is_error
            assert result.structured_content["done"] is True
            task = await get_task(client.session, task_id)
            assert task["status"] == "completed"
            assert task["result"]["structuredContent"]["done"] is True
            # Without allow_claimed, the extension waits for the result itself.
            plain = await client.call_tool("pt", {"steps": []})
            assert plain.structured_content["done"] is True

    asyncio.run(after_the_restart())


def test_tasks_are_private_bounded_per_principal_and_cancel_kills_the_tree(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_HANG_STAGE_TIMEOUT_SECONDS="600")
    sidecars(dsn, [str(TOOLS / "hang_tree.py")], "--tool", "hang", env=env)
    g = gateway("--max-tasks-per-principal", "1", env=env)
    pidfile = tmp_path / "hang.pids"

    async def main():
        async with _tasks_client(g) as alice, _tasks_client(g, BOB) as bob:
            handle = await alice.session.call_tool(
                "hang", {"pidfile": str(pidfile), "tree": True}, allow_claimed=True)
            await asyncio.to_thread(read_pids, pidfile, 4)
            # One unfinished task per principal here: alice is refused, bob is not.
            with pytest.raises(MCPError) as bound:
                await alice.session.call_tool("hang", {"pidfile": "x"}, allow_claimed=True)
            assert "too many unfinished tasks for principal alice" in str(bound.value)
            queued = await bob.session.call_tool("hang", {"pidfile": "x"}, allow_claimed=True)
            assert queued.status == "working"
            for method in (get_task, task_result, cancel_task):
                with pytest.raises(MCPError) as refused:
                    await method(bob.session, handle.task_id)
                assert f"no task '{handle.task_id}'" in str(refused.value)
            with pytest.raises(MCPError):
                await get_task(bob.session, str(uuid.uuid4()))
            assert [t["taskId"] for t in await list_tasks(bob.session)] == [queued.task_id]
            assert (await get_task(alice.session, handle.task_id))["status"] == "working"
            await cancel_task(alice.session, handle.task_id)
            ended = await task_result(alice.session, handle.task_id)
            assert ended.is_error and ended.structured_content["state"] == "cancelled"
            assert (await get_task(alice.session, handle.task_id))["status"] == "cancelled"
            again = await alice.session.call_tool("hang", {"pidfile": "x"}, allow_claimed=True)
            await cancel_task(alice.session, again.task_id)
            await cancel_task(bob.session, queued.task_id)
            return handle.task_id

    task_id = asyncio.run(main())
    assert scalar(dsn, "SELECT state FROM tool_jobs WHERE tags->>'mcp.task' = $1",
                  task_id) == "cancelled"
    for pid in read_pids(pidfile, 4):
        wait_until(lambda p=pid: not pid_alive(p), 10, what=f"tool pid {pid} to die")
