"""A tool's progress reports (issue 26): what the attempt that owns the lease says about
how far it got, stored on the job row, sent to the job's waiters and counted as activity
by the idle watchdog.

Two ways in, one report ``{"progress": 0..1 or null, "message": "..." or null}`` (a JSON
object of at most PROGRESS_BODY_LIMIT bytes, a message of at most MESSAGE_CHARS printable
characters):

- ``POST $SIDECAR_GUARD_URL/v1/progress`` with the guard's token (sidecar.worker.guard);
- rewriting the file ``$SIDECAR_PROGRESS_FILE`` (``progress.json`` in the attempt's work
  directory), for tools that cannot do HTTP: looked at every FILE_SECONDS on a timer of its
  own (never the heartbeat's: a caller waiting on progress must not wait a heartbeat period,
  issue 41) through the work directory's descriptor (one ``fstatat``, no link followed; the
  file is read, bounded: sidecar.worker.safefs, only when its modification time, change
  time, size or inode moved); only a rewrite (a new modification time or content) counts as
  a report.

Each report is written by a fenced statement (WorkerStore.report_progress_if_owner: owner,
token and a live lease), at most once per WRITE_SECONDS per attempt: a report that comes
sooner is kept (the latest wins) and written when that second is over. The journal gets a
``job_progress`` row at most every JOURNAL_SECONDS per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson

from sidecar.protocol.lease_state import Lease
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import ClaimedJob
from sidecar.runtime.log import log, log_fields
from sidecar.storage import db
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker import safefs

PROGRESS_FILE_NAME = "progress.json"
PROGRESS_BODY_LIMIT = 4096   # bytes of one report (HTTP body or file)
MESSAGE_CHARS = 1000         # characters of a message (the NOTIFY payload stays < 8000 B)
WRITE_SECONDS = 1.0          # at most one write of an attempt's progress per this
JOURNAL_SECONDS = 5.0        # at most one job_progress journal row per attempt per this
FILE_SECONDS = 0.5           # SIDECAR_PROGRESS_FILE is looked at this often (issue 41)
_KEYS = frozenset({"progress", "message"})


class BadProgress(ValueError):
    """A report that is not ``{"progress": 0..1 or null, "message": str or null}``;
    ``error`` is ``bad_json`` or ``bad_request``, the text says what to fix."""

    def __init__(self, error: str, message: str):
        super().__init__(message)
        self.error = error


class NotOwner(Exception):
    """This attempt no longer owns the job: the report was not stored."""


def parse_report(body: bytes) -> tuple[float | None, str | None]:
    """``(value, message)`` of one report (an empty body is ``{}``). Raises BadProgress."""
    if not body.strip():
        return None, None
    try:
        report = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadProgress("bad_json", f"the report is not JSON ({exc})") from None
    if not isinstance(report, dict):
        raise BadProgress("bad_request", 'the report must be a JSON object {"progress": '
                          '0..1 or null, "message": "..."}')
    unknown = sorted(set(report) - _KEYS)
    if unknown:
        raise BadProgress("bad_request", f"unknown key {unknown[0]!r}: a report has "
                          '"progress" (0..1 or null) and "message" only')
    value = report.get("progress")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not 0 <= value <= 1):
        raise BadProgress("bad_request", f"progress must be a number from 0 to 1 or null, "
                          f"not {orjson.dumps(value).decode()[:40]}")
    message = report.get("message")
    if message is not None and not (isinstance(message, str) and len(message) <= MESSAGE_CHARS
                                    and message.isprintable()):
        raise BadProgress("bad_request", f"message must be a string of at most "
                          f"{MESSAGE_CHARS} printable characters (no line breaks) or null")
    return (None if value is None else float(value)), message


class ProgressReporter:
    """The progress of one attempt (``job`` under ``lease``, owned by ``owner_id``).

    ``reports`` counts the reports accepted (the idle watchdog's activity, sidecar.
    supervisor.watch_idle); ``fenced_out`` is set once a write found the job not ours."""

    def __init__(self, store: WorkerStore, owner_id: str, job: ClaimedJob, lease: Lease):
        self.store = store
        self.owner_id = owner_id
        self.job = job
        self.lease = lease
        self.reports = 0
        self.fenced_out = False
        self._pending: tuple[float | None, str | None, str] | None = None
        self._last_write = float("-inf")
        self._last_journal = float("-inf")
        self._writing = asyncio.Lock()
        self._deferred: asyncio.Task | None = None
        self._file_refused: str | None = None

    @property
    def lost(self) -> bool:
        """The attempt may not report any more (lease lost, outcome being written, or a
        write found the job not ours)."""
        return self.fenced_out or self.lease.lost.is_set() or self.lease.settling

    async def report(self, value: float | None, message: str | None, source: str) -> float:
        """Accept one report from ``source`` (``http`` or ``file``): written now (returns
        0.0) or, within WRITE_SECONDS of the last write, kept and written in the seconds
        returned (the latest report wins). Raises NotOwner when the attempt may not report
        (nothing stored), and what the store raises (db.DATABASE_ERRORS)."""
        if self.lost:
            raise NotOwner()
        self.reports += 1
        self._pending = (value, message, source)
        wait = self._last_write + WRITE_SECONDS - time.monotonic()
        if wait > 0 or self._writing.locked():
            if self._deferred is None:
                self._deferred = asyncio.ensure_future(self._write_later(max(wait, 0.0)))
            return max(wait, 0.0) or WRITE_SECONDS
        await self._write()
        return 0.0

    async def _write(self) -> None:
        async with self._writing:
            if self._pending is None:
                return
            value, message, source = self._pending
            self._pending = None
            now = time.monotonic()
            self._last_write = now
            journal = now - self._last_journal >= JOURNAL_SECONDS
            stored = await self.store.report_progress_if_owner(
                self.job, self.owner_id, {"value": value, "message": message},
                {"source": source}, journal)
            if not stored:
                self.fenced_out = True
                raise NotOwner()
            if journal:
                self._last_journal = now

    async def _write_later(self, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            if not self.lost:
                await self._write()
        except (NotOwner, *db.DATABASE_ERRORS):
            pass  # not ours any more, or the next report writes it
        finally:
            self._deferred = None
            if self._pending is not None and not self.lost:  # came in during the write
                self._deferred = asyncio.ensure_future(self._write_later(WRITE_SECONDS))

    def close(self) -> None:
        """The attempt ended: a report not yet written is dropped."""
        self._pending = None
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None

    async def watch_file(self, dir_fd: int, owner_uid: int | None,
                         period: float = FILE_SECONDS) -> None:
        """Look at ``$SIDECAR_PROGRESS_FILE`` through the work directory's descriptor
        ``dir_fd`` every ``period`` seconds (FILE_SECONDS, independent of the heartbeat:
        issue 41) and report each rewrite; returns once the attempt may not report any
        more. Each look is one ``fstatat`` (no link followed); the file is opened and read
        (at most PROGRESS_BODY_LIMIT bytes, sidecar.worker.safefs.read_small_file) only when
        its inode, size, modification or change time moved. A file that cannot be used (a
        link, too large, not a report) is logged once per reason as
        ``progress_file_refused`` and otherwise ignored. The report goes through ``report``:
        the same fencing and write throttle as ``POST /v1/progress``."""
        last: tuple[bytes, int] | None = None
        seen: tuple[int, int, int, int] | None = None
        while not self.lost:
            await asyncio.sleep(period)
            try:
                # One fstatat per look; on a change one open, fstat and read of at most
                # 4 KiB: on the loop (as has_result).
                info = safefs.lstat_at(dir_fd, PROGRESS_FILE_NAME)
                if info is None:
                    continue
                stamp = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
                if stamp == seen:
                    continue
                seen = stamp
                found = safefs.read_small_file(dir_fd, PROGRESS_FILE_NAME,
                                               PROGRESS_BODY_LIMIT, owner_uid)
                if found is None or found == last:
                    continue
                last = found
                labels = SECRETS.labels_in(found[0])
                if labels:
                    raise BadProgress("secret_in_output", "it holds a secret of the "
                                      f"sidecar's ({', '.join(labels)})")
                value, message = parse_report(found[0])
            except (ValueError, OSError) as exc:
                self._refuse_file(str(exc))
                continue
            with contextlib.suppress(NotOwner, *db.DATABASE_ERRORS):
                await self.report(value, message, "file")

    def _refuse_file(self, reason: str) -> None:
        if reason != self._file_refused:
            self._file_refused = reason
            log.emit("progress_file_refused", "warning", **log_fields(self.job),
                     reason=f"SIDECAR_PROGRESS_FILE: {reason}"[:300])


def report_answer(waited: float) -> tuple[int, dict[str, Any]]:
    """The guard's answer to an accepted report: ``200 {"stored": true}`` when written now,
    ``202 {"stored": false, "write_in_s": S}`` when kept for the next write."""
    if waited <= 0:
        return 200, {"stored": True}
    return 202, {"stored": False, "write_in_s": round(waited, 3)}
