"""``sidecar run`` from its arguments to a running Worker, in named steps (as tini's
``main`` reads).

``check_run_args`` is the argument check: it changes nothing and returns a RunConfig or
raises UsageError with one line. ``run`` is the bootstrap, one function per step:

1. *parse and configure signals*: done by ``cli.main`` before this module is reached
   (the inherited signal state is reset before any thread exists, case F10);
   ``tracing_step``: whether OTEL_* asks for traces, and the ``[otel]`` extra is there
   when it does (a refusal, exit 2, before anything changes);
2. ``host_step`` (cgroups): detect the cgroup host and check the profile and the work
   root against it; every refusal (exit 2) comes here, before anything process-wide
   changes;
3. ``non_dumpable_step``: the database URL leaves the environment, the process becomes
   non-dumpable (a tool of our uid reads neither our environ nor our memory);
4. ``subreaper_step``: become the child subreaper and make the process table
   (ProcessTable) of the process, saying so (``subreaper_unavailable``) when the kernel
   refuses;
5. ``parent_death_step`` (signals): drain when our parent dies (F8), unless the launcher
   ignored SIGHUP (F24);
6. ``worker_step``: the Worker (and its tracer, issue 30), leftovers of dead sidecars
   swept, the guardian started, then the claim loop until drained or stopped; the last
   spans are exported at the end.

The order is the one ``sidecar run`` always had: the cgroup checks, which may refuse
to start, come first, so a refused start changes nothing in the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
from dataclasses import dataclass

from sidecar.ops import tracing
from sidecar.protocol.errors import ConfigError, UsageError
from sidecar.protocol.model import LeaseProfile
from sidecar.runtime.config import Settings, validate_tool_name
from sidecar.runtime.log import log
from sidecar.runtime.loop import run_async
from sidecar.storage import db
from sidecar.worker import cgroups, guardian, isolation, leftovers, linux
from sidecar.worker.child import ProcessTable

# Programs that run another program: their name says nothing about the tool.
INTERPRETER = re.compile(r"(python|pypy|node|nodejs|deno|bun|perl|ruby|php|java|bash|sh|dash"
                         r"|zsh|env|exec|nice|timeout|xvfb-run|Rscript|lua)[0-9.]*")


@dataclass(frozen=True)
class RunConfig:
    """What ``sidecar run`` was asked to do, checked: the tool's name and lease profile,
    the command (``argv[0]`` resolved to an absolute path as the user meant it, against
    our own directory and PATH), ``concurrency`` (jobs at once, 1 or more), ``drain``
    (exit 0 once nothing of the tool is queued or running), and the signal state the
    launcher left (``inherited_signals``, e.g. ``"SIGHUP:ignored"``, from
    ``linux.reset_inherited_signal_state``)."""

    tool: str
    profile: LeaseProfile
    argv: list[str]
    concurrency: int
    drain: bool
    inherited_signals: tuple[str, ...] = ()


def check_run_args(command: list[str], tool: str | None, concurrency: int, drain: bool,
                   settings: Settings, inherited_signals: list[str] | None = None
                   ) -> RunConfig:
    """The arguments of ``sidecar run`` checked, as a RunConfig. Changes nothing; looks the
    command up on PATH (``shutil.which``). Raises UsageError (one line, exit 2) for no
    command, a command that starts with an interpreter and no ``--tool``, an invalid tool
    name, a concurrency below 1, or a command that is not an executable file; ConfigError
    for an invalid profile of the tool."""
    if not command:
        raise UsageError("give the tool command after '--', e.g. sidecar run -- /usr/bin/ocr")
    program = os.path.basename(command[0])
    if tool is None and INTERPRETER.fullmatch(program):
        # `run -- python3 script.py` would silently serve jobs of a tool named "python3".
        raise UsageError(f"the command starts with the interpreter {program!r}; name the "
                         f"tool it runs with --tool, e.g. sidecar run --tool ocr -- "
                         f"{' '.join(command[:2])}")
    tool = validate_tool_name(tool or program)
    profile = settings.profile(tool)
    if concurrency < 1:
        raise UsageError(f"--concurrency {concurrency}: must be 1 or more")
    # The tool starts in its work directory with an allow-listed PATH: resolve the command
    # here, against our own directory and PATH, as the user meant it.
    found = shutil.which(command[0])
    if found is None:
        # Refused here, not at the first job: a typo would otherwise fail the whole queue
        # of the tool as spawn_failed within a second.
        where = "" if os.sep in command[0] else f" on PATH ({os.environ.get('PATH', '')})"
        raise UsageError(f"command {command[0]!r} does not exist or is not an "
                         f"executable file{where}; fix the command after '--'")
    return RunConfig(tool, profile, [os.path.abspath(found), *command[1:]], concurrency,
                     drain, tuple(inherited_signals or ()))


# --- the steps ----------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """What the cgroup step found: the cgroup host and the work root (a directory), and
    the sandbox each attempt runs in (None: none, ``sandbox_off`` says why)."""

    cgroups: cgroups.CgroupHost
    work_root: str
    sandbox: isolation.SandboxPlan | None = None
    sandbox_off: str = ""


def host_step(config: RunConfig, settings: Settings) -> Host:
    """Detect the cgroup host; refuse a profile it cannot enforce and an unusable work
    root; give the sidecar itself the tool's rlimits where it can (so tools start by
    vfork), and its soft RLIMIT_NOFILE raised to the hard limit (issue 25: the guard's
    descriptor reserve is counted below it; tools inherit it unless the profile's
    OPEN_FILES sets theirs); probe the bubblewrap sandbox once (``SANDBOX``: ``auto`` goes
    on without it and warns ``sandbox_unavailable`` with the reason; with it, logs
    ``sandbox_hides``: the host paths its tools cannot see and how to bind inputs).
    Raises ConfigError
    (exit 2) for what it refuses, ``SANDBOX=required`` where the sandbox cannot work
    included."""
    host = cgroups.detect(settings.cgroups)
    isolation.check_profile(config.profile, host)
    isolation.share_limits(config.profile)
    work_root = isolation.check_work_dir(settings, config.profile)
    linux.raise_open_files_limit()
    plan, off = isolation.check_sandbox(settings, config.profile, work_root, config.argv)
    if plan is None and config.profile.network == "none":
        # NETWORK=none is the namespace sandbox's: without it the tool would share the
        # host's network, a setting dropped in silence (issue 41, point 1's kind).
        raise ConfigError(f"SIDECAR_NETWORK=none for tool {config.tool!r} needs the "
                          f"namespace sandbox, unavailable here ({off}); install bubblewrap "
                          "or allow user namespaces, or set NETWORK=host")
    if plan is None and config.profile.sandbox == "auto":
        log.emit("sandbox_unavailable", "warning", tool=config.tool, reason=off,
                 effect="attempts run without the namespace sandbox: they see what the "
                        "sidecar's user sees (docs/isolation.md)")
    if plan is not None:
        # Once at start: what a tool given an input path there will not find (issue 41).
        log.emit("sandbox_hides", tool=config.tool, hidden=isolation.hidden_paths(plan),
                 bound=[f"{path}:{mode}" for path, mode in plan.extra_paths],
                 effect="a tool given a path under these (e.g. an input in the system "
                        "temporary directory) finds nothing there",
                 hint=isolation.BIND_HINT)
    return Host(host, work_root, plan, off)


def non_dumpable_step(settings: Settings) -> str:
    """Resolve the database URL and return it. It (and SIDECAR_LISTEN_DATABASE_URL) is in
    memory now: a tool of our own uid must not find it, not in our environment (what
    later children inherit), and not through /proc/<pid>/environ or mem, which
    non-dumpable closes (the initial environment block stays in memory). Raises
    ConfigError for a URL of a bad scheme."""
    dsn = db.resolve_dsn(settings)
    os.environ.pop("SIDECAR_DATABASE_URL", None)
    os.environ.pop("SIDECAR_LISTEN_DATABASE_URL", None)
    linux.make_undumpable()
    return dsn


def subreaper_step(tool: str) -> ProcessTable:
    """Become the adopter of orphaned descendants (PR_SET_CHILD_SUBREAPER) and return the
    process table of this process. When the kernel refuses, logs
    ``subreaper_unavailable`` (warning) and goes on without: the tree kill then finds
    escapees by session and environment cookie in a scan of every process on the host,
    and orphans are reaped by PID 1."""
    adopt = linux.set_child_subreaper()
    if not adopt:
        code = ctypes.get_errno()
        log.emit("subreaper_unavailable", "warning", tool=tool,
                 errno=errno.errorcode.get(code) if code else None,
                 reason="prctl(PR_SET_CHILD_SUBREAPER) failed: orphaned tool processes go "
                        "to PID 1, and every tree kill scans every process on the host")
    return ProcessTable(subreaper=adopt)


def parent_death_step(config: RunConfig) -> tuple[bool, int | None]:
    """Drain if our own parent dies (an entrypoint shell that took the SIGTERM meant for
    us, case F8) -- unless the launcher ignored SIGHUP (nohup, a daemonizing script): it
    asked us to outlive it, and a parent-death drain would stop the sidecar the moment
    the script ends (F24). Returns ``(go_on, parent_pid)``: ``go_on`` is False when the
    parent died already (logged ``parent_died``; exit 0); ``parent_pid`` is the parent
    whose death sends SIGTERM, or None."""
    parent: int | None = os.getppid()
    if "SIGHUP:ignored" in config.inherited_signals:
        log.emit("parent_death_drain_off", tool=config.tool, parent_pid=parent,
                 reason="the launcher ignored SIGHUP (nohup): the sidecar outlives it")
        return True, None
    linux.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        log.emit("parent_died", "warning", tool=config.tool, old_parent_pid=parent,
                 new_parent_pid=os.getppid(), reason="before the sidecar started")
        return False, parent
    return True, parent


def tracing_step() -> bool:
    """Whether the OTEL_* variables ask for traces (sidecar.ops.tracing.asked); when they do,
    the ``[otel]`` extra is imported now. Imports nothing of OpenTelemetry otherwise.
    Raises ConfigError (exit 2, one line) for an exporter or protocol the extra does not
    bring, or when the extra is missing (issue 30)."""
    traced = tracing.asked(os.environ)
    if traced:
        tracing.implementation()
    return traced


def worker_step(config: RunConfig, settings: Settings, host: Host, dsn: str,
                processes: ProcessTable, parent: int | None, traced: bool = False) -> int:
    """Make the Worker (with the SDK's tracer when ``traced``), sweep what sidecars that
    died here left (ours will be, however we die: the worker holds its owner lock while
    it runs; the guardian clears after it), start the guardian, and run the worker until
    drained or stopped; then export the spans still queued (at most
    tracing.FLUSH_SECONDS). Returns the exit code (0 clean, 1 failure)."""
    from sidecar.worker.claim_loop import Worker, install_signal_handlers

    worker = Worker(settings, config.profile, dsn, config.argv, config.concurrency,
                    config.drain, adopt_orphans=processes.subreaper, serve_http=True,
                    cgroup_host=host.cgroups, processes=processes, sandbox=host.sandbox)
    if traced:
        worker.tracer = tracing.start(os.environ, worker.owner_id, config.tool)
    swept = leftovers.sweep_dead_owners(host.work_root, host.cgroups.parents)
    if swept:
        log.emit("leftovers_removed", tool=config.tool, count=swept,
                 reason="job cgroups and work directories of sidecars that died")
    keeper = guardian.start(worker.owner_id, host.work_root, host.cgroups.parents)
    processes.exempt(keeper.pid)
    if config.inherited_signals:
        log.emit("inherited_signal_state_reset", "warning",
                 signals=list(config.inherited_signals),
                 reason="the launcher blocked or ignored signals the sidecar and its "
                        "tools need (case F10)")

    async def go():
        install_signal_handlers(worker, parent)
        return await worker.run()

    try:
        return run_async(settings, go())
    finally:
        keeper.stdin.close()
        worker.tracer.shutdown()


def run(config: RunConfig, settings: Settings) -> int:
    """The bootstrap of ``sidecar run`` (see the module): each step in order; returns the
    process exit code. Raises SidecarError subclasses (one line, their exit code) for a
    refused start."""
    traced = tracing_step()
    host = host_step(config, settings)
    dsn = non_dumpable_step(settings)
    processes = subreaper_step(config.tool)
    go_on, parent = parent_death_step(config)
    if not go_on:
        return 0
    return worker_step(config, settings, host, dsn, processes, parent, traced)
