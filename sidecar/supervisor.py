"""One job, start to end: spawn -> race(exit | lease lost | cancel | stage deadline |
lifetime cap | idle tree | shutdown) -> kill the tree -> fenced commit.

The race lives in ``JobSupervisor.run``; its outcome is one ``stop_reason`` that decides
the final state, the journal event and the log line (P8, P13).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import psutil

from sidecar import db, jsontext, metrics
from sidecar import lease as lease_mod
from sidecar.cgroups import CgroupHost, Usage
from sidecar.child import Child, SpawnFailed
from sidecar.config import LeaseProfile, Settings, tool_env_key
from sidecar.db import RawJson
from sidecar.isolation import TMPDIR_VARIABLES, Sandbox, child_environment, read_result_file
from sidecar.lease import Lease, LeaseKeeper
from sidecar.leftovers import job_name, work_dir_prefix
from sidecar.log import log, payload_digest
from sidecar.results import BadResult, parse_result, scrub_text
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
CPU_LIMIT = "cpu_limit"

# What a process refused memory under RLIMIT_AS typically writes last (lower case): the
# Python and C++ runtimes, libc's strerror(ENOMEM), and the dynamic loader.
_OUT_OF_MEMORY_MARKERS = ("memoryerror", "cannot allocate memory", "out of memory",
                          "bad_alloc", "failed to allocate", "failed to map segment")

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
    cgroup_host: CgroupHost = CgroupHost()


def job_variables(job: ClaimedJob, profile: LeaseProfile, owner_id: str,
                  sandbox: Sandbox) -> dict[str, str]:
    """The variables a child gets for one attempt (README, "The child process"): the
    ``SIDECAR_*`` ones, its temporary directory (its work directory) and, by the profile's
    ``HOME``, its own HOME and XDG base directories."""
    variables = dict(
        SIDECAR_JOB_ID=str(job.id),
        SIDECAR_TOOL=job.tool,
        SIDECAR_ATTEMPT=str(job.attempt),
        SIDECAR_FENCING_TOKEN=str(job.fencing_token),
        SIDECAR_IDEMPOTENCY_KEY=f"tool-job:{job.id}",
        SIDECAR_STAGE_TIMEOUT_SECONDS=f"{profile.stage_timeout_seconds:g}",
        SIDECAR_OWNER_ID=owner_id,
        SIDECAR_JOB_DIR=sandbox.job_dir,
        SIDECAR_RESULT_FILE=sandbox.result_file,
    )
    variables.update(dict.fromkeys(TMPDIR_VARIABLES, sandbox.job_dir))
    variables.update(sandbox.home_variables())
    return variables


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
        # The attempt's peak memory and CPU time, journaled with its outcome.
        self.resources: dict[str, Any] = {}

    def _var(self, field: str) -> str:
        """The variable that sets ``field`` for this job's tool, for messages."""
        return f"SIDECAR_PROFILE_{tool_env_key(self.job.tool)}_{field}"

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
        sandbox = Sandbox(self.ctx.settings, profile, self.ctx.cgroup_host,
                          job_name(self.ctx.owner_id, job.id, job.fencing_token),
                          work_dir_prefix(self.ctx.owner_id))
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, sandbox.open)
        except Exception as exc:  # noqa: BLE001 - any failure here fails the attempt, cleanly
            await loop.run_in_executor(None, sandbox.close)
            log.emit("sandbox_failed", "error", **self._fields(), reason=str(exc))
            self.lease.settle()
            return await self._fail({"kind": "sandbox_failed", "message":
                                     f"cannot set up the attempt's work directory or cgroup: "
                                     f"{exc}; check SIDECAR_WORK_DIR and the cgroup "
                                     "filesystem"}, retryable=True)
        for note in sandbox.notes:
            log.emit("cgroup_unavailable", "warning", **self._fields(),
                     reason=note + "; this attempt runs under rlimits only")
        env = child_environment(self.ctx.base_env, profile,
                                job_variables(job, profile, self.ctx.owner_id, sandbox))
        try:
            if job.checkpoint_text is not None:
                env["SIDECAR_CHECKPOINT_FILE"] = sandbox.write_file(CHECKPOINT_FILE_NAME,
                                                                    job.checkpoint_text)
            if self.ctx.guard is not None:
                env["SIDECAR_GUARD_URL"] = self.ctx.guard_url
                env["SIDECAR_GUARD_TOKEN"] = self.ctx.guard.register(self.lease)
            return await self._supervise(env, payload, sandbox)
        finally:
            if self.ctx.guard is not None:
                self.ctx.guard.unregister(job.id)
            left = await loop.run_in_executor(None, sandbox.close)
            if left:
                log.emit("sandbox_left", "warning", **self._fields(), paths=left)

    async def _supervise(self, env: dict[str, str], payload: bytes, sandbox: Sandbox) -> str:
        profile = self.ctx.profile
        cookie = {k: env[k] for k in ("SIDECAR_JOB_ID", "SIDECAR_FENCING_TOKEN")}
        relay = _StderrRelay(self.job, self.ctx.settings.log_tool_stderr)
        try:
            child = await Child.spawn(self.ctx.argv, env, payload, profile.max_result_bytes,
                                      relay, cookie, cwd=sandbox.job_dir,
                                      make_preexec=sandbox.preexec, cgroup=sandbox.cgroup)
            child.run_as_uid = sandbox.ids[0] if sandbox.ids else None
        except SpawnFailed as exc:
            log.emit("spawn_failed", "error", **self._fields(), reason=exc.message)
            error = {"kind": "spawn_failed", "message": exc.message, "exit_code": exc.exit_code}
            self.lease.settle()
            return await self._fail(error, retryable=False)

        await self._journal("tool_request_started", {"pid": child.pid, "argv0": self.ctx.argv[0],
                                                     "payload": payload_digest(payload)})
        log.emit("tool_request_started", **self._fields(), pid=child.pid)

        reason = await self._race(child, sandbox)
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
        usage = await asyncio.get_running_loop().run_in_executor(None, measure, child, sandbox)
        self.resources = {k: v for k, v in (
            ("peak_memory_bytes", usage.peak_memory_bytes),
            ("cpu_seconds", None if usage.cpu_seconds is None else round(usage.cpu_seconds, 3)),
            ("oom_kills", usage.oom_kills or None),
            ("process_limit_hits", usage.process_limit_hits or None)) if v is not None}
        return await self._settle(reason, child, sandbox, usage)

    async def _race(self, child: Child, sandbox: Sandbox) -> str:
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
        if profile.cpu_seconds > 0:
            waiters[asyncio.ensure_future(
                watch_cpu(child, sandbox, profile.cpu_seconds))] = CPU_LIMIT
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
        for reason in (SHUTDOWN, EXITED, TOO_LARGE, IDLE, CPU_LIMIT):
            if reason in reasons:
                return reason
        return EXITED

    async def _settle(self, reason: str, child: Child, sandbox: Sandbox, usage: Usage) -> str:
        profile = self.ctx.profile
        duration = round(time.monotonic() - self.started, 3)
        self.lease.settle()
        if self.lease.lost.is_set():
            # P13: the lease is gone, whatever the tool answered. Keep evidence only.
            if (child.returncode == 0 or child.status_lost) and not child.stdout_overflow:
                await self._reject(self._output_digest(child, sandbox),
                                   "lease lost before commit")
            log.emit("lease_lost", "warning", **self._fields(), reason=self.lease.reason,
                     duration_s=duration)
            return self.lease.reason or lease_mod.LEASE_LOST
        if reason == SHUTDOWN:
            released = await self._release()
            return "released" if released else "lease_lost"
        stderr_tail = scrub_text(child.stderr_tail.decode("utf-8", "replace")) or None
        # A limit's evidence (an OOM kill in the attempt's cgroup, say) names the failure
        # whatever ended the attempt: a wrapper whose helper was OOM-killed and that then
        # hung is a memory_limit, not a stage_timeout to retry (case F13).
        limit_error = self._limit_error(reason, child, usage, sandbox, stderr_tail)
        if limit_error is not None:
            return await self._fail(limit_error, retryable=False)
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
                                f"{self._var('MAX_RESULT_BYTES')}"}
            return await self._fail(error, retryable=False)
        if reason == LIFETIME:
            return await self._fail({**self._lifetime_error(), "stderr_tail": stderr_tail},
                                    retryable=False)
        if child.status_lost:
            # Case F9: with no exit status there is no telling a success from a failure
            # that printed partial output; the attempt fails and may be retried.
            error = {"kind": "exit_status_lost", "stderr_tail": stderr_tail,
                     "message": "the tool's exit status could not be collected (ECHILD: it "
                                "was reaped by someone else, e.g. a launcher that left "
                                "SIGCHLD ignored); its output is not trusted"}
            return await self._fail(error, retryable=True)
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
                                f"{self._var('MAX_RESULT_BYTES')}"}
            return await self._fail(error, retryable=False)
        try:
            # The result file, when there is one, is the result; stdout is ignored.
            # Up to MAX_RESULT_BYTES from disk: off the event loop, which heartbeats.
            output = await asyncio.get_running_loop().run_in_executor(
                None, read_result_file, sandbox.result_file, profile.max_result_bytes,
                sandbox.ids[0] if sandbox.ids else None, self._var("MAX_RESULT_BYTES"))
            source = "SIDECAR_RESULT_FILE"
        except FileNotFoundError:
            output, child.stdout = child.stdout, bytearray()  # handed over, not copied
            source = "stdout"
        except BadResult as exc:
            return await self._fail({"kind": exc.kind, "message": exc.message,
                                     "stderr_tail": stderr_tail}, retryable=False)
        holder = [output]
        del output  # _succeed drops the buffer once parsed; no reference may outlive that
        return await self._succeed(holder, stderr_tail, source)

    def _output_digest(self, child: Child, sandbox: Sandbox) -> dict[str, Any] | None:
        """payload_digest of what the tool returned (its result file, else its stdout),
        for the journal of a result that may not be committed (P6)."""
        try:
            return payload_digest(read_result_file(
                sandbox.result_file, self.ctx.profile.max_result_bytes,
                sandbox.ids[0] if sandbox.ids else None))
        except FileNotFoundError:
            return payload_digest(child.stdout)
        except BadResult:
            return None

    def _limit_error(self, reason: str, child: Child, usage: Usage, sandbox: Sandbox,
                     stderr_tail: str | None) -> dict[str, Any] | None:
        """The failure of a tool stopped by one of its profile's limits, or None.
        ``cpu_limit``: the tree's CPU time reached CPU_SECONDS (our watcher, or RLIMIT_CPU's
        SIGXCPU/SIGKILL); ``memory_limit``: the cgroup's OOM killer fired in the attempt
        (whatever ended it, exit 0 included: a process of the tree was killed), or without
        a memory cgroup the attempt did not succeed and its stderr says it ran out of
        memory under RLIMIT_AS (a helper's MemoryError counts, case F13);
        ``process_limit``: a fork was refused at PROCESSES and the tool failed."""
        profile, code = self.ctx.profile, child.returncode
        cpu = usage.cpu_seconds or 0.0
        if profile.cpu_seconds and (
                reason == CPU_LIMIT or code == -signal.SIGXCPU
                or (code == -signal.SIGKILL and cpu >= profile.cpu_seconds)):
            return {"kind": "cpu_limit", "stderr_tail": stderr_tail, "cpu_seconds": round(cpu, 3),
                    "message": f"the tool's tree reached its CPU time limit of "
                               f"{profile.cpu_seconds:g} s (measured {cpu:.2f} s); the tree "
                               "was killed. Raise "
                               f"{self._var('CPU_SECONDS')} or give it less work"}
        exited = reason == EXITED
        succeeded = exited and code == 0
        memory_cgroup = sandbox.cgroup is not None and sandbox.cgroup.host.memory is not None
        tail = (stderr_tail or "").lower()
        under_rlimit_as = bool(profile.memory_bytes) and not memory_cgroup
        if profile.memory_bytes and usage.oom_kills:
            how = "killed by the cgroup's OOM killer"
        elif under_rlimit_as and not succeeded and any(
                marker in tail for marker in _OUT_OF_MEMORY_MARKERS):
            how = "RLIMIT_AS: an allocation was refused"
        elif under_rlimit_as and exited and code == -signal.SIGSEGV:
            how = "RLIMIT_AS: killed by SIGSEGV, most likely a refused stack or heap growth"
        else:
            how = ""
        if how:
            return {"kind": "memory_limit", "stderr_tail": stderr_tail,
                    "peak_memory_bytes": usage.peak_memory_bytes,
                    "message": f"the tool ran out of its memory limit of "
                               f"{profile.memory_bytes} bytes ({how}); raise "
                               f"{self._var('MEMORY_BYTES')}"}
        if profile.processes and usage.process_limit_hits and exited and not succeeded:
            return {"kind": "process_limit", "stderr_tail": stderr_tail,
                    "message": f"the tool failed after the kernel refused "
                               f"{usage.process_limit_hits} new process(es) or thread(s) at "
                               f"its limit of {profile.processes} (threads count: pids.max "
                               f"limits tasks); raise {self._var('PROCESSES')}"}
        return None

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
                                f"{self.job.tool!r} ({self._var('NEXT_TOOLS')}: "
                                f"{allowed})"}
        limit = self.ctx.settings.max_payload_bytes
        if limit and len(jsontext.dumps(nxt.get("payload", {}))) > limit:
            return None, None, {"kind": "bad_result", "message":
                                f"the next stage's payload is larger than "
                                f"SIDECAR_MAX_PAYLOAD_BYTES={limit}"}
        next_profile = self.ctx.settings.profile(nxt["tool"])
        return value["result"], NextStage(nxt["tool"], nxt.get("payload", {}),
                                          next_profile.max_attempts), None

    async def _succeed(self, holder: list[bytes | bytearray], stderr_tail: str | None,
                       source: str = "stdout") -> str:
        """Commit the tool's JSON text (its stdout, or its result file) if the lease is still
        ours; a bad result fails the job. ``holder`` is a one-item list this method empties:
        once parsed, the bytes are dropped and only the text sent to PostgreSQL is held."""
        output = holder.pop()
        digest = payload_digest(output)
        try:
            value, result = parse_result(output, source)
        except BadResult as exc:
            error = {"kind": "bad_result", "stderr_tail": stderr_tail, "message": exc.message}
            return await self._fail(error, retryable=False)
        finally:
            del output
        value, next_stage, stage_error = self._next_stage(value)
        if stage_error is not None:
            return await self._fail({**stage_error, "stderr_tail": stderr_tail}, retryable=False)
        if next_stage is not None:
            result = RawJson(jsontext.dumps(value).decode())  # every digit kept (F11)
        del value  # a large result is held once, as the text sent to PostgreSQL
        details = {"result": digest,
                   "duration_s": round(time.monotonic() - self.started, 3), **self.resources}
        try:
            accepted = await self._fenced(lambda: self.ctx.store.finish_if_owner(
                self.job, self.ctx.owner_id, "succeeded", result, None, "job_succeeded", details,
                self.ctx.profile.result_url or None, next_stage))
        except OwnershipUnknown:
            return await self._abandon(digest)
        except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as exc:  # jsonb refused it
            error = {"kind": "bad_result", "stderr_tail": stderr_tail,
                     "message": f"PostgreSQL refused the result as jsonb: {exc}"}
            return await self._fail(error, retryable=False)
        if not accepted:
            await self._reject(digest, "not the owner at commit")
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
                   **{k: error[k] for k in ("exit_code", "signal") if k in error},
                   **self.resources}
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

    async def _abandon(self, digest: dict[str, Any] | None) -> str:
        """The outcome could not be written before the local deadline: give the job up."""
        self.lease.lose(lease_mod.LOCAL_DEADLINE)
        log.emit("lease_abandoned", "error", **self._fields(),
                 reason="outcome not written before the local deadline; ownership unknown")
        await self._reject(digest, "ownership unknown at commit")
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

    async def _reject(self, digest: dict[str, Any] | None, why: str) -> None:
        """P6: an outcome we may not commit goes to the journal as hash and size only
        (``digest``: payload_digest of the output, None when there was none).
        When ownership is unknown the database may be unreachable: the lease keeper
        journals it once the database answers again."""
        details: dict[str, Any] = {"why": why, "owner_id": self.ctx.owner_id}
        if digest is not None:
            details["result"] = digest
        log.emit("result_rejected", "warning", **self._fields(), reason=why)
        metrics.COMPLETIONS_REJECTED.labels(self.job.tool, self.ctx.profile.provider).inc()
        if self.lease.abandoned:
            self.lease.evidence = details
        else:
            await self._journal("result_rejected", details)

    async def _fenced(self, write: Callable[[], Awaitable[T]]) -> T:
        """Run a fenced write; when the database does not answer or cannot take it now
        (``db.UNAVAILABLE_ERRORS``: a failover's read-only primary too, case F12), retry
        on a new connection while the local deadline allows (a fenced write is safe to
        repeat). Past it, ownership is unknown:
        raise OwnershipUnknown and let the lease keeper settle it later."""
        while True:
            try:
                return await write()
            except db.UNAVAILABLE_ERRORS as exc:
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


