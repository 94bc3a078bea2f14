"""The caller's store: what a producer of jobs does in SQL (sidecar.client, the MCP gateway,
``sidecar enqueue``, ``wait`` and ``cancel``): enqueue, read and wait for its jobs, cancel
them. Statements by name from ``sql/queries.sql``; the schema, the bounded pool and the job
reads it shares with the operator come from sidecar.storage.store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import asyncpg

from sidecar.protocol.enqueue_args import EnqueueOptions
from sidecar.protocol.errors import IdempotencyConflict, UsageError
from sidecar.protocol.model import RawJson
from sidecar.storage import db
from sidecar.storage.queries import Q
from sidecar.storage.store import JobAccess, check_producer_key, settle_expired, shown_rows


class CallerStore(JobAccess):
    """The caller's SQL: enqueue, the waiter's read, the tag bound; and (JobAccess) read,
    list and cancel jobs. Bounded as StoreBase's."""

    # --- producers ----------------------------------------------------------------

    async def enqueue(
        self, tool: str, payload: Any, idempotency_key: str | None, max_attempts: int | None,
        details: dict[str, Any], options: EnqueueOptions | None = None,
        max_payload_bytes: int | None = None, conn: asyncpg.Connection | None = None,
    ) -> tuple[uuid.UUID, bool]:
        """Insert a queued job; return ``(id, created)``. ``payload`` is any JSON-able value,
        or RawJson text kept exactly as given (big integers, decimals). ``max_attempts``
        None leaves it to the profile of the sidecar that claims the job (migration 014);
        ``options``: priority, schedule, expiry, tags and trace context (issue 26);
        ``max_payload_bytes``: the limit on the payload as stored, None when the caller
        checked it already. ``details`` go into the ``job_enqueued`` journal row.
        ``conn``: a caller's own connection (sidecar.client), so the job is part of the
        transaction open on it (the wake-up leaves at its commit); default the pool.

        One statement, tool_job_enqueue (migration 014), the implementation the SQL
        function sidecar_enqueue shares: the same idempotency key returns the existing job
        and inserts nothing, also under concurrent calls. Raises IdempotencyConflict when
        the key already names a job of another tool or with another payload, and
        UsageError for a key in the namespace of next stages (``...:stage:N``, case F22)
        or any value the database refuses (SQLSTATE 22023, the message names the field).
        """
        key = check_producer_key(idempotency_key) if idempotency_key else None
        value = RawJson("null") if payload is None else payload
        o = options or EnqueueOptions()
        # JSON goes as text (the query casts it), so no connection's jsonb codec is needed.
        args = (tool, db.encode_json(value), key, o.priority, o.run_after, o.run_in,
                o.expires_in, db.encode_json(o.tags), max_attempts, o.traceparent,
                o.tracestate, max_payload_bytes, db.encode_json(details), o.expires_at,
                o.concurrency_key, o.session, o.dedupe, o.interest)
        try:
            if conn is None:
                row = await self.db.fetchrow(Q["enqueue_job"], *args, timeout=self.timeout)
            else:
                row = await db.run(conn, "fetchrow", Q["enqueue_job"], *args,
                                   timeout=self.timeout)
        except asyncpg.InvalidParameterValueError as exc:  # 22023: the field is named
            raise UsageError(exc.args[0] if exc.args else str(exc)) from None
        except asyncpg.UniqueViolationError as exc:  # the key names another operation
            raise IdempotencyConflict(exc.args[0] if exc.args else str(exc)) from None
        except asyncpg.SerializationError as exc:  # the key's holder kept vanishing
            raise IdempotencyConflict(exc.args[0] if exc.args else str(exc)) from None
        except asyncpg.DataError as exc:  # e.g. \u0000 in a string: valid JSON, not jsonb
            message = exc.args[0] if exc.args else str(exc)
            detail = getattr(exc, "detail", None)
            raise UsageError(f"the payload cannot be stored as jsonb: {message}"
                             + (f"; {detail}" if detail else "")) from None
        return row["id"], row["created"]

    # --- interest leases (issue 44, point 2; migration 029) ----------------------------

    async def hold_interest(self, key: str, ttl_seconds: float,
                            holder: str | None) -> asyncpg.Record:
        """Hold or renew the interest ``key`` for ``ttl_seconds`` (1 s to 1 day) from now
        by the database's clock; ``generation`` and ``expires_at``. UsageError for a bad key,
        ttl or holder (the database's 22023, naming the field)."""
        try:
            return await self.db.fetchrow(Q["hold_interest"], key, ttl_seconds, holder,
                                          timeout=self.timeout)
        except asyncpg.InvalidParameterValueError as exc:
            raise UsageError(exc.args[0] if exc.args else str(exc)) from None

    async def release_interest(self, key: str) -> list[asyncpg.Record]:
        """Let go of the interest ``key`` now: its unfinished calls stop (queued ones end
        expired, running ones are cancelled, kind abandoned_by_caller). The calls ended."""
        try:
            return await self.db.fetch(Q["release_interest"], key, timeout=self.timeout)
        except asyncpg.InvalidParameterValueError as exc:
            raise UsageError(exc.args[0] if exc.args else str(exc)) from None

    async def unfinished_jobs_tagged(self, tags: dict[str, str], up_to: int) -> int:
        """How many queued or running jobs carry all of ``tags``, counted up to ``up_to``
        + 1 (enough to tell a bound is reached)."""
        return await self.db.fetchval(Q["unfinished_jobs_tagged"], tags, up_to,
                                      timeout=self.timeout)

    # --- the MCP gateway's sessions (issue 41, point 15; migration 024) -------------

    async def mcp_sessions_live(self, principal: str, idle_seconds: float, up_to: int) -> int:
        """How many MCP sessions of ``principal`` were used within ``idle_seconds``,
        counted up to ``up_to`` + 1."""
        return await self.db.fetchval(Q["mcp_sessions_live"], principal, idle_seconds, up_to,
                                      timeout=self.timeout)

    async def mcp_session_open(self, session_id: str, principal: str,
                               idle_seconds: float) -> None:
        """Record the session ``principal`` opened; delete a batch of those unused for
        longer than ``idle_seconds``. asyncpg.UniqueViolationError for an id already
        recorded (never skipped silently, case F22)."""
        await self.db.execute(Q["mcp_session_open"], session_id, principal, idle_seconds,
                              timeout=self.timeout)

    async def mcp_session_principal(self, session_id: str, idle_seconds: float) -> str | None:
        """The principal of the session used within ``idle_seconds`` (marked used now), or
        None when there is none."""
        return await self.db.fetchval(Q["mcp_session_principal"], session_id, idle_seconds,
                                      timeout=self.timeout)

    async def mcp_session_close(self, session_id: str, principal: str) -> None:
        """Forget the session its client ended (with the token of ``principal``)."""
        await self.db.execute(Q["mcp_session_close"], session_id, principal,
                              timeout=self.timeout)

    async def unfinished_same_jobs(self, tool: str, payload: Any, tags: dict[str, str],
                                   limit: int) -> list[asyncpg.Record]:
        """``id, tags`` of the oldest queued or running jobs (at most ``limit``) of
        ``tool`` with ``payload`` (any JSON value, compared as jsonb) whose tags include
        all of ``tags``. One statement."""
        return await self.db.fetch(Q["unfinished_same_jobs"], tags, tool,
                                   db.encode_json(payload), limit, timeout=self.timeout)

    @staticmethod
    async def jobs_to_wait_for(conn: asyncpg.Connection, job_ids: Iterable[uuid.UUID],
                               timeout: float) -> list[dict[str, Any]]:
        """``id, state, attempt, result, error, progress, settle_in_s`` of each job of
        ``job_ids`` that exists, on the caller's own connection (the waiter's, which
        LISTENs first: sidecar.client.waiting), after settling those past their expiry
        (``settle_expired``), ``shown`` (secrets scrubbed: what a waiter prints or
        returns); ``settle_in_s``: seconds until an unfinished job's expiry would be
        settled by a read (None: no expiry). Bounded by ``timeout`` seconds per
        statement."""
        ids = [str(job_id) for job_id in job_ids]
        await settle_expired(conn, ids, timeout)  # issue 41: expired while all are down
        return shown_rows(await db.run(conn, "fetch", Q["jobs_to_wait_for"], ids,
                                       timeout=timeout))

    async def wait_rows(self, job_ids: Iterable[uuid.UUID]) -> list[dict[str, Any]]:
        """The waiter's read through the pool (sidecar.client.waiting.WaitHub): ``id,
        state, attempt, result, error, progress, settle_in_s, expired`` of each job of
        ``job_ids`` that exists, after settling those past their expiry
        (``settle_expired``), ``shown`` (secrets scrubbed); ``expired``: queued past its
        expires_at. Bounded as every pool call."""
        ids = [str(j) for j in job_ids]
        await settle_expired(self.db, ids, self.timeout)
        return shown_rows(await self.db.fetch(Q["jobs_to_wait_for"], ids))

    async def wait_reasons(self, job_ids: Iterable[uuid.UUID], explain: bool = True,
                           ) -> list[dict[str, Any]]:
        """``id, reason, ahead, detail`` of each queued job of ``job_ids`` (at most 1,000):
        why it waits (SQL tool_job_wait_reasons, functions/waiting.sql; reason None when a
        claim could take it now); no row without ``explain``. Jobs among them whose start
        deadline passed end ``expired`` first (their waiters hear the end). Bounded as
        every pool call. ``shown``: a pause's reason is free text (issue 41, point 7)."""
        return shown_rows(await self.db.fetch(Q["wait_reasons"], [str(j) for j in job_ids],
                                              explain))
