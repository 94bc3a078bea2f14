"""The operator's store: what a person running the queue does in SQL (``sidecar web``,
``jobs``, ``show``, ``events``, ``retry``, flow control, ``prune``, ``migrate --grant``).
Statements by name from ``sql/queries.sql``; the schema, the bounded pool, the job reads and
cancel (shared with callers) and the retention's deletes (shared with the worker's pruner)
come from sidecar.storage.store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import asyncpg

from sidecar.protocol.masking import mask_text, mask_url
from sidecar.storage import db
from sidecar.storage.queries import Q
from sidecar.storage.store import JobAccess, Pruning, shown, shown_rows


class OperatorStore(JobAccess, Pruning):
    """The operator's SQL: roles, retries, a job's journal, next stages and forwarding,
    flow control and the web view's reads; and (JobAccess) read, list and cancel jobs,
    (Pruning) the retention's deletes. Bounded as StoreBase's."""

    # --- roles --------------------------------------------------------------------

    async def grant_roles(self, worker: str | None, scaler: str | None,
                          caller: str | None = None, web: str | None = None) -> list[str]:
        """Grant ``worker`` the worker's privileges, ``scaler`` EXECUTE on tool_job_demand,
        ``caller`` what enqueue, wait, get and cancel need and ``web`` what ``sidecar web``
        reads and the definer functions of its actions (sql/roles.sql; each None is
        skipped), in one transaction; return the statements run. Every named role's
        revokes (what earlier releases granted and this one does not: the callers' direct
        writes, the workers' UPDATE of the journals) run before any grant, so a role named
        twice ends with the rights of both (issue 41, point 2). Run as the schema owner
        after migrating; the roles themselves are the DBA's (asyncpg's UndefinedObjectError
        when one does not exist, and nothing is granted)."""
        roles = (("worker", worker), ("scaler", scaler), ("caller", caller), ("web", web))
        done: list[str] = []
        async with self.pool.acquire() as conn, conn.transaction():
            for phase in ("revokes", "grants"):
                for kind, role in roles:
                    name = f"{kind}_{phase}"
                    if role is None or name not in Q:
                        continue
                    for row in await conn.fetch(Q[name], role, timeout=self.timeout):
                        await conn.execute(row[0], timeout=self.timeout)
                        done.append(row[0])
        return done

    # --- retries (case F14) -------------------------------------------------------

    async def retry(self, job_id: uuid.UUID | None, state: str | None, tool: str | None,
                    by: str, tags: dict[str, str] | None = None) -> list[asyncpg.Record]:
        """Requeue failed or cancelled jobs with fresh attempts (journaled ``job_retried``
        with ``by``, the operator's description): the one ``job_id``, or every one of
        ``tool`` and/or whose tags include all of ``tags`` (in ``state`` when given).
        Returns ``id, tool, previous_state`` of each.

        A job cancelled while it ran is left alone until its owner acknowledged the
        cancel (its tree is dead) or the lease it held then has ended (by then the owner
        gave it up by its local deadline): see ``unacknowledged_cancels`` (case F14)."""
        return await self.db.fetch(Q["retry_jobs"], job_id, state, tool, by, tags or None,
                                   timeout=self.timeout)

    async def retry_when_acknowledged(
        self, job_id: uuid.UUID | None, state: str | None, tool: str | None, by: str,
        tags: dict[str, str] | None = None, poll_seconds: float = 0.2,
    ) -> tuple[list[asyncpg.Record], float]:
        """``retry``, and again until no cancelled job of the selection is left waiting
        for its owner (case F14): a job cancelled while it ran is retried only once its
        owner acknowledged the cancel (its tree is dead) or the lease it held has ended,
        so the wait is bounded by the database's own lease end. What is pending is read
        before each retry, so an acknowledgement between the two is not missed. Returns
        the rows of every job retried and the seconds waited (what ``sidecar retry`` and
        ``sidecar web``'s retry run)."""
        started, rows = time.monotonic(), []
        while True:
            pending = await self.unacknowledged_cancels(job_id, state, tool, tags)
            rows += await self.retry(job_id, state, tool, by, tags)
            if not pending:
                return rows, time.monotonic() - started
            wait = max(row["wait_seconds"] for row in pending)
            await asyncio.sleep(min(poll_seconds, max(wait, 0.0) + 0.01))

    async def unacknowledged_cancels(self, job_id: uuid.UUID | None, state: str | None,
                                     tool: str | None,
                                     tags: dict[str, str] | None = None
                                     ) -> list[asyncpg.Record]:
        """Cancelled jobs ``retry`` would take but must not yet (case F14): ``id``,
        ``owner_id``, ``fencing_token`` and ``wait_seconds`` (until the cancelled lease
        ends by the database's clock, the longest the owner may still run the tree)."""
        return await self.db.fetch(Q["unacknowledged_cancels"], job_id, state, tool,
                                   tags or None, timeout=self.timeout)

    # --- inspection ---------------------------------------------------------------

    async def job_events(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """The journal of one job, oldest first, ``shown`` (secrets scrubbed)."""
        return shown_rows(await self.db.fetch(Q["job_events"], job_id, timeout=self.timeout))

    async def children(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """The next-stage jobs a job created (P19), ``shown``."""
        return shown_rows(await self.db.fetch(Q["children_of_job"], job_id,
                                              timeout=self.timeout))

    async def session_of_job(self, job_id: uuid.UUID) -> dict[str, Any] | None:
        """The agent session a job belongs to (issue 43), ``shown``: its state (live,
        ended, lost), owner, generation, lease, start, last call, end and reason, calls;
        None for a job without one, or whose session has not started yet."""
        rows = shown_rows(await self.db.fetch(Q["session_of_job"], job_id,
                                              timeout=self.timeout))
        return rows[0] if rows else None

    async def live_sessions(self, tool: str | None, limit: int) -> list[dict[str, Any]]:
        """The live agent sessions (of ``tool``; None: every tool), newest first, at most
        ``limit``, ``shown`` (issue 43)."""
        return shown_rows(await self.db.fetch(Q["live_sessions"], tool, limit,
                                              timeout=self.timeout))

    async def outbox_of_job(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """The forwarding rows of one job (for ``sidecar show`` and the web view),
        ``shown``, and each RESULT_URL as ``masking.mask_url`` shows it (its credentials
        ``***``, also where its delivery error quotes them): the row keeps the URL whole
        for delivery, and the process that shows it rarely knows the workers'
        RESULT_URL."""
        rows = shown_rows(await self.db.fetch(Q["outbox_of_job"], job_id,
                                              timeout=self.timeout))
        for row in rows:
            url = row["url"] or ""
            row["url"] = mask_url(url)
            if row["last_error"]:
                row["last_error"] = mask_text(row["last_error"], [url])
        return rows

    async def outbox_redeliver(self, job_id: uuid.UUID, by: str) -> list[int]:
        """Make the dead-lettered outbox rows of ``job_id`` pending again with fresh
        attempts and age (journaled ``forward_redelivery`` with ``by``); returns their ids,
        empty when the job has none."""
        rows = await self.db.fetch(Q["outbox_redeliver"], job_id, by, timeout=self.timeout)
        return [row["id"] for row in rows]

    async def running_jobs(self, tool: str) -> list[uuid.UUID]:
        """Ids of the jobs of ``tool`` running now."""
        return [row["id"] for row in await self.db.fetch(Q["running_jobs_of_tool"], tool,
                                                         timeout=self.timeout)]

    # --- flow control (issue 27) --------------------------------------------------

    async def set_limits(self, tool: str, changes: dict[str, Any], by: str) -> int:
        """Change ``tool``'s limits fleet-wide (``changes`` from
        sidecar.protocol.flow.limit_changes:
        only the fields given; None clears one), journaled ``limits_set`` with ``by``;
        every idle sidecar of the tool is woken. Returns how many were woken."""
        row = await self.db.fetchrow(Q["set_tool_limits"], tool, db.encode_json(changes),
                                     by, timeout=self.timeout)
        return row["woken"]

    async def limits(self, tool: str | None = None) -> list[dict[str, Any]]:
        """Every tool with a flow row (or only ``tool``): limits, pause, and its running
        (live lease) and queued jobs now, ``shown`` (a pause reason is free text)."""
        return shown_rows(await self.db.fetch(Q["tool_limits"], tool, timeout=self.timeout))

    async def pause(self, tool: str, reason: str | None, by: str) -> asyncpg.Record:
        """Stop every claim of ``tool`` fleet-wide from now on (running jobs go on),
        journaled ``tool_paused``; ``reason`` None keeps an earlier one. Returns
        ``paused_at, pause_reason, was_paused``."""
        return await self.db.fetchrow(Q["pause_tool"], tool, reason, by,
                                      timeout=self.timeout)

    async def known_tools(self, tool: str, most: int) -> tuple[bool, list[str]]:
        """Whether ``tool`` was ever seen (a job, a limit or pause, an idle sidecar of it)
        and up to ``most`` names of tools that were, sorted: what ``sidecar pause`` checks
        before pausing a tool (a typo must not look like success, issue 41)."""
        row = await self.db.fetchrow(Q["known_tools"], tool, most, timeout=self.timeout)
        return row["known"], list(row["tools"])

    async def resume(self, tool: str, by: str) -> bool:
        """Let claims of ``tool`` start again and wake its idle sidecars, journaled
        ``tool_resumed``. False when it was not paused."""
        return await self.db.fetchrow(Q["resume_tool"], tool, by,
                                      timeout=self.timeout) is not None

    async def flow_events(self, tool: str | None, limit: int) -> list[asyncpg.Record]:
        """The newest ``limit`` flow changes (of ``tool``, or of every tool), oldest
        first: ``id, tool, event, at, details``, ``shown``."""
        return shown_rows(await self.db.fetch(Q["flow_events"], tool, limit,
                                              timeout=self.timeout))

    # --- the operator's web view (sidecar web, issue 30) --------------------------

    async def web_read(self, name: str, *args: Any, method: str = "fetch") -> Any:
        """Run the named read ``name`` of the web view in a transaction of its own that
        plans it for its parameters (web_custom_plans; behind a transaction pooler with
        the sidecar's settings too): ``fetch`` rows, ``fetchrow`` one or None, or
        ``fetchval``, each ``shown`` (secrets scrubbed). Bounded by ``timeout`` for
        acquiring and again for the reads (TimeoutError), a connection that failed
        terminated (as BoundedPool)."""
        # Bounded end to end as BoundedPool's calls are: a transaction block's ROLLBACK
        # on the way out of a timeout would wait forever on a blackholed path, so the
        # connection is terminated instead (its transaction ends with it).
        async with asyncio.timeout(self.timeout):
            conn = await self.pool.acquire()
        try:
            async with asyncio.timeout(self.timeout):
                await conn.execute("BEGIN")
                begin = db.local_settings_sql(conn)
                if begin is not None:
                    await conn.execute(begin)
                await conn.execute(Q["web_custom_plans"])
                result = await getattr(conn, method)(Q[name], *args)
                await conn.execute("COMMIT")
            return shown_rows(result) if method == "fetch" else shown(result)
        except BaseException:
            conn.terminate()
            raise
        finally:
            await self.pool.release(conn, timeout=self.timeout)

    # --- the web view's sessions and failed logins (issue 41, migration 025) ---------

    async def web_session_create(self, key_sha256: bytes, principal: str, csrf: str,
                                 seconds: float, per_principal: int, total: int) -> None:
        """Store a session of ``principal`` (only the sha256 of its key, 32 bytes) with
        its CSRF token, ending ``seconds`` from now by the database's clock; expired
        sessions go first, then the oldest beyond ``per_principal`` of the principal's and
        ``total`` in all (this one counted)."""
        await self.db.execute(Q["web_session_create"], key_sha256, principal, csrf,
                              seconds, per_principal, total, timeout=self.timeout)

    async def web_session(self, key_sha256: bytes) -> asyncpg.Record | None:
        """The live session whose key hashes to ``key_sha256``: ``principal, csrf``, or
        None (none, or expired)."""
        return await self.db.fetchrow(Q["web_session_get"], key_sha256,
                                      timeout=self.timeout)

    async def web_session_delete(self, key_sha256: bytes) -> None:
        """Delete the session whose key hashes to ``key_sha256`` (logging out)."""
        await self.db.execute(Q["web_session_delete"], key_sha256, timeout=self.timeout)

    async def web_login_lock(self, source: str, token_sha256: str | None
                             ) -> asyncpg.Record | None:
        """The lock on ``source`` or on the token whose sha256 (hex) is ``token_sha256``:
        ``scope`` ('source' or 'token') and ``retry_after_s`` (whole seconds), or None."""
        return await self.db.fetchrow(Q["web_login_lock"], source, token_sha256,
                                      timeout=self.timeout)

    async def web_login_failed(self, source: str, token_sha256: str, window_s: float,
                               allowed: int, lock_s: float, max_rows: int
                               ) -> list[asyncpg.Record]:
        """Count one failed login for ``source`` and for the token hash in a window of
        ``window_s`` seconds; the ``allowed``-th failure of a window locks its subject for
        ``lock_s`` seconds; at most ``max_rows`` rows are kept. Returns ``scope,
        failures, locked_now`` per subject (locked_now: this failure locked it)."""
        return await self.db.fetch(Q["web_login_failed"], source, token_sha256, window_s,
                                   allowed, lock_s, max_rows, timeout=self.timeout)
