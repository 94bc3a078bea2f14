"""One job, start to end: spawn -> race(exit | lease lost | cancel | stage deadline |
lifetime cap | idle tree | shutdown) -> kill the tree -> fenced commit.

The race lives in ``JobSupervisor.run``; its outcome is one ``stop_reason`` that decides
the final state, the journal event and the log line (P8, P13).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import orjson
import psutil

from sidecar import lease as lease_mod
from sidecar import metrics
from sidecar.child import Child, SpawnFailed
from sidecar.config import LeaseProfile, Settings
from sidecar.db import RawJson
from sidecar.lease import Lease, LeaseKeeper
from sidecar.log import log, payload_digest
from sidecar.store import ClaimedJob, NextStage, Store

if TYPE_CHECKING:
    from sidecar.guard import GuardServer

# Why the child stopped; the first one observed wins.
EXITED = "exited"
STAGE_TIMEOUT = "stage_timeout"
LIFETIME = "max_lifetime_exceeded"
IDLE = "idle_timeout"
TOO_LARGE = "result_too_large"
SHUTDOWN = "shutdown"

CHECKPOINT_FILE_NAME = "checkpoint.json"

_STDERR_LINES_PER_SECOND = 200
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerContext:
    """What every supervisor of one sidecar shares."""

    store: Store
    keeper: LeaseKeeper
    profile: LeaseProfile
    owner_id: str
    argv: list[str]
    base_env: dict[str, str]
    shutdown_kill: asyncio.Event
    result_queued: Callable[[], None]
    settings: Settings
    guard: GuardServer | None = None
    guard_url: str = ""


def child_environment(base_env: dict[str, str], job: ClaimedJob, profile: LeaseProfile,
                      owner_id: str) -> dict[str, str]:
    """The child's environment: the sidecar's without any ``SIDECAR_*`` variable (the child
    never sees the database URL), plus the job's variables (README, "The child process")."""
    env = {k: v for k, v in base_env.items() if not k.startswith("SIDECAR_")}
    env.update(
        SIDECAR_JOB_ID=str(job.id),
        SIDECAR_TOOL=job.tool,
        SIDECAR_ATTEMPT=str(job.attempt),
        SIDECAR_FENCING_TOKEN=str(job.fencing_token),
        SIDECAR_IDEMPOTENCY_KEY=f"tool-job:{job.id}",
        SIDECAR_STAGE_TIMEOUT_SECONDS=f"{profile.stage_timeout_seconds:g}",
        SIDECAR_OWNER_ID=owner_id,
    )
    return env


def backoff_seconds(profile: LeaseProfile, attempt: int) -> float:
    """Exponential backoff with full jitter (P16): a uniform draw in
    [0, min(cap, base x 2^(attempt-1))] seconds, so retries of many jobs spread out."""
    delay = min(profile.backoff_max_seconds, profile.backoff_base_seconds * 2 ** (attempt - 1))
    return random.uniform(0.0, delay)


class _StderrRelay:
    """The child's stderr in the log. By default (P23) only a count: one ``tool_stderr``
    event with lines and bytes when the attempt ends. With ``SIDECAR_LOG_TOOL_STDERR`` each
    line is an event of its own, at most ``_STDERR_LINES_PER_SECOND`` a second; the rest
    are counted, not lost silently."""

    def __init__(self, job: ClaimedJob, with_content: bool):
        self.job = job
        self.with_content = with_content
        self.window = time.monotonic()
        self.count = 0
        self.dropped = 0
        self.lines = 0
        self.bytes = 0

    def summary(self) -> None:
        """The end-of-attempt event: how much the tool wrote to stderr."""
        self.flush()
        if self.lines:
            log.emit("tool_stderr", job_id=str(self.job.id), tool=self.job.tool,
                     fencing_token=self.job.fencing_token, lines=self.lines, bytes=self.bytes)

    def __call__(self, line: bytes) -> None:
        self.lines += 1
        self.bytes += len(line) + 1
        if not self.with_content:
            return
        now = time.monotonic()
        if now - self.window >= 1.0:
            self.flush()
            self.window, self.count = now, 0
        self.count += 1
        if self.count > _STDERR_LINES_PER_SECOND:
            self.dropped += 1
            return
        log.emit("tool_stderr", job_id=str(self.job.id), tool=self.job.tool,
                 fencing_token=self.job.fencing_token,
                 line=line.decode("utf-8", "replace").rstrip("\r"))

    def flush(self) -> None:
        if self.dropped:
            log.emit("tool_stderr_dropped", "warning", job_id=str(self.job.id),
                     tool=self.job.tool, lines=self.dropped)
            self.dropped = 0