async def watch_cpu(child: Child, sandbox: Sandbox, limit_seconds: float) -> None:
    """Return once the tool's whole tree has used ``limit_seconds`` of CPU time: from the
    job cgroup where there is one (exited processes count too), else from the live tree.
    RLIMIT_CPU bounds each process on its own; this bounds their sum."""
    loop = asyncio.get_running_loop()
    period = min(1.0, max(0.05, limit_seconds / 10))
    while True:
        await asyncio.sleep(period)
        used = sandbox.cgroup.cpu_seconds() if sandbox.cgroup is not None else None
        if used is None:
            used = (await loop.run_in_executor(None, tree_activity, child.pid))[0]
        if used >= limit_seconds:
            return


def measure(child: Child, sandbox: Sandbox) -> Usage:
    """The attempt's resource use once its tree is dead: the cgroup's figures where there
    is one, else (and for what it lacks) the child's own rusage from wait4, which counts
    the descendants it reaped itself."""
    usage = sandbox.cgroup.usage() if sandbox.cgroup is not None else Usage()
    if child.rusage is not None:
        if usage.cpu_seconds is None:
            usage.cpu_seconds = child.rusage.ru_utime + child.rusage.ru_stime
        if usage.peak_memory_bytes is None:
            usage.peak_memory_bytes = child.rusage.ru_maxrss * 1024  # KiB on Linux
    return usage


def tree_activity(pid: int) -> tuple[float, int]:
    """CPU seconds and I/O bytes (read + written) of a process and its descendants, the
    CPU time of descendants they already reaped included."""
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
                # children_*: descendants this process already reaped (sequential workers)
                cpu += times.user + times.system + times.children_user + times.children_system
                counters = proc.io_counters()
                io += counters.read_chars + counters.write_chars
        except (psutil.Error, AttributeError):
            continue
    return round(cpu, 2), io


class OwnershipUnknown(Exception):
    """A fenced write got no answer before the lease's local deadline (P14b)."""


