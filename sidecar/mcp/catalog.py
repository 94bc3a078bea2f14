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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

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


def call_idempotency_key(principal: str, session_id: str | None,
                         request_id: str | int | None) -> str | None:
    """The idempotency key of an MCP ``tools/call`` (P18): the same principal, session
    and JSON-RPC request id give the same key, so a client's retry of that request joins
    the job instead of running the tool twice. None when the request has no session or no
    id (the 2026-07-28 protocol has no sessions, and request ids repeat across a client's
    connections: no key is safer than a wrong one); a client then gives its own in
    ``_meta`` (sidecar.mcp.gateway.IDEMPOTENCY_META)."""
    if not session_id or request_id is None:
        return None
    digest = hashlib.sha256(orjson.dumps([principal, session_id, str(request_id)]))
    return f"mcp:{digest.hexdigest()}"


def client_idempotency_key(principal: str, key: str) -> str:
    """A key the client gave (in ``_meta``), scoped to its principal: two principals
    using the same key get two jobs, and neither can reach the other's through it."""
    digest = hashlib.sha256(orjson.dumps([principal, key]))
    return f"mcp:{digest.hexdigest()}"
