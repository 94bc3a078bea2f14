"""Environment -> validated settings and per-tool lease profiles.

Lease settings belong to the tool type, set by the operator's environment, never
by a payload (P11, P20). Defaults come from ``SIDECAR_<FIELD>``; a tool overrides
them with ``SIDECAR_PROFILE_<TOOL>_<FIELD>`` where TOOL is the tool name upper-cased
with every other character as ``_``. Every ``SIDECAR_*`` variable must be known:
a misspelled one is an error, not silently ignored.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sidecar.protocol import parsing
from sidecar.protocol.enqueue_args import MAX_ATTEMPTS_LIMIT, dedupe_window_seconds
from sidecar.protocol.errors import ConfigError, SidecarError, UsageError
from sidecar.protocol.masking import SECRETS, mask_url, url_secrets
from sidecar.protocol.model import (
    PROFILE_FIELD_NAMES,
    LeaseProfile,
    tolerated_silence,
    tool_env_key,
)

PREFIX = "SIDECAR_"
PROFILE_PREFIX = "SIDECAR_PROFILE_"
# SIDECAR_DATABASE_POOLER: "transaction" = a transaction-mode pooler (PgBouncer) sits in
# front of PostgreSQL, so no statement may rely on the server session.
POOLER_MODES = ("none", "transaction")
TOOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
# What tool_env_key makes of a valid tool name.
_TOOL_KEY = re.compile(r"[A-Z0-9][A-Z0-9_]{0,62}")


class _Invalid(SidecarError, ValueError):
    """A value refused for a reason worth showing (the parsers' own ValueErrors are not)."""


def _number(text: str) -> float:
    if not text.isascii():  # float() reads other scripts' digits ("١٢") too
        raise ValueError("not an ASCII number")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    if abs(value) > MAX_SECONDS:
        raise _Invalid(f"at most {MAX_SECONDS} seconds (100 years)")
    return value


# Durations above this are refused: PostgreSQL's interval arithmetic (now() + L seconds)
# and the event loop's timers would overflow long before a number stops being finite.
MAX_SECONDS = 100 * 365 * 86400


# Integers above this are refused: no limit needs more, and JSON (sidecar config, the
# journal) carries at most 64 bits.
_MAX_INTEGER = 2**62


def _integer(text: str) -> int:
    if not text.isascii():  # int() reads other scripts' digits ("١٢") too
        raise ValueError("not an ASCII integer")
    value = int(text.strip())
    if abs(value) > _MAX_INTEGER:
        raise _Invalid(f"at most {_MAX_INTEGER}")
    return value


def _http_url(text: str) -> str:
    text = text.strip()
    if text and not text.startswith(("http://", "https://")):
        raise _Invalid("not an http:// or https:// URL")
    return text


def _label(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._-]{0,63}", text):
        raise _Invalid("use up to 63 letters, digits, '.', '_' or '-'")
    return text


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise _Invalid("use true or false")


def _listen_addr(text: str) -> str:
    """``SIDECAR_HTTP_ADDR``: ``off``, or HOST:PORT as sidecar.protocol.parsing reads every one."""
    if text == "off":
        return text
    try:
        parsing.split_host_port(text)
    except parsing.ParseError as exc:
        raise _Invalid(f"{exc}; e.g. 0.0.0.0:9180, or off") from None
    return text


def _names(text: str) -> frozenset[str]:
    """Comma- or space-separated names, e.g. ``PATH,HOME`` or ``PATH HOME``."""
    return frozenset(part for part in re.split(r"[,\s]+", text) if part)


def _tool_list(text: str) -> frozenset[str]:
    tools = _names(text)
    for tool in tools:
        if not TOOL_NAME.fullmatch(tool):
            raise _Invalid(f"{tool!r} is not a valid tool name")
    return tools


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_names(text: str) -> frozenset[str]:
    names = _names(text)
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise _Invalid(f"{name!r} is not an environment variable name")
        if name.upper().startswith(PREFIX):
            raise _Invalid(f"{name} is the sidecar's own; SIDECAR_* variables never pass "
                             "to a tool (the child gets its job variables instead)")
    return names


def _run_as(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    if not re.fullmatch(r"\d{1,10}(:\d{1,10})?", text, re.ASCII):
        raise _Invalid("use a numeric uid or uid:gid, e.g. 65534:65534")
    ids = [int(part) for part in text.split(":")]
    if any(value >= 2**32 - 1 for value in ids):  # (uid_t)-1 means "unchanged" to the kernel
        raise _Invalid("a uid or gid is below 4294967295")
    if ids[0] == 0:
        raise _Invalid("0 is root: the tool would not be isolated; pick an unprivileged uid")
    return text


def _duration(text: str) -> float:
    """Seconds: a number, or one with a unit s, m, h or d (``90``, ``30m``, ``7d``); at most
    MAX_SECONDS (sidecar.protocol.parsing.duration_seconds, the one reader of durations)."""
    try:
        return parsing.duration_seconds(text, MAX_SECONDS)
    except parsing.ParseError as exc:
        raise _Invalid(str(exc)) from None


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise _Invalid("must not be negative; 0 means no limit")
    return value


def _absolute_path(text: str) -> str:
    """A path made absolute (against the current directory): the tool runs in another one."""
    return os.path.abspath(text) if text.strip() else ""


# Longest MCP_DESCRIPTION (characters): an MCP client puts it in a model's context.
MCP_DESCRIPTION_MAX = 4096


def _description(text: str) -> str:
    """A tool's description for MCP clients: printable text (newlines and tabs allowed),
    at most MCP_DESCRIPTION_MAX characters after stripping."""
    text = text.strip()
    if len(text) > MCP_DESCRIPTION_MAX:
        raise _Invalid(f"at most {MCP_DESCRIPTION_MAX} characters")
    if any(not (c.isprintable() or c in "\n\t") for c in text):
        raise _Invalid("use printable text (newlines and tabs allowed), no control characters")
    return text


def _home(text: str) -> str:
    """``job``, ``inherit`` or an absolute path (see the ``HOME`` profile field)."""
    text = text.strip()
    if text in ("job", "inherit") or (os.path.isabs(text) and "\0" not in text):
        return os.path.normpath(text) if os.path.isabs(text) else text
    raise _Invalid("use job (a private HOME per attempt), inherit, or an absolute path")


SANDBOX_MODES = ("auto", "required", "off")
NETWORK_MODES = ("host", "none")
PROCESS_MODES = ("per-job", "warm")
SESSION_RESTARTS = ("lost", "fresh")


def _sandbox_mode(text: str) -> str:
    """``auto``, ``required`` or ``off`` (the ``SANDBOX`` profile field)."""
    value = text.strip().lower()
    if value not in SANDBOX_MODES:
        raise _Invalid("use auto (a bubblewrap sandbox where this host allows one), "
                       "required (refuse to start without it) or off")
    return value


def _session_restart(text: str) -> str:
    """``lost`` or ``fresh`` (the ``SESSION_RESTART`` profile field, docs/callers.md)."""
    value = text.strip().lower()
    if value not in SESSION_RESTARTS:
        raise _Invalid("use lost (a call of a session whose process is gone fails "
                       "session_lost) or fresh (it starts the session again in a new process)")
    return value


def _dedupe(text: str) -> str:
    """``forever``, ``active`` or a window such as ``24h`` (the ``DEDUPE`` profile field,
    docs/callers.md "Idempotency keys")."""
    value = text.strip()
    try:
        dedupe_window_seconds(value)
    except UsageError:
        raise _Invalid("use forever (a job keeps its key for good), active (a finished "
                       "job's key frees for a new job) or a window of 1s to 366d, e.g. "
                       "24h") from None
    return value


def _approval_mode(text: str) -> str:
    """``wait`` or ``park`` (the ``APPROVAL_MODE`` profile field, docs/side-effects.md)."""
    value = text.strip().lower()
    if value not in ("wait", "park"):
        raise _Invalid("use wait (the tool blocks for the answer, its lease kept) or park "
                       "(it exits and the job waits for the answer without a slot)")
    return value


def _process_mode(text: str) -> str:
    """``per-job`` or ``warm`` (the ``PROCESS`` profile field, docs/child-process.md)."""
    value = text.strip().lower()
    if value not in PROCESS_MODES:
        raise _Invalid("use per-job (a fresh tool process per attempt) or warm (one process "
                       "serves consecutive jobs of a slot, one JSON line each)")
    return value


def _network_mode(text: str) -> str:
    """``host`` or ``none`` (the ``NETWORK`` profile field)."""
    value = text.strip().lower()
    if value not in NETWORK_MODES:
        raise _Invalid("use host (the pod's network) or none (an empty network namespace)")
    return value


# Where an extra bind would undo the sandbox itself: its own /proc, /dev and /tmp.
_EXTRA_PATH_REFUSED = ("/", "/proc", "/dev", "/tmp")


def _extra_paths(text: str) -> tuple[tuple[str, str], ...]:
    """``EXTRA_PATHS``: comma-separated ``PATH[:ro|:rw]`` (``ro`` when no suffix), e.g.
    ``/usr/share/tessdata,/srv/out:rw`` -> ``(("/usr/share/tessdata", "ro"),
    ("/srv/out", "rw"))``. Each PATH is absolute and is bound at the same path inside the
    sandbox; the path itself must not hold a comma. Raises _Invalid for a relative path,
    an unknown suffix, ``/``, ``/proc``, ``/dev`` or ``/tmp`` (the sandbox's own), or a
    path named twice."""
    out: dict[str, str] = {}
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            continue
        path, mode = part, "ro"
        head, sep, tail = part.rpartition(":")
        if sep and tail in ("ro", "rw"):
            path, mode = head, tail
        elif sep and "/" not in tail:
            raise _Invalid(f"{part!r}: the suffix after ':' is ro or rw")
        if not os.path.isabs(path) or "\0" in path:
            raise _Invalid(f"{part!r}: use an absolute path, e.g. /srv/data:ro")
        path = os.path.normpath(path)
        if path in _EXTRA_PATH_REFUSED or path.startswith(("/proc/", "/dev/")):
            raise _Invalid(f"{path}: the sandbox makes its own {path}; name a "
                           "directory below it instead")
        if path in out:
            raise _Invalid(f"{path} is named twice")
        out[path] = mode
    return tuple(out.items())


def _exit_code_or_none(text: str) -> int:
    """An exit code from 1 to 255, or 0 for none (``SNOOZE_EXIT_CODE``)."""
    code = _integer(text)
    if not 0 <= code <= 255:
        raise _Invalid("an exit code from 1 to 255, or 0 for none")
    return code


def _exit_codes(text: str) -> frozenset[int]:
    codes = frozenset(_integer(part) for part in _names(text))
    if any(not 1 <= code <= 255 for code in codes):
        raise _Invalid("exit codes are integers from 1 to 255, comma-separated")
    return codes


@dataclass(frozen=True)
class _Field:
    parse: Callable[[str], object]
    default: str
    unit: str
    what: str


# Fields a tool's profile may override. Units are in the names (seconds, bytes).
PROFILE_FIELDS: dict[str, _Field] = {
    "LEASE_SECONDS": _Field(_number, "90", "s", "lease length L (P1)"),
    "HEARTBEAT_SECONDS": _Field(_number, "30", "s", "heartbeat period H (P5)"),
    "TOLERATED_MISSES": _Field(_integer, "1", "count", "consecutive missed heartbeats R (P10)"),
    "JITTER_SECONDS": _Field(_number, "20", "s", "allowance J for network jitter and pauses (P10)"),
    "STAGE_TIMEOUT_SECONDS": _Field(_number, "600", "s", "stage deadline of one attempt (P8)"),
    "MAX_ATTEMPTS": _Field(_integer, "3", "count",
                           "attempts per job the enqueue gave none for (P16)"),
    "KILL_GRACE_SECONDS": _Field(_number, "5", "s", "SIGTERM to SIGKILL grace"),
    "NON_RETRYABLE_EXIT_CODES": _Field(_exit_codes, "64,65", "codes", "exit codes failed at once"),
    "BACKOFF_BASE_SECONDS": _Field(_number, "2", "s", "first retry delay, doubled per attempt"),
    "BACKOFF_MAX_SECONDS": _Field(_number, "300", "s", "retry delay cap"),
    "MAX_RESULT_BYTES": _Field(_integer, str(8 * 1024 * 1024), "bytes", "stdout cap"),
    "RESULT_URL": _Field(_http_url, "", "url", "where accepted results are POSTed (outbox)"),
    "FORWARD_MAX_ATTEMPTS": _Field(_integer, "20", "count",
                                   "delivery attempts of a forwarded result before it is "
                                   "dead-lettered (case F21)"),
    "FORWARD_MAX_AGE_SECONDS": _Field(_number, "86400", "s",
                                      "how long a forwarded result is retried, from its "
                                      "completion (or re-delivery), before it is "
                                      "dead-lettered (case F21)"),
    "FORWARD_FOLLOW_REDIRECTS": _Field(_flag, "false", "bool",
                                       "follow a receiver's 307/308 (method and body kept); "
                                       "any other 3xx, or any 3xx when false, dead-letters "
                                       "the result"),
    "IDLE_TIMEOUT_SECONDS": _Field(_number, "0", "s",
                                   "kill a tree with no CPU, I/O or output this long; 0 = off"),
    "MAX_LIFETIME_SECONDS": _Field(_number, "0", "s",
                                   "cap on a job's life from its first claim (P12); 0 = off"),
    "NEXT_TOOLS": _Field(_tool_list, "", "tools", "tools a result may name as its next stage"),
    "PROVIDER": _Field(_label, "", "label", "the external provider, a metrics label (P21)"),
    # Isolation of the child (docs/isolation.md); 0 = no limit.
    "MEMORY_BYTES": _Field(_non_negative_int, "0", "bytes",
                           "memory of the tool's whole tree (cgroup), else RLIMIT_AS per process"),
    "CPU_SECONDS": _Field(_number, "0", "s", "CPU time of the tool's tree; 0 = no limit"),
    "OPEN_FILES": _Field(_non_negative_int, "0", "count",
                         "RLIMIT_NOFILE of every tool process; 0 = inherit"),
    "PROCESSES": _Field(_non_negative_int, "0", "count",
                        "processes and threads of the tool's tree (cgroup pids.max), else "
                        "RLIMIT_NPROC"),
    "CORE_DUMPS": _Field(_flag, "false", "bool", "let the tool write core dumps"),
    "ALLOW_NEW_PRIVS": _Field(_flag, "false", "bool",
                              "let the tool gain privileges by exec (setuid/setgid programs, "
                              "file capabilities); off, it starts with PR_SET_NO_NEW_PRIVS"),
    "RUN_AS": _Field(_run_as, "", "uid[:gid]",
                     "run the tool as this user (the sidecar must be root)"),
    "ENV_PASSTHROUGH": _Field(_env_names, "PATH,HOME,LANG,LC_ALL,LC_CTYPE,TZ", "names",
                              "the sidecar's variables the tool may see; nothing else passes"),
    "HOME": _Field(_home, "job", "mode",
                   "the tool's HOME and XDG base directories: job (private to each attempt, "
                   "in its work directory), inherit (the sidecar's, if ENV_PASSTHROUGH "
                   "passes HOME), or an absolute path"),
    # The per-attempt namespace sandbox (bubblewrap; docs/isolation.md).
    "SANDBOX": _Field(_sandbox_mode, "auto", "mode",
                      "auto: each attempt in its own bubblewrap sandbox where this host "
                      "allows it (else a sandbox_unavailable warning at start); required: "
                      "refuse to start without it; off"),
    "NETWORK": _Field(_network_mode, "host", "mode",
                      "the sandboxed tool's network: host (the pod's) or none (an empty "
                      "network namespace; the guard is then the attempt's own Unix socket, "
                      "SIDECAR_GUARD_SOCKET, only)"),
    "EXTRA_PATHS": _Field(_extra_paths, "", "paths",
                          "more paths bound into the sandbox at the same place: "
                          "PATH[:ro|:rw], comma-separated, ro by default"),
    # The tool as an MCP tool (`sidecar mcp`, issue 29; docs/mcp.md).
    "MCP_DESCRIPTION": _Field(_description, "", "text",
                              "the tool's description for MCP clients; `sidecar mcp --tool` "
                              "refuses a tool without one"),
    "MCP_INPUT_SCHEMA_FILE": _Field(_absolute_path, "", "path",
                                    "a JSON Schema (an object schema) of the tool's MCP "
                                    "arguments; unset = any JSON object"),
    # Warm tool processes (issue 43; docs/child-process.md, "Warm mode").
    "PROCESS": _Field(_process_mode, "per-job", "mode",
                      "per-job: a fresh tool process per attempt; warm: one process, in its "
                      "slot's sandbox and cgroup, serves consecutive jobs over one JSON line "
                      "each way"),
    "MAX_JOBS_PER_PROCESS": _Field(_non_negative_int, "1000", "count",
                                   "jobs one warm process serves before it is replaced; "
                                   "0 = no cap"),
    "MAX_PROCESS_SECONDS": _Field(_number, "3600", "s",
                                  "age after which a warm process is replaced once its job "
                                  "ends; 0 = no cap"),
    "WARM_IDLE_SECONDS": _Field(_number, "300", "s",
                                "a warm process with no job this long is stopped"),
    # Agent sessions (issue 43, point 3; docs/callers.md, "Sessions").
    "SESSION_IDLE_SECONDS": _Field(_number, "300", "s",
                                   "a session with no call this long ends, and its process "
                                   "with it"),
    "SESSION_MAX_SECONDS": _Field(_number, "3600", "s",
                                  "a session ends once it is this old, when no call of it "
                                  "runs; 0 = no cap"),
    "MAX_SESSIONS": _Field(_integer, "8", "count",
                           "agent sessions one sidecar holds at once (each keeps a warm "
                           "process); a call of a new session beyond them goes back to the "
                           "queue for another sidecar, its attempt not spent"),
    "SESSION_RESTART": _Field(_session_restart, "lost", "mode",
                              "a call whose session ended or was lost: lost = it fails "
                              "session_lost; fresh = a new process starts the session again"),
    # The tool's default dedupe policy (issue 44, point 4; docs/callers.md).
    "DEDUPE": _Field(_dedupe, "forever", "policy",
                     "how long a job holds its idempotency key when its enqueue names no "
                     "policy: forever, active (until it finishes) or a window such as 24h "
                     "(until it finishes and that long after its enqueue)"),
    # Snoozes: a tool asks to run later without spending an attempt (issue 44, point 3;
    # docs/side-effects.md "Snooze").
    "MAX_SNOOZES": _Field(_non_negative_int, "100", "count",
                          "times one job may snooze; one more fails it snooze_limit"),
    "SNOOZE_EXIT_CODE": _Field(_exit_code_or_none, "0", "code",
                               "an exit code that means \"run me again later\" (after "
                               "SNOOZE_SECONDS, the attempt not spent); 0 = none"),
    "SNOOZE_SECONDS": _Field(_number, "60", "s",
                             "the delay of a snooze asked by SNOOZE_EXIT_CODE"),
    # Approvals: a person's yes before an irreversible step (issue 44, point 1;
    # docs/side-effects.md "Approval").
    "APPROVAL_WAIT_SECONDS": _Field(_number, "300", "s",
                                    "how long a tool's approval request waits for an "
                                    "answer (the lease is kept meanwhile); then the job "
                                    "fails approval_expired"),
    "APPROVAL_MODE": _Field(_approval_mode, "wait", "mode",
                            "wait: the tool blocks for the answer, its lease and slot "
                            "kept (APPROVAL_WAIT_SECONDS); park: it saves its checkpoint "
                            "and exits, the job waits without a slot (APPROVAL_PARK_SECONDS)"),
    "APPROVAL_PARK_SECONDS": _Field(_number, "604800", "s",
                                    "how long a parked job waits for its answer (at most "
                                    "366 days); then it fails approval_expired"),
}

# Every profile field is one field of model.LeaseProfile, in its order (as_dict's order).
if tuple(name.lower() for name in PROFILE_FIELDS) != PROFILE_FIELD_NAMES:
    raise AssertionError("config.PROFILE_FIELDS and model.LeaseProfile disagree")

# Sidecar-wide settings (not per tool).
GLOBAL_FIELDS: dict[str, _Field] = {
    "DATABASE_URL": _Field(str, "", "dsn", "PostgreSQL server; unset = embedded PostgreSQL"),
    "DATABASE_URL_FILE": _Field(_absolute_path, "", "path",
                                "a file holding the DSN (a mounted Secret), instead of "
                                "SIDECAR_DATABASE_URL"),
    "DATA_DIR": _Field(str, "", "path", "embedded PostgreSQL data directory"),
    "POLL_SECONDS": _Field(_number, "2", "s", "claim poll period when NOTIFY is missed"),
    "DRAIN_SECONDS": _Field(_number, "20", "s", "on SIGTERM, how long running jobs may finish"),
    "DB_TIMEOUT_SECONDS": _Field(_number, "5", "s", "client-side timeout of one statement"),
    "LOG_LEVEL": _Field(str, "info", "level", "debug, info, warning or error"),
    "LOG_FORMAT": _Field(str, "json", "format", "json or text"),
    "WORKER_NAME": _Field(str, "", "name", "stable part of owner_id; default the hostname"),
    "EVENT_LOOP": _Field(str, "uvloop", "name", "uvloop or asyncio"),
    "DATABASE_POOLER": _Field(str, "none", "mode",
                              "none, or transaction behind PgBouncer's transaction pooling: "
                              "no prepared-statement cache, no LISTEN (polling) unless "
                              "SIDECAR_LISTEN_DATABASE_URL is set"),
    "LISTEN_DATABASE_URL": _Field(str, "", "dsn",
                                  "where the one LISTEN connection goes (a session: the "
                                  "server directly, or a session-mode pool); unset = "
                                  "SIDECAR_DATABASE_URL, or no LISTEN behind a transaction "
                                  "pooler"),
    "LISTEN_DATABASE_URL_FILE": _Field(_absolute_path, "", "path",
                                       "a file holding SIDECAR_LISTEN_DATABASE_URL (a "
                                       "mounted Secret), instead of the variable"),
    "HTTP_ADDR": _Field(_listen_addr, "0.0.0.0:9180", "host:port",
                        "metrics, /livez and /readyz of `sidecar run`; off = none"),
    "LOG_TOOL_STDERR": _Field(_flag, "false", "bool",
                              "log the tool's stderr lines (content) as tool_stderr events"),
    "PREPARE": _Field(_flag, "true", "bool",
                      "keep one attempt per slot prepared ahead (work directory, job cgroup, "
                      "sandbox, a launcher waiting for its job); false: set each up when "
                      "its job is claimed"),
    "WORK_DIR": _Field(_absolute_path, "", "path",
                       "root of each attempt's private work directory; default the temp dir"),
    "MAX_PAYLOAD_BYTES": _Field(_non_negative_int, str(8 * 1024 * 1024), "bytes",
                                "largest payload `enqueue` accepts (and a next stage's)"),
    "CGROUPS": _Field(str, "auto", "mode",
                      "auto: a cgroup per job where this host lets the sidecar make one; off"),
    "LEFTOVER_SWEEP_SECONDS": _Field(_duration, "60", "s",
                                     "how often a running sidecar clears what dead sidecars "
                                     "of this work root left (tools, job cgroups, work "
                                     "directories); 0 = only at start"),
    "RETENTION_SECONDS": _Field(_duration, "604800", "s",
                                "succeeded and cancelled jobs, with their journal, are deleted "
                                "this long after they finished; 0 keeps them"),
    "RETENTION_FAILED_SECONDS": _Field(_duration, "2592000", "s",
                                       "the same for failed jobs (dead letters); 0 keeps them"),
    "MCP_TOKEN_FILE": _Field(_absolute_path, "", "path",
                             "bearer tokens `sidecar mcp` accepts over HTTP, one "
                             "`PRINCIPAL TOKEN` line each (a mounted Secret)"),
    "MCP_SECRET_FILE": _Field(_absolute_path, "", "path",
                              "the secret `sidecar mcp` signs its job tags and keys with "
                              "(shared by its replicas); unset: derived from "
                              "SIDECAR_MCP_TOKEN_FILE"),
    "WEB_TOKEN_FILE": _Field(_absolute_path, "", "path",
                             "admin tokens of `sidecar web` (cancel, retry, pause, resume), "
                             "one `PRINCIPAL TOKEN` line each; unset: read-only"),
}

# Variables the sidecar sets for its child, and the test suite's own; allowed in
# the environment so a tool may itself call `sidecar enqueue`.
PASSIVE_VARIABLES = frozenset(
    {
        "SIDECAR_JOB_ID",
        "SIDECAR_TOOL",
        "SIDECAR_ATTEMPT",
        "SIDECAR_FENCING_TOKEN",
        "SIDECAR_IDEMPOTENCY_KEY",
        "SIDECAR_OWNER_ID",
        "SIDECAR_GUARD_URL",
        "SIDECAR_GUARD_TOKEN",
        "SIDECAR_CHECKPOINT_FILE",
        "SIDECAR_JOB_DIR",
        "SIDECAR_RESULT_FILE",
        "SIDECAR_PROCESS_ID",
        "SIDECAR_TEST_DATABASE_URL",
    }
)


def validate_tool_name(tool: str) -> str:
    """Return ``tool`` if it matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,62}``; else ConfigError."""
    if not TOOL_NAME.fullmatch(tool or ""):
        raise ConfigError(
            f"tool name {tool!r} is invalid: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return tool


@dataclass(frozen=True)
class Settings:
    """Validated sidecar-wide settings plus the raw per-tool overrides."""

    database_url: str
    database_url_file: str
    data_dir: str
    poll_seconds: float
    drain_seconds: float
    db_timeout_seconds: float
    log_level: str
    log_format: str
    worker_name: str
    event_loop: str
    database_pooler: str
    listen_database_url: str
    listen_database_url_file: str
    http_addr: str
    log_tool_stderr: bool
    prepare: bool
    work_dir: str
    max_payload_bytes: int
    cgroups: str
    retention_seconds: float
    retention_failed_seconds: float
    leftover_sweep_seconds: float
    mcp_token_file: str
    mcp_secret_file: str
    web_token_file: str
    defaults: Mapping[str, tuple[object, str]]
    overrides: Mapping[str, Mapping[str, tuple[object, str]]]
    # True when SIDECAR_HTTP_ADDR is unset: a taken default port moves to the next free
    # one of DEFAULT_HTTP_PORTS (two tools in one pod); a port that was set must be free.
    http_addr_is_default: bool = True

    def profile(self, tool: str) -> LeaseProfile:
        """The validated lease profile of ``tool``; ConfigError names the variable and rule."""
        validate_tool_name(tool)
        return _build_profile(tool, self.defaults, self.overrides.get(tool_env_key(tool), {}))

    def default_profile(self) -> LeaseProfile:
        """The profile a tool without ``SIDECAR_PROFILE_*`` overrides gets."""
        return _build_profile("(defaults)", self.defaults, {})

    def profile_tools(self) -> list[str]:
        """Tool keys that have at least one ``SIDECAR_PROFILE_*`` override."""
        return sorted(self.overrides)


def _parse(var: str, raw: str, spec: _Field) -> object:
    try:
        return spec.parse(raw)
    except _Invalid as exc:
        raise ConfigError(f"{var}={raw!r} is not valid: {exc}") from None
    except ValueError:
        example = _EXAMPLES.get(spec.unit)
        raise ConfigError(
            f"{var}={raw!r} is not valid: expected {spec.unit} ({spec.what})"
            + (f", e.g. {example}" if example else "")
        ) from None


# What a valid value of each unit looks like, for the error of an invalid one.
_EXAMPLES = {"s": "30 or 2.5 (seconds, no unit suffix)",
             "bytes": "536870912 (a plain number of bytes, no unit suffix)",
             "count": "8", "codes": "64,65"}


def _build_profile(
    tool: str,
    defaults: Mapping[str, tuple[object, str]],
    overrides: Mapping[str, tuple[object, str]],
) -> LeaseProfile:
    values = {name: (overrides.get(name) or defaults[name]) for name in PROFILE_FIELDS}
    p = {name.lower(): value for name, (value, _) in values.items()}
    src = {name: source for name, (_, source) in values.items()}

    for name in ("LEASE_SECONDS", "HEARTBEAT_SECONDS", "STAGE_TIMEOUT_SECONDS",
                 "MAX_ATTEMPTS", "MAX_RESULT_BYTES", "TOLERATED_MISSES",
                 "FORWARD_MAX_ATTEMPTS", "FORWARD_MAX_AGE_SECONDS"):
        if p[name.lower()] <= 0:
            raise ConfigError(f"{src[name]}={p[name.lower()]}: must be a positive number")
    if p["max_attempts"] > MAX_ATTEMPTS_LIMIT:
        raise ConfigError(f"{src['MAX_ATTEMPTS']}={p['max_attempts']}: at most "
                          f"{MAX_ATTEMPTS_LIMIT} attempts")
    for name in ("JITTER_SECONDS", "KILL_GRACE_SECONDS", "BACKOFF_BASE_SECONDS",
                 "BACKOFF_MAX_SECONDS", "IDLE_TIMEOUT_SECONDS", "MAX_LIFETIME_SECONDS",
                 "CPU_SECONDS", "MAX_PROCESS_SECONDS", "SESSION_MAX_SECONDS"):
        if p[name.lower()] < 0:
            raise ConfigError(f"{src[name]}={p[name.lower()]}: must not be negative")

    if p["network"] == "none" and p["sandbox"] == "off":
        # A setting that cannot hold must not be dropped in silence (issue 41, point 1's
        # kind): without the sandbox the tool shares the host's network.
        raise ConfigError(
            f"{src['NETWORK']}=none needs the namespace sandbox, but {src['SANDBOX']}=off "
            f"for tool {tool!r}: the tool would use the host's network; set SANDBOX=auto or "
            "required, or NETWORK=host")

    if not 1 <= p["max_sessions"] <= 1000:
        raise ConfigError(f"{src['MAX_SESSIONS']}={p['max_sessions']}: use 1 to 1000 sessions "
                          "per sidecar")
    if p["snooze_exit_code"] and p["snooze_exit_code"] in p["non_retryable_exit_codes"]:
        raise ConfigError(f"{src['SNOOZE_EXIT_CODE']}={p['snooze_exit_code']} is also in "
                          f"{src['NON_RETRYABLE_EXIT_CODES']}: an exit code either asks to run "
                          "later or fails the job; name it in one of them")
    for name, cap, said in (("APPROVAL_PARK_SECONDS", 366 * 86400, "366 days"),
                            ("APPROVAL_WAIT_SECONDS", 86400, "1 day"),
                            ("SNOOZE_SECONDS", 366 * 86400, "366 days")):
        if p[name.lower()] > cap:
            raise ConfigError(f"{src[name]}={p[name.lower()]:g}: at most {said}")
    for name in ("WARM_IDLE_SECONDS", "SESSION_IDLE_SECONDS", "SNOOZE_SECONDS",
                 "APPROVAL_WAIT_SECONDS", "APPROVAL_PARK_SECONDS"):
        if p[name.lower()] <= 0:
            raise ConfigError(f"{src[name]}={p[name.lower()]}: must be a positive number of "
                              "seconds")

    lease, hb, misses, jitter = (
        p["lease_seconds"], p["heartbeat_seconds"], p["tolerated_misses"], p["jitter_seconds"]
    )
    if not lease > misses * hb + jitter:
        raise ConfigError(
            f"{src['LEASE_SECONDS']}={lease:g} breaks rule P10 (L > R x H + J) for tool "
            f"{tool!r}: {misses} x {hb:g} + {jitter:g} = {misses * hb + jitter:g} s "
            f"(R from {src['TOLERATED_MISSES']}, H from {src['HEARTBEAT_SECONDS']}, "
            f"J from {src['JITTER_SECONDS']}); raise the lease or shorten the heartbeat"
        )
    silence = tolerated_silence(lease, hb, p["kill_grace_seconds"])
    if silence < misses * hb:
        raise ConfigError(
            f"{src['LEASE_SECONDS']}={lease:g} cannot survive {misses} missed heartbeat(s) and "
            f"still kill the tool before the lease ends, for tool {tool!r}: "
            f"L - H - kill grace - L/10 = {silence:g} s < R x H = {misses * hb:g} s "
            f"(H from {src['HEARTBEAT_SECONDS']}, kill grace from {src['KILL_GRACE_SECONDS']}); "
            "raise the lease or shorten the heartbeat or the kill grace")
    return LeaseProfile(tool=tool, sources=src, **p)


def _read_dsn_file(path: str, url_also_set: bool,
                   url_var: str = "SIDECAR_DATABASE_URL") -> str:
    """The DSN in ``{url_var}_FILE`` (a mounted Secret; SIDECAR_DATABASE_URL_FILE or
    SIDECAR_LISTEN_DATABASE_URL_FILE): its first line, stripped. ConfigError when
    ``url_var`` is set too, or the file is unreadable or empty."""
    var = f"{url_var}_FILE={path}"
    if url_also_set:
        raise ConfigError(f"{var} and {url_var} are both set; keep one (the file "
                          "keeps the password out of the process environment)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(65536)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{var}: cannot read it ({getattr(exc, 'strerror', None) or exc}); "
                          "mount the Secret there, or unset the variable") from None
    dsn = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not dsn:
        raise ConfigError(f"{var}: the file is empty; put the server's URL in it")
    return dsn


def check_postgres_url(var: str, url: str,
                       error: type[SidecarError] = ConfigError) -> str:
    """``url`` if it is a PostgreSQL URL (``postgresql://`` or ``postgres://``, a numeric
    port, a host a URL parser reads); else ``error`` (ConfigError unless the caller says
    otherwise: ``db.resolve_dsn`` raises UsageError, exit 2, for SIDECAR_DATABASE_URL), one
    line naming ``var``, with the URL's credentials masked (``masking.mask_url``)."""
    shown = mask_url(url)
    if not url.startswith(("postgres://", "postgresql://")):
        raise error(f"{var} {shown!r} is not a PostgreSQL URL: it must start with "
                          "postgresql://, e.g. postgresql://USER:PASSWORD@HOST:5432/DATABASE")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        parts.hostname  # noqa: B018 - raises ValueError for a broken [IPv6] host
    except ValueError:  # its text may quote a piece of the password: not shown
        raise error(f"{var} {shown!r} is malformed: the port must be a number, and a "
                          "password holding / ? # or @ must be percent-encoded; expected "
                          "postgresql://USER:PASSWORD@HOST:PORT/DATABASE") from None
    return url


def secret_values(settings: Settings, dsn: str) -> dict[str, list[str]]:
    """Every secret value these settings hold, by the label ``masking.SECRETS`` shows for
    it (issue 25; the worker registers them): ``database_url``, the DSN in use (``dsn``:
    SIDECAR_DATABASE_URL, SIDECAR_DATABASE_URL_FILE's content, or the embedded server's)
    and SIDECAR_LISTEN_DATABASE_URL, whole; ``database_password``, their credentials
    (``masking.url_secrets``: the userinfo password and secret query values such as
    ``?password=``), as written and percent-decoded; ``result_url_credential``, the same
    pieces of the RESULT_URL of the defaults and of every profile. Those are the only
    secret settings: the other variables, the paths of SIDECAR_DATABASE_URL_FILE and
    SIDECAR_LISTEN_DATABASE_URL_FILE included, name no credential."""
    dsns = [url for url in (dsn, settings.listen_database_url) if url]
    found: dict[str, list[str]] = {"database_url": list(dict.fromkeys(dsns))}
    found["database_password"] = list(dict.fromkeys(
        piece for url in dsns for piece in _decoded(url_secrets(url))))
    urls = [settings.defaults["RESULT_URL"][0],
            *(o["RESULT_URL"][0] for o in settings.overrides.values() if "RESULT_URL" in o)]
    found["result_url_credential"] = [piece for url in urls if url
                                      for piece in _decoded(url_secrets(str(url)))]
    return {label: values for label, values in found.items() if values}


def register_secrets(settings: Settings, dsn: str, owner: Hashable) -> list[Hashable]:
    """Add every secret value of these settings (``secret_values``) to the process-wide
    ``masking.SECRETS``, each label under the key ``(owner, label)``, and return those keys
    (``SECRETS.discard`` each to forget them). Every process that writes or shows rows
    registers what it knows: the worker (what it writes is scrubbed, issue 25), and the
    readers that show stored rows to a person or a caller (``sidecar show``, ``events``,
    ``jobs``, ``wait``, ``sidecar web``, sidecar.client and so the MCP gateway: rows
    written before scrubbing existed are scrubbed on display, issue 41)."""
    keys: list[Hashable] = []
    for label, values in secret_values(settings, dsn).items():
        keys.append((owner, label))
        SECRETS.add(keys[-1], label, values)
    return keys


def _decoded(pieces: list[str]) -> list[str]:
    """Each piece as written and, where it differs, percent-decoded (what a tool that
    reads the password from elsewhere would print)."""
    return list(dict.fromkeys(p for piece in pieces for p in (piece, unquote(piece))))


def set_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The ``SIDECAR_*`` variables of ``env`` that are set: one rule for every variable,
    an empty (or blank) value means unset, as if the variable were absent (case F24)."""
    return {var: raw for var, raw in env.items()
            if var.startswith(PREFIX) and raw.strip()}


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate every ``SIDECAR_*`` variable of ``env`` (default ``os.environ``);
    an empty or blank one is unset (``set_variables``).

    Raises ConfigError (exit 2) with one line naming the variable, the value and
    the fix, for an unknown variable, a bad number or a profile breaking P10.
    """
    env = set_variables(os.environ if env is None else env)
    defaults: dict[str, tuple[object, str]] = {}
    for name, spec in PROFILE_FIELDS.items():
        var = PREFIX + name
        raw = env.get(var)
        if raw:
            defaults[name] = (_parse(var, raw, spec), var)
        else:
            defaults[name] = (spec.parse(spec.default), f"(default) {var}")

    glob: dict[str, object] = {}
    for name, spec in GLOBAL_FIELDS.items():
        var = PREFIX + name
        raw = env.get(var, "")
        glob[name.lower()] = _parse(var, raw, spec) if raw else spec.parse(spec.default)

    overrides: dict[str, dict[str, tuple[object, str]]] = {}
    for var, raw in env.items():
        if not var.startswith(PREFIX):
            continue
        if var.startswith(PROFILE_PREFIX):
            rest = var[len(PROFILE_PREFIX):]
            # The longest field that ends the name: FORWARD_MAX_ATTEMPTS, not MAX_ATTEMPTS
            # of a tool "...-forward".
            match = max(
                (f for f in PROFILE_FIELDS if rest.endswith("_" + f) and len(rest) > len(f) + 1),
                key=len, default=None,
            )
            if match is None:
                raise ConfigError(
                    f"{var}: unknown profile variable; expected SIDECAR_PROFILE_<TOOL>_<FIELD> "
                    f"with FIELD one of {', '.join(PROFILE_FIELDS)}"
                )
            tool_key = rest[: -(len(match) + 1)]
            if not _TOOL_KEY.fullmatch(tool_key):
                raise ConfigError(
                    f"{var}: no tool name gives {tool_key!r} as its TOOL part, so this would "
                    "be ignored; write the tool name upper-cased with every other character "
                    "as _ (ocr-fast -> SIDECAR_PROFILE_OCR_FAST_<FIELD>)")
            overrides.setdefault(tool_key, {})[match] = (
                _parse(var, raw, PROFILE_FIELDS[match]), var
            )
        elif var[len(PREFIX):] not in PROFILE_FIELDS and var[len(PREFIX):] not in GLOBAL_FIELDS \
                and var not in PASSIVE_VARIABLES:
            raise ConfigError(
                f"{var}: unknown variable; see docs/configuration.md "
                "(a misspelled setting would otherwise be ignored)"
            )

    if glob["log_level"] not in ("debug", "info", "warning", "error"):
        raise ConfigError(
            f"SIDECAR_LOG_LEVEL={glob['log_level']!r}: use debug, info, warning or error")
    if glob["log_format"] not in ("json", "text"):
        raise ConfigError(f"SIDECAR_LOG_FORMAT={glob['log_format']!r}: use json or text")
    if glob["event_loop"] not in ("uvloop", "asyncio"):
        raise ConfigError(f"SIDECAR_EVENT_LOOP={glob['event_loop']!r}: use uvloop or asyncio")
    if glob["database_pooler"] not in POOLER_MODES:
        raise ConfigError(
            f"SIDECAR_DATABASE_POOLER={glob['database_pooler']!r}: use none, or transaction "
            "when SIDECAR_DATABASE_URL points at PgBouncer with pool_mode = transaction")
    if glob["listen_database_url_file"]:
        glob["listen_database_url"] = _read_dsn_file(
            glob["listen_database_url_file"], "SIDECAR_LISTEN_DATABASE_URL" in env,
            "SIDECAR_LISTEN_DATABASE_URL")
    if glob["listen_database_url"]:
        glob["listen_database_url"] = check_postgres_url(
            "SIDECAR_LISTEN_DATABASE_URL_FILE's URL" if glob["listen_database_url_file"]
            else "SIDECAR_LISTEN_DATABASE_URL", glob["listen_database_url"].strip())
    for name in ("poll_seconds", "db_timeout_seconds"):
        if glob[name] <= 0:
            raise ConfigError(f"SIDECAR_{name.upper()}={glob[name]}: must be a positive number")
    if glob["cgroups"] not in ("auto", "off"):
        raise ConfigError(f"SIDECAR_CGROUPS={glob['cgroups']!r}: use auto or off")
    if glob["leftover_sweep_seconds"] < 0:
        raise ConfigError(f"SIDECAR_LEFTOVER_SWEEP_SECONDS={glob['leftover_sweep_seconds']}: "
                          "must not be negative (0 = only at start)")
    if glob["drain_seconds"] < 0:
        raise ConfigError(f"SIDECAR_DRAIN_SECONDS={glob['drain_seconds']}: must not be negative")

    if glob["database_url_file"]:
        glob["database_url"] = _read_dsn_file(glob["database_url_file"],
                                              "SIDECAR_DATABASE_URL" in env)
    if glob["listen_database_url"] and glob["database_pooler"] == "transaction" \
            and glob["listen_database_url"] == glob["database_url"].strip():
        raise ConfigError(
            "SIDECAR_LISTEN_DATABASE_URL is the same URL as the database's, which "
            "SIDECAR_DATABASE_POOLER=transaction says is a transaction pooler: LISTEN needs a "
            "session there; point it at the server itself or at a session-mode pool")
    settings = Settings(defaults=defaults, overrides=overrides,
                        http_addr_is_default=not env.get("SIDECAR_HTTP_ADDR"), **glob)
    # Every profile that is mentioned must be valid, not only the one in use.
    _build_profile("(defaults)", defaults, {})
    for tool_key in overrides:
        _build_profile(tool_key.lower(), defaults, overrides[tool_key])
    return settings


def default_data_dir() -> Path:
    """Per-user data directory of the embedded PostgreSQL: ``$XDG_DATA_HOME/sidecar/postgres``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share")
    return Path(base) / "sidecar" / "postgres"
