"""The caller's half of a tool call at enqueue (issue 26, points 3, 4, 6, 7), against a
real PostgreSQL and real sidecars: priority order of claims, run-after, expiry (of a job
never started and of a retried one; a running attempt is not killed), max_attempts from
the claiming profile, tags and the group actions (jobs, cancel and retry --tag), next
stages inheriting tags, the SQL function sidecar_enqueue called from psql, and the trace
context in the tool's environment."""

from __future__ import annotations

import subprocess
import uuid

import asyncpg
import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_row,
    journal_details,
    journal_rows,
    one_line_error,
    pid_alive,
    query,
    read_pids,
    scalar,
    scraped_metric,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.server]

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _drain(dsn, tool, *command, env=None, concurrency=1):
    done = cli(dsn, "run", "--tool", tool, "--concurrency", str(concurrency), "--drain", "--",
               *command, env=env or base_env(dsn), timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def _psql(dsn, sql):
    """Run ``sql`` with psql (stops at the first error); the finished process."""
    return subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-d", dsn],
                          input=("\\set VERBOSITY verbose\n" + sql).encode(),
                          capture_output=True, timeout=60)


def test_claims_take_priority_0_first_then_the_oldest(dsn):
    ids = {}
    for name, priority in (("late-low", "9"), ("first-mid", "5"), ("top-1", "0"),
                           ("second-mid", "5"), ("top-2", None)):
        extra = ["--priority", priority] if priority is not None else []
        ids[name] = enqueue(dsn, "cat", {"name": name}, *extra)
    assert job_row(dsn, ids["top-2"])["priority"] == 0  # the default
    _drain(dsn, "cat", "cat")
    order = [r["payload"]["name"] for r in query(
        dsn, "SELECT payload FROM tool_jobs ORDER BY first_claimed_at")]
    assert order == ["top-1", "top-2", "first-mid", "second-mid", "late-low"]


def test_a_job_is_not_claimed_before_its_run_after(dsn, sidecars):
    later = enqueue(dsn, "cat", {"n": 1}, "--run-after", "2s")
    at = scalar(dsn, "SELECT (now() + interval '3 seconds')::timestamptz")
    at_time = enqueue(dsn, "cat", {"n": 2}, "--run-after", at.isoformat())
    now = enqueue(dsn, "cat", {"n": 3})
    sidecars(dsn, ["cat"], "--tool", "cat")
    wait_until(lambda: all(job_row(dsn, j)["state"] == "succeeded"
                           for j in (later, at_time, now)), 30, what="the three jobs")
    for job in (later, at_time):
        row = job_row(dsn, job)
        assert row["first_claimed_at"] >= row["run_after"] > row["created_at"]
    assert job_row(dsn, at_time)["run_after"] == at
    [details] = journal_details(dsn, later, "job_enqueued")
    assert "run_after" in details


def test_a_job_never_started_before_its_expiry_ends_failed_expired(dsn, sidecars):
    """No sidecar of the tool runs: a sidecar of any other tool ends it, journals it and
    counts it."""
    job = enqueue(dsn, "nobody-runs-this", {}, "--expires-in", "1s")
    other = sidecars(dsn, ["cat"], "--tool", "cat")
    wait_until(lambda: job_row(dsn, job)["state"] == "failed", 20, what="the expiry")
    row = job_row(dsn, job)
    assert row["error"]["kind"] == "expired" and row["attempt"] == 0
    [details] = journal_details(dsn, job, "job_expired")
    assert details["previous_state"] == "queued" and details["attempts"] == 0
    addr = other.wait_event("worker_started")["http_addr"]
    assert scraped_metric(f"http://{addr}", "sidecar_jobs_expired_total",
                          tool="nobody-runs-this") == 1
    other.wait_event("job_expired", job_id=job)


@pytest.mark.parametrize("how", ["enqueue --wait", "wait", "show"])
def test_with_every_sidecar_down_a_read_settles_a_job_past_its_expiry(dsn, how):
    """Issue 41, point 13: the outage expiry is for. No sidecar runs at all, so no sweep:
    the waiter (`enqueue --wait`, `wait`, whose timer wakes it at the expiry) and `show`
    (any read of a job for a caller) end a queued job past its expiry failed/expired,
    journaled as the sweep journals it; the wait ends 3 (`expired`), not 4 (timeout)."""
    if how == "enqueue --wait":
        done = cli(dsn, "enqueue", "nobody-runs-this", "--payload", "{}", "--expires-in",
                   "1s", "--wait", "--timeout", "20")
        job = None
    else:
        job = enqueue(dsn, "nobody-runs-this", {}, "--expires-in", "1s")
        if how == "wait":
            done = cli(dsn, "wait", job, "--timeout", "20")
        else:
            wait_until(lambda: scalar(dsn, "SELECT expires_at <= now() FROM tool_jobs "
                                           "WHERE id = $1", job), 10, what="the expiry")
            done = cli(dsn, "show", job)
    if how != "show":
        assert done.returncode == 3, (done.returncode, done.stderr.decode())
        assert "expired" in done.stderr.decode() + done.stdout.decode()
    else:
        assert done.returncode == 0, done.stderr.decode()
        shown = orjson.loads(done.stdout)
        assert (shown["state"], shown["error"]["kind"]) == ("failed", "expired"), shown
    [row] = query(dsn, "SELECT id::text, state, error, attempt FROM tool_jobs")
    assert (row["state"], row["error"]["kind"], row["attempt"]) == ("failed", "expired", 0)
    [details] = journal_details(dsn, job or row["id"], "job_expired")
    assert details["previous_state"] == "queued" and details["attempts"] == 0


