"""The caller's options at enqueue, parsed and bounded (issue 26): when a job may start
(``--priority``, ``--run-after``, ``--expires-in``), its tags (``--tag KEY=VALUE``) and its
W3C trace context (``--traceparent``, ``--tracestate``). Pure: no I/O, so the CLI checks
its arguments before it connects, and tests sweep the rules without a database.

One parser for both front doors: ``enqueue_options`` takes the command line's text
(``--run-after 5m``) and the client's Python values (``run_after=300``, a timedelta, an
aware datetime) alike, naming each option as its caller spells it (CLI_NAMES,
PYTHON_NAMES); durations are read by sidecar.protocol.parsing.

The database checks the same rules again, with the same limits, in ``tool_job_enqueue``
(migration 014), the one implementation behind ``sidecar enqueue`` and ``sidecar_enqueue``
(tests/test_caller_options.py feeds both the same bad values). Every error is a
UsageError (exit 2) whose one line names the option and the form it wants.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.protocol import parsing
from sidecar.protocol.errors import UsageError
from sidecar.protocol.flow import check_concurrency_key

PRIORITY_MIN, PRIORITY_MAX = 0, 9  # 0 is claimed first
# The farthest ahead a job may be scheduled (--run-after) or given to start (--expires-in).
HORIZON = dt.timedelta(days=366)
MAX_TAGS = 16
MAX_TAG_VALUE_CHARS = 256
TAG_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,62}")
# Characters no tag value or idempotency key may hold (C0 and C1 controls, DEL): the
# database's check (migration 014) is this same class.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# W3C Trace Context, level 1: version-traceid-parentid-flags, lower-case hex.
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32
_TRACESTATE_MEMBER = re.compile(
    r"(?P<key>[a-z0-9][a-z0-9_*/-]{0,240}@[a-z][a-z0-9_*/-]{0,13}|[a-z][a-z0-9_*/-]{0,255})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
MAX_ATTEMPTS_LIMIT = 1000  # the same bound as sidecar.runtime.config's


@dataclass(frozen=True)
class EnqueueOptions:
    """What a caller may say about one job besides tool, payload and key (issue 26):
    ``priority`` 0-9 (0 first); ``run_in`` (a delay, counted by the database's clock) or
    ``run_after`` (a time), not both; ``expires_in``: no attempt starts later than this
    after enqueue, or ``expires_at`` (a time, by the database's clock; not both:
    sidecar.client); ``tags`` (string to string); ``traceparent``/``tracestate`` (W3C);
    ``concurrency_key``: the key flow control caps and takes turns by (issue 27);
    ``session``: the agent session the call belongs to (issue 43: its calls run one at a
    time, in order, in one warm process; docs/callers.md "Sessions"); ``dedupe``: how long
    the job holds its idempotency key (forever, active or a window; None: the tool's
    default, issue 44); ``interest``: the caller's interest the job belongs to (held now;
    its lapse stops the job, issue 44). The defaults change nothing."""

    priority: int = 0
    run_in: dt.timedelta | None = None
    run_after: dt.datetime | None = None
    expires_in: dt.timedelta | None = None
    expires_at: dt.datetime | None = None
    tags: dict[str, str] = field(default_factory=dict)
    traceparent: str | None = None
    tracestate: str | None = None
    concurrency_key: str | None = None
    session: str | None = None
    dedupe: str | None = None
    interest: str | None = None


@dataclass(frozen=True)
class OptionNames:
    """How a caller spells each option in its errors: ``--run-after`` on the command line,
    ``run_after`` from Python."""

    priority: str
    run_after: str
    expires_in: str
    tags: str
    traceparent: str
    tracestate: str
    concurrency_key: str
    idempotency_key: str
    max_attempts: str
    session: str
    dedupe: str
    interest: str


CLI_NAMES = OptionNames("--priority", "--run-after", "--expires-in", "--tag", "--traceparent",
                        "--tracestate", "--concurrency-key", "--idempotency-key",
                        "--max-attempts", "--session", "--dedupe", "--interest")
PYTHON_NAMES = OptionNames("priority", "run_after", "expires_in", "tags", "traceparent",
                           "tracestate", "concurrency_key", "idempotency_key", "max_attempts",
                           "session", "dedupe", "interest")


def parse_duration(text: str, what: str) -> dt.timedelta:
    """``text`` as a duration: seconds, or a number with s, m, h or d (``90``, ``30m``,
    ``12h``); at most HORIZON (sidecar.protocol.parsing.parse_duration). UsageError names ``what``
    (the option)."""
    return dt.timedelta(seconds=parsing.parse_duration(text, what,
                                                       HORIZON.total_seconds()))


def parse_run_after(text: str, what: str = "--run-after") -> dt.timedelta | dt.datetime:
    """``--run-after``: a duration from now (``parse_duration``) or a time in ISO 8601
    with its UTC offset (``2030-01-02T03:04:05Z``). A time already past means now."""
    stripped = text.strip()
    if parsing.is_duration(stripped):
        return parse_duration(stripped, what)
    try:
        when = dt.datetime.fromisoformat(stripped)
    except ValueError:
        raise UsageError(f"{what} {text[:40]!r}: {parsing.DURATION_FORM}, or an ISO 8601 "
                         "time with its offset, e.g. 2030-01-02T03:04:05Z") from None
    if when.tzinfo is None:
        raise UsageError(f"{what} {text[:40]!r}: give the time's UTC offset, e.g. "
                         f"{stripped}Z or {stripped}+02:00")
    return when


def parse_expires_in(text: str, what: str = "--expires-in") -> dt.timedelta:
    """``--expires-in``: a duration, more than 0 and at most 366 days."""
    return dt.timedelta(seconds=parsing.parse_duration(text, what, HORIZON.total_seconds(),
                                                       positive=True))


def check_priority(value: int, what: str = "--priority") -> int:
    """``value`` if it is a priority (an int, 0 claimed first, to 9); else UsageError."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise UsageError(f"{what} {value!r}: must be an integer from {PRIORITY_MIN} "
                         f"(claimed first) to {PRIORITY_MAX}")
    return value


