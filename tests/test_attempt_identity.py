"""Case F14: an attempt is (job id, fencing token), never the job id alone.

The kind of fault: state of one attempt kept under the job id, so a second attempt of the
same job in the same sidecar overwrites (or is overwritten by) the first. Found by an
operator's `sidecar cancel ID` then `sidecar retry ID` within one heartbeat, at
`--concurrency 2`: the owning sidecar claimed its own job again (token 2) while token 1
still ran; token 1 was never killed and, when it ended, dropped token 2's lease.

Every place that keyed by job id is keyed by the attempt now: the lease keeper's leases
and abandoned leases, the renewal's answer, the worker's running tasks, the guard's
registrations; job cgroups and work directories were already named by (owner, job,
token). A claim of a job this sidecar still supervises first ends the old attempt (lease
lost, tree killed, journaled ``attempt_superseded``) before the new tree starts, and
`sidecar retry` of a cancelled job waits until its owner acknowledged the cancel
(``cancel_acknowledged``) or the cancelled lease ended.

What is observed: real sidecars, a real tool that logs each attempt's start and end by
token, a watcher that samples the live processes of the job (by the SIDECAR_JOB_ID in
their environment) every few milliseconds, and the journal.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from pathlib import Path

import asyncpg
import orjson
import psutil
import pytest

from kit import base_env, cli, enqueue, job_processes, job_row, query, run, scalar, wait_until
from sidecar.storage.db import init_connection
from sidecar.storage.queries import Q

pytestmark = [pytest.mark.e2e, pytest.mark.server]

PROBE = "attempt_probe.py"

# H = 2 s, so an operator's cancel and retry (or requeue) fit in one heartbeat; L = 12 s
# keeps P10 (12 > 1 x 2 + 1).
SLOW_HEARTBEAT = {"SIDECAR_LEASE_SECONDS": "12", "SIDECAR_HEARTBEAT_SECONDS": "2",
                  "SIDECAR_JITTER_SECONDS": "1"}

# What `sidecar retry` did before it waited for the acknowledgement, and what any other
# writer (an older release, an operator's SQL) may still do: requeue a cancelled job at once.
REQUEUE_AT_ONCE = """
UPDATE tool_jobs SET state = 'queued', attempt = 0, run_after = now(), owner_id = NULL,
    lease_until = NULL, heartbeat_at = NULL, error = NULL, finished_at = NULL
WHERE id = $1 AND state = 'cancelled'
RETURNING tool_job_wake(tool, 1)
"""


def live_attempts(job_id: str) -> dict[str, list[int]]:
    """The job's live processes (zombies count as gone) by the fencing token in their
    environment: one key per attempt whose tree is alive."""
    found: dict[str, list[int]] = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SIDECAR_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(env.get("SIDECAR_FENCING_TOKEN", "?"), []).append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


class TreeWatch:
    """Samples the live processes of one job every ``period`` seconds in a thread of its
    own; ``overlaps`` keeps every sample that saw the trees of two attempts (two fencing
    tokens) alive at once."""

    def __init__(self, job_id: str, period: float = 0.01):
        self.job_id = job_id
        self.period = period
        self.samples = 0
        self.overlaps: list[dict[str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            alive = live_attempts(self.job_id)
            self.samples += 1
            if len(alive) > 1:
                self.overlaps.append({token: [describe(pid) for pid in pids]
                                      for token, pids in alive.items()})
            self._stop.wait(self.period)


def describe(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return f"{pid} {proc.status()} {' '.join(proc.cmdline())[-80:]}"
    except psutil.Error:
        return f"{pid} gone"


def probe_log(path: Path) -> list[tuple[str, int]]:
    """The probe's log: ("start" | "end", token) in the order they happened."""
    if not path.exists():
        return []
    return [(word, int(token)) for word, token, *_ in
            (line.split() for line in path.read_text().splitlines() if line.strip())]


def journal(dsn: str, job_id: str) -> list[tuple[str, int, dict]]:
    return [(r["event"], r["fencing_token"], orjson.loads(r["details"]) if r["details"] else {})
            for r in query(dsn, "SELECT event, fencing_token, details::text AS details "
                                "FROM tool_job_events WHERE job_id = $1 ORDER BY at, id",
                           uuid.UUID(job_id))]


def started_tokens(log_path: Path) -> list[int]:
    return [token for word, token in probe_log(log_path) if word == "start"]


