"""Delivers accepted results to a profile's ``RESULT_URL`` from the outbox, at least once.

The fenced completion (P6) queued the row in the same statement as the result, so only an
accepted result is ever forwarded. Any sidecar may deliver any row: rows are claimed with
SKIP LOCKED under a forwarding lease of their own, so a sidecar that dies mid-delivery
leaves the row to another after that lease. Each POST carries
``Idempotency-Key: tool-job:{id}:result`` and ``X-Execution-Fence: {token}`` (P7, P17), so
a receiver replays duplicates and refuses a stale owner.

Outcomes: 2xx delivered (``effect_forwarded``); 409 ``stale_fence`` or another 4xx except
408/429 dead-lettered with the reason (``effect_rejected``, ``forward_dead_lettered``);
anything else (5xx, 408, 429, a refused or timed-out connection) retried with
exponential backoff and jitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import TYPE_CHECKING

from sidecar.config import Settings
from sidecar.log import log
from sidecar.store import Store

if TYPE_CHECKING:
    import aiohttp

FORWARD_LEASE_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 20.0  # well inside the forwarding lease
BATCH = 8


def is_permanent_refusal(status: int) -> bool:
    """A 4xx other than 408 (timeout) and 429 (rate limited) will not change on retry."""
    return 400 <= status < 500 and status not in (408, 429)


class Forwarder:
    """One sidecar's delivery loop. ``wake()`` makes it look for work at once."""

    def __init__(self, store: Store, settings: Settings, owner_id: str):
        self.store = store
        self.settings = settings
        self.owner_id = owner_id
        self._wake = asyncio.Event()
        self.log_errors = True  # False: database errors of the outbox poll are not logged

    def wake(self) -> None:
        """Called after a commit that queued a result."""
        self._wake.set()

    async def run(self) -> None:
        """Deliver until cancelled; database errors are logged and retried next period.
        The HTTP client (aiohttp, about 12 MiB once imported) is made at the first row to
        deliver, so a sidecar whose results are never forwarded does not carry it."""
        session = None
        try:
            while True:
                self._wake.clear()
                try:
                    rows = await self.store.claim_outbox(self.owner_id, FORWARD_LEASE_SECONDS,
                                                         BATCH)
                    if rows and session is None:
                        session = _client_session()
                    await asyncio.gather(*(self._deliver(session, row) for row in rows))
                except (OSError, TimeoutError, ConnectionError) as exc:
                    if self.log_errors:
                        log.emit("forward_error", "warning",
                                 reason=f"{type(exc).__name__}: {exc}")
                    rows = []
                except Exception as exc:  # noqa: BLE001 - asyncpg errors; never kill the loop
                    if self.log_errors:
                        log.emit("forward_error", "warning",
                                 reason=f"{type(exc).__name__}: {exc}")
                    rows = []
                if len(rows) == BATCH:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_seconds)
        finally:
            if session is not None:
                await session.close()

    async def _deliver(self, session: aiohttp.ClientSession, row) -> None:
        import aiohttp

        fields = {"job_id": str(row["job_id"]), "tool": row["tool"],
                  "fencing_token": row["fencing_token"]}
        headers = {"Content-Type": "application/json",
                   "Idempotency-Key": row["idempotency_key"],
                   "X-Execution-Fence": str(row["fencing_token"])}
        status: int | None = None
        try:
            async with session.post(row["url"], data=row["body_text"].encode(),
                                    headers=headers) as response:
                status = response.status
                text = (await response.text(errors="replace"))[:500]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            text = f"{type(exc).__name__}: {exc}"[:500]
        if status is not None and 200 <= status < 300:
            await self.store.outbox_delivered(row["id"], self.owner_id, status)
            log.emit("effect_forwarded", **fields, status=status, attempt=row["attempts"])
        elif status is not None and is_permanent_refusal(status):
            reason = _reason(text) or f"HTTP {status}"
            await self.store.outbox_dead_letter(row["id"], self.owner_id, status, reason)
            log.emit("forward_dead_lettered", "warning", **fields, status=status, reason=reason)
        else:
            profile = self.settings.profile(row["tool"])
            delay = min(profile.backoff_max_seconds,
                        profile.backoff_base_seconds * 2 ** (row["attempts"] - 1))
            delay *= random.uniform(0.5, 1.0)
            await self.store.outbox_retry_later(row["id"], self.owner_id, delay, status, text)
            log.emit("forward_retry", "warning", **fields, status=status,
                     reason=text[:200], retry_in_s=round(delay, 3))


def _client_session() -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS))


def _reason(body: str) -> str | None:
    """The receiver's ``error`` field (e.g. ``stale_fence``) when it answered JSON."""
    import orjson

    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.strip()[:200] or None
    if isinstance(parsed, dict) and parsed.get("error"):
        return str(parsed["error"])
    return body.strip()[:200] or None
