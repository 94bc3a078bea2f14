"""What ``sidecar mcp`` exposes and to whom (issue 29): the tools' MCP entries, the
bearer tokens, and the idempotency key of a call. No MCP SDK here: ``sidecar config``
checks the same files with it, and the tests run without the ``[mcp]`` extra.

A tool is exposed only when named with ``--tool`` and described by its profile:
``SIDECAR_PROFILE_<TOOL>_MCP_DESCRIPTION`` (required) and
``SIDECAR_PROFILE_<TOOL>_MCP_INPUT_SCHEMA_FILE`` (a JSON Schema of an object; default any
object). Descriptions and schemas come from the operator's environment, never from a
caller (P11, P20).

Errors: ConfigError (exit 2), one line naming the variable and the fix.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar.protocol import enqueue_args
from sidecar.protocol.errors import ConfigError
from sidecar.protocol.model import tool_env_key
from sidecar.runtime import tokens
from sidecar.runtime.config import Settings, validate_tool_name

# Largest MCP_INPUT_SCHEMA_FILE (bytes).
MAX_SCHEMA_BYTES = 256 * 1024
# The token file's rules and its constant-time lookup are shared with `sidecar web`.
MAX_TOKEN_FILE_BYTES = tokens.MAX_TOKEN_FILE_BYTES
MIN_TOKEN_CHARS = tokens.MIN_TOKEN_CHARS
PRINCIPAL = tokens.PRINCIPAL
principal_of = tokens.principal_of
# The schema of a tool that has no MCP_INPUT_SCHEMA_FILE: any JSON object.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}
# The principal of a `sidecar mcp --stdio` session: whoever started the process.
STDIO_PRINCIPAL = "stdio"
# The gateway's namespaces (issue 41 point 2): tags named mcp.* and idempotency keys
# starting mcp: are written by `sidecar mcp` only; the CLI and Client.enqueue refuse them
# (sidecar.protocol.enqueue_args), and the gateway trusts a job's mcp.* tags only with a
# valid mcp.sig (sign_tags).
RESERVED_TAG_PREFIX = enqueue_args.RESERVED_TAG_PREFIX
RESERVED_KEY_PREFIX = enqueue_args.RESERVED_KEY_PREFIX
SIG_TAG = "mcp.sig"
# SIDECAR_MCP_SECRET_FILE: its size bounds, bytes.
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
# `sidecar mcp --start-deadline`: the default, and the most it may be (30 days), seconds.
DEFAULT_START_DEADLINE_SECONDS = 600.0
MAX_START_DEADLINE_SECONDS = 30 * 86400.0


@dataclass(frozen=True)
class McpTool:
    """One tool as MCP clients see it: ``name`` (the tool's name, as in ``tool_jobs``),
    ``description`` (MCP_DESCRIPTION) and ``input_schema`` (the parsed JSON Schema)."""

    name: str
    description: str
    input_schema: Mapping[str, Any]


def load_catalog(settings: Settings, tools: Iterable[str]) -> list[McpTool]:
    """The MCP entries of ``tools`` (the ``--tool`` names, in order), each from its
    profile. ConfigError when none is given, a name repeats or is invalid, a tool has no
    MCP_DESCRIPTION, or its schema file is unreadable, too large, not JSON or not an
    object schema."""
    names = list(tools)
    if not names:
        raise ConfigError("sidecar mcp: give at least one --tool NAME (it exposes only the "
                          "tools it is given)")
    catalog: list[McpTool] = []
    seen: set[str] = set()
    for name in names:
        validate_tool_name(name)
        if name in seen:
            raise ConfigError(f"--tool {name}: given twice")
        seen.add(name)
        profile = settings.profile(name)
        key = tool_env_key(name)
        if not profile.mcp_description:
            raise ConfigError(
                f"--tool {name}: SIDECAR_PROFILE_{key}_MCP_DESCRIPTION is not set; describe "
                "the tool for MCP clients (what it does, what its arguments mean)")
        schema = (load_input_schema(f"SIDECAR_PROFILE_{key}_MCP_INPUT_SCHEMA_FILE",
                                    profile.mcp_input_schema_file)
                  if profile.mcp_input_schema_file else ANY_OBJECT)
        catalog.append(McpTool(name, profile.mcp_description, schema))
    return catalog


def load_input_schema(var: str, path: str) -> dict[str, Any]:
    """The JSON Schema in ``path`` (named by the variable ``var`` in errors): at most
    MAX_SCHEMA_BYTES of JSON, an object whose ``type`` is ``"object"`` (MCP's rule for a
    tool's inputSchema). ConfigError otherwise. Whether it is a valid schema of its
    draft is checked by the gateway, which has ``jsonschema`` (sidecar.mcp.gateway)."""
    data = tokens.read_bounded(f"{var}={path}", path, MAX_SCHEMA_BYTES,
                         "mount the schema there, or unset the variable (any object)")
    try:
        schema = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{var}={path}: not JSON ({exc})") from None
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ConfigError(f"{var}={path}: the schema must be a JSON object with "
                          '"type": "object" (MCP tool arguments are an object)')
    return schema


def load_tokens(path: str) -> dict[str, str]:
    """``{token: principal}`` from SIDECAR_MCP_TOKEN_FILE (sidecar.runtime.tokens.load_tokens: one
    ``PRINCIPAL TOKEN`` per line); ConfigError naming the variable and the line."""
    return tokens.load_tokens(path, "SIDECAR_MCP_TOKEN_FILE")


def load_secret(secret_file: str, token_file: str) -> bytes:
    """The secret the gateway's ``mcp.*`` tags and ``mcp:`` keys are signed with (issue 41
    point 2: any producer, on the same database role, could write them): from
    SIDECAR_MCP_SECRET_FILE when set (at least 32 bytes; the replicas of one gateway share
    it, and it outlives token rotations), else from SIDECAR_MCP_TOKEN_FILE's text (which
    no other producer reads; changing the file then hides the tasks made before), else
    (``--stdio`` without either) a random one per process. ConfigError naming the
    variable when the file is unreadable, too large or too short."""
    if secret_file:
        data = tokens.read_bounded("SIDECAR_MCP_SECRET_FILE", secret_file, MAX_SECRET_BYTES,
                                   "mount the Secret there")
        if len(data.strip()) < MIN_SECRET_BYTES:
            raise ConfigError(f"SIDECAR_MCP_SECRET_FILE={secret_file}: give at least "
                              f"{MIN_SECRET_BYTES} bytes of secret (e.g. openssl rand -hex 32)")
        return gateway_secret(data.strip())
    if token_file:
        return gateway_secret(tokens.read_bounded(
            "SIDECAR_MCP_TOKEN_FILE", token_file, MAX_TOKEN_FILE_BYTES,
            "mount the Secret there"))
    return gateway_secret(None)


def gateway_secret(material: bytes | None) -> bytes:
    """32 bytes of key from ``material`` (SHA-256, domain-separated); a fresh random
    key when there is none."""
    if not material:
        return secrets.token_bytes(32)
    return hashlib.sha256(b"sidecar mcp tags\0" + material).digest()


def _mac(secret: bytes, value: Any) -> str:
    """HMAC-SHA256 of ``value`` as canonical JSON under ``secret``, 64 hex digits."""
    return hmac.new(secret, orjson.dumps(value, option=orjson.OPT_SORT_KEYS),
                    hashlib.sha256).hexdigest()


def mac_of(secret: bytes, value: Any) -> str:
    """The gateway's MAC of ``value`` (canonical JSON) under ``secret``: 64 hex digits."""
    return _mac(secret, value)


