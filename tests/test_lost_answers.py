"""Case F16: the answer of a statement can be lost after it committed.

The kind of fault: acting on "no answer" or on a retry's "not yours" as if the statement
had not happened. A claim that committed (token + 1, attempt + 1, owner this sidecar)
but whose answer was lost left the job running under the sidecar's own owner id with no
lease held locally; with --max-attempts 1 it ended max_attempts_exceeded without its tool
ever starting. A fenced end of an attempt whose answer was lost was retried, found the job
no longer running, and was journaled as a rejected result although it had committed.

Now the sidecar settles such a statement from the database before acting: after a claim
with no answer, every job running under its own owner id that it does not hold goes back
to the queue without spending the attempt (``lease_released``, reason
``claim_answer_lost``) before the next claim; after a fenced write with no answer whose
retry is refused, the journal row the write commits in its own statement tells whether
it did commit (``commit_answer_lost``). Places with the same shape: the claim; the
success, failure, requeue and release writes of sidecar.worker.commit (one ``_fenced`` path).

The answers are lost by a real PostgreSQL protocol proxy (tests/pgproxy.py) that lets
the statement commit and then cuts the connection instead of passing its answer on.
"""

from __future__ import annotations

import uuid

import pytest
from netproxy import through, upstream_of
from pgproxy import AnswerDropProxy

from kit import base_env, enqueue, job_row, query, wait_until
from sidecar.storage.queries import Q

pytestmark = [pytest.mark.e2e, pytest.mark.server]

COUNTER = "run_counter.py"


def _marker(name: str) -> str:
    """A line of the named statement's SQL no other statement has."""
    lines = [line for line in Q[name].splitlines()
             if line.strip() and not line.strip().startswith("--")]
    unique = [line for line in lines
              if sum(line in text for text in Q.values()) == 1]
    assert unique, name
    return unique[0].strip()


@pytest.fixture
def drop_answers(dsn):
    proxies = []

    def start(statement: str) -> tuple[AnswerDropProxy, str]:
        proxy = AnswerDropProxy(upstream_of(dsn), _marker(statement))
        proxies.append(proxy)
        port = proxy.start()
        proxied = through(dsn, port)
        return proxy, proxied + ("&" if "?" in proxied else "?") + "sslmode=disable"

    yield start
    for proxy in proxies:
        proxy.stop()


def _events(dsn: str, job_id: str) -> list[tuple[str, int, dict]]:
    return [(r["event"], r["fencing_token"], r["details"]) for r in query(
        dsn, "SELECT event, fencing_token, details FROM tool_job_events WHERE job_id = $1 "
             "ORDER BY at, id", uuid.UUID(job_id))]


def test_a_claim_whose_answer_was_lost_is_released_without_spending_the_attempt(
        dsn, sidecars, drop_answers, tmp_path):
    """Case F16, the claim: its answer is lost after it committed (token 1, attempt 1 of
    1, owner this sidecar). The sidecar settles it from the row before claiming again:
    the job goes back to the queue with its attempt given back, is claimed again (token
    2) and succeeds on its only attempt; the tool ran once, and never for token 1."""
    proxy, proxied = drop_answers("claim_job")
    runs = tmp_path / "runs"
    sc = sidecars(dsn, [COUNTER], env=base_env(proxied))
    sc.wait_event("worker_started")
    proxy.arm(1)
    job_id = enqueue(dsn, COUNTER, {"log": str(runs)}, "--max-attempts", "1")
    wait_until(lambda: job_row(dsn, job_id)["state"] in ("succeeded", "failed"), 30,
               what="the job's end")
    row = job_row(dsn, job_id)
    assert proxy.dropped == 1
    assert row["state"] == "succeeded", row["error"]
    assert (row["fencing_token"], row["attempt"]) == (2, 1)
    assert runs.read_text().split() == ["2"]
    events = _events(dsn, job_id)
    released = [(t, d) for e, t, d in events if e == "lease_released"]
    assert released == [(1, {"reason": "claim_answer_lost", "owner_id": released[0][1]
                             ["owner_id"], "attempt_spent": False})]
    assert not [e for e, _, _ in events if e == "job_failed"]
    sc.wait_event("claim_answer_lost", job_id=job_id, fencing_token=1)


def test_a_lost_claim_of_a_sidecar_that_died_before_settling_it_is_not_an_attempt(
        dsn, sidecars, drop_answers, tmp_path):
    """Case F16, kind "the answer of a statement can be lost after it committed", when the
    sidecar cannot settle it: the claim's answer is lost (token 1, attempt 1 of 1, owner
    A) and A dies before it could release the job (its database is cut off, then it is
    SIGKILLed). The lease expires with no tool started for token 1 (no
    ``tool_request_started`` in the journal). It used to end ``max_attempts_exceeded``
    without the tool ever running; now the expired attempt is given back: sidecar B
    claims it (token 2, still attempt 1, ``attempt_refunded`` journaled with the claim,
    ``unstarted_expiries`` 1) and the tool runs once and succeeds."""
    proxy, proxied = drop_answers("claim_job")
    runs = tmp_path / "runs"
    a = sidecars(dsn, [COUNTER], env=base_env(proxied))
    a.wait_event("worker_started")
    proxy.arm(1, isolate=True)
    job_id = enqueue(dsn, COUNTER, {"log": str(runs)}, "--max-attempts", "1")
    wait_until(proxy.isolated.is_set, 20, what="the claim's answer to be lost")
    a.proc.kill()
    a.wait(10)
    row = job_row(dsn, job_id)
    assert (row["state"], row["fencing_token"], row["attempt"]) == ("running", 1, 1)
    b = sidecars(dsn, [COUNTER], env=base_env(dsn))
    wait_until(lambda: job_row(dsn, job_id)["state"] in ("succeeded", "failed"), 30,
               what="the job's end")
    row = job_row(dsn, job_id)
    assert row["state"] == "succeeded", row["error"]
    assert (row["fencing_token"], row["attempt"]) == (2, 1)
    assert runs.read_text().split() == ["2"]
    refunds = query(dsn, "SELECT unstarted_expiries FROM tool_jobs WHERE id = $1",
                    uuid.UUID(job_id))[0]["unstarted_expiries"]
    assert refunds == 1
    claims = [(t, d) for e, t, d in _events(dsn, job_id) if e == "job_claimed"]
    assert [t for t, _ in claims] == [1, 2]
    assert "attempt_refunded" not in claims[0][1] and "attempt_refunded" in claims[1][1]
    assert claims[1][1]["attempt"] == 1
    b.wait_event("job_succeeded", job_id=job_id)


