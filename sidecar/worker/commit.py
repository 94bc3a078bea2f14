"""The fenced end of one attempt: ``FencedCommit.end(ending)`` is its only ender. The kind
of ending (a verdict: Succeeded, Failure, Release, Reject) picks one fenced write
(``_ENDERS``); every write goes through one retry policy (``_fenced``) while the lease's
local deadline allows; and one table (``ENDING_REPORTS``) says how each way of ending is
logged and journaled; its outcome is counted in one place (sidecar_attempts_finished_total).

A fenced write (``*_if_owner`` in sidecar.storage.worker_store) carries the job id, owner, token and
``lease_until > now()`` (P6). "Not accepted" means another owner holds the job: the
outcome is journaled as ``result_rejected`` (hash and size only), never published. "The
database failed" (``db.UNAVAILABLE_ERRORS``: no answer, a dropped connection, a read-only
failover primary) means ownership is unknown: the write is repeated on a new connection
until the local deadline (a fenced write is safe to repeat), then the attempt is abandoned
(P14b, case F12).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import asyncpg

from sidecar.ops import metrics
from sidecar.ops.tracing import NO_TRACE, AttemptTrace
from sidecar.protocol import clock
from sidecar.protocol.errors import NextStageConflict, OwnershipUnknown
from sidecar.protocol.model import ClaimedJob, JobState, LeaseProfile
from sidecar.protocol.verdict import (
    Ending,
    Failure,
    Park,
    Reject,
    Release,
    Snooze,
    Succeeded,
    failure,
    lifetime_failure,
    profile_var,
)
from sidecar.protocol.vocabulary import FailureKind, Outcome, StopReason
from sidecar.runtime.log import log, log_fields
from sidecar.storage import db
from sidecar.worker import isolation
from sidecar.worker.context import WorkerContext
from sidecar.worker.lease import Lease

T = TypeVar("T")
# What an ender returns: the outcome (the metric's label), how it came about (the key of
# ENDING_REPORTS) and the fields of its log line.
Ended = tuple[Outcome, "How", dict[str, Any]]

# What the outcome of an attempt is when its lease ended before anything was committed.
LEASE_ENDING_OUTCOMES = {StopReason.LEASE_LOST: Outcome.LEASE_LOST,
                         StopReason.CANCELLED: Outcome.CANCELLED,
                         StopReason.LOCAL_DEADLINE: Outcome.ABANDONED}
# Attempts that ended without writing their outcome: the job may have been cancelled under
# them, and their tree is dead now (case F14).
ACKNOWLEDGING_OUTCOMES = frozenset({Outcome.CANCELLED, Outcome.LEASE_LOST, Outcome.REJECTED,
                                    Outcome.ABANDONED})


# How long an event noted during an attempt (tool_request_started, child_killed) may wait
# to travel with the statement that ends the attempt before it is written on its own: an
# attempt shorter than this costs no journal round trip of its own; a longer one has the
# row in the journal within this many seconds of the event (P22).
JOURNAL_DEFER_SECONDS = 1.0


# metric.labels(*values), each label set looked up once (prometheus_client validates the
# values and takes a lock at every labels() call: about 2 us, several times per job).
# Safe because the metrics counted per job are never cleared nor their children removed.
_LABELLED: dict[tuple[int, tuple[str, ...]], Any] = {}


def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)`` (a prometheus_client metric's child for these label
    values), looked up once per process and label set. Only for metrics whose children
    are never removed (the per-attempt counters and histograms)."""
    key = (id(metric), values)
    child = _LABELLED.get(key)
    if child is None:
        child = _LABELLED[key] = metric.labels(*values)
    return child


def backoff_seconds(profile: LeaseProfile, attempt: int) -> float:
    """Exponential backoff with full jitter (P16): a uniform draw in
    [0, min(cap, base x 2^(attempt-1))] seconds, so retries of many jobs spread out."""
    delay = min(profile.backoff_max_seconds, profile.backoff_base_seconds * 2 ** (attempt - 1))
    return random.uniform(0.0, delay)