def test_cancel_then_retry_within_a_heartbeat_never_runs_two_trees(dsn, sidecars, tmp_path):
    """Case F14, the exact sequence: `sidecar cancel` then `sidecar retry` within one
    heartbeat, one sidecar at --concurrency 2. The retry waits for the owner to
    acknowledge the cancel (its tree is dead) before the job is queued again; token 1 is
    killed and journaled, token 2 runs alone, under a heartbeated lease, to success."""
    log_path, endfile = tmp_path / "probe.log", tmp_path / "end"
    sc = sidecars(dsn, [PROBE], "--concurrency", "2", env=base_env(dsn, **SLOW_HEARTBEAT))
    job_id = enqueue(dsn, PROBE, {"log": str(log_path), "endfile": str(endfile),
                                  "max_wait": 60})
    with TreeWatch(job_id) as watch:
        wait_until(lambda: started_tokens(log_path) == [1], 20, what="token 1 started")
        cancelled = cli(dsn, "cancel", job_id)
        assert cancelled.returncode == 0, cancelled.stderr.decode()
        retried = cli(dsn, "retry", job_id)
        assert retried.returncode == 0, retried.stderr.decode()
        assert orjson.loads(retried.stdout)["retried"] == [job_id]
        wait_until(lambda: 2 in started_tokens(log_path), 20, what="token 2 started")
        time.sleep(2 * 2 + 0.5)  # two heartbeats of the new lease
        assert job_row(dsn, job_id)["state"] == "running"
        (endfile.parent / f"{endfile.name}.2").touch()
        wait_until(lambda: job_row(dsn, job_id)["state"] == "succeeded", 20,
                   what="token 2's result committed")
    assert watch.samples > 50 and watch.overlaps == [], watch.overlaps
    assert started_tokens(log_path) == [1, 2]
    row = job_row(dsn, job_id)
    assert (row["fencing_token"], row["attempt"]) == (2, 1)
    assert row["result"] == {"token": 2}
    events = journal(dsn, job_id)
    names = [(e, t) for e, t, _ in events]
    # Token 1 was killed because of the cancel, and its owner said so before the retry.
    assert ("child_killed", 1) in names
    kill = next(d for e, t, d in events if (e, t) == ("child_killed", 1))
    assert kill["reason"] == "cancelled" and kill["survivors"] == 0
    assert names.index(("cancel_acknowledged", 1)) < names.index(("job_retried", 1))
    assert names.index(("job_retried", 1)) < names.index(("job_claimed", 2))
    assert ("job_succeeded", 2) in names
    assert not any(e == "job_failed" for e, _ in names)
    sc.wait_event("heartbeat_lost", fencing_token=1, job_id=job_id)


def test_claim_of_a_job_still_supervised_here_first_ends_the_old_attempt(
        dsn, sidecars, tmp_path):
    """Case F14: the job is requeued at once after a cancel (an operator's SQL or an older
    release's retry, so nothing waits for the acknowledgement) and this same sidecar
    claims it again (token 2) while token 1's tree still runs. The claim marks token 1's
    lease lost, its tree is killed and journaled (``attempt_superseded``, ``child_killed``)
    before token 2's tool starts; token 2's lease is renewed (it survives several
    heartbeats after token 1 ended) and its result is committed."""
    log_path, endfile = tmp_path / "probe.log", tmp_path / "end"
    sc = sidecars(dsn, [PROBE], "--concurrency", "2",
                  env=base_env(dsn, **SLOW_HEARTBEAT, SIDECAR_LOG_LEVEL="debug"))
    job_id = enqueue(dsn, PROBE, {"log": str(log_path), "endfile": str(endfile),
                                  "max_wait": 60})
    with TreeWatch(job_id) as watch:
        wait_until(lambda: started_tokens(log_path) == [1], 20, what="token 1 started")
        # Right after a renewal, the next one is H = 2 s away: the cancel and the requeue
        # (one transaction) land well inside that heartbeat.
        sc.wait_event("heartbeat_ok", job_id=job_id)
        run(_cancel_and_requeue(dsn, uuid.UUID(job_id)))
        wait_until(lambda: 2 in started_tokens(log_path), 20, what="token 2 started")
        superseded = sc.wait_event("attempt_superseded", job_id=job_id)
        assert (superseded["fencing_token"], superseded["new_fencing_token"]) == (1, 2)
        time.sleep(3 * 2 + 0.5)  # three heartbeats: token 2's lease must be renewed
        row = job_row(dsn, job_id)
        assert (row["state"], row["fencing_token"]) == ("running", 2)
        (endfile.parent / f"{endfile.name}.2").touch()
        wait_until(lambda: job_row(dsn, job_id)["state"] == "succeeded", 20,
                   what="token 2's result committed")
    assert watch.overlaps == [], watch.overlaps
    assert started_tokens(log_path) == [1, 2]
    names = [(e, t) for e, t, _ in journal(dsn, job_id)]
    assert ("attempt_superseded", 1) in names and ("child_killed", 1) in names
    assert names.index(("child_killed", 1)) < names.index(("tool_request_started", 2))
    assert ("job_succeeded", 2) in names
    assert scalar(dsn, "SELECT attempt FROM tool_jobs WHERE id = $1", uuid.UUID(job_id)) == 1
    assert not [e for e in sc.events("heartbeat_lost") if e.get("fencing_token") == 2]


