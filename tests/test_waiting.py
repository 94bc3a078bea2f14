"""The caller's half of a tool call (issue 26, points 1 and 2), on a real PostgreSQL with real
sidecars: `sidecar wait` and `enqueue --wait` and their exit codes (0 succeeded, 3 failed or
cancelled, 4 timeout, `--any`); the wake-up is a NOTIFY on the job's own channel sent by the
statement that ends it, so a rolled-back end wakes nobody and a waiter hears no other job's
end; behind PgBouncer the waiter polls. Progress: over the guard (`POST /v1/progress`) and
the file `SIDECAR_PROGRESS_FILE`, fenced on the attempt, on the row, in `show`, in the
journal at most every few seconds, on `wait --progress`'s stderr, and counted by the idle
watchdog."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_row,
    journal_details,
    query,
    stop_process,
    wait_until,
)
from sidecar.client.waiting import job_channel
from sidecar.protocol.model import JobState, RawJson
from sidecar.storage import db
from sidecar.storage.queries import Q
from sidecar.storage.worker_store import WorkerStore

pytestmark = [pytest.mark.e2e, pytest.mark.server]

TOOL = "pt"
COMMAND = [str(TOOLS / "progress_tool.py")]


def _lines(data: bytes) -> list[dict]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def _waiter(dsn: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`sidecar wait ARGS` running in the background (stdout and stderr piped)."""
    return subprocess.Popen([sys.executable, "-m", "sidecar", "wait", *args],
                            env=env or base_env(dsn), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _waiter_listening(dsn: str, count: int = 1) -> None:
    """Wait until ``count`` waiters have LISTENed and read their jobs: their connection's
    last statement is the waiter's read (sidecar/storage/sql/queries.sql jobs_to_wait_for), done."""
    sql = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
           "AND state = 'idle' AND query LIKE '%the waiter''s read%'")
    wait_until(lambda: query(dsn, sql)[0][0] >= count, 20, what="the waiter to listen")


def _finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, bytes, bytes]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc, 5)
        raise
    return proc.returncode, out, err


async def _store(dsn: str) -> WorkerStore:
    return WorkerStore(await db.create_pool(dsn, 10, max_size=2), 10)


# --- wait ------------------------------------------------------------------------------------

def test_wait_exit_codes_any_and_bad_input(dsn, sidecars):
    ok = enqueue(dsn, TOOL, {"steps": []})
    failing = enqueue(dsn, TOOL, {"exit": 65}, "--max-attempts", "1")
    slow = enqueue(dsn, TOOL, {"steps": [{"sleep": 120}]})
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "3")

    done = cli(dsn, "wait", ok, "--timeout", "30s")
    assert done.returncode == 0, done.stderr.decode()
    assert _lines(done.stdout) == [{"id": ok, "state": "succeeded",
                                    "result": {"done": True, "statuses": []}, "attempt": 1}]

    done = cli(dsn, "wait", ok, failing, ok, "--timeout", "30s")  # a repeated id counts once
    assert done.returncode == 3, done.stderr.decode()
    ended = {line["id"]: line for line in _lines(done.stdout)}
    assert set(ended) == {ok, failing} and len(_lines(done.stdout)) == 2
    assert ended[failing]["state"] == "failed" and "result" not in ended[failing]
    assert ended[failing]["error"]["kind"] == "exit_code" and ended[failing]["attempt"] == 1

    done = cli(dsn, "wait", slow, "--timeout", "1s")
    assert done.returncode == 4 and done.stdout == b""
    assert "timed out" in done.stderr.decode() and slow in done.stderr.decode()

    done = cli(dsn, "wait", slow, ok, "--any", "--timeout", "30s")
    assert done.returncode == 0, done.stderr.decode()
    assert [line["id"] for line in _lines(done.stdout)] == [ok]

    assert cli(dsn, "cancel", slow).returncode == 0
    done = cli(dsn, "wait", slow, "--timeout", "30s")
    assert done.returncode == 3
    assert _lines(done.stdout)[0]["state"] == "cancelled"

    missing = "00000000-0000-4000-8000-000000000000"
    done = cli(dsn, "wait", ok, missing)
    assert done.returncode == 1 and f"no job {missing}" in done.stderr.decode()
    assert cli(dsn, "wait", ok, "--timeout", "soon").returncode == 2
    assert cli(dsn, "wait", "not-a-uuid").returncode == 2


