"""Agent sessions (issue 43, point 3; docs/callers.md "Sessions"): a caller names a
session when it enqueues; the calls of one session run one at a time, in order, in one
warm process that keeps its state, held by one sidecar under a session lease; a call
whose session ended or was lost fails ``session_lost`` unless SESSION_RESTART=fresh.
Real `sidecar run` processes, a real PostgreSQL and a real warm tool
(tests/tools/warm_tool.py: it counts the calls it served and echoes the session)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    free_port,
    job_row,
    journal_details,
    one_line_error,
    parse_events,
    pid_alive,
    query,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.e2e

WARM_TOOL = [sys.executable, str(TOOLS / "warm_tool.py")]


def _env(dsn, **extra):
    return base_env(dsn, **{"SIDECAR_PROCESS": "warm", "SIDECAR_STAGE_TIMEOUT_SECONDS": "3",
                            **extra})


def _call(dsn, env, session, mode="count", tool="warm", **payload):
    extra = ("--session", session) if session is not None else ()
    return enqueue(dsn, tool, {"mode": mode, **payload}, "--max-attempts", "1", *extra,
                   env=env)


def _ended(dsn, job, timeout=30):
    wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed", "cancelled"),
               timeout, what=f"job {job} to end")
    return job_row(dsn, job)


def _session(dsn, key, tool="warm"):
    rows = query(dsn, "SELECT * FROM tool_sessions WHERE tool = $1 AND session_key = $2",
                 tool, key)
    return dict(rows[0]) if rows else None


def test_the_calls_of_a_session_run_in_order_in_one_process_that_keeps_its_state(dsn):
    """Three calls of s1, two of s2 and one without a session, drained by one sidecar with
    two slots: s1's calls are served 1, 2, 3 by one process, s2's 1, 2 by another, the
    call without a session by neither; each request carried its session; s1's calls were
    claimed in the order they were enqueued, never two at once; the sessions end with the
    sidecar (ended, shutdown)."""
    env = _env(dsn)
    s1 = [_call(dsn, env, "s1") for _ in range(3)]
    s2 = [_call(dsn, env, "s2") for _ in range(2)]
    plain = _call(dsn, env, None)
    done = cli(dsn, "run", "--tool", "warm", "--drain", "--concurrency", "2", "--",
               *WARM_TOOL, env=env, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    r1 = [job_row(dsn, job)["result"] for job in s1]
    r2 = [job_row(dsn, job)["result"] for job in s2]
    rp = job_row(dsn, plain)["result"]
    assert [r["served"] for r in r1] == [1, 2, 3] and len({r["pid"] for r in r1}) == 1
    assert [r["served"] for r in r2] == [1, 2] and len({r["pid"] for r in r2}) == 1
    assert len({r1[0]["pid"], r2[0]["pid"], rp["pid"]}) == 3
    assert {r["session"] for r in r1} == {"s1"} and rp["session"] is None
    spans = [(job_row(dsn, job)["claimed_at"], job_row(dsn, job)["finished_at"]) for job in s1]
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)), spans
    for key, calls in (("s1", 3), ("s2", 2)):
        row = _session(dsn, key)
        assert (row["state"], row["end_reason"], row["calls"], row["generation"]) == \
            ("ended", "shutdown", calls, 1), row
    events = parse_events(done.stderr)
    assert sorted(e["session"] for e in events if e["event"] == "session_started") == \
        ["s1", "s2"]


def test_a_hung_call_kills_its_sessions_process_and_the_next_call_fails_session_lost(
        dsn, sidecars):
    """Call 1 of s1 answers; call 2 hangs past its stage deadline: its process tree is
    killed and the session is lost. Call 3 does not run in a fresh process: it fails
    session_lost at once, saying why, and no request of it reached any process."""
    env = _env(dsn)
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "s1"))
    assert first["state"] == "succeeded"
    pid = first["result"]["pid"]
    hung = _ended(dsn, _call(dsn, env, "s1", "hang"))
    assert hung["error"]["kind"] == "stage_timeout", hung["error"]
    wait_until(lambda: not pid_alive(pid), 10, what="the session's process to be gone")
    wait_until(lambda: _session(dsn, "s1")["state"] == "lost", 10, what="the session lost")
    third = _ended(dsn, _call(dsn, env, "s1"))
    assert third["state"] == "failed" and third["attempt"] == 1, third
    assert third["error"]["kind"] == "session_lost", third["error"]
    assert "'s1'" in third["error"]["message"] and "SESSION_RESTART" in third["error"]["message"]
    assert not journal_details(dsn, third["id"], "tool_request_started")
    assert sc.wait_event("session_lost", 5)["session"] == "s1"


def test_session_restart_fresh_starts_a_lost_session_again_in_a_new_process(dsn, sidecars):
    """SESSION_RESTART=fresh: after the hung call, the next call of s1 starts the session
    again (generation 2) in a new process whose count starts at 1; the journal says so."""
    env = _env(dsn, SIDECAR_SESSION_RESTART="fresh")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "s1"))
    _ended(dsn, _call(dsn, env, "s1", "hang"))
    again = _ended(dsn, _call(dsn, env, "s1"))
    assert again["state"] == "succeeded", again["error"]
    assert again["result"]["served"] == 1 and again["result"]["pid"] != first["result"]["pid"]
    started = journal_details(dsn, again["id"], "session_started")
    assert started and started[0]["restarted"] is True and started[0]["generation"] == 2
    row = _session(dsn, "s1")
    assert (row["state"], row["generation"]) == ("live", 2)


def test_another_sidecar_never_claims_the_calls_of_a_session_it_does_not_hold(dsn, sidecars):
    """Two sidecars of the tool. The session is started by whichever claims its first call;
    every later call of it runs there, in the same process (count 2..5), while the other
    sidecar, idle, claims none of them but does claim a call without a session."""
    env = _env(dsn)
    a = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    b = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    a.wait_event("worker_started", 30)
    b.wait_event("worker_started", 30)
    first = _ended(dsn, _call(dsn, env, "s1"))
    owner = first["owner_id"]
    later = [_call(dsn, env, "s1") for _ in range(4)]
    rows = [_ended(dsn, job) for job in later]
    assert {row["owner_id"] for row in rows} == {owner}
    assert [row["result"]["served"] for row in rows] == [2, 3, 4, 5]
    assert {row["result"]["pid"] for row in rows} == {first["result"]["pid"]}
    assert _session(dsn, "s1")["owner_id"] == owner
    listed = cli(dsn, "sessions", "--tool", "warm", env=env)
    assert listed.returncode == 0, listed.stderr.decode()
    [live] = [orjson.loads(line) for line in listed.stdout.splitlines()]
    assert (live["session_key"], live["owner_id"], live["calls"], live["generation"]) == \
        ("s1", owner, 5, 1) and live["lease_remaining"] > 0
    shown = orjson.loads(cli(dsn, "show", later[-1], env=env).stdout)
    assert shown["session_key"] == "s1" and shown["session"]["state"] == "live"


def test_a_sidecar_killed_mid_call_leaves_no_process_and_the_call_is_not_run_twice(
        dsn, sidecars, tmp_path):
    """Sidecar A runs call 2 of s1 (it marks a file, then works for a while) and is
    SIGKILLed. Its guardian kills the session's process tree. Sidecar B takes the call
    over once A's lease ends: the session is lost with A, so the call fails session_lost
    instead of running again in a fresh process (the mark file has one line), and B
    starts no process for it."""
    env = _env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    a = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "s1"))
    pid = first["result"]["pid"]
    mark = tmp_path / "mark"
    job = enqueue(dsn, "warm", {"mode": "slow", "mark": str(mark), "seconds": 30},
                  "--max-attempts", "3", "--session", "s1", env=env)
    wait_until(lambda: mark.exists() and mark.read_text().strip(), 15, what="the call to run")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    wait_until(lambda: not pid_alive(pid), 15, what="the session's process to be gone")
    b = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    row = _ended(dsn, job, 60)
    assert row["state"] == "failed" and row["error"]["kind"] == "session_lost", row
    assert mark.read_text().splitlines() == [job]
    assert b.wait_event("session_lost", 5)["session"] == "s1"
    assert not [e for e in b.events("tool_request_started") if e.get("job_id") == job]


def test_an_idle_session_ends_with_its_process_and_a_later_call_fails_session_lost(
        dsn, sidecars):
    """SESSION_IDLE_SECONDS=1: a second after its call the session ends (ended, idle) and
    its process is stopped; the next call fails session_lost naming the idle end."""
    env = _env(dsn, SIDECAR_SESSION_IDLE_SECONDS="1")
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "s1"))
    wait_until(lambda: _session(dsn, "s1")["state"] == "ended", 15, what="the idle end")
    assert _session(dsn, "s1")["end_reason"] == "idle"
    wait_until(lambda: not pid_alive(first["result"]["pid"]), 10, what="its process gone")
    later = _ended(dsn, _call(dsn, env, "s1"))
    assert later["error"]["kind"] == "session_lost" and "idle" in later["error"]["message"]
    assert sc.wait_event("session_ended", 5)["reason"] == "idle"


def test_a_session_of_a_per_job_tool_fails_session_unsupported_and_bad_keys_are_refused(dsn):
    """PROCESS=per-job keeps no process between calls: a call with a session fails at once,
    kind session_unsupported, naming PROCESS=warm. A blank or overlong session is one line
    and exit 2 from the CLI, and a UsageError from the client, with nothing written."""
    env = base_env(dsn)
    job = _call(dsn, env, "s1", tool="perjob")
    done = cli(dsn, "run", "--tool", "perjob", "--drain", "--", *WARM_TOOL, env=env,
               timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    row = job_row(dsn, job)
    assert row["error"]["kind"] == "session_unsupported" and "PROCESS=warm" in \
        row["error"]["message"], row["error"]
    before = query(dsn, "SELECT count(*) AS n FROM tool_jobs")[0]["n"]
    for bad in (" ", "x" * 257, "a\tb"):
        refused = cli(dsn, "enqueue", "warm", "--session", bad, env=env)
        assert refused.returncode == 2 and "--session" in one_line_error(refused)
    assert query(dsn, "SELECT count(*) AS n FROM tool_jobs")[0]["n"] == before

    from sidecar.client import Client
    from sidecar.protocol.errors import UsageError

    async def go():
        with pytest.raises(UsageError, match="session"):
            Client(dsn, session="")
        async with Client(dsn, session="agent-7") as client:
            ref = await client.enqueue("warm", {"mode": "count"})
            other = await client.enqueue("warm", {}, session="agent-8")
        return ref.id, other.id

    ref, other = asyncio.run(go())
    assert job_row(dsn, ref)["session_key"] == "agent-7"
    assert job_row(dsn, other)["session_key"] == "agent-8"


def test_sql_callers_enqueue_into_a_session_in_their_own_transaction(dsn):
    """sidecar_enqueue(..., session_key => ...) from plain SQL: the job carries the
    session; a control character in it is refused with 22023 naming the session."""
    rows = query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, "
                      "session_key => 'sql-run-1') AS id")
    assert job_row(dsn, rows[0]["id"])["session_key"] == "sql-run-1"
    import asyncpg

    with pytest.raises(asyncpg.InvalidParameterValueError, match="session"):
        query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, session_key => E'a\\nb')")


def test_a_sidecar_holds_at_most_max_sessions_and_a_further_session_waits_unspent(
        dsn, sidecars):
    """MAX_SESSIONS=1: while s1 lives, a call of s2 goes back to the queue with its attempt
    unspent (attempt_shortage, errno max_sessions); once s1 ends idle, s2's call runs on
    its first attempt, in a process of its own."""
    env = _env(dsn, SIDECAR_MAX_SESSIONS="1", SIDECAR_SESSION_IDLE_SECONDS="2")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "s1"))
    second = _ended(dsn, _call(dsn, env, "s2"), 60)
    assert second["state"] == "succeeded" and second["attempt"] == 1, second
    assert second["result"]["pid"] != first["result"]["pid"]
    shortages = journal_details(dsn, second["id"], "attempt_shortage")
    assert shortages and {s["errno"] for s in shortages} == {"max_sessions"}
    assert _session(dsn, "s1")["end_reason"] == "idle"


def test_retention_removes_ended_sessions_but_not_live_ones_or_those_with_calls(dsn):
    """`sidecar prune`: an ended session older than the retention goes; a live one, and an
    ended one with a queued call, stay."""
    query(dsn, "INSERT INTO tool_sessions (tool, session_key, state, ended_at, end_reason) "
               "VALUES ('warm', 'old', 'ended', now() - interval '400 days', 'idle'), "
               "('warm', 'waited', 'lost', now() - interval '400 days', 'exited')")
    query(dsn, "INSERT INTO tool_sessions (tool, session_key, state, owner_id, lease_until) "
               "VALUES ('warm', 'live', 'live', 'x', now() + interval '1 hour')")
    _call(dsn, base_env(dsn), "waited")
    done = cli(dsn, "prune", env=base_env(dsn, SIDECAR_RETENTION_SECONDS="3600"))
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["sessions"] == 1
    left = {r["session_key"] for r in query(dsn, "SELECT session_key FROM tool_sessions")}
    assert left == {"waited", "live"}


def test_a_session_whose_process_cannot_start_is_not_left_live(dsn, sidecars, tmp_path):
    """The tool cannot be started (its #! interpreter is missing): the call fails
    spawn_failed, and its session ends lost at once instead of staying live (renewed for
    ever, holding one of MAX_SESSIONS) without a process."""
    env = _env(dsn, SIDECAR_MAX_SESSIONS="1")
    broken = tmp_path / "broken-tool"
    broken.write_text(f"#!{tmp_path / 'no-such-interpreter'}\n")
    broken.chmod(0o755)
    sc = sidecars(dsn, [str(broken)], "--tool", "warm", env=env)
    row = _ended(dsn, _call(dsn, env, "s1"))
    assert row["error"]["kind"] == "spawn_failed", row["error"]
    wait_until(lambda: _session(dsn, "s1")["state"] == "lost", 10, what="the session lost")
    assert sc.wait_event("session_ended", 5)["state"] == "lost"
    # the cap is free again: another session's call is taken (and fails the same way)
    other = _ended(dsn, _call(dsn, env, "s2"))
    assert other["error"]["kind"] == "spawn_failed" and other["attempt"] == 1


def test_the_web_view_shows_live_sessions_and_a_calls_session(dsn, sidecars, tmp_path):
    """`sidecar web`, connected as the web view's own role: /sessions lists the live
    session with its holder and calls, and the call's page says its session."""
    import urllib.request

    from test_roles import _as

    env = _env(dsn)
    sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "agent-web-1"))
    role = f"sidecar_web_{first['id'].hex[:10]}"
    query(dsn, f'CREATE ROLE "{role}" LOGIN')
    web = None
    try:
        assert cli(dsn, "migrate", "--web-role", role).returncode == 0
        port = free_port()
        log = tmp_path / "web.log"
        with open(log, "wb") as out:
            web = subprocess.Popen([sys.executable, "-m", "sidecar", "web", "--listen",
                                    f"127.0.0.1:{port}"], env=base_env(_as(dsn, role)),
                                   stdout=out, stderr=out)
        wait_until(lambda: "web listening on" in log.read_text(errors="replace"), 30,
                   what="sidecar web's ready line")

        def page(path):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as r:
                return r.read().decode()

        listed = page("/sessions?tool=warm")
        assert "agent-web-1" in listed and first["owner_id"] in listed
        assert "no live session" not in listed
        shown = page(f"/jobs/{first['id']}")
        assert 'id="session"' in shown and "agent-web-1: live, generation 1, 1 calls" in shown
    finally:
        if web is not None:
            stop_process(web)
        query(dsn, f'DROP OWNED BY "{role}"')
        query(dsn, f'DROP ROLE "{role}"')
