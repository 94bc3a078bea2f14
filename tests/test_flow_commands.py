"""Flow control from the operator's and the caller's side (issue 27): ``sidecar limit``,
``limits``, ``pause``, ``resume``, ``enqueue --concurrency-key`` (and the client and SQL
function), and real sidecars obeying them: a fleet never above its cap, a pause that
holds every sidecar and cancels running trees, gauges and /readyz detail."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import asyncpg
import orjson
import pytest

from sidecar.client import Client
from sidecar.protocol.flow import limit_changes
from sidecar.protocol.model import JobState, RawJson
from sidecar.storage import db
from sidecar.storage.worker_store import WorkerStore
from tests.kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    http_get_json,
    job_processes,
    one_line_error,
    read_pids,
    run,
    scalar,
    scraped_metric,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.server]

SLEEP = str(TOOLS / "fault_sleep.py")
HANG = str(TOOLS / "hang_tree.py")


def _json(done) -> dict:
    assert done.returncode == 0, done.stderr.decode()
    return orjson.loads(done.stdout)


def test_limit_sets_changes_and_clears_fleet_wide_limits_journaled(dsn):
    out = _json(cli(dsn, "limit", "erp", "--max-running", "4", "--rate", "600/m"))
    assert out["tool"] == "erp" and out["max_running"] == 4 and out["rate"] == "600/m"
    assert out["burst"] == 1 and out["paused"] is False
    # Only what is given changes.
    out = _json(cli(dsn, "limit", "erp", "--max-running-per-key", "1"))
    assert (out["max_running"], out["max_running_per_key"], out["rate"]) == (4, 1, "600/m")
    listed = _json(cli(dsn, "limits", "--events", "5"))
    assert [t["tool"] for t in listed["tools"]] == ["erp"]
    assert [e["event"] for e in listed["events"]] == ["limits_set", "limits_set"]
    assert listed["events"][0]["details"]["max_running"] == 4
    assert listed["events"][0]["details"]["by"].startswith("sidecar limit (")
    out = _json(cli(dsn, "limit", "erp", "--clear"))
    assert [out[k] for k in ("max_running", "max_running_per_key", "rate", "rate_per_key")] \
        == [None] * 4
    assert _json(cli(dsn, "limits", "--tool", "nothing-here")) == {"tools": []}


@pytest.mark.parametrize("args, names", [
    (["limit", "erp"], "--max-running"),
    (["limit", "erp", "--max-running", "0"], "--max-running"),
    (["limit", "erp", "--max-running", "-3"], "--max-running"),
    (["limit", "erp", "--max-running", "١٢"], "--max-running"),
    (["limit", "erp", "--max-running", "99999999999"], "--max-running"),
    (["limit", "erp", "--rate", "10/h"], "--rate"),
    (["limit", "erp", "--rate", "0/s"], "--rate"),
    (["limit", "erp", "--rate", "0.000001/m"], "--rate"),
    (["limit", "erp", "--rate", "0.0000001/s"], "--rate"),
    (["limit", "erp", "--rate", "ten/s"], "--rate"),
    (["limit", "erp", "--rate-per-key", "5"], "--rate-per-key"),
    (["limit", "erp", "--clear", "--max-running", "2"], "--clear"),
    (["limit", "bad tool!", "--max-running", "2"], "tool"),
    (["pause", "erp", "--reason", "a\x07bell"], "--reason"),
    (["pause", "erp", "--reason", " "], "--reason"),
    (["limits", "--events", "0"], "--events"),
    (["enqueue", "erp", "--concurrency-key", ""], "--concurrency-key"),
    (["enqueue", "erp", "--concurrency-key", "tab\there"], "--concurrency-key"),
    (["enqueue", "erp", "--concurrency-key", "k" * 257], "--concurrency-key"),
])
def test_bad_flow_input_is_one_line_naming_the_option_exit_2(dsn, args, names):
    done = cli(dsn, *args)
    assert done.returncode == 2, done.stderr.decode()
    assert names in one_line_error(done, no_stdout=True)
    assert scalar(dsn, "SELECT count(*) FROM tool_flow_events") == 0
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0


def test_pause_and_resume_are_shown_by_limits_and_jobs(dsn):
    enqueue(dsn, "erp", {})
    out = _json(cli(dsn, "pause", "erp", "--reason", "ERP down until 02:00"))
    assert out["paused"] and out["was_paused"] is False and out["reason"].startswith("ERP")
    assert _json(cli(dsn, "pause", "erp"))["was_paused"] is True  # keeps the reason
    [tool] = _json(cli(dsn, "limits"))["tools"]
    assert tool["paused"] and tool["pause_reason"] == "ERP down until 02:00"
    assert tool["queued"] == 1
    listed = cli(dsn, "jobs")
    # The banner goes to stderr; stdout keeps one line per job for scripts (issue 41).
    [banner] = listed.stderr.decode().splitlines()
    assert banner.startswith("tool erp:  PAUSED since ") and "ERP down" in banner
    [line] = listed.stdout.decode().splitlines()
    assert line.split()[1:3] == ["erp", "queued"]
    assert _json(cli(dsn, "resume", "erp"))["resumed"] is True
    again = cli(dsn, "resume", "erp")  # nothing to act on: exit 1, one line
    assert again.returncode == 1
    assert "erp is not paused" in one_line_error(again, no_stdout=True)
    assert len(cli(dsn, "jobs").stdout.decode().splitlines()) == 1


def test_pause_of_a_tool_never_seen_is_refused_unless_asked_for_ahead(dsn):
    """Issue 41: a typo during an incident (`pause epr` for erp) must not look like success:
    a tool with no job, limit or sidecar is refused in one line naming it, the known
    tools and --new, exit 1, and nothing is paused; --new pauses it ahead of its first
    job, and a tool known by its limit alone is known."""
    enqueue(dsn, "erp", {})
    done = cli(dsn, "pause", "epr", "--reason", "ERP down")
    assert done.returncode == 1
    line = one_line_error(done, no_stdout=True)
    assert "'epr'" in line and "known tools: erp" in line and "--new" in line
    assert scalar(dsn, "SELECT count(*) FROM tool_flow") == 0
    assert scalar(dsn, "SELECT count(*) FROM tool_flow_events") == 0
    out = _json(cli(dsn, "pause", "epr", "--new"))
    assert out["paused"] is True and out["was_paused"] is False
    assert _json(cli(dsn, "pause", "epr"))["was_paused"] is True  # known now
    _json(cli(dsn, "limit", "crm", "--max-running", "2"))
    assert _json(cli(dsn, "pause", "crm"))["paused"] is True


def test_a_concurrency_key_from_the_cli_the_client_and_sql(dsn):
    one = enqueue(dsn, "browser", {}, "--concurrency-key", "account-7")

    async def go():
        async with Client(dsn) as client:
            two = await client.enqueue("browser", {"n": 2}, concurrency_key="account-8")
        conn = await asyncpg.connect(dsn)
        try:
            three = await conn.fetchval("SELECT sidecar_enqueue('browser', '{\"n\": 3}', "
                                        "concurrency_key => 'account-9')")
            with pytest.raises(asyncpg.InvalidParameterValueError, match="concurrency_key"):
                await conn.fetchval("SELECT sidecar_enqueue('browser', '{}', "
                                    "concurrency_key => E'a\\nb')")
            # The same idempotency key with another concurrency key is another operation.
            await conn.fetchval("SELECT sidecar_enqueue('browser', '{}', 'op-1', "
                                "concurrency_key => 'a')")
            with pytest.raises(asyncpg.UniqueViolationError):
                await conn.fetchval("SELECT sidecar_enqueue('browser', '{}', 'op-1', "
                                    "concurrency_key => 'b')")
            return two.id, three
        finally:
            await conn.close()

    two, three = run(go())
    keys = dict((str(r[0]), r[1]) for r in _rows(
        dsn, "SELECT id, concurrency_key FROM tool_jobs WHERE tool = 'browser'"))
    assert keys[one] == "account-7" and keys[str(two)] == "account-8"
    assert keys[str(three)] == "account-9"
    shown = _json(cli(dsn, "show", one))
    assert shown["concurrency_key"] == "account-7"
    # A keyed job gives its tool a flow row, so its claims take turns by key.
    assert [t["tool"] for t in _json(cli(dsn, "limits"))["tools"]] == ["browser"]


def _rows(dsn: str, sql: str) -> list:
    async def go():
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(sql)
        finally:
            await conn.close()
    return run(go())


def test_a_fleet_of_sidecars_never_runs_more_than_max_running(dsn, sidecars, tmp_path):
    """The issue's case: 3 sidecars at --concurrency 4 and 12 jobs of 1.5 s ran all 12 at
    once; with --max-running 2, sampled every 20 ms, never more than 2 run."""
    assert _json(cli(dsn, "limit", "export", "--max-running", "2"))["max_running"] == 2
    ids = [enqueue(dsn, "export", {"seconds": 1.5}) for _ in range(12)]
    seen, done = [], threading.Event()

    def sample():
        async def go():
            conn = await asyncpg.connect(dsn)
            try:
                while not done.is_set():
                    seen.append(await conn.fetchval(
                        "SELECT count(*) FROM tool_jobs WHERE tool = 'export' "
                        "AND state = 'running' AND lease_until >= now()"))
                    await asyncio.sleep(0.02)
            finally:
                await conn.close()
        run(go())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _ in range(3):
            sidecars(dsn, [sys.executable, SLEEP], "--tool", "export", "--concurrency", "4")
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_jobs WHERE tool = 'export' "
                                       "AND state = 'succeeded'") == 12, timeout=90,
                   what="12 jobs succeeded")
    finally:
        done.set()
        sampler.join()
    assert max(seen) == 2, seen
    assert scalar(dsn, "SELECT max(attempt) FROM tool_jobs WHERE tool = 'export'") == 1
    assert len(ids) == 12


def test_a_freed_slot_wakes_an_idle_sidecar_without_waiting_for_its_poll(dsn, sidecars):
    """A sidecar held back by max_running stays on the idle list; the end of the running
    job (here held by the test itself, as another sidecar would) wakes it: with a poll of
    60 s, the next job starts long before its poll would have found it."""
    cli(dsn, "limit", "wake", "--max-running", "1")
    enqueue(dsn, "wake", {"seconds": 0})
    second = enqueue(dsn, "wake", {"seconds": 0})

    async def with_store(action):
        pool = await db.create_pool(dsn, 10, max_size=1)
        try:
            return await action(WorkerStore(pool, 10))
        finally:
            await pool.close()

    job = run(with_store(lambda store: store.claim("wake", "the-test", 60.0, None, 3)))
    sc = sidecars(dsn, [sys.executable, SLEEP], "--tool", "wake",
                  env=base_env(dsn, SIDECAR_POLL_SECONDS="60"))
    wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars "
                                   "WHERE tool = 'wake'") == 1, what="idle registration")
    assert scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1", second) == "queued"
    assert run(with_store(lambda store: store.finish_if_owner(
        job, "the-test", JobState.SUCCEEDED, RawJson("{}"), None, "job_succeeded", {})))
    wait_until(lambda: scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                              second) == "succeeded", timeout=30,
               what="the second job run after the wake-up")
    assert sc.events("claim_error") == []


def test_pause_holds_every_sidecar_and_cancel_running_kills_the_tree(dsn, sidecars,
                                                                      tmp_path):
    pidfile = tmp_path / "pids"
    running = enqueue(dsn, "ocr", {"pidfile": str(pidfile), "tree": True})
    sc = sidecars(dsn, [sys.executable, HANG], "--tool", "ocr", "--concurrency", "2")
    pids = read_pids(pidfile, 4)
    base = "http://" + sc.wait_event("worker_started")["http_addr"]
    out = _json(cli(dsn, "pause", "ocr", "--reason", "upstream down", "--cancel-running"))
    assert out["cancelled"] == [running]
    queued = enqueue(dsn, "ocr", {"pidfile": str(tmp_path / "never"), "tree": False})
    # The running tree dies (cancel), nothing new starts while paused.
    wait_until(lambda: not job_processes(running) and not any(
        _alive(p) for p in pids), timeout=30, what="the cancelled tree gone")
    wait_until(lambda: scraped_metric(base, "sidecar_flow_paused", tool="ocr") == 1.0,
               what="the paused gauge")
    ready = http_get_json(base + "/readyz")
    assert ready["ready"] is True and ready["flow"]["paused"] is True
    assert ready["flow"]["pause_reason"] == "upstream down"
    assert scraped_metric(base, "sidecar_claim_attempts_total", tool="ocr",
                          outcome="paused") >= 1
    time.sleep(1.0)  # several polls of the sidecar: still nothing claimed
    assert scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1", queued) == "queued"
    assert scalar(dsn, "SELECT attempt FROM tool_jobs WHERE id = $1", queued) == 0
    _json(cli(dsn, "resume", "ocr"))
    wait_until(lambda: scalar(dsn, "SELECT state FROM tool_jobs WHERE id = $1",
                              queued) == "running", timeout=30, what="claimed after resume")
    cli(dsn, "cancel", queued)


def _alive(pid: int) -> bool:
    from tests.kit import pid_alive
    return pid_alive(pid)


def test_limit_gauges_follow_the_database(dsn, sidecars):
    sc = sidecars(dsn, ["cat"], "--tool", "gauge")
    base = "http://" + sc.wait_event("worker_started")["http_addr"]
    cli(dsn, "limit", "gauge", "--max-running", "3", "--rate", "30/m")
    wait_until(lambda: scraped_metric(base, "sidecar_flow_limit", tool="gauge",
                                      limit="max_running") == 3.0, what="max_running gauge")
    assert scraped_metric(base, "sidecar_flow_limit", tool="gauge", limit="rate") == 0.5
    assert scraped_metric(base, "sidecar_flow_running", tool="gauge") == 0.0
    cli(dsn, "limit", "gauge", "--clear")
    wait_until(lambda: scraped_metric(base, "sidecar_flow_limit", tool="gauge",
                                      limit="max_running") is None, what="gauge removed")
    assert limit_changes(clear=True)["max_running"] is None