def test_wait_tag_waits_for_every_job_of_the_tag(dsn, sidecars):
    """``wait --tag`` follows every job carrying the tags when it starts (issue 26 point
    4): it returns once all ended, exit 3 when one of them failed; an unknown tag is
    exit 1, ids and --tag together exit 2."""
    run = f"run={os.urandom(4).hex()}"
    ok = enqueue(dsn, TOOL, {"steps": []}, "--tag", run)
    failing = enqueue(dsn, TOOL, {"exit": 65}, "--max-attempts", "1", "--tag", run,
                      "--tag", "kind=bad")
    other = enqueue(dsn, TOOL, {"steps": [{"sleep": 120}]})  # not of the tag: never awaited
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "3")

    done = cli(dsn, "wait", "--tag", run, "--timeout", "30s")
    assert done.returncode == 3, done.stderr.decode()
    ended = {line["id"]: line["state"] for line in _lines(done.stdout)}
    assert ended == {ok: "succeeded", failing: "failed"}

    done = cli(dsn, "wait", "--tag", run, "--tag", "kind=bad", "--timeout", "30s")
    assert done.returncode == 3 and [x["id"] for x in _lines(done.stdout)] == [failing]
    done = cli(dsn, "wait", "--tag", f"{run}-nobody", "--timeout", "5s")
    assert done.returncode == 1 and "no job has the tags" in done.stderr.decode()
    assert cli(dsn, "wait", ok, "--tag", run).returncode == 2
    assert cli(dsn, "cancel", other).returncode == 0


def test_enqueue_wait_enqueues_and_waits_in_one_command(dsn, sidecars):
    sidecars(dsn, COMMAND, "--tool", TOOL)
    done = cli(dsn, "enqueue", TOOL, "--payload", '{"steps": []}', "--wait", "--timeout", "30s")
    assert done.returncode == 0, done.stderr.decode()
    queued, ended = _lines(done.stdout)
    assert queued["created"] is True
    assert ended == {"id": queued["id"], "state": "succeeded",
                     "result": {"done": True, "statuses": []}, "attempt": 1}

    done = cli(dsn, "enqueue", TOOL, "--payload", '{"exit": 65}', "--max-attempts", "1",
               "--wait")
    assert done.returncode == 3
    assert _lines(done.stdout)[1]["state"] == "failed"
    done = cli(dsn, "enqueue", TOOL, "--timeout", "5s")
    assert done.returncode == 2 and b"--wait" in done.stderr


def test_a_job_deleted_while_waited_for_ends_the_wait_with_no_job(dsn):
    """A job removed while a caller waits for it (pruned, deleted by hand) sends no
    notification: the waiter's next read says "no job", exit 1, instead of waiting for
    ever. The LISTEN path reads after check_seconds; the polling path (behind a
    transaction pooler) at its next poll."""
    import uuid as uuid_mod

    from sidecar.client.waiting import JobNotFound, watch

    job_id = enqueue(dsn, TOOL, {})

    async def main():
        conn = await db.connect(dsn, 10)
        try:
            async def wait_all():
                return [event async for event in watch(conn, [uuid_mod.UUID(job_id)],
                                                       check_seconds=0.5)]
            waiting = asyncio.ensure_future(wait_all())
            await asyncio.sleep(0.3)
            await asyncio.to_thread(query, dsn, "DELETE FROM tool_jobs WHERE id = $1::uuid",
                                    job_id)
            with pytest.raises(JobNotFound, match=job_id):
                await asyncio.wait_for(waiting, 10)
        finally:
            await conn.close()

    asyncio.run(main())

    other = enqueue(dsn, TOOL, {})
    env = base_env(dsn, SIDECAR_DATABASE_POOLER="transaction")
    waiter = _waiter(dsn, other, "--timeout", "60s", env=env)
    time.sleep(1.0)
    query(dsn, "DELETE FROM tool_jobs WHERE id = $1::uuid", other)
    code, out, err = _finish(waiter, 30)
    assert code == 1 and out == b"", err.decode()
    assert f"no job {other}" in err.decode()