def test_a_retry_that_would_start_after_the_expiry_ends_failed_expired(dsn, tmp_path):
    """A tool that always fails retryably, many attempts allowed: attempts run until the
    expiry, none starts after it, and the job ends expired instead of retrying on."""
    job = enqueue(dsn, "counter", {"log": str(tmp_path / "runs"), "exit": 1},
                  "--expires-in", "2s", "--max-attempts", "1000")
    env = base_env(dsn)
    _drain(dsn, "counter", str(TOOLS / "run_counter.py"), env=env)
    row = job_row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "expired", row["error"]
    assert row["attempt"] >= 2  # retried at least once before the expiry
    assert journal_details(dsn, job, "job_retry_scheduled")
    claims = journal_rows(dsn, job, "job_claimed")
    assert claims and all(c["at"] < row["expires_at"] for c in claims)
    assert len((tmp_path / "runs").read_text().split()) == row["attempt"]


def test_a_running_attempt_is_not_killed_by_the_expiry(dsn, tmp_path):
    # The expiry leaves the sidecar 3 s to start and claim (a loaded machine is slow to
    # start one); the attempt then outlives it.
    job = enqueue(dsn, "slow", {"seconds": 5, "pidfile": str(tmp_path / "pids")},
                  "--expires-in", "3s")
    _drain(dsn, "slow", str(TOOLS / "fault_sleep.py"))
    row = job_row(dsn, job)
    assert row["state"] == "succeeded" and row["finished_at"] > row["expires_at"]
    assert not journal_details(dsn, job, "job_expired")


def test_max_attempts_comes_from_the_claiming_profile_unless_given_at_enqueue(dsn, tmp_path):
    env = base_env(dsn, SIDECAR_PROFILE_COUNTER_MAX_ATTEMPTS="2")
    default = enqueue(dsn, "counter", {"log": str(tmp_path / "a"), "exit": 1})
    given = enqueue(dsn, "counter", {"log": str(tmp_path / "b"), "exit": 1},
                    "--max-attempts", "1")
    assert job_row(dsn, default)["max_attempts"] is None  # not decided at enqueue
    _drain(dsn, "counter", str(TOOLS / "run_counter.py"), env=env)
    first, second = job_row(dsn, default), job_row(dsn, given)
    assert (first["state"], first["max_attempts"], first["attempt"]) == ("failed", 2, 2)
    assert (second["state"], second["max_attempts"], second["attempt"]) == ("failed", 1, 1)


def test_cancel_by_tag_kills_running_trees_and_cancels_queued_jobs(dsn, sidecars, tmp_path):
    running = [enqueue(dsn, "hang_tree.py", {"pidfile": str(tmp_path / f"p{i}"), "tree": True},
                       "--tag", "run=r1", "--tag", "agent=a") for i in range(2)]
    queued = enqueue(dsn, "hang_tree.py", {"pidfile": str(tmp_path / "p2")}, "--tag", "run=r1")
    other = enqueue(dsn, "cat", {}, "--tag", "run=r2")
    sidecars(dsn, ["hang_tree.py"], "--concurrency", "2")
    pids = [pid for i in range(2) for pid in read_pids(tmp_path / f"p{i}", 4)]
    assert job_row(dsn, queued)["state"] == "queued"

    listed = cli(dsn, "jobs", "--tag", "run=r1", "--tag", "agent=a")
    assert listed.returncode == 0
    assert sorted(line.split()[0] for line in listed.stdout.decode().splitlines()) == \
        sorted(running)

    done = cli(dsn, "cancel", "--tag", "run=r1")
    assert done.returncode == 0, done.stderr.decode()
    out = orjson.loads(done.stdout)
    assert sorted(out["cancelled"]) == sorted([*running, queued]) and out["count"] == 3
    assert out["previous_states"] == {"queued": 1, "running": 2}
    wait_until(lambda: not any(pid_alive(p) for p in pids), 15, what="the trees to die")
    assert all(job_row(dsn, j)["state"] == "cancelled" for j in [*running, queued])
    assert job_row(dsn, other)["state"] == "queued"  # another tag: untouched
    nothing = cli(dsn, "cancel", "--tag", "run=none")
    assert nothing.returncode == 0 and orjson.loads(nothing.stdout)["count"] == 0

    again = cli(dsn, "retry", "--tag", "run=r1")  # waits for the owners' acknowledgement
    assert again.returncode == 0, again.stderr.decode()
    assert sorted(orjson.loads(again.stdout)["retried"]) == sorted([*running, queued])
    assert all(job_row(dsn, j)["state"] in ("queued", "running") for j in [*running, queued])
    assert orjson.loads(cli(dsn, "cancel", "--tag", "run=r1").stdout)["count"] == 3


