"""Hostile tests of agent sessions (issue 43, point 3; docs/callers.md "Sessions").

Section 1: reproducers. Each asserts a promise of the docs (or of the brief: nothing stays
``live`` after its owner is gone, a call of a session stays in its session) and failed on
the code it was written against, because of the defect its docstring names; each is fixed
since (calls ordered by a sequence, the sweep of expired sessions, next stages inherit
the session, idle only without a queued call, a failed start drops its session, the
MAX_SESSIONS place taken before the database is asked, a draining sidecar frees a place)
and the test now guards the fix. Two changed with a decision: the session's process is
named by each call's journal, not by a column; under SESSION_RESTART=fresh an
interrupted call is retried in the new session, as documented.

Section 2: promises attacked that held. They pass, and keep passing guards them.

Real `sidecar run` processes, a real PostgreSQL, the suite's warm tool
(tests/tools/warm_tool.py) or a small warm tool written by the test."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap

import asyncpg
import pytest

from kit import (
    TOOLS,
    _connect,
    base_env,
    cli,
    enqueue,
    job_row,
    journal_details,
    kill_pid,
    pid_alive,
    query,
    wait_until,
)

pytestmark = pytest.mark.e2e

WARM_TOOL = [sys.executable, str(TOOLS / "warm_tool.py")]


def _env(dsn, **extra):
    return base_env(dsn, **{"SIDECAR_PROCESS": "warm", "SIDECAR_STAGE_TIMEOUT_SECONDS": "5",
                            **extra})


def _call(dsn, env, session, mode="count", tool="warm", attempts="1", **payload):
    extra = ("--session", session) if session is not None else ()
    return enqueue(dsn, tool, {"mode": mode, **payload}, "--max-attempts", attempts, *extra,
                   env=env)


def _ended(dsn, job, timeout=30):
    wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed", "cancelled"),
               timeout, what=f"job {job} to end")
    return job_row(dsn, job)


def _session(dsn, key, tool="warm"):
    rows = query(dsn, "SELECT * FROM tool_sessions WHERE tool = $1 AND session_key = $2",
                 tool, key)
    return dict(rows[0]) if rows else None


def _enqueue_in_one_transaction(dsn, session, count):
    """``count`` calls of ``session`` enqueued through sidecar_enqueue one after another in
    ONE caller transaction (a caller's PL/pgSQL loop: the transactional-outbox use the docs
    offer sidecar_enqueue for). Their ids, in the order they were enqueued."""

    async def go():
        conn = await _connect(dsn)
        try:
            async with conn.transaction():
                await conn.execute("CREATE TEMP TABLE enqueued (n int, id uuid) ON COMMIT DROP")
                await conn.execute(f"""
                    DO $$
                    BEGIN
                        FOR i IN 1..{int(count)} LOOP
                            INSERT INTO pg_temp.enqueued VALUES (i, sidecar_enqueue(
                                'warm', jsonb_build_object('mode', 'count', 'n', i),
                                max_attempts => 1, session_key => {_literal(session)}));
                        END LOOP;
                    END $$""")
                rows = await conn.fetch("SELECT id FROM pg_temp.enqueued ORDER BY n")
            return [str(row["id"]) for row in rows]
        finally:
            await conn.close()

    return asyncio.run(go())


def _literal(text):
    return "'" + text.replace("'", "''") + "'"


# ==========================================================================================
# Section 1: reproducers (each FAILS on the current code)
# ==========================================================================================


def test_calls_enqueued_in_one_transaction_run_in_the_order_they_were_enqueued(dsn):
    """Promise 1: "A call of a session is claimed only when ... no older one is queued";
    the calls run in enqueue order. DEFECT: "older" is (created_at, id). created_at is
    now(), the transaction's start, so every call enqueued in one caller transaction has
    the same created_at, and the tie goes to the id, tool_job_new_id(): a millisecond
    timestamp followed by RANDOM bits. Calls enqueued within the same millisecond are
    therefore ordered at random: a later call of the session overtakes an earlier one."""
    env = _env(dsn)
    ids = _enqueue_in_one_transaction(dsn, "agent-tx", 100)
    done = cli(dsn, "run", "--tool", "warm", "--drain", "--concurrency", "1", "--",
               *WARM_TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    rows = [job_row(dsn, job) for job in ids]
    assert {row["state"] for row in rows} == {"succeeded"}, [r["error"] for r in rows]
    assert len({row["result"]["pid"] for row in rows}) == 1
    served = [row["result"]["served"] for row in rows]
    assert served == list(range(1, 101)), (
        f"served in this order (position i ran as call served[i]): {served}")


def test_a_live_session_whose_owner_was_killed_does_not_stay_live_past_its_lease(
        dsn, sidecars):
    """Promise 4: no session stays ``live`` in tool_sessions after its owner is gone for
    longer than its lease. DEFECT: a session is only ever marked lost by
    tool_job_session_begin, i.e. when a later call of the SAME session is claimed. The
    owner is SIGKILLed while its session is idle (the normal state of an agent session
    between calls): with no further call the row stays ``live`` for ever, owner and all,
    with a lease long run out, although another sidecar of the tool is up and polling.
    `sidecar sessions` keeps listing it (its lease_remaining negative), and retention
    (which prunes only ended/lost rows) never removes it."""
    env = _env(dsn)
    a = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "idle-agent"))
    assert first["state"] == "succeeded", first["error"]
    assert _session(dsn, "idle-agent")["state"] == "live"
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    wait_until(lambda: not pid_alive(first["result"]["pid"]), 15,
               what="the session's process to be gone with its sidecar")
    b = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    b.wait_event("worker_started", 30)
    # SIDECAR_LEASE_SECONDS is 3 (FAST_PROFILE): five leases and more
    wait_until(lambda: _session(dsn, "idle-agent")["state"] != "live", 20,
               what="the dead owner's session to stop being live")


def test_a_next_stage_of_a_session_call_stays_in_its_session(dsn, sidecars, tmp_path):
    """Promise (docs/callers.md "Each call is still a job"; point 6 of the brief): a call
    of a session whose result names a next stage of the same tool. DEFECT:
    finish_job_if_owner copies the parent's priority, tags, trace context and
    concurrency key into the next stage, but not its session_key. The next stage runs as a
    plain job: in a pooled warm process without the session's state (its request has no
    "session"), free to run beside or after the session's later calls, and the session
    never sees it. It should inherit the session (or be refused), never silently leave
    it."""
    tool = tmp_path / "staged_tool.py"
    tool.write_text(textwrap.dedent("""\
        import json, os, sys
        served = 0
        for line in sys.stdin:
            request = json.loads(line)
            served += 1
            result = {"pid": os.getpid(), "served": served,
                      "session": request.get("session")}
            answer = {"job_id": request["job_id"], "result": result}
            if (request.get("payload") or {}).get("mode") == "stage1":
                answer["next"] = {"tool": "warm", "payload": {"mode": "stage2"}}
            sys.stdout.write(json.dumps(answer) + "\\n")
            sys.stdout.flush()
        """))
    env = _env(dsn, SIDECAR_NEXT_TOOLS="warm")
    sidecars(dsn, [sys.executable, str(tool)], "--tool", "warm", env=env)
    parent = _ended(dsn, _call(dsn, env, "staged", "stage1"))
    assert parent["state"] == "succeeded", parent["error"]
    assert parent["result"]["session"] == "staged"
    wait_until(lambda: query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1",
                             parent["id"]), 10, what="the next stage")
    [child] = query(dsn, "SELECT id FROM tool_jobs WHERE parent_id = $1", parent["id"])
    stage = _ended(dsn, str(child["id"]))
    assert stage["state"] == "succeeded", stage["error"]
    assert stage["session_key"] == "staged", "the next stage left its session"
    assert stage["result"]["session"] == "staged"
    assert (stage["result"]["pid"], stage["result"]["served"]) == \
        (parent["result"]["pid"], 2), "the next stage ran outside the session's process"


def test_a_session_does_not_end_idle_while_its_next_call_waits_in_the_queue(
        dsn, sidecars, tmp_path):
    """Promise 5: a session ends after SESSION_IDLE_SECONDS *without a call*. DEFECT: the
    idle clock (WarmPool.run_idle, Session.last_used) only knows the calls this sidecar
    has claimed. One slot, SESSION_IDLE_SECONDS=3: call 1 of the session runs; a plain job
    of the tool (8 s) takes the slot; call 2 of the session is enqueued right behind it,
    well within the 3 s. While call 2 waits for the slot the session is ended ``idle``,
    and call 2 then fails session_lost: the agent called in time and loses its state
    because the sidecar was busy with somebody else's work."""
    env = _env(dsn, SIDECAR_SESSION_IDLE_SECONDS="3", SIDECAR_STAGE_TIMEOUT_SECONDS="30")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", "--concurrency", "1", env=env)
    first = _ended(dsn, _call(dsn, env, "busy-agent"))
    assert first["state"] == "succeeded", first["error"]
    mark = tmp_path / "mark"
    plain = _call(dsn, env, None, "slow", mark=str(mark), seconds=8)
    second = _call(dsn, env, "busy-agent")
    enqueued = job_row(dsn, second)["created_at"]
    assert (enqueued - first["finished_at"]).total_seconds() < 3, \
        "premise: call 2 was enqueued within SESSION_IDLE_SECONDS of call 1"
    row = _ended(dsn, second, 60)
    assert job_row(dsn, plain)["state"] == "succeeded"
    assert row["state"] == "succeeded", (row["error"], _session(dsn, "busy-agent"))
    assert row["result"]["served"] == 2 and row["result"]["pid"] == first["result"]["pid"]


