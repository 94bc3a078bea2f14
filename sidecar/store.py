"""The only module that runs SQL. Statements come by name from ``sql/queries.sql``.

Fenced methods (``*_if_owner``) return True only when this owner still held the
lease by the database's clock (P5, P6); False means "not ours any more": the
caller must not publish anything.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg

from sidecar import db
from sidecar.enqueue_args import EnqueueOptions, stored_trace_context
from sidecar.errors import IdempotencyConflict, NextStageConflict, UsageError
from sidecar.flow import ClaimHeld, Held
from sidecar.masking import SECRETS
from sidecar.model import ClaimedJob, JobState, NextStage, RawJson, new_job_id
from sidecar.queries import Q, Repeatable, migrations, repeatables
from sidecar.vocabulary import AttemptId

# A claim's max_attempts for a job enqueued without one, when the caller names no profile
# value (the default of SIDECAR_MAX_ATTEMPTS).
DEFAULT_MAX_ATTEMPTS = 3
# Jobs one expiry sweep ends at most (fail_expired).
EXPIRY_BATCH = 500

# Key of the transaction-scoped advisory lock that serialises migrations.
MIGRATION_LOCK_KEY = 0x5DECA4_0001

# The idempotency keys of next stages (P19): '{parent key}:stage:{n}'. Reserved: no
# producer may enqueue one (case F22), so a parent's stage key is only ever its own.
STAGE_KEY_SUFFIX = re.compile(r":stage:[0-9]+\Z")
# The unique constraint of tool_jobs.idempotency_key (migration 001).
_JOB_KEY_CONSTRAINT = "tool_jobs_idempotency_key_key"


def stage_key(parent_key: str, stage: int) -> str:
    """The idempotency key of stage ``stage`` (1, 2, ...) of the job keyed ``parent_key``
    at stage ``stage - 1``, as finish_job_if_owner derives it."""
    return f"{parent_key}:stage:{stage}"


def check_producer_key(key: str) -> str:
    """Return ``key`` if a producer may use it; raise UsageError (exit 2) when it ends in
    ``:stage:N``, the namespace of the keys next stages get (case F22)."""
    if STAGE_KEY_SUFFIX.search(key):
        raise UsageError(f"--idempotency-key {key!r} ends in ':stage:N', which is reserved "
                         "for the next stages a job creates (P19); use another key, e.g. "
                         f"{STAGE_KEY_SUFFIX.sub(lambda m: m.group(0).replace(':', '-'), key)!r}")
    return key


@dataclass(frozen=True)
class Renewal:
    """One renewed lease: the new ``lease_until`` and seconds left by the database clock."""

    lease_until: dt.datetime
    lease_remaining: float


def _trace_context(row: asyncpg.Record) -> dict[str, Any]:
    """``traceparent``/``tracestate`` of a claimed row, each dropped unless it is W3C trace
    context, and the names of those dropped (``trace_context_ignored``, logged when the
    attempt starts): the enqueue function checks them, a row written around it may hold
    anything (an environment string the kernel refuses to exec, issue 30)."""
    given = (row["traceparent"], row["tracestate"])
    kept = stored_trace_context(*given)
    return {"traceparent": kept[0], "tracestate": kept[1],
            "trace_context_ignored": tuple(
                name for name, was, now in zip(("traceparent", "tracestate"), given, kept,
                                               strict=True) if was is not None and now is None)}


class BoundedPool:
    """The asyncpg pool calls the Store makes, each bounded in time end to end (case F2).

    Acquiring waits at most ``timeout`` seconds (a new connection on a blackholed path
    must not hang), the statement has the same client-side timeout, and a connection that
    failed or timed out is terminated (transport aborted) before it goes back, so the pool
    never waits on a cancel or reset over a dead path and never reuses a connection in an
    unknown protocol state.
    """

    def __init__(self, pool: asyncpg.Pool, timeout: float):
        self.pool = pool
        self.timeout = timeout

    async def _call(self, method: str, query: str, *args: Any, timeout: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        # Bounded here, not by acquire(timeout=): asyncpg runs a timed acquire as a task
        # of its own (wait_for), one more task per statement on the event loop.
        async with asyncio.timeout(timeout):
            conn = await self.pool.acquire()
        try:
            return await db.run(conn, method, query, *args, timeout=timeout)
        except BaseException:
            conn.terminate()
            raise
        finally:
            await self.pool.release(conn, timeout=timeout)

    async def fetch(self, query: str, *args: Any, timeout: float | None = None):
        return await self._call("fetch", query, *args, timeout=timeout)

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None):
        return await self._call("fetchrow", query, *args, timeout=timeout)

    async def fetchval(self, query: str, *args: Any, timeout: float | None = None):
        return await self._call("fetchval", query, *args, timeout=timeout)

    async def execute(self, query: str, *args: Any, timeout: float | None = None):
        return await self._call("execute", query, *args, timeout=timeout)


class Store:
    """SQL access over an asyncpg pool; every call is bounded by ``timeout`` (seconds),
    acquiring a connection included (see BoundedPool)."""

    def __init__(self, pool: asyncpg.Pool, timeout: float):
        self.pool = pool
        self.timeout = timeout
        self.db = BoundedPool(pool, timeout)

    # --- schema -------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Apply the migrations not yet recorded, then the repeatable definitions that
        changed (see upgrade); return the migration versions applied now."""
        return (await self.upgrade())[0]

    async def upgrade(self) -> tuple[list[int], list[str]]:
        """Apply the migrations not yet recorded, then every repeatable definition
        (sql/functions/*.sql: functions, views, triggers) whose checksum differs from the
        one recorded in sidecar_schema_repeatables, in queries.REPEATABLE_ORDER; return the
        versions and the file names applied now.

        Safe to run twice and from two processes at once: one transaction holding
        a transaction-scoped advisory lock. A schema already current is only read, so a
        worker whose role may not create anything (docs/operations.md) still starts. A
        database whose schema is newer than this release's last migration keeps its
        definitions: they are the newer release's, and an older one (running there by
        compatible-from) must not put its own back.
        """
        wanted = migrations()
        files = repeatables()
        last = wanted[-1].version
        try:
            done = {row[0] for row in await self.db.fetch(Q["applied_migrations"],
                                                          timeout=self.timeout)}
            if {migration.version for migration in wanted} <= done and (
                    max(done) > last or self._current(
                        files, await self.db.fetch(Q["applied_repeatables"],
                                                   timeout=self.timeout))):
                return [], []
        except asyncpg.UndefinedTableError:
            pass
        applied_now: list[int] = []
        defined_now: list[str] = []
        async with self.pool.acquire() as conn, conn.transaction():
            # A migration may rewrite a large table and waits its turn behind another
            # migrator: no statement or lock bound of the lease path applies (case F18).
            await conn.execute(db.local_settings_sql(conn, statement_timeout="0",
                                                     lock_timeout="0"))
            await conn.execute(Q["lock_migrations"], MIGRATION_LOCK_KEY)
            await conn.execute(Q["create_migrations_table"])
            await conn.execute(Q["add_migrations_compatible_from"])
            await conn.execute(Q["create_repeatables_table"])
            done = {row[0] for row in await conn.fetch(Q["applied_migrations"])}
            for migration in wanted:
                if migration.version not in done:
                    if not migration.only_comments:
                        await conn.execute(migration.sql)
                    await conn.execute(Q["record_migration"], migration.version, migration.name,
                                       migration.compatible_from)
                    applied_now.append(migration.version)
            if max(done, default=0) > last:
                return applied_now, defined_now
            recorded = {row[0]: row[1] for row in await conn.fetch(Q["applied_repeatables"])}
            changed = [f for f in files if recorded.get(f.name) != f.checksum]
            if changed:
                await conn.fetchval(Q["pin_search_path"])
            for repeatable in changed:
                await conn.execute(repeatable.sql)
                await conn.execute(Q["forget_repeatable"], repeatable.name)
                await conn.execute(Q["record_repeatable"], repeatable.name, repeatable.checksum)
                defined_now.append(repeatable.name)
        return applied_now, defined_now

    @staticmethod
    def _current(files: list[Repeatable], recorded: Iterable[asyncpg.Record]) -> bool:
        """Whether the ledger ``recorded`` (name, checksum) holds every file as it is."""
        checksums = {row[0]: row[1] for row in recorded}
        return all(checksums.get(f.name) == f.checksum for f in files)

    async def schema_compatibility(self, expected: int) -> tuple[int, bool]:
        """(highest applied migration, whether a release built for schema ``expected``
        may run on it): the same version, or a newer one whose every migration above
        ``expected`` declares ``-- compatible-from:`` at most ``expected`` (case F24). A
        table without the column (written by older releases) is compatible only at the
        same version."""
        try:
            row = await self.db.fetchrow(Q["schema_compatibility"], expected,
                                         timeout=self.timeout)
        except asyncpg.UndefinedColumnError:
            version = await self.schema_version()
            return version, version == expected
        except asyncpg.UndefinedTableError:
            return 0, expected == 0
        return row["version"], bool(row["compatible"])

    async def schema_version(self) -> int:
        """Highest applied migration, 0 when none (or the table is missing)."""
        try:
            return await self.db.fetchval(Q["schema_version"], timeout=self.timeout)
        except asyncpg.UndefinedTableError:
            return 0

    async def grant_roles(self, worker: str | None, scaler: str | None,
                          caller: str | None = None) -> list[str]:
        """Grant ``worker`` the worker's privileges, ``scaler`` EXECUTE on tool_job_demand
        and ``caller`` what enqueue, wait, get and cancel need (sql/roles.sql; each None
        is skipped), in one transaction; return the statements run. Run as the schema
        owner after migrating; the roles themselves are the DBA's (asyncpg's
        UndefinedObjectError when one does not exist, and nothing is granted)."""
        done: list[str] = []
        async with self.pool.acquire() as conn, conn.transaction():
            for name, role in (("worker_grants", worker), ("scaler_grants", scaler),
                               ("caller_grants", caller)):
                if role is None:
                    continue
                for row in await conn.fetch(Q[name], role, timeout=self.timeout):
                    await conn.execute(row[0], timeout=self.timeout)
                    done.append(row[0])
        return done

    # --- producers ----------------------------------------------------------

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
                o.concurrency_key)
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

    async def cancel(self, job_id: uuid.UUID | None,
                     tags: dict[str, str] | None = None,
                     by: str | None = None) -> dict[uuid.UUID, str]:
        """Cancel a job (``job_id``), or every queued or running job whose tags include
        all of ``tags``, and their later stages that are still queued or running; return
        ``{id: previous state}`` of every job cancelled (empty when none was). A running
        one's owner kills its tree at its next heartbeat. ``by``: who asked, journaled as
        ``job_cancelled``'s ``by`` (issue 30; None: not said)."""
        rows = await self.db.fetch(Q["cancel_job"], job_id, tags or None, by,
                                   timeout=self.timeout)
        return {row["id"]: row["previous_state"] for row in rows}

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

    async def acknowledge_cancel_if_owner(self, job: ClaimedJob, owner_id: str,
                                          details: dict[str, Any]) -> bool:
        """The owner of a cancelled attempt says its tree is dead (case F14): the job may
        be retried at once. Journaled ``cancel_acknowledged`` with ``details``; False
        when the row is not a cancel of this attempt (nothing to acknowledge)."""
        row = await self.db.fetchrow(Q["acknowledge_cancel_if_owner"], job.id, owner_id,
                                     job.fencing_token, details, timeout=self.timeout)
        return row is not None

    async def children(self, job_id: uuid.UUID) -> list[asyncpg.Record]:
        """The next-stage jobs a job created (P19)."""
        return await self.db.fetch(Q["children_of_job"], job_id, timeout=self.timeout)

    # --- the lease protocol -------------------------------------------------

    async def fail_exhausted_leases(self, tool: str) -> list[asyncpg.Record]:
        """Expired running jobs of ``tool`` with no attempt left -> failed (P16)."""
        return await self.db.fetch(Q["fail_exhausted_leases"], tool, timeout=self.timeout)

    async def fail_expired(self, limit: int = EXPIRY_BATCH) -> list[asyncpg.Record]:
        """Up to ``limit`` jobs of any tool whose expiry passed before an attempt could
        start (queued, or under an expired lease) -> failed, kind ``expired``, journaled
        ``job_expired`` (issue 26). Returns ``id, tool, fencing_token, attempt`` of each."""
        return await self.db.fetch(Q["fail_expired_jobs"], limit, timeout=self.timeout)

    async def claim(self, tool: str, owner_id: str, lease_seconds: float,
                    max_lifetime_seconds: float | None = None,
                    max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> ClaimedJob | ClaimHeld | None:
        """Claim one job of ``tool`` (P4) or return None when none is eligible, or
        ClaimHeld when a flow limit of the tool (issue 27: pause, caps, rates) held every
        eligible one back. ``claim_many`` with a limit of 1; the same arguments."""
        jobs, held = await self.claim_many(tool, owner_id, lease_seconds, 1,
                                           max_lifetime_seconds, max_attempts)
        return jobs[0] if jobs else held

    async def claim_many(self, tool: str, owner_id: str, lease_seconds: float, limit: int,
                         max_lifetime_seconds: float | None = None,
                         max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                         ) -> tuple[list[ClaimedJob], ClaimHeld | None]:
        """Claim up to ``limit`` jobs of ``tool`` in one statement (P4; issue 28: one
        statement for all of a sidecar's free slots, not one per slot), each with its own
        fencing token, attempt, lease of ``lease_seconds`` and ``job_claimed`` journal row.

        Returns ``(jobs, held)``: the jobs claimed, in no particular order, and ClaimHeld
        when a flow limit of the tool (issue 27: pause, caps, rates) held the rest back
        (else None). Fewer jobs than ``limit`` and no ``held``: nothing more is claimable
        now. ``max_lifetime_seconds`` (P12) makes each job also carry how much of its
        lifetime is left, counted from its first claim by the database's clock.
        ``max_attempts`` (the profile's MAX_ATTEMPTS) is written on a job enqueued without
        one (migration 014). ``limit`` below 1 counts as 1. Raises what asyncpg raises."""
        rows = await self.db.fetch(
            Q["claim_job"], tool, owner_id, lease_seconds, max_lifetime_seconds,
            max_attempts, max(1, limit), timeout=self.timeout)
        jobs: list[ClaimedJob] = []
        held: ClaimHeld | None = None
        for row in rows:
            if row["blocked"] is not None:
                held = ClaimHeld(Held(row["blocked"]), row["retry_in"])
                continue
            jobs.append(ClaimedJob(
                id=row["id"], tool=row["tool"], payload_text=row["payload_text"],
                fencing_token=row["fencing_token"], attempt=row["attempt"],
                max_attempts=row["max_attempts"], lease_until=row["lease_until"],
                lease_remaining=row["lease_remaining"],
                idempotency_key=row["idempotency_key"],
                reclaimed=row["previous_state"] == JobState.RUNNING,
                checkpoint_text=row["checkpoint_text"], stage=row["stage"],
                lifetime_remaining=row["lifetime_remaining"],
                **_trace_context(row)))
        return jobs, held

    async def release_unheld_claims(self, tool: str, owner_id: str,
                                    held: Iterable[AttemptId]) -> list[asyncpg.Record]:
        """Case F16: settle claims whose answer was lost. Every job of ``tool`` running under
        ``owner_id`` whose attempt is not in ``held`` goes back to the queue without
        spending the attempt, journaled ``lease_released`` (reason ``claim_answer_lost``).
        Returns ``id, fencing_token`` of each."""
        leases = [{"id": str(a.job_id), "token": a.fencing_token} for a in held]
        return await self.db.fetch(Q["release_unheld_claims"], tool, owner_id, leases,
                                   timeout=self.timeout)

    async def journaled_outcome(self, attempt: AttemptId, event: str) -> dict | None:
        """Case F16: the details of ``event`` journaled for ``attempt`` (the proof that a
        fenced write whose answer was lost did commit), or None."""
        return await self.db.fetchval(Q["journaled_outcome"], attempt.job_id,
                                      attempt.fencing_token, event, timeout=self.timeout)

    @staticmethod
    async def extend_leases_if_owner(
        conn: asyncpg.Connection, owner_id: str, held: Iterable[tuple[uuid.UUID, int]],
        lease_seconds: float, timeout: float,
    ) -> dict[AttemptId, Renewal | None]:
        """Renew every lease in ``held`` ((job id, token) pairs) in one statement (P5).

        Runs on the caller's dedicated connection. Keyed by attempt (job id, token), never
        by job id alone (case F14): ``Renewal`` for each lease renewed, ``None`` for each
        whose row another session holds locked (skipped, never waited on: ownership
        unknown for this round, case F17). An attempt missing from the result is no
        longer ours: expired, taken over, cancelled or changed by policy.
        """
        leases = [{"id": str(job_id), "token": token} for job_id, token in held]
        rows = await db.run(conn, "fetch", Q["extend_leases_if_owner"], owner_id, leases,
                            lease_seconds, timeout=timeout)
        return {AttemptId(row["id"], row["fencing_token"]): None if row["locked"]
                else Renewal(row["lease_until"], row["lease_remaining"]) for row in rows}

    @staticmethod
    async def expire_lease_if_owner(
        conn: asyncpg.Connection, owner_id: str, job_id: uuid.UUID, token: int, timeout: float,
    ) -> bool:
        """End our own lease now (after abandoning the job locally); False when it was not
        ours any more (expired, taken over, cancelled)."""
        row = await db.run(conn, "fetchrow", Q["expire_lease_if_owner"], owner_id, job_id,
                           token, timeout=timeout)
        return row is not None

    @staticmethod
    async def record_event_on(
        conn: asyncpg.Connection, job_id: uuid.UUID, token: int | None, event: str,
        details: dict[str, Any], timeout: float,
    ) -> None:
        """Append one journal event on the given connection."""
        await db.run(conn, "execute", Q["record_event"], job_id, token, event, details,
                     timeout=timeout)

    async def finish_if_owner(
        self, job: ClaimedJob, owner_id: str, state: JobState, result: RawJson | None,
        error: dict[str, Any] | None, event: str, details: dict[str, Any],
        result_url: str | None = None, next_stage: NextStage | None = None,
        earlier: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Write the terminal ``state`` (succeeded or failed, P6) and journal ``event``;
        False when not the owner.
        With ``result_url``, a success also queues its forwarding (outbox); with
        ``next_stage``, it creates the next stage's job; both in the same statement.
        ``earlier`` events of the attempt (``{event, age_s, details}``, see
        ``record_events``) are journaled before ``event`` by the same statement; none is
        written when it returns False.

        Raises NextStageConflict (nothing written) when the next stage's key is held by a
        job that is not this job's own stage (case F22); a repeated completion that meets
        its own stage creates no second one."""
        try:
            row = await self.db.fetchrow(
                Q["finish_job_if_owner"], job.id, owner_id, job.fencing_token, state, result,
                error, event, details, result_url,
                next_stage.tool if next_stage else None,
                (RawJson("null") if next_stage.payload is None else next_stage.payload)
                if next_stage else None,
                next_stage.max_attempts if next_stage else None,
                new_job_id() if next_stage else None, earlier or None,
                timeout=self.timeout,
            )
        except asyncpg.UniqueViolationError as exc:
            if next_stage is None or exc.constraint_name != _JOB_KEY_CONSTRAINT:
                raise
            key = stage_key(job.idempotency_key, job.stage + 1)
            holder = await self.db.fetchrow(Q["find_job_by_idempotency_key"], key,
                                            RawJson("null"), timeout=self.timeout)
            raise NextStageConflict(key, holder["id"] if holder else None) from None
        return row is not None

    async def requeue_if_owner(
        self, job: ClaimedJob, owner_id: str, error: dict[str, Any], backoff_seconds: float,
        details: dict[str, Any], earlier: list[dict[str, Any]] | None = None,
    ) -> dt.datetime | None:
        """Back to queued with ``run_after = now() + backoff_seconds``; None when not the
        owner. ``earlier`` as for ``finish_if_owner``."""
        row = await self.db.fetchrow(
            Q["requeue_job_if_owner"], job.id, owner_id, job.fencing_token, error,
            backoff_seconds, details, earlier or None, timeout=self.timeout,
        )
        return row["run_after"] if row else None

    async def release_if_owner(
        self, job: ClaimedJob, owner_id: str, details: dict[str, Any],
        earlier: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Give the job back (queued, attempt not spent) for another sidecar; False if not
        ours. ``earlier`` as for ``finish_if_owner``."""
        row = await self.db.fetchrow(
            Q["release_lease_if_owner"], job.id, owner_id, job.fencing_token, details,
            earlier or None, timeout=self.timeout,
        )
        return row is not None

    async def save_checkpoint_if_owner(
        self, job: ClaimedJob, owner_id: str, checkpoint: RawJson, details: dict[str, Any],
    ) -> bool:
        """Store the tool's progress for the next attempt; False when not the owner."""
        row = await self.db.fetchrow(
            Q["save_checkpoint_if_owner"], job.id, owner_id, job.fencing_token, checkpoint,
            details, timeout=self.timeout)
        return row is not None

    async def report_progress_if_owner(
        self, job: ClaimedJob, owner_id: str, progress: dict[str, Any],
        details: dict[str, Any], journal: bool,
    ) -> bool:
        """Store a tool's progress report (``progress``: ``{"value": 0..1 or None,
        "message": str or None}``) on the job row with the database's time and the attempt,
        and NOTIFY the job's waiters (issue 26); journaled as ``job_progress`` (with
        ``details``) only when ``journal``. False, nothing stored or sent, when this attempt
        no longer owns the lease (P5/P6)."""
        row = await self.db.fetchrow(
            Q["report_progress_if_owner"], job.id, owner_id, job.fencing_token, progress,
            details, journal, timeout=self.timeout)
        return row is not None

    @staticmethod
    async def jobs_to_wait_for(conn: asyncpg.Connection, job_ids: Iterable[uuid.UUID],
                               timeout: float) -> list[asyncpg.Record]:
        """``id, state, attempt, result, error, progress`` of each job of ``job_ids`` that
        exists, on the caller's own connection (the waiter's, which LISTENs first:
        sidecar.waiting). Bounded by ``timeout`` seconds."""
        ids = [str(job_id) for job_id in job_ids]
        return await db.run(conn, "fetch", Q["jobs_to_wait_for"], ids, timeout=timeout)

    async def record_event(
        self, job_id: uuid.UUID, token: int | None, event: str, details: dict[str, Any]
    ) -> None:
        """Append one event to the journal (``tool_job_events``)."""
        await self.db.execute(
            Q["record_event"], job_id, token, event, details, timeout=self.timeout
        )

    async def record_events(
        self, job_id: uuid.UUID, token: int | None, earlier: list[dict[str, Any]],
        event: str | None = None, details: dict[str, Any] | None = None,
    ) -> None:
        """Append ``earlier`` events, each ``{"event": name, "age_s": seconds ago,
        "details": {...}}`` and journaled at ``now() - age_s``, then ``event`` (if any)
        with ``details``, in that order, in one statement."""
        await self.db.execute(
            Q["record_events"], job_id, token, earlier, event, details or {},
            timeout=self.timeout)

    async def ownership(self, job_id: uuid.UUID) -> asyncpg.Record | None:
        """``state``, ``owner_id`` and ``fencing_token`` of a job (to explain a lost lease)."""
        return await self.db.fetchrow(Q["ownership_of_job"], job_id, timeout=self.timeout)

    async def sample_tool(self, tool: str, period: float) -> asyncpg.Record:
        """One poll's reading of ``tool`` (issue 28), in one statement: ``sweep`` (True when
        this caller takes the fleet's turn to run the lease and expiry sweeps: the tool's
        last sweep is at least ``period`` seconds old), ``depth`` (jobs claimable now:
        queued and due, or under an expired lease), ``queue_age`` (seconds the oldest queued
        job has been due, by the database's clock; 0 when none), ``forward_backlog``
        (pending outbox rows of the tool), ``has_flow`` and the tool's flow row
        with its slots taken (``running``; NULLs without flow control)."""
        return await self.db.fetchrow(Q["sample_tool"], tool, period, timeout=self.timeout)

    async def unfinished_jobs_tagged(self, tags: dict[str, str], up_to: int) -> int:
        """How many queued or running jobs carry all of ``tags``, counted up to ``up_to``
        + 1 (enough to tell a bound is reached)."""
        return await self.db.fetchval(Q["unfinished_jobs_tagged"], tags, up_to,
                                      timeout=self.timeout)

    async def unfinished_jobs(self, tool: str) -> int:
        """Jobs of ``tool`` still queued or running."""
        return await self.db.fetchval(Q["unfinished_jobs_of_tool"], tool, timeout=self.timeout)

    # --- wake-ups -------------------------------------------------------------

    async def register_idle(self, owner_id: str, tool: str, channel: str) -> None:
        """Record that this sidecar has room for a job of ``tool`` and found none: the
        next job queued for the tool wakes it (one NOTIFY on ``channel``), or another idle
        one, not every sidecar (migration 008, ``tool_job_wake``)."""
        await self.db.execute(Q["register_idle_sidecar"], owner_id, tool, channel,
                              timeout=self.timeout)

    async def unregister_idle(self, owner_id: str) -> None:
        """Take this sidecar off the idle list (it stops, or stops listening)."""
        await self.db.execute(Q["unregister_idle_sidecar"], owner_id, timeout=self.timeout)

    async def forget_full_key_buckets(self) -> None:
        """Delete per-key rate buckets that have refilled (or whose tool has no per-key
        rate any more): a missing bucket is a full one, so the table holds only keys
        claimed recently (issue 27); and clear the pending cancels whose lease ended
        unconfirmed (their slot is no longer counted)."""
        await self.db.execute(Q["forget_full_key_buckets"], timeout=self.timeout)
        await self.db.execute(Q["forget_ended_cancels"], timeout=self.timeout)

    async def prune_flow_events(self, older_than_seconds: float) -> int:
        """Delete the journal of flow changes (``tool_flow_events``) older than
        ``older_than_seconds``; returns how many rows went."""
        status = await self.db.execute(Q["prune_flow_events"], older_than_seconds,
                                       timeout=self.timeout)
        return int(status.split()[-1])

    async def forget_dead_idle(self) -> None:
        """Delete idle registrations their sidecars stopped refreshing long ago."""
        await self.db.execute(Q["forget_dead_idle_sidecars"], timeout=self.timeout)

    # --- retention ----------------------------------------------------------

    async def prune_finished(self, state: str, older_than_seconds: float, batch: int,
                             lock_key: int) -> asyncpg.Record:
        """Delete one batch (at most ``batch`` jobs) of ``state`` finished more than
        ``older_than_seconds`` ago, with their journal and outbox rows, unless another
        pruner holds ``lock_key``. Returns ``locked`` (False: another pruner ran, nothing
        was deleted) and the ``jobs``, ``events`` and ``outbox`` rows deleted."""
        return await self.db.fetchrow(Q["prune_finished_jobs"], state, older_than_seconds,
                                      batch, lock_key, timeout=self.timeout)

    async def count_prunable(self, state: str, older_than_seconds: float) -> asyncpg.Record:
        """What ``prune_finished`` would delete in all its batches (``jobs``, ``events``,
        ``outbox``), deleting nothing."""
        return await self.db.fetchrow(Q["count_prunable_jobs"], state, older_than_seconds,
                                      timeout=self.timeout)

    # --- result outbox ------------------------------------------------------

    async def claim_outbox(self, owner_id: str, lease_seconds: float,
                           limit: int) -> list[asyncpg.Record]:
        """Take up to ``limit`` deliverable outbox rows under a forwarding lease."""
        return await self.db.fetch(Q["claim_outbox_rows"], owner_id, lease_seconds, limit,
                                     timeout=self.timeout)

    async def outbox_delivered(self, row_id: int, owner_id: str, status: int) -> bool:
        """Mark delivered and journal ``effect_forwarded``; False if the row was not ours."""
        return await self.db.fetchrow(Q["outbox_delivered_if_owner"], row_id, owner_id,
                                        status, timeout=self.timeout) is not None

    async def outbox_dead_letter(self, row_id: int, owner_id: str, status: int | None,
                                 reason: str, kind: str = "refused",
                                 details: dict[str, Any] | None = None) -> bool:
        """Dead-letter and journal ``forward_dead_lettered`` with ``kind`` (``refused``,
        also journaled as ``effect_rejected``; ``redirect``, ``max_attempts``, ``max_age``,
        case F21) and ``details``; False if the row was not ours."""
        return await self.db.fetchrow(Q["outbox_dead_letter_if_owner"], row_id, owner_id,
                                        status, SECRETS.scrub(reason), kind, details or {},
                                        timeout=self.timeout) is not None

    async def outbox_redeliver(self, job_id: uuid.UUID, by: str) -> list[int]:
        """Make the dead-lettered outbox rows of ``job_id`` pending again with fresh
        attempts and age (journaled ``forward_redelivery`` with ``by``); returns their ids,
        empty when the job has none."""
        rows = await self.db.fetch(Q["outbox_redeliver"], job_id, by, timeout=self.timeout)
        return [row["id"] for row in rows]

    async def outbox_retry_later(self, row_id: int, owner_id: str, delay_seconds: float,
                                 status: int | None, error: str) -> bool:
        """Give the row back for another try after ``delay_seconds``. ``error`` (the
        receiver's answer or the connection error) is stored scrubbed, as every text
        column a message reaches (``masking.SECRETS``); jsonb values are scrubbed by
        sidecar.db's encoder."""
        return await self.db.fetchrow(Q["outbox_retry_later_if_owner"], row_id, owner_id,
                                        delay_seconds, status, SECRETS.scrub(error),
                                        timeout=self.timeout) is not None

    async def due_outbox_rows(self, tool: str, within_seconds: float) -> int:
        """Outbox rows of ``tool`` pending and due for delivery within ``within_seconds``."""
        return await self.db.fetchval(Q["due_outbox_rows_of_tool"], tool, within_seconds,
                                        timeout=self.timeout)

    async def outbox_of_job(self, job_id: uuid.UUID) -> list[asyncpg.Record]:
        """The forwarding rows of one job (for ``sidecar show``)."""
        return await self.db.fetch(Q["outbox_of_job"], job_id, timeout=self.timeout)

    # --- inspection ---------------------------------------------------------

    async def get_job(self, job_id: uuid.UUID) -> asyncpg.Record | None:
        """The whole row of one job, or None."""
        return await self.db.fetchrow(Q["get_job"], job_id, timeout=self.timeout)

    async def job_events(self, job_id: uuid.UUID) -> list[asyncpg.Record]:
        """The journal of one job, oldest first."""
        return await self.db.fetch(Q["job_events"], job_id, timeout=self.timeout)

    # --- flow control (issue 27) --------------------------------------------

    async def set_limits(self, tool: str, changes: dict[str, Any], by: str) -> int:
        """Change ``tool``'s limits fleet-wide (``changes`` from sidecar.flow.limit_changes:
        only the fields given; None clears one), journaled ``limits_set`` with ``by``;
        every idle sidecar of the tool is woken. Returns how many were woken."""
        row = await self.db.fetchrow(Q["set_tool_limits"], tool, db.encode_json(changes),
                                     by, timeout=self.timeout)
        return row["woken"]

    async def limits(self, tool: str | None = None) -> list[asyncpg.Record]:
        """Every tool with a flow row (or only ``tool``): limits, pause, and its running
        (live lease) and queued jobs now."""
        return await self.db.fetch(Q["tool_limits"], tool, timeout=self.timeout)

    async def pause(self, tool: str, reason: str | None, by: str) -> asyncpg.Record:
        """Stop every claim of ``tool`` fleet-wide from now on (running jobs go on),
        journaled ``tool_paused``; ``reason`` None keeps an earlier one. Returns
        ``paused_at, pause_reason, was_paused``."""
        return await self.db.fetchrow(Q["pause_tool"], tool, reason, by,
                                      timeout=self.timeout)

    async def resume(self, tool: str, by: str) -> bool:
        """Let claims of ``tool`` start again and wake its idle sidecars, journaled
        ``tool_resumed``. False when it was not paused."""
        return await self.db.fetchrow(Q["resume_tool"], tool, by,
                                      timeout=self.timeout) is not None

    async def drop_rate_turns(self, tool: str, owner_id: str) -> None:
        """Give up ``owner_id``'s turns at ``tool``'s rate (a sidecar that stops), so the
        others do not wait for them."""
        await self.db.execute(Q["drop_rate_turns"], tool, owner_id, timeout=self.timeout)

    async def running_jobs(self, tool: str) -> list[uuid.UUID]:
        """Ids of the jobs of ``tool`` running now."""
        return [row["id"] for row in await self.db.fetch(Q["running_jobs_of_tool"], tool,
                                                         timeout=self.timeout)]

    async def flow_events(self, tool: str | None, limit: int) -> list[asyncpg.Record]:
        """The newest ``limit`` flow changes (of ``tool``, or of every tool), oldest
        first: ``id, tool, event, at, details``."""
        return await self.db.fetch(Q["flow_events"], tool, limit, timeout=self.timeout)

    # --- the operator's web view (sidecar web, issue 30) ------------------------

    async def web_read(self, name: str, *args: Any, method: str = "fetch") -> Any:
        """Run the named read ``name`` of the web view in a transaction of its own that
        plans it for its parameters (web_custom_plans; behind a transaction pooler with
        the sidecar's settings too): ``fetch`` rows, ``fetchrow`` one or None, or
        ``fetchval``. Bounded by ``timeout`` for acquiring and again for the reads
        (TimeoutError), a connection that failed terminated (as BoundedPool)."""
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
            return result
        except BaseException:
            conn.terminate()
            raise
        finally:
            await self.pool.release(conn, timeout=self.timeout)

    async def list_jobs(
        self, state: str | None, tool: str | None, limit: int,
        tags: dict[str, str] | None = None,
    ) -> list[asyncpg.Record]:
        """Newest jobs first, filtered by state, tool and tags (all of them)."""
        return await self.db.fetch(Q["list_jobs"], state, tool, limit, tags or None,
                                   timeout=self.timeout)
