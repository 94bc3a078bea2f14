"""Issue 44, point 1: a person's yes before an irreversible step, bound to the attempt
that asked.

A tool asks through the guard (``POST /v1/approval {"action", "summary", "details"}``) and
waits, its lease kept, at most APPROVAL_WAIT_SECONDS. An answer names the job, the attempt
and the fencing token it answers (``sidecar approve``, ``Client.approve``); one for an
attempt that no longer owns the job, a second answer, or one past the deadline is refused
and journaled. A denial or no answer in time fails the job (``denied``,
``approval_expired``), whatever the tool prints after.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import asyncpg
import orjson
import pytest
from test_mcp_gateway import gateway  # noqa: F401 - the fixture

from kit import (
    SidecarProcess,
    base_env,
    cli,
    enqueue,
    free_port,
    job_row,
    metric_total,
    metrics_text,
    query,
    run,
    wait_until,
)
from sidecar.client import Client
from sidecar.protocol.errors import UsageError
from sidecar.protocol.verdict import (
    ApprovalAsk,
    Failure,
    Observed,
    Reject,
    approval_failure,
    decide,
    parse_approval,
)
from sidecar.protocol.vocabulary import FailureKind, StopReason
from sidecar.runtime.config import load_settings
from sidecar.storage.caller_store import CallerStore
from sidecar.storage.db import init_connection
from sidecar.storage.worker_store import WorkerStore

TOOL = [sys.executable, str(Path(__file__).parent / "tools" / "approval_tool.py")]
ASK = {"action": "refund", "summary": "refund 40 EUR to c-1048"}


# --- the pure rules ------------------------------------------------------------------

@pytest.mark.unit
def test_an_approval_body_is_an_action_a_summary_and_bounded_details():
    assert parse_approval(b'{"action": "refund", "summary": "refund 40 EUR"}') \
        == ApprovalAsk("refund", "refund 40 EUR", {})
    asked = parse_approval(b'{"action": "case.create", "summary": "s", "details": {"a": 1}}')
    assert asked.details == {"a": 1}
    refused = {
        b"": "JSON object", b"[]": "JSON object", b"{}": "action",
        b'{"action": "Refund", "summary": "s"}': "action",
        b'{"action": "1x", "summary": "s"}': "action",
        ('{"action": "' + "a" * 65 + '", "summary": "s"}').encode(): "action",
        b'{"action": "refund"}': "summary",
        b'{"action": "refund", "summary": ""}': "summary",
        b'{"action": "refund", "summary": "two\\nlines"}': "summary",
        ('{"action": "refund", "summary": "' + "s" * 201 + '"}').encode(): "summary",
        b'{"action": "refund", "summary": "s", "details": []}': "details",
        ('{"action": "refund", "summary": "s", "details": {"x": "' + "d" * 9000 + '"}}')
        .encode(): "details",
        b'{"action": "refund", "summary": "s", "token": 7}': "unknown field 'token'",
    }
    for body, field in refused.items():
        with pytest.raises(ValueError, match=field):
            parse_approval(body)


@pytest.mark.unit
def test_a_denied_step_fails_the_attempt_but_a_lost_lease_still_comes_first():
    profile = load_settings({"SIDECAR_DATABASE_URL": "postgresql://127.0.0.1/x"}).profile("ap")
    denied = approval_failure("denied", "refund", by="alice", reason="not this one")
    assert denied.kind is FailureKind.DENIED and not denied.retryable
    assert "alice denied the step 'refund': not this one" in denied.message
    expired = approval_failure("expired", "refund")
    assert expired.kind is FailureKind.APPROVAL_EXPIRED and not expired.retryable
    verdict = decide(Observed(StopReason.EXITED, 0, refused=denied), profile)
    assert isinstance(verdict, Failure) and verdict.kind is FailureKind.DENIED
    assert isinstance(decide(Observed(StopReason.LEASE_LOST, 0, refused=denied), profile),
                      Reject)


# --- the answer, bound to the attempt ------------------------------------------------

@pytest.mark.database
def test_every_answer_path_is_bound_to_the_attempt_that_asked(dsn):
    """Taken while the asking attempt owns the job; refused and journaled for a second
    answer, an answer for a previous attempt, one arriving as the lease is lost, one
    past the deadline and one with no request."""
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3, init=init_connection)
        store, caller = WorkerStore(pool, 10), CallerStore(pool, 10)
        try:
            out = {}
            job_id, _ = await caller.enqueue("ap", {}, None, 5, {})
            out["none"] = await caller.answer_approval(job_id, 1, 1, True, None, "alice")
            first = await store.claim("ap", "w1", 60)
            asked = await store.ask_approval(first, "w1", uuid.uuid4(), "refund", "s", {}, 60)
            with pytest.raises(asyncpg.UniqueViolationError):  # one open request at a time
                await store.ask_approval(first, "w1", uuid.uuid4(), "refund", "s", {}, 60)
            out["approved"] = await caller.answer_approval(job_id, first.attempt,
                                                           first.fencing_token, True,
                                                           "ok", "alice")
            out["second"] = await caller.answer_approval(job_id, first.attempt,
                                                         first.fencing_token, False, None,
                                                         "bob")
            # attempt 1 asks again, then its lease ends and attempt 2 takes the job
            await store.ask_approval(first, "w1", uuid.uuid4(), "refund", "again", {}, 60)
            await pool.execute("UPDATE tool_jobs SET lease_until = now() - interval '1 s' "
                               "WHERE id = $1", job_id)
            out["as_lost"] = await caller.answer_approval(job_id, first.attempt,
                                                          first.fencing_token, True, None,
                                                          "alice")
            second = await store.claim("ap", "w2", 60)
            out["previous"] = await caller.answer_approval(job_id, first.attempt,
                                                           first.fencing_token, True, None,
                                                           "alice")
            late = await store.ask_approval(second, "w2", uuid.uuid4(), "refund", "s", {}, 0.2)
            await asyncio.sleep(0.4)
            out["late"] = await caller.answer_approval(job_id, second.attempt,
                                                       second.fencing_token, True, None,
                                                       "alice")
            with pytest.raises(UsageError, match="by must be"):
                await caller.answer_approval(job_id, 1, 1, True, None, "a\tb")
            with pytest.raises(UsageError, match="reason must be"):
                await caller.answer_approval(job_id, 1, 1, True, "x" * 501, "alice")
            return job_id, asked, late, first, second, out
        finally:
            await pool.close()

    job_id, asked, late, first, second, out = run(go())
    assert out == {"none": "no_request", "approved": "approved", "second": "already_answered",
                   "as_lost": "stale_attempt", "previous": "stale_attempt", "late": "expired"}
    assert asked["attempt"] == first.attempt and second.fencing_token > first.fencing_token
    states = {r["fencing_token"]: r["state"] for r in query(
        dsn, "SELECT fencing_token, state FROM tool_approvals WHERE summary = 'again'")}
    # never approved by a stale answer; expired once the next attempt asked its own
    assert states == {first.fencing_token: "expired"}
    events = query(dsn, "SELECT event, fencing_token, details FROM tool_job_events "
                        "WHERE job_id = $1 AND event LIKE 'approval_%' ORDER BY id", job_id)
    refused = [e["details"]["outcome"] for e in events if e["event"] == "approval_refused"]
    assert refused == ["no_request", "already_answered", "stale_attempt", "stale_attempt",
                       "expired"]
    answered = [e for e in events if e["event"] == "approval_answered"]
    assert len(answered) == 1 and answered[0]["details"]["by"] == "alice"
    assert answered[0]["fencing_token"] == first.fencing_token


# --- end to end, with a real tool waiting --------------------------------------------

def _open_request(dsn, job_id):
    rows = query(dsn, "SELECT attempt, fencing_token FROM tool_approvals "
                      "WHERE job_id = $1 AND state = 'pending'", job_id)
    return rows[0] if rows else None


@pytest.mark.e2e
def test_a_tool_waits_for_sidecar_approve_and_takes_its_step_with_its_token(dsn, tmp_path):
    port = free_port()
    env = base_env(dsn, SIDECAR_PROFILE_AP_APPROVAL_WAIT_SECONDS="120",
                   SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}")
    job = enqueue(dsn, "ap", ASK)
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: _open_request(dsn, job), 60, what="the tool's approval request")
        wait_until(lambda: metric_total(metrics_text(f"http://127.0.0.1:{port}"),
                                        "sidecar_approvals_waiting") == 1, 30,
                   what="the waiting call counted")
        done = cli(dsn, "approve", job, "--reason", "checked the invoice", env=env)
        assert done.returncode == 0, done.stderr.decode()
        said = orjson.loads(done.stdout)
        assert said["outcome"] == "approved" and said["action"] == "refund"
        wait_until(lambda: job_row(dsn, job)["state"] == "succeeded", 60, what="the job")
        scraped = metrics_text(f"http://127.0.0.1:{port}")
        assert metric_total(scraped, "sidecar_approval_answer_seconds_count",
                            outcome="approved") == 1
        assert metric_total(scraped, "sidecar_approvals_waiting") == 0
        again = cli(dsn, "approve", job, "--attempt", "1", "--token", "1", env=env)
        assert again.returncode == 5
        assert orjson.loads(again.stdout)["outcome"] == "already_answered"
    finally:
        sidecar.stop()
    result = job_row(dsn, job)["result"]
    assert result["status"] == 200 and result["step_taken"] is True
    assert result["answer"]["fencing_token"] == 1
    assert result["answer"]["reason"] == "checked the invoice"
    assert result["answer"]["by"].startswith("sidecar approve (")


@pytest.mark.e2e
def test_a_denial_or_silence_fails_the_job_though_the_tool_exits_0(dsn, tmp_path):
    env = base_env(dsn, SIDECAR_PROFILE_AP_APPROVAL_WAIT_SECONDS="3")
    denied = enqueue(dsn, "ap", ASK)
    silent = enqueue(dsn, "ap", {**ASK, "summary": "nobody answers this"})
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", "--concurrency", "2", env=env,
                             tmp=tmp_path)
    try:
        wait_until(lambda: _open_request(dsn, denied), 60, what="the approval request")

        async def deny():
            async with Client(dsn) as client:
                return await client.approve(denied, approve=False, reason="wrong customer",
                                            by="alice")

        assert run(deny()) == "denied"
        wait_until(lambda: job_row(dsn, denied)["state"] == "failed"
                   and job_row(dsn, silent)["state"] == "failed", 60, what="both jobs")
    finally:
        sidecar.stop()
    row = job_row(dsn, denied)
    assert row["error"]["kind"] == "denied" and "alice denied" in row["error"]["message"]
    assert row["attempt"] == 1 and row["result"] is None
    row = job_row(dsn, silent)
    assert row["error"]["kind"] == "approval_expired" and row["attempt"] == 1
    assert query(dsn, "SELECT state FROM tool_approvals WHERE job_id = $1", silent)[0][
        "state"] == "expired"


@pytest.mark.e2e
def test_the_guard_refuses_hostile_approval_bodies_and_stores_none(dsn):
    bodies = ["", "[]", '{"action": "refund"}', '{"action": "DROP TABLE", "summary": "s"}',
              '{"action": "refund", "summary": "s", "fencing_token": 9}',
              '{"action": "refund", "summary": "' + "s" * 300 + '"}', "{" * 20000]
    job = enqueue(dsn, "ap", {"probe": bodies})
    done = cli(dsn, "run", "--tool", "ap", "--drain", "--", *TOOL, env=base_env(dsn),
               timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert job_row(dsn, job)["result"]["statuses"] == [400] * 6 + [413]
    assert query(dsn, "SELECT id FROM tool_approvals") == []


# --- the park shape ------------------------------------------------------------------

@pytest.mark.e2e
def test_a_parked_job_frees_its_slot_and_runs_again_with_the_answer_once_approved(dsn,
                                                                                   tmp_path):
    port = free_port()
    env = base_env(dsn, SIDECAR_PROFILE_AP_APPROVAL_MODE="park", SIDECAR_POLL_SECONDS="0.5",
                   SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}")
    parked = enqueue(dsn, "ap", ASK)
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", env=env, tmp=tmp_path)  # 1 slot
    try:
        wait_until(lambda: job_row(dsn, parked)["state"] == "waiting", 60, what="the park")
        wait_until(lambda: metric_total(metrics_text(f"http://127.0.0.1:{port}"),
                                        "sidecar_jobs_waiting_approval") == 1, 30,
                   what="the parked job counted")
        row = job_row(dsn, parked)
        assert row["owner_id"] is None and row["lease_until"] is None and row["attempt"] == 0
        other = enqueue(dsn, "ap", {"probe": []})  # the one slot is free for it
        wait_until(lambda: job_row(dsn, other)["state"] == "succeeded", 60, what="another job")
        assert job_row(dsn, parked)["state"] == "waiting"
        done = cli(dsn, "approve", parked, "--reason", "go", env=env)
        assert done.returncode == 0 and orjson.loads(done.stdout)["outcome"] == "approved"
        wait_until(lambda: job_row(dsn, parked)["state"] == "succeeded", 60, what="the rerun")
        late = cli(dsn, "approve", parked, "--attempt", "1", "--token", "1", env=env)
        assert late.returncode == 5
        assert orjson.loads(late.stdout)["outcome"] == "already_answered"
    finally:
        sidecar.stop()
    row = job_row(dsn, parked)
    result = row["result"]
    assert result["step_taken"] is True and result["attempt"] == 1 and result["token"] == 2
    assert result["resumed"]["approved"] is True and result["resumed"]["reason"] == "go"
    assert result["resumed"]["action"] == "refund"
    assert result["checkpoint"] == {"asked": result["resumed"]["request_id"]}
    events = [r["event"] for r in query(dsn, "SELECT event FROM tool_job_events WHERE "
                                             "job_id = $1 ORDER BY id", parked)]
    assert events.index("approval_requested") < events.index("job_parked") \
        < events.index("approval_answered") < events.index("job_succeeded")


@pytest.mark.e2e
def test_a_parked_job_denied_fails_at_once_and_one_unanswered_expires(dsn, tmp_path):
    env = base_env(dsn, SIDECAR_PROFILE_AP_APPROVAL_MODE="park", SIDECAR_POLL_SECONDS="0.5",
                   SIDECAR_PROFILE_AP_APPROVAL_PARK_SECONDS="3")
    denied = enqueue(dsn, "ap", ASK)
    silent = enqueue(dsn, "ap", {**ASK, "summary": "nobody answers this"})
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", "--concurrency", "2", env=env,
                             tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, denied)["state"] == "waiting", 60, what="the park")
        done = cli(dsn, "approve", denied, "--deny", "--reason", "no", env=env)
        assert done.returncode == 0 and orjson.loads(done.stdout)["outcome"] == "denied"
        assert job_row(dsn, denied)["state"] == "failed"  # by the answer itself
        wait_until(lambda: job_row(dsn, silent)["state"] == "failed", 60, what="the expiry")
    finally:
        sidecar.stop()
    row = job_row(dsn, denied)
    assert row["error"]["kind"] == "denied" and row["approval"]["approved"] is False
    row = job_row(dsn, silent)
    assert row["error"]["kind"] == "approval_expired" and row["attempt"] == 0


# --- through the MCP gateway ----------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.server
def test_an_mcp_client_is_asked_by_elicitation_and_a_task_shows_input_required(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A client that declares elicitation is asked while its call waits, and its answer
    is the job's, for the attempt that asked, journaled with its principal. A task of a
    client that cannot be asked says input_required with the request until someone
    answers (here `sidecar approve`)."""
    import mcp_types as types
    from test_mcp_gateway import _gateway_env

    from sidecar.mcp.tasks import TasksExtension, get_task

    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_PT_APPROVAL_WAIT_SECONDS="60")
    sidecars(dsn, TOOL, "--tool", "pt", "--concurrency", "2", env=env)
    g = gateway()
    asked: list[str] = []

    async def answer(context, params):
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": True,
                                                            "reason": "looks right"})

    async def main():
        async with g.client(elicitation_callback=answer, mode="legacy") as client:
            called = await client.call_tool("pt", {"steps": []})
        async with g.client(extensions=[TasksExtension()]) as client:
            handle = await client.session.call_tool("pt", {"steps": []}, allow_claimed=True)
            for _ in range(300):
                task = await get_task(client.session, handle.task_id)
                if task["status"] == "input_required":
                    break
                await asyncio.sleep(0.1)
            rows = await asyncio.to_thread(
                query, dsn, "SELECT job_id FROM tool_approvals WHERE state = 'pending'")
            done = await asyncio.to_thread(cli, dsn, "approve", str(rows[0]["job_id"]),
                                           "--reason", "ok", env=env)
            for _ in range(300):
                finished = await get_task(client.session, handle.task_id)
                if finished["status"] == "completed":
                    break
                await asyncio.sleep(0.1)
            return called, task, done, finished

    called, task, done, finished = asyncio.run(main())
    assert asked and "'refund'" in asked[0] and "refund 40 EUR to c-1048" in asked[0]
    assert called.structured_content["step_taken"] is True, called
    assert called.structured_content["answer"]["by"] == "sidecar mcp (alice)"
    assert called.structured_content["answer"]["reason"] == "looks right"
    assert task["status"] == "input_required" and "sidecar approve" in task["statusMessage"]
    assert done.returncode == 0, done.stderr.decode()
    assert finished["status"] == "completed", finished
    answered = query(dsn, "SELECT details FROM tool_job_events WHERE event = "
                          "'approval_answered' ORDER BY id")
    assert [a["details"]["by"].split(" (")[0] for a in answered] == ["sidecar mcp",
                                                                     "sidecar approve"]


