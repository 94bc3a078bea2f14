"""The guard: a tool asks, just before an irreversible step, whether it may still act (P14,
P15), and saves its progress with the job (checkpoints).

One small HTTP server per sidecar (sidecar.ops.httpserver), on the loopback interface only
(``127.0.0.1``, port chosen by the OS). Every running job gets its own secret; the child
finds the server in ``SIDECAR_GUARD_URL`` (``http://127.0.0.1:PORT``) and the secret in
``SIDECAR_GUARD_TOKEN``, and sends ``Authorization: Bearer <secret>``. The secret names the
job: there is no job id in the URL.

The same server also answers on a Unix socket of each attempt's own (issue 41), made in
the attempt's work directory by sidecar.worker.isolation.Sandbox (``guard.sock``, mode
0600, the tool's user's) and named by ``SIDECAR_GUARD_SOCKET``: a tool in an empty network
namespace (``NETWORK=none``) reaches the guard there, as every tool may. A socket serves
its own attempt only: another attempt's secret sent through it gets 401, as does any
secret once the attempt is unregistered (its socket is closed then).

``POST /v1/guard``, optional JSON body ``{"request_id": "..."}`` (1-200 printable
characters: the id of the external request the tool is about to send):

- ``200 {"fencing_token": N, "lease_remaining_seconds": S}`` only while ownership is
  confirmed and at least H + J (the profile's heartbeat period plus jitter allowance)
  remain before the conservative local deadline, and a fenced read of the job's row on
  the database's clock (owner, token, ``running``, ``lease_until > now()``:
  WorkerStore.confirm_lease_if_owner) sent for this request, or at most
  CONFIRM_REUSE_SECONDS (250 ms) before it arrived, says the attempt still holds the lease
  with at least H + J left (issue 41: local clocks alone never vouch for a go; frozen and
  stepped back, they kept answering go for a lease another sidecar had taken). S is the
  seconds left before the earlier of the local deadline (CLOCK_BOOTTIME, case F20) and
  the lease's end by that read (rounded to ms). The request id is then kept on the
  lease (``Lease.request_id``) for the ownership-unknown event (P15).
- ``409 {"reason": R}`` otherwise, R one of (checked in this order):
  ``cancelled`` (an operator cancelled the job), ``ownership_unknown`` (given up locally at
  the local deadline), ``lease_lost`` (any other loss, or a checkpoint write that found the
  job no longer ours), ``deadline`` (the supervisor is stopping the tool: stage deadline,
  lifetime cap, idle tree or shutdown), ``lease_lost`` (the outcome is being written),
  ``ownership_unknown`` (the database does not answer the heartbeat), ``lease_ending``
  (less than H + J left; transient: the next heartbeat renews the lease); then, from the
  fenced read: ``lease_lost`` (the row says the attempt no longer holds the lease: every
  later call answers it too), ``ownership_unknown`` (the read failed or did not answer
  within CONFIRM_SECONDS, at most the store's timeout: no answer is a no),
  ``lease_ending`` (less than H + J left by the database's clock).
- ``400 {"error": "bad_json" | "bad_request", "message"}`` for a body that is not JSON, not
  an object, or has a bad ``request_id``; ``413 {"error": "body_too_large", "limit": 4096}``.

``POST /v1/checkpoint``, body: one JSON value of at most 65536 bytes (the tool's progress):

- ``200 {"saved": true, "bytes": n}``: stored in ``tool_jobs.checkpoint`` by a write
  fenced on this attempt's token, and journaled as ``checkpoint_saved`` with its size and
  sha256 (never its content). Allowed while the tool is being stopped (a SIGTERM handler
  may save its progress) and while ownership is unknown (the write is fenced anyway).
- ``409 {"reason": "lease_lost"}``: the lease is lost locally or the fenced write found
  the job no longer ours (then every later guard call answers ``lease_lost`` too).
- ``413 {"error": "checkpoint_too_large", "limit": 65536}``; ``400 {"error": "bad_json"}``
  for a body that is not one JSON value (or that PostgreSQL's jsonb refuses, e.g.
  ``\\u0000``); ``400 {"error": "secret_in_output", "secrets": [...]}`` for a body that
  holds a secret the sidecar knows (the database URL or password, a guard token: nothing
  is saved, ``secret_in_output`` is logged with its sha256 and size); ``503 {"error":
  "database_unavailable"}`` when the database fails or does not answer within the store's
  timeout (nothing was saved unless a retry says so).

``POST /v1/progress``, body ``{"progress": 0..1 or null, "message": "..." or null}`` (at
most 4096 bytes, a message of at most 1000 printable characters; sidecar.worker.progress): the
tool's progress, stored on the job row by a write fenced on this attempt's token, sent to
the job's waiters, and counted as activity by the idle watchdog:

- ``200 {"stored": true}``; ``202 {"stored": false, "write_in_s": S}`` when the attempt's
  last write was less than a second ago: kept, and written (the latest report wins) then.
- ``409 {"reason": "lease_lost" | "cancelled"}``: the attempt no longer owns the job
  (locally known, or the fenced write found it so): nothing stored.
- ``400 {"error": "bad_json" | "bad_request" | "secret_in_output", "message"}``; ``413
  {"error": "body_too_large", "limit": 4096}``; ``503 {"error": "database_unavailable"}``.

``POST /v1/snooze``, body ``{"delay_seconds": S, "reason": "..."}`` (issue 44,
sidecar.protocol.verdict.parse_snooze): ``200 {"snoozed": true, ...}``, kept on the lease;
once the tool exits the job is queued again after S seconds, its attempt not spent
(bounded by MAX_SNOOZES and MAX_LIFETIME_SECONDS). ``400`` naming the field, ``409``
when the attempt no longer owns the job.

``POST /v1/approval``, body ``{"action", "summary", "details"}`` (issue 44,
sidecar.protocol.verdict.parse_approval): the request is written bound to this attempt
(job, attempt, fencing token). APPROVAL_MODE=wait: the call waits for the answer (at most
APPROVAL_WAIT_SECONDS, the lease kept): ``200 {"approved": true, "fencing_token": N}``,
``403 {"approved": false}`` (the job then fails denied), ``409 {"reason":
"approval_expired" | "lease_lost" | "cancelled"}``. APPROVAL_MODE=park: ``202 {"parked":
true, "request_id", "deadline"}`` and the attempt ends parked once the tool exits.
``409 {"error": "approval_pending"}`` for a second open request of the attempt.

All of them: a missing, malformed, unknown or no longer registered secret gets ``401
{"error": "unauthorized"}`` with ``WWW-Authenticate: Bearer`` (the same answer for every
case: the caller learns nothing); a body not complete within ``body_timeout`` seconds
gets ``408 {"error": "body_timeout"}``.

The guard protects itself (issue 25): a tool that opens connections by the thousand must
not take the descriptors another job's setup needs.

- A connection's first request must carry a registered secret within
  ``AUTH_SECONDS`` (3 s) of the accept; one that does not (no request in time, or a 401)
  is closed. At most ``UNAUTHENTICATED_CONNECTIONS`` (32) connections wait for their
  first request at once.
- A secret binds its connection to the attempt: at most ``CONNECTIONS_PER_ATTEMPT`` (16)
  per attempt. One more gets ``429 {"error": "too_many_connections", "limit": 16}``,
  unread, and is closed. An attempt's connections are closed when it ends.
- At most ``CONNECTIONS_PER_ATTEMPT x attempts + UNAUTHENTICATED_CONNECTIONS``
  connections in total (``attempts``: the sidecar's concurrency).
- An idle keep-alive connection is closed after ``IDLE_SECONDS`` (15 s); headers are at
  most 16 KiB (431), bodies at most the limits above (413).
- No connection is accepted into the process's descriptor reserve
  (sidecar.ops.httpserver.DESCRIPTOR_RESERVE, 128 below the soft RLIMIT_NOFILE).

A connection over the total or unauthenticated cap is reset at once, before anything is
read. Each refusal is counted (``sidecar_guard_connections_refused_total{reason}``) and
logged once per episode: ``guard_connections_refused`` at the first refusal for a reason
(and attempt), ``guard_refusals_ended`` with the count once none came for
``EPISODE_GAP_SECONDS``.

Every handler is a few dictionary lookups and at most one fenced statement (the guard's
read is shared by an attempt's requests within CONFIRM_REUSE_SECONDS): nothing blocks
the event loop, and each connection is its own task, so a slow or hostile client holds
only its own connection. Checkpoint writes take at most one connection of the store's
pool at a time, and give up (503) rather than wait longer than the store's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

import asyncpg
import orjson

from sidecar.ops import metrics
from sidecar.ops.httpserver import (
    DESCRIPTORS,
    BodyTooLarge,
    ConnectionLimits,
    HttpServer,
    Request,
    Response,
)
from sidecar.protocol import clock, jsontext
from sidecar.protocol.lease_state import Lease, guard_refusal
from sidecar.protocol.masking import SECRETS
from sidecar.protocol.model import LeaseProfile, RawJson
from sidecar.protocol.verdict import (
    APPROVAL_BODY_LIMIT,
    SNOOZE_BODY_LIMIT,
    approval_failure,
    parse_approval,
    parse_snooze,
)
from sidecar.protocol.vocabulary import AttemptId, ConnectionRefusal, GuardRefusal, StopReason
from sidecar.runtime.log import log, log_fields, payload_digest
from sidecar.storage import db
from sidecar.storage.worker_store import WorkerStore
from sidecar.worker.progress import (
    PROGRESS_BODY_LIMIT,
    BadProgress,
    NotOwner,
    ProgressReporter,
    parse_report,
    report_answer,
)

GUARD_PATH = "/v1/guard"
CHECKPOINT_PATH = "/v1/checkpoint"
PROGRESS_PATH = "/v1/progress"
SNOOZE_PATH = "/v1/snooze"
APPROVAL_PATH = "/v1/approval"
# How often a waiting approval request reads its answer (s): a bounded wait of one
# tool, one indexed read each time.
APPROVAL_POLL_SECONDS = 0.5
CHECKPOINT_LIMIT = 65536          # bytes of one checkpoint body
GUARD_BODY_LIMIT = 4096           # bytes of a guard request body
MAX_REQUEST_ID = 200              # characters
MAX_TOKEN_LENGTH = 256            # characters of a bearer token we bother to hash
DEFAULT_BODY_TIMEOUT = 10.0       # seconds to receive a whole request body
UNAUTHORIZED_LOG_PERIOD = 10.0    # seconds between two guard_unauthorized log lines
CONNECTIONS_PER_ATTEMPT = 16      # connections one attempt's secret may hold at once
UNAUTHENTICATED_CONNECTIONS = 32  # connections waiting for their first request, in total
AUTH_SECONDS = 3.0                # from the accept to a first request with a valid secret
IDLE_SECONDS = 15.0               # an idle keep-alive connection is closed after this
EPISODE_GAP_SECONDS = 10.0        # a refusal episode ends after this long without one
CONFIRM_SECONDS = 2.0             # the guard's fenced read answers within this, or it is a no
CONFIRM_REUSE_SECONDS = 0.25      # a go may rest on a fenced read sent this long before


_UNAUTHORIZED_BODY = orjson.dumps({"error": "unauthorized"})


def _json(value: object, status: int = 200) -> Response:
    return Response(status, orjson.dumps(value))


def _unauthorized() -> Response:
    return Response(401, _UNAUTHORIZED_BODY, headers=(("WWW-Authenticate", "Bearer"),))


def _too_many_connections() -> Response:
    return _json({"error": "too_many_connections", "limit": CONNECTIONS_PER_ATTEMPT}, 429)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


@dataclass(eq=False)
class _Registration:
    """One job's secret (as its sha256) and lease."""

    lease: Lease
    digest: bytes
    refused: str | None = None       # the last refusal logged, so a polling tool logs once
    fenced_out: bool = False         # a fenced checkpoint write found the job not ours
    progress: ProgressReporter | None = None  # the attempt's progress (POST /v1/progress)
    # The last fenced read for a go (issue 41): (sent at, CLOCK_BOOTTIME s; seconds the
    # lease had left by the database's clock), and the lock that makes an attempt's
    # requests share one read.
    confirmed: tuple[float, float] | None = None
    confirming: asyncio.Lock = field(default_factory=asyncio.Lock)


