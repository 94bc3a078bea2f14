"""Delivers accepted results to a profile's ``RESULT_URL`` from the outbox, at least once.

The fenced completion (P6) queued the row in the same statement as the result, so only an
accepted result is ever forwarded. Any sidecar may deliver any row: rows are claimed with
SKIP LOCKED under a forwarding lease of their own, so a sidecar that dies mid-delivery
leaves the row to another after that lease. Each POST carries
``Idempotency-Key: tool-job:{id}:result`` and ``X-Execution-Fence: {token}`` (P7, P17), so
a receiver replays duplicates and refuses a stale owner.

Outcomes: 2xx delivered (``effect_forwarded``); 409 ``stale_fence`` or another 4xx except
408/429 dead-lettered with the reason (``effect_rejected``, ``forward_dead_lettered`` kind
``refused``); anything else (5xx, 408, 429, a refused or timed-out connection) retried with
exponential backoff and jitter, bounded (case F21) by the profile's FORWARD_MAX_ATTEMPTS
and FORWARD_MAX_AGE_SECONDS (counted from ``pending_since``, by the database's clock),
then dead-lettered (kind ``max_attempts`` or ``max_age``).

Redirects are never followed by the HTTP client: a 3xx is not a delivery (aiohttp would
turn a POST answered 301/302/303 into a bodyless GET, and a 200 to that GET is not the
receiver accepting the result). It is dead-lettered (kind ``redirect``, with its
``Location``), unless the profile sets FORWARD_FOLLOW_REDIRECTS: then a 307 or 308, which
keep the method and body, is followed by POSTing the same body and headers to its
``Location`` (at most MAX_REDIRECTS hops); any other 3xx is still dead-lettered.
Every dead letter is journaled, logged, counted (``sidecar_forward_dead_letters_total``),
shown by ``sidecar show`` and re-delivered by ``sidecar retry --forwarding JOB_ID``.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

from sidecar.ops import metrics
from sidecar.ops.periodic import POLL_SPREAD, Periodic
from sidecar.protocol.masking import mask_url
from sidecar.protocol.model import LeaseProfile
from sidecar.runtime.config import Settings
from sidecar.runtime.log import log
from sidecar.storage.worker_store import WorkerStore

if TYPE_CHECKING:
    import aiohttp

FORWARD_LEASE_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 20.0  # well inside the forwarding lease
BATCH = 8
MAX_REDIRECTS = 5  # 307/308 hops followed with FORWARD_FOLLOW_REDIRECTS


def is_permanent_refusal(status: int) -> bool:
    """A 4xx other than 408 (timeout) and 429 (rate limited) will not change on retry."""
    return 400 <= status < 500 and status not in (408, 429)


class Forwarder:
    """One sidecar's delivery loop. ``wake()`` makes it look for work at once."""

    def __init__(self, store: WorkerStore, settings: Settings, owner_id: str):
        self.store = store
        self.settings = settings
        self.owner_id = owner_id
        self._wake = asyncio.Event()
        self.log_errors = True  # False: database errors of the outbox poll are not logged

    def wake(self) -> None:
        """Called after a commit that queued a result."""
        self._wake.set()

    async def run(self) -> None:
        """Deliver until cancelled, as the periodic service ``forwarder``
        (sidecar.ops.periodic): a batch every ``SIDECAR_POLL_SECONDS``, at once after a full
        one or a ``wake()``; any error (the database, the network: never kills the loop)
        is logged as ``forward_error`` unless ``log_errors`` is False, and retried next
        period. The HTTP client (aiohttp, about 12 MiB once imported) is made at the first
        row to deliver, so a sidecar whose results are never forwarded does not carry it."""
        session = None

        async def step() -> bool:
            nonlocal session
            rows = await self.store.claim_outbox(self.owner_id, FORWARD_LEASE_SECONDS, BATCH)
            if rows and session is None:
                session = _client_session()
            await asyncio.gather(*(self._deliver(session, row) for row in rows))
            return len(rows) == BATCH

        try:
            await Periodic("forwarder", lambda: self.settings.poll_seconds, step, first=0,
                           spread=POLL_SPREAD, wake=self._wake, errors=(Exception,),
                           error_event="forward_error",
                           error_fields=lambda exc: {"reason": f"{type(exc).__name__}: {exc}"}
                           if self.log_errors else None).run()
        finally:
            if session is not None:
                await session.close()

    async def _deliver(self, session: aiohttp.ClientSession, row) -> None:
        fields = {"job_id": str(row["job_id"]), "tool": row["tool"],
                  "fencing_token": row["fencing_token"]}
        profile = self.settings.profile(row["tool"])
        attempts, age = row["attempts"], row["age_s"]
        if attempts > profile.forward_max_attempts:
            # Claimed more often than allowed without an answer (forwarders that died
            # mid-delivery): the bound holds without another request.
            await self._dead_letter(row, profile, fields, None, "max_attempts",
                                    f"{attempts - 1} delivery attempts without an answer")
            return
        status, text, location, url = await _post(session, row, profile)
        if status is not None and 200 <= status < 300:
            await self.store.outbox_delivered(row["id"], self.owner_id, status)
            log.emit("effect_forwarded", **fields, status=status, attempt=attempts,
                     url=mask_url(url) if url != row["url"] else None)
        elif status is not None and 300 <= status < 400:
            shown = mask_url(location) if location else None
            await self._dead_letter(
                row, profile, fields, status, "redirect",
                f"HTTP {status} redirect to {shown or '(no Location)'}: a redirect is not a "
                "delivery" + ("" if profile.forward_follow_redirects else
                              "; set FORWARD_FOLLOW_REDIRECTS to follow 307/308"),
                {"location": shown})
        elif status is not None and is_permanent_refusal(status):
            await self._dead_letter(row, profile, fields, status, "refused",
                                    _reason(text) or f"HTTP {status}")
        elif attempts >= profile.forward_max_attempts:
            await self._dead_letter(row, profile, fields, status, "max_attempts",
                                    f"{attempts} delivery attempts failed; last: {text}"[:500])
        elif age >= profile.forward_max_age_seconds:
            await self._dead_letter(row, profile, fields, status, "max_age",
                                    f"undelivered after {age:.0f} s; last: {text}"[:500])
        else:
            delay = min(profile.backoff_max_seconds,
                        profile.backoff_base_seconds * 2 ** (attempts - 1))
            delay *= random.uniform(0.5, 1.0)
            # The last try falls at the age bound, not past it.
            delay = max(0.0, min(delay, profile.forward_max_age_seconds - age))
            await self.store.outbox_retry_later(row["id"], self.owner_id, delay, status, text)
            log.emit("forward_retry", "warning", **fields, status=status,
                     reason=text[:200], retry_in_s=round(delay, 3), attempt=attempts)

    async def _dead_letter(self, row, profile: LeaseProfile, fields: dict, status: int | None,
                           kind: str, reason: str, details: dict | None = None) -> None:
        """End the row's delivery without a delivery: journaled (``forward_dead_lettered``
        with ``kind``), logged and counted."""
        if await self.store.outbox_dead_letter(row["id"], self.owner_id, status, reason, kind,
                                               details):
            metrics.FORWARD_DEAD_LETTERS.labels(row["tool"], profile.provider, kind).inc()
            log.emit("forward_dead_lettered", "warning", **fields, status=status, kind=kind,
                     reason=reason[:300], attempts=row["attempts"])