def test_a_session_whose_first_process_could_not_start_is_not_held_for_ever(
        dsn, sidecars, tmp_path):
    """Promises 4 and 5: a session's end frees its place under MAX_SESSIONS, and a session
    without a call for SESSION_IDLE_SECONDS ends. DEFECT: in Supervisor._run_warm, when
    the first process of a NEW session cannot be started (SpawnFailed: the tool is not
    executable; likewise SpawnSetupFailed and SpawnShortage), the call ends but the
    Session that _open_session just opened stays in WarmPool.sessions, busy=True with no
    process, for the sidecar's life: run_idle skips busy sessions, the heartbeat renews
    its lease (tool_sessions stays ``live``), and it fills a MAX_SESSIONS place. Here the
    tool is fixed (made executable) right after (it was broken only while the first call
    started): with MAX_SESSIONS=1 no other session can ever start on this sidecar (its
    calls go back to the queue, max_sessions, for ever).
    Only the exception path drops the session; the three typed ones return early."""
    tool = tmp_path / "late_tool.py"
    tool.write_text((TOOLS / "warm_tool.py").read_text().replace(
        "#!/usr/bin/env python3", f"#!{sys.executable}", 1))
    tool.chmod(0o755)
    env = _env(dsn, SIDECAR_MAX_SESSIONS="1", SIDECAR_SESSION_IDLE_SECONDS="1")
    sc = sidecars(dsn, [str(tool)], "--tool", "warm", env=env)
    sc.wait_event("worker_started", 30)
    tool.chmod(0o644)  # not executable for a moment: the spawn fails (126)
    broken = _ended(dsn, _call(dsn, env, "first-agent"))
    assert broken["state"] == "failed" and broken["error"]["kind"] == "spawn_failed", broken
    tool.chmod(0o755)
    other = _call(dsn, env, "second-agent")
    wait_until(lambda: job_row(dsn, other)["state"] in ("succeeded", "failed"), 30,
               what=("a call of another session to run once the first one's start failed "
                     f"(first session: {_session(dsn, 'first-agent')}; "
                     f"max_sessions shortages: {len(sc.events('attempt_shortage'))})"))
    assert job_row(dsn, other)["state"] == "succeeded"
    assert _session(dsn, "first-agent")["state"] != "live"


