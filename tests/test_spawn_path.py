"""The job path's spawn and journal (issue 14): a tool that needs nothing set between fork
and exec is started by vfork and moved into its job cgroup by the sidecar, every process it
forked before the move with it; an attempt's journal rows travel with the statement that
ends it, or are written on their own while it still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kit import TOOLS, base_env, enqueue, journal_details, query, short_root, wait_until
from sidecar.worker import linux
from sidecar.worker.cgroups import JobCgroup, detect

pytestmark = pytest.mark.e2e

ROOT = os.geteuid() == 0
SRC = TOOLS.parent.parent  # the checkout: the tool imports sidecar.worker.linux from it


def _env(dsn, tmp_path, **extra):
    return base_env(dsn, SIDECAR_WORK_DIR=str(short_root(tmp_path / "work")), **extra)


def _events(dsn, job):
    return query(dsn, "SELECT event, at, xmin::text::bigint AS xid FROM tool_job_events "
                      "WHERE job_id = $1 ORDER BY id", job)


def test_a_short_attempts_journal_rows_are_written_by_its_final_statement(dsn, sidecars,
                                                                          tmp_path):
    job = enqueue(dsn, "quick", {})
    sc = sidecars(dsn, [sys.executable, "-c", "print('{\"ok\": true}')"], "--tool", "quick",
                  "--drain", env=_env(dsn, tmp_path))
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    rows = _events(dsn, job)
    assert [r["event"] for r in rows] == [
        "job_enqueued", "job_claimed", "tool_request_started", "job_succeeded"], rows
    started, succeeded = rows[2], rows[3]
    assert started["xid"] == succeeded["xid"]  # one transaction: the finish statement
    assert rows[1]["at"] <= started["at"] <= succeeded["at"]


def test_a_long_attempts_start_is_journaled_while_it_runs(dsn, sidecars, tmp_path):
    job = enqueue(dsn, "slow", {})
    sc = sidecars(dsn, [sys.executable, "-c",
                        "import time; time.sleep(4); print('{\"ok\": true}')"],
                  "--tool", "slow", "--drain", env=_env(dsn, tmp_path))
    sc.wait_event("tool_request_started", job_id=job)
    seen = wait_until(lambda: [r for r in _events(dsn, job)
                               if r["event"] == "tool_request_started"], timeout=3.0,
                      what="tool_request_started in the journal")
    assert query(dsn, "SELECT state FROM tool_jobs WHERE id = $1", job)[0]["state"] == "running"
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    rows = _events(dsn, job)
    assert [r["event"] for r in rows] == [
        "job_enqueued", "job_claimed", "tool_request_started", "job_succeeded"], rows
    assert rows[2]["xid"] == seen[0]["xid"] != rows[3]["xid"]  # written once, on its own


def _cgroup_v2_host():
    host = detect("auto") if ROOT else None
    if host is None or not host.v2_dir:
        return None
    return host


def test_a_scan_reaps_the_exited_orphans_it_lists_and_keeps_the_rest():
    """A tree scan reaps the exited children it lists (ProcessTable.reap_listed) instead of
    reading each from /proc until the periodic reaper comes; a running child, a managed
    tool's pid and an exempt pid are returned untouched, and while a spawn holds the reap
    lock (case F9) nothing is reaped at all."""
    from sidecar.worker.child import ProcessTable

    table = ProcessTable(subreaper=True)
    exited = subprocess.Popen(["/bin/true"])
    managed = subprocess.Popen(["/bin/true"])
    running = subprocess.Popen(["/bin/sleep", "60"])
    try:
        table.manage(managed.pid)
        for proc in (exited, managed):
            wait_until(lambda p=proc: linux.is_zombie(p.pid), what=f"{proc.pid} exited")
        listed = [exited.pid, managed.pid, running.pid]
        with table.reap_lock:  # a spawn in progress: nothing is reaped meanwhile
            assert table.reap_listed(listed) == listed
        assert linux.is_zombie(exited.pid)
        assert table.reap_listed(listed) == [managed.pid, running.pid]
        assert not os.path.exists(f"/proc/{exited.pid}")  # its status is collected
        assert linux.is_zombie(managed.pid)  # the tool's status is left to its owner
        assert managed.wait(5) == 0
        assert table.reap_listed([exited.pid]) == []  # no child of ours any more
    finally:
        exited.returncode = 0  # collected above: Popen must not wait on the pid again
        running.kill()
        running.wait(5)
        managed.wait(5)


def test_an_orphan_goes_to_the_subreapers_leader_thread_not_the_thread_that_forked():
    """find_tree reads adopted orphans from the sidecar's leader thread only (one read,
    not one per thread; linux.adopted_pids). That rests on the kernel's rule: an orphan
    goes to the first live thread of its subreaper, the leader, whichever thread forked
    its ancestor (the spawn thread forks every tool). Checked here on this kernel, in a
    real multi-threaded subreaper process of its own."""
    done = subprocess.run([sys.executable, str(TOOLS / "orphan_to_leader.py"), str(SRC)],
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    seen = json.loads(done.stdout)
    assert seen["grandchild"] in seen["leader"], seen
    assert seen["grandchild"] not in seen["thread"], seen
    assert seen["grandchild"] in seen["adopted_pids"], seen


@pytest.mark.skipif(not ROOT, reason="making a job cgroup needs root")
def test_join_tree_moves_the_tool_and_everything_it_forked_before_the_move():
    host = _cgroup_v2_host()
    assert host is not None, "root on this host has no cgroup v2 directory for job cgroups"
    cgroup = JobCgroup(host, f"join-test-{os.getpid()}", 0, 0)
    cgroup.create()
    # A tree that already has a child, a grandchild and a double-forked one: what a tool
    # may fork in the moment between its exec and the sidecar's move.
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & (sleep 30 &) ; sh -c 'sleep 30' & wait"],
                            start_new_session=True)
    try:
        wait_until(lambda: len(linux.descendant_pids(tree.pid)) >= 3, timeout=5,
                   what="the tree's descendants")
        before = {tree.pid, *linux.descendant_pids(tree.pid)}
        assert not before & cgroup.members()
        cgroup.join_tree(tree.pid, linux.descendant_pids)
        members = cgroup.members()
        assert {tree.pid, *linux.descendant_pids(tree.pid)} <= members, (before, members)
    finally:
        cgroup.kill()
        tree.wait(10)
        time.sleep(0.1)
        assert cgroup.remove() == []


@pytest.mark.skipif(not ROOT, reason="per-job cgroups need root")
def test_a_default_profile_tool_runs_in_its_job_cgroup_with_what_it_forks(dsn, sidecars,
                                                                         tmp_path):
    assert _cgroup_v2_host() is not None, "root on this host has no cgroup v2 directory"
    script = ("sleep 5 & a=$!; sleep 5 & b=$!; sleep 0.3; "
              "printf '{\"self\": \"%s\", \"a\": \"%s\", \"b\": \"%s\"}\\n' "
              "\"$(grep '^0::' /proc/$$/cgroup)\" \"$(grep '^0::' /proc/$a/cgroup)\" "
              "\"$(grep '^0::' /proc/$b/cgroup)\"; kill $a $b")
    job = enqueue(dsn, "forker", {})
    sc = sidecars(dsn, ["/bin/sh", "-c", script], "--tool", "forker", "--drain",
                  env=_env(dsn, tmp_path))
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    [row] = query(dsn, "SELECT state, result FROM tool_jobs WHERE id = $1", job)
    assert row["state"] == "succeeded", row
    seen = set(row["result"].values())
    started = journal_details(dsn, job, "tool_request_started")[0]
    assert len(seen) == 1 and "sidecar-jobs/" + started["cgroup"] in seen.pop(), row["result"]
