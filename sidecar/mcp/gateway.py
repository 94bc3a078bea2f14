"""``sidecar mcp``: every tool it is given as an MCP tool whose calls are jobs (issue 29).

A ``tools/call`` is one job of that tool: the arguments, checked against the tool's
schema, are its payload; the job carries the MCP principal, session and request as tags
and, where the request can be told apart from every other, an idempotency key derived
from it (sidecar.mcp.catalog.call_idempotency_key), so a client's retry joins the job
instead of running the tool twice (without a key: a request sent again joins its
unfinished job). The gateway waits for the job without polling (sidecar.client.Client.follow:
every call on the client's one LISTEN connection, issue 41), turns the tool's progress,
and while the job is queued why it waits, into ``notifications/progress`` when the
client sent a progress token, gives every job a start deadline, and returns the
job's result (``isError`` with the error's kind and message when it failed). A request
the client cancels (``notifications/cancelled``, or closing its response stream on the
2026-07-28 protocol) cancels the job: its sidecar kills the tree at its next heartbeat.

Built on the official MCP Python SDK (``pip install 'sidecar[mcp]'``): its low-level
server, its Streamable HTTP transport at ``/mcp`` (served by uvicorn) and its stdio
transport. ``sidecar run`` never imports this module (tests/test_import_graph.py).

Secure by default: bound to 127.0.0.1 unless told otherwise; over HTTP every request
but ``/livez`` needs a bearer token from SIDECAR_MCP_TOKEN_FILE (none there: refuses to
start); ``Host`` and ``Origin`` are checked (DNS rebinding); request bodies and the calls
in flight per principal are bounded; bad input is a JSON-RPC error with one clear line.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import hmac
import logging
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import jsonschema
import mcp_types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST

from sidecar.client import Client, JobEnd, JobNotFound, JobProgress, JobRef
from sidecar.mcp import catalog as mcp_catalog
from sidecar.mcp import wire
from sidecar.mcp.catalog import McpTool
from sidecar.protocol import enqueue_args, jsontext, masking, parsing
from sidecar.protocol.errors import (
    ConfigError,
    DatabaseUnavailable,
    IdempotencyConflict,
    SidecarError,
    UsageError,
    one_line,
)
from sidecar.runtime.config import Settings
from sidecar.storage import db

log = logging.getLogger("sidecar.mcp")

# A client's own idempotency key for a call, in the request's _meta (1-256 printable
# characters; scoped to its principal).
IDEMPOTENCY_META = "io.github.sidecar/idempotency-key"
# How long that key names the call's job (issue 44): forever, active or a window such as
# 24h (docs/callers.md "Idempotency keys"); unset: the tool's DEDUPE.
DEDUPE_META = "io.github.sidecar/dedupe"
# What a result's _meta says about the job behind it.
JOB_META = "io.github.sidecar/job"
# The MCP Tasks extension (SEP-2663, protocol 2026-07-28): a client that lists it in its
# per-request capabilities gets a task handle from tools/call at once.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
# The pollIntervalMs a task suggests (tasks/result waits without polling).
TASK_POLL_MS = 1000
# tasks/list: the newest tasks of the principal, at most this many.
TASK_LIST_LIMIT = 100
TASK_ID = re.compile(r"[A-Za-z0-9_-]{32}")
_TASK_STATUS = {"queued": "working", "running": "working", "waiting": "input_required",
                "succeeded": "completed", "failed": "completed", "cancelled": "cancelled"}
# The progress message the guard reports when a tool asks a person's yes (issue 44,
# sidecar.worker.guard): the one progress event that makes a waiting call look.
APPROVAL_PROGRESS = "waiting for a person's yes"
# What a client is asked when a call's tool waits for a person's yes (issue 44).
APPROVAL_SCHEMA = {"type": "object", "properties": {
    "approve": {"type": "boolean", "title": "Approve this step"},
    "reason": {"type": "string", "title": "Why", "maxLength": 500}},
    "required": ["approve"]}
# Defaults of the command's bounds.
DEFAULT_MAX_CALLS_PER_PRINCIPAL = 64
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
DEFAULT_MAX_TASKS_PER_PRINCIPAL = 1000
# The SSE `retry:` a stream's priming event suggests (ms): how soon a client whose
# connection dropped reconnects with Last-Event-ID (sidecar.mcp.resume).
SSE_RETRY_MS = 1000
# How long cancelling a job may take when its request is cancelled (seconds).
CANCEL_BOUND_SECONDS = 10.0


# An MCP call's interest lives this long without a sign of its client (seconds).
DEFAULT_INTEREST_SECONDS = 120.0
# Interests one replica remembers it renewed (an LRU bound; a forgotten one is renewed
# again at its next sign).
INTEREST_MEMORY = 4096


@dataclass(frozen=True)
class GatewayOptions:
    """How ``sidecar mcp`` serves: ``max_calls_per_principal`` (calls in flight at once
    per principal; one more is refused with a JSON-RPC error), ``max_tasks_per_principal``
    (unfinished tasks per principal, counted in the database) and, over HTTP,
    ``max_request_bytes`` (a larger body gets 413), ``allowed_hosts`` and
    ``allowed_origins`` (``Host``/``Origin`` values accepted besides the loopback ones;
    ``host:*`` admits any port). ``start_deadline_seconds``: a call's job not started
    that long after the call ends failed, kind ``expired`` (its ``expires_at``; issue 41:
    no call waits for ever for a tool no sidecar serves). ``secret``: the key of the
    ``mcp.sig`` tag and of the derived idempotency keys (catalog.gateway_secret; the
    replicas of one gateway share it; issue 41 point 2)."""

    max_calls_per_principal: int = DEFAULT_MAX_CALLS_PER_PRINCIPAL
    max_tasks_per_principal: int = DEFAULT_MAX_TASKS_PER_PRINCIPAL
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    start_deadline_seconds: float = mcp_catalog.DEFAULT_START_DEADLINE_SECONDS
    allowed_hosts: Sequence[str] = ()
    allowed_origins: Sequence[str] = ()
    # What the gateway's mcp.* tags and mcp: keys are signed with
    # (sidecar.mcp.catalog.gateway_secret); empty: a random one per process.
    secret: bytes = b""
    # Issue 44: how long a call's interest lives without a sign of its client (a request
    # of its session, a poll of its task, or its own request still waiting), seconds.
    interest_seconds: float = DEFAULT_INTEREST_SECONDS


class Gateway:
    """The MCP face of a set of tools: builds the SDK's low-level ``Server`` whose
    ``tools/list`` lists ``catalog`` and whose ``tools/call`` runs a job through
    ``client`` (open; the caller closes it). ``principal_of`` tells who sent a request
    (the HTTP transport's bearer token; ``stdio`` on stdio)."""

    def __init__(self, client: Client, catalog: Sequence[McpTool], options: GatewayOptions,
                 principal_of: Callable[[Any], str]):
        self.client = client
        self.settings = client.settings
        self.options = options
        self.tools = {tool.name: tool for tool in catalog}
        self.validators = {tool.name: _validator(tool) for tool in catalog}
        self.principal_of = principal_of
        self.secret = options.secret or mcp_catalog.gateway_secret(None)
        self.in_flight: dict[str, int] = {}
        # interest key -> monotonic time this replica last renewed it (issue 44)
        self._renewed: dict[str, float] = {}
        # How results carry exact numbers: marked for ExactWire over HTTP (build_http_app
        # sets it), plain ints and floats over stdio (sidecar.mcp.wire).
        self.marks: wire.Marks | None = None
        self.stopping = False  # a shutdown cancels handlers: their jobs go on
        self.server: Server[Any] = Server(
            "sidecar", version=_version(), instructions=(
                "Each tool call runs as a leased job of the sidecar queue; a cancelled "
                "request cancels its job."),
            on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        self.server.middleware.append(self._clear_validation)
        # Tasks: every method reads the job row, so any replica serves any task.
        self.server.extensions[TASKS_EXTENSION] = {}
        self.server.add_request_handler("tasks/get", TaskParams, self._task_get)
        self.server.add_request_handler("tasks/result", TaskParams, self._task_result)
        self.server.add_request_handler("tasks/cancel", TaskParams, self._task_cancel)
        self.server.add_request_handler("tasks/list", types.PaginatedRequestParams,
                                        self._task_list)

    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=tool.name, description=tool.description,
                       input_schema=dict(tool.input_schema))
            for tool in self.tools.values()])

    async def _call_tool(self, ctx: Any,
                         params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = self.tools.get(params.name)
        if tool is None:
            raise MCPError(code=INVALID_PARAMS, message=(
                f"unknown tool {params.name[:80]!r}: this server exposes "
                f"{', '.join(sorted(self.tools))}"))
        if params.request_state is not None:  # the retry of an in-band ask (2026-07-28)
            return await self._resume_with_answer(ctx, params)
        arguments = params.arguments if params.arguments is not None else {}
        _check_arguments(tool.name, self.validators[tool.name], arguments)
        try:  # the arguments as written, every digit (the SDK's parse rounds decimals)
            exact = wire.exact_arguments(_scope(ctx), ctx.request_id, tool.name)
        except jsontext.NumberOutOfRange as exc:
            raise MCPError(code=INVALID_PARAMS, message=(
                f"{tool.name}: arguments: {one_line(str(exc))[:300]}")) from None
        if exact is not None:
            arguments = exact
        principal = self.principal_of(ctx)
        meta = _wire_meta(ctx)
        key = self._idempotency_key(ctx, principal, meta)
        dedupe = _dedupe(meta)
        as_task = _wants_task(ctx)
        task_id = secrets.token_urlsafe(24) if as_task else None
        with self._slot(principal):
            tags = {"mcp.principal": principal, "mcp.tool_call": _tag_id(ctx.request_id)}
            if session := _session_id(ctx):
                tags["mcp.session"] = session[:256]
            if as_task:  # the task id: 192 random bits, not the job id
                await self._check_task_bound(principal)
                tags["mcp.task"] = task_id
                tags["mcp.kind"] = "task"
            tags = mcp_catalog.sign_tags(self.secret, tags)
            try:
                ref = None
                if key is None and not as_task:  # no session: a retry finds its job
                    ref = await self._unfinished_call(tool.name, tags, arguments)
                if ref is None:
                    interest = await self._hold_call_interest(ctx, principal, task_id)
                    ref = await self.client.enqueue(
                        tool.name, arguments, idempotency_key=key, tags=tags,
                        expires_in=self.options.start_deadline_seconds, gateway_tags=True,
                        session=self._agent_session(tool.name, principal, ctx),
                        dedupe=dedupe, interest=interest)
            except IdempotencyConflict as exc:
                raise MCPError(code=INVALID_PARAMS,
                               message=_conflict(str(exc), meta, key)) from None
            except (UsageError, ConfigError) as exc:
                raise MCPError(code=INVALID_PARAMS, message=self._said(exc)) from None
            except (SidecarError, *db.DATABASE_ERRORS) as exc:
                why = one_line(str(exc)) or db.describe_error(exc)  # a timeout has no text
                log.warning("mcp call of %s: enqueue failed: %s", tool.name, why)
                raise MCPError(code=INTERNAL_ERROR, message=(
                    f"the job could not be queued: {self._said(exc)}")) from None
            if as_task:  # the handle at once; the job goes on without this request
                job = await self.client.get(ref.id)
                if "mcp.task" not in (job.tags or {}) \
                        or not self._signed(job.tags):  # the key named a plain call
                    raise MCPError(code=INVALID_PARAMS, message=(
                        f"_meta {IDEMPOTENCY_META}: this key already names a call made "
                        f"without the Tasks extension (job {job.id}); use another key"))
                return {"resultType": "task", **self._task(job, with_result=False)}
            progress_token = meta.get("progressToken")
            if isinstance(progress_token, bool) or not isinstance(progress_token, str | int):
                progress_token = None
            end = await self._wait(ctx, ref.id, progress_token, cancel_on_cancel=True,
                                   ask_in_band=True)
        if isinstance(end, types.InputRequiredResult):
            return end  # a person's yes is asked in-band; the client retries with it
        return _tool_result(end, self.marks)

    def _said(self, exc: BaseException) -> str:
        """An error's text as an MCP caller may read it: one line, credentials masked, and
        no word of where the database is (host, port, user, database name, addresses;
        sidecar.protocol.masking.mask_database; issue 41, point 15)."""
        dsns = [getattr(self.client, "dsn", None) or "",
                getattr(self.client, "listen_dsn", None) or ""]
        return masking.mask_database(one_line(str(exc)), dsns)

    async def _clear_validation(self, ctx: Any, call_next: Any) -> Any:
        """Server middleware (_clear_validation), its database errors masked (_said); a
        request of an MCP session whose calls this replica holds an interest for renews
        it (issue 44: the client is still there)."""
        session = _session_id(ctx)
        if session:
            known = mcp_catalog.interest_key(self.secret, self.principal_of(ctx),
                                             ["session", session])
            if known in self._renewed:
                await self._renew(known)
        return await _clear_validation(ctx, call_next, self._said)

    # --- approvals (issue 44, point 1) ---------------------------------------------

    async def answer_from(self, job_id: uuid.UUID, request: Mapping[str, Any], answer: Any,
                          principal: str) -> str | None:
        """Write the client's elicitation ``answer`` (an ElicitResult, or its JSON) as
        the answer to ``request`` of job ``job_id``, for the attempt and token that asked,
        by ``sidecar mcp (PRINCIPAL)``: accept with ``approve`` true or false, or decline
        (a no). A cancel, or an answer without a yes or no, leaves the request open (None
        returned). The outcome otherwise (approved, denied, or why it was refused)."""
        if isinstance(answer, Mapping):
            action, content = answer.get("action"), answer.get("content")
        else:
            action, content = getattr(answer, "action", None), getattr(answer, "content", None)
        content = content if isinstance(content, Mapping) else {}
        if action == "accept" and isinstance(content.get("approve"), bool):
            approve, reason = content["approve"], content.get("reason")
        elif action == "decline":
            approve, reason = False, "declined in the MCP client"
        else:
            return None
        if not (isinstance(reason, str) and 1 <= len(reason) <= 500 and reason.isprintable()):
            reason = None
        try:
            outcome = await self.client.approve(
                job_id, approve=approve, reason=reason, attempt=request["attempt"],
                token=request["fencing_token"], by=cancelled_by(principal))
        except (SidecarError, *db.DATABASE_ERRORS) as exc:
            log.warning("mcp: the answer for job %s was not written: %s", job_id,
                        one_line(str(exc))[:200])
            return None
        log.info("mcp: job %s approval %s by %s", job_id, outcome, principal)
        return outcome

    def _approval_state(self, principal: str, job_id: uuid.UUID, request_id: Any) -> str:
        """The requestState of an in-band ask (2026-07-28): the job and request it is
        about, under a MAC of this gateway's secret and the principal (the client echoes
        it; it is never trusted unverified)."""
        mac = mcp_catalog.mac_of(self.secret, ["approval-state", principal, str(job_id),
                                               str(request_id)])
        return f"a1.{job_id}.{request_id}.{mac}"

    def _verified_state(self, principal: str, state: str) -> tuple[uuid.UUID, str]:
        """``(job id, request id)`` of a requestState this gateway issued to
        ``principal``; INVALID_PARAMS for any other."""
        parts = state.split(".") if isinstance(state, str) and len(state) <= 300 else []
        try:
            if len(parts) != 4 or parts[0] != "a1":
                raise ValueError("format")
            job_id, request_id = uuid.UUID(parts[1]), str(uuid.UUID(parts[2]))
        except ValueError:
            raise MCPError(code=INVALID_PARAMS, message="requestState: not one this "
                           "gateway issued") from None
        if not hmac.compare_digest(parts[3], self._approval_state(principal, job_id,
                                                                  request_id).split(".")[3]):
            raise MCPError(code=INVALID_PARAMS, message="requestState: not one this "
                           "gateway issued")
        return job_id, request_id

    async def _resume_with_answer(self, ctx: Any,
                                  params: types.CallToolRequestParams) -> types.CallToolResult:
        """A 2026-07-28 client retries a tools/call with its answer to the approval the
        gateway asked in-band: write it for the request the state names (if that request
        is still the open one), then wait for the job as the first request did."""
        principal = self.principal_of(ctx)
        job_id, request_id = self._verified_state(principal, params.request_state)
        responses = params.input_responses or {}
        answer = responses.get("approval") if isinstance(responses, Mapping) else None
        request = await self.client.approval_request(job_id)
        if answer is not None and request is not None and str(request["id"]) == request_id:
            await self.answer_from(job_id, request, answer, principal)
        progress_token = _wire_meta(ctx).get("progressToken")
        if isinstance(progress_token, bool) or not isinstance(progress_token, str | int):
            progress_token = None
        with self._slot(principal):
            end = await self._wait(ctx, job_id, progress_token, cancel_on_cancel=True,
                                   ask_in_band=True)
        if isinstance(end, types.InputRequiredResult):
            return end  # a person's yes is asked in-band; the client retries with it
        return _tool_result(end, self.marks)

    # --- interests (issue 44, point 2) ---------------------------------------------

    async def _hold_call_interest(self, ctx: Any, principal: str,
                                  task_id: str | None) -> str:
        """The interest a new call belongs to, held now: its MCP session's, else its
        task's, else its own request's. Renewed while its client shows signs (a request
        of the session, a poll of the task, the request itself still waiting); once they
        stop for interest_seconds, the call stops (its sidecar kills its tree)."""
        session = _session_id(ctx)
        owner = ["session", session] if session else \
            ["task", task_id] if task_id else ["call", secrets.token_urlsafe(18)]
        key = mcp_catalog.interest_key(self.secret, principal, owner)
        await self._renew(key, force=True)
        return key

    async def _renew(self, key: str | None, force: bool = False) -> None:
        """Renew interest ``key`` for interest_seconds, at most every third of it per
        replica (``force``: now). A database error is left to the next sign: the ttl is
        the slack."""
        if key is None:
            return
        ttl = self.options.interest_seconds
        now = time.monotonic()
        last = self._renewed.get(key)
        if not force and last is not None and now - last < ttl / 3:
            return
        try:
            await self.client.hold_interest(key, ttl, "sidecar mcp")
        except (SidecarError, *db.DATABASE_ERRORS) as exc:
            if force:
                raise
            log.warning("mcp: renewing an interest failed: %s", one_line(str(exc)))
            return
        self._renewed.pop(key, None)
        self._renewed[key] = now
        while len(self._renewed) > INTEREST_MEMORY:
            self._renewed.pop(next(iter(self._renewed)))

    async def _keep_interest(self, job_id: uuid.UUID) -> None:
        """While a request waits for job ``job_id``, renew the interest it belongs to
        (its client is connected); until cancelled."""
        try:
            key = (await self.client.get(job_id)).interest_key
        except (SidecarError, *db.DATABASE_ERRORS):
            return
        if key is None:
            return
        while True:
            await self._renew(key)
            await asyncio.sleep(self.options.interest_seconds / 3)

    async def _unfinished_call(self, tool: str, tags: Mapping[str, str],
                               arguments: Any) -> JobRef | None:
        """A call with no idempotency key (no session on the 2026-07-28 revision, no key
        in ``_meta``): the unfinished job of the same principal, request id, tool and
        arguments, if there is one, so a client's retry of that request joins its job
        instead of starting a second (issue 41). Only unfinished jobs: request ids repeat
        across a client's connections, and a later call must not get an old result."""
        wanted = {"mcp.principal": tags["mcp.principal"],
                  "mcp.tool_call": tags["mcp.tool_call"]}
        for row in await self.client.unfinished_like(tool, arguments, wanted):
            if "mcp.task" not in (row["tags"] or {}) and self._signed(row["tags"]):
                return JobRef(row["id"], False)
        return None

    def _agent_session(self, tool: str, principal: str, ctx: Any) -> str | None:
        """The agent session of this call (issue 43): the client's MCP session, for a tool
        whose profile is PROCESS=warm (a per-job tool keeps no state between calls);
        else None."""
        if not _warm(self.client.settings, tool):
            return None
        return mcp_catalog.agent_session_key(self.secret, principal, _session_id(ctx))

    def _idempotency_key(self, ctx: Any, principal: str, meta: Mapping[str, Any]) -> str | None:
        given = meta.get(IDEMPOTENCY_META)
        if given is not None:
            if not isinstance(given, str) or not 1 <= len(given) <= 256 \
                    or not given.isprintable():
                raise MCPError(code=INVALID_PARAMS, message=(
                    f"_meta {IDEMPOTENCY_META}: give 1-256 printable characters"))
            return mcp_catalog.client_idempotency_key(self.secret, principal, given)
        return mcp_catalog.call_idempotency_key(self.secret, principal, _session_id(ctx),
                                                ctx.request_id)

    def _signed(self, tags: Mapping[str, str] | None) -> bool:
        """Whether a job's mcp.* tags are this gateway's (a valid ``mcp.sig``): any
        producer may write tags, so only a signed job is listed, counted, joined or
        replayed (issue 41 point 2)."""
        return mcp_catalog.signed(self.secret, tags)

    @contextlib.contextmanager
    def _slot(self, principal: str):
        limit = self.options.max_calls_per_principal
        if self.in_flight.get(principal, 0) >= limit:
            raise MCPError(code=INVALID_REQUEST, message=(
                f"too many calls in flight for principal {principal} (at most {limit}); "
                "wait for one to end"))
        self.in_flight[principal] = self.in_flight.get(principal, 0) + 1
        try:
            yield
        finally:
            self.in_flight[principal] -= 1
            if not self.in_flight[principal]:
                del self.in_flight[principal]

    async def _wait(self, ctx: Any, job_id: uuid.UUID, progress_token: str | int | None,
                    cancel_on_cancel: bool, ask_in_band: bool = False) -> Any:
        """``_follow``; a cancelled request cancels the job (``cancel_on_cancel``, unless
        the gateway is stopping); losing sight of the job (the database away longer than
        the waiter's reconnects) is INTERNAL_ERROR saying the job goes on."""
        keeper = asyncio.create_task(self._keep_interest(job_id))
        try:
            return await self._follow(ctx, job_id, progress_token,
                                      ask_in_band and _modern_elicits(ctx))
        except _AskInBand as asking:  # the job goes on; the client answers and retries
            principal = self.principal_of(ctx)
            request = asking.request
            return types.InputRequiredResult(
                input_requests={"approval": types.ElicitRequest(
                    params=types.ElicitRequestFormParams(
                        message=_approval_message(request),
                        requested_schema=APPROVAL_SCHEMA))},
                request_state=self._approval_state(principal, job_id, request["id"]))
        except asyncio.CancelledError:
            if cancel_on_cancel and not self.stopping:
                await self._cancel(job_id, self.principal_of(ctx))
            raise
        except (SidecarError, *db.DATABASE_ERRORS) as exc:
            if isinstance(exc, JobNotFound):
                raise MCPError(code=INVALID_PARAMS, message=f"job {job_id} is gone "
                               "(pruned after its retention)") from None
            log.warning("mcp: lost sight of job %s: %s", job_id, one_line(str(exc)))
            raise MCPError(code=INTERNAL_ERROR, message=(
                f"the gateway lost sight of job {job_id}, which goes on; ask again (the "
                f"same request or task) to wait for it: {self._said(exc)[:200]}")) \
                from None
        finally:
            keeper.cancel()

    async def _follow(self, ctx: Any, job_id: uuid.UUID,
                      progress_token: str | int | None, in_band: bool = False) -> JobEnd:
        """The job's end; meanwhile, when the client sent a progress token, each progress
        report and, while the job is queued, why it waits (each time that changes, as its
        message) as ``notifications/progress``, whose ``progress`` only grows
        (wire.ProgressClock)."""
        clock = wire.ProgressClock()
        asking = _Elicitations(self, ctx, job_id) if _can_elicit(ctx) else None
        if in_band:  # a parked job's request may be open already
            request = await self.client.approval_request(job_id)
            if request is not None:
                raise _AskInBand(request)
        try:
            async for event in self.client.follow(job_id,
                                                  reasons=progress_token is not None):
                if isinstance(event, JobEnd):
                    return event
                if isinstance(event, JobProgress) \
                        and (event.message or "").startswith(APPROVAL_PROGRESS):
                    if in_band:
                        request = await self.client.approval_request(job_id)
                        if request is not None:
                            raise _AskInBand(request)
                    elif asking is not None:
                        await asking.check()
                if progress_token is not None and isinstance(event, JobProgress):
                    value = 0.0 if event.waiting is not None else event.value
                    progress, total = clock.next(value, event.attempt)
                    await ctx.session.send_progress_notification(
                        progress_token, progress, total=total, message=event.message,
                        related_request_id=_text_id(ctx.request_id))
        finally:
            if asking is not None:
                await asking.close()
        raise MCPError(code=INTERNAL_ERROR, message=f"job {job_id}: its events ended early")

    async def replay(self, session_id: str, request: str) -> dict[str, Any] | None:
        """The JSON-RPC result of the tools/call ``request`` (its id as text) of the
        session, from its job: waits (no polling) for the job to end. None when that
        request was not a job, or its job is gone (sidecar.mcp.resume: a resumed SSE
        stream, on any replica)."""
        rows = [row for row in await self.client.jobs(
            tags={"mcp.session": session_id[:256], "mcp.tool_call": _tag_id(request)},
            limit=TASK_LIST_LIMIT) if self._signed(row["tags"])]
        if not rows:
            return None
        try:
            async for event in self.client.follow(rows[0]["id"]):
                if isinstance(event, JobEnd):
                    return _tool_result(event, self.marks).model_dump(
                        by_alias=True, mode="json", exclude_none=True)
        except JobNotFound:
            return None
        return None

    # --- tasks (the job row is the task's whole state) ---------------------------------

    async def _check_task_bound(self, principal: str) -> None:
        """INVALID_REQUEST when the principal has max_tasks_per_principal unfinished
        tasks (counted in the database: the bound holds across replicas, give or take
        the tasks being created at the same moment)."""
        limit = self.options.max_tasks_per_principal
        wanted = {"mcp.principal": principal, "mcp.kind": "task"}
        count = await self.client.count_unfinished(wanted, limit)
        if count >= limit:  # some may be planted: count only the signed ones
            found = set()
            for state in ("queued", "running", "waiting"):
                for row in await self.client.jobs(tags=wanted, state=state,
                                                  limit=min(limit + 1, 1000)):
                    if self._signed(row["tags"]):
                        found.add(row["tags"].get("mcp.task"))
            count = len(found)
        if count >= limit:
            raise MCPError(code=INVALID_REQUEST, message=(
                f"too many unfinished tasks for principal {principal} (at most {limit}); "
                "wait for some to end or cancel them"))

    async def _own_task(self, ctx: Any, task_id: str) -> Any:
        """The job behind ``task_id`` if the requesting principal created it as a task;
        else the same INVALID_PARAMS as for a task that does not exist (another
        principal's task is not even confirmed to exist)."""
        principal = self.principal_of(ctx)
        missing = MCPError(code=INVALID_PARAMS, message=f"no task {task_id[:80]!r}")
        if not TASK_ID.fullmatch(task_id):
            raise missing
        rows = [row for row in await self.client.jobs(
            tags={"mcp.task": task_id, "mcp.principal": principal}, limit=TASK_LIST_LIMIT)
            if self._signed(row["tags"])]
        if not rows:
            raise missing
        try:  # the oldest: a copy of a signed task's tags is younger than the task
            return await self.client.get(rows[-1]["id"])
        except JobNotFound:  # pruned just now
            raise missing from None

    def _task(self, job: Any, with_result: bool = True) -> dict[str, Any]:
        """The task of a job row: its status, times, TTL (the retention of its state,
        SIDECAR_RETENTION_SECONDS / _FAILED_SECONDS; null when kept for ever), the poll
        interval and, once completed, the tool result (``isError`` for a failed job)."""
        status = _TASK_STATUS.get(job.state, "working")
        progress = job.progress if isinstance(job.progress, dict) else {}
        # lastUpdatedAt: the latest of creation, first claim, the tool's last progress
        # report (its statusMessage) and the end (issue 41, point 15)
        moments = [job.created_at, job.first_claimed_at, _moment(progress.get("at")),
                   job.finished_at]
        task: dict[str, Any] = {
            "taskId": job.tags["mcp.task"], "status": status, "createdAt": _iso(job.created_at),
            "lastUpdatedAt": _iso(max(m for m in moments if m is not None)),
            "ttlMs": self._ttl_ms(job.state), "pollIntervalMs": TASK_POLL_MS}
        if job.state == "queued":
            task["statusMessage"] = "queued"
        elif job.state == "running":
            note = progress.get("message")
            task["statusMessage"] = f"running, attempt {job.attempt}" + (
                f": {note}" if isinstance(note, str) and note else "")
        elif job.state == "failed" and isinstance(job.error, dict):
            task["statusMessage"] = f"{job.error.get('kind')}: {job.error.get('message')}"
        if with_result and status == "completed":
            end = JobEnd(job.id, job.state, job.attempt, job.result, job.error)
            task["result"] = _tool_result(end, self.marks).model_dump(by_alias=True, mode="json",
                                                          exclude_none=True)
        return task

    def _ttl_ms(self, state: str) -> int | None:
        """The retention of a job in ``state`` in ms (SIDECAR_RETENTION_SECONDS, or
        _FAILED_SECONDS for a failed one); None when kept for ever."""
        if self.settings is None:
            return None
        seconds = (self.settings.retention_failed_seconds if state == "failed"
                   else self.settings.retention_seconds)
        return int(seconds * 1000) or None

    async def _task_get(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        job = await self._own_task(ctx, params.task_id)
        await self._renew(job.interest_key)  # its client still polls it
        task = self._task(job)
        if job.state in ("running", "waiting"):  # its tool waits for a person's yes
            request = await self.client.approval_request(job.id)
            if request is not None:
                task["status"] = "input_required"
                task["statusMessage"] = (
                    f"waiting for a person's yes before the step {request['action']!r}: "
                    f"{request['summary']} (answer with sidecar approve {job.id}, "
                    f"attempt {request['attempt']}, token {request['fencing_token']})")
        if job.state == "queued":  # why it waits (one statement; ends it if expired)
            reason = await self.client.waiting_reason(job.id)
            if reason is not None:
                task["statusMessage"] = f"queued: {reason.message}"
        return {"resultType": "complete", **task}

    async def _task_result(self, ctx: Any, params: TaskParams) -> types.CallToolResult:
        """Wait for the task's job to end (no polling) and return its tool result."""
        job = await self._own_task(ctx, params.task_id)
        with self._slot(self.principal_of(ctx)):
            end = await self._wait(ctx, job.id, None, cancel_on_cancel=False)
        return _tool_result(end, self.marks)

    async def _task_cancel(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        """Cancel the task's job (its tree dies at its sidecar's next heartbeat); a
        finished task stays as it is."""
        job = await self._own_task(ctx, params.task_id)
        await self.client.cancel(job.id, by=cancelled_by(self.principal_of(ctx)))
        return {"resultType": "complete"}

    async def _task_list(self, ctx: Any, params: Any) -> dict[str, Any]:
        """The principal's newest tasks (at most TASK_LIST_LIMIT), without results."""
        principal = self.principal_of(ctx)
        rows = await self.client.jobs(tags={"mcp.principal": principal, "mcp.kind": "task"},
                                      limit=TASK_LIST_LIMIT)
        tasks = []
        seen: set[str] = set()
        for row in reversed(rows):  # oldest first: a copied task is listed once
            task_id = (row["tags"] or {}).get("mcp.task")
            if not task_id or task_id in seen or not self._signed(row["tags"]):
                continue
            seen.add(task_id)
            moments = [row["created_at"], row["finished_at"]]
            tasks.append({"taskId": task_id,
                          "status": _TASK_STATUS.get(row["state"], "working"),
                          "createdAt": _iso(row["created_at"]),
                          "lastUpdatedAt": _iso(max(m for m in moments if m is not None)),
                          "ttlMs": self._ttl_ms(row["state"]),
                          "pollIntervalMs": TASK_POLL_MS})
        tasks.reverse()  # newest first, as before
        return {"resultType": "complete", "tasks": tasks}

    async def _cancel(self, job_id: uuid.UUID, principal: str) -> None:
        """Cancel the job of a request that was cancelled (shielded: the request's own
        scope is being cancelled), journaled as by its MCP client."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_BOUND_SECONDS):
            try:
                await self.client.cancel(job_id, by=cancelled_by(principal))
                log.info("mcp call cancelled: job %s cancelled", job_id)
            except Exception as exc:  # noqa: BLE001 - logged; the request is gone anyway
                log.warning("mcp call cancelled, but cancelling job %s failed: %s", job_id,
                            one_line(str(exc)))


class TaskParams(types.RequestParams):
    """Params of tasks/get, tasks/result and tasks/cancel: ``taskId``."""

    task_id: str


class _AskInBand(Exception):  # noqa: N818 - a signal, not an error
    """The job a 2026-07-28 tools/call waits on asks a person's yes: the request ends with
    an input_required result asking it (the job goes on)."""

    def __init__(self, request: dict[str, Any]):
        super().__init__(str(request["id"]))
        self.request = request


def _approval_message(request: Mapping[str, Any]) -> str:
    """What the client's person is asked."""
    return (f"The tool asks your yes before the step {request['action']!r}: "
            f"{request['summary']}")


def _modern_elicits(ctx: Any) -> bool:
    """The request is on a 2026-07-28 connection and its client lists elicitation in its
    per-request capabilities (it can answer an input_required result)."""
    from mcp_types import CLIENT_CAPABILITIES_META_KEY
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    capabilities = _wire_meta(ctx).get(CLIENT_CAPABILITIES_META_KEY)
    return isinstance(capabilities, Mapping) and isinstance(capabilities.get("elicitation"),
                                                              Mapping)


def _can_elicit(ctx: Any) -> bool:
    """Whether the client of this request declared the elicitation capability."""
    check = getattr(getattr(ctx, "session", None), "check_client_capability", None)
    if check is None:
        return False
    try:
        return bool(check(types.ClientCapabilities(elicitation=types.ElicitationCapability())))
    except Exception:  # noqa: BLE001 - a client we cannot read is asked nothing
        return False


class _Elicitations:
    """The approval requests (issue 44, point 1) of the job a tools/call waits on, put to
    its client as elicitation/create requests, each once: the answer it gives (accept with
    approve true or false, or decline) is the job's answer, named for the attempt and
    fencing token that asked and journaled with the principal; a cancelled elicitation
    leaves the request open for another answer path (sidecar approve, the web view)."""

    def __init__(self, gateway: Gateway, ctx: Any, job_id: uuid.UUID):
        self.gateway, self.ctx, self.job_id = gateway, ctx, job_id
        self.asked: set[str] = set()
        self.tasks: set[asyncio.Task] = set()

    async def check(self) -> None:
        """Ask the client about the job's open request, if any and not asked yet."""
        try:
            request = await self.gateway.client.approval_request(self.job_id)
        except (SidecarError, *db.DATABASE_ERRORS):
            return
        if request is None or str(request["id"]) in self.asked:
            return
        self.asked.add(str(request["id"]))
        task = asyncio.create_task(self._ask(request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _ask(self, request: dict[str, Any]) -> None:
        gateway, ctx = self.gateway, self.ctx
        principal = gateway.principal_of(ctx)
        try:
            answer = await ctx.session.elicit_form(
                _approval_message(request), APPROVAL_SCHEMA,
                related_request_id=_text_id(ctx.request_id))
        except Exception as exc:  # noqa: BLE001 - no answer here: the request stays open
            log.info("mcp: elicitation for job %s got no answer: %s", self.job_id,
                     one_line(str(exc))[:200])
            return
        await gateway.answer_from(self.job_id, request, answer, principal)

    async def close(self) -> None:
        """Stop asking: the call ended or its request went away."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _wants_task(ctx: Any) -> bool:
    """The request is on a 2026-07-28 connection and its client lists the Tasks
    extension in its per-request capabilities."""
    from mcp_types import CLIENT_CAPABILITIES_META_KEY
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    capabilities = _wire_meta(ctx).get(CLIENT_CAPABILITIES_META_KEY)
    extensions = capabilities.get("extensions") if isinstance(capabilities, Mapping) else None
    return isinstance(extensions, Mapping) and TASKS_EXTENSION in extensions


def _moment(value: Any) -> dt.datetime | None:
    """A progress report's ``at`` (a datetime, or its ISO 8601 text in the jsonb) as an
    aware datetime; None when absent or not a time."""
    if isinstance(value, dt.datetime):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            moment = dt.datetime.fromisoformat(value)
            return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)
    return None


def _iso(moment: Any) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def check_catalog(catalog: Sequence[McpTool]) -> None:
    """ConfigError naming the tool when its input schema is not a valid JSON Schema of
    its own draft (``$schema``; default 2020-12)."""
    for tool in catalog:
        _validator(tool)


def _version() -> str:
    from sidecar import __version__

    return __version__


def _validator(tool: McpTool) -> Any:
    """A validator of the tool's schema, in the schema's own draft (``$schema``; default
    2020-12). ConfigError naming the tool when the schema is not valid in its draft."""
    cls = jsonschema.validators.validator_for(tool.input_schema,
                                              default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(tool.input_schema)
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"--tool {tool.name}: its MCP_INPUT_SCHEMA_FILE is not a valid "
                          f"JSON Schema: {one_line(exc.message)}") from None
    return cls(tool.input_schema)


def _check_arguments(tool: str, validator: Any, arguments: Any) -> None:
    """INVALID_PARAMS naming the first failing argument (by its JSON path) and why."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is not None:
        where = error.json_path if error.path else "arguments"
        raise MCPError(code=INVALID_PARAMS, message=(
            f"{tool}: {where}: {one_line(error.message)[:300]}"))


def _wire_meta(ctx: Any) -> Mapping[str, Any]:
    """The request's ``_meta`` as sent (wire keys: ``progressToken``, ours), or {}."""
    params = ctx.params if isinstance(ctx.params, Mapping) else {}
    meta = params.get("_meta")
    return meta if isinstance(meta, Mapping) else {}


def _text_id(request_id: Any) -> str:
    return "" if request_id is None else str(request_id)[:256]


def _conflict(message: str, meta: Mapping[str, Any], key: str | None) -> str:
    """An idempotency conflict in the client's terms: its own ``_meta`` key, or its
    session's request id, never the gateway's derived key."""
    found = re.search(r"job ([0-9a-f-]{36})", message)
    job = f" (job {found.group(1)})" if found else ""
    given = meta.get(IDEMPOTENCY_META)
    if isinstance(given, str):
        return (f"_meta {IDEMPOTENCY_META} {given[:80]!r} already names a call with other "
                f"arguments or another tool{job}; use another key")
    return (f"this request id was already used in this session for a call with other "
            f"arguments or another tool{job}; use a new request id")


async def _clear_validation(ctx: Any, call_next: Any,
                            said: Callable[[BaseException], str] = lambda e: one_line(str(e)),
                            ) -> Any:
    """Server middleware: params the SDK refuses (pydantic, before any handler) become
    INVALID_PARAMS naming the field and why, instead of a bare "Invalid request
    parameters"; a database failure in any handler is one INTERNAL_ERROR line (the
    request may be sent again), never a traceback."""
    from pydantic import ValidationError

    try:
        return await call_next(ctx)
    except (DatabaseUnavailable, *db.DATABASE_ERRORS) as exc:
        if ctx.request_id is None:
            raise
        log.warning("mcp %s: %s", ctx.method, one_line(str(exc)))
        raise MCPError(code=INTERNAL_ERROR, message=(
            f"{ctx.method}: the database did not answer; send it again: "
            f"{said(exc)[:200]}")) from None
    except ValidationError as exc:
        if ctx.request_id is None:  # a notification: nobody to answer
            raise
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())) or "params"
        raise MCPError(code=INVALID_PARAMS, message=(
            f"{ctx.method}: params.{where}: {one_line(str(first.get('msg', 'invalid')))}"
            [:300])) from None


def _tag_id(request_id: Any) -> str:
    """The request id as a tag value: as is when it is 1-256 printable characters, else
    (an empty id, control characters, a longer one: all legal JSON-RPC) ``sha256:`` and
    the first 32 hex digits of its digest."""
    text = "" if request_id is None else str(request_id)
    if 1 <= len(text) <= 256 and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _scope(ctx: Any) -> Mapping[str, Any] | None:
    """The ASGI scope of the request over HTTP (where ExactWire leaves its exact parse)."""
    request = getattr(ctx, "request", None)
    scope = getattr(request, "scope", None)
    return scope if isinstance(scope, Mapping) else None


def _dedupe(meta: Mapping[str, Any]) -> str | None:
    """The call's dedupe policy from ``_meta`` (DEDUPE_META), checked as every enqueue
    checks it; None when absent. MCPError (invalid params) naming the field otherwise."""
    given = meta.get(DEDUPE_META)
    if given is None:
        return None
    try:
        enqueue_args.dedupe_window_seconds(given, f"_meta {DEDUPE_META}")
    except UsageError as exc:
        raise MCPError(code=INVALID_PARAMS, message=str(exc)) from None
    return given


def _warm(settings: Any, tool: str) -> bool:
    try:
        return settings.profile(tool).process == "warm"
    except Exception:  # noqa: BLE001 - a tool the gateway's settings cannot describe
        return False


def _session_id(ctx: Any) -> str | None:
    """The Streamable HTTP session of the request (``Mcp-Session-Id``), if any."""
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    return headers.get("mcp-session-id") if headers is not None else None


def cancelled_by(principal: str) -> str:
    """The ``by`` of a cancel an MCP client asked for (a cancelled request, tasks/cancel):
    journaled as job_cancelled's ``by``; the job's error then says "cancelled by its MCP
    client" (sql/functions/cancel.sql), not "by an operator"."""
    return f"sidecar mcp ({principal})"


def _tool_result(end: JobEnd, marks: wire.Marks | None = None) -> types.CallToolResult:
    """The job's end as a tool result: its JSON result as text, every digit kept (and as
    structured content when it is an object, its exact numbers marked for ExactWire with
    ``marks``, else plain: sidecar.mcp.wire); a failed or cancelled job ``isError`` with
    its kind and message."""
    meta = {JOB_META: {"id": str(end.id), "state": end.state, "attempt": end.attempt}}
    if end.state == "succeeded":
        text = jsontext.dumps(end.result).decode()
        structured = None
        if isinstance(end.result, dict):
            structured = marks.encode(end.result) if marks is not None \
                else wire.plain(end.result)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=structured, _meta=meta)
    error = end.error if isinstance(end.error, dict) else {"message": str(end.error)}
    kind = error.get("kind") or end.state
    message = error.get("message") or ""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"{kind}: {message}".rstrip(": "))],
        structured_content={"error": {"kind": kind, "message": message},
                            "state": end.state},
        is_error=True, _meta=meta)