def test_a_calls_journal_names_the_warm_process_of_its_session(dsn, sidecars):
    """An operator ties a session to its process tree through its calls' journal: each
    call's tool_request_started names the warm process (its SIDECAR_PROCESS_ID), the same
    for every call of the session. (tool_sessions has no process column: the process of
    a session changes only with its generation, and the journal says both.)"""
    env = _env(dsn)
    sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    calls = [_ended(dsn, _call(dsn, env, "named-agent")) for _ in range(2)]
    named = [journal_details(dsn, c["id"], "tool_request_started")[0]["warm"]["process_id"]
             for c in calls]
    assert named == [c["result"]["process"] for c in calls] and len(set(named)) == 1


def test_max_sessions_bounds_the_sessions_held_even_when_two_start_at_once(dsn, sidecars):
    """Promise 5: MAX_SESSIONS bounds the sessions (and so the warm processes) one sidecar
    holds. DEFECT: Supervisor._open_session checks ``len(pool.sessions) >=
    max_sessions`` and only then awaits the database (begin_session); the Session is
    added after the await. Two first calls of two sessions claimed in one batch (two free
    slots) both pass the check before either is added: with MAX_SESSIONS=1 the sidecar
    holds two sessions and two session processes. (Fix: reserve the place before the
    await, e.g. count pending opens, or check again after it.)"""
    env = _env(dsn, SIDECAR_MAX_SESSIONS="1", SIDECAR_SESSION_IDLE_SECONDS="300")
    one = _call(dsn, env, "cap-a")
    two = _call(dsn, env, "cap-b")  # both queued before the sidecar's first claim
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", "--concurrency", "2", env=env)

    def settled():
        states = [job_row(dsn, job)["state"] for job in (one, two)]
        shortages = query(dsn, "SELECT count(*) AS n FROM tool_job_events "
                               "WHERE event = 'attempt_shortage'")[0]["n"]
        return "succeeded" in states and (states.count("succeeded") == 2 or shortages)

    wait_until(settled, 30, what="one call to run and the other to run or wait")
    live = query(dsn, "SELECT session_key FROM tool_sessions WHERE state = 'live' "
                      "AND owner_id = (SELECT owner_id FROM tool_jobs WHERE id = $1)",
                 one if job_row(dsn, one)["state"] == "succeeded" else two)
    assert len(live) <= 1, (f"MAX_SESSIONS=1 but the sidecar holds {len(live)} sessions: "
                            f"{[r['session_key'] for r in live]}; "
                            f"started: {len(sc.events('session_started'))}")


