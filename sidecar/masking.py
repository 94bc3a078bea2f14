"""Secrets masked in one place: every credential the sidecar shows is replaced by ``***``.

Two shapes of text carry secrets. A URL or DSN the operator configured (the database's,
a RESULT_URL, a redirect's Location) is shown with ``mask_url``. Free text (a driver's
error message, a library's log line) goes through ``mask_text``, which masks the
credentials of any URLs it is given and every bearer/basic/``token=`` credential.

Pure: string work only, no I/O, no sidecar imports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

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