def check_max_attempts(value: int | None, what: str = "--max-attempts") -> int | None:
    """``value`` if it is None (the claiming profile's MAX_ATTEMPTS decides) or an int from
    1 to MAX_ATTEMPTS_LIMIT; else UsageError."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= MAX_ATTEMPTS_LIMIT):
        raise UsageError(f"{what} {value!r}: must be from 1 to {MAX_ATTEMPTS_LIMIT}")
    return value


def _is_utf8(text: str) -> bool:
    """False for a str holding lone surrogates: bytes that were not UTF-8 on the command
    line (Python's surrogateescape), which no JSON encoder or database accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tags(tags: dict[str, Any], what: str = "--tag") -> dict[str, str]:
    """``tags`` if every key and value is allowed (at most MAX_TAGS; keys as TAG_KEY,
    values strings of 1-256 printable characters); else UsageError naming the tag."""
    if len(tags) > MAX_TAGS:
        raise UsageError(f"{what}: at most {MAX_TAGS} tags per job, {len(tags)} given")
    for key, value in tags.items():
        if not isinstance(key, str) or not TAG_KEY.fullmatch(key):
            raise UsageError(f"{what} {str(key)[:70]!r}: a key is 1-63 letters, digits, "
                             "'_', '.', ':', '/' or '-', starting with a letter or digit")
        if not isinstance(value, str) or not 1 <= len(value) <= MAX_TAG_VALUE_CHARS \
                or _CONTROL.search(value) or not _is_utf8(value):
            raise UsageError(f"{what} {key}: the value must be 1-{MAX_TAG_VALUE_CHARS} "
                             "printable characters of valid UTF-8")
    return dict(tags)


def parse_tags(items: Iterable[str] | None, what: str = "--tag") -> dict[str, str]:
    """``--tag KEY=VALUE`` options (repeatable; each key once) as a dict, checked by
    ``check_tags``."""
    tags: dict[str, str] = {}
    for item in items or ():
        if not isinstance(item, str):
            raise UsageError(f"{what} {item!r:.70}: use KEY=VALUE, e.g. run=42")
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"{what} {item[:70]!r}: use KEY=VALUE, e.g. run=42")
        if key in tags:
            raise UsageError(f"{what} {key}: given twice; a job has one value per key")
        tags[key] = value
    return check_tags(tags, what)


def check_traceparent(value: str, what: str = "--traceparent") -> str:
    """``value`` if it is a W3C traceparent (version 00's layout, a version other than ff,
    trace and parent ids not all zeros); else UsageError."""
    if not isinstance(value, str) or not TRACEPARENT.fullmatch(value) or value[:2] == "ff" \
            or value[3:35] == "0" * 32 or value[36:52] == "0" * 16:
        raise UsageError(f"{what} {str(value)[:80]!r}: not a W3C traceparent "
                         "(version-traceid-parentid-flags in lower-case hex, e.g. "
                         "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01)")
    return value


def stored_trace_context(traceparent: str | None, tracestate: str | None
                         ) -> tuple[str | None, str | None]:
    """The trace context of a claimed row as the tool and the trace may use it: each part
    that passes check_traceparent / check_tracestate, None for a part that does not (a
    row written around tool_job_enqueue's checks, issue 30), and no tracestate without a
    traceparent. Never raises: a bad context costs the job its trace, never its run."""
    if traceparent is None:
        return None, None
    try:
        check_traceparent(traceparent)
    except UsageError:
        return None, None
    if tracestate is not None:
        try:
            check_tracestate(tracestate)
        except UsageError:
            tracestate = None
    return traceparent, tracestate