def test_under_session_restart_fresh_an_interrupted_call_is_retried_in_the_new_session(
        dsn, sidecars, tmp_path):
    """docs/callers.md: under SESSION_RESTART=fresh a call interrupted with its session
    (here its owner SIGKILLed mid-call, attempts left) is retried like any job, with the
    same idempotency key, in the session started again (generation 2, a fresh process);
    the journal says so. (Under the default, SESSION_RESTART=lost, it fails
    session_lost and runs once: test_sessions.)"""
    env = _env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="60", SIDECAR_SESSION_RESTART="fresh")
    a = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "restartable"))
    mark = tmp_path / "mark"
    job = enqueue(dsn, "warm", {"mode": "slow", "mark": str(mark), "seconds": 3},
                  "--max-attempts", "3", "--session", "restartable", env=env)
    wait_until(lambda: mark.exists() and mark.read_text().strip(), 15, what="the call to run")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    wait_until(lambda: not pid_alive(first["result"]["pid"]), 15,
               what="the session's process to be gone")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    row = _ended(dsn, job, 90)
    # (its attempt may be given back: killed before its first renewal, F16 counts it as
    # never started)
    assert row["state"] == "succeeded", row
    assert mark.read_text().splitlines() == [job, job]
    assert row["result"]["served"] == 1 and row["result"]["key"] == f"tool-job:{job}"
    started = journal_details(dsn, job, "session_started")
    assert [s["generation"] for s in started] == [2] and started[0]["restarted"] is True


