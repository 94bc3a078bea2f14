"""Secrets masked in one place: every credential the sidecar shows is replaced by ``***``,
and every secret value it knows is scrubbed (``SECRETS``) from what leaves the process.

Two shapes of text carry secrets. A URL or DSN the operator configured (the database's,
a RESULT_URL, a redirect's Location) is shown with ``mask_url``. Free text (a driver's
error message, a library's log line) goes through ``mask_text``, which masks the
credentials of any URLs it is given and every bearer/basic/``token=`` credential.

The third shape is a secret *value* in text the sidecar did not write: a tool's stderr
that echoes the mounted database Secret, a guard token in a result (issue 25). The
process-wide ``SECRETS`` registry knows those values (the worker adds the database URL and
its password, the guard each attempt's token) and replaces them with ``[secret]`` in the
log, the journal and the job row's ``error`` (``SecretRegistry.scrub``); the supervisor
refuses a result that holds one (``SecretRegistry.labels_in``, kind ``secret_in_output``).

Pure: string work only, no I/O, no sidecar imports (the registry is state, never I/O).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

# Query parameters whose value is a credential: password=, sslpassword=, token=,
# access_token=, api_key=, client_secret=, signature=, X-Amz-Credential=, auth=, ...
_SECRET_KEY = r"[^=&#\s]*(?:pass|secret|token|key|sig|auth|credential)[^=&#\s]*"
# A secret value runs to the next "&name=" (an "&" not starting a parameter is part of it).
_SECRET_PARAM = re.compile(rf"([?&]{_SECRET_KEY}=)(?:[^&#]|&(?![^=&#]*=))*", re.IGNORECASE)
_SECRET_WORD = re.compile(rf"\b({_SECRET_KEY})\s*=\s*(?:'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
# Credentials a library may quote in a log message (aiohttp echoes a bad request's headers).
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic|token)(\s+|=)[^\s'\",;]+")

MASK = "***"


def mask_url(dsn: str) -> str:
    """A DSN or URL with its credentials replaced by ``***``: the userinfo password, the
    user of an http(s) URL without a password (a token in the user part), and the values of
    query parameters (or ``key=value`` words of a libpq DSN) that name a password, token,
    key, secret or signature.

    Secret query values are masked first, then the userinfo: everything between
    ``scheme://`` and the *last* ``@``, so a password holding ``/``, ``?``, ``#`` or ``@``
    unencoded (which URL parsers cut short) is masked whole. The rest is kept as written.
    Never raises."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:  # not a URL: perhaps a libpq "host=... password=..." string
        return _SECRET_WORD.sub(rf"\1={MASK}", dsn)
    rest = _SECRET_PARAM.sub(rf"\1{MASK}", rest)
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return f"{scheme}://{rest}"
    user, colon, _password = userinfo.partition(":")
    if colon:
        userinfo = f"{user}:{MASK}"
    elif scheme.lower() in ("http", "https"):
        userinfo = MASK
    return f"{scheme}://{userinfo}@{host}"


def url_secrets(dsn: str) -> list[str]:
    """The credentials ``mask_url`` hides in ``dsn`` (the userinfo password, secret query
    values), longest first, so messages built from the raw URL can be scrubbed too."""
    found: list[str] = []
    scheme, sep, rest = dsn.partition("://")
    if sep:
        userinfo, at, _host = rest.rpartition("@")
        if at and ":" in userinfo:
            found.append(userinfo.partition(":")[2])
        found += [m.group(0)[len(m.group(1)):] for m in _SECRET_PARAM.finditer(rest)]
    else:
        found += [m.group(0).split("=", 1)[1].strip().strip("'") for m in
                  _SECRET_WORD.finditer(dsn)]
    return sorted({s for s in found if s}, key=len, reverse=True)


