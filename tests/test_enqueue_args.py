"""The caller's options parsed without a database (sidecar.protocol.enqueue_args, pure): durations
and times, tags, and the W3C trace context, each refused with one line naming the option."""

from __future__ import annotations

import datetime as dt

import pytest

from sidecar.protocol.enqueue_args import (
    check_traceparent,
    check_tracestate,
    enqueue_options,
    parse_duration,
    parse_expires_in,
    parse_run_after,
    parse_tags,
)
from sidecar.protocol.errors import UsageError

pytestmark = pytest.mark.unit

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("text, seconds", [("90", 90), ("1.5s", 1.5), ("30m", 1800),
                                           ("12h", 43200), ("2d", 172800), (" 7 D ", 604800)])
def test_durations(text, seconds):
    assert parse_duration(text, "--x") == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "-1", "1w", "abc", "1e3", "367d", "nan"])
def test_bad_durations_name_the_option(text):
    with pytest.raises(UsageError, match="--x"):
        parse_duration(text, "--x")


def test_run_after_is_a_delay_or_a_time_with_its_offset():
    assert parse_run_after("5m") == dt.timedelta(minutes=5)
    assert parse_run_after("2030-01-02T03:04:05Z") == dt.datetime(2030, 1, 2, 3, 4, 5,
                                                                  tzinfo=dt.UTC)
    with pytest.raises(UsageError, match="offset"):
        parse_run_after("2030-01-02T03:04:05")
    with pytest.raises(UsageError, match="--run-after"):
        parse_run_after("tomorrow")


def test_an_expiry_is_more_than_zero_and_after_the_delay():
    with pytest.raises(UsageError, match="more than 0"):
        parse_expires_in("0")
    with pytest.raises(UsageError, match="expire before"):
        enqueue_options(run_after="10m", expires_in="5m")
    options = enqueue_options(priority=3, run_after="1m", expires_in="5m")
    assert (options.priority, options.run_in, options.expires_in) == (
        3, dt.timedelta(minutes=1), dt.timedelta(minutes=5))


def test_tags():
    assert parse_tags(["run=42", "user=a=b"]) == {"run": "42", "user": "a=b"}
    assert parse_tags(None) == {}
    for bad, why in ((["run"], "KEY=VALUE"), (["run=1", "run=2"], "twice"),
                     (["=1"], "key"), (["-x=1"], "key"), (["run="], "value"),
                     (["run=a\nb"], "value"), ([f"k{i}=v" for i in range(17)], "at most 16"),
                     (["run=" + "x" * 257], "value"), (["k" * 64 + "=v"], "key"),
                     # bytes that were not UTF-8 on the command line (surrogateescape)
                     ([b"run=a\xffb".decode("utf-8", "surrogateescape")], "UTF-8")):
        with pytest.raises(UsageError, match=why):
            parse_tags(bad)


@pytest.mark.parametrize("text", ["١٢", "１２", "1٢m"])
def test_durations_are_ascii_digits_only(text):
    """Python's \\d and int() take other scripts' digits; the SQL side would not."""
    with pytest.raises(UsageError, match="--expires-in"):
        parse_expires_in(text)
    with pytest.raises(UsageError, match="--run-after"):
        parse_run_after(text)


def test_traceparent():
    assert check_traceparent(TP) == TP
    for bad in (TP.upper(), TP[:-1], "ff" + TP[2:], TP.replace("4bf92f3577b34da6a3ce929d0e0e4736",
                                                              "0" * 32),
                TP.replace("00f067aa0ba902b7", "0" * 16), TP + "-00", "x"):
        with pytest.raises(UsageError, match="--traceparent"):
            check_traceparent(bad)


def test_tracestate():
    for good in ("rojo=00f067aa0ba902b7", "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7",
                 "tenant@vendor=x", "a=1,,b=2"):
        assert check_tracestate(good) == good
    for bad in ("Rojo=1", "rojo", "a=1,a=2", "rojo=a,b", "x=" + "v" * 600,
                ",".join(f"k{i}=v" for i in range(33)), "k=a=b"):
        with pytest.raises(UsageError, match="--tracestate"):
            check_tracestate(bad)
    with pytest.raises(UsageError, match="needs a --traceparent"):
        enqueue_options(tracestate="rojo=1")