def test_a_drained_batch_does_not_park_a_finished_session_while_another_sessions_call_waits(
        dsn):
    """Promise 5 (MAX_SESSIONS: "the call waits for one to end or for another sidecar")
    with `sidecar run --drain`, the batch mode. DEFECT (liveness): MAX_SESSIONS=1, two
    sessions with one call each. Session A's only call is done and nothing of A is queued,
    yet A keeps the one place until SESSION_IDLE_SECONDS (20 here, 300 by default) runs
    out, while B's call bounces off max_sessions: the batch takes a whole idle period per
    MAX_SESSIONS sessions. A drained sidecar (or any sidecar whose place is wanted) should
    end a session with no queued call instead of making another session's call wait."""
    env = _env(dsn, SIDECAR_MAX_SESSIONS="1", SIDECAR_SESSION_IDLE_SECONDS="20")
    a = _call(dsn, env, "batch-a")
    b = _call(dsn, env, "batch-b")
    done = cli(dsn, "run", "--tool", "warm", "--drain", "--concurrency", "1", "--",
               *WARM_TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert [job_row(dsn, job)["state"] for job in (a, b)] == ["succeeded"] * 2
    first, second = sorted(("batch-a", "batch-b"),
                           key=lambda k: _session(dsn, k)["started_at"])
    assert _session(dsn, first)["end_reason"] != "idle", (
        f"session {first} sat idle for SESSION_IDLE_SECONDS holding the only place while "
        f"{second}'s call waited")


# ==========================================================================================
# Section 2: promises attacked that held (these PASS)
# ==========================================================================================


def test_held_the_same_idempotency_key_with_another_session_is_refused(dsn):
    """Promise 6: the same idempotency key with another session (or with none) is another
    operation: refused (23505), never the existing job handed back."""
    first = query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, idempotency_key => 'op-1', "
                       "session_key => 's-a') AS id")[0]["id"]
    again = query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, idempotency_key => 'op-1', "
                       "session_key => 's-a') AS id")[0]["id"]
    assert again == first
    for other in ("'s-b'", "NULL"):
        with pytest.raises(asyncpg.UniqueViolationError, match="session"):
            query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, idempotency_key => 'op-1', "
                       f"session_key => {other})")
    with pytest.raises(asyncpg.UniqueViolationError, match="session"):
        query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, idempotency_key => 'plain-1')")
        query(dsn, "SELECT sidecar_enqueue('warm', '{}'::jsonb, idempotency_key => 'plain-1', "
                   "session_key => 's-a')")


HOSTILE_KEYS = [
    "agent-ü-日本-🤖",
    "k" * 256,
    "x'); DELETE FROM tool_sessions; --",
    "%s %% \\ ' \" $1",
    "s1 ",  # a trailing blank: another session than "s1"
    "s1",
]


