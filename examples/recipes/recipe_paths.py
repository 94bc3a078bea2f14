"""Payload checks the LibreOffice recipes share (libreoffice_convert.py, per job, and
libreoffice_warm.py, warm): the fields' types, and paths confined under a root directory
the tool's profile passes through. Not a recipe itself: a recipe imports it from its own
directory. Nothing here exits or prints; the recipe decides how to refuse (a per-job
recipe exits 65 or 78, a warm one answers the job with an error and keeps serving).
"""
import json
import os


class BadPayload(ValueError):
    """Bad input, not worth a retry; ``str()`` is one line saying why (no path of a file
    outside the root is read, and no content of one is quoted)."""


class NotConfigured(RuntimeError):
    """The recipe's root variable is unset or relative; ``str()`` is one line naming it.
    Every payload would be refused: exit 78 (EX_CONFIG)."""


def check_fields(payload, fields: dict) -> dict:
    """``payload`` (any decoded JSON value), checked to be an object whose fields
    (name -> (type, required)) are non-empty values of that type (bool is never an int);
    returns it unchanged. Raises BadPayload."""
    if not isinstance(payload, dict):
        raise BadPayload(f"a JSON object is needed, not {type(payload).__name__}")
    for name, (kind, required) in fields.items():
        if name not in payload:
            if required:
                raise BadPayload(f"{name!r} is missing")
            continue
        value = payload[name]
        if not isinstance(value, kind) or isinstance(value, bool) or value in ("", None):
            raise BadPayload(f"{name!r} must be a non-empty {kind.__name__}, "
                             f"not {json.dumps(value)[:40]}")
    return payload


def root(variable: str) -> str:
    """The directory the environment variable ``variable`` names, symlinks resolved.
    Raises NotConfigured when it is unset or not absolute."""
    value = os.environ.get(variable, "")
    if not os.path.isabs(value):
        raise NotConfigured(f"{variable} must name the directory payload paths are confined "
                            f"to (examples/recipes/*.env), not {value!r}")
    return os.path.realpath(value)


def under_root(value: str, name: str, variable: str) -> str:
    """``value`` (the payload's field ``name``) with every symlink resolved, if that is
    under the directory the environment variable ``variable`` names (the tool's profile
    passes it through): a payload chooses files there, never elsewhere (a mounted Secret,
    /proc, ...). The real path is what the binary gets, so a link swapped later points
    nowhere new for components already resolved. Raises NotConfigured (root unset or
    relative) or BadPayload (relative path, NUL byte, outside the root)."""
    base = root(variable)
    if "\0" in value or not os.path.isabs(value):
        raise BadPayload(f"{name!r} must be an absolute path, not {json.dumps(value)[:80]}")
    real = os.path.realpath(value)
    if os.path.commonpath([real, base]) != base:
        raise BadPayload(f"{name!r} must be under {variable} ({base}), "
                         f"not {json.dumps(value)[:80]}")
    return real


def check_extension(fmt: str) -> str:
    """``fmt``, if it is a file extension (ASCII letters and digits, at most 10); raises
    BadPayload otherwise (a path, an option, a filter name)."""
    if not (fmt.isascii() and fmt.isalnum() and len(fmt) <= 10):
        raise BadPayload("'format' must be a file extension such as pdf or odt, not "
                         f"{json.dumps(fmt)[:40]}")
    return fmt
