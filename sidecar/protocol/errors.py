"""One root error; each subclass carries the one line a user sees and its exit code.

Internal errors (a spawn that failed, a bad tool result, ownership unknown at commit, a
cgroup that could not be made) derive from it too, so nothing the sidecar raises on
purpose reaches a user as a traceback."""


class SidecarError(Exception):
    """Base of every error the CLI turns into one line on stderr (no traceback).

    ``exit_code`` is what the process exits with: 2 for bad input or configuration,
    1 for an environment problem such as an unreachable database.
    """

    exit_code = 1

    def __init__(self, message: str):
        message = one_line(message)
        super().__init__(message)
        self.message = message


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters shown as escapes (``\\n``),
    so a name or path from the user cannot split or forge an error line."""
    if text.isprintable():  # the usual message: one C scan, no per-character join
        return text
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape")
                   .decode("ascii") for ch in text)


class ConfigError(SidecarError):
    """An environment variable or profile is invalid; the message names it and the fix."""

    exit_code = 2


class UsageError(SidecarError):
    """A command-line argument is invalid (bad JSON, unreadable file, unknown job id)."""

    exit_code = 2


class DatabaseUnavailable(SidecarError):
    """The database cannot be reached or refused us; the message names the host, password masked."""

    exit_code = 1


class IdempotencyConflict(SidecarError):
    """An idempotency key is reused for a different tool or payload."""

    exit_code = 2


class OwnershipUnknown(SidecarError):
    """A fenced write got no answer before the lease's local deadline (P14b): whether the
    job is still ours cannot be known until the database answers again."""

    def __init__(self, message: str = "ownership unknown: the database did not answer a "
                                      "fenced write before the lease's local deadline"):
        super().__init__(message)


class NextStageConflict(SidecarError):
    """The next stage's derived key (``{parent key}:stage:{n}``, P19) is held by a job that
    is not this parent's own stage (case F22): the completion wrote nothing. ``key`` is the
    key, ``holder_id`` the job holding it (None when it vanished before it could be read)."""

    def __init__(self, key: str, holder_id: object | None):
        super().__init__(f"the next stage's idempotency key {key!r} is already held by job "
                         f"{holder_id or '(gone)'}, which is not a stage of this job; "
                         "nothing was committed")
        self.key = key
        self.holder_id = holder_id


class SchemaMismatch(SidecarError):
    """The database's schema is not one this sidecar may work on: older than its newest
    migration (or missing: version 0), or newer without declaring compatibility with it
    (``-- compatible-from:``, docs/operations.md). Only ``sidecar migrate`` and
    ``sidecar run`` change the schema; every other entry point refuses with this one line.
    ``version``: the database's (0: no schema); ``expected``: this sidecar's."""

    exit_code = 1

    def __init__(self, version: int, expected: int):
        if version < expected:
            where = ("the database has no sidecar schema" if version == 0
                     else f"the database schema is at version {version}")
            fix = "run 'sidecar migrate' first"
        else:
            where = (f"the database schema is at version {version}, which declares no "
                     "compatibility with it")
            fix = "upgrade this sidecar to the release that migrated it"
        super().__init__(f"{where}, this sidecar needs {expected}: {fix}")
        self.version = version
        self.expected = expected
