"""The heartbeat: one task on the sidecar's own event loop renews every lease it holds,
with one statement per period on a connection of its own (P5, P9).

Each lease keeps a conservative local deadline on the monotonic clock: the moment the
last successful renewal was *sent*, plus the lease length the database returned, minus
a safety margin. Zero rows for a job means the lease is lost (P5); a database that does
not answer leaves ownership unknown (P14b) and the job is given up locally once the
local deadline passes unconfirmed, before the database could hand it to someone else.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from dataclasses import dataclass, field

import asyncpg

from sidecar import db
from sidecar.config import LeaseProfile
from sidecar.log import log
from sidecar.store import ClaimedJob, Store

# Reasons a lease ends without our commit; the supervisor kills the tree for each.
LEASE_LOST = "lease_lost"          # zero rows: expired and taken over, or changed by policy
CANCELLED = "cancelled"            # zero rows because an operator cancelled the job
LOCAL_DEADLINE = "local_deadline"  # ownership unknown until the conservative deadline passed


@dataclass
class Lease:
    """One lease this sidecar holds. ``lost`` is set once it is no longer ours; ``reason``
    then says why. ``local_deadline`` is monotonic seconds."""

    job: ClaimedJob
    local_deadline: float
    lease_until: dt.datetime
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str | None = None
    settling: bool = False

    def settle(self) -> None:
        """The owner is about to write the job's outcome (fenced itself): stop renewing, so
        a renewal racing that write cannot mistake our own commit for a lost lease."""
        self.settling = True

    def lose(self, reason: str) -> None:
        """Mark the lease lost for ``reason`` (first reason wins)."""
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()


def safety_margin(profile: LeaseProfile) -> float:
    """Seconds kept between the local deadline and the lease end: the kill grace (the tree
    must be dead before the lease ends) plus a tenth of the lease for clock-rate error."""
    return profile.kill_grace_seconds + 0.1 * profile.lease_seconds


class LeaseKeeper:
    """Heartbeats every lease of one sidecar (one tool, one profile).

    ``statement_timeout`` (seconds) bounds each renewal on the client side; it is kept
    below the heartbeat period so a dead path is noticed, never waited on.
    """

    def __init__(self, dsn: str, owner_id: str, profile: LeaseProfile, store: Store,
                 db_timeout: float):
        self.dsn = dsn
        self.owner_id = owner_id
        self.profile = profile
        self.store = store
        self.statement_timeout = min(db_timeout, 0.8 * profile.heartbeat_seconds)
        self.margin = safety_margin(profile)
        self.leases: dict[uuid.UUID, Lease] = {}
        self._conn: asyncpg.Connection | None = None

    def hold(self, job: ClaimedJob, claim_sent_at: float) -> Lease:
        """Start heartbeating ``job``; ``claim_sent_at`` is when the claim was sent (monotonic)."""
        lease = Lease(job, claim_sent_at + job.lease_remaining - self.margin, job.lease_until)
        self.leases[job.id] = lease
        return lease

    def drop(self, job_id: uuid.UUID) -> None:
        """Stop heartbeating a job (finished, released or lost)."""
        self.leases.pop(job_id, None)

    async def run(self) -> None:
        """Renew every ``heartbeat_seconds`` until cancelled."""
        try:
            while True:
                started = time.monotonic()
                if self.leases:
                    await self.beat()
                self._expire_local_deadlines()
                delay = self.profile.heartbeat_seconds - (time.monotonic() - started)
                await asyncio.sleep(max(0.0, delay))
        finally:
            self._abort_connection()

    async def beat(self) -> None:
        """One renewal round for all leases held now."""
        held = [lease for lease in self.leases.values()
                if not lease.lost.is_set() and not lease.settling]
        if not held:
            return
        sent = time.monotonic()
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncio.wait_for(
                    db.connect(self.dsn, self.statement_timeout), self.statement_timeout
                )
            renewed = await Store.extend_leases_if_owner(
                self._conn, self.owner_id, [(h.job.id, h.job.fencing_token) for h in held],
                self.profile.lease_seconds, self.statement_timeout,
            )
        except (TimeoutError, Exception) as exc:  # noqa: BLE001 - any failure = unknown
            self._abort_connection()
            for lease in held:
                log.emit("heartbeat_error", "warning", job_id=str(lease.job.id),
                         tool=lease.job.tool, fencing_token=lease.job.fencing_token,
                         lease_until=lease.lease_until, reason=type(exc).__name__)
            return
        for lease in held:
            renewal = renewed.get(lease.job.id)
            if renewal is not None:
                lease.lease_until = renewal.lease_until
                lease.local_deadline = sent + renewal.lease_remaining - self.margin
                if log.enabled("debug"):
                    log.emit("heartbeat_ok", "debug", job_id=str(lease.job.id),
                             tool=lease.job.tool, fencing_token=lease.job.fencing_token,
                             lease_until=renewal.lease_until)
            elif not lease.lost.is_set() and not lease.settling:
                await self._zero_rows(lease)

    async def _zero_rows(self, lease: Lease) -> None:
        job = lease.job
        details: dict[str, object] = {"reason": "zero_rows", "owner_id": self.owner_id,
                                      "last_lease_until": lease.lease_until.isoformat()}
        reason = LEASE_LOST
        try:
            row = await self.store.ownership(job.id)
            if row is not None:
                details.update(state=row["state"], current_token=row["fencing_token"])
                if row["state"] == "cancelled":
                    reason = CANCELLED
        except Exception:  # noqa: BLE001 - the explanation is optional; the loss is not
            pass
        lease.lose(reason)
        log.emit("heartbeat_lost", "warning", job_id=str(job.id), tool=job.tool,
                 fencing_token=job.fencing_token, attempt=job.attempt,
                 lease_until=lease.lease_until, reason=reason)
        try:
            await self.store.record_event(job.id, job.fencing_token, "heartbeat_lost", details)
        except Exception:  # noqa: BLE001
            log.emit("journal_error", "warning", job_id=str(job.id), reason="heartbeat_lost")

    def _expire_local_deadlines(self) -> None:
        now = time.monotonic()
        for lease in self.leases.values():
            if not lease.lost.is_set() and not lease.settling and now >= lease.local_deadline:
                lease.lose(LOCAL_DEADLINE)
                log.emit("lease_abandoned", "error", job_id=str(lease.job.id),
                         tool=lease.job.tool, fencing_token=lease.job.fencing_token,
                         lease_until=lease.lease_until, reason="no confirmed renewal before "
                         "the local deadline; ownership unknown")

    def _abort_connection(self) -> None:
        if self._conn is not None:
            self._conn.terminate()  # never a close that could hang on a dead path
            self._conn = None
