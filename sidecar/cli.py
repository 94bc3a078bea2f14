"""The ``sidecar`` command: argument parsing, and errors mapped to one line and an exit code.

Data goes to stdout as JSON; messages and events go to stderr. Exit codes: 0 success,
1 environment problem (database unreachable, schema older than this sidecar or missing:
run ``sidecar migrate``, job not found), 2 bad input or configuration;
``wait`` (and ``enqueue --wait``) also 3 when a job waited for ended failed or cancelled,
4 when the timeout passed first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC
from pathlib import Path
from typing import Any, TypeVar

import orjson

from sidecar import __version__
from sidecar.protocol import enqueue_args, jsontext, parsing
from sidecar.protocol.errors import (
    ConfigError,
    DatabaseUnavailable,
    IdempotencyConflict,
    SidecarError,
    UsageError,
)
from sidecar.protocol.masking import mask_url
from sidecar.protocol.model import FINISHED_STATES, JobState, RawJson, tool_env_key
from sidecar.runtime import log as log_mod
from sidecar.runtime.config import (
    GLOBAL_FIELDS,
    MAX_ATTEMPTS_LIMIT,
    MAX_SECONDS,
    Settings,
    default_data_dir,
    load_settings,
    register_secrets,
    validate_tool_name,
)
from sidecar.runtime.loop import run_async
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.operator_store import OperatorStore
from sidecar.storage.store import StoreBase, check_producer_key
from sidecar.worker import linux

# Plain strings: argparse shows choices with repr() in its errors.
STATES = tuple(state.value for state in JobState)
# How many known tools `pause` names when it refuses a tool never seen.
KNOWN_TOOLS_SHOWN = 20
# How often `retry` looks again for the acknowledgement of a cancel (case F14).
RETRY_ACK_POLL_SECONDS = 0.2
# `wait`: a job waited for ended failed or cancelled; the timeout passed first.
EXIT_JOB_FAILED = 3
EXIT_TIMEOUT = 4
# The store a command opens: the one of its audience (sidecar.storage.store).
S = TypeVar("S", bound=StoreBase)


class OutputClosed(SidecarError):
    """Standard output was closed before a command's whole output was written."""


