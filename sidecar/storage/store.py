"""The stores' shared base: the only place SQL runs is a store (statements by name from
``sql/queries.sql``), and every store stands on what this module holds: the bounded pool
(``BoundedPool``), the schema (``StoreBase``: migrate, the schema check), the idempotency
keys' namespace, and the statements two audiences share (``JobAccess``: a caller's and an
operator's reads of a job and its cancel; ``Pruning``: the retention's deletes, run by the
worker's pruner and by ``sidecar prune``).

Each end of the queue constructs the store of its audience and nothing else:
``sidecar.storage.worker_store.WorkerStore`` (the worker and its supervisors),
``sidecar.storage.caller_store.CallerStore`` (sidecar.client, the MCP gateway, ``sidecar enqueue``,
``wait``, ``cancel``) and ``sidecar.storage.operator_store.OperatorStore`` (``sidecar web``,
``jobs``,
``show``, flow control, retry, ``prune``, ``migrate``); tests/test_import_graph.py holds them
apart.

Every read that shows stored rows to a person or a caller returns them ``shown``: a row
written before scrubbing existed (issue 25) may hold a secret, so the secrets this process
knows (``masking.SECRETS``, registered by ``config.register_secrets``) are scrubbed on
display too (issue 41), with the registry writes are scrubbed with.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Iterable
from typing import Any

import asyncpg

from sidecar.protocol.errors import UsageError
from sidecar.protocol.masking import SECRETS
from sidecar.storage import db
from sidecar.storage.queries import Q, Repeatable, migrations, repeatables

# Key of the transaction-scoped advisory lock that serialises migrations.
MIGRATION_LOCK_KEY = 0x5DECA4_0001

# The idempotency keys of next stages (P19): '{parent key}:stage:{n}'. Reserved: no
# producer may enqueue one (case F22), so a parent's stage key is only ever its own.
STAGE_KEY_SUFFIX = re.compile(r":stage:[0-9]+\Z")


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


class BoundedPool:
    """The asyncpg pool calls a store makes, each bounded in time end to end (case F2).

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

    async def fetchval_rolled_back(self, query: str, *args: Any,
                                   timeout: float | None = None):
        """``fetchval`` of ``query`` in a transaction that is then rolled back: what a
        write would answer, with nothing written (a dry run of it). Bounded as every call
        (the sidecar's own settings too, behind a transaction pooler: case F18)."""
        timeout = self.timeout if timeout is None else timeout
        async with asyncio.timeout(timeout):
            conn = await self.pool.acquire()
        try:
            async with asyncio.timeout(timeout):
                await conn.execute("BEGIN")
                try:
                    local = db.local_settings_sql(conn)
                    if local is not None:
                        await conn.execute(local)
                    value = await conn.fetchval(query, *args)
                except asyncpg.PostgresError:
                    with contextlib.suppress(*db.DATABASE_ERRORS):
                        await conn.execute("ROLLBACK")
                    raise
                await conn.execute("ROLLBACK")
                return value
        except BaseException:  # a connection in doubt is not reused (its transaction dies)
            conn.terminate()
            raise
        finally:
            await self.pool.release(conn, timeout=timeout)


class StoreBase:
    """SQL access over an asyncpg pool; every call is bounded by ``timeout`` (seconds),
    acquiring a connection included (see BoundedPool). The schema's statements only: each
    audience's store (worker, caller, operator) adds its own."""

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


def shown(row: Any) -> Any:
    """A row as a person or a caller is shown it: a dict (an asyncpg.Record's columns)
    whose every string, in nested JSON values too and keys included, has the secrets this
    process knows replaced by ``[secret]`` (``masking.SECRETS.scrub_value``; numbers, ids
    and times as they are, F11's exact numbers too). None stays None; any other value (a
    ``fetchval``'s) is scrubbed as it is. Never raises."""
    if row is None:
        return None
    if isinstance(row, asyncpg.Record):
        row = dict(row)
    return SECRETS.scrub_value(row)


def shown_rows(rows: Iterable[Any]) -> list[Any]:
    """Each of ``rows`` ``shown``."""
    return [shown(row) for row in rows]


SETTLE_BATCH = 1000  # job ids per tool_job_expire call (functions/expiry.sql bounds it)


async def settle_expired(conn: Any, job_ids: Iterable[uuid.UUID], timeout: float) -> None:
    """End failed/expired those of ``job_ids`` past their expiry that no attempt runs
    (tool_job_expire, functions/expiry.sql: what the sidecars' sweep does), before a
    caller reads them (issue 41). ``conn``: a BoundedPool or an asyncpg connection.
    Best effort: a role without EXECUTE on tool_job_expire (rights given by hand, not by
    ``sidecar migrate --caller-role``), or a server answering read-only (a failover's old
    primary, case F12), reads the rows as they are, left to the sweep."""
    ids = [str(job_id) for job_id in job_ids]  # jsonb through the connection's codec
    try:
        for start in range(0, len(ids), SETTLE_BATCH):  # the function takes 1,000 at most
            batch = ids[start:start + SETTLE_BATCH]
            if isinstance(conn, asyncpg.Connection):
                await db.run(conn, "fetch", Q["settle_expired"], batch, timeout=timeout)
            else:
                await conn.fetch(Q["settle_expired"], batch, timeout=timeout)
    except (asyncpg.InsufficientPrivilegeError, asyncpg.ReadOnlySQLTransactionError):
        pass


