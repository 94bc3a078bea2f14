"""What every supervisor of one sidecar shares: its ``WorkerContext``. A module of its own
so the supervisor and the fenced commit both import it, neither importing the other."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar.ops.tracing import OFF, Tracer
from sidecar.protocol.model import LeaseProfile
from sidecar.protocol.shortage import ClaimPause
from sidecar.runtime.config import Settings
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker.cgroups import CgroupHost
from sidecar.worker.child import ProcessTable
from sidecar.worker.isolation import SandboxPlan, SparePool
from sidecar.worker.lease import LeaseKeeper

if TYPE_CHECKING:
    from sidecar.worker.guard import GuardServer
    from sidecar.worker.prepared import Preparer
    from sidecar.worker.warm import WarmPool


@dataclass(frozen=True)
class WorkerContext:
    """What every supervisor of one sidecar shares."""

    store: WorkerStore
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
    # Set by an attempt that met a shortage of the host; the claim loop waits it out (F19).
    claim_pause: ClaimPause = field(default_factory=ClaimPause)
    # The process table (the process's, from the Worker) and the Worker's kept work
    # directories: every attempt's Child and Sandbox use these.
    processes: ProcessTable = field(default_factory=ProcessTable)
    spares: SparePool = field(default_factory=SparePool)
    # How each attempt is wrapped in bubblewrap (sidecar.worker.isolation.check_sandbox at
    # start); None: attempts run unsandboxed (SANDBOX=off, or auto where it cannot work).
    sandbox: SandboxPlan | None = None
    # Attempts prepared ahead of their jobs (sidecar.worker.prepared); None: each is set
    # up when its job is claimed (SIDECAR_PREPARE=false, RUN_AS).
    preparer: Preparer | None = None
    # Each attempt's trace (issue 30): sidecar.ops.tracing.OFF unless OTEL_* asks for traces.
    tracer: Tracer = OFF
    # PROCESS=warm (issue 43): the idle warm processes jobs run in; None: per-job.
    warm: WarmPool | None = None