@pytest.mark.parametrize("args, why", [
    (["cancel"], "JOB_ID, or --tag"),
    (["cancel", str(uuid.uuid4()), "--tag", "a=b"], "JOB_ID, or --tag"),
    (["cancel", "--tag", "nokey"], "KEY=VALUE"),
    (["jobs", "--tag", "a="], "value"),
    (["retry", "--forwarding", str(uuid.uuid4()), "--tag", "a=b"], "--forwarding"),
])
def test_group_actions_refuse_bad_arguments_in_one_line(dsn, args, why):
    done = cli(dsn, *args)
    assert done.returncode == 2 and why in one_line_error(done, no_stdout=True)


def test_a_next_stage_inherits_tags_priority_and_trace_context(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_FETCH_NEXT_TOOLS="publish")
    parent = enqueue(dsn, "fetch", {"mode": "first", "next": "publish"}, "--tag", "run=r9",
                     "--priority", "3", "--traceparent", TP, "--tracestate", "rojo=1", env=env)
    _drain(dsn, "fetch", "stage_tool.py", env=env)
    [child] = query(dsn, "SELECT * FROM tool_jobs WHERE parent_id = $1", uuid.UUID(parent))
    assert child["tags"] == {"run": "r9"} and child["priority"] == 3
    assert (child["traceparent"], child["tracestate"]) == (TP, "rojo=1")
    [details] = journal_details(dsn, child["id"], "job_enqueued")
    assert details["tags"] == {"run": "r9"} and details["traceparent"] == TP
    # and the group actions reach it
    out = orjson.loads(cli(dsn, "cancel", "--tag", "run=r9").stdout)
    assert out["cancelled"] == [str(child["id"])]


def test_the_tool_gets_the_trace_context_and_show_and_the_journal_have_it(dsn):
    job = enqueue(dsn, "print_env.py", {"exit": 0}, "--traceparent", TP, "--tracestate",
                  "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
    plain = enqueue(dsn, "print_env.py", {"exit": 0})
    _drain(dsn, "print_env.py", "print_env.py")
    env = job_row(dsn, job)["result"]["env"]
    assert env["TRACEPARENT"] == TP
    assert env["TRACESTATE"] == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    assert "TRACEPARENT" not in job_row(dsn, plain)["result"]["env"]
    shown = orjson.loads(cli(dsn, "show", job).stdout)
    assert shown["traceparent"] == TP and shown["tracestate"].startswith("congo=")
    enqueued = next(e for e in shown["events"] if e["event"] == "job_enqueued")
    assert enqueued["details"]["traceparent"] == TP


def test_sidecar_enqueue_from_psql_rolled_back_leaves_nothing_committed_runs(dsn, sidecars):
    """The SQL function in a caller's own transaction: rolled back, no job, no journal, no
    wake-up; committed, the job is there and an idle sidecar, polling only once a minute,
    is woken by the commit and runs it."""
    rolled = _psql(dsn, "BEGIN;\nSELECT sidecar_enqueue('cat', '{\"n\": 1}');\nROLLBACK;\n")
    assert rolled.returncode == 0, rolled.stderr.decode()
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0
    assert scalar(dsn, "SELECT count(*) FROM tool_job_events") == 0

    sc = sidecars(dsn, ["cat"], "--tool", "cat", env=base_env(dsn, SIDECAR_POLL_SECONDS="60"))
    wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars") == 1, 20,
               what="the sidecar to be idle and listening")
    done = _psql(dsn, "BEGIN;\n"
                      "SELECT sidecar_enqueue('cat', '{\"n\": 2}', idempotency_key => 'k-1',\n"
                      "    priority => 2, expires_in => interval '1 hour',\n"
                      "    tags => '{\"run\": \"sql\"}', traceparent => '" + TP + "');\n"
                      "COMMIT;\n")
    assert done.returncode == 0, done.stderr.decode()
    job = done.stdout.decode().strip()
    wait_until(lambda: job_row(dsn, job)["state"] == "succeeded", 15,
               what="the job to run on the commit's wake-up, not the minute's poll")
    row = job_row(dsn, job)
    assert row["result"] == {"n": 2} and row["tags"] == {"run": "sql"}
    assert (row["priority"], row["idempotency_key"], row["max_attempts"]) == (2, "k-1", 3)
    [details] = journal_details(dsn, job, "job_enqueued")
    assert details["by"] == "sidecar_enqueue" and details["traceparent"] == TP
    # the same key again: the same job, none created
    again = _psql(dsn, "SELECT sidecar_enqueue('cat', '{\"n\": 2}', idempotency_key => 'k-1');")
    assert again.stdout.decode().strip() == job
    sc.stop()


