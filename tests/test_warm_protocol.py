"""The warm protocol's pure parts (sidecar/protocol/warm.py) and the PROCESS profile
fields: the request line each job sends, the ``sidecar_error`` answer, a job's share of
its process's cgroup figures."""

from __future__ import annotations

import datetime as dt
import uuid

import orjson
import pytest

from sidecar.protocol.errors import ConfigError
from sidecar.protocol.model import ClaimedJob, Usage
from sidecar.protocol.warm import request_line, tool_error, usage_since
from sidecar.runtime.config import load_settings

pytestmark = pytest.mark.unit


def _job(payload: str = '{"a": 1}', checkpoint: str | None = None) -> ClaimedJob:
    return ClaimedJob(id=uuid.UUID(int=7), tool="ocr", payload_text=payload, fencing_token=4,
                      attempt=2, max_attempts=3, lease_until=dt.datetime.now(dt.UTC),
                      lease_remaining=90.0, idempotency_key="k", reclaimed=False,
                      checkpoint_text=checkpoint)


def test_the_request_line_carries_the_jobs_identity_payload_and_checkpoint():
    line = request_line(_job(checkpoint='{"page": 3}'),
                        guard={"token": "t" * 43, "socket": "/w/guard-1.sock"},
                        trace={"TRACEPARENT": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    request = orjson.loads(line)
    assert request == {
        "job_id": str(uuid.UUID(int=7)), "tool": "ocr", "attempt": 2, "fencing_token": 4,
        "idempotency_key": f"tool-job:{uuid.UUID(int=7)}",
        "guard": {"token": "t" * 43, "socket": "/w/guard-1.sock"},
        "trace": {"TRACEPARENT": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        "payload": {"a": 1}, "checkpoint": {"page": 3}}
    assert orjson.loads(request_line(_job()))["checkpoint"] is None
    assert "guard" not in orjson.loads(request_line(_job()))


def test_the_payload_travels_as_stored_every_digit_kept_on_one_line():
    """The stored JSON text goes into the line as it is (a number no float holds keeps
    every digit); its whitespace newlines, the only raw ones valid JSON can hold, become
    spaces, so one request is one line."""
    stored = '{"n": 123456789012345678901234567890.000000000000000000001,\n "s": "a\\nb"}'
    line = request_line(_job(stored, checkpoint='[1,\r\n2]'))
    assert line.count(b"\n") == 1
    assert b'"payload":{"n": 123456789012345678901234567890.000000000000000000001,  "s": ' \
           b'"a\\nb"}' in line
    assert orjson.loads(line)["checkpoint"] == [1, 2]


@pytest.mark.parametrize(("value", "expected"), [
    ({"sidecar_error": {"message": "404", "exit_code": 65}}, ("404", 65)),
    ({"sidecar_error": {"message": "no code"}}, ("no code", 1)),
    ({"sidecar_error": "just text"}, ("just text", 1)),
    ({"sidecar_error": {"message": "m", "exit_code": 0}}, ("m", 1)),
    ({"sidecar_error": {"message": "m", "exit_code": 256}}, ("m", 1)),
    ({"sidecar_error": {"message": "m", "exit_code": True}}, ("m", 1)),
    ({"sidecar_error": {"message": ["x"]}}, ('["x"]', 1)),
    ({"sidecar_error": None}, ("the tool reported an error", 1)),
    ({"sidecar_error": "x", "other": 1}, None),
    ({"error": "a result that says error"}, None),
    ([{"sidecar_error": "x"}], None),
    ("sidecar_error", None),
])
def test_a_sidecar_error_answer_fails_its_job_anything_else_is_the_result(value, expected):
    assert tool_error(value) == expected


def test_a_sidecar_error_message_is_cut():
    message, _ = tool_error({"sidecar_error": {"message": "x" * 5000}})
    assert len(message) == 2000


def test_a_jobs_usage_is_what_changed_in_its_processs_cgroup_during_it():
    before = Usage(peak_memory_bytes=10, cpu_seconds=5.0, oom_kills=1, process_limit_hits=2)
    now = Usage(peak_memory_bytes=99, cpu_seconds=7.5, oom_kills=1, process_limit_hits=3)
    assert usage_since(now, before) == Usage(None, 2.5, 0, 1)
    assert usage_since(Usage(cpu_seconds=3.0), Usage()) == Usage(None, None, 0, 0)


def test_process_fields_default_to_per_job_and_parse():
    profile = load_settings({}).profile("ocr")
    assert (profile.process, profile.max_jobs_per_process, profile.max_process_seconds,
            profile.warm_idle_seconds) == ("per-job", 1000, 3600.0, 300.0)
    profile = load_settings({"SIDECAR_PROFILE_OCR_PROCESS": "WARM",
                             "SIDECAR_PROFILE_OCR_MAX_JOBS_PER_PROCESS": "0",
                             "SIDECAR_WARM_IDLE_SECONDS": "1.5"}).profile("ocr")
    assert (profile.process, profile.max_jobs_per_process, profile.warm_idle_seconds) == \
        ("warm", 0, 1.5)


@pytest.mark.parametrize(("env", "named"), [
    ({"SIDECAR_PROCESS": "pooled"}, "SIDECAR_PROCESS"),
    ({"SIDECAR_PROFILE_OCR_MAX_JOBS_PER_PROCESS": "-1"},
     "SIDECAR_PROFILE_OCR_MAX_JOBS_PER_PROCESS"),
    ({"SIDECAR_MAX_PROCESS_SECONDS": "-5"}, "SIDECAR_MAX_PROCESS_SECONDS"),
    ({"SIDECAR_WARM_IDLE_SECONDS": "0"}, "SIDECAR_WARM_IDLE_SECONDS"),
])
def test_a_bad_process_setting_is_one_line_naming_its_variable(env, named):
    with pytest.raises(ConfigError) as info:
        load_settings(env).profile("ocr")
    assert named in info.value.message and "\n" not in info.value.message
