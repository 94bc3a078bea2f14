"""Traces of attempts (issue 30): real sidecars export their spans over OTLP/HTTP to a real
receiver (tests/otlp_receiver.py, decoding with the official opentelemetry-proto), with a
real PostgreSQL. One database, one receiver and one traced sidecar serve the module.

Checked: a retry's two attempts are two spans in the enqueue's trace, each the child of the
enqueue's span, the second linked (not nested) to the first; their attributes; the tool's
TRACEPARENT names its attempt's span; a stage-deadline kill names its reason; a job
enqueued without a trace context gets a trace of its own; the spans of a sidecar that
stops are exported at its stop; without the OTEL_* variables (or with the SDK disabled)
nothing of OpenTelemetry is imported and nothing is sent; a request for traces that the
install cannot serve is one line, exit 2.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest
from otlp_receiver import OtlpReceiver

import kit
from sidecar.storage.db import with_database

pytestmark = pytest.mark.e2e

TOOL = "traced"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
TRACEPARENT_RE = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@pytest.fixture(scope="module")
def db(server_dsn):
    """A fresh, migrated database for the module; dropped afterwards."""
    name = f"sidecar_t_{uuid.uuid4().hex[:12]}"
    kit.query(server_dsn, f'CREATE DATABASE "{name}"')
    url = with_database(server_dsn, name)
    done = kit.cli(url, "migrate")
    assert done.returncode == 0, done.stderr.decode()
    yield url
    kit.query(server_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def receiver():
    server = OtlpReceiver()
    server.start()
    yield server
    server.stop()


def traced_env(dsn: str, receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    """A sidecar's environment that asks for traces, sent to ``receiver`` quickly."""
    return kit.base_env(dsn, OTEL_TRACES_EXPORTER="otlp",
                        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                        OTEL_SERVICE_NAME="sidecar-under-test", OTEL_BSP_SCHEDULE_DELAY="100",
                        SIDECAR_STAGE_TIMEOUT_SECONDS="2", **extra)


@pytest.fixture(scope="module")
def sidecar(db, receiver, tmp_path_factory):
    """One traced sidecar of the tool ``traced`` for the module."""
    proc = kit.SidecarProcess(db, ["trace_probe.py"], "--tool", TOOL, "--concurrency", "2",
                              env=traced_env(db, receiver),
                              tmp=tmp_path_factory.mktemp("traced"))
    proc.wait_event("tracing_started")
    yield proc
    proc.stop()


def attempt_spans(receiver: OtlpReceiver, job_id: str, count: int) -> list:
    """The attempt spans of ``job_id``, by attempt, once ``count`` of them arrived."""
    def found():
        spans = [s for s in receiver.spans() if s.attributes.get("sidecar.job.id") == job_id
                 and s.name.startswith("execute_tool ")]
        return sorted(spans, key=lambda s: s.attributes["sidecar.job.fencing_token"]) \
            if len(spans) >= count else None

    return kit.wait_until(found, 20, what=f"{count} attempt spans of {job_id}")


def children(receiver: OtlpReceiver, parent) -> dict[str, object]:
    return {s.name: s for s in receiver.spans() if s.parent_span_id == parent.span_id
            and s.trace_id == parent.trace_id}


def wait_state(dsn: str, job_id: str, state: str) -> dict:
    kit.wait_until(lambda: kit.job_row(dsn, job_id)["state"] == state, 30,
                   what=f"job {job_id} {state}")
    return kit.job_row(dsn, job_id)