async def _post(session: aiohttp.ClientSession, row, profile: LeaseProfile,
                ) -> tuple[int | None, str, str | None, str]:
    """POST the row's body; return ``(status, text, location, url)``: the last answer's
    status (None when no answer came), its text (or the connection error), its Location
    (for a 3xx) and the URL that answered. Redirects are never followed by aiohttp; a
    307/308 is followed here, same method, body and headers, only when the profile opts in
    (FORWARD_FOLLOW_REDIRECTS) and at most MAX_REDIRECTS times."""
    import aiohttp
    from yarl import URL

    headers = {"Content-Type": "application/json",
               "Idempotency-Key": row["idempotency_key"],
               "X-Execution-Fence": str(row["fencing_token"])}
    body = row["body_text"].encode()
    url = row["url"]
    for _hop in range(MAX_REDIRECTS + 1):
        status: int | None = None
        location: str | None = None
        try:
            async with session.post(url, data=body, headers=headers,
                                    allow_redirects=False) as response:
                status = response.status
                location = response.headers.get("Location")
                text = (await response.text(errors="replace"))[:500]
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:500], None, url
        if not (profile.forward_follow_redirects and status in (307, 308) and location
                and _hop < MAX_REDIRECTS):
            break
        try:
            target = URL(url).join(URL(location))
        except ValueError:
            break
        if target.scheme not in ("http", "https"):
            break
        url = str(target)
    return status, text, location, url


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
