"""A cancel is pushed to the owner (issue 41, point 12): every path that cancels a running
job (``sidecar cancel JOB``, ``cancel --tag``, ``pause --cancel-running``; the web view,
MCP and sidecar.client share the same SQL function) NOTIFYs the owning sidecar on its
cancel channel, which renews at once, gets zero rows and kills the tree, instead of
waiting for its next heartbeat. A sidecar that cannot LISTEN (behind a transaction
pooler without a listen URL, or while its LISTEN connection is down) checks about every
second whether a job it runs was cancelled, with the same end. The heartbeat stays the
fallback.

The sidecar here heartbeats every 20 s under a 60 s lease: the test asserts the order on
the database's clock (P3), that the owner confirmed the tree dead (``cancel_acknowledged``)
before its first heartbeat after the claim was due, not a speed."""

from __future__ import annotations

import contextlib
import os
import signal

import orjson
import pytest

from kit import base_env, cli, enqueue, journal_rows, pid_alive, read_pids, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.server]

HEARTBEAT = 20.0
LONG_HEARTBEAT = {"SIDECAR_HEARTBEAT_SECONDS": str(HEARTBEAT), "SIDECAR_LEASE_SECONDS": "60"}
HANG = "hang_tree.py"


# How the owner hears of the cancel: its NOTIFY (a LISTEN session on the server); or,
# with no LISTEN at all (SIDECAR_DATABASE_POOLER=transaction without
# SIDECAR_LISTEN_DATABASE_URL: the mode alone turns LISTEN off, even on the plain server)
# or with its LISTEN connection down (a listen URL nobody answers on), its own check
# about every second (issue 41 point 12).
NO_LISTEN = {"SIDECAR_DATABASE_POOLER": "transaction"}
LISTEN_DOWN = {"SIDECAR_LISTEN_DATABASE_URL": "postgresql://app:pw@127.0.0.1:1/nope"}
HEARD = {"notify": ({}, "listen_started", "notify"),
         "no-listen": (NO_LISTEN, "listen_disabled", "check"),
         "listen-down": (LISTEN_DOWN, "listen_lost", "check")}


@pytest.mark.parametrize(("how", "heard"), [
    ("cancel", "notify"), ("cancel --tag", "notify"), ("pause --cancel-running", "notify"),
    ("cancel", "no-listen"), ("pause --cancel-running", "no-listen"),
    ("cancel", "listen-down")])
def test_a_cancel_kills_the_tree_before_the_next_heartbeat(dsn, sidecars, tmp_path, how,
                                                            heard):
    pidfile = tmp_path / "pids"
    extra, listen_event, via = HEARD[heard]
    sc = sidecars(dsn, [HANG], env=base_env(dsn, **LONG_HEARTBEAT, **extra))
    sc.wait_event(listen_event)
    job_id = enqueue(dsn, HANG, {"pidfile": str(pidfile), "tree": True}, "--tag", "run=push")
    pids = read_pids(pidfile, 4)
    try:
        sc.wait_event("tool_request_started", job_id=job_id)
        args = {"cancel": ["cancel", job_id],
                "cancel --tag": ["cancel", "--tag", "run=push"],
                "pause --cancel-running": ["pause", HANG, "--cancel-running"]}[how]
        done = cli(dsn, *args)
        assert done.returncode == 0, done.stderr.decode()
        said = orjson.loads(done.stdout)
        # The caller is told when the kill is expected, and the bound it has.
        assert "within about 1 s" in said["tree_kill"], said
        assert "at the latest" in said["tree_kill"], said
        wait_until(lambda: not any(pid_alive(p) for p in pids), 2 * HEARTBEAT + 20,
                   what="the cancelled tree to die")
        wait_until(lambda: journal_rows(dsn, job_id, "cancel_acknowledged"), 2 * HEARTBEAT,
                   what="the owner's acknowledgement")
    finally:
        for pid in pids:  # test hygiene: never leave a hung tool behind a failed assertion
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    [claimed] = journal_rows(dsn, job_id, "job_claimed")
    [acknowledged] = journal_rows(dsn, job_id, "cancel_acknowledged")
    since_claim = (acknowledged["at"] - claimed["at"]).total_seconds()
    assert since_claim < HEARTBEAT, (
        f"the tree was confirmed dead {since_claim:.1f} s after the claim: at the heartbeat "
        f"(due {HEARTBEAT:g} s after it), not on the owner's notification")
    cancel_heard = sc.events("cancel_heard")[0]
    assert (cancel_heard["job_id"], cancel_heard["via"]) == (job_id, via)
    [lost] = journal_rows(dsn, job_id, "heartbeat_lost")
    assert lost["details"]["state"] == "cancelled"


def test_a_cancel_of_a_queued_job_says_nothing_about_a_tree(dsn):
    job_id = enqueue(dsn, HANG, {})
    done = cli(dsn, "cancel", job_id)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout) == {"id": job_id, "cancelled": True,
                                         "previous_state": "queued"}