def test_a_retry_is_two_attempts_in_the_callers_trace_the_second_linked(db, receiver,
                                                                        sidecar):
    job_id = kit.enqueue(db, TOOL, {"mode": "fail_first"}, "--traceparent", TRACEPARENT,
                         "--tracestate", "vendor=abc", "--max-attempts", "3")
    row = wait_state(db, job_id, "succeeded")
    first, second = attempt_spans(receiver, job_id, 2)

    for attempt, span in ((1, first), (2, second)):
        # In the enqueue's trace, each the child of the enqueue's span: never nested.
        assert (span.trace_id, span.parent_span_id) == (CALLER_TRACE, CALLER_SPAN)
        assert span.kind == "CONSUMER" and span.name == f"execute_tool {TOOL}"
        assert span.attributes["gen_ai.operation.name"] == "execute_tool"
        assert span.attributes["gen_ai.tool.name"] == TOOL
        assert span.attributes["gen_ai.tool.call.id"] == job_id
        assert span.attributes["sidecar.job.attempt"] == attempt
        assert span.attributes["sidecar.job.fencing_token"] == attempt
        assert span.resource["service.name"] == "sidecar-under-test"
        assert span.resource["service.instance.id"].startswith(sidecar_owner(sidecar))
        # The phases of the attempt are its children.
        assert {"claim", "spawn", "run", "commit"} <= set(children(receiver, span))
        assert "kill" not in children(receiver, span)  # the tool exited by itself

    assert first.attributes["sidecar.outcome"] == "requeued"
    assert first.attributes["error.type"] == "exit_code"
    assert first.status == "ERROR" and first.links == []
    assert second.attributes["sidecar.outcome"] == "succeeded"
    assert "error.type" not in second.attributes and second.status == "UNSET"
    # The retry is linked to the attempt before it, in the same trace.
    [(link_trace, link_span, link_attributes)] = second.links
    assert (link_trace, link_span) == (first.trace_id, first.span_id)
    assert link_attributes == {"sidecar.job.fencing_token": 1}
    commit = children(receiver, second)["commit"]
    assert commit.attributes["sidecar.outcome"] == "succeeded"
    assert children(receiver, first)["run"].attributes["sidecar.stop_reason"] == "exited"

    # The tool's own trace context names its attempt's span (the caller's state kept).
    result = row["result"]
    assert result["attempt"] == 2
    assert result["traceparent"] == f"00-{CALLER_TRACE}-{second.span_id}-01"
    assert result["tracestate"] == "vendor=abc"


def sidecar_owner(proc: kit.SidecarProcess) -> str:
    return proc.wait_event("worker_started")["owner_id"]


def test_a_stage_deadline_kill_names_its_reason_in_a_trace_of_the_job(db, receiver,
                                                                       sidecar):
    job_id = kit.enqueue(db, TOOL, {"mode": "hang"}, "--max-attempts", "1")
    row = wait_state(db, job_id, "failed")
    assert row["error"]["kind"] == "stage_timeout"
    [span] = attempt_spans(receiver, job_id, 1)
    # No trace context at enqueue: the job's own trace, its id the job id's 128 bits.
    assert span.trace_id == uuid.UUID(job_id).hex and span.parent_span_id == ""
    assert span.attributes["sidecar.kill.reason"] == "stage_timeout"
    assert span.attributes["sidecar.kill.signal"] in ("SIGTERM", "SIGKILL")
    assert span.attributes["sidecar.stop_reason"] == "stage_timeout"
    assert span.attributes["sidecar.outcome"] == "failed"
    assert span.attributes["error.type"] == "stage_timeout"
    assert span.status == "ERROR"
    kill = children(receiver, span)["kill"]
    assert kill.attributes["sidecar.kill.reason"] == "stage_timeout"
    assert kill.start_ns <= kill.end_ns
    assert children(receiver, span)["run"].attributes["sidecar.stop_reason"] == "stage_timeout"


IMPORTS_OTEL = b"opentelemetry"


