"""One job, start to end: spawn -> race(exit | lease lost | cancel | stage deadline |
lifetime cap | idle tree | shutdown) -> kill the tree -> fenced commit.

The race lives in ``JobSupervisor._race``; its outcome is one ``stop_reason`` that decides
the verdict (P8, P13). Every path of an attempt, those that end it before its tool ran
included, yields one ending (sidecar.protocol.verdict.Ending), and ``JobSupervisor.run`` hands it to
the one call that ends the attempt, ``FencedCommit.end``: the fenced write, its journal
row, log line and metrics are all there (tests/test_supervisor_ending.py holds it so).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import asyncpg
import psutil

from sidecar.ops import metrics
from sidecar.ops.tracing import NO_TRACE, AttemptTrace
from sidecar.protocol import clock, jsontext
from sidecar.protocol.errors import one_line
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import ClaimedJob, LeaseProfile, NextStage, RawJson, Usage
from sidecar.protocol.results import (
    BadResult,
    SecretInOutput,
    check_no_secret,
    parse_result,
    split_next_stage,
    stderr_tail_text,
)
from sidecar.protocol.shortage import shortage_errno
from sidecar.protocol.verdict import (
    APPROVAL_BODY_LIMIT,
    Commit,
    Ending,
    Failure,
    Observed,
    Park,
    Reject,
    Release,
    Snooze,
    Succeeded,
    decide,
    failure,
    lifetime_failure,
    limit_failure,
    parse_approval,
    profile_var,
)
from sidecar.protocol.vocabulary import LEASE_ENDINGS, FailureKind, KillSignal, Outcome, StopReason
from sidecar.protocol.warm import Answer, BadAnswer, read_answer, request_line, usage_since
from sidecar.runtime.config import Settings
from sidecar.runtime.log import log, log_fields, payload_digest
from sidecar.storage import db
from sidecar.worker import safefs
from sidecar.worker.child import (
    STDERR_LINE_BYTES,
    STDERR_TAIL_BYTES,
    Child,
    LineBroken,
    SpawnFailed,
    SpawnSetupFailed,
    SpawnShortage,
    tree_processes,
)
from sidecar.worker.commit import FencedCommit
from sidecar.worker.context import WorkerContext
from sidecar.worker.isolation import TMPDIR_VARIABLES, Sandbox, child_environment, mount_identities
from sidecar.worker.lease import Lease
from sidecar.worker.leftovers import job_name, work_dir_prefix
from sidecar.worker.prepared import (
    NotPreparable,
    PreparedAttempt,
    exec_files,
    launcher_argv,
    shell_altered,
    unset_pwd_for,
    wait_ready,
)
from sidecar.worker.progress import PROGRESS_FILE_NAME, ProgressReporter
from sidecar.worker.warm import PROCESS_ID_VARIABLE, Session, WarmProcess

# The file a tool without HTTP asks a person's yes through (issue 44): the body of a
# POST /v1/approval, read once the tool has exited.
APPROVAL_FILE_NAME = "approval-request.json"


if TYPE_CHECKING:
    pass

CHECKPOINT_FILE_NAME = "checkpoint.json"

_STDERR_LINES_PER_SECOND = 200
# Results up to this many bytes are parsed on the event loop (well under a millisecond).
PARSE_ON_LOOP_BYTES = 64 * 1024


def attempt_variables(profile: LeaseProfile, owner_id: str, sandbox: Sandbox
                      ) -> dict[str, str]:
    """The variables of an attempt that its job does not change (docs/child-process.md):
    the tool, its stage timeout, the owner, its work directory and the files in it, its
    temporary directory and, by the profile's ``HOME``, its own HOME and XDG base
    directories. A prepared launcher starts with these (sidecar.worker.prepared)."""
    variables = dict(
        SIDECAR_TOOL=profile.tool,
        SIDECAR_STAGE_TIMEOUT_SECONDS=f"{profile.stage_timeout_seconds:g}",
        SIDECAR_OWNER_ID=owner_id,
        SIDECAR_JOB_DIR=sandbox.job_dir,
        SIDECAR_RESULT_FILE=sandbox.result_file,
        SIDECAR_PROGRESS_FILE=os.path.join(sandbox.job_dir, PROGRESS_FILE_NAME),
        SIDECAR_APPROVAL_REQUEST_FILE=os.path.join(sandbox.job_dir, APPROVAL_FILE_NAME),
    )
    variables.update(dict.fromkeys(TMPDIR_VARIABLES, sandbox.job_dir))
    variables.update(sandbox.home_variables())
    return variables


def job_variables(job: ClaimedJob, profile: LeaseProfile, owner_id: str,
                  sandbox: Sandbox) -> dict[str, str]:
    """The variables a child gets for one attempt (docs/child-process.md): the
    ``SIDECAR_*`` ones of its job and ``attempt_variables``."""
    variables = dict(
        SIDECAR_JOB_ID=str(job.id),
        SIDECAR_TOOL=job.tool,
        SIDECAR_ATTEMPT=str(job.attempt),
        SIDECAR_FENCING_TOKEN=str(job.fencing_token),
        SIDECAR_IDEMPOTENCY_KEY=f"tool-job:{job.id}",
    )
    if job.approval_text is not None:  # the answer to the request that parked it (issue 44)
        variables["SIDECAR_APPROVAL"] = job.approval_text
    # The caller's trace context, by OpenTelemetry's environment-carrier convention.
    if job.trace_context_ignored:
        log.emit("trace_context_ignored", "warning", job_id=str(job.id),
                 ignored=list(job.trace_context_ignored))
    if job.traceparent:
        variables["TRACEPARENT"] = job.traceparent
        if job.tracestate:
            variables["TRACESTATE"] = job.tracestate
    attempt = attempt_variables(profile, owner_id, sandbox)
    attempt["SIDECAR_TOOL"] = job.tool
    return {**attempt, **variables}


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
        self.cut = False  # the last line was cut at STDERR_LINE_BYTES: the next one starts cut

    def summary(self) -> None:
        """The end-of-attempt event: how much the tool wrote to stderr."""
        self.flush()
        if self.lines:
            log.emit("tool_stderr", **log_fields(self.job), lines=self.lines,
                     bytes=self.bytes)

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
        # A line longer than STDERR_LINE_BYTES comes in pieces: a secret cut there is
        # masked in both (the log scrubs whole secrets in every event anyway).
        cut_start, self.cut = self.cut, len(line) >= STDERR_LINE_BYTES
        log.emit("tool_stderr", **log_fields(self.job),
                 line=SECRETS.scrub(line.decode("utf-8", "replace").rstrip("\r"),
                                    cut_start=cut_start, cut_end=self.cut))

    def flush(self) -> None:
        if self.dropped:
            log.emit("tool_stderr_dropped", "warning", **log_fields(self.job),
                     lines=self.dropped)
            self.dropped = 0


async def prepare_attempt(ctx: WorkerContext, serial: int) -> PreparedAttempt:
    """One attempt of ``ctx``'s tool set up ahead of its job (sidecar.worker.prepared): a
    work directory (a kept one when there is one) and a job cgroup named
    ``<owner key>.job-p<serial>-0``, and a launcher started in them (and in the sandbox)
    with the attempt's static environment, waiting for its job's line. Raises what
    opening the Sandbox or starting the launcher raises, and OSError for a program the
    launcher's shell would exec otherwise than execve (prepared.exec_files),
    NotPreparable for an environment it would change (prepared.shell_altered); nothing
    is left behind then."""
    profile = ctx.profile
    # Only for a program execve would start (else the shell's exec differs): raises.
    files = exec_files(ctx.argv[0])
    # Before bwrap mounts them: a change after this is seen at start (mounts_moved).
    mounts = mount_identities(ctx.sandbox.mounted_paths()) if ctx.sandbox else ()
    altered = shell_altered(child_environment(ctx.base_env, profile, {}),
                            ctx.sandbox is not None)
    if altered:
        raise NotPreparable(f"ENV_PASSTHROUGH passes {', '.join(altered)}, which a "
                            "launcher's /bin/sh sets itself: every attempt starts cold")
    sandbox = Sandbox(ctx.settings, profile, ctx.cgroup_host,
                      job_name(ctx.owner_id, f"p{serial}", 0),
                      work_dir_prefix(ctx.owner_id), spares=ctx.spares)
    loop = asyncio.get_running_loop()
    try:
        if not sandbox.open_kept():
            await loop.run_in_executor(None, sandbox.open)
        env = child_environment(ctx.base_env, profile,
                                attempt_variables(profile, ctx.owner_id, sandbox))
        if ctx.guard is not None and (ctx.sandbox is None or ctx.sandbox.network != "none"):
            env["SIDECAR_GUARD_URL"] = ctx.guard_url
        preexec = sandbox.preexec if sandbox.needs_preexec else None
        # The launcher joins its cgroup itself, unless a preexec_fn does (limits).
        procs = sandbox.cgroup.procs_files if sandbox.cgroup is not None and preexec is None \
            else []
        plan = ctx.sandbox
        if plan is None:
            argv, wrap = launcher_argv(ctx.argv, procs, None, unset_pwd_for(env, False)), None
        else:
            argv = ctx.argv

            def wrap(tool_argv: list[str], status_fd: int) -> list[str]:
                return launcher_argv(
                    tool_argv, procs,
                    lambda inner: plan.argv(inner, sandbox.job_dir, status_fd), False)
        launched = await Child.launch(argv, env, cwd=sandbox.job_dir, make_preexec=preexec,
                                      cgroup=sandbox.cgroup,
                                      new_privileges=profile.allow_new_privs,
                                      processes=ctx.processes, wrap=wrap,
                                      joins_itself=bool(procs))
        try:
            await wait_ready(launched)
        except BaseException:
            await loop.run_in_executor(None, launched.discard)
            raise
    except BaseException:
        await loop.run_in_executor(None, sandbox.close)
        raise
    return PreparedAttempt(sandbox, launched, env, ctx.argv[0], files, mounts)


def discard_prepared(prepared: PreparedAttempt) -> None:
    """Kill a prepared launcher never used and remove its work directory and cgroup
    (blocking: off the event loop)."""
    prepared.launched.discard()
    prepared.sandbox.close()


async def start_warm_process(ctx: WorkerContext, serial: int, process_id: str
                             ) -> WarmProcess:
    """A warm tool process of ``ctx``'s tool (sidecar.worker.warm): a work directory and
    job cgroup (``<owner key>.job-w<serial>-0``) of its own, its command started there (in
    the sandbox, with the profile's limits) with the attempt's static variables and
    SIDECAR_PROCESS_ID, its stdin open for request lines. Logs
    ``warm_process_started``. Raises what opening a Sandbox raises (OSError,
    CgroupError) and SpawnFailed, SpawnSetupFailed, SpawnShortage; nothing is left
    behind then."""
    profile = ctx.profile
    # CPU_SECONDS bounds each job (watch_cpu, from the job's start), never the process's
    # whole life, which an RLIMIT_CPU would (every job it served counting).
    sandbox = Sandbox(ctx.settings, dataclasses.replace(profile, cpu_seconds=0.0),
                      ctx.cgroup_host, job_name(ctx.owner_id, f"w{serial}", 0),
                      work_dir_prefix(ctx.owner_id), spares=None)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sandbox.open)
    process = WarmProcess(serial, sandbox, process_id,
                          mounts=mount_identities(ctx.sandbox.mounted_paths())
                          if ctx.sandbox is not None else ())
    try:
        variables = attempt_variables(profile, ctx.owner_id, sandbox)
        # A warm job's result is its response line and its progress goes to the guard:
        # no per-job file a warm process could mistake for a way to answer.
        for name in ("SIDECAR_RESULT_FILE", "SIDECAR_PROGRESS_FILE",
                     "SIDECAR_APPROVAL_REQUEST_FILE"):
            variables.pop(name, None)
        env = child_environment(ctx.base_env, profile, variables)
        env[PROCESS_ID_VARIABLE] = process_id
        wrap = None
        if ctx.sandbox is not None:
            plan = ctx.sandbox

            def wrap(argv: list[str], status_fd: int) -> list[str]:
                return plan.argv(argv, sandbox.job_dir, status_fd)
        launched = await Child.launch(ctx.argv, env, cwd=sandbox.job_dir,
                                      make_preexec=sandbox.preexec
                                      if sandbox.needs_preexec else None,
                                      cgroup=sandbox.cgroup,
                                      new_privileges=profile.allow_new_privs,
                                      processes=ctx.processes, wrap=wrap)
        process.child = Child.start(launched, b"", profile.max_result_bytes,
                                    process.on_stderr_line,
                                    {PROCESS_ID_VARIABLE: process_id}, lines=True)
        process.child.run_as_uid = sandbox.ids[0] if sandbox.ids else None
    except BaseException:
        await loop.run_in_executor(None, sandbox.close)
        raise
    log.emit("warm_process_started", tool=profile.tool, pid=process.child.pid,
             process_id=process_id,
             cgroup=sandbox.cgroup.name if sandbox.cgroup is not None else None)
    return process


async def stop_warm_process(ctx: WorkerContext, process: WarmProcess, reason: str) -> None:
    """End a warm process: close its stdin (the cue to finish), give it the kill grace to
    exit, kill whatever of its tree is left, and remove its work directory and cgroup.
    Logs ``warm_process_stopped`` with ``reason`` (idle, max_jobs, max_seconds, shutdown,
    exited, broken, or the stop reason of the job it did not answer) and the jobs it
    answered."""
    child = process.child
    report = None
    if child is not None:
        child.close_stdin()
        if not child.exited.done():
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a
            # cancellation (the worker's stop) that meets the end of what it awaits
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ctx.profile.kill_grace_seconds):
                    await asyncio.shield(child.exited)
        report = await child.kill_tree(ctx.profile.kill_grace_seconds)
        await child.close_pipes(timeout=1.0)
    left = await asyncio.get_running_loop().run_in_executor(None, process.sandbox.close)
    log.emit("warm_process_stopped", tool=ctx.profile.tool,
             pid=child.pid if child is not None else None, process_id=process.process_id,
             reason=reason, jobs=process.jobs,
             survivors=(report.survivors or None) if report is not None else None,
             left=left or None)


class JobSupervisor:
    """Runs one claimed job to a terminal, requeued, released or abandoned end: spawn,
    race, kill and measure here; the verdict in sidecar.protocol.verdict; the fenced write in
    sidecar.worker.commit."""

    def __init__(self, ctx: WorkerContext, job: ClaimedJob, lease: Lease,
                 predecessors: Collection[asyncio.Task] = (), trace: AttemptTrace = NO_TRACE):
        """``predecessors``: the supervisors of older attempts of the same job this
        sidecar still runs (their leases already marked lost, case F14); this attempt
        spawns nothing before every one of them has ended, so at most one tree of a job
        is alive here at any time. ``trace``: the attempt's trace (sidecar.ops.tracing,
        issue 30), told of the spawn, the race's end, the kill and the end."""
        self.ctx = ctx
        self.job = job
        self.lease = lease
        self.predecessors = tuple(predecessors)
        self.started = time.monotonic()
        self.claimed_at = clock.ownership_now()  # the lifetime cap's origin (F20)
        self.trace = trace
        self.commit = FencedCommit(ctx, job, lease, self.started, trace)
        # The tool's progress reports (guard and SIDECAR_PROGRESS_FILE, issue 26).
        self.progress = ProgressReporter(ctx.store, ctx.owner_id, job, lease)
        # The attempt prepared ahead that this one runs in (``_run``), until its
        # launcher became the Child or was dropped.
        self.prepared: PreparedAttempt | None = None

    async def run(self) -> Outcome:
        """Supervise the job; return how the attempt ended."""
        error: BaseException | None = None
        try:
            if self.predecessors:
                await asyncio.wait(self.predecessors)  # each kills its tree, bounded by grace
            # What the attempt holds (its work directory and cgroup, its guard registration,
            # its progress reports) is let go once its end is written.
            async with contextlib.AsyncExitStack() as held:
                # The one place an attempt ends, whichever way it went.
                outcome = await self.commit.end(await self._attempt(held))
            await self.commit.journal(None, {})  # whatever the attempt noted and no end wrote
            await self.commit.acknowledge_cancel(outcome)
        except Exception as exc:
            error = exc
            self.commit.crashed()  # a bug: counted once, then the worker logs it
            raise
        finally:
            self.ctx.keeper.drop(self.job.attempt_id)
            self.trace.finish(error)
        return outcome

    async def _attempt(self, held: contextlib.AsyncExitStack) -> Ending:
        """Run the attempt up to its verdict: how it is to end (sidecar.protocol.verdict.Ending).
        What it holds until that end is written goes on ``held``."""
        if self.lease.lost.is_set():  # lost (cancelled again?) while we waited
            return Reject(self._lease_ending())
        return await self._run(held)

    def _fail_before_spawn(self, fault: Failure) -> Failure:
        self.lease.settle()
        return fault

    def _short_before_spawn(self, stage: str, errno_name: str, reason: str) -> Release:
        """Case F19: the host ran short of processes, memory, descriptors or disk while
        this attempt was set up (``stage``: sandbox, checkpoint or spawn) before its tool
        ran. Not the job's fault: journal ``attempt_shortage``, count it, give the lease
        back without spending the attempt, and pause this sidecar's claiming
        (sidecar.protocol.shortage.ClaimPause) so the backlog is not burnt meanwhile."""
        self.lease.settle()
        pause = self.ctx.claim_pause.begin()
        asyncio.get_running_loop().call_later(pause, self.ctx.claim_pause.on_end)
        log.emit("attempt_shortage", "warning", **log_fields(self.job), stage=stage,
                 errno=errno_name, reason=reason, claim_pause_s=pause)
        metrics.ATTEMPT_SHORTAGES.labels(self.job.tool, self.ctx.profile.provider,
                                         errno_name).inc()
        self.commit.note("attempt_shortage", {"stage": stage, "errno": errno_name,
                                              "reason": reason, "attempt": self.job.attempt,
                                              "claim_pause_s": pause})
        return Release("shortage")

    async def _run(self, held: contextlib.AsyncExitStack) -> Ending:
        job, profile = self.job, self.ctx.profile
        payload = job.payload_text.encode()
        self.payload_digest = payload_digest(payload)  # logged here, journaled at the start
        log.emit("job_claimed", **log_fields(job), lease_until=job.lease_until,
                 reclaimed=job.reclaimed or None, payload=self.payload_digest)
        if job.lifetime_remaining is not None and job.lifetime_remaining <= 0:
            return self._fail_before_spawn(lifetime_failure(profile))
        if self.ctx.warm is not None:
            return await self._run_warm(held)
        if job.session_key is not None:
            return self._fail_before_spawn(failure(
                FailureKind.SESSION_UNSUPPORTED,
                f"tool {job.tool!r} runs a fresh process per call (PROCESS=per-job), so "
                f"session {job.session_key!r} could keep no state; set the tool's "
                "PROCESS=warm, or enqueue without a session"))
        # The checkpoint is written while the work directory is still the sidecar's own,
        # before the RUN_AS user (and so a sibling attempt) can plant a link in it (F15).
        files = {} if job.checkpoint_text is None else {CHECKPOINT_FILE_NAME: job.checkpoint_text}
        loop = asyncio.get_running_loop()
        # An attempt prepared ahead (sidecar.worker.prepared): its work directory, cgroup
        # and sandbox are set up and its launcher waits; only the job's own files and
        # guard socket are added now, while the directory is still the sidecar's.
        self.prepared = self.ctx.preparer.take() if self.ctx.preparer is not None else None
        if self.prepared is not None:
            # A launcher this attempt ends up not using is killed, however it ends (also
            # by ``_let_go``, first, so the cgroup it sits in can then be removed).
            held.push_async_callback(self._drop_prepared)
            sandbox = self.prepared.sandbox
            sandbox.files, sandbox.guard_socket = files, self.ctx.guard is not None
        else:
            sandbox = Sandbox(self.ctx.settings, profile, self.ctx.cgroup_host,
                              job_name(self.ctx.owner_id, job.id, job.fencing_token),
                              work_dir_prefix(self.ctx.owner_id), spares=self.ctx.spares,
                              files=files, guard_socket=self.ctx.guard is not None)
        try:
            if self.prepared is not None:
                sandbox.attach()
            elif not sandbox.open_kept():
                await loop.run_in_executor(None, sandbox.open)
        except Exception as exc:  # noqa: BLE001 - any failure here fails the attempt, cleanly
            await self._drop_prepared()
            await loop.run_in_executor(None, sandbox.close)
            short = shortage_errno(exc)
            if short is not None:
                return self._short_before_spawn("sandbox", short, str(exc))
            log.emit("sandbox_failed", "error", **log_fields(job), reason=str(exc))
            return self._fail_before_spawn(failure(
                FailureKind.SANDBOX_FAILED, f"cannot set up the attempt's work directory or "
                f"cgroup: {exc}; check SIDECAR_WORK_DIR and the cgroup filesystem"))
        for note in sandbox.notes:
            log.emit("cgroup_unavailable", "warning", **log_fields(job),
                     reason=note + "; this attempt runs under rlimits only")
        env = child_environment(self.ctx.base_env, profile,
                                job_variables(job, profile, self.ctx.owner_id, sandbox))
        # Traced: the tool's TRACEPARENT names this attempt's span (the same trace).
        tool_context = self.trace.tool_context()
        if tool_context:
            env.update(tool_context)
        held.push_async_callback(self._let_go, sandbox)
        if files:
            env["SIDECAR_CHECKPOINT_FILE"] = os.path.join(sandbox.job_dir,
                                                          CHECKPOINT_FILE_NAME)
        # The guard, whatever the sandbox and network (issue 41): the attempt's own Unix
        # socket in its work directory always (bound into the sandbox with it), and the
        # loopback URL unless the tool is in an empty network namespace (NETWORK=none),
        # where it could not reach it.
        if self.ctx.guard is not None:
            # The guard serves (and closes) the socket; the sandbox removes its name.
            listener = sandbox.guard_listener
            env["SIDECAR_GUARD_TOKEN"] = self.ctx.guard.register(self.lease, self.progress,
                                                                 listener)
            if listener is not None and self.ctx.guard.has_socket(self.job.attempt_id):
                env["SIDECAR_GUARD_SOCKET"] = sandbox.guard_socket_path
            if self.ctx.sandbox is None or self.ctx.sandbox.network != "none":
                env["SIDECAR_GUARD_URL"] = self.ctx.guard_url
        return await self._supervise(env, payload, sandbox)

    async def _let_go(self, sandbox: Sandbox) -> None:
        """Let go of what the attempt held once its end is written (or the supervisor
        raised): its progress reports, its guard registration, its work directory and
        cgroup (``sandbox_left`` logged for paths that could not be removed)."""
        self.progress.close()
        await self._drop_prepared()  # a launcher never used: before its cgroup goes
        if self.ctx.guard is not None:
            self.ctx.guard.unregister(self.job.attempt_id)
        left = [] if sandbox.close_kept() else \
            await asyncio.get_running_loop().run_in_executor(None, sandbox.close)
        if left:
            log.emit("sandbox_left", "warning", **log_fields(self.job), paths=left)

    async def _supervise(self, env: dict[str, str], payload: bytes, sandbox: Sandbox
                         ) -> Ending:
        profile = self.ctx.profile
        cookie = {k: env[k] for k in ("SIDECAR_JOB_ID", "SIDECAR_FENCING_TOKEN")}
        relay = _StderrRelay(self.job, self.ctx.settings.log_tool_stderr)
        self.trace.spawning()
        try:
            child = None
            if self.prepared is not None:
                child = self.prepared.start(env, payload, profile.max_result_bytes, relay,
                                            cookie)
                if child is None:  # the line cannot carry env, or the launcher is gone
                    await self._drop_prepared()
                else:
                    self.prepared = None  # its launcher is the Child's now
            if child is None:
                child = await Child.spawn(self.ctx.argv, env, payload,
                                          profile.max_result_bytes, relay, cookie,
                                          cwd=sandbox.job_dir,
                                          make_preexec=sandbox.preexec
                                          if sandbox.needs_preexec else None,
                                          cgroup=sandbox.cgroup,
                                          new_privileges=profile.allow_new_privs,
                                          processes=self.ctx.processes,
                                          wrap=self._sandbox_wrap(sandbox))
            child.run_as_uid = sandbox.ids[0] if sandbox.ids else None
            self.trace.spawned(child.pid)
        except SpawnShortage as exc:
            return self._short_before_spawn("spawn", exc.errno_name, exc.message)
        except SpawnSetupFailed as exc:
            log.emit("sandbox_failed", "error", **log_fields(self.job), reason=exc.message)
            return self._fail_before_spawn(failure(
                FailureKind.SANDBOX_FAILED, f"{exc.message}; the tool did not run"))
        except SpawnFailed as exc:
            log.emit("spawn_failed", "error", **log_fields(self.job), reason=exc.message)
            return self._fail_before_spawn(failure(
                FailureKind.SPAWN_FAILED, exc.message, exit_code=exc.exit_code))

        self.ctx.claim_pause.started()
        # The attempt's job cgroup by name: ``<owner key>.job-<id>-<token>``, or
        # ``.job-p<n>-0`` for one prepared ahead of its job (issue 42).
        cgroup = sandbox.cgroup.name if sandbox.cgroup is not None else None
        self.commit.note("tool_request_started", {
            "pid": child.pid, "argv0": self.ctx.argv[0], "payload": self.payload_digest,
            **({"cgroup": cgroup} if cgroup else {})})
        log.emit("tool_request_started", **log_fields(self.job), pid=child.pid,
                 cgroup=cgroup)

        # SIDECAR_PROGRESS_FILE, looked at on a timer of its own (progress.FILE_SECONDS),
        # never the heartbeat's: a waiting caller sees a report within a second (issue 41).
        progress_file = asyncio.ensure_future(self.progress.watch_file(
            sandbox.dir_lock, sandbox.ids[0] if sandbox.ids else None))
        try:
            reason = await self._race(child, sandbox)
        finally:
            progress_file.cancel()
        self.trace.stopped(reason)
        if reason is not StopReason.EXITED:
            self.lease.stop(reason)  # the guard refuses from now on ("deadline")
        kill_started = time.monotonic()
        report = await child.kill_tree(profile.kill_grace_seconds)
        if report.signal is not None:  # a kill that signalled: its latency (issue 30)
            metrics.KILL_DURATION.labels(self.job.tool, profile.provider).observe(
                time.monotonic() - kill_started)
        sandbox.tree_clean = (reason is StopReason.EXITED and report.signal is None
                              and not report.survivors)
        await child.close_pipes(timeout=1.0)
        relay.summary()
        if reason is not StopReason.EXITED or report.signal is not None:
            self._killed(StopReason.ORPHANED_DESCENDANTS
                         if reason is StopReason.EXITED else reason, report)
        usage = measure(child, sandbox)  # a few small cgroup files: no hop to a thread
        self._note_usage(usage)
        return await self._settle(reason, child, sandbox, usage)

    def _note_usage(self, usage: Usage) -> None:
        """The attempt's resource use, journaled with its end."""
        self.commit.resources = {k: v for k, v in (
            ("peak_memory_bytes", usage.peak_memory_bytes),
            ("cpu_seconds", None if usage.cpu_seconds is None else round(usage.cpu_seconds, 3)),
            ("oom_kills", usage.oom_kills or None),
            ("process_limit_hits", usage.process_limit_hits or None)) if v is not None}

    async def _drop_prepared(self) -> None:
        """Kill the prepared launcher this attempt will not use (its process group, and
        the sandbox's namespace with it) and reap it; the sandbox (work directory and
        cgroup) stays the attempt's."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            await asyncio.get_running_loop().run_in_executor(None, prepared.launched.discard)

    def _sandbox_wrap(self, sandbox: Sandbox):
        """The wrapper of the tool's command line in this attempt's bubblewrap sandbox
        (sidecar.worker.isolation.SandboxPlan.argv over its work directory), or None when
        attempts run unsandboxed."""
        plan = self.ctx.sandbox
        if plan is None:
            return None
        return lambda argv, status_fd: plan.argv(argv, sandbox.job_dir, status_fd)

    def _killed(self, reason: StopReason, report) -> None:
        """Log, count and journal one tree kill."""
        gone = KillSignal.ALREADY_EXITED
        sig = KillSignal(report.signal.name) if report.signal is not None else gone
        details = {"reason": str(reason), "signal": None if sig is gone else str(sig),
                   "killed": len(report.killed), "survivors": len(report.survivors)}
        if report.unsignalled:  # EPERM: the tree holds a process of another user (F23)
            details["unsignalled"] = len(report.unsignalled)
        log.emit("child_killed", "warning", **log_fields(self.job), reason=str(reason),
                 signal=details["signal"],
                 killed=len(report.killed), survivors=report.survivors or None,
                 unsignalled=report.unsignalled or None)
        labels = (self.job.tool, self.ctx.profile.provider)
        metrics.CHILD_KILLS.labels(*labels, reason, sig).inc()
        metrics.PROCESSES_LEFT.labels(*labels).inc(len(report.survivors))
        self.commit.note("child_killed", details)
        self.trace.killed(str(reason), details["signal"], len(report.killed),
                          len(report.survivors))

    async def _race(self, child: Child, sandbox: Sandbox,
                    answer: asyncio.Future | None = None, cpu_base: float = 0.0
                    ) -> StopReason:
        """Wait for the first of: the child exits, the lease is lost (or cancelled), the
        stage deadline or the job's lifetime cap passes, the tree goes idle, or shutdown
        demands the kill. Return which. Ownership wins every tie (P13). ``answer``: a
        warm process's response line to this job (EXITED when it came: the tool is done
        with the job); ``cpu_base``: the cgroup's CPU time at its start (CPU_SECONDS
        bounds the job's own)."""
        profile = self.ctx.profile
        timeout, on_timeout = profile.stage_timeout_seconds, StopReason.STAGE_TIMEOUT
        lifetime = self.job.lifetime_remaining
        elapsed = clock.ownership_now() - self.claimed_at
        if lifetime is not None and lifetime - elapsed < timeout:
            timeout = max(0.0, lifetime - elapsed)
            on_timeout = StopReason.MAX_LIFETIME
        waiters = {
            # On CLOCK_BOOTTIME: a suspend counts toward the deadline (case F20).
            asyncio.ensure_future(watch_deadline(clock.ownership_now() + timeout)):
                on_timeout,
            asyncio.ensure_future(asyncio.shield(child.exited)): StopReason.EXITED,
            asyncio.ensure_future(self.lease.lost.wait()): StopReason.LEASE_LOST,
            asyncio.ensure_future(self.ctx.shutdown_kill.wait()): StopReason.SHUTDOWN,
            asyncio.ensure_future(asyncio.shield(child.overflowed)):
                StopReason.RESULT_TOO_LARGE,
        }
        if answer is not None:
            waiters[asyncio.ensure_future(asyncio.shield(answer))] = StopReason.EXITED
        if profile.idle_timeout_seconds > 0:
            waiters[asyncio.ensure_future(
                watch_idle(child, profile.idle_timeout_seconds,
                           lambda: self.progress.reports))] = StopReason.IDLE_TIMEOUT
        if profile.cpu_seconds > 0:
            waiters[asyncio.ensure_future(
                watch_cpu(child, sandbox, profile.cpu_seconds, cpu_base))] = StopReason.CPU_LIMIT
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in waiters:
                fut.cancel()
        if self.lease.lost.is_set():
            return self._lease_ending()
        reasons = {waiters[fut] for fut in done}
        for reason in (StopReason.SHUTDOWN, StopReason.EXITED, StopReason.RESULT_TOO_LARGE,
                       StopReason.IDLE_TIMEOUT, StopReason.CPU_LIMIT, on_timeout):
            if reason in reasons:
                return reason
        return StopReason.EXITED

    # --- warm mode (sidecar.worker.warm) -------------------------------------

    async def _run_warm(self, held: contextlib.AsyncExitStack) -> Ending:
        """The attempt in a warm process: an idle one of the pool, else a new one (a
        process that cannot take the request is stopped and a new one started, once).
        Its request line goes out, then the race as for any attempt; an answer keeps the
        process for the next job, anything else kills its tree (docs/child-process.md,
        "Warm mode")."""
        pool = self.ctx.warm
        if self.job.session_key is None:
            return await self._warm_attempt(held, pool.take(), None)
        opened = await self._open_session()
        if not isinstance(opened, Session):
            return opened
        try:
            return await self._warm_attempt(held, opened.process, opened)
        finally:
            # A session whose first process never started holds nothing: it ends lost
            # here, whatever ended the attempt (a spawn failure, a cancellation).
            if opened.process is None:
                pool.drop_session(opened, "lost", "its process could not start")

    async def _warm_attempt(self, held: contextlib.AsyncExitStack,
                            process: WarmProcess | None, session: Session | None) -> Ending:
        pool, fresh = self.ctx.warm, False
        for _ in range(2):
            if process is None:
                try:
                    process, fresh = await pool.start(), True
                    if session is not None:
                        pool.bind(process, session)
                except SpawnShortage as exc:
                    return self._short_before_spawn("spawn", exc.errno_name, exc.message)
                except SpawnSetupFailed as exc:
                    log.emit("sandbox_failed", "error", **log_fields(self.job),
                             reason=exc.message)
                    return self._fail_before_spawn(failure(
                        FailureKind.SANDBOX_FAILED, f"{exc.message}; the tool did not run"))
                except SpawnFailed as exc:
                    log.emit("spawn_failed", "error", **log_fields(self.job),
                             reason=exc.message)
                    return self._fail_before_spawn(failure(
                        FailureKind.SPAWN_FAILED, exc.message, exit_code=exc.exit_code))
                except Exception as exc:  # noqa: BLE001 - the sandbox: fails the attempt
                    short = shortage_errno(exc)
                    if short is not None:
                        return self._short_before_spawn("sandbox", short, str(exc))
                    log.emit("sandbox_failed", "error", **log_fields(self.job),
                             reason=str(exc))
                    return self._fail_before_spawn(failure(
                        FailureKind.SANDBOX_FAILED, f"cannot set up the warm process's work "
                        f"directory or cgroup: {exc}; check SIDECAR_WORK_DIR and the cgroup "
                        "filesystem"))
            try:
                answer = await self._send_request(process, held)
                break
            except LineBroken as exc:
                log.emit("warm_process_broken", "warning", **log_fields(self.job),
                         pid=process.child.pid, reason=str(exc))
                pool.retire(process, "broken")
                if fresh:  # a new process that cannot take its first request
                    return self._fail_before_spawn(failure(
                        FailureKind.SPAWN_FAILED, f"the warm process could not take its "
                        f"first request: {exc}"))
                if session is not None:  # its state went with it: never a fresh one
                    return self._fail_before_spawn(self._session_lost(
                        "its process could not take the call"))
                process = None
        return await self._supervise_warm(process, answer, fresh)

    async def _open_session(self) -> Session | Ending:
        """The session this call of an agent session runs in (issue 43): held here and
        continued, or started (again) here; else the call's end: ``session_lost`` (it
        ended or was lost, and SESSION_RESTART is not fresh), or a Release when another
        sidecar holds it or the database did not answer (the attempt is not spent)."""
        profile, key = self.ctx.profile, self.job.session_key
        pool = self.ctx.warm
        opening = key not in pool.sessions
        if opening and not pool.room() and not await pool.free_a_place():
            # Each session keeps a process: a new one beyond the cap goes to another
            # sidecar (or here, later), its attempt not spent (F19's path).
            return self._short_before_spawn(
                "session", "max_sessions", f"this sidecar holds MAX_SESSIONS="
                f"{profile.max_sessions} sessions; the call waits for one to end or for "
                "another sidecar")
        if opening:  # its place is taken now: two first calls at once cannot both pass
            pool.opening += 1
        sent = time.monotonic()
        try:
            status, generation, end_reason = await pool.begin_session(self.job.tool, key)
        except (*db.DATABASE_ERRORS, TimeoutError) as exc:
            log.emit("session_unknown", "warning", **log_fields(self.job), session=key,
                     reason=db.describe_error(exc))
            self.lease.settle()
            return Release("session_unknown")
        finally:
            if opening:
                pool.opening -= 1
        confirmed = sent + profile.lease_seconds - self.ctx.keeper.margin
        if status == "elsewhere":
            self.lease.settle()
            return Release("session_elsewhere")
        if status == "lost":
            return self._fail_before_spawn(self._session_lost(end_reason or "it ended"))
        if status == "continued":
            session = pool.continue_session(key, generation, confirmed)
            if session is None:
                # Ours by the database, but its process is gone here (it died between
                # calls, or this sidecar dropped it): its state is gone with it.
                lost = pool.sessions.get(key)
                if lost is not None and not lost.busy:
                    pool.drop_session(lost, "lost", "its process is gone")
                else:
                    await pool.end_session_row(self.job.tool, key, generation, "lost",
                                               "its process is gone")
                return self._fail_before_spawn(self._session_lost("its process is gone"))
            return session
        session = pool.open_session(self.job.tool, key, generation, confirmed)
        log.emit("session_started", **log_fields(self.job), session=key,
                 generation=generation, restarted=status == "restarted",
                 **({"previous_end": end_reason} if end_reason else {}))
        self.commit.note("session_started", {"session": key, "generation": generation,
                                             "restarted": status == "restarted"})
        return session

    def _session_lost(self, why: str) -> Failure:
        """The call's failure when its session is gone: kind session_lost, saying why."""
        key = self.job.session_key
        log.emit("session_lost", "warning", **log_fields(self.job), session=key, reason=why)
        metrics.SESSIONS_LOST.labels(self.job.tool, self.ctx.profile.provider).inc()
        return failure(FailureKind.SESSION_LOST,
                       f"session {key!r} of tool {self.job.tool!r} is gone ({why}); its "
                       "state went with its process, so this call did not run: start a new "
                       "session (another key), or set the tool's SESSION_RESTART=fresh")

    async def _send_request(self, process: WarmProcess, held: contextlib.AsyncExitStack
                            ) -> asyncio.Future:
        """Register the job with the guard (a socket of its own in the process's work
        directory) and write its request line; the future of the answer. Raises
        LineBroken (the registration is undone)."""
        guard: dict[str, str] = {}
        socket_path = None
        if self.ctx.guard is not None:
            try:
                socket_path, listener = process.guard_socket()
            except OSError:
                listener = None  # the URL still serves where the network does
            guard["token"] = self.ctx.guard.register(self.lease, self.progress, listener)
            if socket_path is not None and self.ctx.guard.has_socket(self.job.attempt_id):
                guard["socket"] = socket_path
            if self.ctx.sandbox is None or self.ctx.sandbox.network != "none":
                guard["url"] = self.ctx.guard_url
        trace = self.trace.tool_context()
        if self.job.traceparent:
            trace = {"TRACEPARENT": self.job.traceparent,
                     **({"TRACESTATE": self.job.tracestate} if self.job.tracestate else {}),
                     **(trace or {})}

        async def let_go() -> None:
            self.progress.close()
            if self.ctx.guard is not None:
                self.ctx.guard.unregister(self.job.attempt_id)
            if socket_path is not None:
                process.forget_socket(socket_path)

        try:
            answer = process.child.request(request_line(self.job, guard, trace))
        except LineBroken:
            await let_go()
            raise
        held.push_async_callback(let_go)
        return answer

    async def _supervise_warm(self, process: WarmProcess, answer: asyncio.Future,
                              fresh: bool) -> Ending:
        profile, child, sandbox = self.ctx.profile, process.child, process.sandbox
        relay = _StderrRelay(self.job, self.ctx.settings.log_tool_stderr)
        process.relay = relay
        stderr_before = child.stderr_bytes
        # The cgroup is the process's: each job's figures are what changed during it.
        usage_before = sandbox.cgroup.usage() if sandbox.cgroup is not None else Usage()
        cpu_base = usage_before.cpu_seconds or 0.0
        if sandbox.cgroup is None and profile.cpu_seconds > 0:  # the live tree's, then
            cpu_base = (await asyncio.get_running_loop().run_in_executor(
                None, tree_activity, child.pid))[0]
        self.trace.spawning()
        self.trace.spawned(child.pid)
        self.ctx.claim_pause.started()
        cgroup = sandbox.cgroup.name if sandbox.cgroup is not None else None
        warm = {"process_id": process.process_id, "jobs_before": process.jobs,
                "fresh": fresh}
        self.commit.note("tool_request_started", {
            "pid": child.pid, "argv0": self.ctx.argv[0], "payload": self.payload_digest,
            "warm": warm, **({"cgroup": cgroup} if cgroup else {})})
        log.emit("tool_request_started", **log_fields(self.job), pid=child.pid,
                 cgroup=cgroup, warm=warm)
        reason = await self._race(child, sandbox, answer, cpu_base)
        self.trace.stopped(reason)
        answered = reason is StopReason.EXITED and answer.done() and not answer.cancelled() \
            and not child.stdout_overflow
        if reason is StopReason.EXITED and child.stdout_overflow:
            reason = StopReason.RESULT_TOO_LARGE  # the answer came with a line over the cap
        process.relay = None
        relay.summary()
        tail_bytes = child.stderr_bytes - stderr_before
        stderr_tail = stderr_tail_text(child.stderr_tail[-tail_bytes:] if tail_bytes else b"",
                                       tail_bytes > len(child.stderr_tail), STDERR_TAIL_BYTES)
        if answered:
            process.jobs += 1
            usage = usage_since(sandbox.cgroup.usage(), usage_before) \
                if sandbox.cgroup is not None else Usage()
            self._note_usage(usage)
            limit = limit_failure(Observed(
                StopReason.EXITED, 0, usage=usage, stderr_tail=stderr_tail,
                memory_cgroup=sandbox.cgroup is not None
                and sandbox.cgroup.host.memory is not None), profile)
            checked = None
            if limit is None and not child.stdout and not self.lease.lost.is_set():
                # Checked while the heartbeat still renews the lease (an exact parse of a
                # large answer takes seconds on a loaded host): see _settle.
                checked = await self._answered(answer.result(), stderr_tail)
            self.lease.settle()
            if checked is not None and checked[1]:
                log.emit("warm_process_broken", "warning", **log_fields(self.job),
                         pid=child.pid, reason="an answer that names another job or none")
                self.ctx.warm.retire(process, "broken")
                if not self.lease.lost.is_set():
                    return checked[0]
            if self.lease.lost.is_set():  # lost as the answer came: ownership first (P13)
                ending = Reject(self._lease_ending(), payload_digest(answer.result()))
            elif limit is not None:
                # An OOM kill or a refused fork in the process during the job: the job
                # fails by that limit, as a per-job tool's would, and the process (whose
                # tree lost a member) goes.
                self.ctx.warm.retire(process, str(limit.kind))
                return limit
            elif child.stdout:
                # More than one line came for one request: which one answers it cannot be
                # told (a tool that prints anything but its answers to stdout). The job
                # fails and the process goes, before it answers another job with it.
                ending = failure(FailureKind.BAD_RESULT, "the warm process wrote more than "
                                 "one line for the job's request; write only the answer to "
                                 "stdout (logs go to stderr)", stderr_tail=stderr_tail)
                log.emit("warm_process_broken", "warning", **log_fields(self.job),
                         pid=child.pid, reason="more than one line for one request")
                self.ctx.warm.retire(process, "broken")
                return ending
            elif self.lease.refused is not None:
                ending = self.lease.refused  # its step was denied: its answer is not kept
            elif self.lease.park is not None:
                ending = self.lease.park  # it waits for a person's yes: parked
            elif self.lease.snooze is not None:
                ending = self.lease.snooze  # it asked to run later: its answer is not kept
            else:
                ending = checked[0]
            if process.retired:
                return ending
            # Kept, or retired in the pool's own task: the job's end is written without
            # waiting for a stop (its lease is settled: renewed no more).
            self.ctx.warm.give_back(process)
            return ending
        # No answer: the process is lost with the job; its whole tree goes.
        if reason is not StopReason.EXITED:
            self.lease.stop(reason)
        kill_started = time.monotonic()
        report = await child.kill_tree(profile.kill_grace_seconds)
        if report.signal is not None:
            metrics.KILL_DURATION.labels(self.job.tool, profile.provider).observe(
                time.monotonic() - kill_started)
        await child.close_pipes(timeout=1.0)
        if reason is not StopReason.EXITED or report.signal is not None:
            self._killed(StopReason.ORPHANED_DESCENDANTS
                         if reason is StopReason.EXITED else reason, report)
        usage = usage_since(sandbox.cgroup.usage(), usage_before) \
            if sandbox.cgroup is not None else Usage()
        self._note_usage(usage)
        self.ctx.warm.retire(process, str(reason))  # its tree is dead: the rest goes aside
        self.lease.settle()
        if self.lease.lost.is_set():
            reason = self._lease_ending()
        if reason is StopReason.EXITED and child.returncode == 0 and not child.stdout_overflow:
            return failure(FailureKind.BAD_RESULT, "the warm process exited (status 0) "
                           "before it answered the job's request line",
                           stderr_tail=stderr_tail)
        seen = Observed(reason, child.returncode, child.status_lost, child.stdout_overflow,
                        child.stdout_bytes, usage, stderr_tail,
                        sandbox.cgroup is not None and sandbox.cgroup.host.memory is not None,
                        self.lease.snooze, self.lease.refused, self.lease.park)
        verdict = decide(seen, profile)
        if isinstance(verdict, Reject | Release | Failure | Snooze | Park):
            return verdict
        return failure(FailureKind.BAD_RESULT, "the warm process ended without answering "
                       "the job's request line", stderr_tail=stderr_tail)

    async def _answered(self, line: bytes, stderr_tail: str | None
                        ) -> tuple[Succeeded | Failure, bool]:
        """The verdict on a warm process's response line (sidecar.protocol.warm): the job's
        result, checked as a per-job tool's stdout, or the failure its ``error`` reports;
        and whether the line was out of step (it names another job or none: the process
        must serve no other). A line over PARSE_ON_LOOP_BYTES is read off the event
        loop."""
        profile = self.ctx.profile
        output = bytearray(line)
        digest = payload_digest(output)
        args = (output, str(self.job.id), self.ctx.settings, profile)
        try:
            if len(output) > PARSE_ON_LOOP_BYTES:
                answer, result, next_stage = await asyncio.get_running_loop(
                ).run_in_executor(None, _parse_answer, *args)
            else:
                answer, result, next_stage = _parse_answer(*args)
        except SecretInOutput as exc:
            return self._refuse_secret(exc, digest, ANSWER_SOURCE, stderr_tail), False
        except BadAnswer as exc:
            return failure(FailureKind.BAD_RESULT, exc.message,
                           stderr_tail=stderr_tail), exc.out_of_step
        except BadResult as exc:  # worded for a per-job tool's stdout after its exit
            return failure(FailureKind(exc.kind), exc.message.removeprefix("exit 0 but "),
                           stderr_tail=stderr_tail), False
        if answer.error is not None:
            message, code = answer.error
            retryable = code not in profile.non_retryable_exit_codes
            return Failure(FailureKind.EXIT_CODE,
                           f"the tool reported an error (exit code {code}): {message}"
                           + ("" if retryable else " (non-retryable for this profile)"),
                           retryable, {"exit_code": code, "stderr_tail": stderr_tail}), False
        return Succeeded(result, digest, next_stage, stderr_tail), False

    def _lease_ending(self) -> StopReason:
        """Why the lease ended (lease_lost, cancelled or local_deadline)."""
        reason = StopReason(self.lease.reason or StopReason.LEASE_LOST)
        return reason if reason in LEASE_ENDINGS else StopReason.LEASE_LOST

    async def _settle(self, reason: StopReason, child: Child, sandbox: Sandbox,
                      usage: Usage) -> Ending:
        # Scrubbed before it goes anywhere (issue 25): a tool that echoes the mounted
        # database Secret or its guard token leaves "[secret]" in the tail.
        stderr_tail = stderr_tail_text(child.stderr_tail,
                                       child.stderr_bytes > len(child.stderr_tail),
                                       STDERR_TAIL_BYTES)
        checked = None
        if reason is StopReason.EXITED and not self.lease.lost.is_set() \
                and not child.sandbox_failed:
            # A tool without HTTP asks a person's yes by a file (issue 44): while the
            # lease is still renewed, the request is written and the job parks.
            checked = await self._approval_file(sandbox)
        if checked is None and not self.lease.lost.is_set() \
                and not (child.sandbox_failed and reason is StopReason.EXITED) \
                and isinstance(decide(self._observed(reason, child, sandbox, usage,
                                                     stderr_tail), self.ctx.profile), Commit):
            # Read and checked while the heartbeat still renews the lease: the exact parse
            # of a large result takes seconds on a loaded host (8 MiB of 17-digit numbers:
            # about 5 s on 2 busy cores), more than what is left of a lease.
            checked = await self._commit_output(child, sandbox, stderr_tail)
        self.lease.settle()
        if self.lease.lost.is_set():  # lost during the kill or the check: ownership first
            reason = self._lease_ending()  # (P13)
            if checked is not None:
                return Reject(reason, checked.digest if isinstance(checked, Succeeded)
                              else checked.details.get("result"))
        elif checked is not None:
            return checked
        if child.sandbox_failed and reason is StopReason.EXITED:
            # bwrap exited without starting the tool: the sandbox's failure, not the
            # tool's exit status (retried, as any sandbox_failed).
            last = (stderr_tail or "").strip().splitlines()[-1:] or ["no message"]
            log.emit("sandbox_failed", "error", **log_fields(self.job), reason=last[0])
            return failure(
                FailureKind.SANDBOX_FAILED, f"the sandbox (bwrap) did not start the tool: "
                f"{last[0]}", stderr_tail=stderr_tail)
        verdict = decide(self._observed(reason, child, sandbox, usage, stderr_tail),
                         self.ctx.profile)
        match verdict:
            case Reject(reason=ending):
                returned = (child.returncode == 0 or child.status_lost) \
                    and not child.stdout_overflow
                # Up to MAX_RESULT_BYTES from disk: off the event loop, which heartbeats
                # the other jobs' leases.
                digest = await asyncio.get_running_loop().run_in_executor(
                    None, self._output_digest, child, sandbox) if returned else None
                return Reject(ending, digest)
            case Release() | Failure() | Snooze() | Park():
                return verdict
            case Commit():
                return await self._commit_output(child, sandbox, stderr_tail)
        raise AssertionError(f"no verdict handled: {verdict!r}")

    async def _approval_file(self, sandbox: Sandbox) -> Failure | Release | None:
        """``$SIDECAR_APPROVAL_REQUEST_FILE``, if the exited tool wrote it: the body of a
        ``POST /v1/approval`` (issue 44). Its request is written for this attempt,
        answerable for APPROVAL_PARK_SECONDS, and the attempt ends parked (the lease's
        park, read by decide) whatever APPROVAL_MODE says: a tool without HTTP cannot wait
        in place. None when there is no file or the request was kept; a Failure
        (bad_result, not retried) for a file that cannot be used; a Release (the attempt
        not spent) when the database did not take the request."""
        try:
            found = safefs.read_small_file(sandbox.dir_lock, APPROVAL_FILE_NAME,
                                           APPROVAL_BODY_LIMIT,
                                           sandbox.ids[0] if sandbox.ids else None)
            if found is None:
                return None
            if SECRETS.labels_in(found[0]):
                raise ValueError("it holds a secret the sidecar knows")
            asked = parse_approval(found[0])
        except (ValueError, OSError) as exc:
            return failure(FailureKind.BAD_RESULT, "SIDECAR_APPROVAL_REQUEST_FILE: "
                           f"{one_line(str(exc))[:300]}")
        profile = self.ctx.profile
        try:
            row = await self.commit.ask_approval(
                uuid.uuid4(), asked.action, asked.summary, dict(asked.details),
                profile.approval_park_seconds)
        except asyncpg.UniqueViolationError:
            return failure(FailureKind.BAD_RESULT, "SIDECAR_APPROVAL_REQUEST_FILE: this "
                           "attempt's request through the guard is still open")
        except db.DATABASE_ERRORS as exc:  # not written: the attempt is given back
            log.emit("approval_failed", "warning", **log_fields(self.job),
                     reason=db.describe_error(exc))
            return Release("approval_unwritten")
        if row is None:
            return None  # no longer ours: the lease's loss decides
        log.emit("approval_requested", **log_fields(self.job), request_id=str(row["id"]),
                 action=asked.action, wait_s=profile.approval_park_seconds, mode="file")
        self.lease.park_for(str(row["id"]), asked.action)
        return None

    def _observed(self, reason: StopReason, child: Child, sandbox: Sandbox, usage: Usage,
                  stderr_tail: str | None) -> Observed:
        return Observed(reason, child.returncode, child.status_lost, child.stdout_overflow,
                        child.stdout_bytes, usage, stderr_tail,
                        sandbox.cgroup is not None and sandbox.cgroup.host.memory is not None,
                        self.lease.snooze, self.lease.refused, self.lease.park)

    async def _commit_output(self, child: Child, sandbox: Sandbox,
                             stderr_tail: str | None) -> Succeeded | Failure:
        """Read what the tool returned (its result file, else its stdout) and check it:
        Succeeded with the result to commit, or the Failure it is. The output is held
        once: parsed, then only the text for PostgreSQL."""
        profile = self.ctx.profile
        try:
            # The result file, when there is one, is the result; stdout is ignored.
            # Up to MAX_RESULT_BYTES from disk: off the event loop, which heartbeats (a
            # tool that left none costs one lstat here, no hop to a thread).
            # Both through the work directory's descriptor, never its path (F15).
            if not sandbox.has_result():
                raise FileNotFoundError(sandbox.result_file)
            output = await asyncio.get_running_loop().run_in_executor(
                None, sandbox.read_result, profile.max_result_bytes,
                profile_var(profile, "MAX_RESULT_BYTES"))
            source = "SIDECAR_RESULT_FILE"
        except FileNotFoundError:
            output, child.stdout = child.stdout, bytearray()  # handed over, not copied
            source = "stdout"
        except BadResult as exc:
            return failure(FailureKind(exc.kind), exc.message, stderr_tail=stderr_tail)
        digest = payload_digest(output)
        try:
            if len(output) > PARSE_ON_LOOP_BYTES:
                # An exact parse costs about 20 ms per MiB, and so does freeing the parsed
                # value: both off the event loop, which heartbeats the other jobs' leases.
                result, next_stage = await asyncio.get_running_loop().run_in_executor(
                    None, _parse_output, output, source, self.ctx.settings, profile)
            else:
                result, next_stage = _parse_output(output, source, self.ctx.settings,
                                                   profile)
            del output  # a large result is held once, as the text sent to PostgreSQL
        except SecretInOutput as exc:
            return self._refuse_secret(exc, digest, source, stderr_tail)
        except BadResult as exc:
            return failure(FailureKind(exc.kind), exc.message, stderr_tail=stderr_tail)
        return Succeeded(result, digest, next_stage, stderr_tail)

    def _refuse_secret(self, exc: SecretInOutput, digest: dict[str, Any], source: str,
                       stderr_tail: str | None) -> Failure:
        """The output holds a secret (issue 25): nothing of it is stored; the attempt fails
        ``secret_in_output`` (not retried), journaled with the output's sha256 and size and
        the kinds of secret found, never the value."""
        details = {"result": digest, "source": source, "secrets": exc.labels}
        log.emit("secret_in_output", "error", **log_fields(self.job), reason=exc.message,
                 result=digest, secrets=exc.labels)
        self.commit.note("secret_in_output", details)
        return failure(FailureKind.SECRET_IN_OUTPUT, exc.message, stderr_tail=stderr_tail,
                       secrets=exc.labels, result=digest)

    def _output_digest(self, child: Child, sandbox: Sandbox) -> dict[str, Any] | None:
        """payload_digest of what the tool returned (its result file, else its stdout),
        for the journal of a result that may not be committed (P6)."""
        try:
            return payload_digest(sandbox.read_result(self.ctx.profile.max_result_bytes))
        except FileNotFoundError:
            return payload_digest(child.stdout)
        except BadResult:
            return None


