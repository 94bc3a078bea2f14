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


# --- the secrets the sidecar knows, scrubbed from whatever leaves the process ----------------

SECRET_MARK = "[secret]"
# A value shorter than this is never registered: it protects nothing, and scrubbing it
# would mangle every text (a password "pw" would turn every "pw" into the marker).
MIN_SECRET_CHARS = 4
# Up to this many characters ``holds`` runs one compiled alternation; beyond, one
# ``bytes.find`` per spelling (measured: 15 ms for 19 spellings over a 6 MB result, where
# the alternation takes 58 ms; 2 us against 8 us for a 170-byte log line).
REGEX_LIMIT = 64 * 1024
# The alternation is compiled only once a set of secrets has been searched this many
# times; until then each search is one ``in`` per spelling. Compiling costs about 300 us
# per kind (str, bytes) for a set of 11 spellings, and the guard changes the set twice
# per attempt (its token in, its token out): compiled at once, the no-op jobs of bench
# section 1 spent 0.4 ms of sidecar CPU each on compiles. A find costs a few us more than
# the compiled search, so an unchanging set still gets its alternation after these few.
REGEX_AFTER_SEARCHES = 16


def secret_forms(value: str) -> tuple[str, ...]:
    """The spellings of ``value`` that text a tool writes may hold, longest first: the
    value itself, JSON-escaped as orjson writes it (UTF-8 kept) and as Python's
    ``json.dumps`` does by default (non-ASCII as ``\\uXXXX``), each also with ``/``
    escaped as ``\\/`` (PHP's json_encode). Deliberate encodings (base64, hex) are not
    found: what this catches is a tool that echoes what it read."""
    escaped = orjson.dumps(value).decode()[1:-1]
    ascii_escaped = json.dumps(value)[1:-1]
    forms = {value, escaped, ascii_escaped}
    forms |= {form.replace("/", "\\/") for form in forms}
    return tuple(sorted(forms, key=len, reverse=True))


@dataclass(frozen=True)
class _Snapshot:
    """One immutable view of the registry (swapped whole on every change, so threads
    that scrub while the event loop adds a token see either the old or the new set)."""

    forms: tuple[str, ...] = ()                    # longest first
    labels: Mapping[str, str] = field(default_factory=dict)  # form -> label
    encoded: tuple[tuple[bytes, str], ...] = ()    # (UTF-8 form, label)
    compiled: dict[type, re.Pattern] = field(default_factory=dict)  # on first use
    # Searches of this snapshot so far (an estimate: threads may race on it).
    searches: list[int] = field(default_factory=lambda: [0])

    def search(self, data: str | bytes | bytearray) -> bool:
        """True when ``data`` (text or UTF-8 bytes, at most REGEX_LIMIT characters) holds
        any form: the compiled alternation once this snapshot has been searched
        REGEX_AFTER_SEARCHES times, one ``in`` per form before that (same answer)."""
        kind = str if isinstance(data, str) else bytes
        pattern = self.compiled.get(kind)
        if pattern is None:
            self.searches[0] += 1
            if self.searches[0] <= REGEX_AFTER_SEARCHES:
                if kind is str:
                    return any(form in data for form in self.forms)
                return any(form in data for form, _ in self.encoded)
            pattern = self.regex(kind)
        return pattern.search(data) is not None

    def regex(self, kind: type = str) -> re.Pattern:
        """One alternation of every form, longest first (for ``str`` or ``bytes``)."""
        pattern = self.compiled.get(kind)
        if pattern is None:
            if kind is str:
                pattern = re.compile("|".join(map(re.escape, self.forms)))
            else:
                pattern = re.compile(b"|".join(re.escape(f) for f, _ in self.encoded))
            self.compiled[kind] = pattern
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
    text that holds a secret (text that holds none is returned as it is). The alternation
    of a set is compiled only once that set has been searched REGEX_AFTER_SEARCHES times.
    With no secret registered both return at once."""

    def __init__(self) -> None:
        # key -> (label, the spellings of its values): each value's secret_forms are
        # worked out once, when it is added, not again at every change of another key.
        self._groups: dict[Hashable, tuple[str, tuple[str, ...]]] = {}
        self._snapshot = _Snapshot()

    def add(self, key: Hashable, label: str, values: Iterable[str]) -> None:
        """Register ``values`` (strings; shorter than MIN_SECRET_CHARS ignored) under
        ``key``, replacing what ``key`` held."""
        kept = tuple(v for v in values if v and len(v) >= MIN_SECRET_CHARS)
        self._groups[key] = (label, tuple(form for value in kept
                                          for form in secret_forms(value)))
        self._rebuild()

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s values; an unknown key is ignored."""
        if self._groups.pop(key, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        labels: dict[str, str] = {}
        for label, forms in self._groups.values():
            for form in forms:
                labels.setdefault(form, label)
        forms = tuple(sorted(labels, key=len, reverse=True))
        self._snapshot = _Snapshot(forms, labels,
                                   tuple((f.encode("utf-8", "surrogatepass"), labels[f])
                                         for f in forms))

    def __bool__(self) -> bool:
        return bool(self._snapshot.forms)

    def holds(self, data: str | bytes | bytearray) -> bool:
        """True when ``data`` (text or UTF-8 bytes) holds a registered secret in any
        spelling. For short data one compiled search (a log line: about 2 us) once the set
        of secrets has been searched REGEX_AFTER_SEARCHES times, one ``in`` per spelling
        before that (a few us, no compile); one ``bytes.find`` per spelling beyond
        REGEX_LIMIT characters (faster there)."""
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
        # Text that holds no secret (nearly all) is left as it is, without an alternation
        # compiled for it (REGEX_AFTER_SEARCHES).
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


# The process-wide registry: filled by the worker (sidecar.worker) and the guard
# (sidecar.guard), read by the log (sidecar.log), the jsonb encoder (sidecar.db) and the
# result check (sidecar.results).
SECRETS = SecretRegistry()