class GuardServer:
    """The guard of one sidecar (one tool, one lease profile, one owner).

    ``store``: the sidecar's WorkerStore (checkpoint writes use its pool and timeout).
    ``profile``: the tool's lease profile; H + J = ``heartbeat_seconds + jitter_seconds``
    is the least time (seconds) that must remain before a lease's local deadline for a 200.
    ``owner_id``: this sidecar's owner id, which fences the checkpoint writes.
    ``body_timeout``: seconds a client may take to send a request body (then 408).
    ``attempts``: how many attempts may run at once (the sidecar's concurrency), for the
    total cap on connections.
    """

    def __init__(self, store: WorkerStore, profile: LeaseProfile, owner_id: str, *,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, attempts: int = 1):
        self.store = store
        self.profile = profile
        self.owner_id = owner_id
        self.body_timeout = body_timeout
        self.limits = ConnectionLimits(
            total=CONNECTIONS_PER_ATTEMPT * max(1, attempts) + UNAUTHENTICATED_CONNECTIONS,
            unbound=UNAUTHENTICATED_CONNECTIONS, per_key=CONNECTIONS_PER_ATTEMPT,
            bind_seconds=AUTH_SECONDS)
        self.min_remaining = profile.heartbeat_seconds + profile.jitter_seconds
        # The guard's fenced read is bounded by this (pool acquire included): no answer
        # in time is a no (issue 41).
        self.confirm_timeout = min(store.timeout, CONFIRM_SECONDS)
        self.url: str | None = None
        self._by_digest: dict[bytes, _Registration] = {}
        self._by_attempt: dict[AttemptId, _Registration] = {}
        self._http: HttpServer | None = None
        self._db_slot = asyncio.Semaphore(1)
        self._unauthorized = 0
        self._unauthorized_logged = float("-inf")
        # Refusal episodes by (reason, attempt or None): [first, last, count, timer].
        self._episodes: dict[tuple[str, AttemptId | None], list] = {}

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> str:
        """Listen on 127.0.0.1 on a port chosen by the OS; return the base URL
        (``http://127.0.0.1:PORT``, no trailing slash). Raises RuntimeError when already
        started, OSError when the socket cannot be bound."""
        if self._http is not None:
            raise RuntimeError("the guard server is already started")
        http = HttpServer({("POST", GUARD_PATH): self._guard,
                           ("POST", CHECKPOINT_PATH): self._checkpoint,
                           ("POST", PROGRESS_PATH): self._progress,
                           ("POST", SNOOZE_PATH): self._snooze,
                           ("POST", APPROVAL_PATH): self._approval},
                          keepalive_timeout=IDLE_SECONDS, header_timeout=self.body_timeout,
                          limits=self.limits, on_refuse=self._refused)
        _, port = await http.start("127.0.0.1", 0)
        self._http = http
        self.url = f"http://127.0.0.1:{port}"
        log.emit("guard_started", url=self.url, tool=self.profile.tool)
        return self.url

    async def stop(self) -> None:
        """Close the listener and every connection (in-flight requests get up to 2 s) and
        forget every secret. Safe to call twice, or without start()."""
        http, self._http = self._http, None
        for attempt in list(self._by_attempt):
            self.unregister(attempt)
        for episode in self._episodes.values():
            episode[3].cancel()
        self._episodes.clear()
        if http is not None:
            await http.stop(grace=2.0)

    @property
    def connections(self) -> int:
        """Connections to the guard open now."""
        return self._http.connections if self._http is not None else 0

    # --- jobs ---------------------------------------------------------------

    def register(self, lease: Lease, progress: ProgressReporter | None = None,
                 listener: socket.socket | None = None) -> str:
        """Accept requests for ``lease``'s attempt from now on; return its new secret
        (``secrets.token_urlsafe(32)``: 43 URL-safe characters) for ``SIDECAR_GUARD_TOKEN``.
        ``progress``: where the attempt's ``POST /v1/progress`` reports go (None: 404).
        ``listener``: the attempt's own listening Unix socket (Sandbox.guard_listener),
        served from now on for this attempt alone; the guard owns it (closed by
        unregister, or at once when the guard is not started).
        Only its sha256 is kept. Registrations are keyed by attempt (job id, token), never
        by job id alone (case F14): a later attempt of the same job has its own. May be
        called before start(). The token is a secret of the sidecar's until unregister:
        scrubbed from what leaves the process, refused in a result (``masking.SECRETS``,
        issue 25)."""
        self.unregister(lease.job.attempt_id)
        token = secrets.token_urlsafe(32)
        registration = _Registration(lease, _digest(token), progress=progress)
        self._by_digest[registration.digest] = registration
        self._by_attempt[lease.job.attempt_id] = registration
        SECRETS.add(self._secret_key(lease.job.attempt_id), "guard_token", [token])
        if listener is not None:
            if self._http is None:
                listener.close()
            else:
                self._http.add_listener(listener, lease.job.attempt_id)
        return token

    def has_socket(self, attempt: AttemptId) -> bool:
        """Whether ``attempt``'s own Unix socket (register's ``listener``) is served."""
        return self._http is not None and self._http.listening(attempt)

    def _secret_key(self, attempt: AttemptId) -> tuple[str, int, AttemptId]:
        """The attempt's key in masking.SECRETS (this guard's own: two in one process
        never drop each other's)."""
        return ("guard_token", id(self), attempt)

    def unregister(self, attempt: AttemptId) -> None:
        """Forget the attempt's secret: its requests get 401 from now on. Another attempt
        of the same job keeps its own. Unknown attempts are ignored."""
        registration = self._by_attempt.pop(attempt, None)
        if registration is not None:
            self._by_digest.pop(registration.digest, None)
            SECRETS.discard(self._secret_key(attempt))
        if self._http is not None:
            self._http.remove_listener(attempt)
            self._http.close_bound(attempt)

    # --- refused connections ------------------------------------------------

    def _refused(self, reason: str, attempt: AttemptId | None) -> None:
        """The server refused a connection (or paused accepting): count it; log the
        first of an episode, and its end with the count (``_episode_check``)."""
        metrics.GUARD_CONNECTIONS_REFUSED.labels(self.profile.tool, self.profile.provider,
                                                 reason).inc()
        now = time.monotonic()
        key = (reason, attempt)
        episode = self._episodes.get(key)
        if episode is not None:
            episode[1] = now
            episode[2] += 1
            return
        timer = asyncio.get_running_loop().call_later(EPISODE_GAP_SECONDS,
                                                      self._episode_check, key)
        self._episodes[key] = [now, now, 1, timer]
        registration = self._by_attempt.get(attempt) if attempt is not None else None
        fields = log_fields(registration.lease.job) if registration is not None \
            else {"tool": self.profile.tool}
        limit = {ConnectionRefusal.ATTEMPT_CAP: self.limits.per_key,
                 ConnectionRefusal.TOTAL_CAP: self.limits.total,
                 ConnectionRefusal.UNAUTHENTICATED_CAP: self.limits.unbound}.get(reason)
        log.emit("guard_connections_refused", "warning", **fields, reason=reason,
                 limit=limit, connections=self.connections,
                 open_files=DESCRIPTORS.open_estimate(), open_files_limit=DESCRIPTORS.limit,
                 reserve=DESCRIPTORS.reserve)

    def _episode_check(self, key: tuple[str, AttemptId | None]) -> None:
        episode = self._episodes.get(key)
        if episode is None:
            return
        first, last, count, _ = episode
        quiet = time.monotonic() - last
        if quiet < EPISODE_GAP_SECONDS:
            episode[3] = asyncio.get_running_loop().call_later(
                EPISODE_GAP_SECONDS - quiet, self._episode_check, key)
            return
        del self._episodes[key]
        reason, attempt = key
        log.emit("guard_refusals_ended", tool=self.profile.tool, reason=reason,
                 job_id=str(attempt.job_id) if attempt is not None else None,
                 fencing_token=attempt.fencing_token if attempt is not None else None,
                 refused=count, duration_s=round(last - first, 3))

    # --- requests -----------------------------------------------------------

    def _authenticate(self, request: Request) -> _Registration | None | Response:
        """The registration the bearer secret names, having bound the connection to its
        attempt; None (and a rate-limited log line) for no valid secret; a 429 answer when
        the attempt has its connections already."""
        values = request.header_values("authorization")
        registration = None
        if len(values) == 1:
            scheme, _, token = values[0].partition(" ")
            token = token.strip()
            if (scheme.lower() == "bearer" and 0 < len(token) <= MAX_TOKEN_LENGTH
                    and token.isascii()):
                digest = _digest(token)
                found = self._by_digest.get(digest)
                if found is not None and request.via is not None \
                        and request.via != found.lease.job.attempt_id:
                    found = None  # an attempt's socket serves that attempt alone
                if found is not None and hmac.compare_digest(found.digest, digest):
                    registration = found
                    if not request.bind(found.lease.job.attempt_id):
                        return _too_many_connections()
        if registration is None:
            self._unauthorized += 1
            now = time.monotonic()
            if now - self._unauthorized_logged >= UNAUTHORIZED_LOG_PERIOD:
                log.emit("guard_unauthorized", "warning", tool=self.profile.tool,
                         path=request.path, requests=self._unauthorized)
                self._unauthorized_logged, self._unauthorized = now, 0
        return registration

    async def _read_body(self, request: Request, limit: int,
                         too_large: dict[str, object]) -> bytes | Response:
        """The whole body (at most ``limit`` bytes) or the error answer to send instead."""
        if request.content_length is not None and request.content_length > limit:
            return _json(too_large, 413)
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await request.read(limit)
        except BodyTooLarge:
            return _json(too_large, 413)
        except TimeoutError:
            return _json({"error": "body_timeout", "message": f"the body did not arrive "
                          f"within {self.body_timeout:g} s"}, 408)
        if len(body) > limit:
            return _json(too_large, 413)
        return body

    def _refusal(self, registration: _Registration) -> str | None:
        """Why the tool may not start an irreversible step now, or None when it may
        (sidecar.protocol.lease_state.guard_refusal over the lease's state)."""
        lease = registration.lease
        return guard_refusal(lease.state, lease.reason, registration.fenced_out,
                             lease.local_deadline - clock.ownership_now(), self.min_remaining)

    async def _guard(self, request: Request) -> Response:
        registration = self._authenticate(request)
        if registration is None:
            return _unauthorized()
        if isinstance(registration, Response):
            return registration
        body = await self._read_body(request, GUARD_BODY_LIMIT,
                                     {"error": "body_too_large", "limit": GUARD_BODY_LIMIT})
        if isinstance(body, Response):
            return body
        request_id = None
        if body.strip():
            try:
                parsed = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                return _json({"error": "bad_json", "message": f"the body is not JSON ({exc})"},
                             400)
            if not isinstance(parsed, dict):
                return _json({"error": "bad_request",
                              "message": 'the body must be a JSON object {"request_id": ...}'},
                             400)
            request_id = parsed.get("request_id")
            if request_id is not None and not (
                    isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID
                    and request_id.isprintable()):
                return _json({"error": "bad_request", "message": f"request_id must be a "
                              f"string of 1-{MAX_REQUEST_ID} printable characters"}, 400)
        lease = registration.lease
        arrived = clock.ownership_now()
        reason = self._refusal(registration)
        db_left = None
        if reason is None:
            reason, db_left = await self._confirm(registration, arrived)
        if reason is None:  # the read took time: the local state may have moved meanwhile
            reason = self._refusal(registration)
        if reason is not None:
            self._log_refusal(registration, reason, request_id)
            return _json({"reason": reason}, 409)
        remaining = min(lease.local_deadline - clock.ownership_now(), db_left)
        if request_id is not None:
            lease.note_request(request_id)
        registration.refused = None
        return _json({"fencing_token": lease.job.fencing_token,
                      "lease_remaining_seconds": round(remaining, 3)})

    async def _confirm(self, registration: _Registration, arrived: float
                       ) -> tuple[GuardRefusal | None, float | None]:
        """The database's word on a go for a request that arrived at ``arrived``
        (CLOCK_BOOTTIME s), issue 41: ``(None, S)`` when a fenced read sent for it (or at
        most CONFIRM_REUSE_SECONDS before it arrived; an attempt's requests share one)
        found the attempt holding its lease with S >= H + J seconds left now by the
        database's clock (the read's answer less the time since it was sent), else
        ``(reason, None)``: ``lease_lost`` (not ours: remembered, as a fenced-out
        checkpoint is), ``ownership_unknown`` (no answer within ``confirm_timeout``, or
        the database failed), ``lease_ending``."""
        job = registration.lease.job
        try:
            async with asyncio.timeout(self.confirm_timeout):
                async with registration.confirming:
                    confirmed = registration.confirmed
                    if confirmed is None or confirmed[0] < arrived - CONFIRM_REUSE_SECONDS:
                        sent = clock.ownership_now()
                        left = await self.store.confirm_lease_if_owner(
                            job, self.owner_id, self.confirm_timeout)
                        if left is None:
                            registration.fenced_out = True
                            registration.confirmed = None
                            return GuardRefusal.LEASE_LOST, None
                        confirmed = registration.confirmed = (sent, left)
        except (TimeoutError, *db.DATABASE_ERRORS) as exc:
            if registration.refused != GuardRefusal.OWNERSHIP_UNKNOWN:  # once an episode
                log.emit("guard_unconfirmed", "warning", **log_fields(job),
                         reason=db.describe_error(exc), timeout_s=self.confirm_timeout)
            return GuardRefusal.OWNERSHIP_UNKNOWN, None
        if registration.fenced_out:  # another request's read found it not ours
            return GuardRefusal.LEASE_LOST, None
        left = confirmed[1] - (clock.ownership_now() - confirmed[0])
        if left < self.min_remaining:
            return GuardRefusal.LEASE_ENDING, None
        return None, left

    def _log_refusal(self, registration: _Registration, reason: str,
                     request_id: str | None) -> None:
        """One line per change of reason (a tool polling the guard does not flood the log);
        with the fields P15 asks for when ownership is unknown."""
        if registration.refused == reason:
            return
        registration.refused = reason
        lease, job = registration.lease, registration.lease.job
        unknown_for = (round(clock.ownership_now() - lease.unknown_since, 3)
                       if lease.unknown_since is not None else None)
        log.emit("guard_refused", "warning" if reason == GuardRefusal.OWNERSHIP_UNKNOWN else "info",
                 **log_fields(job),
                 lease_until=lease.lease_until, reason=reason, request_id=request_id,
                 last_request_id=lease.request_id, unknown_for_s=unknown_for,
                 stopping=lease.stopping)

    async def _checkpoint(self, request: Request) -> Response:
        registration = self._authenticate(request)
        if registration is None:
            return _unauthorized()
        if isinstance(registration, Response):
            return registration
        body = await self._read_body(request, CHECKPOINT_LIMIT,
                                     {"error": "checkpoint_too_large", "limit": CHECKPOINT_LIMIT})
        if isinstance(body, Response):
            return body
        try:
            jsontext.loads(body, bounded=True)
        except jsontext.NumberOutOfRange as exc:
            return _json({"error": "bad_json", "message": str(exc)}, 400)
        except ValueError as exc:  # orjson.JSONDecodeError
            return _json({"error": "bad_json",
                          "message": f"a checkpoint must be one JSON value ({exc})"}, 400)
        lease, job = registration.lease, registration.lease.job
        if lease.lost.is_set() or lease.settling or registration.fenced_out:
            return _json({"reason": GuardRefusal.LEASE_LOST}, 409)
        digest = payload_digest(body)
        labels = SECRETS.labels_in(body)
        if labels:  # stored, it would be shown by `sidecar show` (issue 25)
            log.emit("secret_in_output", "error", **log_fields(job), reason="checkpoint",
                     result=digest, secrets=labels)
            return _json({"error": "secret_in_output", "secrets": labels}, 400)
        fields = log_fields(job)
        try:
            async with asyncio.timeout(self.store.timeout):
                await self._db_slot.acquire()
        except TimeoutError:
            log.emit("checkpoint_failed", "warning", **fields, reason="database busy")
            return _json({"error": "database_unavailable"}, 503)
        try:
            saved = await self.store.save_checkpoint_if_owner(
                job, self.owner_id, RawJson(body.decode("utf-8")), digest)
        except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as exc:
            return _json({"error": "bad_json", "message": "PostgreSQL refused the checkpoint "
                          f"as jsonb: {str(exc).splitlines()[0] if str(exc) else exc}"}, 400)
        except db.DATABASE_ERRORS as exc:
            log.emit("checkpoint_failed", "warning", **fields,
                     reason=f"{type(exc).__name__}: {exc}"[:200])
            return _json({"error": "database_unavailable"}, 503)
        finally:
            self._db_slot.release()
        if not saved:
            registration.fenced_out = True
            log.emit("checkpoint_rejected", "warning", **fields, reason="not the owner",
                     bytes=digest["bytes"])
            return _json({"reason": GuardRefusal.LEASE_LOST}, 409)
        if log.enabled("debug"):
            log.emit("checkpoint_saved", "debug", **fields, bytes=digest["bytes"])
        return _json({"saved": True, "bytes": digest["bytes"]})

    async def _snooze(self, request: Request) -> Response:
        """POST /v1/snooze (issue 44, point 3): the tool asks to run again later. Kept on
        the attempt's lease; the attempt then ends as a snooze, whatever the tool does
        next (its output is not committed), when the tool exits."""
        registration = self._authenticate(request)
        if registration is None:
            return _unauthorized()
        if isinstance(registration, Response):
            return registration
        body = await self._read_body(request, SNOOZE_BODY_LIMIT,
                                     {"error": "body_too_large", "limit": SNOOZE_BODY_LIMIT})
        if isinstance(body, Response):
            return body
        try:
            asked = parse_snooze(body)
        except ValueError as exc:
            return _json({"error": "bad_request", "message": str(exc)}, 400)
        lease = registration.lease
        if lease.lost.is_set() or lease.settling or registration.fenced_out:
            cancelled = lease.lost.is_set() and lease.reason is StopReason.CANCELLED
            return _json({"reason": GuardRefusal.CANCELLED if cancelled
                          else GuardRefusal.LEASE_LOST}, 409)
        if asked.reason is not None and SECRETS.labels_in(asked.reason.encode()):
            return _json({"error": "secret_in_output", "message": "the reason holds a "
                          "secret the sidecar knows; say why without it"}, 400)
        lease.ask_snooze(asked.delay_seconds, asked.reason)
        log.emit("snooze_asked", **log_fields(lease.job), delay_s=asked.delay_seconds)
        return _json({"snoozed": True, "delay_seconds": asked.delay_seconds,
                      "max_snoozes": self.profile.max_snoozes,
                      "message": "exit now: the job runs again after the delay, this "
                                 "attempt not spent; its output is not kept"})

    async def _approval(self, request: Request) -> Response:
        """POST /v1/approval (issue 44, point 1): the tool asks a person's yes before an
        irreversible step and waits for it, the lease kept by its heartbeats, at most
        APPROVAL_WAIT_SECONDS. The request is bound to this attempt (job, attempt,
        fencing token): only an answer naming them, while this attempt owns the job, is
        taken. A denial or no answer in time ends the attempt failed (denied,
        approval_expired) whatever the tool does next."""
        registration = self._authenticate(request)
        if registration is None:
            return _unauthorized()
        if isinstance(registration, Response):
            return registration
        body = await self._read_body(request, APPROVAL_BODY_LIMIT,
                                     {"error": "body_too_large", "limit": APPROVAL_BODY_LIMIT})
        if isinstance(body, Response):
            return body
        try:
            asked = parse_approval(body)
        except ValueError as exc:
            return _json({"error": "bad_request", "message": str(exc)}, 400)
        lease, job = registration.lease, registration.lease.job
        if lease.lost.is_set() or lease.settling or registration.fenced_out:
            cancelled = lease.lost.is_set() and lease.reason is StopReason.CANCELLED
            return _json({"reason": GuardRefusal.CANCELLED if cancelled
                          else GuardRefusal.LEASE_LOST}, 409)
        labels = SECRETS.labels_in(body)
        if labels:  # stored, it would be shown to whoever answers
            return _json({"error": "secret_in_output", "secrets": labels}, 400)
        fields = log_fields(job)
        park = self.profile.approval_mode == "park"
        wait = self.profile.approval_park_seconds if park else self.profile.approval_wait_seconds
        try:
            row = await self.store.ask_approval(job, self.owner_id, uuid.uuid4(), asked.action,
                                                asked.summary, dict(asked.details), wait)
        except asyncpg.UniqueViolationError:
            return _json({"error": "approval_pending",
                          "message": "this attempt's earlier request is still open"}, 409)
        except db.DATABASE_ERRORS as exc:
            log.emit("approval_failed", "warning", **fields,
                     reason=f"{type(exc).__name__}: {exc}"[:200])
            return _json({"error": "database_unavailable"}, 503)
        if row is None:
            registration.fenced_out = True
            return _json({"reason": GuardRefusal.LEASE_LOST}, 409)
        log.emit("approval_requested", **fields, request_id=str(row["id"]),
                 action=asked.action, wait_s=wait, mode=self.profile.approval_mode)
        if registration.progress is not None:
            # Its waiters hear it (a NOTIFY), and the MCP gateway asks its client.
            with contextlib.suppress(NotOwner, *db.DATABASE_ERRORS):
                await registration.progress.report(
                    None, f"waiting for a person's yes before {asked.action}: "
                          f"{asked.summary}", "http")
        if park:
            lease.park_for(str(row["id"]), asked.action)
            return _json({"parked": True, "request_id": str(row["id"]),
                          "deadline": row["deadline"].isoformat(),
                          "message": "save your checkpoint and exit: the job waits for the "
                                     "answer, and its next attempt finds it in "
                                     "SIDECAR_APPROVAL"}, 202)
        labels_of = (self.profile.tool, self.profile.provider)
        metrics.APPROVALS_WAITING.labels(*labels_of).inc()
        try:
            return await self._await_answer(registration, row, asked.action, wait, labels_of)
        finally:
            metrics.APPROVALS_WAITING.labels(*labels_of).dec()

    async def _await_answer(self, registration, row, action: str, wait: float,
                            labels_of: tuple[str, str]) -> Response:
        """Read the request's answer every APPROVAL_POLL_SECONDS until it comes, the
        wait ends (then it expires) or the lease does."""
        lease, fields = registration.lease, log_fields(registration.lease.job)
        request_id = row["id"]
        ends = time.monotonic() + wait
        while True:
            if lease.lost.is_set() or lease.settling or lease.stopping is not None \
                    or registration.fenced_out \
                    or self._by_attempt.get(lease.job.attempt_id) is not registration:
                # lost, ending (stopped, its outcome being written) or unregistered: the
                # attempt that asked waits no more
                cancelled = lease.lost.is_set() and lease.reason is StopReason.CANCELLED
                return _json({"reason": GuardRefusal.CANCELLED if cancelled
                              else GuardRefusal.LEASE_LOST}, 409)
            try:
                answer = await self.store.approval_state(request_id)
                if answer is not None and answer["state"] == "pending" \
                        and time.monotonic() >= ends:
                    if await self.store.expire_approval(request_id):
                        metrics.APPROVAL_ANSWER_SECONDS.labels(*labels_of, "expired").observe(
                            wait)
                        lease.refuse_step(approval_failure("expired", action))
                        log.emit("approval_expired", "warning", **fields,
                                 request_id=str(request_id))
                        return _json({"reason": "approval_expired",
                                      "message": "nobody answered in time: exit now; the "
                                                 "job fails approval_expired"}, 409)
                    continue  # answered just now: read it
            except db.DATABASE_ERRORS:
                answer = None  # asked again at the next read; the wait stays bounded
            if answer is not None and answer["state"] == "expired":
                # expired by a newer attempt's request, or by the sweep: final
                lease.refuse_step(approval_failure("expired", action))
                return _json({"reason": "approval_expired",
                              "message": "the request expired: exit now"}, 409)
            if answer is not None and answer["state"] in ("approved", "denied"):
                outcome = answer["state"]
                metrics.APPROVAL_ANSWER_SECONDS.labels(*labels_of, outcome).observe(
                    answer["waited_s"] or 0.0)
                said = {"by": answer["answered_by"], "reason": answer["reason"]}
                if outcome == "denied":
                    lease.refuse_step(approval_failure("denied", action, **said))
                    return _json({"approved": False, **said,
                                  "message": "denied: do not take the step; exit now, the "
                                             "job fails denied"}, 403)
                return _json({"approved": True, "fencing_token": lease.job.fencing_token,
                              **said})
            if answer is None and time.monotonic() >= ends + self.store.timeout:
                return _json({"error": "database_unavailable"}, 503)
            await asyncio.sleep(APPROVAL_POLL_SECONDS)

    async def _progress(self, request: Request) -> Response:
        registration = self._authenticate(request)
        if registration is None:
            return _unauthorized()
        if isinstance(registration, Response):
            return registration
        body = await self._read_body(request, PROGRESS_BODY_LIMIT,
                                     {"error": "body_too_large", "limit": PROGRESS_BODY_LIMIT})
        if isinstance(body, Response):
            return body
        try:
            value, message = parse_report(body)
        except BadProgress as exc:
            return _json({"error": exc.error, "message": str(exc)}, 400)
        reporter, lease = registration.progress, registration.lease
        if reporter is None:
            return _json({"error": "not_found", "message": "no progress for this attempt"},
                         404)
        labels = SECRETS.labels_in(body)
        if labels:  # stored, it would be shown by `sidecar show` (issue 25)
            log.emit("secret_in_output", "error", **log_fields(lease.job), reason="progress",
                     result=payload_digest(body), secrets=labels)
            return _json({"error": "secret_in_output", "secrets": labels}, 400)
        if registration.fenced_out or reporter.lost:
            cancelled = lease.lost.is_set() and lease.reason is StopReason.CANCELLED
            return _json({"reason": GuardRefusal.CANCELLED if cancelled
                          else GuardRefusal.LEASE_LOST}, 409)
        try:
            waited = await reporter.report(value, message, "http")
        except NotOwner:
            registration.fenced_out = reporter.fenced_out or registration.fenced_out
            return _json({"reason": GuardRefusal.LEASE_LOST}, 409)
        except db.DATABASE_ERRORS as exc:
            log.emit("progress_failed", "warning", **log_fields(lease.job),
                     reason=f"{type(exc).__name__}: {exc}"[:200])
            return _json({"error": "database_unavailable"}, 503)
        status, answer = report_answer(waited)
        return _json(answer, status)
