"""The worker's store: what a sidecar that runs jobs does in SQL (``sidecar run``: the claim
loop, its supervisors, lease keeper, guard, progress reports and forwarder). Statements by
name from ``sql/queries.sql``; the schema, the bounded pool and the retention's deletes come
from sidecar.storage.store.

Fenced methods (``*_if_owner``) return True only when this owner still held the
lease by the database's clock (P5, P6); False means "not ours any more": the
caller must not publish anything.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import asyncpg

from sidecar.protocol.enqueue_args import stored_trace_context
from sidecar.protocol.errors import NextStageConflict
from sidecar.protocol.flow import ClaimHeld, Held
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import ClaimedJob, JobState, NextStage, RawJson, new_job_id
from sidecar.protocol.vocabulary import AttemptId
from sidecar.storage import db
from sidecar.storage.queries import Q
from sidecar.storage.store import Pruning, stage_key

# A claim's max_attempts for a job enqueued without one, when the caller names no profile
# value (the default of SIDECAR_MAX_ATTEMPTS).
DEFAULT_MAX_ATTEMPTS = 3
# Jobs one expiry sweep ends at most (fail_expired).
EXPIRY_BATCH = 500
# The unique index of the keys jobs hold (migration 027; the column's UNIQUE before).
_JOB_KEY_CONSTRAINT = "tool_jobs_held_key_idx"


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


class WorkerStore(Pruning):
    """The worker's SQL: claims, leases, the fenced ends of an attempt, the journal,
    checkpoints and progress, the claim loop's readings and wake-ups, the result outbox;
    and the retention's deletes its pruner runs (Pruning). Bounded as StoreBase's."""

    # --- the lease protocol -------------------------------------------------------

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
                session_key=row["session_key"], approval_text=row["approval_text"],
                **_trace_context(row)))
        return jobs, held

    # --- agent sessions (issue 43) -------------------------------------------------

    async def session_begin(self, tool: str, key: str, owner_id: str, lease_seconds: float,
                            restart: bool) -> tuple[str, int, str | None]:
        """What a call of session ``key`` of ``tool`` just claimed by ``owner_id`` runs in:
        ``(status, generation, end_reason)``, status ``new``, ``continued``, ``restarted``,
        ``lost`` or ``elsewhere`` (functions/sessions.sql tool_job_session_begin). A start
        or a call sets the session lease ``lease_seconds`` ahead. Raises what asyncpg
        raises."""
        row = await self.db.fetchrow(Q["session_begin"], tool, key, owner_id, lease_seconds,
                                     restart, timeout=self.timeout)
        return row["status"], row["generation"], row["end_reason"]

    async def session_call_queued(self, tool: str, key: str) -> bool:
        """Whether a call of session ``key`` of ``tool`` waits in the queue."""
        return await self.db.fetchval(Q["session_call_queued"], tool, key,
                                      timeout=self.timeout)

    async def lapse_interests(self) -> list[asyncpg.Record]:
        """Every caller's interest whose time ran out lapses (issue 44, point 2), of any
        tool: its queued calls end expired, its running ones are cancelled (kind
        abandoned_by_caller; their owners told at once). ``job_id, tool, previous_state,
        interest_key`` of each call ended."""
        return await self.db.fetch(Q["lapse_interests"], timeout=self.timeout)

    async def lose_expired_sessions(self, tool: str) -> list[asyncpg.Record]:
        """Live sessions of ``tool`` whose lease ran out -> lost (their holder is gone);
        ``session_key, owner_id, generation`` of each."""
        return await self.db.fetch(Q["lose_expired_sessions"], tool, timeout=self.timeout)

    async def end_session_if_owner(self, tool: str, key: str, generation: int,
                                   owner_id: str, state: str, reason: str) -> bool:
        """End session ``key`` (its ``generation``) held by ``owner_id``: ``state`` ``ended``
        or ``lost``, with ``reason``. False when it was no longer ours."""
        row = await self.db.fetchrow(Q["end_session_if_owner"], tool, key, generation,
                                     owner_id, state, reason[:500], timeout=self.timeout)
        return row is not None

    @staticmethod
    async def extend_sessions_if_owner(
        conn: asyncpg.Connection, owner_id: str, held: Iterable[tuple[str, str, int]],
        lease_seconds: float, timeout: float) -> set[tuple[str, str, int]]:
        """Renew the session leases ``held`` ((tool, key, generation)) of ``owner_id`` by
        ``lease_seconds`` in one statement; returns those renewed (the others are no longer
        ours). Raises what asyncpg raises."""
        sessions = [{"tool": t, "key": k, "generation": g} for t, k, g in held]
        rows = await db.run(conn, "fetch", Q["extend_sessions_if_owner"], owner_id,
                            sessions, lease_seconds, timeout=timeout)
        return {(r["tool"], r["session_key"], r["generation"]) for r in rows}

    async def release_unheld_claims(self, tool: str, owner_id: str,
                                    held: Iterable[AttemptId]) -> list[asyncpg.Record]:
        """Case F16: settle claims whose answer was lost. Every job of ``tool`` running under
        ``owner_id`` whose attempt is not in ``held`` goes back to the queue without
        spending the attempt, journaled ``lease_released`` (reason ``claim_answer_lost``).
        Returns ``id, fencing_token`` of each."""
        leases = [{"id": str(a.job_id), "token": a.fencing_token} for a in held]
        return await self.db.fetch(Q["release_unheld_claims"], tool, owner_id, leases,
                                   timeout=self.timeout)

    async def fail_exhausted_leases(self, tool: str) -> list[asyncpg.Record]:
        """Expired running jobs of ``tool`` with no attempt left -> failed (P16)."""
        return await self.db.fetch(Q["fail_exhausted_leases"], tool, timeout=self.timeout)

    async def fail_expired(self, limit: int = EXPIRY_BATCH) -> list[asyncpg.Record]:
        """Up to ``limit`` jobs of any tool whose expiry passed before an attempt could
        start (queued, or under an expired lease) -> failed, kind ``expired``, journaled
        ``job_expired`` (issue 26). Returns ``id, tool, fencing_token, attempt`` of each."""
        return await self.db.fetch(Q["fail_expired_jobs"], limit, timeout=self.timeout)

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

    async def cancelled_leases(self, owner_id: str,
                               held: Iterable[tuple[uuid.UUID, int]]) -> list[uuid.UUID]:
        """The job ids among ``held`` ((job id, token) pairs, the leases ``owner_id`` holds)
        cancelled while they ran, in one read-only statement: how a sidecar that cannot
        LISTEN learns of a cancel without waiting for its next heartbeat (issue 41). Raises
        what asyncpg raises (the caller checks again later)."""
        leases = [{"id": str(job_id), "token": token} for job_id, token in held]
        rows = await self.db.fetch(Q["cancelled_leases_of_owner"], owner_id, leases,
                                   timeout=self.timeout)
        return [row["id"] for row in rows]

    @staticmethod
    async def expire_lease_if_owner(
        conn: asyncpg.Connection, owner_id: str, job_id: uuid.UUID, token: int, timeout: float,
    ) -> bool:
        """End our own lease now (after abandoning the job locally); False when it was not
        ours any more (expired, taken over, cancelled)."""
        row = await db.run(conn, "fetchrow", Q["expire_lease_if_owner"], owner_id, job_id,
                           token, timeout=timeout)
        return row is not None

    async def ownership(self, job_id: uuid.UUID) -> asyncpg.Record | None:
        """``state``, ``owner_id`` and ``fencing_token`` of a job (to explain a lost lease)."""
        return await self.db.fetchrow(Q["ownership_of_job"], job_id, timeout=self.timeout)

    # --- the fenced end of an attempt (sidecar.worker.commit) ----------------------------

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
        job that is not this job's own stage (case F22) and keeps it; one whose dedupe
        policy lets it go (an earlier run of the same key's chain, issue 44) frees it and
        the end is written again, once. A repeated completion that meets its own stage
        creates no second one."""
        for last in (False, True):
            try:
                row = await self.db.fetchrow(
                    Q["finish_job_if_owner"], job.id, owner_id, job.fencing_token, state,
                    result, error, event, details, result_url,
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
                if not last and await self.db.fetchval(Q["free_key"], key,
                                                       timeout=self.timeout) is not None:
                    continue
                holder = await self.db.fetchrow(Q["find_job_by_idempotency_key"], key,
                                                RawJson("null"), timeout=self.timeout)
                raise NextStageConflict(key, holder["id"] if holder else None) from None
            return row is not None
        raise AssertionError("unreachable: the second try returns or raises")

    async def set_dedupe_default(self, tool: str, window_seconds: float | None,
                                 owner_id: str) -> None:
        """The profile's DEDUPE as ``tool``'s default dedupe policy (issue 44, point 4):
        ``window_seconds`` None = forever, 0 = active, else the window; read by an enqueue
        that names no policy. Raises what the database raises."""
        await self.db.execute(
            Q["set_dedupe_default"], tool,
            None if window_seconds is None else dt.timedelta(seconds=window_seconds),
            owner_id, timeout=self.timeout)

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

    async def ask_approval(self, job: ClaimedJob, owner_id: str, request_id: uuid.UUID,
                           action: str, summary: str, details: Any,
                           wait_seconds: float) -> asyncpg.Record | None:
        """This attempt asks for a person's yes (issue 44, point 1): older attempts' open
        requests of the job expire, then the request is written and journaled, answerable
        for ``wait_seconds``. ``id, attempt, deadline``; None when the attempt does not own
        the job. asyncpg.UniqueViolationError when one of its requests is open already."""
        return await self.db.fetchrow(Q["ask_approval"], job.id, owner_id, job.fencing_token,
                                      action, summary, details, wait_seconds, request_id,
                                      timeout=self.timeout)

    async def park_if_owner(self, job: ClaimedJob, owner_id: str, request_id: str,
                            details: dict[str, Any],
                            earlier: list[dict[str, Any]] | None = None
                            ) -> asyncpg.Record | None:
        """Park the job (``waiting``) until request ``request_id`` is answered, its lease
        and slot let go and its attempt not spent (issue 44; functions/approvals.sql
        tool_job_park): ``outcome`` (``parked``; or ``approved``, ``denied``, ``expired``
        when the request was settled as the tool exited, the answer applied at once) and
        ``deadline``; None when this attempt no longer owns the job. ``earlier`` as for
        ``finish_if_owner``."""
        return await self.db.fetchrow(Q["park_job_if_owner"], job.id, owner_id,
                                      job.fencing_token, request_id, details, earlier or None,
                                      timeout=self.timeout)

    async def expire_parked_approvals(self) -> list[asyncpg.Record]:
        """Parked jobs (any tool) whose request passed its deadline unanswered fail
        ``approval_expired``; ``id, tool, fencing_token`` of each."""
        return await self.db.fetch(Q["expire_parked_approvals"], timeout=self.timeout)

    async def approval_state(self, request_id: uuid.UUID) -> asyncpg.Record | None:
        """``state, answered_by, reason, waited_s`` of an approval request."""
        return await self.db.fetchrow(Q["approval_state"], request_id, timeout=self.timeout)

    async def expire_approval(self, request_id: uuid.UUID) -> bool:
        """The request got no answer by its deadline: expired, journaled; False when it was
        answered meanwhile."""
        return await self.db.fetchval(Q["expire_approval"], request_id,
                                      timeout=self.timeout) is not None

    async def snooze_if_owner(
        self, job: ClaimedJob, owner_id: str, delay_seconds: float, max_snoozes: int,
        lifetime_seconds: float | None, details: dict[str, Any],
        earlier: list[dict[str, Any]] | None = None,
    ) -> asyncpg.Record | None:
        """The tool asked to run again in ``delay_seconds`` (issue 44): back to queued, the
        attempt not spent, if this attempt owns the job, it snoozed fewer than
        ``max_snoozes`` times and (``lifetime_seconds`` from its first claim, None: no
        cap) it would run again within its lifetime. Returns ``outcome`` (``snoozed``,
        ``snooze_limit``, ``past_lifetime``), ``run_after`` and ``snoozes``; None when not
        the owner. ``earlier`` as for ``finish_if_owner``."""
        return await self.db.fetchrow(
            Q["snooze_job_if_owner"], job.id, owner_id, job.fencing_token, delay_seconds,
            max_snoozes, lifetime_seconds, details, earlier or None, timeout=self.timeout)

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

    async def journaled_outcome(self, attempt: AttemptId, event: str) -> dict | None:
        """Case F16: the details of ``event`` journaled for ``attempt`` (the proof that a
        fenced write whose answer was lost did commit), or None."""
        return await self.db.fetchval(Q["journaled_outcome"], attempt.job_id,
                                      attempt.fencing_token, event, timeout=self.timeout)

    async def acknowledge_cancel_if_owner(self, job: ClaimedJob, owner_id: str,
                                          details: dict[str, Any]) -> bool:
        """The owner of a cancelled attempt says its tree is dead (case F14): the job may
        be retried at once. Journaled ``cancel_acknowledged`` with ``details``; False
        when the row is not a cancel of this attempt (nothing to acknowledge)."""
        row = await self.db.fetchrow(Q["acknowledge_cancel_if_owner"], job.id, owner_id,
                                     job.fencing_token, details, timeout=self.timeout)
        return row is not None

    # --- while an attempt runs ----------------------------------------------------

    async def save_checkpoint_if_owner(
        self, job: ClaimedJob, owner_id: str, checkpoint: RawJson, details: dict[str, Any],
    ) -> bool:
        """Store the tool's progress for the next attempt; False when not the owner."""
        row = await self.db.fetchrow(
            Q["save_checkpoint_if_owner"], job.id, owner_id, job.fencing_token, checkpoint,
            details, timeout=self.timeout)
        return row is not None

    async def confirm_lease_if_owner(self, job: ClaimedJob, owner_id: str,
                                     timeout: float) -> float | None:
        """The seconds ``job``'s lease has left by the database's clock while ``owner_id``
        holds this attempt (id, token, ``running``, ``lease_until > now()``: P5), read for
        the guard's answer (issue 41); None when it does not hold it. Bounded by
        ``timeout`` seconds (pool acquire included); raises what the store raises
        (db.DATABASE_ERRORS, TimeoutError)."""
        return await self.db.fetchval(Q["confirm_lease_if_owner"], job.id, owner_id,
                                      job.fencing_token, timeout=timeout)

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

    # --- journal ------------------------------------------------------------------

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

    @staticmethod
    async def record_event_on(
        conn: asyncpg.Connection, job_id: uuid.UUID, token: int | None, event: str,
        details: dict[str, Any], timeout: float,
    ) -> None:
        """Append one journal event on the given connection."""
        await db.run(conn, "execute", Q["record_event"], job_id, token, event, details,
                     timeout=timeout)

    # --- the claim loop's readings and wake-ups -----------------------------------

    async def sample_tool(self, tool: str, period: float) -> asyncpg.Record:
        """One poll's reading of ``tool`` (issue 28), in one statement: ``sweep`` (True when
        this caller takes the fleet's turn to run the lease and expiry sweeps: the tool's
        last sweep is at least ``period`` seconds old), ``depth`` (jobs the claim's row
        rules admit now: queued, due and before their expiry, or under an expired lease with
        an attempt left; sql/functions/claimable.sql; flow limits not applied: the claim
        says which one holds a job back), ``queue_age`` (seconds the oldest of those queued
        jobs has been due, by the database's clock; 0 when none), ``forward_backlog``
        (pending outbox rows of the tool), ``has_flow`` and the tool's flow row
        with its slots taken (``running``; NULLs without flow control)."""
        return await self.db.fetchrow(Q["sample_tool"], tool, period, timeout=self.timeout)

    async def unfinished_jobs(self, tool: str) -> int:
        """Jobs of ``tool`` still queued or running."""
        return await self.db.fetchval(Q["unfinished_jobs_of_tool"], tool, timeout=self.timeout)

    async def due_outbox_rows(self, tool: str, within_seconds: float) -> int:
        """Outbox rows of ``tool`` pending and due for delivery within ``within_seconds``."""
        return await self.db.fetchval(Q["due_outbox_rows_of_tool"], tool, within_seconds,
                                        timeout=self.timeout)

    async def register_idle(self, owner_id: str, tool: str, channel: str) -> None:
        """Record that this sidecar has room for a job of ``tool`` and found none: the
        next job queued for the tool wakes it (one NOTIFY on ``channel``), or another idle
        one, not every sidecar (migration 008, ``tool_job_wake``)."""
        await self.db.execute(Q["register_idle_sidecar"], owner_id, tool, channel,
                              timeout=self.timeout)

    async def unregister_idle(self, owner_id: str) -> None:
        """Take this sidecar off the idle list (it stops, or stops listening)."""
        await self.db.execute(Q["unregister_idle_sidecar"], owner_id, timeout=self.timeout)

    async def drop_rate_turns(self, tool: str, owner_id: str) -> None:
        """Give up ``owner_id``'s turns at ``tool``'s rate (a sidecar that stops), so the
        others do not wait for them."""
        await self.db.execute(Q["drop_rate_turns"], tool, owner_id, timeout=self.timeout)

    # --- result outbox ------------------------------------------------------------

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

    async def outbox_retry_later(self, row_id: int, owner_id: str, delay_seconds: float,
                                 status: int | None, error: str) -> bool:
        """Give the row back for another try after ``delay_seconds``. ``error`` (the
        receiver's answer or the connection error) is stored scrubbed, as every text
        column a message reaches (``masking.SECRETS``); jsonb values are scrubbed by
        sidecar.storage.db's encoder."""
        return await self.db.fetchrow(Q["outbox_retry_later_if_owner"], row_id, owner_id,
                                        delay_seconds, status, SECRETS.scrub(error),
                                        timeout=self.timeout) is not None