@pytest.mark.e2e
def test_a_tool_without_http_asks_by_a_file_and_its_job_parks(dsn, tmp_path):
    """$SIDECAR_APPROVAL_REQUEST_FILE holds the body of a POST /v1/approval: once the tool
    exits, its request is written for that attempt and the job parks (whatever
    APPROVAL_MODE says); approved, the next attempt finds SIDECAR_APPROVAL. A file that
    is not a request fails the job bad_result, naming the file."""
    env = base_env(dsn, SIDECAR_POLL_SECONDS="0.5")
    asked = enqueue(dsn, "ap", {"via": "file"})
    bad = enqueue(dsn, "ap", {"via": "file", "raw": '{"action": "Bad Name", "summary": "s"}'})
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, asked)["state"] == "waiting", 60, what="the park")
        wait_until(lambda: job_row(dsn, bad)["state"] == "failed", 60, what="the bad file")

        async def approve():
            async with Client(dsn) as client:
                return await client.approve(asked, reason="by file", by="bob")

        assert run(approve()) == "approved"
        wait_until(lambda: job_row(dsn, asked)["state"] == "succeeded", 60, what="the rerun")
    finally:
        sidecar.stop()
    result = job_row(dsn, asked)["result"]
    assert result["resumed"]["by"] == "bob" and result["resumed"]["approved"] is True
    error = job_row(dsn, bad)["error"]
    assert error["kind"] == "bad_result" and "SIDECAR_APPROVAL_REQUEST_FILE" in error["message"]
    assert "action" in error["message"]