def _parse_output(output: bytearray, source: str, settings: Settings,
                  profile: LeaseProfile) -> tuple[RawJson, NextStage | None]:
    """The tool's output checked (parse_result) and split into the result's JSON text and
    the next stage (split_next_stage); the parsed value is dropped here, in whichever
    thread runs this. Raises BadResult (SecretInOutput first, for output that holds a
    secret the sidecar knows: result and next-stage payload alike, issue 25)."""
    check_no_secret(output, source)
    value, text = parse_result(output, source)
    return split_next_stage(value, text, settings, profile)


ANSWER_SOURCE = "the response line"


def _parse_answer(output: bytearray, job_id: str, settings: Settings, profile: LeaseProfile
                  ) -> tuple[Answer, RawJson | None, NextStage | None]:
    """A warm process's response line checked (no secret, parse_result), read as the
    answer to job ``job_id`` (warm.read_answer) and its result split from its next stage
    (split_next_stage), in whichever thread runs this. Raises SecretInOutput, BadResult,
    BadAnswer."""
    check_no_secret(output, ANSWER_SOURCE)
    value, _ = parse_result(output, ANSWER_SOURCE)
    answer = read_answer(value, job_id)
    if answer.error is not None:
        return answer, None, None
    text = RawJson(jsontext.dumps(answer.output).decode())
    if answer.staged:
        result, next_stage = split_next_stage(answer.output, text, settings, profile)
        return answer, result, next_stage
    return answer, text, None