def write_stdout(data: bytes) -> None:
    """Write all of ``data`` to standard output or raise OutputClosed: a partial write
    is never taken for a whole one, and a descriptor left non-blocking (an event loop may
    set O_NONBLOCK on a pipe it shares) is waited on instead of cut at the pipe's 64 KiB.
    Bypasses sys.stdout's buffers (flushed first), so PYTHONUNBUFFERED changes nothing."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (stdout redirected in-process)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    view = memoryview(data)
    try:
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                select.select([], [fd], [])
                continue
            view = view[written:]
    except BrokenPipeError:
        raise OutputClosed(f"standard output was closed after {len(data) - len(view)} of "
                           f"{len(data)} bytes; the output is incomplete") from None


def _print_json(value: Any) -> None:
    write_stdout(jsontext.dumps(value, option=orjson.OPT_APPEND_NEWLINE, other_as_str=True))


def _print_lines(lines: list[str]) -> None:
    write_stdout("".join(f"{line}\n" for line in lines).encode())


@asynccontextmanager
async def open_store(settings: Settings, kind: type[S],
                     dsn: str | None = None) -> AsyncIterator[S]:
    """A store of ``kind`` (the command's audience: CallerStore for enqueue, wait and
    cancel, OperatorStore for the operator's commands) on a small pool: the schema is
    checked once and never changed (SchemaMismatch, exit 1, when it is older than this
    sidecar or missing: only ``sidecar migrate`` and ``sidecar run`` migrate)."""
    from sidecar.storage import schema

    dsn = dsn or db.resolve_dsn(settings)
    # What the command shows of stored rows is scrubbed of the secrets it knows, in rows
    # written before scrubbing existed too (issue 41; the store's reads are ``shown``).
    register_secrets(settings, dsn, "cli")
    pool = await db.create_pool(dsn, settings.db_timeout_seconds, max_size=2)
    try:
        store = kind(pool, settings.db_timeout_seconds)
        await schema.require_current(store)
        yield store
    finally:
        await pool.close()


def _job_id(text: str) -> uuid.UUID:
    """A JOB_ID argument (sidecar.protocol.parsing.parse_job_id); UsageError (exit 2) otherwise."""
    return parsing.parse_job_id(text, "JOB_ID")


# --- commands -----------------------------------------------------------------


def cmd_migrate(args, settings: Settings) -> int:
    async def go():
        dsn = db.resolve_dsn(settings)
        pool = await db.create_pool(dsn, settings.db_timeout_seconds, max_size=1)
        try:
            store = OperatorStore(pool, settings.db_timeout_seconds)
            applied, defined = await store.upgrade()
            out = {"applied": applied, "definitions": defined,
                   "version": await store.schema_version()}
            if args.worker_role or args.scaler_role or args.caller_role or args.web_role:
                await store.grant_roles(args.worker_role, args.scaler_role, args.caller_role,
                                        args.web_role)
                out["granted"] = {"worker": args.worker_role, "scaler": args.scaler_role,
                                  "caller": args.caller_role, "web": args.web_role}
            return out
        finally:
            await pool.close()

    _print_json(run_async(settings, go()))
    return 0


def _read_payload(args, limit: int) -> tuple[Any, bytes]:
    """The payload's value and bytes; at most ``limit`` bytes (0 = any) are accepted, and
    no more than one byte past it is ever read (SIDECAR_MAX_PAYLOAD_BYTES)."""
    if args.payload is not None and args.payload_file is not None:
        raise UsageError("give --payload or --payload-file, not both")
    if args.payload_file is not None:
        try:
            if args.payload_file == "-":
                raw = sys.stdin.buffer.read(limit + 1) if limit else sys.stdin.buffer.read()
            else:
                with open(args.payload_file, "rb") as f:
                    raw = f.read(limit + 1) if limit else f.read()
        except OSError as exc:
            raise UsageError(f"--payload-file {args.payload_file}: cannot read it "
                             f"({exc.strerror or exc})") from None
        source = f"--payload-file {args.payload_file}"
    elif args.payload is not None:
        raw, source = args.payload.encode("utf-8", "surrogateescape"), "--payload"
    else:
        raw, source = b"{}", "--payload"
    if limit and len(raw) > limit:
        raise UsageError(f"{source}: the payload is larger than SIDECAR_MAX_PAYLOAD_BYTES="
                         f"{limit} bytes; pass a reference (a URL or object key) instead, "
                         "or raise that limit")
    try:
        return jsontext.loads(raw, bounded=True), raw
    except jsontext.NumberOutOfRange as exc:
        raise UsageError(f"{source}: {exc}") from None
    except ValueError as exc:  # orjson.JSONDecodeError, or text that is not UTF-8
        raise UsageError(f"{source} is not valid JSON ({exc}); pass one JSON value, "
                         "for example --payload '{\"path\": \"/etc/hosts\"}'") from None


def _tags(args) -> dict[str, str] | None:
    """The ``--tag KEY=VALUE`` filters of a group action, None when none is given."""
    return enqueue_args.parse_tags(args.tag) or None if args.tag else None


def _tags_text(tags: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in tags.items())


def cmd_enqueue(args, settings: Settings) -> int:
    tool = validate_tool_name(args.tool)
    options = enqueue_args.enqueue_options(args.priority, args.run_after, args.expires_in,
                                           args.tag, args.traceparent, args.tracestate,
                                           args.concurrency_key, session=args.session,
                                           dedupe=args.dedupe, interest=args.interest)
    payload, raw = _read_payload(args, settings.max_payload_bytes)
    # None: the profile (MAX_ATTEMPTS) of the sidecar that claims the job decides.
    max_attempts = enqueue_args.check_max_attempts(args.max_attempts)
    if args.idempotency_key is not None:
        key = enqueue_args.check_idempotency_key(args.idempotency_key)
        check_producer_key(key)  # ':stage:N' keys belong to next stages (case F22)
    # mcp.* tags and mcp: keys are sidecar mcp's (issue 41 point 2)
    enqueue_args.refuse_reserved(options.tags, args.idempotency_key, enqueue_args.CLI_NAMES)

    # The text as given, validated: jsonb keeps every number exactly, where a round trip
    # through Python floats would not (12345678901234567890123 stays an integer).
    text = RawJson(raw.decode("utf-8"))

    timeout = _wait_timeout(args)
    if timeout is not None and not args.wait:
        raise UsageError("--timeout bounds --wait; give --wait too")
    if args.progress and not args.wait:
        raise UsageError("--progress prints the reports --wait follows; give --wait too")

    async def go():
        async with open_store(settings, CallerStore) as store:
            try:
                job_id, created = await store.enqueue(
                    tool, None if payload is None else text, args.idempotency_key,
                    max_attempts, {"by": "sidecar enqueue"}, options)
            except IdempotencyConflict as exc:
                # The database names its argument; the user gave the option.
                raise IdempotencyConflict(str(exc).replace(
                    "idempotency_key ", "--idempotency-key ", 1)) from None
            _print_json({"id": job_id, "created": created})
            if not args.wait:
                return 0
            return await _wait(settings, store, [job_id], timeout=timeout,
                               progress=args.progress)

    return run_async(settings, go())


def _wait_timeout(args) -> float | None:
    """``--timeout DURATION`` in seconds (more than 0), None when not given."""
    if args.timeout is None:
        return None
    return parsing.parse_duration(args.timeout, "--timeout", MAX_SECONDS, positive=True)


# ``wait --tag``: the most jobs one waiter follows (each is one LISTEN on its connection).
MAX_WAIT_JOBS = 1000


def cmd_wait(args, settings: Settings) -> int:
    """``sidecar wait JOB_ID...|--tag K=V``: block until the jobs end (the first with
    ``--any``), printing each as one JSON line; exit 0, EXIT_JOB_FAILED or EXIT_TIMEOUT.
    ``--tag`` waits for every job carrying all the tags when the command starts (at most
    MAX_WAIT_JOBS: more is a UsageError; none is JobNotFound, exit 1)."""
    if bool(args.job_id) == bool(args.tag):
        raise UsageError("give JOB_ID..., or --tag KEY=VALUE (repeatable) for every job "
                         "with those tags")
    job_ids = list(dict.fromkeys(_job_id(text) for text in args.job_id))
    tags = _tags(args)
    timeout = _wait_timeout(args)

    async def go():
        async with open_store(settings, CallerStore) as store:
            ids = job_ids
            if tags:
                rows = await store.list_jobs(None, None, MAX_WAIT_JOBS + 1, tags)
                if not rows:
                    from sidecar.client.waiting import JobNotFound

                    raise JobNotFound(f"no job has the tags {_tags_text(tags)}")
                if len(rows) > MAX_WAIT_JOBS:
                    raise UsageError(f"--tag {_tags_text(tags)}: more than "
                                     f"{MAX_WAIT_JOBS} jobs; wait on a narrower tag")
                ids = [row["id"] for row in rows]
            return await _wait(settings, store, ids, timeout=timeout, first=args.any,
                               progress=args.progress)

    return run_async(settings, go())


async def _wait(settings: Settings, store: CallerStore, job_ids: list[uuid.UUID], *,
                timeout: float | None, first: bool = False, progress: bool = False) -> int:
    """Wait for ``job_ids`` (sidecar.client.waiting.WaitHub: one LISTEN connection for
    them all, reads through ``store``'s pool), printing each end on stdout as it comes
    and, with ``progress``, each progress report on stderr, and while a job is queued a
    line saying why it waits each time that changes (``"waiting"``: no_live_sidecar,
    paused, ...); connect again after a failure, bounded by ``timeout`` seconds. Returns
    the exit code: 0 all succeeded, EXIT_JOB_FAILED when one ended failed or cancelled
    (also when others then timed out), else EXIT_TIMEOUT."""
    from sidecar.client import waiting

    dsn = db.resolve_dsn(settings)
    # LISTEN on SIDECAR_LISTEN_DATABASE_URL when set (a session even behind a transaction
    # pooler), else on the database's URL, or nowhere behind a transaction pooler.
    target = db.listen_target(dsn, settings.database_pooler, settings.listen_database_url)
    if target is None:
        log_mod.log.emit("listen_disabled", reason="SIDECAR_DATABASE_POOLER=transaction "
                         "without SIDECAR_LISTEN_DATABASE_URL: wait reads the jobs every "
                         f"{waiting.POLL_SECONDS:g} s instead of LISTEN")
    pending, failed = list(job_ids), False

    def reconnecting(exc: BaseException, jobs: int) -> None:
        log_mod.log.emit("wait_reconnecting", "warning", reason=db.describe_error(exc),
                         jobs=jobs)

    connect = None
    if target is not None:
        setting = ("SIDECAR_LISTEN_DATABASE_URL" if settings.listen_database_url
                   else "SIDECAR_DATABASE_URL")

        async def connect() -> Any:
            return await db.connect(target[0], settings.db_timeout_seconds,
                                    pooler=target[1], setting=setting,
                                    application_name=db.LISTEN_APPLICATION_NAME)

    hub = waiting.WaitHub(store, connect, timeout=settings.db_timeout_seconds,
                          on_reconnect=reconnecting)
    try:
        async with asyncio.timeout(timeout), contextlib.aclosing(
                hub.follow(job_ids, reasons=progress)) as events:
            async for event in events:
                if isinstance(event, waiting.JobWaiting):
                    event = event.as_progress()
                if isinstance(event, waiting.JobProgress):
                    if progress:
                        sys.stderr.buffer.write(jsontext.dumps(
                            event.as_json(), option=orjson.OPT_APPEND_NEWLINE))
                        sys.stderr.buffer.flush()
                    continue
                _print_json(event.as_json())
                pending.remove(event.id)
                failed = failed or not event.succeeded
                if first:
                    return EXIT_JOB_FAILED if failed else 0
    except TimeoutError:
        shown = ", ".join(str(job_id) for job_id in pending[:5])
        more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
        print(f"sidecar: error: timed out after {timeout:g} s; still unfinished: "
              f"{shown}{more}", file=sys.stderr)
        # A job that ended failed is known for good; it wins over the ones not yet ended.
        return EXIT_JOB_FAILED if failed else EXIT_TIMEOUT
    finally:
        await hub.close()
    return EXIT_JOB_FAILED if failed else 0


def cmd_run(args, settings: Settings) -> int:
    """``sidecar run``: the arguments checked (bootstrap.check_run_args), then the
    bootstrap's named steps (bootstrap.run)."""
    from sidecar.worker import bootstrap

    config = bootstrap.check_run_args(args.command, args.tool, args.concurrency, args.drain,
                                      settings, getattr(args, "inherited_signals", None))
    return bootstrap.run(config, settings)


def cmd_show(args, settings: Settings) -> int:
    job_id = _job_id(args.job_id)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            row = await store.get_job(job_id)
            if row is None:
                return None
            job = dict(row)
            job["events"] = [dict(e) for e in await store.job_events(job_id)]
            job["forwarding"] = [dict(o) for o in await store.outbox_of_job(job_id)]
            job["next_stages"] = [dict(c) for c in await store.children(job_id)]
            if job.get("session_key") is not None:  # its agent session (issue 43)
                job["session"] = await store.session_of_job(job_id)
            return job

    job = run_async(settings, go())
    if job is None:
        raise SidecarError(f"no job {job_id}")
    _print_json(job)
    return 0


def _interest_ttl(text: str) -> float:
    """``--interest-ttl``: 1 s to 1 day."""
    seconds = parsing.parse_duration(text, "--interest-ttl", 86400.0, positive=True)
    if seconds < 1.0:
        raise UsageError(f"--interest-ttl {text}: from 1s to 1d, e.g. 2m")
    return seconds


def cmd_interest(args, settings: Settings) -> int:
    """Hold (or renew) a caller's interest for ``--ttl`` from now, for shells (issue 44,
    point 2): run it again before the ttl ends for as long as the calls enqueued with
    ``--interest KEY`` are wanted; once nobody renews it, they stop. Prints ``{"interest",
    "generation", "expires_at"}``. ``--release`` lets go of it now and prints each call
    that stopped. Exit 2 with one line for a bad key or ttl."""
    key = enqueue_args.enqueue_options(interest=args.key).interest
    assert key is not None
    ttl = parsing.parse_duration(args.ttl, "--ttl", 86400.0, positive=True)
    if not args.release and ttl < 1.0:
        raise UsageError(f"--ttl {args.ttl}: from 1s to 1d, e.g. 30s")

    async def go():
        async with open_store(settings, CallerStore) as store:
            if args.release:
                return [dict(r) for r in await store.release_interest(key)]
            row = await store.hold_interest(key, ttl, args.holder)
            return [{"interest": key, **dict(row)}]

    for row in run_async(settings, go()):
        _print_json(row)
    return 0


def cmd_sessions(args, settings: Settings) -> int:
    """The live agent sessions (issue 43): one JSON object per line, newest first: tool,
    session_key, owner_id, generation, lease_until and lease_remaining (s), started_at,
    last_call_at, calls."""
    if args.tool is not None:
        validate_tool_name(args.tool)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            return await store.live_sessions(args.tool, args.limit)

    for row in run_async(settings, go()):
        _print_json(dict(row))
    return 0


def cmd_jobs(args, settings: Settings) -> int:
    if args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be 1 or more")
    if args.tool is not None:
        validate_tool_name(args.tool)
    tags = _tags(args)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            return (await store.list_jobs(args.state, args.tool, args.limit, tags),
                    await store.limits(args.tool))

    jobs, flows = run_async(settings, go())
    # First, on stderr, a line per listed tool that is paused or limited (issue 27): the
    # job lines on stdout stay one per job for scripts (issue 41).
    listed = {row["tool"] for row in jobs} | ({args.tool} if args.tool else set())
    banners = [_flow_line(row) for row in flows if row["tool"] in listed and (
        row["paused_at"] is not None or row["max_running"] or row["max_running_per_key"]
        or row["rate"] or row["rate_per_key"])]
    for banner in banners:
        print(banner, file=sys.stderr)
    lines = []
    for row in jobs:
        when = (row["finished_at"] or row["created_at"]).isoformat(timespec="seconds")
        lease = row["lease_until"].isoformat(timespec="seconds") if row["lease_until"] else "-"
        lines.append(f"{row['id']}  {row['tool']:<16} {row['state']:<9} "
                     f"attempt {row['attempt']}/{row['max_attempts'] or '-'}  "
                     f"token {row['fencing_token']}  lease_until {lease}  "
                     f"{row['error_kind'] or ''}  {when}".rstrip())
    _print_lines(lines)
    return 0


def _flow_line(row) -> str:
    """``sidecar jobs``' line for a tool that is paused or limited, before its jobs."""
    parts = [f"tool {row['tool']}:"]
    if row["paused_at"] is not None:
        when = row["paused_at"].isoformat(timespec="seconds")
        parts.append(f"PAUSED since {when}"
                     + (f" ({row['pause_reason']})" if row["pause_reason"] else ""))
    for name in ("max_running", "max_running_per_key", "rate", "rate_per_key"):
        if row[name]:
            parts.append(f"{name} {row[name]}")
    parts.append(f"running {row['running']}, queued {row['queued']}")
    return "  ".join(parts)


def cmd_approve(args, settings: Settings) -> int:
    """Answer the approval request a job's tool waits on (issue 44, point 1): approve, or
    ``--deny``. The answer names the attempt and fencing token of the request open now
    (or ``--attempt``/``--token``). Prints ``{"id", "outcome"}``; exit 0 when the answer
    was taken, 5 when it was refused (no request, already answered, expired, or the
    attempt that asked no longer owns the job; journaled either way)."""
    job_id = _job_id(args.job_id)
    if (args.attempt is None) != (args.token is None):
        raise UsageError("give both --attempt and --token, or neither (the open request's)")

    async def go():
        async with open_store(settings, CallerStore) as store:
            attempt, token, request = args.attempt, args.token, None
            if attempt is None:
                request = await store.open_approval(job_id)
                if request is None:
                    return None, "no_request"
                attempt, token = request["attempt"], request["fencing_token"]
            outcome = await store.answer_approval(
                job_id, attempt, token, not args.deny, args.reason,
                _operator("approve"))
            return request, outcome

    request, outcome = run_async(settings, go())
    out: dict[str, Any] = {"id": str(job_id), "outcome": outcome}
    if request is not None:
        out.update(action=request["action"], summary=request["summary"],
                   attempt=request["attempt"], fencing_token=request["fencing_token"])
    _print_json(out)
    return 0 if outcome in ("approved", "denied") else 5


def cmd_cancel(args, settings: Settings) -> int:
    if (args.job_id is None) == (not args.tag):
        raise UsageError("give one JOB_ID, or --tag KEY=VALUE (repeatable) for every queued "
                         "or running job with those tags")
    if args.tag:
        return _cancel_tagged(args, settings)
    job_id = _job_id(args.job_id)

    async def go():
        async with open_store(settings, CallerStore) as store:
            cancelled = await store.cancel(job_id, by=_operator("cancel"))
            bound = await store.cancel_kill_bound(list(cancelled)) if cancelled else (0, None)
            return cancelled, await store.get_job(job_id), bound

    cancelled, row, bound = run_async(settings, go())
    if row is None:
        raise SidecarError(f"no job {job_id}")
    if not cancelled:
        raise SidecarError(f"job {job_id} is already {row['state']}; nothing to cancel")
    later = [str(i) for i in cancelled if i != job_id]
    out: dict[str, Any] = {"id": job_id, "cancelled": job_id in cancelled,
                           "previous_state": cancelled.get(job_id, row["state"])}
    if later:
        out["cancelled_stages"] = later
    out.update(_kill_expected(*bound))
    _print_json(out)
    return 0


def _kill_expected(pending: int, latest_s: float | None) -> dict[str, str]:
    """The ``tree_kill`` line of ``cancel`` and ``pause --cancel-running``: when the trees
    of ``pending`` jobs cancelled while they ran are expected to die. Their owners are
    told at commit (a NOTIFY, functions/cancel.sql) and kill within about a second; an
    owner that cannot LISTEN (behind a transaction pooler without
    SIDECAR_LISTEN_DATABASE_URL, or while its LISTEN connection is down) asks about every
    second instead (sidecar.worker.claim_loop's cancel check), so about a second holds in
    every pooler mode. Only an owner that does not answer at all (the database out of its
    reach) leaves it to its next heartbeat, at the latest when the lease ends, ``latest_s``
    seconds from now. Empty when no tree was running."""
    if not pending or latest_s is None:
        return {}
    whose = "its owner was told; its tree dies" if pending == 1 \
        else f"their owners were told; their {pending} trees die"
    return {"tree_kill": f"{whose} within about 1 s (an owner that cannot LISTEN checks "
                         "every second), at the latest when the lease ends (within "
                         f"{max(latest_s, 0.0):.0f} s) should the owner lose the database"}


def _state_counts(states) -> dict[str, int]:
    """``previous_states`` of the commands that act on many jobs (cancel --tag, retry
    --tool/--tag), one shape for both: ``{state: how many}``, sorted by state."""
    counts: dict[str, int] = {}
    for state in states:
        counts[state] = counts.get(state, 0) + 1
    return dict(sorted(counts.items()))


def _cancel_tagged(args, settings: Settings) -> int:
    """``sidecar cancel --tag K=V...``: every queued or running job whose tags include all
    those given, and their later stages; a running one's tree is killed by its owner
    within about a second (``tree_kill`` says by when at the latest). Prints
    ``{"cancelled", "count", "previous_states": {state: n}[, "tree_kill"]}``; none is 0."""
    tags = _tags(args)

    async def go():
        async with open_store(settings, CallerStore) as store:
            cancelled = await store.cancel(None, tags, _operator("cancel"))
            bound = await store.cancel_kill_bound(list(cancelled)) if cancelled else (0, None)
            return cancelled, bound

    cancelled, bound = run_async(settings, go())
    _print_json({"cancelled": [str(i) for i in cancelled], "count": len(cancelled),
                 "previous_states": _state_counts(cancelled.values()),
                 **_kill_expected(*bound)})
    return 0


def cmd_retry(args, settings: Settings) -> int:
    if args.forwarding:
        if args.tag:
            raise UsageError("--forwarding takes one JOB_ID (no --tag)")
        return _retry_forwarding(args, settings)
    if (args.job_id is None) == (args.tool is None and not args.tag):
        raise UsageError("give one JOB_ID, or --tool TOOL and/or --tag KEY=VALUE (with "
                         "--state) for every failed or cancelled job of a tool or tags")
    if args.job_id is not None and args.state is not None:
        raise UsageError("--state selects jobs of a --tool or --tag; a JOB_ID is one job "
                         "already")
    job_id = _job_id(args.job_id) if args.job_id is not None else None
    if args.tool is not None:
        validate_tool_name(args.tool)
    tags = _tags(args)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            # F14: a job cancelled while it ran is retried only once its owner has
            # acknowledged the cancel (its tree is dead) or the lease it held has ended.
            rows, waited = await store.retry_when_acknowledged(
                job_id, args.state, args.tool, "sidecar retry", tags, RETRY_ACK_POLL_SECONDS)
            row = await store.get_job(job_id) if job_id is not None and not rows else None
            return rows, row, waited

    rows, row, waited = run_async(settings, go())
    if job_id is not None and not rows:
        if row is None:
            raise SidecarError(f"no job {job_id}")
        raise SidecarError(f"job {job_id} is {row['state']}; only a failed or cancelled job "
                           "can be retried")
    out: dict[str, Any] = {"retried": [str(r["id"]) for r in rows], "count": len(rows),
                           "previous_states": _state_counts(r["previous_state"] for r in rows)}
    if waited >= RETRY_ACK_POLL_SECONDS:
        out["waited_for_cancel_s"] = round(waited, 3)
    _print_json(out)
    return 0


def _retry_forwarding(args, settings: Settings) -> int:
    """``sidecar retry --forwarding JOB_ID``: deliver a dead-lettered result again (case
    F21). Exit 2 for bad arguments, 1 when the job does not exist or has no dead-lettered
    forwarding."""
    if args.job_id is None or args.tool is not None or args.state is not None:
        raise UsageError("--forwarding takes one JOB_ID (no --tool or --state): the job "
                         "whose dead-lettered result should be delivered again")
    job_id = _job_id(args.job_id)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            redone = await store.outbox_redeliver(job_id, "sidecar retry --forwarding")
            if redone:
                return redone, None, []
            return redone, await store.get_job(job_id), await store.outbox_of_job(job_id)

    redone, row, outbox = run_async(settings, go())
    if not redone:
        if row is None:
            raise SidecarError(f"no job {job_id}")
        states = ", ".join(sorted({o["state"] for o in outbox})) or "none (no RESULT_URL)"
        raise SidecarError(f"job {job_id} has no dead-lettered forwarding (forwarding: "
                           f"{states}); only a dead-lettered result can be delivered again")
    _print_json({"id": job_id, "redelivering": redone, "count": len(redone)})
    return 0


def _operator(command: str) -> str:
    """Who changed a tool's flow, for its journal: the command, the user and the host."""
    import socket

    user = os.environ.get("USER") or os.environ.get("LOGNAME") or f"uid {os.getuid()}"
    return f"sidecar {command} ({user}@{socket.gethostname()})"


def _limits_json(row) -> dict[str, Any]:
    """One tool's flow row as ``sidecar limits`` prints it."""
    return {"tool": row["tool"],
            "max_running": row["max_running"],
            "max_running_per_key": row["max_running_per_key"],
            "rate": row["rate"], "rate_per_key": row["rate_per_key"], "burst": row["burst"],
            "paused": row["paused_at"] is not None, "paused_at": row["paused_at"],
            "pause_reason": row["pause_reason"], "paused_by": row["paused_by"],
            "running": row["running"], "queued": row["queued"],
            "updated_at": row["updated_at"], "updated_by": row["updated_by"]}


def cmd_limit(args, settings: Settings) -> int:
    from sidecar.protocol import flow

    tool = validate_tool_name(args.tool)
    changes = flow.limit_changes(args.max_running, args.max_running_per_key, args.rate,
                                 args.rate_per_key, args.burst, args.clear)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            await store.set_limits(tool, changes, _operator("limit"))
            return await store.limits(tool)

    [row] = run_async(settings, go())
    _print_json(_limits_json(row))
    return 0


def cmd_limits(args, settings: Settings) -> int:
    if args.tool is not None:
        validate_tool_name(args.tool)
    if args.events is not None and args.events < 1:
        raise UsageError(f"--events {args.events}: must be 1 or more")

    async def go():
        async with open_store(settings, OperatorStore) as store:
            rows = await store.limits(args.tool)
            events = (await store.flow_events(args.tool, args.events)
                      if args.events else None)
            return rows, events

    rows, events = run_async(settings, go())
    out: dict[str, Any] = {"tools": [_limits_json(row) for row in rows]}
    if events is not None:
        out["events"] = [dict(row) for row in events]
    _print_json(out)
    return 0


def cmd_pause(args, settings: Settings) -> int:
    from sidecar.protocol import flow

    tool = validate_tool_name(args.tool)
    reason = flow.check_reason(args.reason) if args.reason is not None else None

    async def go():
        async with open_store(settings, OperatorStore) as store:
            if not args.new:
                known, tools = await store.known_tools(tool, KNOWN_TOOLS_SHOWN)
                if not known:
                    raise SidecarError(_unknown_tool(tool, tools))
            row = await store.pause(tool, reason, _operator("pause"))
            cancelled: dict[uuid.UUID, str] = {}
            bound: tuple[int, float | None] = (0, None)
            if args.cancel_running:
                # after the pause, so nothing claimed in between escapes it
                for job_id in await store.running_jobs(tool):
                    cancelled.update(await store.cancel(job_id, by=_operator("pause")))
                if cancelled:
                    bound = await store.cancel_kill_bound(list(cancelled))
            return row, cancelled, bound

    row, cancelled, bound = run_async(settings, go())
    out: dict[str, Any] = {"tool": tool, "paused": True, "paused_at": row["paused_at"],
                           "was_paused": row["was_paused"], "reason": row["pause_reason"]}
    if args.cancel_running:
        out["cancelled"] = [str(i) for i in cancelled]
        out.update(_kill_expected(*bound))
    _print_json(out)
    return 0


def _unknown_tool(tool: str, known: list[str]) -> str:
    """The one line of ``sidecar pause`` for a tool never seen (no job, limit, pause or
    idle sidecar of it): the tools that were (up to KNOWN_TOOLS_SHOWN), and the flag that
    pauses one ahead of its first job."""
    shown = ", ".join(known[:KNOWN_TOOLS_SHOWN]) if known else "none yet"
    more = ", ..." if len(known) >= KNOWN_TOOLS_SHOWN else ""
    return (f"pause {tool!r}: no job, limit or sidecar of this tool was ever seen (a typo?); "
            f"known tools: {shown}{more}; to pause it ahead of its first job, add --new")


def cmd_resume(args, settings: Settings) -> int:
    tool = validate_tool_name(args.tool)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            return await store.resume(tool, _operator("resume"))

    if not run_async(settings, go()):
        raise SidecarError(f"tool {tool} is not paused; nothing to resume")
    _print_json({"tool": tool, "resumed": True})
    return 0


def cmd_prune(args, settings: Settings) -> int:
    from sidecar.ops import retention

    ages = retention.retention_by_state(settings)
    if args.older_than is not None:
        # more than 0: 0 would remove every finished job
        age = parsing.parse_duration(args.older_than, "--older-than", MAX_SECONDS, positive=True)
        ages = dict.fromkeys(ages, age)
    if args.state is not None:
        ages = {args.state: ages[args.state]}
    kept = sorted(state for state, age in ages.items() if age <= 0)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            return await retention.prune(store, ages, dry_run=args.dry_run,
                                         finished_only=args.state is not None)

    done = run_async(settings, go())
    done["older_than_s"] = {state: age for state, age in ages.items() if age > 0}
    if kept:
        done["kept"] = {state: "retention 0 keeps every job" for state in kept}
    _print_json(done)
    if done["busy"]:
        print("sidecar: another pruner (a running sidecar) holds the retention lock; what it "
              "has not removed yet is left to it", file=sys.stderr)
    return 0


def cmd_receiver(args, settings: Settings) -> int:
    from sidecar.ops import receiver

    host, port = parsing.parse_host_port(args.listen, "--listen", RECEIVER_LISTEN)
    return run_async(settings, receiver.serve(settings, host, port))


def cmd_mcp(args, settings: Settings) -> int:
    """Serve the ``--tool`` tools over MCP (sidecar.mcp.gateway; the ``[mcp]`` extra)."""
    from sidecar.mcp import catalog as mcp_catalog

    catalog = mcp_catalog.load_catalog(settings, args.tool or ())
    if args.stdio and args.listen:
        raise UsageError("sidecar mcp: give --stdio or --listen, not both")
    tokens: dict[str, str] = {}
    host, port = "", 0
    if not args.stdio:
        host, port = parsing.parse_host_port(args.listen or DEFAULT_MCP_LISTEN, "--listen",
                                             DEFAULT_MCP_LISTEN)
        if not settings.mcp_token_file:
            raise ConfigError("sidecar mcp over HTTP needs bearer tokens: set "
                              "SIDECAR_MCP_TOKEN_FILE to a file of `PRINCIPAL TOKEN` lines "
                              "(or use --stdio)")
        tokens = mcp_catalog.load_tokens(settings.mcp_token_file)
    try:
        from sidecar.mcp import gateway as mcp_gateway
    except ImportError as exc:
        raise UsageError(_MCP_EXTRA.format(exc.name)) from None
    options = mcp_gateway.GatewayOptions(
        max_calls_per_principal=args.max_calls_per_principal,
        max_tasks_per_principal=args.max_tasks_per_principal,
        max_request_bytes=args.max_request_bytes,
        start_deadline_seconds=parsing.parse_duration(
            args.start_deadline, "--start-deadline", mcp_catalog.MAX_START_DEADLINE_SECONDS,
            positive=True),
        allowed_hosts=tuple(args.allowed_host or ()),
        allowed_origins=tuple(args.allowed_origin or ()),
        secret=mcp_catalog.load_secret(settings.mcp_secret_file, settings.mcp_token_file),
        interest_seconds=_interest_ttl(args.interest_ttl))
    mcp_gateway.check_catalog(catalog)  # each schema valid in its draft, before any I/O

    return run_async(settings, mcp_gateway.serve(settings, catalog, options, stdio=args.stdio,
                                                 host=host, port=port, tokens=tokens))


def cmd_web(args, settings: Settings) -> int:
    """Serve the operator's web view (sidecar.ops.web; the ``[web]`` extra), read-only unless
    SIDECAR_WEB_TOKEN_FILE names admin tokens (issue 30)."""
    from sidecar.runtime import tokens

    admin = (tokens.load_tokens(settings.web_token_file, "SIDECAR_WEB_TOKEN_FILE")
             if settings.web_token_file else None)
    try:
        from sidecar.ops import web
    except ImportError as exc:
        raise UsageError(f"sidecar web needs the web extra ({exc.name} is missing): "
                         "pip install 'sidecar[web]'") from None
    host, port = parsing.parse_host_port(args.listen, "--listen", web.DEFAULT_LISTEN)
    web.check_exposure(host, admin)
    proxies = tuple(web.parse_trusted_proxy(text) for text in args.trusted_proxy or ())
    return run_async(settings, web.serve(settings, host, port, admin,
                                         tuple(args.allowed_host or ()), proxies))


DEFAULT_MCP_LISTEN = "127.0.0.1:8765"
RECEIVER_LISTEN = "127.0.0.1:8900"
_MCP_EXTRA = ("sidecar mcp needs the MCP extra ({} is missing): "
              "pip install 'sidecar[mcp]'")


def cmd_demo(args, settings: Settings) -> int:
    from sidecar.demo import run_demo

    if settings.database_url and not args.yes:
        # The demo queues jobs: into a configured (perhaps production) queue only if asked.
        where = db.describe_host(mask_url(settings.database_url))
        question = (f"sidecar demo queues demo jobs and runs them in the database at {where} "
                    "(SIDECAR_DATABASE_URL)")
        if not sys.stdin.isatty():
            raise UsageError(f"{question}; pass --yes to do that, or unset "
                             "SIDECAR_DATABASE_URL to use the embedded PostgreSQL")
        print(f"{question}. Continue? [y/N] ", end="", file=sys.stderr, flush=True)
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            raise UsageError("sidecar demo: nothing queued")
    return run_demo(settings)


def cmd_config(args, settings: Settings) -> int:
    """The effective settings and profiles, secrets masked. An invalid variable never
    gets here: load_settings already failed with one line and exit 2."""
    if settings.database_url:
        db.resolve_dsn(settings)  # checks the URL's scheme; connects to nothing
    from sidecar.worker import cgroups, isolation

    host = cgroups.detect(settings.cgroups, probe=False)  # changes nothing on the host
    out: dict[str, Any] = {"settings": _global_settings(settings),
                           "isolation": host.describe()}
    if args.tool:
        out["profiles"] = [_profile_entry(settings, validate_tool_name(args.tool))]
    else:
        out["defaults"] = _profile_entry(settings)
        out["profiles"] = [_profile_entry(settings, env_key=key)
                           for key in settings.profile_tools()]
    refused: list[str] = []
    for entry in [*out["profiles"], *([out["defaults"]] if "defaults" in out else [])]:
        # What `sidecar run` would refuse on this host, said here already (and exit 2).
        profile = (settings.profile(entry.get("tool") or entry["env_key"].lower())
                   if "env_key" in entry else settings.default_profile())
        try:
            isolation.check_profile(profile, host)
            root = isolation.check_work_dir(settings, profile, create=False)
            # The same probe `run` makes (a `true` in a sandbox; nothing stays).
            plan, off = isolation.check_sandbox(settings, profile, root)
            entry["sandbox"] = {"mode": profile.sandbox, "active": plan is not None}
            if plan is None:
                entry["sandbox"]["reason"] = off
        except SidecarError as exc:
            entry["isolation_error"] = str(exc)
            refused.append(str(exc))
        if profile.mcp_input_schema_file:  # what `sidecar mcp` would refuse, said here
            from sidecar.mcp import catalog as mcp_catalog

            try:
                mcp_catalog.load_input_schema(
                    profile.sources.get("MCP_INPUT_SCHEMA_FILE", "MCP_INPUT_SCHEMA_FILE"),
                    profile.mcp_input_schema_file)
            except SidecarError as exc:
                entry["mcp_error"] = str(exc)
                refused.append(str(exc))
    _print_json(out)
    for message in dict.fromkeys(refused):  # also one line each on stderr, as run would say
        print(f"sidecar: error: {message}", file=sys.stderr)
    return 2 if refused else 0


def _global_settings(settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in GLOBAL_FIELDS.items():
        value = getattr(settings, name.lower(), None)
        if isinstance(value, str) and spec.unit in ("dsn", "url") and value:
            value = mask_url(value)
        elif isinstance(value, frozenset):
            value = sorted(value)
        out[name.lower()] = value
    if not settings.database_url:
        out["database_url"] = None  # the embedded PostgreSQL in data_dir
        out["data_dir"] = settings.data_dir or str(default_data_dir())
    return out


def _profile_entry(settings: Settings, tool: str | None = None,
                   env_key: str | None = None) -> dict[str, Any]:
    """One profile as JSON, with the variables that set it (defaults left out): of
    ``tool``, of the tool(s) whose ``SIDECAR_PROFILE_<env_key>_*`` variables exist, or the
    defaults."""
    entry: dict[str, Any] = {}
    if tool is not None:
        profile = settings.profile(tool)
        entry["tool"] = tool
        entry["env_key"] = tool_env_key(tool)
    elif env_key is not None:
        profile = settings.profile(env_key.lower())
        entry["env_key"] = env_key
    else:
        profile = settings.default_profile()
    entry.update({k: v for k, v in profile.as_dict().items() if k != "tool"})
    entry["set_by"] = {name.lower(): var for name, var in profile.sources.items()
                       if not var.startswith("(default)")}
    return entry


def _compact(value: Any) -> str:
    if isinstance(value, str):
        return value if value and all(c.isprintable() and c not in " =\"" for c in value) \
            else orjson.dumps(value).decode()
    return jsontext.dumps(value, other_as_str=True).decode()


def format_event(row) -> str:
    """One journal row as one line: time (UTC), event, fencing token, ``key=value``."""
    at = row["at"].astimezone(UTC).isoformat(timespec="milliseconds")
    details = row["details"]
    if isinstance(details, dict):
        text = " ".join(f"{k}={_compact(v)}" for k, v in details.items() if v is not None)
    else:
        text = "" if details is None else _compact(details)
    return f"{at.replace('+00:00', 'Z')}  {row['event']:<22} token {row['fencing_token']:<4} " \
           f"{text}".rstrip()


def cmd_events(args, settings: Settings) -> int:
    job_id = _job_id(args.job_id)

    async def go():
        async with open_store(settings, OperatorStore) as store:
            if await store.get_job(job_id) is None:
                return None
            return await store.job_events(job_id)

    rows = run_async(settings, go())
    if rows is None:
        raise SidecarError(f"no job {job_id}")
    _print_lines([format_event(row) for row in rows])
    return 0


def bundle_dir() -> Path | None:
    """The directory of the relocatable bundle this sidecar runs from, or None when it
    runs from a Python installation (PyInstaller ``--onedir``: the executable's dir)."""
    if not getattr(sys, "frozen", False):
        return None
    return Path(sys.executable).resolve().parent


def cmd_install(args, settings: Settings) -> int:
    source = bundle_dir()
    if source is None:
        raise UsageError("sidecar install copies the relocatable bundle and must be run from "
                         "it (e.g. /opt/sidecar/sidecar install /sidecar); this sidecar runs "
                         f"from a Python installation ({sys.executable})")
    dest = Path(args.dest).absolute()
    if dest.resolve() == source or source in dest.resolve().parents:
        raise UsageError(f"DEST {dest} is the bundle itself or inside it; choose another "
                         "directory, e.g. a shared emptyDir mounted at /sidecar")
    try:
        shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
    except shutil.Error as exc:
        # A directory that already exists and is not ours (a Kubernetes emptyDir belongs
        # to root) keeps its own mode and times: copytree's copystat of it fails with
        # EPERM after every file was copied. Only a failure to copy a file counts.
        failed = [(src, why) for src, _dst, why in exc.args[0] if not os.path.isdir(src)]
        if failed:
            src, why = failed[0]
            raise SidecarError(f"cannot copy the bundle {source} to {dest}: {src}: {why}"
                               + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
                               ) from None
    except OSError as exc:
        raise SidecarError(f"cannot copy the bundle {source} to {dest}: {exc}") from None
    _print_json({"installed": str(dest / Path(sys.executable).name), "from": str(source)})
    return 0


# --- parser -------------------------------------------------------------------

# The bounds of every integer option: a value outside them is bad input (exit 2, one
# line), never a number handed on to PostgreSQL (a bigint) or the event loop (case F24).
LIMIT_MAX = 100_000
CONCURRENCY_MAX = 1024


def _int_from(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: the option's text as an int from ``low`` to ``high``, else
    ArgumentTypeError naming the range (shown by _Parser.error as one line, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip()) if text.isascii() else None  # int("١٢") is 12
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer from {low} "
                                             f"to {high}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line on stderr (exit 2) that names the command and
    points at its --help, never a usage block before the error."""

    def error(self, message: str):
        print(f"sidecar: error: {self.prog}: {message}; see '{self.prog} --help'",
              file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sidecar",
        description="Run hang-prone tools from a PostgreSQL queue under a lease.")
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    sub = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    def add(name: str, func: Callable, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("migrate", cmd_migrate, "create or upgrade the schema; then, as its owner, "
            "grant the worker's, the scaler's, the callers' and the web view's roles "
            "what they need and no more")
    p.add_argument("--worker-role", metavar="ROLE",
                   help="grant ROLE the workers' privileges: rows of the queue's tables, "
                        "no DDL (docs/operations.md, 'Roles and Secrets')")
    p.add_argument("--scaler-role", metavar="ROLE",
                   help="grant ROLE EXECUTE on tool_job_demand only (KEDA's query)")
    p.add_argument("--caller-role", metavar="ROLE",
                   help="grant ROLE what a caller needs and no more: enqueue, wait, read "
                        "and cancel jobs (the MCP gateway's, sidecar.client's), through "
                        "functions; no write on any table, no DDL")
    p.add_argument("--web-role", metavar="ROLE",
                   help="grant ROLE what `sidecar web` needs and no more: read jobs, "
                        "journals and flow rows; cancel, retry, pause and resume through "
                        "functions; no write on any table, no DDL")
    p = add("enqueue", cmd_enqueue, "queue one job for TOOL; prints {id, created}")
    p.add_argument("tool", metavar="TOOL")
    p.add_argument("--payload", metavar="JSON")
    p.add_argument("--payload-file", metavar="PATH", help="file with the JSON payload, - for stdin")
    p.add_argument("--idempotency-key", metavar="KEY",
                   help="the same key returns the existing job instead of a second one")
    p.add_argument("--max-attempts", type=_int_from(1, MAX_ATTEMPTS_LIMIT),
                   metavar="N", help="default: MAX_ATTEMPTS of the profile of the sidecar "
                                     "that claims the job")
    p.add_argument("--priority", type=_int_from(0, 9), metavar="N",
                   help="0 (claimed first, the default) to 9")
    p.add_argument("--run-after", metavar="DURATION|TIMESTAMP",
                   help="not claimed before: a delay (90, 30m, 12h) or an ISO 8601 time "
                        "with its offset")
    p.add_argument("--expires-in", metavar="DURATION",
                   help="no attempt starts later than this after enqueue; a job still "
                        "queued then ends failed, kind expired")
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="repeatable; for jobs, cancel and retry --tag")
    p.add_argument("--traceparent", metavar="TRACEPARENT",
                   help="W3C trace context, given to the tool as TRACEPARENT")
    p.add_argument("--tracestate", metavar="TRACESTATE",
                   help="W3C tracestate, given to the tool as TRACESTATE")
    p.add_argument("--concurrency-key", metavar="KEY",
                   help="the key flow control caps (--max-running-per-key) and takes turns "
                        "by, e.g. a tenant or an account (sidecar limit)")
    p.add_argument("--session", metavar="KEY",
                   help="the agent session of the call: a session's calls run one at a "
                        "time, in order, in one warm process that keeps its state "
                        "(PROCESS=warm; docs/callers.md \"Sessions\")")
    p.add_argument("--interest", metavar="KEY",
                   help="the caller's interest the call belongs to (held now: sidecar "
                        "interest KEY): it stops once nobody renews the interest "
                        "(docs/callers.md \"Interest\")")
    p.add_argument("--dedupe", metavar="POLICY",
                   help="how long the job holds its idempotency key: forever, active "
                        "(until it finishes: the key then frees for a new job) or a window "
                        "such as 24h; default the tool's DEDUPE (docs/callers.md)")
    p.add_argument("--wait", action="store_true",
                   help="then wait for the job to end, as `sidecar wait` (exit 0, 3, 4)")
    p.add_argument("--timeout", metavar="DURATION",
                   help="with --wait: give up after DURATION (seconds, or e.g. 90s, 5m): "
                        "exit 4")
    p.add_argument("--progress", action="store_true",
                   help="with --wait: print each progress report as a JSON line on stderr")
    p = add("wait", cmd_wait, "block until the jobs end; print each as one JSON line "
            "{id, state, result|error, attempt}; exit 0 all succeeded, 3 one failed or was "
            "cancelled, 4 timeout")
    p.add_argument("job_id", metavar="JOB_ID", nargs="*")
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="every job with these tags (repeatable: all of them), instead of ids")
    p.add_argument("--any", action="store_true", help="return when the first one ends")
    p.add_argument("--timeout", metavar="DURATION",
                   help="give up after DURATION (seconds, or e.g. 90s, 5m): exit 4")
    p.add_argument("--progress", action="store_true",
                   help="print each progress report of the jobs as a JSON line on stderr")
    p = add("run", cmd_run, "claim jobs of TOOL and run COMMAND once per job")
    p.add_argument("--tool", metavar="TOOL", help="default: the basename of COMMAND")
    p.add_argument("--concurrency", type=_int_from(1, CONCURRENCY_MAX),
                   default=1, metavar="N")
    p.add_argument("--drain", action="store_true",
                   help="exit 0 once no job of the tool is queued or running")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG...]")
    p = add("show", cmd_show, "one job as JSON, with its journal")
    p.add_argument("job_id", metavar="JOB_ID")
    p = add("approve", cmd_approve, "answer the approval request a job's tool waits on "
            "(exit 5 when the answer is refused)")
    p.add_argument("job_id", metavar="JOB_ID")
    p.add_argument("--deny", action="store_true", help="deny it: the job fails denied")
    p.add_argument("--reason", metavar="TEXT", help="why, journaled and shown to the tool")
    p.add_argument("--attempt", type=int, metavar="N",
                   help="the attempt the answer is for (default: the open request's)")
    p.add_argument("--token", type=int, metavar="N",
                   help="the fencing token the answer is for (with --attempt)")
    p = add("interest", cmd_interest, "hold or renew a caller's interest for --ttl (its "
            "calls stop once nobody renews it), or let go of it")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--ttl", default="30s", metavar="DURATION",
                   help="how long from now it is held (1s to 1d; default 30s)")
    p.add_argument("--holder", metavar="NAME", help="who holds it, kept for operators")
    p.add_argument("--release", action="store_true",
                   help="let go of it now: its unfinished calls stop")
    p = add("sessions", cmd_sessions, "the live agent sessions as JSON lines, newest first")
    p.add_argument("--tool")
    p.add_argument("--limit", type=_int_from(1, LIMIT_MAX), default=50)
    p = add("jobs", cmd_jobs, "one line per job, newest first")
    p.add_argument("--state", choices=STATES)
    p.add_argument("--tool")
    p.add_argument("--limit", type=_int_from(1, LIMIT_MAX), default=50)
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="only jobs with this tag (repeatable: all of them)")
    p = add("cancel", cmd_cancel, "cancel a queued or running job, or every one with tags")
    p.add_argument("job_id", metavar="JOB_ID", nargs="?")
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="every queued or running job with this tag (repeatable: all of "
                        "them); prints {cancelled, count, previous_states}")
    p = add("retry", cmd_retry, "requeue a failed or cancelled job (or every one of a tool) "
            "with fresh attempts; prints {retried, count}")
    p.add_argument("job_id", metavar="JOB_ID", nargs="?")
    p.add_argument("--tool", metavar="TOOL", help="every failed or cancelled job of TOOL")
    p.add_argument("--tag", action="append", metavar="KEY=VALUE",
                   help="every failed or cancelled job with this tag (repeatable: all)")
    p.add_argument("--state", choices=(JobState.FAILED.value, JobState.CANCELLED.value),
                   help="only jobs in this state")
    p.add_argument("--forwarding", action="store_true",
                   help="instead: deliver the dead-lettered result of JOB_ID again "
                        "(fresh forwarding attempts and age)")
    p = add("limit", cmd_limit, "set TOOL's flow limits for the whole fleet (stored in the "
            "database, obeyed from every sidecar's next claim); prints the tool's limits")
    p.add_argument("tool", metavar="TOOL")
    p.add_argument("--max-running", type=_int_from(1, 1_000_000), metavar="N",
                   help="at most N jobs of TOOL running at once, fleet-wide")
    p.add_argument("--max-running-per-key", type=_int_from(1, 1_000_000), metavar="N",
                   help="at most N running at once per --concurrency-key (jobs without a "
                        "key are not held by it)")
    p.add_argument("--rate", metavar="N/s|N/m",
                   help="at most N claims of TOOL per second or minute (a token bucket)")
    p.add_argument("--rate-per-key", metavar="N/s|N/m", help="the same, per key")
    p.add_argument("--burst", type=_int_from(1, 1_000_000), metavar="N",
                   help="claims a rate lets start at once (default 1: no bursts)")
    p.add_argument("--clear", action="store_true", help="remove every limit of TOOL")
    p = add("limits", cmd_limits, "every tool's flow limits, pause and running jobs as JSON")
    p.add_argument("--tool", metavar="TOOL", help="only this tool")
    p.add_argument("--events", type=_int_from(1, 10_000), metavar="N",
                   help="also the N newest flow changes (limits set, pauses, resumes)")
    p = add("pause", cmd_pause, "stop every claim of TOOL fleet-wide (running jobs finish); "
            "`sidecar resume TOOL` undoes it")
    p.add_argument("tool", metavar="TOOL")
    p.add_argument("--reason", metavar="TEXT",
                   help="shown by limits, jobs and /readyz (a second pause without one "
                        "keeps the first's)")
    p.add_argument("--new", action="store_true",
                   help="pause a tool never seen yet (no job, limit or sidecar of it); "
                        "without it such a tool is refused as a probable typo (exit 1)")
    p.add_argument("--cancel-running", action="store_true",
                   help="also cancel the running jobs (their trees die as with cancel)")
    p = add("resume", cmd_resume, "let claims of a paused TOOL start again")
    p.add_argument("tool", metavar="TOOL")
    p = add("prune", cmd_prune, "delete finished jobs, with their journal and outbox rows, "
            "older than their state's retention, and what else a sidecar's pruner removes "
            "(old flow changes, refilled rate buckets, ended cancels, dead idle "
            "registrations, stale sweep turns); prints what it removed as JSON")
    p.add_argument("--older-than", metavar="DURATION",
                   help="instead of SIDECAR_RETENTION_SECONDS and "
                        "SIDECAR_RETENTION_FAILED_SECONDS: seconds, or e.g. 12h, 7d")
    p.add_argument("--state", choices=tuple(state.value for state in FINISHED_STATES),
                   help="only jobs in this state (and nothing of the other kinds)")
    p.add_argument("--dry-run", action="store_true",
                   help="count what would be removed; remove nothing")
    p = add("receiver", cmd_receiver,
            "serve the reference receiver of fenced side effects (POST and GET /effects)")
    p.add_argument("--listen", default=RECEIVER_LISTEN, metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8900)")
    p = add("mcp", cmd_mcp,
            "serve the --tool tools over MCP (Streamable HTTP at /mcp, or stdio); each "
            "call is a job (needs the [mcp] extra)")
    p.add_argument("--tool", action="append", metavar="TOOL",
                   help="a tool to expose (repeatable; its profile's MCP_DESCRIPTION is "
                        "required); no other tool is reachable")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help=f"serve Streamable HTTP here (default {DEFAULT_MCP_LISTEN}); needs "
                        "SIDECAR_MCP_TOKEN_FILE")
    p.add_argument("--stdio", action="store_true",
                   help="serve one client over stdin/stdout instead (it started us)")
    p.add_argument("--max-calls-per-principal", type=_int_from(1, 100_000), default=64,
                   metavar="N", help="calls in flight at once per principal (default 64)")
    p.add_argument("--max-tasks-per-principal", type=_int_from(1, 1_000_000), default=1000,
                   metavar="N", help="unfinished MCP tasks per principal, fleet-wide "
                                     "(default 1000)")
    p.add_argument("--max-request-bytes", type=_int_from(1024, 64 * 1024 * 1024),
                   default=1024 * 1024, metavar="N",
                   help="largest HTTP request body (default 1048576)")
    p.add_argument("--interest-ttl", default="2m", metavar="DURATION",
                   help="a call stops once its client shows no sign this long: no request "
                        "of its MCP session, no poll of its task, its own request gone "
                        "(1s to 1d; docs/mcp.md)")
    p.add_argument("--start-deadline", default="10m", metavar="DURATION",
                   help="a call's job that has not started this long after the call ends "
                        "failed, kind expired, and the call returns that error (default "
                        "10m, at most 30d)")
    p.add_argument("--allowed-host", action="append", metavar="HOST[:PORT|:*]",
                   help="a Host header to accept besides loopback (repeatable), e.g. the "
                        "Service's name: sidecar-mcp:*")
    p.add_argument("--allowed-origin", action="append", metavar="ORIGIN",
                   help="an Origin header to accept besides loopback (repeatable)")
    p = add("web", cmd_web,
            "serve the operator's web view: tools, running jobs, jobs, each job's timeline "
            "(needs the [web] extra); read-only unless SIDECAR_WEB_TOKEN_FILE is set")
    p.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                   help="address to serve on (default 127.0.0.1:8080)")
    p.add_argument("--allowed-host", action="append", metavar="HOST[:PORT|:*]",
                   help="a Host header to accept besides loopback (repeatable), e.g. the "
                        "Service's name: sidecar-web:*")
    p.add_argument("--trusted-proxy", action="append", metavar="ADDRESS[/BITS]",
                   help="a proxy in front of sidecar web (repeatable): its X-Forwarded-For "
                        "names the source failed logins are counted against; none by "
                        "default (the peer's address)")
    p = add("demo", cmd_demo,
            "run the sidecar on real programs and a hung tool, print outcomes")
    p.add_argument("--yes", action="store_true",
                   help="queue the demo jobs in the database SIDECAR_DATABASE_URL names "
                        "without asking (unset: the embedded PostgreSQL, no question)")
    p = add("config", cmd_config,
            "print the effective settings and lease profiles (secrets masked) as JSON; "
            "exit 2 when any is invalid")
    p.add_argument("--tool", metavar="TOOL", help="only this tool's effective profile")
    p = add("events", cmd_events, "the journal of one job, one line per event")
    p.add_argument("job_id", metavar="JOB_ID")
    p = add("install", cmd_install,
            "copy the relocatable bundle this sidecar runs from to DEST (init containers)")
    p.add_argument("dest", metavar="DEST")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sidecar`` console script; returns the exit code."""
    raw = sys.argv[1:] if argv is None else argv
    # Before any thread exists, so every later thread and tool inherits the clean state.
    inherited = linux.reset_inherited_signal_state()
    if raw[:1] == ["_guardian"]:  # the guardian of a frozen bundle (no `python -m` there)
        from sidecar.worker import guardian

        return guardian.main(raw[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    try:
        settings = load_settings()
        log_mod.configure(settings.log_level, settings.log_format)
        # Said by `run` once it starts serving, never before an error: an error is one
        # line whatever the launcher did (case F24).
        args.inherited_signals = inherited
        return args.func(args, settings)
    except SidecarError as exc:
        print(f"sidecar: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except db.DATABASE_ERRORS as exc:
        err = DatabaseUnavailable(f"database error: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}")
        print(f"sidecar: error: {err.message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