def check_tracestate(value: str, what: str = "--tracestate") -> str:
    """``value`` if it is a W3C tracestate: at most 512 characters and 32 list members
    ``key=value`` (blank members skipped), each key once; else UsageError."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be a string, e.g. 'vendor=value'")
    if len(value) > MAX_TRACESTATE_CHARS:
        raise UsageError(f"{what}: at most {MAX_TRACESTATE_CHARS} characters")
    keys: list[str] = []
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        match = _TRACESTATE_MEMBER.fullmatch(member)
        if match is None or match.group("key") in keys:
            raise UsageError(f"{what}: member {member[:80]!r} is not a W3C list member "
                             "(key=value, each key once)")
        keys.append(match.group("key"))
    if len(keys) > MAX_TRACESTATE_MEMBERS:
        raise UsageError(f"{what}: at most {MAX_TRACESTATE_MEMBERS} list members")
    return value


# The namespaces of `sidecar mcp` (issue 41 point 2): tags named mcp.* and idempotency
# keys starting mcp: are the gateway's; other producers are refused them here (the
# gateway itself trusts only mcp.* tags it signed: sidecar.mcp.catalog.sign_tags).
RESERVED_TAG_PREFIX = "mcp."
RESERVED_KEY_PREFIX = "mcp:"


def refuse_reserved(tags: Mapping[str, str], key: str | None, names: OptionNames) -> None:
    """UsageError (exit 2) naming the option when a tag is named ``mcp.*`` or the
    idempotency key starts ``mcp:``: those belong to ``sidecar mcp`` (docs/mcp.md,
    Security). ``names`` spells the options (CLI_NAMES or PYTHON_NAMES)."""
    for name in tags:
        if name.startswith(RESERVED_TAG_PREFIX):
            raise UsageError(f"{names.tags} {name[:70]}: tags named {RESERVED_TAG_PREFIX}* "
                             "are reserved for sidecar mcp; use another name")
    if key is not None and key.startswith(RESERVED_KEY_PREFIX):
        key_name = "--idempotency-key" if names is CLI_NAMES else "idempotency_key"
        raise UsageError(f"{key_name} {key[:70]!r}: keys starting {RESERVED_KEY_PREFIX!r} "
                         "are reserved for sidecar mcp; use another key")


# A dedupe policy's window: a whole number (no leading zero, at most 8 digits) and a unit;
# functions/dedupe.sql (tool_job_dedupe_window) holds the same rule.
_DEDUPE_WINDOW = re.compile(r"[1-9][0-9]{0,7}[smhd]")
_DEDUPE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
DEDUPE_POLICIES = ("forever", "active")


def dedupe_window_seconds(policy: str, what: str = "--dedupe") -> float | None:
    """How long a job keeps its idempotency key after its enqueue, by its dedupe policy
    (issue 44, point 4; docs/callers.md "Idempotency keys"): ``forever`` -> None (never
    freed; the default), ``active`` -> 0 (freed once the job has finished), a window of 1 s
    to 366 days written as a whole number and a unit (``90s``, ``30m``, ``24h``, ``7d``) ->
    its seconds (freed once the job has finished and the window since its enqueue has
    passed). UsageError naming ``what`` otherwise."""
    if isinstance(policy, str) and policy in DEDUPE_POLICIES:
        return None if policy == "forever" else 0.0
    if isinstance(policy, str) and _DEDUPE_WINDOW.fullmatch(policy):
        seconds = int(policy[:-1]) * _DEDUPE_UNITS[policy[-1]]
        if seconds <= HORIZON.total_seconds():
            return float(seconds)
    raise UsageError(f"{what} {str(policy)[:80]!r}: use forever, active or a window of 1s "
                     "to 366d, e.g. 24h")


def check_idempotency_key(key: str, what: str = "--idempotency-key") -> str:
    """``key`` if it is 1-512 printable characters of valid UTF-8; else UsageError. (Keys
    ending in ``:stage:N`` belong to next stages: sidecar.storage.store.check_producer_key.)"""
    if not isinstance(key, str) or not key.strip() or len(key) > 512 \
            or not key.isprintable():
        raise UsageError(f"{what} must be 1-512 printable characters, "
                         "e.g. invoice-42:capture")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} is not valid UTF-8") from None
    return key


Moment = dt.datetime | dt.timedelta | float | str


def _moment(value: Moment, what: str, positive: bool) -> dt.timedelta | dt.datetime:
    """A ``run_after``/``expires_in`` value as a span from now or an aware time: the CLI's
    text (a duration, or for run_after an ISO 8601 time with its offset), seconds, a
    timedelta (0 to HORIZON; more than 0 with ``positive``) or an aware datetime."""
    if isinstance(value, str):
        return parse_expires_in(value, what) if positive else parse_run_after(value, what)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise UsageError(f"{what} {value.isoformat()}: give a timezone-aware datetime "
                             "(e.g. datetime.now(UTC) + ...)")
        return value
    if isinstance(value, dt.timedelta | int | float) and not isinstance(value, bool):
        return dt.timedelta(seconds=parsing.seconds_value(
            value, what, HORIZON.total_seconds(), positive=positive))
    raise UsageError(f"{what} {value!r:.80}: give seconds, a timedelta, an aware datetime "
                     "or a duration such as '30m'")


def enqueue_options(priority: int | None = None, run_after: Moment | None = None,
                    expires_in: Moment | None = None,
                    tags: Iterable[str] | Mapping[str, str] | None = None,
                    traceparent: str | None = None,
                    tracestate: str | None = None,
                    concurrency_key: str | None = None, *,
                    session: str | None = None, dedupe: str | None = None,
                    interest: str | None = None,
                    names: OptionNames = CLI_NAMES) -> EnqueueOptions:
    """The one parser of the enqueue options, for the command line (text as given, None
    when absent) and the client (Python values; ``names=PYTHON_NAMES``) alike.

    ``priority`` an int 0-9 (None: 0); ``run_after`` a delay (a duration's text, seconds
    or a timedelta, 0 to 366 days, counted by the database's clock) or a time (an aware
    datetime, or ISO 8601 text with its offset); ``expires_in`` a duration more than 0
    (same forms) or an aware datetime (no attempt starts after it); ``tags`` ``KEY=VALUE``
    strings or a mapping; ``traceparent``/``tracestate`` W3C trace context (a tracestate
    needs a traceparent); ``concurrency_key`` and ``session`` 1-256 printable
    characters each; ``dedupe`` a policy (dedupe_window_seconds); ``interest`` 1-256
    printable characters. Returns
    EnqueueOptions; UsageError, naming the option as ``names`` spells it, for the first
    value that is not allowed."""
    when = _moment(run_after, names.run_after, False) if run_after is not None else None
    expiry = _moment(expires_in, names.expires_in, True) if expires_in is not None else None
    if tracestate is not None and traceparent is None:
        raise UsageError(f"{names.tracestate} needs a {names.traceparent}")
    if isinstance(expiry, dt.timedelta) and isinstance(when, dt.timedelta) and when >= expiry:
        raise UsageError(f"{names.expires_in} {expires_in}: the job would expire before its "
                         f"{names.run_after} {run_after}")
    if isinstance(tags, Mapping):
        checked_tags = check_tags(dict(tags), names.tags)
    elif isinstance(tags, str | bytes):
        raise UsageError(f"{names.tags}: give KEY=VALUE strings or a dict of strings, "
                         "e.g. {'run': '42'}")
    else:
        checked_tags = parse_tags(tags, names.tags)
    if concurrency_key is not None and not isinstance(concurrency_key, str):
        raise UsageError(f"{names.concurrency_key} must be a string, e.g. 'tenant-42'")
    if session is not None and not isinstance(session, str):
        raise UsageError(f"{names.session} must be a string, e.g. 'agent-run-42'")
    if dedupe is not None:
        dedupe_window_seconds(dedupe, names.dedupe)  # refused here as the database would
    if interest is not None and not isinstance(interest, str):
        raise UsageError(f"{names.interest} must be a string, e.g. 'agent-run-42'")
    return EnqueueOptions(
        priority=check_priority(priority, names.priority) if priority is not None else 0,
        run_in=when if isinstance(when, dt.timedelta) else None,
        run_after=when if isinstance(when, dt.datetime) else None,
        expires_in=expiry if isinstance(expiry, dt.timedelta) else None,
        expires_at=expiry if isinstance(expiry, dt.datetime) else None,
        tags=checked_tags,
        traceparent=(check_traceparent(traceparent, names.traceparent)
                     if traceparent is not None else None),
        tracestate=(check_tracestate(tracestate, names.tracestate)
                    if tracestate is not None else None),
        concurrency_key=(check_concurrency_key(concurrency_key, names.concurrency_key)
                         if concurrency_key is not None else None),
        session=(check_concurrency_key(session, names.session, "agent-run-42")
                 if session is not None else None),
        dedupe=dedupe,
        interest=(check_concurrency_key(interest, names.interest, "agent-run-42")
                  if interest is not None else None))