def test_psql_enqueues_and_waits_for_the_end_without_polling(dsn, sidecars):
    """Any language, as docs/callers.md says: psql enqueues with sidecar_enqueue and
    LISTENs on the job's channel (tool_job_channel) in the same transaction, so the end
    cannot slip in between; the end arrives as one notification whose payload says
    succeeded, while psql only sleeps (nothing read from tool_jobs)."""
    sidecars(dsn, ["cat"], "--tool", "cat", env=base_env(dsn, SIDECAR_POLL_SECONDS="60"))
    wait_until(lambda: scalar(dsn, "SELECT count(*) FROM tool_idle_sidecars") == 1, 20,
               what="the sidecar to be idle and listening")
    script = ("BEGIN;\n"
              "SELECT sidecar_enqueue('cat', '{\"n\": 7}') AS id \\gset\n"
              "SELECT tool_job_channel(:'id') AS chan \\gset\n"
              "LISTEN :chan;\n"
              "COMMIT;\n"
              "\\echo enqueued :id\n"
              + "SELECT pg_sleep(0.2);\n" * 50)  # 10 s: the end comes within one
    done = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-At", "-d", dsn],
                          input=script.encode(), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    job = out.split("enqueued ", 1)[1].split()[0]
    heard = [line for line in out.splitlines() if line.startswith("Asynchronous notification")]
    assert len(heard) == 1, out[-2000:]
    payload = orjson.loads(heard[0].split(' with payload "', 1)[1].rsplit('" received', 1)[0])
    assert payload == {"id": job, "state": "succeeded"}
    assert job_row(dsn, job)["result"] == {"n": 7}


def test_sidecar_enqueue_refuses_bad_input_with_22023_naming_the_field(dsn):
    done = _psql(dsn, "SELECT sidecar_enqueue('cat', '{}', tags => '{\"run\": 1}');")
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "22023" in err and "tags" in err, err
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0


# (CLI arguments, the SQL function's named arguments): the same bad value, refused by both
# with the field named (CLI: exit 2, one line; SQL: SQLSTATE 22023).
SAME_RULES = [
    (["--priority", "10"], "priority => 10", "priority"),
    (["--max-attempts", "0"], "max_attempts => 0", "max"),
    (["--expires-in", "400d"], "expires_in => interval '400 days'", "expires"),
    (["--run-after", "400d"], "run_after => now() + interval '400 days'", "run"),
    (["--tag", "bad key=1"], "tags => '{\"bad key\": \"1\"}'", "tag"),
    (["--tag", "k=" + "v" * 257], "tags => jsonb_build_object('k', repeat('v', 257))", "tag"),
    ([f"--tag=k{i}=v" for i in range(17)],
     "tags => (SELECT jsonb_object_agg('k' || g, 'v') FROM generate_series(1, 17) g)", "tag"),
    (["--traceparent", "00-xyz"], "traceparent => '00-xyz'", "traceparent"),
    (["--traceparent", TP, "--tracestate", "A=1"], f"traceparent => '{TP}', tracestate => 'A=1'",
     "tracestate"),
    (["--tracestate", "a=1"], "tracestate => 'a=1'", "tracestate"),
    (["--idempotency-key", "x:stage:1"], "idempotency_key => 'x:stage:1'", "stage"),
    (["--run-after", "1h", "--expires-in", "1m"],
     "run_after => now() + interval '1 hour', expires_in => interval '1 minute'", "expire"),
]


@pytest.mark.parametrize("cli_args, sql_args, field", SAME_RULES)
def test_the_cli_and_the_sql_function_refuse_the_same_values(dsn, cli_args, sql_args, field):
    done = cli(dsn, "enqueue", "cat", *cli_args)
    assert done.returncode == 2, done.stderr.decode()
    assert field in one_line_error(done, no_stdout=True).lower()
    with pytest.raises(asyncpg.InvalidParameterValueError, match=field):
        query(dsn, f"SELECT sidecar_enqueue('cat', '{{}}', {sql_args})")
    assert scalar(dsn, "SELECT count(*) FROM tool_jobs") == 0