def test_wait_exit_3_wins_over_a_timeout_and_enqueue_wait_takes_progress(dsn, sidecars):
    """One job failed, another still queued at the timeout: exit 3, the failure being
    known for good. ``enqueue --wait --progress`` is accepted; ``--progress`` alone is
    exit 2."""
    failing = enqueue(dsn, TOOL, {"exit": 65}, "--max-attempts", "1")
    stuck = enqueue(dsn, "nobody-runs-this", {})
    sidecars(dsn, COMMAND, "--tool", TOOL)
    done = cli(dsn, "wait", failing, stuck, "--timeout", "5s")
    assert done.returncode == 3, done.stderr.decode()
    assert [line["id"] for line in _lines(done.stdout)] == [failing]
    assert "timed out" in done.stderr.decode()
    done = cli(dsn, "enqueue", TOOL, "--payload", '{"steps": []}', "--wait", "--progress",
               "--timeout", "30s")
    assert done.returncode == 0, done.stderr.decode()
    assert cli(dsn, "enqueue", TOOL, "--payload", "{}", "--progress").returncode == 2


def test_wait_progress_says_why_a_job_waits(dsn):
    """Issue 41, point 4: `wait --progress` on a job of a tool no sidecar serves prints a
    line on stderr saying so ("waiting": "no_live_sidecar"), once, then times out (exit
    4). Was: silence until the timeout."""
    job = enqueue(dsn, "nobody-runs-this", {})
    done = cli(dsn, "wait", job, "--progress", "--timeout", "5s")
    assert done.returncode == 4, done.stderr.decode()
    reasons = [line for line in _lines(done.stderr.split(b"sidecar: error")[0])
               if "waiting" in line]
    assert [(r["id"], r["waiting"], r["progress"]) for r in reasons] == [
        (job, "no_live_sidecar", None)]
    assert reasons[0]["message"].startswith("no live sidecar")


def test_a_rolled_back_end_wakes_nobody(dsn):
    """The fenced end run in a transaction that rolls back sends nothing (the NOTIFY leaves
    at commit): the waiter keeps waiting and a listener on the job's channel hears nothing;
    the same end committed wakes both, once."""
    job_id = enqueue(dsn, TOOL, {})

    async def main():
        store = await _store(dsn)
        listener = await db.connect(dsn, 10)
        ender = await db.connect(dsn, 10)
        heard: list[str] = []
        waiter = None
        try:
            await listener.add_listener(job_channel(job_id), lambda *a: heard.append(a[3]))
            job = await store.claim(TOOL, "test-owner", 60)
            assert str(job.id) == job_id
            waiter = _waiter(dsn, job_id, "--timeout", "60s")
            await asyncio.to_thread(_waiter_listening, dsn)
            transaction = ender.transaction()
            await transaction.start()
            ended = await ender.fetchrow(
                Q["finish_job_if_owner"], job.id, "test-owner", job.fencing_token,
                JobState.SUCCEEDED, RawJson('{"rolled": "back"}'), None, "job_succeeded", {},
                None, None, None, None, None, None)
            assert ended is not None  # the statement did end the job, in the transaction
            await transaction.rollback()
            await asyncio.sleep(1.5)
            assert heard == [] and waiter.poll() is None
            assert (await asyncio.to_thread(job_row, dsn, job_id))["state"] == "running"

            assert await store.finish_if_owner(job, "test-owner", JobState.SUCCEEDED,
                                               RawJson('{"ok": 1}'), None, "job_succeeded", {})
            code, out, err = await asyncio.to_thread(_finish, waiter)
            assert code == 0, err.decode()
            assert _lines(out) == [{"id": job_id, "state": "succeeded", "result": {"ok": 1},
                                    "attempt": 1}]
            await asyncio.sleep(0.2)
            assert [json.loads(p) for p in heard] == [{"id": job_id, "state": "succeeded"}]
        finally:
            if waiter is not None:
                stop_process(waiter, 5)
            await listener.close()
            await ender.close()
            await store.pool.close()

    asyncio.run(main())