@pytest.mark.database
def test_an_answer_given_as_the_tool_exits_is_applied_when_the_job_parks(dsn):
    """Review of issue 44: in park mode the job is still running between the guard's 202
    and the tool's exit. An answer in that window is kept on the request, and the park
    applies it: approved -> queued again with the answer; denied -> failed denied; a
    request past its deadline -> failed approval_expired. Never parked for good."""
    async def go():
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3, init=init_connection)
        store, caller = WorkerStore(pool, 10), CallerStore(pool, 10)
        try:
            out = {}
            for case in ("approved", "denied", "expired", "open"):
                job_id, _ = await caller.enqueue(f"pk-{case}", {}, None, 3, {})
                job = await store.claim(f"pk-{case}", "w1", 60)
                wait = 0.2 if case == "expired" else 600
                asked = await store.ask_approval(job, "w1", uuid.uuid4(), "refund", "s", {},
                                                 wait)
                if case in ("approved", "denied"):
                    said = await caller.answer_approval(job_id, job.attempt,
                                                        job.fencing_token,
                                                        case == "approved", None, "alice")
                    assert said == case
                if case == "expired":
                    await asyncio.sleep(0.4)
                row = await store.park_if_owner(job, "w1", str(asked["id"]), {})
                out[case] = (job_id, row["outcome"])
            return out
        finally:
            await pool.close()

    out = run(go())
    assert {case: outcome for case, (_, outcome) in out.items()} == {
        "approved": "approved", "denied": "denied", "expired": "expired", "open": "parked"}
    rows = {case: job_row(dsn, job_id) for case, (job_id, _) in out.items()}
    assert rows["approved"]["state"] == "queued" and rows["approved"]["approval"]["by"] == "alice"
    assert rows["approved"]["attempt"] == 0 and rows["approved"]["owner_id"] is None
    assert rows["denied"]["state"] == "failed" and rows["denied"]["error"]["kind"] == "denied"
    assert rows["expired"]["error"]["kind"] == "approval_expired"
    assert rows["open"]["state"] == "waiting" and rows["open"]["expires_at"] is None