# The longest a deadline on CLOCK_BOOTTIME may be seen late after a suspend: sleeps (on
# the monotonic clock, which stops in a suspend) are cut into pieces of at most this.
DEADLINE_CHECK_SECONDS = 1.0


async def watch_deadline(deadline: float) -> None:
    """Return once sidecar.protocol.clock.ownership_now() reaches ``deadline`` (CLOCK_BOOTTIME
    seconds), which counts time the host spent suspended (case F20). Sleeps on the
    event loop's monotonic clock at most DEADLINE_CHECK_SECONDS at a time, so a deadline
    that passed during a suspend is seen within that of the resume."""
    while (left := deadline - clock.ownership_now()) > 0:
        await asyncio.sleep(min(left, DEADLINE_CHECK_SECONDS))


async def watch_idle(child: Child, idle_seconds: float,
                     reports: Callable[[], int] = lambda: 0) -> None:
    """Return once the child's tree has shown no CPU time, no I/O, no output and no
    progress report (``reports()``: how many it made so far, issue 26) for
    ``idle_seconds``: hung, although the sidecar itself is healthy and heartbeating."""
    loop = asyncio.get_running_loop()
    period = min(1.0, idle_seconds / 4)
    last_sample, last_progress = None, time.monotonic()
    while True:
        await asyncio.sleep(period)
        sample = (await loop.run_in_executor(None, tree_activity, child.pid),
                  child.stdout_bytes, child.stderr_bytes, reports())
        now = time.monotonic()
        if sample != last_sample:
            last_sample, last_progress = sample, now
        elif now - last_progress >= idle_seconds:
            return


async def watch_cpu(child: Child, sandbox: Sandbox, limit_seconds: float,
                    base: float = 0.0) -> None:
    """Return once the tool's whole tree has used ``limit_seconds`` of CPU time: from the
    job cgroup where there is one (exited processes count too), else from the live
    tree; less ``base``, the same figure when the job started (a warm process's). RLIMIT_CPU
    bounds each process on its own; this bounds their sum."""
    loop = asyncio.get_running_loop()
    period = min(1.0, max(0.05, limit_seconds / 10))
    while True:
        await asyncio.sleep(period)
        used = sandbox.cgroup.cpu_seconds() if sandbox.cgroup is not None else None
        if used is None:
            used = (await loop.run_in_executor(None, tree_activity, child.pid))[0]
        if used - base >= limit_seconds:
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
    for proc in tree_processes(pid):
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



