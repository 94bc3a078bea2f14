"""Flow control's vocabulary (issue 27): limits as the operator writes them, parsed and
bounded, and why a claim took nothing. Pure: no I/O, so ``sidecar limit`` checks its
arguments before it connects and tests sweep the rules without a database.

The limits live in the database (table ``tool_flow``, migration 016) and are enforced by
the claim itself (``tool_job_claim_flow``): every sidecar of the fleet obeys the same
values from its next claim on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sidecar.protocol.errors import UsageError

# The largest cap and burst accepted; a larger one is a typo, not a limit.
MAX_CAP = 1_000_000
# The rates accepted, in tokens per second: from 1/m to 100,000/s.
MIN_RATE_PER_SECOND = 1 / 60
MAX_RATE_PER_SECOND = 100_000.0
MAX_KEY_CHARS = 256
MAX_REASON_CHARS = 500
_RATE = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)/([sm])", re.ASCII)
_PERIOD_SECONDS = {"s": 1.0, "m": 60.0}


class Held(StrEnum):
    """Why a claim of a tool with a flow row took nothing although the tool may have
    queued jobs (the claim's ``blocked`` column, migration 016)."""

    PAUSED = "paused"
    MAX_RUNNING = "max_running"
    MAX_RUNNING_PER_KEY = "max_running_per_key"
    RATE = "rate"
    RATE_PER_KEY = "rate_per_key"
    # Not a limit: the claim visited its bound of keys with no due job among them; the
    # next claim goes on from there at once.
    MORE_KEYS = "more_keys"


@dataclass(frozen=True)
class ClaimHeld:
    """A claim that took nothing because a limit held it back: ``reason``, and for a
    rate, ``retry_in`` seconds until its bucket holds a token (by the database's clock);
    None when only a freed slot, a resume or a limit change lets a job start (each wakes
    an idle sidecar)."""

    reason: Held
    retry_in: float | None = None


def parse_rate(text: str, option: str) -> tuple[str, float]:
    """``"10/s"`` or ``"600/m"`` (a count per second or per minute) -> ``(text,
    tokens per second)``; UsageError naming ``option`` for anything else, or a rate below
    1/m or above MAX_RATE_PER_SECOND."""
    match = _RATE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"{option} {text[:40]!r}: give N/s or N/m (N a number with at "
                         "most 6 decimals), e.g. 10/s or 600/m")
    count, unit = float(match.group(1)), match.group(2)
    per_second = count / _PERIOD_SECONDS[unit]
    if not MIN_RATE_PER_SECOND - 1e-12 <= per_second <= MAX_RATE_PER_SECOND:
        raise UsageError(f"{option} {text[:40]!r}: must be from 1/m to "
                         f"{MAX_RATE_PER_SECOND:,.0f}/s")
    return f"{match.group(1)}/{unit}", per_second


def check_cap(value: int, option: str) -> int:
    """``value`` if it is a cap from 1 to MAX_CAP; else UsageError naming ``option``."""
    if not 1 <= value <= MAX_CAP:
        raise UsageError(f"{option} {value}: must be from 1 to {MAX_CAP}")
    return value


def check_concurrency_key(key: str, option: str = "--concurrency-key",
                          example: str = "tenant-42") -> str:
    """``key`` if it is 1-256 printable characters of valid UTF-8; else UsageError
    naming ``option`` (with ``example``). Also the rule of a session's key (``--session``).
    (``tool_job_enqueue`` refuses control characters and blank keys too; separators other
    than the space, which Python does not call printable, only the CLI and the client
    refuse.)"""
    if not key.strip() or len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise UsageError(f"{option} must be 1-{MAX_KEY_CHARS} printable characters, "
                         f"e.g. {example}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{option} is not valid UTF-8") from None
    return key


def check_reason(text: str) -> str:
    """A pause's reason: 1 to MAX_REASON_CHARS printable characters of valid UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("--reason is not valid UTF-8") from None
    if not text.strip() or len(text) > MAX_REASON_CHARS or not text.isprintable():
        raise UsageError(f"--reason must be 1-{MAX_REASON_CHARS} printable characters")
    return text


def limit_changes(max_running: int | None = None, max_running_per_key: int | None = None,
                  rate: str | None = None, rate_per_key: str | None = None,
                  burst: int | None = None, clear: bool = False) -> dict[str, Any]:
    """The fields ``sidecar limit`` changes, as the ``set_tool_limits`` statement takes
    them: only those given (None = keep); ``clear`` sets every limit to none and may not
    be combined with a value. UsageError when nothing is given or a value is out of
    range."""
    given = {name: value for name, value in (
        ("max_running", max_running), ("max_running_per_key", max_running_per_key),
        ("rate", rate), ("rate_per_key", rate_per_key), ("burst", burst))
        if value is not None}
    if clear:
        if given:
            raise UsageError("--clear removes every limit of the tool; give it alone")
        return {"max_running": None, "max_running_per_key": None, "rate": None,
                "rate_per_second": None, "rate_per_key": None, "key_rate_per_second": None,
                "burst": None}
    if not given:
        raise UsageError("give at least one of --max-running, --max-running-per-key, "
                         "--rate, --rate-per-key, --burst, or --clear")
    changes: dict[str, Any] = {}
    if max_running is not None:
        changes["max_running"] = check_cap(max_running, "--max-running")
    if max_running_per_key is not None:
        changes["max_running_per_key"] = check_cap(max_running_per_key,
                                                   "--max-running-per-key")
    if rate is not None:
        changes["rate"], changes["rate_per_second"] = parse_rate(rate, "--rate")
    if rate_per_key is not None:
        changes["rate_per_key"], changes["key_rate_per_second"] = parse_rate(
            rate_per_key, "--rate-per-key")
    if burst is not None:
        changes["burst"] = check_cap(burst, "--burst")
    return changes