def test_a_waiter_hears_its_own_job_only(dsn, sidecars):
    """One notification per end, on the job's own channel: a waiter on job A hears nothing
    of job B's end (counted on its connection), and one notification for A's."""
    a = enqueue(dsn, "nobody-runs-this", {})
    b = enqueue(dsn, TOOL, {"steps": []})

    async def main():
        listener = await db.connect(dsn, 10)
        heard: dict[str, list[str]] = {a: [], b: []}
        waiter = None
        try:
            for job_id in (a, b):
                await listener.add_listener(job_channel(job_id),
                                            lambda *args, j=job_id: heard[j].append(args[3]))
            channel = await asyncio.to_thread(query, dsn, "SELECT tool_job_channel($1::uuid)", a)
            assert channel[0][0] == job_channel(a)
            waiter = _waiter(dsn, a, "--timeout", "60s")
            await asyncio.to_thread(_waiter_listening, dsn)
            sidecars(dsn, COMMAND, "--tool", TOOL)
            await asyncio.to_thread(wait_until, lambda: job_row(dsn, b)["state"] == "succeeded",
                                    30, 0.05, "job B to succeed")
            await asyncio.sleep(1.0)
            assert heard[a] == [] and waiter.poll() is None
            assert [json.loads(p) for p in heard[b]] == [{"id": b, "state": "succeeded"}]
            assert (await asyncio.to_thread(cli, dsn, "cancel", a)).returncode == 0
            code, out, _ = await asyncio.to_thread(_finish, waiter)
            assert code == 3 and _lines(out)[0]["state"] == "cancelled"
            await asyncio.sleep(0.2)
            assert [json.loads(p) for p in heard[a]] == [{"id": a, "state": "cancelled"}]
        finally:
            if waiter is not None:
                stop_process(waiter, 5)
            await listener.close()

    asyncio.run(main())


def test_wait_behind_pgbouncer_polls_and_returns(dsn, bouncer, sidecars):
    bdsn = bouncer.dsn_for(dsn)
    env = base_env(bdsn, SIDECAR_DATABASE_POOLER="transaction")
    job_id = enqueue(dsn, TOOL, {"steps": [{"http": {"progress": 0.5}}, {"sleep": 1.5}]})
    waiter = _waiter(bdsn, job_id, "--progress", "--timeout", "60s", env=env)
    try:
        time.sleep(1.0)
        sidecars(dsn, COMMAND, "--tool", TOOL)
        code, out, err = _finish(waiter, 60)
    finally:
        stop_process(waiter, 5)
    assert code == 0, err.decode()
    assert _lines(out)[0]["state"] == "succeeded"
    events = [line for line in _lines(err) if "event" in line]
    assert [e["event"] for e in events] == ["listen_disabled"]
    assert "every 1 s" in events[0]["reason"]
    # The tool's report; a waiting line (the job waited for a sidecar: "waiting" set,
    # "progress" null) may come first on a loaded machine.
    assert [line["progress"] for line in _lines(err)
            if "progress" in line and not line.get("waiting")] == [0.5]


# --- progress --------------------------------------------------------------------------------

def test_progress_over_http_and_file_reaches_row_show_journal_and_waiter(dsn, sidecars,
                                                                         tmp_path):
    release = tmp_path / "release"
    job_id = enqueue(dsn, TOOL, {"steps": [
        {"http": {"progress": 0.25, "message": "http step"}}, {"sleep": 1.2},
        {"file": {"progress": 0.75, "message": "file step"}},
        {"wait_for": str(release)}]})
    waiter = _waiter(dsn, job_id, "--progress", "--timeout", "60s")
    try:
        _waiter_listening(dsn)
        sidecars(dsn, COMMAND, "--tool", TOOL)
        wait_until(lambda: (job_row(dsn, job_id)["progress"] or {}).get("value") == 0.75, 20,
                   what="the file's progress on the row")
        shown = orjson.loads(cli(dsn, "show", job_id).stdout)
        assert shown["progress"]["message"] == "file step" and shown["progress"]["attempt"] == 1
        first = journal_details(dsn, job_id, "job_progress")[0]
        assert (first["value"], first["message"], first["source"]) == (0.25, "http step", "http")
        release.touch()
        code, out, err = _finish(waiter)
    finally:
        stop_process(waiter, 5)
    assert code == 0, err.decode()
    assert _lines(out)[0]["result"] == {"done": True, "statuses": [200]}
    # (a line saying why the job waits, "waiting", may come before the sidecar is up)
    reports = [line for line in _lines(err) if "progress" in line and "waiting" not in line]
    assert [(r["id"], r["progress"], r["message"]) for r in reports] == [
        (job_id, 0.25, "http step"), (job_id, 0.75, "file step")]


