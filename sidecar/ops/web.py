"""``sidecar web``: the operator's web view (issue 30), a separate process on aiohttp with
server-rendered pages (jinja2, the ``[web]`` extra; no JavaScript build, one small static
script refreshes the running jobs in place). ``sidecar run`` never imports it
(tests/test_import_graph.py).

Pages (docs/web.md): ``/tools`` (queues, failures, pauses, limits, sidecars seen),
``/running`` (owner, attempt, token, lease slack and time in stage by the database's
clock, progress), ``/jobs`` (filters, keyset pages), ``/jobs/{id}`` (the journal as a
timeline, digests, content on request).

Read-only unless SIDECAR_WEB_TOKEN_FILE names admin tokens (sidecar.runtime.tokens): a principal
logs in with its token (a session cookie, HttpOnly, SameSite=Strict; the session is a row of
sidecar_web_sessions, migration 025, so it outlives this process and works on every
replica) or sends it as a bearer token, and may then cancel, retry, pause and resume, each
behind a confirmation
page, by POST only, with a CSRF token bound to the session, journaled with the principal
(``by``) through the statements the CLI runs. Everything from the database is escaped
(jinja2's autoescape); every input is bounded; bad input is a 400 whose one line names
the field. Security headers on every answer: a CSP without inline script, no framing,
no-store.

Failed logins (a token that is not one of the file's, on the login form or as a bearer
token) are counted per source address and per token presented (sidecar_web_login_failures):
LOGIN_FAILURES_ALLOWED in LOGIN_WINDOW_SECONDS lock that source, or that token, for
LOGIN_LOCK_SECONDS on every replica (429, even for a good token), each lockout logged
(``web_login_locked``) and counted (``sidecar_web_login_lockouts_total`` on ``/metrics``).
The source is the peer's address (an IPv6 one by its /64): X-Forwarded-For is never
trusted. Every value shown from a row is scrubbed of the secrets this process knows
(``masking.SECRETS``: its database URL and password, RESULT_URL credentials), as a row
written before scrubbing existed may hold them (issue 41).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import ipaddress
import re
import secrets
import signal
import sys
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from sidecar.protocol import enqueue_args, jsontext, masking, parsing
from sidecar.protocol.errors import ConfigError, SidecarError, UsageError
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import JobState
from sidecar.runtime import log as log_mod
from sidecar.runtime import tokens
from sidecar.runtime.config import Settings, register_secrets, validate_tool_name
from sidecar.storage import db, schema
from sidecar.storage.operator_store import OperatorStore

DEFAULT_LISTEN = "127.0.0.1:8080"

# Bounds of every input (issue 30): a page holds at most MAX_PAGE jobs, a query value at
# most MAX_PARAM_CHARS characters, a form body at most MAX_BODY_BYTES.
DEFAULT_PAGE = 50
MAX_PAGE = 200
MAX_PARAM_CHARS = 300
MAX_BODY_BYTES = 16 * 1024
MAX_RUNNING_ROWS = 500
MAX_TOOLS = 500
MAX_TIMELINE_EVENTS = 2000
# Payload or result content shown on request: at most this many characters.
MAX_CONTENT_CHARS = 64 * 1024
# Any other value from a row (an error field, a tag, progress, an outbox error) shows at
# most MAX_VALUE_CHARS characters, a key MAX_KEY_CHARS, an object MAX_PAIRS items; one
# journal event's details MAX_EVENT_CHARS in all (2000 events of a few lines each).
MAX_VALUE_CHARS = 4096
MAX_KEY_CHARS = 64
MAX_PAIRS = 64
MAX_EVENT_CHARS = 1000
KIND = re.compile(r"[a-z0-9_]{1,64}")
SESSION_COOKIE = "sidecar_web_session"
SESSION_SECONDS = 8 * 3600
# Sessions kept (sidecar_web_sessions): at most this many per principal and in all; a
# login beyond either ends the oldest.
MAX_SESSIONS_PER_PRINCIPAL = 20
MAX_SESSIONS = 1000
# Failed logins: this many in a window of LOGIN_WINDOW_SECONDS (from the first) lock the
# source, or the token presented, for LOGIN_LOCK_SECONDS; the failures table keeps at most
# MAX_FAILURE_ROWS rows.
LOGIN_FAILURES_ALLOWED = 10
LOGIN_WINDOW_SECONDS = 300
LOGIN_LOCK_SECONDS = 300
MAX_FAILURE_ROWS = 10_000
STATES = tuple(state.value for state in JobState)

# Every answer carries these (no inline script or style: the CSP forbids both).
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "img-src 'self'; connect-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# How each journal event shows on the timeline (a CSS class): the events of
# docs/operations.md's catalog that a job's journal holds.
EVENT_CLASS = {
    "job_enqueued": "operator", "job_cancelled": "operator", "job_retried": "operator",
    "job_claimed": "claim", "lease_released": "claim", "attempt_superseded": "kill",
    "tool_request_started": "claim", "attempt_shortage": "lost",
    "ownership_unknown": "lost", "ownership_confirmed": "claim", "heartbeat_lost": "lost",
    "lease_abandoned": "lost", "child_killed": "kill", "cancel_acknowledged": "kill",
    "job_succeeded": "commit", "result_rejected": "lost", "job_failed": "fail",
    "job_retry_scheduled": "fail", "job_expired": "fail", "secret_in_output": "fail",
    "next_stage_conflict": "fail", "effect_forwarded": "forward",
    "effect_rejected": "fail", "forward_dead_lettered": "fail",
    "forward_redelivery": "forward", "job_progress": "progress",
    "checkpoint_saved": "progress",
}
# The banners a finished action leaves on the page it goes back to (?done=...).
DONE = {
    "cancelled": "The job was cancelled; a running owner kills its tree at its next "
                 "heartbeat.",
    "retried": "The job was queued again with fresh attempts.",
    "paused": "The tool is paused: no claim starts until it is resumed.",
    "resumed": "The tool is resumed: its idle sidecars were woken.",
    "nothing": "Nothing was changed: the job or tool was not in a state the action takes.",
    "approved": "The step was approved for the attempt that asked.",
    "denied": "The step was denied: the job fails denied.",
    "refused": "The answer was refused and journaled: the request was answered already, "
               "expired, or the attempt that asked no longer owns the job.",
}


class BadInput(SidecarError):
    """A query parameter or form field the web view refuses: a 400 whose one line names
    the field and the fix."""

    exit_code = 2


@dataclass(frozen=True)
class Session:
    """One logged-in browser, as its row in sidecar_web_sessions says: its principal, the
    CSRF token its forms carry, and the sha256 of its cookie's key (the row's key)."""

    principal: str
    csrf: str
    key_sha256: bytes


@dataclass
class WebState:
    """What every handler of one server shares: the store (sessions and failed logins
    live in its database), the settings (for the stage deadline of each tool's profile),
    the admin tokens (None: read-only), the Host headers accepted besides loopback, the
    templates and the metrics this process serves on ``/metrics``."""

    store: OperatorStore
    settings: Settings
    tokens: dict[str, str] | None
    allowed_hosts: frozenset[str]
    templates: jinja2.Environment
    metrics: WebMetrics
    trusted_proxies: tuple[IPNetwork, ...] = ()


class WebMetrics:
    """The web view's own counters, in a registry of their own (``/metrics`` of ``sidecar
    web`` shows these, not the sidecar's): ``sidecar_web_login_failures_total`` and
    ``sidecar_web_login_lockouts_total`` by ``scope`` (source or token), both scopes at
    zero from the start."""

    SCOPES = ("source", "token")

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.failures = Counter("sidecar_web_login_failures",
                                "Failed logins of this web view (a token that is not one "
                                "of SIDECAR_WEB_TOKEN_FILE's, on the form or as a bearer "
                                "token).", registry=self.registry)
        self.lockouts = Counter("sidecar_web_login_lockouts",
                                "Lockouts after too many failed logins, by scope: source "
                                "(the peer address) or token (one token presented).",
                                ("scope",), registry=self.registry)
        for scope in self.SCOPES:
            self.lockouts.labels(scope)


STATE = web.AppKey("state", WebState)
# Who sent a request (principal, session), worked out once by the middleware.
WHO = web.RequestKey("who", tuple)


# --- inputs ---------------------------------------------------------------------------------

def _param(request: web.Request, name: str) -> str | None:
    """The query parameter ``name``, None when absent or empty; BadInput when repeated or
    longer than MAX_PARAM_CHARS."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadInput(f"query parameter {name}: give it once")
    if not values or values[0] == "":
        return None
    if len(values[0]) > MAX_PARAM_CHARS:
        raise BadInput(f"query parameter {name}: at most {MAX_PARAM_CHARS} characters")
    return values[0]


@dataclass(frozen=True)
class JobFilter:
    """The jobs list's filters and page, from the query string: ``state`` (one of
    STATES), ``tool``, ``tag`` (``KEY=VALUE``, repeatable), ``kind`` (an error kind),
    ``limit`` (1 to MAX_PAGE) and ``after`` (the keyset: the id of the previous page's
    last row; ids are time-ordered, so newest first is highest id first)."""

    state: str | None = None
    tool: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    kind: str | None = None
    limit: int = DEFAULT_PAGE
    after: uuid.UUID | None = None

    def query(self, **changes: Any) -> str:
        """This filter as a query string, with ``changes`` (``after=None`` for the first
        page)."""
        values: dict[str, Any] = {"state": self.state, "tool": self.tool, "kind": self.kind,
                                  "limit": self.limit if self.limit != DEFAULT_PAGE else None}
        values.update(changes)
        after = values.pop("after", self.after)
        pairs = [(k, str(v)) for k, v in values.items() if v is not None]
        pairs += [("tag", f"{k}={v}") for k, v in self.tags]
        if after is not None:
            pairs.append(("after", str(after)))
        return urlencode(pairs)


def parse_filter(request: web.Request) -> JobFilter:
    """The JobFilter of ``request``'s query string; BadInput naming the field."""
    state = _param(request, "state")
    if state is not None and state not in STATES:
        raise BadInput(f"query parameter state: must be one of {', '.join(STATES)}")
    tool = _param(request, "tool")
    if tool is not None:
        try:
            validate_tool_name(tool)
        except ConfigError:
            raise BadInput("query parameter tool: 1-63 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit") from None
    raw_tags = request.query.getall("tag", [])
    if len(raw_tags) > enqueue_args.MAX_TAGS:
        raise BadInput(f"query parameter tag: at most {enqueue_args.MAX_TAGS}")
    try:
        tags = enqueue_args.parse_tags(t for t in raw_tags if t) if raw_tags else {}
    except UsageError as exc:
        raise BadInput("query parameter tag: " + exc.message.removeprefix("--tag ")) \
            from None
    kind = _param(request, "kind")
    if kind is not None and not KIND.fullmatch(kind):
        raise BadInput("query parameter kind: an error kind, 1-64 lower-case letters, "
                       "digits or '_' (e.g. stage_timeout)")
    limit_text = _param(request, "limit")
    limit = DEFAULT_PAGE
    if limit_text is not None:
        if not limit_text.isascii() or not limit_text.isdigit() \
                or not 1 <= int(limit_text) <= MAX_PAGE:
            raise BadInput(f"query parameter limit: an integer from 1 to {MAX_PAGE}")
        limit = int(limit_text)
    after_text = _param(request, "after")
    after = None
    if after_text is not None:
        after = parsing.parse_job_id(after_text, "query parameter after", BadInput,
                                     echo=False)
    return JobFilter(state, tool, tuple(tags.items()), kind, limit, after)


def _job_id(request: web.Request) -> uuid.UUID:
    """The path's job id (sidecar.protocol.parsing.parse_job_id); BadInput (a 400) otherwise."""
    return parsing.parse_job_id(request.match_info["job_id"], "job id", BadInput, echo=False)


def _tool(request: web.Request) -> str:
    try:
        return validate_tool_name(request.match_info["tool"])
    except ConfigError:
        raise BadInput("tool: 1-63 letters, digits, '.', '_' or '-'") from None


async def _form(request: web.Request) -> dict[str, str]:
    """The POSTed form's fields (urlencoded, each once, each at most MAX_PARAM_CHARS);
    BadInput otherwise."""
    if not request.can_read_body:
        return {}
    if request.content_type != "application/x-www-form-urlencoded":
        raise BadInput("the body must be a form (application/x-www-form-urlencoded)")
    data = await request.post()
    out: dict[str, str] = {}
    for key in data:
        values = data.getall(key)
        if len(values) != 1 or not isinstance(values[0], str):
            raise BadInput(f"form field {key[:40]}: give it once, as text")
        if len(values[0]) > MAX_PARAM_CHARS:
            raise BadInput(f"form field {key[:40]}: at most {MAX_PARAM_CHARS} characters")
        out[key] = values[0]
    return out


# --- who is asking --------------------------------------------------------------------------

def _sha256(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


# The longest X-Forwarded-For read from a trusted proxy (longer: the peer is the source).
MAX_FORWARDED_CHARS = 2000
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _address(text: str) -> IPAddress | None:
    """An IP address (an IPv4-mapped IPv6 one as IPv4; a zone dropped), None otherwise."""
    try:
        address = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_trusted_proxy(text: str) -> IPNetwork:
    """A ``--trusted-proxy`` value: an IP address or network (``10.0.0.0/8``); UsageError
    (exit 2) naming the option and the fix otherwise."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise UsageError(f"--trusted-proxy {text[:80]!r}: give an IP address or network, "
                         "e.g. 10.0.0.0/8 (the proxy in front of sidecar web)") from None


def source_of(request: web.Request) -> str:
    """The source a failed login from ``request`` is counted against (``source``: its
    peer, and X-Forwarded-For from a proxy of ``--trusted-proxy`` only)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return source(str(peer[0]) if peer else None,
                  ",".join(request.headers.getall("X-Forwarded-For", [])),
                  request.app[STATE].trusted_proxies)


def source(peer: str | None, forwarded: str, trusted: tuple[IPNetwork, ...]) -> str:
    """The source of a request from ``peer`` (the socket's address; None: unknown) with
    the X-Forwarded-For text ``forwarded`` (every such header, joined by commas): the
    peer's address, an IPv6 one by its /64 (which one host commonly holds whole), an
    IPv4-mapped one as IPv4. The header is believed only from a proxy in ``trusted``
    (``--trusted-proxy``; none by default): then the source is the right-most address
    that is not itself a trusted proxy (what the nearest proxy saw; a client writes what
    it likes to the left of it), the peer when the header is longer than
    MAX_FORWARDED_CHARS, up to the first entry that is no address. Pure; never raises."""
    if not peer:
        return "unknown"
    address = _address(peer)
    if address is None:
        return peer[:100]
    if trusted and any(address in net for net in trusted) \
            and len(forwarded) <= MAX_FORWARDED_CHARS:
        for item in reversed(forwarded.split(",")):
            hop = _address(item)
            if hop is None:
                break
            address = hop
            if not any(hop in net for net in trusted):
                break
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def _session(request: web.Request) -> Session | None:
    """The live session of the request's cookie (its row in sidecar_web_sessions), None
    without one; a session whose principal is no longer in the token file is none."""
    state = request.app[STATE]
    key = request.cookies.get(SESSION_COOKIE)
    if not key or len(key) > 100:
        return None
    digest = _sha256(key)
    row = await state.store.web_session(digest)
    if row is None or state.tokens is None or row["principal"] not in state.tokens.values():
        return None
    return Session(row["principal"], row["csrf"], digest)


def _locked(scope: str, retry_after: int) -> web.HTTPException:
    """The 429 of a locked source or token: one line and Retry-After."""
    what = "this address" if scope == "source" else "this token"
    return web.HTTPTooManyRequests(
        text=f"too many failed logins from {what}: locked for {retry_after} s more; wait, "
             "then log in with a token of SIDECAR_WEB_TOKEN_FILE\n",
        content_type="text/plain", headers={"Retry-After": str(max(retry_after, 1))})


async def check_token(request: web.Request, presented: str) -> str | None:
    """The principal of the token ``presented`` (a login form's or a bearer token), None
    when it is none of the token file's: that failure is counted for the request's source
    and for the token (``login_failed``). A source or token that is locked is refused
    first, a good token too: HTTPTooManyRequests (429, Retry-After)."""
    state = request.app[STATE]
    assert state.tokens is not None
    source, digest = source_of(request), _sha256(presented).hex()
    lock = await state.store.web_login_lock(source, digest)
    if lock is not None:
        raise _locked(lock["scope"], lock["retry_after_s"])
    # compared whole: a longer one is no token (a prefix must not pass as one)
    who = None if len(presented) > MAX_PARAM_CHARS else \
        tokens.principal_of(state.tokens, presented)
    if who is None:
        await login_failed(request, source, digest)
    return who


async def login_failed(request: web.Request, source: str, token_sha256: str) -> None:
    """Count a failed login for ``source`` and the token; each lockout it causes is
    logged once (``web_login_locked``, warning: scope, source, the token's sha256 prefix,
    failures, seconds) and counted (``sidecar_web_login_lockouts_total``)."""
    state = request.app[STATE]
    state.metrics.failures.inc()
    rows = await state.store.web_login_failed(
        source, token_sha256, LOGIN_WINDOW_SECONDS, LOGIN_FAILURES_ALLOWED,
        LOGIN_LOCK_SECONDS, MAX_FAILURE_ROWS)
    for row in rows:
        if row["locked_now"]:
            state.metrics.lockouts.labels(row["scope"]).inc()
            log_mod.log.emit("web_login_locked", "warning", scope=row["scope"],
                             source=source, token_sha256=token_sha256[:16],
                             failures=row["failures"], window_s=LOGIN_WINDOW_SECONDS,
                             locked_s=LOGIN_LOCK_SECONDS)


async def identify(request: web.Request) -> tuple[str | None, Session | None]:
    """Who sent ``request``: a bearer token's principal (no session; a wrong one is a
    failed login, and a locked source or token a 429: check_token), or a logged-in
    session's; ``(None, None)`` for an anonymous reader or a read-only server."""
    state = request.app[STATE]
    if state.tokens is None:
        return None, None
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        return await check_token(request, header[7:].strip()), None
    found = await _session(request)
    return (found.principal, found) if found else (None, None)


def principal(request: web.Request) -> tuple[str | None, Session | None]:
    """Who sent ``request`` (``identify``'s answer, worked out once by the middleware)."""
    return request.get(WHO, (None, None))


def _require_admin(request: web.Request, form: dict[str, str]) -> str:
    """The principal allowed to act, or an HTTP error: 403 on a read-only server or a
    form whose CSRF token is missing or not its session's, 401 without credentials."""
    state = request.app[STATE]
    if state.tokens is None:
        raise _plain(403, "read-only: this server has no admin tokens (set "
                          "SIDECAR_WEB_TOKEN_FILE to allow actions)")
    who, session = principal(request)
    if who is None:
        raise _plain(401, "log in first (/login), or send Authorization: Bearer TOKEN")
    if session is not None and not hmac.compare_digest(
            form.get("csrf", "").encode(), session.csrf.encode()):
        raise _plain(403, "form field csrf: missing or not this session's; reload the "
                          "confirmation page and submit it again")
    return who


def _plain(status: int, line: str) -> web.HTTPException:
    """An HTTP error whose body is one line of text."""
    kinds = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 403: web.HTTPForbidden,
             404: web.HTTPNotFound, 409: web.HTTPConflict, 429: web.HTTPTooManyRequests,
             503: web.HTTPServiceUnavailable}
    return kinds[status](text=line + "\n", content_type="text/plain")


# --- rendering ------------------------------------------------------------------------------

def _seconds(value: float | None) -> str:
    """A duration as the page shows it: ``-`` for none, else seconds, minutes, hours."""
    if value is None:
        return "-"
    sign, value = ("-", -value) if value < 0 else ("", value)
    if value < 120:
        return f"{sign}{value:.1f} s"
    if value < 7200:
        return f"{sign}{value / 60:.1f} min"
    return f"{sign}{value / 3600:.1f} h"


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _clip(text: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` (str() of it) cut to ``limit`` characters, saying how long it was."""
    text = "" if text is None else str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


def _compact(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A JSON value as compact text (a string as is), at most ``limit`` characters."""
    if not isinstance(value, str):
        value = jsontext.dumps(value, other_as_str=True).decode()
    return _clip(value, limit)


def _pairs(value: Any) -> list[tuple[str, Any]]:
    """A JSON object's items as the page lists them; any other JSON value (a row written
    around the checks: tags, journal details) as one item with an empty key, none for
    null."""
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = [] if value is None else [("", value)]
    shown = [(_clip(k, MAX_KEY_CHARS), v if k == "stderr_tail" and isinstance(v, str)
              else _compact(v)) for k, v in items[:MAX_PAIRS]]
    if len(items) > MAX_PAIRS:
        shown.append(("…", f"{len(items) - MAX_PAIRS} more"))
    return shown


def _event_details(value: Any) -> list[tuple[str, str]]:
    """One journal event's details as _pairs shows an object (null values left out), at
    most MAX_EVENT_CHARS characters of keys and values in all."""
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if v is not None]
    else:
        items = [] if value is None else [("", value)]
    out, room = [], MAX_EVENT_CHARS
    for number, (key, raw) in enumerate(items):
        if room <= 0:
            out.append(("…", f"{len(items) - number} more"))
            break
        key = _clip(key, MAX_KEY_CHARS)
        text = _compact(raw, max(room - len(key), 16))
        room -= len(key) + len(text)
        out.append((key, text))
    return out


def _progress(value: Any) -> str:
    """A job's progress as one line: ``VALUE MESSAGE`` of the object a tool reports, or
    any other JSON value (a row written around the checks) compact."""
    if isinstance(value, dict):
        parts = [value.get("value"), value.get("message")]
        return _clip(" ".join(_compact(part) for part in parts if part is not None))
    return _compact(value)


def make_templates() -> jinja2.Environment:
    """The page templates (sidecar/ops/web_templates), autoescaped: every value from the
    database is HTML-escaped unless a template says otherwise (none does)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("sidecar.ops", "web_templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True)
    env.filters.update(seconds=_seconds, when=_when, compact=_compact, pairs=_pairs,
                       progress=_progress, clip=_clip)
    env.globals.update(quote=lambda text: quote(str(text), safe=""))
    return env


def _render(request: web.Request, name: str, status: int = 200,
            **context: Any) -> web.Response:
    state = request.app[STATE]
    who, session = principal(request)
    text = state.templates.get_template(name).render(
        principal=who, csrf=session.csrf if session else "",
        admin_enabled=state.tokens is not None, path=request.path_qs, **context)
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


# --- pages ----------------------------------------------------------------------------------

async def tools_page(request: web.Request) -> web.Response:
    rows = await request.app[STATE].store.web_read("web_tools", MAX_TOOLS + 1)
    return _render(request, "tools.html", tools=rows[:MAX_TOOLS],
                   more_tools=len(rows) > MAX_TOOLS, max_tools=MAX_TOOLS,
                   done=DONE.get(request.query.get("done", "")))


def _stage_deadline(settings: Settings, tool: str) -> float | None:
    """The stage deadline (s) of ``tool``'s profile as this process's environment sets it
    (SIDECAR_PROFILE_<TOOL>_STAGE_TIMEOUT_SECONDS, else the default), None when that
    profile is invalid here."""
    try:
        return settings.profile(tool).stage_timeout_seconds
    except SidecarError:
        return None


def _tool_param(request: web.Request) -> str | None:
    """The optional ``?tool=`` filter of a page: a valid tool name or None; BadInput (one
    line naming the parameter) otherwise."""
    tool = _param(request, "tool")
    if tool is not None:
        try:
            validate_tool_name(tool)
        except ConfigError:
            raise BadInput("query parameter tool: 1-63 letters, digits, '.', '_' or '-'") \
                from None
    return tool


async def running_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tool = _tool_param(request)
    fragment = _param(request, "fragment")
    if fragment not in (None, "rows"):
        raise BadInput("query parameter fragment: only 'rows'")
    rows = await state.store.web_read("web_running", tool, MAX_RUNNING_ROWS)
    running = [dict(row, deadline_s=_stage_deadline(state.settings, row["tool"]))
               for row in rows]
    return _render(request, "running_rows.html" if fragment else "running.html",
                   running=running, tool=tool, limit=MAX_RUNNING_ROWS)


async def sessions_page(request: web.Request) -> web.Response:
    """The live agent sessions (issue 43; of one tool with ``?tool=``): who holds each,
    its generation, calls, lease slack and the call running now."""
    state = request.app[STATE]
    tool = _tool_param(request)
    rows = await state.store.web_read("web_sessions", tool, MAX_RUNNING_ROWS)
    return _render(request, "sessions.html", sessions=rows, tool=tool,
                   limit=MAX_RUNNING_ROWS)


async def jobs_page(request: web.Request) -> web.Response:
    wanted = parse_filter(request)
    rows = await request.app[STATE].store.web_read(
        "web_jobs_page", wanted.state, wanted.tool,
        dict(wanted.tags) or None, wanted.kind, wanted.after, wanted.limit + 1)
    more = len(rows) > wanted.limit
    rows = rows[:wanted.limit]
    older = wanted.query(after=rows[-1]["id"]) if more else None
    return _render(request, "jobs.html", jobs=rows, filter=wanted, states=STATES,
                   older=older, first=wanted.query(after=None) if wanted.after else None)


async def job_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    job_id = _job_id(request)
    show = _param(request, "show")
    if show not in (None, "payload", "result"):
        raise BadInput("query parameter show: payload or result")
    job = await state.store.web_read("web_job", job_id, method="fetchrow")
    if job is None:
        raise _plain(404, f"no job {job_id}")
    who, _ = principal(request)
    content = None
    if show is not None:
        if state.tokens is not None and who is None:
            raise _plain(401, f"query parameter show: the {show} is shown to a logged-in "
                              "principal only on a server with admin tokens; log in first")
        content = await state.store.web_read("web_job_content", job_id, show,
                                             MAX_CONTENT_CHARS, method="fetchrow")
        if content is not None and content["text"] is not None \
                and content["chars"] > MAX_CONTENT_CHARS:
            # cut by the database: a secret the cut splits is masked too
            content["text"] = SECRETS.scrub(content["text"], cut_end=True)
    events = await state.store.web_read("web_job_events", job_id, MAX_TIMELINE_EVENTS)
    total = await state.store.web_read("web_job_event_count", job_id, method="fetchval")
    timeline, previous, first = [], None, None
    for row in events:
        first = first or row["at"]
        timeline.append({
            "at": row["at"], "event": row["event"], "token": row["fencing_token"],
            "class": EVENT_CLASS.get(row["event"], "other"),
            "since_start": (row["at"] - first).total_seconds(),
            "gap": (row["at"] - previous).total_seconds() if previous else None,
            "details": _event_details(row["details"])})
        previous = row["at"]
    forwarding = await state.store.outbox_of_job(job_id)
    children = await state.store.children(job_id)
    session = await state.store.web_read("web_session_of_job", job_id, method="fetchrow") \
        if job["session_key"] is not None else None
    approval = await state.store.web_read("web_open_approval", job_id, method="fetchrow") \
        if job["state"] in ("running", "waiting") else None
    error = job["error"] if isinstance(job["error"], dict) else None
    return _render(
        request, "job.html", job=job, error=error, timeline=timeline, total_events=total,
        session=session, approval=approval,
        forwarding=forwarding, children=children, show=show, content=content,
        content_limit=MAX_CONTENT_CHARS, deadline_s=_stage_deadline(state.settings,
                                                                    job["tool"]),
        done=DONE.get(request.query.get("done", "")))


# --- actions (admin) ------------------------------------------------------------------------

JOB_ACTIONS = {"cancel": "Cancel", "retry": "Retry", "approve": "Approve the step of",
               "deny": "Deny the step of"}
TOOL_ACTIONS = {"pause": "Pause", "resume": "Resume"}


async def confirm_page(request: web.Request) -> web.Response:
    """The confirmation page of an action: a form that POSTs it with the CSRF token."""
    state = request.app[STATE]
    if state.tokens is None:
        raise _plain(403, "read-only: this server has no admin tokens (set "
                          "SIDECAR_WEB_TOKEN_FILE to allow actions)")
    action = request.match_info["action"]
    if "job_id" in request.match_info:
        target, kind = str(_job_id(request)), "job"
        job = await state.store.get_job(uuid.UUID(target))
        if job is None:
            raise _plain(404, f"no job {target}")
        detail = f"{job['tool']}, {job['state']}, attempt {job['attempt']}"
        if action in ("approve", "deny"):
            # The answer names the request this page shows: its attempt and token.
            asked = await state.store.open_approval(uuid.UUID(target))
            if asked is None:
                raise _plain(409, f"job {target} waits on no approval request now")
            who, _ = principal(request)
            if who is None:
                raise web.HTTPSeeOther("/login?" + urlencode({"next": request.path}))
            return _render(request, "confirm.html", action=action, kind=kind,
                           target=target, detail=f"{asked['action']}: {asked['summary']}",
                           label=JOB_ACTIONS[action], asked=asked)
    else:
        target, kind, detail = _tool(request), "tool", ""
    who, _ = principal(request)
    if who is None:
        raise web.HTTPSeeOther("/login?" + urlencode({"next": request.path}))
    return _render(request, "confirm.html", action=action, kind=kind, target=target,
                   detail=detail, label=(JOB_ACTIONS | TOOL_ACTIONS)[action], asked=None)


def _by(who: str) -> str:
    """The ``by`` a web action is journaled with: the principal, and where it acted."""
    return f"sidecar web ({who})"


async def job_action(request: web.Request) -> web.Response:
    form = await _form(request)
    who = _require_admin(request, form)
    state = request.app[STATE]
    job_id = _job_id(request)
    action = request.match_info["action"]
    if action in ("approve", "deny"):
        attempt, token = _form_int(form, "attempt"), _form_int(form, "token")
        reason = form.get("reason") or None
        try:
            outcome = await state.store.answer_approval(job_id, attempt, token,
                                                        action == "approve", reason, _by(who))
        except UsageError as exc:  # the database's check of the reason, one line
            raise BadInput(f"form field reason: {exc}") from None
        changed = outcome in ("approved", "denied")
        log_mod.log.emit("web_action", action=action, principal=who, job_id=str(job_id),
                         changed=changed, outcome=outcome)
        raise web.HTTPSeeOther(f"/jobs/{job_id}?done={outcome if changed else 'refused'}")
    if action == "cancel":
        changed = bool(await state.store.cancel(job_id, by=_by(who)))
        done = "cancelled"
    else:
        # F14: a job cancelled while it ran is retried once its owner killed the tree or
        # the lease it held ended, as `sidecar retry` does.
        rows, _ = await state.store.retry_when_acknowledged(job_id, None, None, _by(who))
        changed, done = bool(rows), "retried"
    log_mod.log.emit("web_action", action=action, principal=who, job_id=str(job_id),
                     changed=changed)
    raise web.HTTPSeeOther(f"/jobs/{job_id}?done={done if changed else 'nothing'}")


def _form_int(form: dict[str, str], name: str) -> int:
    """A form field that must be a whole number (an approval's attempt and token)."""
    text = form.get(name, "")
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise BadInput(f"form field {name}: a whole number (the request's {name})")
    return int(text)


async def tool_action(request: web.Request) -> web.Response:
    form = await _form(request)
    who = _require_admin(request, form)
    state = request.app[STATE]
    tool = _tool(request)
    action = request.match_info["action"]
    if action == "pause":
        reason = form.get("reason") or None
        if reason is not None:
            from sidecar.protocol import flow

            try:
                reason = flow.check_reason(reason)
            except UsageError as exc:
                raise BadInput("form field reason: " + exc.message) from None
        if not (await state.store.known_tools(tool, 0))[0]:  # a typed URL's typo (issue 41)
            raise BadInput(f"tool {tool}: no job, limit or sidecar of it was ever seen; "
                           "pause a new tool ahead of its first job with sidecar pause --new")
        await state.store.pause(tool, reason, _by(who))
        changed, done = True, "paused"
    else:
        changed, done = await state.store.resume(tool, _by(who)), "resumed"
    log_mod.log.emit("web_action", action=action, principal=who, tool=tool, changed=changed)
    raise web.HTTPSeeOther(f"/tools?done={done if changed else 'nothing'}")


# --- logging in -----------------------------------------------------------------------------

# A path of this server as a login's "next": printable ASCII without a space or a
# backslash (a browser's URL parser drops tabs and newlines and reads "\\" as "/", so
# "/\t/evil" or "/\\evil" would leave for another host), not starting "//".
_NEXT = re.compile(r"/(?![/\\])[!-\[\]-~]*")


def _next(text: str | None) -> str:
    """Where a login goes back to: a path of this server only (_NEXT, at most
    MAX_PARAM_CHARS), else ``/tools``."""
    if text and len(text) <= MAX_PARAM_CHARS and _NEXT.fullmatch(text):
        return text
    return "/tools"


async def login_page(request: web.Request) -> web.Response:
    if request.app[STATE].tokens is None:
        raise _plain(403, "read-only: this server has no admin tokens (set "
                          "SIDECAR_WEB_TOKEN_FILE to allow logging in)")
    return _render(request, "login.html", next=_next(_param(request, "next")), failed=False)


async def login(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.tokens is None:
        raise _plain(403, "read-only: this server has no admin tokens")
    form = await _form(request)
    who = await check_token(request, form.get("token", "").strip())
    if who is None:
        log_mod.log.emit("web_login_refused", "warning", remote=source_of(request))
        return _render(request, "login.html", status=401, next=_next(form.get("next")),
                       failed=True)
    key = secrets.token_urlsafe(32)
    await state.store.web_session_create(_sha256(key), who, secrets.token_urlsafe(32),
                                         SESSION_SECONDS, MAX_SESSIONS_PER_PRINCIPAL,
                                         MAX_SESSIONS)
    response = _see_other(_next(form.get("next")))
    response.set_cookie(SESSION_COOKIE, key, max_age=SESSION_SECONDS, httponly=True,
                        samesite="Strict", secure=request.secure, path="/")
    log_mod.log.emit("web_login", principal=who)
    return response


async def logout(request: web.Request) -> web.Response:
    form = await _form(request)
    _, found = principal(request)
    if found is not None and hmac.compare_digest(form.get("csrf", "").encode(),
                                                 found.csrf.encode()):
        # the row goes: the cookie is no session on any replica from now on
        await request.app[STATE].store.web_session_delete(found.key_sha256)
    response = _see_other("/tools")
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


def _see_other(location: str) -> web.Response:
    """A 303 to ``location`` as a plain response (one that keeps the cookies it sets)."""
    return web.Response(status=303, headers={"Location": location})


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    types = {"web.css": "text/css", "refresh.js": "text/javascript"}
    if name not in types:
        raise _plain(404, "no such file")
    body = resources.files("sidecar.ops").joinpath("web_templates", "static", name).read_bytes()
    response = web.Response(body=body, content_type=types[name], charset="utf-8")
    response.headers["Cache-Control"] = "max-age=300"
    return response


# --- the application ------------------------------------------------------------------------

def _host_allowed(host: str, allowed: frozenset[str]) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return parsing.is_loopback(name) or host in allowed or name in allowed \
        or f"{name}:*" in allowed


@web.middleware
async def guard_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Security headers on every answer; a Host header that is not loopback or allowed
    refused (DNS rebinding); a POST from another origin refused; bad input, a missing
    job and a database failure each one line of text."""
    state = request.app[STATE]
    try:
        if not _host_allowed(request.host, state.allowed_hosts):
            raise _plain(403, f"Host {request.host[:80]!r} is not allowed; start sidecar "
                              "web with --allowed-host for a name other than loopback")
        if request.method == "POST":
            # A browser names where a form came from in Sec-Fetch-Site even when the page
            # hides its origin ("null" under no-referrer): another site, or another port
            # of this host (the same site, to which a SameSite cookie is still sent).
            if request.headers.get("Sec-Fetch-Site", "same-origin") not in (
                    "same-origin", "none"):
                raise _plain(403, "Sec-Fetch-Site: a form of another site or port; actions "
                                  "are taken from this server's own pages only")
            origin = request.headers.get("Origin")
            if origin is not None and origin != "null" and \
                    origin.split("://", 1)[-1] != request.host:
                raise _plain(403, "Origin: a form of another site; actions are taken from "
                                  "this server's own pages only")
        if not request.path.startswith("/static/"):
            request[WHO] = await identify(request)
        response = await handler(request)
    except BadInput as exc:
        response = _as_response(_plain(400, exc.message))
    except web.HTTPException as exc:  # an error or a redirect, answered as a response
        response = _as_response(exc)
    except db.DATABASE_ERRORS as exc:
        log_mod.log.emit("web_error", "warning", reason=db.describe_error(exc))
        # the page names no host, port, user or database (issue 41, as sidecar mcp)
        said = masking.mask_database(db.describe_error(exc), [state.settings.database_url])
        response = _as_response(_plain(503, f"database unavailable: {said}"))
    except TimeoutError:
        response = _as_response(_plain(503, "database unavailable: no answer in time"))
    except Exception as exc:  # a bug or a row of a shape no page expects: one line, logged
        log_mod.log.emit("web_error", "error", reason=f"{type(exc).__name__}: {exc}"[:300],
                         path=request.path[:200])
        response = web.Response(status=500, text="internal error: the server's log has "
                                "the reason (event web_error)\n", content_type="text/plain")
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def _as_response(exc: web.HTTPException) -> web.Response:
    return web.Response(status=exc.status, body=exc.body, headers=exc.headers)


def make_app(store: OperatorStore, settings: Settings, admin_tokens: dict[str, str] | None,
             allowed_hosts: tuple[str, ...] = (),
             trusted_proxies: tuple[IPNetwork, ...] = ()) -> web.Application:
    """The web view's aiohttp application on ``store`` (its schema checked). ``admin_tokens``:
    ``{token: principal}`` (sidecar.runtime.tokens.load_tokens), None for a read-only server;
    ``allowed_hosts``: Host headers accepted besides loopback (``name``, ``name:port``
    or ``name:*``); ``trusted_proxies``: the proxies whose X-Forwarded-For names the
    source of a failed login (``source_of``; none: the peer is the source)."""
    app = web.Application(middlewares=[guard_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = WebState(store, settings, admin_tokens, frozenset(allowed_hosts),
                          make_templates(), WebMetrics(), tuple(trusted_proxies))
    app.router.add_get("/", _root)
    app.router.add_get("/tools", tools_page)
    app.router.add_get("/running", running_page)
    app.router.add_get("/jobs", jobs_page)
    app.router.add_get("/sessions", sessions_page)
    app.router.add_get("/jobs/{job_id}", job_page)
    app.router.add_get("/jobs/{job_id}/{action:cancel|retry|approve|deny}", confirm_page)
    app.router.add_post("/jobs/{job_id}/{action:cancel|retry|approve|deny}", job_action)
    app.router.add_get("/tools/{tool}/{action:pause|resume}", confirm_page)
    app.router.add_post("/tools/{tool}/{action:pause|resume}", tool_action)
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/metrics", metrics_page)
    return app


async def metrics_page(request: web.Request) -> web.Response:
    """The web view's own counters (WebMetrics) in Prometheus' text format."""
    response = web.Response(body=generate_latest(request.app[STATE].metrics.registry))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def _root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/tools")


def check_exposure(host: str, admin_tokens: dict[str, str] | None) -> None:
    """Refuse to serve beyond loopback without admin tokens: a read-only server shows
    payload and result content to whoever reaches it, and a client names any Host it
    likes, so only the listening address tells who can. UsageError (exit 2) naming
    --listen and the fix; loopback (sidecar.protocol.parsing.is_loopback: 127.0.0.0/8, ::1,
    localhost) always passes."""
    if admin_tokens is None and not parsing.is_loopback(host):
        raise UsageError(f"--listen {host}: beyond loopback, sidecar web needs "
                         "SIDECAR_WEB_TOKEN_FILE (else payloads and results are open to "
                         "whoever reaches it); set it, or listen on 127.0.0.1")


async def serve(settings: Settings, host: str, port: int,
                admin_tokens: dict[str, str] | None,
                allowed_hosts: tuple[str, ...] = (),
                trusted_proxies: tuple[IPNetwork, ...] = ()) -> int:
    """Check the schema (SchemaMismatch before listening when it is older than this
    sidecar or missing; the web view never migrates), serve the web view until SIGTERM
    or SIGINT, return 0 (``trusted_proxies`` as make_app's). Prints
    ``sidecar: web listening on http://HOST:PORT`` on stderr once it serves, and logs
    ``web_started``."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    dsn = db.resolve_dsn(settings)
    # Every value a page shows of a row is scrubbed of these (the store's reads are
    # ``shown``), in rows written before scrubbing existed too (issue 41).
    register_secrets(settings, dsn, "web")
    pool = await db.create_pool(dsn, settings.db_timeout_seconds, max_size=4)
    try:
        store = OperatorStore(pool, settings.db_timeout_seconds)
        await schema.require_current(store)
        runner = web.AppRunner(make_app(store, settings, admin_tokens, allowed_hosts,
                                        trusted_proxies),
                               access_log=None, shutdown_timeout=5)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as exc:
                raise SidecarError(f"sidecar web cannot listen on {host}:{port}: "
                                   f"{exc.strerror or exc}") from None
            bound_host, bound_port = runner.addresses[0][:2]
            url = f"http://{parsing.format_host_port(bound_host, bound_port)}"
            log_mod.log.emit("web_started", url=url,
                             read_only=admin_tokens is None,
                             principals=len(admin_tokens or {}))
            print(f"sidecar: web listening on {url}",
                  file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await pool.close()
    return 0
