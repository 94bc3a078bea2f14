"""The warm protocol's lines (issue 43; docs/child-process.md, "Warm mode").

A warm tool process serves consecutive jobs of one slot. For each job the sidecar writes
one **request line** to the tool's stdin, a JSON object ending in a newline::

    {"job_id": "...", "tool": "...", "attempt": 1, "fencing_token": 7,
     "idempotency_key": "tool-job:...", "payload": {...}, "checkpoint": null,
     "guard": {"token": "...", "socket": "...", "url": "..."}}

and the tool answers with one **response line** on its stdout, a JSON object that names
the job it answers (so no line is ever taken for another job's answer) and carries
either its result, any JSON value, exactly what a per-job tool prints (the same size cap,
checks and ``next`` stages), or an error::

    {"job_id": "...", "result": {...}}
    {"job_id": "...", "result": {...}, "next": {"tool": "...", "payload": {...}}}
    {"job_id": "...", "error": {"message": "page returned 404", "exit_code": 65}}

An error fails the job as a per-job tool exiting with ``exit_code`` would (1 when absent;
NON_RETRYABLE_EXIT_CODES applies) while the process serves the next job.

Pure: bytes and values only, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar.protocol.model import ClaimedJob, Usage

_MESSAGE_CHARS = 2000
_DEFAULT_EXIT_CODE = 1
_ANSWER_KEYS = frozenset({"job_id", "result", "next", "error"})


class BadAnswer(ValueError):
    """A response line that is no answer to the request (``message`` says why);
    ``out_of_step``: it names another job or none, so the process's lines can no longer
    be matched to requests and it must not serve another job."""

    def __init__(self, message: str, out_of_step: bool = False):
        super().__init__(message)
        self.message = message
        self.out_of_step = out_of_step


@dataclass(frozen=True)
class Answer:
    """A warm process's answer to one job: ``error`` (message, exit code) or the result
    as the object a per-job tool would print (``output``: ``{"result": R, "next": N}``
    when the answer names a next stage, else R itself)."""

    output: Any = None
    staged: bool = False
    error: tuple[str, int] | None = None


def request_line(job: ClaimedJob, guard: Mapping[str, str] | None = None,
                 trace: Mapping[str, str] | None = None) -> bytes:
    """The request line of ``job`` (UTF-8, one ``\\n`` at its end and none inside): its
    identity, the fencing token and idempotency key for its side effects, its payload
    and last checkpoint as the JSON they were stored as, ``guard`` (token, and the
    attempt's socket and URL where it has them), ``trace`` (TRACEPARENT,
    TRACESTATE), ``session`` (the agent session's key, issue 43) when the job has
    one, and ``approval`` (the answer to the request that parked it, issue 44) when it
    was parked. A newline or carriage return in stored JSON text can only be
    whitespace between tokens (JSON escapes them inside strings), so it becomes a
    space."""
    head = {
        "job_id": str(job.id), "tool": job.tool, "attempt": job.attempt,
        "fencing_token": job.fencing_token, "idempotency_key": f"tool-job:{job.id}",
    }
    if job.session_key is not None:
        head["session"] = job.session_key
    if guard:
        head["guard"] = dict(guard)
    if trace:
        head["trace"] = dict(trace)
    text = orjson.dumps(head)[:-1]  # without its closing brace: the raw JSON follows
    payload = _one_line(job.payload_text)
    checkpoint = _one_line(job.checkpoint_text) if job.checkpoint_text is not None \
        else b"null"
    approval = b',"approval":' + _one_line(job.approval_text) \
        if job.approval_text is not None else b""
    return (text + b',"payload":' + payload + b',"checkpoint":' + checkpoint + approval
            + b"}\n")


def _one_line(text: str) -> bytes:
    data = text.encode()
    if b"\n" in data or b"\r" in data:
        data = data.replace(b"\r", b" ").replace(b"\n", b" ")
    return data


def read_answer(value: Any, job_id: str) -> Answer:
    """The answer in the parsed response line ``value`` to the request of job
    ``job_id``. Raises BadAnswer: out of step for a value that is no object or names no
    job or another one; in step for one with unknown keys, with neither or both of
    ``result`` and ``error``, or with ``next`` beside an error. An error's message is cut
    to 2000 characters; an exit code that is not an integer from 1 to 255 is 1."""
    if not isinstance(value, Mapping) or value.get("job_id") != job_id:
        named = value.get("job_id") if isinstance(value, Mapping) else None
        raise BadAnswer(
            "the response line names no job" if named is None else
            f"the response line answers job {str(named)[:80]!r}, not this one", True)
    unknown = set(value) - _ANSWER_KEYS
    if unknown:
        raise BadAnswer(f"the response line has keys a response does not: "
                        f"{', '.join(sorted(map(str, unknown)))[:200]}")
    if ("result" in value) == ("error" in value):
        raise BadAnswer("the response line needs either result or error")
    if "error" in value:
        if "next" in value:
            raise BadAnswer("the response line names a next stage beside an error")
        return Answer(error=_error(value["error"]))
    if "next" in value:
        return Answer({"result": value["result"], "next": value["next"]}, staged=True)
    return Answer(value["result"])


def _error(body: Any) -> tuple[str, int]:
    if isinstance(body, Mapping):
        message, code = body.get("message"), body.get("exit_code")
    else:
        message, code = body, None
    if not isinstance(message, str):
        message = "the tool reported an error" if message is None \
            else orjson.dumps(message, default=str).decode()
    if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 255:
        code = _DEFAULT_EXIT_CODE
    return message[:_MESSAGE_CHARS], code


def usage_since(now: Usage, before: Usage) -> Usage:
    """What one job of a warm process used: the cgroup's figures ``now`` less those at
    the job's start (``before``): CPU time, OOM kills and refused forks. Peak memory is
    the process's, not the job's: None. A figure the start did not have is None (CPU) or
    0 (counts): never the process's whole life taken for one job."""
    cpu = None if now.cpu_seconds is None or before.cpu_seconds is None \
        else max(0.0, now.cpu_seconds - before.cpu_seconds)
    return Usage(peak_memory_bytes=None, cpu_seconds=cpu,
                 oom_kills=max(0, now.oom_kills - before.oom_kills),
                 process_limit_hits=max(0, now.process_limit_hits - before.process_limit_hits))