@pytest.mark.e2e
def test_a_tool_killed_while_it_waits_for_an_answer_ends_the_guards_wait(dsn, tmp_path):
    """Review of issue 44: the guard's wait for an answer ends with its attempt (here the
    stage deadline kills the tool first): the wait is not left polling, and the gauge of
    waiting calls goes back to 0."""
    port = free_port()
    env = base_env(dsn, SIDECAR_PROFILE_AP_STAGE_TIMEOUT_SECONDS="3",
                   SIDECAR_PROFILE_AP_MAX_ATTEMPTS="1", SIDECAR_HTTP_ADDR=f"127.0.0.1:{port}")
    job = enqueue(dsn, "ap", ASK)
    sidecar = SidecarProcess(dsn, TOOL, "--tool", "ap", env=env, tmp=tmp_path)
    try:
        wait_until(lambda: job_row(dsn, job)["state"] == "failed", 60, what="the deadline")
        wait_until(lambda: metric_total(metrics_text(f"http://127.0.0.1:{port}"),
                                        "sidecar_approvals_waiting") == 0, 15,
                   what="the guard's wait to end")
    finally:
        sidecar.stop()
    assert job_row(dsn, job)["error"]["kind"] == "stage_timeout"


@pytest.mark.e2e
@pytest.mark.server
def test_a_2026_client_is_asked_in_band_and_a_forged_request_state_is_refused(
        dsn, sidecars, gateway, tmp_path):  # noqa: F811 - the fixture
    """A client of the 2026-07-28 revision that lists elicitation gets an input_required
    result asking the person's yes (the job goes on); its retry carries the answer, which
    is written for the attempt that asked, and the call returns the job's result. A
    requestState the gateway did not issue is refused."""
    import mcp_types as types
    from test_mcp_gateway import _gateway_env

    from sidecar.mcp.gateway import MCPError

    env = _gateway_env(dsn, tmp_path, SIDECAR_PROFILE_PT_APPROVAL_WAIT_SECONDS="60")
    sidecars(dsn, TOOL, "--tool", "pt", env=env)
    g = gateway()
    asked: list[str] = []

    async def answer(context, params):
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": False,
                                                            "reason": "not today"})

    async def main():
        async with g.client(elicitation_callback=answer) as client:
            called = await client.call_tool("pt", {"steps": []})
            with pytest.raises(MCPError, match="requestState"):
                await client.session.call_tool(
                    "pt", {"steps": []}, request_state="a1.forged.state.x",
                    input_responses={})
            return called

    called = asyncio.run(main())
    assert asked and "refund 40 EUR to c-1048" in asked[0]
    assert called.is_error  # denied: the job failed
    [job] = query(dsn, "SELECT id, error FROM tool_jobs")
    assert job["error"]["kind"] == "denied" and "not today" in job["error"]["message"]
    [answered] = [r["details"] for r in query(
        dsn, "SELECT details FROM tool_job_events WHERE event = 'approval_answered'")]
    assert answered["by"] == "sidecar mcp (alice)" and answered["approve"] is False