def test_held_hostile_session_keys_are_distinct_sessions_each_in_its_own_process(dsn):
    """Promise 5: unicode, 256 characters, SQL-ish and format-ish keys, "s1" and "s1 ": each
    is its own session, its two calls served 1, 2 by one process, no two sessions sharing
    a process, every key stored as given and every session ended with the sidecar."""
    env = _env(dsn)
    calls = {key: [_call(dsn, env, key) for _ in range(2)] for key in HOSTILE_KEYS}
    done = cli(dsn, "run", "--tool", "warm", "--drain", "--concurrency", "2", "--",
               *WARM_TOOL, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    pids = {}
    for key, jobs in calls.items():
        rows = [job_row(dsn, job) for job in jobs]
        assert [r["state"] for r in rows] == ["succeeded"] * 2, [r["error"] for r in rows]
        assert [r["result"]["served"] for r in rows] == [1, 2], key
        assert {r["result"]["session"] for r in rows} == {key}
        assert len({r["result"]["pid"] for r in rows}) == 1
        pids[key] = rows[0]["result"]["pid"]
        row = _session(dsn, key)
        assert row is not None and (row["state"], row["calls"]) == ("ended", 2), (key, row)
    assert len(set(pids.values())) == len(HOSTILE_KEYS)
    assert query(dsn, "SELECT count(*) AS n FROM tool_sessions")[0]["n"] == len(HOSTILE_KEYS)


def test_held_a_retried_call_is_not_overtaken_by_the_next_call_of_its_session(dsn, sidecars):
    """Promise 1 with retries: call 1 answers an error (exit code 65, made retryable) and is
    requeued with a backoff; call 2, enqueued after it and due at once, does not overtake
    it. Call 1's attempts all run before call 2, in the session's one process."""
    env = _env(dsn, SIDECAR_NON_RETRYABLE_EXIT_CODES="64")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", "--concurrency", "2", env=env)
    warmup = _ended(dsn, _call(dsn, env, "retry-agent"))
    failing = enqueue(dsn, "warm", {"mode": "error"}, "--max-attempts", "3", "--session",
                      "retry-agent", env=env)
    later = _call(dsn, env, "retry-agent")
    bad = _ended(dsn, failing)
    good = _ended(dsn, later)
    assert bad["state"] == "failed" and bad["attempt"] == 3, bad
    assert good["state"] == "succeeded", good["error"]
    assert good["claimed_at"] >= bad["finished_at"]
    # warm-up 1, three attempts of the failing call 2..4, then the later call
    assert good["result"]["served"] == 5 and good["result"]["pid"] == warmup["result"]["pid"]


def test_held_a_session_process_killed_between_calls_fails_the_next_call_session_lost(
        dsn, sidecars):
    """Promise 3: the session's process dies between calls (SIGKILL of the pid its first
    call reported): the next call fails session_lost, never starts a fresh process and
    reaches no tool; the session is lost."""
    env = _env(dsn)
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "fragile"))
    pid = first["result"]["pid"]
    kill_pid(pid)
    wait_until(lambda: not pid_alive(pid), 10, what="the session's process to die")
    later = _ended(dsn, _call(dsn, env, "fragile"))
    assert later["state"] == "failed" and later["error"]["kind"] == "session_lost", later
    assert not [e for e in sc.events("tool_request_started") if e.get("job_id") == later["id"]]
    assert _session(dsn, "fragile")["state"] == "lost"


def test_held_a_cancelled_queued_call_does_not_block_or_reorder_the_later_ones(
        dsn, sidecars, tmp_path):
    """Promise 1 with a cancel: call 2 of three is cancelled while call 1 runs (queued
    then); call 3 runs after call 1, in the same process (served 2), and call 2 never
    ran."""
    env = _env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="30")
    sidecars(dsn, WARM_TOOL, "--tool", "warm", "--concurrency", "2", env=env)
    mark = tmp_path / "mark"
    one = _call(dsn, env, "cancelly", "slow", mark=str(mark), seconds=3)
    two = _call(dsn, env, "cancelly")
    three = _call(dsn, env, "cancelly")
    wait_until(lambda: mark.exists() and mark.read_text().strip(), 15, what="call 1 to run")
    done = cli(dsn, "cancel", two, env=env)
    assert done.returncode == 0, done.stderr.decode()
    rows = [_ended(dsn, job) for job in (one, two, three)]
    assert [r["state"] for r in rows] == ["succeeded", "cancelled", "succeeded"], rows
    assert rows[2]["result"]["served"] == 2
    assert rows[2]["result"]["pid"] == rows[0]["result"]["pid"]
    assert rows[2]["claimed_at"] >= rows[0]["finished_at"]


def test_held_sigterm_while_a_session_call_runs_leaves_no_process_and_no_live_session(
        dsn, sidecars, tmp_path):
    """Promises 3 and 4: SIGTERM while a call of the session runs longer than the drain: the
    sidecar exits, the session's process is gone, the session is not left live, and the
    call is not reported succeeded."""
    env = _env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="60", SIDECAR_DRAIN_SECONDS="1")
    sc = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    first = _ended(dsn, _call(dsn, env, "drained"))
    mark = tmp_path / "mark"
    job = enqueue(dsn, "warm", {"mode": "slow", "mark": str(mark), "seconds": 30},
                  "--max-attempts", "3", "--session", "drained", env=env)
    wait_until(lambda: mark.exists() and mark.read_text().strip(), 15, what="the call to run")
    sc.proc.send_signal(signal.SIGTERM)
    sc.proc.wait(30)
    wait_until(lambda: not pid_alive(first["result"]["pid"]), 10,
               what="the session's process to be gone")
    assert _session(dsn, "drained")["state"] != "live", _session(dsn, "drained")
    assert job_row(dsn, job)["state"] != "succeeded"


