"""MCP sessions every gateway replica serves (issue 41, point 15).

On the 2025 protocol revisions a client opens a session (``initialize``) and sends its id
(``Mcp-Session-Id``) with every later request. The SDK's session manager keeps sessions in
the memory of one process: behind a Service with two replicas, or after a restart, a
session's next request answers 404 "Session not found". ``SharedSessions`` keeps them in
the database too (``sidecar_mcp_sessions``, migration 024: the id, the principal whose
token opened it, when it was last used): a request whose session this process does not
know, but the database does for the same principal, is served by a session rebuilt here
(born initialized, speaking the request's ``MCP-Protocol-Version``). Nothing else of a
session needs keeping: a call's state is its job row.

Bounds: a session unused for ``idle_seconds`` (default 30 minutes, the SDK's idle timeout)
is gone on every replica; a principal has at most ``max_per_principal`` live sessions
(one more ``initialize`` is answered 503); a client's ``DELETE`` forgets it everywhere.
A session rebuilt elsewhere has no standalone GET stream of the old process (server
notifications without a request: this gateway sends none).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.connection import Connection
from mcp.server.runner import serve_connection
from mcp.server.streamable_http import (
    MCP_SESSION_ID_HEADER,
    EventStore,
    StreamableHTTPServerTransport,
)
from mcp.server.streamable_http_manager import (
    DEFAULT_SESSION_IDLE_TIMEOUT,
    StreamableHTTPSessionManager,
    _error_response,
)
from mcp.shared.jsonrpc_dispatcher import JSONRPCDispatcher
from mcp_types import DEFAULT_NEGOTIATED_VERSION, INTERNAL_ERROR
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sidecar.protocol.errors import DatabaseUnavailable, one_line
from sidecar.storage import db

log = logging.getLogger("sidecar.mcp")

# A principal's live sessions, at most (one more initialize is answered 503).
DEFAULT_MAX_SESSIONS_PER_PRINCIPAL = 1000
# A session's use is written at most this often per replica (seconds).
TOUCH_EVERY_SECONDS = 60.0


class SharedSessions(StreamableHTTPSessionManager):
    """The SDK's session manager with its sessions also in the database (see the module).
    ``store``: the gateway's caller store (sidecar.client.Client.store);
    ``event_store_of(session_id)``: the EventStore of a session's transport
    (sidecar.mcp.resume), or None. Other arguments as the SDK's."""

    def __init__(self, app: Any, store: Any, *,
                 event_store_of: Callable[[str], EventStore | None] = lambda _sid: None,
                 idle_seconds: float = DEFAULT_SESSION_IDLE_TIMEOUT,
                 max_per_principal: int = DEFAULT_MAX_SESSIONS_PER_PRINCIPAL,
                 **options: Any):
        super().__init__(app, session_idle_timeout=idle_seconds, **options)
        self.store = store
        self.event_store_of = event_store_of
        self.idle_seconds = idle_seconds
        self.max_per_principal = max_per_principal
        self._touched: dict[str, float] = {}

    async def _handle_stateful_request(self, scope: Any, receive: Any, send: Any) -> None:
        session_id = _header(scope, MCP_SESSION_ID_HEADER)
        principal = scope.get("sidecar.principal") or ""
        try:
            if session_id is None:
                if scope.get("method") == "POST" and await self._full(principal):
                    await _error_response(
                        f"too many open sessions for principal {principal} (at most "
                        f"{self.max_per_principal}); end one (DELETE) or let it expire",
                        503, INTERNAL_ERROR)(scope, receive, send)
                    return
            elif session_id in self._server_instances:
                await self._touch(session_id)
            elif await self.store.mcp_session_principal(session_id[:256],
                                                        self.idle_seconds) == principal:
                self._touched[session_id] = time.monotonic()
                await self._adopt(session_id, scope)
        except (DatabaseUnavailable, *db.DATABASE_ERRORS) as exc:
            log.warning("mcp sessions: the database did not answer: %s", one_line(str(exc)))
            await _error_response("the database did not answer; send the request again",
                                  503, INTERNAL_ERROR)(scope, receive, send)
            return
        await super()._handle_stateful_request(scope, receive, send)
        if session_id is not None and scope.get("method") == "DELETE" \
                and session_id not in self._server_instances:
            self._touched.pop(session_id, None)
            await self._quietly(self.store.mcp_session_close(session_id[:256], principal))

    async def _full(self, principal: str) -> bool:
        live = await self.store.mcp_sessions_live(principal, self.idle_seconds,
                                                  self.max_per_principal)
        return live >= self.max_per_principal

    async def _touch(self, session_id: str) -> None:
        """Mark the session used, at most every TOUCH_EVERY_SECONDS per replica."""
        now = time.monotonic()
        if now - self._touched.get(session_id, 0.0) >= TOUCH_EVERY_SECONDS:
            self._touched[session_id] = now
            await self._quietly(self.store.mcp_session_principal(session_id[:256],
                                                                 self.idle_seconds))

    async def _quietly(self, statement: Any) -> None:
        try:
            await statement
        except (DatabaseUnavailable, *db.DATABASE_ERRORS) as exc:
            log.warning("mcp sessions: the database did not answer: %s", one_line(str(exc)))

    def _admit_session(self, requestor: Any) -> StreamableHTTPServerTransport | None:
        transport = super()._admit_session(requestor)
        if transport is not None and transport.mcp_session_id is not None:
            # The SDK gives every session the manager's one EventStore; ours is per
            # session (its replay needs the session's id), set before the session serves.
            transport._event_store = self.event_store_of(transport.mcp_session_id)
        return transport

    async def _serve_opening_request(self, http_transport: StreamableHTTPServerTransport,
                                     scope: Any, receive: Any, send: Any) -> None:
        """The SDK's, then the session established is recorded for every replica."""
        await super()._serve_opening_request(http_transport, scope, receive, send)
        session_id = http_transport.mcp_session_id
        if session_id is not None and session_id in self._server_instances:
            self._touched[session_id] = time.monotonic()
            await self._quietly(self.store.mcp_session_open(
                session_id, scope.get("sidecar.principal") or "", self.idle_seconds))

    async def _adopt(self, session_id: str, scope: Any) -> None:
        """Serve here a session another replica (or this one before a restart) opened:
        a transport with its id, owned by the request's credential, whose connection is
        born initialized at the request's protocol version."""
        user = scope.get("user")
        requestor = authorization_context(user) if isinstance(user, AuthenticatedUser) \
            else None
        version = _header(scope, "mcp-protocol-version")
        if version not in HANDSHAKE_PROTOCOL_VERSIONS:
            version = DEFAULT_NEGOTIATED_VERSION
        async with self._session_creation_lock:
            if session_id in self._server_instances:
                return
            if self.max_sessions is not None and \
                    len(self._server_instances) >= self.max_sessions:
                return  # answered 404 by the SDK: the client opens a new session
            transport = StreamableHTTPServerTransport(
                mcp_session_id=session_id, is_json_response_enabled=self.json_response,
                event_store=self.event_store_of(session_id),
                security_settings=self.security_settings, retry_interval=self.retry_interval,
                idle_timeout=self.session_idle_timeout)
            if requestor is not None:
                self._session_owners[session_id] = requestor
            self._server_instances[session_id] = transport
        log.info("mcp session %s adopted from the database", session_id[:64])

        async def run(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            async with transport.connect() as (read_stream, write_stream):
                task_status.started()
                try:
                    idle = transport.idle_scope or anyio.CancelScope()
                    with idle:
                        dispatcher = JSONRPCDispatcher(read_stream, write_stream,
                                                       inline_methods=frozenset({"initialize"}))
                        connection = Connection.for_loop(dispatcher, session_id=session_id,
                                                         protocol_version_hint=version)
                        connection.initialized.set()  # it was initialized where it opened
                        await serve_connection(self.app, dispatcher, connection=connection,
                                               lifespan_state=self._lifespan_state)
                except Exception:  # noqa: BLE001 - as the SDK's own session task
                    log.exception("mcp session %s crashed", session_id[:64])
                finally:
                    await self._discard_session(session_id, transport)

        assert self._task_group is not None
        await self._task_group.start(run)


def _header(scope: Any, name: str) -> str | None:
    wanted = name.lower().encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key == wanted:
            return value.decode("latin-1")
    return None