def test_unstarted_expiries_are_given_back_a_bounded_number_of_times(dsn, sidecars, tmp_path):
    """Case F16's bound: a job whose attempts keep expiring before their tool's start
    reaches the journal (a tool that kills its sidecar at once, or sidecars that die
    between claim and spawn) is given back at most max_attempts times, then the next
    unstarted expiry is spent as any other, so it cannot loop for ever. Claims by the
    real claim statement of sidecars that die at once (nothing runs for them); a real
    sidecar's lease sweep ends the job ``max_attempts_exceeded``."""
    job_id = enqueue(dsn, COUNTER, {"log": str(tmp_path / "runs")}, "--max-attempts", "1")
    claim = Q["claim_job"]
    seen = []
    for owner in ("dead-1", "dead-2"):
        wait_until(lambda: query(dsn, "SELECT state = 'queued' OR lease_until < now() AS due "
                                      "FROM tool_jobs WHERE id = $1",
                                 uuid.UUID(job_id))[0]["due"], 15, what="the lease to expire")
        [row] = query(dsn, claim, COUNTER, owner, 1.0, None, 3, 1)
        seen.append((row["fencing_token"], row["attempt"], row["refunded"]))
    assert seen == [(1, 1, False), (2, 1, True)]
    sc = sidecars(dsn, [COUNTER], env=base_env(dsn))
    wait_until(lambda: job_row(dsn, job_id)["state"] == "failed", 20,
               what="the exhausted job to fail")
    row = job_row(dsn, job_id)
    assert row["error"]["kind"] == "max_attempts_exceeded"
    assert not (tmp_path / "runs").exists()
    sc.stop()


@pytest.mark.parametrize("exit_code, event, state", [
    (0, "job_succeeded", "succeeded"),
    (3, "job_retry_scheduled", "queued"),
])
def test_a_fenced_end_whose_answer_was_lost_is_settled_from_the_journal(
        dsn, sidecars, drop_answers, tmp_path, exit_code, event, state):
    """Case F16, the fenced end of an attempt (success, and a requeue after a failure):
    the write commits and its answer is lost; the retry finds the job no longer running.
    The journal row the write committed in its own statement settles it: the outcome
    stands, no ``result_rejected`` is journaled, and the attempt is not counted as lost."""
    statement = "finish_job_if_owner" if exit_code == 0 else "requeue_job_if_owner"
    proxy, proxied = drop_answers(statement)
    runs = tmp_path / "runs"
    sc = sidecars(dsn, [COUNTER], env=base_env(proxied))
    sc.wait_event("worker_started")
    proxy.arm(1)
    job_id = enqueue(dsn, COUNTER, {"log": str(runs), "exit": exit_code},
                     "--max-attempts", "2")
    settled = sc.wait_event("commit_answer_lost", job_id=job_id, timeout=30)
    assert settled["journal_event"] == event and proxy.dropped == 1
    if state == "queued":  # the second attempt then fails for good: let it, and look
        wait_until(lambda: job_row(dsn, job_id)["state"] == "failed", 30,
                   what="the second attempt's end")
    else:
        wait_until(lambda: job_row(dsn, job_id)["state"] == state, 30, what=state)
    names = [(e, t) for e, t, _ in _events(dsn, job_id)]
    assert (event, 1) in names
    assert not [n for n in names if n[0] == "result_rejected"], names
    assert not sc.events("result_rejected")
    assert runs.read_text().split() == (["1"] if exit_code == 0 else ["1", "2"])


def test_a_lease_claimed_before_the_refund_rule_expires_as_before(dsn, sidecars, tmp_path):
    """Migration 012 adds claimed_at; a row claimed by an older release has none. Its
    expired lease is spent as it always was (never given back, never stuck between the
    sweep and the claim): with no attempt left the sweep fails it."""
    job_id = enqueue(dsn, COUNTER, {"log": str(tmp_path / "runs")}, "--max-attempts", "1")
    [row] = query(dsn, Q["claim_job"], COUNTER, "older-release", 1.0, None, 3, 1)
    query(dsn, "UPDATE tool_jobs SET claimed_at = NULL WHERE id = $1", row["id"])
    sidecars(dsn, [COUNTER], env=base_env(dsn))
    wait_until(lambda: job_row(dsn, job_id)["state"] == "failed", 20,
               what="the exhausted job to fail")
    assert job_row(dsn, job_id)["error"]["kind"] == "max_attempts_exceeded"
    assert not (tmp_path / "runs").exists()