class FencedCommit:
    """Ends one attempt of ``job`` held under ``lease`` by one call, ``end(ending)``:
    commit, fail (requeue or dead letter), release, or record that the lease was lost,
    returning the Outcome. Besides: ``note`` (events to journal with the end),
    ``journal``, ``acknowledge_cancel`` (after the end) and ``crashed``. ``resources``
    (peak memory, CPU time) go into every journaled summary."""

    def __init__(self, ctx: WorkerContext, job: ClaimedJob, lease: Lease, started: float,
                 trace: AttemptTrace = NO_TRACE):
        self.ctx = ctx
        self.trace = trace  # the attempt's trace: the write's span, a stale result's event
        self.job = job
        self.lease = lease
        self.started = started  # monotonic seconds at the claim
        self.resources: dict[str, Any] = {}
        self._noted: list[tuple[str, dict[str, Any], float]] = []  # (event, details, when)
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Future | None = None

    def note(self, event: str, details: dict[str, Any]) -> None:
        """Journal ``event`` with the statement that ends the attempt, or on its own after
        JOURNAL_DEFER_SECONDS if the attempt is still running then; it keeps its own time
        either way."""
        self._noted.append((event, details, time.monotonic()))
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                JOURNAL_DEFER_SECONDS, self._flush_noted)

    def _flush_noted(self) -> None:
        self._flush_timer = None
        if self._noted:
            self._flushing = asyncio.ensure_future(self._write(self._pop_noted(), None, {}))

    async def _take_noted(self) -> list[dict[str, Any]]:
        """The noted events not yet written, as the ``earlier`` of a WorkerStore statement;
        waits for a flush already on its way, so the journal keeps their order."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._flushing is not None and not self._flushing.done():
            await asyncio.shield(self._flushing)
        return self._pop_noted()

    def _pop_noted(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        taken = [{"event": event, "age_s": round(now - when, 3), "details": details}
                 for event, details, when in self._noted]
        self._noted = []
        return taken

    def _give_back(self, earlier: list[dict[str, Any]]) -> None:
        """Events a statement did not write (not the owner): the next journal row takes
        them."""
        now = time.monotonic()
        self._noted[:0] = [(e["event"], e["details"], now - e["age_s"]) for e in earlier]
        if self._noted and self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                JOURNAL_DEFER_SECONDS, self._flush_noted)

    def _duration(self) -> float:
        return round(time.monotonic() - self.started, 3)

    async def end(self, ending: Ending) -> Outcome:
        """End this attempt by ``ending`` (a verdict; a Commit's output checked into
        Succeeded) with the one fenced write its kind calls for (``_ENDERS``), then
        report it once: its log line (``ENDING_REPORTS``), the attempt's outcome and
        duration metrics. The only place an attempt's outcome is written, logged and
        counted."""
        self.trace.committing()
        outcome, how, fields = await _ENDERS[type(ending)](self, ending)
        self.trace.ended(outcome, how, fields)
        report = ENDING_REPORTS[how]
        if report.event is not None:
            log.emit(report.event, report.level, **log_fields(self.job), **fields)
        self._count(outcome, fields.get("reason")
                    if outcome in (Outcome.FAILED, Outcome.REQUEUED) else None)
        return outcome

    async def ask_approval(self, request_id: Any, action: str, summary: str,
                           details: dict[str, Any], seconds: float) -> Any:
        """Write this attempt's approval request (issue 44; a tool without HTTP asked by
        its file): ``id, attempt, deadline``, or None when the attempt no longer owns the
        job. Not an end: the attempt then ends parked through ``end``. Raises what the
        store raises (asyncpg.UniqueViolationError for an open request of its own)."""
        return await self.ctx.store.ask_approval(self.job, self.ctx.owner_id, request_id,
                                                 action, summary, details, seconds)

    async def acknowledge_cancel(self, outcome: Outcome) -> None:
        """After ``end``, once the attempt's tree is dead: an attempt that ended without
        writing its outcome (``ACKNOWLEDGING_OUTCOMES``) says so if the job was cancelled
        under it, so ``sidecar retry`` need not wait for the lease to end (case F14).
        Best effort, never raises: without it, retry waits until the lease ends."""
        if outcome not in ACKNOWLEDGING_OUTCOMES:
            return
        try:
            acknowledged = await self.ctx.store.acknowledge_cancel_if_owner(
                self.job, self.ctx.owner_id,
                {"owner_id": self.ctx.owner_id, "outcome": str(outcome)})
        except Exception as exc:  # noqa: BLE001 - the lease end releases the retry anyway
            log.emit("journal_error", "warning", **log_fields(self.job),
                     reason=f"cancel_acknowledged: {type(exc).__name__}")
            return
        if acknowledged:
            log.emit("cancel_acknowledged", **log_fields(self.job), outcome=str(outcome))

    def crashed(self) -> None:
        """The supervisor raised before an outcome was written (a bug): counted as
        abandoned, as the lease expires by itself."""
        self._count(Outcome.ABANDONED)

    def _count(self, outcome: Outcome, kind: str | None = None) -> None:
        """Count one attempt's end: its outcome, its duration and, for a failure (failed
        or requeued), its error.kind."""
        labels = (self.job.tool, self.ctx.profile.provider)
        labelled(metrics.ATTEMPTS_FINISHED, *labels, outcome).inc()
        if kind is not None:
            labelled(metrics.ATTEMPT_FAILURES, *labels, kind).inc()
        labelled(metrics.ATTEMPT_DURATION, *labels).observe(time.monotonic() - self.started)

    async def _succeed(self, ending: Succeeded) -> Ended:
        """Commit the result (and create its next stage, P19) if the lease is still ours."""
        digest, next_stage = dict(ending.digest), ending.next_stage
        details = {"result": digest, "duration_s": self._duration(), **self.resources}
        earlier = await self._take_noted()
        try:
            accepted = await self._fenced(lambda: self.ctx.store.finish_if_owner(
                self.job, self.ctx.owner_id, JobState.SUCCEEDED, ending.result, None,
                "job_succeeded", details, self.ctx.profile.result_url or None, next_stage,
                earlier), "job_succeeded", cancel_is_final=True)
        except OwnershipUnknown:
            self._give_back(earlier)
            return await self._abandon(digest)
        except asyncpg.QueryCanceledError as exc:  # rolled back: nothing was written (F18)
            self._give_back(earlier)
            return await self._fail(failure(
                FailureKind.COMMIT_TIMEOUT,
                f"the server cancelled the commit of the {digest['bytes']}-byte result "
                f"({db.describe_error(exc)}); nothing was stored; raise "
                "SIDECAR_DB_TIMEOUT_SECONDS (the sidecar's statement_timeout is 0.9 x it)",
                stderr_tail=ending.stderr_tail))
        except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as exc:  # jsonb refused
            self._give_back(earlier)
            return await self._fail(failure(
                FailureKind.BAD_RESULT, f"PostgreSQL refused the result as jsonb: {exc}",
                stderr_tail=ending.stderr_tail))
        except NextStageConflict as exc:
            # Case F22: the stage's key belongs to another job; the statement wrote nothing.
            # Never a silent success: journaled, logged loudly, and the attempt fails.
            self._give_back(earlier)
            holder = str(exc.holder_id) if exc.holder_id else None
            log.emit("next_stage_conflict", "error", **log_fields(self.job), key=exc.key,
                     holder_id=holder, next_tool=next_stage.tool if next_stage else None)
            self.note("next_stage_conflict", {"key": exc.key, "holder_id": holder,
                                              "next_tool": next_stage.tool if next_stage
                                              else None})
            return await self._fail(failure(FailureKind.NEXT_STAGE_CONFLICT, exc.message,
                                            key=exc.key, holder_id=holder))
        if not accepted:
            self._give_back(earlier)
            await self.reject(digest, "not the owner at commit")
            return Outcome.REJECTED, How.REJECTED, {}
        if self.ctx.profile.result_url:
            self.ctx.result_queued()
        return Outcome.SUCCEEDED, How.COMMITTED, {
            "duration_s": details["duration_s"],
            "next_tool": next_stage.tool if next_stage else None}

    async def _fail(self, fault: Failure) -> Ended:
        """Record ``fault``: requeued after backoff while it is retryable and attempts
        remain, else the job fails for good (P16). Every attempt's summary is journaled,
        the last error goes to the row."""
        job = self.job
        error = fault.error()
        duration = self._duration()
        summary = {"attempt": job.attempt, "kind": error["kind"], "duration_s": duration,
                   **{k: error[k] for k in ("exit_code", "signal") if k in error},
                   **self.resources}
        if self.ctx.sandbox is not None:
            # The payload names an input the sandbox hides: say why the tool failed
            # (issue 41, point 8), in the row's error and the attempt's journal row.
            named = isolation.hidden_paths_named(self.ctx.sandbox, job.payload_text)
            if named:
                error["hint"] = isolation.hidden_path_hint(named)
                summary["hidden_paths"] = named
        if fault.retryable and job.attempt < job.max_attempts:
            delay = backoff_seconds(self.ctx.profile, job.attempt)
            earlier = await self._take_noted()
            try:
                run_after = await self._fenced(lambda: self.ctx.store.requeue_if_owner(
                    job, self.ctx.owner_id, error, delay,
                    {**summary, "backoff_s": round(delay, 3)}, earlier), "job_retry_scheduled")
            except OwnershipUnknown:
                self._give_back(earlier)
                return await self._abandon(None)
            if run_after is None:
                self._give_back(earlier)
                await self.reject(None, "not the owner at requeue")
                return Outcome.REJECTED, How.REJECTED, {}
            return Outcome.REQUEUED, How.REQUEUED, {
                "reason": error["kind"], "duration_s": duration, "run_after": run_after}
        if fault.retryable:
            error["message"] += f"; attempt {job.attempt} of {job.max_attempts}, none left"
        earlier = await self._take_noted()
        try:
            accepted = await self._fenced(lambda: self.ctx.store.finish_if_owner(
                job, self.ctx.owner_id, JobState.FAILED, None, error, "job_failed", summary,
                earlier=earlier), "job_failed")
        except OwnershipUnknown:
            self._give_back(earlier)
            return await self._abandon(None)
        if not accepted:
            self._give_back(earlier)
            await self.reject(None, "not the owner at commit")
            return Outcome.REJECTED, How.REJECTED, {}
        return Outcome.FAILED, How.FAILED, {
            "reason": error["kind"], "duration_s": duration, "exit_code": error.get("exit_code")}

    async def _park(self, ending: Park) -> Ended:
        """The tool asked a person's yes in park mode (issue 44): its job waits for the
        answer as ``waiting``, its slot and lease let go, its attempt not spent."""
        details = {"duration_s": self._duration(), **self.resources}
        earlier = await self._take_noted()
        try:
            row = await self._fenced(lambda: self.ctx.store.park_if_owner(
                self.job, self.ctx.owner_id, ending.request_id, details, earlier),
                "job_parked")
        except OwnershipUnknown:
            self._give_back(earlier)
            return await self._abandon(None)
        if row is None:
            self._give_back(earlier)
            await self.reject(None, "not the owner when parking")
            return Outcome.REJECTED, How.REJECTED, {}
        # parked; or answered as the tool exited, applied by the same statement
        return Outcome.PARKED, How.PARKED, {
            "request_id": ending.request_id, "action": ending.action,
            "deadline": row["deadline"], "outcome": row["outcome"]}

    async def _snooze(self, ending: Snooze) -> Ended:
        """The tool asked to run again later (issue 44, point 3): back to the queue after
        its delay, the attempt not spent, while the job snoozed fewer than MAX_SNOOZES
        times and would run again within MAX_LIFETIME_SECONDS of its first claim (both
        checked by the fenced write, on the database's clock); past either, the job fails
        ``snooze_limit`` or ``max_lifetime_exceeded`` (not retried)."""
        profile = self.ctx.profile
        details = {"delay_s": ending.delay_seconds, "via": ending.via,
                   "duration_s": self._duration(), **self.resources,
                   **({"reason": ending.reason} if ending.reason else {})}
        earlier = await self._take_noted()
        try:
            row = await self._fenced(lambda: self.ctx.store.snooze_if_owner(
                self.job, self.ctx.owner_id, ending.delay_seconds, profile.max_snoozes,
                profile.max_lifetime_seconds or None, details, earlier), "job_snoozed")
        except OwnershipUnknown:
            self._give_back(earlier)
            return await self._abandon(None)
        if row is None:
            self._give_back(earlier)
            await self.reject(None, "not the owner at snooze")
            return Outcome.REJECTED, How.REJECTED, {}
        if row["outcome"] == "snoozed":
            return Outcome.SNOOZED, How.SNOOZED, {
                "delay_s": ending.delay_seconds, "via": ending.via,
                "run_after": row["run_after"], "snoozes": row["snoozes"]}
        self._give_back(earlier)  # written with the failure instead
        if row["outcome"] == "snooze_limit":
            return await self._fail(failure(
                FailureKind.SNOOZE_LIMIT,
                f"the tool asked to run later more than {profile.max_snoozes} times (its "
                f"MAX_SNOOZES); raise {profile_var(profile, 'MAX_SNOOZES')} or let it "
                "finish", delay_s=ending.delay_seconds))
        return await self._fail(lifetime_failure(profile, delay_s=ending.delay_seconds))

    async def _release(self, ending: Release) -> Ended:
        """Give the lease back without spending the attempt: at shutdown, or (reason
        "shortage", case F19) when the host ran short of something before the tool ran."""
        earlier = await self._take_noted()
        try:
            released = await self._fenced(lambda: self.ctx.store.release_if_owner(
                self.job, self.ctx.owner_id,
                {"reason": ending.reason, "owner_id": self.ctx.owner_id}, earlier),
                "lease_released")
        except OwnershipUnknown:
            self._give_back(earlier)
            return await self._abandon(None)
        if not released:
            self._give_back(earlier)
            await self.journal(None, {})
        if released:
            return Outcome.RELEASED, How.RELEASED, {"reason": ending.reason}
        return Outcome.LEASE_LOST, How.NOT_RELEASED, {"reason": ending.reason}

    async def _lease_ended(self, ending: Reject) -> Ended:
        """The lease ended before the outcome was written (P13): nothing is committed; a
        result the tool returned (``digest``) is only journaled."""
        if ending.digest is not None:
            await self.reject(dict(ending.digest), "lease lost before commit")
        elif self._noted or self._flush_timer is not None:
            await self.journal(None, {})  # what the attempt noted, on its own
        return LEASE_ENDING_OUTCOMES[ending.reason], How.LEASE_ENDED, {
            "reason": str(ending.reason), "duration_s": self._duration()}

    async def reject(self, digest: dict[str, Any] | None, why: str) -> None:
        """P6: an outcome we may not commit goes to the journal as hash and size only
        (``digest``: payload_digest of the output, None when there was none). When
        ownership is unknown the database may be unreachable: the lease keeper journals it
        once the database answers again."""
        details: dict[str, Any] = {"why": why, "owner_id": self.ctx.owner_id}
        if digest is not None:
            details["result"] = digest
        log.emit("result_rejected", "warning", **log_fields(self.job), reason=why)
        self.trace.rejected(digest, why)
        metrics.COMPLETIONS_REJECTED.labels(self.job.tool, self.ctx.profile.provider).inc()
        if self.lease.abandoned:
            self.lease.keep_evidence(details)
        else:
            await self.journal("result_rejected", details)

    async def _abandon(self, digest: dict[str, Any] | None) -> Ended:
        """The outcome could not be written before the local deadline: give the job up."""
        self.lease.lose(StopReason.LOCAL_DEADLINE)
        await self.reject(digest, "ownership unknown at commit")
        return Outcome.ABANDONED, How.ABANDONED_AT_COMMIT, {
            "reason": "outcome not written before the local deadline; ownership unknown"}

    async def _fenced(self, write: Callable[[], Awaitable[T]], event: str, *,
                      cancel_is_final: bool = False) -> T:
        """Run a fenced write; when the database failed (``db.UNAVAILABLE_ERRORS``, a
        failover's read-only primary too, case F12), retry on a new connection while the
        local deadline allows. Past it, raise OwnershipUnknown.

        A write the server ended on a timeout (``db.TIMEOUT_ERRORS``, cases F17, F18) was
        rolled back and says nothing about ownership: a lock wait (55P03: another session
        holds the row) is retried the same way; a cancelled statement (57014) is retried
        too, unless ``cancel_is_final``, when the QueryCanceledError is raised at once.

        Case F16: a write whose answer was lost (connection dropped, no answer in time)
        may have committed; its retry then finds the job no longer ours. Before such a
        "not accepted" is believed, the journal is asked whether ``event`` (which the
        write journals in its own statement) is there for this attempt: if so the write
        did commit, and its details (``run_after`` for a requeue, else True) are returned."""
        answer_lost = False
        while True:
            try:
                result = await write()
            except db.TIMEOUT_ERRORS as exc:
                if cancel_is_final and isinstance(exc, asyncpg.QueryCanceledError):
                    log.emit("commit_cancelled", "warning", **log_fields(self.job),
                             reason=db.describe_error(exc), sqlstate=db.sqlstate(exc))
                    raise
                await self._before_retry(exc)
            except db.UNAVAILABLE_ERRORS as exc:
                answer_lost = True
                await self._before_retry(exc)
            else:
                if not result and answer_lost:
                    settled = await self._settle_lost_answer(event)
                    if settled is not None:
                        return settled
                return result

    async def _settle_lost_answer(self, event: str) -> Any:
        """Case F16: did the write whose answer was lost commit? Its journal row says."""
        try:
            details = await self.ctx.store.journaled_outcome(self.job.attempt_id, event)
        except Exception as exc:  # noqa: BLE001 - unsettled: the write counts as refused
            log.emit("commit_unsettled", "warning", **log_fields(self.job), journal_event=event,
                     reason=db.describe_error(exc))
            return None
        if details is None:
            return None
        log.emit("commit_answer_lost", "warning", **log_fields(self.job), journal_event=event,
                 reason="the write's answer was lost, and the journal shows it committed")
        return (details.get("run_after") if isinstance(details, dict) else None) or True

    async def _before_retry(self, exc: BaseException) -> None:
        """Log one ``commit_retry`` and wait a little; OwnershipUnknown past the deadline."""
        if clock.ownership_now() >= self.lease.local_deadline:
            raise OwnershipUnknown() from exc
        log.emit("commit_retry", "warning", **log_fields(self.job),
                 reason=db.describe_error(exc), sqlstate=db.sqlstate(exc))
        await asyncio.sleep(min(0.5, self.ctx.profile.heartbeat_seconds / 2))

    async def journal(self, event: str | None, details: dict[str, Any]) -> None:
        """One journal row for this attempt (none for ``event`` None), after the events
        noted and not yet written, in one statement; a failure to write them is logged,
        never raised (the journal must not take the supervisor down)."""
        await self._write(await self._take_noted(), event, details)

    async def _write(self, earlier: list[dict[str, Any]], event: str | None,
                     details: dict[str, Any]) -> None:
        if not earlier and event is None:
            return
        try:
            await self.ctx.store.record_events(self.job.id, self.job.fencing_token, earlier,
                                               event, details)
        except Exception:  # noqa: BLE001
            # Not lost (case F24): the lease keeper writes a lease's unjournaled events once
            # the database answers, while it holds the lease or probes it as abandoned.
            kept = [(e["event"], {**e["details"], "noted_s_before_written": e["age_s"]})
                    for e in earlier]
            self.lease.keep_for_journal(kept + ([(event, details)] if event else []))
            log.emit("journal_error", "warning", **log_fields(self.job),
                     reason=event or ",".join(e["event"] for e in earlier),
                     kept_for_later=bool(self.lease.abandoned or not self.lease.lost.is_set()))


class How(StrEnum):
    """How an attempt ended, as its one report line tells it (``ENDING_REPORTS``)."""

    COMMITTED = "committed"                 # the result is stored (Outcome.SUCCEEDED)
    REQUEUED = "requeued"                   # a retryable failure, attempts left
    FAILED = "failed"                       # for good (P16)
    RELEASED = "released"                   # the lease given back, the attempt not spent
    SNOOZED = "snoozed"                     # queued again later at the tool's ask
    PARKED = "parked"                       # waiting for a person's answer
    NOT_RELEASED = "not_released"           # the release found the job no longer ours
    LEASE_ENDED = "lease_ended"             # lost, cancelled or given up before any write
    ABANDONED_AT_COMMIT = "abandoned_at_commit"  # the write not done by the local deadline
    REJECTED = "rejected"                   # the write found another owner


@dataclass(frozen=True)
class OutcomeReport:
    """How one way of ending is reported: its log line (``event`` at ``level``; None when
    the rejection's own ``result_rejected`` line says it) and the fenced statement's
    journal row (``journal``; None when nothing was written, the row being another's)."""

    event: str | None
    level: str
    journal: str | None


# One table from how an attempt ended to what is logged and journaled; the outcome each
# ender returns beside it is counted in sidecar_attempts_finished_total{outcome}.
ENDING_REPORTS: dict[How, OutcomeReport] = {
    How.COMMITTED: OutcomeReport("job_succeeded", "info", "job_succeeded"),
    How.REQUEUED: OutcomeReport("job_retry_scheduled", "warning", "job_retry_scheduled"),
    How.FAILED: OutcomeReport("job_failed", "warning", "job_failed"),
    How.RELEASED: OutcomeReport("lease_released", "info", "lease_released"),
    How.SNOOZED: OutcomeReport("job_snoozed", "info", "job_snoozed"),
    How.PARKED: OutcomeReport("job_parked", "info", "job_parked"),
    How.NOT_RELEASED: OutcomeReport("lease_lost", "warning", None),
    How.LEASE_ENDED: OutcomeReport("lease_lost", "warning", None),
    How.ABANDONED_AT_COMMIT: OutcomeReport("lease_abandoned", "error", None),
    How.REJECTED: OutcomeReport(None, "warning", "result_rejected"),
}

# The one fenced write per kind of ending.
_ENDERS: dict[type, Callable[[FencedCommit, Any], Awaitable[Ended]]] = {
    Succeeded: FencedCommit._succeed,
    Failure: FencedCommit._fail,
    Release: FencedCommit._release,
    Snooze: FencedCommit._snooze,
    Park: FencedCommit._park,
    Reject: FencedCommit._lease_ended,
}
