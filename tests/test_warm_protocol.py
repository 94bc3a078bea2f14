"""The warm protocol's pure parts (sidecar/protocol/warm.py) and the PROCESS profile
fields: the request line each job sends, the answer that must name its job, a job's
share of its process's cgroup figures."""

from __future__ import annotations

import datetime as dt
import uuid

import orjson
import pytest

from sidecar.protocol.errors import ConfigError
from sidecar.protocol.model import ClaimedJob, Usage
from sidecar.protocol.warm import Answer, BadAnswer, read_answer, request_line, usage_since
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


JOB = "01a24159-1331-74f3-87f6-0d67722353aa"


@pytest.mark.parametrize(("value", "expected"), [
    ({"job_id": JOB, "result": {"a": 1}}, Answer({"a": 1})),
    ({"job_id": JOB, "result": None}, Answer(None)),
    ({"job_id": JOB, "result": 1, "next": {"tool": "t", "payload": {}}},
     Answer({"result": 1, "next": {"tool": "t", "payload": {}}}, staged=True)),
    ({"job_id": JOB, "error": {"message": "404", "exit_code": 65}}, Answer(error=("404", 65))),
    ({"job_id": JOB, "error": {"message": "no code"}}, Answer(error=("no code", 1))),
    ({"job_id": JOB, "error": "just text"}, Answer(error=("just text", 1))),
    ({"job_id": JOB, "error": {"message": "m", "exit_code": 0}}, Answer(error=("m", 1))),
    ({"job_id": JOB, "error": {"message": "m", "exit_code": 256}}, Answer(error=("m", 1))),
    ({"job_id": JOB, "error": {"message": "m", "exit_code": True}}, Answer(error=("m", 1))),
    ({"job_id": JOB, "error": {"message": ["x"]}}, Answer(error=('["x"]', 1))),
    ({"job_id": JOB, "error": None}, Answer(error=("the tool reported an error", 1))),
])
def test_an_answer_names_its_job_and_carries_a_result_or_an_error(value, expected):
    assert read_answer(value, JOB) == expected


@pytest.mark.parametrize(("value", "out_of_step"), [
    ({"result": 1}, True),                                    # names no job
    ({"job_id": "another", "result": 1}, True),               # a late line of another job
    ({"job_id": JOB.upper(), "result": 1}, True),
    ([{"job_id": JOB, "result": 1}], True),                   # not an object
    ("text", True),
    ({"job_id": JOB}, False),                                 # neither
    ({"job_id": JOB, "result": 1, "error": "e"}, False),      # both
    ({"job_id": JOB, "error": "e", "next": {}}, False),
    ({"job_id": JOB, "result": 1, "extra": 2}, False),
])
def test_a_line_that_is_no_answer_fails_its_job_and_one_out_of_step_its_process(
        value, out_of_step):
    with pytest.raises(BadAnswer) as info:
        read_answer(value, JOB)
    assert info.value.out_of_step is out_of_step
    assert "\n" not in info.value.message


def test_an_error_message_is_cut():
    answer = read_answer({"job_id": JOB, "error": {"message": "x" * 5000}}, JOB)
    assert len(answer.error[0]) == 2000


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