def test_progress_file_reaches_row_and_waiter_long_before_the_next_heartbeat(dsn, sidecars,
                                                                              tmp_path):
    """Issue 41 point 10: SIDECAR_PROGRESS_FILE was read once per heartbeat period (30 s
    by default), so an 8-second tool that rewrote it four times reported nothing. With the
    heartbeat at 30 s, each rewrite reaches the row and a waiting caller within about a
    second (the file's own timer, progress.FILE_SECONDS), well before any heartbeat."""
    release = tmp_path / "release"
    job_id = enqueue(dsn, TOOL, {"steps": [
        {"file": {"progress": 0.25, "message": "first"}}, {"sleep": 1.5},
        {"file": {"progress": 0.5, "message": "second"}},
        {"wait_for": str(release)}]})
    env = base_env(dsn, SIDECAR_HEARTBEAT_SECONDS="30", SIDECAR_LEASE_SECONDS="120")
    waiter = _waiter(dsn, job_id, "--progress", "--timeout", "60s")
    try:
        _waiter_listening(dsn)
        sc = sidecars(dsn, COMMAND, "--tool", TOOL, env=env)
        started = sc.wait_event("tool_request_started", 20, job_id=job_id)
        assert started
        # Both reports arrive well inside the first heartbeat period (30 s): bounded at
        # 10 s here, a third of it, so only a timer of the file's own can pass.
        wait_until(lambda: (job_row(dsn, job_id)["progress"] or {}).get("value") == 0.5, 10,
                   what="the file's second report on the row, before any heartbeat")
        assert job_row(dsn, job_id)["progress"]["message"] == "second"
        release.touch()
        code, out, err = _finish(waiter)
    finally:
        stop_process(waiter, 5)
    assert code == 0, err.decode()
    reports = [line for line in _lines(err) if "progress" in line]
    assert [(r["progress"], r["message"]) for r in reports] == [(0.25, "first"),
                                                                 (0.5, "second")]
    assert {d["source"] for d in journal_details(dsn, job_id, "job_progress")} == {"file"}


def test_progress_of_a_stale_attempt_is_refused_and_not_stored(dsn, sidecars, tmp_path):
    # The fenced statement itself: the attempt whose token was superseded writes nothing.
    job_id = enqueue(dsn, "stale", {})

    async def fenced():
        store = await _store(dsn)
        try:
            old = await store.claim("stale", "owner-a", 60)
            await asyncio.to_thread(query, dsn, "UPDATE tool_jobs SET lease_until = now() - "
                                    "interval '1 second'")
            new = await store.claim("stale", "owner-b", 60)
            assert new.fencing_token == old.fencing_token + 1
            report = {"value": 0.5, "message": "old"}
            assert not await store.report_progress_if_owner(old, "owner-a", report, {}, True)
            assert (await asyncio.to_thread(job_row, dsn, job_id))["progress"] is None
            assert await asyncio.to_thread(journal_details, dsn, job_id, "job_progress") == []
            assert await store.report_progress_if_owner(new, "owner-b", report, {}, True)
            row = await asyncio.to_thread(job_row, dsn, job_id)
            assert row["progress"]["attempt"] == new.attempt
        finally:
            await store.pool.close()

    asyncio.run(fenced())

    # Over the guard: a tool whose job was taken over gets 409, and nothing is stored.
    info = tmp_path / "info.json"
    taken = enqueue(dsn, TOOL, {"info": str(info), "steps": [{"sleep": 30}]})
    sidecars(dsn, COMMAND, "--tool", TOOL)
    wait_until(info.exists, 20, what="the tool's guard info")
    guard = json.loads(info.read_text())
    query(dsn, "UPDATE tool_jobs SET owner_id = 'someone-else', "
               "fencing_token = fencing_token + 1, lease_until = now() + interval '1 minute' "
               "WHERE id = $1::uuid", taken)
    status, answer = _post_progress(guard, {"progress": 0.9})
    assert (status, answer) == (409, {"reason": "lease_lost"})
    assert job_row(dsn, taken)["progress"] is None