def sign_tags(secret: bytes, tags: Mapping[str, str]) -> dict[str, str]:
    """``tags`` with ``mcp.sig`` added: the HMAC of every other ``mcp.*`` tag (names and
    values), so a job another producer tagged ``mcp.*`` carries no valid one."""
    own = {k: v for k, v in tags.items() if k.startswith(RESERVED_TAG_PREFIX) and k != SIG_TAG}
    return {**tags, SIG_TAG: _mac(secret, own)}


def signed(secret: bytes, tags: Mapping[str, str] | None) -> bool:
    """Whether a job's tags carry a valid ``mcp.sig`` (sign_tags) under ``secret``: only
    such jobs are the gateway's (listed, counted, joined, replayed). Constant-time."""
    tags = tags or {}
    given = tags.get(SIG_TAG)
    if not isinstance(given, str):
        return False
    own = {k: v for k, v in tags.items() if k.startswith(RESERVED_TAG_PREFIX) and k != SIG_TAG}
    return hmac.compare_digest(given, _mac(secret, own))


def call_idempotency_key(secret: bytes, principal: str, session_id: str | None,
                         request_id: str | int | None) -> str | None:
    """The idempotency key of an MCP ``tools/call`` (P18): the same principal, session
    and JSON-RPC request id give the same key, so a client's retry of that request joins
    the job instead of running the tool twice. None when the request has no session or no
    id (the 2026-07-28 protocol has no sessions, and request ids repeat across a client's
    connections: no key is safer than a wrong one); a client then gives its own in
    ``_meta`` (sidecar.mcp.gateway.IDEMPOTENCY_META). Keyed by ``secret``
    (gateway_secret): another producer cannot compute it, so cannot plant a job under it."""
    if not session_id or request_id is None:
        return None
    return f"{RESERVED_KEY_PREFIX}{_mac(secret, [principal, session_id, str(request_id)])}"


def agent_session_key(secret: bytes, principal: str, session_id: str | None) -> str | None:
    """The agent session (issue 43; docs/callers.md "Sessions") of an MCP client's calls
    of a warm tool: one per principal and MCP session (``Mcp-Session-Id``), so the calls of
    one connected client run in order in one warm process that keeps its state, and two
    clients never share one. None without an MCP session. A MAC under ``secret``: the MCP
    session id itself (a bearer value) is never stored."""
    if not session_id:
        return None
    return f"mcp:{_mac(secret, ['session', principal, session_id])}"


def interest_key(secret: bytes, principal: str, owner: list[str]) -> str:
    """The interest (issue 44; docs/callers.md "Interest") an MCP call belongs to: its
    client's MCP session, else its task, else its request (``owner``: ``["session", id]``,
    ``["task", id]`` or ``["call", random]``), scoped to the principal. A MAC under
    ``secret``: the session id (a bearer value) is never stored."""
    return f"mcp:{_mac(secret, ['interest', principal, *owner])}"


def client_idempotency_key(secret: bytes, principal: str, key: str) -> str:
    """A key the client gave (in ``_meta``), scoped to its principal: two principals
    using the same key get two jobs, and neither can reach the other's through it; keyed
    by ``secret`` as call_idempotency_key."""
    return f"{RESERVED_KEY_PREFIX}{_mac(secret, [principal, key])}"
