"""One parser per kind of input (sidecar.protocol.parsing, pure; issue 40, point 4): HOST:PORT,
durations, job ids and the loopback hosts, and the enqueue options' one parser
(sidecar.protocol.enqueue_args.enqueue_options) from the command line and from Python. Each case
is one that a former copy accepted or refused (config's SIDECAR_HTTP_ADDR, the MCP
gateway's, the web view's and the receiver's --listen; config's and enqueue_args'
durations; the CLI's, the client's and the web view's job ids; the web view's and the
gateway's loopback sets; the CLI's and the client's enqueue options)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest

from sidecar.protocol import enqueue_args, parsing
from sidecar.protocol.errors import SidecarError, UsageError
from sidecar.runtime.config import MAX_SECONDS, ConfigError, load_settings

pytestmark = pytest.mark.unit


# --- HOST:PORT ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, host, port", [
    ("127.0.0.1:8080", "127.0.0.1", 8080),
    ("0.0.0.0:9180", "0.0.0.0", 9180),
    ("localhost:0", "localhost", 0),
    ("example.org:65535", "example.org", 65535),
    ("sidecar-mcp:8765", "sidecar-mcp", 8765),
    ("[::1]:8080", "::1", 8080),
    ("[::]:0", "::", 0),
    ("[fd00::1]:8900", "fd00::1", 8900),
])
def test_host_port_accepts_host_or_bracketed_ipv6_and_a_port(text, host, port):
    assert parsing.split_host_port(text) == (host, port)
    assert parsing.parse_host_port(text, "--listen", "127.0.0.1:8080") == (host, port)
    assert parsing.format_host_port(host, port) == text  # read back the same


@pytest.mark.parametrize("text", [
    "localhost", "8080", ":8080", "host:", "host:65536", "host:99999", "host:123456",
    "host:-1", "host:８０", "host:١٢", "host:80x", "a b:80", " host:80", "host:80 ",
    "[::1]", "[::1:80", "::1]:80", "::1:8080", "[]:80", "", "[a b]:80", "host:80:90",
])
def test_host_port_refuses_anything_else_in_one_line_naming_the_field(text):
    with pytest.raises(parsing.ParseError):
        parsing.split_host_port(text)
    with pytest.raises(UsageError) as raised:
        parsing.parse_host_port(text, "--listen", "127.0.0.1:8765")
    line = raised.value.message
    assert line.startswith(f"--listen {text!r}: use HOST:PORT"), line
    assert "[::1]:8080" in line and "e.g. 127.0.0.1:8765" in line and "\n" not in line


def test_sidecar_http_addr_is_read_by_the_same_parser():
    assert load_settings({"SIDECAR_HTTP_ADDR": "[::1]:9180"}).http_addr == "[::1]:9180"
    assert load_settings({"SIDECAR_HTTP_ADDR": "off"}).http_addr == "off"
    for bad in ("9180", "::1:9180", "host:70000"):
        with pytest.raises(ConfigError) as raised:
            load_settings({"SIDECAR_HTTP_ADDR": bad})
        assert raised.value.message.startswith(f"SIDECAR_HTTP_ADDR={bad!r} is not valid: "
                                               "use HOST:PORT"), raised.value.message
        assert "or off" in raised.value.message


# --- loopback ---------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]",
                                  "localhost", "LOCALHOST"])
def test_loopback_hosts(host):
    assert parsing.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "10.0.0.1", "example.org",
                                  "localhost.", "127.evil.example", "127.0.0.1.evil.example",
                                  "", "[127.0.0.1]x", "::ffff:8.8.8.8"])
def test_not_loopback(host):
    assert not parsing.is_loopback(host)


def test_loopback_patterns_cover_every_loopback_name_with_ipv6_in_brackets():
    assert parsing.loopback_patterns() == ["127.0.0.1:*", "localhost:*", "[::1]:*"]
    assert parsing.loopback_patterns("http") == ["http://127.0.0.1:*", "http://localhost:*",
                                                 "http://[::1]:*"]


# --- durations --------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [
    ("0", 0), ("90", 90), ("1.5", 1.5), ("1.5s", 1.5), ("30m", 1800), ("12h", 43200),
    ("7d", 604800), (" 7 D ", 604800), ("3600", 3600), ("2S", 2),
])
def test_durations(text, seconds):
    assert parsing.duration_seconds(text, MAX_SECONDS) == seconds
    assert parsing.parse_duration(text, "--timeout", MAX_SECONDS) == seconds


@pytest.mark.parametrize("text", ["", "-1", "1w", "abc", "1e3", "nan", "inf", "1.", ".5",
                                  "١٢", "１２", "5 m s", "1h30m", "0x10"])
def test_bad_durations_name_the_field_and_the_form(text):
    with pytest.raises(UsageError) as raised:
        parsing.parse_duration(text, "--timeout", MAX_SECONDS)
    assert raised.value.message == f"--timeout {text!r}: {parsing.DURATION_FORM}"


def test_durations_have_a_bound_and_may_have_to_be_more_than_zero():
    with pytest.raises(UsageError, match=r"--x '367d': at most 366 days"):
        parsing.parse_duration("367d", "--x", 366 * 86400)
    assert parsing.parse_duration("366d", "--x", 366 * 86400) == 366 * 86400
    with pytest.raises(UsageError, match="at most 36500 days"):
        parsing.parse_duration("4000000000000000000", "--older-than", MAX_SECONDS)
    with pytest.raises(UsageError, match=r"--timeout '0': must be more than 0"):
        parsing.parse_duration("0", "--timeout", MAX_SECONDS, positive=True)
    with pytest.raises(ConfigError, match="--x"):
        parsing.parse_duration("soon", "--x", MAX_SECONDS, error=ConfigError)


def test_settings_durations_are_read_by_the_same_parser():
    assert load_settings({"SIDECAR_RETENTION_SECONDS": "7d"}).retention_seconds == 604800
    with pytest.raises(ConfigError, match="SIDECAR_RETENTION_SECONDS='1w' is not valid: use "
                                          "seconds"):
        load_settings({"SIDECAR_RETENTION_SECONDS": "1w"})


@pytest.mark.parametrize("value, seconds", [(5, 5.0), (0.25, 0.25),
                                            (dt.timedelta(minutes=2), 120.0)])
def test_python_durations(value, seconds):
    assert parsing.seconds_value(value, "timeout", positive=True) == seconds


@pytest.mark.parametrize("value, why", [
    (0, "more than 0"), (-1, "0 or more"), (float("nan"), "0 or more"),
    (float("inf"), "0 or more"), (True, "seconds or a timedelta"),
    ("5", "seconds or a timedelta"), (None, "seconds or a timedelta"),
    (dt.timedelta(seconds=-1), "0 or more"),
])
def test_bad_python_durations_name_the_argument(value, why):
    with pytest.raises(UsageError) as raised:
        parsing.seconds_value(value, "timeout", positive=True)
    assert raised.value.message.startswith("timeout ") and why in raised.value.message


# --- job ids ----------------------------------------------------------------------------

JOB = uuid.UUID("0190b2c4-6c2e-7abc-8def-0123456789ab")


@pytest.mark.parametrize("value", [JOB, str(JOB), str(JOB).upper(), JOB.hex,
                                   "{" + str(JOB) + "}", f"urn:uuid:{JOB}"])
def test_job_ids(value):
    assert parsing.parse_job_id(value) == JOB


@pytest.mark.parametrize("value", ["", "not-a-uuid", str(JOB)[:-1], str(JOB) + "0",
                                   "1 OR 1=1", 42, None, b"0190"])
def test_bad_job_ids_are_one_line_naming_the_field(value):
    with pytest.raises(UsageError) as raised:
        parsing.parse_job_id(value, "JOB_ID")
    assert raised.value.message.startswith("JOB_ID ")
    assert raised.value.message.endswith(f": {parsing.JOB_ID_FORM}")
    assert "not a UUID" in raised.value.message


def test_a_job_id_error_may_leave_the_value_out_and_be_another_error():
    class BadInput(SidecarError):
        exit_code = 2

    with pytest.raises(BadInput) as raised:
        parsing.parse_job_id("<script>", "query parameter after", BadInput, echo=False)
    assert raised.value.message == f"query parameter after: {parsing.JOB_ID_FORM}"


# --- the enqueue options: one parser, two front doors ------------------------------------

def test_the_command_line_and_python_give_the_same_options():
    text = enqueue_args.enqueue_options(3, "1m", "5m", ["run=42"], None, None, "t-1")
    python = enqueue_args.enqueue_options(3, 60, dt.timedelta(minutes=5), {"run": "42"},
                                          None, None, "t-1",
                                          names=enqueue_args.PYTHON_NAMES)
    assert text == python
    assert (text.priority, text.run_in, text.expires_in, text.tags) == (
        3, dt.timedelta(minutes=1), dt.timedelta(minutes=5), {"run": "42"})
    at = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert enqueue_args.enqueue_options(run_after="2030-01-02T03:04:05Z").run_after == at
    assert enqueue_args.enqueue_options(run_after=at, expires_in=at,
                                        names=enqueue_args.PYTHON_NAMES).expires_at == at
    assert enqueue_args.enqueue_options() == enqueue_args.EnqueueOptions()


@pytest.mark.parametrize("kwargs, cli_says, python_says", [
    ({"priority": 12}, "--priority 12", "priority 12"),
    ({"priority": True}, "--priority True", "priority True"),
    ({"run_after": "tomorrow"}, "--run-after 'tomorrow'", "run_after 'tomorrow'"),
    ({"run_after": "2030-01-02T03:04:05"}, "offset", "offset"),
    ({"run_after": dt.datetime(2030, 1, 1)}, "timezone-aware", "timezone-aware"),
    ({"run_after": "400d"}, "at most 366 days", "at most 366 days"),
    ({"run_after": dt.timedelta(days=400)}, "from 0 to 366 days", "from 0 to 366 days"),
    ({"run_after": float("nan")}, "--run-after nan", "run_after nan"),
    ({"run_after": -5}, "--run-after -5", "run_after -5"),
    ({"run_after": [1]}, "--run-after [1]", "run_after [1]"),
    ({"expires_in": "0"}, "--expires-in '0': must be more than 0", "must be more than 0"),
    ({"expires_in": 0}, "--expires-in 0: must be more than 0", "expires_in 0: must be"),
    ({"run_after": "10m", "expires_in": "5m"}, "expire before its --run-after",
     "expire before its run_after"),
    ({"tracestate": "a=b"}, "--tracestate needs a --traceparent",
     "tracestate needs a traceparent"),
    ({"traceparent": "00-xyz"}, "--traceparent '00-xyz'", "traceparent '00-xyz'"),
    ({"traceparent": 5}, "--traceparent '5'", "traceparent '5'"),
    ({"tags": ["run"]}, "--tag 'run': use KEY=VALUE", "tags 'run': use KEY=VALUE"),
    ({"tags": {"bad key": "x"}}, "--tag 'bad key'", "tags 'bad key'"),
    ({"tags": {"run": 1}}, "--tag run: the value", "tags run: the value"),
    ({"tags": "run=1"}, "--tag: give KEY=VALUE", "tags: give KEY=VALUE"),
    ({"tags": [("run", "1")]}, "--tag ('run', '1')", "tags ('run', '1')"),
    ({"concurrency_key": ""}, "--concurrency-key must be", "concurrency_key must be"),
    ({"concurrency_key": 42}, "--concurrency-key must be a string",
     "concurrency_key must be a string"),
])
def test_bad_options_are_refused_alike_naming_the_option_as_its_caller_spells_it(
        kwargs, cli_says, python_says):
    for names, says in ((enqueue_args.CLI_NAMES, cli_says),
                        (enqueue_args.PYTHON_NAMES, python_says)):
        with pytest.raises(UsageError) as raised:
            enqueue_args.enqueue_options(**kwargs, names=names)
        assert says in raised.value.message, (names, raised.value.message)
        assert "\n" not in raised.value.message


@pytest.mark.parametrize("value, ok", [(None, True), (1, True), (1000, True), (0, False),
                                       (1001, False), (True, False), ("3", False)])
def test_max_attempts(value, ok):
    if ok:
        assert enqueue_args.check_max_attempts(value, "max_attempts") == value
    else:
        with pytest.raises(UsageError, match=r"^max_attempts .*: must be from 1 to 1000"):
            enqueue_args.check_max_attempts(value, "max_attempts")
