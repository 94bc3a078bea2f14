"""14. The MCP gateway (issue 29, point 7): a no-op tool call through ``sidecar mcp``
against the same call made with the Python client, and the gateway's memory.

Round trip: one MCP client session (the official SDK's ``mcp.Client`` over Streamable
HTTP, a bearer token) is opened once and reused; each call is ``tools/call`` of a no-op
tool, timed from the client's request to its result. The gateway enqueues one job, waits
for it (sidecar.client.Client.follow: a NOTIFY on the job's channel) and returns its
result. The baseline is the same call made by the Python client in the bench's process
(``sidecar.client.Client.call``: enqueue, then wait without polling). Both are served by
one real ``sidecar run`` of the tool ``/bin/cat`` (the result is the payload ``{"n": i}``,
checked), on the same database; the two take turns call by call, 20-100 ms apart, so the
machine's noise falls on both (as section 11).

Memory and connections: the gateway's resident set (psutil, the process and any children)
idle, then while N calls (1,000 by default) are in flight at once in the same session.
Those calls are of a second tool whose sidecar starts only after the measurement, so every
call is queued and waited for by the gateway until then; the in-flight figure is read once
the database shows N jobs queued. Meanwhile the database's server sessions are counted
(pg_stat_activity of its database, every 0.1 s): all the calls share the gateway's one
LISTEN connection and its pool (issue 41), so they stay within the sessions before the
calls plus GATEWAY_CONNECTIONS. Then the sidecar runs them and every result is checked
(none lost).

Skipped, with one "n/a" row, where the ``mcp`` extra is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import secrets
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import asyncpg
import psutil

from bench.common import (
    BenchError,
    Context,
    Sidecar,
    free_port,
    ms,
    percentile,
    progress,
    sidecar_env,
    until,
)
from bench.report import Row

SECTION = "14"
NOOP, HELD = "mcp-noop", "mcp-held"
# A pending task is a job row, nothing in the gateway: its memory must not grow with them.
TASK_KIB_TARGET = 4.0
CAT = ["/bin/cat"]
WARM_UP = 2  # calls of each side not measured (connections, prepared statements, imports)
P50_TARGET = 1.5
PRINCIPAL = "bench"
# What the section needs besides the bench's own packages: the [mcp] extra.
NEEDED = ("mcp", "uvicorn", "starlette", "jsonschema")
QUEUED = "SELECT count(*) FROM tool_jobs WHERE tool = $1 AND state = 'queued'"
SESSIONS = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
# The most server connections a gateway holds, whatever the calls it waits for: its
# client's pool (sidecar.client.Client's max_connections, 4) + the hub's LISTEN connection
# (docs/mcp.md, "Connections").
GATEWAY_CONNECTIONS = 4 + 1
# The calls in flight are sent this many at a time, each wave queued before the next.
RAMP = 100


def missing_packages() -> list[str]:
    """The packages of the ``[mcp]`` extra this interpreter cannot import."""
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def rss(pid: int) -> int:
    """Resident bytes of the process ``pid`` and its children."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for kid in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += kid.memory_info().rss
    return total


async def rss_settled(pid: int, samples: int = 5, interval: float = 0.1) -> int:
    """The largest of a few readings of ``rss`` ``interval`` seconds apart."""
    best = 0
    for _ in range(samples):
        best = max(best, rss(pid))
        await asyncio.sleep(interval)
    return best


def kib(n_bytes: float) -> str:
    return f"{n_bytes / 1024:,.0f} KiB"


