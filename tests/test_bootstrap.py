"""Unit tests of ``sidecar run``'s argument check (sidecar.worker.bootstrap.check_run_args: pure,
a RunConfig or one UsageError line) and of the one periodic-service shape
(sidecar.ops.periodic.Periodic) the pruner, the forwarder, the leftover sweep, the orphan
reaper and the loop watch share. Nothing here spawns a process or needs the database.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time

import orjson
import pytest
from prometheus_client import REGISTRY

from sidecar.ops.periodic import Periodic
from sidecar.protocol.errors import UsageError
from sidecar.runtime.config import load_settings
from sidecar.runtime.log import log
from sidecar.worker.bootstrap import check_run_args

pytestmark = pytest.mark.unit

# --- the argument check -------------------------------------------------------------------


def test_the_argument_check_resolves_the_command_and_names_the_tool():
    settings = load_settings({})
    config = check_run_args(["true", "-x"], None, 2, True, settings, ["SIGHUP:ignored"])
    assert config.tool == "true" and config.profile.tool == "true"
    assert os.path.isabs(config.argv[0]) and config.argv[1:] == ["-x"]
    assert (config.concurrency, config.drain) == (2, True)
    assert config.inherited_signals == ("SIGHUP:ignored",)


@pytest.mark.parametrize("command, tool, concurrency, says", [
    ([], None, 1, "give the tool command after '--'"),
    ([sys.executable, "x.py"], None, 1, "starts with the interpreter"),
    (["true"], None, 0, "--concurrency 0: must be 1 or more"),
    (["/nonexistent/ocr"], "ocr", 1, "does not exist or is not an executable file"),
])
def test_a_bad_argument_is_one_line(command, tool, concurrency, says):
    with pytest.raises(UsageError) as caught:
        check_run_args(command, tool, concurrency, False, load_settings({}))
    assert says in caught.value.message and "\n" not in caught.value.message


# --- the periodic-service shape ----------------------------------------------------------


def _runs(service: str, result: str) -> float:
    return REGISTRY.get_sample_value("sidecar_service_runs_total",
                                     {"service": service, "result": result}) or 0.0


@pytest.fixture
def events(monkeypatch):
    """The JSON events the code under test logs, as a list filled as they come."""
    stream = io.BytesIO()
    monkeypatch.setattr(log, "stream", stream)
    monkeypatch.setattr(log, "fmt", "json")
    return lambda: [orjson.loads(line) for line in stream.getvalue().splitlines()]


def _run_until(service: Periodic, done: asyncio.Event, timeout: float = 5.0) -> None:
    async def go() -> None:
        task = asyncio.create_task(service.run())
        try:
            await asyncio.wait_for(done.wait(), timeout)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    asyncio.run(go())


def test_a_service_survives_its_errors_logs_each_once_and_counts_every_run(events):
    before_ok, before_error = _runs("pruner", "ok"), _runs("pruner", "error")
    calls: list[float] = []
    done = asyncio.Event()

    async def step() -> None:
        calls.append(time.monotonic())
        if len(calls) == 4:
            done.set()
        if len(calls) % 2:
            raise OSError("no route")

    _run_until(Periodic("pruner", 0.01, step, first=0, errors=(OSError,),
                        error_event="prune_error", fields={"tool": "t"}), done)
    assert len(calls) >= 4
    errors = [e for e in events() if e["event"] == "prune_error"]
    assert len(errors) >= 2 and errors[0]["level"] == "warning"
    assert errors[0]["tool"] == "t" and errors[0]["reason"] == "OSError: no route"
    assert _runs("pruner", "error") - before_error >= 2
    assert _runs("pruner", "ok") - before_ok >= 2


def test_an_error_it_does_not_survive_ends_the_service():
    async def step() -> None:
        raise RuntimeError("broken")

    service = Periodic("orphan_reaper", 0.01, step, first=0, errors=())
    with pytest.raises(RuntimeError):
        asyncio.run(service.run())


def test_a_silenced_error_is_counted_not_logged(events):
    done = asyncio.Event()

    async def step() -> None:
        done.set()
        raise TimeoutError

    _run_until(Periodic("forwarder", 0.01, step, first=0, errors=(Exception,),
                        error_event="forward_error", error_fields=lambda exc: None), done)
    assert not [e for e in events() if e["event"] == "forward_error"]


def test_the_first_run_waits_first_plus_jitter_then_every_period():
    calls: list[float] = []
    done = asyncio.Event()

    async def step() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            done.set()

    started = time.monotonic()
    _run_until(Periodic("leftover_sweep", 0.05, step, first=0.1, jitter=0.1,
                        errors=()), done)
    assert 0.1 <= calls[0] - started < 1.0
    assert all(later - earlier >= 0.05 for earlier, later in zip(calls, calls[1:], strict=False))


def test_more_work_runs_again_at_once_and_a_wake_ends_the_wait():
    calls: list[float] = []
    done = asyncio.Event()
    wake = asyncio.Event()

    async def step() -> bool:
        calls.append(time.monotonic())
        if len(calls) == 3:
            wake.set()  # as a commit that queued a result would: no 30 s wait
        if len(calls) == 4:
            done.set()
        return len(calls) < 3  # two full batches, then a short one

    _run_until(Periodic("forwarder", 30.0, step, first=0, wake=wake, errors=()), done)
    assert len(calls) == 4 and calls[-1] - calls[0] < 5.0


def test_errors_it_survives_need_an_error_event():
    async def step() -> None:
        return None

    with pytest.raises(ValueError):
        Periodic("pruner", 1.0, step, errors=(OSError,))
