"""One parser per kind of input (issue 40, point 4): ``HOST:PORT``, durations, job ids and
the loopback hosts, used alike by the CLI, the client, the MCP gateway, the web view, the
receiver and the settings. Pure: no I/O, so each rule is tested without a database
(tests/test_parsers.py) and read in one place. (The enqueue options' one parser is
sidecar.protocol.enqueue_args.enqueue_options, built on these.)

Every parser comes in two layers: ``split_*``/``*_seconds`` raise ParseError carrying
only the reason (sidecar.runtime.config adds the variable's name its own way), and ``parse_*``
raise ``error`` (UsageError by default: exit 2) with one line that names the field, the
value as given (shortened) and the form wanted.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import math
import re
import uuid

from sidecar.protocol.errors import SidecarError, UsageError


class ParseError(ValueError):
    """A value refused; ``str()`` is the reason and the form wanted, without the field."""


def _line(field: str, value: object, reason: str, echo: bool = True) -> str:
    """``FIELD 'VALUE': REASON`` (text quoted, other values as repr; shortened to 80
    characters), or ``FIELD:
    REASON`` without ``echo`` (the web view names a field without repeating its value)."""
    if not echo:
        return f"{field}: {reason}"
    shown = repr(value[:80]) if isinstance(value, str) else repr(value)[:80]
    return f"{field} {shown}: {reason}"


# --- HOST:PORT ----------------------------------------------------------------------------

# A host name or IPv4 address (no colon, space or bracket), or anything but space and
# brackets inside brackets (an IPv6 address); then a port of ASCII digits.
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[^\[\]\s]+)\]|(?P<host>[^\s\[\]:]+)):(?P<port>[0-9]{1,5})",
                        re.ASCII)
HOST_PORT_FORM = ("use HOST:PORT with a port from 0 to 65535 (an IPv6 address in brackets, "
                  "e.g. [::1]:8080)")


def split_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` -> (host without brackets, port 0-65535). Raises
    ParseError for anything else: no port, a port above 65535 or not ASCII digits, an
    empty host, spaces, or an IPv6 address without brackets (``::1:8080`` is ambiguous)."""
    match = _HOST_PORT.fullmatch(text)
    if match is None or int(match["port"]) > 65535:
        raise ParseError(HOST_PORT_FORM)
    return match["v6"] or match["host"], int(match["port"])


def parse_host_port(text: str, field: str, example: str,
                    error: type[SidecarError] = UsageError) -> tuple[str, int]:
    """``split_host_port`` for a user's value: ``error`` (UsageError: exit 2) names
    ``field`` (e.g. ``--listen``) and gives ``example`` (e.g. ``127.0.0.1:8080``)."""
    try:
        return split_host_port(text)
    except ParseError as exc:
        raise error(_line(field, text, f"{exc}; e.g. {example}")) from None


def format_host_port(host: str, port: int) -> str:
    """(host, port) as ``HOST:PORT``, an IPv6 address in brackets: what split_host_port
    reads back, and the authority of an http:// URL."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- loopback ---------------------------------------------------------------------------

# The names a server on the loopback interface is reached by (an allow-list's defaults).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 with or without brackets) names this
    machine's loopback interface: ``localhost`` (any case), 127.0.0.0/8 or ::1. A host
    name other than localhost is not: whatever it resolves to may be more than us."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def loopback_patterns(scheme: str = "") -> list[str]:
    """``HOST:*`` patterns (``scheme://HOST:*`` with a scheme) for every LOOPBACK_NAMES
    entry, IPv6 in brackets: the Host and Origin headers a loopback server accepts."""
    prefix = f"{scheme}://" if scheme else ""
    return [prefix + format_host_port(name, 0).rpartition(":")[0] + ":*"
            for name in LOOPBACK_NAMES]


# --- durations --------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.ASCII)  # ASCII: no "١٢"
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
DURATION_FORM = "use seconds, or a number with s, m, h or d (e.g. 90, 30m, 12h, 7d)"


def is_duration(text: str) -> bool:
    """Whether ``text`` has a duration's form (whatever its size)."""
    return _DURATION.fullmatch(text.strip().lower()) is not None


def _most_text(most: float) -> str:
    days = most / 86400
    return f"{days:g} days" if days >= 1 and days == int(days) else f"{most:g} seconds"


def duration_seconds(text: str, most: float, positive: bool = False) -> float:
    """``text`` as seconds: a number, or one with a unit s, m, h or d (``90``, ``1.5s``,
    ``30m``, ``7d``; spaces around and between, any case; ASCII digits only), at most
    ``most`` seconds, and more than 0 with ``positive``. ParseError otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not match:
        raise ParseError(DURATION_FORM)
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not value <= most:
        raise ParseError(f"at most {_most_text(most)}")
    if positive and value <= 0:
        raise ParseError("must be more than 0")
    return value


def parse_duration(text: str, field: str, most: float, positive: bool = False,
                   error: type[SidecarError] = UsageError) -> float:
    """``duration_seconds`` for a user's value: ``error`` names ``field``."""
    try:
        return duration_seconds(text, most, positive)
    except ParseError as exc:
        raise error(_line(field, text, str(exc))) from None


def seconds_value(value: object, field: str, most: float | None = None,
                  positive: bool = False) -> float:
    """A duration given from Python: ``int``/``float`` seconds or a ``timedelta`` (never a
    bool, NaN or infinity), from 0 (more than 0 with ``positive``) to ``most`` seconds
    (None: no bound). UsageError naming ``field`` otherwise."""
    seconds = value.total_seconds() if isinstance(value, dt.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise UsageError(_line(field, value, "give seconds or a timedelta"))
    if not math.isfinite(seconds) or seconds < 0 or (most is not None and seconds > most):
        bound = f"from 0 to {_most_text(most)}" if most is not None else "0 or more"
        raise UsageError(_line(field, value, f"must be {bound}"))
    if positive and seconds <= 0:
        raise UsageError(_line(field, value, "must be more than 0"))
    return float(seconds)


# --- job ids ----------------------------------------------------------------------------

JOB_ID_FORM = "not a UUID; give a job id as 'sidecar enqueue' prints it"


def parse_job_id(value: object, field: str = "JOB_ID",
                 error: type[SidecarError] = UsageError, echo: bool = True) -> uuid.UUID:
    """A job id: a uuid.UUID as it is, or its text in any form uuid.UUID reads (hyphens,
    braces, ``urn:uuid:``, any case). ``error`` (UsageError: exit 2) names ``field`` and,
    with ``echo``, the value."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return uuid.UUID(value)
    except ValueError:
        raise error(_line(field, value, JOB_ID_FORM, echo)) from None
