"""The claim loop of one sidecar: concurrency, NOTIFY wake-ups with polling as fallback,
``--drain``, and a clean drain on SIGTERM/SIGINT (case F8).

If a background task (heartbeat, claim loop) dies, the worker kills every child and
stops: no half-alive process keeps leases it no longer renews.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import resource
import signal
import socket
import tempfile
import time
import uuid

from sidecar.ops import health, metrics, retention
from sidecar.ops.health import Readiness
from sidecar.ops.periodic import POLL_SPREAD, RESYNC_SPREAD, Periodic, spread_after, spread_period
from sidecar.ops.tracing import OFF, Tracer
from sidecar.protocol import clock, parsing
from sidecar.protocol.enqueue_args import dedupe_window_seconds
from sidecar.protocol.errors import ConfigError
from sidecar.protocol.flow import Held
from sidecar.protocol.masking import SECRETS, mask_url
from sidecar.protocol.model import ClaimedJob, LeaseProfile
from sidecar.protocol.shortage import ClaimPause
from sidecar.protocol.vocabulary import AttemptId, FailureKind
from sidecar.runtime.config import Settings, register_secrets
from sidecar.runtime.log import log
from sidecar.storage import db
from sidecar.storage.queries import migrations
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker.cgroups import CgroupHost
from sidecar.worker.child import ProcessTable
from sidecar.worker.commit import labelled
from sidecar.worker.context import WorkerContext
from sidecar.worker.forwarder import Forwarder
from sidecar.worker.guard import GuardServer
from sidecar.worker.isolation import SandboxPlan, SparePool
from sidecar.worker.lease import LeaseKeeper
from sidecar.worker.leftovers import (
    OwnerLock,
    remove_if_abandoned,
    sweep_dead_owners,
    work_dir_prefix,
)
from sidecar.worker.prepared import Preparer
from sidecar.worker.supervisor import (
    JobSupervisor,
    discard_prepared,
    prepare_attempt,
    start_warm_process,
    stop_warm_process,
)
from sidecar.worker.warm import WarmPool

# An idle sidecar refreshes its place on the idle list this often (seconds); the wake-up
# function skips places older than two minutes (migration 008).
IDLE_REFRESH_SECONDS = 30.0
# The LISTEN connection: a lost one is made again after LISTEN_RETRY_MIN_SECONDS,
# doubling to LISTEN_RETRY_MAX_SECONDS while it keeps failing (polling covers meanwhile);
# one that is up is probed with SELECT 1 every min(SIDECAR_POLL_SECONDS,
# LISTEN_CHECK_SECONDS) (a connection the server closes is noticed at once).
LISTEN_RETRY_MIN_SECONDS = 1.0
LISTEN_RETRY_MAX_SECONDS = 30.0
LISTEN_CHECK_SECONDS = 30.0
# A sidecar that cannot hear the cancel NOTIFY (no LISTEN behind a transaction pooler, or
# its LISTEN connection is down) asks the database this often, while it holds leases,
# whether a job it runs was cancelled (issue 41), so the tree still dies within about a
# second rather than at the next heartbeat.
CANCEL_CHECK_SECONDS = 1.0


def wake_channel(owner_id: str) -> str:
    """The NOTIFY channel only this sidecar listens on: ``sidecar_wake_`` and 40 hex
    digits of the owner id's sha1 (an identifier of 53 characters, under PostgreSQL's 63)."""
    return "sidecar_wake_" + hashlib.sha1(owner_id.encode()).hexdigest()


def cancel_channel(owner_id: str) -> str:
    """The NOTIFY channel on which this sidecar hears that a job it runs was cancelled:
    ``sidecar_cancel_`` and the md5 of the owner id in 32 hex digits (47 characters), as
    tool_job_tell_owner (functions/cancel.sql) computes it; the payload is the job id."""
    return "sidecar_cancel_" + hashlib.md5(owner_id.encode(), usedforsecurity=False).hexdigest()


def worker_identity(worker_name: str) -> str:
    """A fresh ``owner_id``: a stable name (default the hostname), the pid and a random part,
    so a restarted pod that keeps its hostname and pid never inherits its predecessor's
    leases (case F3)."""
    name = worker_name or socket.gethostname()
    return f"{name}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


# The first poll period of a claim loop is drawn over [0.1, 1] x SIDECAR_POLL_SECONDS
# (spread_period), the later ones over [0.8, 1] x (POLL_SPREAD), except after a poll that
# came late by more than that (a pause: spread_after).
FIRST_POLL_SPREAD = RESYNC_SPREAD


def may_claim(running: int, concurrency: int, stopping: bool, pause_left: float) -> bool:
    """The claim loop's rule for one more claim now: a free slot (``running`` attempts of
    ``concurrency``), no stop asked (a stopping sidecar only drains, case F8), and no
    claim pause after a shortage of the host (``pause_left`` seconds, case F19)."""
    return running < concurrency and not stopping and pause_left <= 0.0


def drained(running: int, unfinished: int, due_outbox: int) -> bool:
    """``--drain``'s end: nothing of the tool runs here, none of its jobs is queued or
    running anywhere (``unfinished``), and no accepted result still waits to be forwarded
    within the drain time (``due_outbox``): the batch is done."""
    return running == 0 and unfinished == 0 and due_outbox == 0


class Worker:
    """Claims jobs of ``profile.tool`` and runs ``argv`` once per job, ``concurrency`` at once.

    ``drain``: return once no job of the tool is queued or running. ``adopt_orphans``:
    reap zombies adopted as a child subreaper (set when the process is one).
    ``serve_http``: serve /metrics, /livez and /readyz on ``SIDECAR_HTTP_ADDR``.
    ``processes``: the process table of this process (``sidecar run``'s bootstrap makes
    the one that knows the subreaper and the guardian); None makes one of the Worker's
    own, no subreaper. The Worker owns its pool of kept work directories (``spares``),
    closed at its stop. ``sandbox``: how each attempt is wrapped in bubblewrap
    (sidecar.worker.isolation.check_sandbox); None runs the tools unsandboxed.
    """

    def __init__(self, settings: Settings, profile: LeaseProfile, dsn: str, argv: list[str],
                 concurrency: int = 1, drain: bool = False, adopt_orphans: bool = False,
                 owner_id: str | None = None, serve_http: bool = False,
                 cgroup_host: CgroupHost | None = None,
                 processes: ProcessTable | None = None,
                 sandbox: SandboxPlan | None = None):
        self.settings = settings
        # Each attempt's bubblewrap sandbox (bootstrap's check_sandbox); None: none.
        self.sandbox = sandbox
        # Where job cgroups go; the default (none) leaves rlimits and the psutil tree kill.
        self.cgroup_host = cgroup_host or CgroupHost(notes=("not detected",))
        self.profile = profile
        self.dsn = dsn
        self.argv = argv
        self.concurrency = concurrency
        self.drain = drain
        self.stop_reason: str | None = None  # why a stop was asked (request_stop)
        self._schema_checked = 0.0  # monotonic time of the last _check_schema
        self.adopt_orphans = adopt_orphans
        self.processes = processes if processes is not None else ProcessTable()
        self.spares = SparePool()
        # Each attempt's trace (issue 30); bootstrap's worker_step sets the SDK's when the
        # environment asks for traces (sidecar.ops.tracing.start).
        self.tracer: Tracer = OFF
        self.owner_id = owner_id or worker_identity(settings.worker_name)
        self.stopping = asyncio.Event()
        self.shutdown_kill = asyncio.Event()
        self.wake = asyncio.Event()
        self.channel = wake_channel(self.owner_id)
        self.cancel_channel = cancel_channel(self.owner_id)
        self._listening = False  # LISTEN on self.channel is up
        # The cancel check (_check_cancels) is owed once more after LISTEN came up or went
        # down (a cancel sent in between was heard by nobody); the event ends its wait.
        self._cancel_check_owed = False
        self._cancel_check_wake = asyncio.Event()
        self._idle_since: float | None = None  # monotonic time of our idle registration
        self._retry_at: float | None = None  # monotonic time a rate allows the next claim
        # The turn a rate gave this sidecar (monotonic): until then, a job's end does not
        # make it claim (it would only be held again); a NOTIFY does.
        self._rate_turn_at: float | None = None
        # Keyed by attempt, never by job id alone (case F14).
        self.running: dict[AttemptId, asyncio.Task] = {}
        self.failure: BaseException | None = None
        self.serve_http = serve_http and settings.http_addr != "off"
        self.labels = (profile.tool, profile.provider)
        self._background: list[asyncio.Task] = []
        self._writes: set[asyncio.Future] = set()  # journal writes in flight
        self._claim_unsettled = False  # a claim's answer was lost (F16)
        self._store: WorkerStore | None = None
        self.readiness = Readiness(expected_schema=migrations()[-1].version,
                                   db_fresh_seconds=max(10.0, 3 * settings.poll_seconds),
                                   draining=self.stopping.is_set)
        # The secrets this sidecar knows, scrubbed from all it writes from now on and
        # refused in results (issue 25); the guard adds each attempt's token.
        self._secret_keys = register_secrets(settings, dsn, ("worker", self.owner_id))

    def request_stop(self, reason: str = "requested") -> None:
        """First call: stop claiming and drain, logged as ``stop_requested`` with
        ``reason`` (a signal name, ``parent_died``). Second call: kill running children
        now."""
        if self.stopping.is_set():
            self.shutdown_kill.set()
        else:
            self.stop_reason = reason
            log.emit("stop_requested", tool=self.profile.tool, owner_id=self.owner_id,
                     reason=reason, running=len(self.running))
        self.stopping.set()
        self.wake.set()

    async def run(self) -> int:
        """Run until drained or stopped; return the process exit code (0 clean, 1 failure).

        Start-up and shutdown are pairs on one AsyncExitStack: the owner lock in the work
        root (it marks this sidecar's work directories and job cgroups as alive,
        sidecar.worker.leftovers), the pool, the HTTP endpoints, the guard and the background
        tasks. Whatever fails, at start or later, what was started is torn down in reverse
        order. Raises OSError when the work root is unusable, ConfigError when the HTTP
        address is taken, DatabaseUnavailable when the database cannot be reached."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start(stack)
                try:
                    await self._claim_loop(self._store, self._ctx)
                    await self._drain_running()
                    await asyncio.gather(*self._writes, return_exceptions=True)
                finally:
                    await self._stop_background()
            log.emit("worker_stopped", tool=self.profile.tool, owner_id=self.owner_id,
                     reason=repr(self.failure) if self.failure else None,
                     stop_reason=self.stop_reason or ("drained" if self.drain else None))
        finally:
            for key in self._secret_keys:
                SECRETS.discard(key)
        return 1 if self.failure else 0

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.settings.db_timeout_seconds
        work_root = self.settings.work_dir or tempfile.gettempdir()
        owner_lock = OwnerLock(work_root, self.owner_id)
        await loop.run_in_executor(None, owner_lock.acquire)
        stack.callback(owner_lock.release)
        # Last, while the owner lock still marks them ours: the work directories an
        # attempt could not remove (a sibling tool of its RUN_AS user kept writing into
        # one while it was emptied, case F15) go once no tool of ours runs any more.
        stack.callback(self._remove_own_leftovers, work_root)
        # The work directories kept for reuse (sidecar.worker.isolation); after this none more.
        stack.callback(self.spares.close)
        pool = await db.create_pool(self.dsn, timeout, max_size=self.concurrency + 2)
        stack.push_async_callback(lambda: asyncio.wait_for(pool.close(), timeout))
        store = WorkerStore(pool, timeout)
        self._store = store
        stack.push_async_callback(self._leave_idle_list)
        await store.migrate()
        await self._check_schema(store)
        # The profile's DEDUPE as the tool's default for enqueues naming no policy (issue 44)
        await store.set_dedupe_default(self.profile.tool,
                                       dedupe_window_seconds(self.profile.dedupe),
                                       self.owner_id)
        self.readiness.db_ok_at = time.monotonic()
        metrics.start_at_zero(*self.labels)
        http_addr = None
        if self.serve_http:
            try:
                http_runner, http_addr = await health.serve(
                    self.readiness, self.settings.http_addr,
                    next_free=self.settings.http_addr_is_default)
            except OSError as exc:
                more = getattr(exc, "ports_tried", 1) - 1
                tried = f" (and the next {more} port{'s' if more > 1 else ''})" if more else ""
                raise ConfigError(f"SIDECAR_HTTP_ADDR={self.settings.http_addr}{tried}: cannot "
                                  f"listen ({exc.strerror or exc}); give each sidecar in a pod "
                                  "its own port, or off") from None
            stack.push_async_callback(http_runner.stop)
            wanted = parsing.split_host_port(self.settings.http_addr)[1]
            if parsing.split_host_port(http_addr)[1] != wanted and wanted != 0:
                log.emit("http_port_moved", level="warning", tool=self.profile.tool,
                         wanted=self.settings.http_addr, http_addr=http_addr,
                         reason="the default port is taken (another sidecar in this pod?); "
                                "set SIDECAR_HTTP_ADDR per container so probes and scrapes "
                                "reach the sidecar they mean")
        keeper = LeaseKeeper(self.dsn, self.owner_id, self.profile, store, timeout)
        forwarder = Forwarder(store, self.settings, self.owner_id)
        # Any sidecar delivers any tool's rows; one whose tool forwards nothing leaves the
        # outage to claim_error instead of logging forward_error every poll (case F24).
        forwarder.log_errors = bool(self.profile.result_url)
        guard = GuardServer(store, self.profile, self.owner_id, attempts=self.concurrency)
        guard_url = await guard.start()
        stack.push_async_callback(guard.stop)
        if self.adopt_orphans:  # the last sweep, once every tool is gone
            stack.callback(self.processes.reap_adopted)
        # One attempt per slot set up ahead of its job (issue 42); discarded before the
        # spare directories are removed (the stack unwinds in reverse).
        warm = self.profile.process == "warm"
        preparer = Preparer(self.concurrency, lambda serial: prepare_attempt(self._ctx, serial),
                            discard_prepared) \
            if self.settings.prepare and not self.profile.run_as and not warm else None
        # PROCESS=warm (issue 43): jobs run in warm processes kept between jobs instead.
        warm_pool = WarmPool(
            self.profile,
            lambda serial, process_id: start_warm_process(self._ctx, serial, process_id),
            lambda process, reason: stop_warm_process(self._ctx, process, reason),
            lambda session, state, reason: self._end_session(store, session, state, reason),
            lambda tool, key: store.session_begin(
                tool, key, self.owner_id, self.profile.lease_seconds,
                self.profile.session_restart == "fresh"),
            store.session_call_queued, drain=self.drain) \
            if warm else None
        keeper.session_pool = warm_pool
        if warm_pool is not None:  # read at each scrape, never stale (issue 43)
            metrics.SESSIONS_HELD.labels(self.profile.tool, self.profile.provider) \
                .set_function(lambda: len(warm_pool.sessions))
        self._ctx = WorkerContext(store, keeper, self.profile, self.owner_id, self.argv,
                                  dict(os.environ), self.shutdown_kill, forwarder.wake,
                                  self.settings, guard, guard_url, self.cgroup_host,
                                  ClaimPause(on_end=self.wake.set),
                                  processes=self.processes, spares=self.spares,
                                  sandbox=self.sandbox, tracer=self.tracer,
                                  preparer=preparer, warm=warm_pool)
        if preparer is not None:
            stack.push_async_callback(preparer.close)
            preparer.fill()
        if warm_pool is not None:  # after every job's end: the idle processes go
            stack.push_async_callback(warm_pool.close)
        log.emit("worker_started", tool=self.profile.tool, owner_id=self.owner_id,
                 concurrency=self.concurrency, profile=self.profile.as_dict(),
                 http_addr=http_addr, guard_url=guard_url,
                 isolation=self.cgroup_host.describe(),
                 open_files_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                 sandbox="bwrap" if self.sandbox is not None else "off")
        self._background = [
            asyncio.create_task(keeper.run(), name="heartbeat"),
            asyncio.create_task(self._listen(), name="listen"),
            asyncio.create_task(self._check_cancels(), name="cancel-check"),
            asyncio.create_task(forwarder.run(), name="forwarder"),
            asyncio.create_task(health.watch_loop(self.readiness), name="loop-watch"),
            asyncio.create_task(retention.run_pruner(store, self.settings, self.profile.tool),
                                name="pruner")]
        if self.adopt_orphans:
            self._background.append(asyncio.create_task(self._reap_orphans(), name="reaper"))
        if warm_pool is not None:
            self._background.append(asyncio.create_task(warm_pool.run_idle(),
                                                        name="warm-idle"))
        if self.settings.leftover_sweep_seconds > 0:
            self._background.append(asyncio.create_task(self._sweep_leftovers(),
                                                        name="leftover-sweep"))
        for task in self._background:
            task.add_done_callback(self._background_done)
        stack.push_async_callback(self._stop_background)

    async def _end_session(self, store: WorkerStore, session, state: str,
                           reason: str) -> None:
        """Write the end of an agent session this sidecar holds (issue 43; ``state``
        ``ended`` or ``lost``), fenced by owner and generation, and log
        ``session_ended``. A database that does not answer is logged: the session's lease,
        renewed no more, runs out on its own and its next call finds it lost."""
        try:
            written = await store.end_session_if_owner(session.tool, session.key,
                                                       session.generation, self.owner_id,
                                                       state, reason)
        except (*db.DATABASE_ERRORS, TimeoutError) as exc:
            log.emit("session_ended", "warning", tool=session.tool, session=session.key,
                     generation=session.generation, state=state, reason=reason,
                     written=False, error=db.describe_error(exc))
            return
        log.emit("session_ended", "info" if state == "ended" else "warning",
                 tool=session.tool, session=session.key, generation=session.generation,
                 state=state, reason=reason, written=written)

    def _remove_own_leftovers(self, work_root: str) -> None:
        """Remove this sidecar's work directories that are still there at its end (each
        attempt removes its own; one fails when another process writes into it meanwhile,
        ``sandbox_left``). Runs after every attempt ended and every tree was killed: none of
        our tools can write into them any more. Each goes through the descriptor holding its
        lock (leftovers.remove_if_abandoned: no link followed); ``leftovers_removed`` counts
        them."""
        prefix = work_dir_prefix(self.owner_id)
        try:
            names = [e.name for e in os.scandir(work_root) if e.name.startswith(prefix)]
        except OSError:
            return
        removed = sum(remove_if_abandoned(os.path.join(work_root, name), min_age=0.0)
                      for name in names)
        if removed:
            log.emit("leftovers_removed", tool=self.profile.tool, count=removed,
                     reason="work directories of this sidecar's attempts that could not be "
                            "removed when they ended")

    async def _stop_background(self) -> None:
        """Cancel the background tasks (heartbeat, listener, forwarder, watchers, reaper)
        and wait for them; a second call finds nothing left to do."""
        tasks, self._background = self._background, []
        for task in tasks:
            task.remove_done_callback(self._background_done)
        # Cancelled again while any is left: on Python 3.11 an asyncio.wait_for whose inner
        # awaitable finishes as the cancellation arrives loses it (the listener, caught in
        # its LISTEN at start, went on listening and the stop waited for ever).
        pending = set(tasks)
        while pending:
            for task in pending:
                task.cancel()
            _done, pending = await asyncio.wait(pending, timeout=1.0)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _background_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        self.failure = task.exception() or RuntimeError(f"{task.get_name()} task ended")
        log.emit("worker_failed", "error", tool=self.profile.tool, reason=repr(self.failure),
                 task=task.get_name())
        self.stopping.set()
        self.shutdown_kill.set()
        self.wake.set()

    async def _claim_loop(self, store: WorkerStore, ctx: WorkerContext) -> None:
        tool, poll = self.profile.tool, self.settings.poll_seconds
        last_sweep = 0.0
        # This poll period's length (spread_period, issue 28): the first drawn over
        # [0.1, 1] x poll, so sidecars started together poll at spread phases at once;
        # each later one over [0.8, 1] x poll, so their phases keep drifting apart; one
        # that came later than that width (the host or the loop was paused, which puts a
        # fleet in step) over [0.1, 1] x poll again.
        interval, spread = poll, FIRST_POLL_SPREAD
        poll_due = False  # the last wait was ended by the poll's timer
        while not self.stopping.is_set():
            self.wake.clear()
            nothing_due = False
            try:
                since = time.monotonic() - last_sweep
                if poll_due or since >= interval:
                    poll_due = False
                    if last_sweep:
                        spread = spread_after(max(0.0, since - interval), poll, POLL_SPREAD)
                    last_sweep = time.monotonic()
                    interval = spread_period(poll, random.random(), spread)
                    # One statement a poll; the sweeps only on the fleet's turn, taken by
                    # one sidecar of the tool per poll period (issue 28).
                    sample = await store.sample_tool(tool, poll)
                    labelled(metrics.POLLS, *self.labels).inc()
                    # Nothing claimable by the database's count just now: the poll claims
                    # nothing (a job queued since sends its NOTIFY after this read).
                    nothing_due = sample["depth"] == 0
                    metrics.QUEUE_DEPTH.labels(*self.labels).set(sample["depth"])
                    metrics.QUEUE_AGE.labels(*self.labels).set(sample["queue_age"])
                    metrics.FORWARD_BACKLOG.labels(*self.labels).set(sample["forward_backlog"])
                    metrics.JOBS_WAITING_APPROVAL.labels(*self.labels).set(
                        sample["waiting_approval"])
                    self._sample_flow(sample if sample["has_flow"] else None)
                    if sample["sweep"]:
                        await self._sweep(store)
                    self.readiness.db_ok_at = time.monotonic()
                    if time.monotonic() - self._schema_checked >= health.SCHEMA_RECHECK_SECONDS:
                        await self._check_schema(store)  # a migration applied since (F24)
                if self._claim_unsettled:
                    await self._settle_claims(store)
                # ctx.claim_pause: an attempt met a shortage of the host (F19); its end
                # wakes this loop.
                # Before the turn a rate gave us, a job's end or a poll claims nothing.
                waiting_turn = (self._rate_turn_at is not None
                                and time.monotonic() < self._rate_turn_at)
                if not waiting_turn:
                    self._rate_turn_at = None
                if nothing_due and may_claim(len(self.running), self.concurrency,
                                             self.stopping.is_set(), 0.0):
                    await self._stay_idle(store)  # keeps its place on the idle list
                while not waiting_turn and not nothing_due and may_claim(
                        len(self.running), self.concurrency, self.stopping.is_set(),
                        ctx.claim_pause.remaining()):
                    sent = clock.ownership_now()  # the lease's local deadline (F20)
                    free = self.concurrency - len(self.running)
                    try:
                        # One statement for every free slot (issue 28).
                        jobs, held = await store.claim_many(
                            tool, self.owner_id, self.profile.lease_seconds, free,
                            self.profile.max_lifetime_seconds or None,
                            self.profile.max_attempts)
                    except db.UNAVAILABLE_ERRORS:
                        self._claim_unsettled = True  # it may have committed (F16)
                        raise
                    self.readiness.db_ok_at = time.monotonic()
                    # One count per claim statement, by what it did.
                    outcome = ("claimed" if jobs else
                               held.reason.value if held is not None else "empty")
                    labelled(metrics.CLAIM_ATTEMPTS, *self.labels, outcome).inc()
                    for job in jobs:
                        self._start_attempt(store, ctx, job, sent)
                    if held is not None:
                        # A flow limit holds the tool's jobs back (issue 27): a freed slot,
                        # a resume or a limit change wakes an idle sidecar; a rate's next
                        # token is waited for here.
                        if held.reason is Held.MORE_KEYS:
                            continue  # the walk of keys goes on in the next claim
                        if held.reason is Held.RATE and held.retry_in is not None:
                            self._rate_turn_at = time.monotonic() + held.retry_in
                        elif held.retry_in is not None:
                            self._retry_at = time.monotonic() + held.retry_in
                        await self._stay_idle(store)
                        break
                    if len(jobs) < free:
                        # Fewer than asked for: nothing more is claimable now.
                        await self._stay_idle(store)
                        break
                    if len(self.running) >= self.concurrency and self._idle_since is not None:
                        # Full now, and not by a wake-up (a waker takes us off the list
                        # itself): a wake-up sent to us would wait for a free slot.
                        self._idle_since = None
                        await store.unregister_idle(self.owner_id)
                if self.drain and not self.running and drained(
                        len(self.running), await store.unfinished_jobs(tool),
                        await store.due_outbox_rows(tool, self.settings.drain_seconds)):
                    log.emit("drained", tool=tool, owner_id=self.owner_id)
                    return
                # Until this poll period ends, not a whole period from now: a job's end
                # or another wake-up does not put the next poll off (whose lateness then
                # means a pause, spread_after).
                timeout = max(0.0, last_sweep + interval - time.monotonic())
            except db.DATABASE_ERRORS as exc:
                log.emit("claim_error", "warning", tool=tool, reason=db.describe_error(exc),
                         sqlstate=db.sqlstate(exc))
                timeout = interval  # a whole period before the next try
            # A wait the poll's timer ends polls, even a hair before the period's end by
            # the timer's rounding (uvloop's is whole milliseconds): it must count the
            # queue first, never claim blind.
            poll_timer = True
            turn_at = self._rate_turn_at
            if turn_at is None:
                turn_at, self._retry_at = self._retry_at, None
            if turn_at is not None and turn_at - time.monotonic() < timeout:
                timeout, poll_timer = max(0.0, turn_at - time.monotonic()), False
            if not self.wake.is_set():  # a job's end while claiming: claim again at once
                # asyncio.timeout, not wait_for: no task of its own per wake-up (issue 42).
                try:
                    async with asyncio.timeout(timeout):
                        await self.wake.wait()
                except TimeoutError:
                    poll_due = poll_timer

    def _start_attempt(self, store: WorkerStore, ctx: WorkerContext, job: ClaimedJob,
                       sent: float) -> None:
        """Supervise one claimed attempt: its lease held from ``sent`` (the monotonic time
        the claim was sent, F20), after any older attempt of the same job here is killed
        (F14); tracked in ``running`` by attempt until it ends."""
        labelled(metrics.JOBS_CLAIMED, *self.labels).inc()
        if job.reclaimed:
            labelled(metrics.JOBS_RECLAIMED, *self.labels).inc()
        predecessors = self._supersede(store, job)
        lease = ctx.keeper.hold(job, sent)
        supervisor = JobSupervisor(ctx, job, lease, predecessors,
                                   trace=ctx.tracer.attempt(job, sent))
        task = asyncio.create_task(supervisor.run())
        self.running[job.attempt_id] = task
        task.add_done_callback(lambda t, attempt=job.attempt_id: self._job_done(attempt, t))

    async def _sweep(self, store: WorkerStore) -> None:
        """The fleet's sweep, on this sidecar's turn: expired leases of the tool with no
        attempt left end failed (P16); jobs of any tool whose expiry passed before an
        attempt started end ``expired`` (issue 26; a job whose tool has no sidecar running
        expires too); live sessions of a warm tool whose lease ran out end lost (issue 43);
        callers' interests that ran out lapse and their calls stop (issue 44, any tool).
        Each logged. Raises what the store raises."""
        tool = self.profile.tool
        for row in await store.fail_exhausted_leases(tool):
            log.emit("job_failed", "warning", job_id=str(row["id"]), tool=tool,
                     fencing_token=row["fencing_token"],
                     reason=FailureKind.MAX_ATTEMPTS_EXCEEDED)
        for row in await store.fail_expired():
            metrics.JOBS_EXPIRED.labels(row["tool"]).inc()
            log.emit("job_expired", "warning", job_id=str(row["id"]), tool=row["tool"],
                     fencing_token=row["fencing_token"], attempt=row["attempt"],
                     reason=FailureKind.EXPIRED)
        if self.profile.process == "warm":  # only a warm tool has sessions (issue 43)
            for row in await store.lose_expired_sessions(tool):
                log.emit("session_ended", "warning", tool=tool, session=row["session_key"],
                         generation=row["generation"], state="lost",
                         reason=f"its lease ran out (held by {row['owner_id']})",
                         written=True)
        # Parked jobs whose approval got no answer in time (issue 44): of any tool.
        for row in await store.expire_parked_approvals():
            log.emit("approval_expired", "warning", job_id=str(row["id"]), tool=row["tool"],
                     fencing_token=row["fencing_token"], parked=True)
        # Calls nobody waits for any more (issue 44): of any tool, as expiries are.
        for row in await store.lapse_interests():
            log.emit("interest_lapsed", "warning", job_id=str(row["job_id"]), tool=row["tool"],
                     interest=row["interest_key"], previous_state=row["previous_state"])

    async def _settle_claims(self, store: WorkerStore) -> None:
        """Case F16: a claim whose answer was lost may have committed, leaving a job running
        under this sidecar's own owner id with no lease held here and no tool started. Once
        the database answers, every such job goes back to the queue without spending the
        attempt (journaled ``lease_released``, reason ``claim_answer_lost``) before anything
        else is claimed. Raises what the store raises (the claim loop retries)."""
        held = [*self.running, *self._ctx.keeper.abandoned]
        for row in await store.release_unheld_claims(self.profile.tool, self.owner_id, held):
            log.emit("claim_answer_lost", "warning", job_id=str(row["id"]),
                     tool=self.profile.tool, fencing_token=row["fencing_token"],
                     reason="the claim committed but its answer was lost; released "
                            "without spending the attempt")
        self._claim_unsettled = False

    async def _check_schema(self, store: WorkerStore) -> None:
        """Read the schema's version and whether this release may run on it (readiness)."""
        self.readiness.schema, self.readiness.schema_compatible = \
            await store.schema_compatibility(self.readiness.expected_schema)
        self._schema_checked = time.monotonic()

    def _sample_flow(self, row) -> None:
        """Publish the tool's flow control as read (issue 27; ``row`` from
        WorkerStore.sample_tool, None without flow control): gauges of its limits, running jobs
        and pause, and the detail /readyz shows."""
        tool = self.profile.tool
        limits = {"max_running": row and row["max_running"],
                  "max_running_per_key": row and row["max_running_per_key"],
                  "rate": row and row["rate_per_second"],
                  "rate_per_key": row and row["key_rate_per_second"]}
        for name, value in limits.items():
            if value is None:
                with contextlib.suppress(KeyError):
                    metrics.FLOW_LIMIT.remove(tool, name)
            else:
                metrics.FLOW_LIMIT.labels(tool, name).set(value)
        metrics.FLOW_PAUSED.labels(tool).set(1 if row and row["paused_at"] else 0)
        if row is None:
            self.readiness.flow = None
            return
        metrics.FLOW_RUNNING.labels(tool).set(row["running"])
        self.readiness.flow = {
            "paused": row["paused_at"] is not None,
            "pause_reason": row["pause_reason"],
            "max_running": row["max_running"],
            "max_running_per_key": row["max_running_per_key"],
            "rate": row["rate"], "rate_per_key": row["rate_per_key"], "burst": row["burst"],
            "running": row["running"]}

    async def _stay_idle(self, store: WorkerStore) -> None:
        """Room for a job and none to claim: be on the idle list, so the next job queued
        for the tool wakes this sidecar (or another idle one) and no other. Only while our
        own channel is listened to; refreshed every IDLE_REFRESH_SECONDS."""
        if not self._listening or self.stopping.is_set():
            return
        now = time.monotonic()
        if self._idle_since is not None and now - self._idle_since < IDLE_REFRESH_SECONDS:
            return
        await store.register_idle(self.owner_id, self.profile.tool, self.channel)
        if not self._listening:
            # The LISTEN connection was lost while we registered (its loss took us off
            # the list, perhaps before this registration landed): a wake-up sent to us
            # now would be lost.
            await store.unregister_idle(self.owner_id)
            return
        self._idle_since = now

    async def _leave_idle_list(self) -> None:
        """At stop: off the idle list, so no wake-up is sent to a sidecar that is gone,
        and out of the tool's rate turns, so no other sidecar waits for a turn it will not
        take (issue 27). Best effort: a dead sidecar's turn is dropped once overdue."""
        if self._store is None:
            return
        with contextlib.suppress(Exception):
            await self._store.unregister_idle(self.owner_id)
        if self._rate_turn_at is not None:
            with contextlib.suppress(Exception):
                await self._store.drop_rate_turns(self.profile.tool, self.owner_id)

    def _supersede(self, store: WorkerStore, job: ClaimedJob) -> list[asyncio.Task]:
        """This sidecar just claimed ``job`` anew (token N) while it still supervises an
        older attempt of it (an operator cancelled and retried it within a heartbeat, or
        its lease ran out here): each older attempt's lease is marked lost at once, its
        supervisor kills its tree, and the new attempt waits for those supervisors before
        it spawns (case F14). Logged and journaled as ``attempt_superseded`` on the old
        token. Returns the older attempts' tasks."""
        older = [(key, task) for key, task in self.running.items() if key.job_id == job.id]
        if not older:
            return []
        self._ctx.keeper.supersede(job)
        for key, _ in older:
            log.emit("attempt_superseded", "warning", job_id=str(job.id), tool=job.tool,
                     fencing_token=key.fencing_token, new_fencing_token=job.fencing_token,
                     reason="claimed anew by this sidecar; the older tree is killed first")
            self._background_write(store.record_event(
                job.id, key.fencing_token, "attempt_superseded",
                {"owner_id": self.owner_id, "new_fencing_token": job.fencing_token}))
        return [task for _, task in older]

    def _background_write(self, write) -> None:
        """Run a journal write without holding up the claim loop; a failure is logged."""
        def done(task: asyncio.Task) -> None:
            self._writes.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.emit("journal_error", "warning", tool=self.profile.tool,
                         reason=f"{type(task.exception()).__name__}")
        task = asyncio.ensure_future(write)
        self._writes.add(task)
        task.add_done_callback(done)

    def _job_done(self, attempt: AttemptId, task: asyncio.Task) -> None:
        self.running.pop(attempt, None)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.emit("supervisor_error", "error", job_id=str(attempt.job_id),
                     fencing_token=attempt.fencing_token, tool=self.profile.tool,
                     reason=f"{type(exc).__name__}: {exc}")
        self.wake.set()

    async def _drain_running(self) -> None:
        if not self.running:
            return
        log.emit("draining", tool=self.profile.tool, running=len(self.running),
                 drain_seconds=self.settings.drain_seconds)
        tasks = list(self.running.values())
        if not self.shutdown_kill.is_set():
            await asyncio.wait(tasks, timeout=self.settings.drain_seconds)
        self.shutdown_kill.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        """Wake the claim loop on a NOTIFY on this sidecar's own channel (sent to one idle
        sidecar per job queued, see ``_stay_idle``), and renew the leases at once on a
        NOTIFY on its cancel channel (``cancel_channel``: a job it runs was cancelled;
        logged as ``cancel_heard``), on a connection of its own
        (application_name ``sidecar-listen``), where ``db.listen_target`` says:
        SIDECAR_LISTEN_DATABASE_URL when set (a session: the server itself or a
        session-mode pool, even behind a transaction pooler), else the database's URL.

        Behind a transaction pooler (``SIDECAR_DATABASE_POOLER=transaction``) without
        SIDECAR_LISTEN_DATABASE_URL, LISTEN has no session to live in: no listener at all
        (``listen_disabled``), the claim loop polls every ``SIDECAR_POLL_SECONDS`` and
        ``_check_cancels`` stands in for the cancel channel. The task then just waits to be
        cancelled (a background task that returns counts as a failure of the worker).

        The first LISTEN logs ``listen_started``. When the connection fails or cannot be
        made, ``listen_lost`` (warning, once per outage, with the reason): the sidecar
        leaves the idle list (a wake-up sent to it would be lost), claims at once and then
        polls (``_check_cancels`` asks about cancels meanwhile); it connects again after
        LISTEN_RETRY_MIN_SECONDS, doubling to LISTEN_RETRY_MAX_SECONDS (``listen_error``
        at debug level for each further failure), and logs ``listen_restored`` with the
        outage's length once LISTEN is back. ``sidecar_listening`` is 1 while it listens,
        else 0.
        """
        tool = self.profile.tool
        settings = self.settings
        target = db.listen_target(self.dsn, settings.database_pooler,
                                  settings.listen_database_url)
        if target is None:
            log.emit("listen_disabled", tool=tool,
                     reason="SIDECAR_DATABASE_POOLER=transaction without "
                            "SIDECAR_LISTEN_DATABASE_URL: polling every "
                            f"{settings.poll_seconds:g} s instead of LISTEN, and checking "
                            f"every {CANCEL_CHECK_SECONDS:g} s whether a running job was "
                            "cancelled")
            await asyncio.Event().wait()
        listen_dsn, pooler = target
        via = ("SIDECAR_LISTEN_DATABASE_URL" if settings.listen_database_url
               else "SIDECAR_DATABASE_URL")
        where = db.describe_host(mask_url(listen_dsn))
        check = min(settings.poll_seconds, LISTEN_CHECK_SECONDS)

        def on_notify(_conn, _pid, _channel, _payload: str) -> None:
            self._idle_since = None  # the waker took us off the idle list
            self._rate_turn_at = None  # a resume or a limit change: claim at once
            self.wake.set()

        def on_cancel(_conn, _pid, _channel, payload: str) -> None:
            # A job we run was cancelled: renew now (a fenced statement), so its zero rows
            # stop the tree within about a second instead of at the next heartbeat.
            with contextlib.suppress(ValueError):
                if self._ctx.keeper.renew_soon(uuid.UUID(payload)):
                    log.emit("cancel_heard", tool=tool, job_id=payload, via="notify")

        lost_at: float | None = None  # monotonic start of the current outage
        off_list = True  # not on the idle list, or taken off since the last LISTEN
        started = False
        retry = LISTEN_RETRY_MIN_SECONDS
        while True:
            conn, up = None, False
            closed = asyncio.Event()
            try:
                conn = await db.connect(listen_dsn, settings.db_timeout_seconds, pooler=pooler,
                                        application_name=db.LISTEN_APPLICATION_NAME, setting=via)
                conn.add_termination_listener(lambda _conn, ended=closed: ended.set())
                # LISTEN is a round trip too: a path that went silent after the connect
                # must not hold the listener for good (it is retried like a failure).
                # asyncio.timeout, not wait_for: wait_for (3.11) can lose a cancellation.
                async with asyncio.timeout(settings.db_timeout_seconds):
                    await conn.add_listener(self.channel, on_notify)
                async with asyncio.timeout(settings.db_timeout_seconds):
                    await conn.add_listener(self.cancel_channel, on_cancel)
                self._set_listening(True)
                up, off_list = True, False
                self._idle_since = None  # (re-)register at the next empty claim
                self.wake.set()
                retry = LISTEN_RETRY_MIN_SECONDS
                if lost_at is not None:
                    log.emit("listen_restored", tool=tool, via=via, host=where,
                             down_s=round(time.monotonic() - lost_at, 3))
                elif not started:
                    log.emit("listen_started", tool=tool, via=via, host=where,
                             channel=self.channel)
                started, lost_at = True, None
                while not conn.is_closed():
                    # asyncio.timeout: wait_for (3.11) can lose the stopping cancellation.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(check):
                            await closed.wait()
                    if not conn.is_closed():
                        await conn.execute("SELECT 1", timeout=settings.db_timeout_seconds)
                raise ConnectionError("the server closed the LISTEN connection")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - polling keeps working meanwhile
                reason = db.describe_error(exc)
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.emit("listen_lost", "warning", tool=tool, via=via, host=where,
                             reason=reason, poll_seconds=settings.poll_seconds)
                else:
                    log.emit("listen_error", "debug", tool=tool, reason=reason)
            finally:
                self._set_listening(False)
                if conn is not None:
                    conn.terminate()
            if up:  # a wake-up may have been lost with the connection: claim now
                self._idle_since = None
                self.wake.set()
            if not off_list:
                off_list = await self._leave_idle_list_unheard()
            await asyncio.sleep(retry)
            retry = min(2 * retry, LISTEN_RETRY_MAX_SECONDS)

    def _set_listening(self, up: bool) -> None:
        """Whether LISTEN on our channel is up: ``_stay_idle`` registers only then, and
        ``sidecar_listening`` says it. A change owes one cancel check at once (a cancel
        NOTIFY sent while the connection went down or before the LISTEN took hold was
        heard by nobody)."""
        if up != self._listening:
            self._cancel_check_owed = True
            self._cancel_check_wake.set()
        self._listening = up
        metrics.LISTENING.labels(*self.labels).set(1 if up else 0)

    async def _leave_idle_list_unheard(self) -> bool:
        """LISTEN is down: off the idle list, so no wake-up is sent where nobody hears it
        (the waker would spend it on us, and the job would wait for someone's poll). True
        when done; False when the database did not answer (tried again at the next retry
        of the listener; the wake-up function skips a place not refreshed for two
        minutes anyway). Best effort: no failure of it ends the listener (it once did,
        with asyncpg's InternalClientError from a pool connection the same outage broke,
        and took the worker and its running tools down with it)."""
        if self._store is None:
            return True
        try:
            await self._store.unregister_idle(self.owner_id)
        except Exception as exc:  # noqa: BLE001 - any failure: tried again next retry
            log.emit("listen_error", "debug", tool=self.profile.tool,
                     reason=db.describe_error(exc))
            return False
        return True

    async def _check_cancels(self) -> None:
        """Stand in for the cancel channel while this sidecar cannot hear it: every
        CANCEL_CHECK_SECONDS (drawn between 0.8 and 1 of it), while LISTEN is not up
        (``listen_disabled`` behind a transaction pooler, or between ``listen_lost`` and
        ``listen_restored``) and leases are held, one read-only statement asks which of its
        running jobs were cancelled (LeaseKeeper.check_cancels); for each, the leases are
        renewed at once, the cancelled one gets zero rows and its tree dies by the same
        path as on a NOTIFY (logged ``cancel_heard`` with ``via`` ``check``). Once more
        right after LISTEN comes up or goes down (``_set_listening``). Nothing to do when the
        heartbeat is no longer than the check. A failed check (any error; the heartbeat
        stays the fallback) is logged once per episode as ``cancel_check_error`` and tried
        again at the next period. The periodic service ``cancel_check``
        (sidecar.ops.periodic)."""
        tool = self.profile.tool
        failing = False

        async def step() -> None:
            nonlocal failing
            owed, self._cancel_check_owed = self._cancel_check_owed, False
            if (self._listening and not owed) \
                    or self.profile.heartbeat_seconds <= CANCEL_CHECK_SECONDS:
                return
            try:
                found = await self._ctx.keeper.check_cancels()
            except BaseException:
                self._cancel_check_owed = self._cancel_check_owed or owed
                raise
            failing = False
            for job_id in found:
                log.emit("cancel_heard", tool=tool, job_id=str(job_id), via="check")

        def once_per_episode(exc: BaseException) -> dict[str, str] | None:
            nonlocal failing
            if failing:
                return None
            failing = True
            return {"reason": db.describe_error(exc)}

        await Periodic("cancel_check", CANCEL_CHECK_SECONDS, step, spread=POLL_SPREAD,
                       wake=self._cancel_check_wake, errors=(Exception,),
                       error_event="cancel_check_error", fields={"tool": tool},
                       error_fields=once_per_episode).run()

    async def _sweep_leftovers(self) -> None:
        """Every SIDECAR_LEFTOVER_SWEEP_SECONDS, clear what sidecars of this work root that
        died left behind (sidecar.worker.leftovers.sweep_dead_owners): a sidecar SIGKILLed together
        with its guardian leaves its tools running at most that long (F24). A failed sweep
        (any error: a sweep never takes the worker down) is logged as
        ``leftover_sweep_error`` and tried again at the next period. The periodic service
        ``leftover_sweep`` (sidecar.ops.periodic)."""
        loop = asyncio.get_running_loop()
        work_root = self.settings.work_dir or tempfile.gettempdir()

        async def sweep() -> None:
            swept = await loop.run_in_executor(None, sweep_dead_owners, work_root,
                                               self.cgroup_host.parents)
            if swept:
                log.emit("leftovers_removed", tool=self.profile.tool, count=swept,
                         reason="job cgroups and work directories of sidecars that died")

        await Periodic("leftover_sweep", self.settings.leftover_sweep_seconds, sweep,
                       errors=(Exception,), error_event="leftover_sweep_error",
                       fields={"tool": self.profile.tool},
                       error_fields=lambda exc: {
                           "reason": f"{type(exc).__name__}: {exc}"[:200]}).run()

    async def _reap_orphans(self) -> None:
        """Reap adopted zombies now and every second (ProcessTable.reap_adopted), off the
        loop: it scans /proc and waits for a spawn in progress to be recorded. The
        periodic service ``orphan_reaper`` (sidecar.ops.periodic); an error ends it, and with
        it the worker."""
        loop = asyncio.get_running_loop()

        async def reap() -> None:
            await loop.run_in_executor(None, self.processes.reap_adopted)

        await Periodic("orphan_reaper", 1.0, reap, first=0, errors=()).run()


def install_signal_handlers(worker: Worker, parent_pid: int | None = None) -> None:
    """SIGTERM and SIGINT: drain (a second one kills at once). ``parent_pid``: the parent
    whose death sends SIGTERM (PR_SET_PDEATHSIG), or None when none was asked for; a
    SIGTERM after that parent is gone is logged as ``parent_died`` with its pid, so every
    drain says why (case F24)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGTERM and parent_pid is not None and os.getppid() != parent_pid:
            if not worker.stopping.is_set():
                log.emit("parent_died", "warning", tool=worker.profile.tool,
                         owner_id=worker.owner_id, old_parent_pid=parent_pid,
                         new_parent_pid=os.getppid())
            worker.request_stop("parent_died")
        else:
            worker.request_stop(sig.name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