# --- transports -------------------------------------------------------------------------

class BearerAuth:
    """ASGI middleware: every request but ``exempt`` paths needs ``Authorization: Bearer
    TOKEN`` with a token of SIDECAR_MCP_TOKEN_FILE; else 401 with ``WWW-Authenticate``.
    The principal goes into the request's scope (``sidecar.principal``), where the call
    handler reads it per request."""

    def __init__(self, app: Any, tokens: Mapping[str, str], exempt: Sequence[str] = ()):
        self.app = app
        self.tokens = tokens
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        principal = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    principal = mcp_catalog.principal_of(self.tokens, token.strip())
                break
        if principal is None:
            await _plain(send, 401, b"a bearer token of SIDECAR_MCP_TOKEN_FILE is required\n",
                         [(b"www-authenticate", b'Bearer realm="sidecar-mcp"')])
            return
        scope["sidecar.principal"] = principal
        # The SDK binds a session to the credential that opened it (scope["user"]): a
        # session id used with another principal's token is answered 404, as unknown.
        scope["user"] = AuthenticatedUser(AccessToken(token="-", client_id=principal,
                                                      scopes=[]))
        await self.app(scope, receive, send)


async def _plain(send: Any, status: int, body: bytes,
                 headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _http_principal(ctx: Any) -> str:
    request = getattr(ctx, "request", None)
    principal = request.scope.get("sidecar.principal") if request is not None else None
    if not principal:  # BearerAuth lets nothing through without one
        raise MCPError(code=INVALID_REQUEST, message="no principal: a bearer token is required")
    return principal


def _stdio_principal(ctx: Any) -> str:
    return mcp_catalog.STDIO_PRINCIPAL


def build_http_app(gateway: Gateway, host: str, tokens: Mapping[str, str]) -> Any:
    """The ASGI application: MCP at ``/mcp`` (Streamable HTTP), ``/livez``; bearer
    tokens, Host/Origin checks and the body bound as GatewayOptions says."""
    from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from sidecar.mcp.resume import JobReplay
    from sidecar.mcp.sessions import SharedSessions

    options = gateway.options
    hosts = [*parsing.loopback_patterns(), *options.allowed_hosts]
    if not parsing.is_loopback(host) and host not in ("0.0.0.0", "::"):
        hosts.append(parsing.format_host_port(host, 0).rpartition(":")[0] + ":*")
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts,
        allowed_origins=[*parsing.loopback_patterns("http"), *options.allowed_origins])

    async def livez(request: Any) -> Any:
        return PlainTextResponse("ok\n")

    # The SDK's app, with its session manager replaced by one whose sessions every
    # replica serves (sidecar.mcp.sessions).
    manager = SharedSessions(
        gateway.server, gateway.client.store, security_settings=security,
        max_request_body_size=options.max_request_bytes, retry_interval=SSE_RETRY_MS,
        event_store_of=lambda session_id: JobReplay(session_id, gateway.replay))
    gateway.server._session_manager = manager
    app = Starlette(routes=[Route("/mcp", endpoint=StreamableHTTPASGIApp(manager)),
                            Route("/livez", livez)],
                    lifespan=lambda _app: manager.run())
    gateway.marks = wire.Marks()
    exact = wire.ExactWire(app, gateway.marks, options.max_request_bytes)
    return BearerAuth(exact, tokens, exempt=("/livez",))