class JobAccess(StoreBase):
    """What a caller and an operator both do to jobs: read one, list them, cancel them
    (CallerStore and OperatorStore have it; the worker's store has not)."""

    # --- approvals (issue 44, point 1; migration 030) -----------------------------------

    async def open_approval(self, job_id: uuid.UUID) -> asyncpg.Record | None:
        """The job's open approval request (``id, job_id, attempt, fencing_token, action,
        summary, details, asked_at, deadline``), or None."""
        return await self.db.fetchrow(Q["open_approval_of_job"], job_id, timeout=self.timeout)

    async def answer_approval(self, job_id: uuid.UUID, attempt: int, token: int, approve: bool,
                              reason: str | None, by: str) -> str:
        """Answer the request of ``job_id`` asked by ``attempt`` with fencing ``token``:
        ``approved`` or ``denied`` when taken, else why it was refused (``no_request``,
        ``already_answered``, ``expired``, ``stale_attempt``), journaled either way.
        UsageError for a bad reason or ``by``."""
        try:
            return await self.db.fetchval(Q["answer_approval"], job_id, attempt, token, approve,
                                          reason, by, timeout=self.timeout)
        except asyncpg.InvalidParameterValueError as exc:
            raise UsageError(exc.args[0] if exc.args else str(exc)) from None

    # --- jobs ---------------------------------------------------------------------

    async def get_job(self, job_id: uuid.UUID) -> dict[str, Any] | None:
        """The whole row of one job ``shown`` (secrets scrubbed), or None; a job past its
        expiry that no attempt runs is first settled as failed/expired
        (``settle_expired``, issue 41), so a read never shows a job queued that can no
        longer start."""
        await settle_expired(self.db, [job_id], self.timeout)
        return shown(await self.db.fetchrow(Q["get_job"], job_id, timeout=self.timeout))

    async def list_jobs(
        self, state: str | None, tool: str | None, limit: int,
        tags: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Newest jobs first, filtered by state, tool and tags (all of them), ``shown``."""
        return shown_rows(await self.db.fetch(Q["list_jobs"], state, tool, limit,
                                              tags or None, timeout=self.timeout))

    async def cancel(self, job_id: uuid.UUID | None,
                     tags: dict[str, str] | None = None,
                     by: str | None = None) -> dict[uuid.UUID, str]:
        """Cancel a job (``job_id``), or every queued or running job whose tags include
        all of ``tags``, and their later stages that are still queued or running; return
        ``{id: previous state}`` of every job cancelled (empty when none was). A running
        one's owner is told at commit (functions/cancel.sql), or finds out by its own
        check every second when it cannot LISTEN, and kills its tree within about a
        second; at the latest when its lease ends if it is cut off. ``by``: who
        asked, journaled as ``job_cancelled``'s ``by`` (issue 30; None: not said)."""
        rows = await self.db.fetch(Q["cancel_job"], job_id, tags or None, by,
                                   timeout=self.timeout)
        return {row["id"]: row["previous_state"] for row in rows}

    async def cancel_kill_bound(self, job_ids: list[uuid.UUID]) -> tuple[int, float | None]:
        """Of ``job_ids`` (just cancelled), how many ran under a live lease whose owner has
        not confirmed its tree dead yet, and the seconds (database clock, P3) until the
        latest of those leases ends: the bound by which every tree dies even when the
        owner's notification is lost (None when there is none)."""
        row = await self.db.fetchrow(Q["cancel_kill_bound"],
                                     [str(i) for i in job_ids],
                                     timeout=self.timeout)
        return row["pending"], row["latest_s"]


class Pruning(StoreBase):
    """The retention's statements (sidecar.ops.retention): the worker's periodic pruner and the
    operator's ``sidecar prune`` run the same deletes (WorkerStore and OperatorStore have
    it)."""

    # --- retention ----------------------------------------------------------------

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

    async def prune_rows(self, statement: str, *args: Any, dry_run: bool = False) -> int:
        """Run the retention statement named ``statement`` (queries.sql; the ones
        sidecar.ops.retention.RETENTION lists: each removes one kind of row and returns how
        many) with ``args``; with ``dry_run``, in a transaction rolled back: how many it
        would remove, nothing removed. KeyError for a name queries.sql does not hold;
        database errors propagate."""
        if dry_run:
            return await self.db.fetchval_rolled_back(Q[statement], *args)
        return await self.db.fetchval(Q[statement], *args, timeout=self.timeout)
