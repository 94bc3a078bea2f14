"""What a tool returned, checked before it goes near the database.

A tool's output is untrusted input: bytes that may not be UTF-8, may hold NUL bytes, may
nest JSON 10,000 levels deep or carry numbers no float holds. ``parse_result`` accepts one
JSON value and keeps its text exactly (PostgreSQL stores big integers and decimals as
``numeric``); anything else raises ``BadResult`` with a one-line reason, which the
supervisor turns into a ``bad_result`` failure. Nothing here raises anything else.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from sidecar.protocol import jsontext
from sidecar.protocol.errors import SidecarError
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import LeaseProfile, NextStage, RawJson, tool_env_key
from sidecar.protocol.vocabulary import FailureKind

# Longest reason kept from the JSON parser: its messages quote no input, but stay short.
_REASON_CHARS = 200
# PostgreSQL's numeric keeps at most 16383 digits after the decimal point (its dscale):
# 1e-20000 is valid JSON, read by orjson as 0.0, and refused by jsonb.
NUMERIC_MAX_SCALE = 16383


def _maybe_long_exponent_or_fraction(shape: bytes) -> bool:
    """True when the text may hold an exponent of 5 or more digits or a fraction of more
    than NUMERIC_MAX_SCALE digits (``shape`` is jsontext.number_shape of it): only then
    is every number's scale checked."""
    return b"e00000" in shape or b"e+00000" in shape \
        or b"0" * (NUMERIC_MAX_SCALE + 2) in shape
_STRING_OR_NUMBER = re.compile(
    r'"(?:[^"\\]|\\.)*"|-?(?:0|[1-9]\d*)(?:\.(\d+))?(?:[eE]([+-]?\d+))?')


class BadResult(SidecarError):
    """The tool's output is not one JSON value PostgreSQL can store; ``message`` says why,
    ``kind`` is the error kind of the failed job (``bad_result``, ``result_too_large``,
    ``stage_not_allowed``)."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.BAD_RESULT):
        super().__init__(message)
        self.message = message
        self.kind = kind


class StageSettings(Protocol):
    """What split_next_stage reads of the settings (``config.Settings`` has both), so this
    module needs no env parsing: the payload cap in bytes (0 = none) and the validated
    profile of a tool (ConfigError for an invalid one)."""

    @property
    def max_payload_bytes(self) -> int: ...

    def profile(self, tool: str) -> LeaseProfile: ...


def parse_result(data: bytes | bytearray | memoryview,
                 source: str = "stdout") -> tuple[Any, RawJson]:
    """Parse the tool's output (UTF-8 JSON text, at most ``len(data)`` bytes); ``source``
    names where it came from in messages (stdout, SIDECAR_RESULT_FILE).

    Returns ``(value, text)``: the parsed value (for the next-stage check, P19; numbers no
    float holds as ``jsontext.ExactNumber``) and the
    original text as ``RawJson``, sent to PostgreSQL as is. Raises BadResult for output
    that is not UTF-8, not JSON, nested deeper than orjson's limit (1024 levels), holds a
    number PostgreSQL's numeric cannot store (1e-20000, 1e131072; a 400-digit integer or
    1e400 is kept exactly, case F24) or exponents that blow the document up (see
    jsontext.MAX_NUMBER_GROWTH), or holds ``\\u0000`` (valid JSON that jsonb refuses).
    """
    shape = jsontext.number_shape(data)
    try:
        value = jsontext.loads(data, shape, bounded=True)
    except jsontext.NumberOutOfRange as exc:
        raise BadResult(f"exit 0 but {source} holds a number the sidecar refuses: {exc}; "
                        f"{len(data)} bytes") from None
    except ValueError as exc:  # orjson.JSONDecodeError
        reason = str(exc)[:_REASON_CHARS]
        raise BadResult(f"exit 0 but {source} is not one JSON value ({reason}); "
                        f"{len(data)} bytes") from None
    try:
        text = str(data, "utf-8")  # any buffer (bytearray, memoryview), no extra copy
    except UnicodeDecodeError:  # orjson checks UTF-8 too; kept for a clear message anyway
        raise BadResult(f"{source} is not UTF-8; {len(data)} bytes") from None
    if "\\u0000" in text and _has_nul_escape(text):
        raise BadResult("the JSON holds \\u0000, which PostgreSQL jsonb cannot store")
    if _maybe_long_exponent_or_fraction(shape):
        _check_scales(text)
    return value, RawJson(text)


def split_next_stage(value: Any, text: RawJson, settings: StageSettings, profile: LeaseProfile,
                     ) -> tuple[RawJson, NextStage | None]:
    """Split a tool's output (``value`` parsed from ``text`` by parse_result) of the form
    ``{"result": R, "next": {"tool": T, "payload": P}}`` (P19) into R's JSON text and the
    next stage; any other output is the result itself (``text``), with no next stage.
    Numbers keep every digit (``jsontext``, case F11). Raises BadResult (kind
    ``bad_result`` or ``stage_not_allowed``) for a malformed next stage, a tool not in the
    profile's NEXT_TOOLS, or a payload over SIDECAR_MAX_PAYLOAD_BYTES."""
    if not (isinstance(value, dict) and value.keys() == {"result", "next"}):
        return text, None
    nxt = value["next"]
    if not (isinstance(nxt, dict) and isinstance(nxt.get("tool"), str)
            and set(nxt) <= {"tool", "payload"}):
        raise BadResult('a next stage must be {"tool": NAME, "payload": JSON}')
    if nxt["tool"] not in profile.next_tools:
        allowed = ", ".join(sorted(profile.next_tools)) or "none"
        raise BadResult(f"next stage tool {nxt['tool']!r} is not allowed for "
                        f"{profile.tool!r} (SIDECAR_PROFILE_{tool_env_key(profile.tool)}"
                        f"_NEXT_TOOLS: {allowed})", kind=FailureKind.STAGE_NOT_ALLOWED)
    payload = nxt.get("payload", {})
    limit = settings.max_payload_bytes
    if limit and len(jsontext.dumps(payload)) > limit:
        raise BadResult(f"the next stage's payload is larger than "
                        f"SIDECAR_MAX_PAYLOAD_BYTES={limit}")
    next_profile = settings.profile(nxt["tool"])
    return (RawJson(jsontext.dumps(value["result"]).decode()),
            NextStage(nxt["tool"], payload, next_profile.max_attempts))