def test_held_an_owner_cut_off_from_the_database_loses_its_session_and_the_next_call_fails(
        dsn, sidecars, proxy):
    """Promise 3, partition: sidecar A (through a proxy) holds the session; the proxy
    blackholes A. A stops the session's process once its lease is no longer known to hold;
    the next call, enqueued during the partition, waits while A's session lease lives,
    then sidecar B takes it and fails it session_lost without running it. After the
    partition heals A runs nothing of the session either."""
    from netproxy import through

    env = _env(dsn)
    side_dsn = through(dsn, proxy.port)
    a = sidecars(side_dsn, WARM_TOOL, "--tool", "warm",
                 env=_env(side_dsn, SIDECAR_DB_TIMEOUT_SECONDS="1"))
    first = _ended(dsn, _call(dsn, env, "cut"))
    assert first["state"] == "succeeded", first["error"]
    b = sidecars(dsn, WARM_TOOL, "--tool", "warm", env=env)
    b.wait_event("worker_started", 30)
    proxy.blackhole()
    try:
        later = _call(dsn, env, "cut")
        row = _ended(dsn, later, 60)
        wait_until(lambda: not pid_alive(first["result"]["pid"]), 30,
                   what="A to stop the session's process while cut off")
    finally:
        proxy.restore()
    assert row["state"] == "failed" and row["error"]["kind"] == "session_lost", row
    assert not [e for e in b.events("tool_request_started") if e.get("job_id") == later]
    assert not [e for e in a.events("tool_request_started") if e.get("job_id") == later]
    assert _session(dsn, "cut")["state"] == "lost"
    third = _ended(dsn, _call(dsn, env, "cut"))
    assert third["error"]["kind"] == "session_lost", third


def test_held_many_sessions_on_two_sidecars_run_each_in_order_one_at_a_time(dsn, sidecars):
    """Promises 1 and 2 under load: two sidecars of two slots each, four sessions of six
    calls each enqueued interleaved with plain calls and mixed priorities. Each session's
    calls run in enqueue order (served 1..6), all in one process of one sidecar, never two
    at once; no session process serves a plain call or another session's."""
    env = _env(dsn)
    calls = {f"load-{n}": [] for n in range(4)}
    plain = []
    for i in range(6):
        for key, jobs in calls.items():
            jobs.append(enqueue(dsn, "warm", {"mode": "count"}, "--max-attempts", "1",
                                "--session", key, "--priority", str((i * 7) % 3), env=env))
        plain.append(_call(dsn, env, None))
    for _ in range(2):
        sidecars(dsn, WARM_TOOL, "--tool", "warm", "--concurrency", "2", env=env)
    session_pids = {}
    for key, jobs in calls.items():
        rows = [_ended(dsn, job, 90) for job in jobs]
        assert [r["state"] for r in rows] == ["succeeded"] * 6, [r["error"] for r in rows]
        assert [r["result"]["served"] for r in rows] == list(range(1, 7)), key
        assert {r["result"]["session"] for r in rows} == {key}
        assert len({r["result"]["pid"] for r in rows}) == 1
        assert len({r["owner_id"] for r in rows}) == 1
        # one at a time: each call's claim was journaled after the previous call's end
        # (event ids: a bigserial taken at insert; claimed_at/finished_at are now(), the
        # start of their transactions, and a claim waiting on the tool's flow lock may
        # have started before the previous call's end committed)
        marks = [query(dsn, "SELECT max(id) FILTER (WHERE event = 'job_claimed') AS claimed, "
                            "max(id) FILTER (WHERE event = 'job_succeeded') AS ended "
                            "FROM tool_job_events WHERE job_id = $1", job)[0] for job in jobs]
        assert all(marks[i]["ended"] < marks[i + 1]["claimed"] for i in range(5)), (key, marks)
        session_pids[key] = rows[0]["result"]["pid"]
    assert len(set(session_pids.values())) == 4
    plain_pids = {_ended(dsn, job, 90)["result"]["pid"] for job in plain}
    assert not plain_pids & set(session_pids.values())