def mask_text(text: str, urls: Iterable[str] = ()) -> str:
    """Free ``text`` (an error message, a library's log line) with its secrets replaced by
    ``***``: each of ``urls`` that appears whole is shown as ``mask_url`` shows it, any
    piece of their credentials (``url_secrets``: a driver may quote a piece of a
    malformed URL) is masked, and so is every bearer/basic credential and ``token=``
    value. Never raises."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, mask_url(url))
        for secret in url_secrets(url):
            text = text.replace(secret, MASK)
    return _CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)


# Where a database is, in a driver's words: `host "db"`, `server at "db" (10.0.0.5)`,
# `port 5432`, `user "app"`, `role "app"`, `database "jobs"`, `socket "/run/.s.PGSQL.5432"`.
_DB_NAMED = re.compile(r'(?i)\b(host|server at|user|role|database|dbname|socket)'
                       r'(\s*=?\s*)("[^"]*"|\'[^\']*\')')
_DB_PORT = re.compile(r"(?i)\b(port)(\s*=?\s*)(\d+)")
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}(?![\w:])", re.IGNORECASE)
# Shorter names of a DSN are masked only where a driver quotes them (`user "pg"`): a
# one- or two-letter word would mask every such word of the text.
_MIN_NAME_CHARS = 3


def database_names(dsn: str) -> list[str]:
    """The host(s), port(s), user and database name a PostgreSQL URL or libpq
    ``key=value`` DSN names, longest first (what ``mask_database`` hides). Never raises."""
    def unquote(text: str) -> str:  # %XX escapes (no urllib: this module stays pure)
        return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), text)

    found: list[str] = []
    scheme, sep, rest = dsn.partition("://")
    if sep:
        rest, _, query = rest.partition("?")
        userinfo, at, location = rest.rpartition("@")
        if at:
            found.append(unquote(userinfo.partition(":")[0]))
        hosts, _, database = location.partition("/")
        found.append(unquote(database))
        for hostport in hosts.split(","):
            host, port = (hostport[1:].split("]", 1) if hostport.startswith("[")
                          else hostport.rsplit(":", 1) if hostport.count(":") == 1
                          else (hostport, ""))
            found += [unquote(host), port.lstrip(":")]
        pairs = [(unquote(k), unquote(v)) for k, _, v in
                 (item.partition("=") for item in query.split("&") if item)]
    else:
        pairs = [(m.group(1), m.group(2).strip("'")) for m in
                 re.finditer(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn)]
    for key, value in pairs:
        if key.lower() in ("host", "hostaddr", "port", "user", "dbname"):
            found += value.split(",")
    return sorted({name for name in found if name}, key=len, reverse=True)


def mask_database(text: str, dsns: Iterable[str] = ()) -> str:
    """``text`` (an error a caller will read: the MCP gateway's, issue 41) with where the
    database is replaced by ``***``: every host, port, user and database name of ``dsns``
    (``database_names``), the quoted host, user, role, database and socket and the port a
    driver's message names, and every IP address; credentials as ``mask_text``. Never
    raises."""
    dsns = [dsn for dsn in dsns if dsn]
    text = mask_text(text, dsns)
    for dsn in dsns:
        for name in database_names(dsn):
            if len(name) < _MIN_NAME_CHARS:
                continue
            if name.isdigit():
                text = re.sub(rf"(?<!\d){re.escape(name)}(?!\d)", MASK, text)
            else:
                text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", MASK, text)
    text = _DB_NAMED.sub(lambda m: f"{m.group(1)}{m.group(2)}\"{MASK}\"", text)
    text = _DB_PORT.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", text)
    text = _IPV4.sub(MASK, text)
    # an IPv6 address has "::" or seven colons (a time of day has two)
    return _IPV6.sub(lambda m: MASK if "::" in m.group(0) or m.group(0).count(":") == 7
                     else m.group(0), text)


# --- the secrets the sidecar knows, scrubbed from whatever leaves the process ----------------

SECRET_MARK = "[secret]"
# A value shorter than this is never registered: it protects nothing, and scrubbing it
# would mangle every text (a password "pw" would turn every "pw" into the marker).
MIN_SECRET_CHARS = 4
# Up to this many characters ``holds`` runs one compiled alternation; beyond, one
# ``bytes.find`` per spelling (measured: 15 ms for 19 spellings over a 6 MB result, where
# the alternation takes 58 ms; 2 us against 8 us for a 170-byte log line).
REGEX_LIMIT = 64 * 1024
# A group of spellings (one ``add``: the database URL and its password, or one attempt's
# guard token) is searched with one ``in`` per spelling until it has been searched this
# many times, then by its own compiled alternation (about 300 us per kind, str or bytes,
# for 11 spellings). Each group compiles at most once in its life, so a guard token coming
# and going (twice per attempt) never recompiles the database URL's alternation: when the
# whole set was one alternation, rebuilt at every change, the no-op jobs of bench section
# 1 spent 0.4 ms of sidecar CPU each on compiles, and still about 10 % of the event
# loop's time at 1x8 with the search threshold (issue 28's profile).
REGEX_AFTER_SEARCHES = 16
# A group with at most this many spellings is never compiled: that many ``in`` tests cost
# no more than one compiled search (a guard token is one spelling: URL-safe base64).
INLINE_FORMS = 4


# The printable ASCII characters some JSON encoder escapes: the quote, the backslash and
# (PHP's json_encode) the slash.
_ESCAPED_ASCII = frozenset('"\\/')


def secret_forms(value: str) -> tuple[str, ...]:
    """The spellings of ``value`` that text a tool writes may hold, longest first: the
    value itself, JSON-escaped as orjson writes it (UTF-8 kept) and as Python's
    ``json.dumps`` does by default (non-ASCII as ``\\uXXXX``), each also with ``/``
    escaped as ``\\/`` (PHP's json_encode). Deliberate encodings (base64, hex) are not
    found: what this catches is a tool that echoes what it read."""
    if value.isascii() and value.isprintable() and not _ESCAPED_ASCII.intersection(value):
        return (value,)  # every encoder writes it as it is (a guard token: URL-safe base64)
    escaped = orjson.dumps(value).decode()[1:-1]
    ascii_escaped = json.dumps(value)[1:-1]
    forms = {value, escaped, ascii_escaped}
    forms |= {form.replace("/", "\\/") for form in forms}
    return tuple(sorted(forms, key=len, reverse=True))


@dataclass(frozen=True)
class _Group:
    """The spellings of one ``add`` (one key), fixed for the key's life, and the
    alternations compiled of them on first need (per kind: ``str`` or ``bytes``)."""

    label: str
    forms: tuple[str, ...]                         # longest first
    encoded: tuple[bytes, ...]                     # UTF-8, same order
    compiled: dict[type, re.Pattern] = field(default_factory=dict)
    # Searches of this group so far (an estimate: threads may race on it).
    searches: list[int] = field(default_factory=lambda: [0])

    def search(self, data: str | bytes | bytearray, text: bool) -> bool:
        """True when ``data`` (``text``: a str; else UTF-8 bytes) holds one of the
        spellings: one ``in`` per spelling until this group has been searched
        REGEX_AFTER_SEARCHES times, its compiled alternation after (same answer)."""
        forms = self.forms if text else self.encoded
        kind = str if text else bytes
        pattern = self.compiled.get(kind)
        if pattern is None:
            self.searches[0] += 1
            if self.searches[0] <= REGEX_AFTER_SEARCHES:
                return any(form in data for form in forms)
            if text:
                pattern = re.compile("|".join(map(re.escape, forms)))
            else:
                pattern = re.compile(b"|".join(map(re.escape, forms)))
            self.compiled[kind] = pattern
        return pattern.search(data) is not None


@dataclass(frozen=True)
class _Snapshot:
    """One immutable view of the registry (swapped whole on every change, so threads
    that scrub while the event loop adds a token see either the old or the new set).
    Its groups are shared with the snapshots before and after: what a group compiled
    stays compiled across changes of other keys."""

    # The spellings of every group of at most INLINE_FORMS (a guard token each), searched
    # one ``in`` at a time, and the larger groups, searched each by its own alternation.
    inline: tuple[str, ...] = ()
    inline_encoded: tuple[bytes, ...] = ()
    groups: tuple[_Group, ...] = ()
    forms: tuple[str, ...] = ()                    # every group's, longest first
    labels: Mapping[str, str] = field(default_factory=dict)  # form -> label
    encoded: tuple[tuple[bytes, str], ...] = ()    # (UTF-8 form, label)
    compiled: dict[type, re.Pattern] = field(default_factory=dict)  # on first use

    def search(self, data: str | bytes | bytearray) -> bool:
        """True when ``data`` (text or UTF-8 bytes, at most REGEX_LIMIT characters) holds
        any form: each spelling of the small groups, then ``_Group.search`` of each larger
        group."""
        text = isinstance(data, str)
        for form in self.inline if text else self.inline_encoded:
            if form in data:
                return True
        return any(group.search(data, text) for group in self.groups)

    def regex(self) -> re.Pattern:
        """One alternation of every form, longest first, for replacing them in text: only
        text that holds a secret (rare) or is longer than REGEX_LIMIT needs it."""
        pattern = self.compiled.get(str)
        if pattern is None:
            pattern = re.compile("|".join(map(re.escape, self.forms)))
            self.compiled[str] = pattern
        return pattern


class SecretRegistry:
    """Every secret value the sidecar knows, in one place, and the one scrubber that
    replaces them with ``SECRET_MARK`` before text leaves the process (the journal, the
    job row's ``error``, the log).

    The worker adds the database URL and its password pieces (``config.secret_values``),
    the guard adds each attempt's token at its registration and discards it at its end.
    Values are grouped under a ``key`` (anything hashable, so two workers or two attempts
    never remove each other's) with a ``label`` that names the kind of secret in
    messages (``database_url``, ``guard_token``): the label is shown, never the value.

    Cost: finding is one ``bytes.find`` per spelling (``secret_forms``), so checking a
    multi-MB result costs a few scans of it; scrubbing is one compiled alternation over
    text that holds a secret (text that holds none is returned as it is). Short text is
    searched key by key: each key's own alternation, compiled once that key has been
    searched REGEX_AFTER_SEARCHES times (never for a key of INLINE_FORMS spellings or
    fewer, such as a guard token), so adding or discarding one key recompiles nothing.
    With no secret registered both return at once."""

    def __init__(self) -> None:
        # key -> (label, the spellings of its values): each value's secret_forms are
        # worked out once, when it is added, not again at every change of another key.
        self._groups: dict[Hashable, _Group] = {}
        self._snapshot = _Snapshot()

    def add(self, key: Hashable, label: str, values: Iterable[str]) -> None:
        """Register ``values`` (strings; shorter than MIN_SECRET_CHARS ignored) under
        ``key``, replacing what ``key`` held."""
        kept = tuple(v for v in values if v and len(v) >= MIN_SECRET_CHARS)
        forms = tuple(sorted({form for value in kept for form in secret_forms(value)},
                             key=len, reverse=True))
        self._groups[key] = _Group(label, forms, tuple(f.encode("utf-8", "surrogatepass")
                                                       for f in forms))
        self._rebuild()

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s values; an unknown key is ignored."""
        if self._groups.pop(key, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        labels: dict[str, str] = {}
        for group in self._groups.values():
            for form in group.forms:
                labels.setdefault(form, group.label)
        forms = tuple(sorted(labels, key=len, reverse=True))
        small = [g for g in self._groups.values() if len(g.forms) <= INLINE_FORMS]
        self._snapshot = _Snapshot(
            tuple(form for group in small for form in group.forms),
            tuple(form for group in small for form in group.encoded),
            tuple(g for g in self._groups.values() if len(g.forms) > INLINE_FORMS),
            forms, labels,
            tuple((f.encode("utf-8", "surrogatepass"), labels[f]) for f in forms))

    def __bool__(self) -> bool:
        return bool(self._snapshot.forms)

    def holds(self, data: str | bytes | bytearray) -> bool:
        """True when ``data`` (text or UTF-8 bytes) holds a registered secret in any
        spelling. For short data, per key: one compiled search (a log line: about 2 us)
        once that key has been searched REGEX_AFTER_SEARCHES times, one ``in`` per
        spelling before that or for a key of at most INLINE_FORMS spellings (no compile);
        one ``bytes.find`` per spelling beyond REGEX_LIMIT characters (faster there)."""
        snap = self._snapshot
        if not snap.forms:
            return False
        if len(data) <= REGEX_LIMIT:
            return snap.search(data)
        return bool(self.labels_in(data))

    def labels_in(self, data: str | bytes | bytearray) -> list[str]:
        """The labels of the secrets ``data`` holds in any spelling (``secret_forms``),
        sorted; empty when it holds none. ``data`` is text or UTF-8 bytes."""
        snap = self._snapshot
        if isinstance(data, str):
            found = {snap.labels[f] for f in snap.forms if f in data}
        else:
            found = {label for form, label in snap.encoded if form in data}
        return sorted(found)

    def scrub(self, text: str, *, cut_start: bool = False, cut_end: bool = False) -> str:
        """``text`` with every registered secret (in any spelling) replaced by
        SECRET_MARK. ``cut_start``/``cut_end`` say the text was cut there from a longer
        one (a stderr tail, an over-long line): a start that ends a secret, or an end that
        begins one, is masked too, however short the piece, so a cut never leaves a
        piece of a secret behind. Never raises."""
        snap = self._snapshot
        if not snap.forms:
            return text
        # Text that holds no secret (nearly all) is left as it is, without the whole set's
        # alternation compiled for it.
        if len(text) > REGEX_LIMIT or snap.search(text):
            text = snap.regex().sub(SECRET_MARK, text)
        if cut_start:
            piece = max((k for f in snap.forms for k in range(min(len(f) - 1, len(text)), 0, -1)
                         if text.startswith(f[-k:])), default=0)
            if piece:
                text = SECRET_MARK + text[piece:]
        if cut_end:
            piece = max((k for f in snap.forms for k in range(min(len(f) - 1, len(text)), 0, -1)
                         if text.endswith(f[:k])), default=0)
            if piece:
                text = text[:-piece] + SECRET_MARK
        return text

    def scrub_value(self, value: Any) -> Any:
        """A JSON-like ``value`` (dicts, lists, tuples, strings, numbers) with every string
        in it, keys too, scrubbed (``scrub``); other values are returned as they are.
        Strings are scrubbed as values, never as serialized JSON, so the result stays
        valid whatever the secret looks like."""
        if not self._snapshot.forms:
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub_value(k): self.scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub_value(v) for v in value]
        return value


# The process-wide registry: filled by the worker (sidecar.worker.claim_loop) and the guard
# (sidecar.worker.guard), read by the log (sidecar.runtime.log), the jsonb encoder
# (sidecar.storage.db) and the
# result check (sidecar.protocol.results).
SECRETS = SecretRegistry()
