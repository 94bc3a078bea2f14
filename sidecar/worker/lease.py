"""The heartbeat: one task on the sidecar's own event loop renews every lease it holds,
with one statement per period on a connection of its own (P5, P9).

Three kinds of heartbeat failure (P14):
- no row for a job: the lease is lost (expired, taken over, cancelled); the job's
  supervisor kills the tree and commits nothing (P13);
- the database does not answer, or ends the renewal on a timeout (lock_timeout,
  statement_timeout: case F18), or another session holds the job's row locked (that one
  lease only: the renewal skips locked rows, case F17): ownership is unknown. Logged once
  per episode as ``ownership_unknown`` (P15); renewals go on, each on a fresh connection,
  while the conservative local deadline allows: the time the last successful renewal was
  *sent*, plus the lease length the database returned, minus a safety margin, on
  CLOCK_BOOTTIME (sidecar.protocol.clock: it counts time the host spent suspended, case F20).
  After a suspend (a jump between CLOCK_BOOTTIME and CLOCK_MONOTONIC) every lease is
  unknown until a renewal sent after the jump confirms it. Past the local deadline the
  job is given up locally (``lease_abandoned``): the tree is killed before the database
  could hand the job to someone else;
- the tool not answering is bounded by the stage deadline, not here (P8).

An abandoned lease is not forgotten: once the database answers again, the keeper ends
it if it is still ours (so the job is claimable at once) or journals ``heartbeat_lost``
when it was not, plus ``lease_abandoned`` and any result that could not be committed.
It never extends an abandoned lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import asyncpg

from sidecar.ops import metrics
from sidecar.protocol import clock
from sidecar.protocol.lease_state import Lease, LeaseState
from sidecar.protocol.model import ClaimedJob, JobState, LeaseProfile
from sidecar.protocol.vocabulary import AttemptId, HeartbeatResult, StopReason
from sidecar.runtime.log import log, log_fields
from sidecar.storage import db
from sidecar.storage.worker_store import WorkerStore

# A renewal asked early (renew_soon) follows the previous one by at least this many
# seconds, so a flood of notifications costs at most this many renewals per second.
EARLY_RENEWAL_MIN_SECONDS = 0.1


class RowLocked(Exception):
    """A renewal skipped a lease because another session holds its row locked (case F17)."""

    def __str__(self) -> str:
        return "the job's row is locked by another session; renewal skipped"


def safety_margin(profile: LeaseProfile) -> float:
    """Seconds kept between the local deadline and the lease end: the kill grace (the tree
    must be dead before the lease ends) plus a tenth of the lease for clock-rate error."""
    return profile.kill_grace_seconds + 0.1 * profile.lease_seconds


class LeaseKeeper:
    """Heartbeats every lease of one sidecar (one tool, one profile).

    ``statement_timeout`` (seconds) bounds each renewal on the client side; it is kept
    below the heartbeat period so a dead path is noticed, never waited on.
    """

    def __init__(self, dsn: str, owner_id: str, profile: LeaseProfile, store: WorkerStore,
                 db_timeout: float):
        self.dsn = dsn
        self.owner_id = owner_id
        self.profile = profile
        self.store = store
        self.statement_timeout = min(db_timeout, 0.8 * profile.heartbeat_seconds)
        self.margin = safety_margin(profile)
        # Keyed by attempt, never by job id alone (case F14).
        self.leases: dict[AttemptId, Lease] = {}
        self.abandoned: dict[AttemptId, Lease] = {}
        self._conn: asyncpg.Connection | None = None
        self._soon = asyncio.Event()  # renew_soon: renew before the period ends
        self.labels = (profile.tool, profile.provider)
        # Counted at each scrape, never stale: an episode shows as long as it lasts.
        metrics.LEASES_UNKNOWN.labels(*self.labels).set_function(self.unknown_count)
        # Agent sessions (issue 43): the warm pool whose sessions' leases are renewed
        # with the job leases (sidecar.worker.warm.WarmPool), None without warm mode.
        self.session_pool = None

    def unknown_count(self) -> int:
        """How many leases held now have their ownership unknown (LeaseState.UNKNOWN: a
        renewal failed or skipped them, or the host was suspended, and none has confirmed
        them since); the gauge sidecar_leases_ownership_unknown (issue 30)."""
        return sum(1 for lease in list(self.leases.values())
                   if lease.state is LeaseState.UNKNOWN)

    def hold(self, job: ClaimedJob, claim_sent_at: float) -> Lease:
        """Start heartbeating ``job``; ``claim_sent_at`` is when the claim was sent
        (sidecar.protocol.clock.ownership_now seconds)."""
        lease = Lease(job, claim_sent_at + job.lease_remaining - self.margin, job.lease_until)
        self.leases[job.attempt_id] = lease
        return lease

    def supersede(self, job: ClaimedJob) -> list[Lease]:
        """``job`` was just claimed anew by this sidecar: every older attempt of the same job
        still held here is no longer ours (the claim bumped the token), so each is marked
        lost now, before the heartbeat would notice, and its supervisor kills its tree
        (case F14). Returns the leases marked (their supervisors may still be running)."""
        older = [lease for key, lease in self.leases.items()
                 if key.job_id == job.id and key.fencing_token < job.fencing_token]
        for lease in older:
            lease.lose(StopReason.LEASE_LOST)
        return older

    def renew_soon(self, job_id: uuid.UUID) -> bool:
        """A job was cancelled (its owner's NOTIFY, functions/cancel.sql): when a lease of
        ``job_id`` is held here, renew every lease now instead of at the end of the
        heartbeat period; the cancelled one gets zero rows and its supervisor kills the
        tree (P5, P13). Returns whether one is held (a notification for a job not ours, or
        already ended here, is ignored). The heartbeat stays the fallback for a lost one;
        ``check_cancels`` asks the same when no notification can be heard."""
        if not any(key.job_id == job_id for key in self.leases):
            return False
        self._soon.set()
        return True

    async def check_cancels(self) -> list[uuid.UUID]:
        """Ask the database which leases held here were cancelled while they ran (one
        read-only statement for them all, WorkerStore.cancelled_leases) and ``renew_soon``
        for each: the sidecar's own check when it cannot hear the cancel NOTIFY (no LISTEN
        behind a transaction pooler, or its LISTEN connection is down; issue 41). Returns
        the job ids found (empty, without a statement, when no lease is renewable).
        Raises what the store raises; the heartbeat stays the fallback."""
        held = [(lease.job.id, lease.job.fencing_token)
                for lease in list(self.leases.values()) if lease.renewable]
        if not held:
            return []
        cancelled = await self.store.cancelled_leases(self.owner_id, held)
        return [job_id for job_id in cancelled if self.renew_soon(job_id)]

    def drop(self, attempt: AttemptId) -> None:
        """The supervisor is done with a lease: stop renewing it. An abandoned lease moves to
        the probe list, to be ended (never extended) once the database answers."""
        lease = self.leases.pop(attempt, None)
        if lease is not None and lease.abandoned:
            self.abandoned[attempt] = lease

    async def run(self) -> None:
        """Renew every ``heartbeat_seconds`` (sooner when ``renew_soon`` asks, at most
        every EARLY_RENEWAL_MIN_SECONDS) until cancelled; meanwhile watch the local
        deadlines on a timer of their own, so a renewal stuck on a dead path (up to its
        statement timeout) or the wait for the next period never delays giving up."""
        watcher = asyncio.create_task(self._watch_deadlines(), name="lease-deadlines")
        try:
            while True:
                started = time.monotonic()
                self._soon.clear()  # a notice arriving during this round asks for another
                if self.leases or self.abandoned:
                    await self.beat()
                if self.session_pool is not None and self.session_pool.sessions:
                    await self.beat_sessions()
                self._expire_local_deadlines()
                delay = self.profile.heartbeat_seconds - (time.monotonic() - started)
                # asyncio.timeout: wait_for (3.11) can lose the cancellation that stops it.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, delay)):
                        await self._soon.wait()
                early = EARLY_RENEWAL_MIN_SECONDS - (time.monotonic() - started)
                await asyncio.sleep(max(0.0, early))
        finally:
            watcher.cancel()
            self._abort_connection()

    async def _watch_deadlines(self) -> None:
        """Sleep until the earliest local deadline of a live lease, then give it up."""
        while True:
            live = [lease.local_deadline for lease in self.leases.values() if lease.renewable]
            # Sleeping runs on the monotonic clock, which stops in a suspend: at most H
            # at a time, so a deadline that passed while suspended is seen within H of
            # the resume (and the guard refuses from the first instant, sidecar.worker.guard).
            wait = min(live) - clock.ownership_now() if live \
                else self.profile.heartbeat_seconds
            # A renewal only moves a deadline later and a new lease's deadline lies a lease
            # ahead, so sleeping to the earliest one (at most H) misses nothing.
            await asyncio.sleep(min(max(wait, 0.0) + 0.001, self.profile.heartbeat_seconds))
            self._expire_local_deadlines()

    async def beat(self) -> None:
        """One round: renew all leases held now, then probe the abandoned ones."""
        held = [lease for lease in self.leases.values() if lease.renewable]
        metrics.LEASES_HELD.labels(*self.labels).set(len(held))
        sent, suspended = clock.ownership_now(), clock.suspended_seconds()
        started = time.monotonic()
        try:
            conn = await self._connection()
            renewed = {}
            if held:
                renewed = await WorkerStore.extend_leases_if_owner(
                    conn, self.owner_id, [(h.job.id, h.job.fencing_token) for h in held],
                    self.profile.lease_seconds, self.statement_timeout,
                )
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure = unknown
            self._abort_connection()
            result = HeartbeatResult.TIMEOUT \
                if isinstance(exc, (TimeoutError, *db.TIMEOUT_ERRORS)) else HeartbeatResult.ERROR
            metrics.HEARTBEATS.labels(*self.labels, result).inc(len(held))
            self._ownership_unknown(held, exc)
            return
        if held:
            metrics.HEARTBEAT_SECONDS.labels(*self.labels).observe(time.monotonic() - started)
        if clock.jumped(suspended, clock.suspended_seconds()):
            # Suspended while the renewal was on its way: its answer may describe a
            # lease that ended since; it confirms nothing (case F20).
            self._clock_jumped(held)
            renewed, held = {}, []
        locked = [lease for lease in held
                  if lease.job.attempt_id in renewed and renewed[lease.job.attempt_id] is None]
        if locked:
            # Case F17: another session holds these rows locked. Only they are unknown this
            # round, and they keep their local deadline; the others were renewed.
            metrics.HEARTBEATS.labels(*self.labels, HeartbeatResult.LOCKED).inc(len(locked))
            self._ownership_unknown(locked, RowLocked())
        for lease in held:
            if lease.job.attempt_id in renewed and renewed[lease.job.attempt_id] is None:
                continue
            renewal = renewed.get(lease.job.attempt_id)
            if renewal is not None:
                # Slack: how much of the old lease was left by the database clock.
                db_now = renewal.lease_until.timestamp() - renewal.lease_remaining
                metrics.LEASE_SLACK.labels(*self.labels).observe(
                    max(0.0, lease.lease_until.timestamp() - db_now))
                metrics.HEARTBEATS.labels(*self.labels, HeartbeatResult.OK).inc()
                metrics.LAST_HEARTBEAT.labels(*self.labels).set(time.time())
                self._ownership_confirmed(lease, lease.confirm(
                    renewal.lease_until, sent + renewal.lease_remaining - self.margin,
                    suspended))
                if log.enabled("debug"):
                    log.emit("heartbeat_ok", "debug", **log_fields(lease.job),
                             lease_until=renewal.lease_until)
            elif lease.renewable:
                await self._zero_rows(lease)
        try:
            for lease in held:
                if lease.unjournaled:
                    await self._flush_journal(conn, lease)
            await self._probe_abandoned()
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - probe again next round
            self._abort_connection()
            log.emit("heartbeat_error", "warning", reason=f"probe: {db.describe_error(exc)}",
                     sqlstate=db.sqlstate(exc))

    async def beat_sessions(self) -> None:
        """One round for the agent sessions held here (issue 43): renew their leases in one
        statement. A session not renewed is no longer ours (its lease ran out and a claim
        found it lost, or another sidecar started it again): its process is stopped,
        nothing written. When the statement fails, a session whose lease is no longer known
        to hold (``confirmed_until`` passed) is given up the same way."""
        pool = self.session_pool
        sessions = pool.held_sessions()
        if not sessions:
            return
        sent = time.monotonic()
        renewed: set[tuple[str, str, int]] | None
        try:
            conn = await self._connection()
            renewed = await WorkerStore.extend_sessions_if_owner(
                conn, self.owner_id, [session.held() for session in sessions],
                self.profile.lease_seconds, self.statement_timeout)
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - unknown: see below
            self._abort_connection()
            renewed = None
            log.emit("heartbeat_error", "warning", reason=f"sessions: {db.describe_error(exc)}",
                     sqlstate=db.sqlstate(exc))
        now = time.monotonic()
        for session in sessions:
            if pool.sessions.get(session.key) is not session:
                continue  # ended or replaced meanwhile
            if renewed is not None and session.held() in renewed:
                session.confirmed_until = sent + self.profile.lease_seconds - self.margin
            elif renewed is not None or now > session.confirmed_until:
                lost = renewed is not None
                log.emit("session_lease_lost" if lost else "session_lease_unknown", "warning",
                         tool=session.tool, session=session.key,
                         generation=session.generation, busy=session.busy)
                pool.lose_session(session.key, "session_lease_lost" if lost
                                  else "session_lease_unknown")

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncio.wait_for(
                db.connect(self.dsn, self.statement_timeout), self.statement_timeout)
        return self._conn

    def _ownership_unknown(self, held: list[Lease], exc: BaseException) -> None:
        now = clock.ownership_now()
        for lease in held:
            if not lease.mark_unknown(now):
                continue
            metrics.OWNERSHIP_UNKNOWN.labels(*self.labels).inc()
            reason = db.describe_error(exc)
            log.emit("ownership_unknown", "warning", **log_fields(lease.job),
                     lease_until=lease.lease_until, reason=reason, request_id=lease.request_id,
                     sqlstate=db.sqlstate(exc),
                     local_deadline_in_s=round(lease.local_deadline - now, 3))
            # P15: its own journal row, written once the database answers again.
            lease.keep_for_journal([("ownership_unknown", {
                "last_confirmed_lease_until": lease.lease_until.isoformat(),
                "request_id": lease.request_id, "reason": reason,
                "owner_id": self.owner_id})])

    def _ownership_confirmed(self, lease: Lease, unknown_since: float | None) -> None:
        """Log and journal the end of an episode of unknown ownership that began at
        ``unknown_since`` (None: there was none)."""
        if unknown_since is not None:
            duration = round(clock.ownership_now() - unknown_since, 3)
            log.emit("ownership_confirmed", **log_fields(lease.job), lease_until=lease.lease_until,
                     duration_s=duration)
            lease.keep_for_journal([("ownership_confirmed", {
                "lease_until": lease.lease_until.isoformat(), "unknown_for_s": duration})])

    async def _flush_journal(self, conn: asyncpg.Connection, lease: Lease) -> None:
        """Write the events kept while the database did not answer."""
        while lease.unjournaled:
            event, details = lease.unjournaled[0]
            await WorkerStore.record_event_on(conn, lease.job.id, lease.job.fencing_token,
                                              event, details, self.statement_timeout)
            lease.journaled_first()

    async def _zero_rows(self, lease: Lease) -> None:
        job = lease.job
        details: dict[str, object] = {"reason": "zero_rows", "owner_id": self.owner_id,
                                      "last_lease_until": lease.lease_until.isoformat()}
        reason = StopReason.LEASE_LOST
        try:
            row = await self.store.ownership(job.id)
            if row is not None:
                details.update(state=row["state"], current_token=row["fencing_token"])
                if row["state"] == JobState.CANCELLED:
                    reason = StopReason.CANCELLED
        except Exception as exc:  # noqa: BLE001 - the explanation is optional; the loss is not
            details["ownership_error"] = f"{type(exc).__name__}: {exc}"[:200]
        lease.lose(reason)
        metrics.HEARTBEATS.labels(*self.labels, HeartbeatResult.LOST).inc()
        metrics.LEASES_EXPIRED.labels(*self.labels).inc()
        log.emit("heartbeat_lost", "warning", **log_fields(job),
                 lease_until=lease.lease_until, reason=reason)
        try:
            await self.store.record_event(job.id, job.fencing_token, "heartbeat_lost", details)
        except Exception:  # noqa: BLE001
            log.emit("journal_error", "warning", **log_fields(job), reason="heartbeat_lost")

    async def _probe_abandoned(self) -> None:
        """Tell the database about leases given up while it did not answer."""
        for attempt, lease in list(self.abandoned.items()):
            job = lease.job
            conn = await self._connection()
            await self._flush_journal(conn, lease)
            still_ours = await WorkerStore.expire_lease_if_owner(
                conn, self.owner_id, job.id, job.fencing_token, self.statement_timeout)
            base = {"owner_id": self.owner_id, "last_lease_until": lease.lease_until.isoformat()}
            if not still_ours:
                log.emit("heartbeat_lost", "warning", **log_fields(job),
                         lease_until=lease.lease_until, reason="zero_rows")
                now_owned = await self.store.ownership(job.id)
                explained = {"state": now_owned["state"],
                             "current_token": now_owned["fencing_token"]} if now_owned else {}
                await WorkerStore.record_event_on(
                    conn, job.id, job.fencing_token, "heartbeat_lost",
                    {**base, "reason": "zero_rows", **explained}, self.statement_timeout)
            if lease.evidence is not None:
                await WorkerStore.record_event_on(
                    conn, job.id, job.fencing_token, "result_rejected",
                    {**base, **lease.evidence}, self.statement_timeout)
            await WorkerStore.record_event_on(
                conn, job.id, job.fencing_token, "lease_abandoned",
                {**base, "reason": "ownership_unknown", "lease_ended_by_us": still_ours},
                self.statement_timeout)
            del self.abandoned[attempt]

    def _clock_jumped(self, leases: list[Lease]) -> None:
        """The host was suspended (case F20): each lease not yet lost is unknown until a
        renewal sent after the jump confirms it; logged once per lease and episode."""
        now, suspended = clock.ownership_now(), clock.suspended_seconds()
        for lease in leases:
            if not lease.renewable:
                continue
            jump = round(lease.restart_suspend_episode(suspended), 3)  # one log line each
            if lease.mark_unknown(now):
                log.emit("clock_jump", "warning", **log_fields(lease.job),
                         suspended_s=jump, lease_until=lease.lease_until,
                         local_deadline_in_s=round(lease.local_deadline - now, 3),
                         reason="the host was suspended; ownership unknown until the "
                                "database confirms the lease")
                lease.keep_for_journal([("ownership_unknown", {
                    "last_confirmed_lease_until": lease.lease_until.isoformat(),
                    "request_id": lease.request_id, "reason": f"suspended {jump} s",
                    "owner_id": self.owner_id})])

    def _expire_local_deadlines(self) -> None:
        jumped = [lease for lease in self.leases.values() if lease.suspended_since_confirm]
        if jumped:
            self._clock_jumped(jumped)
        now = clock.ownership_now()
        for lease in self.leases.values():
            if lease.renewable and now >= lease.local_deadline:
                lease.lose(StopReason.LOCAL_DEADLINE)
                metrics.LEASES_EXPIRED.labels(*self.labels).inc()
                log.emit("lease_abandoned", "error", **log_fields(lease.job),
                         lease_until=lease.lease_until, reason="no confirmed renewal before "
                         "the local deadline; ownership unknown")

    def _abort_connection(self) -> None:
        if self._conn is not None:
            self._conn.terminate()  # never a close that could hang on a dead path
            self._conn = None