async def _cancel_and_requeue(dsn: str, job_id: uuid.UUID) -> None:
    """The operator's cancel (the CLI's own statement) and an immediate requeue, in one
    transaction of a few milliseconds."""
    conn = await asyncpg.connect(dsn)
    try:
        await init_connection(conn)
        async with conn.transaction():
            assert await conn.fetch(Q["cancel_job"], job_id, None, None)
            assert await conn.fetch(REQUEUE_AT_ONCE, job_id)
    finally:
        await conn.close()


# --- the property: random interleavings of two attempts of one job ------------------------

TAKEOVER = """
UPDATE tool_jobs SET owner_id = 'usurper', fencing_token = fencing_token + 1,
    attempt = attempt + 1, lease_until = now() + interval '60 seconds'
WHERE id = $1 AND state = 'running'
RETURNING fencing_token
"""
# The usurper dies: its lease ends now, so the sidecar may claim the job back.
USURPER_DIES = """
UPDATE tool_jobs SET lease_until = now() - interval '1 millisecond'
WHERE id = $1 AND state = 'running' AND owner_id = 'usurper'
"""


@pytest.mark.parametrize("seed", [14, 1414, 141414])
def test_random_interleavings_never_run_two_trees_of_one_job(dsn, sidecars, tmp_path, seed):
    """Case F14, as a property: claim, cancel, retry (at once or through `sidecar retry`),
    takeover by another owner, and the tool's own end, interleaved at random for one job
    in one sidecar at --concurrency 2. At every sample at most one tree of the job is
    alive, and the job always reaches a clean end: a final retry ends it succeeded, never
    max_attempts_exceeded."""
    rng = random.Random(seed)
    log_path, endfile = tmp_path / "probe.log", tmp_path / "end"
    env = base_env(dsn, SIDECAR_LEASE_SECONDS="6", SIDECAR_HEARTBEAT_SECONDS="1",
                   SIDECAR_JITTER_SECONDS="1")
    sc = sidecars(dsn, [PROBE], "--concurrency", "2", env=env)
    job_id = enqueue(dsn, PROBE, {"log": str(log_path), "endfile": str(endfile),
                                  "max_wait": 60}, "--max-attempts", "20")
    key = uuid.UUID(job_id)
    done_ops = []
    with TreeWatch(job_id) as watch:
        wait_until(lambda: started_tokens(log_path), 20, what="the first attempt")
        for _ in range(8):
            op = rng.choice(["cancel_requeue", "cancel_retry", "takeover", "end", "wait"])
            done_ops.append(op)
            state = job_row(dsn, job_id)["state"]
            if op == "cancel_requeue" and state in ("queued", "running"):
                cli(dsn, "cancel", job_id)
                query(dsn, REQUEUE_AT_ONCE, key)
            elif op == "cancel_retry" and state in ("queued", "running"):
                cli(dsn, "cancel", job_id)
                assert cli(dsn, "retry", job_id).returncode == 0
            elif op == "takeover" and state == "running":
                query(dsn, TAKEOVER, key)
                time.sleep(rng.uniform(0.0, 1.5))
                query(dsn, USURPER_DIES, key)
            elif op == "end":
                token = job_row(dsn, job_id)["fencing_token"]
                (endfile.parent / f"{endfile.name}.{token}").touch()
                time.sleep(0.3)
                if job_row(dsn, job_id)["state"] in ("succeeded", "failed"):
                    query(dsn, REQUEUE_AT_ONCE.replace("state = 'cancelled'",
                                                       "state IN ('succeeded', 'failed')"), key)
            time.sleep(rng.uniform(0.0, 1.2))
        # The end: whatever state it is in, it runs once more to success.
        state = job_row(dsn, job_id)["state"]
        if state in ("succeeded", "failed", "cancelled"):
            query(dsn, REQUEUE_AT_ONCE.replace("state = 'cancelled'",
                                               "state IN ('succeeded', 'failed', 'cancelled')"),
                  key)
        (endfile.parent / f"{endfile.name}.all").touch()
        wait_until(lambda: job_row(dsn, job_id)["state"] in ("succeeded", "failed"), 40,
                   what=f"the job's end after {done_ops}")
        wait_until(lambda: not job_processes(job_id), 10, what="no tree left")
    assert watch.overlaps == [], (done_ops, watch.overlaps)
    row = job_row(dsn, job_id)
    assert row["state"] == "succeeded", (done_ops, row["error"])
    assert not [e for e in sc.events("supervisor_error")]
