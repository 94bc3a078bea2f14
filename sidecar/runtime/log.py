"""Structured events as JSON lines (orjson) on stderr, built in one place.

Every line has ``ts``, ``level`` and ``event`` first, then the job fields that
apply (``job_id``, ``tool``, ``fencing_token``, ``attempt``, ``lease_until``,
``reason``, ``duration_s``), then the rest. Payloads, results and stderr content
never appear in an event except the child's own stderr lines as ``tool_stderr``
(P23: only ids, hashes, sizes, durations and error kinds). Every secret value the
sidecar knows (``masking.SECRETS``) is replaced by ``[secret]`` in any field before the
line is written (issue 25).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import re
import sys
from typing import Any

import orjson

from sidecar.protocol.masking import SECRETS, mask_text

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
_ORDER = ("job_id", "tool", "fencing_token", "attempt", "lease_until", "reason", "duration_s")
# Every C0 control (line breaks included: one event is one line), DEL and the one-byte CSI.
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x9b]")


class EventLog:
    """Writes events to a binary stream (default stderr) as JSON lines or text.

    ``level`` drops events below it; ``fmt`` is "json" or "text" (for people;
    control characters are escaped so a tool cannot drive the terminal).
    """

    def __init__(self, level: str = "info", fmt: str = "json", stream=None):
        self.threshold = _LEVELS[level]
        self.fmt = fmt
        self.stream = stream if stream is not None else sys.stderr.buffer

    def enabled(self, level: str) -> bool:
        """True when events of ``level`` would be written (skip building costly ones)."""
        return _LEVELS[level] >= self.threshold

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        """Write one event; ``None`` fields are left out."""
        if _LEVELS[level] < self.threshold:
            return
        record: dict[str, Any] = {
            "ts": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
            "level": level,
            "event": event,
        }
        for key in _ORDER:
            value = fields.pop(key, None)
            if value is not None:
                record[key] = value
        record.update((k, v) for k, v in fields.items() if v is not None)
        line = self._line(record)
        if SECRETS.holds(line):  # a secret the sidecar knows, in any field (issue 25)
            line = self._line(SECRETS.scrub_value(_plain(record)))
        try:
            self.stream.write(line)
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            pass


    def _line(self, record: dict[str, Any]) -> bytes:
        """One event as the bytes of one line, in this log's format."""
        if self.fmt == "json":
            return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE, default=str)
        record = dict(record)
        head = f"{record.pop('ts')} {record.pop('level').upper():7} {record.pop('event')}"
        rest = " ".join(f"{k}={_text(v)}" for k, v in record.items())
        return (head + (" " + rest if rest else "") + "\n").encode("utf-8", "replace")


def _plain(value: Any) -> Any:
    """``value`` with every object orjson would write with ``str`` (an exception, a path)
    already made a string, so scrub_value reaches its text too."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool | _dt.datetime):
        return value
    return str(value)


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def log_fields(job: Any) -> dict[str, Any]:
    """The fields every event about one attempt carries (P22): ``job_id``, ``tool``,
    ``fencing_token`` and ``attempt`` of ``job`` (a model.ClaimedJob or anything with
    those attributes)."""
    return {"job_id": str(job.id), "tool": job.tool, "fencing_token": job.fencing_token,
            "attempt": job.attempt}


def payload_digest(data: bytes) -> dict[str, Any]:
    """``{"sha256": hex, "bytes": n}`` of a payload or result: what P6/P23 let us keep."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


log = EventLog()


class _LibraryBridge(logging.Handler):
    """Turns warnings of libraries (asyncpg's pool, aiohttp) into ``library_log`` events, so
    stderr stays JSON lines: the message and the exception's type, no traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        level = "error" if record.levelno >= logging.ERROR else "warning"
        exc = record.exc_info[1] if record.exc_info else None
        log.emit("library_log", level, logger=record.name,
                 reason=mask_text(record.getMessage())[:300],
                 exception=mask_text(f"{type(exc).__name__}: {exc}")[:300] if exc else None)


def configure(level: str, fmt: str) -> None:
    """Set the process-wide event log's level and format (from Settings), and route
    library log records (WARNING and up) through it."""
    log.threshold = _LEVELS[level]
    log.fmt = fmt
    root = logging.getLogger()
    if not any(isinstance(h, _LibraryBridge) for h in root.handlers):
        root.addHandler(_LibraryBridge(logging.WARNING))