def drain(dsn: str, env: dict[str, str], tool: str) -> subprocess.CompletedProcess:
    """``sidecar run --drain`` under ``python -X importtime``: every module the process
    imported is named on its stderr."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "sidecar", "run",
                           "--tool", tool, "--drain", "--", "trace_probe.py"],
                          env=env, capture_output=True, timeout=90)


def test_without_the_variables_nothing_is_imported_or_sent(db, receiver):
    plain = {k: v for k, v in kit.base_env(db).items() if not k.startswith("OTEL_")}
    disabled = {**traced_env(db, receiver), "OTEL_SDK_DISABLED": "true"}
    jobs = []
    for tool, env in (("untraced", plain), ("disabled", disabled)):
        job_id = kit.enqueue(db, tool, {"mode": "ok"})
        done = drain(db, env, tool)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert kit.job_row(db, job_id)["state"] == "succeeded"
        assert b"import time:" in done.stderr  # the check sees imports at all
        assert IMPORTS_OTEL not in done.stderr, tool
        assert kit.parse_events(done.stderr, "tracing_started") == []
        jobs.append(job_id)
    # The traced sidecar of the module exports every 0.1 s: had these sent anything, it
    # would be here by the time a span of a later job is.
    later = kit.enqueue(db, "flushed", {"mode": "ok"})
    done = drain(db, {**traced_env(db, receiver), "OTEL_BSP_SCHEDULE_DELAY": "60000"},
                 "flushed")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert IMPORTS_OTEL in done.stderr
    # Exported at the stop (the batch's delay is a minute): the flush at shutdown.
    [span] = attempt_spans(receiver, later, 1)
    assert span.attributes["sidecar.outcome"] == "succeeded"
    assert kit.parse_events(done.stderr, "traces_flushed")
    assert not [s for s in receiver.spans() if s.attributes.get("sidecar.job.id") in jobs]


@pytest.mark.parametrize("variables, named", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER=zipkin"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
    # values the SDK itself refuses at start with a traceback
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_BSP_MAX_QUEUE_SIZE": "-5"},
     "OTEL_BSP_MAX_QUEUE_SIZE=-5"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
      "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=0"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
      "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "-3"}, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=-3"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
      "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "abc"}, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=abc"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_BSP_MAX_QUEUE_SIZE": "10",
      "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, "refused an OTEL_* variable"),
])
def test_traces_the_install_cannot_send_are_refused_in_one_line(db, variables, named):
    done = kit.cli(db, "run", "--tool", "refused", "--", "trace_probe.py",
                   env=kit.base_env(db, **variables))
    assert done.returncode == 2
    assert named in kit.one_line_error(done, no_stdout=True)


def test_traces_asked_for_without_the_extra_are_one_line(db):
    """The [otel] extra missing: its package cannot be imported in this process."""
    code = ("import sys; sys.modules['opentelemetry'] = None; "
            "from sidecar.cli import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code, "run", "--tool", "refused", "--",
                           "trace_probe.py"],
                          env=kit.base_env(db, OTEL_TRACES_EXPORTER="otlp"),
                          capture_output=True, timeout=60)
    assert done.returncode == 2
    line = kit.one_line_error(done, no_stdout=True)
    assert "[otel] extra is missing" in line and "pip install 'sidecar[otel]'" in line


def test_a_hostile_trace_context_in_a_row_never_stops_the_job(db, receiver):
    """A row written around the enqueue checks (by SQL): a traceparent that is not one, a
    tracestate far beyond 512 characters (larger than an environment string may be) and
    one of 40 members. Traced or not, the sidecar runs each job to success and keeps
    running; the tool gets a trace context it can parse or none."""
    tool = "traced-hostile"
    hostile = {
        "garbage": ("zz-<script>-not-a-traceparent", "a=b"),
        "huge": (TRACEPARENT, "k=" + "v" * 200_000),
        "members": (TRACEPARENT, ",".join(f"k{i}=v" for i in range(40))),
    }
    for traced in (True, False):
        ids = {}
        for name, (parent, state) in hostile.items():
            ids[name] = kit.enqueue(db, tool, {"mode": "ok"})
            kit.query(db, "UPDATE tool_jobs SET traceparent = $2, tracestate = $3 "
                          "WHERE id = $1::uuid", ids[name], parent, state)
        env = traced_env(db, receiver) if traced else kit.base_env(db)
        done = subprocess.run([sys.executable, "-m", "sidecar", "run", "--tool", tool,
                               "--drain", "--", "trace_probe.py"], env=env,
                              capture_output=True, timeout=90)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        ignored = kit.parse_events(done.stderr, "trace_context_ignored")
        assert sorted(e["job_id"] for e in ignored) == sorted(ids.values()), ignored
        for name, job_id in ids.items():
            row = kit.job_row(db, job_id)
            assert row["state"] == "succeeded", (traced, name, row["error"])
            got = row["result"]
            if got["traceparent"] is not None:
                assert TRACEPARENT_RE.fullmatch(got["traceparent"]), (traced, name, got)
            assert len(got["tracestate"] or "") <= 512, (traced, name)