def _check_scales(text: str) -> None:
    """Raise BadResult for a number (outside strings) that would need more than
    NUMERIC_MAX_SCALE digits after the decimal point as a PostgreSQL numeric."""
    for match in _STRING_OR_NUMBER.finditer(text):
        if match.group(0).startswith('"'):
            continue  # a string literal, skipped whole
        try:
            scale = len(match.group(1) or "") - int(match.group(2) or 0)
        except ValueError:  # an exponent of thousands of digits
            scale = NUMERIC_MAX_SCALE + 1
        if scale > NUMERIC_MAX_SCALE:
            raise BadResult(f"the JSON holds a number PostgreSQL's numeric cannot store "
                            f"(more than {NUMERIC_MAX_SCALE} decimal places)")


def _has_nul_escape(text: str) -> bool:
    """True when ``\\u0000`` appears as an escape (an odd number of backslashes before
    ``u0000``), not as the literal text of an escaped backslash."""
    start = 0
    while (at := text.find("\\u0000", start)) != -1:
        slashes = 0
        while at - slashes - 1 >= 0 and text[at - slashes - 1] == "\\":
            slashes += 1
        if slashes % 2 == 0:
            return True
        start = at + 1
    return False


def scrub_text(text: str | None, *, cut_start: bool = False,
               cut_end: bool = False) -> str | None:
    """Text from a tool (stderr tail, messages) made safe to store and show: every secret
    the sidecar knows (``masking.SECRETS``: the database URL and password, the guard
    tokens) replaced by ``[secret]``, a piece of one at an edge the text was cut at
    (``cut_start``, ``cut_end``) too (issue 25); NUL replaced (jsonb refuses
    ``\\u0000``), lone surrogates replaced. None stays None."""
    if text is None:
        return None
    text = SECRETS.scrub(text, cut_start=cut_start, cut_end=cut_end)
    return text.replace("\x00", "\N{REPLACEMENT CHARACTER}").encode(
        "utf-8", "replace").decode("utf-8")


def stderr_tail_text(raw: bytes, cut: bool, limit: int) -> str | None:
    """The ``error.stderr_tail`` of an attempt: the last ``limit`` bytes of the tool's
    stderr as text, scrubbed (``scrub_text``) *before* it is cut to ``limit``, so a secret
    that straddles the cut is found whole. ``raw`` is the end of the stderr (more than
    ``limit`` bytes kept, sidecar.worker.child.STDERR_TAIL_MARGIN), ``cut`` says the tool wrote
    more than ``raw``. None for no output."""
    text = scrub_text(raw.decode("utf-8", "replace"), cut_start=cut)
    if len(text) > limit // 4:  # may be longer than ``limit`` bytes: cut on bytes
        text = text.encode("utf-8")[-limit:].decode("utf-8", "replace")
    return text or None


class SecretInOutput(BadResult):
    """The tool's output holds a secret the sidecar knows (``labels``: which kinds, e.g.
    ``database_url``, ``guard_token``; never the value): it is not stored, the attempt
    fails ``secret_in_output`` (not retried: the same input would echo it again)."""

    def __init__(self, source: str, labels: list[str], size: int):
        super().__init__(f"{source} holds a secret the sidecar knows ({', '.join(labels)}); "
                         f"the result ({size} bytes) was not stored (a tool echoed what it "
                         "read, e.g. a mounted Secret: see docs/isolation.md)",
                         FailureKind.SECRET_IN_OUTPUT)
        self.labels = labels


def check_no_secret(data: bytes | bytearray, source: str = "stdout") -> None:
    """Raise SecretInOutput when the tool's output ``data`` (the whole of it: the result
    and any next stage's payload, P19) holds a value of ``masking.SECRETS`` in any
    spelling (as is or JSON-escaped, ``masking.secret_forms``). One ``bytes.find`` per
    spelling: about 15 ms for a 6 MB result with 16 attempts' tokens registered."""
    labels = SECRETS.labels_in(data)
    if labels:
        raise SecretInOutput(source, labels, len(data))
