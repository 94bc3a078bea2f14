"""The client's side of MCP Tasks against ``sidecar mcp`` (issue 29, point 3), for Python
agents built on the official MCP SDK's ``Client``: the SDK ships no Tasks extension of its
own, so this is the piece that makes ``tools/call`` return a task handle and reads tasks.

```python
from mcp import Client
from sidecar.mcp.tasks import TasksExtension, get_task, task_result

async with Client(url_or_transport, extensions=[TasksExtension()]) as client:
    handle = await client.session.call_tool("ocr", {"file": "/data/a.png"},
                                            allow_claimed=True)   # a TaskHandle, at once
    ...                                   # disconnect, restart, another replica: all fine
    result = await task_result(client.session, handle.task_id)  # a CallToolResult
```

With the extension, ``client.call_tool`` (not ``allow_claimed``) still returns the final
CallToolResult: the claim's resolver waits for it with ``tasks/result``.

Wire (SEP-2663, protocol 2026-07-28): ``tools/call`` answers ``resultType: "task"`` with
the Task fields; ``tasks/get`` returns the Task (``result`` once completed);
``tasks/cancel``. ``tasks/result`` (wait for the result) and ``tasks/list`` (the
principal's tasks) are the gateway's additions, as in the 2025-11-25 revision. Needs the
``[mcp]`` extra.
"""

from __future__ import annotations

from typing import Any, Literal

import mcp_types as types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from pydantic import ConfigDict, TypeAdapter

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
_ANY = TypeAdapter(dict[str, Any])


class TaskHandle(types.Result):
    """What ``tools/call`` returns for a task: ``task_id``, ``status`` (working,
    completed, cancelled...), ``created_at``, ``last_updated_at`` (ISO 8601),
    ``ttl_ms``, ``poll_interval_ms``."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"]
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class _TaskParams(types.RequestParams):
    task_id: str


class _GetTask(types.Request[_TaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: _TaskParams


class _TaskResult(types.Request[_TaskParams, Literal["tasks/result"]]):
    method: Literal["tasks/result"] = "tasks/result"
    params: _TaskParams


class _CancelTask(types.Request[_TaskParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: _TaskParams


class _ListTasks(types.Request[types.PaginatedRequestParams | None, Literal["tasks/list"]]):
    method: Literal["tasks/list"] = "tasks/list"
    params: types.PaginatedRequestParams | None = None


async def get_task(session: Any, task_id: str) -> dict[str, Any]:
    """``tasks/get``: the task as the wire has it (``taskId``, ``status``, ...,
    ``result`` once completed). MCPError when there is no such task of this principal."""
    return await session.send_request(_GetTask(params=_TaskParams(task_id=task_id)), _ANY)


async def task_result(session: Any, task_id: str,
                      timeout: float | None = None) -> types.CallToolResult:
    """``tasks/result``: wait (no polling) until the task ends; its CallToolResult."""
    return await session.send_request(_TaskResult(params=_TaskParams(task_id=task_id)),
                                      types.CallToolResult, timeout)


async def cancel_task(session: Any, task_id: str) -> None:
    """``tasks/cancel``: cancel the task's job (its tool's tree dies within a heartbeat)."""
    await session.send_request(_CancelTask(params=_TaskParams(task_id=task_id)), _ANY)


async def list_tasks(session: Any) -> list[dict[str, Any]]:
    """``tasks/list``: this principal's newest tasks, without their results."""
    answer = await session.send_request(_ListTasks(params=types.PaginatedRequestParams()),
                                        _ANY)
    return list(answer.get("tasks", []))


async def _resolve(handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
    return await task_result(ctx.session, handle.task_id)


class TasksExtension(ClientExtension):
    """Advertises ``io.modelcontextprotocol/tasks`` and claims the ``task`` result of
    ``tools/call``: pass it to ``mcp.Client(..., extensions=[TasksExtension()])``."""

    identifier = TASKS_EXTENSION

    def claims(self) -> tuple[ResultClaim[Any], ...]:
        return (ResultClaim(result_type="task", model=TaskHandle, resolve=_resolve),)