async def serve_http(client: Client, catalog: Sequence[McpTool], options: GatewayOptions,
                     host: str, port: int, tokens: Mapping[str, str],
                     ready: Callable[[int], Awaitable[None] | None] | None = None) -> None:
    """Serve MCP over Streamable HTTP on ``host:port`` until SIGTERM/SIGINT (uvicorn's
    handlers); prints ``sidecar mcp: listening on http://HOST:PORT/mcp`` on stderr."""
    import sys

    import uvicorn

    gateway = Gateway(client, catalog, options, _http_principal)
    app = build_http_app(gateway, host, tokens)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def watch_stop() -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
        gateway.stopping = True  # before uvicorn cancels the handlers

    watcher = asyncio.create_task(watch_stop())
    try:
        config.load()
        print(f"sidecar mcp: listening on http://{parsing.format_host_port(host, port)}/mcp "
              f"({len(catalog)} tool(s): {', '.join(t.name for t in catalog)})",
              file=sys.stderr, flush=True)
        await server.serve()
    finally:
        watcher.cancel()


async def serve_stdio(client: Client, catalog: Sequence[McpTool],
                      options: GatewayOptions) -> None:
    """Serve MCP over this process's stdin/stdout (an MCP client started it) until stdin
    closes. The principal is ``stdio``: whoever could start the process."""
    from mcp.server.stdio import stdio_server

    gateway = Gateway(client, catalog, options, _stdio_principal)
    async with stdio_server() as (read, write):
        await gateway.server.run(read, write, gateway.server.create_initialization_options())


async def serve(settings: Settings, catalog: Sequence[McpTool], options: GatewayOptions, *,
                stdio: bool, host: str = "", port: int = 0,
                tokens: Mapping[str, str] | None = None) -> int:
    """Open a Client on the settings' database (DSN as the CLI resolves it) and serve
    over stdio, or over HTTP on ``host:port`` with ``tokens``; return 0 when stopped."""
    async with Client(settings=settings) as client:
        if stdio:
            await serve_stdio(client, catalog, options)
        else:
            await serve_http(client, catalog, options, host, port, tokens or {})
    return 0

