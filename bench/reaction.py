"""4. Reaction times, with the short profile (L = 3 s, H = 0.5 s, kill grace 1 s):

- lease lost to a takeover (the bench moves the row to another owner and token, as a
  second sidecar's claim would) and to a cancel (``cancel_job``, what ``sidecar cancel``
  runs), to the child's whole tree dead;
- stage deadline to tree dead, for a tree that ignores SIGTERM;
- sidecar SIGKILL to its tree dead, and to the job re-claimed by a second sidecar.

A tree is ``sh -c 'sleep 600 & sleep 600 & wait'`` (three processes). "Dead" is when the
last of its pidfds becomes readable (the process exited), watched on this event loop.
Baselines: the bench killing the same tree itself (SIGTERM to its process group; for the
stubborn tree SIGTERM, the same grace, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import select
import signal
import subprocess
import time
import uuid

import asyncpg
import psutil

from bench.common import (
    SHORT_PROFILE,
    BenchError,
    Context,
    Sidecar,
    enqueue_one,
    ms,
    percentile,
    progress,
    until,
)
from bench.report import Row
from sidecar.storage.queries import Q

TREE = ["/bin/sh", "-c", "sleep 600 & sleep 600 & wait"]
STUBBORN = ["/bin/sh", "-c", "trap '' TERM; sleep 600 & sleep 600 & wait"]
H = float(SHORT_PROFILE["SIDECAR_HEARTBEAT_SECONDS"])
L = float(SHORT_PROFILE["SIDECAR_LEASE_SECONDS"])
GRACE = float(SHORT_PROFILE["SIDECAR_KILL_GRACE_SECONDS"])


class TreeWatch:
    """Watches processes through pidfds; ``dead`` resolves to the monotonic time at which
    the last one exited."""

    def __init__(self, pids: list[int]):
        self.loop = asyncio.get_running_loop()
        self.dead: asyncio.Future[float] = self.loop.create_future()
        self.fds: set[int] = set()
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            self.fds.add(fd)
            self.loop.add_reader(fd, self._exited, fd)
        if not self.fds:
            self.dead.set_result(time.monotonic())

    def _exited(self, fd: int) -> None:
        now = time.monotonic()
        self.loop.remove_reader(fd)
        os.close(fd)
        self.fds.discard(fd)
        if not self.fds and not self.dead.done():
            self.dead.set_result(now)

    def close(self) -> None:
        for fd in self.fds:
            self.loop.remove_reader(fd)
            os.close(fd)
        self.fds.clear()


def _tree_of(root: psutil.Process) -> list[int] | None:
    try:
        kids = root.children(recursive=True)
    except psutil.Error:
        return None
    return [root.pid, *(k.pid for k in kids)] if len(kids) >= 2 else None


async def _running_tree(sc: Sidecar) -> list[int]:
    async def tree():
        for child in sc.tool_children():
            pids = _tree_of(child)
            if pids:
                return pids
        return None

    return await until(tree, 30, interval=0.01, what=f"the tool tree of {sc.name}")


async def _enqueue(conn: asyncpg.Connection, tool: str, max_attempts: int = 1) -> uuid.UUID:
    return await enqueue_one(conn, tool, max_attempts=max_attempts, details={})


async def _idle(sc: Sidecar) -> None:
    async def no_tool():
        return not sc.tool_children()

    await until(no_tool, 30, what=f"{sc.name} to finish its job")


async def lease_lost(conn: asyncpg.Connection, sc: Sidecar, how: str) -> float:
    """One takeover or cancel; seconds from our write to the tree dead."""
    job_id = await _enqueue(conn, sc.tool)
    watch = TreeWatch(await _running_tree(sc))
    try:
        await asyncio.sleep(random.uniform(0, H))
        if how == "takeover":
            await conn.execute(
                "UPDATE tool_jobs SET owner_id = 'bench-thief', fencing_token = fencing_token "
                "+ 1, lease_until = now() + interval '1 hour' WHERE id = $1", job_id)
        else:
            await conn.fetch(Q["cancel_job"], job_id, None, None)
        t0 = time.monotonic()
        dead = await asyncio.wait_for(watch.dead, H + GRACE + 10)
    finally:
        watch.close()
    await conn.execute("UPDATE tool_jobs SET state = 'cancelled', finished_at = now(), "
                       "lease_until = NULL WHERE id = $1 AND state = 'running'", job_id)
    await _idle(sc)
    return dead - t0


async def stage_deadline(ctx: Context, conn: asyncpg.Connection, sc: Sidecar,
                         timeout: float) -> float:
    job_id = await _enqueue(conn, sc.tool)
    watch = TreeWatch(await _running_tree(sc))
    try:
        dead = await asyncio.wait_for(watch.dead, timeout + GRACE + 15)
        dead_wall = time.time() - (time.monotonic() - dead)
    finally:
        watch.close()
    started = await conn.fetchval(
        "SELECT extract(epoch FROM at)::float8 FROM tool_job_events WHERE job_id = $1 AND "
        "event = 'tool_request_started'", job_id)
    await _idle(sc)
    return dead_wall - (started - ctx.clock_offset + timeout)


async def reclaim(ctx: Context, conn: asyncpg.Connection, pair: list[Sidecar],
                  trial: int) -> tuple[float, float, float, Sidecar]:
    """SIGKILL the sidecar that holds the job. Returns (seconds to its tree dead, seconds
    to the re-claim by the other, lease left at the kill), and the survivor."""
    job_id = await _enqueue(conn, pair[0].tool, max_attempts=3)  # a second attempt is due

    async def owner():
        return await conn.fetchval("SELECT owner_id FROM tool_jobs WHERE id = $1 AND "
                                   "state = 'running'", job_id)

    owner_id = await until(owner, 30, what="the job claimed")
    owners = {(await sc.wait_event("worker_started"))["owner_id"]: sc for sc in pair}
    victim = owners[owner_id]
    survivor = next(sc for sc in pair if sc is not victim)
    watch = TreeWatch(await _running_tree(victim))
    try:
        await asyncio.sleep(random.uniform(0, H))
        lease_until = await conn.fetchval("SELECT extract(epoch FROM lease_until)::float8 FROM "
                                          "tool_jobs WHERE id = $1", job_id)
        victim.proc.kill()
        killed, killed_wall = time.monotonic(), time.time()
        dead = await asyncio.wait_for(watch.dead, 10)
    finally:
        watch.close()
    victim.proc.wait()

    async def reclaimed():
        return await conn.fetchval(
            "SELECT extract(epoch FROM at)::float8 FROM tool_job_events WHERE job_id = $1 "
            "AND event = 'job_claimed' AND (details->>'reclaimed')::bool", job_id)

    at = await until(reclaimed, L + 30, interval=0.02, what="the job re-claimed")
    await conn.fetch(Q["cancel_job"], job_id, None, None)
    await _idle(survivor)
    killed_db = killed_wall + ctx.clock_offset
    return dead - killed, at - killed_db, lease_until - killed_db, survivor


def _bare_kill(tree: list[str], grace: float | None) -> float:
    """The bench kills the same tree itself: SIGTERM to its group (then, for a stubborn
    tree, SIGKILL after ``grace``); seconds to the last process gone (pidfds)."""
    proc = subprocess.Popen(tree, start_new_session=True)
    fds: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while (pids := _tree_of(psutil.Process(proc.pid))) is None:
            if time.monotonic() > deadline:
                raise BenchError("the bare tree did not start")
            time.sleep(0.005)
        fds = [os.pidfd_open(pid) for pid in pids]
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        if grace is not None:
            time.sleep(grace)
            os.killpg(proc.pid, signal.SIGKILL)
        left = set(fds)
        while left:
            ready = poller.poll(10_000)
            if not ready:
                raise BenchError("the bare tree survived its kill for 10 s")
            for fd, _ in ready:
                poller.unregister(fd)
                left.discard(fd)
        return time.monotonic() - t0
    finally:
        for fd in fds:
            os.close(fd)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _summary(values: list[float]) -> str:
    return f"p50 {ms(percentile(values, 50))}, max {ms(max(values))} (n = {len(values)})"


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    trials, poll = ctx.mode.reaction_trials, ctx.mode.poll_seconds
    env = {**SHORT_PROFILE, "SIDECAR_POLL_SECONDS": f"{poll:g}"}
    loop = asyncio.get_running_loop()
    bare_term = await loop.run_in_executor(None, _bare_kill, TREE, None)
    bare_stubborn = await loop.run_in_executor(None, _bare_kill, STUBBORN, GRACE)

    stage_timeout = 1.0
    # All four sidecars start together (start-up is slow on a busy machine).
    sc = Sidecar(ctx, "reaction", "react", TREE, 1, **env)
    stubborn = Sidecar(ctx, "stubborn", "stubborn", STUBBORN, 1,
                       **{**env, "SIDECAR_STAGE_TIMEOUT_SECONDS": f"{stage_timeout:g}"})
    pair = [Sidecar(ctx, f"reclaim-{i}", "reclaim", TREE, 1, **env) for i in range(2)]
    await asyncio.gather(*(p.ready() for p in (sc, stubborn, *pair)))

    progress(f"reaction: {trials} takeovers, {trials} cancels")
    takeovers = [await lease_lost(conn, sc, "takeover") for _ in range(trials)]
    cancels = [await lease_lost(conn, sc, "cancel") for _ in range(trials)]
    await sc.stop()

    progress(f"reaction: {trials} stage deadlines of a tree ignoring SIGTERM")
    deadlines = [await stage_deadline(ctx, conn, stubborn, stage_timeout)
                 for _ in range(trials)]
    await stubborn.stop()

    progress(f"reaction: {ctx.mode.kill_trials} sidecar SIGKILLs")
    tree_dead, reclaimed, floors = [], [], []
    for trial in range(ctx.mode.kill_trials):
        dead, again, floor, survivor = await reclaim(ctx, conn, pair, trial)
        tree_dead.append(dead)
        reclaimed.append(again)
        floors.append(floor)
        if trial + 1 < ctx.mode.kill_trials:
            fresh = Sidecar(ctx, f"reclaim-{trial + 2}", "reclaim", TREE, 1, **env)
            await fresh.ready()
            pair = [survivor, fresh]
    for p in pair:
        await p.stop()
    ctx.count("reaction jobs", 3 * trials + 2 * ctx.mode.kill_trials)

    limit = H + GRACE + 0.2
    ctx.settings.append(
        f"reaction: short profile L = {L:g} s, H = {H:g} s, kill grace {GRACE:g} s, "
        f"poll {poll:g} s; stage deadline {stage_timeout:g} s; the tree is "
        "`sh -c 'sleep 600 & sleep 600 & wait'` (with `trap '' TERM` for the stubborn one); "
        "takeovers and SIGKILLs at a random phase of the heartbeat")
    return [
        Row("4", "lease lost (takeover) → tree dead", _summary(takeovers),
            f"next heartbeat ≤ H = {ms(H)}, then bare SIGTERM of the tree {ms(bare_term)}",
            f"max {max(takeovers) / limit:.2f} × target",
            f"≤ H + grace + 0.2 s = {limit:g} s", max(takeovers) <= limit),
        Row("4", "lease lost (cancel) → tree dead", _summary(cancels),
            f"next heartbeat ≤ H = {ms(H)}, then bare SIGTERM of the tree {ms(bare_term)}",
            f"max {max(cancels) / limit:.2f} × target",
            f"≤ H + grace + 0.2 s = {limit:g} s", max(cancels) <= limit),
        Row("4", "stage deadline → tree dead (tree ignores SIGTERM)", _summary(deadlines),
            f"bare SIGTERM, grace, SIGKILL {ms(bare_stubborn)}",
            f"{percentile(deadlines, 50) / bare_stubborn:.2f} × bare"),
        Row("4", "sidecar SIGKILL → its tool tree dead", _summary(tree_dead),
            f"bare SIGTERM of the tree {ms(bare_term)}",
            f"{percentile(tree_dead, 50) / bare_term:.1f} × bare"),
        Row("4", "sidecar SIGKILL → job re-claimed by another sidecar", _summary(reclaimed),
            f"lease left at the kill {_summary(floors).split(' (')[0]}, + poll ≤ {poll:g} s "
            f"(expect ≤ L + poll = {L + poll:g} s)",
            f"max {max(reclaimed) / (L + poll):.2f} × (L + poll)"),
    ]