def _post_progress(guard: dict, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(guard["url"] + "/v1/progress", data=data, method="POST",
                                     headers={"Authorization": "Bearer " + guard["token"]})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_bad_progress_reports_get_one_clear_4xx(dsn, sidecars, tmp_path):
    info = tmp_path / "info.json"
    job_id = enqueue(dsn, TOOL, {"info": str(info), "steps": [{"sleep": 30}]})
    sidecars(dsn, COMMAND, "--tool", TOOL)
    wait_until(info.exists, 20, what="the tool's guard info")
    guard = json.loads(info.read_text())
    for body, error in ((b"{", "bad_json"), (b"[0.5]", "bad_request"),
                        ({"progress": 1.5}, "bad_request"), ({"progress": True}, "bad_request"),
                        ({"progress": "half"}, "bad_request"),
                        ({"message": "x" * 1001}, "bad_request"),
                        ({"message": "two\nlines"}, "bad_request"),
                        ({"percent": 50}, "bad_request")):
        status, answer = _post_progress(guard, body)
        assert (status, answer["error"]) == (400, error), body
        assert answer["message"]
    status, answer = _post_progress(guard, b" " * 5000)
    assert (status, answer) == (413, {"error": "body_too_large", "limit": 4096})
    assert _post_progress({**guard, "token": "wrong"}, {"progress": 0.1})[0] == 401
    assert job_row(dsn, job_id)["progress"] is None
    assert _post_progress(guard, {"progress": 1, "message": "all"}) == (200, {"stored": True})
    assert job_row(dsn, job_id)["progress"]["value"] == 1.0


def test_progress_journal_is_throttled_and_the_latest_report_wins(dsn, sidecars):
    steps = []
    for n in range(1, 26):
        steps += [{"http": {"progress": n / 25, "message": f"step {n}"}}, {"sleep": 0.1}]
    job_id = enqueue(dsn, TOOL, {"steps": [*steps, {"sleep": 1.5}]})
    sidecars(dsn, COMMAND, "--tool", TOOL)
    wait_until(lambda: job_row(dsn, job_id)["state"] == "succeeded", 60, what="the job")
    row = job_row(dsn, job_id)
    statuses = row["result"]["statuses"]
    assert len(statuses) == 25 and set(statuses) == {200, 202}
    # Written at most once a second (the rest kept, the latest written then), journaled at
    # most every 5 s: about 3 s of reports make one or two rows, not 25.
    assert 1 <= len(journal_details(dsn, job_id, "job_progress")) <= 2
    assert (row["progress"]["value"], row["progress"]["message"]) == (1.0, "step 25")


def test_progress_resets_the_idle_watchdog(dsn, sidecars, tmp_path):
    """A tool silent on stdout, with no CPU time or I/O, is killed at IDLE_TIMEOUT_SECONDS
    (2 s); the same tool whose progress is reported every half second lives to its end."""
    silent_info, reported_info = tmp_path / "silent.json", tmp_path / "reported.json"
    silent = enqueue(dsn, TOOL, {"info": str(silent_info), "steps": [{"sleep": 6}]},
                     "--max-attempts", "1")
    reported = enqueue(dsn, TOOL, {"info": str(reported_info), "steps": [{"sleep": 6}]},
                       "--max-attempts", "1")
    env = base_env(dsn, SIDECAR_PROFILE_PT_IDLE_TIMEOUT_SECONDS="2",
                   SIDECAR_PROFILE_PT_STAGE_TIMEOUT_SECONDS="60")
    sidecars(dsn, COMMAND, "--tool", TOOL, "--concurrency", "2", env=env)
    wait_until(reported_info.exists, 20, what="the tool's guard info")
    guard = json.loads(reported_info.read_text())
    deadline = time.monotonic() + 30
    n = 0
    while job_row(dsn, reported)["state"] == "running" and time.monotonic() < deadline:
        n += 1
        _post_progress(guard, {"progress": min(n / 20, 1), "message": f"tick {n}"})
        time.sleep(0.5)
    wait_until(lambda: job_row(dsn, silent)["state"] == "failed", 30, what="the silent job")
    assert job_row(dsn, silent)["error"]["kind"] == "idle_timeout"
    row = job_row(dsn, reported)
    assert row["state"] == "succeeded", row["error"]
    assert row["progress"]["message"].startswith("tick")


def test_progress_file_that_is_a_symlink_is_refused(dsn, sidecars, tmp_path):
    """SIDECAR_PROGRESS_FILE is read without following links: a link to a file with a valid
    report stores nothing and is logged once."""
    target = tmp_path / "elsewhere.json"
    target.write_text('{"progress": 0.5}')
    info = tmp_path / "info.json"
    job_id = enqueue(dsn, TOOL, {"info": str(info), "steps": [{"sleep": 3}]})
    proc = sidecars(dsn, COMMAND, "--tool", TOOL)
    wait_until(info.exists, 20, what="the tool's guard info")
    Path(json.loads(info.read_text())["file"]).symlink_to(target)
    event = proc.wait_event("progress_file_refused", job_id=job_id)
    assert "symlink" in event["reason"]
    wait_until(lambda: job_row(dsn, job_id)["state"] == "succeeded", 30, what="the job")
    assert job_row(dsn, job_id)["progress"] is None