class JobSupervisor:
    """Runs one claimed job to a terminal, requeued, released or abandoned end."""

    def __init__(self, ctx: WorkerContext, job: ClaimedJob, lease: Lease):
        self.ctx = ctx
        self.job = job
        self.lease = lease
        self.started = time.monotonic()

    def _fields(self) -> dict[str, Any]:
        return {"job_id": str(self.job.id), "tool": self.job.tool,
                "fencing_token": self.job.fencing_token, "attempt": self.job.attempt}

    async def run(self) -> str:
        """Supervise the job; return how it ended (the stop reason or the outcome)."""
        try:
            outcome = await self._run()
        finally:
            self.ctx.keeper.drop(self.job.id)
        labels = (self.job.tool, self.ctx.profile.provider)
        metrics.JOBS_FINISHED.labels(*labels, outcome).inc()
        metrics.JOB_DURATION.labels(*labels).observe(time.monotonic() - self.started)
        return outcome

    async def _run(self) -> str:
        job, profile = self.job, self.ctx.profile
        payload = job.payload_text.encode()
        log.emit("job_claimed", **self._fields(), lease_until=job.lease_until,
                 reclaimed=job.reclaimed or None, payload=payload_digest(payload))
        if job.lifetime_remaining is not None and job.lifetime_remaining <= 0:
            self.lease.settle()
            return await self._fail(self._lifetime_error(), retryable=False)
        env = child_environment(self.ctx.base_env, job, profile, self.ctx.owner_id)
        with tempfile.TemporaryDirectory(prefix="sidecar-job-") as job_dir:
            if job.checkpoint_text is not None:
                path = os.path.join(job_dir, CHECKPOINT_FILE_NAME)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(job.checkpoint_text)
                env["SIDECAR_CHECKPOINT_FILE"] = path
            if self.ctx.guard is not None:
                env["SIDECAR_GUARD_URL"] = self.ctx.guard_url
                env["SIDECAR_GUARD_TOKEN"] = self.ctx.guard.register(self.lease)
            try:
                return await self._supervise(env, payload)
            finally:
                if self.ctx.guard is not None:
                    self.ctx.guard.unregister(job.id)

    async def _supervise(self, env: dict[str, str], payload: bytes) -> str:
        profile = self.ctx.profile
        cookie = {k: env[k] for k in ("SIDECAR_JOB_ID", "SIDECAR_FENCING_TOKEN")}
        relay = _StderrRelay(self.job, self.ctx.settings.log_tool_stderr)
        try:
            child = await Child.spawn(self.ctx.argv, env, payload, profile.max_result_bytes,
                                      relay, cookie)
        except SpawnFailed as exc:
            log.emit("spawn_failed", "error", **self._fields(), reason=exc.message)
            error = {"kind": "spawn_failed", "message": exc.message, "exit_code": exc.exit_code}
            self.lease.settle()
            return await self._fail(error, retryable=False)

        await self._journal("tool_request_started", {"pid": child.pid, "argv0": self.ctx.argv[0],
                                                     "payload": payload_digest(payload)})
        log.emit("tool_request_started", **self._fields(), pid=child.pid)

        reason = await self._race(child)
        if reason != EXITED:
            self.lease.stopping = reason  # the guard refuses from now on ("deadline")
        report = await child.kill_tree(profile.kill_grace_seconds)
        await child.close_pipes(timeout=1.0)
        relay.summary()
        if reason != EXITED or report.signal is not None:
            kill_reason = reason if reason != EXITED else "orphaned_descendants"
            details = {"reason": kill_reason, "signal": report.signal and report.signal.name,
                       "killed": len(report.killed), "survivors": len(report.survivors)}
            log.emit("child_killed", "warning", **self._fields(), reason=kill_reason,
                     signal=details["signal"], killed=len(report.killed),
                     survivors=report.survivors or None)
            labels = (self.job.tool, self.ctx.profile.provider)
            metrics.CHILD_KILLS.labels(*labels, kill_reason, details["signal"] or "none").inc()
            metrics.PROCESSES_LEFT.labels(*labels).inc(len(report.survivors))
            await self._journal("child_killed", details)
        return await self._settle(reason, child)

    async def _race(self, child: Child) -> str:
        """Wait for the first of: the child exits, the lease is lost (or cancelled), the
        stage deadline or the job's lifetime cap passes, the tree goes idle, or shutdown
        demands the kill. Return which. Ownership wins every tie (P13)."""
        profile = self.ctx.profile
        timeout, on_timeout = profile.stage_timeout_seconds, STAGE_TIMEOUT
        lifetime = self.job.lifetime_remaining
        if lifetime is not None and lifetime - (time.monotonic() - self.started) < timeout:
            timeout, on_timeout = max(0.0, lifetime - (time.monotonic() - self.started)), LIFETIME
        waiters = {
            asyncio.ensure_future(asyncio.shield(child.exited)): EXITED,
            asyncio.ensure_future(self.lease.lost.wait()): "lease",
            asyncio.ensure_future(self.ctx.shutdown_kill.wait()): SHUTDOWN,
            asyncio.ensure_future(asyncio.shield(child.overflowed)): TOO_LARGE,
        }
        if profile.idle_timeout_seconds > 0:
            waiters[asyncio.ensure_future(
                watch_idle(child, profile.idle_timeout_seconds))] = IDLE
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in waiters:
                fut.cancel()
        if self.lease.lost.is_set():
            return self.lease.reason or lease_mod.LEASE_LOST
        if not done:
            return on_timeout
        reasons = {waiters[fut] for fut in done}
        for reason in (SHUTDOWN, EXITED, TOO_LARGE, IDLE):
            if reason in reasons:
                return reason
        return EXITED

    async def _settle(self, reason: str, child: Child) -> str:
        profile = self.ctx.profile
        duration = round(time.monotonic() - self.started, 3)
        self.lease.settle()
        if self.lease.lost.is_set():
            # P13: the lease is gone, whatever the tool answered. Keep evidence only.
            if child.returncode == 0 and not child.stdout_overflow:
                await self._reject(bytes(child.stdout), "lease lost before commit")
            log.emit("lease_lost", "warning", **self._fields(), reason=self.lease.reason,
                     duration_s=duration)
            return self.lease.reason or lease_mod.LEASE_LOST
        if reason == SHUTDOWN:
            released = await self._release()
            return "released" if released else "lease_lost"
        stderr_tail = child.stderr_tail.decode("utf-8", "replace") or None
        if reason == STAGE_TIMEOUT:
            error = {"kind": "stage_timeout", "stderr_tail": stderr_tail,
                     "message": f"no result within the stage deadline of "
                                f"{profile.stage_timeout_seconds:g} s; the tree was killed"}
            return await self._fail(error, retryable=True)
        if reason == IDLE:
            error = {"kind": "idle_timeout", "stderr_tail": stderr_tail,
                     "message": f"no CPU time, I/O or output for "
                                f"{profile.idle_timeout_seconds:g} s; the tree was killed"}
            return await self._fail(error, retryable=True)
        if reason == TOO_LARGE:
            error = {"kind": "result_too_large", "stderr_tail": stderr_tail,
                     "message": f"stdout passed {profile.max_result_bytes} bytes; the tree was "
                                "killed. Return less, or raise "
                                "SIDECAR_PROFILE_<TOOL>_MAX_RESULT_BYTES"}
            return await self._fail(error, retryable=False)
        if reason == LIFETIME:
            return await self._fail({**self._lifetime_error(), "stderr_tail": stderr_tail},
                                    retryable=False)
        code = child.returncode
        if code is not None and code < 0:
            error = {"kind": "signal", "signal": -code, "stderr_tail": stderr_tail,
                     "message": f"the tool was killed by signal {-code}"}
            return await self._fail(error, retryable=True)
        if code != 0:
            retryable = code not in profile.non_retryable_exit_codes
            error = {"kind": "exit_code", "exit_code": code, "stderr_tail": stderr_tail,
                     "message": f"the tool exited with code {code}"
                                + ("" if retryable else " (non-retryable for this profile)")}
            return await self._fail(error, retryable=retryable)
        if child.stdout_overflow:
            error = {"kind": "result_too_large", "stderr_tail": stderr_tail,
                     "message": f"stdout exceeded {profile.max_result_bytes} bytes "
                                f"({child.stdout_bytes} bytes written); return less, or raise "
                                f"SIDECAR_PROFILE_<TOOL>_MAX_RESULT_BYTES"}
            return await self._fail(error, retryable=False)
        return await self._succeed(bytes(child.stdout), stderr_tail)

    def _lifetime_error(self) -> dict[str, Any]:
        return {"kind": "max_lifetime_exceeded",
                "message": f"the job outlived its cap of "
                           f"{self.ctx.profile.max_lifetime_seconds:g} s from its first claim "
                           "(P12); split it into stages"}

    def _next_stage(self, value: Any) -> tuple[Any, NextStage | None, dict[str, Any] | None]:
        """Split ``{"result": R, "next": {"tool": T, "payload": P}}`` (P19); anything else
        is a plain result. Returns (result, next stage or None, error or None)."""
        if not (isinstance(value, dict) and value.keys() == {"result", "next"}):
            return value, None, None
        nxt = value["next"]
        if not (isinstance(nxt, dict) and isinstance(nxt.get("tool"), str)
                and set(nxt) <= {"tool", "payload"}):
            return None, None, {"kind": "bad_result", "message":
                                'a next stage must be {"tool": NAME, "payload": JSON}'}
        if nxt["tool"] not in self.ctx.profile.next_tools:
            allowed = ", ".join(sorted(self.ctx.profile.next_tools)) or "none"
            return None, None, {"kind": "stage_not_allowed", "message":
                                f"next stage tool {nxt['tool']!r} is not allowed for "
                                f"{self.job.tool!r} (SIDECAR_PROFILE_<TOOL>_NEXT_TOOLS: "
                                f"{allowed})"}
        next_profile = self.ctx.settings.profile(nxt["tool"])
        return value["result"], NextStage(nxt["tool"], nxt.get("payload", {}),
                                          next_profile.max_attempts), None

    async def _succeed(self, stdout: bytes, stderr_tail: str | None) -> str:
        try:
            value = orjson.loads(stdout)
            result = RawJson(stdout.decode("utf-8"))
        except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
            error = {"kind": "bad_result", "stderr_tail": stderr_tail,
                     "message": f"exit 0 but stdout is not one JSON value ({exc}); "
                                f"{len(stdout)} bytes"}
            return await self._fail(error, retryable=False)
        value, next_stage, stage_error = self._next_stage(value)
        if stage_error is not None:
            return await self._fail({**stage_error, "stderr_tail": stderr_tail}, retryable=False)
        if next_stage is not None:
            result = RawJson(orjson.dumps(value).decode())
        details = {"result": payload_digest(stdout),
                   "duration_s": round(time.monotonic() - self.started, 3)}
        try:
            accepted = await self._fenced(lambda: self.ctx.store.finish_if_owner(
                self.job, self.ctx.owner_id, "succeeded", result, None, "job_succeeded", details,
                self.ctx.profile.result_url or None, next_stage))
        except OwnershipUnknown:
            return await self._abandon(stdout)
        except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as exc:  # jsonb refused it
            error = {"kind": "bad_result", "stderr_tail": stderr_tail,
                     "message": f"PostgreSQL refused the result as jsonb: {exc}"}
            return await self._fail(error, retryable=False)
        if not accepted:
            await self._reject(stdout, "not the owner at commit")
            return "rejected"
        log.emit("job_succeeded", **self._fields(), duration_s=details["duration_s"],
                 next_tool=next_stage.tool if next_stage else None)
        if self.ctx.profile.result_url:
            self.ctx.result_queued()
        return "succeeded"

    async def _fail(self, error: dict[str, Any], retryable: bool) -> str:
        job, profile = self.job, self.ctx.profile
        error = {k: v for k, v in error.items() if v is not None}
        duration = round(time.monotonic() - self.started, 3)
        # Every attempt's summary goes to the journal (P16), the last error to the row.
        summary = {"attempt": job.attempt, "kind": error["kind"], "duration_s": duration,
                   **{k: error[k] for k in ("exit_code", "signal") if k in error}}
        if retryable and job.attempt < job.max_attempts:
            delay = backoff_seconds(profile, job.attempt)
            try:
                run_after = await self._fenced(lambda: self.ctx.store.requeue_if_owner(
                    job, self.ctx.owner_id, error, delay,
                    {**summary, "backoff_s": round(delay, 3)}))
            except OwnershipUnknown:
                return await self._abandon(None)
            if run_after is None:
                await self._reject(None, "not the owner at requeue")
                return "rejected"
            log.emit("job_retry_scheduled", "warning", **self._fields(), reason=error["kind"],
                     duration_s=duration, run_after=run_after)
            return "requeued"
        if retryable:
            error["message"] += f"; attempt {job.attempt} of {job.max_attempts}, none left"
        try:
            accepted = await self._fenced(lambda: self.ctx.store.finish_if_owner(
                job, self.ctx.owner_id, "failed", None, error, "job_failed",
                summary))
        except OwnershipUnknown:
            return await self._abandon(None)
        if not accepted:
            await self._reject(None, "not the owner at commit")
            return "rejected"
        log.emit("job_failed", "warning", **self._fields(), reason=error["kind"],
                 duration_s=duration, exit_code=error.get("exit_code"))
        return "failed"

    async def _abandon(self, output: bytes | None) -> str:
        """The outcome could not be written before the local deadline: give the job up."""
        self.lease.lose(lease_mod.LOCAL_DEADLINE)
        log.emit("lease_abandoned", "error", **self._fields(),
                 reason="outcome not written before the local deadline; ownership unknown")
        await self._reject(output, "ownership unknown at commit")
        return "abandoned"

    async def _release(self) -> bool:
        try:
            released = await self._fenced(lambda: self.ctx.store.release_if_owner(
                self.job, self.ctx.owner_id,
                {"reason": "shutdown", "owner_id": self.ctx.owner_id}))
        except OwnershipUnknown:
            await self._abandon(None)
            return False
        log.emit("lease_released" if released else "lease_lost",
                 "info" if released else "warning", **self._fields(), reason="shutdown")
        return released

    async def _reject(self, output: bytes | None, why: str) -> None:
        """P6: an outcome we may not commit goes to the journal as hash and size only.
        When ownership is unknown the database may be unreachable: the lease keeper
        journals it once the database answers again."""
        details: dict[str, Any] = {"why": why, "owner_id": self.ctx.owner_id}
        if output is not None:
            details["result"] = payload_digest(output)
        log.emit("result_rejected", "warning", **self._fields(), reason=why)
        metrics.COMPLETIONS_REJECTED.labels(self.job.tool, self.ctx.profile.provider).inc()
        if self.lease.abandoned:
            self.lease.evidence = details
        else:
            await self._journal("result_rejected", details)

    async def _fenced(self, write: Callable[[], Awaitable[T]]) -> T:
        """Run a fenced write; when the database does not answer, retry while the local
        deadline allows (a fenced write is safe to repeat). Past it, ownership is unknown:
        raise OwnershipUnknown and let the lease keeper settle it later."""
        while True:
            try:
                return await write()
            except (OSError, TimeoutError, asyncpg.InterfaceError,
                    asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError) as exc:
                if time.monotonic() >= self.lease.local_deadline:
                    raise OwnershipUnknown() from exc
                log.emit("commit_retry", "warning", **self._fields(),
                         reason=f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(min(0.5, self.ctx.profile.heartbeat_seconds / 2))

    async def _journal(self, event: str, details: dict[str, Any]) -> None:
        try:
            await self.ctx.store.record_event(self.job.id, self.job.fencing_token, event, details)
        except Exception:  # noqa: BLE001 - the journal must not take the supervisor down
            log.emit("journal_error", "warning", **self._fields(), reason=event)


async def watch_idle(child: Child, idle_seconds: float) -> None:
    """Return once the child's tree has shown no CPU time, no I/O and no output for
    ``idle_seconds``: hung, although the sidecar itself is healthy and heartbeating."""
    loop = asyncio.get_running_loop()
    period = min(1.0, idle_seconds / 4)
    last_sample, last_progress = None, time.monotonic()
    while True:
        await asyncio.sleep(period)
        sample = (await loop.run_in_executor(None, tree_activity, child.pid),
                  child.stdout_bytes, child.stderr_bytes)
        now = time.monotonic()
        if sample != last_sample:
            last_sample, last_progress = sample, now
        elif now - last_progress >= idle_seconds:
            return


def tree_activity(pid: int) -> tuple[float, int]:
    """CPU seconds and I/O bytes (read + written) of a process and its descendants."""
    cpu, io = 0.0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return cpu, io
    for proc in procs:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                cpu += times.user + times.system
                counters = proc.io_counters()
                io += counters.read_chars + counters.write_chars
        except (psutil.Error, AttributeError):
            continue
    return round(cpu, 2), io


class OwnershipUnknown(Exception):
    """A fenced write got no answer before the lease's local deadline (P14b)."""