class GatewayProcess:
    """A ``sidecar mcp --listen`` process serving NOOP and HELD on a free loopback port,
    with a bearer token of its own; its stderr goes to a log file."""

    def __init__(self, ctx: Context, dsn: str, max_calls: int, name: str = "mcp-gateway"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.token = secrets.token_hex(24)
        tokens = ctx.tmp / f"{name}.tokens"
        tokens.write_text(f"{PRINCIPAL} {self.token}\n")
        tokens.chmod(0o600)
        self.log_path = ctx.tmp / f"{name}.log"
        env = sidecar_env(
            dsn, SIDECAR_MCP_TOKEN_FILE=str(tokens),
            SIDECAR_PROFILE_MCP_NOOP_MCP_DESCRIPTION="No-op: returns its arguments.",
            SIDECAR_PROFILE_MCP_HELD_MCP_DESCRIPTION="No-op: returns its arguments.")
        argv = [sys.executable, "-m", "sidecar", "mcp", "--listen", f"127.0.0.1:{self.port}",
                "--tool", NOOP, "--tool", HELD, "--max-calls-per-principal", str(max_calls),
                "--max-tasks-per-principal", str(ctx.mode.mcp_tasks + 8)]
        self.proc = ctx.popen(argv, env=env, log=self.log_path)
        self.pid = self.proc.pid

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def _live(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/livez",
                                        timeout=1) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    async def ready(self, timeout: float = 30.0) -> None:
        """Until ``GET /livez`` answers 200; BenchError if the process exits first."""
        async def live() -> bool:
            if self.proc.poll() is not None:
                raise BenchError(f"sidecar mcp exited ({self.proc.returncode}): {self.tail()}")
            return await asyncio.to_thread(self._live)

        await until(live, timeout, interval=0.05, what="sidecar mcp to serve /livez")

    @contextlib.asynccontextmanager
    async def session(self, connections: int):
        """An open MCP client session over Streamable HTTP with the token, its HTTP client
        allowed ``connections`` connections at once (the SDK's default client: 100)."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

        http = httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
            limits=httpx2.Limits(max_connections=connections,
                                 max_keepalive_connections=connections))
        async with http, Client(streamable_http_client(self.url, http_client=http)) as client:
            yield client

    @contextlib.asynccontextmanager
    async def tasks_session(self):
        """An MCP client session that declares the Tasks extension (sidecar.mcp.tasks):
        tools/call answers with a task handle at once."""
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        from sidecar.mcp.tasks import TasksExtension

        http = create_mcp_http_client(headers={"Authorization": f"Bearer {self.token}"})
        async with http, Client(streamable_http_client(self.url, http_client=http),
                                extensions=[TasksExtension()]) as client:
            yield client

    async def stop(self) -> None:
        import kit

        await asyncio.to_thread(kit.stop_process, self.proc, 10)


def _check(n: int, result: Any, who: str) -> None:
    if result != {"n": n}:
        raise BenchError(f"{who} call {n} returned {result!r}, not {{'n': {n}}}")


async def mcp_call(session: Any, tool: str, n: int) -> float:
    """One ``tools/call`` through the gateway, request to result; seconds."""
    started = time.perf_counter()
    result = await session.call_tool(tool, {"n": n})
    elapsed = time.perf_counter() - started
    if result.is_error:
        text = result.content[0].text if result.content else ""
        raise BenchError(f"MCP call {n} of {tool} is an error: {text[:200]}")
    _check(n, result.structured_content, "MCP")
    return elapsed


async def client_call(client: Any, n: int) -> float:
    """The same call by ``sidecar.client.Client.call``; seconds."""
    started = time.perf_counter()
    result = await client.call(NOOP, {"n": n}, timeout=30)
    elapsed = time.perf_counter() - started
    _check(n, result, "Client.call")
    return elapsed


async def round_trips(ctx: Context, gateway: GatewayProcess, session: Any,
                      calls: int) -> dict[str, list[float]]:
    """``calls`` round trips through the gateway and as many by Client.call, taking turns
    (each side first in turn) after WARM_UP unmeasured of each; seconds by side."""
    from sidecar.client import Client
    from sidecar.runtime.config import load_settings

    out: dict[str, list[float]] = {"mcp": [], "client": []}
    sides = list(out)
    # The Python client with the settings a sidecar of the bench gets (no SIDECAR_* of
    # ours), as the gateway's own Client has.
    settings = load_settings(sidecar_env(ctx.dsn))
    async with Client(ctx.dsn, settings=settings) as client:
        for n in range(WARM_UP + calls):
            for side in sides[n % 2:] + sides[:n % 2]:
                await asyncio.sleep(random.uniform(0.02, 0.1))
                took = await (mcp_call(session, NOOP, n) if side == "mcp"
                              else client_call(client, n))
                if n >= WARM_UP:
                    out[side].append(took)
    if gateway.proc.poll() is not None:
        raise BenchError(f"sidecar mcp exited ({gateway.proc.returncode}): {gateway.tail()}")
    return out


async def in_flight(ctx: Context, dsn: str, conn: asyncpg.Connection,
                    gateway: GatewayProcess, session: Any, calls: int) -> dict[str, Any]:
    """The gateway's RSS idle, then with ``calls`` calls of HELD in flight at once (no
    sidecar of HELD yet: each is queued and waited for); then a sidecar runs them and
    each result is checked. Bytes, and how long the calls took to be in flight."""
    idle = await rss_settled(gateway.pid)
    before = await conn.fetchval(SESSIONS)
    most = before
    started = time.perf_counter()
    tasks: list[asyncio.Task] = []
    sc = None
    try:
        async def all_waiting() -> bool:
            nonlocal most
            most = max(most, await conn.fetchval(SESSIONS))
            for task in tasks:
                if task.done():
                    task.result()  # raises what the call raised
                    raise BenchError("an MCP call of the held tool ended before its "
                                     f"sidecar started: {task.result()!r:.200}")
            if gateway.proc.poll() is not None:
                raise BenchError(f"sidecar mcp exited ({gateway.proc.returncode}): "
                                 f"{gateway.tail()}")
            return await conn.fetchval(QUEUED, HELD) == len(tasks)

        # Sent in waves of RAMP (each wave queued before the next is sent): the row is
        # about calls waiting at once, not about a thousand requests in one instant on
        # two cores shared with the bench's own client.
        for first in range(0, calls, RAMP):
            tasks += [asyncio.create_task(session.call_tool(HELD, {"n": n}))
                      for n in range(first, min(calls, first + RAMP))]
            await until(all_waiting, 120, what=f"{len(tasks)} MCP calls to wait on their "
                                               "jobs")
        settled = time.perf_counter() - started
        busy = await rss_settled(gateway.pid)
        for _ in range(10):  # every call waiting: the sessions a while longer
            most = max(most, await conn.fetchval(SESSIONS))
            await asyncio.sleep(0.1)
        sc = Sidecar(ctx, "mcp-held", HELD, CAT, 8, dsn=dsn)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if sc is not None:
            await sc.stop()
    for n, result in enumerate(results):
        if result.is_error:
            raise BenchError(f"held MCP call {n} is an error: {result.content!r:.200}")
        _check(n, result.structured_content, "held MCP")
    return {"idle": idle, "busy": busy, "calls": calls, "settled": settled,
            "sessions_before": before, "sessions_most": most}


async def pending_tasks(ctx: Context, dsn: str, gateway: GatewayProcess,
                        count: int) -> dict[str, Any]:
    """The gateway's RSS idle, then with ``count`` tasks of HELD pending (created one
    after another with the Tasks extension; no sidecar of HELD runs them); each task read
    back with tasks/get, then all cancelled. Bytes and seconds."""
    from sidecar.client import Client
    from sidecar.mcp.tasks import get_task

    idle = await rss_settled(gateway.pid)
    started = time.perf_counter()
    async with gateway.tasks_session() as client:
        handles = [await client.session.call_tool(HELD, {"n": n}, allow_claimed=True)
                   for n in range(count)]
        created = time.perf_counter() - started
        busy = await rss_settled(gateway.pid)
        for handle in handles[:: max(1, count // 20)]:
            task = await get_task(client.session, handle.task_id)
            if task["status"] != "working":
                raise BenchError(f"pending task {handle.task_id}: {task!r:.200}")
    async with Client(dsn) as caller:
        cancelled = await caller.cancel(tag={"mcp.principal": PRINCIPAL, "mcp.kind": "task"})
    if len(cancelled) != count:
        raise BenchError(f"{count} pending tasks, {len(cancelled)} cancelled")
    return {"idle": idle, "busy": busy, "count": count, "created": created}


@contextlib.asynccontextmanager
async def serving(ctx: Context, dsn: str, max_calls: int, name: str):
    """A sidecar of NOOP (concurrency 1, as section 11's) and a gateway on ``dsn``; yields
    the gateway, stops both afterwards."""
    sc = Sidecar(ctx, f"{name}-noop", NOOP, CAT, 1, dsn=dsn)
    gateway = GatewayProcess(ctx, dsn, max_calls, name)
    try:
        await sc.ready()
        await gateway.ready()
        yield gateway
    finally:
        await gateway.stop()
        await sc.stop()


async def warm(session: Any) -> None:
    """WARM_UP calls through the gateway, not measured."""
    for n in range(WARM_UP):
        await mcp_call(session, NOOP, n)


async def memory_elsewhere(ctx: Context, need: int, calls: int) -> dict[str, Any]:
    """The in-flight measurement on an embedded PostgreSQL of the bench's own allowing
    ``need`` connections (this server allows too few), with a gateway of its own."""
    from bench.fleet import _roomy_server

    async with _roomy_server(ctx, need) as (dsn, _admin, roomy, _monitor), \
            serving(ctx, dsn, calls + 8, "mcp-gateway-roomy") as gateway, \
            gateway.session(calls + 8) as session:
        await warm(session)
        return await in_flight(ctx, dsn, roomy, gateway, session, calls)


async def run(ctx: Context, conn: asyncpg.Connection) -> list[Row]:
    """Section 14's rows: p50 and p99 of the gateway's round trip against Client.call, and
    the gateway's RSS idle and with calls in flight; one n/a row without the extra."""
    missing = missing_packages()
    if missing:
        why = (f"n/a: the [mcp] extra is not installed ({', '.join(missing)} missing; "
               "pip install -e '.[mcp]')")
        progress(f"gateway: not measured, {why}")
        return [Row(SECTION, "MCP gateway round trip p50, no-op tool: not measured", why,
                    "Client.call", "-", f"p50 ≤ {P50_TARGET:g} × Client.call", None)]
    mode = ctx.mode
    calls, flying = mode.mcp_calls, mode.mcp_in_flight
    progress(f"gateway: {calls} MCP calls and as many Client.call, taking turns; "
             f"then {flying} MCP calls in flight at once")
    allowed = await conn.fetchval("SELECT current_setting('max_connections')::int - "
                                  "current_setting('superuser_reserved_connections')::int")
    in_use = await conn.fetchval("SELECT count(*) FROM pg_stat_activity")
    # The gateway's pool and LISTEN connection (GATEWAY_CONNECTIONS, however many calls
    # wait), the sidecars' (about 4 each), ours and slack.
    need = in_use + GATEWAY_CONNECTIONS + 24
    here = need <= allowed
    memory = None
    async with serving(ctx, ctx.dsn, flying + 8, "mcp-gateway") as gateway, \
            gateway.session(flying + 8) as session:
        trips = await round_trips(ctx, gateway, session, calls)
        tasks = await pending_tasks(ctx, ctx.dsn, gateway, mode.mcp_tasks)
        if here:
            memory = await in_flight(ctx, ctx.dsn, conn, gateway, session, flying)
    if memory is None:
        ctx.notes.append(f"{SECTION}: {flying} MCP calls in flight need about {need} "
                         f"connections and this server allows {allowed}, so the memory "
                         "figures come from a second gateway on a second embedded PostgreSQL "
                         f"of the bench's own (same binaries, same machine) with "
                         f"max_connections = {need + 20}")
        memory = await memory_elsewhere(ctx, need + 20, flying)
    ctx.count("MCP gateway calls and their Client.call baseline",
              2 * (WARM_UP + calls) + flying + (0 if here else WARM_UP))

    gw, base = trips["mcp"], trips["client"]
    g50, g99 = percentile(gw, 50), percentile(gw, 99)
    b50, b99 = percentile(base, 50), percentile(base, 99)
    idle, busy = memory["idle"], memory["busy"]
    per_call = (busy - idle) / memory["calls"]
    task_bytes = max(0, tasks["busy"] - tasks["idle"]) / tasks["count"]
    rows = [
        Row(SECTION, "MCP gateway round trip p50, no-op tool (tools/call to result, one "
            "session, calls one after another)", ms(g50), f"Client.call {ms(b50)}",
            f"{g50 / b50:.2f} × Client.call", f"p50 ≤ {P50_TARGET:g} × Client.call",
            g50 <= P50_TARGET * b50),
        Row(SECTION, "MCP gateway round trip p99, same calls", ms(g99),
            f"Client.call {ms(b99)}", f"{g99 / b99:.2f} × Client.call"),
        Row(SECTION, f"MCP gateway RSS with {memory['calls']} calls in flight at once, "
            "per call in flight", f"{kib(per_call)} per call ({busy / 1048576:.1f} MiB "
            "in all)", f"idle {idle / 1048576:.1f} MiB", f"{busy / idle:.2f} × idle"),
        Row(SECTION, f"MCP gateway RSS with {tasks['count']} tasks pending at once (Tasks "
            "extension), per task", f"{kib(task_bytes)} per task "
            f"({tasks['busy'] / 1048576:.1f} MiB in all)",
            f"idle {tasks['idle'] / 1048576:.1f} MiB; created in {tasks['created']:.1f} s",
            f"{tasks['busy'] / tasks['idle']:.2f} × idle",
            f"≤ {TASK_KIB_TARGET:g} KiB per pending task", task_bytes <= TASK_KIB_TARGET * 1024),
        Row(SECTION, f"{memory['calls']} MCP calls waiting at once on one gateway: the "
            "database's server sessions, most seen (every result then checked: none lost)",
            f"{memory['sessions_most']} "
            f"({memory['sessions_most'] - memory['sessions_before']:+d})",
            f"{memory['sessions_before']} before the calls", "-",
            f"≤ before + {GATEWAY_CONNECTIONS} (the gateway's pool + 1)",
            memory["sessions_most"] - memory["sessions_before"] <= GATEWAY_CONNECTIONS),
    ]
    ctx.settings.append(
        f"{SECTION}: `sidecar mcp --listen 127.0.0.1:PORT --tool {NOOP} --tool {HELD} "
        f"--max-calls-per-principal {flying + 8}` (one bearer token), tool `/bin/cat` "
        f"(result = arguments `{{\"n\": i}}`, checked) served by one sidecar at "
        f"concurrency 1 (default profile); one MCP client session (mcp.Client over "
        f"Streamable HTTP, its HTTP client allowed {flying + 8} connections) reused for "
        f"every call; {len(gw)} MCP calls and {len(base)} sidecar.client.Client.call "
        f"(timeout 30 s, in the bench's process) of the same tool taking turns 20-100 ms "
        f"apart after {WARM_UP} unmeasured of each; RSS (psutil, the gateway and its "
        f"children, the largest of 5 readings 0.1 s apart) idle after the calls, then with "
        f"{memory['calls']} calls of `{HELD}` in flight in the same session (sent {RAMP} at "
        f"a time, each wave queued before the next; no sidecar of "
        f"it until read: each call queued and waited for, all on the gateway's one LISTEN "
        f"connection), in flight {memory['settled']:.2f} s after the first was sent, the "
        f"database's sessions (pg_stat_activity) counted meanwhile every 0.1 s; then one "
        f"sidecar at concurrency 8 ran them, each result checked"
        + f"; then {tasks['count']} tasks of `{HELD}` created one after another in a "
        "session declaring the Tasks extension (sidecar.mcp.tasks), RSS read with all of "
        "them pending, every twentieth read back with tasks/get, then all cancelled by tag"
        + ("" if here else "; the RSS on a second gateway and embedded PostgreSQL "
           f"(max_connections {need + 20}) after {WARM_UP} warm-up calls"))
    return rows

