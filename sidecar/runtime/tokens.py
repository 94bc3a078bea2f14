"""Bearer tokens of the operator-facing servers: ``sidecar mcp``'s (SIDECAR_MCP_TOKEN_FILE,
issue 29) and ``sidecar web``'s admin tokens (SIDECAR_WEB_TOKEN_FILE, issue 30). One file
format for both: one ``PRINCIPAL TOKEN`` line each, blank lines and ``#`` comments skipped.

Errors: ConfigError (exit 2), one line naming the variable and the line, never a token.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

from sidecar.protocol.errors import ConfigError

# Largest token file (bytes).
MAX_TOKEN_FILE_BYTES = 64 * 1024
# Shortest token accepted: 32 characters (a `openssl rand -hex 16` makes one).
MIN_TOKEN_CHARS = 32
PRINCIPAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,62}")


def read_bounded(what: str, path: str, limit: int, fix: str) -> bytes:
    """The bytes of ``path``, at most ``limit``; ConfigError naming ``what`` when it
    cannot be read (with ``fix``) or is larger."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it ({exc.strerror or exc}); {fix}") from None
    if len(data) > limit:
        raise ConfigError(f"{what}: larger than {limit} bytes")
    return data


def load_tokens(path: str, variable: str) -> dict[str, str]:
    """``{token: principal}`` from the file ``path`` that ``variable`` names (for the
    messages): one ``PRINCIPAL TOKEN`` per line (blank lines and ``#`` comments skipped).
    A principal is 1-63 letters, digits, ``.``, ``_``, ``@`` or ``-``; a token at least
    MIN_TOKEN_CHARS printable ASCII characters. ConfigError when the file is unreadable,
    larger than MAX_TOKEN_FILE_BYTES, empty, or a line, principal or token is malformed or
    repeated (the message names the line, never a token)."""
    var = f"{variable}={path}"
    data = read_bounded(var, path, MAX_TOKEN_FILE_BYTES, "mount the Secret there")
    try:
        text = data.decode("utf-8-sig")  # a byte order mark (some editors write one) is not text
    except UnicodeDecodeError:
        raise ConfigError(f"{var}: not UTF-8 text") from None
    tokens: dict[str, str] = {}
    principals: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{var}: line {number}: write PRINCIPAL TOKEN (two words)")
        principal, token = parts
        if not PRINCIPAL.fullmatch(principal):
            raise ConfigError(f"{var}: line {number}: the principal must be 1-63 letters, "
                              "digits, '.', '_', '@' or '-'")
        if len(token) < MIN_TOKEN_CHARS or not token.isprintable() or not token.isascii():
            raise ConfigError(f"{var}: line {number}: the token must be at least "
                              f"{MIN_TOKEN_CHARS} printable ASCII characters "
                              "(e.g. `openssl rand -hex 32`)")
        if principal in principals:
            raise ConfigError(f"{var}: line {number}: principal {principal} given twice")
        if token in tokens:
            raise ConfigError(f"{var}: line {number}: the same token as another line")
        principals.add(principal)
        tokens[token] = principal
    if not tokens:
        raise ConfigError(f"{var}: no token in it; write one PRINCIPAL TOKEN line")
    return tokens


def principal_of(tokens: Mapping[str, str], presented: str) -> str | None:
    """The principal whose token ``presented`` is, or None. Compares with every token in
    constant time each (hmac.compare_digest), so timing tells nothing of a token."""
    found = None
    given = presented.encode("utf-8", "surrogatepass")
    for token, principal in tokens.items():
        if hmac.compare_digest(token.encode(), given):
            found = principal
    return found
